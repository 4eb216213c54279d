package pgcoord

import (
	"context"
	"fmt"
	"iter"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// A Lock is a held advisory lock on one or more keys. It is released once,
// by Unlock; it ends early if its session is lost, which Done and Err
// report. Its methods are safe for concurrent use.
type Lock struct {
	s      *Session
	keys   []Key // canonical order
	shared bool
	fence  int64
	since  time.Time // when the lock was granted; set only when lock events are observed

	unreported atomic.Bool // never returned by its acquire: its end is not an event

	mu        sync.Mutex
	err       error // nil while held
	releasing bool  // Unlock has begun
	gated     bool  // the lock, not its acquire, owns its keys' in-process gates
	done      chan struct{}
}

func newLock(s *Session, r request) *Lock {
	l := &Lock{s: s, keys: r.keys, shared: r.shared, done: make(chan struct{})}
	l.unreported.Store(r.internal)
	if s.c.observed() {
		l.since = time.Now()
	}
	return l
}

// Key returns the lock's key; for a lock from LockAll, the first key in
// canonical order.
func (l *Lock) Key() Key { return l.keys[0] }

// Keys returns every key of the lock in canonical order.
func (l *Lock) Keys() []Key { return append([]Key(nil), l.keys...) }

// Fence returns the fencing token issued when the lock was taken with
// [WithFence], or 0 if none was asked for.
func (l *Lock) Fence() Term { return Term(l.fence) }

// Done returns a channel that is closed when the lock ends: by Unlock, by
// the end of its session or Client, or by loss.
func (l *Lock) Done() <-chan struct{} { return l.done }

// Err returns nil while the lock is held. After Done is closed it returns
// an error wrapping [ErrLockLost] (and the cause) if the lock was lost,
// [ErrClosed] if its session or Client was closed, or [ErrNotHeld] if it
// was released by Unlock.
func (l *Lock) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

// finish records why the lock ended and closes Done. It reports whether
// this call ended the lock.
func (l *Lock) finish(why error) bool { return l.finishThen(why, nil) }

// finishThen is finish that runs then, if this call ends the lock, before
// Done closes; then learns whether the lock owned its keys' gates when it
// ended (see claimGates).
func (l *Lock) finishThen(why error, then func(gated bool)) bool {
	l.mu.Lock()
	if l.err != nil {
		l.mu.Unlock()
		return false
	}
	l.err = why
	gated := l.gated
	l.mu.Unlock()
	if then != nil {
		then(gated)
	}
	close(l.done)
	return true
}

// end finishes the lock and lets the next goroutine of this Client at its
// keys. The keys' gates are left before Done closes, so a caller that sees
// Done closed can take the keys again in this process at once. A lock that
// ends before its acquire has handed it over (claimGates) leaves the gates
// to the acquire.
func (l *Lock) end(why error) {
	l.finishThen(why, func(gated bool) {
		if !gated {
			return
		}
		for _, k := range l.keys {
			l.s.c.gates.leave(k, l.shared)
		}
	})
}

// claimGates makes l, about to be returned by its acquire, the owner of its
// keys' gates. It reports false if l has ended already: the gates are
// still the acquire's to leave.
func (l *Lock) claimGates() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.gated = l.err == nil
	return l.gated
}

