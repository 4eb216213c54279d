package core

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// A connection's life
//
// Every dedicated connection of a Client (its shared backends, the
// backends of its waits, Sessions, the election guard's session and the
// listener) is opened here, through the pool's connect path, and only
// here: dial, then the checks and settings of a connection that may hold
// locks (prepare, setup), then, for a session, the statements of its
// common path (prepareHot). Opening is bounded by the Client's connect
// timeout and by its Close, never by the deadline of the call that needed
// the connection: a call that gives up does not waste the connection (a
// backend joins the Client's backends for the next call; a Session is
// closed). Closing a connection that holds nothing is closeConn; a
// session that may hold locks is closed by Session.close.

// connectCall is a connection being opened in the background.
type connectCall struct {
	done chan struct{}
	s    *Session
	err  error
}

// newSession opens a dedicated connection and prepares it for holding locks.
// ctx bounds the connect.
func (c *Client) newSession(ctx context.Context, managed bool) (*Session, error) {
	conn, pid, err := c.Connect(ctx)
	if err != nil {
		return nil, err
	}
	if err := prepareHot(ctx, conn); err != nil {
		CloseConn(conn, c.Cfg.LossDeadline)
		return nil, err
	}
	s := &Session{
		c:        c,
		conn:     conn,
		Pid:      pid,
		managed:  managed,
		use:      make(chan struct{}, 1),
		waitTurn: make(chan struct{}, 1),
		LastOK:   time.Now(),
		Holds:    make(map[Key]*keyHold),
		locks:    make(map[*Lock]struct{}),
		done:     make(chan struct{}),
		stopHB:   make(chan struct{}),
		hbDone:   make(chan struct{}),
		cleaned:  make(chan struct{}),
		traced:   conn.Config().Tracer != nil,
	}
	// The lease's callback reads s.lease under s.state.
	s.State.Lock()
	s.lease = time.AfterFunc(c.Cfg.LossDeadline, s.checkLease)
	s.State.Unlock()
	go s.heartbeat()
	return s, nil
}

// OpenSession opens a session of its own (not one of the Client's shared
// backends) and records it so Close can end it. The connection is opened
// in the background, bounded by the connect timeout and by Close; ctx
// bounds only the wait for it, and a session that is ready after ctx ended
// is closed. It returns ErrClosed if the Client was closed meanwhile, and
// a failure to connect as a connectFailure (see connectFailed), as
// startConnect does.
func (c *Client) OpenSession(ctx context.Context) (*Session, error) {
	type opened struct {
		s   *Session
		err error
	}
	ch := make(chan opened, 1)
	c.Wg.Add(1)
	go func() {
		defer c.Wg.Done()
		cctx, cancel := context.WithTimeout(c.Closing, c.ConnectTimeout)
		s, err := c.newSession(cctx, false)
		cancel()
		if err == nil {
			c.Mu.Lock()
			closed := c.Closed
			if !closed {
				c.Sessions[s] = struct{}{}
			}
			c.Mu.Unlock()
			if closed {
				s.close(context.Background())
				s, err = nil, ErrClosed
			}
		} else if c.Closing.Err() != nil {
			err = ErrClosed
		} else {
			err = connectFailed(err)
		}
		ch <- opened{s, err}
	}()
	select {
	case o := <-ch:
		return o.s, o.err
	case <-ctx.Done():
		c.Wg.Add(1)
		go func() {
			defer c.Wg.Done()
			if o := <-ch; o.s != nil {
				o.s.close(context.Background())
			}
		}()
		return nil, context.Cause(ctx)
	}
}

// startConnect opens a backend in the background; when it is ready it
// joins the Client's backends. The caller holds c.mu.
func (c *Client) startConnect() *connectCall {
	call := &connectCall{done: make(chan struct{})}
	c.connects = append(c.connects, call)
	c.opening++
	c.Wg.Add(1)
	go func() {
		defer c.Wg.Done()
		ctx, cancel := context.WithTimeout(c.Closing, c.ConnectTimeout)
		s, err := c.newSession(ctx, true)
		cancel()
		c.Mu.Lock()
		c.opening--
		for i, x := range c.connects {
			if x == call {
				c.connects = append(c.connects[:i:i], c.connects[i+1:]...)
				break
			}
		}
		switch {
		case err != nil:
			if cause := context.Cause(ctx); c.Closed && cause != nil {
				err = cause
			} else {
				err = connectFailed(err)
			}
		case c.Closed:
			err = ErrClosed
		default:
			c.Sessions[s] = struct{}{}
			c.Backends = append(c.Backends, s)
		}
		c.Mu.Unlock()
		c.backendFreed()
		if err != nil && s != nil {
			s.close(context.Background())
		}
		call.s, call.err = s, err
		close(call.done)
	}()
	return call
}

