package pgcoord

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// Tries never wait: a TryLock or TryRLock answers after a round trip,
// whatever other goroutines of the Client or the Session wait for, and a
// statement that needs a Session's connection interrupts the wait on it.

// A TryRLock must not wait. While another goroutine of the same Client
// waits on the server for the key shared (a writer elsewhere holds it),
// a TryRLock of that key must answer ErrLocked at once, on a Client's
// backends and on a Session, instead of waiting for the other
// goroutine's wait to end.
func TestTryRLockDoesNotWaitForAnotherReadersWait(t *testing.T) {
	t.Parallel()
	clientAndSession(t, func(t *testing.T, name string, onSession bool) {
		ctx := testCtx(t)
		dsn := pgtest.DB(t)
		c := newTestClient(t, dsn)
		k := HashKey("lockcore", "tryrlock-joins-wait", name)
		other := pgtest.Conn(t, dsn)
		if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1)", k.coreKey().V); err != nil {
			t.Fatal(err)
		}
		rlock, tryRLock := c.RLock, c.TryRLock
		if onSession {
			s := newTestSession(t, c)
			rlock, tryRLock = s.RLock, s.TryRLock
		}
		wctx, cancelWait := context.WithCancel(ctx)
		defer cancelWait()
		wch := goLock(func() (*Lock, error) { return rlock(wctx, k) })
		pgtest.Eventually(t, testTimeout, "the reader waits on the server", func() bool { return waitingOn(t, dsn, k) == 1 })

		// The try's ctx is long: it must not be what ends the try.
		start := time.Now()
		tctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		l, err := tryRLock(tctx, k)
		took := time.Since(start)
		if err == nil {
			_ = l.Unlock(ctx)
			t.Fatalf("TryRLock took %v while a writer elsewhere holds it", k)
		}
		if !errors.Is(err, ErrLocked) || took > time.Second {
			t.Fatalf("TryRLock of a key held exclusively elsewhere, while another reader of this Client waits for it: %v after %v; want ErrLocked at once (TryRLock: \"without waiting\")", err, took)
		}
		cancelWait()
		if r := receive(t, wch); r.err == nil {
			_ = r.l.Unlock(ctx)
		}
		if _, err := other.Exec(ctx, "SELECT pg_advisory_unlock($1)", k.coreKey().V); err != nil {
			t.Fatal(err)
		}
		pgtest.Eventually(t, testTimeout, "key free", func() bool { return len(lockState(t, dsn)[k]) == 0 })
	})
}

// The same as TestTryRLockDoesNotWaitForAnotherReadersWait, with the
// TryRLock coming while the other reader's RLock still tries the key,
// before its wait: the Session's connection is held meanwhile, so the
// RLock's try and the TryRLock both wait for it. Once the RLock's try has
// failed and its wait begun, the TryRLock answers ErrLocked.
func TestTryRLockDuringOtherReadersTryStopsWhenItWaits(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	s := newTestSession(t, newTestClient(t, dsn))
	k := HashKey("lockcore", "tryrlock-during-try")
	other := pgtest.Conn(t, dsn)
	if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1)", k.coreKey().V); err != nil {
		t.Fatal(err)
	}
	release := holdConn(t, ctx, s)
	wctx, cancelWait := context.WithCancel(ctx)
	defer cancelWait()
	wch := goLock(func() (*Lock, error) { return s.RLock(wctx, k) })
	pgtest.Eventually(t, testTimeout, "the RLock reserved the key and waits for the connection", func() bool {
		s.core.State.Lock()
		defer s.core.State.Unlock()
		h := s.core.Holds[k.coreKey()]
		return h != nil && h.Busy != nil && s.core.Calls.Busy
	})
	tctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	start := time.Now()
	tch := goLock(func() (*Lock, error) { return s.TryRLock(tctx, k) })
	pgtest.Eventually(t, testTimeout, "the TryRLock waits for the key's statement", func() bool {
		select {
		case r := <-tch:
			t.Fatalf("TryRLock returned (%v, %v) before the RLock's try was answered", r.l, r.err)
		default:
		}
		s.core.State.Lock()
		defer s.core.State.Unlock()
		return s.core.Holds[k.coreKey()] != nil && s.core.Holds[k.coreKey()].WaitsSet != nil
	})
	release()
	pgtest.Eventually(t, testTimeout, "the RLock waits on the server", func() bool { return waitingOn(t, dsn, k) == 1 })
	r := receive(t, tch)
	if took := time.Since(start); r.err == nil || !errors.Is(r.err, ErrLocked) || took > tryBound {
		t.Fatalf("TryRLock while another reader's RLock went from its try to its wait: (%v, %v) after %v; want ErrLocked once the wait began", r.l, r.err, took)
	}
	cancelWait()
	if r := receive(t, wch); r.err == nil {
		t.Fatalf("RLock took %v while a writer elsewhere holds it", k)
	}
	if _, err := other.Exec(ctx, "SELECT pg_advisory_unlock($1)", k.coreKey().V); err != nil {
		t.Fatal(err)
	}
	notHeld(t, dsn, k)
}

