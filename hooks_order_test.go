package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// The tests of this file prove the order promise of Hooks: for each key,
// the end (OnRelease or OnLoss) of a lock of the Client is delivered
// before the OnAcquire of the next lock of the Client that excludes it,
// and a lock's OnAcquire before its end. They replay the hook log in
// delivery order as a gauge of held locks would, and fail on two holders
// of a key in excluding modes, or on an end of a lock never acquired.

// holdEvent is one OnAcquire (that took a lock), OnRelease or OnLoss, as
// delivered.
type holdEvent struct {
	acquire bool
	lost    bool
	keys    []Key
	mode    LockMode
	handoff bool
	err     error // OnRelease: the Unlock error (one wrapping ErrLockLost for a lock found lost)
}

// holdLog records the hook events that change who holds a key, in the
// order the hooks are called.
type holdLog struct {
	mu       sync.Mutex
	events   []holdEvent
	failed   int // acquires that returned an error
	handoffs int // releases that handed the lock over
}

func (g *holdLog) hooks() Hooks {
	return Hooks{
		OnAcquire: func(e AcquireEvent) {
			g.mu.Lock()
			defer g.mu.Unlock()
			if e.Err != nil {
				g.failed++
				return
			}
			g.events = append(g.events, holdEvent{acquire: true, keys: e.Keys, mode: e.Mode, handoff: e.Handoff})
		},
		OnRelease: func(e ReleaseEvent) {
			g.mu.Lock()
			defer g.mu.Unlock()
			if e.Handoff {
				g.handoffs++
			}
			g.events = append(g.events, holdEvent{keys: e.Keys, mode: e.Mode, handoff: e.Handoff, err: e.Err})
		},
		OnLoss: func(e LossEvent) {
			g.mu.Lock()
			defer g.mu.Unlock()
			g.events = append(g.events, holdEvent{lost: true, keys: e.Keys, mode: e.Mode})
		},
	}
}

// check replays the log and returns the first place where it shows an
// acquire of a key that another holder holds in an excluding mode, or an
// end of a hold that no acquire began, and how many acquires, releases and
// losses it holds. With closed, every hold must have ended.
func (g *holdLog) check(closed bool) (acquires, releases, losses int, err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	type count struct{ exclusive, shared int }
	held := map[Key]*count{}
	for i, e := range g.events {
		for _, k := range e.keys {
			n := held[k]
			if n == nil {
				n = &count{}
				held[k] = n
			}
			switch {
			case e.acquire && e.mode == ModeExclusive:
				if n.exclusive > 0 || n.shared > 0 {
					return 0, 0, 0, fmt.Errorf("event %d: exclusive acquire of %s (handoff %v) delivered while the log shows %d exclusive and %d shared holders", i, k, e.handoff, n.exclusive, n.shared)
				}
				n.exclusive++
			case e.acquire:
				if n.exclusive > 0 {
					return 0, 0, 0, fmt.Errorf("event %d: shared acquire of %s delivered while the log shows an exclusive holder", i, k)
				}
				n.shared++
			case e.mode == ModeExclusive:
				if n.exclusive == 0 {
					return 0, 0, 0, fmt.Errorf("event %d: end (lost %v, handoff %v) of an exclusive hold of %s that no delivered acquire began", i, e.lost, e.handoff, k)
				}
				n.exclusive--
			default:
				if n.shared == 0 {
					return 0, 0, 0, fmt.Errorf("event %d: end (lost %v) of a shared hold of %s that no delivered acquire began", i, e.lost, k)
				}
				n.shared--
			}
		}
		switch {
		case e.acquire:
			acquires++
		case e.lost:
			losses++
		default:
			releases++
		}
	}
	if closed {
		for k, n := range held {
			if n.exclusive != 0 || n.shared != 0 {
				return 0, 0, 0, fmt.Errorf("after Close the log still shows %d exclusive and %d shared holders of %s", n.exclusive, n.shared, k)
			}
		}
	}
	return acquires, releases, losses, nil
}

// cycles counts what the callers saw.
type cycles struct {
	locked, unlocked atomic.Int64
}

