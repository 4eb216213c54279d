package core

import (
	"cmp"
	"context"
	"runtime"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Statements of several goroutines in one
//
// A try or a release of one key is one statement and one round trip, and
// a backend runs one statement at a time: while it runs, every other
// statement for that backend waits. When goroutines send such statements to
// one backend at once, the first sends its own at once, and those that
// come while the connection is busy queue; when it is free, the first of
// them sends the whole queue as one statement, one call per key in the
// select list (the server evaluates them in turn), and each caller gets the
// answer for its own key. The server's cost is per statement more than per
// key, so a busy backend answers more keys per second, not fewer. A caller
// alone sends the statement it sent before, with no more work than a
// mutex.
//
// A key is in at most one statement of its backend at a time (see
// keyHold), so the keys of one combined statement are distinct and their
// order does not matter. A combined statement that fails while the session
// lives (the server's lock table is full, say) may have done part of its
// work: session-level advisory locks ignore the statement's failure. Each
// of its keys is then settled on its own: a try's key is released (the
// backend did not hold it before) and tried again alone, and a release is
// sent again alone (the key is free afterwards either way). So one key's
// failure costs no other key its answer.

// While calls are queued or one is being sent, the combiner counts as one
// caller waiting for the connection (Session.pending), so that a blocking
// acquire on the same Session does not take the connection between two
// combined statements only to be interrupted at once: it waits, as it
// waits for any statement, until the queue is empty.

// maxKeysCombined bounds the keys of one combined statement: enough to
// carry every goroutine that queues behind a round trip, few enough that
// the statement texts stay few.
const MaxKeysCombined = 32

// KeyCall is one caller's try or release of one key.
type KeyCall struct {
	Fn    string // the function: lockFunc(shared, true) or unlockFunc(shared)
	Key   Key
	Ok    bool          // the function's answer
	Cause error         // why there is no answer
	lead  bool          // woken to send the queue
	done  chan struct{} // closed once: when answered, or woken to lead (then its own turn answers it)
}

// maxCombinedTexts bounds the combined statements a backend prepares. The
// text of one depends on how many calls of each kind it carries, so a busy
// backend meets a few of them again and again: prepared, they skip the
// server's parse and plan. Past the bound, a new text is sent unprepared.
const MaxCombinedTexts = 64

// combiner queues the key calls of one backend while one is sent.
type combiner struct {
	Busy     bool // a caller sends, or is about to
	Queue    []*KeyCall
	Combined int // statements sent that carried more than one call

	// Prepared holds the combined texts prepared on the connection (at
	// most maxCombinedTexts); only the connection's holder uses it.
	Prepared map[string]struct{}
}

// CallKey runs fn (a try, or a release) of k on the session's connection
// and returns its answer, combined with other goroutines' calls when the
// connection is busy (see above). ctx bounds the wait for the connection,
// as run's does: once its statement is sent, the call waits for the
// answer, so that the caller knows what the backend holds.
func (s *Session) CallKey(ctx context.Context, fn string, k Key) (bool, error) {
	s.State.Lock()
	if !s.Calls.Busy {
		s.Calls.Busy = true
		s.Pending++ // until the queue is empty: see passCalls
		s.State.Unlock()
		return s.sendCalls(ctx, fn, k, nil)
	}
	call := &KeyCall{Fn: fn, Key: k, done: make(chan struct{})}
	s.Calls.Queue = append(s.Calls.Queue, call)
	s.State.Unlock()
	select {
	case <-call.done:
	case <-ctx.Done():
		s.State.Lock()
		i := slices.Index(s.Calls.Queue, call)
		if i >= 0 {
			s.Calls.Queue = slices.Delete(s.Calls.Queue, i, i+1)
		}
		s.State.Unlock()
		if i >= 0 {
			return false, context.Cause(ctx) // not sent: nothing done
		}
		<-call.done
	}
	if call.lead {
		// Let the goroutines that the last statement answered run first:
		// most of them come back with their next call, which then goes
		// out with this one.
		runtime.Gosched()
		return s.sendCalls(ctx, fn, k, call)
	}
	return call.Ok, call.Cause
}

// sendCalls sends fn of k, the call of a caller whose turn it is (own, if
// it queued), together with the calls queued behind it, in one statement;
// it answers them, hands the turn to the first call that queued since, and
// returns its own answer.
func (s *Session) sendCalls(ctx context.Context, fn string, k Key, own *KeyCall) (bool, error) {
	if err := s.Grab(ctx); err != nil {
		s.passCalls()
		return false, err
	}
	ctx = detached(ctx) // see run
	s.State.Lock()
	n := min(len(s.Calls.Queue), MaxKeysCombined-1)
	if n == 0 {
		s.State.Unlock()
		ok, err := s.callOne(ctx, fn, k)
		s.Release()
		s.passCalls()
		return ok, err
	}
	if own == nil {
		own = &KeyCall{Fn: fn, Key: k}
	}
	calls := make([]*KeyCall, 0, n+1)
	calls = append(append(calls, own), s.Calls.Queue[:n]...)
	s.Calls.Queue = slices.Delete(s.Calls.Queue, 0, n)
	s.Calls.Combined++
	s.State.Unlock()

	s.AnswerCalls(ctx, calls)
	s.Release()
	for _, c := range calls {
		if c != own {
			close(c.done)
		}
	}
	// Keep the turn while the goroutines just answered run: most of them
	// come back with their next call, which then queues for the next
	// combined statement instead of going out alone ahead of it.
	runtime.Gosched()
	s.passCalls()
	return own.Ok, own.Cause
}

// passCalls wakes the first queued call to send the queue, or marks the
// combiner idle.
func (s *Session) passCalls() {
	s.State.Lock()
	defer s.State.Unlock()
	if len(s.Calls.Queue) == 0 {
		s.Calls.Busy = false
		s.unpend()
		return
	}
	next := s.Calls.Queue[0]
	s.Calls.Queue = slices.Delete(s.Calls.Queue, 0, 1)
	next.lead = true
	close(next.done)
}

// AnswerCalls runs calls (more than one) in one statement while the
// caller holds the connection, and settles them one by one if that
// statement fails while the session lives.
func (s *Session) AnswerCalls(ctx context.Context, calls []*KeyCall) {
	sql, args := CombinedSQL(calls, s.Pid)
	dest := make([]any, len(calls))
	for i, c := range calls {
		dest[i] = &c.Ok
	}
	err := s.Exec(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		if !s.prepareCombined(ctx, conn, sql) {
			args = append([]any{pgx.QueryExecModeExec}, args...)
		}
		return s.WrongBackend(conn.QueryRow(ctx, sql, args...).Scan(dest...))
	})
	if err == nil {
		return
	}
	for _, c := range calls {
		c.Ok, c.Cause = s.settleCall(ctx, c)
	}
}

