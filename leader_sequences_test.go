package pgcoord

// Elections and semaphores under sequences of faults that come one after
// the other rather than at once, and under a campaign or a Close that ends
// during the wait a new leader owes its predecessor. Each test reads its
// outcome back from PostgreSQL (pg_locks, pg_stat_activity, the leaders
// row) or from the library's own clock.

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// queryStart returns pg_stat_activity.query_start of backend pid: when its
// last statement (for an idle session, its last heartbeat) began.
func queryStart(t testing.TB, pool *pgxpool.Pool, pid int32) time.Time {
	t.Helper()
	var at time.Time
	if err := pool.QueryRow(testCtx(t), "SELECT query_start FROM pg_stat_activity WHERE pid = $1", pid).Scan(&at); err != nil {
		t.Fatalf("query_start of backend %d: %v", pid, err)
	}
	return at
}

// guardSessionPID returns the backend pid of c's guard session, 0 if it
// has none.
func guardSessionPID(c *Client) int32 {
	c.guardMu.Lock()
	defer c.guardMu.Unlock()
	if c.guard == nil {
		return 0
	}
	return c.guard.PID()
}

// A live leader's guard connection is lost, and a second later (less than
// 2H: its heartbeat H is 4 s) its lock connection: the documented case in
// which a new leader cannot tell the old leader from a killed process. The
// new leader takes over at once; the old leader's context is cancelled
// within 2H of the first loss, as documented (the overlap is bounded by
// that), and the old term is stale: CheckFence refuses it.
func TestElectionBothConnectionsLostApartIsBounded(t *testing.T) {
	t.Parallel()
	const beat, loss = 4 * time.Second, 10 * time.Second
	const gap = time.Second
	ctx := testCtx(t)
	dsn := migratedDB(t)
	pool := pgtest.Pool(t, dsn)
	name := "guard-then-lock"
	key := electionKey(DefaultSchema, name)
	a := newTestClient(t, dsn, WithHeartbeat(beat), WithLossDeadline(loss))
	b := newTestClient(t, dsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
	old, err := a.Election(name).Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	next := goCampaign(ctx, b.Election(name))
	pgtest.Eventually(t, testTimeout, "the other candidate waits for the lock", func() bool {
		return waitingOn(t, dsn, key) >= 1
	})
	guard := old.guardLock()
	if guard == nil {
		t.Fatal("the first leader holds no guard")
	}
	guardPID, lockPID := guard.s.PID(), old.lock.s.PID()

	// Terminate the guard backend right after its heartbeat, so that the
	// old leader's next look at it is a heartbeat interval away.
	seen := queryStart(t, pool, guardPID)
	pgtest.Eventually(t, 3*beat, "the guard session's next heartbeat", func() bool {
		return queryStart(t, pool, guardPID).After(seen)
	})
	first := terminateBackend(t, pool, guardPID)
	// The second fault, a second after the first.
	second := time.NewTimer(gap)
	<-second.C
	if old.Context().Err() != nil {
		t.Fatalf("the old leader ended before its lock backend was terminated: %v", context.Cause(old.Context()))
	}
	terminated := terminateBackend(t, pool, lockPID)

	r := receiveCampaign(t, next, "takeover")
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.ld.Resign(context.Background())
	cancelled := awaitLeadershipEnd(t, old)
	if r.ld.Term() <= old.Term() {
		t.Fatalf("new term %d, old %d", r.ld.Term(), old.Term())
	}
	heldOnlyBy(t, dsn, key, r.ld.lock.s.PID())
	if d := cancelled.Sub(first); d > lossNoticeBound(&config{heartbeat: beat}) {
		t.Errorf("the old leader's context was cancelled %v after its guard connection was lost, want within 2H = %v", d.Round(time.Millisecond), 2*beat)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if err := CheckFence(ctx, tx, key, old.Term()); !errors.Is(err, ErrStaleFence) {
		t.Errorf("CheckFence with the old term %d: %v, want ErrStaleFence", old.Term(), err)
	}
	t.Logf("new leader %v after the lock connection was lost; old leader's context cancelled %v after the guard's (overlap %v)",
		r.at.Sub(terminated).Round(time.Millisecond), cancelled.Sub(first).Round(time.Millisecond), max(cancelled.Sub(r.at), 0).Round(time.Millisecond))
}

// A permit whose backend was terminated, released before its session has
// noticed: Release says the permit was lost (ErrLockLost), as documented.
// Permit.Err must then say so too ("an error wrapping ErrLockLost ... if
// the permit was lost"), not that it was released.
func TestSemaphoreLostPermitReleasedReportsLoss(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	c := newTestClient(t, dsn, WithHeartbeat(5*time.Second), WithLossDeadline(15*time.Second))
	s := c.Semaphore("lost-then-released", 1)
	p, err := s.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pid := p.l.s.PID()
	pgtest.Terminate(t, dsn, pid)
	// Whether or not the session has noticed the termination yet (with
	// H = 5 s it rarely has), Release and Err must both report the loss.
	rerr := p.Release(ctx)
	if !errors.Is(rerr, ErrLockLost) {
		t.Fatalf("Release of a permit whose backend was terminated = %v, want ErrLockLost", rerr)
	}
	select {
	case <-p.Done():
	default:
		t.Fatal("Done is not closed after Release returned")
	}
	if hs, err := s.Holders(ctx); err != nil || len(hs) != 0 {
		t.Fatalf("Holders = %+v, %v; want none", hs, err)
	}
	if err := p.Err(); !errors.Is(err, ErrLockLost) {
		t.Errorf("Permit.Err() = %v after its backend was terminated and Release returned %q; want an error wrapping ErrLockLost (the permit was lost, not released)", err, rerr)
	}
}

// guardlessHandover sets up a candidate of its own Client that has won an
// election whose previous leader led without the guard, and now waits out
// that leader's loss deadline before it starts, holding the election's
// lock and its guard. It returns the candidate's Client, its campaign's
// result channel and cancel function, and the election's and guard's keys.
func guardlessHandover(t *testing.T, dsn, name string) (y *Client, next <-chan campaignResult, cancel context.CancelFunc, key, guardKey Key) {
	t.Helper()
	ctx := testCtx(t)
	pool := pgtest.Pool(t, dsn)
	key = electionKey(DefaultSchema, name)
	guardKey = HashKey("pgcoord.election.guard", DefaultSchema, name)
	squatter := pgtest.Conn(t, dsn)
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_lock($1)", guardKey.v); err != nil {
		t.Fatal(err)
	}
	x := newTestClient(t, dsn, WithLossDeadline(time.Second), WithHeartbeat(100*time.Millisecond))
	old, err := x.Election(name).Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if term, guarded, _ := leaderRow(t, pool, name); term != old.Term() || guarded {
		t.Fatalf("leaders row: term %d guarded %v; want term %d without the guard", term, guarded, old.Term())
	}
	// The candidate's own loss deadline is the longer, so the wait it owes
	// after winning is 3 s.
	y = newTestClient(t, dsn, WithLossDeadline(3*time.Second), WithHeartbeat(100*time.Millisecond))
	cctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	next = goCampaign(cctx, y.Election(name))
	pgtest.Eventually(t, testTimeout, "the candidate waits for the lock", func() bool {
		return waitingOn(t, dsn, key) >= 1
	})
	terminateBackend(t, pool, old.lock.s.PID())
	pgtest.Eventually(t, testTimeout, "the candidate records its term", func() bool {
		return rowTerm(ctx, pool, DefaultSchema, name) > old.Term()
	})
	awaitLeadershipEnd(t, old)
	// The guard is free now: the candidate takes it and waits on.
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_unlock($1)", guardKey.v); err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, testTimeout, "the candidate takes the guard", func() bool {
		pid := guardSessionPID(y)
		got := grantedTo(t, dsn, guardKey)
		return pid != 0 && len(got) == 1 && got[0] == pid
	})
	select {
	case r := <-next:
		t.Fatalf("the campaign returned (%v) before the wait it owes the guardless leader", r.err)
	default:
	}
	if got := grantedTo(t, dsn, key); len(got) != 1 {
		t.Fatalf("election lock held by %v, want the waiting candidate", got)
	}
	return y, next, cancel, key, guardKey
}

