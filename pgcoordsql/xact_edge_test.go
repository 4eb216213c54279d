package pgcoordsql_test

import (
	"context"
	"database/sql"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"github.com/pgcoord/pgcoord/pgcoordsql"
)

// sqlStateOf returns the SQLSTATE of err, or "".
func sqlStateOf(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// anyWaiting reports whether some backend other than except waits for an
// advisory lock in the database of dsn.
func anyWaiting(t *testing.T, dsn string, except int32) bool {
	t.Helper()
	for _, l := range pgtest.AdvisoryLocks(t, dsn) {
		if !l.Granted && l.PID != except {
			return true
		}
	}
	return false
}

// noLocksBut waits until no backend but those in keep holds or awaits an
// advisory lock.
func noLocksBut(t *testing.T, dsn string, keep ...int32) {
	t.Helper()
	pgtest.Eventually(t, waitLimit, "advisory locks of other backends to go", func() bool {
		for _, l := range pgtest.AdvisoryLocks(t, dsn) {
			if !slices.Contains(keep, l.PID) {
				return false
			}
		}
		return true
	})
}

// fenceClient migrates dsn's database and returns a Client on it.
func fenceClient(t *testing.T, dsn string) *pgcoord.Client {
	t.Helper()
	ctx := t.Context()
	pool := pgtest.Pool(t, dsn)
	if err := pgcoord.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	c, err := pgcoord.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

// TestXactDoneBeforeSendTxCtx: XactLock with a ctx that is done before the
// statement is sent returns the context's error and sends nothing. If the
// transaction was begun with another, live context, it keeps the key taken
// earlier and commits. If it was begun with that same ctx, database/sql
// rolls it back when ctx ends: the key is released (pg_locks shows none) and
// Commit returns sql.ErrTxDone.
func TestXactDoneBeforeSendTxCtx(t *testing.T) {
	k1, k2 := pgcoord.Int64Key(1), pgcoord.Int64Key(2)
	t.Run("separate ctx", func(t *testing.T) {
		dsn := pgtest.DB(t)
		db := openDB(t, dsn)
		tx, err := db.BeginTx(t.Context(), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		pid := txPid(t, tx)
		ctx, cancel := context.WithCancel(t.Context())
		if err := pgcoordsql.XactLock(ctx, tx, k1); err != nil {
			t.Fatal(err)
		}
		cancel()
		if err := pgcoordsql.XactLock(ctx, tx, k2); !errors.Is(err, context.Canceled) {
			t.Fatalf("XactLock with a done ctx: got %v, want context.Canceled", err)
		}
		if got, w := locksOf(t, dsn, pid), want("ExclusiveLock", "granted", k1); !slices.Equal(got, w) {
			t.Fatalf("after XactLock(done ctx): backend %d holds %q, want %q", pid, got, w)
		}
		if _, err := tx.ExecContext(t.Context(), "SELECT 1"); err != nil {
			t.Fatalf("the transaction was aborted by a call that sent nothing: %v", err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		waitLocks(t, dsn, pid, nil)
		idle(t, db)
	})
	t.Run("BeginTx ctx", func(t *testing.T) {
		dsn := pgtest.DB(t)
		db := openDB(t, dsn)
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		pid := txPid(t, tx)
		if err := pgcoordsql.XactLock(ctx, tx, k1); err != nil {
			t.Fatal(err)
		}
		waitLocks(t, dsn, pid, want("ExclusiveLock", "granted", k1))
		cancel()
		if err := pgcoordsql.XactLock(ctx, tx, k2); !errors.Is(err, context.Canceled) {
			t.Fatalf("XactLock with a done ctx: got %v, want context.Canceled", err)
		}
		// database/sql's rollback (in a goroutine of its own) releases k1;
		// once it has, the transaction is done.
		waitLocks(t, dsn, pid, nil)
		if err := tx.Commit(); !errors.Is(err, sql.ErrTxDone) {
			t.Fatalf("Commit after database/sql rolled back: got %v, want sql.ErrTxDone", err)
		}
		if got := pgtest.AdvisoryLocks(t, dsn); len(got) != 0 {
			t.Fatalf("advisory locks left: %v", got)
		}
		idle(t, db)
	})
}

// tripProxy forwards TCP connections to a PostgreSQL server and records
// the client's round trips: each Sync or simple Query message ends one.
type tripProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	trips  []string
	cur    []string
	conns  []net.Conn
	wg     sync.WaitGroup
}

func newTripProxy(t *testing.T, target string) *tripProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &tripProxy{ln: ln, target: target}
	p.wg.Go(p.accept)
	t.Cleanup(func() {
		ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *tripProxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		p.wg.Go(func() { _, _ = io.Copy(c, s); c.Close() })
		p.wg.Go(func() { p.clientToServer(c, s); s.Close() })
	}
}

// clientToServer forwards the client's messages, recording them.
func (p *tripProxy) clientToServer(c, s net.Conn) {
	var hdr [5]byte
	// Startup-phase messages have no type byte; SSL and GSS requests
	// (code 80877103, 80877104) are followed by another one.
	for {
		if _, err := io.ReadFull(c, hdr[:4]); err != nil {
			return
		}
		n := binary.BigEndian.Uint32(hdr[:4])
		body := make([]byte, n-4)
		if _, err := io.ReadFull(c, body); err != nil {
			return
		}
		if _, err := s.Write(append(hdr[:4:4], body...)); err != nil {
			return
		}
		if code := binary.BigEndian.Uint32(body[:4]); code != 80877103 && code != 80877104 {
			break
		}
	}
	for {
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			return
		}
		n := binary.BigEndian.Uint32(hdr[1:])
		body := make([]byte, n-4)
		if _, err := io.ReadFull(c, body); err != nil {
			return
		}
		p.record(hdr[0], body)
		if _, err := s.Write(append(hdr[:5:5], body...)); err != nil {
			return
		}
	}
}

func (p *tripProxy) record(typ byte, body []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch typ {
	case 'Q':
		p.cur = append(p.cur, "Query("+strings.TrimRight(string(body), "\x00")+")")
	case 'P':
		p.cur = append(p.cur, "Parse")
	case 'B':
		p.cur = append(p.cur, "Bind")
	case 'E':
		p.cur = append(p.cur, "Execute")
	case 'D':
		p.cur = append(p.cur, "Describe")
	case 'S':
		p.cur = append(p.cur, "Sync")
	default:
		p.cur = append(p.cur, string(typ))
	}
	if typ == 'Q' || typ == 'S' {
		p.trips = append(p.trips, strings.Join(p.cur, " "))
		p.cur = nil
	}
}

// take returns the round trips recorded since the last call, leaving out
// database/sql's pings of idle connections.
func (p *tripProxy) take() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for _, tr := range p.trips {
		if !strings.Contains(tr, "-- ping") {
			out = append(out, tr)
		}
	}
	p.trips = nil
	return out
}

// TestInTxRoundTrips: with pgx's stdlib driver, InTx with an fn that sends
// nothing makes exactly the round trips the package documentation gives,
// counted at the protocol level: in the driver's default mode, 4 the first
// time a connection runs a given number of keys (the lock statement is
// prepared first) and 3 after that; with default_query_exec_mode=exec in
// the connection string, always 3 (BEGIN, the lock statement, COMMIT) and
// nothing prepared on the server.
func TestInTxRoundTrips(t *testing.T) {
	counts := []int{2, 2, 3, 1, 2, 3}
	for _, c := range []struct {
		name   string
		params string
		trips  []int
		stmts  int
	}{
		{"default", "", []int{4, 3, 4, 4, 3, 3}, 3},
		{"exec", "default_query_exec_mode=exec", []int{3, 3, 3, 3, 3, 3}, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := t.Context()
			dsn := pgtest.DB(t)
			cfg, err := pgx.ParseConfig(dsn)
			if err != nil {
				t.Fatal(err)
			}
			if c.params != "" {
				sep := "?"
				if strings.Contains(dsn, "?") {
					sep = "&"
				}
				if cfg, err = pgx.ParseConfig(dsn + sep + c.params); err != nil {
					t.Fatal(err)
				}
			}
			p := newTripProxy(t, net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))))
			cfg.Host, cfg.Port, cfg.Fallbacks = "127.0.0.1", uint16(p.ln.Addr().(*net.TCPAddr).Port), nil
			db := stdlib.OpenDB(*cfg)
			t.Cleanup(func() { db.Close() })
			db.SetMaxOpenConns(1)
			for range 2 { // connect, and let database/sql reset the session once
				if err := db.PingContext(ctx); err != nil {
					t.Fatal(err)
				}
			}
			p.take()

			var report []string
			failed := false
			for i, n := range counts {
				keys := make([]pgcoord.Key, n)
				for j := range keys {
					keys[j] = pgcoord.Int64Key(int64(j))
				}
				if err := pgcoordsql.InTx(ctx, db, keys, func(*sql.Tx) error { return nil }); err != nil {
					t.Fatal(err)
				}
				trips := p.take()
				report = append(report, fmt.Sprintf("InTx with %d key(s): %d round trips (want %d): %q", n, len(trips), c.trips[i], trips))
				failed = failed || len(trips) != c.trips[i] ||
					!strings.HasPrefix(trips[0], "Query(begin isolation level read committed") || !strings.HasPrefix(trips[len(trips)-1], "Query(commit")
			}
			if failed {
				t.Fatalf("round trips of InTx:\n%s", strings.Join(report, "\n"))
			}
			t.Log(strings.Join(report, "\n"))
			var n int
			if err := db.QueryRowContext(ctx, "SELECT count(*) FROM pg_prepared_statements").Scan(&n); err != nil {
				t.Fatal(err)
			}
			// In the default mode, the count query is prepared too.
			if c.stmts > 0 {
				c.stmts++
			}
			if n != c.stmts {
				t.Fatalf("%d statements prepared on the connection, want %d", n, c.stmts)
			}
		})
	}
}

