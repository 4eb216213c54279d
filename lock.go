package pgcoord

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// A Lock is a held advisory lock on one or more keys. It is released once,
// by Unlock; it ends early if its session is lost, which Done and Err
// report. Its methods are safe for concurrent use.
type Lock struct {
	s      *Session
	keys   []Key // canonical order
	shared bool
	fence  int64
	since  time.Time // when the lock was granted; set only when lock events are observed

	unreported atomic.Bool // never returned by its acquire: its end is not an event

	mu        sync.Mutex
	err       error // nil while held
	releasing bool  // Unlock has begun
	gated     bool  // claimed: the lock, not its acquire, owns its keys' in-process gates (see claim)
	endUntold bool  // it ended before its claim, which reports the end after the acquire
	// done is Done's channel, made on first use (most locks are unlocked
	// without anyone waiting on it); closed is set, and done closed if
	// made, once the lock has ended and then has run (see finishThen).
	done   chan struct{}
	closed bool
}

func newLock(s *Session, r request) *Lock {
	l := &Lock{s: s, keys: r.keys, shared: r.shared}
	l.unreported.Store(r.internal)
	if s.c.observed() {
		l.since = time.Now()
	}
	return l
}

// drop removes a handle that never reached its caller and releases its
// keys; its gates stay the caller's.
func (s *Session) drop(l *Lock) {
	s.state.Lock()
	_, mine := s.locks[l]
	delete(s.locks, l)
	s.state.Unlock()
	l.finish(ErrNotHeld)
	if mine {
		ctx, cancel := withoutCancel(context.Background(), s.c.cfg.lossDeadline)
		defer cancel()
		_ = s.releaseKeys(ctx, l.keys, l.shared)
	}
}

// Key returns the lock's key; for a lock from LockAll, the first key in
// canonical order.
func (l *Lock) Key() Key { return l.keys[0] }

// Keys returns every key of the lock in canonical order.
func (l *Lock) Keys() []Key { return append([]Key(nil), l.keys...) }

// Fence returns the fencing token issued when the lock was taken with
// [WithFence], or 0 if none was asked for.
func (l *Lock) Fence() Term { return Term(l.fence) }

// Done returns a channel that is closed when the lock ends: by Unlock, by
// the end of its session or Client, or by loss.
func (l *Lock) Done() <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.done == nil {
		l.done = make(chan struct{})
		if l.closed {
			close(l.done)
		}
	}
	return l.done
}

// Err returns nil while the lock is held. After Done is closed it returns
// an error wrapping [ErrLockLost] (and the cause) if the lock was lost,
// [ErrClosed] if its session or Client was closed, or [ErrNotHeld] if it
// was released by Unlock.
func (l *Lock) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

// finish records why the lock ended and closes Done; it neither leaves
// the keys' gates nor reports to the hooks. It reports whether this call
// ended the lock.
func (l *Lock) finish(why error) bool { return l.finishThen(why, false, nil) }

// finishThen is finish that runs then, if this call ends the lock, before
// Done closes; then learns whether the lock was claimed when it ended
// (see claim). With report, an end before the claim is left for the claim
// to report, after the acquire.
func (l *Lock) finishThen(why error, report bool, then func(gated bool)) bool {
	l.mu.Lock()
	if l.err != nil {
		l.mu.Unlock()
		return false
	}
	l.err = why
	gated := l.gated
	// A lock that no acquire reports (a permit's, an election's) has no
	// claim to wait for: its end goes at once to what reports it.
	l.endUntold = report && !gated && !l.unreported.Load()
	l.mu.Unlock()
	if then != nil {
		then(gated)
	}
	l.mu.Lock()
	l.closed = true
	done := l.done
	l.mu.Unlock()
	if done != nil {
		close(done)
	}
	return true
}

// end finishes the lock and lets the next goroutine of this Client at its
// keys. The keys' gates are left before Done closes, so a caller that sees
// Done closed can take the keys again in this process at once. A lock that
// ends before its acquire has claimed it leaves the gates to the acquire.
// end reports nothing to the hooks; see endReported.
func (l *Lock) end(why error) { l.endThen(why, false) }

// endReported is end for a lock that ends with its session: when report
// is set, its end is reported to the hooks (a release for ErrClosed, else
// a loss; a permit's end to OnPermit) before its gates let the next
// goroutine in, so that no acquire of the keys is reported before it; a
// lock not claimed yet is reported by its claim, after its acquire.
func (l *Lock) endReported(why error, report bool) { l.endThen(why, report) }

