package pgcoord

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// A new leader's term is issued without risking the other locks of the
// backend that holds the election's lock: while a transaction holds the
// election's fences row (an old leader's write that called CheckFence) or
// its leaders row, a candidate that has taken the election's lock waits for
// that row in slices, so the unrelated lock on the same backend stays held
// (read in pg_locks) for more than twice the loss deadline, and the
// campaign leads, with a greater term, only once the transaction has ended.
func TestElectionTermWaitKeepsOtherLocks(t *testing.T) {
	t.Parallel()
	const loss = time.Second
	for _, tc := range []struct {
		name string
		hold string // the statement that holds a row of the election for the test's transaction
	}{
		{"fences row", ""}, // CheckFence of the old term
		{"leaders row", "SELECT 1 FROM pgcoord.leaders WHERE name = $1 FOR UPDATE"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			dsn := pgtest.DB(t)
			pool := migrated(t, dsn)
			// One shared backend: the election's lock and the unrelated
			// lock are on the same server session.
			c := newTestClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(250*time.Millisecond), WithSharedBackends(1))
			e := c.Election("term-wait")
			old, err := e.Campaign(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := old.Resign(ctx); err != nil {
				t.Fatal(err)
			}

			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.Background())
			if tc.hold == "" {
				err = CheckFence(ctx, tx, e.Key(), old.Term())
			} else {
				_, err = tx.Exec(ctx, tc.hold, e.Name())
			}
			if err != nil {
				t.Fatal(err)
			}
			unrelated := HashKey("term-wait", "unrelated")
			u, err := c.Lock(ctx, unrelated)
			if err != nil {
				t.Fatal(err)
			}

			won := make(chan *Leadership, 1)
			failed := make(chan error, 1)
			go func() {
				ld, err := e.Campaign(ctx)
				if err != nil {
					failed <- err
					return
				}
				won <- ld
			}()
			// The campaign takes the election's lock on the one backend,
			// then waits for the row.
			for deadline := time.Now().Add(10 * time.Second); !holdsOn(t, dsn, e.Key(), u.core.S.PID()); time.Sleep(5 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("the campaign did not take the election's lock on the Client's one backend %d within 10s; pg_locks shows it granted to %v", u.core.S.PID(), grantedTo(t, dsn, e.Key()))
				}
			}
			open := time.Now()
			end := time.After(5 * loss / 2)
			tick := time.NewTicker(50 * time.Millisecond)
			defer tick.Stop()
		watching:
			for {
				select {
				case ld := <-won:
					t.Fatalf("the campaign led with term %d %v after it took the election's lock, while the transaction holding the %s was open; the term cannot be recorded before it ends",
						ld.Term(), time.Since(open), tc.name)
				case err := <-failed:
					t.Fatalf("the campaign failed %v into its wait for the %s (the unrelated lock's Err: %v): %v; it must wait for the transaction, keeping the other locks of its backend",
						time.Since(open), tc.name, u.Err(), err)
				case <-u.Done():
					t.Fatalf("the unrelated lock was lost %v into the campaign's wait for the %s (Err: %v); recording a term must not hold its backend past the loss deadline %v",
						time.Since(open), tc.name, u.Err(), loss)
				case <-tick.C:
					if !holdsOn(t, dsn, unrelated, u.core.S.PID()) {
						t.Fatalf("%v into the campaign's wait, pg_locks shows the unrelated key granted to %v, not to its backend %d", time.Since(open), grantedTo(t, dsn, unrelated), u.core.S.PID())
					}
				case <-end:
					break watching
				}
			}
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			var ld *Leadership
			select {
			case ld = <-won:
			case err := <-failed:
				t.Fatalf("the campaign after the transaction ended: %v", err)
			case <-time.After(10 * loss):
				t.Fatalf("the campaign did not lead within %v of the transaction's end", 10*loss)
			}
			if ld.Term() <= old.Term() {
				t.Fatalf("term %d, want more than the old leader's %d", ld.Term(), old.Term())
			}
			var recorded int64
			if err := pool.QueryRow(ctx, "SELECT term FROM pgcoord.leaders WHERE name = $1", e.Name()).Scan(&recorded); err != nil {
				t.Fatal(err)
			}
			if recorded != int64(ld.Term()) {
				t.Fatalf("the leaders row records term %d, want the new leader's %d", recorded, ld.Term())
			}
			heldOnlyBy(t, dsn, e.Key(), u.core.S.PID())
			stillHeld(t, dsn, u, "the unrelated lock")
			if err := ld.Resign(ctx); err != nil {
				t.Fatal(err)
			}
			mustUnlock(t, u)
		})
	}
}

