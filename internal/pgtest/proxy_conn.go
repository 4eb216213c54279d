package pgtest

import (
	"net"
	"net/url"
	"strings"
)

// Addr returns the proxy's address, 127.0.0.1:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// ConnString returns connString with its host and port replaced by the
// proxy's, so that connections made with it go through the proxy. It
// accepts URLs and keyword/value strings.
func (p *Proxy) ConnString(connString string) (string, error) {
	host, port, _ := net.SplitHostPort(p.Addr())
	if strings.HasPrefix(connString, "postgres://") || strings.HasPrefix(connString, "postgresql://") {
		u, err := url.Parse(connString)
		if err != nil {
			return "", errorf("proxy: parse connection URL: %w", err)
		}
		u.Host = net.JoinHostPort(host, port)
		return u.String(), nil
	}
	// In a keyword/value string the last value of a keyword wins.
	return connString + " host=" + host + " port=" + port, nil
}

// Heal ends a Blackhole: it closes every connection, whose streams lost
// bytes while silent, and forwards again on the connections made after.
func (p *Proxy) Heal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.silent.Store(false)
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
}
