package pgtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// backendPID returns the process id of the server backend that runs q's
// next statement.
func backendPID(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (int32, error) {
	var pid int32
	// A parameter makes pgx send the statement through the extended
	// protocol in every exec mode but simple_protocol.
	err := q.QueryRow(ctx, "SELECT pg_backend_pid() + $1", 0).Scan(&pid)
	return pid, err
}

// txPID runs one transaction on conn and returns the backend it ran on.
func txPID(ctx context.Context, conn *pgx.Conn) (int32, error) {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return 0, err
	}
	pid, err := backendPID(ctx, tx)
	if err != nil {
		_ = tx.Rollback(ctx)
		return 0, err
	}
	return pid, tx.Commit(ctx)
}

func mustPID(t testing.TB, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) int32 {
	t.Helper()
	pid, err := backendPID(ctxT(t), q)
	if err != nil {
		t.Fatalf("pg_backend_pid: %v", err)
	}
	return pid
}

// adminRows runs an admin console command (SHOW POOLS, SHOW CONFIG) and
// returns its rows as column name -> text.
func adminRows(t testing.TB, admin *pgx.Conn, command string) []map[string]string {
	t.Helper()
	rows, err := admin.Query(ctxT(t), command)
	if err != nil {
		t.Fatalf("%s: %v", command, err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (map[string]string, error) {
		vals, err := row.Values()
		if err != nil {
			return nil, err
		}
		m := map[string]string{}
		for i, fd := range row.FieldDescriptions() {
			if vals[i] != nil {
				m[fd.Name] = fmt.Sprint(vals[i])
			}
		}
		return m, nil
	})
	if err != nil {
		t.Fatalf("%s: %v", command, err)
	}
	return out
}

// waitPoolExhausted waits until, in the pool of database dbname, one
// client waits for a server connection while all servers of the pool's
// connections are linked to clients and no new one is being opened: the
// client waits because the pool is full, not for a connection on its way.
func waitPoolExhausted(t testing.TB, admin *pgx.Conn, dbname string, servers int) {
	t.Helper()
	want := map[string]int{"cl_waiting": 1, "sv_active": servers, "sv_idle": 0, "sv_used": 0, "sv_tested": 0, "sv_login": 0}
	deadline := time.Now().Add(30 * time.Second)
	for pause := time.Millisecond; ; pause = min(2*pause, 20*time.Millisecond) {
		var pool map[string]string
		for _, row := range adminRows(t, admin, "SHOW POOLS") {
			if row["database"] == dbname {
				pool = row
			}
		}
		exhausted := pool != nil
		for col, n := range want {
			if !exhausted {
				break
			}
			got, err := strconv.Atoi(pool[col])
			if err != nil {
				t.Fatalf("SHOW POOLS: %s = %q: %v", col, pool[col], err)
			}
			exhausted = got == n
		}
		if exhausted {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no client of %s waited for one of %d busy server connections within 30s; SHOW POOLS: %v", dbname, servers, pool)
		}
		time.Sleep(pause)
	}
}

type pidResult struct {
	pid int32
	err error
}

// receive waits for the result of a goroutine, at most a minute.
func receive(t testing.TB, ch <-chan pidResult, what string) int32 {
	t.Helper()
	select {
	case r := <-ch:
		if r.err != nil {
			t.Fatalf("%s: %v", what, r.err)
		}
		return r.pid
	case <-time.After(time.Minute):
		t.Fatalf("%s: no result within a minute", what)
		return 0
	}
}

// In transaction mode with a pool of two, a client's next transaction runs
// on whichever server connection is free: with the one its last transaction
// used held by another client, on the other one. A third transaction waits
// while both are held.
func TestPgBouncerTransactionModeMovesClient(t *testing.T) {
	t.Parallel()
	cs := DB(t)
	b := NewPgBouncer(t, cs, TransactionPooling, WithPoolSize(2))
	ctx := ctxT(t)
	admin := Conn(t, b.AdminConnString())
	a := Conn(t, b.ConnString())

	p1, err := txPID(ctx, a)
	if err != nil {
		t.Fatalf("first transaction: %v", err)
	}

	// Two other clients fill the pool; one of them holds p1.
	var txs [2]pgx.Tx
	var pids [2]int32
	for i := range txs {
		tx, err := Conn(t, b.ConnString()).Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_ = tx.Rollback(ctx)
		})
		txs[i], pids[i] = tx, mustPID(t, tx)
	}
	if pids[0] == pids[1] {
		t.Fatalf("two open transactions share backend %d", pids[0])
	}
	holder := map[int32]int{pids[0]: 0, pids[1]: 1}[p1]
	if pids[holder] != p1 {
		t.Fatalf("the pool of two holds backends %v, not %d of the first transaction", pids, p1)
	}
	other := 1 - holder

	next := make(chan pidResult, 1)
	go func() {
		pid, err := txPID(ctx, a)
		next <- pidResult{pid, err}
	}()
	waitPoolExhausted(t, admin, dbOf(t, cs), 2)
	if err := txs[other].Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	p2 := receive(t, next, "second transaction")
	if p2 == p1 {
		t.Fatalf("both transactions ran on backend %d, held by another client", p1)
	}
	if p2 != pids[other] {
		t.Fatalf("second transaction ran on backend %d, want %d, the one freed", p2, pids[other])
	}

	// Both are backends of the database, seen from the server.
	direct := Conn(t, cs)
	var n int
	if err := direct.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1) AND datname = current_database()", []int32{p1, p2}).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 2 {
		t.Fatalf("%d of backends %d and %d are in pg_stat_activity of the database, want 2", n, p1, p2)
	}
}

