package pgcoord

// Promises of the lock core's common path: statements that want a
// session's connection while a blocking acquire waits on it, the end of a
// lock as Done and Err tell it, and the modes and keys the one-key
// statements take, read back from pg_locks.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
	"go.uber.org/goleak"
)

// Promise: while a blocking Lock of a Session waits on its connection for
// a key held elsewhere, TryLock/Unlock of other keys on that Session, from
// many goroutines, interrupt the wait and answer promptly (well within a
// wait slice); once the key is freed, the blocking Lock takes it while the
// statements go on (neither starves the other); pg_locks then shows the
// Session holding the key and nothing else.
func TestStatementsYieldAndBlockingLockNotStarvedOnOneSession(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	ignore := goleak.IgnoreCurrent()
	c := newTestClientOn(t, pool)
	s := newTestSession(t, c)
	k := Int64Key(88100)
	outside := pgtest.Conn(t, dsn)
	outsideLock(t, outside, k)

	wait := goLock(func() (*Lock, error) { return s.Lock(ctx, k) })
	pgtest.Eventually(t, 10*time.Second, "blocking Lock waits", func() bool { return waitingOn(t, dsn, k) == 1 })

	slice := c.core.Cfg.WaitSlice()
	prompt := min(slice/4, 2*time.Second)
	const workers, rounds = 8, 25
	var stop atomic.Bool
	var slowest atomic.Int64
	var wg sync.WaitGroup
	var total atomic.Int64
	runWorkers := func(base int64) {
		for w := range workers {
			wk := Int64Key(base + int64(w))
			wg.Go(func() {
				for i := 0; i < rounds*20 && !stop.Load(); i++ {
					start := time.Now()
					l, err := s.TryLock(ctx, wk)
					if err != nil {
						t.Errorf("TryLock %v while a blocking Lock waits: %v", wk, err)
						return
					}
					if err := l.Unlock(ctx); err != nil {
						t.Errorf("Unlock %v: %v", wk, err)
						return
					}
					d := time.Since(start)
					for {
						old := slowest.Load()
						if int64(d) <= old || slowest.CompareAndSwap(old, int64(d)) {
							break
						}
					}
					if total.Add(1) >= workers*rounds && base == 88200 {
						return
					}
				}
			})
		}
	}
	runWorkers(88200)
	wg.Wait()
	t.Logf("%d TryLock+Unlock beside the waiting Lock, slowest %v", total.Load(), time.Duration(slowest.Load()))
	if got := time.Duration(slowest.Load()); got > prompt {
		t.Errorf("broken promise: a TryLock+Unlock beside a waiting blocking Lock took %v, want under %v (slice %v)", got, prompt, slice)
	}
	stillWaiting(t, wait)
	// The last statement may have interrupted the wait a moment ago: the
	// Lock resumes it once the connection is free.
	pgtest.Eventually(t, 10*time.Second, "the blocking Lock waits on the server again after the statements", func() bool {
		return waitingOn(t, dsn, k) == 1
	})

	// Statements keep coming while the key is freed: the Lock must get it.
	total.Store(0)
	runWorkers(88300)
	outsideUnlock(t, outside, k)
	r := receive(t, wait)
	stop.Store(true)
	wg.Wait()
	if r.err != nil {
		t.Fatalf("blocking Lock after the key was freed: %v", r.err)
	}
	heldOnlyBy(t, dsn, k, s.PID())
	for _, h := range lockState(t, dsn)[k] {
		if h.shared {
			t.Fatalf("pg_locks: Lock holds %v in share mode", k)
		}
	}
	st := lockState(t, dsn)
	if len(st) != 1 {
		t.Fatalf("pg_locks: want only %v, have %v", k, st)
	}
	mustUnlock(t, r.l)
	notHeld(t, dsn, k)
	if err := s.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := goleak.Find(ignore); err != nil {
		t.Fatalf("goroutines left: %v", err)
	}
}

