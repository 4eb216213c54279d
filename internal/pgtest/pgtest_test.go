package pgtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
)

// orphanEnv makes the test binary, started by TestServerDiesWithTestBinary
// (1) or TestPgBouncerDiesWithTestBinary (pgbouncer), start a server, and a
// PgBouncer in front of it, and then panic without running any cleanup.
const orphanEnv = "PGTEST_ORPHAN_CHILD"

func TestMain(m *testing.M) {
	if v := os.Getenv(orphanEnv); v != "" {
		orphan(v == "pgbouncer")
	}
	Main(leakChecked{m})
}

// leakChecked fails the run if a goroutine other than the one that owns
// the shared server's postmaster outlives the tests: observers, admin and
// probe connections must all be closed by then.
type leakChecked struct{ m *testing.M }

// serverGoroutine is the function of the goroutine that owns a child
// process for its lifetime; packages using goleak ignore it by this name.
const serverGoroutine = "github.com/pgcoord/pgcoord/internal/pgtest.startChild.func1"

func (l leakChecked) Run() int {
	code := l.m.Run()
	if code != 0 {
		return code
	}
	if err := goleak.Find(goleak.IgnoreAnyFunction(serverGoroutine)); err != nil {
		fmt.Fprintln(os.Stderr, "goroutine leak after all tests:", err)
		return 1
	}
	return code
}

