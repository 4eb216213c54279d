package pgcoord_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
)

// The examples read DATABASE_URL, as a program would. As tests they run
// against a throwaway database that example_helpers_test.go creates and
// sets DATABASE_URL to.

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

// Take a lock, do the work, release it. ctx bounds only the wait: the
// lock is held until Unlock or until it is lost, which Done reports.
func ExampleClient_Lock() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	c, err := pgcoord.New(pool)
	if err != nil {
		panic(err)
	}
	defer c.Close(context.Background())

	l, err := c.Lock(ctx, pgcoord.HashKey("report", "daily"))
	if err != nil {
		panic(err)
	}
	fmt.Println("holding", l.Key())
	select {
	case <-l.Done():
		fmt.Println("lost:", l.Err()) // wraps pgcoord.ErrLockLost
	default:
		fmt.Println("still held")
	}
	if err := l.Unlock(ctx); err != nil {
		panic(err)
	}
	fmt.Println("released")
	// Output:
	// holding int64:6223870854755599160
	// still held
	// released
}

// TryLock does not wait: another holder, in this process or any other,
// makes it fail with ErrLocked.
func ExampleClient_TryLock() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	worker1, err := pgcoord.New(pool)
	if err != nil {
		panic(err)
	}
	defer worker1.Close(context.Background())
	worker2, err := pgcoord.New(pool)
	if err != nil {
		panic(err)
	}
	defer worker2.Close(context.Background())

	job := pgcoord.HashKey("job", "reindex")
	l, err := worker1.TryLock(ctx, job)
	if err != nil {
		panic(err)
	}
	_, err = worker2.TryLock(ctx, job)
	fmt.Println("worker2:", errors.Is(err, pgcoord.ErrLocked), err)

	if err := l.Unlock(ctx); err != nil {
		panic(err)
	}
	l2, err := worker2.TryLock(ctx, job)
	fmt.Println("worker2 after the unlock:", err)
	_ = l2.Unlock(ctx)
	// Output:
	// worker2: true pgcoord: try lock int64:8563826410180472450: key is locked by another holder
	// worker2 after the unlock: <nil>
}

// Hold a lock for as long as a job runs; the job's context is cancelled if
// the lock is lost. With WithFence, the job finds its fencing token
// through LockFromContext.
func ExampleClient_Do() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if err := pgcoord.Migrate(ctx, pool); err != nil { // WithFence needs the fences table
		panic(err)
	}
	c, err := pgcoord.New(pool)
	if err != nil {
		panic(err)
	}
	defer c.Close(context.Background())

	for range 2 {
		err = c.Do(ctx, pgcoord.HashKey("nightly-report"), func(ctx context.Context) error {
			l, _ := pgcoord.LockFromContext(ctx)
			fmt.Println("generating the report with fence", l.Fence())
			return ctx.Err() // a real job stops when ctx is done
		}, pgcoord.WithFence())
		if errors.Is(err, pgcoord.ErrLockLost) {
			fmt.Println("lost the lock while the report ran; it may be incomplete")
		} else if err != nil {
			panic(err)
		}
	}
	// Output:
	// generating the report with fence 1
	// generating the report with fence 2
}

// LockAll takes several keys in one canonical order, all or none, so two
// callers that lock overlapping sets never deadlock.
func ExampleClient_LockAll() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	c, err := pgcoord.New(pool)
	if err != nil {
		panic(err)
	}
	defer c.Close(context.Background())

	l, err := c.LockAll(ctx, pgcoord.Int64Key(2), pgcoord.PairKey(1, 1), pgcoord.Int64Key(1), pgcoord.Int64Key(2))
	if err != nil {
		panic(err)
	}
	fmt.Println(l.Keys()) // deduplicated, in canonical order
	if err := l.Unlock(ctx); err != nil {
		panic(err)
	}
	// Output:
	// [int64:1 int64:2 pair:1,1]
}

// A transaction-level lock lives exactly as long as the transaction that
// took it, and works behind PgBouncer's transaction pooling.
func ExampleXactLock() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	invoice := pgcoord.HashKey("invoice", "42")
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := pgcoord.XactLock(ctx, tx, invoice); err != nil {
			return err
		}
		// Another transaction cannot take the key until this one ends.
		return pgx.BeginFunc(ctx, pool, func(other pgx.Tx) error {
			err := pgcoord.XactTryLock(ctx, other, invoice)
			fmt.Println("another transaction:", errors.Is(err, pgcoord.ErrLocked))
			return nil
		})
	})
	if err != nil {
		panic(err)
	}
	// Output:
	// another transaction: true
}

// Lock two accounts inside a transaction, in canonical order, so opposite
// transfers never deadlock.
func ExampleInTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, "CREATE TABLE accounts (id int PRIMARY KEY, balance int); INSERT INTO accounts VALUES (1, 100), (2, 100)"); err != nil {
		panic(err)
	}

	from, to := 1, 2
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
	var a, b int
	if err := pool.QueryRow(ctx, "SELECT (SELECT balance FROM accounts WHERE id = 1), (SELECT balance FROM accounts WHERE id = 2)").Scan(&a, &b); err != nil {
		panic(err)
	}
	fmt.Println(a, b)
	// Output:
	// 90 110
}

