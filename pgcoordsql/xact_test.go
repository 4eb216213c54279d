package pgcoordsql_test

import (
	"context"
	"database/sql"
	"errors"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"github.com/pgcoord/pgcoord/pgcoordsql"
)

// TestXactLockOrder: the keys of one call are deduplicated and taken in
// canonical order (bigint keys by value, then pair keys), one after the
// other: with the middle key held elsewhere, pg_locks shows the keys before
// it granted, that key awaited and the keys after it not requested.
func TestXactLockOrder(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	db := openDB(t, dsn)
	blocker, _ := begin(t, db)
	tx, pid := begin(t, db)

	mid := pgcoord.Int64Key(30)
	if err := pgcoordsql.XactLock(ctx, blocker, mid); err != nil {
		t.Fatal(err)
	}
	given := []pgcoord.Key{mid, pgcoord.PairKey(1, -2), pgcoord.Int64Key(10), pgcoord.Int64Key(20), mid,
		pgcoord.PairKey(-1, 5), pgcoord.Int64Key(-5), pgcoord.Int64Key(10)}
	canonical := []pgcoord.Key{pgcoord.Int64Key(-5), pgcoord.Int64Key(10), pgcoord.Int64Key(20), mid,
		pgcoord.PairKey(-1, 5), pgcoord.PairKey(1, -2)}

	r := async(func() error { return pgcoordsql.XactLock(ctx, tx, given...) })
	waitLocks(t, dsn, pid, append(want("ExclusiveLock", "granted", canonical[:3]...), want("ExclusiveLock", "waiting", mid)...))
	if err := blocker.Rollback(); err != nil {
		t.Fatal(err)
	}
	if err := r.get(t); err != nil {
		t.Fatalf("XactLock: %v", err)
	}
	waitLocks(t, dsn, pid, want("ExclusiveLock", "granted", canonical...))
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if got := locksOf(t, dsn, pid); len(got) != 0 {
		t.Fatalf("after COMMIT, backend %d still holds %q", pid, got)
	}
}

// TestXactLockChunks: more keys than one statement takes are taken in
// order, chunk after chunk; a try that meets a held key in the second
// chunk keeps exactly the keys before it and names the held one.
func TestXactLockChunks(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	db := openDB(t, dsn)
	const n = 1500
	keys := make([]pgcoord.Key, n)
	for i := range keys {
		keys[i] = pgcoord.Int64Key(int64(n - 1 - i)) // reversed: canonical order is 0..n-1
	}
	count := func(pid int32) int {
		c := 0
		for _, l := range pgtest.AdvisoryLocks(t, dsn) {
			if l.PID == pid && l.Granted && l.Mode == "ExclusiveLock" {
				c++
			}
		}
		return c
	}

	tx, pid := begin(t, db)
	if err := pgcoordsql.XactLock(ctx, tx, keys...); err != nil {
		t.Fatal(err)
	}
	if got := count(pid); got != n {
		t.Fatalf("XactLock of %d keys: %d held in pg_locks", n, got)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}

	blocker, _ := begin(t, db)
	if err := pgcoordsql.XactLock(ctx, blocker, pgcoord.Int64Key(1200)); err != nil {
		t.Fatal(err)
	}
	tx, pid = begin(t, db)
	err := pgcoordsql.XactTryLock(ctx, tx, keys...)
	if !errors.Is(err, pgcoord.ErrLocked) || !strings.Contains(err.Error(), "int64:1200") {
		t.Fatalf("XactTryLock with int64:1200 held elsewhere: got %v, want ErrLocked naming int64:1200", err)
	}
	if got := count(pid); got != 1200 {
		t.Fatalf("after the failed try, the transaction holds %d keys, want the 1200 before int64:1200", got)
	}
}

