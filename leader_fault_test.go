package pgcoord

// Leader election under faults: candidates in child processes, whose
// leaders are killed, have their backends terminated, or are asked to
// resign by another process; checked through PostgreSQL (pg_locks, the
// leaders row, fenced writes) and through the candidates' own record of
// when each leader's fn started and when its context was cancelled.
// RELIABILITY.md lists the promises and the tests that prove them.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// electionTarget is an election; holding it is leading it, and the term is
// the fence.
type electionTarget struct{ name string }

func (e electionTarget) key() Key       { return keyOf(electionKey(DefaultSchema, e.name)) }
func (e electionTarget) String() string { return "election:" + e.name }

func (e electionTarget) acquire(ctx context.Context, c *Client) (faultHold, error) {
	ld, err := c.Election(e.name).Campaign(ctx)
	if err != nil {
		return nil, err
	}
	return leaderHold{ld}, nil
}

func (e electionTarget) check(ctx context.Context, tx pgx.Tx, fence int64) error {
	return CheckFence(ctx, tx, e.key(), Term(fence))
}

func (e electionTarget) holders(t testing.TB, dsn string) ([]int32, int) {
	t.Helper()
	return grantedTo(t, dsn, e.key()), waitingOn(t, dsn, e.key())
}

type leaderHold struct{ *Leadership }

func (h leaderHold) Fence() Term                       { return h.Term() }
func (h leaderHold) pid() int32                        { return h.lock.S.PID() }
func (h leaderHold) release(ctx context.Context) error { return h.Resign(ctx) }

// childIdentity is the default identity of a candidate in the child
// process p: host name and process id.
func childIdentity(t testing.TB, p *faultProc) string {
	t.Helper()
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	// The default identity (WithIdentity): application name, host, pid.
	return "pgcoord@" + host + " pid " + strconv.Itoa(p.Pid())
}

// runCandidateChild runs its target's election with Run until its
// standard input ends or says "stop". While leading, fn writes its term to
// fault_writes through CheckFence every few milliseconds. It reports:
//   - "lead TERM UNIXNANO" when fn starts;
//   - "unlead TERM UNIXNANO CAUSE" when fn's context has been cancelled:
//     the time is taken by a goroutine that waits for nothing else, so it
//     runs as soon as the context is cancelled;
//   - "stale TERM" for a write CheckFence refused.
func runCandidateChild(out *childOut) error {
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	pool, c, target, err := childClient(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	defer c.Close(context.Background())
	et, ok := target.(electionTarget)
	if !ok {
		return fmt.Errorf("candidate: %v is not an election", target)
	}
	go func() {
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() && in.Text() != "stop" {
		}
		stop()
	}()
	me := fmt.Sprintf("child-%d", os.Getpid())
	err = c.Election(et.name).Run(ctx, func(lctx context.Context, term Term) error {
		start := time.Now()
		out.printf("lead %d %d", term, start.UnixNano())
		pace := time.NewTimer(0)
		defer pace.Stop()
		for lctx.Err() == nil {
			wctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			err := fencedWrite(wctx, pool, et, int64(term), me, "")
			cancel()
			switch {
			case errors.Is(err, ErrStaleFence):
				out.printf("stale %d", term)
			case err != nil:
				// A leader that was paused may find its write's
				// connection ended meanwhile (the server ends a
				// transaction left idle too long) a moment before the
				// library tells it that it lost the lead: a write error
				// is a failure only if the leadership goes on.
				select {
				case <-lctx.Done():
					continue
				case <-time.After(testTimeout):
					return fmt.Errorf("term %d: write: %w", term, err)
				}
			}
			pace.Reset(5 * time.Millisecond) // the leader's work
			select {
			case <-lctx.Done():
			case <-pace.C:
			}
		}
		// When the library had cancelled lctx, by this process's clock:
		// taken right after the cancel, before the guard and the lock
		// are released (a goroutine woken by the cancel may run later).
		<-lctx.Done()
		at := leadershipOf(lctx).cancelledAt()
		out.printf("unlead %d %d %v", term, at.UnixNano(), context.Cause(lctx))
		return nil
	})
	if ctx.Err() == nil {
		return err // Run ended by itself
	}
	return nil
}

// A leaderTerm is one term of a candidate child, as its lines tell it.
type leaderTerm struct {
	term       Term
	proc       *faultProc
	start, end time.Time // end: zero while leading
	cause      string
	killed     bool // end is when the test sent SIGKILL
}

// candidateLog collects the lines of candidate children.
type candidateLog struct {
	mu     sync.Mutex
	terms  map[Term]*leaderTerm
	stale  int
	errors []string
	kick   chan struct{}
	reads  sync.WaitGroup
}

func newCandidateLog() *candidateLog {
	return &candidateLog{terms: map[Term]*leaderTerm{}, kick: make(chan struct{}, 1)}
}

// start starts a candidate child for target with Client options opts and
// reads its lines.
func (l *candidateLog) start(t testing.TB, dsn string, target electionTarget, opts string) *faultProc {
	t.Helper()
	p := startFaultChild(t, "candidate", dsn, target, opts)
	l.reads.Go(func() { l.read(p) })
	return p
}

func (l *candidateLog) read(p *faultProc) {
	for line := range p.Lines() {
		f := strings.Fields(line)
		l.mu.Lock()
		err := l.apply(p, f)
		if err != nil {
			l.errors = append(l.errors, fmt.Sprintf("child %d: %q: %v", p.Pid(), line, err))
		}
		l.mu.Unlock()
		select {
		case l.kick <- struct{}{}:
		default:
		}
	}
}

// apply records one line; the caller holds l.mu.
func (l *candidateLog) apply(p *faultProc, f []string) error {
	if len(f) < 2 || f[0] != "lead" && f[0] != "unlead" && f[0] != "stale" {
		return errors.New("unexpected line")
	}
	n, err := strconv.ParseInt(f[1], 10, 64)
	if err != nil {
		return err
	}
	term := Term(n)
	if f[0] == "stale" {
		l.stale++
		return nil
	}
	if len(f) < 3 {
		return errors.New("no time")
	}
	ns, err := strconv.ParseInt(f[2], 10, 64)
	if err != nil {
		return err
	}
	at := time.Unix(0, ns)
	lt := l.terms[term]
	switch {
	case f[0] == "lead" && lt != nil:
		return fmt.Errorf("term %d led twice", term)
	case f[0] == "lead":
		l.terms[term] = &leaderTerm{term: term, proc: p, start: at}
	case lt == nil || lt.proc != p || !lt.end.IsZero():
		return fmt.Errorf("term %d ended, but this child did not lead it or it had ended", term)
	default:
		lt.end, lt.cause = at, strings.Join(f[3:], " ")
	}
	return nil
}

// killed records that the test killed the child that leads term at at.
func (l *candidateLog) killed(term Term, at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if lt := l.terms[term]; lt != nil && lt.end.IsZero() {
		lt.end, lt.killed, lt.cause = at, true, "killed"
	}
}

// await waits until cond, called with l.mu held, returns a term.
func (l *candidateLog) await(t testing.TB, what string, cond func() *leaderTerm) leaderTerm {
	t.Helper()
	timer := time.NewTimer(testTimeout)
	defer timer.Stop()
	for {
		l.mu.Lock()
		lt := cond()
		var cp leaderTerm
		if lt != nil {
			cp = *lt
		}
		errs := slices.Clone(l.errors)
		l.mu.Unlock()
		if len(errs) > 0 {
			t.Fatalf("candidates: %s", strings.Join(errs, "; "))
		}
		if lt != nil {
			return cp
		}
		select {
		case <-l.kick:
		case <-timer.C:
			t.Fatalf("candidates: not within %v: %s", testTimeout, what)
		}
	}
}

// awaitLead waits for a term after term to lead, and returns the newest.
func (l *candidateLog) awaitLead(t testing.TB, after Term) leaderTerm {
	t.Helper()
	return l.await(t, fmt.Sprintf("a leader with a term after %d", after), func() *leaderTerm {
		var newest *leaderTerm
		for _, lt := range l.terms {
			if lt.term > after && (newest == nil || lt.term > newest.term) {
				newest = lt
			}
		}
		return newest
	})
}

// ended reports whether term's fn context has been cancelled, or its
// leader killed.
func (l *candidateLog) ended(term Term) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	lt := l.terms[term]
	return lt != nil && !lt.end.IsZero()
}

