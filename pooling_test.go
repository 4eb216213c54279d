package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// settingThrough reads a setting through conn.
func settingThrough(t testing.TB, conn *pgx.Conn, name string) string {
	t.Helper()
	var v string
	if err := conn.QueryRow(context.Background(), "SELECT current_setting($1)", name).Scan(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

// bouncerServers returns the backend pid of every server connection that
// PgBouncer holds (SHOW SERVERS on its admin console), with when each was
// opened.
func bouncerServers(t testing.TB, b *pgtest.PgBouncer) map[int32]string {
	t.Helper()
	admin := pgtest.Conn(t, b.AdminConnString())
	rows, err := admin.Query(testCtx(t), "SHOW SERVERS")
	if err != nil {
		t.Fatalf("SHOW SERVERS: %v", err)
	}
	out := map[int32]string{}
	_, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (struct{}, error) {
		vals, err := row.Values()
		if err != nil {
			return struct{}{}, err
		}
		var pid int32
		var opened string
		for i, fd := range row.FieldDescriptions() {
			switch fd.Name {
			case "remote_pid":
				n, err := strconv.ParseInt(fmt.Sprint(vals[i]), 10, 32)
				if err != nil {
					return struct{}{}, fmt.Errorf("remote_pid %v: %w", vals[i], err)
				}
				pid = int32(n)
			case "connect_time":
				opened = fmt.Sprint(vals[i])
			}
		}
		out[pid] = opened
		return struct{}{}, nil
	})
	if err != nil {
		t.Fatalf("SHOW SERVERS: %v", err)
	}
	return out
}

// pooledSettings are the settings a lock connection applies to its own
// backend that a pooled backend must never get.
var pooledSettings = []string{"tcp_user_timeout", "client_connection_check_interval", "tcp_keepalives_count", "tcp_keepalives_idle", "application_name", "statement_timeout", "lock_timeout"}

// pooledBackendsUntouched checks every server connection of a transaction
// pooling PgBouncer (SHOW SERVERS): pg_stat_activity shows none with the
// application name of a pgcoord lock connection, and short transactions
// through PgBouncer, run until each of them has answered, read on each the
// same settings as on a fresh direct connection.
func pooledBackendsUntouched(t testing.TB, b *pgtest.PgBouncer, dsn, appName string) {
	t.Helper()
	ctx := testCtx(t)
	servers := bouncerServers(t, b)
	admin, direct := pgtest.Conn(t, dsn), pgtest.Conn(t, dsn)
	for pid := range servers {
		var app string
		if err := admin.QueryRow(ctx, "SELECT application_name FROM pg_stat_activity WHERE pid = $1", pid).Scan(&app); err != nil {
			t.Fatalf("pg_stat_activity of pooled backend %d: %v", pid, err)
		}
		if app == appName {
			t.Errorf("pooled backend %d has the lock connections' application_name %q", pid, app)
		}
	}
	want := map[string]string{}
	for _, name := range pooledSettings {
		want[name] = settingThrough(t, direct, name)
	}
	conn := pgtest.Conn(t, b.ConnString())
	seen := map[int32]bool{}
	deadline := time.Now().Add(testTimeout)
	for len(seen) < len(servers) {
		if time.Now().After(deadline) {
			t.Fatalf("read the settings of pooled backends %v of %v within %v", seen, servers, testTimeout)
		}
		var pid int32
		got := make([]string, len(pooledSettings))
		dest := []any{&pid}
		sql := "SELECT pg_backend_pid()"
		for i, name := range pooledSettings {
			dest = append(dest, &got[i])
			sql += ", current_setting('" + name + "')"
		}
		if err := conn.QueryRow(ctx, sql).Scan(dest...); err != nil {
			t.Fatal(err)
		}
		if _, ok := servers[pid]; !ok || seen[pid] {
			continue
		}
		seen[pid] = true
		for i, name := range pooledSettings {
			if got[i] != want[name] {
				t.Errorf("pooled backend %d: %s = %q, want the default %q", pid, name, got[i], want[name])
			}
		}
	}
}

// Behind PgBouncer in transaction pooling mode with an idle pool, which
// hands every transaction the same server connection, session locks are
// refused before anything is locked or set on the pooled backend; the
// transaction-level functions work.
func TestTransactionPoolingIdlePool(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	bouncer := pgtest.NewPgBouncer(t, dsn, pgtest.TransactionPooling, pgtest.WithPoolSize(1))
	pool := pgtest.Pool(t, bouncer.ConnString())
	c := newTestClientOn(t, pool, WithApplicationName("pooled-idle"))
	k := HashKey("pooled")
	// The pool's one server connection, opened now.
	if _, err := pool.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatal(err)
	}
	servers := bouncerServers(t, bouncer)
	if len(servers) != 1 {
		t.Fatalf("SHOW SERVERS: %v, want the pool's one server connection", servers)
	}

	if _, err := c.Lock(ctx, k); !errors.Is(err, ErrTransactionPooling) {
		t.Fatalf("Lock behind transaction pooling: %v, want ErrTransactionPooling", err)
	}
	if _, err := c.TryLock(ctx, k); !errors.Is(err, ErrTransactionPooling) {
		t.Fatalf("TryLock behind transaction pooling: %v, want ErrTransactionPooling", err)
	}
	if _, err := c.NewSession(ctx); !errors.Is(err, ErrTransactionPooling) {
		t.Fatalf("NewSession behind transaction pooling: %v, want ErrTransactionPooling", err)
	}
	if n := len(lockState(t, dsn)); n != 0 {
		t.Fatalf("%d advisory locks on the server after the refusals, want none", n)
	}
	// The one pooled backend kept its own settings: the same as a fresh
	// direct connection's.
	pooledBackendsUntouched(t, bouncer, dsn, "pooled-idle")
	// Even a Client that was told the pooler pools sessions finds out.
	told := newTestClientOn(t, pool, WithSessionPooler(), WithApplicationName("pooled-idle"))
	if _, err := told.Lock(ctx, k); !errors.Is(err, ErrTransactionPooling) {
		t.Fatalf("Lock with WithSessionPooler behind transaction pooling: %v, want ErrTransactionPooling", err)
	}
	if n := len(lockState(t, dsn)); n != 0 {
		t.Fatalf("%d advisory locks on the server after the refusals, want none", n)
	}
	pooledBackendsUntouched(t, bouncer, dsn, "pooled-idle")
	// All along, PgBouncer handed back the same server connection.
	if got := bouncerServers(t, bouncer); !maps.Equal(got, servers) {
		t.Fatalf("SHOW SERVERS after the refusals: %v, want the same one server connection %v", got, servers)
	}

	// Transaction-level locks work through the same pool.
	xactLocksWork(t, ctx, pool, dsn, k, HashKey("pooled-2"))
}

