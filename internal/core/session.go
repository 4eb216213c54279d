package core

import (
	"context"
	"encoding/binary"
	"errors"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// A session: one dedicated connection, used by one statement at a time,
// until it ends or is lost

// Session is the core of [pgcoord.Session], which documents it.
type Session struct {
	c       *Client
	conn    *pgx.Conn
	Pid     int32
	managed bool // one of the Client's shared backends
	// Planned holds the statements planned on conn (see prepare); only
	// used while holding the connection.
	Planned map[string]bool

	use      chan struct{} // holds a token while a statement runs on conn
	waitTurn chan struct{} // holds a token while a blocking acquire is in flight

	State       sync.Mutex
	LastOK      time.Time          // start of the last statement the server answered
	wire        wireBuf            // queryRow's buffer, used under the use token
	traced      bool               // the connection's pgx config has a tracer (see queryRow)
	Holds       map[Key]*keyHold   // what this backend holds, by key
	locks       map[*Lock]struct{} // live handles
	err         error              // why the session ended; nil while open
	Pending     int                // callers waiting for conn, other than a blocking acquire; the queued key calls count as one
	noPending   chan struct{}      // closed when pending drops to 0; made by whoever waits for that
	interrupt   func(error)        // ends the blocking statement on conn; nil if none
	interruptAt time.Time          // not before then
	Calls       combiner           // tries and releases of one key queued behind one (see callKey)
	done        chan struct{}
	lease       *time.Timer
	stopHB      chan struct{}
	hbDone      chan struct{}
	cleaned     chan struct{} // closed when the connection is closed and the heartbeat has stopped

	Waiting bool // a blocking acquire of the Client's has this backend (see waitBackend)
	// granting counts the statements in flight that may take a key the
	// backend's records cannot show before the statement ends (a
	// semaphore's grant picks its slot on the server): while it is not 0,
	// no blocking acquire may claim the backend (see beginGrant).
	granting   int
	holderRows bool // the backend has run a semaphore's grant (see ranGrant): close deletes its holder rows, and the rows of the slots it holds
}

// keyHold is one key on one backend. The server holds the key (once) while
// n > 0; a statement that takes or frees it runs only while busy is set, and
// nothing else about the key is decided until it has ended. So the server's
// count for the key on this backend is always 0 or 1, and an error path can
// tell what its own statement did.
type keyHold struct {
	n      int  // live handles holding the key here
	shared bool // mode of the holds
	Busy   chan struct{}
	since  time.Time // when the server granted the key to this backend
	joins  int       // handles that joined the hold without asking the server
	// waits is set while the statement in flight (busy) waits for the
	// key on the server: a try does not wait for it (see reserve).
	waits bool
	// WaitsSet, made by a try that waits for busy, is closed when waits
	// is set, so that the try stops waiting (see markWaits).
	WaitsSet chan struct{}
}

// errYield interrupts a blocking acquire so that another statement can use
// the connection; the acquire resumes afterwards.
var errYield = errors.New("pgcoord: yield the connection")

// NewSession is the core of [pgcoord.Client.NewSession], which documents it.
func (c *Client) NewSession(ctx context.Context) (*Session, error) {
	if ctx == nil {
		return nil, Errorf("new session: ctx is nil")
	}
	if err := c.Enter(); err != nil {
		return nil, err
	}
	defer c.Wg.Done()
	return c.OpenSession(ctx)
}

// Done is the core of [pgcoord.Session.Done], which documents it.
func (s *Session) Done() <-chan struct{} { return s.done }

// Err is the core of [pgcoord.Session.Err], which documents it.
func (s *Session) Err() error {
	s.State.Lock()
	defer s.State.Unlock()
	return s.err
}

// PID is the core of [pgcoord.Session.PID], which documents it.
func (s *Session) PID() int32 { return s.Pid }

// Close is the core of [pgcoord.Session.Close], which documents it.
func (s *Session) Close(ctx context.Context) error { return s.close(ctx) }

func (s *Session) close(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	if !s.End(ErrClosed) {
		return nil // ended before: whoever ended it closes the connection
	}
	ctx, cancel := context.WithTimeout(ctx, s.c.Cfg.LossDeadline)
	defer cancel()
	var err error
	if ctx.Err() != nil {
		// No time to wait for a clean release: cut the connection. (A
		// select below could pick the free connection as well, and
		// report a release that ctx did not leave time for.)
		s.closeSocket()
		return Errorf("close session: the connection was closed without confirming the release (the server frees the locks when it notices): %w", context.Cause(ctx))
	}
	select {
	case s.use <- struct{}{}:
		// The connection is ours: nothing else runs on it any more. ctx
		// bounds the release: when it ends, the socket is cut.
		// (The statement does not watch ctx: pgx would answer it with a
		// cancel request, which a silent network does not deliver.)
		stop := context.AfterFunc(ctx, func() { _ = s.conn.PgConn().Conn().SetDeadline(time.Now()) })
		defer stop()
		s.State.Lock()
		holderRows := s.holderRows
		s.State.Unlock()
		if holderRows {
			// The rows of the permits that end with the session, which
			// no Release deletes, and the rows of any slot it holds: a
			// grant that failed after it took a slot leaves the row of
			// the slot's last holder, whose Release left it to the grant
			// to write over. Best effort: a row left behind is a dead
			// holder's, which Holders ignores and acquires remove.
			_, _ = s.conn.Exec(context.WithoutCancel(ctx), "DELETE FROM "+s.c.Cfg.Table("semaphore_holders")+` h
				WHERE h.pid = pg_catalog.pg_backend_pid() OR h.lock_key IN (
					SELECT (l.classid::bigint << 32) | l.objid::bigint FROM pg_catalog.pg_locks l
					WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.pid = pg_catalog.pg_backend_pid())`)
		}
		if _, err = s.conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock_all()"); err != nil && ctx.Err() != nil {
			err = Errorf("%w: %w", context.Cause(ctx), err)
		}
		if err == nil {
			err = s.conn.Close(ctx)
		} else if backendEnded(err) {
			err = nil // the backend is gone, and its locks with it
		}
		if err != nil {
			_ = s.conn.PgConn().Conn().Close()
			CloseConn(s.conn, time.Second)
		}
		<-s.use
		s.finish()
	case <-ctx.Done():
		err = context.Cause(ctx)
		// Something still runs on the connection: cut it, and let the
		// rest of the cleanup finish in the background (Client.Close
		// waits for it).
		s.closeSocket()
	}
	if err != nil {
		return Errorf("close session: the connection was closed without confirming the release (the server frees the locks when it notices): %w", err)
	}
	return nil
}

