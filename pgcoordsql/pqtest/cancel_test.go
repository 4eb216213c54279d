package pqtest

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" driver
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"github.com/pgcoord/pgcoord/pgcoordsql"
)

// drivers are the database/sql drivers the cancellation tests run on.
var drivers = []string{"postgres", "pgx"}

// holdProxy forwards TCP connections to a PostgreSQL server. Armed with a
// marker, it holds back the server's answers from the moment the client
// executes the statement whose text contains the marker, until release:
// the statement runs to completion on the server while the client still
// waits for it. It also signals each cancel request it forwards.
type holdProxy struct {
	ln      net.Listener
	target  string
	wg      sync.WaitGroup
	cancels chan struct{} // one value per cancel request, while room

	mu     sync.Mutex
	cond   *sync.Cond
	marker []byte // armed while not nil
	seen   bool   // the marker's statement was sent; hold at its Execute
	held   bool
	conns  []net.Conn
}

// newHoldProxy starts a proxy to the server of dsn (a URL) and returns it
// with dsn rewritten to go through it; it is stopped in t.Cleanup.
func newHoldProxy(t *testing.T, dsn string) (*holdProxy, string) {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil || u.Host == "" {
		t.Fatalf("this test needs a URL connection string, got %q (%v)", dsn, err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &holdProxy{ln: ln, target: u.Host, cancels: make(chan struct{}, 16)}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Go(p.accept)
	t.Cleanup(func() {
		p.release()
		ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	u.Host = ln.Addr().String()
	return p, u.String()
}

// arm makes the proxy hold the server's answers once the client executes a
// statement whose text contains marker.
func (p *holdProxy) arm(marker string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.marker, p.seen = []byte(marker), false
}

// release lets the held answers through and disarms the proxy.
func (p *holdProxy) release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.marker, p.seen, p.held = nil, false, false
	p.cond.Broadcast()
}

func (p *holdProxy) accept() {
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
		p.wg.Go(func() { p.serverToClient(s, c); c.Close() })
		p.wg.Go(func() { p.clientToServer(c, s); s.Close() })
	}
}

// serverToClient forwards the server's bytes, waiting while answers are
// held.
func (p *holdProxy) serverToClient(s, c net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := s.Read(buf)
		if n > 0 {
			p.mu.Lock()
			for p.held {
				p.cond.Wait()
			}
			p.mu.Unlock()
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// clientToServer forwards the client's messages, watching for the marker
// and for cancel requests.
func (p *holdProxy) clientToServer(c, s net.Conn) {
	var hdr [5]byte
	// Startup-phase messages have no type byte; SSL and GSS requests
	// (codes 80877103, 80877104) are followed by another one. A cancel
	// request (80877102) is the only message of its connection.
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
		code := binary.BigEndian.Uint32(body[:4])
		if code == 80877102 {
			select {
			case p.cancels <- struct{}{}:
			default:
			}
			return
		}
		if code != 80877103 && code != 80877104 {
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
		p.mu.Lock()
		if p.marker != nil {
			switch typ := hdr[0]; {
			case (typ == 'P' || typ == 'Q') && bytes.Contains(body, p.marker):
				p.seen = true
				p.held = typ == 'Q'
			case typ == 'E' && p.seen:
				p.held = true
			}
		}
		p.mu.Unlock()
		if _, err := s.Write(append(hdr[:5:5], body...)); err != nil {
			return
		}
	}
}

// idleAfter waits until a backend other than the observer's is idle in a
// transaction after running a statement whose text contains marker, and
// returns its pid: the statement completed on the server.
func idleAfter(t *testing.T, observer *sql.DB, marker string) int32 {
	t.Helper()
	var pid int32
	pgtest.Eventually(t, limit, fmt.Sprintf("a backend idle in transaction after %q", marker), func() bool {
		err := observer.QueryRow(`SELECT pid FROM pg_stat_activity
			WHERE pid <> pg_backend_pid() AND state = 'idle in transaction' AND strpos(query, $1) > 0`, marker).Scan(&pid)
		if errors.Is(err, sql.ErrNoRows) {
			return false
		}
		if err != nil {
			t.Fatal(err)
		}
		return true
	})
	return pid
}

// TestCallEndedByCtxAfterStatementSucceeded: when ctx ends while a call's
// statement has already succeeded on the server but its answer has not
// reached the driver, every pgcoordsql call, on lib/pq and on pgx's stdlib,
// returns an error wrapping ctx's, never nil, and InTx does not call fn:
// lib/pq then closes the connection (after a cancel request that comes too
// late), and the transaction's keys and row locks go with the backend, as
// pg_locks shows. A proxy holds the statement's answer back until the
// driver has reacted to ctx (lib/pq: its cancel request reached the
// proxy; pgx's stdlib: the call returned).
func TestCallEndedByCtxAfterStatementSucceeded(t *testing.T) {
	key := pgcoord.HashKey("ended-by-ctx")
	type call struct {
		name, marker string
		run          func(ctx context.Context, db *sql.DB, tx *sql.Tx, fence pgcoord.Term) error
	}
	calls := []call{
		{"XactLock", "SELECT pg_advisory_xact_lock(", func(ctx context.Context, _ *sql.DB, tx *sql.Tx, _ pgcoord.Term) error {
			return pgcoordsql.XactLock(ctx, tx, key)
		}},
		{"XactRLock", "pg_advisory_xact_lock_shared(", func(ctx context.Context, _ *sql.DB, tx *sql.Tx, _ pgcoord.Term) error {
			return pgcoordsql.XactRLock(ctx, tx, key)
		}},
		{"XactTryLock", "pg_try_advisory_xact_lock(", func(ctx context.Context, _ *sql.DB, tx *sql.Tx, _ pgcoord.Term) error {
			return pgcoordsql.XactTryLock(ctx, tx, key)
		}},
		{"XactTryRLock", "pg_try_advisory_xact_lock_shared(", func(ctx context.Context, _ *sql.DB, tx *sql.Tx, _ pgcoord.Term) error {
			return pgcoordsql.XactTryRLock(ctx, tx, key)
		}},
		{"CheckFence", "FOR SHARE", func(ctx context.Context, _ *sql.DB, tx *sql.Tx, fence pgcoord.Term) error {
			return pgcoordsql.CheckFence(ctx, tx, key, fence)
		}},
		{"InTx", "SELECT pg_advisory_xact_lock(", func(ctx context.Context, db *sql.DB, _ *sql.Tx, _ pgcoord.Term) error {
			return pgcoordsql.InTx(ctx, db, []pgcoord.Key{key}, func(*sql.Tx) error {
				return errors.New("fn was called")
			})
		}},
	}
	for _, driver := range drivers {
		t.Run(driver, func(t *testing.T) {
			ctx := t.Context()
			dsn, observer := setup(t)
			fence := issueFence(t, dsn, key)
			p, proxied := newHoldProxy(t, dsn)
			db, err := sql.Open(driver, proxied)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			for _, c := range calls {
				t.Run(c.name, func(t *testing.T) {
					var tx *sql.Tx
					if c.name != "InTx" {
						tx, _ = begin(t, db)
					}
					cctx, cancel := context.WithCancel(ctx)
					defer cancel()
					p.arm(c.marker)
					r := async(func() error { return c.run(cctx, db, tx, fence) })
					pid := idleAfter(t, observer, c.marker)
					if c.name != "CheckFence" {
						waitLocks(t, dsn, pid, fmt.Sprintf("%v %s true", key, map[bool]string{true: "ShareLock", false: "ExclusiveLock"}[c.name == "XactRLock" || c.name == "XactTryRLock"]))
					}
					cancel()
					select {
					case <-p.cancels: // lib/pq has marked the connection bad
					case err := <-r: // pgx's stdlib returns at once
						r <- err
					case <-time.After(limit):
						t.Fatal("the driver neither sent a cancel request nor returned")
					}
					p.release()
					err := get(t, r)
					if !errors.Is(err, context.Canceled) {
						t.Errorf("%s whose statement succeeded as ctx ended: got %v, want an error wrapping context.Canceled; backend %d holds %q", c.name, err, pid, locks(t, dsn, pid))
					}
					t.Logf("%s: %v", c.name, err)
					if tx != nil {
						_ = tx.Rollback()
					}
					// The transaction is over, whichever way: nothing is
					// left in pg_locks, and no connection is in use.
					waitLocks(t, dsn, pid)
					pgtest.Eventually(t, limit, "no connection in use", func() bool { return db.Stats().InUse == 0 })
					for len(p.cancels) > 0 {
						<-p.cancels
					}
				})
			}
		})
	}
}

// issueFence migrates dsn's database and issues a fence for key through a
// Client's fenced lock, which it releases; it returns the fence.
func issueFence(t *testing.T, dsn string, key pgcoord.Key) pgcoord.Term {
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
	l, err := c.Lock(ctx, key, pgcoord.WithFence())
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	return l.Fence()
}

// TestXactLockCancelRaceKeepsPromise: a waiter's ctx is cancelled as the
// holder releases the key, 100 times on each driver. Whenever XactLock
// returns nil, the waiter's backend holds the key (pg_locks), another
// transaction cannot take it, and the waiter's Commit succeeds; otherwise
// the error wraps context.Canceled and the key is released. The outcomes
// are logged.
func TestXactLockCancelRaceKeepsPromise(t *testing.T) {
	const iterations = 100
	key := pgcoord.Int64Key(1)
	for _, driver := range drivers {
		t.Run(driver, func(t *testing.T) {
			ctx := t.Context()
			dsn := pgtest.DB(t)
			db, err := sql.Open(driver, dsn)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			outcomes := map[string]int{}
			for i := range iterations {
				holder, _ := begin(t, db)
				if err := pgcoordsql.XactLock(ctx, holder, key); err != nil {
					t.Fatal(err)
				}
				tx, pid := begin(t, db)
				cctx, cancel := context.WithCancel(ctx)
				r := async(func() error { return pgcoordsql.XactLock(cctx, tx, key) })
				waitLocks(t, dsn, pid, key.String()+" ExclusiveLock false")
				if err := holder.Rollback(); err != nil {
					t.Fatal(err)
				}
				cancel()
				err := get(t, r)
				switch {
				case err == nil:
					outcomes["granted"]++
					if got := locks(t, dsn, pid); len(got) != 1 || got[0] != key.String()+" ExclusiveLock true" {
						t.Fatalf("iteration %d: XactLock returned nil, but backend %d holds %q", i, pid, got)
					}
					other, _ := begin(t, db)
					if err := pgcoordsql.XactTryLock(ctx, other, key); !errors.Is(err, pgcoord.ErrLocked) {
						t.Fatalf("iteration %d: XactLock returned nil, but another transaction's XactTryLock got %v", i, err)
					}
					_ = other.Rollback()
					if err := tx.Commit(); err != nil {
						t.Fatalf("iteration %d: XactLock returned nil, then Commit: %v", i, err)
					}
				case errors.Is(err, context.Canceled):
					outcomes["cancelled"]++
					_ = tx.Rollback()
				default:
					t.Fatalf("iteration %d: got %v, want nil or an error wrapping context.Canceled", i, err)
				}
				waitLocks(t, dsn, pid)
				pgtest.Eventually(t, limit, "no connection in use", func() bool { return db.Stats().InUse == 0 })
			}
			t.Logf("%s, %d iterations: %v", driver, iterations, outcomes)
		})
	}
}
