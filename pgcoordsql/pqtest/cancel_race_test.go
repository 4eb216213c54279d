package pqtest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"github.com/pgcoord/pgcoord/pgcoordsql"
)

// waitingPID waits until some backend waits for key in pg_locks and
// returns its pid.
func waitingPID(t *testing.T, dsn string, key pgcoord.Key) int32 {
	t.Helper()
	var pid int32
	pgtest.Eventually(t, limit, "a backend to wait for "+key.String(), func() bool {
		for _, l := range pgtest.AdvisoryLocks(t, dsn) {
			k, err := pgcoord.KeyFromLock(l.ClassID, l.ObjID, l.ObjSubID)
			if err == nil && k == key && !l.Granted {
				pid = l.PID
				return true
			}
		}
		return false
	})
	return pid
}

// waitTxDone waits until backend pid can run nothing more of its
// transaction: it has left pg_stat_activity (the driver closed its
// connection, so the backend exited and its locks went first) or is idle
// outside a transaction (its commit or rollback completed). Until then a
// statement the driver sent may still run: pgx's stdlib, when ctx ends,
// returns and closes the connection without waiting for the server, which
// may not have read the statement yet; the statement then still runs and
// takes its keys, held until the backend reads that the connection is
// closed.
func waitTxDone(t *testing.T, observer *pgxpool.Pool, pid int32) {
	t.Helper()
	pgtest.Eventually(t, limit, fmt.Sprintf("backend %d to exit or be idle", pid), func() bool {
		var n int
		err := observer.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE pid = $1 AND state IS DISTINCT FROM 'idle'`, pid).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
}

// TestCallsCancelRaceKeepPromise: ctx is cancelled at varying moments
// around XactRLock's and InTx's grant (as the exclusive holder rolls back),
// and around XactTryLock's, XactTryRLock's and CheckFence's statement (no
// wait), many times on each driver. Whenever a call returns nil, what it
// promises holds at that moment, read from another connection: the
// transaction's backend holds the key in pg_locks in the call's mode
// (another transaction's XactTryLock gets ErrLocked), or, for CheckFence,
// the fence's row is locked (another transaction's FOR UPDATE NOWAIT
// fails), or, for InTx, fn ran with the key held; and the transaction then
// commits. Otherwise the error wraps context.Canceled (CheckFence: is not
// nil), and after the rollback, once the transaction's backend has exited
// or is idle (waitTxDone), nothing is left in pg_locks and no connection
// is in use. pg_locks is read only then: pgx's stdlib can return before
// the server has read the statement, which then still takes the key on a
// backend that exits moments later, so a read right after the rollback
// could find nothing held and miss it.
func TestCallsCancelRaceKeepPromise(t *testing.T) {
	const iterations = 64
	key := pgcoord.HashKey("cancel-race")
	type call struct {
		name   string
		wait   bool   // waits for an exclusive holder
		mode   string // the lock's mode in pg_locks, "" for CheckFence
		run    func(ctx context.Context, db *sql.DB, tx *sql.Tx, fence pgcoord.Term, sawHeld func(*sql.Tx) bool) error
		inTx   bool
		fenced bool
	}
	calls := []call{
		{name: "XactRLock", wait: true, mode: "ShareLock", run: func(ctx context.Context, _ *sql.DB, tx *sql.Tx, _ pgcoord.Term, _ func(*sql.Tx) bool) error {
			return pgcoordsql.XactRLock(ctx, tx, key)
		}},
		{name: "InTx", wait: true, mode: "ExclusiveLock", inTx: true, run: func(ctx context.Context, db *sql.DB, _ *sql.Tx, _ pgcoord.Term, sawHeld func(*sql.Tx) bool) error {
			return pgcoordsql.InTx(ctx, db, []pgcoord.Key{key}, func(tx *sql.Tx) error {
				if !sawHeld(tx) {
					// database/sql rolls the transaction back as soon as
					// ctx ends, even while fn runs: that alone may take
					// the key away.
					if err := ctx.Err(); err != nil {
						return fmt.Errorf("fn ran after ctx ended: %w", err)
					}
					return errors.New("fn ran without the key held")
				}
				return nil
			})
		}},
		{name: "XactTryLock", mode: "ExclusiveLock", run: func(ctx context.Context, _ *sql.DB, tx *sql.Tx, _ pgcoord.Term, _ func(*sql.Tx) bool) error {
			return pgcoordsql.XactTryLock(ctx, tx, key)
		}},
		{name: "XactTryRLock", mode: "ShareLock", run: func(ctx context.Context, _ *sql.DB, tx *sql.Tx, _ pgcoord.Term, _ func(*sql.Tx) bool) error {
			return pgcoordsql.XactTryRLock(ctx, tx, key)
		}},
		{name: "CheckFence", fenced: true, run: func(ctx context.Context, _ *sql.DB, tx *sql.Tx, fence pgcoord.Term, _ func(*sql.Tx) bool) error {
			return pgcoordsql.CheckFence(ctx, tx, key, fence)
		}},
	}
	for _, driver := range drivers {
		t.Run(driver, func(t *testing.T) {
			ctx := t.Context()
			dsn := pgtest.DB(t)
			fence := issueFence(t, dsn, key)
			observer := pgtest.Pool(t, dsn)
			db, err := sql.Open(driver, dsn)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			// heldBy reports whether backend pid holds key granted in mode.
			heldBy := func(pid int32, mode string) bool {
				got := locks(t, dsn, pid)
				return len(got) == 1 && got[0] == key.String()+" "+mode+" true"
			}
			for _, c := range calls {
				t.Run(c.name, func(t *testing.T) {
					outcomes := map[string]int{}
					for i := range iterations {
						var holder, tx *sql.Tx
						var pid int32
						if c.wait {
							holder, _ = begin(t, db)
							if err := pgcoordsql.XactLock(ctx, holder, key); err != nil {
								t.Fatal(err)
							}
						}
						if !c.inTx {
							tx, pid = begin(t, db)
						}
						fnHeld, fnPID := false, int32(0)
						sawHeld := func(tx *sql.Tx) bool {
							var p int32
							if err := tx.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&p); err != nil {
								return false
							}
							fnPID = p
							fnHeld = heldBy(p, c.mode)
							return fnHeld
						}
						cctx, cancel := context.WithCancel(ctx)
						r := async(func() error { return c.run(cctx, db, tx, fence, sawHeld) })
						if c.wait {
							waiter := waitingPID(t, dsn, key)
							if !c.inTx && waiter != pid {
								t.Fatalf("iteration %d: backend %d waits, want %d", i, waiter, pid)
							}
							pid = waiter
						}
						// Vary the moment of the cancel around the grant or
						// the statement.
						var wg sync.WaitGroup
						wg.Go(func() {
							// A spin, not a wait for state: 0 to 1.5 ms.
							delay := time.Duration(i%16) * 100 * time.Microsecond
							for start := time.Now(); time.Since(start) < delay; {
								runtime.Gosched()
							}
							cancel()
						})
						if holder != nil {
							wg.Go(func() { _ = holder.Rollback() })
						}
						wg.Wait()
						err := get(t, r)
						switch {
						case err == nil && c.inTx:
							outcomes["nil"]++
							if !fnHeld || fnPID != pid {
								t.Fatalf("iteration %d: InTx returned nil, but fn did not see backend %d (the waiter, %d) hold %v", i, fnPID, pid, key)
							}
						case err == nil && c.fenced:
							outcomes["nil"]++
							if _, perr := observer.Exec(ctx, "SELECT FROM "+pgcoord.DefaultSchema+".fences FOR UPDATE NOWAIT"); perr == nil {
								t.Fatalf("iteration %d: CheckFence returned nil, but the fence's row is not locked", i)
							}
							if err := tx.Commit(); err != nil {
								t.Fatalf("iteration %d: CheckFence returned nil, then Commit: %v", i, err)
							}
						case err == nil:
							outcomes["nil"]++
							if !heldBy(pid, c.mode) {
								t.Fatalf("iteration %d: %s returned nil, but backend %d holds %q", i, c.name, pid, locks(t, dsn, pid))
							}
							other, _ := begin(t, db)
							if err := pgcoordsql.XactTryLock(ctx, other, key); !errors.Is(err, pgcoord.ErrLocked) {
								t.Fatalf("iteration %d: %s returned nil, but another transaction's XactTryLock got %v", i, c.name, err)
							}
							_ = other.Rollback()
							if err := tx.Commit(); err != nil {
								t.Fatalf("iteration %d: %s returned nil, then Commit: %v", i, c.name, err)
							}
						case errors.Is(err, context.Canceled):
							outcomes["cancelled"]++
							if tx != nil {
								_ = tx.Rollback()
							}
						case c.fenced && err != nil && cctx.Err() != nil:
							// CheckFence makes no promise about the error's
							// chain when ctx ends before its statement is
							// sent: the driver may answer driver.ErrBadConn.
							outcomes["failed as ctx ended"]++
							_ = tx.Rollback()
						default:
							t.Fatalf("iteration %d: %s got %v, want nil or an error wrapping context.Canceled", i, c.name, err)
						}
						if pid != 0 {
							waitTxDone(t, observer, pid)
							if got := locks(t, dsn, pid); len(got) != 0 {
								t.Fatalf("iteration %d: %s got %v; backend %d is done with its transaction, but holds %q", i, c.name, err, pid, got)
							}
						}
						pgtest.Eventually(t, limit, "no connection in use", func() bool { return db.Stats().InUse == 0 })
					}
					t.Logf("%s %s, %d iterations: %v", driver, c.name, iterations, outcomes)
				})
			}
		})
	}
}
