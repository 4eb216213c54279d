package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// fenceIsoLevels are the isolation levels CheckFence is checked under.
var fenceIsoLevels = []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable}

// fenceBeginSnapshot begins a transaction at level on pool and takes its
// snapshot (under REPEATABLE READ and SERIALIZABLE) with a read of the
// fences table; it is rolled back in cleanup if still open.
func fenceBeginSnapshot(t *testing.T, ctx context.Context, pool *pgxpool.Pool, c *core.Config, opts pgx.TxOptions) pgx.Tx {
	t.Helper()
	tx, err := pool.BeginTx(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	var n int
	if err := tx.QueryRow(ctx, "SELECT count(*) FROM "+c.Table("fences")).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return tx
}

// TestCheckFenceStaleAfterSnapshotNeverPasses: a transaction whose
// snapshot shows fence f1 as the newest, while f2 has been issued since,
// never gets nil from CheckFence(f1): under READ COMMITTED the check sees
// f2 and reports ErrStaleFence naming it, under REPEATABLE READ and
// SERIALIZABLE (whose snapshot still shows f1) the server reports a
// serialization failure, SQLSTATE 40001. The current fence f2 passes under
// READ COMMITTED only.
func TestCheckFenceStaleAfterSnapshotNeverPasses(t *testing.T) {
	ctx := testCtx(t)
	_, pool := migratedPool(t, ctx, DefaultSchema)
	c := mustFenceConfig(t)
	for i, level := range fenceIsoLevels {
		t.Run(string(level), func(t *testing.T) {
			k := Int64Key(int64(2000 + i))
			f1 := Term(mustNextFence(t, ctx, pool, c, k))
			for _, check := range []string{"stale", "current"} {
				tx := fenceBeginSnapshot(t, ctx, pool, c, pgx.TxOptions{IsoLevel: level})
				f2 := Term(mustNextFence(t, ctx, pool, c, k))
				fence := f1
				if check == "current" {
					fence = f2
				}
				err := CheckFence(ctx, tx, k, fence)
				switch {
				case check == "current" && level == pgx.ReadCommitted:
					if err != nil {
						t.Fatalf("CheckFence(current fence %d) = %v, want nil", fence, err)
					}
				case level == pgx.ReadCommitted:
					if !errors.Is(err, ErrStaleFence) {
						t.Fatalf("CheckFence(stale fence %d, newest %d) = %v, want ErrStaleFence", fence, f2, err)
					}
				default:
					if errors.Is(err, ErrStaleFence) || fenceSQLState(err) != "40001" {
						t.Fatalf("CheckFence(%s fence %d, %d issued after the snapshot) = %v, want SQLSTATE 40001", check, fence, f2, err)
					}
				}
				if err := tx.Rollback(ctx); err != nil {
					t.Fatal(err)
				}
				f1 = f2
			}
		})
	}
}

// TestCheckFenceWaitsForFenceBeingIssued: CheckFence of the current fence
// f1 while another transaction is issuing f2 (its upsert has run, its
// commit has not) waits for that transaction, under every isolation level.
// If the issuer commits, CheckFence does not pass: ErrStaleFence under READ
// COMMITTED, SQLSTATE 40001 under REPEATABLE READ and SERIALIZABLE. If the
// issuer rolls back, f1 is still the newest and CheckFence passes, and its
// row lock then holds off the next issuer until the checking transaction
// ends.
func TestCheckFenceWaitsForFenceBeingIssued(t *testing.T) {
	ctx := testCtx(t)
	_, pool := migratedPool(t, ctx, DefaultSchema)
	c := mustFenceConfig(t)
	n := 0
	for _, level := range fenceIsoLevels {
		for _, end := range []string{"commit", "rollback"} {
			n++
			k := Int64Key(int64(3000 + n))
			t.Run(string(level)+"/"+end, func(t *testing.T) {
				f1 := Term(mustNextFence(t, ctx, pool, c, k))
				tx := fenceBeginSnapshot(t, ctx, pool, c, pgx.TxOptions{IsoLevel: level})
				pid := tx.Conn().PgConn().PID()
				issuer, err := pool.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = issuer.Rollback(context.Background()) }()
				issuerPID := issuer.Conn().PgConn().PID()
				f2 := Term(mustNextFence(t, ctx, issuer, c, k))
				done := make(chan error, 1)
				go func() { done <- CheckFence(ctx, tx, k, f1) }()
				waitBlockedBy(t, ctx, pool, pid, issuerPID)
				select {
				case err := <-done:
					t.Fatalf("CheckFence returned %v while fence %d was being issued", err, f2)
				default:
				}
				if end == "commit" {
					err = issuer.Commit(ctx)
				} else {
					err = issuer.Rollback(ctx)
				}
				if err != nil {
					t.Fatal(err)
				}
				err = xactRecv(t, done, "CheckFence")
				switch {
				case end == "rollback":
					if err != nil {
						t.Fatalf("CheckFence(%d) after the issuer of %d rolled back = %v, want nil", f1, f2, err)
					}
					// The check's row lock holds off the next fence.
					other, err := pool.Acquire(ctx)
					if err != nil {
						t.Fatal(err)
					}
					defer other.Release()
					issued := make(chan error, 1)
					go func() { _, err := core.NextFence(ctx, other, c, k.coreKey()); issued <- err }()
					waitBlockedBy(t, ctx, pool, other.Conn().PgConn().PID(), pid)
					if err := tx.Commit(ctx); err != nil {
						t.Fatal(err)
					}
					if err := xactRecv(t, issued, "nextFence"); err != nil {
						t.Fatalf("nextFence after the check's commit: %v", err)
					}
				case level == pgx.ReadCommitted:
					if !errors.Is(err, ErrStaleFence) {
						t.Fatalf("CheckFence(%d) after fence %d committed = %v, want ErrStaleFence", f1, f2, err)
					}
				default:
					if errors.Is(err, ErrStaleFence) || fenceSQLState(err) != "40001" {
						t.Fatalf("CheckFence(%d) after fence %d committed = %v, want SQLSTATE 40001", f1, f2, err)
					}
				}
			})
		}
	}
}

