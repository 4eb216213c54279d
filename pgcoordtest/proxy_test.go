package pgcoordtest_test

import (
	"slices"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"github.com/pgcoord/pgcoord/pgcoordtest"
)

// A test may end while its Proxy is blackholed and its Client still
// holds a lock, or right after Cut or Heal closed the Client's
// connections, or TerminateBackends ended its backends, before the Client
// has noticed: the Client's close then
// cannot confirm the release, which is what the test asked for, and
// neither fails the test nor holds up its cleanup. Behind a blackhole, the
// Client's close gives up after its loss deadline and makes pgx send a
// cancel request on a new connection through the proxy while the proxy
// stops; that connection must not keep the proxy's cleanup waiting for the
// server, which closes it only after authentication_timeout (60 s). A few
// rounds, since the cancel request races with the proxy's stop.
func TestTestMayEndRightAfterAFault(t *testing.T) {
	endings := []struct {
		name string
		drop func(testing.TB, *pgcoordtest.Proxy, *pgcoord.Client)
	}{
		{"blackholed", func(_ testing.TB, p *pgcoordtest.Proxy, _ *pgcoord.Client) { p.Blackhole() }},
		{"cut", func(_ testing.TB, p *pgcoordtest.Proxy, _ *pgcoord.Client) { p.Cut() }},
		{"healed", func(_ testing.TB, p *pgcoordtest.Proxy, _ *pgcoord.Client) { p.Blackhole(); p.Heal() }},
		{"terminated", func(t testing.TB, _ *pgcoordtest.Proxy, c *pgcoord.Client) { pgcoordtest.TerminateBackends(t, c) }},
	}
	for round := range 8 {
		ending := endings[round%len(endings)]
		test := &exampleT{name: "TestEnds" + ending.name}
		start := time.Now()
		done := make(chan struct{})
		go func() {
			defer close(done)
			defer test.cleanup()
			dsn := pgcoordtest.DB(test)
			p := pgcoordtest.NewProxy(test, dsn)
			c := pgcoordtest.Client(test, p.ConnString(), short...)
			if _, err := c.Lock(ctxT(test), pgcoord.HashKey("dropped at the end")); err != nil {
				test.Fatal(err)
			}
			ending.drop(test, p, c)
		}()
		select {
		case <-done:
		case <-time.After(45 * time.Second):
			t.Fatalf("round %d: the test and its cleanup still run after 45 s", round)
		}
		elapsed := time.Since(start)
		if test.Failed() {
			t.Fatalf("round %d: a test that ended with its Client %s failed (see its output above)", round, ending.name)
		}
		if elapsed > 15*time.Second {
			t.Fatalf("round %d: the test and its cleanup took %v; want about the loss deadline (1 s)", round, elapsed)
		}
	}
}

// TerminateBackends reaches the server directly for a Client made on a
// Proxy's ConnString, so a test can partition a Client and have the
// server end its backends, as when the server gives up on a silent
// client: the lock is free for another Client at once, and the
// partitioned one reports it lost.
func TestTerminateBackendsOfAClientBehindABlackholedProxy(t *testing.T) {
	dsn := pgcoordtest.DB(t)
	key := pgcoord.HashKey("terminate behind a blackhole")
	p := pgcoordtest.NewProxy(t, dsn)
	c := pgcoordtest.Client(t, p.ConnString(), short...)
	l, err := c.Lock(ctxT(t), key)
	if err != nil {
		t.Fatal(err)
	}
	pid := holderPID(t, dsn, key)
	if pid == 0 {
		t.Fatal("pg_locks shows no holder of the key")
	}
	p.Blackhole()
	ended := pgcoordtest.TerminateBackends(t, c)
	if !slices.Contains(ended, pid) {
		t.Fatalf("ended backends %v, not %d, which holds the lock", ended, pid)
	}
	other := pgcoordtest.Client(t, dsn)
	l2, err := other.TryLock(ctxT(t), key)
	if err != nil {
		t.Fatalf("TryLock by another Client once the partitioned one's backend ended: %v", err)
	}
	waitDone(t, l, "Blackhole and TerminateBackends")
	if err := l2.Unlock(ctxT(t)); err != nil {
		t.Fatal(err)
	}
}

// TerminateBackend, given a Proxy's ConnString, reaches the server past
// the proxy, so it ends a partitioned Session's backend while the proxy
// is blackholed.
func TestTerminateBackendBehindABlackholedProxy(t *testing.T) {
	dsn := pgcoordtest.DB(t)
	key := pgcoord.HashKey("terminate a session behind a blackhole")
	p := pgcoordtest.NewProxy(t, dsn)
	c := pgcoordtest.Client(t, p.ConnString(), short...)
	s, err := c.NewSession(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	l, err := s.Lock(ctxT(t), key)
	if err != nil {
		t.Fatal(err)
	}
	p.Blackhole()
	pgcoordtest.TerminateBackend(t, p.ConnString(), s.PID())
	if got := holderPID(t, dsn, key); got != 0 {
		t.Fatalf("backend %d holds the key after TerminateBackend", got)
	}
	waitDone(t, l, "Blackhole and TerminateBackend")
}

// Cut closes the connections on both sides: the server frees the
// Client's lock at once (its backend exits), the Client reports it lost,
// and new connections go through, so the Client takes the key again.
func TestProxyCutFreesTheLockOnBothSides(t *testing.T) {
	dsn := pgcoordtest.DB(t)
	key := pgcoord.HashKey("cut")
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
	p.Cut()
	observer := connect(t, dsn)
	pgtest.Eventually(t, 10*time.Second, "the cut connection's backend to exit", func() bool {
		var n int
		err := observer.QueryRow(ctxT(t), "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", old).Scan(&n)
		return err == nil && n == 0
	})
	waitDone(t, l, "Cut")
	l2, err := c.Lock(ctxT(t), key)
	if err != nil {
		t.Fatalf("Lock after Cut: %v", err)
	}
	if got := holderPID(t, dsn, key); got == 0 || got == old {
		t.Fatalf("holder %d after Cut; want a new backend, not %d", got, old)
	}
	if err := l2.Unlock(ctxT(t)); err != nil {
		t.Fatal(err)
	}
}
