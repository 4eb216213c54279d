package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// Term is a fencing token: the fence that a lock taken with [WithFence]
// got ([Lock.Fence]), or a leader's term ([Leadership.Term]), which is the
// fence issued for the election's key when the leader won. The fences of
// one key only grow, across processes and restarts, so a greater Term is
// a later holder. Check a holder's writes with [CheckFence] (or
// [Client.CheckFence]) and the key; to store one, int64(term) fits a
// bigint column.
type Term int64

// LeaderInfo describes a leader: its identity, term, when it won, and the
// backend pid that holds the election's lock (pg_terminate_backend(PID)
// forces a new election). The zero LeaderInfo, from Observe, means no
// leader.
type LeaderInfo struct {
	Identity string
	Term     Term
	Since    time.Time
	PID      int32
	// Err, set only by Observe, says that the election could not be read
	// (ErrNotMigrated, a role without the privilege, a pool or connection
	// error); the other fields are then zero, and the leader is unknown
	// until a later LeaderInfo without Err.
	Err error
}

// ElectionOption configures an Election.
type ElectionOption interface {
	applyElection(*Election) error
}

type electionOptionFunc func(*Election) error

func (f electionOptionFunc) applyElection(e *Election) error { return f(e) }

// Limits on election names and identities. Identities travel in NOTIFY
// payloads, which PostgreSQL limits to 8000 bytes.
const (
	maxElectionName = 1024
	maxIdentity     = 1024
)

// WithIdentity sets the identity a candidate leads under, as Leader and
// Observe report it (default: host name and process id, "host:pid"). It
// must be 1 to 1024 bytes of UTF-8 without NUL.
func WithIdentity(identity string) ElectionOption {
	return electionOptionFunc(func(e *Election) error {
		if err := checkText("identity", identity, maxIdentity); err != nil {
			return err
		}
		e.identity = identity
		return nil
	})
}

// An Election is a named leader election in the Client's database. Many
// independent elections coexist, one per name. An Election's methods are
// safe for concurrent use; several candidates may campaign through one
// Election (they then take turns in the process).
//
// An Election is an advisory lock plus a row. The lock, on the election's
// key (Election.Key), says who leads: the server frees it the moment the
// leader's backend ends, so a waiting candidate takes over in
// milliseconds when a leader's process dies. The row in the leaders table
// says who that is (identity, term, since, backend pid). The term is the
// fence of the election's key (see WithFence): it grows with every new
// leader, across restarts, and CheckFence accepts it.
//
// # States
//
// A candidate campaigns (Campaign, or Run): it waits for the lock
// on the server, on one of the Client's bounded waits (see WithMaxWaits);
// a campaign gives its wait up every loss deadline and takes it again, so
// campaigns and locks of one Client beyond WithMaxWaits all get their
// turn. Once it has the lock, it takes the election's guard (below) and,
// meanwhile, in one statement issues a fresh fence as its term, writes the
// row and notifies observers; then it leads:
// Run calls fn with the term and a context that is cancelled when the
// leadership ends. It ends by Resign (Run resigns when fn returns), by a
// RequestResign from any process, by loss of either connection it rests
// on, or by Close. Ending cancels the leader's context first and only then
// frees the guard and the lock.
//
// # The guard
//
// A leader whose backend is terminated, or whose connection
// breaks, loses the lock at once on the server, but its process may not
// notice for up to a heartbeat interval (WithHeartbeat), or, with the
// network silent, the loss deadline (WithLossDeadline). So that no new
// leader starts before the old one's context is cancelled, a leader also
// holds a second lock, the guard, on another connection: the Client's
// guard session, one per Client, shared by all its elections. A new leader
// takes the guard before it starts. If the old leader's process died, its
// guard went with it and the new leader starts at once. If the process
// lives, it frees the guard right after it has cancelled its leader's
// context (within a heartbeat interval of the loss, normally); a new
// leader waits for the guard at most the loss deadline, after which the
// old leader has declared the loss by its own clock, and then starts
// without the guard. It records that in the leaders row, and keeps trying
// to take the guard while it leads; until it has, a candidate that takes
// over from it waits the loss deadline after winning before it starts. A
// new leader waits the same after a server restart or a failover ended its
// predecessor's term (the leaders row records the server's start time),
// since both of the predecessor's connections ended at once and its
// process may live on. A process paused longer than L (a stopped process,
// a long GC pause) cannot know it was replaced; its term is then older
// than the new leader's, and CheckFence rejects its writes.
//
// Two cases look to a new leader like a killed process, which it must
// take over from at once, although the old leader's process may live: both
// of the old leader's connections lost less than two heartbeat intervals
// apart (terminated by an administrator at once or one after the other:
// the old leader notices a lost connection only at its next heartbeat, so
// a guard lost first may be gone unnoticed when the lock goes; or ended by
// a server's fast shutdown, which terminates backends one after another,
// so that a candidate may win on the server that is shutting down), and a
// crash-restart of the server after a backend crashed, which ends every
// connection but keeps the server's start time. The new leader then starts
// at once, and the old leader's context is cancelled within two heartbeat
// intervals of its first loss (at most L, its own lease): the two may
// overlap that long, and the old leader's writes are stale meanwhile, so
// CheckFence rejects them.
//
// # Bounds
//
// With the defaults (heartbeat 1 s, loss deadline L = 5 s):
//   - leader's process killed: a waiting candidate leads one round trip
//     after the server has freed the lock and the guard, which it does as
//     the killed process's backends exit (they notice the closed sockets
//     at once; their exits take milliseconds, more on a busy server);
//   - leader's backend terminated, process alive: the old leader's context
//     is cancelled within a heartbeat interval, and the new leader starts
//     right after, never before; at most L; L after winning when the old
//     leader led without the guard;
//   - server restarted, or failed over to a standby: the new leader starts
//     L after it won, so after the old leader's context was cancelled;
//   - network to the leader silent: the old leader's context is cancelled
//     within L, the server frees the lock within 2L, and a candidate leads
//     then;
//   - Leader reports ErrNoLeader as soon as the server has freed the lock.
//
// # Connections
//
// A Client's leaderships live on its shared backends (the
// lock) and its guard session (the guard); a waiting campaign uses one of
// its bounded waits; Observe, and leaders (to hear RequestResign), use the
// Client's listener connection. So a Client that takes part in elections
// uses at most WithSharedBackends + WithMaxWaits + 2 connections, however
// many elections it leads or follows.
type Election struct {
	c        *Client
	name     string
	identity string
	key      Key // the leadership lock; its fence is the term
	guard    Key // held by the leader on the Client's guard session
	prefix   string
	err      error
}

