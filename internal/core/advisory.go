package core

import (
	"context"
	"errors"
	"sync"
	"time"
)

// Session-level locks: the acquire
//
// The API's Lock, TryLock, RLock, TryRLock and LockAll, of a Client or a
// Session, all come to Client.acquire: the key's in-process gate
// (gate.go) lets one goroutine, or a group of readers, go on to the server;
// Session.take (holds.go) routes the statement to a backend and takes the
// keys, a wait running in slices (block.go); WithFence then issues the
// fence (fence.go). acquireErr turns what went wrong into the caller's
// error.

// LockOption is the core of [pgcoord.LockOption], which documents it.
type LockOption interface {
	applyLock(*lockConfig) error
}

type lockConfig struct {
	fence    bool
	prepare  []PreparedStatement
	internal bool
}

type lockOptionFunc func(*lockConfig) error

func (f lockOptionFunc) applyLock(c *lockConfig) error { return f(c) }

// WithFence is the core of [pgcoord.WithFence], which documents it.
func WithFence() LockOption {
	return lockOptionFunc(func(c *lockConfig) error { c.fence = true; return nil })
}

// WithPrepared has the acquire prepare statements (see Session.prepare) on
// the backend it takes the keys on, before it tries or waits there: the
// holder's first statements then run without a planning round trip.
func WithPrepared(sqls ...PreparedStatement) LockOption {
	return lockOptionFunc(func(c *lockConfig) error { c.prepare = sqls; return nil })
}

// A preparedStatement is a statement that an acquire prepares on its
// backend (withPrepared). If plan is not nil, it holds arguments for the
// statement: the first time the statement is prepared on a connection, the
// server also plans it with them (EXPLAIN, which runs nothing). A
// connection's first use of a table and its indexes reads their metadata
// from the catalogs, and planning reads more than parsing does; done while
// the acquire waits, that work no longer delays the statement's first run
// once the keys are taken (for an election, the new leader's record).
type PreparedStatement struct {
	Sql  string
	Plan []any
}

// WithoutHooks marks the locks that elections and semaphores take for
// themselves: their acquires, contention, releases and losses are not
// reported to the Client's hooks (an election reports OnLeadership).
func WithoutHooks() LockOption {
	return lockOptionFunc(func(c *lockConfig) error { c.internal = true; return nil })
}

// Request is one acquire: keys in canonical order and how to take them.
type Request struct {
	keys    []Key
	shared  bool
	try     bool
	mayWait bool // a try that a wait follows if it fails: it may join a hold whose wait is in flight
	fence   bool
	tried   bool                // a try of these keys just failed: wait at once
	direct  bool                // the key was contended a moment ago: try and wait in one statement
	waiting bool                // the acquire waits on a backend that waitBackend gave it
	again   bool                // the acquire tries again: its contention was reported
	prepare []PreparedStatement // statements to prepare on the backend first
	// internal: a lock of an election or a semaphore, not reported to
	// the hooks (withoutHooks)
	internal bool
}

// op names the acquire in errors: lock, try lock, read lock, try read
// lock, or lock all.
func (r Request) op() string {
	switch {
	case len(r.keys) > 1:
		return "lock all"
	case r.try && r.shared:
		return "try read lock"
	case r.try:
		return "try lock"
	case r.shared:
		return "read lock"
	}
	return "lock"
}

func NewRequest(keys []Key, shared, try bool, opts []LockOption) (Request, error) {
	ks, err := CanonicalKeys(keys)
	if err != nil {
		return Request{}, err
	}
	r := Request{keys: ks, shared: shared, try: try}
	var lc lockConfig
	for _, o := range opts {
		if o == nil {
			return r, Errorf("nil LockOption")
		}
		if err := o.applyLock(&lc); err != nil {
			return r, err
		}
	}
	if lc.fence && (shared || len(ks) > 1) {
		return r, Errorf("WithFence applies only to exclusive single-key locks (Lock, TryLock)")
	}
	r.fence, r.prepare, r.internal = lc.fence, lc.prepare, lc.internal
	return r, nil
}

// Lock is the core of [pgcoord.Client.Lock], which documents it.
func (c *Client) Lock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return c.acquire(ctx, nil, []Key{key}, false, false, opts)
}

// TryLock is the core of [pgcoord.Client.TryLock], which documents it.
func (c *Client) TryLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return c.acquire(ctx, nil, []Key{key}, false, true, opts)
}

// RLock is the core of [pgcoord.Client.RLock], which documents it.
func (c *Client) RLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return c.acquire(ctx, nil, []Key{key}, true, false, opts)
}

