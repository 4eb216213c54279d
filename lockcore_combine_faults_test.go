package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/pgcoord/pgcoord/internal/pgtest"
	"go.uber.org/goleak"
)

// holdConn takes s's connection so that the calls sent meanwhile queue,
// and returns a func that gives it back once.
func holdConn(t *testing.T, ctx context.Context, s *Session) func() {
	t.Helper()
	if err := s.core.Grab(ctx); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release := func() { once.Do(s.core.Release) }
	t.Cleanup(release)
	return release
}

// awaitQueued waits until n calls queue behind the one that sends.
func awaitQueued(t *testing.T, s *Session, n int) {
	t.Helper()
	pgtest.Eventually(t, testTimeout, fmt.Sprintf("%d calls queued", n), func() bool {
		s.core.State.Lock()
		defer s.core.State.Unlock()
		return s.core.Calls.Busy && len(s.core.Calls.Queue) == n
	})
}

func combinedCount(s *core.Session) int {
	s.State.Lock()
	defer s.State.Unlock()
	return s.Calls.Combined
}

// pausedBackend stops backend pid (SIGSTOP) and returns a func that
// resumes it once; the test is skipped if it cannot.
func pausedBackend(t *testing.T, pid int32) func() {
	t.Helper()
	if err := syscall.Kill(int(pid), syscall.SIGSTOP); err != nil {
		t.Skipf("cannot pause backend %d: %v", pid, err)
	}
	var once sync.Once
	resume := func() { once.Do(func() { _ = syscall.Kill(int(pid), syscall.SIGCONT) }) }
	t.Cleanup(resume)
	return resume
}

// heldBy returns the keys pg_locks shows granted to pid, with their mode.
func heldBy(t *testing.T, dsn string, pid int32) map[Key]bool {
	t.Helper()
	out := make(map[Key]bool)
	for k, rows := range lockState(t, dsn) {
		for _, h := range rows {
			if h.pid == pid && h.granted {
				out[k] = h.shared
			}
		}
	}
	return out
}

