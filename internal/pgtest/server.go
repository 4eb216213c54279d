package pgtest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// tooManyConnections is the SQLSTATE of "sorry, too many clients already".
const tooManyConnections = "53300"

// Server is a PostgreSQL server run from local binaries for one test, so
// the test can restart it, crash it or replicate it without disturbing other
// tests. It listens on 127.0.0.1 on a port of its own and trusts every local
// connection. It is a child of the test binary, with a parent-death signal,
// and its directory is removed when the test ends.
//
// Connection slots: pgtest keeps one connection (adminSlots) to every
// running server, the admin connection that DB and its cleanup use. It is
// the connection that finds the server ready, so after every start it holds
// its slot before any client of the test can reconnect; only when the
// test's clients have taken every slot first does pgtest open it later,
// when DB or a cleanup needs it. A test therefore has max_connections - 1
// slots. On top of that, AdvisoryLocks keeps one connection per test and
// connection string until the test ends, and Terminate and Promote open one
// for the length of the call. Every connection string of a Server names
// the superuser postgres, which may also use the slots that
// superuser_reserved_connections keeps for superusers; a test that wants
// to see that refusal must connect as a role it creates without SUPERUSER.
type Server struct {
	l        *local
	root     string // the pgtest directory: data, sock, log
	data     string // data directory, as the kernel reports it for cwd
	logPath  string
	port     int
	settings []setting // given to postgres as -c name=value on every start
	admin    *admin

	mu      sync.Mutex
	pm      *child // the running postmaster, nil when stopped
	standby bool   // in recovery, following another Server
}

// adminSlots is the number of connections pgtest keeps to a running
// server: the admin connection.
const adminSlots = 1

// NewServer starts a private server for t from a copy of a cluster that
// initdb makes once per test binary, with the settings that opts give (see
// WithSetting), and stops and removes it in t.Cleanup. It returns once the
// server accepts connections. When local binaries are not the backend in
// use (PGTEST_DATABASE_URL is set, or no PostgreSQL binaries are
// installed) it skips t saying so, or fails it under CI (see SkipOrFail).
// It calls t.Fatal when an option is invalid, and when the binaries exist
// but the server does not start; the message then ends with the server log.
func NewServer(t testing.TB, opts ...ServerOption) *Server {
	t.Helper()
	cfg, err := newServerConfig(opts)
	if err != nil {
		t.Fatal(err)
	}
	if os.Getenv("PGTEST_DATABASE_URL") != "" {
		SkipOrFail(t, "this test needs a PostgreSQL server of its own, started from local binaries, "+
			"to restart, crash or replicate it; PGTEST_DATABASE_URL is set, so the tests use that server instead "+
			"(unset PGTEST_DATABASE_URL to run this test)")
	}
	l, err := getLocal()
	if errors.Is(err, errNoBinaries) {
		SkipOrFail(t, "this test needs a PostgreSQL server of its own, started from local binaries, "+
			"and none were found (Debian: apt-get install postgresql): %v", err)
	}
	if err != nil {
		t.Fatal(errorf("local PostgreSQL: %w", err))
	}
	s, err := newServer(l, cfg.list())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.close(); err != nil {
			t.Error(err)
		}
	})
	return s
}

// localBackend starts the shared server from local binaries.
func localBackend() (*backend, error) {
	l, err := getLocal()
	if err != nil {
		return nil, err
	}
	s, err := newServer(l, nil)
	if err != nil {
		return nil, err
	}
	return &backend{
		admin:      s.admin,
		connString: s.ConnString,
		server:     s,
		stop:       s.close,
	}, nil
}

// newServer copies the template cluster and starts it on a free port with
// settings.
func newServer(l *local, settings []setting) (*Server, error) {
	s, err := newServerDir(l)
	if err != nil {
		return nil, err
	}
	s.settings = settings
	if err := l.copyTree(filepath.Join(l.template, dataDir), s.data); err != nil {
		_ = os.RemoveAll(s.root)
		return nil, errorf("copy template cluster: %w", err)
	}
	if err := s.startOnFreePort(); err != nil {
		_ = s.close()
		return nil, err
	}
	return s, nil
}

// newServerDir makes the directory of a server that has no cluster yet.
func newServerDir(l *local) (*Server, error) {
	root, err := l.user.mkRoot()
	if err != nil {
		return nil, errorf("%w", err)
	}
	// The kernel reports a process's cwd with symlinks resolved.
	if real, err := filepath.EvalSymlinks(root); err == nil {
		root = real
	}
	s := &Server{
		l:       l,
		root:    root,
		data:    filepath.Join(root, dataDir),
		logPath: filepath.Join(root, logFile),
	}
	return s, nil
}

