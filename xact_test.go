package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// xactWait bounds every wait for a signal or for lock state in these tests.
const xactWait = 15 * time.Second

// xactPool opens a pool on a fresh database with room for the test's
// concurrent transactions.
func xactPool(t *testing.T, configure ...func(*pgxpool.Config)) (dsn string, pool *pgxpool.Pool) {
	t.Helper()
	dsn = pgtest.DB(t)
	pool = pgtest.Pool(t, dsn, append([]func(*pgxpool.Config){func(c *pgxpool.Config) { c.MaxConns = 12 }}, configure...)...)
	return dsn, pool
}

// beginTx begins a transaction on pool; it is rolled back in cleanup if the
// test has not ended it.
func xactBegin(t *testing.T, pool *pgxpool.Pool) pgx.Tx {
	t.Helper()
	tx, err := pool.Begin(t.Context())
	if err != nil {
		t.Fatalf("begin: %v", err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

func xactPID(tx pgx.Tx) int32 { return int32(tx.Conn().PgConn().PID()) }

// heldBy returns the advisory locks of backend pid as sorted strings
// "KEY MODE granted|waiting", read from pg_locks.
func xactHeldBy(t *testing.T, dsn string, pid int32) []string {
	t.Helper()
	var out []string
	for _, l := range pgtest.AdvisoryLocks(t, dsn) {
		if l.PID != pid {
			continue
		}
		k, err := KeyFromLock(l.ClassID, l.ObjID, l.ObjSubID)
		if err != nil {
			t.Fatalf("pg_locks row %+v: %v", l, err)
		}
		state := "waiting"
		if l.Granted {
			state = "granted"
		}
		out = append(out, fmt.Sprintf("%v %s %s", k, l.Mode, state))
	}
	slices.Sort(out)
	return out
}

// lockRows builds the expected heldBy output.
func xactRows(rows ...string) []string {
	out := slices.Clone(rows)
	slices.Sort(out)
	return out
}

func xactWantHeld(t *testing.T, dsn string, pid int32, want ...string) {
	t.Helper()
	if got := xactHeldBy(t, dsn, pid); !slices.Equal(got, xactRows(want...)) {
		t.Fatalf("pg_locks for backend %d:\n got %q\nwant %q", pid, got, xactRows(want...))
	}
}

// eventuallyHeld waits (bounded) until pg_locks shows exactly want for pid.
func xactEventuallyHeld(t *testing.T, dsn string, pid int32, want ...string) {
	t.Helper()
	pgtest.Eventually(t, xactWait, fmt.Sprintf("pg_locks for backend %d to be %q", pid, xactRows(want...)), func() bool {
		return slices.Equal(xactHeldBy(t, dsn, pid), xactRows(want...))
	})
}

// recvErr waits (bounded) for the result of a goroutine.
func xactRecv(t *testing.T, ch <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(xactWait):
		t.Fatalf("%s did not return within %v", what, xactWait)
		return nil
	}
}

func xactEx(k Key) string { return k.String() + " ExclusiveLock granted" }
func xactSh(k Key) string { return k.String() + " ShareLock granted" }
func xactWaitingEx(k Key) string {
	return k.String() + " ExclusiveLock waiting"
}

// TestXactTryLockHeldElsewhere: XactTryLock fails with ErrLocked while
// another transaction holds the key, succeeds once it commits, and the lock
// is in pg_locks exactly while its transaction is open.
func TestXactTryLockHeldElsewhere(t *testing.T) {
	dsn, pool := xactPool(t)
	ctx := t.Context()
	k := HashKey("invoice", "42")

	tx1 := xactBegin(t, pool)
	xactWantHeld(t, dsn, xactPID(tx1))
	if err := XactLock(ctx, tx1, k); err != nil {
		t.Fatalf("XactLock: %v", err)
	}
	xactWantHeld(t, dsn, xactPID(tx1), xactEx(k))

	tx2 := xactBegin(t, pool)
	err := XactTryLock(ctx, tx2, k)
	if !errors.Is(err, ErrLocked) {
		t.Fatalf("XactTryLock on a held key: got %v, want ErrLocked", err)
	}
	if !strings.Contains(err.Error(), k.String()) {
		t.Errorf("error %q does not name the key %v", err, k)
	}
	xactWantHeld(t, dsn, xactPID(tx2)) // a failed try neither holds nor waits

	pid1 := xactPID(tx1)
	if err := tx1.Commit(ctx); err != nil {
		t.Fatalf("commit: %v", err)
	}
	xactWantHeld(t, dsn, pid1) // released at commit

	if err := XactTryLock(ctx, tx2, k); err != nil {
		t.Fatalf("XactTryLock after the holder committed: %v", err)
	}
	pid2 := xactPID(tx2)
	xactWantHeld(t, dsn, pid2, xactEx(k))
	if err := tx2.Rollback(ctx); err != nil {
		t.Fatalf("rollback: %v", err)
	}
	xactWantHeld(t, dsn, pid2) // released at rollback
}

// TestXactTryLockPartial: with several keys, XactTryLock stops at the first
// held key in canonical order. The keys before it stay held until the
// transaction ends, the keys after it are not taken, and the transaction is
// not aborted.
func TestXactTryLockPartial(t *testing.T) {
	dsn, pool := xactPool(t)
	ctx := t.Context()
	k1, k2, k3 := Int64Key(-7), Int64Key(3), PairKey(1, 1)

	other := xactBegin(t, pool)
	if err := XactLock(ctx, other, k2); err != nil {
		t.Fatal(err)
	}

	tx := xactBegin(t, pool)
	err := XactTryLock(ctx, tx, k3, k1, k2)
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), "holder: "+k2.String()+" ") {
		t.Fatalf("XactTryLock: got %v, want ErrLocked naming %v", err, k2)
	}
	xactWantHeld(t, dsn, xactPID(tx), xactEx(k1))
	if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatalf("transaction unusable after a failed try: %v", err)
	}
	pid := xactPID(tx)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	xactWantHeld(t, dsn, pid)
}

