package pgcoord

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// The tests of this file prove the promises about how calls end: a
// caller's cancel or deadline is reported as ctx's cause, also when the
// server is down (with the last connection error kept), and Close ends
// every waiting call with ErrClosed, within the loss deadline, leaving
// nothing in pg_locks.

// errStopWaiting is a cause given to context.WithCancelCause.
var errStopWaiting = errors.New("stop waiting: the job was withdrawn")

// awaitUngranted polls pg_locks until some advisory lock of dsn's database
// is waited for, or timeout passes; it reports whether one was seen.
func awaitUngranted(t testing.TB, dsn string, timeout time.Duration) bool {
	t.Helper()
	return pgtest.Poll(timeout, func() bool {
		for _, l := range pgtest.AdvisoryLocks(t, dsn) {
			if !l.Granted {
				return true
			}
		}
		return false
	})
}

// Promise (errors.go, acquires): an acquire whose ctx is cancelled with a
// cause while it waits returns an error wrapping that cause, for Lock,
// LockAll, RLock, a fenced Lock, Campaign and Semaphore.Acquire; past a
// plain deadline it wraps context.DeadlineExceeded.
func TestAcquiresReportCancelCause(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	a := newTestClient(t, dsn)
	b := newTestClient(t, dsn)
	k1, k2 := HashKey("cause", "one"), HashKey("cause", "two")
	held, err := a.LockAll(ctx, k1, k2)
	if err != nil {
		t.Fatal(err)
	}
	lead, err := a.Election("cause", WithIdentity("a")).Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	permit, err := a.Semaphore("cause", 1).Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]func(context.Context) error{
		"Lock":  func(ctx context.Context) error { _, err := b.Lock(ctx, k1); return err },
		"RLock": func(ctx context.Context) error { _, err := b.RLock(ctx, k2); return err },
		"LockAll": func(ctx context.Context) error {
			_, err := b.LockAll(ctx, k2, k1)
			return err
		},
		"Lock WithFence": func(ctx context.Context) error {
			_, err := b.Lock(ctx, k1, WithFence())
			return err
		},
		"Campaign": func(ctx context.Context) error {
			_, err := b.Election("cause", WithIdentity("b")).Campaign(ctx)
			return err
		},
		"Semaphore.Acquire": func(ctx context.Context) error {
			_, err := b.Semaphore("cause", 1).Acquire(ctx)
			return err
		},
	}
	for name, call := range calls {
		// Cancelled with a cause once the wait shows in pg_locks.
		cctx, cancel := context.WithCancelCause(ctx)
		done := make(chan error, 1)
		go func() { done <- call(cctx) }()
		if !awaitUngranted(t, dsn, 5*time.Second) {
			t.Logf("%s: no wait seen in pg_locks; cancelling anyway", name)
		}
		cancel(errStopWaiting)
		select {
		case err := <-done:
			if !errors.Is(err, errStopWaiting) {
				t.Errorf("%s cancelled with a cause: %v, want it to wrap the cause", name, err)
			}
			if err != nil && !strings.HasPrefix(err.Error(), "pgcoord: ") {
				t.Errorf("%s: error %q lacks the pgcoord: prefix", name, err)
			}
		case <-time.After(testTimeout):
			t.Fatalf("%s did not return after its ctx was cancelled", name)
		}
		// A plain deadline: context.DeadlineExceeded.
		pctx, pcancel := context.WithTimeout(ctx, 300*time.Millisecond)
		err := call(pctx)
		pcancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s past a deadline: %v, want context.DeadlineExceeded", name, err)
		}
	}
	if err := permit.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := lead.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	mustUnlock(t, held)
	// The cancelled waits left nothing waiting or held on the server.
	pgtest.Eventually(t, 5*time.Second, "advisory locks left after every wait was cancelled", func() bool {
		return len(pgtest.AdvisoryLocks(t, dsn)) == 0
	})
}

