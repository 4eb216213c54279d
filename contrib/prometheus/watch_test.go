package pgcoordprom_test

import (
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/contrib/internal/contribtest"
	pgcoordprom "github.com/pgcoord/pgcoord/contrib/prometheus"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"github.com/prometheus/client_golang/prometheus"
)

// Unwatch keeps a Client's dropped hook events counted in
// pgcoord_hook_events_dropped_total, and watching a Client again after Unwatch
// counts only what it drops after that: its events are never counted
// twice.
func TestWatchAfterUnwatchCountsDroppedOnce(t *testing.T) {
	ctx := contribtest.Ctx(t)
	_, pool := contribtest.Migrated(t)
	m, err := pgcoordprom.New()
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(m)
	d := contribtest.NewDropper()
	c := contribtest.NewClient(t, pool, pgcoord.WithHooks(pgcoordprom.Chain(d.Hooks(), m.Hooks())))
	t.Cleanup(d.Open)
	l := d.Drop(t, c, 5)
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	dropped := float64(c.Stat().DroppedHookEvents)
	if dropped < 5 {
		t.Fatalf("Stat().DroppedHookEvents = %v, want at least 5", dropped)
	}
	const series = `pgcoord_hook_events_dropped_total{}`
	m.Watch(c)
	if got := values(t, reg)[series]; got != dropped {
		t.Fatalf("watched: %s = %v, want %v", series, got, dropped)
	}
	m.Unwatch(c)
	if got := values(t, reg)[series]; got != dropped {
		t.Fatalf("unwatched: %s = %v, want %v (kept)", series, got, dropped)
	}
	m.Watch(c)
	if got := values(t, reg)[series]; got != dropped {
		t.Errorf("watched again: %s = %v, want %v: the Client's %v dropped events are counted twice", series, got, dropped, dropped)
	}
}

// Two Clients feed one Collector; one closes while holding permits and a
// lock. Close delivers their ends, so the gauges drop at once to what the
// other Client holds, matching pg_locks; once it releases, every gauge
// is back to 0, the counters add up over both Clients, and a refused try
// of one while the other holds counts as no_permit.
func TestCollectorTwoClientsOneClosed(t *testing.T) {
	ctx := contribtest.Ctx(t)
	dsn, pool := contribtest.Migrated(t)
	m, err := pgcoordprom.New()
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(m)
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
	until(t, reg, map[string]float64{
		`pgcoord_permits_held{semaphore="jobs"}`:                             3,
		`pgcoord_permit_acquires_total{result="no_permit",semaphore="jobs"}`: 1,
		`pgcoord_locks_held{name="job"}`:                                     1,
		`pgcoord_lock_handles{}`:                                             4,
	})
	if n := contribtest.SlotsHeld(t, dsn, semA); n != 3 {
		t.Fatalf("pg_locks: %d slots held, want 3", n)
	}

	if err := a.Close(ctx); err != nil {
		t.Fatal(err)
	}
	// Close delivered the ends of a's permits and lock: no wait.
	vs := values(t, reg)
	if vs[`pgcoord_permits_held{semaphore="jobs"}`] != 1 || vs[`pgcoord_locks_held{name="job"}`] != 0 || vs[`pgcoord_lock_handles{}`] != 1 {
		t.Errorf("after a's Close: permits held %v, locks held %v, handles %v; want 1, 0, 1",
			vs[`pgcoord_permits_held{semaphore="jobs"}`], vs[`pgcoord_locks_held{name="job"}`], vs[`pgcoord_lock_handles{}`])
	}
	if n := contribtest.SlotsHeld(t, dsn, semA); n != 1 {
		t.Errorf("pg_locks after a's Close: %d slots held, want 1", n)
	}
	if err := pb.Release(ctx); err != nil {
		t.Fatal(err)
	}
	m.Unwatch(a)
	vs = until(t, reg, map[string]float64{
		`pgcoord_permits_held{semaphore="jobs"}`:                      0,
		`pgcoord_permit_acquires_total{result="ok",semaphore="jobs"}`: 3,
		`pgcoord_lock_releases_total{name="job"}`:                     1,
		`pgcoord_lock_handles{}`:                                      0,
		`pgcoord_lock_waits{state="server"}`:                          0,
		`pgcoord_lock_waits{state="queued"}`:                          0,
		`pgcoord_connections{role="connecting"}`:                      0,
		`pgcoord_connections{role="session"}`:                         0,
		`pgcoord_hook_events_dropped_total{}`:                         0,
	})
	if sum(vs, "pgcoord_permit_losses_total") != 0 || sum(vs, "pgcoord_permit_acquire_wait_seconds_count") != 4 {
		t.Errorf("losses %v, wait observations %v; want 0, 4", sum(vs, "pgcoord_permit_losses_total"), sum(vs, "pgcoord_permit_acquire_wait_seconds_count"))
	}
	if n := contribtest.SlotsHeld(t, dsn, semA); n != 0 {
		t.Errorf("pg_locks: %d slots held at the end, want 0", n)
	}
}

// Scrapes run while Clients are watched, unwatched and closed: no race
// (under -race), no scrape error, and at the end, with every Client
// closed and unwatched, the connection and handle gauges are 0.
func TestCollectorScrapeWhileWatchUnwatchClose(t *testing.T) {
	ctx := contribtest.Ctx(t)
	_, pool := contribtest.Migrated(t)
	m, err := pgcoordprom.New()
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(m)
	stop := make(chan struct{})
	var scrapes atomic.Int64
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for i := 0; i < 100000; i++ {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := reg.Gather(); err != nil {
					t.Errorf("Gather: %v", err)
					return
				}
				scrapes.Add(1)
			}
		})
	}
	for i := range 4 {
		c := contribtest.NewClient(t, pool, m.Option())
		m.Watch(c)
		p, err := c.Semaphore("scraped", 2).Acquire(ctx)
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
		if err := c.Close(ctx); err != nil {
			t.Fatal(err)
		}
		m.Unwatch(c)
	}
	pgtest.Eventually(t, contribtest.Timeout, "scrapes to run", func() bool { return scrapes.Load() >= 4 })
	close(stop)
	wg.Wait()
	until(t, reg, map[string]float64{
		`pgcoord_permits_held{semaphore="scraped"}`:                      0,
		`pgcoord_permit_acquires_total{result="ok",semaphore="scraped"}`: 4,
		`pgcoord_connections{role="backend"}`:                            0,
		`pgcoord_lock_handles{}`:                                         0,
	})
}

// series counts the series whose name is name (before "{").
func series(vs map[string]float64, name string) int {
	n := 0
	for k := range vs {
		if strings.HasPrefix(k, name+"{") {
			n++
		}
	}
	return n
}
