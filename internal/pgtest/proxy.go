package pgtest

import (
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Proxy is a TCP proxy on 127.0.0.1 in front of a test database that can
// go silent: after Blackhole it keeps every connection open on both sides
// but forwards nothing, as a network partition looks to each side's
// application. (Both sides' kernels still acknowledge each other, so
// TCP-level timeouts do not fire; only application-level checks notice.)
type Proxy struct {
	ln     net.Listener
	target string
	silent atomic.Bool
	wg     sync.WaitGroup
	// accepted counts the connections the proxy has accepted, including
	// those it closed at once because the server could not be reached.
	accepted atomic.Int64

	mu      sync.Mutex
	conns   []net.Conn
	stopped bool // close has begun: a connection accepted now is closed at once
}

// NewProxy starts a proxy to the server of connString and stops it, closing
// every connection, in t.Cleanup.
func NewProxy(t testing.TB, connString string) *Proxy {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		t.Fatal(errorf("proxy: parse %q: %w", connString, err))
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(errorf("proxy: listen: %w", err))
	}
	p := &Proxy{ln: ln, target: net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port)))}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

// Route points a pool configuration at the proxy; pass it to Pool.
func (p *Proxy) Route(cfg *pgxpool.Config) {
	addr := p.ln.Addr().(*net.TCPAddr)
	cfg.ConnConfig.Host = addr.IP.String()
	cfg.ConnConfig.Port = uint16(addr.Port)
	cfg.ConnConfig.Fallbacks = nil
}

// Accepted returns how many connections the proxy has accepted so far,
// including those it closed at once because the server was down: each is
// one attempt of a client to connect.
func (p *Proxy) Accepted() int64 { return p.accepted.Load() }

// Blackhole stops forwarding on every connection, present and future.
func (p *Proxy) Blackhole() { p.silent.Store(true) }

// CloseAll closes every connection on both sides, as a partition that ends
// with both sides giving up does.
func (p *Proxy) CloseAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
}

func (p *Proxy) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	p.stopped = true
	p.mu.Unlock()
	p.CloseAll()
	p.wg.Wait()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = client.Close()
			p.accepted.Add(1)
			continue
		}
		p.accepted.Add(1)
		p.mu.Lock()
		if p.stopped {
			// Accepted just before the listener closed, and dialled
			// after CloseAll ran: nothing would close it, and a silent
			// proxy would keep close waiting on its pipes.
			p.mu.Unlock()
			_ = client.Close()
			_ = server.Close()
			continue
		}
		p.conns = append(p.conns, client, server)
		p.mu.Unlock()
		p.wg.Add(2)
		go p.pipe(server, client)
		go p.pipe(client, server)
	}
}

// pipe copies from src to dst until either closes, dropping what it reads
// while the proxy is silent.
func (p *Proxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.silent.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			// A close is passed on, unless the network is "down".
			if !p.silent.Load() {
				_ = dst.Close()
			}
			return
		}
	}
}
