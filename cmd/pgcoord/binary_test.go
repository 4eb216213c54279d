package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// These tests run the pgcoord binary as an operator would: built with go
// build, started with a clean environment of their own.

// buildCLI builds pgcoord into a temporary directory of t and returns its
// path. -buildvcs=false keeps the build independent of git, and makes the
// version "(devel)".
func buildCLI(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "pgcoord")
	out, err := exec.Command("go", "build", "-buildvcs=false", "-o", bin, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// result is what one run of the binary did.
type result struct {
	code           int
	stdout, stderr string
}

// exe runs the binary with args and an environment made of env and the
// PATH and HOME of the test, nothing else: no DATABASE_URL, no PG*
// variable unless env sets it.
func exe(t *testing.T, bin string, env []string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir()}, env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	code := 0
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case err != nil:
		t.Fatalf("pgcoord %q: %v", args, err)
	}
	return result{code, stdout.String(), stderr.String()}
}

// keysOfTable returns the KEY column of "pgcoord key" output.
func keysOfTable(t *testing.T, out string) []string {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) < 1 || !strings.HasPrefix(lines[0], "NAME") {
		t.Fatalf("no table:\n%s", out)
	}
	var keys []string
	for _, l := range lines[1:] {
		f := strings.Fields(l)
		if len(f) != 5 {
			t.Fatalf("row %q", l)
		}
		keys = append(keys, f[1])
	}
	return keys
}

