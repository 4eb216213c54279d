package pqtest

import (
	"database/sql"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/pgcoordsql"
)

// tripProxy forwards TCP connections to a PostgreSQL server and records the
// client's round trips: each Sync or simple Query message ends one.
type tripProxy struct {
	ln     net.Listener
	target string
	wg     sync.WaitGroup

	mu    sync.Mutex
	trips []string
	cur   []string
	conns []net.Conn
}

// newTripProxy starts a proxy to target (host:port), stopped in t.Cleanup.
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

var msgNames = map[byte]string{'P': "Parse", 'B': "Bind", 'E': "Execute", 'D': "Describe", 'S': "Sync", 'C': "Close"}

func (p *tripProxy) record(typ byte, body []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	name, ok := msgNames[typ]
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
func (p *tripProxy) take() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := p.trips
	p.trips = nil
	return out
}

// TestInTxRoundTrips: through lib/pq, InTx with an fn that sends nothing
// makes the round trips the package documentation gives, counted at the
// protocol level: 4 on every call by default (BEGIN ISOLATION LEVEL READ
// COMMITTED, Parse-Describe of the unnamed statement, Bind-Execute,
// COMMIT), and 3 with binary_parameters=yes (the statement in one
// exchange).
func TestInTxRoundTrips(t *testing.T) {
	begin := "Query(BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE)"
	for _, c := range []struct {
		name, params string
		want         []string
	}{
		{"default", "", []string{begin, "Parse Describe Sync", "Bind Execute Sync", "Query(COMMIT)"}},
		{"binary_parameters", "binary_parameters=yes", []string{begin, "Parse Bind Describe Execute Sync", "Query(COMMIT)"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := t.Context()
			dsn, _ := setup(t)
			u, err := url.Parse(dsn)
			if err != nil || u.Host == "" {
				t.Fatalf("this test needs a URL connection string, got %q (%v)", dsn, err)
			}
			p := newTripProxy(t, u.Host)
			u.Host = p.ln.Addr().String()
			if c.params != "" {
				q := u.Query()
				k, v, _ := strings.Cut(c.params, "=")
				q.Set(k, v)
				u.RawQuery = q.Encode()
			}
			db, err := sql.Open("postgres", u.String())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			db.SetMaxOpenConns(1)
			if err := db.PingContext(ctx); err != nil {
				t.Fatal(err)
			}
			p.take()
			var report []string
			failed := false
			for _, n := range []int{2, 2, 3, 1} {
				keys := make([]pgcoord.Key, n)
				for i := range keys {
					keys[i] = pgcoord.Int64Key(int64(i))
				}
				if err := pgcoordsql.InTx(ctx, db, keys, func(*sql.Tx) error { return nil }); err != nil {
					t.Fatal(err)
				}
				got := p.take()
				report = append(report, fmt.Sprintf("InTx with %d key(s): %q", n, got))
				failed = failed || strings.Join(got, "|") != strings.Join(c.want, "|")
			}
			if failed {
				t.Fatalf("round trips, want %q each time:\n%s", c.want, strings.Join(report, "\n"))
			}
		})
	}
}