// TestXactOppositeOrdersNoDeadlock: two transactions lock the same keys
// given in opposite orders. With the middle key held by a third, the first
// holds the keys below it and waits, and the second waits for the lowest
// key holding nothing; had each taken its keys in the order given, they
// would now deadlock once the middle key is freed. Then many transactions
// do the same concurrently, none chosen as a deadlock victim.
func TestXactOppositeOrdersNoDeadlock(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	db := openDB(t, dsn)
	keys := []pgcoord.Key{pgcoord.Int64Key(1), pgcoord.Int64Key(2), pgcoord.Int64Key(3), pgcoord.Int64Key(4), pgcoord.Int64Key(5)}
	reversed := slices.Clone(keys)
	slices.Reverse(reversed)

	blocker, _ := begin(t, db)
	if err := pgcoordsql.XactLock(ctx, blocker, keys[2]); err != nil {
		t.Fatal(err)
	}
	tx1, pid1 := begin(t, db)
	r1 := async(func() error { return pgcoordsql.XactLock(ctx, tx1, reversed...) })
	waitLocks(t, dsn, pid1, append(want("ExclusiveLock", "granted", keys[:2]...), want("ExclusiveLock", "waiting", keys[2])...))
	tx2, pid2 := begin(t, db)
	r2 := async(func() error { return pgcoordsql.XactLock(ctx, tx2, keys...) })
	waitLocks(t, dsn, pid2, want("ExclusiveLock", "waiting", keys[0]))

	if err := blocker.Rollback(); err != nil {
		t.Fatal(err)
	}
	if err := r1.get(t); err != nil {
		t.Fatalf("first transaction: %v", err)
	}
	waitLocks(t, dsn, pid1, want("ExclusiveLock", "granted", keys...))
	if err := tx1.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := r2.get(t); err != nil {
		t.Fatalf("second transaction: %v", err)
	}
	waitLocks(t, dsn, pid2, want("ExclusiveLock", "granted", keys...))
	if err := tx2.Commit(); err != nil {
		t.Fatal(err)
	}

	// Concurrently: 4 goroutines, 25 transactions each, alternating orders.
	var wg sync.WaitGroup
	errs := make(chan error, 100)
	for g := range 4 {
		wg.Go(func() {
			for i := range 25 {
				ks := keys
				if (g+i)%2 == 1 {
					ks = reversed
				}
				cctx, cancel := context.WithTimeout(ctx, waitLimit)
				err := pgcoordsql.InTx(cctx, db, ks, func(tx *sql.Tx) error {
					_, err := tx.ExecContext(cctx, "SELECT 1")
					return err
				})
				cancel()
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("InTx with keys in opposite orders: %v (deadlock: %t)", err, errors.Is(err, pgcoord.ErrDeadlock))
	}
}

// TestXactTryLocked: XactTryLock and XactTryRLock return ErrLocked, naming
// the key, while another transaction holds it exclusively; the keys before
// it in canonical order stay held (partial success) and the ones after it
// are not taken, and the transaction still works.
func TestXactTryLocked(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	db := openDB(t, dsn)
	k1, k2, k3 := pgcoord.Int64Key(1), pgcoord.Int64Key(2), pgcoord.PairKey(0, 3)
	holder, _ := begin(t, db)
	if err := pgcoordsql.XactLock(ctx, holder, k2); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name string
		try  func(context.Context, *sql.Tx, ...pgcoord.Key) error
		mode string
	}{
		{"XactTryLock", pgcoordsql.XactTryLock, "ExclusiveLock"},
		{"XactTryRLock", pgcoordsql.XactTryRLock, "ShareLock"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tx, pid := begin(t, db)
			err := tc.try(ctx, tx, k3, k2, k1)
			if !errors.Is(err, pgcoord.ErrLocked) || !strings.Contains(err.Error(), "holder: "+k2.String()+" ") {
				t.Fatalf("got %v, want ErrLocked naming %v", err, k2)
			}
			waitLocks(t, dsn, pid, want(tc.mode, "granted", k1))
			var one int
			if err := tx.QueryRowContext(ctx, "SELECT 1").Scan(&one); err != nil {
				t.Fatalf("the transaction is not aborted by a failed try, but: %v", err)
			}
			if err := tx.Rollback(); err != nil {
				t.Fatal(err)
			}
			waitLocks(t, dsn, pid, nil)
		})
	}
}

// TestXactSharedVsExclusive: shared holders coexist and keep exclusive
// tries out; once they end, an exclusive try succeeds and keeps shared
// tries out.
func TestXactSharedVsExclusive(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	db := openDB(t, dsn)
	k := pgcoord.HashKey("shared")
	r1, pid1 := begin(t, db)
	r2, pid2 := begin(t, db)
	if err := pgcoordsql.XactRLock(ctx, r1, k); err != nil {
		t.Fatal(err)
	}
	if err := pgcoordsql.XactTryRLock(ctx, r2, k); err != nil {
		t.Fatalf("second shared holder: %v", err)
	}
	waitLocks(t, dsn, pid1, want("ShareLock", "granted", k))
	waitLocks(t, dsn, pid2, want("ShareLock", "granted", k))

	w, pidW := begin(t, db)
	if err := pgcoordsql.XactTryLock(ctx, w, k); !errors.Is(err, pgcoord.ErrLocked) {
		t.Fatalf("exclusive try while shared holders exist: got %v, want ErrLocked", err)
	}
	if err := r1.Rollback(); err != nil {
		t.Fatal(err)
	}
	if err := r2.Rollback(); err != nil {
		t.Fatal(err)
	}
	if err := pgcoordsql.XactTryLock(ctx, w, k); err != nil {
		t.Fatalf("exclusive try after the shared holders ended: %v", err)
	}
	waitLocks(t, dsn, pidW, want("ExclusiveLock", "granted", k))
	r3, _ := begin(t, db)
	if err := pgcoordsql.XactTryRLock(ctx, r3, k); !errors.Is(err, pgcoord.ErrLocked) {
		t.Fatalf("shared try while held exclusively: got %v, want ErrLocked", err)
	}
}

// TestXactCancelledWait: a wait that ends because ctx is done (cancelled,
// or past its deadline) returns the context's error; every key of the
// transaction, including the one taken before the awaited one, is released;
// the transaction is unusable; and after Rollback the *sql.DB has dropped
// the connection (pgx closed it) and has none in use.
func TestXactCancelledWait(t *testing.T) {
	ctx := t.Context()
	for _, deadline := range []bool{false, true} {
		name := "cancel"
		if deadline {
			name = "deadline"
		}
		t.Run(name, func(t *testing.T) {
			dsn := pgtest.DB(t)
			db := openDB(t, dsn)
			k1, k2 := pgcoord.Int64Key(1), pgcoord.Int64Key(2)
			holder, _ := begin(t, db)
			if err := pgcoordsql.XactLock(ctx, holder, k2); err != nil {
				t.Fatal(err)
			}
			waiting := append(want("ExclusiveLock", "granted", k1), want("ExclusiveLock", "waiting", k2)...)

			var tx *sql.Tx
			var pid int32
			var err error
			if deadline {
				// The deadline must pass while the statement waits: if the
				// call returns before pg_locks showed the wait, the machine
				// was too slow for that deadline; try a longer one.
				for d := 500 * time.Millisecond; ; d *= 4 {
					tx, pid = begin(t, db)
					cctx, cancel := context.WithTimeout(ctx, d)
					r := async(func() error { return pgcoordsql.XactLock(cctx, tx, k1, k2) })
					sawWait := false
					for !sawWait && len(r) == 0 {
						sawWait = slices.Equal(locksOf(t, dsn, pid), waiting)
					}
					err = r.get(t)
					cancel()
					if sawWait {
						break
					}
					if d > 10*time.Second {
						t.Fatalf("XactLock returned %v before its wait showed in pg_locks, with deadlines up to %v", err, d)
					}
					_ = tx.Rollback()
				}
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Fatalf("got %v, want an error wrapping context.DeadlineExceeded", err)
				}
			} else {
				tx, pid = begin(t, db)
				cctx, cancel := context.WithCancel(ctx)
				r := async(func() error { return pgcoordsql.XactLock(cctx, tx, k1, k2) })
				waitLocks(t, dsn, pid, waiting)
				cancel()
				if err = r.get(t); !errors.Is(err, context.Canceled) {
					t.Fatalf("got %v, want an error wrapping context.Canceled", err)
				}
			}
			t.Logf("XactLock: %v", err)
			waitLocks(t, dsn, pid, nil)
			if _, err := tx.ExecContext(ctx, "SELECT 1"); err == nil {
				t.Fatal("the transaction still runs statements after the cancelled wait")
			}
			_ = tx.Rollback() // fails: the connection is closed
			if err := holder.Rollback(); err != nil {
				t.Fatal(err)
			}
			idle(t, db)
			gone(t, db, pid)

			// The keys are free for others, and the *sql.DB works.
			if err := pgcoordsql.InTx(ctx, db, []pgcoord.Key{k1, k2}, func(*sql.Tx) error { return nil }); err != nil {
				t.Fatalf("InTx after the cancelled wait: %v", err)
			}
		})
	}
}

