package pgcoord

import (
	"context"
	"encoding/binary"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// The cancel requests of lock connections: a statement whose ctx ends is
// cancelled, the request sent again while the statement runs on, and no
// request reaches a later statement of the connection.

// cancelConn opens a pgx connection on dsn whose context watcher is
// pgcoord's cancelHandler with the given deadline delay; dial, if not
// nil, wraps each connection the driver opens (cancel connections too).
func cancelConn(t *testing.T, dsn string, delay time.Duration, dial func(net.Conn) net.Conn) *pgx.Conn {
	t.Helper()
	cc, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cc.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
		return &core.CancelHandler{Conn: pc, DeadlineDelay: delay}
	}
	if dial != nil {
		base := cc.DialFunc
		cc.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := base(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return dial(c), nil
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(ctx)
	})
	return conn
}

// cancelSenders counts the goroutines that send a cancelHandler's
// requests. (The tests that count them do not run in parallel with
// others, whose connections have senders too.)
func cancelSenders() int {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for _, g := range strings.Split(string(buf), "\n\ngoroutine ") {
		if strings.Contains(g, "(*CancelHandler).HandleCancel.func") {
			n++
		}
	}
	return n
}

// settleSenders waits (bounded) until no cancel sender runs, and reports
// how many still do.
func settleSenders(bound time.Duration) int {
	got := cancelSenders()
	pgtest.Poll(bound, func() bool {
		got = cancelSenders()
		return got == 0
	})
	return got
}

// A statement whose ctx ends as it finishes, often before the first
// cancel request is answered, is followed at once by a statement that
// runs longer than the repeats' first intervals: the latter must never be
// cancelled, and no sender goroutine may outlive its statement.
func TestCancelRepeatsNeverReachNextStatement(t *testing.T) {
	dsn := pgtest.DB(t)
	conn := cancelConn(t, dsn, 5*time.Second, nil)
	ctx := testCtx(t)
	if _, err := conn.Exec(ctx, "SELECT 1"); err != nil { // warm up
		t.Fatal(err)
	}
	cancelled := 0
	for i := range 150 {
		sctx, cancel := context.WithCancel(ctx)
		// End ctx from 0 to ~3 ms into a statement of ~2 ms: the cancel
		// lands before, during or after the statement.
		stop := time.AfterFunc(time.Duration(i%30)*100*time.Microsecond, cancel)
		_, err := conn.Exec(sctx, "SELECT pg_sleep(0.002)")
		stop.Stop()
		cancel()
		if err != nil {
			if conn.IsClosed() {
				t.Fatalf("round %d: the statement failed on the connection: %v", i, err)
			}
			cancelled++
		}
		// The next statement: Background ctx, no watch; only a stray
		// cancel request could end it.
		if _, err := conn.Exec(context.Background(), "SELECT pg_sleep(0.03)"); err != nil {
			t.Fatalf("round %d: a statement after a cancelled one failed: %v (a cancel request of the earlier statement reached it)", i, err)
		}
	}
	t.Logf("%d of 150 statements were cancelled", cancelled)
	if got := settleSenders(2 * time.Second); got != 0 {
		t.Fatalf("%d cancel senders run after every statement returned: a sender outlived its statement", got)
	}
}

// The connection is cut while the repeats run (the statement ignores the
// cancel: it waits for a lock and the cancel requests go nowhere because
// the cancel connections are refused): the sender ends when the
// statement returns, not only at the deadline.
func TestCancelRepeatsEndWhenConnectionCut(t *testing.T) {
	dsn := pgtest.DB(t)
	ctx := testCtx(t)
	var mu sync.Mutex
	var first net.Conn
	refuse := false
	conn := cancelConn(t, dsn, 20*time.Second, func(c net.Conn) net.Conn {
		mu.Lock()
		defer mu.Unlock()
		if first == nil {
			first = c
			return c
		}
		if refuse {
			_ = c.Close() // a cancel connection that goes nowhere
		}
		return c
	})
	other := pgtest.Conn(t, dsn)
	k := HashKey("lockcore", "cancel-cut")
	if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1)", k.coreKey().V); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	refuse = true
	mu.Unlock()
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		_, err := conn.Exec(sctx, "SELECT pg_advisory_lock($1)", k.coreKey().V)
		done <- err
	}()
	pgtest.Eventually(t, testTimeout, "the lock waits", func() bool { return waitingOn(t, dsn, k) == 1 })
	cancel()
	// Let a few repeats go out (bounded poll on the goroutine count: the
	// sender runs).
	pgtest.Eventually(t, testTimeout, "the sender runs", func() bool { return cancelSenders() > 0 })
	mu.Lock()
	_ = first.Close()
	mu.Unlock()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("the statement succeeded on a cut connection")
		}
	case <-time.After(testTimeout):
		t.Fatal("the statement did not return after its connection was cut")
	}
	if got := settleSenders(2 * time.Second); got != 0 {
		t.Fatalf("%d cancel senders run after the statement returned on its cut connection: they go on until the deadline (20 s)", got)
	}
}

