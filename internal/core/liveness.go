package core

import (
	"context"
	"fmt"
	"maps"
	"net"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
)

// Liveness
//
// The bounds every dedicated connection lives by, derived from the loss
// deadline L and the heartbeat H: the server's own bound S on a silent
// client, and the settings a lock connection sets on its backend so that
// the server ends it within S and no role default ends a holder. Then how a
// Session proves its connection alive: a heartbeat every H while nothing
// else runs on it, and a lease that loses the Session once nothing has
// been answered for L.

// ServerBound returns S, the time after which the server drops the backend
// of a client it has heard nothing from, given the client loss deadline L.
// It is 2L: keepalive probes start after L/2 of silence, one a second, and
// the connection is declared dead when they have gone unanswered until 2L
// (or data has gone unacknowledged for 2L, via tcp_user_timeout). The client gives up after L, so it knows it
// lost its locks at least L before anyone else can take them.
func ServerBound(loss time.Duration) time.Duration { return 2 * loss }

// SessionSettings returns the settings a pinned connection applies to its
// own backend, for a server of the given major version. They need no
// special privilege. client_connection_check_interval and
// idle_session_timeout exist from PostgreSQL 14 on; on 13 they are left
// out (a waiter whose client died is then noticed by the server's TCP
// keepalive, within the server bound, instead of within a second).
// transaction_timeout exists from PostgreSQL 17 on.
func SessionSettings(c *Config, major int) map[string]string {
	loss := c.LossDeadline
	const interval = time.Second
	idle := (loss/2 + time.Second - 1).Truncate(time.Second) // L/2, rounded up
	count := int((ServerBound(loss) - idle + interval - 1) / interval)
	secs := func(d time.Duration) string { return strconv.FormatInt(int64(d/time.Second), 10) }
	m := map[string]string{
		// The server notices a silent client within serverBound(loss).
		"tcp_keepalives_idle":     secs(idle),
		"tcp_keepalives_interval": secs(interval),
		"tcp_keepalives_count":    strconv.Itoa(count),
		"tcp_user_timeout":        strconv.FormatInt(ServerBound(loss).Milliseconds(), 10),
		// Nothing may end a lock-holding session or a long wait but the
		// application or a dead network.
		"idle_in_transaction_session_timeout": "0",
		"statement_timeout":                   "0",
		// No statement on a lock connection waits for a lock longer than
		// a slice (see Session.block), not even for a table that a
		// migration or VACUUM FULL holds while a statement is parsed:
		// the connection must answer within its lease whatever runs on it.
		"lock_timeout":     strconv.FormatInt(c.WaitSlice().Milliseconds(), 10),
		"application_name": c.AppName,
		// The bookkeeping statements of fences, elections and semaphores
		// run on lock connections as single statements that update rows
		// other Clients update at the same moment; they rely on READ
		// COMMITTED's re-check of a row changed meanwhile. Under a
		// database's or role's REPEATABLE READ or SERIALIZABLE default
		// they would fail with a serialization error instead.
		"default_transaction_isolation": "read committed",
	}
	if major >= 14 {
		// A backend that is waiting for a lock notices a closed client
		// socket within a second, instead of waiting on and then holding
		// the lock for nobody.
		m["client_connection_check_interval"] = "1000"
		m["idle_session_timeout"] = "0"
	}
	if major >= 17 {
		// A wait slice is a transaction of its own: a role's or a
		// database's transaction_timeout would end the session in the
		// middle of a wait, and every lock it holds with it.
		m["transaction_timeout"] = "0"
	}
	return m
}

// ServerMajor returns the major version from the server_version parameter
// ("15.4 (Debian ...)" is 15), or 0 if it cannot be read.
func ServerMajor(version string) int {
	end := 0
	for end < len(version) && version[end] >= '0' && version[end] <= '9' {
		end++
	}
	n, _ := strconv.Atoi(version[:end])
	return n
}