// closeSocket cuts the connection at once, so that any statement in flight
// returns and the server frees the backend's locks, and finishes closing
// it in the background once nothing uses it (Client.Close waits for that).
func (s *Session) closeSocket() {
	_ = s.conn.PgConn().Conn().Close()
	go func() {
		s.use <- struct{}{}
		CloseConn(s.conn, time.Second)
		<-s.use
		s.finish()
	}()
}

// finish completes the end of a session once its connection is closed.
func (s *Session) finish() {
	<-s.hbDone
	close(s.cleaned)
	s.c.untrack(s)
}

// End moves the session to its final state once: it records why, stops the
// heartbeat and the lease, interrupts a blocking acquire, and ends every
// lock. It reports whether this call was the one that ended the session.
func (s *Session) End(why error) bool {
	s.State.Lock()
	if s.err != nil {
		s.State.Unlock()
		return false
	}
	s.err = why
	locks := s.locks
	s.locks = nil
	interrupt := s.interrupt
	s.lease.Stop()
	s.State.Unlock()
	close(s.stopHB)
	close(s.done)
	if interrupt != nil {
		interrupt(why)
	}
	observed := s.c.observed()
	for l := range locks {
		l.endReported(why, observed)
	}
	s.c.retire(s)
	return true
}

// Lose ends the session because its locks can no longer be trusted, and
// closes the socket at once so that the server frees them and any
// statement in flight returns.
func (s *Session) Lose(cause error) {
	s.State.Lock()
	n := len(s.locks)
	var keys []Key
	for l := range s.locks {
		if len(keys) >= 4 {
			break
		}
		keys = append(keys, l.KeyList[0])
	}
	s.State.Unlock()
	err := Errorf("%w: %w", ErrLockLost, cause)
	if !s.End(err) {
		return
	}
	if n > 0 {
		attrs := []any{"locks", n, "keys", KeyList(keys), "pid", s.Pid, "err", cause}
		var names []string
		for _, k := range keys {
			if name := s.c.Cfg.KeyName(k); name != "" {
				names = append(names, name)
			}
		}
		if len(names) > 0 {
			attrs = append(attrs, "names", names)
		}
		s.c.Cfg.WarnLogger().Warn("pgcoord: locks lost", attrs...)
	} else {
		s.c.Cfg.InfoLogger().Info("pgcoord: connection lost; it held no lock", "pid", s.Pid, "err", cause)
	}
	s.closeSocket()
}