func TestBinary(t *testing.T) {
	bin := buildCLI(t)
	db := pgtest.DB(t)
	dbEnv := []string{"DATABASE_URL=" + db}

	// Flags may follow the arguments; a flag is never hashed as a name;
	// "--" ends the flags.
	t.Run("FlagsAfterArguments", func(t *testing.T) {
		r := exe(t, bin, nil, "key", "invoice/42", "--sep", "/")
		if r.code != exitOK {
			t.Fatalf("key invoice/42 --sep /: exit %d, %s", r.code, r.stderr)
		}
		if got, want := keysOfTable(t, r.stdout), []string{pgcoord.HashKey("invoice", "42").String()}; !slices.Equal(got, want) {
			t.Fatalf("key invoice/42 --sep /: keys %v, want %v (HashKey(\"invoice\", \"42\") only)", got, want)
		}
		r = exe(t, bin, nil, "key", "a/b", "--sep=/", "c/d", "--json")
		var keys []string
		for _, o := range jsonLines(t, r.stdout) {
			keys = append(keys, o["key"].(string))
		}
		if want := []string{pgcoord.HashKey("a", "b").String(), pgcoord.HashKey("c", "d").String()}; r.code != exitOK || !slices.Equal(keys, want) {
			t.Fatalf("key a/b --sep=/ c/d --json: exit %d, keys %v, want %v", r.code, keys, want)
		}
		r = exe(t, bin, nil, "key", "--sep", "/", "--", "--sep", "x/y")
		if want := []string{pgcoord.HashKey("--sep").String(), pgcoord.HashKey("x", "y").String()}; r.code != exitOK || !slices.Equal(keysOfTable(t, r.stdout), want) {
			t.Fatalf("key --sep / -- --sep x/y: exit %d, %q; want keys %v", r.code, r.stdout, want)
		}
		r = exe(t, bin, nil, "key", "x", "--bogus")
		if r.code != exitUsage || !strings.Contains(r.stderr, "--bogus") || r.stdout != "" {
			t.Fatalf("key x --bogus: exit %d, stdout %q, stderr %q; want usage error", r.code, r.stdout, r.stderr)
		}
		// --db after the command and after its argument.
		if r := exe(t, bin, nil, "migrate", "--db", db); r.code != exitOK {
			t.Fatalf("migrate --db URL: exit %d, %s", r.code, r.stderr)
		}
		if r := exe(t, bin, dbEnv, "leader", "scheduler", "--json"); r.code != exitNone || r.stdout != "" || !strings.Contains(r.stderr, "no leader") {
			t.Fatalf("leader scheduler --json, nobody leading: exit %d, %q, %q; want %d", r.code, r.stdout, r.stderr, exitNone)
		}
		c := newClient(t, db)
		ld := campaign(t, c, "scheduler", "pod-1")
		for _, args := range [][]string{
			{"leader", "scheduler", "--json"},
			{"leader", "--json", "scheduler"},
			{"--db", db, "leader", "scheduler", "--json"},
			{"leader", "scheduler", "--db", db, "--json"},
		} {
			env := dbEnv
			if slices.Contains(args, "--db") {
				env = nil
			}
			r := exe(t, bin, env, args...)
			lines := jsonLines(t, r.stdout)
			if r.code != exitOK || len(lines) != 1 || lines[0]["identity"] != "pod-1" || lines[0]["term"] != float64(ld.Term()) {
				t.Fatalf("pgcoord %q: exit %d, stdout %q, stderr %q", args, r.code, r.stdout, r.stderr)
			}
		}
	})

	// With neither --db nor DATABASE_URL, pgcoord connects as libpq does:
	// PGHOST, PGPORT, PGUSER, PGDATABASE, PGPASSWORD, PGSERVICE, the
	// password file.
	t.Run("LibpqEnvironment", func(t *testing.T) {
		cfg, err := pgconn.ParseConfig(db)
		if err != nil {
			t.Fatal(err)
		}
		sslmode := "disable"
		if cfg.TLSConfig != nil {
			sslmode = "require"
		}
		env := []string{"PGHOST=" + cfg.Host, "PGPORT=" + strconv.Itoa(int(cfg.Port)), "PGUSER=" + cfg.User,
			"PGDATABASE=" + cfg.Database, "PGPASSWORD=" + cfg.Password, "PGSSLMODE=" + sslmode}
		if r := exe(t, bin, env, "migrate", "--schema", "from_env"); r.code != exitOK {
			t.Fatalf("migrate with PGHOST...: exit %d, %s", r.code, r.stderr)
		}
		schemaVersion(t, db, "from_env", latestMigration(t))

		svc := filepath.Join(t.TempDir(), "pg_service.conf")
		conf := fmt.Sprintf("[coord]\nhost=%s\nport=%d\nuser=%s\ndbname=%s\nsslmode=%s\n", cfg.Host, cfg.Port, cfg.User, cfg.Database, sslmode)
		if cfg.Password != "" {
			conf += "password=" + cfg.Password + "\n"
		}
		if err := os.WriteFile(svc, []byte(conf), 0o600); err != nil {
			t.Fatal(err)
		}
		if r := exe(t, bin, []string{"PGSERVICEFILE=" + svc, "PGSERVICE=coord"}, "migrate", "--schema", "from_service"); r.code != exitOK {
			t.Fatalf("migrate with PGSERVICE: exit %d, %s", r.code, r.stderr)
		}
		schemaVersion(t, db, "from_service", latestMigration(t))

		// The password file: a server that asks for a password and
		// records the one it gets.
		srv := fakeServer(t, false)
		pass := filepath.Join(t.TempDir(), "pgpass")
		if err := os.WriteFile(pass, []byte("127.0.0.1:"+srv.port+":*:alice:s3cret\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		r := exe(t, bin, []string{"PGHOST=127.0.0.1", "PGPORT=" + srv.port, "PGUSER=alice", "PGPASSFILE=" + pass, "PGSSLMODE=disable"}, "locks")
		select {
		case pw := <-srv.passwords:
			if pw != "s3cret" {
				t.Fatalf("password from the password file: %q, want s3cret", pw)
			}
		default:
			t.Fatalf("pgcoord sent no password: exit %d, %s", r.code, r.stderr)
		}
		if r.code != exitFailure || !strings.Contains(r.stderr, "test server refuses") {
			t.Fatalf("refused login: exit %d, %q", r.code, r.stderr)
		}

		// Nothing to connect to: the error says what was tried.
		r = exe(t, bin, []string{"PGHOST=" + t.TempDir(), "PGPORT=1"}, "locks")
		if r.code != exitFailure || !strings.Contains(r.stderr, "no --db given and DATABASE_URL not set") ||
			!strings.Contains(r.stderr, "libpq environment (PGHOST, PGPORT)") || !strings.Contains(r.stderr, "port 1") {
			t.Fatalf("no server: exit %d, %q", r.code, r.stderr)
		}
		r = exe(t, bin, []string{"PGPORT=not-a-port"}, "locks")
		if r.code != exitUsage || !strings.Contains(r.stderr, "PGPORT") {
			t.Fatalf("bad PGPORT: exit %d, %q", r.code, r.stderr)
		}
	})

	t.Run("Version", func(t *testing.T) {
		for _, args := range [][]string{{"--version"}, {"locks", "--version"}} {
			if r := exe(t, bin, nil, args...); r.code != exitOK || r.stdout != "pgcoord (devel)\n" {
				t.Fatalf("pgcoord %q: exit %d, stdout %q, stderr %q", args, r.code, r.stdout, r.stderr)
			}
		}
	})

	// --connect-timeout bounds the connect to a server that never answers.
	t.Run("ConnectTimeout", func(t *testing.T) {
		srv := fakeServer(t, true)
		url := "postgres://alice@127.0.0.1:" + srv.port + "/x?sslmode=disable"
		start := time.Now()
		r := exe(t, bin, nil, "--connect-timeout", "300ms", "locks", "--db", url)
		if elapsed := time.Since(start); r.code != exitFailure || !strings.Contains(r.stderr, "--connect-timeout") || elapsed > 5*time.Second {
			t.Fatalf("silent server, --connect-timeout 300ms: exit %d after %v, %q", r.code, elapsed, r.stderr)
		}
		if r := exe(t, bin, nil, "locks", "--connect-timeout", "-1s", "--db", url); r.code != exitUsage {
			t.Fatalf("negative --connect-timeout: exit %d, %q", r.code, r.stderr)
		}
	})

	// Every --json output is JSON Lines with snake_case keys.
	t.Run("JSONLines", func(t *testing.T) {
		ctx := context.Background()
		c := newClient(t, db)
		campaign(t, c, "jsonlines", "pod-j")
		p, err := c.Semaphore("jsonlines", 2, pgcoord.WithIdentity("w-1")).Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Release(ctx)
		conn := pgtest.Conn(t, db)
		if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock(42)"); err != nil {
			t.Fatal(err)
		}
		pid := strconv.Itoa(int(conn.PgConn().PID()))
		for _, tc := range []struct {
			args []string
			min  int // lines
		}{
			{[]string{"key", "--json", "a", "b"}, 2},
			{[]string{"locks", "--json"}, 3},
			{[]string{"leader", "--json", "jsonlines"}, 1},
			{[]string{"elections", "--json"}, 1},
			{[]string{"semaphores", "--json", "--holders"}, 1},
			{[]string{"migrate", "--json"}, 1},
			{[]string{"release", "--json", "--force", "--pid", pid}, 1},
		} {
			r := exe(t, bin, dbEnv, tc.args...)
			lines := jsonLines(t, r.stdout)
			if r.code != exitOK || len(lines) < tc.min {
				t.Fatalf("pgcoord %q: exit %d, %d lines, want %d or more; stdout %q, stderr %q", tc.args, r.code, len(lines), tc.min, r.stdout, r.stderr)
			}
			for _, l := range lines {
				if bad := nonSnakeKeys(l); len(bad) > 0 {
					t.Errorf("pgcoord %q: keys not in snake_case: %v in %v", tc.args, bad, l)
				}
			}
			if tc.args[0] == "semaphores" {
				hs, _ := lines[0]["holders"].([]any)
				if len(hs) != 1 || hs[0].(map[string]any)["identity"] != "w-1" || hs[0].(map[string]any)["slot"] == nil {
					t.Errorf("semaphores --json --holders: %v", lines[0])
				}
			}
			if tc.args[0] == "release" {
				rel, _ := lines[0]["released"].([]any)
				if lines[0]["pid"] != float64(conn.PgConn().PID()) || len(rel) != 1 || rel[0].(map[string]any)["key"] != "int64:42" {
					t.Errorf("release --json: %v", lines[0])
				}
			}
		}
	})

	// "pgcoord elections" lists every election of the leaders table, and
	// whether its leader still holds the election's lock.
	t.Run("Elections", func(t *testing.T) {
		edb := pgtest.DB(t)
		env := []string{"DATABASE_URL=" + edb}
		if r := exe(t, bin, env, "elections"); r.code != exitFailure || !strings.Contains(r.stderr, "pgcoord migrate") {
			t.Fatalf("elections before migrate: exit %d, %q", r.code, r.stderr)
		}
		if r := exe(t, bin, env, "migrate"); r.code != exitOK {
			t.Fatal(r.stderr)
		}
		if r := exe(t, bin, env, "elections"); r.code != exitOK || !strings.Contains(r.stdout, "no elections") {
			t.Fatalf("no elections: exit %d, %q, %q", r.code, r.stdout, r.stderr)
		}
		ctx := context.Background()
		c := newClient(t, edb)
		live := campaign(t, c, "alpha", "pod-a")
		ended := campaign(t, c, "beta", "pod-b")
		if err := ended.Resign(ctx); err != nil {
			t.Fatal(err)
		}
		info, err := c.Election("alpha").Leader(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if h := holdersOf(t, edb, c.Election("alpha").Key()); len(h) != 1 || h[0] != info.PID {
			t.Fatalf("alpha's lock held by %v, Leader says %d", h, info.PID)
		}
		if h := holdersOf(t, edb, c.Election("beta").Key()); len(h) != 0 {
			t.Fatalf("beta's lock held by %v after the resign", h)
		}
		r := exe(t, bin, env, "elections", "--json")
		lines := jsonLines(t, r.stdout)
		if r.code != exitOK || len(lines) != 2 {
			t.Fatalf("elections --json: exit %d, %q, %q", r.code, r.stdout, r.stderr)
		}
		a, b := lines[0], lines[1]
		if a["name"] != "alpha" || a["identity"] != "pod-a" || a["leading"] != true || a["pid"] != float64(info.PID) || a["term"] != float64(live.Term()) {
			t.Errorf("alpha: %v; want pod-a leading, pid %d, term %d", a, info.PID, live.Term())
		}
		if b["name"] != "beta" || b["identity"] != "pod-b" || b["leading"] != false || b["term"] != float64(ended.Term()) {
			t.Errorf("beta: %v; want pod-b not leading, term %d", b, ended.Term())
		}
		r = exe(t, bin, env, "elections")
		if r.code != exitOK || !regexp.MustCompile(`(?m)^alpha +yes +pod-a +`+strconv.Itoa(int(live.Term()))+` `).MatchString(r.stdout) ||
			!regexp.MustCompile(`(?m)^beta +no \(ended\) +pod-b `).MatchString(r.stdout) {
			t.Fatalf("elections: exit %d:\n%s%s", r.code, r.stdout, r.stderr)
		}
	})

	// The help names every command and every flag, and the exit codes.
	t.Run("Help", func(t *testing.T) {
		for _, args := range [][]string{{"--help"}, {"-h"}, {"help"}} {
			r := exe(t, bin, nil, args...)
			if r.code != exitOK || r.stderr != "" {
				t.Fatalf("pgcoord %q: exit %d, %q", args, r.code, r.stderr)
			}
			for _, c := range commands {
				if !strings.Contains(r.stdout, "\n  "+c.name+" ") {
					t.Errorf("pgcoord %q does not list command %s", args, c.name)
				}
				fs, _ := newFlagSet(&c, newGlobals())
				for _, name := range flagNames(fs) {
					if !strings.Contains(r.stdout, "--"+name) {
						t.Errorf("pgcoord %q does not mention --%s of %s", args, name, c.name)
					}
				}
			}
			for _, want := range []string{"Exit codes:", "  0  success", "  1  failure", "  2  usage", "  3  nothing to show", "JSON Lines", "DATABASE_URL", "PGHOST"} {
				if !strings.Contains(r.stdout, want) {
					t.Errorf("pgcoord %q lacks %q", args, want)
				}
			}
		}
		for _, c := range commands {
			fs, _ := newFlagSet(&c, newGlobals())
			for _, args := range [][]string{{"help", c.name}, {c.name, "--help"}, {c.name, "-h"}} {
				r := exe(t, bin, nil, args...)
				if r.code != exitOK || !strings.HasPrefix(r.stdout, "Usage: pgcoord "+c.name) || !strings.Contains(r.stdout, "Exit codes:") {
					t.Fatalf("pgcoord %q: exit %d, %q, %q", args, r.code, r.stdout, r.stderr)
				}
				for _, name := range flagNames(fs) {
					if !regexp.MustCompile(`(?m)^  --` + name + `\b`).MatchString(r.stdout) {
						t.Errorf("pgcoord %q does not describe --%s:\n%s", args, name, r.stdout)
					}
				}
			}
		}
	})
}

// flagNames returns the names of the flags of fs.
func flagNames(fs *flag.FlagSet) []string {
	var names []string
	fs.VisitAll(func(f *flag.Flag) { names = append(names, f.Name) })
	return names
}

// jsonLines decodes out as JSON Lines: one object per line.
func jsonLines(t *testing.T, out string) []map[string]any {
	t.Helper()
	var objs []map[string]any
	for _, line := range strings.Split(strings.TrimSuffix(out, "\n"), "\n") {
		if line == "" && out == "" {
			break
		}
		var o map[string]any
		if err := json.Unmarshal([]byte(line), &o); err != nil {
			t.Fatalf("not a JSON object on one line: %q: %v\n%s", line, err, out)
		}
		objs = append(objs, o)
	}
	return objs
}

var snakeCase = regexp.MustCompile(`^[a-z][a-z0-9]*(_[a-z0-9]+)*$`)

// nonSnakeKeys returns the keys of v, and of the objects within it, that
// are not snake_case.
func nonSnakeKeys(v any) []string {
	var bad []string
	switch v := v.(type) {
	case map[string]any:
		for k, x := range v {
			if !snakeCase.MatchString(k) {
				bad = append(bad, k)
			}
			bad = append(bad, nonSnakeKeys(x)...)
		}
	case []any:
		for _, x := range v {
			bad = append(bad, nonSnakeKeys(x)...)
		}
	}
	return bad
}

// newClient returns a Client on a pool of db, closed when the test ends.
func newClient(t *testing.T, db string) *pgcoord.Client {
	t.Helper()
	c, err := pgcoord.New(pgtest.Pool(t, db))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

// campaign makes identity the leader of election, resigning when the test
// ends.
func campaign(t *testing.T, c *pgcoord.Client, election, identity string) *pgcoord.Leadership {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	ld, err := c.Election(election, pgcoord.WithIdentity(identity)).Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ld.Resign(context.Background()) })
	return ld
}

// schemaVersion checks that schema in db is at version want.
// latestMigration returns the newest version of the migrations pgcoord
// embeds: what migrate brings a schema to.
func latestMigration(t *testing.T) int64 {
	t.Helper()
	ups, err := fs.Glob(pgcoord.Migrations(), "*.up.sql")
	if err != nil || len(ups) == 0 {
		t.Fatalf("embedded migrations: %v, %v", ups, err)
	}
	v, err := strconv.ParseInt(strings.SplitN(slices.Max(ups), "_", 2)[0], 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func schemaVersion(t *testing.T, db, schema string, want int64) {
	t.Helper()
	var got int64
	err := pgtest.Conn(t, db).QueryRow(context.Background(), "SELECT max(version) FROM "+schema+".schema_version").Scan(&got)
	if err != nil || got != want {
		t.Fatalf("schema %s: version %d, %v; want %d", schema, got, err, want)
	}
}

// fake is a server that speaks just enough of PostgreSQL's protocol to ask
// for a cleartext password, record it and refuse the login; or, if silent,
// accepts connections and never answers.
type fake struct {
	port      string
	passwords chan string
}

func fakeServer(t *testing.T, silent bool) *fake {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &fake{port: strconv.Itoa(ln.Addr().(*net.TCPAddr).Port), passwords: make(chan string, 16)}
	done := make(chan struct{})
	t.Cleanup(func() {
		ln.Close()
		<-done
	})
	go func() {
		defer close(done)
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, conn)
			if silent {
				continue
			}
			f.refuse(conn)
		}
	}()
	return f
}

// refuse runs the login of one connection up to the password.
func (f *fake) refuse(conn net.Conn) {
	_ = conn.SetDeadline(time.Now().Add(testTimeout))
	be := pgproto3.NewBackend(conn, conn)
	if _, err := be.ReceiveStartupMessage(); err != nil {
		return
	}
	be.Send(&pgproto3.AuthenticationCleartextPassword{})
	if err := be.Flush(); err != nil {
		return
	}
	if err := be.SetAuthType(pgproto3.AuthTypeCleartextPassword); err != nil {
		return
	}
	msg, err := be.Receive()
	if pw, ok := msg.(*pgproto3.PasswordMessage); err == nil && ok {
		f.passwords <- pw.Password
	}
	be.Send(&pgproto3.ErrorResponse{Severity: "FATAL", Code: "28P01", Message: "test server refuses every login"})
	_ = be.Flush()
}

// Bad values exit 2 with a message that names the flag or argument, as the
// help's table of exit codes says; a schema without pgcoord's tables is a
// failure (1) that suggests the migration that would make them.
func TestBinaryExitCodesAndMessages(t *testing.T) {
	bin := buildCLI(t)
	db := pgtest.DB(t)
	env := []string{"DATABASE_URL=" + db}
	for _, tc := range []struct {
		args []string
		code int
		want string // in stderr
	}{
		{[]string{"semaphores", "--schema", ""}, exitUsage, "--schema must not be empty"},
		{[]string{"elections", "--schema", ""}, exitUsage, "--schema must not be empty"},
		{[]string{"migrate", "--schema", ""}, exitUsage, "--schema must not be empty"},
		{[]string{"leader", "--schema", "", "x"}, exitUsage, "--schema must not be empty"},
		{[]string{"locks", "--schema", ""}, exitUsage, "--schema must not be empty"},
		{[]string{"ui", "--schema", ""}, exitUsage, "--schema must not be empty"},
		{[]string{"migrate", "--schema", strings.Repeat("s", 64)}, exitUsage, "at most 63 bytes"},
		{[]string{"leader", ""}, exitUsage, "election name must not be empty"},
		{[]string{"leader", "a\x01b\xff"}, exitUsage, "UTF-8"},
		{[]string{"key", ""}, exitUsage, "NAME must not be empty"},
		{[]string{"key", "a", ""}, exitUsage, "NAME must not be empty"},
		{[]string{"locks", "--name", ""}, exitUsage, "a name must not be empty"},
		{[]string{"locks", "--names-file", filepath.Join(t.TempDir(), "none")}, exitUsage, "--names-file"},
		{[]string{"ui", "--interval", "1ms"}, exitUsage, "--interval must be 100ms to 1h"},
		{[]string{"ui", "--addr", "127.0.0.1:nope"}, exitUsage, "--addr"},
		{[]string{"semaphores", "--schema", "nosuch"}, exitFailure, `schema "nosuch" has no semaphores table (run "pgcoord migrate --schema nosuch" first?)`},
		{[]string{"elections", "--schema", "nosuch"}, exitFailure, `schema "nosuch" has no leaders table (run "pgcoord migrate --schema nosuch" first?)`},
	} {
		r := exe(t, bin, env, tc.args...)
		if r.code != tc.code || !strings.HasPrefix(r.stderr, "pgcoord: ") || !strings.Contains(r.stderr, tc.want) || r.stdout != "" {
			t.Errorf("pgcoord %q: exit %d, stdout %q, stderr %q; want exit %d and %q", tc.args, r.code, r.stdout, r.stderr, tc.code, tc.want)
		}
		// The CLI's messages name its own flags, never the library's
		// options, and a usage error is not an SQL error.
		if strings.Contains(r.stderr, "WithSchema") || strings.Contains(r.stderr, "option ") || tc.code == exitUsage && strings.Contains(r.stderr, "SQLSTATE") {
			t.Errorf("pgcoord %q: stderr %q names a library option or an SQL error", tc.args, r.stderr)
		}
	}
}

// migrate says what it did: created the tables, migrated them from one
// version to another, or found nothing to do.
func TestBinaryMigrateReportsWhatItDid(t *testing.T) {
	bin := buildCLI(t)
	db := pgtest.DB(t)
	env := []string{"DATABASE_URL=" + db}
	latest := latestMigration(t)
	r := exe(t, bin, env, "migrate", "--schema", "app")
	if want := fmt.Sprintf("created pgcoord's tables in schema \"app\" at version %d\n", latest); r.code != exitOK || r.stdout != want {
		t.Fatalf("first migrate: exit %d, %q, %q; want %q", r.code, r.stdout, r.stderr, want)
	}
	r = exe(t, bin, env, "migrate", "--schema", "app", "--json")
	if l := jsonLines(t, r.stdout); r.code != exitOK || len(l) != 1 || l[0]["action"] != "none" || l[0]["previous_version"] != float64(latest) || l[0]["version"] != float64(latest) {
		t.Fatalf("migrate again --json: exit %d, %q, %q", r.code, r.stdout, r.stderr)
	}
	r = exe(t, bin, env, "migrate", "--schema", "app")
	if want := fmt.Sprintf("schema \"app\" is already at version %d; nothing to do\n", latest); r.code != exitOK || r.stdout != want {
		t.Fatalf("migrate again: exit %d, %q; want %q", r.code, r.stdout, want)
	}
	// Back to version 3, by the down files, as an older pgcoord left it.
	ctx := context.Background()
	conn := pgtest.Conn(t, db)
	if _, err := conn.Exec(ctx, "SET search_path = app"); err != nil {
		t.Fatal(err)
	}
	for v := latest; v > 3; v-- {
		downs, err := fs.Glob(pgcoord.Migrations(), fmt.Sprintf("%06d_*.down.sql", v))
		if err != nil || len(downs) != 1 {
			t.Fatalf("down file of %d: %v, %v", v, downs, err)
		}
		sql, err := fs.ReadFile(pgcoord.Migrations(), downs[0])
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, string(sql)); err != nil {
			t.Fatalf("%s: %v", downs[0], err)
		}
		if _, err := conn.Exec(ctx, "DELETE FROM app.schema_version WHERE version = $1", v); err != nil {
			t.Fatal(err)
		}
	}
	r = exe(t, bin, env, "migrate", "--schema", "app", "--json")
	if l := jsonLines(t, r.stdout); r.code != exitOK || len(l) != 1 || l[0]["action"] != "migrated" || l[0]["previous_version"] != float64(3) || l[0]["version"] != float64(latest) {
		t.Fatalf("migrate from 3 --json: exit %d, %q, %q", r.code, r.stdout, r.stderr)
	}
	schemaVersion(t, db, "app", latest)
}

