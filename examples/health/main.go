// Command health shows readiness and liveness probes fed by pgcoord: a
// Probe (probe.go) answers /readyz with 503 once a lock the process must
// hold is lost, or its campaign for an election fails, and says why in
// JSON; a follower is ready. /livez stays 200: restarting a process for a
// lost lock would only lose the locks it still has.
//
// The program takes a lock that the process must hold ("singleton"),
// campaigns for an election ("scheduler"), serves the probes, then has an
// operator terminate the lock's backend and shows /readyz flip to 503.
//
// It reads DATABASE_URL; when that is unset it starts a throwaway PostgreSQL
// from the local binaries and removes it on exit.
//
//	go run ./examples/health
package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/examples/internal/throwaway"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "health:", err)
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
	if err := pgcoord.Migrate(ctx, pool); err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{Level: slog.LevelWarn}))
	client, err := pgcoord.New(pool, pgcoord.WithLogger(logger))
	if err != nil {
		return err
	}
	defer client.Close(context.Background())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}

	// snippet:start
	probe := NewProbe()
	singleton := pgcoord.HashKey("singleton")
	l, err := client.Lock(ctx, singleton)
	if err != nil {
		return err
	}
	probe.Require("singleton", l) // /readyz: 503 once l is lost

	campaignCtx, stopCampaign := context.WithCancel(ctx)
	defer stopCampaign()
	go campaign(campaignCtx, client.Election("scheduler"), probe) // leading, following or error

	srv := &http.Server{Handler: probe.Handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }() // GET /readyz, GET /livez
	defer srv.Close()
	// snippet:end
	base := "http://" + ln.Addr().String()

	if err := waitFor(ctx, func() bool { e := probe.Report().Election; return e != nil && e.State == "leading" }); err != nil {
		return err
	}
	if err := get(ctx, base+"/livez"); err != nil {
		return err
	}
	if err := get(ctx, base+"/readyz"); err != nil {
		return err
	}

	fmt.Println("\nan operator terminates the backend that holds the singleton lock ...")
	locks, err := client.Locks(ctx)
	if err != nil {
		return err
	}
	var pid int32
	for _, li := range locks {
		if li.Key == singleton && li.Granted {
			pid = li.PID
		}
	}
	if err := client.Terminate(ctx, pid); err != nil {
		return err
	}
	select {
	case <-l.Done():
	case <-ctx.Done():
		return ctx.Err()
	}
	if err := get(ctx, base+"/readyz"); err != nil {
		return err
	}
	if probe.Report().Ready {
		return fmt.Errorf("still ready after the singleton lock was lost")
	}
	stopCampaign()
	return client.Close(context.Background())
}

// campaign campaigns for e until ctx ends, reporting to probe: following
// while it waits, leading while it leads, error when a campaign fails (it
// then tries again after a pause).
func campaign(ctx context.Context, e *pgcoord.Election, probe *Probe) {
	for ctx.Err() == nil {
		probe.Following(e.Name())
		ld, err := e.Campaign(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			probe.CampaignFailed(e.Name(), err)
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
			continue
		}
		probe.Leading(e.Name(), ld)
		select {
		case <-ld.Done():
		case <-ctx.Done():
			_ = ld.Resign(context.Background())
		}
	}
}

// waitFor polls cond, bounded by ctx.
func waitFor(ctx context.Context, cond func() bool) error {
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}

// get fetches url and prints the status and body.
func get(ctx context.Context, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
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
	fmt.Printf("GET %s: %s\n  %s", req.URL.Path, resp.Status, body)
	return nil
}