// errConnect marks an error of opening a backend (see connectFailure).
var errConnect = errors.New("pgcoord: open connection")

// connectFailure is an error of opening a backend that may pass with
// time: the server could not be reached, was starting or shutting down,
// had no slot for the connection, or was a standby; the connection broke
// or timed out; a BeforeConnect or AfterConnect hook failed for any other
// reason. A blocking acquire tries again (see Client.take).
type connectFailure struct{ err error }

func (e *connectFailure) Error() string        { return e.err.Error() }
func (e *connectFailure) Unwrap() error        { return e.err }
func (e *connectFailure) Is(target error) bool { return target == errConnect }

// connectFailed marks err, an error of opening a dedicated connection, as
// a connectFailure, unless it is one that trying again cannot cure (see
// permanentConnectError). Every connection of a Client is opened through
// it, so a blocking call rides through the same errors whichever
// connection it needed: its shared backends, a Session, the election
// guard's session; and returns the same errors at once.
func connectFailed(err error) error {
	if permanentConnectError(err) || errors.Is(err, errConnect) {
		return err
	}
	return &connectFailure{err}
}

// permanentConnectError reports whether err, an error of opening a
// dedicated connection, is one that no retry can cure, which a blocking
// acquire returns at once instead of trying again until its ctx ends:
//
//   - a transaction pooler between pgcoord and the server
//     (ErrTransactionPooling);
//   - a pgx connection config that cannot run pgcoord's statements
//     (errConnConfig: a query mode whose cache has no capacity);
//   - the server's refusal of the configuration: the role or its
//     authentication (SQLSTATE class 28: an unknown role, a wrong
//     password, no pg_hba.conf entry, a role that may not log in), an
//     unknown database (3D000), a missing privilege (42501: CONNECT on the
//     database, or a setting the role may not change), an unknown setting
//     (42704) or an invalid value (22023), from the connection's runtime
//     parameters or options, a hook, or pgcoord's session settings.
//
// A wrong password is among them: credentials that rotate are read anew
// for each connection by a BeforeConnect hook, so a failed one is not
// cured by trying again with the same; a caller that expects rotation
// retries the call. Everything else (a server down, starting up, shutting
// down or in recovery, no free connection slot, a network error or
// timeout, a hook's other errors) may pass with time and is retried.
func permanentConnectError(err error) bool {
	if errors.Is(err, ErrTransactionPooling) || errors.Is(err, errConnConfig) {
		return true
	}
	code := SqlState(err)
	return strings.HasPrefix(code, "28") || code == "3D000" || code == "42501" || code == "42704" || code == "22023"
}

// errConnConfig marks a connection config that cannot run pgcoord's
// statements (see checkConnConfig).
var errConnConfig = errors.New("pgcoord: unusable connection config")

// checkConnConfig refuses a config whose default query mode needs a cache
// that it gives no capacity: pgx would fail every statement with
// arguments on such a connection.
func checkConnConfig(cc *pgx.ConnConfig) error {
	switch {
	case cc.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement && cc.StatementCacheCapacity <= 0:
		return Errorf("open connection: %w: statement_cache_capacity is 0 with default_query_exec_mode cache_statement, which pgx refuses for every statement with arguments (cannot use QueryExecModeCacheStatement with disabled statement cache); give the statement cache a capacity, or set default_query_exec_mode to describe_exec or exec", errConnConfig)
	case cc.DefaultQueryExecMode == pgx.QueryExecModeCacheDescribe && cc.DescriptionCacheCapacity <= 0:
		return Errorf("open connection: %w: description_cache_capacity is 0 with default_query_exec_mode cache_describe, which pgx refuses for every statement with arguments (cannot use QueryExecModeCacheDescribe with disabled description cache); give the description cache a capacity, or set default_query_exec_mode to describe_exec or exec", errConnConfig)
	}
	return nil
}

// anyConnect returns a connection being opened, or starts one. The caller
// holds c.mu.
func (c *Client) anyConnect() *connectCall {
	if len(c.connects) > 0 {
		return c.connects[len(c.connects)-1]
	}
	return c.startConnect()
}

// Connect opens a dedicated connection through the pool's connect path
// (its dialer, wrapped, and its BeforeConnect and AfterConnect hooks) and
// prepares it for holding locks. It returns the connection and its backend
// pid.
func (c *Client) Connect(ctx context.Context) (*pgx.Conn, int32, error) {
	conn, err := c.dial(ctx)
	if err != nil {
		return nil, 0, err
	}
	pid, err := c.prepare(ctx, conn)
	if err != nil {
		CloseConn(conn, c.Cfg.LossDeadline)
		return nil, 0, err
	}
	return conn, pid, nil
}

// A hotStatement is a statement of a session's common path, with
// arguments that make it do nothing: a pid guard of 0 matches no backend.
type hotStatement struct {
	Sql  string
	args []any
}

