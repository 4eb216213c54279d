// Command locks is a guided tour of pgcoord's session locks: two workers
// (two Clients, as if in two processes) contend for one job, the lock shows
// in pg_locks, the waiter gets it the moment the holder lets go, a fencing
// token refuses a write from a holder that lost its lock, and killing a
// holder's backend is noticed by the holder within its heartbeat. Last, the
// two workers campaign in a leader election, and the follower takes over
// when the leader's backend is terminated, only after the old leader has
// stopped.
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
	"sync"
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
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS pgcoord_example_report (id int PRIMARY KEY, body text, fence bigint)`); err != nil {
		return err
	}

	a, err := pgcoord.New(pool, pgcoord.WithApplicationName("worker-a"))
	if err != nil {
		return err
	}
	defer a.Close(context.Background())
	b, err := pgcoord.New(pool, pgcoord.WithApplicationName("worker-b"))
	if err != nil {
		return err
	}
	defer b.Close(context.Background())

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
	if err := l.Unlock(ctx); err != nil {
		return err
	}
	return electLeader(ctx, pool, a, b)
}

// electLeader shows a leader election and a takeover: worker-a leads,
// worker-b campaigns, an operator terminates worker-a's backend, and
// worker-b takes over only after worker-a has stopped.
func electLeader(ctx context.Context, pool *pgxpool.Pool, a, b *pgcoord.Client) error {
	fmt.Println("\n6. leader election: worker-a and worker-b campaign for \"nightly-report\"")
	type event struct {
		who  string
		term pgcoord.Term
		at   time.Time
		why  error
	}
	leads, ends := make(chan event, 4), make(chan event, 4)
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { stop(); wg.Wait() }()
	campaign := func(c *pgcoord.Client, who string) {
		e := c.Election("nightly-report", pgcoord.WithIdentity(who))
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = e.Run(runCtx, func(ctx context.Context, term pgcoord.Term) error {
				leads <- event{who: who, term: term, at: time.Now()}
				<-ctx.Done()
				ends <- event{who: who, term: term, at: time.Now(), why: context.Cause(ctx)}
				return nil
			})
		}()
	}
	next := func(ch chan event) (event, error) {
		select {
		case ev := <-ch:
			return ev, nil
		case <-ctx.Done():
			return event{}, ctx.Err()
		}
	}
	campaign(a, "worker-a")
	first, err := next(leads)
	if err != nil {
		return err
	}
	campaign(b, "worker-b")
	info, err := a.Election("nightly-report").Leader(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("   %s leads, term %d, on backend %d; worker-b waits\n", first.who, first.term, info.PID)
	fmt.Println("   an operator terminates the leader's backend")
	killed := time.Now()
	if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", info.PID); err != nil {
		return err
	}
	end, err := next(ends)
	if err != nil {
		return err
	}
	second, err := next(leads)
	if err != nil {
		return err
	}
	fmt.Printf("   %s's leader context cancelled after %v (%v)\n", end.who, end.at.Sub(killed).Round(time.Millisecond), end.why)
	fmt.Printf("   %s leads, term %d > %d, %v after %s stopped: never two leaders at once\n",
		second.who, second.term, first.term, second.at.Sub(end.at).Round(10*time.Microsecond), end.who)
	return nil
}

// writeReport writes the report in a transaction that first checks the
// writer's fence.
func writeReport(ctx context.Context, pool *pgxpool.Pool, job pgcoord.Key, fence pgcoord.Term, body string) error {
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