// One combined statement (and a second one, for the calls past
// maxKeysCombined) carries tries and releases of bigint and pair keys,
// shared and exclusive, some held elsewhere in a mode that refuses them and
// some in one that admits them: each caller gets its own key's answer, and
// pg_locks shows each taken key granted to the session's backend in the
// mode asked for, each released key free.
func TestCombinedMixedKeyFormsAndModesAnswerEachCaller(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	other := pgtest.Conn(t, dsn)
	s := newTestSession(t, newTestClient(t, dsn))

	exclElsewhere := Int64Key(4_000_001)
	sharedElsewherePair := PairKey(40, 2)
	// Held elsewhere: two bigint keys exclusively, two pair keys shared.
	// (A key is in at most one call of a backend at a time, so each call
	// below has a key of its own.)
	if _, err := other.Exec(ctx, "SELECT pg_advisory_lock(4000001), pg_advisory_lock(4000002), pg_advisory_lock_shared(40, 2), pg_advisory_lock_shared(40, 3)"); err != nil {
		t.Fatal(err)
	}
	// Locks the session holds, to be released in the combined statement.
	type held struct {
		k      Key
		shared bool
		l      *Lock
	}
	toRelease := []held{{k: Int64Key(4_000_010)}, {k: PairKey(41, 1), shared: true}, {k: Int64Key(4_000_011), shared: true}, {k: PairKey(41, 2)}, {k: HashKey("combine", "release")}}
	for i := range toRelease {
		var err error
		if toRelease[i].shared {
			toRelease[i].l, err = s.RLock(ctx, toRelease[i].k)
		} else {
			toRelease[i].l, err = s.Lock(ctx, toRelease[i].k)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	type try struct {
		k      Key
		shared bool
		want   bool
	}
	tries := []try{
		{exclElsewhere, false, false},
		{sharedElsewherePair, false, false},
		{PairKey(40, 3), true, true},
		{HashKey("combine", "a"), true, true},
	}
	for i := range 30 {
		if i%2 == 0 {
			tries = append(tries, try{PairKey(42, int32(i)), i%4 == 0, true})
		} else {
			tries = append(tries, try{Int64Key(int64(4_000_100 + i)), i%3 == 0, true})
		}
	}
	// A key held exclusively elsewhere, tried shared, in the second
	// statement.
	tries = append(tries, try{Int64Key(4_000_002), true, false})

	release := holdConn(t, ctx, s)
	tryDone := make([]<-chan result, len(tries))
	for i, tr := range tries {
		if i == 1 {
			// The first call waits for the connection: the rest queue.
			awaitQueued(t, s, 0)
		}
		if tr.shared {
			tryDone[i] = goLock(func() (*Lock, error) { return s.TryRLock(ctx, tr.k) })
		} else {
			tryDone[i] = goLock(func() (*Lock, error) { return s.TryLock(ctx, tr.k) })
		}
	}
	relDone := make(chan error, len(toRelease))
	for _, h := range toRelease {
		go func() { relDone <- h.l.Unlock(ctx) }()
	}
	awaitQueued(t, s, len(tries)-1+len(toRelease))
	release()

	var got []*Lock
	for i, tr := range tries {
		r := receive(t, tryDone[i])
		switch {
		case tr.want && r.err != nil:
			t.Errorf("try %v (shared %v): %v, want a lock", tr.k, tr.shared, r.err)
		case !tr.want && !errors.Is(r.err, ErrLocked):
			t.Errorf("try %v (shared %v): (%v, %v), want ErrLocked", tr.k, tr.shared, r.l, r.err)
		}
		if r.l != nil {
			got = append(got, r.l)
		}
	}
	for range toRelease {
		select {
		case err := <-relDone:
			if err != nil {
				t.Errorf("Unlock in a combined statement: %v", err)
			}
		case <-time.After(testTimeout):
			t.Fatal("Unlock did not return")
		}
	}
	if n := combinedCount(s.core); n < 2 {
		t.Errorf("%d combined statements, want at least 2 (%d calls, %d per statement)", n, len(tries)+len(toRelease), core.MaxKeysCombined)
	}
	mine := heldBy(t, dsn, s.core.Pid)
	for _, tr := range tries {
		shared, ok := mine[tr.k]
		if ok != tr.want || ok && shared != tr.shared {
			t.Errorf("pg_locks: %v granted to backend %d: %v (shared %v); try was shared %v, want held %v", tr.k, s.core.Pid, ok, shared, tr.shared, tr.want)
		}
	}
	for _, h := range toRelease {
		if _, ok := mine[h.k]; ok {
			t.Errorf("pg_locks: released %v still granted to backend %d", h.k, s.core.Pid)
		}
	}
	if len(mine) != len(got) {
		t.Errorf("pg_locks: backend %d holds %d keys, %d tries answered yes: %v", s.core.Pid, len(mine), len(got), mine)
	}
	for _, l := range got {
		mustUnlock(t, l)
	}
	if mine := heldBy(t, dsn, s.core.Pid); len(mine) != 0 {
		t.Errorf("pg_locks after every release: backend %d holds %v", s.core.Pid, mine)
	}
}

// Exclusion across Clients while goroutines of each hammer the one shared
// backend of their Client with TryLock, TryRLock, blocking Lock and RLock
// (short deadlines) and Unlock on a few keys of both forms: no key is ever
// held exclusively by one handle while any other handle holds it, a taken
// key is granted in pg_locks to its handle's backend, Stat counts the live
// handles, and nothing is left in pg_locks at the end.
func TestCombinedCallsKeepExclusionAcrossClients(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	clients := []*Client{
		newTestClient(t, dsn, WithSharedBackends(1), WithMaxWaits(1)),
		newTestClient(t, dsn, WithSharedBackends(1), WithMaxWaits(1)),
	}
	keys := []Key{Int64Key(5_000_001), PairKey(50, 1), Int64Key(5_000_002), PairKey(50, 2)}
	var mu sync.Mutex
	excl := make(map[Key]int)
	shared := make(map[Key]int)
	const workers, rounds = 6, 50
	var wg sync.WaitGroup
	var taken, checked int
	for ci, c := range clients {
		for w := range workers {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(uint64(ci), uint64(w)))
				for i := range rounds {
					k := keys[rng.IntN(len(keys))]
					op := rng.IntN(4)
					actx, cancel := context.WithTimeout(ctx, time.Duration(5+rng.IntN(40))*time.Millisecond)
					var l *Lock
					var err error
					switch op {
					case 0:
						l, err = c.TryLock(ctx, k)
					case 1:
						l, err = c.TryRLock(ctx, k)
					case 2:
						l, err = c.Lock(actx, k)
					case 3:
						l, err = c.RLock(actx, k)
					}
					cancel()
					if err != nil {
						if !errors.Is(err, ErrLocked) && !errors.Is(err, context.DeadlineExceeded) {
							t.Errorf("client %d worker %d op %d on %v: %v", ci, w, op, k, err)
							return
						}
						continue
					}
					isShared := op%2 == 1
					mu.Lock()
					taken++
					if isShared {
						shared[k]++
					} else {
						excl[k]++
					}
					if excl[k] > 1 || excl[k] == 1 && shared[k] > 0 {
						t.Errorf("%v held by %d exclusive and %d shared handles at once", k, excl[k], shared[k])
					}
					mu.Unlock()
					if i%8 == 0 {
						found := false
						for _, pid := range grantedTo(t, dsn, k) {
							found = found || pid == l.core.S.Pid
						}
						if !found {
							t.Errorf("%v taken on backend %d, pg_locks grants it to %v", k, l.core.S.Pid, grantedTo(t, dsn, k))
						}
						mu.Lock()
						checked++
						mu.Unlock()
					}
					mu.Lock()
					if isShared {
						shared[k]--
					} else {
						excl[k]--
					}
					mu.Unlock()
					if err := l.Unlock(ctx); err != nil {
						t.Errorf("Unlock %v: %v", k, err)
						return
					}
				}
			})
		}
	}
	wg.Wait()
	t.Logf("%d acquires, %d checked in pg_locks", taken, checked)
	if taken == 0 {
		t.Fatal("nothing was taken: the test proves nothing")
	}
	combined := 0
	for _, c := range clients {
		if st := c.Stat(); st.Locks != 0 {
			t.Errorf("Stat().Locks = %d after every Unlock", st.Locks)
		}
		c.core.Mu.Lock()
		for _, b := range c.core.Backends {
			combined += combinedCount(b)
		}
		c.core.Mu.Unlock()
	}
	t.Logf("%d combined statements", combined)
	if rows := lockState(t, dsn); len(rows) != 0 {
		t.Errorf("pg_locks after every Unlock: %v", rows)
	}
}