// TestInTxReadCommittedByDefault: with default_transaction_isolation =
// 'repeatable read' on the database, InTx and InTxOptions without an
// isolation level still run READ COMMITTED, so two holders of one key that
// each withdraw 100 from a balance of 100 after checking it leave 0: the
// second sees the first one's withdrawal.
func TestInTxReadCommittedByDefault(t *testing.T) {
	for name, run := range map[string]func(context.Context, *sql.DB, []pgcoord.Key, func(*sql.Tx) error) error{
		"InTx": func(ctx context.Context, db *sql.DB, keys []pgcoord.Key, fn func(*sql.Tx) error) error {
			return pgcoordsql.InTx(ctx, db, keys, fn)
		},
		"InTxOptions nil": func(ctx context.Context, db *sql.DB, keys []pgcoord.Key, fn func(*sql.Tx) error) error {
			return pgcoordsql.InTxOptions(ctx, db, nil, keys, fn)
		},
		"InTxOptions LevelDefault": func(ctx context.Context, db *sql.DB, keys []pgcoord.Key, fn func(*sql.Tx) error) error {
			return pgcoordsql.InTxOptions(ctx, db, &sql.TxOptions{Isolation: sql.LevelDefault}, keys, fn)
		},
	} {
		t.Run(name, func(t *testing.T) {
			balance, err := withdrawTwice(t, "repeatable read", "read committed", run)
			if err != nil || balance != 0 {
				t.Fatalf("second withdrawal: %v; balance %d, want nil and 0", err, balance)
			}
		})
	}
}

