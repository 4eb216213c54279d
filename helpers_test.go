package pgcoord

// Helpers shared by the tests of several files: clients, roles and
// connections of the test server, reads of pg_locks and pg_stat_activity,
// and campaigns run in the background.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// testTimeout bounds every wait in a test: generous for a loaded 2-core
// machine, short enough that a hang fails instead of stalling the suite.
const testTimeout = 30 * time.Second

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	return ctx
}

// newTestClient returns a Client with its own pool on dsn, closed at the
// end of the test.
func newTestClient(t testing.TB, dsn string, opts ...Option) *Client {
	t.Helper()
	return newTestClientOn(t, pgtest.Pool(t, dsn), opts...)
}

func newTestClientOn(t testing.TB, pool *pgxpool.Pool, opts ...Option) *Client {
	t.Helper()
	c, err := New(pool, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(context.Background()); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return c
}

// holder is one granted or waiting advisory lock as pg_locks shows it.
type holder struct {
	pid     int32
	shared  bool
	granted bool
}

// lockState reads pg_locks for the database of dsn and groups the rows by
// decoded key.
func lockState(t testing.TB, dsn string) map[Key][]holder {
	t.Helper()
	out := make(map[Key][]holder)
	for _, r := range pgtest.AdvisoryLocks(t, dsn) {
		k, err := KeyFromLock(r.ClassID, r.ObjID, r.ObjSubID)
		if err != nil {
			t.Fatal(err)
		}
		out[k] = append(out[k], holder{pid: r.PID, shared: r.Mode == "ShareLock", granted: r.Granted})
	}
	return out
}

// grantedTo returns the pids that hold k (granted) in pg_locks.
func grantedTo(t testing.TB, dsn string, k Key) []int32 {
	t.Helper()
	var pids []int32
	for _, h := range lockState(t, dsn)[k] {
		if h.granted {
			pids = append(pids, h.pid)
		}
	}
	return pids
}

// waitingOn reports how many backends wait (not granted) for k.
func waitingOn(t testing.TB, dsn string, k Key) int {
	t.Helper()
	n := 0
	for _, h := range lockState(t, dsn)[k] {
		if !h.granted {
			n++
		}
	}
	return n
}

// heldOnlyBy asserts that exactly the given backend holds k, in pg_locks.
func heldOnlyBy(t testing.TB, dsn string, k Key, pid int32) {
	t.Helper()
	if got := grantedTo(t, dsn, k); len(got) != 1 || got[0] != pid {
		t.Fatalf("pg_locks: %v held by %v, want only backend %d", k, got, pid)
	}
}

// notHeld asserts that nobody holds or waits for k, in pg_locks.
func notHeld(t testing.TB, dsn string, k Key) {
	t.Helper()
	if rows := lockState(t, dsn)[k]; len(rows) != 0 {
		t.Fatalf("pg_locks: %v still has %+v, want no holder or waiter", k, rows)
	}
}

// result of an acquire run in a goroutine.
type result struct {
	l   *Lock
	err error
}

// goLock runs acquire in a goroutine and returns where its result arrives.
func goLock(acquire func() (*Lock, error)) <-chan result {
	ch := make(chan result, 1)
	go func() {
		l, err := acquire()
		ch <- result{l, err}
	}()
	return ch
}

// receive waits, bounded, for a result.
func receive(t testing.TB, ch <-chan result) result {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(testTimeout):
		t.Fatal("acquire did not return in time")
		return result{}
	}
}

// stillWaiting asserts that an acquire has not returned yet.
func stillWaiting(t testing.TB, ch <-chan result) {
	t.Helper()
	select {
	case r := <-ch:
		t.Fatalf("acquire returned (%v, %v) while it should still wait", r.l, r.err)
	default:
	}
}

// awaitEnd waits, bounded, until l has ended (its Done channel closed).
func awaitEnd(t testing.TB, l *Lock, what string) {
	t.Helper()
	select {
	case <-l.Done():
	case <-time.After(testTimeout):
		t.Fatalf("lock did not end: %s", what)
	}
}

func mustUnlock(t testing.TB, l *Lock) {
	t.Helper()
	if err := l.Unlock(context.Background()); err != nil {
		t.Fatalf("Unlock: %v", err)
	}
}

// refusedAcquire checks that acquires on c fail because the server cannot
// be used, for the reason want: a TryLock at once, and a blocking Lock,
// which keeps trying until its ctx ends, with its deadline and want.
func refusedAcquire(t testing.TB, c *Client, k Key, want error) {
	t.Helper()
	ctx := testCtx(t)
	if _, err := c.TryLock(ctx, k); !errors.Is(err, want) {
		t.Fatalf("TryLock: %v, want %v", err, want)
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if _, err := c.Lock(short, k); !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, want) {
		t.Fatalf("Lock with a 300ms deadline: %v, want DeadlineExceeded with the last connection error (%v)", err, want)
	}
}

// keyHolders reads pg_locks on conn for k: every backend that holds or
// waits for it. Unlike lockState it reports errors instead of failing the
// test, so it can run in a goroutine of the test's own.
func keyHolders(ctx context.Context, conn *pgx.Conn, k Key) ([]holder, error) {
	classid, objid, objsubid := k.coreKey().LockColumns()
	rows, err := conn.Query(ctx, `
SELECT pid, mode = 'ShareLock', granted FROM pg_locks
WHERE locktype = 'advisory'
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND classid::int8 = $1 AND objid::int8 = $2 AND objsubid = $3`, int64(classid), int64(objid), objsubid)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (holder, error) {
		var h holder
		err := row.Scan(&h.pid, &h.shared, &h.granted)
		return h, err
	})
}

