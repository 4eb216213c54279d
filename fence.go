package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/pgcoord/pgcoord/internal/xactsql"
)

// Fences
//
// A fence is a number from the fences table, one row per key, issued
// strictly increasing and committed durably before it is handed out; a
// write checks it with CheckFence in its own transaction, which refuses a
// fence lower than the key's latest. Session.issueFence issues a lock's
// fence on the lock's backend when it can, and otherwise away from it
// (blockAway), so that no backend that holds keys waits for a row.

// fenceRow returns the fences table's key_space and key for k: objsubid and
// (classid << 32) | objid, exactly as k appears in pg_locks.
func fenceRow(k Key) (space int16, key int64) {
	classid, objid, objsubid := k.lockColumns()
	return objsubid, int64(uint64(classid)<<32 | uint64(objid))
}

// issueFenceSQL issues the next fence of the fence row ($1, $2) (see
// fenceRow): 1 the first time, then one more than the last fence issued
// for the key, and returns it. Outside a transaction, the new fence is
// committed when the statement returns. The statement waits while a
// transaction that called CheckFence on the key is open; if lockTimeout is
// not 0, it is the number of a parameter that sets lock_timeout for that
// wait (milliseconds, as text, for the statement's transaction only).
//
// The commit waits until the fence is flushed to the WAL, whatever
// synchronous_commit the server, database, role or session sets: with it
// off, a crash could lose a fence that was already returned, so the same
// fence would be issued again and a paused holder of it would pass
// CheckFence. The statement itself sets synchronous_commit to on for the
// transaction it runs in (set_config with is_local, evaluated in the
// INSERT's FROM subquery, before the row is written or waited for), so this
// costs no extra round trip; remote_apply, which also waits for the flush,
// is kept. In an explicit transaction, the setting lasts until that
// transaction ends.
//
// With a synchronous standby, the commit also waits for the standby. A
// cancel that lands during that wait (a slice's end, a caller's ctx, a
// pg_cancel_backend) leaves the fence committed on the primary only, with
// a warning and no error; so the Client runs this statement only as a
// token statement (blockingStatement.durable), which withholds such a
// fence and issues another.
//
// If holder is not 0, it is the number of a parameter with a backend's
// pid: the statement then issues the fence only if that backend holds the
// key exclusively (in pg_locks) when the statement starts, and returns no
// row otherwise. A fence issued on another backend than the lock's must
// check this, or a backend lost meanwhile would get a fence newer than
// its successor's.
//
// If nowait is true, the statement first locks the key's row with FOR
// UPDATE NOWAIT: when a transaction holds the row (it checked the key's
// fence and is still open), the statement fails at once with SQLSTATE
// 55P03 and never joins the row's queue of waiters. A backend that holds
// other goroutines' locks issues fences so (see Client.blockAway): a wait
// there, however short, would let the open transaction's deadlock check
// find a cycle through that backend if the transaction waited for one of
// its keys, a cycle the application does not have.
//
// If floor is not empty, it names a one-row relation of the statement
// (a CTE) whose column floor holds a fence the new one must exceed,
// besides the key's last (NULL for none): an election passes the term in
// its leaders row, so that its terms keep growing even where the fences
// row of its key is older than the leaders row (a key that changed, a
// fences table restored from an older backup).
func issueFenceSQL(c *config, lockTimeout, holder int, floor string, nowait bool) string {
	timeout, held, probe := "", "", ""
	if lockTimeout != 0 {
		timeout = fmt.Sprintf(", set_config('lock_timeout', $%d, true)", lockTimeout)
	}
	if nowait {
		// Evaluated with the INSERT's source, before the row is written
		// or waited for; the lock is the transaction's, so the upsert
		// below does not wait for it.
		probe = `, (SELECT count(*) FROM (SELECT FROM ` + c.table("fences") + ` AS r
			WHERE r.key_space = $1 AND r.key = $2 FOR UPDATE NOWAIT) AS r) AS probe`
	}
	if holder != 0 {
		held = fmt.Sprintf(`
		WHERE EXISTS (SELECT FROM pg_catalog.pg_locks l WHERE l.locktype = 'advisory' AND l.pid = $%d
			AND l.granted AND l.mode = 'ExclusiveLock' AND l.objsubid = $1 AND ((l.classid::int8 << 32) | l.objid::int8) = $2
			AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database()))`, holder)
	}
	first, from, next := "1", "", "f.fence + 1"
	if floor != "" {
		first, from, next = "coalesce("+floor+".floor, 0) + 1", ", "+floor, "GREATEST(f.fence + 1, EXCLUDED.fence)"
	}
	return "INSERT INTO " + c.table("fences") + ` AS f (key_space, key, fence)
		SELECT $1, $2, ` + first + ` FROM (SELECT set_config('synchronous_commit',
			CASE current_setting('synchronous_commit') WHEN 'remote_apply' THEN 'remote_apply' ELSE 'on' END,
			true)` + timeout + `) AS durable` + probe + from + held + `
		ON CONFLICT (key_space, key) DO UPDATE SET fence = ` + next + `
		RETURNING f.fence`
}

