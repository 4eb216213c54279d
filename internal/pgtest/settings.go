package pgtest

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// ServerOption configures a private server made by NewServer.
type ServerOption interface {
	apply(*serverConfig) error
}

// serverConfig is what the options of NewServer ask for.
type serverConfig struct {
	settings map[string]string // lower-case name -> value
}

// setting is one postmaster setting, given as -c name=value.
type setting struct{ name, value string }

type serverOptionFunc func(*serverConfig) error

func (f serverOptionFunc) apply(c *serverConfig) error { return f(c) }

// pgtestSettings are the settings pgtest chooses for every server, on the
// command line or in postgresql.conf, so that its connection strings and
// directories work; WithSetting refuses them.
var pgtestSettings = []string{
	"port", "listen_addresses", "unix_socket_directories",
	"data_directory", "config_file", "hba_file", "ident_file",
}

// WithSetting returns an option that starts the server with the
// configuration parameter name set to value, as postgres -c name=value
// does, on every start: Restart, Crash and Start keep it, and a standby made
// by StartStandby inherits it (a hot standby needs max_connections,
// max_locks_per_transaction and the like at least as high as its primary's).
// A value on the command line overrides postgresql.conf and ALTER SYSTEM.
//
// NewServer fails when name is not a parameter name, is given twice, or is
// one pgtest sets itself (port, listen_addresses, unix_socket_directories,
// data_directory, config_file, hba_file, ident_file), and when
// max_connections would not leave a slot for the tests: see Server for how
// many connections pgtest itself keeps. PostgreSQL checks the names and
// values when the server starts; a value it rejects makes NewServer fail
// with the server log.
func WithSetting(name, value string) ServerOption {
	return serverOptionFunc(func(c *serverConfig) error {
		key := strings.ToLower(name)
		if !isParamName(key) {
			return errorf("WithSetting(%q, %q): not a configuration parameter name", name, value)
		}
		if slices.Contains(pgtestSettings, key) {
			return errorf("WithSetting(%q, %q): pgtest sets %s itself", name, value, key)
		}
		if old, ok := c.settings[key]; ok {
			return errorf("WithSetting(%q, %q): %s is already set to %q", name, value, key, old)
		}
		c.settings[key] = value
		return nil
	})
}

// isParamName reports whether name looks like a configuration parameter:
// an identifier, or two joined by a dot for a custom (extension) parameter.
func isParamName(name string) bool {
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return false
	}
	for _, p := range parts {
		if p == "" || p[0] >= '0' && p[0] <= '9' {
			return false
		}
		for _, r := range p {
			if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_') {
				return false
			}
		}
	}
	return true
}

// newServerConfig applies opts and checks the result.
func newServerConfig(opts []ServerOption) (serverConfig, error) {
	c := serverConfig{settings: map[string]string{}}
	for _, o := range opts {
		if o == nil {
			return c, errorf("NewServer: nil option")
		}
		if err := o.apply(&c); err != nil {
			return c, err
		}
	}
	return c, c.checkConnections()
}

// checkConnections refuses a max_connections that leaves the tests no slot,
// or that PostgreSQL would refuse next to superuser_reserved_connections.
func (c serverConfig) checkConnections() error {
	maxConns, ok := c.intSetting("max_connections")
	if !ok {
		return nil
	}
	if maxConns <= adminSlots {
		return errorf("max_connections=%d leaves no slot for the test: pgtest keeps %d connection to the server; ask for %d more than the test needs", maxConns, adminSlots, adminSlots)
	}
	reserved, set := c.intSetting("superuser_reserved_connections")
	if !set {
		reserved = 3 // PostgreSQL's default
	}
	if reserved >= maxConns {
		how := "PostgreSQL's default"
		if set {
			how = "as set"
		}
		return errorf("max_connections=%d must exceed superuser_reserved_connections (%d, %s); set superuser_reserved_connections lower with WithSetting", maxConns, reserved, how)
	}
	return nil
}

// intSetting returns a setting that is a plain integer.
func (c serverConfig) intSetting(name string) (int, bool) {
	v, ok := c.settings[name]
	if !ok {
		return 0, false
	}
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil {
		return 0, false // PostgreSQL reports it when the server starts
	}
	return n, true
}

// list returns the settings sorted by name.
func (c serverConfig) list() []setting {
	var l []setting
	for name, value := range c.settings {
		l = append(l, setting{name, value})
	}
	slices.SortFunc(l, func(a, b setting) int { return strings.Compare(a.name, b.name) })
	return l
}

// args returns settings as postgres command-line arguments.
func args(settings []setting) []string {
	var a []string
	for _, s := range settings {
		a = append(a, "-c", fmt.Sprintf("%s=%s", s.name, s.value))
	}
	return a
}
