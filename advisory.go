package pgcoord

import (
	"context"
	"errors"
	"sync"
	"time"
)

// Session-level locks: the API
//
// Client.Lock, TryLock, RLock, TryRLock, LockAll and Do, and the same on a
// Session, all come to Client.acquire: the key's in-process gate
// (gate.go) lets one goroutine, or a group of readers, go on to the server;
// Session.take (holds.go) routes the statement to a backend and takes the
// keys, a wait running in slices (block.go); WithFence then issues the
// fence (fence.go). acquireErr turns what went wrong into the caller's
// error.

// LockOption modifies one acquire.
type LockOption interface {
	applyLock(*lockConfig) error
}

type lockConfig struct {
	fence    bool
	prepare  []preparedStatement
	internal bool
}

type lockOptionFunc func(*lockConfig) error

func (f lockOptionFunc) applyLock(c *lockConfig) error { return f(c) }

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
func WithFence() LockOption {
	return lockOptionFunc(func(c *lockConfig) error { c.fence = true; return nil })
}

// withPrepared has the acquire prepare statements (see Session.prepare) on
// the backend it takes the keys on, before it tries or waits there: the
// holder's first statements then run without a planning round trip.
func withPrepared(sqls ...preparedStatement) LockOption {
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
type preparedStatement struct {
	sql  string
	plan []any
}

// withoutHooks marks the locks that elections and semaphores take for
// themselves: their acquires, contention, releases and losses are not
// reported to the Client's hooks (an election reports OnLeadership).
func withoutHooks() LockOption {
	return lockOptionFunc(func(c *lockConfig) error { c.internal = true; return nil })
}

// request is one acquire: keys in canonical order and how to take them.
type request struct {
	keys    []Key
	shared  bool
	try     bool
	mayWait bool // a try that a wait follows if it fails: it may join a hold whose wait is in flight
	fence   bool
	tried   bool                // a try of these keys just failed: wait at once
	direct  bool                // the key was contended a moment ago: try and wait in one statement
	waiting bool                // the acquire waits on a backend that waitBackend gave it
	again   bool                // the acquire tries again: its contention was reported
	prepare []preparedStatement // statements to prepare on the backend first
	// internal: a lock of an election or a semaphore, not reported to
	// the hooks (withoutHooks)
	internal bool
}

// op names the acquire in errors: lock, try lock, read lock, try read
// lock, or lock all.
func (r request) op() string {
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

func newRequest(keys []Key, shared, try bool, opts []LockOption) (request, error) {
	ks, err := canonicalKeys(keys)
	if err != nil {
		return request{}, err
	}
	r := request{keys: ks, shared: shared, try: try}
	var lc lockConfig
	for _, o := range opts {
		if o == nil {
			return r, errorf("nil LockOption")
		}
		if err := o.applyLock(&lc); err != nil {
			return r, err
		}
	}
	if lc.fence && (shared || len(ks) > 1) {
		return r, errorf("WithFence applies only to exclusive single-key locks (Lock, TryLock)")
	}
	r.fence, r.prepare, r.internal = lc.fence, lc.prepare, lc.internal
	return r, nil
}

// Lock blocks until it holds key exclusively, on one of the Client's
// dedicated connections, and returns the held lock. ctx bounds only the
// wait: once Lock returns, the lock is held until Unlock or loss, whatever
// happens to ctx. If the wait fails or is cancelled, nothing stays locked.
// Lock rides through a lost connection, a server restart or a failover: it
// keeps trying to reach a writable server, backing off, until ctx ends.
// A connection error that no retry can cure it returns at once, naming
// the step ("open connection: ..."): a pgx config that cannot run its
// statements (a query mode whose cache has no capacity), and the server's
// refusal of the role or its authentication (SQLSTATE class 28), of the
// database (3D000), of a privilege (42501) or of a setting (42704, 22023).
// Errors: ctx's error (or cause) if it ended first, joined with the last
// connection error if the server could not be reached; such a connection
// error; [ErrClosed];
// [ErrDeadlock] if the application has a lock cycle; [ErrTooManyLocks];
// [ErrInvalidKey]; [ErrNotMigrated] (with WithFence); or
// [ErrTransactionPooling].
func (c *Client) Lock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return c.acquire(ctx, nil, []Key{key}, false, false, opts)
}

// TryLock takes key exclusively if nobody holds it, without waiting. It
// returns an error wrapping [ErrLocked] if another holder has it, in this
// process or any other. ctx bounds the wait for a connection to send the
// try on, not the round trip itself, which a cancel request would cost
// more than: the loss deadline bounds that (a connection that does not
// answer within it is lost). It fails fast when the server cannot be
// reached (after one more attempt on another connection if its
// connection was lost). Other errors are as for Lock.
func (c *Client) TryLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return c.acquire(ctx, nil, []Key{key}, false, true, opts)
}

// RLock blocks until it holds key shared: any number of shared holders
// coexist, and exclude exclusive ones. A waiting exclusive holder is not
// starved: PostgreSQL queues new shared requests behind it, and readers of
// one Client join each other's hold without asking the server only for a
// short while after it was taken (the bounds of [WithHandoff]), so they
// too queue behind a writer that waits. As with sync.RWMutex, a goroutine
// must not take a key shared again while it holds it shared: if a writer
// waits meanwhile, the second RLock waits behind it, and the writer waits
// for the first. ctx, opts and errors are as for Lock, except that
// [WithFence] is refused (a fence orders exclusive holders).
func (c *Client) RLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return c.acquire(ctx, nil, []Key{key}, true, false, opts)
}

// TryRLock takes key shared if no exclusive holder has it, without
// waiting; otherwise it returns an error wrapping [ErrLocked]. ctx, opts
// and other errors are as for RLock.
func (c *Client) TryRLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return c.acquire(ctx, nil, []Key{key}, true, true, opts)
}