// Election returns the election called name. It does not touch the
// network. An invalid name or option is reported by every method of the
// returned Election: a name must be 1 to 1024 bytes of UTF-8 without NUL.
// Elections need the tables of Migrate.
func (c *Client) Election(name string, opts ...ElectionOption) *Election {
	e := &Election{c: c, name: name, key: electionKey(c.cfg.schema, name), guard: HashKey("pgcoord.election.guard", c.cfg.schema, name)}
	k, _ := e.key.Int64()
	e.prefix = strconv.FormatInt(k, 10) + ":"
	if err := checkText("election name", name, maxElectionName); err != nil {
		e.err = errorf("election: %w", err)
		return e
	}
	host, _ := os.Hostname()
	e.identity = host + ":" + strconv.Itoa(os.Getpid())
	for _, o := range opts {
		if o == nil {
			e.err = errorf("election %q: nil option", name)
			return e
		}
		if err := o.applyElection(e); err != nil {
			e.err = errorf("election %q: %w", name, err)
			return e
		}
	}
	return e
}

// Name returns the election's name.
func (e *Election) Name() string { return e.name }

// Key returns the election's lock key: pass it, with a leader's term, to
// CheckFence. It is HashKey("pgcoord.election", schema, name), with the
// schema of the Client's tables (WithSchema): elections of one name in two
// schemas of a database are independent, as their rows are.
func (e *Election) Key() Key { return e.key }

// electionKey returns the lock key of the election called name whose row
// is in schema.
func electionKey(schema, name string) Key { return HashKey("pgcoord.election", schema, name) }

// Leadership is a won election: it lasts until Resign, a RequestResign
// from any process, the loss of a connection it rests on, or the Client's
// Close. Its methods are safe for concurrent use.
type Leadership struct {
	e     *Election
	lock  *Lock // on one of the Client's shared backends
	guard *Lock // on the Client's guard session; nil while leading without it (guarded by mu)
	sub   *subscription
	term  Term
	since time.Time

	ctx       context.Context
	cancel    context.CancelCauseFunc
	resign    chan struct{} // closed by Resign
	once      sync.Once
	done      chan struct{}
	mu        sync.Mutex
	err       error         // why it ended
	cancelled time.Time     // when ctx had been cancelled, before anything was released
	stamped   chan struct{} // closed once cancelled is set
}

// leaderParent is the parent of a leader's context: it is the Client's
// closing context, so that Close cancels every leader's context in its
// first step, synchronously, before it releases any lock; and it carries
// the values of the campaign's ctx. Keys are looked up in closing first,
// which holds none but the one that lets the context package propagate
// its cancellation without a goroutine.
type leaderParent struct {
	context.Context // the Client's closing context
	values          context.Context
}

func (p leaderParent) Value(key any) any {
	if v := p.Context.Value(key); v != nil {
		return v
	}
	return p.values.Value(key)
}

// leadershipKey is the key of the Leadership in its own context.
type leadershipKey struct{}

// leadershipOf returns the Leadership whose context ctx is, or derives
// from; nil if none.
func leadershipOf(ctx context.Context) *Leadership {
	ld, _ := ctx.Value(leadershipKey{}).(*Leadership)
	return ld
}

// cancelledAt returns when the leader's context had been cancelled (zero
// while leading): by the process's clock, before the guard and the lock
// were released.
func (ld *Leadership) cancelledAt() time.Time {
	if ld.ctx.Err() != nil {
		<-ld.stamped // end sets it right after the cancel
	}
	ld.mu.Lock()
	defer ld.mu.Unlock()
	return ld.cancelled
}

// Term returns the leader's term.
func (ld *Leadership) Term() Term { return ld.term }

// Since returns when the leadership began, by the server's clock: when the
// term was issued, right after the election's lock was won. Leader and
// Observe report the same time. The leader's work may start a little
// later, once the guard is taken too.
func (ld *Leadership) Since() time.Time { return ld.since }

// Context returns a context that is cancelled, with the reason as its
// cause, as soon as the leadership ends, before anything is released.
// Work that must run only while leading runs under it.
func (ld *Leadership) Context() context.Context { return ld.ctx }

// Done returns a channel that is closed when the leadership has ended and
// its locks are released (or lost).
func (ld *Leadership) Done() <-chan struct{} { return ld.done }

// Valid reports, from the process's own state with no round trip, whether
// the leadership holds as of now: nil while its context is live and the
// server has answered on the connections of its lock and guard within the
// loss deadline. Otherwise it returns the context's cause, or an error
// wrapping ErrLockLost that says how long the server has not answered.
//
// Check it right before each step that must run only while leading, such
// as starting a job: a process that was paused (a long GC pause, SIGSTOP,
// a frozen VM) for longer than the loss deadline may run a little after
// it resumes before its timers cancel the context, while a successor
// that took over meanwhile already leads; Valid tells it at once. (The
// exception stated at the Election type, both connections lost together,
// is not detected here either; fence the writes, see CheckFence.)
func (ld *Leadership) Valid() error {
	if ld.ctx.Err() != nil {
		return context.Cause(ld.ctx)
	}
	oldest := ld.lock.s.answeredAt()
	if g := ld.guardLock(); g != nil {
		if t := g.s.answeredAt(); t.Before(oldest) {
			oldest = t
		}
	}
	if age := time.Since(oldest); age >= ld.e.c.cfg.lossDeadline {
		return errorf("election %q: term %d: %w: no answer from the server for %v (loss deadline %v)",
			ld.e.name, ld.term, ErrLockLost, age.Round(time.Millisecond), ld.e.c.cfg.lossDeadline)
	}
	return nil
}

// LeadershipFromContext returns the Leadership whose context ctx is, or
// derives from: the context that [Election.Run] gives fn, or
// [Leadership.Context]. ok is false for any other context.
func LeadershipFromContext(ctx context.Context) (ld *Leadership, ok bool) {
	ld = leadershipOf(ctx)
	return ld, ld != nil
}

// Err returns nil while leading. Once Done is closed it says why the
// leadership ended: an error wrapping ErrNotHeld after Resign or a
// RequestResign, ErrLockLost (with the cause) after a loss, ErrClosed
// after the Client's Close.
func (ld *Leadership) Err() error {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	return ld.err
}

// Resign ends the leadership: it cancels the leader's context, tells
// observers, and frees the election for the next candidate. ctx bounds
// the wait for the release; the release itself goes on, bounded by the
// loss deadline. It returns nil once the leadership has ended, whatever
// ended it, or ctx's error.
func (ld *Leadership) Resign(ctx context.Context) error {
	ld.once.Do(func() { close(ld.resign) })
	select {
	case <-ld.done:
		return nil
	case <-ctx.Done():
		return errorf("election %q: resign: %w", ld.e.name, context.Cause(ctx))
	}
}

// errResigned and errResignRequested are the causes of a leadership that
// ended by Resign or by RequestResign.
var (
	errResigned        = errorf("%w: resigned", ErrNotHeld)
	errResignRequested = errorf("%w: resigned on request (RequestResign)", ErrNotHeld)
)

// campaignRound bounds one server-side wait of a campaign, so that the
// Client's bounded waits rotate among its campaigns and locks.
func (e *Election) campaignRound() time.Duration { return e.c.cfg.lossDeadline }