// prepareCombined prepares sql, a combined statement, on conn, which the
// caller holds, unless maxCombinedTexts are prepared already, and reports
// whether sql is prepared: pgx then runs it as such.
func (s *Session) prepareCombined(ctx context.Context, conn *pgx.Conn, sql string) bool {
	if _, ok := s.Calls.Prepared[sql]; ok {
		return true
	}
	if len(s.Calls.Prepared) >= MaxCombinedTexts {
		return false
	}
	if _, err := conn.Prepare(ctx, sql, sql); err != nil {
		return false // the statement, sent unprepared, reports what is wrong
	}
	if s.Calls.Prepared == nil {
		s.Calls.Prepared = make(map[string]struct{})
	}
	s.Calls.Prepared[sql] = struct{}{}
	return true
}

// settleCall answers c alone after the combined statement failed: what
// that statement did to c's key is unknown.
func (s *Session) settleCall(ctx context.Context, c *KeyCall) (bool, error) {
	if e := s.Err(); e != nil {
		return false, e
	}
	if strings.HasPrefix(c.Fn, "pg_try_") {
		// The backend did not hold the key before: one release frees it
		// if the failed statement took it.
		shared := strings.HasSuffix(c.Fn, "_shared")
		if _, err := s.callOne(ctx, UnlockFunc(shared), c.Key); err != nil {
			return false, err
		}
		return s.callOne(ctx, c.Fn, c.Key)
	}
	// The backend held the key before: after this release it does not,
	// whichever statement released it.
	if _, err := s.callOne(ctx, c.Fn, c.Key); err != nil {
		return false, err
	}
	return true, nil
}

// callOne runs fn of k alone while the caller holds the connection.
func (s *Session) callOne(ctx context.Context, fn string, k Key) (ok bool, err error) {
	sql, args := SingleKeySQL(fn, selectForm, k, s.Pid)
	err = s.Exec(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		return s.WrongBackend(s.QueryRow(ctx, conn, sql, args, &ok))
	})
	return ok, err
}

// CombinedSQL is "SELECT fn1(k1), fn2(k2), ... WHERE pg_backend_pid() =
// pid" for calls, which it sorts by function and key form so that the
// statement's text depends on how many calls of each kind it carries, not
// on their order.
func CombinedSQL(calls []*KeyCall, pid int32) (string, []any) {
	slices.SortFunc(calls, func(a, b *KeyCall) int {
		return cmp.Or(strings.Compare(a.Fn, b.Fn), cmp.Compare(a.Key.kind, b.Key.kind))
	})
	var b strings.Builder
	b.WriteString("SELECT ")
	args := make([]any, 0, 2*len(calls)+1)
	for i, c := range calls {
		if i > 0 {
			b.WriteString(", ")
		}
		var list string
		list, args = c.Key.SqlArgs(len(args)+1, args)
		b.WriteString(c.Fn)
		b.WriteByte('(')
		b.WriteString(list)
		b.WriteByte(')')
	}
	return Guard(&b, args, pid)
}
