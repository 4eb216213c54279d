package core

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// The sentinel errors; the root package exports each, and documents when
// it is returned.
var (
	ErrLocked             = errors.New("pgcoord: key is locked by another holder")
	ErrLockLost           = errors.New("pgcoord: lock lost")
	ErrNotHeld            = errors.New("pgcoord: lock not held")
	ErrDeadlock           = errors.New("pgcoord: deadlock detected")
	ErrTooManyLocks       = errors.New("pgcoord: out of shared memory for locks")
	ErrTooManyConnections = errors.New("pgcoord: no free connection slot on the server")
	ErrReadOnly           = errors.New("pgcoord: server is a read-only standby")
	ErrTransactionPooling = errors.New("pgcoord: backend changed between statements (transaction pooling?); use the Xact* functions")
	ErrClosed             = errors.New("pgcoord: closed")
	ErrStaleFence         = errors.New("pgcoord: stale fence")
	ErrNoPermit           = errors.New("pgcoord: no semaphore permit free")
	ErrNotMigrated        = errors.New("pgcoord: tables missing; run pgcoord.Migrate first")
	ErrNoLeader           = errors.New("pgcoord: no leader")
	ErrForeignBackend     = errors.New("pgcoord: not a pgcoord backend of this database")
	ErrInvalidKey         = errors.New("pgcoord: invalid key")
)

// PgError maps the PostgreSQL errors that pgcoord gives a meaning to onto
// sentinels, keeping the original error reachable; other errors are wrapped
// with op for context.
func PgError(op string, err error) error {
	if err == nil {
		return nil
	}
	switch SqlState(err) {
	case "40P01":
		return Errorf("%s: %w: %w", op, ErrDeadlock, err)
	case "53200":
		return Errorf("%s: %w (raise max_locks_per_transaction, or hold fewer keys): %w", op, ErrTooManyLocks, err)
	}
	return Errorf("%s: %w", op, err)
}

// JoinErrors is errors.Join on one line: it returns nil if every err is
// nil, the one error that is not nil as it is, and otherwise an error whose
// message is theirs separated by "; ", with each reachable by errors.Is
// and errors.As.
func JoinErrors(errs ...error) error {
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

// WithLastConnErr joins err, ctx's error, with last, the last connection
// error, as "<err> (last connection error: <last>)".
func WithLastConnErr(err, last error) error {
	return &lastConnError{Errorf("%w (last connection error: %w)", err, last)}
}

// EndedWhileRetrying is the error of a call that kept trying to reach the
// server until ctx ended: ctx's cause joined with the last connection
// error. err is the last attempt's error; when that attempt failed for the
// server, not for ctx (ctx ended while it was under way), it is the last
// connection error, and ctx's cause still comes first.
func EndedWhileRetrying(ctx context.Context, err, last error) error {
	if cause := CtxCause(ctx); cause != nil && !errors.Is(err, cause) {
		// The attempt under way as ctx ended failed for the server, or
		// was cut short with ctx: either way ctx's end is the error.
		if ConnectionTrouble(err) {
			last = err
		}
		err = cause
	}
	if last != nil && !errors.Is(err, last) {
		err = WithLastConnErr(err, last)
	}
	return err
}

// CtxCause is context.Cause(ctx), also in the moment after ctx's deadline
// passed and before ctx's timer ended it (a dial, a read or a wait slice
// cut to the deadline can time out first): it then waits for the timer,
// briefly, so that the cause given with context.WithDeadlineCause is
// reported, and is context.DeadlineExceeded should the timer be late.
func CtxCause(ctx context.Context) error {
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

// CtxEnded returns err, from a call whose ctx ended with cause, as its
// caller should see it: err as it is when it carries the last connection
// error, cause alone when err only says that ctx ended or that a statement
// was cut short to honour it (the lock_timeout or cancel request pgcoord
// set for it), and cause in front of err otherwise.
func CtxEnded(cause, err error) error {
	var last *lastConnError
	switch code := SqlState(err); {
	case errors.As(err, &last):
		return err
	case errors.Is(err, cause), code == "55P03", code == "57014", errors.Is(err, errSliceOver),
		errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return cause
	}
	return Errorf("%w: %w", cause, err)
}

// SqlState returns the SQLSTATE of the server error in err's chain, or ""
// if there is none: pgx's *pgconn.PgError and the errors of database/sql
// drivers such as lib/pq's *pq.Error have a SQLState method.
func SqlState(err error) string {
	var se interface{ SQLState() string }
	if errors.As(err, &se) {
		return se.SQLState()
	}
	return ""
}

// prefix starts the message of every error pgcoord returns, once.
const Prefix = "pgcoord: "

// Errorf is fmt.Errorf for pgcoord's own errors. The message is
// "pgcoord: " followed by format, where each error among args is shown
// without its own leading "pgcoord: ", so that errors nested several calls
// deep still say "pgcoord:" once. The %w operands stay reachable with
// errors.Is and errors.As, exactly as with fmt.Errorf.
func Errorf(format string, args ...any) error {
	wrapped := fmt.Errorf(format, args...)
	shown := make([]any, len(args))
	for i, a := range args {
		if e, ok := a.(error); ok && e != nil {
			a = strings.TrimPrefix(e.Error(), Prefix)
		}
		shown[i] = a
	}
	return &coordError{msg: Prefix + fmt.Sprintf(strings.ReplaceAll(format, "%w", "%v"), shown...), wrapped: wrapped}
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
	return Errorf("%w: the server did not hold %s for backend %d", ErrNotHeld, k, pid)
}

// QuoteName quotes a name for an error message, cut to 64 bytes.
func QuoteName(name string) string {
	if len(name) > 64 {
		return strconv.Quote(name[:64]) + fmt.Sprintf("... (%d bytes)", len(name))
	}
	return strconv.Quote(name)
}
