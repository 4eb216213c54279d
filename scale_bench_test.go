package pgcoord

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// Benchmarks of scale: a handoff between two Clients of one process, one
// key fought over by separate processes, and one Client holding very many
// keys. Each sits next to its raw pgx floor, which does the same work, so
// that a pinned run gives a ratio:
//
//	scripts/bench-pinned.sh 'HandoffClients|HandoffProcesses|Processes8|Contended8Processes'
//	COUNT=1 PGCOORD_BENCH_MANY_LOCKS=20000 scripts/bench-pinned.sh 'ManyLocks'
//
// The process and many-lock benchmarks time whole runs of seconds; run them
// with -benchtime=1x.

// BenchmarkHandoffClients measures handing a key to a waiter in another
// Client of the same process: two Clients, each with its own pool on the
// same database, pass one key back and forth, one holding it while the
// other waits for it:
//
//  1. Client A holds the key.
//  2. Untimed: B calls Lock in a goroutine, and the benchmark polls
//     pg_locks until B's backend waits for the key (not granted); see
//     awaitWaiter. Unlike BenchmarkHandoffRemote it does not wait for the
//     backend to go to sleep on the lock.
//  3. Timed: A calls Unlock, and the benchmark waits for B's Lock to return.
//  4. B is now the holder and A the waiter; go to 2.
//
// ns/op is the time of step 3, from the start of the holder's Unlock until
// both the holder's Unlock and the waiter's Lock have returned.
// waiter-p50-us and waiter-p90-us are the median and 90th percentile of
// the time from the start of the holder's Unlock to the waiter's Lock
// returning: the handoff as the waiter sees it. unlock-p50-us is the
// median of the holder's Unlock call alone, with the waiter queued. The
// floor is BenchmarkRawHandoffClients. At the end nobody holds or waits
// for the key. Fix the count:
//
//	go test -run '^$' -bench 'HandoffClients' -benchtime=200x .
func BenchmarkHandoffClients(b *testing.B) {
	clientsHandoff(b, false)
}

// BenchmarkRawHandoffClients is the floor of BenchmarkHandoffClients: the
// same protocol on two raw pgx connections of one process, the holder
// running SELECT pg_advisory_unlock($1) while the waiter is blocked in
// SELECT pg_advisory_lock($1), and the waiter counted as queued as soon as
// pg_locks shows its request not granted. ns/op, waiter-p50-us,
// waiter-p90-us and unlock-p50-us are as there.
func BenchmarkRawHandoffClients(b *testing.B) {
	rawHandoff(b, false)
}

// Child processes of the Processes8 benchmarks.
const (
	// contendModeEnv says what a "contend" child locks with: "client" (a
	// Client with default options) or "raw" (one pgx connection).
	contendModeEnv = "PGCOORD_CONTEND_MODE"
	// contendLead is how long after the parent sends "go" the counted
	// window opens, so that every child fights for the key by then.
	contendLead = 100 * time.Millisecond
	// contendWindow is how long each counted window lasts.
	contendWindow = 2 * time.Second
)

// BenchmarkContendedProcesses8 measures one key fought over by 8
// processes, as 8 instances of a service would: 8 child processes of the
// test binary (GOMAXPROCS=1 each, on the CPUs of the benchmark, whose
// affinity they inherit), each with one Client of default options and one
// goroutine looping Client.Lock + Lock.Unlock on Int64Key(42). Every op
// goes to the server, and the key passes between the children's backends
// there.
//
// What is timed: each child does contendWarmup ops and reports ready; the
// benchmark then sends every child the same window, opening 100 ms later
// (so that all 8 fight by then) and lasting 2 s, by this machine's wall
// clock. Each child loops from the "go" until an op completes after the
// window's end, and counts the ops that completed inside it. ns/op is the
// window divided by the ops of all children in it, the inverse of the
// throughput, which ops/s reports; min-child-ops is the fewest ops a child
// completed in a window (0 would be starvation). Each b.N iteration is
// one window, and the built-in ns/op is replaced; -benchtime=Nx takes N
// times 2.1 s, so run it once (the default -benchtime also stops after
// one):
//
//	go test -run '^$' -bench 'Processes8' -benchtime=1x .
//
// Its floor is BenchmarkRawContended8Processes. At the end every child
// closes its Client and exits, and nobody holds or waits for the key.
func BenchmarkContendedProcesses8(b *testing.B) {
	contendProcesses(b, "client")
}

