package pgcoordtest_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/pgcoordtest"
)

// exportJob is the code under test: it exports rows while it holds the
// "export" lock, and must stop at once when the lock is lost, because
// another process may hold it by then.
func exportJob(ctx context.Context, c *pgcoord.Client, rows chan<- int) error {
	return c.Do(ctx, pgcoord.HashKey("export"), func(ctx context.Context) error {
		for i := 0; ; i++ {
			select {
			case <-ctx.Done(): // cancelled when the lock is lost
				return context.Cause(ctx)
			case rows <- i:
			}
		}
	})
}

// testExportStopsWhenItsLockIsLost is the test, as it stands in a _test.go
// file as func TestExportStopsWhenItsLockIsLost(t *testing.T).
func testExportStopsWhenItsLockIsLost(t testing.TB) {
	// snippet:start
	dsn := pgcoordtest.DB(t) // a fresh migrated database, dropped at the end
	c := pgcoordtest.Client(t, dsn,
		pgcoord.WithHeartbeat(100*time.Millisecond), pgcoord.WithLossDeadline(time.Second))

	rows := make(chan int)
	result := make(chan error, 1)
	go func() { result <- exportJob(context.Background(), c, rows) }()
	<-rows // the job holds its lock and works

	pgcoordtest.TerminateBackends(t, c) // the server ends the Client's connections
	// snippet:end

	deadline := time.After(10 * time.Second)
	for {
		select {
		case <-rows: // rows it sent before it noticed
		case err := <-result:
			fmt.Println("job stopped; lock lost:", errors.Is(err, pgcoord.ErrLockLost))
			// Another process can take the lock now.
			other := pgcoordtest.Client(t, dsn)
			l, err := other.TryLock(context.Background(), pgcoord.HashKey("export"))
			fmt.Println("taken over:", err == nil)
			if err == nil {
				_ = l.Unlock(context.Background())
			}
			return
		case <-deadline:
			t.Fatal("the job still runs 10 s after its lock was lost")
		}
	}
}

// A job that must stop when its lock is lost, tested by ending the
// Client's connections on the server.
func Example_jobStopsWhenItsLockIsLost() {
	runTest("TestExportStopsWhenItsLockIsLost", testExportStopsWhenItsLockIsLost)
	// Output:
	// job stopped; lock lost: true
	// taken over: true
}
