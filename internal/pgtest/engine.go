package pgtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// The engine of other harnesses
//
// The shared server of DB is found through this package's own variables
// (PGTEST_DATABASE_URL, PGTEST_PG_BINDIR). A harness built on pgtest for
// another audience, such as the pgcoordtest module that users' tests
// import, names its own sources with FindServer: the environment
// variables it reads, a folder of server binaries, and a container step
// that pgtest cannot have itself (this module needs no container
// library). The steps are the same code as DB's: one engine, two faces.

// Sources says where FindServer looks for a server, in order: the
// environment variables, then local binaries, then the container.
type Sources struct {
	// EnvVars name environment variables that may hold the connection
	// string of an existing server whose role may create databases; the
	// first one set is used, and the others are not looked at.
	EnvVars []string
	// BinDir is a folder holding initdb, postgres and pg_ctl. When it is
	// empty, FindServer searches PGTEST_PG_BINDIR, PATH, the newest
	// /usr/lib/postgresql/*/bin (Debian, Ubuntu) and the usual Homebrew,
	// PGDG and source-install folders.
	BinDir string
	// Container, if set, starts a server when neither step before it
	// gives one. It returns the connection string of a role that may
	// create databases and a function that stops the server. Its error
	// wraps ErrAbsent when there is nothing to start a container with
	// (no engine answers).
	Container func() (connString string, stop func() error, err error)
}

// ErrAbsent marks a step of FindServer that found nothing to use (the
// variable is not set, no binaries are installed, no container engine
// answers), as opposed to a step that found something broken.
var ErrAbsent = errors.New("absent")

// Absent returns an error with the message of fmt.Errorf(format, args...)
// that also wraps ErrAbsent.
func Absent(format string, args ...any) error {
	return absentError{fmt.Errorf(format, args...)}
}

type absentError struct{ err error }

func (e absentError) Error() string        { return e.err.Error() }
func (e absentError) Unwrap() error        { return e.err }
func (e absentError) Is(target error) bool { return target == ErrAbsent }

// Attempt is one step of FindServer that gave no server.
type Attempt struct {
	Step string // what was tried: the variables, "local PostgreSQL binaries", "container"
	Err  error  // why it gave no server; wraps ErrAbsent when there was nothing to try
}

// NoServerError is the error of FindServer when no step gave a server.
type NoServerError struct {
	Attempts []Attempt
}

// Error lists every step and why it failed, one per line.
func (e *NoServerError) Error() string {
	var sb strings.Builder
	sb.WriteString("no PostgreSQL server. Tried, in order:")
	for i, a := range e.Attempts {
		fmt.Fprintf(&sb, "\n  %d. %s: %s", i+1, a.Step, indent(a.Err.Error()))
	}
	return sb.String()
}

// Absent reports whether every step found nothing to use, so that a test
// may skip; false means some step found a server or tools that did not
// work, which a test should report as a failure.
func (e *NoServerError) Absent() bool {
	for _, a := range e.Attempts {
		if !errors.Is(a.Err, ErrAbsent) {
			return false
		}
	}
	return true
}

// Found is a server that FindServer found or started.
type Found struct {
	b *backend
	closeState
	// Source says where the server came from: the variable's name,
	// "local PostgreSQL binaries (<folder>)" or "container".
	Source string
	// Admin is the connection string of the database that CreateDB and
	// DropDB connect to: the variable's database, or postgres.
	Admin string
}

