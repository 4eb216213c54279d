package pgcoord

import (
	"errors"
	"strconv"
	"sync"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"
)

// Hooks are functions that a Client calls on lock events, to feed metrics
// or traces (the modules contrib/prometheus and contrib/otel turn them
// into metrics; examples/metrics runs both). Any of them may be nil. Set
// them with [WithHooks].
//
// Hooks never run on the goroutine that caused the event and never hold
// up the library: events are queued, and one goroutine per Client calls
// the hooks, one at a time, in the order the events were queued. For the
// Client's locks that is the order in which they changed hands in the
// process: a lock's OnAcquire comes before its OnRelease or OnLoss, and
// the end of a lock comes before the OnAcquire of the next lock of the
// Client on any of its keys in a mode that excludes it (exclusive excludes
// both modes), also when the lock is handed over in the process (see
// [WithHandoff]), lost, or ended by Close. So a count of holders per key
// built on the hooks never shows two holders of one key that exclude each
// other. The server's view may run ahead: the key of a lost lock can be
// free on the server (and taken by another process) before OnLoss. The
// same holds for permits, with one difference: a semaphore's slot is
// freed on the server by Release or by the end of its backend before the
// permit's end is reported, and another acquire of the Client may take
// it first, so a count of permits built on OnPermit may for a moment show
// one more holder than the limit; a permit's PermitAcquired still comes
// before its end. Events of different Clients are not ordered. A hook
// that is slow only delays later hooks; when more than [MaxPendingHookEvents]
// events wait, newer ones are dropped and counted in
// Stat().DroppedHookEvents. A hook that panics is recovered and logged at
// Error. Hooks may call the Client, except Close, which waits for them.
// Close delivers the events of the locks it ends before it returns; an
// event after that (a call that returns ErrClosed) is not delivered, and
// not counted as dropped.
//
// Every Lock that an acquire returned ends in exactly one OnRelease or
// OnLoss, so acquires minus releases minus losses is the number of locks
// held. The locks that elections and semaphores take for themselves (an
// election's lock and guard, a semaphore's place in its queue, a permit's
// slot) are not reported to OnAcquire, OnContention, OnRelease or OnLoss:
// an election reports OnLeadership, and a semaphore OnPermit. Likewise,
// every Permit that an acquire returned ends in exactly one OnPermit event
// of kind PermitReleased or PermitLost, so acquired minus released minus
// lost permits is the number of permits held.
type Hooks struct {
	// OnAcquire is called when an acquire returns: with Err nil when it
	// took the lock, else with the error it returned.
	OnAcquire func(AcquireEvent)
	// OnRelease is called when a lock ends by Unlock (or by Close, with
	// Err wrapping ErrClosed).
	OnRelease func(ReleaseEvent)
	// OnContention is called when an acquire finds a key held: a try that
	// fails, or a blocking acquire that starts to wait.
	OnContention func(ContentionEvent)
	// OnLoss is called when a lock is lost: its connection failed, was
	// terminated, or could not prove itself alive within the loss deadline.
	OnLoss func(LossEvent)
	// OnLeadership is called when an election of the Client gains or loses
	// leadership.
	OnLeadership func(LeadershipEvent)
	// OnPermit is called when an acquire of a semaphore's permit
	// (Acquire, TryAcquire) returns, with Kind PermitAcquired and Err nil
	// when it took a permit, else the error it returned; and when a
	// permit it returned ends: by Release (or by Close, with Err wrapping
	// ErrClosed), with Kind PermitReleased, or by the loss of its
	// backend, with Kind PermitLost.
	OnPermit func(PermitEvent)
}

// MaxPendingHookEvents bounds the events queued for a Client's hooks.
const MaxPendingHookEvents = 4096

// AcquireEvent describes the end of an acquire (Lock, TryLock, RLock,
// TryRLock, LockAll, Do) on a Client or a Session.
type AcquireEvent struct {
	Key     Key           // the key; for LockAll, the first in canonical order
	Keys    []Key         // every key, in canonical order
	Name    string        // Key's name from WithKeyNames, or ""
	Mode    LockMode      // exclusive or shared
	Try     bool          // a try (TryLock, TryRLock), which does not wait
	Wait    time.Duration // from the call to its return
	PID     int32         // the backend that holds the lock; 0 on error
	Handoff bool          // handed over by a releasing goroutine of this Client (see WithHandoff)
	Err     error         // nil if the lock was taken
}