// A fenced lock protects the write itself: a holder that lost its lock
// while paused cannot write with its old fence.
func ExampleCheckFence() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if err := pgcoord.Migrate(ctx, pool); err != nil {
		panic(err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE exports (day date PRIMARY KEY, done bool)"); err != nil {
		panic(err)
	}
	c, err := pgcoord.New(pool)
	if err != nil {
		panic(err)
	}
	defer c.Close(context.Background())

	job := pgcoord.HashKey("export", "daily")
	write := func(fence pgcoord.Term) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if err := pgcoord.CheckFence(ctx, tx, job, fence); err != nil {
				return err // ErrStaleFence: another holder exists; do not write
			}
			_, err := tx.Exec(ctx, "INSERT INTO exports VALUES (current_date, true) ON CONFLICT (day) DO NOTHING")
			return err
		})
	}

	old, err := c.Lock(ctx, job, pgcoord.WithFence())
	if err != nil {
		panic(err)
	}
	oldFence := old.Fence()
	if err := old.Unlock(ctx); err != nil { // as if the lock had been lost
		panic(err)
	}
	l, err := c.Lock(ctx, job, pgcoord.WithFence())
	if err != nil {
		panic(err)
	}
	defer l.Unlock(ctx)

	fmt.Println("new holder:", write(l.Fence()))
	err = write(oldFence)
	fmt.Println("old holder:", errors.Is(err, pgcoord.ErrStaleFence))
	// Output:
	// new holder: <nil>
	// old holder: true
}

// Locks shows every holder and waiter of an advisory lock in the database,
// from any process, by name where one was given.
func ExampleClient_Locks() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	report, cache := pgcoord.HashKey("report"), pgcoord.HashKey("cache")
	c, err := pgcoord.New(pool, pgcoord.WithKeyNames(map[pgcoord.Key]string{report: "report", cache: "cache"}))
	if err != nil {
		panic(err)
	}
	defer c.Close(context.Background())

	l1, err := c.Lock(ctx, report)
	if err != nil {
		panic(err)
	}
	defer l1.Unlock(ctx)
	l2, err := c.RLock(ctx, cache)
	if err != nil {
		panic(err)
	}
	defer l2.Unlock(ctx)

	locks, err := c.Locks(ctx)
	if err != nil {
		panic(err)
	}
	for _, li := range locks {
		fmt.Println(li.Name, li.Mode, li.Granted, li.ApplicationName, li.PID != 0)
	}
	// Unordered output:
	// report exclusive true pgcoord true
	// cache shared true pgcoord true
}

func ExampleElection_Run() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if err := pgcoord.Migrate(ctx, pool); err != nil { // elections need the leaders table
		panic(err)
	}
	c, err := pgcoord.New(pool)
	if err != nil {
		panic(err)
	}
	defer c.Close(context.Background())

	e := c.Election("scheduler", pgcoord.WithIdentity("pod-a"))
	runCtx, stop := context.WithCancel(ctx)
	err = e.Run(runCtx, func(ctx context.Context, term pgcoord.Term) error {
		info, err := e.Leader(ctx)
		if err != nil {
			return err
		}
		fmt.Printf("%s leads with term %d\n", info.Identity, term)
		stop() // a real scheduler runs until ctx is done
		<-ctx.Done()
		return nil
	})
	fmt.Println("Run returned:", errors.Is(err, context.Canceled))
	_, err = e.Leader(ctx)
	fmt.Println("leader after Run:", err)
	// Output:
	// pod-a leads with term 1
	// Run returned: true
	// leader after Run: pgcoord: leader election "scheduler": no leader
}

// Open makes the pool itself, from a connection string, and checks that
// the server can hold session locks (a primary, reached without a
// transaction pooler); Close closes the pool too.
func ExampleOpen() {
	ctx := context.Background()
	c, err := pgcoord.Open(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err) // unreachable server, standby (ErrReadOnly), transaction pooler (ErrTransactionPooling), ...
	}
	defer c.Close(context.Background())

	l, err := c.TryLock(ctx, pgcoord.HashKey("open", "example"))
	if err != nil {
		panic(err)
	}
	fmt.Println("holding", l.Key())
	if err := l.Unlock(ctx); err != nil {
		panic(err)
	}
	// Output:
	// holding int64:8638469224066336235
}

