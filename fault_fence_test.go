package pgcoord

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// A backend lost while it issues a fence for a lock it has just taken
// (here: the fence waits for a transaction that checked the previous
// fence, and the backend is terminated meanwhile). The acquire goes on on
// another backend and returns a lock with a newer fence once that
// transaction ends; the key's in-process gate is given back exactly once,
// so the lock can be released, and goroutines of the Client still exclude
// each other on the key. (The soak found this: the gate was given back
// twice, and the second time panicked.)
func TestFaultLossWhileIssuingFence(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, pool := faultDB(t)
	c := newTestClient(t, dsn)
	target := lockTarget{"issuing"}
	k := target.key()
	first, err := target.acquire(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.release(ctx); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if err := target.check(ctx, tx, int64(first.Fence())); err != nil {
		t.Fatal(err)
	}

	ch := goLock(func() (*Lock, error) { return c.Lock(ctx, k, WithFence()) })
	issuing := awaitIssuingFence(t, pool, dsn, k)
	pgtest.Terminate(t, dsn, issuing)
	pgtest.Eventually(t, testTimeout, "the acquire goes on on another backend", func() bool {
		pids := grantedTo(t, dsn, k)
		return len(pids) == 1 && pids[0] != issuing
	})
	stillWaiting(t, ch)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := receive(t, ch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.l.Fence() <= first.Fence() {
		t.Fatalf("fence %d, not above %d", r.l.Fence(), first.Fence())
	}
	heldOnlyBy(t, dsn, k, r.l.core.S.PID())
	mustUnlock(t, r.l)

	// The gate still excludes: another goroutine of the Client is turned
	// away in the process while the key is held, and served after.
	a, err := c.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.TryLock(ctx, k); !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), "by this process") {
		t.Fatalf("TryLock while another goroutine holds the key: %v, want ErrLocked by this process", err)
	}
	mustUnlock(t, a)
	b, err := c.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	heldOnlyBy(t, dsn, k, b.core.S.PID())
	mustUnlock(t, b)
	notHeld(t, dsn, k)
}
