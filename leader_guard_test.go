package pgcoord

// Tests of an election's guard (the second connection a leader holds so
// that a new leader starts only after the old one knows): a leader without
// it is still cancelled within its loss deadline on a silent network, the
// guard waits of a Client's elections do not wait for each other, and a lost
// guard session ends every leadership of its Client before a follower takes
// over; the proof that a candidate still holds its lock once it holds the
// guard neither leads when it cannot be answered nor disturbs a shared
// backend. Each test reads the outcome back from pg_locks and the leaders
// row.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// A leader that leads without the guard, on a silent network: its context
// must be cancelled within its loss deadline L of the silence (its lease
// runs from the last answered statement, sent before the silence). Its
// watch tries to take the guard every heartbeat (retakeGuard); on the
// silent network that try hangs until the guard session's own lease runs
// out, and the next tick then opens a new guard session through the silent
// network, which waits out the heartbeat interval, while the lock's loss
// is already known. Six such leaders run at once, each on a Client of its
// own behind a proxy of its own.
func TestElectionGuardlessLeaderSilentNetworkWithinL(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	const loss, beat = 2 * time.Second, time.Second
	const n = 6
	squatter := pgtest.Conn(t, dsn)
	type leader struct {
		ld    *Leadership
		proxy *pgtest.Proxy
	}
	leaders := make([]leader, n)
	errs := make(chan error, n)
	for i := range n {
		name := "silent-guardless-" + string(rune('a'+i))
		guardKey := HashKey("pgcoord.election.guard", DefaultSchema, name)
		if _, err := squatter.Exec(ctx, "SELECT pg_advisory_lock($1)", guardKey.coreKey().V); err != nil {
			t.Fatal(err)
		}
		c, proxy := silentClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(beat))
		leaders[i].proxy = proxy
		go func() {
			ld, err := c.Election(name).Campaign(ctx)
			leaders[i].ld = ld
			errs <- err
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	admin := pgtest.Pool(t, dsn)
	for i := range n {
		if _, guarded, _ := leaderRow(t, admin, "silent-guardless-"+string(rune('a'+i))); guarded {
			t.Fatal("leaders row: guarded, with the guard held elsewhere")
		}
	}
	silent := time.Now()
	for _, l := range leaders {
		l.proxy.Blackhole()
	}
	late := 0
	for i, l := range leaders {
		end := awaitLeadershipEnd(t, l.ld)
		d := end.Sub(silent)
		t.Logf("guardless leader %d: context cancelled %v after the network went silent (L = %v): %v", i, d.Round(time.Millisecond), loss, l.ld.Err())
		if d > loss+500*time.Millisecond {
			late++
		}
	}
	if late > 0 {
		t.Errorf("%d of %d guardless leaders had their context cancelled more than L = %v (+500 ms) after the network went silent", late, n, loss)
	}
}

// Two elections followed by one Client, whose elections share its guard
// session. In election A the guard is held elsewhere (as by a paused
// process), so the Client, having won A's lock, waits up to its loss
// deadline for A's guard. Meanwhile B's leader, of another Client, has its
// lock backend terminated; its process lives and frees B's guard within a
// heartbeat. The Client wins B's lock: B's new leader must start right
// after B's old leader's context was cancelled (E3: measured p90 186 ms),
// not when the unrelated wait for A's guard ends.
func TestElectionGuardWaitsAreIndependent(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	admin := pgtest.Pool(t, dsn)
	// B's old leader notices its loss within a heartbeat of 1 s; the
	// Client's loss deadline, which bounds its wait for A's guard, is 4 s.
	oldOpts := []Option{WithLossDeadline(3 * time.Second), WithHeartbeat(time.Second)}
	opts := []Option{WithLossDeadline(4 * time.Second), WithHeartbeat(100 * time.Millisecond)}
	squatter := pgtest.Conn(t, dsn)
	guardA := HashKey("pgcoord.election.guard", DefaultSchema, "shared-guard-a")
	if _, err := squatter.Exec(ctx, "SELECT pg_advisory_lock($1)", guardA.coreKey().V); err != nil {
		t.Fatal(err)
	}
	z := newTestClient(t, dsn, oldOpts...)
	ldZ, err := z.Election("shared-guard-b").Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	y := newTestClient(t, dsn, opts...)
	chB := goCampaign(ctx, y.Election("shared-guard-b"))
	pgtest.Eventually(t, testTimeout, "the Client waits for B's lock", func() bool {
		return waitingOn(t, dsn, keyOf(electionKey(DefaultSchema, "shared-guard-b"))) >= 1
	})
	chA := goCampaign(ctx, y.Election("shared-guard-a"))
	// The Client has won A's lock; A's guard is held elsewhere, so it
	// waits for the guard.
	pgtest.Eventually(t, testTimeout, "the Client wins A's lock and waits for A's guard", func() bool {
		return len(grantedTo(t, dsn, keyOf(electionKey(DefaultSchema, "shared-guard-a")))) == 1
	})
	at := terminateBackend(t, admin, ldZ.lock.S.PID())
	r := receiveCampaign(t, chB, "B")
	if r.err != nil {
		t.Fatal(r.err)
	}
	oldEnd := awaitLeadershipEnd(t, ldZ)
	if r.at.Before(oldEnd) {
		t.Errorf("B: new leader started before the old leader's context was cancelled")
	}
	_, guarded, _ := leaderRow(t, admin, "shared-guard-b")
	t.Logf("B: old leader's context cancelled %v after its backend was terminated; new leader started %v after that (guarded %v)",
		oldEnd.Sub(at).Round(time.Millisecond), r.at.Sub(oldEnd).Round(time.Millisecond), guarded)
	if d := r.at.Sub(oldEnd); d > time.Second {
		t.Errorf("B: the new leader started %v after the old leader's context was cancelled, want right after (< 1 s): it waited for election A's guard", d.Round(time.Millisecond))
	}
	if !guarded {
		t.Errorf("B: the new leader leads without the guard, which the old leader freed %v after its backend was terminated", oldEnd.Sub(at).Round(time.Millisecond))
	}
	if ra := receiveCampaign(t, chA, "A"); ra.err == nil {
		_ = ra.ld.Resign(ctx)
	}
	_ = r.ld.Resign(ctx)
}

// One Client leads several elections, another follows them all; the
// leading Client's guard session, which holds every guard, is terminated.
// Every leadership ends, every follower takes over, and each new leader
// starts only after the old leader of its election had cancelled its
// context.
func TestElectionManyElectionsGuardSessionLost(t *testing.T) {
	t.Parallel()
	const n = 6
	ctx := testCtx(t)
	dsn := migratedDB(t)
	pool := pgtest.Pool(t, dsn)
	a := newTestClient(t, dsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
	b := newTestClient(t, dsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second), WithMaxWaits(n+1))
	olds := make([]*Leadership, n)
	nexts := make([]<-chan campaignResult, n)
	for i := range n {
		name := fmt.Sprintf("many-%d", i)
		ld, err := a.Election(name).Campaign(ctx)
		if err != nil {
			t.Fatal(err)
		}
		olds[i] = ld
		nexts[i] = goCampaign(ctx, b.Election(name))
	}
	pgtest.Eventually(t, testTimeout, "every follower waits for its election's lock", func() bool {
		for i := range n {
			if waitingOn(t, dsn, keyOf(electionKey(DefaultSchema, fmt.Sprintf("many-%d", i)))) < 1 {
				return false
			}
		}
		return true
	})
	gpid := guardSessionPID(a)
	for i, ld := range olds {
		if g := ld.guardLock(); g == nil || g.S.PID() != gpid {
			t.Fatalf("election %d: guard %v not on the guard session %d", i, g, gpid)
		}
	}
	terminateBackend(t, pool, gpid)
	for i := range n {
		r := receiveCampaign(t, nexts[i], fmt.Sprintf("takeover of election %d", i))
		if r.err != nil {
			t.Fatal(r.err)
		}
		cancelled := awaitLeadershipEnd(t, olds[i])
		if !errors.Is(olds[i].Err(), ErrLockLost) {
			t.Errorf("election %d: old leadership ended with %v, want ErrLockLost", i, olds[i].Err())
		}
		if r.at.Before(cancelled) {
			t.Errorf("election %d: the new leader started %v before the old leader's context was cancelled", i, cancelled.Sub(r.at))
		}
		heldOnlyBy(t, dsn, keyOf(electionKey(DefaultSchema, fmt.Sprintf("many-%d", i))), r.ld.lock.S.PID())
		if err := r.ld.Resign(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// guardProofStalled sets up a candidate (loss deadline l, heartbeat h) that
// has won the election's lock, recorded its term and taken the guard, and
// whose proof on the lock's backend (the ping once the guard is held)
// cannot be answered: the lock's backend was paused (SIGSTOP) before the
// guard came free. It returns the candidate's Client, its campaign's
// channel and cancel, the election's key and a function that resumes the
// backend.
func guardProofStalled(t *testing.T, dsn, name string, loss, beat time.Duration) (*Client, <-chan campaignResult, context.CancelFunc, Key, func()) {
	t.Helper()
	ctx := testCtx(t)
	pool := pgtest.Pool(t, dsn)
	key := electionKey(DefaultSchema, name)
	guardKey, freeGuard := holdGuard(t, dsn, name)
	a := newTestClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(beat))
	cctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	next := goCampaign(cctx, a.Election(name))
	pgtest.Eventually(t, testTimeout, "the candidate records its term and waits for the guard", func() bool {
		return rowTerm(ctx, pool, DefaultSchema, name) > 0 && len(grantedTo(t, dsn, keyOf(key))) == 1 && waitingOn(t, dsn, guardKey) >= 1
	})
	obs := pgtest.Conn(t, dsn)
	_, resume := pauseBackend(t, obs, grantedTo(t, dsn, keyOf(key))[0], func(state, _, _ string) bool { return state == "idle" })
	freeGuard()
	pgtest.Eventually(t, testTimeout, "the candidate takes the guard", func() bool {
		pid := guardSessionPID(a)
		got := grantedTo(t, dsn, guardKey)
		return pid != 0 && len(got) == 1 && got[0] == pid
	})
	select {
	case r := <-next:
		t.Fatalf("the campaign returned (%v, %v) although its lock's backend cannot answer the proof", termOf(r), r.err)
	default:
	}
	return a, next, cancel, keyOf(key), resume
}

// The candidate's campaign ctx ends while its proof on the lock's backend
// waits for an answer that does not come (the backend is paused). The
// ping runs to its answer once sent, so the campaign returns when the
// lease gives the backend up: within L, with ctx's error, and it never
// leads. Once the backend runs again, the lock is free.
func TestElectionGuardProofStalledCtxEnds(t *testing.T) {
	t.Parallel()
	dsn := migratedDB(t)
	const loss = 3 * time.Second
	_, next, cancel, key, resume := guardProofStalled(t, dsn, "proof-stalled-cancel", loss, 1500*time.Millisecond)
	start := time.Now()
	cancel()
	r := receiveCampaign(t, next, "cancelled while the proof stalls")
	took := time.Since(start)
	t.Logf("Campaign returned %v after its ctx ended: %v", took.Round(time.Millisecond), r.err)
	if r.ld != nil || !errors.Is(r.err, context.Canceled) {
		t.Fatalf("Campaign = term %v, %v; want context.Canceled and no leadership", termOf(r), r.err)
	}
	if took > loss+time.Second {
		t.Errorf("Campaign returned %v after its ctx ended, want within L = %v (+1 s)", took, loss)
	}
	resume()
	// The resumed backend finds its connection cut and exits.
	pgtest.Eventually(t, testTimeout, "the resumed backend frees the election's lock", func() bool {
		return len(lockState(t, dsn)[key]) == 0
	})
}

// The candidate's Client closes while its proof on the lock's backend
// waits for an answer that does not come (the backend is paused). Close
// returns within L (it cuts the connection it could not release cleanly,
// and says so), the campaign returns ErrClosed, and it never leads.
func TestElectionGuardProofStalledClientCloses(t *testing.T) {
	t.Parallel()
	dsn := migratedDB(t)
	const loss = 3 * time.Second
	a, next, _, key, resume := guardProofStalled(t, dsn, "proof-stalled-close", loss, 1500*time.Millisecond)
	start := time.Now()
	err := a.Close(testCtx(t))
	took := time.Since(start)
	t.Logf("Close returned after %v: %v", took.Round(time.Millisecond), err)
	if took > loss+time.Second {
		t.Errorf("Close took %v while the proof stalled, want within L = %v (+1 s)", took, loss)
	}
	r := receiveCampaign(t, next, "closed while the proof stalls")
	if r.ld != nil || !errors.Is(r.err, ErrClosed) {
		t.Fatalf("Campaign = term %v, %v; want ErrClosed and no leadership", termOf(r), r.err)
	}
	resume()
	// The resumed backend finds its connection cut and exits.
	pgtest.Eventually(t, testTimeout, "the resumed backend frees the election's lock", func() bool {
		return len(lockState(t, dsn)[key]) == 0
	})
}

// The election's lock lives on a Client's only shared backend, beside
// locks of other goroutines, while goroutines keep trying and freeing
// other keys on it. When the guard comes free, the candidate's proof on
// that backend gets its turn among them: it leads promptly, and the
// backend's other locks live on (the proof neither loses nor disturbs
// them).
func TestElectionGuardProofOnBusySharedBackend(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := migratedDB(t)
	const name = "proof-shared"
	key := electionKey(DefaultSchema, name)
	guardKey, freeGuard := holdGuard(t, dsn, name)
	a := newTestClient(t, dsn, WithSharedBackends(1), WithLossDeadline(2*time.Second), WithHeartbeat(200*time.Millisecond))
	var held []*Lock
	for i := range 3 {
		l, err := a.Lock(ctx, HashKey("proof-shared", "held", fmt.Sprint(i)))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, l)
	}
	pid := lockBackendPID(&held[0].core)
	next := goCampaign(ctx, a.Election(name))
	pgtest.Eventually(t, testTimeout, "the candidate wins on the shared backend and waits for the guard", func() bool {
		got := grantedTo(t, dsn, keyOf(key))
		return len(got) == 1 && got[0] == pid && waitingOn(t, dsn, guardKey) >= 1
	})

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var busy sync.Map
	for g := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				l, err := a.TryLock(ctx, HashKey("proof-shared", "busy", fmt.Sprint(g, i%7)))
				if err != nil {
					if !errors.Is(err, ErrLocked) {
						busy.Store(g, err)
						return
					}
					continue
				}
				if err := l.Unlock(ctx); err != nil {
					busy.Store(g, err)
					return
				}
			}
		})
	}
	defer func() { close(stop); wg.Wait() }()

	released := time.Now()
	freeGuard()
	r := receiveCampaign(t, next, "the candidate on the busy shared backend")
	if r.err != nil {
		t.Fatal(r.err)
	}
	took := r.at.Sub(released)
	t.Logf("led %v after the guard came free", took.Round(time.Millisecond))
	if took > 2*time.Second {
		t.Errorf("led %v after the guard came free, want within 2 s", took)
	}
	if got := lockBackendPID(r.ld.lock); got != pid {
		t.Errorf("leadership on backend %d, want the shared backend %d", got, pid)
	}
	for _, l := range held {
		if err := l.Err(); err != nil {
			t.Errorf("a lock on the shared backend was lost: %v", err)
		}
	}
	busy.Range(func(g, err any) bool {
		t.Errorf("goroutine %v: %v", g, err)
		return true
	})
	if err := r.ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	for _, l := range held {
		mustUnlock(t, l)
	}
}
