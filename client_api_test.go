package pgcoord

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// Client.Migrate and Client.CheckFence use the Client's schema: Migrate
// creates the tables in it (read back from the catalog), a fence issued by
// the Client is checked there, a stale one refused; a Client of another,
// unmigrated schema gets ErrNotMigrated naming it from both.
func TestClientMigrateAndCheckFenceUseItsSchema(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	c := newTestClient(t, dsn, WithSchema("app_coord"))
	if err := c.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	var tables int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = 'app_coord' AND tablename IN ('fences', 'leaders', 'semaphores')`).Scan(&tables); err != nil || tables != 3 {
		t.Fatalf("pgcoord's tables in schema app_coord: %d, %v; want 3", tables, err)
	}
	if schemaExists(t, ctx, pool, DefaultSchema) {
		t.Fatalf("Client.Migrate created the default schema %q too", DefaultSchema)
	}
	k := HashKey("client-check-fence")
	old, err := c.Lock(ctx, k, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	mustUnlock(t, old)
	l, err := c.Lock(ctx, k, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	defer mustUnlock(t, l)
	check := func(c *Client, fence Term) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return c.CheckFence(ctx, tx, k, fence) })
	}
	if err := check(c, l.Fence()); err != nil {
		t.Fatalf("Client.CheckFence of the newest fence: %v", err)
	}
	if err := check(c, old.Fence()); !errors.Is(err, ErrStaleFence) {
		t.Fatalf("Client.CheckFence of the old fence: %v, want ErrStaleFence", err)
	}
	other := newTestClient(t, dsn, WithSchema("not_migrated"))
	if err := check(other, l.Fence()); !errors.Is(err, ErrNotMigrated) {
		t.Fatalf("Client.CheckFence in an unmigrated schema: %v, want ErrNotMigrated", err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return CheckFence(ctx, tx, k, l.Fence(), WithSchema("app_coord"))
	}); err != nil {
		t.Fatalf("CheckFence with WithSchema of the Client's schema: %v", err)
	}
}

// Close(ctx) releases everything it owns even when ctx has ended: with
// locks held on the Client's backends and a Session, the caller's pool
// exhausted, and a ctx already cancelled, Close returns within the loss
// deadline with ctx's error, and pg_locks shows none of the Client's
// locks within a second after (the server frees a closed connection's
// locks as it notices).
func TestCloseWithEndedCtxReleasesEverything(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	const loss = 2 * time.Second
	pool := pgtest.Pool(t, dsn, func(cfg *pgxpool.Config) { cfg.MaxConns = 1 })
	c := newTestClientOn(t, pool, WithLossDeadline(loss), WithApplicationName("close-ctx"))
	var keys []Key
	for i := range 5 {
		k := Int64Key(int64(7000 + i))
		if _, err := c.Lock(ctx, k); err != nil {
			t.Fatal(err)
		}
		keys = append(keys, k)
	}
	s, err := c.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sk := Int64Key(7100)
	if _, err := s.Lock(ctx, sk); err != nil {
		t.Fatal(err)
	}
	keys = append(keys, sk)
	held, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release()
	cctx, cancel := context.WithCancel(context.Background())
	cancel()
	start := time.Now()
	err = c.Close(cctx)
	if took := time.Since(start); took > loss {
		t.Fatalf("Close with an ended ctx took %v, want within the loss deadline %v", took, loss)
	}
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Close with an ended ctx: %v, want an error wrapping context.Canceled", err)
	}
	pgtest.Eventually(t, time.Second, "the server to free the closed Client's locks", func() bool {
		for _, k := range keys {
			if len(grantedTo(t, dsn, k)) != 0 {
				return false
			}
		}
		return true
	})
	if err := c.Close(ctx); err != nil {
		t.Fatalf("a second Close: %v, want nil", err)
	}
}
