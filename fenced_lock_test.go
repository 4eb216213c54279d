package pgcoord

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

func migrated(t testing.TB, dsn string) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.Pool(t, dsn)
	if err := Migrate(testCtx(t), pool); err != nil {
		t.Fatal(err)
	}
	return pool
}

// Fences from three Clients taking one key 1,000 times are strictly
// increasing in acquisition order, also across a server restart.
func TestFencesIncreaseAcrossClientsAndRestart(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	srv := pgtest.NewServer(t)
	dsn := srv.DB(t)
	migrated(t, dsn)
	clients := []*Client{newTestClient(t, dsn), newTestClient(t, dsn), newTestClient(t, dsn)}
	k := HashKey("fenced", "job")

	var mu sync.Mutex
	var fences []int64 // appended while holding the lock: acquisition order
	round := func(n int64) {
		var left atomic.Int64 // acquisitions left in this round, shared by the Clients
		left.Store(n)
		var wg sync.WaitGroup
		for i, c := range clients {
			wg.Go(func() {
				for left.Add(-1) >= 0 {
					l, err := c.Lock(ctx, k, WithFence())
					if err != nil {
						t.Errorf("client %d: %v", i, err)
						return
					}
					mu.Lock()
					fences = append(fences, int64(l.Fence()))
					mu.Unlock()
					if err := l.Unlock(ctx); err != nil {
						t.Errorf("client %d: Unlock: %v", i, err)
						return
					}
				}
			})
		}
		wg.Wait()
	}
	round(500)
	srv.Restart(t)
	round(500)
	if t.Failed() {
		return
	}
	if len(fences) != 1000 {
		t.Fatalf("%d fences, want 1000", len(fences))
	}
	for i := 1; i < len(fences); i++ {
		if fences[i] <= fences[i-1] {
			t.Fatalf("fence %d is %d after %d: not strictly increasing", i, fences[i], fences[i-1])
		}
	}
	t.Logf("fences %d..%d", fences[0], fences[len(fences)-1])
}

// A holder that lost its lock while paused keeps its old fence; its late
// write is refused, and the data shows only the new holder's write.
func TestPausedHolderWriteIsFenced(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := migrated(t, dsn)
	if _, err := pool.Exec(ctx, "CREATE TABLE balance (id int PRIMARY KEY, amount int, writer text)"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "INSERT INTO balance VALUES (1, 100, 'initial')"); err != nil {
		t.Fatal(err)
	}
	a, b := newTestClient(t, dsn), newTestClient(t, dsn)
	k := HashKey("balance", "1")

	la, err := a.Lock(ctx, k, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	fenceA := la.Fence()
	// A "pauses"; meanwhile its backend is terminated and its lock freed.
	pgtest.Terminate(t, dsn, la.core.S.PID())

	lb, err := b.Lock(ctx, k, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	if lb.Fence() <= fenceA {
		t.Fatalf("B's fence %d is not greater than A's %d", lb.Fence(), fenceA)
	}
	write := func(fence int64, who string, amount int) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if err := CheckFence(ctx, tx, k, Term(fence)); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "UPDATE balance SET amount = $1, writer = $2 WHERE id = 1", amount, who)
			return err
		})
	}
	if err := write(int64(lb.Fence()), "B", 200); err != nil {
		t.Fatalf("B's write: %v", err)
	}
	// A wakes up, unaware, and writes with its old fence.
	if err := write(int64(fenceA), "A", 999); !errors.Is(err, ErrStaleFence) {
		t.Fatalf("A's late write: %v, want ErrStaleFence", err)
	}
	var amount int
	var writer string
	if err := pool.QueryRow(ctx, "SELECT amount, writer FROM balance WHERE id = 1").Scan(&amount, &writer); err != nil {
		t.Fatal(err)
	}
	if amount != 200 || writer != "B" {
		t.Fatalf("balance = %d by %s, want 200 by B", amount, writer)
	}
	mustUnlock(t, lb)
}

