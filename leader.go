package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
)

// Elections: the API
//
// An Election is a named lock with a term (a fence issued as the leader
// wins) and a guard that keeps a new leader from starting before the old
// one knows it lost. Campaign, Run, Resign, RequestResign and Leadership
// are here; winning, the term's record and the handover are in
// leader_term.go, Leader and Observe in leader_observe.go.

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

// Limits on election names and identities. Identities travel in NOTIFY
// payloads, which PostgreSQL limits to 8000 bytes.
const (
	maxElectionName = 1024
	maxIdentity     = 1024
)

// IdentityOption is an option of both [Client.Election] and
// [Client.Semaphore]: [WithIdentity].
type IdentityOption interface {
	ElectionOption
	SemaphoreOption
}

// WithIdentity sets the identity under which a candidate leads, as
// [Election.Leader] and [Election.Observe] report it, or under which a
// Semaphore's permits name their holder, in semaphore_holders and
// [Semaphore.Holders]. The default, for both, is the Client's application
// name, the host name and the process id, as "pgcoord@host pid 1234". It
// must be 1 to 1024 bytes of UTF-8 without NUL; the Election or Semaphore
// reports a bad one from every method.
func WithIdentity(identity string) IdentityOption { return identityOption(identity) }

type identityOption string

func (o identityOption) check() error { return checkText("identity", string(o), maxIdentity) }

func (o identityOption) applyElection(e *Election) error {
	if err := o.check(); err != nil {
		return err
	}
	e.identity = string(o)
	return nil
}

func (o identityOption) applySemaphore(s *Semaphore) error {
	if err := o.check(); err != nil {
		return err
	}
	s.identity = string(o)
	return nil
}

// defaultIdentity is the identity of a candidate or a permit's holder
// without WithIdentity: the application name, the host name and the
// process id, shortened to the process id should that be too long.
func defaultIdentity(appName string) string {
	host, _ := os.Hostname()
	id := fmt.Sprintf("%s@%s pid %d", appName, host, os.Getpid())
	if len(id) > maxIdentity || !utf8.ValidString(id) {
		id = fmt.Sprintf("%s pid %d", appName, os.Getpid())
	}
	return id
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
//   - leader's process killed: a waiting candidate leads two round trips
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
	key      core.Key // the leadership lock; its fence is the term
	guard    core.Key // held by the leader on the Client's guard session
	prefix   string
	err      error
}

