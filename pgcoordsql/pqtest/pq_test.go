package pqtest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"github.com/pgcoord/pgcoord/pgcoordsql"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const limit = 20 * time.Second // bounds every wait for state to change

// setup returns a fresh database's connection string and a lib/pq *sql.DB
// on it, closed in t.Cleanup.
func setup(t *testing.T) (string, *sql.DB) {
	t.Helper()
	dsn := pgtest.DB(t)
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return dsn, db
}

// begin begins a transaction and returns it with its backend's pid; it is
// rolled back in t.Cleanup (statements still running are cancelled with
// t.Context() first).
func begin(t *testing.T, db *sql.DB) (*sql.Tx, int32) {
	t.Helper()
	tx, err := db.BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	var pid int32
	if err := tx.QueryRowContext(t.Context(), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	return tx, pid
}

// locks returns backend pid's advisory locks as sorted "key mode granted?".
func locks(t *testing.T, dsn string, pid int32) []string {
	t.Helper()
	var out []string
	for _, l := range pgtest.AdvisoryLocks(t, dsn) {
		if l.PID == pid {
			k, err := pgcoord.KeyFromLock(l.ClassID, l.ObjID, l.ObjSubID)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, fmt.Sprintf("%v %s %t", k, l.Mode, l.Granted))
		}
	}
	slices.Sort(out)
	return out
}

// waitLocks waits until locks(pid) equals want (sorted).
func waitLocks(t *testing.T, dsn string, pid int32, want ...string) {
	t.Helper()
	slices.Sort(want)
	var got []string
	pgtest.Eventually(t, limit, fmt.Sprintf("backend %d to hold %q", pid, want), func() bool {
		got = locks(t, dsn, pid)
		return slices.Equal(got, want)
	})
}

// async runs f in a goroutine and returns its result channel.
func async(f func() error) chan error {
	r := make(chan error, 1)
	go func() { r <- f() }()
	return r
}

func get(t *testing.T, r chan error) error {
	t.Helper()
	select {
	case err := <-r:
		return err
	case <-time.After(limit):
		t.Fatalf("call did not return within %v", limit)
		return nil
	}
}