// waitBlockedBy waits (bounded) until backend pid waits on a lock that
// backend blocker holds, as pg_stat_activity and pg_blocking_pids show it.
func waitBlockedBy(t *testing.T, ctx context.Context, pool *pgxpool.Pool, pid, blocker uint32) {
	t.Helper()
	pgtest.Eventually(t, xactWait, fmt.Sprintf("backend %d to wait on backend %d", pid, blocker), func() bool {
		var ok bool
		err := pool.QueryRow(ctx, `SELECT coalesce(wait_event_type = 'Lock' AND $2::int = ANY (pg_blocking_pids(pid)), false)
			FROM pg_stat_activity WHERE pid = $1`, pid, blocker).Scan(&ok)
		return err == nil && ok
	})
}

// TestCheckFenceReadOnlyTransaction: CheckFence in a READ ONLY transaction
// never passes, whatever the isolation level, since its SELECT ... FOR
// SHARE is refused there (SQLSTATE 25006): the error is the server's,
// wrapped, not ErrStaleFence, even for the current fence.
func TestCheckFenceReadOnlyTransaction(t *testing.T) {
	ctx := testCtx(t)
	_, pool := migratedPool(t, ctx, DefaultSchema)
	c := mustFenceConfig(t)
	k := Int64Key(4000)
	f1 := Term(mustNextFence(t, ctx, pool, c, k))
	for _, level := range fenceIsoLevels {
		t.Run(string(level), func(t *testing.T) {
			tx := fenceBeginSnapshot(t, ctx, pool, c, pgx.TxOptions{IsoLevel: level, AccessMode: pgx.ReadOnly})
			err := CheckFence(ctx, tx, k, f1)
			if err == nil || errors.Is(err, ErrStaleFence) || fenceSQLState(err) != "25006" {
				t.Fatalf("CheckFence(current fence %d) in a READ ONLY transaction = %v, want SQLSTATE 25006", f1, err)
			}
			t.Logf("CheckFence: %v", err)
		})
	}
}

