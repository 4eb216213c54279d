package pgcoord

// Tests of the server's limits: with no free connection slot or a full lock
// table, an acquire fails with an error that names the setting, leaves none
// of its keys, and everything works again once there is room.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// limitedRole creates a login role that is not a superuser (superusers may
// use the reserved connection slots) and returns dsn as that role.
func limitedRole(t testing.TB, dsn string) string {
	t.Helper()
	ctx := testCtx(t)
	admin := pgtest.Conn(t, dsn)
	for _, sql := range []string{
		"CREATE ROLE pgcoord_app LOGIN",
		"DO $$ BEGIN EXECUTE format('GRANT ALL ON DATABASE %I TO pgcoord_app', current_database()); END $$",
	} {
		if _, err := admin.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Replace(dsn, "://"+cfg.User+"@", "://pgcoord_app@", 1)
}

// With every connection slot taken, a Client that needs a new connection
// gets ErrTooManyConnections with an explanation, nothing is locked, and
// work resumes once slots are free. A wait that finds no slot waits on a
// connection the Client already has.
func TestConnectionSlotsExhausted(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	srv := pgtest.NewServer(t, pgtest.WithSetting("max_connections", "12"))
	admin := srv.DB(t) // a superuser: may use the reserved slots to observe
	dsn := limitedRole(t, admin)
	lockState(t, admin) // open the observer before the slots run out

	warm := newTestClient(t, dsn, WithSharedBackends(1))
	if err := warm.Warm(ctx); err != nil {
		t.Fatal(err)
	}
	other := newTestClient(t, dsn, WithSharedBackends(1))
	if err := other.Warm(ctx); err != nil {
		t.Fatal(err)
	}
	// Take every slot left for ordinary roles.
	var fillers []*pgx.Conn
	for {
		conn, err := pgx.Connect(ctx, dsn)
		if err != nil {
			if core.SqlState(err) != "53300" {
				t.Fatal(err)
			}
			break
		}
		fillers = append(fillers, conn)
		if len(fillers) > 20 {
			t.Fatal("max_connections did not apply")
		}
	}
	t.Logf("filled the server with %d more connections", len(fillers))

	fresh := newTestClient(t, dsn)
	refusedAcquire(t, fresh, HashKey("no-slot"), ErrTooManyConnections)
	if _, err := fresh.TryLock(ctx, HashKey("no-slot")); !strings.Contains(fmt.Sprint(err), "max_connections") {
		t.Fatalf("TryLock with no free slot: %v, want an error naming max_connections", err)
	}
	if n := len(lockState(t, admin)); n != 0 {
		t.Fatalf("%d advisory locks after the refusal", n)
	}

	// A warm Client keeps working on the connection it has, waits included.
	k := HashKey("slots-wait")
	h, err := other.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	wch := goLock(func() (*Lock, error) { return warm.Lock(ctx, k) })
	pgtest.Eventually(t, testTimeout, "waiter queued on its existing backend", func() bool { return waitingOn(t, admin, k) == 1 })
	mustUnlock(t, h)
	r := receive(t, wch)
	if r.err != nil {
		t.Fatalf("wait with no free slot: %v", r.err)
	}
	mustUnlock(t, r.l)

	for _, conn := range fillers {
		closeConnT(conn)
	}
	pgtest.Eventually(t, testTimeout, "slots free again", func() bool {
		l, err := fresh.Lock(ctx, HashKey("no-slot"))
		if err != nil {
			return false
		}
		mustUnlock(t, l)
		return true
	})
	notHeld(t, admin, HashKey("no-slot"))
}

func closeConnT(conn *pgx.Conn) { _ = conn.Close(context.Background()) }

// When the server's lock table is full, an acquire returns ErrTooManyLocks
// naming the setting to raise, leaves nothing behind, and works again once
// locks are released.
func TestLockTableExhausted(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	srv := pgtest.NewServer(t, pgtest.WithSetting("max_locks_per_transaction", "10"), pgtest.WithSetting("max_connections", "20"))
	dsn := srv.DB(t)
	c := newTestClient(t, dsn)
	lockState(t, dsn) // open the observer before the lock table fills
	var held []*Lock
	var err error
	for i := 0; i < 100_000; i++ {
		var l *Lock
		if l, err = c.Lock(ctx, Int64Key(int64(i))); err != nil {
			break
		}
		held = append(held, l)
	}
	if !errors.Is(err, ErrTooManyLocks) || !strings.Contains(err.Error(), "max_locks_per_transaction") {
		t.Fatalf("after %d locks: %v, want ErrTooManyLocks naming max_locks_per_transaction", len(held), err)
	}
	t.Logf("lock table full after %d keys: %v", len(held), err)
	// Reading pg_locks needs lock table space too: free some first.
	for _, l := range held[len(held)-30:] {
		mustUnlock(t, l)
	}
	held = held[:len(held)-30]
	if n := len(lockState(t, dsn)); n != len(held) {
		t.Fatalf("%d keys in pg_locks, want the %d held", n, len(held))
	}
	// A multi-key acquire that runs out midway leaves none of its keys.
	more := make([]Key, 50)
	for i := range more {
		more[i] = HashKey("more", fmt.Sprint(i))
	}
	if _, err := c.LockAll(ctx, more...); !errors.Is(err, ErrTooManyLocks) {
		t.Fatalf("LockAll past the lock table: %v, want ErrTooManyLocks", err)
	}
	if n := len(lockState(t, dsn)); n != len(held) {
		t.Fatalf("%d keys in pg_locks after the failed LockAll, want the %d held", n, len(held))
	}
	for _, l := range held {
		mustUnlock(t, l)
	}
	l, err := c.LockAll(ctx, more...)
	if err != nil {
		t.Fatalf("LockAll after releasing: %v", err)
	}
	mustUnlock(t, l)
	if n := len(lockState(t, dsn)); n != 0 {
		t.Fatalf("%d keys still locked", n)
	}
}

// When the server's lock table is full, LockAll fails with ErrTooManyLocks,
// the keys of the failed call are released and earlier locks stay held.
func TestLockAllTooManyLocks(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	srv := pgtest.NewServer(t) // a private server: this fills its lock table
	dsn := srv.DB(t)
	s := newTestSession(t, newTestClient(t, dsn))
	const batch = 20_000 // keys per LockAll: 20 statements of 1,000
	var held []*Lock
	var err error
	for i := 0; i < 50 && err == nil; i++ {
		keys := make([]Key, batch)
		for j := range keys {
			keys[j] = Int64Key(int64(i*batch + j))
		}
		var l *Lock
		if l, err = s.LockAll(ctx, keys...); err == nil {
			held = append(held, l)
		}
	}
	if !errors.Is(err, ErrTooManyLocks) {
		t.Fatalf("LockAll until the lock table is full: %v, want ErrTooManyLocks", err)
	}
	if len(err.Error()) > 500 {
		t.Errorf("error message of %d bytes: keys should be abbreviated", len(err.Error()))
	}
	t.Logf("full after %d keys: %v", len(held)*batch, err)
	if s.Err() != nil {
		t.Fatalf("session ended: %v", s.Err())
	}
	if n := len(lockState(t, dsn)); n != len(held)*batch {
		t.Fatalf("%d keys locked after the failed LockAll, want the %d of the earlier calls", n, len(held)*batch)
	}
	for _, l := range held {
		mustUnlock(t, l)
	}
	if n := len(lockState(t, dsn)); n != 0 {
		t.Fatalf("%d keys still locked after unlocking everything", n)
	}
}
