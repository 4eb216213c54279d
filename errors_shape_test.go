package pgcoord

// The one shape of pgcoord's errors (doc.go, "Errors"): one line,
// "pgcoord: <operation> <subject>: <cause>", the caller's own deadline
// reported as theirs, not as the statement pgcoord cut short for it.

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

func TestErrorShape(t *testing.T) {
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	ctx := testCtx(t)
	if err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	holder := newTestClientOn(t, pool)
	c := newTestClientOn(t, pool)
	k := Int64Key(5151)
	held, err := holder.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	defer mustUnlock(t, held)
	leading, err := holder.Election("shape").Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer leading.Resign(ctx)
	permit, err := holder.Semaphore("shape", 1).Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer permit.Release(ctx)

	short := func() context.Context {
		ctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		t.Cleanup(cancel)
		return ctx
	}
	mine, err := c.Lock(ctx, Int64Key(5152))
	if err != nil {
		t.Fatal(err)
	}
	if err := mine.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name   string
		call   func() error
		prefix string
		is     error
	}{
		{"TryLock held", func() error { _, err := c.TryLock(ctx, k); return err },
			"pgcoord: try lock int64:5151: ", ErrLocked},
		{"TryRLock held", func() error { _, err := c.TryRLock(ctx, k); return err },
			"pgcoord: try read lock int64:5151: ", ErrLocked},
		{"Lock past its deadline", func() error { _, err := c.Lock(short(), k); return err },
			"pgcoord: lock int64:5151: context deadline exceeded", context.DeadlineExceeded},
		{"RLock past its deadline", func() error { _, err := c.RLock(short(), k); return err },
			"pgcoord: read lock int64:5151: context deadline exceeded", context.DeadlineExceeded},
		{"LockAll past its deadline", func() error { _, err := c.LockAll(short(), Int64Key(1), k); return err },
			"pgcoord: lock all [int64:1 int64:5151]: context deadline exceeded", context.DeadlineExceeded},
		{"Lock of the zero Key", func() error { _, err := c.Lock(ctx, Key{}); return err },
			"pgcoord: lock Key{}: invalid key: ", ErrInvalidKey},
		{"LockAll with a zero Key", func() error { _, err := c.LockAll(ctx, Int64Key(1), Key{}); return err },
			"pgcoord: lock all [int64:1 Key{}]: key 2 of 2: invalid key: ", ErrInvalidKey},
		{"LockAll of nothing", func() error { _, err := c.LockAll(ctx); return err },
			"pgcoord: lock []: invalid key: ", ErrInvalidKey},
		{"Unlock twice", func() error { return mine.Unlock(ctx) },
			"pgcoord: unlock int64:5152: ", ErrNotHeld},
		{"Do past its deadline", func() error { return c.Do(short(), k, func(context.Context) error { return nil }) },
			"pgcoord: lock int64:5151: context deadline exceeded", context.DeadlineExceeded},
		{"Campaign past its deadline", func() error { _, err := c.Election("shape").Campaign(short()); return err },
			`pgcoord: campaign election "shape": context deadline exceeded`, context.DeadlineExceeded},
		{"Leader of nobody", func() error { _, err := c.Election("shape-none").Leader(ctx); return err },
			`pgcoord: leader election "shape-none": no leader`, ErrNoLeader},
		{"RequestResign of nobody", func() error { return c.Election("shape-none").RequestResign(ctx) },
			`pgcoord: request resign election "shape-none": no leader`, ErrNoLeader},
		{"Campaign of a bad name", func() error { _, err := c.Election("").Campaign(ctx); return err },
			`pgcoord: campaign election "": `, nil},
		{"TryAcquire of no permit", func() error { _, err := c.Semaphore("shape", 1).TryAcquire(ctx); return err },
			`pgcoord: try acquire semaphore "shape": no semaphore permit free`, ErrNoPermit},
		{"Acquire past its deadline", func() error { _, err := c.Semaphore("shape", 1).Acquire(short()); return err },
			`pgcoord: acquire semaphore "shape": context deadline exceeded`, context.DeadlineExceeded},
		{"SetLimit out of range", func() error { return c.Semaphore("shape", 1).SetLimit(ctx, 0) },
			`pgcoord: set limit semaphore "shape": limit 0 is out of range`, nil},
		{"Acquire with a bad limit", func() error { _, err := c.Semaphore("shape-bad", 0).Acquire(ctx); return err },
			`pgcoord: acquire semaphore "shape-bad": limit 0 is out of range`, nil},
	}
	for _, tc := range cases {
		err := tc.call()
		switch msg := ""; {
		case err == nil:
			t.Errorf("%s: no error", tc.name)
		case tc.is != nil && !errors.Is(err, tc.is):
			t.Errorf("%s: %v, want an error wrapping %v", tc.name, err, tc.is)
		default:
			msg = err.Error()
			if !strings.HasPrefix(msg, tc.prefix) {
				t.Errorf("%s:\n got %q\nwant it to start with %q", tc.name, msg, tc.prefix)
			}
			if strings.Contains(msg, "\n") || strings.Count(msg, "pgcoord:") != 1 {
				t.Errorf("%s: %q: want one line with \"pgcoord:\" once", tc.name, msg)
			}
			for _, leak := range []string{"lock timeout", "55P03", "canceling statement", "57014"} {
				if strings.Contains(msg, leak) {
					t.Errorf("%s: %q reports %q, a statement pgcoord cut short, not the caller's deadline", tc.name, msg, leak)
				}
			}
		}
	}
}

