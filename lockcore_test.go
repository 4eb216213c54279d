package pgcoord

// Tests of the promises of the lock core that span goroutines, backends and
// Clients: what a shared backend may run while it holds other goroutines'
// locks, what a wait slice may cost the locks beside it, what an Unlock that
// returns nil leaves on the server, and what a Client's own limits may not
// do to goroutines with a consistent lock order. Each test reads the outcome
// back from pg_locks.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// outsideLock takes k (a bigint key) on conn, a connection outside pgcoord.
func outsideLock(t testing.TB, conn *pgx.Conn, k Key) {
	t.Helper()
	if _, err := conn.Exec(testCtx(t), "SELECT pg_advisory_lock($1)", mustInt64(k)); err != nil {
		t.Fatalf("outside holder: lock %v: %v", k, err)
	}
}

// outsideUnlock releases k on conn, which must hold it.
func outsideUnlock(t testing.TB, conn *pgx.Conn, k Key) {
	t.Helper()
	var ok bool
	if err := conn.QueryRow(testCtx(t), "SELECT pg_advisory_unlock($1)", mustInt64(k)).Scan(&ok); err != nil || !ok {
		t.Fatalf("outside holder: unlock %v: %v, %v", k, ok, err)
	}
}

// waitingPIDs returns the backends that wait (not granted) for k.
func waitingPIDs(t testing.TB, dsn string, k Key) []int32 {
	t.Helper()
	var pids []int32
	for _, h := range lockState(t, dsn)[k] {
		if !h.granted {
			pids = append(pids, h.pid)
		}
	}
	return pids
}

// holdsOn reports whether pg_locks shows k granted to backend pid.
func holdsOn(t testing.TB, dsn string, k Key, pid int32) bool {
	t.Helper()
	for _, p := range grantedTo(t, dsn, k) {
		if p == pid {
			return true
		}
	}
	return false
}

// setDeadlockTimeout sets deadlock_timeout for new connections to the
// database of dsn and returns it; it returns the server's default (1s) if
// the role may not change it (the setting needs a superuser).
func setDeadlockTimeout(t testing.TB, dsn string, d time.Duration) time.Duration {
	t.Helper()
	conn := pgtest.Conn(t, dsn)
	ctx := testCtx(t)
	var db string
	if err := conn.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	sql := fmt.Sprintf("ALTER DATABASE %s SET deadlock_timeout = '%dms'", pgx.Identifier{db}.Sanitize(), d.Milliseconds())
	if _, err := conn.Exec(ctx, sql); err != nil {
		if core.SqlState(err) != "42501" {
			t.Fatal(err)
		}
		t.Logf("deadlock_timeout stays at 1s: %v", err)
		return time.Second
	}
	return d
}

// outcome describes the result of an acquire.
func outcome(r result) string {
	if r.err != nil {
		return fmt.Sprintf("failed: %v", r.err)
	}
	return fmt.Sprintf("got the lock on backend %d", r.l.core.S.PID())
}

// settle polls cond for at most 2s, for a state that the scenario aims at
// but that a correct acquire need not pass through; it logs when the state
// did not come.
func settle(t testing.TB, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Logf("not within 2s (going on): %s", what)
			return
		}
	}
}

// stillHeld checks that l has not ended and that pg_locks shows its keys
// granted to its backend; what names the lock in the failure message.
func stillHeld(t testing.TB, dsn string, l *Lock, what string) {
	t.Helper()
	select {
	case <-l.Done():
		t.Fatalf("%s: the lock ended (Err: %v), though nothing released it", what, l.Err())
	default:
	}
	for _, k := range l.Keys() {
		if !holdsOn(t, dsn, k, l.core.S.PID()) {
			t.Fatalf("%s: pg_locks shows %v granted to %v, not to the lock's backend %d", what, k, grantedTo(t, dsn, k), l.core.S.PID())
		}
	}
}

