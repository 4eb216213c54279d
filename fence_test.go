package pgcoord

import (
	"context"
	"errors"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// migratedPool returns a pool on a fresh database migrated into schema.
func migratedPool(t *testing.T, ctx context.Context, schema string) (string, *pgxpool.Pool) {
	t.Helper()
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	if err := Migrate(ctx, pool, WithSchema(schema)); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	return dsn, pool
}

func mustFenceConfig(t *testing.T, opts ...Option) *core.Config {
	t.Helper()
	c, err := newConfig(opts)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func mustNextFence(t *testing.T, ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, c *core.Config, k Key) int64 {
	t.Helper()
	f, err := core.NextFence(ctx, q, c, k.coreKey())
	if err != nil {
		t.Fatalf("nextFence(%v): %v", k, err)
	}
	return f
}

// storedFences reads the whole fences table as "space/key=fence".
func storedFences(t *testing.T, ctx context.Context, pool *pgxpool.Pool, c *core.Config) []string {
	t.Helper()
	rows, err := pool.Query(ctx, "SELECT key_space || '/' || key || '=' || fence FROM "+c.Table("fences")+" ORDER BY key_space, key")
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestNextFenceIncreasingAndPerKey(t *testing.T) {
	ctx := testCtx(t)
	_, pool := migratedPool(t, ctx, DefaultSchema)
	c := mustFenceConfig(t)

	a, b := HashKey("fence", "a"), HashKey("fence", "b")
	for want := int64(1); want <= 5; want++ {
		if got := mustNextFence(t, ctx, pool, c, a); got != want {
			t.Fatalf("fence %d of key a = %d", want, got)
		}
	}
	if got := mustNextFence(t, ctx, pool, c, b); got != 1 {
		t.Fatalf("first fence of key b = %d, want 1", got)
	}
	// Same 64 bits, different key spaces: different rows.
	if got := mustNextFence(t, ctx, pool, c, Int64Key(1<<32|2)); got != 1 {
		t.Fatalf("first fence of Int64Key(1<<32|2) = %d, want 1", got)
	}
	if got := mustNextFence(t, ctx, pool, c, PairKey(1, 2)); got != 1 {
		t.Fatalf("first fence of PairKey(1, 2) = %d, want 1", got)
	}
	if got := mustNextFence(t, ctx, pool, c, PairKey(1, 2)); got != 2 {
		t.Fatalf("second fence of PairKey(1, 2) = %d, want 2", got)
	}
	av, _ := a.Int64()
	bv, _ := b.Int64()
	want := []string{
		"1/" + strconv.FormatInt(1<<32|2, 10) + "=1",
		"1/" + strconv.FormatInt(av, 10) + "=5",
		"1/" + strconv.FormatInt(bv, 10) + "=1",
		"2/" + strconv.FormatInt(1<<32|2, 10) + "=2",
	}
	got := storedFences(t, ctx, pool, c)
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("fences table = %q, want %q", got, want)
	}

	if _, err := core.NextFence(ctx, pool, c, Key{}.coreKey()); !errors.Is(err, ErrInvalidKey) {
		t.Fatalf("nextFence(zero Key) = %v, want ErrInvalidKey", err)
	}
}

// TestNextFenceRowsMatchPgLocks checks that a key's row in fences carries
// the key as pg_locks shows it: objsubid and (classid << 32) | objid.
func TestNextFenceRowsMatchPgLocks(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := migratedPool(t, ctx, DefaultSchema)
	c := mustFenceConfig(t)
	conn := pgtest.Conn(t, dsn)
	pid := conn.PgConn().PID()

	for _, k := range []Key{
		Int64Key(0), Int64Key(-1), Int64Key(math.MinInt64), Int64Key(math.MaxInt64), Int64Key(1<<32 | 2),
		PairKey(1, 2), PairKey(-1, -2), PairKey(math.MinInt32, 5), PairKey(0, math.MinInt32),
		HashKey("invoice", "42"),
	} {
		mustNextFence(t, ctx, pool, c, k)
		arg, args := k.coreKey().SqlArgs(1, nil)
		if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock("+arg+")", args...); err != nil {
			t.Fatal(err)
		}
		var held []pgtest.AdvisoryLock
		for _, l := range pgtest.AdvisoryLocks(t, dsn) {
			if uint32(l.PID) == pid {
				held = append(held, l)
			}
		}
		if len(held) != 1 {
			t.Fatalf("%v: %d advisory locks held by the test connection, want 1: %+v", k, len(held), held)
		}
		l := held[0]
		lockValue := int64(uint64(l.ClassID)<<32 | uint64(l.ObjID))
		var fence int64
		err := pool.QueryRow(ctx, "SELECT fence FROM "+c.Table("fences")+" WHERE key_space = $1 AND key = $2", l.ObjSubID, lockValue).Scan(&fence)
		if err != nil || fence != 1 {
			t.Fatalf("%v: fences row for pg_locks (objsubid %d, key %d): fence %d, err %v; want fence 1", k, l.ObjSubID, lockValue, fence, err)
		}
		if _, err := conn.Exec(ctx, "SELECT pg_advisory_unlock_all()"); err != nil {
			t.Fatal(err)
		}
	}
}

func TestNextFenceConcurrentUnique(t *testing.T) {
	ctx := testCtx(t)
	const workers, each = 8, 25
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn, func(c *pgxpool.Config) { c.MaxConns = workers })
	if err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	c := mustFenceConfig(t)
	k := PairKey(7, -7)

	var mu sync.Mutex
	var got []int64
	errs := make(chan error, workers)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for range each {
				f, err := core.NextFence(ctx, pool, c, k.coreKey())
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				got = append(got, f)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	slices.Sort(got)
	for i, f := range got {
		if f != int64(i+1) {
			t.Fatalf("fences issued concurrently are not exactly 1..%d: position %d holds %d", workers*each, i, f)
		}
	}
}

func TestNextFenceNotMigrated(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	c := mustFenceConfig(t)
	_, err := core.NextFence(ctx, pool, c, Int64Key(1).coreKey())
	if !errors.Is(err, ErrNotMigrated) || !strings.Contains(err.Error(), `"pgcoord"`) {
		t.Fatalf("nextFence before Migrate = %v, want ErrNotMigrated naming the schema", err)
	}
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		t.Fatalf("nextFence error %v does not keep the *pgconn.PgError", err)
	}

	// Migrated, but into another schema than the one asked for.
	if err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	other := mustFenceConfig(t, WithSchema("elsewhere"))
	if _, err := core.NextFence(ctx, pool, other, Int64Key(1).coreKey()); !errors.Is(err, ErrNotMigrated) || !strings.Contains(err.Error(), `"elsewhere"`) {
		t.Fatalf("nextFence in an unmigrated schema = %v, want ErrNotMigrated naming it", err)
	}
	// The schema exists, the table does not.
	if _, err := pool.Exec(ctx, "CREATE SCHEMA elsewhere"); err != nil {
		t.Fatal(err)
	}
	if _, err := core.NextFence(ctx, pool, other, Int64Key(1).coreKey()); !errors.Is(err, ErrNotMigrated) {
		t.Fatalf("nextFence in a schema without fences = %v, want ErrNotMigrated", err)
	}
}