// TestCheckFenceWrongSchema: a fence issued in one migrated schema and
// checked in another (also migrated) never passes there: under READ
// COMMITTED the error wraps ErrStaleFence and says the fence was never
// issued in that schema; under REPEATABLE READ and SERIALIZABLE, where a
// missing fence cannot be told from one issued after the snapshot, it is
// SQLSTATE 40001 naming that schema, not ErrStaleFence. In the right
// schema it passes under every level.
func TestCheckFenceWrongSchema(t *testing.T) {
	ctx := testCtx(t)
	_, pool := migratedPool(t, ctx, "fences_a")
	if err := Migrate(ctx, pool, WithSchema("fences_b")); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	ca, cb := mustFenceConfig(t, WithSchema("fences_a")), mustFenceConfig(t, WithSchema("fences_b"))
	k := Int64Key(6000)
	f := Term(mustNextFence(t, ctx, pool, ca, k))
	// Another key has a fence in schema b, so b's table is not empty.
	mustNextFence(t, ctx, pool, cb, Int64Key(6001))
	for _, level := range fenceIsoLevels {
		t.Run(string(level), func(t *testing.T) {
			tx := fenceBeginSnapshot(t, ctx, pool, cb, pgx.TxOptions{IsoLevel: level})
			err := CheckFence(ctx, tx, k, f, WithSchema("fences_b"))
			switch {
			case err == nil:
				t.Fatalf("CheckFence(fence %d of schema fences_a) in schema fences_b = nil", f)
			case !strings.Contains(err.Error(), "fences_b"):
				t.Fatalf("CheckFence in the wrong schema: %q does not name the schema", err)
			case level == pgx.ReadCommitted:
				if !errors.Is(err, ErrStaleFence) || !strings.Contains(err.Error(), "never issued") {
					t.Fatalf("CheckFence in the wrong schema = %v, want ErrStaleFence (never issued)", err)
				}
			default:
				if errors.Is(err, ErrStaleFence) || fenceSQLState(err) != "40001" {
					t.Fatalf("CheckFence in the wrong schema = %v, want SQLSTATE 40001", err)
				}
			}
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			tx = fenceBeginSnapshot(t, ctx, pool, ca, pgx.TxOptions{IsoLevel: level})
			if err := CheckFence(ctx, tx, k, f, WithSchema("fences_a")); err != nil {
				t.Fatalf("CheckFence(fence %d) in its own schema = %v, want nil", f, err)
			}
		})
	}
}

// TestCheckFenceCancelledWaitWrapsCtxError: CheckFence waits for a fence
// being issued (the issuer's transaction holds the row), and ctx is
// cancelled during that wait. Under pgx's default handler the error wraps
// context.Canceled; under pgconn.CancelRequestContextWatcherHandler the
// server's 57014 comes back, and the context's error is not in the chain,
// unlike XactLock's (xactError appends it).
func TestCheckFenceCancelledWaitWrapsCtxError(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := migratedPool(t, ctx, DefaultSchema)
	c := mustFenceConfig(t)
	for i, h := range xactCancelHandlers {
		t.Run(h.name, func(t *testing.T) {
			k := Int64Key(int64(5000 + i))
			f1 := Term(mustNextFence(t, ctx, pool, c, k))
			issuer, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = issuer.Rollback(context.Background()) }()
			mustNextFence(t, ctx, issuer, c, k)
			conn := xactCancelConn(t, dsn, h.configure)
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(context.Background()) }()
			cctx, cancel := context.WithCancel(ctx)
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- CheckFence(cctx, tx, k, f1) }()
			waitBlockedBy(t, ctx, pool, conn.PgConn().PID(), issuer.Conn().PgConn().PID())
			cancel()
			err = xactRecv(t, done, "CheckFence")
			t.Logf("CheckFence: %v", err)
			if !errors.Is(err, context.Canceled) {
				t.Errorf("CheckFence cancelled in its wait: got %v, want an error wrapping context.Canceled", err)
			}
		})
	}
}
