package pgcoord

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"
)

// The hooks count the user's locks only: a semaphore's queue place and
// permits and an election's lock and guard (with campaign rounds that end
// unfinished while another candidate leads) report nothing to OnAcquire,
// OnContention, OnRelease or OnLoss, so a gauge built on the hooks
// (acquires - releases - losses) stays equal to the user's locks held. The
// elections report OnLeadership, a start and an end for each term.
func TestHooksReportOnlyTheUsersLocks(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	var mu sync.Mutex
	var events []string
	record := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		events = append(events, fmt.Sprintf(format, args...))
	}
	gauge, acquires, contentions := 0, 0, 0
	leading := map[string]int{}
	hooks := Hooks{
		OnAcquire: func(ev AcquireEvent) {
			record("acquire %v: %v", ev.Keys, ev.Err)
			mu.Lock()
			defer mu.Unlock()
			acquires++
			if ev.Err == nil {
				gauge++
			}
		},
		OnRelease: func(ev ReleaseEvent) {
			record("release %v", ev.Keys)
			mu.Lock()
			defer mu.Unlock()
			gauge--
		},
		OnLoss: func(ev LossEvent) {
			record("loss %v: %v", ev.Keys, ev.Err)
			mu.Lock()
			defer mu.Unlock()
			gauge--
		},
		OnContention: func(ev ContentionEvent) {
			record("contention %v", ev.Keys)
			mu.Lock()
			defer mu.Unlock()
			contentions++
		},
		OnLeadership: func(ev LeadershipEvent) {
			record("leadership %s term %d leading %v", ev.Election, ev.Term, ev.Leading)
			mu.Lock()
			defer mu.Unlock()
			if ev.Leading {
				leading[ev.Election]++
			} else {
				leading[ev.Election]--
			}
		},
	}
	const loss = time.Second
	c := newTestClient(t, dsn, WithHooks(hooks), WithLossDeadline(loss), WithHeartbeat(250*time.Millisecond))

	// A semaphore: a permit, a waiter that heads the queue, the permit
	// passed on.
	sem := c.Semaphore("hooks", 1)
	p1 := mustAcquire(t, sem, false)
	waiter := goAcquire(ctx, sem)
	awaitHead(t, dsn, sem)
	mustRelease(t, p1)
	r := receivePermit(t, waiter)
	if r.err != nil {
		t.Fatal(r.err)
	}
	mustRelease(t, r.p)

	// An election: a follower of the same Client campaigns for more than
	// two campaign rounds while the leader leads.
	lead, errc := c.Election("hooks").Campaign(ctx)
	if errc != nil {
		t.Fatal(errc)
	}
	won := make(chan *Leadership, 1)
	go func() {
		ld, err := c.Election("hooks").Campaign(ctx)
		if err != nil {
			t.Error(err)
		}
		won <- ld
	}()
	// Campaign rounds last a loss deadline each: let more than two end.
	select {
	case ld := <-won:
		t.Fatalf("the follower led (term %d) while the leader of term %d led", ld.Term(), lead.Term())
	case <-time.After(5 * c.Election("hooks").campaignRound() / 2):
	}
	if err := lead.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	follower := <-won
	if err := follower.Resign(ctx); err != nil {
		t.Fatal(err)
	}

	// One lock of the user's.
	l, err := c.Lock(ctx, HashKey("hooks", "user"))
	if err != nil {
		t.Fatal(err)
	}
	mustUnlock(t, l)
	if err := c.Close(context.Background()); err != nil { // delivers the queued events
		t.Fatal(err)
	}

	mu.Lock()
	defer mu.Unlock()
	if acquires != 1 || gauge != 0 || contentions != 0 || leading["hooks"] != 0 {
		t.Fatalf("acquires %d (want 1: the user's lock), gauge %d (want 0), contentions %d (want 0), leaderships open %d (want 0); events:\n%v",
			acquires, gauge, contentions, leading["hooks"], events)
	}
}