// checkInTx runs CheckFence in a new transaction and rolls it back.
func checkInTx(t *testing.T, ctx context.Context, pool *pgxpool.Pool, k Key, fence Term, opts ...FenceOption) error {
	t.Helper()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	return CheckFence(ctx, tx, k, fence, opts...)
}

func TestCheckFence(t *testing.T) {
	ctx := testCtx(t)
	_, pool := migratedPool(t, ctx, DefaultSchema)
	c := mustFenceConfig(t)
	k := HashKey("account", "17")

	if err := checkInTx(t, ctx, pool, k, 1); !errors.Is(err, ErrStaleFence) || !strings.Contains(err.Error(), "never issued") {
		t.Fatalf("CheckFence before any fence = %v, want ErrStaleFence (never issued)", err)
	}
	f1 := mustNextFence(t, ctx, pool, c, k)
	if err := checkInTx(t, ctx, pool, k, Term(f1)); err != nil {
		t.Fatalf("CheckFence(current fence %d) = %v, want nil", f1, err)
	}
	f2 := mustNextFence(t, ctx, pool, c, k)
	err := checkInTx(t, ctx, pool, k, Term(f1))
	if !errors.Is(err, ErrStaleFence) || !strings.Contains(err.Error(), strconv.FormatInt(f1, 10)) || !strings.Contains(err.Error(), strconv.FormatInt(f2, 10)) {
		t.Fatalf("CheckFence(old fence %d) after fence %d = %v, want ErrStaleFence naming both", f1, f2, err)
	}
	if err := checkInTx(t, ctx, pool, k, Term(f2)); err != nil {
		t.Fatalf("CheckFence(current fence %d) = %v, want nil", f2, err)
	}
	if err := checkInTx(t, ctx, pool, k, Term(f2+1)); !errors.Is(err, ErrStaleFence) || !strings.Contains(err.Error(), "never issued") {
		t.Fatalf("CheckFence(future fence %d) = %v, want ErrStaleFence (never issued)", f2+1, err)
	}
	// The same bits in the other key space have no fence.
	v, _ := k.Int64()
	if err := checkInTx(t, ctx, pool, PairKey(int32(uint64(v)>>32), int32(v)), Term(f2)); !errors.Is(err, ErrStaleFence) {
		t.Fatalf("CheckFence on the pair key with the same bits = %v, want ErrStaleFence", err)
	}

	for _, bad := range []int64{0, -1, math.MinInt64} {
		err := checkInTx(t, ctx, pool, k, Term(bad))
		if err == nil || errors.Is(err, ErrStaleFence) || !strings.HasPrefix(err.Error(), "pgcoord: ") {
			t.Fatalf("CheckFence(fence %d) = %v, want a clear non-stale error", bad, err)
		}
	}
	if err := checkInTx(t, ctx, pool, Key{}, Term(f2)); !errors.Is(err, ErrInvalidKey) {
		t.Fatalf("CheckFence(zero Key) = %v, want ErrInvalidKey", err)
	}
	if err := CheckFence(ctx, nil, k, Term(f2)); err == nil {
		t.Fatal("CheckFence(nil tx) = nil")
	}
	var nilTx *pgxpool.Tx
	if err := xactNoPanic(t, "CheckFence(nil *pgxpool.Tx)", func() error { return CheckFence(ctx, nilTx, k, Term(f2)) }); err == nil || !strings.HasPrefix(err.Error(), "pgcoord: ") {
		t.Fatalf("CheckFence(nil *pgxpool.Tx) = %v, want a pgcoord error", err)
	}
	client := newTestClientOn(t, pool)
	if err := xactNoPanic(t, "Client.CheckFence(nil *pgxpool.Tx)", func() error { return client.CheckFence(ctx, nilTx, k, Term(f2)) }); err == nil || !strings.HasPrefix(err.Error(), "pgcoord: ") {
		t.Fatalf("Client.CheckFence(nil *pgxpool.Tx) = %v, want a pgcoord error", err)
	}
	if err := checkInTx(t, ctx, pool, k, Term(f2), WithSchema("missing")); !errors.Is(err, ErrNotMigrated) {
		t.Fatalf("CheckFence in an unmigrated schema = %v, want ErrNotMigrated", err)
	}
}

