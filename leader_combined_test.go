package pgcoord

// Promises of elections and semaphores under two ordinary things at once:
// a restart or a pause and a candidate that gives up, a silent network and
// a guard to retake, two elections waiting for their guards, Close during a
// campaign. Each test reads the outcome back from PostgreSQL where it can.

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// rowTerm reads the term of an election's row, or 0 when the row cannot be
// read (no row yet, or a pool connection that a restart ended).
func rowTerm(ctx context.Context, pool *pgxpool.Pool, schema, name string) Term {
	var n int64
	if err := pool.QueryRow(ctx, "SELECT term FROM "+quoteIdent(schema)+".leaders WHERE name = $1", name).Scan(&n); err != nil {
		return 0
	}
	return Term(n)
}

// quoteIdent quotes a schema name for SQL.
func quoteIdent(s string) string { return `"` + s + `"` }

// campaignResult is what a Campaign run in a goroutine returned, and when.
type campaignResult struct {
	ld  *Leadership
	err error
	at  time.Time
}

func goCampaign(ctx context.Context, e *Election) <-chan campaignResult {
	ch := make(chan campaignResult, 1)
	go func() {
		ld, err := e.Campaign(ctx)
		ch <- campaignResult{ld, err, time.Now()}
	}()
	return ch
}

func receiveCampaign(t testing.TB, ch <-chan campaignResult, what string) campaignResult {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(testTimeout):
		t.Fatalf("campaign did not return in time: %s", what)
		return campaignResult{}
	}
}

