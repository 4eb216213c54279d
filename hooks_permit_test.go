package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// permitRecorder collects the events of OnPermit, and those of the lock
// hooks, which permits must not reach.
type permitRecorder struct {
	mu      sync.Mutex
	permits []PermitEvent
	locks   int // OnAcquire, OnRelease, OnContention and OnLoss events
}

func (r *permitRecorder) hooks() Hooks {
	lock := func() { r.mu.Lock(); r.locks++; r.mu.Unlock() }
	return Hooks{
		OnPermit:     func(e PermitEvent) { r.mu.Lock(); r.permits = append(r.permits, e); r.mu.Unlock() },
		OnAcquire:    func(AcquireEvent) { lock() },
		OnRelease:    func(ReleaseEvent) { lock() },
		OnContention: func(ContentionEvent) { lock() },
		OnLoss:       func(LossEvent) { lock() },
	}
}

func (r *permitRecorder) events() []PermitEvent {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]PermitEvent(nil), r.permits...)
}

// until waits, bounded, for n permit events and returns them.
func (r *permitRecorder) until(t *testing.T, n int) []PermitEvent {
	t.Helper()
	pgtest.Eventually(t, testTimeout, "permit events", func() bool { return len(r.events()) >= n })
	evs := r.events()
	if len(evs) != n {
		t.Fatalf("%d permit events, want %d: %+v", len(evs), n, evs)
	}
	return evs
}

// holderPID returns the backend that holds slot of sem, from pg_locks.
func holderPID(t *testing.T, dsn string, sem *Semaphore, slot int) int32 {
	t.Helper()
	slots, _ := slotLocks(t, dsn, sem)
	pid := slots[slot]
	if pid == 0 {
		t.Fatalf("pg_locks: no backend holds slot %d of %s (slots %v)", slot, sem.name, slots)
	}
	return pid
}

// OnPermit sees each acquire with its wait and result, each release with
// its hold time, a loss when the permit's backend is terminated, and the
// release of a permit that Close ends, before Close returns; permits never
// reach the lock hooks.
func TestHookPermitEvents(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	var rec permitRecorder
	c := newTestClient(t, dsn, WithHooks(rec.hooks()))
	sem := c.Semaphore("exports", 1)

	p := mustAcquire(t, sem, true)
	evs := rec.until(t, 1)
	if e := evs[0]; e.Kind != PermitAcquired || e.Semaphore != "exports" || !e.Try || e.Err != nil ||
		e.Slot != p.Slot() || e.PID != holderPID(t, dsn, sem, p.Slot()) || e.Wait <= 0 {
		t.Errorf("acquire event %+v", e)
	}

	// A refused try.
	if _, err := sem.TryAcquire(ctx); !errors.Is(err, ErrNoPermit) {
		t.Fatalf("TryAcquire with the only permit held = %v, want ErrNoPermit", err)
	}
	evs = rec.until(t, 2)
	if e := evs[1]; e.Kind != PermitAcquired || !errors.Is(e.Err, ErrNoPermit) || e.Slot != -1 || e.PID != 0 || !e.Try {
		t.Errorf("refused try: event %+v", e)
	}

	// A blocking acquire that waits for the release.
	waiting := goAcquire(ctx, sem)
	awaitHead(t, dsn, sem)
	mustRelease(t, p)
	r := receivePermit(t, waiting)
	if r.err != nil {
		t.Fatal(r.err)
	}
	evs = rec.until(t, 4)
	if e := evs[2]; e.Kind != PermitReleased || e.Err != nil || e.Slot != p.Slot() || e.Held <= 0 || e.Semaphore != "exports" {
		t.Errorf("release event %+v", e)
	}
	if e := evs[3]; e.Kind != PermitAcquired || e.Err != nil || e.Try || e.Slot != r.p.Slot() || e.Wait <= 0 {
		t.Errorf("acquire after a wait: event %+v", e)
	}

	// A loss.
	pid := holderPID(t, dsn, sem, r.p.Slot())
	if evs[3].PID != pid {
		t.Errorf("acquire event's PID %d, pg_locks says %d", evs[3].PID, pid)
	}
	pgtest.Terminate(t, dsn, pid)
	select {
	case <-r.p.Done():
	case <-ctx.Done():
		t.Fatal("the permit of a terminated backend did not end")
	}
	evs = rec.until(t, 5)
	if e := evs[4]; e.Kind != PermitLost || !errors.Is(e.Err, ErrLockLost) || e.PID != pid || e.Slot != r.p.Slot() || e.Held <= 0 {
		t.Errorf("loss event %+v", e)
	}
	if err := r.p.Release(ctx); !errors.Is(err, ErrLockLost) {
		t.Errorf("Release of a lost permit = %v, want ErrLockLost", err)
	}

	// Close ends the last permit and delivers its release before it
	// returns.
	mustAcquire(t, sem, false)
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	evs = rec.events()
	if len(evs) != 7 || evs[5].Kind != PermitAcquired || evs[6].Kind != PermitReleased || !errors.Is(evs[6].Err, ErrClosed) {
		t.Errorf("after Close: %+v", evs)
	}
	for _, e := range evs {
		if e.Kind.String() == "" || e.Semaphore != "exports" {
			t.Errorf("event %+v", e)
		}
	}
	rec.mu.Lock()
	if rec.locks != 0 {
		t.Errorf("%d lock events for permits, want none", rec.locks)
	}
	rec.mu.Unlock()
}