// An Unlock that returns nil leaves the key free on the server. PostgreSQL
// can grant a lock and still report lock_timeout (55P03) when the release
// lands just as a wait slice times out; the wait must not then take the key
// a second time. Outside holders release their key at the end of a slice,
// give or take a millisecond, 40 times each for Lock, RLock and
// Session.Lock.
func TestUnlockLeavesKeyFreeAfterLockTimeoutRace(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DB(t)
	// One slice of a wait is (L-H)/2 (RELIABILITY.md): 250ms.
	const loss, beat = time.Second, 500 * time.Millisecond
	const slice = (loss - beat) / 2
	opts := []Option{WithLossDeadline(loss), WithHeartbeat(beat)}

	// release_at releases a key at a moment given to the microsecond, on
	// the server: pg_sleep to just before it, then a bounded spin.
	setup := pgtest.Conn(t, dsn)
	if core.ServerMajor(setup.PgConn().ParameterStatus("server_version")) < 14 {
		t.Skip("aiming at the end of a wait slice needs pg_locks.waitstart (PostgreSQL 14+)")
	}
	if _, err := setup.Exec(testCtx(t), `CREATE FUNCTION release_at(k bigint, target timestamptz) RETURNS boolean
		LANGUAGE plpgsql AS $$
		DECLARE n int := 0;
		BEGIN
			PERFORM pg_sleep(greatest(0, extract(epoch FROM target - clock_timestamp()) - 0.003));
			WHILE clock_timestamp() < target AND n < 50000000 LOOP n := n + 1; END LOOP;
			RETURN pg_advisory_unlock(k);
		END $$`); err != nil {
		t.Fatal(err)
	}

	// Each kind of acquire runs in two lanes at once, each lane with an
	// outside holder of its own.
	locker, rlocker, sessions := newTestClient(t, dsn, opts...), newTestClient(t, dsn, opts...), newTestClient(t, dsn, opts...)
	s1, s2 := newTestSession(t, sessions), newTestSession(t, sessions)
	type acquireFunc = func(context.Context, Key, ...LockOption) (*Lock, error)
	kinds := []struct {
		name  string
		lanes [2]acquireFunc
	}{
		{"Lock", [2]acquireFunc{locker.Lock, locker.Lock}},
		{"RLock", [2]acquireFunc{rlocker.RLock, rlocker.RLock}},
		{"Session.Lock", [2]acquireFunc{s1.Lock, s2.Lock}},
	}
	const trials = 20 // per lane
	stuck := make([][2]int, len(kinds))
	var wg sync.WaitGroup
	for ki, kind := range kinds {
		for li, acquire := range kind.lanes {
			holder := pgtest.Conn(t, dsn)
			wg.Go(func() {
				ctx := testCtx(t)
				for i := range trials {
					k := HashKey("lock-timeout-race", kind.name, fmt.Sprint(li, i))
					offset, l, err := releaseAtSliceEnd(ctx, holder, k, slice, func() (*Lock, error) { return acquire(ctx, k) })
					if err != nil {
						t.Errorf("%s trial %d.%d: %v", kind.name, li, i, err)
						return
					}
					pid := l.core.S.PID()
					if err := l.Unlock(ctx); err != nil {
						t.Errorf("%s trial %d.%d: Unlock: %v", kind.name, li, i, err)
						return
					}
					var free bool
					if err := holder.QueryRow(ctx, "SELECT CASE WHEN pg_try_advisory_lock($1) THEN pg_advisory_unlock($1) ELSE false END", mustInt64(k)).Scan(&free); err != nil {
						t.Errorf("%s trial %d.%d: try %v from another connection: %v", kind.name, li, i, k, err)
						return
					}
					if free {
						continue
					}
					if stuck[ki][li]++; stuck[ki][li] == 1 {
						t.Errorf("%s trial %d.%d (outside release aimed %v from the end of the wait's slice): Unlock returned nil (lock Err: %v) but another connection cannot take %v: pg_locks shows it granted to %v (the lock's backend was %d); when Unlock returns nil the key must be free on the server",
							kind.name, li, i, offset, l.Err(), k, grantedTo(t, dsn, k), pid)
					}
				}
			})
		}
	}
	wg.Wait()
	for ki, kind := range kinds {
		if n := stuck[ki][0] + stuck[ki][1]; n > 0 {
			t.Errorf("%s: %d of %d trials left the key held on the server after Unlock returned nil", kind.name, n, 2*trials)
		}
	}
}

// releaseAtSliceEnd takes k on holder (a connection outside pgcoord), runs
// acquire, which must wait for k, and releases k on the server within a
// millisecond of the moment the first slice of that wait times out
// (lock_timeout fires one slice after pg_locks.waitstart). It returns how
// far from that moment the release was aimed, and the acquired lock.
func releaseAtSliceEnd(ctx context.Context, holder *pgx.Conn, k Key, slice time.Duration, acquire func() (*Lock, error)) (time.Duration, *Lock, error) {
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock($1)", mustInt64(k)); err != nil {
		return 0, nil, fmt.Errorf("outside holder: lock %v: %w", k, err)
	}
	ch := goLock(acquire)
	var start time.Time
	for range 1000 {
		err := holder.QueryRow(ctx, `SELECT waitstart FROM pg_locks
			WHERE locktype = 'advisory' AND NOT granted AND waitstart IS NOT NULL AND objsubid = 1
			  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			  AND ((classid::bigint << 32) | objid::bigint) = $1`, mustInt64(k)).Scan(&start)
		if err == nil {
			break
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return 0, nil, fmt.Errorf("read waitstart: %w", err)
		}
		select {
		case r := <-ch:
			return 0, nil, fmt.Errorf("acquire %s while the key was held elsewhere", outcome(r))
		case <-time.After(2 * time.Millisecond):
		}
	}
	if start.IsZero() {
		return 0, nil, errors.New("the acquire never waited in pg_locks")
	}
	offset := time.Duration(rand.Int64N(int64(2*time.Millisecond))) - time.Millisecond
	var released bool
	if err := holder.QueryRow(ctx, "SELECT release_at($1, $2)", mustInt64(k), start.Add(slice+offset)).Scan(&released); err != nil || !released {
		return offset, nil, fmt.Errorf("outside holder's release: %v, %v", released, err)
	}
	select {
	case r := <-ch:
		if r.err != nil {
			return offset, nil, fmt.Errorf("acquire after the outside holder released: %w", r.err)
		}
		return offset, r.l, nil
	case <-time.After(testTimeout):
		return offset, nil, errors.New("acquire did not return after the outside holder released")
	}
}

