package pgcoordgocron_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	pgcoordgocron "github.com/pgcoord/pgcoord/contrib/gocron"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// mustLocker returns a Locker on c, or fails the test.
func mustLocker(t testing.TB, c *pgcoord.Client, opts ...pgcoordgocron.LockerOption) *pgcoordgocron.Locker {
	t.Helper()
	lk, err := pgcoordgocron.NewLocker(c, opts...)
	if err != nil {
		t.Fatalf("NewLocker: %v", err)
	}
	return lk
}

// keyLocker returns a Locker for computing keys only: its Client's pool
// never connects.
func keyLocker(t *testing.T, opts ...pgcoordgocron.LockerOption) *pgcoordgocron.Locker {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	c, err := pgcoord.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return mustLocker(t, c, opts...)
}

// newLocker returns a Locker on c, closed in t.Cleanup.
func newLocker(t *testing.T, c *pgcoord.Client, opts ...pgcoordgocron.LockerOption) *pgcoordgocron.Locker {
	t.Helper()
	lk := mustLocker(t, c, opts...)
	t.Cleanup(func() {
		if err := lk.Close(ctxT(t)); err != nil {
			t.Errorf("close locker: %v", err)
		}
	})
	return lk
}

// TestLockerKeyIsFrozen pins the key of a job: schedulers of two versions
// must take the same lock for the same job.
func TestLockerKeyIsFrozen(t *testing.T) {
	lk := keyLocker(t)
	for _, tc := range []struct {
		prefix, job string
		want        pgcoord.Key
	}{
		{"", "reports", pgcoord.HashKey("pgcoord.gocron.job", "", "reports")},
		{"billing", "reports", pgcoord.HashKey("pgcoord.gocron.job", "billing", "reports")},
	} {
		lk := lk
		if tc.prefix != "" {
			lk = keyLocker(t, pgcoordgocron.WithKeyPrefix(tc.prefix))
		}
		if got := lk.Key(tc.job); got != tc.want {
			t.Errorf("Key(%q) with prefix %q = %v, want %v", tc.job, tc.prefix, got, tc.want)
		}
	}
	if got, want := lk.Key("reports").String(), goldenReportsKey; got != want {
		t.Errorf("Key(reports) = %s, want %s", got, want)
	}
}

