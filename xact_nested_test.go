package pgcoord

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// xactNestedOuter begins a transaction on pool that holds outerKey and has
// inserted the row "outer" into t, which it creates (or empties) first.
func xactNestedOuter(t *testing.T, dsn string, pool *pgxpool.Pool, outerKey Key) (pgx.Tx, int32) {
	t.Helper()
	ctx := t.Context()
	if _, err := pool.Exec(ctx, "CREATE TABLE IF NOT EXISTS t (v text)"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "TRUNCATE t"); err != nil {
		t.Fatal(err)
	}
	outer := xactBegin(t, pool)
	pid := xactPID(outer)
	if err := XactLock(ctx, outer, outerKey); err != nil {
		t.Fatal(err)
	}
	if _, err := outer.Exec(ctx, "INSERT INTO t VALUES ('outer')"); err != nil {
		t.Fatal(err)
	}
	xactWantHeld(t, dsn, pid, xactEx(outerKey))
	return outer, pid
}

// xactNestedCommitted commits outer and checks that pg_locks shows nothing
// left for pid and that t holds exactly rows.
func xactNestedCommitted(t *testing.T, dsn string, pool *pgxpool.Pool, outer pgx.Tx, pid int32, rows ...string) {
	t.Helper()
	ctx := t.Context()
	if _, err := outer.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatalf("the outer transaction after InTx: %v", err)
	}
	if err := outer.Commit(ctx); err != nil {
		t.Fatalf("outer commit: %v", err)
	}
	xactWantHeld(t, dsn, pid)
	r, err := pool.Query(ctx, "SELECT v FROM t ORDER BY v")
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(r, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, rows) {
		t.Fatalf("committed rows: got %q, want %q", got, rows)
	}
}

// xactNestedKeyFree checks that another transaction can take k at once.
func xactNestedKeyFree(t *testing.T, pool *pgxpool.Pool, k Key) {
	t.Helper()
	ctx := t.Context()
	other := xactBegin(t, pool)
	if err := XactTryLock(ctx, other, k); err != nil {
		t.Fatalf("key %v is not free: %v", k, err)
	}
	if err := other.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestInTxNestedFnErrorOrPanic: InTx nested in a pgx.Tx whose fn returns
// an error, or panics, after a write under its key: the savepoint is
// rolled back before InTx returns (or the panic goes on), so pg_locks shows
// only the outer transaction's key, another transaction takes the inner
// key at once, and the outer transaction goes on and commits its own row
// and none of fn's. fn's error comes back unchanged; the panic value is the
// one fn raised.
func TestInTxNestedFnErrorOrPanic(t *testing.T) {
	dsn, pool := xactPool(t)
	ctx := t.Context()
	outerKey, innerKey := Int64Key(1), Int64Key(2)
	errFn := errors.New("fn failed")
	for _, c := range []struct {
		name  string
		panic bool
	}{{"error", false}, {"panic", true}} {
		t.Run(c.name, func(t *testing.T) {
			outer, pid := xactNestedOuter(t, dsn, pool, outerKey)
			var err error
			var recovered any
			func() {
				defer func() { recovered = recover() }()
				err = InTx(ctx, outer, []Key{innerKey}, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, "INSERT INTO t VALUES ('fn')"); err != nil {
						return err
					}
					xactWantHeld(t, dsn, pid, xactEx(outerKey), xactEx(innerKey))
					if c.panic {
						panic(errFn)
					}
					return errFn
				})
			}()
			if c.panic {
				if recovered != errFn {
					t.Fatalf("recovered %v, want fn's panic value %v", recovered, errFn)
				}
			} else if err != errFn {
				t.Fatalf("InTx: got %v, want fn's error unchanged", err)
			}
			xactWantHeld(t, dsn, pid, xactEx(outerKey))
			xactNestedKeyFree(t, pool, innerKey)
			xactNestedCommitted(t, dsn, pool, outer, pid, "outer")
		})
	}
}