// Promise (errors.go, Client.Lock): with the server down, a blocking
// acquire keeps trying; cancelled with a cause it returns an error that
// wraps the cause and keeps the last connection error.
func TestAcquireKeepsCauseAndLastConnErrorWhileServerDown(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	srv := pgtest.NewServer(t)
	dsn := srv.DB(t)
	c := newTestClient(t, dsn, WithLossDeadline(time.Second), WithHeartbeat(250*time.Millisecond))
	k := HashKey("cause", "down")
	mustUnlock(t, mustLockOf(t, ctx, c, k))
	srv.Stop(t)
	defer srv.Start(t)

	for _, try := range []struct {
		name string
		mk   func() (context.Context, func())
	}{
		{"WithCancelCause", func() (context.Context, func()) {
			cctx, cancel := context.WithCancelCause(ctx)
			go func() {
				// Cancel once the acquire is queued, trying to reach the server.
				pgtest.Poll(10*time.Second, func() bool { return c.Stat().QueuedWaits > 0 })
				cancel(errStopWaiting)
			}()
			return cctx, func() { cancel(nil) }
		}},
		{"WithTimeoutCause", func() (context.Context, func()) {
			return context.WithTimeoutCause(ctx, time.Second, errStopWaiting)
		}},
	} {
		cctx, cancel := try.mk()
		_, err := c.Lock(cctx, k)
		cancel()
		if !errors.Is(err, errStopWaiting) {
			t.Errorf("%s: Lock with the server down: %v, want it to wrap the cause", try.name, err)
		}
		if err == nil || !strings.Contains(err.Error(), "last connection error") {
			t.Errorf("%s: Lock with the server down: %v, want the last connection error kept", try.name, err)
		}
	}
}

// Promise (errors.go; Campaign, Semaphore.Acquire, LockAll): with the
// server down these keep trying; ended by a cancel or a deadline with a
// cause, they return an error that wraps the cause and keeps the last
// connection error.
func TestElectionSemaphoreLockAllKeepCauseWhileServerDown(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	srv := pgtest.NewServer(t)
	dsn := srv.DB(t)
	pool := pgtest.Pool(t, dsn)
	if err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	c := newTestClient(t, dsn, WithLossDeadline(time.Second), WithHeartbeat(250*time.Millisecond))
	mustUnlock(t, mustLockOf(t, ctx, c, HashKey("x", "y")))
	srv.Stop(t)
	defer srv.Start(t)
	calls := map[string]func(context.Context) error{
		"Campaign":    func(ctx context.Context) error { _, err := c.Election("down").Campaign(ctx); return err },
		"Sem.Acquire": func(ctx context.Context) error { _, err := c.Semaphore("down", 1).Acquire(ctx); return err },
		"LockAll": func(ctx context.Context) error {
			_, err := c.LockAll(ctx, HashKey("a", "b"), HashKey("c", "d"))
			return err
		},
	}
	for name, call := range calls {
		for _, timed := range []bool{false, true} {
			var cctx context.Context
			var cancel func()
			if timed {
				cctx, cancel = context.WithTimeoutCause(ctx, time.Second, errStopWaiting)
			} else {
				var cc context.CancelCauseFunc
				cctx, cc = context.WithCancelCause(ctx)
				go func() {
					pgtest.Poll(10*time.Second, func() bool { return c.Stat().QueuedWaits > 0 })
					cc(errStopWaiting)
				}()
				cancel = func() { cc(nil) }
			}
			err := call(cctx)
			cancel()
			if !errors.Is(err, errStopWaiting) {
				t.Errorf("%s (deadline %v) with the server down: %v, want it to wrap the cause", name, timed, err)
			}
			if err == nil || !strings.Contains(err.Error(), "last connection error") {
				t.Errorf("%s (deadline %v) with the server down: %v, want the last connection error kept", name, timed, err)
			}
		}
	}
}

