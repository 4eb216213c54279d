package pgcoord

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

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
	classid, objid, objsubid := k.lockColumns()
	var query string
	pgtest.Eventually(t, testTimeout, "a backend waiting for "+k.String(), func() bool {
		err := conn.QueryRow(context.Background(), `
			SELECT a.query FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE l.locktype = 'advisory' AND NOT l.granted AND a.wait_event_type = 'Lock'
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
		c.contention.memory = time.Hour // the test's pace does not matter
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
		heldOnlyBy(t, dsn, k, l.s.PID())
		mustUnlock(t, l)
		return q
	}

	// The first contended acquire learns of the contention from a try.
	if q := lockWhileHeld(plain); strings.Contains(q, "CASE WHEN") {
		t.Fatalf("the first contended Lock waits in %q, want the plain wait after a try", q)
	}
	if !plain.contention.recent(k) {
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
	heldOnlyBy(t, dsn, k, l.s.PID())
	mustUnlock(t, l)

	// The watched Client tries first every time, and reports each wait.
	for range 2 {
		if q := lockWhileHeld(watched); strings.Contains(q, "CASE WHEN") {
			t.Fatalf("a Client with OnContention waits in %q, want the plain wait after a try", q)
		}
	}
	if !watched.contention.recent(k) {
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
	const n = 4 * spreadAbove
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
				if !containsKey(allowed, k) {
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
	c.contention.memory = time.Hour
	sem := c.Semaphore("grant-in-flight", 1)
	k := Int64Key(7101)

	mustRelease(t, mustAcquire(t, sem, true)) // the row exists; one backend is open
	if st := c.Stat(); st.Backends != 1 {
		t.Fatalf("Stat: %+v, want one backend", st)
	}
	shared := c.backends[0].PID()

	holder := pgtest.Conn(t, dsn)
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock($1)", k.v); err != nil {
		t.Fatal(err)
	}
	c.contention.note(k) // found held a moment ago: the Lock waits at once

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
	heldOnlyBy(t, dsn, slot, shared)
	pgtest.Eventually(t, testTimeout, "the Lock to wait for the key on the server", func() bool {
		return waitingOn(t, dsn, k) == 1
	})
	waitsWhileHolding(t, dsn, k)

	// The key's holder asks for the slot: a cycle only if the slot and the
	// wait for the key share a backend.
	asked := make(chan error, 1)
	go func() {
		_, err := holder.Exec(ctx, "SELECT pg_advisory_lock($1)", slot.v)
		asked <- err
	}()
	pgtest.Eventually(t, testTimeout, "the holder to wait for the slot", func() bool {
		return waitingOn(t, dsn, slot) == 1
	})
	mustRelease(t, g.p)
	if err := <-asked; err != nil {
		t.Fatalf("the holder's request for the slot: %v", err)
	}
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_unlock($1), pg_advisory_unlock($2)", k.v, slot.v); err != nil {
		t.Fatal(err)
	}
	r := receive(t, locked)
	if r.err != nil {
		t.Fatalf("Lock: %v, want the key once its holder let it go", r.err)
	}
	heldOnlyBy(t, dsn, k, r.l.s.PID())
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
	q, err := c.Lock(ctx, semA.queueKey(), withoutHooks())
	if err != nil {
		t.Fatal(err)
	}
	defer mustUnlock(t, q)
	b := q.s
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
	if err := b.grab(ctx); err != nil {
		t.Fatal(err)
	}
	busy := true
	free := func() {
		if busy {
			busy = false
			b.release()
		}
	}
	defer free()
	granted := make(chan permitResult, 1)
	go func() {
		p, err := semB.TryAcquire(ctx)
		granted <- permitResult{p, err}
	}()
	pgtest.Eventually(t, testTimeout, "B's grant to wait for the head's backend", func() bool {
		b.state.Lock()
		defer b.state.Unlock()
		return b.pending > 0
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
			b.state.Lock()
			defer b.state.Unlock()
			return b.waiting
		}
	})
	free()
	g := receivePermit(t, granted)
	if g.err != nil {
		t.Fatalf("TryAcquire of B: %v", g.err)
	}
	defer mustRelease(t, g.p)
	heldOnlyBy(t, dsn, semB.slotKey(g.p.Slot()), b.PID())

	pgtest.Eventually(t, testTimeout, "the head to give up waiting there, or to wait for slot 0", func() bool {
		if returned {
			return true
		}
		select {
		case a = <-head:
			returned = true
			return true
		default:
			return waitingOn(t, dsn, semA.slotKey(0)) > 0
		}
	})
	waitsWhileHolding(t, dsn, semA.queueKey())
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
	b := c.backends[0]

	claimed, done, err := c.waitBackend(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if claimed != b {
		t.Fatalf("waitBackend claimed backend %d, want the one open, %d", claimed.PID(), b.PID())
	}
	if _, _, err := sem.admitOn(ctx, b, nil, false); !errors.Is(err, errRoute) {
		t.Fatalf("a grant on a backend claimed to wait: %v, want errRoute", err)
	}
	p := mustAcquire(t, sem, true)
	if p.l.s == b {
		t.Fatal("the permit went to the backend claimed to wait")
	}
	heldOnlyBy(t, dsn, sem.slotKey(p.Slot()), p.l.s.PID())
	if got := lockState(t, dsn); len(got) != 1 {
		t.Fatalf("pg_locks: %v, want only the permit's slot", got)
	}
	done()
	mustRelease(t, p)
}