// TestXactLockOrder: keys are deduplicated and taken in canonical order, one
// after the other, within one statement.
func TestXactLockOrder(t *testing.T) {
	dsn, pool := xactPool(t)
	ctx := t.Context()
	k1, k2 := Int64Key(10), Int64Key(20)

	// XactLock(k2, k1, k2) while k1 is held elsewhere waits on k1 without
	// holding k2: k1 is taken first.
	t.Run("canonical order", func(t *testing.T) {
		holder := xactBegin(t, pool)
		if err := XactLock(ctx, holder, k1); err != nil {
			t.Fatal(err)
		}
		tx := xactBegin(t, pool)
		pid := xactPID(tx)
		done := make(chan error, 1)
		go func() { done <- XactLock(ctx, tx, k2, k1, k2) }()
		xactEventuallyHeld(t, dsn, pid, xactWaitingEx(k1))
		if err := holder.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if err := xactRecv(t, done, "XactLock"); err != nil {
			t.Fatalf("XactLock: %v", err)
		}
		xactWantHeld(t, dsn, pid, xactEx(k1), xactEx(k2))
	})

	// XactLock(k1, k2) while k2 is held elsewhere holds k1 and waits on k2:
	// the select list is evaluated left to right, each call completing before
	// the next starts.
	t.Run("left to right", func(t *testing.T) {
		holder := xactBegin(t, pool)
		if err := XactLock(ctx, holder, k2); err != nil {
			t.Fatal(err)
		}
		tx := xactBegin(t, pool)
		pid := xactPID(tx)
		done := make(chan error, 1)
		go func() { done <- XactLock(ctx, tx, k2, k1) }()
		xactEventuallyHeld(t, dsn, pid, xactEx(k1), xactWaitingEx(k2))
		if err := holder.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if err := xactRecv(t, done, "XactLock"); err != nil {
			t.Fatalf("XactLock: %v", err)
		}
		xactWantHeld(t, dsn, pid, xactEx(k1), xactEx(k2))
	})

	// The statement: deduplicated, bigint keys before pair keys, each in
	// value order, one function call per key.
	t.Run("statement", func(t *testing.T) {
		ks, err := core.CanonicalKeys(coreKeys([]Key{PairKey(1, -2), k2, k1, k2, PairKey(-1, 5), PairKey(1, -2)}))
		if err != nil {
			t.Fatal(err)
		}
		sql, args := core.LockSQL(modeXactLock.fn, ks)
		wantSQL := "SELECT pg_advisory_xact_lock($1::int8), pg_advisory_xact_lock($2::int8), " +
			"pg_advisory_xact_lock($3::int4, $4::int4), pg_advisory_xact_lock($5::int4, $6::int4)"
		wantArgs := []any{int64(10), int64(20), int32(-1), int32(5), int32(1), int32(-2)}
		if sql != wantSQL || !slices.Equal(args, wantArgs) {
			t.Fatalf("statement:\n got %s %v\nwant %s %v", sql, args, wantSQL, wantArgs)
		}
		sql, _ = xactTryStatement(modeXactTryRLock.fn, ks[:2])
		wantSQL = "SELECT CASE WHEN NOT pg_try_advisory_xact_lock_shared($1::int8) THEN 1 " +
			"WHEN NOT pg_try_advisory_xact_lock_shared($2::int8) THEN 2 ELSE 0 END"
		if sql != wantSQL {
			t.Fatalf("try statement:\n got %s\nwant %s", sql, wantSQL)
		}
	})
}