// Campaigns and blocking locks of one Client share its bounded waits: with
// WithMaxWaits(1) taken by a Lock that waits on the server for a key held
// elsewhere, a follower's campaign still takes over within 1 s of the
// leader's resignation (the loss deadline is 5 s, the campaign round with
// it), and the Lock keeps waiting on the server meanwhile.
func TestCampaignSharesWaitsWithLocks(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	a := newTestClient(t, dsn)
	b := newTestClient(t, dsn, WithMaxWaits(1), WithLossDeadline(5*time.Second))
	held := HashKey("campaign-shares-waits", "held")
	outside := pgtest.Conn(t, dsn)
	outsideLock(t, outside, held)
	waiting := goLock(func() (*Lock, error) { return b.Lock(ctx, held) })
	pgtest.Eventually(t, testTimeout, "b's Lock to wait on the server", func() bool { return waitingOn(t, dsn, held) == 1 })

	la, err := a.Election("shares-waits").Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	eb := b.Election("shares-waits")
	won := make(chan *Leadership, 1)
	go func() {
		lb, err := eb.Campaign(ctx)
		if err != nil {
			t.Error(err)
		}
		won <- lb
	}()
	// The campaign is under way: it tries, as it cannot wait on the server.
	pgtest.Eventually(t, testTimeout, "b's campaign to try for the election", func() bool { return b.Stat().QueuedWaits > 0 })
	if err := la.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	resigned := time.Now()
	var lb *Leadership
	select {
	case lb = <-won:
	case <-time.After(testTimeout):
		t.Fatalf("b's campaign did not lead within %v of a's resignation", testTimeout)
	}
	if took := lb.Since().Sub(resigned); took > time.Second {
		t.Fatalf("b led %v after a resigned, want within 1 s: a campaign must not wait for the wait slot a Lock holds", took)
	}
	heldOnlyBy(t, dsn, eb.Key(), lb.lock.S.PID())
	if n := waitingOn(t, dsn, held); n != 1 {
		t.Fatalf("%d backends wait for the held key, want b's Lock still waiting", n)
	}
	stillWaiting(t, waiting)
	if err := lb.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	outsideUnlock(t, outside, held)
	mustUnlock(t, receive(t, waiting).l)
}

