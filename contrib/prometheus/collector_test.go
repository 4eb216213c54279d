package pgcoordprom_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/contrib/internal/contribtest"
	pgcoordprom "github.com/pgcoord/pgcoord/contrib/prometheus"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"github.com/prometheus/client_golang/prometheus"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// values gathers reg and returns every sample by series, as
// `name{label="value",...}` with labels in order; a histogram gives
// name_count and name_sum.
func values(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]float64)
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			series := func(suffix string) string {
				return mf.GetName() + suffix + "{" + strings.Join(labels, ",") + "}"
			}
			switch {
			case m.Counter != nil:
				out[series("")] = m.Counter.GetValue()
			case m.Gauge != nil:
				out[series("")] = m.Gauge.GetValue()
			case m.Histogram != nil:
				out[series("_count")] = float64(m.Histogram.GetSampleCount())
				out[series("_sum")] = m.Histogram.GetSampleSum()
			}
		}
	}
	return out
}

// until waits, bounded, until each series has its value, and returns the
// values.
func until(t *testing.T, reg *prometheus.Registry, want map[string]float64) map[string]float64 {
	t.Helper()
	var got map[string]float64
	pgtest.Eventually(t, contribtest.Timeout, fmt.Sprintf("metrics %v", want), func() bool {
		got = values(t, reg)
		for k, v := range want {
			if got[k] != v {
				return false
			}
		}
		return true
	})
	return got
}

// sum adds the values of the series whose name is name (before "{").
func sum(vs map[string]float64, name string) float64 {
	var n float64
	for k, v := range vs {
		if strings.HasPrefix(k, name+"{") {
			n += v
		}
	}
	return n
}

