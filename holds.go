package pgcoord

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// What a backend holds
//
// A Session counts, per key, the live handles that hold the key on its
// backend (keyHold). Only the first handle of a key sends a lock statement
// and only the last one an unlock, so the server's count for the key on the
// backend is 0 or 1. Every decision about a key (join the hold, or send a
// statement) is made and recorded under the session's state mutex, and a
// key whose statement is in flight is marked busy until the statement and
// its bookkeeping are done; anyone else interested in that key on that
// backend waits for it. Hence an error path always knows what its own
// statement may have taken: the keys it marked busy, and nothing else.

// take acquires r's keys on s and returns the new handle. On error, nothing
// this call took stays held; the in-process gates stay the caller's.
func (s *Session) take(ctx context.Context, r request) (*Lock, error) {
	need, err := s.reserve(ctx, r)
	if err != nil {
		return nil, err
	}
	got, err := s.lockKeys(ctx, need, r)
	if err != nil || !got {
		// A failed try of one key took nothing; anything else may have
		// taken some keys before it failed.
		s.undo(ctx, r, need, err == nil && len(need) == 1)
		if e := s.Err(); e != nil && err != nil {
			err = e // the session ended: that is why the acquire failed
		}
		if err == nil {
			return nil, ErrLocked
		}
		if !errorIsLoss(err) && !errors.Is(err, errRoute) {
			// The statement's error, not the backend's: a deadlock or a
			// cancel ended this acquire, and the backend's other locks
			// live.
			err = pgError("acquire", err)
		}
		return nil, err
	}
	l := newLock(s, r)
	if err := s.settle(need, l); err != nil {
		return nil, err
	}
	if r.fence {
		err := s.issueFence(ctx, l)
		if e := l.Err(); e != nil {
			err = e // lost while its fence was issued
		}
		if err != nil {
			s.drop(l)
			return nil, err
		}
	}
	return l, nil
}

// reserve records, for each of r's keys, that one more handle is about to
// hold it here. Keys the backend already holds (shared) are joined with no
// round trip; the others are returned, marked busy, for the caller to take
// on the server. A key whose statement is in flight is waited for first.
//
// On a backend of the Client's, reserve enforces the routing rule (see
// backends.go): it returns errRoute, reserving nothing, when the backend
// waits for another acquire and r would send a statement, or when a shared
// acquire would join a hold that takes no more joiners.
func (s *Session) reserve(ctx context.Context, r request) ([]Key, error) {
	for {
		s.state.Lock()
		if s.err != nil {
			s.state.Unlock()
			return nil, s.err
		}
		var busy chan struct{}
		for _, k := range r.keys {
			if h := s.keys[k]; h != nil && h.busy != nil {
				busy = h.busy
				break
			}
		}
		if busy == nil {
			need, err := s.needs(r)
			if err != nil {
				s.state.Unlock()
				return nil, err
			}
			for _, k := range r.keys {
				if h := s.keys[k]; h != nil {
					h.n++
					h.joins++
					continue
				}
				s.keys[k] = &keyHold{shared: r.shared, busy: make(chan struct{})}
			}
			s.state.Unlock()
			return need, nil
		}
		s.state.Unlock()
		select {
		case <-busy:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		case <-s.done:
			return nil, s.Err()
		}
	}
}

// needs returns the keys of r that the backend does not hold, checking
// that r may join the others and send a statement here. The caller holds
// s.state.
func (s *Session) needs(r request) ([]Key, error) {
	var need []Key
	for _, k := range r.keys {
		h := s.keys[k]
		switch {
		case h == nil:
			need = append(need, k)
		case !r.shared || !h.shared:
			return nil, errorf("%s is already held on this backend in another mode", k)
		case s.managed && !s.c.joinable(h):
			return nil, errRoute
		}
	}
	if len(need) > 0 && s.waiting && !r.waiting {
		return nil, errRoute
	}
	return need, nil
}

