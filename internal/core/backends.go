package core

import (
	"context"
	"errors"
	"sync/atomic"
	"time"
)

// The Client's backends, and which statement may run on which
//
// Locks taken through a Client (Lock, TryLock, RLock, TryRLock, LockAll,
// Do, and the locks of elections and semaphores) live on a few dedicated
// connections that the Client shares among all its locks; a held lock
// costs an entry in the server's lock table, not a connection.
//
// PostgreSQL sees each backend as one session: its deadlock detector, its
// lock_timeout and its lock queue know the backend, not the goroutine. A
// backend that holds goroutine A's lock and waits for goroutine B's key is,
// to the server, a session that holds one lock and waits for another, and
// the server may pick it as a deadlock victim for a cycle that no
// goroutine of the application has. So one rule decides where a statement
// runs, enforced by route and waitBackend below and by Session.reserve:
//
//   - A statement that does not block (a try, an unlock, the heartbeat)
//     runs on any backend that is not waiting.
//   - A statement that waits for a lock held elsewhere (a key, or a row:
//     the fences row of a key whose fence a transaction checked, a
//     leaders row, a semaphore's row) runs only on a backend that holds
//     nothing and on which no statement that may take a key is in flight.
//     On a backend that holds keys, a statement that needs a row locks it
//     with NOWAIT and, if a transaction holds it, goes to wait elsewhere
//     (Client.blockAway, Semaphore.admit): even a short wait there would
//     let the row holder's deadlock check find a cycle through the
//     backend's keys, one the application does not have. The backend is marked as waiting for the length of
//     the acquire, and nothing else takes a key on it meanwhile. A backend
//     whose wait was granted keeps its key and serves tries from then on,
//     like any other; it can wait again once it holds nothing.
//   - The rule covers every key a Client takes, not only the keys of
//     Lock and friends: an election's lock and guard, a semaphore's queue
//     key, and a semaphore's permits. A try or a wait reserves its keys
//     in the backend's records before its statement is sent (Session.
//     reserve), so a claim sees them. A semaphore's grant cannot: it
//     learns which slot it took only when its statement ends, and the
//     statement may first wait for the semaphore's row. So a grant counts
//     as in flight on its backend from before it asks for the connection
//     until its slot is recorded or released (beginGrant), a backend with
//     a grant in flight cannot be claimed to wait, and a grant never runs
//     on a backend claimed to wait (it picks another).
//   - One exception: the head of the queue of a semaphore of limit 1
//     waits for the semaphore's slot on the backend that holds the queue
//     key (Semaphore.await), and only while that backend holds nothing
//     else, marked as waiting like the above. Whoever waits for a queue
//     key waits on a backend that holds nothing, so that wait cannot close
//     a cycle of waits either.
//   - Every blocking statement, on any backend (a wait, or the issue of a
//     fence, which waits for a transaction that checked the old fence, on
//     a backend that holds nothing or on an application's Session), runs
//     in slices of the lease (Session.block): the server answers at
//     least every slice, so a backend that holds locks always proves
//     itself alive in time, and another statement that needs the backend
//     interrupts the slice and runs first.
//   - A statement's error is the statement's, not the backend's: a
//     deadlock, a lock timeout or a cancel ends that statement, whatever it
//     may have taken is released on the same backend, and the backend and
//     its other locks live. Only a broken connection or a lost lease ends a
//     backend.
//
// An acquire first tries its keys, without waiting, on a backend that is
// not waiting: one round trip, and no new connection, when the keys are
// free. Only when they are held elsewhere does it wait on the server, on a
// backend that holds nothing: at most WithMaxWaits (default
// DefaultMaxWaits) such waits run at once, on backends opened when needed.
// A blocking acquire that finds no backend it may wait on (WithMaxWaits
// waits run already, or every backend the Client may open holds locks)
// does not queue behind them: it tries its keys again, at once when a
// backend frees up and otherwise at growing intervals of at most
// maxPollInterval, until it can wait or gets the keys. So a Client's limits
// delay an acquire but never deadlock goroutines whose lock order is
// consistent. A Client that holds many keys spreads them over more
// backends (see spreadAbove), since every statement on a backend costs the
// server time in proportion to the keys it holds. A blocking acquire of a
// key that the Client found held elsewhere a moment ago skips the try and
// tries and waits in one statement on a backend that may wait (see
// contention). A Client uses at most WithSharedBackends + WithMaxWaits
// connections (defaults 2 + 4) for its locks, whatever the number of keys
// it holds. Sessions from NewSession are separate: one connection each, on
// which the application's own locks and waits are one session to the
// server.
//
// Shared holds: goroutines of one Client that take a key shared join one
// backend's hold of it without a round trip, but only for a short while
// after the hold was taken from the server (the handoff bounds, see
// WithHandoff). Later readers take the key on another backend, so the
// server sees them and queues them behind a writer that waits for the key.
//
// Connections are opened in the background, bounded by the connect
// timeout and the Client's Close, not by the deadline of the call that
// needed one: a call that gives up does not waste the connection, which the
// next call uses. A lost backend ends every lock on it (their Done channels
// close and Err wraps ErrLockLost); the Client opens another when it needs
// one. A blocking acquire rides through a lost backend, a server restart or
// a failover: it keeps trying to reach a writable server, backing off, until
// its ctx ends, and then returns ctx's error with the last connection error.
// An error of opening a connection that no retry can cure (a pgx config
// that cannot run pgcoord's statements, an unknown database or role, failed
// authentication, a missing privilege, an unknown or invalid setting: see
// permanentConnectError) it returns at once. A try fails fast.

