package pgcoord

// The Client: the locks of one process, on dedicated connections

import (
	"context"

	"github.com/pgcoord/pgcoord/internal/core"
)

// A Client takes locks on behalf of one process. Locks are held on
// dedicated connections opened from the pool's configuration (see
// Stat for how many); they are never taken from or returned to the pool,
// so a pool borrower can never silently re-enter a lock. A Client is safe
// for concurrent use.
type Client struct {
	core *core.Client // the lock core: connections, routing, statements
	coordState
}

// engine returns c's lock core: nil for a nil Client, and a zero one for a
// Client that New or Open did not make, so that the checks of the core's
// methods (a nil ctx, first) come as they did before the core had its own
// package.
func (c *Client) engine() *core.Client {
	if c == nil {
		return nil
	}
	if c.core == nil {
		return new(core.Client)
	}
	return c.core
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
func (c *Client) Close(ctx context.Context) error { return c.engine().Close(ctx) }

// Lock blocks until it holds key exclusively, on one of the Client's
// dedicated connections, and returns the held lock. ctx bounds only the
// wait: once Lock returns, the lock is held until Unlock or loss, whatever
// happens to ctx. If the wait fails or is cancelled, nothing stays locked.
// Lock rides through a lost connection, a server restart or a failover: it
// keeps trying to reach a writable server, backing off, until ctx ends.
// A connection error that no retry can cure it returns at once, naming
// the step ("open connection: ..."): a pgx config that cannot run its
// statements (a query mode whose cache has no capacity), and the server's
// refusal of the role or its authentication (SQLSTATE class 28), of the
// database (3D000), of a privilege (42501) or of a setting (42704, 22023).
// Errors: ctx's error (or cause) if it ended first, joined with the last
// connection error if the server could not be reached; such a connection
// error; [ErrClosed];
// [ErrDeadlock] if the application has a lock cycle; [ErrTooManyLocks];
// [ErrInvalidKey]; [ErrNotMigrated] (with WithFence); or
// [ErrTransactionPooling].
func (c *Client) Lock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return lockOf(c.engine().Lock(ctx, key.coreKey(), coreLockOptions(opts)...))
}

// TryLock takes key exclusively if nobody holds it, without waiting. It
// returns an error wrapping [ErrLocked] if another holder has it, in this
// process or any other. ctx bounds the wait for a connection to send the
// try on, not the round trip itself, which a cancel request would cost
// more than: the loss deadline bounds that (a connection that does not
// answer within it is lost). It fails fast when the server cannot be
// reached (after one more attempt on another connection if its
// connection was lost). Other errors are as for Lock.
func (c *Client) TryLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return lockOf(c.engine().TryLock(ctx, key.coreKey(), coreLockOptions(opts)...))
}

// RLock blocks until it holds key shared: any number of shared holders
// coexist, and exclude exclusive ones. A waiting exclusive holder is not
// starved: PostgreSQL queues new shared requests behind it, and readers of
// one Client join each other's hold without asking the server only for a
// short while after it was taken (the bounds of [WithHandoff]), so they
// too queue behind a writer that waits. As with sync.RWMutex, a goroutine
// must not take a key shared again while it holds it shared: if a writer
// waits meanwhile, the second RLock waits behind it, and the writer waits
// for the first. ctx, opts and errors are as for Lock, except that
// [WithFence] is refused (a fence orders exclusive holders).
func (c *Client) RLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return lockOf(c.engine().RLock(ctx, key.coreKey(), coreLockOptions(opts)...))
}

// TryRLock takes key shared if no exclusive holder has it, without
// waiting; otherwise it returns an error wrapping [ErrLocked]. ctx, opts
// and other errors are as for RLock.
func (c *Client) TryRLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return lockOf(c.engine().TryRLock(ctx, key.coreKey(), coreLockOptions(opts)...))
}

// LockAll blocks until it holds every key exclusively, or none. Keys are
// deduplicated and taken in one canonical order (the order XactLock also
// uses), so two LockAll calls with overlapping keys never deadlock each
// other. Up to 1000 keys take one round trip; larger sets take one per
// 1000. ctx and errors are as for Lock; on error no key stays locked.
// LockAll takes no LockOption: its variadic parameter is the keys, and
// the one option there is, [WithFence], orders single-key holders.
func (c *Client) LockAll(ctx context.Context, keys ...Key) (*Lock, error) {
	return lockOf(c.engine().LockAll(ctx, coreKeys(keys)...))
}

// Stat is a snapshot of a Client's use of the server, like pgxpool.Stat.
type Stat struct {
	Backends    int // dedicated connections of the Client's own locks
	Sessions    int // connections of Sessions from NewSession
	Connecting  int // connections being opened
	Waits       int // blocking acquires waiting on the server
	QueuedWaits int // blocking acquires that found no backend to wait on, or could not reach the server, and try again until they can
	Locks       int // live Lock handles, on backends and Sessions

	DroppedHookEvents int64 // events not delivered to WithHooks' hooks because too many were pending
}

// Stat returns a snapshot of the Client's connections, waits and locks.
func (c *Client) Stat() Stat { return Stat(c.engine().Stat()) }

// Warm opens the Client's shared backends now, so that the first locks do
// not wait for a connection. ctx bounds the wait; the connections go on
// opening in the background if it ends first. It returns the first
// connection error, or ctx's.
func (c *Client) Warm(ctx context.Context) error { return c.engine().Warm(ctx) }

// DefaultMaxWaits is how many blocking acquires of one Client wait on the
// server at once unless WithMaxWaits says otherwise; DefaultSharedBackends
// is how many backends serve its tries and hold its locks.
const (
	DefaultMaxWaits       = 4
	DefaultSharedBackends = 2
)