// TestXactSharedVsExclusive: shared holders coexist (ShareLock, granted, in
// pg_locks) and keep exclusive tries out until they end; a waiting exclusive
// request keeps new shared tries out.
func TestXactSharedVsExclusive(t *testing.T) {
	dsn, pool := xactPool(t)
	ctx := t.Context()
	k := PairKey(7, -7)

	r1, r2 := xactBegin(t, pool), xactBegin(t, pool)
	if err := XactRLock(ctx, r1, k); err != nil {
		t.Fatalf("first XactRLock: %v", err)
	}
	if err := XactRLock(ctx, r2, k); err != nil {
		t.Fatalf("second XactRLock: %v", err)
	}
	xactWantHeld(t, dsn, xactPID(r1), xactSh(k))
	xactWantHeld(t, dsn, xactPID(r2), xactSh(k))

	w := xactBegin(t, pool)
	if err := XactTryLock(ctx, w, k); !errors.Is(err, ErrLocked) {
		t.Fatalf("XactTryLock while shared holders are open: got %v, want ErrLocked", err)
	}
	xactWantHeld(t, dsn, xactPID(w))
	r3 := xactBegin(t, pool)
	if err := XactTryRLock(ctx, r3, k); err != nil {
		t.Fatalf("XactTryRLock next to shared holders: %v", err)
	}
	xactWantHeld(t, dsn, xactPID(r3), xactSh(k))

	// A waiting exclusive request keeps new shared tries out.
	done := make(chan error, 1)
	go func() { done <- XactLock(ctx, w, k) }()
	xactEventuallyHeld(t, dsn, xactPID(w), xactWaitingEx(k))
	r4 := xactBegin(t, pool)
	if err := XactTryRLock(ctx, r4, k); !errors.Is(err, ErrLocked) {
		t.Fatalf("XactTryRLock behind a waiting exclusive request: got %v, want ErrLocked", err)
	}

	for _, tx := range []pgx.Tx{r1, r2, r3} {
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := xactRecv(t, done, "XactLock"); err != nil {
		t.Fatalf("XactLock after the shared holders committed: %v", err)
	}
	xactWantHeld(t, dsn, xactPID(w), xactEx(k))

	if err := XactTryRLock(ctx, r4, k); !errors.Is(err, ErrLocked) {
		t.Fatalf("XactTryRLock while held exclusively: got %v, want ErrLocked", err)
	}
	xactWantHeld(t, dsn, xactPID(r4))
}

// backendState returns pg_stat_activity.state of backend pid.
func xactBackendState(t *testing.T, pool *pgxpool.Pool, pid int32) string {
	t.Helper()
	var state string
	if err := pool.QueryRow(t.Context(), "SELECT coalesce(state, '') FROM pg_stat_activity WHERE pid = $1", pid).Scan(&state); err != nil {
		t.Fatalf("pg_stat_activity for backend %d: %v", pid, err)
	}
	return state
}

const xactAbortedState = "idle in transaction (aborted)"

// TestXactLockCancel: a wait ended by ctx returns an error that wraps the
// context's error, and no lock of the transaction remains, including the key
// it took before the one it waited on.
func TestXactLockCancel(t *testing.T) {
	k1, k2 := Int64Key(1), Int64Key(2)

	// run makes XactLock(k1, k2) wait for k2, held elsewhere, then cancels
	// its ctx once pg_locks shows the wait, or with expire lets a deadline
	// end it.
	run := func(t *testing.T, expire bool, configure func(*pgxpool.Config)) (dsn string, pool *pgxpool.Pool, tx pgx.Tx, pid int32) {
		dsn, pool = xactPool(t, configure)
		holder := xactBegin(t, pool)
		if err := XactLock(t.Context(), holder, k2); err != nil {
			t.Fatal(err)
		}
		tx = xactBegin(t, pool)
		pid = xactPID(tx)
		var (
			ctx    context.Context
			cancel context.CancelFunc
			want   = context.Canceled
		)
		if expire {
			ctx, cancel = context.WithTimeout(t.Context(), time.Second)
			want = context.DeadlineExceeded
		} else {
			ctx, cancel = context.WithCancel(t.Context())
		}
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- XactLock(ctx, tx, k1, k2) }()
		if !expire {
			xactEventuallyHeld(t, dsn, pid, xactEx(k1), xactWaitingEx(k2))
			cancel()
		}
		err := xactRecv(t, done, "XactLock")
		if err == nil || !errors.Is(err, want) {
			t.Fatalf("XactLock whose ctx ended: got %v, want an error wrapping %v", err, want)
		}
		xactWantHeld(t, dsn, xactPID(holder), xactEx(k2)) // the holder is untouched
		return dsn, pool, tx, pid
	}

	// pgx's default: the statement is cancelled and the connection closed,
	// so the server ends the transaction.
	t.Run("default pgx", func(t *testing.T) {
		dsn, _, tx, pid := run(t, false, func(*pgxpool.Config) {})
		xactEventuallyHeld(t, dsn, pid)
		_ = tx.Rollback(context.Background()) // the connection is closed; nothing to send
		xactWantHeld(t, dsn, pid)
	})

	t.Run("deadline", func(t *testing.T) {
		dsn, _, tx, pid := run(t, true, func(*pgxpool.Config) {})
		xactEventuallyHeld(t, dsn, pid)
		_ = tx.Rollback(context.Background())
		xactWantHeld(t, dsn, pid)
	})

	// With a cancel request instead, the connection survives and the
	// transaction is aborted: its keys are released at once, although the
	// transaction stays open in the failed state until rollback.
	t.Run("cancel request", func(t *testing.T) {
		dsn, pool, tx, pid := run(t, false, func(c *pgxpool.Config) {
			c.ConnConfig.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
				return &pgconn.CancelRequestContextWatcherHandler{Conn: pc, DeadlineDelay: 10 * time.Second}
			}
		})
		if st := xactBackendState(t, pool, pid); st != xactAbortedState {
			t.Fatalf("backend state after the cancelled wait: %q, want %q", st, xactAbortedState)
		}
		xactWantHeld(t, dsn, pid)
		_, err := tx.Exec(t.Context(), "SELECT 1")
		if pe := (*pgconn.PgError)(nil); !errors.As(err, &pe) || pe.Code != "25P02" {
			t.Fatalf("statement after a cancelled wait: got %v, want SQLSTATE 25P02", err)
		}
		if err := tx.Rollback(t.Context()); err != nil {
			t.Fatalf("rollback: %v", err)
		}
		xactWantHeld(t, dsn, pid)
		if err := tx.Conn().Ping(t.Context()); err != nil {
			t.Fatalf("connection after rollback: %v", err)
		}
	})
}

