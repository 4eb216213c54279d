package pgcoordtest

import (
	"sync"
	"sync/atomic"
	"testing"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// Proxy is a TCP proxy on 127.0.0.1 in front of a test database that can
// drop the network: connect through [Proxy.ConnString], then call
// [Proxy.Blackhole] to make every connection go silent, as a network
// partition looks to both sides (the kernels still acknowledge, so only
// application-level checks, such as a pgcoord Client's heartbeat and loss
// deadline, notice). A Client on a blackholed proxy declares its locks
// lost within its loss deadline ([pgcoord.WithLossDeadline]); the server
// frees them later, when its own liveness settings give up on the silent
// connection. Methods are safe for concurrent use.
type Proxy struct {
	p          *pgtest.Proxy
	connString string
	target     string      // the connection string given to NewProxy
	blackholed atomic.Bool // between Blackhole and Heal
	dropped    atomic.Bool // Blackhole, Cut or Heal has been called
}

// proxies maps the ConnString of every running Proxy to it, so that the
// cleanup of a Client made on it knows whether the test dropped its
// network.
var proxies sync.Map // string -> *Proxy

// droppedProxy reports whether connString is the ConnString of a running
// Proxy whose connections the test has blackholed, cut or healed: the
// Client on it may not have noticed yet that they were closed, or it may
// be unable to reach the server at all.
func droppedProxy(connString string) bool {
	p, ok := proxies.Load(connString)
	return ok && p.(*Proxy).dropped.Load()
}

// direct returns connString, or when it is the ConnString of a running
// Proxy, the connection string of the server behind it (behind every
// Proxy, for proxies in front of proxies).
func direct(connString string) string {
	for range 10 {
		p, ok := proxies.Load(connString)
		if !ok {
			break
		}
		connString = p.(*Proxy).target
	}
	return connString
}

// NewProxy starts a proxy to the server of connString and stops it,
// closing every connection, in t.Cleanup. It fails t when connString does
// not parse or no port is free. A test may end with its proxy blackholed,
// or right after [Proxy.Cut] or [Proxy.Heal] closed its connections: once
// any of the three has been called, the cleanup of a [Client] made on its
// ConnString logs, instead of reporting as an error, that the Client's
// close could not confirm its releases.
func NewProxy(t testing.TB, connString string) *Proxy {
	t.Helper()
	p := pgtest.NewProxy(t, connString)
	via, err := p.ConnString(connString)
	if err != nil {
		t.Fatalf("pgcoordtest: NewProxy: %v", err)
	}
	px := &Proxy{p: p, connString: via, target: connString}
	proxies.Store(via, px)
	// Cleanups run last in, first out: this one runs after those of the
	// Clients made on the proxy, which look it up, and before the proxy
	// stops.
	t.Cleanup(func() { proxies.Delete(via) })
	return px
}

// ConnString returns the connection string given to NewProxy with its host
// and port replaced by the proxy's.
func (p *Proxy) ConnString() string { return p.connString }

// Blackhole stops forwarding on every connection, present and future,
// keeping them open on both sides.
func (p *Proxy) Blackhole() {
	p.dropped.Store(true)
	p.blackholed.Store(true)
	p.p.Blackhole()
}

// Cut closes every connection on both sides, as a partition that ends
// with both sides giving up does; new connections go through as before
// (unless the proxy is blackholed).
func (p *Proxy) Cut() {
	p.dropped.Store(true)
	p.p.CloseAll()
}

// Heal ends a Blackhole: it closes every connection (their streams lost
// bytes while silent) and forwards again on new ones, as when the network
// comes back and the clients reconnect.
func (p *Proxy) Heal() {
	p.dropped.Store(true)
	p.p.Heal()
	p.blackholed.Store(false)
}
