package pgcoord

import (
	"context"
	"crypto/rand"
	"errors"
	"io/fs"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/fstest"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// versionRow is one row of schema_version.
type versionRow struct {
	Version   int64
	Name      string
	AppliedAt time.Time
}

func readVersions(t *testing.T, ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, schema string) []versionRow {
	t.Helper()
	rows, err := q.Query(ctx, "SELECT version, name, applied_at FROM "+pgx.Identifier{schema, "schema_version"}.Sanitize()+" ORDER BY version, applied_at")
	if err != nil {
		t.Fatalf("read schema_version: %v", err)
	}
	vs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[versionRow])
	if err != nil {
		t.Fatalf("read schema_version: %v", err)
	}
	return vs
}

// schemaRelations returns "name:relkind" for every relation in schema, sorted.
func schemaRelations(t *testing.T, ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, schema string) []string {
	t.Helper()
	rows, err := q.Query(ctx, `SELECT c.relname || ':' || c.relkind::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 ORDER BY 1`, schema)
	if err != nil {
		t.Fatalf("read pg_class: %v", err)
	}
	rs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("read pg_class: %v", err)
	}
	return rs
}

func schemaExists(t *testing.T, ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, schema string) bool {
	t.Helper()
	var ok bool
	if err := q.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", schema).Scan(&ok); err != nil {
		t.Fatalf("read pg_namespace: %v", err)
	}
	return ok
}

// wantMigrated checks that schema holds exactly the tables of all
// migrations, with one schema_version row per version.
func wantMigrated(t *testing.T, ctx context.Context, pool *pgxpool.Pool, schema string) []versionRow {
	t.Helper()
	migs, err := loadMigrations(Migrations())
	if err != nil {
		t.Fatal(err)
	}
	vs := readVersions(t, ctx, pool, schema)
	if len(vs) != len(migs) {
		t.Fatalf("schema_version in %q has %d rows, want %d: %+v", schema, len(vs), len(migs), vs)
	}
	for i, v := range vs {
		if v.Version != migs[i].version || v.Name != migs[i].name {
			t.Fatalf("schema_version row %d = %+v, want version %d name %q", i, v, migs[i].version, migs[i].name)
		}
	}
	var tables []string
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, "SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1 ORDER BY 1", schema)
		if err != nil {
			return err
		}
		tables, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if want := []string{"fences", "leaders", "schema_version", "semaphore_holders", "semaphores"}; !slices.Equal(tables, want) {
		t.Fatalf("tables in schema %q = %q, want %q", schema, tables, want)
	}
	return vs
}

func TestMigrationsFiles(t *testing.T) {
	migs, err := loadMigrations(Migrations())
	if err != nil {
		t.Fatalf("loadMigrations: %v", err)
	}
	if len(migs) == 0 || migs[0].version != 1 || migs[0].name != "fences" {
		t.Fatalf("first migration = %+v, want version 1 named fences", migs[0])
	}
	names, err := fs.Glob(Migrations(), "*.sql")
	if err != nil {
		t.Fatal(err)
	}
	if len(names) != 2*len(migs) {
		t.Fatalf("Migrations() holds %q, want an up and a down file for each of %d versions", names, len(migs))
	}
	for _, m := range migs {
		for _, body := range []string{m.up, m.down} {
			// The files must work with any schema on search_path: no
			// schema-qualified names, no search_path changes.
			var code []string
			for line := range strings.Lines(body) {
				if !strings.HasPrefix(strings.TrimSpace(line), "--") {
					code = append(code, strings.ToLower(line))
				}
			}
			// A function may keep the search_path it was created with.
			sql := strings.ReplaceAll(strings.Join(code, ""), "set search_path from current", "")
			if strings.Contains(sql, "pgcoord.") || strings.Contains(sql, "search_path") || strings.Contains(sql, "schema") {
				t.Errorf("migration %d mentions a schema or search_path:\n%s", m.version, body)
			}
		}
	}
}

func TestMigrationsLoaderRejectsBadSets(t *testing.T) {
	for name, files := range map[string]map[string]string{
		"missing down": {"000001_a.up.sql": "SELECT 1"},
		"gap":          {"000001_a.up.sql": "x", "000001_a.down.sql": "x", "000003_c.up.sql": "x", "000003_c.down.sql": "x"},
		"bad name":     {"000001_a.up.sql": "x", "000001_a.down.sql": "x", "readme.txt": "x"},
		"two names":    {"000001_a.up.sql": "x", "000001_b.down.sql": "x"},
	} {
		fsys := fstest.MapFS{}
		for name, body := range files {
			fsys[name] = &fstest.MapFile{Data: []byte(body)}
		}
		if _, err := loadMigrations(fsys); err == nil || !strings.HasPrefix(err.Error(), "pgcoord: ") {
			t.Errorf("%s: loadMigrations err = %v, want a pgcoord error", name, err)
		}
	}
}

