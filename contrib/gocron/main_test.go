package pgcoordgocron_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"go.uber.org/goleak"
)

// TestMain runs the tests, or, when the test binary is started again by a
// process test with roleEnv set, one scheduler process (see child).
func TestMain(m *testing.M) {
	if role := os.Getenv(roleEnv); role != "" {
		if err := child(role); err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	pgtest.Main(leakChecked{m})
}

// leakChecked fails the run when a goroutine other than the one that owns
// the shared server's process outlives the tests: every Elector, Locker
// and Client must have cleaned up after itself.
type leakChecked struct{ m *testing.M }

func (l leakChecked) Run() int {
	code := l.m.Run()
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreAnyFunction("github.com/pgcoord/pgcoord/internal/pgtest.startChild.func1")); err != nil {
			fmt.Fprintln(os.Stderr, "goroutines leaked:", err)
			return 1
		}
	}
	return code
}

// testTimeout bounds every wait of the tests.
const testTimeout = 30 * time.Second

// ctxT returns a context bounded by testTimeout and cancelled at cleanup.
func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	return ctx
}

// newClient opens a pgcoord Client on a pool of its own for dsn, with a
// short heartbeat and opts, and closes both in t.Cleanup.
func newClient(t testing.TB, dsn, app string, opts ...pgcoord.Option) *pgcoord.Client {
	t.Helper()
	pool := pgtest.Pool(t, dsn)
	c, err := pgcoord.New(pool, append([]pgcoord.Option{pgcoord.WithApplicationName(app),
		pgcoord.WithHeartbeat(200 * time.Millisecond), pgcoord.WithLossDeadline(2 * time.Second)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(context.Background()); err != nil {
			t.Errorf("close client: %v", err)
		}
	})
	return c
}

// migrated returns a fresh database with pgcoord's tables.
func migrated(t testing.TB) (string, *pgxpool.Pool) {
	t.Helper()
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	if err := pgcoord.Migrate(ctxT(t), pool); err != nil {
		t.Fatal(err)
	}
	return dsn, pool
}

// keyLocks returns the advisory locks on key in the database of dsn, as
// pg_locks shows them.
func keyLocks(t testing.TB, dsn string, key pgcoord.Key) []pgtest.AdvisoryLock {
	t.Helper()
	var out []pgtest.AdvisoryLock
	for _, l := range pgtest.AdvisoryLocks(t, dsn) {
		if k, err := pgcoord.KeyFromLock(l.ClassID, l.ObjID, l.ObjSubID); err == nil && k == key {
			out = append(out, l)
		}
	}
	return out
}

// holder returns the backend pid that holds key, or 0.
func holder(t testing.TB, dsn string, key pgcoord.Key) int32 {
	t.Helper()
	for _, l := range keyLocks(t, dsn, key) {
		if l.Granted {
			return l.PID
		}
	}
	return 0
}
