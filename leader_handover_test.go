package pgcoord

// The handover between leaders where the guard alone proves nothing: a
// leader that leads without the guard, a term that a server restart ended,
// and a live leader whose two connections are lost apart; and the wait a
// new leader owes its predecessor, which outlives a winner that gives up,
// ends cleanly with the campaign's ctx or Close, and gives way to a
// RequestResign. Candidates run in child processes or in this one; each
// reports when its fn started and when its context was cancelled, by its
// own clock, and the tests read pg_locks and the leaders row.

import (
	"context"
	"errors"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// leaderRow reads the handover columns of an election's row.
func leaderRow(t testing.TB, pool *pgxpool.Pool, name string) (term Term, guarded, ended bool) {
	t.Helper()
	var n int64
	if err := pool.QueryRow(testCtx(t), "SELECT term, guarded, ended FROM pgcoord.leaders WHERE name = $1", name).Scan(&n, &guarded, &ended); err != nil {
		t.Fatal(err)
	}
	return Term(n), guarded, ended
}

// A leader whose process is paused (SIGSTOP) has its lock backend
// terminated: the next leader waits L for the guard, which the paused
// process holds, and leads without it, saying so in the leaders row. Then
// the paused leader's guard backend and the guardless leader's lock
// backend are terminated at the same moment, so the guard is free while
// the guardless leader's process lives: the third leader's fn must not
// start before the guardless leader's context was cancelled. Once resumed,
// the paused leader (the documented exception) learns of its loss, and no
// write of an older term is accepted after a newer one.
func TestElectionHandoverAfterGuardlessLeader(t *testing.T) {
	t.Parallel()
	const loss, beat = time.Second, 100 * time.Millisecond
	ctx := testCtx(t)
	dsn, pool := faultDB(t)
	// The paused leader may be stopped inside the transaction of a fenced
	// write, which share-locks the fences row that the next term updates:
	// as RELIABILITY.md advises, the server ends such a transaction
	// (idle_in_transaction_session_timeout on the application's
	// connections; pgcoord's own connections set it to 0).
	if _, err := pool.Exec(ctx, `DO $$ BEGIN
		EXECUTE format('ALTER DATABASE %I SET idle_in_transaction_session_timeout = %L', current_database(), '300ms');
		END $$`); err != nil {
		t.Fatal(err)
	}
	target := electionTarget{"guardless"}
	c := newTestClient(t, dsn)
	e := c.Election(target.name)
	guardKey := HashKey("pgcoord.election.guard", DefaultSchema, target.name)
	log := newCandidateLog()
	opts := childOptions(loss, beat)
	first := log.start(t, dsn, target, opts)
	t1 := log.awaitLead(t, 0)
	procs := []*faultProc{first, log.start(t, dsn, target, opts), log.start(t, dsn, target, opts)}
	pgtest.Eventually(t, testTimeout, "both other candidates wait for the lock", func() bool {
		return waitingOn(t, dsn, target.key()) >= 2
	})
	info1, err := e.Leader(ctx)
	if err != nil || info1.Term != t1.term {
		t.Fatalf("Leader = %+v, %v; want term %d", info1, err, t1.term)
	}
	guards := grantedTo(t, dsn, guardKey)
	if len(guards) != 1 {
		t.Fatalf("the guard is granted to %v, want one backend", guards)
	}
	guard1 := guards[0]

	first.Signal(syscall.SIGSTOP)
	resumed := false
	t.Cleanup(func() {
		if !resumed {
			first.Signal(syscall.SIGCONT)
		}
	})
	at1 := terminateBackend(t, pool, info1.PID)
	t2 := log.awaitLead(t, t1.term)
	if d := t2.start.Sub(at1); d < loss {
		t.Errorf("term %d started %v after the paused leader's lock backend was terminated; its guard is held, so it must wait L = %v", t2.term, d, loss)
	}
	if term, guarded, _ := leaderRow(t, pool, target.name); term != t2.term || guarded {
		t.Fatalf("leaders row: term %d, guarded %v; want term %d led without the guard", term, guarded, t2.term)
	}
	info2, err := e.Leader(ctx)
	if err != nil || info2.Term != t2.term {
		t.Fatalf("Leader = %+v, %v; want term %d", info2, err, t2.term)
	}
	pgtest.Eventually(t, testTimeout, "the remaining candidate waits for the lock", func() bool {
		return waitingOn(t, dsn, target.key()) >= 1
	})

	// Free the paused leader's guard and end the guardless leader's lock
	// together.
	terminateBackend(t, pool, guard1)
	at2 := terminateBackend(t, pool, info2.PID)
	t3 := log.awaitLead(t, t2.term)
	old := log.awaitEnd(t, t2.term)
	if t3.start.Before(old.end) {
		t.Errorf("two leaders: term %d started %v before the guardless term %d had its context cancelled", t3.term, old.end.Sub(t3.start), t2.term)
	}
	if d := old.end.Sub(at2); d > lossNoticeBound(&core.Config{Heartbeat: beat}) {
		t.Errorf("term %d: context cancelled %v after its backend was terminated, want within 2H = %v", t2.term, d, 2*beat)
	}
	t.Logf("guardless takeover after %v; next takeover %v after the guardless leader's backend was terminated (its context cancelled after %v)",
		t2.start.Sub(at1).Round(time.Millisecond), t3.start.Sub(at2).Round(time.Millisecond), old.end.Sub(at2).Round(time.Millisecond))

	first.Signal(syscall.SIGCONT)
	resumed = true
	log.awaitEnd(t, t1.term)
	stopCandidates(t, log, procs)
	fencesInOrder(t, dsn, target)
}

// A server restart ends every connection, so the leader's lock and guard
// are freed together while its process lives on; it learns of the loss
// only at its next heartbeat. The next leader, of another Client, must not
// start before the old leader's context was cancelled: it waits out the
// old leader's loss deadline, which it knows to do because the leaders row
// records the server's start time and the leader's loss deadline. The old
// leader has H = 2 s and L = 4 s, so it may take up to two seconds to
// notice; the candidate has H = 100 ms and L = 1 s, and reconnects within
// a few hundred milliseconds of the restart.
func TestElectionHandoverAfterServerRestart(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	srv := pgtest.NewServer(t)
	dsn := srv.DB(t)
	if err := Migrate(ctx, pgtest.Pool(t, dsn)); err != nil {
		t.Fatal(err)
	}
	type term struct {
		who        string
		start, end time.Time
	}
	var mu sync.Mutex
	terms := map[Term]*term{}
	changed := make(chan struct{}, 16)
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	run := func(who string, loss, beat time.Duration) {
		c := newTestClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(beat))
		wg.Go(func() {
			for runCtx.Err() == nil {
				err := c.Election("restart").Run(runCtx, func(lctx context.Context, n Term) error {
					mu.Lock()
					terms[n] = &term{who: who, start: time.Now()}
					mu.Unlock()
					changed <- struct{}{}
					<-lctx.Done()
					mu.Lock()
					terms[n].end = leadershipOf(lctx).cancelledAt()
					mu.Unlock()
					changed <- struct{}{}
					return nil
				})
				if err != nil && runCtx.Err() == nil {
					t.Logf("%s: Run: %v (campaigning again)", who, err)
				}
			}
		})
	}
	await := func(what string, cond func() bool) {
		t.Helper()
		for {
			mu.Lock()
			ok := cond()
			mu.Unlock()
			if ok {
				return
			}
			select {
			case <-changed:
			case <-ctx.Done():
				t.Fatalf("not within %v: %s", testTimeout, what)
			}
		}
	}
	run("slow", 4*time.Second, 2*time.Second)
	await("a first leader", func() bool { return len(terms) == 1 })
	run("quick", time.Second, 100*time.Millisecond)
	var first Term
	for n := range terms {
		first = n
	}
	pgtest.Eventually(t, testTimeout, "the other Client waits for the lock", func() bool {
		return waitingOn(t, dsn, keyOf(electionKey(DefaultSchema, "restart"))) >= 1
	})
	srv.Restart(t)
	await("a leader after the restart", func() bool {
		for n := range terms {
			if n > first {
				return true
			}
		}
		return false
	})
	await("the end of the first term", func() bool { return !terms[first].end.IsZero() })
	stop()
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	old := terms[first]
	for n, tm := range terms {
		if n > first && tm.start.Before(old.end) {
			t.Errorf("two leaders: term %d (%s) started %v before term %d (%s), whose server restarted, had its context cancelled",
				n, tm.who, old.end.Sub(tm.start), first, old.who)
		}
		if n > first {
			t.Logf("after the restart, term %d (%s) started %v after term %d (%s) had its context cancelled",
				n, tm.who, tm.start.Sub(old.end).Round(time.Millisecond), first, old.who)
		}
	}
}