// nextFence issues the next fence for k with one statement on q (see
// issueFenceSQL). It returns an error wrapping ErrNotMigrated when the
// fences table does not exist in the configured schema. It runs the
// statement once, as it is: it cannot see a warning that a wait for a
// synchronous standby was cancelled, so it serves transactions (whose
// commit is their owner's) and tests; the Client's fences and terms go
// through Session.block, which withholds such a fence.
func nextFence(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, c *config, k Key) (int64, error) {
	if err := k.check(); err != nil {
		return 0, err
	}
	space, key := fenceRow(k)
	var fence int64
	err := q.QueryRow(ctx, issueFenceSQL(c, 0, 0, "", false), space, key).Scan(&fence)
	if err != nil {
		return 0, notMigrated(c, "issue fence for key "+k.String(), err)
	}
	return fence, nil
}

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
		return errorf("check fence %s: %w", keyList([]Key{key}), err)
	}
	return checkFencePgx(ctx, c, tx, key, fence)
}

// CheckFence is [CheckFence] in the Client's schema ([WithSchema]): it
// returns nil if fence is the newest fence issued for key, inside tx, and
// keeps the fence's row share-locked until tx ends. ctx bounds the query;
// the errors are those of [CheckFence], and one wrapping [ErrClosed] after
// Close.
func (c *Client) CheckFence(ctx context.Context, tx pgx.Tx, key Key, fence Term) error {
	if ctx == nil {
		return errorf("check fence %s: ctx is nil", key)
	}
	if err := c.refuseClosed(); err != nil {
		return errorf("check fence %s: %w", key, err)
	}
	return checkFencePgx(ctx, c.cfg, tx, key, fence)
}

func checkFencePgx(ctx context.Context, c *config, tx pgx.Tx, key Key, fence Term) error {
	if isNil(tx) {
		return errorf("check fence %s: nil pgx.Tx", keyList([]Key{key}))
	}
	return checkFence(ctx, c, pgxTx{tx: tx}, key, fence)
}

// fenceSnapshotSQLState is the SQLSTATE of the error CheckFence builds when
// no fence for the key is visible to a REPEATABLE READ or SERIALIZABLE
// transaction's snapshot: serialization_failure, the code the server gives
// when a fence was issued after the snapshot over an older visible one.
const fenceSnapshotSQLState = "40001"

