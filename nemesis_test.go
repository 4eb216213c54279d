package pgcoord

// TestNemesis: a randomized nemesis for elections and semaphores. Candidate
// child processes campaign in two elections with Run, holder child
// processes take and release permits of one semaphore, and the test
// process asks leaders to resign (RequestResign) and changes the
// semaphore's limit (SetLimit), while faults come at random and sometimes
// two at once or overlapping: a process paused (SIGSTOP) for less or more
// than its loss deadline L, the backend of a process's lock, of its
// election guard or of its listener terminated, or all of its backends at
// once, a process killed with SIGKILL (and another started in its place),
// a server restart and a server crash; and two staged cases: the
// processes that hold the semaphore's permits paused, then killed once a
// holder has headed the queue for two re-check intervals (starveHead),
// and a takeover from a leader that leads without the guard (guardless).
//
// The schedule of faults and operations is a function of a seed
// (-nemesis.seed, 0 for one taken from the clock), which the test logs at
// the start and in every failure; the timing of the system under test
// cannot be replayed, so a seed gives the same schedule, not the same run.
// The normal suite runs it for 15 s (-nemesis.duration), and on until one
// fault of each kind and each operation has come:
//
//	go test -race -run 'TestNemesis$' -nemesis.duration=60s .
//	go test -race -run 'TestNemesis$' -nemesis.seed=N .
//
// What is checked, from the children's own reports and from PostgreSQL:
//
//  1. Never two leaders: for each election, the interval of a term, from
//     the start of fn to the moment the library cancelled its context
//     (leadershipOf(lctx).cancelledAt; for a killed leader, the SIGKILL),
//     never overlaps the interval of a later term, except where the
//     earlier leader falls under what RELIABILITY.md says elections do
//     not promise: its process was paused during its term for longer
//     than L − 2H (after a pause it learns a loss within 2H, so only such
//     a pause can outlast a successor's guard wait of L), both its lock
//     and its guard backends were terminated before it noticed, the
//     server crashed, or the later term was won on a server that was
//     shutting down for a restart (its fast shutdown ends backends one
//     after another). Each of these overlaps is bounded as RELIABILITY.md
//     bounds it: the old leader's context is cancelled within 2H of its
//     resumption, of the first of its two lost backends, of the server's
//     return after the crash, or of the later term's start (plus any
//     time its process was paused after that), or the overlap is a
//     violation too. A successor
//     that wins once the server is back is none of these: the leaders
//     row records the server's start time, and it waits out the old
//     leader's L. Whatever happened,
//     CheckFence stops a stale leader: the accepted writes in
//     fault_writes never show a term going back, and every write a
//     leader saw accepted is in the table.
//  2. Never more permits than the limit: a watcher reads the semaphore's
//     slots in pg_locks every 10 ms; no slot is ever granted to two
//     backends, nobody waits on a slot, and whenever a reading shows a
//     grant that the reading before did not, the slots held then are no
//     more than the highest limit that can have been in force between the
//     two readings, and every new slot is below it (lowering the limit
//     takes no permit away; it only holds back new grants). A free
//     permit reaches the head of the queue: no backend holds the queue
//     key for longer than nemesisHeadBound while fewer slots are held
//     than the lowest limit in force meanwhile, unless its process was
//     paused or killed or the server was down (checkHeads).
//  3. RequestResign ends the term it names: when the leader's process was
//     not paused, none of its backends but its listener was terminated,
//     it was not killed and the server did not restart around the
//     request, its context is cancelled within H and a round trip
//     (nemesisRoundTrip) of the request (or of the start of fn, if that
//     came later), with the resign request as its cause.
//  4. Nothing is lost silently: every term that started ends with an
//     unlead report, unless its process was killed; a live leader whose
//     lock or guard backend was terminated has its context cancelled
//     within L; a permit that the server no longer holds reports
//     ErrLockLost (the holder checks pg_locks at both ends of its
//     critical section); every permit acquired is released; every failed
//     acquire, write and campaign reports its reason; every child that
//     was not killed exits cleanly when told to stop (with -race: free of
//     data races).
//
// Every violation is collected and reported with the seed; their number
// must be 0. The run must also have done enough to prove something: one
// fault of each kind, two faults at once, terms led in both elections,
// writes accepted, permits acquired, a resign request checked.

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/url"
	"os"
	"slices"
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

var (
	nemesisSeed = flag.Int64("nemesis.seed", 0,
		"seed of TestNemesis's schedule of faults and operations; 0 takes one from the clock (the test logs it)")
	nemesisDuration = flag.Duration("nemesis.duration", 15*time.Second,
		"how long TestNemesis injects faults; it goes on until each kind has come once (CI passes -nemesis.duration=60s)")
)

// Environment of a nemesis child, besides that of every fault child.
const (
	nemesisElectionsEnv = "PGCOORD_NEMESIS_ELECTIONS" // a candidate's elections, comma-separated
	nemesisSeedEnv      = "PGCOORD_NEMESIS_SEED"      // seed of a child's own random choices
)

// Parameters of the run.
const (
	// nemesisLoss is the loss deadline L of every child; heartbeats are
	// chosen by the seed among 100, 150 and 200 ms.
	nemesisLoss = time.Second
	// nemesisExtra bounds how long the run goes on beyond its duration
	// until each fault and operation has come once.
	nemesisExtra = 2 * time.Minute
	// nemesisSlack separates two readings of this machine's clock that
	// stand for one moment: the server's start of a term (since) and the
	// moment a fault was recorded.
	nemesisSlack = 100 * time.Millisecond
	// nemesisRoundTrip is the round trip that RELIABILITY.md's bound for
	// a RequestResign (H and a round trip) allows on a loaded machine
	// under the race detector: the commit's notification through the
	// leader's listener, or the leader's read of the row.
	nemesisRoundTrip = 300 * time.Millisecond
	// nemesisWrites paces a leader's fenced writes.
	nemesisWrites = 5 * time.Millisecond
	// nemesisChildLife bounds the life of a child that is never told to
	// stop.
	nemesisChildLife = 24 * time.Hour
)

// The elections and the semaphore of the run.
var (
	nemesisElections = []electionTarget{{"nemesis-x"}, {"nemesis-y"}}
	nemesisPermits   = "nemesis-permits"
)

// Kinds of faults and operations.
const (
	nemPauseShort   = "pause<L"
	nemPauseLong    = "pause>L"
	nemCutLock      = "terminate lock backend"
	nemCutGuard     = "terminate guard backend"
	nemCutListener  = "terminate listener backend"
	nemCutAll       = "terminate all backends"
	nemKill         = "kill -9 and replace"
	nemRestart      = "server restart"
	nemCrash        = "server crash"
	nemLimit        = "set limit"
	nemResign       = "request resign"
	nemTwoAtOnce    = "two faults at once"
	nemStarveHead   = "kill the permit holders while a head waits"
	nemGuardless    = "terminate a guardless leader's lock and the guard"
	nemTargetLeader = "leader"
	nemTargetHolder = "holder"
	nemTargetCand   = "candidate"
)

// nemesisFaults are the kinds of faults, with the weight of each in the
// random part of the schedule.
var nemesisFaults = []struct {
	kind   string
	weight int
}{
	{nemPauseShort, 3}, {nemPauseLong, 2}, {nemCutLock, 3}, {nemCutGuard, 2}, {nemCutListener, 2},
	{nemCutAll, 2}, {nemKill, 2}, {nemRestart, 1}, {nemCrash, 1}, {nemStarveHead, 1}, {nemGuardless, 1},
}

// isServerFault reports whether kind restarts the server.
func isServerFault(kind string) bool { return kind == nemRestart || kind == nemCrash }

// isAlone reports whether a fault of kind comes only as the first of a
// step, never as the second fault injected right after another: the
// server faults, and the faults that stage a case over a few seconds.
func isAlone(kind string) bool {
	return isServerFault(kind) || kind == nemStarveHead || kind == nemGuardless
}

// nemesisStep is one fault or operation of the schedule.
type nemesisStep struct {
	at       time.Duration // after the start of the run
	kind     string
	election int           // index in nemesisElections
	target   string        // of a fault on a process: nemTargetLeader (of the election), nemTargetHolder or nemTargetCand
	slot     int           // which holder or candidate
	pause    time.Duration // of a pause
	limit    int           // of nemLimit
	with     *nemesisStep  // a second fault, injected right after this one
}

func (s nemesisStep) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s", s.kind)
	switch {
	case s.kind == nemLimit:
		fmt.Fprintf(&b, " %d", s.limit)
	case s.kind == nemResign || s.kind == nemCutGuard:
		fmt.Fprintf(&b, " %s", nemesisElections[s.election].name)
	case isAlone(s.kind):
	case s.target == nemTargetLeader:
		fmt.Fprintf(&b, " of the leader of %s", nemesisElections[s.election].name)
	default:
		fmt.Fprintf(&b, " of %s %d", s.target, s.slot)
	}
	if s.pause > 0 {
		fmt.Fprintf(&b, " for %v", s.pause)
	}
	if s.with != nil {
		fmt.Fprintf(&b, " + %v", *s.with)
	}
	return b.String()
}

// nemesisPlan is what the seed decides: the actors and the schedule.
type nemesisPlan struct {
	candidates, holders int
	beats               []time.Duration // H of each candidate slot, then of each holder slot
	limit               int             // the semaphore's first limit
	steps               []nemesisStep
}

