package pgcoordtest

import (
	"bufio"
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// urlHelperEnv runs the test binary as urlHelper (see TestMain).
const urlHelperEnv = "PGCOORDTEST_URL_HELPER"

// urlHelper is a child process that finds its server through the
// environment, makes a database from the template and prints where the
// server came from, its prefix and the database's schema version. In mode
// "die" it exits without closing anything, as a killed test binary does;
// in mode "hang" it waits to be killed.
func urlHelper(mode string) int {
	s, err := newServer(serverConfig{container: false})
	if err != nil {
		fmt.Println(err)
		return 1
	}
	name := s.prefix + "t_child"
	if err := s.found.CreateDB(name, s.template); err != nil {
		fmt.Println(err)
		return 1
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.found.ConnString(name))
	if err != nil {
		fmt.Println(err)
		return 1
	}
	var version int
	err = conn.QueryRow(ctx, "SELECT max(version) FROM pgcoord.schema_version").Scan(&version)
	_ = conn.Close(ctx)
	if err != nil {
		fmt.Println(err)
		return 1
	}
	fmt.Printf("CHILD pid=%d admin=%s prefix=%s version=%d source=%s\n", os.Getpid(), s.found.Admin, s.prefix, version, s.found.Source)
	switch mode {
	case "die":
		return 0
	case "hang": // until the parent kills it
		time.Sleep(time.Minute)
		return 1
	}
	if err := s.found.DropDB(name); err != nil {
		fmt.Println(err)
		return 1
	}
	if err := s.close(); err != nil {
		fmt.Println(err)
		return 1
	}
	return 0
}

// runURLHelper runs urlHelper with the database URL variables given and
// returns its CHILD line's fields.
func runURLHelper(t *testing.T, mode string, env ...string) map[string]string {
	t.Helper()
	out, err := urlHelperOutput(mode, env...)
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if rest, ok := strings.CutPrefix(line, "CHILD "); ok {
			fields := map[string]string{}
			for _, f := range strings.Fields(rest) {
				k, v, _ := strings.Cut(f, "=")
				fields[k] = v
			}
			return fields
		}
	}
	t.Fatalf("child printed no CHILD line:\n%s", out)
	return nil
}

// urlHelperOutput runs urlHelper with env added to an environment without
// database URL variables and returns its output and exit error.
func urlHelperOutput(mode string, env ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0])
	for _, kv := range os.Environ() {
		switch strings.SplitN(kv, "=", 2)[0] {
		case EnvDatabaseURL, EnvProjectDatabaseURL, "DATABASE_URL", "CI", helperEnv, urlHelperEnv:
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	cmd.Env = append(cmd.Env, append([]string{urlHelperEnv + "=" + mode}, env...)...)
	return cmd.CombinedOutput()
}

// pgctDatabases returns the databases on the server of connString whose
// name starts with prefix.
func pgctDatabases(t *testing.T, connString, prefix string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, "SELECT datname FROM pg_database WHERE starts_with(datname, $1)", prefix)
	if err != nil {
		t.Fatal(err)
	}
	dbs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return dbs
}