// TestXactLockStatementError: a statement error aborts the
// transaction and PostgreSQL releases its keys at that moment, not at
// ROLLBACK: another transaction can take them while the aborted one is still
// open, in which nothing more can run. In a savepoint, the error releases
// only the keys taken after it. InTx refuses to commit after fn ignored such
// an error.
func TestXactLockStatementError(t *testing.T) {
	dsn, pool := xactPool(t)
	ctx := t.Context()
	k := HashKey("account", "1")

	tx := xactBegin(t, pool)
	pid := xactPID(tx)
	if err := XactLock(ctx, tx, k); err != nil {
		t.Fatal(err)
	}
	xactWantHeld(t, dsn, pid, xactEx(k))
	if _, err := tx.Exec(ctx, "SELECT 1/0"); err == nil {
		t.Fatal("SELECT 1/0 succeeded")
	}
	if st := xactBackendState(t, pool, pid); st != xactAbortedState {
		t.Fatalf("backend state after the error: %q, want %q", st, xactAbortedState)
	}
	xactWantHeld(t, dsn, pid) // released by the abort, before any ROLLBACK
	other := xactBegin(t, pool)
	if err := XactTryLock(ctx, other, k); err != nil {
		t.Fatalf("XactTryLock while the aborted transaction is still open: %v", err)
	}
	var pe *pgconn.PgError
	if _, err := tx.Exec(ctx, "SELECT 1"); !errors.As(err, &pe) || pe.Code != "25P02" {
		t.Fatalf("statement in an aborted transaction: got %v, want SQLSTATE 25P02", err)
	}
	if err := XactLock(ctx, tx, Int64Key(1)); !errors.As(err, &pe) || pe.Code != "25P02" {
		t.Fatalf("XactLock in an aborted transaction: got %v, want SQLSTATE 25P02", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	xactWantHeld(t, dsn, pid)
	if err := other.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	t.Run("in a savepoint", func(t *testing.T) {
		k1, k2 := Int64Key(1), Int64Key(2)
		tx := xactBegin(t, pool)
		pid := xactPID(tx)
		if err := XactLock(ctx, tx, k1); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SAVEPOINT s"); err != nil {
			t.Fatal(err)
		}
		if err := XactLock(ctx, tx, k2); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SELECT 1/0"); err == nil {
			t.Fatal("SELECT 1/0 succeeded")
		}
		xactWantHeld(t, dsn, pid, xactEx(k1))
		if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT s"); err != nil {
			t.Fatal(err)
		}
		xactWantHeld(t, dsn, pid, xactEx(k1))
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		xactWantHeld(t, dsn, pid)
	})

	t.Run("InTx fn ignores the error", func(t *testing.T) {
		var pid int32
		err := InTx(ctx, pool, []Key{k}, func(tx pgx.Tx) error {
			pid = xactPID(tx)
			_, _ = tx.Exec(ctx, "SELECT 1/0") // error ignored
			xactWantHeld(t, dsn, pid)         // fn runs on, unprotected
			return nil
		})
		if !errors.Is(err, pgx.ErrTxCommitRollback) {
			t.Fatalf("InTx: got %v, want pgx.ErrTxCommitRollback", err)
		}
		xactWantHeld(t, dsn, pid)
	})
}

// TestXactLockSavepoint: ROLLBACK TO SAVEPOINT releases the xact
// locks taken after the savepoint while the transaction goes on; locks held
// before the savepoint, and locks kept by RELEASE SAVEPOINT, stay.
func TestXactLockSavepoint(t *testing.T) {
	dsn, pool := xactPool(t)
	ctx := t.Context()
	k1, k2, k3 := Int64Key(1), Int64Key(2), Int64Key(3)

	tx := xactBegin(t, pool)
	pid := xactPID(tx)
	exec := func(sql string) {
		t.Helper()
		if _, err := tx.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	if err := XactLock(ctx, tx, k1); err != nil {
		t.Fatal(err)
	}
	exec("SAVEPOINT s")
	if err := XactLock(ctx, tx, k1, k2); err != nil { // k1 again, k2 new
		t.Fatal(err)
	}
	xactWantHeld(t, dsn, pid, xactEx(k1), xactEx(k2))
	exec("ROLLBACK TO SAVEPOINT s")
	xactWantHeld(t, dsn, pid, xactEx(k1)) // k2 released, k1 (held before) kept

	other := xactBegin(t, pool)
	if err := XactTryLock(ctx, other, k2); err != nil {
		t.Fatalf("k2 after ROLLBACK TO SAVEPOINT is not free: %v", err)
	}
	if err := other.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	exec("SAVEPOINT s2")
	if err := XactLock(ctx, tx, k3); err != nil {
		t.Fatal(err)
	}
	exec("RELEASE SAVEPOINT s2")
	exec("SELECT 1") // the transaction went on all along
	xactWantHeld(t, dsn, pid, xactEx(k1), xactEx(k3))

	// pgx nested transactions are savepoints.
	nested, err := tx.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := XactLock(ctx, nested, k2); err != nil {
		t.Fatal(err)
	}
	xactWantHeld(t, dsn, pid, xactEx(k1), xactEx(k2), xactEx(k3))
	if err := nested.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	xactWantHeld(t, dsn, pid, xactEx(k1), xactEx(k3))

	// InTx given a pgx.Tx: failure releases its keys, success keeps them
	// until the outer transaction ends.
	errFn := errors.New("fn failed")
	if err := InTx(ctx, tx, []Key{k2}, func(pgx.Tx) error { return errFn }); err != errFn {
		t.Fatalf("InTx: got %v, want fn's error", err)
	}
	xactWantHeld(t, dsn, pid, xactEx(k1), xactEx(k3))
	if err := InTx(ctx, tx, []Key{k2}, func(pgx.Tx) error { return nil }); err != nil {
		t.Fatal(err)
	}
	xactWantHeld(t, dsn, pid, xactEx(k1), xactEx(k2), xactEx(k3))
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	xactWantHeld(t, dsn, pid)
}

// TestInTxNestedFailureRollsBackSavepoint: InTx on a pgx.Tx (a savepoint)
// that fails after fn returned nil, because ctx ended before RELEASE
// SAVEPOINT or because fn ignored a statement error, rolls back to the
// savepoint: its key is released (pg_locks, read from another connection)
// while the outer transaction's key stays held, the error says which
// happened, the outer transaction runs statements, and its commit keeps
// its own earlier row and none of fn's. A nested InTx that succeeds keeps
// fn's row and key until the outer commit.
func TestInTxNestedFailureRollsBackSavepoint(t *testing.T) {
	dsn, pool := xactPool(t)
	ctx := t.Context()
	if _, err := pool.Exec(ctx, "CREATE TABLE t (v text)"); err != nil {
		t.Fatal(err)
	}
	outerKey, innerKey := Int64Key(1), Int64Key(2)
	for _, c := range []struct {
		name string
		fn   func(ctx context.Context, cancel context.CancelFunc, tx pgx.Tx) error
		want []error  // the error must wrap each
		says string   // and say this
		rows []string // in t after the outer commit
	}{
		{
			name: "ctx ends after fn",
			fn: func(ctx context.Context, cancel context.CancelFunc, tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, "INSERT INTO t VALUES ('fn')"); err != nil {
					return err
				}
				cancel()
				return nil
			},
			want: []error{context.Canceled},
			says: "ctx ended before the savepoint was released",
			rows: []string{"outer"},
		},
		{
			name: "fn ignores a statement error",
			fn: func(ctx context.Context, _ context.CancelFunc, tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, "INSERT INTO t VALUES ('fn')"); err != nil {
					return err
				}
				_, _ = tx.Exec(ctx, "SELECT 1/0")
				return nil
			},
			want: []error{pgx.ErrTxCommitRollback},
			says: "a statement failed in the savepoint and fn returned nil",
			rows: []string{"outer"},
		},
		{
			name: "success",
			fn: func(ctx context.Context, _ context.CancelFunc, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "INSERT INTO t VALUES ('fn')")
				return err
			},
			rows: []string{"fn", "outer"},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
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
			cctx, cancel := context.WithCancel(ctx)
			defer cancel()
			err := InTx(cctx, outer, []Key{innerKey}, func(tx pgx.Tx) error {
				xactWantHeld(t, dsn, pid, xactEx(outerKey), xactEx(innerKey))
				return c.fn(cctx, cancel, tx)
			})
			for _, w := range c.want {
				if !errors.Is(err, w) {
					t.Errorf("InTx: got %v, want an error wrapping %v", err, w)
				}
			}
			if c.want == nil && err != nil {
				t.Fatalf("InTx: %v", err)
			}
			if err != nil && !strings.Contains(err.Error(), c.says) {
				t.Errorf("InTx: got %q, want it to say %q", err, c.says)
			}
			if c.want != nil {
				t.Logf("InTx: %v", err)
				// The savepoint is rolled back: its key is free while the
				// outer transaction goes on.
				xactWantHeld(t, dsn, pid, xactEx(outerKey))
				other := xactBegin(t, pool)
				if err := XactTryLock(ctx, other, innerKey); err != nil {
					t.Fatalf("the savepoint's key is not free: %v", err)
				}
				if err := other.Rollback(ctx); err != nil {
					t.Fatal(err)
				}
			} else {
				xactWantHeld(t, dsn, pid, xactEx(outerKey), xactEx(innerKey))
			}
			if _, err := outer.Exec(ctx, "SELECT 1"); err != nil {
				t.Fatalf("the outer transaction after InTx: %v", err)
			}
			if err := outer.Commit(ctx); err != nil {
				t.Fatalf("outer commit: %v", err)
			}
			xactWantHeld(t, dsn, pid)
			rows, err := pool.Query(ctx, "SELECT v FROM t ORDER BY v")
			if err != nil {
				t.Fatal(err)
			}
			got, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, c.rows) {
				t.Fatalf("committed rows: got %q, want %q", got, c.rows)
			}
		})
	}
}

