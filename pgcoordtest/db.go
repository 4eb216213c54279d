package pgcoordtest

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// Environment variables that pgcoordtest reads.
const (
	// EnvDatabaseURL names an existing server to use instead of starting
	// one, for example
	// postgres://postgres:pw@localhost:5432/postgres?sslmode=disable. Its
	// role must be allowed to create databases (CREATEDB); every database
	// pgcoordtest makes there is named pgct_*, and dropped again.
	EnvDatabaseURL = "PGCOORDTEST_DATABASE_URL"
	// EnvProjectDatabaseURL is the variable of pgcoord's own tests, honoured
	// after EnvDatabaseURL so that one setting serves both. DATABASE_URL is
	// never read: it usually names a database someone works with.
	EnvProjectDatabaseURL = "PGTEST_DATABASE_URL"
	// EnvBinDir names the folder of the server binaries, like WithBinDir.
	EnvBinDir = "PGCOORDTEST_PG_BINDIR"
)

// timeouts of one step; every wait of the package is bounded by one.
const (
	setupTimeout   = 2 * time.Minute  // finding or starting the server, migrating the template
	cleanupTimeout = 30 * time.Second // closing a Client
)

// server is the test binary's server, with the migrated template that
// every test's database is a copy of.
type server struct {
	found    *pgtest.Found
	cfg      serverConfig
	prefix   string // pgct_<8 hex>_: names of this process's databases
	template string
	keeper   *pgx.Conn // on a shared server: marks prefix as alive (see sweep)
}

// shared is the test binary's server, resolved by the first call.
var shared struct {
	mu     sync.Mutex
	done   bool
	cfg    serverConfig
	s      *server
	err    error
	closed bool
}

// DB returns the connection string of a fresh database on the test
// binary's PostgreSQL server, with pgcoord's schema migrated
// ([pgcoord.Migrate] with its defaults), and drops it WITH (FORCE) in
// t.Cleanup. Each call gets a database of its own, so tests that run in
// parallel (t.Parallel) never see each other's locks, elections or
// semaphores: advisory locks are per database.
//
// The first call finds or starts the server (see the package
// documentation for where it comes from) and migrates a template database
// once; every call, the first included, then copies that template, which
// takes milliseconds. When no server can be found at all, DB skips t with
// a message that names each way to provide one, or fails it with
// [FailIfUnavailable] or under CI=true. When a server was found but does
// not work (a database URL that cannot be used, binaries that do not
// start), DB fails t. It also fails t on an invalid option.
func DB(t testing.TB, opts ...Option) string {
	t.Helper()
	cfg, err := newConfig(opts)
	if err != nil {
		t.Fatal(err)
	}
	s, err := sharedServer(cfg.server)
	if err != nil {
		unavailable(t, err, cfg.fail)
	}
	name := pgtest.DBName(s.prefix, t.Name())
	if err := s.found.CreateDB(name, s.template); err != nil {
		t.Fatalf("pgcoordtest: %v%s", err, s.found.Diagnostics())
	}
	t.Cleanup(func() {
		if err := s.found.DropDB(name); err != nil {
			t.Errorf("pgcoordtest: %v%s", err, s.found.Diagnostics())
		}
	})
	return s.found.ConnString(name)
}

// sharedServer returns the test binary's server, finding or starting it
// and migrating its template on the first call.
func sharedServer(cfg serverConfig) (*server, error) {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.closed {
		return nil, errors.New("pgcoordtest: the server was already shut down by Main")
	}
	if !shared.done {
		shared.cfg = cfg
		shared.s, shared.err = newServer(cfg)
		shared.done = true
	}
	if cfg != shared.cfg {
		return nil, &configError{fmt.Errorf("pgcoordtest: server options %s differ from %s, with which an earlier call chose the test binary's one server", cfg, shared.cfg)}
	}
	return shared.s, shared.err
}

// configError is a misuse that fails the test whatever the options say.
type configError struct{ err error }

func (e *configError) Error() string { return e.err.Error() }
func (e *configError) Unwrap() error { return e.err }

func (c serverConfig) String() string {
	s := "(bin dir " + strconv.Quote(c.binDir)
	if c.container {
		return s + ", container " + c.image + ")"
	}
	return s + ", no container)"
}

// newServer finds or starts a server and makes the migrated template.
func newServer(cfg serverConfig) (*server, error) {
	found, err := findServer(cfg)
	if err != nil {
		return nil, err
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	id := binary.BigEndian.Uint32(b[:])
	s := &server{found: found, cfg: cfg, prefix: fmt.Sprintf("%s%08x_", dbPrefix, id)}
	s.template = s.prefix + "template"
	// Mark this process's databases as alive, and drop those of processes
	// that died, for a server that other processes share (see keep).
	if err := s.keep(); err != nil {
		_ = s.close()
		return nil, err
	}
	if err := s.makeTemplate(); err != nil {
		_ = s.close()
		return nil, err
	}
	return s, nil
}

// dbPrefix starts the name of every database pgcoordtest makes.
const dbPrefix = "pgct_"

// makeTemplate creates the template database and migrates it.
func (s *server) makeTemplate() error {
	if err := s.found.CreateDB(s.template, ""); err != nil {
		return fmt.Errorf("pgcoordtest: %w%s", err, s.found.Diagnostics())
	}
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.found.ConnString(s.template))
	if err != nil {
		return fmt.Errorf("pgcoordtest: connect to the template database: %w", err)
	}
	err = pgcoord.Migrate(ctx, conn)
	// CREATE DATABASE ... TEMPLATE needs the template without connections.
	if cerr := conn.Close(ctx); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("pgcoordtest: migrate the template database: %w", err)
	}
	return nil
}

// close drops what the server holds of this process and stops it if
// pgcoordtest started it.
func (s *server) close() error {
	var errs []error
	errs = append(errs, s.found.DropDB(s.template))
	if s.keeper != nil {
		ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
		errs = append(errs, s.keeper.Close(ctx))
		cancel()
	}
	errs = append(errs, s.found.Close())
	return errors.Join(errs...)
}

// Main runs the tests and then stops the server that pgcoordtest started
// for them, removes its files, or on a server named by a database URL,
// drops the template database. It is optional: without it the server
// dies with the test binary (it gets a parent-death signal), a container
// is removed by testcontainers-go's reaper, and what a test binary leaves
// behind is removed by the next run's first DB call. Call it from
// TestMain:
//
//	func TestMain(m *testing.M) { pgcoordtest.Main(m) }
//
// Main calls os.Exit with the code of m.Run, or 1 if the shutdown failed.
func Main(m interface{ Run() int }) {
	code := m.Run()
	if err := shutdown(); err != nil {
		fmt.Fprintln(os.Stderr, "pgcoordtest:", err)
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

// shutdown stops the shared server, if any.
func shutdown() error {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	shared.closed = true
	if shared.s == nil {
		return nil
	}
	return shared.s.close()
}
