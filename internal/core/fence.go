package core

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Fences
//
// A fence is a number from the fences table, one row per key, issued
// strictly increasing and committed durably before it is handed out; a
// write checks it with CheckFence in its own transaction, which refuses a
// fence lower than the key's latest. Session.issueFence issues a lock's
// fence on the lock's backend when it can, and otherwise away from it
// (blockAway), so that no backend that holds keys waits for a row.

// FenceRow returns the fences table's key_space and key for k: objsubid and
// (classid << 32) | objid, exactly as k appears in pg_locks.
func FenceRow(k Key) (space int16, key int64) {
	classid, objid, objsubid := k.LockColumns()
	return objsubid, int64(uint64(classid)<<32 | uint64(objid))
}

// IssueFenceSQL issues the next fence of the fence row ($1, $2) (see
// fenceRow): 1 the first time, then one more than the last fence issued
// for the key, and returns it. Outside a transaction, the new fence is
// committed when the statement returns. The statement waits while a
// transaction that called CheckFence on the key is open; if lockTimeout is
// not 0, it is the number of a parameter that sets lock_timeout for that
// wait (milliseconds, as text, for the statement's transaction only).
//
// The commit waits until the fence is flushed to the WAL, whatever
// synchronous_commit the server, database, role or session sets: with it
// off, a crash could lose a fence that was already returned, so the same
// fence would be issued again and a paused holder of it would pass
// CheckFence. The statement itself sets synchronous_commit to on for the
// transaction it runs in (set_config with is_local, evaluated in the
// INSERT's FROM subquery, before the row is written or waited for), so this
// costs no extra round trip; remote_apply, which also waits for the flush,
// is kept. In an explicit transaction, the setting lasts until that
// transaction ends.
//
// With a synchronous standby, the commit also waits for the standby. A
// cancel that lands during that wait (a slice's end, a caller's ctx, a
// pg_cancel_backend) leaves the fence committed on the primary only, with
// a warning and no error; so the Client runs this statement only as a
// token statement (blockingStatement.durable), which withholds such a
// fence and issues another.
//
// If holder is not 0, it is the number of a parameter with a backend's
// pid: the statement then issues the fence only if that backend holds the
// key exclusively (in pg_locks) when the statement starts, and returns no
// row otherwise. A fence issued on another backend than the lock's must
// check this, or a backend lost meanwhile would get a fence newer than
// its successor's.
//
// If nowait is true, the statement first locks the key's row with FOR
// UPDATE NOWAIT: when a transaction holds the row (it checked the key's
// fence and is still open), the statement fails at once with SQLSTATE
// 55P03 and never joins the row's queue of waiters. A backend that holds
// other goroutines' locks issues fences so (see Client.blockAway): a wait
// there, however short, would let the open transaction's deadlock check
// find a cycle through that backend if the transaction waited for one of
// its keys, a cycle the application does not have.
//
// If floor is not empty, it names a one-row relation of the statement
// (a CTE) whose column floor holds a fence the new one must exceed,
// besides the key's last (NULL for none): an election passes the term in
// its leaders row, so that its terms keep growing even where the fences
// row of its key is older than the leaders row (a key that changed, a
// fences table restored from an older backup).
func IssueFenceSQL(c *Config, lockTimeout, holder int, floor string, nowait bool) string {
	timeout, held, probe := "", "", ""
	if lockTimeout != 0 {
		timeout = fmt.Sprintf(", set_config('lock_timeout', $%d, true)", lockTimeout)
	}
	if nowait {
		// Evaluated with the INSERT's source, before the row is written
		// or waited for; the lock is the transaction's, so the upsert
		// below does not wait for it.
		probe = `, (SELECT count(*) FROM (SELECT FROM ` + c.Table("fences") + ` AS r
			WHERE r.key_space = $1 AND r.key = $2 FOR UPDATE NOWAIT) AS r) AS probe`
	}
	if holder != 0 {
		held = fmt.Sprintf(`
		WHERE EXISTS (SELECT FROM pg_catalog.pg_locks l WHERE l.locktype = 'advisory' AND l.pid = $%d
			AND l.granted AND l.mode = 'ExclusiveLock' AND l.objsubid = $1 AND ((l.classid::int8 << 32) | l.objid::int8) = $2
			AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database()))`, holder)
	}
	first, from, next := "1", "", "f.fence + 1"
	if floor != "" {
		first, from, next = "coalesce("+floor+".floor, 0) + 1", ", "+floor, "GREATEST(f.fence + 1, EXCLUDED.fence)"
	}
	return "INSERT INTO " + c.Table("fences") + ` AS f (key_space, key, fence)
		SELECT $1, $2, ` + first + ` FROM (SELECT set_config('synchronous_commit',
			CASE current_setting('synchronous_commit') WHEN 'remote_apply' THEN 'remote_apply' ELSE 'on' END,
			true)` + timeout + `) AS durable` + probe + from + held + `
		ON CONFLICT (key_space, key) DO UPDATE SET fence = ` + next + `
		RETURNING f.fence`
}

// NextFence issues the next fence for k with one statement on q (see
// issueFenceSQL). It returns an error wrapping ErrNotMigrated when the
// fences table does not exist in the configured schema. It runs the
// statement once, as it is: it cannot see a warning that a wait for a
// synchronous standby was cancelled, so it serves transactions (whose
// commit is their owner's) and tests; the Client's fences and terms go
// through Session.block, which withholds such a fence.
func NextFence(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, c *Config, k Key) (int64, error) {
	if err := k.Check(); err != nil {
		return 0, err
	}
	space, key := FenceRow(k)
	var fence int64
	err := q.QueryRow(ctx, IssueFenceSQL(c, 0, 0, "", false), space, key).Scan(&fence)
	if err != nil {
		return 0, NotMigrated(c, "issue fence for key "+k.String(), err)
	}
	return fence, nil
}

