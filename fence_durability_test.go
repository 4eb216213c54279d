package pgcoord

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// crashAttempts bounds how often a crash test retries an inconclusive
// attempt: one in which the WAL writer happened to flush between the fence
// and the crash, so that even an unflushed fence would have survived.
const crashAttempts = 3

// lazyWALServer returns a private server, with a migrated database (its
// connection string is returned), on which a commit does not wait for its
// WAL to be flushed: synchronous_commit is off for the server, the database
// or the role the test connects as, as level says. The WAL writer flushes
// only every 10 s, so a crash (SIGKILL) soon after such a commit loses it.
// The settings take effect through a restart, so that the WAL writer surely
// runs with its new delay; a fresh connection is checked to see both.
func lazyWALServer(t *testing.T, ctx context.Context, level string) (*pgtest.Server, string) {
	t.Helper()
	srv := pgtest.NewServer(t)
	dsn := srv.DB(t)
	pool := migrated(t, dsn)
	var setting string
	switch level {
	case "server":
		setting = "ALTER SYSTEM SET synchronous_commit = off"
	case "database":
		var db string
		if err := pool.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
			t.Fatal(err)
		}
		setting = "ALTER DATABASE " + pgx.Identifier{db}.Sanitize() + " SET synchronous_commit = off"
	case "role":
		setting = "ALTER ROLE CURRENT_USER SET synchronous_commit = off"
	default:
		t.Fatalf("unknown level %q", level)
	}
	for _, sql := range []string{
		"CREATE TABLE unflushed (attempt int NOT NULL)",
		"ALTER SYSTEM SET wal_writer_delay = '10s'",
		setting,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	pool.Reset() // its connections die with the restart
	srv.Restart(t)

	conn := pgtest.Conn(t, dsn)
	for name, want := range map[string]string{"synchronous_commit": "off", "wal_writer_delay": "10s"} {
		var got string
		if err := conn.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Fatalf("after %q and a restart, %s = %q on a fresh connection, want %q", setting, name, got, want)
		}
	}
	return srv, dsn
}

// storedFence reads the fence stored for k, or 0 when the fences table has
// no row for k.
func storedFence(t *testing.T, ctx context.Context, conn *pgx.Conn, k Key) int64 {
	t.Helper()
	space, key := fenceRow(k)
	var fence int64
	err := conn.QueryRow(ctx, "SELECT coalesce((SELECT fence FROM "+pgx.Identifier{DefaultSchema, "fences"}.Sanitize()+
		" WHERE key_space = $1 AND key = $2), 0)", space, key).Scan(&fence)
	if err != nil {
		t.Fatal(err)
	}
	return fence
}

// issueThenCrash calls issue, which issues a fence for k on a fresh
// connection to dsn and returns it. Right after, it commits a marker row
// with synchronous_commit off, kills srv with SIGKILL, waits for crash
// recovery, and checks that the fences table holds exactly the issued
// fence. Only the WAL writer (every 10 s) or a commit that waits for a
// flush writes the marker's commit out, so when the marker survived too,
// the attempt cannot tell a durable fence from a lucky one and it is
// repeated, at most crashAttempts times. It returns the last issued fence.
func issueThenCrash(t *testing.T, ctx context.Context, srv *pgtest.Server, dsn string, k Key, issue func() int64) int64 {
	t.Helper()
	for attempt := 1; ; attempt++ {
		marker := pgtest.Conn(t, dsn)
		before := storedFence(t, ctx, marker, k)
		fence := issue()
		if fence <= before {
			t.Fatalf("attempt %d: issued fence %d, not above the stored %d", attempt, fence, before)
		}
		if _, err := marker.Exec(ctx, "INSERT INTO unflushed VALUES ($1)", attempt); err != nil {
			t.Fatal(err)
		}
		srv.Crash(t)

		check := pgtest.Conn(t, dsn)
		if got := storedFence(t, ctx, check, k); got != fence {
			t.Fatalf("attempt %d: after a crash the fences table holds %d for %v, want %d, the fence that was issued and returned: "+
				"the next holder would get fence %d again and a paused holder of it would pass CheckFence", attempt, got, k, fence, got+1)
		}
		var survived bool
		if err := check.QueryRow(ctx, "SELECT EXISTS (SELECT FROM unflushed WHERE attempt = $1)", attempt).Scan(&survived); err != nil {
			t.Fatal(err)
		}
		if !survived {
			return fence // the crash lost an unflushed commit, and not the fence
		}
		if attempt == crashAttempts {
			t.Fatalf("in %d attempts the crash never lost a commit made with synchronous_commit off: the test cannot tell whether the fence was flushed", attempt)
		}
		t.Logf("attempt %d: the WAL was flushed before the crash; trying again", attempt)
	}
}