// checkLockEnded checks Done channels obtained before the end (before) and
// after it: every one closes, Err is non-nil once it has, and matches want.
func checkLockEnded(t *testing.T, l *Lock, before []<-chan struct{}, want error, what string) {
	t.Helper()
	for i, ch := range before {
		select {
		case <-ch:
		case <-time.After(testTimeout):
			t.Fatalf("%s: Done #%d obtained before the end never closed", what, i)
		}
		if err := l.Err(); err == nil {
			t.Fatalf("%s: Err is nil once Done closed", what)
		}
	}
	select {
	case <-l.Done():
	default:
		t.Fatalf("%s: Done obtained after the end is not closed", what)
	}
	if err := l.Err(); !errors.Is(err, want) {
		t.Fatalf("%s: Err = %v, want %v", what, err, want)
	}
	// Same channel every time.
	if first, second := l.Done(), l.Done(); first != second {
		t.Fatalf("%s: Done returns different channels", what)
	}
}

// watchLockDone starts goroutines that call Done concurrently and, when it
// closes, check Err; it returns their channels.
func watchLockDone(t *testing.T, l *Lock, n int, wg *sync.WaitGroup) []<-chan struct{} {
	chans := make([]<-chan struct{}, n)
	ready := make(chan (<-chan struct{}), n)
	for range n {
		wg.Go(func() {
			ch := l.Done()
			ready <- ch
			select {
			case <-ch:
				if l.Err() == nil {
					t.Errorf("Err is nil after Done closed")
				}
			case <-time.After(testTimeout):
				t.Errorf("Done never closed")
			}
		})
	}
	for i := range n {
		chans[i] = <-ready
	}
	return chans
}