// SpreadAbove is how many keys a backend holds before the Client prefers
// others for new keys. Every statement on a backend costs the server time
// in proportion to the session locks the backend holds (at the end of each
// transaction PostgreSQL walks the backend's table of local locks), so
// many keys on one backend slow every acquire and release there. Once
// every backend a new key may go to holds at least spreadAbove keys, the
// Client opens another, up to one less than WithSharedBackends +
// WithMaxWaits, and puts each new key on the backend that holds the
// fewest.
const SpreadAbove = 1024

// Intervals of a blocking acquire that cannot wait on the server yet
// (polling), and of one that cannot reach the server (retrying).
const (
	MinPollInterval  = 2 * time.Millisecond
	maxPollInterval  = 100 * time.Millisecond
	MinRetryInterval = 50 * time.Millisecond
	MaxRetryInterval = time.Second

	// MaxRoutes bounds how often in a row an acquire picks another backend
	// at once before it pauses like a poll.
	MaxRoutes = 8
)

// Stat is the core of [pgcoord.Stat], which documents it.
type Stat struct {
	Backends    int // dedicated connections of the Client's own locks
	Sessions    int // connections of Sessions from NewSession
	Connecting  int // connections being opened
	Waits       int // blocking acquires waiting on the server
	QueuedWaits int // blocking acquires that found no backend to wait on, or could not reach the server, and try again until they can
	Locks       int // live Lock handles, on backends and Sessions

	DroppedHookEvents int64 // events not delivered to WithHooks' hooks because too many were pending
}

// Stat is the core of [pgcoord.Client.Stat], which documents it.
func (c *Client) Stat() Stat {
	c.Mu.Lock()
	defer c.Mu.Unlock()
	st := Stat{
		Backends:    len(c.Backends),
		Sessions:    len(c.Sessions) - len(c.Backends),
		Connecting:  c.opening,
		QueuedWaits: int(c.QueuedWaits.Load()),

		DroppedHookEvents: c.Hooks.droppedEvents(),
	}
	for s := range c.Sessions {
		s.State.Lock()
		if s.Waiting {
			st.Waits++
		}
		st.Locks += len(s.locks)
		s.State.Unlock()
	}
	return st
}