// BenchmarkRawContended8Processes is the floor of
// BenchmarkContendedProcesses8: the same 8 processes and windows, each
// child with one raw pgx connection looping SELECT pg_advisory_lock($1) +
// SELECT pg_advisory_unlock($1) on key 42. Run it with -benchtime=1x.
func BenchmarkRawContended8Processes(b *testing.B) {
	contendProcesses(b, "raw")
}

// contendProcesses runs the Processes8 benchmarks with children of the
// given mode (see contendModeEnv).
func contendProcesses(b *testing.B, mode string) {
	dsn := pgtest.DB(b)
	k := Int64Key(42)
	procs := make([]*faultProc, contenders)
	for i := range procs {
		procs[i] = startFaultChild(b, "contend", dsn, lockTarget{"contend"}, "",
			contendModeEnv+"="+mode, "GOMAXPROCS=1")
	}
	for _, p := range procs {
		p.await(b, "ready", testTimeout)
	}

	var (
		total   int64
		windows int
		minOps  int64 = -1
	)
	for b.Loop() {
		open := time.Now().Add(contendLead)
		end := open.Add(contendWindow)
		for _, p := range procs {
			p.Send(b, fmt.Sprintf("go %d %d", open.UnixNano(), end.UnixNano()))
		}
		for _, p := range procs {
			f := p.await(b, "done", contendLead+contendWindow+testTimeout)
			n, err := strconv.ParseInt(f[len(f)-1], 10, 64)
			if err != nil || len(f) != 2 || n < 0 {
				b.Fatalf("child %d: bad line %q, want \"done COUNT\"", p.Pid(), strings.Join(f, " "))
			}
			total += n
			if minOps < 0 || n < minOps {
				minOps = n
			}
		}
		windows++
	}
	if total == 0 {
		b.Fatalf("no op completed in %d windows of %v", windows, contendWindow)
	}
	wall := time.Duration(windows) * contendWindow
	b.ReportMetric(float64(wall.Nanoseconds())/float64(total), "ns/op")
	b.ReportMetric(float64(total)/wall.Seconds(), "ops/s")
	b.ReportMetric(float64(minOps), "min-child-ops")

	for _, p := range procs {
		p.Send(b, "exit")
	}
	for _, p := range procs {
		select {
		case <-p.Exited():
		case <-time.After(testTimeout):
			b.Fatalf("child %d did not exit within %v of \"exit\"", p.Pid(), testTimeout)
		}
		if err := p.ExitErr(); err != nil {
			b.Fatalf("child %d: %v; stderr:\n%s", p.Pid(), err, p.Stderr())
		}
	}
	notHeld(b, dsn, k)
}