// lockKeys takes the reserved keys on the server, in order, chunk by chunk.
// It reports false if a try found a key held elsewhere.
func (s *Session) lockKeys(ctx context.Context, need []Key, r request) (bool, error) {
	for _, chunk := range chunked(need) {
		if !r.try {
			if r.direct && len(need) == 1 {
				// A key contended a moment ago: one statement tries it
				// and, if it is held, waits for it, and says which (the
				// Client does not report contention, see
				// watchesContention).
				waited, err := s.tryThenWait(ctx, chunk[0], r.shared)
				if err != nil {
					return false, err
				}
				if waited {
					s.c.contention.note(chunk[0])
				}
				continue
			}
			// One free key is taken with a plain try, which needs no
			// lock_timeout for the statement; a try takes nothing when
			// it fails, so the wait after it starts from nothing.
			if len(need) == 1 && !r.tried {
				got, err := s.tryKeys(ctx, chunk, r.shared)
				if err != nil || got {
					return got, err
				}
				if s.c.observed() {
					s.c.contended(r, false)
				}
			}
			if err := s.block(ctx, s.lockStatement(chunk, r.shared)); err != nil {
				return false, err
			}
			continue
		}
		got, err := s.tryKeys(ctx, chunk, r.shared)
		if err != nil || !got {
			return false, err
		}
	}
	return true, nil
}

// tryKeys tries keys (at most one chunk) in order, without waiting. It
// reports false if a key is held elsewhere; for more than one key, the
// keys before it stay taken.
func (s *Session) tryKeys(ctx context.Context, chunk []Key, shared bool) (bool, error) {
	sql, args := trySQL(lockFunc(shared, true), chunk, s.pid)
	var failed int32
	err := s.run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		if len(chunk) == 1 {
			var ok bool
			err := s.queryRow(ctx, conn, sql, args, &ok)
			if !ok {
				failed = 1
			}
			return s.wrongBackend(err)
		}
		return s.wrongBackend(conn.QueryRow(ctx, sql, args...).Scan(&failed))
	})
	if err == nil && ctx.Err() != nil {
		// The answer came after ctx ended: the caller releases what it
		// took.
		return false, context.Cause(ctx)
	}
	return err == nil && failed == 0, err
}

// tryThenWait takes one key, trying it first and waiting for it only if
// it is held elsewhere, in one statement (CASE evaluates its branches in
// order, and only the one it needs), and reports whether it had to wait.
// A slice that ends without the key is undone as lockStatement's is.
func (s *Session) tryThenWait(ctx context.Context, k Key, shared bool) (waited bool, err error) {
	sql, bare, args := tryThenWaitSQL(k, shared, s.pid)
	err = s.block(ctx, blockingStatement{
		sql:   sql,
		bare:  bare,
		args:  args,
		locks: 1,
		run: func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error {
			var free bool
			err := s.queryRow(ctx, conn, sql, args, nil, &free)
			waited = err == nil && !free
			return s.wrongBackend(err)
		},
		undo: func(ctx context.Context, conn *pgx.Conn) error {
			return s.unlockStatement(ctx, conn, []Key{k}, shared, false)
		},
	})
	return waited, err
}

// A blockingStatement is a statement that may wait for a lock held
// elsewhere: an advisory lock, or a row that another transaction holds.
// Session.block runs it in slices.
type blockingStatement struct {
	sql  string
	args []any // the last one is the slice's lock_timeout, in milliseconds, as text: block fills it in
	// bare, if not empty, is sql with NULL in place of its set_config of
	// lock_timeout, for a slice as long as the session's lock_timeout
	// (the wait slice, see sessionSettings): it takes args but the last.
	bare string
	run  func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error
	// undo releases, on the same connection, whatever a slice that ended
	// without success may have taken; nil if such a slice takes nothing.
	undo func(ctx context.Context, conn *pgx.Conn) error
	// locks is how many locks the statement may wait for, one after
	// another (0 counts as 1): each gets an equal share of the slice.
	locks int
	// quick marks a statement that rarely waits (for a row that a
	// transaction holds): it takes the connection in turn like any other
	// statement, and lets others interrupt it only once it has run
	// yieldAfter, so a busy backend cannot keep it from running. A lock
	// wait, which usually waits, lets the statements that want the
	// connection go first, and they interrupt it at once.
	quick bool
	// durable marks a token statement (it issues a fence or a term and
	// commits it): its result counts only if its commit is known durable.
	// A slice in which the connection received a warning that the commit
	// may not have reached a synchronous standby (see watchNotices) is
	// withheld: block treats it as a slice that ended without success, and
	// the next slice issues a new token (see block).
	durable bool
	// glance, if not 0, is the lock_timeout of every slice, and a slice
	// that ends for a lock (55P03, or 40P01 as a deadlock victim) ends
	// block with that error, for the caller to wait elsewhere (see
	// blockAway).
	glance time.Duration
}