// Campaign waits until this candidate leads the election, then returns the
// Leadership. ctx bounds only the wait: the leadership lasts until it
// ends (see Leadership). While the server cannot be reached, refuses
// connections (starting up, shutting down, no free slot) or is a standby
// (a restart, a switchover, a failover, a window with no primary),
// Campaign waits as a blocking Lock does, and goes on once a primary
// answers. With a synchronous standby, the term is handed out only once
// the standby has confirmed its commit (see WithFence). Campaign returns
// ctx's error when ctx ends first (joined with the last connection error,
// if any), ErrClosed after Close, an error wrapping ErrNotMigrated without
// the tables of Migrate, and the server's other errors.
func (e *Election) Campaign(ctx context.Context) (*Leadership, error) {
	if e.err != nil {
		return nil, e.err
	}
	c := e.c
	if err := c.enter(); err != nil {
		return nil, errorf("election %q: %w", e.name, err)
	}
	defer c.wg.Done()
	// Listen before winning, so a RequestResign right after the win is
	// heard.
	sub, err := c.subscribe(leaderChannel, e.prefix+"resign:")
	if err != nil {
		return nil, errorf("election %q: %w", e.name, err)
	}
	// Open the guard session now, while following, so that a takeover
	// does not wait for a connection. The guard's wait, a bigint key's
	// Lock, is prepared on every session as it connects. If the server
	// cannot be reached now (a restart, a failover), the campaign waits
	// for the lock all the same, riding through as a Lock does, and the
	// takeover opens the session.
	if _, err := e.c.guardSession(ctx); err != nil && (!connectionTrouble(err) || ctx.Err() != nil) {
		sub.close()
		return nil, errorf("election %q: open guard session: %w", e.name, err)
	}
	for {
		l, err := e.wait(ctx)
		if err != nil {
			sub.close()
			return nil, err
		}
		ld, err := e.lead(ctx, l, time.Now(), sub)
		if err == nil {
			return ld, nil
		}
		var asked errAskedWhileWaiting
		if errors.As(err, &asked) {
			e.yield(ctx, asked.term)
			continue
		}
		if !errors.Is(err, errLostWhileWinning) {
			sub.close()
			return nil, err
		}
	}
}

// errAskedWhileWaiting means that term was asked to resign while its
// leader waited out its predecessor's loss deadline, before it began; the
// campaign yields to another candidate, then goes on.
type errAskedWhileWaiting struct{ term Term }

func (errAskedWhileWaiting) Error() string { return "pgcoord: asked to resign before leading" }

// errLostWhileWinning means the lock was lost before the leadership
// began; the campaign goes on.
var errLostWhileWinning = errors.New("pgcoord: leadership lock lost while winning")

// wait takes the election's lock, in rounds.
func (e *Election) wait(ctx context.Context) (*Lock, error) {
	var last error // the last round's error that says the server could not be used
	for {
		round, cancel := context.WithTimeout(ctx, e.campaignRound())
		l, err := e.c.Lock(round, e.key, withPrepared(e.recordStatement()), withoutHooks())
		// The round ended if its deadline passed: by round.Err(), read
		// before cancel (which ends it too), or by the clock a moment
		// before round.Err() reports it.
		ended := round.Err() != nil || errors.Is(err, context.DeadlineExceeded)
		cancel()
		if err != nil && (connectionTrouble(err) || errors.Is(err, ErrReadOnly) || errors.Is(err, ErrTooManyConnections)) {
			last = err
		}
		switch {
		case err == nil:
			return l, nil
		case ctx.Err() != nil && last != nil:
			return nil, errorf("election %q: campaign: %w (last connection error: %w)", e.name, context.Cause(ctx), last)
		case ctx.Err() != nil:
			return nil, errorf("election %q: campaign: %w", e.name, context.Cause(ctx))
		case ended && !errors.Is(err, ErrClosed):
			continue // the round ended: wait again
		default:
			return nil, errorf("election %q: campaign: %w", e.name, err)
		}
	}
}

// lead turns a held election lock, won at won, into a leadership: guard,
// row, notice, and the wait for a predecessor that may still live without
// a guard to show it (see handover).
func (e *Election) lead(ctx context.Context, l *Lock, won time.Time, sub *subscription) (*Leadership, error) {
	c := e.c
	fail := func(g *Lock, err error) (*Leadership, error) {
		rctx, cancel := withoutCancel(ctx, c.cfg.lossDeadline)
		defer cancel()
		if g != nil {
			_ = g.Unlock(rctx)
		}
		_ = l.Unlock(rctx)
		return nil, err
	}
	// Take the guard, and meanwhile issue the term and record the leader
	// on the lock's backend: fn starts only once both are done.
	var g *Lock
	var gerr error
	guarded := make(chan struct{})
	go func() {
		defer close(guarded)
		g, gerr = e.takeGuard(ctx, l.Done())
	}()
	term, since, wait, loss, err := e.record(ctx, l)
	until := time.Now().Add(wait) // the server's now() was a little earlier
	<-guarded
	switch {
	case gerr != nil && l.Err() != nil:
		// The server went away (a restart, a failover) while this
		// candidate won: the campaign goes on.
		return fail(g, errLostWhileWinning)
	case gerr != nil:
		return fail(g, gerr)
	}
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fail(g, errorf("election %q: term %d is not newer than the recorded leader's: the fences table was reset or restored while the leaders table was not; delete the election's row in leaders to continue", e.name, term))
	case err != nil && l.Err() != nil:
		return fail(g, errLostWhileWinning)
	case err != nil:
		return fail(g, notMigrated(c.cfg, fmt.Sprintf("election %q: record leader", e.name), err))
	}
	if g == nil {
		// The guard wait covered this Client's loss deadline since the
		// win; a predecessor's may be longer, and so is the wait.
		if u := won.Add(loss); u.After(until) {
			until = u
		}
		// Leading without the guard: say so in the row, on the lock's
		// backend, before fn starts, and how long this leader waits. A
		// successor that wins once this backend is gone reads it and
		// waits out this leader's lease, or the rest of that wait.
		set := fmt.Sprintf("guarded = false, not_before = GREATEST(l.not_before, l.since + %d * interval '1 millisecond')", loss.Milliseconds())
		if err := e.mark(ctx, l, term, set, ""); err != nil {
			if l.Err() != nil {
				return fail(g, errLostWhileWinning)
			}
			return fail(g, notMigrated(c.cfg, fmt.Sprintf("election %q: record leading without the guard", e.name), err))
		}
	}
	if wait := time.Until(until); wait > 0 {
		// The predecessor may live on without knowing it lost: it led
		// without the guard, or a restart or failover ended its term. Its
		// context is cancelled at the latest its loss deadline after it
		// lost the lock, which was before this candidate won it.
		c.cfg.warnLogger().Warn("pgcoord: the previous leader may not know yet that it lost; waiting out its loss deadline before leading",
			"election", e.name, "wait", wait)
		// A request to resign this term, which Leader may already
		// report, is honoured during the wait: the candidate gives up,
		// leaving the wait it owed recorded in the row for the next one.
		requested := e.prefix + "resign:" + strconv.FormatInt(int64(term), 10)
		var guardDone <-chan struct{}
		if g != nil {
			guardDone = g.Done()
		}
		timer := time.NewTimer(wait)
		defer timer.Stop()
		for waiting := true; waiting; {
			select {
			case <-timer.C:
				waiting = false
			case <-l.Done():
				waiting = false
			case <-guardDone:
				return fail(g, errLostWhileWinning)
			case <-ctx.Done():
				return fail(g, errorf("election %q: campaign: %w", e.name, context.Cause(ctx)))
			case <-sub.kick:
				for _, p := range sub.take() {
					if p == requested || p == "" && e.resignRecorded(l, term) {
						return fail(g, errAskedWhileWaiting{term})
					}
				}
			}
		}
		if e.resignRecorded(l, term) {
			return fail(g, errAskedWhileWaiting{term})
		}
	}
	if l.Err() != nil || g != nil && g.Err() != nil {
		return fail(g, errLostWhileWinning)
	}
	ld := &Leadership{
		e: e, lock: l, guard: g, sub: sub, term: term, since: since,
		resign:  make(chan struct{}),
		done:    make(chan struct{}),
		stamped: make(chan struct{}),
	}
	ld.ctx, ld.cancel = context.WithCancelCause(context.WithValue(leaderParent{c.closing, ctx}, leadershipKey{}, ld))
	c.hooks.leadership(LeadershipEvent{Election: e.name, Identity: e.identity, Term: term, Leading: true})
	c.cfg.infoLogger().Info("pgcoord: leading", "election", e.name, "identity", e.identity, "term", int64(term))
	c.wg.Add(1)
	go ld.watch()
	return ld, nil
}

