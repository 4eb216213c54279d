package pgcoord

// Tests of the head of a semaphore's queue waiting on the server for slot 0
// (Semaphore.await): it gets the permit as it is released or its holder
// dies, follows limit changes, leaves nothing behind when its ctx ends, its
// backend is lost or its Client closes, holds nothing but the queue key
// while it waits, and works in another schema under strict isolation.
// pg_locks never shows more permits granted than the limit.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// slotWaiters returns the backends that wait for a slot of sem in
// pg_locks, by slot.
func slotWaiters(t testing.TB, dsn string, sem *Semaphore) map[int][]int32 {
	t.Helper()
	out := map[int][]int32{}
	for k, hs := range lockState(t, dsn) {
		v, ok := k.Int64()
		if !ok || v>>16 != sem.prefix || v&queueSlot == queueSlot {
			continue
		}
		for _, h := range hs {
			if !h.granted {
				out[int(v&queueSlot)] = append(out[int(v&queueSlot)], h.pid)
			}
		}
	}
	return out
}

// The head of a semaphore of limit 1 waits on the server for slot 0, on
// the backend that holds the queue key, and the release grants it: its
// Acquire returns the permit on that backend, its row is written, and the
// queue key is free.
func TestSemaphoreHeadWaitsForSlot(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	holder := newTestClient(t, dsn).Semaphore("await", 1)
	waiter := newTestClient(t, dsn).Semaphore("await", 1)
	hp := mustAcquire(t, holder, true)
	ch := goAcquire(ctx, waiter)
	awaitHead(t, dsn, waiter)
	var pid int32
	pgtest.Eventually(t, testTimeout, "the head to wait for slot 0", func() bool {
		w := slotWaiters(t, dsn, waiter)
		if len(w[0]) == 1 {
			pid = w[0][0]
		}
		return pid != 0
	})
	mustRelease(t, hp)
	r := receivePermit(t, ch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.p.Slot() != 0 || r.p.l.S.PID() != pid {
		t.Fatalf("permit: slot %d on backend %d, want slot 0 on the backend that waited, %d", r.p.Slot(), r.p.l.S.PID(), pid)
	}
	heldOnlyBy(t, dsn, keyOf(waiter.slotKey(0)), pid)
	notHeld(t, dsn, keyOf(waiter.queueKey()))
	var rowPID int32
	if err := pool.QueryRow(ctx, "SELECT pid FROM pgcoord.semaphore_holders WHERE name = $1 AND slot = 0", "await").Scan(&rowPID); err != nil {
		t.Fatal(err)
	}
	if rowPID != pid {
		t.Fatalf("semaphore_holders: slot 0 held by %d, want %d", rowPID, pid)
	}
	mustRelease(t, r.p)
	notHeld(t, dsn, keyOf(waiter.slotKey(0)))
	if err := pool.QueryRow(ctx, "SELECT pid FROM pgcoord.semaphore_holders WHERE name = $1", "await").Scan(&rowPID); err != pgx.ErrNoRows {
		t.Fatalf("semaphore_holders after the release: %v, want no row", err)
	}
}

// awaitSlotWaiter returns the backend that waits for slot 0 of sem, once
// one does.
func awaitSlotWaiter(t *testing.T, dsn string, sem *Semaphore) int32 {
	t.Helper()
	var pid int32
	pgtest.Eventually(t, testTimeout, "the head to wait for slot 0", func() bool {
		if w := slotWaiters(t, dsn, sem); len(w[0]) == 1 {
			pid = w[0][0]
		}
		return pid != 0
	})
	return pid
}

// Raising the limit of a semaphore of limit 1 ends its head's wait for
// slot 0: the head takes the new slot while slot 0 stays held.
func TestSemaphoreHeadWaitEndsWhenLimitRises(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	holder := newTestClient(t, dsn).Semaphore("rise", 1)
	waiter := newTestClient(t, dsn).Semaphore("rise", 1)
	hp := mustAcquire(t, holder, true)
	ch := goAcquire(ctx, waiter)
	awaitSlotWaiter(t, dsn, waiter)
	if err := holder.SetLimit(ctx, 2); err != nil {
		t.Fatal(err)
	}
	r := receivePermit(t, ch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	slots, queued := slotLocks(t, dsn, waiter)
	if len(slots) != 2 || slots[0] != hp.l.S.PID() || slots[r.p.Slot()] != r.p.l.S.PID() || queued {
		t.Fatalf("pg_locks: slots %v (queue used: %v), want slot 0 held by %d and the waiter's slot %d by %d", slots, queued, hp.l.S.PID(), r.p.Slot(), r.p.l.S.PID())
	}
	if len(slotWaiters(t, dsn, waiter)) != 0 {
		t.Fatal("a backend still waits for a slot")
	}
	mustRelease(t, r.p)
	mustRelease(t, hp)
}

// A limit lowered to 1 while two permits are held: the head does not wait
// for slot 0 while another slot is granted (slot 0 may be free while the
// semaphore is full, and taking it even for a moment would show two
// permits in pg_locks); when the holder of slot 0 releases, the head still
// holds nothing, and it gets a permit only once the other permit is
// released too.
func TestSemaphoreHeadWaitRespectsLoweredLimit(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	holders := newTestClient(t, dsn).Semaphore("lowered", 2)
	waiter := newTestClient(t, dsn).Semaphore("lowered", 2)
	first := mustAcquire(t, holders, true)
	second := mustAcquire(t, holders, true)
	if err := holders.SetLimit(ctx, 1); err != nil {
		t.Fatal(err)
	}
	ch := goAcquire(ctx, waiter)
	awaitHead(t, dsn, waiter)
	zero, other := first, second
	if second.Slot() == 0 {
		zero, other = second, first
	}
	if w := slotWaiters(t, dsn, waiter); len(w) != 0 {
		t.Fatalf("pg_locks: backends %v wait for slots while slot %d is granted past the lowered limit", w, other.Slot())
	}
	mustRelease(t, zero)
	if slots, _ := slotLocks(t, dsn, waiter); len(slots) != 1 || slots[other.Slot()] != other.l.S.PID() {
		t.Fatalf("pg_locks after the release of slot 0: slots %v, want only slot %d, held by %d", slots, other.Slot(), other.l.S.PID())
	}
	select {
	case r := <-ch:
		t.Fatalf("Acquire returned (%v) while the other permit holds the lowered limit", r.err)
	default:
	}
	mustRelease(t, other)
	r := receivePermit(t, ch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if slots, _ := slotLocks(t, dsn, waiter); len(slots) != 1 || slots[r.p.Slot()] != r.p.l.S.PID() {
		t.Fatalf("pg_locks: slots %v, want only the waiter's", slots)
	}
	mustRelease(t, r.p)
}

// On a schema whose migrations stop before semaphore_await, the head of a
// semaphore of limit 1 is woken by notification, as before it.
func TestSemaphoreHeadWithoutAwaitFunction(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	if err := migrateDown(ctx, pool, 5); err != nil {
		t.Fatal(err)
	}
	holder := newTestClient(t, dsn).Semaphore("old", 1)
	wc := newTestClient(t, dsn)
	waiter := wc.Semaphore("old", 1)
	for range 2 {
		hp := mustAcquire(t, holder, true)
		ch := goAcquire(ctx, waiter)
		awaitHead(t, dsn, waiter)
		pgtest.Eventually(t, testTimeout, "the head to find no semaphore_await", wc.noAwait.Load)
		if w := slotWaiters(t, dsn, waiter); len(w) != 0 {
			t.Fatalf("backends %v wait for slots without semaphore_await", w)
		}
		mustRelease(t, hp)
		r := receivePermit(t, ch)
		if r.err != nil {
			t.Fatal(r.err)
		}
		if slots, _ := slotLocks(t, dsn, waiter); len(slots) != 1 || slots[0] != r.p.l.S.PID() {
			t.Fatalf("pg_locks: slots %v, want slot 0 held by the waiter's backend %d", slots, r.p.l.S.PID())
		}
		mustRelease(t, r.p)
	}
}

// Promise (Client.Semaphore, TryAcquire): while the head of a semaphore of
// limit 1 waits for slot 0, a TryAcquire from another Client gets
// ErrNoPermit, also at the moment the holder releases; the release passes
// the permit to the head. pg_locks never shows more than one slot granted.
func TestSemaphoreHeadWaitTryAcquireFromOtherClient(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	const name = "await-try"
	watch := watchPermits(t, dsn, semaphoreTarget{name, 1})
	holder := newTestClient(t, dsn).Semaphore(name, 1)
	head := newTestClient(t, dsn).Semaphore(name, 1)
	trier := newTestClient(t, dsn).Semaphore(name, 1)
	for round := range 4 {
		hp := mustAcquire(t, holder, true)
		if round == 0 {
			watch.awaitLimit(t)
		}
		ch := goAcquire(ctx, head)
		pid := awaitSlotWaiter(t, dsn, head)
		// A TryAcquire hammers the semaphore while the release happens.
		var (
			stop    atomic.Bool
			granted atomic.Int32
			tries   atomic.Int32
			wg      sync.WaitGroup
			tryErr  error
		)
		wg.Go(func() {
			for i := 0; i < 10_000 && !stop.Load(); i++ {
				p, err := trier.TryAcquire(ctx)
				tries.Add(1)
				switch {
				case err == nil:
					granted.Add(1)
					_ = p.Release(context.Background())
				case !errors.Is(err, ErrNoPermit):
					tryErr = err
					return
				}
			}
		})
		pgtest.Eventually(t, testTimeout, "a few TryAcquires to run", func() bool { return tries.Load() >= 3 })
		mustRelease(t, hp)
		r := receivePermit(t, ch)
		stop.Store(true)
		wg.Wait()
		if tryErr != nil {
			t.Fatalf("round %d: TryAcquire: %v", round, tryErr)
		}
		if r.err != nil {
			t.Fatalf("round %d: the head's Acquire: %v", round, r.err)
		}
		if n := granted.Load(); n != 0 {
			t.Fatalf("round %d: TryAcquire from another Client took %d permits while the head waited for slot 0 (or as the permit passed to it)", round, n)
		}
		if r.p.l.S.PID() != pid {
			t.Logf("round %d: permit on backend %d, the wait was on %d", round, r.p.l.S.PID(), pid)
		}
		slots, queued := slotLocks(t, dsn, head)
		if len(slots) != 1 || slots[r.p.Slot()] != r.p.l.S.PID() || queued {
			t.Fatalf("round %d: pg_locks: slots %v (queue used: %v), want only the head's slot %d on %d", round, slots, queued, r.p.Slot(), r.p.l.S.PID())
		}
		if _, err := trier.TryAcquire(ctx); !errors.Is(err, ErrNoPermit) {
			t.Fatalf("round %d: TryAcquire while the head holds the permit = %v, want ErrNoPermit", round, err)
		}
		mustRelease(t, r.p)
		if n := holderRows(t, pool, name); n != 0 {
			t.Fatalf("round %d: %d holder rows after every release", round, n)
		}
	}
	watch.finish(t)
}

// Promise (backends.go, RELIABILITY): the head's backend holds nothing but
// the queue key while it waits for slot 0, whatever the other goroutines of
// its Client do; they get no spurious ErrDeadlock, and their blocking
// waits still work (with WithMaxWaits(1), the head's wait takes the only
// wait: the others must poll, never deadlock). Read from pg_locks while
// other goroutines of the head's Client take and release many keys.
func TestSemaphoreHeadBackendHoldsOnlyQueueKey(t *testing.T) {
	t.Parallel()
	for _, waits := range []int{1, DefaultMaxWaits} {
		t.Run(fmt.Sprintf("maxwaits=%d", waits), func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			dsn, _ := semaphoreDB(t)
			name := fmt.Sprintf("await-only-%d", waits)
			other := newTestClient(t, dsn)
			hc := newTestClient(t, dsn, WithMaxWaits(waits))
			holder := other.Semaphore(name, 1)
			head := hc.Semaphore(name, 1)
			hp := mustAcquire(t, holder, true)
			ch := goAcquire(ctx, head)
			pid := awaitSlotWaiter(t, dsn, head)

			// A key that the other Client holds: hc's blocking Lock of it
			// must wait (or poll) and get it once it is free.
			contended := Int64Key(7400)
			ho, err := other.Lock(ctx, contended)
			if err != nil {
				t.Fatal(err)
			}
			blocked := goLock(func() (*Lock, error) { return hc.Lock(ctx, contended) })

			var wg sync.WaitGroup
			errs := make(chan error, 64)
			var stop atomic.Bool
			for g := range 6 {
				wg.Go(func() {
					for i := 0; i < 200 && !stop.Load(); i++ {
						k := Int64Key(int64(100_000 + g*1000 + i))
						l, err := hc.TryLock(ctx, k)
						if err != nil {
							errs <- fmt.Errorf("TryLock %v: %w", k, err)
							return
						}
						if err := l.Unlock(ctx); err != nil {
							errs <- fmt.Errorf("Unlock %v: %w", k, err)
							return
						}
					}
				})
			}
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			samples, notWaiting, foreign := 0, 0, []string(nil)
		sample:
			for samples < 2000 {
				// One snapshot of pg_locks: while the backend waits for
				// slot 0 in it, it may hold nothing but the queue key.
				state := lockState(t, dsn)
				waits := false
				for _, h := range state[keyOf(head.slotKey(0))] {
					waits = waits || h.pid == pid && !h.granted
				}
				if !waits {
					notWaiting++
				}
				var mine []string
				for k, hs := range state {
					for _, h := range hs {
						if h.pid == pid && h.granted && k.coreKey() != head.queueKey() {
							mine = append(mine, k.String())
						}
					}
				}
				if waits && len(mine) > 0 {
					foreign = append(foreign, fmt.Sprintf("%v", mine))
				}
				samples++
				select {
				case <-done:
					break sample
				default:
				}
			}
			stop.Store(true)
			<-done
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			t.Logf("%d snapshots of pg_locks, %d without the head's wait for slot 0", samples, notWaiting)
			if len(foreign) > 0 {
				t.Fatalf("pg_locks: in %d of %d snapshots the head's backend %d waits for slot 0 and holds other keys too, e.g. %v", len(foreign), samples, pid, foreign[0])
			}
			stillWaiting(t, blocked)
			mustUnlock(t, ho)
			r := receive(t, blocked)
			if r.err != nil {
				t.Fatalf("blocking Lock of a key freed while the head waits: %v", r.err)
			}
			heldOnlyBy(t, dsn, contended, r.l.core.S.PID())
			mustUnlock(t, r.l)
			select {
			case pr := <-ch:
				t.Fatalf("the head's Acquire returned (%v, %v) while the permit is held", pr.p, pr.err)
			default:
			}
			mustRelease(t, hp)
			pr := receivePermit(t, ch)
			if pr.err != nil {
				t.Fatal(pr.err)
			}
			slots, queued := slotLocks(t, dsn, head)
			if len(slots) != 1 || slots[0] != pr.p.l.S.PID() || queued {
				t.Fatalf("pg_locks: slots %v (queue used: %v), want slot 0 held by the head's %d", slots, queued, pr.p.l.S.PID())
			}
			mustRelease(t, pr.p)
			notHeld(t, dsn, keyOf(head.slotKey(0)))
			notHeld(t, dsn, contended)
		})
	}
}

// Promise (Acquire): "If Acquire returns an error it holds nothing: no
// permit, row or queue place stays behind", and a permit it returns is
// held. The head's ctx is cancelled at the moment the holder releases
// slot 0 (before, after, at once), so the server may grant the head's wait
// as its statement is cancelled. pg_locks and semaphore_holders are read
// after each round, and pg_locks never shows two slots.
func TestSemaphoreHeadWaitCancelledAsPermitPasses(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	const name = "await-cancel"
	watch := watchPermits(t, dsn, semaphoreTarget{name, 1})
	holder := newTestClient(t, dsn).Semaphore(name, 1)
	head := newTestClient(t, dsn).Semaphore(name, 1)
	granted, failed := 0, 0
	for round := range 12 {
		hp := mustAcquire(t, holder, true)
		if round == 0 {
			watch.awaitLimit(t)
		}
		wctx, cancel := context.WithCancel(ctx)
		ch := goAcquire(wctx, head)
		awaitSlotWaiter(t, dsn, head)
		released := make(chan error, 1)
		release := func() { released <- hp.Release(context.Background()) }
		switch round % 4 {
		case 0:
			cancel()
			release()
		case 1:
			release()
			cancel()
		case 2:
			go release()
			cancel()
		default:
			// The cancel ends the wait on the server before the release.
			cancel()
			pgtest.Eventually(t, testTimeout, "the cancelled head to stop waiting for slot 0", func() bool {
				return len(slotWaiters(t, dsn, head)) == 0
			})
			release()
		}
		r := receivePermit(t, ch)
		cancel()
		if r.err == nil {
			granted++
			slots, _ := slotLocks(t, dsn, head)
			if len(slots) != 1 || slots[r.p.Slot()] != r.p.l.S.PID() {
				t.Fatalf("round %d: Acquire returned a permit on slot %d (%d); pg_locks: slots %v", round, r.p.Slot(), r.p.l.S.PID(), slots)
			}
			mustRelease(t, r.p)
		} else {
			failed++
			if !errors.Is(r.err, context.Canceled) {
				t.Fatalf("round %d: Acquire = %v, want a permit or context.Canceled", round, r.err)
			}
		}
		// Whatever it returned, nothing else stays: no slot, queue place
		// or row.
		if err := <-released; err != nil {
			t.Fatalf("round %d: the holder's Release: %v", round, err)
		}
		slots, queued := slotLocks(t, dsn, head)
		if len(slots) != 0 || queued {
			t.Fatalf("round %d (Acquire: %v): pg_locks: slots %v, queue used %v; want nothing held", round, r.err, slots, queued)
		}
		if n := holderRows(t, pool, name); n != 0 {
			t.Fatalf("round %d (Acquire: %v): %d rows in semaphore_holders, want none", round, r.err, n)
		}
	}
	t.Logf("%d rounds granted, %d cancelled", granted, failed)
	// The semaphore still works.
	p := mustAcquire(t, head, false)
	mustRelease(t, p)
	watch.finish(t)
}

// Promise (Acquire, Wake-up): a blocking Acquire rides through the loss of
// its backend and "lines up again if its place in the queue was lost with
// its connection"; the next in line then heads the queue; a waiter whose
// backend is terminated while it waits for slot 0 blocks nobody. Then
// every waiter gets the permit in turn, pg_locks never shows two slots,
// and nothing stays behind.
func TestSemaphoreHeadWaitBackendTerminated(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	const name = "await-term"
	watch := watchPermits(t, dsn, semaphoreTarget{name, 1})
	holder := newTestClient(t, dsn).Semaphore(name, 1)
	first := newTestClient(t, dsn).Semaphore(name, 1)
	second := newTestClient(t, dsn).Semaphore(name, 1)
	hp := mustAcquire(t, holder, true)
	watch.awaitLimit(t)
	ch1 := goAcquire(ctx, first)
	pid := awaitSlotWaiter(t, dsn, first)
	ch2 := goAcquire(ctx, second)
	pgtest.Eventually(t, testTimeout, "the second to line up", func() bool {
		return waitingOn(t, dsn, keyOf(first.queueKey())) == 1
	})
	pgtest.Terminate(t, dsn, pid)
	// Someone heads the queue again and waits for slot 0 on another
	// backend.
	pgtest.Eventually(t, testTimeout, "a new head to wait for slot 0", func() bool {
		w := slotWaiters(t, dsn, first)
		return len(w[0]) == 1 && w[0][0] != pid
	})
	mustRelease(t, hp)
	var got []permitResult
	for len(got) < 2 {
		select {
		case r := <-ch1:
			got = append(got, r)
		case r := <-ch2:
			got = append(got, r)
		case <-time.After(testTimeout):
			t.Fatalf("after the release, %d of 2 Acquires returned", len(got))
		}
		r := got[len(got)-1]
		if r.err != nil {
			t.Fatalf("Acquire %d: %v", len(got), r.err)
		}
		slots, _ := slotLocks(t, dsn, first)
		if len(slots) != 1 || slots[0] != r.p.l.S.PID() {
			t.Fatalf("pg_locks: slots %v, want slot 0 held by %d only", slots, r.p.l.S.PID())
		}
		mustRelease(t, r.p)
	}
	awaitSettled(t, dsn, first)
	if slots, queued := slotLocks(t, dsn, first); len(slots) != 0 || queued {
		t.Fatalf("pg_locks at the end: slots %v, queue %v", slots, queued)
	}
	if n := holderRows(t, pool, name); n != 0 {
		t.Fatalf("%d holder rows at the end", n)
	}
	watch.finish(t)
}

// Promise (Wake-up): the release of a permit grants slot 0 to the head's
// wait; so does the death of its holder. The holder's backend is
// terminated while the head waits: the head gets slot 0 and its row
// replaces the dead holder's.
func TestSemaphoreHeadWaitHolderTerminated(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	const name = "await-dead-holder"
	holder := newTestClient(t, dsn).Semaphore(name, 1)
	head := newTestClient(t, dsn).Semaphore(name, 1)
	hp := mustAcquire(t, holder, true)
	ch := goAcquire(ctx, head)
	awaitSlotWaiter(t, dsn, head)
	pgtest.Terminate(t, dsn, hp.l.S.PID())
	r := receivePermit(t, ch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	heldOnlyBy(t, dsn, keyOf(head.slotKey(0)), r.p.l.S.PID())
	var rowPID int32
	if err := pool.QueryRow(ctx, "SELECT pid FROM pgcoord.semaphore_holders WHERE name = $1 AND slot = 0", name).Scan(&rowPID); err != nil {
		t.Fatal(err)
	}
	if rowPID != r.p.l.S.PID() || holderRows(t, pool, name) != 1 {
		t.Fatalf("semaphore_holders: slot 0 by %d (%d rows), want one row, by %d", rowPID, holderRows(t, pool, name), r.p.l.S.PID())
	}
	awaitLossOf(t, hp)
	mustRelease(t, r.p)
	notHeld(t, dsn, keyOf(head.slotKey(0)))
	notHeld(t, dsn, keyOf(head.queueKey()))
}

// awaitLossOf waits until p reports its loss.
func awaitLossOf(t testing.TB, p *Permit) {
	t.Helper()
	select {
	case <-p.Done():
	case <-time.After(testTimeout):
		t.Fatal("the permit whose backend was terminated did not end")
	}
	if !errors.Is(p.Err(), ErrLockLost) {
		t.Fatalf("permit Err = %v, want ErrLockLost", p.Err())
	}
}

// Promise (Client.Close): Close makes waiting acquires return ErrClosed,
// releases everything, and "returns within the loss deadline whatever the
// pool and the server do". The head's Client closes while the head waits
// for slot 0, in all rounds but the first as the holder releases it.
// Promise (Acquire): "If Acquire returns an error it holds nothing: no
// permit, row or queue place stays behind". Whatever the Acquire returned,
// nothing of the closed Client stays in pg_locks or semaphore_holders, and
// the permit goes to a later acquirer.
func TestSemaphoreHeadWaitClientClosed(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	const name = "await-close"
	holder := newTestClient(t, dsn).Semaphore(name, 1)
	for round := range 11 {
		app := fmt.Sprintf("await-close-%d", round)
		c, err := New(pgtest.Pool(t, dsn), WithApplicationName(app))
		if err != nil {
			t.Fatal(err)
		}
		head := c.Semaphore(name, 1)
		hp := mustAcquire(t, holder, true)
		ch := goAcquire(ctx, head)
		awaitSlotWaiter(t, dsn, head)
		released := make(chan error, 1)
		race := round > 0 // the holder releases as the Client closes
		if race {
			go func() { released <- hp.Release(context.Background()) }()
		}
		start := time.Now()
		err = c.Close(context.Background())
		took := time.Since(start)
		if err != nil {
			t.Errorf("round %d: Close: %v", round, err)
		}
		if took > DefaultLossDeadline {
			t.Errorf("round %d: Close took %v, want within the loss deadline %v", round, took, DefaultLossDeadline)
		}
		r := receivePermit(t, ch)
		if r.err == nil {
			// Granted just before Close: Close ends the permit.
			<-r.p.Done()
			if !errors.Is(r.p.Err(), ErrClosed) {
				t.Fatalf("round %d: permit after Close: %v", round, r.p.Err())
			}
		} else if !errors.Is(r.err, ErrClosed) {
			t.Fatalf("round %d: the waiting Acquire after Close = %v, want ErrClosed", round, r.err)
		}
		if race {
			if err := <-released; err != nil {
				t.Fatalf("round %d: Release: %v", round, err)
			}
		} else {
			mustRelease(t, hp)
		}
		// The backends exit as soon as they see their sockets closed.
		pgtest.Eventually(t, testTimeout, "the closed Client's connections to go", func() bool {
			return appConnections(t, pool, app) == 0
		})
		slots, queued := slotLocks(t, dsn, head)
		if len(slots) != 0 || queued {
			t.Fatalf("round %d: pg_locks after Close and release: slots %v, queue %v", round, slots, queued)
		}
		if n := holderRows(t, pool, name); n != 0 {
			var slot, rowPID int32
			var identity string
			var alive bool
			if err := pool.QueryRow(ctx, `SELECT h.slot, h.pid, h.identity, EXISTS (SELECT FROM pg_stat_activity a WHERE a.pid = h.pid)
				FROM pgcoord.semaphore_holders h WHERE h.name = $1 LIMIT 1`, name).Scan(&slot, &rowPID, &identity, &alive); err != nil {
				t.Fatal(err)
			}
			t.Fatalf("round %d (Acquire: %v; the holder's backend %d; the release ran during Close: %v): %d holder rows left: slot %d, pid %d (backend alive: %v), identity %q",
				round, r.err, hp.l.S.PID(), race, n, slot, rowPID, alive, identity)
		}
	}
	p := mustAcquire(t, holder, true)
	mustRelease(t, p)
}

// Promise (Client.Semaphore, settings): the head's wait for slot 0 works in
// a second schema (WithSchema) under a database default of REPEATABLE READ
// with short timeouts, and for one Client a role whose defaults are
// SERIALIZABLE and shorter timeouts still; a release passes
// the permit to the waiting head, Release returns nil, and the rows are
// the schema's. Permits ping-pong between two Clients.
func TestSemaphoreHeadWaitOtherSchemaRepeatableRead(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	admin := pgtest.Conn(t, dsn)
	if _, err := admin.Exec(ctx, `DO $$ BEGIN
		EXECUTE format('ALTER DATABASE %I SET default_transaction_isolation = %L', current_database(), 'repeatable read');
		EXECUTE format('ALTER DATABASE %I SET lock_timeout = %L', current_database(), '200ms');
		EXECUTE format('ALTER DATABASE %I SET statement_timeout = %L', current_database(), '2s');
		EXECUTE format('ALTER DATABASE %I SET idle_in_transaction_session_timeout = %L', current_database(), '1s');
		END $$`); err != nil {
		t.Fatal(err)
	}
	pool := pgtest.Pool(t, dsn)
	const schema = "await_other"
	if err := Migrate(ctx, pool, WithSchema(schema)); err != nil {
		t.Fatal(err)
	}
	// The default schema exists too, with the same name of semaphore: it
	// is another semaphore.
	if err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	// One Client logs in as a role whose own defaults are stricter still.
	role, roleDSN := newTestRole(t, dsn, "await_rr")
	if _, err := admin.Exec(ctx, fmt.Sprintf(`GRANT USAGE ON SCHEMA %[2]s TO %[1]s;
		GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA %[2]s TO %[1]s;
		ALTER ROLE %[1]s SET default_transaction_isolation = 'serializable';
		ALTER ROLE %[1]s SET lock_timeout = '100ms';
		ALTER ROLE %[1]s SET statement_timeout = '1s'`, role, schema)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// The role's privileges go first, so that the role can be dropped.
		if _, err := admin.Exec(context.Background(), "DROP OWNED BY "+role); err != nil {
			t.Errorf("drop the role's privileges: %v", err)
		}
	})
	const name = "await-rr"
	a := newTestClient(t, roleDSN, WithSchema(schema)).Semaphore(name, 1)
	b := newTestClient(t, dsn, WithSchema(schema)).Semaphore(name, 1)
	elsewhere := newTestClient(t, dsn).Semaphore(name, 1)
	ep := mustAcquire(t, elsewhere, true) // the default schema's: no effect here
	holderIn := func(pid int32) {
		t.Helper()
		var got int32
		if err := pool.QueryRow(ctx, `SELECT pid FROM "await_other".semaphore_holders WHERE name = $1 AND slot = 0`, name).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != pid {
			t.Fatalf("%s.semaphore_holders: slot 0 by %d, want %d", schema, got, pid)
		}
	}
	held := mustAcquire(t, a, true)
	waiter := b
	for round := range 6 {
		ch := goAcquire(ctx, waiter)
		awaitSlotWaiter(t, dsn, waiter)
		if err := held.Release(ctx); err != nil {
			t.Fatalf("round %d: Release while the head waits for slot 0: %v", round, err)
		}
		r := receivePermit(t, ch)
		if r.err != nil {
			t.Fatalf("round %d: Acquire: %v", round, r.err)
		}
		slots, queued := slotLocks(t, dsn, waiter)
		if len(slots) != 1 || slots[0] != r.p.l.S.PID() || queued {
			t.Fatalf("round %d: pg_locks: slots %v (queue %v), want slot 0 by %d", round, slots, queued, r.p.l.S.PID())
		}
		holderIn(r.p.l.S.PID())
		held = r.p
		if waiter == a {
			waiter = b
		} else {
			waiter = a
		}
	}
	mustRelease(t, held)
	heldOnlyBy(t, dsn, keyOf(elsewhere.slotKey(0)), ep.l.S.PID())
	mustRelease(t, ep)
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM "await_other".semaphore_holders`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("%d rows left in %s.semaphore_holders", n, schema)
	}
}

// Promise (Client.Semaphore, Holders, the semaphores table): at most limit
// permits are held at once, and pg_locks shows the permits (a slot granted
// in pg_locks is a permit: Holders lists every one). The limit is lowered
// from 2 to 1 while one permit, on slot 1, is held, so the semaphore is
// full and the head of the queue must wait. pg_locks is read back to back
// for a few seconds (as a monitor or Holders would, while the server holds
// some thousands of other advisory locks): it may never show two slots of
// this semaphore of limit 1 granted at once.
func TestSemaphoreHeadWaitLoweredLimitShowsOnePermit(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	const name = "await-lowered"
	// Other locks of the database, as any busy server has.
	other := pgtest.Conn(t, dsn)
	if _, err := other.Exec(ctx, "SELECT count(pg_catalog.pg_advisory_lock(i)) FROM generate_series(1, 2000) i"); err != nil {
		t.Fatal(err)
	}
	holders := newTestClient(t, dsn).Semaphore(name, 2)
	head := newTestClient(t, dsn).Semaphore(name, 2)
	p0 := mustAcquire(t, holders, true)
	p1 := mustAcquire(t, holders, true)
	if p0.Slot() != 0 {
		p0, p1 = p1, p0
	}
	mustRelease(t, p0) // only slot 1 is held
	if err := holders.SetLimit(ctx, 1); err != nil {
		t.Fatal(err)
	}
	ch := goAcquire(ctx, head)
	awaitHead(t, dsn, head)

	monitor := pgtest.Conn(t, dsn)
	const sql = `SELECT coalesce(array_agg((k & 65535)::int4 ORDER BY k), '{}'), coalesce(array_agg(pid ORDER BY k), '{}')
		FROM (SELECT (classid::bigint << 32) | objid::bigint AS k, pid FROM pg_catalog.pg_locks
			WHERE locktype = 'advisory' AND objsubid = 1 AND granted
			  AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())) l
		WHERE k >> 16 = $1 AND k & 65535 <> 65535`
	var (
		slots []int32
		pids  []int32
		reads int
	)
	end := time.Now().Add(5 * time.Second)
	for time.Now().Before(end) {
		if err := monitor.QueryRow(ctx, sql, head.prefix).Scan(&slots, &pids); err != nil {
			t.Fatal(err)
		}
		reads++
		if len(slots) > 1 {
			break
		}
	}
	if len(slots) > 1 {
		t.Errorf("pg_locks: slots %v granted at once to backends %v, of a semaphore of limit 1 whose one permit is slot 1, held by %d (the head's queue key is on %v); read %d times",
			slots, pids, p1.l.S.PID(), grantedTo(t, dsn, keyOf(head.queueKey())), reads)
	} else {
		t.Logf("pg_locks read %d times: never more than one slot", reads)
	}
	select {
	case r := <-ch:
		t.Fatalf("Acquire returned (%v, %v) while the permit on slot 1 holds the lowered limit", r.p, r.err)
	default:
	}
	mustRelease(t, p1)
	r := receivePermit(t, ch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	got, _ := slotLocks(t, dsn, head)
	if len(got) != 1 || got[r.p.Slot()] != r.p.l.S.PID() {
		t.Fatalf("pg_locks: slots %v, want only the head's", got)
	}
	mustRelease(t, r.p)
}

// Promise (Client.Semaphore, SetLimit): at most limit permits are held at
// once, also while the limit changes during the head's wait for slot 0,
// and acquirers are served in line order. The limit of a full semaphore
// of limit 1 is raised to 2 at the moment its holder releases, with two
// Acquires lined up: both get a permit, on different slots, pg_locks never
// shows more than two slots, and nothing stays behind.
func TestSemaphoreHeadWaitLimitRaisedAsPermitPasses(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	const name = "await-raise"
	watch := watchSlots(t, dsn, semaphoreKey(DefaultSchema, name).V>>16)
	holder := newTestClient(t, dsn).Semaphore(name, 1)
	first := newTestClient(t, dsn).Semaphore(name, 1)
	second := newTestClient(t, dsn).Semaphore(name, 1)
	for round := range 6 {
		if err := holder.SetLimit(ctx, 1); err != nil {
			t.Fatal(err)
		}
		hp := mustAcquire(t, holder, true)
		ch1 := goAcquire(ctx, first)
		awaitSlotWaiter(t, dsn, first)
		ch2 := goAcquire(ctx, second)
		pgtest.Eventually(t, testTimeout, "the second to line up", func() bool {
			return waitingOn(t, dsn, keyOf(first.queueKey())) == 1
		})
		released := make(chan error, 1)
		if round%2 == 0 {
			go func() { released <- hp.Release(context.Background()) }()
			if err := holder.SetLimit(ctx, 2); err != nil {
				t.Fatal(err)
			}
		} else {
			go func() {
				if err := holder.SetLimit(context.Background(), 2); err != nil {
					t.Error(err)
				}
			}()
			released <- hp.Release(context.Background())
		}
		if err := <-released; err != nil {
			t.Fatalf("round %d: Release: %v", round, err)
		}
		r1, r2 := receivePermit(t, ch1), receivePermit(t, ch2)
		if r1.err != nil || r2.err != nil {
			t.Fatalf("round %d: Acquires: %v, %v", round, r1.err, r2.err)
		}
		slots, _ := slotLocks(t, dsn, first)
		if len(slots) != 2 || slots[r1.p.Slot()] != r1.p.l.S.PID() || slots[r2.p.Slot()] != r2.p.l.S.PID() {
			t.Fatalf("round %d: pg_locks: slots %v; want the two permits, slots %d and %d", round, slots, r1.p.Slot(), r2.p.Slot())
		}
		mustRelease(t, r1.p)
		mustRelease(t, r2.p)
		if slots := awaitSettled(t, dsn, first); len(slots) != 0 {
			t.Fatalf("round %d: pg_locks: slots %v after every release", round, slots)
		}
		if n := holderRows(t, pool, name); n != 0 {
			t.Fatalf("round %d: %d holder rows after every release", round, n)
		}
	}
	if most, reads := watch.stop(); most > 2 {
		t.Fatalf("pg_locks: %d slots granted at once in %d readings, want at most the raised limit 2", most, reads)
	} else {
		t.Logf("pg_locks read %d times: at most %d slots at once", reads, most)
	}
}

// A slotWatch reads, back to back on a connection of its own, how many
// slots of a semaphore pg_locks shows granted, and keeps the most.
type slotWatch struct {
	halt  chan struct{}
	done  chan struct{}
	most  int // read after done is closed
	reads int
}

// watchSlots starts watching the slots of the semaphore whose keys have
// the upper 48 bits prefix; stop ends the watch.
func watchSlots(t testing.TB, dsn string, prefix int64) *slotWatch {
	t.Helper()
	conn := pgtest.Conn(t, dsn)
	w := &slotWatch{halt: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		end := time.After(testTimeout)
		for {
			select {
			case <-w.halt:
				return
			case <-end:
				return
			default:
			}
			var n int
			err := conn.QueryRow(context.Background(), `SELECT count(*)::int FROM (SELECT (classid::bigint << 32) | objid::bigint AS k
				FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND granted
				  AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())) l
				WHERE k >> 16 = $1 AND k & 65535 <> 65535`, prefix).Scan(&n)
			if err != nil {
				return
			}
			w.reads++
			w.most = max(w.most, n)
		}
	}()
	return w
}

// stop ends the watch and returns the most slots it saw granted at once
// and how many times it read pg_locks.
func (w *slotWatch) stop() (most, reads int) {
	close(w.halt)
	<-w.done
	return w.most, w.reads
}

// Promise (Semaphore model): a holder's row is "deleted by the release (or,
// when the slot passes straight to the next holder, written over by that
// holder's grant)". Promise (Acquire): "If Acquire returns an error it
// holds nothing: no permit, row or queue place stays behind". The head of
// a limit-1 semaphore is granted slot 0 by the holder's Release while an
// outside transaction holds the semaphore's row, so the grant stops
// between the slot and the row: the Release has left its row to the grant
// (the table still shows it). Then the head's Acquire is cancelled, or its
// Client closed, and the grant fails: the head deletes the slot's rows,
// the releaser's included, while it holds the slot, and nothing stays in
// semaphore_holders or pg_locks. A round whose release finds the head
// looking at the row rather than waiting for the slot is run again.
func TestSemaphoreFailedGrantDeletesReleasersRow(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"cancelled", "closed"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			dsn, pool := semaphoreDB(t)
			holder := newTestClient(t, dsn).Semaphore("grant-fails-"+how, 1)
			for round := 0; ; round++ {
				if round == 5 {
					t.Fatal("in 5 rounds the release never found the head waiting for slot 0")
				}
				if failedGrantRound(t, ctx, dsn, pool, holder, how, round) {
					break
				}
			}
		})
	}
}

// failedGrantRound runs one round of
// TestSemaphoreFailedGrantDeletesReleasersRow, with a new Client for the
// head (whose backends have run nothing of the semaphore before), and
// reports whether the release found the head waiting for slot 0; if not,
// the head got its permit, and released it.
func failedGrantRound(t *testing.T, ctx context.Context, dsn string, pool *pgxpool.Pool, holder *Semaphore, how string, round int) bool {
	// A wait slice of a minute: the head's grant waits for the row for as
	// long as the test takes.
	app := fmt.Sprintf("grant-fails-%s-%d", how, round)
	c, err := New(pgtest.Pool(t, dsn), WithApplicationName(app), WithHeartbeat(5*time.Second), WithLossDeadline(2*time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close(context.Background()) }()
	c.semaphoreRecheck = time.Hour // no look at the row while the head waits for the slot
	head := c.Semaphore(holder.Name(), 1)
	hp := mustAcquire(t, holder, true)
	holderPID := hp.l.S.PID()
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch := goAcquire(wctx, head)
	headPID := awaitSlotWaiter(t, dsn, head)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, `SELECT FROM pgcoord.semaphores WHERE name = $1 FOR UPDATE`, head.Name()); err != nil {
		t.Fatal(err)
	}
	mustRelease(t, hp)
	var granted bool
	pgtest.Eventually(t, testTimeout, "the head to wait for the semaphore's row", func() bool {
		var query string
		err := pool.QueryRow(ctx, `SELECT query FROM pg_stat_activity
			WHERE pid = $1 AND wait_event_type = 'Lock' AND wait_event IN ('transactionid', 'tuple')`, headPID).Scan(&query)
		if errors.Is(err, pgx.ErrNoRows) {
			return false
		} else if err != nil {
			t.Fatal(err)
		}
		slots, _ := slotLocks(t, dsn, head)
		granted = slots[0] == headPID && strings.Contains(query, "semaphore_await")
		return true
	})
	if !granted {
		// The head was looking at the row when the slot came free: the
		// release freed the slot and notified.
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		r := receivePermit(t, ch)
		if r.err != nil {
			t.Fatalf("the head's Acquire after an ordinary release: %v", r.err)
		}
		mustRelease(t, r.p)
		return false
	}
	var rowPID int32
	if err := pool.QueryRow(ctx, `SELECT pid FROM pgcoord.semaphore_holders WHERE name = $1 AND slot = 0`, head.Name()).Scan(&rowPID); err != nil {
		t.Fatalf("slot 0's row while the head's grant waits: %v (want the releaser's, left for the grant to write over)", err)
	}
	if rowPID != holderPID {
		t.Fatalf("slot 0's row has pid %d while the head's grant waits, want the releaser's %d", rowPID, holderPID)
	}

	want := context.Canceled
	if how == "cancelled" {
		cancel()
	} else {
		want = ErrClosed
		if err := c.Close(ctx); err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
	if r := receivePermit(t, ch); !errors.Is(r.err, want) {
		t.Fatalf("the head's Acquire = (%v, %v), want %v", r.p, r.err, want)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if how == "closed" {
		pgtest.Eventually(t, testTimeout, "the closed Client's connections to go", func() bool {
			return appConnections(t, pool, app) == 0
		})
	}
	slots, queued := slotLocks(t, dsn, head)
	if len(slots) != 0 || queued {
		t.Fatalf("pg_locks after the failed grant: slots %v, queue %v; want nothing held", slots, queued)
	}
	if n := holderRows(t, pool, head.Name()); n != 0 {
		t.Fatalf("%d holder rows after the failed grant, want none (the releaser's row stayed)", n)
	}
	p := mustAcquire(t, holder, true)
	mustRelease(t, p)
	return true
}