// planNemesis draws the plan of a run of duration d from seed. Faults
// come every 0.5 to 2 s, the first ones one of each kind in an order the
// seed picks, and three in ten (and the second one always) come with a
// second fault, mostly on the same target; resign requests and limit
// changes (three in ten) come every 0.3 to 1.2 s, the first two one of
// each. The plan reaches nemesisExtra beyond d.
func planNemesis(seed int64, d time.Duration) nemesisPlan {
	rng := rand.New(rand.NewPCG(uint64(seed), 0x6e656d65736973))
	between := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(rng.Int64N(int64(hi-lo)+1)) }
	p := nemesisPlan{candidates: 3 + rng.IntN(2), holders: 3 + rng.IntN(2), limit: 1 + rng.IntN(3)}
	for range p.candidates + p.holders {
		p.beats = append(p.beats, time.Duration(100+50*rng.IntN(3))*time.Millisecond)
	}
	pick := func(server bool) string {
		total := 0
		for _, f := range nemesisFaults {
			if server || !isAlone(f.kind) {
				total += f.weight
			}
		}
		r := rng.IntN(total)
		for _, f := range nemesisFaults {
			if !server && isAlone(f.kind) {
				continue
			}
			if r < f.weight {
				return f.kind
			}
			r -= f.weight
		}
		panic("unreachable")
	}
	fault := func(kind string) nemesisStep {
		s := nemesisStep{kind: kind, election: rng.IntN(len(nemesisElections)), slot: rng.IntN(1 << 10)}
		switch r := rng.IntN(10); {
		case r < 6:
			s.target, s.slot = nemTargetLeader, s.slot%p.candidates // the candidate to aim at without a leader
		case r < 9:
			s.target, s.slot = nemTargetHolder, s.slot%p.holders
		default:
			s.target, s.slot = nemTargetCand, s.slot%p.candidates
		}
		switch kind {
		case nemPauseShort:
			s.pause = between(50*time.Millisecond, 400*time.Millisecond)
		case nemPauseLong:
			s.pause = between(1300*time.Millisecond, 2500*time.Millisecond)
		}
		return s
	}
	horizon := d + nemesisExtra
	first := rng.Perm(len(nemesisFaults))
	var faults []nemesisStep
	for i, at := 0, time.Duration(0); ; i++ {
		at += between(500*time.Millisecond, 2*time.Second)
		if at > horizon {
			break
		}
		kind := pick(true)
		if i < len(first) {
			kind = nemesisFaults[first[i]].kind
		}
		s := fault(kind)
		s.at = at
		if compose := rng.IntN(10) < 3; compose || i == 1 {
			w := fault(pick(false))
			if rng.IntN(10) < 7 {
				w.election, w.target, w.slot = s.election, s.target, s.slot
			}
			s.with = &w
		}
		faults = append(faults, s)
	}
	var ops []nemesisStep
	for i, at := 0, time.Duration(0); ; i++ {
		at += between(300*time.Millisecond, 1200*time.Millisecond)
		if at > horizon {
			break
		}
		s := nemesisStep{at: at, kind: nemResign, election: rng.IntN(len(nemesisElections)), limit: 1 + rng.IntN(3)}
		if r := rng.IntN(10); i == 1 || i > 1 && r >= 7 {
			s.kind = nemLimit
		}
		ops = append(ops, s)
	}
	p.steps = append(faults, ops...)
	slices.SortStableFunc(p.steps, func(a, b nemesisStep) int { return int(a.at - b.at) })
	return p
}

// runNemesisChild is a child of TestNemesis: with an election target, a
// candidate that runs every election of PGCOORD_NEMESIS_ELECTIONS with
// Run (nemesisCampaign); with a semaphore target, a holder that takes and
// releases permits (nemesisHold). It runs until its standard input ends
// or says "stop".
func runNemesisChild(out *childOut) error {
	ctx, stop := context.WithTimeout(context.Background(), nemesisChildLife)
	defer stop()
	pool, c, target, err := childClient(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	defer c.Close(context.Background())
	seed, err := strconv.ParseUint(os.Getenv(nemesisSeedEnv), 10, 64)
	if err != nil {
		return fmt.Errorf("nemesis child: seed: %w", err)
	}
	go func() {
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() && in.Text() != "stop" {
		}
		stop()
	}()
	switch target := target.(type) {
	case semaphoreTarget:
		nemesisHold(ctx, out, c, pool, target, rand.New(rand.NewPCG(seed, 1)))
	case electionTarget:
		var wg sync.WaitGroup
		for _, name := range strings.Split(os.Getenv(nemesisElectionsEnv), ",") {
			wg.Go(func() { nemesisCampaign(ctx, out, c, pool, electionTarget{name}) })
		}
		wg.Wait()
	default:
		return fmt.Errorf("nemesis child: %v is neither an election nor a semaphore", target)
	}
	return nil
}

// nemesisCampaign runs the election et with Run until ctx ends, and again
// when Run returns an error (reported as "runerr ELECTION ERR"). While
// leading, fn writes its term to fault_writes through CheckFence every
// few milliseconds. It reports:
//   - "lead ELECTION TERM UNIXNANO SINCE LOCKPID GUARDPID" when fn starts:
//     the time, the term's start by the server's clock, the backends of
//     the election's lock and of its guard (0 while leading without it);
//   - "unlead ELECTION TERM UNIXNANO WROTE TAG CAUSE" once the library has
//     cancelled fn's context: when it did, by the library's own clock
//     (cancelledAt, read once the leadership has ended so that it is
//     set), the writes accepted in the term, and why it ended: TAG is
//     "requested" (RequestResign), "resigned", "lost" (ErrLockLost),
//     "closed" or "other", CAUSE the cause as text;
//   - "stale ELECTION TERM" for a write CheckFence refused, and
//     "writeerr ELECTION TERM ERR" for a write that failed otherwise.
func nemesisCampaign(ctx context.Context, out *childOut, c *Client, pool *pgxpool.Pool, et electionTarget) {
	me := fmt.Sprintf("child-%d", os.Getpid())
	e := c.Election(et.name)
	for round := 0; ctx.Err() == nil && round < 1e6; round++ {
		err := e.Run(ctx, func(lctx context.Context, term Term) error {
			ld := leadershipOf(lctx)
			var guardPID int32
			if g := ld.guardLock(); g != nil {
				guardPID = g.S.PID()
			}
			out.printf("lead %s %d %d %d %d %d", et.name, term, time.Now().UnixNano(), ld.Since().UnixNano(), ld.lock.S.PID(), guardPID)
			wrote := 0
			pace := time.NewTimer(0)
			defer pace.Stop()
			for lctx.Err() == nil {
				wctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				err := fencedWrite(wctx, pool, et, int64(term), me, "")
				cancel()
				switch {
				case err == nil:
					wrote++
				case errors.Is(err, ErrStaleFence):
					out.printf("stale %s %d", et.name, term)
				default:
					out.printf("writeerr %s %d %v", et.name, term, err)
				}
				pace.Reset(nemesisWrites)
				select {
				case <-lctx.Done():
				case <-pace.C:
				}
			}
			// cancelledAt is set right after the cancel, before the guard
			// and the lock are released; Done closes after both.
			<-ld.Done()
			cause := context.Cause(lctx)
			out.printf("unlead %s %d %d %d %s %v", et.name, term, ld.cancelledAt().UnixNano(), wrote, nemesisCauseTag(cause), cause)
			return nil
		})
		if ctx.Err() != nil {
			return
		}
		out.printf("runerr %s %v", et.name, err)
		pace := time.NewTimer(50 * time.Millisecond) // the server may be restarting
		select {
		case <-ctx.Done():
		case <-pace.C:
		}
		pace.Stop()
	}
}

// nemesisCauseTag classifies why a leader's context was cancelled.
func nemesisCauseTag(cause error) string {
	switch {
	case errors.Is(cause, errResignRequested):
		return "requested"
	case errors.Is(cause, errResigned):
		return "resigned"
	case errors.Is(cause, ErrLockLost):
		return "lost"
	case errors.Is(cause, ErrClosed):
		return "closed"
	}
	return "other"
}

// nemesisHold takes and releases permits of s until ctx ends. A round
// acquires (waiting at most 3 s), checks in pg_locks that the permit's
// backend holds its slot, works for 20 to 150 ms, checks again, and
// releases. It reports:
//   - "permit SLOT PID" for a permit acquired, "acqerr ERR" for an
//     acquire that failed;
//   - "lost reported ERR" when the server did not hold the slot and the
//     permit reported ErrLockLost within soakLossBound, "lost silent WHY"
//     when it did not;
//   - "released ok" or "released err ERR" for the release.
func nemesisHold(ctx context.Context, out *childOut, c *Client, pool *pgxpool.Pool, s semaphoreTarget, rng *rand.Rand) {
	sem := s.sem(c)
	wait := func(d time.Duration) {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-ctx.Done():
		case <-t.C:
		}
	}
	for round := 0; ctx.Err() == nil && round < 1e6; round++ {
		actx, cancel := context.WithTimeout(ctx, 3*time.Second)
		p, err := sem.Acquire(actx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			out.printf("acqerr %v", err)
			wait(50 * time.Millisecond) // the server may be restarting
			continue
		}
		pid := p.l.S.PID()
		out.printf("permit %d %d", p.Slot(), pid)
		key := s.prefix()<<16 | int64(p.Slot())
		lost := false
		verify := func() {
			if lost {
				return
			}
			vctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			var held bool
			err := pool.QueryRow(vctx, soakHeldSQL, pid, key).Scan(&held)
			cancel()
			if err != nil || held {
				return // held, or no verdict (the server may be restarting)
			}
			lost = true
			timer := time.NewTimer(soakLossBound)
			defer timer.Stop()
			select {
			case <-p.Done():
			case <-timer.C:
			}
			if errors.Is(p.Err(), ErrLockLost) {
				out.printf("lost reported %v", p.Err())
				return
			}
			out.printf("lost silent the server does not hold slot %d for backend %d, and %v later the permit says %v", p.Slot(), pid, soakLossBound, p.Err())
		}
		verify()
		wait(time.Duration(20+rng.IntN(131)) * time.Millisecond) // the critical section's work
		verify()
		rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err = p.Release(rctx)
		cancel()
		if err != nil {
			out.printf("released err %v", err)
		} else {
			out.printf("released ok")
		}
		wait(time.Duration(rng.IntN(51)) * time.Millisecond)
	}
}

// nemesisActor is a child process of the run: a candidate or a holder.
type nemesisActor struct {
	name   string // its application_name, unique in the run
	holder bool
	slot   int
	beat   time.Duration
	proc   *faultProc

	// Guarded by the nemesis's mu.
	pauses            []nemesisPause
	paused            int // index of the pause in progress, -1 when running
	cuts              []nemesisCut
	killed            time.Time
	permits, released int
}

// nemesisPause is a pause of a process: from just before SIGSTOP to just
// after SIGCONT (or the SIGKILL).
type nemesisPause struct{ from, to time.Time }

// nemesisCut is one termination of some of a process's backends.
type nemesisCut struct {
	at      time.Time // just before the terminating statement
	kind    string
	victims []nemesisVictim
}

// nemesisVictim is a terminated backend, with what it held just before.
type nemesisVictim struct {
	pid      int32
	lockOf   []string // elections whose lock it held
	guardOf  []string // elections whose guard it held
	slots    int      // permits it held
	listener bool     // it was the listener connection
}

// listenerOnly reports whether the cut hit nothing but listeners.
func (c nemesisCut) listenerOnly() bool {
	for _, v := range c.victims {
		if !v.listener || len(v.lockOf) > 0 || len(v.guardOf) > 0 || v.slots > 0 {
			return false
		}
	}
	return true
}

// pausedDuring reports whether a was paused, for longer than longer, at
// some time in [from, to]. The caller holds the nemesis's mu, or the run
// is over.
func (a *nemesisActor) pausedDuring(from, to time.Time, longer time.Duration) bool {
	for _, p := range a.pauses {
		end := p.to
		if end.IsZero() {
			end = time.Now()
		}
		if end.Sub(p.from) > longer && !p.from.After(to) && !end.Before(from) {
			return true
		}
	}
	return false
}

// touchedDuring reports whether a backend of a, other than its listener,
// was terminated in [from, to].
func (a *nemesisActor) touchedDuring(from, to time.Time) bool {
	for _, c := range a.cuts {
		if !c.at.Before(from) && !c.at.After(to) && !c.listenerOnly() {
			return true
		}
	}
	return false
}