// recordSQL issues the election key's next fence as the new leader's term,
// durably (issueFenceSQL), records the leader in the leaders table, and
// notifies observers, all in one statement, run on the backend that holds
// the election's lock. Parameters: $1 and $2 the
// fence row (fenceRow), $3 the election's name, $4 its lock key, $5 the
// identity, $6 the pid of the backend that holds the election's lock, $7
// the notification channel, $8 the leader's loss deadline in milliseconds,
// $9 the lock_timeout of its waits for rows (see Session.block). It
// returns the term, the time the leadership began (no row if the leaders
// table holds a newer term), whether observers were not notified, how
// many milliseconds the new leader must wait before it starts, and the
// longest loss deadline among the leaders since the last clean end, its
// own included (see handover).
//
// On the backend that holds the election's lock, which may hold other
// goroutines' keys, the statement locks the fences row and the leaders row
// with NOWAIT before anything else: when a transaction holds either (it
// checked the previous term and is still open), the statement fails at
// once with SQLSTATE 55P03 and never joins the row's queue of waiters,
// where the transaction's deadlock check could find a cycle through that
// backend (see Client.blockAway). recordAwaySQL then waits for the rows
// elsewhere.
func recordSQL(c *config) string { return recordSQLFor(c, false) }

// recordAwaySQL is recordSQL run on a backend of the Client's that holds
// nothing, while the election's lock is held on another ($6): it waits for
// the rows, and records the term only if that backend still holds the
// election's lock when it starts (pg_locks); otherwise it returns no row.
func recordAwaySQL(c *config) string { return recordSQLFor(c, true) }

func recordSQLFor(c *config, away bool) string {
	holder, lockRows, probe := 0, "", ""
	if away {
		holder = 6
	} else {
		lockRows = `lk AS (SELECT count(*) AS n FROM (SELECT FROM ` + c.table("leaders") + ` AS r
				WHERE r.name = $3 FOR UPDATE NOWAIT) AS r),
		`
		probe = " CROSS JOIN lk"
	}
	// h is the predecessor's row, as it was before this statement: what
	// the new term must exceed, the longest loss deadline to carry on,
	// and until when the new leader must wait (NULL: not at all).
	return `WITH ` + lockRows + `h AS (SELECT p.term AS floor,
				CASE WHEN p.ended IS DISTINCT FROM false THEN $8::int8 ELSE GREATEST(p.loss_deadline_ms, $8::int8) END AS loss,
				CASE WHEN NOT p.ended THEN GREATEST(p.not_before,
					CASE WHEN NOT p.guarded OR p.server_start <> pg_catalog.pg_postmaster_start_time()
						THEN now() + GREATEST(p.loss_deadline_ms, $8::int8) * interval '1 millisecond' END) END AS not_before
			FROM (SELECT) AS one` + probe + ` LEFT JOIN ` + c.table("leaders") + ` AS p ON p.name = $3),
		fence AS (` + issueFenceSQL(c, 9, holder, "h", !away) + `),
		won AS (
			INSERT INTO ` + c.table("leaders") + ` AS l (name, lock_key, identity, term, since, pid, guarded, server_start, ended, loss_deadline_ms, not_before)
			SELECT $3, $4, $5, fence.fence, now(), $6, true, pg_catalog.pg_postmaster_start_time(), false, h.loss, h.not_before FROM fence, h
			ON CONFLICT (name) DO UPDATE SET lock_key = EXCLUDED.lock_key, identity = EXCLUDED.identity,
				term = EXCLUDED.term, since = EXCLUDED.since, pid = EXCLUDED.pid,
				guarded = true, server_start = EXCLUDED.server_start, ended = false,
				loss_deadline_ms = EXCLUDED.loss_deadline_ms, not_before = EXCLUDED.not_before
			WHERE l.term < EXCLUDED.term
			RETURNING term, since, not_before)
		SELECT fence.fence, won.since, CASE WHEN won.term IS NOT NULL THEN
			pg_notify($7, format('%s:lead:%s:%s:%s:%s', $4::bigint, won.term, $6::int,
				(extract(epoch FROM won.since) * 1000000)::bigint, $5::text)) END IS NULL,
			GREATEST(ceil(extract(epoch FROM won.not_before - now()) * 1000), 0)::int8,
			h.loss
		FROM fence CROSS JOIN h LEFT JOIN won ON true`
}

