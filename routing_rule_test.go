package pgcoord

// Tests of the rule that keeps a Client's shared backends free of spurious
// deadlocks (backends.go): a fence, a term or a semaphore's grant never joins
// a row's queue on a backend that holds other keys, and a wait never takes a
// backend the rule reserves, so no goroutine sees ErrDeadlock unless its
// application has a lock cycle. Each test reads the outcome back from
// pg_locks.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
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

// xactLockAsync runs XactLock of k on tx in a goroutine and returns where
// its result arrives. When the test ends, the wait is cancelled and waited
// for before anything else uses tx's connection (register tx's rollback
// with t.Cleanup before calling it).
func xactLockAsync(t *testing.T, ctx context.Context, tx pgx.Tx, k Key) <-chan error {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	res := make(chan error, 1)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		res <- XactLock(ctx, tx, k)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-finished:
		case <-time.After(testTimeout):
			t.Error("XactLock did not return after its ctx ended")
		}
	})
	return res
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
	shared := held.core.S.PID()
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
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if err := c.CheckFence(ctx, tx, e.Key(), first); err != nil {
		t.Fatalf("CheckFence of the first term: %v", err)
	}
	txLocked := xactLockAsync(t, ctx, tx, x)
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
			WHERE NOT l.granted AND l.locktype IN ('transactionid', 'tuple') AND a.datname = current_database() AND a.query LIKE '%leaders%'`).Scan(&n)
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
			shared := held.core.S.PID()
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
			t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
			if _, err := tx.Exec(ctx, `UPDATE pgcoord.semaphores SET "limit" = 2 WHERE name = $1`, sem.Name()); err != nil {
				t.Fatal(err)
			}
			txLocked := xactLockAsync(t, ctx, tx, x)
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
					WHERE NOT l.granted AND l.locktype IN ('transactionid', 'tuple') AND a.datname = current_database() AND a.query LIKE '%semaphore_acquire%'`).Scan(&n)
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

