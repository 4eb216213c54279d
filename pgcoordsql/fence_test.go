package pgcoordsql_test

import (
	"database/sql"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"github.com/pgcoord/pgcoord/pgcoordsql"
)

// fencedLock takes key through c with a fence, releases it, and returns the
// fence.
func fencedLock(t *testing.T, c *pgcoord.Client, key pgcoord.Key) pgcoord.Term {
	t.Helper()
	l, err := c.Lock(t.Context(), key, pgcoord.WithFence())
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Unlock(t.Context()); err != nil {
		t.Fatal(err)
	}
	return l.Fence()
}

// checkFence runs CheckFence in a transaction of db and rolls it back.
func checkFence(t *testing.T, db *sql.DB, key pgcoord.Key, fence pgcoord.Term, opts ...pgcoord.FenceOption) error {
	t.Helper()
	tx, _ := begin(t, db)
	defer tx.Rollback()
	return pgcoordsql.CheckFence(t.Context(), tx, key, fence, opts...)
}

// TestCheckFence: with fences issued by a Client's fenced locks, in the
// Client's schema, CheckFence accepts the newest fence and refuses an older
// one and one never issued with ErrStaleFence; while a transaction that
// passed CheckFence is open, the next fenced lock waits for it (its fence
// row is share-locked), and gets a newer fence once it commits.
func TestCheckFence(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	schema := pgcoord.WithSchema("fences here")
	if err := pgcoord.Migrate(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	c, err := pgcoord.New(pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(ctx) })
	db := openDB(t, dsn)
	key := pgcoord.PairKey(4, -4)

	old := fencedLock(t, c, key)
	current := fencedLock(t, c, key)
	if current <= old {
		t.Fatalf("fences %d then %d: not increasing", old, current)
	}
	if err := checkFence(t, db, key, old, schema); !errors.Is(err, pgcoord.ErrStaleFence) {
		t.Fatalf("stale fence %d: got %v, want ErrStaleFence", old, err)
	}
	if err := checkFence(t, db, key, current+1, schema); !errors.Is(err, pgcoord.ErrStaleFence) {
		t.Fatalf("fence %d never issued: got %v, want ErrStaleFence", current+1, err)
	}
	if err := checkFence(t, db, pgcoord.Int64Key(99), 1, schema); !errors.Is(err, pgcoord.ErrStaleFence) || !strings.Contains(err.Error(), "no fence exists") {
		t.Fatalf("key without fences: got %v, want ErrStaleFence (no fence exists)", err)
	}

	tx, _ := begin(t, db)
	if err := pgcoordsql.CheckFence(ctx, tx, key, current, schema); err != nil {
		t.Fatalf("current fence %d: %v", current, err)
	}
	next := make(chan pgcoord.Term, 1)
	r := async(func() error {
		l, err := c.Lock(ctx, key, pgcoord.WithFence())
		if err != nil {
			return err
		}
		next <- l.Fence()
		return l.Unlock(ctx)
	})
	pgtest.Eventually(t, waitLimit, "the fenced lock to wait for the checked fence's row", func() bool {
		var n int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
			WHERE NOT l.granted AND l.locktype IN ('transactionid', 'tuple') AND a.datname = current_database()`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n > 0
	})
	if len(next) != 0 {
		t.Fatal("a newer fence was issued while a transaction that checked the current one was open")
	}
	if _, err := tx.ExecContext(ctx, "CREATE TABLE written_under_fence ()"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := r.get(t); err != nil {
		t.Fatal(err)
	}
	if f := <-next; f <= current {
		t.Fatalf("fence after the check: %d, want more than %d", f, current)
	}
	if err := checkFence(t, db, key, current, schema); !errors.Is(err, pgcoord.ErrStaleFence) {
		t.Fatalf("fence %d after a newer one: got %v, want ErrStaleFence", current, err)
	}
}

// TestCheckFenceNotMigrated: without pgcoord's tables in the schema,
// CheckFence returns ErrNotMigrated; bad input is refused before the query.
func TestCheckFenceNotMigrated(t *testing.T) {
	db := openDB(t, pgtest.DB(t))
	key := pgcoord.Int64Key(1)
	if err := checkFence(t, db, key, 1); !errors.Is(err, pgcoord.ErrNotMigrated) {
		t.Fatalf("default schema, not migrated: got %v, want ErrNotMigrated", err)
	}
	if err := checkFence(t, db, key, 1, pgcoord.WithSchema("elsewhere")); !errors.Is(err, pgcoord.ErrNotMigrated) || !strings.Contains(err.Error(), "elsewhere") {
		t.Fatalf("schema elsewhere, not migrated: got %v, want ErrNotMigrated naming the schema", err)
	}
	if err := checkFence(t, db, pgcoord.Key{}, 1); !errors.Is(err, pgcoord.ErrInvalidKey) {
		t.Errorf("zero key: got %v, want ErrInvalidKey", err)
	}
	if err := checkFence(t, db, key, 0); err == nil || errors.Is(err, pgcoord.ErrNotMigrated) {
		t.Errorf("fence 0: got %v, want an error before the query", err)
	}
	if err := pgcoordsql.CheckFence(t.Context(), nil, key, 1); err == nil {
		t.Error("nil tx: no error")
	}
	if err := checkFence(t, db, key, 1, pgcoord.WithSchema("")); err == nil || errors.Is(err, pgcoord.ErrNotMigrated) {
		t.Errorf("empty schema: got %v, want the option's error", err)
	}
}

// TestCheckFenceFirstFenceAfterSnapshot: in a REPEATABLE READ or
// SERIALIZABLE *sql.Tx whose snapshot predates the key's first fence,
// CheckFence of that current fence returns a serialization failure
// (SQLSTATE 40001), not ErrStaleFence; a retry in a new transaction passes.
func TestCheckFenceFirstFenceAfterSnapshot(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	c := fenceClient(t, dsn)
	db := openDB(t, dsn)
	for i, level := range []sql.IsolationLevel{sql.LevelRepeatableRead, sql.LevelSerializable} {
		t.Run(level.String(), func(t *testing.T) {
			key := pgcoord.Int64Key(int64(100 + i))
			begin := func() *sql.Tx {
				tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: level})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = tx.Rollback() })
				var n int // the snapshot is taken here
				if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM pgcoord.fences`).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return tx
			}
			tx := begin()
			fence := fencedLock(t, c, key)
			err := pgcoordsql.CheckFence(ctx, tx, key, fence)
			if errors.Is(err, pgcoord.ErrStaleFence) || sqlStateOf(err) != "40001" {
				t.Fatalf("CheckFence(current first fence %d, issued after the snapshot) = %v, want SQLSTATE 40001 and no ErrStaleFence", fence, err)
			}
			_ = tx.Rollback()
			if err := pgcoordsql.CheckFence(ctx, begin(), key, fence); err != nil {
				t.Fatalf("retried CheckFence(%d) = %v, want nil", fence, err)
			}
		})
	}
}

