package pgcoord

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// Many goroutines, many keys: each goroutine locks keys of its own in a
// loop, through one Client with its default options, next to the floor of
// K goroutines with a pgx connection each. b.N cycles are shared out among
// the goroutines; ops/s is the cycles of all of them per second, and
// conns the connections the Client opened for its locks (Stat.Backends).
//
//	ROUNDS=3 COUNT=1 scripts/bench-pinned.sh 'Parallel'

// parallelKs are the numbers of goroutines of each parallel benchmark.
var parallelKs = []int{8, 64}

// runParallel runs n cycles of op over k goroutines (op gets the
// goroutine's number) and reports ops/s.
func runParallel(b *testing.B, k int, op func(g int) error) {
	b.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	var failed atomic.Bool
	n := int64(b.N)
	b.ResetTimer()
	start := time.Now()
	for g := range k {
		wg.Go(func() {
			for next.Add(1) <= n && !failed.Load() {
				if err := op(g); err != nil {
					failed.Store(true)
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "ops/s")
}

// reportConns reports the connections c opened for its locks.
func reportConns(b *testing.B, c *Client) {
	b.ReportMetric(float64(c.Stat().Backends), "conns")
}

// rawConns opens k pgx connections to dsn.
func rawConns(b *testing.B, dsn string, k int) []*pgx.Conn {
	conns := make([]*pgx.Conn, k)
	for i := range conns {
		conns[i] = pgtest.Conn(b, dsn)
	}
	return conns
}

// parallelKey is goroutine g's i-th key.
func parallelKey(g, i int) Key { return Int64Key(int64(10_000_000 + 100*g + i)) }

// BenchmarkParallelTryLock: TryLock + Unlock of the goroutine's own key.
func BenchmarkParallelTryLock(b *testing.B) {
	for _, k := range parallelKs {
		b.Run(fmt.Sprint("K=", k), func(b *testing.B) {
			ctx := context.Background()
			c := newTestClient(b, pgtest.DB(b))
			runParallel(b, k, func(g int) error {
				l, err := c.TryLock(ctx, parallelKey(g, 0))
				if err != nil {
					return err
				}
				return l.Unlock(ctx)
			})
			reportConns(b, c)
		})
	}
}

// BenchmarkRawParallelTryLock is its floor: pg_try_advisory_lock +
// pg_advisory_unlock, each goroutine on a connection of its own.
func BenchmarkRawParallelTryLock(b *testing.B) {
	for _, k := range parallelKs {
		b.Run(fmt.Sprint("K=", k), func(b *testing.B) {
			ctx := context.Background()
			conns := rawConns(b, pgtest.DB(b), k)
			runParallel(b, k, func(g int) error {
				v, _ := parallelKey(g, 0).Int64()
				var ok bool
				if err := conns[g].QueryRow(ctx, "SELECT pg_try_advisory_lock($1::int8)", v).Scan(&ok); err != nil || !ok {
					return fmt.Errorf("try: %v, %v", ok, err)
				}
				return conns[g].QueryRow(ctx, "SELECT pg_advisory_unlock($1::int8)", v).Scan(&ok)
			})
		})
	}
}

// BenchmarkParallelLock: a blocking Lock (of a free key) + Unlock.
func BenchmarkParallelLock(b *testing.B) {
	for _, k := range parallelKs {
		b.Run(fmt.Sprint("K=", k), func(b *testing.B) {
			ctx := context.Background()
			c := newTestClient(b, pgtest.DB(b))
			runParallel(b, k, func(g int) error {
				l, err := c.Lock(ctx, parallelKey(g, 0))
				if err != nil {
					return err
				}
				return l.Unlock(ctx)
			})
			reportConns(b, c)
		})
	}
}

// BenchmarkRawParallelLock is its floor: pg_advisory_lock +
// pg_advisory_unlock on a connection of each goroutine's own.
func BenchmarkRawParallelLock(b *testing.B) {
	for _, k := range parallelKs {
		b.Run(fmt.Sprint("K=", k), func(b *testing.B) {
			ctx := context.Background()
			conns := rawConns(b, pgtest.DB(b), k)
			runParallel(b, k, func(g int) error {
				v, _ := parallelKey(g, 0).Int64()
				if _, err := conns[g].Exec(ctx, "SELECT pg_advisory_lock($1::int8)", v); err != nil {
					return err
				}
				var ok bool
				return conns[g].QueryRow(ctx, "SELECT pg_advisory_unlock($1::int8)", v).Scan(&ok)
			})
		})
	}
}

// parallelLockAllKeys are the sizes of the key sets of the LockAll
// benchmarks; 8 goroutines take their own sets.
var parallelLockAllKeys = []int{2, 10}

// BenchmarkParallelLockAll: LockAll of the goroutine's own keys + Unlock.
func BenchmarkParallelLockAll(b *testing.B) {
	for _, n := range parallelLockAllKeys {
		b.Run(fmt.Sprint("keys=", n), func(b *testing.B) {
			ctx := context.Background()
			c := newTestClient(b, pgtest.DB(b))
			runParallel(b, 8, func(g int) error {
				keys := make([]Key, n)
				for i := range keys {
					keys[i] = parallelKey(g, i)
				}
				l, err := c.LockAll(ctx, keys...)
				if err != nil {
					return err
				}
				return l.Unlock(ctx)
			})
			reportConns(b, c)
		})
	}
}

// BenchmarkRawParallelLockAll is its floor: one statement that takes the
// keys in order (pg_advisory_lock for each, in the select list) and one
// that releases them, on a connection of each goroutine's own.
func BenchmarkRawParallelLockAll(b *testing.B) {
	for _, n := range parallelLockAllKeys {
		b.Run(fmt.Sprint("keys=", n), func(b *testing.B) {
			ctx := context.Background()
			conns := rawConns(b, pgtest.DB(b), 8)
			runParallel(b, 8, func(g int) error {
				keys := make([]Key, n)
				for i := range keys {
					keys[i] = parallelKey(g, i)
				}
				lock, args := core.LockSQL("pg_advisory_lock", coreKeys(keys))
				if _, err := conns[g].Exec(ctx, lock, args...); err != nil {
					return err
				}
				unlock, args := core.LockSQL("pg_advisory_unlock", coreKeys(keys))
				_, err := conns[g].Exec(ctx, unlock, args...)
				return err
			})
		})
	}
}

// BenchmarkParallelInTx: InTx with two keys of the goroutine's own, 8
// goroutines on one pool.
func BenchmarkParallelInTx(b *testing.B) {
	ctx := context.Background()
	pool := pgtest.Pool(b, pgtest.DB(b))
	nop := func(pgx.Tx) error { return nil }
	runParallel(b, 8, func(g int) error {
		return InTx(ctx, pool, []Key{parallelKey(g, 1), parallelKey(g, 0)}, nop)
	})
}

// BenchmarkRawParallelInTx is its floor: BEGIN; one statement taking both
// keys with pg_advisory_xact_lock; COMMIT, on the same kind of pool.
func BenchmarkRawParallelInTx(b *testing.B) {
	ctx := context.Background()
	pool := pgtest.Pool(b, pgtest.DB(b))
	const lock = "SELECT pg_advisory_xact_lock($1::int8), pg_advisory_xact_lock($2::int8)"
	runParallel(b, 8, func(g int) error {
		v0, _ := parallelKey(g, 0).Int64()
		v1, _ := parallelKey(g, 1).Int64()
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, lock, v0, v1); err != nil {
			_ = tx.Rollback(ctx)
			return err
		}
		return tx.Commit(ctx)
	})
}