// A workload on a real server shows in the metrics: acquires by result
// with a wait observation each, contention in the process and on the
// server, the held gauge going up and back to 0, a loss after the lock's
// backend is terminated, leadership 1 then 0 with its term, permits by
// semaphore with a lost one, and the Client's connections from Stat.
func TestCollector(t *testing.T) {
	ctx := contribtest.Ctx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	if err := pgcoord.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	m, err := pgcoordprom.New()
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(m)

	job, other, anon := pgcoord.HashKey("job"), pgcoord.HashKey("other"), pgcoord.HashKey("anonymous")
	names := map[pgcoord.Key]string{job: "job", other: "other-job"}
	c, err := pgcoord.New(pool, m.Option(), pgcoord.WithKeyNames(names), pgcoord.WithApplicationName("prom-test"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	m.Watch(c)
	rival, err := pgcoord.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	defer rival.Close(context.Background())

	// A lock, a try refused in the process, a try refused by the server.
	l, err := c.Lock(ctx, job)
	if err != nil {
		t.Fatal(err)
	}
	until(t, reg, map[string]float64{
		`pgcoord_locks_held{name="job"}`:                                       1,
		`pgcoord_lock_acquires_total{mode="exclusive",name="job",result="ok"}`: 1,
	})
	if _, err := c.TryLock(ctx, job); !errors.Is(err, pgcoord.ErrLocked) {
		t.Fatal(err)
	}
	held, err := rival.Lock(ctx, other)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.TryRLock(ctx, other); !errors.Is(err, pgcoord.ErrLocked) {
		t.Fatal(err)
	}
	until(t, reg, map[string]float64{
		`pgcoord_lock_acquires_total{mode="exclusive",name="job",result="locked"}`:      1,
		`pgcoord_lock_acquires_total{mode="shared",name="other-job",result="locked"}`:   1,
		`pgcoord_lock_contentions_total{mode="exclusive",name="job",where="local"}`:     1,
		`pgcoord_lock_contentions_total{mode="shared",name="other-job",where="server"}`: 1,
		`pgcoord_locks_held{name="job"}`:                                                1,
		`pgcoord_lock_handles{}`:                                                        1,
	})
	if err := held.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	until(t, reg, map[string]float64{
		`pgcoord_locks_held{name="job"}`:          0,
		`pgcoord_lock_releases_total{name="job"}`: 1,
		`pgcoord_lock_handles{}`:                  0,
	})

	// A lock of a key without a name, lost with its backend.
	l, err = c.Lock(ctx, anon)
	if err != nil {
		t.Fatal(err)
	}
	until(t, reg, map[string]float64{`pgcoord_locks_held{name="unnamed"}`: 1})
	pgtest.Terminate(t, dsn, contribtest.LockHolder(t, dsn, anon))
	select {
	case <-l.Done():
	case <-ctx.Done():
		t.Fatal("the lock of a terminated backend did not end")
	}
	vs := until(t, reg, map[string]float64{
		`pgcoord_locks_held{name="unnamed"}`:        0,
		`pgcoord_lock_losses_total{name="unnamed"}`: 1,
	})
	acquires := sum(vs, "pgcoord_lock_acquires_total")
	if acquires != 4 || sum(vs, "pgcoord_lock_acquire_wait_seconds_count") != acquires || sum(vs, "pgcoord_lock_acquire_wait_seconds_sum") <= 0 {
		t.Errorf("%v acquires, wait histogram count %v and sum %v: want 4, 4 and more than 0", acquires,
			sum(vs, "pgcoord_lock_acquire_wait_seconds_count"), sum(vs, "pgcoord_lock_acquire_wait_seconds_sum"))
	}

	// Connections, as pg_stat_activity has them. The terminated backend's
	// lock ends a moment before the Client stops counting the backend, so
	// a Warm right after Done may find the shared backends all there:
	// warm again until the Client has replaced it.
	var backends int
	pgtest.Eventually(t, contribtest.Timeout, "the Client's shared backends, the terminated one replaced", func() bool {
		if err := c.Warm(ctx); err != nil {
			t.Fatal(err)
		}
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'prom-test' AND datname = current_database()").Scan(&backends); err != nil {
			t.Fatal(err)
		}
		vs = values(t, reg)
		return vs[`pgcoord_connections{role="backend"}`] >= pgcoord.DefaultSharedBackends && backends >= pgcoord.DefaultSharedBackends
	})
	if got := vs[`pgcoord_connections{role="backend"}`]; got != pgcoord.DefaultSharedBackends || backends < pgcoord.DefaultSharedBackends {
		t.Errorf("pgcoord_connections{role=backend} = %v, pg_stat_activity shows %d of the Client's connections; want %d of each at least",
			got, backends, pgcoord.DefaultSharedBackends)
	}
	if vs[`pgcoord_hook_events_dropped_total{}`] != 0 || vs[`pgcoord_lock_waits{state="server"}`] != 0 {
		t.Errorf("dropped events or waits: %v", vs)
	}

	// Leadership: 1 with its term, then 0 after a resignation.
	ld, err := c.Election("scheduler").Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	until(t, reg, map[string]float64{
		`pgcoord_leader{election="scheduler"}`:      1,
		`pgcoord_leader_term{election="scheduler"}`: float64(ld.Term()),
	})
	if err := ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	until(t, reg, map[string]float64{
		`pgcoord_leader{election="scheduler"}`:                  0,
		`pgcoord_leadership_losses_total{election="scheduler"}`: 0,
	})

	// Permits by semaphore: one released, one lost, one refused.
	sem := c.Semaphore("exports", 2)
	p, err := sem.TryAcquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	q, err := sem.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sem.TryAcquire(ctx); !errors.Is(err, pgcoord.ErrNoPermit) {
		t.Fatal(err)
	}
	until(t, reg, map[string]float64{
		`pgcoord_permits_held{semaphore="exports"}`:                             2,
		`pgcoord_permit_acquires_total{result="ok",semaphore="exports"}`:        2,
		`pgcoord_permit_acquires_total{result="no_permit",semaphore="exports"}`: 1,
		`pgcoord_permit_acquire_wait_seconds_count{semaphore="exports"}`:        3,
	})
	if err := p.Release(ctx); err != nil {
		t.Fatal(err)
	}
	until(t, reg, map[string]float64{`pgcoord_permits_held{semaphore="exports"}`: 1})
	hs, err := sem.Holders(ctx)
	if err != nil || len(hs) != 1 || hs[0].Slot != q.Slot() {
		t.Fatalf("Holders = %+v, %v; want the one permit left", hs, err)
	}
	pgtest.Terminate(t, dsn, hs[0].PID)
	select {
	case <-q.Done():
	case <-ctx.Done():
		t.Fatal("the permit of a terminated backend did not end")
	}
	until(t, reg, map[string]float64{
		`pgcoord_permits_held{semaphore="exports"}`:        0,
		`pgcoord_permit_losses_total{semaphore="exports"}`: 1,
	})

	// After Close, nothing is held and no connection is left.
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	vs = values(t, reg)
	for _, series := range []string{`pgcoord_connections{role="backend"}`, `pgcoord_connections{role="session"}`, `pgcoord_lock_handles{}`} {
		if vs[series] != 0 {
			t.Errorf("after Close, %s = %v", series, vs[series])
		}
	}
	m.Unwatch(c)
	if vs := values(t, reg); vs[`pgcoord_hook_events_dropped_total{}`] != 0 || vs[`pgcoord_lock_losses_total{name="unnamed"}`] != 1 {
		t.Errorf("after Unwatch: %v", vs)
	}
}

// Names beyond the bound are labelled "other", and invalid options are
// refused with an error that says what is wrong.
func TestCollectorBoundsAndOptions(t *testing.T) {
	m, err := pgcoordprom.New(pgcoordprom.WithMaxNames(2), pgcoordprom.WithBuckets(0.001, 0.1))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(m)
	h := m.Hooks()
	for _, name := range []string{"a", "b", "c", "a", "", "d", "bad\xff"} {
		h.OnAcquire(pgcoord.AcquireEvent{Name: name, Wait: time.Millisecond, Err: pgcoord.ErrLocked})
	}
	vs := values(t, reg)
	want := map[string]float64{
		`pgcoord_lock_acquires_total{mode="exclusive",name="a",result="locked"}`:       2,
		`pgcoord_lock_acquires_total{mode="exclusive",name="b",result="locked"}`:       1,
		`pgcoord_lock_acquires_total{mode="exclusive",name="unnamed",result="locked"}`: 1,
		`pgcoord_lock_acquires_total{mode="exclusive",name="other",result="locked"}`:   3,
	}
	for k, v := range want {
		if vs[k] != v {
			t.Errorf("%s = %v, want %v (all: %v)", k, vs[k], v, vs)
		}
	}
	if n := sum(vs, "pgcoord_lock_acquires_total"); n != 7 {
		t.Errorf("%v acquires, want 7", n)
	}

	for _, tc := range []struct {
		opt  pgcoordprom.Option
		want string
	}{
		{pgcoordprom.WithMaxNames(0), "at least 1"},
		{pgcoordprom.WithBuckets(), "no bounds"},
		{pgcoordprom.WithBuckets(1, 1), "must increase"},
		{pgcoordprom.WithBuckets(-1), "positive"},
		{nil, "nil Option"},
	} {
		if _, err := pgcoordprom.New(tc.opt); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New with a bad option = %v, want an error saying %q", err, tc.want)
		}
	}
}

