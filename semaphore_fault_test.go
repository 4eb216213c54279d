package pgcoord

// Semaphores under the fault suite: a holder paused while its backend is
// terminated, a server restart and crash, the caller's pool recycling, the
// listener's connection terminated, and a waiting process killed. Each
// scenario checks the limit and the holders through pg_locks; where a
// holder is a real process it is the fault suite's holder child, with a
// semaphoreTarget. RELIABILITY.md lists the promises and bounds.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/anishathalye/porcupine"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// permitBound bounds how long a waiter at the head of a semaphore's queue
// takes to get a permit that became free: the recheck (250 ms) when the
// permit was freed by a backend's death or when its notification was lost,
// a notification otherwise, and a round trip; the rest is slack for a
// loaded machine.
const permitBound = time.Second

// semaphoreTarget is a permit of a semaphore, as a faultTarget. A
// semaphore has no fence: a hold's Fence is 0, and check refuses every
// write.
type semaphoreTarget struct {
	name  string
	limit int
}

func (s semaphoreTarget) String() string { return fmt.Sprintf("semaphore:%d:%s", s.limit, s.name) }

func parseSemaphoreTarget(s string) (faultTarget, error) {
	limit, name, _ := strings.Cut(s, ":")
	n, err := strconv.Atoi(limit)
	if err != nil || name == "" {
		return nil, fmt.Errorf("bad semaphore target %q, want LIMIT:NAME", s)
	}
	return semaphoreTarget{name, n}, nil
}

func (s semaphoreTarget) sem(c *Client) *Semaphore { return c.Semaphore(s.name, s.limit) }

// prefix is the upper 48 bits of every advisory lock key of the semaphore.
func (s semaphoreTarget) prefix() int64 { return semaphoreKey(DefaultSchema, s.name).V >> 16 }

func (s semaphoreTarget) acquire(ctx context.Context, c *Client) (faultHold, error) {
	p, err := s.sem(c).Acquire(ctx)
	if err != nil {
		return nil, err
	}
	return permitHold{p}, nil
}

func (s semaphoreTarget) check(context.Context, pgx.Tx, int64) error {
	return errors.New("a semaphore has no fence to check")
}

// holders returns the backends that hold a slot, and how many acquires
// are in line: the head, which holds the queue key, and those that wait
// for it.
func (s semaphoreTarget) holders(t testing.TB, dsn string) ([]int32, int) {
	t.Helper()
	st := permitLocks(t, dsn, s)
	var pids []int32
	for _, pid := range st.slots {
		pids = append(pids, pid)
	}
	slices.Sort(pids)
	return pids, len(st.head) + len(st.queued)
}

type permitHold struct{ *Permit }

func (h permitHold) Fence() Term                       { return 0 }
func (h permitHold) pid() int32                        { return h.l.S.PID() }
func (h permitHold) release(ctx context.Context) error { return h.Release(ctx) }

// permitState is a semaphore's locks as pg_locks shows them.
type permitState struct {
	slots    map[int]int32 // granted slots, and the backend of each
	head     []int32       // backends that hold the queue key
	queued   []int32       // backends that wait for it
	awaiting []int32       // backends that wait for slot 0
}

// permitLocks reads the locks of s from pg_locks; it fails the test if a
// slot is held twice, or awaited other than by the head of the queue of a
// semaphore of limit 1 waiting for slot 0 (see Semaphore.await).
func permitLocks(t testing.TB, dsn string, s semaphoreTarget) permitState {
	t.Helper()
	st := permitState{slots: map[int]int32{}}
	defer func() {
		if len(st.awaiting) == 0 {
			return
		}
		if s.limit != 1 || len(st.awaiting) > 1 || len(st.head) != 1 || st.awaiting[0] != st.head[0] {
			t.Fatalf("pg_locks: backends %v wait for slot 0 of %v (limit %d), whose queue key is held by %v: want only the head, and only for limit 1", st.awaiting, s, s.limit, st.head)
		}
	}()
	for k, hs := range lockState(t, dsn) {
		v, ok := k.Int64()
		if !ok || v>>16 != s.prefix() {
			continue
		}
		slot := int(v & queueSlot)
		for _, h := range hs {
			switch {
			case slot == queueSlot && h.granted:
				st.head = append(st.head, h.pid)
			case slot == queueSlot:
				st.queued = append(st.queued, h.pid)
			case !h.granted && slot == 0:
				st.awaiting = append(st.awaiting, h.pid)
			case !h.granted:
				t.Fatalf("pg_locks: backend %d waits for slot %d of %v", h.pid, slot, s)
			default:
				if prev, dup := st.slots[slot]; dup {
					t.Fatalf("pg_locks: slot %d of %v held by %d and %d", slot, s, prev, h.pid)
				}
				st.slots[slot] = h.pid
			}
		}
	}
	return st
}

// A permitWatch reads pg_locks every 10 ms, on a connection of its own that
// it reopens after a restart, and records the most slots of a semaphore
// granted at once and every reading that broke the limit (more slots than
// the limit, or a slot at or above it).
type permitWatch struct {
	target semaphoreTarget
	stop   chan struct{}
	done   chan struct{}
	// reached is closed at the first reading that shows the limit reached
	// (or broken, which finish reports).
	reached chan struct{}
	// Written by the watching goroutine, read after done is closed.
	most, polls int
	broken      []string
}

