// Command leader shows leader election across processes: three candidate
// processes campaign for one election; the program shows who leads, kills
// the leader with SIGKILL several times and prints how long each takeover
// took (from the kill to the new leader's function starting), next to the
// floor of the machine (the same kill of a process that holds a plain
// pg_advisory_lock), then asks the leader to step down from a process that
// is not a candidate, and terminates a leader's backend while its process
// lives.
//
// It reads DATABASE_URL; when that is unset it starts a throwaway PostgreSQL
// from the local binaries and removes it on exit.
//
//	go run ./examples/leader
package main

import (
	"bufio"
	"context"
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

	"github.com/jackc/pgx/v5"
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
	switch name := os.Getenv(roleEnv); name {
	case "":
		err = run()
	case rawHolderRole:
		err = rawHolder()
	default:
		err = candidate(name)
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
	defer c.Close(context.Background())
	e := c.Election(election, pgcoord.WithIdentity(name))
	fmt.Println("ready")
	err = e.Run(ctx, func(ctx context.Context, term pgcoord.Term) error {
		fmt.Printf("lead %d %d\n", term, time.Now().UnixNano())
		<-ctx.Done()
		fmt.Printf("end %d %d %v\n", term, time.Now().UnixNano(), context.Cause(ctx))
		return nil
	})
	// The parent asks a candidate to stop by closing its stdin, which
	// cancels ctx: whatever Run returns after that is the stop, not a
	// failure. Usually that is ctx's error; but when the stop comes while
	// this candidate is just taking over, Run can return the error of the
	// statement that the cancel interrupted (a cancelled statement, not
	// context.Canceled), so test ctx rather than the error.
	if ctx.Err() != nil {
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
	defer obs.Close(context.Background())
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
	// handover waits for a leader's "end" and the next leader's "lead".
	// They come from two processes through two pipes, so the "lead" line
	// can arrive first even though the new leader started after the old
	// one ended (the times in the lines say so).
	handover := func() (end, lead event, err error) {
		timer := time.NewTimer(waitLimit)
		defer timer.Stop()
		for end.kind == "" || lead.kind == "" {
			select {
			case ev := <-events:
				switch {
				case ev.kind == "end" && end.kind == "":
					end = ev
				case ev.kind == "lead" && lead.kind == "":
					lead = ev
				}
			case <-timer.C:
				return end, lead, fmt.Errorf("no leader ended and another started within %v", waitLimit)
			case <-ctx.Done():
				return end, lead, ctx.Err()
			}
		}
		return end, lead, nil
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
		first.name, first.term, info.Identity, info.PID, info.Since.Format(time.TimeOnly))

	fmt.Printf("\n2. kill -9 the leader's process, %d times, and time the takeover\n", kills)
	var takeovers []time.Duration
	leaderConns := 0 // the most connections a killed leader had
	for range kills {
		// Kill a leader in steady state: both followers wait for the lock.
		if err := awaitFollowers(ctx, obs, e.Key(), 2); err != nil {
			return err
		}
		info, err := e.Leader(ctx)
		if err != nil {
			return err
		}
		mu.Lock()
		victim := procs[info.Identity]
		mu.Unlock()
		var conns int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
			"candidate-"+victim.name).Scan(&conns); err != nil {
			return err
		}
		leaderConns = max(leaderConns, conns)
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

	fmt.Printf("\n3. the floor on this machine: the same kill without pgcoord, %d times\n", kills)
	fmt.Printf("   (a process with %d plain pgx connections, as many as a killed leader had, holds\n", leaderConns)
	fmt.Println("   pg_advisory_lock on one of them; another connection waits for the lock)")
	granted, plusOne, err := rawFloor(ctx, dsn, obs, leaderConns)
	if err != nil {
		return err
	}
	fmt.Printf("   lock granted after p50 %v; granted plus one round trip after p50 %v\n",
		granted[len(granted)/2].Round(10*time.Microsecond), plusOne[len(plusOne)/2].Round(10*time.Microsecond))
	fmt.Println("   (a new leader's fn starts one round trip after its grant: the term, the row and the")
	fmt.Println("   guard are taken in parallel. The server frees a killed process's locks only as its")
	fmt.Println("   backends exit, and on a small machine those exits compete for the CPU.)")

	fmt.Println("\n4. the observer (not a candidate) asks the leader to step down")
	before, err := e.Leader(ctx)
	if err != nil {
		return err
	}
	if err := e.RequestResign(ctx); err != nil {
		return err
	}
	end, ev, err := handover()
	if err != nil {
		return err
	}
	fmt.Printf("   %s stepped down (%s); %s leads, term %d > %d, %v later\n", end.name, end.text, ev.name, ev.term, before.Term,
		ev.at.Sub(end.at).Round(10*time.Microsecond))

	fmt.Println("\n5. an administrator terminates the leader's backend; its process lives on")
	before, err = e.Leader(ctx)
	if err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", before.PID); err != nil {
		return err
	}
	end, ev, err = handover()
	if err != nil {
		return err
	}
	fmt.Printf("   %s noticed and stopped leading (%s)\n", end.name, end.text)
	fmt.Printf("   %s leads, term %d, %v after the old leader stopped (never before)\n", ev.name, ev.term, ev.at.Sub(end.at).Round(10*time.Microsecond))
	fmt.Println("\ndone")
	return nil
}

// rawHolderRole is the role of a child process that holds rawKey with plain
// pgx, for the floor.
const (
	rawHolderRole = "raw-holder"
	connsEnv      = "PGCOORD_EXAMPLE_CONNS"
	rawKey        = 7331
)

// rawHolder opens the number of connections connsEnv says, takes rawKey on
// the first, reports "ready", and waits to be killed.
func rawHolder() error {
	ctx := context.Background()
	n, err := strconv.Atoi(os.Getenv(connsEnv))
	if err != nil || n < 1 {
		return fmt.Errorf("%s=%q: want a positive count", connsEnv, os.Getenv(connsEnv))
	}
	conns := make([]*pgx.Conn, n)
	for i := range conns {
		if conns[i], err = pgx.Connect(ctx, os.Getenv("DATABASE_URL")); err != nil {
			return err
		}
	}
	if _, err := conns[0].Exec(ctx, "SELECT pg_advisory_lock($1)", rawKey); err != nil {
		return err
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin) // until killed, or the parent is gone
	return nil
}

// rawFloor kills a rawHolder with conns connections kills times, each time
// while a connection of this process waits for rawKey, and returns, sorted,
// the times from the kill to the grant and to the end of one more round
// trip.
func rawFloor(ctx context.Context, dsn string, obs *pgcoord.Client, conns int) (granted, plusOne []time.Duration, err error) {
	waiter, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, nil, err
	}
	defer waiter.Close(context.Background())
	for range kills {
		cmd, stdin, stdout, err := startSelf(rawHolderRole, dsn, connsEnv+"="+strconv.Itoa(conns))
		if err != nil {
			return nil, nil, err
		}
		if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || line != "ready\n" {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			return nil, nil, fmt.Errorf("raw holder: %q, %v", line, err)
		}
		got := make(chan error, 1)
		var grant, trip time.Time
		go func() {
			_, err := waiter.Exec(ctx, "SELECT pg_advisory_lock($1)", rawKey)
			grant = time.Now()
			if err == nil {
				_, err = waiter.Exec(ctx, "SELECT 1")
			}
			trip = time.Now()
			got <- err
		}()
		err = awaitFollowers(ctx, obs, pgcoord.Int64Key(rawKey), 1)
		killedAt := time.Now()
		_ = cmd.Process.Signal(syscall.SIGKILL)
		_ = stdin.Close()
		_ = cmd.Wait()
		werr := <-got // the kill freed the lock, so the waiter is done
		if err != nil {
			return nil, nil, err
		}
		if werr != nil {
			return nil, nil, werr
		}
		granted = append(granted, grant.Sub(killedAt))
		plusOne = append(plusOne, trip.Sub(killedAt))
		if _, err := waiter.Exec(ctx, "SELECT pg_advisory_unlock($1)", rawKey); err != nil {
			return nil, nil, err
		}
	}
	slices.Sort(granted)
	slices.Sort(plusOne)
	return granted, plusOne, nil
}

