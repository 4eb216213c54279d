// Command metrics shows how to turn pgcoord's lock events into metrics
// without making a metrics library a dependency of pgcoord: WithHooks gives
// plain functions, and this program feeds them into a few counters and a
// wait-time histogram published with the standard library's expvar, at
// /debug/vars. The comments on each hook show the same with Prometheus'
// client_golang and with OpenTelemetry.
//
// It runs a short workload (goroutines of two Clients contending for a few
// keys, and one backend terminated to cause a loss), reads its own
// /debug/vars over HTTP and prints pgcoord's part.
//
// It reads DATABASE_URL; when that is unset it starts a throwaway PostgreSQL
// from the local binaries and removes it on exit.
//
//	go run ./examples/metrics
package main

import (
	"context"
	"encoding/json"
	"errors"
	"expvar"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/examples/internal/throwaway"
)

// metrics are the instruments the hooks update. With Prometheus they would
// be (registered once, labelled by the key's name):
//
//	acquires := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "pgcoord_acquires_total"}, []string{"name", "result"})
//	wait := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "pgcoord_acquire_wait_seconds"}, []string{"name"})
//	held := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "pgcoord_locks_held"}, []string{"name"})
//	contention := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "pgcoord_contention_total"}, []string{"name", "local"})
//	losses := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "pgcoord_losses_total"}, []string{"name"})
//
// and with OpenTelemetry, from a metric.Meter: Int64Counter for the
// counters, Float64Histogram for the wait, Int64UpDownCounter for held.
// Label by WithKeyNames' names, never by raw keys: a HashKey per invoice
// would give every invoice a time series of its own.
type metrics struct {
	acquires, acquireErrors, releases, contention, losses expvar.Int
	held                                                  expvar.Int // acquires - releases - losses
	wait                                                  histogram
}

func newMetrics() *metrics {
	m := &metrics{wait: histogram{bounds: []time.Duration{time.Millisecond, 10 * time.Millisecond, 100 * time.Millisecond, time.Second}}}
	m.wait.counts = make([]int64, len(m.wait.bounds)+1)
	v := expvar.NewMap("pgcoord")
	v.Set("acquires", &m.acquires)
	v.Set("acquire_errors", &m.acquireErrors)
	v.Set("releases", &m.releases)
	v.Set("contention", &m.contention)
	v.Set("losses", &m.losses)
	v.Set("held", &m.held)
	v.Set("acquire_wait", &m.wait)
	return m
}

// hooks returns the functions for pgcoord.WithHooks. pgcoord calls them on
// a goroutine of its own, one at a time, so they cannot slow a lock down;
// they should still be quick, as these are.
func (m *metrics) hooks() pgcoord.Hooks {
	return pgcoord.Hooks{
		// Prometheus: acquires.WithLabelValues(e.Name, result).Inc() and,
		// on success, wait.WithLabelValues(e.Name).Observe(e.Wait.Seconds()).
		OnAcquire: func(e pgcoord.AcquireEvent) {
			if e.Err != nil {
				m.acquireErrors.Add(1)
				return
			}
			m.acquires.Add(1)
			m.held.Add(1)
			m.wait.observe(e.Wait)
		},
		// Prometheus: held.WithLabelValues(e.Name).Dec(); the hold time
		// (e.Held) could feed another histogram.
		OnRelease: func(e pgcoord.ReleaseEvent) {
			m.releases.Add(1)
			m.held.Add(-1)
		},
		// Prometheus: contention.WithLabelValues(e.Name, strconv.FormatBool(e.Local)).Inc().
		OnContention: func(e pgcoord.ContentionEvent) { m.contention.Add(1) },
		// A loss deserves an alert: losses.WithLabelValues(e.Name).Inc().
		// pgcoord also logs it at Warn.
		OnLoss: func(e pgcoord.LossEvent) {
			m.losses.Add(1)
			m.held.Add(-1)
		},
	}
}

// histogram counts durations in buckets: counts[i] holds the durations up
// to bounds[i], the last one those above every bound. It is an
// expvar.Var.
type histogram struct {
	mu     sync.Mutex
	bounds []time.Duration
	counts []int64
}

func (h *histogram) observe(d time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	i := 0
	for i < len(h.bounds) && d > h.bounds[i] {
		i++
	}
	h.counts[i]++
}

// String renders the buckets as JSON, as expvar wants.
func (h *histogram) String() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	m := make(map[string]int64, len(h.counts))
	for i, n := range h.counts {
		label := "+Inf"
		if i < len(h.bounds) {
			label = "le_" + h.bounds[i].String()
		}
		m[label] = n
	}
	b, _ := json.Marshal(m)
	return string(b)
}

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

	m := newMetrics()
	names := map[pgcoord.Key]string{}
	var keys []pgcoord.Key
	for _, n := range []string{"report", "cache", "mailer"} {
		k := pgcoord.HashKey("metrics-example", n)
		names[k] = n
		keys = append(keys, k)
	}
	// Losses are logged at Warn; this handler keeps the example's output
	// short.
	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{Level: slog.LevelWarn}))
	opts := []pgcoord.Option{pgcoord.WithHooks(m.hooks()), pgcoord.WithKeyNames(names), pgcoord.WithLogger(logger)}
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

	fmt.Println("8 goroutines of two Clients take 3 keys 50 times each ...")
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
					if err != nil {
						errs <- err
						return
					}
					if err := l.Unlock(ctx); err != nil {
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
	if err := <-errs; err != nil {
		return err
	}

	fmt.Println("an operator terminates the backend of a held lock ...")
	l, err := a.Lock(ctx, keys[0])
	if err != nil {
		return err
	}
	var pid int32
	locks, err := a.Locks(ctx)
	if err != nil {
		return err
	}
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
	// The hooks run on their own goroutine: Close delivers what is left.
	if err := a.Close(context.Background()); err != nil {
		return err
	}
	if err := b.Close(context.Background()); err != nil {
		return err
	}

	// Serve expvar's /debug/vars, as a real program would, and read it.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: expvar.Handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+ln.Addr().String()+"/debug/vars", nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	var vars map[string]json.RawMessage
	if err := json.Unmarshal(body, &vars); err != nil {
		return err
	}
	var out map[string]any
	if err := json.Unmarshal(vars["pgcoord"], &out); err != nil {
		return err
	}
	pretty, err := json.MarshalIndent(out, "  ", "  ")
	if err != nil {
		return err
	}
	fmt.Printf("GET /debug/vars, \"pgcoord\":\n  %s\n", pretty)
	if m.held.Value() != 0 || m.losses.Value() != 1 {
		return fmt.Errorf("held %d, losses %d: want 0 and 1 once every lock ended", m.held.Value(), m.losses.Value())
	}
	return nil
}
