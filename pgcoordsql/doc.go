// Package pgcoordsql takes pgcoord's transaction-level advisory locks and
// checks its fences inside database/sql transactions, for code built on
// database/sql: sqlc, sqlx, ent, bun, or plain *sql.DB, with pgx's stdlib
// driver (github.com/jackc/pgx/v5/stdlib) or lib/pq.
//
// It is the database/sql twin of pgcoord.XactLock, XactRLock, XactTryLock,
// XactTryRLock, InTx, InTxOptions and CheckFence, and runs the same code:
// the same canonical key order (the order pgcoord's LockAll uses), the same
// single statement per call (one per 1000 keys for more), the same errors (pgcoord.ErrLocked, ErrInvalidKey, ErrDeadlock, ErrTooManyLocks,
// ErrStaleFence, ErrNotMigrated), which these functions return wrapped, as
// pgcoord does. Use it when the transaction that the lock must protect is a
// *sql.Tx; use the pgcoord functions when it is a pgx.Tx. Keys taken
// through either package are the same PostgreSQL locks and exclude each
// other. The session-level locks, elections and semaphores need pgcoord's
// Client, which runs on pgx; a program on database/sql can still open one
// with pgcoord.Open, next to its *sql.DB.
//
// # Errors abort the transaction
//
// A transaction-level lock belongs to the transaction: PostgreSQL releases
// it at COMMIT or ROLLBACK, and there is no way to release it earlier. Read
// pgcoord's documentation of XactLock; in short:
//
//   - A statement error (including a cancelled statement and a deadlock)
//     aborts the transaction at once, and PostgreSQL releases its locks,
//     the advisory ones included, at that moment, not at ROLLBACK. The
//     transaction stays open in the failed state until ROLLBACK and every
//     further statement fails with SQLSTATE 25P02, but the keys protect
//     nothing any more: another transaction can take them right away. Work
//     outside the database done after an ignored error is not protected.
//   - ROLLBACK TO SAVEPOINT releases the keys taken after that savepoint,
//     while the transaction goes on; take keys before any savepoint you may
//     roll back to.
//   - [InTx] rolls back as soon as fn returns an error or panics. If fn
//     ignores a statement error and returns nil, COMMIT turns into ROLLBACK
//     and InTx returns the driver's error for it (pgx's stdlib: an error
//     wrapping pgx.ErrTxCommitRollback; lib/pq: pq.ErrInFailedTransaction).
//
// # Contexts and cancellation
//
// database/sql rolls a transaction back when the context given to BeginTx
// ends, whatever runs in it; InTx begins its transaction with its ctx, so
// that ctx bounds the whole transaction, fn included.
//
// A lock wait that ends because the statement's ctx is done frees every key
// of the transaction, including those taken before the one waited on: the
// driver sends PostgreSQL a cancel request, the statement fails, and that
// aborts the transaction. The error wraps the context's error. How the call
// ends depends on the driver:
//
//   - pgx's stdlib returns at once, before the keys are released, and closes
//     the connection; the server releases the keys once it has processed
//     the cancel request (tens of milliseconds on a local server).
//   - lib/pq sends the cancel request and waits for the server's answer, so
//     the keys are already free when the call returns; it then marks the
//     connection bad.
//
// Either way, roll the transaction back: database/sql then discards the
// connection rather than return it to the pool. A ctx that is already done
// when a statement is about to be sent sends nothing: database/sql returns
// the context's error, and the transaction keeps the keys it holds.
//
// The functions use no session state of their own, so behind PgBouncer's
// transaction pooling they work wherever the driver's statements do (pgx's
// stdlib prepares named statements unless its QueryExecMode says otherwise,
// which PgBouncer before 1.21 does not support).
package pgcoordsql