// LockAll blocks until it holds every key exclusively, or none. Keys are
// deduplicated and taken in one canonical order (the order XactLock also
// uses), so two LockAll calls with overlapping keys never deadlock each
// other. Up to 1000 keys take one round trip; larger sets take one per
// 1000. ctx and errors are as for Lock; on error no key stays locked.
// LockAll takes no LockOption: its variadic parameter is the keys, and
// the one option there is, [WithFence], orders single-key holders.
func (c *Client) LockAll(ctx context.Context, keys ...Key) (*Lock, error) {
	return c.acquire(ctx, nil, keys, false, false, nil)
}

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
		return errorf("do %s: fn is nil", keyList([]Key{key}))
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
		return joinErrors(err, errorf("do %s: the lock ended while fn ran: %w", keyList(l.keys), lost))
	}
	return joinErrors(err, l.Unlock(ctx))
}

// Lock is [Client.Lock] on this session's connection.
func (s *Session) Lock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return s.c.acquire(ctx, s, []Key{key}, false, false, opts)
}

// TryLock is [Client.TryLock] on this session's connection.
func (s *Session) TryLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return s.c.acquire(ctx, s, []Key{key}, false, true, opts)
}

// RLock is [Client.RLock] on this session's connection, with one
// difference: the session holds each key once, so every shared hold of a
// key on one session joins the first without asking the server, and a
// writer elsewhere waits until all of them are released. Readers that must
// let a waiting writer in take the key through the Client.
func (s *Session) RLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return s.c.acquire(ctx, s, []Key{key}, true, false, opts)
}

// TryRLock is [Client.TryRLock] on this session's connection.
func (s *Session) TryRLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return s.c.acquire(ctx, s, []Key{key}, true, true, opts)
}

// LockAll is [Client.LockAll] on this session's connection. The session's
// locks and its waits are one session to the server: a wait on a session
// that holds other locks is, to PostgreSQL, a session that holds and waits.
// If the server picks it as a deadlock victim, the acquire returns an error
// wrapping [ErrDeadlock], leaves nothing of its keys behind, and the
// session and its other locks live: release some to let the other side go
// on.
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
		return nil, errorf("%s %s: ctx is nil", request{keys: keys, shared: shared, try: try}.op(), keyList(keys))
	}
	r, err := newRequest(keys, shared, try, opts)
	if err != nil {
		return nil, errorf("%s %s: %w", request{keys: keys, shared: shared, try: try}.op(), keyList(keys), err)
	}
	if err := c.enter(); err != nil {
		return nil, err
	}
	defer c.wg.Done()
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
func (c *Client) acquireGated(ctx context.Context, s *Session, r request, start time.Time) (*Lock, error) {
	actx := c.acquireCtx(ctx)
	defer actx.end()
	ctx = actx
	observed := !start.IsZero()
	shared, try := r.shared, r.try
	var queued func()
	if observed {
		queued = func() { c.contended(r, true) }
	}

	var accept func(*Lock) bool
	if !shared && len(r.keys) == 1 {
		accept = func(l *Lock) bool { return l.s.managed }
		if s != nil {
			accept = func(l *Lock) bool { return l.s == s }
		}
	}
	for i := 0; i < len(r.keys); i++ {
		k := r.keys[i]
		handed, ok, err := c.gates.enter(ctx, k, shared, try, accept, queued)
		if err == nil && !ok {
			if observed {
				c.contended(r, true)
			}
			err = errorf("%w (by this process)", ErrLocked)
		}
		if err != nil {
			for _, k := range r.keys[:i] {
				c.gates.leave(k, shared)
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
			err := handed.s.issueFence(ctx, handed)
			if e := handed.Err(); e != nil {
				err = e // lost while its fence was issued
			}
			if err != nil {
				handed.unreported.Store(true) // the acquire fails: no release to report
				if handed.claim(time.Time{}, r, true) {
					_ = handed.Unlock(ctx) // leaves the key's gate, or hands the lock on
				} else {
					c.gates.leave(k, shared) // it ended before the claim
				}
				if errorIsLoss(err) && ctx.Err() == nil {
					// The backend was lost with the lock handed over: queue
					// for the key again, and take it on another backend.
					i--
					continue
				}
				return nil, c.acquireErr(ctx, r, err)
			}
		}
		if !handed.claim(start, r, true) {
			c.gates.leave(k, shared) // it ended before the claim
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

func (c *Client) leaveAll(r request) {
	for _, k := range r.keys {
		c.gates.leave(k, r.shared)
	}
}

// acquireErr names the keys in an acquire error and puts the context's
// cause (ErrClosed when the Client closed) in front.
func (c *Client) acquireErr(ctx context.Context, r request, err error) error {
	if cause := ctxCause(ctx); cause != nil {
		err = ctxEnded(cause, err)
	}
	if r.internal {
		return err // the election's or semaphore's error names what failed
	}
	return errorf("%s %s: %w", r.op(), keyList(r.keys), err)
}

// acquireCtx derives the context of an acquire: it ends with ctx or when
// the Client closes, whichever is first. Statements of the acquire run on
// ctx alone (see stmtCtx): the Client's Close cuts their connections, and
// the lease bounds them, so they need not watch the Client too. The
// caller calls its end once the acquire has returned.
func (c *Client) acquireCtx(ctx context.Context) *acquireContext {
	return &acquireContext{stmt: ctx, closing: c.closing}
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

// end releases the joined context, if any. A context joined after end is
// already cancelled, as the acquire's context was once it returned; one
// whose caller's context never ends ends with the Client, as before.
func (a *acquireContext) end() {
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