// checkFence runs CheckFence on tx, for pgx and for package pgcoordsql.
func checkFence(ctx context.Context, c *config, tx xactsql.Tx, key Key, fence Term) error {
	op := "check fence " + keyList([]Key{key}) // and its subject, as errors name them
	if ctx == nil {
		return errorf("%s: ctx is nil", op)
	}
	if err := key.check(); err != nil {
		return errorf("%s: %w", op, err)
	}
	if fence <= 0 {
		return errorf("%s: fence %d is not a fence (fences start at 1; was the lock taken with WithFence?)", op, fence)
	}
	space, k := fenceRow(key)
	var stored Term
	err := tx.QueryRow(ctx, "SELECT fence FROM "+c.table("fences")+" WHERE key_space = $1 AND key = $2 FOR SHARE", []any{space, k}, &stored)
	switch {
	case errors.Is(err, xactsql.ErrNoRows):
		// Under REPEATABLE READ or SERIALIZABLE the row may exist but be
		// invisible to tx's snapshot: the key's first fence was issued after
		// the snapshot was taken. Nothing then conflicts with the read, so
		// the server reports no serialization failure; report one.
		var iso string
		if err := tx.QueryRow(ctx, "SELECT current_setting('transaction_isolation')", nil, &iso); err != nil {
			return pgError(op, withCtxErr(ctx, err))
		}
		if iso == "repeatable read" || iso == "serializable" {
			return errorf("%s: fence %d cannot be checked in this transaction: %w", op, fence, &pgconn.PgError{
				Severity: "ERROR",
				Code:     fenceSnapshotSQLState,
				Message: fmt.Sprintf("could not serialize access: no fence for the key in schema %s is visible to the snapshot of this %s transaction, and it may have been issued after the snapshot was taken (reported by pgcoord, not the server)",
					c.quotedSchema(), strings.ToUpper(iso)),
				Hint: "retry in a new transaction, or check the fence under READ COMMITTED",
			})
		}
		return errorf("%s: %w: fence %d was never issued: no fence exists for the key in schema %s", op, ErrStaleFence, fence, c.quotedSchema())
	case err != nil:
		return notMigrated(c, op, withCtxErr(ctx, err))
	case stored > fence:
		return errorf("%s: %w: a newer holder exists (fence %d, latest %d)", op, ErrStaleFence, fence, stored)
	case stored < fence:
		return errorf("%s: %w: fence %d was never issued (latest %d)", op, ErrStaleFence, fence, stored)
	}
	return nil
}

// notMigrated wraps err with ErrNotMigrated, naming the schema, when the
// server reports that pgcoord's table or schema does not exist (SQLSTATE
// 42P01 or 3F000), and maps it with pgError otherwise.
func notMigrated(c *config, op string, err error) error {
	if code := sqlState(err); code == "42P01" || code == "3F000" || code == "42703" {
		return errorf("%s: %w (schema %s): %w", op, ErrNotMigrated, c.quotedSchema(), err)
	}
	return pgError(op, err)
}

// withCtxErr adds ctx's error to err, a statement's error, when ctx ended
// and err does not say so already: a statement cut short by a cancel
// request reports the server's 57014 alone, and a driver that closed the
// connection its own way ("bad connection"), so that errors.Is with
// context.Canceled or context.DeadlineExceeded holds, and with the cause
// given to ctx's cancel. The cause comes first in the message; a statement
// that the server cancelled because ctx ended (57014) is not shown, only
// kept reachable with errors.As, as in every error of pgcoord whose wait
// ctx ended.
func withCtxErr(ctx context.Context, err error) error {
	cerr := ctx.Err()
	if cerr == nil {
		return err
	}
	switch cause := context.Cause(ctx); {
	case sqlState(err) == "57014":
		// The statement was cancelled because ctx ended: report ctx's end
		// alone, as doc.go says, and keep the server's error reachable.
		msg := cause.Error()
		if cause != cerr {
			msg += " (" + cerr.Error() + ")"
		}
		return &coordError{msg: prefix + strings.TrimPrefix(msg, prefix), wrapped: fmt.Errorf("%w%w%w", cause, cerr, err)}
	case errors.Is(err, cause) && errors.Is(err, cerr):
		return err
	case errors.Is(err, cause):
		return errorf("%w (%w)", err, cerr)
	case errors.Is(err, cerr) || errors.Is(cause, cerr):
		return errorf("%w: %w", cause, err)
	default:
		return errorf("%w (%w): %w", cause, cerr, err)
	}
}