// silentClient returns a Client whose every connection goes through a
// proxy that the test can silence, so that the Client learns of a loss only
// by its own loss deadline.
func silentClient(t *testing.T, dsn string, opts ...Option) (*Client, *pgtest.Proxy) {
	t.Helper()
	proxy := pgtest.NewProxy(t, dsn)
	c, err := New(pgtest.Pool(t, dsn, proxy.Route), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c, proxy
}

// awaitLeadershipEnd waits, bounded, until a leadership has ended, and
// returns when its context was cancelled by its own clock.
func awaitLeadershipEnd(t testing.TB, ld *Leadership) time.Time {
	t.Helper()
	select {
	case <-ld.Done():
	case <-time.After(testTimeout):
		t.Fatalf("term %d did not end", ld.Term())
	}
	return ld.cancelledAt()
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
	heldOnlyBy(t, dsn, key, ldOld.lock.s.PID())

	quick := []Option{WithLossDeadline(time.Second), WithHeartbeat(100 * time.Millisecond)}
	first := newTestClient(t, dsn, quick...)
	second := newTestClient(t, dsn, quick...)
	firstCtx, giveUp := context.WithCancel(ctx)
	defer giveUp()
	firstCh := goCampaign(firstCtx, first.Election(name))
	pgtest.Eventually(t, testTimeout, "the first candidate waits for the lock", func() bool {
		return waitingOn(t, dsn, key) >= 1
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
		return waitingOn(t, dsn, key) >= 1
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
	heldOnlyBy(t, dsn, key, r.ld.lock.s.PID())
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
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_lock($1)", guardKey.v); err != nil {
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
		return waitingOn(t, dsn, key) >= 1
	})

	proxy.Blackhole()
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_unlock($1)", guardKey.v); err != nil {
		t.Fatal(err)
	}
	at := terminateBackend(t, admin, ldOld.lock.s.PID())
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
		return waitingOn(t, dsn, key) >= 1
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
	heldOnlyBy(t, dsn, key, r.ld.lock.s.PID())
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

// A leader that leads without the guard, on a silent network: its context
// must be cancelled within its loss deadline L of the silence (its lease
// runs from the last answered statement, sent before the silence). Its
// watch tries to take the guard every heartbeat (retakeGuard); on the
// silent network that try hangs until the guard session's own lease runs
// out, and the next tick then opens a new guard session through the silent
// network, which waits out the heartbeat interval, while the lock's loss
// is already known. Six such leaders run at once, each on a Client of its
// own behind a proxy of its own.
func TestElectionGuardlessLeaderSilentNetworkWithinL(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	const loss, beat = 2 * time.Second, time.Second
	const n = 6
	squatter := pgtest.Conn(t, dsn)
	type leader struct {
		ld    *Leadership
		proxy *pgtest.Proxy
	}
	leaders := make([]leader, n)
	errs := make(chan error, n)
	for i := range n {
		name := "silent-guardless-" + string(rune('a'+i))
		guardKey := HashKey("pgcoord.election.guard", DefaultSchema, name)
		if _, err := squatter.Exec(ctx, "SELECT pg_advisory_lock($1)", guardKey.v); err != nil {
			t.Fatal(err)
		}
		c, proxy := silentClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(beat))
		leaders[i].proxy = proxy
		go func() {
			ld, err := c.Election(name).Campaign(ctx)
			leaders[i].ld = ld
			errs <- err
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	admin := pgtest.Pool(t, dsn)
	for i := range n {
		if _, guarded, _ := leaderRow(t, admin, "silent-guardless-"+string(rune('a'+i))); guarded {
			t.Fatal("leaders row: guarded, with the guard held elsewhere")
		}
	}
	silent := time.Now()
	for _, l := range leaders {
		l.proxy.Blackhole()
	}
	late := 0
	for i, l := range leaders {
		end := awaitLeadershipEnd(t, l.ld)
		d := end.Sub(silent)
		t.Logf("guardless leader %d: context cancelled %v after the network went silent (L = %v): %v", i, d.Round(time.Millisecond), loss, l.ld.Err())
		if d > loss+500*time.Millisecond {
			late++
		}
	}
	if late > 0 {
		t.Errorf("%d of %d guardless leaders had their context cancelled more than L = %v (+500 ms) after the network went silent", late, n, loss)
	}
}

// Two elections followed by one Client, whose elections share its guard
// session. In election A the guard is held elsewhere (as by a paused
// process), so the Client, having won A's lock, waits up to its loss
// deadline for A's guard. Meanwhile B's leader, of another Client, has its
// lock backend terminated; its process lives and frees B's guard within a
// heartbeat. The Client wins B's lock: B's new leader must start right
// after B's old leader's context was cancelled (E3: measured p90 186 ms),
// not when the unrelated wait for A's guard ends.
func TestElectionGuardWaitsAreIndependent(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	admin := pgtest.Pool(t, dsn)
	// B's old leader notices its loss within a heartbeat of 1 s; the
	// Client's loss deadline, which bounds its wait for A's guard, is 4 s.
	oldOpts := []Option{WithLossDeadline(3 * time.Second), WithHeartbeat(time.Second)}
	opts := []Option{WithLossDeadline(4 * time.Second), WithHeartbeat(100 * time.Millisecond)}
	squatter := pgtest.Conn(t, dsn)
	guardA := HashKey("pgcoord.election.guard", DefaultSchema, "shared-guard-a")
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_lock($1)", guardA.v); err != nil {
		t.Fatal(err)
	}
	z := newTestClient(t, dsn, oldOpts...)
	ldZ, err := z.Election("shared-guard-b").Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	y := newTestClient(t, dsn, opts...)
	chB := goCampaign(ctx, y.Election("shared-guard-b"))
	pgtest.Eventually(t, testTimeout, "the Client waits for B's lock", func() bool {
		return waitingOn(t, dsn, electionKey(DefaultSchema, "shared-guard-b")) >= 1
	})
	chA := goCampaign(ctx, y.Election("shared-guard-a"))
	// The Client has won A's lock; A's guard is held elsewhere, so it
	// waits for the guard.
	pgtest.Eventually(t, testTimeout, "the Client wins A's lock and waits for A's guard", func() bool {
		return len(grantedTo(t, dsn, electionKey(DefaultSchema, "shared-guard-a"))) == 1
	})
	at := terminateBackend(t, admin, ldZ.lock.s.PID())
	r := receiveCampaign(t, chB, "B")
	if r.err != nil {
		t.Fatal(r.err)
	}
	oldEnd := awaitLeadershipEnd(t, ldZ)
	if r.at.Before(oldEnd) {
		t.Errorf("B: new leader started before the old leader's context was cancelled")
	}
	_, guarded, _ := leaderRow(t, admin, "shared-guard-b")
	t.Logf("B: old leader's context cancelled %v after its backend was terminated; new leader started %v after that (guarded %v)",
		oldEnd.Sub(at).Round(time.Millisecond), r.at.Sub(oldEnd).Round(time.Millisecond), guarded)
	if d := r.at.Sub(oldEnd); d > time.Second {
		t.Errorf("B: the new leader started %v after the old leader's context was cancelled, want right after (< 1 s): it waited for election A's guard", d.Round(time.Millisecond))
	}
	if !guarded {
		t.Errorf("B: the new leader leads without the guard, which the old leader freed %v after its backend was terminated", oldEnd.Sub(at).Round(time.Millisecond))
	}
	if ra := receiveCampaign(t, chA, "A"); ra.err == nil {
		_ = ra.ld.Resign(ctx)
	}
	_ = r.ld.Resign(ctx)
}

// An Acquire at the head of the queue whose grant statement waits for the
// semaphore's row, which an uncommitted raise of the limit holds, has its
// ctx cancelled during that wait; the raise then commits. "If Acquire
// returns an error it holds nothing": no slot, no queue key, no row; and
// the raised limit is there for the next acquire.
func TestSemaphoreCancelWhileRowLockedLeavesNothing(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	const name = "cancel-row-locked"
	a := newTestClient(t, dsn).Semaphore(name, 1)
	b := newTestClient(t, dsn).Semaphore(name, 1)
	held := mustAcquire(t, a, true)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		p, err := b.Acquire(wctx)
		if p != nil {
			_ = p.Release(ctx)
		}
		done <- err
	}()
	pgtest.Eventually(t, testTimeout, "the Acquire heads the queue", func() bool {
		_, queued := slotLocks(t, dsn, a)
		return queued
	})
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, `UPDATE pgcoord.semaphores SET "limit" = 2 WHERE name = $1`, name); err != nil {
		t.Fatal(err)
	}
	// The head of a semaphore of limit 1 waits for slot 0 on the server
	// and looks at the row again only when told the limit changed, which
	// the raise will tell at its commit: tell it now, as often as it takes
	// (the wait may start just after a notice), and its grant waits for
	// the row.
	pgtest.Eventually(t, testTimeout, "the head's grant waits for the semaphore's row", func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND wait_event IN ('transactionid', 'tuple') AND query LIKE '%semaphore_acquire%'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			if _, err := pool.Exec(ctx, "SELECT pg_notify($1, $2)", semaphoreChannel, a.payload+"limit"); err != nil {
				t.Fatal(err)
			}
		}
		return n >= 1
	})
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Acquire = %v, want context.Canceled", err)
		}
	case <-time.After(testTimeout):
		t.Fatal("Acquire did not return after its ctx was cancelled")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	slots, queued := slotLocks(t, dsn, a)
	if len(slots) != 1 || slots[held.Slot()] != held.l.s.pid || queued {
		t.Fatalf("pg_locks after a cancelled Acquire: slots %v, queue %v; want only the holder's", slots, queued)
	}
	if n := holderRows(t, pool, name); n != 1 {
		t.Fatalf("%d holder rows, want the holder's only", n)
	}
	p := mustAcquire(t, b, true)
	mustRelease(t, p)
	mustRelease(t, held)
}

