package pgcoord

import (
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// A lock whose backend ended before the Client noticed: what Unlock, Err
// and a handoff of it report.

// A lock whose backend was terminated, unnoticed, before its Unlock: the
// Unlock's release fails, and Unlock returns an error wrapping
// ErrLockLost. The lock's Err must then say the same (it was lost), not
// ErrNotHeld (released by Unlock), for a lock of the Client's backends
// and of a Session; the key is free in pg_locks.
func TestUnlockOnEndedBackendErrSaysLost(t *testing.T) {
	t.Parallel()
	clientAndSession(t, func(t *testing.T, name string, onSession bool) {
		ctx := testCtx(t)
		dsn := pgtest.DB(t)
		// A heartbeat that does not notice the termination first.
		c := newTestClient(t, dsn, WithHeartbeat(5*time.Second), WithLossDeadline(20*time.Second))
		lock := c.Lock
		if onSession {
			lock = newTestSession(t, c).Lock
		}
		k := HashKey("lockcore", "unlock-ended", name)
		l, err := lock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		pid := l.core.S.PID()
		pgtest.Terminate(t, dsn, pid)
		admin := pgtest.Conn(t, dsn)
		backendGoneFrom(t, admin, pid)
		uerr := l.Unlock(ctx)
		if !errors.Is(uerr, ErrLockLost) {
			t.Fatalf("Unlock after the backend %d ended: %v, want ErrLockLost", pid, uerr)
		}
		awaitEnd(t, l, "after Unlock")
		if err := l.Err(); !errors.Is(err, ErrLockLost) {
			t.Fatalf("Unlock returned %v, and the lock's Err is %v: want ErrLockLost, as the lock was lost before its Unlock", uerr, err)
		}
		notHeld(t, dsn, k)
	})
}

// A lock handed over in the process (WithHandoff, no fence, so no round
// trip) from a backend that was terminated just before, unnoticed: the
// Unlock hands it on, a contender of another Client gets the key on the
// server, and the handed-over lock must report ErrLockLost within 2H of
// the termination (its Done closes), on a Client's backend and on a
// Session; its Unlock then says so, and pg_locks shows only the contender.
func TestUnfencedHandoffFromTerminatedBackendReportsLoss(t *testing.T) {
	t.Parallel()
	clientAndSession(t, func(t *testing.T, name string, onSession bool) {
		ctx := testCtx(t)
		dsn := pgtest.DB(t)
		const beat = 300 * time.Millisecond
		c := newTestClient(t, dsn, WithHandoff(8, time.Second), WithHeartbeat(beat), WithLossDeadline(4*beat))
		lock := c.Lock
		if onSession {
			lock = newTestSession(t, c).Lock
		}
		contender := newTestClient(t, dsn)
		admin := pgtest.Conn(t, dsn)
		// The handover happens only if the Unlock comes before the
		// Client's heartbeat notices the termination: the termination
		// comes right after a heartbeat was answered, and an attempt
		// that lost the race anyway (a loaded machine) is made again
		// on a fresh key.
		var (
			k          Key
			pid        int32
			terminated time.Time
			uerr       error
			cl         *Lock
			r          result
		)
		for attempt := 0; ; attempt++ {
			if attempt == 5 {
				t.Fatalf("in %d attempts, the Client noticed the termination before A's Unlock every time: no handover to check", attempt)
			}
			k = HashKey("lockcore", "handoff-terminated", name, strconv.Itoa(attempt))
			a, err := lock(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			bch := goLock(func() (*Lock, error) { return lock(ctx, k) })
			pgtest.Eventually(t, testTimeout, "B queued at the key's gate", func() bool { return gateWaiters(c, k) == 1 })
			pid = a.core.S.PID()
			answered := a.core.S.AnsweredAt()
			pgtest.Eventually(t, testTimeout, "a heartbeat answered", func() bool { return a.core.S.AnsweredAt().After(answered) })
			pgtest.Terminate(t, dsn, pid)
			terminated = time.Now()
			backendGoneFrom(t, admin, pid)
			if cl, err = contender.TryLock(ctx, k); err != nil {
				t.Fatalf("the contender's TryLock after backend %d ended: %v", pid, err)
			}
			uerr = a.Unlock(ctx)
			select {
			case r = <-bch:
			case <-time.After(2 * time.Second):
				// Not handed over: B waits for the contender.
				mustUnlock(t, cl)
				if r = receive(t, bch); r.err == nil {
					mustUnlock(t, r.l)
				}
				t.Logf("attempt %d: A's Unlock: %v; the lock was not handed over", attempt, uerr)
				continue
			}
			break
		}
		if r.err != nil {
			t.Fatalf("A's Unlock %v; B's Lock %v", uerr, r.err)
		}
		b := r.l
		t.Logf("A's Unlock: %v; B on backend %d (A's was %d)", uerr, b.core.S.PID(), pid)
		bound := 2 * beat
		select {
		case <-b.Done():
		case <-time.After(time.Until(terminated.Add(bound + 2*time.Second))):
			t.Fatalf("B's lock, handed over from terminated backend %d while the contender holds the key, still live after %v (bound 2H = %v)", pid, time.Since(terminated), bound)
		}
		if d := time.Since(terminated); d > bound+time.Second {
			t.Errorf("B's lock reported its loss %v after the termination, want within 2H = %v (and a second's slack)", d, bound)
		}
		if !errors.Is(b.Err(), ErrLockLost) {
			t.Fatalf("B's Err: %v, want ErrLockLost", b.Err())
		}
		if err := b.Unlock(ctx); !errors.Is(err, ErrLockLost) {
			t.Fatalf("B's Unlock: %v, want ErrLockLost", err)
		}
		heldOnlyBy(t, dsn, k, cl.core.S.PID())
		mustUnlock(t, cl)
		notHeld(t, dsn, k)
	})
}
