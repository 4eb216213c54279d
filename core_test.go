package pgcoord

import (
	"context"
	"errors"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// Shared holds of one key on one Session are counted exactly: while any
// shared handle is live (counted outside the library, from RLock's return
// to the call of Unlock), no exclusive TryLock elsewhere can succeed, and
// pg_locks shows the session's backend holding the key shared; when all
// are gone nothing is left. The handles overlap and some are held across
// a pg_locks read, so a hold that the session gave up too early on the
// server is seen both by the contender and by the observer.
func TestSharedHoldsNeverPhantom(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c, other := newTestClient(t, dsn), newTestClient(t, dsn)
	s := newTestSession(t, c)
	k := HashKey("shared-phantom")

	const goroutines, cycles = 8, 2500 // 20,000 RLock/Unlock cycles
	// live counts the shared handles between RLock's return and the call
	// of Unlock; held[i] is odd while reader i holds such a handle, and
	// changes at each of its entries and exits.
	var live atomic.Int64
	var held [goroutines]atomic.Int64
	var exclusiveWins, observed atomic.Int64
	stop := make(chan struct{})
	var bg sync.WaitGroup

	// The contender: whenever it gets the key exclusively, no shared handle
	// may be live from before its TryLock returned until it unlocks, and
	// pg_locks must show its backend as the only holder.
	contenderConn := pgtest.Conn(t, dsn)
	bg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			l, err := other.TryLock(ctx, k)
			if errors.Is(err, ErrLocked) {
				continue
			}
			if err != nil {
				t.Errorf("contender TryLock: %v", err)
				return
			}
			before := live.Load()
			rows, err := keyHolders(ctx, contenderConn, k)
			after := live.Load()
			if err != nil {
				t.Errorf("contender reads pg_locks: %v", err)
			}
			if before != 0 || after != 0 {
				t.Errorf("exclusive TryLock held while %d (then %d) shared handles were live", before, after)
			}
			granted := slices.DeleteFunc(rows, func(h holder) bool { return !h.granted })
			if err == nil && (len(granted) != 1 || granted[0] != (holder{pid: l.core.S.PID(), granted: true})) {
				t.Errorf("pg_locks while the contender holds the key exclusively: granted to %+v, want only backend %d", granted, l.core.S.PID())
			}
			exclusiveWins.Add(1)
			if err := l.Unlock(ctx); err != nil {
				t.Errorf("contender Unlock: %v", err)
				return
			}
		}
	})

	// The observer: a reader that held its handle from before a pg_locks
	// read until after it must find the key granted shared to the session.
	observerConn := pgtest.Conn(t, dsn)
	bg.Go(func() {
		var before [goroutines]int64
		for {
			select {
			case <-stop:
				return
			default:
			}
			for i := range held {
				before[i] = held[i].Load()
			}
			rows, err := keyHolders(ctx, observerConn, k)
			if err != nil {
				t.Errorf("observer reads pg_locks: %v", err)
				return
			}
			for i := range held {
				if before[i]%2 == 0 || held[i].Load() != before[i] {
					continue
				}
				observed.Add(1)
				if !slices.Contains(rows, holder{pid: s.PID(), shared: true, granted: true}) {
					t.Errorf("reader %d held a shared handle all through a pg_locks read that shows %+v, not backend %d holding the key shared", i, rows, s.PID())
				}
				break
			}
		}
	})

	// The readers run their cycles, and go on (at most 20 s) until the
	// contender has won the key once and the observer has seen a shared
	// hold: on a loaded machine the fixed cycles may pass before either.
	var wg sync.WaitGroup
	begun := time.Now()
	for i := range goroutines {
		wg.Go(func() {
			for n := 0; n < cycles || (exclusiveWins.Load() == 0 || observed.Load() == 0) && time.Since(begun) < 20*time.Second; n++ {
				l, err := s.RLock(ctx, k)
				if err != nil {
					t.Errorf("RLock: %v", err)
					return
				}
				held[i].Add(1)
				live.Add(1)
				// Hold some handles long enough to span a pg_locks read,
				// and let the others overlap.
				if n%16 == i%16 {
					time.Sleep(2 * time.Millisecond)
				} else {
					runtime.Gosched()
				}
				live.Add(-1)
				held[i].Add(1)
				if err := l.Unlock(ctx); err != nil {
					t.Errorf("Unlock: %v", err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	bg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	t.Logf("%d exclusive wins and %d shared holds seen in pg_locks during %d shared cycles", exclusiveWins.Load(), observed.Load(), goroutines*cycles)
	if observed.Load() == 0 || exclusiveWins.Load() == 0 {
		t.Fatal("no shared handle was held all through a pg_locks read, or the contender never got the key: the test checked nothing")
	}
	if s.Err() != nil {
		t.Fatalf("session ended: %v", s.Err())
	}
	notHeld(t, dsn, k)
}

// Close ends a session within its ctx even while a blocking acquire waits
// on its connection: the acquire returns ErrClosed and nothing is left.
func TestSessionCloseEndsBlockedWait(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c, other := newTestClient(t, dsn), newTestClient(t, dsn)
	k, mine := HashKey("close-blocked"), HashKey("close-blocked-mine")
	h, err := other.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	s, err := c.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Lock(ctx, mine); err != nil {
		t.Fatal(err)
	}
	wch := goLock(func() (*Lock, error) { return s.Lock(context.Background(), k) })
	pgtest.Eventually(t, testTimeout, "session waits in pg_locks", func() bool { return waitingOn(t, dsn, k) == 1 })

	cctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	closed := make(chan error, 1)
	go func() { closed <- s.Close(cctx) }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close with a 500ms context still blocked after 5s")
	}
	r := receive(t, wch)
	if !errors.Is(r.err, ErrClosed) {
		t.Fatalf("blocked Lock after Close: %v, want ErrClosed", r.err)
	}
	// Close returned nil: the session's locks are free now.
	notHeld(t, dsn, mine)
	heldOnlyBy(t, dsn, k, h.core.S.PID())
	mustUnlock(t, h)
}

// Unlock of one lock does not wait for a blocking acquire on the same
// Session to end: it interrupts the wait, which goes on afterwards.
func TestUnlockInterruptsBlockedWait(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c, other := newTestClient(t, dsn), newTestClient(t, dsn)
	s := newTestSession(t, c)
	k, mine := HashKey("unlock-blocked"), HashKey("unlock-blocked-mine")
	h, err := other.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	l, err := s.Lock(ctx, mine)
	if err != nil {
		t.Fatal(err)
	}
	wch := goLock(func() (*Lock, error) { return s.Lock(ctx, k) })
	pgtest.Eventually(t, testTimeout, "session waits in pg_locks", func() bool { return waitingOn(t, dsn, k) == 1 })
	mustUnlock(t, l)
	// The unlock is done while the other acquire still waits.
	notHeld(t, dsn, mine)
	stillWaiting(t, wch)
	pgtest.Eventually(t, testTimeout, "wait resumed in pg_locks", func() bool { return waitingOn(t, dsn, k) == 1 })
	mustUnlock(t, h)
	r := receive(t, wch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	heldOnlyBy(t, dsn, k, s.PID())
	mustUnlock(t, r.l)
}

// Settings that exist only from PostgreSQL 14 are left out for 13.
func TestSessionSettingsByServerVersion(t *testing.T) {
	cfg, err := newConfig(nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		version string
		major   int
		has     bool
	}{
		{"13.16", 13, false},
		{"14.0", 14, true},
		{"15.18 (Debian 15.18-0+deb12u1)", 15, true},
		{"16.4", 16, true},
		{"17beta1", 17, true},
	} {
		major := core.ServerMajor(tc.version)
		if major != tc.major {
			t.Errorf("serverMajor(%q) = %d, want %d", tc.version, major, tc.major)
		}
		m := core.SessionSettings(cfg, major)
		for _, name := range []string{"client_connection_check_interval", "idle_session_timeout"} {
			if _, ok := m[name]; ok != tc.has {
				t.Errorf("server %s: setting %s present = %v, want %v", tc.version, name, ok, tc.has)
			}
		}
		if _, ok := m["tcp_user_timeout"]; !ok {
			t.Errorf("server %s: tcp_user_timeout missing", tc.version)
		}
		if v, ok := m["transaction_timeout"]; ok != (major >= 17) || ok && v != "0" {
			t.Errorf("server %s: transaction_timeout = %q (set %v), want 0 from 17 on and absent before", tc.version, v, ok)
		}
	}
}

// A cancelled wait never cancels a later statement on the same connection:
// waits are cancelled at every moment of their life, including just as
// they are granted, and each is followed at once by other statements,
// which must all succeed.
func TestCancelNeverHitsNextStatement(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c, other := newTestClient(t, dsn), newTestClient(t, dsn)
	s := newTestSession(t, c)
	k, free := HashKey("stray-cancel"), HashKey("stray-cancel-free")
	var cancelled, acquired int
	for i := range 300 {
		var h *Lock
		if i%2 == 0 {
			var err error
			if h, err = other.Lock(ctx, k); err != nil {
				t.Fatal(err)
			}
		}
		wctx, cancel := context.WithTimeout(ctx, time.Duration(i%7)*200*time.Microsecond)
		l, err := s.Lock(wctx, k)
		cancel()
		switch {
		case err == nil:
			acquired++
			mustUnlock(t, l)
		case errors.Is(err, context.DeadlineExceeded):
			cancelled++
		default:
			t.Fatalf("iteration %d: Lock: %v", i, err)
		}
		// The statements right after must not be hit by the cancel.
		l2, err := s.TryLock(ctx, free)
		if err != nil {
			t.Fatalf("iteration %d: TryLock after a cancelled wait: %v", i, err)
		}
		mustUnlock(t, l2)
		if h != nil {
			mustUnlock(t, h)
		}
	}
	t.Logf("%d acquired, %d cancelled", acquired, cancelled)
	if cancelled == 0 {
		t.Fatal("no wait was cancelled: the test exercised nothing")
	}
	if s.Err() != nil {
		t.Fatalf("session ended: %v", s.Err())
	}
	notHeld(t, dsn, k)
	notHeld(t, dsn, free)
}

// Two Unlocks racing each other (or a loss) never return an error that
// wraps nil: exactly one succeeds, the other says ErrNotHeld.
func TestConcurrentUnlock(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	for i := range 50 {
		l, err := c.Lock(ctx, Int64Key(int64(i)))
		if err != nil {
			t.Fatal(err)
		}
		errs := make(chan error, 2)
		for range 2 {
			go func() { errs <- l.Unlock(ctx) }()
		}
		e1, e2 := <-errs, <-errs
		if (e1 == nil) == (e2 == nil) {
			t.Fatalf("two Unlocks: %v and %v, want exactly one nil", e1, e2)
		}
		for _, err := range []error{e1, e2} {
			if err != nil && (!errors.Is(err, ErrNotHeld) || strings.Contains(err.Error(), "%!")) {
				t.Fatalf("second Unlock: %v, want ErrNotHeld", err)
			}
		}
	}
	for i := range 50 {
		notHeld(t, dsn, Int64Key(int64(i)))
	}
}

// Readers of a key are admitted in turn with writers: a steady stream of
// writers does not starve a reader of the same Client.
func TestGateReaderNotStarved(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn, WithHandoff(0, 0))
	k := HashKey("reader-starvation")
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var writes atomic.Int64
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				l, err := c.Lock(ctx, k)
				if err != nil {
					t.Error(err)
					return
				}
				writes.Add(1)
				if err := l.Unlock(ctx); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	pgtest.Eventually(t, testTimeout, "writers running", func() bool { return writes.Load() > 20 })
	before := writes.Load()
	l, err := c.RLock(ctx, k)
	after := writes.Load()
	close(stop)
	if err == nil {
		mustUnlock(t, l)
	}
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	// FIFO admission: the reader waits for the writers queued before it,
	// at most one each, and some slack for the one holding.
	if after-before > 8 {
		t.Errorf("reader admitted after %d writes behind it, want at most a few", after-before)
	}
	notHeld(t, dsn, k)
}

// A lock statement never takes a key on a backend other than the
// session's own: the backend check is part of the statement.
func TestLockStatementGuardedByBackend(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	conn := pgtest.Conn(t, dsn)
	k := HashKey("guarded")
	for _, build := range []func() (string, []any){
		func() (string, []any) { return core.TrySQL("pg_try_advisory_lock", coreKeys([]Key{k}), 1) },
		func() (string, []any) { return core.TrySQL("pg_try_advisory_lock", coreKeys([]Key{k, Int64Key(7)}), 1) },
		func() (string, []any) { return core.WaitSQL("pg_advisory_lock", coreKeys([]Key{k}), 1) },
		func() (string, []any) { return core.WaitSQL("pg_advisory_lock", coreKeys([]Key{k, Int64Key(7)}), 1) },
	} {
		sql, args := build()
		if strings.Contains(sql, "lock_timeout") {
			args[len(args)-1] = "1000"
		}
		rows, err := conn.Query(ctx, sql, args...)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for rows.Next() {
			n++
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Fatalf("%s: %d rows on the wrong backend, want none", sql, n)
		}
		notHeld(t, dsn, k)
		notHeld(t, dsn, Int64Key(7))
	}
}

// A wait slices its time on the server: each slice is answered, and the
// wait goes on until the key is free, however long that takes.
func TestWaitInSlices(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	opts := []Option{WithLossDeadline(time.Second), WithHeartbeat(200 * time.Millisecond)}
	c, other := newTestClient(t, dsn, opts...), newTestClient(t, dsn)
	k := HashKey("slices")
	h, err := other.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	s := newTestSession(t, c)
	wch := goLock(func() (*Lock, error) { return s.LockAll(ctx, HashKey("slices-first"), k) })
	// Several slices (400ms each) pass: the wait reappears in pg_locks.
	start := time.Now()
	pgtest.Eventually(t, testTimeout, "three slices waited", func() bool {
		return waitingOn(t, dsn, k) == 1 && time.Since(start) > 1500*time.Millisecond
	})
	stillWaiting(t, wch)
	if s.Err() != nil {
		t.Fatalf("session lost while waiting in slices: %v", s.Err())
	}
	mustUnlock(t, h)
	r := receive(t, wch)
	if r.err != nil {
		t.Fatal(r.err)
	}
	heldOnlyBy(t, dsn, k, s.PID())
	heldOnlyBy(t, dsn, HashKey("slices-first"), s.PID())
	mustUnlock(t, r.l)
}