// xactTracer counts the statements and prepares that pgx sends.
type xactTracer struct {
	queries, prepares atomic.Int64
}

func (c *xactTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.queries.Add(1)
	return ctx
}
func (c *xactTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *xactTracer) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	c.prepares.Add(1)
	return ctx
}
func (c *xactTracer) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

// TestInTxNoSessionState: in every pgx query mode, including the
// ones used behind PgBouncer's transaction pooling, InTx takes the right keys
// (extremes of both key spaces, read back from pg_locks), and leaves nothing
// on the server connection: no advisory lock and no prepared statement (the
// lock statement runs in QueryExecModeExec whatever the default mode). It
// also sends exactly BEGIN, one lock statement, fn's statements and COMMIT,
// and prepares nothing, on the first run as on the second
// (TestInTxRoundTrips counts the round trips on the wire).
func TestInTxNoSessionState(t *testing.T) {
	keys := []Key{
		Int64Key(math.MinInt64), Int64Key(math.MaxInt64), Int64Key(-1), Int64Key(0),
		PairKey(math.MinInt32, -1), PairKey(math.MaxInt32, 0), PairKey(-1, math.MinInt32),
		HashKey("account", "7"),
	}
	var want []string
	for _, k := range keys {
		want = append(want, xactEx(k))
	}
	modes := []pgx.QueryExecMode{
		pgx.QueryExecModeCacheStatement,
		pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec,
		pgx.QueryExecModeExec,
		pgx.QueryExecModeSimpleProtocol,
	}
	dsn := pgtest.DB(t)
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := t.Context()
			tracer := &xactTracer{}
			pool := pgtest.Pool(t, dsn, func(c *pgxpool.Config) {
				c.MaxConns = 1 // every call below uses the same backend
				c.ConnConfig.DefaultQueryExecMode = mode
				c.ConnConfig.Tracer = tracer
			})
			var pid int32
			for i := range 2 {
				tracer.queries.Store(0)
				tracer.prepares.Store(0)
				err := InTx(ctx, pool, keys, func(tx pgx.Tx) error {
					pid = xactPID(tx)
					xactWantHeld(t, dsn, pid, want...)
					return nil
				})
				if err != nil {
					t.Fatalf("InTx: %v", err)
				}
				if q, p := tracer.queries.Load(), tracer.prepares.Load(); q != 3 || p != 0 {
					t.Errorf("run %d: InTx sent %d statements and %d prepares, want 3 (BEGIN, lock, COMMIT) and no prepare", i+1, q, p)
				}
			}
			xactWantHeld(t, dsn, pid)
			var n int
			var after int32
			if err := pool.QueryRow(ctx, "SELECT pg_backend_pid(), (SELECT count(*) FROM pg_prepared_statements WHERE strpos(statement, 'pg_' || 'advisory') > 0)").Scan(&after, &n); err != nil {
				t.Fatal(err)
			}
			if after != pid {
				t.Fatalf("backend changed from %d to %d", pid, after)
			}
			if n != 0 {
				t.Errorf("%d lock statements left prepared on the backend, want 0", n)
			}
		})
	}
}

