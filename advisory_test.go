package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

func TestLockExcludesOtherClients(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	a, b := newTestClient(t, dsn), newTestClient(t, dsn)
	k := HashKey("exclusion")

	l, err := a.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	heldOnlyBy(t, dsn, k, l.core.S.PID())
	if _, err := b.TryLock(ctx, k); !errors.Is(err, ErrLocked) {
		t.Fatalf("TryLock while held elsewhere: %v, want ErrLocked", err)
	}
	if _, err := b.TryRLock(ctx, k); !errors.Is(err, ErrLocked) {
		t.Fatalf("TryRLock while held exclusively elsewhere: %v, want ErrLocked", err)
	}
	mustUnlock(t, l)
	notHeld(t, dsn, k)
	if err := l.Unlock(ctx); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("second Unlock: %v, want ErrNotHeld", err)
	}
	if !errors.Is(l.Err(), ErrNotHeld) {
		t.Fatalf("Err after Unlock: %v, want ErrNotHeld", l.Err())
	}

	l2, err := b.TryLock(ctx, k)
	if err != nil {
		t.Fatalf("TryLock after Unlock: %v", err)
	}
	heldOnlyBy(t, dsn, k, l2.core.S.PID())
	mustUnlock(t, l2)
}

func TestSharedLocks(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	r1, r2, w := newTestClient(t, dsn), newTestClient(t, dsn), newTestClient(t, dsn)
	k := Int64Key(7)

	l1, err := r1.RLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	l2, err := r2.RLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	rows := lockState(t, dsn)[k]
	if len(rows) != 2 || !rows[0].shared || !rows[1].shared || !rows[0].granted || !rows[1].granted {
		t.Fatalf("pg_locks for two readers: %+v, want two granted ShareLocks", rows)
	}

	wch := goLock(func() (*Lock, error) { return w.Lock(ctx, k) })
	pgtest.Eventually(t, testTimeout, "writer waits in pg_locks", func() bool { return waitingOn(t, dsn, k) == 1 })
	mustUnlock(t, l1)
	stillWaiting(t, wch)
	mustUnlock(t, l2)
	res := receive(t, wch)
	if res.err != nil {
		t.Fatal(res.err)
	}
	heldOnlyBy(t, dsn, k, res.l.core.S.PID())
	mustUnlock(t, res.l)
	notHeld(t, dsn, k)
}