// No goroutine sees a deadlock its application does not have, and no lock
// is lost because of another goroutine's wait. Two Clients at their
// connection limit: in the first, G1 holds A while G2 waits for D; in the
// second, H1 holds D while H2 waits for A. No goroutine holds one key while
// waiting for another, so there is no cycle, whatever backends the waits
// run on.
func TestNoDeadlockAcrossClientsAtConnectionLimit(t *testing.T) {
	t.Parallel()
	for _, multi := range []bool{false, true} {
		name := "Lock"
		if multi {
			name = "LockAll"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			dsn := pgtest.DB(t)
			// A cycle among backends is found after deadlock_timeout.
			deadlockTimeout := setDeadlockTimeout(t, dsn, 100*time.Millisecond)
			outside := pgtest.Conn(t, dsn)
			opts := []Option{WithSharedBackends(1), WithMaxWaits(1)}
			c1, c2 := newTestClient(t, dsn, opts...), newTestClient(t, dsn, opts...)
			acquire := func(c *Client, ks []Key) (*Lock, error) {
				if multi {
					return c.LockAll(ctx, ks...)
				}
				return c.Lock(ctx, ks[0])
			}
			keys := func(name string) []Key {
				if multi {
					return []Key{HashKey(name, "1"), HashKey(name, "2")}
				}
				return []Key{HashKey(name)}
			}
			a, d := keys("a"), keys("d")

			g1, err := acquire(c1, a)
			if err != nil {
				t.Fatal(err)
			}
			h1, err := acquire(c2, d)
			if err != nil {
				t.Fatal(err)
			}
			// Each Client takes one more lock after a wait, on a second
			// backend: both are at their limit of 1 + 1 connections, and
			// each of their backends holds a lock.
			var extra []*Lock
			for i, c := range []*Client{c1, c2} {
				v := HashKey("v", fmt.Sprint(i))
				outsideLock(t, outside, v)
				ch := goLock(func() (*Lock, error) { return c.Lock(ctx, v) })
				pgtest.Eventually(t, testTimeout, "the Client waits for v", func() bool { return waitingOn(t, dsn, v) == 1 })
				outsideUnlock(t, outside, v)
				r := receive(t, ch)
				if r.err != nil {
					t.Fatal(r.err)
				}
				extra = append(extra, r.l)
			}
			t.Logf("client 1 backends: a on %d, v0 on %d; client 2 backends: d on %d, v1 on %d",
				g1.core.S.PID(), extra[0].core.S.PID(), h1.core.S.PID(), extra[1].core.S.PID())

			g2 := goLock(func() (*Lock, error) { return acquire(c1, d) })
			h2 := goLock(func() (*Lock, error) { return acquire(c2, a) })
			// Both waits show up on the server (or wait in their process).
			for i := 0; i < 200 && g1.Err() == nil && h1.Err() == nil; i++ {
				if len(waitingPIDs(t, dsn, d[0])) > 0 && len(waitingPIDs(t, dsn, a[0])) > 0 {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			t.Logf("waiting for d: %v; waiting for a: %v", waitingPIDs(t, dsn, d[0]), waitingPIDs(t, dsn, a[0]))

			// Many times deadlock_timeout: no waiter fails, no holder loses.
			var g2r, h2r *result
			watch := time.After(min(15*deadlockTimeout, 3*time.Second))
		watching:
			for g2r == nil && h2r == nil && g1.Err() == nil && h1.Err() == nil {
				select {
				case r := <-g2:
					g2r = &r
				case r := <-h2:
					h2r = &r
				case <-g1.Done():
				case <-h1.Done():
				case <-watch:
					break watching
				}
			}
			if g2r != nil || h2r != nil || g1.Err() != nil || h1.Err() != nil {
				// Let the other side of the failure show, then report all.
				for range 50 {
					if (g2r != nil || h2r != nil) && (g1.Err() != nil || h1.Err() != nil) {
						break
					}
					select {
					case r := <-g2:
						g2r = &r
					case r := <-h2:
						h2r = &r
					case <-time.After(20 * time.Millisecond):
					}
				}
				waiter := func(r *result) string {
					if r == nil {
						return "still waiting"
					}
					return outcome(*r)
				}
				t.Fatalf("no goroutine holds one key while it waits for another, yet: G2 (client 1, waits for d) %s; H2 (client 2, waits for a) %s; G1's lock on a: Err %v; H1's lock on d: Err %v. A wait without a cycle in the application must not fail with ErrDeadlock, and a held lock must not be lost because of another goroutine's wait",
					waiter(g2r), waiter(h2r), g1.Err(), h1.Err())
			}
			stillHeld(t, dsn, g1, "G1's lock on a")
			stillHeld(t, dsn, h1, "H1's lock on d")

			// The holders release: the waiters get their keys.
			mustUnlock(t, g1)
			mustUnlock(t, h1)
			for _, w := range []struct {
				name string
				ch   <-chan result
				ks   []Key
			}{{"G2", g2, d}, {"H2", h2, a}} {
				r := receive(t, w.ch)
				if r.err != nil {
					t.Fatalf("%s after the holders released: %v", w.name, r.err)
				}
				for _, k := range w.ks {
					heldOnlyBy(t, dsn, k, r.l.core.S.PID())
				}
				mustUnlock(t, r.l)
			}
			for _, l := range extra {
				mustUnlock(t, l)
			}
		})
	}
}

// A multi-key wait answers within its slice, however its keys are freed:
// it never lets the lease of its backend run out, so the other locks on
// that backend stay held. Four keys are freed one by one, 0.36 L apart:
// each key alone is granted within a slice, all four take 1.44 L.
func TestMultiKeyWaitKeepsOtherLocks(t *testing.T) {
	t.Parallel()
	const loss = time.Second
	opts := []Option{WithLossDeadline(loss), WithHeartbeat(200 * time.Millisecond)}
	// queued reports whether the LockAll waits in the process for a
	// connection it may wait on (every connection of a Client at its limit
	// holds a lock), trying its keys meanwhile.
	run := func(t *testing.T, dsn string, held []*Lock, queued func() bool, lockAll func(ctx context.Context, keys ...Key) (*Lock, error)) {
		ctx := testCtx(t)
		outside := pgtest.Conn(t, dsn)
		keys, err := core.CanonicalKeys(coreKeys([]Key{HashKey("multi", "1"), HashKey("multi", "2"), HashKey("multi", "3"), HashKey("multi", "4")}))
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range keys {
			outsideLock(t, outside, keyOf(k))
		}
		ch := goLock(func() (*Lock, error) { return lockAll(ctx, keysOf(keys)...) })
		pgtest.Eventually(t, testTimeout, "LockAll waits for the first key", func() bool { return waitingOn(t, dsn, keyOf(keys[0])) == 1 || queued() })
		start := time.Now()
		// Free the keys one by one, 0.36 L apart, in the order LockAll
		// takes them, watching the locks beside the wait meanwhile.
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for i, k := range keys {
			at := time.After(time.Until(start.Add(time.Duration(i+1) * loss * 36 / 100)))
		waiting:
			for {
				select {
				case <-at:
					break waiting
				case r := <-ch:
					var errs []error
					for _, l := range held {
						errs = append(errs, l.Err())
					}
					t.Fatalf("LockAll %s %v into its wait, with %d of its keys still held elsewhere; the unrelated locks' Err: %v; a wait must answer within its slice and keep the other locks of its backend",
						outcome(r), time.Since(start), len(keys)-i, errs)
				case <-tick.C:
					for _, l := range held {
						if l.Err() != nil {
							t.Fatalf("the unrelated lock on %v was lost %v into the LockAll wait (Err: %v); a wait must answer within its slice and keep the other locks of its backend", l.Key(), time.Since(start), l.Err())
						}
					}
				}
			}
			outsideUnlock(t, outside, keyOf(k))
		}
		r := receive(t, ch)
		took := time.Since(start)
		for _, l := range held {
			if l.Err() != nil {
				t.Errorf("the unrelated lock on %v ended during the LockAll wait (Err: %v); a wait must answer within its slice and keep the other locks of its backend", l.Key(), l.Err())
			}
		}
		if r.err != nil {
			t.Fatalf("LockAll after all its keys were freed (%v): %v", took, r.err)
		}
		t.Logf("LockAll returned after %v on backend %d", took, r.l.core.S.PID())
		for _, l := range held {
			stillHeld(t, dsn, l, "the unrelated lock on "+l.Key().String())
		}
		for _, k := range keys {
			heldOnlyBy(t, dsn, keyOf(k), r.l.core.S.PID())
		}
		mustUnlock(t, r.l)
	}

	t.Run("Session", func(t *testing.T) {
		t.Parallel()
		dsn := pgtest.DB(t)
		s := newTestSession(t, newTestClient(t, dsn, opts...))
		u, err := s.Lock(testCtx(t), HashKey("unrelated"))
		if err != nil {
			t.Fatal(err)
		}
		run(t, dsn, []*Lock{u}, func() bool { return false }, s.LockAll)
		if s.Err() != nil {
			t.Fatalf("session ended: %v", s.Err())
		}
	})
	t.Run("Client", func(t *testing.T) {
		t.Parallel()
		ctx := testCtx(t)
		dsn := pgtest.DB(t)
		// At the limit of 1 + 1 connections, each holding a lock: the
		// LockAll finds no connection it may wait on, and tries again.
		c := newTestClient(t, dsn, append(opts, WithSharedBackends(1), WithMaxWaits(1))...)
		u, err := c.Lock(ctx, HashKey("unrelated"))
		if err != nil {
			t.Fatal(err)
		}
		outside := pgtest.Conn(t, dsn)
		v := HashKey("unrelated", "v")
		outsideLock(t, outside, v)
		ch := goLock(func() (*Lock, error) { return c.Lock(ctx, v) })
		pgtest.Eventually(t, testTimeout, "the Client waits for v", func() bool { return waitingOn(t, dsn, v) == 1 })
		outsideUnlock(t, outside, v)
		r := receive(t, ch)
		if r.err != nil {
			t.Fatal(r.err)
		}
		run(t, dsn, []*Lock{u, r.l}, func() bool { return c.Stat().QueuedWaits == 1 }, c.LockAll)
	})
}

// Issuing a fence never holds a backend past the loss deadline: while an
// old holder's transaction that called CheckFence is open (it holds the
// fence row, so no newer fence can be issued), a Client that takes the key
// WithFence keeps its other locks, and gets its fence only after that
// transaction ends, greater than the old one.
func TestFenceWaitKeepsOtherLocks(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		loss time.Duration
		opts []Option
	}{
		{"default", time.Second, []Option{WithLossDeadline(time.Second), WithHeartbeat(250 * time.Millisecond)}},
		{"oneSharedBackend", 2 * time.Second, []Option{WithLossDeadline(2 * time.Second), WithHeartbeat(500 * time.Millisecond), WithSharedBackends(1)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			dsn := pgtest.DB(t)
			pool := migrated(t, dsn)
			c := newTestClient(t, dsn, tc.opts...)
			k, unrelated := HashKey("fence-wait"), HashKey("fence-wait", "unrelated")
			old, err := c.Lock(ctx, k, WithFence())
			if err != nil {
				t.Fatal(err)
			}
			mustUnlock(t, old)
			// The old holder's write transaction checks its fence and stays
			// open for more than 2L.
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.Background())
			if err := CheckFence(ctx, tx, k, old.Fence()); err != nil {
				t.Fatal(err)
			}
			u, err := c.Lock(ctx, unrelated)
			if err != nil {
				t.Fatal(err)
			}
			ch := goLock(func() (*Lock, error) { return c.Lock(ctx, k, WithFence()) })
			open := time.Now()
			end := time.After(5 * tc.loss / 2)
			tick := time.NewTicker(50 * time.Millisecond)
			defer tick.Stop()
		watching:
			for {
				select {
				case r := <-ch:
					if r.err != nil {
						t.Fatalf("Lock WithFence failed %v after it started, while the CheckFence transaction of fence %d was open: %v (the unrelated lock's Err: %v); it must wait for that transaction to end, keeping the other locks of its backend",
							time.Since(open), old.Fence(), r.err, u.Err())
					}
					t.Fatalf("Lock WithFence returned fence %d %v after it started, while the CheckFence transaction of fence %d was still open; no fence can be issued before it ends",
						r.l.Fence(), time.Since(open), old.Fence())
				case <-u.Done():
					t.Fatalf("the unrelated lock was lost %v into the fenced Lock's wait for the CheckFence transaction (Err: %v); issuing a fence must not hold its backend past the loss deadline %v", time.Since(open), u.Err(), tc.loss)
				case <-tick.C:
					if !holdsOn(t, dsn, unrelated, u.core.S.PID()) {
						t.Fatalf("%v into the fenced Lock's wait, pg_locks shows the unrelated key granted to %v, not to its backend %d", time.Since(open), grantedTo(t, dsn, unrelated), u.core.S.PID())
					}
				case <-end:
					break watching
				}
			}
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			r := receive(t, ch)
			if r.err != nil {
				t.Fatalf("Lock WithFence after the CheckFence transaction ended: %v", r.err)
			}
			if r.l.Fence() <= old.Fence() {
				t.Fatalf("fence %d, want more than the old holder's %d", r.l.Fence(), old.Fence())
			}
			heldOnlyBy(t, dsn, k, r.l.core.S.PID())
			stillHeld(t, dsn, u, "the unrelated lock")
			mustUnlock(t, r.l)
			mustUnlock(t, u)
		})
	}
}