// TestOrder: the keys of one call are taken in canonical order: with
// int64:2 held elsewhere, the keys below it are granted, it is awaited, and
// the pair key (after every bigint key) is not requested; a transaction
// that gives the same keys in the opposite order waits for the first key
// holding nothing, so the two cannot deadlock. Both then get every key.
func TestOrder(t *testing.T) {
	ctx := t.Context()
	dsn, db := setup(t)
	k := []pgcoord.Key{pgcoord.Int64Key(-1), pgcoord.Int64Key(1), pgcoord.Int64Key(2), pgcoord.PairKey(0, 0)}
	blocker, _ := begin(t, db)
	if err := pgcoordsql.XactLock(ctx, blocker, k[2]); err != nil {
		t.Fatal(err)
	}
	tx1, pid1 := begin(t, db)
	r1 := async(func() error { return pgcoordsql.XactLock(ctx, tx1, k[3], k[2], k[1], k[0], k[1]) })
	waitLocks(t, dsn, pid1, "int64:-1 ExclusiveLock true", "int64:1 ExclusiveLock true", "int64:2 ExclusiveLock false")
	tx2, pid2 := begin(t, db)
	r2 := async(func() error { return pgcoordsql.XactLock(ctx, tx2, k...) })
	waitLocks(t, dsn, pid2, "int64:-1 ExclusiveLock false")
	if err := blocker.Rollback(); err != nil {
		t.Fatal(err)
	}
	all := []string{"int64:-1 ExclusiveLock true", "int64:1 ExclusiveLock true", "int64:2 ExclusiveLock true", "pair:0,0 ExclusiveLock true"}
	for _, x := range []struct {
		tx  *sql.Tx
		pid int32
		r   chan error
	}{{tx1, pid1, r1}, {tx2, pid2, r2}} {
		if err := get(t, x.r); err != nil {
			t.Fatal(err)
		}
		waitLocks(t, dsn, x.pid, all...)
		if err := x.tx.Commit(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestTryLocked: the try variants return ErrLocked naming the key held
// elsewhere, keeping the keys before it.
func TestTryLocked(t *testing.T) {
	ctx := t.Context()
	dsn, db := setup(t)
	holder, _ := begin(t, db)
	if err := pgcoordsql.XactLock(ctx, holder, pgcoord.Int64Key(2)); err != nil {
		t.Fatal(err)
	}
	for _, try := range []func(context.Context, *sql.Tx, ...pgcoord.Key) error{pgcoordsql.XactTryLock, pgcoordsql.XactTryRLock} {
		tx, pid := begin(t, db)
		err := try(ctx, tx, pgcoord.Int64Key(3), pgcoord.Int64Key(2), pgcoord.Int64Key(1))
		if !errors.Is(err, pgcoord.ErrLocked) || !strings.Contains(err.Error(), "int64:2") {
			t.Fatalf("got %v, want ErrLocked naming int64:2", err)
		}
		if got := locks(t, dsn, pid); len(got) != 1 || !strings.HasPrefix(got[0], "int64:1 ") {
			t.Fatalf("after the failed try: %q, want int64:1 only", got)
		}
		if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestCancelledWait: lib/pq answers a ctx deadline during the wait with a
// cancel request and waits for the server: when XactLock returns (with the
// context's error) the transaction's keys are already free, the
// transaction is unusable, and after Rollback the connection is dropped and
// none is in use.
func TestCancelledWait(t *testing.T) {
	ctx := t.Context()
	dsn, db := setup(t)
	holder, _ := begin(t, db)
	if err := pgcoordsql.XactLock(ctx, holder, pgcoord.Int64Key(2)); err != nil {
		t.Fatal(err)
	}
	// The deadline must pass during the wait; on a machine too slow for it,
	// try a longer one.
	for d := 500 * time.Millisecond; ; d *= 4 {
		tx, pid := begin(t, db)
		cctx, cancel := context.WithTimeout(ctx, d)
		r := async(func() error { return pgcoordsql.XactLock(cctx, tx, pgcoord.Int64Key(1), pgcoord.Int64Key(2)) })
		waited := false
		for !waited && len(r) == 0 {
			waited = slices.Equal(locks(t, dsn, pid), []string{"int64:1 ExclusiveLock true", "int64:2 ExclusiveLock false"})
		}
		err := get(t, r)
		cancel()
		if !waited {
			if d > 10*time.Second {
				t.Fatalf("XactLock returned %v before its wait showed in pg_locks", err)
			}
			_ = tx.Rollback()
			continue
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("got %v, want an error wrapping context.DeadlineExceeded", err)
		}
		t.Logf("XactLock after its deadline (%v): %v", d, err)
		if got := locks(t, dsn, pid); len(got) != 0 {
			t.Fatalf("keys held when XactLock returned: %q", got)
		}
		if _, err := tx.ExecContext(ctx, "SELECT 1"); err == nil {
			t.Fatal("the transaction still runs statements")
		}
		_ = tx.Rollback()
		break
	}
	if err := holder.Rollback(); err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, limit, "no connection in use, one open", func() bool {
		s := db.Stats()
		return s.InUse == 0 && s.OpenConnections == 1 // the holder's, now idle
	})
}

// TestInTx: InTx commits fn's work holding the keys, rolls back on fn's
// error; afterwards the keys are free. An ignored statement error makes
// lib/pq report pq.ErrInFailedTransaction.
func TestInTx(t *testing.T) {
	ctx := t.Context()
	dsn, db := setup(t)
	if _, err := db.Exec("CREATE TABLE t (v int)"); err != nil {
		t.Fatal(err)
	}
	keys := []pgcoord.Key{pgcoord.Int64Key(2), pgcoord.Int64Key(1)}
	var pid int32
	run := func(v int, ret func(*sql.Tx) error) error {
		return pgcoordsql.InTx(ctx, db, keys, func(tx *sql.Tx) error {
			if err := tx.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
				return err
			}
			waitLocks(t, dsn, pid, "int64:1 ExclusiveLock true", "int64:2 ExclusiveLock true")
			if _, err := tx.ExecContext(ctx, "INSERT INTO t VALUES ($1)", v); err != nil {
				return err
			}
			return ret(tx)
		})
	}
	boom := errors.New("boom")
	for _, c := range []struct {
		v    int
		ret  func(*sql.Tx) error
		want error
	}{
		{1, func(*sql.Tx) error { return nil }, nil},
		{2, func(*sql.Tx) error { return boom }, boom},
		{3, func(tx *sql.Tx) error { _, _ = tx.ExecContext(ctx, "SELECT 1/0"); return nil }, pq.ErrInFailedTransaction},
	} {
		if err := run(c.v, c.ret); !errors.Is(err, c.want) {
			t.Fatalf("InTx inserting %d: got %v, want %v", c.v, err, c.want)
		}
		if got := locks(t, dsn, pid); len(got) != 0 {
			t.Fatalf("keys held after InTx: %q", got)
		}
	}
	var n, sum int
	if err := db.QueryRow("SELECT count(*), coalesce(sum(v), 0) FROM t").Scan(&n, &sum); err != nil {
		t.Fatal(err)
	}
	if n != 1 || sum != 1 {
		t.Fatalf("table holds %d rows summing to %d, want only the committed 1", n, sum)
	}
}

// TestStaleFence: CheckFence refuses a fence older than the newest issued
// (by a Client's fenced lock) with ErrStaleFence and accepts the newest;
// without pgcoord's tables it returns ErrNotMigrated.
func TestStaleFence(t *testing.T) {
	ctx := t.Context()
	dsn, db := setup(t)
	key := pgcoord.HashKey("fenced")
	check := func(fence pgcoord.Term) error {
		tx, _ := begin(t, db)
		defer tx.Rollback()
		return pgcoordsql.CheckFence(ctx, tx, key, fence)
	}
	if err := check(1); !errors.Is(err, pgcoord.ErrNotMigrated) {
		t.Fatalf("before Migrate: got %v, want ErrNotMigrated", err)
	}
	pool := pgtest.Pool(t, dsn)
	if err := pgcoord.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	c, err := pgcoord.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	var fences []pgcoord.Term
	for range 2 {
		l, err := c.Lock(ctx, key, pgcoord.WithFence())
		if err != nil {
			t.Fatal(err)
		}
		fences = append(fences, l.Fence())
		if err := l.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := check(fences[0]); !errors.Is(err, pgcoord.ErrStaleFence) {
		t.Fatalf("stale fence %d (newest %d): got %v, want ErrStaleFence", fences[0], fences[1], err)
	}
	if err := check(fences[1]); err != nil {
		t.Fatalf("newest fence %d: %v", fences[1], err)
	}
}

// TestCancelledWaitInSavepoint: inside a savepoint, a cancelled wait aborts
// only the subtransaction: when XactLock returns (with the context's error)
// the keys it took after the savepoint are already free and only keys taken
// before the savepoint may still be held; those go too, moments later, as
// lib/pq has closed the connection and the backend exits. After Rollback no
// connection is in use.
func TestCancelledWaitInSavepoint(t *testing.T) {
	ctx := t.Context()
	dsn, db := setup(t)
	holder, _ := begin(t, db)
	if err := pgcoordsql.XactLock(ctx, holder, pgcoord.Int64Key(3)); err != nil {
		t.Fatal(err)
	}
	tx, pid := begin(t, db)
	if err := pgcoordsql.XactLock(ctx, tx, pgcoord.Int64Key(1)); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.ExecContext(ctx, "SAVEPOINT s"); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	r := async(func() error { return pgcoordsql.XactLock(cctx, tx, pgcoord.Int64Key(3), pgcoord.Int64Key(2)) })
	waitLocks(t, dsn, pid, "int64:1 ExclusiveLock true", "int64:2 ExclusiveLock true", "int64:3 ExclusiveLock false")
	cancel()
	if err := get(t, r); !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want an error wrapping context.Canceled", err)
	}
	got := locks(t, dsn, pid)
	if !slices.Equal(got, nil) && !slices.Equal(got, []string{"int64:1 ExclusiveLock true"}) {
		t.Fatalf("locks when XactLock returned: %q, want at most int64:1 (taken before the savepoint)", got)
	}
	t.Logf("locks when XactLock returned: %q", got)
	waitLocks(t, dsn, pid)
	if _, err := tx.ExecContext(ctx, "SELECT 1"); err == nil {
		t.Fatal("the transaction still runs statements")
	}
	_ = tx.Rollback()
	if err := holder.Rollback(); err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, limit, "no connection in use", func() bool { return db.Stats().InUse == 0 })
}
