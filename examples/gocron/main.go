// Command gocron shows gocron jobs on one instance of a fleet, with
// pgcoord instead of Redis or etcd: three scheduler processes run the same
// gocron scheduler with one job, every 200 ms, and an Elector from
// github.com/pgcoord/pgcoord/contrib/gocron, so only the scheduler of the
// process that leads the election runs it. The program kills the leading
// process with SIGKILL, twice, shows the job's runs moving to another
// process and how long the job paused, and checks that no two processes
// ever ran the job at the same time.
//
// It reads DATABASE_URL; when that is unset it starts a throwaway PostgreSQL
// from the local binaries and removes it on exit.
//
//	cd examples/gocron && go run .
package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/go-co-op/gocron/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	pgcoordgocron "github.com/pgcoord/pgcoord/contrib/gocron"
	"github.com/pgcoord/pgcoord/examples/internal/throwaway"
)

const (
	election  = "reports"
	roleEnv   = "PGCOORD_EXAMPLE_SCHEDULER"
	interval  = 200 * time.Millisecond
	kills     = 2
	waitLimit = 20 * time.Second
)

func init() {
	// Children get a parent-death signal, which the kernel sends when the
	// thread that started them exits: start them from this one.
	runtime.LockOSThread()
}

func main() {
	var err error
	if name := os.Getenv(roleEnv); name != "" {
		err = scheduler(name)
	} else {
		err = run()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "gocron:", err)
		os.Exit(1)
	}
}

// scheduler is one scheduler process. It runs the job while it leads, and
// prints a line "run <start> <end>" (Unix nanoseconds) after each run, until
// its standard input closes.
func scheduler(name string) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c, err := pgcoord.Open(ctx, os.Getenv("DATABASE_URL"), pgcoord.WithApplicationName("scheduler-"+name),
		pgcoord.WithHeartbeat(200*time.Millisecond), pgcoord.WithLossDeadline(2*time.Second))
	if err != nil {
		return err
	}
	defer c.Close(context.Background())
	el, err := pgcoordgocron.NewElector(ctx, c, election,
		pgcoordgocron.WithElectionOptions(pgcoord.WithIdentity(name)))
	if err != nil {
		return err
	}
	defer el.Close(context.Background())
	s, err := gocron.NewScheduler(gocron.WithDistributedElector(el))
	if err != nil {
		return err
	}
	_, err = s.NewJob(gocron.DurationJob(interval), gocron.NewTask(func() {
		start := time.Now()
		time.Sleep(20 * time.Millisecond) // the job's work
		fmt.Printf("run %d %d\n", start.UnixNano(), time.Now().UnixNano())
	}), gocron.WithName("send-reports"))
	if err != nil {
		return err
	}
	s.Start()
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin) // until the parent closes it, or dies
	return s.Shutdown()
}

// proc is a running scheduler process.
type proc struct {
	name  string
	cmd   *exec.Cmd
	stdin io.WriteCloser
	read  chan struct{} // closed when its standard output has been read to the end
}

