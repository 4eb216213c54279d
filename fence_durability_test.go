package pgcoord

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// crashAttempts bounds how often a crash test retries an inconclusive
// attempt: one in which the WAL writer happened to flush between the fence
// and the crash, so that even an unflushed fence would have survived.
const crashAttempts = 3

// lazyWALServer returns a private server, with a migrated database (its
// connection string is returned), on which a commit does not wait for its
// WAL to be flushed: synchronous_commit is off for the server, the database
// or the role the test connects as, as level says. The WAL writer flushes
// only every 10 s, so a crash (SIGKILL) soon after such a commit loses it.
// The settings take effect through a restart, so that the WAL writer surely
// runs with its new delay; a fresh connection is checked to see both.
func lazyWALServer(t *testing.T, ctx context.Context, level string) (*pgtest.Server, string) {
	t.Helper()
	srv := pgtest.NewServer(t)
	dsn := srv.DB(t)
	pool := migrated(t, dsn)
	var setting string
	switch level {
	case "server":
		setting = "ALTER SYSTEM SET synchronous_commit = off"
	case "database":
		var db string
		if err := pool.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
			t.Fatal(err)
		}
		setting = "ALTER DATABASE " + pgx.Identifier{db}.Sanitize() + " SET synchronous_commit = off"
	case "role":
		setting = "ALTER ROLE CURRENT_USER SET synchronous_commit = off"
	default:
		t.Fatalf("unknown level %q", level)
	}
	for _, sql := range []string{
		"CREATE TABLE unflushed (attempt int NOT NULL)",
		"ALTER SYSTEM SET wal_writer_delay = '10s'",
		setting,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	pool.Reset() // its connections die with the restart
	srv.Restart(t)

	conn := pgtest.Conn(t, dsn)
	for name, want := range map[string]string{"synchronous_commit": "off", "wal_writer_delay": "10s"} {
		var got string
		if err := conn.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Fatalf("after %q and a restart, %s = %q on a fresh connection, want %q", setting, name, got, want)
		}
	}
	return srv, dsn
}

// storedFence reads the fence stored for k, or 0 when the fences table has
// no row for k.
func storedFence(t *testing.T, ctx context.Context, conn *pgx.Conn, k Key) int64 {
	t.Helper()
	space, key := core.FenceRow(k.coreKey())
	var fence int64
	err := conn.QueryRow(ctx, "SELECT coalesce((SELECT fence FROM "+pgx.Identifier{DefaultSchema, "fences"}.Sanitize()+
		" WHERE key_space = $1 AND key = $2), 0)", space, key).Scan(&fence)
	if err != nil {
		t.Fatal(err)
	}
	return fence
}

// issueThenCrash calls issue, which issues a fence for k on a fresh
// connection to dsn and returns it. Right after, it commits a marker row
// with synchronous_commit off, kills srv with SIGKILL, waits for crash
// recovery, and checks that the fences table holds exactly the issued
// fence. Only the WAL writer (every 10 s) or a commit that waits for a
// flush writes the marker's commit out, so when the marker survived too,
// the attempt cannot tell a durable fence from a lucky one and it is
// repeated, at most crashAttempts times. It returns the last issued fence.
func issueThenCrash(t *testing.T, ctx context.Context, srv *pgtest.Server, dsn string, k Key, issue func() int64) int64 {
	t.Helper()
	for attempt := 1; ; attempt++ {
		marker := pgtest.Conn(t, dsn)
		before := storedFence(t, ctx, marker, k)
		fence := issue()
		if fence <= before {
			t.Fatalf("attempt %d: issued fence %d, not above the stored %d", attempt, fence, before)
		}
		if _, err := marker.Exec(ctx, "INSERT INTO unflushed VALUES ($1)", attempt); err != nil {
			t.Fatal(err)
		}
		srv.Crash(t)

		check := pgtest.Conn(t, dsn)
		if got := storedFence(t, ctx, check, k); got != fence {
			t.Fatalf("attempt %d: after a crash the fences table holds %d for %v, want %d, the fence that was issued and returned: "+
				"the next holder would get fence %d again and a paused holder of it would pass CheckFence", attempt, got, k, fence, got+1)
		}
		var survived bool
		if err := check.QueryRow(ctx, "SELECT EXISTS (SELECT FROM unflushed WHERE attempt = $1)", attempt).Scan(&survived); err != nil {
			t.Fatal(err)
		}
		if !survived {
			return fence // the crash lost an unflushed commit, and not the fence
		}
		if attempt == crashAttempts {
			t.Fatalf("in %d attempts the crash never lost a commit made with synchronous_commit off: the test cannot tell whether the fence was flushed", attempt)
		}
		t.Logf("attempt %d: the WAL was flushed before the crash; trying again", attempt)
	}
}

