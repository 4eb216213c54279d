package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
)

// Winning and leading
//
// A candidate that wins the election's lock becomes the leader in steps:
// it issues the term (the election key's next fence) and records itself in
// the leaders row (Election.record), waits for the predecessor to be gone
// (the guard, or the wait the row asks for), proves on the lock's backend
// that it still holds the lock, and only then starts. While it
// leads, Leadership.watch ends the term on a loss of either connection, a
// resign request, or ctx, and Leadership.end cancels the leader's context
// before it frees anything, so the next leader never overlaps it.

// The handover from one leader to the next. A new leader starts only once
// its predecessor's context has been cancelled, by the predecessor's own
// clock. The guard proves it while the predecessor holds it: a predecessor
// that lives frees its guard only after cancelling its context. Where the
// guard proves nothing, the leaders row tells the new leader to wait out
// the predecessor's loss deadline L after winning (the predecessor's
// context is cancelled at most L after the lock was lost, which was before
// the win; the row carries the longest L of the leaders since the last
// clean end, the new leader's own included, and the wait is that long):
//   - guarded = false: the predecessor led without the guard, because its
//     own predecessor did not free it within L (a paused process); it
//     keeps trying to take the guard, and sets guarded back once it has;
//   - server_start differs from the server's pg_postmaster_start_time(): a
//     restart or a failover ended the predecessor's term, and with it both
//     of its backends, so its guard was freed with its lock whether or not
//     its process lives.
//
// The wait is recorded as not_before in the new leader's row, as it wins:
// should it give up before it starts (its campaign's ctx ends, its lock is
// lost, its Client closes), the next winner, which finds a row that says
// nothing else to fear, still waits until then. ended = true, which a
// leader sets when it ends its term itself, after its context was
// cancelled, removes the wait. A predecessor whose lock and guard
// connections are both lost less than 2H apart (it notices a loss only at
// its next heartbeat), or that loses them in a crash-restart of the server
// (which keeps the postmaster and its start time), cannot be told from a
// killed process: its successor starts at once, and the predecessor's
// context is cancelled within 2H of its first loss (at most L); its writes
// are stale by then, and CheckFence rejects them.

// errAskedWhileWaiting means that term was asked to resign while its
// leader waited out its predecessor's loss deadline, before it began; the
// campaign yields to another candidate, then goes on.
type errAskedWhileWaiting struct{ term Term }

// errLostWhileWinning means the lock was lost before the leadership
// began; the campaign goes on.
var errLostWhileWinning = errors.New("pgcoord: leadership lock lost while winning")

// wait takes the election's lock, in rounds.
func (e *Election) wait(ctx context.Context) (*core.Lock, error) {
	var last error // the last round's error that says the server could not be used
	for {
		round, cancel := context.WithTimeout(ctx, e.campaignRound())
		l, err := e.c.core.Lock(round, e.key, core.WithPrepared(e.recordStatement()), core.WithoutHooks())
		// The round ended if its deadline passed: by round.Err(), read
		// before cancel (which ends it too), or by the clock a moment
		// before round.Err() reports it.
		ended := round.Err() != nil || errors.Is(err, context.DeadlineExceeded)
		cancel()
		if err != nil && (core.ConnectionTrouble(err) || errors.Is(err, ErrReadOnly) || errors.Is(err, ErrTooManyConnections)) {
			last = err
		}
		switch {
		case err == nil:
			return l, nil
		case ctx.Err() != nil && last != nil:
			return nil, core.WithLastConnErr(context.Cause(ctx), last)
		case ctx.Err() != nil:
			return nil, context.Cause(ctx)
		case ended && !errors.Is(err, ErrClosed):
			continue // the round ended: wait again
		default:
			return nil, err
		}
	}
}

