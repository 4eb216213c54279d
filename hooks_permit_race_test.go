package pgcoord

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// permitID names a permit in the events: its slot on its backend.
type permitID struct {
	slot int
	pid  int32
}

// balance checks the permit events of one semaphore: every acquire that
// returned a permit is matched by exactly one end (release or loss) of the
// same slot on the same backend, and nothing ends that was not acquired.
// It returns the numbers of permits acquired, released and lost.
func balance(t *testing.T, evs []PermitEvent, sem string) (acquired, released, lost int) {
	t.Helper()
	open := map[permitID]int{}
	for _, e := range evs {
		if e.Semaphore != sem {
			continue
		}
		id := permitID{e.Slot, e.PID}
		switch e.Kind {
		case PermitAcquired:
			if e.Err != nil {
				if e.Slot != -1 || e.PID != 0 {
					t.Errorf("failed acquire with a slot or a backend: %+v", e)
				}
				continue
			}
			open[id]++
			acquired++
		case PermitReleased:
			open[id]--
			released++
		case PermitLost:
			if !errors.Is(e.Err, ErrLockLost) {
				t.Errorf("loss event whose Err does not wrap ErrLockLost: %+v", e)
			}
			open[id]--
			lost++
		default:
			t.Errorf("event of kind %v: %+v", e.Kind, e)
		}
	}
	for id, n := range open {
		if n != 0 {
			t.Errorf("%s: slot %d on backend %d: %d more acquires than ends", sem, id.slot, id.pid, n)
		}
	}
	return acquired, released, lost
}

// The hook queue holds at most MaxPendingHookEvents events: once that
// many wait, newer ones are dropped. The queue's goroutine takes the
// whole pending list at once and delivers it; while a hook is slow inside
// that list, the rest of it still waits and counts against the bound.
func TestHookQueueBound(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)

	var delivered atomic.Int64
	entered := make(chan int64, 2)
	gates := [2]chan struct{}{make(chan struct{}), make(chan struct{})}
	var once [2]sync.Once
	open := func(i int) { once[i].Do(func() { close(gates[i]) }) }
	c := newTestClient(t, dsn, WithHooks(Hooks{OnAcquire: func(AcquireEvent) {
		n := delivered.Add(1)
		if n <= 2 {
			entered <- n
			<-gates[n-1]
		}
	}}))
	// Registered after the Client: runs before its Close, which waits
	// for the hooks.
	t.Cleanup(func() { open(0); open(1) })
	await := func(want int64) {
		t.Helper()
		select {
		case n := <-entered:
			if n != want {
				t.Fatalf("hook entered event %d, want %d", n, want)
			}
		case <-ctx.Done():
			t.Fatalf("the hook did not get event %d", want)
		}
	}

	k := HashKey("break", "queue-bound")
	l, err := c.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	generated := int64(1)
	await(1) // the hook is stuck in event 1

	refuse := func(n int) {
		t.Helper()
		for range n {
			if _, err := c.TryLock(ctx, k); !errors.Is(err, ErrLocked) {
				t.Fatalf("TryLock of a key this Client holds = %v, want ErrLocked", err)
			}
			generated++
		}
	}
	// The bound holds while the queue's goroutine is stuck before taking
	// the pending list: MaxPendingHookEvents wait, the next one is dropped.
	refuse(MaxPendingHookEvents)
	if d := c.Stat().DroppedHookEvents; d != 0 {
		t.Fatalf("%d events dropped with %d pending, want 0", d, MaxPendingHookEvents)
	}
	refuse(1)
	if d := c.Stat().DroppedHookEvents; d != 1 {
		t.Fatalf("%d events dropped with %d pending and one more, want 1", d, MaxPendingHookEvents)
	}

	// Let event 1 finish: the goroutine takes the 4096 pending events as
	// one list and gets stuck in the first of them.
	open(0)
	await(2)
	refuse(MaxPendingHookEvents)
	waiting := generated - delivered.Load() - c.Stat().DroppedHookEvents
	if waiting > MaxPendingHookEvents {
		t.Errorf("%d events wait for the hooks (generated %d, entered %d, dropped %d): the queue holds more than MaxPendingHookEvents = %d",
			waiting, generated, delivered.Load(), c.Stat().DroppedHookEvents, MaxPendingHookEvents)
	}

	// Whatever the bound: every event is delivered or dropped, none lost
	// silently.
	open(1)
	pgtest.Eventually(t, testTimeout, "every event delivered or dropped", func() bool {
		return delivered.Load()+c.Stat().DroppedHookEvents == generated
	})
	mustUnlock(t, l)
}

