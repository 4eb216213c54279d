package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// A waiter whose process is killed does not stay queued for the key: its
// backend notices the closed socket within client_connection_check_interval
// (1 s, set on every lock connection), although the waiter's loss deadline
// of 30 s makes each slice of its wait last 14.5 s. pg_locks shows no
// waiter within 1 s plus a second of slack for a loaded machine, and the
// key never goes to the dead waiter.
func TestFaultKilledWaiterLeavesQueue(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := faultDB(t)
	target := lockTarget{"killed-waiter"}
	h, err := target.acquire(ctx, newTestClient(t, dsn))
	if err != nil {
		t.Fatal(err)
	}
	const loss, checkInterval = 30 * time.Second, time.Second
	if slice := (&core.Config{LossDeadline: loss, Heartbeat: DefaultHeartbeat}).WaitSlice(); slice < 10*checkInterval {
		t.Fatalf("wait slice %v: too short to tell the check interval from the end of a slice", slice)
	}
	p := startFaultChild(t, "holder", dsn, target, childOptions(loss, DefaultHeartbeat))
	var waiter int32
	pgtest.Eventually(t, testTimeout, "the child waits on the server", func() bool {
		for _, r := range lockState(t, dsn)[target.key()] {
			if !r.granted {
				waiter = r.pid
				return true
			}
		}
		return false
	})

	killed := time.Now()
	p.Kill(t)
	const bound = checkInterval + time.Second
	pgtest.Eventually(t, testTimeout, "the killed waiter leaves the queue", func() bool {
		_, waiting := target.holders(t, dsn)
		return waiting == 0
	})
	took := time.Since(killed)
	t.Logf("killed waiter left the queue after %v", took.Round(time.Millisecond))
	if took > bound {
		t.Errorf("killed waiter left the queue after %v, want within %v", took, bound)
	}
	backendGone(t, pool, waiter)
	if pids, _ := target.holders(t, dsn); len(pids) != 1 || pids[0] != h.pid() {
		t.Fatalf("pg_locks: %v held by %v, want only the holder %d", target, pids, h.pid())
	}
	if err := h.release(ctx); err != nil {
		t.Fatal(err)
	}
	notHeld(t, dsn, target.key())
}