// fenceSQLState returns the SQLSTATE of the *pgconn.PgError in err's chain,
// or "".
func fenceSQLState(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// TestCheckFenceFirstFenceAfterSnapshot: under REPEATABLE READ and
// SERIALIZABLE, a key's first fence issued after the transaction's snapshot
// was taken is invisible to it; CheckFence of that current fence reports a
// serialization failure (a *pgconn.PgError with Code 40001, also through a
// SQLState method), not ErrStaleFence, and a retry in a new transaction
// succeeds. A later fence issued after the snapshot over a visible one gets
// the server's own 40001. Under READ COMMITTED the current first fence
// passes at once.
func TestCheckFenceFirstFenceAfterSnapshot(t *testing.T) {
	ctx := testCtx(t)
	_, pool := migratedPool(t, ctx, DefaultSchema)
	c := mustFenceConfig(t)
	for i, level := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable, pgx.ReadCommitted} {
		t.Run(string(level), func(t *testing.T) {
			k := Int64Key(int64(1000 + i))
			begin := func() pgx.Tx {
				t.Helper()
				tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: level})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
				// The snapshot (under REPEATABLE READ and SERIALIZABLE) is
				// taken here, before any fence of k exists.
				var n int
				if err := tx.QueryRow(ctx, "SELECT count(*) FROM "+c.Table("fences")).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return tx
			}
			tx := begin()
			f1 := Term(mustNextFence(t, ctx, pool, c, k))
			if f1 != 1 {
				t.Fatalf("first fence = %d, want 1", f1)
			}
			err := CheckFence(ctx, tx, k, f1)
			if level == pgx.ReadCommitted {
				if err != nil {
					t.Fatalf("CheckFence(first fence %d) under READ COMMITTED = %v, want nil", f1, err)
				}
				return
			}
			var se interface{ SQLState() string }
			switch {
			case errors.Is(err, ErrStaleFence):
				t.Fatalf("CheckFence(current first fence %d, issued after the snapshot) = %v, want no ErrStaleFence", f1, err)
			case fenceSQLState(err) != "40001" || !errors.As(err, &se) || se.SQLState() != "40001":
				t.Fatalf("CheckFence(current first fence %d, issued after the snapshot) = %v, want SQLSTATE 40001", f1, err)
			case !strings.HasPrefix(err.Error(), "pgcoord: ") || !strings.Contains(err.Error(), "issued after the snapshot"):
				t.Fatalf("CheckFence: %q does not say the fence may have been issued after the snapshot", err)
			}
			t.Logf("CheckFence: %v", err)
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}

			// The retry, in a new transaction, sees the fence.
			tx = begin()
			if err := CheckFence(ctx, tx, k, f1); err != nil {
				t.Fatalf("retried CheckFence(first fence %d) = %v, want nil", f1, err)
			}
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}

			// A newer fence issued after the snapshot, over a visible one:
			// the server reports 40001 for the newest, and a stale fence
			// seen in a fresh transaction is ErrStaleFence.
			tx = begin()
			f2 := Term(mustNextFence(t, ctx, pool, c, k))
			if err := CheckFence(ctx, tx, k, f2); errors.Is(err, ErrStaleFence) || fenceSQLState(err) != "40001" {
				t.Fatalf("CheckFence(fence %d issued after the snapshot over fence %d) = %v, want SQLSTATE 40001", f2, f1, err)
			}
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			tx = begin()
			if err := CheckFence(ctx, tx, k, f1); !errors.Is(err, ErrStaleFence) {
				t.Fatalf("CheckFence(stale fence %d, newest %d) = %v, want ErrStaleFence", f1, f2, err)
			}
		})
	}
}

