package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// Semaphores when their tables cannot be written: semaphore_holders held
// by another session (VACUUM FULL, CLUSTER, TRUNCATE, a migration's ALTER
// TABLE, an uncommitted DELETE) or a database read-only by default, while
// permits are released and taken on a backend that other goroutines'
// locks share.

// lockedHolders starts a transaction that holds pgcoord's
// semaphore_holders table in ACCESS EXCLUSIVE mode, as VACUUM FULL, CLUSTER,
// TRUNCATE or a migration's ALTER TABLE would, and returns the function that
// ends it (safe to call twice; also run at cleanup).
//
// With rows, it locks only the rows of semaphore_holders (FOR UPDATE), as
// an operator's uncommitted DELETE or UPDATE of them would.
func lockedHolders(t *testing.T, ctx context.Context, dsn string, rows bool) (unlock func()) {
	t.Helper()
	locker := pgtest.Conn(t, dsn)
	tx, err := locker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sql := `LOCK TABLE pgcoord.semaphore_holders IN ACCESS EXCLUSIVE MODE`
	if rows {
		sql = `SELECT FROM pgcoord.semaphore_holders FOR UPDATE`
	}
	if _, err := tx.Exec(ctx, sql); err != nil {
		t.Fatal(err)
	}
	done := false
	unlock = func() {
		if !done {
			done = true
			_ = tx.Rollback(context.Background())
		}
	}
	t.Cleanup(unlock)
	return unlock
}

// clientWithSharedLock returns a Client on one shared backend, a lock of
// another goroutine held there, and a permit of sem held on the same
// backend.
func clientWithSharedLock(t *testing.T, ctx context.Context, dsn string) (c *Client, lx *Lock, sem *Semaphore) {
	t.Helper()
	c = newTestClient(t, dsn, WithSharedBackends(1), WithLossDeadline(2*time.Second), WithHeartbeat(500*time.Millisecond))
	lx, err := c.Lock(ctx, Int64Key(424242))
	if err != nil {
		t.Fatal(err)
	}
	return c, lx, c.Semaphore("sem-locked-table", 2)
}

// checkLockKept fails the test if lx, held by another goroutine on the
// backend where the semaphore's statement ran, was lost: its Err, and
// pg_locks read from outside (the key still granted to the same backend).
func checkLockKept(t *testing.T, dsn string, lx *Lock, pid int32, what string) {
	t.Helper()
	if err := lx.Err(); err != nil {
		t.Fatalf("broken promise (a goroutine never loses a lock because of another goroutine's statement): "+
			"a Lock held on the backend of %s ended: %v", what, err)
	}
	if got := grantedTo(t, dsn, lx.Key()); len(got) != 1 || got[0] != pid {
		t.Fatalf("broken promise: after %s, pg_locks shows the other goroutine's key %v granted to %v, want backend %d",
			what, lx.Key(), got, pid)
	}
}

// unlockLeavingNothing unlocks lx, the other goroutine's lock, and checks
// that pg_locks shows no slot and no queue key of sem.
func unlockLeavingNothing(t *testing.T, ctx context.Context, dsn string, lx *Lock, sem *Semaphore) {
	t.Helper()
	if err := lx.Unlock(ctx); err != nil {
		t.Fatalf("Unlock of the other goroutine's lock: %v", err)
	}
	if slots, queued := slotLocks(t, dsn, sem); len(slots) != 0 || queued {
		t.Fatalf("pg_locks at the end: slots %v, queue %v", slots, queued)
	}
}

// Promise (backends.go, DESIGN "a shared backend is one session"): no
// goroutine loses a lock because of another goroutine's wait or error, and
// Release's nil means the slot is free on the server.
//
// Attack: a permit and another goroutine's Lock share the Client's only
// backend; a session holds semaphore_holders in ACCESS EXCLUSIVE mode (as
// VACUUM FULL or a migration's ALTER TABLE would) for longer than a wait
// slice while the permit is released. The release statement deletes the
// permit's row, so it waits for the table, until its lock_timeout (a
// slice) ends it.
func TestSemaphorePermitReleaseWhileHoldersTableLockedKeepsOtherLocks(t *testing.T) {
	t.Run("table", func(t *testing.T) { releaseWhileHoldersLocked(t, false) })
	// The row only: the release's statement gives its slot up, takes it
	// back by its try (nobody waits) and then waits to delete its row.
	t.Run("row", func(t *testing.T) { releaseWhileHoldersLocked(t, true) })
}