// lead turns a held election lock, won at won, into a leadership: guard,
// row, notice, and the wait for a predecessor that may still live without
// a guard to show it (see handover).
func (e *Election) lead(ctx context.Context, l *core.Lock, won time.Time, sub *subscription) (*Leadership, error) {
	c := e.c
	fail := func(g *core.Lock, err error) (*Leadership, error) {
		rctx, cancel := core.WithoutCancel(ctx, c.core.Cfg.LossDeadline)
		defer cancel()
		if g != nil {
			_ = g.Unlock(rctx)
		}
		_ = l.Unlock(rctx)
		return nil, err
	}
	// Take the guard, and meanwhile issue the term and record the leader
	// on the lock's backend: fn starts only once both are done.
	var g *core.Lock
	var gerr error
	guarded := make(chan struct{})
	go func() {
		defer close(guarded)
		g, gerr = e.takeGuard(ctx, l.Done())
	}()
	term, since, wait, loss, err := e.record(ctx, l)
	until := time.Now().Add(wait) // the server's now() was a little earlier
	<-guarded
	switch {
	case gerr != nil && l.Err() != nil:
		// The server went away (a restart, a failover) while this
		// candidate won: the campaign goes on.
		return fail(g, errLostWhileWinning)
	case gerr != nil:
		return fail(g, gerr)
	}
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fail(g, core.Errorf("term %d is not newer than the recorded leader's: the fences table was reset or restored while the leaders table was not; delete the election's row in leaders to continue", term))
	case err != nil && l.Err() != nil:
		return fail(g, errLostWhileWinning)
	case err != nil:
		return fail(g, core.NotMigrated(c.core.Cfg, "record leader", err))
	}
	if g == nil {
		// The guard wait covered this Client's loss deadline since the
		// win; a predecessor's may be longer, and so is the wait.
		if u := won.Add(loss); u.After(until) {
			until = u
		}
		// Leading without the guard: say so in the row, on the lock's
		// backend, before fn starts, and how long this leader waits. A
		// successor that wins once this backend is gone reads it and
		// waits out this leader's lease, or the rest of that wait.
		set := fmt.Sprintf("guarded = false, not_before = GREATEST(l.not_before, l.since + %d * interval '1 millisecond')", loss.Milliseconds())
		if err := e.mark(ctx, l, term, set, ""); err != nil {
			if l.Err() != nil {
				return fail(g, errLostWhileWinning)
			}
			return fail(g, core.NotMigrated(c.core.Cfg, "record leading without the guard", err))
		}
	}
	if wait := time.Until(until); wait > 0 {
		// The predecessor may live on without knowing it lost: it led
		// without the guard, or a restart or failover ended its term. Its
		// context is cancelled at the latest its loss deadline after it
		// lost the lock, which was before this candidate won it.
		c.core.Cfg.WarnLogger().Warn("pgcoord: the previous leader may not know yet that it lost; waiting out its loss deadline before leading",
			"election", e.name, "wait", wait)
		// A request to resign this term, which Leader may already
		// report, is honoured during the wait: the candidate gives up,
		// leaving the wait it owed recorded in the row for the next one.
		requested := e.prefix + "resign:" + strconv.FormatInt(int64(term), 10)
		var guardDone <-chan struct{}
		if g != nil {
			guardDone = g.Done()
		}
		timer := time.NewTimer(wait)
		defer timer.Stop()
		for waiting := true; waiting; {
			select {
			case <-timer.C:
				waiting = false
			case <-l.Done():
				waiting = false
			case <-guardDone:
				return fail(g, errLostWhileWinning)
			case <-ctx.Done():
				return fail(g, context.Cause(ctx))
			case <-sub.kick:
				for _, p := range sub.take() {
					if p == requested || p == "" && e.resignRecorded(l, term) {
						return fail(g, errAskedWhileWaiting{term})
					}
				}
			}
		}
		if e.resignRecorded(l, term) {
			return fail(g, errAskedWhileWaiting{term})
		}
	}
	if g != nil {
		// The guard may have come after the term was recorded, and the
		// lock may have been lost meanwhile without this Client knowing
		// yet: a successor could then have won the lock, taken the guard
		// first, led and freed the guard again, all before this candidate
		// got the guard. A round trip on the lock's backend, now that the
		// guard is held, proves that the backend still holds the lock, so
		// that no successor has won it since this candidate did; from here
		// on a successor also needs this guard.
		if err := l.S.Prove(ctx, "election "+strconv.Quote(e.name)); err != nil {
			if ctx.Err() != nil {
				return fail(g, context.Cause(ctx))
			}
			return fail(g, errLostWhileWinning)
		}
	}
	if l.Err() != nil || g != nil && g.Err() != nil {
		return fail(g, errLostWhileWinning)
	}
	ld := &Leadership{
		e: e, lock: l, guard: g, sub: sub, term: term, since: since,
		resign:  make(chan struct{}),
		done:    make(chan struct{}),
		stamped: make(chan struct{}),
	}
	ld.ctx, ld.cancel = context.WithCancelCause(context.WithValue(leaderParent{c.core.Closing, ctx}, leadershipKey{}, ld))
	c.events.leadership(LeadershipEvent{Election: e.name, Identity: e.identity, Term: term, Leading: true})
	c.core.Cfg.InfoLogger().Info("pgcoord: leading", "election", e.name, "identity", e.identity, "term", int64(term))
	c.core.Wg.Add(1)
	go ld.watch()
	return ld, nil
}

