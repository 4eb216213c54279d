// Command leader shows leader election across processes: three candidate
// processes campaign for one election; the program shows who leads, kills
// the leader with SIGKILL several times and prints how long each takeover
// took (from the kill to the new leader's function starting), then asks
// the leader to step down from a process that is not a candidate, and
// terminates a leader's backend while its process lives.
//
// It reads DATABASE_URL; when that is unset it starts a throwaway PostgreSQL
// from the local binaries and removes it on exit.
//
//	go run ./examples/leader
package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/examples/internal/throwaway"
)

const (
	election  = "scheduler"
	roleEnv   = "PGCOORD_EXAMPLE_CANDIDATE"
	kills     = 7
	waitLimit = 30 * time.Second
)

func main() {
	var err error
	if name := os.Getenv(roleEnv); name != "" {
		err = candidate(name)
	} else {
		err = run()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "leader:", err)
		os.Exit(1)
	}
}

// candidate is one candidate process: it campaigns until its standard
// input closes, and reports on standard output when it starts and stops
// leading, with wall-clock times so the parent can measure takeovers.
func candidate(name string) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { // the parent closes our stdin (or dies): stop
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	c, err := pgcoord.Open(ctx, os.Getenv("DATABASE_URL"), pgcoord.WithApplicationName("candidate-"+name),
		pgcoord.WithHeartbeat(200*time.Millisecond), pgcoord.WithLossDeadline(2*time.Second))
	if err != nil {
		return err
	}
	defer c.Close()
	e := c.Election(election, pgcoord.WithIdentity(name))
	fmt.Println("ready")
	err = e.Run(ctx, func(ctx context.Context, term pgcoord.Term) error {
		fmt.Printf("lead %d %d\n", term, time.Now().UnixNano())
		<-ctx.Done()
		fmt.Printf("end %d %d %v\n", term, time.Now().UnixNano(), context.Cause(ctx))
		return nil
	})
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

// proc is a running candidate process.
type proc struct {
	name  string
	cmd   *exec.Cmd
	stdin io.WriteCloser
}

// event is a line from a candidate.
type event struct {
	name string
	kind string // ready, lead, end
	term int64
	at   time.Time
	text string
}

func run() error {
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	ctx, cancelTimeout := context.WithTimeout(ctx, 3*time.Minute)
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
	// The observer is not a candidate: it watches, and later asks the
	// leader to step down.
	obs, err := pgcoord.New(pool, pgcoord.WithApplicationName("observer"))
	if err != nil {
		return err
	}
	defer obs.Close()
	e := obs.Election(election)

	events := make(chan event, 64)
	var mu sync.Mutex
	procs := map[string]*proc{}
	start := func(name string) error {
		p, err := startCandidate(name, dsn, events)
		if err != nil {
			return err
		}
		mu.Lock()
		procs[name] = p
		mu.Unlock()
		return nil
	}
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		for _, p := range procs {
			_ = p.stdin.Close()
			_ = p.cmd.Wait()
		}
	}()
	next := func(kind string) (event, error) {
		timer := time.NewTimer(waitLimit)
		defer timer.Stop()
		for {
			select {
			case ev := <-events:
				if ev.kind == kind {
					return ev, nil
				}
			case <-timer.C:
				return event{}, fmt.Errorf("no %q from a candidate within %v", kind, waitLimit)
			case <-ctx.Done():
				return event{}, ctx.Err()
			}
		}
	}

	fmt.Println("\n1. three candidate processes campaign for election", strconv.Quote(election))
	for _, name := range []string{"pod-a", "pod-b", "pod-c"} {
		if err := start(name); err != nil {
			return err
		}
	}
	first, err := next("lead")
	if err != nil {
		return err
	}
	info, err := e.Leader(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("   %s leads, term %d (Leader(): identity %s, backend pid %d, since %s)\n",
		first.name, first.term, info.Identity, info.Pid, info.Since.Format(time.TimeOnly))

	fmt.Printf("\n2. kill -9 the leader's process, %d times, and time the takeover\n", kills)
	var takeovers []time.Duration
	for range kills {
		info, err := e.Leader(ctx)
		if err != nil {
			return err
		}
		mu.Lock()
		victim := procs[info.Identity]
		mu.Unlock()
		killedAt := time.Now()
		if err := victim.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			return err
		}
		ev, err := next("lead")
		if err != nil {
			return err
		}
		d := ev.at.Sub(killedAt)
		takeovers = append(takeovers, d)
		fmt.Printf("   killed %s (term %d): %s leads, term %d, after %v\n", info.Identity, info.Term, ev.name, ev.term, d.Round(10*time.Microsecond))
		_ = victim.cmd.Wait()
		if err := start(victim.name); err != nil { // it rejoins as a candidate
			return err
		}
		if _, err := next("ready"); err != nil {
			return err
		}
	}
	slices.Sort(takeovers)
	fmt.Printf("   takeover after kill -9: p50 %v, max %v\n", takeovers[len(takeovers)/2].Round(10*time.Microsecond),
		takeovers[len(takeovers)-1].Round(10*time.Microsecond))

	fmt.Println("\n3. the observer (not a candidate) asks the leader to step down")
	before, err := e.Leader(ctx)
	if err != nil {
		return err
	}
	if err := e.RequestResign(ctx); err != nil {
		return err
	}
	end, err := next("end")
	if err != nil {
		return err
	}
	ev, err := next("lead")
	if err != nil {
		return err
	}
	fmt.Printf("   %s stepped down (%s); %s leads, term %d > %d, %v later\n", end.name, end.text, ev.name, ev.term, before.Term,
		ev.at.Sub(end.at).Round(10*time.Microsecond))

	fmt.Println("\n4. an administrator terminates the leader's backend; its process lives on")
	before, err = e.Leader(ctx)
	if err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", before.Pid); err != nil {
		return err
	}
	end, err = next("end")
	if err != nil {
		return err
	}
	ev, err = next("lead")
	if err != nil {
		return err
	}
	fmt.Printf("   %s noticed and stopped leading (%s)\n", end.name, end.text)
	fmt.Printf("   %s leads, term %d, %v after the old leader stopped (never before)\n", ev.name, ev.term, ev.at.Sub(end.at).Round(10*time.Microsecond))
	fmt.Println("\ndone")
	return nil
}

// startCandidate runs this program again as a candidate and forwards its
// lines to events.
func startCandidate(name, dsn string, events chan<- event) (*proc, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), roleEnv+"="+name, "DATABASE_URL="+dsn)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			f := strings.SplitN(sc.Text(), " ", 4)
			ev := event{name: name, kind: f[0], at: time.Now()}
			if len(f) >= 3 {
				ev.term, _ = strconv.ParseInt(f[1], 10, 64)
				ns, _ := strconv.ParseInt(f[2], 10, 64)
				ev.at = time.Unix(0, ns)
			}
			if len(f) == 4 {
				ev.text = f[3]
			}
			events <- ev
		}
	}()
	return &proc{name: name, cmd: cmd, stdin: stdin}, nil
}
