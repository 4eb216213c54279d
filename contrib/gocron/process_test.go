package pgcoordgocron_test

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	pgcoordgocron "github.com/pgcoord/pgcoord/contrib/gocron"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// kid is a scheduler process started by a process test.
type kid struct {
	name string
	p    *pgtest.Process
}

// startKids starts n scheduler processes in role (see child), this test
// binary run again. pgtest.StartProcess gives each a parent-death signal
// (SIGKILL) and kills and reaps it in t.Cleanup, whatever way the test
// ends. It returns once every process has said "ready".
func startKids(t *testing.T, dsn, role string, n int) []*kid {
	t.Helper()
	kids := make([]*kid, n)
	for i := range kids {
		name := fmt.Sprintf("%s-%d", role, i)
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), roleEnv+"="+role, nameEnv+"="+name, dsnEnv+"="+dsn)
		kids[i] = &kid{name: name, p: pgtest.StartProcess(t, cmd)}
	}
	for _, k := range kids {
		k.await(t, "ready")
	}
	return kids
}

// await returns the first line of the process that starts with prefix.
func (k *kid) await(t *testing.T, prefix string) string {
	t.Helper()
	timer := time.NewTimer(testTimeout)
	defer timer.Stop()
	for {
		select {
		case line, ok := <-k.p.Lines():
			if !ok {
				t.Fatalf("%s ended its output before %q: %v\n%s", k.name, prefix, k.p.ExitErr(), k.p.Stderr())
			}
			if strings.HasPrefix(line, prefix) {
				return line
			}
		case <-timer.C:
			t.Fatalf("no %q from %s within %v\n%s", prefix, k.name, testTimeout, k.p.Stderr())
		}
	}
}

// stop asks the process to shut its scheduler down and waits until it
// has exited cleanly. It returns the stats the process reports.
func (k *kid) stop(t *testing.T) stats {
	t.Helper()
	k.p.Send(t, "stop")
	line := k.await(t, "stopped")
	st, err := parseStats(line)
	if err != nil {
		t.Fatalf("%s: %q: %v", k.name, line, err)
	}
	select {
	case <-k.p.Exited():
	case <-time.After(testTimeout):
		t.Fatalf("%s did not exit within %v of stopping", k.name, testTimeout)
	}
	if err := k.p.ExitErr(); err != nil {
		t.Fatalf("%s: %v\n%s", k.name, err, k.p.Stderr())
	}
	return st
}

// run is a row of the runs table.
type run struct {
	ID              int64
	Proc            string
	Tick, Attempted *time.Time
	TickNo          *int64
	Started         time.Time
	Ended           *time.Time
}

func createRuns(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	if _, err := pool.Exec(ctxT(t), runsTable); err != nil {
		t.Fatal(err)
	}
}

// readRuns returns every run, by start.
func readRuns(t *testing.T, pool *pgxpool.Pool) []run {
	t.Helper()
	rows, err := pool.Query(ctxT(t), "SELECT id, proc, tick, attempted, tick_no, started, ended FROM runs ORDER BY started, id")
	if err != nil {
		t.Fatal(err)
	}
	runs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[run])
	if err != nil {
		t.Fatal(err)
	}
	return runs
}

// serverNow reads the server's clock_timestamp().
func serverNow(t *testing.T, pool *pgxpool.Pool) time.Time {
	t.Helper()
	var now time.Time
	if err := pool.QueryRow(ctxT(t), "SELECT clock_timestamp()").Scan(&now); err != nil {
		t.Fatal(err)
	}
	return now
}

