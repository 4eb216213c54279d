package pgcoordtest_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/pgcoordtest"
)

// ctxT returns a context bounded by 30 seconds and cancelled at cleanup.
func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// connect opens a connection to dsn, closed at cleanup.
func connect(t testing.TB, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctxT(t), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// migratedVersion reads the version Migrate recorded in dsn's database.
func migratedVersion(t testing.TB, dsn string) int {
	t.Helper()
	var v int
	err := connect(t, dsn).QueryRow(ctxT(t), "SELECT max(version) FROM pgcoord.schema_version").Scan(&v)
	if err != nil {
		t.Fatalf("read pgcoord.schema_version: %v", err)
	}
	return v
}

// latestMigration returns the newest version among pgcoord's migrations.
func latestMigration(t testing.TB) int {
	t.Helper()
	dsn := pgcoordtest.DB(t)
	pool := pgcoordtest.Pool(t, dsn)
	// Migrate again: it applies nothing on a database that is up to date,
	// so the version it leaves is the newest there is.
	if err := pgcoord.Migrate(ctxT(t), pool); err != nil {
		t.Fatal(err)
	}
	return migratedVersion(t, dsn)
}

// Twenty tests in parallel each get a database of their own, migrated,
// and see nothing of each other's: each creates the same table, which
// would fail in a shared database, and each takes a key that the parent
// test holds, in its own database, all along.
func TestParallelTestsGetTheirOwnDatabases(t *testing.T) {
	want := latestMigration(t)
	key := pgcoord.HashKey("pgcoordtest", "parallel")
	holder := pgcoordtest.Client(t, pgcoordtest.DB(t))
	if _, err := holder.Lock(ctxT(t), key); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	names := map[string]string{} // database -> test
	t.Run("group", func(t *testing.T) {
		for i := range 20 {
			t.Run(fmt.Sprint(i), func(t *testing.T) {
				t.Parallel()
				dsn := pgcoordtest.DB(t)
				conn := connect(t, dsn)
				var db string
				if err := conn.QueryRow(ctxT(t), "SELECT current_database()").Scan(&db); err != nil {
					t.Fatal(err)
				}
				mu.Lock()
				if other, ok := names[db]; ok {
					t.Errorf("database %s given to test %s and to %s", db, other, t.Name())
				}
				names[db] = t.Name()
				mu.Unlock()
				if v := migratedVersion(t, dsn); v != want {
					t.Errorf("schema version %d, want %d", v, want)
				}
				if _, err := conn.Exec(ctxT(t), "CREATE TABLE mine (test text)"); err != nil {
					t.Fatalf("create a table no other test's database has: %v", err)
				}
				c := pgcoordtest.Client(t, dsn)
				l, err := c.TryLock(ctxT(t), key)
				if err != nil {
					t.Fatalf("TryLock of a key held in another database: %v", err)
				}
				if err := l.Unlock(ctxT(t)); err != nil {
					t.Fatal(err)
				}
			})
		}
	})
	if len(names) != 20 {
		t.Fatalf("%d databases for 20 tests", len(names))
	}
	// Every database was dropped when its test ended.
	conn := connect(t, pgcoordtest.DB(t))
	for db := range names {
		var n int
		if err := conn.QueryRow(ctxT(t), "SELECT count(*) FROM pg_database WHERE datname = $1", db).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Errorf("database %s still exists after its test", db)
		}
	}
}

// DB and Client work from a test's cleanup, where t.Context() is already
// cancelled, and the database made there is dropped too.
func TestDBFromACleanup(t *testing.T) {
	var db string
	t.Run("inner", func(t *testing.T) {
		t.Cleanup(func() {
			dsn := pgcoordtest.DB(t)
			c := pgcoordtest.Client(t, dsn)
			l, err := c.TryLock(ctxT(t), pgcoord.HashKey("cleanup"))
			if err != nil {
				t.Fatalf("TryLock from a cleanup: %v", err)
			}
			if err := l.Unlock(ctxT(t)); err != nil {
				t.Fatal(err)
			}
			if err := connect(t, dsn).QueryRow(ctxT(t), "SELECT current_database()").Scan(&db); err != nil {
				t.Fatal(err)
			}
		})
	})
	if db == "" {
		t.Fatal("the cleanup made no database")
	}
	var n int
	if err := connect(t, pgcoordtest.DB(t)).QueryRow(ctxT(t), "SELECT count(*) FROM pg_database WHERE datname = $1", db).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("database %s made in a cleanup still exists after the test", db)
	}
}