// Under concurrent acquires, releases, a terminated backend and Close,
// every permit that an acquire returned ends in exactly one release or
// loss event.
func TestHookPermitEveryPermitEndsOnce(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	var rec permitRecorder
	c := newTestClient(t, dsn, WithHooks(rec.hooks()))
	sem := c.Semaphore("busy", 2)

	const workers, rounds = 4, 15
	var wg sync.WaitGroup
	terminated := make(chan struct{})
	for i := range workers {
		wg.Go(func() {
			for j := range rounds {
				p, err := sem.Acquire(ctx)
				if err != nil {
					t.Error(err)
					return
				}
				if i == 0 && j == rounds/2 {
					// Lose this permit (and whatever else shares its
					// backend).
					if pid := holderPIDOf(t, dsn, sem, p); pid != 0 {
						pgtest.Terminate(t, dsn, pid)
						select {
						case <-p.Done():
						case <-ctx.Done():
							t.Error("the permit of a terminated backend did not end")
						}
					}
					close(terminated)
				}
				if err := p.Release(ctx); err != nil && !errors.Is(err, ErrLockLost) {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	<-terminated
	// A permit left held for Close to end.
	mustAcquire(t, sem, false)
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}

	type permitID struct {
		slot int
		pid  int32
	}
	open := map[permitID]int{} // acquire events minus end events, by slot and backend
	var acquired, released, lost int
	for _, e := range rec.events() {
		id := permitID{e.Slot, e.PID}
		switch e.Kind {
		case PermitAcquired:
			if e.Err != nil {
				t.Errorf("acquire failed: %+v", e)
				continue
			}
			open[id]++
			acquired++
		case PermitReleased:
			open[id]--
			released++
		case PermitLost:
			open[id]--
			lost++
		default:
			t.Errorf("event of kind %v", e.Kind)
		}
	}
	for id, n := range open {
		if n != 0 {
			t.Errorf("slot %d on backend %d: %d more acquires than ends", id.slot, id.pid, n)
		}
	}
	if acquired != workers*rounds+1 || acquired != released+lost || lost == 0 {
		t.Errorf("%d acquired, %d released, %d lost: want %d acquired, each ended once, at least one lost",
			acquired, released, lost, workers*rounds+1)
	}
}

// holderPIDOf returns the backend that holds p, held now, from pg_locks,
// or 0 with an error reported.
func holderPIDOf(t *testing.T, dsn string, sem *Semaphore, p *Permit) int32 {
	slots, _ := slotLocks(t, dsn, sem)
	if slots[p.Slot()] == 0 {
		t.Errorf("pg_locks: no backend holds slot %d of %s", p.Slot(), sem.name)
	}
	return slots[p.Slot()]
}

// WithHooks works as any Option does when the caller wraps it (a type of
// its own that embeds the Option): the permit events come all the same,
// and a later WithHooks, wrapped or not, replaces the earlier one whole,
// so that a Client whose last WithHooks sets no hook takes its permits
// and reports nothing.
func TestHookPermitEventsThroughWrappedOption(t *testing.T) {
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	type wrapped struct{ Option }

	var rec permitRecorder
	c := newTestClient(t, dsn, wrapped{WithHooks(rec.hooks())})
	p := mustAcquire(t, c.Semaphore("wrapped", 1), true)
	mustRelease(t, p)
	if evs := rec.until(t, 2); evs[0].Kind != PermitAcquired || evs[1].Kind != PermitReleased {
		t.Errorf("events through a wrapped WithHooks: %+v", evs)
	}

	var first permitRecorder
	replaced := newTestClient(t, dsn, WithHooks(first.hooks()), wrapped{WithHooks(Hooks{})})
	var err error
	func() {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("panic: %v", r)
			}
		}()
		var q *Permit
		if q, err = replaced.Semaphore("wrapped", 1).TryAcquire(ctx); err == nil {
			err = q.Release(ctx)
		}
	}()
	if err != nil {
		t.Fatalf("TryAcquire and Release on a Client whose last WithHooks sets no hook: %v", err)
	}
	if err := replaced.Close(ctx); err != nil { // delivers what was queued
		t.Fatal(err)
	}
	if evs := first.events(); len(evs) != 0 {
		t.Errorf("the replaced WithHooks got permit events: %+v", evs)
	}
}
