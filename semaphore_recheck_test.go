package pgcoord

import (
	"errors"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// A permit freed by the death of its holder's backend sends no
// notification: the head of the queue of a semaphore of limit 2 or more
// (which cannot wait for one slot on the server) learns of it by its
// re-check, every semaphoreRecheck, however long it has waited already.
// Here the head has waited for several re-check intervals when a holder's
// backend is terminated; the holders' Clients have a heartbeat of 10 s,
// so nothing of theirs reaches the head meanwhile. The head must get the
// permit within the documented bound (250 ms + a round trip; 1 s here),
// read back from pg_locks.
func TestSemaphoreHeadGetsPermitOfDeadHolderAfterLongWait(t *testing.T) {
	for _, limit := range []int{2, 3} {
		t.Run(map[int]string{2: "limit2", 3: "limit3"}[limit], func(t *testing.T) {
			ctx := testCtx(t)
			dsn, _ := semaphoreDB(t)
			quiet := []Option{WithHeartbeat(10 * time.Second), WithLossDeadline(30 * time.Second)}
			var held []*Permit
			for i := 0; i < limit; i++ {
				s := newTestClient(t, dsn, quiet...).Semaphore("recheck", limit)
				held = append(held, mustAcquire(t, s, true))
			}
			head := newTestClient(t, dsn).Semaphore("recheck", limit, WithIdentity("head"))
			waiter := goAcquire(ctx, head)
			awaitHead(t, dsn, head)

			// Let the head wait for four re-check intervals, checking all
			// along that it still heads the queue and got nothing.
			waitedFrom := time.Now()
			long := 4 * head.c.semaphoreRecheck
			if !pgtest.Poll(testTimeout, func() bool {
				if len(grantedTo(t, dsn, keyOf(head.queueKey()))) != 1 {
					t.Fatal("the head left the queue while every permit was held")
				}
				return time.Since(waitedFrom) > long
			}) {
				t.Fatal("the wait did not last")
			}
			select {
			case r := <-waiter:
				t.Fatalf("the head returned while every permit was held: %v, %v", r.p, r.err)
			default:
			}

			victim := held[limit-1]
			pgtest.Terminate(t, dsn, victim.l.S.Pid)
			gone := time.Now()
			r := receivePermit(t, waiter)
			if r.err != nil {
				t.Fatal(r.err)
			}
			if d := time.Since(gone); d > time.Second {
				t.Errorf("the head, after waiting %v, got the permit %v after a holder's backend ended, want within 1 s (re-check every %v)",
					long, d, head.c.semaphoreRecheck)
			}
			slots := awaitSettled(t, dsn, head)
			if len(slots) != limit {
				t.Errorf("pg_locks: slots held %v, want %d", slots, limit)
			}
			found := false
			for _, pid := range slots {
				found = found || pid == r.p.l.S.Pid
			}
			if !found {
				t.Errorf("pg_locks: slots held %v, none by the head's backend %d", slots, r.p.l.S.Pid)
			}
			mustRelease(t, r.p)
			for _, p := range held[:limit-1] {
				mustRelease(t, p)
			}
			if err := victim.Release(ctx); !errors.Is(err, ErrLockLost) {
				t.Errorf("Release of the dead holder's permit = %v, want ErrLockLost", err)
			}
		})
	}
}
