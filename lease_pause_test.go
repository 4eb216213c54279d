package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/core"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// The lease and the end of blocking acquires, checked from the outside:
// what the package documentation promises about a server that stops
// answering (the loss deadline L), about a wait whose ctx is cancelled or
// runs out, and about Unlock after a loss.

// leaseSlack is how late, by the test's own clock, a declared loss may be
// seen beyond its bound on a loaded machine (the race detector, two cores).
const leaseSlack = time.Second

// lossLog counts the records of a Client's logger that report a lost
// connection or lost locks.
type lossLog struct {
	mu   sync.Mutex
	msgs []string
}

func (h *lossLog) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelInfo }
func (h *lossLog) WithAttrs([]slog.Attr) slog.Handler           { return h }
func (h *lossLog) WithGroup(string) slog.Handler                { return h }
func (h *lossLog) Handle(_ context.Context, r slog.Record) error {
	if strings.Contains(r.Message, "lost") {
		var b strings.Builder
		b.WriteString(r.Message)
		r.Attrs(func(a slog.Attr) bool {
			fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
			return true
		})
		h.mu.Lock()
		h.msgs = append(h.msgs, b.String())
		h.mu.Unlock()
	}
	return nil
}

func (h *lossLog) losses() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.msgs)
}

// backendState reads pg_stat_activity for pid: its state and what it
// waits for. ok is false when pid is not a backend of dsn's database.
func backendState(t testing.TB, conn *pgx.Conn, pid int32) (state, waitType, waitEvent string, ok bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := conn.QueryRow(ctx, `
SELECT coalesce(state, ''), coalesce(wait_event_type, ''), coalesce(wait_event, '')
FROM pg_stat_activity WHERE pid = $1 AND datname = current_database()`, pid).Scan(&state, &waitType, &waitEvent)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", "", "", false
	}
	if err != nil {
		t.Fatalf("read pg_stat_activity for backend %d: %v", pid, err)
	}
	return state, waitType, waitEvent, true
}

// pauseBackend stops the server process pid (a backend of the test's own
// database, checked in pg_stat_activity and /proc) with SIGSTOP once ready
// reports true, and returns when it was stopped and a function that
// resumes it (SIGCONT), which also runs in t.Cleanup.
func pauseBackend(t *testing.T, conn *pgx.Conn, pid int32, ready func(state, waitType, waitEvent string) bool) (time.Time, func()) {
	t.Helper()
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || !strings.Contains(string(cmdline), "postgres") {
		pgtest.SkipOrFail(t, "backend %d is not a postgres process of this machine (%v), so it cannot be paused", pid, err)
	}
	pgtest.Eventually(t, testTimeout, fmt.Sprintf("backend %d ready to be paused", pid), func() bool {
		state, wt, we, ok := backendState(t, conn, pid)
		if !ok {
			t.Fatalf("backend %d is not in pg_stat_activity of the test's database", pid)
		}
		return ready(state, wt, we)
	})
	var once sync.Once
	resume := func() {
		once.Do(func() {
			if err := syscall.Kill(int(pid), syscall.SIGCONT); err != nil {
				t.Errorf("SIGCONT backend %d: %v", pid, err)
			}
		})
	}
	at := time.Now()
	if err := syscall.Kill(int(pid), syscall.SIGSTOP); err != nil {
		pgtest.SkipOrFail(t, "cannot pause backend %d: %v", pid, err)
	}
	t.Cleanup(resume)
	return at, resume
}

// awaitDone waits, bounded, for done and returns when the test saw it.
func awaitDone(t testing.TB, done <-chan struct{}, within time.Duration, what string) time.Time {
	t.Helper()
	select {
	case <-done:
		return time.Now()
	case <-time.After(within):
		t.Fatalf("%s: not within %v", what, within)
		return time.Time{}
	}
}

// backendGoneFrom waits until pid has left pg_stat_activity.
func backendGoneFrom(t testing.TB, conn *pgx.Conn, pid int32) {
	t.Helper()
	pgtest.Eventually(t, testTimeout, fmt.Sprintf("backend %d exits", pid), func() bool {
		_, _, _, ok := backendState(t, conn, pid)
		return !ok
	})
}