// TestCheckFenceHoldsOffNewerFence checks that while a transaction holds a
// successful CheckFence, issuing a newer fence waits on the row lock, and
// goes through only when the transaction ends (commit or rollback).
func TestCheckFenceHoldsOffNewerFence(t *testing.T) {
	for _, end := range []string{"commit", "rollback"} {
		t.Run(end, func(t *testing.T) {
			ctx := testCtx(t)
			dsn, pool := migratedPool(t, ctx, DefaultSchema)
			c := mustFenceConfig(t)
			k := Int64Key(-42)
			f1 := mustNextFence(t, ctx, pool, c, k)
			if _, err := pool.Exec(ctx, "CREATE TABLE public.ledger (fence bigint)"); err != nil {
				t.Fatal(err)
			}

			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
			if err := CheckFence(ctx, tx, k, Term(f1)); err != nil {
				t.Fatalf("CheckFence: %v", err)
			}
			if _, err := tx.Exec(ctx, "INSERT INTO public.ledger VALUES ($1)", f1); err != nil {
				t.Fatal(err)
			}
			holder := tx.Conn().PgConn().PID()

			issuer := pgtest.Conn(t, dsn)
			issuerPID := issuer.PgConn().PID()
			type issued struct {
				fence int64
				err   error
			}
			done := make(chan issued, 1)
			go func() {
				f, err := core.NextFence(ctx, issuer, c, k.coreKey())
				done <- issued{f, err}
			}()

			pgtest.Eventually(t, 10*time.Second, "nextFence never waited on the CheckFence transaction", func() bool {
				var waiting bool
				err := pool.QueryRow(ctx, `SELECT wait_event_type IS NOT DISTINCT FROM 'Lock' AND $2::int = ANY (pg_blocking_pids(pid))
					FROM pg_stat_activity WHERE pid = $1`, issuerPID, holder).Scan(&waiting)
				return err == nil && waiting
			})
			select {
			case r := <-done:
				t.Fatalf("nextFence returned (%d, %v) while the CheckFence transaction was open", r.fence, r.err)
			default:
			}

			if end == "commit" {
				err = tx.Commit(ctx)
			} else {
				err = tx.Rollback(ctx)
			}
			if err != nil {
				t.Fatal(err)
			}
			var r issued
			select {
			case r = <-done:
			case <-ctx.Done():
				t.Fatal("nextFence did not finish after the CheckFence transaction ended")
			}
			if r.err != nil || r.fence != f1+1 {
				t.Fatalf("nextFence after the transaction ended = (%d, %v), want %d", r.fence, r.err, f1+1)
			}
			var rows int
			if err := pool.QueryRow(ctx, "SELECT count(*) FROM public.ledger").Scan(&rows); err != nil {
				t.Fatal(err)
			}
			if want := map[string]int{"commit": 1, "rollback": 0}[end]; rows != want {
				t.Fatalf("ledger has %d rows after %s, want %d", rows, end, want)
			}
			if err := checkInTx(t, ctx, pool, k, Term(f1)); !errors.Is(err, ErrStaleFence) {
				t.Fatalf("CheckFence(%d) after fence %d was issued = %v, want ErrStaleFence", f1, r.fence, err)
			}
		})
	}
}