// A WithFence acquire issues the key's fence on the backend that holds the
// key, waiting there at most a glance (20 ms) for a transaction that
// checked the key's previous fence, then elsewhere on a backend that holds
// nothing, and while none is free (WithMaxWaits waits run already), on the
// key's backend again at intervals. Keeping the glance below
// deadlock_timeout keeps the glancing backend's own deadlock check from
// running, but not the check of the transaction it waits for: if that
// transaction waits for another key of the glancing backend, its check
// finds the cycle whenever it runs during a glance. The application has
// no cycle (the key's holder waits for nothing): the transaction must not
// be told of a deadlock. Each of 30 attempts starts the transaction's wait
// as soon as pg_locks shows a backend waiting for the checked row (a
// glance, or a wait elsewhere), with the transaction's deadlock_timeout at
// its least, 1 ms, so that its check runs while that wait lasts. With the
// key held by another Client instead, the same attempts end in lock
// timeouts only.
func TestFenceGlanceNoSpuriousDeadlock(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	c := newTestClient(t, dsn, WithSharedBackends(1), WithMaxWaits(1))
	k, x, y := Int64Key(7303), Int64Key(7304), Int64Key(7305)

	// The key's first fence, which the transaction checks.
	l0, err := c.Lock(ctx, k, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	first := l0.Fence()
	mustUnlock(t, l0)

	held, err := c.TryLock(ctx, x)
	if err != nil {
		t.Fatal(err)
	}
	shared := held.core.S.PID()

	// The Client's one wait is taken: a Lock of y, which another
	// connection holds.
	other := pgtest.Conn(t, dsn)
	if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1)", y.coreKey().V); err != nil {
		t.Fatal(err)
	}
	waiter := goLock(func() (*Lock, error) { return c.Lock(ctx, y) })
	pgtest.Eventually(t, testTimeout, "the Lock of y to wait on the server", func() bool {
		return waitingOn(t, dsn, y) == 1 && c.Stat().Waits == 1
	})

	txConn := pgtest.Conn(t, dsn)
	if _, err := txConn.Exec(ctx, "SET deadlock_timeout = '1ms'"); err != nil {
		pgtest.SkipOrFail(t, "the transaction needs a deadlock_timeout of its own: %v", err)
	}
	tx, err := txConn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if err := c.CheckFence(ctx, tx, k, first); err != nil {
		t.Fatalf("CheckFence of the first fence: %v", err)
	}

	fenced := goLock(func() (*Lock, error) { return c.Lock(ctx, k, WithFence()) })
	watch := pgtest.Conn(t, dsn)
	txPID := txConn.PgConn().PID()
	// rowWait reports whether a backend other than the transaction's waits
	// for a row: the fence's wait for the checked fence, wherever it runs.
	rowWait := func() bool {
		var n int
		err := watch.QueryRow(ctx, `SELECT count(*) FROM pg_locks
			WHERE NOT granted AND locktype IN ('transactionid', 'tuple') AND pid <> $1
			  AND pid IN (SELECT pid FROM pg_stat_activity WHERE datname = current_database())`, txPID).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n > 0
	}
	const attempts = 30
	seen := 0
	for attempt := 1; attempt <= attempts; attempt++ {
		// Start the wait as a backend waits for the row, if one does
		// within a while.
		for until := time.Now().Add(150 * time.Millisecond); time.Now().Before(until); {
			if rowWait() {
				seen++
				break
			}
		}
		if _, err := tx.Exec(ctx, "SAVEPOINT attempt"); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = '30ms'"); err != nil {
			t.Fatal(err)
		}
		_, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", x.coreKey().V)
		switch core.SqlState(err) {
		case "55P03":
		case "40P01":
			t.Fatalf("attempt %d: the transaction's wait for %v, which backend %d holds, ended in a deadlock: %v; the application has no cycle (backend %d waits for a row: %v)",
				attempt, x, shared, err, shared, backendWaitsOnRow(t, watch, shared))
		default:
			t.Fatalf("attempt %d: the transaction's wait for %v: %v, want a lock timeout", attempt, x, err)
		}
		if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT attempt"); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("%d waits for %v, %d of them started while the fence waited for the checked row, without a deadlock", attempts, x, seen)
	stillWaiting(t, fenced)

	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := other.Exec(ctx, "SELECT pg_advisory_unlock($1)", y.coreKey().V); err != nil {
		t.Fatal(err)
	}
	w := receive(t, waiter)
	if w.err != nil {
		t.Fatalf("Lock of y: %v", w.err)
	}
	mustUnlock(t, w.l)
	r := receive(t, fenced)
	if r.err != nil {
		t.Fatalf("Lock WithFence: %v", r.err)
	}
	if r.l.Fence() <= first {
		t.Fatalf("fence %d, want more than %d", r.l.Fence(), first)
	}
	mustUnlock(t, r.l)
	mustUnlock(t, held)
}