// FindServer finds or starts a server from src. An error from a step that
// found something broken (a variable whose server cannot be used) ends the
// search at once with that error; otherwise the error is a
// *NoServerError naming every step. A server it starts from local
// binaries is a child of the process with a parent-death signal, as DB's
// is; Close stops it and removes its directory, and a directory that a
// process which never called Close leaves is removed by the next run.
func FindServer(src Sources) (*Found, error) {
	var tried []Attempt
	for _, name := range src.EnvVars {
		u := os.Getenv(name)
		if u == "" {
			continue
		}
		b, err := externalBackend(u)
		if err != nil {
			return nil, errorf("%s is set but unusable: %v\n"+
				"Fix it (the role needs CREATEDB and the server PostgreSQL 13 or later), or unset it.", name, err)
		}
		return &Found{b: b, Source: name, Admin: u}, nil
	}
	if len(src.EnvVars) > 0 {
		tried = append(tried, Attempt{strings.Join(src.EnvVars, ", "), Absent("not set")})
	}

	f, err := localFound(src.BinDir)
	if err == nil {
		return f, nil
	}
	tried = append(tried, Attempt{"local PostgreSQL binaries", err})

	if src.Container != nil {
		connString, stop, err := src.Container()
		if err == nil {
			b, err := externalBackend(connString)
			if err == nil {
				b.stop = stop
				return &Found{b: b, Source: "container", Admin: connString}, nil
			}
			err = errors.Join(err, stop())
			tried = append(tried, Attempt{"container", err})
		} else {
			tried = append(tried, Attempt{"container", err})
		}
	}
	return nil, &NoServerError{Attempts: tried}
}

// localFound starts a server from local binaries in binDir, or found by
// search when binDir is empty.
func localFound(binDir string) (*Found, error) {
	bin, err := findBinariesIn(binDir)
	if err != nil {
		return nil, Absent("%v", err)
	}
	l, err := getLocalFrom(bin)
	if err != nil {
		return nil, err
	}
	s, err := newServer(l, nil)
	if err != nil {
		return nil, err
	}
	// The one server of the process is running: the cluster it was
	// copied from is not needed any more.
	if err := removeTemplate(); err != nil {
		_ = s.close()
		return nil, err
	}
	b := &backend{admin: s.admin, connString: s.ConnString, server: s, stop: s.close}
	return &Found{b: b, Source: "local PostgreSQL binaries (" + filepath.Dir(bin.postgres) + ")", Admin: s.ConnString("postgres")}, nil
}

// getLocalFrom is getLocal with the programs given.
func getLocalFrom(bin binaries) (*local, error) {
	localState.mu.Lock()
	defer localState.mu.Unlock()
	if !localState.done {
		localState.l, localState.err = newLocalFrom(bin)
		localState.done = true
	}
	return localState.l, localState.err
}

// extraBinDirs are where PostgreSQL's server binaries live when they are
// not on PATH: Homebrew (Apple silicon and Intel), Postgres.app, the PGDG
// packages of Red Hat-like systems, and a build from source.
func extraBinDirs() []string {
	var dirs []string
	for _, pattern := range []string{
		"/opt/homebrew/opt/postgresql@*/bin",
		"/usr/local/opt/postgresql@*/bin",
		"/opt/homebrew/opt/postgresql/bin",
		"/usr/local/opt/postgresql/bin",
		"/Applications/Postgres.app/Contents/Versions/latest/bin",
		"/usr/pgsql-*/bin",
		"/usr/local/pgsql/bin",
	} {
		m, _ := filepath.Glob(pattern)
		sort.Sort(sort.Reverse(sort.StringSlice(m))) // newest version first, mostly
		dirs = append(dirs, m...)
	}
	return dirs
}

// findBinariesIn looks in dir when it is set, else where findBinaries
// looks and then in extraBinDirs.
func findBinariesIn(dir string) (binaries, error) {
	if dir != "" {
		b, err := binariesIn(dir)
		if err != nil {
			return b, fmt.Errorf("configured folder %s: %w", dir, err)
		}
		return b, nil
	}
	b, err := findBinaries()
	if err == nil {
		return b, nil
	}
	for _, d := range extraBinDirs() {
		if b, err := binariesIn(d); err == nil {
			return b, nil
		}
	}
	return b, err
}

// ConnString returns the connection string of database dbname on the
// server.
func (f *Found) ConnString(dbname string) string { return f.b.connString(dbname) }

// CreateDB creates database name as a copy of database template
// (template0 when it is empty). The template must have no other
// connections.
func (f *Found) CreateDB(name, template string) error {
	if template == "" {
		return f.b.admin.createDB(name)
	}
	return f.b.admin.do(func(ctx context.Context, conn *pgx.Conn) error {
		sql := "CREATE DATABASE " + quoteIdent(name) + " TEMPLATE " + quoteIdent(template)
		if f.b.admin.version >= 150000 {
			// See createDB.
			sql += " STRATEGY = FILE_COPY"
		}
		if _, err := conn.Exec(ctx, sql); err != nil {
			return errorf("create database %s from %s: %w", name, template, err)
		}
		return nil
	})
}