// TestInTxReadCommittedSeesPreviousHolder: under a READ COMMITTED database
// default, the second holder sees the first one's withdrawal and refuses its
// own: balance 0.
func TestInTxReadCommittedSeesPreviousHolder(t *testing.T) {
	balance, err := withdrawTwice(t, "read committed", "read committed", func(ctx context.Context, db *sql.DB, keys []pgcoord.Key, fn func(*sql.Tx) error) error {
		return pgcoordsql.InTx(ctx, db, keys, fn)
	})
	if err != nil || balance != 0 {
		t.Fatalf("second withdrawal: %v; balance %d, want nil and 0", err, balance)
	}
}

// TestInTxOptionsSnapshotBeforeGrant: an explicit REPEATABLE READ or
// SERIALIZABLE is honoured, with the documented effect of a snapshot taken
// before the key is granted: under REPEATABLE READ the second holder reads
// the balance from before the first one's withdrawal and withdraws too
// (balance -100, no error); under SERIALIZABLE the second holder fails with
// SQLSTATE 40001 and the balance stays 0.
func TestInTxOptionsSnapshotBeforeGrant(t *testing.T) {
	for _, c := range []struct {
		level       sql.IsolationLevel
		name        string
		wantBalance int
		wantState   string
	}{
		{sql.LevelRepeatableRead, "repeatable read", -100, ""},
		{sql.LevelSerializable, "serializable", 0, "40001"},
	} {
		t.Run(c.name, func(t *testing.T) {
			balance, err := withdrawTwice(t, "read committed", c.name, func(ctx context.Context, db *sql.DB, keys []pgcoord.Key, fn func(*sql.Tx) error) error {
				return pgcoordsql.InTxOptions(ctx, db, &sql.TxOptions{Isolation: c.level}, keys, fn)
			})
			if sqlStateOf(err) != c.wantState || (c.wantState == "") != (err == nil) || balance != c.wantBalance {
				t.Fatalf("second withdrawal: %v; balance %d; want SQLSTATE %q and balance %d", err, balance, c.wantState, c.wantBalance)
			}
		})
	}
}