// The head of a semaphore's queue asks for a permit on the backend that
// holds its queue key, since the grant releases that key. That backend may
// hold other goroutines' keys: with one shared backend, the queue key was
// taken there by a try, next to X. The head's grant then waits for the
// semaphore's row on it, which a transaction that changes the limit keeps
// locked; if that transaction waits for X, the server sees a cycle that
// the application does not have. Neither may be told of a deadlock, and
// once X is released the head gets the new permit.
func TestSemaphoreHeadGrantRowWaitNoSpuriousDeadlock(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	dl := setDeadlockTimeout(t, dsn, 100*time.Millisecond)
	c := newTestClient(t, dsn, WithSharedBackends(1), WithLossDeadline(20*time.Second))
	other := newTestClient(t, dsn)
	sem := c.Semaphore("routing-head-grant-row", 1)
	x := Int64Key(7306)

	full := mustAcquire(t, other.Semaphore(sem.Name(), 1), true)
	held, err := c.TryLock(ctx, x)
	if err != nil {
		t.Fatal(err)
	}
	shared := held.core.S.PID()

	granted := make(chan permitResult, 1)
	acquired := make(chan error, 1)
	go func() {
		p, err := sem.Acquire(ctx)
		granted <- permitResult{p, err}
		acquired <- err
	}()
	pgtest.Eventually(t, testTimeout, "the Acquire to head the queue on the shared backend", func() bool {
		g := grantedTo(t, dsn, keyOf(sem.queueKey()))
		return len(g) == 1 && g[0] == shared
	})

	txConn := pgtest.Conn(t, dsn)
	tx, err := txConn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if _, err := tx.Exec(ctx, `UPDATE pgcoord.semaphores SET "limit" = 2 WHERE name = $1`, sem.Name()); err != nil {
		t.Fatal(err)
	}
	txLocked := xactLockAsync(t, ctx, tx, x)
	pgtest.Eventually(t, testTimeout, "the transaction to wait for X", func() bool {
		return waitingOn(t, dsn, x) == 1
	})
	// The head looks again at least every semaphoreRecheck: its grant
	// then waits for the row, if it runs where it may wait. Wait for
	// that a while, bounded (a head that waits elsewhere, or not on the
	// server, is fine too).
	watch := pgtest.Conn(t, dsn)
	rowWait := false
	for until := time.Now().Add(10 * c.semaphoreRecheck); !rowWait && time.Now().Before(until); {
		var n int
		err := watch.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE NOT l.granted AND l.locktype IN ('transactionid', 'tuple') AND a.datname = current_database() AND a.query LIKE '%semaphore_acquire%'`).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		rowWait = n > 0
	}
	if rowWait && backendWaitsOnRow(t, watch, shared) {
		t.Logf("pg_locks: backend %d, which holds %v and the queue key, waits for the semaphore's row", shared, x)
	}

	deadlockFree(t, dl, map[string]<-chan error{
		"the transaction's XactLock of X": txLocked,
		"Acquire":                         acquired,
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
		t.Fatalf("Acquire: %v, want the permit the new limit frees", g.err)
	}
	slots, _ := slotLocks(t, dsn, sem)
	if len(slots) != 2 {
		t.Fatalf("pg_locks: slots %v, want two permits", slots)
	}
	mustRelease(t, g.p)
	mustRelease(t, full)
}

// A statement that waits on a backend lets the others that need the
// backend run first (backends.go: every blocking statement runs in slices
// that another statement interrupts; Unlock interrupts a blocking acquire
// on its connection rather than wait for it). A semaphore's grant waits
// for the semaphore's row while a transaction that changes the limit holds
// it, but never on a backend that holds other goroutines' keys: it waits
// on a backend of its own (pg_locks), and an Unlock of another goroutine's
// key returns while the grant still waits, with the key free on the
// server.
func TestUnlockDoesNotWaitBehindGrantRowWait(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	// A wait slice (the grant's lock_timeout) far longer than the test's
	// steps take on a loaded machine.
	c := newTestClient(t, dsn, WithSharedBackends(1), WithLossDeadline(20*time.Second))
	sem := c.Semaphore("routing-unlock-behind-grant", 1)
	x := Int64Key(7307)

	mustRelease(t, mustAcquire(t, sem, true)) // the row exists
	held, err := c.TryLock(ctx, x)
	if err != nil {
		t.Fatal(err)
	}
	shared := held.core.S.PID()

	txConn := pgtest.Conn(t, dsn)
	tx, err := txConn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if _, err := tx.Exec(ctx, `UPDATE pgcoord.semaphores SET "limit" = 2 WHERE name = $1`, sem.Name()); err != nil {
		t.Fatal(err)
	}

	granted := make(chan permitResult, 1)
	go func() {
		p, err := sem.TryAcquire(ctx)
		granted <- permitResult{p, err}
	}()
	watch := pgtest.Conn(t, dsn)
	grantWaits := func() bool {
		var n int
		err := watch.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE NOT l.granted AND l.locktype IN ('transactionid', 'tuple') AND a.datname = current_database() AND a.query LIKE '%semaphore_acquire%'`).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n > 0
	}
	pgtest.Eventually(t, testTimeout, "the grant to wait for the semaphore's row", grantWaits)
	if backendWaitsOnRow(t, watch, shared) {
		t.Fatalf("the grant waits for the row on backend %d, which holds %v", shared, x)
	}

	start := time.Now()
	mustUnlock(t, held)
	took := time.Since(start)
	if !grantWaits() {
		t.Fatalf("Unlock of %v returned after %v, once the grant on its backend had stopped waiting for the semaphore's row: it waited behind that grant instead of running first", x, took.Round(time.Millisecond))
	}
	notHeld(t, dsn, x)

	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	g := receivePermit(t, granted)
	if g.err != nil {
		t.Fatalf("TryAcquire: %v, want a permit once the transaction ended", g.err)
	}
	mustRelease(t, g.p)
}