// Promise: Done closes, once, for every way a lock ends: Unlock (racing
// Done from many goroutines), loss of its backend, Session.Close,
// Client.Close and a handoff to another goroutine of the process; a Done
// obtained before or after the end is closed, Err is non-nil once it is,
// and once Done closed the key can be taken again in this process at once.
func TestDoneClosesForEveryEndAndKeyIsFreeAfter(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)

	t.Run("Unlock", func(t *testing.T) {
		c := newTestClient(t, dsn)
		s := newTestSession(t, c)
		for i := range 30 {
			k := Int64Key(88400 + int64(i%3))
			var l *Lock
			var err error
			if i%2 == 0 {
				l, err = c.TryLock(ctx, k)
			} else {
				l, err = s.TryRLock(ctx, k)
			}
			if err != nil {
				t.Fatalf("round %d: %v", i, err)
			}
			var wg sync.WaitGroup
			start := make(chan struct{})
			var before []<-chan struct{}
			if i%3 != 0 {
				before = append(before, l.Done())
			}
			for range 6 {
				wg.Go(func() {
					<-start
					ch := l.Done()
					select {
					case <-ch:
						if l.Err() == nil {
							t.Errorf("Err is nil after Done closed")
						}
					case <-time.After(testTimeout):
						t.Errorf("Done never closed")
					}
				})
			}
			close(start)
			mustUnlock(t, l)
			checkLockEnded(t, l, before, ErrNotHeld, "Unlock")
			wg.Wait()
			// Taken again at once: the gates were left before Done closed.
			again, err := c.TryLock(ctx, k)
			if err != nil {
				t.Fatalf("round %d: TryLock after Done closed: %v", i, err)
			}
			mustUnlock(t, again)
		}
		notHeld(t, dsn, Int64Key(88400))
	})

	t.Run("Done after end first", func(t *testing.T) {
		c := newTestClient(t, dsn)
		k := PairKey(884, 5)
		l, err := c.TryLock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		mustUnlock(t, l)
		checkLockEnded(t, l, nil, ErrNotHeld, "Done first called after Unlock")
	})

	t.Run("loss", func(t *testing.T) {
		c := newTestClient(t, dsn, WithHeartbeat(200*time.Millisecond), WithLossDeadline(2*time.Second))
		s := newTestSession(t, c)
		k := Int64Key(88410)
		l, err := s.Lock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		l2, err := s.TryRLock(ctx, PairKey(8841, 1))
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		before := watchLockDone(t, l, 4, &wg)
		// Statements race for the connection as the backend dies.
		var sw sync.WaitGroup
		for w := range 4 {
			wk := Int64Key(88420 + int64(w))
			sw.Go(func() {
				for range 200 {
					x, err := s.TryLock(ctx, wk)
					if err != nil {
						if !errors.Is(err, ErrLockLost) {
							t.Errorf("TryLock on a lost session: %v, want ErrLockLost", err)
						}
						return
					}
					if err := x.Unlock(ctx); err != nil {
						if !errors.Is(err, ErrLockLost) {
							t.Errorf("Unlock on a lost session: %v", err)
						}
						return
					}
				}
			})
		}
		pgtest.Terminate(t, dsn, s.PID())
		checkLockEnded(t, l, before, ErrLockLost, "loss")
		awaitEnd(t, l2, "second lock of the lost session")
		if !errors.Is(l2.Err(), ErrLockLost) {
			t.Fatalf("second lock: %v", l2.Err())
		}
		wg.Wait()
		sw.Wait()
		again, err := c.TryLock(ctx, k)
		if err != nil {
			t.Fatalf("TryLock after loss: %v", err)
		}
		mustUnlock(t, again)
		pgtest.Eventually(t, 10*time.Second, "nothing left in pg_locks", func() bool { return len(lockState(t, dsn)) == 0 })
	})

	t.Run("Session.Close", func(t *testing.T) {
		c := newTestClient(t, dsn)
		s := newTestSession(t, c)
		k := PairKey(8843, 7)
		l, err := s.RLock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		before := watchLockDone(t, l, 4, &wg)
		if err := s.Close(ctx); err != nil {
			t.Fatal(err)
		}
		checkLockEnded(t, l, before, ErrClosed, "Session.Close")
		wg.Wait()
		again, err := c.TryLock(ctx, k)
		if err != nil {
			t.Fatalf("TryLock after Session.Close: %v", err)
		}
		mustUnlock(t, again)
		notHeld(t, dsn, k)
	})

	t.Run("Client.Close", func(t *testing.T) {
		pool := pgtest.Pool(t, dsn)
		c, err := New(pool)
		if err != nil {
			t.Fatal(err)
		}
		s, err := c.NewSession(ctx)
		if err != nil {
			t.Fatal(err)
		}
		l1, err := c.Lock(ctx, Int64Key(88440))
		if err != nil {
			t.Fatal(err)
		}
		l2, err := s.TryRLock(ctx, PairKey(8844, 1))
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		b1 := watchLockDone(t, l1, 3, &wg)
		if err := c.Close(ctx); err != nil {
			t.Fatal(err)
		}
		checkLockEnded(t, l1, b1, ErrClosed, "Client.Close (shared backend)")
		checkLockEnded(t, l2, nil, ErrClosed, "Client.Close (session)")
		wg.Wait()
		pgtest.Eventually(t, 10*time.Second, "nothing left in pg_locks", func() bool { return len(lockState(t, dsn)) == 0 })
	})

	t.Run("handoff", func(t *testing.T) {
		c := newTestClient(t, dsn, WithSharedBackends(1))
		k := Int64Key(88450)
		for round := range 20 {
			l, err := c.Lock(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			var before []<-chan struct{}
			if round%2 == 0 {
				before = watchLockDone(t, l, 3, &wg)
			}
			next := goLock(func() (*Lock, error) { return c.Lock(ctx, k) })
			// The second waits in this process, at the key's gate: let it
			// get there (bounded), then end the first.
			pgtest.Eventually(t, 10*time.Second, "second Lock queued at the key's gate", func() bool {
				c.core.Gates.Mu.Lock()
				defer c.core.Gates.Mu.Unlock()
				g := c.core.Gates.M[k.coreKey()]
				return g != nil && len(g.Queue) == 1
			})
			mustUnlock(t, l)
			checkLockEnded(t, l, before, ErrNotHeld, fmt.Sprintf("handoff round %d", round))
			wg.Wait()
			r := receive(t, next)
			if r.err != nil {
				t.Fatalf("round %d: the waiting Lock: %v", round, r.err)
			}
			nd := r.l.Done()
			select {
			case <-nd:
				t.Fatalf("round %d: the handed lock's Done closed while held (Err %v)", round, r.l.Err())
			default:
			}
			if r.l.Err() != nil {
				t.Fatalf("round %d: handed lock's Err while held: %v", round, r.l.Err())
			}
			if len(grantedTo(t, dsn, k)) != 1 {
				t.Fatalf("round %d: pg_locks: %v granted to %v", round, k, grantedTo(t, dsn, k))
			}
			mustUnlock(t, r.l)
			checkLockEnded(t, r.l, []<-chan struct{}{nd}, ErrNotHeld, "handed lock")
		}
		notHeld(t, dsn, k)
	})
}

