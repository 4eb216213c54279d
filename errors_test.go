package pgcoord

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// onePrefix checks that err's message starts with "pgcoord: " and says it
// only once, however deeply pgcoord's own errors are nested in it.
func onePrefix(t *testing.T, what string, err error) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: no error", what)
	}
	msg := err.Error()
	if !strings.HasPrefix(msg, "pgcoord: ") || strings.Count(msg, "pgcoord:") != 1 {
		t.Errorf("%s: message %q should say \"pgcoord:\" once, at the start", what, msg)
	}
}

func TestErrorfSaysPrefixOnce(t *testing.T) {
	pe := &pgconn.PgError{Severity: "ERROR", Code: "40P01", Message: "deadlock detected"}
	inner := core.Errorf("acquire: %w", core.PgError("wait", pe))
	err := core.Errorf("lock %s: %w: %w", Int64Key(7), ErrClosed, inner)
	const want = "pgcoord: lock int64:7: closed: acquire: wait: deadlock detected: ERROR: deadlock detected (SQLSTATE 40P01)"
	if err.Error() != want {
		t.Errorf("message\n got %q\nwant %q", err, want)
	}
	var got *pgconn.PgError
	if !errors.Is(err, ErrClosed) || !errors.Is(err, ErrDeadlock) || !errors.As(err, &got) || got != pe {
		t.Errorf("sentinels or the PgError are not reachable from %v", err)
	}
	// A non-error operand is shown as fmt shows it; a foreign error is
	// shown whole.
	if err := core.Errorf("%d keys: %w", 3, errors.New("pgcoord: x")); err.Error() != "pgcoord: 3 keys: x" {
		t.Errorf("got %q", err)
	}
	if err := core.Errorf("%w", context.Canceled); err.Error() != "pgcoord: context canceled" || !errors.Is(err, context.Canceled) {
		t.Errorf("got %q", err)
	}
}

// TestErrorMessages checks the messages of representative failures from
// real operations: each says "pgcoord:" once, and the sentinel and the
// server's error stay reachable.
func TestErrorMessages(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	a := newTestClient(t, dsn)
	b := newTestClient(t, dsn)
	k := Int64Key(1)

	held, err := a.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}

	_, err = b.TryLock(ctx, k)
	onePrefix(t, "TryLock", err)
	if want := "pgcoord: try lock int64:1: key is locked by another holder"; err.Error() != want || !errors.Is(err, ErrLocked) {
		t.Errorf("TryLock: got %q, want %q", err, want)
	}

	// A wait cut by the Client's Close.
	c := newTestClient(t, dsn)
	waiting := goLock(func() (*Lock, error) { return c.Lock(ctx, k) })
	pgtest.Eventually(t, testTimeout, "the wait to show in pg_locks", func() bool { return waitingOn(t, dsn, k) == 1 })
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	r := receive(t, waiting)
	onePrefix(t, "Lock cut by Close", r.err)
	if !errors.Is(r.err, ErrClosed) || !strings.HasPrefix(r.err.Error(), "pgcoord: lock int64:1: closed") {
		t.Errorf("Lock cut by Close: %q", r.err)
	}
	_, err = c.Lock(ctx, k)
	if !errors.Is(err, ErrClosed) || err.Error() != "pgcoord: closed" {
		t.Errorf("Lock after Close: %q", err)
	}

	// A lost lock: its backend is terminated.
	pgtest.Terminate(t, dsn, held.core.S.PID())
	awaitEnd(t, held, "the lock of a terminated backend")
	onePrefix(t, "Err of a lost lock", held.Err())
	err = held.Unlock(ctx)
	onePrefix(t, "Unlock of a lost lock", err)
	if !errors.Is(err, ErrLockLost) || !strings.HasPrefix(err.Error(), "pgcoord: unlock int64:1: lock lost: ") {
		t.Errorf("Unlock of a lost lock: %q", err)
	}

	// The server's error in an aborted transaction.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	_, _ = tx.Exec(ctx, "SELECT 1/0")
	err = XactLock(ctx, tx, k)
	onePrefix(t, "XactLock in an aborted transaction", err)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "25P02" || !strings.HasPrefix(err.Error(), "pgcoord: xact lock int64:1: ERROR: ") {
		t.Errorf("XactLock in an aborted transaction: %q", err)
	}

	// Tables missing.
	tx2, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx2.Rollback(ctx)
	err = CheckFence(ctx, tx2, k, 1)
	onePrefix(t, "CheckFence before Migrate", err)
	if !errors.Is(err, ErrNotMigrated) || !errors.As(err, &pe) || pe.Code != "42P01" {
		t.Errorf("CheckFence before Migrate: %q", err)
	}

	// Invalid input.
	_, err = b.LockAll(ctx, k, Key{})
	onePrefix(t, "LockAll with the zero Key", err)
	if !errors.Is(err, ErrInvalidKey) {
		t.Errorf("LockAll with the zero Key: %q", err)
	}
	_, err = ParseKey("nope")
	onePrefix(t, "ParseKey", err)
	_, err = b.RLock(ctx, k, WithFence())
	onePrefix(t, "RLock WithFence", err)
	_, err = New(pool, WithHeartbeat(0), WithMaxWaits(0))
	for _, e := range err.(interface{ Unwrap() []error }).Unwrap() {
		onePrefix(t, "New with bad options", e)
	}
}
