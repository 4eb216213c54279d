// Command metrics publishes pgcoord's metrics with both integrations of
// this repository: contrib/prometheus (a prometheus.Collector, served on
// /metrics) and contrib/otel (OpenTelemetry instruments, served here through
// the OpenTelemetry Prometheus exporter on /otel/metrics). Both are fed by
// the same Clients, whose hooks are chained.
//
// It runs a short workload (goroutines of two Clients contending for a few
// keys, a backend terminated to cause a loss, a small election with a
// handover, and a semaphore with more workers than permits), fetches its
// own /metrics and /otel/metrics over HTTP and prints pgcoord's series
// (without histogram buckets, to keep the output short).
//
// It reads DATABASE_URL; when that is unset it starts a throwaway PostgreSQL
// from the local binaries and removes it on exit. It is a module of its own,
// so that the metrics libraries stay out of pgcoord's module:
//
//	cd examples/metrics && go run .
package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	pgcoordotel "github.com/pgcoord/pgcoord/contrib/otel"
	pgcoordprom "github.com/pgcoord/pgcoord/contrib/prometheus"
	"github.com/pgcoord/pgcoord/examples/internal/throwaway"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "metrics:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	ctx, cancelTimeout := context.WithTimeout(ctx, 2*time.Minute)
	defer cancelTimeout()

	dsn, stop, err := throwaway.DatabaseURL(ctx)
	if err != nil {
		return err
	}
	defer stop()
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := pgcoord.Migrate(ctx, pool); err != nil { // elections and semaphores need their tables
		return err
	}

	// Prometheus: a Collector on a registry served at /metrics.
	prom, err := pgcoordprom.New()
	if err != nil {
		return err
	}
	promReg := prometheus.NewRegistry()
	promReg.MustRegister(prom)
	// OpenTelemetry: instruments on a MeterProvider whose reader is the
	// Prometheus exporter, on a registry of its own served at
	// /otel/metrics (its names would clash with the Collector's).
	otelReg := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(otelReg), otelprom.WithoutScopeInfo(), otelprom.WithoutTargetInfo())
	if err != nil {
		return err
	}
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	defer provider.Shutdown(context.Background())
	otelMetrics, err := pgcoordotel.New(pgcoordotel.WithMeterProvider(provider))
	if err != nil {
		return err
	}
	defer otelMetrics.Close()

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(promReg, promhttp.HandlerOpts{}))
	mux.Handle("/otel/metrics", promhttp.HandlerFor(otelReg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	base := "http://" + ln.Addr().String()

	// Two Clients, each feeding both. Label by WithKeyNames' names, never
	// by raw keys: a HashKey per invoice would give every invoice a time
	// series of its own.
	names := map[pgcoord.Key]string{}
	var keys []pgcoord.Key
	for _, n := range []string{"report", "cache", "mailer"} {
		k := pgcoord.HashKey("metrics-example", n)
		names[k] = n
		keys = append(keys, k)
	}
	// Losses are logged at Warn; this handler keeps the output short.
	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{Level: slog.LevelWarn}))
	opts := []pgcoord.Option{
		pgcoord.WithHooks(pgcoordprom.Chain(prom.Hooks(), otelMetrics.Hooks())),
		pgcoord.WithKeyNames(names), pgcoord.WithLogger(logger),
	}
	a, err := pgcoord.New(pool, opts...)
	if err != nil {
		return err
	}
	defer a.Close(context.Background())
	b, err := pgcoord.New(pool, opts...)
	if err != nil {
		return err
	}
	defer b.Close(context.Background())
	for _, c := range []*pgcoord.Client{a, b} {
		prom.Watch(c)
		otelMetrics.Watch(c)
	}

	fmt.Println("8 goroutines of two Clients take 3 keys 50 times each ...")
	if err := contend(ctx, a, b, keys); err != nil {
		return err
	}
	fmt.Println("connections while the Clients are open:")
	if err := show(ctx, base+"/metrics", "pgcoord_connections"); err != nil {
		return err
	}

	fmt.Println("an election: a leads, hands over to b, b resigns ...")
	if err := elect(ctx, a, b); err != nil {
		return err
	}
	fmt.Println("4 workers share a semaphore of 2 permits, 5 times each ...")
	if err := share(ctx, a, b); err != nil {
		return err
	}

	fmt.Println("an operator terminates the backend of a held lock ...")
	l, err := a.Lock(ctx, keys[0])
	if err != nil {
		return err
	}
	locks, err := a.Locks(ctx)
	if err != nil {
		return err
	}
	var pid int32
	for _, li := range locks {
		if li.Key == keys[0] && li.Granted {
			pid = li.PID
		}
	}
	if err := a.Terminate(ctx, pid); err != nil {
		return err
	}
	select {
	case <-l.Done():
	case <-ctx.Done():
		return ctx.Err()
	}

	// The hooks run on a goroutine of their own: Close delivers what is
	// left before it returns.
	if err := errors.Join(a.Close(context.Background()), b.Close(context.Background())); err != nil {
		return err
	}
	fmt.Printf("\nGET /metrics (contrib/prometheus), pgcoord's series without buckets:\n")
	if err := show(ctx, base+"/metrics", "pgcoord_"); err != nil {
		return err
	}
	fmt.Printf("\nGET /otel/metrics (contrib/otel through the OpenTelemetry exporter), the lock series:\n")
	if err := show(ctx, base+"/otel/metrics", "pgcoord_lock_"); err != nil {
		return err
	}

	// What the workload must have left: nothing held, one lost lock.
	lost := total(promReg, "pgcoord_lock_losses_total")
	held := total(promReg, "pgcoord_locks_held") + total(promReg, "pgcoord_permits_held") + total(promReg, "pgcoord_leader")
	if held != 0 || lost != 1 {
		return fmt.Errorf("held %v, lost %v: want 0 and 1 once everything ended", held, lost)
	}
	return nil
}

