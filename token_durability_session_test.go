package pgcoord

import (
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// A fence asked for on a Session from NewSession (not a backend of the
// Client's) while the synchronous standby receives no WAL, with a cancel
// from outside (pg_cancel_backend, as an operator or a pooler's watchdog
// might send) landing on the fence's commit while it waits for the
// standby: the fence the cancelled commit made is withheld like one cut
// by the end of a slice, the call waits, the session answers every slice
// so its other lock is never lost, and once the standby receives WAL again
// the call returns a greater fence, which the promoted standby holds.
func TestSessionFenceWithheldWhenOutsideCancelEndsCommitWait(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	primary, standby, pdsn, sdsn := migratedWithSyncStandby(t)

	c := newTestClient(t, pdsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
	sess, err := c.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	kHeld, kF := HashKey("durable", "session", "held"), HashKey("durable", "session", "fenced")
	held, err := sess.Lock(ctx, kHeld)
	if err != nil {
		t.Fatal(err)
	}
	l0, err := sess.Lock(ctx, kF, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	f0 := l0.Fence()
	mustUnlock(t, l0)

	pconn, sconn := pgtest.Conn(t, pdsn), pgtest.Conn(t, sdsn)
	resume := primary.PauseWALSenders(t)
	fenced := goLock(func() (*Lock, error) { return sess.Lock(ctx, kF, WithFence()) })
	handedEarly := func(r result) {
		t.Helper()
		t.Fatalf("Session.Lock(WithFence) returned (fence %d, %v) while the synchronous standby received no WAL; the standby holds %d",
			fenceOf(r.l), r.err, storedFence(t, ctx, sconn, kF))
	}
	// Cancel the fence's commit from outside while it waits for the
	// standby (wait_event SyncRep on the session's backend).
	var cancelled int
	if !pgtest.Poll(testTimeout, func() bool {
		select {
		case r := <-fenced:
			handedEarly(r)
		default:
		}
		var ok bool
		err := pconn.QueryRow(ctx, `SELECT coalesce(bool_or(pg_cancel_backend(pid)), false) FROM pg_stat_activity
			WHERE pid = $1 AND wait_event = 'SyncRep'`, sess.PID()).Scan(&ok)
		if err == nil && ok {
			cancelled++
		}
		return cancelled >= 2
	}) {
		t.Fatalf("the session's fence never waited for the standby (SyncRep) to be cancelled; stored fence %d (before %d)", storedFence(t, ctx, pconn, kF), f0)
	}
	// Several slices go by, each issuing and withholding a fence: more
	// than the loss deadline in all.
	stalled := time.Now()
	if !pgtest.Poll(testTimeout, func() bool {
		select {
		case r := <-fenced:
			handedEarly(r)
		default:
		}
		return storedFence(t, ctx, pconn, kF) >= int64(f0)+5 && time.Since(stalled) > 1500*time.Millisecond
	}) {
		t.Fatalf("the primary's fence for the key stayed at %d (before %d): not issued again slice after slice", storedFence(t, ctx, pconn, kF), f0)
	}
	if err := sess.Err(); err != nil {
		t.Fatalf("the session was lost while its fence waited for the standby: %v", err)
	}
	if err := held.Err(); err != nil {
		t.Fatalf("the session's other lock was lost while its fence waited for the standby: %v", err)
	}
	heldOnlyBy(t, pdsn, kHeld, sess.PID())
	withheldUpTo := storedFence(t, ctx, pconn, kF)
	t.Logf("%d outside cancels; the primary issued fences %d..%d, all withheld; the standby holds %d",
		cancelled, f0+1, withheldUpTo, storedFence(t, ctx, sconn, kF))

	resume()
	r := receive(t, fenced)
	if r.err != nil {
		t.Fatalf("Session.Lock(WithFence) after the standby resumed: %v", r.err)
	}
	if int64(r.l.Fence()) <= withheldUpTo {
		t.Fatalf("fence %d handed out after the stall, want above every withheld one (up to %d)", r.l.Fence(), withheldUpTo)
	}
	if err := held.Err(); err != nil {
		t.Fatalf("the session's other lock was lost: %v", err)
	}

	failOver(t, ctx, primary, standby, c)
	if got := storedFence(t, ctx, sconn, kF); Term(got) < r.l.Fence() {
		t.Fatalf("fence %d was handed out, but the promoted standby holds only %d", r.l.Fence(), got)
	}
	err = pgx.BeginFunc(ctx, pgtest.Pool(t, sdsn), func(tx pgx.Tx) error { return CheckFence(ctx, tx, kF, Term(withheldUpTo)) })
	if !errors.Is(err, ErrStaleFence) {
		t.Fatalf("CheckFence on the promoted standby with withheld fence %d: %v, want ErrStaleFence", withheldUpTo, err)
	}
}
