package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// haTimeout bounds the whole switchover test: a cluster's start, two
// switchovers and the waits for the old primary to stream again.
const haTimeout = 4 * time.Minute

// A planned switchover, and one back, on a Patroni cluster (three nodes,
// two synchronous standbys, one multi-host connection string with
// target_session_attrs=read-write) while one Client holds a fenced lock,
// leads an election through Run and holds a semaphore's only permit, and
// another Client waits for the lock and the permit and campaigns through
// Run. Each time:
//   - every hold on the old primary reports ErrLockLost within 2H of the
//     server ending it;
//   - the waiting Lock and Acquire ride through and are granted on the new
//     primary (in pg_locks, to the waiter's backend);
//   - the old leader's Run campaigns on instead of returning, so two
//     candidates campaign on the new primary: the one that waited through
//     the switchover and the old leader. One of them leads, in pg_locks,
//     its fn begun after the old leader's context was cancelled; the other
//     campaigns on;
//   - a Client that first campaigns (and locks) while no node is the
//     primary waits, and leads once the new primary answers;
//   - fences and terms only grow, and CheckFence on the new primary refuses
//     every earlier one and accepts the newest.
//
// A watcher reads pg_locks on all three nodes every few milliseconds
// throughout: no key or slot is granted on two nodes at once.
func TestHASwitchoverAndBack(t *testing.T) {
	t.Parallel()
	began := time.Now()
	cluster := pgtest.NewPatroniCluster(t)
	t.Logf("cluster of three nodes up after %v", time.Since(began).Round(time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), haTimeout)
	defer cancel()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("%s%s", fmt.Sprintf(format, args...), cluster.Logs())
	}

	const db = "pgcoord_ha"
	first, err := cluster.Primary(ctx)
	if err != nil {
		fail("primary: %v", err)
	}
	createDatabase(t, ctx, cluster.NodeConnString(first, "postgres"), db)
	dsn := cluster.ConnString(db)
	pool := pgtest.Pool(t, dsn)
	if err := Migrate(ctx, pool); err != nil {
		fail("Migrate: %v", err)
	}

	k := HashKey("ha", "fenced")
	parties := [2]*haParty{}
	for i, name := range []string{"a", "b"} {
		c := newTestClient(t, dsn, WithApplicationName("pgcoord-ha-"+name))
		parties[i] = &haParty{name: name, c: c, e: c.Election("ha", WithIdentity(name)), s: c.Semaphore("ha", 1)}
	}
	a, b := parties[0], parties[1]
	watched := map[Key]string{
		k:                     "fenced lock",
		a.e.Key():             "election lock",
		keyOf(a.e.guard):      "election guard",
		keyOf(a.s.slotKey(0)): "permit slot 0",
		keyOf(a.s.queueKey()): "permit queue",
	}
	w := watchLocks(t, cluster, db, watched)
	defer w.stop()

	// The first holder takes all three on the first primary; then the
	// other campaigns too, and waits for the lock and the permit.
	runCtx, stopRuns := context.WithCancel(ctx)
	defer stopRuns()
	holder := a.take(t, ctx, runCtx, k)
	b.run(runCtx)
	waiter := b
	fences, terms := []Term{holder.lock.Fence()}, []Term{holder.leader.Term()}
	primary := first
	for round := 1; round <= 2; round++ {
		waits := waiter.wait(ctx, k, a, b)
		queued := func() (lock, leader, permit bool) {
			return w.waiting(primary, k), w.waiting(primary, a.e.Key()),
				w.waiting(primary, keyOf(a.s.slotKey(0))) || w.granted(primary, keyOf(a.s.queueKey()))
		}
		ok := pgtest.Poll(testTimeout, func() bool {
			lock, leader, permit := queued()
			return lock && leader && permit || a.returned() || b.returned()
		})
		a.checkRunning(fail, round)
		b.checkRunning(fail, round)
		if !ok {
			lock, leader, permit := queued()
			fail("round %d: the waits of %s not all queued on %s within %v: lock %v, campaign %v, permit %v", round, waiter.name, primary, testTimeout, lock, leader, permit)
		}

		to := first
		if round == 1 {
			h, err := cluster.Health(ctx)
			if err != nil || len(h.Sync) == 0 {
				fail("health: %+v, %v", h, err)
			}
			to = slices.Min(h.Sync)
		}
		// A Client that has not connected yet campaigns, and locks,
		// while no node is the primary: once the watcher's read of the
		// old primary fails after the request.
		requested := time.Now()
		window := inWindow(ctx, w, primary, requested, newTestClient(t, dsn, WithApplicationName("pgcoord-ha-window")), round)
		sent, answering, err := cluster.Switchover(ctx, to)
		if err != nil {
			fail("round %d: %v", round, err)
		}
		t.Logf("round %d: switchover %s -> %s: the new primary answered %v after the request", round, primary, to, answering.Sub(sent).Round(time.Millisecond))

		// Every hold on the old primary reports its loss within 2H of the
		// server ending it.
		bound := lossNoticeBound(&core.Config{Heartbeat: DefaultHeartbeat})
		for _, h := range holder.list(k) {
			select {
			case <-h.Done():
			case <-time.After(testTimeout):
				fail("round %d: %s still believed held %v after the switchover", round, h.what, testTimeout)
			}
			at := h.doneAt()
			if !errors.Is(h.Err(), ErrLockLost) {
				fail("round %d: %s ended with %v, want ErrLockLost", round, h.what, h.Err())
			}
			var gone time.Time
			if !pgtest.Poll(testTimeout, func() (ok bool) { gone, ok = w.goneAt(primary, h.key, h.pid); return ok }) {
				fail("round %d: the watcher never saw %s held on %s, then gone", round, h.what, primary)
			}
			t.Logf("round %d: %s reported lost %v after the request, %v after the watcher found it gone from %s",
				round, h.what, at.Sub(sent).Round(time.Millisecond), at.Sub(gone).Round(time.Millisecond), primary)
			if at.Sub(gone) > bound {
				fail("round %d: %s reported lost %v after the server had ended it, want within 2H = %v", round, h.what, at.Sub(gone), bound)
			}
		}

		// Every wait rode through and was granted on the new primary.
		next := waits.receive(t, fail, round, w.describe)
		for _, h := range next.list(k) {
			t.Logf("round %d: %s granted %v after the request, %v after the new primary answered",
				round, h.what, h.at.Sub(sent).Round(time.Millisecond), h.at.Sub(answering).Round(time.Millisecond))
			if pids := w.grantedTo(to, h.key); !slices.Equal(pids, []int32{h.pid}) {
				fail("round %d: pg_locks on the new primary %s: %s held by %v, want only the new holder's backend %d", round, to, h.what, pids, h.pid)
			}
		}
		// The new leader's work begins after the old leader's context was
		// cancelled. Its term may be issued earlier (Since): a leader whose
		// predecessor's term ended with a change of server wins, then waits
		// out L before its fn starts (E13).
		if ca := holder.leader.cancelledAt(); !ca.Before(next.leaderAt) {
			fail("round %d: the new leader's fn began at %v (term issued at %v), not after the old leader's context was cancelled at %v", round, next.leaderAt, next.leader.Since(), ca)
		}
		// The candidate that did not win campaigns on, on the new
		// primary. Both campaigned there: the one that waited through
		// the switchover, and the old leader's Run, which campaigned
		// again once it knew its term had ended; whichever of them the
		// new primary saw first won.
		loser := a
		if next.leaderParty == a {
			loser = b
		}
		if !pgtest.Poll(testTimeout, func() bool { return w.waiting(to, a.e.Key()) || loser.returned() }) || loser.returned() {
			loser.checkRunning(fail, round)
			fail("round %d: %s leads; the campaign of %s does not wait on the new primary %s within %v", round, next.leaderParty.name, loser.name, to, testTimeout)
		}
		if next.leaderParty == holder.leaderParty {
			t.Logf("round %d: the old leader's Run (%s) campaigned again and won on the new primary before the waiting candidate (%s), which campaigns on", round, next.leaderParty.name, loser.name)
		}
		window.check(t, fail, answering)

		fences, terms = append(fences, next.lock.Fence()), append(terms, next.leader.Term())
		for _, tokens := range []struct {
			what string
			key  Key
			seq  []Term
		}{{"fence", k, fences}, {"term", a.e.Key(), terms}} {
			for i := 1; i < len(tokens.seq); i++ {
				if tokens.seq[i] <= tokens.seq[i-1] {
					fail("round %d: %ss handed out %v, want strictly increasing", round, tokens.what, tokens.seq)
				}
			}
			// On the new primary, every earlier token is stale and the
			// newest is not.
			for i, tok := range tokens.seq {
				err := checkFenceOn(ctx, pool, tokens.key, tok)
				newest := i == len(tokens.seq)-1
				if newest && err != nil || !newest && !errors.Is(err, ErrStaleFence) {
					fail("round %d: CheckFence of %s %d (of %v) on %s: %v, want %s", round, tokens.what, tok, tokens.seq, to,
						err, map[bool]string{true: "nil", false: "ErrStaleFence"}[newest])
				}
			}
		}
		holder, waiter, primary = next, holder.party, to
	}
	a.checkRunning(fail, 3)
	b.checkRunning(fail, 3)

	// The last holder holds all three, on the first primary again; the
	// other Run still campaigns.
	if err := holder.lock.Unlock(ctx); err != nil {
		fail("Unlock after the switchover back: %v", err)
	}
	if err := holder.permit.Release(ctx); err != nil {
		fail("Release after the switchover back: %v", err)
	}
	stopRuns()
	for _, p := range parties {
		if err := p.runEnd(); !errors.Is(err, context.Canceled) {
			fail("Run of %s returned %v when its ctx was cancelled, want context.Canceled", p.name, err)
		}
	}
	if !errors.Is(holder.leader.Err(), ErrNotHeld) {
		fail("the last leadership ended with %v once Run returned, want ErrNotHeld", holder.leader.Err())
	}

	w.stop()
	if err := w.check(); err != nil {
		fail("%v", err)
	}
	t.Logf("pg_locks read %s; the whole test took %v", w.summary(), time.Since(began).Round(time.Millisecond))
}