// A fence that nextFence returned survives a crash that comes right after,
// although synchronous_commit is off for the server, the database or the
// role: a crash must never make the same fence be issued twice.
func TestNextFenceSurvivesCrashWithSynchronousCommitOff(t *testing.T) {
	t.Parallel()
	for _, level := range []string{"server", "database", "role"} {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			srv, dsn := lazyWALServer(t, ctx, level)
			c := mustFenceConfig(t)
			k := HashKey("durable", "fence", level)

			fence := issueThenCrash(t, ctx, srv, dsn, k, func() int64 {
				return mustNextFence(t, ctx, pgtest.Conn(t, dsn), c, k)
			})
			if next := mustNextFence(t, ctx, pgtest.Conn(t, dsn), c, k); next != fence+1 {
				t.Fatalf("first fence after the crash = %d, want %d", next, fence+1)
			}
		})
	}
}

// The same through the public API: a holder's fence from Lock with
// WithFence survives a crash with synchronous_commit off for the database,
// so after the crash the next holder gets a newer fence and the old
// holder's late write is refused.
func TestFencedLockSurvivesCrashWithSynchronousCommitOff(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	srv, dsn := lazyWALServer(t, ctx, "database")
	k := HashKey("durable", "lock")

	fence := issueThenCrash(t, ctx, srv, dsn, k, func() int64 {
		l, err := newTestClient(t, dsn).Lock(ctx, k, WithFence())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { awaitEnd(t, l, "the crash ends the lock") })
		return int64(l.Fence())
	})

	l, err := newTestClient(t, dsn).Lock(ctx, k, WithFence())
	if err != nil {
		t.Fatal(err)
	}
	if l.Fence() <= Term(fence) {
		t.Fatalf("fence after the crash = %d, not above the %d issued before it", l.Fence(), fence)
	}
	pool := pgtest.Pool(t, dsn)
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return CheckFence(ctx, tx, k, Term(fence)) })
	if !errors.Is(err, ErrStaleFence) {
		t.Fatalf("CheckFence with the fence %d issued before the crash = %v, want ErrStaleFence", fence, err)
	}
	mustUnlock(t, l)
}

// Inside a transaction, nextFence makes that transaction's commit wait for
// its WAL flush: synchronous_commit becomes on, whatever it was, except
// that remote_apply, which waits for the flush too, stays. The setting ends
// with the transaction.
func TestNextFenceInTransactionCommitsSynchronously(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := migratedPool(t, ctx, DefaultSchema)
	conn := pgtest.Conn(t, dsn)
	c := mustFenceConfig(t)
	k := HashKey("durable", "tx")
	setting := func() string {
		t.Helper()
		var s string
		if err := conn.QueryRow(ctx, "SELECT current_setting('synchronous_commit')").Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	if _, err := conn.Exec(ctx, "SET synchronous_commit = off"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ local, want string }{
		{"off", "on"},
		{"local", "on"},
		{"remote_write", "on"},
		{"on", "on"},
		{"remote_apply", "remote_apply"},
	} {
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SET LOCAL synchronous_commit = "+tc.local); err != nil {
			t.Fatal(err)
		}
		mustNextFence(t, ctx, tx, c, k)
		if got := setting(); got != tc.want {
			t.Fatalf("synchronous_commit %s, after nextFence in the transaction: %q, want %q", tc.local, got, tc.want)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if got := setting(); got != "off" {
			t.Fatalf("after the commit, synchronous_commit = %q, want the session's off", got)
		}
	}
}