// Calls queued on a backend that is terminated before they go out: every
// caller returns promptly with an error wrapping ErrLockLost (tries and
// releases), the handles end, and pg_locks shows nothing of the backend.
func TestCombinedQueuedCallsOnTerminatedBackendFailPromptly(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	s := newTestSession(t, c)
	var locks []*Lock
	for i := range 4 {
		l, err := s.Lock(ctx, Int64Key(int64(6_000_000+i)))
		if err != nil {
			t.Fatal(err)
		}
		locks = append(locks, l)
	}
	release := holdConn(t, ctx, s)
	var tries []<-chan result
	for i := range 10 {
		if i == 1 {
			awaitQueued(t, s, 0)
		}
		k := PairKey(60, int32(i))
		tries = append(tries, goLock(func() (*Lock, error) { return s.TryLock(ctx, k) }))
	}
	unlocks := make(chan error, len(locks))
	for _, l := range locks {
		go func() { unlocks <- l.Unlock(ctx) }()
	}
	awaitQueued(t, s, 9+len(locks))
	pgtest.Terminate(t, dsn, s.core.Pid)
	start := time.Now()
	release()
	for _, ch := range tries {
		r := receive(t, ch)
		if r.err == nil {
			t.Errorf("TryLock on a terminated backend returned a lock")
			mustUnlock(t, r.l)
		} else if !errors.Is(r.err, ErrLockLost) {
			t.Errorf("TryLock on a terminated backend: %v, want ErrLockLost", r.err)
		}
	}
	for range locks {
		select {
		case err := <-unlocks:
			if !errors.Is(err, ErrLockLost) {
				t.Errorf("Unlock on a terminated backend: %v, want ErrLockLost", err)
			}
		case <-time.After(testTimeout):
			t.Fatal("Unlock did not return")
		}
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("callers returned %v after the backend was terminated", d)
	}
	if !errors.Is(s.Err(), ErrLockLost) {
		t.Errorf("session Err: %v, want ErrLockLost", s.Err())
	}
	for _, l := range locks {
		awaitEnd(t, l, "backend terminated")
	}
	pgtest.Eventually(t, testTimeout, "the backend's locks gone from pg_locks", func() bool {
		return len(heldBy(t, dsn, s.core.Pid)) == 0
	})
}

// A backend terminated while a combined statement is in flight (paused,
// then terminated and resumed): every caller returns, the session is
// lost, and pg_locks shows nothing of the backend.
func TestCombinedStatementInFlightOnTerminatedBackend(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	s := newTestSession(t, newTestClient(t, dsn))
	held, err := s.Lock(ctx, Int64Key(6_100_000))
	if err != nil {
		t.Fatal(err)
	}
	release := holdConn(t, ctx, s)
	var tries []<-chan result
	for i := range 6 {
		if i == 1 {
			awaitQueued(t, s, 0)
		}
		k := Int64Key(int64(6_100_001 + i))
		tries = append(tries, goLock(func() (*Lock, error) { return s.TryRLock(ctx, k) }))
	}
	unlocked := make(chan error, 1)
	go func() { unlocked <- held.Unlock(ctx) }()
	awaitQueued(t, s, 6)
	resume := pausedBackend(t, s.core.Pid)
	release()
	pgtest.Eventually(t, testTimeout, "the calls go out combined", func() bool { return combinedCount(s.core) == 1 })
	other := pgtest.Conn(t, dsn)
	if _, err := other.Exec(ctx, "SELECT pg_terminate_backend($1)", s.core.Pid); err != nil {
		t.Fatal(err)
	}
	resume()
	for _, ch := range tries {
		r := receive(t, ch)
		if r.err == nil {
			// Answered before the backend died: the lock ends with it.
			awaitEnd(t, r.l, "backend terminated")
		} else if !errors.Is(r.err, ErrLockLost) {
			t.Errorf("TryRLock: %v, want a lock or ErrLockLost", r.err)
		}
	}
	select {
	case err := <-unlocked:
		if err != nil && !errors.Is(err, ErrLockLost) {
			t.Errorf("Unlock: %v, want nil or ErrLockLost", err)
		}
	case <-time.After(testTimeout):
		t.Fatal("Unlock did not return")
	}
	pgtest.Eventually(t, testTimeout, "the session is lost", func() bool { return errors.Is(s.Err(), ErrLockLost) })
	pgtest.Eventually(t, testTimeout, "the backend's locks gone from pg_locks", func() bool {
		return len(heldBy(t, dsn, s.core.Pid)) == 0
	})
}

