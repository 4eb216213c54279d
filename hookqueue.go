package pgcoord

// The hook queue: a Client's events, delivered in order on one goroutine

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// MaxPendingHookEvents bounds the events queued for a Client's hooks.
const MaxPendingHookEvents = 4096

// The lock events of a Client, as its hooks see them: the root package's
// Hooks take them converted to its event types, which document them.

type acquireEvent struct {
	Key     Key
	Keys    []Key
	Name    string
	Mode    LockMode
	Try     bool
	Wait    time.Duration
	PID     int32
	Handoff bool
	Err     error
}

type releaseEvent struct {
	Key     Key
	Keys    []Key
	Name    string
	Mode    LockMode
	Held    time.Duration
	PID     int32
	Handoff bool
	Err     error
}

type contentionEvent struct {
	Key   Key
	Keys  []Key
	Name  string
	Mode  LockMode
	Try   bool
	Local bool
}

type lossEvent struct {
	Key  Key
	Keys []Key
	Name string
	Mode LockMode
	Held time.Duration
	PID  int32
	Err  error
}

// lockHooks take a Client's lock events; any of them may be nil.
type lockHooks struct {
	onAcquire    func(acquireEvent)
	onRelease    func(releaseEvent)
	onContention func(contentionEvent)
	onLoss       func(lossEvent)
	// internalEnded is told of the end of a lock that is not reported
	// (an election's or a semaphore's), lost or not, on the goroutine that
	// ended it.
	internalEnded func(l *Lock, lost bool, err error)
	// queue asks for a queue with no lock hook: the Client's elections
	// and semaphores push their events to it.
	queue bool
}

// internalEnded tells q's internalEnded of the end of l.
func (q *hookQueue) internalEnded(l *Lock, lost bool, err error) {
	if q != nil && q.h.internalEnded != nil {
		q.h.internalEnded(l, lost, err)
	}
}

// hookQueue delivers a Client's events to its hooks on one goroutine. A
// nil *hookQueue (no hooks set) ignores every event.
type hookQueue struct {
	h       lockHooks
	logger  func() *slog.Logger
	mu      sync.Mutex
	pending []func()
	queued  int // events not yet delivered: pending, and the rest of the batch in delivery
	closed  bool
	wake    chan struct{}
	done    chan struct{}
	dropped atomic.Int64
}

func newHookQueue(h lockHooks, logger func() *slog.Logger) *hookQueue {
	if h.onAcquire == nil && h.onRelease == nil && h.onContention == nil && h.onLoss == nil && !h.queue {
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
	if q := c.hooks; q != nil && q.h.onAcquire != nil {
		ev := acquireEvent{Key: r.keys[0], Keys: append([]Key(nil), r.keys...), Name: c.cfg.keyName(r.keys[0]),
			Mode: modeOf(r.shared), Try: r.try, Wait: wait, PID: pid, Handoff: handoff, Err: err}
		q.push(func() { q.h.onAcquire(ev) })
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
	if q := c.hooks; q != nil && q.h.onContention != nil {
		ev := contentionEvent{Key: r.keys[0], Keys: append([]Key(nil), r.keys...), Name: c.cfg.keyName(r.keys[0]),
			Mode: modeOf(r.shared), Try: r.try, Local: local}
		q.push(func() { q.h.onContention(ev) })
	}
}

// released reports a lock that Unlock or Close ended.
func (l *Lock) released(handoff bool, err error) {
	c := l.s.c
	if l.unreported.Load() {
		c.hooks.internalEnded(l, false, err) // a permit, if any
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
	if q := c.hooks; q != nil && q.h.onRelease != nil {
		ev := releaseEvent{Key: l.keys[0], Keys: append([]Key(nil), l.keys...), Name: c.cfg.keyName(l.keys[0]),
			Mode: modeOf(l.shared), Held: held, PID: l.s.pid, Handoff: handoff, Err: err}
		q.push(func() { q.h.onRelease(ev) })
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
		q.internalEnded(l, true, err) // a permit, if any
		return
	}
	if q == nil || q.h.onLoss == nil {
		return
	}
	held := time.Duration(0)
	if !l.since.IsZero() {
		held = time.Since(l.since)
	}
	ev := lossEvent{Key: l.keys[0], Keys: append([]Key(nil), l.keys...), Name: l.s.c.cfg.keyName(l.keys[0]),
		Mode: modeOf(l.shared), Held: held, PID: l.s.pid, Err: err}
	q.push(func() { q.h.onLoss(ev) })
}