// watchPermits starts watching the semaphore of target in the database
// of dsn, for at most two minutes; finish stops it.
func watchPermits(t testing.TB, dsn string, target semaphoreTarget) *permitWatch {
	t.Helper()
	w := &permitWatch{target: target, stop: make(chan struct{}), done: make(chan struct{}), reached: make(chan struct{})}
	const sql = `SELECT count(*)::int, count(*) FILTER (WHERE k & 65535 >= $2)::int
		FROM (SELECT (classid::bigint << 32) | objid::bigint AS k FROM pg_catalog.pg_locks
			WHERE locktype = 'advisory' AND objsubid = 1 AND granted
			  AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())) l
		WHERE k >> 16 = $1 AND k & 65535 <> 65535`
	go func() {
		defer close(w.done)
		var conn *pgx.Conn
		defer func() {
			if conn != nil {
				conn.Close(context.Background())
			}
		}()
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		end := time.After(2 * time.Minute)
		for {
			select {
			case <-w.stop:
				return
			case <-end:
				w.broken = append(w.broken, "the watch ran for two minutes without being stopped")
				return
			case <-tick.C:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			if conn == nil {
				conn, _ = pgx.Connect(ctx, dsn) // the server may be restarting
			}
			var held, above int
			if conn != nil {
				if err := conn.QueryRow(ctx, sql, target.prefix(), target.limit).Scan(&held, &above); err != nil {
					conn.Close(ctx)
					conn = nil
				} else {
					w.polls++
					if held >= target.limit && w.most < target.limit {
						close(w.reached) // the first reading at the limit, or past it (reported below)
					}
					w.most = max(w.most, held)
					if held > target.limit || above > 0 {
						w.broken = append(w.broken, fmt.Sprintf("%s: %d slots granted, %d of them at or above the limit %d",
							time.Now().Format("15:04:05.000"), held, above, target.limit))
					}
				}
			}
			cancel()
		}
	}()
	return w
}

// awaitLimit waits until the watch has read the limit reached in pg_locks.
// Call it while the limit is held: a test that is over before the watch's
// first readings would otherwise prove nothing and fail in finish.
func (w *permitWatch) awaitLimit(t testing.TB) {
	t.Helper()
	select {
	case <-w.reached:
	case <-w.done:
		t.Fatalf("pg_locks: the watch of %v stopped before it read the limit reached", w.target)
	case <-time.After(testTimeout):
		t.Fatalf("pg_locks: the watch of %v did not read the limit reached within %v while it was held", w.target, testTimeout)
	}
}

// finish stops the watch and fails the test if the limit was ever broken,
// or if the watch never saw the limit reached (it would have proved
// nothing).
func (w *permitWatch) finish(t testing.TB) {
	t.Helper()
	close(w.stop)
	<-w.done
	for _, b := range w.broken {
		t.Error("pg_locks:", b)
	}
	if w.most != w.target.limit {
		t.Errorf("pg_locks: at most %d slots of %v granted at once in %d readings, want the limit %d reached", w.most, w.target, w.polls, w.target.limit)
	}
	t.Logf("pg_locks read %d times: at most %d of %d permits held at once", w.polls, w.most, w.target.limit)
}

// A holder process paused (SIGSTOP) while its backend is terminated: the
// server frees its permit at once, so an acquire that heads the queue gets
// it within permitBound (no notification comes for a death: the head's
// 250 ms recheck finds it). After SIGCONT the paused holder reports the
// loss (Done closed, Err wraps ErrLockLost) within the heartbeat bound 2H,
// and its Release says so and frees nothing of the new holder's. pg_locks,
// read every 10 ms throughout, never shows more than the limit (2) of
// slots granted.
func TestSemaphoreFaultPausedHolder(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := faultDB(t)
	target := semaphoreTarget{"paused", 2}
	watch := watchPermits(t, dsn, target)
	mine, err := target.acquire(ctx, newTestClient(t, dsn))
	if err != nil {
		t.Fatal(err)
	}
	p := startFaultChild(t, "holder", dsn, target, "")
	_, oldPID := p.held(t)
	if pids, _ := target.holders(t, dsn); !slices.Equal(pids, sorted(mine.pid(), oldPID)) {
		t.Fatalf("pg_locks: %v held by %v, want backends %d and %d", target, pids, mine.pid(), oldPID)
	}
	watch.awaitLimit(t)

	ch := startContender(t, ctx, target, newTestClient(t, dsn), dsn)
	p.Signal(syscall.SIGSTOP)
	pgtest.Terminate(t, dsn, oldPID)
	faulted := time.Now()
	r := <-ch
	if r.err != nil {
		t.Fatalf("contender: %v", r.err)
	}
	took := r.at.Sub(faulted)
	t.Logf("the head of the queue got the permit %v after the paused holder's backend ended", took.Round(time.Millisecond))
	if took > permitBound {
		t.Errorf("the head of the queue got the permit %v after the holder's backend ended, want within %v", took, permitBound)
	}
	want := sorted(mine.pid(), r.h.pid())
	if pids, waiting := target.holders(t, dsn); !slices.Equal(pids, want) || waiting != 0 {
		t.Fatalf("pg_locks after the takeover: held by %v with %d in line, want %v and nobody in line", pids, waiting, want)
	}

	p.Signal(syscall.SIGCONT)
	p.awaitLossReported(t, "the paused holder", time.Now(), "SIGCONT")
	p.Send(t, "release")
	if f := p.await(t, "released", testTimeout); !strings.Contains(strings.Join(f, " "), strings.TrimPrefix(ErrLockLost.Error(), core.Prefix)) {
		t.Fatalf("the paused holder's Release: %q, want ErrLockLost", f)
	}
	if pids, _ := target.holders(t, dsn); !slices.Equal(pids, want) {
		t.Fatalf("pg_locks after the old holder's Release: held by %v, want %v", pids, want)
	}
	for _, h := range []faultHold{mine, r.h} {
		if err := h.release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	watch.finish(t)
}

// sorted returns the pids in ascending order.
func sorted(pids ...int32) []int32 {
	slices.Sort(pids)
	return pids
}

// A server restart (fast shutdown) and a crash (SIGKILL of the postmaster)
// end every backend: both permits of a semaphore with limit 2, held by two
// Clients, report ErrLockLost within 2H of the server's return, and an
// Acquire that headed the queue meanwhile either gets a permit once the
// server is back or returns an error holding nothing. The same Clients then
// take both permits again, a third is refused (ErrNoPermit), and Holders
// lists only the new holders. (A permit granted to the waiter on the old
// server, as the holders' backends ended before its own, is reported lost
// like theirs.) pg_locks, read every 10 ms throughout (on a
// connection reopened after the fault), never shows more than 2 slots.
func TestSemaphoreFaultServerRestart(t *testing.T) {
	t.Parallel()
	for _, fault := range []string{"restart", "crash"} {
		t.Run(fault, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			srv := pgtest.NewServer(t)
			dsn := srv.DB(t)
			pool := faultTables(t, dsn)
			target := semaphoreTarget{"restart-" + fault, 2}
			watch := watchPermits(t, dsn, target)
			var sems []*Semaphore
			for range 3 {
				sems = append(sems, target.sem(newTestClient(t, dsn)))
			}
			held := []*Permit{mustAcquire(t, sems[0], true), mustAcquire(t, sems[1], true)}
			watch.awaitLimit(t)
			waiter := goAcquire(ctx, sems[2])
			awaitHead(t, dsn, sems[2])

			if fault == "restart" {
				srv.Restart(t)
			} else {
				srv.Crash(t)
			}
			back := time.Now()
			pool.Reset()
			awaitLost(t, held, func(i int) string { return fmt.Sprintf("permit %d", i) }, back, "the server came back")

			var extra *Permit // the waiter's, if it got one
			if r := receivePermit(t, waiter); r.err != nil {
				t.Fatalf("the waiter's Acquire across the %s: %v; a blocking Acquire rides through a restart", fault, r.err)
			} else {
				extra = r.p
				t.Logf("the waiter got slot %d after the %s", extra.Slot(), fault)
			}
			st := permitLocks(t, dsn, target)
			if extra != nil && st.slots[extra.Slot()] != extra.l.S.PID() {
				// Granted on the old server, between the holders' deaths
				// and its own backend's: it must report the loss too.
				awaitLost(t, []*Permit{extra}, func(int) string { return "the waiter's permit, not in pg_locks," }, back, "the server came back")
				t.Logf("the waiter's permit was granted before the %s and reported lost: %v", fault, extra.Err())
				extra = nil
			}
			if extra == nil && len(st.slots) != 0 || extra != nil && (len(st.slots) != 1 || st.slots[extra.Slot()] != extra.l.S.PID()) {
				t.Fatalf("pg_locks after the %s: slots %v; want none, or the waiter's", fault, st.slots)
			}
			again := []*Permit{mustAcquire(t, sems[0], false)}
			if extra != nil {
				if _, err := sems[1].TryAcquire(ctx); !errors.Is(err, ErrNoPermit) {
					t.Fatalf("a third permit: %v, want ErrNoPermit", err)
				}
				mustRelease(t, extra)
			}
			again = append(again, mustAcquire(t, sems[1], false))
			if _, err := sems[2].TryAcquire(ctx); !errors.Is(err, ErrNoPermit) {
				t.Fatalf("a third permit after the Clients acquired again: %v, want ErrNoPermit", err)
			}
			hs, err := sems[2].Holders(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var got, want []int32
			for i, h := range hs {
				got, want = append(got, h.PID), append(want, again[i].l.S.PID())
			}
			slices.Sort(got)
			slices.Sort(want)
			if !slices.Equal(got, want) {
				t.Fatalf("Holders after the %s: %+v, want backends %v", fault, hs, want)
			}
			for _, p := range again {
				mustRelease(t, p)
			}
			watch.finish(t)
		})
	}
}

// The Client's listener connection is terminated while an Acquire heads
// the queue, and the only permit is released at once, before the listener
// can be back: its notification is lost, and the head gets the permit
// through its 250 ms recheck, or through the resync when the listener
// reconnects, within permitBound. The listener reconnects (a new backend
// LISTENs under the Client's application name), and a later release wakes
// the next head through it, within permitBound too.
func TestSemaphoreFaultListenerTerminated(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	const app = "sem-listener"
	target := semaphoreTarget{"listener", 1}
	holder := target.sem(newTestClient(t, dsn))
	wc := newTestClient(t, dsn, WithApplicationName(app))
	// The head's re-check, which would find the permit within 250 ms
	// whatever the listener does, is out of the way: the permit must come
	// through the notification or the listener's resync.
	wc.semaphoreRecheck = time.Hour
	waiter := target.sem(wc)
	listeners := func() []int32 {
		rows, err := pool.Query(ctx, "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN %' ORDER BY pid", app)
		if err != nil {
			t.Fatal(err)
		}
		pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			t.Fatal(err)
		}
		return pids
	}
	// wake releases p while waiter heads the queue, and returns how long
	// the head took to get the permit.
	wake := func(p *Permit, ch <-chan permitResult, before func()) (*Permit, time.Duration) {
		t.Helper()
		awaitHead(t, dsn, waiter)
		before()
		released := time.Now()
		mustRelease(t, p)
		r := receivePermit(t, ch)
		if r.err != nil {
			t.Fatal(r.err)
		}
		return r.p, time.Since(released)
	}

	hp := mustAcquire(t, holder, true)
	ch := goAcquire(ctx, waiter)
	var old []int32
	wp, took := wake(hp, ch, func() {
		pgtest.Eventually(t, testTimeout, "the waiter's Client to listen", func() bool {
			old = listeners()
			return len(old) == 1
		})
		pgtest.Terminate(t, dsn, old[0])
	})
	t.Logf("with the listener terminated, the head got the permit %v after the release", took.Round(time.Millisecond))
	if took > permitBound {
		t.Errorf("with the listener terminated, the head got the permit %v after the release, want within %v", took, permitBound)
	}
	if st := permitLocks(t, dsn, target); len(st.slots) != 1 || st.slots[wp.Slot()] != wp.l.S.PID() {
		t.Fatalf("pg_locks: slots %v, want only the waiter's", st.slots)
	}

	pgtest.Eventually(t, testTimeout, "the listener to reconnect", func() bool {
		now := listeners()
		return len(now) == 1 && now[0] != old[0]
	})
	mustRelease(t, wp)
	hp = mustAcquire(t, holder, true)
	ch = goAcquire(ctx, waiter)
	wp, took = wake(hp, ch, func() {})
	t.Logf("through the reconnected listener, the head got the permit %v after the release", took.Round(time.Millisecond))
	if took > permitBound {
		t.Errorf("through the reconnected listener, the head got the permit %v after the release, want within %v", took, permitBound)
	}
	mustRelease(t, wp)
	if st := awaitSettled(t, dsn, waiter); len(st) != 0 {
		t.Fatalf("pg_locks at the end: slots %v", st)
	}
}

// A waiting process killed with SIGKILL leaves the semaphore's queue, both
// when it heads the queue (holding the queue key: the kernel closes its
// socket and the server frees the key at once) and when it waits behind the
// head (its backend notices the closed socket within
// client_connection_check_interval, 1 s, although the child's loss deadline
// of 30 s makes each slice of its wait last 14.5 s). pg_locks shows none
// of its backends on the queue key within 1 s plus a second of slack, the
// other waiter heads the queue, and it gets the permit within permitBound
// of its release: the dead waiter blocks nobody.
func TestSemaphoreFaultKilledWaiter(t *testing.T) {
	t.Parallel()
	for _, head := range []bool{true, false} {
		name := map[bool]string{true: "head", false: "queued"}[head]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			dsn, _ := faultDB(t)
			target := semaphoreTarget{"killed-waiter-" + name, 1}
			holder := target.sem(newTestClient(t, dsn))
			hp := mustAcquire(t, holder, true)
			other := target.sem(newTestClient(t, dsn))
			var (
				p     *faultProc
				ch    <-chan permitResult
				child int32 // the child's backend on the queue key
			)
			startChild := func(inLine int) {
				p = startFaultChild(t, "holder", dsn, target, childOptions(30*time.Second, DefaultHeartbeat))
				pgtest.Eventually(t, testTimeout, "the child to line up", func() bool {
					st := permitLocks(t, dsn, target)
					if head && len(st.head) == 1 {
						child = st.head[0]
					} else if !head && len(st.queued) == 1 {
						child = st.queued[0]
					}
					return len(st.head)+len(st.queued) == inLine && child != 0
				})
			}
			if head {
				startChild(1)
				ch = goAcquire(ctx, other)
				pgtest.Eventually(t, testTimeout, "the other acquire to wait behind the child", func() bool {
					return len(permitLocks(t, dsn, target).queued) == 1
				})
			} else {
				ch = goAcquire(ctx, other)
				awaitHead(t, dsn, other)
				startChild(2)
			}

			killed := time.Now()
			p.Kill(t)
			const bound = 2 * time.Second // client_connection_check_interval, and slack
			var st permitState
			pgtest.Eventually(t, testTimeout, "the killed waiter to leave the queue", func() bool {
				st = permitLocks(t, dsn, target)
				return !slices.Contains(st.head, child) && !slices.Contains(st.queued, child) && len(st.head) == 1
			})
			took := time.Since(killed)
			t.Logf("the killed waiter left the queue %v after the kill", took.Round(time.Millisecond))
			if took > bound {
				t.Errorf("the killed waiter left the queue %v after the kill, want within %v", took, bound)
			}
			if len(st.queued) != 0 {
				t.Fatalf("pg_locks: %v waiting for the queue key after the kill, want nobody", st.queued)
			}

			released := time.Now()
			mustRelease(t, hp)
			r := receivePermit(t, ch)
			if r.err != nil {
				t.Fatal(r.err)
			}
			if d := time.Since(released); d > permitBound {
				t.Errorf("the other waiter got the permit %v after the release, want within %v", d, permitBound)
			}
			if slots := awaitSettled(t, dsn, other); len(slots) != 1 || slots[r.p.Slot()] != r.p.l.S.PID() {
				t.Fatalf("pg_locks: slots %v, want only the other waiter's", slots)
			}
			mustRelease(t, r.p)
		})
	}
}