// Promise: the one-key statements take the mode and key they are asked
// for: exclusive and shared, Int64Key and PairKey (negative halves too),
// try and blocking (also when the blocking one has to wait), on a Session
// and on the Client; pg_locks shows each as asked, on the right backend,
// and nothing is left after Unlock.
func TestOneKeyStatementsTakeTheModeAndKeyAsked(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	s := newTestSession(t, c)
	keys := []Key{Int64Key(88500), Int64Key(-88501), PairKey(885, 2), PairKey(-885, -3), PairKey(0, -1), Int64Key(int64(-1) << 40)}
	type acq struct {
		name   string
		shared bool
		f      func(context.Context, Key) (*Lock, error)
	}
	acqs := []acq{
		{"Session.Lock", false, func(ctx context.Context, k Key) (*Lock, error) { return s.Lock(ctx, k) }},
		{"Session.TryLock", false, func(ctx context.Context, k Key) (*Lock, error) { return s.TryLock(ctx, k) }},
		{"Session.RLock", true, func(ctx context.Context, k Key) (*Lock, error) { return s.RLock(ctx, k) }},
		{"Session.TryRLock", true, func(ctx context.Context, k Key) (*Lock, error) { return s.TryRLock(ctx, k) }},
		{"Client.Lock", false, func(ctx context.Context, k Key) (*Lock, error) { return c.Lock(ctx, k) }},
		{"Client.RLock", true, func(ctx context.Context, k Key) (*Lock, error) { return c.RLock(ctx, k) }},
	}
	for _, k := range keys {
		for _, a := range acqs {
			l, err := a.f(ctx, k)
			if err != nil {
				t.Fatalf("%s %v: %v", a.name, k, err)
			}
			st := lockState(t, dsn)
			if len(st) != 1 || len(st[k]) != 1 {
				t.Fatalf("%s %v: pg_locks %v, want exactly one row for the key", a.name, k, st)
			}
			if h := st[k][0]; !h.granted || h.shared != a.shared {
				t.Fatalf("%s %v: pg_locks %+v, want granted, shared=%v", a.name, k, h, a.shared)
			}
			if a.name[:7] == "Session" && st[k][0].pid != s.PID() {
				t.Fatalf("%s %v: held by %d, want the session's %d", a.name, k, st[k][0].pid, s.PID())
			}
			mustUnlock(t, l)
			notHeld(t, dsn, k)
		}
	}

	// The blocking statements when they have to wait: an outside shared
	// holder lets shared in at once and makes exclusive wait.
	outside := pgtest.Conn(t, dsn)
	for _, k := range []Key{PairKey(-886, 9), Int64Key(-88600)} {
		a, b, pair := k.Pair()
		lock, unlock := "SELECT pg_advisory_lock_shared($1)", "SELECT pg_advisory_unlock_shared($1)"
		args := []any{hotInt64(k)}
		if pair {
			lock, unlock = "SELECT pg_advisory_lock_shared($1::int4, $2::int4)", "SELECT pg_advisory_unlock_shared($1::int4, $2::int4)"
			args = []any{a, b}
		}
		if _, err := outside.Exec(ctx, lock, args...); err != nil {
			t.Fatal(err)
		}
		r, err := s.RLock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		mustUnlock(t, r)
		w := goLock(func() (*Lock, error) { return s.Lock(ctx, k) })
		pgtest.Eventually(t, 10*time.Second, "exclusive Lock waits behind the shared holder", func() bool { return waitingOn(t, dsn, k) == 1 })
		for _, h := range lockState(t, dsn)[k] {
			if !h.granted && (h.shared || h.pid != s.PID()) {
				t.Fatalf("pg_locks: waiter %+v, want the session's exclusive wait", h)
			}
		}
		if _, err := outside.Exec(ctx, unlock, args...); err != nil {
			t.Fatal(err)
		}
		res := receive(t, w)
		if res.err != nil {
			t.Fatal(res.err)
		}
		st := lockState(t, dsn)[k]
		if len(st) != 1 || st[0].shared || !st[0].granted || st[0].pid != s.PID() {
			t.Fatalf("pg_locks after the wait: %+v", st)
		}
		mustUnlock(t, res.l)
		notHeld(t, dsn, k)
	}
	if st := lockState(t, dsn); len(st) != 0 {
		t.Fatalf("pg_locks: left %v", st)
	}
}