// A waiting writer is not starved by readers, also when the readers are
// goroutines of one Client: readers that join their backend's shared hold
// queue behind a writer of another Client waiting on the server. Four
// readers take RLock in turn, each holding until a newer one holds, so the
// key is never free of them.
func TestWriterNotStarvedByReadersOfOneClient(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	readers, writer := newTestClient(t, dsn), newTestClient(t, dsn)
	k := HashKey("starve-one-client")

	stop := make(chan struct{})
	var seq, reads atomic.Int64
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				l, err := readers.RLock(ctx, k)
				if err != nil {
					t.Error(err)
					return
				}
				reads.Add(1)
				// Hold until a reader that came after holds too (at most
				// 50ms): the newest reader always holds.
				mine := seq.Add(1)
				for i := 0; i < 500 && seq.Load() == mine; i++ {
					select {
					case <-stop:
						i = 500
					case <-time.After(100 * time.Microsecond):
					}
				}
				if err := l.Unlock(ctx); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	defer func() {
		close(stop)
		wg.Wait()
	}()
	pgtest.Eventually(t, testTimeout, "readers running", func() bool { return reads.Load() > 20 })

	wctx, cancel := context.WithTimeout(ctx, 4*time.Second)
	defer cancel()
	wch := goLock(func() (*Lock, error) { return writer.Lock(wctx, k) })
	pgtest.Eventually(t, testTimeout, "writer waits in pg_locks", func() bool {
		for _, h := range lockState(t, dsn)[k] {
			if !h.granted && !h.shared {
				return true
			}
		}
		return false
	})
	queued, before := time.Now(), reads.Load()
	res := receive(t, wch)
	waited, during := time.Since(queued), reads.Load()-before
	if res.err != nil {
		t.Fatalf("the writer of another Client waited %v in the queue, while the readers of one Client took %d more shared locks, and then failed: %v; RLock promises that a waiting exclusive holder is not starved", waited, during, res.err)
	}
	t.Logf("writer got the key %v after it queued; %d reads meanwhile", waited, during)
	heldOnlyBy(t, dsn, k, res.l.core.S.PID())
	mustUnlock(t, res.l)
	if waited > time.Second {
		t.Fatalf("the writer of another Client waited %v in the queue, while the readers of one Client took %d more shared locks; RLock promises that a waiting exclusive holder is not starved", waited, during)
	}
}