// Grab waits until the connection is free for one statement, bounded by
// ctx. A blocking acquire that waits on the connection is interrupted and
// resumes after. The caller must call release.
func (s *Session) Grab(ctx context.Context) error {
	select {
	case s.use <- struct{}{}:
		// Free: no statement runs, so there is nothing to interrupt and
		// nobody to queue behind (a caller that waited for the
		// connection is handed it as it is released, before anyone
		// else can take it here).
		if err := s.Err(); err != nil {
			<-s.use
			return err
		}
		return nil
	default:
	}
	s.State.Lock()
	if s.err != nil {
		s.State.Unlock()
		return s.err
	}
	s.Pending++
	if s.interrupt != nil && !time.Now().Before(s.interruptAt) {
		s.interrupt(errYield)
	}
	s.State.Unlock()
	defer func() {
		s.State.Lock()
		s.unpend()
		s.State.Unlock()
	}()
	select {
	case s.use <- struct{}{}:
		if err := s.Err(); err != nil {
			<-s.use
			return err
		}
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-s.done:
		return s.Err()
	}
}

// unpend counts one caller fewer in pending, and wakes a blocking acquire
// that waits for none to be left. The caller holds s.state.
func (s *Session) unpend() {
	if s.Pending--; s.Pending == 0 && s.noPending != nil {
		close(s.noPending)
		s.noPending = nil
	}
}

// Release gives the connection back after grab.
func (s *Session) Release() { <-s.use }

// prepare prepares statements on the session's connection (named by their
// text, so that pgx runs them as prepared statements from then on), unless
// they are already, and plans those that give arguments for it once per
// connection (see preparedStatement). Preparing has the server parse them
// and load the metadata of their tables, which a connection's first use of
// a table costs.
func (s *Session) prepare(ctx context.Context, sts []PreparedStatement) error {
	if len(sts) == 0 {
		return nil
	}
	return s.Run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		for _, st := range sts {
			if _, err := conn.Prepare(ctx, st.Sql, st.Sql); err != nil {
				if SqlState(err) == "55P03" {
					// A table is locked (a migration, VACUUM FULL): the
					// statement is prepared when it first runs instead.
					return nil
				}
				return NotMigrated(s.c.Cfg, "prepare statements", err)
			}
			if st.Plan == nil || s.Planned[st.Sql] {
				continue
			}
			// Text arguments, one round trip, nothing prepared or cached:
			// the plan is all this is for. An error of the server here
			// costs only the warm-up: the statement reports its own
			// errors when it runs.
			args := append([]any{pgx.QueryExecModeExec}, st.Plan...)
			if _, err := conn.Exec(ctx, "EXPLAIN (COSTS OFF) "+st.Sql, args...); err != nil {
				if SqlState(err) != "" {
					continue
				}
				return err
			}
			if s.Planned == nil {
				s.Planned = make(map[string]bool)
			}
			s.Planned[st.Sql] = true
		}
		return nil
	})
}

// Run executes one statement that does not wait (a try, an unlock) on the
// session's connection. ctx bounds the wait for the connection, not the
// statement: the server answers it in one round trip, and a cancel request
// would cost more than the answer (on a loaded server, far more, with the
// connection, and every lock on it, held meanwhile). The lease bounds the
// statement: with no answer for the loss deadline, the session is lost and
// its connection closed, which ends the statement.
func (s *Session) Run(ctx context.Context, f func(ctx context.Context, conn *pgx.Conn) error) error {
	if err := s.Grab(ctx); err != nil {
		return err
	}
	defer s.Release()
	return s.Exec(detached(ctx), f)
}

