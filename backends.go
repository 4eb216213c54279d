package pgcoord

import (
	"context"
	"errors"
	"sync"

	"github.com/jackc/pgx/v5"
)

// The Client's shared backends
//
// Locks taken through a Client (Lock, TryLock, RLock, TryRLock, LockAll,
// Do) live on a few dedicated connections that the Client shares among all
// its locks; a held lock costs an entry in the server's lock table, not a
// connection. An acquire first tries its keys, without waiting, on a
// shared backend that is not busy with a wait: one round trip, and no new
// connection, when the keys are free. Only when the keys are held
// elsewhere does it wait on the server, and such waits run on their own
// backends: at most WithMaxWaits (default DefaultMaxWaits) at once; further
// waits queue in the process, first come first served, until one ends.
// So a Client never uses more than WithSharedBackends + WithMaxWaits
// connections (defaults 2 + 4) for its locks, whatever the number of keys
// it holds. A lock granted after a wait stays on the backend that waited;
// that backend then serves tries and later waits like any other (a wait
// on a backend that holds locks is interrupted by an Unlock of one of
// them, and resumes). Sessions from NewSession are separate: one
// connection each.
//
// Connections are opened in the background, bounded by the connect
// timeout, not by the deadline of the call that needed one: a call that
// gives up does not waste the connection, which the next call uses.
// A lost backend ends every lock on it (their Done channels close and Err
// wraps ErrLockLost); the Client opens another when it needs one.

// DefaultMaxWaits is how many blocking acquires of one Client wait on the
// server at once unless WithMaxWaits says otherwise; DefaultSharedBackends
// is how many backends serve its tries and hold its locks.
const (
	DefaultMaxWaits       = 4
	DefaultSharedBackends = 2
)

// connectCall is a connection being opened in the background.
type connectCall struct {
	done chan struct{}
	s    *Session
	err  error
}

// Stat is a snapshot of a Client's use of the server, like pgxpool.Stat.
type Stat struct {
	Backends    int // dedicated connections of the Client's own locks
	Sessions    int // connections of Sessions from NewSession
	Connecting  int // connections being opened
	Waits       int // blocking acquires waiting on the server
	QueuedWaits int // blocking acquires queued in the process for a wait slot
	Locks       int // live Lock handles, on backends and Sessions

	DroppedHookEvents int64 // events not delivered to WithHooks' hooks because too many were pending
}

// Stat returns a snapshot of the Client's connections, waits and locks.
func (c *Client) Stat() Stat {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := Stat{
		Backends:    len(c.backends),
		Sessions:    len(c.sessions) - len(c.backends),
		Connecting:  c.opening,
		QueuedWaits: int(c.queuedWaits.Load()),

		DroppedHookEvents: c.hooks.droppedEvents(),
	}
	for s := range c.sessions {
		if s.waiter {
			st.Waits++
		}
		s.state.Lock()
		st.Locks += len(s.locks)
		s.state.Unlock()
	}
	return st
}

// Warm opens the Client's shared backends now, so that the first locks do
// not wait for a connection. ctx bounds the wait; the connections go on
// opening in the background if it ends first. It returns the first
// connection error, or ctx's.
func (c *Client) Warm(ctx context.Context) error { return c.warm(ctx, c.cfg.sharedBackends) }

// warm opens shared backends until n are open or opening, and waits for
// the ones it started, bounded by ctx.
func (c *Client) warm(ctx context.Context, n int) error {
	if err := c.enter(); err != nil {
		return err
	}
	defer c.wg.Done()
	c.mu.Lock()
	var calls []*connectCall
	for open := len(c.backends) + c.opening; open < n; open++ {
		calls = append(calls, c.startConnect())
	}
	c.mu.Unlock()
	for _, call := range calls {
		if err := c.awaitConnect(ctx, call); err != nil {
			return err
		}
	}
	return nil
}

// take acquires r on the Client's backends: a try on a shared backend,
// then, if the keys are held elsewhere, a wait on a backend of the waits.
// A backend found dead (a server restart, say) takes nothing with it that
// this acquire holds: the acquire goes on, on another backend.
func (c *Client) take(ctx context.Context, r request) (*Lock, error) {
	var err error
	for range c.cfg.sharedBackends + c.cfg.maxWaits + 1 {
		var l *Lock
		if l, err = c.takeOnce(ctx, r); err == nil || !errorIsLoss(err) || ctx.Err() != nil {
			return l, err
		}
	}
	return nil, err
}

