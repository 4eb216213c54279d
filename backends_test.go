package pgcoord

// Tests of a Client's backends: many keys live on a few shared backends,
// blocking waits use at most WithMaxWaits backends of their own, lock
// connections follow the pool's connect path, and the Client's connection
// limits delay an acquire but never deadlock goroutines with a consistent
// lock order. Connections are counted in pg_stat_activity, keys in
// pg_locks.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// backendsOf counts the server backends whose application_name is app.
func backendsOf(t testing.TB, dsn, app string) int {
	t.Helper()
	var n int
	conn := pgtest.Conn(t, dsn)
	if err := conn.QueryRow(context.Background(), "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", app).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Ten thousand keys held at once through one Client live on a few shared
// backends, not on a connection each: at most WithSharedBackends +
// WithMaxWaits - 1, over which the Client spreads many keys.
func TestManyLocksFewBackends(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	const app = "pgcoord-many-locks"
	c := newTestClient(t, dsn, WithApplicationName(app))
	const n = 10_000
	locks := make([]*Lock, 0, n)
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Go(func() {
			for i := g; i < n; i += 8 {
				var l *Lock
				var err error
				if i%2 == 0 {
					l, err = c.Lock(ctx, Int64Key(int64(i)))
				} else {
					l, err = c.TryLock(ctx, Int64Key(int64(i)))
				}
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				locks = append(locks, l)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if got := len(lockState(t, dsn)); got != n {
		t.Fatalf("pg_locks shows %d keys, want %d", got, n)
	}
	backends := backendsOf(t, dsn, app)
	st := c.Stat()
	t.Logf("%d keys held on %d backends; Stat %+v", n, backends, st)
	if limit := DefaultSharedBackends + DefaultMaxWaits - 1; backends > limit || st.Backends > limit {
		t.Fatalf("%d keys held on %d backends (Stat: %d), want at most %d", n, backends, st.Backends, limit)
	}
	if st.Locks != n {
		t.Errorf("Stat.Locks = %d, want %d", st.Locks, n)
	}
	for _, l := range locks {
		mustUnlock(t, l)
	}
	if got := len(lockState(t, dsn)); got != 0 {
		t.Fatalf("%d keys still locked after unlocking all", got)
	}
}

// Blocking waits use their own backends, at most WithMaxWaits of them at a
// time; the others queue in the process, and every waiter acquires once
// its key is free.
func TestWaitsBounded(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	const app = "pgcoord-waits-bounded"
	c := newTestClient(t, dsn, WithApplicationName(app))
	other := newTestClient(t, dsn)
	const n = 64
	s, err := other.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	held := make([]*Lock, n)
	for i := range held {
		if held[i], err = s.Lock(ctx, Int64Key(int64(1000+i))); err != nil {
			t.Fatal(err)
		}
	}
	results := make([]<-chan result, n)
	for i := range results {
		results[i] = goLock(func() (*Lock, error) { return c.Lock(ctx, Int64Key(int64(1000+i))) })
	}
	var st Stat
	defer func() {
		if t.Failed() {
			t.Logf("last Stat: %+v", st)
		}
	}()
	pgtest.Eventually(t, testTimeout, "all waits in flight or queued", func() bool {
		st = c.Stat()
		return st.Waits == DefaultMaxWaits && st.QueuedWaits == n-DefaultMaxWaits
	})
	bound := DefaultSharedBackends + DefaultMaxWaits
	maxSeen := 0
	check := func() {
		got := backendsOf(t, dsn, app)
		maxSeen = max(maxSeen, got)
		if got > bound {
			t.Fatalf("%d backends in use, want at most %d", got, bound)
		}
	}
	check()
	// Free the keys one by one, checking the backends as the waiters move.
	for i, h := range held {
		mustUnlock(t, h)
		if i%8 == 0 {
			check()
		}
	}
	for i, ch := range results {
		r := receive(t, ch)
		if r.err != nil {
			t.Fatalf("waiter %d: %v", i, r.err)
		}
		heldOnlyBy(t, dsn, Int64Key(int64(1000+i)), r.l.core.S.PID())
		check()
		mustUnlock(t, r.l)
	}
	t.Logf("at most %d backends for %d waiters (bound %d)", maxSeen, n, bound)
	if got := len(lockState(t, dsn)); got != 0 {
		t.Fatalf("%d keys still locked", got)
	}
}

// Tight deadlines on a fresh Client: a connection that a call started is
// not wasted when the call gives up, waits that race their grant leave
// nothing behind, and some of them win. Not parallel: a 5 ms deadline is
// about scheduling, and the parallel tests would compete for the CPUs.
//
// The warm Client's lock within 5 ms is checked from the server, not by
// the call's wall time, which a loaded machine stretches whatever the
// library does: the lock is taken on the backend that the first call
// started, no other connection is opened, and the backend's one statement
// for it is the prepared lock statement, which the server ran in under
// 5 ms (query_start to state_change in pg_stat_activity).
func TestTightDeadlines(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*testTimeout) // 500 rounds
	defer cancel()
	dsn := pgtest.DB(t)
	c, other := newTestClient(t, dsn, WithApplicationName("tight")), newTestClient(t, dsn)
	k := HashKey("tight-deadline")

	// The very first call cannot connect in 5ms...
	dctx, dcancel := context.WithTimeout(ctx, 5*time.Millisecond)
	first, err := c.Lock(dctx, k)
	dcancel()
	if err == nil {
		t.Log("first call connected within 5ms")
		mustUnlock(t, first)
	} else if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("first call: %v, want DeadlineExceeded", err)
	}
	// ...but the connection it started is kept for the next one, which
	// takes the key there with one statement that the server runs in
	// under 5 ms.
	pgtest.Eventually(t, testTimeout, "connection kept", func() bool { return c.Stat().Backends >= 1 })
	admin := pgtest.Conn(t, dsn)
	backends := func() map[int32]time.Time {
		rows, err := admin.Query(ctx, "SELECT pid, backend_start FROM pg_stat_activity WHERE application_name = 'tight'")
		if err != nil {
			t.Fatal(err)
		}
		m := map[int32]time.Time{}
		var pid int32
		var started time.Time
		if _, err := pgx.ForEachRow(rows, []any{&pid, &started}, func() error { m[pid] = started; return nil }); err != nil {
			t.Fatal(err)
		}
		return m
	}
	kept := backends()
	lockSQL, _ := core.TrySQL(core.LockFunc(false, true), coreKeys([]Key{k}), 0)
	for attempt := 0; ; attempt++ {
		var called time.Time // by the server's clock
		if err := admin.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&called); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		l, err := c.Lock(ctx, k)
		took := time.Since(start)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := kept[l.core.S.PID()]; !ok {
			t.Fatalf("warm Client locked on backend %d, not on the one the first call started (%v)", l.core.S.PID(), kept)
		}
		var query string
		var ran time.Duration
		if err := admin.QueryRow(ctx, "SELECT query, state_change - query_start FROM pg_stat_activity WHERE pid = $1", l.core.S.PID()).Scan(&query, &ran); err != nil {
			t.Fatal(err)
		}
		// The statement was ready before the call: no prepare round trip.
		var prepared time.Time
		err = l.core.S.Run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
			return conn.QueryRow(ctx, "SELECT prepare_time FROM pg_prepared_statements WHERE statement = $1", lockSQL).Scan(&prepared)
		})
		if err != nil {
			t.Fatalf("the lock statement in pg_prepared_statements: %v", err)
		}
		if !prepared.Before(called) {
			t.Fatalf("the warm Lock's statement was prepared at %v, after the call began at %v", prepared, called)
		}
		mustUnlock(t, l)
		if query != lockSQL {
			// A heartbeat ran on the backend since: look again.
			if attempt == 20 {
				t.Fatalf("the backend's last statement was never the lock's: %q", query)
			}
			continue
		}
		t.Logf("warm Lock: the server ran its statement in %v; the call took %v", ran, took)
		if ran >= 5*time.Millisecond {
			t.Fatalf("the server ran the warm Lock's statement in %v, want under 5ms", ran)
		}
		break
	}
	if got := backends(); !maps.Equal(got, kept) {
		t.Fatalf("backends of the Client after the warm Lock: %v, want the one kept %v", got, kept)
	}
	if err := other.Warm(ctx); err != nil {
		t.Fatal(err)
	}

	var acquired, timedOut int
	for i := range 500 {
		h, err := other.Lock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		release := time.Duration(4000+rand.IntN(2000)) * time.Microsecond
		released := make(chan error, 1)
		timer := time.AfterFunc(release, func() { released <- h.Unlock(context.Background()) })
		dctx, cancel := context.WithTimeout(ctx, 5*time.Millisecond)
		l, err := c.Lock(dctx, k)
		cancel()
		if rerr := <-released; rerr != nil {
			t.Fatal(rerr)
		}
		timer.Stop()
		switch {
		case err == nil:
			acquired++
			heldOnlyBy(t, dsn, k, l.core.S.PID())
			mustUnlock(t, l)
		case errors.Is(err, context.DeadlineExceeded):
			timedOut++
			notHeld(t, dsn, k)
		default:
			t.Fatalf("iteration %d: %v", i, err)
		}
	}
	t.Logf("500 waits with a 5ms deadline, holder releasing after 4-6ms: %d acquired, %d timed out", acquired, timedOut)
	if acquired == 0 || timedOut == 0 {
		t.Fatalf("%d acquired and %d timed out: the race was not exercised", acquired, timedOut)
	}
}