// withdrawTwice sets the database's default isolation level to dbDefault,
// then runs two transactions with run under one key that each withdraw 100
// if the ledger's balance allows: the second waits for the key while the
// first has read the balance. Each checks that its transaction runs at
// level. It returns the final balance and the second run's error (the first
// must succeed).
func withdrawTwice(t *testing.T, dbDefault, level string, run func(context.Context, *sql.DB, []pgcoord.Key, func(*sql.Tx) error) error) (int, error) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	admin := openDB(t, dsn)
	if _, err := admin.ExecContext(ctx, fmt.Sprintf("ALTER DATABASE %s SET default_transaction_isolation = '%s'",
		pgx.Identifier{cfg.Database}.Sanitize(), dbDefault)); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.ExecContext(ctx, "CREATE TABLE ledger (amount int NOT NULL); INSERT INTO ledger VALUES (100)"); err != nil {
		t.Fatal(err)
	}
	db := openDB(t, dsn) // new connections get the setting
	var def string
	if err := db.QueryRowContext(ctx, "SHOW default_transaction_isolation").Scan(&def); err != nil || def != dbDefault {
		t.Fatalf("default_transaction_isolation %q (%v), want %q", def, err, dbDefault)
	}
	key := pgcoord.HashKey("account")
	withdraw := func(tx *sql.Tx, between func()) error {
		var got string
		if err := tx.QueryRowContext(ctx, "SHOW transaction_isolation").Scan(&got); err != nil {
			return err
		}
		if got != level {
			t.Errorf("transaction_isolation %s, want %s", got, level)
		}
		var bal int
		if err := tx.QueryRowContext(ctx, "SELECT sum(amount) FROM ledger").Scan(&bal); err != nil {
			return err
		}
		between()
		if bal >= 100 {
			_, err := tx.ExecContext(ctx, "INSERT INTO ledger VALUES (-100)")
			return err
		}
		return nil
	}
	read := make(chan struct{})
	second := make(chan struct{})
	first := async(func() error {
		return run(ctx, db, []pgcoord.Key{key}, func(tx *sql.Tx) error {
			return withdraw(tx, func() {
				close(read)
				<-second
			})
		})
	})
	select {
	case <-read:
	case err := <-first:
		t.Fatalf("first withdrawal ended before reading: %v", err)
	}
	r2 := async(func() error {
		return run(ctx, db, []pgcoord.Key{key}, func(tx *sql.Tx) error { return withdraw(tx, func() {}) })
	})
	pgtest.Eventually(t, waitLimit, "the second transaction to wait for the key", func() bool { return anyWaiting(t, dsn, 0) })
	close(second)
	if err := first.get(t); err != nil {
		t.Fatalf("first withdrawal: %v", err)
	}
	err2 := r2.get(t)
	var bal int
	if err := admin.QueryRowContext(ctx, "SELECT sum(amount) FROM ledger").Scan(&bal); err != nil {
		t.Fatal(err)
	}
	noLocksBut(t, dsn)
	idle(t, db)
	return bal, err2
}

// TestXactCancelRace: the cancel arrives around the grant (before, with,
// or after the holder's rollback). Either XactLock returns nil and tx holds
// both keys and commits, or it returns the context's error and the keys go
// with the backend, or, when the statement completed but ctx had ended by
// the time it returned, it returns the context's error saying so, tx still
// holds both keys, and its Rollback releases them. No connection stays in
// use.
func TestXactCancelRace(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	db := openDB(t, dsn)
	k1, k2 := pgcoord.Int64Key(1), pgcoord.Int64Key(2)
	outcomes := map[string]int{}
	for i := range 12 {
		holder, _ := begin(t, db)
		if err := pgcoordsql.XactLock(ctx, holder, k2); err != nil {
			t.Fatal(err)
		}
		tx, pid := begin(t, db)
		cctx, cancel := context.WithCancel(ctx)
		r := async(func() error { return pgcoordsql.XactLock(cctx, tx, k2, k1) })
		waitLocks(t, dsn, pid, append(want("ExclusiveLock", "granted", k1), want("ExclusiveLock", "waiting", k2)...))
		switch i % 3 {
		case 0:
			cancel()
			_ = holder.Rollback()
		case 1:
			_ = holder.Rollback()
			cancel()
		default:
			var wg sync.WaitGroup
			wg.Go(cancel)
			wg.Go(func() { _ = holder.Rollback() })
			wg.Wait()
		}
		err := r.get(t)
		switch {
		case err == nil:
			outcomes["granted"]++
			waitLocks(t, dsn, pid, want("ExclusiveLock", "granted", k1, k2))
			if err := tx.Commit(); err != nil {
				t.Fatalf("iteration %d: XactLock returned nil, then Commit: %v", i, err)
			}
			waitLocks(t, dsn, pid, nil)
		case errors.Is(err, context.Canceled) && strings.Contains(err.Error(), "the statement completed"):
			outcomes["completed as ctx ended"]++
			waitLocks(t, dsn, pid, want("ExclusiveLock", "granted", k1, k2))
			if err := tx.Rollback(); err != nil {
				t.Fatalf("iteration %d: Rollback: %v", i, err)
			}
			waitLocks(t, dsn, pid, nil)
		case errors.Is(err, context.Canceled):
			outcomes["cancelled"]++
			waitLocks(t, dsn, pid, nil)
			_ = tx.Rollback()
			gone(t, db, pid)
		default:
			t.Fatalf("iteration %d: got %v, want nil or context.Canceled", i, err)
		}
		cancel()
		noLocksBut(t, dsn)
		idle(t, db)
	}
	t.Logf("outcomes: %v", outcomes)
}

