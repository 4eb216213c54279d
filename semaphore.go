package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
)

// Semaphores: the API
//
// Client.Semaphore, Acquire, TryAcquire, Permit.Release, Holders, Limit and
// SetLimit. How a permit is granted is in semaphore_admit.go, how the queue
// waits in semaphore_queue.go; the SQL is in the migrations.

// Bounds of semaphores.
const (
	// MaxSemaphoreLimit is the highest limit of a semaphore: a permit is
	// a slot key whose low 16 bits are its number, and the last one is
	// the queue. Each held permit costs an entry in the server's lock
	// table (max_locks_per_transaction × max_connections entries in all).
	MaxSemaphoreLimit = 1<<16 - 1
	// MaxSemaphoreName bounds the length in bytes of a semaphore's name
	// and of a holder's identity.
	MaxSemaphoreName = 1024
)

// semaphoreRecheck is how often the head of a semaphore's queue looks
// again for a permit when no notification came: it bounds how long a
// permit freed by the death of its holder's backend stays unused.
const semaphoreRecheck = 250 * time.Millisecond

// queueSlot is the low 16 bits of a semaphore's queue key.
const queueSlot = 1<<16 - 1

// SemaphoreOption configures a [Semaphore].
type SemaphoreOption interface {
	applySemaphore(*Semaphore) error
}

