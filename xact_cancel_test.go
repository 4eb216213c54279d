package pgcoord

import (
	"context"
	"errors"
	"net"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// What a wait in XactLock leaves behind when its ctx ends, with pgx's
// default context handling and with a cancel request. Scenario: another
// connection holds k2; tx takes k1 with XactLock, then waits in XactLock(k2)
// until ctx's deadline passes. pg_locks and pg_stat_activity are read on
// connections of their own.

// xactCancelDeadline is how long the ended wait's ctx lives. The observer
// must see the wait in pg_locks before the deadline, so that the deadline
// certainly lands during the wait and not before the statement is sent
// (TestXactCancelBeforeSend covers that case). On an idle machine the wait
// shows within a few milliseconds, but on this 2-core machine under a load
// of 10 the test process was seen to stall for 1.6 s; three seconds leaves
// room for that.
const xactCancelDeadline = 3 * time.Second

// xactCancelReleaseBound bounds the time from ctx's deadline to pg_locks
// showing k1 free. Measured on this 2-core machine by polling pg_locks
// without pause: 12 to 35 ms with either handler, with or without the race
// detector, and in two runs out of 32 under a load average of 10, 0.55 s
// and 1.6 s (in the second the test process itself had stalled: XactLock
// returned 1.7 s after the deadline). The polls here back off to 20 ms between reads, and with
// the cancel request handler they start only once XactLock has returned,
// about 100 ms later. Five seconds is three times the worst stall seen and
// still tells a released key from one that is not: nothing else would
// release k1 while the test runs, as k2's holder never lets go.
const xactCancelReleaseBound = 5 * time.Second

var xactCancelK1, xactCancelK2 = Int64Key(101), Int64Key(102)

// xactCancelConn opens a connection on dsn with cfg adjusted by configure,
// closed in cleanup.
func xactCancelConn(t *testing.T, dsn string, configure func(*pgx.ConnConfig)) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	configure(cfg)
	ctx, cancel := context.WithTimeout(context.Background(), xactWait)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(ctx)
	})
	return conn
}

// xactCancelHandlers are the two ways of ending a wait the tests cover.
var xactCancelHandlers = []struct {
	name      string
	configure func(*pgx.ConnConfig)
}{
	{"default handler", func(*pgx.ConnConfig) {}},
	{"cancel request handler", func(c *pgx.ConnConfig) {
		c.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
			return &pgconn.CancelRequestContextWatcherHandler{Conn: pc, DeadlineDelay: 10 * time.Second}
		}
	}},
}

// xactCancelBackend returns pg_stat_activity.state of backend pid, read on
// observer, and whether the backend exists.
func xactCancelBackend(t *testing.T, observer *pgx.Conn, pid int32) (state string, exists bool) {
	t.Helper()
	err := observer.QueryRow(t.Context(), "SELECT coalesce(state, '') FROM pg_stat_activity WHERE pid = $1", pid).Scan(&state)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", false
	}
	if err != nil {
		t.Fatalf("pg_stat_activity for backend %d: %v", pid, err)
	}
	return state, true
}

// xactCancelEnded is what xactCancelWait observed.
type xactCancelEnded struct {
	tx       pgx.Tx
	pid      int32         // backend of tx
	holder   int32         // backend holding k2
	deadline time.Time     // ctx's deadline
	err      error         // returned by XactLock(k2)
	returned time.Duration // from ctx's deadline to XactLock's return
	k1Free   bool          // k1 free in pg_locks when first read after the return
}