// The handover from one leader to the next. A new leader starts only once
// its predecessor's context has been cancelled, by the predecessor's own
// clock. The guard proves it while the predecessor holds it: a predecessor
// that lives frees its guard only after cancelling its context. Where the
// guard proves nothing, the leaders row tells the new leader to wait out
// the predecessor's loss deadline L after winning (the predecessor's
// context is cancelled at most L after the lock was lost, which was before
// the win; the row carries the longest L of the leaders since the last
// clean end, the new leader's own included, and the wait is that long):
//   - guarded = false: the predecessor led without the guard, because its
//     own predecessor did not free it within L (a paused process); it
//     keeps trying to take the guard, and sets guarded back once it has;
//   - server_start differs from the server's pg_postmaster_start_time(): a
//     restart or a failover ended the predecessor's term, and with it both
//     of its backends, so its guard was freed with its lock whether or not
//     its process lives.
//
// The wait is recorded as not_before in the new leader's row, as it wins:
// should it give up before it starts (its campaign's ctx ends, its lock is
// lost, its Client closes), the next winner, which finds a row that says
// nothing else to fear, still waits until then. ended = true, which a
// leader sets when it ends its term itself, after its context was
// cancelled, removes the wait. A predecessor whose lock and guard
// connections are both lost less than 2H apart (it notices a loss only at
// its next heartbeat), or that loses them in a crash-restart of the server
// (which keeps the postmaster and its start time), cannot be told from a
// killed process: its successor starts at once, and the predecessor's
// context is cancelled within 2H of its first loss (at most L); its writes
// are stale by then, and CheckFence rejects them.

// recordArgs returns the arguments of recordSQL for a new leader whose
// election lock is held by backend pid.
func (e *Election) recordArgs(pid int32) []any {
	space, fkey := fenceRow(e.key)
	k, _ := e.key.Int64()
	return []any{space, fkey, e.name, k, e.identity, pid, leaderChannel, e.c.cfg.lossDeadline.Milliseconds(), ""}
}

// recordStatement is recordSQL as the campaign's acquire prepares it on the
// backend it waits on: planned there too, with this candidate's arguments,
// so that a takeover's record does not begin with the backend reading the
// leaders and fences tables' metadata (about half of that statement's time
// on a connection's first run).
func (e *Election) recordStatement() preparedStatement {
	return preparedStatement{sql: recordSQL(e.c.cfg), plan: e.recordArgs(0)}
}

// record runs recordSQL, which the campaign's acquire prepared, on the
// backend of l, the election's lock. It returns the term, when it began,
// how long from now the new leader must wait before it starts, and the
// longest loss deadline of the leaders since the last clean end (see
// handover). It returns pgx.ErrNoRows, with the fence issued, when the
// leaders table holds a newer term.
func (e *Election) record(ctx context.Context, l *Lock) (Term, time.Time, time.Duration, time.Duration, error) {
	c := e.c
	var term, waitMS, loss int64
	var since *time.Time
	// The statement waits for the fences row while a transaction that
	// checked the previous term is open: in slices, like a lock wait, so
	// that the backend's other locks keep proving themselves alive. It is
	// a token statement: a term whose commit a synchronous standby has not
	// confirmed is withheld, and the next slice records a greater one (see
	// Session.block); the row and the notice of a withheld term are
	// overwritten by it.
	//
	// On a backend of the Client's, which may hold other goroutines' keys,
	// it never waits for the rows: it runs there with NOWAIT and, if a
	// transaction holds a row, waits for it on a backend that holds
	// nothing (Client.blockAway).
	run := func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error {
		return conn.QueryRow(ctx, sql, args...).Scan(&term, &since, new(bool), &waitMS, &loss)
	}
	err := c.blockAway(ctx, l.s, blockingStatement{
		sql:     recordSQL(c.cfg),
		args:    e.recordArgs(l.s.pid),
		locks:   2, // the fences row, then the leaders row
		run:     run,
		quick:   true,
		durable: true,
	}, blockingStatement{
		sql:   recordAwaySQL(c.cfg),
		args:  e.recordArgs(l.s.pid),
		locks: 2,
		run: func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error {
			err := run(ctx, conn, sql, args)
			if errors.Is(err, pgx.ErrNoRows) {
				err = errorf("%w: backend %d no longer holds %s", ErrLockLost, l.s.pid, e.key)
			}
			return err
		},
		durable: true,
	})
	if err != nil {
		return Term(term), time.Time{}, 0, 0, err
	}
	if since == nil {
		return Term(term), time.Time{}, 0, 0, pgx.ErrNoRows
	}
	return Term(term), *since, time.Duration(waitMS) * time.Millisecond, time.Duration(loss) * time.Millisecond, nil
}

// mark sets columns of term's row in the leaders table (set is the SET
// clause) on the backend of l, the election's lock, which proves that
// backend held the lock when the change committed, and notifies notice to
// observers, unless it is empty. Like record, it waits for the row in
// slices. It returns an error if the row holds another term.
func (e *Election) mark(ctx context.Context, l *Lock, term Term, set, notice string) error {
	var n int64
	err := l.s.block(ctx, blockingStatement{
		sql: `WITH t AS (SELECT pg_catalog.set_config('lock_timeout', $5, true)),
			u AS (UPDATE ` + e.c.cfg.table("leaders") + ` AS l SET ` + set + ` FROM t WHERE l.name = $1 AND l.term = $2 RETURNING 1)
			SELECT count(*), bool_or(CASE WHEN $4 <> '' THEN pg_catalog.pg_notify($3, $4) END IS NULL) FROM u`,
		args: []any{e.name, int64(term), leaderChannel, notice, ""},
		run: func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error {
			return conn.QueryRow(ctx, sql, args...).Scan(&n, new(*bool))
		},
		quick: true,
	})
	if err == nil && n != 1 {
		err = errorf("the leaders row of election %q no longer holds term %d", e.name, term)
	}
	return err
}

