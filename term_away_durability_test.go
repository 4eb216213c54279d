package pgcoord

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// A term recorded away from the election lock's backend (a transaction
// that checked the previous term keeps its fences row share-locked, so the
// record waits for it on a backend of the Client's that holds nothing)
// while the synchronous standby receives no WAL: once the transaction ends,
// the away record's term is withheld slice after slice and Campaign waits;
// once the standby receives WAL again Campaign leads with a term above
// every withheld one, which the promoted standby's fences and leaders rows
// hold.
func TestTermRecordedAwayWaitsForSynchronousStandby(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	primary, standby, pdsn, sdsn := migratedWithSyncStandby(t)

	c := newTestClient(t, pdsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
	e := c.Election("durable-away")
	ld0, err := e.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t0 := ld0.Term()
	if err := ld0.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	checker := pgtest.Conn(t, pdsn)
	tx, err := checker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := CheckFence(ctx, tx, e.Key(), t0); err != nil {
		t.Fatal(err)
	}
	pconn, sconn := pgtest.Conn(t, pdsn), pgtest.Conn(t, sdsn)
	resume := primary.PauseWALSenders(t)
	type won struct {
		ld  *Leadership
		err error
	}
	campaign := make(chan won, 1)
	go func() {
		ld, err := e.Campaign(ctx)
		campaign <- won{ld, err}
	}()
	early := func() {
		t.Helper()
		select {
		case w := <-campaign:
			var term Term
			if w.ld != nil {
				term = w.ld.Term()
			}
			t.Fatalf("Campaign returned (term %d, %v) while the synchronous standby received no WAL; the standby holds %d",
				term, w.err, storedFence(t, ctx, sconn, e.Key()))
		default:
		}
	}
	// The record waits for the transaction on a backend that does not
	// hold the election's lock.
	space, key := core.FenceRow(e.Key().coreKey())
	if !pgtest.Poll(testTimeout, func() bool {
		early()
		var n int
		err := pconn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%leaders%'
			AND pid NOT IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted
				AND objsubid = $1 AND ((classid::int8 << 32) | objid::int8) = $2)`, space, key).Scan(&n)
		return err == nil && n > 0
	}) {
		t.Fatal("the term's record never waited for the CheckFence transaction away from the election lock's backend")
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	stalled := time.Now()
	if !pgtest.Poll(testTimeout, func() bool {
		early()
		return storedFence(t, ctx, pconn, e.Key()) >= int64(t0)+3 && time.Since(stalled) > 1500*time.Millisecond
	}) {
		t.Fatalf("the primary's term stayed at %d (before %d): the away record was not issued again slice after slice", storedFence(t, ctx, pconn, e.Key()), t0)
	}
	withheldUpTo := storedFence(t, ctx, pconn, e.Key())
	resume()
	var ld *Leadership
	select {
	case w := <-campaign:
		if w.err != nil {
			t.Fatalf("Campaign after the standby resumed: %v", w.err)
		}
		ld = w.ld
	case <-ctx.Done():
		t.Fatal("Campaign did not return after the standby resumed")
	}
	if int64(ld.Term()) <= withheldUpTo {
		t.Fatalf("term %d handed out, want above every withheld one (up to %d)", ld.Term(), withheldUpTo)
	}
	heldOnlyBy(t, pdsn, e.Key(), ld.lock.S.PID())
	t.Logf("term %d before, withheld up to %d, handed out %d", t0, withheldUpTo, ld.Term())
	failOver(t, ctx, primary, standby, c)
	if got := storedFence(t, ctx, sconn, e.Key()); Term(got) < ld.Term() {
		t.Fatalf("term %d was handed out, but the promoted standby's fences row holds %d", ld.Term(), got)
	}
	var recorded int64
	if err := sconn.QueryRow(ctx, "SELECT term FROM pgcoord.leaders WHERE name = $1", e.Name()).Scan(&recorded); err != nil {
		t.Fatal(err)
	}
	if Term(recorded) != ld.Term() {
		t.Fatalf("the promoted standby's leaders row holds term %d, want the handed-out %d", recorded, ld.Term())
	}
}

// A Campaign whose ctx ends while its term's commit waits for the stalled
// synchronous standby returns ctx's error and leads nowhere: its term is
// withheld, the election's lock is free again (pg_locks); once the standby
// receives WAL again, the next Campaign leads with a term above every one
// the primary issued meanwhile.
func TestCampaignCtxEndsWhileTermWaitsForSynchronousStandby(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	primary, standby, pdsn, sdsn := migratedWithSyncStandby(t)

	c := newTestClient(t, pdsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
	e := c.Election("durable-ctx")
	ld0, err := e.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t0 := ld0.Term()
	if err := ld0.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	pconn := pgtest.Conn(t, pdsn)
	resume := primary.PauseWALSenders(t)
	short, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	ld, err := e.Campaign(short)
	if err == nil {
		t.Fatalf("Campaign led with term %d while the synchronous standby received no WAL", ld.Term())
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Campaign whose ctx ended while its term waited for the standby: %v, want context.DeadlineExceeded", err)
	}
	withheldUpTo := storedFence(t, ctx, pconn, e.Key())
	if withheldUpTo < int64(t0)+2 {
		t.Fatalf("the primary's term is %d (before %d): the term was not issued and withheld slice after slice", withheldUpTo, t0)
	}
	pgtest.Eventually(t, testTimeout, "the election's lock is free after the Campaign gave up", func() bool {
		return len(lockState(t, pdsn)[e.Key()]) == 0
	})
	t.Logf("Campaign with a 2 s ctx: %v; terms up to %d withheld (before %d)", err, withheldUpTo, t0)
	resume()
	ld, err = e.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if int64(ld.Term()) <= withheldUpTo {
		t.Fatalf("term %d after the standby resumed, want above every withheld one (up to %d)", ld.Term(), withheldUpTo)
	}
	failOver(t, ctx, primary, standby, c)
	if got := storedFence(t, ctx, pgtest.Conn(t, sdsn), e.Key()); Term(got) < ld.Term() {
		t.Fatalf("term %d was handed out, but the promoted standby holds %d", ld.Term(), got)
	}
}