// A Semaphore hands out at most a limit of permits at once, across every
// process that uses the same name on the same database and schema. Its
// methods are safe for concurrent use.
//
// A semaphore lets at most limit holders, in any processes, hold a permit
// at once. Its limit lives in the table semaphores and its holders in
// semaphore_holders (see [Migrate]), where SQL can read and change them.
//
// # Model
//
// A permit is a session-level advisory lock on a slot key, held on
// one of the Client's shared backends like any lock of the Client. All the
// advisory locks of a semaphore share the upper 48 bits of its key
// K = HashKey("pgcoord.semaphore", schema, name), with the schema of the
// Client's tables (WithSchema), so that semaphores of one name in two
// schemas of a database are independent: slot s, for s in [0, limit), is
// the bigint key (K >> 16 << 16) | s, and the key with the low 16 bits all
// set is its queue. The locks are the truth: a permit is held exactly while
// its slot key is granted in pg_locks, so the permit of a holder whose
// backend ended (terminated, crashed process, lost network) is free as soon
// as the server has ended that backend, whatever its row says. Rows are a
// description for people and [Semaphore.Holders]: written in the same
// transaction that takes the slot, deleted by the release (or, when the
// slot passes straight to the next holder, written over by that holder's
// grant), and ignored (and later removed) once their lock is gone. A
// release whose slot passes to something that writes no row (a slot key
// taken by hand, a grant that gives the slot back under a lowered limit)
// leaves its row until the slot's next grant or the end of its backend;
// like any row whose backend does not hold its slot, Holders ignores it.
//
// Granting a permit is one statement, the function semaphore_acquire: it
// locks the semaphore's row (which serialises grants and limit changes),
// counts the slots granted in pg_locks, and, if fewer than the limit are
// held, writes the holder's row and takes a free slot below the limit, as
// its last step. Hence never more than limit permits are granted, also
// while holders die (a dead holder's slot is no longer granted) and while
// the limit changes. Lowering the limit takes no permit away: holders keep
// their permits, and no new permit is granted until fewer than the new
// limit are held. Raising it wakes the waiters at once (a trigger
// notifies them). The limit in the table wins: the limit given to
// [Client.Semaphore] only creates the row when the semaphore is first
// used; a process that passes another limit gets the table's.
//
// # Fairness
//
// An Acquire that finds no permit lines up on the semaphore's
// queue key with an ordinary blocking [Client.Lock]: PostgreSQL's lock
// queue orders the waiters of all processes, and goroutines of one Client
// queue in the process behind a single server wait. Only the holder of
// the queue key, the head, may take a permit while anyone is queued: other
// acquires, TryAcquire included, see the queue in pg_locks and step behind
// it. The grant to the head releases the queue key in the same statement,
// so the next in line heads the queue at once. A steady stream of
// acquirers cannot starve a waiter. (As for every blocking lock, a server
// wait is cut into slices of the lease, and a waiter rejoins PostgreSQL's
// queue at the end of each slice; see the package documentation. A head
// whose grant fails after it released the queue key, such as one whose
// wait for the one slot of a semaphore of limit 1 ends because its
// Client's listener reconnected just as the slot passed to it, lines up
// again behind the others.)
//
// # Wake-up
//
// The head listens on the Client's listener connection: a release
// and a change of the limit send a NOTIFY, upon which the head tries again
// (one statement). A permit freed by a backend's death sends nothing, so
// the head also tries again every 250 ms: a waiter gets such a permit
// within 250 ms plus a round trip of the server ending the backend. There
// is no other polling.
//
// A semaphore of limit 1 has one slot, so its head can wait for it on the
// server, as a lock waiter waits for its key: the head's backend waits for
// slot 0 and, once the release grants it, takes the permit in the same
// statement (semaphore_await, see [Migrate]), so the permit passes with no
// notification and no further round trip. The head waits so while the
// backend that holds its queue key holds nothing else and the Client has a
// wait to spare (WithMaxWaits); the wait counts as one of them. Otherwise,
// and for larger limits, whose head cannot know which slot frees first,
// the head is woken by notification. A change of the limit ends the
// head's wait on the server, and it looks again.
//
// # Connections and round trips
//
// Per Client:
//   - TryAcquire, and Acquire when a permit is free and nobody waits: one
//     statement (one round trip) on a shared backend; no new connection
//     once the shared backends are open. The permit stays there: a
//     hundred permits of ten semaphores cost a hundred lock-table entries
//     and no connection beyond [WithSharedBackends].
//   - Acquire that waits: the statement above, then one try of the queue
//     key (a round trip) and, while another heads the queue, a wait on one
//     of the Client's bounded waits ([WithMaxWaits]); goroutines of one
//     Client behind it wait in the process, with no connection. The head
//     waits on the Client's one listener connection, opened the first
//     time a semaphore or election needs it, and, for a semaphore of limit
//     1, on the backend that holds its queue key (see Wake-up).
//     Each wake-up costs one statement, on the backend that holds the
//     queue key; the statement that grants the permit also releases the
//     queue key there, so the next waiter heads the queue at once.
//   - Release: one statement (unlock, delete the row, notify).
//   - Holders, Limit, SetLimit: one statement on the Client's pool.
//
// On the server each grant locks one row, reads pg_locks (whose cost grows
// with the number of locks the server holds) and commits one row, without
// waiting for the disk (a lost row loses nothing: the lock is the truth).
// A transaction that keeps the semaphore's row locked (an UPDATE of the
// limit left uncommitted) holds grants up. A grant never waits for the row
// on a backend that holds other goroutines' keys (the server's deadlock
// check would see that backend's keys and the row's holder as one cycle
// if the holder waited for one of them): it waits, at most a wait slice
// of the lease ((L-H)/2, 2 s by default), on a backend that holds nothing,
// counted as one of the Client's waits ([WithMaxWaits]). Then, or at once
// when no such backend is free, TryAcquire returns the server's lock
// timeout error and a waiting Acquire tries again from the queue.
//
// # Keys
//
// Two names whose keys agree in their upper 48 bits would share
// permits, as two names with one HashKey would share a lock: with n
// semaphores the chance is about n²/2⁴⁹, 2·10⁻⁷ for ten thousand.
type Semaphore struct {
	c        *Client
	name     string
	limit    int
	key      core.Key // semaphoreKey(schema, name)
	prefix   int64    // key >> 16: the upper 48 bits of every key of the semaphore
	identity string
	err      error // invalid name, limit or option: every method returns it

	acquireSQL, acquireNowaitSQL, awaitSQL, cleanupSQL, releaseSQL string
	cleanupLocksSQL, releaseLockSQL                                string // cleanupSQL and releaseSQL without the tables (see rowsFailed)
	payload                                                        string // notification payloads about this semaphore start with it
}

