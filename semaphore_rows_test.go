package pgcoord

import (
	"context"
	"fmt"
	"sync"
	"testing"

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
					if h.PID == p.l.s.PID() && h.Slot == p.Slot() {
						found = true
						if want := fmt.Sprintf("client-%d", i); h.Identity != want || h.Since.IsZero() {
							fail("client %d: Holders lists its permit (slot %d, backend %d) as %q since %v, want %q", i, h.Slot, h.PID, h.Identity, h.Since, want)
						}
					}
				}
				if !found {
					fail("client %d: Holders %+v lacks its permit (slot %d, backend %d)", i, hs, p.Slot(), p.l.s.PID())
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