// yieldAfter is how long a quick blocking statement runs before another
// statement may interrupt it.
const yieldAfter = 10 * time.Millisecond

// lockStatement takes keys (at most one chunk), waiting until they are
// free. A slice that ends without them may still have taken some (the
// keys before the one it waited for, or even that one: the server can
// grant a lock and report the lock timeout when the holder frees it at
// the last moment), so its undo releases them all, as far as they were
// taken: the backend held none of them before, so its count of each key
// is 0 again afterwards.
func (s *Session) lockStatement(keys []Key, shared bool) blockingStatement {
	sql, args := waitSQL(lockFunc(shared, false), keys, s.pid)
	return blockingStatement{
		sql:   sql,
		args:  args,
		locks: len(keys),
		run: func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error {
			if len(keys) == 1 {
				return s.wrongBackend(s.queryRow(ctx, conn, sql, args))
			}
			tag, err := conn.Exec(ctx, sql, args...)
			if err == nil && tag.RowsAffected() == 0 {
				err = s.wrongBackend(pgx.ErrNoRows)
			}
			return err
		},
		undo: func(ctx context.Context, conn *pgx.Conn) error {
			return s.unlockStatement(ctx, conn, keys, shared, false)
		},
	}
}

// block runs a blocking statement in slices, so that the server answers at
// least every slice, which proves the connection alive (and with it every
// lock of the backend) while the wait goes on. A statement that may wait
// for n locks one after another waits at most 1/n of the slice for each
// (lock_timeout, for that statement only), so the server ends it within
// the slice; a cancel request ends it should the server not answer half a
// heartbeat after that. Another statement that needs the
// connection interrupts the slice, runs, and the wait resumes. A slice that
// ends without success is undone (st.undo) before the next one. Blocking
// statements on one session run one at a time.
//
// A slice that would outlast ctx's deadline is cut to it, so the server
// itself ends the wait at the deadline: quicker than a cancel request,
// which is sent only for other ends of ctx, or if the server has not
// answered deadlineGrace after the deadline.
//
// A slice's cancel request may also land while the statement's commit
// waits for a synchronous standby, which PostgreSQL then ends with success
// and a warning, the commit made on the primary only. For most statements
// that does no harm; a token statement (st.durable) withholds such a slice's
// token, since a failover to the standby would issue it again, and runs
// again in the next slice: its new commit waits for the standby once more,
// and once the standby confirms it, it has every earlier commit of the
// primary too, the withheld token's included. The token handed out is then
// the greater, durable one; the withheld one is never handed out. When ctx
// ends first, block returns an error (ctx's, and errNotDurable). The slices
// go on cancelling a commit wait rather than letting it run: a backend
// whose answers stop for the loss deadline is lost with every lock on it,
// and PostgreSQL does not end a wait for a standby when the client goes
// away, so that backend would keep its locks until the standby came back.
// A withheld slice is an answer, which proves the backend alive; so a
// stalled synchronous standby delays tokens, never the lease.
//
// On error, what the last slice may have taken is the caller's to undo.
func (s *Session) block(ctx context.Context, st blockingStatement) error {
	select {
	case s.waitTurn <- struct{}{}:
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-s.done:
		return s.Err()
	}
	defer func() { <-s.waitTurn }()
	last := len(st.args) - 1
	for withheld := 0; ; {
		slice, byDeadline := s.c.cfg.waitSlice(), false
		if dl, ok := ctx.Deadline(); ok {
			left := time.Until(dl)
			if left <= 0 {
				return context.DeadlineExceeded
			}
			if left <= slice {
				slice, byDeadline = left, true
			}
		}
		each := slice / time.Duration(max(st.locks, 1))
		sql, args := st.sql, st.args
		if st.glance > 0 {
			st.args[last] = strconv.FormatInt(max(st.glance.Milliseconds(), 1), 10)
		} else if ms := max((each + time.Millisecond - 1).Milliseconds(), 1); st.bare != "" && ms == s.c.cfg.waitSlice().Milliseconds() {
			// The session's own lock_timeout (see sessionSettings).
			sql, args = st.bare, st.args[:last]
		} else {
			st.args[last] = strconv.FormatInt(ms, 10)
		}
		var sctx context.Context
		var cancel context.CancelCauseFunc
		stop := func() bool { return true }
		if byDeadline {
			// ctx's deadline is the server's to enforce; a cancel
			// request follows only if it does not answer in time.
			sctx, cancel = context.WithCancelCause(context.WithoutCancel(ctx))
			stop = context.AfterFunc(ctx, func() {
				if ctx.Err() == context.DeadlineExceeded {
					select {
					case <-sctx.Done():
						return
					case <-time.After(deadlineGrace):
					}
				}
				cancel(context.Cause(ctx))
			})
		} else {
			// Any end of ctx ends the slice at once, with ctx's cause.
			sctx, cancel = context.WithCancelCause(ctx)
		}
		// The server ends the statement within the slice; should it not
		// answer (a loaded server, a lock it waits for that lock_timeout
		// does not cover), a cancel request does, early enough to leave
		// time for the answer within the lease. A token statement's
		// commit may wait for a synchronous standby, which no
		// lock_timeout covers, slice after slice: it is cut at the end of
		// the slice, so that two slices in a row, each proving the
		// backend alive as of its start, are answered within L - H plus
		// two answers' time.
		cutAfter := slice + s.c.cfg.heartbeat/2
		if st.durable {
			cutAfter = slice
		}
		cut := time.AfterFunc(cutAfter, func() { cancel(errSliceOver) })
		if err := s.grabForWait(ctx, cancel, st.quick); err != nil {
			stop()
			cut.Stop()
			cancel(nil)
			return err
		}
		arm := func() bool { return true }
		if st.quick {
			arm = time.AfterFunc(yieldAfter, func() {
				s.state.Lock()
				if s.pending > 0 && s.interrupt != nil {
					s.interrupt(errYield)
				}
				s.state.Unlock()
			}).Stop
		}
		warned := notDurableWarnings(s.conn)
		err := s.exec(sctx, func(ctx context.Context, conn *pgx.Conn) error {
			return st.run(ctx, conn, sql, args)
		})
		s.state.Lock()
		s.interrupt = nil
		s.state.Unlock()
		arm()
		stop()
		cut.Stop()
		cause := context.Cause(sctx)
		cancel(nil)
		if err == nil && st.durable && notDurableWarnings(s.conn) != warned {
			// Committed on this server only: withhold the token.
			err = errNotDurable
			if withheld++; withheld == 1 {
				s.c.cfg.warnLogger().Warn("pgcoord: a token's commit was not confirmed by the synchronous standby; it is withheld and a new one issued until the standby confirms one",
					"pid", s.pid)
			}
		}
		// A yield or the cut cancels the slice's statement: on the server
		// (57014), or before pgx sent it (a context error, the connection
		// intact).
		yielded := errors.Is(cause, errYield)
		interrupted := (yielded || errors.Is(cause, errSliceOver)) &&
			(pgCode(err) == "57014" || errors.Is(err, context.Canceled) && !s.conn.IsClosed())
		sliceEnded := interrupted || pgCode(err) == "55P03" && st.glance == 0 || err == errNotDurable
		if err == nil || ctx.Err() != nil || s.Err() != nil || !sliceEnded {
			s.release()
			if err == errNotDurable {
				// ctx ended, or the session did, before the standby
				// confirmed a token.
				why := context.Cause(ctx)
				if e := s.Err(); e != nil {
					why = e
				}
				err = errorf("%w (%w)", why, errNotDurable)
			}
			return err
		}
		// The slice ended without success: go on waiting, from nothing.
		if st.undo != nil {
			uctx, cancel := withoutCancel(ctx, s.c.cfg.lossDeadline)
			err = s.exec(uctx, st.undo)
			cancel()
			if err != nil {
				s.release()
				return err
			}
		}
		s.release()
	}
}