// runContendChild is a child of the Processes8 benchmarks. It opens one
// Client (PGCOORD_CONTEND_MODE=client, with the options of
// PGCOORD_FAULT_OPTS) or one pgx connection (raw) on PGCOORD_FAULT_DSN,
// does contendWarmup Lock+Unlock of key 42, and reports "ready". Then, on
// each command "go OPEN END" (Unix nanoseconds), it loops Lock+Unlock
// until an op completes at or after END, each op bounded by testTimeout,
// and reports "done COUNT", COUNT being the ops that completed in
// [OPEN, END). It returns on the command "exit" or at the end of its
// standard input, after closing its Client or connection.
func runContendChild(out *childOut) error {
	ctx := context.Background()
	const key = 42
	var op func(ctx context.Context) error
	switch mode := os.Getenv(contendModeEnv); mode {
	case "client":
		pool, c, _, err := childClient(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		defer c.Close(context.Background())
		op = func(ctx context.Context) error {
			l, err := c.Lock(ctx, Int64Key(key))
			if err != nil {
				return err
			}
			return l.Unlock(ctx)
		}
	case "raw":
		conn, err := pgx.Connect(ctx, os.Getenv(faultDSNEnv))
		if err != nil {
			return err
		}
		defer conn.Close(context.Background())
		op = func(ctx context.Context) error {
			if _, err := conn.Exec(ctx, rawLockSQL, int64(key)); err != nil {
				return err
			}
			return rawUnlock(ctx, conn, key)
		}
	default:
		return fmt.Errorf("%s=%q: want client or raw", contendModeEnv, mode)
	}
	timedOp := func() error {
		octx, cancel := context.WithTimeout(ctx, testTimeout)
		defer cancel()
		return op(octx)
	}

	for range contendWarmup {
		if err := timedOp(); err != nil {
			return err
		}
	}
	out.printf("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		switch {
		case len(f) == 1 && f[0] == "exit":
			return nil
		case len(f) == 3 && f[0] == "go":
			open, err1 := strconv.ParseInt(f[1], 10, 64)
			end, err2 := strconv.ParseInt(f[2], 10, 64)
			if err := errors.Join(err1, err2); err != nil {
				return fmt.Errorf("command %q: %w", in.Text(), err)
			}
			n := 0
			for {
				if err := timedOp(); err != nil {
					return err
				}
				now := time.Now().UnixNano()
				if now >= end {
					break
				}
				if now >= open {
					n++
				}
			}
			out.printf("done %d", n)
		default:
			return fmt.Errorf("unknown command %q: want \"go OPEN END\" or \"exit\"", in.Text())
		}
	}
	return in.Err()
}

// Many locks held at once by one holder.
const (
	// manyLocks is how many keys the ManyLocks benchmarks take;
	// manyLocksEnv overrides it.
	manyLocks    = 20000
	manyLocksEnv = "PGCOORD_BENCH_MANY_LOCKS"
	// manyLocksBase is the first of the keys, Int64Key(manyLocksBase+i)
	// for i in [0, n); the cycles use key 42, outside that range.
	manyLocksBase = 1 << 20
	// manyCycles is how many TryLock+Unlock cycles each cycle metric is
	// the median of.
	manyCycles = 200
)

// manyLocksCount returns n for the ManyLocks benchmarks: manyLocks, or the
// positive integer in PGCOORD_BENCH_MANY_LOCKS.
func manyLocksCount(b *testing.B) int {
	b.Helper()
	s := os.Getenv(manyLocksEnv)
	if s == "" {
		return manyLocks
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		b.Fatalf("%s=%q: want a positive number of keys, such as 2000", manyLocksEnv, s)
	}
	return n
}

// BenchmarkManyLocks measures one Client (default options) holding n
// distinct keys at once, n = 20,000 or PGCOORD_BENCH_MANY_LOCKS. Each
// iteration, from one goroutine:
//
//  1. 200 uncontended TryLock+Unlock cycles on key 42; cycle-none-us is
//     the median cycle.
//  2. Lock of Int64Key(2^20 + i) for i = 0 .. n-1, one after another;
//     take-s is the time of all n. backends is Client.Stat().Backends
//     then, and pg_locks must show exactly n of those keys granted.
//  3. 200 more cycles on key 42 while the n keys are held; cycle-held-us
//     is the median.
//  4. Unlock of the n locks, one after another; release-s is the time of
//     all n, and pg_locks must show none of the keys afterwards.
//
// total-s is take-s + release-s; the metrics are means (medians for the
// cycles) over the iterations, and ns/op is one whole iteration. The
// floor is BenchmarkRawManyLocks. An iteration takes seconds at n =
// 20,000, so run it once:
//
//	go test -run '^$' -bench 'ManyLocks' -benchtime=1x .
func BenchmarkManyLocks(b *testing.B) {
	manyLocksClient(b)
}