// A resync that fails is tried again: the observing Client's listener is
// kept away while a new leader wins (its notification is lost), and when
// the listener is back, the resync's read of the leader fails (the role
// may not read the leaders table for a while). Once the read works again,
// Observe delivers the missed leader within a few heartbeats, though no
// notification comes.
func TestObserveRetriesFailedResync(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	admin := pgtest.Conn(t, dsn)
	role, roleDSN := newTestRole(t, dsn, "observer")
	exec := func(sql string) {
		t.Helper()
		if _, err := admin.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	exec("GRANT USAGE ON SCHEMA pgcoord TO " + role)
	exec("GRANT SELECT ON pgcoord.leaders TO " + role)
	t.Cleanup(func() {
		// Before the role is dropped.
		_, _ = admin.Exec(context.Background(), "REVOKE ALL ON pgcoord.leaders FROM "+role+"; REVOKE ALL ON SCHEMA pgcoord FROM "+role)
	})
	const heartbeat = 100 * time.Millisecond
	b := newTestClient(t, roleDSN, WithHeartbeat(heartbeat), WithApplicationName("observer-"+role))
	obs := b.Election("resync").Observe(ctx)
	if info := nextInfo(t, obs); info != (LeaderInfo{}) {
		t.Fatalf("first observation %+v, want no leader", info)
	}
	listener := func() (pid int32) {
		_ = admin.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE usename = $1 AND query LIKE 'LISTEN%'`, role).Scan(&pid)
		return pid
	}
	pgtest.Eventually(t, testTimeout, "the observer's listener", func() bool { return listener() != 0 })

	// Keep the listener away: the role may not connect, and its
	// listener's backend is terminated.
	exec("ALTER ROLE " + role + " NOLOGIN")
	exec("REVOKE SELECT ON pgcoord.leaders FROM " + role)
	if _, err := admin.Exec(ctx, "SELECT pg_terminate_backend($1)", listener()); err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, testTimeout, "the listener's backend to end", func() bool { return listener() == 0 })
	a := newTestClient(t, dsn)
	la, err := a.Election("resync").Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// The read fails: Observe says why, once.
	select {
	case info, ok := <-obs:
		if !ok || info.Err == nil || core.SqlState(info.Err) != "42501" || info.Term != 0 {
			t.Fatalf("observed %+v (channel open: %v), want the read's error (SQLSTATE 42501)", info, ok)
		}
	case <-ctx.Done():
		t.Fatal("the failed read was not reported")
	}
	// The listener comes back; its resync cannot read the leader.
	exec("ALTER ROLE " + role + " LOGIN")
	pgtest.Eventually(t, testTimeout, "the listener to listen again", func() bool { return listener() != 0 })
	select {
	case info, ok := <-obs:
		t.Fatalf("observed %+v (channel open: %v) while the role could not read the leaders table, after its error was reported", info, ok)
	case <-time.After(5 * heartbeat):
	}
	exec("GRANT SELECT ON pgcoord.leaders TO " + role)
	granted := time.Now()
	select {
	case info, ok := <-obs:
		if !ok || info.Term != la.Term() || info.Identity != a.Election("resync").identity {
			t.Fatalf("observed %+v (channel open: %v), want the leader of term %d", info, ok, la.Term())
		}
	case <-time.After(3 * time.Second):
		t.Fatalf("the leader that won while the listener was away was not observed within 3 s of the read working again")
	}
	if took := time.Since(granted); took > 20*heartbeat {
		t.Errorf("the missed leader was observed %v after the read worked again, want within a few heartbeats (%v)", took, heartbeat)
	}
	if err := la.Resign(ctx); err != nil {
		t.Fatal(err)
	}
}

// Close returns within the loss deadline whatever the caller's pool is
// doing: with the pool's only connection held by the caller and an Observe
// whose read waits for the pool, Close does not wait for the pool, and
// Observe's channel closes.
func TestCloseBoundedWithPoolExhausted(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	const loss = time.Second
	pool := pgtest.Pool(t, dsn, func(cfg *pgxpool.Config) { cfg.MaxConns = 1 })
	c := newTestClientOn(t, pool, WithLossDeadline(loss), WithHeartbeat(250*time.Millisecond))
	held, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release()
	obs := c.Election("close-bounded").Observe(ctx)
	// Observe's first read waits for the pool's one connection, and
	// reports that it could not read, at most once.
	errs := 0
	for wait := time.After(2 * loss); ; {
		var info LeaderInfo
		var ok bool
		select {
		case info, ok = <-obs:
			if !ok {
				t.Fatal("Observe's channel closed with the Client open")
			}
		case <-wait:
		}
		if !ok {
			break
		}
		errs++
		if info.Err == nil || errs > 1 {
			t.Fatalf("Observe delivered %+v with the pool's only connection held (report %d); want one error at most", info, errs)
		}
	}
	start := time.Now()
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > loss {
		t.Fatalf("Close took %v with the pool exhausted and an Observe running, want within the loss deadline %v", took, loss)
	}
	select {
	case _, ok := <-obs:
		if ok {
			t.Fatal("Observe delivered a leader after Close")
		}
	case <-time.After(testTimeout):
		t.Fatal("Observe's channel still open after Close returned")
	}
}

// A RequestResign reaches the leader whatever happens to the leader's
// listener connection: terminated just before the request (it comes back
// and resyncs), or terminated and kept away (its role may not log in, so
// it cannot come back). The leader's context is cancelled within a second
// (H = 100 ms), far inside the loss deadline, and its term's row records
// the request.
func TestRequestResignReachesLeaderWithoutListener(t *testing.T) {
	t.Parallel()
	for _, away := range []bool{false, true} {
		name := "listener terminated"
		if away {
			name = "listener kept away"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			dsn := migratedDB(t)
			admin := pgtest.Conn(t, dsn)
			role, roleDSN := newTestRole(t, dsn, "leader")
			exec := func(sql string) {
				t.Helper()
				if _, err := admin.Exec(ctx, sql); err != nil {
					t.Fatalf("%s: %v", sql, err)
				}
			}
			exec("GRANT USAGE ON SCHEMA pgcoord TO " + role)
			exec("GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA pgcoord TO " + role)
			t.Cleanup(func() {
				_, _ = admin.Exec(context.Background(), "REVOKE ALL ON ALL TABLES IN SCHEMA pgcoord FROM "+role+"; REVOKE ALL ON SCHEMA pgcoord FROM "+role)
			})
			const heartbeat = 100 * time.Millisecond
			c := newTestClient(t, roleDSN, WithHeartbeat(heartbeat), WithLossDeadline(5*time.Second))
			ld, err := c.Election("resign-request").Campaign(ctx)
			if err != nil {
				t.Fatal(err)
			}
			listener := func() (pid int32) {
				_ = admin.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE usename = $1 AND query LIKE 'LISTEN%'`, role).Scan(&pid)
				return pid
			}
			pgtest.Eventually(t, testTimeout, "the leader's listener", func() bool { return listener() != 0 })
			if away {
				exec("ALTER ROLE " + role + " NOLOGIN")
				defer exec("ALTER ROLE " + role + " LOGIN")
			}
			if _, err := admin.Exec(ctx, "SELECT pg_terminate_backend($1)", listener()); err != nil {
				t.Fatal(err)
			}
			asked := time.Now()
			if err := newTestClient(t, dsn).Election("resign-request").RequestResign(ctx); err != nil {
				t.Fatal(err)
			}
			select {
			case <-ld.Context().Done():
			case <-time.After(testTimeout):
				t.Fatalf("the leader's context still live %v after RequestResign returned nil", testTimeout)
			}
			if !errors.Is(context.Cause(ld.Context()), ErrNotHeld) {
				t.Fatalf("the leadership ended with %v, want a resignation (ErrNotHeld)", context.Cause(ld.Context()))
			}
			if took := ld.cancelledAt().Sub(asked); took > time.Second {
				t.Fatalf("the leader stepped down %v after the request, want within 1 s", took)
			}
			if away && listener() != 0 {
				t.Fatal("the listener came back though its role may not log in")
			}
			var requested *int64
			if err := admin.QueryRow(ctx, "SELECT resign_term FROM pgcoord.leaders WHERE name = $1", "resign-request").Scan(&requested); err != nil {
				t.Fatal(err)
			}
			if requested == nil || *requested != int64(ld.Term()) {
				t.Fatalf("leaders.resign_term = %v, want the term %d", requested, ld.Term())
			}
		})
	}
}