// deadlineGrace is how long after ctx's deadline a wait cut to it may go
// on before it is cancelled with a cancel request. (A slice that is not
// cut to the deadline is cancelled half a heartbeat after its end.)
const deadlineGrace = 50 * time.Millisecond

// errSliceOver cancels a slice that has run its time (see block).
var errSliceOver = errors.New("pgcoord: wait slice over")

// errNotDurable says that a token statement's commit was not confirmed
// durable (see block); it reaches a caller only joined to the reason it
// stopped waiting.
var errNotDurable = errors.New("pgcoord: a token was withheld: its commit was not confirmed by the synchronous standby (synchronous_standby_names) in time")

// grabForWait takes the connection for one slice of a blocking statement,
// after any statement that is waiting for it unless the statement is
// quick, and installs interrupt.
func (s *Session) grabForWait(ctx context.Context, interrupt func(error), quick bool) error {
	for {
		select {
		case s.use <- struct{}{}:
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-s.done:
			return s.Err()
		}
		s.state.Lock()
		if s.err != nil {
			s.state.Unlock()
			<-s.use
			return s.Err()
		}
		if s.pending == 0 || quick {
			s.interrupt = interrupt
			s.interruptAt = time.Time{}
			if quick {
				s.interruptAt = time.Now().Add(yieldAfter)
			}
			s.state.Unlock()
			return nil
		}
		if s.noPending == nil {
			s.noPending = make(chan struct{})
		}
		ch := s.noPending
		s.state.Unlock()
		<-s.use
		select {
		case <-ch:
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-s.done:
			return s.Err()
		}
	}
}