// DB creates a fresh, empty database on s and returns its connection string.
// The database is dropped WITH (FORCE) in t.Cleanup if s is running then and
// is not a standby. DB calls t.Fatal when the database cannot be created, as
// on a standby, which is read-only.
func (s *Server) DB(t testing.TB) string {
	t.Helper()
	name := dbName(t.Name())
	if err := s.admin.createDB(name); err != nil {
		t.Fatalf("%v%s", err, s.logTail())
	}
	t.Cleanup(func() {
		s.mu.Lock()
		running := s.pm != nil && !s.standby
		s.mu.Unlock()
		if !running {
			return
		}
		if err := s.admin.dropDB(name); err != nil {
			t.Errorf("%v%s", err, s.logTail())
		}
	})
	return s.ConnString(name)
}

// ConnString returns a connection string for database dbname on s, as the
// superuser postgres over TCP to 127.0.0.1, with sslmode=disable. It stays
// valid across Restart, Crash, Stop and Start.
func (s *Server) ConnString(dbname string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", s.port, url.PathEscape(dbname))
}

// Port returns the TCP port s listens on, the same for the life of s.
func (s *Server) Port() int { return s.port }

// Restart shuts s down fast (terminating every connection) and starts it
// again on the same port, returning once it accepts connections. It calls
// t.Fatal when either step fails.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.stop(); err != nil {
		t.Fatal(err)
	}
	if err := s.start(false); err != nil {
		t.Fatal(err)
	}
}

// Crash kills the postmaster of s with SIGKILL, waits until every process of
// the cluster has exited (backends notice the postmaster's death), and starts
// s again on the same port, returning once crash recovery has finished and
// it accepts connections. It calls t.Fatal when a step fails or does not
// finish within its bound.
func (s *Server) Crash(t testing.TB) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pm == nil {
		t.Fatal(errorf("crash: server is not running"))
	}
	if err := s.kill(); err != nil {
		t.Fatal(err)
	}
	if err := s.start(true); err != nil {
		t.Fatal(err)
	}
}

// Stop shuts s down fast, terminating every connection; it does nothing when
// s is stopped. It calls t.Fatal when s does not stop.
func (s *Server) Stop(t testing.TB) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.stop(); err != nil {
		t.Fatal(err)
	}
}

// Start starts s after Stop on the same port and returns once it accepts
// connections. It calls t.Fatal when s is already running or does not start.
func (s *Server) Start(t testing.TB) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pm != nil {
		t.Fatal(errorf("start: server is already running"))
	}
	if err := s.start(false); err != nil {
		t.Fatal(err)
	}
}

// StartStandby makes a streaming hot standby of s: pg_basebackup -R -X
// stream into a new directory, started on a port of its own. It returns once
// the standby accepts (read-only) connections; it is stopped and removed in
// t.Cleanup. Without pg_basebackup it skips t saying so, or fails it under
// CI (see SkipOrFail). It calls t.Fatal when the backup or the start fails.
func (s *Server) StartStandby(t testing.TB) *Server {
	t.Helper()
	if err := isExecutable(s.l.bin.pgBasebackup); err != nil {
		if _, lerr := exec.LookPath(s.l.bin.pgBasebackup); lerr != nil {
			SkipOrFail(t, "this test starts a standby with pg_basebackup, which was not found "+
				"(Debian: apt-get install postgresql-client): %v", err)
		}
	}
	st, err := s.startStandby()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := st.close(); err != nil {
			t.Error(err)
		}
	})
	return st
}

func (s *Server) startStandby() (*Server, error) {
	st, err := newServerDir(s.l)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(s.l.bin.pgBasebackup,
		"-h", "127.0.0.1", "-p", strconv.Itoa(s.port), "-U", "postgres",
		"-D", st.data, "-R", "-X", "stream", "-c", "fast", "--no-sync")
	if err := s.l.run(cmd, st.root, st.logPath, 2*time.Minute); err != nil {
		err = errorf("pg_basebackup: %v%s", err, st.logTail())
		_ = os.RemoveAll(st.root)
		return nil, err
	}
	st.standby = true
	st.settings = s.settings
	if err := st.startOnFreePort(); err != nil {
		_ = st.close()
		return nil, err
	}
	return st, nil
}

// Promote promotes s, a standby, to a primary and returns once
// pg_is_in_recovery() is false on it. It calls t.Fatal when promotion fails
// or does not finish within a minute.
func (s *Server) Promote(t testing.TB) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	ctx, conn, done := s.mustAdmin(t, readyTimeout)
	defer done()
	var promoted bool
	if err := conn.QueryRow(ctx, "SELECT pg_promote(true, 60)").Scan(&promoted); err != nil {
		t.Fatalf("%v%s", errorf("promote: %w", err), s.logTail())
	}
	if !promoted {
		t.Fatalf("%v%s", errorf("promote: not promoted within 60s"), s.logTail())
	}
	var inRecovery bool
	if err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery); err != nil {
		t.Fatal(errorf("promote: %w", err))
	}
	if inRecovery {
		t.Fatalf("%v%s", errorf("promote: still in recovery after pg_promote"), s.logTail())
	}
	s.standby = false
}

// logTail returns the end of the server log, to append to a failure.
func (s *Server) logTail() string { return tailOf(s.logPath) }