// A backend is ready for its first lock when it joins the Client: the
// statements of a bigint key's Lock, TryLock and Unlock, and the
// heartbeat's, are prepared and have run once, guarded to do nothing, so
// the first lock costs one round trip and no lookups in the server's
// catalogs. pg_prepared_statements of each backend shows them planned, and
// pg_locks shows that running them took nothing.
func TestBackendReadyOnConnect(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	if err := c.Warm(ctx); err != nil {
		t.Fatal(err)
	}
	if got := len(lockState(t, dsn)); got != 0 {
		t.Fatalf("%d keys locked after Warm, want none", got)
	}
	c.core.Mu.Lock()
	backends := slices.Clone(c.core.Backends)
	c.core.Mu.Unlock()
	if len(backends) == 0 {
		t.Fatal("no backend after Warm")
	}
	for _, b := range backends {
		plans := map[string]int64{}
		err := b.Run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
			rows, err := conn.Query(ctx, "SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements")
			if err != nil {
				return err
			}
			var sql string
			var n int64
			_, err = pgx.ForEachRow(rows, []any{&sql, &n}, func() error {
				plans[sql] = n
				return nil
			})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range core.HotStatements() {
			if n, ok := plans[h.Sql]; !ok || n < 1 {
				t.Errorf("backend %d: %q prepared %v, planned %d times; want prepared and run", b.PID(), h.Sql, ok, n)
			}
		}
	}
}