// createDatabase creates database name through dsn.
func createDatabase(t *testing.T, ctx context.Context, dsn, name string) {
	t.Helper()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatal(err)
	}
}

// checkFenceOn runs CheckFence for key and fence in a transaction of its
// own on pool, and rolls it back.
func checkFenceOn(ctx context.Context, pool *pgxpool.Pool, key Key, fence Term) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.Background())
	return CheckFence(ctx, tx, key, fence)
}

// haParty is one Client of the switchover test with its election, which it
// runs (Election.Run) from its first campaign to the end of the test, and
// its semaphore.
type haParty struct {
	name string
	c    *Client
	e    *Election
	s    *Semaphore
	led  chan haGot[*Leadership] // every leadership its Run begins, when fn started

	ran    chan struct{} // closed when its Run has returned
	runErr error         // what its Run returned, once ran is closed
}

// run starts the party's Run, until ctx ends. Its fn reports each
// leadership and holds it until it ends.
func (p *haParty) run(ctx context.Context) {
	p.led, p.ran = make(chan haGot[*Leadership], 8), make(chan struct{})
	go func() {
		defer close(p.ran)
		p.runErr = p.e.Run(ctx, func(ctx context.Context, term Term) error {
			ld, _ := LeadershipFromContext(ctx)
			p.led <- haGot[*Leadership]{v: ld, at: time.Now()}
			<-ctx.Done()
			return nil
		})
	}()
}

