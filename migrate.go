package pgcoord

import (
	"cmp"
	"context"
	"embed"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"slices"
	"strconv"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
)

// Migrations
//
// The tables and functions pgcoord needs (fences, leaders, semaphores) are
// created by Migrate, per database and schema, in one transaction under a
// transaction-level advisory lock, so that processes migrating at once
// apply each migration once; schema_version records what was applied.

//go:embed migrations/*.sql
var migrationFiles embed.FS

// migrateKey is the transaction-level advisory lock that serialises every
// Migrate call on a database, whatever its schema.
var migrateKey = core.HashKey("pgcoord", "migrate")

// Migrations returns pgcoord's SQL migrations for use with a migration tool
// instead of [Migrate]. The files sit at the root of the returned file system
// and follow golang-migrate's naming: 000001_fences.up.sql,
// 000001_fences.down.sql, and so on, numbered without gaps.
//
// The files are plain SQL and do not name a schema: they create their objects
// in the first schema of search_path. Create the schema first and connect
// with search_path set to it, for example with "search_path=pgcoord" in the
// connection URL, then pass the same schema to [New] or [Open] and
// [CheckFence] with [WithSchema].
//
// With golang-migrate, wrap the file system with its iofs source; its own
// version table then also goes into the first schema of search_path:
//
//	src, err := iofs.New(pgcoord.Migrations(), ".")
//	m, err := migrate.NewWithSourceInstance("iofs", src,
//		"postgres://host/db?search_path=pgcoord")
//	err = m.Up()
//
// Atlas reads a directory in golang-migrate format
// ("file://dir?format=golang-migrate"); copy the files out with
// [os.CopyFS]. goose expects one file per version with "-- +goose Up" and
// "-- +goose Down" annotations, so goose users join each up and down pair
// into such a file.
//
// Use either a migration tool or [Migrate] on a schema, not both: Migrate
// records what it applied in its own table, schema_version, and does not read
// other tools' records.
func Migrations() fs.FS {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		panic("pgcoord: embedded migrations: " + err.Error()) // fs.Sub fails only for an invalid path literal
	}
	return sub
}

// migration is one numbered step, with the SQL of both directions.
type migration struct {
	version int64
	name    string
	up      string
	down    string
}

var migrationName = regexp.MustCompile(`^([0-9]+)_([a-z0-9_]+)\.(up|down)\.sql$`)

// loadMigrations reads and checks the migrations in fsys: every file is
// named NNNNNN_name.up.sql or NNNNNN_name.down.sql, every version has both,
// and versions run from 1 without gaps. The result is sorted by version.
func loadMigrations(fsys fs.FS) ([]migration, error) {
	entries, err := fs.ReadDir(fsys, ".")
	if err != nil {
		return nil, core.Errorf("read migrations: %w", err)
	}
	byVersion := map[int64]*migration{}
	for _, e := range entries {
		m := migrationName.FindStringSubmatch(e.Name())
		if m == nil || e.IsDir() {
			return nil, core.Errorf("migrations: unexpected file %q (want NNNNNN_name.up.sql or NNNNNN_name.down.sql)", e.Name())
		}
		v, err := strconv.ParseInt(m[1], 10, 64)
		if err != nil || v <= 0 {
			return nil, core.Errorf("migrations: bad version in %q", e.Name())
		}
		body, err := fs.ReadFile(fsys, path.Clean(e.Name()))
		if err != nil {
			return nil, core.Errorf("read migration %s: %w", e.Name(), err)
		}
		mg := byVersion[v]
		if mg == nil {
			mg = &migration{version: v, name: m[2]}
			byVersion[v] = mg
		}
		if mg.name != m[2] {
			return nil, core.Errorf("migrations: version %d has two names, %q and %q", v, mg.name, m[2])
		}
		if m[3] == "up" {
			mg.up = string(body)
		} else {
			mg.down = string(body)
		}
	}
	out := make([]migration, 0, len(byVersion))
	for _, mg := range byVersion {
		if mg.up == "" || mg.down == "" {
			return nil, core.Errorf("migrations: version %d (%s) needs a non-empty up and down file", mg.version, mg.name)
		}
		out = append(out, *mg)
	}
	slices.SortFunc(out, func(a, b migration) int { return cmp.Compare(a.version, b.version) })
	for i, mg := range out {
		if mg.version != int64(i+1) {
			return nil, core.Errorf("migrations: version %d is missing", i+1)
		}
	}
	return out, nil
}