// issueFence gives l a new fence for its key. The statement waits while a
// transaction that checked an older fence of the key (CheckFence) is open,
// so it runs as a blocking statement (see blockAway).
func (s *Session) issueFence(ctx context.Context, l *Lock) error {
	// The fence may wait on another backend: stop when l is lost.
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	go func() {
		select {
		case <-l.Done():
			cancel(l.Err())
		case <-ctx.Done():
		}
	}()
	space, key := fenceRow(l.keys[0])
	var fence int64
	run := func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error {
		err := conn.QueryRow(ctx, sql, args...).Scan(&fence)
		if errors.Is(err, pgx.ErrNoRows) {
			err = errorf("%w: backend %d no longer holds %s", ErrLockLost, s.pid, l.keys[0])
		}
		return err
	}
	// Both statements are token statements: a fence whose commit a
	// synchronous standby has not confirmed is withheld (see block).
	err := s.c.blockAway(ctx, s, blockingStatement{
		sql:     issueFenceSQL(s.c.cfg, 3, 0, "", true),
		args:    []any{space, key, ""},
		run:     run,
		quick:   true,
		durable: true,
	}, blockingStatement{
		// Away from l's backend, the fence checks that l's backend
		// still holds the key.
		sql:     issueFenceSQL(s.c.cfg, 4, 3, "", false),
		args:    []any{space, key, s.pid, ""},
		run:     run,
		durable: true,
	})
	if err != nil {
		return notMigrated(s.c.cfg, "issue fence for key "+l.keys[0].String(), err)
	}
	l.fence = fence
	return nil
}

// glance is how long a blocking statement that rarely waits may wait on a
// backend that holds other goroutines' locks (see blockAway) for a lock
// its NOWAIT does not cover (a row being inserted by another transaction
// at the same moment): well below PostgreSQL's deadlock_timeout, so that
// the backend's own deadlock check does not run meanwhile. The row it
// needs it never waits for there: the deadlock check of that row's holder
// would see the backend's keys.
const glance = 20 * time.Millisecond

// blockAway runs st, a blocking statement that rarely waits (for a row
// that a transaction holds), for a lock on home. On a Session of the
// application's own, it runs there in slices. On a backend of the Client's,
// which may hold other goroutines' locks, it first runs there without
// joining the queue of the row it needs (st locks it with NOWAIT: a wait
// there, however short, would let the row holder's deadlock check find a
// cycle through home if the holder waited for one of home's keys) and
// waiting at most a glance for anything else; if the row is held (or the
// server picked it as a deadlock victim meanwhile), away runs instead on a backend that
// holds nothing, in slices, as a lock wait does (see backends.go); while no
// such backend is free, st runs on home again at growing intervals. On
// home too, st runs in slices, which bounds a wait that no lock_timeout
// covers: its commit's wait for a synchronous standby (see block).
func (c *Client) blockAway(ctx context.Context, home *Session, st, away blockingStatement) error {
	if !home.managed {
		return home.block(ctx, st)
	}
	st.glance = glance
	poll := minPollInterval
	for {
		err := home.block(ctx, st)
		if code := sqlState(err); code != "55P03" && code != "40P01" || home.Err() != nil {
			return err
		}
		b, done, err := c.waitBackend(ctx)
		switch {
		case err == nil:
			err = b.block(ctx, away)
			done()
			return err
		case !errors.Is(err, errNoWaitBackend):
			return err
		}
		if err := c.pause(ctx, poll); err != nil {
			return err
		}
		poll = min(2*poll, maxPollInterval)
	}
}