// Unlock releases the lock. It works even if ctx is already cancelled: the
// release is sent with a context that keeps ctx's values and is bounded by
// the loss deadline. When Unlock returns nil the lock is released: its keys
// are free on the server, unless another goroutine of the same Client was
// waiting for the key and the lock was handed to it directly (see
// [WithHandoff]). If a blocking acquire waits on the same connection,
// Unlock interrupts it (the acquire then resumes) rather than wait for it.
// A shared lock whose hold other handles of the Client still share on the
// same connection is not released on the server; Unlock then proves the
// connection's backend alive with one round trip, so that nil also means
// the backend held the keys until the call (a backend that had ended
// unnoticed makes Unlock return an error wrapping [ErrLockLost]).
//
// It returns an error wrapping [ErrNotHeld] if the lock was already
// released or is being released by another call, an error wrapping
// [ErrLockLost] or [ErrClosed] if it had ended otherwise, and an error
// wrapping [ErrLockLost] if the release itself failed; in that case the
// connection has been closed, so the server frees the keys as soon as it
// notices.
func (l *Lock) Unlock(ctx context.Context) error {
	l.mu.Lock()
	if l.err != nil || l.releasing {
		err := l.err
		l.mu.Unlock()
		if err == nil {
			err = errorf("%w: another Unlock is releasing it", ErrNotHeld)
		}
		return errorf("unlock %s: %w", keyList(l.keys), err)
	}
	l.releasing = true
	l.mu.Unlock()

	s := l.s
	if s.c.handoff(l) {
		l.released(true, nil)
		return nil
	}
	s.state.Lock()
	_, mine := s.locks[l]
	delete(s.locks, l)
	s.state.Unlock()
	if !mine {
		// The session ended meanwhile and is ending this lock.
		<-l.done
		return errorf("unlock %s: %w", keyList(l.keys), l.Err())
	}
	// The release is bounded by the session's lease: with no answer
	// from the server for the loss deadline, the session is lost and its
	// connection closed, which ends the statement.
	sent, err := s.releaseHold(context.WithoutCancel(ctx), l.keys, l.shared)
	if err == nil && !sent {
		// Other handles still hold the keys here, so nothing was sent.
		// The backend may have ended unnoticed (terminated, its
		// connection broken) since it last answered: a ping proves it
		// still holds them, else the session is lost and so is l.
		err = s.run(context.WithoutCancel(ctx), s.ping)
		if err != nil {
			s.lose(errorf("unlock: %w", err))
			if e := s.Err(); e != nil {
				err = e
			}
		}
	}
	l.end(ErrNotHeld)
	l.released(false, err)
	if err != nil {
		return errorf("unlock %s: %w", keyList(l.keys), err)
	}
	return nil
}

// maxKeysPerStatement bounds the keys one statement takes or releases:
// PostgreSQL allows at most 1664 select-list entries, and pgx 65535
// parameters. Larger sets take one round trip per chunk, in order.
const maxKeysPerStatement = 1000

// chunked yields keys in order, in chunks of at most maxKeysPerStatement.
func chunked(keys []Key) iter.Seq2[int, []Key] {
	return func(yield func(int, []Key) bool) {
		i := 0
		for chunk := range slices.Chunk(keys, maxKeysPerStatement) {
			if !yield(i, chunk) {
				return
			}
			i++
		}
	}
}

// The statements below end with WHERE pg_backend_pid() = <the session's
// backend>. Without FROM, that condition is evaluated once, before the
// select list, so on any other backend (behind a transaction-pooling proxy)
// the statement returns no row and does nothing. The select list is
// evaluated left to right, so keys are taken in the order given.

// selectKeys writes "fn(k1), fn(k2), ..." and appends the keys' values.
func selectKeys(b *strings.Builder, fn string, keys []Key, args []any) []any {
	for i, k := range keys {
		if i > 0 {
			b.WriteString(", ")
		}
		var list string
		list, args = k.sqlArgs(len(args)+1, args)
		b.WriteString(fn)
		b.WriteByte('(')
		b.WriteString(list)
		b.WriteByte(')')
	}
	return args
}

// guard appends the backend check.
func guard(b *strings.Builder, args []any, pid int32) (string, []any) {
	args = append(args, pid)
	fmt.Fprintf(b, " WHERE pg_backend_pid() = $%d", len(args))
	return b.String(), args
}

// lockSQL applies fn to each key in order, with no backend check: for
// transaction-level locks, which need none.
func lockSQL(fn string, keys []Key) (string, []any) {
	var b strings.Builder
	b.WriteString("SELECT ")
	args := selectKeys(&b, fn, keys, make([]any, 0, 2*len(keys)))
	return b.String(), args
}

// unlockSQL releases keys: one boolean column per key.
func unlockSQL(fn string, keys []Key, pid int32) (string, []any) {
	if len(keys) == 1 {
		return singleKeySQL(fn, "SELECT %s", keys[0], pid)
	}
	var b strings.Builder
	b.WriteString("SELECT ")
	args := selectKeys(&b, fn, keys, make([]any, 0, 2*len(keys)+1))
	return guard(&b, args, pid)
}

// trySQL tries keys in order. For one key it returns one boolean; for more
// it stops at the first key it cannot take and returns that key's 1-based
// position, or 0 if it took them all (CASE evaluates its conditions in
// order, and only as far as needed).
func trySQL(fn string, keys []Key, pid int32) (string, []any) {
	if len(keys) == 1 {
		return singleKeySQL(fn, "SELECT %s", keys[0], pid)
	}
	var b strings.Builder
	args := make([]any, 0, 2*len(keys)+1)
	b.WriteString("SELECT CASE")
	for i, k := range keys {
		var list string
		list, args = k.sqlArgs(len(args)+1, args)
		fmt.Fprintf(&b, " WHEN NOT %s(%s) THEN %d", fn, list, i+1)
	}
	b.WriteString(" ELSE 0 END")
	return guard(&b, args, pid)
}