// mustLockOf takes k on c or fails the test.
func mustLockOf(t testing.TB, ctx context.Context, c *Client, k Key) *Lock {
	t.Helper()
	l, err := c.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// Promise (Client.Close): Close while a Client holds locks (on the shared
// backends and on a Session) and while its acquires wait (Lock, RLock,
// LockAll, a fenced Lock, Campaign, Semaphore.Acquire) makes every waiting
// call return an error wrapping ErrClosed, returns within the loss
// deadline, and leaves nothing of the Client in pg_locks; every call after
// it returns ErrClosed.
func TestCloseEndsHoldsAndWaitsWithErrClosed(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	a := newTestClient(t, dsn)
	const lossDeadline = time.Second
	pool := pgtest.Pool(t, dsn)
	b, err := New(pool, WithLossDeadline(lossDeadline), WithHeartbeat(250*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	k1, k2, own, sessKey := HashKey("close", "one"), HashKey("close", "two"), HashKey("close", "own"), HashKey("close", "session")
	held, err := a.LockAll(ctx, k1, k2)
	if err != nil {
		t.Fatal(err)
	}
	lead, err := a.Election("close", WithIdentity("a")).Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	permit, err := a.Semaphore("close", 1).Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	mine := mustLockOf(t, ctx, b, own)
	sess, err := b.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sl, err := sess.Lock(ctx, sessKey)
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]func() error{
		"Lock":          func() error { _, err := b.Lock(ctx, k1); return err },
		"RLock":         func() error { _, err := b.RLock(ctx, k2); return err },
		"LockAll":       func() error { _, err := b.LockAll(ctx, k2, k1); return err },
		"fenced Lock":   func() error { _, err := b.Lock(ctx, k1, WithFence()); return err },
		"Session.Lock":  func() error { _, err := sess.Lock(ctx, k2); return err },
		"local waiter":  func() error { _, err := b.Lock(ctx, own); return err },
		"Campaign":      func() error { _, err := b.Election("close", WithIdentity("b")).Campaign(ctx); return err },
		"Sem.Acquire":   func() error { _, err := b.Semaphore("close", 1).Acquire(ctx); return err },
		"Do on a held":  func() error { return b.Do(ctx, k1, func(context.Context) error { return nil }) },
		"Lock another ": func() error { _, err := b.Lock(ctx, k2); return err },
	}
	type ended struct {
		name string
		err  error
	}
	results := make(chan ended, len(calls))
	for name, call := range calls {
		go func() { results <- ended{name, call()} }()
	}
	// Wait until the server shows waits (the local waiter waits in the
	// process); the calls that are not yet waiting are still in flight.
	pgtest.Eventually(t, 10*time.Second, "no waits in pg_locks", func() bool {
		n := 0
		for _, l := range pgtest.AdvisoryLocks(t, dsn) {
			if !l.Granted {
				n++
			}
		}
		return n >= 1
	})
	start := time.Now()
	if err := b.Close(context.Background()); err != nil {
		t.Errorf("Close: %v", err)
	}
	// Close waits for the session's release, the shared backends' and
	// the waits' ends: one loss deadline, with slack for a loaded machine.
	if took := time.Since(start); took > 2*lossDeadline {
		t.Errorf("Close took %v with calls in flight, more than twice the loss deadline", took)
	}
	for range calls {
		select {
		case r := <-results:
			if !errors.Is(r.err, ErrClosed) {
				t.Errorf("%s waiting during Close: %v, want ErrClosed", r.name, r.err)
			}
		case <-time.After(2 * lossDeadline):
			t.Fatal("a call waiting during Close did not return")
		}
	}
	for _, l := range []*Lock{mine, sl} {
		if err := l.Err(); !errors.Is(err, ErrClosed) {
			t.Errorf("a lock held during Close: Err %v, want ErrClosed", err)
		}
		if err := l.Unlock(ctx); !errors.Is(err, ErrClosed) {
			t.Errorf("Unlock of a lock ended by Close: %v, want ErrClosed", err)
		}
	}
	if _, err := b.Lock(ctx, HashKey("close", "after")); !errors.Is(err, ErrClosed) {
		t.Errorf("Lock after Close: %v, want ErrClosed", err)
	}
	if _, err := sess.Lock(ctx, HashKey("close", "after")); !errors.Is(err, ErrClosed) {
		t.Errorf("Session.Lock after Close: %v, want ErrClosed", err)
	}
	// Nothing of b is left: its holds are free and nobody waits.
	notHeld(t, dsn, own)
	notHeld(t, dsn, sessKey)
	for _, l := range pgtest.AdvisoryLocks(t, dsn) {
		if !l.Granted {
			t.Errorf("after Close a wait is left in pg_locks: %+v", l)
		}
	}
	if err := permit.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := lead.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	mustUnlock(t, held)
	if locks := pgtest.AdvisoryLocks(t, dsn); len(locks) != 0 {
		t.Errorf("advisory locks left after both Clients released: %+v", locks)
	}
}