// BenchmarkManyLocksWide is BenchmarkManyLocks with
// WithSharedBackends(manyLocksWide): a Client allowed the connections it
// takes to keep a cycle next to 20,000 held keys within twice the cycle
// with none (up to manyLocksWide + DefaultMaxWaits - 1 = 15 of them hold
// keys, about 1,300 each). Run it with -benchtime=1x.
func BenchmarkManyLocksWide(b *testing.B) {
	manyLocksClient(b, WithSharedBackends(manyLocksWide))
}

// manyLocksWide is the WithSharedBackends of BenchmarkManyLocksWide.
const manyLocksWide = 12

// manyLocksClient runs the ManyLocks protocol with a Client of opts.
func manyLocksClient(b *testing.B, opts ...Option) {
	dsn := pgtest.DB(b)
	c := newTestClient(b, dsn, opts...)
	held := make([]*Lock, manyLocksCount(b))
	manyLocksBench(b, dsn, len(held), manySide{
		take: func(ctx context.Context, i int) error {
			l, err := c.Lock(ctx, Int64Key(manyLocksBase+int64(i)))
			held[i] = l
			return err
		},
		release: func(ctx context.Context, i int) error {
			err := held[i].Unlock(ctx)
			held[i] = nil
			return err
		},
		cycle: func(ctx context.Context) error {
			l, err := c.TryLock(ctx, Int64Key(42))
			if err != nil {
				return err
			}
			return l.Unlock(ctx)
		},
		backends: func() int { return c.Stat().Backends },
	})
}

// BenchmarkRawManyLocks is the floor of BenchmarkManyLocks: one raw pgx
// connection runs SELECT pg_advisory_lock($1) for each of the n keys, then
// SELECT pg_advisory_unlock($1) for each, and its cycles are SELECT
// pg_try_advisory_lock(42) + SELECT pg_advisory_unlock(42) on the same
// connection. backends is 1. Run it with -benchtime=1x.
func BenchmarkRawManyLocks(b *testing.B) {
	dsn := pgtest.DB(b)
	conn := pgtest.Conn(b, dsn)
	manyLocksBench(b, dsn, manyLocksCount(b), manySide{
		take: func(ctx context.Context, i int) error {
			_, err := conn.Exec(ctx, rawLockSQL, manyLocksBase+int64(i))
			return err
		},
		release: func(ctx context.Context, i int) error {
			return rawUnlock(ctx, conn, manyLocksBase+int64(i))
		},
		cycle: func(ctx context.Context) error {
			var ok bool
			if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1::int8)", int64(42)).Scan(&ok); err != nil {
				return err
			}
			if !ok {
				return errors.New("pg_try_advisory_lock(42): taken, want free")
			}
			return rawUnlock(ctx, conn, 42)
		},
		backends: func() int { return 1 },
	})
}

// manySide is what the ManyLocks benchmarks do with their holder: take and
// release the i-th key, one uncontended cycle on key 42, and how many
// backends it holds its locks on.
type manySide struct {
	take, release func(ctx context.Context, i int) error
	cycle         func(ctx context.Context) error
	backends      func() int
}