// Migrate creates or upgrades pgcoord's tables, which fencing tokens,
// leader election and semaphores need; plain locks need none.
// It is safe to call at every start of every process: it applies only the
// migrations the database does not have yet, so a second call changes
// nothing.
//
// Everything happens in one transaction begun on db (a *pgxpool.Pool,
// *pgx.Conn, or anything else that implements [TxBeginner]). It first takes a
// transaction-level advisory lock on a fixed key, so concurrent Migrate calls
// on one database run one after the other; then it creates the schema
// ([DefaultSchema], or the one set with [WithSchema]) if it does not exist,
// and a table schema_version in it that records each applied version and
// when; then it runs each migration newer than the recorded version, in
// order, with search_path set to the schema, and commits. On any error
// nothing is applied. The transaction runs at READ COMMITTED whatever the
// default isolation level of the server, database or role.
//
// Privileges, by what Migrate finds:
//
//   - No schema: CREATE on the database (it creates the schema, its
//     tables and functions, which the role then owns).
//   - A schema without pgcoord's tables: USAGE and CREATE on the schema.
//   - Older versions applied (an upgrade): a migration may alter tables
//     that exist (000004 and 000005 add columns to leaders), which
//     PostgreSQL allows only to a table's owner. So an upgrade must run as
//     the role that owns pgcoord's tables in the schema, or a member of
//     it, with USAGE and CREATE on the schema and SELECT and INSERT on
//     schema_version (the role whose Migrate created the tables has all of
//     these). CREATE and USAGE alone are not enough.
//   - Up to date: USAGE on the schema and SELECT on schema_version, so
//     processes running as a role that may change nothing can call Migrate
//     at every start.
//
// A missing privilege fails the call, with nothing applied, with an error
// that wraps the server's (SQLSTATE 42501) and names the step and what it
// needs, such as:
//
//	pgcoord: migrate schema "pgcoord": apply 000004_resign_requests: ERROR: must be owner of table leaders (SQLSTATE 42501) (an upgrade needs the role that owns pgcoord's tables in the schema, or a member of it)
//
// ctx governs the whole call, including the wait for other Migrate calls to
// finish; if it ends first, the transaction is rolled back. Options:
// [WithSchema] and [WithLogger].
// Errors from PostgreSQL are wrapped, so *pgconn.PgError stays reachable with
// errors.As.
func Migrate(ctx context.Context, db TxBeginner, opts ...MigrateOption) error {
	if ctx == nil {
		return core.Errorf("migrate: ctx is nil")
	}
	c, err := newMigrateConfig(opts)
	if err != nil {
		return err
	}
	return migrate(ctx, c, db)
}

// Migrate is [Migrate] on the Client's pool, in the Client's schema
// ([WithSchema]) and with its logger ([WithLogger]). ctx and the errors
// are as for [Migrate]; after Close it returns an error wrapping [ErrClosed].
func (c *Client) Migrate(ctx context.Context) error {
	if ctx == nil {
		return core.Errorf("migrate schema %q: ctx is nil", c.core.Cfg.Schema)
	}
	if err := c.core.RefuseClosed(); err != nil {
		return core.Errorf("migrate schema %q: %w", c.core.Cfg.Schema, err)
	}
	return migrate(ctx, c.core.Cfg, c.core.Pool)
}