// takeGuard takes the election's guard on the Client's guard session,
// waiting at most the loss deadline for a previous leader that lives to
// free it. It returns a nil Lock, and no error, when that wait ran out,
// also when the guard session could not be opened meanwhile (the server
// cannot be reached, has no free connection slot, or is a standby): the
// new leader then leads without the guard, which the handover covers. It
// returns early, with errLostWhileWinning, when lockLost (the election
// lock's Done) closes.
//
// The wait runs on the server, so the guard is granted the moment it is
// freed (a killed leader's guard backend exits), but in short slices
// (guardSlice): the guard session serves every election of the Client, and
// its blocking statements run one at a time, so one election's wait for a
// guard that is slow to come must not hold up another's for longer than a
// slice. Slices that short also end before the server would look for a
// deadlock between two Clients that take over from each other at once.
func (e *Election) takeGuard(ctx context.Context, lockLost <-chan struct{}) (*Lock, error) {
	c := e.c
	deadline := time.Now().Add(c.cfg.lossDeadline)
	retry := minRetryInterval
	var err error
	for lost := false; ; {
		var s *Session
		var g *Lock
		s, err = c.guardSession(ctx)
		if err == nil {
			err = ErrLocked // not tried yet: the first slice returns at once if the guard is free
		}
		for errors.Is(err, ErrLocked) || errors.Is(err, ErrDeadlock) {
			left := time.Until(deadline)
			if left <= 0 {
				c.cfg.warnLogger().Warn("pgcoord: the previous leader did not free the election's guard within the loss deadline; leading without it",
					"election", e.name, "loss_deadline", c.cfg.lossDeadline)
				return nil, nil
			}
			sctx, cancel := context.WithTimeout(ctx, min(guardSlice, left))
			g, err = s.Lock(sctx, e.guard, withoutHooks())
			// The slice's deadline may have passed by the clock a moment
			// before sctx reports it.
			if err != nil && ctx.Err() == nil && (sctx.Err() != nil || errors.Is(err, context.DeadlineExceeded)) {
				err = ErrLocked // the slice ended: wait on
			}
			cancel()
		}
		switch {
		case err == nil:
			return g, nil
		case ctx.Err() != nil:
			return nil, errorf("election %q: take guard: %w", e.name, context.Cause(ctx))
		case !connectionTrouble(err) || errors.Is(err, ErrClosed):
			return nil, errorf("election %q: take guard: %w", e.name, err)
		}
		// The guard session was lost (a new one is opened at once, the
		// first time), or cannot be opened now: open another, at growing
		// intervals, within the guard's deadline.
		if errorIsLoss(err) && !lost {
			lost = true
			continue
		}
		left := time.Until(deadline)
		if left <= 0 {
			c.cfg.warnLogger().Warn("pgcoord: the election's guard could not be taken within the loss deadline; leading without it",
				"election", e.name, "loss_deadline", c.cfg.lossDeadline, "error", err)
			return nil, nil
		}
		t := time.NewTimer(min(retry, left))
		select {
		case <-t.C:
		case <-lockLost:
			t.Stop()
			return nil, errLostWhileWinning
		case <-ctx.Done():
			t.Stop()
			return nil, errorf("election %q: take guard: %w", e.name, context.Cause(ctx))
		}
		retry = min(2*retry, maxRetryInterval)
	}
}

// guardSlice is how long one wait for a guard runs on the Client's guard
// session before it lets the next election's statement run.
const guardSlice = 20 * time.Millisecond

// guardSession returns the Client's guard session, opening it if needed.
func (c *Client) guardSession(ctx context.Context) (*Session, error) {
	c.guardMu.Lock()
	defer c.guardMu.Unlock()
	if c.guard != nil && c.guard.Err() == nil {
		return c.guard, nil
	}
	s, err := c.openSession(ctx)
	if err != nil {
		return nil, err
	}
	c.guard = s
	return s, nil
}

// guardLock returns the leadership's guard, nil while it leads without.
func (ld *Leadership) guardLock() *Lock {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	return ld.guard
}

// retakeGuard tries, once and without waiting, to take the guard that a
// leader that started without it lacks, and records in the leaders row
// that it holds it (see handover). It returns the guard, or nil.
func (ld *Leadership) retakeGuard() *Lock {
	e := ld.e
	ctx, cancel := context.WithTimeout(ld.ctx, e.c.cfg.heartbeat)
	defer cancel()
	s, err := e.c.guardSession(ctx)
	if err != nil {
		return nil
	}
	g, err := s.TryLock(ctx, e.guard, withoutHooks())
	if err != nil {
		return nil
	}
	if err := e.mark(ctx, ld.lock, ld.term, "guarded = true", ""); err != nil {
		rctx, rcancel := withoutCancel(ctx, e.c.cfg.lossDeadline)
		_ = g.Unlock(rctx)
		rcancel()
		return nil
	}
	ld.mu.Lock()
	ld.guard = g
	ld.mu.Unlock()
	e.c.cfg.infoLogger().Info("pgcoord: leader took the election's guard", "election", e.name, "term", int64(ld.term))
	return g
}

// watch ends the leadership when something ends it.
func (ld *Leadership) watch() {
	c := ld.e.c
	defer c.wg.Done()
	var guardDone <-chan struct{}
	guard := ld.guardLock()
	if guard != nil {
		guardDone = guard.Done()
	}
	requested := ld.e.prefix + "resign:" + strconv.FormatInt(int64(ld.term), 10)
	// A request to resign is notified and recorded in the leaders row:
	// read the row when notifications may have been lost (the listener
	// resynced, or is not listening), and every loss deadline in any case.
	tick := time.NewTicker(c.cfg.heartbeat)
	defer tick.Stop()
	read := time.Now()
	// A leader without the guard tries to take it every heartbeat, in a
	// goroutine of its own: the try runs on the guard session, which may
	// itself be slow to answer or to reconnect, and must not keep the
	// watch from seeing the end of the leadership.
	retaken := make(chan *Lock, 1)
	retaking := false
	var why error
	for why == nil {
		select {
		case now := <-tick.C:
			if guard == nil && !retaking {
				retaking = true
				go func() { retaken <- ld.retakeGuard() }()
			}
			if !c.listening.Load() || now.Sub(read) >= c.cfg.lossDeadline {
				read = now
				if ld.resignRecorded() {
					why = errResignRequested
				}
			}
		case g := <-retaken:
			retaking = false
			if g != nil {
				guard, guardDone = g, g.Done()
			}
		case <-ld.lock.Done():
			why = errorf("election lock: %w", ld.lock.Err())
		case <-guardDone:
			why = errorf("election guard: %w", guard.Err())
		case <-ld.resign:
			why = errResigned
		case <-c.closing.Done():
			why = ErrClosed
		case <-ld.sub.kick:
			resync := false
			for _, p := range ld.sub.take() {
				switch p {
				case requested:
					why = errResignRequested
				case "":
					resync = true
				}
			}
			if resync && why == nil {
				read = time.Now()
				if ld.resignRecorded() {
					why = errResignRequested
				}
			}
		}
	}
	ld.end(why, func() {
		// A try still in flight ends within a heartbeat (its ctx, a
		// child of the leader's, is cancelled now); a guard it took is
		// freed with the rest.
		if retaking {
			<-retaken
		}
	})
}

// end cancels the leader's context, then, once settle has returned, tells
// observers (after a resign) and frees the guard and the lock.
func (ld *Leadership) end(why error, settle func()) {
	ld.cancel(why)
	at := time.Now()
	if errors.Is(context.Cause(ld.ctx), ErrClosed) {
		// Close cancelled it as it began.
		c := ld.e.c
		c.mu.Lock()
		at = c.closedAt
		c.mu.Unlock()
	}
	ld.mu.Lock()
	ld.cancelled = at
	ld.mu.Unlock()
	close(ld.stamped)
	settle()
	ld.sub.close()
	ctx, cancel := withoutCancel(context.Background(), ld.e.c.cfg.lossDeadline)
	defer cancel()
	if errors.Is(why, ErrNotHeld) && ld.lock.Err() == nil {
		// The term ended here, its context cancelled: the successor need
		// not wait for it (see handover), and observers learn at once.
		_ = ld.e.mark(ctx, ld.lock, ld.term, "ended = true", ld.e.prefix+"end:"+strconv.FormatInt(int64(ld.term), 10))
	}
	if g := ld.guardLock(); g != nil {
		_ = g.Unlock(ctx)
	}
	_ = ld.lock.Unlock(ctx)
	ld.mu.Lock()
	ld.err = errorf("election %q: term %d ended: %w", ld.e.name, ld.term, why)
	ld.mu.Unlock()
	c := ld.e.c
	ev := LeadershipEvent{Election: ld.e.name, Identity: ld.e.identity, Term: ld.term}
	if errors.Is(why, ErrLockLost) {
		ev.Err = ld.err
		c.cfg.warnLogger().Warn("pgcoord: leadership lost", "election", ld.e.name, "identity", ld.e.identity, "term", int64(ld.term), "error", why)
	} else {
		c.cfg.infoLogger().Info("pgcoord: leadership ended", "election", ld.e.name, "term", int64(ld.term), "why", why)
	}
	c.hooks.leadership(ev)
	close(ld.done)
}