// Semaphore returns the semaphore called name, whose permits at most limit
// holders hold at once. It needs the tables that [Migrate] creates. It does
// not touch the network: the first acquire creates the semaphore's row with
// limit, and from then on the limit in the table wins (see
// [Semaphore.SetLimit]); a process that passes another limit uses the
// table's. Names are compared byte for byte, and sent only as bound
// parameters.
//
// Semaphore cannot fail: an invalid name (empty, longer than
// [MaxSemaphoreName] bytes, not UTF-8 or containing NUL), a limit outside 1
// to [MaxSemaphoreLimit], or an invalid option makes every method of the
// returned Semaphore return an error that says so.
//
// A permit lives on the Client's shared backends, as a lock does: it ends
// when released, when the Client closes, or when its backend is lost, and
// then frees its slot at once on the server.
func (c *Client) Semaphore(name string, limit int, opts ...SemaphoreOption) *Semaphore {
	s := &Semaphore{c: c, name: name, limit: limit}
	s.err = s.init(opts)
	return s
}

func (s *Semaphore) init(opts []SemaphoreOption) error {
	if err := checkText("name", s.name, MaxSemaphoreName); err != nil {
		return err
	}
	if s.limit < 1 || s.limit > MaxSemaphoreLimit {
		return core.Errorf("limit %d is out of range: it must be 1 to %d (how many holders may hold a permit at once)", s.limit, MaxSemaphoreLimit)
	}
	s.identity = defaultIdentity(s.c.core.Cfg.AppName)
	for _, o := range opts {
		if o == nil {
			return core.Errorf("nil SemaphoreOption")
		}
		if err := o.applySemaphore(s); err != nil {
			return err
		}
	}
	s.key = semaphoreKey(s.c.core.Cfg.Schema, s.name)
	s.prefix = s.key.V >> 16
	s.payload = strconv.FormatInt(s.key.V, 10) + ":"
	cfg := s.c.core.Cfg
	s.acquireSQL = "SELECT slot, sem_limit, holders, queued FROM " + cfg.Table("semaphore_acquire") + "($1, $2, $3, $4, $5, $6, $7)"
	// The same, but it first locks the semaphore's row with NOWAIT, and
	// fails at once with SQLSTATE 55P03 when a transaction holds it: the
	// grant never joins the row's queue of waiters (see admitOn). The
	// function's own FOR UPDATE then finds the row locked by its own
	// transaction. The probe's count is an argument of the call, so that
	// the probe runs first.
	s.acquireNowaitSQL = `SELECT a.slot, a.sem_limit, a.holders, a.queued
		FROM (SELECT count(*) AS n FROM (SELECT FROM ` + cfg.Table("semaphores") + ` AS r
			WHERE r.name = $1 FOR UPDATE NOWAIT) AS r) AS probe,
		LATERAL ` + cfg.Table("semaphore_acquire") + `($1, $2, $3, $4, $5, CASE WHEN probe.n >= 0 THEN $6 END, $7) AS a`
	s.awaitSQL = "SELECT slot, sem_limit, holders FROM " + cfg.Table("semaphore_await") + "($1, $2, $3, $4, $5)"
	s.cleanupSQL = `WITH mine AS MATERIALIZED (
			SELECT l.k FROM (SELECT (classid::bigint << 32) | objid::bigint AS k
				FROM pg_catalog.pg_locks
				WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND pid = pg_catalog.pg_backend_pid()
				  AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())) l
			WHERE l.k >> 16 = $1
		), gone AS (
			DELETE FROM ` + cfg.Table("semaphore_holders") + ` h
			WHERE h.name = $3 AND h.lock_key <> ALL ($2::int8[])
			  AND (h.pid = pg_catalog.pg_backend_pid() OR h.lock_key IN (SELECT m.k FROM mine m))
			RETURNING 1
		)
		SELECT count(pg_catalog.pg_advisory_unlock(m.k)) FILTER (WHERE m.k & 65535 <> 65535 AND m.k <> ALL ($2::int8[])),
			coalesce(bool_or(m.k & 65535 = 65535), false)
		FROM mine m WHERE pg_catalog.pg_backend_pid() = $4 AND (SELECT count(*) FROM gone) >= 0`
	// (The main query reads gone before any unlock, so the rows of the
	// slots it frees go while this backend still holds them: a row of
	// another pid deleted here cannot be a new holder's. A data-modifying
	// CTE that the main query does not read would run after it.)
	// cleanupSQL without the rows: for when semaphore_holders cannot be
	// had within the connection's lock_timeout (a session holds the
	// table, as VACUUM FULL or a migration's ALTER TABLE would, or the
	// rows) or cannot be written (a read-only database). The rows it
	// leaves are a description only: their backend no longer holds their
	// slots, so Holders ignores them and the next grant removes them.
	s.cleanupLocksSQL = `SELECT count(pg_catalog.pg_advisory_unlock(l.k)) FILTER (WHERE l.k & 65535 <> 65535 AND l.k <> ALL ($2::int8[])),
			coalesce(bool_or(l.k & 65535 = 65535), false)
		FROM (SELECT (classid::bigint << 32) | objid::bigint AS k
			FROM pg_catalog.pg_locks
			WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND pid = pg_catalog.pg_backend_pid()
			  AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())) l
		WHERE l.k >> 16 = $1 AND pg_catalog.pg_backend_pid() = $3`
	// releaseSQL without the row, for the same cases. A release that
	// failed either did nothing (the table was locked when it was parsed
	// or began, or the transaction is read-only) or holds its slot again,
	// taken back by its try, while it waited to delete the row (whose
	// lock a transaction holds); both roll back the row's deletion but
	// not the advisory lock's calls. Either way this unlock leaves the
	// slot not held by this backend: free, or already granted to the next
	// waiter.
	s.releaseLockSQL = `SELECT pg_catalog.pg_advisory_unlock($1), pg_catalog.pg_notify($2, $3) IS NOT NULL
		WHERE pg_catalog.pg_backend_pid() = $4`
	// The release unlocks the slot and tries it again at once. If the try
	// fails, the slot has passed on: a head that waited for it on the
	// server (Semaphore.await) or another acquire has it, and writes the
	// slot's row over this holder's in the transaction of its grant, so the
	// release writes nothing. If the try succeeds, no one took the slot: the
	// release deletes its row while it holds the slot again, undoes the try,
	// and notifies the waiters (a slot taken at once by another acquire
	// frees no permit, so that case notifies no one).
	s.releaseSQL = `WITH r AS MATERIALIZED (
			SELECT pg_catalog.pg_advisory_unlock($1) AS released, pg_catalog.pg_try_advisory_lock($1) AS free
			WHERE pg_catalog.pg_backend_pid() = $6
		), gone AS (
			DELETE FROM ` + cfg.Table("semaphore_holders") + ` WHERE name = $4 AND slot = $5 AND pid = $6 AND (SELECT free FROM r)
			RETURNING 1
		)
		SELECT r.released,
			CASE WHEN r.free THEN
				CASE WHEN (SELECT count(*) FROM gone) >= 0 THEN
					CASE WHEN pg_catalog.pg_advisory_unlock($1) THEN pg_catalog.pg_notify($2, $3) IS NOT NULL END
				END
			END,
			pg_catalog.set_config('synchronous_commit', 'off', true)
		FROM r`
	return nil
}