// orphan starts a private server, prints its postmaster's pid and
// directory, and, if withBouncer, starts a PgBouncer in front of it and
// prints its pid and directory too; then it panics, as a test that times out
// or panics would.
func orphan(withBouncer bool) {
	l, err := getLocal()
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(3)
	}
	s, err := newServer(l, nil)
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(3)
	}
	fmt.Printf("server %d %s\n", s.pm.cmd.Process.Pid, s.root)
	if withBouncer {
		b, err := startPgBouncer(s.ConnString("postgres"), SessionPooling, nil)
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(3)
		}
		fmt.Printf("pgbouncer %d %s\n", b.proc.cmd.Process.Pid, b.root)
	}
	panic("test binary dies with its server running")
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func exec1(t testing.TB, conn *pgx.Conn, sql string, args ...any) {
	t.Helper()
	if _, err := conn.Exec(ctxT(t), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func queryBool(t testing.TB, conn *pgx.Conn, sql string, args ...any) bool {
	t.Helper()
	var v bool
	if err := conn.QueryRow(ctxT(t), sql, args...).Scan(&v); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return v
}

func dbOf(t testing.TB, connString string) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Database
}

// Two databases of the shared server do not share advisory locks, and
// AdvisoryLocks reports exactly the locks of the database asked about,
// decoded as pg_locks stores bigint and two-int4 keys.
func TestAdvisoryLocksArePerDatabase(t *testing.T) {
	t.Parallel()
	a, b := DB(t), DB(t)
	if a == b {
		t.Fatalf("DB returned the same database twice: %s", a)
	}
	connA, connB := Conn(t, a), Conn(t, b)

	exec1(t, connA, "SELECT pg_advisory_lock(42)")
	if !queryBool(t, connB, "SELECT pg_try_advisory_lock(42)") {
		t.Fatal("database B could not take key 42 held in database A")
	}

	want := func(conn *pgx.Conn, objID uint32) []AdvisoryLock {
		return []AdvisoryLock{{PID: int32(conn.PgConn().PID()), ObjID: objID, ObjSubID: 1, Mode: "ExclusiveLock", Granted: true}}
	}
	if got := AdvisoryLocks(t, b); !equalLocks(got, want(connB, 42)) {
		t.Fatalf("locks of B = %+v, want %+v", got, want(connB, 42))
	}
	if got := AdvisoryLocks(t, a); !equalLocks(got, want(connA, 42)) {
		t.Fatalf("locks of A = %+v, want %+v", got, want(connA, 42))
	}

	// A negative bigint fills both halves; a two-int4 key is stored as is.
	exec1(t, connB, "SELECT pg_advisory_lock_shared(-1)")
	exec1(t, connB, "SELECT pg_advisory_lock(7, 9)")
	pid := int32(connB.PgConn().PID())
	wantB := []AdvisoryLock{
		{PID: pid, ObjID: 42, ObjSubID: 1, Mode: "ExclusiveLock", Granted: true},
		{PID: pid, ClassID: 7, ObjID: 9, ObjSubID: 2, Mode: "ExclusiveLock", Granted: true},
		{PID: pid, ClassID: 0xffffffff, ObjID: 0xffffffff, ObjSubID: 1, Mode: "ShareLock", Granted: true},
	}
	if got := AdvisoryLocks(t, b); !equalLocks(got, wantB) {
		t.Fatalf("locks of B = %+v, want %+v", got, wantB)
	}
}

func equalLocks(a, b []AdvisoryLock) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// A database from DB is gone after its test, even with a connection left
// open, and a waiter's lock shows as not granted.
func TestDBDroppedAfterTest(t *testing.T) {
	t.Parallel()
	var cs string
	var leaked *pgx.Conn
	t.Run("user", func(t *testing.T) {
		cs = DB(t)
		var err error
		if leaked, err = pgx.Connect(ctxT(t), cs); err != nil { // closed by nobody
			t.Fatal(err)
		}
		holder, waiter := Conn(t, cs), Conn(t, cs)
		waiterPID := int32(waiter.PgConn().PID())
		exec1(t, holder, "SELECT pg_advisory_lock(1)")
		waited := make(chan error, 1)
		go func() {
			_, err := waiter.Exec(context.Background(), "SELECT pg_advisory_lock(1)")
			waited <- err
		}()
		Eventually(t, 30*time.Second, "waiter to queue for key 1", func() bool {
			for _, l := range AdvisoryLocks(t, cs) {
				if l.PID == waiterPID && !l.Granted {
					return true
				}
			}
			return false
		})
		exec1(t, holder, "SELECT pg_advisory_unlock(1)")
		if err := <-waited; err != nil {
			t.Fatalf("waiter: %v", err)
		}
	})
	defer closeConn(leaked)
	b, err := sharedBackend()
	if err != nil {
		t.Fatal(err)
	}
	admin := Conn(t, b.admin.connString)
	if queryBool(t, admin, "SELECT count(*) > 0 FROM pg_database WHERE datname = $1", dbOf(t, cs)) {
		t.Fatalf("database %s still exists after its test", dbOf(t, cs))
	}
	if _, err := leaked.Exec(ctxT(t), "SELECT 1"); err == nil {
		t.Fatal("a connection to a dropped database still works")
	}
}

// Terminate ends the backend: the client's next query fails and the pid is
// gone from pg_stat_activity.
func TestTerminate(t *testing.T) {
	t.Parallel()
	cs := DB(t)
	victim, other := Conn(t, cs), Conn(t, cs)
	pid := int32(victim.PgConn().PID())
	Terminate(t, cs, pid)
	if _, err := victim.Exec(ctxT(t), "SELECT 1"); err == nil {
		t.Fatal("query on a terminated backend succeeded")
	}
	if queryBool(t, other, "SELECT count(*) > 0 FROM pg_stat_activity WHERE pid = $1", pid) {
		t.Fatal("terminated backend still in pg_stat_activity")
	}
}

// Terminated ends a backend named by its pid and start, and leaves alone a
// backend that has the pid it was given but started at another time: the
// server gives an ended backend's pid to later ones.
func TestTerminatedTellsBackendsByTheirStart(t *testing.T) {
	t.Parallel()
	cs := DB(t)
	victim, other := Conn(t, cs), Conn(t, cs)
	b, err := ThisBackend(ctxT(t), victim)
	if err != nil {
		t.Fatal(err)
	}
	if b.PID != int32(victim.PgConn().PID()) || b.Start.IsZero() {
		t.Fatalf("ThisBackend = %+v, want pid %d and a start", b, victim.PgConn().PID())
	}
	for _, stale := range []Backend{{b.PID, b.Start.Add(-time.Microsecond)}, {b.PID, b.Start.Add(time.Second)}} {
		ended, err := Terminated(cs, []Backend{stale}, "another-app")
		if err != nil || len(ended) != 0 {
			t.Fatalf("Terminated(pid %d, started %v) of a backend started %v = %v, %v; want nothing ended", stale.PID, stale.Start, b.Start, ended, err)
		}
		if _, err := victim.Exec(ctxT(t), "SELECT 1"); err != nil {
			t.Fatalf("the backend with that pid, started at another time, was ended: %v", err)
		}
	}
	ended, err := Terminated(cs, []Backend{b}, "another-app")
	if err != nil || len(ended) != 1 || ended[0] != b.PID {
		t.Fatalf("Terminated(%+v) = %v, %v; want [%d]", b, ended, err, b.PID)
	}
	if _, err := victim.Exec(ctxT(t), "SELECT 1"); err == nil {
		t.Fatal("query on a terminated backend succeeded")
	}
	if queryBool(t, other, "SELECT count(*) > 0 FROM pg_stat_activity WHERE pid = $1", b.PID) {
		t.Fatal("terminated backend still in pg_stat_activity")
	}
}

// startTime returns the postmaster's start time, which changes when the
// server restarts.
func startTime(t testing.TB, conn *pgx.Conn) time.Time {
	t.Helper()
	var ts time.Time
	if err := conn.QueryRow(ctxT(t), "SELECT pg_postmaster_start_time()").Scan(&ts); err != nil {
		t.Fatal(err)
	}
	return ts
}

// checkFaultRecovery opens a connection, applies fault, and checks that
// the old connection fails, a new one works on the same port with a new
// postmaster, and committed data survived.
func checkFaultRecovery(t *testing.T, s *Server, fault func()) {
	cs := s.DB(t)
	port := s.Port()
	before := Conn(t, cs)
	exec1(t, before, "CREATE TABLE kept (v int); INSERT INTO kept VALUES (1)")
	started := startTime(t, before)

	fault()

	if _, err := before.Exec(ctxT(t), "SELECT 1"); err == nil {
		t.Fatal("query on a connection from before the fault succeeded")
	}
	if s.Port() != port {
		t.Fatalf("port changed from %d to %d", port, s.Port())
	}
	after := Conn(t, cs)
	if !startTime(t, after).After(started) {
		t.Fatal("postmaster start time did not change")
	}
	if !queryBool(t, after, "SELECT count(*) = 1 FROM kept WHERE v = 1") {
		t.Fatal("committed row lost")
	}
}

func TestServerRestart(t *testing.T) {
	t.Parallel()
	s := NewServer(t)
	checkFaultRecovery(t, s, func() { s.Restart(t) })
}

func TestServerCrash(t *testing.T) {
	t.Parallel()
	s := NewServer(t)
	checkFaultRecovery(t, s, func() { s.Crash(t) })
	log, err := os.ReadFile(s.logPath)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(log), "not properly shut down; automatic recovery in progress") {
		t.Fatalf("server log shows no crash recovery:%s", s.logTail())
	}
}