// ReleaseEvent describes a lock that ended by Unlock or Close.
type ReleaseEvent struct {
	Key     Key
	Keys    []Key
	Name    string
	Mode    LockMode
	Held    time.Duration // from the acquire's return to the release
	PID     int32
	Handoff bool  // passed on to a waiting goroutine of this Client, still held on the server
	Err     error // nil, the Unlock error, or ErrClosed
}

// ContentionEvent describes an acquire that found a key held.
type ContentionEvent struct {
	Key  Key
	Keys []Key
	Name string
	Mode LockMode
	Try  bool // a try that failed; false: a blocking acquire that starts to wait
	// Local is true when the holder is a goroutine of this Client: the
	// acquire waits, or fails, in the process, using no connection. For
	// a blocking acquire on a Client, a local wait may be followed by a
	// wait on the server, which is reported again with Local false.
	Local bool
}

// LossEvent describes a lock that was lost.
type LossEvent struct {
	Key  Key
	Keys []Key
	Name string
	Mode LockMode
	Held time.Duration // from the acquire's return to the loss being declared
	PID  int32
	Err  error // wraps ErrLockLost and the cause, as Lock.Err
}

// LeadershipEvent describes a change of leadership of an election run by
// the Client: Leading is true when Identity became the leader for Term,
// false when it stopped leading (Err says why, or is nil for a
// resignation).
type LeadershipEvent struct {
	Election string
	Identity string
	Term     Term
	Leading  bool
	Err      error
}

// PermitEventKind says what happened to a semaphore's permit.
type PermitEventKind int

// The kinds of [PermitEvent].
const (
	// PermitAcquired: an acquire returned, with a permit or an error.
	PermitAcquired PermitEventKind = iota + 1
	// PermitReleased: a permit ended by Release, or by Close (Err wraps
	// ErrClosed); also a Release that failed without the permit being
	// lost (Err says why).
	PermitReleased
	// PermitLost: a permit ended with the loss of the backend that held
	// it (Err wraps ErrLockLost and the cause, as Permit.Err).
	PermitLost
)

// String returns "acquired", "released" or "lost".
func (k PermitEventKind) String() string {
	switch k {
	case PermitAcquired:
		return "acquired"
	case PermitReleased:
		return "released"
	case PermitLost:
		return "lost"
	}
	return "PermitEventKind(" + strconv.Itoa(int(k)) + ")"
}

// PermitEvent describes an acquire of a semaphore's permit, or the end of
// a permit that an acquire returned.
type PermitEvent struct {
	Kind      PermitEventKind
	Semaphore string        // the semaphore's name
	Slot      int           // the permit's slot; -1 for an acquire that failed
	Try       bool          // PermitAcquired: a TryAcquire, which does not wait
	Wait      time.Duration // PermitAcquired: from the call to its return
	Held      time.Duration // PermitReleased, PermitLost: from the acquire's return to the end
	PID       int32         // the backend that holds (or held) the permit; 0 on error
	Err       error         // nil for a permit taken or released; else why
}

// WithHooks sets functions called on the Client's lock events; see
// [Hooks]. Calling WithHooks again replaces them.
func WithHooks(h Hooks) Option { return hooksOption{h} }

// hooksOption is WithHooks's option: it sets the Client's lock hooks, and
// keeps with them the hooks of its elections and semaphores (eventHooks),
// which New and Open take from there.
type hooksOption struct{ h Hooks }