type nemesisTermKey struct {
	election string
	term     Term
}

// nemesisTerm is one term of an election, as its leader reported it.
type nemesisTerm struct {
	election          string
	term              Term
	actor             *nemesisActor
	since, start, end time.Time // end: zero until reported
	lockPID, guardPID int32
	wrote             int
	tag, cause        string
	killed            bool // end is the SIGKILL of its process
}

// nemesisRequest is the first RequestResign recorded for a term.
type nemesisRequest struct {
	at, back time.Time // the call, and its return
}

// nemesisLimit is a call of SetLimit. Its value may be in force from its
// call until the return of the next call that succeeded.
type nemesisLimit struct {
	call, ret time.Time
	value     int
	ok        bool
	until     time.Time // the return of the next call that succeeded; zero if none
}

// nemesisServerFault is a restart or crash of the server.
type nemesisServerFault struct {
	kind     string
	from, to time.Time
}

// nemesis is the state of a run.
type nemesis struct {
	t     *testing.T
	seed  int64
	plan  nemesisPlan
	srv   *pgtest.Server
	dsn   string
	pool  *pgxpool.Pool // the test's queries, and the admin Client's
	admin *Client
	sem   *Semaphore
	start time.Time
	watch *nemesisPermitWatch

	finish     chan struct{} // closed to resume every paused process at once
	finishOnce sync.Once
	resumes    sync.WaitGroup
	readers    sync.WaitGroup

	mu         sync.Mutex
	cands      []*nemesisActor // by slot
	holders    []*nemesisActor // by slot
	actors     []*nemesisActor // every actor, killed ones too
	byName     map[string]*nemesisActor
	spawned    int
	terms      map[nemesisTermKey]*nemesisTerm
	requested  map[nemesisTermKey]nemesisRequest
	limits     []nemesisLimit
	server     []nemesisServerFault
	injected   map[string]int // faults and operations that took effect
	skipped    map[string]int // ... that found nothing to act on, or failed
	counts     map[string]int // what the children reported
	reasons    map[string][]string
	journal    []nemesisEntry // what happened, logged after a violation
	violations []string
}

// nemesisEntry is a line of the journal.
type nemesisEntry struct {
	at   time.Time
	text string
}

// record adds a line to the journal; the caller holds n.mu.
func (n *nemesis) record(at time.Time, format string, args ...any) {
	n.journal = append(n.journal, nemesisEntry{at, fmt.Sprintf(format, args...)})
}

// violate records a violation; the caller holds n.mu.
func (n *nemesis) violate(format string, args ...any) {
	n.violations = append(n.violations, fmt.Sprintf(format, args...))
}

// note counts an event of kind and keeps a few of its reasons.
func (n *nemesis) note(kind, reason string) {
	n.counts[kind]++
	if len(n.reasons[kind]) < 3 && reason != "" && !slices.Contains(n.reasons[kind], reason) {
		n.reasons[kind] = append(n.reasons[kind], reason)
	}
}

// rel formats at as an offset from the start of the run.
func (n *nemesis) rel(at time.Time) string {
	if at.IsZero() {
		return "never"
	}
	return fmt.Sprintf("+%.3fs", at.Sub(n.start).Seconds())
}

// TestNemesis: see the top of this file.
func TestNemesis(t *testing.T) {
	t.Parallel()
	seed, d := *nemesisSeed, *nemesisDuration
	if seed == 0 {
		seed = time.Now().UnixNano()
	}
	t.Logf("nemesis: seed %d, duration %v (again: go test -race -run 'TestNemesis$' -nemesis.seed=%d -nemesis.duration=%v .)", seed, d, seed, d)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("nemesis: FAILED with seed %d (-nemesis.seed=%d -nemesis.duration=%v)", seed, seed, d)
		}
	})
	plan := planNemesis(seed, d)
	srv := pgtest.NewServer(t)
	dsn := srv.DB(t)
	faultTables(t, dsn)
	pool := pgtest.Pool(t, dsn)
	n := &nemesis{
		t: t, seed: seed, plan: plan, srv: srv, dsn: dsn, pool: pool,
		finish:    make(chan struct{}),
		cands:     make([]*nemesisActor, plan.candidates),
		holders:   make([]*nemesisActor, plan.holders),
		byName:    map[string]*nemesisActor{},
		terms:     map[nemesisTermKey]*nemesisTerm{},
		requested: map[nemesisTermKey]nemesisRequest{},
		injected:  map[string]int{},
		skipped:   map[string]int{},
		counts:    map[string]int{},
		reasons:   map[string][]string{},
	}
	n.admin = newTestClientOn(t, pool, WithApplicationName("nemesis-admin"))
	n.sem = n.admin.Semaphore(nemesisPermits, plan.limit)
	call := time.Now()
	if err := n.sem.SetLimit(testCtx(t), plan.limit); err != nil {
		t.Fatalf("nemesis seed %d: first limit: %v", seed, err)
	}
	n.limits = append(n.limits, nemesisLimit{call: call, ret: time.Now(), value: plan.limit, ok: true})
	n.watch = watchNemesisPermits(dsn, semaphoreTarget{nemesisPermits, plan.limit}.prefix(), d+nemesisExtra+5*time.Minute)
	t.Cleanup(n.shutdown)
	n.start = time.Now()
	for i := range plan.candidates {
		n.spawn(false, i)
	}
	for i := range plan.holders {
		n.spawn(true, i)
	}
	t.Logf("nemesis: %d candidates in %d elections and %d holders of %q (first limit %d), L = %v, H = %v; %d steps planned",
		plan.candidates, len(nemesisElections), plan.holders, nemesisPermits, plan.limit, nemesisLoss, plan.beats, len(plan.steps))

	n.run(d)
	ran := time.Since(n.start)
	stopAt := n.stop()
	n.check(stopAt, ran, d)
}

// shutdown resumes every paused process and stops the permit watch; it is
// also the cleanup after a failure.
func (n *nemesis) shutdown() {
	n.finishOnce.Do(func() { close(n.finish) })
	n.resumes.Wait()
	n.watch.finish()
}

// spawn starts the child of a candidate or holder slot, and reads its
// lines.
func (n *nemesis) spawn(holder bool, slot int) *nemesisActor {
	n.t.Helper()
	n.mu.Lock()
	n.spawned++
	gen := n.spawned
	n.mu.Unlock()
	kind, beat := "c", n.plan.beats[slot]
	var target faultTarget = nemesisElections[0]
	if holder {
		kind, beat = "h", n.plan.beats[n.plan.candidates+slot]
		target = semaphoreTarget{nemesisPermits, n.plan.limit}
	}
	name := fmt.Sprintf("nemesis-%s%d-%d", kind, slot, gen)
	var elections []string
	for _, e := range nemesisElections {
		elections = append(elections, e.name)
	}
	// Every connection of the child, its pool's too, carries its name.
	dsn := n.dsn + "&application_name=" + url.QueryEscape(name)
	p := startFaultChild(n.t, "nemesis", dsn, target, childOptions(nemesisLoss, beat)+",app="+name,
		nemesisElectionsEnv+"="+strings.Join(elections, ","),
		nemesisSeedEnv+"="+strconv.FormatUint(uint64(n.seed)^uint64(gen)*0x9e3779b97f4a7c15, 10))
	a := &nemesisActor{name: name, holder: holder, slot: slot, beat: beat, proc: p, paused: -1}
	n.mu.Lock()
	if holder {
		n.holders[slot] = a
	} else {
		n.cands[slot] = a
	}
	n.actors = append(n.actors, a)
	n.byName[name] = a
	n.mu.Unlock()
	n.readers.Go(func() {
		for line := range p.Lines() {
			n.apply(a, line)
		}
	})
	return a
}

// apply records a line of a's child.
func (n *nemesis) apply(a *nemesisActor, line string) {
	f := strings.Fields(line)
	if len(f) == 0 {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	bad := func(why string) { n.violate("%s (child %d): %s: %q", a.name, a.proc.Pid(), why, line) }
	nanos := func(s string) (time.Time, bool) {
		v, err := strconv.ParseInt(s, 10, 64)
		return time.Unix(0, v), err == nil
	}
	reason := func(from int) string {
		if len(f) <= from {
			return ""
		}
		return strings.Join(f[from:], " ")
	}
	switch f[0] {
	case "lead", "unlead", "stale", "writeerr":
		if len(f) < 3 {
			bad("a line too short")
			return
		}
		term, err := strconv.ParseInt(f[2], 10, 64)
		if err != nil {
			bad("no term")
			return
		}
		k := nemesisTermKey{f[1], Term(term)}
		lt := n.terms[k]
		switch f[0] {
		case "lead":
			if len(f) != 7 {
				bad("a bad lead line")
				return
			}
			start, ok1 := nanos(f[3])
			since, ok2 := nanos(f[4])
			lock, err1 := strconv.ParseInt(f[5], 10, 32)
			guard, err2 := strconv.ParseInt(f[6], 10, 32)
			switch {
			case !ok1 || !ok2 || err1 != nil || err2 != nil:
				bad("a bad lead line")
			case lt != nil:
				bad(fmt.Sprintf("term %d led twice, first by %s", term, lt.actor.name))
			default:
				n.terms[k] = &nemesisTerm{election: f[1], term: Term(term), actor: a, start: start, since: since, lockPID: int32(lock), guardPID: int32(guard)}
				n.record(start, "%s: %s leads term %d (since %s, lock backend %d, guard backend %d)", f[1], a.name, term, n.rel(since), lock, guard)
				n.counts["terms led"]++
			}
		case "unlead":
			if len(f) < 6 {
				bad("a bad unlead line")
				return
			}
			at, ok := nanos(f[3])
			wrote, err := strconv.Atoi(f[4])
			switch {
			case !ok || err != nil:
				bad("a bad unlead line")
			case lt == nil || lt.actor != a || !lt.end.IsZero():
				bad("the end of a term this child did not lead, or that had ended")
			default:
				lt.end, lt.wrote, lt.tag, lt.cause = at, wrote, f[5], reason(6)
				n.record(at, "%s: %s ends term %d (%s): %s", f[1], a.name, term, lt.tag, lt.cause)
				n.counts["writes accepted (reported)"] += wrote
			}
		case "stale":
			n.counts["writes refused as stale"]++
		case "writeerr":
			if reason(3) == "" {
				bad("a write failed without a reason")
			}
			n.note("writes failed", reason(3))
		}
	case "runerr":
		if reason(2) == "" {
			bad("a campaign failed without a reason")
		}
		n.note("campaigns failed", reason(2))
	case "permit":
		a.permits++
		n.counts["permits acquired"]++
	case "acqerr":
		if reason(1) == "" {
			bad("an acquire failed without a reason")
		}
		n.note("acquires failed", reason(1))
	case "released":
		a.released++
		if len(f) > 1 && f[1] == "ok" {
			n.counts["permits released"]++
		} else {
			if reason(2) == "" {
				bad("a release failed without a reason")
			}
			n.note("releases failed", reason(2))
		}
	case "lost":
		if len(f) > 1 && f[1] == "reported" {
			n.note("permits found lost and reported", reason(2))
		} else {
			bad("a permit lost silently")
		}
	case "error":
		bad("the child failed")
	default:
		bad("an unexpected line")
	}
}

// run injects the plan's steps at their times, for d, and on until each
// fault and operation has come at least once, at most nemesisExtra more.
func (n *nemesis) run(d time.Duration) {
	t := n.t
	pace := time.NewTimer(time.Hour)
	defer pace.Stop()
	done := 0
	for _, s := range n.plan.steps {
		if time.Since(n.start) >= d && n.missing() == nil {
			break
		}
		if time.Since(n.start) >= d+nemesisExtra {
			break
		}
		if wait := time.Until(n.start.Add(s.at)); wait > 0 {
			pace.Reset(wait) // the schedule's pacing
			<-pace.C
		}
		at := time.Now()
		n.inject(s)
		n.mu.Lock()
		n.record(at, "%v (%v)", s, time.Since(at).Round(time.Millisecond))
		n.mu.Unlock()
		done++
	}
	if missing := n.missing(); missing != nil {
		n.mu.Lock()
		n.violate("after %v and %d steps, these never took effect: %q (took effect: %v; found nothing to act on or failed: %v)",
			time.Since(n.start).Round(time.Second), done, missing, n.injected, n.skipped)
		n.mu.Unlock()
	}
	t.Logf("nemesis: %d steps injected in %v", done, time.Since(n.start).Round(time.Millisecond))
}

// missing returns the faults and operations that have not taken effect
// yet.
func (n *nemesis) missing() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	var m []string
	for _, f := range nemesisFaults {
		if n.injected[f.kind] == 0 {
			m = append(m, f.kind)
		}
	}
	for _, k := range []string{nemLimit, nemResign, nemTwoAtOnce} {
		if n.injected[k] == 0 {
			m = append(m, k)
		}
	}
	return m
}

