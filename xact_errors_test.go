package pgcoord

import (
	"context"
	"errors"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// errorShape is the one shape of pgcoord's errors (see the package
// documentation): "pgcoord: <operation> <subject>: <cause>", on one line.
var errorShape = regexp.MustCompile(`^pgcoord: [a-z][a-z ]* (\S+|\[[^]]+\]|(election|semaphore) "[^"]*"): \S.*$`)

// xactErrorCase provokes one kind of error of the transaction-level
// functions against a real server.
type xactErrorCase struct {
	name   string
	run    func(t *testing.T) error
	is     error  // the error must wrap this, when set
	prefix string // the message must start with this
}

// TestErrorShapeXact: every kind of error that XactLock, XactRLock,
// XactTryLock, XactTryRLock, InTx, InTxOptions and CheckFence return reads
// "pgcoord: <operation> <subject>: <cause>" on one line, names the keys,
// and still wraps its sentinel.
func TestErrorShapeXact(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := migratedPool(t, ctx, DefaultSchema)
	k1, k2, k3 := Int64Key(1), Int64Key(2), Int64Key(3)
	var nilCtx context.Context
	var nilPoolTx *pgxpool.Tx

	begin := func(t *testing.T) pgx.Tx { t.Helper(); return xactBegin(t, pool) }
	// heldElsewhere takes keys exclusively in a transaction that stays
	// open until the test ends.
	heldElsewhere := func(t *testing.T, keys ...Key) {
		t.Helper()
		if err := XactLock(ctx, begin(t), keys...); err != nil {
			t.Fatal(err)
		}
	}
	// fences issues n fences for k and returns the newest.
	fences := func(t *testing.T, k Key, n int) Term {
		t.Helper()
		var f int64
		for range n {
			f = mustNextFence(t, ctx, pool, mustFenceConfig(t), k)
		}
		return Term(f)
	}

	cases := []xactErrorCase{
		{name: "XactLock nil tx", prefix: "pgcoord: xact lock [int64:1 int64:2]: nil pgx.Tx",
			run: func(*testing.T) error { return XactLock(ctx, nil, k2, k1) }},
		{name: "XactRLock nil *pgxpool.Tx", prefix: "pgcoord: xact read lock int64:1: nil pgx.Tx",
			run: func(*testing.T) error { return XactRLock(ctx, nilPoolTx, k1) }},
		{name: "XactTryLock nil ctx", prefix: "pgcoord: xact try lock int64:1: ctx is nil",
			run: func(t *testing.T) error { return XactTryLock(nilCtx, begin(t), k1) }},
		{name: "XactTryRLock nil ctx", prefix: "pgcoord: xact try read lock int64:1: ctx is nil",
			run: func(t *testing.T) error { return XactTryRLock(nilCtx, begin(t), k1) }},
		{name: "XactLock no keys", is: ErrInvalidKey, prefix: "pgcoord: xact lock []: invalid key",
			run: func(t *testing.T) error { return XactLock(ctx, begin(t)) }},
		{name: "XactLock zero key", is: ErrInvalidKey, prefix: "pgcoord: xact lock " + core.KeyList(coreKeys([]Key{k1, {}})) + ": ",
			run: func(t *testing.T) error { return XactLock(ctx, begin(t), k1, Key{}) }},
		{name: "XactTryLock held elsewhere", is: ErrLocked, prefix: "pgcoord: xact try lock int64:1: key is locked by another holder",
			run: func(t *testing.T) error { heldElsewhere(t, k1); return XactTryLock(ctx, begin(t), k1) }},
		{name: "XactTryLock partial", is: ErrLocked, prefix: "pgcoord: xact try lock [int64:1 int64:2 int64:3]: key is locked by another holder: int64:2 (the 1 key(s) before it",
			run: func(t *testing.T) error { heldElsewhere(t, k2); return XactTryLock(ctx, begin(t), k3, k2, k1) }},
		{name: "XactTryRLock held elsewhere", is: ErrLocked, prefix: "pgcoord: xact try read lock [int64:1 int64:2]: key is locked by another holder: int64:1",
			run: func(t *testing.T) error { heldElsewhere(t, k1); return XactTryRLock(ctx, begin(t), k1, k2) }},
		{name: "XactLock in a failed transaction", prefix: "pgcoord: xact lock int64:1: ERROR: current transaction is aborted",
			run: func(t *testing.T) error {
				tx := begin(t)
				_, _ = tx.Exec(ctx, "SELECT 1/0")
				return XactLock(ctx, tx, k1)
			}},
		{name: "XactLock ctx done before send", is: context.Canceled, prefix: "pgcoord: xact lock int64:1: timeout: context already done: context canceled",
			run: func(t *testing.T) error {
				c, cancel := context.WithCancel(ctx)
				cancel()
				return XactLock(c, begin(t), k1)
			}},
		{name: "XactLock wait cut by a deadline", is: context.DeadlineExceeded, prefix: "pgcoord: xact lock int64:1: ",
			run: func(t *testing.T) error {
				heldElsewhere(t, k1)
				c, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
				defer cancel()
				return XactLock(c, begin(t), k1)
			}},
		{name: "XactRLock wait cancelled with a cause", is: context.Canceled, prefix: "pgcoord: xact read lock int64:1: shutting down: ",
			run: func(t *testing.T) error {
				heldElsewhere(t, k1)
				tx := begin(t)
				c, cancel := context.WithCancelCause(ctx)
				done := make(chan error, 1)
				go func() { done <- XactRLock(c, tx, k1) }()
				xactEventuallyHeld(t, dsn, xactPID(tx), k1.String()+" ShareLock waiting")
				cancel(errors.New("shutting down"))
				return xactRecv(t, done, "XactRLock")
			}},
		{name: "XactLock deadlock", is: ErrDeadlock, prefix: "pgcoord: xact lock int64:",
			run: func(t *testing.T) error {
				tx1, tx2 := begin(t), begin(t)
				if err := XactLock(ctx, tx1, k1); err != nil {
					t.Fatal(err)
				}
				if err := XactLock(ctx, tx2, k2); err != nil {
					t.Fatal(err)
				}
				done := make(chan error, 1)
				go func() { done <- XactLock(ctx, tx1, k2) }()
				xactEventuallyHeld(t, dsn, xactPID(tx1), xactEx(k1), xactWaitingEx(k2))
				err2 := XactLock(ctx, tx2, k1)
				err1 := xactRecv(t, done, "tx1's XactLock")
				if errors.Is(err1, ErrDeadlock) {
					return err1
				}
				return err2
			}},
		{name: "InTx nil db", prefix: "pgcoord: in tx int64:1: nil TxBeginner",
			run: func(*testing.T) error { return InTx(ctx, nil, []Key{k1}, func(pgx.Tx) error { return nil }) }},
		{name: "InTx nil fn", prefix: "pgcoord: in tx [int64:1 int64:2]: fn is nil",
			run: func(*testing.T) error { return InTx(ctx, pool, []Key{k2, k1, k2}, nil) }},
		{name: "InTx nil ctx", prefix: "pgcoord: in tx []: ctx is nil",
			run: func(*testing.T) error { return InTx(nilCtx, pool, nil, func(pgx.Tx) error { return nil }) }},
		{name: "InTx zero key", is: ErrInvalidKey, prefix: "pgcoord: in tx " + core.KeyList(coreKeys([]Key{{}})) + ": ",
			run: func(*testing.T) error { return InTx(ctx, pool, []Key{{}}, func(pgx.Tx) error { return nil }) }},
		{name: "InTxOptions nil db", prefix: "pgcoord: in tx int64:1: nil TxOptionsBeginner",
			run: func(*testing.T) error {
				return InTxOptions(ctx, nil, pgx.TxOptions{}, []Key{k1}, func(pgx.Tx) error { return nil })
			}},
		{name: "InTx begin in a failed transaction", prefix: "pgcoord: in tx int64:1: begin: ERROR: current transaction is aborted",
			run: func(t *testing.T) error {
				tx := begin(t)
				_, _ = tx.Exec(ctx, "SELECT 1/0")
				return InTx(ctx, tx, []Key{k1}, func(pgx.Tx) error { return nil })
			}},
		{name: "InTx lock wait cut by a deadline", is: context.DeadlineExceeded, prefix: "pgcoord: in tx int64:1: ",
			run: func(t *testing.T) error {
				heldElsewhere(t, k1)
				c, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
				defer cancel()
				return InTx(c, pool, []Key{k1}, func(pgx.Tx) error { return nil })
			}},
		{name: "InTx commit after an ignored statement error", is: pgx.ErrTxCommitRollback, prefix: "pgcoord: in tx int64:1: commit: ",
			run: func(*testing.T) error {
				return InTx(ctx, pool, []Key{k1}, func(tx pgx.Tx) error {
					_, _ = tx.Exec(ctx, "SELECT 1/0")
					return nil
				})
			}},
		{name: "nested InTx ctx ended before the savepoint's release", is: context.Canceled, prefix: "pgcoord: in tx int64:1: commit: ctx ended before the savepoint was released",
			run: func(t *testing.T) error {
				c, cancel := context.WithCancel(ctx)
				defer cancel()
				return InTx(c, begin(t), []Key{k1}, func(pgx.Tx) error { cancel(); return nil })
			}},
		{name: "CheckFence nil tx", prefix: "pgcoord: check fence int64:1: nil pgx.Tx",
			run: func(*testing.T) error { return CheckFence(ctx, nil, k1, 1) }},
		{name: "CheckFence nil ctx", prefix: "pgcoord: check fence int64:1: ctx is nil",
			run: func(t *testing.T) error { return CheckFence(nilCtx, begin(t), k1, 1) }},
		{name: "CheckFence zero key", is: ErrInvalidKey, prefix: "pgcoord: check fence " + core.KeyList(coreKeys([]Key{{}})) + ": ",
			run: func(t *testing.T) error { return CheckFence(ctx, begin(t), Key{}, 1) }},
		{name: "CheckFence fence 0", prefix: "pgcoord: check fence int64:1: fence 0 is not a fence",
			run: func(t *testing.T) error { return CheckFence(ctx, begin(t), k1, 0) }},
		{name: "CheckFence nil option", prefix: "pgcoord: check fence int64:1: ",
			run: func(t *testing.T) error { return CheckFence(ctx, begin(t), k1, 1, nil) }},
		{name: "CheckFence never issued, no fence", is: ErrStaleFence, prefix: `pgcoord: check fence int64:101: stale fence: fence 1 was never issued: no fence exists for the key in schema "pgcoord"`,
			run: func(t *testing.T) error { return CheckFence(ctx, begin(t), Int64Key(101), 1) }},
		{name: "CheckFence stale", is: ErrStaleFence, prefix: "pgcoord: check fence int64:102: stale fence: a newer holder exists (fence 1, latest 2)",
			run: func(t *testing.T) error {
				fences(t, Int64Key(102), 2)
				return CheckFence(ctx, begin(t), Int64Key(102), 1)
			}},
		{name: "CheckFence never issued, newer than the newest", is: ErrStaleFence, prefix: "pgcoord: check fence int64:103: stale fence: fence 5 was never issued (latest 1)",
			run: func(t *testing.T) error {
				fences(t, Int64Key(103), 1)
				return CheckFence(ctx, begin(t), Int64Key(103), 5)
			}},
		{name: "CheckFence not migrated", is: ErrNotMigrated, prefix: `pgcoord: check fence int64:1: tables missing; run pgcoord.Migrate first (schema "elsewhere"): `,
			run: func(t *testing.T) error { return CheckFence(ctx, begin(t), k1, 1, WithSchema("elsewhere")) }},
		{name: "CheckFence first fence after the snapshot", prefix: "pgcoord: check fence int64:104: fence 1 cannot be checked in this transaction: ",
			run: func(t *testing.T) error {
				tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = tx.Rollback(ctx) }()
				if _, err := tx.Exec(ctx, "SELECT 1"); err != nil { // takes the snapshot
					t.Fatal(err)
				}
				f := fences(t, Int64Key(104), 1)
				return CheckFence(ctx, tx, Int64Key(104), f)
			}},
		{name: "CheckFence in a read-only transaction", prefix: "pgcoord: check fence int64:105: ERROR: ",
			run: func(t *testing.T) error {
				f := fences(t, Int64Key(105), 1)
				tx, err := pool.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = tx.Rollback(ctx) }()
				return CheckFence(ctx, tx, Int64Key(105), f)
			}},
		{name: "CheckFence ctx done", is: context.Canceled, prefix: "pgcoord: check fence int64:1: timeout: context already done: context canceled",
			run: func(t *testing.T) error {
				c, cancel := context.WithCancel(ctx)
				cancel()
				return CheckFence(c, begin(t), k1, 1)
			}},
		{name: "XactLock lock table full", is: ErrTooManyLocks, prefix: "pgcoord: xact lock [int64:0 int64:1 int64:2 int64:3 and 4996 more]: out of shared memory for locks",
			run: func(t *testing.T) error {
				srv := pgtest.NewServer(t, pgtest.WithSetting("max_locks_per_transaction", "10"), pgtest.WithSetting("max_connections", "20"))
				p := pgtest.Pool(t, srv.DB(t))
				keys := make([]Key, 5000)
				for i := range keys {
					keys[i] = Int64Key(int64(i))
				}
				return InTx(ctx, p, nil, func(tx pgx.Tx) error { return XactLock(ctx, tx, keys...) })
			}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var err error
			func() {
				defer func() {
					if p := recover(); p != nil {
						t.Fatalf("panicked: %v", p)
					}
				}()
				err = c.run(t)
			}()
			xactCheckErrorShape(t, err, c.is, c.prefix)
			if err != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) &&
				strings.Contains(err.Error(), "canceling statement") {
				t.Errorf("%q: a caller's ctx ended the call, so the message must say so alone, not show the statement it cancelled", err)
			}
		})
	}
}

// xactCheckErrorShape checks that err has the one shape of pgcoord's
// errors, starts with prefix and wraps is (when set).
func xactCheckErrorShape(t *testing.T, err, is error, prefix string) {
	t.Helper()
	switch {
	case err == nil:
		t.Fatal("no error")
	case strings.Contains(err.Error(), "\n"):
		t.Errorf("%q: more than one line", err)
	case !errorShape.MatchString(err.Error()):
		t.Errorf("%q does not match %s", err, errorShape)
	case !strings.HasPrefix(err.Error(), prefix):
		t.Errorf("%q: want it to start with %q", err, prefix)
	case is != nil && !errors.Is(err, is):
		t.Errorf("%q: does not wrap %v", err, is)
	}
	t.Logf("%v", err)
}
