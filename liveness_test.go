package pgcoord

import (
	"context"
	"errors"
	"testing"
	"time"

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
	}
	err := s.run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
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
	if got := serverBound(4 * time.Second); got != 8*time.Second {
		t.Fatalf("serverBound(4s) = %v", got)
	}
}

// A role's statement_timeout must not cut a long wait short.
func TestLongWaitSurvivesRoleStatementTimeout(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	admin := pgtest.Conn(t, dsn)
	// Open the pg_locks observer first, so that it does not get the
	// database's 50 ms statement_timeout, which a loaded machine exceeds.
	notHeld(t, dsn, HashKey("long-wait"))
	if _, err := admin.Exec(ctx, "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET statement_timeout = 50', current_database()); END $$"); err != nil {
		t.Fatal(err)
	}
	holder, waiter := newTestClient(t, dsn), newTestClient(t, dsn)
	k := HashKey("long-wait")
	h, err := holder.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	wch := goLock(func() (*Lock, error) { return waiter.Lock(ctx, k) })
	// Wait in pg_locks for much longer than the 50 ms statement timeout:
	// the waiter must still be there, waiting.
	deadline := time.Now().Add(500 * time.Millisecond)
	for i := 0; i < 1000 && time.Now().Before(deadline); i++ {
		if n := waitingOn(t, dsn, k); n != 1 {
			select {
			case r := <-wch:
				t.Fatalf("waiter returned early: %v", r.err)
			default:
			}
		}
	}
	stillWaiting(t, wch)
	mustUnlock(t, h)
	r := receive(t, wch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	mustUnlock(t, r.l)
}

// A hot standby grants advisory locks that exclude nobody on the primary:
// sessions refuse it.
func TestStandbyIsRefused(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	primary := pgtest.NewServer(t)
	primary.DB(t) // the standby copies the primary, databases included
	standby := primary.StartStandby(t)
	c := newTestClient(t, standby.ConnString("postgres"))
	refusedAcquire(t, c, Int64Key(1), ErrReadOnly)
	if _, err := c.NewSession(ctx); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("NewSession on a standby: %v, want ErrReadOnly", err)
	}
	standby.Promote(t)
	l, err := c.Lock(ctx, Int64Key(1))
	if err != nil {
		t.Fatalf("Lock after promotion: %v", err)
	}
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
	heldOnlyBy(t, dsn, k, r.l.s.PID())
	mustUnlock(t, r.l)
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
	pid := l.s.PID()
	heldOnlyBy(t, dsn, k, pid)

	start := time.Now()
	proxy.Blackhole()
	awaitEnd(t, l, "loss on a silent network")
	took := time.Since(start)
	t.Logf("silence noticed after %v: %v", took, l.Err())
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
	heldOnlyBy(t, dsn, k, l2.s.PID())
	mustUnlock(t, l2)
}