// inject applies a step and its second fault, if any.
func (n *nemesis) inject(s nemesisStep) {
	ok := n.do(s)
	if s.with != nil && n.do(*s.with) && ok {
		n.mu.Lock()
		n.injected[nemTwoAtOnce]++
		n.mu.Unlock()
	}
}

// do applies one fault or operation, and reports whether it took effect.
func (n *nemesis) do(s nemesisStep) bool {
	var ok bool
	switch s.kind {
	case nemPauseShort, nemPauseLong:
		ok = n.pause(n.resolve(s), s.pause)
	case nemCutLock:
		a := n.resolve(s)
		switch {
		case s.target == nemTargetLeader:
			ok = n.cut(s.kind, "a.pid IN ("+nemesisHolderSQL+" AND k = $1)", nemesisElections[s.election].key().coreKey().V)
		case a.holder:
			ok = n.cut(s.kind, "a.application_name = $1 AND a.pid IN ("+nemesisHolderSQL+" AND k >> 16 = $2 AND k & 65535 <> 65535)",
				a.name, semaphoreTarget{name: nemesisPermits}.prefix())
		default:
			ok = n.cut(s.kind, "a.application_name = $1 AND a.pid IN ("+nemesisHolderSQL+" AND k = ANY($2))", a.name, nemesisKeys(electionKey))
		}
	case nemCutGuard:
		ok = n.cut(s.kind, "a.pid IN ("+nemesisHolderSQL+" AND k = $1)", nemesisGuardKey(nemesisElections[s.election].name).coreKey().V)
	case nemCutListener:
		ok = n.cut(s.kind, "a.application_name = $1 AND a.query LIKE 'LISTEN%'", n.resolve(s).name)
	case nemCutAll:
		ok = n.cut(s.kind, "a.application_name = $1", n.resolve(s).name)
	case nemKill:
		n.kill(n.resolve(s))
		ok = true
	case nemRestart, nemCrash:
		from := time.Now()
		if s.kind == nemRestart {
			n.srv.Restart(n.t)
		} else {
			n.srv.Crash(n.t)
		}
		n.mu.Lock()
		n.server = append(n.server, nemesisServerFault{s.kind, from, time.Now()})
		n.record(time.Now(), "the server is back after the %s", s.kind)
		n.mu.Unlock()
		n.pool.Reset() // its connections died with the server
		ok = true
	case nemStarveHead:
		ok = n.starveHead()
	case nemGuardless:
		ok = n.guardless(s.election)
	case nemLimit:
		ok = n.setLimit(s.limit)
	case nemResign:
		ok = n.requestResign(nemesisElections[s.election].name)
	}
	n.mu.Lock()
	if ok {
		n.injected[s.kind]++
	} else {
		n.skipped[s.kind]++
	}
	n.mu.Unlock()
	return ok
}

// nemesisHolderSQL selects, as pid, the backends granted a bigint key k
// of the database; callers add a condition on k.
const nemesisHolderSQL = `SELECT l.pid FROM (SELECT pid, (classid::bigint << 32) | objid::bigint AS k FROM pg_catalog.pg_locks
	WHERE locktype = 'advisory' AND granted AND objsubid = 1
	  AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())) l WHERE true`

// nemesisGuardKey is the key of an election's guard.
func nemesisGuardKey(name string) Key { return HashKey("pgcoord.election.guard", DefaultSchema, name) }

// nemesisKeys returns the bigint values of key for every election.
func nemesisKeys(key func(schema, name string) core.Key) []int64 {
	var ks []int64
	for _, e := range nemesisElections {
		ks = append(ks, key(DefaultSchema, e.name).V)
	}
	return ks
}

// resolve returns the actor a step is aimed at: the leader of its
// election (the process whose backend holds the election's lock; a
// candidate if none does), or a holder or candidate slot.
func (n *nemesis) resolve(s nemesisStep) *nemesisActor {
	if s.target == nemTargetLeader {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		var app string
		err := n.pool.QueryRow(ctx, "SELECT coalesce(a.application_name, '') FROM ("+nemesisHolderSQL+
			" AND k = $1) h JOIN pg_catalog.pg_stat_activity a ON a.pid = h.pid LIMIT 1", nemesisElections[s.election].key().coreKey().V).Scan(&app)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			n.pool.Reset()
		}
		n.mu.Lock()
		a := n.byName[app]
		n.mu.Unlock()
		if a != nil && a.killed.IsZero() {
			return a
		}
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if s.target == nemTargetHolder {
		return n.holders[s.slot%len(n.holders)]
	}
	return n.cands[s.slot%len(n.cands)]
}

// pause stops a's process and resumes it after d, unless it is paused
// already or was killed.
func (n *nemesis) pause(a *nemesisActor, d time.Duration) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	if a.paused >= 0 || !a.killed.IsZero() {
		return false
	}
	a.pauses = append(a.pauses, nemesisPause{from: time.Now()})
	a.proc.Signal(syscall.SIGSTOP)
	n.record(a.pauses[len(a.pauses)-1].from, "paused %s for %v", a.name, d)
	i := len(a.pauses) - 1
	a.paused = i
	n.resumes.Go(func() {
		timer := time.NewTimer(d)
		defer timer.Stop()
		select {
		case <-timer.C:
		case <-n.finish:
		}
		n.mu.Lock()
		defer n.mu.Unlock()
		if a.pauses[i].to.IsZero() {
			a.proc.Signal(syscall.SIGCONT)
			a.pauses[i].to = time.Now()
			n.record(a.pauses[i].to, "resumed %s after %v", a.name, a.pauses[i].to.Sub(a.pauses[i].from).Round(time.Millisecond))
		}
		if a.paused == i {
			a.paused = -1
		}
	})
	return true
}

// cut terminates the backends of the database that where (a condition
// on pg_stat_activity a, with args) selects, and records, for each
// process it hit, which backends and what they held just before. It
// reports whether it terminated any backend of a child.
func (n *nemesis) cut(kind, where string, args ...any) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	at := time.Now()
	rows, err := n.pool.Query(ctx, `SELECT a.pid, coalesce(a.application_name, ''), coalesce(a.query LIKE 'LISTEN%', false),
			array(SELECT (l.classid::bigint << 32) | l.objid::bigint FROM pg_catalog.pg_locks l
				WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted AND l.objsubid = 1),
			pg_catalog.pg_terminate_backend(a.pid)
		FROM pg_catalog.pg_stat_activity a
		WHERE a.datname = current_database() AND a.pid <> pg_catalog.pg_backend_pid() AND (`+where+`)`, args...)
	if err != nil {
		n.pool.Reset()
		return false
	}
	type row struct {
		PID      int32
		App      string
		Listener bool
		Keys     []int64
		Done     bool
	}
	hit, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		n.pool.Reset()
		return false
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	cuts := map[*nemesisActor]*nemesisCut{}
	var order []*nemesisActor
	for _, r := range hit {
		a := n.byName[r.App]
		if a == nil || !r.Done {
			continue // not a child's, or gone already
		}
		v := nemesisVictim{pid: r.PID, listener: r.Listener}
		prefix := semaphoreTarget{name: nemesisPermits}.prefix()
		for _, k := range r.Keys {
			for _, e := range nemesisElections {
				if k == e.key().coreKey().V {
					v.lockOf = append(v.lockOf, e.name)
				}
				if k == nemesisGuardKey(e.name).coreKey().V {
					v.guardOf = append(v.guardOf, e.name)
				}
			}
			if k>>16 == prefix && k&queueSlot != queueSlot {
				v.slots++
			}
		}
		if cuts[a] == nil {
			cuts[a] = &nemesisCut{at: at, kind: kind}
			order = append(order, a)
		}
		cuts[a].victims = append(cuts[a].victims, v)
	}
	for _, a := range order {
		a.cuts = append(a.cuts, *cuts[a])
		var vs []string
		for _, v := range cuts[a].victims {
			vs = append(vs, fmt.Sprintf("%d (lock of %v, guard of %v, %d slots, listener %t)", v.pid, v.lockOf, v.guardOf, v.slots, v.listener))
		}
		n.record(at, "%s: terminated backends of %s: %s", kind, a.name, strings.Join(vs, ", "))
	}
	return len(order) > 0
}

// kill kills a's process with SIGKILL and starts another in its slot.
func (n *nemesis) kill(a *nemesisActor) {
	n.mu.Lock()
	at := time.Now()
	a.killed = at
	n.record(at, "killed %s", a.name)
	if a.paused >= 0 {
		a.pauses[a.paused].to = at
		a.paused = -1
	}
	n.mu.Unlock()
	a.proc.Kill(n.t)
	n.spawn(a.holder, a.slot)
}