// TestXactDoneBeforeSend: a ctx done before the call sends nothing: the
// transaction keeps the keys it holds and still works.
func TestXactDoneBeforeSend(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	db := openDB(t, dsn)
	tx, pid := begin(t, db)
	k1, k2 := pgcoord.Int64Key(1), pgcoord.Int64Key(2)
	if err := pgcoordsql.XactLock(ctx, tx, k1); err != nil {
		t.Fatal(err)
	}
	done, cancel := context.WithCancel(ctx)
	cancel()
	if err := pgcoordsql.XactLock(done, tx, k2); !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want context.Canceled", err)
	}
	waitLocks(t, dsn, pid, want("ExclusiveLock", "granted", k1))
	if err := tx.Commit(); err != nil {
		t.Fatalf("the transaction was aborted by a call that sent nothing: %v", err)
	}
}

// TestXactBadInput: bad input is reported before anything is sent.
func TestXactBadInput(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	db := openDB(t, dsn)
	tx, pid := begin(t, db)
	for _, keys := range [][]pgcoord.Key{nil, {pgcoord.Int64Key(1), {}}, {pgcoord.HashKey()}} {
		if err := pgcoordsql.XactLock(ctx, tx, keys...); !errors.Is(err, pgcoord.ErrInvalidKey) {
			t.Errorf("XactLock(%v): got %v, want ErrInvalidKey", keys, err)
		}
	}
	if err := pgcoordsql.XactTryLock(ctx, nil, pgcoord.Int64Key(1)); err == nil || !strings.Contains(err.Error(), "nil *sql.Tx") {
		t.Errorf("XactTryLock(nil tx): got %v, want an error about the nil *sql.Tx", err)
	}
	var nilCtx context.Context
	for name, f := range map[string]func(context.Context, *sql.Tx, ...pgcoord.Key) error{
		"xact lock": pgcoordsql.XactLock, "xact read lock": pgcoordsql.XactRLock,
		"xact try lock": pgcoordsql.XactTryLock, "xact try read lock": pgcoordsql.XactTryRLock,
	} {
		if err := noPanic(t, name+"(nil ctx)", func() error { return f(nilCtx, tx, pgcoord.Int64Key(1)) }); err == nil || err.Error() != "pgcoord: "+name+" int64:1: ctx is nil" {
			t.Errorf("%s(nil ctx): got %v", name, err)
		}
	}
	if err := noPanic(t, "CheckFence(nil ctx)", func() error { return pgcoordsql.CheckFence(nilCtx, tx, pgcoord.Int64Key(1), 1) }); err == nil || err.Error() != "pgcoord: check fence int64:1: ctx is nil" {
		t.Errorf("CheckFence(nil ctx): got %v", err)
	}
	if got := locksOf(t, dsn, pid); len(got) != 0 {
		t.Errorf("locks after bad input: %q", got)
	}
	if err := tx.Commit(); err != nil {
		t.Fatalf("bad input aborted the transaction: %v", err)
	}
}

