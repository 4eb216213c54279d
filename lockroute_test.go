package pgcoord

// Tests of where an acquire runs (route, tryThenWait, spreadAbove): a key
// contended a moment ago is tried and waited for in one statement (and a
// Client that reports contention reports it once, also when the wait is
// cancelled or its backend is lost); a Client that holds many keys spreads
// them over more backends within its connection bounds; and a wait never
// runs on a backend whose grant is in flight. Each test reads the outcome
// back from pg_locks and pg_stat_activity.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// waitingQuery returns the statement of the backend that waits for k in
// pg_locks, once one does (bounded by testTimeout). pg_stat_activity must
// show the wait too: the two views are read at slightly different moments,
// and a backend that started its wait in between would show its previous
// statement.
func waitingQuery(t *testing.T, dsn string, k Key) string {
	t.Helper()
	conn := pgtest.Conn(t, dsn)
	classid, objid, objsubid := k.coreKey().LockColumns()
	var query string
	pgtest.Eventually(t, testTimeout, "a backend waiting for "+k.String(), func() bool {
		err := conn.QueryRow(context.Background(), `
			SELECT a.query FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE l.locktype = 'advisory' AND NOT l.granted AND a.wait_event_type = 'Lock'
			  AND a.datname = current_database()
			  AND l.classid = $1 AND l.objid = $2 AND l.objsubid = $3`,
			int64(classid), int64(objid), objsubid).Scan(&query)
		return err == nil
	})
	return query
}

// A blocking Lock of a key that the Client found held a moment ago does
// not try it first: it tries and waits in one statement (seen in
// pg_stat_activity while it waits), and takes a free key with it too. A
// Client that reports contention to its hooks tries first, so that it
// reports each wait as it starts. The locks are read back from pg_locks.
func TestContendedKeyTriesAndWaitsInOneStatement(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	holder := newTestClient(t, dsn)
	var rec recorder
	watched := newTestClient(t, dsn, WithHooks(rec.hooks()))
	plain := newTestClient(t, dsn)
	for _, c := range []*Client{watched, plain} {
		c.core.Contention.Memory = time.Hour // the test's pace does not matter
	}
	k := Int64Key(7001)

	// lockWhileHeld has c Lock k while holder holds it, and returns the
	// statement c's backend waits in.
	lockWhileHeld := func(c *Client) string {
		t.Helper()
		h, err := holder.Lock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan *Lock, 1)
		go func() {
			l, err := c.Lock(ctx, k)
			if err != nil {
				t.Error(err)
			}
			got <- l
		}()
		q := waitingQuery(t, dsn, k)
		mustUnlock(t, h)
		l := <-got
		if l == nil {
			t.FailNow()
		}
		heldOnlyBy(t, dsn, k, l.core.S.PID())
		mustUnlock(t, l)
		return q
	}

	// The first contended acquire learns of the contention from a try.
	if q := lockWhileHeld(plain); strings.Contains(q, "CASE WHEN") {
		t.Fatalf("the first contended Lock waits in %q, want the plain wait after a try", q)
	}
	if !plain.core.Contention.Recent(k.coreKey()) {
		t.Fatal("the Client did not remember that the key was held elsewhere")
	}
	// The next one waits in the statement that tries.
	if q := lockWhileHeld(plain); !strings.Contains(q, "CASE WHEN pg_try_advisory_lock(") {
		t.Fatalf("the second contended Lock waits in %q, want the statement that tries and waits", q)
	}
	// A free key: taken by the same statement.
	l, err := plain.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	heldOnlyBy(t, dsn, k, l.core.S.PID())
	mustUnlock(t, l)

	// The watched Client tries first every time, and reports each wait.
	for range 2 {
		if q := lockWhileHeld(watched); strings.Contains(q, "CASE WHEN") {
			t.Fatalf("a Client with OnContention waits in %q, want the plain wait after a try", q)
		}
	}
	if !watched.core.Contention.Recent(k.coreKey()) {
		t.Fatal("the watched Client did not remember that the key was held elsewhere")
	}
	rec.until(t, 2, 2, 2, 0)
	notHeld(t, dsn, k)
}