// tryBound is how long a try may take on a loaded 2-core machine
// with the race detector: a round trip, perhaps a connection opened, and
// a blocking wait interrupted on the way; never another acquire's wait.
const tryBound = 2 * time.Second

// triesSeed replays the choices of TestTriesNeverWaitAmidRandomWaitsAndCancels
// (not its timing).
var triesSeed = flag.Uint64("tries.seed", 0, "seed of TestTriesNeverWaitAmidRandomWaitsAndCancels (0: a random one; the seed is logged either way)")

// Tries never wait for another goroutine's wait, and no two goroutines
// ever hold a key in excluding modes: goroutines of one Client (one shared
// backend, one wait) and of a Session on it mix blocking Lock, RLock and
// LockAll with random deadlines and cancels, while others TryLock and
// TryRLock the same few keys with a long ctx, and a connection of its own
// takes and frees the keys exclusively and shared. Every try must answer
// within tryBound; each goroutine's critical section is counted per
// key; at the end nothing is left in pg_locks. Seeded; the seed is logged.
func TestTriesNeverWaitAmidRandomWaitsAndCancels(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	seed := *triesSeed
	if seed == 0 {
		seed = rand.Uint64()
	}
	t.Logf("seed %d (replay its choices with -tries.seed=%d)", seed, seed)
	c := newTestClient(t, dsn, WithSharedBackends(1), WithMaxWaits(1))
	s := newTestSession(t, c)
	keys := []Key{HashKey("lockcore", "tries", "0"), HashKey("lockcore", "tries", "1"), Int64Key(77_001), Int64Key(77_002)}

	type count struct{ writers, readers atomic.Int32 }
	counts := make(map[Key]*count)
	for _, k := range keys {
		counts[k] = &count{}
	}
	var (
		mu       sync.Mutex
		failures []string
	)
	fail := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if len(failures) < 10 {
			failures = append(failures, fmt.Sprintf(format, args...))
		}
	}
	enter := func(l *Lock) {
		for _, k := range l.Keys() {
			n := counts[k]
			if l.core.Shared {
				n.readers.Add(1)
				if w := n.writers.Load(); w != 0 {
					fail("%v: a reader entered while %d writers hold it", k, w)
				}
			} else {
				if w := n.writers.Add(1); w != 1 {
					fail("%v: %d writers at once", k, w)
				}
				if r := n.readers.Load(); r != 0 {
					fail("%v: a writer entered while %d readers hold it", k, r)
				}
			}
		}
	}
	leave := func(l *Lock) {
		for _, k := range l.Keys() {
			if l.core.Shared {
				counts[k].readers.Add(-1)
			} else {
				counts[k].writers.Add(-1)
			}
		}
		if err := l.Unlock(ctx); err != nil {
			fail("Unlock %v: %v", l.Keys(), err)
		}
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	// The remote holder, in phases until the workers are done: it takes
	// every key it can exclusively and holds them for longer than a try may
	// take (a batch job elsewhere), then takes and frees single keys,
	// exclusively or shared, for a few of its own round trips each.
	remote := pgtest.Conn(t, dsn)
	wg.Add(1)
	go func() {
		defer wg.Done()
		rng := rand.New(rand.NewPCG(seed, 99))
		exec := func(sql string, args ...any) bool {
			if _, err := remote.Exec(ctx, sql, args...); err != nil {
				fail("remote %s: %v", sql, err)
				return false
			}
			return true
		}
		stopped := func() bool {
			select {
			case <-stop:
				return true
			default:
				return false
			}
		}
		for phase := 0; phase < 1000 && !stopped(); phase++ {
			if phase%2 == 0 {
				for _, k := range keys {
					if !exec("SELECT pg_try_advisory_lock($1)", k.coreKey().V) {
						return
					}
				}
				for t0 := time.Now(); time.Since(t0) < 2*tryBound && !stopped(); {
					if !exec("SELECT pg_sleep(0.05)") {
						return
					}
				}
				if !exec("SELECT pg_advisory_unlock_all()") {
					return
				}
				continue
			}
			for range 20 {
				k := keys[rng.IntN(len(keys))]
				fn, unlock := "pg_try_advisory_lock", "pg_advisory_unlock"
				if rng.IntN(2) == 0 {
					fn, unlock = "pg_try_advisory_lock_shared", "pg_advisory_unlock_shared"
				}
				var got bool
				if err := remote.QueryRow(ctx, "SELECT "+fn+"($1)", k.coreKey().V).Scan(&got); err != nil {
					fail("remote %s: %v", fn, err)
					return
				}
				for range 1 + rng.IntN(20) {
					if !exec("SELECT 1") {
						return
					}
				}
				if got && !exec("SELECT "+unlock+"($1)", k.coreKey().V) {
					return
				}
			}
		}
	}()

	var maxTry atomic.Int64
	defer func() { t.Logf("longest try: %v", time.Duration(maxTry.Load())) }()
	const rounds = 100000
	end := time.Now().Add(8 * time.Second)
	var workers sync.WaitGroup
	for w := range 6 {
		workers.Add(1)
		go func() {
			defer workers.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			for i := 0; i < rounds && time.Now().Before(end); i++ {
				onSession := rng.IntN(2) == 0
				k := keys[rng.IntN(len(keys))]
				if w%3 == 0 {
					// A blocking acquire with a random deadline, or cancelled.
					// Some wait longer than a try may take.
					d := time.Duration(1+rng.IntN(200)) * time.Millisecond
					if rng.IntN(2) == 0 {
						d = 3 * tryBound
					}
					actx, cancel := context.WithTimeout(ctx, d)
					var l *Lock
					var err error
					// Half of them read: a reader's wait is what a try of
					// the same key must not wait for.
					switch op := rng.IntN(4); {
					case op == 0 && onSession:
						l, err = s.Lock(actx, k)
					case op == 0:
						l, err = c.Lock(actx, k)
					case op <= 2 && onSession:
						l, err = s.RLock(actx, k)
					case op <= 2:
						l, err = c.RLock(actx, k)
					case onSession:
						l, err = s.LockAll(actx, k, keys[(rng.IntN(len(keys)-1)+1+slices.Index(keys, k))%len(keys)])
					default:
						l, err = c.LockAll(actx, k, keys[(rng.IntN(len(keys)-1)+1+slices.Index(keys, k))%len(keys)])
					}
					cancel()
					if err != nil {
						if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, ErrLocked) {
							fail("blocking acquire of %v: %v", k, err)
						}
						continue
					}
					enter(l)
					leave(l)
					continue
				}
				// A try, with a long ctx: it must answer at once.
				shared := rng.IntN(4) != 0
				start := time.Now()
				var l *Lock
				var err error
				switch {
				case shared && onSession:
					l, err = s.TryRLock(ctx, k)
				case shared:
					l, err = c.TryRLock(ctx, k)
				case onSession:
					l, err = s.TryLock(ctx, k)
				default:
					l, err = c.TryLock(ctx, k)
				}
				took := time.Since(start)
				for {
					m := maxTry.Load()
					if int64(took) <= m || maxTry.CompareAndSwap(m, int64(took)) {
						break
					}
				}
				if took > tryBound {
					fail("try (shared %v, session %v) of %v took %v (err %v)", shared, onSession, k, took, err)
				}
				if err != nil {
					if !errors.Is(err, ErrLocked) {
						fail("try of %v: %v", k, err)
					}
					continue
				}
				enter(l)
				leave(l)
			}
		}()
	}
	workers.Wait()
	close(stop)
	wg.Wait()
	mu.Lock()
	for _, f := range failures {
		t.Errorf("seed %d: %s", seed, f)
	}
	mu.Unlock()
	if _, err := remote.Exec(ctx, "SELECT pg_advisory_unlock_all()"); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		notHeld(t, dsn, k)
	}
	if err := s.Err(); err != nil {
		t.Fatalf("seed %d: the session ended: %v", seed, err)
	}
}

