package pgcoord

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// recorder collects the events of WithHooks.
type recorder struct {
	mu          sync.Mutex
	acquires    []AcquireEvent
	releases    []ReleaseEvent
	contentions []ContentionEvent
	losses      []LossEvent
	leaderships []LeadershipEvent
}

func (r *recorder) hooks() Hooks {
	return Hooks{
		OnAcquire:    func(e AcquireEvent) { r.mu.Lock(); r.acquires = append(r.acquires, e); r.mu.Unlock() },
		OnRelease:    func(e ReleaseEvent) { r.mu.Lock(); r.releases = append(r.releases, e); r.mu.Unlock() },
		OnContention: func(e ContentionEvent) { r.mu.Lock(); r.contentions = append(r.contentions, e); r.mu.Unlock() },
		OnLoss:       func(e LossEvent) { r.mu.Lock(); r.losses = append(r.losses, e); r.mu.Unlock() },
		OnLeadership: func(e LeadershipEvent) { r.mu.Lock(); r.leaderships = append(r.leaderships, e); r.mu.Unlock() },
	}
}

// counts returns how many events of each kind arrived: acquires,
// releases, contentions, losses.
func (r *recorder) counts() (int, int, int, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.acquires), len(r.releases), len(r.contentions), len(r.losses)
}

// until waits, bounded, for the counts of events.
func (r *recorder) until(t *testing.T, acquires, releases, contentions, losses int) {
	t.Helper()
	pgtest.Eventually(t, testTimeout, "hook events", func() bool {
		a, rel, c, l := r.counts()
		return a == acquires && rel == releases && c == contentions && l == losses
	})
}

// logRecords is a slog.Handler that keeps records.
type logRecords struct {
	mu      sync.Mutex
	records []slog.Record
}

func (h *logRecords) Enabled(context.Context, slog.Level) bool { return true }
func (h *logRecords) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.records = append(h.records, r)
	return nil
}
func (h *logRecords) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *logRecords) WithGroup(string) slog.Handler      { return h }

// find returns the text of the records at level whose message is msg,
// with their attributes.
func (h *logRecords) find(level slog.Level, msg string) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []string
	for _, r := range h.records {
		if r.Level == level && r.Message == msg {
			var b strings.Builder
			r.Attrs(func(a slog.Attr) bool { b.WriteString(a.String() + " "); return true })
			out = append(out, b.String())
		}
	}
	return out
}

// Hooks see acquires with their wait, contention (local and on the
// server, tries and waits), releases with their hold time, and losses;
// the Debug log shows the same operations and the loss is logged at
// Warn.
func TestHooks(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	var rec recorder
	logs := &logRecords{}
	job, other := HashKey("job"), HashKey("other")
	c := newTestClient(t, dsn, WithHooks(rec.hooks()), WithKeyNames(map[Key]string{job: "job"}), WithLogger(slog.New(logs)))
	rival := newTestClient(t, dsn)

	l, err := c.Lock(ctx, job)
	if err != nil {
		t.Fatal(err)
	}
	rec.until(t, 1, 0, 0, 0)
	if a := rec.acquires[0]; a.Key != job || a.Name != "job" || a.Mode != ModeExclusive || a.Try || a.Err != nil || a.PID != l.core.S.PID() || a.Wait <= 0 {
		t.Errorf("acquire event %+v", a)
	}

	// A try that the process itself refuses, and one the server refuses.
	if _, err := c.TryLock(ctx, job); !errors.Is(err, ErrLocked) {
		t.Fatal(err)
	}
	rec.until(t, 2, 0, 1, 0)
	if e := rec.contentions[0]; !e.Try || !e.Local || e.Key != job || e.Name != "job" {
		t.Errorf("local contention event %+v", e)
	}
	if a := rec.acquires[1]; !a.Try || !errors.Is(a.Err, ErrLocked) || a.PID != 0 {
		t.Errorf("failed try: acquire event %+v", a)
	}
	held, err := rival.Lock(ctx, other)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.TryRLock(ctx, other); !errors.Is(err, ErrLocked) {
		t.Fatal(err)
	}
	rec.until(t, 3, 0, 2, 0)
	if e := rec.contentions[1]; !e.Try || e.Local || e.Key != other || e.Mode != ModeShared {
		t.Errorf("server contention event %+v", e)
	}

	// A wait on the server, then the grant.
	waiting := goLock(func() (*Lock, error) { return c.Lock(ctx, other) })
	rec.until(t, 3, 0, 3, 0)
	if e := rec.contentions[2]; e.Try || e.Local || e.Key != other {
		t.Errorf("wait contention event %+v", e)
	}
	pgtest.Eventually(t, testTimeout, "the wait in pg_locks", func() bool { return waitingOn(t, dsn, other) == 1 })
	if err := held.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	r := receive(t, waiting)
	if r.err != nil {
		t.Fatal(r.err)
	}
	rec.until(t, 4, 0, 3, 0)
	if a := rec.acquires[3]; a.Err != nil || a.Key != other || a.PID != r.l.core.S.PID() {
		t.Errorf("acquire after a wait: %+v", a)
	}

	// A release, and a loss.
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	rec.until(t, 4, 1, 3, 0)
	if e := rec.releases[0]; e.Key != job || e.Name != "job" || e.Err != nil || e.Held <= 0 || e.Handoff {
		t.Errorf("release event %+v", e)
	}
	pgtest.Terminate(t, dsn, r.l.core.S.PID())
	awaitEnd(t, r.l, "a lock of a terminated backend")
	rec.until(t, 4, 1, 3, 1)
	if e := rec.losses[0]; e.Key != other || !errors.Is(e.Err, ErrLockLost) || e.Held <= 0 || e.PID != r.l.core.S.PID() {
		t.Errorf("loss event %+v", e)
	}
	pgtest.Eventually(t, testTimeout, "the loss logged at Warn", func() bool {
		w := logs.find(slog.LevelWarn, "pgcoord: locks lost")
		return len(w) == 1 && strings.Contains(w[0], other.String())
	})
	if d := logs.find(slog.LevelDebug, "pgcoord: acquire"); len(d) != 4 || !strings.Contains(d[0], "name=job") {
		t.Errorf("Debug records of acquires: %q", d)
	}
	if d := logs.find(slog.LevelDebug, "pgcoord: release"); len(d) != 1 {
		t.Errorf("Debug records of releases: %q", d)
	}

	// Close ends the remaining lock and delivers its release before it
	// returns.
	if _, err := c.Lock(ctx, job); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	a, rel, _, _ := rec.counts()
	if a != 5 || rel != 2 || !errors.Is(rec.releases[1].Err, ErrClosed) {
		t.Errorf("after Close: %d acquires, %d releases (%+v)", a, rel, rec.releases)
	}
}