// Stat().DroppedHookEvents counts events not delivered because too many
// were pending. After Close, an acquire still reports its ErrClosed to
// the hook queue, which is closed: the event is not delivered, and not
// counted as dropped either (no hook was slow, nothing was pending), so
// metrics that export the figure report no drops for an idle, closed
// Client.
func TestHookEventsAfterCloseNotDropped(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	var rec permitRecorder
	var acquires atomic.Int64
	h := rec.hooks()
	h.OnAcquire = func(AcquireEvent) { acquires.Add(1) }
	c := newTestClient(t, dsn, WithHooks(h))
	sem := c.Semaphore("after-close", 1)
	mustRelease(t, mustAcquire(t, sem, true))
	if err := c.Close(ctx); err != nil {
		t.Fatal(err)
	}
	before := len(rec.events())
	if before != 2 {
		t.Fatalf("%d permit events before the calls after Close, want 2: %+v", before, rec.events())
	}
	if _, err := sem.TryAcquire(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("TryAcquire after Close = %v, want ErrClosed", err)
	}
	if _, err := c.TryLock(ctx, HashKey("after-close")); !errors.Is(err, ErrClosed) {
		t.Fatalf("TryLock after Close = %v, want ErrClosed", err)
	}
	if d := c.Stat().DroppedHookEvents; d != 0 {
		t.Errorf("Stat().DroppedHookEvents = %d after two calls on a closed Client whose hooks were never slow, want 0", d)
	}
}

// A permit whose backend is terminated while its Release is on its way
// (the Client may or may not have noticed the loss yet) ends in exactly
// one event, PermitLost, with the slot and backend that pg_locks showed,
// and its slot is free on the server.
func TestPermitHookReleaseRacesTerminatedBackend(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	var rec permitRecorder
	c := newTestClient(t, dsn, WithHooks(rec.hooks()))
	sem := c.Semaphore("release-vs-terminate", 2)

	const rounds = 4
	for i := range rounds {
		p := mustAcquire(t, sem, i%2 == 0)
		pid := holderPID(t, dsn, sem, p.Slot())
		pgtest.Terminate(t, dsn, pid)
		err := p.Release(ctx)
		if !errors.Is(err, ErrLockLost) {
			t.Fatalf("round %d: Release of a permit whose backend was terminated = %v, want ErrLockLost", i, err)
		}
		if !errors.Is(p.Err(), ErrLockLost) {
			t.Errorf("round %d: Permit.Err = %v, want ErrLockLost", i, p.Err())
		}
		// The loss event of this round, with its acquire, is the last
		// pair.
		evs := rec.until(t, 2*(i+1))
		acq, end := evs[2*i], evs[2*i+1]
		if acq.Kind != PermitAcquired || acq.PID != pid || acq.Slot != p.Slot() || acq.Err != nil {
			t.Errorf("round %d: acquire event %+v, want slot %d on backend %d", i, acq, p.Slot(), pid)
		}
		if end.Kind != PermitLost || end.PID != pid || end.Slot != p.Slot() || !errors.Is(end.Err, ErrLockLost) {
			t.Errorf("round %d: end event %+v, want PermitLost of slot %d on backend %d", i, end, p.Slot(), pid)
		}
		if slots, _ := slotLocks(t, dsn, sem); len(slots) != 0 {
			t.Errorf("round %d: pg_locks still shows slots %v", i, slots)
		}
		// A second Release reports nothing more.
		if err := p.Release(ctx); err == nil {
			t.Errorf("round %d: a second Release returned nil", i)
		}
	}
	if err := c.Close(ctx); err != nil {
		t.Fatal(err)
	}
	evs := rec.events()
	if len(evs) != 2*rounds {
		t.Errorf("%d events, want %d: %+v", len(evs), 2*rounds, evs)
	}
	if a, r, l := balance(t, evs, sem.Name()); a != rounds || r != 0 || l != rounds {
		t.Errorf("%d acquired, %d released, %d lost; want %d, 0, %d", a, r, l, rounds, rounds)
	}
}