func releaseWhileHoldersLocked(t *testing.T, rows bool) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	c, lx, sem := clientWithSharedLock(t, ctx, dsn)
	p := mustAcquire(t, sem, true)
	pid := lx.core.S.PID()
	if p.l.S.PID() != pid {
		t.Fatalf("the permit is on backend %d, the lock on %d: want one shared backend", p.l.S.PID(), pid)
	}
	obs := pgtest.Conn(t, dsn)
	unlock := lockedHolders(t, ctx, dsn, rows)

	released := make(chan error, 1)
	go func() { released <- p.Release(ctx) }()
	pgtest.Eventually(t, 10*time.Second, "the release to wait for the locked table", func() bool {
		return waitsNotGranted(t, obs, pid, "") > 0
	})
	// The table stays locked well beyond the release's slice: the
	// release must end by itself (its statement's lock_timeout), without
	// costing the other goroutine its lock.
	bound := 2*c.core.Cfg.WaitSlice() + 2*time.Second
	var err error
	select {
	case err = <-released:
	case <-time.After(bound):
		unlock()
		err = <-released
		t.Logf("Release returned only once the table was unlocked (after %v): %v", bound, err)
	}
	t.Logf("Release while semaphore_holders was locked: %v", err)
	// Read while the table is still locked, if Release ended by itself.
	checkLockKept(t, dsn, lx, pid, "a Release that waited for the locked table")
	if err == nil {
		// nil: the slot is free on the server.
		if got := grantedTo(t, dsn, keyOf(p.l.KeyList[0])); len(got) != 0 {
			t.Fatalf("Release returned nil, but pg_locks shows slot %d granted to %v", p.Slot(), got)
		}
	}
	unlock()
	// The semaphore works on: every permit can be taken, and released.
	a, b := mustAcquire(t, sem, true), mustAcquire(t, sem, true)
	mustRelease(t, a)
	mustRelease(t, b)
	unlockLeavingNothing(t, ctx, dsn, lx, sem)
}

// The same attack on TryAcquire: its grant, on the shared backend, waits a
// slice for the locked table and fails; the cleanup after the failed grant
// deletes rows too, and must not cost the backend (and the other
// goroutine's lock) when it cannot.
func TestSemaphoreTryAcquireWhileHoldersTableLockedKeepsOtherLocks(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	c, lx, sem := clientWithSharedLock(t, ctx, dsn)
	// The semaphore's row exists, and the backend has run a grant.
	mustRelease(t, mustAcquire(t, sem, true))
	pid := lx.core.S.PID()
	unlock := lockedHolders(t, ctx, dsn, false)

	tried := make(chan permitResult, 1)
	go func() {
		p, err := sem.TryAcquire(ctx)
		tried <- permitResult{p, err}
	}()
	bound := 4*c.core.Cfg.WaitSlice() + 2*time.Second
	var r permitResult
	select {
	case r = <-tried:
	case <-time.After(bound):
		unlock()
		r = <-tried
		t.Logf("TryAcquire returned only once the table was unlocked (after %v)", bound)
	}
	t.Logf("TryAcquire while semaphore_holders was locked: %v", r.err)
	checkLockKept(t, dsn, lx, pid, "a TryAcquire whose grant waited for the locked table")
	if r.err == nil {
		// A permit is a slot granted to its backend.
		heldOnlyBy(t, dsn, keyOf(r.p.l.KeyList[0]), r.p.l.S.PID())
	} else if slots, _ := slotLocks(t, dsn, sem); len(slots) != 0 {
		t.Fatalf("TryAcquire failed (%v), but pg_locks shows slots %v", r.err, slots)
	}
	unlock()
	if r.err == nil {
		mustRelease(t, r.p)
	}
	mustRelease(t, mustAcquire(t, sem, true))
	unlockLeavingNothing(t, ctx, dsn, lx, sem)
}

// The same attack with a database made read-only by default
// (ALTER DATABASE ... SET default_transaction_read_only = on, a common way
// to freeze a database for maintenance): plain advisory locks still work
// there, but a semaphore's grant cannot write its row. TryAcquire must fail
// with the server's error and cost nothing else: the cleanup after the
// failed grant deletes rows too, and fails in the same way.
func TestSemaphoreTryAcquireOnReadOnlyDatabaseKeepsOtherLocks(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	var db string
	if err := pool.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "ALTER DATABASE "+quoteIdent(db)+" SET default_transaction_read_only = on"); err != nil {
		t.Fatal(err)
	}
	_, lx, sem := clientWithSharedLock(t, ctx, dsn)
	pid := lx.core.S.PID()
	_, err := sem.TryAcquire(ctx)
	t.Logf("TryAcquire on a read-only database: %v", err)
	if err == nil {
		t.Fatal("TryAcquire on a read-only database returned a permit")
	}
	checkLockKept(t, dsn, lx, pid, "a TryAcquire on a read-only database")
	if slots, queued := slotLocks(t, dsn, sem); len(slots) != 0 || queued {
		t.Fatalf("pg_locks after the failed TryAcquire: slots %v, queue %v", slots, queued)
	}
	if err := lx.Unlock(ctx); err != nil {
		t.Fatalf("Unlock of the other goroutine's lock: %v", err)
	}
}