// newTestRole creates a login role of the test's own, named from prefix,
// with no privilege beyond LOGIN, drops it when the test ends, and returns
// its name and dsn with the role as the user. When the role of dsn may not
// create roles (SQLSTATE 42501, as on a server given by
// PGTEST_DATABASE_URL), it skips the test saying so, or fails it under CI;
// any other error fails the test.
func newTestRole(t testing.TB, dsn, prefix string) (role, roleDSN string) {
	t.Helper()
	admin := pgtest.Conn(t, dsn)
	role = fmt.Sprintf("%s_%d_%d", prefix, os.Getpid(), time.Now().UnixNano()%1e9)
	if _, err := admin.Exec(testCtx(t), "CREATE ROLE "+role+" LOGIN"); err != nil {
		if core.SqlState(err) == "42501" {
			pgtest.SkipOrFail(t, "this test needs a role of its own, and the test server's role may not create roles: %v", err)
		}
		t.Fatalf("create role: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		if _, err := admin.Exec(ctx, "DROP ROLE "+role); err != nil {
			t.Errorf("drop role: %v", err)
		}
	})
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	return role, strings.Replace(dsn, "://"+cfg.User+"@", "://"+role+"@", 1)
}

// leaseExpiry matches the loss that a session declares when nothing has
// proved its connection alive for the loss deadline (checkLease).
var leaseExpiry = regexp.MustCompile(`no answer from the server for ([0-9.]+[a-zµ]+) \(loss deadline`)

// leaseLostAt returns when the session s declared its locks lost because
// its lease ran out, by the library's own clock: the start of the last
// statement the server answered (lastOK) plus the silence it measured at
// the declaration, which the loss error states. A late wake-up of the
// test's goroutine does not count.
func leaseLostAt(t testing.TB, s *core.Session) time.Time {
	t.Helper()
	<-s.Done()
	m := leaseExpiry.FindStringSubmatch(fmt.Sprint(s.Err()))
	if m == nil {
		t.Fatalf("session lost with %v, not by its lease running out", s.Err())
	}
	age, err := time.ParseDuration(m[1])
	if err != nil {
		t.Fatal(err)
	}
	s.State.Lock()
	defer s.State.Unlock()
	return s.LastOK.Add(age)
}

// appConnections counts the connections whose application_name is app.
func appConnections(t testing.TB, pool *pgxpool.Pool, app string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", app).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// errResult is the error a goroutine's call returned, and when.
type errResult struct {
	err error
	at  time.Time
}

// rowTerm reads the term of an election's row, or 0 when the row cannot be
// read (no row yet, or a pool connection that a restart ended).
func rowTerm(ctx context.Context, pool *pgxpool.Pool, schema, name string) Term {
	var n int64
	if err := pool.QueryRow(ctx, "SELECT term FROM "+quoteIdent(schema)+".leaders WHERE name = $1", name).Scan(&n); err != nil {
		return 0
	}
	return Term(n)
}

// quoteIdent quotes a schema name for SQL.
func quoteIdent(s string) string { return `"` + s + `"` }

// campaignResult is what a Campaign run in a goroutine returned, and when.
type campaignResult struct {
	ld  *Leadership
	err error
	at  time.Time
}

func goCampaign(ctx context.Context, e *Election) <-chan campaignResult {
	ch := make(chan campaignResult, 1)
	go func() {
		ld, err := e.Campaign(ctx)
		ch <- campaignResult{ld, err, time.Now()}
	}()
	return ch
}

func receiveCampaign(t testing.TB, ch <-chan campaignResult, what string) campaignResult {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(testTimeout):
		t.Fatalf("campaign did not return in time: %s", what)
		return campaignResult{}
	}
}

// silentClient returns a Client whose every connection goes through a
// proxy that the test can silence, so that the Client learns of a loss only
// by its own loss deadline.
func silentClient(t *testing.T, dsn string, opts ...Option) (*Client, *pgtest.Proxy) {
	t.Helper()
	proxy := pgtest.NewProxy(t, dsn)
	c, err := New(pgtest.Pool(t, dsn, proxy.Route), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c, proxy
}

// awaitLeadershipEnd waits, bounded, until a leadership has ended, and
// returns when its context was cancelled by its own clock.
func awaitLeadershipEnd(t testing.TB, ld *Leadership) time.Time {
	t.Helper()
	select {
	case <-ld.Done():
	case <-time.After(testTimeout):
		t.Fatalf("term %d did not end", ld.Term())
	}
	return ld.cancelledAt()
}

// queryStart returns pg_stat_activity.query_start of backend pid: when its
// last statement (for an idle session, its last heartbeat) began.
func queryStart(t testing.TB, pool *pgxpool.Pool, pid int32) time.Time {
	t.Helper()
	var at time.Time
	if err := pool.QueryRow(testCtx(t), "SELECT query_start FROM pg_stat_activity WHERE pid = $1", pid).Scan(&at); err != nil {
		t.Fatalf("query_start of backend %d: %v", pid, err)
	}
	return at
}

// guardSessionPID returns the backend pid of c's guard session, 0 if it
// has none.
func guardSessionPID(c *Client) int32 {
	c.guardMu.Lock()
	defer c.guardMu.Unlock()
	if c.guard == nil {
		return 0
	}
	return c.guard.PID()
}

// clientAndSession runs test as two parallel subtests, "client" and
// "session" (its name), for a promise that holds for the locks of a
// Client's backends and for those of a Session.
func clientAndSession(t *testing.T, test func(t *testing.T, name string, onSession bool)) {
	t.Helper()
	for _, onSession := range []bool{false, true} {
		name := "client"
		if onSession {
			name = "session"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			test(t, name, onSession)
		})
	}
}