// A statement that needs a Session's connection interrupts the blocking
// wait on it at once, every time: one goroutine tries and releases
// another key over and over while a blocking Lock waits, so that each try
// interrupts a slice that has just begun again. No try or Unlock may wait
// out the slice (4.5 s here).
func TestTryInterruptsFreshlyResumedWaitSlice(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn, WithLossDeadline(10*time.Second))
	s := newTestSession(t, c)
	k, k2 := Int64Key(77_101), Int64Key(77_102)
	wch, endWait := lockWaitingOn(t, ctx, dsn, s, k)
	slice := c.core.Cfg.WaitSlice()
	var slow []string
	var slowest time.Duration
	end := time.Now().Add(5 * time.Second)
	n := 0
	for ; n < 2000 && time.Now().Before(end) && len(slow) < 5; n++ {
		start := time.Now()
		l, err := s.TryLock(ctx, k2)
		tried := time.Since(start)
		if err != nil {
			t.Fatalf("TryLock of a free key beside the waiting Lock: %v", err)
		}
		start = time.Now()
		if err := l.Unlock(ctx); err != nil {
			t.Fatalf("Unlock: %v", err)
		}
		unlocked := time.Since(start)
		slowest = max(slowest, tried, unlocked)
		if tried > time.Second || unlocked > time.Second {
			slow = append(slow, fmt.Sprintf("round %d: TryLock %v, Unlock %v", n, tried, unlocked))
		}
	}
	t.Logf("%d TryLock+Unlock beside the waiting Lock, slowest step %v (slice %v)", n, slowest, slice)
	if len(slow) > 0 {
		t.Errorf("a TryLock or Unlock waited for the blocking Lock's slice (%v) instead of interrupting it: %v", slice, slow)
	}
	stillWaiting(t, wch)
	endWait()
	notHeld(t, dsn, k2)
}