// orderedClient returns a Client whose hooks record into a new holdLog.
func orderedClient(t *testing.T, dsn string, opts ...Option) (*Client, *holdLog) {
	g := &holdLog{}
	return newTestClient(t, dsn, append(opts, WithHooks(g.hooks()))...), g
}

// closeAndCheck closes c, which delivers every event, then checks the log
// against what the callers saw: every successful acquire and Unlock has its
// event, and nothing was dropped.
func closeAndCheck(t *testing.T, c *Client, g *holdLog, n *cycles, wantHandoffs bool) {
	t.Helper()
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if d := c.Stat().DroppedHookEvents; d != 0 {
		t.Fatalf("%d hook events dropped: the log cannot be checked", d)
	}
	a, r, l, err := g.check(true)
	if err != nil {
		t.Fatal(err)
	}
	if int64(a) != n.locked.Load() {
		t.Errorf("%d acquire events, %d successful acquires", a, n.locked.Load())
	}
	if int64(r+l) < n.unlocked.Load() || a != r+l {
		t.Errorf("%d acquire events, %d release and %d loss events, %d successful Unlocks", a, r, l, n.unlocked.Load())
	}
	g.mu.Lock()
	handoffs := g.handoffs
	g.mu.Unlock()
	if wantHandoffs && handoffs == 0 {
		t.Errorf("no lock was handed over in the process: the test did not reach the handoff path")
	}
	t.Logf("%d acquires, %d releases (%d handed over), %d losses", a, r, handoffs, l)
}

