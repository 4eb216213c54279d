// Command locks is a guided tour of pgcoord's session locks: two workers
// (two Clients, as if in two processes) contend for one job, the lock shows
// in pg_locks, the waiter gets it the moment the holder lets go, a fencing
// token refuses a write from a holder that lost its lock, and killing a
// holder's backend is noticed by the holder within its heartbeat.
//
// It reads DATABASE_URL; when that is unset it starts a throwaway PostgreSQL
// from the local binaries and removes it on exit.
//
//	go run ./examples/locks
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/examples/internal/throwaway"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "locks:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	ctx, cancelTimeout := context.WithTimeout(ctx, 2*time.Minute)
	defer cancelTimeout()

	dsn := os.Getenv("DATABASE_URL")
	if dsn == "" {
		fmt.Println("DATABASE_URL is not set: starting a throwaway PostgreSQL from the local binaries ...")
		cs, stop, err := throwaway.Start(ctx)
		if err != nil {
			return err
		}
		defer stop()
		dsn = cs
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := pgcoord.Migrate(ctx, pool); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS pgcoord_example_report (id int PRIMARY KEY, body text, fence bigint)`); err != nil {
		return err
	}

	a, err := pgcoord.New(pool, pgcoord.WithApplicationName("worker-a"))
	if err != nil {
		return err
	}
	defer a.Close()
	b, err := pgcoord.New(pool, pgcoord.WithApplicationName("worker-b"))
	if err != nil {
		return err
	}
	defer b.Close()

	job := pgcoord.HashKey("report", "daily")
	fmt.Printf("\n1. worker-a locks %v (HashKey(\"report\", \"daily\")) with a fencing token\n", job)
	la, err := a.Lock(ctx, job, pgcoord.WithFence())
	if err != nil {
		return err
	}
	fmt.Printf("   held, fence %d\n", la.Fence())
	if err := showLocks(ctx, pool); err != nil {
		return err
	}

	fmt.Println("\n2. worker-b tries the same key")
	if _, err := b.TryLock(ctx, job); errors.Is(err, pgcoord.ErrLocked) {
		fmt.Println("   TryLock:", err)
	} else if err != nil {
		return err
	} else {
		return errors.New("worker-b got a lock worker-a holds")
	}

	fmt.Println("\n3. worker-b waits with Lock; worker-a writes the report and unlocks")
	got := make(chan *pgcoord.Lock, 1)
	waitErr := make(chan error, 1)
	go func() {
		l, err := b.Lock(ctx, job, pgcoord.WithFence())
		if err != nil {
			waitErr <- err
			return
		}
		got <- l
	}()
	if err := writeReport(ctx, pool, job, la.Fence(), "report by worker-a"); err != nil {
		return err
	}
	released := time.Now()
	if err := la.Unlock(ctx); err != nil {
		return err
	}
	var lb *pgcoord.Lock
	select {
	case lb = <-got:
	case err := <-waitErr:
		return err
	}
	fmt.Printf("   worker-b holds it %v after the unlock, fence %d\n", time.Since(released).Round(time.Microsecond), lb.Fence())

	fmt.Println("\n4. worker-a, paused and unaware, writes with its old fence")
	err = writeReport(ctx, pool, job, la.Fence(), "late report by worker-a")
	fmt.Println("   CheckFence:", err)
	if !errors.Is(err, pgcoord.ErrStaleFence) {
		return errors.New("a stale fence was accepted")
	}
	if err := writeReport(ctx, pool, job, lb.Fence(), "report by worker-b"); err != nil {
		return err
	}
	var body string
	if err := pool.QueryRow(ctx, "SELECT body FROM pgcoord_example_report WHERE id = 1").Scan(&body); err != nil {
		return err
	}
	fmt.Printf("   the table says: %q\n", body)

	fmt.Println("\n5. an operator terminates worker-b's backend (as a crash or a network cut would end it)")
	var pid int32
	if err := pool.QueryRow(ctx, "SELECT pid FROM pg_stat_activity WHERE application_name = 'worker-b' AND state = 'idle' AND pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory')").Scan(&pid); err != nil {
		return err
	}
	killed := time.Now()
	if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
		return err
	}
	select {
	case <-lb.Done():
		fmt.Printf("   worker-b noticed after %v: %v\n", time.Since(killed).Round(time.Millisecond), lb.Err())
	case <-ctx.Done():
		return ctx.Err()
	}
	l, err := a.TryLock(ctx, job)
	if err != nil {
		return err
	}
	fmt.Println("   the key is free again: worker-a's TryLock succeeds")
	return l.Unlock(ctx)
}

// writeReport writes the report in a transaction that first checks the
// writer's fence.
func writeReport(ctx context.Context, pool *pgxpool.Pool, job pgcoord.Key, fence int64, body string) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := pgcoord.CheckFence(ctx, tx, job, fence); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO pgcoord_example_report VALUES (1, $1, $2)
			ON CONFLICT (id) DO UPDATE SET body = excluded.body, fence = excluded.fence`, body, fence)
		return err
	})
}

func showLocks(ctx context.Context, pool *pgxpool.Pool) error {
	rows, err := pool.Query(ctx, `SELECT a.application_name, l.pid, l.mode, l.granted,
			(l.classid::bigint << 32) | l.objid::bigint AS key
		FROM pg_locks l JOIN pg_stat_activity a USING (pid)
		WHERE l.locktype = 'advisory' AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())`)
	if err != nil {
		return err
	}
	defer rows.Close()
	fmt.Println("   pg_locks:")
	for rows.Next() {
		var app, mode string
		var pid int32
		var granted bool
		var key int64
		if err := rows.Scan(&app, &pid, &mode, &granted, &key); err != nil {
			return err
		}
		fmt.Printf("     %-9s pid %-6d %-13s granted=%-5v key=%d\n", app, pid, mode, granted, key)
	}
	return rows.Err()
}