// A fence that nextFence returned survives a crash that comes right after,
// although synchronous_commit is off for the server, the database or the
// role: a crash must never make the same fence be issued twice.
func TestNextFenceSurvivesCrashWithSynchronousCommitOff(t *testing.T) {
	t.Parallel()
	for _, level := range []string{"server", "database", "role"} {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			srv, dsn := lazyWALServer(t, ctx, level)
			c := mustFenceConfig(t)
			k := HashKey("durable", "fence", level)

			fence := issueThenCrash(t, ctx, srv, dsn, k, func() int64 {
				return mustNextFence(t, ctx, pgtest.Conn(t, dsn), c, k)
			})
			if next := mustNextFence(t, ctx, pgtest.Conn(t, dsn), c, k); next != fence+1 {
				t.Fatalf("first fence after the crash = %d, want %d", next, fence+1)
			}
		})
	}
}

// The same through the public API: a holder's fence from Lock with
// WithFence survives a crash with synchronous_commit off for the database,
// so after the crash the next holder gets a newer fence and the old
// holder's late write is refused.
func TestFencedLockSurvivesCrashWithSynchronousCommitOff(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	srv, dsn := lazyWALServer(t, ctx, "database")
	k := HashKey("durable", "lock")

	fence := issueThenCrash(t, ctx, srv, dsn, k, func() int64 {
		l, err := newTestClient(t, dsn).Lock(ctx, k, WithFence())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { awaitEnd(t, l, "the crash ends the lock") })
		return int64(l.Fence())
	})

	l, err := newTestClient(t, dsn).Lock(ctx, k, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	if l.Fence() <= Term(fence) {
		t.Fatalf("fence after the crash = %d, not above the %d issued before it", l.Fence(), fence)
	}
	pool := pgtest.Pool(t, dsn)
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return CheckFence(ctx, tx, k, Term(fence)) })
	if !errors.Is(err, ErrStaleFence) {
		t.Fatalf("CheckFence with the fence %d issued before the crash = %v, want ErrStaleFence", fence, err)
	}
	mustUnlock(t, l)
}