// manyLocksBench runs the iterations of the ManyLocks benchmarks with n
// keys and reports their metrics. Each iteration is bounded by testTimeout
// plus 10 ms per key. At the end nobody holds or waits for key 42.
func manyLocksBench(b *testing.B, dsn string, n int, side manySide) {
	obs := pgtest.Conn(b, dsn)
	first, last := int64(manyLocksBase), int64(manyLocksBase+n-1)
	var (
		take, release time.Duration
		none, held    []time.Duration
		backends      int
	)
	cycles := func(ctx context.Context, into *[]time.Duration) {
		for range manyCycles {
			start := time.Now()
			if err := side.cycle(ctx); err != nil {
				b.Fatalf("cycle on key 42: %v", err)
			}
			*into = append(*into, time.Since(start))
		}
	}
	iteration := func() {
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout+time.Duration(n)*10*time.Millisecond)
		defer cancel()
		cycles(ctx, &none)

		start := time.Now()
		for i := range n {
			if err := side.take(ctx, i); err != nil {
				b.Fatalf("take key %d of %d: %v", i, n, err)
			}
		}
		take += time.Since(start)
		backends = side.backends()
		if granted, rows := manyLocksRows(b, ctx, obs, first, last); granted != n || rows != n {
			b.Fatalf("pg_locks with all %d keys held: %d granted of %d rows, want %d granted", n, granted, rows, n)
		}
		cycles(ctx, &held)

		start = time.Now()
		for i := range n {
			if err := side.release(ctx, i); err != nil {
				b.Fatalf("release key %d of %d: %v", i, n, err)
			}
		}
		release += time.Since(start)
		if granted, rows := manyLocksRows(b, ctx, obs, first, last); rows != 0 {
			b.Fatalf("pg_locks after releasing all %d keys: %d rows (%d granted), want none", n, rows, granted)
		}
	}
	iterations := 0
	for b.Loop() {
		iteration()
		iterations++
	}
	slices.Sort(none)
	slices.Sort(held)
	perIter := func(d time.Duration) float64 { return d.Seconds() / float64(iterations) }
	b.ReportMetric(perIter(take), "take-s")
	b.ReportMetric(perIter(release), "release-s")
	b.ReportMetric(perIter(take+release), "total-s")
	b.ReportMetric(quantileMS(none, 0.5)*1e3, "cycle-none-us")
	b.ReportMetric(quantileMS(held, 0.5)*1e3, "cycle-held-us")
	b.ReportMetric(float64(backends), "backends")
	notHeld(b, dsn, Int64Key(42))
}

// manyLocksRows reads, in one query on conn, how many advisory locks of the
// bigint keys first..last in the current database pg_locks shows granted,
// and how many rows it has for them in all (granted or awaited).
func manyLocksRows(b *testing.B, ctx context.Context, conn *pgx.Conn, first, last int64) (granted, rows int) {
	b.Helper()
	err := conn.QueryRow(ctx, `
		SELECT count(*) FILTER (WHERE granted), count(*) FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 1
		  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND (classid::int8 << 32 | objid::int8) BETWEEN $1 AND $2`, first, last).Scan(&granted, &rows)
	if err != nil {
		b.Fatalf("read pg_locks: %v", err)
	}
	return granted, rows
}

// Child process of the HandoffProcesses benchmarks.
const (
	// handoffModeEnv says what a "handoff" child waits with: "client" (a
	// Client with default options) or "raw" (one pgx connection).
	handoffModeEnv = "PGCOORD_HANDOFF_MODE"
	// handoffKey is the key the HandoffProcesses benchmarks hand over,
	// as an Int64Key.
	handoffKey = 42
	// handoffWarmup is how many handoffs run untimed before the first
	// timed one, so that both connections, backends and prepared
	// statements are in place.
	handoffWarmup = 2
)

// BenchmarkHandoffProcesses measures handing a key to a waiter in another
// process, as between two instances of a service: the benchmark holds
// Int64Key(42) with a Client and hands it to a child process of the test
// binary (GOMAXPROCS=1, on the CPUs of the benchmark, whose affinity it
// inherits) that waits for it with a Client of its own; both Clients have
// default options. Each iteration:
//
//  1. Untimed: the benchmark holds the key and tells the child "lock"; the
//     child calls Client.Lock, and the benchmark polls pg_locks until the
//     child's request waits (not granted); see awaitWaiter.
//  2. Timed: the benchmark calls Lock.Unlock, and waits for the child to
//     report the time, by this machine's wall clock, at which its Lock
//     returned.
//  3. Untimed: the child unlocks when told to, and the benchmark takes the
//     key again.
//
// ns/op is the time of step 2 as b.Loop times it: from the start of the
// Unlock until the Unlock has returned and the benchmark has read the
// child's line, so it includes the pipe from the child. waiter-p50-us and
// waiter-p90-us are the median and 90th percentile of the time from the
// start of the Unlock to the child's Lock returning, by the child's
// report: the handoff as the waiter sees it, without the pipe. A report
// earlier than the Unlock fails the benchmark. unlock-p50-us is the
// median of the Unlock call alone, with the child queued. Two handoffs run
// untimed first. The floor is BenchmarkRawHandoffProcesses. At the end the
// child exits cleanly and nobody holds or waits for the key. Fix the
// count:
//
//	go test -run '^$' -bench 'HandoffProcesses' -benchtime=200x .
//
// or, pinned (the default -benchtime):
//
//	scripts/bench-pinned.sh 'HandoffProcesses'
func BenchmarkHandoffProcesses(b *testing.B) {
	dsn := pgtest.DB(b)
	c := newTestClient(b, dsn)
	var held *Lock
	handoffProcesses(b, dsn, "client",
		func(ctx context.Context) error {
			l, err := c.Lock(ctx, Int64Key(handoffKey))
			held = l
			return err
		},
		func(ctx context.Context) error {
			return held.Unlock(ctx)
		})
}

