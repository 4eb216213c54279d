package pgcoord

import (
	"context"
	"errors"
	"reflect"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Making a Client: New and Open

// New returns a Client that uses pool's connection settings. The pool stays
// the caller's: Close does not close it, and the Client needs it open. New
// does not touch the network. It returns an error for a nil pool, one
// wrapping [ErrClosed] for a pool that was closed, and one for invalid or
// conflicting options.
func New(pool *pgxpool.Pool, opts ...Option) (*Client, error) {
	if pool == nil {
		return nil, errors.New("pgcoord: new client: pool is nil")
	}
	if poolClosed(pool) {
		return nil, core.Errorf("new client: the pool was closed: %w", ErrClosed)
	}
	return openClient(pool, false, opts)
}

// poolClosed reports whether pool was closed. pgxpool has no method that
// tells, and asking it for a connection would open one on an open pool, so
// poolClosed reads the channel that pgxpool's Close closes. Should a later
// pgx name it otherwise, poolClosed reports false and the pool's first use
// reports the closed pool instead (the core's Client.OnPool);
// TestNewRefusesClosedPool fails then, so the change does not go unseen.
func poolClosed(pool *pgxpool.Pool) bool {
	f := reflect.ValueOf(pool).Elem().FieldByName("closeChan")
	if !f.IsValid() || f.Type() != reflect.TypeFor[chan struct{}]() {
		return false
	}
	closed := *(*chan struct{})(unsafe.Pointer(f.UnsafeAddr()))
	select {
	case <-closed:
		return true
	default:
		return false
	}
}

// Open makes a pool for connString and returns a Client that owns it:
// Close closes the pool. Open opens the Client's first lock connection, so
// the first lock does not wait for one, and so a server that pgcoord
// cannot use fails here; the pool itself connects only when a method that
// runs on it (Leader, Locks, ...) first needs it. ctx bounds the connect.
// Open returns errors for an unparsable connString, an unreachable server,
// a standby ([ErrReadOnly]), a transaction pooler
// ([ErrTransactionPooling]), and invalid or conflicting options.
func Open(ctx context.Context, connString string, opts ...Option) (*Client, error) {
	if _, err := newConfig(opts); err != nil {
		return nil, err
	}
	pool, err := pgxpool.New(ctx, connString)
	if err != nil {
		return nil, core.Errorf("Open: %w", err)
	}
	c, err := openClient(pool, true, opts)
	if err != nil {
		pool.Close()
		return nil, err
	}
	if err := c.core.WarmUp(ctx, 1); err != nil {
		_ = c.Close(context.Background())
		return nil, core.Errorf("Open: %w", err)
	}
	return c, nil
}

// openClient returns a Client of pool with the options opts; own makes
// Close close the pool.
func openClient(pool *pgxpool.Pool, own bool, opts []Option) (*Client, error) {
	cfg, err := newConfig(opts)
	if err != nil {
		return nil, err
	}
	events := eventHooksOf(cfg)
	c := &Client{core: core.NewClient(pool, own, cfg)}
	c.core.NewHandle = newHandle
	c.semaphoreRecheck = semaphoreRecheck
	c.events = events
	if events != nil {
		events.q = c.core.Hooks
	}
	return c, nil
}

// coordState is the state of a Client's elections and semaphores.
type coordState struct {
	events *eventHooks // nil without OnLeadership and OnPermit hooks
	// semaphoreRecheck is how often the head of a semaphore's queue looks
	// for a permit with no notification (semaphoreRecheck; tests set it).
	semaphoreRecheck time.Duration
	noAwait          atomic.Bool // the schema has no semaphore_await: heads wait for notifications

	notifier  notifier      // the listener connection's subscriptions
	guardMu   sync.Mutex    // guards guard
	guard     *core.Session // holds the guards of the Client's leaderships
	listening atomic.Bool   // the listener listens now
}