// detached returns a context with ctx's values that never ends, for a
// statement that runs to its answer once sent (see run). For an acquire's
// context, whose statements run on the caller's context (see stmtCtx),
// that is the caller's, detached, and the acquire's is left unjoined.
func detached(ctx context.Context) context.Context {
	ctx = stmtCtx(ctx)
	if ctx.Done() != nil {
		ctx = context.WithoutCancel(ctx)
	}
	return ctx
}

// Exec runs f while the caller holds the connection. An answer from the
// server, error or not, proves the connection alive as of the start. A
// broken connection, or a cancellation that ctx did not ask for, loses
// the session. Statement errors (lock wait cancelled, deadlock, ...) are
// returned as they are for the caller to resolve.
func (s *Session) Exec(ctx context.Context, f func(ctx context.Context, conn *pgx.Conn) error) error {
	start := time.Now()
	err := f(stmtCtx(ctx), s.conn)
	if err == nil {
		s.proved(start)
		return nil
	}
	// Declared here, not above: errors.As makes pe escape, and a
	// statement that succeeds should not pay for its allocation.
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		s.proved(start)
	}
	switch {
	case s.conn.IsClosed():
		s.Lose(err)
	case pe != nil && pe.Code == "57014" && ctx.Err() == nil:
		s.Lose(Errorf("a statement was cancelled that nothing here cancelled: %w", err))
	case errors.Is(err, ErrTransactionPooling):
		s.Lose(err)
	default:
		return err
	}
	if e := s.Err(); e != nil {
		return e
	}
	return err
}

// proved records that the server answered a statement sent at start.
func (s *Session) proved(start time.Time) {
	// The lease timer is left as it is: when it fires, checkLease finds
	// the newer answer and sets it again for the rest of the deadline, so
	// a statement costs no timer operation.
	s.State.Lock()
	if start.After(s.LastOK) {
		s.LastOK = start
	}
	s.State.Unlock()
}

// AnsweredAt returns the start of the last statement the server answered
// on the session's connection.
func (s *Session) AnsweredAt() time.Time {
	s.State.Lock()
	defer s.State.Unlock()
	return s.LastOK
}

// backendEnded reports whether err is the server ending the backend
// (a FATAL error: terminated, shut down), which frees all its locks.
func backendEnded(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (pe.Severity == "FATAL" || pe.Severity == "PANIC")
}

// ErrorIsLoss reports whether err means the session (and its locks) ended.
func ErrorIsLoss(err error) bool {
	return errors.Is(err, ErrLockLost) || errors.Is(err, ErrClosed)
}

// The statements of one key (a try, a wait, an unlock: the common path of
// every lock) take arguments of three kinds and answer booleans. queryRow
// runs them on pgconn directly, without pgx's rows: the statement is
// prepared under its own text once per connection (as pgx's QueryRow does
// for a named statement), the arguments are written straight in the
// protocol's binary form into a buffer of the session, and the row is read
// from pgconn's own buffers. That costs a few allocations where pgx's rows
// cost a few dozen, which matters on a contended path, where the client's
// work between a grant and the next unlock is part of everyone's wait.

// wireMaxArgs is the most arguments a statement of one key takes: a pair
// key's two halves, the backend's pid, and a lock_timeout.
const wireMaxArgs = 4

// wireBuf is a session's buffer for queryRow; statements on a session run
// one at a time, under its use token.
type wireBuf struct {
	bytes   [wireMaxArgs * 8]byte
	params  [wireMaxArgs][]byte
	formats [wireMaxArgs]int16
}

// binaryResults asks for every result column in binary form.
var binaryResults = []int16{pgx.BinaryFormatCode}