// A role (here: the test's role in the test's database) with
// idle_session_timeout set does not end lock connections, which are idle
// for a heartbeat interval (1 s) at a time: every lock connection sets
// idle_session_timeout = 0 on its own backend. An ordinary connection of
// the same role shows that the timeout is in force; the locks, on a
// Client's shared backend and on a Session, stay held on the same backends
// through three heartbeat intervals.
func TestFaultRoleIdleSessionTimeout(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	admin := pgtest.Conn(t, dsn)
	if _, err := admin.Exec(ctx, "DO $$ BEGIN EXECUTE format('ALTER ROLE %I IN DATABASE %I SET idle_session_timeout = 300', current_user, current_database()); END $$"); err != nil {
		t.Fatal(err)
	}
	control := pgtest.Conn(t, dsn)
	if got := settingThrough(t, control, "idle_session_timeout"); got != "300ms" {
		t.Fatalf("idle_session_timeout = %q on a new connection, want 300ms", got)
	}
	controlPID := int32(control.PgConn().PID())

	c := newTestClient(t, dsn)
	k := HashKey("idle-session")
	l, err := c.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	s := newTestSession(t, c)
	sk := HashKey("idle-session", "session")
	sl, err := s.Lock(ctx, sk)
	if err != nil {
		t.Fatal(err)
	}
	locked := time.Now()

	pgtest.Eventually(t, testTimeout, "idle_session_timeout ends an ordinary idle connection", func() bool {
		var n int
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", controlPID).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
	hold := 3 * DefaultHeartbeat
	select {
	case <-l.Done():
		t.Fatalf("lock ended under the role's idle_session_timeout: %v", l.Err())
	case <-sl.Done():
		t.Fatalf("session lock ended under the role's idle_session_timeout: %v", sl.Err())
	case <-time.After(time.Until(locked.Add(hold))):
	}
	heldOnlyBy(t, dsn, k, l.core.S.PID())
	heldOnlyBy(t, dsn, sk, s.PID())
	mustUnlock(t, l)
	mustUnlock(t, sl)
}

// A caller's pool that recycles its connections aggressively (lifetime and
// idle time 1 s, health checks every 100 ms) while the caller uses it does
// not touch the locks of a Client built on it: they live on dedicated
// connections that the pool never sees. Locks, and a leadership (its lock
// and its guard), held for 10 s stay held on their backends (pg_locks), and
// the pool did recycle meanwhile; Leader, which queries through the pool,
// still reports the leader.
func TestFaultPoolRecycling(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := recyclingPool(t)
	c := newTestClientOn(t, pool)
	fenced, err := c.Lock(ctx, HashKey("recycled", "fenced"), WithFence())
	if err != nil {
		t.Fatal(err)
	}
	multi, err := c.LockAll(ctx, HashKey("recycled", "a"), HashKey("recycled", "b"))
	if err != nil {
		t.Fatal(err)
	}
	s := newTestSession(t, c)
	sl, err := s.Lock(ctx, HashKey("recycled", "session"))
	if err != nil {
		t.Fatal(err)
	}
	e := c.Election("recycled")
	ld, err := e.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if ld.guardLock() == nil {
		t.Fatal("the leadership holds no guard")
	}
	locks := []*Lock{fenced, multi, sl, faceOf(ld.lock), faceOf(ld.guardLock())}
	owners := map[Key]int32{}
	for _, l := range locks {
		for _, k := range l.Keys() {
			owners[k] = l.core.S.PID()
		}
	}
	check := func() {
		t.Helper()
		state := lockState(t, dsn)
		for k, pid := range owners {
			if rows := state[k]; len(rows) != 1 || rows[0].pid != pid || !rows[0].granted {
				t.Fatalf("pg_locks: %v has %+v, want held by backend %d", k, rows, pid)
			}
		}
	}
	alive := func() {
		t.Helper()
		for _, l := range locks {
			select {
			case <-l.Done():
				t.Fatalf("lock %v ended while the pool recycled: %v", l.Keys(), l.Err())
			default:
			}
		}
		select {
		case <-ld.Context().Done():
			t.Fatalf("leadership ended while the pool recycled: %v", context.Cause(ld.Context()))
		default:
		}
	}
	check()
	useRecyclingPool(t, pool, check, alive)
	if info, err := e.Leader(ctx); err != nil || info.Term != ld.Term() || info.PID != ld.lock.S.PID() {
		t.Fatalf("Leader: %+v, %v; want term %d on backend %d", info, err, ld.Term(), ld.lock.S.PID())
	}
	if err := ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	for _, l := range locks[:3] {
		mustUnlock(t, l)
	}
	if n := len(lockState(t, dsn)); n != 0 {
		t.Fatalf("%d advisory locks after Unlock", n)
	}
}

// recyclingPool returns a fresh migrated database and a pool on it that
// recycles its connections aggressively: lifetime and idle time 1 s,
// health checks every 100 ms.
func recyclingPool(t *testing.T) (string, *pgxpool.Pool) {
	t.Helper()
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn, func(cfg *pgxpool.Config) {
		cfg.MaxConnLifetime = time.Second
		cfg.MaxConnLifetimeJitter = 0
		cfg.MaxConnIdleTime = time.Second
		cfg.HealthCheckPeriod = 100 * time.Millisecond
		cfg.MinConns = 2
	})
	if err := Migrate(testCtx(t), pool); err != nil {
		t.Fatal(err)
	}
	return dsn, pool
}

// useRecyclingPool uses pool as a caller would, a statement every 100 ms,
// for 10 s; it calls alive after every statement and check every second
// and at the end. It fails the test if the pool recycled no connection
// meanwhile: the test would have proved nothing.
func useRecyclingPool(t *testing.T, pool *pgxpool.Pool, check, alive func()) {
	t.Helper()
	ctx := testCtx(t)
	const hold = 10 * time.Second
	end := time.After(hold)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for i := 0; ; i++ {
		select {
		case <-end:
			check()
			st := pool.Stat()
			recycled := st.MaxLifetimeDestroyCount() + st.MaxIdleDestroyCount()
			t.Logf("pool recycled %d connections (%d by lifetime) in %v", recycled, st.MaxLifetimeDestroyCount(), hold)
			if recycled == 0 {
				t.Fatal("the pool recycled no connection: the test proved nothing")
			}
			return
		case <-tick.C:
			if _, err := pool.Exec(ctx, "SELECT 1"); err != nil {
				t.Fatal(err)
			}
			if i%10 == 0 {
				check()
			}
		}
		alive()
	}
}

// Failover to a standby. A Client whose pool lists the primary, then the
// standby (a multi-host connection string, as an application configures
// failover), holds a fenced lock and a Session lock on the primary. The
// primary stops: both report ErrLockLost within the heartbeat bound 2H.
// Until the standby is promoted, every acquire reaches only the standby and
// is refused with ErrReadOnly, leaving nothing in its pg_locks (see also
// TestStandbyIsRefused). After promotion the Client locks on the new
// primary with a greater fence (the fence had replicated); the old Lock
// and Session stay ended: no session that was on the old primary believes
// it holds a lock on the new one, whose pg_locks shows only the new hold.
func TestFaultFailover(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	primary := pgtest.NewServer(t)
	pdsn := primary.DB(t)
	migrated(t, pdsn)
	cfg, err := pgx.ParseConfig(pdsn)
	if err != nil {
		t.Fatal(err)
	}
	standby := primary.StartStandby(t)
	sdsn := standby.ConnString(cfg.Database)
	both := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/%s?sslmode=disable", primary.Port(), standby.Port(), cfg.Database)
	c := newTestClientOn(t, pgtest.Pool(t, both))
	k := HashKey("failover")

	l, err := c.Lock(ctx, k, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	heldOnlyBy(t, pdsn, k, l.core.S.PID())
	s := newTestSession(t, c)
	sk := HashKey("failover", "session")
	sl, err := s.Lock(ctx, sk)
	if err != nil {
		t.Fatal(err)
	}
	// The fence has reached the standby before the primary goes.
	replica := pgtest.Conn(t, sdsn)
	pgtest.Eventually(t, testTimeout, "the fence replicates", func() bool {
		var n int64
		space, key := core.FenceRow(k.coreKey())
		err := replica.QueryRow(ctx, "SELECT coalesce(max(fence), 0) FROM pgcoord.fences WHERE key_space = $1 AND key = $2", space, key).Scan(&n)
		return err == nil && Term(n) == l.Fence()
	})

	primary.Stop(t)
	locks := []*Lock{l, sl}
	awaitLost(t, locks, func(i int) string { return fmt.Sprintf("lock %v", locks[i].Keys()) }, time.Now(), "the primary stopped")
	if !errors.Is(s.Err(), ErrLockLost) {
		t.Fatalf("session: %v, want ErrLockLost", s.Err())
	}

	// A try fails fast; a blocking acquire keeps trying until its ctx
	// ends, and then says what the server answered.
	refusedAcquire(t, c, k, ErrReadOnly)
	if _, err := c.NewSession(ctx); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("NewSession with only the standby up: %v, want ErrReadOnly", err)
	}
	if n := len(lockState(t, sdsn)); n != 0 {
		t.Fatalf("%d advisory locks on the standby, want none", n)
	}

	// A blocking acquire that starts while only the standby is up rides
	// through the failover: it gets the key once the standby is promoted.
	riding := goLock(func() (*Lock, error) { return c.Lock(ctx, k, WithFence()) })
	pgtest.Eventually(t, testTimeout, "the blocking Lock is retrying", func() bool { return c.Stat().QueuedWaits > 0 })
	standby.Promote(t)
	if _, err := s.TryLock(ctx, sk); !errors.Is(err, ErrLockLost) {
		t.Fatalf("TryLock on the session from the old primary: %v, want ErrLockLost", err)
	}
	res := receive(t, riding)
	if res.err != nil {
		t.Fatalf("Lock that waited through the promotion: %v", res.err)
	}
	nl := res.l
	if nl.Fence() <= l.Fence() {
		t.Fatalf("fence %d on the new primary, not above %d from the old one", nl.Fence(), l.Fence())
	}
	heldOnlyBy(t, sdsn, k, nl.core.S.PID())
	if rows := lockState(t, sdsn); len(rows) != 1 {
		t.Fatalf("pg_locks on the new primary: %v, want only the new lock", rows)
	}
	for _, h := range []*Lock{l, sl} {
		if !errors.Is(h.Err(), ErrLockLost) {
			t.Fatalf("old lock %v: %v after promotion, want it still lost", h.Keys(), h.Err())
		}
	}
	mustUnlock(t, nl)
}