// returned reports whether the party's Run has returned.
func (p *haParty) returned() bool {
	select {
	case <-p.ran:
		return true
	default:
		return false
	}
}

// checkRunning fails the test if the party's Run has returned.
func (p *haParty) checkRunning(fail func(string, ...any), round int) {
	if p.returned() {
		fail("round %d: Run of %s returned %v; it must campaign on until its ctx ends", round, p.name, p.runErr)
	}
}

// runEnd waits, bounded, for the party's Run to return.
func (p *haParty) runEnd() error {
	select {
	case <-p.ran:
		return p.runErr
	case <-time.After(testTimeout):
		return fmt.Errorf("Run did not return within %v of its ctx's end", testTimeout)
	}
}

// haHolds are what one party holds: a fenced lock, a leadership, a permit.
type haHolds struct {
	party                      *haParty // of the lock and the permit
	lock                       *Lock
	leader                     *Leadership
	leaderParty                *haParty // whose Run leads
	permit                     *Permit
	lockAt, leaderAt, permitAt time.Time // when each acquire returned
	watch                      map[string]*haDone
}

// haDone records when a hold's Done channel closed.
type haDone struct {
	ch <-chan struct{}
	mu sync.Mutex
	at time.Time
}

func watchDone(ch <-chan struct{}) *haDone {
	d := &haDone{ch: ch}
	go func() {
		<-ch
		d.mu.Lock()
		d.at = time.Now()
		d.mu.Unlock()
	}()
	return d
}

