package pgcoord

// Tests of Close (Client.Close, Session.Close): it is bounded by its ctx or
// the loss deadline even on a silent network, ends every lock and waiting
// acquire, and leaves nothing behind in pg_locks or in goroutines.

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
	"go.uber.org/goleak"
)

// Promise (Session.Close): ctx bounds Close; if ctx ends first, Close closes
// the socket instead and returns an error.
//
// On a silent network, Close's pg_advisory_unlock_all() is cut by ctx only
// through the cancel handler, which waits the loss deadline after the
// cancel before the socket's deadline ends the statement.
func TestSessionCloseBoundedByCtxOnSilentNetwork(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	proxy := pgtest.NewProxy(t, dsn)
	const loss, hb = 4 * time.Second, 2 * time.Second
	c := newTestClientOn(t, pgtest.Pool(t, dsn, proxy.Route), WithLossDeadline(loss), WithHeartbeat(hb))
	s, err := c.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	k := Int64Key(7301)
	if _, err := s.Lock(ctx, k); err != nil {
		t.Fatal(err)
	}
	// Right after a heartbeat was answered, so that none is in flight.
	s.core.State.Lock()
	last := s.core.LastOK
	s.core.State.Unlock()
	pgtest.Eventually(t, 10*time.Second, "a heartbeat", func() bool {
		s.core.State.Lock()
		defer s.core.State.Unlock()
		return s.core.LastOK.After(last)
	})
	proxy.Blackhole()
	t.Cleanup(proxy.CloseAll) // end the partition before the Client's and the database's cleanup
	const bound = 200 * time.Millisecond
	cctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	start := time.Now()
	err = s.Close(cctx)
	took := time.Since(start)
	if took > bound+time.Second {
		t.Fatalf("broken promise: Session.Close with a %v ctx on a silent network took %v (err %v): "+
			"ctx ended the unlock_all statement only through cancelHandler, whose socket deadline comes the loss deadline %v after the cancel",
			bound, took.Round(time.Millisecond), err, loss)
	}
	if err == nil {
		t.Fatal("Close returned nil without confirming the release")
	}
}

// Promise (Client.Close): each connection's release is bounded by the loss
// deadline; one that cannot be released cleanly in that time is closed.
func TestClientCloseReleaseBoundedByLossDeadlineOnSilentNetwork(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	proxy := pgtest.NewProxy(t, dsn)
	const loss, hb = 2 * time.Second, time.Second
	c, err := New(pgtest.Pool(t, dsn, proxy.Route), WithLossDeadline(loss), WithHeartbeat(hb), WithSharedBackends(1))
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			_ = c.Close(context.Background())
		}
	})
	l, err := c.Lock(ctx, Int64Key(7401))
	if err != nil {
		t.Fatal(err)
	}
	s := l.core.S
	s.State.Lock()
	last := s.LastOK
	s.State.Unlock()
	pgtest.Eventually(t, 10*time.Second, "a heartbeat", func() bool {
		s.State.Lock()
		defer s.State.Unlock()
		return s.LastOK.After(last)
	})
	proxy.Blackhole()
	t.Cleanup(proxy.CloseAll) // end the partition before the database's cleanup
	start := time.Now()
	err = c.Close(context.Background())
	closed = true
	took := time.Since(start)
	if took > loss+500*time.Millisecond {
		t.Fatalf("broken promise: Client.Close of one connection on a silent network took %v (err %v), more than the loss deadline %v that bounds each connection's release: "+
			"Session.close's statement is cut only by cancelHandler, whose socket deadline comes another loss deadline after the cancel",
			took.Round(time.Millisecond), err, loss)
	}
}

// Promises (Client.Close, lock.go): Close during a burst of acquires ends
// every lock and makes every acquire return, leaves no goroutine behind and
// returns within the loss deadline per connection; the Lock's bookkeeping of
// its in-process gates is decided once, under its mutex (claimGates against
// end), so the race detector sees no unsynchronised access.
func TestClientCloseDuringAcquiresLeavesNothing(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	ignore := goleak.IgnoreCurrent()
	const rounds, workers = 15, 8
	for round := range rounds {
		pool := pgtest.Pool(t, dsn)
		c, err := New(pool, WithSharedBackends(1), WithMaxWaits(1), WithLossDeadline(time.Second), WithHeartbeat(250*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		locked := 0
		enough := make(chan struct{})
		for w := range workers {
			k := Int64Key(int64(7500 + w))
			wg.Go(func() {
				for {
					l, err := c.Lock(ctx, k)
					if err != nil {
						if !errors.Is(err, ErrClosed) {
							t.Errorf("Lock during Close: %v, want ErrClosed", err)
						}
						return
					}
					mu.Lock()
					if locked++; locked == 4*workers {
						close(enough)
					}
					mu.Unlock()
					if err := l.Unlock(ctx); err != nil && !errors.Is(err, ErrClosed) && !errors.Is(err, ErrNotHeld) {
						t.Errorf("Unlock during Close: %v", err)
						return
					}
				}
			})
		}
		select {
		case <-enough:
		case <-time.After(testTimeout):
			t.Fatal("no locks taken")
		}
		start := time.Now()
		if err := c.Close(context.Background()); err != nil {
			t.Errorf("round %d: Close: %v", round, err)
		}
		if took := time.Since(start); took > time.Second+500*time.Millisecond {
			t.Errorf("round %d: Close took %v, more than the loss deadline", round, took)
		}
		wg.Wait()
		pool.Close()
		for w := range workers {
			notHeld(t, dsn, Int64Key(int64(7500+w)))
		}
		if t.Failed() {
			return
		}
	}
	if err := goleak.Find(ignore); err != nil {
		t.Fatalf("broken promise: goroutines left after Client.Close: %v", err)
	}
}
