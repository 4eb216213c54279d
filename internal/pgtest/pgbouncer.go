package pgtest

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Pool modes of PgBouncer, for NewPgBouncer.
const (
	SessionPooling     = "session"     // a client keeps one server connection until it disconnects
	TransactionPooling = "transaction" // a client holds a server connection for one transaction
	StatementPooling   = "statement"   // a client holds a server connection for one statement
)

// defaultPoolSize is the pool size of NewPgBouncer without WithPoolSize.
const defaultPoolSize = 4

// PgBouncer is a PgBouncer process in front of a test database, started by
// NewPgBouncer.
type PgBouncer struct {
	root    string // pgtest directory: pgbouncer.ini, userlist.txt, log
	logPath string
	port    int
	user    string // the user of the upstream connection string
	pass    string
	dbname  string
	mode    string
	proc    *child
}

// PgBouncerOption configures a PgBouncer made by NewPgBouncer.
type PgBouncerOption interface {
	applyBouncer(*bouncerConfig) error
}

type bouncerConfig struct {
	poolSize int               // 0: not given
	settings map[string]string // pgbouncer.ini [pgbouncer] section
}

type bouncerOptionFunc func(*bouncerConfig) error

func (f bouncerOptionFunc) applyBouncer(c *bouncerConfig) error { return f(c) }

// WithPoolSize returns an option that sets default_pool_size, the number
// of server connections PgBouncer opens at most for the database (and
// user); clients beyond that wait for one to come free. Without it the
// pool size is 4. NewPgBouncer fails when n is not positive or is given
// twice.
func WithPoolSize(n int) PgBouncerOption {
	return bouncerOptionFunc(func(c *bouncerConfig) error {
		if n < 1 {
			return errorf("WithPoolSize(%d): the pool size must be positive", n)
		}
		if c.poolSize != 0 {
			return errorf("WithPoolSize(%d): the pool size is already %d", n, c.poolSize)
		}
		c.poolSize = n
		return nil
	})
}

// bouncerSettings are the pgbouncer.ini settings NewPgBouncer chooses
// itself, so that the process, its files and its connection strings work;
// WithPgBouncerSetting refuses them.
var bouncerSettings = []string{
	"listen_addr", "listen_port", "unix_socket_dir", "auth_type", "auth_file",
	"auth_hba_file", "auth_query", "auth_user", "admin_users", "stats_users",
	"pool_mode", "default_pool_size", "logfile", "pidfile", "syslog", "user",
	"ignore_startup_parameters", "server_tls_sslmode",
}

// WithPgBouncerSetting returns an option that writes name = value into the
// [pgbouncer] section of pgbouncer.ini, for example server_idle_timeout or
// query_wait_timeout. NewPgBouncer fails when name is not a setting name,
// is given twice, or is one it sets itself (pool_mode and default_pool_size
// among them: use the mode argument and WithPoolSize), and when value spans
// lines. PgBouncer checks the names and values when it starts; one it
// rejects makes NewPgBouncer fail with its log.
func WithPgBouncerSetting(name, value string) PgBouncerOption {
	return bouncerOptionFunc(func(c *bouncerConfig) error {
		key := strings.ToLower(name)
		if key == "" || strings.Trim(key, "abcdefghijklmnopqrstuvwxyz_") != "" {
			return errorf("WithPgBouncerSetting(%q, %q): not a setting name", name, value)
		}
		if slices.Contains(bouncerSettings, key) {
			return errorf("WithPgBouncerSetting(%q, %q): pgtest sets %s itself", name, value, key)
		}
		if strings.ContainsAny(value, "\r\n") {
			return errorf("WithPgBouncerSetting(%q, %q): the value spans lines", name, value)
		}
		if old, ok := c.settings[key]; ok {
			return errorf("WithPgBouncerSetting(%q, %q): %s is already set to %q", name, value, key, old)
		}
		c.settings[key] = value
		return nil
	})
}