// Name returns the semaphore's name.
func (s *Semaphore) Name() string { return s.name }

// Key returns the semaphore's advisory lock key,
// HashKey("pgcoord.semaphore", schema, name) with the schema of the
// Client's tables (WithSchema). In pg_locks, its permits are the
// bigint keys that share the key's upper 48 bits, with the slot number in
// the low 16 bits; the key with those bits all set is the queue of
// waiters.
func (s *Semaphore) Key() Key { return keyOf(s.key) }

// semaphoreKey returns the key of the semaphore called name whose rows are
// in schema.
func semaphoreKey(schema, name string) core.Key {
	return core.HashKey("pgcoord.semaphore", schema, name)
}

func (s *Semaphore) slotKey(slot int) core.Key { return core.Int64Key(s.prefix<<16 | int64(slot)) }

func (s *Semaphore) queueKey() core.Key { return s.slotKey(queueSlot) }

// A Permit is one held permit of a [Semaphore]. It is released once, by
// Release; it ends early if its backend is lost or its Client closes,
// which Done and Err report. Its methods are safe for concurrent use.
type Permit struct {
	sem   *Semaphore
	l     *core.Lock
	slot  int
	since time.Time // when its acquire returned; set only for OnPermit
}

// Slot returns the permit's slot: a number below the limit at the time it
// was granted, unique among the semaphore's permits held at once.
func (p *Permit) Slot() int { return p.slot }

