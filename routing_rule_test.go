package pgcoord

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// The routing rule (backends.go) promises that no statement of a Client
// waits for a lock held elsewhere on a backend that holds other
// goroutines' keys, so that the server never sees a cycle of waits that
// the application does not have. The tests below hold a key X on a
// Client's only shared backend, have a transaction of the application
// hold a row that one of the Client's statements needs and then wait for
// X, and check that nobody is told of a deadlock: in the application,
// X's holder waits for nothing, so there is no cycle, and once X is
// released everything goes through.

// deadlockFree waits, bounded, while the given results are pending, for
// many times deadlock_timeout (the server looks for a cycle once a wait
// has lasted that long), and fails the test if one of them arrives
// meanwhile: nothing may end while X is held.
func deadlockFree(t *testing.T, dl time.Duration, pending map[string]<-chan error) {
	t.Helper()
	quiet := time.NewTimer(20 * dl)
	defer quiet.Stop()
	for {
		var ended []string
		for what, ch := range pending {
			select {
			case err := <-ch:
				ended = append(ended, fmt.Sprintf("%s returned %v", what, err))
			default:
			}
		}
		if len(ended) > 0 {
			t.Fatalf("while the key is held (no deadlock in the application, so everything must wait on): %s", strings.Join(ended, "; "))
		}
		select {
		case <-quiet.C:
			return
		case <-time.After(dl / 2):
		}
	}
}

