package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// Tries and releases of many goroutines on one backend go out combined,
// and each goroutine gets the answer for its own key: a key held elsewhere
// is refused, a free one is taken and released, whatever else shared the
// statement. pg_locks shows each taken key on the Client's backend while
// its goroutine holds it, and nothing of the Client's at the end.
func TestCombinedCallsAnswerEachKey(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	other := pgtest.Conn(t, dsn)
	c := newTestClient(t, dsn, WithSharedBackends(1), WithMaxWaits(1))
	const workers, rounds = 16, 60
	keyOf := func(w, i int) Key { return Int64Key(int64(1_000_000 + w*1000 + i%7)) }
	heldElsewhere := func(k Key) bool { v, _ := k.Int64(); return v%7 == 3 }
	for w := range workers {
		for i := range 7 {
			if k := keyOf(w, i); heldElsewhere(k) {
				v, _ := k.Int64()
				if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1)", v); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			for i := range rounds {
				k := keyOf(w, i)
				l, err := c.TryLock(ctx, k)
				switch {
				case heldElsewhere(k):
					if !errors.Is(err, ErrLocked) {
						errs <- fmt.Errorf("worker %d: TryLock(%v), held elsewhere: %v, want ErrLocked", w, k, err)
						return
					}
					continue
				case err != nil:
					errs <- fmt.Errorf("worker %d: TryLock(%v), free: %v", w, k, err)
					return
				}
				if i%10 == 0 {
					if pids := grantedTo(t, dsn, k); len(pids) != 1 || pids[0] != l.core.S.Pid {
						errs <- fmt.Errorf("worker %d: %v taken, granted in pg_locks to %v, want backend %d", w, k, pids, l.core.S.Pid)
					}
				}
				if err := l.Unlock(ctx); err != nil {
					errs <- fmt.Errorf("worker %d: Unlock(%v): %v", w, k, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	combined := 0
	c.core.Mu.Lock()
	for _, b := range c.core.Backends {
		b.State.Lock()
		combined += b.Calls.Combined
		b.State.Unlock()
	}
	c.core.Mu.Unlock()
	if combined == 0 {
		t.Errorf("no statement carried more than one call: the test did not combine")
	}
	t.Logf("%d combined statements", combined)
	for k, rows := range lockState(t, dsn) {
		for _, h := range rows {
			if !heldElsewhere(k) || h.pid != int32(other.PgConn().PID()) {
				t.Errorf("pg_locks: %v held by %+v after every lock was released", k, h)
			}
		}
	}
}

// A combined statement that fails while its session lives (here: a try
// finds the server's lock table full) costs no other call its answer: a
// release in it still frees its key, and each try answers for itself,
// holding its key exactly when it says so.
func TestCombinedStatementFailureCostsNoOtherKey(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	srv := pgtest.NewServer(t, pgtest.WithSetting("max_locks_per_transaction", "10"), pgtest.WithSetting("max_connections", "20"))
	dsn := srv.DB(t)
	lockState(t, dsn) // open the observer before the lock table fills
	c := newTestClient(t, dsn)
	s := newTestSession(t, c)
	release := Int64Key(-1)
	held, err := s.Lock(ctx, release)
	if err != nil {
		t.Fatal(err)
	}
	// Fill the lock table from another backend.
	filler := newTestSession(t, c)
	for i := range 100_000 {
		if _, err = filler.Lock(ctx, Int64Key(int64(i))); err != nil {
			break
		}
	}
	if !errors.Is(err, ErrTooManyLocks) {
		t.Fatalf("filling the lock table: %v, want ErrTooManyLocks", err)
	}
	// Hold the connection so that the calls queue, then let them go out
	// as one statement: a release of a held key and tries of free ones.
	if err := s.core.Grab(ctx); err != nil {
		t.Fatal(err)
	}
	tries := []Key{HashKey("t", "1"), HashKey("t", "2"), HashKey("t", "3")}
	type answer struct {
		ok  bool
		err error
	}
	releaseDone := make(chan answer, 1)
	go func() {
		ok, err := s.core.CallKey(ctx, core.UnlockFunc(false), release.coreKey())
		releaseDone <- answer{ok, err}
	}()
	tryDone := make([]chan answer, len(tries))
	for i, k := range tries {
		tryDone[i] = make(chan answer, 1)
		go func() {
			ok, err := s.core.CallKey(ctx, core.LockFunc(false, true), k.coreKey())
			tryDone[i] <- answer{ok, err}
		}()
	}
	pgtest.Eventually(t, testTimeout, "every call queued", func() bool {
		s.core.State.Lock()
		defer s.core.State.Unlock()
		return s.core.Calls.Busy && len(s.core.Calls.Queue) == len(tries)
	})
	s.core.Release()
	r := <-releaseDone
	if r.err != nil || !r.ok {
		t.Fatalf("release in a failed combined statement: (%v, %v), want (true, nil)", r.ok, r.err)
	}
	s.core.State.Lock()
	combined := s.core.Calls.Combined
	s.core.State.Unlock()
	if combined != 1 {
		t.Fatalf("%d combined statements, want 1", combined)
	}
	failed := 0
	for i, k := range tries {
		a := <-tryDone[i]
		if a.err != nil {
			failed++
			if core.SqlState(a.err) != "53200" {
				t.Errorf("try %v: %v, want out of shared memory or an answer", k, a.err)
			}
		}
		// Free some of the lock table to read pg_locks.
		if i == 0 {
			filler.Close(ctx)
		}
		pids := grantedTo(t, dsn, k)
		if a.ok != (len(pids) == 1 && pids[0] == s.core.Pid) || len(pids) > 1 {
			t.Errorf("try %v answered (%v, %v), granted in pg_locks to %v", k, a.ok, a.err, pids)
		}
		if a.ok {
			if _, err := s.core.CallKey(ctx, core.UnlockFunc(false), k.coreKey()); err != nil {
				t.Fatal(err)
			}
		}
	}
	if failed == 0 {
		t.Errorf("no try failed: the lock table was not full, and the test proves nothing")
	}
	for _, k := range tries {
		if pids := grantedTo(t, dsn, k); len(pids) != 0 {
			t.Errorf("%v still granted to %v after its one release", k, pids)
		}
	}
	if pids := grantedTo(t, dsn, release); len(pids) != 0 {
		t.Errorf("released key still granted to %v", pids)
	}
	_ = held
}

// A caller whose ctx ends while its try waits in the queue, or after its
// try went out in a combined statement, leaves nothing held: many
// goroutines try keys through one backend with deadlines that end at
// random moments, and pg_locks shows only the locks they hold.
func TestCombinedCallsCancelledLeaveNothingHeld(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn, WithSharedBackends(1), WithMaxWaits(1))
	const workers, rounds = 16, 80
	var wg sync.WaitGroup
	var mu sync.Mutex
	cancelled := 0
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := range rounds {
				k := Int64Key(int64(2_000_000 + w*1000 + i%5))
				cctx, cancel := context.WithTimeout(ctx, time.Duration(rng.IntN(400))*time.Microsecond)
				l, err := c.TryLock(cctx, k)
				cancel()
				if err != nil {
					if !errors.Is(err, context.DeadlineExceeded) {
						t.Errorf("TryLock(%v): %v", k, err)
						return
					}
					mu.Lock()
					cancelled++
					mu.Unlock()
					continue
				}
				if err := l.Unlock(ctx); err != nil {
					t.Errorf("Unlock(%v): %v", k, err)
					return
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d of %d tries cut by their deadline", cancelled, workers*rounds)
	if cancelled == 0 {
		t.Errorf("no try was cut by its deadline: the test proves nothing")
	}
	if rows := lockState(t, dsn); len(rows) != 0 {
		t.Errorf("pg_locks after every lock was released or refused: %v", rows)
	}
}

// A caller whose ctx ends after its try went out in a combined statement
// waits for the answer, so the key it may have taken is released: the
// backend is paused (SIGSTOP) while the statement is in flight, the
// caller's ctx is cancelled, and once the backend resumes, the caller's
// TryLock has failed and pg_locks shows the key free.
func TestCombinedCallCancelledInFlightLeavesNothingHeld(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	s := newTestSession(t, newTestClient(t, dsn))
	if err := s.core.Grab(ctx); err != nil {
		t.Fatal(err)
	}
	first, second := Int64Key(3_000_001), Int64Key(3_000_002)
	leader := goLock(func() (*Lock, error) { return s.TryLock(ctx, first) })
	pgtest.Eventually(t, testTimeout, "the first try waits for the connection", func() bool {
		s.core.State.Lock()
		defer s.core.State.Unlock()
		return s.core.Calls.Busy
	})
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	queued := goLock(func() (*Lock, error) { return s.TryLock(cctx, second) })
	pgtest.Eventually(t, testTimeout, "the second try queues", func() bool {
		s.core.State.Lock()
		defer s.core.State.Unlock()
		return len(s.core.Calls.Queue) == 1
	})
	if err := syscall.Kill(int(s.core.Pid), syscall.SIGSTOP); err != nil {
		t.Skipf("cannot pause backend %d (the server runs as another user): %v", s.core.Pid, err)
	}
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			_ = syscall.Kill(int(s.core.Pid), syscall.SIGCONT)
		}
	}
	defer resume()
	s.core.Release()
	pgtest.Eventually(t, testTimeout, "both tries go out in one statement", func() bool {
		s.core.State.Lock()
		defer s.core.State.Unlock()
		return len(s.core.Calls.Queue) == 0 && s.core.Calls.Combined == 1
	})
	cancel()
	resume()
	if r := receive(t, leader); r.err != nil {
		t.Fatalf("first TryLock: %v", r.err)
	} else {
		defer mustUnlock(t, r.l)
	}
	r := receive(t, queued)
	if r.err == nil {
		t.Fatalf("second TryLock returned a lock after its ctx was cancelled in flight")
	}
	if !errors.Is(r.err, context.Canceled) {
		t.Errorf("second TryLock: %v, want context.Canceled", r.err)
	}
	notHeld(t, dsn, second)
	heldOnlyBy(t, dsn, first, s.core.Pid)
}

// A caller whose turn it is to send the queue, but whose ctx ends while it
// waits for the connection, hands the turn on: the calls queued behind it
// are still sent and answered.
func TestCombinedTurnPassesOnWhenItsCallerGivesUp(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	s := newTestSession(t, newTestClient(t, dsn))
	if err := s.core.Grab(ctx); err != nil {
		t.Fatal(err)
	}
	first, second := Int64Key(4_000_001), Int64Key(4_000_002)
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	giving := goLock(func() (*Lock, error) { return s.TryLock(cctx, first) })
	pgtest.Eventually(t, testTimeout, "the first try waits for the connection", func() bool {
		s.core.State.Lock()
		defer s.core.State.Unlock()
		return s.core.Calls.Busy
	})
	queued := goLock(func() (*Lock, error) { return s.TryLock(ctx, second) })
	var call *core.KeyCall
	pgtest.Eventually(t, testTimeout, "the second try queues", func() bool {
		s.core.State.Lock()
		defer s.core.State.Unlock()
		if len(s.core.Calls.Queue) == 1 {
			call = s.core.Calls.Queue[0]
		}
		return call != nil
	})
	cancel()
	pgtest.Eventually(t, testTimeout, "the queued try takes the turn", func() bool {
		s.core.State.Lock()
		defer s.core.State.Unlock()
		return !slices.Contains(s.core.Calls.Queue, call)
	})
	s.core.Release()
	if r := receive(t, giving); !errors.Is(r.err, context.Canceled) {
		t.Fatalf("first TryLock, cancelled while waiting for the connection: (%v, %v), want context.Canceled", r.l, r.err)
	}
	r := receive(t, queued)
	if r.err != nil {
		t.Fatalf("second TryLock, queued behind a caller that gave up: %v", r.err)
	}
	heldOnlyBy(t, dsn, second, s.core.Pid)
	notHeld(t, dsn, first)
	mustUnlock(t, r.l)
}

// A backend prepares the combined statements it sends, up to
// maxCombinedTexts texts, and sends the others unprepared: whatever mix of
// tries and releases goroutines combine, the server keeps a bounded number
// of statements for the backend (pg_prepared_statements, read on the
// backend itself), and every caller still gets its own key's answer,
// prepared or not. Nothing stays held.
func TestCombinedStatementsPreparedAreBounded(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	s, err := c.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	send := func(calls []*core.KeyCall) {
		t.Helper()
		if err := s.core.Grab(ctx); err != nil {
			t.Fatal(err)
		}
		s.core.AnswerCalls(ctx, calls)
		s.core.Release()
		for _, c := range calls {
			if c.Cause != nil {
				t.Fatalf("%s(%v): %v", c.Fn, c.Key, c.Cause)
			}
		}
	}
	next := int64(3_000_000)
	texts := 0
	for tries := 1; tries <= 12; tries++ {
		for releases := 1; releases <= 12; releases++ {
			var calls, taken []*core.KeyCall
			for range tries {
				next++
				calls = append(calls, &core.KeyCall{Fn: core.LockFunc(false, true), Key: Int64Key(next).coreKey()})
			}
			taken = slices.Clone(calls)
			for range releases {
				next++
				calls = append(calls, &core.KeyCall{Fn: core.UnlockFunc(false), Key: Int64Key(next).coreKey()})
			}
			send(calls)
			texts++
			for _, c := range calls {
				if want := c.Fn == core.LockFunc(false, true); c.Ok != want {
					t.Fatalf("%d tries, %d releases: %s(%v) answered %v, want %v", tries, releases, c.Fn, c.Key, c.Ok, want)
				}
			}
			if got := heldBy(t, dsn, s.core.Pid); len(got) != tries {
				t.Fatalf("%d tries, %d releases: backend holds %d keys in pg_locks, want %d", tries, releases, len(got), tries)
			}
			if len(taken) == 1 {
				ok, err := s.core.CallKey(ctx, core.UnlockFunc(false), taken[0].Key)
				if err != nil || !ok {
					t.Fatalf("release of %v: %v, %v", taken[0].Key, ok, err)
				}
				continue
			}
			for _, c := range taken {
				c.Fn, c.Ok = core.UnlockFunc(false), false
			}
			send(taken)
			for _, c := range taken {
				if !c.Ok {
					t.Fatalf("release of %v answered false, want true", c.Key)
				}
			}
		}
	}
	if got := heldBy(t, dsn, s.core.Pid); len(got) != 0 {
		t.Fatalf("backend still holds %v", got)
	}
	var statements []string
	err = s.core.Run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		rows, _ := conn.Query(ctx, "SELECT statement FROM pg_prepared_statements")
		statements, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	prepared := 0
	for _, st := range statements {
		calls := strings.HasPrefix(st, "SELECT "+core.LockFunc(false, true)+"(") || strings.HasPrefix(st, "SELECT "+core.UnlockFunc(false)+"(")
		if calls && strings.Contains(st, "), pg_") {
			prepared++ // a statement of more than one call
		}
	}
	if texts <= core.MaxCombinedTexts || prepared != core.MaxCombinedTexts {
		t.Fatalf("%d combined texts sent, %d prepared on the backend, want %d: %q", texts, prepared, core.MaxCombinedTexts, statements)
	}
}
