package pgcoordotel_test

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
	pgcoordotel "github.com/pgcoord/pgcoord/contrib/otel"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// newMetrics returns Metrics on a MeterProvider read by the returned
// ManualReader.
func newMetrics(t *testing.T, opts ...pgcoordotel.Option) (*pgcoordotel.Metrics, *sdkmetric.ManualReader) {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = provider.Shutdown(context.Background()) })
	m, err := pgcoordotel.New(append([]pgcoordotel.Option{pgcoordotel.WithMeterProvider(provider)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Error(err)
		}
	})
	return m, reader
}

// values collects reader and returns every data point by series, as
// `name{key=value,...}`; a histogram gives name_count and name_sum. It
// also checks each instrument's unit: "s" for the histograms, a {curly}
// annotation otherwise.
func values(t *testing.T, reader *sdkmetric.ManualReader) map[string]float64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := make(map[string]float64)
	series := func(name string, attrs attribute.Set) string {
		return name + "{" + attrs.Encoded(attribute.DefaultEncoder()) + "}"
	}
	for _, sm := range rm.ScopeMetrics {
		if sm.Scope.Name != pgcoordotel.ScopeName {
			t.Errorf("scope %q", sm.Scope.Name)
		}
		for _, md := range sm.Metrics {
			switch d := md.Data.(type) {
			case metricdata.Sum[int64]:
				for _, dp := range d.DataPoints {
					out[series(md.Name, dp.Attributes)] = float64(dp.Value)
				}
			case metricdata.Gauge[int64]:
				for _, dp := range d.DataPoints {
					out[series(md.Name, dp.Attributes)] = float64(dp.Value)
				}
			case metricdata.Histogram[float64]:
				if md.Unit != "s" {
					t.Errorf("%s: unit %q, want s", md.Name, md.Unit)
				}
				for _, dp := range d.DataPoints {
					out[series(md.Name+"_count", dp.Attributes)] = float64(dp.Count)
					out[series(md.Name+"_sum", dp.Attributes)] = dp.Sum
				}
				continue
			default:
				t.Errorf("%s: unexpected data %T", md.Name, md.Data)
			}
			if !strings.HasPrefix(md.Unit, "{") {
				t.Errorf("%s: unit %q, want a {count} annotation", md.Name, md.Unit)
			}
		}
	}
	return out
}

