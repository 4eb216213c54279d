package pgcoord

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
)

// Inspection
//
// Locks and Terminate are for operators and tools (cmd/pgcoord uses them):
// they read pg_locks and pg_stat_activity through the Client's pool, hold
// nothing, and need no privilege beyond CONNECT to list locks. What the
// server shows of other roles' backends (client address, times) is hidden
// from a role that is neither a superuser, a member of that role nor of
// pg_read_all_stats; such fields are then empty. Their application names
// show.

// LockInfo is one advisory lock in the Client's database, as pg_locks shows
// it: a backend that holds a key (Granted) or waits for it.
type LockInfo struct {
	Key     Key      // decoded with KeyFromLock
	Name    string   // the Key's name given to WithKeyNames, or ""
	Mode    LockMode // exclusive or shared
	Granted bool     // false while the backend waits for the key

	// PID is the backend's process ID (0 for a lock of a prepared
	// transaction, which has no backend).
	PID int32
	// ApplicationName is the backend's application_name: "pgcoord", or
	// what WithApplicationName set, for pgcoord's connections.
	ApplicationName string
	// ClientAddr is the backend's client as host:port, "local" for a Unix
	// socket, or "" when the server does not say.
	ClientAddr string

	// Since is when the backend started to wait, for a waiter, and the
	// earliest the lock can have been taken, for a holder:
	//
	//   - A waiter: pg_locks.waitstart on PostgreSQL 14 and later, else the
	//     start of the statement that waits (query_start). pgcoord's own
	//     blocking acquires wait in slices of a few seconds, each a new
	//     statement, so for them Since is the start of the current slice.
	//   - A holder: PostgreSQL does not record when a lock was granted,
	//     nor whether it is session- or transaction-level (a session lock
	//     may be older than the transaction its backend is in). Since is
	//     the time the holder's connection was opened (backend_start). The
	//     lock has been held for at most time.Since(Since).
	//
	// It is the zero Time when the server does not say.
	Since time.Time
}

// WithKeyNames gives keys names for [Client.Locks] (LockInfo.Name) and for
// the events of [WithHooks], so that an operator sees "report/daily"
// rather than a hashed number. The map is copied; keys that are not in it
// have no name. Invalid keys in the map are an error.
func WithKeyNames(names map[Key]string) Option {
	m := make(map[core.Key]string, len(names))
	for k, n := range names {
		m[k.coreKey()] = n
	}
	return optionFunc{"WithKeyNames", func(c *core.Config) error {
		for k := range m {
			if err := k.Check(); err != nil {
				return err
			}
		}
		c.KeyNames = m
		return nil
	}}
}

// locksSQL lists the advisory locks of the current database with their
// backends. pg_locks.waitstart exists from PostgreSQL 14 on; reading it
// through to_jsonb gives NULL on older servers instead of an error.
const locksSQL = `
SELECT l.classid::int8, l.objid::int8, l.objsubid, l.mode = 'ShareLock', l.granted,
	coalesce(l.pid, 0), coalesce(a.application_name, ''),
	CASE WHEN a.client_port = -1 THEN 'local'
		WHEN a.client_addr IS NULL THEN ''
		ELSE host(a.client_addr) || ':' || a.client_port END,
	CASE WHEN l.granted THEN a.backend_start
		ELSE coalesce((to_jsonb(l) ->> 'waitstart')::timestamptz, a.query_start) END
FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
	AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY l.granted DESC, 9, l.pid`