// xactCancelWait holds k2 on a connection of its own, takes k1 in a
// transaction on conn, then calls XactLock(k2) there with a ctx that expires
// after xactCancelDeadline, and checks that the wait was under way before
// the deadline.
func xactCancelWait(t *testing.T, dsn string, conn *pgx.Conn) xactCancelEnded {
	t.Helper()
	holderConn := pgtest.Conn(t, dsn)
	htx, err := holderConn.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = htx.Rollback(context.Background()) })
	if err := XactLock(t.Context(), htx, xactCancelK2); err != nil {
		t.Fatal(err)
	}
	holderPID := int32(holderConn.PgConn().PID())

	tx, err := conn.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	pid := int32(conn.PgConn().PID())
	if err := XactLock(t.Context(), tx, xactCancelK1); err != nil {
		t.Fatal(err)
	}
	heldOnlyBy(t, dsn, xactCancelK1, pid) // also opens the pg_locks observer

	ctx, cancel := context.WithTimeout(t.Context(), xactCancelDeadline)
	defer cancel()
	deadline, _ := ctx.Deadline()
	type ret struct {
		err error
		at  time.Time
	}
	done := make(chan ret, 1)
	go func() {
		err := XactLock(ctx, tx, xactCancelK2)
		done <- ret{err, time.Now()}
	}()

	// The wait must be seen in pg_locks by a read that started before the
	// deadline.
	var readAt time.Time
	pgtest.Eventually(t, xactWait, "tx to wait for k2 in pg_locks", func() bool {
		readAt = time.Now()
		return slices.Contains(lockState(t, dsn)[xactCancelK2], holder{pid: pid, granted: false})
	})
	if !readAt.Before(deadline) {
		t.Fatalf("the wait for k2 showed in pg_locks only %v after ctx's deadline", readAt.Sub(deadline))
	}

	var r ret
	select {
	case r = <-done:
	case <-time.After(xactWait):
		t.Fatalf("XactLock did not return within %v", xactWait)
	}
	return xactCancelEnded{
		tx:       tx,
		pid:      pid,
		holder:   holderPID,
		err:      r.err,
		returned: r.at.Sub(deadline),
		k1Free:   len(grantedTo(t, dsn, xactCancelK1)) == 0,
		deadline: deadline,
	}
}

// xactCancelReleased checks what both handlers guarantee once XactLock has
// returned: the error wraps context.DeadlineExceeded, k1 shows free in
// pg_locks within xactCancelReleaseBound of the deadline, and k2 is held by
// its holder with nobody queued behind it. It returns how long after the
// deadline k1 was seen free.
func xactCancelReleased(t *testing.T, dsn string, e xactCancelEnded) time.Duration {
	t.Helper()
	if !errors.Is(e.err, context.DeadlineExceeded) {
		t.Fatalf("XactLock whose ctx expired during the wait: got %v, want an error wrapping context.DeadlineExceeded", e.err)
	}
	var seenAt time.Time
	pgtest.Eventually(t, xactWait, "k1 to be free in pg_locks", func() bool {
		free := len(grantedTo(t, dsn, xactCancelK1)) == 0
		seenAt = time.Now()
		return free
	})
	free := seenAt.Sub(e.deadline)
	if free > xactCancelReleaseBound {
		t.Fatalf("k1 was seen free %v after ctx's deadline, want at most %v", free, xactCancelReleaseBound)
	}
	if got, want := lockState(t, dsn)[xactCancelK2], []holder{{pid: e.holder, granted: true}}; !slices.Equal(got, want) {
		t.Fatalf("pg_locks for k2: %+v, want only the holder %d, granted, and no waiter", got, e.holder)
	}
	t.Logf("XactLock returned %v after the deadline (k1 free then: %v); k1 seen free %v after it", e.returned, e.k1Free, free)
	return free
}

