package pgcoord

import (
	"cmp"
	"context"
	"embed"
	"errors"
	"io/fs"
	"path"
	"regexp"
	"slices"
	"strconv"

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
var migrateKey = HashKey("pgcoord", "migrate")

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
		return nil, errorf("read migrations: %w", err)
	}
	byVersion := map[int64]*migration{}
	for _, e := range entries {
		m := migrationName.FindStringSubmatch(e.Name())
		if m == nil || e.IsDir() {
			return nil, errorf("migrations: unexpected file %q (want NNNNNN_name.up.sql or NNNNNN_name.down.sql)", e.Name())
		}
		v, err := strconv.ParseInt(m[1], 10, 64)
		if err != nil || v <= 0 {
			return nil, errorf("migrations: bad version in %q", e.Name())
		}
		body, err := fs.ReadFile(fsys, path.Clean(e.Name()))
		if err != nil {
			return nil, errorf("read migration %s: %w", e.Name(), err)
		}
		mg := byVersion[v]
		if mg == nil {
			mg = &migration{version: v, name: m[2]}
			byVersion[v] = mg
		}
		if mg.name != m[2] {
			return nil, errorf("migrations: version %d has two names, %q and %q", v, mg.name, m[2])
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
			return nil, errorf("migrations: version %d (%s) needs a non-empty up and down file", mg.version, mg.name)
		}
		out = append(out, *mg)
	}
	slices.SortFunc(out, func(a, b migration) int { return cmp.Compare(a.version, b.version) })
	for i, mg := range out {
		if mg.version != int64(i+1) {
			return nil, errorf("migrations: version %d is missing", i+1)
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
// Privileges: CREATE on the database if the schema does not exist yet;
// otherwise CREATE and USAGE on the schema while there is something to
// apply. When the schema is up to date, USAGE on it and SELECT on
// schema_version are enough, so processes running as a role without CREATE
// can call Migrate as well. A missing privilege is reported as the server's
// error (SQLSTATE 42501), wrapped.
//
// ctx governs the whole call, including the wait for other Migrate calls to
// finish; if it ends first, the transaction is rolled back. Options:
// [WithSchema] and [WithLogger].
// Errors from PostgreSQL are wrapped, so *pgconn.PgError stays reachable with
// errors.As.
func Migrate(ctx context.Context, db TxBeginner, opts ...MigrateOption) error {
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
	if err := c.refuseClosed(); err != nil {
		return errorf("migrate schema %q: %w", c.cfg.schema, err)
	}
	return migrate(ctx, c.cfg, c.pool)
}

func migrate(ctx context.Context, c *config, db TxBeginner) error {
	if db == nil {
		return errors.New("pgcoord: Migrate: db is nil")
	}
	migs, err := loadMigrations(Migrations())
	if err != nil {
		return err
	}
	return c.inMigrationTx(ctx, db, func(tx pgx.Tx) error {
		var have int64
		var exists bool
		if err := tx.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", c.table("schema_version")).Scan(&exists); err != nil {
			return pgError("Migrate: look for version table", err)
		}
		if exists {
			if err := tx.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM "+c.table("schema_version")).Scan(&have); err != nil {
				return pgError("Migrate: read version", err)
			}
		}
		latest := migs[len(migs)-1].version
		if have >= latest {
			if have > latest {
				c.warnLogger().WarnContext(ctx, "pgcoord: database schema is newer than this version of pgcoord knows", "schema", c.schema, "version", have, "known", latest)
			}
			return nil
		}
		if !exists {
			if _, err := tx.Exec(ctx, `CREATE TABLE `+c.table("schema_version")+` (
				version    bigint      PRIMARY KEY CHECK (version > 0),
				name       text        NOT NULL,
				applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
				return pgError("Migrate: create version table", err)
			}
			if _, err := tx.Exec(ctx, "COMMENT ON TABLE "+c.table("schema_version")+" IS 'pgcoord migrations applied by pgcoord.Migrate to this schema: one row per version.'"); err != nil {
				return pgError("Migrate: comment version table", err)
			}
		}
		for _, m := range migs {
			if m.version <= have {
				continue
			}
			if err := c.runMigrationSQL(ctx, tx, m.up); err != nil {
				return errorf("Migrate: apply %06d_%s.up.sql to schema %s: %w", m.version, m.name, c.quotedSchema(), err)
			}
			if _, err := tx.Exec(ctx, "INSERT INTO "+c.table("schema_version")+" (version, name) VALUES ($1, $2)", m.version, m.name); err != nil {
				return pgError("Migrate: record version", err)
			}
			c.infoLogger().InfoContext(ctx, "pgcoord: applied migration", "schema", c.schema, "version", m.version, "name", m.name)
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
	if db == nil {
		return errors.New("pgcoord: migrate down: db is nil")
	}
	if target < 0 {
		return errorf("migrate down: target version %d is negative", target)
	}
	migs, err := loadMigrations(Migrations())
	if err != nil {
		return err
	}
	return c.inMigrationTx(ctx, db, func(tx pgx.Tx) error {
		var have int64
		if err := tx.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM "+c.table("schema_version")).Scan(&have); err != nil {
			return notMigrated(c, "migrate down: read version", err)
		}
		if have > int64(len(migs)) {
			return errorf("migrate down: schema %s is at version %d, newer than the %d migrations known", c.quotedSchema(), have, len(migs))
		}
		for i := have; i > target; i-- {
			m := migs[i-1]
			if err := c.runMigrationSQL(ctx, tx, m.down); err != nil {
				return errorf("migrate down: apply %06d_%s.down.sql to schema %s: %w", m.version, m.name, c.quotedSchema(), err)
			}
			if _, err := tx.Exec(ctx, "DELETE FROM "+c.table("schema_version")+" WHERE version = $1", m.version); err != nil {
				return pgError("migrate down: record version", err)
			}
		}
		if target == 0 {
			if _, err := tx.Exec(ctx, "DROP TABLE "+c.table("schema_version")); err != nil {
				return pgError("migrate down: drop version table", err)
			}
		}
		return nil
	})
}

// inMigrationTx runs fn in a READ COMMITTED transaction on db that holds the
// migration advisory lock and in which the schema exists. The transaction is
// committed if fn returns nil and rolled back otherwise.
func (c *config) inMigrationTx(ctx context.Context, db TxBeginner, fn func(pgx.Tx) error) (err error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return pgError("Migrate: begin", err)
	}
	defer func() {
		if err != nil {
			rollbackTx(ctx, tx)
		}
	}()
	// A later snapshot must see what the previous lock holder committed, so
	// the version read after the lock wait must not reuse an older snapshot.
	if _, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"); err != nil {
		return pgError("Migrate: needs READ COMMITTED", err)
	}
	// The lock comes before any catalog change, so concurrent calls do not
	// race on CREATE SCHEMA or CREATE TABLE.
	if err := XactLock(ctx, tx, migrateKey); err != nil {
		return errorf("Migrate: wait for other migrations: %w", err)
	}
	var exists bool
	if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname = $1)", c.schema).Scan(&exists); err != nil {
		return pgError("Migrate: look for schema", err)
	}
	if !exists {
		if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+c.quotedSchema()); err != nil {
			return pgError("Migrate: create schema "+c.quotedSchema(), err)
		}
	}
	if err := fn(tx); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return pgError("Migrate: commit", err)
	}
	return nil
}

// runMigrationSQL runs the statements of one migration file with
// search_path set to the schema (pg_temp last, so a temporary table cannot
// shadow ours), then restores the previous search_path.
func (c *config) runMigrationSQL(ctx context.Context, tx pgx.Tx, sql string) error {
	var old string
	if err := tx.QueryRow(ctx, "SELECT pg_catalog.current_setting('search_path')").Scan(&old); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, "SET LOCAL search_path TO "+c.quotedSchema()+", pg_temp"); err != nil {
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

// table returns the quoted, schema-qualified name of one of pgcoord's tables.
func (c *config) table(name string) string {
	return c.quotedSchema() + "." + pgx.Identifier{name}.Sanitize()
}