// starveHead stages the case that only the head's re-check serves: a
// permit freed by the death of its holder's process, which sends no
// notification, while the head of the queue has waited for longer than
// one re-check interval (semaphoreRecheck) already. It sets the limit to
// 2, pauses the processes that hold slots once two are held, waits until
// a holder's backend has headed the queue for two re-check intervals,
// kills the paused processes (others take their slots), and waits (at
// most 2.5 s) until the head holds a slot, so that no step of the
// schedule sends a notification meanwhile. The permit watch's check of
// the head (checkHeads) judges the outcome. It reports whether it killed
// a process.
func (n *nemesis) starveHead() bool {
	if !n.setLimit(2) {
		return false
	}
	type row struct {
		Slot int
		PID  int32
		App  string
	}
	read := func() ([]row, bool) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		rows, err := n.pool.Query(ctx, `SELECT (l.k & 65535)::int, l.pid, coalesce(a.application_name, '') FROM (
				SELECT pid, (classid::bigint << 32) | objid::bigint AS k FROM pg_catalog.pg_locks
				WHERE locktype = 'advisory' AND granted AND objsubid = 1
				  AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())) l
			JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid WHERE l.k >> 16 = $1`, semaphoreTarget{name: nemesisPermits}.prefix())
		var got []row
		if err == nil {
			got, err = pgx.CollectRows(rows, pgx.RowToStructByPos[row])
		}
		if err != nil {
			n.pool.Reset() // the server may be restarting
			n.mu.Lock()
			n.note("reads of the semaphore's slots failed", err.Error())
			n.mu.Unlock()
			return nil, false
		}
		return got, true
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	var paused []*nemesisActor
	var head int32
	var headSince time.Time
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); <-tick.C {
		got, ok := read()
		if !ok {
			continue
		}
		var holders []*nemesisActor
		var q row
		for _, r := range got {
			if r.Slot == queueSlot {
				q = r
				continue
			}
			n.mu.Lock()
			a := n.byName[r.App]
			n.mu.Unlock()
			if a != nil && a.holder {
				holders = append(holders, a)
			}
		}
		if paused == nil {
			if len(holders) < 2 {
				continue
			}
			for _, a := range holders {
				if n.pause(a, 2*time.Second) {
					paused = append(paused, a)
				}
			}
			if paused == nil {
				return false
			}
			deadline = time.Now().Add(1500 * time.Millisecond)
			continue
		}
		if q.PID != head {
			head, headSince = q.PID, time.Now()
		}
		n.mu.Lock()
		a := n.byName[q.App]
		n.mu.Unlock()
		if head == 0 || a == nil || !a.holder || time.Since(headSince) < 2*semaphoreRecheck {
			continue
		}
		n.mu.Lock()
		n.record(time.Now(), "%s has headed the queue for %v; killing %d paused permit holders", a.name, time.Since(headSince).Round(time.Millisecond), len(paused))
		n.mu.Unlock()
		for _, p := range paused {
			n.kill(p)
		}
		killed := time.Now()
		for end := killed.Add(2500 * time.Millisecond); time.Now().Before(end); <-tick.C {
			got, _ := read()
			if slices.ContainsFunc(got, func(r row) bool { return r.PID == head && r.Slot != queueSlot }) {
				n.mu.Lock()
				n.record(time.Now(), "%s holds a permit %v after the kill", a.name, time.Since(killed).Round(time.Millisecond))
				n.note("heads served after their permits' holders were killed", "")
				n.mu.Unlock()
				break
			}
		}
		return true
	}
	return false
}

// guardless stages a takeover from a leader that leads without the
// guard, where only the handover's wait keeps two leaders apart (E12): it
// pauses the leader of the election (of the other one if this one has
// none) for 2.5 s and terminates its lock backend; another candidate wins
// and, the paused leader's guard not freed within L, leads without it;
// then one statement terminates that leader's lock backend and the guard's
// (the paused process's), so that the next winner takes the guard at
// once, while the guardless leader, whose process runs, learns of its
// loss only at its next heartbeat (or its next try to take the guard,
// every H). The next winner's fn must start only after that leader's
// context was cancelled (check 1), which the row's guarded = false makes
// it wait for. It stages the case twice (the guardless leader notices
// within a few milliseconds now and then, which leaves no time for an
// overlap), and reports whether it staged it at all.
func (n *nemesis) guardless(election int) bool {
	staged := 0
	for range 2 * len(nemesisElections) {
		if n.guardlessIn(nemesisElections[election]) {
			if staged++; staged == 2 {
				break
			}
			continue // again in the same election: its leader holds the guard
		}
		election = (election + 1) % len(nemesisElections)
	}
	return staged > 0
}

// guardlessIn is guardless in election et; it reports false if et has no
// live leader or none led without the guard in time.
func (n *nemesis) guardlessIn(et electionTarget) bool {
	a := n.resolve(nemesisStep{target: nemTargetLeader, election: slices.Index(nemesisElections, et)})
	n.mu.Lock()
	var old *nemesisTerm
	for _, lt := range n.terms {
		if lt.election == et.name && lt.actor == a && lt.end.IsZero() && (old == nil || lt.term > old.term) {
			old = lt
		}
	}
	dead := !a.killed.IsZero()
	n.mu.Unlock()
	if old == nil || dead || !n.pause(a, 2500*time.Millisecond) {
		return false
	}
	from := time.Now()
	if !n.cut(nemGuardless, "a.pid = $1", old.lockPID) {
		return false
	}
	// The next leader waits L for the guard, then leads without it.
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	var next *nemesisTerm
	for deadline := from.Add(2 * time.Second); next == nil && time.Now().Before(deadline); <-tick.C {
		n.mu.Lock()
		for _, lt := range n.terms {
			if lt.election == et.name && lt.term > old.term && lt.guardPID == 0 && lt.end.IsZero() && lt.actor.killed.IsZero() && lt.actor != a {
				next = lt
			}
		}
		n.mu.Unlock()
	}
	if next == nil {
		return false
	}
	// Right after the guardless leader's heartbeat on its lock backend
	// (its last statement's end moves), so that its next one, which would
	// tell it of the loss, is about H away.
	var last time.Time
	for deadline := time.Now().Add(500 * time.Millisecond); time.Now().Before(deadline); <-tick.C {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		var at time.Time
		err := n.pool.QueryRow(ctx, "SELECT coalesce(state_change, 'epoch') FROM pg_catalog.pg_stat_activity WHERE pid = $1", next.lockPID).Scan(&at)
		cancel()
		if err != nil || !last.IsZero() && !at.Equal(last) {
			break
		}
		last = at
	}
	n.cut(nemGuardless, "a.pid = $1 OR a.pid IN ("+nemesisHolderSQL+" AND k = $2)", next.lockPID, nemesisGuardKey(et.name).coreKey().V)
	n.mu.Lock()
	cuts := next.actor.cuts
	hit := len(cuts) > 0 && !cuts[len(cuts)-1].at.Before(from) &&
		slices.ContainsFunc(cuts[len(cuts)-1].victims, func(v nemesisVictim) bool { return v.pid == next.lockPID })
	n.mu.Unlock()
	// Let the takeover play out before the next step (or the end of the
	// run): the next winner waits L after winning.
	for deadline := time.Now().Add(nemesisLoss + time.Second); hit && time.Now().Before(deadline); <-tick.C {
		n.mu.Lock()
		started := slices.ContainsFunc(slices.Collect(maps.Values(n.terms)), func(lt *nemesisTerm) bool {
			return lt.election == et.name && lt.term > next.term
		})
		n.mu.Unlock()
		if started {
			break
		}
	}
	return hit
}

// setLimit changes the semaphore's limit through the admin Client.
func (n *nemesis) setLimit(v int) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	call := time.Now()
	err := n.sem.SetLimit(ctx, v)
	n.mu.Lock()
	n.limits = append(n.limits, nemesisLimit{call: call, ret: time.Now(), value: v, ok: err == nil})
	if err != nil {
		n.note("limit changes failed", err.Error())
	}
	n.mu.Unlock()
	if err != nil {
		n.pool.Reset()
	}
	return err == nil
}

// requestResign asks the leader of the election name to resign, through
// the admin Client, and records which term the request named: the
// leaders row's resign_term, which only this test sets.
func (n *nemesis) requestResign(name string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	at := time.Now()
	err := n.admin.Election(name).RequestResign(ctx)
	back := time.Now()
	if err != nil {
		if !errors.Is(err, ErrNoLeader) {
			n.pool.Reset()
		}
		n.mu.Lock()
		n.note("resign requests refused", err.Error())
		n.mu.Unlock()
		return false
	}
	var asked *int64
	if err := n.pool.QueryRow(ctx, "SELECT resign_term FROM "+(&core.Config{Schema: DefaultSchema}).Table("leaders")+" WHERE name = $1", name).Scan(&asked); err != nil || asked == nil {
		n.pool.Reset()
		n.mu.Lock()
		n.note("resign requests not read back", fmt.Sprint(err))
		n.mu.Unlock()
		return false
	}
	k := nemesisTermKey{name, Term(*asked)}
	n.mu.Lock()
	defer n.mu.Unlock()
	if _, ok := n.requested[k]; ok {
		n.counts["resign requests repeated"]++
	} else {
		n.requested[k] = nemesisRequest{at: at, back: back}
	}
	return true
}

// stop resumes every process, tells every child that was not killed to
// stop, and waits until each has exited (cleanly: with -race, free of
// data races) and its lines are read. It returns when it began.
func (n *nemesis) stop() time.Time {
	t := n.t
	n.finishOnce.Do(func() { close(n.finish) })
	n.resumes.Wait()
	stopAt := time.Now()
	n.mu.Lock()
	var live []*nemesisActor
	for _, a := range n.actors {
		if a.killed.IsZero() {
			live = append(live, a)
		}
	}
	n.mu.Unlock()
	var exited []*nemesisActor
	for _, a := range live {
		select {
		case <-a.proc.Exited():
			exited = append(exited, a)
		default:
			a.proc.Send(t, "stop")
		}
	}
	for _, a := range live {
		timer := time.NewTimer(testTimeout)
		select {
		case <-a.proc.Exited():
			err := a.proc.ExitErr()
			n.mu.Lock()
			switch {
			case slices.Contains(exited, a):
				n.violate("%s (child %d) exited by itself before it was told to stop: %v\n%s", a.name, a.proc.Pid(), err, a.proc.Stderr())
			case err != nil:
				n.violate("%s (child %d) did not exit cleanly: %v\n%s", a.name, a.proc.Pid(), err, a.proc.Stderr())
			}
			n.mu.Unlock()
		case <-timer.C:
			n.mu.Lock()
			n.violate("%s (child %d) did not stop within %v", a.name, a.proc.Pid(), testTimeout)
			n.mu.Unlock()
			a.proc.Kill(t)
		}
		timer.Stop()
	}
	n.readers.Wait()
	n.watch.finish()
	return stopAt
}