// In session mode a client keeps its backend across statements and
// transactions while another client works beside it, and pgx's cached
// prepared statements work.
func TestPgBouncerSessionModeKeepsBackend(t *testing.T) {
	t.Parallel()
	cs := DB(t)
	b := NewPgBouncer(t, cs, SessionPooling, WithPoolSize(2))
	ctx := ctxT(t)
	cfg, err := pgx.ParseConfig(b.ConnString())
	if err != nil {
		t.Fatal(err)
	}
	if cfg.DefaultQueryExecMode != pgx.QueryExecModeCacheStatement {
		t.Fatalf("session mode connection string sets exec mode %v", cfg.DefaultQueryExecMode)
	}
	a, other := Conn(t, b.ConnString()), Conn(t, b.ConnString())
	pid := mustPID(t, a)
	otherPID := mustPID(t, other)
	if otherPID == pid {
		t.Fatalf("two sessions share backend %d", pid)
	}
	for i := range 5 {
		if got, err := txPID(ctx, other); err != nil || got != otherPID {
			t.Fatalf("round %d: other client's transaction: backend %d, %v; want %d", i, got, err, otherPID)
		}
		if got := mustPID(t, a); got != pid {
			t.Fatalf("round %d: statement ran on backend %d, want %d", i, got, pid)
		}
		if got, err := txPID(ctx, a); err != nil || got != pid {
			t.Fatalf("round %d: transaction: backend %d, %v; want %d", i, got, err, pid)
		}
	}
}

// With a pool of one in session mode, a second client waits until the first
// disconnects and then gets its backend; the settings of the options are in
// force.
func TestPgBouncerPoolSizeOne(t *testing.T) {
	t.Parallel()
	cs := DB(t)
	b := NewPgBouncer(t, cs, SessionPooling, WithPoolSize(1), WithPgBouncerSetting("server_idle_timeout", "17"))
	ctx := ctxT(t)
	admin := Conn(t, b.AdminConnString())
	config := map[string]string{}
	for _, row := range adminRows(t, admin, "SHOW CONFIG") {
		config[row["key"]] = row["value"]
	}
	for key, want := range map[string]string{"pool_mode": "session", "default_pool_size": "1", "server_idle_timeout": "17", "listen_port": strconv.Itoa(b.Port())} {
		if config[key] != want {
			t.Errorf("SHOW CONFIG: %s = %q, want %q", key, config[key], want)
		}
	}

	first, err := connect(b.ConnString())
	if err != nil {
		t.Fatal(err)
	}
	defer closeConn(first)
	pid := mustPID(t, first)

	second := make(chan pidResult, 1)
	go func() {
		conn, err := connect(b.ConnString())
		if err != nil {
			second <- pidResult{0, err}
			return
		}
		defer closeConn(conn)
		pid, err := backendPID(ctx, conn)
		second <- pidResult{pid, err}
	}()
	waitPoolExhausted(t, admin, dbOf(t, cs), 1)
	closeConn(first)
	if got := receive(t, second, "second client"); got != pid {
		t.Fatalf("second client ran on backend %d, want %d, the pool's only one", got, pid)
	}
}

