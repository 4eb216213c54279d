package core

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// A lock's handle: its keys, its end, Done, Err and Unlock

// Lock is the core of [pgcoord.Lock], which documents it.
type Lock struct {
	S       *Session
	KeyList []Key // canonical order
	Shared  bool
	fence   int64
	since   time.Time // when the lock was granted; set only when lock events are observed

	unreported atomic.Bool // never returned by its acquire: its end is not an event

	Mu        sync.Mutex
	Cause     error // nil while held
	Releasing bool  // Unlock has begun
	gated     bool  // claimed: the lock, not its acquire, owns its keys' in-process gates (see claim)
	endUntold bool  // it ended before its claim, which reports the end after the acquire
	// done is Done's channel, made on first use (most locks are unlocked
	// without anyone waiting on it); closed is set, and done closed if
	// made, once the lock has ended and then has run (see finishThen).
	done   chan struct{}
	closed bool

	// Face is the API's handle that holds this one (see Client.NewHandle),
	// or nil.
	Face any
}

// newHandle returns a new, empty lock handle: the one inside the API's
// handle when NewHandle is set, so that one allocation makes both.
func (c *Client) newHandle() *Lock {
	if c.NewHandle != nil {
		return c.NewHandle()
	}
	return new(Lock)
}

func newLock(s *Session, r Request) *Lock {
	l := s.c.newHandle()
	l.S, l.KeyList, l.Shared = s, r.keys, r.shared
	l.unreported.Store(r.internal)
	if s.c.observed() {
		l.since = time.Now()
	}
	return l
}

// drop removes a handle that never reached its caller and releases its
// keys; its gates stay the caller's.
func (s *Session) drop(l *Lock) {
	s.State.Lock()
	_, mine := s.locks[l]
	delete(s.locks, l)
	s.State.Unlock()
	l.finish(ErrNotHeld)
	if mine {
		ctx, cancel := WithoutCancel(context.Background(), s.c.Cfg.LossDeadline)
		defer cancel()
		_ = s.releaseKeys(ctx, l.KeyList, l.Shared)
	}
}

// Key is the core of [pgcoord.Lock.Key], which documents it.
func (l *Lock) Key() Key { return l.KeyList[0] }

// Keys is the core of [pgcoord.Lock.Keys], which documents it.
func (l *Lock) Keys() []Key { return append([]Key(nil), l.KeyList...) }

// Fence is the core of [pgcoord.Lock.Fence], which documents it.
func (l *Lock) Fence() int64 { return l.fence }

// Done is the core of [pgcoord.Lock.Done], which documents it.
func (l *Lock) Done() <-chan struct{} {
	l.Mu.Lock()
	defer l.Mu.Unlock()
	if l.done == nil {
		l.done = make(chan struct{})
		if l.closed {
			close(l.done)
		}
	}
	return l.done
}

// Err is the core of [pgcoord.Lock.Err], which documents it.
func (l *Lock) Err() error {
	l.Mu.Lock()
	defer l.Mu.Unlock()
	return l.Cause
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
	l.Mu.Lock()
	if l.Cause != nil {
		l.Mu.Unlock()
		return false
	}
	l.Cause = why
	gated := l.gated
	// A lock that no acquire reports (a permit's, an election's) has no
	// claim to wait for: its end goes at once to what reports it.
	l.endUntold = report && !gated && !l.unreported.Load()
	l.Mu.Unlock()
	if then != nil {
		then(gated)
	}
	l.Mu.Lock()
	l.closed = true
	done := l.done
	l.Mu.Unlock()
	if done != nil {
		close(done)
	}
	return true
}

// End finishes the lock and lets the next goroutine of this Client at its
// keys. The keys' gates are left before Done closes, so a caller that sees
// Done closed can take the keys again in this process at once. A lock that
// ends before its acquire has claimed it leaves the gates to the acquire.
// end reports nothing to the hooks; see endReported.
func (l *Lock) End(why error) { l.endThen(why, false) }

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
	for _, k := range l.KeyList {
		l.S.c.Gates.leave(k, l.Shared)
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
func (l *Lock) claim(start time.Time, r Request, handoff bool) bool {
	l.Mu.Lock()
	defer l.Mu.Unlock()
	if !start.IsZero() {
		l.S.c.acquired(start, r, l, handoff, nil)
	}
	if l.Cause != nil {
		if l.endUntold {
			l.endUntold = false
			l.reportEnd(l.Cause)
		}
		return false
	}
	l.gated = true
	return true
}

// Unlock is the core of [pgcoord.Lock.Unlock], which documents it.
func (l *Lock) Unlock(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	l.Mu.Lock()
	if l.Cause != nil || l.Releasing {
		err := l.Cause
		l.Mu.Unlock()
		if err == nil {
			err = Errorf("%w: another Unlock is releasing it", ErrNotHeld)
		}
		return Errorf("unlock %s: %w", KeyList(l.KeyList), err)
	}
	l.Releasing = true
	l.Mu.Unlock()

	s := l.S
	if s.c.handoff(l) {
		return nil // the release was reported before the handoff completed
	}
	if err := s.c.Enter(); err != nil {
		// Close has begun: it ends the lock, and reports its end,
		// before it returns.
		<-l.Done()
		return Errorf("unlock %s: %w", KeyList(l.KeyList), l.Err())
	}
	// Close waits for the release, and its report, from here on.
	defer s.c.Wg.Done()
	s.State.Lock()
	_, mine := s.locks[l]
	delete(s.locks, l)
	s.State.Unlock()
	if !mine {
		// The session ended meanwhile and is ending this lock.
		<-l.Done()
		return Errorf("unlock %s: %w", KeyList(l.KeyList), l.Err())
	}
	// The release is bounded by the session's lease: with no answer
	// from the server for the loss deadline, the session is lost and its
	// connection closed, which ends the statement.
	sent, err := s.releaseHold(context.WithoutCancel(ctx), l.KeyList, l.Shared)
	if err == nil && !sent {
		// Other handles still hold the keys here, so nothing was sent.
		// The backend may have ended unnoticed (terminated, its
		// connection broken) since it last answered: a ping proves it
		// still holds them, else the session is lost and so is l.
		err = s.Prove(context.WithoutCancel(ctx), "unlock")
	}
	// A release that failed lost the session, and with it the lock: Err
	// says so, as Unlock does, not that Unlock released it.
	why := error(ErrNotHeld)
	if ErrorIsLoss(err) {
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
		return Errorf("unlock %s: %w", KeyList(l.KeyList), err)
	}
	return nil
}

// The statements below end with WHERE pg_backend_pid() = <the session's
// backend>. Without FROM, that condition is evaluated once, before the
// select list, so on any other backend (behind a transaction-pooling proxy)
// the statement returns no row and does nothing. The select list is
// evaluated left to right, so keys are taken in the order given.

// LockMode is the core of [pgcoord.LockMode], which documents it.
type LockMode uint8

// The modes of an advisory lock, as pg_locks names them ExclusiveLock and
// ShareLock.
const (
	ModeExclusive LockMode = iota + 1
	ModeShared
)

// String is the core of [pgcoord.LockMode.String], which documents it.
func (m LockMode) String() string {
	switch m {
	case ModeExclusive:
		return "exclusive"
	case ModeShared:
		return "shared"
	}
	return "LockMode(" + strconv.Itoa(int(m)) + ")"
}
