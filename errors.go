package pgcoord

// Errors: the sentinels that callers test for with errors.Is

import "github.com/pgcoord/pgcoord/internal/core"

// Sentinel errors. Test for them with errors.Is: pgcoord wraps them with
// context, and errors that came from PostgreSQL also keep the
// *pgconn.PgError reachable with errors.As.
var (
	// ErrLocked is returned by TryLock, TryRLock, XactTryLock and other
	// non-blocking acquires when another holder has the key.
	ErrLocked = core.ErrLocked

	// ErrLockLost is returned by Err (of a Lock or a Session) and wraps the
	// cause when the connection that held the lock failed, was terminated,
	// or could not prove it was alive within the loss deadline. Whatever the
	// lock protected must be treated as no longer protected.
	ErrLockLost = core.ErrLockLost

	// ErrNotHeld is returned by Unlock when the lock was already released,
	// or by the server when it did not hold the lock it was asked to release.
	ErrNotHeld = core.ErrNotHeld

	// ErrDeadlock is returned by a blocking acquire that PostgreSQL chose as
	// the victim of a deadlock (SQLSTATE 40P01). Take keys with LockAll,
	// XactLock or InTx, which use one canonical order, to avoid it.
	ErrDeadlock = core.ErrDeadlock

	// ErrTooManyLocks is returned when the server's shared lock table is full
	// (SQLSTATE 53200); raise max_locks_per_transaction or hold fewer keys.
	ErrTooManyLocks = core.ErrTooManyLocks

	// ErrTooManyConnections is returned when the server refuses a new
	// connection because every connection slot is taken (SQLSTATE 53300);
	// raise max_connections, close idle connections elsewhere, or lower
	// WithMaxWaits.
	ErrTooManyConnections = core.ErrTooManyConnections

	// ErrReadOnly is returned when the server is a standby in recovery, whose
	// advisory locks exclude nobody on the primary.
	ErrReadOnly = core.ErrReadOnly

	// ErrTransactionPooling is returned, or wrapped by ErrLockLost, when the
	// server backend behind a session changed between statements, as it does
	// behind PgBouncer in transaction pooling mode. Session locks cannot work
	// there; use XactLock, XactRLock or InTx instead.
	ErrTransactionPooling = core.ErrTransactionPooling

	// ErrClosed is returned, wrapped, by every method of a Client, Session,
	// Election or Semaphore that returns an error, once the Client's Close
	// has begun (Close itself, called again, returns nil), by acquires that
	// were waiting when Close was called, and by New for a closed pool.
	ErrClosed = core.ErrClosed

	// ErrStaleFence is returned by CheckFence when the fence is not the
	// key's latest: a newer fence has been issued (a later holder exists),
	// or the fence was never issued; either way the write must not happen.
	ErrStaleFence = core.ErrStaleFence

	// ErrNoPermit is returned by Semaphore.TryAcquire when every permit of
	// the semaphore is held, or when other acquires are already waiting for
	// one (they come first).
	ErrNoPermit = core.ErrNoPermit

	// ErrNotMigrated is returned by features that need pgcoord's tables
	// (fences, elections, semaphores) when they do not exist in the
	// configured schema; run Migrate with the same schema first.
	ErrNotMigrated = core.ErrNotMigrated

	// ErrNoLeader is returned by Election.Leader and RequestResign when
	// nobody leads the election: no candidate holds its lock.
	ErrNoLeader = core.ErrNoLeader

	// ErrForeignBackend is returned by Client.Terminate for a backend that
	// is not pgcoord's: its application_name is not the Client's, or it is
	// connected to another database. Client.TerminateAny ends it anyway.
	ErrForeignBackend = core.ErrForeignBackend

	// ErrInvalidKey is returned for the zero Key, HashKey with no parts, an
	// empty key list, or a key string or pg_locks row that cannot be decoded.
	ErrInvalidKey = core.ErrInvalidKey
)