// TestXactCancelDefaultHandler: with pgx's default context handling, the
// deadline makes XactLock return at once with a client-side timeout; pgx
// has already marked the connection closed, and in the background sends a
// cancel request, then Terminate. The cancel aborts the statement and with
// it the transaction, so k1 is released shortly after XactLock returned;
// then the backend exits. Rollback has nothing left to roll back and
// fails.
func TestXactCancelDefaultHandler(t *testing.T) {
	dsn := pgtest.DB(t)
	conn := xactCancelConn(t, dsn, xactCancelHandlers[0].configure)
	observer := pgtest.Conn(t, dsn)
	e := xactCancelWait(t, dsn, conn)
	if !conn.IsClosed() {
		t.Fatal("connection still open after the ended wait; pgx's default handler closes it")
	}
	if !pgconn.Timeout(e.err) {
		t.Errorf("error %v: want pgconn.Timeout to report it (the socket deadline ended the read)", e.err)
	}
	var pe *pgconn.PgError
	if errors.As(e.err, &pe) {
		t.Errorf("error %v carries server error %s; the default handler does not wait for the server's answer", e.err, pe.Code)
	}
	xactCancelReleased(t, dsn, e)
	pgtest.Eventually(t, xactWait, "the backend to exit", func() bool {
		_, exists := xactCancelBackend(t, observer, e.pid)
		return !exists
	})
	if err := e.tx.Rollback(t.Context()); err == nil {
		t.Fatal("Rollback on the closed connection succeeded; want an error")
	}
	notHeld(t, dsn, xactCancelK1)
}

// TestXactCancelRequestHandler: with pgconn.CancelRequestContextWatcherHandler
// (and a DeadlineDelay longer than the server takes to answer), pgx sends a
// cancel request when ctx ends and waits for the server's answer. The
// statement fails with SQLSTATE 57014, the transaction is aborted and its
// keys released before XactLock returns. The connection stays open, the
// transaction in the failed state until Rollback, after which the
// connection works as before.
func TestXactCancelRequestHandler(t *testing.T) {
	dsn := pgtest.DB(t)
	conn := xactCancelConn(t, dsn, xactCancelHandlers[1].configure)
	observer := pgtest.Conn(t, dsn)
	e := xactCancelWait(t, dsn, conn)
	var pe *pgconn.PgError
	if !errors.As(e.err, &pe) || pe.Code != "57014" {
		t.Fatalf("XactLock whose ctx expired: got %v, want SQLSTATE 57014 (query_canceled)", e.err)
	}
	if !e.k1Free {
		t.Fatal("k1 still held in pg_locks when XactLock returned; the server releases it before answering")
	}
	xactCancelReleased(t, dsn, e)
	if conn.IsClosed() {
		t.Fatal("connection closed after the cancelled wait; the cancel request handler keeps it")
	}
	if st, _ := xactCancelBackend(t, observer, e.pid); st != xactAbortedState {
		t.Fatalf("backend state after the cancelled wait: %q, want %q", st, xactAbortedState)
	}
	if _, err := e.tx.Exec(t.Context(), "SELECT 1"); !errors.As(err, &pe) || pe.Code != "25P02" {
		t.Fatalf("statement in the aborted transaction: got %v, want SQLSTATE 25P02", err)
	}
	if err := e.tx.Rollback(t.Context()); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
	if st, _ := xactCancelBackend(t, observer, e.pid); st != "idle" {
		t.Fatalf("backend state after Rollback: %q, want idle", st)
	}

	// The same connection, and backend, takes k1 again.
	tx, err := conn.Begin(t.Context())
	if err != nil {
		t.Fatalf("begin after the rollback: %v", err)
	}
	if err := XactLock(t.Context(), tx, xactCancelK1); err != nil {
		t.Fatalf("XactLock after the rollback: %v", err)
	}
	heldOnlyBy(t, dsn, xactCancelK1, e.pid)
	if err := tx.Commit(t.Context()); err != nil {
		t.Fatalf("commit: %v", err)
	}
	notHeld(t, dsn, xactCancelK1)
}

