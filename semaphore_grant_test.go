package pgcoord

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// A grant at the edges of its statement: the acquire's ctx ending as the
// grant commits, the head's grant waiting for the semaphore's row while a
// backend is terminated, two queues sharing a Client's only wait.

// appPIDs returns the backends whose application_name is app.
func appPIDs(t *testing.T, pool *pgxpool.Pool, app string) map[int32]bool {
	t.Helper()
	rows, err := pool.Query(testCtx(t), "SELECT pid FROM pg_stat_activity WHERE application_name = $1", app)
	if err != nil {
		t.Fatal(err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		t.Fatal(err)
	}
	m := make(map[int32]bool, len(pids))
	for _, p := range pids {
		m[p] = true
	}
	return m
}

// semaphoreHeldBy returns the slots of sem granted in pg_locks to pids, and
// whether any of pids holds or waits for its queue key.
func semaphoreHeldBy(t *testing.T, dsn string, sem *Semaphore, pids map[int32]bool) (slots []int, queue bool) {
	t.Helper()
	for k, hs := range lockState(t, dsn) {
		v, ok := k.Int64()
		if !ok || v>>16 != sem.prefix {
			continue
		}
		for _, h := range hs {
			if !pids[h.pid] {
				continue
			}
			if v&0xFFFF == queueSlot {
				queue = true
			} else if h.granted {
				slots = append(slots, int(v&0xFFFF))
			}
		}
	}
	return slots, queue
}

// Promise (the bounds of semaphores): a free permit reaches the head of
// the queue within 250 ms and a round trip (tests allow 1 s); rows 25, 27:
// the heads of a Client's queues share its bounded waits (WithMaxWaits),
// and no backend waits while it holds a key other than its queue key.
//
// Attack: a Client (WithMaxWaits(1), one shared backend) lines up on two
// semaphores of limit 1 behind another Client's heads, so that its queue
// keys must be waited for on the server: one on the Client's only wait,
// the other retried. Each permit passes along: holder, the other
// Client's head, this Client's head. Every permit reaches its next head
// within 1 s of its release, at most one backend of the Client waits on
// the server, and none waits while it holds anything but a queue key.
func TestSemaphoreTwoQueuesBehindOtherHeadsShareTheOnlyWait(t *testing.T) {
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	x, z := newTestClient(t, dsn), newTestClient(t, dsn)
	y := newTestClient(t, dsn, WithMaxWaits(1), WithSharedBackends(1), WithApplicationName("sem-two-queues"))
	names := []string{"sem-qa", "sem-qb"}
	var xs, zs, ys [2]*Semaphore
	var held [2]*Permit
	for i, n := range names {
		xs[i], zs[i], ys[i] = x.Semaphore(n, 1), z.Semaphore(n, 1), y.Semaphore(n, 1)
		held[i] = mustAcquire(t, xs[i], true)
	}
	var zch, ych [2]<-chan permitResult
	for i := range names {
		zch[i] = goAcquire(ctx, zs[i])
		awaitHead(t, dsn, zs[i])
	}
	for i := range names {
		ych[i] = goAcquire(ctx, ys[i])
	}
	pgtest.Eventually(t, testTimeout, "y to wait on the server for one of the queue keys", func() bool {
		return waitingOn(t, dsn, keyOf(ys[0].queueKey()))+waitingOn(t, dsn, keyOf(ys[1].queueKey())) == 1
	})
	check := func(what string) {
		t.Helper()
		pids := appPIDs(t, pool, "sem-two-queues")
		holds := map[int32][]string{}
		waits := map[int32]bool{}
		for key, hs := range lockState(t, dsn) {
			for _, h := range hs {
				if !pids[h.pid] {
					continue
				}
				if !h.granted {
					waits[h.pid] = true
					continue
				}
				if v, ok := key.Int64(); ok && v&0xFFFF == queueSlot && (v>>16 == ys[0].prefix || v>>16 == ys[1].prefix) {
					continue
				}
				holds[h.pid] = append(holds[h.pid], key.String())
			}
		}
		if len(waits) > 1 {
			t.Fatalf("%s: %d backends of a Client WithMaxWaits(1) wait on the server", what, len(waits))
		}
		for pid := range waits {
			if len(holds[pid]) > 0 {
				t.Fatalf("%s: backend %d waits while it holds %v", what, pid, holds[pid])
			}
		}
		for i := range names {
			slotLocks(t, dsn, xs[i])
		}
	}
	check("y queued behind z's heads")
	pass := func(what string, p *Permit, ch <-chan permitResult) *Permit {
		t.Helper()
		start := time.Now()
		mustRelease(t, p)
		r := receivePermit(t, ch)
		took := time.Since(start)
		if r.err != nil {
			t.Fatalf("%s: Acquire: %v", what, r.err)
		}
		heldOnlyBy(t, dsn, keyOf(r.p.l.KeyList[0]), r.p.l.S.PID())
		t.Logf("%s: the permit reached the head after %v", what, took.Round(time.Millisecond))
		if took > time.Second {
			t.Fatalf("broken promise: %s: a free permit reached the head after %v, bound 1 s", what, took)
		}
		return r.p
	}
	var zp, yp [2]*Permit
	for i := range names {
		zp[i] = pass("x to z on "+names[i], held[i], zch[i])
		awaitHead(t, dsn, ys[i])
		check("y heads " + names[i])
	}
	// Both heads look again at every re-check: one of them may take the
	// only wait, never both. Look for a few re-check intervals.
	awaiting := 0
	for deadline := time.Now().Add(4 * semaphoreRecheck); time.Now().Before(deadline); {
		check("y heads both queues")
		awaiting = max(awaiting, waitingOn(t, dsn, keyOf(ys[0].slotKey(0)))+waitingOn(t, dsn, keyOf(ys[1].slotKey(0))))
	}
	t.Logf("y's heads: at most %d awaited slot 0 on the server at once", awaiting)
	for i := range names {
		yp[i] = pass("z to y on "+names[i], zp[i], ych[i])
		check("y holds " + names[i])
	}
	for i := range names {
		mustRelease(t, yp[i])
		if slots, queued := slotLocks(t, dsn, xs[i]); len(slots) != 0 || queued {
			t.Fatalf("pg_locks at the end: %s slots %v, queue %v", names[i], slots, queued)
		}
	}
}

// Promise (Acquire): while its place in the queue is lost with its
// connection, Acquire lines up again and keeps trying until ctx ends; a
// raised limit wakes the waiters, which take the new permits at once;
// never more than the limit; a free permit reaches the head within 1 s.
//
// Attack: two faults at once. A limit change is in flight (an UPDATE of
// the semaphore's row, not yet committed) while the head's grant waits for
// that row; then either the head's backend is terminated (and the raise
// commits), or the backend of the transaction that changes the limit is
// (and the raise never happens, so the head gets the permit only at the
// holder's release).
func TestSemaphoreHeadGrantWaitsForRowInFlightWhenABackendIsTerminated(t *testing.T) {
	for _, victim := range []string{"head", "limit-change"} {
		t.Run(victim, func(t *testing.T) {
			ctx := testCtx(t)
			dsn, pool := semaphoreDB(t)
			const name = "sem-row-in-flight"
			a := newTestClient(t, dsn).Semaphore(name, 1)
			b := newTestClient(t, dsn).Semaphore(name, 1)
			held := mustAcquire(t, a, true)
			ch := goAcquire(ctx, b)
			awaitHead(t, dsn, b)
			changer := pgtest.Conn(t, dsn)
			var changerPID int32
			if err := changer.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&changerPID); err != nil {
				t.Fatal(err)
			}
			tx, err := changer.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(context.Background()) }()
			if _, err := tx.Exec(ctx, `UPDATE pgcoord.semaphores SET "limit" = 2 WHERE name = $1`, name); err != nil {
				t.Fatal(err)
			}
			// Wake the head (of a semaphore of limit 1, it waits for slot 0
			// on the server) as the raise will at its commit, until its
			// grant waits for the row.
			var headPID int32
			pgtest.Eventually(t, testTimeout, "the head's grant waits for the semaphore's row", func() bool {
				err := pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity
					WHERE datname = current_database() AND wait_event_type = 'Lock'
					  AND wait_event IN ('transactionid', 'tuple') AND query LIKE '%semaphore_acquire%'`).Scan(&headPID)
				if errors.Is(err, pgx.ErrNoRows) {
					if _, err := pool.Exec(ctx, "SELECT pg_notify($1, $2)", semaphoreChannel, a.payload+"limit"); err != nil {
						t.Fatal(err)
					}
					return false
				}
				if err != nil {
					t.Fatal(err)
				}
				return true
			})
			var start time.Time
			var want *Permit // the permit to release for the head, if any
			switch victim {
			case "head":
				pgtest.Terminate(t, dsn, headPID)
				// The head lines up again on another backend and waits on;
				// the raise then commits and must reach it.
				pgtest.Eventually(t, testTimeout, "the Acquire to head the queue again on a new backend", func() bool {
					stillWaitingPermit(t, ch)
					pids := grantedTo(t, dsn, keyOf(b.queueKey()))
					return len(pids) == 1 && pids[0] != headPID
				})
				stillWaitingPermit(t, ch)
				start = time.Now()
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
			case "limit-change":
				pgtest.Terminate(t, dsn, changerPID)
				// No raise: the head's grant finds the limit reached, and
				// the holder's release is what frees a permit.
				pgtest.Eventually(t, testTimeout, "the head's grant to end, finding no permit", func() bool {
					var n int
					if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
						WHERE datname = current_database() AND wait_event_type = 'Lock'
						  AND wait_event IN ('transactionid', 'tuple')`).Scan(&n); err != nil {
						t.Fatal(err)
					}
					stillWaitingPermit(t, ch)
					return n == 0
				})
				awaitHead(t, dsn, b)
				stillWaitingPermit(t, ch)
				start = time.Now()
				want = held
				mustRelease(t, held)
			}
			r := receivePermit(t, ch)
			took := time.Since(start)
			if r.err != nil {
				t.Fatalf("Acquire after the %s's backend was terminated: %v", victim, r.err)
			}
			t.Logf("the head got a permit %v after the %s", took.Round(time.Millisecond), map[string]string{"head": "raise committed", "limit-change": "release"}[victim])
			if took > time.Second {
				t.Fatalf("broken promise: the permit reached the head %v after it was freed, bound 1 s", took)
			}
			heldOnlyBy(t, dsn, keyOf(r.p.l.KeyList[0]), r.p.l.S.PID())
			slots, queued := slotLocks(t, dsn, a)
			wantSlots := 2
			if want != nil {
				wantSlots = 1
			}
			if len(slots) != wantSlots || queued {
				t.Fatalf("pg_locks: slots %v, queue %v; want %d slots and no queue", slots, queued, wantSlots)
			}
			hs, err := a.Holders(ctx)
			if err != nil || len(hs) != wantSlots {
				t.Fatalf("Holders = %+v, %v; want %d", hs, err, wantSlots)
			}
			if _, err := b.TryAcquire(ctx); !errors.Is(err, ErrNoPermit) {
				t.Fatalf("TryAcquire over the limit = %v, want ErrNoPermit", err)
			}
			mustRelease(t, r.p)
			if want == nil {
				mustRelease(t, held)
			}
			if n := holderRows(t, pool, name); n != 0 {
				t.Fatalf("%d holder rows left once every permit is released", n)
			}
		})
	}
}