// TestInTxPanicAfterCancelledStatement: fn's statement is cancelled (pgx's
// stdlib closes the connection), then fn panics: the panic is re-raised,
// the keys are released, and the *sql.DB has no connection in use and
// works.
func TestInTxPanicAfterCancelledStatement(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	db := openDB(t, dsn)
	k1, k2 := pgcoord.Int64Key(1), pgcoord.Int64Key(2)
	holder, holderPid := begin(t, db)
	if err := pgcoordsql.XactLock(ctx, holder, k2); err != nil {
		t.Fatal(err)
	}
	var pid int32
	var stmtErr error
	var recovered any
	func() {
		defer func() { recovered = recover() }()
		_ = pgcoordsql.InTx(ctx, db, []pgcoord.Key{k1}, func(tx *sql.Tx) error {
			pid = txPid(t, tx)
			cctx, cancel := context.WithCancel(ctx)
			defer cancel()
			r := async(func() error { return pgcoordsql.XactLock(cctx, tx, k2) })
			waitLocks(t, dsn, pid, append(want("ExclusiveLock", "granted", k1), want("ExclusiveLock", "waiting", k2)...))
			cancel()
			stmtErr = r.get(t)
			panic("after a cancelled statement")
		})
	}()
	if recovered != "after a cancelled statement" {
		t.Fatalf("recovered %v, want fn's panic", recovered)
	}
	if !errors.Is(stmtErr, context.Canceled) {
		t.Fatalf("fn's XactLock: %v, want context.Canceled", stmtErr)
	}
	waitLocks(t, dsn, pid, nil)
	gone(t, db, pid)
	if got := locksOf(t, dsn, holderPid); !slices.Equal(got, want("ExclusiveLock", "granted", k2)) {
		t.Fatalf("holder's locks: %q", got)
	}
	if err := holder.Rollback(); err != nil {
		t.Fatal(err)
	}
	idle(t, db)
	if err := pgcoordsql.InTx(ctx, db, []pgcoord.Key{k1, k2}, func(*sql.Tx) error { return nil }); err != nil {
		t.Fatalf("InTx afterwards: %v", err)
	}
	idle(t, db)
}

// TestInTxGoexit: fn ending its goroutine (runtime.Goexit, as t.FailNow
// does) still rolls back: keys released, connection back in the pool.
func TestInTxGoexit(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	db := openDB(t, dsn)
	k := pgcoord.Int64Key(7)
	pids := make(chan int32, 1)
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		_ = pgcoordsql.InTx(ctx, db, []pgcoord.Key{k}, func(tx *sql.Tx) error {
			var pid int32
			if err := tx.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid); err == nil {
				pids <- pid
			}
			runtime.Goexit()
			return nil
		})
	}()
	select {
	case <-ended:
	case <-t.Context().Done():
		t.Fatal("test ended first")
	}
	if len(pids) != 1 {
		t.Fatal("fn did not read its pid")
	}
	waitLocks(t, dsn, <-pids, nil)
	idle(t, db)
}

// TestInTxTerminatedBackend: InTx on a *sql.Conn whose backend the server
// terminated fails at BEGIN without calling fn; a backend terminated while
// fn runs makes fn's statement fail, and InTx returns fn's error
// unchanged (or a commit error if fn ignores it); no key stays held and no
// connection stays in use.
func TestInTxTerminatedBackend(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	db := openDB(t, dsn)
	k := pgcoord.Int64Key(3)

	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var pid int32
	if err := conn.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	pgtest.Terminate(t, dsn, pid)
	called := false
	err = pgcoordsql.InTx(ctx, conn, []pgcoord.Key{k}, func(*sql.Tx) error { called = true; return nil })
	if err == nil || called {
		t.Fatalf("InTx on a terminated *sql.Conn: err %v, fn called %t; want an error and fn not called", err, called)
	}
	t.Logf("InTx on a terminated *sql.Conn: %v", err)
	conn.Close()
	noLocksBut(t, dsn)
	idle(t, db)

	for _, ignore := range []bool{false, true} {
		var fnErr error
		err = pgcoordsql.InTx(ctx, db, []pgcoord.Key{k}, func(tx *sql.Tx) error {
			pid = txPid(t, tx)
			pgtest.Terminate(t, dsn, pid)
			_, fnErr = tx.ExecContext(ctx, "SELECT 1")
			if ignore {
				return nil
			}
			return fnErr
		})
		if fnErr == nil {
			t.Fatal("a statement on a terminated backend succeeded")
		}
		if !ignore && err != fnErr {
			t.Fatalf("InTx: got %v, want fn's error %v unchanged", err, fnErr)
		}
		if ignore && err == nil {
			t.Fatal("InTx committed after fn ignored the error of a terminated backend")
		}
		noLocksBut(t, dsn)
		idle(t, db)
	}
	if err := pgcoordsql.InTx(ctx, db, []pgcoord.Key{k}, func(*sql.Tx) error { return nil }); err != nil {
		t.Fatalf("InTx afterwards: %v", err)
	}
}

