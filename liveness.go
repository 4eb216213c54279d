package pgcoord

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

// serverBound returns S, the time after which the server drops the backend
// of a client it has heard nothing from, given the client loss deadline L.
// It is 2L: keepalive probes start after L/2 of silence, one a second, and
// the connection is declared dead when they have gone unanswered until 2L
// (or data has gone unacknowledged for 2L, via tcp_user_timeout). The client gives up after L, so it knows it
// lost its locks at least L before anyone else can take them.
func serverBound(loss time.Duration) time.Duration { return 2 * loss }

// sessionSettings returns the settings a pinned connection applies to its
// own backend. They need no special privilege.
func sessionSettings(c *config) map[string]string {
	loss := c.lossDeadline
	const interval = time.Second
	idle := (loss/2 + time.Second - 1).Truncate(time.Second) // L/2, rounded up
	count := int((serverBound(loss) - idle + interval - 1) / interval)
	secs := func(d time.Duration) string { return strconv.FormatInt(int64(d/time.Second), 10) }
	return map[string]string{
		// The server notices a silent client within serverBound(loss).
		"tcp_keepalives_idle":     secs(idle),
		"tcp_keepalives_interval": secs(interval),
		"tcp_keepalives_count":    strconv.Itoa(count),
		"tcp_user_timeout":        strconv.FormatInt(serverBound(loss).Milliseconds(), 10),
		// A backend that is waiting for a lock notices a closed client
		// socket within a second, instead of waiting on and then holding
		// the lock for nobody.
		"client_connection_check_interval": "1000",
		// Nothing may end a lock-holding session or a long wait but the
		// application or a dead network.
		"idle_session_timeout":                "0",
		"idle_in_transaction_session_timeout": "0",
		"statement_timeout":                   "0",
		"lock_timeout":                        "0",
		"application_name":                    c.appName,
	}
}

// dedicatedConfig derives the configuration of pgcoord's pinned
// connections from a pool's connection configuration:
//   - a cancelled context sends a cancel request to the server, so a
//     cancelled lock wait ends with an error on a connection that stays
//     usable (pgx's default closes the socket, and a backend blocked in a
//     lock wait might then be granted the lock for nobody);
//   - TCP keepalives and TCP_USER_TIMEOUT on the client socket, so a
//     statement in flight on a silent network fails within the loss
//     deadline.
func dedicatedConfig(base *pgx.ConnConfig, c *config) *pgx.ConnConfig {
	cc := base.Copy()
	cc.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.CancelRequestContextWatcherHandler{
			Conn:               pc,
			CancelRequestDelay: 0,
			DeadlineDelay:      c.lossDeadline,
		}
	}
	d := &net.Dialer{
		Timeout: c.lossDeadline,
		KeepAliveConfig: net.KeepAliveConfig{
			Enable:   true,
			Idle:     c.heartbeat,
			Interval: c.heartbeat,
			Count:    max(int(c.lossDeadline/c.heartbeat), 1),
		},
		Control: setUserTimeout(c.lossDeadline),
	}
	cc.DialFunc = d.DialContext
	return cc
}

// setupSQL applies sessionSettings and reads the backend's identity in one
// round trip.
func setupSQL(c *config) (string, []any) {
	sql := "SELECT pg_backend_pid(), pg_is_in_recovery()"
	settings := sessionSettings(c)
	var args []any
	for _, name := range slices.Sorted(maps.Keys(settings)) {
		args = append(args, name, settings[name])
		sql += fmt.Sprintf(", set_config($%d, $%d, false)", len(args)-1, len(args))
	}
	return sql, args
}

// withoutCancel returns a context for releasing things: it keeps ctx's
// values, cannot already be cancelled, and ends after d.
func withoutCancel(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), d)
}