// A caller's pool that recycles aggressively does not touch the permits of
// a Client built on it (see TestFaultPoolRecycling): both permits of a
// semaphore, held 10 s while the caller uses the pool, stay on the same
// backends (pg_locks), do not end, and are still listed by Holders.
func TestSemaphoreFaultPoolRecycling(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := recyclingPool(t)
	target := semaphoreTarget{"recycled", 2}
	sem := target.sem(newTestClientOn(t, pool))
	permits := []*Permit{mustAcquire(t, sem, true), mustAcquire(t, sem, false)}
	want := map[int]int32{}
	for _, p := range permits {
		want[p.Slot()] = p.l.S.PID()
	}
	check := func() {
		t.Helper()
		if st := permitLocks(t, dsn, target); !maps.Equal(st.slots, want) {
			t.Fatalf("pg_locks: slots %v, want %v", st.slots, want)
		}
		hs, err := sem.Holders(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(hs) != len(want) {
			t.Fatalf("Holders: %+v, want %v", hs, want)
		}
	}
	alive := func() {
		t.Helper()
		for _, p := range permits {
			select {
			case <-p.Done():
				t.Fatalf("permit %d ended while the pool recycled: %v", p.Slot(), p.Err())
			default:
			}
		}
	}
	check()
	useRecyclingPool(t, pool, check, alive)
	for _, p := range permits {
		mustRelease(t, p)
	}
	if st := permitLocks(t, dsn, target); len(st.slots) != 0 {
		t.Fatalf("pg_locks after Release: slots %v", st.slots)
	}
}

// Permits in the soak (see soak_test.go). A soak child's round on a
// semaphore acquires a permit (waiting at most 3 s), records in
// soak_permits, at the start and at the end of its critical section, that
// the server holds the permit's slot for the permit's backend (the same
// backend: pid and start time), and releases the permit. Two checks follow:
//
//   - The history of acquires and releases, as the children saw them, is
//     checked with porcupine against soakPermitModel: a permit takes a free
//     slot below the limit, and holds it until it ends. A permit released
//     without error ended within its Release; any other permit (lost,
//     failed release, child killed) ended after the server was last seen
//     holding its slot, and at most soakClosedBound after its Release
//     returned an error or its process was reaped (either closed its
//     connection, and the server frees a closed connection's locks at
//     once).
//   - The intervals recorded with both ends verified are intervals in
//     which the server held the slot for that backend: no two of them for
//     one slot may overlap, and no more than the limit at any instant.
//
// A recording that finds the slot not held on the server is a permit the
// library believes held although it is not: the permit must report the
// loss (Done closed, Err wrapping ErrLockLost) within soakLossBound, or
// the round reports a silent loss (soakAwaitLoss).

// soakSemaphore is the semaphore of the soak.
var soakSemaphore = semaphoreTarget{"soak-permits", 2}

// soakLossBound bounds how long a soak child waits for a hold (a permit, a
// lock, a leadership) that the server no longer holds to report the loss: the heartbeat bound 2H after
// the server ended the backend, plus the longest pause the soak injects
// (twice the loss deadline of 2 s), with slack for a loaded machine.
const soakLossBound = 15 * time.Second

const soakPermitsTable = `CREATE TABLE soak_permits (
	op            text PRIMARY KEY,
	slot          integer NOT NULL,
	pid           integer NOT NULL,
	backend_start timestamptz NOT NULL,
	t_from        timestamptz NOT NULL,
	t_to          timestamptz)`

// Both recordings find the slot granted to the permit's backend in pg_locks.
const (
	soakPermitOpenSQL = `INSERT INTO soak_permits (op, slot, pid, backend_start, t_from)
		SELECT $1, $2, a.pid, a.backend_start, clock_timestamp() FROM pg_stat_activity a
		WHERE a.pid = $3 AND EXISTS (SELECT FROM pg_locks l
			WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
			  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
			  AND ((l.classid::bigint << 32) | l.objid::bigint) = $4)`
	soakPermitCloseSQL = `UPDATE soak_permits s SET t_to = clock_timestamp() FROM pg_stat_activity a
		WHERE s.op = $1 AND a.pid = s.pid AND a.backend_start = s.backend_start AND EXISTS (SELECT FROM pg_locks l
			WHERE l.pid = s.pid AND l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
			  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
			  AND ((l.classid::bigint << 32) | l.objid::bigint) = $2)`
)

// soakRound is a soak child's round on the semaphore s; id names it.
func (s semaphoreTarget) soakRound(ctx context.Context, c *Client, pool *pgxpool.Pool, id string, emit func(soakEvent)) {
	emit(soakEvent{Ev: "call", ID: id, Op: "permit", Target: s.String()})
	actx, cancel := context.WithTimeout(ctx, 3*time.Second)
	p, err := s.sem(c).Acquire(actx)
	cancel()
	if err != nil {
		emit(soakEvent{Ev: "ret", ID: id, Result: "error", Err: err.Error()})
		time.Sleep(50 * time.Millisecond) // the server may be restarting
		return
	}
	emit(soakEvent{Ev: "ret", ID: id, Result: "ok", Fence: int64(p.Slot()) + 1})
	key := s.prefix()<<16 | int64(p.Slot())
	// record runs one recording; it reports false when the server did
	// not hold the slot, after checking that the permit reported it.
	record := func(sql string, args ...any) (held, ok bool) {
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		tag, err := pool.Exec(rctx, sql, args...)
		cancel()
		if err != nil {
			return false, false // the server may be restarting: no verdict
		}
		if tag.RowsAffected() == 1 {
			return true, true
		}
		soakAwaitLoss(id, s.String(), fmt.Sprintf("the server does not hold slot %d", p.Slot()), p, emit)
		return false, true
	}
	var verified int64 // when a recording that found the slot held started
	if held, _ := record(soakPermitOpenSQL, id, int32(p.Slot()), p.l.S.PID(), key); held {
		time.Sleep(time.Duration(5+rand.IntN(25)) * time.Millisecond) // the critical section's work
		from := time.Now().UnixNano()
		if held, _ := record(soakPermitCloseSQL, id, key); held {
			verified = from
		}
	}
	emit(soakEvent{Ev: "call", ID: id + "/release", Op: "unpermit", Target: s.String(), From: verified})
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	err = p.Release(rctx)
	cancel()
	if err != nil {
		emit(soakEvent{Ev: "ret", ID: id + "/release", Result: "error", Err: err.Error()})
	} else {
		emit(soakEvent{Ev: "ret", ID: id + "/release", Result: "ok"})
	}
}

// permitOperations turns the acquire id of a permit, with its release,
// into porcupine operations: the acquire, and the permit's end. A permit
// released without error ended within its Release; any other (lost,
// failed release, child killed) ended after the server was last seen
// holding its slot (or after its acquire returned) and no later than
// endBy.
func (h *soakHistory) permitOperations(id string, call soakEvent, f *soakFigures) []porcupine.Operation {
	ret, returned := h.rets[id]
	acq := porcupine.Operation{Input: soakInput{Op: "permit", Target: call.Target, Holder: id}, Call: call.T, Output: soakOutput{}, Return: math.MaxInt64}
	if returned {
		acq.Return = ret.T
	}
	if !returned || ret.Result != "ok" {
		// An Acquire that failed holds nothing; one cut short by a kill
		// held nothing beyond the death of its process.
		f.permitFailed++
		return []porcupine.Operation{acq}
	}
	f.permits++
	acq.Output = soakOutput{Fence: ret.Fence}
	rcall, called := h.calls[id+"/release"]
	end := porcupine.Operation{Input: soakInput{Op: "unpermit", Target: call.Target, Holder: id, Fence: ret.Fence}, Call: max(ret.T, rcall.From), Output: soakOutput{}, Return: h.endBy(id)}
	if rret, ok := h.rets[id+"/release"]; called && ok && rret.Result == "ok" {
		end.Call, end.Return = rcall.T, rret.T
		f.permitsReleased++
	}
	return []porcupine.Operation{acq, end}
}

// soakPermitModel is a semaphore with limit slots. The state names the
// holder of each slot ("" for none), separated by NUL bytes. A permit
// granted slot s takes effect when s was free and below the limit; an
// acquire that returned no slot changes nothing; a permit's end frees its
// slot.
func soakPermitModel(limit int) porcupine.Model {
	m := &porcupine.NondeterministicModel{
		Init: func() []any { return []any{strings.Repeat("\x00", limit-1)} },
		Step: func(state, input, output any) []any {
			slots, in, out := strings.Split(state.(string), "\x00"), input.(soakInput), output.(soakOutput)
			switch {
			case in.Op == "permit" && out.Fence == 0:
				return []any{state}
			case in.Op == "permit" && out.Fence <= int64(limit) && slots[out.Fence-1] == "":
				slots[out.Fence-1] = in.Holder
			case in.Op == "unpermit" && in.Fence <= int64(limit) && slots[in.Fence-1] == in.Holder:
				slots[in.Fence-1] = ""
			default:
				return nil
			}
			return []any{strings.Join(slots, "\x00")}
		},
		DescribeOperation: func(input, output any) string {
			in, out := input.(soakInput), output.(soakOutput)
			if in.Op == "unpermit" {
				return fmt.Sprintf("%s ends slot %d", in.Holder, in.Fence-1)
			}
			if out.Fence == 0 {
				return in.Holder + " acquires nothing"
			}
			return fmt.Sprintf("%s acquires slot %d", in.Holder, out.Fence-1)
		},
		DescribeState: func(state any) string { return strings.ReplaceAll(state.(string), "\x00", " | ") },
	}
	return m.ToModel()
}

// The permit checker accepts a legal history (a slot taken again after
// its release, or after a lost permit that may have ended any time), and
// catches a slot granted twice, a slot at the limit, and a permit's end
// without its acquire.
func TestFaultSoakPermitChecker(t *testing.T) {
	t.Parallel()
	model := soakPermitModel(2)
	acq := func(who string, call, ret int64, slot int) porcupine.Operation {
		return porcupine.Operation{Input: soakInput{Op: "permit", Target: "s", Holder: who}, Call: call, Output: soakOutput{Fence: int64(slot + 1)}, Return: ret}
	}
	end := func(who string, call, ret int64, slot int) porcupine.Operation {
		return porcupine.Operation{Input: soakInput{Op: "unpermit", Target: "s", Holder: who, Fence: int64(slot + 1)}, Call: call, Output: soakOutput{}, Return: ret}
	}
	for _, tc := range []struct {
		name  string
		ops   []porcupine.Operation
		legal bool
	}{
		{"legal", []porcupine.Operation{acq("a", 0, 1, 0), acq("b", 0, 2, 1), acq("c", 0, math.MaxInt64, -1), end("a", 3, 4, 0), acq("d", 5, 6, 0), end("b", 7, 8, 1), end("d", 7, 8, 0)}, true},
		{"after a loss", []porcupine.Operation{acq("a", 0, 1, 0), end("a", 1, math.MaxInt64, 0), acq("b", 2, 3, 0), end("b", 4, 5, 0)}, true},
		{"slot granted twice", []porcupine.Operation{acq("a", 0, 1, 0), acq("b", 2, 3, 0), end("a", 4, 5, 0)}, false},
		{"slot at the limit", []porcupine.Operation{acq("a", 0, 1, 2)}, false},
		{"three held", []porcupine.Operation{acq("a", 0, 1, 0), acq("b", 0, 1, 1), end("a", 4, 5, 0), end("b", 4, 5, 1), acq("c", 2, 3, 1)}, false},
		{"end without acquire", []porcupine.Operation{end("a", 0, 1, 0)}, false},
	} {
		err := checkSoakHistory(model, tc.ops, time.Minute)
		if (err == nil) != tc.legal {
			t.Errorf("%s: %v, want legal=%v", tc.name, err, tc.legal)
		}
		if err != nil {
			_ = os.Remove(strings.TrimPrefix(err.Error(), "history is not linearizable: see "))
		}
	}
}

// checkSoakPermits checks the intervals recorded in soak_permits (see
// above), and that at least floor critical sections were verified at both
// ends, and logs the figures with the children's loss reports.
func checkSoakPermits(t *testing.T, pool *pgxpool.Pool, h *soakHistory, f *soakFigures, floor int) {
	t.Helper()
	limit := soakSemaphore.limit
	rows, err := pool.Query(testCtx(t), "SELECT op, slot, t_from, t_to FROM soak_permits WHERE t_to IS NOT NULL ORDER BY t_from")
	if err != nil {
		t.Fatal(err)
	}
	type interval struct {
		Op       string
		Slot     int32
		From, To time.Time
	}
	spans, err := pgx.CollectRows(rows, pgx.RowToStructByPos[interval])
	if err != nil {
		t.Fatal(err)
	}
	var open int
	if err := pool.QueryRow(testCtx(t), "SELECT count(*) FROM soak_permits WHERE t_to IS NULL").Scan(&open); err != nil {
		t.Fatal(err)
	}
	// Ordered by start: a slot overlaps when it starts before the end of
	// the slot's previous interval; the holders at once are the intervals
	// started and not yet ended.
	overlaps, most := 0, 0
	last := map[int32]interval{}
	var ends []time.Time // of the intervals started so far, not yet ended
	for _, s := range spans {
		if s.Slot < 0 || int(s.Slot) >= limit {
			overlaps++
			t.Errorf("soak_permits: %s held slot %d of a semaphore with limit %d", s.Op, s.Slot, limit)
		}
		if prev, ok := last[s.Slot]; ok && s.From.Before(prev.To) {
			overlaps++
			t.Errorf("soak_permits: slot %d held by %s from %v and by %s until %v", s.Slot, s.Op, s.From, prev.Op, prev.To)
		}
		if prev, ok := last[s.Slot]; !ok || s.To.After(prev.To) {
			last[s.Slot] = s
		}
		ends = slices.DeleteFunc(ends, func(e time.Time) bool { return !e.After(s.From) })
		ends = append(ends, s.To)
		most = max(most, len(ends))
		if len(ends) > limit {
			t.Errorf("soak_permits: %d permits held at %v, limit %d", len(ends), s.From, limit)
		}
	}
	var reported, silent int // silent ones fail TestFaultSoak
	for _, e := range h.losses {
		switch {
		case e.Target != soakSemaphore.String():
		case e.Result == "reported":
			reported++
		default:
			silent++
		}
	}
	t.Logf("permits of %v: %d granted (%d released cleanly), %d acquires failed or cut short; "+
		"%d critical sections verified on the server at both ends (%d not at the end), at most %d held at once, %d overlapping; "+
		"%d permits found not held by the server and reported lost, %d lost silently",
		soakSemaphore, f.permits, f.permitsReleased, f.permitFailed, len(spans), open, most, overlaps, reported, silent)
	if len(spans) < floor {
		t.Errorf("soak_permits: %d critical sections verified at both ends, want at least %d", len(spans), floor)
	}
}

// A failover: the primary stops while one Client holds the only permit and
// another's Acquire heads the queue; a third Acquire starts while only the
// standby is up. Both blocking Acquires ride through the failover: the
// held permit is reported lost, and once the standby is promoted, the
// waiters get the permit there in turn, under the limit that was set on
// the old primary (read back from the new primary's pg_locks and tables).
func TestSemaphoreFaultFailover(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	primary := pgtest.NewServer(t)
	pdsn := primary.DB(t)
	migrated(t, pdsn)
	cfg, err := pgx.ParseConfig(pdsn)
	if err != nil {
		t.Fatal(err)
	}
	standby := primary.StartStandby(t)
	sdsn := standby.ConnString(cfg.Database)
	both := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/%s?sslmode=disable", primary.Port(), standby.Port(), cfg.Database)
	target := semaphoreTarget{"failover", 2}
	var sems []*Semaphore
	for range 3 {
		sems = append(sems, target.sem(newTestClientOn(t, pgtest.Pool(t, both))))
	}
	// The limit set on the primary, lower than the one the Semaphores
	// were made with, must be the one that holds on the new primary.
	if err := sems[0].SetLimit(ctx, 1); err != nil {
		t.Fatal(err)
	}
	// pg_locks is read against the limit in force: under limit 1 the head
	// of the queue may wait for slot 0 (see Semaphore.await).
	target.limit = 1
	held := mustAcquire(t, sems[0], true)
	waiter := goAcquire(ctx, sems[1])
	awaitHead(t, pdsn, sems[1])
	replica := pgtest.Conn(t, sdsn)
	pgtest.Eventually(t, testTimeout, "the limit and the holder replicate", func() bool {
		var limit, holders int
		err := replica.QueryRow(ctx, `SELECT (SELECT "limit" FROM pgcoord.semaphores WHERE name = $1),
			(SELECT count(*) FROM pgcoord.semaphore_holders WHERE name = $1)`, target.name).Scan(&limit, &holders)
		return err == nil && limit == 1 && holders == 1
	})

	primary.Stop(t)
	awaitLost(t, []*Permit{held}, func(int) string { return "the held permit" }, time.Now(), "the primary stopped")
	if _, err := sems[2].TryAcquire(ctx); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("TryAcquire with only the standby up: %v, want ErrReadOnly", err)
	}
	late := goAcquire(ctx, sems[2])
	pgtest.Eventually(t, testTimeout, "both Acquires to keep trying", func() bool {
		return sems[1].c.Stat().QueuedWaits > 0 && sems[2].c.Stat().QueuedWaits > 0
	})
	for _, ch := range []<-chan permitResult{waiter, late} {
		select {
		case r := <-ch:
			t.Fatalf("an Acquire returned (%v, %v) while only the standby was up; it must keep trying until its ctx ends", r.p, r.err)
		default:
		}
	}
	standby.Promote(t)

	// One of the two gets the permit; the other waits for it.
	var first *Permit
	var rest <-chan permitResult
	select {
	case r := <-waiter:
		first, rest = r.p, late
		if r.err != nil {
			t.Fatalf("the Acquire that headed the queue when the primary stopped: %v", r.err)
		}
	case r := <-late:
		first, rest = r.p, waiter
		if r.err != nil {
			t.Fatalf("the Acquire that started with only the standby up: %v", r.err)
		}
	case <-time.After(testTimeout):
		t.Fatalf("no Acquire got the permit within %v of the promotion", testTimeout)
	}
	st := permitLocks(t, sdsn, target)
	if len(st.slots) != 1 || st.slots[first.Slot()] != first.l.S.PID() {
		t.Fatalf("pg_locks on the new primary: slots %v, want only slot %d of backend %d", st.slots, first.Slot(), first.l.S.PID())
	}
	if n, err := sems[0].Limit(ctx); err != nil || n != 1 {
		t.Fatalf("Limit on the new primary: %d, %v; want the 1 set on the old one", n, err)
	}
	if _, err := sems[0].TryAcquire(ctx); !errors.Is(err, ErrNoPermit) {
		t.Fatalf("a second permit under limit 1: %v, want ErrNoPermit", err)
	}
	select {
	case r := <-rest:
		t.Fatalf("the other Acquire returned (%v, %v) while the only permit was held", r.p, r.err)
	default:
	}
	mustRelease(t, first)
	r := receivePermit(t, rest)
	if r.err != nil {
		t.Fatalf("the other Acquire, after the first permit's release: %v", r.err)
	}
	if st := permitLocks(t, sdsn, target); len(st.slots) != 1 || st.slots[r.p.Slot()] != r.p.l.S.PID() {
		t.Fatalf("pg_locks on the new primary: slots %v, want only slot %d of backend %d", st.slots, r.p.Slot(), r.p.l.S.PID())
	}
	if !errors.Is(held.Err(), ErrLockLost) {
		t.Fatalf("the permit held on the old primary: %v, want ErrLockLost", held.Err())
	}
	mustRelease(t, r.p)
}