// A Client that holds many keys spreads them over more backends, so that
// no backend holds most of them, and stays within WithSharedBackends +
// WithMaxWaits connections. Read back from pg_locks.
func TestManyKeysSpreadOverBackends(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	const n = 4 * core.SpreadAbove
	locks := make([]*Lock, 0, n)
	for i := range n {
		l, err := c.TryLock(ctx, Int64Key(int64(80_000+i)))
		if err != nil {
			t.Fatal(err)
		}
		locks = append(locks, l)
	}
	perPID := make(map[int32]int)
	for _, hs := range lockState(t, dsn) {
		for _, h := range hs {
			if h.granted {
				perPID[h.pid]++
			}
		}
	}
	total, most := 0, 0
	for _, m := range perPID {
		total += m
		most = max(most, m)
	}
	st := c.Stat()
	t.Logf("%d keys on %d backends: %v; Stat %+v", total, len(perPID), perPID, st)
	if total != n {
		t.Fatalf("pg_locks shows %d keys held, want %d", total, n)
	}
	if limit := DefaultSharedBackends + DefaultMaxWaits; st.Backends > limit {
		t.Fatalf("%d backends, want at most WithSharedBackends + WithMaxWaits = %d", st.Backends, limit)
	}
	if len(perPID) < 3 || most > n/2 {
		t.Fatalf("keys held per backend %v: want them spread over at least 3 backends, none holding more than half", perPID)
	}
	for _, l := range locks {
		mustUnlock(t, l)
	}
	if got := len(lockState(t, dsn)); got != 0 {
		t.Fatalf("%d keys still locked after unlocking all", got)
	}
}

// backendWaitsOnRow reports whether backend pid waits for a row lock or a
// transaction (a semaphore's grant that waits for the semaphore's row).
func backendWaitsOnRow(t testing.TB, conn *pgx.Conn, pid int32) bool {
	t.Helper()
	var n int
	err := conn.QueryRow(context.Background(), `
		SELECT count(*) FROM pg_locks
		WHERE pid = $1 AND NOT granted AND locktype IN ('transactionid', 'tuple')`, pid).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n > 0
}

// waitsWhileHolding fails the test if a backend that waits for an advisory
// lock holds another one, in pg_locks: the routing rule keeps every wait
// of a Client on a backend that holds nothing (or, for the head of a
// semaphore's queue, nothing but the queue key, allowed).
func waitsWhileHolding(t testing.TB, dsn string, allowed ...Key) {
	t.Helper()
	waiting := make(map[int32][]Key)
	held := make(map[int32][]Key)
	for k, hs := range lockState(t, dsn) {
		for _, h := range hs {
			if h.granted {
				if !core.ContainsKey(coreKeys(allowed), k.coreKey()) {
					held[h.pid] = append(held[h.pid], k)
				}
			} else {
				waiting[h.pid] = append(waiting[h.pid], k)
			}
		}
	}
	for pid, ks := range waiting {
		if len(held[pid]) != 0 {
			t.Fatalf("pg_locks: backend %d waits for %v while it holds %v", pid, ks, held[pid])
		}
	}
}