// TestInTxNestedInNested: InTx inside the fn of an InTx nested in a
// pgx.Tx (a savepoint in a savepoint). When the innermost fn fails, only
// the innermost key and row go: the middle fn still holds its key, goes on
// and returns nil, and the outer transaction then holds its key and the
// middle one until it commits its row and the middle fn's. When every level
// succeeds, all three keys stay held until the outer commit.
func TestInTxNestedInNested(t *testing.T) {
	dsn, pool := xactPool(t)
	ctx := t.Context()
	outerKey, midKey, innerKey := Int64Key(1), Int64Key(2), Int64Key(3)
	errInner := errors.New("inner failed")
	for _, fail := range []bool{true, false} {
		name := "inner succeeds"
		if fail {
			name = "inner fails"
		}
		t.Run(name, func(t *testing.T) {
			outer, pid := xactNestedOuter(t, dsn, pool, outerKey)
			err := InTx(ctx, outer, []Key{midKey}, func(mid pgx.Tx) error {
				if _, err := mid.Exec(ctx, "INSERT INTO t VALUES ('mid')"); err != nil {
					return err
				}
				err := InTx(ctx, mid, []Key{innerKey}, func(inner pgx.Tx) error {
					if _, err := inner.Exec(ctx, "INSERT INTO t VALUES ('inner')"); err != nil {
						return err
					}
					xactWantHeld(t, dsn, pid, xactEx(outerKey), xactEx(midKey), xactEx(innerKey))
					if fail {
						return errInner
					}
					return nil
				})
				if fail {
					if err != errInner {
						t.Errorf("inner InTx: got %v, want %v", err, errInner)
					}
					xactWantHeld(t, dsn, pid, xactEx(outerKey), xactEx(midKey))
					xactNestedKeyFree(t, pool, innerKey)
				} else if err != nil {
					t.Errorf("inner InTx: %v", err)
				}
				// The middle savepoint goes on after the inner one.
				_, err = mid.Exec(ctx, "INSERT INTO t VALUES ('mid2')")
				return err
			})
			if err != nil {
				t.Fatalf("middle InTx: %v", err)
			}
			if fail {
				xactWantHeld(t, dsn, pid, xactEx(outerKey), xactEx(midKey))
				xactNestedKeyFree(t, pool, innerKey)
				xactNestedCommitted(t, dsn, pool, outer, pid, "mid", "mid2", "outer")
				return
			}
			xactWantHeld(t, dsn, pid, xactEx(outerKey), xactEx(midKey), xactEx(innerKey))
			xactNestedCommitted(t, dsn, pool, outer, pid, "inner", "mid", "mid2", "outer")
		})
	}
}

// TestInTxNestedOuterAlreadyFailed: InTx given a pgx.Tx in the failed
// state (a statement error was ignored, SQLSTATE 25P02 from then on) does
// not call fn: SAVEPOINT itself fails, and InTx returns an error wrapping
// the server's 25P02. The failed outer transaction's keys were already
// released by the error, and InTx takes none.
func TestInTxNestedOuterAlreadyFailed(t *testing.T) {
	dsn, pool := xactPool(t)
	ctx := t.Context()
	outerKey, innerKey := Int64Key(1), Int64Key(2)
	outer, pid := xactNestedOuter(t, dsn, pool, outerKey)
	if _, err := outer.Exec(ctx, "SELECT 1/0"); err == nil {
		t.Fatal("SELECT 1/0 succeeded")
	}
	xactWantHeld(t, dsn, pid)
	called := false
	err := InTx(ctx, outer, []Key{innerKey}, func(pgx.Tx) error {
		called = true
		return nil
	})
	if called {
		t.Fatal("fn was called in a failed transaction")
	}
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "25P02" || !strings.HasPrefix(err.Error(), "pgcoord: in tx "+innerKey.String()+": begin: ") {
		t.Fatalf("InTx on a failed transaction: got %v, want a begin error wrapping SQLSTATE 25P02", err)
	}
	xactWantHeld(t, dsn, pid)
	if err := outer.Rollback(ctx); err != nil {
		t.Fatalf("rollback of the failed outer transaction: %v", err)
	}
}

// TestInTxNestedCtxDoneBeforeSavepoint: a ctx that is already done when
// InTx is called on a pgx.Tx sends nothing: no savepoint, fn is not
// called, the error wraps ctx's, and the outer transaction keeps its key
// and its row, goes on and commits.
func TestInTxNestedCtxDoneBeforeSavepoint(t *testing.T) {
	dsn, pool := xactPool(t)
	outerKey, innerKey := Int64Key(1), Int64Key(2)
	outer, pid := xactNestedOuter(t, dsn, pool, outerKey)
	cctx, cancel := context.WithCancel(t.Context())
	cancel()
	called := false
	err := InTx(cctx, outer, []Key{innerKey}, func(pgx.Tx) error {
		called = true
		return nil
	})
	if called {
		t.Fatal("fn was called with a done ctx")
	}
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("InTx with a done ctx: got %v, want an error wrapping context.Canceled", err)
	}
	xactWantHeld(t, dsn, pid, xactEx(outerKey))
	xactNestedCommitted(t, dsn, pool, outer, pid, "outer")
}