// The listener's resync alone delivers a leader whose notification was
// lost: the observer's heartbeat (its periodic read) is a minute, longer
// than the test, so the leader that won while the observer's listener was
// kept away (its role may not log in) can only come through the resync
// when the listener is back, within 2 s of it listening again.
func TestObserveResyncDeliversMissedLeader(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	admin := pgtest.Conn(t, dsn)
	role, roleDSN := newTestRole(t, dsn, "resync")
	exec := func(sql string) {
		t.Helper()
		if _, err := admin.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	exec("GRANT USAGE ON SCHEMA pgcoord TO " + role)
	exec("GRANT SELECT ON pgcoord.leaders TO " + role)
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "REVOKE ALL ON pgcoord.leaders FROM "+role+"; REVOKE ALL ON SCHEMA pgcoord FROM "+role)
	})
	b := newTestClient(t, roleDSN, WithHeartbeat(time.Minute), WithLossDeadline(3*time.Minute))
	obs := b.Election("resync-only").Observe(ctx)
	if info := nextInfo(t, obs); info != (LeaderInfo{}) {
		t.Fatalf("first observation %+v, want no leader", info)
	}
	listener := func() (pid int32) {
		_ = admin.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE usename = $1 AND query LIKE 'LISTEN%'`, role).Scan(&pid)
		return pid
	}
	pgtest.Eventually(t, testTimeout, "the observer's listener", func() bool { return listener() != 0 })
	exec("ALTER ROLE " + role + " NOLOGIN")
	if _, err := admin.Exec(ctx, "SELECT pg_terminate_backend($1)", listener()); err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, testTimeout, "the listener's backend to end", func() bool { return listener() == 0 })
	a := newTestClient(t, dsn)
	la, err := a.Election("resync-only").Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	exec("ALTER ROLE " + role + " LOGIN")
	pgtest.Eventually(t, testTimeout, "the listener to listen again", func() bool { return listener() != 0 })
	back := time.Now()
	select {
	case info, ok := <-obs:
		if !ok || info.Term != la.Term() {
			t.Fatalf("observed %+v (channel open: %v), want the leader of term %d", info, ok, la.Term())
		}
	case <-time.After(2 * time.Second):
		t.Fatalf("the leader that won while the listener was away was not observed within 2 s of the listener listening again")
	}
	t.Logf("observed through the resync %v after the listener listened again", time.Since(back).Round(time.Millisecond))
	if err := la.Resign(ctx); err != nil {
		t.Fatal(err)
	}
}

// Close cancels a leader's context before it releases anything: the
// leader's context is cancelled (cause ErrClosed) as Close begins, by the
// library's own clock, and a candidate of another Client that takes over
// records its term (by the server's clock, on this machine) after that.
// Five rounds.
func TestCloseCancelsLeaderBeforeRelease(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	follower := newTestClient(t, dsn)
	for round := range 5 {
		a := newTestClient(t, dsn)
		la, err := a.Election("close-order").Campaign(ctx)
		if err != nil {
			t.Fatal(err)
		}
		won := make(chan *Leadership, 1)
		go func() {
			ld, err := follower.Election("close-order").Campaign(ctx)
			if err != nil {
				t.Error(err)
			}
			won <- ld
		}()
		pgtest.Eventually(t, testTimeout, "the follower to wait for the election", func() bool {
			return waitingOn(t, dsn, keyOf(la.e.key)) == 1
		})
		if err := a.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
		if cause := context.Cause(la.Context()); !errors.Is(cause, ErrClosed) {
			t.Fatalf("round %d: the leader's context ended with %v, want ErrClosed", round, cause)
		}
		a.core.Mu.Lock()
		began := a.core.ClosedAt
		a.core.Mu.Unlock()
		if at := la.cancelledAt(); at.IsZero() || at.After(began) {
			t.Fatalf("round %d: the leader's context was cancelled at %v, after Close began at %v", round, at, began)
		}
		next := <-won
		if next == nil {
			t.FailNow()
		}
		// Since is the server's clock, on this machine: when the
		// follower recorded its term, after the server freed the lock.
		if !la.cancelledAt().Before(next.Since()) {
			t.Fatalf("round %d: the follower's term began at %v, before the old leader's context was cancelled at %v", round, next.Since(), la.cancelledAt())
		}
		if err := next.Resign(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// Two resignations on request in a row leave no gap: the first leader
// yields until a later term has won, and that term's leader is asked to
// resign as soon as it starts. Whether or not the first saw it lead, a
// leader starts within 1 s (the loss deadline is 5 s: a candidate that
// waited for a leader that came and went would wait it out). Ten rounds.
func TestRunAfterTwoResignRequestsLeavesNoGap(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	type start struct {
		term Term
		at   time.Time
	}
	starts := make(chan start, 100)
	runCtx, stop := context.WithCancel(ctx)
	var running sync.WaitGroup
	defer func() { stop(); running.Wait() }()
	for _, who := range []string{"a", "b"} {
		e := newTestClient(t, dsn, WithLossDeadline(5*time.Second)).Election("no-gap", WithIdentity(who))
		running.Go(func() {
			_ = e.Run(runCtx, func(lctx context.Context, term Term) error {
				starts <- start{term, time.Now()}
				<-lctx.Done()
				return nil
			})
		})
	}
	outsider := newTestClient(t, dsn).Election("no-gap")
	next := func() start {
		t.Helper()
		select {
		case s := <-starts:
			return s
		case <-time.After(testTimeout):
			t.Fatalf("no leader started within %v", testTimeout)
		}
		return start{}
	}
	last := next()
	for round := range 10 {
		for range 2 {
			if err := outsider.RequestResign(ctx); err != nil {
				t.Fatal(err)
			}
			asked := time.Now()
			s := next()
			if s.term <= last.term {
				t.Fatalf("round %d: term %d started after term %d", round, s.term, last.term)
			}
			if gap := s.at.Sub(asked); gap > time.Second {
				t.Fatalf("round %d: the next leader started %v after the resign request, want within 1 s", round, gap)
			}
			last = s
		}
	}
}

// Observe on a database without the tables of Migrate says so, once,
// then keeps trying: after Migrate it reports that nobody leads, then the
// leader.
func TestObserveReportsNotMigrated(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn, WithHeartbeat(50*time.Millisecond))
	obs := c.Election("early").Observe(ctx)
	if info := nextInfo(t, obs); !errors.Is(info.Err, ErrNotMigrated) || info.Term != 0 {
		t.Fatalf("first observation %+v, want an error wrapping ErrNotMigrated", info)
	}
	if err := c.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if info := nextInfo(t, obs); info != (LeaderInfo{}) {
		t.Fatalf("observation after Migrate %+v, want no leader and no error", info)
	}
	ld, err := c.Election("early").Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info := nextInfo(t, obs); info.Term != ld.Term() || info.Err != nil {
		t.Fatalf("observation %+v, want the leader of term %d", info, ld.Term())
	}
	if err := ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
}

// A follower prepares and plans the record statement on the backend it
// waits on, with its own arguments, while it waits: the server accepts the
// plan (an error there would silently leave the takeover's record to read
// the tables' metadata first), and the backend that wins records the term
// with that statement.
func TestCampaignPlansRecordWhileFollowing(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	a := newTestClient(t, dsn)
	b := newTestClient(t, dsn)
	la, err := a.Election("plans-record").Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	eb := b.Election("plans-record")
	won := make(chan *Leadership, 1)
	go func() {
		lb, err := eb.Campaign(ctx)
		if err != nil {
			t.Error(err)
		}
		won <- lb
	}()
	pgtest.Eventually(t, testTimeout, "b's campaign to wait on the server", func() bool { return waitingOn(t, dsn, eb.Key()) == 1 })
	sql := recordSQL(b.core.Cfg)
	planned := func() (n int) {
		b.core.Mu.Lock()
		var sessions []*core.Session
		for s := range b.core.Sessions {
			sessions = append(sessions, s)
		}
		b.core.Mu.Unlock()
		for _, s := range sessions {
			if s.Grab(ctx) != nil {
				continue
			}
			if s.Planned[sql] {
				n++
			}
			s.Release()
		}
		return n
	}
	if n := planned(); n != 1 {
		t.Fatalf("%d of b's backends planned the record statement, want 1: the one its campaign waits on", n)
	}
	if err := la.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	var lb *Leadership
	select {
	case lb = <-won:
	case <-time.After(testTimeout):
		t.Fatalf("b's campaign did not lead within %v of a's resignation", testTimeout)
	}
	if lb.Term() <= la.Term() {
		t.Fatalf("b leads term %d, want more than a's %d", lb.Term(), la.Term())
	}
	info, err := eb.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Term != lb.Term() || info.PID != lb.lock.S.PID() {
		t.Fatalf("leaders row: term %d, pid %d; want b's term %d on its lock's backend %d", info.Term, info.PID, lb.Term(), lb.lock.S.PID())
	}
	if err := lb.Resign(ctx); err != nil {
		t.Fatal(err)
	}
}

// Valid answers from local state whether the leadership holds: nil while
// leading (in Run's fn too, through LeadershipFromContext), an error
// wrapping ErrLockLost once the leader's backend is gone, and the
// context's cause after the end. Once the server has not answered on the
// leader's connections for the loss deadline, it fails even before the
// Client's own timers have noticed (a process resumed after a pause): the
// test ages the lock session's last answer instead of pausing a process.
func TestLeadershipValid(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := faultDB(t)
	c := newTestClient(t, dsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
	e := c.Election("valid")
	if _, ok := LeadershipFromContext(ctx); ok {
		t.Fatal("LeadershipFromContext of a plain context: ok, want not ok")
	}
	ran := make(chan error, 1)
	runCtx, stopRun := context.WithCancel(ctx)
	runErr := make(chan error, 1)
	go func() {
		runErr <- e.Run(runCtx, func(lctx context.Context, term Term) error {
			defer stopRun() // one term is enough
			ld, ok := LeadershipFromContext(lctx)
			switch {
			case !ok || ld.Term() != term:
				ran <- core.Errorf("LeadershipFromContext(fn's ctx) = %v, %v; want the term %d leadership", ld, ok, term)
			case ld.Valid() != nil:
				ran <- core.Errorf("Valid while leading: %w", ld.Valid())
			default:
				ran <- nil
			}
			return nil
		})
	}()
	select {
	case err := <-ran:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(testTimeout):
		t.Fatal("Run's fn did not run")
	}
	if err := <-runErr; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run = %v, want its ctx's error", err)
	}

	ld, err := e.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ld.Valid(); err != nil {
		t.Fatalf("Valid while leading: %v", err)
	}
	// A pause longer than the loss deadline, as the session sees it: its
	// last answer is older than L, and nothing has run since.
	s := ld.lock.S
	s.State.Lock()
	saved := s.LastOK
	s.LastOK = time.Now().Add(-2 * time.Second)
	s.State.Unlock()
	err = ld.Valid()
	s.State.Lock()
	if s.LastOK.Before(saved) {
		s.LastOK = saved
	}
	s.State.Unlock()
	if !errors.Is(err, ErrLockLost) {
		t.Fatalf("Valid with no answer for 2 s (L = 1 s) = %v, want ErrLockLost", err)
	}
	if ld.Context().Err() != nil {
		t.Log("the Client's timers noticed first; Valid agreed")
	}

	terminateBackend(t, pool, ld.lock.S.PID())
	pgtest.Eventually(t, testTimeout, "Valid to fail after the leader's backend was terminated", func() bool {
		return errors.Is(ld.Valid(), ErrLockLost)
	})
	<-ld.Done()
	if err := ld.Valid(); err == nil {
		t.Fatal("Valid after the leadership ended: nil")
	}
}
