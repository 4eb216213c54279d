package pgcoord

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// xactTripProxy forwards TCP connections to a PostgreSQL server and
// records the client's round trips: each Sync or simple Query message ends
// one.
type xactTripProxy struct {
	ln     net.Listener
	target string
	wg     sync.WaitGroup

	mu    sync.Mutex
	trips []string
	cur   []string
	conns []net.Conn
}

// newXactTripProxy starts a proxy to the server of dsn, stopped in
// t.Cleanup.
func newXactTripProxy(t *testing.T, dsn string) *xactTripProxy {
	t.Helper()
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &xactTripProxy{ln: ln, target: net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))}
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

// route points a pool configuration at the proxy.
func (p *xactTripProxy) route(c *pgxpool.Config) {
	c.ConnConfig.Host = "127.0.0.1"
	c.ConnConfig.Port = uint16(p.ln.Addr().(*net.TCPAddr).Port)
	c.ConnConfig.Fallbacks = nil
}

func (p *xactTripProxy) accept() {
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
func (p *xactTripProxy) clientToServer(c, s net.Conn) {
	var hdr [5]byte
	// Startup-phase messages have no type byte; SSL and GSS requests
	// (codes 80877103, 80877104) are followed by another one.
	for {
		if _, err := io.ReadFull(c, hdr[:4]); err != nil {
			return
		}
		body := make([]byte, binary.BigEndian.Uint32(hdr[:4])-4)
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
		body := make([]byte, binary.BigEndian.Uint32(hdr[1:])-4)
		if _, err := io.ReadFull(c, body); err != nil {
			return
		}
		p.record(hdr[0], body)
		if _, err := s.Write(append(hdr[:5:5], body...)); err != nil {
			return
		}
	}
}

var xactTripNames = map[byte]string{'P': "Parse", 'B': "Bind", 'E': "Execute", 'D': "Describe", 'S': "Sync", 'C': "Close"}

func (p *xactTripProxy) record(typ byte, body []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	name, ok := xactTripNames[typ]
	switch {
	case typ == 'Q':
		name = "Query(" + strings.TrimRight(string(body), "\x00") + ")"
	case !ok:
		name = string(typ)
	}
	p.cur = append(p.cur, name)
	if typ == 'Q' || typ == 'S' {
		p.trips = append(p.trips, strings.Join(p.cur, " "))
		p.cur = nil
	}
}

// take returns the round trips recorded since the last call.
func (p *xactTripProxy) take() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := p.trips
	p.trips = nil
	return out
}

// TestInTxRoundTrips: in every pgx query mode, InTx with an fn that sends
// nothing makes exactly 3 round trips (BEGIN ISOLATION LEVEL READ
// COMMITTED, the lock statement in one Parse-Bind-Describe-Execute-Sync
// exchange, COMMIT), the first time a connection runs a given number of
// keys as much as after; XactTryLock makes one; nothing is left prepared on
// the server. Counted at the protocol level with a proxy.
func TestInTxRoundTrips(t *testing.T) {
	dsn := pgtest.DB(t)
	lock := "Parse Bind Describe Execute Sync"
	for _, mode := range []pgx.QueryExecMode{
		pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec,
		pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
	} {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := t.Context()
			p := newXactTripProxy(t, dsn)
			pool := pgtest.Pool(t, dsn, func(c *pgxpool.Config) {
				p.route(c)
				c.MaxConns = 1
				c.ConnConfig.DefaultQueryExecMode = mode
			})
			if err := pool.Ping(ctx); err != nil {
				t.Fatal(err)
			}
			p.take()
			var report []string
			failed := false
			for _, n := range []int{2, 2, 3, 1, 1500} {
				keys := make([]Key, n)
				for i := range keys {
					keys[i] = Int64Key(int64(i))
				}
				if err := InTx(ctx, pool, keys, func(pgx.Tx) error { return nil }); err != nil {
					t.Fatal(err)
				}
				want := []string{"Query(begin isolation level read committed)", lock, "Query(commit)"}
				if n > core.MaxKeysPerStatement {
					want = []string{want[0], lock, lock, want[2]}
				}
				got := p.take()
				report = append(report, fmt.Sprintf("InTx with %d key(s): %q", n, got))
				failed = failed || strings.Join(got, "|") != strings.Join(want, "|")
			}
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			p.take()
			if err := XactTryLock(ctx, tx, Int64Key(1), Int64Key(2)); err != nil {
				t.Fatal(err)
			}
			got := p.take()
			report = append(report, fmt.Sprintf("XactTryLock: %q", got))
			failed = failed || len(got) != 1 || got[0] != lock
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			if failed {
				t.Fatalf("round trips (want BEGIN, %q per 1000 keys, COMMIT):\n%s", lock, strings.Join(report, "\n"))
			}
			var prepared int
			if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_prepared_statements WHERE strpos(statement, 'pg_' || 'advisory') > 0").Scan(&prepared); err != nil {
				t.Fatal(err)
			}
			if prepared != 0 { // (the query above does not count itself)
				t.Fatalf("%d lock statements prepared on the server, want 0", prepared)
			}
		})
	}
}