// Done returns a channel that is closed when the permit ends: by Release,
// by the Client's Close, or by the loss of the backend that holds it.
func (p *Permit) Done() <-chan struct{} { return p.l.Done() }

// Err returns nil while the permit is held. After Done is closed it
// returns an error wrapping [ErrLockLost] (and the cause) if the permit
// was lost, [ErrClosed] if the Client was closed, or [ErrNotHeld] if it
// was released.
func (p *Permit) Err() error { return p.l.Err() }

// Acquire blocks until it holds a permit of the semaphore, and returns it.
// ctx bounds only the wait: once Acquire returns, the permit is held until
// Release or loss, whatever happens to ctx. Acquirers are served in the
// order they line up (see [Client.Semaphore]); an Acquire that must wait
// uses one of the Client's bounded waits ([WithMaxWaits]) until it heads
// the queue, and no connection after that.
//
// While the server cannot be reached or refuses (a restart, a failover
// whose standby is not promoted yet, no connection slot free), Acquire
// keeps trying, with backoff, until ctx ends, and lines up again if its
// place in the queue was lost with its connection. TryAcquire fails at
// once instead.
//
// If Acquire returns an error it holds nothing: no permit, row or queue
// place stays behind. Errors: ctx's error (or cause) if it ended first,
// joined with the last connection error if there was one,
// [ErrClosed], an error wrapping [ErrNotMigrated] if the tables are
// missing, the error of an invalid name, limit or option (see
// [Client.Semaphore]), or the server's or connection's error.
func (s *Semaphore) Acquire(ctx context.Context) (*Permit, error) {
	return s.acquire(ctx, false)
}

// TryAcquire takes a permit if one is free and nobody waits for one,
// without waiting. It returns an error wrapping [ErrNoPermit], saying how
// many permits are held, when every permit is held or other acquires are
// queued (they come first, even if a permit was just released). ctx bounds
// the one statement it runs. Other errors are as for Acquire; after an
// error nothing is held.
func (s *Semaphore) TryAcquire(ctx context.Context) (*Permit, error) {
	return s.acquire(ctx, true)
}

// Release gives the permit back: when Release returns nil its slot is
// free on the server, or already granted to the next waiter, and otherwise
// the next waiter is notified. It works even if ctx
// is already cancelled: the release is sent with a context that keeps
// ctx's values, bounded by the backend's lease.
//
// A release whose statement cannot delete the permit's row (another
// session holds semaphore_holders or the row for longer than a wait
// slice, as VACUUM FULL or a migration's ALTER TABLE would; the database
// is read-only) frees the slot without it and logs a warning; the row,
// whose backend no longer holds its slot, is ignored by Holders and
// removed by the next grant.
//
// It returns an error wrapping [ErrNotHeld] if the permit was already
// released or is being released by another call, an error wrapping
// [ErrLockLost] or [ErrClosed] if it had ended otherwise, and an error
// wrapping [ErrLockLost] if the release itself failed; the backend's
// connection has then been closed, so the server frees the slot as soon
// as it notices.
func (p *Permit) Release(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	l, s := p.l, p.sem
	l.Mu.Lock()
	if l.Cause != nil || l.Releasing {
		err := l.Cause
		l.Mu.Unlock()
		if err == nil {
			err = fmt.Errorf("%w: another Release is releasing it", ErrNotHeld)
		}
		return s.fail(ctx, "release", err)
	}
	l.Releasing = true
	l.Mu.Unlock()

	b, k := l.S, l.KeyList[0]
	if !b.StartRelease(l, k) {
		// The backend ended meanwhile and is ending the permit.
		<-l.Done()
		return s.fail(ctx, "release", l.Err())
	}
	err := b.Run(context.WithoutCancel(ctx), func(ctx context.Context, conn *pgx.Conn) error {
		var ok bool
		err := conn.QueryRow(ctx, s.releaseSQL, k.V, semaphoreChannel, s.payload+"release", s.name, int32(p.slot), b.Pid).
			Scan(&ok, nil, nil)
		if rowsFailed(err, conn) {
			// The statement failed on the permit's row: semaphore_holders
			// or the row is held by another session for longer than the
			// connection's lock_timeout, or the database does not take
			// writes (default_transaction_read_only). Release the slot
			// without deleting the row, instead of losing the backend and
			// every other goroutine's lock on it.
			cause := err
			if err = conn.QueryRow(ctx, s.releaseLockSQL, k.V, semaphoreChannel, s.payload+"release", b.Pid).Scan(nil, nil); err == nil {
				ok = true // the slot is not held by this backend now
				s.c.core.Cfg.WarnLogger().Warn("pgcoord: semaphore: released a permit without deleting its row",
					"semaphore", s.name, "slot", p.slot, "pid", b.Pid, "err", cause)
			}
		}
		if err = b.WrongBackend(err); err == nil && !ok {
			err = fmt.Errorf("%w: the server did not hold %s for backend %d", ErrNotHeld, k, b.Pid)
		}
		return err
	})
	b.ForgetKeys([]core.Key{k})
	why := ErrNotHeld
	if err != nil {
		b.Lose(err)
		if e := b.Err(); e != nil {
			err = e
		}
		if core.ErrorIsLoss(err) {
			why = err // the permit was lost, not released: Err says so
		}
	}
	l.End(why)
	kind, evErr := PermitReleased, err
	if errors.Is(why, ErrLockLost) {
		kind, evErr = PermitLost, why
	}
	s.c.events.permitEnded(l, kind, evErr)
	if err != nil {
		return s.fail(ctx, "release", err)
	}
	return nil
}

