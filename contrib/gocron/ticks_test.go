package pgcoordgocron_test

import (
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord"
	pgcoordgocron "github.com/pgcoord/pgcoord/contrib/gocron"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// clock is a settable clock for WithClock. With a sequence set, each
// reading takes the next time of it (the last one repeats).
type clock struct {
	mu  sync.Mutex
	seq []time.Time
}

func (c *clock) set(ts ...time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seq = ts
}

func (c *clock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := c.seq[0]
	if len(c.seq) > 1 {
		c.seq = c.seq[1:]
	}
	return t
}

// TestTickOf: ticks are the nearest multiples of the interval since the
// epoch, each window half-open: [n·I − I/2, n·I + I/2).
func TestTickOf(t *testing.T) {
	const i = 100 * time.Millisecond
	at := func(d time.Duration) time.Time { return time.Unix(0, int64(d)) }
	for _, tc := range []struct {
		t    time.Time
		want int64
	}{
		{at(0), 0},
		{at(49 * time.Millisecond), 0},
		{at(50*time.Millisecond - 1), 0},
		{at(50 * time.Millisecond), 1},
		{at(149 * time.Millisecond), 1},
		{at(150 * time.Millisecond), 2},
		{at(-50 * time.Millisecond), 0},
		{at(-50*time.Millisecond - 1), -1},
		{at(-150 * time.Millisecond), -1},
		{time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC).Add(-time.Nanosecond), time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano() / int64(i)},
	} {
		if got := pgcoordgocron.TickOf(tc.t, i); got != tc.want {
			t.Errorf("TickOf(%v) = %d, want %d", time.Duration(tc.t.UnixNano()), got, tc.want)
		}
	}
	// An odd interval: the window of tick 1 of 3ns is [2ns, 5ns).
	for ns, want := range map[int64]int64{1: 0, 2: 1, 4: 1, 5: 2} {
		if got := pgcoordgocron.TickOf(time.Unix(0, ns), 3); got != want {
			t.Errorf("TickOf(%dns, 3ns) = %d, want %d", ns, got, want)
		}
	}
}

// TestLockerTickKeyIsFrozen pins the key of a tick.
func TestLockerTickKeyIsFrozen(t *testing.T) {
	lk := keyLocker(t, pgcoordgocron.WithKeyPrefix("billing"), pgcoordgocron.WithTicks(time.Minute))
	if got, want := lk.TickKey("reports", 29462400), pgcoord.HashKey("pgcoord.gocron.tick", "billing", "reports", "29462400"); got != want {
		t.Errorf("TickKey = %v, want %v", got, want)
	}
	if got, want := keyLocker(t).TickKey("reports", 29462400).String(), goldenReportsTickKey; got != want {
		t.Errorf("TickKey(reports, 29462400) = %s, want %s", got, want)
	}
	if lk.Interval() != time.Minute || lk.MinHold() != 0 {
		t.Errorf("Interval, MinHold = %v, %v; want 1m, 0", lk.Interval(), lk.MinHold())
	}
}

// goldenReportsTickKey is the key of tick 29462400 of job "reports"
// without a prefix, computed once: it must never change.
const goldenReportsTickKey = "int64:3319612606898933416"

