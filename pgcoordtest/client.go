package pgcoordtest

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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
	connString string      // the server's, past any Proxy
	poolApp    string      // application_name of the pool's own connections
	terminated atomic.Bool // TerminateBackends has ended backends of the Client

	mu       sync.Mutex
	backends []pgtest.Backend      // every backend opened through the Client's pool config
	opening  map[*opening]struct{} // connects under way, whose backends are not recorded yet
}

// opening is one dial of a connect of the Client's, from the call of the
// dialer until AfterConnect records the backend, or the connect fails and
// its socket is closed.
type opening struct {
	since time.Time
	conn  net.Conn // nil while the dial runs
}

func (ci *clientInfo) record(b pgtest.Backend, conn net.Conn) {
	ci.mu.Lock()
	defer ci.mu.Unlock()
	ci.backends = append(ci.backends, b)
	for o := range ci.opening {
		if o.conn == conn {
			delete(ci.opening, o)
		}
	}
}

// dialer wraps dial so that each dial is under way in ci from its call
// until the connect has ended.
func (ci *clientInfo) dialer(dial pgconn.DialFunc) pgconn.DialFunc {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		o := &opening{since: time.Now()}
		ci.mu.Lock()
		ci.opening[o] = struct{}{}
		ci.mu.Unlock()
		conn, err := dial(ctx, network, addr)
		ci.mu.Lock()
		defer ci.mu.Unlock()
		if err != nil {
			delete(ci.opening, o)
		} else {
			o.conn = conn
		}
		return conn, err
	}
}

// settle waits, for at most settleWait, until every connect that was under
// way at start has ended: its backend recorded, or its socket closed.
func (ci *clientInfo) settle(start time.Time) {
	pgtest.Poll(settleWait, func() bool {
		ci.mu.Lock()
		defer ci.mu.Unlock()
		left := 0
		for o := range ci.opening {
			switch {
			case o.conn != nil && socketClosed(o.conn):
				delete(ci.opening, o) // the connect failed
			case o.since.Before(start):
				left++
			}
		}
		return left == 0
	})
}

// settleWait bounds how long TerminateBackends waits for the Client's
// connects under way to end.
const settleWait = 10 * time.Second

// socketClosed reports whether conn has been closed.
func socketClosed(conn net.Conn) bool {
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return true
	}
	return rc.Control(func(uintptr) {}) != nil
}

// netConn returns the socket under conn's TLS, if any.
func netConn(conn net.Conn) net.Conn {
	if tc, ok := conn.(interface{ NetConn() net.Conn }); ok {
		return tc.NetConn()
	}
	return conn
}

// Client returns a [pgcoord.Client] with opts on a pool of its own for
// connString (typically from [DB], or a [Proxy]'s ConnString), and closes
// the Client, then the pool, in t.Cleanup. It does not connect: the
// Client opens its backends when it first needs them, as pgcoord.New's
// do. Client fails t when connString does not parse or pgcoord.New
// refuses opts.
//
// Unlike pgcoord.New's, its Clients are known to [TerminateBackends].
// An error of the Client's close fails t, unless the test ended the
// Client's backends ([TerminateBackends]) or connString is that of a
// [Proxy] whose connections the test blackholed, cut or healed: the close
// may then be unable to confirm its releases, which is logged.
func Client(t testing.TB, connString string, opts ...pgcoord.Option) *pgcoord.Client {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		t.Fatalf("pgcoordtest: Client: %v", err)
	}
	// TerminateBackends talks to the server directly, past any Proxy, so
	// that it works while the proxy is blackholed.
	ci := &clientInfo{connString: direct(connString), poolApp: cfg.ConnConfig.RuntimeParams["application_name"], opening: map[*opening]struct{}{}}
	// The Client opens its dedicated backends through the pool's connect
	// path, AfterConnect included, so this sees them as well as the
	// pool's own connections. Each is recorded with its start, so that a
	// later backend that gets an ended one's pid is not taken for it.
	// Each connect's dials are followed from the dialer on, so that
	// TerminateBackends can wait for a connect under way to end.
	before := cfg.BeforeConnect
	cfg.BeforeConnect = func(ctx context.Context, cc *pgx.ConnConfig) error {
		if before != nil {
			if err := before(ctx, cc); err != nil {
				return err
			}
		}
		if cc.DialFunc == nil {
			cc.DialFunc = (&net.Dialer{}).DialContext
		}
		cc.DialFunc = ci.dialer(cc.DialFunc)
		return nil
	}
	after := cfg.AfterConnect
	cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
		b, err := pgtest.ThisBackend(ctx, conn)
		if err != nil {
			return fmt.Errorf("pgcoordtest: %w", err)
		}
		ci.record(b, netConn(conn.PgConn().Conn()))
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
		case ci.terminated.Load():
			// The test ended the backends on purpose, and the Client
			// may not have noticed yet.
			t.Logf("pgcoordtest: close Client whose backends TerminateBackends ended: %v", err)
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
// It ends the backends c has opened by the time it is called, and those c
// is opening then (for a Lock, run at the same time, that needs a
// connection of its own): it waits for such a connect to end, for at most
// 10 seconds.
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
	ci.settle(time.Now())
	ci.mu.Lock()
	backends := append([]pgtest.Backend(nil), ci.backends...)
	ci.mu.Unlock()
	ci.terminated.Store(true)
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
