package pgcoordgocron

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-co-op/gocron/v2"
	"github.com/pgcoord/pgcoord"
)

// Elector is a gocron.Elector on a pgcoord leader election: pass it to
// gocron.WithDistributedElector, and only the scheduler of the process
// that leads the election runs jobs. It campaigns in the background from
// NewElector until its ctx ends or Close; when the leader's process dies,
// another process's Elector leads within milliseconds (see
// pgcoord.Election for the bounds of the other failures).
//
// IsLeader answers from the process's own state, with no round trip, so
// that gocron may ask it on every run of every job. It says yes only while
// the leadership holds by pgcoord.Leadership.Valid: its context is live
// (pgcoord cancels it as soon as it knows or suspects the leadership is
// gone: a failed heartbeat, a terminated backend, a resign, the Client's
// Close), and the server has answered on the leader's connections (its
// lock's, and its guard's while it holds the guard) within the Client's
// loss deadline. So a process that was paused (SIGSTOP, a long GC pause,
// a frozen VM) for longer than the loss deadline says no from the moment
// it resumes, before its timers have noticed the loss; and a new leader,
// which waits for the old one's guard or, failing that, the loss
// deadline, never starts a run while IsLeader still says yes here.
//
// One exception, that of pgcoord.Election: when both of the leader's
// connections are lost together (terminated at once or within two
// heartbeat intervals of each other, a server's fast shutdown, a
// crash-restart of the server), a new leader starts at once, while this
// process may say yes for up to two heartbeat intervals more (at most the
// loss deadline). And gocron asks IsLeader when a run starts: a run that
// started while this process led goes on, and is not interrupted, when the
// leadership ends. Jobs whose writes must never come from an old leader
// fence them: take the term from Term when the run starts and check it
// with pgcoord.CheckFence and Election().Key() in the transaction of the
// write; a later leader's term rejects the old one's writes.
//
// An Elector's methods are safe for concurrent use.
type Elector struct {
	election *pgcoord.Election
	retry    time.Duration
	cancel   context.CancelFunc
	done     chan struct{} // closed when the campaign goroutine has returned

	cur    atomic.Pointer[leading] // nil while not leading
	closed atomic.Bool

	mu      sync.Mutex
	lastErr error // why the last campaign failed; nil once it leads
}

// leading is one term of leadership.
type leading struct {
	ld   *pgcoord.Leadership // nil only if Run's context did not carry it
	ctx  context.Context     // cancelled as soon as the leadership ends
	term pgcoord.Term
}

// valid returns nil while the term holds (see pgcoord.Leadership.Valid).
func (l *leading) valid() error {
	if l.ld != nil {
		return l.ld.Valid()
	}
	if l.ctx.Err() != nil {
		return context.Cause(l.ctx)
	}
	return nil
}

var _ gocron.Elector = (*Elector)(nil)

// NewElector checks that the election called name can be read, then
// campaigns for it in the background, through c, until ctx ends or Close
// is called. ctx bounds the check and the whole campaign; when it ends,
// the Elector resigns if it leads. The Client must outlive the Elector;
// the election needs the tables of pgcoord.Migrate.
//
// NewElector returns an error for a nil Client, an invalid name (see
// Client.Election) or option, a database without the tables of Migrate
// (wrapping pgcoord.ErrNotMigrated), a closed Client
// (pgcoord.ErrClosed), and the error of the check's query (ctx's error,
// connection errors).
func NewElector(ctx context.Context, c *pgcoord.Client, name string, opts ...ElectorOption) (*Elector, error) {
	if c == nil {
		return nil, fmt.Errorf("pgcoordgocron: NewElector %q: the pgcoord.Client is nil", name)
	}
	cfg := electorConfig{retry: DefaultRetryInterval}
	var errs []error
	for _, o := range opts {
		if o == nil {
			errs = append(errs, errors.New("nil ElectorOption"))
			continue
		}
		errs = append(errs, o.applyElector(&cfg))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("pgcoordgocron: NewElector %q: %w", name, err)
	}
	e := c.Election(name, cfg.election...)
	if _, err := e.Leader(ctx); err != nil && !errors.Is(err, pgcoord.ErrNoLeader) {
		return nil, fmt.Errorf("pgcoordgocron: NewElector: %w", err)
	}
	rctx, cancel := context.WithCancel(ctx)
	el := &Elector{election: e, retry: cfg.retry, cancel: cancel, done: make(chan struct{})}
	go el.campaign(rctx)
	return el, nil
}