// NotMigrated wraps err with ErrNotMigrated, naming the schema, when the
// server reports that pgcoord's table or schema does not exist (SQLSTATE
// 42P01 or 3F000), and maps it with pgError otherwise.
func NotMigrated(c *Config, op string, err error) error {
	if code := SqlState(err); code == "42P01" || code == "3F000" || code == "42703" {
		return Errorf("%s: %w (schema %s): %w", op, ErrNotMigrated, c.QuotedSchema(), err)
	}
	return PgError(op, err)
}

// WithCtxErr adds ctx's error to err, a statement's error, when ctx ended
// and err does not say so already: a statement cut short by a cancel
// request reports the server's 57014 alone, and a driver that closed the
// connection its own way ("bad connection"), so that errors.Is with
// context.Canceled or context.DeadlineExceeded holds, and with the cause
// given to ctx's cancel. The cause comes first in the message; a statement
// that the server cancelled because ctx ended (57014) is not shown, only
// kept reachable with errors.As, as in every error of pgcoord whose wait
// ctx ended.
func WithCtxErr(ctx context.Context, err error) error {
	cerr := ctx.Err()
	if cerr == nil {
		return err
	}
	switch cause := context.Cause(ctx); {
	case SqlState(err) == "57014":
		// The statement was cancelled because ctx ended: report ctx's end
		// alone, as doc.go says, and keep the server's error reachable.
		msg := cause.Error()
		if cause != cerr {
			msg += " (" + cerr.Error() + ")"
		}
		return &coordError{msg: Prefix + strings.TrimPrefix(msg, Prefix), wrapped: fmt.Errorf("%w%w%w", cause, cerr, err)}
	case errors.Is(err, cause) && errors.Is(err, cerr):
		return err
	case errors.Is(err, cause):
		return Errorf("%w (%w)", err, cerr)
	case errors.Is(err, cerr) || errors.Is(cause, cerr):
		return Errorf("%w: %w", cause, err)
	default:
		return Errorf("%w (%w): %w", cause, cerr, err)
	}
}

// issueFence gives l a new fence for its key. The statement waits while a
// transaction that checked an older fence of the key (CheckFence) is open,
// so it runs as a blocking statement (see blockAway).
func (s *Session) issueFence(ctx context.Context, l *Lock) error {
	// The fence may wait on another backend: stop when l is lost.
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	go func() {
		select {
		case <-l.Done():
			cancel(l.Err())
		case <-ctx.Done():
		}
	}()
	space, key := FenceRow(l.KeyList[0])
	var fence int64
	run := func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error {
		err := conn.QueryRow(ctx, sql, args...).Scan(&fence)
		if errors.Is(err, pgx.ErrNoRows) {
			err = Errorf("%w: backend %d no longer holds %s", ErrLockLost, s.Pid, l.KeyList[0])
		}
		return err
	}
	// Both statements are token statements: a fence whose commit a
	// synchronous standby has not confirmed is withheld (see block).
	err := s.c.BlockAway(ctx, s, BlockingStatement{
		Sql:     IssueFenceSQL(s.c.Cfg, 3, 0, "", true),
		Args:    []any{space, key, ""},
		Run:     run,
		Quick:   true,
		Durable: true,
	}, BlockingStatement{
		// Away from l's backend, the fence checks that l's backend
		// still holds the key.
		Sql:     IssueFenceSQL(s.c.Cfg, 4, 3, "", false),
		Args:    []any{space, key, s.Pid, ""},
		Run:     run,
		Durable: true,
	})
	if err != nil {
		return NotMigrated(s.c.Cfg, "issue fence for key "+l.KeyList[0].String(), err)
	}
	l.fence = fence
	return nil
}

// glance is how long a blocking statement that rarely waits may wait on a
// backend that holds other goroutines' locks (see blockAway) for a lock
// its NOWAIT does not cover (a row being inserted by another transaction
// at the same moment): well below PostgreSQL's deadlock_timeout, so that
// the backend's own deadlock check does not run meanwhile. The row it
// needs it never waits for there: the deadlock check of that row's holder
// would see the backend's keys.
const glance = 20 * time.Millisecond

// BlockAway runs st, a blocking statement that rarely waits (for a row
// that a transaction holds), for a lock on home. On a Session of the
// application's own, it runs there in slices. On a backend of the Client's,
// which may hold other goroutines' locks, it first runs there without
// joining the queue of the row it needs (st locks it with NOWAIT: a wait
// there, however short, would let the row holder's deadlock check find a
// cycle through home if the holder waited for one of home's keys) and
// waiting at most a glance for anything else; if the row is held (or the
// server picked it as a deadlock victim meanwhile), away runs instead on a backend that
// holds nothing, in slices, as a lock wait does (see backends.go); while no
// such backend is free, st runs on home again at growing intervals. On
// home too, st runs in slices, which bounds a wait that no lock_timeout
// covers: its commit's wait for a synchronous standby (see block).
func (c *Client) BlockAway(ctx context.Context, home *Session, st, away BlockingStatement) error {
	if !home.managed {
		return home.Block(ctx, st)
	}
	st.glance = glance
	poll := MinPollInterval
	for {
		err := home.Block(ctx, st)
		if code := SqlState(err); code != "55P03" && code != "40P01" || home.Err() != nil {
			return err
		}
		b, done, err := c.WaitBackend(ctx)
		switch {
		case err == nil:
			err = b.Block(ctx, away)
			done()
			return err
		case !errors.Is(err, ErrNoWaitBackend):
			return err
		}
		if err := c.Pause(ctx, poll); err != nil {
			return err
		}
		poll = min(2*poll, maxPollInterval)
	}
}