// event is a line from a scheduler process.
type event struct {
	name       string
	kind       string // ready, run
	start, end time.Time
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
	obs, err := pgcoord.New(pool, pgcoord.WithApplicationName("observer"))
	if err != nil {
		return err
	}
	defer obs.Close(context.Background())
	e := obs.Election(election)

	events := make(chan event, 256)
	procs := map[string]*proc{}
	defer func() {
		for _, p := range procs {
			_ = p.stdin.Close()
			_ = p.cmd.Process.Kill() // a no-op for one that exited
			_ = p.cmd.Wait()
		}
	}()
	var runs []event
	// next returns the next run (recording it), or the next event of kind.
	next := func(want func(event) bool) (event, error) {
		timer := time.NewTimer(waitLimit)
		defer timer.Stop()
		for {
			select {
			case ev := <-events:
				if ev.kind == "run" {
					runs = append(runs, ev)
				}
				if want(ev) {
					return ev, nil
				}
			case <-timer.C:
				return event{}, fmt.Errorf("nothing expected from the schedulers within %v", waitLimit)
			case <-ctx.Done():
				return event{}, ctx.Err()
			}
		}
	}

	fmt.Printf("\n1. three scheduler processes, one job every %v, gocron.WithDistributedElector\n", interval)
	for _, name := range []string{"pod-a", "pod-b", "pod-c"} {
		p, err := startScheduler(name, dsn, events)
		if err != nil {
			return err
		}
		procs[name] = p
	}
	for range procs {
		if _, err := next(func(ev event) bool { return ev.kind == "ready" }); err != nil {
			return err
		}
	}
	var pauses []time.Duration
	for i := range kills + 1 {
		// Let the leader run the job a few times.
		first, err := next(func(ev event) bool { return ev.kind == "run" })
		if err != nil {
			return err
		}
		for n := 1; n < 5; {
			if _, err := next(func(ev event) bool { return ev.kind == "run" && ev.name == first.name }); err != nil {
				return err
			}
			n++
		}
		info, err := e.Leader(ctx)
		if err != nil {
			return err
		}
		fmt.Printf("   %s leads (term %d) and runs the job: %d runs so far\n", info.Identity, info.Term, count(runs, first.name))
		if i == kills {
			break
		}
		victim := procs[info.Identity]
		fmt.Printf("\n%d. kill -9 %s (pid %d)\n", i+2, victim.name, victim.cmd.Process.Pid)
		killedAt := time.Now()
		if err := victim.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			return err
		}
		ev, err := next(func(ev event) bool { return ev.kind == "run" && ev.name != victim.name })
		if err != nil {
			return err
		}
		last := lastRun(runs, victim.name)
		pause := ev.start.Sub(last.start)
		pauses = append(pauses, pause)
		fmt.Printf("   %s runs the job %v after the kill; %v between the last run start of %s and the first of %s\n",
			ev.name, ev.start.Sub(killedAt).Round(time.Millisecond), pause.Round(time.Millisecond), victim.name, ev.name)
		_ = victim.cmd.Wait()
		delete(procs, victim.name)
		// It comes back as a candidate; a later leader never runs the
		// job at once with anyone.
		p, err := startScheduler(victim.name, dsn, events)
		if err != nil {
			return err
		}
		procs[victim.name] = p
		if _, err := next(func(ev event) bool { return ev.kind == "ready" }); err != nil {
			return err
		}
	}

	// Stop the schedulers and take the runs they report meanwhile.
	for _, p := range procs {
		_ = p.stdin.Close()
	}
	timer := time.NewTimer(waitLimit)
	defer timer.Stop()
	for _, p := range procs {
		for done := false; !done; {
			select {
			case ev := <-events:
				if ev.kind == "run" {
					runs = append(runs, ev)
				}
			case <-p.read:
				done = true
			case <-timer.C:
				return fmt.Errorf("the schedulers did not stop within %v", waitLimit)
			}
		}
		_ = p.cmd.Wait()
	}
	for drained := false; !drained; {
		select {
		case ev := <-events:
			if ev.kind == "run" {
				runs = append(runs, ev)
			}
		default:
			drained = true
		}
	}

	fmt.Println("\nsummary")
	for _, n := range []string{"pod-a", "pod-b", "pod-c"} {
		fmt.Printf("   %s ran the job %d times\n", n, count(runs, n))
	}
	slices.SortFunc(runs, func(a, b event) int { return a.start.Compare(b.start) })
	overlaps := 0
	for i := 1; i < len(runs); i++ {
		if runs[i].name != runs[i-1].name && runs[i].start.Before(runs[i-1].end) {
			overlaps++
		}
	}
	fmt.Printf("   pauses of the job after each kill -9: %v (a run every %v: the takeover itself\n", roundAll(pauses), interval)
	fmt.Println("   takes milliseconds, the rest is the wait for the next tick)")
	fmt.Printf("   runs of two processes at the same time: %d\n", overlaps)
	if overlaps > 0 {
		return fmt.Errorf("%d overlapping runs", overlaps)
	}
	return nil
}

// count returns how many of runs are name's.
func count(runs []event, name string) int {
	n := 0
	for _, r := range runs {
		if r.name == name {
			n++
		}
	}
	return n
}

// lastRun returns the last run of name in runs.
func lastRun(runs []event, name string) event {
	var last event
	for _, r := range runs {
		if r.name == name && r.start.After(last.start) {
			last = r
		}
	}
	return last
}

func roundAll(ds []time.Duration) []time.Duration {
	out := make([]time.Duration, len(ds))
	for i, d := range ds {
		out[i] = d.Round(time.Millisecond)
	}
	return out
}

// startScheduler runs this program again as the scheduler called name and
// forwards its lines to events.
func startScheduler(name, dsn string, events chan<- event) (*proc, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), roleEnv+"="+name, "DATABASE_URL="+dsn)
	cmd.Stderr = os.Stderr
	dieWithParent(cmd)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	// A pipe of our own: Wait would close StdoutPipe's as the process
	// exits, maybe before its last lines are read.
	stdout, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd.Stdout = w
	err = cmd.Start()
	w.Close()
	if err != nil {
		stdout.Close()
		return nil, err
	}
	p := &proc{name: name, cmd: cmd, stdin: stdin, read: make(chan struct{})}
	go func() {
		defer close(p.read)
		defer stdout.Close()
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			ev := event{name: name, kind: f[0]}
			if len(f) == 3 {
				s, _ := strconv.ParseInt(f[1], 10, 64)
				e, _ := strconv.ParseInt(f[2], 10, 64)
				ev.start, ev.end = time.Unix(0, s), time.Unix(0, e)
			}
			events <- ev
		}
	}()
	return p, nil
}