// newCollector returns a Collector registered on a pedantic registry.
func newCollector(t *testing.T, opts ...pgcoordprom.Option) (*pgcoordprom.Collector, *prometheus.Registry) {
	t.Helper()
	m, err := pgcoordprom.New(opts...)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(m)
	return m, reg
}

// pgcoord_leader_term never goes backwards, even for elections that share
// the "other" label past WithMaxNames: it keeps the highest term gained
// under each label, whichever election gained it.
func TestCollectorLeaderTermNeverGoesBackUnderOther(t *testing.T) {
	m, reg := newCollector(t, pgcoordprom.WithMaxNames(1))
	h := m.Hooks()
	const (
		first = `pgcoord_leader_term{election="first"}`
		other = `pgcoord_leader_term{election="other"}`
	)
	h.OnLeadership(pgcoord.LeadershipEvent{Election: "first", Leading: true, Term: 5})
	var high float64
	// Terms go up and down across the elections past the bound; the
	// highest so far is the value under "other" after each.
	for i, term := range []pgcoord.Term{10, 3, 12, 7, 1, 12, 30, 2} {
		name := fmt.Sprintf("election-%d", i%4)
		h.OnLeadership(pgcoord.LeadershipEvent{Election: name, Leading: true, Term: term})
		high = max(high, float64(term))
		vs := values(t, reg)
		if vs[other] != high {
			t.Fatalf("after term %d of %s: %s = %v, want %v (the highest gained under other)", term, name, other, vs[other], high)
		}
		if vs[first] != 5 {
			t.Fatalf("%s = %v, want 5", first, vs[first])
		}
		h.OnLeadership(pgcoord.LeadershipEvent{Election: name, Leading: false})
	}
}

