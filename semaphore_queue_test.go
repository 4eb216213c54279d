package pgcoord

import (
	"context"
	"errors"
	"testing"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// TryAcquire does not jump the queue: with a permit just freed and the
// head of the queue about to take it, a TryAcquire that reaches the
// semaphore's row first is refused with ErrNoPermit (other acquires are
// waiting), and the head gets the permit. The order is made certain with
// the semaphore's row, which a transaction holds: the TryAcquire's grant
// waits for it first, then a release wakes the head, whose grant waits
// behind it (both read back from pg_locks); the head's periodic re-check
// is out of the way. pg_locks shows the freed slot granted to the head.
func TestSemaphoreTryAcquireDoesNotJumpTheQueue(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	const name = "line"
	a := mustAcquire(t, newTestClient(t, dsn).Semaphore(name, 2), true)
	b := mustAcquire(t, newTestClient(t, dsn).Semaphore(name, 2), true)
	hc := newTestClient(t, dsn)
	hc.semaphoreRecheck = testTimeout // only the release's notification wakes the head
	head := hc.Semaphore(name, 2, WithIdentity("head"))
	waiter := goAcquire(ctx, head)
	awaitHead(t, dsn, head)
	// The head's first look for a permit, right after it took the queue
	// key, is over: it waits for a notification.
	headPID := grantedTo(t, dsn, keyOf(head.queueKey()))[0]
	idle := pgtest.Conn(t, dsn)
	pgtest.Eventually(t, testTimeout, "the head's first look to end", func() bool {
		var done bool
		if err := idle.QueryRow(ctx, `SELECT state = 'idle' AND query LIKE '%semaphore_acquire%' FROM pg_stat_activity WHERE pid = $1`, headPID).Scan(&done); err != nil {
			t.Fatal(err)
		}
		return done
	})

	tx, err := pgtest.Conn(t, dsn).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, "SELECT 1 FROM pgcoord.semaphores WHERE name = $1 FOR UPDATE", name); err != nil {
		t.Fatal(err)
	}
	watch := pgtest.Conn(t, dsn)
	rowWaiters := func() int {
		var n int
		if err := watch.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE NOT l.granted AND l.locktype IN ('transactionid', 'tuple') AND a.datname = current_database() AND a.query LIKE '%semaphore_acquire%'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	newcomer := newTestClient(t, dsn).Semaphore(name, 2, WithIdentity("newcomer"))
	tried := make(chan permitResult, 1)
	go func() {
		p, err := newcomer.TryAcquire(ctx)
		tried <- permitResult{p, err}
	}()
	pgtest.Eventually(t, testTimeout, "the TryAcquire's grant to wait for the semaphore's row", func() bool { return rowWaiters() == 1 })
	mustRelease(t, a)
	pgtest.Eventually(t, testTimeout, "the head's grant to wait for the row behind it", func() bool { return rowWaiters() == 2 })
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	r := <-tried
	if r.err == nil {
		_ = r.p.Release(ctx)
		t.Fatal("TryAcquire took the freed permit while an Acquire headed the queue, want ErrNoPermit")
	}
	if !errors.Is(r.err, ErrNoPermit) {
		t.Fatalf("TryAcquire: %v, want ErrNoPermit", r.err)
	}
	got := receivePermit(t, waiter)
	if got.err != nil {
		t.Fatal(got.err)
	}
	slots := awaitSettled(t, dsn, head)
	if len(slots) != 2 || slots[got.p.Slot()] != got.p.l.S.Pid {
		t.Errorf("pg_locks: slots %v, want 2 held, slot %d by the head's backend %d", slots, got.p.Slot(), got.p.l.S.Pid)
	}
	mustRelease(t, got.p)
	mustRelease(t, b)
}