func hotInt64(k Key) int64 { v, _ := k.Int64(); return v }

// Promise (context.Context, which an acquire's context is): once Err
// returns a non-nil error, every later call returns the same error, and
// the cause of an acquire's context that the Client's Close ended first
// is ErrClosed, whatever the caller's context does after.
func TestAcquireContextErrStaysTheSameOnceEnded(t *testing.T) {
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	c, err := New(pool)
	if err != nil {
		t.Fatal(err)
	}
	caller, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	a := c.core.AcquireCtx(caller)
	defer a.End()
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	first := a.Err()
	if first == nil {
		t.Fatal("Err is nil after the Client closed")
	}
	select {
	case <-caller.Done():
	case <-time.After(testTimeout):
		t.Fatal("caller's deadline never came")
	}
	if again := a.Err(); again != first {
		t.Errorf("broken promise: Err returned %v, then %v after the caller's deadline passed", first, again)
	}
	if cause := context.Cause(a); !errors.Is(cause, ErrClosed) {
		t.Errorf("broken promise: cause of an acquire's context that Close ended first: %v, want ErrClosed", cause)
	}
}

// Promise: an acquire whose context has already ended takes nothing: on a
// Session whose connection is free, TryLock and TryRLock of Int64Key and
// PairKey return the context's error and pg_locks shows nothing.
func TestEndedContextTryOnFreeSessionTakesNothing(t *testing.T) {
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	s := newTestSession(t, c)
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	for i := range 40 {
		k := Int64Key(88700 + int64(i))
		if i%2 == 1 {
			k = PairKey(887, int32(i))
		}
		var l *Lock
		var err error
		if i%4 < 2 {
			l, err = s.TryLock(ended, k)
		} else {
			l, err = s.TryRLock(ended, k)
		}
		if err == nil {
			mustUnlock(t, l)
			t.Fatalf("round %d: try with an ended context took %v", i, k)
		}
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("round %d: %v, want context.Canceled", i, err)
		}
		notHeld(t, dsn, k)
	}
}

