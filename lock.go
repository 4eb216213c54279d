package pgcoord

// Locks: the handle of a held lock, its options, and Do

import (
	"context"

	"github.com/pgcoord/pgcoord/internal/core"
)

// A Lock is a held advisory lock on one or more keys. It is released once,
// by Unlock; it ends early if its session is lost, which Done and Err
// report. Its methods are safe for concurrent use.
type Lock struct{ core core.Lock }

// newHandle makes the lock core's handle inside a Lock, so that one
// allocation makes both (core.Client.NewHandle).
func newHandle() *core.Lock {
	l := new(Lock)
	l.core.Face = l
	return &l.core
}

// faceOf returns the Lock that holds l, a handle that newHandle made.
func faceOf(l *core.Lock) *Lock { return l.Face.(*Lock) }

// lockOf returns the Lock of an acquire's handle l.
func lockOf(l *core.Lock, err error) (*Lock, error) {
	if err != nil {
		return nil, err
	}
	return faceOf(l), nil
}

// Key returns the lock's key; for a lock from LockAll, the first key in
// canonical order.
func (l *Lock) Key() Key { return keyOf(l.core.Key()) }

// Keys returns every key of the lock in canonical order.
func (l *Lock) Keys() []Key { return append([]Key(nil), keysOf(l.core.KeyList)...) }

// Fence returns the fencing token issued when the lock was taken with
// [WithFence], or 0 if none was asked for.
func (l *Lock) Fence() Term { return Term(l.core.Fence()) }

// Done returns a channel that is closed when the lock ends: by Unlock, by
// the end of its session or Client, or by loss.
func (l *Lock) Done() <-chan struct{} { return l.core.Done() }

// Err returns nil while the lock is held. After Done is closed it returns
// an error wrapping [ErrLockLost] (and the cause) if the lock was lost,
// [ErrClosed] if its session or Client was closed, or [ErrNotHeld] if it
// was released by Unlock.
func (l *Lock) Err() error { return l.core.Err() }

// Unlock releases the lock. It works even if ctx is already cancelled: the
// release is sent with a context that keeps ctx's values and is bounded by
// the loss deadline. When Unlock returns nil the lock is released: its keys
// are free on the server, unless another goroutine of the same Client was
// waiting for the key and the lock was handed to it directly (see
// [WithHandoff]). If a blocking acquire waits on the same connection,
// Unlock interrupts it (the acquire then resumes) rather than wait for it.
// A shared lock whose hold other handles of the Client still share on the
// same connection is not released on the server; Unlock then proves the
// connection's backend alive with one round trip, so that nil also means
// the backend held the keys until the call (a backend that had ended
// unnoticed makes Unlock return an error wrapping [ErrLockLost]).
//
// It returns an error wrapping [ErrNotHeld] if the lock was already
// released or is being released by another call, an error wrapping
// [ErrLockLost] or [ErrClosed] if it had ended otherwise, and an error
// wrapping [ErrLockLost] if the release itself failed; in that case the
// connection has been closed, so the server frees the keys as soon as it
// notices.
func (l *Lock) Unlock(ctx context.Context) error { return l.core.Unlock(ctx) }

// LockMode is the mode of an advisory lock: exclusive or shared.
type LockMode uint8

// The modes of an advisory lock, as pg_locks names them ExclusiveLock and
// ShareLock.
const (
	ModeExclusive LockMode = LockMode(core.ModeExclusive)
	ModeShared    LockMode = LockMode(core.ModeShared)
)

// String returns "exclusive" or "shared".
func (m LockMode) String() string { return core.LockMode(m).String() }

// LockOption modifies one acquire.
type LockOption interface {
	lockOption() core.LockOption
}

type lockOption struct{ o core.LockOption }

func (o lockOption) lockOption() core.LockOption { return o.o }

// coreLockOptions returns opts as the lock core takes them; a nil option
// stays nil, for the acquire to report.
func coreLockOptions(opts []LockOption) []core.LockOption {
	if len(opts) == 0 {
		return nil
	}
	os := make([]core.LockOption, len(opts))
	for i, o := range opts {
		if o != nil {
			os[i] = o.lockOption()
		}
	}
	return os
}

// WithFence makes an exclusive single-key acquire also issue a fencing
// token: [Lock.Fence] is then strictly greater than every fence issued
// before for that key, and is committed durably before the acquire
// returns: flushed to the WAL, and, with synchronous replication
// (synchronous_standby_names), confirmed by a synchronous standby. While
// the standby does not confirm, the acquire waits, until its ctx ends; a
// fence whose wait for the standby was cancelled is never handed out. It
// needs the tables that [Migrate] creates (otherwise the acquire fails with
// an error wrapping [ErrNotMigrated] and takes nothing). Shared locks and
// LockAll reject it, since a fence orders single exclusive holders.
func WithFence() LockOption { return lockOption{core.WithFence()} }

// Do holds key exclusively for the duration of fn. fn's context is
// cancelled, with the lock's error as cause, if the lock is lost while fn
// runs; fn must then stop touching whatever the lock protects. ctx bounds
// the wait and is the parent of fn's context. Do returns the acquire
// error, or fn's error joined with an error wrapping [ErrLockLost] if the
// lock was lost while fn ran, and the Unlock error if releasing failed.
// opts are as for Lock. fn finds the held Lock, and so its [Lock.Fence]
// when opts include [WithFence], with [LockFromContext]:
//
//	err := c.Do(ctx, key, func(ctx context.Context) error {
//		l, _ := pgcoord.LockFromContext(ctx)
//		return write(ctx, l.Fence())
//	}, pgcoord.WithFence())
func (c *Client) Do(ctx context.Context, key Key, fn func(ctx context.Context) error, opts ...LockOption) error {
	if fn == nil {
		return core.Errorf("do %s: fn is nil", core.KeyList([]core.Key{key.coreKey()}))
	}
	l, err := c.Lock(ctx, key, opts...)
	if err != nil {
		return err
	}
	return l.do(ctx, fn)
}

// LockFromContext returns the Lock that [Client.Do] holds while it runs
// fn, given fn's context or one derived from it; ok is false for any other
// context. When Do calls nest, it returns the innermost lock. The Lock
// gives fn its key, its fence ([WithFence]) and Done; fn must not Unlock
// it, which Do does when fn returns.
func LockFromContext(ctx context.Context) (l *Lock, ok bool) {
	l, ok = ctx.Value(lockContextKey{}).(*Lock)
	return l, ok
}

// lockContextKey is the context key of the Lock that Do holds.
type lockContextKey struct{}

// do runs fn with l in its context, cancelled if l ends, and unlocks l.
func (l *Lock) do(ctx context.Context, fn func(ctx context.Context) error) error {
	fctx, cancel := context.WithCancelCause(context.WithValue(ctx, lockContextKey{}, l))
	defer cancel(nil)
	fnDone, watched := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(watched)
		select {
		case <-l.Done():
			cancel(l.Err())
		case <-fnDone:
		}
	}()
	err := fn(fctx)
	close(fnDone)
	<-watched
	if lost := l.Err(); lost != nil {
		return core.JoinErrors(err, core.Errorf("do %s: the lock ended while fn ran: %w", core.KeyList(l.core.KeyList), lost))
	}
	return core.JoinErrors(err, l.Unlock(ctx))
}
