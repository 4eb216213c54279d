package core

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Statements that wait
//
// A statement that may wait for a lock held elsewhere (an advisory lock, or
// a row another transaction holds) is a blockingStatement, and
// Session.block runs it in slices: the server answers at least every slice,
// which proves the backend alive, and with it every lock the backend holds,
// however long the wait. Where such a statement may run is decided by the
// routing rule in backends.go (Client.waitBackend); this file is what
// happens once it runs: the slices, the yield to other statements of the
// backend, the cut at ctx's deadline, the undo of a slice that may have
// taken something, and the tokens whose commit may not be durable.

// A blockingStatement is a statement that may wait for a lock held
// elsewhere: an advisory lock, or a row that another transaction holds.
// Session.block runs it in slices.
type BlockingStatement struct {
	Sql  string
	Args []any // the last one is the slice's lock_timeout, in milliseconds, as text: block fills it in
	// bare, if not empty, is sql with NULL in place of its set_config of
	// lock_timeout, for a slice as long as the session's lock_timeout
	// (the wait slice, see sessionSettings): it takes args but the last.
	bare string
	Run  func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error
	// Undo releases, on the same connection, whatever a slice that ended
	// without success may have taken; nil if such a slice takes nothing.
	Undo func(ctx context.Context, conn *pgx.Conn) error
	// Locks is how many locks the statement may wait for, one after
	// another (0 counts as 1): each gets an equal share of the slice.
	Locks int
	// Quick marks a statement that rarely waits (for a row that a
	// transaction holds): it takes the connection in turn like any other
	// statement, and lets others interrupt it only once it has run
	// yieldAfter, so a busy backend cannot keep it from running. A lock
	// wait, which usually waits, lets the statements that want the
	// connection go first, and they interrupt it at once.
	Quick bool
	// Durable marks a token statement (it issues a fence or a term and
	// commits it): its result counts only if its commit is known durable.
	// A slice in which the connection received a warning that the commit
	// may not have reached a synchronous standby (see watchNotices) is
	// withheld: block treats it as a slice that ended without success, and
	// the next slice issues a new token (see block).
	Durable bool
	// glance, if not 0, is the lock_timeout of every slice, and a slice
	// that ends for a lock (55P03, or 40P01 as a deadlock victim) ends
	// block with that error, for the caller to wait elsewhere (see
	// blockAway).
	glance time.Duration
}

// yieldAfter is how long a quick blocking statement runs before another
// statement may interrupt it.
const yieldAfter = 10 * time.Millisecond