// A new leader's statement that issues its term waits for the fences row
// of the election's key while a transaction that checked the previous term
// is open. It runs on the backend that holds the election's lock, which
// may hold other goroutines' keys (the lock was taken by a try on a shared
// backend). If that transaction then waits for one of those keys, the
// server sees a cycle (the shared backend waits for the transaction, the
// transaction for the shared backend) that the application does not have:
// the key's holder waits for nothing. Neither the transaction nor the
// campaign may be told of a deadlock.
func TestElectionTermWaitNoSpuriousDeadlock(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	dl := setDeadlockTimeout(t, dsn, 100*time.Millisecond)
	c := newTestClient(t, dsn, WithSharedBackends(1))
	e := c.Election("routing-term-wait")
	x := Int64Key(7301)

	// A first term, so that a transaction can check it.
	ld, err := e.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	first := ld.Term()
	if err := ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}

	// X on the Client's one shared backend.
	held, err := c.TryLock(ctx, x)
	if err != nil {
		t.Fatal(err)
	}
	shared := held.s.PID()
	if st := c.Stat(); st.Backends != 1 {
		t.Fatalf("Stat: %+v, want one backend", st)
	}

	// The application's transaction checks the first term (the fences row
	// stays share-locked) and then waits for X.
	txConn := pgtest.Conn(t, dsn)
	tx, err := txConn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if err := c.CheckFence(ctx, tx, e.Key(), first); err != nil {
		t.Fatalf("CheckFence of the first term: %v", err)
	}
	txLocked := make(chan error, 1)
	go func() { txLocked <- XactLock(ctx, tx, x) }()
	pgtest.Eventually(t, testTimeout, "the transaction to wait for X", func() bool {
		return waitingOn(t, dsn, x) == 1
	})

	// A campaign wins the election's lock and issues its term.
	type campaign struct {
		ld  *Leadership
		err error
	}
	won := make(chan campaign, 1)
	campaigned := make(chan error, 1)
	go func() {
		ld, err := e.Campaign(ctx)
		won <- campaign{ld, err}
		campaigned <- err
	}()
	watch := pgtest.Conn(t, dsn)
	pgtest.Eventually(t, testTimeout, "the new term to wait for the checked fence", func() bool {
		var n int
		err := watch.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE NOT l.granted AND l.locktype IN ('transactionid', 'tuple') AND a.query LIKE '%leaders%'`).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		select {
		case r := <-won:
			t.Fatalf("Campaign returned (%v, %v) while a transaction that checked the last term is open", r.ld, r.err)
		default:
		}
		return n > 0
	})
	if backendWaitsOnRow(t, watch, shared) {
		t.Logf("pg_locks: backend %d, which holds %v, waits for the fences row", shared, x)
	}

	deadlockFree(t, dl, map[string]<-chan error{
		"the transaction's XactLock of X": txLocked,
		"Campaign":                        campaigned,
	})

	mustUnlock(t, held)
	if err := <-txLocked; err != nil {
		t.Fatalf("the transaction's XactLock of X: %v, want X once its holder let it go", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var r campaign
	select {
	case r = <-won:
	case <-time.After(testTimeout):
		t.Fatal("Campaign did not return")
	}
	if r.err != nil {
		t.Fatalf("Campaign: %v, want a new term once the transaction ended", r.err)
	}
	if r.ld.Term() <= first {
		t.Fatalf("new term %d, want more than %d", r.ld.Term(), first)
	}
	if err := r.ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
}

// A semaphore's grant locks the semaphore's row, which a transaction that
// changes the limit with SQL (as the documentation of SetLimit allows)
// keeps locked until it ends. The grant runs on a shared backend, which
// may hold other goroutines' keys; if the transaction then waits for one
// of those keys, the server sees a cycle that the application does not
// have: the key's holder waits for nothing. Neither the transaction nor
// the acquire may be told of a deadlock, for TryAcquire and Acquire alike.
func TestSemaphoreGrantRowWaitNoSpuriousDeadlock(t *testing.T) {
	t.Parallel()
	for _, try := range []bool{true, false} {
		name := "Acquire"
		if try {
			name = "TryAcquire"
		}
		t.Run(name, func(t *testing.T) {
			ctx := testCtx(t)
			dsn, _ := semaphoreDB(t)
			dl := setDeadlockTimeout(t, dsn, 100*time.Millisecond)
			// A long wait slice, so that the grant waits for the row
			// past every step of the test.
			c := newTestClient(t, dsn, WithSharedBackends(1), WithLossDeadline(20*time.Second))
			sem := c.Semaphore("routing-grant-row", 1)
			x := Int64Key(7302)

			mustRelease(t, mustAcquire(t, sem, true)) // the row exists
			held, err := c.TryLock(ctx, x)
			if err != nil {
				t.Fatal(err)
			}
			shared := held.s.PID()
			if st := c.Stat(); st.Backends != 1 {
				t.Fatalf("Stat: %+v, want one backend", st)
			}

			// The application raises the limit with SQL, and, in the same
			// transaction, waits for X.
			txConn := pgtest.Conn(t, dsn)
			tx, err := txConn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(context.Background()) }()
			if _, err := tx.Exec(ctx, `UPDATE pgcoord.semaphores SET "limit" = 2 WHERE name = $1`, sem.Name()); err != nil {
				t.Fatal(err)
			}
			txLocked := make(chan error, 1)
			go func() { txLocked <- XactLock(ctx, tx, x) }()
			pgtest.Eventually(t, testTimeout, "the transaction to wait for X", func() bool {
				return waitingOn(t, dsn, x) == 1
			})

			granted := make(chan permitResult, 1)
			acquired := make(chan error, 1)
			go func() {
				acquire := sem.Acquire
				if try {
					acquire = sem.TryAcquire
				}
				p, err := acquire(ctx)
				granted <- permitResult{p, err}
				acquired <- err
			}()
			watch := pgtest.Conn(t, dsn)
			pgtest.Eventually(t, testTimeout, "the grant to wait for the semaphore's row", func() bool {
				var n int
				err := watch.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
					WHERE NOT l.granted AND l.locktype IN ('transactionid', 'tuple') AND a.query LIKE '%semaphore_acquire%'`).Scan(&n)
				if err != nil {
					t.Fatal(err)
				}
				return n > 0
			})
			if backendWaitsOnRow(t, watch, shared) {
				t.Logf("pg_locks: backend %d, which holds %v, waits for the semaphore's row", shared, x)
			}

			deadlockFree(t, dl, map[string]<-chan error{
				"the transaction's XactLock of X": txLocked,
				name:                              acquired,
			})

			mustUnlock(t, held)
			if err := <-txLocked; err != nil {
				t.Fatalf("the transaction's XactLock of X: %v, want X once its holder let it go", err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			g := receivePermit(t, granted)
			if g.err != nil {
				t.Fatalf("%s: %v, want a permit once the transaction ended", name, g.err)
			}
			slots, _ := slotLocks(t, dsn, sem)
			if len(slots) != 1 {
				t.Fatalf("pg_locks: slots %v, want the one permit", slots)
			}
			mustRelease(t, g.p)
		})
	}
}
