package pgcoord

import (
	"testing"

	"github.com/jackc/pgx/v5"
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
	if r.p.Slot() != 0 || r.p.l.s.PID() != pid {
		t.Fatalf("permit: slot %d on backend %d, want slot 0 on the backend that waited, %d", r.p.Slot(), r.p.l.s.PID(), pid)
	}
	heldOnlyBy(t, dsn, waiter.slotKey(0), pid)
	notHeld(t, dsn, waiter.queueKey())
	var rowPID int32
	if err := pool.QueryRow(ctx, "SELECT pid FROM pgcoord.semaphore_holders WHERE name = $1 AND slot = 0", "await").Scan(&rowPID); err != nil {
		t.Fatal(err)
	}
	if rowPID != pid {
		t.Fatalf("semaphore_holders: slot 0 held by %d, want %d", rowPID, pid)
	}
	mustRelease(t, r.p)
	notHeld(t, dsn, waiter.slotKey(0))
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
	if len(slots) != 2 || slots[0] != hp.l.s.PID() || slots[r.p.Slot()] != r.p.l.s.PID() || queued {
		t.Fatalf("pg_locks: slots %v (queue used: %v), want slot 0 held by %d and the waiter's slot %d by %d", slots, queued, hp.l.s.PID(), r.p.Slot(), r.p.l.s.PID())
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
	if slots, _ := slotLocks(t, dsn, waiter); len(slots) != 1 || slots[other.Slot()] != other.l.s.PID() {
		t.Fatalf("pg_locks after the release of slot 0: slots %v, want only slot %d, held by %d", slots, other.Slot(), other.l.s.PID())
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
	if slots, _ := slotLocks(t, dsn, waiter); len(slots) != 1 || slots[r.p.Slot()] != r.p.l.s.PID() {
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
		if slots, _ := slotLocks(t, dsn, waiter); len(slots) != 1 || slots[0] != r.p.l.s.PID() {
			t.Fatalf("pg_locks: slots %v, want slot 0 held by the waiter's backend %d", slots, r.p.l.s.PID())
		}
		mustRelease(t, r.p)
	}
}
