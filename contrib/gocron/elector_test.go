package pgcoordgocron_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord"
	pgcoordgocron "github.com/pgcoord/pgcoord/contrib/gocron"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// newElector starts an Elector for election "jobs" on its own Client and
// closes it in t.Cleanup (before the Client, which closes later).
func newElector(t *testing.T, dsn, identity string) *pgcoordgocron.Elector {
	t.Helper()
	c := newClient(t, dsn, "elector-"+identity)
	el, err := pgcoordgocron.NewElector(context.Background(), c, "jobs",
		pgcoordgocron.WithElectionOptions(pgcoord.WithIdentity(identity)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := el.Close(ctxT(t)); err != nil {
			t.Errorf("close elector %s: %v", identity, err)
		}
	})
	return el
}

func awaitLeading(t *testing.T, el *pgcoordgocron.Elector) {
	t.Helper()
	pgtest.Eventually(t, testTimeout, "the elector to lead", func() bool { return el.IsLeader(context.Background()) == nil })
}

// awaitWaiters waits until n backends wait for key in pg_locks.
func awaitWaiters(t *testing.T, dsn string, key pgcoord.Key, n int) {
	t.Helper()
	pgtest.Eventually(t, testTimeout, "candidates to wait for the election's lock", func() bool {
		waiting := 0
		for _, l := range keyLocks(t, dsn, key) {
			if !l.Granted {
				waiting++
			}
		}
		return waiting >= n
	})
}