// A Holder is one live holder of a semaphore's permit.
type Holder struct {
	Slot     int       // the permit's slot
	Identity string    // who holds it (see WithIdentity); "" if its row is missing
	Since    time.Time // when it was granted; zero if its row is missing
	PID      int32     // server backend that holds it; pg_terminate_backend(PID) frees it, with every other lock of that backend
}

// Holders returns the live holders of the semaphore's permits, oldest
// first: those whose slot is granted in pg_locks. A holder whose backend
// has ended is not listed, even if its row is still in the table. ctx
// bounds the query, which runs on the Client's pool. Errors: [ErrClosed],
// an error wrapping [ErrNotMigrated] if the tables are missing, the error
// of an invalid name, limit or option, or the server's error.
func (s *Semaphore) Holders(ctx context.Context) ([]Holder, error) {
	if ctx == nil {
		return nil, core.Errorf("holders semaphore %s: ctx is nil", core.QuoteName(s.name))
	}
	if s.err != nil {
		return nil, s.fail(ctx, "holders", s.err)
	}
	if err := s.c.core.Enter(); err != nil {
		return nil, s.fail(ctx, "holders", err)
	}
	defer s.c.core.Wg.Done()
	var hs []Holder
	err := s.c.core.OnPool(ctx, func(b *pgx.Batch) {
		b.Queue(`SELECT (l.k & 65535)::int4, l.pid, coalesce(h.identity, ''), h.since
			FROM (SELECT pid, (classid::bigint << 32) | objid::bigint AS k
				FROM pg_catalog.pg_locks
				WHERE locktype = 'advisory' AND objsubid = 1 AND granted
				  AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())) l
			LEFT JOIN `+s.c.core.Cfg.Table("semaphore_holders")+` h ON h.name = $1 AND h.slot = (l.k & 65535)::int4 AND h.pid = l.pid
			WHERE l.k >> 16 = $2 AND l.k & 65535 <> 65535
			ORDER BY h.since NULLS LAST, 1`, s.name, s.prefix).Query(func(rows pgx.Rows) error {
			var err error
			hs, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (Holder, error) {
				var h Holder
				var slot int32
				var since *time.Time
				err := row.Scan(&slot, &h.PID, &h.Identity, &since)
				h.Slot = int(slot)
				if since != nil {
					h.Since = *since
				}
				return h, err
			})
			return err
		})
	})
	if err != nil {
		return nil, s.fail(ctx, "holders", s.c.notMigratedSemaphore(err))
	}
	return hs, nil
}