// While a transaction that passed CheckFence is open, a newer holder's
// fenced acquire does not complete: it gets its fence only after that
// transaction ends, so the two writers cannot interleave.
func TestFencedAcquireWaitsForCheckedTransaction(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := migrated(t, dsn)
	a, b := newTestClient(t, dsn), newTestClient(t, dsn)
	k := Int64Key(77)

	la, err := a.Lock(ctx, k, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if err := CheckFence(ctx, tx, k, la.Fence()); err != nil {
		t.Fatal(err)
	}
	mustUnlock(t, la) // A's lock ends while its checked transaction is open

	bch := goLock(func() (*Lock, error) { return b.Lock(ctx, k, WithFence()) })
	// B holds the advisory lock but waits for the fence row.
	awaitIssuingFence(t, pool, dsn, k)
	stillWaiting(t, bch)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := receive(t, bch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.l.Fence() != la.Fence()+1 {
		t.Fatalf("B's fence %d, want %d", r.l.Fence(), la.Fence()+1)
	}
	mustUnlock(t, r.l)
}

// awaitIssuingFence waits until one backend holds k and a backend of
// pgcoord waits for a row lock (the fence row, share-locked by a
// transaction that checked the fence), and returns the backend that holds
// k. (The fence may wait on another backend of the Client than the one
// that holds the key.)
func awaitIssuingFence(t *testing.T, pool *pgxpool.Pool, dsn string, k Key) int32 {
	t.Helper()
	ctx := testCtx(t)
	var pid int32
	pgtest.Eventually(t, testTimeout, "a backend holds the key and a fence waits to be issued", func() bool {
		pids := grantedTo(t, dsn, k)
		if len(pids) != 1 {
			return false
		}
		var waiting bool
		err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'
			AND query LIKE '%fences%' AND pid <> pg_backend_pid())`).Scan(&waiting)
		pid = pids[0]
		return err == nil && waiting
	})
	return pid
}

func TestWithFenceNeedsMigrateAndExclusiveSingleKey(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	k := HashKey("nomigrate")
	if _, err := c.Lock(ctx, k, WithFence()); !errors.Is(err, ErrNotMigrated) {
		t.Fatalf("fenced Lock before Migrate: %v, want ErrNotMigrated", err)
	}
	notHeld(t, dsn, k)
	s := newTestSession(t, c)
	if _, err := s.TryLock(ctx, k, WithFence()); !errors.Is(err, ErrNotMigrated) {
		t.Fatalf("fenced TryLock before Migrate: %v, want ErrNotMigrated", err)
	}
	notHeld(t, dsn, k)
	if s.Err() != nil {
		t.Fatalf("session ended by a failed fence: %v", s.Err())
	}
	if _, err := core.NewRequest(coreKeys([]Key{k, Int64Key(1)}), false, false, []core.LockOption{core.WithFence()}); err == nil {
		t.Fatal("WithFence on two keys: no error")
	}
	if _, err := core.NewRequest(coreKeys([]Key{k}), true, false, []core.LockOption{core.WithFence()}); err == nil {
		t.Fatal("WithFence on a shared lock: no error")
	}
}

// Do with WithFence: fn finds the held Lock, and its fence, in its context;
// the fence passes CheckFence, and the key is held by the Lock's backend
// while fn runs.
func TestDoFenceFromContext(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := migrated(t, dsn)
	c := newTestClient(t, dsn)
	k := HashKey("do", "fenced")
	if _, ok := LockFromContext(ctx); ok {
		t.Fatal("LockFromContext outside Do reported a lock")
	}
	var fences []int64
	for range 2 {
		err := c.Do(ctx, k, func(ctx context.Context) error {
			l, ok := LockFromContext(ctx)
			if !ok || l.Key() != k || l.Fence() <= 0 {
				t.Fatalf("LockFromContext in Do: %v, %v", l, ok)
			}
			heldOnlyBy(t, dsn, k, l.core.S.PID())
			fences = append(fences, int64(l.Fence()))
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				return CheckFence(ctx, tx, k, l.Fence())
			})
		}, WithFence())
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(fences) != 2 || fences[1] <= fences[0] {
		t.Fatalf("fences %v, want increasing", fences)
	}
	notHeld(t, dsn, k)
	// Without WithFence, fn still finds the lock; its fence is 0.
	err := c.Do(ctx, k, func(ctx context.Context) error {
		if l, ok := LockFromContext(ctx); !ok || l.Fence() != 0 {
			t.Errorf("LockFromContext without WithFence: %v, %v", l, ok)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