// The head of a semaphore's queue of limit 1 waits for slot 0 on the
// backend that holds its queue key, and that wait counts as one of the
// Client's waits. With WithMaxWaits(1) it is the only one: a blocking Lock
// of a key held elsewhere then finds no backend to wait on and tries again
// instead (it never waits on a backend that holds a key), a TryLock runs
// on another backend than the head's, and both the Lock and the head get
// what they wait for once it is freed. Read back from pg_locks.
func TestQueueHeadAwaitTakesTheOnlyWait(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	c := newTestClient(t, dsn, WithMaxWaits(1))
	other := newTestClient(t, dsn)
	sem := c.Semaphore("routing-head-only-wait", 1)
	k, z := Int64Key(7308), Int64Key(7309)

	full := mustAcquire(t, other.Semaphore(sem.Name(), 1), true)
	granted := make(chan permitResult, 1)
	go func() {
		p, err := sem.Acquire(ctx)
		granted <- permitResult{p, err}
	}()
	slot0 := sem.slotKey(0)
	pgtest.Eventually(t, testTimeout, "the head to wait for slot 0 on the server", func() bool {
		return waitingOn(t, dsn, keyOf(slot0)) == 1 && c.Stat().Waits == 1
	})
	heads := grantedTo(t, dsn, keyOf(sem.queueKey()))
	if len(heads) != 1 {
		t.Fatalf("pg_locks: queue key held by %v, want one head", heads)
	}
	head := heads[0]

	holder := pgtest.Conn(t, dsn)
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock($1)", k.coreKey().V); err != nil {
		t.Fatal(err)
	}
	locked := goLock(func() (*Lock, error) { return c.Lock(ctx, k) })
	pgtest.Eventually(t, testTimeout, "the Lock to find no backend to wait on, or to wait", func() bool {
		return c.Stat().QueuedWaits >= 1 || waitingOn(t, dsn, k) > 0
	})
	if n := waitingOn(t, dsn, k); n != 0 {
		t.Fatalf("pg_locks: %d backends wait for %v while the head's wait takes the Client's only one", n, k)
	}
	waitsWhileHolding(t, dsn, keyOf(sem.queueKey()))

	zl, err := c.TryLock(ctx, z)
	if err != nil {
		t.Fatal(err)
	}
	if zl.core.S.PID() == head {
		t.Fatalf("TryLock of %v ran on backend %d, which waits for slot 0", z, head)
	}
	heldOnlyBy(t, dsn, z, zl.core.S.PID())
	waitsWhileHolding(t, dsn, keyOf(sem.queueKey()))
	stillWaiting(t, locked)

	if _, err := holder.Exec(ctx, "SELECT pg_advisory_unlock($1)", k.coreKey().V); err != nil {
		t.Fatal(err)
	}
	r := receive(t, locked)
	if r.err != nil {
		t.Fatalf("Lock: %v, want the key once it is free", r.err)
	}
	heldOnlyBy(t, dsn, k, r.l.core.S.PID())
	if r.l.core.S.PID() == head {
		t.Fatalf("Lock of %v ended on backend %d, which waits for slot 0", k, head)
	}

	mustRelease(t, full)
	g := receivePermit(t, granted)
	if g.err != nil {
		t.Fatalf("Acquire: %v", g.err)
	}
	heldOnlyBy(t, dsn, keyOf(slot0), head)
	waitsWhileHolding(t, dsn)
	mustRelease(t, g.p)
	mustUnlock(t, r.l)
	mustUnlock(t, zl)
	notHeld(t, dsn, keyOf(sem.queueKey()))
}