// check runs the checks of the top of this file once the run is over,
// and logs what the run did.
func (n *nemesis) check(stopAt time.Time, ran, d time.Duration) {
	t := n.t
	n.mu.Lock()
	defer n.mu.Unlock()
	L := nemesisLoss

	// Every term ended; a killed leader's term at the SIGKILL.
	byElection := map[string][]*nemesisTerm{}
	for _, lt := range n.terms {
		if lt.end.IsZero() && !lt.actor.killed.IsZero() {
			lt.end, lt.killed, lt.tag, lt.cause = lt.actor.killed, true, "killed", "killed"
		}
		if lt.end.IsZero() {
			n.violate("%s: term %d of %s, started at %s, never reported the end of its leadership", lt.election, lt.term, lt.actor.name, n.rel(lt.start))
			continue
		}
		byElection[lt.election] = append(byElection[lt.election], lt)
	}

	// 1. No two leaders' contexts live at once, but for the documented
	// exceptions.
	excused := map[string]int{}
	for _, e := range nemesisElections {
		ts := byElection[e.name]
		slices.SortFunc(ts, func(a, b *nemesisTerm) int { return int(a.term - b.term) })
		for i, old := range ts {
			for _, nw := range ts[i+1:] {
				if !nw.start.Before(old.end) {
					continue
				}
				why, ok := n.excuse(old, nw)
				if ok {
					excused[why]++
					t.Logf("nemesis: %s: term %d (%s) started %v before term %d (%s) had its context cancelled (%s): excused, %s: %s",
						e.name, nw.term, nw.actor.name, old.end.Sub(nw.start).Round(time.Millisecond), old.term, old.actor.name, old.cause, why, n.faultsOf(old.actor, old.since, old.end))
					continue
				}
				var during string
				for _, s := range n.server {
					if !nw.since.Before(s.from) && !nw.since.After(s.to) {
						during = fmt.Sprintf("; term %d was won at %s, during the %s (%s-%s), on the server that was shutting down", nw.term, n.rel(nw.since), s.kind, n.rel(s.from), n.rel(s.to))
					}
				}
				if why != "" {
					during += "; not excused: " + why
				}
				n.violate("%s: two leaders: term %d (%s) started at %s, %v before term %d (%s, since %s, fn from %s) had its context cancelled at %s (%s: %s)%s; the faults of term %d's process: %s",
					e.name, nw.term, nw.actor.name, n.rel(nw.start), old.end.Sub(nw.start).Round(time.Millisecond), old.term, old.actor.name,
					n.rel(old.since), n.rel(old.start), n.rel(old.end), old.tag, old.cause, during, old.term, n.faultsOf(old.actor, old.since, old.end))
			}
		}
	}

	// 4. A live leader whose lock or guard backend was terminated has its
	// context cancelled within L.
	noticed, pausedCut := 0, 0
	for _, a := range n.actors {
		for _, c := range a.cuts {
			for _, v := range c.victims {
				for _, lt := range n.terms {
					if lt.actor != a || lt.end.IsZero() || lt.end.Before(c.at) || lt.since.After(c.at.Add(nemesisSlack)) {
						continue
					}
					lock := lt.lockPID == v.pid && slices.Contains(v.lockOf, lt.election)
					guard := lt.guardPID == v.pid && slices.Contains(v.guardOf, lt.election)
					if !lock && !guard {
						continue
					}
					// A term won before the termination whose fn started
					// after it (it waited for the guard, or out its
					// predecessor's loss deadline) has a context only from
					// then on.
					from := c.at
					if lt.start.After(from) {
						from = lt.start
					}
					if a.pausedDuring(c.at, from.Add(L), 0) {
						pausedCut++
						continue
					}
					noticed++
					if took := lt.end.Sub(from); took > L {
						n.violate("%s: term %d (%s, fn from %s) had its context cancelled %v after its %s backend %d was terminated at %s (%s), want within L = %v (%s: %s)",
							lt.election, lt.term, a.name, n.rel(lt.start), took.Round(time.Millisecond), map[bool]string{true: "lock", false: "guard"}[lock], v.pid, n.rel(c.at), c.kind, L, lt.tag, lt.cause)
					}
				}
			}
		}
	}

	// 3. A RequestResign to a live leader ends its term within H and a
	// round trip, with the request as the cause.
	var keys []nemesisTermKey
	for k := range n.requested {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b nemesisTermKey) int {
		return n.requested[a].at.Compare(n.requested[b].at)
	})
	resign := map[string]int{}
	var resignSlowest time.Duration
	for _, k := range keys {
		rq, lt := n.requested[k], n.terms[k]
		switch {
		case lt == nil:
			resign["its term never started fn (lost while winning, or its process killed)"]++
			continue
		case lt.end.IsZero():
			continue // reported above
		case lt.end.Before(rq.at):
			resign["its term had ended before the request"]++
			continue
		}
		from := rq.back
		if lt.start.After(from) {
			from = lt.start
		}
		a := lt.actor
		deadline := from.Add(a.beat + nemesisRoundTrip)
		lower := lt.since.Add(-nemesisSlack)
		if early := rq.at.Add(-L); early.After(lower) {
			lower = early
		}
		switch {
		case deadline.After(stopAt):
			resign["too close to the end of the run"]++
			continue
		case !a.killed.IsZero() && !a.killed.After(deadline) || a.pausedDuring(lower, deadline, 0) || a.touchedDuring(lower, deadline) || n.serverDuring(lower, deadline, ""):
			resign["a fault touched its leader around the request"]++
			continue
		}
		resign["checked"]++
		if took := lt.end.Sub(from); took > resignSlowest {
			resignSlowest = took
		}
		switch {
		case lt.end.After(deadline):
			n.violate("%s: term %d (%s) still led %v after RequestResign returned at %s (fn from %s), want within H + a round trip = %v + %v; it ended at %s (%s: %s)",
				lt.election, lt.term, a.name, lt.end.Sub(from).Round(time.Millisecond), n.rel(rq.back), n.rel(lt.start), a.beat, nemesisRoundTrip, n.rel(lt.end), lt.tag, lt.cause)
		case lt.tag == "lost":
			// Lost by itself (a loaded machine can miss a heartbeat's
			// deadline) before the request took effect: not the request's
			// doing, and the term did end.
			resign["lost by itself before the request took effect"]++
			t.Logf("nemesis: %s: term %d (%s), asked to resign at %s, was lost first at %s: %s", lt.election, lt.term, a.name, n.rel(rq.at), n.rel(lt.end), lt.cause)
		case lt.tag != "requested" || !strings.Contains(lt.cause, "RequestResign"):
			n.violate("%s: term %d (%s), asked to resign at %s, ended at %s with %s: %s, not the resign request",
				lt.election, lt.term, a.name, n.rel(rq.at), n.rel(lt.end), lt.tag, lt.cause)
		}
	}

	// 4. Every permit acquired was released, unless its process was killed.
	for _, a := range n.actors {
		if a.holder && a.killed.IsZero() && a.permits != a.released {
			n.violate("%s: %d permits acquired, %d released", a.name, a.permits, a.released)
		}
	}

	// 1 and 4 through PostgreSQL: the accepted writes never show a term
	// going back, and every write a leader saw accepted is there.
	accepted, backwards := n.checkWrites(byElection)

	// 2. Never more permits than the limit.
	grants := n.checkPermits()
	headsChecked, headsExcused := n.checkHeads()

	terms := map[string]int{}
	for _, lt := range n.terms {
		terms[lt.election]++
	}
	resigned := 0
	for _, lt := range n.terms {
		if lt.tag == "requested" {
			resigned++
		}
	}
	limitsFailed := 0
	for _, l := range n.limits[1:] {
		if !l.ok {
			limitsFailed++
		}
	}
	t.Logf("nemesis: seed %d, ran %v (-nemesis.duration=%v), %d candidate and %d holder processes started (%d killed)",
		n.seed, ran.Round(time.Millisecond), d, n.countActors(false), n.countActors(true), n.countKilled())
	t.Logf("nemesis: faults and operations that took effect: %v; that found nothing to act on or failed: %v", n.injected, n.skipped)
	t.Logf("nemesis: terms led: %v, %d ended by a resign request; resign requests recorded for %d terms (%d repeated): %v; the slowest checked took %v (bound: H + %v)",
		terms, resigned, len(n.requested), n.counts["resign requests repeated"], resign, resignSlowest.Round(time.Millisecond), nemesisRoundTrip)
	t.Logf("nemesis: fenced writes: %d accepted in fault_writes (%d reported by their leaders), %d refused as stale, %d failed; %d terms going back",
		accepted, n.counts["writes accepted (reported)"], n.counts["writes refused as stale"], n.counts["writes failed"], backwards)
	t.Logf("nemesis: permits: %d acquired, %d released, %d releases failed, %d acquires failed, %d found lost on the server and reported; %d limit changes (%d failed); pg_locks read %d times (%d failed), %d new grants checked against the limit, at most %d permits held at once",
		n.counts["permits acquired"], n.counts["permits released"], n.counts["releases failed"], n.counts["acquires failed"],
		n.counts["permits found lost and reported"], len(n.limits)-1, limitsFailed, n.watch.polls, n.watch.failed, grants, n.watch.most)
	t.Logf("nemesis: the queue's head waiting longer than %v while a permit was free: %d stalls checked, %d excused (its process paused or killed, or the server down); heads served after their permits' holders were killed: %d",
		nemesisStallShown, headsChecked, headsExcused, n.counts["heads served after their permits' holders were killed"])
	t.Logf("nemesis: overlapping terms excused: %v; terminations of a live leader's lock or guard noticed within L: %d (%d not checked: paused)", excused, noticed, pausedCut)
	for _, kind := range slices.Sorted(maps.Keys(n.reasons)) {
		t.Logf("nemesis: %s: %d, such as: %q", kind, n.counts[kind], n.reasons[kind])
	}

	// The run must have done something worth checking.
	for _, e := range nemesisElections {
		if terms[e.name] < 2 {
			n.violate("%s: %d terms led, want at least 2", e.name, terms[e.name])
		}
	}
	if accepted == 0 || n.counts["permits acquired"] < 3 || resign["checked"] == 0 {
		n.violate("the run proved little: %d writes accepted, %d permits acquired, %d resign requests checked; want at least 1, 3 and 1",
			accepted, n.counts["permits acquired"], resign["checked"])
	}

	if len(n.violations) > 0 || testing.Verbose() {
		slices.SortStableFunc(n.journal, func(a, b nemesisEntry) int { return a.at.Compare(b.at) })
		var b strings.Builder
		for _, e := range n.journal {
			fmt.Fprintf(&b, "\n%s %s", n.rel(e.at), e.text)
		}
		t.Logf("nemesis: journal of faults, operations and terms:%s", b.String())
	}
	t.Logf("nemesis: seed %d: %d violations", n.seed, len(n.violations))
	for _, v := range n.violations {
		t.Errorf("nemesis seed %d: %s", n.seed, v)
	}
}

