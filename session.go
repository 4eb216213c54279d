package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// A Session is one dedicated PostgreSQL connection on which any number of
// locks are held. It is never returned to a pool while it may hold a lock.
// A heartbeat proves the connection alive; when it fails, or when nothing
// has proved it alive for the loss deadline, the session is lost: Done
// closes, Err returns an error wrapping [ErrLockLost], the connection is
// closed (so the server frees the locks), and every Lock on it is lost too.
//
// A Session's methods are safe for concurrent use; statements on its one
// connection run one at a time, so a blocking Lock delays the others.
type Session struct {
	c       *Client
	conn    *pgx.Conn
	pid     int32
	managed bool // owned by the Client for single-lock use

	mu      sync.Mutex // serialises use of conn
	waiting bool       // a blocking acquire is in flight (guarded by state)

	state   sync.Mutex
	lastOK  time.Time          // start of the last statement that succeeded
	held    map[Key]int        // keys this backend holds (once each), by live handle count
	locks   map[*Lock]struct{} // live handles
	err     error              // why the session ended; nil while open
	done    chan struct{}
	lease   *time.Timer
	stopHB  chan struct{}
	hbDone  chan struct{}
	cleaned chan struct{} // closed when the connection is closed and the heartbeat has stopped
}

// newSession opens a dedicated connection and prepares it for holding locks.
func (c *Client) newSession(ctx context.Context, managed bool) (*Session, error) {
	conn, err := pgx.ConnectConfig(ctx, c.connConfig)
	if err != nil {
		return nil, fmt.Errorf("pgcoord: open session connection: %w", err)
	}
	start := time.Now()
	sql, args := setupSQL(c.cfg)
	var pid int32
	var inRecovery bool
	dest := []any{&pid, &inRecovery}
	for range len(args) / 2 {
		dest = append(dest, new(string))
	}
	if err := conn.QueryRow(ctx, sql, args...).Scan(dest...); err != nil {
		closeConn(conn, c.cfg.lossDeadline)
		return nil, fmt.Errorf("pgcoord: prepare session connection: %w", err)
	}
	if inRecovery {
		closeConn(conn, c.cfg.lossDeadline)
		return nil, fmt.Errorf("%w: pg_is_in_recovery() is true; connect to the primary", ErrReadOnly)
	}
	s := &Session{
		c:       c,
		conn:    conn,
		pid:     pid,
		managed: managed,
		lastOK:  start,
		held:    make(map[Key]int),
		locks:   make(map[*Lock]struct{}),
		done:    make(chan struct{}),
		stopHB:  make(chan struct{}),
		hbDone:  make(chan struct{}),
		cleaned: make(chan struct{}),
	}
	s.lease = time.AfterFunc(c.cfg.lossDeadline, s.checkLease)
	go s.heartbeat()
	return s, nil
}

// NewSession opens a Session: one dedicated connection for many locks. ctx
// bounds only the connect. It returns [ErrClosed] after Close, an error
// wrapping [ErrReadOnly] if the server is a standby, or the connection error.
func (c *Client) NewSession(ctx context.Context) (*Session, error) {
	if err := c.enter(); err != nil {
		return nil, err
	}
	defer c.wg.Done()
	return c.open(ctx, false)
}

// Done returns a channel that is closed when the session ends: by Close,
// by the Client's Close, or by loss.
func (s *Session) Done() <-chan struct{} { return s.done }

// Err returns nil while the session is open, an error wrapping
// [ErrLockLost] (and the cause) if it was lost, or [ErrClosed] if it was
// closed.
func (s *Session) Err() error {
	s.state.Lock()
	defer s.state.Unlock()
	return s.err
}

// PID returns the server process ID of the session's backend, as shown in
// pg_locks and pg_stat_activity.
func (s *Session) PID() int32 { return s.pid }

// Close releases every lock of the session and closes its connection. ctx
// bounds the release; if it cannot be done in time (or ctx is already
// cancelled) the connection is closed anyway, which makes the server free
// the locks. Close returns the first error met; the locks are gone either
// way. Closing a closed or lost session returns nil.
func (s *Session) Close(ctx context.Context) error {
	err := s.close(ctx)
	s.c.untrack(s)
	return err
}

func (s *Session) close(ctx context.Context) error {
	if !s.end(ErrClosed) {
		<-s.cleaned // ended by loss: wait for its cleanup
		return nil
	}
	ctx, cancel := withoutCancel(ctx, s.c.cfg.lossDeadline)
	defer cancel()
	s.mu.Lock()
	// Ending the connection releases all session locks at once: pgx sends
	// Terminate, the backend exits and its locks go with it.
	err := s.conn.Close(ctx)
	s.mu.Unlock()
	<-s.hbDone
	close(s.cleaned)
	if err != nil {
		return fmt.Errorf("pgcoord: close session: %w", err)
	}
	return nil
}