// TestMigrateConcurrentAndIdempotent runs Migrate from many goroutines at
// once, also with a default isolation level under which a snapshot taken
// before the lock wait would miss the versions the previous caller recorded.
func TestMigrateConcurrentAndIdempotent(t *testing.T) {
	for _, iso := range []string{"", "serializable"} {
		t.Run("isolation="+iso, func(t *testing.T) {
			ctx := testCtx(t)
			dsn := pgtest.DB(t)
			const n = 10
			pool := pgtest.Pool(t, dsn, func(c *pgxpool.Config) {
				c.MaxConns = n + 2
				if iso != "" {
					c.ConnConfig.RuntimeParams["default_transaction_isolation"] = iso
				}
			})

			start := make(chan struct{})
			errs := make([]error, n)
			var wg sync.WaitGroup
			for i := range n {
				wg.Go(func() {
					<-start
					errs[i] = Migrate(ctx, pool)
				})
			}
			close(start)
			wg.Wait()
			for i, err := range errs {
				if err != nil {
					t.Fatalf("Migrate %d of %d concurrent calls: %v", i, n, err)
				}
			}
			before := wantMigrated(t, ctx, pool, DefaultSchema)
			if got := schemaRelations(t, ctx, pool, "public"); len(got) != 0 {
				t.Fatalf("Migrate created relations in public: %q", got)
			}

			for range 2 {
				if err := Migrate(ctx, pool); err != nil {
					t.Fatalf("second Migrate: %v", err)
				}
			}
			after := wantMigrated(t, ctx, pool, DefaultSchema)
			if !slices.EqualFunc(before, after, func(a, b versionRow) bool {
				return a.Version == b.Version && a.Name == b.Name && a.AppliedAt.Equal(b.AppliedAt)
			}) {
				t.Fatalf("a second Migrate changed schema_version:\nbefore %+v\nafter  %+v", before, after)
			}
		})
	}
}

// TestMigrateWaitsForLockBeforeCatalog holds Migrate's advisory lock in
// another transaction and checks that Migrate waits for it before touching
// the catalog.
func TestMigrateWaitsForLockBeforeCatalog(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	holder := pgtest.Conn(t, dsn)
	tx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	v, _ := migrateKey.Int64()
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", v); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- Migrate(ctx, pool) }()

	classid, objid, objsubid := migrateKey.LockColumns()
	pgtest.Eventually(t, 10*time.Second, "Migrate never waited on its advisory lock", func() bool {
		for _, l := range pgtest.AdvisoryLocks(t, dsn) {
			if !l.Granted && l.ClassID == classid && l.ObjID == objid && l.ObjSubID == objsubid && l.Mode == "ExclusiveLock" {
				return true
			}
		}
		return false
	})
	select {
	case err := <-done:
		t.Fatalf("Migrate returned %v while the lock was held", err)
	default:
	}
	if schemaExists(t, ctx, holder, DefaultSchema) {
		t.Fatal("schema created before the advisory lock was granted")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Migrate: %v", err)
		}
	case <-ctx.Done():
		t.Fatal("Migrate did not finish after the lock was released")
	}
	wantMigrated(t, ctx, pool, DefaultSchema)
}

