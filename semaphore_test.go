package pgcoord

// Tests of semaphores (Client.Semaphore, Acquire, TryAcquire, Release,
// Holders, SetLimit): permits, rows and pg_locks agree, the limit holds,
// waiters are served in line order and fairly, and an Acquire that fails or
// is cancelled leaves nothing behind.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// semaphoreDB returns a fresh database with pgcoord's tables, and a pool on
// it.
func semaphoreDB(t testing.TB) (string, *pgxpool.Pool) {
	t.Helper()
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	if err := Migrate(testCtx(t), pool); err != nil {
		t.Fatal(err)
	}
	return dsn, pool
}

// slotLocks returns, from pg_locks, the backends that hold a slot of sem
// (granted), by slot, and whether anyone holds or waits for its queue.
func slotLocks(t testing.TB, dsn string, sem *Semaphore) (map[int]int32, bool) {
	t.Helper()
	slots := make(map[int]int32)
	queued := false
	var heads, awaiting []int32
	defer func() {
		// Only the head of the queue waits for a slot, slot 0 (see
		// Semaphore.await).
		if len(awaiting) > 1 || len(awaiting) == 1 && (len(heads) != 1 || heads[0] != awaiting[0]) {
			t.Fatalf("pg_locks: backends %v wait for slot 0 of %q, whose queue key is held by %v: only the head may", awaiting, sem.name, heads)
		}
	}()
	for k, hs := range lockState(t, dsn) {
		v, ok := k.Int64()
		if !ok || v>>16 != sem.prefix {
			continue
		}
		slot := int(v & 0xFFFF)
		if slot == queueSlot {
			queued = queued || len(hs) > 0
			for _, h := range hs {
				if h.granted {
					heads = append(heads, h.pid)
				}
			}
			continue
		}
		for _, h := range hs {
			if !h.granted && slot == 0 {
				awaiting = append(awaiting, h.pid)
				continue
			}
			if !h.granted {
				t.Fatalf("pg_locks: backend %d waits for slot %d of %q: only the head waits, and only for slot 0", h.pid, slot, sem.name)
			}
			if prev, dup := slots[slot]; dup {
				t.Fatalf("pg_locks: slot %d of %q held by %d and %d", slot, sem.name, prev, h.pid)
			}
			slots[slot] = h.pid
		}
	}
	return slots, queued
}

// holderRows counts the rows of semaphore_holders for name.
func holderRows(t testing.TB, pool *pgxpool.Pool, name string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(testCtx(t), "SELECT count(*) FROM pgcoord.semaphore_holders WHERE name = $1", name).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

type permitResult struct {
	p   *Permit
	err error
}

func goAcquire(ctx context.Context, s *Semaphore) <-chan permitResult {
	ch := make(chan permitResult, 1)
	go func() {
		p, err := s.Acquire(ctx)
		ch <- permitResult{p, err}
	}()
	return ch
}

func receivePermit(t testing.TB, ch <-chan permitResult) permitResult {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(testTimeout):
		t.Fatal("Acquire did not return in time")
		return permitResult{}
	}
}