// TestXactCancelBeforeSend: a ctx that is already done when XactLock is
// called sends nothing, whatever the handler: the error wraps the
// context's, the transaction is not aborted, the keys it holds stay held
// and the connection stays open.
func TestXactCancelBeforeSend(t *testing.T) {
	for _, h := range xactCancelHandlers {
		t.Run(h.name, func(t *testing.T) {
			dsn := pgtest.DB(t)
			conn := xactCancelConn(t, dsn, h.configure)
			observer := pgtest.Conn(t, dsn)
			pid := int32(conn.PgConn().PID())
			tx, err := conn.Begin(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
			if err := XactLock(t.Context(), tx, xactCancelK1); err != nil {
				t.Fatal(err)
			}

			ctx, cancel := context.WithDeadline(t.Context(), time.Now())
			defer cancel()
			err = XactLock(ctx, tx, xactCancelK2)
			if !errors.Is(err, context.DeadlineExceeded) || !pgconn.SafeToRetry(err) {
				t.Fatalf("XactLock with an expired ctx: got %v, want an error wrapping context.DeadlineExceeded that pgconn.SafeToRetry accepts (nothing sent)", err)
			}
			if conn.IsClosed() {
				t.Fatal("connection closed by a call that sent nothing")
			}
			heldOnlyBy(t, dsn, xactCancelK1, pid)
			notHeld(t, dsn, xactCancelK2)
			if st, _ := xactCancelBackend(t, observer, pid); st != "idle in transaction" {
				t.Fatalf("backend state: %q, want %q (not aborted)", st, "idle in transaction")
			}
			if err := XactLock(t.Context(), tx, xactCancelK2); err != nil {
				t.Fatalf("XactLock in the same transaction: %v", err)
			}
			heldOnlyBy(t, dsn, xactCancelK2, pid)
			if err := tx.Commit(t.Context()); err != nil {
				t.Fatalf("commit: %v", err)
			}
			notHeld(t, dsn, xactCancelK1)
			notHeld(t, dsn, xactCancelK2)
		})
	}
}

// TestXactCancelNeedsCancelRequest: what frees the keys of an ended wait is
// the cancel request, not the closed connection. The test closes the socket
// of a waiting transaction itself, which sends pgx down the same path as a
// deadline (mark the connection closed, send a cancel request, Terminate,
// close), and makes every dial after the first fail, so that the cancel
// request never reaches the server. Once pgx is done, the backend still
// holds k1 and waits for k2: PostgreSQL does not look at the client's socket
// while it waits on a lock, unless client_connection_check_interval is set,
// in which case it notices the lost client and ends the backend.
func TestXactCancelNeedsCancelRequest(t *testing.T) {
	for _, interval := range []string{"", "50ms"} {
		name := "client_connection_check_interval unset"
		if interval != "" {
			name = "client_connection_check_interval " + interval
		}
		t.Run(name, func(t *testing.T) {
			dsn := pgtest.DB(t)
			observer := pgtest.Conn(t, dsn)
			holderConn := pgtest.Conn(t, dsn)
			htx, err := holderConn.Begin(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = htx.Rollback(context.Background()) })
			if err := XactLock(t.Context(), htx, xactCancelK2); err != nil {
				t.Fatal(err)
			}
			holderPID := int32(holderConn.PgConn().PID())

			var dials atomic.Int32
			conn := xactCancelConn(t, dsn, func(c *pgx.ConnConfig) {
				dial := c.DialFunc
				c.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
					if dials.Add(1) > 1 {
						return nil, errors.New("pgcoord: test refuses every dial after the first")
					}
					return dial(ctx, network, addr)
				}
				if interval != "" {
					c.RuntimeParams["client_connection_check_interval"] = interval
				}
			})
			pid := int32(conn.PgConn().PID())
			tx, err := conn.Begin(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if err := XactLock(t.Context(), tx, xactCancelK1); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- XactLock(t.Context(), tx, xactCancelK2) }()
			pgtest.Eventually(t, xactWait, "tx to wait for k2 in pg_locks", func() bool {
				return slices.Contains(lockState(t, dsn)[xactCancelK2], holder{pid: pid, granted: false})
			})

			closedAt := time.Now()
			if err := conn.PgConn().Conn().Close(); err != nil {
				t.Fatal(err)
			}
			if err := xactRecv(t, done, "XactLock"); err == nil {
				t.Fatal("XactLock on a closed socket succeeded")
			}
			select {
			case <-conn.PgConn().CleanupDone():
			case <-time.After(xactWait):
				t.Fatalf("pgx did not finish closing the connection within %v", xactWait)
			}
			if n := dials.Load(); n != 2 {
				t.Fatalf("%d dials, want 2: the connection and one refused cancel request", n)
			}

			if interval == "" {
				// pgx has nothing left in flight; the server has not
				// noticed.
				heldOnlyBy(t, dsn, xactCancelK1, pid)
				heldOnlyBy(t, dsn, xactCancelK2, holderPID)
				if rows := lockState(t, dsn)[xactCancelK2]; len(rows) != 2 || !slices.Contains(rows, holder{pid: pid}) {
					t.Fatalf("pg_locks for k2: %+v, want the holder %d and backend %d waiting", rows, holderPID, pid)
				}
				// The wait ends when k2's holder lets go; then the backend
				// finds its client gone and exits.
				if err := htx.Rollback(t.Context()); err != nil {
					t.Fatal(err)
				}
			}
			var freeAt time.Time
			pgtest.Eventually(t, xactWait, "k1 to be free in pg_locks", func() bool {
				free := len(grantedTo(t, dsn, xactCancelK1)) == 0
				freeAt = time.Now()
				return free
			})
			if interval != "" {
				if d := freeAt.Sub(closedAt); d > xactCancelReleaseBound {
					t.Fatalf("k1 seen free %v after the socket closed, want at most %v", d, xactCancelReleaseBound)
				}
				t.Logf("k1 seen free %v after the socket closed", freeAt.Sub(closedAt))
				heldOnlyBy(t, dsn, xactCancelK2, holderPID) // k2's holder never let go
			}
			pgtest.Eventually(t, xactWait, "the backend to exit", func() bool {
				_, exists := xactCancelBackend(t, observer, pid)
				return !exists
			})
		})
	}
}