// recordSQL issues the election key's next fence as the new leader's term,
// durably (issueFenceSQL), records the leader in the leaders table, and
// notifies observers, all in one statement, run on the backend that holds
// the election's lock. Parameters: $1 and $2 the
// fence row (fenceRow), $3 the election's name, $4 its lock key, $5 the
// identity, $6 the pid of the backend that holds the election's lock, $7
// the notification channel, $8 the leader's loss deadline in milliseconds,
// $9 the lock_timeout of its waits for rows (see Session.block). It
// returns the term, the time the leadership began (no row if the leaders
// table holds a newer term), whether observers were not notified, how
// many milliseconds the new leader must wait before it starts, and the
// longest loss deadline among the leaders since the last clean end, its
// own included (see handover).
//
// On the backend that holds the election's lock, which may hold other
// goroutines' keys, the statement locks the fences row and the leaders row
// with NOWAIT before anything else: when a transaction holds either (it
// checked the previous term and is still open), the statement fails at
// once with SQLSTATE 55P03 and never joins the row's queue of waiters,
// where the transaction's deadlock check could find a cycle through that
// backend (see Client.blockAway). recordAwaySQL then waits for the rows
// elsewhere.
func recordSQL(c *core.Config) string { return recordSQLFor(c, false) }

// recordAwaySQL is recordSQL run on a backend of the Client's that holds
// nothing, while the election's lock is held on another ($6): it waits for
// the rows, and records the term only if that backend still holds the
// election's lock when it starts (pg_locks); otherwise it returns no row.
func recordAwaySQL(c *core.Config) string { return recordSQLFor(c, true) }