// Promise (backends.go; row 26, TestUnlockAnswersWithinSliceWhileCampaignPrepareWaits):
// a backend that holds locks answers within its wait slice whatever runs
// on it: an Unlock of another goroutine's lock there waits at most a slice
// (+500 ms) behind a semaphore's statement.
//
// Attack: semaphore_holders is locked (as above) while a TryAcquire's grant
// runs on the backend of another goroutine's lock, which that goroutine
// then unlocks.
func TestSemaphoreUnlockBehindGrantOnLockedTableWithinSlice(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	c, lx, sem := clientWithSharedLock(t, ctx, dsn)
	mustRelease(t, mustAcquire(t, sem, true))
	pid := lx.core.S.PID()
	obs := pgtest.Conn(t, dsn)
	unlock := lockedHolders(t, ctx, dsn, false)
	tried := make(chan permitResult, 1)
	go func() {
		p, err := sem.TryAcquire(ctx)
		tried <- permitResult{p, err}
	}()
	pgtest.Eventually(t, 10*time.Second, "the grant to wait for the locked table on the shared backend", func() bool {
		return waitsNotGranted(t, obs, pid, "relation") > 0
	})
	slice := c.core.Cfg.WaitSlice()
	start := time.Now()
	err := lx.Unlock(ctx)
	took := time.Since(start)
	unlock()
	r := receivePermit(t, tried)
	if r.err == nil {
		mustRelease(t, r.p)
	}
	t.Logf("Unlock took %v behind the grant (slice %v); TryAcquire: %v", took.Round(time.Millisecond), slice, r.err)
	if err != nil {
		t.Fatalf("Unlock: %v", err)
	}
	if bound := slice + 500*time.Millisecond; took > bound {
		t.Fatalf("broken promise: an Unlock on a backend where a TryAcquire's grant waited for the locked table took %v, bound a slice + 500ms = %v", took.Round(time.Millisecond), bound)
	}
	notHeld(t, dsn, lx.Key())
}

