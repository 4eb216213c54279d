package core

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/puddle/v2"
)

// The core of a Client: its sessions, its Close, and what every call
// checks first

// Client is the core of [pgcoord.Client], which documents it.
type Client struct {
	Cfg *Config
	// NewHandle, if set, makes the handles of the Client's locks: the API
	// keeps each inside its own, and finds its own through Lock.Face.
	NewHandle      func() *Lock
	Pool           *pgxpool.Pool
	ownPool        bool
	connConfig     *pgx.ConnConfig
	beforeConnect  func(context.Context, *pgx.ConnConfig) error
	afterConnect   func(context.Context, *pgx.Conn) error
	ConnectTimeout time.Duration
	Gates          gates
	Contention     contention // keys found held elsewhere a moment ago
	Hooks          *HookQueue // nil without WithHooks

	Closing context.Context // cancelled with ErrClosed by Close
	stop    context.CancelCauseFunc
	Wg      sync.WaitGroup // calls in flight and background work

	QueuedWaits atomic.Int64  // blocking acquires that found no backend to wait on
	freedMu     sync.Mutex    // guards freed
	freed       chan struct{} // closed when a backend may have become free to wait on

	Mu       sync.Mutex
	Closed   bool
	ClosedAt time.Time             // when Close began: it cancels the leaders' contexts then
	Sessions map[*Session]struct{} // every open session: backends and NewSession's
	Backends []*Session            // the shared backends of the Client's own locks
	connects []*connectCall        // connections being opened
	opening  int
}

// NewClient returns a Client of pool with the settings cfg; own makes
// Close close the pool.
func NewClient(pool *pgxpool.Pool, own bool, cfg *Config) *Client {
	pc := pool.Config()
	c := &Client{
		Cfg:            cfg,
		Pool:           pool,
		ownPool:        own,
		connConfig:     dedicatedConfig(pc.ConnConfig, cfg),
		beforeConnect:  pc.BeforeConnect,
		afterConnect:   pc.AfterConnect,
		ConnectTimeout: pc.ConnConfig.ConnectTimeout,
		Gates:          gates{maxHandoffs: cfg.MaxHandoffs, handoffWindow: cfg.HandoffWindow},
		Sessions:       make(map[*Session]struct{}),
		Contention:     contention{Memory: contentionMemory},
	}
	if c.ConnectTimeout <= 0 {
		c.ConnectTimeout = ServerBound(cfg.LossDeadline)
	}
	c.Closing, c.stop = context.WithCancelCause(context.Background())
	c.Hooks = newHookQueue(cfg.Hooks, cfg.WarnLogger)
	return c
}

// Close is the core of [pgcoord.Client.Close], which documents it.
func (c *Client) Close(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	c.Mu.Lock()
	if c.Closed {
		c.Mu.Unlock()
		return nil
	}
	c.Closed = true
	c.ClosedAt = time.Now()
	all := make([]*Session, 0, len(c.Sessions))
	for s := range c.Sessions {
		all = append(all, s)
	}
	c.Mu.Unlock()
	// Cancelling closing cancels every leader's context at once, before
	// anything is released (see leaderParent).
	c.stop(ErrClosed)

	// Release every connection at once: each is bounded by the loss
	// deadline, and so is Close.
	errs := make([]error, len(all))
	var closing sync.WaitGroup
	for i, s := range all {
		closing.Go(func() { errs[i] = s.close(ctx) })
	}
	closing.Wait()
	for _, s := range all {
		<-s.cleaned
	}
	c.Wg.Wait()
	c.Hooks.close()
	if c.ownPool {
		c.Pool.Close()
	}
	return errors.Join(errs...)
}

// RefuseClosed returns ErrClosed once Close has begun, for calls that need
// no tracking while they run (they hold nothing of the Client's).
func (c *Client) RefuseClosed() error {
	c.Mu.Lock()
	defer c.Mu.Unlock()
	if c.Closed {
		return ErrClosed
	}
	return nil
}

// Enter registers a call in flight, or returns ErrClosed.
func (c *Client) Enter() error {
	c.Mu.Lock()
	defer c.Mu.Unlock()
	if c.Closed {
		return ErrClosed
	}
	c.Wg.Add(1)
	return nil
}

// untrack forgets a session whose connection is closed.
func (c *Client) untrack(s *Session) {
	c.Mu.Lock()
	defer c.Mu.Unlock()
	delete(c.Sessions, s)
}

// retire stops routing locks to an ended session.
func (c *Client) retire(s *Session) {
	c.Mu.Lock()
	for i, b := range c.Backends {
		if b == s {
			c.Backends = append(c.Backends[:i:i], c.Backends[i+1:]...)
			break
		}
	}
	c.Mu.Unlock()
	c.backendFreed()
}

// handoff passes l, being released, to a goroutine of this Client that
// waits for its key, if the gate allows it (see gates).
func (c *Client) handoff(l *Lock) bool {
	return c.Gates.handoff(l, func() *Lock {
		s := l.S
		s.State.Lock()
		defer s.State.Unlock()
		if _, ok := s.locks[l]; !ok || s.err != nil {
			return nil
		}
		next := c.newHandle() // claimed by its acquire
		next.S, next.KeyList = s, l.KeyList
		if s.c.observed() {
			next.since = time.Now()
		}
		delete(s.locks, l)
		s.locks[next] = struct{}{}
		l.finish(ErrNotHeld) // the old handle ends before the new one is delivered
		return next
	})
}

func (x closingContext) Deadline() (time.Time, bool) { return time.Time{}, false }
func (x closingContext) Done() <-chan struct{}       { return x.closing.Done() }
func (x closingContext) Err() error                  { return x.closing.Err() }

// Value looks keys up in the caller's context, then in the Client's
// closing context, which holds no values of its own but lets
// context.Cause find ErrClosed.
func (x closingContext) Value(key any) any {
	if v := x.values.Value(key); v != nil {
		return v
	}
	return x.closing.Value(key)
}

// OnPool runs the statements that queue adds to a batch on a connection of
// the Client's pool, in a transaction of its own at READ COMMITTED,
// whatever default_transaction_isolation the database, role or connection
// sets: one round trip for BEGIN, the statements and COMMIT. The
// bookkeeping tables of elections and semaphores are updated by several
// Clients at once, which at REPEATABLE READ or SERIALIZABLE would fail
// with serialization errors that READ COMMITTED resolves by re-reading the
// row. If a statement fails, the transaction is rolled back, so the
// connection goes back to the pool clean. ctx bounds the acquire and the
// batch.
func (c *Client) OnPool(ctx context.Context, queue func(b *pgx.Batch)) error {
	conn, err := c.Pool.Acquire(ctx)
	if errors.Is(err, puddle.ErrClosedPool) {
		return Errorf("the pool was closed: %w", ErrClosed)
	}
	if err != nil {
		return err
	}
	defer conn.Release()
	b := &pgx.Batch{}
	b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
	queue(b)
	b.Queue("COMMIT")
	err = conn.SendBatch(ctx, b).Close()
	if pc := conn.Conn().PgConn(); !pc.IsClosed() && pc.TxStatus() != 'I' {
		// A failed statement left the transaction open. Should the
		// rollback fail too, Release discards the connection.
		rctx, cancel := WithoutCancel(ctx, c.Cfg.LossDeadline)
		_, _ = conn.Exec(rctx, "ROLLBACK")
		cancel()
	}
	return err
}