// xactWithdrawTwice sets the database's default isolation level to
// dbDefault, then runs two transactions with run under one key that each
// withdraw 100 if the ledger's balance allows: the second waits for the
// key while the first has read the balance. Each checks that its
// transaction runs at level. It returns the final balance and the second
// run's error (the first must succeed).
func xactWithdrawTwice(t *testing.T, dbDefault, level string, run func(ctx context.Context, pool *pgxpool.Pool, dsn string, keys []Key, fn func(pgx.Tx) error) error) (int, error) {
	ctx := t.Context()
	dsn := pgtest.DB(t)
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	admin := pgtest.Conn(t, dsn)
	if _, err := admin.Exec(ctx, fmt.Sprintf("ALTER DATABASE %s SET default_transaction_isolation = '%s'",
		pgx.Identifier{cfg.Database}.Sanitize(), dbDefault)); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "CREATE TABLE ledger (amount int NOT NULL); INSERT INTO ledger VALUES (100)"); err != nil {
		t.Fatal(err)
	}
	pool := pgtest.Pool(t, dsn) // new connections get the setting
	var def string
	if err := pool.QueryRow(ctx, "SHOW default_transaction_isolation").Scan(&def); err != nil || def != dbDefault {
		t.Fatalf("default_transaction_isolation %q (%v), want %q", def, err, dbDefault)
	}
	key := HashKey("account")
	withdraw := func(tx pgx.Tx, between func()) error {
		var got string
		if err := tx.QueryRow(ctx, "SHOW transaction_isolation").Scan(&got); err != nil {
			return err
		}
		if got != level {
			t.Errorf("transaction_isolation %s, want %s", got, level)
		}
		var bal int
		if err := tx.QueryRow(ctx, "SELECT sum(amount) FROM ledger").Scan(&bal); err != nil {
			return err
		}
		between()
		if bal >= 100 {
			_, err := tx.Exec(ctx, "INSERT INTO ledger VALUES (-100)")
			return err
		}
		return nil
	}
	read := make(chan struct{})
	second := make(chan struct{})
	first := make(chan error, 1)
	go func() {
		first <- run(ctx, pool, dsn, []Key{key}, func(tx pgx.Tx) error {
			return withdraw(tx, func() {
				close(read)
				<-second
			})
		})
	}()
	select {
	case <-read:
	case err := <-first:
		t.Fatalf("first withdrawal ended before reading: %v", err)
	}
	r2 := make(chan error, 1)
	go func() {
		r2 <- run(ctx, pool, dsn, []Key{key}, func(tx pgx.Tx) error { return withdraw(tx, func() {}) })
	}()
	pgtest.Eventually(t, xactWait, "the second transaction to wait for the key", func() bool {
		for _, l := range pgtest.AdvisoryLocks(t, dsn) {
			if !l.Granted {
				return true
			}
		}
		return false
	})
	close(second)
	if err := xactRecv(t, first, "first withdrawal"); err != nil {
		t.Fatalf("first withdrawal: %v", err)
	}
	err2 := xactRecv(t, r2, "second withdrawal")
	var bal int
	if err := admin.QueryRow(ctx, "SELECT sum(amount) FROM ledger").Scan(&bal); err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, xactWait, "no advisory lock left", func() bool { return len(pgtest.AdvisoryLocks(t, dsn)) == 0 })
	return bal, err2
}