func (c *Client) takeOnce(ctx context.Context, r request) (*Lock, error) {
	tr := r
	tr.try = true
	b, err := c.fastBackend(ctx, r)
	if err != nil {
		return nil, err
	}
	if err := b.prepare(ctx, r.prepare); err != nil {
		return nil, err
	}
	l, err := b.take(ctx, tr)
	if r.try || !errors.Is(err, ErrLocked) {
		return l, err
	}
	if c.observed() {
		c.contended(r, false)
	}

	c.queuedWaits.Add(1)
	select {
	case c.waitSlots <- struct{}{}:
		c.queuedWaits.Add(-1)
	case <-ctx.Done():
		c.queuedWaits.Add(-1)
		return nil, context.Cause(ctx)
	}
	defer func() { <-c.waitSlots }()
	b, done, err := c.waitBackend(ctx, r)
	if err != nil {
		return nil, err
	}
	defer done()
	if err := b.prepare(ctx, r.prepare); err != nil {
		return nil, err
	}
	r.tried = true
	return b.take(ctx, r)
}

// fastBackend picks the backend for a try: one that already holds r's keys
// shared (joining costs no round trip), else a free one that is not
// waiting. It opens another when all are busy and fewer than the shared
// count are open, and waits for a connection only when there is none.
func (c *Client) fastBackend(ctx context.Context, r request) (*Session, error) {
	for {
		c.mu.Lock()
		if c.closed {
			c.mu.Unlock()
			return nil, ErrClosed
		}
		if r.shared {
			if b := c.holderOf(r.keys); b != nil {
				c.mu.Unlock()
				return b, nil
			}
		}
		var pick *Session
		n := 0
		for _, b := range c.backends {
			if b.waiter {
				continue
			}
			n++
			if pick == nil || len(b.use) == 0 && len(pick.use) != 0 {
				pick = b
			}
		}
		if (pick == nil || len(pick.use) != 0) && n+c.opening < c.cfg.sharedBackends {
			c.startConnect()
		}
		if pick != nil {
			c.mu.Unlock()
			return pick, nil
		}
		call := c.anyConnect()
		c.mu.Unlock()
		if err := c.awaitConnect(ctx, call); err != nil {
			return nil, err
		}
	}
}

// waitBackend picks the backend for a blocking acquire and marks it as
// waiting; done unmarks it. Shared keys that a backend holds or is taking
// are joined there. Otherwise it takes a backend that holds nothing, when
// another remains for tries, or opens one while under the limit, or, at
// the limit, waits on a backend that holds locks.
func (c *Client) waitBackend(ctx context.Context, r request) (*Session, func(), error) {
	for {
		c.mu.Lock()
		if c.closed {
			c.mu.Unlock()
			return nil, nil, ErrClosed
		}
		if r.shared {
			if b := c.holderOf(r.keys); b != nil {
				c.mu.Unlock()
				return b, func() {}, nil
			}
		}
		var idle, holder []*Session
		for _, b := range c.backends {
			if b.waiter {
				continue
			}
			if b.holdsNothing() {
				idle = append(idle, b)
			} else {
				holder = append(holder, b)
			}
		}
		var pick *Session
		switch {
		case len(idle) > 0 && len(idle)+len(holder) > 1:
			pick = idle[len(idle)-1]
		case len(c.backends)+c.opening < c.cfg.sharedBackends+c.cfg.maxWaits:
			call := c.startConnect()
			c.mu.Unlock()
			if err := c.awaitConnect(ctx, call); err != nil {
				if !errors.Is(err, ErrTooManyConnections) || len(idle)+len(holder) == 0 {
					return nil, nil, err
				}
				// No slot for another connection: wait on one we have.
				c.mu.Lock()
				pick = c.leastLoaded()
				if pick == nil {
					c.mu.Unlock()
					return nil, nil, err
				}
				break
			}
			continue
		case len(idle) > 0:
			pick = idle[0]
		default:
			pick = c.leastLoaded()
		}
		if pick == nil {
			// Every backend waits; one will be free when a wait ends.
			call := c.anyConnect()
			c.mu.Unlock()
			if err := c.awaitConnect(ctx, call); err != nil {
				return nil, nil, err
			}
			continue
		}
		pick.waiter = true
		c.mu.Unlock()
		return pick, func() {
			c.mu.Lock()
			pick.waiter = false
			c.mu.Unlock()
		}, nil
	}
}