// A candidate that waits out a guardless predecessor's loss deadline, its
// lock and guard held, and gives up (its ctx ends) or whose Client closes:
// the campaign returns the documented error and nothing stays held in
// pg_locks; Close returns within the loss deadline.
func TestElectionHandoverWaitEndsCleanly(t *testing.T) {
	t.Parallel()
	t.Run("cancel", func(t *testing.T) {
		t.Parallel()
		dsn := migratedDB(t)
		_, next, cancel, key, guardKey := guardlessHandover(t, dsn, "wait-cancel")
		cancel()
		r := receiveCampaign(t, next, "cancelled during the handover wait")
		if !errors.Is(r.err, context.Canceled) || r.ld != nil {
			t.Fatalf("Campaign = %v, %v; want context.Canceled", r.ld, r.err)
		}
		notHeld(t, dsn, key)
		notHeld(t, dsn, guardKey)
	})
	t.Run("close", func(t *testing.T) {
		t.Parallel()
		dsn := migratedDB(t)
		y, next, _, key, guardKey := guardlessHandover(t, dsn, "wait-close")
		start := time.Now()
		if err := y.Close(testCtx(t)); err != nil {
			t.Fatalf("Close: %v", err)
		}
		if d := time.Since(start); d > 3*time.Second {
			t.Errorf("Close took %v during the handover wait, want within L = 3s", d)
		}
		r := receiveCampaign(t, next, "closed during the handover wait")
		if !errors.Is(r.err, ErrClosed) || r.ld != nil {
			t.Fatalf("Campaign = %v, %v; want ErrClosed", r.ld, r.err)
		}
		notHeld(t, dsn, key)
		notHeld(t, dsn, guardKey)
	})
}