// haHold is one of haHolds, seen uniformly.
type haHold struct {
	what string
	key  Key   // the key the hold has granted in pg_locks
	pid  int32 // the backend that holds it
	at   time.Time
	done *haDone
	err  func() error
}

func (h haHold) Done() <-chan struct{} { return h.done.ch }
func (h haHold) Err() error            { return h.err() }

// doneAt returns when Done closed, once it has.
func (h haHold) doneAt() time.Time {
	<-h.done.ch
	for {
		h.done.mu.Lock()
		at := h.done.at
		h.done.mu.Unlock()
		if !at.IsZero() {
			return at
		}
		time.Sleep(time.Millisecond)
	}
}

func (hs *haHolds) list(k Key) []haHold {
	return []haHold{
		{what: "fenced lock", key: k, pid: hs.lock.core.S.PID(), at: hs.lockAt, done: hs.watch["lock"], err: hs.lock.Err},
		{what: "leadership of " + hs.leaderParty.name, key: hs.leaderParty.e.Key(), pid: hs.leader.lock.S.PID(), at: hs.leaderAt, done: hs.watch["leader"], err: hs.leader.Err},
		{what: "permit", key: keyOf(hs.party.s.slotKey(hs.permit.Slot())), pid: hs.permit.l.S.PID(), at: hs.permitAt, done: hs.watch["permit"], err: hs.permit.Err},
	}
}

func (hs *haHolds) watchAll() {
	hs.watch = map[string]*haDone{
		"lock":   watchDone(hs.lock.Done()),
		"leader": watchDone(hs.leader.Done()),
		"permit": watchDone(hs.permit.Done()),
	}
}

// take takes the lock, starts the party's Run until runCtx ends and waits
// for its leadership, and takes the permit, with nobody else waiting.
func (p *haParty) take(t *testing.T, ctx, runCtx context.Context, k Key) *haHolds {
	t.Helper()
	hs := &haHolds{party: p}
	var err error
	if hs.lock, err = p.c.Lock(ctx, k, WithFence()); err != nil {
		t.Fatalf("Lock: %v", err)
	}
	hs.lockAt = time.Now()
	p.run(runCtx)
	select {
	case g := <-p.led:
		hs.leader, hs.leaderAt, hs.leaderParty = g.v, g.at, p
	case <-p.ran:
		t.Fatalf("Run: %v", p.runErr)
	case <-time.After(testTimeout):
		t.Fatal("Run did not lead within", testTimeout)
	}
	if hs.permit, err = p.s.Acquire(ctx); err != nil {
		t.Fatalf("Acquire: %v", err)
	}
	hs.permitAt = time.Now()
	hs.watchAll()
	return hs
}

// haWaits are the blocking acquires of one party, under way, and its
// campaigning Run.
type haWaits struct {
	party      *haParty   // whose Lock and Acquire these are
	candidates []*haParty // whose Runs campaign: the next leader is one of them
	lock       chan haGot[*Lock]
	permit     chan haGot[*Permit]
}

type haGot[T any] struct {
	v   T
	err error
	at  time.Time
}

func goGet[T any](f func() (T, error)) chan haGot[T] {
	ch := make(chan haGot[T], 1)
	go func() {
		v, err := f()
		ch <- haGot[T]{v, err, time.Now()}
	}()
	return ch
}

// wait starts a blocking Lock with a fence and an Acquire of the party,
// each bounded by ctx; its Run campaigns already, as may the Runs of
// candidates.
func (p *haParty) wait(ctx context.Context, k Key, candidates ...*haParty) *haWaits {
	return &haWaits{
		party:      p,
		candidates: candidates,
		lock:       goGet(func() (*Lock, error) { return p.c.Lock(ctx, k, WithFence()) }),
		permit:     goGet(func() (*Permit, error) { return p.s.Acquire(ctx) }),
	}
}