// Stop makes the server refuse connections; Start brings it back.
func TestServerStopStart(t *testing.T) {
	t.Parallel()
	s := NewServer(t)
	cs := s.DB(t)
	s.Stop(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if conn, err := pgx.Connect(ctx, cs); err == nil {
		closeConn(conn)
		t.Fatal("connected to a stopped server")
	}
	s.Start(t)
	if !queryBool(t, Conn(t, cs), "SELECT true") {
		t.Fatal("no answer after Start")
	}
}

// A standby is in recovery and follows the primary; after Promote it is not
// in recovery and accepts writes.
func TestStandbyPromote(t *testing.T) {
	t.Parallel()
	primary := NewServer(t)
	cs := primary.DB(t)
	pconn := Conn(t, cs)
	exec1(t, pconn, "CREATE TABLE kv (k int PRIMARY KEY)")

	standby := primary.StartStandby(t)
	if standby.Port() == primary.Port() {
		t.Fatal("standby shares the primary's port")
	}
	sconn := Conn(t, standby.ConnString(dbOf(t, cs)))
	if !queryBool(t, sconn, "SELECT pg_is_in_recovery()") {
		t.Fatal("standby is not in recovery")
	}
	exec1(t, pconn, "INSERT INTO kv VALUES (1)")
	Eventually(t, 30*time.Second, "row 1 to reach the standby", func() bool {
		return queryBool(t, sconn, "SELECT count(*) = 1 FROM kv")
	})

	standby.Promote(t)
	if queryBool(t, sconn, "SELECT pg_is_in_recovery()") {
		t.Fatal("promoted standby still in recovery")
	}
	exec1(t, sconn, "INSERT INTO kv VALUES (2)")
}

// A test binary that dies with a server running takes the server with it
// (parent-death signal), and the directory it leaves is removed by the next
// sweep.
func TestServerDiesWithTestBinary(t *testing.T) {
	if _, err := getLocal(); errors.Is(err, errNoBinaries) {
		SkipOrFail(t, "this test needs local PostgreSQL binaries (Debian: apt-get install postgresql): %v", err)
	} else if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), orphanEnv+"=1")
	out, err := cmd.Output()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 {
		t.Fatalf("child: want a panic (exit 2), got %v; output:\n%s", err, out)
	}
	var pid int
	var root string
	for _, line := range strings.Split(string(out), "\n") {
		if _, err := fmt.Sscanf(line, "server %d %s", &pid, &root); err == nil {
			break
		}
	}
	if pid == 0 || !strings.Contains(filepath.Base(root), dirPrefix) {
		t.Fatalf("child printed no server:\n%s", out)
	}
	t.Cleanup(func() { _ = os.RemoveAll(root) })
	Eventually(t, 30*time.Second, "orphaned postmaster to exit", func() bool { return !alive(pid) })
	Eventually(t, 30*time.Second, "orphaned backends to exit", func() bool {
		pids, err := clusterProcesses(filepath.Join(root, dataDir))
		return err == nil && len(pids) == 0
	})
	removeStale(filepath.Dir(root))
	if _, err := os.Stat(root); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("stale directory %s not removed: %v", root, err)
	}
}