func (l *Lock) endThen(why error, report bool) {
	l.finishThen(why, report, func(gated bool) {
		if report && (gated || l.unreported.Load()) {
			l.reportEnd(why)
		}
		if gated {
			l.leaveGates()
		}
	})
}

func (l *Lock) leaveGates() {
	for _, k := range l.keys {
		l.s.c.gates.leave(k, l.shared)
	}
}

// claim makes l, about to be returned by its acquire, the owner of its
// keys' gates, and reports the acquire to the hooks unless start is zero
// (the acquire is not observed): under l.mu, so that l's end is never
// reported before its acquire, and while the acquire still owns the keys'
// gates, so that the previous holder's end, reported before it left them,
// comes first. It reports false if l has ended already: the gates are
// still the acquire's to leave, and l's end is reported here, right after
// the acquire.
func (l *Lock) claim(start time.Time, r request, handoff bool) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !start.IsZero() {
		l.s.c.acquired(start, r, l, handoff, nil)
	}
	if l.err != nil {
		if l.endUntold {
			l.endUntold = false
			l.reportEnd(l.err)
		}
		return false
	}
	l.gated = true
	return true
}

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
func (l *Lock) Unlock(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	l.mu.Lock()
	if l.err != nil || l.releasing {
		err := l.err
		l.mu.Unlock()
		if err == nil {
			err = errorf("%w: another Unlock is releasing it", ErrNotHeld)
		}
		return errorf("unlock %s: %w", keyList(l.keys), err)
	}
	l.releasing = true
	l.mu.Unlock()

	s := l.s
	if s.c.handoff(l) {
		return nil // the release was reported before the handoff completed
	}
	if err := s.c.enter(); err != nil {
		// Close has begun: it ends the lock, and reports its end,
		// before it returns.
		<-l.Done()
		return errorf("unlock %s: %w", keyList(l.keys), l.Err())
	}
	// Close waits for the release, and its report, from here on.
	defer s.c.wg.Done()
	s.state.Lock()
	_, mine := s.locks[l]
	delete(s.locks, l)
	s.state.Unlock()
	if !mine {
		// The session ended meanwhile and is ending this lock.
		<-l.Done()
		return errorf("unlock %s: %w", keyList(l.keys), l.Err())
	}
	// The release is bounded by the session's lease: with no answer
	// from the server for the loss deadline, the session is lost and its
	// connection closed, which ends the statement.
	sent, err := s.releaseHold(context.WithoutCancel(ctx), l.keys, l.shared)
	if err == nil && !sent {
		// Other handles still hold the keys here, so nothing was sent.
		// The backend may have ended unnoticed (terminated, its
		// connection broken) since it last answered: a ping proves it
		// still holds them, else the session is lost and so is l.
		err = s.prove(context.WithoutCancel(ctx), "unlock")
	}
	// A release that failed lost the session, and with it the lock: Err
	// says so, as Unlock does, not that Unlock released it.
	why := error(ErrNotHeld)
	if errorIsLoss(err) {
		why = err
	}
	// The release is reported before the gates let the next goroutine of
	// this Client in, so the hooks see it before that one's acquire.
	l.finishThen(why, false, func(gated bool) {
		l.released(false, err)
		if gated {
			l.leaveGates()
		}
	})
	if err != nil {
		return errorf("unlock %s: %w", keyList(l.keys), err)
	}
	return nil
}

// The statements below end with WHERE pg_backend_pid() = <the session's
// backend>. Without FROM, that condition is evaluated once, before the
// select list, so on any other backend (behind a transaction-pooling proxy)
// the statement returns no row and does nothing. The select list is
// evaluated left to right, so keys are taken in the order given.

// LockMode is the mode of an advisory lock: exclusive or shared.
type LockMode uint8

// The modes of an advisory lock, as pg_locks names them ExclusiveLock and
// ShareLock.
const (
	ModeExclusive LockMode = iota + 1
	ModeShared
)

// String returns "exclusive" or "shared".
func (m LockMode) String() string {
	switch m {
	case ModeExclusive:
		return "exclusive"
	case ModeShared:
		return "shared"
	}
	return "LockMode(" + strconv.Itoa(int(m)) + ")"
}