// Promise: when a Session's backend is terminated while a blocking Lock
// waits on it and other goroutines' statements race for its connection,
// every call returns (the blocking Lock and the statements with
// ErrLockLost), every lock taken on it ends with Done closed and Err
// non-nil, nothing of it is left in pg_locks, and no goroutine is left.
func TestTerminatedSessionEndsRacingStatementsAndWait(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	outside := pgtest.Conn(t, dsn)
	ignore := goleak.IgnoreCurrent()
	for round := range 5 {
		c := newTestClientOn(t, pool, WithHeartbeat(200*time.Millisecond), WithLossDeadline(2*time.Second))
		s := newTestSession(t, c)
		k := Int64Key(88800)
		outsideLock(t, outside, k)
		wait := goLock(func() (*Lock, error) { return s.Lock(ctx, k) })
		pgtest.Eventually(t, 10*time.Second, "blocking Lock waits", func() bool { return waitingOn(t, dsn, k) == 1 })
		var wg sync.WaitGroup
		var mu sync.Mutex
		var held []*Lock
		started := make(chan struct{}, 6)
		for w := range 6 {
			wk := PairKey(888, int32(w))
			wg.Go(func() {
				for i := 0; i < 2000; i++ {
					var l *Lock
					var err error
					if w%2 == 0 {
						l, err = s.TryLock(ctx, wk)
					} else {
						l, err = s.TryRLock(ctx, wk)
					}
					if i == 0 {
						started <- struct{}{}
					}
					if err != nil {
						if !errors.Is(err, ErrLockLost) {
							t.Errorf("round %d: try on a terminated session: %v", round, err)
						}
						return
					}
					mu.Lock()
					held = append(held, l)
					mu.Unlock()
					if err := l.Unlock(ctx); err != nil {
						if !errors.Is(err, ErrLockLost) {
							t.Errorf("round %d: Unlock on a terminated session: %v", round, err)
						}
						return
					}
				}
			})
		}
		for range 6 {
			<-started
		}
		pgtest.Terminate(t, dsn, s.PID())
		r := receive(t, wait)
		if r.err == nil || !errors.Is(r.err, ErrLockLost) {
			t.Fatalf("round %d: blocking Lock on the terminated session: (%v, %v), want ErrLockLost", round, r.l, r.err)
		}
		wg.Wait()
		for _, l := range held {
			awaitEnd(t, l, "lock of the terminated session")
			if l.Err() == nil {
				t.Fatalf("round %d: Err nil after Done closed", round)
			}
		}
		outsideUnlock(t, outside, k)
		pgtest.Eventually(t, 10*time.Second, "nothing left in pg_locks", func() bool { return len(lockState(t, dsn)) == 0 })
		if err := c.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if err := goleak.Find(ignore); err != nil {
		t.Fatalf("goroutines left: %v", err)
	}
}

// Promise: under concurrent one-key acquires of one Client's shared
// backend (statements that may be combined), each goroutine's lock is on
// the server in the mode and key it asked for while it holds it, and gone
// once its Unlock returned nil.
func TestConcurrentOneKeyAcquiresShowTheirModeWhileHeld(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn, WithSharedBackends(1))
	var wg sync.WaitGroup
	for w := range 6 {
		conn := pgtest.Conn(t, dsn)
		var k Key
		if w%2 == 0 {
			k = Int64Key(-88900 - int64(w))
		} else {
			k = PairKey(-889, int32(w))
		}
		wg.Go(func() {
			for i := range 40 {
				shared := (i+w)%2 == 0
				var l *Lock
				var err error
				switch {
				case shared && i%3 == 0:
					l, err = c.RLock(ctx, k)
				case shared:
					l, err = c.TryRLock(ctx, k)
				case i%3 == 0:
					l, err = c.Lock(ctx, k)
				default:
					l, err = c.TryLock(ctx, k)
				}
				if err != nil {
					t.Errorf("worker %d round %d: %v", w, i, err)
					return
				}
				hs, err := keyHolders(ctx, conn, k)
				if err != nil {
					t.Error(err)
					return
				}
				if len(hs) != 1 || !hs[0].granted || hs[0].shared != shared {
					t.Errorf("worker %d round %d: pg_locks for %v: %+v, want one granted, shared=%v", w, i, k, hs, shared)
					return
				}
				if err := l.Unlock(ctx); err != nil {
					t.Errorf("worker %d round %d: Unlock: %v", w, i, err)
					return
				}
				hs, err = keyHolders(ctx, conn, k)
				if err != nil {
					t.Error(err)
					return
				}
				if len(hs) != 0 {
					t.Errorf("worker %d round %d: pg_locks for %v after Unlock: %+v", w, i, k, hs)
					return
				}
			}
		})
	}
	wg.Wait()
	if st := lockState(t, dsn); len(st) != 0 {
		t.Fatalf("pg_locks: left %v", st)
	}
}