// A semaphore's grant that waits for the semaphore's row (a SetLimit in
// progress, or another process's grant) has not recorded its slot yet; a
// blocking Lock that needs a backend to wait on must not claim that one.
// If it did, the slot would be granted on the backend that waits for the
// key, and when the key's holder asked for the slot the server would see a
// cycle and end the Lock with a deadlock that the application does not
// have. Read back from pg_locks.
func TestLockWaitAvoidsBackendWithGrantInFlight(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	// A long slice, so that the grant's wait for the row outlasts the test's
	// steps on a loaded machine.
	c := newTestClient(t, dsn, WithSharedBackends(1), WithLossDeadline(20*time.Second))
	c.core.Contention.Memory = time.Hour
	sem := c.Semaphore("grant-in-flight", 1)
	k := Int64Key(7101)

	mustRelease(t, mustAcquire(t, sem, true)) // the row exists; one backend is open
	if st := c.Stat(); st.Backends != 1 {
		t.Fatalf("Stat: %+v, want one backend", st)
	}
	shared := c.core.Backends[0].PID()

	holder := pgtest.Conn(t, dsn)
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock($1)", k.coreKey().V); err != nil {
		t.Fatal(err)
	}
	c.core.Contention.Note(k.coreKey()) // found held a moment ago: the Lock waits at once

	// Another transaction holds the semaphore's row.
	row, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = row.Rollback(context.Background()) }()
	if _, err := row.Exec(ctx, "SELECT 1 FROM pgcoord.semaphores WHERE name = $1 FOR UPDATE", sem.Name()); err != nil {
		t.Fatal(err)
	}

	granted := make(chan permitResult, 1)
	go func() {
		p, err := sem.TryAcquire(ctx)
		granted <- permitResult{p, err}
	}()
	watch := pgtest.Conn(t, dsn)
	pgtest.Eventually(t, testTimeout, "the grant to wait for the semaphore's row", func() bool {
		return backendWaitsOnRow(t, watch, shared)
	})

	locked := goLock(func() (*Lock, error) { return c.Lock(ctx, k) })
	pgtest.Eventually(t, testTimeout, "the Lock to claim a backend to wait on", func() bool {
		return c.Stat().Waits == 1
	})

	if err := row.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	g := receivePermit(t, granted)
	if g.err != nil {
		t.Fatalf("TryAcquire: %v", g.err)
	}
	slot := sem.slotKey(g.p.Slot())
	heldOnlyBy(t, dsn, keyOf(slot), shared)
	pgtest.Eventually(t, testTimeout, "the Lock to wait for the key on the server", func() bool {
		return waitingOn(t, dsn, k) == 1
	})
	waitsWhileHolding(t, dsn, k)

	// The key's holder asks for the slot: a cycle only if the slot and the
	// wait for the key share a backend.
	asked := make(chan error, 1)
	go func() {
		_, err := holder.Exec(ctx, "SELECT pg_advisory_lock($1)", slot.V)
		asked <- err
	}()
	pgtest.Eventually(t, testTimeout, "the holder to wait for the slot", func() bool {
		return waitingOn(t, dsn, keyOf(slot)) == 1
	})
	mustRelease(t, g.p)
	if err := <-asked; err != nil {
		t.Fatalf("the holder's request for the slot: %v", err)
	}
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_unlock($1), pg_advisory_unlock($2)", k.coreKey().V, slot.V); err != nil {
		t.Fatal(err)
	}
	r := receive(t, locked)
	if r.err != nil {
		t.Fatalf("Lock: %v, want the key once its holder let it go", r.err)
	}
	heldOnlyBy(t, dsn, k, r.l.core.S.PID())
	mustUnlock(t, r.l)
}

// The head of a semaphore's queue waits on the server for slot 0 on the
// backend that holds its queue key, and only while that backend holds
// nothing else. Another semaphore's grant in flight on that backend (it
// records its slot only when its statement ends; here it waits for the
// connection, which another statement keeps busy) counts as something
// else: the head does not wait there, since the slot granted meanwhile
// would sit on a waiting backend. Read back from pg_locks.
func TestQueueHeadWaitAvoidsBackendWithGrantInFlight(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	c := newTestClient(t, dsn, WithSharedBackends(1), WithLossDeadline(20*time.Second))
	other := newTestClient(t, dsn)
	semA := c.Semaphore("queue-head-a", 1)
	semB := c.Semaphore("queue-head-b", 1)
	mustRelease(t, mustAcquire(t, semB, true)) // the row exists
	full := mustAcquire(t, other.Semaphore(semA.Name(), 1), true)
	defer mustRelease(t, full)

	// This Client heads semaphore A's queue on its one shared backend.
	q, err := c.core.Lock(ctx, semA.queueKey(), core.WithoutHooks())
	if err != nil {
		t.Fatal(err)
	}
	defer mustUnlock(t, faceOf(q))
	b := q.S
	sub, err := c.subscribe(semaphoreChannel, semA.payload)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.close()
	// The listener's first entry, a resync marker, would end the head's
	// wait at once (a head looks again after it): take it now, as
	// Semaphore.lead does.
	if _, err := sub.next(ctx, nil); err != nil {
		t.Fatal(err)
	}

	// Semaphore B's grant goes to the same backend and waits for its
	// connection, which a statement of the test holds.
	if err := b.Grab(ctx); err != nil {
		t.Fatal(err)
	}
	busy := true
	free := func() {
		if busy {
			busy = false
			b.Release()
		}
	}
	defer free()
	granted := make(chan permitResult, 1)
	go func() {
		p, err := semB.TryAcquire(ctx)
		granted <- permitResult{p, err}
	}()
	pgtest.Eventually(t, testTimeout, "B's grant to wait for the head's backend", func() bool {
		b.State.Lock()
		defer b.State.Unlock()
		return b.Pending > 0
	})

	type awaited struct {
		p     *Permit
		again bool
		err   error
	}
	head := make(chan awaited, 1)
	go func() {
		p, again, err := semA.await(ctx, q, sub)
		head <- awaited{p, again, err}
	}()
	// Either the head gives up waiting there at once, or it claims the
	// backend and waits for the connection too; then the grant goes first.
	var a awaited
	returned := false
	pgtest.Eventually(t, testTimeout, "the head to give up, or to claim the backend", func() bool {
		select {
		case a = <-head:
			returned = true
			return true
		default:
			b.State.Lock()
			defer b.State.Unlock()
			return b.Waiting
		}
	})
	free()
	g := receivePermit(t, granted)
	if g.err != nil {
		t.Fatalf("TryAcquire of B: %v", g.err)
	}
	defer mustRelease(t, g.p)
	heldOnlyBy(t, dsn, keyOf(semB.slotKey(g.p.Slot())), b.PID())

	pgtest.Eventually(t, testTimeout, "the head to give up waiting there, or to wait for slot 0", func() bool {
		if returned {
			return true
		}
		select {
		case a = <-head:
			returned = true
			return true
		default:
			return waitingOn(t, dsn, keyOf(semA.slotKey(0))) > 0
		}
	})
	waitsWhileHolding(t, dsn, keyOf(semA.queueKey()))
	if !returned {
		a = <-head
	}
	if a.p != nil || a.err != nil {
		t.Fatalf("await = %v, %v, %v: want no permit and no error (the head waits for a notification instead)", a.p, a.again, a.err)
	}
}