func mustAcquire(t testing.TB, s *Semaphore, try bool) *Permit {
	t.Helper()
	acquire := s.Acquire
	if try {
		acquire = s.TryAcquire
	}
	p, err := acquire(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func mustRelease(t testing.TB, p *Permit) {
	t.Helper()
	if err := p.Release(context.Background()); err != nil {
		t.Fatalf("Release: %v", err)
	}
}

// awaitHead waits until some backend of c holds the queue of sem: an
// Acquire of c heads the queue and waits for a permit.
func awaitHead(t testing.TB, dsn string, sem *Semaphore) {
	t.Helper()
	pgtest.Eventually(t, testTimeout, "an Acquire to head the queue of "+sem.name, func() bool {
		return len(grantedTo(t, dsn, keyOf(sem.queueKey()))) == 1
	})
}

// awaitSettled waits until nobody holds or waits for the queue of sem (a
// granted Acquire leaves the queue in the background) and returns the
// slots held, from pg_locks.
func awaitSettled(t testing.TB, dsn string, sem *Semaphore) map[int]int32 {
	t.Helper()
	var slots map[int]int32
	pgtest.Eventually(t, testTimeout, "the queue of "+sem.name+" to empty", func() bool {
		var queued bool
		slots, queued = slotLocks(t, dsn, sem)
		return !queued
	})
	return slots
}

// Permits, rows and pg_locks agree; the limit holds; a release frees the
// slot on the server; a second Release says the permit is not held.
func TestSemaphoreTryAcquireRelease(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	c := newTestClient(t, dsn)
	sem := c.Semaphore("exports", 2)

	p1 := mustAcquire(t, sem, true)
	p2 := mustAcquire(t, sem, true)
	if p1.Slot() == p2.Slot() {
		t.Fatalf("two permits on slot %d", p1.Slot())
	}
	_, err := sem.TryAcquire(ctx)
	if !errors.Is(err, ErrNoPermit) || !strings.Contains(err.Error(), "2 of 2 permits held") || !strings.Contains(err.Error(), `"exports"`) {
		t.Fatalf("third TryAcquire = %v, want ErrNoPermit naming the semaphore and saying 2 of 2 permits held", err)
	}
	slots, queued := slotLocks(t, dsn, sem)
	if len(slots) != 2 || queued {
		t.Fatalf("pg_locks: slots %v, queue %v; want 2 slots and no queue", slots, queued)
	}
	if n := holderRows(t, pool, "exports"); n != 2 {
		t.Fatalf("%d holder rows, want 2", n)
	}

	mustRelease(t, p1)
	if slots, _ := slotLocks(t, dsn, sem); len(slots) != 1 || slots[p2.Slot()] == 0 {
		t.Fatalf("after Release pg_locks has slots %v, want only %d", slots, p2.Slot())
	}
	if n := holderRows(t, pool, "exports"); n != 1 {
		t.Fatalf("%d holder rows after Release, want 1", n)
	}
	select {
	case <-p1.Done():
	default:
		t.Fatal("Done not closed after Release")
	}
	if err := p1.Err(); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("Err after Release = %v, want ErrNotHeld", err)
	}
	if err := p1.Release(ctx); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("second Release = %v, want ErrNotHeld", err)
	}
	p3 := mustAcquire(t, sem, false)
	mustRelease(t, p2)
	mustRelease(t, p3)
	if slots := awaitSettled(t, dsn, sem); len(slots) != 0 {
		t.Fatalf("pg_locks after all releases: slots %v", slots)
	}
	if n := holderRows(t, pool, "exports"); n != 0 {
		t.Fatalf("%d holder rows after all releases, want 0", n)
	}
}