// TryRLock is the core of [pgcoord.Client.TryRLock], which documents it.
func (c *Client) TryRLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return c.acquire(ctx, nil, []Key{key}, true, true, opts)
}

// LockAll is the core of [pgcoord.Client.LockAll], which documents it.
func (c *Client) LockAll(ctx context.Context, keys ...Key) (*Lock, error) {
	return c.acquire(ctx, nil, keys, false, false, nil)
}

// Lock is the core of [pgcoord.Session.Lock], which documents it.
func (s *Session) Lock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return s.c.acquire(ctx, s, []Key{key}, false, false, opts)
}

// TryLock is the core of [pgcoord.Session.TryLock], which documents it.
func (s *Session) TryLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return s.c.acquire(ctx, s, []Key{key}, false, true, opts)
}

// RLock is the core of [pgcoord.Session.RLock], which documents it.
func (s *Session) RLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return s.c.acquire(ctx, s, []Key{key}, true, false, opts)
}

// TryRLock is the core of [pgcoord.Session.TryRLock], which documents it.
func (s *Session) TryRLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return s.c.acquire(ctx, s, []Key{key}, true, true, opts)
}

// LockAll is the core of [pgcoord.Session.LockAll], which documents it.
func (s *Session) LockAll(ctx context.Context, keys ...Key) (*Lock, error) {
	return s.c.acquire(ctx, s, keys, false, false, nil)
}

// acquire takes keys on s, or on the Client's shared backends if s is nil.
// Goroutines of this Client first pass the in-process gate of each key, in
// canonical order, so only one of them at a time goes to the server for a
// key; a single-key exclusive waiter may instead be handed the lock by its
// releasing holder.
func (c *Client) acquire(ctx context.Context, s *Session, keys []Key, shared, try bool, opts []LockOption) (*Lock, error) {
	if ctx == nil {
		return nil, Errorf("%s %s: ctx is nil", Request{keys: keys, shared: shared, try: try}.op(), KeyList(keys))
	}
	r, err := NewRequest(keys, shared, try, opts)
	if err != nil {
		return nil, Errorf("%s %s: %w", Request{keys: keys, shared: shared, try: try}.op(), KeyList(keys), err)
	}
	if err := c.Enter(); err != nil {
		return nil, err
	}
	defer c.Wg.Done()
	if !c.observed() || r.internal {
		return c.acquireGated(ctx, s, r, time.Time{})
	}
	start := time.Now()
	l, err := c.acquireGated(ctx, s, r, start)
	if err != nil {
		c.acquired(start, r, nil, false, err) // a lock taken is reported by its claim
	}
	return l, err
}

// acquireGated is acquire after the checks. A non-zero start, when the
// acquire began, makes it report contention and the lock it takes to the
// hooks and the logger: the lock's claim (Lock.claim) reports it while
// the acquire owns the keys' gates, so that the hooks see the end of the
// previous holder of a key before this acquire, and this acquire before
// the lock's end.
func (c *Client) acquireGated(ctx context.Context, s *Session, r Request, start time.Time) (*Lock, error) {
	actx := c.AcquireCtx(ctx)
	defer actx.End()
	ctx = actx
	observed := !start.IsZero()
	shared, try := r.shared, r.try
	var queued func()
	if observed {
		queued = func() { c.contended(r, true) }
	}

	var accept func(*Lock) bool
	if !shared && len(r.keys) == 1 {
		accept = func(l *Lock) bool { return l.S.managed }
		if s != nil {
			accept = func(l *Lock) bool { return l.S == s }
		}
	}
	for i := 0; i < len(r.keys); i++ {
		k := r.keys[i]
		handed, ok, err := c.Gates.Enter(ctx, k, shared, try, accept, queued)
		if err == nil && !ok {
			if observed {
				c.contended(r, true)
			}
			err = Errorf("%w (by this process)", ErrLocked)
		}
		if err != nil {
			for _, k := range r.keys[:i] {
				c.Gates.leave(k, shared)
			}
			return nil, c.acquireErr(ctx, r, err)
		}
		if handed == nil {
			continue
		}
		if r.internal {
			handed.unreported.Store(true)
		}
		if r.fence {
			err := handed.S.issueFence(ctx, handed)
			if e := handed.Err(); e != nil {
				err = e // lost while its fence was issued
			}
			if err != nil {
				handed.unreported.Store(true) // the acquire fails: no release to report
				if handed.claim(time.Time{}, r, true) {
					_ = handed.Unlock(ctx) // leaves the key's gate, or hands the lock on
				} else {
					c.Gates.leave(k, shared) // it ended before the claim
				}
				if ErrorIsLoss(err) && ctx.Err() == nil {
					// The backend was lost with the lock handed over: queue
					// for the key again, and take it on another backend.
					i--
					continue
				}
				return nil, c.acquireErr(ctx, r, err)
			}
		}
		if !handed.claim(start, r, true) {
			c.Gates.leave(k, shared) // it ended before the claim
		}
		return handed, nil
	}
	var l *Lock
	var err error
	if s != nil {
		l, err = s.take(ctx, r)
	} else {
		l, err = c.take(ctx, r)
	}
	if err != nil || !l.claim(start, r, false) {
		c.leaveAll(r)
	}
	if err != nil {
		if observed && try && errors.Is(err, ErrLocked) {
			c.contended(r, false)
		}
		return nil, c.acquireErr(ctx, r, err)
	}
	return l, nil
}