// Campaign "returns ctx's error when ctx ends first, ErrClosed after
// Close, an error wrapping ErrNotMigrated without the tables of Migrate".
// Two ordinary cases: the Client is closed while a candidate waits for a
// leader of another Client to go, and a database without the tables. The
// campaign's ctx has a deadline of 5 s: Campaign must return the
// error, and Close must return within the Client's loss deadline L.
func TestCampaignReturnsItsErrors(t *testing.T) {
	t.Parallel()
	const loss = time.Second
	t.Run("closed", func(t *testing.T) {
		t.Parallel()
		ctx := testCtx(t)
		dsn := migratedDB(t)
		const name = "campaign-closed"
		leader := newTestClient(t, dsn)
		ld, err := leader.Election(name).Campaign(ctx)
		if err != nil {
			t.Fatal(err)
		}
		c, err := New(pgtest.Pool(t, dsn), WithLossDeadline(loss), WithHeartbeat(100*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		ch := goCampaign(cctx, c.Election(name))
		pgtest.Eventually(t, testTimeout, "the candidate waits for the lock", func() bool {
			return waitingOn(t, dsn, electionKey(DefaultSchema, name)) >= 1
		})
		closed := make(chan time.Duration, 1)
		start := time.Now()
		go func() {
			_ = c.Close(context.Background())
			closed <- time.Since(start)
		}()
		r := receiveCampaign(t, ch, "candidate")
		if !errors.Is(r.err, ErrClosed) {
			t.Errorf("Campaign returned %v after %v; want ErrClosed at once", r.err, r.at.Sub(start).Round(time.Millisecond))
		}
		if d := <-closed; d > loss {
			t.Errorf("Close took %v, want within L = %v", d.Round(time.Millisecond), loss)
		}
		_ = ld.Resign(ctx)
	})
	t.Run("not-migrated", func(t *testing.T) {
		t.Parallel()
		ctx := testCtx(t)
		dsn := pgtest.DB(t)
		c := newTestClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(100*time.Millisecond))
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		start := time.Now()
		_, err := c.Election("campaign-not-migrated").Campaign(cctx)
		if !errors.Is(err, ErrNotMigrated) {
			t.Errorf("Campaign on a database without the tables returned %v after %v; want ErrNotMigrated at once", err, time.Since(start).Round(time.Millisecond))
		}
	})
}