// Inside a transaction, nextFence makes that transaction's commit wait for
// its WAL flush: synchronous_commit becomes on, whatever it was, except
// that remote_apply, which waits for the flush too, stays. The setting ends
// with the transaction.
func TestNextFenceInTransactionCommitsSynchronously(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := migratedPool(t, ctx, DefaultSchema)
	conn := pgtest.Conn(t, dsn)
	c := mustFenceConfig(t)
	k := HashKey("durable", "tx")
	setting := func() string {
		t.Helper()
		var s string
		if err := conn.QueryRow(ctx, "SELECT current_setting('synchronous_commit')").Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	if _, err := conn.Exec(ctx, "SET synchronous_commit = off"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ local, want string }{
		{"off", "on"},
		{"local", "on"},
		{"remote_write", "on"},
		{"on", "on"},
		{"remote_apply", "remote_apply"},
	} {
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SET LOCAL synchronous_commit = "+tc.local); err != nil {
			t.Fatal(err)
		}
		mustNextFence(t, ctx, tx, c, k)
		if got := setting(); got != tc.want {
			t.Fatalf("synchronous_commit %s, after nextFence in the transaction: %q, want %q", tc.local, got, tc.want)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if got := setting(); got != "off" {
			t.Fatalf("after the commit, synchronous_commit = %q, want the session's off", got)
		}
	}
}

// With a synchronous standby, no token is handed out before the standby
// has it. The primary's WAL senders are stopped (SIGSTOP), so the standby
// receives nothing while a term (Campaign) and fences (Lock with
// WithFence: one issued on the lock's backend, one that first waits for a
// CheckFence transaction's row) are issued. Each commit then waits for the
// standby until the wait slice cancels it, which PostgreSQL answers with
// success and a warning; none of the calls may return meanwhile (the
// primary's fences rows show each token issued again, and commits waiting
// in SyncRep), and a call whose ctx ends returns an error and leaves its
// key free. Once the WAL senders resume, the calls return; after the
// primary is killed and the standby promoted, every token handed out is
// there, and the next ones issued are greater.
func TestTokensWaitForSynchronousStandby(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	primary, standby, pdsn, sdsn := migratedWithSyncStandby(t)

	opts := []Option{WithHeartbeat(100 * time.Millisecond), WithLossDeadline(time.Second)}
	c := newTestClient(t, pdsn, opts...)
	e := c.Election("durable-sync")
	kA, kB, kD := HashKey("durable", "sync", "a"), HashKey("durable", "sync", "b"), HashKey("durable", "sync", "d")

	// Tokens issued while the standby receives WAL.
	fence := func(k Key) Term {
		t.Helper()
		l, err := c.Lock(ctx, k, WithFence())
		if err != nil {
			t.Fatal(err)
		}
		mustUnlock(t, l)
		return l.Fence()
	}
	a0, b0 := fence(kA), fence(kB)
	ld0, err := e.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t0 := ld0.Term()
	if err := ld0.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	pconn, sconn := pgtest.Conn(t, pdsn), pgtest.Conn(t, sdsn)
	// A transaction that checked kB's fence keeps its row share-locked, so
	// kB's next fence waits for it, then goes on while the standby stalls.
	checker := pgtest.Conn(t, pdsn)
	tx, err := checker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := CheckFence(ctx, tx, kB, b0); err != nil {
		t.Fatal(err)
	}

	// Each token comes through a Client of its own: on one backend, token
	// statements run one at a time, and each would wait for the first.
	cA, cB, cE, cD := newTestClient(t, pdsn, opts...), newTestClient(t, pdsn, opts...), newTestClient(t, pdsn, opts...), newTestClient(t, pdsn, opts...)
	resume := primary.PauseWALSenders(t)
	lockA := goLock(func() (*Lock, error) { return cA.Lock(ctx, kA, WithFence()) })
	lockB := goLock(func() (*Lock, error) { return cB.Lock(ctx, kB, WithFence()) })
	type won struct {
		ld  *Leadership
		err error
	}
	campaign := make(chan won, 1)
	go func() {
		ld, err := cE.Election(e.Name()).Campaign(ctx)
		campaign <- won{ld, err}
	}()
	short, cancelShort := context.WithTimeout(ctx, 3*time.Second)
	defer cancelShort()
	lockD := goLock(func() (*Lock, error) { return cD.Lock(short, kD, WithFence()) })

	// handed fails the test: a token came back that the standby lacks.
	handed := func(what string, k Key, token Term, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s returned %v while the synchronous standby received no WAL, want it to wait", what, err)
		}
		t.Fatalf("%s returned token %d while the synchronous standby received no WAL: the standby holds %d for its key, "+
			"so a failover would issue %d again", what, token, storedFence(t, ctx, sconn, k), token)
	}
	// The fence waits longer than a glance on the lock's backend, so it
	// waits on another backend of the Client, in slices.
	space, key := core.FenceRow(kB.coreKey())
	pgtest.Eventually(t, testTimeout, "kB's fence waits for the CheckFence transaction away from the lock's backend", func() bool {
		var n int
		err := pconn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%fences%'
			AND pid NOT IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted
				AND objsubid = $1 AND ((classid::int8 << 32) | objid::int8) = $2)`, space, key).Scan(&n)
		return err == nil && n > 0
	})
	if err := tx.Rollback(ctx); err != nil { // a rollback waits for no standby
		t.Fatal(err)
	}
	var ld *Leadership
	var lA, lB *Lock
	dDone := false
	if !pgtest.Poll(testTimeout, func() bool {
		select {
		case r := <-lockA:
			handed("Lock(kA, WithFence)", kA, fenceOf(r.l), r.err)
		case r := <-lockB:
			handed("Lock(kB, WithFence)", kB, fenceOf(r.l), r.err)
		case w := <-campaign:
			var term Term
			if w.ld != nil {
				term = w.ld.Term()
			}
			handed("Campaign", e.Key(), term, w.err)
		case r := <-lockD:
			dDone = true
			if r.err == nil {
				handed("Lock(kD, WithFence) with a 3 s ctx", kD, r.l.Fence(), nil)
			}
			if !errors.Is(r.err, context.DeadlineExceeded) {
				t.Fatalf("Lock(kD, WithFence) whose ctx ended while the standby stalled: %v, want context.DeadlineExceeded", r.err)
			}
			t.Logf("Lock(kD) with a 3 s ctx: %v", r.err)
		default:
		}
		// Each token was issued, withheld and issued again.
		return dDone && storedFence(t, ctx, pconn, kA) >= int64(a0)+2 && storedFence(t, ctx, pconn, kB) >= int64(b0)+2 &&
			storedFence(t, ctx, pconn, e.Key()) >= int64(t0)+2
	}) {
		t.Fatalf("while the standby stalled, the primary's fences did not show each token issued again: kA %d (before %d), kB %d (before %d), term %d (before %d); Lock(kD) returned: %v",
			storedFence(t, ctx, pconn, kA), a0, storedFence(t, ctx, pconn, kB), b0, storedFence(t, ctx, pconn, e.Key()), t0, dDone)
	}
	waiting := primary.WaitEvents(t, "SyncRep")
	if waiting == 0 {
		t.Fatal("no commit waits for the synchronous standby (pg_stat_activity, SyncRep) while its WAL senders are stopped")
	}
	notHeld(t, pdsn, kD)
	t.Logf("while the standby stalled: %d commits waiting in SyncRep; on the primary kA %d (before %d), kB %d (before %d), term %d (before %d); the standby holds kA %d, kB %d, term %d",
		waiting, storedFence(t, ctx, pconn, kA), a0, storedFence(t, ctx, pconn, kB), b0, storedFence(t, ctx, pconn, e.Key()), t0,
		storedFence(t, ctx, sconn, kA), storedFence(t, ctx, sconn, kB), storedFence(t, ctx, sconn, e.Key()))

	resumed := time.Now()
	resume()
	for _, r := range []struct {
		what string
		res  result
		l    **Lock
	}{{"kA", receive(t, lockA), &lA}, {"kB", receive(t, lockB), &lB}} {
		if r.res.err != nil {
			t.Fatalf("Lock(%s, WithFence) after the standby resumed: %v", r.what, r.res.err)
		}
		*r.l = r.res.l
	}
	select {
	case w := <-campaign:
		if w.err != nil {
			t.Fatalf("Campaign after the standby resumed: %v", w.err)
		}
		ld = w.ld
	case <-ctx.Done():
		t.Fatal("Campaign did not return after the standby resumed")
	}
	t.Logf("after the WAL senders resumed, the calls returned within %v: fence kA %d, kB %d, term %d",
		time.Since(resumed).Round(time.Millisecond), lA.Fence(), lB.Fence(), ld.Term())
	if lA.Fence() <= a0 || lB.Fence() <= b0 || ld.Term() <= t0 {
		t.Fatalf("tokens after the stall: kA %d, kB %d, term %d; want above %d, %d, %d", lA.Fence(), lB.Fence(), ld.Term(), a0, b0, t0)
	}

	// Failover to the standby, with nothing more sent to it.
	failOver(t, ctx, primary, standby, c, cA, cB, cE, cD)
	for _, h := range []struct {
		what  string
		k     Key
		token Term
	}{{"kA's fence", kA, lA.Fence()}, {"kB's fence", kB, lB.Fence()}, {"the term", e.Key(), ld.Term()}} {
		if got := storedFence(t, ctx, sconn, h.k); Term(got) < h.token {
			t.Fatalf("%s %d was handed out, but the promoted standby holds only %d", h.what, h.token, got)
		}
	}
	var recorded int64
	if err := sconn.QueryRow(ctx, "SELECT term FROM pgcoord.leaders WHERE name = $1", e.Name()).Scan(&recorded); err != nil {
		t.Fatal(err)
	}
	if Term(recorded) < ld.Term() {
		t.Fatalf("the promoted standby's leaders row holds term %d, below the handed-out %d", recorded, ld.Term())
	}
	c2 := newTestClient(t, sdsn, opts...)
	nl, err := c2.Lock(ctx, kA, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	if nl.Fence() <= lA.Fence() {
		t.Fatalf("fence %d on the promoted standby, not above %d from before", nl.Fence(), lA.Fence())
	}
	err = pgx.BeginFunc(ctx, pgtest.Pool(t, sdsn), func(tx pgx.Tx) error { return CheckFence(ctx, tx, kA, lA.Fence()) })
	if !errors.Is(err, ErrStaleFence) {
		t.Fatalf("CheckFence with fence %d from the old primary: %v, want ErrStaleFence", lA.Fence(), err)
	}
	mustUnlock(t, nl)
	nld, err := c2.Election("durable-sync").Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if nld.Term() <= ld.Term() {
		t.Fatalf("term %d on the promoted standby, not above %d from before", nld.Term(), ld.Term())
	}
	if err := nld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
}

// fenceOf returns l's fence, 0 for no lock.
func fenceOf(l *Lock) Term {
	if l == nil {
		return 0
	}
	return l.Fence()
}

// migratedWithSyncStandby starts a server of the test's own with a migrated
// database and a synchronous standby that has confirmed it receives WAL,
// and returns both servers and the database's connection strings on each.
func migratedWithSyncStandby(t *testing.T) (primary, standby *pgtest.Server, pdsn, sdsn string) {
	t.Helper()
	primary = pgtest.NewServer(t)
	pdsn = primary.DB(t)
	migrated(t, pdsn)
	cfg, err := pgx.ParseConfig(pdsn)
	if err != nil {
		t.Fatal(err)
	}
	standby = primary.StartStandby(t)
	sdsn = standby.ConnString(cfg.Database)
	primary.RequireSynchronousStandby(t)
	return primary, standby, pdsn, sdsn
}

// failOver closes clients, whose locks are on primary, so that their
// releases are confirmed (a Client closed after the kill could not
// confirm them), then kills primary and promotes standby: what a test
// checks after the failover is what the standby holds.
func failOver(t *testing.T, ctx context.Context, primary, standby *pgtest.Server, clients ...*Client) {
	t.Helper()
	for _, c := range clients {
		if err := c.Close(ctx); err != nil {
			t.Fatalf("Close before the failover: %v", err)
		}
	}
	primary.Kill(t)
	standby.Promote(t)
}
