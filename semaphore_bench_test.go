package pgcoord

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// BenchmarkSemaphoreHandoff measures handing a permit to a waiter in
// another process: two Clients pass the one permit of a semaphore with
// limit 1 back and forth, as BenchmarkHandoffRemote does with a lock:
//
//  1. Client A holds the permit.
//  2. Untimed: B calls Acquire in a goroutine, and the benchmark waits
//     until B heads the queue (pg_locks shows the queue key granted),
//     waits for a notification with nothing left to read, and its backend
//     sleeps waiting for slot 0 (see Semaphore.await), as
//     BenchmarkHandoffRemote waits for the lock's waiter to sleep.
//  3. Timed: A calls Release, and the benchmark waits for B's Acquire to
//     return: the release grants slot 0 to B's waiting statement, which
//     takes the permit and leaves the queue.
//  4. B is now the holder and A the waiter; go to 2.
//
// ns/op is the time of step 3. waiter-p50-us and waiter-p90-us are the
// median and 90th percentile of the time from the start of Release to the
// waiter's Acquire returning. Run it in the same process as the lock's
// handoff and its raw floor, so the figures compare:
//
//	go test -run '^$' -bench 'SemaphoreHandoff|Handoff' -benchtime 200x .
func BenchmarkSemaphoreHandoff(b *testing.B) {
	dsn, _ := semaphoreDB(b)
	clients := [2]*Client{newTestClient(b, dsn), newTestClient(b, dsn)}
	sems := [2]*Semaphore{clients[0].Semaphore("handoff", 1), clients[1].Semaphore("handoff", 1)}
	ctx, cancel := context.WithCancel(context.Background())
	var waiter sync.WaitGroup
	defer func() {
		cancel() // only a failure leaves a waiter blocked
		waiter.Wait()
	}()
	// Warm both sides: backends, the listener, the queue path.
	var held [2]*Permit
	for side := range 2 {
		p, err := sems[side].Acquire(ctx)
		if err != nil {
			b.Fatal(err)
		}
		ch := goAcquire(ctx, sems[1-side])
		awaitHead(b, dsn, sems[1-side])
		if err := p.Release(ctx); err != nil {
			b.Fatal(err)
		}
		r := receivePermit(b, ch)
		if r.err != nil {
			b.Fatal(r.err)
		}
		if err := r.p.Release(ctx); err != nil {
			b.Fatal(err)
		}
	}
	p, err := sems[0].Acquire(ctx)
	if err != nil {
		b.Fatal(err)
	}
	held[0] = p
	obs := pgtest.Conn(b, dsn)

	holder, waited := pingPong(b, ctx, &waiter,
		func(ctx context.Context, side int) error {
			p, err := sems[side].Acquire(ctx)
			held[side] = p
			return err
		},
		func(ctx context.Context, side int) error { return held[side].Release(ctx) },
		func(side int) {
			awaitBlockedHead(b, dsn, sems[side])
			awaitWaiter(b, obs, keyOf(sems[side].slotKey(0)), true)
		})
	b.ReportMetric(float64(waited[len(waited)/2].Nanoseconds())/1e3, "waiter-p50-us")
	b.ReportMetric(float64(waited[len(waited)*9/10].Nanoseconds())/1e3, "waiter-p90-us")
	if err := held[holder].Release(ctx); err != nil {
		b.Fatal(err)
	}
}

// awaitBlockedHead returns once an Acquire of sem heads the queue and
// waits for a notification, with nothing queued for it to read. It polls every
// 50 µs, bounded by testTimeout.
func awaitBlockedHead(b *testing.B, dsn string, sem *Semaphore) {
	b.Helper()
	awaitHead(b, dsn, sem)
	c := sem.c
	deadline := time.Now().Add(testTimeout)
	for {
		idle := false
		if c.listening.Load() {
			c.notifier.mu.Lock()
			for sub := range c.notifier.subs {
				sub.mu.Lock()
				idle = sub.prefix == sem.payload && len(sub.queue) == 0 && len(sub.kick) == 0
				sub.mu.Unlock()
			}
			c.notifier.mu.Unlock()
		}
		if idle {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("no Acquire of %q blocked at the head of the queue within %v", sem.name, testTimeout)
		}
		time.Sleep(50 * time.Microsecond) // untimed; leaves the CPU to the waiter
	}
}