// TestLockerTicks: two schedulers (two Clients) calling Lock at moments
// of the tick grid. The first call in tick n's window takes tick n's lock;
// a second one anywhere in the same window is refused, whichever Client
// makes it; a call past the window takes the next tick's lock of its own.
// The locks are the tick keys in pg_locks, held after Unlock for the
// interval (an hour here), and released by Close.
func TestLockerTicks(t *testing.T) {
	dsn := pgtest.DB(t)
	const i = time.Hour
	var ca, cb clock
	a := newLocker(t, newClient(t, dsn, "a"), pgcoordgocron.WithTicks(i), pgcoordgocron.WithClock(ca.now))
	b := newLocker(t, newClient(t, dsn, "b"), pgcoordgocron.WithTicks(i), pgcoordgocron.WithClock(cb.now))
	ctx := ctxT(t)
	tickAt := time.Date(2030, 1, 1, 12, 0, 0, 0, time.UTC)
	n := tickAt.UnixNano() / int64(i)

	lock := func(lk *pgcoordgocron.Locker, c *clock, at ...time.Time) (*pgcoordgocron.JobLock, error) {
		t.Helper()
		c.set(at...)
		l, err := lk.Lock(ctx, "job")
		if err != nil {
			return nil, err
		}
		return l.(*pgcoordgocron.JobLock), nil
	}
	// a is early, by the most the window allows.
	la, err := lock(a, &ca, tickAt.Add(-i/2))
	if err != nil {
		t.Fatalf("first Lock of the tick: %v", err)
	}
	if got, ok := la.Tick(); got != n || !ok || la.Key() != a.TickKey("job", n) {
		t.Fatalf("JobLock.Tick, Key = %d, %v, %v; want %d, true, %v", got, ok, la.Key(), n, a.TickKey("job", n))
	}
	if err := la.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	pa := holder(t, dsn, a.TickKey("job", n))
	if pa == 0 {
		t.Fatal("tick's lock not in pg_locks after Unlock: the hold of one and a half intervals was not kept")
	}
	for _, at := range []time.Time{tickAt.Add(-i / 2), tickAt, tickAt.Add(i/2 - time.Nanosecond)} {
		for name, lk := range map[string]*pgcoordgocron.Locker{"a": a, "b": b} {
			c := map[string]*clock{"a": &ca, "b": &cb}[name]
			if _, err := lock(lk, c, at); !errors.Is(err, pgcoord.ErrLocked) || !strings.Contains(err.Error(), "tick") {
				t.Errorf("Lock by %s at tick%+v, same tick: %v, want ErrLocked naming the tick", name, at.Sub(tickAt), err)
			}
		}
	}
	// b is late, past the window: the next tick, a lock of its own.
	lb, err := lock(b, &cb, tickAt.Add(i/2))
	if err != nil {
		t.Fatalf("Lock past the window: %v", err)
	}
	if got, _ := lb.Tick(); got != n+1 {
		t.Fatalf("Lock past the window locked tick %d, want %d", got, n+1)
	}
	pb := holder(t, dsn, a.TickKey("job", n+1))
	if pb == 0 || pb == pa || holder(t, dsn, a.TickKey("job", n)) != pa {
		t.Fatalf("holders of ticks n, n+1 = %d, %d; want both held, by the two Clients' backends", holder(t, dsn, a.TickKey("job", n)), pb)
	}
	// a, on time for tick n+1, finds it run already.
	if _, err := lock(a, &ca, tickAt.Add(i)); !errors.Is(err, pgcoord.ErrLocked) {
		t.Fatalf("Lock on time for a tick run early elsewhere = %v, want ErrLocked", err)
	}
	// While b's run of tick n+1 goes on, the job's lock is held, and a's
	// Lock of tick n+2 is refused and gives that tick's lock back.
	if holder(t, dsn, a.Key("job")) == 0 {
		t.Fatal("the job's lock is not held during the run")
	}
	if _, err := lock(a, &ca, tickAt.Add(2*i)); !errors.Is(err, pgcoord.ErrLocked) || !strings.Contains(err.Error(), "earlier tick") {
		t.Fatalf("Lock of the next tick during a run = %v, want ErrLocked for the run going on", err)
	}
	if p := holder(t, dsn, a.TickKey("job", n+2)); p != 0 {
		t.Fatalf("tick n+2's lock still held by backend %d after a refused Lock", p)
	}
	if err := lb.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if p := holder(t, dsn, a.Key("job")); p != 0 {
		t.Fatalf("the job's lock still held by backend %d after the run's Unlock", p)
	}
	if holder(t, dsn, a.TickKey("job", n+1)) != pb {
		t.Fatal("tick n+1's lock was released with the run, before its hold")
	}
	// The run over, a still runs tick n+2 within its window.
	l2, err := lock(a, &ca, tickAt.Add(2*i+i/4))
	if err != nil {
		t.Fatalf("Lock of tick n+2 after the run ended: %v", err)
	}
	if err := l2.Unlock(ctx); err != nil {
		t.Fatal(err)
	}

	// Close releases the held ticks now.
	if err := a.Close(ctx); err != nil {
		t.Fatal(err)
	}
	for _, k := range []int64{n, n + 2} {
		if p := holder(t, dsn, a.TickKey("job", k)); p != 0 {
			t.Fatalf("tick n%+d's lock still held by backend %d after Close", k-n, p)
		}
	}
	// A lock of tick n that b could take only after its window ended
	// (the clock reads the window's start, then its end) is refused and
	// given back.
	if _, err := lock(b, &cb, tickAt.Add(-i/2), tickAt.Add(i/2)); !errors.Is(err, pgcoordgocron.ErrTickPassed) {
		t.Fatalf("Lock taken after the tick's window = %v, want ErrTickPassed", err)
	}
	if p := holder(t, dsn, a.TickKey("job", n)); p != 0 {
		t.Fatalf("the lock taken too late is still held by backend %d", p)
	}
	if holder(t, dsn, a.TickKey("job", n+1)) != pb {
		t.Fatal("tick n+1 lost its holder")
	}
}