// count runs a count(*) query.
func count(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(ctxT(t), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestElectorProcesses: three scheduler processes with an Elector each,
// one job every 100 ms recording its runs. Read back from the runs table:
// before the kill only the leader ran; the runs of different processes
// never overlap; after the leader's kill -9, runs move to one other
// process, and the gap between the last run start of the killed process
// and the first run start of the next one is under one second (logged).
func TestElectorProcesses(t *testing.T) {
	dsn, pool := migrated(t)
	createRuns(t, pool)
	kids := startKids(t, dsn, roleElector, 3)
	byName := map[string]*kid{}
	for _, k := range kids {
		byName[k.name] = k
	}
	obs := newClient(t, dsn, "observer")
	e := obs.Election(electionName)

	// Steady state: a leader that runs the job, and both other candidates
	// waiting for the election's lock on the server.
	var leader *kid
	pgtest.Eventually(t, testTimeout, "a leader with runs and two waiting candidates", func() bool {
		info, err := e.Leader(ctxT(t))
		if err != nil {
			return false
		}
		waiting := 0
		for _, l := range keyLocks(t, dsn, e.Key()) {
			if !l.Granted {
				waiting++
			}
		}
		leader = byName[info.Identity]
		return leader != nil && waiting == 2 && count(t, pool, "SELECT count(*) FROM runs WHERE proc = $1", info.Identity) >= 5
	})
	killAt := serverNow(t, pool)
	leader.p.Kill(t)
	pgtest.Eventually(t, testTimeout, "runs of another process after the kill", func() bool {
		return count(t, pool, "SELECT count(*) FROM runs WHERE proc <> $1 AND started > $2", leader.name, killAt) >= 5
	})
	// Stop the follower first, so that no third leader runs the job when
	// the new leader resigns as it stops.
	var next *kid
	info, err := e.Leader(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range kids {
		if k != leader && k.name != info.Identity {
			k.stop(t)
		}
	}
	next = byName[info.Identity]
	next.stop(t)

	runs := readRuns(t, pool)
	var lastKilled time.Time // the last moment the killed process recorded
	var firstNext *run
	for i := range runs {
		r := &runs[i]
		switch {
		case r.Started.Before(killAt) && r.Proc != leader.name:
			t.Errorf("run %d of %s started at %v, before the kill, while %s led", r.ID, r.Proc, r.Started, leader.name)
		case r.Proc == leader.name:
			lastKilled = later(lastKilled, r.Started)
			if r.Ended != nil {
				lastKilled = later(lastKilled, *r.Ended)
			}
		case r.Proc != next.name:
			t.Errorf("run %d of %s: after the kill only %s led, and it stopped last", r.ID, r.Proc, next.name)
		case firstNext == nil:
			firstNext = r
		}
	}
	if firstNext == nil {
		t.Fatal("no run after the kill")
	}
	if !firstNext.Started.After(killAt) || !firstNext.Started.After(lastKilled) {
		t.Errorf("first run of %s started at %v, not after the kill (%v) and the killed leader's last record (%v)",
			next.name, firstNext.Started, killAt, lastKilled)
	}
	var lastStartKilled time.Time
	for _, r := range runs {
		if r.Proc == leader.name {
			lastStartKilled = r.Started
		}
	}
	// Runs of different processes never overlap. A run without an end is
	// the killed leader's last: checked above against the next leader.
	for i, r := range runs {
		if r.Ended == nil {
			if r.Proc != leader.name || r.Started != lastStartKilled {
				t.Errorf("run %d of %s has no end", r.ID, r.Proc)
			}
			continue
		}
		for _, s := range runs[i+1:] {
			if s.Proc != r.Proc && s.Started.Before(*r.Ended) {
				t.Errorf("run %d of %s [%v, %v] overlaps run %d of %s starting %v", r.ID, r.Proc, r.Started, *r.Ended, s.ID, s.Proc, s.Started)
			}
		}
	}
	gap := firstNext.Started.Sub(lastStartKilled)
	t.Logf("%d runs; leader %s killed; %s ran next: pause between their run starts %v (kill to first run %v)",
		len(runs), leader.name, next.name, gap.Round(time.Millisecond), firstNext.Started.Sub(killAt).Round(time.Millisecond))
	if gap >= time.Second {
		t.Errorf("the runs moved to %s %v after the killed leader's last run start, want under 1s", next.name, gap)
	}
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// TestLockerProcesses: three scheduler processes with the Locker and no
// Elector, one job every 100 ms on the same tick grid (a common start),
// minimum hold 70 ms. Read back from the runs table:
//   - the lock is held the minimum hold, exactly: every run starts (server
//     clock) at or after the end of the previous run, and at least 70 ms
//     after the moment the previous run's Lock was called (the Locker
//     counts the hold from after that moment, and the next run, in any
//     process, cannot start before the release);
//   - the job kept running: at least a third of the ticks while all
//     three ran have a run, and the schedulers did contend (the Locker
//     refused at least one attempt per two runs).
//
// A minimum hold does not make each tick run exactly once: a scheduler
// that calls Lock more than the hold after another, for the same tick,
// runs it again (see WithMinHold). TestLockerTickProcesses asserts
// exactly once for WithTicks.
func TestLockerProcesses(t *testing.T) {
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	createRuns(t, pool)
	kids := startKids(t, dsn, roleLocker, 3)
	from := serverNow(t, pool)
	pgtest.Eventually(t, testTimeout, "30 runs", func() bool {
		return count(t, pool, "SELECT count(*) FROM runs WHERE started > $1", from) >= 30
	})
	to := serverNow(t, pool)
	skipped := 0
	perKid := map[string]int{}
	for _, k := range kids {
		perKid[k.name] = k.stop(t).Skipped
		skipped += perKid[k.name]
	}

	runs := readRuns(t, pool)
	perProc := map[string]int{}
	inWindow := 0
	minGap := time.Duration(1<<63 - 1)
	for i, r := range runs {
		perProc[r.Proc]++
		if r.Attempted == nil || r.Ended == nil {
			t.Errorf("run %d of %s lacks its lock time or end: %+v", r.ID, r.Proc, r)
			continue
		}
		if !r.Started.Before(from) && r.Started.Before(to) {
			inWindow++
		}
		if i == 0 {
			continue
		}
		p := runs[i-1]
		if p.Ended == nil || p.Attempted == nil {
			continue // reported above
		}
		if r.Started.Before(*p.Ended) {
			t.Errorf("run %d of %s started at %v, before run %d of %s ended at %v", r.ID, r.Proc, r.Started, p.ID, p.Proc, *p.Ended)
		}
		if d := r.Started.Sub(*p.Attempted); d < lockerHold {
			t.Errorf("run %d of %s started %v after run %d of %s called Lock, within the minimum hold %v", r.ID, r.Proc, d, p.ID, p.Proc, lockerHold)
		}
		minGap = min(minGap, r.Started.Sub(p.Started))
	}
	window := int(to.Sub(from) / jobInterval)
	t.Logf("%d runs (per process %v), %d of the %d ticks while all ran; %d attempts refused (per process %v); shortest gap between run starts %v",
		len(runs), perProc, inWindow, window, skipped, perKid, minGap.Round(100*time.Microsecond))
	if inWindow*3 < window {
		t.Errorf("only %d of %d ticks ran", inWindow, window)
	}
	if skipped*2 < len(runs) {
		t.Errorf("the Locker refused %d attempts for %d runs: the schedulers did not contend", skipped, len(runs))
	}
}

// tickRuns is how many runs TestLockerTickProcesses waits for: long
// enough for the locks of many ticks to come and go.
const tickRuns = 80

// TestLockerTickProcesses: three scheduler processes with the Locker in
// tick mode (WithTicks(100ms)) and no Elector, one job every 100 ms
// aligned to the epoch. Each run records the tick number it locked and
// its start and end by the server's clock. Read back from the runs table:
//   - exactly once: no tick number has two runs;
//   - runs never overlap, in any process;
//   - coverage: of the ticks from the first recorded to the last, at
//     least 90% ran. A tick is lost only when every scheduler called Lock
//     for it more than 50 ms (half the interval) late, or got its lock
//     only after its window: three processes all that late at once happens
//     only when the machine stalls them together (a loaded 2-core machine
//     running the race detector does, for a few ticks in a run); a Locker
//     that skipped ticks for any other reason (holds that block the next
//     tick, lost keys) would lose far more than 10%;
//   - the schedulers contended (at least one refusal per two runs);
//   - the locks stay bounded: sampled in pg_locks all along, at most 4
//     tick locks and the job's lock are held at once, all keys of this
//     job. A tick's lock is held from its first call of Lock, up to 50 ms
//     before the tick, until 150 ms after that call, and the call may be
//     up to 50 ms late: 250 ms, so up to three ticks are held at once, plus
//     one taken past its window and being given back. Each process's
//     Client had at most 4 live locks (three recent ticks it ran and the
//     job's lock) and its usual shared backends at any Lock, and none
//     after the Locker's Close.
func TestLockerTickProcesses(t *testing.T) {
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	createRuns(t, pool)
	kids := startKids(t, dsn, roleTicks, 3)
	from := serverNow(t, pool)
	keys := map[pgcoord.Key]bool{} // every advisory key seen in pg_locks
	maxHeld, samples := 0, 0
	pgtest.Eventually(t, 2*testTimeout, fmt.Sprintf("%d runs", tickRuns), func() bool {
		held := 0
		for _, l := range pgtest.AdvisoryLocks(t, dsn) {
			if l.Granted {
				held++
			}
			k, err := pgcoord.KeyFromLock(l.ClassID, l.ObjID, l.ObjSubID)
			if err != nil {
				t.Fatal(err)
			}
			keys[k] = true
		}
		maxHeld = max(maxHeld, held)
		samples++
		return count(t, pool, "SELECT count(*) FROM runs WHERE started > $1", from) >= tickRuns
	})
	var total stats
	perKid := map[string]string{}
	for _, k := range kids {
		st := k.stop(t)
		perKid[k.name] = fmt.Sprintf("%d held/%d late/max %d locks", st.Skipped, st.Late, st.MaxLocks)
		total.Skipped += st.Skipped
		total.Late += st.Late
		if st.MaxLocks > 4 || st.MaxBackends > pgcoord.DefaultSharedBackends || st.Locks != 0 {
			t.Errorf("%s: %+v; want at most 4 live locks, at most %d backends, and no lock after Close",
				k.name, st, pgcoord.DefaultSharedBackends)
		}
	}

	runs := readRuns(t, pool)
	byTick := map[int64]run{}
	perProc := map[string]int{}
	first, last := int64(1<<63-1), int64(-1<<63)
	offGrid := 0 // runs of a tick other than the one gocron scheduled
	var lastEnd *run
	for _, r := range runs {
		perProc[r.Proc]++
		if r.TickNo == nil || r.Ended == nil {
			t.Errorf("run %d of %s lacks its tick number or end: %+v", r.ID, r.Proc, r)
			continue
		}
		n := *r.TickNo
		if prev, dup := byTick[n]; dup {
			t.Errorf("tick %d ran twice: run %d of %s [%v, %v] and run %d of %s [%v, %v]", n,
				prev.ID, prev.Proc, prev.Started, *prev.Ended, r.ID, r.Proc, r.Started, *r.Ended)
		}
		byTick[n] = r
		first, last = min(first, n), max(last, n)
		if r.Tick != nil && r.Tick.UnixNano() != n*int64(jobInterval) {
			offGrid++
		}
		// Sorted by start: each run starts after every earlier one ended.
		if lastEnd != nil && r.Started.Before(*lastEnd.Ended) {
			t.Errorf("run %d of %s (tick %d) started at %v, before run %d of %s (tick %d) ended at %v",
				r.ID, r.Proc, n, r.Started, lastEnd.ID, lastEnd.Proc, *lastEnd.TickNo, *lastEnd.Ended)
		}
		if lastEnd == nil || r.Ended.After(*lastEnd.Ended) {
			lastEnd = &r
		}
	}
	if len(byTick) == 0 {
		t.Fatal("no run recorded its tick")
	}
	span := last - first + 1
	coverage := float64(len(byTick)) / float64(span)
	t.Logf("%d runs (per process %v) of %d distinct ticks, %d ticks from the first to the last: coverage %.1f%%; duplicates %d; "+
		"attempts refused: %d held, %d past their window (per process %v); runs of another tick than gocron's scheduled one: %d; "+
		"pg_locks: at most %d advisory locks held in %d samples",
		len(runs), perProc, len(byTick), span, 100*coverage, len(runs)-len(byTick),
		total.Skipped, total.Late, perKid, offGrid, maxHeld, samples)
	if coverage < 0.9 {
		t.Errorf("only %d of the %d ticks from %d to %d ran (%.1f%%), want at least 90%%", len(byTick), span, first, last, 100*coverage)
	}
	if total.Skipped*2 < len(runs) {
		t.Errorf("the Locker refused %d attempts for %d runs: the schedulers did not contend", total.Skipped, len(runs))
	}
	if maxHeld > 5 {
		t.Errorf("up to %d advisory locks held at once, want at most 5 (4 ticks and the job's lock)", maxHeld)
	}
	lk := keyLocker(t, pgcoordgocron.WithTicks(jobInterval))
	ours := map[pgcoord.Key]bool{lk.Key(jobName): true}
	for n := first - 50; n <= last+50; n++ {
		ours[lk.TickKey(jobName, n)] = true
	}
	for k := range keys {
		if !ours[k] {
			t.Errorf("pg_locks showed key %v, neither the job's nor one of its ticks %d..%d", k, first-50, last+50)
		}
	}
}