// A blocking acquire whose last slice (cut to ctx's deadline) is
// interrupted by an Unlock on the same Session resumes, as any interrupted
// wait does: it either gets the key or fails with ctx's deadline, never
// before it.
func TestInterruptedLastSliceWaitsUntilDeadline(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	// Default L and H: one slice is 2s, longer than the acquire's 1.5s.
	c, other := newTestClient(t, dsn), newTestClient(t, dsn)
	s := newTestSession(t, c)
	k := HashKey("last-slice")
	h, err := other.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	defer mustUnlock(t, h)
	const timeout = 1500 * time.Millisecond
	for i, at := range []time.Duration{100 * time.Millisecond, 300 * time.Millisecond, 900 * time.Millisecond} {
		u, err := s.Lock(ctx, HashKey("last-slice", "unrelated", fmt.Sprint(i)))
		if err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithTimeout(ctx, timeout)
		deadline, _ := wctx.Deadline()
		ch := goLock(func() (*Lock, error) { return s.Lock(wctx, k) })
		pgtest.Eventually(t, testTimeout, "the session waits for k", func() bool { return waitingOn(t, dsn, k) == 1 })
		select {
		case r := <-ch:
			t.Fatalf("Lock %s before the interruption", outcome(r))
		case <-time.After(time.Until(deadline.Add(-timeout + at))):
		}
		mustUnlock(t, u)
		r := receive(t, ch)
		early := time.Until(deadline)
		cancel()
		if r.err == nil {
			t.Fatalf("Lock got k while another Client held it (pg_locks: %v)", grantedTo(t, dsn, k))
		}
		if early > 0 {
			t.Fatalf("Unlock of another lock of the Session %v into a %v Lock (its wait is one slice, cut to the deadline): Lock returned %v before its deadline: %v; an interrupted wait resumes, so it must wait until the deadline and then fail with context.DeadlineExceeded",
				at, timeout, early.Round(time.Millisecond), r.err)
		}
		if !errors.Is(r.err, context.DeadlineExceeded) {
			t.Fatalf("Unlock of another lock of the Session %v into a %v Lock: Lock returned at its deadline with %v, want an error wrapping context.DeadlineExceeded", at, timeout, r.err)
		}
		heldOnlyBy(t, dsn, k, h.core.S.PID())
		if s.Err() != nil {
			t.Fatalf("session ended: %v", s.Err())
		}
	}
}

// A lock handed over in process whose fence cannot be issued because its
// backend was lost does not fail the acquire: the acquire goes on on
// another backend and gets a valid fence (RELIABILITY.md, promise 13).
func TestHandoffFenceOnLostBackendGoesOn(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := migrated(t, dsn)
	// A long heartbeat, so the Client does not notice the terminated
	// backend before the Unlock; a window long enough for the handoff.
	c := newTestClient(t, dsn, WithHandoff(16, time.Second), WithHeartbeat(2*time.Second))
	handed := 0
	for attempt := range 3 {
		k := HashKey("handoff-lost", fmt.Sprint(attempt))
		a, err := c.Lock(ctx, k, WithFence())
		if err != nil {
			t.Fatal(err)
		}
		bch := goLock(func() (*Lock, error) { return c.Lock(ctx, k, WithFence()) })
		pgtest.Eventually(t, testTimeout, "B queued at the key's gate", func() bool { return gateWaiters(c, k) == 1 })
		dead := a.core.S.PID()
		pgtest.Terminate(t, dsn, dead)
		uerr := a.Unlock(ctx)
		if uerr == nil {
			handed++
		}
		r := receive(t, bch)
		if r.err != nil {
			t.Fatalf("attempt %d: A's backend %d was terminated, then A's Unlock returned %v (nil: it handed the lock to B); B's Lock WithFence failed: %v; when the backend is lost while it issues the fence, the acquire must go on on another backend (RELIABILITY.md, promise 13)",
				attempt, dead, uerr, r.err)
		}
		if r.l.Fence() <= a.Fence() {
			t.Fatalf("attempt %d: B's fence %d, want more than A's %d", attempt, r.l.Fence(), a.Fence())
		}
		pid := r.l.core.S.PID()
		if pid == dead {
			t.Fatalf("attempt %d: B's lock is on the terminated backend %d", attempt, dead)
		}
		heldOnlyBy(t, dsn, k, pid)
		var alive bool
		if err := pool.QueryRow(ctx, "SELECT count(*) = 1 FROM pg_stat_activity WHERE pid = $1", pid).Scan(&alive); err != nil || !alive {
			t.Fatalf("attempt %d: B's backend %d is not live: %v, %v", attempt, pid, alive, err)
		}
		mustUnlock(t, r.l)
		notHeld(t, dsn, k)
	}
	t.Logf("%d of 3 attempts handed the lock over", handed)
}