// TestLockerTickHold: with the real clock, Unlock returns at once, the
// tick's lock stays held (pg_locks) until one and a half intervals after
// the call of Lock, and is then released. The tick is the one nearest to the call.
func TestLockerTickHold(t *testing.T) {
	dsn := pgtest.DB(t)
	c := newClient(t, dsn, "locker")
	other := newClient(t, dsn, "other")
	const i = 2 * time.Second
	lk := newLocker(t, c, pgcoordgocron.WithTicks(i))
	ctx := ctxT(t)

	// Lock with half the interval left in the tick's window, so that the
	// round trip ends inside it: one that ends past it is given back with
	// ErrTickPassed (TestLockerTickWindowEdges), and a call a few
	// milliseconds before the window's end would meet that.
	pgtest.Eventually(t, i, "a tick window with half the interval left", func() bool {
		now := time.Now()
		end := time.Unix(0, pgcoordgocron.TickOf(now, i)*int64(i)+int64(i)/2)
		return end.Sub(now) >= i/2
	})
	start := time.Now()
	gl, err := lk.Lock(ctx, "job")
	if err != nil {
		t.Fatal(err)
	}
	after := time.Now()
	l := gl.(*pgcoordgocron.JobLock)
	n, _ := l.Tick()
	if lo, hi := pgcoordgocron.TickOf(start, i), pgcoordgocron.TickOf(after, i); n < lo || n > hi {
		t.Fatalf("locked tick %d, want the tick nearest the call, %d..%d", n, lo, hi)
	}
	unlockStart := time.Now()
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(unlockStart); took >= i/2 {
		t.Fatalf("Unlock blocked for %v; it must return at once and release in the background", took)
	}
	if holder(t, dsn, lk.TickKey("job", n)) == 0 {
		t.Fatalf("the tick's lock was released %v after Lock, before the interval %v", time.Since(start), i)
	}
	if _, err := other.TryLock(ctx, lk.TickKey("job", n)); !errors.Is(err, pgcoord.ErrLocked) {
		t.Fatalf("another Client's TryLock of the tick during its hold = %v, want ErrLocked", err)
	}
	if err := l.Unlock(ctx); !errors.Is(err, pgcoord.ErrNotHeld) {
		t.Fatalf("second Unlock = %v, want ErrNotHeld", err)
	}
	hold := i + i/2
	pgtest.Eventually(t, hold+testTimeout, "the tick's lock to be released after its hold", func() bool {
		return holder(t, dsn, lk.TickKey("job", n)) == 0
	})
	if held := time.Since(start); held < hold {
		t.Fatalf("released after %v, before the hold %v (interval %v)", held, hold, i)
	}
	t.Logf("released %v after Lock (interval %v, hold %v)", time.Since(start).Round(time.Millisecond), i, hold)
}

// TestLockerTickOptionErrors: invalid intervals and a minimum hold with
// ticks are reported by Lock, saying what was wrong.
func TestLockerTickOptionErrors(t *testing.T) {
	dsn := pgtest.DB(t)
	c := newClient(t, dsn, "locker")
	for _, tc := range []struct {
		name string
		opts []pgcoordgocron.LockerOption
		want string
	}{
		{"zero interval", []pgcoordgocron.LockerOption{pgcoordgocron.WithTicks(0)}, "WithTicks: the interval must be at least 1ms"},
		{"short interval", []pgcoordgocron.LockerOption{pgcoordgocron.WithTicks(time.Microsecond)}, "got 1µs"},
		{"min hold too", []pgcoordgocron.LockerOption{pgcoordgocron.WithTicks(time.Second), pgcoordgocron.WithMinHold(time.Second)}, "exclude each other"},
		{"nil clock", []pgcoordgocron.LockerOption{pgcoordgocron.WithClock(nil)}, "nil clock"},
	} {
		lk, err := pgcoordgocron.NewLocker(c, tc.opts...)
		if lk != nil || err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: NewLocker = %v, %v; want no Locker and an error mentioning %q", tc.name, lk, err, tc.want)
		}
	}
}