// waitSQL takes keys, waiting at most the lock_timeout given as the last
// argument (milliseconds, as text; set for this statement's transaction
// only) before failing with SQLSTATE 55P03. The caller fills that argument
// in.
func waitSQL(fn string, keys []Key, pid int32) (string, []any) {
	if len(keys) == 1 {
		sql, args := singleKeySQL(fn, "SELECT set_config('lock_timeout', $%d, true), %s", keys[0], pid)
		return sql, append(args, "")
	}
	var b strings.Builder
	b.WriteString("SELECT set_config('lock_timeout', $%d, true), ")
	args := selectKeys(&b, fn, keys, make([]any, 0, 2*len(keys)+2))
	sql, args := guard(&b, args, pid)
	return fmt.Sprintf(sql, len(args)+1), append(args, "")
}

// tryThenWaitSQL takes one key: it tries the key and, only if that
// fails, waits for it at most the lock_timeout given as the last argument
// (which the caller fills in). Its second column is true if the try took
// the key, false if the statement waited. bare is the same statement
// without the setting of lock_timeout (see blockingStatement.bare).
func tryThenWaitSQL(k Key, shared bool, pid int32) (sql, bare string, args []any) {
	_, _, pair := k.Pair()
	ck := singleKey{"try-then-wait", lockFunc(shared, false), pair}
	texts, ok := singleKeyCache.Load(ck)
	if !ok {
		list, args := k.sqlArgs(1, nil)
		format := "SELECT %s, CASE WHEN %s(%s) THEN true ELSE %s(%s) IS NULL END WHERE pg_backend_pid() = $%d"
		setting := fmt.Sprintf("set_config('lock_timeout', $%d, true)", len(args)+2)
		texts, _ = singleKeyCache.LoadOrStore(ck, [2]string{
			fmt.Sprintf(format, setting, lockFunc(shared, true), list, lockFunc(shared, false), list, len(args)+1),
			fmt.Sprintf(format, "NULL", lockFunc(shared, true), list, lockFunc(shared, false), list, len(args)+1),
		})
	}
	t := texts.([2]string)
	if a, b, pair := k.Pair(); pair {
		return t[0], t[1], []any{a, b, pid, ""}
	}
	return t[0], t[1], []any{k.v, pid, ""}
}

// singleKeySQL builds the statement for one key from a cache: the common
// case builds no SQL. format has a %s for the key's call and guard, and
// may have a %d before it for the number of the argument after them.
func singleKeySQL(fn, format string, k Key, pid int32) (string, []any) {
	_, _, pair := k.Pair()
	ck := singleKey{fn, format, pair}
	sql, ok := singleKeyCache.Load(ck)
	if !ok {
		var b strings.Builder
		args := selectKeys(&b, fn, []Key{k}, nil)
		text, args := guard(&b, args, pid)
		if strings.Contains(format, "%d") {
			sql, _ = singleKeyCache.LoadOrStore(ck, fmt.Sprintf(format, len(args)+1, text))
		} else {
			sql, _ = singleKeyCache.LoadOrStore(ck, fmt.Sprintf(format, text))
		}
	}
	if a, b, pair := k.Pair(); pair {
		return sql.(string), []any{a, b, pid}
	}
	return sql.(string), []any{k.v, pid}
}

type singleKey struct {
	fn, format string
	pair       bool
}

var singleKeyCache sync.Map

func lockFunc(shared, try bool) string {
	switch {
	case shared && try:
		return "pg_try_advisory_lock_shared"
	case shared:
		return "pg_advisory_lock_shared"
	case try:
		return "pg_try_advisory_lock"
	}
	return "pg_advisory_lock"
}

func unlockFunc(shared bool) string {
	if shared {
		return "pg_advisory_unlock_shared"
	}
	return "pg_advisory_unlock"
}

func keyList(keys []Key) string {
	if len(keys) == 1 {
		return keys[0].String()
	}
	const shown = 4
	s := make([]string, 0, shown+1)
	for _, k := range keys[:min(len(keys), shown)] {
		s = append(s, k.String())
	}
	if len(keys) > shown {
		s = append(s, fmt.Sprintf("and %d more", len(keys)-shown))
	}
	return "[" + strings.Join(s, " ") + "]"
}
