package pgcoord

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// More keys than fit in one statement are taken in chunks, still in
// canonical order and all or nothing.
func TestManyKeysAreChunked(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	const n = 2*core.MaxKeysPerStatement + 500
	keys := make([]Key, n)
	for i := range keys {
		keys[i] = Int64Key(int64(n - i)) // reverse order: canonical order sorts them
	}

	s := newTestSession(t, newTestClient(t, dsn))
	l, err := s.LockAll(ctx, keys...)
	if err != nil {
		t.Fatal(err)
	}
	if got := len(lockState(t, dsn)); got != n {
		t.Fatalf("LockAll of %d keys: %d in pg_locks", n, got)
	}
	mustUnlock(t, l)
	if got := len(lockState(t, dsn)); got != 0 {
		t.Fatalf("%d keys left after Unlock", got)
	}

	pool := pgtest.Pool(t, dsn)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if err := XactLock(ctx, tx, keys...); err != nil {
		t.Fatal(err)
	}
	if got := len(lockState(t, dsn)); got != n {
		t.Fatalf("XactLock of %d keys: %d in pg_locks", n, got)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	// A key in the third chunk is held elsewhere: the try stops there.
	busy := Int64Key(2*core.MaxKeysPerStatement + 100)
	other, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback(context.Background())
	if err := XactLock(ctx, other, busy); err != nil {
		t.Fatal(err)
	}
	tx, err = pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	err = XactTryLock(ctx, tx, keys...)
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), busy.String()) {
		t.Fatalf("XactTryLock with %v held elsewhere: %v", busy, err)
	}
	// Keys 1 .. busy-1 are held by tx, plus busy by the other transaction.
	if got, want := len(lockState(t, dsn)), 2*core.MaxKeysPerStatement+100; got != want {
		t.Fatalf("%d keys in pg_locks after the failed try, want %d", got, want)
	}
}
