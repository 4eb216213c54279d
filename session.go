package pgcoord

// Sessions: one dedicated connection for many locks

import (
	"context"

	"github.com/pgcoord/pgcoord/internal/core"
)

// A Session is one dedicated PostgreSQL connection on which any number of
// locks are held. It is never returned to a pool while it may hold a lock.
// A heartbeat proves the connection alive; when it fails, or when nothing
// has proved it alive for the loss deadline, the session is lost: Done
// closes, Err returns an error wrapping [ErrLockLost], the connection is
// closed (so the server frees the locks), and every Lock on it is lost too.
//
// A Session's methods are safe for concurrent use. Statements on its one
// connection run one at a time; tries and releases of single keys that
// goroutines send while it is busy go out together, as one statement, each
// caller getting its own key's answer. A blocking acquire waits on the server in
// slices (see the package documentation), so it never stops the session
// from proving itself alive; an Unlock, TryLock or Close that needs the
// connection while a blocking acquire waits on it interrupts that wait,
// which then resumes. Blocking acquires on one Session wait one at a time.
type Session struct{ core *core.Session }

// engine returns s's session in the lock core: nil for a nil Session, and a
// zero one for a Session that NewSession did not make, as for a Client.
func (s *Session) engine() *core.Session {
	if s == nil {
		return nil
	}
	if s.core == nil {
		return new(core.Session)
	}
	return s.core
}

// NewSession opens a Session: one dedicated connection for many locks. ctx
// bounds only the connect. It returns [ErrClosed] after Close, an error
// wrapping [ErrReadOnly] if the server is a standby,
// [ErrTransactionPooling] behind a transaction-pooling proxy,
// [ErrTooManyConnections] if the server has no free connection slot, or the
// connection error.
func (c *Client) NewSession(ctx context.Context) (*Session, error) {
	s, err := c.engine().NewSession(ctx)
	if err != nil {
		return nil, err
	}
	return &Session{s}, nil
}

// Done returns a channel that is closed when the session ends: by Close,
// by the Client's Close, or by loss.
func (s *Session) Done() <-chan struct{} { return s.engine().Done() }

// Err returns nil while the session is open, an error wrapping
// [ErrLockLost] (and the cause) if it was lost, or [ErrClosed] if it was
// closed.
func (s *Session) Err() error { return s.engine().Err() }

// PID returns the server process ID of the session's backend, as shown in
// pg_locks and pg_stat_activity.
func (s *Session) PID() int32 { return s.engine().PID() }

// Close ends the session: its locks end with [ErrClosed], a blocking
// acquire in flight on it returns ErrClosed, and the connection is closed.
// ctx bounds Close (by the loss deadline when ctx has none). When Close
// returns nil, every lock of the session is free on the server: it runs
// pg_advisory_unlock_all() before closing the connection. If ctx ends
// first, or the connection fails, Close closes the socket instead and
// returns an error; the server then frees the locks when the backend
// notices, at once for a connected idle backend, and within the server
// bound of the package documentation for a silent network. Closing a closed
// or lost session returns nil.
func (s *Session) Close(ctx context.Context) error { return s.engine().Close(ctx) }

// Lock is [Client.Lock] on this session's connection.
func (s *Session) Lock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return lockOf(s.engine().Lock(ctx, key.coreKey(), coreLockOptions(opts)...))
}

// TryLock is [Client.TryLock] on this session's connection.
func (s *Session) TryLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return lockOf(s.engine().TryLock(ctx, key.coreKey(), coreLockOptions(opts)...))
}

// RLock is [Client.RLock] on this session's connection, with one
// difference: the session holds each key once, so every shared hold of a
// key on one session joins the first without asking the server, and a
// writer elsewhere waits until all of them are released. Readers that must
// let a waiting writer in take the key through the Client.
func (s *Session) RLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return lockOf(s.engine().RLock(ctx, key.coreKey(), coreLockOptions(opts)...))
}

// TryRLock is [Client.TryRLock] on this session's connection.
func (s *Session) TryRLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error) {
	return lockOf(s.engine().TryRLock(ctx, key.coreKey(), coreLockOptions(opts)...))
}

// LockAll is [Client.LockAll] on this session's connection. The session's
// locks and its waits are one session to the server: a wait on a session
// that holds other locks is, to PostgreSQL, a session that holds and waits.
// If the server picks it as a deadlock victim, the acquire returns an error
// wrapping [ErrDeadlock], leaves nothing of its keys behind, and the
// session and its other locks live: release some to let the other side go
// on.
func (s *Session) LockAll(ctx context.Context, keys ...Key) (*Lock, error) {
	return lockOf(s.engine().LockAll(ctx, coreKeys(keys)...))
}
