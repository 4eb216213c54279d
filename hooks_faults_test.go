package pgcoord

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// The tests of this file prove the order promise of Hooks (see
// hooks_order_test.go for the log they replay) under faults: waiters whose
// ctx ends as a lock is handed to them, Close during a burst of handoffs,
// fenced handoffs whose backend is terminated, and a mix of every acquire.

// checkClosed checks g, after Close and after every caller returned,
// against the calls that succeeded: one acquire event per lock returned,
// one end per acquire, nothing dropped.
func checkClosed(t *testing.T, c *Client, g *holdLog, n *cycles) (acquires, releases, losses int) {
	t.Helper()
	if d := c.Stat().DroppedHookEvents; d != 0 {
		t.Fatalf("%d hook events dropped: the log cannot be checked", d)
	}
	a, r, l, err := g.check(true)
	if err != nil {
		t.Fatal(err)
	}
	if int64(a) != n.locked.Load() {
		t.Errorf("%d acquire events, %d locks returned by acquires", a, n.locked.Load())
	}
	if a != r+l || int64(r+l) < n.unlocked.Load() {
		t.Errorf("%d acquire events, %d release and %d loss events, %d successful Unlocks", a, r, l, n.unlocked.Load())
	}
	return a, r, l
}

// Waiters whose ctx ends a moment after they start to wait, often as the
// holder hands the lock to them: each lock returned has one acquire event
// after the previous holder's end, a waiter that gave up has none, and a
// lock handed to a waiter that gave up is passed on or released.
func TestHooksOrderWaitersCancelledAtHandoff(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	migrated(t, dsn)
	c, g := orderedClient(t, dsn)
	k := HashKey("hooks-faults", "cancel")
	const workers, rounds = 6, 200
	var n cycles
	var cancelled cycles // locked: acquires that ended with ctx's error
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range rounds {
				var opts []LockOption
				if i%4 == 0 {
					opts = append(opts, WithFence())
				}
				actx, cancel := context.WithTimeout(ctx, time.Duration(rand.IntN(3000))*time.Microsecond)
				l, err := c.Lock(actx, k, opts...)
				cancel()
				if err != nil {
					if !errors.Is(err, context.DeadlineExceeded) {
						t.Errorf("worker %d: Lock: %v", w, err)
						return
					}
					cancelled.locked.Add(1)
					continue
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
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	a, r, _ := checkClosed(t, c, g, &n)
	g.mu.Lock()
	failed, handoffs := g.failed, g.handoffs
	g.mu.Unlock()
	if int64(failed) != cancelled.locked.Load() {
		t.Errorf("%d failed acquire events, %d acquires returned an error", failed, cancelled.locked.Load())
	}
	t.Logf("%d acquires, %d releases (%d handed over), %d cancelled", a, r, handoffs, cancelled.locked.Load())
}

// Close during a burst of handoffs: every lock returned ends in one
// release (by Unlock or by Close), after its acquire and before the next
// holder's; the events of the locks Close ends are delivered before it
// returns; nothing is left in pg_locks.
func TestHooksOrderCloseDuringHandoffs(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	for round := range 5 {
		pool := pgtest.Pool(t, dsn)
		g := &holdLog{}
		c, err := New(pool, WithHooks(g.hooks()), WithLossDeadline(time.Second), WithHeartbeat(250*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		keys := []Key{HashKey("hooks-faults", "close-a"), HashKey("hooks-faults", "close-b")}
		const workers = 8
		var n cycles
		enough := make(chan struct{})
		var once sync.Once
		var wg sync.WaitGroup
		for w := range workers {
			k := keys[w%len(keys)]
			wg.Go(func() {
				for i := 0; i < 2000; i++ {
					l, err := c.Lock(ctx, k)
					if err != nil {
						if !errors.Is(err, ErrClosed) {
							t.Errorf("worker %d: Lock: %v, want ErrClosed", w, err)
						}
						return
					}
					if n.locked.Add(1) >= 100 {
						once.Do(func() { close(enough) })
					}
					if err := l.Unlock(ctx); err == nil {
						n.unlocked.Add(1)
					} else if !errors.Is(err, ErrClosed) {
						t.Errorf("worker %d: Unlock: %v", w, err)
						return
					}
				}
			})
		}
		select {
		case <-enough:
		case <-ctx.Done():
			t.Fatal("no locks taken")
		}
		if err := c.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
		// Close delivered the events of the locks it ended; count them
		// before the callers finish, then again after.
		if _, _, _, err := g.check(true); err != nil {
			t.Fatalf("round %d, right after Close: %v", round, err)
		}
		wg.Wait()
		checkClosed(t, c, g, &n)
		pool.Close()
		for _, k := range keys {
			notHeld(t, dsn, k)
		}
		if t.Failed() {
			return
		}
	}
}

// Fenced locks handed over in the process while the holder's backend is
// being terminated: a handoff whose fence cannot be issued is not an
// acquire, and the waiter takes the key again elsewhere; the log never
// shows two holders, every acquire ends once, and every lock returned has
// a fence greater than any before it.
func TestHooksOrderFencedHandoffOnTerminatedBackend(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	migrated(t, dsn)
	c, g := orderedClient(t, dsn)
	k := HashKey("hooks-faults", "fenced-terminated")
	const workers, rounds, terminations = 4, 40, 12
	var n cycles
	var mu sync.Mutex
	var last Term
	killed := 0
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
				kill := killed < terminations && waitingOn(t, dsn, k) == 0
				if kill {
					killed++
				}
				mu.Unlock()
				if kill {
					// Terminate the holder's backend and release at once:
					// the release may hand the lock to a waiter of this
					// Client before the session notices the loss.
					pgtest.Terminate(t, dsn, l.core.S.PID())
				}
				if err := l.Unlock(ctx); err == nil {
					n.unlocked.Add(1)
				} else if !errors.Is(err, ErrLockLost) {
					t.Errorf("worker %d: Unlock: %v", w, err)
					return
				}
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	notHeld(t, dsn, k)
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	a, r, l := checkClosed(t, c, g, &n)
	g.mu.Lock()
	handoffs := g.handoffs
	g.mu.Unlock()
	t.Logf("%d acquires, %d releases (%d handed over), %d losses, %d terminations", a, r, handoffs, l, killed)
}

// Every kind of acquire of a Client and of its Sessions on two keys, mixed
// (Lock, TryLock, RLock, TryRLock, LockAll, Do, Session.Lock), while
// holders' backends are terminated now and then: the log never shows two
// holders of a key that exclude each other, and each lock returned ends
// once.
func TestHooksOrderMixedAcquiresWithLoss(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c, g := orderedClient(t, dsn)
	keys := []Key{HashKey("hooks-faults", "mix-a"), HashKey("hooks-faults", "mix-b")}
	var sessions [2]*Session
	for i := range sessions {
		s, err := c.NewSession(ctx)
		if err != nil {
			t.Fatal(err)
		}
		sessions[i] = s
	}
	const workers, rounds = 6, 120
	var n cycles
	var terminated sync.Mutex // one termination at a time
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := range rounds {
				k := keys[rng.IntN(len(keys))]
				var l *Lock
				var err error
				switch op := rng.IntN(7); op {
				case 0:
					l, err = c.Lock(ctx, k)
				case 1:
					l, err = c.TryLock(ctx, k)
				case 2:
					l, err = c.RLock(ctx, k)
				case 3:
					l, err = c.TryRLock(ctx, k)
				case 4:
					l, err = c.LockAll(ctx, keys...)
				case 5:
					err = c.Do(ctx, k, func(context.Context) error {
						n.locked.Add(1)
						return nil
					})
					if err == nil {
						n.unlocked.Add(1)
					} else if !errors.Is(err, ErrLockLost) {
						t.Errorf("worker %d: Do: %v", w, err)
						return
					}
					continue
				default:
					s := sessions[rng.IntN(len(sessions))]
					if s.Err() != nil {
						continue // lost: its locks end, its calls fail
					}
					l, err = s.Lock(ctx, k)
				}
				if errors.Is(err, ErrLocked) || errors.Is(err, ErrLockLost) {
					continue
				}
				if err != nil {
					t.Errorf("worker %d: acquire: %v", w, err)
					return
				}
				n.locked.Add(1)
				if i%40 == 39 && terminated.TryLock() {
					pgtest.Terminate(t, dsn, l.core.S.PID())
					awaitEnd(t, l, "a lock whose backend was terminated")
					terminated.Unlock()
				}
				if err := l.Unlock(ctx); err == nil {
					n.unlocked.Add(1)
				} else if !errors.Is(err, ErrLockLost) {
					t.Errorf("worker %d: Unlock: %v", w, err)
					return
				}
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	for _, k := range keys {
		notHeld(t, dsn, k)
	}
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	a, r, l := checkClosed(t, c, g, &n)
	t.Logf("%d acquires, %d releases, %d losses", a, r, l)
}