// until waits, bounded, until each series has its value.
func until(t *testing.T, reader *sdkmetric.ManualReader, want map[string]float64) map[string]float64 {
	t.Helper()
	var got map[string]float64
	pgtest.Eventually(t, contribtest.Timeout, fmt.Sprintf("metrics %v", want), func() bool {
		got = values(t, reader)
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

// A workload on a real server shows in the instruments: acquires by
// result with a wait each, contention, locks held going up and back to 0,
// a loss after the lock's backend is terminated, leadership 1 then 0 with
// its term, permits by semaphore with a lost one, and the Client's
// connections from Stat.
func TestMetrics(t *testing.T) {
	ctx := contribtest.Ctx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	if err := pgcoord.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	m, reader := newMetrics(t)
	job, other, anon := pgcoord.HashKey("job"), pgcoord.HashKey("other"), pgcoord.HashKey("anonymous")
	c, err := pgcoord.New(pool, m.Option(), pgcoord.WithKeyNames(map[pgcoord.Key]string{job: "job", other: "other-job"}),
		pgcoord.WithApplicationName("otel-test"))
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

	l, err := c.Lock(ctx, job)
	if err != nil {
		t.Fatal(err)
	}
	until(t, reader, map[string]float64{
		`pgcoord.lock.held{pgcoord.lock.name=job}`:                                                   1,
		`pgcoord.lock.acquires{pgcoord.lock.mode=exclusive,pgcoord.lock.name=job,pgcoord.result=ok}`: 1,
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
	until(t, reader, map[string]float64{
		`pgcoord.lock.acquires{pgcoord.lock.mode=exclusive,pgcoord.lock.name=job,pgcoord.result=locked}`:                    1,
		`pgcoord.lock.acquires{pgcoord.lock.mode=shared,pgcoord.lock.name=other-job,pgcoord.result=locked}`:                 1,
		`pgcoord.lock.contentions{pgcoord.contention.location=local,pgcoord.lock.mode=exclusive,pgcoord.lock.name=job}`:     1,
		`pgcoord.lock.contentions{pgcoord.contention.location=server,pgcoord.lock.mode=shared,pgcoord.lock.name=other-job}`: 1,
		`pgcoord.lock.handles{}`: 1,
	})
	if err := held.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	until(t, reader, map[string]float64{
		`pgcoord.lock.held{pgcoord.lock.name=job}`:     0,
		`pgcoord.lock.releases{pgcoord.lock.name=job}`: 1,
		`pgcoord.lock.handles{}`:                       0,
	})

	// A lock of a key without a name, lost with its backend.
	l, err = c.Lock(ctx, anon)
	if err != nil {
		t.Fatal(err)
	}
	until(t, reader, map[string]float64{`pgcoord.lock.held{pgcoord.lock.name=unnamed}`: 1})
	pgtest.Terminate(t, dsn, contribtest.LockHolder(t, dsn, anon))
	select {
	case <-l.Done():
	case <-ctx.Done():
		t.Fatal("the lock of a terminated backend did not end")
	}
	vs := until(t, reader, map[string]float64{
		`pgcoord.lock.held{pgcoord.lock.name=unnamed}`:   0,
		`pgcoord.lock.losses{pgcoord.lock.name=unnamed}`: 1,
	})
	acquires := sum(vs, "pgcoord.lock.acquires")
	if acquires != 4 || sum(vs, "pgcoord.lock.wait.duration_count") != acquires || sum(vs, "pgcoord.lock.wait.duration_sum") <= 0 {
		t.Errorf("%v acquires, wait histogram count %v and sum %v: want 4, 4 and more than 0", acquires,
			sum(vs, "pgcoord.lock.wait.duration_count"), sum(vs, "pgcoord.lock.wait.duration_sum"))
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
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'otel-test' AND datname = current_database()").Scan(&backends); err != nil {
			t.Fatal(err)
		}
		vs = values(t, reader)
		return vs[`pgcoord.connection.count{pgcoord.connection.role=backend}`] >= pgcoord.DefaultSharedBackends && backends >= pgcoord.DefaultSharedBackends
	})
	if got := vs[`pgcoord.connection.count{pgcoord.connection.role=backend}`]; got != pgcoord.DefaultSharedBackends || backends < pgcoord.DefaultSharedBackends {
		t.Errorf("pgcoord.connection.count{backend} = %v, pg_stat_activity shows %d of the Client's connections; want %d of each at least",
			got, backends, pgcoord.DefaultSharedBackends)
	}
	if vs[`pgcoord.hook.events.dropped{}`] != 0 || vs[`pgcoord.lock.waits{pgcoord.wait.state=server}`] != 0 {
		t.Errorf("dropped events or waits: %v", vs)
	}

	// Leadership: 1 with its term, then 0 after a resignation.
	ld, err := c.Election("scheduler").Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	until(t, reader, map[string]float64{
		`pgcoord.leader{pgcoord.election.name=scheduler}`:      1,
		`pgcoord.leader.term{pgcoord.election.name=scheduler}`: float64(ld.Term()),
	})
	if err := ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	vs = until(t, reader, map[string]float64{`pgcoord.leader{pgcoord.election.name=scheduler}`: 0})
	if n := sum(vs, "pgcoord.leader.losses"); n != 0 {
		t.Errorf("%v leadership losses after a resignation, want 0", n)
	}

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
	until(t, reader, map[string]float64{
		`pgcoord.permit.held{pgcoord.semaphore.name=exports}`:                              2,
		`pgcoord.permit.acquires{pgcoord.result=ok,pgcoord.semaphore.name=exports}`:        2,
		`pgcoord.permit.acquires{pgcoord.result=no_permit,pgcoord.semaphore.name=exports}`: 1,
		`pgcoord.permit.wait.duration_count{pgcoord.semaphore.name=exports}`:               3,
	})
	if err := p.Release(ctx); err != nil {
		t.Fatal(err)
	}
	until(t, reader, map[string]float64{`pgcoord.permit.held{pgcoord.semaphore.name=exports}`: 1})
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
	until(t, reader, map[string]float64{
		`pgcoord.permit.held{pgcoord.semaphore.name=exports}`:   0,
		`pgcoord.permit.losses{pgcoord.semaphore.name=exports}`: 1,
	})

	// After Close, nothing is held and no connection is left.
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	vs = values(t, reader)
	for _, s := range []string{`pgcoord.connection.count{pgcoord.connection.role=backend}`, `pgcoord.connection.count{pgcoord.connection.role=session}`, `pgcoord.lock.handles{}`} {
		if v, ok := vs[s]; !ok || v != 0 {
			t.Errorf("after Close, %s = %v (reported: %v)", s, v, ok)
		}
	}
	m.Unwatch(c)
}

// Names beyond the bound become "other", and invalid options are refused
// with an error that says what is wrong.
func TestMetricsBoundsAndOptions(t *testing.T) {
	m, reader := newMetrics(t, pgcoordotel.WithMaxNames(2), pgcoordotel.WithBuckets(0.001, 0.1))
	h := m.Hooks()
	for _, name := range []string{"a", "b", "c", "a", "", "d", "bad\xff"} {
		h.OnAcquire(pgcoord.AcquireEvent{Name: name, Wait: time.Millisecond, Err: pgcoord.ErrLocked})
	}
	vs := values(t, reader)
	for name, want := range map[string]float64{"a": 2, "b": 1, "unnamed": 1, "other": 3} {
		k := `pgcoord.lock.acquires{pgcoord.lock.mode=exclusive,pgcoord.lock.name=` + name + `,pgcoord.result=locked}`
		if vs[k] != want {
			t.Errorf("%s = %v, want %v (all: %v)", k, vs[k], want, vs)
		}
	}
	if n := sum(vs, "pgcoord.lock.acquires"); n != 7 {
		t.Errorf("%v acquires, want 7", n)
	}

	for _, tc := range []struct {
		opt  pgcoordotel.Option
		want string
	}{
		{pgcoordotel.WithMaxNames(0), "at least 1"},
		{pgcoordotel.WithBuckets(), "no bounds"},
		{pgcoordotel.WithBuckets(1, 1), "must increase"},
		{pgcoordotel.WithBuckets(-1), "positive"},
		{pgcoordotel.WithMeterProvider(nil), "provider is nil"},
		{nil, "nil Option"},
	} {
		if _, err := pgcoordotel.New(tc.opt); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New with a bad option = %v, want an error saying %q", err, tc.want)
		}
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
		if got := pgcoordotel.Result(err); got != want {
			t.Errorf("Result(%v) = %q, want %q", err, got, want)
		}
	}
}

// Chain calls every hook, in order, and leaves nil a kind that none takes.
func TestChain(t *testing.T) {
	var calls []string
	h := pgcoordotel.Chain(
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

// pgcoord.leader.term never goes backwards, even for elections that share
// the "other" value past WithMaxNames: it keeps the highest term gained
// under each value, whichever election gained it.
func TestMetricsLeaderTermNeverGoesBackUnderOther(t *testing.T) {
	m, reader := newMetrics(t, pgcoordotel.WithMaxNames(1))
	h := m.Hooks()
	const (
		first = `pgcoord.leader.term{pgcoord.election.name=first}`
		other = `pgcoord.leader.term{pgcoord.election.name=other}`
	)
	h.OnLeadership(pgcoord.LeadershipEvent{Election: "first", Leading: true, Term: 5})
	var high float64
	// Terms go up and down across the elections past the bound; the
	// highest so far is the value under "other" after each.
	for i, term := range []pgcoord.Term{10, 3, 12, 7, 1, 12, 30, 2} {
		name := fmt.Sprintf("election-%d", i%4)
		h.OnLeadership(pgcoord.LeadershipEvent{Election: name, Leading: true, Term: term})
		high = max(high, float64(term))
		vs := values(t, reader)
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
// kept per attribute value, so at most WithMaxNames values and "other".
func TestMetricsLeaderTermStateBounded(t *testing.T) {
	const maxNames, elections = 8, 10000
	m, reader := newMetrics(t, pgcoordotel.WithMaxNames(maxNames))
	h := m.Hooks()
	for i := range elections {
		h.OnLeadership(pgcoord.LeadershipEvent{Election: fmt.Sprintf("election-%d", i), Leading: true, Term: pgcoord.Term(i + 1)})
	}
	if n := pgcoordotel.TermLabels(m); n > maxNames+1 {
		t.Errorf("highest terms kept for %d election values after %d elections, want at most %d (the bound and other)", n, elections, maxNames+1)
	}
	vs := values(t, reader)
	points := 0
	for k := range vs {
		if strings.HasPrefix(k, "pgcoord.leader.term{") {
			points++
		}
	}
	if points != maxNames+1 || vs[`pgcoord.leader.term{pgcoord.election.name=other}`] != elections {
		t.Errorf("%d data points of pgcoord.leader.term, other = %v; want %d and %d", points,
			vs[`pgcoord.leader.term{pgcoord.election.name=other}`], maxNames+1, elections)
	}
}

// Real elections past WithMaxNames share "other": its pgcoord.leader.term
// is the highest term any of them gained, and a later election's first
// term does not take it back.
func TestMetricsLeaderTermUnderOtherFromElections(t *testing.T) {
	ctx := contribtest.Ctx(t)
	_, pool := contribtest.Migrated(t)
	m, reader := newMetrics(t, pgcoordotel.WithMaxNames(1))
	var events atomic.Int64
	counted := pgcoord.Hooks{OnLeadership: func(pgcoord.LeadershipEvent) { events.Add(1) }}
	c := contribtest.NewClient(t, pool, pgcoord.WithHooks(pgcoordotel.Chain(m.Hooks(), counted)))
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
	const other = `pgcoord.leader.term{pgcoord.election.name=other}`
	until(t, reader, map[string]float64{other: float64(high)})
	if low := campaign("fresh"); low >= high {
		t.Fatalf("the fresh election's term %d is not below the busy one's %d", low, high)
	}
	pgtest.Eventually(t, contribtest.Timeout, "the 10 leadership events delivered", func() bool { return events.Load() == 10 })
	if got := values(t, reader)[other]; got != float64(high) {
		t.Errorf("%s = %v after a lower term of another election under other, want %v", other, got, high)
	}
}

// The exported defaults and attribute values are the ones the
// documentation gives.
func TestDefaults(t *testing.T) {
	if pgcoordotel.Unnamed != "unnamed" || pgcoordotel.Other != "other" || pgcoordotel.DefaultMaxNames != 64 {
		t.Errorf("Unnamed %q, Other %q, DefaultMaxNames %d; want unnamed, other, 64", pgcoordotel.Unnamed, pgcoordotel.Other, pgcoordotel.DefaultMaxNames)
	}
	if want := []float64{0.0005, 0.002, 0.008, 0.032, 0.128, 0.512, 2.048, 8.192, 32.768}; !slices.Equal(pgcoordotel.DefaultBuckets, want) {
		t.Errorf("DefaultBuckets = %v, want %v", pgcoordotel.DefaultBuckets, want)
	}
}

// Past WithMaxNames semaphores, the attribute is "other": the data points
// stay bounded, each returns to 0, and the semaphores beyond the bound
// add up under "other".
func TestMetricsSemaphoreNamesBounded(t *testing.T) {
	ctx := contribtest.Ctx(t)
	_, pool := contribtest.Migrated(t)
	m, reader := newMetrics(t, pgcoordotel.WithMaxNames(2))
	c := contribtest.NewClient(t, pool, m.Option())
	const n = 6
	var ps []*pgcoord.Permit
	for i := range n {
		p, err := c.Semaphore(fmt.Sprintf("sem-%d", i), 1).TryAcquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	until(t, reader, map[string]float64{
		`pgcoord.permit.held{pgcoord.semaphore.name=sem-0}`: 1,
		`pgcoord.permit.held{pgcoord.semaphore.name=sem-1}`: 1,
		`pgcoord.permit.held{pgcoord.semaphore.name=other}`: n - 2,
	})
	for _, p := range ps {
		if err := p.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	vs := until(t, reader, map[string]float64{
		`pgcoord.permit.held{pgcoord.semaphore.name=sem-0}`:                       0,
		`pgcoord.permit.held{pgcoord.semaphore.name=sem-1}`:                       0,
		`pgcoord.permit.held{pgcoord.semaphore.name=other}`:                       0,
		`pgcoord.permit.acquires{pgcoord.result=ok,pgcoord.semaphore.name=other}`: n - 2,
		`pgcoord.permit.wait.duration_count{pgcoord.semaphore.name=other}`:        n - 2,
	})
	for _, name := range []string{"pgcoord.permit.held", "pgcoord.permit.acquires", "pgcoord.permit.wait.duration_count"} {
		count := 0
		for k := range vs {
			if len(k) > len(name) && k[:len(name)+1] == name+"{" {
				count++
			}
		}
		if count != 3 {
			t.Errorf("%d data points of %s, want 3 (2 names and other)", count, name)
		}
	}
}
