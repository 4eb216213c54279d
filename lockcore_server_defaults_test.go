package pgcoord

import (
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// The server's defaults for the database (timeouts, read-only
// transactions) do not end the locks of a lock connection.

// Database defaults that would end or refuse a lock connection's work:
// lock_timeout of 1 ms, statement_timeout of 150 ms, idle timeouts of
// 100 ms and 300 ms (the session one from PostgreSQL 14 on), a
// transaction_timeout of 200 ms (from 17 on), and
// default_transaction_read_only. Lock connections
// override the timeouts: a wait outlasts them several times and is granted,
// and the holder's locks, idle meanwhile, stay granted to their backends.
// A fenced acquire, whose fence cannot be written in a read-only
// transaction, fails with the server's error (SQLSTATE 25006) and leaves
// its key free in pg_locks; the Client then takes that key.
func TestServerDefaultsOnDatabaseDoNotEndLocks(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	if err := Migrate(ctx, pgtest.Pool(t, dsn)); err != nil {
		t.Fatal(err)
	}
	admin := pgtest.Conn(t, dsn)
	var version int
	if err := admin.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		t.Fatal(err)
	}
	defaults := [][2]string{
		{"lock_timeout", "1ms"},
		{"statement_timeout", "150ms"},
		{"idle_in_transaction_session_timeout", "100ms"},
		{"default_transaction_read_only", "on"},
	}
	if version >= 140000 {
		defaults = append(defaults, [2]string{"idle_session_timeout", "300ms"})
	}
	if version >= 170000 {
		// Every wait slice is a transaction of its own.
		defaults = append(defaults, [2]string{"transaction_timeout", "200ms"})
	}
	for _, d := range defaults {
		if _, err := admin.Exec(ctx, `DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET `+d[0]+` = %L', current_database(), '`+d[1]+`'); END $$`); err != nil {
			t.Fatal(err)
		}
	}
	// The defaults are in force on an ordinary new connection.
	control := pgtest.Conn(t, dsn)
	if _, err := control.Exec(ctx, "SELECT pg_sleep(0.5)"); core.SqlState(err) != "57014" {
		t.Fatalf("a 0.5 s statement on an ordinary connection: %v, want SQLSTATE 57014", err)
	}

	holder := newTestClient(t, dsn)
	waiter := newTestClient(t, dsn)
	k1, k2, k3, k4 := HashKey("lockcore", "defaults", "1"), HashKey("lockcore", "defaults", "2"), HashKey("lockcore", "defaults", "3"), HashKey("lockcore", "defaults", "4")
	l1, err := holder.Lock(ctx, k1)
	if err != nil {
		t.Fatal(err)
	}
	l2, err := holder.RLock(ctx, k2)
	if err != nil {
		t.Fatal(err)
	}
	l34, err := holder.LockAll(ctx, k3, k4)
	if err != nil {
		t.Fatal(err)
	}
	pids := map[Key]int32{k1: l1.core.S.PID(), k2: l2.core.S.PID(), k3: l34.core.S.PID(), k4: l34.core.S.PID()}

	wch := goLock(func() (*Lock, error) { return waiter.Lock(ctx, k1) })
	var wpid int32
	pgtest.Eventually(t, testTimeout, "the waiter waits in pg_locks", func() bool {
		for _, h := range lockState(t, dsn)[k1] {
			if !h.granted {
				wpid = h.pid
				return true
			}
		}
		stillWaiting(t, wch)
		return false
	})
	// The waiter's backend has waited for more than three times the
	// statement_timeout and the idle_session_timeout (by the server's
	// clock: its backend started before the wait).
	pgtest.Eventually(t, testTimeout, "the wait outlasts the defaults", func() bool {
		var waited time.Duration
		if err := admin.QueryRow(ctx, "SELECT clock_timestamp() - backend_start FROM pg_stat_activity WHERE pid = $1", wpid).Scan(&waited); err != nil {
			t.Fatalf("pg_stat_activity of the waiter's backend %d: %v", wpid, err)
		}
		stillWaiting(t, wch)
		return waited > time.Second
	})
	for _, l := range []*Lock{l1, l2, l34} {
		if err := l.Err(); err != nil {
			t.Fatalf("lock %v ended under the database's defaults: %v", l.Keys(), err)
		}
	}
	for k, pid := range pids {
		heldOnlyBy(t, dsn, k, pid)
	}
	mustUnlock(t, l1)
	r := receive(t, wch)
	if r.err != nil {
		t.Fatalf("the waiter's Lock after the holder's Unlock: %v", r.err)
	}
	if r.l.core.S.PID() != wpid {
		t.Logf("the waiter was granted on backend %d, it waited on %d", r.l.core.S.PID(), wpid)
	}
	heldOnlyBy(t, dsn, k1, r.l.core.S.PID())
	mustUnlock(t, r.l)
	mustUnlock(t, l2)
	mustUnlock(t, l34)

	// A fence cannot be written in a read-only transaction: the acquire
	// fails, and nothing of it stays.
	k5 := HashKey("lockcore", "defaults", "fenced")
	if l, err := waiter.Lock(ctx, k5, WithFence()); err == nil {
		t.Fatalf("Lock WithFence in a database whose transactions are read-only by default: fence %d, want an error", l.Fence())
	} else if core.SqlState(err) != "25006" {
		t.Logf("Lock WithFence: %v", err)
	}
	notHeld(t, dsn, k5)
	l5, err := waiter.TryLock(ctx, k5)
	if err != nil {
		t.Fatalf("TryLock after the failed fenced acquire: %v", err)
	}
	heldOnlyBy(t, dsn, k5, l5.core.S.PID())
	mustUnlock(t, l5)
	for _, k := range []Key{k1, k2, k3, k4, k5} {
		notHeld(t, dsn, k)
	}
}