// Close racing with goroutines that acquire and release permits of two
// semaphores: every permit an acquire returned ends in exactly one event
// (a Release that lost the race to Close included), Close returns only
// after they are delivered, nothing is dropped, and pg_locks shows no
// slot held afterwards.
func TestPermitHookCloseRacesAcquireRelease(t *testing.T) {
	dsn, _ := semaphoreDB(t)
	const rounds, workers = 3, 6
	for round := range rounds {
		ctx := testCtx(t)
		var rec permitRecorder
		// TestSemaphoreCloseRacingQueueLeave covers a Client without
		// WithLogger.
		c, err := New(pgtest.Pool(t, dsn), WithHooks(rec.hooks()), WithSharedBackends(2),
			WithLogger(slog.New(slog.DiscardHandler)))
		if err != nil {
			t.Fatal(err)
		}
		sems := []*Semaphore{c.Semaphore("race-a", 2), c.Semaphore("race-b", 3)}
		var progress atomic.Int64
		var returned atomic.Int64 // permits that acquires returned
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for w := range workers {
			wg.Go(func() {
				sem := sems[w%len(sems)]
				for i := 0; i < 200; i++ {
					select {
					case <-stop:
						return
					default:
					}
					acquire := sem.Acquire
					if i%3 == 0 {
						acquire = sem.TryAcquire
					}
					p, err := acquire(ctx)
					if err != nil {
						if !errors.Is(err, ErrClosed) && !errors.Is(err, ErrNoPermit) {
							t.Errorf("acquire: %v", err)
						}
						if errors.Is(err, ErrClosed) {
							return
						}
						continue
					}
					returned.Add(1)
					progress.Add(1)
					if err := p.Release(ctx); err != nil && !errors.Is(err, ErrClosed) && !errors.Is(err, ErrLockLost) {
						t.Errorf("Release: %v", err)
					}
				}
			})
		}
		pgtest.Eventually(t, testTimeout, "some permits to go round", func() bool { return progress.Load() >= 10 })
		closeErr := c.Close(context.Background())
		close(stop)
		wg.Wait()
		if closeErr != nil {
			t.Fatalf("round %d: Close: %v", round, closeErr)
		}
		evs := rec.events() // Close delivered everything: read once, no wait
		var acquired int
		for _, sem := range sems {
			a, r, l := balance(t, evs, sem.Name())
			if a != r+l {
				t.Errorf("round %d: %s: %d acquired, %d released, %d lost", round, sem.Name(), a, r, l)
			}
			acquired += a
			if slots, queued := slotLocks(t, dsn, sem); len(slots) != 0 || queued {
				t.Errorf("round %d: %s: after Close, pg_locks shows slots %v (queue used: %v)", round, sem.Name(), slots, queued)
			}
		}
		if int64(acquired) != returned.Load() {
			t.Errorf("round %d: %d acquire events with a permit, %d permits returned", round, acquired, returned.Load())
		}
		if d := c.Stat().DroppedHookEvents; d != 0 {
			t.Errorf("round %d: %d hook events dropped", round, d)
		}
	}
}