// TestElectorIsLeader: exactly the Elector whose process holds the
// election's lock (pg_locks, Leader) says it leads; the other says why
// not, with ErrNotLeader; Term is the term Leader reports.
func TestElectorIsLeader(t *testing.T) {
	dsn, _ := migrated(t)
	a := newElector(t, dsn, "a")
	awaitLeading(t, a)
	b := newElector(t, dsn, "b")
	key := a.Election().Key()
	awaitWaiters(t, dsn, key, 1)

	err := b.IsLeader(context.Background())
	if !errors.Is(err, pgcoordgocron.ErrNotLeader) {
		t.Fatalf("follower: IsLeader = %v, want ErrNotLeader", err)
	}
	if err := a.IsLeader(context.Background()); err != nil {
		t.Fatalf("leader: IsLeader = %v", err)
	}
	info, err := a.Election().Leader(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if info.Identity != "a" || info.PID != holder(t, dsn, key) {
		t.Fatalf("Leader = %+v, holder of the election's lock %d; want identity a holding it", info, holder(t, dsn, key))
	}
	term, err := a.Term()
	if err != nil || term != info.Term {
		t.Fatalf("Term = %d, %v; Leader's term %d", term, err, info.Term)
	}
	if _, err := b.Term(); !errors.Is(err, pgcoordgocron.ErrNotLeader) {
		t.Fatalf("follower: Term error = %v, want ErrNotLeader", err)
	}
}

// TestElectorClose: Close makes IsLeader fail at once (ErrNotLeader and
// pgcoord.ErrClosed), resigns (the lock moves to the other candidate's
// backend in pg_locks, and the other Elector leads with a greater term),
// and returns with the campaign's goroutine gone (goleak in TestMain).
func TestElectorClose(t *testing.T) {
	dsn, _ := migrated(t)
	a := newElector(t, dsn, "a")
	awaitLeading(t, a)
	b := newElector(t, dsn, "b")
	key := a.Election().Key()
	awaitWaiters(t, dsn, key, 1)
	before := holder(t, dsn, key)
	termA, err := a.Term()
	if err != nil {
		t.Fatal(err)
	}

	if err := a.Close(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	err = a.IsLeader(context.Background())
	if !errors.Is(err, pgcoordgocron.ErrNotLeader) || !errors.Is(err, pgcoord.ErrClosed) {
		t.Fatalf("after Close: IsLeader = %v, want ErrNotLeader and ErrClosed", err)
	}
	awaitLeading(t, b)
	if after := holder(t, dsn, key); after == 0 || after == before {
		t.Fatalf("election's lock held by backend %d after the leader's Close, before by %d", after, before)
	}
	termB, err := b.Term()
	if err != nil || termB <= termA {
		t.Fatalf("new leader's term %d (%v), old %d", termB, err, termA)
	}
	if err := a.Close(ctxT(t)); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// TestElectorContextEnds: when NewElector's ctx ends, the Elector resigns
// (the election's lock is free in pg_locks) and IsLeader fails.
func TestElectorContextEnds(t *testing.T) {
	dsn, _ := migrated(t)
	c := newClient(t, dsn, "elector")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	el, err := pgcoordgocron.NewElector(ctx, c, "jobs")
	if err != nil {
		t.Fatal(err)
	}
	defer el.Close(context.Background())
	awaitLeading(t, el)
	cancel()
	pgtest.Eventually(t, testTimeout, "the election's lock to be released", func() bool {
		return holder(t, dsn, el.Election().Key()) == 0
	})
	if err := el.IsLeader(context.Background()); !errors.Is(err, pgcoordgocron.ErrNotLeader) {
		t.Fatalf("after ctx ended: IsLeader = %v, want ErrNotLeader", err)
	}
}

// TestElectorBackendTerminated: when the backend that holds the election's
// lock (found in pg_locks) is terminated, IsLeader fails no later than
// pgcoord reports the loss (it is asked from the Client's OnLeadership
// hook, which runs after the leadership's context is cancelled) and keeps
// failing while the other candidate takes over, on another backend, with
// a greater term. The time from the termination to the failure is logged.
func TestElectorBackendTerminated(t *testing.T) {
	dsn, _ := migrated(t)
	var a atomic.Pointer[pgcoordgocron.Elector]
	atLoss := make(chan error, 1)
	hooks := pgcoord.Hooks{OnLeadership: func(ev pgcoord.LeadershipEvent) {
		if el := a.Load(); el != nil && !ev.Leading && ev.Identity == "a" {
			select {
			case atLoss <- el.IsLeader(context.Background()):
			default:
			}
		}
	}}
	c := newClient(t, dsn, "elector-a", pgcoord.WithHooks(hooks))
	el, err := pgcoordgocron.NewElector(context.Background(), c, "jobs",
		pgcoordgocron.WithElectionOptions(pgcoord.WithIdentity("a")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := el.Close(ctxT(t)); err != nil {
			t.Errorf("close elector a: %v", err)
		}
	})
	a.Store(el)
	awaitLeading(t, el)
	term, _ := el.Term()
	b := newElector(t, dsn, "b")
	key := el.Election().Key()
	awaitWaiters(t, dsn, key, 1)
	pid := holder(t, dsn, key)
	if pid == 0 {
		t.Fatal("the leader's election lock is not in pg_locks")
	}

	pgtest.Terminate(t, dsn, pid)
	gone := time.Now()
	pgtest.Eventually(t, 5*time.Second, "IsLeader to fail after the leader's backend was terminated", func() bool {
		return el.IsLeader(context.Background()) != nil
	})
	t.Logf("IsLeader failed %v after the terminated backend had left pg_stat_activity", time.Since(gone).Round(time.Millisecond))
	select {
	case err := <-atLoss:
		if !errors.Is(err, pgcoordgocron.ErrNotLeader) {
			t.Fatalf("IsLeader when pgcoord reported the loss = %v, want ErrNotLeader", err)
		}
	case <-time.After(testTimeout):
		t.Fatal("pgcoord did not report the loss of the leadership")
	}
	awaitLeading(t, b)
	if err := el.IsLeader(context.Background()); !errors.Is(err, pgcoordgocron.ErrNotLeader) {
		t.Fatalf("old leader while the other leads: IsLeader = %v, want ErrNotLeader", err)
	}
	newTerm, err := b.Term()
	if err != nil || newTerm <= term {
		t.Fatalf("new leader's term %d (%v), old %d", newTerm, err, term)
	}
	if now := holder(t, dsn, key); now == 0 || now == pid {
		t.Fatalf("election's lock held by backend %d, the terminated one was %d", now, pid)
	}
}

// TestNewElectorErrors: bad input fails at construction with a message
// that says what is wrong.
func TestNewElectorErrors(t *testing.T) {
	dsn, _ := migrated(t)
	c := newClient(t, dsn, "elector")
	ctx := ctxT(t)
	cases := []struct {
		name string
		new  func() (*pgcoordgocron.Elector, error)
		want string
		is   error
	}{
		{"nil client", func() (*pgcoordgocron.Elector, error) { return pgcoordgocron.NewElector(ctx, nil, "jobs") }, "Client is nil", nil},
		{"empty name", func() (*pgcoordgocron.Elector, error) { return pgcoordgocron.NewElector(ctx, c, "") }, "election name", nil},
		{"nil option", func() (*pgcoordgocron.Elector, error) { return pgcoordgocron.NewElector(ctx, c, "jobs", nil) }, "nil ElectorOption", nil},
		{"bad retry", func() (*pgcoordgocron.Elector, error) {
			return pgcoordgocron.NewElector(ctx, c, "jobs", pgcoordgocron.WithRetryInterval(0))
		}, "WithRetryInterval", nil},
		{"bad identity", func() (*pgcoordgocron.Elector, error) {
			return pgcoordgocron.NewElector(ctx, c, "jobs", pgcoordgocron.WithElectionOptions(pgcoord.WithIdentity("")))
		}, "identity", nil},
		{"not migrated", func() (*pgcoordgocron.Elector, error) {
			return pgcoordgocron.NewElector(ctx, newClient(t, pgtest.DB(t), "bare"), "jobs")
		}, "Migrate", pgcoord.ErrNotMigrated},
	}
	for _, tc := range cases {
		el, err := tc.new()
		if err == nil {
			_ = el.Close(ctx)
			t.Errorf("%s: no error", tc.name)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) || tc.is != nil && !errors.Is(err, tc.is) {
			t.Errorf("%s: error %q, want it to mention %q (and wrap %v)", tc.name, err, tc.want, tc.is)
		}
	}
}
