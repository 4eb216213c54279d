package pgcoordgocron_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"github.com/go-co-op/gocron/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	pgcoordgocron "github.com/pgcoord/pgcoord/contrib/gocron"
)

// The process tests run this test binary again as scheduler processes:
// roleEnv selects the role (roleElector or roleLocker), nameEnv names the
// process, dsnEnv is the database.
const (
	roleEnv = "PGCOORDGOCRON_TEST_ROLE"
	nameEnv = "PGCOORDGOCRON_TEST_NAME"
	dsnEnv  = "PGCOORDGOCRON_TEST_DATABASE_URL"

	roleElector = "elector"
	roleLocker  = "locker" // the Locker with a minimum hold
	roleTicks   = "ticks"  // the Locker with WithTicks(jobInterval)

	electionName = "scheduler"
	jobName      = "record"
	// jobInterval is the job's interval, in every scheduler.
	jobInterval = 100 * time.Millisecond
	// lockerHold is the Locker's minimum hold in the locker role: longer
	// than the splay between the three schedulers' timers, shorter than
	// the interval.
	lockerHold = 70 * time.Millisecond
)

// runsTable records every run of the job: which process ran it, the tick
// gocron scheduled it for, when the Locker was asked for its lock (locker
// roles), the number of the tick whose lock it took (ticks role), and
// when it started and ended by the server's clock.
const runsTable = `CREATE TABLE runs (
	id        bigserial PRIMARY KEY,
	role      text NOT NULL,
	proc      text NOT NULL,
	pid       int NOT NULL,
	tick      timestamptz,
	attempted timestamptz,
	tick_no   bigint,
	started   timestamptz NOT NULL,
	ended     timestamptz)`

// child is one scheduler process: a gocron scheduler with one job every
// jobInterval that records its runs, distributed by an Elector or by a
// Locker (role). It prints "ready" once the scheduler has started, and on
// a line "stop" (or the end of its input) shuts the scheduler down, closes
// the Elector or Locker, prints a line of stats (see stats) and returns.
func child(role string) error {
	dsn, name := os.Getenv(dsnEnv), os.Getenv(nameEnv)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	c, err := pgcoord.Open(ctx, dsn, pgcoord.WithApplicationName("gocron-"+name),
		pgcoord.WithHeartbeat(200*time.Millisecond), pgcoord.WithLossDeadline(2*time.Second))
	if err != nil {
		return err
	}
	defer c.Close(context.Background())

	rec := &recordingLocker{c: c}
	var opts []gocron.SchedulerOption
	var jobOpts []gocron.JobOption
	var closeDistributed func(context.Context) error
	switch role {
	case roleElector:
		el, err := pgcoordgocron.NewElector(ctx, c, electionName,
			pgcoordgocron.WithElectionOptions(pgcoord.WithIdentity(name)))
		if err != nil {
			return err
		}
		opts = append(opts, gocron.WithDistributedElector(el))
		closeDistributed = el.Close
	case roleLocker:
		if rec.lk, err = pgcoordgocron.NewLocker(c, pgcoordgocron.WithMinHold(lockerHold)); err != nil {
			return err
		}
		opts = append(opts, gocron.WithDistributedLocker(rec))
		closeDistributed = rec.lk.Close
	case roleTicks:
		if rec.lk, err = pgcoordgocron.NewLocker(c, pgcoordgocron.WithTicks(jobInterval)); err != nil {
			return err
		}
		opts = append(opts, gocron.WithDistributedLocker(rec))
		closeDistributed = rec.lk.Close
		// One run at a time in this process, so that the run reads the
		// tick of its own Lock.
		jobOpts = append(jobOpts, gocron.WithSingletonMode(gocron.LimitModeReschedule))
	default:
		return fmt.Errorf("unknown role %q", role)
	}
	s, err := gocron.NewScheduler(opts...)
	if err != nil {
		return err
	}
	var job gocron.Job
	run := func() {
		rctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		// The tick this run is for: gocron has scheduled the next one
		// before it calls the job.
		var tick, att *time.Time
		if next, err := job.NextRun(); err == nil && !next.IsZero() {
			t := next.Add(-jobInterval)
			tick = &t
		}
		if a := rec.attempted.Load(); a != 0 {
			t := time.Unix(0, a)
			att = &t
		}
		var tickNo *int64
		if n, ok := rec.lastTick(); ok {
			tickNo = &n
		}
		var id int64
		if err := pool.QueryRow(rctx, `INSERT INTO runs (role, proc, pid, tick, attempted, tick_no, started)
			VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp()) RETURNING id`,
			role, name, os.Getpid(), tick, att, tickNo).Scan(&id); err != nil {
			fmt.Fprintln(os.Stderr, "record start:", err)
			return
		}
		if _, err := pool.Exec(rctx, "SELECT pg_sleep(0.01)"); err != nil { // the job's work
			fmt.Fprintln(os.Stderr, "work:", err)
		}
		if _, err := pool.Exec(rctx, "UPDATE runs SET ended = clock_timestamp() WHERE id = $1", id); err != nil {
			fmt.Fprintln(os.Stderr, "record end:", err)
		}
	}
	// Every scheduler's ticks fall on the same multiples of the interval.
	start := time.Now().Truncate(jobInterval).Add(3 * jobInterval)
	job, err = s.NewJob(gocron.DurationJob(jobInterval), gocron.NewTask(run), append(jobOpts, gocron.WithName(jobName),
		gocron.WithStartAt(gocron.WithStartDateTime(start)))...)
	if err != nil {
		return err
	}
	s.Start()
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() && in.Text() != "stop" {
	}
	serr := s.Shutdown()
	cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer ccancel()
	if err := errors.Join(serr, closeDistributed(cctx)); err != nil {
		return err
	}
	st := stats{Skipped: int(rec.skipped.Load()), Late: int(rec.late.Load()),
		MaxLocks: int(rec.maxLocks.Load()), MaxBackends: int(rec.maxBackends.Load()), Locks: c.Stat().Locks}
	fmt.Println(st.String())
	return nil
}

