package pgcoord

// The fault-injection suite: scenarios in which a process, a backend, the
// network or the server fails while locks are held, each checked through
// PostgreSQL (pg_locks, pg_stat_activity and a table of fenced writes).
// RELIABILITY.md lists every promise, its bound, and the test that proves
// it. The scenarios are written against faultTarget, the thing contended
// for, so that an election or a semaphore can be put through the same
// faults by adding a target.
//
// Some scenarios need a holder that is a real process, so that it can be
// killed or stopped: the test binary runs itself again with
// PGCOORD_FAULT_CHILD set, and TestMain hands such a run to faultChildMain
// instead of running tests.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// Environment of a child process of the fault tests.
const (
	faultChildEnv  = "PGCOORD_FAULT_CHILD"  // the child's role: "holder", "candidate", "soak" or "lockcore"
	faultDSNEnv    = "PGCOORD_FAULT_DSN"    // the database
	faultTargetEnv = "PGCOORD_FAULT_TARGET" // what to hold, as faultTarget.String gives it
	faultOptsEnv   = "PGCOORD_FAULT_OPTS"   // Client options, as "loss=5s,beat=1s"
)

// A faultTarget is what the fault scenarios contend for: something that at
// most one holder has at a time, taken with a fencing token: a lock, or an
// election (leader_fault_test.go), whose term is the fence. A semaphore
// with one permit fits the same shape.
type faultTarget interface {
	// String names the target so that a child process can rebuild it
	// with parseFaultTarget.
	String() string
	// acquire waits until c holds the target, bounded by ctx.
	acquire(ctx context.Context, c *Client) (faultHold, error)
	// check verifies, inside tx, that fence is still the newest.
	check(ctx context.Context, tx pgx.Tx, fence int64) error
	// holders returns the backends that hold the target, read from
	// PostgreSQL, and how many wait for it.
	holders(t testing.TB, dsn string) (pids []int32, waiting int)
}

// A faultHold is one holder's hold of a faultTarget.
type faultHold interface {
	Fence() Term
	Done() <-chan struct{}
	Err() error
	pid() int32 // the backend that holds it
	release(ctx context.Context) error
}

// lockTarget is an exclusive session lock on one key, taken WithFence.
type lockTarget struct{ name string }

func (l lockTarget) key() Key       { return HashKey("fault", l.name) }
func (l lockTarget) String() string { return "lock:" + l.name }

func (l lockTarget) acquire(ctx context.Context, c *Client) (faultHold, error) {
	lk, err := c.Lock(ctx, l.key(), WithFence())
	if err != nil {
		return nil, err
	}
	return lockHold{lk}, nil
}

func (l lockTarget) check(ctx context.Context, tx pgx.Tx, fence int64) error {
	return CheckFence(ctx, tx, l.key(), Term(fence))
}

func (l lockTarget) holders(t testing.TB, dsn string) ([]int32, int) {
	t.Helper()
	return grantedTo(t, dsn, l.key()), waitingOn(t, dsn, l.key())
}

type lockHold struct{ *Lock }

func (h lockHold) pid() int32                        { return h.core.S.PID() }
func (h lockHold) release(ctx context.Context) error { return h.Unlock(ctx) }

// parseFaultTarget is the inverse of faultTarget.String.
func parseFaultTarget(s string) (faultTarget, error) {
	kind, name, _ := strings.Cut(s, ":")
	switch kind {
	case "lock":
		return lockTarget{name}, nil
	case "election":
		return electionTarget{name}, nil
	case "semaphore":
		return parseSemaphoreTarget(name)
	}
	return nil, fmt.Errorf("unknown fault target %q", s)
}

// faultDB returns a fresh migrated database on the shared server with the
// table of fenced writes.
func faultDB(t *testing.T) (string, *pgxpool.Pool) {
	t.Helper()
	dsn := pgtest.DB(t)
	return dsn, faultTables(t, dsn)
}