// A grant never runs on a backend that a blocking acquire has claimed to
// wait on, even when it was picked before the claim: it sends nothing
// there, and the acquire takes its permit on another backend. Read back
// from pg_locks.
func TestGrantAvoidsBackendClaimedToWait(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	c := newTestClient(t, dsn, WithSharedBackends(1))
	sem := c.Semaphore("claimed-backend", 1)
	mustRelease(t, mustAcquire(t, sem, true)) // one backend is open
	b := c.core.Backends[0]

	claimed, done, err := c.core.WaitBackend(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if claimed != b {
		t.Fatalf("waitBackend claimed backend %d, want the one open, %d", claimed.PID(), b.PID())
	}
	if _, _, err := sem.admitOn(ctx, b, nil, false); !errors.Is(err, core.ErrRoute) {
		t.Fatalf("a grant on a backend claimed to wait: %v, want errRoute", err)
	}
	p := mustAcquire(t, sem, true)
	if p.l.S == b {
		t.Fatal("the permit went to the backend claimed to wait")
	}
	heldOnlyBy(t, dsn, keyOf(sem.slotKey(p.Slot())), p.l.S.PID())
	if got := lockState(t, dsn); len(got) != 1 {
		t.Fatalf("pg_locks: %v, want only the permit's slot", got)
	}
	done()
	mustRelease(t, p)
}

// contentionCount returns how many OnContention events r holds.
func (r *recorder) contentionCount() int {
	_, _, c, _ := r.counts()
	return c
}

// waiterPID returns the backend that waits (not granted) for k, once one
// does whose pid is not in not.
func waiterPID(t testing.TB, dsn string, k Key, not ...int32) int32 {
	t.Helper()
	var pid int32
	pgtest.Eventually(t, testTimeout, "a backend to wait for "+k.String(), func() bool {
		for _, h := range lockState(t, dsn)[k] {
			if !h.granted && !slices.Contains(not, h.pid) {
				pid = h.pid
				return true
			}
		}
		return false
	})
	return pid
}

// Promise (Hooks.OnContention): it "is called when an acquire finds a key
// held: ... a blocking acquire that starts to wait". A Client that reports
// contention keeps the try before the wait for a key contended a moment
// ago, so its event comes while it waits, and also when its ctx ends the
// wait. Promise (Lock, RELIABILITY): an acquire cancelled mid-wait leaves
// no lock behind, on that path and on the one statement that tries and
// waits (a Client without OnContention), and once the holder unlocks, the
// key is free. Read back from pg_locks.
func TestContendedDirectWaitReportedAndCancelled(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	var rec recorder
	holder := newTestClient(t, dsn)
	c := newTestClient(t, dsn, WithHooks(rec.hooks()))
	c.core.Contention.Memory = time.Hour // the test's pace does not matter
	k := Int64Key(7301)
	c.core.Contention.Note(k.coreKey()) // found held elsewhere a moment ago

	h, err := holder.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	// Control: a shared acquire of the same key (not the one-statement
	// path) reports its contention while it waits.
	var ctl recorder
	cc := newTestClient(t, dsn, WithHooks(ctl.hooks()))
	cc.core.Contention.Memory = time.Hour
	cc.core.Contention.Note(k.coreKey())
	rctx, rcancel := context.WithCancel(ctx)
	rch := goLock(func() (*Lock, error) { return cc.RLock(rctx, k) })
	if !pgtest.Poll(testTimeout, func() bool { return ctl.contentionCount() == 1 }) {
		t.Fatalf("control: OnContention: %d events while an RLock waits, want 1", ctl.contentionCount())
	}
	stillWaiting(t, rch)
	rcancel()
	if r := receive(t, rch); !errors.Is(r.err, context.Canceled) {
		t.Fatalf("control: RLock cancelled mid-wait = %v, %v", r.l, r.err)
	}

	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch := goLock(func() (*Lock, error) { return c.Lock(wctx, k) })
	if q := waitingQuery(t, dsn, k); strings.Contains(q, "CASE WHEN") {
		t.Fatalf("the contended Lock of a Client with OnContention waits in %q, want the wait after a try", q)
	}
	stillWaiting(t, ch)
	if !pgtest.Poll(5*time.Second, func() bool { return rec.contentionCount() >= 1 }) {
		t.Errorf("OnContention: no event in 5s while the blocking Lock of %v waits on the server (pg_locks shows it waiting); want one when it starts to wait", k)
	}
	cancel()
	r := receive(t, ch)
	if !errors.Is(r.err, context.Canceled) {
		t.Fatalf("Lock cancelled mid-wait = %v, %v; want context.Canceled", r.l, r.err)
	}
	// Nothing of c's stays on the key: only the holder.
	heldOnlyBy(t, dsn, k, h.core.S.PID())
	if n := waitingOn(t, dsn, k); n != 0 {
		t.Fatalf("pg_locks: %d backends still wait for %v after the cancelled Lock returned", n, k)
	}
	if !pgtest.Poll(5*time.Second, func() bool { return rec.contentionCount() == 1 }) {
		t.Errorf("OnContention: %d events after a blocking Lock that waited and was cancelled, want 1", rec.contentionCount())
	}

	// The one statement that tries and waits, cancelled mid-wait.
	d := newTestClient(t, dsn)
	d.core.Contention.Memory = time.Hour
	d.core.Contention.Note(k.coreKey())
	dctx, dcancel := context.WithCancel(ctx)
	defer dcancel()
	dch := goLock(func() (*Lock, error) { return d.Lock(dctx, k) })
	if q := waitingQuery(t, dsn, k); !strings.Contains(q, "CASE WHEN pg_try_advisory_lock(") {
		t.Fatalf("the contended Lock waits in %q, want the statement that tries and waits", q)
	}
	stillWaiting(t, dch)
	dcancel()
	if r := receive(t, dch); !errors.Is(r.err, context.Canceled) {
		t.Fatalf("Lock cancelled mid-wait in the one statement = %v, %v; want context.Canceled", r.l, r.err)
	}
	heldOnlyBy(t, dsn, k, h.core.S.PID())
	if n := waitingOn(t, dsn, k); n != 0 {
		t.Fatalf("pg_locks: %d backends still wait for %v after the cancelled Lock returned", n, k)
	}

	mustUnlock(t, h)
	notHeld(t, dsn, k)
	l, err := c.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	heldOnlyBy(t, dsn, k, l.core.S.PID())
	mustUnlock(t, l)
	notHeld(t, dsn, k)
}

// Promise (Client.take, RELIABILITY): a blocking acquire whose backend is
// lost while it waits tries again until it gets the key; (OnContention) an
// acquire that waited is reported, once. The backend that waits in the
// statement that tries and waits is terminated mid-wait.
func TestContendedDirectWaitBackendTerminated(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	var rec recorder
	holder := newTestClient(t, dsn)
	c := newTestClient(t, dsn, WithHooks(rec.hooks()))
	c.core.Contention.Memory = time.Hour
	k := Int64Key(7302)
	c.core.Contention.Note(k.coreKey())

	h, err := holder.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	ch := goLock(func() (*Lock, error) { return c.Lock(ctx, k) })
	first := waiterPID(t, dsn, k)
	pgtest.Terminate(t, dsn, first)
	// It waits again, on another backend.
	second := waiterPID(t, dsn, k, first)
	stillWaiting(t, ch)
	mustUnlock(t, h)
	r := receive(t, ch)
	if r.err != nil {
		t.Fatalf("Lock after its waiting backend %d was terminated: %v", first, r.err)
	}
	heldOnlyBy(t, dsn, k, r.l.core.S.PID())
	if r.l.core.S.PID() != second {
		t.Logf("granted on backend %d, which waited second was %d", r.l.core.S.PID(), second)
	}
	if !pgtest.Poll(5*time.Second, func() bool { return rec.contentionCount() == 1 }) {
		t.Errorf("OnContention: %d events for one blocking Lock that waited (twice, on backends %d and %d), want 1", rec.contentionCount(), first, second)
	}
	mustUnlock(t, r.l)
	notHeld(t, dsn, k)

	// The same on the one statement that tries and waits (a Client
	// without OnContention).
	d := newTestClient(t, dsn)
	d.core.Contention.Memory = time.Hour
	d.core.Contention.Note(k.coreKey())
	if h, err = holder.Lock(ctx, k); err != nil {
		t.Fatal(err)
	}
	dch := goLock(func() (*Lock, error) { return d.Lock(ctx, k) })
	if q := waitingQuery(t, dsn, k); !strings.Contains(q, "CASE WHEN pg_try_advisory_lock(") {
		t.Fatalf("the contended Lock waits in %q, want the statement that tries and waits", q)
	}
	first = waiterPID(t, dsn, k)
	pgtest.Terminate(t, dsn, first)
	waiterPID(t, dsn, k, first)
	stillWaiting(t, dch)
	mustUnlock(t, h)
	r = receive(t, dch)
	if r.err != nil {
		t.Fatalf("Lock after its waiting backend %d was terminated: %v", first, r.err)
	}
	heldOnlyBy(t, dsn, k, r.l.core.S.PID())
	mustUnlock(t, r.l)
	notHeld(t, dsn, k)
}

// Promise (PairKey): pair keys never conflict with bigint keys; (contention)
// a key that shares a slot of the contention table with a contended one
// "only takes that path too, which costs it nothing". A pair key and the
// bigint key with the same 64 bits share the slot and its remembered value:
// each must be taken at once while the other is held elsewhere, and
// pg_locks must show exactly the key asked for. WithFence on the contended path: the fence of a handoff
// grows. (A Client without OnContention, which takes that path.)
func TestContendedPairKeysAndFence(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	if err := Migrate(ctx, pgtest.Pool(t, dsn)); err != nil {
		t.Fatal(err)
	}
	holder := newTestClient(t, dsn)
	c := newTestClient(t, dsn)
	c.core.Contention.Memory = time.Hour
	p := PairKey(12, 34)
	i := Int64Key(p.coreKey().V)
	if c.core.Contention.Slot(p.coreKey()) != c.core.Contention.Slot(i.coreKey()) {
		t.Fatal("the pair key and the bigint key of the same bits do not share a slot")
	}

	// The pair key is contended.
	c.core.Contention.Note(p.coreKey())
	hp, err := holder.Lock(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	// The bigint key is free, though its slot says contended.
	li, err := c.Lock(ctx, i)
	if err != nil {
		t.Fatal(err)
	}
	heldOnlyBy(t, dsn, i, li.core.S.PID())
	heldOnlyBy(t, dsn, p, hp.core.S.PID())
	mustUnlock(t, li)
	mustUnlock(t, hp)

	// The bigint key is contended; the pair key is free.
	c.core.Contention.Note(i.coreKey())
	hi, err := holder.Lock(ctx, i)
	if err != nil {
		t.Fatal(err)
	}
	lp, err := c.Lock(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	heldOnlyBy(t, dsn, p, lp.core.S.PID())
	heldOnlyBy(t, dsn, i, hi.core.S.PID())
	mustUnlock(t, lp)

	// A fenced Lock of the contended bigint key waits in the statement
	// that tries and waits, and gets a larger fence than the holder's.
	mustUnlock(t, hi)
	hf, err := holder.Lock(ctx, i, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	c.core.Contention.Note(i.coreKey())
	ch := goLock(func() (*Lock, error) { return c.Lock(ctx, i, WithFence()) })
	if q := waitingQuery(t, dsn, i); !strings.Contains(q, "CASE WHEN") {
		t.Fatalf("the contended fenced Lock waits in %q, want the statement that tries and waits", q)
	}
	mustUnlock(t, hf)
	r := receive(t, ch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.l.Fence() <= hf.Fence() {
		t.Fatalf("fence after the handoff %d, want more than the holder's %d", r.l.Fence(), hf.Fence())
	}
	heldOnlyBy(t, dsn, i, r.l.core.S.PID())
	mustUnlock(t, r.l)
	notHeld(t, dsn, i)
	notHeld(t, dsn, p)
}

// Promise (backends.go): "A Client uses at most WithSharedBackends +
// WithMaxWaits connections ... for its locks, whatever the number of keys
// it holds", and its limits "delay an acquire but never deadlock": with
// thousands of keys held, spread over backends, blocking acquires of keys
// held elsewhere still get them once they are free, whether they can wait
// on a backend or must poll. Connections are counted in pg_stat_activity
// by application_name; keys in pg_locks.
func TestManyKeysBoundsAndWaits(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ shared, waits, keys int }{
		{1, 1, 2*core.SpreadAbove + 10},
		{1, 2, 3*core.SpreadAbove + 10},
	} {
		t.Run(fmt.Sprintf("shared=%d,waits=%d", tc.shared, tc.waits), func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			dsn := pgtest.DB(t)
			pool := pgtest.Pool(t, dsn)
			app := fmt.Sprintf("manykeys-spread-%d-%d", tc.shared, tc.waits)
			limit := tc.shared + tc.waits
			other := newTestClient(t, dsn)
			c := newTestClient(t, dsn, WithSharedBackends(tc.shared), WithMaxWaits(tc.waits), WithApplicationName(app))
			locks := make([]*Lock, 0, tc.keys)
			for i := range tc.keys {
				l, err := c.TryLock(ctx, Int64Key(int64(200_000+i)))
				if err != nil {
					t.Fatalf("TryLock %d: %v", i, err)
				}
				locks = append(locks, l)
			}
			if n := appConnections(t, pool, app); n > limit {
				t.Fatalf("%d connections with %d keys held, want at most %d", n, tc.keys, limit)
			}
			// Blocking acquires of keys held elsewhere, two at a time, more
			// than the Client has waits: each gets its key once it is free.
			for round := range 3 {
				ks := []Key{Int64Key(int64(300_000 + 2*round)), Int64Key(int64(300_001 + 2*round))}
				var hs []*Lock
				var chs []<-chan result
				for _, k := range ks {
					h, err := other.Lock(ctx, k)
					if err != nil {
						t.Fatal(err)
					}
					hs = append(hs, h)
					chs = append(chs, goLock(func() (*Lock, error) { return c.Lock(ctx, k) }))
				}
				for _, ch := range chs {
					stillWaiting(t, ch)
				}
				if n := appConnections(t, pool, app); n > limit {
					t.Fatalf("round %d: %d connections while acquires wait, want at most %d", round, n, limit)
				}
				for i, h := range hs {
					mustUnlock(t, h)
					r := receive(t, chs[i])
					if r.err != nil {
						t.Fatalf("round %d: blocking Lock of %v: %v", round, ks[i], r.err)
					}
					heldOnlyBy(t, dsn, ks[i], r.l.core.S.PID())
					locks = append(locks, r.l)
				}
			}
			held := 0
			for _, hs := range lockState(t, dsn) {
				for _, h := range hs {
					if h.granted {
						held++
					}
				}
			}
			if held != len(locks) {
				t.Fatalf("pg_locks: %d keys held, want %d", held, len(locks))
			}
			if n, st := appConnections(t, pool, app), c.Stat(); n > limit || st.Backends > limit {
				t.Fatalf("%d connections (Stat: %+v), want at most %d", n, st, limit)
			}
			for _, l := range locks {
				mustUnlock(t, l)
			}
			if n := len(lockState(t, dsn)); n != 0 {
				t.Fatalf("%d keys still locked after unlocking all", n)
			}
		})
	}
}
