package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
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
func WithHooks(h Hooks) Option {
	return optionFunc{"WithHooks", func(c *config) error {
		c.hooks = h
		return nil
	}}
}

// hookQueue delivers a Client's events to its hooks on one goroutine. A
// nil *hookQueue (no hooks set) ignores every event.
type hookQueue struct {
	h       Hooks
	logger  func() *slog.Logger
	mu      sync.Mutex
	pending []func()
	queued  int // events not yet delivered: pending, and the rest of the batch in delivery
	closed  bool
	wake    chan struct{}
	done    chan struct{}
	dropped atomic.Int64

	// permits holds the permits that an acquire returned and whose end
	// is not reported yet (*Lock → *Permit): whoever removes one reports
	// its end, so each is reported once.
	permits sync.Map
}

func newHookQueue(h Hooks, logger func() *slog.Logger) *hookQueue {
	if h.OnAcquire == nil && h.OnRelease == nil && h.OnContention == nil && h.OnLoss == nil && h.OnLeadership == nil && h.OnPermit == nil {
		return nil
	}
	q := &hookQueue{h: h, logger: logger, wake: make(chan struct{}, 1), done: make(chan struct{})}
	go q.run()
	return q
}

// push queues f, or drops it when the queue is full (counted in dropped)
// or closed (an event after Close, which no hook is left to take).
func (q *hookQueue) push(f func()) {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return
	}
	if q.queued >= MaxPendingHookEvents {
		q.mu.Unlock()
		if q.dropped.Add(1) == 1 {
			q.logger().Warn("pgcoord: hook events dropped: the hooks are slower than the events", "pending", MaxPendingHookEvents)
		}
		return
	}
	q.pending = append(q.pending, f)
	q.queued++
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// run delivers events until the queue is closed and empty.
func (q *hookQueue) run() {
	defer close(q.done)
	for {
		<-q.wake
		for {
			q.mu.Lock()
			batch, closed := q.pending, q.closed
			q.pending = nil
			q.mu.Unlock()
			if len(batch) == 0 {
				if closed {
					return
				}
				break
			}
			for _, f := range batch {
				q.mu.Lock()
				q.queued-- // delivering, no longer waiting
				q.mu.Unlock()
				q.call(f)
			}
		}
	}
}

func (q *hookQueue) call(f func()) {
	defer func() {
		if p := recover(); p != nil {
			q.logger().Error("pgcoord: a hook panicked", "panic", fmt.Sprint(p))
		}
	}()
	f()
}

// close delivers what is queued and stops the goroutine.
func (q *hookQueue) close() {
	if q == nil {
		return
	}
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
	<-q.done
}

// droppedEvents returns how many events were dropped.
func (q *hookQueue) droppedEvents() int64 {
	if q == nil {
		return 0
	}
	return q.dropped.Load()
}

// leadership reports a change of leadership of an election of the Client
// to OnLeadership. The election code calls it whenever its elector gains
// or loses leadership.
func (q *hookQueue) leadership(ev LeadershipEvent) {
	if q == nil || q.h.OnLeadership == nil {
		return
	}
	q.push(func() { q.h.OnLeadership(ev) })
}

// permitAcquired reports the end of an acquire of sem's permit that
// began at start, and registers the permit it returned so that its end is
// reported once: by Release, by the end of its backend, or here if it
// ended before it was registered.
func (q *hookQueue) permitAcquired(sem *Semaphore, try bool, start time.Time, p *Permit, err error) {
	if q == nil || q.h.OnPermit == nil {
		return
	}
	ev := PermitEvent{Kind: PermitAcquired, Semaphore: sem.name, Slot: -1, Try: try, Wait: time.Since(start), Err: err}
	if p != nil {
		ev.Slot, ev.PID = p.slot, p.l.s.pid
		p.since = time.Now()
	}
	q.push(func() { q.h.OnPermit(ev) })
	if p == nil {
		return
	}
	q.permits.Store(p.l, p)
	select {
	case <-p.l.Done():
		// It ended before it was registered: its backend's end found
		// nothing to report.
		why := p.l.Err()
		kind := PermitReleased
		if errors.Is(why, ErrLockLost) {
			kind = PermitLost
		}
		q.permitEnded(p.l, kind, why)
	default:
	}
}

// permitEnded reports the end of the permit whose lock is l, if l is a
// permit whose end is not reported yet.
func (q *hookQueue) permitEnded(l *Lock, kind PermitEventKind, err error) {
	if q == nil || q.h.OnPermit == nil {
		return
	}
	v, ok := q.permits.LoadAndDelete(l)
	if !ok {
		return
	}
	p := v.(*Permit)
	ev := PermitEvent{Kind: kind, Semaphore: p.sem.name, Slot: p.slot, Held: time.Since(p.since), PID: l.s.pid, Err: err}
	q.push(func() { q.h.OnPermit(ev) })
}

func modeOf(shared bool) LockMode {
	if shared {
		return ModeShared
	}
	return ModeExclusive
}