// checkLeaseBound checks a loss by its lease: declared (by the library's
// clock) no later than L + one beat after the silence began, seen by the
// test no later than L + leaseSlack after it, and reported as ErrLockLost.
func checkLeaseBound(t *testing.T, s *core.Session, silence, seen time.Time, loss, beat time.Duration) time.Time {
	t.Helper()
	if !errors.Is(s.Err(), ErrLockLost) {
		t.Fatalf("session Err after silence: %v, want ErrLockLost", s.Err())
	}
	declared := leaseLostAt(t, s)
	t.Logf("loss declared %v after the silence began, seen by the test after %v: %v",
		declared.Sub(silence).Round(time.Millisecond), seen.Sub(silence).Round(time.Millisecond), s.Err())
	if d := declared.Sub(silence); d > loss+beat {
		t.Errorf("loss declared %v after the silence began, want within the loss deadline %v (+ one beat %v)", d, loss, beat)
	}
	if d := seen.Sub(silence); d > loss+leaseSlack {
		t.Errorf("Done closed %v after the silence began (test's clock), want within %v + %v", d, loss, leaseSlack)
	}
	return declared
}

// An idle holder whose backend stops answering (SIGSTOP of the backend
// process: the TCP connection stays up, nothing answers) is declared lost
// within L; Unlock afterwards reports ErrLockLost; once the backend runs
// again the server frees the key and the same Client locks it again.
func TestLeaseIdleBackendPaused(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	const loss, beat = 2 * time.Second, 250 * time.Millisecond
	c := newTestClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(beat))
	obs := pgtest.Conn(t, dsn)
	k := HashKey("lease-pause", "idle")
	l, err := c.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	pid := l.core.S.PID()
	heldOnlyBy(t, dsn, k, pid)

	silence, resume := pauseBackend(t, obs, pid, func(state, _, _ string) bool { return state == "idle" })
	seen := awaitDone(t, l.Done(), loss+leaseSlack+testTimeout/2, "loss of a lock whose backend is paused")
	resume()
	checkLeaseBound(t, l.core.S, silence, seen, loss, beat)
	if !errors.Is(l.Err(), ErrLockLost) {
		t.Fatalf("lock Err: %v, want ErrLockLost", l.Err())
	}
	if err := l.Unlock(context.Background()); !errors.Is(err, ErrLockLost) {
		t.Fatalf("Unlock after the lease ran out: %v, want an error wrapping ErrLockLost", err)
	}
	// The session closed its socket: the resumed backend exits, and with
	// it the key.
	backendGoneFrom(t, obs, pid)
	notHeld(t, dsn, k)
	l2, err := c.Lock(ctx, k)
	if err != nil {
		t.Fatalf("Lock after the loss: %v", err)
	}
	if l2.core.S.PID() == pid {
		t.Fatalf("the key was taken again on the lost backend %d", pid)
	}
	heldOnlyBy(t, dsn, k, l2.core.S.PID())
	mustUnlock(t, l2)
}