// QueryRow is conn.QueryRow(ctx, sql, args...).Scan(dest...) for a
// statement of one key, whose arguments are int64, int32 or string and
// whose scanned columns are booleans; a nil dest skips its column. It
// returns pgx.ErrNoRows if the statement returned no row. It runs the
// statement from its cached description, as pgx does, so the server is not
// asked to describe the result again. The caller holds the session's
// connection. A connection with a pgx tracer goes through pgx, so that the
// tracer sees every statement, as does anything else queryRow does not
// encode.
func (s *Session) QueryRow(ctx context.Context, conn *pgx.Conn, sql string, args []any, dest ...*bool) error {
	if len(args) > wireMaxArgs || s.traced {
		return pgxRow(ctx, conn, sql, args, dest)
	}
	sd, err := conn.Prepare(ctx, sql, sql)
	if err != nil {
		return err
	}
	params, formats, ok := s.wire.encode(sd, args)
	if !ok || len(sd.Fields) < len(dest) {
		return pgxRow(ctx, conn, sql, args, dest)
	}
	for i, d := range dest {
		if d != nil && sd.Fields[i].DataTypeOID != pgtype.BoolOID {
			return pgxRow(ctx, conn, sql, args, dest)
		}
	}
	rr := conn.PgConn().ExecStatement(ctx, sd, params, formats, binaryResults)
	rows := 0
	var scanErr error
	for rr.NextRow() {
		if rows++; rows > 1 {
			continue
		}
		values := rr.Values()
		for i, d := range dest {
			switch v := values[i]; {
			case d == nil:
			case len(v) == 1:
				*d = v[0] != 0
			case v == nil:
				scanErr = Errorf("column %d of %q is NULL, want a boolean", i+1, sql)
			default:
				scanErr = Errorf("column %d of %q: %d bytes for a boolean", i+1, sql, len(v))
			}
		}
	}
	if _, err := rr.Close(); err != nil {
		return err
	}
	switch {
	case scanErr != nil:
		return scanErr
	case rows == 0:
		return pgx.ErrNoRows
	}
	return nil
}

// encode writes args in the binary form of sd's parameter types (text
// parameters as text) into w, and reports false for an argument whose type
// it does not write.
func (w *wireBuf) encode(sd *pgconn.StatementDescription, args []any) ([][]byte, []int16, bool) {
	if len(sd.ParamOIDs) != len(args) {
		return nil, nil, false
	}
	buf := w.bytes[:0]
	var ends [wireMaxArgs]int
	for i, a := range args {
		switch v := a.(type) {
		case int64:
			if sd.ParamOIDs[i] != pgtype.Int8OID {
				return nil, nil, false
			}
			buf = binary.BigEndian.AppendUint64(buf, uint64(v))
			w.formats[i] = pgx.BinaryFormatCode
		case int32:
			if sd.ParamOIDs[i] != pgtype.Int4OID {
				return nil, nil, false
			}
			buf = binary.BigEndian.AppendUint32(buf, uint32(v))
			w.formats[i] = pgx.BinaryFormatCode
		case string:
			if sd.ParamOIDs[i] != pgtype.TextOID {
				return nil, nil, false
			}
			buf = append(buf, v...)
			w.formats[i] = pgx.TextFormatCode
		default:
			return nil, nil, false
		}
		ends[i] = len(buf)
	}
	start := 0
	for i := range args {
		w.params[i] = buf[start:ends[i]:ends[i]]
		start = ends[i]
	}
	return w.params[:len(args)], w.formats[:len(args)], true
}

// pgxRow is queryRow through pgx.
func pgxRow(ctx context.Context, conn *pgx.Conn, sql string, args []any, dest []*bool) error {
	rows, err := conn.Query(ctx, sql, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	scan := make([]any, max(len(rows.FieldDescriptions()), len(dest)))
	for i, d := range dest {
		if d != nil {
			scan[i] = d
		}
	}
	if err := rows.Scan(scan...); err != nil {
		return err
	}
	rows.Close()
	return rows.Err()
}

// stmtCtx returns the context a statement runs on: the caller's, for an
// acquire's context. pgx watches a statement's context when it can end;
// watching the caller's context alone costs no more than raw pgx does.
func stmtCtx(ctx context.Context) context.Context {
	if a, ok := ctx.(*acquireContext); ok {
		return a.stmt
	}
	return ctx
}

// closingContext has the values of a context that never ends, and ends
// when the Client closes, with ErrClosed as its cause.
type closingContext struct {
	values  context.Context
	closing context.Context
}