// Hooks may call the Client: an OnPermit hook that takes and gives back a
// permit of another semaphore for each permit of the first sees its own
// events too, in balance, and a hook that calls the Client while Close
// drains the queue does not hold Close up.
func TestPermitHookCallsClient(t *testing.T) {
	dsn, _ := semaphoreDB(t)
	var rec permitRecorder
	var c *Client
	var inner *Semaphore
	var innerErrs, closedCalls atomic.Int64
	h := rec.hooks()
	record := h.OnPermit
	h.OnPermit = func(e PermitEvent) {
		record(e)
		if e.Semaphore == "outer" && errors.Is(e.Err, ErrClosed) {
			// Close drains the queue: the Client refuses, at once.
			if _, err := inner.TryAcquire(context.Background()); errors.Is(err, ErrClosed) {
				closedCalls.Add(1)
			}
			return
		}
		if e.Semaphore != "outer" || e.Kind != PermitAcquired || e.Err != nil {
			return
		}
		p, err := inner.TryAcquire(context.Background())
		if err != nil {
			innerErrs.Add(1)
			return
		}
		if err := p.Release(context.Background()); err != nil {
			innerErrs.Add(1)
		}
	}
	c = newTestClient(t, dsn, WithHooks(h))
	inner = c.Semaphore("inner", 1)
	outer := c.Semaphore("outer", 2)
	const n = 5
	for range n {
		mustRelease(t, mustAcquire(t, outer, false))
	}
	// 2n outer events, and 2n inner ones from the hook.
	pgtest.Eventually(t, testTimeout, "the hook's own events", func() bool { return len(rec.events()) >= 4*n })
	if innerErrs.Load() != 0 {
		t.Errorf("%d errors of the Client called from the hook", innerErrs.Load())
	}
	evs := rec.events()
	if a, r, l := balance(t, evs, "inner"); a != n || r != n || l != 0 {
		t.Errorf("inner: %d acquired, %d released, %d lost; want %d, %d, 0", a, r, l, n, n)
	}
	// A permit held at Close: its release event reaches the hook, which
	// calls the closed Client; Close still returns.
	mustAcquire(t, outer, true)
	done := make(chan error, 1)
	go func() { done <- c.Close(context.Background()) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(testTimeout):
		t.Fatal("Close did not return while a hook called the Client")
	}
	if closedCalls.Load() != 1 {
		t.Errorf("the hook called the closing Client %d times and got ErrClosed, want 1", closedCalls.Load())
	}
	if a, r, l := balance(t, rec.events(), "outer"); a != n+1 || r != n+1 || l != 0 {
		t.Errorf("outer: %d acquired, %d released, %d lost; want %d, %d, 0", a, r, l, n+1, n+1)
	}
	if slots, _ := slotLocks(t, dsn, inner); len(slots) != 0 {
		t.Errorf("inner: pg_locks shows slots %v after Close", slots)
	}
}

// Lowering the limit below the permits held takes none away: the holders
// release theirs later, each once; a try by another Client in between is
// refused and reported with no slot and no backend; the events of every
// permit carry the backend that pg_locks shows.
func TestPermitHookSetLimitDownWhileHeld(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	var rec, rivalRec permitRecorder
	c := newTestClient(t, dsn, WithHooks(rec.hooks()), WithSharedBackends(3))
	rival := newTestClient(t, dsn, WithHooks(rivalRec.hooks()))
	sem := c.Semaphore("shrink", 4)
	rsem := rival.Semaphore("shrink", 4)

	var ps []*Permit
	for range 4 {
		ps = append(ps, mustAcquire(t, sem, true))
	}
	evs := rec.until(t, 4)
	slots, _ := slotLocks(t, dsn, sem)
	for i, e := range evs {
		if e.Kind != PermitAcquired || e.Err != nil || e.Slot != ps[i].Slot() || slots[e.Slot] != e.PID {
			t.Errorf("acquire event %+v: pg_locks has slot %d on backend %d", e, e.Slot, slots[e.Slot])
		}
	}
	if err := sem.SetLimit(ctx, 2); err != nil {
		t.Fatal(err)
	}
	if slots, _ := slotLocks(t, dsn, sem); len(slots) != 4 {
		t.Errorf("after SetLimit down, pg_locks shows %d slots, want the 4 still held", len(slots))
	}
	mustRelease(t, ps[0])
	mustRelease(t, ps[1])
	// 2 held, limit 2: refused.
	if _, err := rsem.TryAcquire(ctx); !errors.Is(err, ErrNoPermit) {
		t.Fatalf("rival TryAcquire with 2 held of 2 = %v, want ErrNoPermit", err)
	}
	rev := rivalRec.until(t, 1)
	if e := rev[0]; e.Kind != PermitAcquired || !e.Try || !errors.Is(e.Err, ErrNoPermit) || e.Slot != -1 || e.PID != 0 {
		t.Errorf("rival's refused try: %+v", e)
	}
	mustRelease(t, ps[2])
	rp := mustAcquire(t, rsem, true)
	rev = rivalRec.until(t, 2)
	if e := rev[1]; e.Kind != PermitAcquired || e.Err != nil || e.Slot >= 2 || e.PID != holderPID(t, dsn, sem, rp.Slot()) {
		t.Errorf("rival's permit under the new limit: %+v", e)
	}
	mustRelease(t, ps[3])
	mustRelease(t, rp)
	evs = rec.until(t, 8)
	if a, r, l := balance(t, evs, "shrink"); a != 4 || r != 4 || l != 0 {
		t.Errorf("%d acquired, %d released, %d lost; want 4, 4, 0", a, r, l)
	}
	if a, r, l := balance(t, rivalRec.until(t, 3), "shrink"); a != 1 || r != 1 || l != 0 {
		t.Errorf("rival: %d acquired, %d released, %d lost; want 1, 1, 0", a, r, l)
	}
	if slots, _ := slotLocks(t, dsn, sem); len(slots) != 0 {
		t.Errorf("pg_locks shows slots %v after every release", slots)
	}
}

