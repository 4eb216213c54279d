package pgcoord

// Tests of a lock's liveness on its backend: the settings that keep a lock
// connection alive and its lease bounded are in force, role and database
// defaults cannot end a holder or a wait, a wait longer than the loss
// deadline is not a loss, a standby is refused before anything is locked
// on it, and a holder whose backend is terminated or whose network goes
// silent reports the loss within its bound.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// The liveness settings are really in force on a lock connection's backend.
func TestSessionAppliesServerLiveness(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn, WithLossDeadline(4*time.Second), WithApplicationName("liveness-test"))
	s := newTestSession(t, c)
	want := map[string]string{
		"tcp_keepalives_idle":              "2",
		"tcp_keepalives_interval":          "1",
		"tcp_keepalives_count":             "6",
		"tcp_user_timeout":                 "8000",
		"client_connection_check_interval": "1s",
		"idle_session_timeout":             "0",
		"statement_timeout":                "0",
		"lock_timeout":                     "1500ms", // a wait slice: (L - H) / 2
		"application_name":                 "liveness-test",
		"default_transaction_isolation":    "read committed",
	}
	err := s.core.Run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		for name, w := range want {
			var got string
			if err := conn.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&got); err != nil {
				return err
			}
			if got != w && !(name == "tcp_user_timeout" && got == "8s") {
				t.Errorf("%s = %q on the lock connection, want %q", name, got, w)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := core.ServerBound(4 * time.Second); got != 8*time.Second {
		t.Fatalf("serverBound(4s) = %v", got)
	}
}

