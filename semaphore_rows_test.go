package pgcoord

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// holderRowPIDs returns, by slot, the pid of each row of semaphore_holders
// for name.
func holderRowPIDs(t testing.TB, pool *pgxpool.Pool, name string) map[int]int32 {
	t.Helper()
	rows, err := pool.Query(testCtx(t), "SELECT slot, pid FROM pgcoord.semaphore_holders WHERE name = $1", name)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]int32{}
	for rows.Next() {
		var slot, pid int32
		if err := rows.Scan(&slot, &pid); err != nil {
			t.Fatal(err)
		}
		out[int(slot)] = pid
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// Promise (Semaphore "Model", Holders, S11): a release whose slot passes
// straight on leaves its row to be written over by the slot's next grant,
// and until then Holders ignores it. Here the slot passes, at the release,
// to a backend that waits for the slot key by hand (pg_advisory_lock from
// plain SQL), which is no permit and writes no row: Holders lists that
// backend with no identity, never the releaser; once the hand lock is
// dropped, the next Acquire's row is the slot's only row, and its release
// leaves none.
func TestSemaphoreRowsSlotTakenByHandShowsNoReleaser(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	const name = "rows-hand"
	sem := newTestClient(t, dsn).Semaphore(name, 1, WithIdentity("releaser"))
	p := mustAcquire(t, sem, true)
	key := sem.prefix<<16 | int64(p.Slot())

	hand, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer hand.Close(context.Background())
	var handPID int32
	if err := hand.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&handPID); err != nil {
		t.Fatal(err)
	}
	locked := make(chan error, 1)
	go func() {
		_, err := hand.Exec(ctx, "SELECT pg_advisory_lock($1)", key)
		locked <- err
	}()
	pgtest.Eventually(t, testTimeout, "the plain SQL backend to wait for the slot key", func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1
			AND NOT granted AND pid = $1`, handPID).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	})
	mustRelease(t, p)
	if err := <-locked; err != nil {
		t.Fatal(err)
	}
	hs, err := sem.Holders(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(hs) != 1 || hs[0].PID != handPID || hs[0].Identity != "" {
		t.Fatalf("Holders = %+v, want only the plain SQL backend %d with no identity", hs, handPID)
	}
	if rows := holderRowPIDs(t, pool, name); len(rows) > 1 || len(rows) == 1 && rows[p.Slot()] != p.l.S.PID() {
		t.Fatalf("semaphore_holders with the slot held by hand: rows %v (slot: pid), want at most the releaser's (backend %d)", rows, p.l.S.PID())
	}
	if _, err := hand.Exec(ctx, "SELECT pg_advisory_unlock($1)", key); err != nil {
		t.Fatal(err)
	}
	next := newTestClient(t, dsn).Semaphore(name, 1, WithIdentity("next"))
	np := mustAcquire(t, next, false)
	if rows := holderRowPIDs(t, pool, name); len(rows) != 1 || rows[np.Slot()] != np.l.S.PID() {
		t.Fatalf("semaphore_holders after the next Acquire: rows %v (slot: pid), want only its row (backend %d)", rows, np.l.S.PID())
	}
	hs, err = sem.Holders(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(hs) != 1 || hs[0].PID != np.l.S.PID() || hs[0].Identity != "next" {
		t.Fatalf("Holders = %+v, want only the next Acquire's backend %d, identity next", hs, np.l.S.PID())
	}
	mustRelease(t, np)
	if rows := holderRowPIDs(t, pool, name); len(rows) != 0 {
		t.Fatalf("semaphore_holders after every release: rows %v (slot: pid), want none", rows)
	}
}

// Promise (Semaphore "Model", Holders, Permit.Release): with several
// slots, Clients that release and acquire again at once, some with
// TryAcquire racing the releases and some woken by notification, never
// hold more than the limit; Holders, read by each holder while it holds,
// lists it with its own identity and slot; and once every permit is
// released, with every Client still open, no row stays.
func TestSemaphoreRowsChurnLeavesExactRows(t *testing.T) {
	t.Parallel()
	dsn, pool := semaphoreDB(t)
	semaphoreRowsChurn(t, dsn, pool)
}

// As TestSemaphoreRowsChurnLeavesExactRows, on a database whose
// transactions are SERIALIZABLE by default: a release that deletes its row
// and frees the slot in one statement, and a grant that writes the row of
// the slot it takes, serialise without an error.
func TestSemaphoreRowsChurnSerializable(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	admin := pgtest.Conn(t, dsn)
	if _, err := admin.Exec(ctx, `DO $$ BEGIN
		EXECUTE format('ALTER DATABASE %I SET default_transaction_isolation = %L', current_database(), 'serializable');
		END $$`); err != nil {
		t.Fatal(err)
	}
	pool := pgtest.Pool(t, dsn)
	if err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	semaphoreRowsChurn(t, dsn, pool)
}

// semaphoreRowsChurn runs the churn of TestSemaphoreRowsChurnLeavesExactRows
// on the database of dsn (pool), migrated.
func semaphoreRowsChurn(t *testing.T, dsn string, pool *pgxpool.Pool) {
	ctx := testCtx(t)
	const (
		name   = "rows-churn"
		limit  = 2
		nc     = 4
		rounds = 40
	)
	sems := make([]*Semaphore, nc)
	for i := range sems {
		sems[i] = newTestClient(t, dsn).Semaphore(name, limit, WithIdentity(fmt.Sprintf("client-%d", i)))
	}
	var (
		mu    sync.Mutex
		held  int
		fails []string
	)
	fail := func(format string, args ...any) {
		mu.Lock()
		fails = append(fails, fmt.Sprintf(format, args...))
		mu.Unlock()
	}
	var wg sync.WaitGroup
	for i, sem := range sems {
		wg.Go(func() {
			for r := 0; r < rounds; r++ {
				var (
					p   *Permit
					err error
				)
				if i%2 == 1 && r%2 == 0 {
					p, err = sem.TryAcquire(ctx)
					if err != nil {
						continue // ErrNoPermit: the others hold them
					}
				} else if p, err = sem.Acquire(ctx); err != nil {
					fail("client %d: Acquire: %v", i, err)
					return
				}
				mu.Lock()
				held++
				if held > limit {
					fails = append(fails, fmt.Sprintf("%d permits held, limit %d", held, limit))
				}
				mu.Unlock()
				hs, err := sem.Holders(ctx)
				if err != nil {
					fail("client %d: Holders: %v", i, err)
				}
				found := false
				for _, h := range hs {
					if h.PID == p.l.S.PID() && h.Slot == p.Slot() {
						found = true
						if want := fmt.Sprintf("client-%d", i); h.Identity != want || h.Since.IsZero() {
							fail("client %d: Holders lists its permit (slot %d, backend %d) as %q since %v, want %q", i, h.Slot, h.PID, h.Identity, h.Since, want)
						}
					}
				}
				if !found {
					fail("client %d: Holders %+v lacks its permit (slot %d, backend %d)", i, hs, p.Slot(), p.l.S.PID())
				}
				mu.Lock()
				held--
				mu.Unlock()
				if err := p.Release(context.Background()); err != nil {
					fail("client %d: Release: %v", i, err)
					return
				}
			}
		})
	}
	wg.Wait()
	for _, f := range fails {
		t.Error(f)
	}
	if t.Failed() {
		return
	}
	if slots := awaitSettled(t, dsn, sems[0]); len(slots) != 0 {
		t.Fatalf("pg_locks: slots %v held after every release", slots)
	}
	if rows := holderRowPIDs(t, pool, name); len(rows) != 0 {
		t.Fatalf("semaphore_holders after every release, all Clients open: rows %v (slot: pid), want none", rows)
	}
}

// Promise (Semaphore "Model", Holders, S10/S11): the head of a limit-1
// semaphore, granted slot 0 on the server by the holder's release, gives
// it back when other slots are granted past the limit (a row of another
// slot, left by a holder whose backend was terminated, sends
// semaphore_await to pg_locks, where a key of slot 1 taken by hand
// counts). The releaser's row, left to the grant that gave the slot back,
// never shows in Holders; once slot 1 is free the head gets its permit,
// and its row is slot 0's.
func TestSemaphoreRowsHeadGivesSlotBackShowsNoReleaser(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := semaphoreDB(t)
	const name = "rows-giveback"
	holders := newTestClient(t, dsn).Semaphore(name, 2)
	// The backend of dead's permit is terminated: its Close reports the
	// release it could not confirm.
	dc, err := New(pgtest.Pool(t, dsn))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dc.Close(context.Background()) })
	dead := dc.Semaphore(name, 2)
	a := mustAcquire(t, holders, true)
	b := mustAcquire(t, dead, true)
	if a.Slot() != 0 || b.Slot() != 1 {
		t.Fatalf("slots %d and %d, want 0 and 1", a.Slot(), b.Slot())
	}
	if err := holders.SetLimit(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", b.l.S.PID()); err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, testTimeout, "slot 1 to be free", func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND pid = $1`, b.l.S.PID()).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
	// A Client made after the change of the limit: no notification of it
	// ends the head's wait.
	head := newTestClient(t, dsn).Semaphore(name, 1)
	ch := goAcquire(ctx, head)
	awaitSlotWaiter(t, dsn, head)

	hand, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer hand.Close(context.Background())
	if _, err := hand.Exec(ctx, "SELECT pg_advisory_lock($1)", head.prefix<<16|1); err != nil {
		t.Fatal(err)
	}
	mustRelease(t, a)
	pgtest.Eventually(t, testTimeout, "the head to end its wait for slot 0", func() bool {
		return len(slotWaiters(t, dsn, head)[0]) == 0
	})
	hs, err := head.Holders(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(hs) != 1 || hs[0].Slot != 1 || hs[0].Identity != "" {
		t.Fatalf("Holders after the head gave slot 0 back = %+v, want only slot 1, held by hand, with no identity", hs)
	}
	if _, err := hand.Exec(ctx, "SELECT pg_advisory_unlock($1)", head.prefix<<16|1); err != nil {
		t.Fatal(err)
	}
	r := receivePermit(t, ch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if rows := holderRowPIDs(t, pool, name); rows[r.p.Slot()] != r.p.l.S.PID() {
		t.Fatalf("semaphore_holders after the head's grant: rows %v (slot: pid), want slot %d's row the head's (backend %d)", rows, r.p.Slot(), r.p.l.S.PID())
	}
	mustRelease(t, r.p)
}