// errorShape is the one shape of pgcoord's errors (see package pgcoord's
// documentation): "pgcoord: <operation> <subject>: <cause>", on one line.
var errorShape = regexp.MustCompile(`^pgcoord: [a-z][a-z ]* (\S+|\[[^]]+\]|(election|semaphore) "[^"]*"): \S.*$`)

// TestErrorShapeXact: every kind of error of XactLock, XactRLock,
// XactTryLock, XactTryRLock, InTx, InTxOptions and CheckFence on a *sql.Tx
// reads "pgcoord: <operation> <subject>: <cause>" on one line, names the
// keys, and still wraps its sentinel.
func TestErrorShapeXact(t *testing.T) {
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
	k1, k2, k3 := pgcoord.Int64Key(1), pgcoord.Int64Key(2), pgcoord.Int64Key(3)
	var (
		nilCtx context.Context
		nilTx  *sql.Tx
		nilDB  *sql.DB
	)
	tx := func(t *testing.T) *sql.Tx { t.Helper(); tx, _ := begin(t, db); return tx }
	heldElsewhere := func(t *testing.T, keys ...pgcoord.Key) {
		t.Helper()
		if err := pgcoordsql.XactLock(ctx, tx(t), keys...); err != nil {
			t.Fatal(err)
		}
	}
	ok := func(*sql.Tx) error { return nil }
	cases := []struct {
		name   string
		run    func(t *testing.T) error
		is     error
		prefix string
	}{
		{"XactLock nil tx", func(*testing.T) error { return pgcoordsql.XactLock(ctx, nilTx, k2, k1) },
			nil, "pgcoord: xact lock [int64:1 int64:2]: nil *sql.Tx"},
		{"XactRLock nil ctx", func(t *testing.T) error { return pgcoordsql.XactRLock(nilCtx, tx(t), k1) },
			nil, "pgcoord: xact read lock int64:1: ctx is nil"},
		{"XactLock no keys", func(t *testing.T) error { return pgcoordsql.XactLock(ctx, tx(t)) },
			pgcoord.ErrInvalidKey, "pgcoord: xact lock []: invalid key"},
		{"XactLock zero key", func(t *testing.T) error { return pgcoordsql.XactLock(ctx, tx(t), k1, pgcoord.Key{}) },
			pgcoord.ErrInvalidKey, "pgcoord: xact lock [int64:1 "},
		{"XactTryLock held elsewhere", func(t *testing.T) error { heldElsewhere(t, k1); return pgcoordsql.XactTryLock(ctx, tx(t), k1) },
			pgcoord.ErrLocked, "pgcoord: xact try lock int64:1: key is locked by another holder"},
		{"XactTryRLock partial", func(t *testing.T) error { heldElsewhere(t, k2); return pgcoordsql.XactTryRLock(ctx, tx(t), k3, k2, k1) },
			pgcoord.ErrLocked, "pgcoord: xact try read lock [int64:1 int64:2 int64:3]: key is locked by another holder: int64:2 (the 1 key(s) before it"},
		{"XactLock in a failed transaction", func(t *testing.T) error {
			tx := tx(t)
			_, _ = tx.ExecContext(ctx, "SELECT 1/0")
			return pgcoordsql.XactLock(ctx, tx, k1)
		}, nil, "pgcoord: xact lock int64:1: ERROR: current transaction is aborted"},
		{"XactLock wait cut by a deadline", func(t *testing.T) error {
			heldElsewhere(t, k1)
			tx := tx(t)
			c, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			defer cancel()
			return pgcoordsql.XactLock(c, tx, k1)
		}, context.DeadlineExceeded, "pgcoord: xact lock int64:1: "},
		{"InTx nil db", func(*testing.T) error { return pgcoordsql.InTx(ctx, nilDB, []pgcoord.Key{k1}, ok) },
			nil, "pgcoord: in tx int64:1: nil TxBeginner"},
		{"InTxOptions nil fn", func(*testing.T) error { return pgcoordsql.InTxOptions(ctx, db, nil, []pgcoord.Key{k1}, nil) },
			nil, "pgcoord: in tx int64:1: fn is nil"},
		{"InTx nil ctx", func(*testing.T) error { return pgcoordsql.InTx(nilCtx, db, nil, ok) },
			nil, "pgcoord: in tx []: ctx is nil"},
		{"InTx lock wait cut by a deadline", func(t *testing.T) error {
			heldElsewhere(t, k1)
			c, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			defer cancel()
			return pgcoordsql.InTx(c, db, []pgcoord.Key{k1}, ok)
		}, context.DeadlineExceeded, "pgcoord: in tx int64:1: "},
		{"InTx commit after an ignored statement error", func(*testing.T) error {
			return pgcoordsql.InTx(ctx, db, []pgcoord.Key{k1}, func(tx *sql.Tx) error {
				_, _ = tx.ExecContext(ctx, "SELECT 1/0")
				return nil
			})
		}, nil, "pgcoord: in tx int64:1: commit: "},
		{"CheckFence nil tx", func(*testing.T) error { return pgcoordsql.CheckFence(ctx, nilTx, k1, 1) },
			nil, "pgcoord: check fence int64:1: nil *sql.Tx"},
		{"CheckFence fence 0", func(t *testing.T) error { return pgcoordsql.CheckFence(ctx, tx(t), k1, 0) },
			nil, "pgcoord: check fence int64:1: fence 0 is not a fence"},
		{"CheckFence stale", func(t *testing.T) error {
			old := fencedLock(t, c, k3)
			newer := fencedLock(t, c, k3)
			if newer != old+1 {
				t.Fatalf("fences %d then %d", old, newer)
			}
			return pgcoordsql.CheckFence(ctx, tx(t), k3, old)
		}, pgcoord.ErrStaleFence, "pgcoord: check fence int64:3: stale fence: a newer holder exists (fence 1, latest 2)"},
		{"CheckFence not migrated", func(t *testing.T) error {
			return pgcoordsql.CheckFence(ctx, tx(t), k1, 1, pgcoord.WithSchema("elsewhere"))
		}, pgcoord.ErrNotMigrated, "pgcoord: check fence int64:1: "},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := noPanic(t, c.name, func() error { return c.run(t) })
			switch {
			case err == nil:
				t.Fatal("no error")
			case strings.Contains(err.Error(), "\n"):
				t.Errorf("%q: more than one line", err)
			case !errorShape.MatchString(err.Error()):
				t.Errorf("%q does not match %s", err, errorShape)
			case !strings.HasPrefix(err.Error(), c.prefix):
				t.Errorf("%q: want it to start with %q", err, c.prefix)
			case c.is != nil && !errors.Is(err, c.is):
				t.Errorf("%q: does not wrap %v", err, c.is)
			}
			t.Logf("%v", err)
		})
	}
}