// Promise (Client.Close): Close releases everything it owns and returns
// within the loss deadline whatever the pool and the server do; a waiting
// acquire returns ErrClosed.
//
// Attack: semaphore_holders is locked by another session (as above) while
// a Client whose backends hold permits (and another goroutine's lock), and
// whose TryAcquire waits for the table, closes: every session's close
// deletes its holder rows first, and the release statements of the
// permits wait for the table too.
func TestSemaphoreCloseWhileHoldersTableLocked(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	const loss = 2 * time.Second
	c, err := New(pgtest.Pool(t, dsn), WithSharedBackends(2), WithLossDeadline(loss), WithHeartbeat(500*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	sem := c.Semaphore("sem-close-locked", 5)
	var ps []*Permit
	for range 4 {
		ps = append(ps, mustAcquire(t, sem, true))
	}
	lx, err := c.Lock(ctx, Int64Key(737373))
	if err != nil {
		t.Fatal(err)
	}
	obs := pgtest.Conn(t, dsn)
	unlock := lockedHolders(t, ctx, dsn, false)
	tried := make(chan permitResult, 1)
	go func() {
		p, err := sem.TryAcquire(ctx)
		tried <- permitResult{p, err}
	}()
	released := make(chan error, 1)
	go func() { released <- ps[0].Release(ctx) }()
	pgtest.Eventually(t, 10*time.Second, "the TryAcquire or the Release to wait for the locked table", func() bool {
		var n int
		if err := obs.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'relation'
			AND relation = 'pgcoord.semaphore_holders'::regclass`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n >= 1
	})
	start := time.Now()
	cerr := c.Close(context.Background())
	took := time.Since(start)
	t.Logf("Close took %v (loss deadline %v): %v", took.Round(time.Millisecond), loss, cerr)
	if took > loss {
		t.Fatalf("broken promise: Close took %v, bound the loss deadline %v", took, loss)
	}
	r := receivePermit(t, tried)
	if r.err == nil {
		t.Fatalf("TryAcquire racing Close returned a permit")
	}
	t.Logf("TryAcquire: %v; Release: %v", r.err, <-released)
	unlock()
	for _, p := range ps {
		select {
		case <-p.Done():
		default:
			t.Fatalf("a permit is not done after Close")
		}
	}
	<-lx.Done()
	if slots, queued := slotLocks(t, dsn, sem); len(slots) != 0 || queued {
		t.Fatalf("pg_locks after Close: slots %v, queue %v", slots, queued)
	}
	notHeld(t, dsn, lx.Key())
}

// A release's fallback (semaphore.go, rowsFailed) passes its slot on: the
// release statement gives its slot up, takes it back by its try (nobody
// waits yet) and then waits for its row, which another session holds
// (FOR UPDATE) beyond a slice. Meanwhile another Client's Acquire heads
// the queue and waits for slot 0 (limit 1). The fallback's unlock passes
// the slot to the head: at no time may more than one slot be granted, the
// release returns nil, and once the row is free the head holds the only
// permit, with nothing else left in pg_locks at the end.
func TestSemaphoreReleaseFallbackPassesSlotToHead(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	opts := []Option{WithSharedBackends(1), WithLossDeadline(2 * time.Second), WithHeartbeat(500 * time.Millisecond)}
	c := newTestClient(t, dsn, opts...)
	sem := c.Semaphore("sem-fallback-head", 1)
	p := mustAcquire(t, sem, true)
	pid := p.l.S.PID()
	c2 := newTestClient(t, dsn, opts...)
	sem2 := c2.Semaphore("sem-fallback-head", 1)
	obs := pgtest.Conn(t, dsn)
	unlock := lockedHolders(t, ctx, dsn, true)

	// Watch the slots for the whole test: never two granted.
	stopWatch := make(chan struct{})
	watchDone := make(chan string, 1)
	var stopOnce sync.Once
	stop := func() string {
		stopOnce.Do(func() { close(stopWatch) })
		msg := <-watchDone
		watchDone <- msg
		return msg
	}
	t.Cleanup(func() { stop() })
	go func() {
		most := 0
		var seen map[int]int32
		for {
			select {
			case <-stopWatch:
				if most > 1 {
					watchDone <- fmt.Sprintf("%d slots granted at once: %v", most, seen)
				} else {
					watchDone <- ""
				}
				return
			case <-time.After(5 * time.Millisecond):
			}
			slots, _ := slotLocks(t, dsn, sem)
			if len(slots) > most {
				most, seen = len(slots), slots
			}
		}
	}()

	released := make(chan error, 1)
	go func() { released <- p.Release(ctx) }()
	pgtest.Eventually(t, 10*time.Second, "the release waits for its row", func() bool {
		return waitsNotGranted(t, obs, pid, "transactionid")+waitsNotGranted(t, obs, pid, "tuple") > 0
	})
	acquired := make(chan result, 1)
	go func() {
		q, err := sem2.Acquire(ctx)
		var l *Lock
		if q != nil {
			l = faceOf(q.l)
		}
		acquired <- result{l: l, err: err}
		if err == nil {
			<-stopWatch
			_ = q.Release(context.Background())
		}
	}()
	slot0 := sem.slotKey(0)
	pgtest.Eventually(t, 10*time.Second, "the head waits for slot 0", func() bool { return waitingOn(t, dsn, keyOf(slot0)) == 1 })
	select {
	case err := <-released:
		if err != nil {
			t.Fatalf("Release whose row is locked: %v", err)
		}
	case <-time.After(4 * c.core.Cfg.WaitSlice()):
		t.Fatalf("Release did not return within 4 slices")
	}
	if err := p.Err(); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("released permit's Err: %v", err)
	}
	// The head may hold slot 0 for moments (its own grant waits for the
	// row and gives it up); the row freed, it takes the permit.
	unlock()
	var r result
	select {
	case r = <-acquired:
	case <-time.After(testTimeout):
		t.Fatal("the head did not get the permit after the row was freed")
	}
	if r.err != nil {
		t.Fatalf("head's Acquire: %v", r.err)
	}
	hs, err := sem.Holders(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(hs) != 1 || hs[0].PID != r.l.core.S.PID() {
		t.Fatalf("Holders after the head's grant: %+v, want the head's backend %d only", hs, r.l.core.S.PID())
	}
	if msg := stop(); msg != "" {
		t.Fatal(msg)
	}
	pgtest.Eventually(t, testTimeout, "nothing left", func() bool {
		slots, queued := slotLocks(t, dsn, sem)
		return len(slots) == 0 && !queued
	})
}