func recordSQLFor(c *core.Config, away bool) string {
	holder, lockRows, probe := 0, "", ""
	if away {
		holder = 6
	} else {
		lockRows = `lk AS (SELECT count(*) AS n FROM (SELECT FROM ` + c.Table("leaders") + ` AS r
				WHERE r.name = $3 FOR UPDATE NOWAIT) AS r),
		`
		probe = " CROSS JOIN lk"
	}
	// h is the predecessor's row, as it was before this statement: what
	// the new term must exceed, the longest loss deadline to carry on,
	// and until when the new leader must wait (NULL: not at all).
	return `WITH ` + lockRows + `h AS (SELECT p.term AS floor,
				CASE WHEN p.ended IS DISTINCT FROM false THEN $8::int8 ELSE GREATEST(p.loss_deadline_ms, $8::int8) END AS loss,
				CASE WHEN NOT p.ended THEN GREATEST(p.not_before,
					CASE WHEN NOT p.guarded OR p.server_start <> pg_catalog.pg_postmaster_start_time()
						THEN now() + GREATEST(p.loss_deadline_ms, $8::int8) * interval '1 millisecond' END) END AS not_before
			FROM (SELECT) AS one` + probe + ` LEFT JOIN ` + c.Table("leaders") + ` AS p ON p.name = $3),
		fence AS (` + core.IssueFenceSQL(c, 9, holder, "h", !away) + `),
		won AS (
			INSERT INTO ` + c.Table("leaders") + ` AS l (name, lock_key, identity, term, since, pid, guarded, server_start, ended, loss_deadline_ms, not_before)
			SELECT $3, $4, $5, fence.fence, now(), $6, true, pg_catalog.pg_postmaster_start_time(), false, h.loss, h.not_before FROM fence, h
			ON CONFLICT (name) DO UPDATE SET lock_key = EXCLUDED.lock_key, identity = EXCLUDED.identity,
				term = EXCLUDED.term, since = EXCLUDED.since, pid = EXCLUDED.pid,
				guarded = true, server_start = EXCLUDED.server_start, ended = false,
				loss_deadline_ms = EXCLUDED.loss_deadline_ms, not_before = EXCLUDED.not_before
			WHERE l.term < EXCLUDED.term
			RETURNING term, since, not_before)
		SELECT fence.fence, won.since, CASE WHEN won.term IS NOT NULL THEN
			pg_notify($7, format('%s:lead:%s:%s:%s:%s', $4::bigint, won.term, $6::int,
				(extract(epoch FROM won.since) * 1000000)::bigint, $5::text)) END IS NULL,
			GREATEST(ceil(extract(epoch FROM won.not_before - now()) * 1000), 0)::int8,
			h.loss
		FROM fence CROSS JOIN h LEFT JOIN won ON true`
}

// recordArgs returns the arguments of recordSQL for a new leader whose
// election lock is held by backend pid.
func (e *Election) recordArgs(pid int32) []any {
	space, fkey := core.FenceRow(e.key)
	k, _ := e.key.Int64()
	return []any{space, fkey, e.name, k, e.identity, pid, leaderChannel, e.c.core.Cfg.LossDeadline.Milliseconds(), ""}
}

// recordStatement is recordSQL as the campaign's acquire prepares it on the
// backend it waits on: planned there too, with this candidate's arguments,
// so that a takeover's record does not begin with the backend reading the
// leaders and fences tables' metadata (about half of that statement's time
// on a connection's first run).
func (e *Election) recordStatement() core.PreparedStatement {
	return core.PreparedStatement{Sql: recordSQL(e.c.core.Cfg), Plan: e.recordArgs(0)}
}

// record runs recordSQL, which the campaign's acquire prepared, on the
// backend of l, the election's lock. It returns the term, when it began,
// how long from now the new leader must wait before it starts, and the
// longest loss deadline of the leaders since the last clean end (see
// handover). It returns pgx.ErrNoRows, with the fence issued, when the
// leaders table holds a newer term.
func (e *Election) record(ctx context.Context, l *core.Lock) (Term, time.Time, time.Duration, time.Duration, error) {
	c := e.c
	var term, waitMS, loss int64
	var since *time.Time
	// The statement waits for the fences row while a transaction that
	// checked the previous term is open: in slices, like a lock wait, so
	// that the backend's other locks keep proving themselves alive. It is
	// a token statement: a term whose commit a synchronous standby has not
	// confirmed is withheld, and the next slice records a greater one (see
	// Session.block); the row and the notice of a withheld term are
	// overwritten by it.
	//
	// On a backend of the Client's, which may hold other goroutines' keys,
	// it never waits for the rows: it runs there with NOWAIT and, if a
	// transaction holds a row, waits for it on a backend that holds
	// nothing (Client.blockAway).
	run := func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error {
		return conn.QueryRow(ctx, sql, args...).Scan(&term, &since, new(bool), &waitMS, &loss)
	}
	err := c.core.BlockAway(ctx, l.S, core.BlockingStatement{
		Sql:     recordSQL(c.core.Cfg),
		Args:    e.recordArgs(l.S.Pid),
		Locks:   2, // the fences row, then the leaders row
		Run:     run,
		Quick:   true,
		Durable: true,
	}, core.BlockingStatement{
		Sql:   recordAwaySQL(c.core.Cfg),
		Args:  e.recordArgs(l.S.Pid),
		Locks: 2,
		Run: func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error {
			err := run(ctx, conn, sql, args)
			if errors.Is(err, pgx.ErrNoRows) {
				err = core.Errorf("%w: backend %d no longer holds %s", ErrLockLost, l.S.Pid, e.key)
			}
			return err
		},
		Durable: true,
	})
	if err != nil {
		return Term(term), time.Time{}, 0, 0, err
	}
	if since == nil {
		return Term(term), time.Time{}, 0, 0, pgx.ErrNoRows
	}
	return Term(term), *since, time.Duration(waitMS) * time.Millisecond, time.Duration(loss) * time.Millisecond, nil
}