// TestInTxNoKeysCheckFence: InTx with no keys runs a transaction that takes
// no lock, such as one that checks a fence held elsewhere and writes under
// it: with the current fence the write commits, with a stale one CheckFence
// refuses it and nothing is written. pg_locks shows no advisory lock while
// fn runs.
func TestInTxNoKeysCheckFence(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	if err := pgcoord.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	c, err := pgcoord.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(ctx) })
	db := openDB(t, dsn)
	if _, err := db.ExecContext(ctx, "CREATE TABLE ledger (fence bigint)"); err != nil {
		t.Fatal(err)
	}
	key := pgcoord.Int64Key(77)
	write := func(fence pgcoord.Term) func(*sql.Tx) error {
		return func(tx *sql.Tx) error {
			if err := pgcoordsql.CheckFence(ctx, tx, key, fence); err != nil {
				return err
			}
			var n int
			if err := tx.QueryRowContext(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()").Scan(&n); err != nil {
				return err
			}
			if n != 0 {
				t.Errorf("InTx with no keys holds %d advisory locks", n)
			}
			_, err := tx.ExecContext(ctx, "INSERT INTO ledger VALUES ($1)", int64(fence))
			return err
		}
	}
	old := fencedLock(t, c, key)
	if err := pgcoordsql.InTx(ctx, db, nil, write(old)); err != nil {
		t.Fatalf("InTx with no keys and the current fence: %v", err)
	}
	if err := pgcoordsql.InTxOptions(ctx, db, nil, []pgcoord.Key{}, write(old)); err != nil {
		t.Fatalf("InTxOptions with an empty key list and the current fence: %v", err)
	}
	newer := fencedLock(t, c, key)
	if err := pgcoordsql.InTx(ctx, db, nil, write(old)); !errors.Is(err, pgcoord.ErrStaleFence) {
		t.Fatalf("InTx with no keys and a stale fence: got %v, want ErrStaleFence", err)
	}
	if err := pgcoordsql.InTx(ctx, db, nil, write(newer)); err != nil {
		t.Fatalf("InTx with no keys and the newer fence: %v", err)
	}
	var got []int64
	rs, err := db.QueryContext(ctx, "SELECT fence FROM ledger ORDER BY fence")
	if err != nil {
		t.Fatal(err)
	}
	defer rs.Close()
	for rs.Next() {
		var f int64
		if err := rs.Scan(&f); err != nil {
			t.Fatal(err)
		}
		got = append(got, f)
	}
	if err := rs.Err(); err != nil {
		t.Fatal(err)
	}
	if want := []int64{int64(old), int64(old), int64(newer)}; !slices.Equal(got, want) {
		t.Fatalf("ledger: got %v, want %v (none written under the stale fence)", got, want)
	}
}