// Promise (doc.go, "Locks that live as long as a connection"; backends.go):
// no goroutine sees ErrDeadlock unless its application has a lock cycle.
//
// Here there is none: goroutine A holds X; the application's write
// transaction T checked Y's fence (it holds the fence row) and then wants X,
// so it waits for A; goroutine C takes Y with WithFence, so its fence waits
// for T. A waits for nothing, so everybody gets through once A unlocks. But
// C's fence runs on the shared backend that holds A's X, and to PostgreSQL
// that backend holds X and waits for T, which waits for X: a cycle.
func TestFenceWaitSeesNoDeadlockWithoutCycle(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := migratedPool(t, ctx, DefaultSchema)
	c := newTestClientOn(t, pool, WithSharedBackends(1))
	x, y := Int64Key(7001), Int64Key(7002)

	// A fence exists for Y: an earlier holder took it with a fence.
	first, err := c.Lock(ctx, y, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	oldFence := first.Fence()
	mustUnlock(t, first)

	// Goroutine A holds X.
	lx, err := c.Lock(ctx, x)
	if err != nil {
		t.Fatal(err)
	}
	b1 := lx.core.S.PID()

	// The application's write transaction checks Y's fence.
	obs := pgtest.Conn(t, dsn)
	tconn := pgtest.Conn(t, dsn)
	tx, err := tconn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// T's statements run on one goroutine at a time: the cleanup lets A's
	// X go, waits for T's XactLock to return, then rolls T back.
	tch := make(chan errResult, 1)
	tStarted := false
	t.Cleanup(func() {
		if tStarted {
			if lx.Err() == nil {
				_ = lx.Unlock(context.Background())
			}
			select {
			case r := <-tch:
				tch <- r
			case <-time.After(testTimeout):
			}
		}
		_ = tx.Rollback(context.Background())
	})
	if err := CheckFence(ctx, tx, y, oldFence); err != nil {
		t.Fatal(err)
	}

	// Goroutine C takes Y with a fence: the fence waits for T.
	cch := make(chan result, 1)
	go func() {
		l, err := c.Lock(ctx, y, WithFence())
		cch <- result{l, err}
	}()
	// The fence waits for T's row: first on the shared backend, then, if
	// T has not ended within a glance, on a backend of C's Client that
	// holds nothing. Either way a backend of the Client waits for a lock.
	pgtest.Eventually(t, 10*time.Second, "C's fence to wait for T", func() bool {
		var n int
		err := obs.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'pgcoord' AND wait_event_type = 'Lock'`).Scan(&n)
		if err != nil {
			t.Fatalf("read pg_stat_activity: %v", err)
		}
		return n > 0
	})

	// T now wants X, which A holds: T waits for A.
	tStarted = true
	go func() {
		err := XactLock(ctx, tx, x)
		tch <- errResult{err, time.Now()}
	}()
	pgtest.Eventually(t, 10*time.Second, "T to wait for X", func() bool {
		return waitingOn(t, dsn, x) == 1
	})

	// Nobody may see a deadlock. Wait three deadlock_timeouts (1s each by
	// default) for an error that must not come.
	var cRes *result
	var tRes *errResult
	select {
	case r := <-cch:
		cRes = &r
	case r := <-tch:
		tRes = &r
	case <-time.After(3 * time.Second):
	}
	if cRes != nil && cRes.err != nil {
		t.Fatalf("broken promise: goroutine C's Lock(Y, WithFence) failed with %v (ErrDeadlock: %v) although no goroutine or transaction has a lock cycle: "+
			"C waits for T, T waits for A, A waits for nothing. C's fence ran on the shared backend %d that holds A's X, so the server saw that backend hold X and wait for T, and T wait for X",
			cRes.err, errors.Is(cRes.err, ErrDeadlock), b1)
	}
	if tRes != nil && tRes.err != nil {
		t.Fatalf("broken promise: the application's XactLock(X) in T failed with %v (ErrDeadlock: %v) although nobody has a lock cycle: "+
			"C's fence ran on the shared backend %d that holds A's X, so the server saw that backend hold X and wait for T",
			tRes.err, errors.Is(tRes.err, ErrDeadlock), b1)
	}
	if cRes != nil {
		t.Fatalf("C got Y before T ended: %+v", cRes)
	}

	// No deadlock: A unlocks, T gets X and commits, C gets its fence.
	mustUnlock(t, lx)
	var tr errResult
	if tRes != nil {
		tr = *tRes
	} else {
		select {
		case tr = <-tch:
		case <-time.After(testTimeout):
			t.Fatal("T did not get X after A unlocked it")
		}
	}
	tStarted = false // T's XactLock has returned: nothing for the cleanup to wait for
	if tr.err != nil {
		t.Fatalf("T's XactLock: %v", tr.err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	cr := receive(t, cch)
	if cr.err != nil {
		t.Fatalf("C's Lock: %v", cr.err)
	}
	if cr.l.Fence() <= oldFence {
		t.Fatalf("C's fence %d is not newer than %d", cr.l.Fence(), oldFence)
	}
	mustUnlock(t, cr.l)
}
