package pgcoord

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// A Campaign whose only server is a standby (a window with no primary:
// the old primary is gone, its standby not promoted yet) waits, its lock
// wait retrying the connection, and leads on that server once it is
// promoted, with the lock held there (pg_locks) and the term recorded in
// its leaders row.
func TestCampaignOnStandbyLeadsOncePromoted(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	primary := pgtest.NewServer(t)
	pdsn := primary.DB(t)
	migrated(t, pdsn)
	before := newTestClient(t, pdsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
	ld0, err := before.Election("standby-window").Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t0 := ld0.Term()
	if err := ld0.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	standby := primary.StartStandby(t)
	dbName := pgtest.Conn(t, pdsn).Config().Database
	sdsn := standby.ConnString(dbName)
	primary.Kill(t)

	c := newTestClient(t, sdsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
	e := c.Election("standby-window")
	type won struct {
		ld  *Leadership
		err error
	}
	campaign := make(chan won, 1)
	go func() {
		ld, err := e.Campaign(ctx)
		campaign <- won{ld, err}
	}()
	if !pgtest.Poll(testTimeout, func() bool {
		select {
		case w := <-campaign:
			t.Fatalf("Campaign returned (%v) while its only server was a standby, want it to wait", w.err)
		default:
		}
		return c.Stat().QueuedWaits > 0
	}) {
		t.Fatal("the campaign never retried its connection while its only server was a standby")
	}
	// A Leader read meanwhile fails or reports the old row: it must not
	// end the campaign.
	_, _ = e.Leader(ctx)
	select {
	case w := <-campaign:
		t.Fatalf("Campaign returned (%v) while its only server was a standby, want it to wait", w.err)
	default:
	}
	standby.Promote(t)
	promoted := time.Now()
	var ld *Leadership
	select {
	case w := <-campaign:
		if w.err != nil {
			t.Fatalf("Campaign after the standby was promoted: %v", w.err)
		}
		ld = w.ld
	case <-ctx.Done():
		t.Fatal("Campaign did not lead after the standby was promoted")
	}
	t.Logf("Campaign led %v after the promotion", time.Since(promoted).Round(time.Millisecond))
	if ld.Term() <= t0 {
		t.Fatalf("term %d on the promoted standby, want above %d from the old primary", ld.Term(), t0)
	}
	heldOnlyBy(t, sdsn, e.Key(), ld.lock.S.PID())
	var recorded int64
	if err := pgtest.Conn(t, sdsn).QueryRow(ctx, "SELECT term FROM pgcoord.leaders WHERE name = $1", e.Name()).Scan(&recorded); err != nil {
		t.Fatal(err)
	}
	if Term(recorded) != ld.Term() {
		t.Fatalf("leaders row holds term %d, want %d", recorded, ld.Term())
	}
	if err := ld.Resign(ctx); err != nil {
		t.Fatal(err)
	}
}

// Close while a Campaign, a Run and an Observe wait for a server that is
// down (its retry interval grown to its longest) returns at once, within
// the loss deadline: the Campaign and the Run return ErrClosed, the Observe
// channel closes, and the Client has no connection being opened nor any
// wait queued (Stat).
func TestCloseEndsCampaignAndRunWaitingForServer(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	srv := pgtest.NewServer(t)
	dsn := srv.DB(t)
	migrated(t, dsn)
	srv.Stop(t)
	c, err := New(pgtest.Pool(t, dsn), WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	e := c.Election("close-while-down")
	campaign, run := make(chan error, 1), make(chan error, 1)
	go func() {
		_, err := e.Campaign(ctx)
		campaign <- err
	}()
	go func() {
		run <- e.Run(ctx, func(context.Context, Term) error {
			return errors.New("fn ran while the server was down")
		})
	}()
	obs := e.Observe(ctx)
	// The campaign's lock wait retries the connection (Run's waits for the
	// key behind it, in the process); wait until the retry interval
	// has had time to grow to its longest (maxRetryInterval).
	waiting := time.Now()
	if !pgtest.Poll(testTimeout, func() bool {
		select {
		case err := <-campaign:
			t.Fatalf("Campaign returned (%v) while the server was down", err)
		case err := <-run:
			t.Fatalf("Run returned (%v) while the server was down", err)
		default:
		}
		return c.Stat().QueuedWaits >= 1 && time.Since(waiting) > 3*core.MaxRetryInterval
	}) {
		t.Fatalf("the campaigns did not retry their connections while the server was down: %+v", c.Stat())
	}
	start := time.Now()
	if err := c.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	took := time.Since(start)
	if took > time.Second {
		t.Fatalf("Close took %v while campaigns waited for the server, want within the loss deadline (1 s)", took)
	}
	for what, ch := range map[string]chan error{"Campaign": campaign, "Run": run} {
		// Close waits for calls in flight, so each has returned; its
		// goroutine sends the result a moment later.
		select {
		case err := <-ch:
			if !errors.Is(err, ErrClosed) {
				t.Fatalf("%s after Close: %v, want ErrClosed", what, err)
			}
		case <-time.After(time.Second):
			t.Fatalf("%s had not returned 1 s after Close returned", what)
		}
	}
	if !pgtest.Poll(testTimeout, func() bool {
		select {
		case _, ok := <-obs:
			return !ok
		default:
			return false
		}
	}) {
		t.Fatal("the Observe channel was not closed after Close")
	}
	if st := c.Stat(); st.Connecting != 0 || st.QueuedWaits != 0 || st.Waits != 0 || st.Backends != 0 || st.Sessions != 0 {
		t.Fatalf("Stat after Close: %+v, want no connection and no wait", st)
	}
	t.Logf("Close took %v", took.Round(time.Microsecond))
}

// A Campaign, and a Run, whose ctx ends while the only server is a
// standby return ctx's error joined with the last connection error
// (ErrReadOnly), as the doc comment of Campaign says and as Lock does
// (RELIABILITY row 22).
func TestCampaignCtxEndOnStandbyReportsLastConnectionError(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	primary := pgtest.NewServer(t)
	pdsn := primary.DB(t)
	migrated(t, pdsn)
	standby := primary.StartStandby(t)
	sdsn := standby.ConnString(pgtest.Conn(t, pdsn).Config().Database)
	c := newTestClient(t, sdsn, WithHeartbeat(100*time.Millisecond), WithLossDeadline(time.Second))
	e := c.Election("standby-ctx")

	lctx, cancel := context.WithTimeout(ctx, 2500*time.Millisecond)
	_, lerr := c.Lock(lctx, Int64Key(7))
	cancel()
	if !errors.Is(lerr, context.DeadlineExceeded) || !errors.Is(lerr, ErrReadOnly) {
		t.Fatalf("Lock on a standby with a 2.5 s ctx: %v, want DeadlineExceeded and ErrReadOnly", lerr)
	}
	cctx, cancel := context.WithTimeout(ctx, 2500*time.Millisecond)
	start := time.Now()
	_, err := e.Campaign(cctx)
	cancel()
	took := time.Since(start)
	if took > 2500*time.Millisecond+time.Second {
		t.Fatalf("Campaign with a 2.5 s ctx returned after %v", took)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Campaign on a standby with a 2.5 s ctx: %v, want DeadlineExceeded", err)
	}
	if !errors.Is(err, ErrReadOnly) {
		t.Fatalf("Campaign on a standby with a 2.5 s ctx: %v, want it joined with the last connection error (ErrReadOnly), as Lock's %v", err, lerr)
	}
	rctx, cancel := context.WithTimeout(ctx, 2500*time.Millisecond)
	err = e.Run(rctx, func(context.Context, Term) error { return nil })
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, ErrReadOnly) {
		t.Fatalf("Run on a standby with a 2.5 s ctx: %v, want DeadlineExceeded joined with ErrReadOnly", err)
	}
}