// BenchmarkSemaphoreHandoffClients measures the semaphore's handoff in the
// protocol of BenchmarkHandoffClients, as a user's harness would run it:
// two Clients of one process, each with its own pool, pass the one permit
// of a semaphore with limit 1 back and forth, the one that just acquired
// becoming the next holder:
//
//  1. Client A holds the permit.
//  2. Untimed: B calls Acquire in a goroutine, and the benchmark gives it
//     20 ms to queue. Unlike BenchmarkSemaphoreHandoff it does not look
//     inside B for the state of its wait.
//  3. Timed: A calls Release, and the benchmark waits for B's Acquire to
//     return.
//  4. B is now the holder and A the waiter; go to 2.
//
// waiter-p50-us and waiter-p90-us are the median and 90th percentile of the
// time from the start of the holder's Release to the waiter's Acquire
// returning; release-p50-us is the median of the holder's Release call
// alone, to compare with unlock-p50-us of BenchmarkHandoffClients. Fix the
// count:
//
//	go test -run '^$' -bench 'SemaphoreHandoffClients|HandoffClients' -benchtime=200x .
func BenchmarkSemaphoreHandoffClients(b *testing.B) {
	dsn, _ := semaphoreDB(b)
	clients := [2]*Client{newTestClient(b, dsn), newTestClient(b, dsn)}
	sems := [2]*Semaphore{clients[0].Semaphore("handoff", 1), clients[1].Semaphore("handoff", 1)}
	ctx, cancel := context.WithCancel(context.Background())
	var waiter sync.WaitGroup
	defer func() {
		cancel() // only a failure leaves a waiter blocked
		waiter.Wait()
	}()
	bounded := func(ctx context.Context, f func(context.Context) error) error {
		ctx, cancel := context.WithTimeout(ctx, testTimeout)
		defer cancel()
		return f(ctx)
	}
	var held [2]*Permit
	acquire := func(ctx context.Context, side int) error {
		return bounded(ctx, func(ctx context.Context) error {
			p, err := sems[side].Acquire(ctx)
			held[side] = p
			return err
		})
	}
	release := func(ctx context.Context, side int) error {
		return bounded(ctx, held[side].Release)
	}
	// Warm each side once, uncontended, as BenchmarkHandoffClients does.
	for side := range 2 {
		if err := acquire(ctx, side); err != nil {
			b.Fatal(err)
		}
		if err := release(ctx, side); err != nil {
			b.Fatal(err)
		}
	}
	if err := acquire(ctx, 0); err != nil {
		b.Fatal(err)
	}
	var gave []time.Duration
	holder, waited := pingPong(b, ctx, &waiter, acquire,
		func(ctx context.Context, side int) error {
			start := time.Now()
			err := release(ctx, side)
			gave = append(gave, time.Since(start))
			return err
		},
		func(int) { time.Sleep(20 * time.Millisecond) }) // the protocol's queueing time, untimed
	slices.Sort(gave)
	b.ReportMetric(quantileMS(waited, 0.5)*1e3, "waiter-p50-us")
	b.ReportMetric(quantileMS(waited, 0.9)*1e3, "waiter-p90-us")
	b.ReportMetric(quantileMS(gave, 0.5)*1e3, "release-p50-us")
	if err := release(ctx, holder); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkLockHandoffClientsIdle is the lock's handoff in the protocol of
// BenchmarkSemaphoreHandoffClients, its comparison: two Clients of one
// process pass Int64Key(42) back and forth, the waiter given 20 ms to
// queue (with no look at the server) before the holder's Unlock.
// waiter-p50-us is the median from the start of the Unlock to the
// waiter's Lock returning, unlock-p50-us the median of the Unlock call.
// The idle 20 ms before each Unlock is part of what it measures:
// BenchmarkHandoffClients, which polls pg_locks up to the Unlock, is not
// the figure to compare BenchmarkSemaphoreHandoffClients with.
func BenchmarkLockHandoffClientsIdle(b *testing.B) {
	dsn := pgtest.DB(b)
	k := Int64Key(42)
	clients := [2]*Client{newTestClient(b, dsn), newTestClient(b, dsn)}
	ctx, cancel := context.WithCancel(context.Background())
	var waiter sync.WaitGroup
	defer func() {
		cancel() // only a failure leaves a waiter blocked
		waiter.Wait()
	}()
	bounded := func(ctx context.Context, f func(context.Context) error) error {
		ctx, cancel := context.WithTimeout(ctx, testTimeout)
		defer cancel()
		return f(ctx)
	}
	var held [2]*Lock
	lock := func(ctx context.Context, side int) error {
		return bounded(ctx, func(ctx context.Context) error {
			l, err := clients[side].Lock(ctx, k)
			held[side] = l
			return err
		})
	}
	unlock := func(ctx context.Context, side int) error { return bounded(ctx, held[side].Unlock) }
	for side := range 2 {
		if err := lock(ctx, side); err != nil {
			b.Fatal(err)
		}
		if err := unlock(ctx, side); err != nil {
			b.Fatal(err)
		}
	}
	if err := lock(ctx, 0); err != nil {
		b.Fatal(err)
	}
	var gave []time.Duration
	holder, waited := pingPong(b, ctx, &waiter, lock,
		func(ctx context.Context, side int) error {
			start := time.Now()
			err := unlock(ctx, side)
			gave = append(gave, time.Since(start))
			return err
		},
		func(int) { time.Sleep(20 * time.Millisecond) }) // the protocol's queueing time, untimed
	slices.Sort(gave)
	b.ReportMetric(quantileMS(waited, 0.5)*1e3, "waiter-p50-us")
	b.ReportMetric(quantileMS(waited, 0.9)*1e3, "waiter-p90-us")
	b.ReportMetric(quantileMS(gave, 0.5)*1e3, "unlock-p50-us")
	if err := unlock(ctx, holder); err != nil {
		b.Fatal(err)
	}
	notHeld(b, dsn, k)
}
