package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// maxIdleSessions is how many lock-free dedicated connections a Client
// keeps for reuse by Lock, TryLock, RLock, TryRLock, LockAll and Do.
const maxIdleSessions = 4

// A Client takes locks on behalf of one process. Locks are held on
// dedicated connections opened from the pool's configuration; they are
// never taken from or returned to the pool, so a pool borrower can never
// silently re-enter a lock. A Client is safe for concurrent use.
type Client struct {
	cfg        *config
	pool       *pgxpool.Pool
	ownPool    bool
	connConfig *pgx.ConnConfig
	gates      gates

	closing context.Context // cancelled with ErrClosed by Close
	stop    context.CancelCauseFunc
	wg      sync.WaitGroup // calls in flight and background cleanup

	mu       sync.Mutex
	closed   bool
	idle     []*Session
	sessions map[*Session]struct{}
}

// New returns a Client that uses pool's connection settings. The pool stays
// the caller's: Close does not close it. New does not touch the network.
// It returns an error for a nil pool or for invalid or conflicting options.
func New(pool *pgxpool.Pool, opts ...Option) (*Client, error) {
	if pool == nil {
		return nil, errors.New("pgcoord: New: pool is nil")
	}
	return newClient(pool, false, opts)
}

// Open connects a pool to connString and returns a Client that owns it:
// Close closes the pool. ctx bounds the connect and the first ping. It
// returns errors for an unparsable connString, an unreachable server, and
// invalid or conflicting options.
func Open(ctx context.Context, connString string, opts ...Option) (*Client, error) {
	if _, err := newConfig(scopeClient, opts); err != nil {
		return nil, err
	}
	pool, err := pgxpool.New(ctx, connString)
	if err != nil {
		return nil, fmt.Errorf("pgcoord: Open: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("pgcoord: Open: %w", err)
	}
	return newClient(pool, true, opts)
}

func newClient(pool *pgxpool.Pool, own bool, opts []Option) (*Client, error) {
	cfg, err := newConfig(scopeClient, opts)
	if err != nil {
		return nil, err
	}
	c := &Client{
		cfg:        cfg,
		pool:       pool,
		ownPool:    own,
		connConfig: dedicatedConfig(pool.Config().ConnConfig, cfg),
		sessions:   make(map[*Session]struct{}),
	}
	c.closing, c.stop = context.WithCancelCause(context.Background())
	return c, nil
}

// Close ends every session and lock of the Client (their Done channels
// close, their Err is ErrClosed), makes waiting acquires return ErrClosed,
// waits for background work to finish, and closes the pool if Open made
// it. Releasing is bounded by the loss deadline; connections that cannot
// be released cleanly in that time are closed, which frees their locks on
// the server. Close returns the first release error; calling it again
// returns nil.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	all := make([]*Session, 0, len(c.sessions))
	for s := range c.sessions {
		all = append(all, s)
	}
	c.sessions = nil
	c.idle = nil
	c.mu.Unlock()
	c.stop(ErrClosed)

	var errs []error
	for _, s := range all {
		errs = append(errs, s.close(context.Background()))
	}
	c.wg.Wait()
	if c.ownPool {
		c.pool.Close()
	}
	return errors.Join(errs...)
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

// track records a session so Close can end it. It reports false if the
// Client was closed meanwhile.
func (c *Client) track(s *Session) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.sessions[s] = struct{}{}
	return true
}

func (c *Client) untrack(s *Session) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.sessions, s)
}

// borrow returns an idle managed session (reused reports true) or opens a
// new one.
func (c *Client) borrow(ctx context.Context) (s *Session, reused bool, err error) {
	c.mu.Lock()
	for len(c.idle) > 0 {
		s := c.idle[len(c.idle)-1]
		c.idle = c.idle[:len(c.idle)-1]
		if s.Err() == nil {
			c.mu.Unlock()
			return s, true, nil
		}
	}
	c.mu.Unlock()
	s, err = c.open(ctx, true)
	return s, false, err
}

// open opens a new session, managed by the Client for single-lock use or
// handed to the caller, and tracks it so Close can end it.
func (c *Client) open(ctx context.Context, managed bool) (*Session, error) {
	s, err := c.newSession(ctx, managed)
	if err != nil {
		return nil, err
	}
	if !c.track(s) {
		s.close(context.Background())
		return nil, ErrClosed
	}
	return s, nil
}

// giveBack returns a managed session that holds nothing to the idle list,
// or closes it if the list is full or the Client closed.
func (c *Client) giveBack(s *Session) {
	if s.Err() != nil {
		return
	}
	c.mu.Lock()
	if !c.closed && len(c.idle) < maxIdleSessions {
		c.idle = append(c.idle, s)
		c.mu.Unlock()
		return
	}
	c.mu.Unlock()
	s.Close(context.Background())
}

// acquireCtx derives the context of an acquire: it ends with ctx or when
// the Client closes, whichever is first.
func (c *Client) acquireCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(c.closing, func() { cancel(ErrClosed) })
	return ctx, func() { stop(); cancel(nil) }
}