// Readers share a key; a writer excludes them, and they exclude it.
func ExampleClient_RLock() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	readers, err := pgcoord.New(pool)
	if err != nil {
		panic(err)
	}
	defer readers.Close(context.Background())
	writer, err := pgcoord.New(pool)
	if err != nil {
		panic(err)
	}
	defer writer.Close(context.Background())

	config := pgcoord.HashKey("config")
	r1, err := readers.RLock(ctx, config)
	if err != nil {
		panic(err)
	}
	r2, err := readers.TryRLock(ctx, config) // a second reader joins
	fmt.Println("second reader:", err)
	_, err = writer.TryLock(ctx, config)
	fmt.Println("writer while read:", errors.Is(err, pgcoord.ErrLocked))

	for _, r := range []*pgcoord.Lock{r1, r2} {
		if err := r.Unlock(ctx); err != nil {
			panic(err)
		}
	}
	w, err := writer.TryLock(ctx, config)
	fmt.Println("writer after the readers:", err)
	if err := w.Unlock(ctx); err != nil {
		panic(err)
	}
	// Output:
	// second reader: <nil>
	// writer while read: true
	// writer after the readers: <nil>
}

// A Session is one connection of its own for many locks. Its locks end
// together with it: when it is closed, or lost (Done, Err).
func ExampleSession() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	c, err := pgcoord.New(pool)
	if err != nil {
		panic(err)
	}
	defer c.Close(context.Background())

	s, err := c.NewSession(ctx)
	if err != nil {
		panic(err)
	}
	a, err := s.Lock(ctx, pgcoord.Int64Key(1001))
	if err != nil {
		panic(err)
	}
	b, err := s.TryRLock(ctx, pgcoord.PairKey(7, 1))
	if err != nil {
		panic(err)
	}
	fmt.Println("holding", a.Key(), "and", b.Key(), "on one backend:", s.PID() != 0)

	if err := s.Close(ctx); err != nil { // frees every lock of the session
		panic(err)
	}
	<-a.Done()
	fmt.Println("after Close:", errors.Is(a.Err(), pgcoord.ErrClosed), errors.Is(b.Err(), pgcoord.ErrClosed))
	// Output:
	// holding int64:1001 and pair:7,1 on one backend: true
	// after Close: true true
}

// A semaphore lets at most limit holders in at once, across every process.
func ExampleSemaphore() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if err := pgcoord.Migrate(ctx, pool); err != nil { // semaphores need their tables
		panic(err)
	}
	c, err := pgcoord.New(pool)
	if err != nil {
		panic(err)
	}
	defer c.Close(context.Background())

	sem := c.Semaphore("exports", 2, pgcoord.WithIdentity("worker-1"))
	p1, err := sem.Acquire(ctx) // waits in line while 2 permits are held
	if err != nil {
		panic(err)
	}
	p2, err := sem.Acquire(ctx)
	if err != nil {
		panic(err)
	}
	_, err = sem.TryAcquire(ctx)
	fmt.Println("third:", errors.Is(err, pgcoord.ErrNoPermit))
	hs, err := sem.Holders(ctx)
	if err != nil {
		panic(err)
	}
	for _, h := range hs {
		fmt.Println("held by", h.Identity)
	}

	for _, p := range []*pgcoord.Permit{p1, p2} {
		if err := p.Release(ctx); err != nil {
			panic(err)
		}
	}
	p3, err := sem.TryAcquire(ctx)
	fmt.Println("after the releases:", err)
	_ = p3.Release(ctx)
	// Output:
	// third: true
	// held by worker-1
	// held by worker-1
	// after the releases: <nil>
}

// Observe delivers the election's leaders as they change: first the
// current one (the zero LeaderInfo when nobody leads), then each change.
func ExampleElection_Observe() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if err := pgcoord.Migrate(ctx, pool); err != nil { // elections need the leaders table
		panic(err)
	}
	c, err := pgcoord.New(pool)
	if err != nil {
		panic(err)
	}
	defer c.Close(context.Background())

	e := c.Election("reports", pgcoord.WithIdentity("pod-b"))
	observeCtx, stop := context.WithCancel(ctx)
	defer stop()
	changes := e.Observe(observeCtx)
	show := func(info pgcoord.LeaderInfo) {
		if info.Identity == "" {
			fmt.Println("no leader")
			return
		}
		fmt.Printf("%s leads, term %d\n", info.Identity, info.Term)
	}

	show(<-changes)
	ld, err := e.Campaign(ctx)
	if err != nil {
		panic(err)
	}
	show(<-changes)
	if err := ld.Resign(ctx); err != nil {
		panic(err)
	}
	show(<-changes)
	// Output:
	// no leader
	// pod-b leads, term 1
	// no leader
}

// Migrations returns the SQL files that Migrate applies, for a migration
// tool of the application's own.
func ExampleMigrations() {
	ups, err := fs.Glob(pgcoord.Migrations(), "*.up.sql")
	if err != nil {
		panic(err)
	}
	for _, name := range ups {
		fmt.Println(name)
	}
	// Output:
	// 000001_fences.up.sql
	// 000002_leaders.up.sql
	// 000003_semaphores.up.sql
	// 000004_resign_requests.up.sql
	// 000005_leader_handover.up.sql
	// 000006_semaphore_await.up.sql
}