func TestDoErrorsOnOneLine(t *testing.T) {
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	ctx, cancel := context.WithCancel(testCtx(t))
	err := c.Do(ctx, Int64Key(5353), func(fctx context.Context) error {
		cancel()
		<-fctx.Done()
		return fctx.Err()
	})
	if !errors.Is(err, context.Canceled) || strings.Contains(err.Error(), "\n") {
		t.Fatalf("Do = %q, want fn's own error, context.Canceled, on one line", err)
	}
	notHeld(t, dsn, Int64Key(5353))
	fnErr := errors.New("fn gave up")
	if joined := core.JoinErrors(fnErr, core.Errorf("unlock int64:1: %w", ErrNotHeld)); strings.Contains(joined.Error(), "\n") ||
		!errors.Is(joined, fnErr) || !errors.Is(joined, ErrNotHeld) {
		t.Errorf("joinErrors = %q: want one line that wraps both", joined)
	}
}

// An acquire past a deadline set with a cause (context.WithTimeoutCause)
// returns an error wrapping the cause, as context.Cause(ctx) reports it,
// also when a wait slice cut to the deadline ends a moment before ctx's
// own timer does.
func TestAcquirePastDeadlineReportsItsCause(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn, _ := semaphoreDB(t)
	a := newTestClient(t, dsn)
	b := newTestClient(t, dsn)
	k1, k2 := HashKey("cause", "one"), HashKey("cause", "two")
	held, err := a.LockAll(ctx, k1, k2)
	if err != nil {
		t.Fatal(err)
	}
	defer mustUnlock(t, held)
	if _, err := a.Election("cause").Campaign(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Semaphore("cause", 1).Acquire(ctx); err != nil {
		t.Fatal(err)
	}
	calls := map[string]func(context.Context) error{
		"Lock":        func(ctx context.Context) error { _, err := b.Lock(ctx, k1); return err },
		"RLock":       func(ctx context.Context) error { _, err := b.RLock(ctx, k2); return err },
		"LockAll":     func(ctx context.Context) error { _, err := b.LockAll(ctx, k2, k1); return err },
		"Campaign":    func(ctx context.Context) error { _, err := b.Election("cause").Campaign(ctx); return err },
		"Sem.Acquire": func(ctx context.Context) error { _, err := b.Semaphore("cause", 1).Acquire(ctx); return err },
	}
	const rounds = 10
	fails := map[string]int{}
	for range rounds {
		for name, call := range calls {
			dctx, cancel := context.WithTimeoutCause(ctx, 200*time.Millisecond, errStopWaiting)
			err := call(dctx)
			cancel()
			if !errors.Is(err, errStopWaiting) {
				fails[name]++
				if fails[name] == 1 {
					t.Errorf("%s past a deadline with a cause: %v, want it to wrap the cause", name, err)
				}
			}
		}
	}
	if len(fails) > 0 {
		t.Errorf("calls that lost the cause, of %d each: %v", rounds, fails)
	}
}