// receive waits, bounded, for the two acquires and the next leadership of
// one of the candidates' Runs, and fails the test unless each got its
// hold and every Run campaigns on.
func (ws *haWaits) receive(t *testing.T, fail func(string, ...any), round int, state func() string) *haHolds {
	t.Helper()
	hs := &haHolds{party: ws.party}
	timer := time.NewTimer(2 * time.Minute)
	defer timer.Stop()
	var errs []string
	for range 3 {
		select {
		case g := <-ws.lock:
			hs.lock, hs.lockAt = g.v, g.at
			if g.err != nil {
				errs = append(errs, fmt.Sprintf("Lock: %v", g.err))
			}
		case g := <-ws.candidates[0].led:
			hs.leader, hs.leaderAt, hs.leaderParty = g.v, g.at, ws.candidates[0]
		case g := <-ws.candidates[1].led:
			hs.leader, hs.leaderAt, hs.leaderParty = g.v, g.at, ws.candidates[1]
		case <-ws.candidates[0].ran:
			fail("round %d: Run of %s returned %v instead of campaigning on", round, ws.candidates[0].name, ws.candidates[0].runErr)
		case <-ws.candidates[1].ran:
			fail("round %d: Run of %s returned %v instead of campaigning on", round, ws.candidates[1].name, ws.candidates[1].runErr)
		case g := <-ws.permit:
			hs.permit, hs.permitAt = g.v, g.at
			if g.err != nil {
				errs = append(errs, fmt.Sprintf("Acquire: %v", g.err))
			}
		case <-timer.C:
			fail("round %d: the waits of %s did not return within 2 minutes of the switchover (returned: lock %v, leader %v, permit %v; errors: %q); Stat %+v; pg_locks:\n%s",
				round, ws.party.name, hs.lock != nil, hs.leader != nil, hs.permit != nil, errs, ws.party.c.Stat(), state())
		}
	}
	if len(errs) > 0 {
		fail("round %d: waits of %s that should have ridden through the switchover failed:\n%s", round, ws.party.name, strings.Join(errs, "\n"))
	}
	hs.watchAll()
	return hs
}

// haWindow is a Campaign and a Lock of a fresh Client, started while no
// node is the primary.
type haWindow struct {
	round   int
	started chan time.Time // when both were started; closed if never
	leader  chan haGot[*Leadership]
	lock    chan haGot[*Lock]
}

// inWindow starts, once the watcher's first read of old that started after
// since has failed, a Campaign (of an election of its own) and a Lock
// through c, which has not connected yet, each bounded by ctx.
func inWindow(ctx context.Context, w *lockWatch, old string, since time.Time, c *Client, round int) *haWindow {
	hw := &haWindow{round: round, started: make(chan time.Time, 1), leader: make(chan haGot[*Leadership], 1), lock: make(chan haGot[*Lock], 1)}
	go func() {
		if !pgtest.Poll(time.Minute, func() bool { return w.failedSince(old, since) }) {
			close(hw.started)
			return
		}
		hw.started <- time.Now()
		name := fmt.Sprintf("ha-window-%d", round)
		go func() {
			ld, err := c.Election(name, WithIdentity("window")).Campaign(ctx)
			hw.leader <- haGot[*Leadership]{ld, err, time.Now()}
		}()
		l, err := c.Lock(ctx, HashKey(name))
		hw.lock <- haGot[*Lock]{l, err, time.Now()}
	}()
	return hw
}

