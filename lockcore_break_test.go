package pgcoord

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"go.uber.org/goleak"
)

// waitsNotGranted reports how many lock requests of backend pid wait (not
// granted) in pg_locks, of the given locktype ("" for any).
func waitsNotGranted(t testing.TB, conn *pgx.Conn, pid int32, locktype string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var n int
	err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_locks
		WHERE pid = $1 AND NOT granted AND ($2 = '' OR locktype = $2)`, pid, locktype).Scan(&n)
	if err != nil {
		t.Fatalf("read pg_locks: %v", err)
	}
	return n
}

type errResult struct {
	err error
	at  time.Time
}

// Promise (doc.go, "Locks that live as long as a connection"; backends.go):
// no goroutine sees ErrDeadlock unless its application has a lock cycle.
//
// Here there is none: goroutine A holds X; the application's write
// transaction T checked Y's fence (it holds the fence row) and then wants X,
// so it waits for A; goroutine C takes Y with WithFence, so its fence waits
// for T. A waits for nothing, so everybody gets through once A unlocks. But
// C's fence runs on the shared backend that holds A's X, and to PostgreSQL
// that backend holds X and waits for T, which waits for X: a cycle.
func TestFenceWaitSeesNoDeadlockWithoutCycle(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := migratedPool(t, ctx, DefaultSchema)
	c := newTestClientOn(t, pool, WithSharedBackends(1))
	x, y := Int64Key(7001), Int64Key(7002)

	// A fence exists for Y: an earlier holder took it with a fence.
	first, err := c.Lock(ctx, y, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	oldFence := first.Fence()
	mustUnlock(t, first)

	// Goroutine A holds X.
	lx, err := c.Lock(ctx, x)
	if err != nil {
		t.Fatal(err)
	}
	b1 := lx.s.PID()

	// The application's write transaction checks Y's fence.
	obs := pgtest.Conn(t, dsn)
	tconn := pgtest.Conn(t, dsn)
	tx, err := tconn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// T's statements run on one goroutine at a time: the cleanup lets A's
	// X go, waits for T's XactLock to return, then rolls T back.
	tch := make(chan errResult, 1)
	tStarted := false
	t.Cleanup(func() {
		if tStarted {
			if lx.Err() == nil {
				_ = lx.Unlock(context.Background())
			}
			select {
			case r := <-tch:
				tch <- r
			case <-time.After(testTimeout):
			}
		}
		_ = tx.Rollback(context.Background())
	})
	if err := CheckFence(ctx, tx, y, oldFence); err != nil {
		t.Fatal(err)
	}

	// Goroutine C takes Y with a fence: the fence waits for T.
	cch := make(chan result, 1)
	go func() {
		l, err := c.Lock(ctx, y, WithFence())
		cch <- result{l, err}
	}()
	// The fence waits for T's row: first on the shared backend, then, if
	// T has not ended within a glance, on a backend of C's Client that
	// holds nothing. Either way a backend of the Client waits for a lock.
	pgtest.Eventually(t, 10*time.Second, "C's fence to wait for T", func() bool {
		var n int
		err := obs.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'pgcoord' AND wait_event_type = 'Lock'`).Scan(&n)
		if err != nil {
			t.Fatalf("read pg_stat_activity: %v", err)
		}
		return n > 0
	})

	// T now wants X, which A holds: T waits for A.
	tStarted = true
	go func() {
		err := XactLock(ctx, tx, x)
		tch <- errResult{err, time.Now()}
	}()
	pgtest.Eventually(t, 10*time.Second, "T to wait for X", func() bool {
		return waitingOn(t, dsn, x) == 1
	})

	// Nobody may see a deadlock. Wait three deadlock_timeouts (1s each by
	// default) for an error that must not come.
	var cRes *result
	var tRes *errResult
	select {
	case r := <-cch:
		cRes = &r
	case r := <-tch:
		tRes = &r
	case <-time.After(3 * time.Second):
	}
	if cRes != nil && cRes.err != nil {
		t.Fatalf("broken promise: goroutine C's Lock(Y, WithFence) failed with %v (ErrDeadlock: %v) although no goroutine or transaction has a lock cycle: "+
			"C waits for T, T waits for A, A waits for nothing. C's fence ran on the shared backend %d that holds A's X, so the server saw that backend hold X and wait for T, and T wait for X",
			cRes.err, errors.Is(cRes.err, ErrDeadlock), b1)
	}
	if tRes != nil && tRes.err != nil {
		t.Fatalf("broken promise: the application's XactLock(X) in T failed with %v (ErrDeadlock: %v) although nobody has a lock cycle: "+
			"C's fence ran on the shared backend %d that holds A's X, so the server saw that backend hold X and wait for T",
			tRes.err, errors.Is(tRes.err, ErrDeadlock), b1)
	}
	if cRes != nil {
		t.Fatalf("C got Y before T ended: %+v", cRes)
	}

	// No deadlock: A unlocks, T gets X and commits, C gets its fence.
	mustUnlock(t, lx)
	var tr errResult
	if tRes != nil {
		tr = *tRes
	} else {
		select {
		case tr = <-tch:
		case <-time.After(testTimeout):
			t.Fatal("T did not get X after A unlocked it")
		}
	}
	tStarted = false // T's XactLock has returned: nothing for the cleanup to wait for
	if tr.err != nil {
		t.Fatalf("T's XactLock: %v", tr.err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	cr := receive(t, cch)
	if cr.err != nil {
		t.Fatalf("C's Lock: %v", cr.err)
	}
	if cr.l.Fence() <= oldFence {
		t.Fatalf("C's fence %d is not newer than %d", cr.l.Fence(), oldFence)
	}
	mustUnlock(t, cr.l)
}

// campaignBlockedByTableLock holds X on the only shared backend of a
// Client and starts a campaign of an election on the same Client while a
// transaction holds pgcoord's tables in ACCESS EXCLUSIVE mode (a migration,
// a VACUUM FULL, an operator's LOCK TABLE). It returns once the campaign's
// statement waits on that backend.
func campaignBlockedByTableLock(t *testing.T, ctx context.Context, opts ...Option) (c *Client, lx *Lock, obs *pgx.Conn, release func()) {
	t.Helper()
	dsn, pool := migratedPool(t, ctx, DefaultSchema)
	c = newTestClientOn(t, pool, append([]Option{WithSharedBackends(1)}, opts...)...)
	x := Int64Key(7101)
	lx, err := c.Lock(ctx, x)
	if err != nil {
		t.Fatal(err)
	}
	b1 := lx.s.PID()
	obs = pgtest.Conn(t, dsn)

	locker := pgtest.Conn(t, dsn)
	tx, err := locker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `LOCK TABLE pgcoord.fences, pgcoord.leaders IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	unlockTables := func() { once.Do(func() { _ = tx.Rollback(context.Background()) }) }
	t.Cleanup(unlockTables)

	cctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		ld, err := c.Election("break").Campaign(cctx)
		if err == nil {
			_ = ld.Resign(context.Background())
		}
	}()
	release = func() {
		cancel()
		unlockTables()
		select {
		case <-done:
		case <-time.After(testTimeout):
			t.Error("campaign did not end")
		}
	}
	t.Cleanup(release)
	pgtest.Eventually(t, 10*time.Second, "the campaign's statement to wait for the table lock on the shared backend", func() bool {
		return waitsNotGranted(t, obs, b1, "relation") > 0
	})
	return c, lx, obs, release
}

// Promise (backends.go): every blocking statement, on any backend, runs in
// slices, so a backend that holds locks answers within its wait slice and
// another statement that needs it (an Unlock) runs first.
//
// A campaign prepares its statement on the shared backend (withPrepared,
// Session.prepare) in one plain statement, not in slices: when pgcoord's
// tables are locked, it waits there with lock_timeout 0, and the Unlock of
// another goroutine's lock on that backend waits behind it.
func TestUnlockAnswersWithinSliceWhileCampaignPrepareWaits(t *testing.T) {
	ctx := testCtx(t)
	c, lx, _, release := campaignBlockedByTableLock(t, ctx, WithLossDeadline(2*time.Second), WithHeartbeat(500*time.Millisecond))
	slice := c.cfg.waitSlice()
	start := time.Now()
	err := lx.Unlock(ctx)
	took := time.Since(start)
	release()
	bound := slice + 500*time.Millisecond
	if err != nil || took > bound {
		t.Fatalf("broken promise: Unlock of a lock on a backend where a campaign's statement waits took %v (bound: the wait slice %v + 500ms) and returned %v; "+
			"the campaign's Session.prepare runs as one unsliced statement on the shared backend while pgcoord's tables are locked", took.Round(time.Millisecond), slice, err)
	}
}

// Promise (doc.go, backends.go): no goroutine's lock is lost because of
// another's wait; a backend's locks keep their loss deadline while another
// statement waits on it.
//
// The campaign's unsliced prepare on the shared backend keeps it from
// answering for longer than the loss deadline, so the session declares
// every lock on it lost.
func TestLockSurvivesCampaignPrepareWaitingOnSameBackend(t *testing.T) {
	ctx := testCtx(t)
	const loss, hb = 2 * time.Second, 500 * time.Millisecond
	_, lx, _, _ := campaignBlockedByTableLock(t, ctx, WithLossDeadline(loss), WithHeartbeat(hb))
	// Two campaign rounds (each L long): a lock that survives them survives.
	select {
	case <-lx.Done():
		t.Fatalf("broken promise: goroutine A's lock on the shared backend was lost (%v) while another goroutine's campaign waited on the same backend: "+
			"Session.prepare runs unsliced with lock_timeout 0, so the backend answers nothing for longer than the loss deadline %v", lx.Err(), loss)
	case <-time.After(2*loss + 2*hb):
	}
	mustUnlock(t, lx)
}

// Promise (RLock's doc): a waiting writer is not starved; readers of one
// Client join each other's hold without asking the server only for a
// short while after it was taken (the bounds of WithHandoff).
//
// TryRLock readers of a Client with one shared backend join its hold of the
// key whatever its age (route returns the holder for a try, and needs skips
// the joinable check for tries), so overlapping readers keep the key on
// the server forever and a writer of another process never gets it.
func TestTryRLockReadersDoNotStarveWaitingWriter(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn, WithSharedBackends(1))
	k := Int64Key(7201)
	kv, _ := k.Int64()

	cur, err := c.TryRLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	// A writer of another process waits for the key.
	wconn := pgtest.Conn(t, dsn)
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	wch := make(chan errResult, 1)
	go func() {
		_, err := wconn.Exec(wctx, "SELECT pg_advisory_lock($1)", kv)
		wch <- errResult{err, time.Now()}
	}()
	pgtest.Eventually(t, 10*time.Second, "writer waits", func() bool { return waitingOn(t, dsn, k) == 1 })
	queued := time.Now()

	// Readers keep coming, each overlapping the one before it.
	const stream = 3 * time.Second
	reads, refused := 0, false
	var writer *errResult
	for time.Since(queued) < stream && writer == nil {
		next, err := c.TryRLock(ctx, k)
		if errors.Is(err, ErrLocked) {
			refused = true
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		reads++
		mustUnlock(t, cur)
		cur = next
		select {
		case r := <-wch:
			writer = &r
		default:
		}
	}
	stillWaiting := writer == nil && waitingOn(t, dsn, k) == 1
	mustUnlock(t, cur)
	var w errResult
	if writer != nil {
		w = *writer
	} else {
		w = <-wch
	}
	if w.err == nil {
		if _, err := wconn.Exec(ctx, "SELECT pg_advisory_unlock($1)", kv); err != nil {
			t.Fatal(err)
		}
	}
	if stillWaiting && !refused {
		t.Fatalf("broken promise: a writer waited %v behind %d TryRLock readers of one Client that arrived after it (the first was taken long before the handoff window %v): "+
			"each joined the backend's shared hold without asking the server, so the key never became free for the writer",
			stream, reads, c.cfg.handoffWindow)
	}
	t.Logf("%d reads after the writer queued; refused: %v", reads, refused)
}

// Promise (Session.Close): ctx bounds Close; if ctx ends first, Close closes
// the socket instead and returns an error.
//
// On a silent network, Close's pg_advisory_unlock_all() is cut by ctx only
// through the cancel handler, which waits the loss deadline after the
// cancel before the socket's deadline ends the statement.
func TestSessionCloseBoundedByCtxOnSilentNetwork(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	proxy := pgtest.NewProxy(t, dsn)
	const loss, hb = 4 * time.Second, 2 * time.Second
	c := newTestClientOn(t, pgtest.Pool(t, dsn, proxy.Route), WithLossDeadline(loss), WithHeartbeat(hb))
	s, err := c.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	k := Int64Key(7301)
	if _, err := s.Lock(ctx, k); err != nil {
		t.Fatal(err)
	}
	// Right after a heartbeat was answered, so that none is in flight.
	s.state.Lock()
	last := s.lastOK
	s.state.Unlock()
	pgtest.Eventually(t, 10*time.Second, "a heartbeat", func() bool {
		s.state.Lock()
		defer s.state.Unlock()
		return s.lastOK.After(last)
	})
	proxy.Blackhole()
	t.Cleanup(proxy.CloseAll) // end the partition before the Client's and the database's cleanup
	const bound = 200 * time.Millisecond
	cctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	start := time.Now()
	err = s.Close(cctx)
	took := time.Since(start)
	if took > bound+time.Second {
		t.Fatalf("broken promise: Session.Close with a %v ctx on a silent network took %v (err %v): "+
			"ctx ended the unlock_all statement only through cancelHandler, whose socket deadline comes the loss deadline %v after the cancel",
			bound, took.Round(time.Millisecond), err, loss)
	}
	if err == nil {
		t.Fatal("Close returned nil without confirming the release")
	}
}

// Promise (Client.Close): each connection's release is bounded by the loss
// deadline; one that cannot be released cleanly in that time is closed.
func TestClientCloseReleaseBoundedByLossDeadlineOnSilentNetwork(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	proxy := pgtest.NewProxy(t, dsn)
	const loss, hb = 2 * time.Second, time.Second
	c, err := New(pgtest.Pool(t, dsn, proxy.Route), WithLossDeadline(loss), WithHeartbeat(hb), WithSharedBackends(1))
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			_ = c.Close(context.Background())
		}
	})
	l, err := c.Lock(ctx, Int64Key(7401))
	if err != nil {
		t.Fatal(err)
	}
	s := l.s
	s.state.Lock()
	last := s.lastOK
	s.state.Unlock()
	pgtest.Eventually(t, 10*time.Second, "a heartbeat", func() bool {
		s.state.Lock()
		defer s.state.Unlock()
		return s.lastOK.After(last)
	})
	proxy.Blackhole()
	t.Cleanup(proxy.CloseAll) // end the partition before the database's cleanup
	start := time.Now()
	err = c.Close(context.Background())
	closed = true
	took := time.Since(start)
	if took > loss+500*time.Millisecond {
		t.Fatalf("broken promise: Client.Close of one connection on a silent network took %v (err %v), more than the loss deadline %v that bounds each connection's release: "+
			"Session.close's statement is cut only by cancelHandler, whose socket deadline comes another loss deadline after the cancel",
			took.Round(time.Millisecond), err, loss)
	}
}

// Promises (Client.Close, lock.go): Close during a burst of acquires ends
// every lock and makes every acquire return, leaves no goroutine behind and
// returns within the loss deadline per connection; the Lock's bookkeeping of
// its in-process gates is decided once, under its mutex (claimGates against
// end), so the race detector sees no unsynchronised access.
func TestClientCloseDuringAcquiresLeavesNothing(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	ignore := goleak.IgnoreCurrent()
	const rounds, workers = 15, 8
	for round := range rounds {
		pool := pgtest.Pool(t, dsn)
		c, err := New(pool, WithSharedBackends(1), WithMaxWaits(1), WithLossDeadline(time.Second), WithHeartbeat(250*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		locked := 0
		enough := make(chan struct{})
		for w := range workers {
			k := Int64Key(int64(7500 + w))
			wg.Go(func() {
				for {
					l, err := c.Lock(ctx, k)
					if err != nil {
						if !errors.Is(err, ErrClosed) {
							t.Errorf("Lock during Close: %v, want ErrClosed", err)
						}
						return
					}
					mu.Lock()
					if locked++; locked == 4*workers {
						close(enough)
					}
					mu.Unlock()
					if err := l.Unlock(ctx); err != nil && !errors.Is(err, ErrClosed) && !errors.Is(err, ErrNotHeld) {
						t.Errorf("Unlock during Close: %v", err)
						return
					}
				}
			})
		}
		select {
		case <-enough:
		case <-time.After(testTimeout):
			t.Fatal("no locks taken")
		}
		start := time.Now()
		if err := c.Close(context.Background()); err != nil {
			t.Errorf("round %d: Close: %v", round, err)
		}
		if took := time.Since(start); took > time.Second+500*time.Millisecond {
			t.Errorf("round %d: Close took %v, more than the loss deadline", round, took)
		}
		wg.Wait()
		pool.Close()
		for w := range workers {
			notHeld(t, dsn, Int64Key(int64(7500+w)))
		}
		if t.Failed() {
			return
		}
	}
	if err := goleak.Find(ignore); err != nil {
		t.Fatalf("broken promise: goroutines left after Client.Close: %v", err)
	}
}

// Promises (backends.go, WithMaxWaits): a Client uses at most
// WithSharedBackends + WithMaxWaits connections, and its limits never
// deadlock goroutines whose lock order is consistent, even when LockAll
// calls with overlapping keys and single-key Locks of the same keys wait
// for a holder in another process and outnumber the backends.
func TestLimitsHoldConnectionsAndNeverDeadlockOverlappingLockAll(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	const app = "brk-limits"
	c := newTestClient(t, dsn, WithSharedBackends(1), WithMaxWaits(1), WithApplicationName(app))
	keys := []Key{Int64Key(7601), Int64Key(7602), Int64Key(7603), Int64Key(7604)}
	holder := pgtest.Conn(t, dsn)
	for _, k := range keys {
		v, _ := k.Int64()
		if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock($1)", v); err != nil {
			t.Fatal(err)
		}
	}
	obs := pgtest.Conn(t, dsn)
	count := func() int {
		var n int
		if err := obs.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", app).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	sets := [][]Key{{keys[0], keys[1]}, {keys[1], keys[2]}, {keys[2], keys[3]}, {keys[0], keys[3]}, {keys[0]}, {keys[1]}, {keys[2]}, {keys[3]}}
	errs := make(chan error, len(sets))
	var wg sync.WaitGroup
	for _, set := range sets {
		wg.Go(func() {
			for range 5 {
				l, err := c.LockAll(ctx, set...)
				if err != nil {
					errs <- err
					return
				}
				if err := l.Unlock(ctx); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	maxSeen := 0
	observe := func() {
		if n := count(); n > maxSeen {
			maxSeen = n
		}
	}
	// The acquires queue: one waits on the server, the rest poll.
	pgtest.Eventually(t, 10*time.Second, "an acquire to wait on the server", func() bool {
		observe()
		return len(lockState(t, dsn)[keys[0]])+len(lockState(t, dsn)[keys[1]])+len(lockState(t, dsn)[keys[2]])+len(lockState(t, dsn)[keys[3]]) > 4
	})
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_unlock_all()"); err != nil {
		t.Fatal(err)
	}
	deadline := time.After(testTimeout)
	for finished := false; !finished; {
		observe()
		select {
		case <-done:
			finished = true
		case <-deadline:
			t.Fatalf("broken promise: acquires with a consistent order did not finish within %v under WithSharedBackends(1), WithMaxWaits(1): %+v", testTimeout, c.Stat())
		case <-time.After(10 * time.Millisecond):
		}
	}
	close(errs)
	for err := range errs {
		t.Errorf("broken promise: acquire failed: %v (ErrDeadlock: %v)", err, errors.Is(err, ErrDeadlock))
	}
	if maxSeen > 2 {
		t.Fatalf("broken promise: pg_stat_activity showed %d connections of the Client, more than WithSharedBackends(1) + WithMaxWaits(1)", maxSeen)
	}
	for _, k := range keys {
		notHeld(t, dsn, k)
	}
	t.Logf("at most %d connections", maxSeen)
}

// Promise (doc.go, the lease): a database's defaults (lock_timeout,
// statement_timeout, idle_in_transaction_session_timeout,
// default_transaction_isolation = serializable) cannot end a holder or a
// long wait: a wait over several slices, then a fence that waits for a
// transaction that checked the old one, succeed, and the holder's other
// lock on the same Client lives throughout.
func TestDatabaseDefaultsDoNotEndWaitsOrFences(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := migratedPool(t, ctx, DefaultSchema)
	admin := pgtest.Conn(t, dsn)
	var db string
	if err := admin.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	ident := pgx.Identifier{db}.Sanitize()
	for _, set := range []string{"lock_timeout = '50ms'", "statement_timeout = '100ms'", "idle_in_transaction_session_timeout = '200ms'", "default_transaction_isolation = 'serializable'", "deadlock_timeout = '10ms'"} {
		if _, err := admin.Exec(ctx, "ALTER DATABASE "+ident+" SET "+set); err != nil {
			t.Fatal(err)
		}
	}
	const loss, hb = 2 * time.Second, 500 * time.Millisecond
	c := newTestClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(hb))
	_ = pool
	k, other := Int64Key(7701), Int64Key(7702)
	first, err := c.Lock(ctx, k, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	oldFence := first.Fence()
	mustUnlock(t, first)
	lo, err := c.Lock(ctx, other)
	if err != nil {
		t.Fatal(err)
	}

	holder := pgtest.Conn(t, dsn)
	kv, _ := k.Int64()
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock($1)", kv); err != nil {
		t.Fatal(err)
	}
	ch := goLock(func() (*Lock, error) { return c.Lock(ctx, k, WithFence()) })
	began := time.Now()
	slice := c.cfg.waitSlice()
	// The wait goes on over several slices.
	pgtest.Eventually(t, 10*time.Second, "the wait to last three slices", func() bool {
		stillWaiting(t, ch)
		return time.Since(began) > 3*slice && waitingOn(t, dsn, k) == 1
	})
	// A transaction checks the old fence, so the new fence must wait for it.
	tconn := pgtest.Conn(t, dsn)
	if _, err := tconn.Exec(ctx, "SET idle_in_transaction_session_timeout = 0"); err != nil {
		t.Fatal(err)
	}
	tx, err := tconn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := CheckFence(ctx, tx, k, oldFence); err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_unlock($1)", kv); err != nil {
		t.Fatal(err)
	}
	fenceWaitFrom := time.Now()
	pgtest.Eventually(t, 10*time.Second, "the fence to wait over three slices", func() bool {
		stillWaiting(t, ch)
		return time.Since(fenceWaitFrom) > 3*slice
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	res := receive(t, ch)
	if res.err != nil {
		t.Fatalf("broken promise: a wait and a fence under the database's defaults failed: %v", res.err)
	}
	if res.l.Fence() <= oldFence {
		t.Fatalf("fence %d not newer than %d", res.l.Fence(), oldFence)
	}
	if lo.Err() != nil {
		t.Fatalf("broken promise: the other lock was lost: %v", lo.Err())
	}
	heldOnlyBy(t, dsn, k, res.l.s.PID())
	mustUnlock(t, res.l)
	mustUnlock(t, lo)
	notHeld(t, dsn, k)
}