// DropDB drops database name if it exists, terminating its connections.
func (f *Found) DropDB(name string) error { return f.b.admin.dropDB(name) }

// Diagnostics returns the end of the server's log when pgtest started it
// from local binaries, to append to a failure message, or "".
func (f *Found) Diagnostics() string { return f.b.diagnostics() }

// Close closes the admin connection and stops the server if FindServer
// started it. It is safe to call more than once.
func (f *Found) Close() error {
	f.b.admin.close()
	f.closeOnce.Do(func() {
		if f.b.stop != nil {
			f.closeErr = f.b.stop()
		}
	})
	return f.closeErr
}

// DBName returns a fresh database name made of prefix, a readable part of
// testName and a suffix unique across processes; it is at most 63 bytes
// when prefix is at most 16.
func DBName(prefix, testName string) string {
	return prefix + strings.TrimPrefix(dbName(testName), "t_")
}

// A Backend names one server process for Terminated: its pid, and when it
// started (pg_stat_activity.backend_start), which tells it apart from a
// later backend that the server gave the same pid.
type Backend struct {
	PID   int32
	Start time.Time
}

// ThisBackend returns conn's backend, as Terminated names it.
func ThisBackend(ctx context.Context, conn *pgx.Conn) (Backend, error) {
	b := Backend{PID: int32(conn.PgConn().PID())}
	err := conn.QueryRow(ctx, "SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()").Scan(&b.Start)
	if err != nil {
		return Backend{}, errorf("read the backend's start: %w", err)
	}
	return b, nil
}

// Terminated ends the given backends through pg_terminate_backend on a
// fresh connection to connString, skipping any that has left (a backend
// that now has one's pid but started at another time is another's), any
// that is not connected to connString's database and any whose
// application_name is exceptApp, and returns once each ended one has left
// pg_stat_activity. It returns the pids it ended.
func Terminated(connString string, backends []Backend, exceptApp string) ([]int32, error) {
	pids := make([]int32, len(backends))
	starts := make([]time.Time, len(backends))
	for i, b := range backends {
		pids[i], starts[i] = b.PID, b.Start
	}
	conn, err := connect(connString)
	if err != nil {
		return nil, err
	}
	defer closeConn(conn)
	ctx, cancel := context.WithTimeout(context.Background(), terminateWait)
	defer cancel()
	rows, err := conn.Query(ctx, `
WITH target AS MATERIALIZED (
	SELECT a.pid FROM pg_stat_activity a JOIN unnest($1::int4[], $2::timestamptz[]) AS b (pid, start)
		ON a.pid = b.pid AND a.backend_start = b.start
	WHERE a.datname = current_database() AND a.pid <> pg_backend_pid() AND a.application_name <> $3
)
SELECT pid FROM target WHERE pg_terminate_backend(pid) ORDER BY pid`, pids, starts, exceptApp)
	if err != nil {
		return nil, errorf("terminate backends %v: %w", pids, err)
	}
	ended, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, errorf("terminate backends %v: %w", pids, err)
	}
	var left int
	ok := Poll(terminateWait, func() bool {
		err = conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity a
			JOIN unnest($1::int4[], $2::timestamptz[]) AS b (pid, start) ON a.pid = b.pid AND a.backend_start = b.start
			WHERE a.pid = ANY($3)`, pids, starts, ended).Scan(&left)
		return err != nil || left == 0
	})
	if err != nil {
		return ended, errorf("read pg_stat_activity: %w", err)
	}
	if !ok {
		return ended, errorf("%d of the terminated backends %v still in pg_stat_activity after %v", left, ended, terminateWait)
	}
	return ended, nil
}

// closeState is the part of Found that Close guards.
type closeState struct {
	closeOnce sync.Once
	closeErr  error
}