// excuse returns why the leader of term old may still have been live when
// a later term started, by what RELIABILITY.md lists as not promised, or
// "" if nothing does. Each case is bounded as RELIABILITY.md bounds it:
//   - its process was paused, during its term, for longer than L − 2H (a
//     resumed leader learns its loss within 2H, and a successor waits for
//     the guard at most L): its context must be cancelled within 2H of
//     the end of the last such pause;
//   - its lock and its guard backends were both terminated during its
//     term (a successor cannot tell that from a killed process): within
//     2H of the first of those terminations;
//   - the server crashed during its term: within 2H of the server's
//     return;
//   - the later term was won on the server that was shutting down for a
//     restart: within 2H of the later term's start.
//
// Time the old leader's process spent paused after the moment a bound
// counts from is added to that bound (a paused process notices nothing).
// An overlap that one of these cases explains but that outlasts its bound
// is returned as over, the case named, with ok false; the caller reports
// it as a violation.
// The caller holds n.mu, or the run is over.
func (n *nemesis) excuse(old, nw *nemesisTerm) (why string, ok bool) {
	a := old.actor
	bound := func(from time.Time) time.Time {
		return from.Add(2*a.beat + nemesisSlack + a.pausedFor(from, old.end))
	}
	var over []string
	within := func(why string, from time.Time) bool {
		if b := bound(from); old.end.After(b) {
			over = append(over, fmt.Sprintf("%s, but its context was cancelled %v after %s, want within 2H = %v (plus pauses)",
				why, old.end.Sub(from).Round(time.Millisecond), n.rel(from), 2*a.beat))
			return false
		}
		return true
	}
	// A fast shutdown ends the backends one after another: a candidate
	// may win on the server that is shutting down, from a leader whose
	// connections ended first. Documented with both connections lost
	// close together: the old leader notices within 2H.
	for _, s := range n.server {
		if s.kind == nemRestart && !nw.since.Before(s.from) && !nw.since.After(s.to) {
			const why = "the new term was won on the server that was shutting down"
			if within(why, nw.start) {
				return why + ", and the old leader noticed within 2H", true
			}
		}
	}
	lower := old.since.Add(-nemesisSlack)
	if resumed, paused := a.lastLongPause(lower, old.end, nemesisLoss-2*a.beat); paused {
		const why = "its process was paused for longer than L − 2H"
		if within(why, resumed) {
			return why + ", and noticed within 2H of its resumption", true
		}
	}
	var lock, guard bool
	var first time.Time
	for _, c := range a.cuts {
		if c.at.Before(lower) || c.at.After(old.end) {
			continue
		}
		for _, v := range c.victims {
			// Its own backends: the term's lock backend, and its guard's
			// (the one it won with, or one it took during the term). A
			// backend of the process that held the election's lock just
			// before the term, a campaign that lost it, is not.
			l := slices.Contains(v.lockOf, old.election) && v.pid == old.lockPID
			g := slices.Contains(v.guardOf, old.election) && (v.pid == old.guardPID || !c.at.Before(old.since))
			if (l || g) && (first.IsZero() || c.at.Before(first)) {
				first = c.at
			}
			lock, guard = lock || l, guard || g
		}
	}
	if lock && guard {
		const why = "its lock and guard backends were both terminated"
		if within(why, first) {
			return why + ", and it noticed within 2H of the first", true
		}
	}
	for _, s := range n.server {
		if s.kind == nemCrash && !s.from.After(old.end) && !s.to.Before(lower) {
			const why = "the server crashed during its term"
			if within(why, s.to) {
				return why + ", and it noticed within 2H of the server's return", true
			}
		}
	}
	if len(over) > 0 {
		return strings.Join(over, "; "), false
	}
	return "", false
}

// serverDuring reports whether a restart or crash of the server (of kind,
// or of any kind for "") overlapped [from, to].
func (n *nemesis) serverDuring(from, to time.Time, kind string) bool {
	for _, s := range n.server {
		if (kind == "" || s.kind == kind) && !s.from.After(to) && !s.to.Before(from) {
			return true
		}
	}
	return false
}

// faultsOf describes the pauses and terminations of a's process, and the
// restarts and crashes of the server, within a few seconds of [from, to].
func (n *nemesis) faultsOf(a *nemesisActor, from, to time.Time) string {
	from, to = from.Add(-5*time.Second), to.Add(5*time.Second)
	near := func(t0, t1 time.Time) bool { return !t1.Before(from) && !t0.After(to) }
	var b []string
	for _, p := range a.pauses {
		if near(p.from, p.to) {
			b = append(b, fmt.Sprintf("paused %s-%s (%v)", n.rel(p.from), n.rel(p.to), p.to.Sub(p.from).Round(time.Millisecond)))
		}
	}
	for _, c := range a.cuts {
		if !near(c.at, c.at) {
			continue
		}
		var vs []string
		for _, v := range c.victims {
			vs = append(vs, fmt.Sprintf("%d(lock %v, guard %v, slots %d, listener %t)", v.pid, v.lockOf, v.guardOf, v.slots, v.listener))
		}
		b = append(b, fmt.Sprintf("%s at %s: %s", c.kind, n.rel(c.at), strings.Join(vs, " ")))
	}
	if !a.killed.IsZero() && near(a.killed, a.killed) {
		b = append(b, "killed at "+n.rel(a.killed))
	}
	for _, s := range n.server {
		if near(s.from, s.to) {
			b = append(b, fmt.Sprintf("%s %s-%s", s.kind, n.rel(s.from), n.rel(s.to)))
		}
	}
	if len(b) == 0 {
		return "none"
	}
	return strings.Join(b, "; ")
}

func (n *nemesis) countActors(holder bool) int {
	c := 0
	for _, a := range n.actors {
		if a.holder == holder {
			c++
		}
	}
	return c
}

func (n *nemesis) countKilled() int {
	c := 0
	for _, a := range n.actors {
		if !a.killed.IsZero() {
			c++
		}
	}
	return c
}

// checkWrites reads fault_writes: for each election the accepted writes,
// in the order they were made, must never show a term lower than one
// before it (the fence stopped every stale leader), and each term that
// reported its end must have at least the writes it saw accepted. It
// returns the number of accepted writes and of terms going back. The
// caller holds n.mu.
func (n *nemesis) checkWrites(byElection map[string][]*nemesisTerm) (accepted, backwards int) {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	n.pool.Reset()
	for _, e := range nemesisElections {
		rows, err := n.pool.Query(ctx, "SELECT fence FROM fault_writes WHERE target = $1 ORDER BY id", e.String())
		if err != nil {
			n.violate("fault_writes: %v", err)
			return
		}
		fences, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			n.violate("fault_writes: %v", err)
			return
		}
		accepted += len(fences)
		per := map[Term]int{}
		var last int64
		for i, f := range fences {
			per[Term(f)]++
			if f < last {
				backwards++
				if backwards <= 10 {
					n.violate("%s: fault_writes: write %d with term %d was accepted after one with term %d", e.name, i, f, last)
				}
			}
			last = max(last, f)
		}
		for _, lt := range byElection[e.name] {
			if !lt.killed && per[lt.term] < lt.wrote {
				n.violate("%s: term %d (%s) saw %d writes accepted, but fault_writes has %d", e.name, lt.term, lt.actor.name, lt.wrote, per[lt.term])
			}
		}
	}
	if backwards > 10 {
		n.violate("fault_writes: %d writes in all accepted after one with a newer term", backwards)
	}
	return accepted, backwards
}

// checkPermits checks the permit watch's readings against the limits set
// (see the top of this file), and returns how many readings with a new
// grant it checked. The caller holds n.mu.
func (n *nemesis) checkPermits() int {
	w := n.watch
	for _, b := range w.broken {
		n.violate("pg_locks: %s", b)
	}
	// A limit may be in force from its call until the return of the next
	// call that succeeded.
	var next time.Time
	for i := len(n.limits) - 1; i >= 0; i-- {
		n.limits[i].until = next
		if n.limits[i].ok {
			next = n.limits[i].ret
		}
	}
	highest := func(from, to time.Time) int {
		m := 0
		for _, l := range n.limits {
			if l.call.After(to) {
				break
			}
			if l.until.IsZero() || l.until.After(from) {
				m = max(m, l.value)
			}
		}
		return m
	}
	for _, g := range w.grants {
		limit := highest(g.from, g.to)
		if g.held > limit {
			n.violate("pg_locks: %d permits held at a reading at %s with a grant since the reading at %s, above the highest limit in force meanwhile, %d (limit changes: %s)",
				g.held, n.rel(g.to), n.rel(g.from), limit, n.limitsAround(g.from, g.to))
		}
		for _, s := range g.slots {
			if s >= limit {
				n.violate("pg_locks: slot %d granted between %s and %s, not below the highest limit in force meanwhile, %d (limit changes: %s)",
					s, n.rel(g.from), n.rel(g.to), limit, n.limitsAround(g.from, g.to))
			}
		}
	}
	return len(w.grants)
}

// checkHeads checks that a free permit reaches the head of the queue
// within nemesisHeadBound: no stretch of readings in which one backend
// held the queue key, fewer slots were held than the lowest limit in
// force meanwhile, and the head's process was neither paused nor killed
// nor the server down, lasts longer. It returns how many stalls with a
// free permit it checked and how many it excused. It runs after
// checkPermits, which sets the limits' until.
func (n *nemesis) checkHeads() (checked, excused int) {
	lowest := func(from, to time.Time) int {
		m := 1 << 30
		for _, l := range n.limits {
			if l.call.After(to) {
				break
			}
			if l.until.IsZero() || l.until.After(from) {
				m = min(m, l.value)
			}
		}
		return m
	}
	for _, st := range n.watch.stalls {
		limit := lowest(st.from, st.to)
		if st.held >= limit {
			continue
		}
		checked++
		a := n.byName[st.app]
		down := false
		for _, f := range n.server {
			down = down || !f.from.After(st.to) && !f.to.Before(st.from.Add(-nemesisHeadBound))
		}
		if a == nil || down || a.pausedDuring(st.from.Add(-nemesisHeadBound), st.to, 0) ||
			!a.killed.IsZero() && !a.killed.Before(st.from) && !a.killed.After(st.to.Add(nemesisHeadBound)) {
			excused++
			continue
		}
		if d := st.to.Sub(st.from); d > nemesisHeadBound {
			n.violate("pg_locks: backend %d (%s) headed the semaphore's queue from %s to %s (%v) while %d slots were held, below the lowest limit in force meanwhile, %d; a free permit reaches the head within %v (limit changes: %s)",
				st.pid, st.app, n.rel(st.from), n.rel(st.to), d.Round(time.Millisecond), st.held, limit, nemesisHeadBound, n.limitsAround(st.from, st.to))
		}
	}
	return checked, excused
}