func (o hooksOption) apply(c *core.Config) error {
	h := o.h
	var lh core.LockHooks
	if f := h.OnAcquire; f != nil {
		lh.OnAcquire = func(ev core.AcquireEvent) {
			f(AcquireEvent{Key: keyOf(ev.Key), Keys: keysOf(ev.Keys), Name: ev.Name, Mode: LockMode(ev.Mode),
				Try: ev.Try, Wait: ev.Wait, PID: ev.PID, Handoff: ev.Handoff, Err: ev.Err})
		}
	}
	if f := h.OnRelease; f != nil {
		lh.OnRelease = func(ev core.ReleaseEvent) {
			f(ReleaseEvent{Key: keyOf(ev.Key), Keys: keysOf(ev.Keys), Name: ev.Name, Mode: LockMode(ev.Mode),
				Held: ev.Held, PID: ev.PID, Handoff: ev.Handoff, Err: ev.Err})
		}
	}
	if f := h.OnContention; f != nil {
		lh.OnContention = func(ev core.ContentionEvent) {
			f(ContentionEvent{Key: keyOf(ev.Key), Keys: keysOf(ev.Keys), Name: ev.Name, Mode: LockMode(ev.Mode),
				Try: ev.Try, Local: ev.Local})
		}
	}
	if f := h.OnLoss; f != nil {
		lh.OnLoss = func(ev core.LossEvent) {
			f(LossEvent{Key: keyOf(ev.Key), Keys: keysOf(ev.Keys), Name: ev.Name, Mode: LockMode(ev.Mode),
				Held: ev.Held, PID: ev.PID, Err: ev.Err})
		}
	}
	lh.MaxPending = MaxPendingHookEvents
	if h.OnLeadership != nil || h.OnPermit != nil {
		e := &eventHooks{h: h}
		lh.Queue, lh.InternalEnded, lh.Events = true, e.internalEnded, e
	}
	c.Hooks = lh
	return nil
}

// eventHooks report the events of a Client's elections and semaphores,
// on the Client's hook queue. A nil *eventHooks (no such hook set)
// ignores every event.
type eventHooks struct {
	h Hooks
	q *core.HookQueue

	// permits holds the permits that an acquire returned and whose end
	// is not reported yet (the permit's *core.Lock → *Permit): whoever
	// removes one reports its end, so each is reported once.
	permits sync.Map
}

// eventHooksOf returns the eventHooks that the options left in cfg, or nil
// if they set neither OnLeadership nor OnPermit. Its queue is set once the
// Client is made.
func eventHooksOf(cfg *core.Config) *eventHooks {
	e, _ := cfg.Hooks.Events.(*eventHooks)
	return e
}

// internalEnded reports the end of l, if l is a permit's lock.
func (e *eventHooks) internalEnded(l *core.Lock, lost bool, err error) {
	kind := PermitReleased
	if lost {
		kind = PermitLost
	}
	e.permitEnded(l, kind, err)
}

// leadership reports a change of leadership of an election of the Client
// to OnLeadership. The election code calls it whenever its elector gains
// or loses leadership.
func (e *eventHooks) leadership(ev LeadershipEvent) {
	if e == nil || e.h.OnLeadership == nil {
		return
	}
	e.q.Push(func() { e.h.OnLeadership(ev) })
}

// permitAcquired reports the end of an acquire of sem's permit that
// began at start, and registers the permit it returned so that its end is
// reported once: by Release, by the end of its backend, or here if it
// ended before it was registered.
func (e *eventHooks) permitAcquired(sem *Semaphore, try bool, start time.Time, p *Permit, err error) {
	if e == nil || e.h.OnPermit == nil {
		return
	}
	ev := PermitEvent{Kind: PermitAcquired, Semaphore: sem.name, Slot: -1, Try: try, Wait: time.Since(start), Err: err}
	if p != nil {
		ev.Slot, ev.PID = p.slot, p.l.S.Pid
		p.since = time.Now()
	}
	e.q.Push(func() { e.h.OnPermit(ev) })
	if p == nil {
		return
	}
	e.permits.Store(p.l, p)
	select {
	case <-p.l.Done():
		// It ended before it was registered: its backend's end found
		// nothing to report.
		why := p.l.Err()
		kind := PermitReleased
		if errors.Is(why, ErrLockLost) {
			kind = PermitLost
		}
		e.permitEnded(p.l, kind, why)
	default:
	}
}

// permitEnded reports the end of the permit whose lock is l, if l is a
// permit whose end is not reported yet.
func (e *eventHooks) permitEnded(l *core.Lock, kind PermitEventKind, err error) {
	if e == nil || e.h.OnPermit == nil {
		return
	}
	v, ok := e.permits.LoadAndDelete(l)
	if !ok {
		return
	}
	p := v.(*Permit)
	ev := PermitEvent{Kind: kind, Semaphore: p.sem.name, Slot: p.slot, Held: time.Since(p.since), PID: l.S.Pid, Err: err}
	e.q.Push(func() { e.h.OnPermit(ev) })
}
