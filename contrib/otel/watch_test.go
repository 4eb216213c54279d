package pgcoordotel_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/contrib/internal/contribtest"
	pgcoordotel "github.com/pgcoord/pgcoord/contrib/otel"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Unwatch keeps a Client's dropped hook events counted in
// pgcoord.hook.events.dropped, and watching a Client again after Unwatch
// counts only what it drops after that: its events are never counted
// twice.
func TestWatchAfterUnwatchCountsDroppedOnce(t *testing.T) {
	ctx := contribtest.Ctx(t)
	_, pool := contribtest.Migrated(t)
	m, reader := newMetrics(t)
	d := contribtest.NewDropper()
	c := contribtest.NewClient(t, pool, pgcoord.WithHooks(pgcoordotel.Chain(d.Hooks(), m.Hooks())))
	t.Cleanup(d.Open)
	l := d.Drop(t, c, 5)
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	dropped := float64(c.Stat().DroppedHookEvents)
	if dropped < 5 {
		t.Fatalf("Stat().DroppedHookEvents = %v, want at least 5", dropped)
	}
	const series = `pgcoord.hook.events.dropped{}`
	m.Watch(c)
	if got := values(t, reader)[series]; got != dropped {
		t.Fatalf("watched: %s = %v, want %v", series, got, dropped)
	}
	m.Unwatch(c)
	if got := values(t, reader)[series]; got != dropped {
		t.Fatalf("unwatched: %s = %v, want %v (kept)", series, got, dropped)
	}
	m.Watch(c)
	if got := values(t, reader)[series]; got != dropped {
		t.Errorf("watched again: %s = %v, want %v: the Client's %v dropped events are counted twice", series, got, dropped, dropped)
	}
}