// TestXactChunksConcurrent: many goroutines lock large overlapping sets
// (more than one statement's worth, given in random order), shared or
// exclusive, each set in one call: none deadlocks or fails, and nothing
// stays held.
func TestXactChunksConcurrent(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	db := openDB(t, dsn)
	const universe, size, workers, rounds = 2600, 1300, 6, 6
	var wg sync.WaitGroup
	errs := make(chan error, workers*rounds)
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 42))
			for i := range rounds {
				start := rng.IntN(universe - size)
				keys := make([]pgcoord.Key, 0, size+1)
				for j := range size {
					keys = append(keys, pgcoord.Int64Key(int64(start+j)))
				}
				keys = append(keys, pgcoord.PairKey(int32(rng.IntN(3)), 0))
				rng.Shuffle(len(keys), func(a, b int) { keys[a], keys[b] = keys[b], keys[a] })
				shared := (w+i)%3 == 0
				cctx, cancel := context.WithTimeout(ctx, waitLimit)
				tx, err := db.BeginTx(cctx, nil)
				if err == nil {
					if shared {
						err = pgcoordsql.XactRLock(cctx, tx, keys...)
					} else {
						err = pgcoordsql.XactLock(cctx, tx, keys...)
					}
					if err == nil {
						_, err = tx.ExecContext(cctx, "SELECT 1")
					}
					if err == nil {
						err = tx.Commit()
					} else {
						_ = tx.Rollback()
					}
				}
				cancel()
				if err != nil {
					errs <- fmt.Errorf("worker %d round %d (shared %t): %w (deadlock: %t)", w, i, shared, err, errors.Is(err, pgcoord.ErrDeadlock))
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	noLocksBut(t, dsn)
	idle(t, db)
}

// TestXactSavepoints: SAVEPOINT statements through a *sql.Tx. ROLLBACK TO
// releases the keys taken after the savepoint, but not a key already held
// before it; a partial XactTryLock inside a savepoint is undone by ROLLBACK
// TO; RELEASE keeps the keys; an error inside a savepoint releases only the
// keys taken after it; a cancelled wait inside a savepoint frees every key
// of the transaction (pgx's stdlib closes the connection).
func TestXactSavepoints(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	db := openDB(t, dsn)
	k := func(i int64) pgcoord.Key { return pgcoord.Int64Key(i) }
	holder, _ := begin(t, db)
	if err := pgcoordsql.XactLock(ctx, holder, k(4)); err != nil {
		t.Fatal(err)
	}
	tx, pid := begin(t, db)
	exec := func(q string) {
		t.Helper()
		if _, err := tx.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	held := func(keys ...pgcoord.Key) []string { return want("ExclusiveLock", "granted", keys...) }

	if err := pgcoordsql.XactLock(ctx, tx, k(1)); err != nil {
		t.Fatal(err)
	}
	exec("SAVEPOINT a")
	if err := pgcoordsql.XactLock(ctx, tx, k(2), k(1)); err != nil {
		t.Fatal(err)
	}
	waitLocks(t, dsn, pid, held(k(1), k(2)))
	exec("ROLLBACK TO SAVEPOINT a")
	waitLocks(t, dsn, pid, held(k(1)))

	exec("SAVEPOINT b")
	if err := pgcoordsql.XactTryLock(ctx, tx, k(5), k(4), k(3)); !errors.Is(err, pgcoord.ErrLocked) {
		t.Fatalf("XactTryLock with int64:4 held: %v", err)
	}
	waitLocks(t, dsn, pid, held(k(1), k(3)))
	exec("ROLLBACK TO SAVEPOINT b")
	waitLocks(t, dsn, pid, held(k(1)))

	exec("SAVEPOINT c")
	if err := pgcoordsql.XactRLock(ctx, tx, k(6)); err != nil {
		t.Fatal(err)
	}
	exec("RELEASE SAVEPOINT c")
	waitLocks(t, dsn, pid, append(held(k(1)), want("ShareLock", "granted", k(6))...))

	exec("SAVEPOINT d")
	if err := pgcoordsql.XactLock(ctx, tx, k(7)); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.ExecContext(ctx, "SELECT 1/0"); err == nil {
		t.Fatal("SELECT 1/0 succeeded")
	}
	waitLocks(t, dsn, pid, append(held(k(1)), want("ShareLock", "granted", k(6))...))
	exec("ROLLBACK TO SAVEPOINT d")

	exec("SAVEPOINT e")
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	r := async(func() error { return pgcoordsql.XactLock(cctx, tx, k(4), k(3)) })
	waitLocks(t, dsn, pid, append(held(k(1), k(3)), append(want("ShareLock", "granted", k(6)), want("ExclusiveLock", "waiting", k(4))...)...))
	cancel()
	if err := r.get(t); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled wait in a savepoint: %v", err)
	}
	waitLocks(t, dsn, pid, nil)
	_ = tx.Rollback()
	if err := holder.Rollback(); err != nil {
		t.Fatal(err)
	}
	idle(t, db)
}

// TestCheckFenceRace: CheckFence runs while a fenced Lock of the Client
// issues the next fence. Under READ COMMITTED, either CheckFence returns
// nil and no newer fence is committed until tx ends (the Lock gets its
// fence after), or it returns ErrStaleFence. Under REPEATABLE READ, a
// serialization failure is a third documented outcome.
func TestCheckFenceRace(t *testing.T) {
	for _, level := range []sql.IsolationLevel{sql.LevelReadCommitted, sql.LevelRepeatableRead} {
		t.Run(level.String(), func(t *testing.T) {
			ctx := t.Context()
			dsn := pgtest.DB(t)
			c := fenceClient(t, dsn)
			db := openDB(t, dsn)
			key := pgcoord.PairKey(9, 9)
			current := fencedLock(t, c, key)
			outcomes := map[string]int{}
			for i := range 12 {
				tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: level})
				if err != nil {
					t.Fatal(err)
				}
				if i%2 == 0 { // take the snapshot before the race
					txPid(t, tx)
				}
				next := make(chan pgcoord.Term, 1)
				r := async(func() error {
					l, err := c.Lock(ctx, key, pgcoord.WithFence())
					if err != nil {
						return err
					}
					next <- l.Fence()
					return l.Unlock(ctx)
				})
				err = pgcoordsql.CheckFence(ctx, tx, key, current)
				switch {
				case err == nil:
					outcomes["nil"]++
					var stored pgcoord.Term
					if err := db.QueryRowContext(ctx, "SELECT fence FROM pgcoord.fences WHERE key_space = 2 AND key = $1", int64(9)<<32|9).Scan(&stored); err != nil {
						t.Fatalf("read fence row: %v", err)
					}
					if stored != current || len(next) != 0 {
						t.Fatalf("iteration %d: CheckFence(%d) passed, yet fence %d is stored and the Lock got %d fences while tx is open", i, current, stored, len(next))
					}
					if _, err := tx.ExecContext(ctx, "SELECT 1"); err != nil {
						t.Fatal(err)
					}
					if err := tx.Commit(); err != nil {
						t.Fatal(err)
					}
				case errors.Is(err, pgcoord.ErrStaleFence):
					outcomes["stale"]++
					_ = tx.Rollback()
				case level == sql.LevelRepeatableRead && sqlStateOf(err) == "40001":
					outcomes["40001"]++
					_ = tx.Rollback()
				default:
					t.Fatalf("iteration %d: CheckFence: %v", i, err)
				}
				if err := r.get(t); err != nil {
					t.Fatalf("fenced Lock: %v", err)
				}
				f := <-next
				if f <= current {
					t.Fatalf("fence %d after %d", f, current)
				}
				current = f
			}
			t.Logf("outcomes: %v", outcomes)
			idle(t, db)
		})
	}
}

