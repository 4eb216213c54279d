package pgcoordtest_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"github.com/pgcoord/pgcoord/pgcoordtest"
)

// short makes a Client notice a lost connection within a second.
var short = []pgcoord.Option{pgcoord.WithHeartbeat(100 * time.Millisecond), pgcoord.WithLossDeadline(time.Second)}

// holderPID returns the backend that holds key in dsn's database, as
// pg_locks says, or 0.
func holderPID(t testing.TB, dsn string, key pgcoord.Key) int32 {
	t.Helper()
	c := pgcoordtest.Client(t, dsn)
	locks, err := c.Locks(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range locks {
		if l.Key == key && l.Granted {
			return l.PID
		}
	}
	return 0
}

// waitDone waits for l to end, failing t after 10 seconds.
func waitDone(t testing.TB, l *pgcoord.Lock, what string) {
	t.Helper()
	select {
	case <-l.Done():
	case <-time.After(10 * time.Second):
		t.Fatalf("the lock did not end within 10 s of %s", what)
	}
	if !errors.Is(l.Err(), pgcoord.ErrLockLost) {
		t.Fatalf("lock ended with %v, want ErrLockLost", l.Err())
	}
}

// TerminateBackends ends the backend that holds the Client's lock, which
// the server then frees and the Client reports lost, and leaves the
// Client's pool working.
func TestTerminateBackendsEndsTheClientsLocks(t *testing.T) {
	dsn := pgcoordtest.DB(t)
	key := pgcoord.HashKey("terminate")
	c := pgcoordtest.Client(t, dsn, short...)
	l, err := c.Lock(ctxT(t), key)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Locks(ctxT(t)); err != nil { // the pool opens a connection
		t.Fatal(err)
	}
	pid := holderPID(t, dsn, key)
	if pid == 0 {
		t.Fatal("pg_locks shows no holder of the key")
	}
	ended := pgcoordtest.TerminateBackends(t, c)
	if !slices.Contains(ended, pid) {
		t.Fatalf("ended backends %v, not %d, which holds the lock", ended, pid)
	}
	waitDone(t, l, "TerminateBackends")
	if got := holderPID(t, dsn, key); got != 0 {
		t.Fatalf("backend %d holds the key after TerminateBackends", got)
	}
	// The pool's connection was left alone: the next query on it works.
	if _, err := c.Locks(ctxT(t)); err != nil {
		t.Fatalf("the Client's pool after TerminateBackends: %v", err)
	}
	// The Client takes the key again on a new backend.
	l2, err := c.TryLock(ctxT(t), key)
	if err != nil {
		t.Fatalf("TryLock after the loss: %v", err)
	}
	if got := holderPID(t, dsn, key); got == 0 || slices.Contains(ended, got) {
		t.Fatalf("holder %d after the loss; want a new backend, none of %v", got, ended)
	}
	if err := l2.Unlock(ctxT(t)); err != nil {
		t.Fatal(err)
	}
}

// A Session's backend ends through TerminateBackend with its PID.
func TestTerminateBackendEndsASession(t *testing.T) {
	dsn := pgcoordtest.DB(t)
	c := pgcoordtest.Client(t, dsn, short...)
	s, err := c.NewSession(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	l, err := s.Lock(ctxT(t), pgcoord.HashKey("session"))
	if err != nil {
		t.Fatal(err)
	}
	pgcoordtest.TerminateBackend(t, dsn, s.PID())
	waitDone(t, l, "TerminateBackend")
}

// A blackholed Proxy makes the Client declare its lock lost within its
// loss deadline; Heal lets it connect again and take the key back once the
// server has freed it.
func TestProxyBlackholeLosesTheLockAndHealRestores(t *testing.T) {
	dsn := pgcoordtest.DB(t)
	key := pgcoord.HashKey("proxy")
	p := pgcoordtest.NewProxy(t, dsn)
	c := pgcoordtest.Client(t, p.ConnString(), short...)
	l, err := c.Lock(ctxT(t), key)
	if err != nil {
		t.Fatal(err)
	}
	old := holderPID(t, dsn, key)
	if old == 0 {
		t.Fatal("pg_locks shows no holder of the key")
	}
	p.Blackhole()
	start := time.Now()
	waitDone(t, l, "Blackhole")
	t.Logf("lock lost %v after Blackhole", time.Since(start).Round(time.Millisecond))
	p.Heal()
	l2, err := c.Lock(ctxT(t), key)
	if err != nil {
		t.Fatalf("Lock after Heal: %v", err)
	}
	if got := holderPID(t, dsn, key); got == 0 || got == old {
		t.Fatalf("holder %d after Heal; want a new backend, not %d", got, old)
	}
	if err := l2.Unlock(ctxT(t)); err != nil {
		t.Fatal(err)
	}
}

// Heal closes the connections that were blackholed, on both sides (the
// server's backend exits), and new connections go through.
func TestProxyHealClosesBlackholedConnections(t *testing.T) {
	dsn := pgcoordtest.DB(t)
	p := pgcoordtest.NewProxy(t, dsn)
	old := connect(t, p.ConnString())
	var pid int32
	if err := old.QueryRow(ctxT(t), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	p.Blackhole()
	p.Heal()
	if err := old.Ping(ctxT(t)); err == nil {
		t.Fatal("a connection blackholed before Heal still answers after it")
	}
	observer := connect(t, dsn)
	pgtest.Eventually(t, 10*time.Second, "the blackholed connection's backend to exit", func() bool {
		var n int
		err := observer.QueryRow(ctxT(t), "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid).Scan(&n)
		return err == nil && n == 0
	})
	if err := connect(t, p.ConnString()).Ping(ctxT(t)); err != nil {
		t.Fatalf("a new connection after Heal: %v", err)
	}
}

// Client does not connect: right after it, the test's database has no
// connection.
func TestClientDoesNotConnect(t *testing.T) {
	dsn := pgcoordtest.DB(t)
	pgcoordtest.Client(t, dsn)
	observer := connect(t, dsn)
	var n int
	if err := observer.QueryRow(ctxT(t), "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("%d connections to the database after Client; want none", n)
	}
}

// TerminateBackends also ends a backend the Client is opening as it is
// called: a Lock on a key another Client holds, started just before, needs
// a connection of its own to wait on. Whatever the stagger between the two,
// no backend of the Client that started before TerminateBackends was called
// is left when it returns.
func TestTerminateBackendsEndsABackendBeingOpened(t *testing.T) {
	dsn := pgcoordtest.DB(t)
	other := pgcoordtest.Client(t, dsn, pgcoord.WithApplicationName("other"))
	key := pgcoord.HashKey("contended")
	if _, err := other.Lock(ctxT(t), key); err != nil {
		t.Fatal(err)
	}
	admin := connect(t, dsn)
	count := func(t *testing.T, extra string, args ...any) int {
		var n int
		err := admin.QueryRow(ctxT(t), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'pgcoord' `+extra, args...).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	for round := range 20 {
		t.Run(fmt.Sprint("round", round), func(t *testing.T) {
			pgtest.Eventually(t, 10*time.Second, "the backends of earlier rounds to exit", func() bool { return count(t, "") == 0 })
			c := pgcoordtest.Client(t, dsn, short...)
			if _, err := c.Lock(ctxT(t), pgcoord.HashKey("own", fmt.Sprint(round))); err != nil {
				t.Fatal(err)
			}
			go func() { _, _ = c.Lock(ctxT(t), key) }()
			// Not a wait for an outcome: a stagger that moves the call
			// across the few milliseconds in which the waiting backend
			// is being opened.
			time.Sleep(time.Duration(round) * 500 * time.Microsecond)
			var before time.Time
			if err := admin.QueryRow(ctxT(t), "SELECT clock_timestamp()").Scan(&before); err != nil {
				t.Fatal(err)
			}
			ended := pgcoordtest.TerminateBackends(t, c)
			if n := count(t, "AND backend_start < $1", before); n != 0 {
				t.Fatalf("%d backend(s) of the Client that started before TerminateBackends was called are still running after it returned (it ended %v)", n, ended)
			}
		})
	}
}
