package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Sentinel errors. Test for them with errors.Is: pgcoord wraps them with
// context, and errors that came from PostgreSQL also keep the
// *pgconn.PgError reachable with errors.As.
var (
	// ErrLocked is returned by TryLock, TryRLock, XactTryLock and other
	// non-blocking acquires when another holder has the key.
	ErrLocked = errors.New("pgcoord: key is locked by another holder")

	// ErrLockLost is returned by Err (of a Lock or a Session) and wraps the
	// cause when the connection that held the lock failed, was terminated,
	// or could not prove it was alive within the loss deadline. Whatever the
	// lock protected must be treated as no longer protected.
	ErrLockLost = errors.New("pgcoord: lock lost")

	// ErrNotHeld is returned by Unlock when the lock was already released,
	// or by the server when it did not hold the lock it was asked to release.
	ErrNotHeld = errors.New("pgcoord: lock not held")

	// ErrDeadlock is returned by a blocking acquire that PostgreSQL chose as
	// the victim of a deadlock (SQLSTATE 40P01). Take keys with LockAll,
	// XactLock or InTx, which use one canonical order, to avoid it.
	ErrDeadlock = errors.New("pgcoord: deadlock detected")

	// ErrTooManyLocks is returned when the server's shared lock table is full
	// (SQLSTATE 53200); raise max_locks_per_transaction or hold fewer keys.
	ErrTooManyLocks = errors.New("pgcoord: out of shared memory for locks")

	// ErrTooManyConnections is returned when the server refuses a new
	// connection because every connection slot is taken (SQLSTATE 53300);
	// raise max_connections, close idle connections elsewhere, or lower
	// WithMaxWaits.
	ErrTooManyConnections = errors.New("pgcoord: no free connection slot on the server")

	// ErrReadOnly is returned when the server is a standby in recovery, whose
	// advisory locks exclude nobody on the primary.
	ErrReadOnly = errors.New("pgcoord: server is a read-only standby")

	// ErrTransactionPooling is returned, or wrapped by ErrLockLost, when the
	// server backend behind a session changed between statements, as it does
	// behind PgBouncer in transaction pooling mode. Session locks cannot work
	// there; use XactLock, XactRLock or InTx instead.
	ErrTransactionPooling = errors.New("pgcoord: backend changed between statements (transaction pooling?); use the Xact* functions")

	// ErrClosed is returned, wrapped, by every method of a Client, Session,
	// Election or Semaphore that returns an error, once the Client's Close
	// has begun (Close itself, called again, returns nil), by acquires that
	// were waiting when Close was called, and by New for a closed pool.
	ErrClosed = errors.New("pgcoord: closed")

	// ErrStaleFence is returned by CheckFence when the fence is not the
	// key's latest: a newer fence has been issued (a later holder exists),
	// or the fence was never issued; either way the write must not happen.
	ErrStaleFence = errors.New("pgcoord: stale fence")

	// ErrNoPermit is returned by Semaphore.TryAcquire when every permit of
	// the semaphore is held, or when other acquires are already waiting for
	// one (they come first).
	ErrNoPermit = errors.New("pgcoord: no semaphore permit free")

	// ErrNotMigrated is returned by features that need pgcoord's tables
	// (fences, elections, semaphores) when they do not exist in the
	// configured schema; run Migrate with the same schema first.
	ErrNotMigrated = errors.New("pgcoord: tables missing; run pgcoord.Migrate first")

	// ErrNoLeader is returned by Election.Leader and RequestResign when
	// nobody leads the election: no candidate holds its lock.
	ErrNoLeader = errors.New("pgcoord: no leader")

	// ErrForeignBackend is returned by Client.Terminate for a backend that
	// is not pgcoord's: its application_name is not the Client's, or it is
	// connected to another database. Client.TerminateAny ends it anyway.
	ErrForeignBackend = errors.New("pgcoord: not a pgcoord backend of this database")

	// ErrInvalidKey is returned for the zero Key, HashKey with no parts, an
	// empty key list, or a key string or pg_locks row that cannot be decoded.
	ErrInvalidKey = errors.New("pgcoord: invalid key")
)

// pgError maps the PostgreSQL errors that pgcoord gives a meaning to onto
// sentinels, keeping the original error reachable; other errors are wrapped
// with op for context.
func pgError(op string, err error) error {
	if err == nil {
		return nil
	}
	switch sqlState(err) {
	case "40P01":
		return errorf("%s: %w: %w", op, ErrDeadlock, err)
	case "53200":
		return errorf("%s: %w (raise max_locks_per_transaction, or hold fewer keys): %w", op, ErrTooManyLocks, err)
	}
	return errorf("%s: %w", op, err)
}

// joinErrors is errors.Join on one line: it returns nil if every err is
// nil, the one error that is not nil as it is, and otherwise an error whose
// message is theirs separated by "; ", with each reachable by errors.Is
// and errors.As.
func joinErrors(errs ...error) error {
	var j lineJoin
	for _, err := range errs {
		if err != nil {
			j = append(j, err)
		}
	}
	switch len(j) {
	case 0:
		return nil
	case 1:
		return j[0]
	}
	return j
}