// awaitEnd waits until term's fn context has been cancelled.
func (l *candidateLog) awaitEnd(t testing.TB, term Term) leaderTerm {
	t.Helper()
	return l.await(t, fmt.Sprintf("the end of term %d", term), func() *leaderTerm {
		if lt := l.terms[term]; lt != nil && !lt.end.IsZero() {
			return lt
		}
		return nil
	})
}

// checkIntervals checks that every term ended and that no two terms'
// intervals, from the start of fn to the cancellation of its context by
// the leader's own clock, overlap; terms grow in the order they started.
func (l *candidateLog) checkIntervals(t testing.TB) (n int) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, e := range l.errors {
		t.Errorf("candidates: %s", e)
	}
	var all []*leaderTerm
	for _, lt := range l.terms {
		all = append(all, lt)
	}
	slices.SortFunc(all, func(a, b *leaderTerm) int { return a.start.Compare(b.start) })
	var prev *leaderTerm
	var lastEnd time.Time
	for _, lt := range all {
		if lt.end.IsZero() {
			t.Errorf("term %d (child %d) never reported the end of its leadership", lt.term, lt.proc.Pid())
			continue
		}
		if prev != nil && lt.term <= prev.term {
			t.Errorf("term %d started after term %d", lt.term, prev.term)
		}
		if lt.start.Before(lastEnd) {
			t.Errorf("two leaders: term %d (child %d) started %v before term %d (child %d) had its context cancelled (%s)",
				lt.term, lt.proc.Pid(), lastEnd.Sub(lt.start), prev.term, prev.proc.Pid(), prev.cause)
		}
		if lt.end.After(lastEnd) {
			lastEnd, prev = lt.end, lt
		}
	}
	return len(all)
}

// stopCandidates tells the candidate children to stop, waits until they
// have exited cleanly (a child that stopped by itself also passed the
// race detector) and their lines are read.
func stopCandidates(t testing.TB, l *candidateLog, procs []*faultProc) {
	t.Helper()
	for _, p := range procs {
		p.Send(t, "stop")
	}
	for _, p := range procs {
		select {
		case <-p.Exited():
			if err := p.ExitErr(); err != nil {
				t.Errorf("candidate child %d: %v\n%s", p.Pid(), err, p.Stderr())
			}
		case <-time.After(testTimeout):
			t.Fatalf("candidate child %d did not stop within %v", p.Pid(), testTimeout)
		}
	}
	l.reads.Wait()
}

// fencesInOrder reads the fences of target's accepted writes in the order
// they were written, and reports an error for every fence lower than one
// before it. It returns how many distinct fences wrote.
func fencesInOrder(t testing.TB, dsn string, target faultTarget) (writes, distinct int) {
	t.Helper()
	rows, err := pgtest.Pool(t, dsn).Query(testCtx(t), "SELECT fence FROM fault_writes WHERE target = $1 ORDER BY id", target.String())
	if err != nil {
		t.Fatal(err)
	}
	fences, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	var last int64
	for _, f := range fences {
		switch {
		case f < last:
			t.Errorf("fault_writes: a write with term %d was accepted after one with term %d", f, last)
		case f > last:
			distinct++
			last = f
		}
	}
	return len(fences), distinct
}

// wroteWithFence reports whether fault_writes holds a write to target
// with fence.
func wroteWithFence(t testing.TB, pool *pgxpool.Pool, target faultTarget, fence int64) bool {
	t.Helper()
	var ok bool
	err := pool.QueryRow(testCtx(t), "SELECT EXISTS (SELECT 1 FROM fault_writes WHERE target = $1 AND fence = $2)", target.String(), fence).Scan(&ok)
	if err != nil {
		t.Fatal(err)
	}
	return ok
}

// electionWatch reads an election's state from PostgreSQL again and again,
// on a connection of its own, and notes every breach of the election's
// promises that it sees: two backends granted the election's lock; the
// leaders row's term going back, or one term recorded for two backends;
// Leader reporting a backend that pg_locks showed holding the lock neither
// just before nor just after, or a term older than one it reported before.
type electionWatch struct {
	mu         sync.Mutex
	violations []string
	reads      int
	reported   int     // leaders Leader reported
	terms      []int64 // distinct terms of the leaders row, as seen
	held       int64   // the newest term seen recorded by the backend that held the lock
}

// heldTerm returns the newest term the watch saw held by the backend its
// row names.
func (w *electionWatch) heldTerm() Term {
	w.mu.Lock()
	defer w.mu.Unlock()
	return Term(w.held)
}

