// Command transfer moves money between accounts from many goroutines at once.
// Each transfer reads both balances, checks for funds and writes both back,
// holding transaction-level advisory locks on both accounts, taken with
// pgcoord.InTx in one canonical order. It prints the throughput and checks
// that the total balance never changed and no balance went negative; it exits
// with status 1 if either did, or if a deadlock happened.
//
// It reads DATABASE_URL; when that is unset it starts a throwaway PostgreSQL
// from the local binaries and removes it on exit.
//
//	go run ./examples/transfer                 # InTx: no deadlocks, total kept
//	go run ./examples/transfer -mode=unordered # one lock per account, in argument order: deadlocks
//	go run ./examples/transfer -mode=nolock    # no locks: lost updates, the total drifts (exit 1)
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/examples/internal/throwaway"
)

const table = "pgcoord_example_accounts"

// startBalance is every account's opening balance.
const startBalance = 1000

// maxRetries bounds the retries of one transfer after deadlocks.
const maxRetries = 50

func main() { os.Exit(run()) }

type stats struct {
	committed, declined, deadlocks atomic.Int64
}

func run() int {
	accounts := flag.Int("accounts", 20, "number of accounts")
	workers := flag.Int("workers", 8, "concurrent transfer goroutines (one connection each)")
	transfers := flag.Int("transfers", 5000, "transfers in total")
	mode := flag.String("mode", "ordered", "ordered (pgcoord.InTx), unordered (one XactLock per account in argument order) or nolock")
	flag.Parse()
	if *accounts < 2 || *workers < 1 || *transfers < 1 {
		fmt.Fprintln(os.Stderr, "transfer: need -accounts >= 2, -workers >= 1, -transfers >= 1")
		return 2
	}
	transfer, ok := map[string]transferFunc{"ordered": ordered, "unordered": unordered, "nolock": nolock}[*mode]
	if !ok {
		fmt.Fprintf(os.Stderr, "transfer: unknown -mode %q (want ordered, unordered or nolock)\n", *mode)
		return 2
	}

	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()

	dsn := os.Getenv("DATABASE_URL")
	if dsn == "" {
		fmt.Println("DATABASE_URL is not set: starting a throwaway PostgreSQL from the local binaries ...")
		cs, stop, err := throwaway.Start(ctx)
		if err != nil {
			fmt.Fprintln(os.Stderr, "transfer:", err)
			return 1
		}
		defer stop()
		fmt.Printf("throwaway PostgreSQL running at %s (stopped and removed on exit)\n", cs)
		dsn = cs
	}

	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		fmt.Fprintln(os.Stderr, "transfer: DATABASE_URL:", err)
		return 1
	}
	cfg.MaxConns = int32(*workers) + 1
	// Detect deadlocks after 50ms instead of the default 1s, where the role
	// may change it (superusers only); the program works either way, but the
	// unordered and nolock modes run much slower at 1s per deadlock.
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, _ = c.Exec(ctx, "SET deadlock_timeout = '50ms'")
		return nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "transfer:", err)
		return 1
	}
	defer pool.Close()

	if err := setup(ctx, pool, *accounts); err != nil {
		fmt.Fprintln(os.Stderr, "transfer: setup:", err)
		return 1
	}
	defer func() {
		_, _ = pool.Exec(context.WithoutCancel(ctx), "DROP TABLE IF EXISTS "+table)
	}()
	before, _, err := audit(ctx, pool)
	if err != nil {
		fmt.Fprintln(os.Stderr, "transfer:", err)
		return 1
	}

	fmt.Printf("mode %s: %d transfers by %d goroutines among %d accounts ...\n", *mode, *transfers, *workers, *accounts)
	var st stats
	var wg sync.WaitGroup
	errs := make(chan error, *workers)
	start := time.Now()
	for w := range *workers {
		n := *transfers / *workers
		if w < *transfers%*workers {
			n++
		}
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), uint64(w)))
			for range n {
				from := 1 + rng.IntN(*accounts)
				to := 1 + rng.IntN(*accounts-1)
				if to >= from {
					to++
				}
				amount := int64(1 + rng.IntN(100))
				var declined bool
				err := withRetry(ctx, &st, func() (err error) {
					declined, err = transfer(ctx, pool, from, to, amount)
					return err
				})
				if err != nil {
					errs <- err
					return
				}
				if declined {
					st.declined.Add(1)
				} else {
					st.committed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	close(errs)
	failed := false
	if ctx.Err() != nil {
		fmt.Fprintln(os.Stderr, "transfer: interrupted")
		failed = true
	} else {
		for err := range errs {
			fmt.Fprintln(os.Stderr, "transfer:", err)
			failed = true
		}
	}

	n := st.committed.Load()
	fmt.Printf("%d transfers committed in %v: %.0f transfers/s (%d declined for lack of funds)\n",
		n, elapsed.Round(time.Millisecond), float64(n)/elapsed.Seconds(), st.declined.Load())
	fmt.Printf("deadlocks: %d\n", st.deadlocks.Load())

	after, minBalance, err := audit(context.WithoutCancel(ctx), pool)
	if err != nil {
		fmt.Fprintln(os.Stderr, "transfer:", err)
		return 1
	}
	fmt.Printf("total balance: %d before, %d after; lowest balance %d\n", before, after, minBalance)
	if after != before {
		fmt.Printf("FAIL: the total changed by %d: updates were lost\n", after-before)
		failed = true
	}
	if minBalance < 0 {
		fmt.Println("FAIL: a balance went negative: a funds check was overtaken")
		failed = true
	}
	if *mode == "ordered" && st.deadlocks.Load() > 0 {
		fmt.Println("FAIL: deadlocks although every transfer took its keys in canonical order")
		failed = true
	}
	if failed {
		return 1
	}
	fmt.Println("OK: total unchanged, no balance negative")
	return 0
}

// transferFunc moves amount from one account to another, or declines it
// (declined true, nil error) when the first account lacks the funds.
type transferFunc func(ctx context.Context, pool *pgxpool.Pool, from, to int, amount int64) (declined bool, err error)

func accountKey(id int) pgcoord.Key { return pgcoord.HashKey("account", strconv.Itoa(id)) }

// ordered locks both accounts with InTx: one statement, canonical order.
func ordered(ctx context.Context, pool *pgxpool.Pool, from, to int, amount int64) (declined bool, err error) {
	keys := []pgcoord.Key{accountKey(from), accountKey(to)}
	err = pgcoord.InTx(ctx, pool, keys, func(tx pgx.Tx) error {
		declined, err = move(ctx, tx, from, to, amount, nil)
		return err
	})
	return declined, err
}

// unordered locks each account with its own XactLock, in argument order,
// reading the first account before locking the second: two opposite
// transfers can each hold one account and wait for the other.
func unordered(ctx context.Context, pool *pgxpool.Pool, from, to int, amount int64) (declined bool, err error) {
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := pgcoord.XactLock(ctx, tx, accountKey(from)); err != nil {
			return err
		}
		declined, err = move(ctx, tx, from, to, amount, func() error {
			return pgcoord.XactLock(ctx, tx, accountKey(to))
		})
		return err
	})
	return declined, err
}