func TestMigrateHostileSchemaNames(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	if _, err := pool.Exec(ctx, `CREATE SCHEMA victims; CREATE TABLE victims.victim (id int); CREATE SCHEMA "drop"; CREATE TABLE "drop".victim (id int)`); err != nil {
		t.Fatal(err)
	}
	names := []string{
		`odd "name"; drop`,
		`x"; DROP TABLE victims.victim; --`,
		`'; DROP SCHEMA "drop" CASCADE; --`,
		strings.Repeat("s", 60),
		strings.Repeat(`";`, 30),
		strings.Repeat("é", 31), // 62 bytes
		"MixedCase",
		"public",
	}
	for _, name := range names {
		if err := Migrate(ctx, pool, WithSchema(name)); err != nil {
			t.Fatalf("Migrate(WithSchema(%q)): %v", name, err)
		}
		wantMigrated(t, ctx, pool, name)
		if err := Migrate(ctx, pool, WithSchema(name)); err != nil {
			t.Fatalf("second Migrate(WithSchema(%q)): %v", name, err)
		}
	}
	var victims int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_class WHERE relname = 'victim'`).Scan(&victims); err != nil {
		t.Fatal(err)
	}
	if victims != 2 {
		t.Fatalf("%d victim tables left, want 2", victims)
	}
	// Every schema the test asked for, the two it made, and nothing else
	// outside the system schemas.
	rows, err := pool.Query(ctx, `SELECT nspname::text FROM pg_namespace WHERE nspname NOT LIKE 'pg\_%' AND nspname <> 'information_schema' ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(got)
	want := append([]string{"drop", "victims"}, names...)
	slices.Sort(want)
	want = slices.Compact(want)
	if !slices.Equal(got, want) {
		t.Fatalf("schemas = %q, want %q", got, want)
	}

	for _, bad := range []string{"", "nul\x00byte", strings.Repeat("s", 64), strings.Repeat("é", 32)} {
		err := Migrate(ctx, pool, WithSchema(bad))
		if err == nil || !strings.HasPrefix(err.Error(), "pgcoord: ") || !strings.Contains(err.Error(), "schema name") {
			t.Errorf("Migrate(WithSchema(%q)) = %v, want a clear schema name error", bad, err)
		}
	}
	// A name PostgreSQL reserves is refused by the server, with its error.
	err = Migrate(ctx, pool, WithSchema("pg_pgcoord"))
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "42939" {
		t.Fatalf("Migrate(WithSchema(\"pg_pgcoord\")) = %v, want the server's reserved name error", err)
	}
}

// The options of New, Migrate and CheckFence are types of their own: an
// option that does not apply somewhere does not compile there. WithSchema
// serves all three, WithLogger New and Migrate, and no other option is a
// MigrateOption or a FenceOption.
func TestOptionTypes(t *testing.T) {
	var _ Option = WithSchema("s")
	var _ MigrateOption = WithSchema("s")
	var _ FenceOption = WithSchema("s")
	var _ Option = WithLogger(slog.Default())
	var _ MigrateOption = WithLogger(slog.Default())
	if _, ok := any(WithLogger(slog.Default())).(FenceOption); ok {
		t.Error("WithLogger is a FenceOption")
	}
	for name, o := range map[string]Option{
		"WithHeartbeat":       WithHeartbeat(time.Second),
		"WithLossDeadline":    WithLossDeadline(10 * time.Second),
		"WithApplicationName": WithApplicationName("x"),
		"WithMaxWaits":        WithMaxWaits(1),
		"WithSharedBackends":  WithSharedBackends(1),
		"WithHandoff":         WithHandoff(1, time.Second),
		"WithSessionPooler":   WithSessionPooler(),
		"WithHooks":           WithHooks(Hooks{}),
		"WithKeyNames":        WithKeyNames(nil),
	} {
		if _, ok := o.(MigrateOption); ok {
			t.Errorf("%s is a MigrateOption", name)
		}
		if _, ok := o.(FenceOption); ok {
			t.Errorf("%s is a FenceOption", name)
		}
	}
}

func TestMigrateRejectsOptions(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	for _, opts := range [][]MigrateOption{
		{nil},
		{WithLogger(nil)},
		{WithSchema("ok"), nil},
		{WithSchema("ok"), WithLogger(nil)},
	} {
		err := Migrate(ctx, pool, opts...)
		if err == nil || !strings.HasPrefix(err.Error(), "pgcoord: ") {
			t.Errorf("Migrate with %d options = %v, want an error", len(opts), err)
		}
	}
	if err := Migrate(ctx, nil); err == nil {
		t.Error("Migrate(nil db) = nil, want an error")
	}
	for _, s := range []string{DefaultSchema, "ok"} {
		if schemaExists(t, ctx, pool, s) {
			t.Errorf("a rejected Migrate created schema %q", s)
		}
	}
}

func TestMigrateCancelledAppliesNothing(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := Migrate(cctx, pool); !errors.Is(err, context.Canceled) {
		t.Fatalf("Migrate with a cancelled ctx = %v, want context.Canceled", err)
	}
	if schemaExists(t, ctx, pool, DefaultSchema) {
		t.Fatal("a cancelled Migrate created the schema")
	}
}

