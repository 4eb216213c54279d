package pgcoord

// Checking a fence: inside a transaction of the application's, before a
// write that a fence guards.

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/pgcoord/pgcoord/internal/xactsql"
)

// CheckFence verifies, inside tx, that fence is still the newest fence
// issued for key, and keeps it so until tx ends. Call it in the transaction
// that writes the data the lock protects, before committing:
//
//	tx, err := pool.Begin(ctx)
//	...
//	if err := pgcoord.CheckFence(ctx, tx, key, l.Fence()); err != nil {
//		return err // do not write: errors.Is(err, pgcoord.ErrStaleFence) means another holder exists
//	}
//	// write, then commit
//
// CheckFence reads the key's row in the fences table with SELECT ... FOR
// SHARE. The row stays share-locked until tx commits or rolls back, and
// issuing a new fence updates that row, so no newer fence can be issued
// (a new holder's Lock with [WithFence] waits) while tx is open. Hence a
// write committed in tx after a nil CheckFence can never interleave with a
// newer holder's writes: the newer holder gets its fence only after tx has
// ended. A holder paused inside tx (a stopped process, a long GC pause)
// holds the row as long, and the next holder's fence waits: set
// idle_in_transaction_session_timeout for the role the application's pool
// uses, so that the server ends such a transaction.
//
// It returns nil when the stored fence equals fence. It returns an error
// wrapping [ErrStaleFence], naming both fences, when a newer fence has been
// issued. It also wraps ErrStaleFence when fence was never issued for key
// (it is greater than the newest stored fence, or no fence exists for key):
// that happens with a wrong key, schema or database, or when a database
// failover lost recently issued fences, and in every case the write must not
// happen and retrying cannot make it safe. Other errors: [ErrInvalidKey] for
// an invalid key, a plain error for a nil tx (a nil *pgxpool.Tx included), a
// nil ctx or fence <= 0 (fences start at 1), [ErrNotMigrated] when the
// fences table does not exist in the schema, and the server's error,
// wrapped, when the query fails. After any error, roll tx back. Every error
// reads "pgcoord: check fence <key>: <cause>", for instance "pgcoord: check
// fence int64:7: stale fence: a newer holder exists (fence 5, latest 6)".
//
// Under REPEATABLE READ or SERIALIZABLE, tx reads the fences table as of its
// snapshot, taken by its first statement. A fence issued after that, over an
// older one tx can see, makes the server report a serialization failure
// (SQLSTATE 40001) on the read. The key's first fence, issued after the
// snapshot, leaves tx nothing to read: CheckFence then cannot tell it from a
// fence never issued, and returns an error that does not wrap ErrStaleFence
// but wraps a *pgconn.PgError with Code "40001", which pgcoord builds (the
// server reports nothing), so that code that retries serialization failures
// (errors.As with *pgconn.PgError, or an error with a SQLState method)
// retries this one too: a retry in a new transaction whose snapshot is
// taken after the fence was issued sees it and decides. A fence that was
// never issued for the key keeps failing this way under these levels;
// READ COMMITTED, where each statement sees every committed fence, reports
// it as ErrStaleFence (never issued). TestCheckFenceFirstFenceAfterSnapshot
// checks both levels.
//
// In a READ ONLY transaction CheckFence always fails (SQLSTATE 25006: the
// row lock it takes is refused there); check fences in a transaction that
// may write, which is the one that writes under the fence anyway. If ctx
// ends during the query, the error wraps ctx's error too.
//
// ctx governs the query, including the wait for a new fence being issued at
// the same moment. Options: only [WithSchema] applies; pass the schema given
// to [Migrate] and the Client.
//
// Limits. Fences protect writes to data in the same database, checked in the
// same transaction. For an external resource (a file store, another
// database, an API), pass the fence along with each write and have the
// resource reject fences lower than the highest it has seen. With
// asynchronous replication, a failover to a standby can lose the most
// recently issued fences (and the writes made under them), so a fence can
// be issued twice. Setting synchronous_standby_names on the primary, and
// failing over only to a standby named there, removes that window: a fence
// is always committed with synchronous_commit = on (or remote_apply, when
// that is the setting in effect), even where the server, database or role
// turns it off, so its commit waits for that standby. For the same reason a
// crash of the server itself never loses an issued fence, unless fsync is
// off and the operating system crashes too.
func CheckFence(ctx context.Context, tx pgx.Tx, key Key, fence Term, opts ...FenceOption) error {
	c, err := newFenceConfig(opts)
	if err != nil {
		return core.Errorf("check fence %s: %w", core.KeyList([]core.Key{key.coreKey()}), err)
	}
	return checkFencePgx(ctx, c, tx, key.coreKey(), fence)
}