// A session on which many short statements keep succeeding is never lost
// while they do (for 2.5 L), and when the network then goes silent the
// loss is declared within L of the silence, counted from the last answer:
// not earlier than L after the start of the last statement that the test
// saw succeed, and not later than L (+ a beat) after the silence. An Unlock
// sent into the silence returns, bounded by the lease, with ErrLockLost,
// and so does an Unlock after the loss.
func TestLeaseBusySessionThenSilence(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	proxy := pgtest.NewProxy(t, dsn)
	const loss, beat = 2 * time.Second, 250 * time.Millisecond
	c := newTestClientOn(t, pgtest.Pool(t, dsn, proxy.Route), WithLossDeadline(loss), WithHeartbeat(beat))
	s := newTestSession(t, c)
	held, inflight, busy := HashKey("lease-pause", "held"), HashKey("lease-pause", "inflight"), HashKey("lease-pause", "busy")
	l1, err := s.Lock(ctx, held)
	if err != nil {
		t.Fatal(err)
	}
	l2, err := s.Lock(ctx, inflight)
	if err != nil {
		t.Fatal(err)
	}

	var mu sync.Mutex
	var lastOKStart time.Time // start of the last statement the test saw answered
	var statements int
	stop := make(chan struct{})
	loopDone := make(chan error, 1)
	go func() {
		for {
			select {
			case <-stop:
				loopDone <- nil
				return
			default:
			}
			start := time.Now()
			l, err := s.TryLock(ctx, busy)
			if err != nil {
				loopDone <- err
				return
			}
			mu.Lock()
			lastOKStart, statements = start, statements+1
			mu.Unlock()
			start = time.Now()
			if err := l.Unlock(ctx); err != nil {
				loopDone <- err
				return
			}
			mu.Lock()
			lastOKStart, statements = start, statements+1
			mu.Unlock()
		}
	}()

	// Healthy and busy for 2.5 L: the lease timer fires several times
	// meanwhile and must find the newer answers.
	busyUntil := time.Now().Add(5 * loss / 2)
	select {
	case <-s.Done():
		t.Fatalf("session lost while statements kept succeeding: %v", s.Err())
	case err := <-loopDone:
		t.Fatalf("a statement failed on a healthy connection: %v", err)
	case <-time.After(time.Until(busyUntil)):
	}
	mu.Lock()
	n := statements
	mu.Unlock()
	if n < 50 {
		t.Fatalf("only %d statements in %v; the test needs many", n, 5*loss/2)
	}

	silence := time.Now()
	proxy.Blackhole()
	unlocked := make(chan error, 1)
	go func() { unlocked <- l2.Unlock(context.Background()) }()
	seen := awaitDone(t, s.Done(), loss+leaseSlack+testTimeout/2, "loss after the network went silent")
	close(stop)
	declared := checkLeaseBound(t, s.core, silence, seen, loss, beat)
	mu.Lock()
	last, n := lastOKStart, statements
	mu.Unlock()
	t.Logf("%d statements answered; the last one started %v before the silence", n, silence.Sub(last).Round(time.Microsecond))
	if early := last.Add(loss); declared.Before(early) {
		t.Errorf("loss declared at %v after the silence, before L after the start of the last answered statement (%v): the lease did not count from the last answer",
			declared.Sub(silence), early.Sub(silence))
	}
	select {
	case err := <-loopDone:
		if err != nil && !errors.Is(err, ErrLockLost) {
			t.Errorf("statement in the silence: %v, want ErrLockLost", err)
		}
	case <-time.After(testTimeout):
		t.Fatal("the statement loop did not end after the loss")
	}
	select {
	case err := <-unlocked:
		if !errors.Is(err, ErrLockLost) {
			t.Errorf("Unlock sent into the silence: %v, want an error wrapping ErrLockLost", err)
		}
	case <-time.After(leaseSlack):
		t.Fatal("Unlock sent into the silence did not return within a second of the loss")
	}
	awaitEnd(t, l1, "held lock after the loss")
	if !errors.Is(l1.Err(), ErrLockLost) {
		t.Fatalf("held lock Err: %v, want ErrLockLost", l1.Err())
	}
	if err := l1.Unlock(context.Background()); !errors.Is(err, ErrLockLost) {
		t.Fatalf("Unlock after the loss: %v, want an error wrapping ErrLockLost", err)
	}
	proxy.CloseAll()
	pgtest.Eventually(t, testTimeout, "the server frees the lost session's keys", func() bool {
		st := lockState(t, dsn)
		return len(st[held]) == 0 && len(st[inflight]) == 0 && len(st[busy]) == 0
	})
}

// A session that holds a lock and waits for another on the same backend,
// whose backend stops answering (SIGSTOP) while it waits, is declared lost
// within L; the held lock and the blocked acquire both end with
// ErrLockLost; Unlock of the held lock reports ErrLockLost.
func TestLeaseWaitingBackendPaused(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	const loss, beat = 2 * time.Second, 250 * time.Millisecond
	c := newTestClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(beat))
	other := newTestClient(t, dsn)
	obs := pgtest.Conn(t, dsn)
	mine, wanted := HashKey("lease-pause", "wait-held"), HashKey("lease-pause", "wait-wanted")
	h, err := other.Lock(ctx, wanted)
	if err != nil {
		t.Fatal(err)
	}
	s := newTestSession(t, c)
	l1, err := s.Lock(ctx, mine)
	if err != nil {
		t.Fatal(err)
	}
	wch := goLock(func() (*Lock, error) { return s.Lock(ctx, wanted) })
	pgtest.Eventually(t, testTimeout, "session waits for the key", func() bool { return waitingOn(t, dsn, wanted) == 1 })
	// Let the wait go through at least one slice boundary first: a
	// statement sent after now is answered.
	waitingSince := time.Now()
	pgtest.Eventually(t, testTimeout, "a wait slice ends and the wait resumes", func() bool {
		return s.core.AnsweredAt().After(waitingSince)
	})

	silence, resume := pauseBackend(t, obs, s.PID(), func(state, wt, we string) bool {
		return state == "active" && wt == "Lock" && we == "advisory"
	})
	seen := awaitDone(t, s.Done(), loss+leaseSlack+testTimeout/2, "loss of a session whose backend is paused while it waits")
	resume()
	checkLeaseBound(t, s.core, silence, seen, loss, beat)
	awaitEnd(t, l1, "held lock of the paused backend")
	if !errors.Is(l1.Err(), ErrLockLost) {
		t.Fatalf("held lock Err: %v, want ErrLockLost", l1.Err())
	}
	select {
	case r := <-wch:
		if r.err == nil || !errors.Is(r.err, ErrLockLost) {
			t.Fatalf("blocked Lock on the lost session: (%v, %v), want an error wrapping ErrLockLost", r.l, r.err)
		}
		if d := time.Since(seen); d > leaseSlack {
			t.Errorf("blocked Lock returned %v after the loss", d)
		}
	case <-time.After(leaseSlack + loss):
		t.Fatal("blocked Lock did not return after its session was lost")
	}
	if err := l1.Unlock(context.Background()); !errors.Is(err, ErrLockLost) {
		t.Fatalf("Unlock after the loss: %v, want an error wrapping ErrLockLost", err)
	}
	backendGoneFrom(t, obs, s.PID())
	notHeld(t, dsn, mine)
	heldOnlyBy(t, dsn, wanted, h.core.S.PID())
	mustUnlock(t, h)
	notHeld(t, dsn, wanted)
}