// A server named by PGCOORDTEST_DATABASE_URL, else PGTEST_DATABASE_URL,
// serves migrated databases; the first variable wins over the second. A
// process that closes leaves no database there, and the databases of one
// that died are dropped by the next.
func TestDatabaseURLServesDB(t *testing.T) {
	s := sharedTestServer(t) // a server for the children to share
	url := s.found.Admin
	unusable := "postgres://nobody@127.0.0.1:1/none?sslmode=disable&connect_timeout=1"

	for _, tc := range []struct {
		name, source string
		env          []string
	}{
		{"PGCOORDTEST_DATABASE_URL", EnvDatabaseURL, []string{EnvDatabaseURL + "=" + url, EnvProjectDatabaseURL + "=" + unusable}},
		{"PGTEST_DATABASE_URL", EnvProjectDatabaseURL, []string{EnvProjectDatabaseURL + "=" + url}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := runURLHelper(t, "close", tc.env...)
			if got["source"] != tc.source || got["version"] == "" || got["version"] == "0" {
				t.Fatalf("child reported %v; want source %s and a migrated database", got, tc.source)
			}
			if dbs := pgctDatabases(t, url, got["prefix"]); len(dbs) != 0 {
				t.Fatalf("databases %v left behind by a child that closed", dbs)
			}
		})
	}

	t.Run("dead process", func(t *testing.T) {
		env := EnvDatabaseURL + "=" + url
		dead := runURLHelper(t, "die", env)
		if dbs := pgctDatabases(t, url, dead["prefix"]); len(dbs) != 2 {
			t.Fatalf("a child that died left %v; want its template and its database", dbs)
		}
		// Its keeper's backend leaves pg_stat_activity once the server
		// sees the connection closed.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		pgtest.Eventually(t, 10*time.Second, "the dead child's keeper to leave pg_stat_activity", func() bool {
			var n int
			err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", keeperApp+dead["prefix"]).Scan(&n)
			return err == nil && n == 0
		})
		next := runURLHelper(t, "close", env)
		if next["prefix"] == dead["prefix"] {
			t.Fatalf("two children with prefix %s", next["prefix"])
		}
		if dbs := pgctDatabases(t, url, dead["prefix"]); len(dbs) != 0 {
			t.Fatalf("databases %v of a dead child survived the next child", dbs)
		}
	})
}

// withRole returns the URL with its user replaced by role.
func withRole(t *testing.T, connString, role string) string {
	t.Helper()
	u, err := url.Parse(connString)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	return u.String()
}

// sharedTestServer returns the server that this test binary's DB calls
// share, found or started as the first DB call does; like DB, it skips
// the test where no server can be had.
func sharedTestServer(t *testing.T) *server {
	t.Helper()
	DB(t)
	s, err := sharedServer(shared.cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// localTestServer is sharedTestServer for a test whose children start
// servers from local binaries: it skips the test where the shared server
// came from elsewhere (a database URL).
func localTestServer(t *testing.T) *server {
	t.Helper()
	s := sharedTestServer(t)
	if !strings.HasPrefix(s.found.Source, "local") {
		t.Skip("skipped: this test starts servers from local binaries, and the shared server came from " + s.found.Source)
	}
	return s
}

// adminConn connects to s as its administrator, within ctx; the
// connection closes when the test ends.
func adminConn(ctx context.Context, t *testing.T, s *server) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, s.found.Admin)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// A role that may not create databases is refused at once with what to
// do about it; one that may (CREATEDB, not a superuser) serves migrated
// databases and leaves none behind.
func TestDatabaseURLRole(t *testing.T) {
	s := sharedTestServer(t) // a server for the children to share
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin := adminConn(ctx, t, s)
	for _, sql := range []string{
		"CREATE ROLE pgct_role_nocreatedb LOGIN",
		"CREATE ROLE pgct_role_createdb LOGIN CREATEDB",
	} {
		if _, err := admin.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, s.found.Admin)
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP ROLE pgct_role_nocreatedb, pgct_role_createdb"); err != nil {
			t.Error(err)
		}
	})

	t.Run("without CREATEDB", func(t *testing.T) {
		out, err := urlHelperOutput("close", EnvDatabaseURL+"="+withRole(t, s.found.Admin, "pgct_role_nocreatedb"))
		if err == nil {
			t.Fatalf("a role without CREATEDB was used:\n%s", out)
		}
		for _, want := range []string{EnvDatabaseURL + " is set but unusable", "ALTER ROLE ... CREATEDB"} {
			if !strings.Contains(string(out), want) {
				t.Errorf("output lacks %q:\n%s", want, out)
			}
		}
	})
	t.Run("with CREATEDB", func(t *testing.T) {
		dsn := withRole(t, s.found.Admin, "pgct_role_createdb")
		got := runURLHelper(t, "close", EnvDatabaseURL+"="+dsn)
		if got["source"] != EnvDatabaseURL || got["version"] == "" || got["version"] == "0" {
			t.Fatalf("child reported %v; want source %s and a migrated database", got, EnvDatabaseURL)
		}
		if dbs := pgctDatabases(t, s.found.Admin, got["prefix"]); len(dbs) != 0 {
			t.Fatalf("databases %v left behind by a child that closed", dbs)
		}
	})
}

