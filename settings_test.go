package pgcoord

// Elections, semaphores and fences under server settings that many
// deployments use and that the library must not depend on: a database
// whose default isolation is REPEATABLE READ or SERIALIZABLE.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// Under a database default of REPEATABLE READ or SERIALIZABLE, every
// bookkeeping statement of the library works while two Clients race for
// the same fresh rows: Migrate, the first acquires of fresh semaphores,
// SetLimit, campaigns for fresh elections, RequestResign, Leader, Holders
// and Limit, and fenced locks. Each of them updates rows another Client
// updates at the same moment, which at those levels fails with a
// serialization error (SQLSTATE 40001) unless the statement pins READ
// COMMITTED. The outcome is read back from the tables and pg_locks.
func TestBookkeepingUnderStrictIsolation(t *testing.T) {
	t.Parallel()
	for _, level := range []string{"repeatable read", "serializable"} {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			dsn := pgtest.DB(t)
			admin := pgtest.Conn(t, dsn)
			if _, err := admin.Exec(ctx, fmt.Sprintf(`DO $$ BEGIN
				EXECUTE format('ALTER DATABASE %%I SET default_transaction_isolation = %%L', current_database(), '%s');
				END $$`, level)); err != nil {
				t.Fatal(err)
			}
			// The setting is in force for new connections.
			probe := pgtest.Conn(t, dsn)
			if got := settingThrough(t, probe, "transaction_isolation"); got != level {
				t.Fatalf("transaction_isolation = %q on a new connection, want %q", got, level)
			}
			pool := pgtest.Pool(t, dsn)
			// Two Migrates at once, on a fresh database.
			var wg sync.WaitGroup
			errs := make(chan error, 64)
			for range 2 {
				wg.Go(func() {
					if err := Migrate(ctx, pool); err != nil {
						errs <- fmt.Errorf("Migrate: %w", err)
					}
				})
			}
			wg.Wait()
			a := newTestClientOn(t, pool, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
			b := newTestClient(t, dsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
			clients := []*Client{a, b}

			const names = 8
			// Both Clients race for the first permits of fresh
			// semaphores of limit 1, change their limits, and read them.
			var mu sync.Mutex
			granted := map[string]int{}
			var permits []*Permit
			for i := range names {
				for _, c := range clients {
					wg.Go(func() {
						s := c.Semaphore(fmt.Sprintf("strict-%d", i), 1)
						p, err := s.TryAcquire(ctx)
						switch {
						case errors.Is(err, ErrNoPermit):
						case err != nil:
							errs <- fmt.Errorf("semaphore %d: TryAcquire: %w", i, err)
						default:
							mu.Lock()
							granted[s.Name()]++
							permits = append(permits, p)
							mu.Unlock()
						}
						if _, err := s.Holders(ctx); err != nil {
							errs <- fmt.Errorf("semaphore %d: Holders: %w", i, err)
						}
						if err := s.SetLimit(ctx, 1); err != nil {
							errs <- fmt.Errorf("semaphore %d: SetLimit: %w", i, err)
						}
						if _, err := s.Limit(ctx); err != nil {
							errs <- fmt.Errorf("semaphore %d: Limit: %w", i, err)
						}
					})
				}
			}
			// Both Clients campaign for fresh elections at once; each
			// winner is asked to resign by the other Client, and the
			// loser then leads.
			for i := range names {
				wg.Go(func() {
					name := fmt.Sprintf("strict-%d", i)
					terms := make(chan Term, 2)
					var cw sync.WaitGroup
					for _, c := range clients {
						cw.Go(func() {
							ld, err := c.Election(name).Campaign(ctx)
							if err != nil {
								errs <- fmt.Errorf("election %d: Campaign: %w", i, err)
								return
							}
							terms <- ld.Term()
							<-ld.Done()
						})
					}
					for range 2 {
						var term Term
						select {
						case term = <-terms:
						case <-ctx.Done():
							errs <- fmt.Errorf("election %d: no leader: %w", i, ctx.Err())
							return
						}
						info, err := b.Election(name).Leader(ctx)
						if err != nil || info.Term != term {
							errs <- fmt.Errorf("election %d: Leader = %+v, %v, want term %d", i, info, err, term)
						}
						if err := a.Election(name).RequestResign(ctx); err != nil {
							errs <- fmt.Errorf("election %d: RequestResign: %w", i, err)
						}
					}
					cw.Wait()
				})
			}
			// Fenced locks of both Clients on one key issue fences in turn.
			k := Int64Key(42)
			for _, c := range clients {
				wg.Go(func() {
					for range 5 {
						l, err := c.Lock(ctx, k, WithFence())
						if err != nil {
							errs <- fmt.Errorf("fenced Lock: %w", err)
							return
						}
						if err := l.Unlock(ctx); err != nil {
							errs <- fmt.Errorf("fenced Unlock: %w", err)
						}
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}

			// Each fresh semaphore granted its one permit, and pg_locks
			// and the holders table agree.
			for i := range names {
				name := fmt.Sprintf("strict-%d", i)
				if granted[name] != 1 {
					t.Errorf("semaphore %s: %d permits granted, want 1", name, granted[name])
				}
			}
			var held, rows int
			if err := admin.QueryRow(ctx, `SELECT
					(SELECT count(*) FROM pg_locks l JOIN pgcoord.semaphores s ON ((l.classid::bigint << 32) | l.objid::bigint) >> 16 = s.lock_key >> 16
						WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND ((l.classid::bigint << 32) | l.objid::bigint) & 65535 <> 65535
						AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())),
					(SELECT count(*) FROM pgcoord.semaphore_holders)`).Scan(&held, &rows); err != nil {
				t.Fatal(err)
			}
			if held != names || rows != names {
				t.Errorf("%d permits in pg_locks and %d holder rows, want %d of each", held, rows, names)
			}
			for _, p := range permits {
				if err := p.Release(ctx); err != nil {
					t.Errorf("Release: %v", err)
				}
			}
			// Every election went through two terms, and the fences of
			// the lock key through ten.
			var terms, fence int64
			if err := admin.QueryRow(ctx, `SELECT (SELECT coalesce(sum(term), 0) FROM pgcoord.leaders),
					(SELECT fence FROM pgcoord.fences WHERE key_space = 1 AND key = 42)`).Scan(&terms, &fence); err != nil {
				t.Fatal(err)
			}
			if terms != 2*names || fence != 10 {
				t.Errorf("terms sum to %d, want %d; the lock key's fence is %d, want 10", terms, 2*names, fence)
			}
		})
	}
}

// Two applications in one database, each with its own schema, have
// independent elections and semaphores of the same names: each leads its
// own election "sched" and holds the one permit of its own semaphore
// "jobs" at the same time, on distinct keys in pg_locks, and a third Client
// of the first schema sees the first's leader and gets no permit.
func TestSchemasIsolateElectionsAndSemaphores(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	schemas := []string{"app_a", "app_b"}
	leaders := map[string]*Leadership{}
	permits := map[string]*Permit{}
	for _, schema := range schemas {
		if err := Migrate(ctx, pool, WithSchema(schema)); err != nil {
			t.Fatal(err)
		}
		c := newTestClient(t, dsn, WithSchema(schema))
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		ld, err := c.Election("sched").Campaign(cctx)
		cancel()
		if err != nil {
			t.Fatalf("schema %s: Campaign: %v", schema, err)
		}
		leaders[schema] = ld
		p, err := c.Semaphore("jobs", 1).TryAcquire(ctx)
		if err != nil {
			t.Fatalf("schema %s: TryAcquire: %v", schema, err)
		}
		permits[schema] = p
	}
	a, b := leaders["app_a"], leaders["app_b"]
	if a.e.Key() == b.e.Key() || permits["app_a"].l.Key() == permits["app_b"].l.Key() {
		t.Fatalf("the schemas share keys: elections %v and %v, permits %v and %v",
			a.e.Key(), b.e.Key(), permits["app_a"].l.Key(), permits["app_b"].l.Key())
	}
	for _, schema := range schemas {
		heldOnlyBy(t, dsn, leaders[schema].e.Key(), leaders[schema].lock.S.PID())
		heldOnlyBy(t, dsn, keyOf(permits[schema].l.Key()), permits[schema].l.S.PID())
		if leaders[schema].Err() != nil || permits[schema].Err() != nil {
			t.Fatalf("schema %s: leadership %v, permit %v", schema, leaders[schema].Err(), permits[schema].Err())
		}
	}
	other := newTestClient(t, dsn, WithSchema("app_a"))
	info, err := other.Election("sched").Leader(ctx)
	if err != nil || info.Term != a.Term() || info.PID != a.lock.S.PID() {
		t.Fatalf("Leader in app_a = %+v, %v; want term %d on backend %d", info, err, a.Term(), a.lock.S.PID())
	}
	if _, err := other.Semaphore("jobs", 1).TryAcquire(ctx); !errors.Is(err, ErrNoPermit) {
		t.Fatalf("a second permit of app_a's jobs: %v, want ErrNoPermit", err)
	}
	for _, schema := range schemas {
		if err := leaders[schema].Resign(ctx); err != nil {
			t.Error(err)
		}
		if err := permits[schema].Release(ctx); err != nil {
			t.Error(err)
		}
	}
}

// A Client whose pool has no free connection (the caller holds its only
// one) still campaigns, leads, steps down on request, and acquires and
// releases permits: none of it waits for the pool. What reads through the
// pool (Leader, Holders) is bounded by its ctx, and Close by the loss
// deadline.
func TestElectionsAndSemaphoresWithExhaustedPool(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	const loss = time.Second
	pool := pgtest.Pool(t, dsn, func(cfg *pgxpool.Config) { cfg.MaxConns = 1 })
	c, err := New(pool, WithLossDeadline(loss), WithHeartbeat(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	held, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release()
	other := newTestClient(t, dsn)

	ld, err := c.Election("starved").Campaign(ctx)
	if err != nil {
		t.Fatalf("Campaign with the pool exhausted: %v", err)
	}
	heldOnlyBy(t, dsn, ld.e.Key(), ld.lock.S.PID())
	if err := other.Election("starved").RequestResign(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ld.Done():
	case <-ctx.Done():
		t.Fatal("the leader did not step down on request with its pool exhausted")
	}
	notHeld(t, dsn, ld.e.Key())

	sem := c.Semaphore("starved", 1)
	p, err := sem.Acquire(ctx)
	if err != nil {
		t.Fatalf("Acquire with the pool exhausted: %v", err)
	}
	heldOnlyBy(t, dsn, keyOf(p.l.Key()), p.l.S.PID())
	if _, err := other.Semaphore("starved", 1).TryAcquire(ctx); !errors.Is(err, ErrNoPermit) {
		t.Fatalf("a second permit: %v, want ErrNoPermit", err)
	}
	if err := p.Release(ctx); err != nil {
		t.Fatal(err)
	}
	notHeld(t, dsn, keyOf(p.l.Key()))

	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	_, err = c.Election("starved").Leader(short)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Leader with the pool exhausted: %v, want the ctx's deadline", err)
	}
	start := time.Now()
	if err := c.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > loss {
		t.Fatalf("Close took %v, want within the loss deadline %v", took, loss)
	}
}