func TestFenceHostileSchemaNames(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	for i, name := range []string{`odd "name"; drop`, `f"; DELETE FROM fences; --`, strings.Repeat(`'`, 60)} {
		if err := Migrate(ctx, pool, WithSchema(name)); err != nil {
			t.Fatalf("Migrate(WithSchema(%q)): %v", name, err)
		}
		c := mustFenceConfig(t, WithSchema(name))
		k := Int64Key(int64(i))
		mustNextFence(t, ctx, pool, c, k)
		f := mustNextFence(t, ctx, pool, c, k)
		if f != 2 {
			t.Fatalf("schema %q: second fence = %d, want 2", name, f)
		}
		if err := checkInTx(t, ctx, pool, k, Term(f), WithSchema(name)); err != nil {
			t.Fatalf("schema %q: CheckFence: %v", name, err)
		}
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_class c JOIN pg_namespace s ON s.oid = c.relnamespace
			WHERE s.nspname = $1 AND c.relname = 'fences'`, name).Scan(&n); err != nil || n != 1 {
			t.Fatalf("schema %q: %d fences tables (err %v), want 1", name, n, err)
		}
	}
	// Each schema kept its own rows: nothing was deleted by a name.
	var total int64
	if err := pool.QueryRow(ctx, `SELECT sum(fence) FROM (
		SELECT fence FROM `+pgx.Identifier{`odd "name"; drop`, "fences"}.Sanitize()+`
		UNION ALL SELECT fence FROM `+pgx.Identifier{`f"; DELETE FROM fences; --`, "fences"}.Sanitize()+`
		UNION ALL SELECT fence FROM `+pgx.Identifier{strings.Repeat(`'`, 60), "fences"}.Sanitize()+`) f`).Scan(&total); err != nil {
		t.Fatal(err)
	}
	if total != 6 {
		t.Fatalf("sum of fences over the three schemas = %d, want 6", total)
	}
	if err := checkInTx(t, ctx, pool, Int64Key(1), 1, WithSchema("nul\x00")); err == nil || !strings.Contains(err.Error(), "NUL") {
		t.Fatalf("CheckFence(WithSchema with NUL) = %v, want a clear error", err)
	}
}