// TestInTxOptionsSerializable: a serialization failure in fn rolls back,
// releases the keys, and InTxOptions returns fn's error unchanged; a
// read-only serializable transaction takes the keys.
func TestInTxOptionsSerializable(t *testing.T) {
	ctx := t.Context()
	dsn, db := inTxDB(t)
	if _, err := db.ExecContext(ctx, "INSERT INTO t VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	keys := []pgcoord.Key{pgcoord.Int64Key(2), pgcoord.Int64Key(1)}
	var pid int32
	var fnErr error
	err := pgcoordsql.InTxOptions(ctx, db, &sql.TxOptions{Isolation: sql.LevelSerializable}, keys, func(tx *sql.Tx) error {
		pid = txPid(t, tx)
		waitLocks(t, dsn, pid, want("ExclusiveLock", "granted", keys...))
		if _, err := db.ExecContext(ctx, "UPDATE t SET v = v + 1"); err != nil { // another connection
			return err
		}
		_, fnErr = tx.ExecContext(ctx, "UPDATE t SET v = v + 10")
		return fnErr
	})
	if sqlStateOf(fnErr) != "40001" || err != fnErr {
		t.Fatalf("fn's update: %v; InTxOptions: %v; want a serialization failure returned unchanged", fnErr, err)
	}
	waitLocks(t, dsn, pid, nil)
	if got := rows(t, db); !slices.Equal(got, []int{2}) {
		t.Fatalf("rows %v, want [2]", got)
	}
	idle(t, db)

	err = pgcoordsql.InTxOptions(ctx, db, &sql.TxOptions{Isolation: sql.LevelSerializable, ReadOnly: true}, keys, func(tx *sql.Tx) error {
		pid = txPid(t, tx)
		waitLocks(t, dsn, pid, want("ExclusiveLock", "granted", keys...))
		return pgcoordsql.XactTryRLock(ctx, tx, pgcoord.Int64Key(3))
	})
	if err != nil {
		t.Fatal(err)
	}
	waitLocks(t, dsn, pid, nil)
	idle(t, db)
}

// TestInTxSingleConnection: on a *sql.DB with MaxOpenConns = 1, InTx does
// not wait on itself: fn may use tx for more locks and a fence check, a
// cancelled wait, an error and a panic each give the one connection back,
// and concurrent callers all get through.
func TestInTxSingleConnection(t *testing.T) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	c := fenceClient(t, dsn)
	fence := fencedLock(t, c, pgcoord.Int64Key(10))
	db := openDB(t, dsn)
	db.SetMaxOpenConns(1)
	other := openDB(t, dsn)
	k1, k2 := pgcoord.Int64Key(1), pgcoord.Int64Key(2)

	if err := pgcoordsql.InTx(ctx, db, []pgcoord.Key{k1}, func(tx *sql.Tx) error {
		if err := pgcoordsql.XactTryLock(ctx, tx, k2); err != nil {
			return err
		}
		return pgcoordsql.CheckFence(ctx, tx, pgcoord.Int64Key(10), fence)
	}); err != nil {
		t.Fatal(err)
	}

	holder, holderPid := begin(t, other)
	if err := pgcoordsql.XactLock(ctx, holder, k2); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	r := async(func() error {
		return pgcoordsql.InTx(cctx, db, []pgcoord.Key{k1, k2}, func(*sql.Tx) error { return nil })
	})
	pgtest.Eventually(t, waitLimit, "InTx to wait", func() bool { return anyWaiting(t, dsn, holderPid) })
	cancel()
	if err := r.get(t); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled InTx: %v", err)
	}
	noLocksBut(t, dsn, holderPid)
	if err := holder.Rollback(); err != nil {
		t.Fatal(err)
	}

	boom := errors.New("boom")
	if err := pgcoordsql.InTx(ctx, db, []pgcoord.Key{k1}, func(*sql.Tx) error { return boom }); err != boom {
		t.Fatalf("fn's error: got %v", err)
	}
	func() {
		defer func() { _ = recover() }()
		_ = pgcoordsql.InTx(ctx, db, []pgcoord.Key{k1}, func(tx *sql.Tx) error {
			rs, err := tx.QueryContext(ctx, "SELECT generate_series(1, 10000)") // left open
			if err != nil {
				return err
			}
			_ = rs
			panic("with open rows")
		})
	}()

	var wg sync.WaitGroup
	errs := make(chan error, 40)
	for g := range 4 {
		wg.Go(func() {
			for i := range 10 {
				cctx, cancel := context.WithTimeout(ctx, waitLimit)
				keys := []pgcoord.Key{k1, k2}
				if (g+i)%2 == 0 {
					keys = []pgcoord.Key{k2, k1}
				}
				err := pgcoordsql.InTx(cctx, db, keys, func(tx *sql.Tx) error {
					_, err := tx.ExecContext(cctx, "SELECT 1")
					return err
				})
				cancel()
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("concurrent InTx on one connection: %v", err)
	}
	noLocksBut(t, dsn)
	idle(t, db)
	if n := db.Stats().OpenConnections; n > 1 {
		t.Fatalf("%d connections open with MaxOpenConns 1", n)
	}
}

// TestInTxCtxEndsDuringFn: the ctx given to InTx ending while fn runs
// rolls the transaction back then (the keys are free before fn returns),
// and InTx returns the context's error.
func TestInTxCtxEndsDuringFn(t *testing.T) {
	ctx := t.Context()
	dsn, db := inTxDB(t)
	k := pgcoord.Int64Key(5)
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var pid int32
	err := pgcoordsql.InTx(cctx, db, []pgcoord.Key{k}, func(tx *sql.Tx) error {
		pid = txPid(t, tx)
		if _, err := tx.ExecContext(cctx, "INSERT INTO t VALUES (1)"); err != nil {
			return err
		}
		waitLocks(t, dsn, pid, want("ExclusiveLock", "granted", k))
		cancel()
		waitLocks(t, dsn, pid, nil) // released while fn still runs
		return nil
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want context.Canceled", err)
	}
	if got := rows(t, db); len(got) != 0 {
		t.Fatalf("rows %v: fn's work was committed", got)
	}
	idle(t, db)
}