// campaign runs the election until ctx ends, campaigning again after a
// failure once the retry interval has passed. It stops for good when the
// Client is closed.
func (el *Elector) campaign(ctx context.Context) {
	defer close(el.done)
	for {
		err := el.election.Run(ctx, el.lead)
		if ctx.Err() != nil {
			return
		}
		el.mu.Lock()
		el.lastErr = err
		el.mu.Unlock()
		if errors.Is(err, pgcoord.ErrClosed) {
			return
		}
		t := time.NewTimer(el.retry)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return
		}
	}
}

// lead publishes one term while it lasts. Election.Run calls it with the
// leadership's context, and resigns when it returns.
func (el *Elector) lead(ctx context.Context, term pgcoord.Term) error {
	ld, _ := pgcoord.LeadershipFromContext(ctx)
	l := &leading{ld: ld, ctx: ctx, term: term}
	el.mu.Lock()
	el.lastErr = nil
	el.mu.Unlock()
	el.cur.Store(l)
	<-ctx.Done()
	el.cur.CompareAndSwap(l, nil)
	return nil
}

// IsLeader returns nil while this process leads the election and its
// leadership holds by pgcoord.Leadership.Valid (see the Elector type for
// the one exception), and an error wrapping ErrNotLeader otherwise: before
// it has won, while another process leads, as soon as its leadership's
// context is cancelled (the leadership is lost, being lost, or resigned),
// when the server has not answered on the leader's connections within the
// loss deadline (wrapping pgcoord.ErrLockLost too), and after Close
// (wrapping pgcoord.ErrClosed too). When the last campaign failed, the
// error says why. It answers from the process's own state: ctx is not
// used, and it never blocks. A run that IsLeader let start goes on when
// the leadership ends.
func (el *Elector) IsLeader(ctx context.Context) error {
	_, err := el.Term()
	return err
}

// Term returns the current term (the fencing token of the leadership,
// see pgcoord.Leadership.Term) while this process leads, and otherwise
// the error IsLeader would return. Like IsLeader it answers from the
// process's own state.
func (el *Elector) Term() (pgcoord.Term, error) {
	name := el.election.Name()
	if el.closed.Load() {
		return 0, fmt.Errorf("%w: election %q: %w", ErrNotLeader, name, pgcoord.ErrClosed)
	}
	l := el.cur.Load()
	if l == nil {
		el.mu.Lock()
		last := el.lastErr
		el.mu.Unlock()
		if last != nil {
			return 0, fmt.Errorf("%w: election %q: the last campaign failed, retrying: %w", ErrNotLeader, name, last)
		}
		return 0, fmt.Errorf("%w: election %q: another process leads, or none yet", ErrNotLeader, name)
	}
	if err := l.valid(); err != nil {
		return 0, fmt.Errorf("%w: election %q: term %d is ending or lost: %w", ErrNotLeader, name, l.term, err)
	}
	return l.term, nil
}

// Election returns the pgcoord election the Elector campaigns in: use it
// to read the leader (Leader, Observe), to ask the leader to step down
// (RequestResign), or for its Key, to fence writes with the Term.
func (el *Elector) Election() *pgcoord.Election { return el.election }

// Close stops campaigning, resigns if this process leads, and waits until
// the Elector's goroutine has returned. IsLeader returns an error from the
// moment Close is called. ctx bounds the wait: Close then returns ctx's
// error, and the resign goes on in the background, bounded by the
// Client's loss deadline. Calling Close again returns nil once the
// goroutine has returned.
func (el *Elector) Close(ctx context.Context) error {
	el.closed.Store(true)
	el.cancel()
	select {
	case <-el.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("pgcoordgocron: close elector %q: %w", el.election.Name(), context.Cause(ctx))
	}
}
