package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// ctxKinds are the kinds of caller context an acquire may get: one that
// never ends, one that ends only when cancelled, and one whose deadline
// is nearer than a wait slice (so the slice is cut to it).
func ctxKinds(t *testing.T, deadline time.Duration) map[string]context.Context {
	cancellable, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	near, cancelNear := context.WithTimeout(context.Background(), deadline)
	t.Cleanup(cancelNear)
	return map[string]context.Context{
		"never ends":    context.Background(),
		"cancellable":   cancellable,
		"near deadline": near,
	}
}

// Promise (Client.Close): every kind of waiting acquire (Lock, RLock,
// LockAll, fenced Lock, Session.Lock, Semaphore.Acquire, Campaign), with any
// kind of caller context (one that never ends, one that may be cancelled,
// one whose deadline is within a wait slice), returns an error wrapping
// ErrClosed promptly when the Client closes, and nothing of the Client is
// left waiting in pg_locks.
func TestCloseEndsWaitsWithAnyCallerContextWithErrClosed(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	a := newTestClient(t, dsn)
	k1, k2 := HashKey("actx", "one"), HashKey("actx", "two")
	held, err := a.LockAll(ctx, k1, k2)
	if err != nil {
		t.Fatal(err)
	}
	defer mustUnlock(t, held)
	permit, err := a.Semaphore("actx", 1).Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer permit.Release(ctx)
	lead, err := a.Election("actx", WithIdentity("a")).Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lead.Resign(ctx)

	// A wait slice of 9 s: the near deadline (8 s) cuts it.
	b, err := New(pgtest.Pool(t, dsn), WithLossDeadline(20*time.Second), WithHeartbeat(2*time.Second), WithMaxWaits(32))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close(context.Background())
	sess, err := b.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	type ended struct {
		name string
		err  error
	}
	var calls []string
	results := make(chan ended, 32)
	for kind, cctx := range ctxKinds(t, 8*time.Second) {
		for name, call := range map[string]func() error{
			"Lock":         func() error { _, err := b.Lock(cctx, k1); return err },
			"RLock":        func() error { _, err := b.RLock(cctx, k2); return err },
			"LockAll":      func() error { _, err := b.LockAll(cctx, k2, k1); return err },
			"fenced Lock":  func() error { _, err := b.Lock(cctx, k1, WithFence()); return err },
			"Session.Lock": func() error { _, err := sess.Lock(cctx, k2); return err },
			"Sem.Acquire":  func() error { _, err := b.Semaphore("actx", 1).Acquire(cctx); return err },
			"Campaign":     func() error { _, err := b.Election("actx", WithIdentity("b")).Campaign(cctx); return err },
		} {
			name := name + " (" + kind + ")"
			calls = append(calls, name)
			go func() { results <- ended{name, call()} }()
		}
	}
	// Wait until several acquires wait on the server.
	pgtest.Eventually(t, 10*time.Second, "no waits in pg_locks", func() bool {
		return waitingOn(t, dsn, k1)+waitingOn(t, dsn, k2) >= 1
	})
	start := time.Now()
	if err := b.Close(context.Background()); err != nil {
		t.Errorf("Close: %v", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("Close took %v with acquires waiting", took)
	}
	for range calls {
		select {
		case r := <-results:
			if !errors.Is(r.err, ErrClosed) {
				t.Errorf("%s waiting during Close: %v, want ErrClosed", r.name, r.err)
			}
		case <-time.After(3 * time.Second):
			t.Fatal("an acquire waiting during Close did not return promptly (the near deadline is 8 s)")
		}
	}
	pgtest.Eventually(t, 5*time.Second, "waiters of the closed Client left in pg_locks", func() bool {
		return waitingOn(t, dsn, k1)+waitingOn(t, dsn, k2) == 0
	})
}

// Promise (Client.Close): Close racing the very start of acquires (of a
// free key, of a held key, of a semaphore that is full, on a Session)
// makes each either succeed (the free key, with the lock then ended by
// Close) or fail with an error wrapping ErrClosed; nothing of the Client
// is left held or waiting in pg_locks.
func TestCloseRacingAcquireStartEndsItWithErrClosedAndLeavesNothing(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	a := newTestClient(t, dsn)
	busy := HashKey("race", "busy")
	held := mustLockOf(t, ctx, a, busy)
	defer mustUnlock(t, held)
	permit, err := a.Semaphore("race", 1).Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer permit.Release(ctx)
	for i := range 12 {
		b, err := New(pgtest.Pool(t, dsn))
		if err != nil {
			t.Fatal(err)
		}
		// A lock first, so that backends are open and a Session exists.
		mustUnlock(t, mustLockOf(t, ctx, b, HashKey("race", "warm")))
		sess, err := b.NewSession(ctx)
		if err != nil {
			t.Fatal(err)
		}
		free := HashKey("race", fmt.Sprint("free", i))
		ctxs := ctxKinds(t, time.Duration(1+i%4)*300*time.Millisecond)
		type ended struct {
			name string
			l    *Lock
			err  error
		}
		go1 := make(chan struct{})
		var wg sync.WaitGroup
		results := make(chan ended, 64)
		for kind, cctx := range ctxs {
			for name, call := range map[string]func() (*Lock, error){
				"Lock free":    func() (*Lock, error) { return b.Lock(cctx, free) },
				"Lock busy":    func() (*Lock, error) { return b.Lock(cctx, busy) },
				"RLock busy":   func() (*Lock, error) { return b.RLock(cctx, busy) },
				"TryLock free": func() (*Lock, error) { return b.TryLock(cctx, free) },
				"Session busy": func() (*Lock, error) { return sess.Lock(cctx, busy) },
				"Session free": func() (*Lock, error) { return sess.Lock(cctx, free) },
				"Sem.Acquire": func() (*Lock, error) {
					_, err := b.Semaphore("race", 1).Acquire(cctx)
					return nil, err
				},
			} {
				wg.Go(func() {
					<-go1
					l, err := call()
					results <- ended{name + " (" + kind + ")", l, err}
				})
			}
		}
		close(go1)
		closed := make(chan error, 1)
		go func() { closed <- b.Close(context.Background()) }()
		wg.Wait()
		close(results)
		if err := <-closed; err != nil {
			t.Errorf("Close: %v", err)
		}
		for r := range results {
			switch {
			case r.err == nil && r.l != nil:
				if err := r.l.Err(); !errors.Is(err, ErrClosed) {
					t.Errorf("%s: a lock taken as Close began: Err %v after Close, want ErrClosed", r.name, err)
				}
			case r.err == nil:
				t.Errorf("%s: succeeded on a held key or a full semaphore", r.name)
			case errors.Is(r.err, ErrClosed):
			case errors.Is(r.err, context.DeadlineExceeded):
				// A near deadline may come before Close.
			case errors.Is(r.err, ErrLocked) && r.name[:len("TryLock")] == "TryLock":
				// Another goroutine here took the free key first.
			default:
				t.Errorf("%s racing Close: %v, want ErrClosed", r.name, r.err)
			}
		}
		pgtest.Eventually(t, 5*time.Second, "the closed Client left locks in pg_locks", func() bool {
			st := lockState(t, dsn)
			return len(st[free]) == 0 && len(st[busy]) == 1
		})
	}
}

// Promise (acquire): an acquire whose ctx has already ended, cancelled with
// a cause or past its deadline, ends with ctx's cause (or takes the key, if
// free: a race the caller could not see), and leaves nothing held or
// waiting; the Client stays usable.
func TestEndedContextEndsAcquireWithItsCauseAndHoldsNothing(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	a := newTestClient(t, dsn)
	busy, free := HashKey("ended", "busy"), HashKey("ended", "free")
	held := mustLockOf(t, ctx, a, busy)
	defer func() { mustUnlock(t, held) }()
	permit, err := a.Semaphore("ended", 1).Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer permit.Release(ctx)
	b := newTestClient(t, dsn)
	// Warm up: backends open, statements prepared.
	mustUnlock(t, mustLockOf(t, ctx, b, free))
	sess, err := b.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close(ctx)
	cause := errors.New("the caller gave up")
	took := 0
	for i := range 40 {
		var cctx context.Context
		var want error
		if i%2 == 0 {
			c, cancel := context.WithCancelCause(context.Background())
			cancel(cause)
			cctx, want = c, cause
		} else {
			c, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Millisecond))
			defer cancel()
			cctx, want = c, context.DeadlineExceeded
		}
		for name, call := range map[string]func() (*Lock, error){
			"Lock busy":     func() (*Lock, error) { return b.Lock(cctx, busy) },
			"fenced busy":   func() (*Lock, error) { return b.Lock(cctx, busy, WithFence()) },
			"RLock busy":    func() (*Lock, error) { return b.RLock(cctx, busy) },
			"LockAll busy":  func() (*Lock, error) { return b.LockAll(cctx, free, busy) },
			"Session busy":  func() (*Lock, error) { return sess.Lock(cctx, busy) },
			"Lock free":     func() (*Lock, error) { return b.Lock(cctx, free) },
			"TryLock free":  func() (*Lock, error) { return b.TryLock(cctx, free) },
			"Session free":  func() (*Lock, error) { return sess.Lock(cctx, free) },
			"LockAll free2": func() (*Lock, error) { return b.LockAll(cctx, free, HashKey("ended", "free2")) },
			"Sem.Acquire": func() (*Lock, error) {
				_, err := b.Semaphore("ended", 1).Acquire(cctx)
				return nil, err
			},
		} {
			l, err := call()
			switch {
			case err == nil && l != nil:
				took++
				mustUnlock(t, l)
			case err == nil:
				t.Fatalf("%s with an ended ctx: succeeded on a held key or a full semaphore", name)
			case !errors.Is(err, want):
				t.Fatalf("%s with an ended ctx: %v, want it to wrap %v", name, err, want)
			}
			st := lockState(t, dsn)
			if len(st[free]) != 0 || len(st[HashKey("ended", "free2")]) != 0 || len(st[busy]) != 1 {
				t.Fatalf("%s with an ended ctx (%v) left locks: free %+v busy %+v", name, err, st[free], st[busy])
			}
		}
	}
	t.Logf("%d acquires with an ended ctx took a free key", took)
	// The Client still works: nothing is stuck holding a turn or a backend.
	mustUnlock(t, mustLockOf(t, ctx, b, free))
	l, err := sess.Lock(ctx, free)
	if err != nil {
		t.Fatal(err)
	}
	mustUnlock(t, l)
	done := goLock(func() (*Lock, error) { return b.Lock(ctx, busy) })
	pgtest.Eventually(t, 10*time.Second, "the Lock of a held key does not wait", func() bool { return waitingOn(t, dsn, busy) == 1 })
	mustUnlock(t, held)
	r := receive(t, done)
	if r.err != nil {
		t.Fatal(r.err)
	}
	mustUnlock(t, r.l)
	held = mustLockOf(t, ctx, a, busy)
}