// Lock connections follow the pool's connect path: its dialer (wrapped,
// not replaced) and its BeforeConnect and AfterConnect hooks.
func TestConnectPathFollowsPool(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	var dials, before, after atomic.Int64
	pool := pgtest.Pool(t, dsn, func(cfg *pgxpool.Config) {
		base := cfg.ConnConfig.DialFunc
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			dials.Add(1)
			return base(ctx, network, addr)
		}
		cfg.BeforeConnect = func(ctx context.Context, cc *pgx.ConnConfig) error {
			before.Add(1)
			return nil
		}
		cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
			after.Add(1)
			return nil
		}
	})
	const app = "pgcoord-connect-path"
	c := newTestClientOn(t, pool, WithApplicationName(app))
	d0, b0, a0 := dials.Load(), before.Load(), after.Load()
	other := newTestClient(t, dsn)
	k := HashKey("connect-path")
	h, err := other.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	s := newTestSession(t, c)
	wch := goLock(func() (*Lock, error) { return c.Lock(ctx, k) })
	pgtest.Eventually(t, testTimeout, "waiter queued", func() bool { return waitingOn(t, dsn, k) == 1 })
	mustUnlock(t, h)
	r := receive(t, wch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	mustUnlock(t, r.l)
	opened := int64(backendsOf(t, dsn, app))
	t.Logf("%d lock connections; dials %d, BeforeConnect %d, AfterConnect %d", opened, dials.Load()-d0, before.Load()-b0, after.Load()-a0)
	if opened < 2 {
		t.Fatalf("%d lock connections, want the session's and the Client's", opened)
	}
	// Each connection dials once, plus one dial per cancel request.
	if dials.Load()-d0 < opened || before.Load()-b0 != opened || after.Load()-a0 != opened {
		t.Fatalf("for %d connections: %d dials, %d BeforeConnect, %d AfterConnect", opened, dials.Load()-d0, before.Load()-b0, after.Load()-a0)
	}
	_ = s
}