// TestInTx: success commits and releases; fn's error is returned unchanged
// and rolls back; a panic rolls back and is re-raised; invalid arguments
// fail before anything is sent. Works with *pgx.Conn as well as a pool.
func TestInTx(t *testing.T) {
	dsn, pool := xactPool(t)
	ctx := t.Context()
	if _, err := pool.Exec(ctx, "CREATE TABLE t (v int)"); err != nil {
		t.Fatal(err)
	}
	count := func() int {
		t.Helper()
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM t").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	k := Int64Key(99)
	var pid int32
	insert := func(tx pgx.Tx) error {
		pid = xactPID(tx)
		xactWantHeld(t, dsn, pid, xactEx(k))
		_, err := tx.Exec(ctx, "INSERT INTO t VALUES (1)")
		return err
	}

	if err := InTx(ctx, pool, []Key{k}, insert); err != nil {
		t.Fatal(err)
	}
	xactWantHeld(t, dsn, pid)
	if n := count(); n != 1 {
		t.Fatalf("after a successful InTx: %d rows, want 1", n)
	}

	errFn := errors.New("fn failed")
	err := InTx(ctx, pool, []Key{k}, func(tx pgx.Tx) error { _ = insert(tx); return errFn })
	if err != errFn {
		t.Fatalf("InTx: got %v, want fn's error unchanged", err)
	}
	xactWantHeld(t, dsn, pid)
	if n := count(); n != 1 {
		t.Fatalf("after a failed InTx: %d rows, want 1", n)
	}

	func() {
		defer func() {
			if p := recover(); p != "boom" {
				t.Fatalf("recovered %v, want the panic from fn", p)
			}
		}()
		_ = InTx(ctx, pool, []Key{k}, func(tx pgx.Tx) error { _ = insert(tx); panic("boom") })
		t.Fatal("InTx returned after fn panicked")
	}()
	xactWantHeld(t, dsn, pid)
	if n := count(); n != 1 {
		t.Fatalf("after a panicking InTx: %d rows, want 1", n)
	}

	conn := pgtest.Conn(t, dsn)
	if err := InTx(ctx, conn, []Key{k, k}, insert); err != nil {
		t.Fatalf("InTx on a *pgx.Conn: %v", err)
	}
	xactWantHeld(t, dsn, pid)
	if n := count(); n != 2 {
		t.Fatalf("after InTx on a *pgx.Conn: %d rows, want 2", n)
	}

	called := false
	fn := func(pgx.Tx) error { called = true; return nil }
	for name, err := range map[string]error{
		"zero key":         InTx(ctx, pool, []Key{k, {}}, fn),
		"only a zero key":  InTx(ctx, pool, []Key{{}}, fn),
		"a zero key first": InTx(ctx, pool, []Key{{}, k}, fn),
	} {
		if !errors.Is(err, ErrInvalidKey) {
			t.Errorf("InTx with %s: got %v, want ErrInvalidKey", name, err)
		}
	}
	if err := InTx(ctx, nil, []Key{k}, fn); err == nil || !strings.HasPrefix(err.Error(), "pgcoord: ") {
		t.Errorf("InTx with nil db: got %v", err)
	}
	if err := InTx(ctx, pool, []Key{k}, nil); err == nil {
		t.Error("InTx with nil fn succeeded")
	}
	var nilCtx context.Context
	if err := xactNoPanic(t, "InTx(nil ctx)", func() error { return InTx(nilCtx, pool, []Key{k}, fn) }); err == nil || !strings.Contains(err.Error(), "ctx is nil") {
		t.Errorf("InTx with nil ctx: got %v", err)
	}
	if called {
		t.Error("fn was called for invalid arguments")
	}
}

// TestInTxNoKeysCheckFence: InTx with no keys runs a transaction that takes
// no lock: one that checks a fence held elsewhere and writes under it. With
// the current fence the write commits; with a stale one CheckFence refuses
// it and nothing is written. pg_locks shows no advisory lock of the
// transaction's backend while fn runs.
func TestInTxNoKeysCheckFence(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := migratedPool(t, ctx, DefaultSchema)
	if _, err := pool.Exec(ctx, "CREATE TABLE ledger (fence bigint)"); err != nil {
		t.Fatal(err)
	}
	c := newTestClientOn(t, pool)
	k := Int64Key(77)
	lock := func() *Lock {
		t.Helper()
		l, err := c.Lock(ctx, k, WithFence())
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	write := func(fence Term) func(pgx.Tx) error {
		return func(tx pgx.Tx) error {
			if err := CheckFence(ctx, tx, k, fence); err != nil {
				return err
			}
			if got := xactHeldBy(t, dsn, xactPID(tx)); len(got) != 0 {
				t.Errorf("InTx with no keys holds %q", got)
			}
			_, err := tx.Exec(ctx, "INSERT INTO ledger VALUES ($1)", int64(fence))
			return err
		}
	}
	rows := func() (out []int64) {
		t.Helper()
		r, err := pool.Query(ctx, "SELECT fence FROM ledger ORDER BY fence")
		if err != nil {
			t.Fatal(err)
		}
		out, err = pgx.CollectRows(r, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		return out
	}

	old := lock()
	if err := InTx(ctx, pool, nil, write(old.Fence())); err != nil {
		t.Fatalf("InTx with no keys and the current fence: %v", err)
	}
	if err := InTx(ctx, pool, []Key{}, write(old.Fence())); err != nil {
		t.Fatalf("InTx with an empty key list and the current fence: %v", err)
	}
	if err := old.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	newer := lock()
	defer newer.Unlock(ctx)
	if err := InTx(ctx, pool, nil, write(old.Fence())); !errors.Is(err, ErrStaleFence) {
		t.Fatalf("InTx with no keys and a stale fence: got %v, want ErrStaleFence", err)
	}
	if got, want := rows(), []int64{int64(old.Fence()), int64(old.Fence())}; !slices.Equal(got, want) {
		t.Fatalf("ledger: got %v, want %v (two writes under the current fence, none under the stale one)", got, want)
	}
	// Nested in a transaction of its own: a savepoint, no key either.
	tx := xactBegin(t, pool)
	if err := InTx(ctx, tx, nil, write(newer.Fence())); err != nil {
		t.Fatalf("nested InTx with no keys: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := rows(); len(got) != 3 || got[2] != int64(newer.Fence()) {
		t.Fatalf("ledger after the nested InTx: %v, want the newer fence %d last", got, newer.Fence())
	}
}

// TestXactInvalidArguments: nil tx and invalid keys are clear errors, for
// every Xact function, and the transaction is not touched.
func TestXactInvalidArguments(t *testing.T) {
	dsn, pool := xactPool(t)
	ctx := t.Context()
	tx := xactBegin(t, pool)
	var nilCtx context.Context
	for name, f := range map[string]func(context.Context, pgx.Tx, ...Key) error{
		"xact lock": XactLock, "xact read lock": XactRLock, "xact try lock": XactTryLock, "xact try read lock": XactTryRLock,
	} {
		if err := f(ctx, nil, Int64Key(1)); err == nil || !strings.Contains(err.Error(), "nil pgx.Tx") || !strings.HasPrefix(err.Error(), "pgcoord: "+name+" int64:1: ") {
			t.Errorf("%s(nil tx): got %v", name, err)
		}
		if err := xactNoPanic(t, name+"(nil ctx)", func() error { return f(nilCtx, tx, Int64Key(1)) }); err == nil || err.Error() != "pgcoord: "+name+" int64:1: ctx is nil" {
			t.Errorf("%s(nil ctx): got %v", name, err)
		}
		if err := f(ctx, tx); !errors.Is(err, ErrInvalidKey) {
			t.Errorf("%s with no keys: got %v, want ErrInvalidKey", name, err)
		}
		if err := f(ctx, tx, Int64Key(1), HashKey()); !errors.Is(err, ErrInvalidKey) {
			t.Errorf("%s with an invalid key: got %v, want ErrInvalidKey", name, err)
		}
	}
	xactWantHeld(t, dsn, xactPID(tx))
	if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatalf("transaction after invalid calls: %v", err)
	}
}

// xactNoPanic runs f and returns its error, or fails the test if f panics.
func xactNoPanic(t *testing.T, what string, f func() error) (err error) {
	t.Helper()
	defer func() {
		if p := recover(); p != nil {
			t.Errorf("%s panicked: %v", what, p)
		}
	}()
	return f()
}

// TestXactTypedNilArguments: a nil *pgxpool.Pool, *pgx.Conn or *pgxpool.Tx
// in the interface argument is reported as an error prefixed "pgcoord: ",
// as an untyped nil is, by InTx, InTxOptions and every Xact function,
// instead of a nil-pointer panic.
func TestXactTypedNilArguments(t *testing.T) {
	ctx := t.Context()
	k := Int64Key(1)
	fn := func(pgx.Tx) error { t.Error("fn called with a nil db"); return nil }
	var (
		pool *pgxpool.Pool
		conn *pgx.Conn
		ptx  *pgxpool.Tx
	)
	calls := map[string]func() error{
		"InTx(nil *pgxpool.Pool)":        func() error { return InTx(ctx, pool, []Key{k}, fn) },
		"InTx(nil *pgx.Conn)":            func() error { return InTx(ctx, conn, []Key{k}, fn) },
		"InTx(nil *pgxpool.Tx)":          func() error { return InTx(ctx, ptx, []Key{k}, fn) },
		"InTxOptions(nil *pgxpool.Pool)": func() error { return InTxOptions(ctx, pool, pgx.TxOptions{}, []Key{k}, fn) },
		"InTxOptions(nil *pgx.Conn)":     func() error { return InTxOptions(ctx, conn, pgx.TxOptions{}, []Key{k}, fn) },
	}
	for name, f := range map[string]func(context.Context, pgx.Tx, ...Key) error{
		"XactLock": XactLock, "XactRLock": XactRLock, "XactTryLock": XactTryLock, "XactTryRLock": XactTryRLock,
	} {
		calls[name+"(nil *pgxpool.Tx)"] = func() error { return f(ctx, ptx, k) }
	}
	for name, call := range calls {
		if err := xactNoPanic(t, name, call); err == nil || !strings.HasPrefix(err.Error(), "pgcoord: ") || !strings.Contains(err.Error(), "nil") {
			t.Errorf("%s: got %v, want a pgcoord error about the nil argument", name, err)
		}
	}
}

// transferSetup creates n accounts with balance 1000 each.
func xactAccounts(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	_, err := pool.Exec(t.Context(), `CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL);
		INSERT INTO accounts SELECT g, 1000 FROM generate_series(1, `+fmt.Sprint(n)+`) g`)
	if err != nil {
		t.Fatal(err)
	}
}

func xactBalanceSum(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	var sum int64
	if err := pool.QueryRow(t.Context(), "SELECT sum(balance) FROM accounts").Scan(&sum); err != nil {
		t.Fatal(err)
	}
	return sum
}

// runTransfers runs total random transfers among accounts 1..n on workers
// goroutines; transfer does one and returns its error. It returns how many
// failed with a deadlock; any other error fails the test. Workers stop early
// once stop returns true.
func xactTransfers(t *testing.T, workers, total, n int, stop func() bool, transfer func(from, to int, amount int64) error) (deadlocks int64) {
	t.Helper()
	var dl atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 0x5eed))
			for range total / workers {
				if stop() {
					return
				}
				from := 1 + rng.IntN(n)
				to := 1 + rng.IntN(n-1)
				if to >= from {
					to++
				}
				err := transfer(from, to, int64(1+rng.IntN(100)))
				switch {
				case err == nil:
				case xactIsDeadlock(err):
					dl.Add(1)
				default:
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("transfer: %v", err)
	}
	return dl.Load()
}

// TestInTxOrderedNoDeadlock: concurrent transfers that lock both accounts
// with InTx (canonical order) never deadlock and keep the total; the same
// workload taking the keys in argument order, one statement per key with
// the row update in between, does deadlock, so the first half can fail.
func TestInTxOrderedNoDeadlock(t *testing.T) {
	const (
		workers  = 8
		total    = 2000
		accounts = 20
	)
	// A short deadlock_timeout makes PostgreSQL check for deadlocks soon
	// after a wait starts, in both halves alike.
	_, pool := xactPool(t, func(c *pgxpool.Config) {
		c.MaxConns = workers
		c.ConnConfig.RuntimeParams["deadlock_timeout"] = "20ms"
	})
	xactAccounts(t, pool, accounts)
	ctx := t.Context()
	// update reads the balance and writes it back changed: a
	// read-modify-write that loses updates unless the account is locked.
	update := func(tx pgx.Tx, id int, delta int64) error {
		var balance int64
		if err := tx.QueryRow(ctx, "SELECT balance FROM accounts WHERE id = $1", id).Scan(&balance); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "UPDATE accounts SET balance = $1 WHERE id = $2", balance+delta, id)
		return err
	}
	sum0 := xactBalanceSum(t, pool)

	t.Run("InTx", func(t *testing.T) {
		var done atomic.Int64
		dl := xactTransfers(t, workers, total, accounts, func() bool { return false }, func(from, to int, amount int64) error {
			err := InTx(ctx, pool, []Key{Int64Key(int64(from)), Int64Key(int64(to))}, func(tx pgx.Tx) error {
				if err := update(tx, from, -amount); err != nil {
					return err
				}
				return update(tx, to, amount)
			})
			if err == nil {
				done.Add(1)
			}
			return err
		})
		if dl != 0 {
			t.Errorf("%d deadlocks with canonical order, want 0", dl)
		}
		if n := done.Load(); n != total {
			t.Errorf("%d transfers committed, want %d", n, total)
		}
		if sum := xactBalanceSum(t, pool); sum != sum0 {
			t.Errorf("sum of balances changed from %d to %d", sum0, sum)
		}
	})

	t.Run("argument order deadlocks", func(t *testing.T) {
		var hit atomic.Bool
		dl := xactTransfers(t, workers, total, accounts, hit.Load, func(from, to int, amount int64) error {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(ctx) }()
			for _, step := range []struct {
				id    int
				delta int64
			}{{from, -amount}, {to, amount}} {
				_, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1::int8)", int64(step.id))
				if err == nil {
					err = update(tx, step.id, step.delta)
				}
				if err != nil {
					if xactIsDeadlock(err) {
						hit.Store(true)
					}
					return err
				}
			}
			return tx.Commit(ctx)
		})
		if dl == 0 {
			t.Errorf("no deadlock when taking keys in argument order; the ordered half proves nothing")
		}
		t.Logf("%d deadlock(s) in argument order", dl)
		if sum := xactBalanceSum(t, pool); sum != sum0 {
			t.Errorf("sum of balances changed from %d to %d", sum0, sum)
		}
	})

	// Without locks the read-modify-write loses updates, so the sum check
	// above can fail.
	t.Run("no lock changes the sum", func(t *testing.T) {
		xactTransfers(t, workers, total/2, accounts, func() bool { return false }, func(from, to int, amount int64) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if err := update(tx, from, -amount); err != nil {
					return err
				}
				return update(tx, to, amount)
			})
		})
		if sum := xactBalanceSum(t, pool); sum == sum0 {
			t.Errorf("sum of balances unchanged without locks; the sum check proves nothing")
		}
	})
}

