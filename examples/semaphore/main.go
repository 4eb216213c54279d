// Command semaphore shows a pgcoord semaphore shared by several processes:
// three worker processes, four goroutines each, run export jobs under one
// semaphore, "exports", with a limit of 2, while the parent process watches
// the holders, raises the limit to 3, and kills a worker that holds a
// permit. At no moment do more jobs run than the limit allows, and the
// killed worker's permit goes to a waiter at once.
//
// It reads DATABASE_URL; when that is unset it starts a throwaway PostgreSQL
// from the local binaries and removes it on exit.
//
//	go run ./examples/semaphore
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/examples/internal/throwaway"
)

const (
	semName    = "exports"
	limit      = 2
	workers    = 3
	goroutines = 4
	jobs       = 3 // per goroutine
	jobTime    = 150 * time.Millisecond
	workerEnv  = "SEMAPHORE_EXAMPLE_WORKER"
)

func main() {
	var err error
	if name := os.Getenv(workerEnv); name != "" {
		err = worker(name)
	} else {
		err = run()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "semaphore:", err)
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
	// Start from a known limit, also on a database where the example ran
	// before (the table's limit wins over the one a process passes).
	if _, err := pool.Exec(ctx, `DELETE FROM pgcoord.semaphores WHERE name = $1`, semName); err != nil {
		return err
	}
	c, err := pgcoord.New(pool, pgcoord.WithApplicationName("watcher"))
	if err != nil {
		return err
	}
	defer c.Close(context.Background())
	sem := c.Semaphore(semName, limit)
	if err := sem.SetLimit(ctx, limit); err != nil {
		return err
	}

	self, err := os.Executable()
	if err != nil {
		return err
	}
	fmt.Printf("\n%d worker processes x %d goroutines x %d jobs share semaphore %q, limit %d\n\n", workers, goroutines, jobs, semName, limit)
	procs := make([]*exec.Cmd, workers)
	exited := make(chan error, workers)
	for i := range procs {
		cmd := exec.CommandContext(ctx, self)
		cmd.Env = append(os.Environ(), workerEnv+"="+fmt.Sprintf("worker-%d", i), "DATABASE_URL="+dsn)
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Start(); err != nil {
			return err
		}
		procs[i] = cmd
		go func() { exited <- cmd.Wait() }()
	}
	defer func() {
		for _, p := range procs {
			_ = p.Process.Kill()
		}
	}()

	// Watch the holders until every worker has exited; raise the limit
	// once two jobs run, and kill worker-2 the first time it holds a
	// permit once three run.
	most, raised, killed := 0, false, false
	running := workers
	var last []string
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for running > 0 {
		select {
		case err := <-exited:
			running--
			var exit *exec.ExitError
			if err != nil && !(killed && errors.As(err, &exit)) {
				return fmt.Errorf("worker: %w", err)
			}
			continue
		case <-tick.C:
		case <-ctx.Done():
			return ctx.Err()
		}
		hs, err := sem.Holders(ctx)
		if err != nil {
			return err
		}
		lim, err := sem.Limit(ctx)
		if err != nil {
			return err
		}
		var who []string
		for _, h := range hs {
			who = append(who, strings.SplitN(h.Identity, " ", 2)[0])
		}
		if !slices.Equal(who, last) {
			fmt.Printf("  watcher: %d of %d permits held %s\n", len(hs), lim, strings.Join(who, ", "))
			last = who
		}
		most = max(most, len(hs))
		if len(hs) > lim {
			return fmt.Errorf("%d holders with limit %d", len(hs), lim)
		}
		if !raised && most == limit {
			fmt.Printf("\n  watcher: raising the limit to %d (waiters are notified at once)\n\n", limit+1)
			if err := sem.SetLimit(ctx, limit+1); err != nil {
				return err
			}
			raised = true
		}
		if raised && most > limit && !killed {
			for _, h := range hs {
				if strings.HasPrefix(h.Identity, "worker-2 ") {
					fmt.Printf("\n  watcher: killing worker-2 (process %d) while it holds slot %d; the server frees its permit as soon as its connection is gone\n\n", procs[2].Process.Pid, h.Slot)
					_ = procs[2].Process.Kill()
					killed = true
					break
				}
			}
		}
	}
	fmt.Printf("\nat most %d jobs ran at once; the limit was %d, then %d\n", most, limit, limit+1)
	return nil
}

// worker runs goroutines that each do a few jobs, each under a permit.
func worker(name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := pgcoord.Open(ctx, os.Getenv("DATABASE_URL"), pgcoord.WithApplicationName(name))
	if err != nil {
		return err
	}
	defer c.Close(context.Background())
	host, _ := os.Hostname()
	sem := c.Semaphore(semName, limit, pgcoord.WithIdentity(fmt.Sprintf("%s %s pid %d", name, host, os.Getpid())))
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for g := range goroutines {
		wg.Go(func() {
			for j := range jobs {
				p, err := sem.Acquire(ctx)
				if err != nil {
					errs <- err
					return
				}
				fmt.Printf("%s/%d job %d: running on slot %d\n", name, g, j, p.Slot())
				time.Sleep(jobTime) // the export
				if err := p.Release(ctx); err != nil {
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