// Session.Close while calls queue behind a held connection: every caller
// returns with ErrClosed, Close releases everything (pg_locks shows nothing
// of the backend), and once the Client closes no goroutine is left.
func TestCombinedCallsQueuedAtSessionCloseAllReturn(t *testing.T) {
	dsn := pgtest.DB(t)
	lockState(t, dsn) // the observer's connection is not the Client's
	ignore := goleak.IgnoreCurrent()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	pool := pgtest.Pool(t, dsn)
	c, err := New(pool)
	if err != nil {
		t.Fatal(err)
	}
	s, err := c.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var locks []*Lock
	for i := range 3 {
		l, err := s.RLock(ctx, PairKey(70, int32(i)))
		if err != nil {
			t.Fatal(err)
		}
		locks = append(locks, l)
	}
	release := holdConn(t, ctx, s)
	var tries []<-chan result
	for i := range 8 {
		if i == 1 {
			awaitQueued(t, s, 0)
		}
		k := Int64Key(int64(7_000_000 + i))
		tries = append(tries, goLock(func() (*Lock, error) { return s.TryLock(ctx, k) }))
	}
	unlocks := make(chan error, len(locks))
	for _, l := range locks {
		go func() { unlocks <- l.Unlock(ctx) }()
	}
	awaitQueued(t, s, 7+len(locks))
	closed := make(chan error, 1)
	go func() { closed <- s.Close(ctx) }()
	for _, ch := range tries {
		if r := receive(t, ch); !errors.Is(r.err, ErrClosed) {
			t.Errorf("TryLock queued at Close: (%v, %v), want ErrClosed", r.l, r.err)
		}
	}
	for range locks {
		select {
		case err := <-unlocks:
			if err != nil && !errors.Is(err, ErrClosed) {
				t.Errorf("Unlock queued at Close: %v, want nil or ErrClosed", err)
			}
		case <-time.After(testTimeout):
			t.Fatal("Unlock did not return")
		}
	}
	release()
	select {
	case err := <-closed:
		if err != nil {
			t.Errorf("Close: %v", err)
		}
	case <-time.After(testTimeout):
		t.Fatal("Close did not return")
	}
	if mine := heldBy(t, dsn, s.core.Pid); len(mine) != 0 {
		t.Errorf("pg_locks after Close: backend %d holds %v", s.core.Pid, mine)
	}
	if err := c.Close(ctx); err != nil {
		t.Errorf("Client.Close: %v", err)
	}
	pool.Close()
	if err := goleak.Find(ignore); err != nil {
		t.Errorf("goroutines left after Close: %v", err)
	}
}

// Session.Close while a combined statement is in flight on a paused
// backend, with a ctx that ends first: Close cuts the connection, every
// caller returns, and once the backend resumes pg_locks shows nothing of
// it; Client.Close then leaves no goroutine.
func TestCombinedStatementInFlightAtSessionCloseAllReturn(t *testing.T) {
	dsn := pgtest.DB(t)
	lockState(t, dsn) // the observer's connection is not the Client's
	ignore := goleak.IgnoreCurrent()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	pool := pgtest.Pool(t, dsn)
	c, err := New(pool)
	if err != nil {
		t.Fatal(err)
	}
	s, err := c.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	held, err := s.Lock(ctx, Int64Key(7_100_000))
	if err != nil {
		t.Fatal(err)
	}
	release := holdConn(t, ctx, s)
	var tries []<-chan result
	for i := range 5 {
		if i == 1 {
			awaitQueued(t, s, 0)
		}
		k := Int64Key(int64(7_100_001 + i))
		tries = append(tries, goLock(func() (*Lock, error) { return s.TryLock(ctx, k) }))
	}
	unlocked := make(chan error, 1)
	go func() { unlocked <- held.Unlock(ctx) }()
	awaitQueued(t, s, 5)
	resume := pausedBackend(t, s.core.Pid)
	release()
	pgtest.Eventually(t, testTimeout, "the calls go out combined", func() bool { return combinedCount(s.core) == 1 })
	cctx, ccancel := context.WithTimeout(ctx, 200*time.Millisecond)
	err = s.Close(cctx)
	ccancel()
	if err == nil {
		t.Errorf("Close with a statement in flight on a paused backend confirmed the release")
	}
	for _, ch := range tries {
		r := receive(t, ch)
		if r.err == nil {
			t.Errorf("TryLock in flight at Close returned a lock")
		}
	}
	select {
	case <-unlocked:
	case <-time.After(testTimeout):
		t.Fatal("Unlock did not return")
	}
	resume()
	pgtest.Eventually(t, testTimeout, "the backend's locks gone from pg_locks", func() bool {
		return len(heldBy(t, dsn, s.core.Pid)) == 0
	})
	if err := c.Close(ctx); err != nil {
		t.Errorf("Client.Close: %v", err)
	}
	pool.Close()
	if err := goleak.Find(ignore); err != nil {
		t.Errorf("goroutines left after Close: %v", err)
	}
}

