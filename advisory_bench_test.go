package pgcoord

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// The benchmarks come in pairs: pgcoord's path and the raw pgx floor it
// stands on, run in the same process against the same server, so their
// ratio is the overhead pgcoord adds. Compare ns/op within one run:
//
//	go test -run '^$' -bench 'LockUnlock' -count 5 .

// BenchmarkRawPinnedLockUnlock is the floor for a Session: try-lock and
// unlock on one pinned connection, two round trips.
func BenchmarkRawPinnedLockUnlock(b *testing.B) {
	ctx := context.Background()
	conn := pgtest.Conn(b, pgtest.DB(b))
	var ok bool
	for b.Loop() {
		if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1::int8)", int64(42)).Scan(&ok); err != nil || !ok {
			b.Fatal(err, ok)
		}
		if err := conn.QueryRow(ctx, "SELECT pg_advisory_unlock($1::int8)", int64(42)).Scan(&ok); err != nil || !ok {
			b.Fatal(err, ok)
		}
	}
}

// BenchmarkSessionLockUnlock is Session.Lock + Unlock.
func BenchmarkSessionLockUnlock(b *testing.B) {
	ctx := context.Background()
	s := newTestSession(b, newTestClient(b, pgtest.DB(b)))
	k := Int64Key(42)
	for b.Loop() {
		l, err := s.Lock(ctx, k)
		if err != nil {
			b.Fatal(err)
		}
		if err := l.Unlock(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRawPoolLockUnlock is the floor for a Client: borrow a pool
// connection, try-lock, unlock, give it back.
func BenchmarkRawPoolLockUnlock(b *testing.B) {
	ctx := context.Background()
	pool := pgtest.Pool(b, pgtest.DB(b))
	var ok bool
	for b.Loop() {
		err := func() error {
			conn, err := pool.Acquire(ctx)
			if err != nil {
				return err
			}
			defer conn.Release()
			if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1::int8)", int64(42)).Scan(&ok); err != nil || !ok {
				return err
			}
			return conn.QueryRow(ctx, "SELECT pg_advisory_unlock($1::int8)", int64(42)).Scan(&ok)
		}()
		if err != nil || !ok {
			b.Fatal(err, ok)
		}
	}
}

// BenchmarkClientLockUnlock is Client.Lock + Unlock.
func BenchmarkClientLockUnlock(b *testing.B) {
	ctx := context.Background()
	c := newTestClient(b, pgtest.DB(b))
	k := Int64Key(42)
	for b.Loop() {
		l, err := c.Lock(ctx, k)
		if err != nil {
			b.Fatal(err)
		}
		if err := l.Unlock(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkClientTryLockUnlock is Client.TryLock + Unlock, the exact
// counterpart of the raw pool floor.
func BenchmarkClientTryLockUnlock(b *testing.B) {
	ctx := context.Background()
	c := newTestClient(b, pgtest.DB(b))
	k := Int64Key(42)
	for b.Loop() {
		l, err := c.TryLock(ctx, k)
		if err != nil {
			b.Fatal(err)
		}
		if err := l.Unlock(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkInterleaved runs the four benchmarks above in one loop, one
// Lock+Unlock of each per iteration, and reports the median of each
// (client-p50-us, raw-pool-p50-us, session-p50-us, raw-pinned-p50-us)
// and the ratios of pgcoord to its floor (client/raw, session/raw). The
// order of the four turns by one every iteration.
// Separate benchmarks run minutes apart, and on a shared or virtual machine
// their round trips drift by more than the overhead being measured;
// interleaved, every path sees the same conditions. ns/op is one round of
// all four.
func BenchmarkInterleaved(b *testing.B) {
	ctx := context.Background()
	dsn := pgtest.DB(b)
	c := newTestClient(b, dsn)
	s := newTestSession(b, c)
	pool := pgtest.Pool(b, dsn)
	pinned := pgtest.Conn(b, dsn)
	k := Int64Key(42)
	var ok bool
	rawPair := func(q interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	}) {
		if err := q.QueryRow(ctx, "SELECT pg_try_advisory_lock($1::int8)", int64(43)).Scan(&ok); err != nil || !ok {
			b.Fatal(err, ok)
		}
		if err := q.QueryRow(ctx, "SELECT pg_advisory_unlock($1::int8)", int64(43)).Scan(&ok); err != nil || !ok {
			b.Fatal(err, ok)
		}
	}
	lockPair := func(lock func(context.Context, Key, ...LockOption) (*Lock, error)) {
		l, err := lock(ctx, k)
		if err != nil {
			b.Fatal(err)
		}
		if err := l.Unlock(ctx); err != nil {
			b.Fatal(err)
		}
	}
	paths := []struct {
		name string
		run  func()
	}{
		{"raw-pool", func() {
			conn, err := pool.Acquire(ctx)
			if err != nil {
				b.Fatal(err)
			}
			rawPair(conn)
			conn.Release()
		}},
		{"client", func() { lockPair(c.Lock) }},
		{"raw-pinned", func() { rawPair(pinned) }},
		{"session", func() { lockPair(s.Lock) }},
	}
	took := make([][]time.Duration, len(paths))
	for round := 0; b.Loop(); round++ {
		// Each round starts one path later than the last, so that every
		// path follows every other equally often: in a fixed order, a path
		// always runs right after the same one, and what that one leaves
		// behind (whose backend just ran, whose code is in the caches)
		// moves its figure by several percent.
		for j := range paths {
			i := (round + j) % len(paths)
			start := time.Now()
			paths[i].run()
			took[i] = append(took[i], time.Since(start))
		}
	}
	p50 := make([]float64, len(paths))
	for i, p := range paths {
		slices.Sort(took[i])
		p50[i] = float64(took[i][len(took[i])/2].Nanoseconds()) / 1e3
		b.ReportMetric(p50[i], p.name+"-p50-us")
	}
	b.ReportMetric(p50[1]/p50[0], "client/raw")
	b.ReportMetric(p50[3]/p50[2], "session/raw")
}