// settle records that the reserved keys are now held by l.
func (s *Session) settle(need []Key, l *Lock) error {
	s.state.Lock()
	defer s.state.Unlock()
	now := time.Now()
	for _, k := range need {
		h := s.keys[k]
		h.n, h.since = 1, now
		close(h.busy)
		h.busy = nil
	}
	if s.err != nil {
		return s.err // ended meanwhile: the server freed everything
	}
	s.locks[l] = struct{}{}
	return nil
}

// undo gives back what a failed acquire reserved: the keys it sent to the
// server are released there unless nothing was taken (the server answers
// false for a key it did not hold), and the joined keys are released like
// any other handle's. If that fails, the session is lost, which frees
// everything.
func (s *Session) undo(ctx context.Context, r request, need []Key, nothingTaken bool) {
	ctx, cancel := withoutCancel(ctx, s.c.cfg.lossDeadline)
	defer cancel()
	var err error
	if len(need) > 0 && !nothingTaken && s.Err() == nil {
		err = s.unlockKeys(ctx, need, r.shared, false)
	}
	s.forgetKeys(need)
	if err != nil {
		s.lose(errorf("release after failed acquire: %w", err))
		return
	}
	joined := make([]Key, 0, len(r.keys)-len(need))
	for _, k := range r.keys {
		if !containsKey(need, k) {
			joined = append(joined, k)
		}
	}
	_ = s.releaseKeys(ctx, joined, r.shared)
}

// releaseKeys drops one handle's hold of keys. Keys that no handle holds
// any more are released on the server, where each must have been held.
// An error loses the session.
func (s *Session) releaseKeys(ctx context.Context, keys []Key, shared bool) error {
	_, err := s.releaseHold(ctx, keys, shared)
	return err
}

// releaseHold is releaseKeys; sent reports whether it sent a release to
// the server (false: other handles still hold every key here).
func (s *Session) releaseHold(ctx context.Context, keys []Key, shared bool) (sent bool, err error) {
	s.state.Lock()
	var free []Key
	for _, k := range keys {
		h := s.keys[k]
		switch {
		case h == nil:
		case h.n > 1:
			h.n--
		default:
			h.n = 0
			h.busy = make(chan struct{})
			free = append(free, k)
		}
	}
	s.state.Unlock()
	if len(free) == 0 {
		return false, nil
	}
	return true, s.releaseFree(ctx, free, shared)
}

// releaseFree releases on the server the keys that releaseHold marked.
func (s *Session) releaseFree(ctx context.Context, free []Key, shared bool) error {
	err := s.unlockKeys(ctx, free, shared, true)
	s.forgetKeys(free)
	if err != nil {
		s.lose(err)
		if e := s.Err(); e != nil {
			return e
		}
	}
	return err
}

// forgetKeys drops busy keys whose statement has ended and that the
// backend no longer holds, and wakes whoever waits for them.
func (s *Session) forgetKeys(keys []Key) {
	s.state.Lock()
	for _, k := range keys {
		h := s.keys[k]
		delete(s.keys, k)
		close(h.busy)
	}
	empty := len(s.keys) == 0 && s.managed
	s.state.Unlock()
	if empty {
		s.c.backendFreed()
	}
}

