// Package pgcoordsql takes pgcoord's transaction-level advisory locks and
// checks its fences inside database/sql transactions, for code built on
// database/sql: sqlc, sqlx, ent, bun, or plain *sql.DB, with pgx's stdlib
// driver (github.com/jackc/pgx/v5/stdlib) or lib/pq.
//
// It is the database/sql twin of pgcoord.XactLock, XactRLock, XactTryLock,
// XactTryRLock, InTx, InTxOptions and CheckFence, and runs the same code:
// the same canonical key order (the order pgcoord's LockAll uses), the same
// single statement per call (one per 1000 keys for more), the same errors
// (pgcoord.ErrLocked, ErrInvalidKey, ErrDeadlock, ErrTooManyLocks,
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
//     An error inside a savepoint aborts only that subtransaction: keys
//     taken after the savepoint are released, keys taken before it stay
//     held.
//   - ROLLBACK TO SAVEPOINT releases the keys taken after that savepoint,
//     while the transaction goes on; a key already held before the
//     savepoint stays held, and RELEASE SAVEPOINT keeps the keys. Take keys
//     before any savepoint you may roll back to.
//   - [InTx] rolls back as soon as fn returns an error or panics. If fn
//     ignores a statement error and returns nil, COMMIT turns into ROLLBACK
//     and InTx returns the driver's error for it (pgx's stdlib: an error
//     wrapping pgx.ErrTxCommitRollback; lib/pq: pq.ErrInFailedTransaction).
//
// # Isolation level
//
// The keys serialise the holders' work only if each holder sees what the
// previous one committed, which READ COMMITTED gives (each statement takes
// a new snapshot). Under REPEATABLE READ and SERIALIZABLE the snapshot is
// taken by the transaction's first statement, at the latest when the lock
// statement starts, before the keys are granted: the holder does not see
// what the previous holder committed while it waited. Under REPEATABLE READ
// a read-then-write under the keys silently works on a stale read; under
// SERIALIZABLE the server reports a serialization failure (SQLSTATE 40001)
// instead of a wrong result. [InTx] therefore begins its transaction with
// sql.LevelReadCommitted, whatever the database's or role's
// default_transaction_isolation, and so does [InTxOptions] unless given
// another level. A transaction of your own passed to [XactLock] runs at the
// level it was begun with: begin it with sql.LevelReadCommitted.
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
//     the cancel request (tens of milliseconds on a local server), if the
//     statement was running by then (see below for one that was not).
//     Inside a savepoint too, every key goes: the backend exits.
//   - lib/pq sends the cancel request, waits for the server's answer and
//     then closes the connection, before the call returns. Outside a
//     savepoint the keys are already free when the call returns. Inside a
//     savepoint the cancelled statement aborts only the subtransaction: the
//     keys taken after the savepoint are free when the call returns, and
//     those taken before it go moments later, when the backend exits after
//     the connection was closed.
//
// Either way, roll the transaction back: database/sql then discards the
// connection rather than return it to the pool.
//
// A statement can also succeed on the server while ctx ends, when the
// cancel request comes too late: lib/pq still closes the connection (it
// does so whenever ctx ended during a call), so the backend exits and the
// transaction ends with it, keys and row locks included, although the
// statement reported success; pgx's stdlib closes the connection if ctx's
// deadline cuts the answer off, and keeps it (with the transaction and its
// keys) if the answer arrived first. So every call of
// this package (XactLock, XactRLock, XactTryLock, XactTryRLock, CheckFence,
// and the lock statement of InTx) returns an error wrapping the context's
// error whenever ctx is done by the time its statement returns, even if
// the statement succeeded, on every driver. Treat it as any error: roll the
// transaction back (or let InTx do it), which releases the keys if the
// connection was kept, and do not count on the keys or the fence; a new
// transaction may try again. A nil return means ctx was still
// live when the statement's answer arrived, so the driver kept the
// connection. TestCallEndedByCtxAfterStatementSucceeded and
// TestXactLockCancelRaceKeepsPromise (in pqtest) check this on lib/pq and
// pgx's stdlib, through pg_locks.
//
// pgx's stdlib does not wait for the server at all when ctx ends: its
// statement may not have reached the backend yet, or the backend, on a busy
// machine, may not have read it. The cancel request that pgx sends as it
// closes the connection finds no statement running and is ignored, and the
// statement runs after the call, and the caller's Rollback, have returned.
// Its keys are then the backend's until it exits: a try holds them until
// the backend reads that the connection is closing, moments later (another
// transaction's try can meanwhile get pgcoord.ErrLocked); a lock that must
// wait keeps the keys it took before the awaited one and waits for that one
// on the server, which does not notice that the client went away, until it
// is granted. No call of this package can wait for that backend: the
// driver has closed its connection. TestCallsCancelRaceKeepPromise (in
// pqtest) reads pg_locks only once the backend has exited or is idle.
//
// A ctx that is already done when a statement is about to be sent sends
// nothing, and the call returns an error wrapping the context's error. The
// transaction then keeps the keys it holds and can go on, if the context
// given to BeginTx is still live. If that context is done too (the call's
// ctx is the BeginTx context or derived from it), database/sql rolls the
// transaction back by itself when it ends: the keys are released and
// Commit returns sql.ErrTxDone (or the context's error).
//
// # Round trips and prepared statements
//
// Each call sends one lock statement with parameters (one per 1000 keys for
// more); its text depends on the number of keys and, for the try variants,
// on the mode. How many round trips a statement with parameters costs is the
// driver's choice; [InTx] with an fn that sends nothing makes:
//
//   - pgx's stdlib in its default mode (QueryExecModeCacheStatement): 4 the
//     first time a connection runs a given number of keys (BEGIN; Parse and
//     Describe to prepare the statement; Bind and Execute; COMMIT), then 3.
//     Each prepared text stays in the connection's statement cache and on
//     the server until the cache evicts it. With default_query_exec_mode=exec
//     in the connection string (or the connector's pgx.ConnConfig), it
//     always makes 3 and prepares nothing.
//   - lib/pq: 4 on every call (it prepares the unnamed statement in a round
//     trip of its own, then binds and executes it); 3 with
//     binary_parameters=yes in the connection string, which sends the
//     statement in one round trip.
//
// The functions use no session state of their own, so behind PgBouncer's
// transaction pooling they work wherever the driver's statements do (pgx's
// stdlib in its default mode prepares named statements, which PgBouncer
// before 1.21, or without max_prepared_statements, does not support; use
// default_query_exec_mode=exec there).
package pgcoordsql
