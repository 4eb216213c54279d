package pgcoord

import (
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// A term and a fence whose commits wait for the synchronous standby while
// their backend is terminated (pg_terminate_backend: PostgreSQL ends the
// wait with a 57P01 warning, the commit made on the primary only, and
// closes the connection): Campaign and Lock(WithFence) ride through the
// lost backend, take the key again on another, and hand out, once the
// standby receives WAL again, a token greater than every one the primary
// issued meanwhile, which the promoted standby holds.
func TestTokensWithheldWhenBackendTerminatedInCommitWait(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	primary, standby, pdsn, sdsn := migratedWithSyncStandby(t)

	opts := []Option{WithHeartbeat(100 * time.Millisecond), WithLossDeadline(time.Second)}
	cE, cF := newTestClient(t, pdsn, opts...), newTestClient(t, pdsn, opts...)
	e := cE.Election("terminated-term")
	kF := HashKey("durable", "terminated", "fence")
	ld0, err := e.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t0 := ld0.Term()
	if err := ld0.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	l0, err := cF.Lock(ctx, kF, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	f0 := l0.Fence()
	mustUnlock(t, l0)

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
	fenced := goLock(func() (*Lock, error) { return cF.Lock(ctx, kF, WithFence()) })
	early := func() {
		t.Helper()
		select {
		case w := <-campaign:
			t.Fatalf("Campaign returned (%v) while the synchronous standby received no WAL", w.err)
		case r := <-fenced:
			t.Fatalf("Lock(WithFence) returned (fence %d, %v) while the synchronous standby received no WAL", fenceOf(r.l), r.err)
		default:
		}
	}
	// Terminate each token's backend while its commit waits for the
	// standby, twice each.
	terminated := map[string]int{}
	if !pgtest.Poll(testTimeout, func() bool {
		early()
		for what, like := range map[string]string{"term": "%leaders%", "fence": "%fences%"} {
			if terminated[what] >= 2 {
				continue
			}
			var n int
			err := pconn.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
				WHERE wait_event = 'SyncRep' AND datname = current_database() AND query LIKE $1
				AND ($1 <> '%fences%' OR query NOT LIKE '%leaders%')`, like).Scan(&n)
			if err == nil {
				terminated[what] += n
			}
		}
		return terminated["term"] >= 2 && terminated["fence"] >= 2
	}) {
		t.Fatalf("terminated %v backends in SyncRep, want 2 each", terminated)
	}
	// The calls go on: each issues its token again on a new backend.
	if !pgtest.Poll(testTimeout, func() bool {
		early()
		return primary.WaitEvents(t, "SyncRep") >= 2
	}) {
		t.Fatal("after the terminations, the term's and the fence's commits did not wait for the standby again")
	}
	early()
	termUpTo, fenceUpTo := storedFence(t, ctx, pconn, e.Key()), storedFence(t, ctx, pconn, kF)
	t.Logf("terminated %v; the primary issued terms up to %d (before %d), fences up to %d (before %d); the standby holds %d, %d",
		terminated, termUpTo, t0, fenceUpTo, f0, storedFence(t, ctx, sconn, e.Key()), storedFence(t, ctx, sconn, kF))
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
	r := receive(t, fenced)
	if r.err != nil {
		t.Fatalf("Lock(WithFence) after the standby resumed: %v", r.err)
	}
	if int64(ld.Term()) <= termUpTo || int64(r.l.Fence()) <= fenceUpTo {
		t.Fatalf("handed out term %d and fence %d, want above %d and %d: every token the terminated backends committed", ld.Term(), r.l.Fence(), termUpTo, fenceUpTo)
	}
	heldOnlyBy(t, pdsn, e.Key(), ld.lock.S.PID())
	heldOnlyBy(t, pdsn, kF, r.l.core.S.PID())

	failOver(t, ctx, primary, standby, cE, cF)
	if got := storedFence(t, ctx, sconn, e.Key()); Term(got) < ld.Term() {
		t.Fatalf("term %d was handed out, but the promoted standby holds %d", ld.Term(), got)
	}
	if got := storedFence(t, ctx, sconn, kF); Term(got) < r.l.Fence() {
		t.Fatalf("fence %d was handed out, but the promoted standby holds %d", r.l.Fence(), got)
	}
	err = pgx.BeginFunc(ctx, pgtest.Pool(t, sdsn), func(tx pgx.Tx) error { return CheckFence(ctx, tx, kF, r.l.Fence()) })
	if err != nil {
		t.Fatalf("CheckFence on the promoted standby with the handed-out fence %d: %v, want nil", r.l.Fence(), err)
	}
	err = pgx.BeginFunc(ctx, pgtest.Pool(t, sdsn), func(tx pgx.Tx) error { return CheckFence(ctx, tx, kF, r.l.Fence()-1) })
	if !errors.Is(err, ErrStaleFence) {
		t.Fatalf("CheckFence on the promoted standby with fence %d: %v, want ErrStaleFence", r.l.Fence()-1, err)
	}
}
