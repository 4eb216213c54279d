package pgcoord

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// permanentErrorBound is how soon a blocking acquire must return an error
// that no retry can cure: well under the first retries' backoff sum, and
// far under the ctx the tests give it.
const permanentErrorBound = 2 * time.Second

// A blocking acquire whose connection cannot be opened for a reason that
// no retry can cure (the pool's config, or the server refusing the
// database, the role or a setting) returns that error at once, naming the
// step, instead of retrying until its ctx ends; nothing is locked. So do a
// campaign and a semaphore's Acquire, which open the same connections.
func TestBlockingAcquireReturnsConfigurationErrorAtOnce(t *testing.T) {
	dsn := pgtest.DB(t)
	if err := Migrate(testCtx(t), pgtest.Pool(t, dsn)); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	withUser := strings.Replace(dsn, "://"+cfg.User+"@", "://pgcoord_no_such_role@", 1)
	withDB := strings.Replace(dsn, "/"+cfg.Database+"?", "/pgcoord_no_such_db?", 1)
	if !strings.Contains(dsn, "/"+cfg.Database+"?") {
		withDB = strings.Replace(dsn, "/"+cfg.Database, "/pgcoord_no_such_db", 1)
	}
	for _, tc := range []struct {
		name      string
		dsn       string
		configure func(*pgxpool.Config)
		code      string // SQLSTATE of the server's refusal, if it is one
		says      string // what the error must say
	}{
		{name: "statement cache disabled", dsn: dsn, says: "statement_cache_capacity",
			configure: func(c *pgxpool.Config) { c.ConnConfig.StatementCacheCapacity = 0 }},
		{name: "description cache disabled", dsn: dsn, says: "description_cache_capacity",
			configure: func(c *pgxpool.Config) {
				c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe
				c.ConnConfig.DescriptionCacheCapacity = 0
			}},
		{name: "unknown database", dsn: withDB, code: "3D000", says: "pgcoord_no_such_db"},
		{name: "unknown role", dsn: withUser, code: "28000", says: "pgcoord_no_such_role"},
		{name: "unknown setting", dsn: dsn, code: "42704", says: "pgcoord_no_such_setting",
			configure: func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["pgcoord_no_such_setting"] = "1" }},
		{name: "invalid setting", dsn: dsn, code: "22023", says: "statement_timeout",
			configure: func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["statement_timeout"] = "soon" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var configure []func(*pgxpool.Config)
			if tc.configure != nil {
				configure = append(configure, tc.configure)
			}
			c := newTestClientOn(t, pgtest.Pool(t, tc.dsn, configure...))
			k := Int64Key(-42)
			check := func(what string, call func(ctx context.Context) error) {
				t.Helper()
				ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
				defer cancel()
				start := time.Now()
				err := call(ctx)
				took := time.Since(start)
				switch {
				case err == nil:
					t.Fatalf("%s: nil error", what)
				case took > permanentErrorBound:
					t.Fatalf("%s returned after %v, want within %v: %v", what, took, permanentErrorBound, err)
				case ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded):
					t.Fatalf("%s: %v, want the configuration error, not ctx's", what, err)
				case !strings.HasPrefix(err.Error(), "pgcoord: ") || !strings.Contains(err.Error(), "open connection: ") || !strings.Contains(err.Error(), tc.says):
					t.Fatalf("%s: %q, want an error naming the step (open connection) and %q", what, err, tc.says)
				}
				if tc.code != "" {
					var pe *pgconn.PgError
					if !errors.As(err, &pe) || pe.Code != tc.code {
						t.Fatalf("%s: %v, want the server's error with SQLSTATE %s", what, err, tc.code)
					}
				}
				if n := c.Stat().QueuedWaits; n != 0 {
					t.Errorf("after %s Stat.QueuedWaits = %d, want 0", what, n)
				}
				notHeld(t, dsn, k)
			}
			check("Lock", func(ctx context.Context) error {
				_, err := c.Lock(ctx, k)
				if err != nil && !strings.HasPrefix(err.Error(), "pgcoord: lock "+k.String()+": ") {
					t.Errorf("Lock: %q does not name the lock", err)
				}
				return err
			})
			check("RLock", func(ctx context.Context) error { _, err := c.RLock(ctx, k); return err })
			check("LockAll", func(ctx context.Context) error { _, err := c.LockAll(ctx, k, PairKey(-1, 1)); return err })
			check("Campaign", func(ctx context.Context) error { _, err := c.Election("e").Campaign(ctx); return err })
			check("Acquire", func(ctx context.Context) error { _, err := c.Semaphore("s", 1).Acquire(ctx); return err })
			check("Warm", c.Warm)
		})
	}
}

// The configuration that pgx refuses for lack of a statement cache works
// once the pool's query mode does not need one: what the error tells the
// user to do.
func TestLockWithoutStatementCacheInOtherQueryModes(t *testing.T) {
	dsn := pgtest.DB(t)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := testCtx(t)
			c := newTestClientOn(t, pgtest.Pool(t, dsn, func(c *pgxpool.Config) {
				c.ConnConfig.StatementCacheCapacity = 0
				c.ConnConfig.DescriptionCacheCapacity = 0
				c.ConnConfig.DefaultQueryExecMode = mode
			}))
			k := Int64Key(-42)
			l, err := c.Lock(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			heldOnlyBy(t, dsn, k, l.core.S.PID())
			if err := l.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
			notHeld(t, dsn, k)
		})
	}
}