// Leader returns the current leader. It returns an error wrapping
// ErrNoLeader when nobody leads: a leader is reported only while its
// backend holds the election's lock, so never a dead one. A new leader is
// reported as soon as it has recorded its term, which it does while it
// takes the election's guard: its fn starts only after that (normally
// within a round trip; up to the loss deadline later after a predecessor
// that did not free the guard, that led without it, or whose term a
// restart or failover ended), and the previous leader's context may still
// be live until then. To route work to a leader, have the leader itself
// announce when it is ready, or expect it to refuse work until its fn
// runs. ctx bounds the query, which runs on the Client's pool. Other
// errors: ErrNotMigrated without the tables of Migrate, and query errors.
func (e *Election) Leader(ctx context.Context) (LeaderInfo, error) {
	if e.err != nil {
		return LeaderInfo{}, e.err
	}
	classid, objid, _ := e.key.lockColumns()
	var info LeaderInfo
	var term int64
	err := e.c.onPool(ctx, func(b *pgx.Batch) {
		b.Queue(`SELECT l.identity, l.term, l.since, l.pid FROM `+e.c.cfg.table("leaders")+` AS l
			WHERE l.name = $1 AND EXISTS (SELECT 1 FROM pg_locks AS k
				WHERE k.locktype = 'advisory' AND k.granted AND k.pid = l.pid
				AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
				AND k.classid::bigint = $2 AND k.objid::bigint = $3 AND k.objsubid = 1)`,
			e.name, int64(classid), int64(objid)).QueryRow(func(row pgx.Row) error {
			return row.Scan(&info.Identity, &term, &info.Since, &info.PID)
		})
	})
	info.Term = Term(term)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return LeaderInfo{}, errorf("election %q: %w", e.name, ErrNoLeader)
	case err != nil:
		return LeaderInfo{}, notMigrated(e.c.cfg, fmt.Sprintf("election %q: read leader", e.name), err)
	}
	return info, nil
}

// RequestResign asks the current leader, in whatever process it runs, to
// step down: its context is cancelled, it resigns, and the next candidate
// leads with a greater term. The request names the current term, so it
// never reaches a later leader. Any process may call it, candidate or
// not. It returns once the request is recorded in the leader's row and
// notified (follow the change with Observe or Leader); ErrNoLeader when
// nobody leads. ctx bounds the two queries, which run on the Client's
// pool.
//
// The leader hears the notification at once. If its listener connection
// is away (reconnecting, or unable to), it finds the recorded request when
// the listener is back, and meanwhile reads its row every heartbeat
// interval; so a leader whose process runs and whose backend answers steps
// down within a heartbeat interval and a round trip of the request,
// whatever happens to its listener. (A listener whose network is silent,
// nothing closed, is noticed only by TCP keepalives; the leader reads its
// row every loss deadline in any case.)
func (e *Election) RequestResign(ctx context.Context) error {
	info, err := e.Leader(ctx)
	if err != nil {
		return err
	}
	err = e.c.onPool(ctx, func(b *pgx.Batch) {
		b.Queue(`WITH asked AS (
				UPDATE `+e.c.cfg.table("leaders")+` SET resign_term = term WHERE name = $1 AND term = $2 RETURNING term)
			SELECT pg_notify($3, $4) FROM asked`,
			e.name, int64(info.Term), leaderChannel, e.prefix+"resign:"+strconv.FormatInt(int64(info.Term), 10))
	})
	if err != nil {
		return notMigrated(e.c.cfg, fmt.Sprintf("election %q: request resign", e.name), err)
	}
	return nil
}

// resignRecorded reports whether the leaders row records a request that
// this leadership resign. It reads the row on the backend of the
// election's lock, bounded by a heartbeat interval; an error counts as no
// request (the next check tries again).
func (ld *Leadership) resignRecorded() bool { return ld.e.resignRecorded(ld.lock, ld.term) }

// resignRecorded reports whether the leaders row records a request that
// term resign, reading it on the backend of l, the election's lock.
func (e *Election) resignRecorded(l *Lock, term Term) bool {
	c := e.c
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.heartbeat)
	defer cancel()
	var asked bool
	err := l.s.run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, "SELECT coalesce(resign_term = $2, false) FROM "+c.cfg.table("leaders")+" WHERE name = $1",
			e.name, int64(term)).Scan(&asked)
	})
	return err == nil && asked
}

// Run campaigns, runs fn while leading, and campaigns again, until ctx
// ends. fn gets the term and a context that is cancelled when the
// leadership ends (see Leadership.Context) or ctx ends; when fn returns,
// Run resigns.
// If fn returns an error while still leading, Run resigns and returns that
// error. An error fn returns after its leadership ended is the expected
// reaction to the cancellation, and Run campaigns again. After a
// RequestResign, Run lets another candidate lead before it campaigns
// again (it waits until one does, at most the loss deadline). A leadership
// that a restart or failover ended is not an error: Run campaigns on, and
// waits, like Campaign, through the time no primary can be reached. Run
// returns ctx's error when ctx ends, and the errors of Campaign.
func (e *Election) Run(ctx context.Context, fn func(ctx context.Context, term Term) error) error {
	for {
		ld, err := e.Campaign(ctx)
		if err != nil {
			return err
		}
		// Run's ctx ending ends the leadership, which cancels fn's ctx.
		stop := context.AfterFunc(ctx, func() { ld.once.Do(func() { close(ld.resign) }) })
		ferr := fn(ld.ctx, ld.term)
		stop()
		leading := ld.ctx.Err() == nil
		rctx, cancel := withoutCancel(ctx, e.c.cfg.lossDeadline)
		_ = ld.Resign(rctx)
		cancel()
		switch {
		case ctx.Err() != nil:
			return errorf("election %q: %w", e.name, context.Cause(ctx))
		case ferr != nil && leading:
			return errorf("election %q: term %d: %w", e.name, ld.term, ferr)
		case errors.Is(context.Cause(ld.ctx), errResignRequested):
			e.yield(ctx, ld.term)
		}
	}
}