// TestInTxNestedLockWaitCancelled: InTx nested in a pgx.Tx on a connection
// with pgconn.CancelRequestContextWatcherHandler, waiting for a key that
// another transaction holds: when ctx ends, the cancelled lock statement
// aborts only the savepoint, InTx rolls back to it and returns an error
// wrapping ctx's (and SQLSTATE 57014) without calling fn, and the outer
// transaction, which still holds its own key, goes on and commits its row.
func TestInTxNestedLockWaitCancelled(t *testing.T) {
	ctx := t.Context()
	dsn, pool := xactPool(t)
	conn := xactCancelConn(t, dsn, xactCancelHandlers[1].configure)
	outerKey, innerKey := Int64Key(1), Int64Key(2)
	if _, err := pool.Exec(ctx, "CREATE TABLE t (v text)"); err != nil {
		t.Fatal(err)
	}
	holder := xactBegin(t, pool)
	if err := XactLock(ctx, holder, innerKey); err != nil {
		t.Fatal(err)
	}
	outer, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = outer.Rollback(context.Background()) }()
	pid := xactPID(outer)
	if err := XactLock(ctx, outer, outerKey); err != nil {
		t.Fatal(err)
	}
	if _, err := outer.Exec(ctx, "INSERT INTO t VALUES ('outer')"); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	called := make(chan struct{}, 1)
	done := make(chan error, 1)
	go func() {
		done <- InTx(cctx, outer, []Key{innerKey}, func(pgx.Tx) error {
			called <- struct{}{}
			return nil
		})
	}()
	xactEventuallyHeld(t, dsn, pid, xactEx(outerKey), xactWaitingEx(innerKey))
	cancel()
	err = xactRecv(t, done, "InTx")
	var pe *pgconn.PgError
	if !errors.Is(err, context.Canceled) || !errors.As(err, &pe) || pe.Code != "57014" {
		t.Fatalf("cancelled nested InTx: got %v, want SQLSTATE 57014 wrapping context.Canceled", err)
	}
	select {
	case <-called:
		t.Fatal("fn was called after the lock wait was cancelled")
	default:
	}
	xactWantHeld(t, dsn, pid, xactEx(outerKey))
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	xactNestedKeyFree(t, pool, innerKey)
	if _, err := outer.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatalf("the outer transaction after InTx: %v", err)
	}
	if err := outer.Commit(ctx); err != nil {
		t.Fatalf("outer commit: %v", err)
	}
	xactWantHeld(t, dsn, pid)
	var rows []string
	r, err := pool.Query(ctx, "SELECT v FROM t ORDER BY v")
	if err != nil {
		t.Fatal(err)
	}
	if rows, err = pgx.CollectRows(r, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(rows, []string{"outer"}) {
		t.Fatalf("committed rows: got %q, want [outer]", rows)
	}
}

// InTx nested in a
// pgx.Tx on a connection with pgx's default context handler, waiting for a
// key another transaction holds, has its ctx cancelled. pgx closes the
// connection, so the ROLLBACK TO SAVEPOINT that InTx sends fails, and the
// outer transaction is over. InTx's doc promises that "only if the
// rollback itself fails (a broken connection), which the error then says,
// must the outer transaction be rolled back"; the error is the lock's
// alone and does not say so.
func TestInTxNestedFailedRollbackSaysSo(t *testing.T) {
	ctx := t.Context()
	dsn, pool := xactPool(t)
	conn := xactCancelConn(t, dsn, xactCancelHandlers[0].configure)
	outerKey, innerKey := Int64Key(1), Int64Key(2)
	holder := xactBegin(t, pool)
	if err := XactLock(ctx, holder, innerKey); err != nil {
		t.Fatal(err)
	}
	outer, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = outer.Rollback(context.Background()) }()
	pid := xactPID(outer)
	if err := XactLock(ctx, outer, outerKey); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- InTx(cctx, outer, []Key{innerKey}, func(pgx.Tx) error { return nil })
	}()
	xactEventuallyHeld(t, dsn, pid, xactEx(outerKey), xactWaitingEx(innerKey))
	cancel()
	err = xactRecv(t, done, "InTx")
	t.Logf("InTx: %v", err)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want context.Canceled", err)
	}
	_, execErr := outer.Exec(ctx, "SELECT 1")
	t.Logf("the outer transaction after InTx: %v", execErr)
	if execErr != nil && !strings.Contains(err.Error(), "roll the outer transaction back") {
		t.Errorf("the outer transaction is unusable (%v), but InTx's error does not say to roll it back: %v", execErr, err)
	}
}