// PgBouncer is gone, and its directory removed, once its test has ended.
func TestPgBouncerStopsAtCleanup(t *testing.T) {
	t.Parallel()
	cs := DB(t)
	var pid int
	var root, bouncerCS string
	t.Run("user", func(t *testing.T) {
		b := NewPgBouncer(t, cs, TransactionPooling)
		pid, root, bouncerCS = b.proc.cmd.Process.Pid, b.root, b.ConnString()
		if !queryBool(t, Conn(t, bouncerCS), "SELECT true") {
			t.Fatal("no answer through PgBouncer")
		}
	})
	if alive(pid) {
		t.Fatalf("pgbouncer %d still runs after its test", pid)
	}
	if _, err := os.Stat(root); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("directory %s not removed: %v", root, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if conn, err := pgx.Connect(ctx, bouncerCS); err == nil {
		closeConn(conn)
		t.Fatal("connected through a stopped PgBouncer")
	}
}

// Without the binary, NewPgBouncer fails, saying how to install it.
func TestPgBouncerMissingBinary(t *testing.T) {
	t.Setenv("PGTEST_PGBOUNCER", filepath.Join(t.TempDir(), "pgbouncer"))
	_, err := startPgBouncer("postgres://postgres@127.0.0.1:1/x?sslmode=disable", TransactionPooling, nil)
	if err == nil || !strings.Contains(err.Error(), "apt-get install pgbouncer") {
		t.Fatalf("error = %v, want one saying apt-get install pgbouncer", err)
	}
}

// NewPgBouncer refuses arguments and options that cannot work, and fails
// with PgBouncer's reason on a setting PgBouncer rejects.
func TestPgBouncerOptionsSayNo(t *testing.T) {
	t.Parallel()
	const cs = "postgres://postgres@127.0.0.1:1/x?sslmode=disable"
	for _, tc := range []struct {
		mode string
		opts []PgBouncerOption
		want string
	}{
		{"pooled", nil, `pool mode "pooled"`},
		{TransactionPooling, []PgBouncerOption{WithPoolSize(0)}, "must be positive"},
		{TransactionPooling, []PgBouncerOption{WithPoolSize(2), WithPoolSize(3)}, "already 2"},
		{TransactionPooling, []PgBouncerOption{WithPgBouncerSetting("pool_mode", "session")}, "pgtest sets pool_mode itself"},
		{TransactionPooling, []PgBouncerOption{WithPgBouncerSetting("Listen_Port", "1")}, "pgtest sets listen_port itself"},
		{TransactionPooling, []PgBouncerOption{WithPgBouncerSetting("server idle", "1")}, "not a setting name"},
		{TransactionPooling, []PgBouncerOption{WithPgBouncerSetting("server_idle_timeout", "1\nlisten_port = 1")}, "spans lines"},
		{TransactionPooling, []PgBouncerOption{WithPgBouncerSetting("server_idle_timeout", "1"), WithPgBouncerSetting("server_idle_timeout", "2")}, `already set to "1"`},
		{TransactionPooling, []PgBouncerOption{nil}, "nil option"},
	} {
		b, err := startPgBouncer(cs, tc.mode, tc.opts)
		if err == nil {
			_ = b.close()
			t.Errorf("%s %v: no error, want one with %q", tc.mode, tc.opts, tc.want)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "pgcoord: pgtest: ") {
			t.Errorf("%s: %v, want pgcoord: pgtest: ... %s", tc.mode, err, tc.want)
		}
	}

	b, err := startPgBouncer(DB(t), TransactionPooling, []PgBouncerOption{WithPgBouncerSetting("server_idle_timeout", "soon")})
	if err == nil {
		_ = b.close()
		t.Fatal("PgBouncer started with server_idle_timeout=soon")
	}
	if !strings.Contains(err.Error(), "server_idle_timeout") {
		t.Fatalf("error lacks PgBouncer's reason: %v", err)
	}
}

// A test binary that dies with a PgBouncer running takes it with it
// (parent-death signal), and the directory it leaves is removed by the next
// sweep.
func TestPgBouncerDiesWithTestBinary(t *testing.T) {
	if _, err := getLocal(); errors.Is(err, errNoBinaries) {
		SkipOrFail(t, "this test needs local PostgreSQL binaries (Debian: apt-get install postgresql): %v", err)
	} else if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), orphanEnv+"=pgbouncer")
	out, err := cmd.Output()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 {
		t.Fatalf("child: want a panic (exit 2), got %v; output:\n%s", err, out)
	}
	var serverPID, bouncerPID int
	var serverRoot, bouncerRoot string
	for _, line := range strings.Split(string(out), "\n") {
		if _, err := fmt.Sscanf(line, "server %d %s", &serverPID, &serverRoot); err == nil {
			continue
		}
		_, _ = fmt.Sscanf(line, "pgbouncer %d %s", &bouncerPID, &bouncerRoot)
	}
	if serverPID == 0 || bouncerPID == 0 || !strings.HasPrefix(filepath.Base(bouncerRoot), dirPrefix) {
		t.Fatalf("child printed no server and PgBouncer:\n%s", out)
	}
	t.Cleanup(func() {
		_ = os.RemoveAll(serverRoot)
		_ = os.RemoveAll(bouncerRoot)
	})
	Eventually(t, 30*time.Second, "orphaned pgbouncer to exit", func() bool { return !alive(bouncerPID) })
	Eventually(t, 30*time.Second, "orphaned postmaster to exit", func() bool { return !alive(serverPID) })
	Eventually(t, 30*time.Second, "orphaned backends to exit", func() bool {
		pids, err := clusterProcesses(filepath.Join(serverRoot, dataDir))
		return err == nil && len(pids) == 0
	})
	removeStale(filepath.Dir(bouncerRoot))
	if _, err := os.Stat(bouncerRoot); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("stale directory %s not removed: %v", bouncerRoot, err)
	}
}