// limitsAround describes the limit changes near [from, to].
func (n *nemesis) limitsAround(from, to time.Time) string {
	var b []string
	for _, l := range n.limits {
		if l.ret.Before(from.Add(-5*time.Second)) || l.call.After(to.Add(time.Second)) {
			continue
		}
		b = append(b, fmt.Sprintf("%d at %s-%s ok=%t", l.value, n.rel(l.call), n.rel(l.ret), l.ok))
	}
	return strings.Join(b, ", ")
}

// nemesisPermitWatch reads the semaphore's slots in pg_locks every 10 ms,
// on a connection of its own that it opens again after a restart.
type nemesisPermitWatch struct {
	stop chan struct{}
	done chan struct{}
	once sync.Once
	// Written by the watching goroutine, read after done is closed.
	polls, failed, most int
	grants              []nemesisGrant
	stalls              []nemesisStall
	broken              []string
}

// nemesisStall is a stretch of consecutive readings, longer than
// nemesisStallShown, in which one backend held the queue key (headed the
// queue) and the number of slots held stayed the same.
type nemesisStall struct {
	pid      int32
	app      string    // the head's application_name
	held     int       // slots held throughout
	from, to time.Time // the end of the first reading, the start of the last: the stall lasted at least that long
}

// nemesisStallShown is the shortest stall the watch records.
const nemesisStallShown = 500 * time.Millisecond

// nemesisHeadBound is how long the head of a semaphore's queue may wait
// while a permit is free: RELIABILITY.md's "250 ms + a round trip (tests
// allow 1 s)".
const nemesisHeadBound = time.Second

// nemesisGrant is a reading that showed slots granted that the reading
// before did not.
type nemesisGrant struct {
	from, to time.Time // the grants happened in between: after the previous reading began, before this one ended
	held     int       // slots granted at this reading
	slots    []int     // the slots newly granted
}

// watchNemesisPermits starts watching the slots of the semaphore whose
// keys' upper 48 bits are prefix, for at most bound.
func watchNemesisPermits(dsn string, prefix int64, bound time.Duration) *nemesisPermitWatch {
	w := &nemesisPermitWatch{stop: make(chan struct{}), done: make(chan struct{})}
	const sql = `SELECT (k & 65535)::int, pid, granted,
			coalesce((SELECT a.application_name FROM pg_catalog.pg_stat_activity a WHERE a.pid = l.pid), '') FROM (
			SELECT pid, granted, (classid::bigint << 32) | objid::bigint AS k FROM pg_catalog.pg_locks
			WHERE locktype = 'advisory' AND objsubid = 1
			  AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())) l
		WHERE k >> 16 = $1`
	go func() {
		defer close(w.done)
		var conn *pgx.Conn
		defer func() {
			if conn != nil {
				conn.Close(context.Background())
			}
		}()
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		end := time.NewTimer(bound)
		defer end.Stop()
		prevFrom := time.Now()
		prev := map[[2]int64]bool{}
		var stall nemesisStall // of the readings so far; pid 0 for none
		flush := func() {
			if stall.pid != 0 && stall.to.Sub(stall.from) > nemesisStallShown {
				w.stalls = append(w.stalls, stall)
			}
			stall = nemesisStall{}
		}
		defer flush()
		for {
			select {
			case <-w.stop:
				return
			case <-end.C:
				w.broken = append(w.broken, fmt.Sprintf("the watch ran for %v without being stopped", bound))
				return
			case <-tick.C:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			if conn == nil {
				conn, _ = pgx.Connect(ctx, dsn+"&application_name=nemesis-watch") // the server may be restarting
			}
			if conn == nil {
				cancel()
				w.failed++
				continue
			}
			from := time.Now()
			rows, err := conn.Query(ctx, sql, prefix)
			type row struct {
				Slot    int
				PID     int32
				Granted bool
				App     string
			}
			var got []row
			if err == nil {
				got, err = pgx.CollectRows(rows, pgx.RowToStructByPos[row])
			}
			to := time.Now()
			cancel()
			if err != nil {
				conn.Close(context.Background())
				conn = nil
				w.failed++
				flush() // the server may be restarting
				continue
			}
			w.polls++
			now := map[[2]int64]bool{}
			holder := map[int]int32{}
			var fresh []int
			var head int32       // holds the queue key
			var headApp string   // its application_name
			var awaiting []int32 // wait for slot 0
			for _, r := range got {
				switch {
				case r.Slot == queueSlot:
					if r.Granted {
						head, headApp = r.PID, r.App
					}
				case !r.Granted && r.Slot == 0:
					awaiting = append(awaiting, r.PID)
				case !r.Granted:
					w.broken = append(w.broken, fmt.Sprintf("backend %d waits for slot %d", r.PID, r.Slot))
				case holder[r.Slot] != 0:
					w.broken = append(w.broken, fmt.Sprintf("slot %d granted to backends %d and %d at once", r.Slot, holder[r.Slot], r.PID))
				default:
					holder[r.Slot] = r.PID
					k := [2]int64{int64(r.Slot), int64(r.PID)}
					now[k] = true
					if !prev[k] {
						fresh = append(fresh, r.Slot)
					}
				}
			}
			// Only the head of the queue waits for a slot, slot 0 (see
			// Semaphore.await).
			if len(awaiting) > 1 || len(awaiting) == 1 && awaiting[0] != head {
				w.broken = append(w.broken, fmt.Sprintf("backends %v wait for slot 0 while %d heads the queue", awaiting, head))
			}
			w.most = max(w.most, len(now))
			if head != stall.pid || len(now) != stall.held {
				flush()
				if head != 0 {
					stall = nemesisStall{pid: head, app: headApp, held: len(now), from: to, to: to}
				}
			} else if head != 0 {
				stall.to = from
			}
			if len(fresh) > 0 {
				w.grants = append(w.grants, nemesisGrant{from: prevFrom, to: to, held: len(now), slots: fresh})
			}
			prev, prevFrom = now, from
		}
	}()
	return w
}

// finish stops the watch and waits for it; it may be called more than
// once.
func (w *nemesisPermitWatch) finish() {
	w.once.Do(func() { close(w.stop) })
	<-w.done
}

// pausedFor returns how long a's process was paused within [from, to].
func (a *nemesisActor) pausedFor(from, to time.Time) time.Duration {
	var d time.Duration
	for _, p := range a.pauses {
		s, e := p.from, p.to
		if e.IsZero() {
			e = time.Now()
		}
		if s.Before(from) {
			s = from
		}
		if e.After(to) {
			e = to
		}
		if e.After(s) {
			d += e.Sub(s)
		}
	}
	return d
}

// lastLongPause returns the end of the last pause of a's process longer
// than longer that overlapped [from, to], and whether there was one.
func (a *nemesisActor) lastLongPause(from, to time.Time, longer time.Duration) (time.Time, bool) {
	var last time.Time
	found := false
	for _, p := range a.pauses {
		end := p.to
		if end.IsZero() {
			end = time.Now()
		}
		if end.Sub(p.from) > longer && !p.from.After(to) && !end.Before(from) && (!found || end.After(last)) {
			last, found = end, true
		}
	}
	return last, found
}

// TestNemesisExcuseBounds shows that the nemesis excuses an overlap of two
// leaders only within the bounds RELIABILITY.md states: 2H from the old
// leader's resumption after a long pause, from the first of its two lost
// connections, from the server's return after a crash, or from the new
// term's start on a server that was shutting down; beyond that it is a
// violation, and an overlap no case explains is one too.
func TestNemesisExcuseBounds(t *testing.T) {
	t.Parallel()
	t0 := time.Now()
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	const beat = 100 * time.Millisecond // 2H + nemesisSlack = 300 ms
	x := nemesisElections[0].name
	for _, tc := range []struct {
		name   string
		actor  nemesisActor
		server []nemesisServerFault
		end    int // the old term's context cancelled, in ms; the new term starts at 1000
		want   string
		ok     bool
	}{
		{name: "nothing explains it", end: 1100},
		{name: "paused, noticed within 2H of the resumption", end: 2250, ok: true, want: "paused",
			actor: nemesisActor{pauses: []nemesisPause{{at(500), at(2000)}}}},
		{name: "paused, noticed later", end: 2400, want: "paused",
			actor: nemesisActor{pauses: []nemesisPause{{at(500), at(2000)}}}},
		{name: "a short pause explains nothing", end: 1100,
			actor: nemesisActor{pauses: []nemesisPause{{at(500), at(600)}}}},
		{name: "both connections lost, noticed within 2H of the first", end: 1150, ok: true, want: "both terminated",
			actor: nemesisActor{cuts: []nemesisCut{{at: at(900), victims: []nemesisVictim{{lockOf: []string{x}}}}, {at: at(950), victims: []nemesisVictim{{guardOf: []string{x}}}}}}},
		{name: "both connections lost, noticed later", end: 1300, want: "both terminated",
			actor: nemesisActor{cuts: []nemesisCut{{at: at(900), victims: []nemesisVictim{{lockOf: []string{x}}}}, {at: at(950), victims: []nemesisVictim{{guardOf: []string{x}}}}}}},
		{name: "a lock backend of the process's campaign before the term is not the term's", end: 1150, ok: true, want: "both terminated",
			actor: nemesisActor{cuts: []nemesisCut{{at: at(-50), victims: []nemesisVictim{{pid: 7, lockOf: []string{x}}}},
				{at: at(900), victims: []nemesisVictim{{lockOf: []string{x}}, {guardOf: []string{x}}}}}}},
		{name: "one connection lost explains nothing", end: 1150,
			actor: nemesisActor{cuts: []nemesisCut{{at: at(900), victims: []nemesisVictim{{lockOf: []string{x}}}}}}},
		{name: "a crash, noticed within 2H of the server's return", end: 1250, ok: true, want: "crashed",
			server: []nemesisServerFault{{kind: nemCrash, from: at(400), to: at(1000)}}},
		{name: "a crash, noticed later", end: 1400, want: "crashed",
			server: []nemesisServerFault{{kind: nemCrash, from: at(400), to: at(1000)}}},
		{name: "won during a shutdown, noticed within 2H", end: 1250, ok: true, want: "shutting down",
			server: []nemesisServerFault{{kind: nemRestart, from: at(900), to: at(1500)}}},
		{name: "won during a shutdown, noticed later", end: 1400, want: "shutting down",
			server: []nemesisServerFault{{kind: nemRestart, from: at(900), to: at(1500)}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := tc.actor
			a.name, a.beat = "old", beat
			n := &nemesis{start: t0, server: tc.server}
			old := &nemesisTerm{election: x, term: 1, actor: &a, since: at(0), start: at(10), end: at(tc.end)}
			nw := &nemesisTerm{election: x, term: 2, actor: &nemesisActor{name: "new", beat: beat}, since: at(990), start: at(1000), end: at(3000)}
			why, ok := n.excuse(old, nw)
			if ok != tc.ok || !strings.Contains(why, tc.want) || tc.want == "" && why != "" {
				t.Errorf("excuse = %q, %v; want ok %v and a reason containing %q", why, ok, tc.ok, tc.want)
			}
		})
	}
}