// check fails the test unless the Campaign and the Lock started in the
// window both succeeded, once the new primary answered, and ends them.
func (hw *haWindow) check(t *testing.T, fail func(string, ...any), answering time.Time) {
	t.Helper()
	var started time.Time
	select {
	case at, ok := <-hw.started:
		if !ok {
			fail("round %d: the watcher never saw the old primary fail", hw.round)
		}
		started = at
	case <-time.After(testTimeout):
		fail("round %d: the window's Campaign and Lock did not start within %v", hw.round, testTimeout)
	}
	if !started.Before(answering) {
		// The machine was too slow to start them in the window: they
		// prove nothing then, but must work all the same.
		t.Logf("round %d: the window's Campaign and Lock started %v after the new primary answered, not before", hw.round, started.Sub(answering))
	}
	for _, got := range []struct {
		what string
		ch   <-chan error
	}{
		{"Campaign", pipe(hw.leader, func(ld *Leadership) error { return ld.Resign(context.Background()) })},
		{"Lock", pipe(hw.lock, func(l *Lock) error { return l.Unlock(context.Background()) })},
	} {
		select {
		case err := <-got.ch:
			if err != nil {
				fail("round %d: %s of a fresh Client started %v before the new primary answered: %v; it must wait for a primary until its ctx ends",
					hw.round, got.what, answering.Sub(started).Round(time.Millisecond), err)
			}
		case <-time.After(testTimeout):
			fail("round %d: %s of a fresh Client started in the window did not return within %v", hw.round, got.what, testTimeout)
		}
	}
	t.Logf("round %d: a fresh Client's Campaign and Lock started %v before the new primary answered, and succeeded", hw.round, answering.Sub(started).Round(time.Millisecond))
}

// pipe delivers the error of an acquire, or else the error of end applied
// to what it got.
func pipe[T any](ch <-chan haGot[T], end func(T) error) <-chan error {
	out := make(chan error, 1)
	go func() {
		g := <-ch
		if g.err != nil {
			out <- g.err
			return
		}
		out <- end(g.v)
	}()
	return out
}

// lockWatch reads the advisory locks of a database on every node of a
// cluster, over and over, from a goroutine per node, until stopped.
type lockWatch struct {
	keys    map[Key]string
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	stopped sync.Once

	mu      sync.Mutex
	samples map[string][]lockSample // by node
}

// lockSample is one read of pg_locks on one node: the query ran between
// start and end, and saw granted (key -> pids) and waiting (key -> count),
// or failed with err.
type lockSample struct {
	start, end time.Time
	granted    map[Key][]int32
	waiting    map[Key]int
	err        error
}

// watchLocks starts reading pg_locks on every node of cluster, for the
// database db, every few milliseconds, keeping what it sees of keys, until
// stopped or for haTimeout at most.
func watchLocks(t *testing.T, cluster *pgtest.PatroniCluster, db string, keys map[Key]string) *lockWatch {
	ctx, cancel := context.WithTimeout(context.Background(), haTimeout)
	w := &lockWatch{keys: keys, cancel: cancel, samples: map[string][]lockSample{}}
	for _, node := range cluster.Nodes() {
		dsn := cluster.NodeConnString(node, db)
		w.wg.Add(1)
		go func() {
			defer w.wg.Done()
			w.run(ctx, node, dsn)
		}()
	}
	t.Cleanup(w.stop)
	return w
}

func (w *lockWatch) stop() {
	w.stopped.Do(func() {
		w.cancel()
		w.wg.Wait()
	})
}

// run reads pg_locks on one node until ctx ends, connecting again after
// each failure.
func (w *lockWatch) run(ctx context.Context, node, dsn string) {
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.Background())
		}
	}()
	for ctx.Err() == nil {
		s := lockSample{start: time.Now()}
		if conn == nil {
			cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			conn, s.err = pgx.Connect(cctx, dsn)
			cancel()
		}
		if s.err == nil {
			s.granted, s.waiting, s.err = w.read(ctx, conn)
		}
		s.end = time.Now()
		if ctx.Err() != nil {
			return
		}
		if s.err != nil && conn != nil {
			conn.Close(context.Background())
			conn = nil
		}
		w.mu.Lock()
		w.samples[node] = append(w.samples[node], s)
		w.mu.Unlock()
		pause := 5 * time.Millisecond
		if s.err != nil {
			pause = 20 * time.Millisecond
		}
		select {
		case <-ctx.Done():
		case <-time.After(pause):
		}
	}
}

