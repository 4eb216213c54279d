package pgcoordtest

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// Pool opens a *pgxpool.Pool on connString and closes it in t.Cleanup. The
// pool connects lazily, as pgxpool does. Pool fails t when connString does
// not parse.
func Pool(t testing.TB, connString string) *pgxpool.Pool {
	t.Helper()
	return pgtest.Pool(t, connString)
}

// clients remembers, for each Client made by Client, the backends it
// opened, so that TerminateBackends can find them.
var clients struct {
	sync.Mutex
	m map[*pgcoord.Client]*clientInfo
}

// clientInfo is what TerminateBackends needs of a Client.
type clientInfo struct {
	connString string // the server's, past any Proxy
	poolApp    string // application_name of the pool's own connections

	mu       sync.Mutex
	backends []pgtest.Backend // every backend opened through the Client's pool config
}

func (ci *clientInfo) record(b pgtest.Backend) {
	ci.mu.Lock()
	defer ci.mu.Unlock()
	ci.backends = append(ci.backends, b)
}

// Client returns a [pgcoord.Client] with opts on a pool of its own for
// connString (typically from [DB], or a [Proxy]'s ConnString), and closes
// the Client, then the pool, in t.Cleanup. It does not connect: the
// Client opens its backends when it first needs them, as pgcoord.New's
// do. Client fails t when connString does not parse or pgcoord.New
// refuses opts.
//
// Unlike pgcoord.New's, its Clients are known to [TerminateBackends].
// An error of the Client's close fails t, unless connString is that of a
// [Proxy] whose connections the test blackholed, cut or healed, where the
// close may not be able to confirm its releases: it is logged then.
func Client(t testing.TB, connString string, opts ...pgcoord.Option) *pgcoord.Client {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		t.Fatalf("pgcoordtest: Client: %v", err)
	}
	// TerminateBackends talks to the server directly, past any Proxy, so
	// that it works while the proxy is blackholed.
	ci := &clientInfo{connString: direct(connString), poolApp: cfg.ConnConfig.RuntimeParams["application_name"]}
	// The Client opens its dedicated backends through the pool's connect
	// path, AfterConnect included, so this sees them as well as the
	// pool's own connections. Each is recorded with its start, so that a
	// later backend that gets an ended one's pid is not taken for it.
	after := cfg.AfterConnect
	cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
		b, err := pgtest.ThisBackend(ctx, conn)
		if err != nil {
			return fmt.Errorf("pgcoordtest: %w", err)
		}
		ci.record(b)
		if after != nil {
			return after(ctx, conn)
		}
		return nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pgcoordtest: Client: %v", err)
	}
	t.Cleanup(pool.Close)
	c, err := pgcoord.New(pool, opts...)
	if err != nil {
		t.Fatalf("pgcoordtest: Client: %v", err)
	}
	clients.Lock()
	if clients.m == nil {
		clients.m = make(map[*pgcoord.Client]*clientInfo)
	}
	clients.m[c] = ci
	clients.Unlock()
	t.Cleanup(func() {
		clients.Lock()
		delete(clients.m, c)
		clients.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
		defer cancel()
		err := c.Close(ctx)
		switch {
		case err == nil:
		case droppedProxy(connString):
			// The test dropped the network on purpose: the release
			// cannot be confirmed, and the server frees the locks when
			// the proxy closes the connections.
			t.Logf("pgcoordtest: close Client behind a Proxy that dropped its connections: %v", err)
		default:
			t.Errorf("pgcoordtest: close Client: %v", err)
		}
	})
	return c
}

// TerminateBackends ends every dedicated backend of c, a Client made by
// [Client], with pg_terminate_backend, and returns their process IDs once
// they have left pg_stat_activity. Those are the connections that hold
// and wait for its locks, run its Sessions and its elections' guards, and
// listen for its notifications; the connections of its pool, which its
// Migrate, Leader and Locks use, are left alone (unless they share the
// dedicated ones' application_name). The server frees every lock they
// held; the Client learns it at its next statement or heartbeat, and its
// Locks end with [pgcoord.ErrLockLost], as when an operator or a failover
// ends them.
//
// It ends the backends c has opened by the time it is called: one that c
// is still opening (for a Lock, run at the same time, that needs a
// connection of its own) is not among them, and lives on. Call it once c
// holds, or waits for, what the test means to end: a waiter shows in
// pg_locks.
//
// For a Client made on a [Proxy]'s ConnString, TerminateBackends connects
// to the server behind the proxy, so it ends the backends even while the
// proxy is blackholed.
//
// TerminateBackends fails t when c was not made by Client, and when c has
// no dedicated backend to end: a test of lost locks that ends nothing
// would prove nothing.
func TerminateBackends(t testing.TB, c *pgcoord.Client) []int32 {
	t.Helper()
	clients.Lock()
	ci := clients.m[c]
	clients.Unlock()
	if ci == nil {
		t.Fatal("pgcoordtest: TerminateBackends: the Client was not made by pgcoordtest.Client (or was already closed)")
	}
	ci.mu.Lock()
	backends := append([]pgtest.Backend(nil), ci.backends...)
	ci.mu.Unlock()
	ended, err := pgtest.Terminated(ci.connString, backends, ci.poolApp)
	if err != nil {
		t.Fatalf("pgcoordtest: TerminateBackends: %v", err)
	}
	if len(ended) == 0 && ci.poolApp != "" {
		t.Fatalf("pgcoordtest: TerminateBackends: the Client has no dedicated backend to end: take a lock first; "+
			"the backends named like its pool, application_name %q, are left alone, so the Client's own "+
			"(pgcoord.WithApplicationName, default \"pgcoord\") must be named otherwise", ci.poolApp)
	}
	if len(ended) == 0 {
		t.Fatal("pgcoordtest: TerminateBackends: the Client has no dedicated backend to end (take a lock first)")
	}
	return ended
}

// TerminateBackend ends the backend with process ID pid, such as a
// [pgcoord.Session]'s (Session.PID), with pg_terminate_backend on a fresh
// connection to connString, and returns once it has left
// pg_stat_activity. When connString is a [Proxy]'s ConnString, it
// connects to the server behind the proxy, so it works while the proxy is
// blackholed. It fails t when pid is not a backend of connString's server
// or does not exit within 30 seconds.
func TerminateBackend(t testing.TB, connString string, pid int32) {
	t.Helper()
	pgtest.Terminate(t, direct(connString), pid)
}