// A role's statement_timeout must not cut a long wait short. The waiter
// connects as a role of the test's own whose statement_timeout is 50 ms
// (ALTER ROLE): an ordinary connection of that role is cut off by it, while
// the lock connection's wait is seen in pg_locks and pg_stat_activity
// waiting in one statement, on one backend, for ten times that by the
// server's clock, and ends with the lock.
func TestLongWaitSurvivesRoleStatementTimeout(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	admin := pgtest.Conn(t, dsn)
	role, roleDSN := newTestRole(t, dsn, "pgcoord_stmt")
	const timeout = 50 * time.Millisecond
	if _, err := admin.Exec(ctx, fmt.Sprintf("ALTER ROLE %s SET statement_timeout = %d", role, timeout.Milliseconds())); err != nil {
		t.Fatal(err)
	}

	// The role's timeout is in force on an ordinary connection of it.
	control := pgtest.Conn(t, roleDSN)
	if got := settingThrough(t, control, "statement_timeout"); got != "50ms" {
		t.Fatalf("statement_timeout = %q on an ordinary connection of the role, want 50ms", got)
	}
	if _, err := control.Exec(ctx, "SELECT pg_sleep(1)"); core.SqlState(err) != "57014" {
		t.Fatalf("a 1 s statement of the role: %v, want SQLSTATE 57014 (statement timeout)", err)
	}

	holder, waiter := newTestClient(t, dsn), newTestClient(t, roleDSN)
	k := HashKey("long-wait")
	h, err := holder.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	wch := goLock(func() (*Lock, error) { return waiter.Lock(ctx, k) })
	var pid int32
	pgtest.Eventually(t, testTimeout, "the waiter waits in pg_locks", func() bool {
		for _, w := range lockState(t, dsn)[k] {
			if !w.granted {
				pid = w.pid
				return true
			}
		}
		stillWaiting(t, wch)
		return false
	})
	// One wait statement of that backend, connected as the role, has been
	// waiting for the lock for ten times the role's statement_timeout.
	var backendStart time.Time
	pgtest.Eventually(t, testTimeout, "one wait statement outlasts the role's statement_timeout tenfold", func() bool {
		var user, waitType string
		var started time.Time
		var waited time.Duration
		err := admin.QueryRow(ctx, `
SELECT usename, coalesce(wait_event_type, ''), backend_start, clock_timestamp() - query_start
FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&user, &waitType, &started, &waited)
		if errors.Is(err, pgx.ErrNoRows) {
			r := receive(t, wch)
			t.Fatalf("the waiter's backend %d left, and Lock returned (%v, %v)", pid, r.l, r.err)
		}
		if err != nil {
			t.Fatalf("pg_stat_activity of the waiter's backend %d: %v", pid, err)
		}
		if user != role {
			t.Fatalf("the waiting backend %d is connected as %q, want the role %s", pid, user, role)
		}
		if backendStart.IsZero() {
			backendStart = started
		} else if !started.Equal(backendStart) {
			t.Fatalf("the waiter's backend %d was replaced during the wait", pid)
		}
		if waitType != "Lock" {
			stillWaiting(t, wch)
			return false
		}
		return waited > 10*timeout
	})
	stillWaiting(t, wch)
	if got := waitingOn(t, dsn, k); got != 1 {
		t.Fatalf("%d waiters of the key in pg_locks, want the one", got)
	}
	mustUnlock(t, h)
	r := receive(t, wch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	heldOnlyBy(t, dsn, k, pid)
	mustUnlock(t, r.l)
}

// A hot standby grants advisory locks that exclude nobody on the primary:
// every acquire refuses it with ErrReadOnly before it reaches the
// standby's lock table. A plain connection holds a key on the standby, and
// a watcher reads the standby's pg_locks all along: it never sees another
// advisory lock, held or awaited (a Lock of the held key that reached the
// lock table would wait there); afterwards no connection of the Client is
// left on the standby. Once the standby is promoted, locks work on it.
func TestStandbyIsRefused(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	primary := pgtest.NewServer(t)
	primary.DB(t) // the standby copies the primary, databases included
	standby := primary.StartStandby(t)
	sdsn := standby.ConnString("postgres")
	held := Int64Key(1)
	raw := pgtest.Conn(t, sdsn)
	if _, err := raw.Exec(ctx, "SELECT pg_advisory_lock($1)", mustInt64(held)); err != nil {
		t.Fatal(err)
	}
	rawPID := int32(raw.PgConn().PID())
	heldOnlyBy(t, sdsn, held, rawPID)

	// The watcher: any advisory lock but raw's, held or awaited, is one
	// that an acquire took or waited for on the standby.
	// It is stopped and waited for before its connection closes, however
	// the test ends.
	watch := pgtest.Conn(t, sdsn)
	stop, exited := make(chan struct{}), make(chan struct{})
	var (
		reads    int
		watchErr error
	)
	go func() {
		defer close(exited)
		for {
			var n int
			err := watch.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid <> $1
				AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`, rawPID).Scan(&n)
			if err != nil || n != 0 {
				watchErr = fmt.Errorf("pg_locks on the standby: %d advisory locks of others (%v)", n, err)
				return
			}
			reads++
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()
	var stopOnce sync.Once
	stopWatch := func() {
		stopOnce.Do(func() { close(stop) })
		<-exited
	}
	t.Cleanup(stopWatch)

	c := newTestClient(t, sdsn, WithApplicationName("on-standby"))
	for _, op := range []struct {
		name string
		do   func(ctx context.Context) error
	}{
		{"Lock of the held key", func(ctx context.Context) error { _, err := c.Lock(ctx, held); return err }},
		{"TryLock", func(ctx context.Context) error { _, err := c.TryLock(ctx, Int64Key(2)); return err }},
		{"RLock", func(ctx context.Context) error { _, err := c.RLock(ctx, Int64Key(3)); return err }},
		{"LockAll", func(ctx context.Context) error { _, err := c.LockAll(ctx, held, Int64Key(4)); return err }},
		{"NewSession", func(ctx context.Context) error { _, err := c.NewSession(ctx); return err }},
	} {
		// A blocking acquire keeps trying until its ctx ends, then
		// returns ctx's error with the last connection error. On a
		// loaded machine no connection may have answered by then: ctx's
		// error alone is no answer, and the op runs again with more
		// time.
		var err error
		for _, bound := range []time.Duration{500 * time.Millisecond, 2 * time.Second, 8 * time.Second} {
			octx, cancel := context.WithTimeout(ctx, bound)
			err = op.do(octx)
			cancel()
			if errors.Is(err, ErrReadOnly) || !errors.Is(err, context.DeadlineExceeded) {
				break
			}
			t.Logf("%s on a standby, bounded by %v: %v; no connection answered in time", op.name, bound, err)
		}
		if !errors.Is(err, ErrReadOnly) {
			t.Fatalf("%s on a standby: %v, want ErrReadOnly", op.name, err)
		}
	}
	stopWatch()
	if watchErr != nil {
		t.Fatal(watchErr)
	}
	if reads == 0 {
		t.Fatal("the watcher never read pg_locks")
	}
	pgtest.Eventually(t, testTimeout, "no connection of the Client left on the standby", func() bool {
		var n int
		if err := watch.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'on-standby'").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
	if rows := lockState(t, sdsn); len(rows) != 1 || len(rows[held]) != 1 {
		t.Fatalf("pg_locks on the standby: %v, want only the plain connection's hold of %v", rows, held)
	}

	standby.Promote(t)
	l, err := c.Lock(ctx, Int64Key(2))
	if err != nil {
		t.Fatalf("Lock after promotion: %v", err)
	}
	heldOnlyBy(t, sdsn, Int64Key(2), l.core.S.PID())
	mustUnlock(t, l)
}

// A wait longer than the loss deadline is not a loss: the lock it ends
// with is proved alive afresh, and stays held.
func TestWaitLongerThanLossDeadline(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	opts := []Option{WithLossDeadline(time.Second), WithHeartbeat(200 * time.Millisecond)}
	holder, waiter := newTestClient(t, dsn, opts...), newTestClient(t, dsn, opts...)
	k := HashKey("long-wait-lease")
	h, err := holder.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	wch := goLock(func() (*Lock, error) { return waiter.Lock(ctx, k) })
	pgtest.Eventually(t, testTimeout, "waiter queued for twice the loss deadline", func() bool {
		return waitingOn(t, dsn, k) == 1 && time.Since(start) > 2*time.Second
	})
	mustUnlock(t, h)
	r := receive(t, wch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	// Several heartbeats and one full loss deadline later it is still held.
	select {
	case <-r.l.Done():
		t.Fatalf("lock ended right after a long wait: %v", r.l.Err())
	case <-time.After(1500 * time.Millisecond):
	}
	heldOnlyBy(t, dsn, k, r.l.core.S.PID())
	mustUnlock(t, r.l)
}

// A wait longer than the loss deadline is not a loss for the other locks
// of its backend either: a Session holds k1 and waits on the same backend
// for k2, held elsewhere, for three loss deadlines by the server's clock.
// The wait answers at every slice ((L − H)/2 = 400 ms), each answer proves
// the connection alive, and nothing else can (the heartbeat does not run
// while a statement does): pg_stat_activity shows the backend's wait
// statement starting afresh, pg_locks shows k1 granted to the same backend
// all along, and the session is not lost. Once k2 is free the session
// holds both.
func TestWaitProvesOtherLocksAlive(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	const loss, beat = time.Second, 200 * time.Millisecond
	c, other := newTestClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(beat)), newTestClient(t, dsn)
	k1, k2 := HashKey("wait-proves", "held"), HashKey("wait-proves", "wanted")
	h, err := other.Lock(ctx, k2)
	if err != nil {
		t.Fatal(err)
	}
	s := newTestSession(t, c)
	l1, err := s.Lock(ctx, k1)
	if err != nil {
		t.Fatal(err)
	}
	pid := s.PID()
	admin := pgtest.Conn(t, dsn)
	var backendStart time.Time
	if err := admin.QueryRow(ctx, "SELECT backend_start FROM pg_stat_activity WHERE pid = $1", pid).Scan(&backendStart); err != nil {
		t.Fatal(err)
	}
	wch := goLock(func() (*Lock, error) { return s.Lock(ctx, k2) })

	slices := map[time.Time]bool{} // query_start of each wait statement seen
	var first time.Time
	for {
		var started, queryStart, now time.Time
		var waiting bool
		err := admin.QueryRow(ctx, `SELECT backend_start, query_start, wait_event_type IS NOT DISTINCT FROM 'Lock', clock_timestamp()
			FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&started, &queryStart, &waiting, &now)
		if err != nil {
			t.Fatalf("pg_stat_activity of the session's backend %d: %v", pid, err)
		}
		if !started.Equal(backendStart) {
			t.Fatalf("backend %d was replaced during the wait", pid)
		}
		heldOnlyBy(t, dsn, k1, pid)
		select {
		case <-l1.Done():
			t.Fatalf("k1 lost while the session waited for k2: %v", l1.Err())
		default:
		}
		stillWaiting(t, wch)
		if waiting {
			slices[queryStart] = true
			if first.IsZero() {
				first = queryStart
			}
		}
		if !first.IsZero() && now.Sub(first) > 3*loss {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("%d wait statements seen in %v of waiting (slice %v)", len(slices), 3*loss, c.core.Cfg.WaitSlice())
	if len(slices) < 3 {
		t.Fatalf("%d wait statements in three loss deadlines, want one every slice of %v", len(slices), c.core.Cfg.WaitSlice())
	}
	mustUnlock(t, h)
	r := receive(t, wch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	heldOnlyBy(t, dsn, k1, pid)
	heldOnlyBy(t, dsn, k2, pid)
	if err := s.Err(); err != nil {
		t.Fatalf("session: %v", err)
	}
	mustUnlock(t, r.l)
	mustUnlock(t, l1)
}

// When the network goes silent the holder declares its lock lost within
// the loss deadline, while the server still holds it: nobody else can take
// the key before the old holder knows it lost it.
func TestLossOnSilentNetwork(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	proxy := pgtest.NewProxy(t, dsn)
	const loss, beat = 2 * time.Second, 250 * time.Millisecond
	c := newTestClientOn(t, pgtest.Pool(t, dsn, proxy.Route), WithLossDeadline(loss), WithHeartbeat(beat))
	k := HashKey("partition")
	l, err := c.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	pid := l.core.S.PID()
	heldOnlyBy(t, dsn, k, pid)

	start := time.Now()
	proxy.Blackhole()
	awaitEnd(t, l, "loss on a silent network")
	took := leaseLostAt(t, l.core.S).Sub(start)
	t.Logf("silence noticed (the loss declared) after %v: %v", took, l.Err())
	if !errors.Is(l.Err(), ErrLockLost) {
		t.Fatalf("Err: %v, want ErrLockLost", l.Err())
	}
	if took > loss+beat {
		t.Errorf("noticed after %v, want within the loss deadline %v (+ one beat)", took, loss)
	}
	// The server has not let go yet: the old holder knew first.
	heldOnlyBy(t, dsn, k, pid)
	other := newTestClient(t, dsn)
	if _, err := other.TryLock(ctx, k); !errors.Is(err, ErrLocked) {
		t.Fatalf("TryLock while the partitioned backend holds the key: %v, want ErrLocked", err)
	}
	// The partition ends with the sockets closed: the server frees the key.
	proxy.CloseAll()
	l2, err := other.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	heldOnlyBy(t, dsn, k, l2.core.S.PID())
	mustUnlock(t, l2)
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
	slice := c.core.Cfg.WaitSlice()
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
	heldOnlyBy(t, dsn, k, res.l.core.S.PID())
	mustUnlock(t, res.l)
	mustUnlock(t, lo)
	notHeld(t, dsn, k)
}

// Terminating the holder's backend ends its locks: Done closes within the
// heartbeat bound, Err wraps ErrLockLost, and Do's callback is cancelled.
func TestLossOnTerminatedBackend(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	k := HashKey("loss")

	l, err := c.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	pgtest.Terminate(t, dsn, l.core.S.PID())
	awaitEnd(t, l, "after the backend was terminated")
	took := time.Since(start)
	t.Logf("loss noticed after %v", took)
	if bound := lossNoticeBound(c.core.Cfg); took > bound {
		t.Errorf("loss noticed after %v, documented bound %v", took, bound)
	}
	if !errors.Is(l.Err(), ErrLockLost) {
		t.Fatalf("Err: %v, want ErrLockLost", l.Err())
	}
	if err := l.Unlock(ctx); !errors.Is(err, ErrLockLost) {
		t.Fatalf("Unlock after loss: %v, want ErrLockLost", err)
	}
	notHeld(t, dsn, k)

	// Do: the callback's context is cancelled with the loss as cause.
	started := make(chan struct{})
	doErr := make(chan error, 1)
	var cause error
	go func() {
		doErr <- c.Do(ctx, k, func(fctx context.Context) error {
			close(started)
			<-fctx.Done()
			cause = context.Cause(fctx)
			return fctx.Err()
		})
	}()
	select {
	case <-started:
	case <-time.After(testTimeout):
		t.Fatal("Do's callback did not start")
	}
	pids := grantedTo(t, dsn, k)
	if len(pids) != 1 {
		t.Fatalf("pg_locks while Do runs: holders %v, want one", pids)
	}
	pgtest.Terminate(t, dsn, pids[0])
	select {
	case err := <-doErr:
		if !errors.Is(err, ErrLockLost) {
			t.Fatalf("Do: %v, want ErrLockLost", err)
		}
	case <-time.After(testTimeout):
		t.Fatal("Do's callback was not cancelled after the backend was terminated")
	}
	if !errors.Is(cause, ErrLockLost) {
		t.Fatalf("callback context cause: %v, want ErrLockLost", cause)
	}
	notHeld(t, dsn, k)
	// The Client goes on working after a loss.
	l, err = c.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	mustUnlock(t, l)
}

// A lock held on a backend keeps its loss deadline while a blocking acquire
// waits on the same backend: when the network goes silent, the held lock is
// declared lost within the deadline.
func TestLeaseHoldsDuringBlockedWait(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	proxy := pgtest.NewProxy(t, dsn)
	const loss, beat = 2 * time.Second, 250 * time.Millisecond
	c := newTestClientOn(t, pgtest.Pool(t, dsn, proxy.Route), WithLossDeadline(loss), WithHeartbeat(beat))
	other := newTestClient(t, dsn)
	k1, k2 := HashKey("lease-held"), HashKey("lease-wanted")
	h, err := other.Lock(ctx, k2)
	if err != nil {
		t.Fatal(err)
	}
	s := newTestSession(t, c)
	l1, err := s.Lock(ctx, k1)
	if err != nil {
		t.Fatal(err)
	}
	wch := goLock(func() (*Lock, error) { return s.Lock(ctx, k2) })
	pgtest.Eventually(t, testTimeout, "session waits for k2", func() bool { return waitingOn(t, dsn, k2) == 1 })

	start := time.Now()
	proxy.Blackhole()
	awaitEnd(t, l1, "loss of k1 while waiting for k2")
	took := leaseLostAt(t, s.core).Sub(start)
	t.Logf("held lock declared lost %v after the network went silent: %v", took, l1.Err())
	if !errors.Is(l1.Err(), ErrLockLost) {
		t.Fatalf("k1 Err: %v, want ErrLockLost", l1.Err())
	}
	if took > loss+beat {
		t.Errorf("k1 declared lost after %v, want within the loss deadline %v (+ one beat)", took, loss)
	}
	if r := receive(t, wch); r.err == nil {
		t.Fatal("the blocked acquire succeeded on a lost session")
	}
	proxy.CloseAll()
	mustUnlock(t, h)
}