// contend has 8 goroutines of a and b take keys, mostly with Do, every
// fifth time with TryLock.
func contend(ctx context.Context, a, b *pgcoord.Client, keys []pgcoord.Key) error {
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := range 8 {
		c := a
		if i%2 == 1 {
			c = b
		}
		wg.Go(func() {
			for j := range 50 {
				k := keys[(i+j)%len(keys)]
				if j%5 == 0 {
					l, err := c.TryLock(ctx, k)
					if errors.Is(err, pgcoord.ErrLocked) {
						continue
					}
					if err == nil {
						err = l.Unlock(ctx)
					}
					if err != nil {
						errs <- err
						return
					}
					continue
				}
				if err := c.Do(ctx, k, func(context.Context) error { return nil }); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// elect has a lead the election "scheduler", then resign while b
// campaigns, so that b leads; then b resigns.
func elect(ctx context.Context, a, b *pgcoord.Client) error {
	la, err := a.Election("scheduler", pgcoord.WithIdentity("a")).Campaign(ctx)
	if err != nil {
		return err
	}
	type result struct {
		ld  *pgcoord.Leadership
		err error
	}
	won := make(chan result, 1)
	go func() {
		ld, err := b.Election("scheduler", pgcoord.WithIdentity("b")).Campaign(ctx)
		won <- result{ld, err}
	}()
	if err := la.Resign(ctx); err != nil {
		return err
	}
	r := <-won // Campaign returns by ctx at the latest
	if r.err != nil {
		return r.err
	}
	return r.ld.Resign(ctx)
}

// share has 4 workers, 2 per Client, hold a permit of a semaphore of 2
// in turn.
func share(ctx context.Context, a, b *pgcoord.Client) error {
	sems := []*pgcoord.Semaphore{a.Semaphore("exports", 2), b.Semaphore("exports", 2)}
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for i := range 4 {
		wg.Go(func() {
			for range 5 {
				p, err := sems[i%2].Acquire(ctx)
				if err == nil {
					err = p.Release(ctx)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// show fetches url and prints the sample lines that start with prefix,
// without histogram buckets.
func show(ctx context.Context, url, prefix string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, prefix) && !strings.Contains(line, "_bucket{") {
			fmt.Println("  " + line)
		}
	}
	return sc.Err()
}

// total sums the values of the gauge or counter family name in
// reg, or returns -1 if reg has no such family.
func total(reg *prometheus.Registry, name string) float64 {
	mfs, err := reg.Gather()
	if err != nil {
		return -1
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		var sum float64
		for _, m := range mf.GetMetric() {
			sum += m.GetGauge().GetValue() + m.GetCounter().GetValue()
		}
		return sum
	}
	return -1
}