// errTestCancel is the cause the test gives a cancelled acquire.
var errTestCancel = errors.New("lease test: cancelled by the test")

// A blocking Lock whose ctx is cancelled (with a cause, not a deadline)
// at any moment of its wait, including across slice boundaries and while
// the holder releases, returns promptly with the cause when it fails,
// leaves nothing of its own in pg_locks, and loses no connection: the
// Session stays open with its other lock granted, and the Client keeps
// every backend it opened.
func TestLeaseCancelledWait(t *testing.T) {
	t.Parallel()
	for _, onSession := range []bool{true, false} {
		name := "client"
		if onSession {
			name = "session"
		}
		t.Run(name, func(t *testing.T) {
			ctx := testCtx(t)
			dsn := pgtest.DB(t)
			const loss, beat = time.Second, 250 * time.Millisecond
			logs := &lossLog{}
			app := "lease-pause-" + name
			c := newTestClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(beat),
				WithApplicationName(app), WithLogger(slog.New(logs)))
			other := newTestClient(t, dsn)
			obs := pgtest.Conn(t, dsn)
			slice := c.core.Cfg.WaitSlice()
			k, kept := HashKey("lease-pause", "cancel"), HashKey("lease-pause", "cancel-kept")

			var s *Session
			var keptLock *Lock
			lock := c.Lock
			if onSession {
				s = newTestSession(t, c)
				var err error
				if keptLock, err = s.Lock(ctx, kept); err != nil {
					t.Fatal(err)
				}
				lock = s.Lock
			}
			pids := func() map[int32]bool {
				rows, err := obs.Query(ctx, "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND datname = current_database()", app)
				if err != nil {
					t.Fatal(err)
				}
				got, err := pgx.CollectRows(rows, pgx.RowTo[int32])
				if err != nil {
					t.Fatal(err)
				}
				m := make(map[int32]bool)
				for _, p := range got {
					m[p] = true
				}
				return m
			}

			rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
			var took []time.Duration
			var seenPIDs map[int32]bool
			acquired, cancelled := 0, 0
			const rounds = 30
			for i := range rounds {
				h, err := other.Lock(ctx, k)
				if err != nil {
					t.Fatal(err)
				}
				lctx, cancel := context.WithCancelCause(ctx)
				ch := goLock(func() (*Lock, error) { return lock(lctx, k) })
				pgtest.Eventually(t, testTimeout, "the acquire waits in pg_locks", func() bool { return waitingOn(t, dsn, k) == 1 })
				delay := time.Duration(rng.Int64N(int64(slice * 6 / 5)))
				var cancelledAt time.Time
				var cmu sync.Mutex
				fire := time.AfterFunc(delay, func() {
					cmu.Lock()
					cancelledAt = time.Now()
					cmu.Unlock()
					cancel(errTestCancel)
				})
				released := i%3 == 2
				releasedErr := make(chan error, 1)
				if released {
					// The holder releases around the moment of the cancel.
					release := delay + time.Duration(rng.Int64N(int64(20*time.Millisecond))) - 10*time.Millisecond
					time.AfterFunc(max(release, 0), func() { releasedErr <- h.Unlock(context.Background()) })
				}
				r := receive(t, ch)
				if released {
					select {
					case err := <-releasedErr:
						if err != nil {
							t.Fatalf("round %d: holder's Unlock: %v", i, err)
						}
					case <-time.After(testTimeout):
						t.Fatalf("round %d: holder's Unlock did not return", i)
					}
				}
				returned := time.Now()
				fire.Stop()
				cmu.Lock()
				at := cancelledAt
				cmu.Unlock()
				cancel(nil)
				if r.err == nil {
					if !released {
						t.Fatalf("round %d: Lock returned a lock while another Client held the key", i)
					}
					acquired++
					pid := r.l.core.S.PID()
					heldOnlyBy(t, dsn, k, pid)
					mustUnlock(t, r.l)
				} else {
					cancelled++
					if !errors.Is(r.err, errTestCancel) {
						t.Fatalf("round %d (cancel after %v): Lock: %v, want an error wrapping the ctx's cause", i, delay, r.err)
					}
					if at.IsZero() {
						t.Fatalf("round %d: Lock failed before its ctx was cancelled: %v", i, r.err)
					}
					took = append(took, returned.Sub(at))
					// Nothing of the failed acquire in pg_locks: no waiter,
					// and the key granted to the holder only (or to nobody).
					st := lockState(t, dsn)[k]
					for _, x := range st {
						if !x.granted || released || x.pid != h.core.S.PID() {
							t.Fatalf("round %d: pg_locks for the key after a cancelled Lock: %+v (holder %d, released %v)", i, st, h.core.S.PID(), released)
						}
					}
				}
				if !released {
					mustUnlock(t, h)
				}
				notHeld(t, dsn, k)
				if onSession {
					if err := s.Err(); err != nil {
						t.Fatalf("round %d: session ended by a cancelled wait: %v", i, err)
					}
					heldOnlyBy(t, dsn, kept, s.PID())
				}
				now := pids()
				for p := range seenPIDs {
					if !now[p] {
						t.Fatalf("round %d: backend %d of the Client is gone after a cancelled wait (log: %q)", i, p, logs.losses())
					}
				}
				seenPIDs = now
			}
			if got := logs.losses(); len(got) > 0 {
				t.Fatalf("losses logged during cancelled waits: %q", got)
			}
			slices.Sort(took)
			if len(took) == 0 {
				t.Fatal("no acquire was cancelled")
			}
			p50, worst := took[len(took)/2], took[len(took)-1]
			t.Logf("%d cancelled, %d acquired; cancel to return: p50 %v, max %v", cancelled, acquired, p50, worst)
			if worst > 500*time.Millisecond {
				t.Errorf("a cancelled Lock returned %v after the cancel, want within milliseconds (bound 500ms on a loaded machine)", worst)
			}
			if p50 > 100*time.Millisecond {
				t.Errorf("cancelled Locks returned after a median %v, want a few milliseconds (bound 100ms)", p50)
			}
			if onSession {
				// The session still works.
				l, err := s.TryLock(ctx, k)
				if err != nil {
					t.Fatalf("TryLock on the session after the cancelled waits: %v", err)
				}
				heldOnlyBy(t, dsn, k, s.PID())
				mustUnlock(t, l)
				mustUnlock(t, keptLock)
			}
		})
	}
}