// mark sets columns of term's row in the leaders table (set is the SET
// clause) on the backend of l, the election's lock, which proves that
// backend held the lock when the change committed, and notifies notice to
// observers, unless it is empty. Like record, it waits for the row in
// slices. It returns an error if the row holds another term.
func (e *Election) mark(ctx context.Context, l *core.Lock, term Term, set, notice string) error {
	var n int64
	err := l.S.Block(ctx, core.BlockingStatement{
		Sql: `WITH t AS (SELECT pg_catalog.set_config('lock_timeout', $5, true)),
			u AS (UPDATE ` + e.c.core.Cfg.Table("leaders") + ` AS l SET ` + set + ` FROM t WHERE l.name = $1 AND l.term = $2 RETURNING 1)
			SELECT count(*), bool_or(CASE WHEN $4 <> '' THEN pg_catalog.pg_notify($3, $4) END IS NULL) FROM u`,
		Args: []any{e.name, int64(term), leaderChannel, notice, ""},
		Run: func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error {
			return conn.QueryRow(ctx, sql, args...).Scan(&n, new(*bool))
		},
		Quick: true,
	})
	if err == nil && n != 1 {
		err = core.Errorf("the leaders row of election %q no longer holds term %d", e.name, term)
	}
	return err
}

// takeGuard takes the election's guard on the Client's guard session,
// waiting at most the loss deadline for a previous leader that lives to
// free it. It returns a nil Lock, and no error, when that wait ran out,
// also when the guard session could not be opened meanwhile (the server
// cannot be reached, has no free connection slot, or is a standby): the
// new leader then leads without the guard, which the handover covers. It
// returns early, with errLostWhileWinning, when lockLost (the election
// lock's Done) closes.
//
// The wait runs on the server, so the guard is granted the moment it is
// freed (a killed leader's guard backend exits), but in short slices
// (guardSlice): the guard session serves every election of the Client, and
// its blocking statements run one at a time, so one election's wait for a
// guard that is slow to come must not hold up another's for longer than a
// slice. Slices that short also end before the server would look for a
// deadlock between two Clients that take over from each other at once.
func (e *Election) takeGuard(ctx context.Context, lockLost <-chan struct{}) (*core.Lock, error) {
	c := e.c
	deadline := time.Now().Add(c.core.Cfg.LossDeadline)
	retry := core.MinRetryInterval
	var err error
	for lost := false; ; {
		var s *core.Session
		var g *core.Lock
		s, err = c.guardSession(ctx)
		if err == nil {
			err = ErrLocked // not tried yet: the first slice returns at once if the guard is free
		}
		for errors.Is(err, ErrLocked) || errors.Is(err, ErrDeadlock) {
			left := time.Until(deadline)
			if left <= 0 {
				c.core.Cfg.WarnLogger().Warn("pgcoord: the previous leader did not free the election's guard within the loss deadline; leading without it",
					"election", e.name, "loss_deadline", c.core.Cfg.LossDeadline)
				return nil, nil
			}
			sctx, cancel := context.WithTimeout(ctx, min(guardSlice, left))
			g, err = s.Lock(sctx, e.guard, core.WithoutHooks())
			// The slice's deadline may have passed by the clock a moment
			// before sctx reports it.
			if err != nil && ctx.Err() == nil && (sctx.Err() != nil || errors.Is(err, context.DeadlineExceeded)) {
				err = ErrLocked // the slice ended: wait on
			}
			cancel()
		}
		switch {
		case err == nil:
			return g, nil
		case ctx.Err() != nil:
			return nil, core.Errorf("take guard: %w", context.Cause(ctx))
		case !core.ConnectionTrouble(err) || errors.Is(err, ErrClosed):
			return nil, core.Errorf("take guard: %w", err)
		}
		// The guard session was lost (a new one is opened at once, the
		// first time), or cannot be opened now: open another, at growing
		// intervals, within the guard's deadline.
		if core.ErrorIsLoss(err) && !lost {
			lost = true
			continue
		}
		left := time.Until(deadline)
		if left <= 0 {
			c.core.Cfg.WarnLogger().Warn("pgcoord: the election's guard could not be taken within the loss deadline; leading without it",
				"election", e.name, "loss_deadline", c.core.Cfg.LossDeadline, "error", err)
			return nil, nil
		}
		t := time.NewTimer(min(retry, left))
		select {
		case <-t.C:
		case <-lockLost:
			t.Stop()
			return nil, errLostWhileWinning
		case <-ctx.Done():
			t.Stop()
			return nil, core.Errorf("take guard: %w", context.Cause(ctx))
		}
		retry = min(2*retry, core.MaxRetryInterval)
	}
}