func (w *lockWatch) read(ctx context.Context, conn *pgx.Conn) (map[Key][]int32, map[Key]int, error) {
	qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	rows, err := conn.Query(qctx, `
SELECT classid::int8, objid::int8, objsubid::int4, pid, granted FROM pg_locks
WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`)
	if err != nil {
		return nil, nil, err
	}
	granted, waiting := map[Key][]int32{}, map[Key]int{}
	for rows.Next() {
		var classid, objid int64
		var objsubid, pid int32
		var g bool
		if err := rows.Scan(&classid, &objid, &objsubid, &pid, &g); err != nil {
			return nil, nil, err
		}
		k, err := KeyFromLock(uint32(classid), uint32(objid), int16(objsubid))
		if err != nil {
			return nil, nil, err
		}
		if _, ok := w.keys[k]; !ok {
			continue
		}
		if g {
			granted[k] = append(granted[k], pid)
		} else {
			waiting[k]++
		}
	}
	return granted, waiting, rows.Err()
}

// last returns the newest successful sample of node.
func (w *lockWatch) last(node string) (lockSample, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	ss := w.samples[node]
	for i := len(ss) - 1; i >= 0; i-- {
		if ss[i].err == nil {
			return ss[i], true
		}
	}
	return lockSample{}, false
}

// waiting reports whether the newest read of node shows a waiter for k.
func (w *lockWatch) waiting(node string, k Key) bool {
	s, ok := w.last(node)
	return ok && s.waiting[k] > 0
}

// granted reports whether the newest read of node shows k granted.
func (w *lockWatch) granted(node string, k Key) bool {
	s, ok := w.last(node)
	return ok && len(s.granted[k]) > 0
}

// grantedTo returns the backends that hold k on node by a read that
// started now or later.
func (w *lockWatch) grantedTo(node string, k Key) []int32 {
	since := time.Now()
	var s lockSample
	pgtest.Poll(testTimeout, func() bool {
		var ok bool
		s, ok = w.last(node)
		return ok && s.start.After(since)
	})
	return s.granted[k]
}

// goneAt returns the end of the first read of node after which k was no
// longer seen granted to pid: a read that failed, or that did not show it.
// The server had ended the hold by then.
func (w *lockWatch) goneAt(node string, k Key, pid int32) (time.Time, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	ss := w.samples[node]
	lastHeld := -1
	for i, s := range ss {
		if s.err == nil && slices.Contains(s.granted[k], pid) {
			lastHeld = i
		}
	}
	if lastHeld < 0 || lastHeld == len(ss)-1 {
		return time.Time{}, false
	}
	return ss[lastHeld+1].end, true
}

// failedSince reports whether a read of node that started after since has
// failed.
func (w *lockWatch) failedSince(node string, since time.Time) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	ss := w.samples[node]
	for i := len(ss) - 1; i >= 0 && ss[i].start.After(since); i-- {
		if ss[i].err != nil {
			return true
		}
	}
	return false
}