// holderOf returns a backend that holds or is taking one of keys, so that
// another shared hold of them joins it there. The caller holds c.mu.
func (c *Client) holderOf(keys []Key) *Session {
	for _, b := range c.backends {
		b.state.Lock()
		for _, k := range keys {
			if h := b.keys[k]; h != nil && h.shared {
				b.state.Unlock()
				return b
			}
		}
		b.state.Unlock()
	}
	return nil
}

// leastLoaded returns the non-waiting backend with the fewest locks. The
// caller holds c.mu.
func (c *Client) leastLoaded() *Session {
	var pick *Session
	least := 0
	for _, b := range c.backends {
		if b.waiter {
			continue
		}
		b.state.Lock()
		n := len(b.locks)
		b.state.Unlock()
		if pick == nil || n < least {
			pick, least = b, n
		}
	}
	return pick
}

func (s *Session) holdsNothing() bool {
	s.state.Lock()
	defer s.state.Unlock()
	return len(s.keys) == 0
}

// startConnect opens a backend in the background; when it is ready it
// joins the Client's backends. The caller holds c.mu.
func (c *Client) startConnect() *connectCall {
	call := &connectCall{done: make(chan struct{})}
	c.connects = append(c.connects, call)
	c.opening++
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		ctx, cancel := context.WithTimeout(c.closing, c.connectTimeout)
		s, err := c.newSession(ctx, true)
		cancel()
		c.mu.Lock()
		c.opening--
		for i, x := range c.connects {
			if x == call {
				c.connects = append(c.connects[:i:i], c.connects[i+1:]...)
				break
			}
		}
		switch {
		case err != nil:
			if cause := context.Cause(ctx); c.closed && cause != nil {
				err = cause
			}
		case c.closed:
			err = ErrClosed
		default:
			c.sessions[s] = struct{}{}
			c.backends = append(c.backends, s)
		}
		c.mu.Unlock()
		if err != nil && s != nil {
			s.close(context.Background())
		}
		call.s, call.err = s, err
		close(call.done)
	}()
	return call
}

// anyConnect returns a connection being opened, or starts one. The caller
// holds c.mu.
func (c *Client) anyConnect() *connectCall {
	if len(c.connects) > 0 {
		return c.connects[len(c.connects)-1]
	}
	return c.startConnect()
}