func (w *electionWatch) violate(format string, args ...any) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.violations = append(w.violations, fmt.Sprintf(format, args...))
}

// watchElection starts watching e, in the database of dsn, with e's
// Client's Leader. stop ends the watch; read w only after it.
func watchElection(t testing.TB, dsn string, e *Election) (w *electionWatch, stop func()) {
	t.Helper()
	conn := pgtest.Conn(t, dsn)
	ctx, cancel := context.WithCancel(context.Background())
	w = &electionWatch{}
	done := make(chan struct{})
	classid, objid, _ := e.Key().coreKey().LockColumns()
	type state struct {
		pids      []int32
		term      int64
		recordPid int32
	}
	read := func() (state, error) {
		var s state
		err := conn.QueryRow(ctx, `SELECT array(SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted
				AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
				AND classid::bigint = $1 AND objid::bigint = $2 AND objsubid = 1 ORDER BY pid),
			coalesce((SELECT term FROM pgcoord.leaders WHERE name = $3), 0),
			coalesce((SELECT pid FROM pgcoord.leaders WHERE name = $3), 0)`,
			int64(classid), int64(objid), e.Name()).Scan(&s.pids, &s.term, &s.recordPid)
		return s, err
	}
	go func() {
		defer close(done)
		const maxReads, maxTime = 200000, 3 * time.Minute
		var rowTerm, reported int64
		var rowPid int32
		see := func(s state) {
			if len(s.pids) > 1 {
				w.violate("pg_locks: backends %v all hold the election's lock", s.pids)
			}
			switch {
			case s.term < rowTerm:
				w.violate("leaders row: term %d after term %d", s.term, rowTerm)
			case s.term == rowTerm && s.recordPid != rowPid && rowTerm != 0:
				w.violate("leaders row: term %d recorded for backend %d, then for %d", s.term, rowPid, s.recordPid)
			case s.term > rowTerm:
				rowTerm, rowPid = s.term, s.recordPid
				w.mu.Lock()
				w.terms = append(w.terms, s.term)
				w.mu.Unlock()
			}
			w.mu.Lock()
			w.reads++
			if len(s.pids) == 1 && s.pids[0] == s.recordPid && s.term > w.held {
				w.held = s.term
			}
			w.mu.Unlock()
		}
		pause := time.NewTimer(0)
		defer pause.Stop()
		deadline := time.Now().Add(maxTime)
		for range maxReads {
			if time.Now().After(deadline) {
				break
			}
			before, err1 := read()
			info, err2 := e.Leader(ctx)
			after, err3 := read()
			if ctx.Err() != nil {
				return
			}
			if err := errors.Join(err1, err3); err != nil {
				w.violate("watch: %v", err)
				return
			}
			see(before)
			see(after)
			switch {
			case errors.Is(err2, ErrNoLeader):
			case err2 != nil:
				w.violate("Leader: %v", err2)
			case !slices.Contains(before.pids, info.PID) && !slices.Contains(after.pids, info.PID):
				w.violate("Leader reported %+v, but pg_locks showed the lock held by %v just before and by %v just after", info, before.pids, after.pids)
			case int64(info.Term) < reported:
				w.violate("Leader reported term %d after term %d", info.Term, reported)
			default:
				reported = int64(info.Term)
				w.mu.Lock()
				w.reported++
				w.mu.Unlock()
			}
			pause.Reset(2 * time.Millisecond) // leave the machine to the candidates
			select {
			case <-ctx.Done():
				return
			case <-pause.C:
			}
		}
		w.violate("the watch reached its bound (%d reads or %v) before the test ended", maxReads, maxTime)
	}()
	return w, func() {
		cancel()
		<-done
	}
}

// terminateBackend terminates backend pid through pool, whose connection
// must be allowed to, and returns the moment just before it asked, once
// the backend has left pg_stat_activity.
func terminateBackend(t testing.TB, pool *pgxpool.Pool, pid int32) time.Time {
	t.Helper()
	ctx := testCtx(t)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var ok bool
	at := time.Now()
	if err := conn.QueryRow(ctx, "SELECT pg_terminate_backend($1)", pid).Scan(&ok); err != nil || !ok {
		t.Fatalf("terminate backend %d: %v, %v", pid, ok, err)
	}
	backendGone(t, pool, pid)
	return at
}

// percentile returns the p-th percentile (0 < p < 1) of ds, which it sorts.
func percentile(ds []time.Duration, p float64) time.Duration {
	slices.Sort(ds)
	return ds[int(float64(len(ds)-1)*p+0.5)]
}