// hotStatements are the statements of Lock, TryLock and Unlock of one
// bigint key, and of the heartbeat.
var HotStatements = sync.OnceValue(func() []hotStatement {
	k := []Key{Int64Key(0)}
	try, tryArgs := TrySQL(LockFunc(false, true), k, 0)
	wait, waitArgs := WaitSQL(LockFunc(false, false), k, 0)
	unlock, unlockArgs := UnlockSQL(UnlockFunc(false), k, 0)
	return []hotStatement{{try, tryArgs}, {wait, waitArgs}, {unlock, unlockArgs}, {PingSQL, nil}}
})

// prepareHot prepares hotStatements on a session's new connection and
// runs each once, guarded to do nothing. Else a backend's first lock would
// cost pgx's prepare round trip, and the server's first lookups of the
// statement's functions in its catalogs: together a few times a warm lock,
// and more on a loaded machine, where a tight deadline would then miss on
// a connection that was ready.
func prepareHot(ctx context.Context, conn *pgx.Conn) error {
	for _, h := range HotStatements() {
		if _, err := conn.Prepare(ctx, h.Sql, h.Sql); err != nil {
			return Errorf("prepare session connection: %w", err)
		}
		if _, err := conn.Exec(ctx, h.Sql, h.args...); err != nil {
			return Errorf("prepare session connection: %w", err)
		}
	}
	return nil
}

// dial opens a connection as the pool would, watching its notices for
// commits that may not be durable (see watchNotices).
func (c *Client) dial(ctx context.Context) (*pgx.Conn, error) {
	cc := c.connConfig.Copy()
	watchNotices(cc)
	if c.beforeConnect != nil {
		if err := c.beforeConnect(ctx, cc); err != nil {
			return nil, Errorf("open connection: BeforeConnect: %w", err)
		}
	}
	if err := checkConnConfig(cc); err != nil {
		return nil, err
	}
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return nil, connectError(err)
	}
	if c.afterConnect != nil {
		if err := c.afterConnect(ctx, conn); err != nil {
			CloseConn(conn, c.Cfg.LossDeadline)
			return nil, Errorf("open connection: AfterConnect: %w", err)
		}
	}
	return conn, nil
}

// connectError explains a failed connect; running out of connection slots
// wraps ErrTooManyConnections.
func connectError(err error) error {
	if SqlState(err) == "53300" {
		return Errorf("open connection: %w: the server has no free connection slot (SQLSTATE 53300); raise max_connections, close idle connections elsewhere, or lower WithMaxWaits: %w", ErrTooManyConnections, err)
	}
	return Errorf("open connection: %w", err)
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
	major := ServerMajor(conn.PgConn().ParameterStatus("server_version"))
	pid, err := c.setup(ctx, conn, major, int32(conn.PgConn().PID()))
	if !errors.Is(err, pgx.ErrNoRows) {
		return pid, err
	}
	if !c.Cfg.SessionPooler {
		return 0, Errorf("%w: a connection pooler is between pgcoord and the server (the backend pid differs from the one announced at connect); session locks cannot work through transaction pooling: use the Xact functions, or, if the pooler runs in session mode, pass WithSessionPooler", ErrTransactionPooling)
	}
	probe, err := c.dial(ctx)
	if err != nil {
		return 0, err
	}
	defer CloseConn(probe, c.Cfg.LossDeadline)
	var inRecovery bool
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid(), pg_is_in_recovery()").Scan(&pid, &inRecovery); err != nil {
		return 0, Errorf("prepare session connection: %w", err)
	}
	if inRecovery {
		return 0, readOnlyError()
	}
	var other int32
	if err := probe.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&other); err != nil {
		return 0, Errorf("prepare session connection: probe: %w", err)
	}
	if other == pid {
		return 0, Errorf("%w: two client connections share backend %d (the pooler pools transactions, not sessions); use the Xact functions", ErrTransactionPooling, pid)
	}
	got, err := c.setup(ctx, conn, major, pid)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, Errorf("%w: the backend changed between two statements (the pooler pools transactions, not sessions); use the Xact functions", ErrTransactionPooling)
	}
	return got, err
}

// setup runs the settings statement guarded by pid; pgx.ErrNoRows means it
// ran on another backend and did nothing.
func (c *Client) setup(ctx context.Context, conn *pgx.Conn, major int, pid int32) (int32, error) {
	sql, args := setupSQL(c.Cfg, major, pid)
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
		return 0, Errorf("prepare session connection: %w", err)
	case inRecovery:
		return 0, readOnlyError()
	}
	return got, nil
}

func readOnlyError() error {
	return Errorf("%w: pg_is_in_recovery() is true; connect to the primary", ErrReadOnly)
}

// CloseConn closes a connection that holds nothing, bounded by d.
func CloseConn(conn *pgx.Conn, d time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	_ = conn.Close(ctx)
}