// breakLeaveDSN, in the environment, makes
// TestSemaphoreCloseRacingQueueLeave run its reproduction on that
// database, in a child process.
const breakLeaveDSN = "PGCOORD_BREAK_LEAVE_DSN"

// Close racing with Acquires that leave a semaphore's queue: the queue
// key's Unlock can take the key off its backend's records, then find the
// backend closed and fail with ErrClosed. Acquire must then return
// ErrClosed, as it promises when the Client closes, on a Client without
// WithLogger too (a nil logger once made the process panic there). The
// race runs in a child process, so that a panic fails this test instead
// of killing every test of the package; it repeats for at most 8 s.
func TestSemaphoreCloseRacingQueueLeave(t *testing.T) {
	if dsn := os.Getenv(breakLeaveDSN); dsn != "" {
		closeRacingQueue(t, dsn)
		return
	}
	dsn, _ := semaphoreDB(t)
	ctx := testCtx(t)
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^"+t.Name()+"$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), breakLeaveDSN+"="+dsn)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Errorf("Close racing with queued Acquires, Client without WithLogger: the child process failed (%v):\n%s", err, out)
	}
}

// closeRacingQueue closes Clients while goroutines acquire and release
// permits of two small semaphores, with waits in their queues, and
// expects every Acquire to return a permit or ErrClosed, and no slot or
// queue place held on the server afterwards.
func closeRacingQueue(t *testing.T, dsn string) {
	deadline := time.Now().Add(8 * time.Second)
	for round := 0; round < 300 && time.Now().Before(deadline); round++ {
		ctx := testCtx(t)
		c, err := New(pgtest.Pool(t, dsn), WithSharedBackends(2), WithHooks(Hooks{OnPermit: func(PermitEvent) {}}))
		if err != nil {
			t.Fatal(err)
		}
		sems := []*Semaphore{c.Semaphore("queue-a", 2), c.Semaphore("queue-b", 3)}
		var progress atomic.Int64
		var wg sync.WaitGroup
		for w := range 6 {
			wg.Go(func() {
				sem := sems[w%len(sems)]
				for i := range 200 {
					acquire := sem.Acquire
					if i%3 == 0 {
						acquire = sem.TryAcquire
					}
					p, err := acquire(ctx)
					switch {
					case errors.Is(err, ErrClosed):
						return
					case errors.Is(err, ErrNoPermit):
						continue
					case err != nil:
						t.Errorf("round %d: acquire: %v", round, err)
						return
					}
					progress.Add(1)
					_ = p.Release(ctx)
				}
			})
		}
		pgtest.Eventually(t, testTimeout, "some permits to go round", func() bool { return progress.Load() >= 5 })
		if err := c.Close(context.Background()); err != nil {
			t.Errorf("round %d: Close: %v", round, err)
		}
		wg.Wait()
		for _, sem := range sems {
			if slots, queued := slotLocks(t, dsn, sem); len(slots) != 0 || queued {
				t.Errorf("round %d: %s: after Close, pg_locks shows slots %v (queue used: %v)", round, sem.Name(), slots, queued)
			}
		}
	}
}