// guardSlice is how long one wait for a guard runs on the Client's guard
// session before it lets the next election's statement run.
const guardSlice = 20 * time.Millisecond

// guardSession returns the Client's guard session, opening it if needed.
func (c *Client) guardSession(ctx context.Context) (*core.Session, error) {
	c.guardMu.Lock()
	defer c.guardMu.Unlock()
	if c.guard != nil && c.guard.Err() == nil {
		return c.guard, nil
	}
	s, err := c.core.OpenSession(ctx)
	if err != nil {
		return nil, err
	}
	c.guard = s
	return s, nil
}

// guardLock returns the leadership's guard, nil while it leads without.
func (ld *Leadership) guardLock() *core.Lock {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	return ld.guard
}

// retakeGuard tries, once and without waiting, to take the guard that a
// leader that started without it lacks, and records in the leaders row
// that it holds it (see handover). It returns the guard, or nil.
func (ld *Leadership) retakeGuard() *core.Lock {
	e := ld.e
	ctx, cancel := context.WithTimeout(ld.ctx, e.c.core.Cfg.Heartbeat)
	defer cancel()
	s, err := e.c.guardSession(ctx)
	if err != nil {
		return nil
	}
	g, err := s.TryLock(ctx, e.guard, core.WithoutHooks())
	if err != nil {
		return nil
	}
	if err := e.mark(ctx, ld.lock, ld.term, "guarded = true", ""); err != nil {
		rctx, rcancel := core.WithoutCancel(ctx, e.c.core.Cfg.LossDeadline)
		_ = g.Unlock(rctx)
		rcancel()
		return nil
	}
	ld.mu.Lock()
	ld.guard = g
	ld.mu.Unlock()
	e.c.core.Cfg.InfoLogger().Info("pgcoord: leader took the election's guard", "election", e.name, "term", int64(ld.term))
	return g
}