// The mark of a wait in flight (keyHold.waits) does not outlive the
// wait. Once a blocking RLock's wait is granted, a TryRLock
// of the key on the same backend joins the hold; once a wait is
// cancelled, a TryRLock goes to the server and takes the key when it is
// free.
func TestTryAfterWaitEndsJoinsOrTakesAtOnce(t *testing.T) {
	t.Parallel()
	clientAndSession(t, func(t *testing.T, name string, onSession bool) {
		ctx := testCtx(t)
		dsn := pgtest.DB(t)
		c := newTestClient(t, dsn, WithSharedBackends(1), WithMaxWaits(1))
		rlock, tryRLock := c.RLock, c.TryRLock
		if onSession {
			s := newTestSession(t, c)
			rlock, tryRLock = s.RLock, s.TryRLock
		}
		k := HashKey("lockcore", "waits-mark", name)
		other := pgtest.Conn(t, dsn)
		for round := range 2 {
			granted := round == 0
			if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1)", k.coreKey().V); err != nil {
				t.Fatal(err)
			}
			wctx, cancelWait := context.WithCancel(ctx)
			wch := goLock(func() (*Lock, error) { return rlock(wctx, k) })
			pgtest.Eventually(t, testTimeout, "the reader waits on the server", func() bool { return waitingOn(t, dsn, k) == 1 })
			if l, err := tryRLock(ctx, k); !errors.Is(err, ErrLocked) {
				if err == nil {
					_ = l.Unlock(ctx)
				}
				t.Fatalf("TryRLock during the wait: %v, want ErrLocked", err)
			}
			var waiter *Lock
			if granted {
				if _, err := other.Exec(ctx, "SELECT pg_advisory_unlock($1)", k.coreKey().V); err != nil {
					t.Fatal(err)
				}
				r := receive(t, wch)
				if r.err != nil {
					t.Fatalf("RLock after the writer left: %v", r.err)
				}
				waiter = r.l
			} else {
				cancelWait()
				if r := receive(t, wch); r.err == nil {
					t.Fatal("the cancelled RLock took the key")
				}
				if _, err := other.Exec(ctx, "SELECT pg_advisory_unlock($1)", k.coreKey().V); err != nil {
					t.Fatal(err)
				}
			}
			cancelWait()
			start := time.Now()
			tctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			l, err := tryRLock(tctx, k)
			cancel()
			if err != nil || time.Since(start) > tryBound {
				t.Fatalf("round %d (wait granted: %v): TryRLock of a key no writer holds: %v after %v; want it taken at once (a stale mark of the wait?)", round, granted, err, time.Since(start))
			}
			mustUnlock(t, l)
			if waiter != nil {
				mustUnlock(t, waiter)
			}
			notHeld(t, dsn, k)
		}
	})
}

// lockWaitingOn holds k on a connection of its own and starts s.Lock(k),
// which it returns once the Lock waits on the server, with its result's
// channel; endWait cancels the Lock and checks that it did not take k.
func lockWaitingOn(t *testing.T, ctx context.Context, dsn string, s *Session, k Key) (wch <-chan result, endWait func()) {
	t.Helper()
	outside := pgtest.Conn(t, dsn)
	if _, err := outside.Exec(ctx, "SELECT pg_advisory_lock($1)", k.coreKey().V); err != nil {
		t.Fatal(err)
	}
	wctx, cancelWait := context.WithCancel(ctx)
	t.Cleanup(cancelWait)
	wch = goLock(func() (*Lock, error) { return s.Lock(wctx, k) })
	pgtest.Eventually(t, testTimeout, "the Lock waits on the server", func() bool { return waitingOn(t, dsn, k) == 1 })
	return wch, func() {
		t.Helper()
		cancelWait()
		if r := receive(t, wch); r.err == nil {
			t.Fatalf("the Lock took %v while it is held elsewhere", k)
		}
	}
}