// Holders lists each live holder with its identity, since and pid, oldest
// first, as pg_locks has them.
func TestSemaphoreHolders(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	a := newTestClient(t, dsn, WithApplicationName("sem-a"))
	b := newTestClient(t, dsn)
	semA := a.Semaphore("reports", 3)
	semB := b.Semaphore("reports", 3, WithIdentity("worker b"))

	before := time.Now()
	pa := mustAcquire(t, semA, true)
	pb := mustAcquire(t, semB, false)
	hs, err := semA.Holders(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(hs) != 2 {
		t.Fatalf("Holders = %+v, want 2", hs)
	}
	slots, _ := slotLocks(t, dsn, semA)
	host, _ := os.Hostname()
	wantA := fmt.Sprintf("sem-a@%s pid %d", host, os.Getpid())
	for i, want := range []struct {
		p        *Permit
		identity string
	}{{pa, wantA}, {pb, "worker b"}} {
		h := hs[i]
		if h.Slot != want.p.Slot() || h.Identity != want.identity || h.PID != slots[h.Slot] || h.PID != want.p.l.S.Pid {
			t.Errorf("holder %d = %+v, want slot %d, identity %q, pid %d (pg_locks: %d)", i, h, want.p.Slot(), want.identity, want.p.l.S.Pid, slots[h.Slot])
		}
		if h.Since.Before(before.Add(-time.Minute)) || h.Since.After(time.Now().Add(time.Minute)) {
			t.Errorf("holder %d since %v, want about now", i, h.Since)
		}
	}
	if !hs[0].Since.Before(hs[1].Since) && !hs[0].Since.Equal(hs[1].Since) {
		t.Errorf("Holders not oldest first: %+v", hs)
	}
	mustRelease(t, pa)
	hs, err = semB.Holders(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(hs) != 1 || hs[0].Identity != "worker b" {
		t.Fatalf("Holders after a release = %+v, want only worker b", hs)
	}
	mustRelease(t, pb)
}

// Never more than limit holders: 20 goroutines across 3 Clients take 1,000
// permits of a semaphore with limit 3. A counter outside the library, and
// pg_locks, never see more than 3 holders, and the counter does see 3.
func TestSemaphoreNeverOverLimit(t *testing.T) {
	const (
		limit      = 3
		goroutines = 20
		total      = 1000
	)
	dsn, pool := semaphoreDB(t)
	ctx := testCtx(t)
	var sems [3]*Semaphore
	for i := range sems {
		sems[i] = newTestClient(t, dsn).Semaphore("limited", limit)
	}
	var (
		started, inside, most atomic.Int64
		wg                    sync.WaitGroup
		errs                  = make(chan error, goroutines)
	)
	for g := range goroutines {
		sem := sems[g%len(sems)]
		wg.Go(func() {
			for started.Add(1) <= total {
				p, err := sem.Acquire(ctx)
				if err != nil {
					errs <- err
					return
				}
				n := inside.Add(1)
				for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
				}
				// The server agrees, while this permit is held.
				var held int
				err = pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted
					AND objsubid = 1 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
					AND ((classid::bigint << 32) | objid::bigint) >> 16 = $1
					AND ((classid::bigint << 32) | objid::bigint) & 65535 <> 65535`, sem.prefix).Scan(&held)
				if err == nil && (held < 1 || held > limit) {
					err = fmt.Errorf("pg_locks shows %d permits held while one is held, limit %d", held, limit)
				}
				inside.Add(-1)
				if rerr := p.Release(ctx); err == nil {
					err = rerr
				}
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
		t.Error(err)
	}
	if m := most.Load(); m != limit {
		t.Fatalf("at most %d holders at once, want exactly %d", m, limit)
	}
	if slots := awaitSettled(t, dsn, sems[0]); len(slots) != 0 {
		t.Fatalf("pg_locks at the end: slots %v", slots)
	}
}

// A holder whose backend is terminated loses its permit at once on the
// server: a blocked waiter in another Client gets it within a second, and
// Holders no longer lists the dead holder.
func TestSemaphoreHolderBackendTerminated(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	a := newTestClient(t, dsn).Semaphore("jobs", 1, WithIdentity("a"))
	b := newTestClient(t, dsn).Semaphore("jobs", 1, WithIdentity("b"))
	pa := mustAcquire(t, a, true)
	waiter := goAcquire(ctx, b)
	awaitHead(t, dsn, b)

	hs, err := a.Holders(ctx)
	if err != nil || len(hs) != 1 || hs[0].Identity != "a" {
		t.Fatalf("Holders = %+v, %v; want a", hs, err)
	}
	pgtest.Terminate(t, dsn, hs[0].PID)
	gone := time.Now()
	r := receivePermit(t, waiter)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if d := time.Since(gone); d > time.Second {
		t.Errorf("the waiter got the permit %v after the holder's backend ended, want within 1s", d)
	}
	select {
	case <-pa.Done():
	case <-time.After(testTimeout):
		t.Fatal("the dead holder's permit did not end")
	}
	if err := pa.Err(); !errors.Is(err, ErrLockLost) {
		t.Fatalf("dead holder's Err = %v, want ErrLockLost", err)
	}
	hs, err = b.Holders(ctx)
	if err != nil || len(hs) != 1 || hs[0].Identity != "b" || hs[0].PID != r.p.l.S.Pid {
		t.Fatalf("Holders after the death = %+v, %v; want only b on backend %d", hs, err, r.p.l.S.Pid)
	}
	mustRelease(t, r.p)
}

// A holder process that is killed frees its permit: a blocked waiter gets
// it within a second, and Holders no longer lists the dead holder. The
// holder is a child of the fault tests' kind (see startFaultChild).
func TestSemaphoreHolderProcessKilled(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	target := semaphoreTarget{"killed", 1}
	child := startFaultChild(t, "holder", dsn, target, "")
	_, childPid := child.held(t)

	sem := newTestClient(t, dsn).Semaphore(target.name, 1, WithIdentity("parent"))
	hs, err := sem.Holders(ctx)
	if err != nil || len(hs) != 1 || hs[0].Identity == "parent" || hs[0].PID != childPid {
		t.Fatalf("Holders = %+v, %v; want the child on backend %d", hs, err, childPid)
	}
	waiter := goAcquire(ctx, sem)
	awaitHead(t, dsn, sem)
	child.Signal(syscall.SIGKILL)
	killed := time.Now()
	r := receivePermit(t, waiter)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if d := time.Since(killed); d > time.Second {
		t.Errorf("the waiter got the permit %v after the holder process was killed, want within 1s", d)
	}
	hs, err = sem.Holders(ctx)
	if err != nil || len(hs) != 1 || hs[0].Identity != "parent" {
		t.Fatalf("Holders after the kill = %+v, %v; want only the parent", hs, err)
	}
	mustRelease(t, r.p)
}

// 100 permits of 10 semaphores held by one Client live on its shared
// backends: no connection per permit.
func TestSemaphorePermitsShareBackends(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	const app = "sem-economy"
	c := newTestClient(t, dsn, WithApplicationName(app))
	var permits []*Permit
	var sems []*Semaphore
	for i := range 10 {
		sem := c.Semaphore(fmt.Sprintf("economy-%d", i), 10)
		sems = append(sems, sem)
		for j := range 10 {
			permits = append(permits, mustAcquire(t, sem, j%2 == 0))
		}
	}
	st := c.Stat()
	if st.Backends > DefaultSharedBackends || st.Locks != 100 || st.Waits != 0 || st.Sessions != 0 {
		t.Fatalf("Stat = %+v, want at most %d backends holding 100 locks", st, DefaultSharedBackends)
	}
	rows, err := pool.Query(ctx, "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND datname = current_database()", app)
	if err != nil {
		t.Fatal(err)
	}
	var pids []int32
	for rows.Next() {
		var pid int32
		if err := rows.Scan(&pid); err != nil {
			t.Fatal(err)
		}
		pids = append(pids, pid)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(pids) == 0 || len(pids) > DefaultSharedBackends {
		t.Fatalf("pg_stat_activity shows %d connections of the Client (%v), want 1 to %d", len(pids), pids, DefaultSharedBackends)
	}
	n := 0
	for _, sem := range sems {
		slots, _ := slotLocks(t, dsn, sem)
		if len(slots) != 10 {
			t.Fatalf("pg_locks: %d slots of %s held, want 10", len(slots), sem.name)
		}
		for _, pid := range slots {
			if !slices.Contains(pids, pid) {
				t.Fatalf("a slot of %s is held by backend %d, not one of the Client's %v", sem.name, pid, pids)
			}
			n++
		}
	}
	if n != 100 {
		t.Fatalf("%d slots held, want 100", n)
	}
	for _, p := range permits {
		mustRelease(t, p)
	}
	if st := c.Stat(); st.Locks != 0 {
		t.Fatalf("Stat after releasing everything = %+v", st)
	}
}

// With limit 1 and four Clients acquiring in a loop for 10 s, every Client
// gets at least a fifth of its fair share.
func TestSemaphoreFairness(t *testing.T) {
	t.Parallel()
	const (
		clients  = 4
		duration = 10 * time.Second
	)
	dsn, _ := semaphoreDB(t)
	ctx := testCtx(t)
	var counts [clients]int
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	start := make(chan struct{})
	var stop atomic.Bool
	for i := range clients {
		sem := newTestClient(t, dsn).Semaphore("fair", 1)
		wg.Go(func() {
			<-start
			for !stop.Load() {
				p, err := sem.Acquire(ctx)
				if err != nil {
					errs <- err
					return
				}
				counts[i]++
				if err := p.Release(ctx); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	close(start)
	timer := time.AfterFunc(duration, func() { stop.Store(true) })
	defer timer.Stop()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	total := 0
	for _, n := range counts {
		total += n
	}
	t.Logf("acquisitions per Client in %v: %v", duration, counts)
	for i, n := range counts {
		if fair := total / clients; n < fair/5 || n == 0 {
			t.Errorf("Client %d got %d of %d permits, less than a fifth of its fair share %d", i, n, total, fair)
		}
	}
}

// Lowering the limit takes no permit away, and grants none until fewer
// than the new limit are held; raising it, by SetLimit or by SQL, wakes a
// waiter at once. The table's limit wins over the one a process passes.
func TestSemaphoreLimitChange(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	const heartbeat = 100 * time.Millisecond
	c := newTestClient(t, dsn, WithHeartbeat(heartbeat))
	sem := c.Semaphore("resize", 3)
	if n, err := sem.Limit(ctx); err != nil || n != 3 {
		t.Fatalf("Limit before first use = %d, %v; want 3", n, err)
	}
	ps := []*Permit{mustAcquire(t, sem, true), mustAcquire(t, sem, true), mustAcquire(t, sem, true)}
	var lowered time.Time // by the server's clock
	if err := pool.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&lowered); err != nil {
		t.Fatal(err)
	}
	if err := sem.SetLimit(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if n, err := sem.Limit(ctx); err != nil || n != 1 {
		t.Fatalf("Limit = %d, %v; want 1", n, err)
	}
	// Lowering the limit takes no permit away, also after two heartbeats
	// of every permit's backend: each has run a statement that began more
	// than 2H after the change, and still holds its slot in pg_locks.
	for _, p := range ps {
		pgtest.Eventually(t, testTimeout, "a heartbeat of the permit's backend 2H after the change", func() bool {
			var ran bool
			err := pool.QueryRow(ctx, "SELECT query_start > $2 FROM pg_stat_activity WHERE pid = $1", p.l.S.PID(), lowered.Add(2*heartbeat)).Scan(&ran)
			return err == nil && ran
		})
	}
	slots := permitLocks(t, dsn, semaphoreTarget{"resize", 3}).slots
	for _, p := range ps {
		if p.Err() != nil {
			t.Fatalf("a permit ended when the limit shrank: %v", p.Err())
		}
		if slots[p.Slot()] != p.l.S.PID() {
			t.Fatalf("2H after the limit shrank, pg_locks shows slots %v; want slot %d still granted to backend %d", slots, p.Slot(), p.l.S.PID())
		}
	}
	for len(ps) > 0 {
		if _, err := sem.TryAcquire(ctx); !errors.Is(err, ErrNoPermit) {
			t.Fatalf("TryAcquire with %d held and limit 1 = %v, want ErrNoPermit", len(ps), err)
		}
		// Release the lowest slot first, so that a free slot below the
		// new limit does not mean a free permit.
		mustRelease(t, ps[0])
		ps = ps[1:]
	}
	p := mustAcquire(t, sem, true)

	// Another process that says 5 gets the table's limit, 1.
	other := newTestClient(t, dsn).Semaphore("resize", 5)
	if n, err := other.Limit(ctx); err != nil || n != 1 {
		t.Fatalf("Limit from a process that says 5 = %d, %v; want the table's 1", n, err)
	}
	if _, err := other.TryAcquire(ctx); !errors.Is(err, ErrNoPermit) {
		t.Fatalf("TryAcquire over the table's limit = %v, want ErrNoPermit", err)
	}

	waiter := goAcquire(ctx, other)
	awaitHead(t, dsn, other)
	if err := sem.SetLimit(ctx, 2); err != nil {
		t.Fatal(err)
	}
	r := receivePermit(t, waiter)
	if r.err != nil {
		t.Fatal(r.err)
	}

	waiter = goAcquire(ctx, other)
	awaitHead(t, dsn, other)
	if _, err := pool.Exec(ctx, `UPDATE pgcoord.semaphores SET "limit" = 3 WHERE name = 'resize'`); err != nil {
		t.Fatal(err)
	}
	r2 := receivePermit(t, waiter)
	if r2.err != nil {
		t.Fatal(r2.err)
	}
	if slots, _ := slotLocks(t, dsn, sem); len(slots) != 3 {
		t.Fatalf("pg_locks: %d slots held, want 3", len(slots))
	}
	for _, p := range []*Permit{p, r.p, r2.p} {
		mustRelease(t, p)
	}
	if err := sem.SetLimit(ctx, 0); err == nil || !strings.Contains(err.Error(), "1 to 65535") {
		t.Fatalf("SetLimit(0) = %v, want an error saying the range", err)
	}
	if _, err := pool.Exec(ctx, `UPDATE pgcoord.semaphores SET "limit" = 0 WHERE name = 'resize'`); err == nil {
		t.Fatal("the table accepted limit 0")
	}
}

// An Acquire whose context ends while it waits, and acquires cut short at
// any point, leave no slot, queue place or row behind.
func TestSemaphoreCancelledAcquireLeavesNothing(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	a := newTestClient(t, dsn).Semaphore("cancel", 1)
	b := newTestClient(t, dsn).Semaphore("cancel", 1)
	held := mustAcquire(t, a, true)
	wctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	_, err := b.Acquire(wctx)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Acquire past its deadline = %v, want DeadlineExceeded", err)
	}
	slots, queued := slotLocks(t, dsn, a)
	if len(slots) != 1 || slots[held.Slot()] != held.l.S.Pid || queued {
		t.Fatalf("pg_locks after a cancelled Acquire: slots %v, queue %v; want only the holder's", slots, queued)
	}
	mustRelease(t, held)

	// Deadlines that end anywhere in an acquire, on a semaphore with free
	// permits: whatever was granted is a Permit, and nothing else stays.
	sem := newTestClient(t, dsn).Semaphore("cancel", 1)
	if err := sem.SetLimit(ctx, 4); err != nil {
		t.Fatal(err)
	}
	var ps []*Permit
	for i := range 60 {
		dctx, cancel := context.WithTimeout(ctx, time.Duration(i%30)*100*time.Microsecond)
		p, err := sem.Acquire(dctx)
		cancel()
		if err == nil {
			ps = append(ps, p)
		} else if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Acquire %d: %v", i, err)
		}
		if len(ps) == 4 || i%7 == 0 {
			for _, p := range ps {
				mustRelease(t, p)
			}
			ps = nil
		}
		if slots := awaitSettled(t, dsn, sem); len(slots) != len(ps) {
			t.Fatalf("after acquire %d: pg_locks slots %v; want %d permits", i, slots, len(ps))
		}
	}
	for _, p := range ps {
		mustRelease(t, p)
	}
	if n := holderRows(t, pool, "cancel"); n != 0 {
		t.Fatalf("%d holder rows left", n)
	}
}

// Closing a Client ends its permits (the slots are free at once) and makes
// its waiting Acquire return ErrClosed.
func TestSemaphoreClientClose(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	pool := pgtest.Pool(t, dsn)
	c, err := New(pool)
	if err != nil {
		t.Fatal(err)
	}
	sem := c.Semaphore("close", 1)
	p := mustAcquire(t, sem, true)
	waiter := goAcquire(ctx, sem)
	awaitHead(t, dsn, sem)
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if r := receivePermit(t, waiter); !errors.Is(r.err, ErrClosed) {
		t.Fatalf("waiting Acquire after Close = %v, want ErrClosed", r.err)
	}
	<-p.Done()
	if !errors.Is(p.Err(), ErrClosed) {
		t.Fatalf("permit Err after Close = %v, want ErrClosed", p.Err())
	}
	if slots, queued := slotLocks(t, dsn, sem); len(slots) != 0 || queued {
		t.Fatalf("pg_locks after Close: slots %v, queue %v", slots, queued)
	}
	if _, err := sem.TryAcquire(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("TryAcquire after Close = %v, want ErrClosed", err)
	}
}

// Bad input gets an error that says what is wrong, from every method.
func TestSemaphoreBadInput(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	c := newTestClient(t, dsn)
	for _, tc := range []struct {
		name  string
		limit int
		opts  []SemaphoreOption
		want  string
	}{
		{"", 1, nil, "name is empty"},
		{strings.Repeat("n", MaxSemaphoreName+1), 1, nil, "name is 1025 bytes long; at most 1024"},
		{strings.Repeat("n", 10_000), 1, nil, "name is 10000 bytes long"},
		{"a\x00b", 1, nil, "NUL byte"},
		{"bad\xffutf8", 1, nil, "not valid UTF-8"},
		{"ok", 0, nil, "limit 0 is out of range: it must be 1 to 65535"},
		{"ok", -1, nil, "limit -1 is out of range"},
		{"ok", MaxSemaphoreLimit + 1, nil, "limit 65536 is out of range"},
		{"ok", 1, []SemaphoreOption{nil}, "nil SemaphoreOption"},
		{"ok", 1, []SemaphoreOption{WithIdentity("")}, "identity is empty"},
		{"ok", 1, []SemaphoreOption{WithIdentity("x\x00")}, "identity \"x\\x00\" contains a NUL byte"},
	} {
		sem := c.Semaphore(tc.name, tc.limit, tc.opts...)
		_, err1 := sem.Acquire(ctx)
		_, err2 := sem.TryAcquire(ctx)
		_, err3 := sem.Holders(ctx)
		_, err4 := sem.Limit(ctx)
		err5 := sem.SetLimit(ctx, 2)
		for i, err := range []error{err1, err2, err3, err4, err5} {
			if err == nil || !strings.HasPrefix(err.Error(), "pgcoord: ") || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Semaphore(%s, %d) method %d: %v, want an error containing %q", core.QuoteName(tc.name), tc.limit, i, err, tc.want)
			}
		}
	}
	if st := c.Stat(); st.Backends != 0 {
		t.Fatalf("bad input opened connections: %+v", st)
	}
}

// Hostile names are data, never SQL: each is its own semaphore, and the
// tables are intact.
func TestSemaphoreHostileNames(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	c := newTestClient(t, dsn)
	names := []string{
		`'; DROP TABLE pgcoord.semaphores; --`,
		`"; DELETE FROM pgcoord.semaphore_holders; --`,
		`$1 $$ \x00 %s %d`,
		"tab\tnew\nline",
		"ünïcødé ☃",
		strings.Repeat("x", MaxSemaphoreName),
	}
	var ps []*Permit
	for _, name := range names {
		sem := c.Semaphore(name, 1, WithIdentity(`identity '); DROP TABLE x; --`))
		p := mustAcquire(t, sem, true)
		ps = append(ps, p)
		if _, err := sem.TryAcquire(ctx); !errors.Is(err, ErrNoPermit) {
			t.Fatalf("second TryAcquire of %s = %v, want ErrNoPermit", core.QuoteName(name), err)
		}
		hs, err := sem.Holders(ctx)
		if err != nil || len(hs) != 1 || hs[0].Identity != `identity '); DROP TABLE x; --` {
			t.Fatalf("Holders of %s = %+v, %v", core.QuoteName(name), hs, err)
		}
		if err := sem.SetLimit(ctx, 2); err != nil {
			t.Fatalf("SetLimit of %s: %v", core.QuoteName(name), err)
		}
	}
	var stored []string
	rows, err := pool.Query(ctx, "SELECT name FROM pgcoord.semaphores ORDER BY name")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			t.Fatal(err)
		}
		stored = append(stored, n)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	want := slices.Clone(names)
	slices.Sort(want)
	slices.Sort(stored)
	if !slices.Equal(stored, want) {
		t.Fatalf("semaphores table holds %q, want %q", stored, want)
	}
	for _, p := range ps {
		mustRelease(t, p)
	}
	for _, name := range []string{"nul\x00byte", strings.Repeat("y", 10_000)} {
		if _, err := c.Semaphore(name, 1).Acquire(ctx); err == nil {
			t.Fatalf("Acquire of %s succeeded", core.QuoteName(name))
		}
	}
}

// Without Migrate, every method that needs the tables says so.
func TestSemaphoreNotMigrated(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	sem := c.Semaphore("unmigrated", 1)
	_, err1 := sem.TryAcquire(ctx)
	_, err2 := sem.Acquire(ctx)
	_, err3 := sem.Holders(ctx)
	_, err4 := sem.Limit(ctx)
	err5 := sem.SetLimit(ctx, 2)
	for i, err := range []error{err1, err2, err3, err4, err5} {
		if !errors.Is(err, ErrNotMigrated) {
			t.Errorf("method %d without Migrate = %v, want ErrNotMigrated", i, err)
		}
	}
	if slots, queued := slotLocks(t, dsn, sem); len(slots) != 0 || queued {
		t.Fatalf("pg_locks: slots %v, queue %v", slots, queued)
	}
}

// Migrating down removes the semaphores' tables and functions.
func TestSemaphoreMigrateDown(t *testing.T) {
	ctx := testCtx(t)
	_, pool := semaphoreDB(t)
	if err := migrateDown(ctx, pool, 2); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_proc p JOIN pg_namespace s ON s.oid = p.pronamespace
		WHERE s.nspname = 'pgcoord' AND p.proname LIKE 'semaphore%'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("%d semaphore functions left after migrating down", n)
	}
	if err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
}

// The clean-up after a failed grant frees a slot that the backend holds on
// the server but not in its records, with its row, and keeps the others.
func TestSemaphoreCleanupAfterFailedGrant(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	sem := newTestClient(t, dsn).Semaphore("cleanup", 3)
	p := mustAcquire(t, sem, true)
	b := p.l.S
	stray := sem.slotKey(2)
	if err := b.Run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", mustInt64(keyOf(stray)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO pgcoord.semaphore_holders (name, slot, lock_key, pid, identity, since)
		VALUES ('cleanup', 2, $1, $2, 'stray', now())`, mustInt64(keyOf(stray)), b.Pid); err != nil {
		t.Fatal(err)
	}
	if err := b.Grab(ctx); err != nil {
		t.Fatal(err)
	}
	sem.cleanup(ctx, b, nil, true)
	b.Release()
	if err := b.Err(); err != nil {
		t.Fatalf("clean-up lost the backend: %v", err)
	}
	slots, _ := slotLocks(t, dsn, sem)
	if len(slots) != 1 || slots[p.Slot()] != b.Pid {
		t.Fatalf("pg_locks after clean-up: %v, want only slot %d on %d", slots, p.Slot(), b.Pid)
	}
	if n := holderRows(t, pool, "cleanup"); n != 1 {
		t.Fatalf("%d rows after clean-up, want the permit's only", n)
	}
	mustRelease(t, p)

	// A head whose queue key the server no longer holds loses it; a head
	// whose key is still held keeps it.
	q, err := sem.c.Lock(ctx, keyOf(sem.queueKey()))
	if err != nil {
		t.Fatal(err)
	}
	hb := q.core.S
	if err := hb.Grab(ctx); err != nil {
		t.Fatal(err)
	}
	sem.cleanup(ctx, hb, &q.core, true)
	hb.Release()
	if err := q.Err(); err != nil {
		t.Fatalf("clean-up ended a queue key the server holds: %v", err)
	}
	if err := hb.Run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, "SELECT pg_advisory_unlock($1)", mustInt64(keyOf(sem.queueKey())))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if err := hb.Grab(ctx); err != nil {
		t.Fatal(err)
	}
	sem.cleanup(ctx, hb, &q.core, true)
	hb.Release()
	if err := q.Err(); !errors.Is(err, ErrLockLost) {
		t.Fatalf("queue key released on the server: Err = %v, want ErrLockLost", err)
	}
	if hb.Err() != nil {
		t.Fatalf("clean-up lost the backend: %v", hb.Err())
	}
	l, err := sem.c.TryLock(ctx, keyOf(sem.queueKey()))
	if err != nil {
		t.Fatalf("the queue key is still taken in the process or on the server: %v", err)
	}
	mustUnlock(t, l)
}

// Waiters are served in the order they line up: with limit 1 and the
// permit held, four Clients' Acquires line up one after another (each seen
// in pg_locks, heading the queue or waiting for its key, before the next
// starts), and each release passes the permit to the next in that order.
// The loss deadline is a minute, so no wait slice ends during the test (a
// waiter rejoins PostgreSQL's queue at the end of each slice).
func TestSemaphoreServesInLineOrder(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	const waiters = 4
	opts := []Option{WithLossDeadline(time.Minute), WithHeartbeat(time.Second)}
	holder := newTestClient(t, dsn, opts...).Semaphore("line", 1)
	p := mustAcquire(t, holder, true)
	sems := make([]*Semaphore, waiters)
	chs := make([]<-chan permitResult, waiters)
	for i := range sems {
		sems[i] = newTestClient(t, dsn, opts...).Semaphore("line", 1)
		chs[i] = goAcquire(ctx, sems[i])
		// Lined up: the first heads the queue, each later one waits for
		// the queue key on the server.
		pgtest.Eventually(t, testTimeout, fmt.Sprintf("waiter %d to line up", i), func() bool {
			return len(grantedTo(t, dsn, keyOf(sems[0].queueKey()))) == 1 && waitingOn(t, dsn, keyOf(sems[0].queueKey())) == i
		})
	}
	for i := range sems {
		mustRelease(t, p)
		got := -1
		select {
		case r := <-chs[i]:
			if r.err != nil {
				t.Fatalf("waiter %d: %v", i, r.err)
			}
			p, got = r.p, i
		case <-time.After(testTimeout):
		}
		if got != i {
			for j := range sems {
				select {
				case r := <-chs[j]:
					t.Fatalf("after %d releases, waiter %d got the permit (%v), not waiter %d, which lined up before it", i+1, j, r.err, i)
				default:
				}
			}
			t.Fatalf("waiter %d did not get the permit within %v of its turn", i, testTimeout)
		}
		if st := permitLocks(t, dsn, semaphoreTarget{"line", 1}); len(st.slots) != 1 || st.slots[p.Slot()] != p.l.S.PID() {
			t.Fatalf("pg_locks after waiter %d's grant: slots %v, want only its slot %d on backend %d", i, st.slots, p.Slot(), p.l.S.PID())
		}
	}
	mustRelease(t, p)
}

// An Acquire at the head of the queue whose grant statement waits for the
// semaphore's row, which an uncommitted raise of the limit holds, has its
// ctx cancelled during that wait; the raise then commits. "If Acquire
// returns an error it holds nothing": no slot, no queue key, no row; and
// the raised limit is there for the next acquire.
func TestSemaphoreCancelWhileRowLockedLeavesNothing(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	const name = "cancel-row-locked"
	a := newTestClient(t, dsn).Semaphore(name, 1)
	b := newTestClient(t, dsn).Semaphore(name, 1)
	held := mustAcquire(t, a, true)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		p, err := b.Acquire(wctx)
		if p != nil {
			_ = p.Release(ctx)
		}
		done <- err
	}()
	pgtest.Eventually(t, testTimeout, "the Acquire heads the queue", func() bool {
		_, queued := slotLocks(t, dsn, a)
		return queued
	})
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, `UPDATE pgcoord.semaphores SET "limit" = 2 WHERE name = $1`, name); err != nil {
		t.Fatal(err)
	}
	// The head of a semaphore of limit 1 waits for slot 0 on the server
	// and looks at the row again only when told the limit changed, which
	// the raise will tell at its commit: tell it now, as often as it takes
	// (the wait may start just after a notice), and its grant waits for
	// the row.
	pgtest.Eventually(t, testTimeout, "the head's grant waits for the semaphore's row", func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'
			  AND wait_event IN ('transactionid', 'tuple') AND query LIKE '%semaphore_acquire%'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			if _, err := pool.Exec(ctx, "SELECT pg_notify($1, $2)", semaphoreChannel, a.payload+"limit"); err != nil {
				t.Fatal(err)
			}
		}
		return n >= 1
	})
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Acquire = %v, want context.Canceled", err)
		}
	case <-time.After(testTimeout):
		t.Fatal("Acquire did not return after its ctx was cancelled")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	slots, queued := slotLocks(t, dsn, a)
	if len(slots) != 1 || slots[held.Slot()] != held.l.S.Pid || queued {
		t.Fatalf("pg_locks after a cancelled Acquire: slots %v, queue %v; want only the holder's", slots, queued)
	}
	if n := holderRows(t, pool, name); n != 1 {
		t.Fatalf("%d holder rows, want the holder's only", n)
	}
	p := mustAcquire(t, b, true)
	mustRelease(t, p)
	mustRelease(t, held)
}