// NewPgBouncer starts a PgBouncer in front of the server of connString, in
// pool mode mode (SessionPooling, TransactionPooling or StatementPooling),
// and stops it in t.Cleanup, removing its files. It returns once PgBouncer
// accepts connections; ConnString gives the connection string of the
// database of connString through it.
//
// PgBouncer listens on 127.0.0.1 on a free port, lets in without a
// password clients that log in as the user of connString (the only user it
// knows), and logs in to the server as that user, with its password if any,
// with at most WithPoolSize server connections (4 by default), which count
// against the server's max_connections while open. It forwards every
// database name to the same name on the server. It runs as a child of the
// test binary with a parent-death signal, as OS user postgres
// (PGTEST_OS_USER) when the tests run as root, as PgBouncer refuses to run
// as root. The binary is PGTEST_PGBOUNCER, else /usr/sbin/pgbouncer, else
// pgbouncer in PATH; tested with PgBouncer 1.18.
//
// In transaction and statement mode, consecutive transactions of one client
// connection may run on different server connections, so a statement that
// pgx prepares and caches on one is missing on the next, or already
// prepared there by another client: PgBouncer 1.18 does not track prepared
// statements. ConnString therefore sets pgx's
// default_query_exec_mode to exec in those modes (unnamed statements, sent
// with their parameters in one round trip); set
// ConnConfig.DefaultQueryExecMode to pgx.QueryExecModeSimpleProtocol for
// client-side parameter interpolation instead, but not to a mode that
// caches statements or describes them in a round trip of its own. The
// startup parameter extra_float_digits, which some clients send, is
// ignored; PgBouncer refuses other parameters it does not track (it tracks
// application_name, client_encoding, DateStyle, TimeZone and
// standard_conforming_strings).
//
// When no pgbouncer binary is installed, NewPgBouncer skips t saying so
// and how to install it, or fails it under CI (see SkipOrFail). It calls
// t.Fatal when an argument or option is invalid, when PGTEST_PGBOUNCER
// names no executable, and when PgBouncer does not start; the message then
// ends with its log.
func NewPgBouncer(t testing.TB, connString, mode string, opts ...PgBouncerOption) *PgBouncer {
	t.Helper()
	b, err := startPgBouncer(connString, mode, opts)
	if errors.Is(err, errNoPgBouncer) {
		SkipOrFail(t, "this test needs PgBouncer: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := b.close(); err != nil {
			t.Error(err)
		}
	})
	return b
}

// ConnString returns the connection string of the database of NewPgBouncer's
// connString through PgBouncer: its user and password, over TCP to
// 127.0.0.1, sslmode=disable, and in transaction and statement mode
// default_query_exec_mode=exec. It is valid until the test ends.
func (b *PgBouncer) ConnString() string {
	return b.connString(b.dbname, b.mode != SessionPooling, "exec")
}

// AdminConnString returns the connection string of PgBouncer's admin
// console (database pgbouncer), which answers SHOW POOLS, SHOW SERVERS,
// SHOW CONFIG and the other admin commands. The console speaks only the
// simple query protocol, which the string selects for pgx.
func (b *PgBouncer) AdminConnString() string {
	return b.connString("pgbouncer", true, "simple_protocol")
}

// Port returns the TCP port PgBouncer listens on.
func (b *PgBouncer) Port() int { return b.port }

