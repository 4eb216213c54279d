package pgcoordsql

import (
	"context"
	"database/sql"
	"errors"

	"github.com/pgcoord/pgcoord"
)

// CheckFence verifies, inside tx, that fence is still the newest fence
// issued for key (by a lock taken with [pgcoord.WithFence], for instance),
// and keeps it so until tx ends, as [pgcoord.CheckFence] does in a pgx.Tx.
// Call it in the transaction that writes the data the lock protects, before
// writing:
//
//	if err := pgcoordsql.CheckFence(ctx, tx, key, fence); err != nil {
//		return err // do not write: errors.Is(err, pgcoord.ErrStaleFence) means another holder exists
//	}
//	// write, then commit
//
// It reads the key's row in the fences table with SELECT ... FOR SHARE; the
// row stays share-locked until tx ends, and issuing a new fence updates it,
// so no newer fence can be issued while tx is open: a write committed in tx
// after a nil CheckFence can never interleave with a newer holder's writes.
// A holder paused inside tx holds the next holder's fence up as long: set
// idle_in_transaction_session_timeout for the application's role.
//
// It returns nil when the stored fence equals fence, and an error wrapping
// [pgcoord.ErrStaleFence], naming both fences, when a newer fence has been
// issued or when fence was never issued for key (a wrong key, schema or
// database, or fences lost in a failover): the write must not happen, and
// retrying cannot make it safe. Other errors: [pgcoord.ErrInvalidKey] for an
// invalid key, a plain error for a nil tx, a nil ctx or fence <= 0 (fences
// start at 1), [pgcoord.ErrNotMigrated] when the fences table does not exist in the
// schema, and the driver's error, wrapped, when the query fails. After any
// error, roll tx back.
//
// Under REPEATABLE READ or SERIALIZABLE, a fence issued after tx's snapshot
// was taken makes the server report a serialization failure (SQLSTATE
// 40001). If it is the key's first fence, tx sees no fence at all, and
// CheckFence, unable to tell it from a fence never issued, returns an error
// that does not wrap ErrStaleFence but wraps a *pgconn.PgError with Code
// "40001", built by pgcoord, whose SQLState method returns "40001" (with
// lib/pq, errors.As finds no *pq.Error: test for an error with a SQLState
// method). Retry in a new transaction; see [pgcoord.CheckFence].
//
// ctx governs the query, including the wait for a new fence being issued at
// the same moment. If ctx ends while the query succeeds, CheckFence returns
// an error wrapping the context's error, not nil: the driver may be closing
// the connection, which ends tx and its row lock; roll tx back. Options:
// only [pgcoord.WithSchema] applies; pass the schema given to
// [pgcoord.Migrate] and the Client.
func CheckFence(ctx context.Context, tx *sql.Tx, key pgcoord.Key, fence pgcoord.Term, opts ...pgcoord.FenceOption) error {
	if tx == nil {
		return errors.New("pgcoord: check fence " + impl.Subject([]pgcoord.Key{key}) + ": nil *sql.Tx")
	}
	return impl.CheckFence(ctx, sqlTx{tx}, key, fence, opts)
}