// lineJoin is the error of joinErrors.
type lineJoin []error

func (j lineJoin) Error() string {
	msgs := make([]string, len(j))
	for i, err := range j {
		msgs[i] = strings.ReplaceAll(err.Error(), "\n", "; ")
	}
	return strings.Join(msgs, "; ")
}

// Unwrap returns the joined errors.
func (j lineJoin) Unwrap() []error { return j }

// lastConnError is ctx's error (or cause) with the last connection error
// that a blocking call met before ctx ended: the server was down, a
// standby, or out of connection slots.
type lastConnError struct{ error }

func (e *lastConnError) Unwrap() error { return e.error }

// withLastConnErr joins err, ctx's error, with last, the last connection
// error, as "<err> (last connection error: <last>)".
func withLastConnErr(err, last error) error {
	return &lastConnError{errorf("%w (last connection error: %w)", err, last)}
}

// endedWhileRetrying is the error of a call that kept trying to reach the
// server until ctx ended: ctx's cause joined with the last connection
// error. err is the last attempt's error; when that attempt failed for the
// server, not for ctx (ctx ended while it was under way), it is the last
// connection error, and ctx's cause still comes first.
func endedWhileRetrying(ctx context.Context, err, last error) error {
	if cause := ctxCause(ctx); cause != nil && !errors.Is(err, cause) {
		// The attempt under way as ctx ended failed for the server, or
		// was cut short with ctx: either way ctx's end is the error.
		if connectionTrouble(err) {
			last = err
		}
		err = cause
	}
	if last != nil && !errors.Is(err, last) {
		err = withLastConnErr(err, last)
	}
	return err
}

// ctxCause is context.Cause(ctx), also in the moment after ctx's deadline
// passed and before ctx's timer ended it (a dial, a read or a wait slice
// cut to the deadline can time out first): it then waits for the timer,
// briefly, so that the cause given with context.WithDeadlineCause is
// reported, and is context.DeadlineExceeded should the timer be late.
func ctxCause(ctx context.Context) error {
	cause := context.Cause(ctx)
	if dl, ok := ctx.Deadline(); ok && cause == nil && !time.Now().Before(dl) {
		t := time.NewTimer(deadlineGrace)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-t.C:
			return context.DeadlineExceeded
		}
	}
	return cause
}

// ctxEnded returns err, from a call whose ctx ended with cause, as its
// caller should see it: err as it is when it carries the last connection
// error, cause alone when err only says that ctx ended or that a statement
// was cut short to honour it (the lock_timeout or cancel request pgcoord
// set for it), and cause in front of err otherwise.
func ctxEnded(cause, err error) error {
	var last *lastConnError
	switch code := sqlState(err); {
	case errors.As(err, &last):
		return err
	case errors.Is(err, cause), code == "55P03", code == "57014", errors.Is(err, errSliceOver),
		errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return cause
	}
	return errorf("%w: %w", cause, err)
}

// sqlState returns the SQLSTATE of the server error in err's chain, or ""
// if there is none: pgx's *pgconn.PgError and the errors of database/sql
// drivers such as lib/pq's *pq.Error have a SQLState method.
func sqlState(err error) string {
	var se interface{ SQLState() string }
	if errors.As(err, &se) {
		return se.SQLState()
	}
	return ""
}

// prefix starts the message of every error pgcoord returns, once.
const prefix = "pgcoord: "

// errorf is fmt.Errorf for pgcoord's own errors. The message is
// "pgcoord: " followed by format, where each error among args is shown
// without its own leading "pgcoord: ", so that errors nested several calls
// deep still say "pgcoord:" once. The %w operands stay reachable with
// errors.Is and errors.As, exactly as with fmt.Errorf.
func errorf(format string, args ...any) error {
	wrapped := fmt.Errorf(format, args...)
	shown := make([]any, len(args))
	for i, a := range args {
		if e, ok := a.(error); ok && e != nil {
			a = strings.TrimPrefix(e.Error(), prefix)
		}
		shown[i] = a
	}
	return &coordError{msg: prefix + fmt.Sprintf(strings.ReplaceAll(format, "%w", "%v"), shown...), wrapped: wrapped}
}

// coordError is an error built by errorf.
type coordError struct {
	msg     string
	wrapped error // from fmt.Errorf: its operands are the %w arguments
}

func (e *coordError) Error() string { return e.msg }

// Unwrap returns the %w operands of the error.
func (e *coordError) Unwrap() []error {
	switch w := e.wrapped.(type) {
	case interface{ Unwrap() []error }:
		return w.Unwrap()
	case interface{ Unwrap() error }:
		if u := w.Unwrap(); u != nil {
			return []error{u}
		}
	}
	return nil
}

// errNotHeldBy is the error of a release of k that backend pid did not hold.
func errNotHeldBy(k Key, pid int32) error {
	return errorf("%w: the server did not hold %s for backend %d", ErrNotHeld, k, pid)
}

// quoteName quotes a name for an error message, cut to 64 bytes.
func quoteName(name string) string {
	if len(name) > 64 {
		return strconv.Quote(name[:64]) + fmt.Sprintf("... (%d bytes)", len(name))
	}
	return strconv.Quote(name)
}
