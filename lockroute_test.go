package pgcoord

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// waitingQuery returns the statement of the backend that waits for k in
// pg_locks, once one does (bounded by testTimeout).
func waitingQuery(t *testing.T, dsn string, k Key) string {
	t.Helper()
	conn := pgtest.Conn(t, dsn)
	classid, objid, objsubid := k.lockColumns()
	var query string
	pgtest.Eventually(t, testTimeout, "a backend waiting for "+k.String(), func() bool {
		err := conn.QueryRow(context.Background(), `
			SELECT a.query FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE l.locktype = 'advisory' AND NOT l.granted
			  AND l.classid = $1 AND l.objid = $2 AND l.objsubid = $3`,
			int64(classid), int64(objid), objsubid).Scan(&query)
		return err == nil
	})
	return query
}

// A blocking Lock of a key that the Client found held a moment ago does
// not try it first: it tries and waits in one statement (seen in
// pg_stat_activity while it waits), and takes a free key with it too. A
// Client that reports contention to its hooks tries first, so that it
// reports each wait as it starts. The locks are read back from pg_locks.
func TestContendedKeyTriesAndWaitsInOneStatement(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	holder := newTestClient(t, dsn)
	var rec recorder
	watched := newTestClient(t, dsn, WithHooks(rec.hooks()))
	plain := newTestClient(t, dsn)
	for _, c := range []*Client{watched, plain} {
		c.contention.memory = time.Hour // the test's pace does not matter
	}
	k := Int64Key(7001)

	// lockWhileHeld has c Lock k while holder holds it, and returns the
	// statement c's backend waits in.
	lockWhileHeld := func(c *Client) string {
		t.Helper()
		h, err := holder.Lock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan *Lock, 1)
		go func() {
			l, err := c.Lock(ctx, k)
			if err != nil {
				t.Error(err)
			}
			got <- l
		}()
		q := waitingQuery(t, dsn, k)
		mustUnlock(t, h)
		l := <-got
		if l == nil {
			t.FailNow()
		}
		heldOnlyBy(t, dsn, k, l.s.PID())
		mustUnlock(t, l)
		return q
	}

	// The first contended acquire learns of the contention from a try.
	if q := lockWhileHeld(plain); strings.Contains(q, "CASE WHEN") {
		t.Fatalf("the first contended Lock waits in %q, want the plain wait after a try", q)
	}
	if !plain.contention.recent(k) {
		t.Fatal("the Client did not remember that the key was held elsewhere")
	}
	// The next one waits in the statement that tries.
	if q := lockWhileHeld(plain); !strings.Contains(q, "CASE WHEN pg_try_advisory_lock(") {
		t.Fatalf("the second contended Lock waits in %q, want the statement that tries and waits", q)
	}
	// A free key: taken by the same statement.
	l, err := plain.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	heldOnlyBy(t, dsn, k, l.s.PID())
	mustUnlock(t, l)

	// The watched Client tries first every time, and reports each wait.
	for range 2 {
		if q := lockWhileHeld(watched); strings.Contains(q, "CASE WHEN") {
			t.Fatalf("a Client with OnContention waits in %q, want the plain wait after a try", q)
		}
	}
	if !watched.contention.recent(k) {
		t.Fatal("the watched Client did not remember that the key was held elsewhere")
	}
	rec.until(t, 2, 2, 2, 0)
	notHeld(t, dsn, k)
}

// A Client that holds many keys spreads them over more backends, so that
// no backend holds most of them, and stays within WithSharedBackends +
// WithMaxWaits connections. Read back from pg_locks.
func TestManyKeysSpreadOverBackends(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	const n = 4 * spreadAbove
	locks := make([]*Lock, 0, n)
	for i := range n {
		l, err := c.TryLock(ctx, Int64Key(int64(80_000+i)))
		if err != nil {
			t.Fatal(err)
		}
		locks = append(locks, l)
	}
	perPID := make(map[int32]int)
	for _, hs := range lockState(t, dsn) {
		for _, h := range hs {
			if h.granted {
				perPID[h.pid]++
			}
		}
	}
	total, most := 0, 0
	for _, m := range perPID {
		total += m
		most = max(most, m)
	}
	st := c.Stat()
	t.Logf("%d keys on %d backends: %v; Stat %+v", total, len(perPID), perPID, st)
	if total != n {
		t.Fatalf("pg_locks shows %d keys held, want %d", total, n)
	}
	if limit := DefaultSharedBackends + DefaultMaxWaits; st.Backends > limit {
		t.Fatalf("%d backends, want at most WithSharedBackends + WithMaxWaits = %d", st.Backends, limit)
	}
	if len(perPID) < 3 || most > n/2 {
		t.Fatalf("keys held per backend %v: want them spread over at least 3 backends, none holding more than half", perPID)
	}
	for _, l := range locks {
		mustUnlock(t, l)
	}
	if got := len(lockState(t, dsn)); got != 0 {
		t.Fatalf("%d keys still locked after unlocking all", got)
	}
}