// dedicatedConfig derives the configuration of pgcoord's pinned
// connections from a pool's connection configuration:
//   - a cancelled context sends a cancel request to the server (see
//     cancelHandler), so a cancelled lock wait ends with an error on a
//     connection that stays usable (pgx's default closes the socket, which
//     would waste the connection and every lock on it);
//   - the pool's dialer is kept (a cloud SQL connector or an SSH tunnel
//     still works) and wrapped: on a TCP socket it turns on keepalives and
//     TCP_USER_TIMEOUT, so a statement in flight on a silent network fails
//     within the loss deadline.
func dedicatedConfig(base *pgx.ConnConfig, c *Config) *pgx.ConnConfig {
	cc := base.Copy()
	cc.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
		return &CancelHandler{Conn: pc, DeadlineDelay: c.LossDeadline}
	}
	dial := cc.DialFunc
	if dial == nil {
		dial = (&net.Dialer{Timeout: c.LossDeadline}).DialContext
	}
	cc.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		if tcp, ok := conn.(*net.TCPConn); ok {
			_ = tcp.SetKeepAliveConfig(net.KeepAliveConfig{
				Enable:   true,
				Idle:     c.Heartbeat,
				Interval: c.Heartbeat,
				Count:    max(int(c.LossDeadline/c.Heartbeat), 1),
			})
			if rc, err := tcp.SyscallConn(); err == nil {
				_ = setUserTimeout(rc, c.LossDeadline)
			}
		}
		return conn, nil
	}
	return cc
}

// setupSQL applies sessionSettings and reads the backend's identity in one
// round trip, guarded by pid: on another backend it returns no row and
// changes nothing.
func setupSQL(c *Config, major int, pid int32) (string, []any) {
	sql := "SELECT pg_backend_pid(), pg_is_in_recovery()"
	settings := SessionSettings(c, major)
	args := []any{pid}
	for _, name := range slices.Sorted(maps.Keys(settings)) {
		args = append(args, name, settings[name])
		sql += fmt.Sprintf(", set_config($%d, $%d, false)", len(args)-1, len(args))
	}
	return sql + " WHERE pg_backend_pid() = $1", args
}

// WithoutCancel returns a context for releasing things: it keeps ctx's
// values, cannot already be cancelled, and ends after d.
func WithoutCancel(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), d)
}

// heartbeat proves the connection alive every interval, unless a statement
// is running on it (which proves it, or fails, by itself).
func (s *Session) heartbeat() {
	defer close(s.hbDone)
	t := time.NewTicker(s.c.Cfg.Heartbeat)
	defer t.Stop()
	for {
		select {
		case <-s.stopHB:
			return
		case <-t.C:
		}
		select {
		case s.use <- struct{}{}:
		default:
			continue // busy: the statement proves the connection alive
		}
		if s.Err() != nil {
			<-s.use
			return
		}
		s.State.Lock()
		deadline := s.LastOK.Add(s.c.Cfg.LossDeadline)
		s.State.Unlock()
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		err := s.Exec(ctx, s.ping)
		cancel()
		<-s.use
		if err != nil {
			s.Lose(Errorf("heartbeat: %w", err))
		}
	}
}

const PingSQL = "SELECT pg_backend_pid()"

// ping proves the connection alive with one round trip, and that the
// backend behind it is still the one that holds the session's locks.
func (s *Session) ping(ctx context.Context, conn *pgx.Conn) error {
	var pid int32
	if err := conn.QueryRow(ctx, PingSQL).Scan(&pid); err != nil {
		return err
	}
	if pid != s.Pid {
		return Errorf("%w: backend pid changed from %d to %d", ErrTransactionPooling, s.Pid, pid)
	}
	return nil
}

// Prove proves with one round trip, at a moment the caller chooses, that
// the session's backend is alive and still the one that holds its keys
// (see ping); ctx bounds only the wait for the connection. If the proof
// fails for any reason but ctx's end, the session is lost, with op naming
// the caller in its cause, and the session's error is returned.
func (s *Session) Prove(ctx context.Context, op string) error {
	err := s.Run(ctx, s.ping)
	if err == nil || ctx.Err() != nil {
		return err
	}
	s.Lose(Errorf("%s: %w", op, err))
	if e := s.Err(); e != nil {
		return e
	}
	return err
}

// checkLease runs when nothing has proved the connection alive for the
// loss deadline, whatever runs on it.
func (s *Session) checkLease() {
	s.State.Lock()
	age := time.Since(s.LastOK)
	if s.err != nil {
		s.State.Unlock()
		return
	}
	if age < s.c.Cfg.LossDeadline {
		s.lease.Reset(s.c.Cfg.LossDeadline - age)
		s.State.Unlock()
		return
	}
	s.State.Unlock()
	s.Lose(Errorf("no answer from the server for %v (loss deadline %v)", age.Round(time.Millisecond), s.c.Cfg.LossDeadline))
}