// Locks returns every advisory lock in the Client's database, held or
// awaited, by any process. They are ordered by key, in the one order of
// keys that [Client.LockAll] and [XactLock] take them in: bigint keys
// ([Int64Key], [HashKey]) first, by their signed value, then pair keys
// ([PairKey]) by a, then b, both signed; so int64:-5 comes before int64:3,
// and every bigint key before pair:-1,0. The rows of one key come holders
// first, then waiters, each by Since (oldest first, an unknown Since
// last), then by PID. It reads pg_locks and pg_stat_activity in one query
// on a connection of the Client's pool; ctx bounds it. Keys that
// [WithKeyNames] names carry their Name. Errors: [ErrClosed] after Close,
// and the server's error, wrapped.
func (c *Client) Locks(ctx context.Context) ([]LockInfo, error) {
	if ctx == nil {
		return nil, core.Errorf("locks: ctx is nil")
	}
	if err := c.core.Enter(); err != nil {
		return nil, core.Errorf("locks: %w", err)
	}
	defer c.core.Wg.Done()
	rows, err := c.core.Pool.Query(ctx, locksSQL)
	if err != nil {
		return nil, core.PgError("list locks", err)
	}
	locks, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (LockInfo, error) {
		var li LockInfo
		var classid, objid int64
		var objsubid int16
		var shared bool
		var since *time.Time
		if err := row.Scan(&classid, &objid, &objsubid, &shared, &li.Granted, &li.PID, &li.ApplicationName, &li.ClientAddr, &since); err != nil {
			return li, err
		}
		k, err := core.KeyFromLock(uint32(classid), uint32(objid), objsubid)
		if err != nil {
			return li, err
		}
		li.Key, li.Name, li.Mode = keyOf(k), c.core.Cfg.KeyName(k), ModeExclusive
		if shared {
			li.Mode = ModeShared
		}
		if since != nil {
			li.Since = *since
		}
		return li, nil
	})
	if err != nil {
		return nil, core.PgError("list locks", err)
	}
	// The query orders the rows of a key; the keys' order is Go's, since
	// pg_locks splits a key over columns that do not sort as the key does.
	slices.SortStableFunc(locks, func(a, b LockInfo) int { return core.CompareKeys(a.Key.coreKey(), b.Key.coreKey()) })
	return locks, nil
}

// terminateWait bounds how long Terminate waits for a terminated backend
// to exit when ctx has no earlier deadline.
const terminateWait = 10 * time.Second

// Terminate force-releases the locks of a backend by ending it with
// pg_terminate_backend: the server closes its connection and frees every
// lock it holds or waits for, session- and transaction-level. The
// backend's client learns it at its next statement (a pgcoord Client or
// Session within its heartbeat: its locks end with [ErrLockLost]).
//
// Terminate refuses, with an error wrapping [ErrForeignBackend], a backend
// that is not pgcoord's: one whose application_name is not the Client's
// (see [WithApplicationName]; default "pgcoord"), or that is connected to
// another database. [Client.TerminateAny] skips that check. It also
// refuses the backend of the connection it runs on.
//
// The check and the signal are one statement, so the backend signalled is
// the one checked; a pid names a backend only while it lives, though, and
// one read earlier (from [Client.Locks], say) names another backend once
// the server has given it out again. When Terminate returns nil, the
// backend it signalled has exited and its locks are free; a later backend
// with the same pid is told apart by its start and left alone.
//
// ctx bounds the whole call, including the wait for the backend to exit;
// when ctx has no deadline, the call gives up after 10 seconds. Errors:
// ErrForeignBackend; an error naming the missing privilege, wrapping the
// server's *pgconn.PgError (SQLSTATE 42501), when the Client's role may
// not signal that backend (it needs to be a member of the backend's role
// or of pg_signal_backend; only a superuser may end a superuser's
// backend); an error when no backend has that pid; [ErrClosed] after
// Close; and ctx's error or the server's error, wrapped.
func (c *Client) Terminate(ctx context.Context, pid int32) error {
	return c.terminate(ctx, pid, false)
}

// TerminateAny is [Client.Terminate] for any backend of the server,
// whatever its application name or database: use it for a stuck lock held
// by a program that does not use pgcoord. ctx and errors are as for
// Terminate, except that it never returns [ErrForeignBackend].
func (c *Client) TerminateAny(ctx context.Context, pid int32) error {
	return c.terminate(ctx, pid, true)
}