// Exactly one leader at any time. Five candidates, each a child process
// running Run with a heartbeat of 100 ms and a loss deadline of 1 s, go
// through 51 forced changes of leader, in turn: a RequestResign from a
// process that is no candidate, the leader's backend terminated
// (pg_terminate_backend of the pid Leader reports), and the leader's
// process killed with SIGKILL (and another candidate started in its
// place). Each change waits for the new leader, and for the watch to see
// it, before the next. Checked three ways:
//   - the watch (electionWatch), through PostgreSQL: never two backends
//     granted the lock, the leaders row's term only grows, and Leader
//     reports a backend that pg_locks shows holding the lock;
//   - the candidates' own record: from the start of fn to the moment its
//     context was cancelled (by the leader's clock; a killed leader's at
//     the moment of SIGKILL), no two leaders' intervals overlap, and terms
//     grow in the order leaders started;
//   - fencing: every leader writes its term through CheckFence while it
//     leads (each forced term's first write lands before its fault), and
//     the accepted writes, in the order they were made, never show a term
//     lower than one before it.
func TestElectionOneLeaderUnderFaults(t *testing.T) {
	t.Parallel()
	const candidates, changes = 5, 51
	const loss, beat = time.Second, 100 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dsn, pool := faultDB(t)
	target := electionTarget{"one-leader"}
	outsider := newTestClient(t, dsn)
	e := outsider.Election(target.name)
	log := newCandidateLog()
	opts := childOptions(loss, beat)
	procs := make([]*faultProc, candidates)
	for i := range procs {
		procs[i] = log.start(t, dsn, target, opts)
	}
	w, stopWatch := watchElection(t, dsn, e)
	defer stopWatch()

	kinds := []string{"resign", "terminate", "kill"}
	takeovers := map[string][]time.Duration{}
	var last Term
	unforced := 0
	for forced, round := 0, 0; forced < changes; round++ {
		if round > 2*changes {
			t.Fatalf("%d rounds for %d forced changes: too many leaders lost without a fault (%d)", round, forced, unforced)
		}
		cur := log.awaitLead(t, last)
		last = cur.term
		pgtest.Eventually(t, testTimeout, fmt.Sprintf("the watch sees term %d held", cur.term), func() bool {
			return w.heldTerm() >= cur.term
		})
		// Every forced term takes part in the fence check: its first
		// fenced write has landed before the fault.
		var wrote bool
		pgtest.Eventually(t, testTimeout, fmt.Sprintf("term %d writes through its fence, or ends", cur.term), func() bool {
			wrote = wroteWithFence(t, pool, target, int64(cur.term))
			return wrote || log.ended(cur.term)
		})
		info, err := e.Leader(ctx)
		if !wrote || err != nil || info.Term != cur.term {
			// The leader lost its leadership by itself (a loaded machine can
			// miss a heartbeat's deadline): not a forced change.
			unforced++
			t.Logf("term %d ended without a fault (Leader: %+v, %v)", cur.term, info, err)
			continue
		}
		kind := kinds[forced%len(kinds)]
		at := time.Now()
		switch kind {
		case "resign":
			if err := e.RequestResign(ctx); err != nil {
				t.Fatal(err)
			}
		case "terminate":
			at = terminateBackend(t, pool, info.PID)
		case "kill":
			cur.proc.Kill(t)
			log.killed(cur.term, at)
		}
		next := log.awaitLead(t, cur.term)
		takeovers[kind] = append(takeovers[kind], next.start.Sub(at))
		forced++
		if kind == "kill" {
			// Another candidate takes the killed one's place, once the
			// takeover is measured (starting a process loads the machine).
			i := slices.Index(procs, cur.proc)
			if i < 0 {
				t.Fatalf("term %d: leader child %d is not a running candidate", cur.term, cur.proc.Pid())
			}
			procs[i] = log.start(t, dsn, target, opts)
		}
	}
	// The watch stops first: as the candidates stop, a last term can begin
	// and end within one of its rounds (read, Leader, read), which its
	// check would take for a leader that held nothing.
	stopWatch()
	stopCandidates(t, log, procs)

	n := log.checkIntervals(t)
	writes, distinct := fencesInOrder(t, dsn, target)
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, v := range w.violations {
		t.Error(v)
	}
	if len(w.terms) < changes {
		t.Errorf("the watch saw %d terms, want at least %d: it proved little", len(w.terms), changes)
	}
	if distinct < changes {
		t.Errorf("%d writes by %d terms in increasing order, want at least the %d forced terms, each of which wrote before its fault", writes, distinct, changes)
	}
	t.Logf("%d terms (%d forced changes, %d without a fault); the watch read the state %d times and saw %d terms, Leader reported a leader %d times; %d fenced writes by %d terms, %d refused as stale",
		n, changes, unforced, w.reads, len(w.terms), w.reported, writes, distinct, log.stale)
	for _, kind := range kinds {
		ds := takeovers[kind]
		t.Logf("%s: %d changes, new leader's fn started after p50 %v, p90 %v, max %v", kind, len(ds),
			percentile(ds, 0.5).Round(time.Millisecond), percentile(ds, 0.9).Round(time.Millisecond), percentile(ds, 1).Round(time.Millisecond))
	}
}

// Takeover. Three candidates, each a child process running Run (heartbeat
// H = 200 ms, loss deadline L = 1 s); before each fault another candidate
// waits for the election's lock on the server.
//   - kill: the leader's process is killed with SIGKILL (and another
//     candidate started in its place). A waiting candidate's fn starts
//     within milliseconds; the test asserts a p50 under 1 s over 12 kills,
//     generous for a loaded machine, and logs the figures.
//   - terminate: the leader's backend is terminated while its process
//     lives. The old leader's context is cancelled within 2H (its next
//     heartbeat fails), the new leader's fn starts after that by the old
//     leader's own clock, never before, and within L of the termination,
//     with a greater term; over 10 terminations.
func TestElectionTakeover(t *testing.T) {
	t.Parallel()
	for _, fault := range []string{"kill", "terminate"} {
		t.Run(fault, func(t *testing.T) {
			t.Parallel()
			const loss, beat = time.Second, 200 * time.Millisecond
			rounds := map[string]int{"kill": 12, "terminate": 10}[fault]
			ctx := testCtx(t)
			dsn, pool := faultDB(t)
			target := electionTarget{"takeover-" + fault}
			e := newTestClient(t, dsn).Election(target.name)
			log := newCandidateLog()
			opts := childOptions(loss, beat)
			procs := []*faultProc{log.start(t, dsn, target, opts), log.start(t, dsn, target, opts), log.start(t, dsn, target, opts)}
			var took, noticed []time.Duration
			var last Term
			for round := 0; len(took) < rounds; round++ {
				if round > 2*rounds {
					t.Fatalf("%d rounds for %d faults: too many leaders lost without a fault", round, len(took))
				}
				cur := log.awaitLead(t, last)
				last = cur.term
				pgtest.Eventually(t, testTimeout, "another candidate waits for the lock", func() bool {
					return waitingOn(t, dsn, target.key()) >= 1
				})
				info, err := e.Leader(ctx)
				if err != nil || info.Term != cur.term {
					t.Logf("term %d ended without a fault (Leader: %+v, %v)", cur.term, info, err)
					continue
				}
				var at time.Time
				if fault == "kill" {
					at = time.Now()
					cur.proc.Kill(t)
					log.killed(cur.term, at)
				} else {
					at = terminateBackend(t, pool, info.PID)
				}
				next := log.awaitLead(t, cur.term)
				took = append(took, next.start.Sub(at))
				if fault == "kill" {
					// Another candidate takes the killed one's place, once
					// the takeover is measured.
					procs[slices.Index(procs, cur.proc)] = log.start(t, dsn, target, opts)
				}
				if fault == "terminate" {
					old := log.awaitEnd(t, cur.term)
					noticed = append(noticed, old.end.Sub(at))
					if next.start.Before(old.end) {
						t.Errorf("term %d started %v before term %d's context was cancelled", next.term, old.end.Sub(next.start), cur.term)
					}
					if d := old.end.Sub(at); d > lossNoticeBound(&core.Config{Heartbeat: beat}) {
						t.Errorf("term %d: context cancelled %v after its backend was terminated, want within 2H = %v", cur.term, d, 2*beat)
					}
					if d := next.start.Sub(at); d > loss {
						t.Errorf("term %d started %v after term %d's backend was terminated, want within L = %v", next.term, d, cur.term, loss)
					}
				}
			}
			stopCandidates(t, log, procs)
			log.checkIntervals(t)
			fencesInOrder(t, dsn, target)
			p50, p90 := percentile(took, 0.5), percentile(took, 0.9)
			t.Logf("%s: new leader's fn started after p50 %v, p90 %v, max %v (%d faults)", fault,
				p50.Round(100*time.Microsecond), p90.Round(100*time.Microsecond), percentile(took, 1).Round(100*time.Microsecond), len(took))
			if fault == "terminate" {
				t.Logf("terminate: old leader's context cancelled after p50 %v, p90 %v", percentile(noticed, 0.5).Round(time.Millisecond), percentile(noticed, 0.9).Round(time.Millisecond))
			}
			if max := percentile(took, 1); fault == "kill" && (p50 > time.Second || p90 > time.Second || max > 2*time.Second) {
				t.Errorf("takeover after a kill: p50 %v, p90 %v, max %v; want p50 and p90 under 1 s and every takeover under 2 s", p50, p90, max)
			}
		})
	}
}