// A writer that waits is served before readers that arrive after it, so a
// stream of readers cannot starve it.
func TestWaitingWriterNotStarvedByReaders(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	w := newTestClient(t, dsn)
	k := HashKey("starve")

	// A stream of readers from several Clients, each holding only briefly
	// and overlapping the others, so the key is never free of readers.
	readers := make([]*Client, 4)
	for i := range readers {
		readers[i] = newTestClient(t, dsn)
	}
	first, err := readers[0].RLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var readsAfterWriterQueued atomic.Int64
	var writerGotIt atomic.Bool
	writerQueued := make(chan struct{})
	for _, r := range readers[1:] {
		wg.Go(func() {
			for i := 0; i < 10_000; i++ {
				select {
				case <-stop:
					return
				default:
				}
				l, err := r.RLock(ctx, k)
				if err != nil {
					t.Error(err)
					return
				}
				select {
				case <-writerQueued:
					if !writerGotIt.Load() {
						readsAfterWriterQueued.Add(1)
					}
				default:
				}
				if err := l.Unlock(ctx); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}

	wch := goLock(func() (*Lock, error) { return w.Lock(ctx, k) })
	pgtest.Eventually(t, testTimeout, "writer waits in pg_locks", func() bool {
		for _, h := range lockState(t, dsn)[k] {
			if !h.granted && !h.shared {
				return true
			}
		}
		return false
	})
	close(writerQueued)
	// New readers now queue behind the writer: once the first reader goes,
	// the writer must get the key even though readers keep coming.
	mustUnlock(t, first)
	res := receive(t, wch)
	writerGotIt.Store(true)
	close(stop)
	if res.err != nil {
		t.Fatal(res.err)
	}
	heldOnlyBy(t, dsn, k, res.l.core.S.PID())
	mustUnlock(t, res.l)
	wg.Wait()
	// Readers that asked after the writer queued waited behind it: between
	// its queueing and its grant, at most the reads already granted when it
	// queued (one per reader) got through.
	n := readsAfterWriterQueued.Load()
	t.Logf("%d reads completed while the writer waited", n)
	if n > int64(len(readers)-1) {
		t.Fatalf("%d reads completed after the writer queued: new readers overtook it", n)
	}
}

// A blocking Lock whose deadline races the holder's release either returns
// a held lock or an error, and never leaves a lock behind.
func TestLockCancelRaceLeavesNothing(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	const workers, rounds = 4, 125 // 500 races in total
	var won, lost atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		holder, waiter := newTestClient(t, dsn), newTestClient(t, dsn)
		k := PairKey(int32(w), 500)
		// Open the waiter's connection first, so the race is between the
		// deadline and the lock, not the connect.
		warm, err := waiter.Lock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		mustUnlock(t, warm)
		wg.Go(func() {
			for i := range rounds {
				if t.Failed() {
					return
				}
				held, err := holder.Lock(ctx, k)
				if err != nil {
					t.Error(err)
					return
				}
				// Release and deadline both land in the same few
				// milliseconds, in random order.
				released := make(chan error, 1)
				time.AfterFunc(time.Duration(rand.IntN(3000))*time.Microsecond, func() {
					released <- held.Unlock(ctx)
				})
				wctx, cancel := context.WithTimeout(ctx, time.Duration(rand.IntN(3000))*time.Microsecond)
				l, err := waiter.Lock(wctx, k)
				cancel()
				if err := <-released; err != nil {
					t.Errorf("round %d: holder Unlock: %v", i, err)
					return
				}
				if err != nil {
					if !errors.Is(err, context.DeadlineExceeded) {
						t.Errorf("round %d: Lock: %v, want a deadline error", i, err)
						return
					}
					lost.Add(1)
					if rows := lockState(t, dsn)[k]; len(rows) != 0 {
						t.Errorf("round %d: Lock failed (%v) but pg_locks has %+v", i, err, rows)
						return
					}
					continue
				}
				won.Add(1)
				if got := grantedTo(t, dsn, k); len(got) != 1 || got[0] != l.core.S.PID() {
					t.Errorf("round %d: Lock returned a lock, but pg_locks shows holders %v, want %d", i, got, l.core.S.PID())
					return
				}
				if err := l.Unlock(ctx); err != nil {
					t.Errorf("round %d: Unlock: %v", i, err)
					return
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d acquired, %d cancelled", won.Load(), lost.Load())
	if !t.Failed() && (won.Load() == 0 || lost.Load() == 0) {
		t.Fatalf("the race never went both ways (%d acquired, %d cancelled)", won.Load(), lost.Load())
	}
}

// Unlock with an already-cancelled context still releases the lock, and a
// connection that held a lock never goes back to the pool.
func TestUnlockWithCancelledContextOnTinyPool(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn, func(c *pgxpool.Config) { c.MaxConns = 1 })
	a := newTestClientOn(t, pool)
	k := HashKey("tiny-pool")

	l, err := a.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := l.Unlock(cancelled); err != nil {
		t.Fatalf("Unlock with cancelled ctx: %v", err)
	}
	notHeld(t, dsn, k)

	b := newTestClient(t, dsn)
	lb, err := b.TryLock(ctx, k)
	if err != nil {
		t.Fatalf("second Client TryLock: %v", err)
	}
	heldOnlyBy(t, dsn, k, lb.core.S.PID())

	// The pool's one connection is not the one that held the lock, so its
	// next borrower cannot re-enter it.
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var got bool
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1::int8)", mustInt64(k)).Scan(&got); err != nil {
		t.Fatal(err)
	}
	if got {
		t.Fatal("a pool borrower re-entered the lock that another Client holds")
	}
	mustUnlock(t, lb)
}

// Two sessions locking two keys in opposite order: a lock cycle of the
// application. PostgreSQL picks one acquire as the deadlock victim: it
// fails with ErrDeadlock and takes nothing, and its session and the lock it
// held live on (pg_locks), until the application releases that lock; then
// the other side proceeds.
func TestDeadlockVictimKeepsItsSession(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	// Two Clients: locks of one Client exclude each other in process,
	// where PostgreSQL cannot see a cycle.
	s1 := newTestSession(t, newTestClient(t, dsn))
	s2 := newTestSession(t, newTestClient(t, dsn))
	a, b := Int64Key(1), Int64Key(2)

	la, err := s1.Lock(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	lb, err := s2.Lock(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	ch1 := goLock(func() (*Lock, error) { return s1.Lock(ctx, b) })
	ch2 := goLock(func() (*Lock, error) { return s2.Lock(ctx, a) })
	var victim, winner *Session
	var vheld *Lock
	var wch <-chan result
	select {
	case r := <-ch1:
		victim, winner, vheld, wch = s1, s2, la, ch2
		if !errors.Is(r.err, ErrDeadlock) {
			t.Fatalf("first acquire to return: %v, want ErrDeadlock", r.err)
		}
	case r := <-ch2:
		victim, winner, vheld, wch = s2, s1, lb, ch1
		if !errors.Is(r.err, ErrDeadlock) {
			t.Fatalf("first acquire to return: %v, want ErrDeadlock", r.err)
		}
	case <-time.After(testTimeout):
		t.Fatal("no deadlock was detected")
	}
	if err := victim.Err(); err != nil {
		t.Fatalf("victim session: %v, want it open", err)
	}
	if err := vheld.Err(); err != nil {
		t.Fatalf("victim's held lock: %v, want it held", err)
	}
	heldOnlyBy(t, dsn, vheld.Key(), victim.PID())
	stillWaiting(t, wch)
	// The application resolves its cycle: the victim lets go.
	mustUnlock(t, vheld)
	wres := receive(t, wch)
	if wres.err != nil {
		t.Fatalf("winner's Lock: %v", wres.err)
	}
	heldOnlyBy(t, dsn, a, winner.PID())
	heldOnlyBy(t, dsn, b, winner.PID())
}

func TestLockAllNeverDeadlocks(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	keys := []Key{Int64Key(1), Int64Key(2), PairKey(1, 2), HashKey("x")}
	var wg sync.WaitGroup
	for w := range 4 {
		s := newTestSession(t, newTestClient(t, dsn))
		wg.Go(func() {
			for i := range 50 {
				order := append([]Key(nil), keys...)
				rand.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
				l, err := s.LockAll(ctx, order...)
				if err != nil {
					t.Errorf("worker %d round %d: %v", w, i, err)
					return
				}
				if len(l.Keys()) != len(keys) {
					t.Errorf("LockAll returned keys %v", l.Keys())
				}
				if err := l.Unlock(ctx); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	for _, k := range keys {
		notHeld(t, dsn, k)
	}
}

// 200 goroutines of one Client contending for one key queue in process:
// at most two backends are ever used, and the critical section never
// overlaps.
func TestInProcessQueueUsesFewBackends(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	const app = "pgcoord-queue-test"
	c := newTestClient(t, dsn, WithApplicationName(app))
	k := HashKey("queue")

	var maxBackends atomic.Int64
	observer := pgtest.Conn(t, dsn)
	stopObserving := make(chan struct{})
	observed := make(chan struct{})
	go func() {
		defer close(observed)
		for range 100_000 {
			select {
			case <-stopObserving:
				return
			default:
			}
			var n int64
			if err := observer.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", app).Scan(&n); err != nil {
				t.Error(err)
				return
			}
			if n > maxBackends.Load() {
				maxBackends.Store(n)
			}
		}
	}()

	var inside atomic.Int32
	counter := 0
	var wg sync.WaitGroup
	for range 200 {
		wg.Go(func() {
			for range 3 {
				l, err := c.Lock(ctx, k)
				if err != nil {
					t.Error(err)
					return
				}
				if inside.Add(1) != 1 {
					t.Error("two goroutines inside the critical section")
				}
				counter++ // unsynchronised on purpose: the lock is the only guard
				inside.Add(-1)
				if err := l.Unlock(ctx); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(stopObserving)
	<-observed
	if counter != 600 {
		t.Fatalf("counter = %d, want 600", counter)
	}
	t.Logf("at most %d backends used", maxBackends.Load())
	if n := maxBackends.Load(); n > 2 || n < 1 {
		t.Fatalf("%d backends used by 200 goroutines on one key, want 1 or 2", n)
	}
}

func TestSessionHoldsManyLocksOnOneBackend(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	s := newTestSession(t, c)
	k1, k2 := HashKey("s", "1"), PairKey(3, 4)
	l1, err := s.Lock(ctx, k1)
	if err != nil {
		t.Fatal(err)
	}
	r1, err := s.RLock(ctx, k2)
	if err != nil {
		t.Fatal(err)
	}
	r2, err := s.TryRLock(ctx, k2) // shared again on the same backend
	if err != nil {
		t.Fatal(err)
	}
	heldOnlyBy(t, dsn, k1, s.PID())
	heldOnlyBy(t, dsn, k2, s.PID())
	mustUnlock(t, r1)
	heldOnlyBy(t, dsn, k2, s.PID()) // r2 still holds it
	mustUnlock(t, r2)
	notHeld(t, dsn, k2)

	// Close releases what is left; the locks report it.
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
	awaitEnd(t, l1, "after its session was closed")
	if !errors.Is(l1.Err(), ErrClosed) {
		t.Fatalf("lock Err after session Close: %v, want ErrClosed", l1.Err())
	}
	pgtest.Eventually(t, testTimeout, "session's locks freed after Close", func() bool { return len(lockState(t, dsn)[k1]) == 0 })
	if _, err := s.Lock(ctx, k1); !errors.Is(err, ErrClosed) {
		t.Fatalf("Lock on closed session: %v, want ErrClosed", err)
	}
}

func TestClientCloseEndsWaitersAndLocks(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	holder := newTestClient(t, dsn)
	c, err := New(pgtest.Pool(t, dsn))
	if err != nil {
		t.Fatal(err)
	}
	k := HashKey("close")
	h, err := holder.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	mine, err := c.Lock(ctx, HashKey("mine"))
	if err != nil {
		t.Fatal(err)
	}
	wch := goLock(func() (*Lock, error) { return c.Lock(ctx, k) })
	pgtest.Eventually(t, testTimeout, "waiter queued in pg_locks", func() bool { return waitingOn(t, dsn, k) == 1 })
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if r := receive(t, wch); !errors.Is(r.err, ErrClosed) {
		t.Fatalf("waiting Lock after Close: %v, want ErrClosed", r.err)
	}
	awaitEnd(t, mine, "after its Client was closed")
	if _, err := c.Lock(ctx, k); !errors.Is(err, ErrClosed) {
		t.Fatalf("Lock after Close: %v, want ErrClosed", err)
	}
	pgtest.Eventually(t, testTimeout, "closed Client's locks freed", func() bool {
		return len(lockState(t, dsn)[HashKey("mine")]) == 0 && waitingOn(t, dsn, k) == 0
	})
	mustUnlock(t, h)
}

func TestBadInput(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	if _, err := c.Lock(ctx, Key{}); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("Lock(zero Key): %v, want ErrInvalidKey", err)
	}
	if _, err := c.Lock(ctx, HashKey()); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("Lock(HashKey()): %v, want ErrInvalidKey", err)
	}
	if _, err := c.LockAll(ctx); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("LockAll(): %v, want ErrInvalidKey", err)
	}
	if _, err := c.LockAll(ctx, Int64Key(1), Key{}); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("LockAll with a zero Key: %v, want ErrInvalidKey", err)
	}
	if _, err := c.Lock(ctx, Int64Key(1), nil); err == nil {
		t.Error("Lock with a nil option: no error")
	}
	pool := pgtest.Pool(t, dsn)
	for _, tc := range []struct {
		name string
		opts []Option
	}{
		{"zero heartbeat", []Option{WithHeartbeat(0)}},
		{"heartbeat over half the loss deadline", []Option{WithHeartbeat(3 * time.Second)}},
		{"tiny loss deadline", []Option{WithLossDeadline(time.Millisecond)}},
		{"nil logger", []Option{WithLogger(nil)}},
		{"empty application name", []Option{WithApplicationName("")}},
		{"nil option", []Option{nil}},
	} {
		if _, err := New(pool, tc.opts...); err == nil {
			t.Errorf("New with %s: no error", tc.name)
		} else {
			t.Logf("%s: %v", tc.name, err)
		}
	}
	if _, err := New(nil); err == nil {
		t.Error("New(nil): no error")
	}
	for _, k := range []Key{Int64Key(1), HashKey("a")} {
		if _, err := c.RLock(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.LockAll(ctx, Int64Key(5), Int64Key(6)); err != nil {
		t.Fatal(err)
	}
	if err := c.Do(ctx, Int64Key(9), func(context.Context) error { return fmt.Errorf("boom") }); err == nil || err.Error() != "boom" {
		t.Fatalf("Do returns fn's error unchanged: %v", err)
	}
	notHeld(t, dsn, Int64Key(9))
}

// lossNoticeBound is the documented time within which a terminated
// backend is noticed: the next heartbeat, plus one interval for its round
// trip on a loaded machine.
func lossNoticeBound(c *core.Config) time.Duration { return 2 * c.Heartbeat }

func newTestSession(t testing.TB, c *Client) *Session {
	t.Helper()
	s, err := c.NewSession(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close(context.Background()) })
	return s
}

func mustInt64(k Key) int64 {
	v, ok := k.Int64()
	if !ok {
		panic("not a bigint key")
	}
	return v
}

func TestOpen(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	if _, err := Open(ctx, "postgres://%%%"); err == nil {
		t.Fatal("Open with a bad connection string: no error")
	}
	if _, err := Open(ctx, dsn, WithHeartbeat(-1)); err == nil {
		t.Fatal("Open with a bad option: no error")
	}
	if _, err := Open(ctx, "postgres://postgres@127.0.0.1:1/x?sslmode=disable&connect_timeout=5"); err == nil {
		t.Fatal("Open with nothing listening: no error")
	}
	c, err := Open(ctx, dsn, WithApplicationName("open-test"))
	if err != nil {
		t.Fatal(err)
	}
	// Open opened the first lock connection, and the pool holds none: a
	// Client that only locks costs one backend.
	if st := c.Stat(); st.Backends != 1 {
		t.Fatalf("after Open: Stat %+v, want 1 backend", st)
	}
	if n := c.core.Pool.Stat().TotalConns(); n != 0 {
		t.Fatalf("after Open: the pool holds %d connections, want 0", n)
	}
	if n := backendsOf(t, dsn, "open-test"); n != 1 {
		t.Fatalf("after Open: %d backends in pg_stat_activity, want 1", n)
	}
	l, err := c.Lock(ctx, Int64Key(3))
	if err != nil {
		t.Fatal(err)
	}
	heldOnlyBy(t, dsn, Int64Key(3), l.core.S.PID())
	if n := backendsOf(t, dsn, "open-test"); n != 1 {
		t.Fatalf("after Lock: %d backends in pg_stat_activity, want 1", n)
	}
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := c.core.Pool.Ping(ctx); err == nil {
		t.Fatal("Close did not close the pool Open made")
	}
	pgtest.Eventually(t, testTimeout, "lock freed after Close", func() bool { return len(lockState(t, dsn)[Int64Key(3)]) == 0 })
}