// A Client's limit on waits never deadlocks goroutines whose lock order is
// consistent. With WithMaxWaits(1): G2 waits on the server for Z (held by
// G3's transaction); G1 wants K (held by another connection at first);
// G3, inside its transaction on Z, wants K too. Z is always taken before K,
// so once K is freed everyone must finish.
func TestMaxWaitsNoDeadlockWithConsistentOrder(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	c := newTestClient(t, dsn, WithMaxWaits(1))
	k, z := HashKey("max-waits", "k"), HashKey("max-waits", "z")
	outside := pgtest.Conn(t, dsn)
	outsideLock(t, outside, k)

	const limit = 8 * time.Second
	gctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	type done struct {
		err error
		at  time.Time
	}
	lockUnlock := func(k Key) error {
		l, err := c.Lock(gctx, k)
		if err != nil {
			return err
		}
		return l.Unlock(gctx)
	}
	inTx, proceed := make(chan struct{}), make(chan struct{})
	g3 := make(chan done, 1)
	go func() {
		err := InTx(gctx, pool, []Key{z}, func(tx pgx.Tx) error {
			close(inTx)
			select {
			case <-proceed:
			case <-gctx.Done():
				return gctx.Err()
			}
			return lockUnlock(k)
		})
		g3 <- done{err, time.Now()}
	}()
	select {
	case <-inTx:
	case d := <-g3:
		t.Fatalf("G3's InTx: %v", d.err)
	}
	g2 := make(chan done, 1)
	go func() { g2 <- done{lockUnlock(z), time.Now()} }()
	settle(t, "G2 waits for z on the server", func() bool { return waitingOn(t, dsn, z) == 1 })
	g1 := make(chan done, 1)
	go func() { g1 <- done{lockUnlock(k), time.Now()} }()
	// G1 passes k's gate and queues for the wait slot; then G3 queues at
	// k's gate behind it. (Each state is awaited for at most 2s: an
	// acquire that waits some other way gets on with the test.)
	settle(t, "G1 passed k's gate and waits for a wait slot", func() bool {
		return gatePassedExclusive(c, k) && c.Stat().QueuedWaits == 1
	})
	close(proceed)
	settle(t, "G3 queued at k's gate", func() bool { return gateWaiters(c, k) == 1 })
	outsideUnlock(t, outside, k)
	freed := time.Now()

	const bound = limit / 2
	for _, g := range []struct {
		name string
		ch   <-chan done
	}{{"G1 (Lock k)", g1}, {"G2 (Lock z)", g2}, {"G3 (Lock k inside InTx(z))", g3}} {
		var d done
		select {
		case d = <-g.ch:
		case <-time.After(testTimeout):
			t.Fatalf("%s did not return", g.name)
		}
		if took := d.at.Sub(freed); d.err != nil || took > bound {
			t.Errorf("%s returned %v after k was freed (err: %v); the lock order is consistent (z before k) and k is free, so every goroutine must finish well before its %v deadline: WithMaxWaits must not deadlock them",
				g.name, took.Round(time.Millisecond), d.err, limit)
		}
	}
	notHeld(t, dsn, k)
	notHeld(t, dsn, z)
}