func (b *PgBouncer) connString(dbname string, setMode bool, execMode string) string {
	u := url.URL{
		Scheme: "postgres",
		Host:   "127.0.0.1:" + strconv.Itoa(b.port),
		Path:   "/" + dbname,
	}
	if b.pass != "" {
		u.User = url.UserPassword(b.user, b.pass)
	} else {
		u.User = url.User(b.user)
	}
	q := url.Values{"sslmode": {"disable"}}
	if setMode {
		q.Set("default_query_exec_mode", execMode)
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// findPgBouncer returns the pgbouncer binary.
func findPgBouncer() (string, error) {
	const install = "install it (Debian/Ubuntu: apt-get install pgbouncer; .ci/run does) or set PGTEST_PGBOUNCER to the binary"
	if path := os.Getenv("PGTEST_PGBOUNCER"); path != "" {
		if err := isExecutable(path); err != nil {
			return "", errorf("PGTEST_PGBOUNCER=%s: %v; %s", path, err, install)
		}
		return path, nil
	}
	const debian = "/usr/sbin/pgbouncer"
	if isExecutable(debian) == nil {
		return debian, nil
	}
	if path, err := exec.LookPath("pgbouncer"); err == nil {
		return path, nil
	}
	return "", errorf("%w (PGTEST_PGBOUNCER not set, no %s, none in PATH): %s", errNoPgBouncer, debian, install)
}

// errNoPgBouncer marks the failure to find a pgbouncer binary where none
// was configured.
var errNoPgBouncer = errors.New("pgbouncer not found")

// startPgBouncer is NewPgBouncer without t.
func startPgBouncer(connString, mode string, opts []PgBouncerOption) (*PgBouncer, error) {
	switch mode {
	case SessionPooling, TransactionPooling, StatementPooling:
	default:
		return nil, errorf("pgbouncer: pool mode %q is none of %q, %q, %q", mode, SessionPooling, TransactionPooling, StatementPooling)
	}
	cfg := bouncerConfig{settings: map[string]string{}}
	for _, o := range opts {
		if o == nil {
			return nil, errorf("pgbouncer: nil option")
		}
		if err := o.applyBouncer(&cfg); err != nil {
			return nil, err
		}
	}
	if cfg.poolSize == 0 {
		cfg.poolSize = defaultPoolSize
	}
	up, err := pgconn.ParseConfig(connString)
	if err != nil {
		return nil, errorf("pgbouncer: parse %q: %w", connString, err)
	}
	bin, err := findPgBouncer()
	if err != nil {
		return nil, err
	}
	u, err := findOSUser()
	if err != nil {
		return nil, errorf("pgbouncer: %w", err)
	}
	root, err := u.mkRoot()
	if err != nil {
		return nil, errorf("pgbouncer: %w", err)
	}
	if real, err := filepath.EvalSymlinks(root); err == nil {
		root = real
	}
	b := &PgBouncer{
		root:    root,
		logPath: filepath.Join(root, "pgbouncer.log"),
		user:    up.User,
		pass:    up.Password,
		dbname:  up.Database,
		mode:    mode,
	}
	for range 3 {
		if b.port, err = freePort(); err != nil {
			err = errorf("pgbouncer: find a free port: %w", err)
			break
		}
		if err = b.start(bin, u, up, cfg); err == nil || !strings.Contains(err.Error(), "already in use") {
			break
		}
	}
	if err != nil {
		return nil, errors.Join(err, b.close())
	}
	return b, nil
}

// start writes the configuration for b.port and starts PgBouncer there.
func (b *PgBouncer) start(bin string, u osUser, up *pgconn.Config, cfg bouncerConfig) error {
	ini := filepath.Join(b.root, "pgbouncer.ini")
	users := filepath.Join(b.root, "userlist.txt")
	if err := writeOwned(u, users, userlist(b.user)); err != nil {
		return errorf("pgbouncer: %w", err)
	}
	if err := writeOwned(u, ini, b.ini(up, cfg, users)); err != nil {
		return errorf("pgbouncer: %w", err)
	}
	cmd := exec.Command(bin, ini)
	f, err := u.command(cmd, b.root, b.logPath)
	if err != nil {
		return errorf("pgbouncer: %w", err)
	}
	proc, err := startChild(cmd, syscall.SIGKILL)
	f.Close()
	if err != nil {
		return errorf("start pgbouncer as OS user %s: %w", u.name, err)
	}
	b.proc = proc
	if err := b.waitReady(); err != nil {
		_ = b.stop()
		return errorf("pgbouncer did not start: %v%s", err, tailOf(b.logPath))
	}
	return nil
}

// ini returns pgbouncer.ini.
func (b *PgBouncer) ini(up *pgconn.Config, cfg bouncerConfig, users string) string {
	server := []string{"host=" + iniQuote(up.Host), "port=" + strconv.Itoa(int(up.Port)), "user=" + iniQuote(up.User)}
	if up.Password != "" {
		server = append(server, "password="+iniQuote(up.Password))
	}
	tls := "disable"
	if up.TLSConfig != nil {
		tls = "prefer"
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "; pgtest: PgBouncer for one test.\n[databases]\n* = %s\n\n[pgbouncer]\n", strings.Join(server, " "))
	for _, kv := range [][2]string{
		{"listen_addr", "127.0.0.1"},
		{"listen_port", strconv.Itoa(b.port)},
		{"unix_socket_dir", ""},
		{"auth_type", "trust"},
		{"auth_file", users},
		{"admin_users", b.user},
		{"pool_mode", b.mode},
		{"default_pool_size", strconv.Itoa(cfg.poolSize)},
		{"ignore_startup_parameters", "extra_float_digits"},
		{"server_tls_sslmode", tls},
		{"logfile", ""},
		{"pidfile", ""},
		{"syslog", "0"},
	} {
		fmt.Fprintf(&sb, "%s = %s\n", kv[0], kv[1])
	}
	names := make([]string, 0, len(cfg.settings))
	for name := range cfg.settings {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		fmt.Fprintf(&sb, "%s = %s\n", name, cfg.settings[name])
	}
	return sb.String()
}

// iniQuote quotes a value of a connection string in [databases].
func iniQuote(s string) string {
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(s) + "'"
}

// userlist returns an auth_file naming user, which auth_type trust needs.
func userlist(user string) string {
	return `"` + strings.ReplaceAll(user, `"`, `""`) + `" ""` + "\n"
}

// writeOwned writes a file that only the OS user may read.
func writeOwned(u osUser, path, text string) error {
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		return err
	}
	return u.chown(path)
}

// waitReady polls the admin console until it answers, PgBouncer exits, or
// readyTimeout passes.
func (b *PgBouncer) waitReady() error {
	deadline := time.Now().Add(readyTimeout)
	connString := b.AdminConnString()
	var last error
	for pause := time.Millisecond; ; pause = min(2*pause, 50*time.Millisecond) {
		if b.proc.exited() {
			return fmt.Errorf("pgbouncer exited: %v", b.proc.err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		conn, err := pgx.Connect(ctx, connString)
		if err == nil {
			_ = conn.Close(ctx)
			cancel()
			return nil
		}
		cancel()
		last = err
		if time.Now().After(deadline) {
			return fmt.Errorf("not accepting connections within %v: %w", readyTimeout, last)
		}
		time.Sleep(pause)
	}
}

// stop shuts PgBouncer down at once (SIGTERM closes every connection),
// killing it if that does not finish within shutdownTimeout.
func (b *PgBouncer) stop() error {
	if b.proc == nil {
		return nil
	}
	p := b.proc
	b.proc = nil
	p.signal(syscall.SIGTERM)
	if p.waitFor(shutdownTimeout) {
		return nil
	}
	p.signal(syscall.SIGKILL)
	if !p.waitFor(killTimeout) {
		return errorf("pgbouncer did not exit within %v of SIGKILL", killTimeout)
	}
	return errorf("pgbouncer did not shut down within %v and was killed%s", shutdownTimeout, tailOf(b.logPath))
}

// close stops PgBouncer and removes its directory.
func (b *PgBouncer) close() error {
	stopErr := b.stop()
	if err := os.RemoveAll(b.root); err != nil {
		return errors.Join(stopErr, errorf("remove %s: %w", b.root, err))
	}
	return stopErr
}