// A blocking Lock whose deadline is shorter than a wait slice (or falls in
// a later slice) returns context.DeadlineExceeded not before the deadline
// and soon after it, leaves nothing in pg_locks, and loses no connection.
func TestLeaseDeadlineShorterThanSlice(t *testing.T) {
	t.Parallel()
	for _, onSession := range []bool{true, false} {
		name := "client"
		if onSession {
			name = "session"
		}
		t.Run(name, func(t *testing.T) {
			ctx := testCtx(t)
			dsn := pgtest.DB(t)
			const loss, beat = 2 * time.Second, 250 * time.Millisecond
			logs := &lossLog{}
			c := newTestClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(beat), WithLogger(slog.New(logs)))
			other := newTestClient(t, dsn)
			slice := c.core.Cfg.WaitSlice()
			k, kept := HashKey("lease-pause", "deadline"), HashKey("lease-pause", "deadline-kept")
			h, err := other.Lock(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			var s *Session
			var keptLock *Lock
			lock := c.Lock
			if onSession {
				s = newTestSession(t, c)
				if keptLock, err = s.Lock(ctx, kept); err != nil {
					t.Fatal(err)
				}
				lock = s.Lock
			}
			var worst time.Duration
			for _, d := range []time.Duration{
				5 * time.Millisecond, 40 * time.Millisecond, 150 * time.Millisecond, 400 * time.Millisecond,
				slice - 20*time.Millisecond, slice + 20*time.Millisecond, slice * 3 / 2,
			} {
				for range 2 {
					dctx, cancel := context.WithTimeout(ctx, d)
					deadline, _ := dctx.Deadline()
					_, err := lock(dctx, k)
					returned := time.Now()
					cancel()
					if !errors.Is(err, context.DeadlineExceeded) {
						t.Fatalf("Lock with a %v deadline: %v, want DeadlineExceeded", d, err)
					}
					if returned.Before(deadline) {
						t.Fatalf("Lock with a %v deadline returned %v before it", d, deadline.Sub(returned))
					}
					over := returned.Sub(deadline)
					worst = max(worst, over)
					if over > 300*time.Millisecond {
						t.Errorf("Lock with a %v deadline returned %v after it, want soon after (bound 300ms)", d, over)
					}
					heldOnlyBy(t, dsn, k, h.core.S.PID())
					if n := waitingOn(t, dsn, k); n != 0 {
						t.Fatalf("after a Lock with a %v deadline: %d waiter(s) left in pg_locks", d, n)
					}
					if onSession {
						if err := s.Err(); err != nil {
							t.Fatalf("session ended by a timed-out wait: %v", err)
						}
						heldOnlyBy(t, dsn, kept, s.PID())
					}
				}
			}
			t.Logf("largest overshoot of the deadline: %v (wait slice %v)", worst, slice)
			if got := logs.losses(); len(got) > 0 {
				t.Fatalf("losses logged during timed-out waits: %q", got)
			}
			mustUnlock(t, h)
			l, err := lock(ctx, k)
			if err != nil {
				t.Fatalf("Lock after the timed-out waits: %v", err)
			}
			if onSession && l.core.S != s.core {
				t.Fatal("a Session lock on another connection")
			}
			mustUnlock(t, l)
			if onSession {
				mustUnlock(t, keptLock)
			}
			notHeld(t, dsn, k)
		})
	}
}