// BenchmarkRawHandoffProcesses is the floor of BenchmarkHandoffProcesses:
// the same protocol with one raw pgx connection on each side, the
// benchmark running SELECT pg_advisory_unlock($1) while the child is
// blocked in SELECT pg_advisory_lock($1), and the child counted as queued
// as soon as pg_locks shows its request not granted. ns/op,
// waiter-p50-us, waiter-p90-us and unlock-p50-us are as there.
func BenchmarkRawHandoffProcesses(b *testing.B) {
	dsn := pgtest.DB(b)
	conn := pgtest.Conn(b, dsn)
	handoffProcesses(b, dsn, "raw",
		func(ctx context.Context) error {
			_, err := conn.Exec(ctx, rawLockSQL, int64(handoffKey))
			return err
		},
		func(ctx context.Context) error {
			return rawUnlock(ctx, conn, handoffKey)
		})
}

// handoffProcesses runs the protocol of BenchmarkHandoffProcesses with a
// "handoff" child of the given mode (see handoffModeEnv), lock blocking
// until the benchmark holds the key and unlock releasing it, and reports
// its metrics. Every call and every wait for the child is bounded by
// testTimeout. At the end the child has exited and nobody holds or waits
// for the key.
func handoffProcesses(b *testing.B, dsn, mode string, lock, unlock func(ctx context.Context) error) {
	k := Int64Key(handoffKey)
	bounded := func(f func(context.Context) error) error {
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		return f(ctx)
	}
	p := startFaultChild(b, "handoff", dsn, lockTarget{"handoff"}, "",
		handoffModeEnv+"="+mode, "GOMAXPROCS=1")
	p.await(b, "ready", testTimeout)
	obs := pgtest.Conn(b, dsn)
	if err := bounded(lock); err != nil {
		b.Fatal(err)
	}

	var waited, gave []time.Duration
	// handoff does steps 1-3 with the benchmark holding k, and records
	// the times when record is set. The timer is stopped during steps 1
	// and 3, so b.Loop times only step 2 (and the loop's own overhead).
	handoff := func(record bool) {
		b.StopTimer()
		p.Send(b, "lock")
		awaitWaiter(b, obs, k, false)
		b.StartTimer()

		start := time.Now()
		if err := bounded(unlock); err != nil {
			b.Fatal(err)
		}
		unlocked := time.Since(start)
		f := p.await(b, "locked", testTimeout)
		b.StopTimer()
		ns, err := strconv.ParseInt(f[len(f)-1], 10, 64)
		if err != nil || len(f) != 2 {
			b.Fatalf("child %d: bad line %q, want \"locked UNIXNANO\"", p.Pid(), strings.Join(f, " "))
		}
		wait := time.Unix(0, ns).Sub(start)
		if wait < 0 {
			b.Fatalf("child %d: Lock returned %v before the Unlock started, want after", p.Pid(), -wait)
		}
		if record {
			waited = append(waited, wait)
			gave = append(gave, unlocked)
		}

		p.Send(b, "unlock")
		p.await(b, "unlocked", testTimeout)
		if err := bounded(lock); err != nil {
			b.Fatal(err)
		}
		b.StartTimer() // b.Loop must be called with the timer on
	}
	for range handoffWarmup {
		handoff(false)
	}
	for b.Loop() {
		handoff(true)
	}
	slices.Sort(waited)
	slices.Sort(gave)
	b.ReportMetric(quantileMS(waited, 0.5)*1e3, "waiter-p50-us")
	b.ReportMetric(quantileMS(waited, 0.9)*1e3, "waiter-p90-us")
	b.ReportMetric(quantileMS(gave, 0.5)*1e3, "unlock-p50-us")

	if err := bounded(unlock); err != nil {
		b.Fatal(err)
	}
	p.Send(b, "exit")
	select {
	case <-p.Exited():
	case <-time.After(testTimeout):
		b.Fatalf("child %d did not exit within %v of \"exit\"; stderr:\n%s", p.Pid(), testTimeout, p.Stderr())
	}
	if err := p.ExitErr(); err != nil {
		b.Fatalf("child %d: %v; stderr:\n%s", p.Pid(), err, p.Stderr())
	}
	notHeld(b, dsn, k)
}