// Behind PgBouncer in transaction pooling mode with a busy pool, where the
// server connection changes between transactions, session locks are
// refused every time and nothing is left on any backend; the
// transaction-level functions work.
func TestTransactionPoolingBusyPool(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	bouncer := pgtest.NewPgBouncer(t, dsn, pgtest.TransactionPooling, pgtest.WithPoolSize(3))
	pool := pgtest.Pool(t, bouncer.ConnString())

	// Other clients keep the pool busy with short transactions.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 3 {
		conn := pgtest.Conn(t, bouncer.ConnString())
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := conn.Exec(ctx, "SELECT pg_sleep(0.002)"); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	defer func() { close(stop); wg.Wait() }()
	// The pool is busy: one client's transactions land on different
	// server connections.
	control := pgtest.Conn(t, bouncer.ConnString())
	pids := map[int32]bool{}
	for i := 0; len(pids) < 2; i++ {
		if i == 1000 {
			t.Fatalf("1000 transactions through the busy pool all ran on backends %v, want the server connection to change", pids)
		}
		var pid int32
		if err := control.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			t.Fatal(err)
		}
		pids[pid] = true
	}

	k := HashKey("pooled-busy")
	for i := range 20 {
		c, err := New(pool, WithApplicationName("pooled-busy"))
		if err != nil {
			t.Fatal(err)
		}
		l, err := c.Lock(ctx, k)
		if !errors.Is(err, ErrTransactionPooling) {
			t.Errorf("attempt %d: Lock behind a busy transaction pool: (%v, %v), want ErrTransactionPooling", i, l, err)
		}
		if err := c.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
		if n := len(lockState(t, dsn)); n != 0 {
			t.Fatalf("attempt %d: %d advisory locks on the server, want none", i, n)
		}
	}
	// No pooled backend got a lock connection's settings.
	pooledBackendsUntouched(t, bouncer, dsn, "pooled-busy")
	// Transaction-level locks work through the busy pool.
	for range 5 {
		xactLocksWork(t, ctx, pool, dsn, k)
	}
}

// xactLocksWork checks InTx on keys, then XactLock on the first key,
// through pool: each holds its keys on its transaction's backend
// (pg_locks) and frees them at the end of the transaction.
func xactLocksWork(t *testing.T, ctx context.Context, pool *pgxpool.Pool, dsn string, keys ...Key) {
	t.Helper()
	k := keys[0]
	err := InTx(ctx, pool, keys, func(tx pgx.Tx) error {
		var pid int32
		if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			return err
		}
		heldOnlyBy(t, dsn, k, pid)
		return nil
	})
	if err != nil {
		t.Fatalf("InTx through a transaction pool: %v", err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := XactLock(ctx, tx, k); err != nil {
		t.Fatalf("XactLock through a transaction pool: %v", err)
	}
	if len(grantedTo(t, dsn, k)) != 1 {
		t.Fatal("XactLock through PgBouncer holds nothing")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	notHeld(t, dsn, k)
}

// Behind PgBouncer in session pooling mode a client keeps its server
// connection, and session locks work.
func TestSessionPoolingWorks(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	bouncer := pgtest.NewPgBouncer(t, dsn, pgtest.SessionPooling, pgtest.WithPoolSize(4))
	c := newTestClientOn(t, pgtest.Pool(t, bouncer.ConnString()), WithSessionPooler())
	other := newTestClient(t, dsn)
	k := HashKey("session-pooled")
	// Without the option, the pooler is refused.
	plain := newTestClientOn(t, pgtest.Pool(t, bouncer.ConnString()))
	if _, err := plain.Lock(ctx, k); !errors.Is(err, ErrTransactionPooling) {
		t.Fatalf("Lock through a pooler without WithSessionPooler: %v, want ErrTransactionPooling", err)
	}
	l, err := c.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	heldOnlyBy(t, dsn, k, l.core.S.PID())
	if _, err := other.TryLock(ctx, k); !errors.Is(err, ErrLocked) {
		t.Fatalf("TryLock of a key held through PgBouncer: %v, want ErrLocked", err)
	}
	// A blocking wait through the proxy, cancelled by a cancel request
	// that PgBouncer forwards.
	h, err := other.Lock(ctx, HashKey("session-pooled-2"))
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	_, err = c.Lock(wctx, HashKey("session-pooled-2"))
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("cancelled wait through PgBouncer: %v", err)
	}
	heldOnlyBy(t, dsn, HashKey("session-pooled-2"), h.core.S.PID())
	mustUnlock(t, h)
	mustUnlock(t, l)
	notHeld(t, dsn, k)
}
