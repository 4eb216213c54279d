package pgcoord_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
)

func ExampleHashKey() {
	k := pgcoord.HashKey("invoice", "42")
	v, _ := k.Int64()
	fmt.Println(k)
	fmt.Println(v == 6345862734762165923)
	// Output:
	// int64:6345862734762165923
	// true
}

func ExampleParseKey() {
	for _, s := range []string{"int64:-7", "pair:1,2", "42"} {
		k, err := pgcoord.ParseKey(s)
		fmt.Println(k, errors.Is(err, pgcoord.ErrInvalidKey))
	}
	// Output:
	// int64:-7 false
	// pair:1,2 false
	// invalid true
}

// Hold a lock for as long as a job runs; the job's context is cancelled if
// the lock is lost.
func ExampleClient_Do() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost/app")
	if err != nil {
		panic(err)
	}
	c, err := pgcoord.New(pool)
	if err != nil {
		panic(err)
	}
	defer c.Close()
	err = c.Do(ctx, pgcoord.HashKey("nightly-report"), func(ctx context.Context) error {
		return generateReport(ctx) // stop when ctx is done
	})
	if errors.Is(err, pgcoord.ErrLockLost) {
		fmt.Println("lost the lock while the report ran; it may be incomplete")
	}
}

// Lock two accounts inside a transaction, in canonical order, so opposite
// transfers never deadlock.
func ExampleInTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost/app")
	if err != nil {
		panic(err)
	}
	from, to := int64(1), int64(2)
	keys := []pgcoord.Key{pgcoord.HashKey("account", fmt.Sprint(from)), pgcoord.HashKey("account", fmt.Sprint(to))}
	err = pgcoord.InTx(ctx, pool, keys, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance - 10 WHERE id = $1", from); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + 10 WHERE id = $1", to)
		return err
	})
	if err != nil {
		panic(err)
	}
}

// A fenced lock protects the write itself: a holder that lost its lock
// while paused cannot write with its old fence.
func ExampleCheckFence() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost/app")
	if err != nil {
		panic(err)
	}
	if err := pgcoord.Migrate(ctx, pool); err != nil {
		panic(err)
	}
	c, err := pgcoord.New(pool)
	if err != nil {
		panic(err)
	}
	defer c.Close()
	job := pgcoord.HashKey("export", "daily")
	l, err := c.Lock(ctx, job, pgcoord.WithFence())
	if err != nil {
		panic(err)
	}
	defer l.Unlock(ctx)
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := pgcoord.CheckFence(ctx, tx, job, l.Fence()); err != nil {
			return err // ErrStaleFence: another holder exists; do not write
		}
		_, err := tx.Exec(ctx, "UPDATE exports SET done = true WHERE day = current_date")
		return err
	})
	if errors.Is(err, pgcoord.ErrStaleFence) {
		fmt.Println("superseded by a newer holder")
	}
}

func generateReport(ctx context.Context) error { return ctx.Err() }
