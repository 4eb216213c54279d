package pgcoord

import (
	"context"
	"testing"

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