// In-process handoff: a released lock passes to the next waiter of the
// same Client with the old handle ended first; a fenced acquire still gets
// a fresh fence; and a run of handoffs ends, so a waiter in another
// process gets its turn.
func TestHandoff(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	if err := Migrate(ctx, pgtest.Pool(t, dsn)); err != nil {
		t.Fatal(err)
	}
	c := newTestClient(t, dsn, WithHandoff(4, time.Second))
	k := HashKey("handoff")
	first, err := c.Lock(ctx, k, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	wch := goLock(func() (*Lock, error) { return c.Lock(ctx, k, WithFence()) })
	pgtest.Eventually(t, testTimeout, "local waiter queued", func() bool {
		c.core.Gates.Mu.Lock()
		defer c.core.Gates.Mu.Unlock()
		return c.core.Gates.M[k.coreKey()] != nil && len(c.core.Gates.M[k.coreKey()].Queue) == 1
	})
	pid := first.core.S.PID()
	mustUnlock(t, first)
	r := receive(t, wch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if first.Err() == nil {
		t.Fatal("the old handle is still live after the handoff")
	}
	if r.l.core.S.PID() != pid {
		t.Fatalf("handed-off lock on backend %d, want %d (no round trip)", r.l.core.S.PID(), pid)
	}
	if r.l.Fence() <= first.Fence() {
		t.Fatalf("fence after handoff %d, want more than %d", r.l.Fence(), first.Fence())
	}
	heldOnlyBy(t, dsn, k, pid)

	// A waiter in another process waits on the server; local waiters keep
	// handing off among themselves, at most 4 times in a row.
	remote := newTestClient(t, dsn)
	rch := goLock(func() (*Lock, error) { return remote.Lock(ctx, k) })
	pgtest.Eventually(t, testTimeout, "remote waiter queued", func() bool { return waitingOn(t, dsn, k) == 1 })
	cur := r.l
	handoffs := 0
	for range 10 {
		next := goLock(func() (*Lock, error) { return c.Lock(ctx, k) })
		pgtest.Eventually(t, testTimeout, "local waiter queued", func() bool {
			c.core.Gates.Mu.Lock()
			defer c.core.Gates.Mu.Unlock()
			return len(c.core.Gates.M[k.coreKey()].Queue) == 1
		})
		mustUnlock(t, cur)
		select {
		case rr := <-rch:
			if rr.err != nil {
				t.Fatal(rr.err)
			}
			// The remote waiter got its turn.
			heldOnlyBy(t, dsn, k, rr.l.core.S.PID())
			mustUnlock(t, rr.l)
			nr := receive(t, next)
			if nr.err != nil {
				t.Fatal(nr.err)
			}
			mustUnlock(t, nr.l)
			t.Logf("remote waiter served after %d local handoffs", handoffs)
			if handoffs > 4 {
				t.Fatalf("%d local handoffs before the remote waiter, want at most 4", handoffs)
			}
			notHeld(t, dsn, k)
			return
		case nr := <-next:
			if nr.err != nil {
				t.Fatal(nr.err)
			}
			handoffs++
			cur = nr.l
		}
	}
	t.Fatalf("remote waiter still waiting after %d local handoffs", handoffs)
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

// Promise (Client.Close): acquires that keep trying to reach a server that
// is down (Lock, LockAll, Semaphore.Acquire), their retry interval grown to
// its longest, end with ErrClosed as soon as Close begins, not at their
// next retry: Close, which waits for them, returns well within one retry
// interval.
func TestCloseEndsAcquiresRetryingWhileServerDown(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	srv := pgtest.NewServer(t)
	dsn := srv.DB(t)
	if err := Migrate(ctx, pgtest.Pool(t, dsn)); err != nil {
		t.Fatal(err)
	}
	// One Client for each kind of acquire, each behind a proxy of its own
	// that counts its attempts to connect: each Client is closed right
	// after an attempt, when its acquire has just begun to wait a whole
	// retry interval. Were the acquire ended only by its next retry,
	// Close would wait most of that interval.
	calls := []struct {
		name string
		call func(c *Client) error
	}{
		{"Lock", func(c *Client) error { _, err := c.Lock(ctx, HashKey("down", "lock")); return err }},
		{"LockAll", func(c *Client) error {
			_, err := c.LockAll(ctx, HashKey("down", "a"), HashKey("down", "b"))
			return err
		}},
		{"Semaphore.Acquire", func(c *Client) error { _, err := c.Semaphore("down", 1).Acquire(ctx); return err }},
	}
	cs := make([]*Client, len(calls))
	proxies := make([]*pgtest.Proxy, len(calls))
	for i := range calls {
		proxies[i] = pgtest.NewProxy(t, dsn)
		c, err := New(pgtest.Pool(t, dsn, proxies[i].Route), WithLossDeadline(time.Second), WithHeartbeat(250*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		mustUnlock(t, mustLockOf(t, ctx, c, HashKey("up", fmt.Sprint(i))))
		cs[i] = c
	}
	srv.Stop(t)
	defer srv.Start(t)
	results := make([]chan error, len(calls))
	for i, k := range calls {
		results[i] = make(chan error, 1)
		go func() { results[i] <- k.call(cs[i]) }()
	}
	waiting := time.Now()
	if !pgtest.Poll(testTimeout, func() bool {
		for _, c := range cs {
			if c.Stat().QueuedWaits < 1 {
				return false
			}
		}
		// By then every retry interval has grown to its longest.
		return time.Since(waiting) > 3*core.MaxRetryInterval
	}) {
		t.Fatal("the acquires did not queue to retry while the server was down")
	}
	for i, k := range calls {
		n := proxies[i].Accepted()
		if !pgtest.Poll(3*core.MaxRetryInterval, func() bool { return proxies[i].Accepted() > n }) {
			t.Fatalf("%s: no attempt to connect within %v while retrying", k.name, 3*core.MaxRetryInterval)
		}
		start := time.Now()
		if err := cs[i].Close(context.Background()); err != nil {
			t.Errorf("Close of the Client of %s: %v", k.name, err)
		}
		if took := time.Since(start); took > core.MaxRetryInterval/3 {
			t.Errorf("broken promise: Close took %v with %s retrying, want it ended at once (a retry interval is %v)", took, k.name, core.MaxRetryInterval)
		}
		select {
		case err := <-results[i]:
			if !errors.Is(err, ErrClosed) {
				t.Errorf("%s retrying during Close: %v, want ErrClosed", k.name, err)
			}
		case <-time.After(2 * core.MaxRetryInterval):
			t.Fatalf("%s retrying during Close did not return", k.name)
		}
	}
}