// TestInTxReadCommittedByDefault: with default_transaction_isolation =
// 'repeatable read' on the database, InTx (on a pool or a *pgx.Conn) and
// InTxOptions without an isolation level run READ COMMITTED, so two
// holders of one key that each withdraw 100 from a balance of 100 after
// checking it leave 0: the second sees the first one's withdrawal. The same
// holds under a READ COMMITTED default.
func TestInTxReadCommittedByDefault(t *testing.T) {
	runs := map[string]func(context.Context, *pgxpool.Pool, string, []Key, func(pgx.Tx) error) error{
		"InTx pool": func(ctx context.Context, pool *pgxpool.Pool, _ string, keys []Key, fn func(pgx.Tx) error) error {
			return InTx(ctx, pool, keys, fn)
		},
		"InTx conn": func(ctx context.Context, _ *pgxpool.Pool, dsn string, keys []Key, fn func(pgx.Tx) error) error {
			conn, err := pgx.Connect(ctx, dsn)
			if err != nil {
				return err
			}
			defer conn.Close(context.Background())
			return InTx(ctx, conn, keys, fn)
		},
		"InTxOptions": func(ctx context.Context, pool *pgxpool.Pool, _ string, keys []Key, fn func(pgx.Tx) error) error {
			return InTxOptions(ctx, pool, pgx.TxOptions{AccessMode: pgx.ReadWrite}, keys, fn)
		},
	}
	for _, def := range []string{"repeatable read", "read committed"} {
		for name, run := range runs {
			t.Run(def+"/"+name, func(t *testing.T) {
				balance, err := xactWithdrawTwice(t, def, "read committed", run)
				if err != nil || balance != 0 {
					t.Fatalf("second withdrawal: %v; balance %d, want nil and 0", err, balance)
				}
			})
		}
	}
}

// TestInTxOptionsSnapshotBeforeGrant: an explicit REPEATABLE READ or
// SERIALIZABLE is honoured, with the documented effect of a snapshot taken
// before the key is granted: under REPEATABLE READ the second holder reads
// the balance from before the first one's withdrawal and withdraws too
// (balance -100, no error); under SERIALIZABLE it fails with SQLSTATE 40001
// and the balance stays 0.
func TestInTxOptionsSnapshotBeforeGrant(t *testing.T) {
	for _, c := range []struct {
		level       pgx.TxIsoLevel
		name        string
		wantBalance int
		wantState   string
	}{
		{pgx.RepeatableRead, "repeatable read", -100, ""},
		{pgx.Serializable, "serializable", 0, "40001"},
	} {
		t.Run(c.name, func(t *testing.T) {
			balance, err := xactWithdrawTwice(t, "read committed", c.name, func(ctx context.Context, pool *pgxpool.Pool, _ string, keys []Key, fn func(pgx.Tx) error) error {
				return InTxOptions(ctx, pool, pgx.TxOptions{IsoLevel: c.level}, keys, fn)
			})
			var pe *pgconn.PgError
			state := ""
			if errors.As(err, &pe) {
				state = pe.Code
			}
			if state != c.wantState || (c.wantState == "") != (err == nil) || balance != c.wantBalance {
				t.Fatalf("second withdrawal: %v; balance %d; want SQLSTATE %q and balance %d", err, balance, c.wantState, c.wantBalance)
			}
		})
	}
}
