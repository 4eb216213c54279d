package pgcoord

import (
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// A fenced lock handed over in the process (WithHandoff: Unlock passes the
// key to a goroutine of the same Client that waits for it, without the
// server) while the synchronous standby receives no WAL: the new holder's
// fence is a token statement like any other; it is withheld slice after
// slice, the acquire waits, the backend keeps its other lock, and once the
// standby receives WAL again the acquire returns a fence above every
// withheld one, which the promoted standby holds.
func TestHandedOverLockFenceWaitsForSynchronousStandby(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	primary, standby, pdsn, sdsn := migratedWithSyncStandby(t)

	c := newTestClient(t, pdsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second), WithHandoff(DefaultMaxHandoffs, time.Second))
	k, kOther := HashKey("durable", "handoff", "k"), HashKey("durable", "handoff", "other")
	first, err := c.Lock(ctx, k, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	f1 := first.Fence()
	// Another lock on the same backend, which must live through the stall.
	other, err := first.core.S.Lock(ctx, kOther.coreKey())
	if err != nil {
		t.Fatal(err)
	}
	next := goLock(func() (*Lock, error) { return c.Lock(ctx, k, WithFence()) })
	if !pgtest.Poll(testTimeout, func() bool { return gateWaiters(c, k) == 1 }) {
		t.Fatal("the second Lock never waited at the key's gate in the process")
	}
	pconn, sconn := pgtest.Conn(t, pdsn), pgtest.Conn(t, sdsn)
	resume := primary.PauseWALSenders(t)
	if err := first.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	stalled := time.Now()
	if !pgtest.Poll(testTimeout, func() bool {
		select {
		case r := <-next:
			t.Fatalf("the handed-over Lock returned (fence %d, %v) while the synchronous standby received no WAL; the standby holds %d",
				fenceOf(r.l), r.err, storedFence(t, ctx, sconn, k))
		default:
		}
		return storedFence(t, ctx, pconn, k) >= int64(f1)+3 && time.Since(stalled) > 1500*time.Millisecond
	}) {
		t.Fatalf("the primary's fence stayed at %d (before %d): the handed-over lock's fence was not issued again slice after slice", storedFence(t, ctx, pconn, k), f1)
	}
	if err := other.Err(); err != nil {
		t.Fatalf("the backend's other lock was lost while the handed-over fence waited for the standby: %v", err)
	}
	withheldUpTo := storedFence(t, ctx, pconn, k)
	resume()
	r := receive(t, next)
	if r.err != nil {
		t.Fatalf("the handed-over Lock after the standby resumed: %v", r.err)
	}
	if int64(r.l.Fence()) <= withheldUpTo {
		t.Fatalf("fence %d handed out, want above every withheld one (up to %d)", r.l.Fence(), withheldUpTo)
	}
	if r.l.core.S != first.core.S {
		t.Logf("the key was not handed over on the same backend (pid %d, then %d)", first.core.S.PID(), r.l.core.S.PID())
	}
	heldOnlyBy(t, pdsn, k, r.l.core.S.PID())
	heldOnlyBy(t, pdsn, kOther, other.S.PID())
	t.Logf("fence %d before, withheld up to %d, handed out %d", f1, withheldUpTo, r.l.Fence())
	failOver(t, ctx, primary, standby, c)
	if got := storedFence(t, ctx, sconn, k); Term(got) < r.l.Fence() {
		t.Fatalf("fence %d was handed out, but the promoted standby holds %d", r.l.Fence(), got)
	}
}