// One Client leads several elections, another follows them all; the
// leading Client's guard session, which holds every guard, is terminated.
// Every leadership ends, every follower takes over, and each new leader
// starts only after the old leader of its election had cancelled its
// context.
func TestElectionManyElectionsGuardSessionLost(t *testing.T) {
	t.Parallel()
	const n = 6
	ctx := testCtx(t)
	dsn := migratedDB(t)
	pool := pgtest.Pool(t, dsn)
	a := newTestClient(t, dsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
	b := newTestClient(t, dsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second), WithMaxWaits(n+1))
	olds := make([]*Leadership, n)
	nexts := make([]<-chan campaignResult, n)
	for i := range n {
		name := fmt.Sprintf("many-%d", i)
		ld, err := a.Election(name).Campaign(ctx)
		if err != nil {
			t.Fatal(err)
		}
		olds[i] = ld
		nexts[i] = goCampaign(ctx, b.Election(name))
	}
	pgtest.Eventually(t, testTimeout, "every follower waits for its election's lock", func() bool {
		for i := range n {
			if waitingOn(t, dsn, electionKey(DefaultSchema, fmt.Sprintf("many-%d", i))) < 1 {
				return false
			}
		}
		return true
	})
	gpid := guardSessionPID(a)
	for i, ld := range olds {
		if g := ld.guardLock(); g == nil || g.s.PID() != gpid {
			t.Fatalf("election %d: guard %v not on the guard session %d", i, g, gpid)
		}
	}
	terminateBackend(t, pool, gpid)
	for i := range n {
		r := receiveCampaign(t, nexts[i], fmt.Sprintf("takeover of election %d", i))
		if r.err != nil {
			t.Fatal(r.err)
		}
		cancelled := awaitLeadershipEnd(t, olds[i])
		if !errors.Is(olds[i].Err(), ErrLockLost) {
			t.Errorf("election %d: old leadership ended with %v, want ErrLockLost", i, olds[i].Err())
		}
		if r.at.Before(cancelled) {
			t.Errorf("election %d: the new leader started %v before the old leader's context was cancelled", i, cancelled.Sub(r.at))
		}
		heldOnlyBy(t, dsn, electionKey(DefaultSchema, fmt.Sprintf("many-%d", i)), r.ld.lock.s.PID())
		if err := r.ld.Resign(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// RequestResign while the leader that Leader reports has recorded its term
// but still waits out a guardless predecessor's loss deadline. The request
// names that leader's term, and "a leader whose process runs and whose
// backend answers steps down within a heartbeat interval and a round trip
// of the request". The leader's heartbeat is 100 ms; the test allows 1 s.
func TestElectionRequestResignDuringHandoverWait(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	const name = "resign-wait"
	_, next, _, key, _ := guardlessHandover(t, dsn, name)
	e := newTestClient(t, dsn).Election(name)
	info, err := e.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := grantedTo(t, dsn, key); len(got) != 1 || got[0] != info.PID {
		t.Fatalf("Leader = %+v, pg_locks holder %v", info, got)
	}
	asked := time.Now()
	if err := e.RequestResign(ctx); err != nil {
		t.Fatal(err)
	}
	// The term asked to resign gives up its wait, and its lock, within a
	// heartbeat and a round trip: its fn never starts.
	var gaveUp time.Duration
	pgtest.Eventually(t, testTimeout, "the asked term to free the election's lock", func() bool {
		got := grantedTo(t, dsn, key)
		gaveUp = time.Since(asked)
		return len(got) == 0 || got[0] != info.PID
	})
	if gaveUp > time.Second {
		t.Errorf("the term Leader reported (%d) gave up %v after RequestResign returned, want within H (100ms) and a round trip", info.Term, gaveUp.Round(time.Millisecond))
	}
	r := receiveCampaign(t, next, "the candidate, once another term has had its turn")
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.ld.Term() <= info.Term {
		t.Fatalf("term %d started after term %d was asked to resign before it led", r.ld.Term(), info.Term)
	}
	if err := r.ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
}