// A leader dies and nobody else campaigns: its process is killed, or its
// backend terminated (its process lives on). Leader reports ErrNoLeader as
// soon as the server has freed the election's lock: at the first call
// after the terminated backend has left pg_stat_activity, and for the
// killed process once pg_locks shows the lock free (within 1 s of the
// kill). Observe, on another Client (heartbeat H = 250 ms), delivers the
// leader, then no leader within 2H of the lock's release. A terminated
// leader reports ErrLockLost within its own 2H.
func TestElectionNoLeaderAfterDeath(t *testing.T) {
	t.Parallel()
	for _, fault := range []string{"kill", "terminate"} {
		t.Run(fault, func(t *testing.T) {
			t.Parallel()
			const beat = 250 * time.Millisecond
			ctx := testCtx(t)
			dsn, pool := faultDB(t)
			target := electionTarget{"alone-" + fault}
			e := newTestClient(t, dsn, WithHeartbeat(beat)).Election(target.name)
			octx, stopObserving := context.WithCancel(ctx)
			rec := record(e.Observe(octx))
			defer func() { stopObserving(); <-rec.done }()
			rec.awaitLast(t, LeaderInfo{})
			p := startFaultChild(t, "holder", dsn, target, childOptions(time.Second, 100*time.Millisecond))
			term, pid := p.held(t)
			info, err := e.Leader(ctx)
			if err != nil || info.Term != Term(term) || info.PID != pid || info.Identity != childIdentity(t, p) {
				t.Fatalf("Leader: %+v, %v; want term %d, backend %d", info, err, term, pid)
			}
			rec.awaitLast(t, info)

			var freed time.Time
			if fault == "kill" {
				killed := time.Now()
				p.Kill(t)
				pgtest.Eventually(t, testTimeout, "the server frees the election's lock", func() bool {
					return len(grantedTo(t, dsn, target.key())) == 0
				})
				freed = time.Now()
				if d := freed.Sub(killed); d > time.Second {
					t.Errorf("the server freed the killed leader's lock %v after the kill, want within 1s", d)
				}
			} else {
				terminateBackend(t, pool, pid)
				freed = time.Now()
			}
			if _, err := e.Leader(ctx); !errors.Is(err, ErrNoLeader) {
				t.Fatalf("Leader once the lock is free: %v, want ErrNoLeader", err)
			}
			rec.deliveredWithin(t, LeaderInfo{}, freed, 2*beat, "the lock was freed")
			rec.mu.Lock()
			got := slices.Clone(rec.got)
			rec.mu.Unlock()
			if len(got) != 3 {
				t.Fatalf("Observe delivered %+v, want no leader, the leader, no leader", got)
			}
			if fault == "terminate" {
				_, lost, why := p.ended(t)
				if !lost {
					t.Fatalf("the terminated leader ended with %q, want ErrLockLost", why)
				}
			}
		})
	}
}

// observed records what an Observe channel delivers, and when: a goroutine
// that does nothing else receives each change and notes the time at once.
type observed struct {
	mu   sync.Mutex
	got  []LeaderInfo
	at   []time.Time // when each change was received
	kick chan struct{}
	done chan struct{}
}

func record(ch <-chan LeaderInfo) *observed {
	o := &observed{kick: make(chan struct{}, 1), done: make(chan struct{})}
	go func() {
		defer close(o.done)
		for info := range ch {
			at := time.Now()
			o.mu.Lock()
			o.got = append(o.got, info)
			o.at = append(o.at, at)
			o.mu.Unlock()
			select {
			case o.kick <- struct{}{}:
			default:
			}
		}
	}()
	return o
}

// awaitLast waits, at most testTimeout, until the last delivered change is
// want, and returns when it was delivered. A bound on the delivery is
// checked against that time (see deliveredWithin), not against when this
// goroutine gets to look.
func (o *observed) awaitLast(t testing.TB, want LeaderInfo) time.Time {
	t.Helper()
	timer := time.NewTimer(testTimeout)
	defer timer.Stop()
	for {
		o.mu.Lock()
		ok := len(o.got) > 0 && sameLeader(o.got[len(o.got)-1], want)
		got := slices.Clone(o.got)
		var at time.Time
		if ok {
			at = o.at[len(o.at)-1]
		}
		o.mu.Unlock()
		if ok {
			return at
		}
		select {
		case <-o.kick:
		case <-timer.C:
			t.Fatalf("Observe did not deliver %+v within %v; it delivered %+v", want, testTimeout, got)
		}
	}
}

// deliveredWithin waits for want as the last delivered change and checks
// that it was delivered within bound of since (the event named by after).
func (o *observed) deliveredWithin(t testing.TB, want LeaderInfo, since time.Time, bound time.Duration, after string) {
	t.Helper()
	d := o.awaitLast(t, want).Sub(since)
	what := "no leader"
	if want != (LeaderInfo{}) {
		what = fmt.Sprintf("%+v", want)
	}
	t.Logf("Observe delivered %s %v after %s", what, d.Round(time.Millisecond), after)
	if d > bound {
		t.Errorf("Observe delivered %s %v after %s, want within %v", what, d.Round(time.Millisecond), after, bound)
	}
}

func sameLeader(a, b LeaderInfo) bool {
	return a.Identity == b.Identity && a.Term == b.Term && a.PID == b.PID && a.Since.Equal(b.Since)
}