// A leader that started without the guard (held here by a plain
// connection, as by a paused process) says so in the leaders row, takes
// the guard as soon as it is free and says that too; and when it resigns,
// the row says its term ended, so the next leader starts at once instead
// of waiting out its loss deadline.
func TestElectionGuardlessLeaderRetakesGuard(t *testing.T) {
	t.Parallel()
	const loss, beat = time.Second, 100 * time.Millisecond
	ctx := testCtx(t)
	dsn := migratedDB(t)
	pool := pgtest.Pool(t, dsn)
	name := "retake"
	guardKey := HashKey("pgcoord.election.guard", DefaultSchema, name)
	squatter := pgtest.Conn(t, dsn)
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_lock($1)", guardKey.coreKey().V); err != nil {
		t.Fatal(err)
	}
	a := newTestClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(beat))
	start := time.Now()
	ld, err := a.Election(name).Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < loss {
		t.Fatalf("led %v after the campaign began, with the guard held elsewhere; want the guard wait of L = %v first", d, loss)
	}
	if term, guarded, ended := leaderRow(t, pool, name); term != ld.Term() || guarded || ended {
		t.Fatalf("leaders row: term %d, guarded %v, ended %v; want term %d led without the guard", term, guarded, ended, ld.Term())
	}
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_unlock($1)", guardKey.coreKey().V); err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, testTimeout, "the leader takes the freed guard and records it", func() bool {
		_, guarded, _ := leaderRow(t, pool, name)
		return guarded
	})
	guard := ld.guardLock()
	if guard == nil {
		t.Fatal("the row says guarded, the leadership holds no guard")
	}
	heldOnlyBy(t, dsn, guardKey, guard.S.PID())
	if ld.Err() != nil || ld.Context().Err() != nil {
		t.Fatalf("the leadership ended: %v", ld.Err())
	}

	if err := ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	if _, _, ended := leaderRow(t, pool, name); !ended {
		t.Fatal("leaders row: the resigned term is not marked ended")
	}

	// Another leader without the guard, asked to resign the moment the
	// guard is free, before it can take it: the row says its term ended,
	// so the waiting candidate starts at once, not a loss deadline later.
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_lock($1)", guardKey.coreKey().V); err != nil {
		t.Fatal(err)
	}
	b := newTestClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(beat))
	ldb, err := b.Election(name).Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	next := make(chan *Leadership, 1)
	go func() {
		ld, err := a.Election(name).Campaign(ctx)
		if err != nil {
			t.Error(err)
		}
		next <- ld
	}()
	pgtest.Eventually(t, testTimeout, "the next candidate waits for the lock", func() bool {
		return waitingOn(t, dsn, keyOf(electionKey(DefaultSchema, name))) >= 1
	})
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_unlock($1)", guardKey.coreKey().V); err != nil {
		t.Fatal(err)
	}
	if err := a.Election(name).RequestResign(ctx); err != nil {
		t.Fatal(err)
	}
	<-ldb.Done()
	ended := ldb.cancelledAt()
	ldc := <-next
	if ldc == nil {
		t.Fatal("no next leader")
	}
	if d := time.Since(ended); d >= loss/2 {
		t.Errorf("the next leader started %v after a leader without the guard resigned; want at once, well within L = %v", d, loss)
	}
	if err := ldc.Resign(ctx); err != nil {
		t.Fatal(err)
	}
}

