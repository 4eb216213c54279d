package pgcoord

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

// A Client takes locks on behalf of one process. Locks are held on
// dedicated connections opened from the pool's configuration (see
// Stat for how many); they are never taken from or returned to the pool,
// so a pool borrower can never silently re-enter a lock. A Client is safe
// for concurrent use.
type Client struct {
	cfg            *config
	pool           *pgxpool.Pool
	ownPool        bool
	connConfig     *pgx.ConnConfig
	beforeConnect  func(context.Context, *pgx.ConnConfig) error
	afterConnect   func(context.Context, *pgx.Conn) error
	connectTimeout time.Duration
	gates          gates
	contention     contention // keys found held elsewhere a moment ago
	hooks          *hookQueue // nil without WithHooks

	closing context.Context // cancelled with ErrClosed by Close
	stop    context.CancelCauseFunc
	wg      sync.WaitGroup // calls in flight and background work

	queuedWaits atomic.Int64  // blocking acquires that found no backend to wait on
	freedMu     sync.Mutex    // guards freed
	freed       chan struct{} // closed when a backend may have become free to wait on

	coordState // the state of its elections and semaphores

	mu       sync.Mutex
	closed   bool
	closedAt time.Time             // when Close began: it cancels the leaders' contexts then
	sessions map[*Session]struct{} // every open session: backends and NewSession's
	backends []*Session            // the shared backends of the Client's own locks
	connects []*connectCall        // connections being opened
	opening  int
}

// newClient returns a Client of pool with the settings cfg; own makes
// Close close the pool.
func newClient(pool *pgxpool.Pool, own bool, cfg *config) *Client {
	pc := pool.Config()
	c := &Client{
		cfg:            cfg,
		pool:           pool,
		ownPool:        own,
		connConfig:     dedicatedConfig(pc.ConnConfig, cfg),
		beforeConnect:  pc.BeforeConnect,
		afterConnect:   pc.AfterConnect,
		connectTimeout: pc.ConnConfig.ConnectTimeout,
		gates:          gates{maxHandoffs: cfg.maxHandoffs, handoffWindow: cfg.handoffWindow},
		sessions:       make(map[*Session]struct{}),
		contention:     contention{memory: contentionMemory},
	}
	if c.connectTimeout <= 0 {
		c.connectTimeout = serverBound(cfg.lossDeadline)
	}
	c.closing, c.stop = context.WithCancelCause(context.Background())
	c.hooks = newHookQueue(cfg.hooks, cfg.warnLogger)
	return c
}

// Close ends every session and lock of the Client (their Done channels
// close, their Err is ErrClosed), makes waiting acquires return ErrClosed,
// waits for background work to finish, and closes the pool if Open made
// it. It first cancels the context of every leadership the Client holds
// (cause ErrClosed), and only then releases locks, guards and permits.
//
// ctx bounds how long Close waits for the server to release the Client's
// locks cleanly; each release is also bounded by the loss deadline. A
// connection that cannot be released cleanly in time is closed, which
// frees its locks on the server as soon as it notices (at once for a
// closed socket). So Close always releases everything it owns, and
// returns within the loss deadline whatever the pool and the server do.
// It returns every release error, joined (with ctx's error when ctx ended
// first); calling it again returns nil.
func (c *Client) Close(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.closedAt = time.Now()
	all := make([]*Session, 0, len(c.sessions))
	for s := range c.sessions {
		all = append(all, s)
	}
	c.mu.Unlock()
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
	c.wg.Wait()
	c.hooks.close()
	if c.ownPool {
		c.pool.Close()
	}
	return errors.Join(errs...)
}

// refuseClosed returns ErrClosed once Close has begun, for calls that need
// no tracking while they run (they hold nothing of the Client's).
func (c *Client) refuseClosed() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	return nil
}

// enter registers a call in flight, or returns ErrClosed.
func (c *Client) enter() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	c.wg.Add(1)
	return nil
}

// untrack forgets a session whose connection is closed.
func (c *Client) untrack(s *Session) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.sessions, s)
}

// retire stops routing locks to an ended session.
func (c *Client) retire(s *Session) {
	c.mu.Lock()
	for i, b := range c.backends {
		if b == s {
			c.backends = append(c.backends[:i:i], c.backends[i+1:]...)
			break
		}
	}
	c.mu.Unlock()
	c.backendFreed()
}

// handoff passes l, being released, to a goroutine of this Client that
// waits for its key, if the gate allows it (see gates).
func (c *Client) handoff(l *Lock) bool {
	return c.gates.handoff(l, func() *Lock {
		s := l.s
		s.state.Lock()
		defer s.state.Unlock()
		if _, ok := s.locks[l]; !ok || s.err != nil {
			return nil
		}
		next := &Lock{s: s, keys: l.keys} // claimed by its acquire
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

// onPool runs the statements that queue adds to a batch on a connection of
// the Client's pool, in a transaction of its own at READ COMMITTED,
// whatever default_transaction_isolation the database, role or connection
// sets: one round trip for BEGIN, the statements and COMMIT. The
// bookkeeping tables of elections and semaphores are updated by several
// Clients at once, which at REPEATABLE READ or SERIALIZABLE would fail
// with serialization errors that READ COMMITTED resolves by re-reading the
// row. If a statement fails, the transaction is rolled back, so the
// connection goes back to the pool clean. ctx bounds the acquire and the
// batch.
func (c *Client) onPool(ctx context.Context, queue func(b *pgx.Batch)) error {
	conn, err := c.pool.Acquire(ctx)
	if errors.Is(err, puddle.ErrClosedPool) {
		return errorf("the pool was closed: %w", ErrClosed)
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
		rctx, cancel := withoutCancel(ctx, c.cfg.lossDeadline)
		_, _ = conn.Exec(rctx, "ROLLBACK")
		cancel()
	}
	return err
}