// leaderOf describes an in-process leadership as Leader would.
func leaderOf(ld *Leadership, identity string) LeaderInfo {
	return LeaderInfo{Identity: identity, Term: ld.Term(), Since: ld.Since(), PID: ld.lock.S.PID()}
}

// Observe delivers every change, in order, through a sequence of known
// transitions: a campaign won, a resignation (just after the observing
// Client's listener connection was terminated, so that only its resync can
// deliver it), a handover to a waiting candidate, a leader whose backend
// is terminated and one whose process is killed with nobody waiting (no
// leader is then delivered within 2H of the lock's release, H = 250 ms),
// a RequestResign that hands over to another candidate, and the last
// resignation. Transitions that PostgreSQL notifies follow each other
// without waiting for Observe. Everything delivered is compared with the
// expected list (a handover may show no leader in between, or not); terms
// never go backwards.
func TestElectionObserveSequence(t *testing.T) {
	t.Parallel()
	const beat = 250 * time.Millisecond
	ctx := testCtx(t)
	dsn, pool := faultDB(t)
	const name = "sequence"
	oc := newTestClient(t, dsn, WithHeartbeat(beat), WithApplicationName("observer"))
	a := newTestClient(t, dsn)
	b := newTestClient(t, dsn)
	ea, eb := a.Election(name, WithIdentity("a")), b.Election(name, WithIdentity("b"))
	octx, stopObserving := context.WithCancel(ctx)
	rec := record(oc.Election(name).Observe(octx))
	type want struct {
		info     LeaderInfo
		optional bool // a handover may or may not show no leader first
	}
	wants := []want{{}}
	expect := func(info LeaderInfo) { wants = append(wants, want{info: info}) }
	handover := func(info LeaderInfo) { wants = append(wants, want{optional: true}, want{info: info}) }
	rec.awaitLast(t, LeaderInfo{})

	la, err := ea.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	expect(leaderOf(la, "a"))
	rec.awaitLast(t, leaderOf(la, "a"))
	// The observer's listener connection dies; the resignation right
	// after is delivered by the resync once it listens again, if not by a
	// notification.
	var listener int32
	if err := pool.QueryRow(ctx, "SELECT pid FROM pg_stat_activity WHERE application_name = 'observer' AND query LIKE 'LISTEN%'").Scan(&listener); err != nil {
		t.Fatalf("the observer's listener: %v", err)
	}
	terminateBackend(t, pool, listener)
	if err := la.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	expect(LeaderInfo{})
	rec.awaitLast(t, LeaderInfo{})

	lb, err := eb.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	expect(leaderOf(lb, "b"))
	won := goLeader(func() (*Leadership, error) { return ea.Campaign(ctx) })
	pgtest.Eventually(t, testTimeout, "a waits for the election's lock", func() bool { return waitingOn(t, dsn, ea.Key()) == 1 })
	if err := lb.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	la2 := receiveLeader(t, won)
	handover(leaderOf(la2, "a"))
	// The terminations below are not notified: Observe finds them by its
	// own re-check. Each is timed from a state Observe has delivered, so
	// that the no leader it then delivers is the new one.
	rec.awaitLast(t, leaderOf(la2, "a"))

	terminateBackend(t, pool, la2.lock.S.PID())
	freed := time.Now()
	expect(LeaderInfo{})
	rec.deliveredWithin(t, LeaderInfo{}, freed, 2*beat, "the terminated leader's lock was freed")
	<-la2.Done()

	target := electionTarget{name}
	p := startFaultChild(t, "holder", dsn, target, "")
	p.held(t)
	info, err := ea.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	expect(info)
	rec.awaitLast(t, info)
	p.Kill(t)
	pgtest.Eventually(t, testTimeout, "the server frees the killed leader's lock", func() bool {
		return len(grantedTo(t, dsn, ea.Key())) == 0
	})
	freed = time.Now()
	expect(LeaderInfo{})
	rec.deliveredWithin(t, LeaderInfo{}, freed, 2*beat, "the killed leader's lock was freed")

	lb2, err := eb.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	expect(leaderOf(lb2, "b"))
	runCtx, stopRun := context.WithCancel(ctx)
	started := make(chan Term, 1)
	ran := make(chan error, 1)
	go func() {
		ran <- ea.Run(runCtx, func(lctx context.Context, term Term) error {
			started <- term
			<-lctx.Done()
			return nil
		})
	}()
	pgtest.Eventually(t, testTimeout, "a waits for the election's lock", func() bool { return waitingOn(t, dsn, ea.Key()) == 1 })
	if err := newTestClient(t, dsn).Election(name).RequestResign(ctx); err != nil {
		t.Fatal(err)
	}
	var term Term
	select {
	case term = <-started:
	case <-time.After(testTimeout):
		t.Fatal("a did not lead after b was asked to resign")
	}
	info, err = ea.Leader(ctx)
	if err != nil || info.Term != term || info.Identity != "a" {
		t.Fatalf("Leader: %+v, %v; want a with term %d", info, err, term)
	}
	handover(info)
	<-lb2.Done()
	stopRun()
	if err := <-ran; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run: %v", err)
	}
	expect(LeaderInfo{})
	rec.awaitLast(t, LeaderInfo{})
	stopObserving()
	<-rec.done

	got := rec.got
	i := 0
	for _, w := range wants {
		switch {
		case i < len(got) && sameLeader(got[i], w.info):
			i++
		case w.optional:
		default:
			t.Fatalf("Observe delivered %+v; want %+v (at %d)", got, wants, i)
		}
	}
	if i != len(got) {
		t.Fatalf("Observe delivered %+v; want %+v (%d extra)", got, wants, len(got)-i)
	}
	var last Term
	for _, info := range got {
		if info.Term != 0 && info.Term <= last {
			t.Fatalf("Observe delivered term %d after term %d", info.Term, last)
		}
		last = max(last, info.Term)
	}
	t.Logf("Observe delivered %d changes as expected", len(got))
}

// goLeader runs campaign in a goroutine.
func goLeader(campaign func() (*Leadership, error)) <-chan *Leadership {
	ch := make(chan *Leadership, 1)
	go func() {
		ld, err := campaign()
		if err != nil {
			ld = nil
		}
		ch <- ld
	}()
	return ch
}