func (c *Client) terminate(ctx context.Context, pid int32, force bool) error {
	if ctx == nil {
		return core.Errorf("terminate backend %d: ctx is nil", pid)
	}
	if err := c.core.Enter(); err != nil {
		return core.Errorf("terminate backend %d: %w", pid, err)
	}
	defer c.core.Wg.Done()
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, terminateWait)
		defer cancel()
	}
	conn, err := c.core.Pool.Acquire(ctx)
	if err != nil {
		return core.Errorf("terminate backend %d: %w", pid, err)
	}
	defer conn.Release()

	// The check and the signal are one statement, so the backend signalled is
	// the one checked: a pid is handed out again once its backend has exited
	// and the server's pids wrap around. The backend's start tells it apart
	// from a later one with its pid in the wait below (NULL where the role
	// may not read it: then any backend with the pid is taken for it).
	var app, db string
	var self, sameDB bool
	var started *time.Time
	var signalled *bool
	err = conn.QueryRow(ctx, `SELECT app, db, self, same_db, backend_start,
			CASE WHEN NOT self AND ($2 OR (app = $3 AND same_db)) THEN pg_terminate_backend(pid) END
		FROM (SELECT pid, coalesce(application_name, '') AS app, coalesce(datname, '') AS db,
				pid = pg_backend_pid() AS self, datname IS NOT DISTINCT FROM current_database() AS same_db,
				backend_start
			FROM pg_stat_activity WHERE pid = $1 OFFSET 0) AS target`,
		pid, force, c.core.Cfg.AppName).Scan(&app, &db, &self, &sameDB, &started, &signalled)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return core.Errorf("terminate backend %d: no backend of the server has that pid", pid)
	case core.SqlState(err) == "42501":
		return core.Errorf("terminate backend %d: permission denied: the role must be a member of the backend's role or of pg_signal_backend (and only a superuser may end a superuser's backend): %w", pid, err)
	case err != nil:
		return core.PgError("terminate backend "+strconv.Itoa(int(pid)), err)
	case self:
		return core.Errorf("terminate backend %d: that is the backend Terminate runs on", pid)
	case !force && app != c.core.Cfg.AppName:
		return core.Errorf("terminate backend %d: %w: its application_name is %q, not %q; use TerminateAny to end it anyway", pid, ErrForeignBackend, app, c.core.Cfg.AppName)
	case !force && !sameDB:
		return core.Errorf("terminate backend %d: %w: it is connected to database %q, not to this Client's; use TerminateAny to end it anyway", pid, ErrForeignBackend, db)
	case signalled == nil || !*signalled:
		return core.Errorf("terminate backend %d: the server could not signal it (it exited meanwhile, or is not a backend)", pid)
	}
	// Wait until the backend has exited and its locks are gone, polling
	// with a growing pause, bounded by ctx. A backend with its pid but
	// another start is a later one: the terminated one has exited, and the
	// locks of that pid are the later one's.
	pause := time.Millisecond
	for {
		var alive bool
		err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND backend_start IS NOT DISTINCT FROM $2)
			OR (EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1)
				AND NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND backend_start IS DISTINCT FROM $2))`, pid, started).Scan(&alive)
		if err != nil {
			if ctx.Err() != nil {
				// ctx ended while the poll was under way.
				return core.Errorf("terminate backend %d: signalled, but it has not exited yet: %w", pid, context.Cause(ctx))
			}
			return core.Errorf("terminate backend %d: signalled, but could not see it exit: %w", pid, err)
		}
		if !alive {
			return nil
		}
		select {
		case <-time.After(pause):
		case <-ctx.Done():
			return core.Errorf("terminate backend %d: signalled, but it has not exited yet: %w", pid, context.Cause(ctx))
		}
		pause = min(2*pause, 50*time.Millisecond)
	}
}