// TestXactCancelRequestHandlerSavepoint: under the cancel request handler,
// a wait cancelled inside a savepoint aborts only the subtransaction: when
// XactLock returns (SQLSTATE 57014), the key it took after the savepoint is
// free and the key taken before the savepoint is still held; after ROLLBACK
// TO SAVEPOINT the transaction goes on and commits, releasing it.
func TestXactCancelRequestHandlerSavepoint(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	conn := xactCancelConn(t, dsn, xactCancelHandlers[1].configure)
	holder := xactCancelConn(t, dsn, func(*pgx.ConnConfig) {})
	k0 := Int64Key(100) // before xactCancelK1 and xactCancelK2 in canonical order
	htx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = htx.Rollback(context.Background()) }()
	if err := XactLock(ctx, htx, xactCancelK2); err != nil {
		t.Fatal(err)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	pid := xactPID(tx)
	if err := XactLock(ctx, tx, k0); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SAVEPOINT s"); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- XactLock(cctx, tx, xactCancelK2, xactCancelK1) }()
	xactEventuallyHeld(t, dsn, pid, xactEx(k0), xactEx(xactCancelK1), xactWaitingEx(xactCancelK2))
	cancel()
	err = xactRecv(t, done, "XactLock")
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "57014" || !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled XactLock in a savepoint: got %v, want SQLSTATE 57014 wrapping context.Canceled", err)
	}
	xactWantHeld(t, dsn, pid, xactEx(k0))
	if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT s"); err != nil {
		t.Fatalf("ROLLBACK TO SAVEPOINT: %v", err)
	}
	xactWantHeld(t, dsn, pid, xactEx(k0))
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit: %v", err)
	}
	xactWantHeld(t, dsn, pid)
}