func receiveLeader(t testing.TB, ch <-chan *Leadership) *Leadership {
	t.Helper()
	select {
	case ld := <-ch:
		if ld == nil {
			t.Fatal("campaign failed")
		}
		return ld
	case <-time.After(testTimeout):
		t.Fatal("campaign did not win in time")
	}
	return nil
}

// Connection use. One Client (WithSharedBackends(2), WithMaxWaits(3))
// leads 50 elections: every election's lock is held by one of its shared
// backends (pg_locks), and it uses at most shared + waits + 2 connections
// (the guard session and the listener), by pg_stat_activity and by Stat.
// Another Client with the same limits campaigns in all 50: at most 3 of
// its campaigns wait on the server at once, the others wait in the
// process, and it too stays within shared + waits + 2 connections. When
// one election's leader resigns, the following Client takes it over
// within two campaign rounds (a round is the loss deadline, 1 s):
// campaigns take turns in the waits. When one of the leading Client's
// shared backends is terminated, every election it held goes over to the
// following Client.
func TestElectionConnectionUse(t *testing.T) {
	t.Parallel()
	const elections, shared, waits = 50, 2, 3
	const loss, beat = time.Second, 100 * time.Millisecond
	const connBound = shared + waits + 2
	ctx := testCtx(t)
	dsn, pool := faultDB(t)
	opts := func(app string) []Option {
		return []Option{WithSharedBackends(shared), WithMaxWaits(waits), WithLossDeadline(loss), WithHeartbeat(beat), WithApplicationName(app)}
	}
	lc := newTestClient(t, dsn, opts("leads")...)
	fc := newTestClient(t, dsn, opts("follows")...)
	name := func(i int) string { return fmt.Sprintf("e-%02d", i) }
	connsOf := func(app string) int {
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", app).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	backendsOf := func(c *Client) []int32 {
		c.core.Mu.Lock()
		defer c.core.Mu.Unlock()
		var pids []int32
		for _, b := range c.core.Backends {
			pids = append(pids, b.PID())
		}
		return pids
	}
	// within checks a Client's connections against the bound.
	within := func(c *Client, app string) {
		t.Helper()
		if n := connsOf(app); n > connBound {
			t.Fatalf("%s: %d connections in pg_stat_activity, want at most %d", app, n, connBound)
		}
		if st := c.Stat(); st.Backends > shared+waits || st.Sessions > 1 || st.Waits > waits {
			t.Fatalf("%s: Stat %+v, want at most %d backends, 1 session (the guard's) and %d waits", app, st, shared+waits, waits)
		}
	}
	// holders returns the backend holding each election's lock, and the
	// backends waiting for them.
	holders := func() (held map[int]int32, waiting []int32) {
		held = map[int]int32{}
		state := lockState(t, dsn)
		for i := range elections {
			for _, h := range state[keyOf(electionKey(DefaultSchema, name(i)))] {
				if h.granted {
					held[i] = h.pid
				} else {
					waiting = append(waiting, h.pid)
				}
			}
		}
		return held, waiting
	}

	leads := make([]*Leadership, elections)
	for i := range elections {
		ld, err := lc.Election(name(i), WithIdentity("leads")).Campaign(ctx)
		if err != nil {
			t.Fatal(err)
		}
		leads[i] = ld
	}
	held, _ := holders()
	for i := range elections {
		if !slices.Contains(backendsOf(lc), held[i]) {
			t.Fatalf("%s: lock held by backend %d, not one of the leading Client's backends %v", name(i), held[i], backendsOf(lc))
		}
	}
	if st := lc.Stat(); st.Backends > shared {
		t.Fatalf("leading Client: Stat %+v, want its leaderships on at most %d shared backends", st, shared)
	}
	within(lc, "leads")

	fctx, stopFollowing := context.WithCancel(ctx)
	defer stopFollowing()
	won := make([]chan *Leadership, elections)
	for i := range elections {
		won[i] = make(chan *Leadership, 1)
		go func() {
			ld, err := fc.Election(name(i), WithIdentity("follows")).Campaign(fctx)
			if err != nil && fctx.Err() == nil {
				t.Errorf("%s: the following Client's campaign: %v", name(i), err)
			}
			won[i] <- ld
		}()
	}
	pgtest.Eventually(t, testTimeout, "the following Client's campaigns fill its waits and queue the rest", func() bool {
		within(fc, "follows")
		_, waiting := holders()
		if len(waiting) > waits {
			t.Fatalf("%d backends wait for the elections, want at most %d", len(waiting), waits)
		}
		st := fc.Stat()
		return len(waiting) == waits && st.QueuedWaits > 0
	})
	_, waiting := holders()
	for _, pid := range waiting {
		if !slices.Contains(backendsOf(fc), pid) {
			t.Fatalf("backend %d waits for an election, not one of the following Client's %v", pid, backendsOf(fc))
		}
	}
	within(lc, "leads")

	// takeOver waits until the following Client leads election i, on one
	// of its backends, and returns how long that took from since.
	takeOver := func(i int, since time.Time) time.Duration {
		t.Helper()
		var ld *Leadership
		select {
		case ld = <-won[i]:
		case <-time.After(testTimeout):
			t.Fatalf("%s: the following Client did not take over", name(i))
		}
		took := time.Since(since)
		if ld == nil {
			t.Fatalf("%s: the following Client's campaign failed", name(i))
		}
		won[i] <- ld // for the cleanup
		info, err := fc.Election(name(i)).Leader(ctx)
		if err != nil || info.Identity != "follows" || info.Term <= leads[i].Term() {
			t.Fatalf("%s: Leader %+v, %v; want the following Client with a term after %d", name(i), info, err, leads[i].Term())
		}
		if !slices.Contains(backendsOf(fc), info.PID) {
			t.Fatalf("%s: lock held by backend %d, not one of the following Client's %v", name(i), info.PID, backendsOf(fc))
		}
		return took
	}

	resigned := time.Now()
	if err := leads[7].Resign(ctx); err != nil {
		t.Fatal(err)
	}
	took := takeOver(7, resigned)
	t.Logf("%s taken over %v after its leader resigned", name(7), took.Round(time.Millisecond))
	if took > 2*loss {
		t.Errorf("%s taken over %v after its leader resigned, want within two campaign rounds (%v)", name(7), took, 2*loss)
	}

	held, _ = holders()
	victim := held[0]
	var lost []int
	for i, pid := range held {
		if pid == victim {
			lost = append(lost, i)
		}
	}
	at := terminateBackend(t, pool, victim)
	var slowest time.Duration
	for _, i := range lost {
		slowest = max(slowest, takeOver(i, at))
		// The new leader started after the old one's context was
		// cancelled; the old one's release may still be finishing.
		if leads[i].Context().Err() == nil {
			t.Fatalf("%s: taken over while the old leader's context was live", name(i))
		}
		select {
		case <-leads[i].Done():
		case <-time.After(testTimeout):
			t.Fatalf("%s: the old leadership did not end", name(i))
		}
		if !errors.Is(leads[i].Err(), ErrLockLost) {
			t.Fatalf("%s: the old leadership ended with %v, want ErrLockLost", name(i), leads[i].Err())
		}
	}
	t.Logf("%d elections whose leader's backend was terminated all taken over within %v", len(lost), slowest.Round(time.Millisecond))
	within(fc, "follows")
	within(lc, "leads")

	stopFollowing()
	for i := range elections {
		if ld := <-won[i]; ld != nil {
			if err := ld.Resign(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if err := leads[i].Resign(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// A Campaign that starts while the server is down waits, as a Lock does,
// and leads once the server is back, within its ctx; it does not give up
// because the guard session cannot be opened meanwhile.
func TestCampaignWaitsThroughServerRestart(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	srv := pgtest.NewServer(t)
	dsn := srv.DB(t)
	migrated(t, dsn)
	c := newTestClient(t, dsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
	e := c.Election("restart-campaign")

	srv.Stop(t)
	type won struct {
		ld  *Leadership
		err error
	}
	campaign := make(chan won, 1)
	go func() {
		ld, err := e.Campaign(ctx)
		campaign <- won{ld, err}
	}()
	// The campaign's lock wait retries the connection, as a Lock does.
	if !pgtest.Poll(testTimeout, func() bool {
		select {
		case w := <-campaign:
			t.Fatalf("Campaign returned (%v) while the server was down, want it to wait", w.err)
		default:
		}
		return c.Stat().QueuedWaits > 0
	}) {
		t.Fatal("the campaign never retried its connection while the server was down")
	}
	srv.Start(t)
	started := time.Now()
	var ld *Leadership
	select {
	case w := <-campaign:
		if w.err != nil {
			t.Fatalf("Campaign after the server came back: %v", w.err)
		}
		ld = w.ld
	case <-ctx.Done():
		t.Fatalf("Campaign did not lead within %v of its start", testTimeout)
	}
	t.Logf("Campaign led %v after the server accepted connections again", time.Since(started).Round(time.Millisecond))
	if ld.Term() < 1 {
		t.Fatalf("term %d after the restart, want >= 1", ld.Term())
	}
	heldOnlyBy(t, dsn, e.Key(), ld.lock.S.PID())
	info, err := e.Leader(ctx)
	if err != nil || info.Term != ld.Term() {
		t.Fatalf("Leader after the restart: %+v, %v; want term %d", info, err, ld.Term())
	}
	if err := ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
}

// A leader's Run whose server goes away (stopped and started again, or
// stopped and replaced by its promoted standby) cancels fn's ctx and
// campaigns on: it keeps waiting while no primary can be reached and leads
// again, fn called a second time with a greater term, instead of returning
// an error.
func TestRunCampaignsOnAfterPrimaryGoes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		failover bool
	}{{"restart", false}, {"failover", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			primary := pgtest.NewServer(t)
			pdsn := primary.DB(t)
			migrated(t, pdsn)
			dsn, after := pdsn, pdsn
			var standby *pgtest.Server
			if tc.failover {
				cfg, err := pgx.ParseConfig(pdsn)
				if err != nil {
					t.Fatal(err)
				}
				standby = primary.StartStandby(t)
				after = standby.ConnString(cfg.Database)
				dsn = fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/%s?sslmode=disable", primary.Port(), standby.Port(), cfg.Database)
			}
			c := newTestClient(t, dsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
			e := c.Election("primary-goes")

			type lead struct {
				term Term
				ctx  context.Context
			}
			leads := make(chan lead, 4)
			runCtx, stopRun := context.WithCancel(ctx)
			defer stopRun()
			ran := make(chan error, 1)
			go func() {
				ran <- e.Run(runCtx, func(lctx context.Context, term Term) error {
					leads <- lead{term, lctx}
					<-lctx.Done()
					return lctx.Err()
				})
			}()
			next := func(what string) lead {
				t.Helper()
				select {
				case l := <-leads:
					return l
				case err := <-ran:
					t.Fatalf("%s: Run returned %v, want it to campaign on", what, err)
				case <-ctx.Done():
					t.Fatalf("%s: not within %v", what, testTimeout)
				}
				panic("unreachable")
			}
			first := next("first term")
			if tc.failover {
				// The term has reached the standby before the primary goes.
				replica := pgtest.Conn(t, after)
				pgtest.Eventually(t, testTimeout, "the term replicates", func() bool {
					var n int64
					err := replica.QueryRow(ctx, "SELECT coalesce(max(term), 0) FROM pgcoord.leaders WHERE name = $1", e.Name()).Scan(&n)
					return err == nil && Term(n) == first.term
				})
			}

			primary.Stop(t)
			select {
			case <-first.ctx.Done():
			case <-ctx.Done():
				t.Fatal("fn's ctx was not cancelled after the primary stopped")
			}
			// With no primary, Run campaigns: its lock wait retries the
			// connection, and it neither returns nor leads.
			if !pgtest.Poll(testTimeout, func() bool {
				select {
				case err := <-ran:
					t.Fatalf("Run returned %v while no primary could be reached, want it to campaign on", err)
				case l := <-leads:
					t.Fatalf("term %d began while no primary could be reached", l.term)
				default:
				}
				return c.Stat().QueuedWaits > 0
			}) {
				t.Fatal("Run never retried its connection while no primary could be reached")
			}
			if tc.failover {
				standby.Promote(t)
			} else {
				primary.Start(t)
			}
			back := time.Now()
			second := next("a term on the server that came back")
			t.Logf("term %d began %v after the new primary answered (term %d before)", second.term, time.Since(back).Round(time.Millisecond), first.term)
			if second.term <= first.term {
				t.Fatalf("term %d after the primary went, not above %d", second.term, first.term)
			}
			ld := leadershipOf(second.ctx)
			heldOnlyBy(t, after, e.Key(), ld.lock.S.PID())
			stopRun()
			if err := <-ran; !errors.Is(err, context.Canceled) {
				t.Fatalf("Run after its ctx ended: %v, want context.Canceled", err)
			}
		})
	}
}
