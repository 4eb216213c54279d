package core

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// What a backend holds, and the statements that change it
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
func (s *Session) take(ctx context.Context, r Request) (*Lock, error) {
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
		if !ErrorIsLoss(err) && !errors.Is(err, ErrRoute) {
			// The statement's error, not the backend's: a deadlock or a
			// cancel ended this acquire, and the backend's other locks
			// live.
			err = PgError("acquire", err)
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
func (s *Session) reserve(ctx context.Context, r Request) ([]Key, error) {
	for {
		s.State.Lock()
		if s.err != nil {
			s.State.Unlock()
			return nil, s.err
		}
		var busy, waitsSet chan struct{}
		for _, k := range r.keys {
			if h := s.Holds[k]; h != nil && h.Busy != nil {
				if r.try && !r.mayWait {
					if h.waits {
						// Another acquire waits on the server for the
						// key here, as long as it takes: a try does not
						// wait for that.
						s.State.Unlock()
						return nil, Errorf("%w: another acquire of this backend waits for it on the server", ErrLocked)
					}
					// The statement in flight may yet start to wait.
					if h.WaitsSet == nil {
						h.WaitsSet = make(chan struct{})
					}
					waitsSet = h.WaitsSet
				}
				busy = h.Busy
				break
			}
		}
		if busy == nil {
			need, err := s.needs(r)
			if err != nil {
				s.State.Unlock()
				return nil, err
			}
			for _, k := range r.keys {
				if h := s.Holds[k]; h != nil {
					h.n++
					h.joins++
					continue
				}
				s.Holds[k] = &keyHold{shared: r.shared, Busy: make(chan struct{})}
			}
			s.State.Unlock()
			return need, nil
		}
		s.State.Unlock()
		select {
		case <-busy:
		case <-waitsSet: // look again: it waits
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		case <-s.done:
			return nil, s.Err()
		}
	}
}

// lockKeys takes the reserved keys on the server, in order, chunk by chunk.
// It reports false if a try found a key held elsewhere.
func (s *Session) lockKeys(ctx context.Context, need []Key, r Request) (bool, error) {
	for _, chunk := range Chunked(need) {
		if !r.try {
			if r.direct && len(need) == 1 {
				// A key contended a moment ago: one statement tries it
				// and, if it is held, waits for it, and says which (the
				// Client does not report contention, see
				// watchesContention).
				s.markWaits(chunk)
				waited, err := s.tryThenWait(ctx, chunk[0], r.shared)
				if err != nil {
					return false, err
				}
				if waited {
					s.c.Contention.Note(chunk[0])
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
			s.markWaits(chunk)
			if err := s.Block(ctx, s.lockStatement(chunk, r.shared)); err != nil {
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

// markWaits records that the statement about to be sent for keys, which
// the caller reserved (busy), waits for them on the server: a try of one
// of them answers ErrLocked instead of waiting for that (see reserve).
func (s *Session) markWaits(keys []Key) {
	s.State.Lock()
	for _, k := range keys {
		if h := s.Holds[k]; h != nil && h.Busy != nil {
			h.waits = true
			if h.WaitsSet != nil {
				close(h.WaitsSet)
				h.WaitsSet = nil
			}
		}
	}
	s.State.Unlock()
}

// tryKeys tries keys (at most one chunk) in order, without waiting. It
// reports false if a key is held elsewhere; for more than one key, the
// keys before it stay taken.
func (s *Session) tryKeys(ctx context.Context, chunk []Key, shared bool) (bool, error) {
	var failed int32
	var err error
	if len(chunk) == 1 {
		var ok bool
		ok, err = s.CallKey(ctx, LockFunc(shared, true), chunk[0])
		if !ok {
			failed = 1
		}
	} else {
		sql, args := TrySQL(LockFunc(shared, true), chunk, s.Pid)
		err = s.Run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
			return s.WrongBackend(conn.QueryRow(ctx, sql, args...).Scan(&failed))
		})
	}
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
	sql, bare, args := TryThenWaitSQL(k, shared, s.Pid)
	err = s.Block(ctx, BlockingStatement{
		Sql:   sql,
		bare:  bare,
		Args:  args,
		Locks: 1,
		Run: func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error {
			var free bool
			err := s.QueryRow(ctx, conn, sql, args, nil, &free)
			waited = err == nil && !free
			return s.WrongBackend(err)
		},
		Undo: func(ctx context.Context, conn *pgx.Conn) error {
			return s.unlockStatement(ctx, conn, []Key{k}, shared, false)
		},
	})
	return waited, err
}

// lockStatement takes keys (at most one chunk), waiting until they are
// free. A slice that ends without them may still have taken some (the
// keys before the one it waited for, or even that one: the server can
// grant a lock and report the lock timeout when the holder frees it at
// the last moment), so its undo releases them all, as far as they were
// taken: the backend held none of them before, so its count of each key
// is 0 again afterwards.
func (s *Session) lockStatement(keys []Key, shared bool) BlockingStatement {
	sql, args := WaitSQL(LockFunc(shared, false), keys, s.Pid)
	return BlockingStatement{
		Sql:   sql,
		Args:  args,
		Locks: len(keys),
		Run: func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error {
			if len(keys) == 1 {
				return s.WrongBackend(s.QueryRow(ctx, conn, sql, args))
			}
			tag, err := conn.Exec(ctx, sql, args...)
			if err == nil && tag.RowsAffected() == 0 {
				err = s.WrongBackend(pgx.ErrNoRows)
			}
			return err
		},
		Undo: func(ctx context.Context, conn *pgx.Conn) error {
			return s.unlockStatement(ctx, conn, keys, shared, false)
		},
	}
}

// settle records that the reserved keys are now held by l.
func (s *Session) settle(need []Key, l *Lock) error {
	s.State.Lock()
	defer s.State.Unlock()
	now := time.Now()
	for _, k := range need {
		h := s.Holds[k]
		h.n, h.since, h.waits, h.WaitsSet = 1, now, false, nil
		close(h.Busy)
		h.Busy = nil
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
func (s *Session) undo(ctx context.Context, r Request, need []Key, nothingTaken bool) {
	ctx, cancel := WithoutCancel(ctx, s.c.Cfg.LossDeadline)
	defer cancel()
	var err error
	if len(need) > 0 && !nothingTaken && s.Err() == nil {
		err = s.unlockKeys(ctx, need, r.shared, false)
	}
	s.ForgetKeys(need)
	if err != nil {
		s.Lose(Errorf("release after failed acquire: %w", err))
		return
	}
	joined := make([]Key, 0, len(r.keys)-len(need))
	for _, k := range r.keys {
		if !ContainsKey(need, k) {
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
	s.State.Lock()
	var free []Key
	for _, k := range keys {
		h := s.Holds[k]
		switch {
		case h == nil:
		case h.n > 1:
			h.n--
		default:
			h.n = 0
			h.Busy = make(chan struct{})
			free = append(free, k)
		}
	}
	s.State.Unlock()
	if len(free) == 0 {
		return false, nil
	}
	return true, s.releaseFree(ctx, free, shared)
}

// releaseFree releases on the server the keys that releaseHold marked.
func (s *Session) releaseFree(ctx context.Context, free []Key, shared bool) error {
	err := s.unlockKeys(ctx, free, shared, true)
	s.ForgetKeys(free)
	if err != nil {
		s.Lose(err)
		if e := s.Err(); e != nil {
			return e
		}
	}
	return err
}

// ForgetKeys drops busy keys whose statement has ended and that the
// backend no longer holds, and wakes whoever waits for them.
func (s *Session) ForgetKeys(keys []Key) {
	s.State.Lock()
	for _, k := range keys {
		h := s.Holds[k]
		delete(s.Holds, k)
		close(h.Busy)
	}
	empty := len(s.Holds) == 0 && s.managed
	s.State.Unlock()
	if empty {
		s.c.backendFreed()
	}
}

// unlockKeys releases keys on the server, taking the connection for each
// chunk. strict makes a key the server did not hold an error wrapping
// ErrNotHeld: the session's picture of its locks would be wrong.
func (s *Session) unlockKeys(ctx context.Context, keys []Key, shared, strict bool) error {
	if len(keys) == 1 {
		ok, err := s.CallKey(ctx, UnlockFunc(shared), keys[0])
		if err == nil && strict && !ok {
			err = errNotHeldBy(keys[0], s.Pid)
		}
		return err
	}
	for _, chunk := range Chunked(keys) {
		err := s.Run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
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
	sql, args := UnlockSQL(UnlockFunc(shared), keys, s.Pid)
	var one [1]bool
	ok := one[:]
	if len(keys) == 1 {
		if err := s.WrongBackend(s.QueryRow(ctx, conn, sql, args, &one[0])); err != nil {
			return err
		}
	} else {
		ok = make([]bool, len(keys))
		dest := make([]any, len(keys))
		for i := range ok {
			dest[i] = &ok[i]
		}
		if err := s.WrongBackend(conn.QueryRow(ctx, sql, args...).Scan(dest...)); err != nil {
			return err
		}
	}
	for i, k := range keys {
		if strict && !ok[i] {
			return errNotHeldBy(k, s.Pid)
		}
	}
	return nil
}

// WrongBackend turns "no row" from a statement guarded by
// WHERE pg_backend_pid() = <the session's pid> into ErrTransactionPooling:
// the statement ran on another backend, and did nothing there.
func (s *Session) WrongBackend(err error) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return Errorf("%w: a statement of backend %d ran on another backend (and did nothing there)", ErrTransactionPooling, s.Pid)
	}
	return err
}

func ContainsKey(keys []Key, k Key) bool {
	for _, x := range keys {
		if x == k {
			return true
		}
	}
	return false
}

// maxKeysPerStatement bounds the keys one statement takes or releases:
// PostgreSQL allows at most 1664 select-list entries, and pgx 65535
// parameters. Larger sets take one round trip per chunk, in order.
const MaxKeysPerStatement = 1000

// Chunked yields keys in order, in chunks of at most maxKeysPerStatement.
func Chunked(keys []Key) iter.Seq2[int, []Key] {
	return func(yield func(int, []Key) bool) {
		i := 0
		for chunk := range slices.Chunk(keys, MaxKeysPerStatement) {
			if !yield(i, chunk) {
				return
			}
			i++
		}
	}
}

// SelectKeys writes "fn(k1), fn(k2), ..." and appends the keys' values.
func SelectKeys(b *strings.Builder, fn string, keys []Key, args []any) []any {
	for i, k := range keys {
		if i > 0 {
			b.WriteString(", ")
		}
		var list string
		list, args = k.SqlArgs(len(args)+1, args)
		b.WriteString(fn)
		b.WriteByte('(')
		b.WriteString(list)
		b.WriteByte(')')
	}
	return args
}

// Guard appends the backend check.
func Guard(b *strings.Builder, args []any, pid int32) (string, []any) {
	args = append(args, pid)
	fmt.Fprintf(b, " WHERE pg_backend_pid() = $%d", len(args))
	return b.String(), args
}

// LockSQL applies fn to each key in order, with no backend check: for
// transaction-level locks, which need none.
func LockSQL(fn string, keys []Key) (string, []any) {
	var b strings.Builder
	b.WriteString("SELECT ")
	args := SelectKeys(&b, fn, keys, make([]any, 0, 2*len(keys)))
	return b.String(), args
}

// UnlockSQL releases keys: one boolean column per key.
func UnlockSQL(fn string, keys []Key, pid int32) (string, []any) {
	if len(keys) == 1 {
		return SingleKeySQL(fn, selectForm, keys[0], pid)
	}
	var b strings.Builder
	b.WriteString("SELECT ")
	args := SelectKeys(&b, fn, keys, make([]any, 0, 2*len(keys)+1))
	return Guard(&b, args, pid)
}

// TrySQL tries keys in order. For one key it returns one boolean; for more
// it stops at the first key it cannot take and returns that key's 1-based
// position, or 0 if it took them all (CASE evaluates its conditions in
// order, and only as far as needed).
func TrySQL(fn string, keys []Key, pid int32) (string, []any) {
	if len(keys) == 1 {
		return SingleKeySQL(fn, selectForm, keys[0], pid)
	}
	var b strings.Builder
	args := TryCase(&b, fn, keys, make([]any, 0, 2*len(keys)+1))
	return Guard(&b, args, pid)
}

// TryCase writes to b the statement that tries keys in order with fn and
// returns args with the keys' arguments added. CASE evaluates its WHEN
// conditions in order and only as far as needed (PostgreSQL documents
// this), so it stops at the first key it cannot take and returns that
// key's 1-based position, or 0 if it took them all:
//
//	SELECT CASE WHEN NOT pg_try_advisory_lock($1::int8) THEN 1 WHEN NOT ... THEN 2 ELSE 0 END
func TryCase(b *strings.Builder, fn string, keys []Key, args []any) []any {
	b.WriteString("SELECT CASE")
	for i, k := range keys {
		var list string
		list, args = k.SqlArgs(len(args)+1, args)
		fmt.Fprintf(b, " WHEN NOT %s(%s) THEN %d", fn, list, i+1)
	}
	b.WriteString(" ELSE 0 END")
	return args
}

// WaitSQL takes keys, waiting at most the lock_timeout given as the last
// argument (milliseconds, as text; set for this statement's transaction
// only) before failing with SQLSTATE 55P03. The caller fills that argument
// in.
func WaitSQL(fn string, keys []Key, pid int32) (string, []any) {
	if len(keys) == 1 {
		sql, args := SingleKeySQL(fn, waitForm, keys[0], pid)
		return sql, append(args, "")
	}
	var b strings.Builder
	b.WriteString("SELECT set_config('lock_timeout', $%d, true), ")
	args := SelectKeys(&b, fn, keys, make([]any, 0, 2*len(keys)+2))
	sql, args := Guard(&b, args, pid)
	return fmt.Sprintf(sql, len(args)+1), append(args, "")
}

// TryThenWaitSQL takes one key: it tries the key and, only if that
// fails, waits for it at most the lock_timeout given as the last argument
// (which the caller fills in). Its second column is true if the try took
// the key, false if the statement waited. bare is the same statement
// without the setting of lock_timeout (see blockingStatement.bare).
func TryThenWaitSQL(k Key, shared bool, pid int32) (sql, bare string, args []any) {
	_, _, pair := k.Pair()
	slot := &tryThenWaitTexts[B2i(shared)][B2i(pair)]
	texts := slot.Load()
	if texts == nil {
		list, args := k.SqlArgs(1, nil)
		format := "SELECT %s, CASE WHEN %s(%s) THEN true ELSE %s(%s) IS NULL END WHERE pg_backend_pid() = $%d"
		setting := fmt.Sprintf("set_config('lock_timeout', $%d, true)", len(args)+2)
		texts = &[2]string{
			fmt.Sprintf(format, setting, LockFunc(shared, true), list, LockFunc(shared, false), list, len(args)+1),
			fmt.Sprintf(format, "NULL", LockFunc(shared, true), list, LockFunc(shared, false), list, len(args)+1),
		}
		slot.Store(texts)
	}
	if a, b, pair := k.Pair(); pair {
		return texts[0], texts[1], []any{a, b, pid, ""}
	}
	return texts[0], texts[1], []any{k.V, pid, ""}
}

// tryThenWaitTexts caches tryThenWaitSQL's texts, by mode (shared) and
// key form (pair).
var tryThenWaitTexts [2][2]atomic.Pointer[[2]string]

// SingleKeySQL builds the statement for one key from a cache: the common
// case builds no SQL. format has a %s for the key's call and guard, and
// may have a %d before it for the number of the argument after them.
func SingleKeySQL(fn, format string, k Key, pid int32) (string, []any) {
	_, _, pair := k.Pair()
	var slot *atomic.Pointer[string]
	if f, ff := slices.Index(KeyFuncs[:], fn), slices.Index(SingleKeyForms[:], format); f >= 0 && ff >= 0 {
		slot = &SingleKeyTexts[f][ff][B2i(pair)]
	}
	var sql *string
	if slot != nil {
		sql = slot.Load()
	}
	if sql == nil {
		var b strings.Builder
		args := SelectKeys(&b, fn, []Key{k}, nil)
		text, args := Guard(&b, args, pid)
		if strings.Contains(format, "%d") {
			text = fmt.Sprintf(format, len(args)+1, text)
		} else {
			text = fmt.Sprintf(format, text)
		}
		sql = &text
		if slot != nil {
			slot.Store(sql)
		}
	}
	if a, b, pair := k.Pair(); pair {
		return *sql, []any{a, b, pid}
	}
	return *sql, []any{k.V, pid}
}

// keyFuncs are the advisory lock functions of one key that the lock core
// calls, and singleKeyForms the statements singleKeySQL puts one call in;
// singleKeyTexts caches the texts of each, by key form (pair), built on
// first use. (A function or form not listed is built every time.)
var (
	KeyFuncs = [...]string{
		"pg_try_advisory_lock", "pg_try_advisory_lock_shared",
		"pg_advisory_lock", "pg_advisory_lock_shared",
		"pg_advisory_unlock", "pg_advisory_unlock_shared",
	}
	SingleKeyForms = [...]string{selectForm, waitForm}
	SingleKeyTexts [len(KeyFuncs)][len(SingleKeyForms)][2]atomic.Pointer[string]
)

// The forms of singleKeySQL: the call alone, and the call after the
// setting of the statement's lock_timeout (waitSQL).
const (
	selectForm = "SELECT %s"
	waitForm   = "SELECT set_config('lock_timeout', $%d, true), %s"
)

// B2i is 1 for true and 0 for false.
func B2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

func LockFunc(shared, try bool) string {
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

func UnlockFunc(shared bool) string {
	if shared {
		return "pg_advisory_unlock_shared"
	}
	return "pg_advisory_unlock"
}

// SqlArgs returns the SQL argument list text for k starting at placeholder
// $n, and appends k's values to args: "$n" for a bigint key, "$n, $n+1" for
// a pair key (typed so the right PostgreSQL overload is chosen).
func (k Key) SqlArgs(n int, args []any) (string, []any) {
	if k.kind == kindPair {
		a, b, _ := k.Pair()
		return fmt.Sprintf("$%d::int4, $%d::int4", n, n+1), append(args, a, b)
	}
	return fmt.Sprintf("$%d::int8", n), append(args, k.V)
}