// lateCancelConn delays a cancel request (and the close of its
// connection) by delay, as a slow network path to the server would: the
// request is written, CancelRequest waits for the server's answer, and the
// bytes reach the server later.
type lateCancelConn struct {
	net.Conn
	delay time.Duration

	mu      sync.Mutex
	pending chan struct{}
}

func (c *lateCancelConn) Write(b []byte) (int, error) {
	if len(b) >= 12 && binary.BigEndian.Uint32(b[4:8]) == 80877102 {
		data := append([]byte(nil), b...)
		done := make(chan struct{})
		c.mu.Lock()
		c.pending = done
		c.mu.Unlock()
		time.AfterFunc(c.delay, func() {
			defer close(done)
			_ = c.Conn.SetDeadline(time.Time{})
			_, _ = c.Conn.Write(data)
			buf := make([]byte, 1)
			_ = c.Conn.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, _ = c.Conn.Read(buf) // the server's close, after it signalled the backend
		})
		return len(b), nil
	}
	return c.Conn.Write(b)
}

func (c *lateCancelConn) Close() error {
	c.mu.Lock()
	p := c.pending
	c.mu.Unlock()
	if p != nil {
		go func() { <-p; _ = c.Conn.Close() }()
		return nil
	}
	return c.Conn.Close()
}

// A cancel request the server has not answered by the handler's deadline
// (deadlineDelay after the cancel) may still be on its way to the backend
// when the statement it was sent for has ended: the connection must not
// run its next statement, which the late request would cancel; it fails
// that statement before sending it instead. Only the cancel packet and
// the close of its connection are delayed, as on a slow path to the
// server.
func TestCancelCutByDeadlineNeverReachesNextStatement(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DB(t)
	const delay = 600 * time.Millisecond // the handler's deadline
	conn := cancelConn(t, dsn, delay, func(c net.Conn) net.Conn {
		return &lateCancelConn{Conn: c, delay: 3 * delay / 2}
	})
	ctx := testCtx(t)
	if _, err := conn.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatal(err)
	}
	// The cancel comes 50 ms into a statement of 300 ms; its request
	// reaches the server 900 ms later, after the statement and after the
	// handler's deadline (650 ms).
	sctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	_, err := conn.Exec(sctx, "SELECT pg_sleep(0.3)")
	t.Logf("first statement: %v", err)
	// The next statement, whose ctx never ends: it must not be cancelled.
	// (Failing without reaching the server, the connection closed, is
	// fine: that is the connection given up on a cancel in doubt.)
	_, err = conn.Exec(context.Background(), "SELECT pg_sleep(1.5)")
	if core.SqlState(err) == "57014" {
		t.Fatalf("a statement after the cancelled one was cancelled by the server: %v (a cancel request sent for the earlier statement, not answered by the handler's deadline, reached it)", err)
	}
	if err != nil && !conn.IsClosed() {
		t.Fatalf("next statement: %v, connection open", err)
	}
	t.Logf("next statement: %v (connection closed: %v)", err, conn.IsClosed())
	// Leave no goroutine of the driver's behind (its own cancel request on
	// close goes through the slow path too).
	closeCtx, cancelClose := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancelClose()
	_ = conn.Close(closeCtx)
	select {
	case <-conn.PgConn().CleanupDone():
	case <-time.After(testTimeout):
		t.Fatal("the connection's clean-up did not finish")
	}
}

// Behind PgBouncer in session pooling mode, whose cancel connection
// closes once PgBouncer has forwarded the request (before the server has
// acted on it), each try beside a waiting Lock interrupts the wait with a
// cancel request. The session must survive: a cancel request sent for
// the wait's slice must not reach a later statement (which the session
// would take for a cancellation nothing asked for, and be lost).
func TestSessionPoolerTriesBesideWaitKeepSession(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	bouncer := pgtest.NewPgBouncer(t, dsn, pgtest.SessionPooling, pgtest.WithPoolSize(4))
	c := newTestClientOn(t, pgtest.Pool(t, bouncer.ConnString()), WithSessionPooler(), WithLossDeadline(10*time.Second))
	s := newTestSession(t, c)
	k, k2 := Int64Key(78_101), Int64Key(78_102)
	_, endWait := lockWaitingOn(t, ctx, dsn, s, k)
	end := time.Now().Add(8 * time.Second)
	n := 0
	for ; n < 3000 && time.Now().Before(end); n++ {
		l, err := s.TryLock(ctx, k2)
		if err == nil {
			err = l.Unlock(ctx)
		}
		if err != nil {
			t.Fatalf("round %d: TryLock+Unlock beside the waiting Lock through PgBouncer: %v (session: %v)", n, err, s.Err())
		}
	}
	t.Logf("%d rounds", n)
	if err := s.Err(); err != nil {
		t.Fatalf("session lost: %v", err)
	}
	endWait()
}
