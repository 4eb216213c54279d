package core

// The hook queue: a Client's events, delivered in order on one goroutine

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// The lock events of a Client, as its hooks see them: the root package's
// Hooks take them converted to its event types, which document them.

type AcquireEvent struct {
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

type ReleaseEvent struct {
	Key     Key
	Keys    []Key
	Name    string
	Mode    LockMode
	Held    time.Duration
	PID     int32
	Handoff bool
	Err     error
}

type ContentionEvent struct {
	Key   Key
	Keys  []Key
	Name  string
	Mode  LockMode
	Try   bool
	Local bool
}

type LossEvent struct {
	Key  Key
	Keys []Key
	Name string
	Mode LockMode
	Held time.Duration
	PID  int32
	Err  error
}

// LockHooks take a Client's lock events; any of them may be nil.
type LockHooks struct {
	OnAcquire    func(AcquireEvent)
	OnRelease    func(ReleaseEvent)
	OnContention func(ContentionEvent)
	OnLoss       func(LossEvent)
	// InternalEnded is told of the end of a lock that is not reported
	// (an election's or a semaphore's), lost or not, on the goroutine that
	// ended it.
	InternalEnded func(l *Lock, lost bool, err error)
	// Queue asks for a queue with no lock hook: the Client's elections
	// and semaphores push their events to it.
	Queue bool
	// MaxPending bounds the events that wait in the queue; more are
	// dropped, and counted.
	MaxPending int
	// Events is what the root package keeps with these hooks: those of
	// the Client's elections and semaphores.
	Events any
}

// internalEnded tells q's internalEnded of the end of l.
func (q *HookQueue) internalEnded(l *Lock, lost bool, err error) {
	if q != nil && q.h.InternalEnded != nil {
		q.h.InternalEnded(l, lost, err)
	}
}

// HookQueue delivers a Client's events to its hooks on one goroutine. A
// nil *hookQueue (no hooks set) ignores every event.
type HookQueue struct {
	h       LockHooks
	logger  func() *slog.Logger
	mu      sync.Mutex
	pending []func()
	queued  int // events not yet delivered: pending, and the rest of the batch in delivery
	closed  bool
	wake    chan struct{}
	done    chan struct{}
	dropped atomic.Int64
}

func newHookQueue(h LockHooks, logger func() *slog.Logger) *HookQueue {
	if h.OnAcquire == nil && h.OnRelease == nil && h.OnContention == nil && h.OnLoss == nil && !h.Queue {
		return nil
	}
	q := &HookQueue{h: h, logger: logger, wake: make(chan struct{}, 1), done: make(chan struct{})}
	go q.Run()
	return q
}

// Push queues f, or drops it when the queue is full (counted in dropped)
// or closed (an event after Close, which no hook is left to take).
func (q *HookQueue) Push(f func()) {
	if q == nil {
		return
	}
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return
	}
	if q.queued >= q.h.MaxPending {
		q.mu.Unlock()
		if q.dropped.Add(1) == 1 {
			q.logger().Warn("pgcoord: hook events dropped: the hooks are slower than the events", "pending", q.h.MaxPending)
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

// Run delivers events until the queue is closed and empty.
func (q *HookQueue) Run() {
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

func (q *HookQueue) call(f func()) {
	defer func() {
		if p := recover(); p != nil {
			q.logger().Error("pgcoord: a hook panicked", "panic", fmt.Sprint(p))
		}
	}()
	f()
}

// close delivers what is queued and stops the goroutine.
func (q *HookQueue) close() {
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
func (q *HookQueue) droppedEvents() int64 {
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
func (c *Client) observed() bool { return c.Hooks != nil || c.Cfg.debugging() }

// acquired reports the end of an acquire that began at start.
func (c *Client) acquired(start time.Time, r Request, l *Lock, handoff bool, err error) {
	wait := time.Since(start)
	var pid int32
	if l != nil {
		pid = l.S.Pid // l.since was set when the lock was granted
	}
	if c.Cfg.debugging() {
		attrs := []any{"keys", KeyList(r.keys), "mode", modeOf(r.shared).String(), "try", r.try, "wait", wait, "pid", pid}
		if n := c.Cfg.KeyName(r.keys[0]); n != "" {
			attrs = append(attrs, "name", n)
		}
		if handoff {
			attrs = append(attrs, "handoff", true)
		}
		if err != nil {
			attrs = append(attrs, "err", err)
		}
		c.Cfg.Logger.Debug("pgcoord: acquire", attrs...)
	}
	if q := c.Hooks; q != nil && q.h.OnAcquire != nil {
		ev := AcquireEvent{Key: r.keys[0], Keys: append([]Key(nil), r.keys...), Name: c.Cfg.KeyName(r.keys[0]),
			Mode: modeOf(r.shared), Try: r.try, Wait: wait, PID: pid, Handoff: handoff, Err: err}
		q.Push(func() { q.h.OnAcquire(ev) })
	}
}

// contended reports that an acquire found a key held.
func (c *Client) contended(r Request, local bool) {
	if r.internal {
		return
	}
	if c.Cfg.debugging() {
		c.Cfg.Logger.Debug("pgcoord: contention", "keys", KeyList(r.keys), "mode", modeOf(r.shared).String(), "try", r.try, "local", local)
	}
	if q := c.Hooks; q != nil && q.h.OnContention != nil {
		ev := ContentionEvent{Key: r.keys[0], Keys: append([]Key(nil), r.keys...), Name: c.Cfg.KeyName(r.keys[0]),
			Mode: modeOf(r.shared), Try: r.try, Local: local}
		q.Push(func() { q.h.OnContention(ev) })
	}
}

// released reports a lock that Unlock or Close ended.
func (l *Lock) released(handoff bool, err error) {
	c := l.S.c
	if l.unreported.Load() {
		c.Hooks.internalEnded(l, false, err) // a permit, if any
		return
	}
	if !c.observed() {
		return
	}
	held := time.Duration(0)
	if !l.since.IsZero() {
		held = time.Since(l.since)
	}
	if c.Cfg.debugging() {
		attrs := []any{"keys", KeyList(l.KeyList), "mode", modeOf(l.Shared).String(), "held", held, "pid", l.S.Pid}
		if handoff {
			attrs = append(attrs, "handoff", true)
		}
		if err != nil {
			attrs = append(attrs, "err", err)
		}
		c.Cfg.Logger.Debug("pgcoord: release", attrs...)
	}
	if q := c.Hooks; q != nil && q.h.OnRelease != nil {
		ev := ReleaseEvent{Key: l.KeyList[0], Keys: append([]Key(nil), l.KeyList...), Name: c.Cfg.KeyName(l.KeyList[0]),
			Mode: modeOf(l.Shared), Held: held, PID: l.S.Pid, Handoff: handoff, Err: err}
		q.Push(func() { q.h.OnRelease(ev) })
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
	q := l.S.c.Hooks
	if l.unreported.Load() {
		q.internalEnded(l, true, err) // a permit, if any
		return
	}
	if q == nil || q.h.OnLoss == nil {
		return
	}
	held := time.Duration(0)
	if !l.since.IsZero() {
		held = time.Since(l.since)
	}
	ev := LossEvent{Key: l.KeyList[0], Keys: append([]Key(nil), l.KeyList...), Name: l.S.c.Cfg.KeyName(l.KeyList[0]),
		Mode: modeOf(l.Shared), Held: held, PID: l.S.Pid, Err: err}
	q.Push(func() { q.h.OnLoss(ev) })
}