// check looks through every read for a key granted on two nodes at once
// (or to two backends on one node). A run of reads of one node that show
// the key granted to the same backend proves it held from the end of the
// run's first read to the start of its last; a single read proves it held
// at some moment within that read. Two runs on different nodes conflict
// when such proven times overlap.
func (w *lockWatch) check() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	type run struct {
		node        string
		pid         int32
		first, last lockSample
	}
	var errs []error
	for k, what := range w.keys {
		var runs []run
		for node, ss := range w.samples {
			var cur *run
			for _, s := range ss {
				pids := s.granted[k]
				if s.err == nil && len(pids) > 1 {
					errs = append(errs, fmt.Errorf("%s (%v) granted to backends %v at once on %s at %v", what, k, pids, node, s.start))
				}
				if s.err != nil || len(pids) != 1 || cur != nil && cur.pid != pids[0] {
					if cur != nil {
						runs = append(runs, *cur)
						cur = nil
					}
				}
				if s.err == nil && len(pids) == 1 {
					if cur == nil {
						cur = &run{node: node, pid: pids[0], first: s}
					}
					cur.last = s
				}
			}
			if cur != nil {
				runs = append(runs, *cur)
			}
		}
		for i, r := range runs {
			for _, q := range runs[i+1:] {
				if r.node == q.node {
					continue
				}
				// Proven times: [first.end, last.start] for a run of
				// reads; within [start, end] for a single read.
				rlo, rhi := r.first.end, r.last.start
				qlo, qhi := q.first.end, q.last.start
				overlap := !rlo.After(rhi) && !qlo.After(qhi) && !maxTime(rlo, qlo).After(minTime(rhi, qhi))
				within := func(a run, lo, hi time.Time) bool { // a single read of a within another run's proven time
					return a.first.start.Equal(a.last.start) && !lo.After(hi) && !a.first.start.Before(lo) && !a.first.end.After(hi)
				}
				if overlap || within(r, qlo, qhi) || within(q, rlo, rhi) {
					errs = append(errs, fmt.Errorf("%s (%v) granted on two nodes at once: on %s to backend %d from %v to %v, on %s to backend %d from %v to %v",
						what, k, r.node, r.pid, r.first.start, r.last.end, q.node, q.pid, q.first.start, q.last.end))
				}
			}
		}
	}
	return errors.Join(errs...)
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// describe returns the newest successful read of every node: the watched
// keys granted (to which backends) and waited for.
func (w *lockWatch) describe() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var lines []string
	for node, ss := range w.samples {
		for i := len(ss) - 1; i >= 0; i-- {
			if s := ss[i]; s.err == nil {
				var parts []string
				for k, pids := range s.granted {
					parts = append(parts, fmt.Sprintf("%s granted to %v", w.keys[k], pids))
				}
				for k, n := range s.waiting {
					parts = append(parts, fmt.Sprintf("%s waited for by %d", w.keys[k], n))
				}
				slices.Sort(parts)
				lines = append(lines, fmt.Sprintf("%s at %v: %s", node, s.start.Format("15:04:05.000"), strings.Join(parts, ", ")))
				break
			}
		}
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

// summary says how many reads each node answered and how many failed.
func (w *lockWatch) summary() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var parts []string
	for node, ss := range w.samples {
		failed := 0
		for _, s := range ss {
			if s.err != nil {
				failed++
			}
		}
		parts = append(parts, fmt.Sprintf("%s: %d reads, %d failed", node, len(ss), failed))
	}
	slices.Sort(parts)
	return strings.Join(parts, "; ")
}

// The switchover test's pg_locks check catches a key granted on two nodes
// at once, by runs of reads or by a single read within another node's run,
// and accepts holds that follow one another.
func TestHALockWatchCatchesTwoNodes(t *testing.T) {
	k := HashKey("ha", "checker")
	t0 := time.Now()
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	held := func(from, to int, pid int32) lockSample {
		return lockSample{start: at(from), end: at(to), granted: map[Key][]int32{k: {pid}}}
	}
	free := func(from, to int) lockSample { return lockSample{start: at(from), end: at(to)} }
	failed := func(from, to int) lockSample {
		return lockSample{start: at(from), end: at(to), err: errors.New("connection refused")}
	}
	for _, tc := range []struct {
		name    string
		samples map[string][]lockSample
		want    string // in the error; "" for none
	}{
		{"one after the other", map[string][]lockSample{
			"n0": {held(0, 5, 1), held(10, 15, 1), failed(20, 25), failed(30, 35)},
			"n1": {failed(0, 5), free(10, 15), free(20, 25), held(30, 35, 2), held(40, 45, 2)},
		}, ""},
		{"runs overlap", map[string][]lockSample{
			"n0": {held(0, 5, 1), held(10, 15, 1), held(20, 25, 1), held(30, 35, 1)},
			"n1": {free(0, 5), held(12, 17, 2), held(22, 27, 2), free(32, 37)},
		}, "granted on two nodes at once"},
		{"a single read within another node's run", map[string][]lockSample{
			"n0": {held(0, 5, 1), held(10, 15, 1), held(20, 25, 1), held(30, 35, 1)},
			"n1": {free(0, 5), held(12, 17, 2), free(22, 27)},
		}, "granted on two nodes at once"},
		{"reads that cannot be ordered", map[string][]lockSample{
			"n0": {held(0, 10, 1), free(20, 30)},
			"n1": {free(0, 4), held(5, 15, 2), held(20, 30, 2)},
		}, ""},
		{"two backends on one node", map[string][]lockSample{
			"n0": {{start: at(0), end: at(5), granted: map[Key][]int32{k: {1, 2}}}},
		}, "granted to backends [1 2] at once"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := &lockWatch{keys: map[Key]string{k: "key"}, samples: tc.samples}
			err := w.check()
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("check: %v, want nil", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("check: %v, want an error with %q", err, tc.want)
			}
		})
	}
}
