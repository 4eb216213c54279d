// Package contribtest holds what the tests of the contrib metric modules
// (contrib/otel, contrib/prometheus) share: a bounded context, a migrated
// database, a Client closed with the test, what pg_locks says about a key
// or a semaphore, and a Client made to drop hook events. The databases
// come from internal/pgtest, so a test binary that uses this package
// calls pgtest.Main from its TestMain.
package contribtest

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// Timeout bounds each wait of a test; Ctx gives the whole test twice as
// long.
const Timeout = 30 * time.Second

// Ctx returns a context that ends after 2*Timeout, or when the test ends.
func Ctx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*Timeout)
	t.Cleanup(cancel)
	return ctx
}

// Migrated returns a fresh database with pgcoord's tables, and a pool on
// it.
func Migrated(t testing.TB) (string, *pgxpool.Pool) {
	t.Helper()
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	if err := pgcoord.Migrate(Ctx(t), pool); err != nil {
		t.Fatal(err)
	}
	return dsn, pool
}

// NewClient returns a Client on pool, closed at the end of the test (a
// second Close is a no-op).
func NewClient(t testing.TB, pool *pgxpool.Pool, opts ...pgcoord.Option) *pgcoord.Client {
	t.Helper()
	c, err := pgcoord.New(pool, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

// SlotsHeld counts, from pg_locks of the database dsn, the granted slots
// of sem (not its queue).
func SlotsHeld(t testing.TB, dsn string, sem *pgcoord.Semaphore) int {
	t.Helper()
	v, _ := sem.Key().Int64()
	conn := pgtest.Conn(t, dsn)
	var n int
	err := conn.QueryRow(Ctx(t), `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1
		AND ((classid::bigint << 32) | objid::bigint) >> 16 = $1
		AND ((classid::bigint << 32) | objid::bigint) & 65535 <> 65535
		AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`, v>>16).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// LockHolder returns the backend that holds k, from pg_locks of the
// database dsn.
func LockHolder(t testing.TB, dsn string, k pgcoord.Key) int32 {
	t.Helper()
	v, ok := k.Int64()
	if !ok {
		t.Fatalf("key %v is not a bigint key", k)
	}
	conn := pgtest.Conn(t, dsn)
	var pid int32
	err := conn.QueryRow(Ctx(t), `SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1
		AND (classid::bigint << 32) | objid::bigint = $1
		AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`, v).Scan(&pid)
	if err != nil {
		t.Fatalf("holder of %v in pg_locks: %v", k, err)
	}
	return pid
}

// A Dropper makes a Client drop hook events: its Hooks, chained before
// the metrics' hooks, hold the first lock event until Open is called.
type Dropper struct {
	entered chan struct{}
	gate    chan struct{}
	once    sync.Once
	n       atomic.Int64
}

// NewDropper returns a Dropper whose gate is closed.
func NewDropper() *Dropper {
	return &Dropper{entered: make(chan struct{}, 1), gate: make(chan struct{})}
}

// Hooks returns the hooks that hold the first lock event at the gate.
func (d *Dropper) Hooks() pgcoord.Hooks {
	return pgcoord.Hooks{OnAcquire: func(pgcoord.AcquireEvent) {
		if d.n.Add(1) == 1 {
			d.entered <- struct{}{}
			<-d.gate
		}
	}}
}

// Open opens the gate; calling it again does nothing.
func (d *Dropper) Open() { d.once.Do(func() { close(d.gate) }) }

// Drop makes c, a Client with d's Hooks, drop extra hook events: it holds
// a lock while the hook is stuck in its event, tries the lock
// MaxPendingHookEvents+extra times in the process, then opens the gate.
// It returns the lock, held.
func (d *Dropper) Drop(t testing.TB, c *pgcoord.Client, extra int) *pgcoord.Lock {
	t.Helper()
	ctx := Ctx(t)
	k := pgcoord.HashKey("dropper")
	l, err := c.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-d.entered:
	case <-ctx.Done():
		t.Fatal("the hook did not get the first event")
	}
	for range pgcoord.MaxPendingHookEvents + extra {
		if _, err := c.TryLock(ctx, k); !errors.Is(err, pgcoord.ErrLocked) {
			t.Fatalf("TryLock of a key the Client holds = %v, want ErrLocked", err)
		}
	}
	d.Open()
	return l
}
