package pgcoordtest

import (
	"context"
	"fmt"
	"regexp"

	"github.com/jackc/pgx/v5"
)

// A server that processes share (one named by a database URL) keeps the
// databases of every test binary that uses it, and a binary that dies
// before its cleanups, or that has no Main, leaves its databases there.
// Each process therefore keeps a connection whose application_name is
// keeperApp followed by its prefix for as long as it runs, opened before
// it creates any database; at start it drops the databases whose prefix
// no such connection names. It lists the databases before the keepers,
// so a process that starts in between is never taken for dead. A process
// whose keeper connection was ended (a server restart, or a test that
// terminates every backend of the server) may see its databases dropped
// by the next process that starts.

// keeperApp starts the application_name of a keeper connection.
const keeperApp = "pgcoordtest keeper "

// ownDB matches the databases pgcoordtest makes and captures their prefix.
var ownDB = regexp.MustCompile(`^(pgct_[0-9a-f]{8}_)`)

// keep opens the keeper connection and drops the databases of processes
// that died.
func (s *server) keep() error {
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	cfg, err := pgx.ParseConfig(s.found.Admin)
	if err != nil {
		return fmt.Errorf("pgcoordtest: %w", err)
	}
	cfg.RuntimeParams["application_name"] = keeperApp + s.prefix
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("pgcoordtest: open keeper connection: %w", err)
	}
	s.keeper = conn
	// The keeper is idle all along: a server or role that ends idle
	// sessions (PostgreSQL 14's idle_session_timeout) must not end it,
	// or the next process would take this one for dead.
	if _, err := conn.Exec(ctx, `SELECT set_config('idle_session_timeout', '0', false)
WHERE current_setting('server_version_num')::int >= 140000`); err != nil {
		return fmt.Errorf("pgcoordtest: set up keeper connection: %w", err)
	}
	rows, err := conn.Query(ctx, `SELECT datname FROM pg_database WHERE datname LIKE 'pgct\_%' ORDER BY datname`)
	if err != nil {
		return fmt.Errorf("pgcoordtest: list databases: %w", err)
	}
	dbs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("pgcoordtest: list databases: %w", err)
	}
	rows, err = conn.Query(ctx, `SELECT substr(application_name, $1) FROM pg_stat_activity WHERE starts_with(application_name, $2)`,
		len(keeperApp)+1, keeperApp)
	if err != nil {
		return fmt.Errorf("pgcoordtest: list keepers: %w", err)
	}
	keepers, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("pgcoordtest: list keepers: %w", err)
	}
	alive := map[string]bool{}
	for _, k := range keepers {
		alive[k] = true
	}
	for _, db := range dbs {
		m := ownDB.FindStringSubmatch(db)
		if m == nil || alive[m[1]] {
			continue
		}
		// Another process may be dropping it too, or it may belong to a
		// role this one cannot drop for: neither stops the tests.
		_ = s.found.DropDB(db)
	}
	return nil
}