// yield waits until a leader with a term after term has won, at most the
// loss deadline or until ctx ends. A later term counts even if its leader
// has ended already: two candidates that were each asked to resign in turn
// must not both wait out the loss deadline for a leader that came and
// went.
func (e *Election) yield(ctx context.Context, term Term) {
	ctx, cancel := context.WithTimeout(ctx, e.c.cfg.lossDeadline)
	defer cancel()
	sub, err := e.c.subscribe(leaderChannel, e.prefix+"lead:")
	if err != nil {
		return
	}
	defer sub.close()
	for {
		var recorded int64
		err := e.c.onPool(ctx, func(b *pgx.Batch) {
			b.Queue("SELECT term FROM "+e.c.cfg.table("leaders")+" WHERE name = $1", e.name).QueryRow(func(row pgx.Row) error {
				return row.Scan(&recorded)
			})
		})
		if err == nil && Term(recorded) > term {
			return
		}
		if _, err := sub.next(ctx, nil); err != nil {
			return
		}
	}
}

// Observe returns a channel that delivers the election's leaders as they
// change, in order: first the current leader (or the zero LeaderInfo when
// nobody leads), then every new leader, and the zero LeaderInfo when a
// leader ends and nobody has followed yet. A new leader is delivered when
// it has recorded its term, which may be before its fn starts (see
// Leader). New leaders and resignations
// arrive by NOTIFY, as they commit; a leader that died without resigning
// is noticed by a check every heartbeat interval (WithHeartbeat), once the
// server has freed its lock. Observing never slows the candidates: changes
// queue in the process until the receiver takes them. The channel is
// closed when ctx ends or the Client closes, or at once if the Election is
// invalid. Observe uses the Client's listener connection and one query on
// the pool per heartbeat interval, each bounded by the loss deadline and
// by Close. A read that fails (the tables of Migrate missing, a pool with
// no free connection, a connection error, a role that may not read the
// leaders table) is delivered as a LeaderInfo whose Err says why, once
// while the same error lasts, and logged; it is tried again every
// heartbeat interval, and once a read works the leader (or the zero
// LeaderInfo) is delivered again, with any change missed meanwhile. An
// invalid Election, or a closed Client, delivers its error in one
// LeaderInfo, then the channel is closed.
func (e *Election) Observe(ctx context.Context) <-chan LeaderInfo {
	err := e.err
	if err == nil {
		if err = e.c.enter(); err != nil {
			err = errorf("election %q: observe: %w", e.name, err)
		}
	}
	if err != nil {
		out := make(chan LeaderInfo, 1)
		out <- LeaderInfo{Err: err}
		close(out)
		return out
	}
	sub, err := e.c.subscribe(leaderChannel, e.prefix)
	if err != nil {
		e.c.wg.Done()
		out := make(chan LeaderInfo, 1)
		out <- LeaderInfo{Err: errorf("election %q: observe: %w", e.name, err)}
		close(out)
		return out
	}
	out := make(chan LeaderInfo)
	go func() {
		defer e.c.wg.Done()
		defer close(out)
		defer sub.close()
		e.observe(ctx, sub, out)
	}()
	return out
}

// observer is the state of one Observe.
type observer struct {
	cur     LeaderInfo // zero: no leader
	maxTerm Term
	started bool
	failed  bool // the last report was an error: report the next leader, or none, even if unchanged
	pending []LeaderInfo
}

// fail reports that the election could not be read.
func (o *observer) fail(err error) {
	o.failed = true
	o.pending = append(o.pending, LeaderInfo{Err: err})
}

func (o *observer) leader(info LeaderInfo) {
	if info.Term > o.maxTerm || o.failed && info.Term == o.maxTerm {
		o.maxTerm, o.cur, o.started, o.failed = info.Term, info, true, false
		o.pending = append(o.pending, info)
	}
}

func (o *observer) none() {
	if !o.started || o.cur.PID != 0 || o.failed {
		o.cur, o.started, o.failed = LeaderInfo{}, true, false
		o.pending = append(o.pending, LeaderInfo{})
	}
}

func (e *Election) observe(ctx context.Context, sub *subscription, out chan<- LeaderInfo) {
	var o observer
	tick := time.NewTicker(e.c.cfg.heartbeat)
	defer tick.Stop()
	// Reads end with ctx or with the Client's closing, whichever comes
	// first, and each within the loss deadline (a pool with no free
	// connection must not hold Observe, or Close, for longer).
	qctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(e.c.closing, cancel)()
	// resync: notifications may have been lost since the last read that
	// succeeded, so the next read takes the leader it finds. It stays set
	// until a read succeeds.
	resync := true
	failed := "" // the error of the last read, if it failed
	check := func(lost bool) {
		resync = resync || lost
		rctx, cancel := context.WithTimeout(qctx, e.c.cfg.lossDeadline)
		info, err := e.Leader(rctx)
		cancel()
		switch {
		case errors.Is(err, ErrNoLeader):
			o.none()
			resync = false
		case err == nil:
			if resync || !o.started || !e.c.listening.Load() {
				// A new leader is taken from its notification, which
				// keeps the order; read here only when notifications may
				// have been lost.
				o.leader(info)
			}
			resync = false
		case qctx.Err() == nil && err.Error() != failed:
			failed = err.Error() // reported and logged once while it lasts
			e.c.cfg.warnLogger().Warn("pgcoord: observe: read the leader; trying again every heartbeat", "election", e.name, "error", err)
			o.fail(err)
			return
		}
		if err == nil || errors.Is(err, ErrNoLeader) {
			failed = ""
		}
	}
	check(true)
	for {
		var send chan<- LeaderInfo
		var head LeaderInfo
		if len(o.pending) > 0 {
			send, head = out, o.pending[0]
		}
		select {
		case send <- head:
			o.pending = o.pending[1:]
		case <-tick.C:
			check(false)
		case <-sub.kick:
			for _, p := range sub.take() {
				e.observed(&o, p, check)
			}
		case <-ctx.Done():
			return
		case <-e.c.closing.Done():
			return
		}
	}
}

// observed applies one payload of the election's channel.
func (e *Election) observed(o *observer, payload string, check func(bool)) {
	if payload == "" {
		check(true)
		return
	}
	rest := strings.TrimPrefix(payload, e.prefix)
	kind, rest, _ := strings.Cut(rest, ":")
	switch kind {
	case "lead":
		f := strings.SplitN(rest, ":", 4)
		if len(f) != 4 {
			return
		}
		term, err1 := strconv.ParseInt(f[0], 10, 64)
		pid, err2 := strconv.ParseInt(f[1], 10, 32)
		micros, err3 := strconv.ParseInt(f[2], 10, 64)
		if err1 != nil || err2 != nil || err3 != nil {
			return
		}
		o.leader(LeaderInfo{Identity: f[3], Term: Term(term), Since: time.UnixMicro(micros), PID: int32(pid)})
	case "end":
		if term, err := strconv.ParseInt(rest, 10, 64); err == nil && Term(term) == o.cur.Term {
			o.none()
		}
	}
}
