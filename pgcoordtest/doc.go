// Package pgcoordtest gives your tests a real PostgreSQL database with
// pgcoord's schema, in one line:
//
//	func TestReport(t *testing.T) {
//		dsn := pgcoordtest.DB(t) // fresh, migrated, dropped when the test ends
//		c := pgcoordtest.Client(t, dsn)
//		...
//	}
//
// so that you can test your own jobs, leaders and semaphores against the
// server they run on in production, including what they do when they lose
// a lock: [TerminateBackends] ends a Client's connections on the server,
// and a [Proxy] drops the network between a Client and the server.
//
// It is a module of its own, github.com/pgcoord/pgcoord/pgcoordtest, so
// that the container library it may use (testcontainers-go) lands only
// in the module graph of those who import it, never in that of pgcoord's
// users.
//
// # Where the server comes from
//
// A test binary uses one server, found or started by its first DB call,
// in this order:
//
//  1. PGCOORDTEST_DATABASE_URL, else PGTEST_DATABASE_URL (the variable of
//     pgcoord's own tests): an existing server whose role may create
//     databases. DATABASE_URL is never read, since it usually names a
//     database someone works with. The databases pgcoordtest makes there
//     are named pgct_* and dropped again; those of a test binary that died
//     are dropped by the next one.
//  2. Local PostgreSQL server binaries, from [WithBinDir] or
//     PGCOORDTEST_PG_BINDIR, else PATH, the newest /usr/lib/postgresql/*/bin
//     (Debian's and Ubuntu's postgresql package), Homebrew's, Postgres.app's
//     and the PGDG packages' folders: a throwaway cluster in a temporary
//     directory (in memory, /dev/shm, where it has room), listening on
//     127.0.0.1 on a free port. PostgreSQL refuses to run as root, so a test
//     run as root runs it as OS user postgres (which Debian's package
//     creates; PGTEST_OS_USER names another). The server is a child of the
//     test binary with a parent-death signal: it dies with the binary, even
//     one killed by a timeout.
//  3. A container, through testcontainers-go's postgres module
//     ([DefaultContainerImage], or [WithContainerImage]), when a Docker
//     engine answers within 2 seconds ([WithoutContainer] leaves this step
//     out). testcontainers-go's reaper removes it when the test binary
//     exits.
//
// When none of them gives a server, DB skips the test with a message that
// names what it tried, why each step failed and how to enable each; with
// [FailIfUnavailable], or when the environment variable CI is true, it
// fails the test instead, so that a CI run never passes a test that did
// not run. A step that finds something broken (a database URL that cannot
// be used, binaries that do not start) fails the test at once.
//
// # Cost, and parallel tests
//
// The first DB call of a test binary starts the server and migrates a
// template database once: about 0.55 s with local binaries (initdb, start,
// migrate). Every DB call then copies the template (CREATE DATABASE ...
// TEMPLATE) and its test's cleanup drops the copy: BenchmarkDB measures
// 10 to 17 ms for the two together (PostgreSQL 15 from local binaries,
// its cluster in /dev/shm, on a 2-core machine shared with other work),
// against 68 to 82 ms for an empty database migrated each time
// (BenchmarkDBMigratedEachTime). DB, Client and the
// helpers are safe for tests that run in parallel (t.Parallel); each test
// gets a database of its own, so tests never see each other's locks
// (advisory locks are per database), elections or semaphores.
//
// Main is optional: called from TestMain, it stops the server after the
// tests and removes its files at once instead of at the next run.
//
// # One harness
//
// pgcoordtest is the public face of the harness that pgcoord's own tests
// use (its internal/pgtest package): the same code finds the binaries,
// runs them as the right OS user, ties the server's life to the test
// binary, copies databases and ends backends. pgcoordtest adds its own
// variables, the container step and the migrated template. The two are
// released together, at the same version.
package pgcoordtest