// A Client's blocking Lock whose wait backend stops answering (SIGSTOP)
// loses only that backend, within L, and rides through: it waits again on
// another backend and gets the key once the holder releases it.
func TestLeaseClientWaitRidesThroughPausedBackend(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	const loss, beat = 2 * time.Second, 250 * time.Millisecond
	logs := &lossLog{}
	c := newTestClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(beat), WithLogger(slog.New(logs)))
	other := newTestClient(t, dsn)
	obs := pgtest.Conn(t, dsn)
	k := HashKey("lease-pause", "ride")
	h, err := other.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	wch := goLock(func() (*Lock, error) { return c.Lock(ctx, k) })
	var waiter int32
	pgtest.Eventually(t, testTimeout, "the Client waits for the key", func() bool {
		for _, x := range lockState(t, dsn)[k] {
			if !x.granted {
				waiter = x.pid
				return true
			}
		}
		return false
	})
	silence, resume := pauseBackend(t, obs, waiter, func(state, wt, we string) bool {
		return state == "active" && wt == "Lock" && we == "advisory"
	})
	lostLog := fmt.Sprintf("pid=%d ", waiter)
	var seen time.Time
	pgtest.Eventually(t, loss+leaseSlack+testTimeout/2, "the paused wait backend is declared lost", func() bool {
		for _, m := range logs.losses() {
			if strings.Contains(m+" ", lostLog) {
				seen = time.Now()
				return true
			}
		}
		return false
	})
	resume()
	t.Logf("wait backend declared lost %v after it was paused: %q", seen.Sub(silence).Round(time.Millisecond), logs.losses())
	if d := seen.Sub(silence); d > loss+leaseSlack {
		t.Errorf("wait backend declared lost %v after it was paused, want within %v + %v", d, loss, leaseSlack)
	}
	stillWaiting(t, wch)
	backendGoneFrom(t, obs, waiter)
	pgtest.Eventually(t, testTimeout, "the Client waits again on another backend", func() bool { return waitingOn(t, dsn, k) == 1 })
	stillWaiting(t, wch)
	mustUnlock(t, h)
	r := receive(t, wch)
	if r.err != nil {
		t.Fatalf("Lock after its wait backend was lost: %v, want the key", r.err)
	}
	if r.l.core.S.PID() == waiter {
		t.Fatalf("the key was granted on the lost backend %d", waiter)
	}
	heldOnlyBy(t, dsn, k, r.l.core.S.PID())
	mustUnlock(t, r.l)
	notHeld(t, dsn, k)
}
