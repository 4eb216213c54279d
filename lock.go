package pgcoord

import (
	"context"
	"fmt"
	"github.com/jackc/pgx/v5"
	"iter"
	"slices"
	"strings"
	"sync"
)

// A Lock is a held advisory lock on one or more keys. It is released once,
// by Unlock; it ends early if its session is lost, which Done and Err
// report. Its methods are safe for concurrent use.
type Lock struct {
	s      *Session
	keys   []Key // canonical order
	shared bool
	fence  int64

	mu   sync.Mutex
	err  error // nil while held
	done chan struct{}
}

// Key returns the lock's key; for a lock from LockAll, the first key in
// canonical order.
func (l *Lock) Key() Key { return l.keys[0] }

// Keys returns every key of the lock in canonical order.
func (l *Lock) Keys() []Key { return append([]Key(nil), l.keys...) }

// Fence returns the fencing token issued when the lock was taken with
// [WithFence], or 0 if none was asked for.
func (l *Lock) Fence() int64 { return l.fence }

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

// end records why the lock ended, closes Done and lets the next goroutine
// of this Client at the keys. It reports whether this call ended the lock.
func (l *Lock) end(why error) bool {
	l.mu.Lock()
	if l.err != nil {
		l.mu.Unlock()
		return false
	}
	l.err = why
	close(l.done)
	l.mu.Unlock()
	for _, k := range l.keys {
		l.s.c.gates.leave(k, l.shared)
	}
	return true
}

// Unlock releases the lock. It works even if ctx is already cancelled: the
// release is sent with a context that keeps ctx's values and is bounded by
// the loss deadline. When Unlock returns nil the keys are free on the
// server. It returns [ErrNotHeld] if the lock was already released, an
// error wrapping [ErrLockLost] or [ErrClosed] if it had ended otherwise,
// and an error wrapping [ErrLockLost] if the release itself failed; in that
// case the connection has been closed, so the server frees the keys as soon
// as it notices.
func (l *Lock) Unlock(ctx context.Context) error {
	s := l.s
	if err := l.Err(); err != nil {
		return fmt.Errorf("pgcoord: unlock %s: %w", keyList(l.keys), err)
	}
	// Remove the handle first, so that a concurrent loss does not end it
	// twice; the keys this backend no longer needs are released below.
	s.state.Lock()
	if _, ok := s.locks[l]; !ok {
		s.state.Unlock()
		return fmt.Errorf("pgcoord: unlock %s: %w", keyList(l.keys), l.Err())
	}
	delete(s.locks, l)
	free := s.forget(l.keys)
	s.state.Unlock()

	ctx, cancel := withoutCancel(ctx, s.c.cfg.lossDeadline)
	defer cancel()
	err := s.unlock(ctx, free, l.shared)
	if err != nil {
		s.lose(err)
		err = fmt.Errorf("pgcoord: unlock %s: %w", keyList(l.keys), s.Err())
	}
	l.end(ErrNotHeld)
	if s.managed {
		s.c.giveBack(s)
	}
	return err
}

// forget drops one holder of each key and returns the keys that no handle
// holds any more. Callers hold s.state.
func (s *Session) forget(keys []Key) []Key {
	var free []Key
	for _, k := range keys {
		n, ok := s.held[k]
		switch {
		case !ok:
		case n > 1:
			s.held[k] = n - 1
		default:
			delete(s.held, k)
			free = append(free, k)
		}
	}
	return free
}

// unlock releases keys on the server. Every key must come back released:
// one that does not means the backend did not hold it, and the session's
// picture of its locks is wrong.
func (s *Session) unlock(ctx context.Context, keys []Key, shared bool) error {
	for _, chunk := range chunked(keys) {
		sql, args := lockSQL(unlockFunc(shared), chunk)
		ok := make([]bool, len(chunk))
		dest := make([]any, len(chunk))
		for i := range ok {
			dest[i] = &ok[i]
		}
		err := s.run(ctx, false, func(ctx context.Context, conn *pgx.Conn) error {
			return conn.QueryRow(ctx, sql, args...).Scan(dest...)
		})
		if err != nil {
			return err
		}
		for i, k := range chunk {
			if !ok[i] {
				return fmt.Errorf("%w: the server did not hold %s for backend %d", ErrNotHeld, k, s.pid)
			}
		}
	}
	return nil
}

// releaseAfterError makes sure a failed acquire leaves nothing behind:
// PostgreSQL may have granted keys before the cancel or error was
// processed. Keys the backend did not hold come back false and are
// ignored. If even that fails, the session is lost, which frees
// everything.
func (s *Session) releaseAfterError(ctx context.Context, keys []Key, shared bool) {
	if s.Err() != nil || len(keys) == 0 {
		return
	}
	ctx, cancel := withoutCancel(ctx, s.c.cfg.lossDeadline)
	defer cancel()
	for _, chunk := range chunked(keys) {
		sql, args := lockSQL(unlockFunc(shared), chunk)
		err := s.run(ctx, false, func(ctx context.Context, conn *pgx.Conn) error {
			_, err := conn.Exec(ctx, sql, args...)
			return err
		})
		if err != nil {
			s.lose(fmt.Errorf("release after failed acquire: %w", err))
			return
		}
	}
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

// lockSQL builds one statement that applies fn to each key in order, with
// one result column per key. PostgreSQL evaluates a select list left to
// right, so keys are taken in the order given.
func lockSQL(fn string, keys []Key) (string, []any) {
	if len(keys) == 1 {
		if sql, ok := singleKeySQL[fn]; ok {
			k := keys[0]
			if a, b, pair := k.Pair(); pair {
				return sql[1], []any{a, b}
			}
			return sql[0], []any{k.v}
		}
	}
	var b strings.Builder
	b.WriteString("SELECT ")
	args := make([]any, 0, 2*len(keys))
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
	return b.String(), args
}

// singleKeySQL holds the statements for one key, bigint and pair, of every
// lock function: the common case builds no SQL at all.
var singleKeySQL = func() map[string][2]string {
	m := make(map[string][2]string)
	for _, fn := range []string{
		"pg_advisory_lock", "pg_advisory_lock_shared", "pg_try_advisory_lock", "pg_try_advisory_lock_shared",
		"pg_advisory_unlock", "pg_advisory_unlock_shared",
	} {
		m[fn] = [2]string{"SELECT " + fn + "($1::int8)", "SELECT " + fn + "($1::int4, $2::int4)"}
	}
	return m
}()

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