func TestMigrateDownAndUpAgain(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	const schema = `down "and"; up`
	if err := Migrate(ctx, pool, WithSchema(schema)); err != nil {
		t.Fatal(err)
	}
	first := wantMigrated(t, ctx, pool, schema)
	if err := migrateDown(ctx, pool, 0, WithSchema(schema)); err != nil {
		t.Fatalf("migrateDown: %v", err)
	}
	if got := schemaRelations(t, ctx, pool, schema); len(got) != 0 {
		t.Fatalf("after migrateDown schema %q still holds %q", schema, got)
	}
	if !schemaExists(t, ctx, pool, schema) {
		t.Fatal("migrateDown dropped the schema itself")
	}
	if err := migrateDown(ctx, pool, 0, WithSchema(schema)); !errors.Is(err, ErrNotMigrated) {
		t.Fatalf("migrateDown of an empty schema = %v, want ErrNotMigrated", err)
	}
	if err := Migrate(ctx, pool, WithSchema(schema)); err != nil {
		t.Fatalf("Migrate after migrateDown: %v", err)
	}
	second := wantMigrated(t, ctx, pool, schema)
	if !second[0].AppliedAt.After(first[0].AppliedAt) {
		t.Fatalf("version 1 applied at %v, not after the first run at %v", second[0].AppliedAt, first[0].AppliedAt)
	}
}

