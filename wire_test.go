package pgcoord

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync"
	"testing"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// TestQueryRowDirect runs the statements of one key through queryRow, the
// path that writes their arguments itself, and checks each answer against
// pg_locks: every argument type it writes (int8 keys at the extremes, the
// int4 halves of pair keys, the int4 pid, a text lock_timeout), a key held
// elsewhere, a pid guard that matches no backend (no row, nothing taken),
// a NULL where a boolean is scanned, and arguments it does not write
// (handed to pgx, with the same answer).
func TestQueryRowDirect(t *testing.T) {
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	ctx := t.Context()
	s, err := c.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close(context.Background()) })
	other := pgtest.Conn(t, dsn)
	var otherPID int32
	if err := other.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&otherPID); err != nil {
		t.Fatal(err)
	}
	on := func(f func(ctx context.Context, conn *pgx.Conn) error) error {
		t.Helper()
		return s.core.Run(ctx, f)
	}
	try := func(k Key, pid int32) (bool, error) {
		t.Helper()
		var ok bool
		sql, args := core.TrySQL(core.LockFunc(false, true), coreKeys([]Key{k}), pid)
		err := on(func(ctx context.Context, conn *pgx.Conn) error { return s.core.QueryRow(ctx, conn, sql, args, &ok) })
		return ok, err
	}
	unlock := func(k Key) bool {
		t.Helper()
		var ok bool
		sql, args := core.UnlockSQL(core.UnlockFunc(false), coreKeys([]Key{k}), s.core.Pid)
		if err := on(func(ctx context.Context, conn *pgx.Conn) error { return s.core.QueryRow(ctx, conn, sql, args, &ok) }); err != nil {
			t.Fatalf("unlock %v: %v", k, err)
		}
		return ok
	}

	for _, k := range []Key{
		Int64Key(math.MinInt64), Int64Key(math.MaxInt64), Int64Key(-1),
		PairKey(math.MinInt32, -1), PairKey(math.MaxInt32, 0), PairKey(-1, math.MinInt32),
	} {
		ok, err := try(k, s.core.Pid)
		if err != nil || !ok {
			t.Fatalf("try %v: %v, %v; want true", k, ok, err)
		}
		heldOnlyBy(t, dsn, k, s.core.Pid)
		if !unlock(k) {
			t.Fatalf("unlock %v: false, want true", k)
		}
		notHeld(t, dsn, k)
		if unlock(k) {
			t.Fatalf("second unlock of %v: true, want false (not held)", k)
		}
	}

	held := Int64Key(7001)
	if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1)", held.coreKey().V); err != nil {
		t.Fatal(err)
	}
	if ok, err := try(held, s.core.Pid); err != nil || ok {
		t.Fatalf("try of a key held elsewhere: %v, %v; want false", ok, err)
	}
	heldOnlyBy(t, dsn, held, otherPID)

	// A guard that matches no backend: no row, and the key is not taken.
	free := Int64Key(7002)
	if _, err := try(free, 0); !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("try with a guard for no backend: %v, want pgx.ErrNoRows", err)
	}
	notHeld(t, dsn, free)

	// A text argument: the wait for a key held elsewhere ends at its
	// lock_timeout; for a free key the try answers at once.
	ttw := func(k Key) (bool, error) {
		sql, _, args := core.TryThenWaitSQL(k.coreKey(), false, s.core.Pid)
		args[len(args)-1] = "20"
		var took bool
		err := on(func(ctx context.Context, conn *pgx.Conn) error {
			return s.core.QueryRow(ctx, conn, sql, args, nil, &took)
		})
		return took, err
	}
	if _, err := ttw(held); core.SqlState(err) != "55P03" {
		t.Fatalf("wait of 20 ms for a key held elsewhere: %v, want lock_timeout (55P03)", err)
	}
	heldOnlyBy(t, dsn, held, otherPID)
	if took, err := ttw(free); err != nil || !took {
		t.Fatalf("try-then-wait of a free key: %v, %v; want true (taken by the try)", took, err)
	}
	heldOnlyBy(t, dsn, free, s.core.Pid)
	if !unlock(free) {
		t.Fatal("unlock after try-then-wait: false")
	}

	// A NULL where a boolean is scanned is an error, not false.
	err = on(func(ctx context.Context, conn *pgx.Conn) error {
		var b bool
		return s.core.QueryRow(ctx, conn, "SELECT NULL::bool WHERE pg_backend_pid() = $1", []any{s.core.Pid}, &b)
	})
	if err == nil || !strings.Contains(err.Error(), "NULL") {
		t.Fatalf("NULL scanned as a boolean: %v, want an error naming NULL", err)
	}

	// Arguments queryRow does not write go through pgx: a float, and an
	// int64 for an int4 parameter.
	err = on(func(ctx context.Context, conn *pgx.Conn) error {
		var a, b bool
		if err := s.core.QueryRow(ctx, conn, "SELECT $1::float8 > 1, $2::int4 = 3", []any{1.5, int64(3)}, &a, &b); err != nil {
			return err
		}
		if !a || !b {
			return core.Errorf("got %v, %v; want true, true", a, b)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("arguments through pgx: %v", err)
	}

	// No column scanned: the answer is whether a row came, on both paths.
	for _, c := range []struct {
		sql  string
		args []any
		want error
	}{
		{"SELECT 1 WHERE pg_backend_pid() = $1", []any{s.core.Pid}, nil},
		{"SELECT 1 WHERE pg_backend_pid() = $1", []any{int32(0)}, pgx.ErrNoRows},
		{"SELECT 1, 2 WHERE $1::float8 > 1", []any{1.5}, nil},
		{"SELECT 1, 2 WHERE $1::float8 > 1", []any{0.5}, pgx.ErrNoRows},
	} {
		err := on(func(ctx context.Context, conn *pgx.Conn) error { return s.core.QueryRow(ctx, conn, c.sql, c.args) })
		if !errors.Is(err, c.want) || (c.want == nil) != (err == nil) {
			t.Fatalf("%s with %v, nothing scanned: %v, want %v", c.sql, c.args, err, c.want)
		}
	}
	if s.Err() != nil {
		t.Fatalf("session ended: %v", s.Err())
	}
}

// queryTracer records the statements pgx runs.
type queryTracer struct {
	mu  sync.Mutex
	sql []string
}

func (q *queryTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	q.mu.Lock()
	q.sql = append(q.sql, d.SQL)
	q.mu.Unlock()
	return ctx
}

func (q *queryTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (q *queryTracer) saw(fn string) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, s := range q.sql {
		if strings.Contains(s, fn+"(") {
			return true
		}
	}
	return false
}

// TestTracedConnectionsTraceLockStatements: a pgx tracer in the pool's
// connection config sees the statements of TryLock, Lock (held elsewhere,
// so it waits) and Unlock, as it sees every other statement.
func TestTracedConnectionsTraceLockStatements(t *testing.T) {
	dsn := pgtest.DB(t)
	tracer := &queryTracer{}
	pool := pgtest.Pool(t, dsn, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracer })
	c := newTestClientOn(t, pool)
	ctx := t.Context()
	l, err := c.TryLock(ctx, Int64Key(1))
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	other := pgtest.Conn(t, dsn)
	if _, err := other.Exec(ctx, "SELECT pg_advisory_lock(2)"); err != nil {
		t.Fatal(err)
	}
	got := make(chan result, 1)
	go func() {
		l, err := c.Lock(ctx, Int64Key(2))
		got <- result{l, err}
	}()
	pgtest.Eventually(t, testTimeout, "the Lock waits for key 2", func() bool { return waitingOn(t, dsn, Int64Key(2)) == 1 })
	if _, err := other.Exec(ctx, "SELECT pg_advisory_unlock(2)"); err != nil {
		t.Fatal(err)
	}
	r := <-got
	if r.err != nil {
		t.Fatal(r.err)
	}
	if err := r.l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	for _, fn := range []string{"pg_try_advisory_lock", "pg_advisory_lock", "pg_advisory_unlock"} {
		if !tracer.saw(fn) {
			t.Errorf("the tracer saw no statement calling %s", fn)
		}
	}
}