// DATABASE_URL is never read: set to a server that cannot be used, it
// changes nothing, and the child starts its server from local binaries.
func TestDatabaseURLIsNeverRead(t *testing.T) {
	localTestServer(t)
	got := runURLHelper(t, "close", "DATABASE_URL=postgres://nobody@127.0.0.1:1/none?sslmode=disable&connect_timeout=1")
	if !strings.HasPrefix(got["source"], "local") || got["version"] == "" || got["version"] == "0" {
		t.Fatalf("child reported %v; want a migrated database on a server from local binaries", got)
	}
}

// A test binary killed with SIGKILL while its server runs from local
// binaries takes the server with it (the parent-death signal), and the
// next test binary's first DB call removes the directory it left.
func TestKilledTestBinaryLeavesNoServer(t *testing.T) {
	localTestServer(t)
	cmd, fields := startHangingChild(t)
	admin := fields["admin"]
	dirs := ownedDirs(t, fields["pid"])
	if len(dirs) == 0 {
		t.Fatalf("no pgtest directory owned by the child %s", fields["pid"])
	}
	probe := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, admin)
		if err != nil {
			return err
		}
		return conn.Close(ctx)
	}
	if err := probe(); err != nil {
		t.Fatalf("the child's server does not answer while the child lives: %v", err)
	}

	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	pgtest.Eventually(t, 30*time.Second, "the killed child's server to stop", func() bool { return probe() != nil })

	// The next test binary removes what the killed one left.
	runURLHelper(t, "close")
	for _, dir := range dirs {
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Errorf("directory %s of the killed child is still there after the next run (%v)", dir, err)
		}
	}
}

// ownedDirs returns the pgtest directories, in the places pgtest keeps
// them, whose owner file names pid.
func ownedDirs(t *testing.T, pid string) []string {
	t.Helper()
	var dirs []string
	for _, base := range []string{os.Getenv("PGTEST_TMPDIR"), "/dev/shm", os.TempDir()} {
		if base == "" {
			continue
		}
		owners, _ := filepath.Glob(filepath.Join(base, "pgtest-*", "pgtest.owner"))
		for _, owner := range owners {
			if b, err := os.ReadFile(owner); err == nil && strings.TrimSpace(string(b)) == pid {
				dirs = append(dirs, filepath.Dir(owner))
			}
		}
	}
	return dirs
}

// startHangingChild starts urlHelper in mode "hang" with env added to an
// environment without database URL variables, waits for its CHILD line
// and returns the process and the line's fields. The child is killed in
// t.Cleanup if still alive.
func startHangingChild(t *testing.T, env ...string) (*exec.Cmd, map[string]string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	cmd := exec.CommandContext(ctx, os.Args[0])
	for _, kv := range os.Environ() {
		switch strings.SplitN(kv, "=", 2)[0] {
		case EnvDatabaseURL, EnvProjectDatabaseURL, "CI", helperEnv, urlHelperEnv:
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	cmd.Env = append(cmd.Env, append([]string{urlHelperEnv + "=hang"}, env...)...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	fields := map[string]string{}
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "CHILD "); ok {
			for _, f := range strings.Fields(rest) {
				k, v, _ := strings.Cut(f, "=")
				fields[k] = v
			}
			break
		}
	}
	if fields["admin"] == "" {
		t.Fatalf("the child printed no CHILD line with its server (%v)", sc.Err())
	}
	return cmd, fields
}