// TestMigrationFilesWithSearchPath applies the files of Migrations() the way
// a migration tool does, with search_path set to a schema, up in order and
// down in reverse.
func TestMigrationFilesWithSearchPath(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	conn := pgtest.Conn(t, dsn)
	const schema = `tool's "schema"`
	quoted := pgx.Identifier{schema}.Sanitize()
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+quoted+"; SET search_path TO "+quoted); err != nil {
		t.Fatal(err)
	}
	ups, err := fs.Glob(Migrations(), "*.up.sql")
	if err != nil {
		t.Fatal(err)
	}
	downs, err := fs.Glob(Migrations(), "*.down.sql")
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(ups)
	slices.Sort(downs)
	slices.Reverse(downs)
	run := func(name string) {
		body, err := fs.ReadFile(Migrations(), name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, string(body)); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	for _, name := range ups {
		run(name)
	}
	if got, want := schemaRelations(t, ctx, conn, schema), []string{"fences:r", "fences_pkey:i", "leaders:r", "leaders_pkey:i", "semaphore_holders:r", "semaphore_holders_pkey:i", "semaphores:r", "semaphores_pkey:i"}; !slices.Equal(got, want) {
		t.Fatalf("relations after the up files = %q, want %q", got, want)
	}
	if got := schemaRelations(t, ctx, conn, "public"); len(got) != 0 {
		t.Fatalf("the up files created relations in public: %q", got)
	}
	var comments int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_description d JOIN pg_class c ON c.oid = d.objoid
		JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = 'fences'`, schema).Scan(&comments); err != nil {
		t.Fatal(err)
	}
	if comments != 4 {
		t.Fatalf("fences has %d comments, want 4 (table and three columns)", comments)
	}
	for _, name := range downs {
		run(name)
	}
	if got := schemaRelations(t, ctx, conn, schema); len(got) != 0 {
		t.Fatalf("relations after the down files = %q, want none", got)
	}
}

// TestMigratePrivileges runs Migrate as a role without CREATE on the
// database: it fails with the server's privilege error on a fresh database,
// and succeeds as a no-op once the schema is up to date and readable.
func TestMigratePrivileges(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	admin := pgtest.Conn(t, dsn)
	// Roles belong to the whole server: the name must not collide with
	// other tests'.
	role := pgx.Identifier{"pgcoord_app_" + strings.ToLower(rand.Text())}.Sanitize()
	if _, err := admin.Exec(ctx, "CREATE ROLE "+role+" NOLOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := admin.Exec(cctx, "DROP OWNED BY "+role+"; DROP ROLE "+role); err != nil {
			t.Errorf("drop role: %v", err)
		}
	})
	app := pgtest.Pool(t, dsn, func(c *pgxpool.Config) {
		c.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
			_, err := conn.Exec(ctx, "SET ROLE "+role)
			return err
		}
	})
	err := Migrate(ctx, app)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "42501" || !strings.HasPrefix(err.Error(), "pgcoord: ") {
		t.Fatalf("Migrate without CREATE on the database = %v, want a wrapped 42501 error", err)
	}
	if schemaExists(t, ctx, admin, DefaultSchema) {
		t.Fatal("a failed Migrate left the schema behind")
	}

	if err := Migrate(ctx, pgtest.Pool(t, dsn)); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "GRANT USAGE ON SCHEMA pgcoord TO "+role+"; GRANT SELECT ON pgcoord.schema_version TO "+role); err != nil {
		t.Fatal(err)
	}
	if err := Migrate(ctx, app); err != nil {
		t.Fatalf("Migrate of an up-to-date schema with USAGE and SELECT only: %v", err)
	}
}

// An upgrade alters tables that exist, which PostgreSQL allows only to
// their owner: a role with USAGE and CREATE on the schema (and SELECT on
// schema_version) that does not own them gets an error naming the step and
// what it needs, and nothing is applied; recording a version needs INSERT
// on schema_version; the role that owns the tables upgrades.
func TestMigrateUpgradeNeedsTableOwner(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	admin := pgtest.Conn(t, dsn)
	owner, ownerDSN := newTestRole(t, dsn, "pgcoord_owner")
	app, appDSN := newTestRole(t, dsn, "pgcoord_app")
	t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		if _, err := admin.Exec(cctx, "DROP SCHEMA IF EXISTS coord CASCADE; DROP OWNED BY "+owner+", "+app); err != nil {
			t.Errorf("drop owned: %v", err)
		}
	})
	var db string
	if err := admin.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "GRANT CREATE ON DATABASE "+pgx.Identifier{db}.Sanitize()+" TO "+owner); err != nil {
		t.Fatal(err)
	}
	ownerPool, appPool := pgtest.Pool(t, ownerDSN), pgtest.Pool(t, appDSN)
	const schema = "coord"
	if err := Migrate(ctx, ownerPool, WithSchema(schema)); err != nil {
		t.Fatal(err)
	}
	if err := migrateDown(ctx, ownerPool, 3, WithSchema(schema)); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "GRANT USAGE, CREATE ON SCHEMA coord TO "+app+"; GRANT SELECT ON coord.schema_version TO "+app); err != nil {
		t.Fatal(err)
	}
	// atVersion3 checks, as the admin, that nothing of a later version
	// is there.
	atVersion3 := func(after string) {
		t.Helper()
		if vs := readVersions(t, ctx, admin, schema); len(vs) != 3 || vs[2].Version != 3 {
			t.Fatalf("after %s schema_version holds %+v, want versions 1 to 3", after, vs)
		}
		var cols int
		if err := admin.QueryRow(ctx, `SELECT count(*) FROM information_schema.columns
			WHERE table_schema = $1 AND table_name = 'leaders' AND column_name IN ('resign_term', 'guarded')`, schema).Scan(&cols); err != nil {
			t.Fatal(err)
		}
		if cols != 0 {
			t.Fatalf("after %s leaders has %d columns of versions 4 and 5, want none", after, cols)
		}
	}

	err := Migrate(ctx, appPool, WithSchema(schema))
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "42501" {
		t.Fatalf("Migrate by a role that does not own the tables = %v, want a wrapped 42501 error", err)
	}
	for _, want := range []string{`pgcoord: migrate schema "coord": apply 000004_resign_requests: `, "must be owner of table leaders", "the role that owns pgcoord's tables"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Migrate by a role that does not own the tables = %q, want it to say %q", err, want)
		}
	}
	atVersion3("a failed upgrade")

	// The owner, without INSERT on schema_version.
	if _, err := admin.Exec(ctx, "ALTER TABLE coord.schema_version OWNER TO CURRENT_USER; GRANT SELECT ON coord.schema_version TO "+owner); err != nil {
		t.Fatal(err)
	}
	err = Migrate(ctx, ownerPool, WithSchema(schema))
	if !errors.As(err, &pe) || pe.Code != "42501" {
		t.Fatalf("Migrate without INSERT on schema_version = %v, want a wrapped 42501 error", err)
	}
	for _, want := range []string{`pgcoord: migrate schema "coord": record version 4: `, "INSERT on schema_version"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Migrate without INSERT on schema_version = %q, want it to say %q", err, want)
		}
	}
	atVersion3("an upgrade that could not record its version")

	if _, err := admin.Exec(ctx, "GRANT INSERT ON coord.schema_version TO "+owner); err != nil {
		t.Fatal(err)
	}
	if err := Migrate(ctx, ownerPool, WithSchema(schema)); err != nil {
		t.Fatalf("Migrate by the tables' owner: %v", err)
	}
	wantMigrated(t, ctx, pgtest.Pool(t, dsn), schema)
	// Up to date, the other role needs only USAGE and SELECT.
	if err := Migrate(ctx, appPool, WithSchema(schema)); err != nil {
		t.Fatalf("Migrate of an up-to-date schema by another role: %v", err)
	}
}
