package pgcoord

import (
	"testing"
	"time"

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
	heldOnlyBy(t, sdsn, e.Key(), ld.lock.s.PID())
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