// Goroutines of one Client take one exclusive key in turn, mostly by
// in-process handoff: each holder's release is delivered before the next
// holder's acquire.
func TestHooksOrderOnHandoff(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c, g := orderedClient(t, dsn)
	k := HashKey("hooks-order", "handoff")
	// 8 x 250 cycles make at most 4,000 release and acquire events, within
	// MaxPendingHookEvents even if the hooks' goroutine never ran.
	const workers, rounds = 8, 250
	var n cycles
	var holding atomic.Int32
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for range rounds {
				l, err := c.Lock(ctx, k)
				if err != nil {
					t.Errorf("worker %d: Lock: %v", w, err)
					return
				}
				n.locked.Add(1)
				if h := holding.Add(1); h != 1 {
					t.Errorf("worker %d: %d goroutines hold the exclusive key", w, h)
				}
				holding.Add(-1)
				if err := l.Unlock(ctx); err != nil {
					t.Errorf("worker %d: Unlock: %v", w, err)
					return
				}
				n.unlocked.Add(1)
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	notHeld(t, dsn, k)
	closeAndCheck(t, c, g, &n, true)
}

// Readers and writers of one Client share a key: no writer's acquire is
// delivered while the log shows a reader or another writer, nor a
// reader's while it shows a writer.
func TestHooksOrderReadersAndWriters(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c, g := orderedClient(t, dsn)
	k := HashKey("hooks-order", "rw")
	const readers, writers, rounds = 4, 2, 200
	var n cycles
	var wg sync.WaitGroup
	for w := range readers + writers {
		shared := w < readers
		wg.Go(func() {
			for range rounds {
				var l *Lock
				var err error
				if shared {
					l, err = c.RLock(ctx, k)
				} else {
					l, err = c.Lock(ctx, k)
				}
				if err != nil {
					t.Errorf("worker %d (shared %v): %v", w, shared, err)
					return
				}
				n.locked.Add(1)
				if err := l.Unlock(ctx); err != nil {
					t.Errorf("worker %d: Unlock: %v", w, err)
					return
				}
				n.unlocked.Add(1)
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	notHeld(t, dsn, k)
	closeAndCheck(t, c, g, &n, false) // handoffs are rare: readers share
}

// Goroutines on two Sessions of one Client take one key: handoffs within
// a session and releases to the other session are delivered in order.
func TestHooksOrderOnSessions(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c, g := orderedClient(t, dsn)
	k := HashKey("hooks-order", "sessions")
	var sessions [2]*Session
	for i := range sessions {
		s, err := c.NewSession(ctx)
		if err != nil {
			t.Fatal(err)
		}
		sessions[i] = s
	}
	const workers, rounds = 6, 150
	var n cycles
	var wg sync.WaitGroup
	for w := range workers {
		s := sessions[w%len(sessions)]
		wg.Go(func() {
			for range rounds {
				l, err := s.Lock(ctx, k)
				if err != nil {
					t.Errorf("worker %d: Lock: %v", w, err)
					return
				}
				n.locked.Add(1)
				if err := l.Unlock(ctx); err != nil {
					t.Errorf("worker %d: Unlock: %v", w, err)
					return
				}
				n.unlocked.Add(1)
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	notHeld(t, dsn, k)
	closeAndCheck(t, c, g, &n, false) // a handoff needs a waiter on the same session
}

// Fenced locks handed over in the process get a fresh fence each; the
// hooks still see each release before the next acquire.
func TestHooksOrderOnFencedHandoff(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	migrated(t, dsn)
	c, g := orderedClient(t, dsn)
	k := HashKey("hooks-order", "fenced")
	const workers, rounds = 4, 60
	var n cycles
	var mu sync.Mutex
	var last Term
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for range rounds {
				l, err := c.Lock(ctx, k, WithFence())
				if err != nil {
					t.Errorf("worker %d: Lock: %v", w, err)
					return
				}
				n.locked.Add(1)
				mu.Lock()
				if l.Fence() <= last {
					t.Errorf("worker %d: fence %d after %d", w, l.Fence(), last)
				}
				last = l.Fence()
				mu.Unlock()
				if err := l.Unlock(ctx); err != nil {
					t.Errorf("worker %d: Unlock: %v", w, err)
					return
				}
				n.unlocked.Add(1)
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	notHeld(t, dsn, k)
	closeAndCheck(t, c, g, &n, false)
}

// Goroutines contend for a key whose holding backend is terminated again
// and again: each loss is delivered before the next holder's acquire, and
// never before the lost lock's own acquire.
func TestHooksOrderOnLoss(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c, g := orderedClient(t, dsn)
	k := HashKey("hooks-order", "loss")
	// At most 1,500 acquires keep the events within MaxPendingHookEvents.
	const workers, wantLosses, maxAcquires = 4, 3, 1500
	var n cycles
	var budget atomic.Int64
	budget.Store(maxAcquires)
	victims := make(chan *Lock) // a holder offers its lock to be lost
	stop := make(chan struct{}) // closed once enough locks were lost
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for budget.Add(-1) >= 0 {
				l, err := c.Lock(ctx, k)
				if err != nil {
					t.Errorf("worker %d: Lock: %v", w, err)
					return
				}
				n.locked.Add(1)
				last := false
				select {
				case victims <- l:
					// Its backend is being terminated: the session
					// notices, and the loss goes to OnLoss.
					select {
					case <-l.Done():
					case <-ctx.Done():
						t.Errorf("worker %d: a lock of a terminated backend did not end", w)
						return
					}
				case <-stop:
					last = true
				default:
				}
				if err := l.Unlock(ctx); err == nil {
					n.unlocked.Add(1)
				} else if !errors.Is(err, ErrLockLost) {
					t.Errorf("worker %d: Unlock: %v", w, err)
					return
				}
				if last {
					return
				}
			}
		})
	}
	finished := make(chan struct{})
	go func() { wg.Wait(); close(finished) }()
	for i := range wantLosses {
		select {
		case l := <-victims:
			pgtest.Terminate(t, dsn, l.core.S.PID())
		case <-finished:
			t.Fatalf("the workers finished after %d terminations", i)
		}
	}
	close(stop)
	<-finished
	if t.Failed() {
		return
	}
	notHeld(t, dsn, k)
	closeAndCheck(t, c, g, &n, false)
	if _, _, lost, _ := g.check(true); lost < wantLosses {
		t.Errorf("%d OnLoss events after %d holders' backends were terminated", lost, wantLosses)
	}
}