// unlockKeys releases keys on the server, taking the connection for each
// chunk. strict makes a key the server did not hold an error wrapping
// ErrNotHeld: the session's picture of its locks would be wrong.
func (s *Session) unlockKeys(ctx context.Context, keys []Key, shared, strict bool) error {
	for _, chunk := range chunked(keys) {
		err := s.run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
			return s.unlockStatement(ctx, conn, chunk, shared, strict)
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// unlockStatement releases keys (at most one chunk) in one statement on
// conn, which the caller holds.
func (s *Session) unlockStatement(ctx context.Context, conn *pgx.Conn, keys []Key, shared, strict bool) error {
	sql, args := unlockSQL(unlockFunc(shared), keys, s.pid)
	var one [1]bool
	ok := one[:]
	if len(keys) == 1 {
		if err := s.wrongBackend(s.queryRow(ctx, conn, sql, args, &one[0])); err != nil {
			return err
		}
	} else {
		ok = make([]bool, len(keys))
		dest := make([]any, len(keys))
		for i := range ok {
			dest[i] = &ok[i]
		}
		if err := s.wrongBackend(conn.QueryRow(ctx, sql, args...).Scan(dest...)); err != nil {
			return err
		}
	}
	for i, k := range keys {
		if strict && !ok[i] {
			return errorf("%w: the server did not hold %s for backend %d", ErrNotHeld, k, s.pid)
		}
	}
	return nil
}

// drop removes a handle that never reached its caller and releases its
// keys; its gates stay the caller's.
func (s *Session) drop(l *Lock) {
	s.state.Lock()
	_, mine := s.locks[l]
	delete(s.locks, l)
	s.state.Unlock()
	l.finish(ErrNotHeld)
	if mine {
		ctx, cancel := withoutCancel(context.Background(), s.c.cfg.lossDeadline)
		defer cancel()
		_ = s.releaseKeys(ctx, l.keys, l.shared)
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
		case <-l.done:
			cancel(l.Err())
		case <-ctx.Done():
		}
	}()
	space, key := fenceRow(l.keys[0])
	var fence int64
	run := func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error {
		err := conn.QueryRow(ctx, sql, args...).Scan(&fence)
		if errors.Is(err, pgx.ErrNoRows) {
			err = errorf("%w: backend %d no longer holds %s", ErrLockLost, s.pid, l.keys[0])
		}
		return err
	}
	// Both statements are token statements: a fence whose commit a
	// synchronous standby has not confirmed is withheld (see block).
	err := s.c.blockAway(ctx, s, blockingStatement{
		sql:     issueFenceSQL(s.c.cfg, 3, 0, "", true),
		args:    []any{space, key, ""},
		run:     run,
		quick:   true,
		durable: true,
	}, blockingStatement{
		// Away from l's backend, the fence checks that l's backend
		// still holds the key.
		sql:     issueFenceSQL(s.c.cfg, 4, 3, "", false),
		args:    []any{space, key, s.pid, ""},
		run:     run,
		durable: true,
	})
	if err != nil {
		return notMigrated(s.c.cfg, "issue fence for key "+l.keys[0].String(), err)
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

// blockAway runs st, a blocking statement that rarely waits (for a row
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
func (c *Client) blockAway(ctx context.Context, home *Session, st, away blockingStatement) error {
	if !home.managed {
		return home.block(ctx, st)
	}
	st.glance = glance
	poll := minPollInterval
	for {
		err := home.block(ctx, st)
		if code := pgCode(err); code != "55P03" && code != "40P01" || home.Err() != nil {
			return err
		}
		b, done, err := c.waitBackend(ctx)
		switch {
		case err == nil:
			err = b.block(ctx, away)
			done()
			return err
		case !errors.Is(err, errNoWaitBackend):
			return err
		}
		if err := c.pause(ctx, poll); err != nil {
			return err
		}
		poll = min(2*poll, maxPollInterval)
	}
}

// wrongBackend turns "no row" from a statement guarded by
// WHERE pg_backend_pid() = <the session's pid> into ErrTransactionPooling:
// the statement ran on another backend, and did nothing there.
func (s *Session) wrongBackend(err error) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return errorf("%w: a statement of backend %d ran on another backend (and did nothing there)", ErrTransactionPooling, s.pid)
	}
	return err
}

// pgCode returns the SQLSTATE of err, or "".
func pgCode(err error) string {
	if err == nil {
		return ""
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

func containsKey(keys []Key, k Key) bool {
	for _, x := range keys {
		if x == k {
			return true
		}
	}
	return false
}