// A permit whose backend was terminated, released before its session has
// noticed: Release says the permit was lost (ErrLockLost), as documented.
// Permit.Err must then say so too ("an error wrapping ErrLockLost ... if
// the permit was lost"), not that it was released.
func TestSemaphoreLostPermitReleasedReportsLoss(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	c := newTestClient(t, dsn, WithHeartbeat(5*time.Second), WithLossDeadline(15*time.Second))
	s := c.Semaphore("lost-then-released", 1)
	p, err := s.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pid := p.l.S.PID()
	pgtest.Terminate(t, dsn, pid)
	// Whether or not the session has noticed the termination yet (with
	// H = 5 s it rarely has), Release and Err must both report the loss.
	rerr := p.Release(ctx)
	if !errors.Is(rerr, ErrLockLost) {
		t.Fatalf("Release of a permit whose backend was terminated = %v, want ErrLockLost", rerr)
	}
	select {
	case <-p.Done():
	default:
		t.Fatal("Done is not closed after Release returned")
	}
	if hs, err := s.Holders(ctx); err != nil || len(hs) != 0 {
		t.Fatalf("Holders = %+v, %v; want none", hs, err)
	}
	if err := p.Err(); !errors.Is(err, ErrLockLost) {
		t.Errorf("Permit.Err() = %v after its backend was terminated and Release returned %q; want an error wrapping ErrLockLost (the permit was lost, not released)", err, rerr)
	}
}