// runHandoffChild is the child of the HandoffProcesses benchmarks. It opens
// one Client (PGCOORD_HANDOFF_MODE=client, with the options of
// PGCOORD_FAULT_OPTS) or one pgx connection (raw) on PGCOORD_FAULT_DSN and
// reports "ready". Then, on the command "lock", it waits for
// Int64Key(handoffKey) (Client.Lock or SELECT pg_advisory_lock($1)) and
// reports "locked UNIXNANO", the wall-clock time at which the wait
// returned; on "unlock" it releases the key and reports "unlocked". Each
// call is bounded by testTimeout. It returns on the command "exit" or at
// the end of its standard input, after closing its Client or connection.
func runHandoffChild(out *childOut) error {
	ctx := context.Background()
	var lock, unlock func(ctx context.Context) error
	switch mode := os.Getenv(handoffModeEnv); mode {
	case "client":
		pool, c, _, err := childClient(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		defer c.Close(context.Background())
		var held *Lock
		lock = func(ctx context.Context) error {
			l, err := c.Lock(ctx, Int64Key(handoffKey))
			held = l
			return err
		}
		unlock = func(ctx context.Context) error { return held.Unlock(ctx) }
	case "raw":
		conn, err := pgx.Connect(ctx, os.Getenv(faultDSNEnv))
		if err != nil {
			return err
		}
		defer conn.Close(context.Background())
		lock = func(ctx context.Context) error {
			_, err := conn.Exec(ctx, rawLockSQL, int64(handoffKey))
			return err
		}
		unlock = func(ctx context.Context) error { return rawUnlock(ctx, conn, handoffKey) }
	default:
		return fmt.Errorf("%s=%q: want client or raw", handoffModeEnv, mode)
	}
	bounded := func(f func(context.Context) error) error {
		ctx, cancel := context.WithTimeout(ctx, testTimeout)
		defer cancel()
		return f(ctx)
	}

	out.printf("ready")
	in := bufio.NewScanner(os.Stdin)
	held := false
	for in.Scan() {
		switch cmd := in.Text(); {
		case cmd == "exit":
			return nil
		case cmd == "lock" && !held:
			if err := bounded(lock); err != nil {
				return fmt.Errorf("lock: %w", err)
			}
			out.printf("locked %d", time.Now().UnixNano())
			held = true
		case cmd == "unlock" && held:
			if err := bounded(unlock); err != nil {
				return fmt.Errorf("unlock: %w", err)
			}
			out.printf("unlocked")
			held = false
		default:
			return fmt.Errorf("command %q with the key held=%v: want \"lock\" when not held, \"unlock\" when held, or \"exit\"", cmd, held)
		}
	}
	return in.Err()
}