// startOnFreePort picks a free port and starts s there, picking another if
// some other process takes the port in between.
func (s *Server) startOnFreePort() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var err error
	for range 3 {
		if s.port, err = freePort(); err != nil {
			return errorf("find a free port: %w", err)
		}
		s.admin = &admin{connString: s.ConnString("postgres")}
		err = s.start(false)
		if err == nil || !strings.Contains(err.Error(), "could not bind") {
			return err
		}
	}
	return err
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// start starts the postmaster as a foreground child and waits until it
// accepts connections. After a crash, a new postmaster refuses to start while
// processes of the old one live; when afterCrash is set, start retries on
// that refusal within readyTimeout. s.mu must be held.
func (s *Server) start(afterCrash bool) error {
	deadline := time.Now().Add(readyTimeout)
	for {
		err := s.startOnce(deadline)
		if err == nil {
			return nil
		}
		if !afterCrash || time.Now().After(deadline) ||
			!strings.Contains(err.Error(), "pre-existing shared memory block") {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (s *Server) startOnce(deadline time.Time) error {
	cmd := exec.Command(s.l.bin.postgres, append([]string{
		"-D", s.data,
		"-p", strconv.Itoa(s.port),
		"-c", "unix_socket_directories=" + filepath.Join(s.root, sockDir),
	}, args(s.settings)...)...)
	f, err := s.l.user.command(cmd, s.root, s.logPath)
	if err != nil {
		return errorf("start postgres: %w", err)
	}
	// SIGQUIT makes the postmaster kill its children and exit at once.
	pm, err := startChild(cmd, syscall.SIGQUIT)
	f.Close()
	if err != nil {
		return errorf("start postgres as OS user %s: %w", s.l.user.name, err)
	}
	s.pm = pm
	conn, err := s.waitReady(deadline)
	if err != nil {
		_ = s.kill()
		return errorf("postgres did not start: %v%s", err, s.logTail())
	}
	if conn != nil {
		s.admin.adopt(conn)
	}
	return nil
}

// waitReady polls until the server accepts a connection, the postmaster
// exits, or deadline passes. It returns the connection that found the
// server ready, or nil when the server was found ready but refused it
// because every connection slot was taken.
func (s *Server) waitReady(deadline time.Time) (*pgx.Conn, error) {
	connString := s.ConnString("postgres")
	var last error
	for pause := time.Millisecond; ; pause = min(2*pause, 50*time.Millisecond) {
		if s.pm.exited() {
			return nil, fmt.Errorf("postmaster exited: %v", s.pm.err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		conn, err := pgx.Connect(ctx, connString)
		cancel()
		if err == nil {
			return conn, nil
		}
		if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == tooManyConnections {
			return nil, nil // ready, and full of the test's clients
		}
		last = err
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("not accepting connections within %v: %w", readyTimeout, last)
		}
		time.Sleep(pause)
	}
}

// stop shuts the postmaster down fast (SIGINT), killing it if that does not
// finish within shutdownTimeout. s.mu must be held.
func (s *Server) stop() error {
	if s.pm == nil {
		return nil
	}
	s.pm.signal(syscall.SIGINT)
	if s.pm.waitFor(shutdownTimeout) {
		s.pm = nil
		return nil
	}
	if err := s.kill(); err != nil {
		return err
	}
	return errorf("postgres did not shut down within %v and was killed%s", shutdownTimeout, s.logTail())
}

// kill sends SIGKILL to the postmaster and waits until it and every other
// process of the cluster have exited. s.mu must be held.
func (s *Server) kill() error {
	if s.pm == nil {
		return nil
	}
	s.pm.signal(syscall.SIGKILL)
	if !s.pm.waitFor(killTimeout) {
		return errorf("postmaster did not exit within %v of SIGKILL", killTimeout)
	}
	s.pm = nil
	return waitClusterGone(s.data)
}

// waitClusterGone waits until no process works in data, the data directory
// that a postmaster and all its children chdir to, killing any that remain
// after killTimeout.
func waitClusterGone(data string) error {
	deadline := time.Now().Add(killTimeout)
	killed := false
	for pause := time.Millisecond; ; pause = min(2*pause, 20*time.Millisecond) {
		pids, err := clusterProcesses(data)
		if err != nil || len(pids) == 0 {
			return nil // without a process table, start retries instead
		}
		if time.Now().After(deadline) {
			if killed {
				return errorf("processes %v of the cluster in %s did not exit", pids, data)
			}
			for _, pid := range pids {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
			killed = true
			deadline = time.Now().Add(killTimeout)
		}
		time.Sleep(pause)
	}
}

// close stops s and removes its directory.
func (s *Server) close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.admin != nil {
		s.admin.close()
	}
	stopErr := s.stop()
	if err := os.RemoveAll(s.root); err != nil {
		return errors.Join(stopErr, errorf("remove %s: %w", s.root, err))
	}
	return stopErr
}