// awaitFollowers returns once n candidates wait for the election's lock on
// the server, as pg_locks shows them through Client.Locks.
func awaitFollowers(ctx context.Context, c *pgcoord.Client, key pgcoord.Key, n int) error {
	deadline := time.Now().Add(waitLimit)
	for {
		locks, err := c.Locks(ctx)
		if err != nil {
			return err
		}
		waiting := 0
		for _, l := range locks {
			if l.Key == key && !l.Granted {
				waiting++
			}
		}
		if waiting >= n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d candidates wait for the election, not %d, after %v", waiting, n, waitLimit)
		}
		select {
		case <-time.After(5 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// startSelf runs this program again in role (see main), connected to dsn,
// with extra environment variables env. The child's standard error is
// ours; its standard input and output are returned.
func startSelf(role, dsn string, env ...string) (*exec.Cmd, io.WriteCloser, io.ReadCloser, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, nil, nil, err
	}
	cmd := exec.Command(self)
	cmd.Env = append(append(os.Environ(), roleEnv+"="+role, "DATABASE_URL="+dsn), env...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, nil, nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, nil, nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, nil, nil, err
	}
	return cmd, stdin, stdout, nil
}

// startCandidate runs this program again as a candidate and forwards its
// lines to events.
func startCandidate(name, dsn string, events chan<- event) (*proc, error) {
	cmd, stdin, stdout, err := startSelf(name, dsn)
	if err != nil {
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