// Promise (acquire): many acquires of a held key, whose deadlines fall
// within a wait slice (so the server ends each slice at the deadline),
// all end with context.DeadlineExceeded, none later than a little past its
// deadline, and leave nobody waiting; the key goes to the next acquire at
// once when it is freed.
func TestNearDeadlinesEndWaitsWithDeadlineExceededAndLeaveNothing(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	a := newTestClient(t, dsn)
	busy := HashKey("near", "busy")
	held := mustLockOf(t, ctx, a, busy)
	b := newTestClient(t, dsn, WithMaxWaits(8))
	sess, err := b.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close(ctx)
	for round := range 3 {
		var wg sync.WaitGroup
		for i := range 16 {
			wg.Go(func() {
				d := time.Duration(1+(i*7+round*3)%25) * 10 * time.Millisecond
				cctx, cancel := context.WithTimeout(context.Background(), d)
				defer cancel()
				start := time.Now()
				var err error
				switch i % 4 {
				case 0:
					_, err = b.Lock(cctx, busy)
				case 1:
					_, err = b.RLock(cctx, busy)
				case 2:
					_, err = sess.Lock(cctx, busy)
				case 3:
					_, err = b.Lock(cctx, busy, WithFence())
				}
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("acquire %d with a %v deadline: %v, want DeadlineExceeded", i, d, err)
				}
				if late := time.Since(start) - d; late > 1500*time.Millisecond {
					t.Errorf("acquire %d with a %v deadline returned %v late", i, d, late)
				}
			})
		}
		wg.Wait()
		pgtest.Eventually(t, 5*time.Second, "waits left after their deadlines", func() bool {
			return waitingOn(t, dsn, busy) == 0
		})
		heldOnlyBy(t, dsn, busy, grantedTo(t, dsn, busy)[0])
	}
	done := goLock(func() (*Lock, error) { return b.Lock(ctx, busy) })
	pgtest.Eventually(t, 10*time.Second, "the Lock of a held key does not wait", func() bool { return waitingOn(t, dsn, busy) == 1 })
	mustUnlock(t, held)
	r := receive(t, done)
	if r.err != nil {
		t.Fatal(r.err)
	}
	mustUnlock(t, r.l)
}