// Warm is the core of [pgcoord.Client.Warm], which documents it.
func (c *Client) Warm(ctx context.Context) error { return c.WarmUp(ctx, c.Cfg.SharedBackends) }

// WarmUp opens shared backends until n are open or opening, and waits for
// the ones it started, bounded by ctx.
func (c *Client) WarmUp(ctx context.Context, n int) error {
	if ctx == nil {
		return Errorf("warm: ctx is nil")
	}
	if err := c.Enter(); err != nil {
		return err
	}
	defer c.Wg.Done()
	c.Mu.Lock()
	var calls []*connectCall
	for open := len(c.Backends) + c.opening; open < n; open++ {
		calls = append(calls, c.startConnect())
	}
	c.Mu.Unlock()
	for _, call := range calls {
		if err := c.awaitConnect(ctx, call); err != nil {
			return err
		}
	}
	return nil
}

// ClaimWait marks b, which holds only the key only and has no grant in
// flight, as waiting, if fewer than WithMaxWaits acquires of the Client
// wait: nothing else takes a key on it until unclaimWait. It reports
// whether it did.
func (c *Client) ClaimWait(b *Session, only Key) bool {
	c.Mu.Lock()
	defer c.Mu.Unlock()
	waits := 0
	for _, o := range c.Backends {
		o.State.Lock()
		if o.Waiting {
			waits++
		}
		o.State.Unlock()
	}
	if waits >= c.Cfg.MaxWaits {
		return false
	}
	b.State.Lock()
	defer b.State.Unlock()
	if b.Waiting || b.granting != 0 || b.err != nil || len(b.Holds) != 1 || b.Holds[only] == nil {
		return false
	}
	b.Waiting = true
	return true
}

// UnclaimWait ends claimWait's mark.
func (c *Client) UnclaimWait(b *Session) {
	b.State.Lock()
	b.Waiting = false
	b.State.Unlock()
	c.backendFreed()
}

// Errors that route an acquire elsewhere; they never reach the caller.
var (
	// ErrRoute: the backend picked for a statement may not run it any
	// more (it started a wait, or a shared hold there stopped taking
	// joiners); pick again.
	ErrRoute = errors.New("pgcoord: pick another backend")
	// ErrNoWaitBackend: no backend may take a blocking wait now.
	ErrNoWaitBackend = errors.New("pgcoord: no backend free to wait on")
)

// take acquires r on the Client's backends: a try on a backend that is not
// waiting, then, if the keys are held elsewhere, a wait on a backend that
// holds nothing. A blocking acquire that finds no such backend tries again
// when one frees up, or after a while; one that cannot reach the server, or
// whose backend is lost, tries again with backoff until ctx ends, unless
// the connection failed for a reason no retry can cure (connectFailed
// leaves such an error unmarked, and it is returned at once). A try goes on
// once on another backend if its backend was lost, and otherwise fails
// fast.
func (c *Client) take(ctx context.Context, r Request) (*Lock, error) {
	poll, retry := MinPollInterval, MinRetryInterval
	var last error  // the last connection error, for a blocking acquire
	queued := false // counted in Stat's QueuedWaits
	dequeue := func() {
		if queued {
			queued = false
			c.QueuedWaits.Add(-1)
		}
	}
	defer dequeue()
	for lost, routed := 0, 0; ; r.again = true {
		l, err := c.takeOnce(ctx, r, dequeue)
		var wait time.Duration
		switch {
		case err == nil:
			return l, nil
		case ctx.Err() != nil:
			return nil, EndedWhileRetrying(ctx, err, last)
		case errors.Is(err, ErrRoute) && routed < MaxRoutes:
			routed++
			continue
		case errors.Is(err, ErrRoute) || errors.Is(err, ErrNoWaitBackend):
			routed = 0
			wait, poll = poll, min(2*poll, maxPollInterval)
		case !ConnectionTrouble(err):
			return nil, err
		case r.try:
			if lost++; lost > 1 || !ErrorIsLoss(err) {
				return nil, err
			}
			continue
		default:
			last = err
			wait, retry = retry, min(2*retry, MaxRetryInterval)
		}
		if !queued {
			queued = true
			c.QueuedWaits.Add(1)
		}
		if err := c.Pause(ctx, wait); err != nil {
			if last != nil {
				err = WithLastConnErr(err, last)
			}
			return nil, err
		}
	}
}