// TestLockerHeldElsewhere: Lock fails with ErrLocked while another Client
// holds the job's key, does not wait, and takes it once it is free; jobs
// of other names, and the same name under another prefix, are independent.
func TestLockerHeldElsewhere(t *testing.T) {
	dsn := pgtest.DB(t)
	c := newClient(t, dsn, "locker")
	other := newClient(t, dsn, "other")
	lk := newLocker(t, c, pgcoordgocron.WithMinHold(0))
	ctx := ctxT(t)

	held, err := other.TryLock(ctx, lk.Key("job"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = lk.Lock(ctx, "job")
	if !errors.Is(err, pgcoord.ErrLocked) || !strings.Contains(err.Error(), `"job"`) {
		t.Fatalf("Lock of a job held elsewhere = %v, want ErrLocked naming the job", err)
	}
	for _, l := range keyLocks(t, dsn, lk.Key("job")) {
		if !l.Granted {
			t.Fatalf("Lock left a waiter on the job's key: %+v", l)
		}
	}
	otherJob, err := lk.Lock(ctx, "other-job")
	if err != nil {
		t.Fatalf("Lock of another job: %v", err)
	}
	if err := otherJob.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	prefixed := newLocker(t, c, pgcoordgocron.WithKeyPrefix("app2"), pgcoordgocron.WithMinHold(0))
	pl, err := prefixed.Lock(ctx, "job")
	if err != nil {
		t.Fatalf("Lock of the same job under another prefix: %v", err)
	}
	if err := pl.Unlock(ctx); err != nil {
		t.Fatal(err)
	}

	if err := held.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	l, err := lk.Lock(ctx, "job")
	if err != nil {
		t.Fatalf("Lock after the other holder released: %v", err)
	}
	if holder(t, dsn, lk.Key("job")) == 0 {
		t.Fatal("the job's lock is not in pg_locks")
	}
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if p := holder(t, dsn, lk.Key("job")); p != 0 {
		t.Fatalf("with no minimum hold, the job's lock is still held by backend %d after Unlock", p)
	}
}

// TestLockerMinHold: Unlock returns at once, the lock stays held (in
// pg_locks) until the minimum hold, counted from the call of Lock, is
// over, and is then released; a second Unlock fails with ErrNotHeld.
func TestLockerMinHold(t *testing.T) {
	dsn := pgtest.DB(t)
	c := newClient(t, dsn, "locker")
	other := newClient(t, dsn, "other")
	const hold = 2 * time.Second
	lk := newLocker(t, c, pgcoordgocron.WithMinHold(hold))
	ctx := ctxT(t)

	start := time.Now()
	l, err := lk.Lock(ctx, "job")
	if err != nil {
		t.Fatal(err)
	}
	unlockStart := time.Now()
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(unlockStart); took >= hold/2 {
		t.Fatalf("Unlock blocked for %v; it must return at once and release in the background", took)
	}
	if holder(t, dsn, lk.Key("job")) == 0 {
		// The hold is 2s; this read comes milliseconds after Lock.
		t.Fatalf("the job's lock was released %v after Lock, before the minimum hold %v", time.Since(start), hold)
	}
	if _, err := other.TryLock(ctx, lk.Key("job")); !errors.Is(err, pgcoord.ErrLocked) {
		t.Fatalf("another Client's TryLock during the minimum hold = %v, want ErrLocked", err)
	}
	if err := l.Unlock(ctx); !errors.Is(err, pgcoord.ErrNotHeld) {
		t.Fatalf("second Unlock = %v, want ErrNotHeld", err)
	}
	pgtest.Eventually(t, hold+testTimeout, "the job's lock to be released after the minimum hold", func() bool {
		return holder(t, dsn, lk.Key("job")) == 0
	})
	if held := time.Since(start); held < hold {
		t.Fatalf("released after %v, before the minimum hold %v", held, hold)
	}
	t.Logf("released %v after Lock (minimum hold %v)", time.Since(start).Round(time.Millisecond), hold)
	l2, err := other.TryLock(ctx, lk.Key("job"))
	if err != nil {
		t.Fatalf("another Client's TryLock after the release: %v", err)
	}
	if err := l2.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestLockerRunLongerThanHold: a run that lasts longer than the minimum
// hold is released by Unlock itself, before it returns.
func TestLockerRunLongerThanHold(t *testing.T) {
	dsn := pgtest.DB(t)
	c := newClient(t, dsn, "locker")
	lk := newLocker(t, c, pgcoordgocron.WithMinHold(time.Millisecond))
	ctx := ctxT(t)
	l, err := lk.Lock(ctx, "job")
	if err != nil {
		t.Fatal(err)
	}
	if holder(t, dsn, lk.Key("job")) == 0 {
		t.Fatal("the job's lock is not in pg_locks")
	}
	time.Sleep(2 * time.Millisecond) // the run itself: longer than the 1 ms hold
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if p := holder(t, dsn, lk.Key("job")); p != 0 {
		t.Fatalf("lock still held by backend %d after Unlock of a run longer than the hold", p)
	}
}

// TestLockerClose: Close cuts a minimum hold short (the lock is free in
// pg_locks when Close returns) and later Locks fail with ErrClosed.
func TestLockerClose(t *testing.T) {
	dsn := pgtest.DB(t)
	c := newClient(t, dsn, "locker")
	lk := mustLocker(t, c, pgcoordgocron.WithMinHold(time.Hour))
	ctx := ctxT(t)
	l, err := lk.Lock(ctx, "job")
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if holder(t, dsn, lk.Key("job")) == 0 {
		t.Fatal("the lock was released before its minimum hold of an hour")
	}
	if err := lk.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if p := holder(t, dsn, lk.Key("job")); p != 0 {
		t.Fatalf("lock still held by backend %d after Close", p)
	}
	if _, err := lk.Lock(ctx, "job"); !errors.Is(err, pgcoord.ErrClosed) {
		t.Fatalf("Lock after Close = %v, want ErrClosed", err)
	}
}

// TestLockerCloseWaitsForRuns: Close waits for a lock whose run has not
// ended, and returns ctx's error when ctx ends first.
func TestLockerCloseWaitsForRuns(t *testing.T) {
	dsn := pgtest.DB(t)
	c := newClient(t, dsn, "locker")
	lk := mustLocker(t, c)
	l, err := lk.Lock(ctxT(t), "job")
	if err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := lk.Close(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Close with a run going = %v, want ctx's deadline error", err)
	}
	if err := l.Unlock(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if err := lk.Close(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if p := holder(t, dsn, lk.Key("job")); p != 0 {
		t.Fatalf("lock still held by backend %d after Close", p)
	}
}

// TestLockerOptionErrors: NewLocker refuses invalid options and a nil
// Client, as NewElector does, saying what was wrong, and returns no
// Locker; it reports every problem it finds at once.
func TestLockerOptionErrors(t *testing.T) {
	dsn := pgtest.DB(t)
	c := newClient(t, dsn, "locker")
	for _, tc := range []struct {
		name string
		c    *pgcoord.Client
		opts []pgcoordgocron.LockerOption
		want []string
	}{
		{"nil client", nil, nil, []string{"Client is nil"}},
		{"negative hold", c, []pgcoordgocron.LockerOption{pgcoordgocron.WithMinHold(-time.Second)}, []string{"WithMinHold"}},
		{"bad prefix", c, []pgcoordgocron.LockerOption{pgcoordgocron.WithKeyPrefix("\xff")}, []string{"WithKeyPrefix"}},
		{"nil option", c, []pgcoordgocron.LockerOption{nil}, []string{"nil LockerOption"}},
		{"all of them", nil, []pgcoordgocron.LockerOption{nil, pgcoordgocron.WithMinHold(-time.Second)}, []string{"Client is nil", "nil LockerOption", "WithMinHold"}},
	} {
		lk, err := pgcoordgocron.NewLocker(tc.c, tc.opts...)
		if lk != nil || err == nil || !strings.HasPrefix(err.Error(), "pgcoordgocron: NewLocker: ") {
			t.Errorf("%s: NewLocker = %v, %v; want no Locker and an error", tc.name, lk, err)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: NewLocker = %v, want an error mentioning %q", tc.name, err, w)
			}
		}
	}
	if n := len(pgtest.AdvisoryLocks(t, dsn)); n != 0 {
		t.Errorf("%d advisory locks held after refused Lockers", n)
	}
}

// goldenReportsKey is the key of job "reports" without a prefix, computed
// once: it must never change.
const goldenReportsKey = "int64:5419353463512915438"