// end moves the session to its final state once: it records why, stops the
// heartbeat and the lease, and ends every lock. It reports whether this
// call was the one that ended the session.
func (s *Session) end(why error) bool {
	s.state.Lock()
	if s.err != nil {
		s.state.Unlock()
		return false
	}
	s.err = why
	locks := s.locks
	s.locks = nil
	s.state.Unlock()
	s.lease.Stop()
	close(s.stopHB)
	close(s.done)
	for l := range locks {
		l.end(why)
	}
	return true
}

// lose ends the session because its locks can no longer be trusted, and
// closes the socket at once so that the server frees them and any
// statement in flight returns.
func (s *Session) lose(cause error) {
	err := fmt.Errorf("%w: %w", ErrLockLost, cause)
	if !s.end(err) {
		return
	}
	s.c.cfg.logger.Warn("pgcoord: session lost", "pid", s.pid, "err", cause)
	_ = s.conn.PgConn().Conn().Close()
	// The statement that noticed the loss may still hold s.mu; finish
	// closing once it lets go. Client.Close waits for this through
	// s.cleaned.
	go func() {
		s.mu.Lock()
		closeConn(s.conn, time.Second)
		s.mu.Unlock()
		<-s.hbDone
		close(s.cleaned)
		s.c.untrack(s)
	}()
}

// run executes one statement on the session's connection. A success counts
// as proof that the connection is alive; a broken connection loses the
// session. Statement errors (lock wait cancelled, deadlock, ...) are
// returned as they are for the caller to resolve.
func (s *Session) run(ctx context.Context, waits bool, f func(ctx context.Context, conn *pgx.Conn) error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.Err(); err != nil {
		return err
	}
	if waits {
		s.state.Lock()
		s.waiting = true
		s.state.Unlock()
	}
	start := time.Now()
	err := f(ctx, s.conn)
	if err == nil && waits && time.Since(start) > s.c.cfg.heartbeat {
		// A long wait does not tell when the server last heard from us:
		// prove the connection alive afresh before trusting what it won.
		start = time.Now()
		err = s.ping(ctx)
	}
	s.state.Lock()
	s.waiting = false
	if err == nil {
		s.lastOK = start
		s.lease.Reset(s.c.cfg.lossDeadline - time.Since(start))
	}
	s.state.Unlock()
	if err != nil && (s.conn.IsClosed() || errors.Is(err, ErrTransactionPooling)) {
		s.lose(err)
		if e := s.Err(); e != nil {
			return e
		}
	}
	return err
}

// heartbeat proves the connection alive every interval, unless a statement
// is running on it (which proves it, or fails, by itself).
func (s *Session) heartbeat() {
	defer close(s.hbDone)
	t := time.NewTicker(s.c.cfg.heartbeat)
	defer t.Stop()
	for {
		select {
		case <-s.stopHB:
			return
		case <-t.C:
		}
		if !s.mu.TryLock() {
			continue
		}
		s.state.Lock()
		deadline := s.lastOK.Add(s.c.cfg.lossDeadline)
		s.state.Unlock()
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		start := time.Now()
		err := s.ping(ctx)
		cancel()
		if err == nil {
			s.state.Lock()
			s.lastOK = start
			s.lease.Reset(s.c.cfg.lossDeadline - time.Since(start))
			s.state.Unlock()
		}
		s.mu.Unlock()
		if err != nil {
			s.lose(fmt.Errorf("heartbeat: %w", err))
		}
	}
}

// ping proves the connection alive with one round trip, and that the
// backend behind it is still the one that holds the session's locks. The
// caller holds s.mu. ctx's cancellation is ignored; it is bounded by the
// loss deadline.
func (s *Session) ping(ctx context.Context) error {
	ctx, cancel := withoutCancel(ctx, s.c.cfg.lossDeadline)
	defer cancel()
	var pid int32
	if err := s.conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		return err
	}
	if pid != s.pid {
		return fmt.Errorf("%w: backend pid changed from %d to %d", ErrTransactionPooling, s.pid, pid)
	}
	return nil
}

// checkLease runs when nothing has proved the connection alive for the
// loss deadline. While a blocking acquire is in flight the socket's own
// keepalive and user timeout bound the wait instead (see the package
// documentation), so the lease is checked again when it ends.
func (s *Session) checkLease() {
	s.state.Lock()
	waiting, age := s.waiting, time.Since(s.lastOK)
	if waiting || age < s.c.cfg.lossDeadline {
		s.lease.Reset(max(s.c.cfg.lossDeadline-age, s.c.cfg.heartbeat))
		s.state.Unlock()
		return
	}
	s.state.Unlock()
	s.lose(fmt.Errorf("no heartbeat for %v (loss deadline %v)", age.Round(time.Millisecond), s.c.cfg.lossDeadline))
}

// closeConn closes a connection that holds nothing, bounded by d.
func closeConn(conn *pgx.Conn, d time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	_ = conn.Close(ctx)
}

// errorIsLoss reports whether err means the session (and its locks) ended.
func errorIsLoss(err error) bool {
	return errors.Is(err, ErrLockLost) || errors.Is(err, ErrClosed)
}