// ConnectionTrouble reports whether err means the server could not be
// reached or a backend was lost, which a blocking acquire rides through:
// a lost lock (ErrLockLost) or a connectFailure, which excludes the errors
// that permanentConnectError finds.
func ConnectionTrouble(err error) bool {
	return errors.Is(err, ErrLockLost) || errors.Is(err, errConnect)
}

// Pause waits d, or less if a backend frees up meanwhile, bounded by ctx.
func (c *Client) Pause(ctx context.Context, d time.Duration) error {
	freed := c.freedSignal()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-freed:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// freedSignal returns a channel that is closed the next time a backend
// may have become free to wait on.
func (c *Client) freedSignal() <-chan struct{} {
	c.freedMu.Lock()
	defer c.freedMu.Unlock()
	if c.freed == nil {
		c.freed = make(chan struct{})
	}
	return c.freed
}

// backendFreed wakes the acquires that wait for a backend to wait on.
func (c *Client) backendFreed() {
	c.freedMu.Lock()
	defer c.freedMu.Unlock()
	if c.freed != nil {
		close(c.freed)
		c.freed = nil
	}
}

// takeOnce is one attempt of take; waiting is called when it has a
// backend to wait on.
func (c *Client) takeOnce(ctx context.Context, r Request, waiting func()) (*Lock, error) {
	if !r.try && !r.shared && len(r.keys) == 1 && !c.watchesContention() && c.Contention.Recent(r.keys[0]) {
		// The key was held elsewhere a moment ago: a try would most
		// likely fail and cost a round trip, so try and wait in one
		// statement, on a backend that may wait. Without such a backend
		// free now, go the usual way. A Client that reports contention
		// tries first, so that it reports each wait as it starts.
		b, done, err := c.WaitBackend(ctx)
		switch {
		case err == nil:
			defer done()
			waiting()
			if err := b.prepare(ctx, r.prepare); err != nil {
				return nil, err
			}
			r.waiting, r.direct = true, true
			return b.take(ctx, r)
		case !errors.Is(err, ErrNoWaitBackend):
			return nil, err
		}
	}
	tr := r
	tr.try, tr.mayWait = true, !r.try
	b, err := c.Route(ctx, r)
	if err != nil {
		return nil, err
	}
	if b != nil {
		if err := b.prepare(ctx, r.prepare); err != nil {
			return nil, err
		}
		l, err := b.take(ctx, tr)
		if r.try || !errors.Is(err, ErrLocked) {
			return l, err
		}
		if !r.again && c.observed() {
			c.contended(r, false)
		}
		if len(r.keys) == 1 {
			c.Contention.Note(r.keys[0])
		}
	}
	b, done, err := c.WaitBackend(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	waiting()
	if err := b.prepare(ctx, r.prepare); err != nil {
		return nil, err
	}
	r.tried, r.waiting = true, true
	return b.take(ctx, r)
}

// Route picks the backend for a try of r: a backend whose shared hold of
// r's keys r may join (no round trip), else the least busy backend that is
// not waiting and holds none of r's keys. It opens another while all are
// busy and fewer than the shared count are open, and waits for a
// connection only when there is none. When every backend holds one of r's
// keys (shared holds that take no more joiners) and no other may be
// opened, it returns nil for a blocking acquire, which then waits, and
// ErrLocked for a try.
func (c *Client) Route(ctx context.Context, r Request) (*Session, error) {
	for {
		c.Mu.Lock()
		if c.Closed {
			c.Mu.Unlock()
			return nil, ErrClosed
		}
		var pick, holder *Session
		var pickLoad, pickQueued int
		n := 0
		for _, b := range c.Backends {
			b.State.Lock()
			waiting, held, joinable := b.Waiting, false, false
			for _, k := range r.keys {
				if h := b.Holds[k]; h != nil {
					held = true
					joinable = r.shared && h.shared && c.joinable(h)
				}
			}
			// A backend's load: 0 while it holds few keys, else how many
			// it holds, busy ones after idle ones of the same load, and
			// among busy ones, those with fewer calls queued first (they
			// go out together: see combine.go).
			load := len(b.Holds)
			if load < SpreadAbove {
				load = 0
			}
			load *= 2
			if len(b.use) != 0 {
				load++
			}
			queued := len(b.Calls.Queue)
			b.State.Unlock()
			if joinable {
				// Joining sends no statement: a waiting backend takes
				// joiners of the shared key it waits for.
				c.Mu.Unlock()
				return b, nil
			}
			if waiting {
				continue
			}
			n++
			switch {
			case held:
				holder = b
			case pick == nil || load < pickLoad || load == pickLoad && queued < pickQueued:
				pick, pickLoad, pickQueued = b, load, queued
			}
		}
		started := false
		switch {
		case (pick == nil || pickLoad%2 == 1) && n+c.opening < c.Cfg.SharedBackends:
			c.startConnect()
			started = true
		case pick != nil && pickLoad >= 2*SpreadAbove && c.opening == 0 &&
			len(c.Backends) < c.Cfg.SharedBackends+c.Cfg.MaxWaits-1:
			// Every backend it may use holds many keys: spread them
			// over another (see spreadAbove), leaving one that the
			// Client may open to wait on.
			c.startConnect()
			started = true
		}
		switch {
		case pick != nil:
			c.Mu.Unlock()
			return pick, nil
		case holder != nil && c.opening == 0 && len(c.Backends) >= c.Cfg.SharedBackends+c.Cfg.MaxWaits:
			c.Mu.Unlock()
			if r.try {
				// Joining would not ask the server, which may have a
				// writer queued for the key.
				return nil, Errorf("%w: every connection of this Client holds the key shared already, past the bounds in which readers join a hold", ErrLocked)
			}
			return nil, nil
		case holder != nil && !started && len(c.Backends)+c.opening < c.Cfg.SharedBackends+c.Cfg.MaxWaits:
			c.startConnect()
		}
		call := c.anyConnect()
		c.Mu.Unlock()
		if err := c.awaitConnect(ctx, call); err != nil {
			return nil, err
		}
	}
}

// joinable reports whether another handle may join h, a shared hold, on
// its backend without asking the server: only within the handoff bounds
// of the hold's start, so that a writer that waits on the server for the
// key gets its turn once the readers that joined in time are done.
func (c *Client) joinable(h *keyHold) bool {
	return h.Busy != nil || h.joins < c.Cfg.MaxHandoffs && time.Since(h.since) < c.Cfg.HandoffWindow
}

// needs returns the keys of r that the backend does not hold, checking
// that r may join the others and send a statement here. The caller holds
// s.state.
func (s *Session) needs(r Request) ([]Key, error) {
	var need []Key
	for _, k := range r.keys {
		h := s.Holds[k]
		switch {
		case h == nil:
			need = append(need, k)
		case !r.shared || !h.shared:
			return nil, Errorf("%s is already held on this backend in another mode", k)
		case s.managed && !s.c.joinable(h):
			return nil, ErrRoute
		}
	}
	if len(need) > 0 && s.Waiting && !r.waiting {
		return nil, ErrRoute
	}
	return need, nil
}

// WaitBackend picks a backend that holds nothing, and has no grant in
// flight, for a blocking acquire and marks it as waiting, so that nothing
// else takes a key on it; done unmarks it. It opens one while fewer than WithSharedBackends +
// WithMaxWaits are open. It returns errNoWaitBackend when WithMaxWaits
// acquires wait already, or no backend may be opened and every open one
// holds locks or waits.
func (c *Client) WaitBackend(ctx context.Context) (*Session, func(), error) {
	for {
		c.Mu.Lock()
		if c.Closed {
			c.Mu.Unlock()
			return nil, nil, ErrClosed
		}
		var pick *Session
		waits := 0
		for _, b := range c.Backends {
			b.State.Lock()
			if b.Waiting {
				waits++
			} else if len(b.Holds) == 0 && b.granting == 0 && (pick == nil || len(b.use) == 0) {
				pick = b
			}
			b.State.Unlock()
		}
		if waits >= c.Cfg.MaxWaits {
			c.Mu.Unlock()
			return nil, nil, ErrNoWaitBackend
		}
		if pick != nil {
			pick.State.Lock()
			ok := len(pick.Holds) == 0 && pick.granting == 0 && !pick.Waiting && pick.err == nil
			pick.Waiting = ok
			pick.State.Unlock()
			c.Mu.Unlock()
			if !ok {
				continue
			}
			return pick, func() {
				pick.State.Lock()
				pick.Waiting = false
				pick.State.Unlock()
				c.backendFreed()
			}, nil
		}
		if len(c.Backends)+c.opening >= c.Cfg.SharedBackends+c.Cfg.MaxWaits {
			c.Mu.Unlock()
			return nil, nil, ErrNoWaitBackend
		}
		have := len(c.Backends) > 0
		call := c.startConnect()
		c.Mu.Unlock()
		if err := c.awaitConnect(ctx, call); err != nil {
			if have && errors.Is(err, ErrTooManyConnections) {
				// The server has no slot for another connection: try on
				// the ones the Client has until one frees up.
				return nil, nil, ErrNoWaitBackend
			}
			return nil, nil, err
		}
	}
}

// watchesContention reports whether the Client reports each wait as it
// starts: to OnContention, or in its debug log.
func (c *Client) watchesContention() bool {
	return c.Hooks != nil && c.Hooks.h.OnContention != nil || c.Cfg.debugging()
}

// contention remembers which keys the Client's blocking acquires found
// held elsewhere during the last contentionMemory. A blocking acquire of
// such a key skips the try on a shared backend, which would most likely
// fail, and tries and waits in one statement on a backend that may wait:
// under contention, one statement per acquire instead of two. A Client
// that reports contention (watchesContention) does not: the one statement
// tells whether it waited only once it ends. Keys share
// slots by their hash; a key that collides with a contended one only takes
// that path too, which costs it nothing but its place on a shared backend.
type contention struct {
	Memory time.Duration // contentionMemory; tests set it
	slots  [contentionSlots]struct {
		key atomic.Int64 // Key.v
		at  atomic.Int64 // since contentionEpoch, in nanoseconds
	}
}

const (
	contentionSlots  = 64
	contentionMemory = 100 * time.Millisecond
)

// contentionEpoch is the origin of contention's monotonic times.
var contentionEpoch = time.Now()

func (m *contention) Slot(k Key) int {
	return int(uint64(k.V) * 0x9e3779b97f4a7c15 >> 58) // the top 6 bits: 64 slots
}

// Note records that a blocking acquire found k held elsewhere just now.
func (m *contention) Note(k Key) {
	sl := &m.slots[m.Slot(k)]
	sl.key.Store(k.V)
	sl.at.Store(int64(time.Since(contentionEpoch)))
}

// Recent reports whether a blocking acquire found k held elsewhere within
// the last contentionMemory.
func (m *contention) Recent(k Key) bool {
	sl := &m.slots[m.Slot(k)]
	at := sl.at.Load()
	return at != 0 && sl.key.Load() == k.V && time.Since(contentionEpoch)-time.Duration(at) < m.Memory
}

// awaitConnect waits for call, bounded by ctx.
func (c *Client) awaitConnect(ctx context.Context, call *connectCall) error {
	select {
	case <-call.done:
		return call.err
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}