// faultTables migrates the database of dsn and creates fault_writes, where
// every write that passed its fence check is recorded.
func faultTables(t testing.TB, dsn string) *pgxpool.Pool {
	t.Helper()
	pool := migrated(t, dsn)
	_, err := pool.Exec(testCtx(t), `CREATE TABLE fault_writes (
		id     bigserial PRIMARY KEY,
		target text NOT NULL,
		fence  bigint NOT NULL,
		writer text NOT NULL,
		op     text UNIQUE)`)
	if err != nil {
		t.Fatal(err)
	}
	return pool
}

// fencedWrite records a write by writer to target with fence, in one
// transaction that checks the fence first, as an application would guard
// the data its lock protects. op, if not empty, names the write uniquely
// so that its fate can be looked up after a crash.
func fencedWrite(ctx context.Context, pool *pgxpool.Pool, target faultTarget, fence int64, writer, op string) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := target.check(ctx, tx, fence); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "INSERT INTO fault_writes (target, fence, writer, op) VALUES ($1, $2, $3, nullif($4, ''))",
			target.String(), fence, writer, op)
		return err
	})
}

// writers returns who wrote to target, in the order of the writes.
func writers(t testing.TB, pool *pgxpool.Pool, target faultTarget) []string {
	t.Helper()
	rows, err := pool.Query(testCtx(t), "SELECT writer FROM fault_writes WHERE target = $1 ORDER BY id", target.String())
	if err != nil {
		t.Fatal(err)
	}
	w, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// backendGone waits until pid has left pg_stat_activity.
func backendGone(t testing.TB, pool *pgxpool.Pool, pid int32) {
	t.Helper()
	pgtest.Eventually(t, testTimeout, fmt.Sprintf("backend %d to exit", pid), func() bool {
		var n int
		if err := pool.QueryRow(testCtx(t), "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
}

// childOptions encodes Client options for a child process; parseChildOptions
// also takes "app=NAME" for WithApplicationName.
func childOptions(loss, beat time.Duration) string {
	return fmt.Sprintf("loss=%v,beat=%v", loss, beat)
}

func parseChildOptions(s string) ([]Option, error) {
	var opts []Option
	for _, kv := range strings.Split(s, ",") {
		if kv == "" {
			continue
		}
		k, v, _ := strings.Cut(kv, "=")
		if k == "app" {
			opts = append(opts, WithApplicationName(v))
			continue
		}
		d, err := time.ParseDuration(v)
		if err != nil {
			return nil, fmt.Errorf("option %q: %w", kv, err)
		}
		switch k {
		case "loss":
			opts = append(opts, WithLossDeadline(d))
		case "beat":
			opts = append(opts, WithHeartbeat(d))

		default:
			return nil, fmt.Errorf("unknown option %q", kv)
		}
	}
	return opts, nil
}

// faultProc is a child process of a fault test, seen from the test.
type faultProc struct {
	*pgtest.Process
	stash []string // lines read while looking for others
}

// startFaultChild runs the test binary again as a child with the given
// role, database, target and options (see faultChildMain).
func startFaultChild(t testing.TB, role, dsn string, target faultTarget, opts string, env ...string) *faultProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(),
		faultChildEnv+"="+role,
		faultDSNEnv+"="+dsn,
		faultTargetEnv+"="+target.String(),
		faultOptsEnv+"="+opts)
	cmd.Env = append(cmd.Env, env...)
	return &faultProc{Process: pgtest.StartProcess(t, cmd)}
}

// await returns the fields of the next line of the child whose first word
// is event, keeping other lines for later calls. It fails the test on a
// line "error ...", or when no such line comes within timeout.
func (p *faultProc) await(t testing.TB, event string, timeout time.Duration) []string {
	t.Helper()
	for i, line := range p.stash {
		if f := strings.Fields(line); len(f) > 0 && f[0] == event {
			p.stash = append(p.stash[:i:i], p.stash[i+1:]...)
			return f
		}
	}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		select {
		case line, ok := <-p.Lines():
			if !ok {
				t.Fatalf("child %d ended its output while the test waited for %q; stderr:\n%s", p.Pid(), event, p.Stderr())
			}
			f := strings.Fields(line)
			if len(f) > 0 && f[0] == "error" {
				t.Fatalf("child %d: %s", p.Pid(), line)
			}
			if len(f) > 0 && f[0] == event {
				return f
			}
			p.stash = append(p.stash, line)
		case <-timer.C:
			t.Fatalf("child %d: no %q line within %v (other lines: %q)", p.Pid(), event, timeout, p.stash)
		}
	}
}

// held waits for the holder child to report its hold, and returns its
// fence and backend.
func (p *faultProc) held(t testing.TB) (fence int64, pid int32) {
	t.Helper()
	f := p.await(t, "held", testTimeout)
	fence, err1 := strconv.ParseInt(f[1], 10, 64)
	n, err2 := strconv.ParseInt(f[2], 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		t.Fatalf("child %d: bad line %q: %v", p.Pid(), f, err)
	}
	return fence, int32(n)
}

// ended waits for the holder child to report that its hold ended, and
// returns when (by the child's clock, which is this machine's) and whether
// it was reported lost.
func (p *faultProc) ended(t testing.TB) (at time.Time, lost bool, why string) {
	t.Helper()
	f := p.await(t, "ended", testTimeout)
	ns, err := strconv.ParseInt(f[1], 10, 64)
	if err != nil {
		t.Fatalf("child %d: bad line %q: %v", p.Pid(), f, err)
	}
	return time.Unix(0, ns), f[2] == "lost=true", strings.Join(f[3:], " ")
}

// awaitLossReported waits for the holder child to report that its hold
// ended, and checks that it was reported lost within the loss-notice bound
// of the default heartbeat after since (the event named by after).
func (p *faultProc) awaitLossReported(t testing.TB, who string, since time.Time, after string) time.Time {
	t.Helper()
	at, lost, why := p.ended(t)
	if !lost {
		t.Fatalf("%s's hold ended with %q, want ErrLockLost", who, why)
	}
	bound := lossNoticeBound(&core.Config{Heartbeat: DefaultHeartbeat})
	if took := at.Sub(since); took > bound {
		t.Errorf("%s reported the loss %v after %s, want within %v", who, took, after, bound)
	}
	t.Logf("%s reported the loss %v after %s: %s", who, at.Sub(since).Round(time.Millisecond), after, why)
	return at
}

// awaitLost checks that each of holds ends, with ErrLockLost, within the
// loss-notice bound of the default heartbeat after since (the event named
// by after). name describes the i-th hold in messages.
func awaitLost[H interface {
	Done() <-chan struct{}
	Err() error
}](t testing.TB, holds []H, name func(i int) string, since time.Time, after string) {
	t.Helper()
	bound := lossNoticeBound(&core.Config{Heartbeat: DefaultHeartbeat})
	for i, h := range holds {
		// Done is checked before the bound, and again once the bound has
		// passed: a hold that ended in time passes even when this
		// goroutine looks late, or when both are ready at once.
		select {
		case <-h.Done():
		default:
			timer := time.NewTimer(time.Until(since.Add(bound)))
			select {
			case <-h.Done():
			case <-timer.C:
				select {
				case <-h.Done():
				default:
					t.Fatalf("%s still believed held %v after %s", name(i), bound, after)
				}
			}
			timer.Stop()
		}
		if !errors.Is(h.Err(), ErrLockLost) {
			t.Fatalf("%s ended with %v, want ErrLockLost", name(i), h.Err())
		}
	}
}

// acquired is the outcome of a contender's acquire, and when it returned.
type acquired struct {
	h   faultHold
	at  time.Time
	err error
}

// startContender starts acquiring target through c and returns once the acquire
// waits on the server (the target being held). The channel delivers the
// outcome, or a timeout error after testTimeout.
func startContender(t testing.TB, ctx context.Context, target faultTarget, c *Client, dsn string) <-chan acquired {
	t.Helper()
	ch, out := make(chan acquired, 1), make(chan acquired, 1)
	go func() {
		h, err := target.acquire(ctx, c)
		ch <- acquired{h, time.Now(), err}
	}()
	pgtest.Eventually(t, testTimeout, "the contender waits on the server", func() bool {
		_, waiting := target.holders(t, dsn)
		return waiting == 1
	})
	go func() {
		select {
		case r := <-ch:
			out <- r
		case <-time.After(testTimeout):
			out <- acquired{err: fmt.Errorf("the contender did not acquire within %v", testTimeout)}
		}
	}()
	return out
}

// faultChildMain runs a child process of the fault tests, in the role
// named by PGCOORD_FAULT_CHILD, and returns its exit code. It reports on
// standard output, one event a line, and takes commands on standard input.
func faultChildMain(role string) int {
	out := &childOut{w: bufio.NewWriter(os.Stdout)}
	var err error
	switch role {
	case "holder":
		err = runHolderChild(out)
	case "candidate":
		err = runCandidateChild(out)
	case "soak":
		err = runSoakChild(out)
	case "lockcore":
		err = runLockCoreChild(out)
	case "nemesis":
		err = runNemesisChild(out)
	case "contend":
		err = runContendChild(out)
	case "handoff":
		err = runHandoffChild(out)
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		out.printf("error %v", err)
		return 1
	}
	return 0
}

// childOut writes whole lines to standard output from any goroutine.
type childOut struct {
	mu sync.Mutex
	w  *bufio.Writer
}

func (o *childOut) printf(format string, args ...any) {
	o.mu.Lock()
	defer o.mu.Unlock()
	line := fmt.Sprintf(format, args...)
	o.w.WriteString(strings.ReplaceAll(line, "\n", " ") + "\n")
	o.w.Flush()
}

// childClient opens the Client of a child process from its environment.
func childClient(ctx context.Context) (*pgxpool.Pool, *Client, faultTarget, error) {
	target, err := parseFaultTarget(os.Getenv(faultTargetEnv))
	if err != nil {
		return nil, nil, nil, err
	}
	opts, err := parseChildOptions(os.Getenv(faultOptsEnv))
	if err != nil {
		return nil, nil, nil, err
	}
	pool, err := pgxpool.New(ctx, os.Getenv(faultDSNEnv))
	if err != nil {
		return nil, nil, nil, err
	}
	c, err := New(pool, opts...)
	if err != nil {
		pool.Close()
		return nil, nil, nil, err
	}
	return pool, c, target, nil
}

// runHolderChild acquires the target (waiting as long as it takes, up to a
// minute), reports "held FENCE PID", and then:
//   - when the hold ends, reports "ended UNIXNANO lost=BOOL ERR";
//   - on the command "write", makes a fenced write with its fence and
//     reports "write ok", "write stale" (ErrStaleFence) or "write error ERR";
//   - on the command "release", releases and reports "released ERR".
//
// It exits when its standard input ends.
func runHolderChild(out *childOut) error {
	ctx := context.Background()
	pool, c, target, err := childClient(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	defer c.Close(context.Background())
	actx, cancel := context.WithTimeout(ctx, time.Minute)
	h, err := target.acquire(actx, c)
	cancel()
	if err != nil {
		return err
	}
	out.printf("held %d %d", h.Fence(), h.pid())
	go func() {
		<-h.Done()
		out.printf("ended %d lost=%t %v", time.Now().UnixNano(), errors.Is(h.Err(), ErrLockLost), h.Err())
	}()
	me := fmt.Sprintf("child-%d", os.Getpid())
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		switch in.Text() {
		case "write":
			wctx, cancel := context.WithTimeout(ctx, testTimeout)
			err := fencedWrite(wctx, pool, target, int64(h.Fence()), me, "")
			cancel()
			switch {
			case err == nil:
				out.printf("write ok")
			case errors.Is(err, ErrStaleFence):
				out.printf("write stale")
			default:
				out.printf("write error %v", err)
			}
		case "release":
			out.printf("released %v", h.release(ctx))
		}
	}
	return nil
}

// A holder whose process is killed, whose backend an administrator
// terminates, or which is paused while its backend is terminated and
// another holder takes over:
//
//   - kill (SIGKILL): the kernel closes the holder's sockets, the server
//     frees its locks at once, and a contender that already waits gets the
//     target within 1 s of the holder's death.
//   - terminate (pg_terminate_backend): the server frees the locks at once,
//     so the contender gets the target within 1 s too; the old holder
//     reports the loss (ErrLockLost) within the heartbeat bound 2H of the
//     termination, and its fenced write is refused with ErrStaleFence.
//   - pause (SIGSTOP, terminate, SIGCONT): the same, except that the
//     holder, paused, cannot know; after SIGCONT it reports ErrLockLost
//     within 2H, and the write it makes with its old fence is refused.
//
// Whatever the fault, pg_locks shows only the contender's backend holding
// the target afterwards, its fence is greater, and fault_writes holds only
// the contender's write.
func TestFaultHolderLoss(t *testing.T) {
	t.Parallel()
	const acquireBound = time.Second
	for _, tc := range []struct {
		name  string
		alive bool // the old holder's process lives on after the fault
		// inject applies the fault to the holder child p, whose backend
		// is pid, and returns when the holder's backend was gone or its
		// process dead (the acquire bound counts from then).
		inject func(t *testing.T, p *faultProc, dsn string, pid int32) time.Time
	}{
		{"kill", false, func(t *testing.T, p *faultProc, _ string, _ int32) time.Time {
			at := time.Now()
			p.Kill(t)
			return at
		}},
		{"terminate", true, func(t *testing.T, _ *faultProc, dsn string, pid int32) time.Time {
			// Just after a heartbeat, so that the holder can know only
			// at its next one, H later, and not by chance right away.
			afterHeartbeat(t, dsn, pid)
			pgtest.Terminate(t, dsn, pid)
			return time.Now()
		}},
		{"pause", true, func(t *testing.T, p *faultProc, dsn string, pid int32) time.Time {
			p.Signal(syscall.SIGSTOP)
			pgtest.Terminate(t, dsn, pid)
			return time.Now()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			dsn, pool := faultDB(t)
			target := lockTarget{tc.name}
			c := newTestClient(t, dsn)
			// The child uses the default liveness settings.
			p := startFaultChild(t, "holder", dsn, target, "")
			oldFence, oldPID := p.held(t)
			if pids, _ := target.holders(t, dsn); len(pids) != 1 || pids[0] != oldPID {
				t.Fatalf("pg_locks: %v held by %v, want the child's backend %d", target, pids, oldPID)
			}

			ch := startContender(t, ctx, target, c, dsn)
			faulted := tc.inject(t, p, dsn, oldPID)
			r := <-ch
			if r.err != nil {
				t.Fatalf("contender: %v", r.err)
			}
			if late := r.at.Sub(faulted); late > acquireBound {
				t.Errorf("contender acquired %v after the fault, want within %v", late, acquireBound)
			}
			t.Logf("contender acquired %v after the fault", r.at.Sub(faulted).Round(time.Millisecond))
			if pids, waiting := target.holders(t, dsn); len(pids) != 1 || pids[0] != r.h.pid() || waiting != 0 {
				t.Fatalf("pg_locks after takeover: held by %v with %d waiting, want only the contender's backend %d", pids, waiting, r.h.pid())
			}
			backendGone(t, pool, oldPID)
			if r.h.Fence() <= Term(oldFence) {
				t.Fatalf("contender's fence %d is not above the old holder's %d", r.h.Fence(), oldFence)
			}
			if err := fencedWrite(ctx, pool, target, int64(r.h.Fence()), "contender", ""); err != nil {
				t.Fatalf("contender's write: %v", err)
			}

			if tc.alive {
				resumed := faulted
				if tc.name == "pause" {
					p.Signal(syscall.SIGCONT)
					resumed = time.Now()
				}
				p.Send(t, "write")
				if f := p.await(t, "write", testTimeout); f[1] != "stale" {
					t.Fatalf("old holder's write after the fault: %q, want stale", f)
				}
				knew := p.awaitLossReported(t, "old holder", resumed, "the fault (or SIGCONT)")
				// The server freed the lock at once: the contender had it
				// before the old holder knew, by the holder's own clock.
				if !r.at.Before(knew) {
					t.Errorf("the contender acquired at %v, not before the old holder reported the loss at %v", r.at, knew)
				}
				t.Logf("the contender acquired %v before the old holder knew", knew.Sub(r.at).Round(time.Millisecond))
			}
			if w := writers(t, pool, target); len(w) != 1 || w[0] != "contender" {
				t.Fatalf("fault_writes for %v: %q, want only the contender's write", target, w)
			}
			if err := r.h.release(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// afterHeartbeat returns once pg_stat_activity shows that the idle backend
// pid has just answered a new heartbeat (its query_start changed).
func afterHeartbeat(t testing.TB, dsn string, pid int32) {
	t.Helper()
	conn := pgtest.Conn(t, dsn)
	var first time.Time
	pgtest.Eventually(t, testTimeout, fmt.Sprintf("a heartbeat of backend %d", pid), func() bool {
		var start time.Time
		var idle bool
		err := conn.QueryRow(testCtx(t), "SELECT query_start, state = 'idle' AND query = $2 FROM pg_stat_activity WHERE pid = $1", pid, core.PingSQL).Scan(&start, &idle)
		if err != nil {
			t.Fatalf("pg_stat_activity of backend %d: %v", pid, err)
		}
		if first.IsZero() {
			first = start
		}
		return idle && start.After(first)
	})
}

// A server restart (fast shutdown) and a crash (SIGKILL of the postmaster,
// then crash recovery) end every backend: every holder, on a Client's
// shared backends or on a Session, reports ErrLockLost within the
// heartbeat bound 2H of the server's return; the same Clients take the
// targets again once the server is back, with fences greater than before
// (fences are committed durably before they are handed out), and pg_locks
// shows only the new holds.
func TestFaultServerRestart(t *testing.T) {
	t.Parallel()
	for _, fault := range []string{"restart", "crash"} {
		t.Run(fault, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			srv := pgtest.NewServer(t)
			dsn := srv.DB(t)
			pool := faultTables(t, dsn)
			clients := []*Client{newTestClient(t, dsn), newTestClient(t, dsn), newTestClient(t, dsn)}
			var targets []faultTarget
			var holds []faultHold
			for i, c := range clients {
				for j := range 2 {
					target := lockTarget{fmt.Sprintf("%s-%d-%d", fault, i, j)}
					h, err := target.acquire(ctx, c)
					if err != nil {
						t.Fatal(err)
					}
					targets, holds = append(targets, target), append(holds, h)
				}
			}
			s := newTestSession(t, clients[0])
			sessionKey := HashKey("fault", fault, "session")
			sl, err := s.Lock(ctx, sessionKey, WithFence())
			if err != nil {
				t.Fatal(err)
			}

			if fault == "restart" {
				srv.Restart(t)
			} else {
				srv.Crash(t)
			}
			back := time.Now()
			pool.Reset() // its connections died with the server
			awaitLost(t, append(holds, lockHold{sl}), func(i int) string { return fmt.Sprintf("hold %d", i) }, back, "the server came back")
			<-s.Done()
			if !errors.Is(s.Err(), ErrLockLost) {
				t.Fatalf("session ended with %v, want ErrLockLost", s.Err())
			}
			if n := len(lockState(t, dsn)); n != 0 {
				t.Fatalf("%d advisory locks on the server after the %s, want none", n, fault)
			}

			for i, target := range targets {
				h, err := target.acquire(ctx, clients[i/2])
				if err != nil {
					t.Fatalf("%v after the %s: %v", target, fault, err)
				}
				if h.Fence() <= holds[i].Fence() {
					t.Fatalf("%v: fence %d after the %s, not above %d before it", target, h.Fence(), fault, holds[i].Fence())
				}
				if pids, _ := target.holders(t, dsn); len(pids) != 1 || pids[0] != h.pid() {
					t.Fatalf("pg_locks: %v held by %v, want backend %d", target, pids, h.pid())
				}
				if err := fencedWrite(ctx, pool, target, int64(holds[i].Fence()), "before", ""); !errors.Is(err, ErrStaleFence) {
					t.Fatalf("%v: write with the fence from before the %s: %v, want ErrStaleFence", target, fault, err)
				}
				if err := h.release(ctx); err != nil {
					t.Fatal(err)
				}
			}
			l, err := clients[0].Lock(ctx, sessionKey, WithFence())
			if err != nil {
				t.Fatal(err)
			}
			if l.Fence() <= sl.Fence() {
				t.Fatalf("session key: fence %d after the %s, not above %d", l.Fence(), fault, sl.Fence())
			}
			mustUnlock(t, l)
		})
	}
}