// CheckFence is [CheckFence] in the Client's schema ([WithSchema]): it
// returns nil if fence is the newest fence issued for key, inside tx, and
// keeps the fence's row share-locked until tx ends. ctx bounds the query;
// the errors are those of [CheckFence], and one wrapping [ErrClosed] after
// Close.
func (c *Client) CheckFence(ctx context.Context, tx pgx.Tx, key Key, fence Term) error {
	if ctx == nil {
		return core.Errorf("check fence %s: ctx is nil", key)
	}
	if err := c.engine().RefuseClosed(); err != nil {
		return core.Errorf("check fence %s: %w", key, err)
	}
	return checkFencePgx(ctx, c.engine().Cfg, tx, key.coreKey(), fence)
}

func checkFencePgx(ctx context.Context, c *core.Config, tx pgx.Tx, key core.Key, fence Term) error {
	if isNil(tx) {
		return core.Errorf("check fence %s: nil pgx.Tx", core.KeyList([]core.Key{key}))
	}
	return checkFence(ctx, c, pgxTx{tx: tx}, key, fence)
}

// fenceSnapshotSQLState is the SQLSTATE of the error CheckFence builds when
// no fence for the key is visible to a REPEATABLE READ or SERIALIZABLE
// transaction's snapshot: serialization_failure, the code the server gives
// when a fence was issued after the snapshot over an older visible one.
const fenceSnapshotSQLState = "40001"

// checkFence runs CheckFence on tx, for pgx and for package pgcoordsql.
func checkFence(ctx context.Context, c *core.Config, tx xactsql.Tx, key core.Key, fence Term) error {
	op := "check fence " + core.KeyList([]core.Key{key}) // and its subject, as errors name them
	if ctx == nil {
		return core.Errorf("%s: ctx is nil", op)
	}
	if err := key.Check(); err != nil {
		return core.Errorf("%s: %w", op, err)
	}
	if fence <= 0 {
		return core.Errorf("%s: fence %d is not a fence (fences start at 1; was the lock taken with WithFence?)", op, fence)
	}
	space, k := core.FenceRow(key)
	var stored Term
	err := tx.QueryRow(ctx, "SELECT fence FROM "+c.Table("fences")+" WHERE key_space = $1 AND key = $2 FOR SHARE", []any{space, k}, &stored)
	switch {
	case errors.Is(err, xactsql.ErrNoRows):
		// Under REPEATABLE READ or SERIALIZABLE the row may exist but be
		// invisible to tx's snapshot: the key's first fence was issued after
		// the snapshot was taken. Nothing then conflicts with the read, so
		// the server reports no serialization failure; report one.
		var iso string
		if err := tx.QueryRow(ctx, "SELECT current_setting('transaction_isolation')", nil, &iso); err != nil {
			return core.PgError(op, core.WithCtxErr(ctx, err))
		}
		if iso == "repeatable read" || iso == "serializable" {
			return core.Errorf("%s: fence %d cannot be checked in this transaction: %w", op, fence, &pgconn.PgError{
				Severity: "ERROR",
				Code:     fenceSnapshotSQLState,
				Message: fmt.Sprintf("could not serialize access: no fence for the key in schema %s is visible to the snapshot of this %s transaction, and it may have been issued after the snapshot was taken (reported by pgcoord, not the server)",
					c.QuotedSchema(), strings.ToUpper(iso)),
				Hint: "retry in a new transaction, or check the fence under READ COMMITTED",
			})
		}
		return core.Errorf("%s: %w: fence %d was never issued: no fence exists for the key in schema %s", op, ErrStaleFence, fence, c.QuotedSchema())
	case err != nil:
		return core.NotMigrated(c, op, core.WithCtxErr(ctx, err))
	case stored > fence:
		return core.Errorf("%s: %w: a newer holder exists (fence %d, latest %d)", op, ErrStaleFence, fence, stored)
	case stored < fence:
		return core.Errorf("%s: %w: fence %d was never issued (latest %d)", op, ErrStaleFence, fence, stored)
	}
	return nil
}
