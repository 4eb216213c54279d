// Command dogpile shows how to stop a cache stampede: when an expensive
// cached value expires, many requests at once find it missing, and without
// coordination every one of them recomputes it (the "dogpile" behind many
// Redis lock recipes). With a pgcoord lock on the cache entry, one request
// recomputes while the others wait for it, or, when a stale value is at
// hand, serve that instead of waiting.
//
// Three Clients (as if three processes) run 10 requests each, at once:
//
//  1. Cold cache: every request finds nothing. Each one takes the entry's
//     lock with Do and looks at the cache again once it holds it, so only
//     the first holder computes; the others find the fresh value.
//  2. Stale cache: the value has expired but is still there. A request
//     that gets the lock with TryLock refreshes it; the others get
//     ErrLocked and serve the stale value at once.
//
// With -nolock every request computes, which is what the lock prevents.
//
// It reads DATABASE_URL; when that is unset it starts a throwaway PostgreSQL
// from the local binaries and removes it on exit.
//
//	go run ./examples/dogpile
//	go run ./examples/dogpile -nolock
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/examples/internal/throwaway"
)

const (
	clients        = 3
	requestsPerOne = 10
	computeTime    = 300 * time.Millisecond // the expensive part
	entry          = "report:daily"
)

func main() {
	nolock := flag.Bool("nolock", false, "let every request recompute, without a lock")
	flag.Parse()
	if err := run(*nolock); err != nil {
		fmt.Fprintln(os.Stderr, "dogpile:", err)
		os.Exit(1)
	}
}

// cache is a cache table in PostgreSQL, shared by every process, with a
// pgcoord lock per entry.
type cache struct {
	pool     *pgxpool.Pool
	c        *pgcoord.Client
	nolock   bool
	computed *atomic.Int64 // recomputations, across all processes
}

// lockKey is the key of an entry's lock.
func lockKey(name string) pgcoord.Key { return pgcoord.HashKey("cache", name) }

// read returns the cached value, whether it is still fresh, and whether
// there is one at all.
func (c *cache) read(ctx context.Context, name string) (value string, fresh, found bool, err error) {
	err = c.pool.QueryRow(ctx, "SELECT value, expires_at > now() FROM pgcoord_example_cache WHERE name = $1", name).Scan(&value, &fresh)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", false, false, nil
	}
	return value, fresh, err == nil, err
}

// compute is the expensive recomputation; it stores the result.
func (c *cache) compute(ctx context.Context, name string) (string, error) {
	n := c.computed.Add(1)
	select {
	case <-time.After(computeTime):
	case <-ctx.Done():
		return "", ctx.Err()
	}
	value := fmt.Sprintf("%s, computation #%d", name, n)
	_, err := c.pool.Exec(ctx, `INSERT INTO pgcoord_example_cache (name, value, expires_at)
		VALUES ($1, $2, now() + interval '1 minute')
		ON CONFLICT (name) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at`, name, value)
	return value, err
}

// get returns the entry, recomputing it at most once across all
// processes when it is missing; when it is stale, one request refreshes
// it and the others serve the stale value.
func (c *cache) get(ctx context.Context, name string) (value string, how string, err error) {
	value, fresh, found, err := c.read(ctx, name)
	switch {
	case err != nil:
		return "", "", err
	case fresh:
		return value, "fresh", nil
	case c.nolock:
		value, err = c.compute(ctx, name)
		return value, "computed", err
	case found:
		// Stale: refresh it if nobody else is, else serve it as it is.
		l, err := c.c.TryLock(ctx, lockKey(name))
		if errors.Is(err, pgcoord.ErrLocked) {
			return value, "stale", nil
		}
		if err != nil {
			return "", "", err
		}
		defer l.Unlock(ctx)
		// Look again: another request may have refreshed it between our
		// read and our TryLock.
		if v, fresh, _, err := c.read(ctx, name); err != nil || fresh {
			return v, "fresh", err
		}
		value, err = c.compute(ctx, name)
		return value, "refreshed", err
	}
	// Missing: wait for whoever computes it, or compute it.
	how = "waited"
	err = c.c.Do(ctx, lockKey(name), func(ctx context.Context) error {
		// Look again: the holder before us may have computed it.
		v, fresh, _, err := c.read(ctx, name)
		if err != nil || fresh {
			value = v
			return err
		}
		how = "computed"
		value, err = c.compute(ctx, name)
		return err
	})
	return value, how, err
}

func run(nolock bool) error {
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
	if _, err := pool.Exec(ctx, `DROP TABLE IF EXISTS pgcoord_example_cache;
		CREATE TABLE pgcoord_example_cache (name text PRIMARY KEY, value text NOT NULL, expires_at timestamptz NOT NULL)`); err != nil {
		return err
	}

	var computed atomic.Int64
	caches := make([]*cache, clients)
	for i := range caches {
		c, err := pgcoord.New(pool)
		if err != nil {
			return err
		}
		defer c.Close(context.Background())
		caches[i] = &cache{pool: pool, c: c, nolock: nolock, computed: &computed}
	}

	for _, phase := range []string{"cold cache", "stale cache"} {
		if phase == "stale cache" {
			if _, err := pool.Exec(ctx, "UPDATE pgcoord_example_cache SET expires_at = now() - interval '1 second'"); err != nil {
				return err
			}
		}
		computed.Store(0)
		start := time.Now()
		var mu sync.Mutex
		hows := map[string]int{}
		var slowest time.Duration
		var wg sync.WaitGroup
		errs := make(chan error, clients*requestsPerOne)
		for _, c := range caches {
			for range requestsPerOne {
				wg.Go(func() {
					began := time.Now()
					_, how, err := c.get(ctx, entry)
					if err != nil {
						errs <- err
						return
					}
					mu.Lock()
					hows[how]++
					slowest = max(slowest, time.Since(began))
					mu.Unlock()
				})
			}
		}
		wg.Wait()
		close(errs)
		if err := <-errs; err != nil {
			return err
		}
		value, _, _, err := caches[0].read(ctx, entry)
		if err != nil {
			return err
		}
		fmt.Printf("\n%s: %d requests from %d processes in %v (slowest request %v)\n",
			phase, clients*requestsPerOne, clients, time.Since(start).Round(time.Millisecond), slowest.Round(time.Millisecond))
		fmt.Printf("  computed %d time(s) (%v each); requests: %v\n", computed.Load(), computeTime, hows)
		fmt.Printf("  cached value: %q\n", value)
		if !nolock && computed.Load() != 1 {
			return fmt.Errorf("%s: computed %d times, want once", phase, computed.Load())
		}
	}
	return nil
}