// Block runs a blocking statement in slices, so that the server answers at
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
func (s *Session) Block(ctx context.Context, st BlockingStatement) error {
	select {
	case s.waitTurn <- struct{}{}:
	default:
		// Wait for the turn. (Taken at once, it asks nothing of ctx: an
		// acquire's context joins the Client's only for a wait, see
		// acquireContext.)
		select {
		case s.waitTurn <- struct{}{}:
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-s.done:
			return s.Err()
		}
	}
	defer func() { <-s.waitTurn }()
	last := len(st.Args) - 1
	for withheld := 0; ; {
		slice, byDeadline := s.c.Cfg.WaitSlice(), false
		if dl, ok := ctx.Deadline(); ok {
			left := time.Until(dl)
			if left <= 0 {
				return CtxCause(ctx)
			}
			if left <= slice {
				slice, byDeadline = left, true
			}
		}
		each := slice / time.Duration(max(st.Locks, 1))
		sql, args := st.Sql, st.Args
		if st.glance > 0 {
			st.Args[last] = strconv.FormatInt(max(st.glance.Milliseconds(), 1), 10)
		} else if ms := max((each + time.Millisecond - 1).Milliseconds(), 1); st.bare != "" && ms == s.c.Cfg.WaitSlice().Milliseconds() {
			// The session's own lock_timeout (see sessionSettings).
			sql, args = st.bare, st.Args[:last]
		} else {
			st.Args[last] = strconv.FormatInt(ms, 10)
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
			// An acquire's slice watches the caller's context alone:
			// the Client's Close ends every session it tracks, and a
			// session's end interrupts its slice with ErrClosed (see
			// Session.end). A session that no Client tracks would need
			// the acquire's whole context here.
			sctx, cancel = context.WithCancelCause(stmtCtx(ctx))
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
		cutAfter := slice + s.c.Cfg.Heartbeat/2
		if st.Durable {
			cutAfter = slice
		}
		cut := time.AfterFunc(cutAfter, func() { cancel(errSliceOver) })
		if err := s.grabForWait(ctx, cancel, st.Quick); err != nil {
			stop()
			cut.Stop()
			cancel(nil)
			return err
		}
		arm := func() bool { return true }
		if st.Quick {
			arm = time.AfterFunc(yieldAfter, func() {
				s.State.Lock()
				if s.Pending > 0 && s.interrupt != nil {
					s.interrupt(errYield)
				}
				s.State.Unlock()
			}).Stop
		}
		warned := notDurableWarnings(s.conn)
		err := s.Exec(sctx, func(ctx context.Context, conn *pgx.Conn) error {
			return st.Run(ctx, conn, sql, args)
		})
		s.State.Lock()
		s.interrupt = nil
		s.State.Unlock()
		arm()
		stop()
		cut.Stop()
		cause := context.Cause(sctx)
		cancel(nil)
		if err == nil && st.Durable && notDurableWarnings(s.conn) != warned {
			// Committed on this server only: withhold the token.
			err = errNotDurable
			if withheld++; withheld == 1 {
				s.c.Cfg.WarnLogger().Warn("pgcoord: a token's commit was not confirmed by the synchronous standby; it is withheld and a new one issued until the standby confirms one",
					"pid", s.Pid)
			}
		}
		// A yield or the cut cancels the slice's statement: on the server
		// (57014), or before pgx sent it (a context error, the connection
		// intact).
		yielded := errors.Is(cause, errYield)
		interrupted := (yielded || errors.Is(cause, errSliceOver)) &&
			(SqlState(err) == "57014" || errors.Is(err, context.Canceled) && !s.conn.IsClosed())
		sliceEnded := interrupted || SqlState(err) == "55P03" && st.glance == 0 || err == errNotDurable
		if err == nil || ctx.Err() != nil || s.Err() != nil || !sliceEnded {
			s.Release()
			if err == errNotDurable {
				// ctx ended, or the session did, before the standby
				// confirmed a token.
				why := context.Cause(ctx)
				if e := s.Err(); e != nil {
					why = e
				}
				err = Errorf("%w (%w)", why, errNotDurable)
			}
			return err
		}
		// The slice ended without success: go on waiting, from nothing.
		if st.Undo != nil {
			uctx, cancel := WithoutCancel(ctx, s.c.Cfg.LossDeadline)
			err = s.Exec(uctx, st.Undo)
			cancel()
			if err != nil {
				s.Release()
				return err
			}
		}
		s.Release()
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
		default:
			select {
			case s.use <- struct{}{}:
			case <-ctx.Done():
				return context.Cause(ctx)
			case <-s.done:
				return s.Err()
			}
		}
		s.State.Lock()
		if s.err != nil {
			s.State.Unlock()
			<-s.use
			return s.Err()
		}
		if s.Pending == 0 || quick {
			s.interrupt = interrupt
			s.interruptAt = time.Time{}
			if quick {
				s.interruptAt = time.Now().Add(yieldAfter)
			}
			s.State.Unlock()
			return nil
		}
		if s.noPending == nil {
			s.noPending = make(chan struct{})
		}
		ch := s.noPending
		s.State.Unlock()
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

// Commits that may not be durable
//
// With synchronous replication (synchronous_standby_names), a commit waits
// until a synchronous standby has its WAL. If the wait is cancelled (a
// cancel request: the end of a slice, a yield or a caller's ctx in
// Session.block, or anyone's pg_cancel_backend), PostgreSQL does not undo
// the commit: it answers the statement with success and a WARNING
// ("canceling wait for synchronous replication due to user request ...
// committed locally, but might not have been replicated"), SQLSTATE 01000
// (57P01 when the backend is being terminated, which also ends the
// connection). A token (a fence, a term) committed like that exists on the
// primary only: a failover to the standby would issue it again. So every
// dedicated connection counts such warnings (watchNotices), and a token
// statement whose run saw one withholds its token (see
// blockingStatement.durable). The message is in the server's language, so
// the count goes by severity and SQLSTATE: a token statement raises no
// other warning.

// notDurableKey is the key, in a dedicated connection's CustomData, of the
// number of warnings it received that a commit may not be durable.
const notDurableKey = "pgcoord.notDurable"

// watchNotices makes connections opened with cc count, in their
// CustomData, the warnings that say a commit may not have reached a
// synchronous standby; cc's own OnNotice, if any, is still called.
func watchNotices(cc *pgx.ConnConfig) {
	next := cc.OnNotice
	cc.OnNotice = func(pc *pgconn.PgConn, n *pgconn.Notice) {
		if commitMayNotBeDurable(n) {
			d := pc.CustomData()
			k, _ := d[notDurableKey].(int)
			d[notDurableKey] = k + 1
		}
		if next != nil {
			next(pc, n)
		}
	}
}

// commitMayNotBeDurable reports whether n is a warning that PostgreSQL
// sends when it stops waiting for a synchronous standby.
func commitMayNotBeDurable(n *pgconn.Notice) bool {
	severity := n.SeverityUnlocalized
	if severity == "" {
		severity = n.Severity
	}
	return severity == "WARNING" && (n.Code == "01000" || n.Code == "57P01")
}

// notDurableWarnings returns how many warnings that a commit may not be
// durable conn has received (see watchNotices). Read it while holding the
// connection, before and after a statement.
func notDurableWarnings(conn *pgx.Conn) int {
	k, _ := conn.PgConn().CustomData()[notDurableKey].(int)
	return k
}