// observed reports whether lock events of this Client are observed, by
// hooks or by a logger at Debug; only then do acquires read the clock
// for them.
func (c *Client) observed() bool { return c.hooks != nil || c.cfg.debugging() }

// acquired reports the end of an acquire that began at start.
func (c *Client) acquired(start time.Time, r request, l *Lock, handoff bool, err error) {
	wait := time.Since(start)
	var pid int32
	if l != nil {
		pid = l.s.pid // l.since was set when the lock was granted
	}
	if c.cfg.debugging() {
		attrs := []any{"keys", keyList(r.keys), "mode", modeOf(r.shared).String(), "try", r.try, "wait", wait, "pid", pid}
		if n := c.cfg.keyName(r.keys[0]); n != "" {
			attrs = append(attrs, "name", n)
		}
		if handoff {
			attrs = append(attrs, "handoff", true)
		}
		if err != nil {
			attrs = append(attrs, "err", err)
		}
		c.cfg.logger.Debug("pgcoord: acquire", attrs...)
	}
	if q := c.hooks; q != nil && q.h.OnAcquire != nil {
		ev := AcquireEvent{Key: r.keys[0], Keys: append([]Key(nil), r.keys...), Name: c.cfg.keyName(r.keys[0]),
			Mode: modeOf(r.shared), Try: r.try, Wait: wait, PID: pid, Handoff: handoff, Err: err}
		q.push(func() { q.h.OnAcquire(ev) })
	}
}

// contended reports that an acquire found a key held.
func (c *Client) contended(r request, local bool) {
	if r.internal {
		return
	}
	if c.cfg.debugging() {
		c.cfg.logger.Debug("pgcoord: contention", "keys", keyList(r.keys), "mode", modeOf(r.shared).String(), "try", r.try, "local", local)
	}
	if q := c.hooks; q != nil && q.h.OnContention != nil {
		ev := ContentionEvent{Key: r.keys[0], Keys: append([]Key(nil), r.keys...), Name: c.cfg.keyName(r.keys[0]),
			Mode: modeOf(r.shared), Try: r.try, Local: local}
		q.push(func() { q.h.OnContention(ev) })
	}
}

// released reports a lock that Unlock or Close ended.
func (l *Lock) released(handoff bool, err error) {
	c := l.s.c
	if l.unreported.Load() {
		c.hooks.permitEnded(l, PermitReleased, err) // a permit, if any
		return
	}
	if !c.observed() {
		return
	}
	held := time.Duration(0)
	if !l.since.IsZero() {
		held = time.Since(l.since)
	}
	if c.cfg.debugging() {
		attrs := []any{"keys", keyList(l.keys), "mode", modeOf(l.shared).String(), "held", held, "pid", l.s.pid}
		if handoff {
			attrs = append(attrs, "handoff", true)
		}
		if err != nil {
			attrs = append(attrs, "err", err)
		}
		c.cfg.logger.Debug("pgcoord: release", attrs...)
	}
	if q := c.hooks; q != nil && q.h.OnRelease != nil {
		ev := ReleaseEvent{Key: l.keys[0], Keys: append([]Key(nil), l.keys...), Name: c.cfg.keyName(l.keys[0]),
			Mode: modeOf(l.shared), Held: held, PID: l.s.pid, Handoff: handoff, Err: err}
		q.push(func() { q.h.OnRelease(ev) })
	}
}

// reportEnd reports the end of l with its session: a release when the
// session was closed, else a loss.
func (l *Lock) reportEnd(why error) {
	if errors.Is(why, ErrClosed) {
		l.released(false, why)
	} else {
		l.lost(why)
	}
}

// lost reports a lock that ended with its session's loss. The session's
// loss is logged once, at Warn, by the session.
func (l *Lock) lost(err error) {
	q := l.s.c.hooks
	if l.unreported.Load() {
		q.permitEnded(l, PermitLost, err) // a permit, if any
		return
	}
	if q == nil || q.h.OnLoss == nil {
		return
	}
	held := time.Duration(0)
	if !l.since.IsZero() {
		held = time.Since(l.since)
	}
	ev := LossEvent{Key: l.keys[0], Keys: append([]Key(nil), l.keys...), Name: l.s.c.cfg.keyName(l.keys[0]),
		Mode: modeOf(l.shared), Held: held, PID: l.s.pid, Err: err}
	q.push(func() { q.h.OnLoss(ev) })
}

// debugging reports whether the configured logger takes Debug records.
func (c *config) debugging() bool {
	return c.logger != nil && c.logger.Enabled(context.Background(), slog.LevelDebug)
}

// warnLogger returns the logger for warnings: WithLogger's, else
// slog.Default(), so that a lost lock is never silent.
func (c *config) warnLogger() *slog.Logger {
	if c.logger != nil {
		return c.logger
	}
	return slog.Default()
}

// infoLogger returns WithLogger's logger, or one that discards.
func (c *config) infoLogger() *slog.Logger {
	if c.logger != nil {
		return c.logger
	}
	return discard
}

var discard = slog.New(slog.DiscardHandler)