// nolock does the same reads and writes with no lock at all.
func nolock(ctx context.Context, pool *pgxpool.Pool, from, to int, amount int64) (declined bool, err error) {
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		declined, err = move(ctx, tx, from, to, amount, nil)
		return err
	})
	return declined, err
}

// move reads both balances, checks the funds and writes both balances back:
// correct only while nobody else changes the two accounts in between. between,
// if not nil, runs after reading the first balance.
func move(ctx context.Context, tx pgx.Tx, from, to int, amount int64, between func() error) (declined bool, err error) {
	var fromBal, toBal int64
	q := "SELECT balance FROM " + table + " WHERE id = $1"
	if err := tx.QueryRow(ctx, q, from).Scan(&fromBal); err != nil {
		return false, err
	}
	if between != nil {
		if err := between(); err != nil {
			return false, err
		}
	}
	if err := tx.QueryRow(ctx, q, to).Scan(&toBal); err != nil {
		return false, err
	}
	if fromBal < amount {
		return true, nil
	}
	u := "UPDATE " + table + " SET balance = $1 WHERE id = $2"
	if _, err := tx.Exec(ctx, u, fromBal-amount, from); err != nil {
		return false, err
	}
	if _, err := tx.Exec(ctx, u, toBal+amount, to); err != nil {
		return false, err
	}
	return false, nil
}

// withRetry runs f, retrying after deadlocks (counted) up to maxRetries.
func withRetry(ctx context.Context, st *stats, f func() error) error {
	for range maxRetries {
		err := f()
		if !isDeadlock(err) {
			return err
		}
		st.deadlocks.Add(1)
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	return fmt.Errorf("a transfer deadlocked %d times in a row", maxRetries)
}

func isDeadlock(err error) bool {
	var pe *pgconn.PgError
	return errors.Is(err, pgcoord.ErrDeadlock) || errors.As(err, &pe) && pe.Code == "40P01"
}

// setup creates the accounts table afresh.
func setup(ctx context.Context, pool *pgxpool.Pool, accounts int) error {
	_, err := pool.Exec(ctx, `DROP TABLE IF EXISTS `+table+`;
		CREATE TABLE `+table+` (id int PRIMARY KEY, balance bigint NOT NULL);
		INSERT INTO `+table+` SELECT g, `+strconv.Itoa(startBalance)+` FROM generate_series(1, `+strconv.Itoa(accounts)+`) g`)
	return err
}

// audit returns the total and the lowest balance.
func audit(ctx context.Context, pool *pgxpool.Pool) (total, lowest int64, err error) {
	err = pool.QueryRow(ctx, "SELECT sum(balance)::bigint, min(balance) FROM "+table).Scan(&total, &lowest)
	if err != nil {
		err = fmt.Errorf("audit: %w", err)
	}
	return total, lowest, err
}