// Terms keep growing where the fences row of the election's key is older
// than the leaders row: after an upgrade that changed the election's key
// (the row's term was issued for the old key), or a fences table restored
// from an older backup. The next term follows the row's, and CheckFence
// accepts it with the election's key.
func TestElectionTermsGrowPastTheLeadersRow(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	pool := pgtest.Pool(t, dsn)
	c := newTestClient(t, dsn)
	e := c.Election("upgraded")
	ld, err := e.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	// The row's term is far ahead of the key's fences row, as if it had
	// been issued under another key.
	if _, err := pool.Exec(ctx, "UPDATE pgcoord.leaders SET term = 40 WHERE name = 'upgraded'"); err != nil {
		t.Fatal(err)
	}
	ld, err = e.Campaign(ctx)
	if err != nil {
		t.Fatalf("Campaign with the leaders row ahead of the fences row: %v", err)
	}
	defer ld.Resign(ctx)
	if ld.Term() != 41 {
		t.Fatalf("term %d, want 41, after the row's 40", ld.Term())
	}
	if term, _, _ := leaderRow(t, pool, "upgraded"); term != 41 {
		t.Fatalf("leaders row: term %d, want 41", term)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if err := c.CheckFence(ctx, tx, e.Key(), ld.Term()); err != nil {
		t.Fatalf("CheckFence(term %d): %v", ld.Term(), err)
	}
}

// The handover after a server restart: the leaders row records the
// server's start time, so the first candidate that wins on the restarted
// server waits out the old leader's loss deadline before it leads. That
// candidate's campaign ends during the wait (its ctx is cancelled: the
// caller gave up). Its own record has replaced the old leader's row, with
// the new server's start time and guarded = true, so the next winner finds
// nothing to wait for and leads at once, while the old leader's process
// still lives and its context is not cancelled.
//
// The old leader's connections go through a proxy that is silenced just
// before the restart, so that it learns of the restart only by its own
// loss deadline (10 s): the latest moment the documentation allows it.
func TestElectionHandoverWaitOutlivesWinnerAfterRestart(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	srv := pgtest.NewServer(t)
	dsn := srv.DB(t)
	admin := pgtest.Pool(t, dsn)
	if err := Migrate(ctx, admin); err != nil {
		t.Fatal(err)
	}
	const name = "restart-give-up"
	key := electionKey(DefaultSchema, name)
	const oldLoss, oldBeat = 10 * time.Second, time.Second
	old, proxy := silentClient(t, dsn, WithLossDeadline(oldLoss), WithHeartbeat(oldBeat))
	ldOld, err := old.Election(name).Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	heldOnlyBy(t, dsn, keyOf(key), ldOld.lock.S.PID())

	quick := []Option{WithLossDeadline(time.Second), WithHeartbeat(100 * time.Millisecond)}
	first := newTestClient(t, dsn, quick...)
	second := newTestClient(t, dsn, quick...)
	firstCtx, giveUp := context.WithCancel(ctx)
	defer giveUp()
	firstCh := goCampaign(firstCtx, first.Election(name))
	pgtest.Eventually(t, testTimeout, "the first candidate waits for the lock", func() bool {
		return waitingOn(t, dsn, keyOf(key)) >= 1
	})

	proxy.Blackhole()
	srv.Restart(t)
	restarted := time.Now()
	pgtest.Eventually(t, testTimeout, "the first candidate wins on the restarted server and records its term", func() bool {
		return rowTerm(ctx, admin, DefaultSchema, name) > ldOld.Term()
	})
	select {
	case r := <-firstCh:
		t.Fatalf("the first candidate's campaign returned (%v, %v) at once; it must wait out the old leader's L = %v", r.ld, r.err, oldLoss)
	default:
	}
	secondCh := goCampaign(ctx, second.Election(name))
	pgtest.Eventually(t, testTimeout, "the second candidate waits for the lock", func() bool {
		return waitingOn(t, dsn, keyOf(key)) >= 1
	})
	giveUp()
	if r := receiveCampaign(t, firstCh, "first"); r.err == nil {
		t.Fatalf("the first candidate led (term %d) although its ctx was cancelled", r.ld.Term())
	}
	r := receiveCampaign(t, secondCh, "second")
	if r.err != nil {
		t.Fatal(r.err)
	}
	oldLive := ldOld.Context().Err() == nil
	heldOnlyBy(t, dsn, keyOf(key), r.ld.lock.S.PID())
	oldEnd := awaitLeadershipEnd(t, ldOld)
	t.Logf("restart; second candidate led %v after it (term %d); the old leader's context was cancelled %v after it",
		r.at.Sub(restarted).Round(time.Millisecond), r.ld.Term(), oldEnd.Sub(restarted).Round(time.Millisecond))
	if oldLive || r.at.Before(oldEnd) {
		t.Errorf("two leaders: term %d started %v before the old term %d, whose server restarted, had its context cancelled",
			r.ld.Term(), oldEnd.Sub(r.at).Round(time.Millisecond), ldOld.Term())
	}
	if err := r.ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
}

// The handover after a leader that led without the guard: its successor
// waits out its loss deadline after winning (the row says guarded =
// false). The successor's campaign ends during that wait (its ctx is
// cancelled); its record set guarded = true, so the next winner leads at
// once, while the guardless leader's process lives and its context is not
// cancelled.
//
// The guard is held at first by a plain connection (as by a paused
// process), so the first leader starts without it; the connections of
// that leader go through a proxy that is silenced before the guard is
// freed and its lock backend terminated, so that it learns of the loss
// only by its loss deadline.
func TestElectionHandoverWaitOutlivesWinnerAfterGuardless(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	admin := pgtest.Pool(t, dsn)
	const name = "guardless-give-up"
	key := electionKey(DefaultSchema, name)
	guardKey := HashKey("pgcoord.election.guard", DefaultSchema, name)
	squatter := pgtest.Conn(t, dsn)
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_lock($1)", guardKey.coreKey().V); err != nil {
		t.Fatal(err)
	}
	const oldLoss, oldBeat = 4 * time.Second, time.Second
	old, proxy := silentClient(t, dsn, WithLossDeadline(oldLoss), WithHeartbeat(oldBeat))
	ldOld, err := old.Election(name).Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, guarded, _ := leaderRow(t, admin, name); guarded {
		t.Fatal("leaders row: guarded, with the guard held elsewhere")
	}

	quick := []Option{WithLossDeadline(time.Second), WithHeartbeat(100 * time.Millisecond)}
	first := newTestClient(t, dsn, quick...)
	second := newTestClient(t, dsn, quick...)
	firstCtx, giveUp := context.WithCancel(ctx)
	defer giveUp()
	firstCh := goCampaign(firstCtx, first.Election(name))
	pgtest.Eventually(t, testTimeout, "the first candidate waits for the lock", func() bool {
		return waitingOn(t, dsn, keyOf(key)) >= 1
	})

	proxy.Blackhole()
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_unlock($1)", guardKey.coreKey().V); err != nil {
		t.Fatal(err)
	}
	at := terminateBackend(t, admin, ldOld.lock.S.PID())
	pgtest.Eventually(t, testTimeout, "the first candidate wins and records its term", func() bool {
		return rowTerm(ctx, admin, DefaultSchema, name) > ldOld.Term()
	})
	select {
	case r := <-firstCh:
		t.Fatalf("the first candidate's campaign returned (%v, %v) at once; it must wait out the guardless leader's L = %v", r.ld, r.err, oldLoss)
	default:
	}
	secondCh := goCampaign(ctx, second.Election(name))
	pgtest.Eventually(t, testTimeout, "the second candidate waits for the lock", func() bool {
		return waitingOn(t, dsn, keyOf(key)) >= 1
	})
	giveUp()
	if r := receiveCampaign(t, firstCh, "first"); r.err == nil {
		t.Fatalf("the first candidate led (term %d) although its ctx was cancelled", r.ld.Term())
	}
	r := receiveCampaign(t, secondCh, "second")
	if r.err != nil {
		t.Fatal(r.err)
	}
	oldLive := ldOld.Context().Err() == nil
	heldOnlyBy(t, dsn, keyOf(key), r.ld.lock.S.PID())
	oldEnd := awaitLeadershipEnd(t, ldOld)
	if !errors.Is(ldOld.Err(), ErrLockLost) {
		t.Errorf("guardless leader ended with %v, want ErrLockLost", ldOld.Err())
	}
	t.Logf("lock backend terminated; second candidate led %v after it (term %d); the guardless leader's context was cancelled %v after it",
		r.at.Sub(at).Round(time.Millisecond), r.ld.Term(), oldEnd.Sub(at).Round(time.Millisecond))
	if oldLive || r.at.Before(oldEnd) {
		t.Errorf("two leaders: term %d started %v before the guardless term %d had its context cancelled",
			r.ld.Term(), oldEnd.Sub(r.at).Round(time.Millisecond), ldOld.Term())
	}
	if err := r.ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
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
		return waitingOn(t, dsn, keyOf(key)) >= 1
	})
	guard := old.guardLock()
	if guard == nil {
		t.Fatal("the first leader holds no guard")
	}
	guardPID, lockPID := guard.S.PID(), old.lock.S.PID()

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
	heldOnlyBy(t, dsn, keyOf(key), r.ld.lock.S.PID())
	if d := cancelled.Sub(first); d > lossNoticeBound(&core.Config{Heartbeat: beat}) {
		t.Errorf("the old leader's context was cancelled %v after its guard connection was lost, want within 2H = %v", d.Round(time.Millisecond), 2*beat)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if err := CheckFence(ctx, tx, keyOf(key), old.Term()); !errors.Is(err, ErrStaleFence) {
		t.Errorf("CheckFence with the old term %d: %v, want ErrStaleFence", old.Term(), err)
	}
	t.Logf("new leader %v after the lock connection was lost; old leader's context cancelled %v after the guard's (overlap %v)",
		r.at.Sub(terminated).Round(time.Millisecond), cancelled.Sub(first).Round(time.Millisecond), max(cancelled.Sub(r.at), 0).Round(time.Millisecond))
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
	key = keyOf(electionKey(DefaultSchema, name))
	guardKey = HashKey("pgcoord.election.guard", DefaultSchema, name)
	squatter := pgtest.Conn(t, dsn)
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_lock($1)", guardKey.coreKey().V); err != nil {
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
	terminateBackend(t, pool, old.lock.S.PID())
	pgtest.Eventually(t, testTimeout, "the candidate records its term", func() bool {
		return rowTerm(ctx, pool, DefaultSchema, name) > old.Term()
	})
	awaitLeadershipEnd(t, old)
	// The guard is free now: the candidate takes it and waits on.
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_unlock($1)", guardKey.coreKey().V); err != nil {
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

// A candidate wins the lock, records its term and waits for the guard (held
// elsewhere); its lock backend is terminated, which its Client would notice
// only at its next heartbeat (10 s). Another candidate wins the lock and
// records a newer term. When the guard comes free, whichever of the two
// gets it first: the first candidate never leads the term whose lock it
// lost, so no older term begins after a newer one. It campaigns on and
// leads a term newer than the other's, after the other resigned.
func TestElectionCandidateThatLostItsLockWhileWaitingForTheGuardNeverLeadsThatTerm(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	pool := pgtest.Pool(t, dsn)
	const name = "lost-before-guard"
	key := electionKey(DefaultSchema, name)
	guardKey, freeGuard := holdGuard(t, dsn, name)

	a := newTestClient(t, dsn, WithLossDeadline(20*time.Second), WithHeartbeat(10*time.Second))
	aNext := goCampaign(ctx, a.Election(name))
	pgtest.Eventually(t, testTimeout, "the first candidate records its term and waits for the guard", func() bool {
		return rowTerm(ctx, pool, DefaultSchema, name) > 0 && len(grantedTo(t, dsn, keyOf(key))) == 1 && waitingOn(t, dsn, guardKey) >= 1
	})
	lost := rowTerm(ctx, pool, DefaultSchema, name)
	terminateBackend(t, pool, grantedTo(t, dsn, keyOf(key))[0])

	b := newTestClient(t, dsn, WithLossDeadline(time.Second), WithHeartbeat(100*time.Millisecond))
	bNext := goCampaign(ctx, b.Election(name))
	pgtest.Eventually(t, testTimeout, "the second candidate records a newer term", func() bool {
		return rowTerm(ctx, pool, DefaultSchema, name) > lost
	})
	freeGuard()

	// The second candidate leads (at once, or once the first has given
	// the guard back), and resigns.
	rb := receiveCampaign(t, bNext, "the second candidate")
	if rb.err != nil {
		t.Fatalf("second candidate: %v", rb.err)
	}
	select {
	case ra := <-aNext:
		t.Fatalf("the first candidate led term %v (%v) while the second led term %d; the lock of term %d was lost before it began",
			termOf(ra), ra.err, rb.ld.Term(), lost)
	default:
	}
	if rb.ld.Term() <= lost {
		t.Fatalf("second candidate leads term %d, want newer than %d", rb.ld.Term(), lost)
	}
	if err := rb.ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	resigned := time.Now()

	ra := receiveCampaign(t, aNext, "the first candidate, after the second resigned")
	if ra.err != nil {
		t.Fatalf("first candidate: %v", ra.err)
	}
	if ra.ld.Term() <= rb.ld.Term() {
		t.Fatalf("broken promise: the first candidate leads term %d, not newer than the second's %d (its lock of term %d was lost before it began)",
			ra.ld.Term(), rb.ld.Term(), lost)
	}
	if ra.at.Before(resigned) && !rb.ld.cancelledAt().Before(ra.at) {
		t.Fatalf("the first candidate began at %v, before the second's context was cancelled", ra.at)
	}
	if term, _, _ := leaderRow(t, pool, name); term != ra.ld.Term() {
		t.Fatalf("leaders row: term %d, want %d", term, ra.ld.Term())
	}
	if err := ra.ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	notHeld(t, dsn, keyOf(key))
}

func termOf(r campaignResult) any {
	if r.ld == nil {
		return nil
	}
	return r.ld.Term()
}

// holdGuard holds the guard of election name on a connection of its own, as
// a previous leader that has not freed it would; free frees it.
func holdGuard(t *testing.T, dsn, name string) (guardKey Key, free func()) {
	t.Helper()
	ctx := testCtx(t)
	guardKey = HashKey("pgcoord.election.guard", DefaultSchema, name)
	squatter := pgtest.Conn(t, dsn)
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_lock($1)", guardKey.coreKey().V); err != nil {
		t.Fatal(err)
	}
	return guardKey, func() {
		t.Helper()
		if _, err := squatter.Exec(ctx, "SELECT pg_advisory_unlock($1)", guardKey.coreKey().V); err != nil {
			t.Fatal(err)
		}
	}
}