// stats is what a scheduler process reports when it stops: the runs the
// Locker refused because a lock was held (Skipped) or the tick's window
// had passed (Late), the most live locks and shared backends its Client
// had at a call of Lock, and its live locks after the Locker's Close.
type stats struct {
	Skipped, Late, MaxLocks, MaxBackends, Locks int
}

const statsFormat = "stopped skipped=%d late=%d maxlocks=%d maxbackends=%d locks=%d"

func (s stats) String() string {
	return fmt.Sprintf(statsFormat, s.Skipped, s.Late, s.MaxLocks, s.MaxBackends, s.Locks)
}

func parseStats(line string) (stats, error) {
	var s stats
	_, err := fmt.Sscanf(line, statsFormat, &s.Skipped, &s.Late, &s.MaxLocks, &s.MaxBackends, &s.Locks)
	return s, err
}

// recordingLocker wraps the Locker: it counts the runs refused because a
// lock was held or the tick's window had passed, keeps the time just
// before each Lock that succeeded, which the job records as attempted,
// and the tick it locked, and samples the Client's Stat at each Lock. The
// Locker's hold counts from after that moment, so every later run starts
// at least the hold after it.
type recordingLocker struct {
	lk *pgcoordgocron.Locker
	c  *pgcoord.Client

	attempted, tick, ticked atomic.Int64
	skipped, late           atomic.Int64
	maxLocks, maxBackends   atomic.Int64
}

func (r *recordingLocker) Lock(ctx context.Context, key string) (gocron.Lock, error) {
	at := time.Now()
	l, err := r.lk.Lock(ctx, key)
	st := r.c.Stat()
	storeMax(&r.maxLocks, int64(st.Locks))
	storeMax(&r.maxBackends, int64(st.Backends))
	switch {
	case errors.Is(err, pgcoord.ErrLocked):
		r.skipped.Add(1)
		return nil, err
	case errors.Is(err, pgcoordgocron.ErrTickPassed):
		r.late.Add(1)
		return nil, err
	case err != nil:
		fmt.Fprintln(os.Stderr, "lock:", err)
		return nil, err
	}
	// Runs of one job in one process do not overlap (the job's lock in
	// the locker role, singleton mode in the ticks role), so the job
	// reads the time and tick of its own Lock.
	r.attempted.Store(at.UnixNano())
	if n, ok := l.(*pgcoordgocron.JobLock).Tick(); ok {
		r.tick.Store(n)
		r.ticked.Store(1)
	}
	return l, nil
}

// lastTick returns the tick of the last Lock that succeeded, if ticked.
func (r *recordingLocker) lastTick() (int64, bool) {
	return r.tick.Load(), r.ticked.Load() == 1
}

func storeMax(v *atomic.Int64, n int64) {
	for {
		old := v.Load()
		if n <= old || v.CompareAndSwap(old, n) {
			return
		}
	}
}