// isDeadlock reports a deadlock, whether or not pgcoord mapped it.
func xactIsDeadlock(err error) bool {
	var pe *pgconn.PgError
	return errors.Is(err, ErrDeadlock) || errors.As(err, &pe) && pe.Code == "40P01"
}

// TestInTxOptions: the transaction is begun with the given options, holds
// the keys while fn runs and releases them when it ends.
func TestInTxOptions(t *testing.T) {
	dsn, pool := xactPool(t)
	ctx := t.Context()
	k := Int64Key(7)
	var pid int32
	opts := pgx.TxOptions{IsoLevel: pgx.Serializable, AccessMode: pgx.ReadOnly}
	err := InTxOptions(ctx, pool, opts, []Key{k}, func(tx pgx.Tx) error {
		pid = xactPID(tx)
		xactWantHeld(t, dsn, pid, xactEx(k))
		var iso, ro string
		if err := tx.QueryRow(ctx, "SELECT current_setting('transaction_isolation'), current_setting('transaction_read_only')").Scan(&iso, &ro); err != nil {
			return err
		}
		if iso != "serializable" || ro != "on" {
			t.Errorf("transaction_isolation %q, transaction_read_only %q; want serializable, on", iso, ro)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	xactWantHeld(t, dsn, pid)

	errFn := errors.New("fn failed")
	if err := InTxOptions(ctx, pool, pgx.TxOptions{}, []Key{k}, func(pgx.Tx) error { return errFn }); err != errFn {
		t.Fatalf("InTxOptions: got %v, want fn's error unchanged", err)
	}
	if err := InTxOptions(ctx, nil, opts, []Key{k}, func(pgx.Tx) error { return nil }); err == nil || !strings.HasPrefix(err.Error(), "pgcoord: in tx "+k.String()+": nil TxOptionsBeginner") {
		t.Fatalf("nil db: %v", err)
	}
	if err := InTxOptions(ctx, pool, opts, []Key{{}}, func(pgx.Tx) error { return nil }); !errors.Is(err, ErrInvalidKey) {
		t.Fatalf("zero key: %v", err)
	}
}