// A blocking Lock waits on a session's backend for a key held elsewhere
// while goroutines try and release other keys on that backend, their
// calls combined: every call is answered (the wait yields to them), the
// waited-for key is never granted to the backend while the other holds
// it, the wait resumes after them and takes the key when it is freed, and
// nothing is left in pg_locks.
func TestCombinedCallsInterleaveWithBlockingWait(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	other := pgtest.Conn(t, dsn)
	s := newTestSession(t, newTestClient(t, dsn))
	waited := Int64Key(8_000_000)
	if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1::int8)", int64(8_000_000)); err != nil {
		t.Fatal(err)
	}
	blocked := goLock(func() (*Lock, error) { return s.Lock(ctx, waited) })
	pgtest.Eventually(t, testTimeout, "the Lock waits on the server", func() bool { return waitingOn(t, dsn, waited) == 1 })
	const workers, rounds = 8, 25
	var wg sync.WaitGroup
	var mu sync.Mutex
	var total, slowest time.Duration
	began := time.Now()
	for w := range workers {
		wg.Go(func() {
			for i := range rounds {
				var k Key
				if w%2 == 0 {
					k = Int64Key(int64(8_000_100 + w*100 + i%3))
				} else {
					k = PairKey(80, int32(w*100+i%3))
				}
				var l *Lock
				var err error
				start := time.Now()
				if i%2 == 0 {
					l, err = s.TryLock(ctx, k)
				} else {
					l, err = s.TryRLock(ctx, k)
				}
				if err != nil {
					t.Errorf("worker %d: try %v while a Lock waits: %v", w, k, err)
					return
				}
				if err := l.Unlock(ctx); err != nil {
					t.Errorf("worker %d: Unlock %v: %v", w, k, err)
					return
				}
				d := time.Since(start)
				mu.Lock()
				total += d
				slowest = max(slowest, d)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	t.Logf("%d try+unlock pairs in %v while a Lock waited: mean %v, slowest %v", workers*rounds, time.Since(began), total/(workers*rounds), slowest)
	stillWaiting(t, blocked)
	for _, pid := range grantedTo(t, dsn, waited) {
		if pid == s.core.Pid {
			t.Fatalf("pg_locks: %v granted to backend %d while backend %d holds it", waited, s.core.Pid, other.PgConn().PID())
		}
	}
	t.Logf("%d combined statements while the Lock waited", combinedCount(s.core))
	if _, err := other.Exec(ctx, "SELECT pg_advisory_unlock($1::int8)", int64(8_000_000)); err != nil {
		t.Fatal(err)
	}
	r := receive(t, blocked)
	if r.err != nil {
		t.Fatalf("blocking Lock after the key was freed: %v", r.err)
	}
	heldOnlyBy(t, dsn, waited, s.core.Pid)
	mustUnlock(t, r.l)
	if rows := lockState(t, dsn); len(rows) != 0 {
		t.Errorf("pg_locks after every release: %v", rows)
	}
}

// With the server's lock table nearly full, goroutines try keys on one
// backend at once, so that combined statements fail part way: each try
// answers for itself (a lock, ErrLocked never, or ErrTooManyLocks), the
// backend holds in pg_locks exactly the keys whose tries said yes, Stat
// counts them, and releasing them leaves nothing.
func TestCombinedTriesOnFullLockTableHoldExactlyWhatTheySay(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	srv := pgtest.NewServer(t, pgtest.WithSetting("max_locks_per_transaction", "10"), pgtest.WithSetting("max_connections", "20"))
	dsn := srv.DB(t)
	lockState(t, dsn) // open the observer before the lock table fills
	c := newTestClient(t, dsn)
	s := newTestSession(t, c)
	filler := newTestSession(t, c)
	var fill []*Lock
	var err error
	for i := range 100_000 {
		var l *Lock
		if l, err = filler.Lock(ctx, Int64Key(int64(i))); err != nil {
			break
		}
		fill = append(fill, l)
	}
	if !errors.Is(err, ErrTooManyLocks) {
		t.Fatalf("filling the lock table: %v, want ErrTooManyLocks", err)
	}
	// Leave a few slots, fewer than the tries, so that some fail.
	for _, l := range fill[len(fill)-6:] {
		mustUnlock(t, l)
	}
	const workers, rounds = 8, 6
	var mu sync.Mutex
	var got []*Lock
	full := 0
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range rounds {
				var k Key
				if (w+i)%2 == 0 {
					k = Int64Key(int64(9_000_000 + w*100 + i))
				} else {
					k = PairKey(90, int32(w*100+i))
				}
				var l *Lock
				var err error
				if i%3 == 0 {
					l, err = s.TryRLock(ctx, k)
				} else {
					l, err = s.TryLock(ctx, k)
				}
				mu.Lock()
				switch {
				case err == nil:
					got = append(got, l)
				case errors.Is(err, ErrTooManyLocks) || core.SqlState(err) == "53200":
					full++
				default:
					t.Errorf("try %v: %v, want a lock or ErrTooManyLocks", k, err)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	t.Logf("%d taken, %d refused for the full table, %d combined statements", len(got), full, combinedCount(s.core))
	if full == 0 {
		t.Errorf("no try found the lock table full: the test proves nothing")
	}
	if err := s.Err(); err != nil {
		t.Fatalf("session ended: %v", err)
	}
	if st := c.Stat(); st.Locks != len(got)+len(fill)-6 {
		t.Errorf("Stat().Locks = %d, want %d", st.Locks, len(got)+len(fill)-6)
	}
	if err := filler.Close(ctx); err != nil {
		t.Fatal(err)
	}
	mine := heldBy(t, dsn, s.core.Pid)
	for _, l := range got {
		shared, ok := mine[keyOf(l.core.KeyList[0])]
		if !ok || shared != l.core.Shared {
			t.Errorf("pg_locks: %v granted to backend %d: %v (shared %v), but its try said yes (shared %v)", l.core.KeyList[0], s.core.Pid, ok, shared, l.core.Shared)
		}
	}
	if len(mine) != len(got) {
		t.Errorf("pg_locks: backend %d holds %d keys, %d tries said yes: %v", s.core.Pid, len(mine), len(got), mine)
	}
	for _, l := range got {
		mustUnlock(t, l)
	}
	if mine := heldBy(t, dsn, s.core.Pid); len(mine) != 0 {
		t.Errorf("pg_locks after every release: backend %d holds %v", s.core.Pid, mine)
	}
}

// A blocking Lock that waits on a backend lets the statements that want
// the connection go first (grabForWait), so goroutines that try and
// release keys on that backend back to back interrupt its wait about once,
// not once per statement: each interrupted slice is a cancel request to
// the server, an aborted statement and an undo. The aborted statements are
// counted by the database's xact_rollback (nothing else here rolls back),
// read once the session's backend has exited and flushed its counts.
//
// Without combining, 400 try+unlock pairs interrupt the wait once. With
// combining, the calls queued behind a statement are not counted as
// waiting for the connection (Session.pending), and the connection is
// given back before the next queued caller asks for it (sendCalls releases,
// then passCalls wakes the next), so the waiting Lock takes the connection
// between every two statements and is interrupted at once, each time.
func TestCombinedCallsDoNotInterruptBlockingWaitPerStatement(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	other := pgtest.Conn(t, dsn)
	obs := pgtest.Conn(t, dsn)
	s := newTestSession(t, newTestClient(t, dsn))
	rollbacks := func() int64 {
		var n int64
		if err := obs.QueryRow(ctx, "SELECT xact_rollback FROM pg_stat_database WHERE datname = current_database()").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	waited := Int64Key(8_500_000)
	if _, err := other.Exec(ctx, "SELECT pg_advisory_lock(8500000)"); err != nil {
		t.Fatal(err)
	}
	blocked := goLock(func() (*Lock, error) { return s.Lock(ctx, waited) })
	pgtest.Eventually(t, testTimeout, "the Lock waits on the server", func() bool { return waitingOn(t, dsn, waited) == 1 })
	const workers, rounds = 8, 50
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range rounds {
				k := Int64Key(int64(8_500_100 + w*100 + i%3))
				l, err := s.TryLock(ctx, k)
				if err != nil {
					t.Errorf("worker %d: TryLock %v while a Lock waits: %v", w, k, err)
					return
				}
				if err := l.Unlock(ctx); err != nil {
					t.Errorf("worker %d: Unlock %v: %v", w, k, err)
					return
				}
			}
		})
	}
	wg.Wait()
	if _, err := other.Exec(ctx, "SELECT pg_advisory_unlock(8500000)"); err != nil {
		t.Fatal(err)
	}
	r := receive(t, blocked)
	if r.err != nil {
		t.Fatalf("blocking Lock after the key was freed: %v", r.err)
	}
	heldOnlyBy(t, dsn, waited, s.core.Pid)
	mustUnlock(t, r.l)
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, testTimeout, "the session's backend exits", func() bool {
		var n int
		if err := obs.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", s.core.Pid).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
	n := rollbacks()
	t.Logf("%d statements aborted (interrupted wait slices) for %d try+unlock pairs, %d combined statements", n, workers*rounds, combinedCount(s.core))
	if limit := int64(workers * rounds / 40); n > limit {
		t.Errorf("the waiting Lock was interrupted %d times by %d try+unlock pairs (want at most %d): it takes the connection while calls queue for it", n, workers*rounds, limit)
	}
}

// Client.Close while goroutines hammer TryLock, TryRLock and Unlock on the
// Client's one shared backend, their calls combined: every goroutine
// returns (its calls fail with ErrClosed, or an Unlock finds its lock
// ended), Close returns nil, pg_locks shows nothing, and no goroutine is
// left.
func TestCombinedCallsAtClientCloseAllReturn(t *testing.T) {
	dsn := pgtest.DB(t)
	lockState(t, dsn) // the observer's connection is not the Client's
	ignore := goleak.IgnoreCurrent()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	pool := pgtest.Pool(t, dsn)
	c, err := New(pool, WithSharedBackends(1), WithMaxWaits(1))
	if err != nil {
		t.Fatal(err)
	}
	const workers = 12
	var wg sync.WaitGroup
	var mu sync.Mutex
	ops := 0
	started := make(chan struct{}, workers)
	for w := range workers {
		wg.Go(func() {
			for i := range 100_000 {
				k := Int64Key(int64(10_000_000 + w*10 + i%4))
				if w%3 == 0 {
					k = PairKey(100, int32(w*10+i%4))
				}
				var l *Lock
				var err error
				if i%2 == 0 {
					l, err = c.TryLock(ctx, k)
				} else {
					l, err = c.TryRLock(ctx, k)
				}
				if i == 3 {
					started <- struct{}{}
				}
				if err != nil {
					if !errors.Is(err, ErrClosed) {
						t.Errorf("worker %d: try %v at Close: %v, want ErrClosed", w, k, err)
					}
					return
				}
				mu.Lock()
				ops++
				mu.Unlock()
				if err := l.Unlock(ctx); err != nil {
					if !errors.Is(err, ErrClosed) && !errors.Is(err, ErrNotHeld) && !errors.Is(err, ErrLockLost) {
						t.Errorf("worker %d: Unlock %v at Close: %v", w, k, err)
					}
					return
				}
			}
			t.Errorf("worker %d: Close did not stop it", w)
		})
	}
	for range workers {
		select {
		case <-started:
		case <-time.After(testTimeout):
			t.Fatal("workers did not start")
		}
	}
	if err := c.Close(ctx); err != nil {
		t.Errorf("Client.Close: %v", err)
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(testTimeout):
		t.Fatal("workers did not return after Close")
	}
	t.Logf("%d acquires before Close", ops)
	if rows := lockState(t, dsn); len(rows) != 0 {
		t.Errorf("pg_locks after Client.Close: %v", rows)
	}
	pool.Close()
	if err := goleak.Find(ignore); err != nil {
		t.Errorf("goroutines left after Close: %v", err)
	}
}

// The Client's shared backend is terminated while goroutines hammer
// TryLock and Unlock on it, their calls combined: every goroutine goes on
// (a try fails with ErrLockLost or succeeds on a new backend; an Unlock of
// a lock on the terminated backend reports it lost), every lock taken on
// the terminated backend ends, no key is held by two handles at once, and
// pg_locks shows nothing at the end.
func TestCombinedCallsSurviveBackendTermination(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn, WithSharedBackends(1), WithMaxWaits(1))
	const workers, rounds = 10, 60
	var mu sync.Mutex
	holders := make(map[Key]int)
	var lost, taken int
	var wg sync.WaitGroup
	terminated := make(chan int32, 1)
	for w := range workers {
		wg.Go(func() {
			for i := range rounds {
				if w == 0 && i == rounds/3 {
					c.core.Mu.Lock()
					var pid int32
					for _, b := range c.core.Backends {
						pid = b.Pid
					}
					c.core.Mu.Unlock()
					if pid != 0 {
						pgtest.Terminate(t, dsn, pid)
						terminated <- pid
					}
				}
				k := Int64Key(int64(11_000_000 + w*10 + i%3))
				l, err := c.TryLock(ctx, k)
				if err != nil {
					if !errors.Is(err, ErrLockLost) && !errors.Is(err, ErrLocked) {
						t.Errorf("worker %d: TryLock %v: %v", w, k, err)
						return
					}
					mu.Lock()
					lost++
					mu.Unlock()
					continue
				}
				mu.Lock()
				taken++
				if holders[k]++; holders[k] > 1 {
					t.Errorf("%v held by %d handles at once", k, holders[k])
				}
				holders[k]--
				mu.Unlock()
				if err := l.Unlock(ctx); err != nil {
					if !errors.Is(err, ErrLockLost) {
						t.Errorf("worker %d: Unlock %v: %v", w, k, err)
						return
					}
					awaitEnd(t, l, "its backend was terminated")
					mu.Lock()
					lost++
					mu.Unlock()
				}
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(testTimeout):
		t.Fatal("workers did not return after their backend was terminated")
	}
	select {
	case pid := <-terminated:
		t.Logf("backend %d terminated; %d acquires, %d calls failed with ErrLockLost or ErrLocked", pid, taken, lost)
	default:
		t.Fatal("no backend was terminated: the test proves nothing")
	}
	if rows := lockState(t, dsn); len(rows) != 0 {
		t.Errorf("pg_locks after every Unlock: %v", rows)
	}
	if st := c.Stat(); st.Locks != 0 {
		t.Errorf("Stat().Locks = %d after every Unlock", st.Locks)
	}
}

// Hooks of a Client whose goroutines hammer TryLock, TryRLock and Unlock
// on its one shared backend, their calls combined: a count of holders per
// key built on OnAcquire and OnRelease never shows two holders that exclude
// each other, every successful acquire is reported once with its backend's
// pid and released once, every refused try is reported with ErrLocked, and
// nothing is dropped.
func TestCombinedCallsKeepHookOrder(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	var mu sync.Mutex
	excl := make(map[Key]int)
	shared := make(map[Key]int)
	var acquired, refused, released, lost int
	var hookErrs []string
	hooks := Hooks{
		OnAcquire: func(e AcquireEvent) {
			mu.Lock()
			defer mu.Unlock()
			switch {
			case e.Err == nil:
				acquired++
				if e.PID == 0 {
					hookErrs = append(hookErrs, fmt.Sprintf("OnAcquire %v: PID 0", e.Key))
				}
				if e.Mode == ModeShared {
					shared[e.Key]++
				} else {
					excl[e.Key]++
				}
				if excl[e.Key] > 1 || excl[e.Key] == 1 && shared[e.Key] > 0 {
					hookErrs = append(hookErrs, fmt.Sprintf("hooks: %v held by %d exclusive and %d shared at once", e.Key, excl[e.Key], shared[e.Key]))
				}
			case errors.Is(e.Err, ErrLocked):
				refused++
			default:
				hookErrs = append(hookErrs, fmt.Sprintf("OnAcquire %v: %v", e.Key, e.Err))
			}
		},
		OnRelease: func(e ReleaseEvent) {
			mu.Lock()
			defer mu.Unlock()
			released++
			if e.Mode == ModeShared {
				shared[e.Key]--
			} else {
				excl[e.Key]--
			}
		},
		OnLoss: func(LossEvent) {
			mu.Lock()
			lost++
			mu.Unlock()
		},
	}
	pool := pgtest.Pool(t, dsn)
	c, err := New(pool, WithSharedBackends(1), WithMaxWaits(1), WithHooks(hooks))
	if err != nil {
		t.Fatal(err)
	}
	keys := []Key{Int64Key(12_000_001), PairKey(120, 1), Int64Key(12_000_002)}
	const workers, rounds = 8, 50
	var wg sync.WaitGroup
	var got, gotRefused int
	var cmu sync.Mutex
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 12))
			for range rounds {
				k := keys[rng.IntN(len(keys))]
				var l *Lock
				var err error
				if rng.IntN(2) == 0 {
					l, err = c.TryLock(ctx, k)
				} else {
					l, err = c.TryRLock(ctx, k)
				}
				if errors.Is(err, ErrLocked) {
					cmu.Lock()
					gotRefused++
					cmu.Unlock()
					continue
				}
				if err != nil {
					t.Errorf("try %v: %v", k, err)
					return
				}
				cmu.Lock()
				got++
				cmu.Unlock()
				if err := l.Unlock(ctx); err != nil {
					t.Errorf("Unlock %v: %v", k, err)
					return
				}
			}
		})
	}
	wg.Wait()
	dropped := c.Stat().DroppedHookEvents
	if err := c.Close(ctx); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, e := range hookErrs {
		t.Error(e)
	}
	t.Logf("%d acquired, %d refused", got, gotRefused)
	if dropped != 0 {
		t.Errorf("%d hook events dropped", dropped)
	}
	if acquired != got || released != got || lost != 0 {
		t.Errorf("hooks: %d acquired, %d released, %d lost; the calls took %d locks", acquired, released, lost, got)
	}
	if refused != gotRefused {
		t.Errorf("hooks: %d refused tries, the calls were refused %d times", refused, gotRefused)
	}
	if rows := lockState(t, dsn); len(rows) != 0 {
		t.Errorf("pg_locks after Close: %v", rows)
	}
}