// A blocked hook does not hold up locking; events beyond the bound are
// dropped and counted; a hook that panics is logged and the next event
// is still delivered; leadership events reach OnLeadership.
func TestHooksNeverBlock(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	block := make(chan struct{})
	var mu sync.Mutex
	var leaderships, acquires int
	logs := &logRecords{}
	c := newTestClient(t, dsn, WithLogger(slog.New(logs)), WithHooks(Hooks{
		OnAcquire: func(AcquireEvent) {
			<-block
			mu.Lock()
			acquires++
			mu.Unlock()
		},
		OnRelease:    func(ReleaseEvent) { panic("hook bug") },
		OnLeadership: func(LeadershipEvent) { mu.Lock(); leaderships++; mu.Unlock() },
	}))
	k := Int64Key(1)
	l, err := c.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	// Refused by the process itself: no round trip.
	const tries = 2 * MaxPendingHookEvents
	for range tries {
		if _, err := c.TryLock(ctx, k); !errors.Is(err, ErrLocked) {
			t.Fatal(err)
		}
	}
	if st := c.Stat(); st.DroppedHookEvents == 0 {
		t.Errorf("Stat: %+v, want dropped hook events", st)
	}
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	close(block)
	pgtest.Eventually(t, testTimeout, "the queued events to be delivered", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return int64(acquires)+c.Stat().DroppedHookEvents >= 1+tries
	})
	c.events.leadership(LeadershipEvent{Election: "e", Identity: "me", Term: 1, Leading: true})
	pgtest.Eventually(t, testTimeout, "the events after the blocked hook", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return leaderships == 1
	})
	l, err = c.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, testTimeout, "the panic to be logged", func() bool { return len(logs.find(slog.LevelError, "pgcoord: a hook panicked")) > 0 })
	if w := logs.find(slog.LevelWarn, "pgcoord: hook events dropped: the hooks are slower than the events"); len(w) != 1 {
		t.Errorf("Warn records of dropped events: %q", w)
	}

	// Without hooks, the election code's call is a no-op.
	var none *eventHooks
	none.leadership(LeadershipEvent{})
}

// Without WithLogger, a lost lock is logged at Warn by slog.Default().
func TestLossLoggedByDefault(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	logs := &logRecords{}
	prev := slog.Default()
	slog.SetDefault(slog.New(logs))
	t.Cleanup(func() { slog.SetDefault(prev) })
	c := newTestClient(t, dsn)
	k := HashKey("watched")
	l, err := c.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Terminate(t, dsn, l.core.S.PID())
	awaitEnd(t, l, "a lock of a terminated backend")
	pgtest.Eventually(t, testTimeout, "the loss logged at Warn by slog.Default()", func() bool {
		for _, w := range logs.find(slog.LevelWarn, "pgcoord: locks lost") {
			if strings.Contains(w, k.String()) {
				return true
			}
		}
		return false
	})
	if d := logs.find(slog.LevelDebug, "pgcoord: acquire"); len(d) != 0 {
		t.Errorf("Debug records went to slog.Default() without WithLogger: %q", d)
	}
}