// With default options, goroutines that hold locks do not make other
// goroutines' waits fail with ErrDeadlock, nor lose their locks, when the
// other side of a wait is in another Client. Two Clients of four goroutines
// each. Every goroutine holds a private key throughout (taken after a
// wait, so the privates spread over the Client's backends; two goroutines
// hold a second one), which nobody else wants. Besides, each goroutine
// either holds a key of its own Client's side for a while, or briefly takes
// a key (or, with LockAll, both keys) of the other side, which the other
// Client's goroutines hold. No goroutine waits while it holds anything but
// its privates: the application has no lock cycle.
func TestNoSpuriousDeadlockRandomized(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	// Holds are short; find any cycle among backends while it lasts.
	setDeadlockTimeout(t, dsn, 10*time.Millisecond)
	outside := pgtest.Conn(t, dsn)
	clients := []*Client{newTestClient(t, dsn), newTestClient(t, dsn)}
	const goroutines, ops = 4, 200
	sides := [][]Key{{HashKey("rand", "a0"), HashKey("rand", "a1")}, {HashKey("rand", "d0"), HashKey("rand", "d1")}}

	// Private keys: each goroutine waits for its own, held outside, so
	// the locks land on the backends of the waits.
	type worker struct {
		c       *Client
		private []*Lock
	}
	var workers []*worker
	for _, c := range clients {
		for range goroutines {
			workers = append(workers, &worker{c: c})
		}
	}
	for round, n := range []int{goroutines, 2} {
		var chans []<-chan result
		var owners []*worker
		var ks []Key
		for w, wk := range workers {
			if w%goroutines >= n {
				continue
			}
			k := HashKey("rand", "private", fmt.Sprint(w, round))
			outsideLock(t, outside, k)
			ks = append(ks, k)
			owners = append(owners, wk)
			chans = append(chans, goLock(func() (*Lock, error) { return wk.c.Lock(ctx, k) }))
		}
		pgtest.Eventually(t, testTimeout, "the private waits", func() bool {
			n := 0
			for _, k := range ks {
				n += waitingOn(t, dsn, k)
			}
			return n == len(ks)
		})
		for _, k := range ks {
			outsideUnlock(t, outside, k)
		}
		for i, ch := range chans {
			r := receive(t, ch)
			if r.err != nil {
				t.Fatal(r.err)
			}
			owners[i].private = append(owners[i].private, r.l)
		}
	}
	// The backend that serves the Client's tries gives its second private
	// back.
	for i, c := range clients {
		probe, err := c.TryLock(ctx, HashKey("rand", "probe"))
		if err != nil {
			t.Fatal(err)
		}
		mustUnlock(t, probe)
		for _, w := range workers {
			if w.c == c && len(w.private) == 2 && w.private[1].core.S == probe.core.S {
				mustUnlock(t, w.private[1])
				w.private = w.private[:1]
			}
		}
		st := c.Stat()
		t.Logf("client %d: %d backends, %d locks", i, st.Backends, st.Locks)
	}

	start := time.Now()
	var next, deadlocks, failures atomic.Int64
	var wg sync.WaitGroup
	for w, wk := range workers {
		mine, theirs := sides[w/goroutines], sides[1-w/goroutines]
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
			for next.Add(1) <= ops {
				var ks []Key
				var hold time.Duration
				switch x := rng.IntN(6); {
				case x < 3:
					ks = []Key{mine[rng.IntN(len(mine))]}
					hold = time.Duration(20+rng.IntN(40)) * time.Millisecond
				case x < 5:
					ks = []Key{theirs[rng.IntN(len(theirs))]}
					hold = time.Duration(rng.IntN(5)) * time.Millisecond
				default:
					ks = theirs
					hold = time.Duration(rng.IntN(5)) * time.Millisecond
				}
				octx, cancel := context.WithTimeout(ctx, 10*time.Second)
				l, err := wk.c.LockAll(octx, ks...)
				cancel()
				if err != nil {
					if errors.Is(err, ErrDeadlock) {
						deadlocks.Add(1)
					}
					failures.Add(1)
					t.Errorf("goroutine %d: LockAll%v: %v", w, ks, err)
					continue
				}
				select {
				case <-l.Done():
				case <-time.After(hold):
				}
				if err := l.Unlock(ctx); err != nil {
					failures.Add(1)
					t.Errorf("goroutine %d: Unlock%v: %v", w, ks, err)
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d operations took %v", ops, time.Since(start))
	lost := 0
	for w, wk := range workers {
		for _, l := range wk.private {
			select {
			case <-l.Done():
				lost++
				t.Errorf("goroutine %d: private lock on %v lost: %v", w, l.Key(), l.Err())
			default:
				if !holdsOn(t, dsn, l.Key(), l.core.S.PID()) {
					lost++
					t.Errorf("goroutine %d: pg_locks shows private %v granted to %v, not to its backend %d", w, l.Key(), grantedTo(t, dsn, l.Key()), l.core.S.PID())
				}
			}
		}
	}
	if deadlocks.Load() > 0 || lost > 0 || failures.Load() > 0 {
		t.Fatalf("%d operations: %d failed with ErrDeadlock, %d failed in all, %d private locks lost; the application has no lock cycle, so no acquire may see a deadlock and no held lock may be lost",
			ops, deadlocks.Load(), failures.Load(), lost)
	}
	for _, wk := range workers {
		for _, l := range wk.private {
			mustUnlock(t, l)
		}
	}
}

// A shared hold that several handles of one Client share on one backend:
// when that backend has ended (terminated by an administrator) before the
// Client has noticed, Unlock of a handle that is not the last must not
// report a clean release, as Unlock of the last one, which sends the
// release, does not: it returns an error wrapping ErrLockLost, and the
// remaining handle learns of the loss too.
func TestUnlockOfJoinedSharedHoldAfterBackendEnded(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := faultDB(t)
	// A heartbeat far away: the Client learns of the end only by asking.
	c := newTestClient(t, dsn, WithHeartbeat(5*time.Second), WithLossDeadline(20*time.Second))
	k := HashKey("joined-shared-unlock")
	a, err := c.RLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.RLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if a.core.S != b.core.S {
		t.Fatalf("the second RLock did not join the first's hold (backends %d and %d)", a.core.S.PID(), b.core.S.PID())
	}
	heldOnlyBy(t, dsn, k, a.core.S.PID())
	terminateBackend(t, pool, a.core.S.PID())
	if n := len(grantedTo(t, dsn, k)); n != 0 {
		t.Fatalf("the key is still granted to %d backends after its backend was terminated", n)
	}
	if err := a.Unlock(ctx); !errors.Is(err, ErrLockLost) {
		t.Fatalf("Unlock of a joined handle after its backend ended = %v, want ErrLockLost", err)
	}
	select {
	case <-b.Done():
	case <-time.After(testTimeout):
		t.Fatal("the remaining handle was not told of the loss")
	}
	if !errors.Is(b.Err(), ErrLockLost) {
		t.Fatalf("the remaining handle's Err = %v, want ErrLockLost", b.Err())
	}
}

// waitsNotGranted reports how many lock requests of backend pid wait (not
// granted) in pg_locks, of the given locktype ("" for any).
func waitsNotGranted(t testing.TB, conn *pgx.Conn, pid int32, locktype string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var n int
	err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_locks
		WHERE pid = $1 AND NOT granted AND ($2 = '' OR locktype = $2)`, pid, locktype).Scan(&n)
	if err != nil {
		t.Fatalf("read pg_locks: %v", err)
	}
	return n
}

// campaignBlockedByTableLock holds X on the only shared backend of a
// Client and starts a campaign of an election on the same Client while a
// transaction holds pgcoord's tables in ACCESS EXCLUSIVE mode (a migration,
// a VACUUM FULL, an operator's LOCK TABLE). It returns once the campaign's
// statement waits on that backend.
func campaignBlockedByTableLock(t *testing.T, ctx context.Context, opts ...Option) (c *Client, lx *Lock, obs *pgx.Conn, release func()) {
	t.Helper()
	dsn, pool := migratedPool(t, ctx, DefaultSchema)
	c = newTestClientOn(t, pool, append([]Option{WithSharedBackends(1)}, opts...)...)
	x := Int64Key(7101)
	lx, err := c.Lock(ctx, x)
	if err != nil {
		t.Fatal(err)
	}
	b1 := lx.core.S.PID()
	obs = pgtest.Conn(t, dsn)

	locker := pgtest.Conn(t, dsn)
	tx, err := locker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `LOCK TABLE pgcoord.fences, pgcoord.leaders IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	unlockTables := func() { once.Do(func() { _ = tx.Rollback(context.Background()) }) }
	t.Cleanup(unlockTables)

	cctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		ld, err := c.Election("break").Campaign(cctx)
		if err == nil {
			_ = ld.Resign(context.Background())
		}
	}()
	release = func() {
		cancel()
		unlockTables()
		select {
		case <-done:
		case <-time.After(testTimeout):
			t.Error("campaign did not end")
		}
	}
	t.Cleanup(release)
	pgtest.Eventually(t, 10*time.Second, "the campaign's statement to wait for the table lock on the shared backend", func() bool {
		return waitsNotGranted(t, obs, b1, "relation") > 0
	})
	return c, lx, obs, release
}

// Promise (backends.go): every blocking statement, on any backend, runs in
// slices, so a backend that holds locks answers within its wait slice and
// another statement that needs it (an Unlock) runs first.
//
// A campaign prepares its statement on the shared backend (withPrepared,
// Session.prepare) in one plain statement, not in slices: when pgcoord's
// tables are locked, it waits there with lock_timeout 0, and the Unlock of
// another goroutine's lock on that backend waits behind it.
func TestUnlockAnswersWithinSliceWhileCampaignPrepareWaits(t *testing.T) {
	ctx := testCtx(t)
	c, lx, _, release := campaignBlockedByTableLock(t, ctx, WithLossDeadline(2*time.Second), WithHeartbeat(500*time.Millisecond))
	slice := c.core.Cfg.WaitSlice()
	start := time.Now()
	err := lx.Unlock(ctx)
	took := time.Since(start)
	release()
	bound := slice + 500*time.Millisecond
	if err != nil || took > bound {
		t.Fatalf("broken promise: Unlock of a lock on a backend where a campaign's statement waits took %v (bound: the wait slice %v + 500ms) and returned %v; "+
			"the campaign's Session.prepare runs as one unsliced statement on the shared backend while pgcoord's tables are locked", took.Round(time.Millisecond), slice, err)
	}
}

// Promise (doc.go, backends.go): no goroutine's lock is lost because of
// another's wait; a backend's locks keep their loss deadline while another
// statement waits on it.
//
// The campaign's unsliced prepare on the shared backend keeps it from
// answering for longer than the loss deadline, so the session declares
// every lock on it lost.
func TestLockSurvivesCampaignPrepareWaitingOnSameBackend(t *testing.T) {
	ctx := testCtx(t)
	const loss, hb = 2 * time.Second, 500 * time.Millisecond
	_, lx, _, _ := campaignBlockedByTableLock(t, ctx, WithLossDeadline(loss), WithHeartbeat(hb))
	// Two campaign rounds (each L long): a lock that survives them survives.
	select {
	case <-lx.Done():
		t.Fatalf("broken promise: goroutine A's lock on the shared backend was lost (%v) while another goroutine's campaign waited on the same backend: "+
			"Session.prepare runs unsliced with lock_timeout 0, so the backend answers nothing for longer than the loss deadline %v", lx.Err(), loss)
	case <-time.After(2*loss + 2*hb):
	}
	mustUnlock(t, lx)
}

// Promise (RLock's doc): a waiting writer is not starved; readers of one
// Client join each other's hold without asking the server only for a
// short while after it was taken (the bounds of WithHandoff).
//
// TryRLock readers of a Client with one shared backend join its hold of the
// key whatever its age (route returns the holder for a try, and needs skips
// the joinable check for tries), so overlapping readers keep the key on
// the server forever and a writer of another process never gets it.
func TestTryRLockReadersDoNotStarveWaitingWriter(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn, WithSharedBackends(1))
	k := Int64Key(7201)
	kv, _ := k.Int64()

	cur, err := c.TryRLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	// A writer of another process waits for the key.
	wconn := pgtest.Conn(t, dsn)
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	wch := make(chan errResult, 1)
	go func() {
		_, err := wconn.Exec(wctx, "SELECT pg_advisory_lock($1)", kv)
		wch <- errResult{err, time.Now()}
	}()
	pgtest.Eventually(t, 10*time.Second, "writer waits", func() bool { return waitingOn(t, dsn, k) == 1 })
	queued := time.Now()

	// Readers keep coming, each overlapping the one before it.
	const stream = 3 * time.Second
	reads, refused := 0, false
	var writer *errResult
	for time.Since(queued) < stream && writer == nil {
		next, err := c.TryRLock(ctx, k)
		if errors.Is(err, ErrLocked) {
			refused = true
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		reads++
		mustUnlock(t, cur)
		cur = next
		select {
		case r := <-wch:
			writer = &r
		default:
		}
	}
	stillWaiting := writer == nil && waitingOn(t, dsn, k) == 1
	mustUnlock(t, cur)
	var w errResult
	if writer != nil {
		w = *writer
	} else {
		w = <-wch
	}
	if w.err == nil {
		if _, err := wconn.Exec(ctx, "SELECT pg_advisory_unlock($1)", kv); err != nil {
			t.Fatal(err)
		}
	}
	if stillWaiting && !refused {
		t.Fatalf("broken promise: a writer waited %v behind %d TryRLock readers of one Client that arrived after it (the first was taken long before the handoff window %v): "+
			"each joined the backend's shared hold without asking the server, so the key never became free for the writer",
			stream, reads, c.core.Cfg.HandoffWindow)
	}
	t.Logf("%d reads after the writer queued; refused: %v", reads, refused)
}