// Limit returns the semaphore's limit as the table has it, or, before the
// semaphore was first used, the limit given to [Client.Semaphore], with
// which the first acquire will create it. ctx bounds the query, which runs
// on the Client's pool. Errors are as for Holders.
func (s *Semaphore) Limit(ctx context.Context) (int, error) {
	if ctx == nil {
		return 0, core.Errorf("limit semaphore %s: ctx is nil", core.QuoteName(s.name))
	}
	if s.err != nil {
		return 0, s.fail(ctx, "limit", s.err)
	}
	if err := s.c.core.Enter(); err != nil {
		return 0, s.fail(ctx, "limit", err)
	}
	defer s.c.core.Wg.Done()
	var limit int32
	err := s.c.core.OnPool(ctx, func(b *pgx.Batch) {
		b.Queue(`SELECT "limit" FROM `+s.c.core.Cfg.Table("semaphores")+` WHERE name = $1`, s.name).QueryRow(func(row pgx.Row) error {
			return row.Scan(&limit)
		})
	})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return s.limit, nil
	case err != nil:
		return 0, s.fail(ctx, "limit", s.c.notMigratedSemaphore(err))
	}
	return int(limit), nil
}

// SetLimit changes the semaphore's limit to n, for every process, creating
// the semaphore if it does not exist yet. Raising it wakes the waiters,
// which take the new permits at once. Lowering it takes no permit away:
// holders beyond the new limit keep their permits until they release
// them, and no new permit is granted until fewer than n are held. The
// same works with SQL: UPDATE semaphores SET "limit" = n WHERE name = ...
// ctx bounds the statement, which runs on the Client's pool and waits for
// a grant in progress to commit. Errors: n outside 1 to
// [MaxSemaphoreLimit], and as for Holders.
func (s *Semaphore) SetLimit(ctx context.Context, n int) error {
	if ctx == nil {
		return core.Errorf("set limit semaphore %s: ctx is nil", core.QuoteName(s.name))
	}
	if s.err != nil {
		return s.fail(ctx, "set limit", s.err)
	}
	if n < 1 || n > MaxSemaphoreLimit {
		return s.fail(ctx, "set limit", core.Errorf("limit %d is out of range: it must be 1 to %d", n, MaxSemaphoreLimit))
	}
	if err := s.c.core.Enter(); err != nil {
		return s.fail(ctx, "set limit", err)
	}
	defer s.c.core.Wg.Done()
	t := s.c.core.Cfg.Table("semaphores")
	err := s.c.core.OnPool(ctx, func(b *pgx.Batch) {
		b.Queue(`INSERT INTO `+t+` AS s (name, "limit", lock_key) VALUES ($1, $2, $3)
			ON CONFLICT (name) DO UPDATE SET "limit" = excluded."limit", updated_at = now()
			WHERE s."limit" <> excluded."limit"`, s.name, int32(n), s.key.V)
	})
	if err != nil {
		return s.fail(ctx, "set limit", s.c.notMigratedSemaphore(err))
	}
	return nil
}

// fail describes an error of the semaphore, with the cause of ctx's end
// (ErrClosed when the Client closed) in front.
func (s *Semaphore) fail(ctx context.Context, op string, err error) error {
	if cause := core.CtxCause(ctx); cause != nil {
		err = core.CtxEnded(cause, err)
	}
	return core.Errorf("%s semaphore %s: %w", op, core.QuoteName(s.name), err)
}

// notMigratedSemaphore wraps ErrNotMigrated around the server's error when
// the semaphores' tables, function or schema are missing (SQLSTATE 42P01,
// 42883 or 3F000).
func (c *Client) notMigratedSemaphore(err error) error {
	switch core.SqlState(err) {
	case "42P01", "42883", "3F000":
		return fmt.Errorf("%w (schema %s has no semaphores): %w", ErrNotMigrated, c.core.Cfg.QuotedSchema(), err)
	}
	return err
}

// rowsFailed reports whether a statement of a semaphore that writes its
// rows failed as a statement, on a connection that goes on: an error of
// the server other than a cancel or a shutdown (class 57) or a connection
// failure (class 08). Such a statement left the advisory locks it had not
// reached as they were, and rolled back its row changes; the locks can be
// put right by a statement that does not touch the tables.
func rowsFailed(err error, conn *pgx.Conn) bool {
	st := core.SqlState(err)
	return st != "" && !strings.HasPrefix(st, "57") && !strings.HasPrefix(st, "08") && !conn.IsClosed()
}

// lockTimedOut reports whether a statement gave up waiting for a lock
// (SQLSTATE 55P03): the semaphore's row was locked for longer than a wait
// slice, by a transaction that changes it.
func lockTimedOut(err error) bool { return core.SqlState(err) == "55P03" }