// watch ends the leadership when something ends it.
func (ld *Leadership) watch() {
	c := ld.e.c
	defer c.core.Wg.Done()
	var guardDone <-chan struct{}
	guard := ld.guardLock()
	if guard != nil {
		guardDone = guard.Done()
	}
	requested := ld.e.prefix + "resign:" + strconv.FormatInt(int64(ld.term), 10)
	// A request to resign is notified and recorded in the leaders row:
	// read the row when notifications may have been lost (the listener
	// resynced, or is not listening), and every loss deadline in any case.
	tick := time.NewTicker(c.core.Cfg.Heartbeat)
	defer tick.Stop()
	read := time.Now()
	// A leader without the guard tries to take it every heartbeat, in a
	// goroutine of its own: the try runs on the guard session, which may
	// itself be slow to answer or to reconnect, and must not keep the
	// watch from seeing the end of the leadership.
	retaken := make(chan *core.Lock, 1)
	retaking := false
	var why error
	for why == nil {
		select {
		case now := <-tick.C:
			if guard == nil && !retaking {
				retaking = true
				go func() { retaken <- ld.retakeGuard() }()
			}
			if !c.listening.Load() || now.Sub(read) >= c.core.Cfg.LossDeadline {
				read = now
				if ld.resignRecorded() {
					why = errResignRequested
				}
			}
		case g := <-retaken:
			retaking = false
			if g != nil {
				guard, guardDone = g, g.Done()
			}
		case <-ld.lock.Done():
			why = core.Errorf("election lock: %w", ld.lock.Err())
		case <-guardDone:
			why = core.Errorf("election guard: %w", guard.Err())
		case <-ld.resign:
			why = errResigned
		case <-c.core.Closing.Done():
			why = ErrClosed
		case <-ld.sub.kick:
			resync := false
			for _, p := range ld.sub.take() {
				switch p {
				case requested:
					why = errResignRequested
				case "":
					resync = true
				}
			}
			if resync && why == nil {
				read = time.Now()
				if ld.resignRecorded() {
					why = errResignRequested
				}
			}
		}
	}
	ld.end(why, func() {
		// A try still in flight ends within a heartbeat (its ctx, a
		// child of the leader's, is cancelled now); a guard it took is
		// freed with the rest.
		if retaking {
			<-retaken
		}
	})
}

// end cancels the leader's context, then, once settle has returned, tells
// observers (after a resign) and frees the guard and the lock.
func (ld *Leadership) end(why error, settle func()) {
	ld.cancel(why)
	at := time.Now()
	if errors.Is(context.Cause(ld.ctx), ErrClosed) {
		// Close cancelled it as it began.
		c := ld.e.c
		c.core.Mu.Lock()
		at = c.core.ClosedAt
		c.core.Mu.Unlock()
	}
	ld.mu.Lock()
	ld.cancelled = at
	ld.mu.Unlock()
	close(ld.stamped)
	settle()
	ld.sub.close()
	ctx, cancel := core.WithoutCancel(context.Background(), ld.e.c.core.Cfg.LossDeadline)
	defer cancel()
	if errors.Is(why, ErrNotHeld) && ld.lock.Err() == nil {
		// The term ended here, its context cancelled: the successor need
		// not wait for it (see handover), and observers learn at once.
		_ = ld.e.mark(ctx, ld.lock, ld.term, "ended = true", ld.e.prefix+"end:"+strconv.FormatInt(int64(ld.term), 10))
	}
	if g := ld.guardLock(); g != nil {
		_ = g.Unlock(ctx)
	}
	_ = ld.lock.Unlock(ctx)
	ld.mu.Lock()
	ld.err = core.Errorf("lead election %q: term %d ended: %w", ld.e.name, ld.term, why)
	ld.mu.Unlock()
	c := ld.e.c
	ev := LeadershipEvent{Election: ld.e.name, Identity: ld.e.identity, Term: ld.term}
	if errors.Is(why, ErrLockLost) {
		ev.Err = ld.err
		c.core.Cfg.WarnLogger().Warn("pgcoord: leadership lost", "election", ld.e.name, "identity", ld.e.identity, "term", int64(ld.term), "error", why)
	} else {
		c.core.Cfg.InfoLogger().Info("pgcoord: leadership ended", "election", ld.e.name, "term", int64(ld.term), "why", why)
	}
	c.events.leadership(ev)
	close(ld.done)
}

func (errAskedWhileWaiting) Error() string { return "pgcoord: asked to resign before leading" }