// The JSON of every command names an election and a semaphore the same
// way ("name"); release --json lists the locks the backend waited for only
// when there were some; and semaphores --holders prints every row under
// the header's columns.
func TestBinaryOutputIsConsistent(t *testing.T) {
	bin := buildCLI(t)
	db := pgtest.DB(t)
	env := []string{"DATABASE_URL=" + db}
	if r := exe(t, bin, env, "migrate"); r.code != exitOK {
		t.Fatal(r.stderr)
	}
	ctx := context.Background()
	c := newClient(t, db)
	campaign(t, c, "scheduler", "pod-1")
	for _, identity := range []string{"w-1", "a much longer holder identity"} {
		p, err := c.Semaphore("exports", 3, pgcoord.WithIdentity(identity)).Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Release(ctx)
	}
	if _, err := c.Semaphore("idle-semaphore-with-a-long-name", 1).TryAcquire(ctx); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"leader", "scheduler", "--json"}, {"elections", "--json"}, {"semaphores", "--json"}} {
		r := exe(t, bin, env, args...)
		lines := jsonLines(t, r.stdout)
		if r.code != exitOK || len(lines) == 0 {
			t.Fatalf("pgcoord %q: exit %d, %q", args, r.code, r.stderr)
		}
		for _, l := range lines {
			if _, ok := l["name"].(string); !ok || l["election"] != nil || l["semaphore"] != nil {
				t.Errorf("pgcoord %q: %v; want the election's or semaphore's name as \"name\"", args, l)
			}
		}
	}

	// release --json: no "awaited" for a backend that waited for nothing.
	holder := pgtest.Conn(t, db)
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock(42)"); err != nil {
		t.Fatal(err)
	}
	r := exe(t, bin, env, "release", "--json", "--force", "--pid", strconv.Itoa(int(holder.PgConn().PID())))
	if l := jsonLines(t, r.stdout); r.code != exitOK || len(l) != 1 || strings.Contains(r.stdout, "awaited") || l[0]["released"] == nil {
		t.Errorf("release --json of a holder: exit %d, %q, %q", r.code, r.stdout, r.stderr)
	}
	// ... and the locks it waited for when it waited.
	a, b := pgtest.Conn(t, db), pgtest.Conn(t, db)
	execSQL(t, a, "SELECT pg_advisory_lock(43)")
	waitIn(t, b, 43)
	pb := int32(b.PgConn().PID())
	pgtest.Eventually(t, testTimeout, "the waiter", func() bool { return waiting(t, db, pb) })
	r = exe(t, bin, env, "release", "--json", "--force", "--pid", strconv.Itoa(int(pb)))
	if l := jsonLines(t, r.stdout); r.code != exitOK || len(l) != 1 || len(l[0]["awaited"].([]any)) != 1 {
		t.Errorf("release --json of a waiter: exit %d, %q, %q", r.code, r.stdout, r.stderr)
	}

	// semaphores --holders: each cell starts where its column's header does.
	r = exe(t, bin, env, "semaphores", "--holders")
	t.Logf("pgcoord semaphores --holders:\n%s", r.stdout)
	lines := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n")
	if r.code != exitOK || len(lines) != 4 {
		t.Fatalf("semaphores --holders: exit %d, %d lines, want a header and 3 rows:\n%s%s", r.code, len(lines), r.stdout, r.stderr)
	}
	starts := func(line string) []int {
		var s []int
		for _, m := range regexp.MustCompile(`(?:^|\s{2,})(\S)`).FindAllStringSubmatchIndex(line, -1) {
			s = append(s, m[2])
		}
		return s
	}
	header := starts(lines[0])
	for _, l := range lines[1:] {
		if got := starts(l); !slices.Equal(got, header) {
			t.Errorf("row %q: cells start at %v, the header's columns at %v", l, got, header)
		}
	}
}