func migrate(ctx context.Context, c *core.Config, db TxBeginner) error {
	op := fmt.Sprintf("migrate schema %q", c.Schema)
	if db == nil {
		return core.Errorf("%s: db is nil", op)
	}
	migs, err := loadMigrations(Migrations())
	if err != nil {
		return err
	}
	return inMigrationTx(ctx, c, db, op, func(tx pgx.Tx) error {
		var have int64
		var exists bool
		if err := tx.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", c.Table("schema_version")).Scan(&exists); err != nil {
			return core.PgError(op+": look for schema_version", err)
		}
		if exists {
			if err := tx.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM "+c.Table("schema_version")).Scan(&have); err != nil {
				return privilegeError(op+": read schema_version", err, "reading the version needs USAGE on the schema and SELECT on schema_version")
			}
		}
		latest := migs[len(migs)-1].version
		if have >= latest {
			if have > latest {
				c.WarnLogger().WarnContext(ctx, "pgcoord: database schema is newer than this version of pgcoord knows", "schema", c.Schema, "version", have, "known", latest)
			}
			return nil
		}
		if !exists {
			if _, err := tx.Exec(ctx, `CREATE TABLE `+c.Table("schema_version")+` (
				version    bigint      PRIMARY KEY CHECK (version > 0),
				name       text        NOT NULL,
				applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
				return privilegeError(op+": create schema_version", err, "creating pgcoord's tables needs USAGE and CREATE on the schema")
			}
			if _, err := tx.Exec(ctx, "COMMENT ON TABLE "+c.Table("schema_version")+" IS 'pgcoord migrations applied by pgcoord.Migrate to this schema: one row per version.'"); err != nil {
				return core.PgError(op+": comment on schema_version", err)
			}
		}
		// A role that may create but does not own the tables fails at
		// the first migration that alters one.
		need := "an upgrade needs the role that owns pgcoord's tables in the schema, or a member of it"
		if have == 0 {
			need = "creating pgcoord's tables needs USAGE and CREATE on the schema"
		}
		for _, m := range migs {
			if m.version <= have {
				continue
			}
			step := fmt.Sprintf("%s: apply %06d_%s", op, m.version, m.name)
			if err := runMigrationSQL(ctx, c, tx, m.up); err != nil {
				return privilegeError(step, err, need)
			}
			if _, err := tx.Exec(ctx, "INSERT INTO "+c.Table("schema_version")+" (version, name) VALUES ($1, $2)", m.version, m.name); err != nil {
				return privilegeError(fmt.Sprintf("%s: record version %d", op, m.version), err, "recording a version needs INSERT on schema_version")
			}
			c.InfoLogger().InfoContext(ctx, "pgcoord: applied migration", "schema", c.Schema, "version", m.version, "name", m.name)
		}
		return nil
	})
}

// migrateDown reverts the migrations of the configured schema down to
// version target (0 reverts all), running the down files in reverse order
// and deleting their rows from schema_version, in one transaction under the
// same advisory lock as Migrate. At target 0 it also drops schema_version,
// leaving the schema itself, which may hold other objects, in place.
func migrateDown(ctx context.Context, db TxBeginner, target int64, opts ...MigrateOption) error {
	c, err := newMigrateConfig(opts)
	if err != nil {
		return err
	}
	op := fmt.Sprintf("migrate down schema %q", c.Schema)
	if db == nil {
		return core.Errorf("%s: db is nil", op)
	}
	if target < 0 {
		return core.Errorf("%s: target version %d is negative", op, target)
	}
	migs, err := loadMigrations(Migrations())
	if err != nil {
		return err
	}
	return inMigrationTx(ctx, c, db, op, func(tx pgx.Tx) error {
		var have int64
		if err := tx.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM "+c.Table("schema_version")).Scan(&have); err != nil {
			return core.NotMigrated(c, op+": read schema_version", err)
		}
		if have > int64(len(migs)) {
			return core.Errorf("%s: the schema is at version %d, newer than the %d migrations known", op, have, len(migs))
		}
		for i := have; i > target; i-- {
			m := migs[i-1]
			if err := runMigrationSQL(ctx, c, tx, m.down); err != nil {
				return core.PgError(fmt.Sprintf("%s: revert %06d_%s", op, m.version, m.name), err)
			}
			if _, err := tx.Exec(ctx, "DELETE FROM "+c.Table("schema_version")+" WHERE version = $1", m.version); err != nil {
				return core.PgError(fmt.Sprintf("%s: unrecord version %d", op, m.version), err)
			}
		}
		if target == 0 {
			if _, err := tx.Exec(ctx, "DROP TABLE "+c.Table("schema_version")); err != nil {
				return core.PgError(op+": drop schema_version", err)
			}
		}
		return nil
	})
}

// inMigrationTx runs fn in a READ COMMITTED transaction on db that holds the
// migration advisory lock and in which the schema exists. The transaction is
// committed if fn returns nil and rolled back otherwise. op starts the
// messages of its errors.
func inMigrationTx(ctx context.Context, c *core.Config, db TxBeginner, op string, fn func(pgx.Tx) error) (err error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return core.PgError(op+": begin", err)
	}
	defer func() {
		if err != nil {
			rollbackTx(ctx, tx)
		}
	}()
	// A later snapshot must see what the previous lock holder committed, so
	// the version read after the lock wait must not reuse an older snapshot.
	if _, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"); err != nil {
		return core.PgError(op+": set READ COMMITTED", err)
	}
	// The lock comes before any catalog change, so concurrent calls do not
	// race on CREATE SCHEMA or CREATE TABLE.
	if err := XactLock(ctx, tx, keyOf(migrateKey)); err != nil {
		return core.Errorf("%s: wait for other migrations: %w", op, err)
	}
	var exists bool
	if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname = $1)", c.Schema).Scan(&exists); err != nil {
		return core.PgError(op+": look for the schema", err)
	}
	if !exists {
		if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+c.QuotedSchema()); err != nil {
			return privilegeError(op+": create the schema", err, "creating the schema needs CREATE on the database")
		}
	}
	if err := fn(tx); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return core.PgError(op+": commit", err)
	}
	return nil
}

// privilegeError is pgError(step, err), saying after a missing privilege
// (SQLSTATE 42501) what the step needs.
func privilegeError(step string, err error, need string) error {
	if core.SqlState(err) == "42501" {
		return core.Errorf("%s: %w (%s)", step, err, need)
	}
	return core.PgError(step, err)
}

// runMigrationSQL runs the statements of one migration file with
// search_path set to the schema (pg_temp last, so a temporary table cannot
// shadow ours), then restores the previous search_path.
func runMigrationSQL(ctx context.Context, c *core.Config, tx pgx.Tx, sql string) error {
	var old string
	if err := tx.QueryRow(ctx, "SELECT pg_catalog.current_setting('search_path')").Scan(&old); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, "SET LOCAL search_path TO "+c.QuotedSchema()+", pg_temp"); err != nil {
		return err
	}
	// No arguments: pgx sends the file with the simple protocol, which runs
	// every statement in it.
	if _, err := tx.Exec(ctx, sql); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, "SELECT pg_catalog.set_config('search_path', $1, true)", old)
	return err
}