// awaitConnect waits for call, bounded by ctx.
func (c *Client) awaitConnect(ctx context.Context, call *connectCall) error {
	select {
	case <-call.done:
		return call.err
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// connect opens a dedicated connection through the pool's connect path
// (its dialer, wrapped, and its BeforeConnect and AfterConnect hooks) and
// prepares it for holding locks. It returns the connection and its backend
// pid.
func (c *Client) connect(ctx context.Context) (*pgx.Conn, int32, error) {
	conn, err := c.dial(ctx)
	if err != nil {
		return nil, 0, err
	}
	pid, err := c.prepare(ctx, conn)
	if err != nil {
		closeConn(conn, c.cfg.lossDeadline)
		return nil, 0, err
	}
	return conn, pid, nil
}

// A hotStatement is a statement of a session's common path, with
// arguments that make it do nothing: a pid guard of 0 matches no backend.
type hotStatement struct {
	sql  string
	args []any
}

// hotStatements are the statements of Lock, TryLock and Unlock of one
// bigint key, and of the heartbeat.
var hotStatements = sync.OnceValue(func() []hotStatement {
	k := []Key{Int64Key(0)}
	try, tryArgs := trySQL(lockFunc(false, true), k, 0)
	wait, waitArgs := waitSQL(lockFunc(false, false), k, 0)
	unlock, unlockArgs := unlockSQL(unlockFunc(false), k, 0)
	return []hotStatement{{try, tryArgs}, {wait, waitArgs}, {unlock, unlockArgs}, {pingSQL, nil}}
})

// prepareHot prepares hotStatements on a session's new connection and
// runs each once, guarded to do nothing. Else a backend's first lock would
// cost pgx's prepare round trip, and the server's first lookups of the
// statement's functions in its catalogs: together a few times a warm lock,
// and more on a loaded machine, where a tight deadline would then miss on
// a connection that was ready.
func prepareHot(ctx context.Context, conn *pgx.Conn) error {
	for _, h := range hotStatements() {
		if _, err := conn.Prepare(ctx, h.sql, h.sql); err != nil {
			return errorf("prepare session connection: %w", err)
		}
		if _, err := conn.Exec(ctx, h.sql, h.args...); err != nil {
			return errorf("prepare session connection: %w", err)
		}
	}
	return nil
}

// dial opens a connection as the pool would.
func (c *Client) dial(ctx context.Context) (*pgx.Conn, error) {
	cc := c.connConfig.Copy()
	if c.beforeConnect != nil {
		if err := c.beforeConnect(ctx, cc); err != nil {
			return nil, errorf("open connection: BeforeConnect: %w", err)
		}
	}
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return nil, connectError(err)
	}
	if c.afterConnect != nil {
		if err := c.afterConnect(ctx, conn); err != nil {
			closeConn(conn, c.cfg.lossDeadline)
			return nil, errorf("open connection: AfterConnect: %w", err)
		}
	}
	return conn, nil
}

// connectError explains a failed connect; running out of connection slots
// wraps ErrTooManyConnections.
func connectError(err error) error {
	if pgCode(err) == "53300" {
		return errorf("open connection: %w: the server has no free connection slot (SQLSTATE 53300); raise max_connections, close idle connections elsewhere, or lower WithMaxWaits: %w", ErrTooManyConnections, err)
	}
	return errorf("open connection: %w", err)
}

// prepare applies the session settings to conn's backend and checks that
// the backend is a primary that the connection keeps to itself. It returns
// the backend's pid.
//
// Directly connected (or through a TCP proxy), the pid the server announced
// at connect is the backend's, and one statement guarded by it does
// everything. Otherwise a protocol-aware pooler is in between (PgBouncer,
// pgcat, RDS Proxy, ...). In transaction pooling mode such a pooler may run
// each statement on another backend, or keep handing back the same one
// while it is idle, which no statement of the session alone can tell apart
// from a backend of its own; so a pooler is refused unless the Client was
// told it pools sessions (WithSessionPooler). Even then prepare asks a
// second connection through the pooler which backend it lands on: the
// session's own means the pooler shares backends between its clients.
// Settings are applied with a statement guarded by the backend's pid, which
// does nothing on another backend.
func (c *Client) prepare(ctx context.Context, conn *pgx.Conn) (int32, error) {
	major := serverMajor(conn.PgConn().ParameterStatus("server_version"))
	pid, err := c.setup(ctx, conn, major, int32(conn.PgConn().PID()))
	if !errors.Is(err, pgx.ErrNoRows) {
		return pid, err
	}
	if !c.cfg.sessionPooler {
		return 0, errorf("%w: a connection pooler is between pgcoord and the server (the backend pid differs from the one announced at connect); session locks cannot work through transaction pooling: use the Xact functions, or, if the pooler runs in session mode, pass WithSessionPooler", ErrTransactionPooling)
	}
	probe, err := c.dial(ctx)
	if err != nil {
		return 0, err
	}
	defer closeConn(probe, c.cfg.lossDeadline)
	var inRecovery bool
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid(), pg_is_in_recovery()").Scan(&pid, &inRecovery); err != nil {
		return 0, errorf("prepare session connection: %w", err)
	}
	if inRecovery {
		return 0, readOnlyError()
	}
	var other int32
	if err := probe.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&other); err != nil {
		return 0, errorf("prepare session connection: probe: %w", err)
	}
	if other == pid {
		return 0, errorf("%w: two client connections share backend %d (the pooler pools transactions, not sessions); use the Xact functions", ErrTransactionPooling, pid)
	}
	got, err := c.setup(ctx, conn, major, pid)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, errorf("%w: the backend changed between two statements (the pooler pools transactions, not sessions); use the Xact functions", ErrTransactionPooling)
	}
	return got, err
}

// setup runs the settings statement guarded by pid; pgx.ErrNoRows means it
// ran on another backend and did nothing.
func (c *Client) setup(ctx context.Context, conn *pgx.Conn, major int, pid int32) (int32, error) {
	sql, args := setupSQL(c.cfg, major, pid)
	var got int32
	var inRecovery bool
	dest := []any{&got, &inRecovery}
	for range (len(args) - 1) / 2 {
		dest = append(dest, new(string))
	}
	err := conn.QueryRow(ctx, sql, args...).Scan(dest...)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return 0, err
	case err != nil:
		return 0, errorf("prepare session connection: %w", err)
	case inRecovery:
		return 0, readOnlyError()
	}
	return got, nil
}

func readOnlyError() error {
	return errorf("%w: pg_is_in_recovery() is true; connect to the primary", ErrReadOnly)
}