// The sweep keeps directories of live test binaries and fresh ones.
func TestRemoveStaleKeepsLiveDirectories(t *testing.T) {
	tmp := t.TempDir()
	mk := func(name, owner string) string {
		dir := filepath.Join(tmp, dirPrefix+name)
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if owner != "" {
			if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(owner), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		return dir
	}
	done := exec.Command("true")
	if err := done.Run(); err != nil {
		t.Fatal(err)
	}
	live := mk("live", fmt.Sprint(os.Getpid()))
	fresh := mk("fresh", "")
	dead := mk("dead", fmt.Sprint(done.Process.Pid))
	removeStale(tmp)
	for _, dir := range []string{live, fresh} {
		if _, err := os.Stat(dir); err != nil {
			t.Errorf("%s removed: %v", dir, err)
		}
	}
	if _, err := os.Stat(dead); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s of a dead owner kept", dead)
	}
}

// When nothing works, the failure names every step and how to fix it.
func TestResolveFailureNamesEverySteps(t *testing.T) {
	t.Setenv("PGTEST_DATABASE_URL", "")
	_, err := resolveWith(func() (*backend, error) { return nil, errors.New("initdb not found") })
	if err == nil {
		t.Fatal("resolve succeeded with no backend")
	}
	for _, want := range []string{"1. PGTEST_DATABASE_URL: not set", "2. local PostgreSQL binaries: initdb not found",
		"docker run", "PGTEST_DATABASE_URL=postgres://", "apt-get install postgresql", "PGTEST_PG_BINDIR"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("message lacks %q:\n%v", want, err)
		}
	}
	if strings.Contains(err.Error(), "3.") {
		t.Errorf("message names a third step:\n%v", err)
	}
}

func BenchmarkDB(b *testing.B) {
	be, err := sharedBackend()
	if err != nil {
		b.Fatal(err)
	}
	var create, drop time.Duration
	n := 0
	for b.Loop() {
		name := dbName(b.Name())
		t0 := time.Now()
		if err := be.admin.createDB(name); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := be.admin.dropDB(name); err != nil {
			b.Fatal(err)
		}
		create += t1.Sub(t0)
		drop += time.Since(t1)
		n++
	}
	b.ReportMetric(float64(create.Microseconds())/float64(n)/1000, "create-ms/op")
	b.ReportMetric(float64(drop.Microseconds())/float64(n)/1000, "drop-ms/op")
}

func BenchmarkNewServer(b *testing.B) {
	l, err := getLocal()
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		s, err := newServer(l, nil)
		if err != nil {
			b.Fatal(err)
		}
		if err := s.close(); err != nil {
			b.Fatal(err)
		}
	}
}