// stillWaitingPermit fails if the Acquire behind ch has returned: it must
// wait on.
func stillWaitingPermit(t *testing.T, ch <-chan permitResult) {
	t.Helper()
	select {
	case r := <-ch:
		t.Fatalf("Acquire returned while it should wait on: %v, %v", r.p, r.err)
	default:
	}
}

// slowGrantCommit makes the commit of every grant whose holder row
// names identity sleep (a deferred constraint trigger on
// semaphore_holders), so that a test can end an acquire's ctx after its
// statement took the slot and before the grant committed: the moment a
// grant "commits" made wide. The grant's transaction then aborts, taking
// its row with it, while the slot (a session lock) and the release of the
// queue key (an unlock) stay as the statement left them.
func slowGrantCommit(t *testing.T, ctx context.Context, pool *pgxpool.Pool, identity string) {
	t.Helper()
	for _, sql := range []string{
		`CREATE FUNCTION pgcoord.slow_grant_commit() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_catalog.pg_sleep(20); RETURN NULL; END $$`,
		`CREATE CONSTRAINT TRIGGER slow_grant_commit AFTER INSERT OR UPDATE ON pgcoord.semaphore_holders
			DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
			WHEN (NEW.identity = '` + identity + `') EXECUTE FUNCTION pgcoord.slow_grant_commit()`,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
}

// awaitSleepingCommit waits until a backend of the database sleeps in
// the trigger of slowGrantCommit, and returns it.
func awaitSleepingCommit(t *testing.T, ctx context.Context, pool *pgxpool.Pool) int32 {
	t.Helper()
	var pid int32
	pgtest.Eventually(t, testTimeout, "a grant to sleep in its commit", func() bool {
		err := pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event = 'PgSleep'`).Scan(&pid)
		if errors.Is(err, pgx.ErrNoRows) {
			return false
		}
		if err != nil {
			t.Fatal(err)
		}
		return true
	})
	return pid
}

// Promise (Acquire, TryAcquire): "If Acquire returns an error it holds
// nothing: no permit, row or queue place stays behind"; after an error
// of TryAcquire nothing is held. S11: a grant that took the slot and
// failed deletes the slot's rows while it still holds the slot.
//
// Attack: ctx ends exactly as a grant commits (widened by a deferred
// trigger that sleeps in the commit): after the statement took the slot,
// and, for a head, released its queue key. Four grants: a TryAcquire and an
// Acquire with a permit free, the head of a limit-2 semaphore woken by a
// release's notification, and the head of a limit-1 semaphore waiting for
// slot 0 on the server.
func TestSemaphoreCtxEndsAsGrantCommits(t *testing.T) {
	for _, tc := range []struct {
		name  string
		limit int
		try   bool
		head  bool
	}{
		{"try", 2, true, false},
		{"acquire", 2, false, false},
		{"head-notified", 2, false, true},
		{"head-awaiting", 1, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testCtx(t)
			dsn, pool := semaphoreDB(t)
			const name = "sem-slow-commit"
			// A lease long enough for the grant's commit to sleep.
			opts := []Option{WithLossDeadline(30 * time.Second), WithHeartbeat(time.Second)}
			holder := newTestClient(t, dsn, opts...).Semaphore(name, tc.limit)
			wc := newTestClient(t, dsn, append(opts, WithApplicationName("sem-slow"))...)
			waiter := wc.Semaphore(name, tc.limit, WithIdentity("sem-slow"))
			var held []*Permit
			if tc.head {
				for range tc.limit {
					held = append(held, mustAcquire(t, holder, true))
				}
			}
			slowGrantCommit(t, ctx, pool, "sem-slow")
			actx, cancel := context.WithCancel(ctx)
			defer cancel()
			ch := make(chan permitResult, 1)
			go func() {
				acquire := waiter.Acquire
				if tc.try {
					acquire = waiter.TryAcquire
				}
				p, err := acquire(actx)
				ch <- permitResult{p, err}
			}()
			if tc.head {
				awaitHead(t, dsn, waiter)
				mustRelease(t, held[0])
				held = held[1:]
			}
			pid := awaitSleepingCommit(t, ctx, pool)
			// The statement took the slot; a head's statement released its
			// queue key.
			if slots, _ := semaphoreHeldBy(t, dsn, waiter, map[int32]bool{pid: true}); len(slots) != 1 {
				t.Fatalf("the sleeping grant's backend %d holds slots %v, want the one it took", pid, slots)
			}
			cancel()
			r := receivePermit(t, ch)
			if r.err == nil {
				t.Fatalf("the grant whose commit was cancelled returned a permit (slot %d)", r.p.Slot())
			}
			if !errors.Is(r.err, context.Canceled) {
				t.Fatalf("Acquire = %v, want ctx's error", r.err)
			}
			pids := appPIDs(t, pool, "sem-slow")
			if slots, queue := semaphoreHeldBy(t, dsn, waiter, pids); len(slots) != 0 || queue {
				t.Fatalf("broken promise: after the failed grant, the waiter's backends %v hold slots %v, queue %v", pids, slots, queue)
			}
			all, queued := slotLocks(t, dsn, waiter)
			if len(all) != len(held) || queued {
				t.Fatalf("pg_locks: slots %v, queue %v; want only the %d kept permits", all, queued, len(held))
			}
			if n := holderRows(t, pool, name); n != len(held) {
				t.Fatalf("%d holder rows, want %d (the kept permits')", n, len(held))
			}
			if hs, err := waiter.Holders(ctx); err != nil || len(hs) != len(held) {
				t.Fatalf("Holders = %+v, %v; want %d", hs, err, len(held))
			}
			for _, p := range held {
				mustRelease(t, p)
			}
			held = nil
			if _, err := pool.Exec(ctx, `DROP TRIGGER slow_grant_commit ON pgcoord.semaphore_holders`); err != nil {
				t.Fatal(err)
			}
			// Everything works on.
			for range tc.limit {
				held = append(held, mustAcquire(t, waiter, true))
			}
			if _, err := waiter.TryAcquire(ctx); !errors.Is(err, ErrNoPermit) {
				t.Fatalf("TryAcquire over the limit = %v, want ErrNoPermit", err)
			}
			for _, p := range held {
				mustRelease(t, p)
			}
			if n := holderRows(t, pool, name); n != 0 {
				t.Fatalf("%d holder rows left", n)
			}
		})
	}
}