// Election returns the election called name. It does not touch the
// network. An invalid name or option is reported by every method of the
// returned Election: a name must be 1 to 1024 bytes of UTF-8 without NUL.
// Elections need the tables of Migrate.
func (c *Client) Election(name string, opts ...ElectionOption) *Election {
	e := &Election{c: c, name: name, key: electionKey(c.core.Cfg.Schema, name), guard: core.HashKey("pgcoord.election.guard", c.core.Cfg.Schema, name)}
	k, _ := e.key.Int64()
	e.prefix = strconv.FormatInt(k, 10) + ":"
	if err := checkText("election name", name, maxElectionName); err != nil {
		e.err = err
		return e
	}
	e.identity = defaultIdentity(c.core.Cfg.AppName)
	for _, o := range opts {
		if o == nil {
			e.err = core.Errorf("nil option")
			return e
		}
		if err := o.applyElection(e); err != nil {
			e.err = err
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
func (e *Election) Key() Key { return keyOf(e.key) }

// electionKey returns the lock key of the election called name whose row
// is in schema.
func electionKey(schema, name string) core.Key { return core.HashKey("pgcoord.election", schema, name) }

// Leadership is a won election: it lasts until Resign, a RequestResign
// from any process, the loss of a connection it rests on, or the Client's
// Close. Its methods are safe for concurrent use.
type Leadership struct {
	e     *Election
	lock  *core.Lock // on one of the Client's shared backends
	guard *core.Lock // on the Client's guard session; nil while leading without it (guarded by mu)
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
	oldest := ld.lock.S.AnsweredAt()
	if g := ld.guardLock(); g != nil {
		if t := g.S.AnsweredAt(); t.Before(oldest) {
			oldest = t
		}
	}
	if age := time.Since(oldest); age >= ld.e.c.core.Cfg.LossDeadline {
		return core.Errorf("lead election %q: term %d: %w: no answer from the server for %v (loss deadline %v)",
			ld.e.name, ld.term, ErrLockLost, age.Round(time.Millisecond), ld.e.c.core.Cfg.LossDeadline)
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
	if ctx == nil {
		ctx = context.Background()
	}
	ld.once.Do(func() { close(ld.resign) })
	select {
	case <-ld.done:
		return nil
	case <-ctx.Done():
		return core.Errorf("resign election %q: %w", ld.e.name, context.Cause(ctx))
	}
}

// errResigned and errResignRequested are the causes of a leadership that
// ended by Resign or by RequestResign.
var (
	errResigned        = core.Errorf("%w: resigned", ErrNotHeld)
	errResignRequested = core.Errorf("%w: resigned on request (RequestResign)", ErrNotHeld)
)

// campaignRound bounds one server-side wait of a campaign, so that the
// Client's bounded waits rotate among its campaigns and locks.
func (e *Election) campaignRound() time.Duration { return e.c.core.Cfg.LossDeadline }

// Campaign waits until this candidate leads the election, then returns the
// Leadership. ctx bounds only the wait: the leadership lasts until it
// ends (see Leadership). While the server cannot be reached, refuses
// connections (starting up, shutting down, no free slot) or is a standby
// (a restart, a switchover, a failover, a window with no primary),
// Campaign waits as a blocking Lock does, and goes on once a primary
// answers. With a synchronous standby, the term is handed out only once
// the standby has confirmed its commit (see WithFence). Once it holds the
// guard, a candidate proves with one round trip on its lock's connection
// that it still holds the lock; should that connection stop answering
// then, the end of ctx is seen within the loss deadline, when the session
// is given up. Campaign returns ctx's error when ctx ends first (joined
// with the last connection error, if any), ErrClosed after Close, an error
// wrapping ErrNotMigrated without the tables of Migrate, and the server's
// other errors.
func (e *Election) Campaign(ctx context.Context) (*Leadership, error) {
	if ctx == nil {
		return nil, core.Errorf("campaign election %q: ctx is nil", e.name)
	}
	ld, err := e.campaign(ctx)
	if err != nil {
		return nil, core.Errorf("campaign election %q: %w", e.name, err)
	}
	return ld, nil
}

// campaign is Campaign, its errors not yet naming the election.
func (e *Election) campaign(ctx context.Context) (*Leadership, error) {
	if e.err != nil {
		return nil, e.err
	}
	c := e.c
	if err := c.core.Enter(); err != nil {
		return nil, err
	}
	defer c.core.Wg.Done()
	// Listen before winning, so a RequestResign right after the win is
	// heard.
	sub, err := c.subscribe(leaderChannel, e.prefix+"resign:")
	if err != nil {
		return nil, err
	}
	// Open the guard session now, while following, so that a takeover
	// does not wait for a connection. The guard's wait, a bigint key's
	// Lock, is prepared on every session as it connects. If the server
	// cannot be reached now (a restart, a failover), the campaign waits
	// for the lock all the same, riding through as a Lock does, and the
	// takeover opens the session.
	if _, err := e.c.guardSession(ctx); err != nil && (!core.ConnectionTrouble(err) || ctx.Err() != nil) {
		sub.close()
		return nil, core.Errorf("open guard session: %w", err)
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
	if ctx == nil {
		return core.Errorf("request resign election %q: ctx is nil", e.name)
	}
	info, err := e.leader(ctx)
	if err != nil {
		return core.Errorf("request resign election %q: %w", e.name, err)
	}
	err = e.c.core.OnPool(ctx, func(b *pgx.Batch) {
		b.Queue(`WITH asked AS (
				UPDATE `+e.c.core.Cfg.Table("leaders")+` SET resign_term = term WHERE name = $1 AND term = $2 RETURNING term)
			SELECT pg_notify($3, $4) FROM asked`,
			e.name, int64(info.Term), leaderChannel, e.prefix+"resign:"+strconv.FormatInt(int64(info.Term), 10))
	})
	if err != nil {
		return core.Errorf("request resign election %q: %w", e.name, core.NotMigrated(e.c.core.Cfg, "record the request", err))
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
func (e *Election) resignRecorded(l *core.Lock, term Term) bool {
	c := e.c
	ctx, cancel := context.WithTimeout(context.Background(), c.core.Cfg.Heartbeat)
	defer cancel()
	var asked bool
	err := l.S.Run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, "SELECT coalesce(resign_term = $2, false) FROM "+c.core.Cfg.Table("leaders")+" WHERE name = $1",
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
	if ctx == nil {
		return core.Errorf("run election %q: ctx is nil", e.name)
	}
	if fn == nil {
		return core.Errorf("run election %q: fn is nil", e.name)
	}
	for {
		ld, err := e.campaign(ctx)
		if err != nil {
			return core.Errorf("run election %q: %w", e.name, err)
		}
		// Run's ctx ending ends the leadership, which cancels fn's ctx.
		stop := context.AfterFunc(ctx, func() { ld.once.Do(func() { close(ld.resign) }) })
		ferr := fn(ld.ctx, ld.term)
		stop()
		leading := ld.ctx.Err() == nil
		rctx, cancel := core.WithoutCancel(ctx, e.c.core.Cfg.LossDeadline)
		_ = ld.Resign(rctx)
		cancel()
		switch {
		case ctx.Err() != nil:
			return core.Errorf("run election %q: %w", e.name, context.Cause(ctx))
		case ferr != nil && leading:
			return core.Errorf("run election %q: term %d: %w", e.name, ld.term, ferr)
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
	ctx, cancel := context.WithTimeout(ctx, e.c.core.Cfg.LossDeadline)
	defer cancel()
	sub, err := e.c.subscribe(leaderChannel, e.prefix+"lead:")
	if err != nil {
		return
	}
	defer sub.close()
	for {
		var recorded int64
		err := e.c.core.OnPool(ctx, func(b *pgx.Batch) {
			b.Queue("SELECT term FROM "+e.c.core.Cfg.Table("leaders")+" WHERE name = $1", e.name).QueryRow(func(row pgx.Row) error {
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