func (c *Client) leaveAll(r Request) {
	for _, k := range r.keys {
		c.Gates.leave(k, r.shared)
	}
}

// acquireErr names the keys in an acquire error and puts the context's
// cause (ErrClosed when the Client closed) in front.
func (c *Client) acquireErr(ctx context.Context, r Request, err error) error {
	if cause := CtxCause(ctx); cause != nil {
		err = CtxEnded(cause, err)
	}
	if r.internal {
		return err // the election's or semaphore's error names what failed
	}
	return Errorf("%s %s: %w", r.op(), KeyList(r.keys), err)
}

// AcquireCtx derives the context of an acquire: it ends with ctx or when
// the Client closes, whichever is first. Statements of the acquire run on
// ctx alone (see stmtCtx): the Client's Close cuts their connections, and
// the lease bounds them, so they need not watch the Client too. The
// caller calls its end once the acquire has returned.
func (c *Client) AcquireCtx(ctx context.Context) *acquireContext {
	return &acquireContext{stmt: ctx, closing: c.Closing}
}

// An acquireContext bounds an acquire: it ends with the caller's context
// (stmt), which bounds the acquire's statements, or when the Client closes
// (closing), whichever is first. The two are joined only once something
// waits on the acquire's context, asks why it ended or derives a context
// from it: an acquire whose waits and statements all go straight through,
// the common case, costs no context, goroutine or registration with
// either.
type acquireContext struct {
	stmt    context.Context
	closing context.Context

	mu     sync.Mutex
	joined context.Context         // nil until join
	cancel context.CancelCauseFunc // nil if stmt never ends
	stop   func() bool             // unregisters cancel from closing
	ended  bool                    // end was called
}

// join returns the joined context, made on first use.
func (a *acquireContext) join() context.Context {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.joined != nil {
		if a.cancel != nil && a.closing.Err() != nil {
			// The Client has closed: end the joined context now, not
			// when AfterFunc's goroutine runs, so that whoever asks
			// sees ErrClosed at once. (A no-op if it ended before.)
			a.cancel(ErrClosed)
		}
		return a.joined
	}
	if a.stmt.Done() == nil {
		// stmt never ends: the acquire ends only with the Client, at
		// the cost of no goroutine, timer or registration.
		a.joined = closingContext{values: a.stmt, closing: a.closing}
		return a.joined
	}
	joined, cancel := context.WithCancelCause(a.stmt)
	a.joined, a.cancel = joined, cancel
	switch {
	case a.ended:
		cancel(nil)
	case a.closing.Err() != nil:
		cancel(ErrClosed) // at once: AfterFunc would set the cause later
	default:
		a.stop = context.AfterFunc(a.closing, func() { cancel(ErrClosed) })
	}
	return joined
}

// End releases the joined context, if any. A context joined after end is
// already cancelled, as the acquire's context was once it returned; one
// whose caller's context never ends ends with the Client, as before.
func (a *acquireContext) End() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.ended = true
	if a.cancel != nil {
		if a.stop != nil {
			a.stop()
		}
		a.cancel(nil)
	}
}

// Deadline is the caller's: the Client's closing has none.
func (a *acquireContext) Deadline() (time.Time, bool) { return a.stmt.Deadline() }
func (a *acquireContext) Done() <-chan struct{}       { return a.join().Done() }
func (a *acquireContext) Value(key any) any           { return a.join().Value(key) }

// Err is the joined context's error. Before the two are joined it asks
// the caller's context, and joins them only once the Client has closed
// first: the joined context then ends with ErrClosed as its cause, and
// Err stays what it first was whatever the caller's context does later.
func (a *acquireContext) Err() error {
	a.mu.Lock()
	untouched := a.joined == nil && !a.ended
	a.mu.Unlock()
	if untouched && a.closing.Err() == nil {
		return a.stmt.Err()
	}
	return a.join().Err()
}
