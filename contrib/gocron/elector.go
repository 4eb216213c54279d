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
// the leadership's context (pgcoord.Leadership.Context) is live: pgcoord
// cancels that context as soon as it knows or suspects the leadership is
// gone (a failed heartbeat, the loss deadline passed with no answer from
// the server, a terminated backend, a resign), before the election's lock
// is released, so that a new leader never starts a run while IsLeader
// still says yes here.
//
// gocron asks IsLeader when a run starts; a run that started while this
// process led is not interrupted when the leadership ends. Jobs whose
// writes must never come from an old leader fence them: take the term
// from Term when the run starts and check it with pgcoord.CheckFence and
// Election().Key() in the transaction of the write.
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
	ctx  context.Context // cancelled as soon as the leadership ends
	term pgcoord.Term
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
	l := &leading{ctx: ctx, term: term}
	el.mu.Lock()
	el.lastErr = nil
	el.mu.Unlock()
	el.cur.Store(l)
	<-ctx.Done()
	el.cur.CompareAndSwap(l, nil)
	return nil
}

// IsLeader returns nil while this process leads the election, and an
// error wrapping ErrNotLeader otherwise: before it has won, while another
// process leads, as soon as its leadership's context is cancelled (the
// leadership is lost, being lost, or resigned), and after Close (wrapping
// pgcoord.ErrClosed too). When the last campaign failed, the error says
// why. It answers from the process's own state: ctx is not used, and it
// never blocks.
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
	if l.ctx.Err() != nil {
		return 0, fmt.Errorf("%w: election %q: term %d is ending: %w", ErrNotLeader, name, l.term, context.Cause(l.ctx))
	}
	if d, ok := l.ctx.Deadline(); ok && !time.Now().Before(d) {
		return 0, fmt.Errorf("%w: election %q: term %d is past its deadline %v", ErrNotLeader, name, l.term, d)
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