// Many distinct election names cost bounded memory: the highest terms are
// kept per label, so at most WithMaxNames labels and "other".
func TestCollectorLeaderTermStateBounded(t *testing.T) {
	const maxNames, elections = 8, 10000
	m, reg := newCollector(t, pgcoordprom.WithMaxNames(maxNames))
	h := m.Hooks()
	for i := range elections {
		h.OnLeadership(pgcoord.LeadershipEvent{Election: fmt.Sprintf("election-%d", i), Leading: true, Term: pgcoord.Term(i + 1)})
	}
	if n := pgcoordprom.TermLabels(m); n > maxNames+1 {
		t.Errorf("highest terms kept for %d election labels after %d elections, want at most %d (the bound and other)", n, elections, maxNames+1)
	}
	vs := values(t, reg)
	points := 0
	for k := range vs {
		if strings.HasPrefix(k, "pgcoord_leader_term{") {
			points++
		}
	}
	if points != maxNames+1 || vs[`pgcoord_leader_term{election="other"}`] != elections {
		t.Errorf("%d series of pgcoord_leader_term, other = %v; want %d and %d", points,
			vs[`pgcoord_leader_term{election="other"}`], maxNames+1, elections)
	}
}

// Real elections past WithMaxNames share "other": its pgcoord_leader_term
// is the highest term any of them gained, and a later election's first
// term does not take it back.
func TestCollectorLeaderTermUnderOtherFromElections(t *testing.T) {
	ctx := contribtest.Ctx(t)
	_, pool := contribtest.Migrated(t)
	m, reg := newCollector(t, pgcoordprom.WithMaxNames(1))
	var events atomic.Int64
	counted := pgcoord.Hooks{OnLeadership: func(pgcoord.LeadershipEvent) { events.Add(1) }}
	c := contribtest.NewClient(t, pool, pgcoord.WithHooks(pgcoordprom.Chain(m.Hooks(), counted)))
	campaign := func(name string) pgcoord.Term {
		t.Helper()
		ld, err := c.Election(name).Campaign(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := ld.Resign(ctx); err != nil {
			t.Fatal(err)
		}
		return ld.Term()
	}
	campaign("first")
	var high pgcoord.Term
	for range 3 {
		high = max(high, campaign("busy"))
	}
	const other = `pgcoord_leader_term{election="other"}`
	until(t, reg, map[string]float64{other: float64(high)})
	if low := campaign("fresh"); low >= high {
		t.Fatalf("the fresh election's term %d is not below the busy one's %d", low, high)
	}
	pgtest.Eventually(t, contribtest.Timeout, "the 10 leadership events delivered", func() bool { return events.Load() == 10 })
	if got := values(t, reg)[other]; got != float64(high) {
		t.Errorf("%s = %v after a lower term of another election under other, want %v", other, got, high)
	}
}

// Result names the outcome of an acquire.
func TestResult(t *testing.T) {
	for err, want := range map[error]string{
		nil:                                      "ok",
		pgcoord.ErrLocked:                        "locked",
		fmt.Errorf("x: %w", pgcoord.ErrNoPermit): "no_permit",
		pgcoord.ErrDeadlock:                      "deadlock",
		context.DeadlineExceeded:                 "timeout",
		context.Canceled:                         "canceled",
		pgcoord.ErrClosed:                        "closed",
		errors.New("boom"):                       "error",
	} {
		if got := pgcoordprom.Result(err); got != want {
			t.Errorf("Result(%v) = %q, want %q", err, got, want)
		}
	}
}

// Chain calls every hook, in order, and leaves nil a kind that none takes.
func TestChain(t *testing.T) {
	var calls []string
	h := pgcoordprom.Chain(
		pgcoord.Hooks{OnAcquire: func(pgcoord.AcquireEvent) { calls = append(calls, "first") }},
		pgcoord.Hooks{},
		pgcoord.Hooks{
			OnAcquire: func(pgcoord.AcquireEvent) { calls = append(calls, "second") },
			OnPermit:  func(pgcoord.PermitEvent) { calls = append(calls, "permit") },
		},
	)
	h.OnAcquire(pgcoord.AcquireEvent{})
	h.OnPermit(pgcoord.PermitEvent{})
	if !slices.Equal(calls, []string{"first", "second", "permit"}) {
		t.Errorf("calls %q", calls)
	}
	if h.OnRelease != nil || h.OnLoss != nil || h.OnContention != nil || h.OnLeadership != nil {
		t.Error("Chain set a hook that no Hooks had")
	}
}

// The exported defaults and label values are the ones the documentation
// gives.
func TestDefaults(t *testing.T) {
	if pgcoordprom.Unnamed != "unnamed" || pgcoordprom.Other != "other" || pgcoordprom.DefaultMaxNames != 64 {
		t.Errorf("Unnamed %q, Other %q, DefaultMaxNames %d; want unnamed, other, 64", pgcoordprom.Unnamed, pgcoordprom.Other, pgcoordprom.DefaultMaxNames)
	}
	if want := []float64{0.0005, 0.002, 0.008, 0.032, 0.128, 0.512, 2.048, 8.192, 32.768}; !slices.Equal(pgcoordprom.DefaultBuckets, want) {
		t.Errorf("DefaultBuckets = %v, want %v", pgcoordprom.DefaultBuckets, want)
	}
}

// Past WithMaxNames semaphores, the label is "other": the series stay
// bounded, the gauge of every label returns to 0, and the counts of the
// semaphores beyond the bound add up under "other".
func TestCollectorSemaphoreLabelsBounded(t *testing.T) {
	ctx := contribtest.Ctx(t)
	_, pool := contribtest.Migrated(t)
	m, err := pgcoordprom.New(pgcoordprom.WithMaxNames(2))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(m)
	c := contribtest.NewClient(t, pool, m.Option())
	const n = 6
	var held []*pgcoord.Permit
	for i := range n {
		p, err := c.Semaphore(fmt.Sprintf("sem-%d", i), 1).TryAcquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, p)
	}
	until(t, reg, map[string]float64{
		`pgcoord_permits_held{semaphore="sem-0"}`: 1,
		`pgcoord_permits_held{semaphore="sem-1"}`: 1,
		`pgcoord_permits_held{semaphore="other"}`: n - 2,
	})
	for _, p := range held {
		if err := p.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	until(t, reg, map[string]float64{
		`pgcoord_permits_held{semaphore="sem-0"}`:                      0,
		`pgcoord_permits_held{semaphore="sem-1"}`:                      0,
		`pgcoord_permits_held{semaphore="other"}`:                      0,
		`pgcoord_permit_acquires_total{result="ok",semaphore="other"}`: n - 2,
	})
	vs := values(t, reg)
	for _, name := range []string{"pgcoord_permits_held", "pgcoord_permit_acquires_total", "pgcoord_permit_acquire_wait_seconds_count"} {
		if got := series(vs, name); got != 3 {
			t.Errorf("%d series of %s, want 3 (2 names and other)", got, name)
		}
	}
}