// Two Clients feed one Metrics; one closes while holding permits and a
// lock. Close delivers their ends, so the up-down counters drop at once to
// what the other Client holds, matching pg_locks; once it releases, every
// one is back to 0 and the counters add up over both Clients.
func TestMetricsTwoClientsOneClosed(t *testing.T) {
	ctx := contribtest.Ctx(t)
	dsn, pool := contribtest.Migrated(t)
	m, reader := newMetrics(t)
	job := pgcoord.HashKey("job")
	names := pgcoord.WithKeyNames(map[pgcoord.Key]string{job: "job"})
	a := contribtest.NewClient(t, pool, m.Option(), names)
	b := contribtest.NewClient(t, pool, m.Option(), names)
	m.Watch(a)
	m.Watch(b)
	m.Watch(a) // counted once
	semA, semB := a.Semaphore("jobs", 3), b.Semaphore("jobs", 3)
	for range 2 {
		if _, err := semA.TryAcquire(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := a.Lock(ctx, job); err != nil {
		t.Fatal(err)
	}
	pb, err := semB.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := semB.TryAcquire(ctx); !errors.Is(err, pgcoord.ErrNoPermit) {
		t.Fatalf("TryAcquire with 3 of 3 held by two Clients = %v, want ErrNoPermit", err)
	}
	const (
		held   = `pgcoord.permit.held{pgcoord.semaphore.name=jobs}`
		locks  = `pgcoord.lock.held{pgcoord.lock.name=job}`
		handle = `pgcoord.lock.handles{}`
	)
	until(t, reader, map[string]float64{
		held: 3, locks: 1, handle: 4,
		`pgcoord.permit.acquires{pgcoord.result=no_permit,pgcoord.semaphore.name=jobs}`: 1,
	})
	if n := contribtest.SlotsHeld(t, dsn, semA); n != 3 {
		t.Fatalf("pg_locks: %d slots held, want 3", n)
	}
	if err := a.Close(ctx); err != nil {
		t.Fatal(err)
	}
	// Close delivered the ends of a's permits and lock: no wait.
	vs := values(t, reader)
	if vs[held] != 1 || vs[locks] != 0 || vs[handle] != 1 {
		t.Errorf("after a's Close: permits held %v, locks held %v, handles %v; want 1, 0, 1", vs[held], vs[locks], vs[handle])
	}
	if n := contribtest.SlotsHeld(t, dsn, semA); n != 1 {
		t.Errorf("pg_locks after a's Close: %d slots held, want 1", n)
	}
	if err := pb.Release(ctx); err != nil {
		t.Fatal(err)
	}
	m.Unwatch(a)
	vs = until(t, reader, map[string]float64{
		held: 0, handle: 0,
		`pgcoord.permit.acquires{pgcoord.result=ok,pgcoord.semaphore.name=jobs}`: 3,
		`pgcoord.lock.releases{pgcoord.lock.name=job}`:                           1,
		`pgcoord.lock.waits{pgcoord.wait.state=server}`:                          0,
		`pgcoord.lock.waits{pgcoord.wait.state=queued}`:                          0,
		`pgcoord.connection.count{pgcoord.connection.role=connecting}`:           0,
		`pgcoord.connection.count{pgcoord.connection.role=session}`:              0,
		`pgcoord.hook.events.dropped{}`:                                          0,
	})
	if sum(vs, "pgcoord.permit.losses") != 0 || sum(vs, "pgcoord.permit.wait.duration_count") != 4 {
		t.Errorf("losses %v, wait observations %v; want 0, 4", sum(vs, "pgcoord.permit.losses"), sum(vs, "pgcoord.permit.wait.duration_count"))
	}
	if n := contribtest.SlotsHeld(t, dsn, semA); n != 0 {
		t.Errorf("pg_locks: %d slots held at the end, want 0", n)
	}
}

// Collections run while Clients are watched, unwatched and closed, and
// while Metrics are closed: no race (under -race), no collection error;
// after Close the watched Clients' Stat is no longer observed, while the
// event instruments keep counting; a second Close is harmless.
func TestMetricsCollectWhileWatchUnwatchClose(t *testing.T) {
	ctx := contribtest.Ctx(t)
	_, pool := contribtest.Migrated(t)
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = provider.Shutdown(context.Background()) })
	m, err := pgcoordotel.New(pgcoordotel.WithMeterProvider(provider))
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var collections atomic.Int64
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for i := 0; i < 100000; i++ {
				select {
				case <-stop:
					return
				default:
				}
				var rm metricdata.ResourceMetrics
				if err := reader.Collect(context.Background(), &rm); err != nil {
					t.Errorf("Collect: %v", err)
					return
				}
				collections.Add(1)
			}
		})
	}
	var keep *pgcoord.Client
	for i := range 4 {
		c := contribtest.NewClient(t, pool, m.Option())
		m.Watch(c)
		p, err := c.Semaphore("collected", 2).Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			if err := p.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		m.Unwatch(c)
		m.Watch(c)
		if i == 3 {
			keep = c // stays watched, open, with its permit
			break
		}
		if err := c.Close(ctx); err != nil {
			t.Fatal(err)
		}
		m.Unwatch(c)
	}
	pgtest.Eventually(t, contribtest.Timeout, "collections to run", func() bool { return collections.Load() >= 4 })
	if err := m.Close(); err != nil { // while the collections run
		t.Fatalf("Close: %v", err)
	}
	close(stop)
	wg.Wait()
	if err := m.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	vs := values(t, reader)
	if _, ok := vs[`pgcoord.lock.handles{}`]; ok {
		t.Errorf("after Close, the Stat of the watched Client is still observed: %v", vs)
	}
	if vs[`pgcoord.permit.held{pgcoord.semaphore.name=collected}`] != 1 {
		t.Errorf("permits held %v, want 1 (the open Client's)", vs[`pgcoord.permit.held{pgcoord.semaphore.name=collected}`])
	}
	if err := keep.Close(ctx); err != nil {
		t.Fatal(err)
	}
	vs = values(t, reader)
	if vs[`pgcoord.permit.held{pgcoord.semaphore.name=collected}`] != 0 ||
		vs[`pgcoord.permit.acquires{pgcoord.result=ok,pgcoord.semaphore.name=collected}`] != 4 {
		t.Errorf("after the last Close: %v", vs)
	}
}
