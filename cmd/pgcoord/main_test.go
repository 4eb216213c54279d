package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const testTimeout = 60 * time.Second

// columns splits a row of a table that pgcoord prints: its columns are
// two or more spaces apart, and a name may hold single spaces.
var columns = regexp.MustCompile(`\s{2,}`)

// syncBuffer is a bytes.Buffer that a running command writes while the
// test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// cli runs the command line in-process with DATABASE_URL set to db and
// returns its exit code, stdout and stderr.
func cli(t *testing.T, db string, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	var out, errOut syncBuffer
	code := run(ctx, args, func(name string) string {
		if name == "DATABASE_URL" {
			return db
		}
		return ""
	}, &out, &errOut)
	return code, out.String(), errOut.String()
}

// startDemo runs "pgcoord demo" until the test ends, and returns once its
// locks, and the wait for demo/report, show in pg_locks.
func startDemo(t *testing.T, db string) *syncBuffer {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := &syncBuffer{}
	done := make(chan int, 1)
	go func() { done <- run(ctx, []string{"--db", db, "demo"}, func(string) string { return "" }, out, out) }()
	t.Cleanup(func() {
		cancel()
		select {
		case code := <-done:
			if code != exitOK {
				t.Errorf("demo exited with %d:\n%s", code, out)
			}
		case <-time.After(testTimeout):
			t.Errorf("demo did not end in time")
		}
	})
	pgtest.Eventually(t, testTimeout, "the demo's locks and wait in pg_locks", func() bool {
		select {
		case code := <-done:
			t.Fatalf("demo exited early with %d:\n%s", code, out)
		default:
		}
		waits := 0
		locks := pgtest.AdvisoryLocks(t, db)
		for _, l := range locks {
			if !l.Granted {
				waits++
			}
		}
		return len(locks) == 6 && waits == 1
	})
	return out
}

func TestUsageAndHelp(t *testing.T) {
	for _, tc := range []struct {
		args []string
		db   string
		code int
		out  string // in stdout
		err  string // in stderr
	}{
		{nil, "", exitUsage, "", "Usage:"},
		{[]string{"help"}, "", exitOK, "Exit codes:", ""},
		{[]string{"-h"}, "", exitOK, "Commands:", ""},
		{[]string{"locks", "-h"}, "", exitOK, "--json", ""},
		{[]string{"nope"}, "", exitUsage, "", `unknown command "nope"`},
		{[]string{"--bogus"}, "", exitUsage, "", "bogus"},
		{[]string{"locks", "--bogus"}, "", exitUsage, "", "locks: flag provided but not defined: --bogus"},
		{[]string{"locks", "--json", "extra", "--name", "x"}, "postgres://x", exitUsage, "", "takes no arguments"},
		{[]string{"help", "nope"}, "", exitUsage, "", `unknown command "nope"`},
		{[]string{"help", "locks"}, "", exitOK, "Usage: pgcoord locks", ""},
		{[]string{"key", "--sep"}, "", exitUsage, "", "flag needs an argument: --sep"},
		{[]string{"locks", "--json=maybe"}, "", exitUsage, "", "invalid value"},
		{[]string{"locks", "extra"}, "postgres://x", exitUsage, "", "takes no arguments"},
		{[]string{"release"}, "postgres://x", exitUsage, "", "--pid"},
		{[]string{"release", "--pid", "x"}, "postgres://x", exitUsage, "", "invalid value"},
		{[]string{"key"}, "", exitUsage, "", "at least one NAME"},
		{[]string{"--db", "::not a url", "locks"}, "", exitUsage, "", "bad database URL"},
	} {
		code, out, errOut := cli(t, tc.db, tc.args...)
		if code != tc.code || !strings.Contains(out, tc.out) || !strings.Contains(errOut, tc.err) {
			t.Errorf("pgcoord %q: exit %d, stdout %q, stderr %q; want exit %d, %q in stdout, %q in stderr",
				tc.args, code, out, errOut, tc.code, tc.out, tc.err)
		}
		if tc.code != exitOK && !strings.HasPrefix(errOut, "pgcoord: ") && tc.args != nil {
			t.Errorf("pgcoord %q: stderr %q should start with \"pgcoord: \"", tc.args, errOut)
		}
	}
	// Every command of the table is in the help.
	_, out, _ := cli(t, "", "help")
	for _, c := range commands {
		if !strings.Contains(out, "  "+c.name+" ") {
			t.Errorf("help does not list %s:\n%s", c.name, out)
		}
	}
	// An unreachable database is a failure, not a usage error.
	if code, _, errOut := cli(t, "postgres://127.0.0.1:1/x?connect_timeout=5", "locks"); code != exitFailure || !strings.HasPrefix(errOut, "pgcoord: ") {
		t.Errorf("unreachable database: exit %d, %q", code, errOut)
	}
}

func TestKey(t *testing.T) {
	code, out, _ := cli(t, "", "key", "--sep", "/", "report/daily", "demo/report")
	if code != exitOK {
		t.Fatalf("exit %d", code)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "NAME") {
		t.Fatalf("output:\n%s", out)
	}
	for i, k := range []pgcoord.Key{pgcoord.HashKey("report", "daily"), pgcoord.HashKey("demo", "report")} {
		v, _ := k.Int64()
		want := fmt.Sprintf("%s %d %d 1", k, uint32(uint64(v)>>32), uint32(v))
		if got := strings.Join(strings.Fields(lines[i+1])[1:], " "); got != want {
			t.Errorf("line %d: %q, want %q", i+1, got, want)
		}
	}
	_, out, _ = cli(t, "", "key", "demo/report")
	if !strings.Contains(out, pgcoord.HashKey("demo/report").String()) {
		t.Errorf("without --sep the whole name is one part:\n%s", out)
	}
}

// "pgcoord locks" shows what pg_locks has, with the demo's names, as a
// table and as JSON.
func TestLocksCommand(t *testing.T) {
	db := pgtest.DB(t)
	if code, out, errOut := cli(t, db, "locks"); code != exitOK || !strings.Contains(out, "no advisory locks") {
		t.Fatalf("no locks: exit %d, %q, %q", code, out, errOut)
	}
	startDemo(t, db)
	conn := pgtest.Conn(t, db)
	if _, err := conn.Exec(context.Background(), "SELECT pg_advisory_lock(42)"); err != nil {
		t.Fatal(err)
	}

	code, out, errOut := cli(t, db, "locks", "--name", "answer")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	t.Logf("pgcoord locks:\n%s", out)
	// One row per pg_locks row: key, mode, state and pid agree.
	type row struct{ key, mode, state, pid string }
	var got []row
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Scan() // header
	if !strings.HasPrefix(sc.Text(), "LOCK") {
		t.Fatalf("no header:\n%s", out)
	}
	waiters := map[string]string{}
	for sc.Scan() {
		f := columns.Split(sc.Text(), -1)
		if len(f) != 9 {
			t.Fatalf("short row %q", sc.Text())
		}
		got = append(got, row{f[0], f[1], f[2], f[3]})
		if f[2] == "held" {
			waiters[f[0]] = f[len(f)-1]
		}
	}
	names := map[pgcoord.Key]string{}
	for _, n := range demoKeys {
		names[pgcoord.HashKey(n)] = n
	}
	var want []row
	for _, l := range pgtest.AdvisoryLocks(t, db) {
		k, err := pgcoord.KeyFromLock(l.ClassID, l.ObjID, l.ObjSubID)
		if err != nil {
			t.Fatal(err)
		}
		name, ok := names[k]
		if !ok {
			name = k.String()
		}
		mode, state := "exclusive", "waiting"
		if l.Mode == "ShareLock" {
			mode = "shared"
		}
		if l.Granted {
			state = "held"
		}
		want = append(want, row{name, mode, state, strconv.Itoa(int(l.PID))})
	}
	cmpRow := func(a, b row) int { return strings.Compare(fmt.Sprint(a), fmt.Sprint(b)) }
	slices.SortFunc(got, cmpRow)
	slices.SortFunc(want, cmpRow)
	if !slices.Equal(got, want) {
		t.Errorf("rows %v\npg_locks %v", got, want)
	}
	if waiters["demo/report"] != "1" || waiters["demo/cache"] != "0" {
		t.Errorf("waiters: %v", waiters)
	}
	if !strings.Contains(out, "int64:42") || !regexp.MustCompile(`demo/report +exclusive +held +\d+ +pgcoord +127\.0\.0\.1:\d+ +<=\S+ +- +1`).MatchString(out) {
		t.Errorf("unexpected table:\n%s", out)
	}

	code, out, _ = cli(t, db, "locks", "--json")
	if code != exitOK {
		t.Fatalf("--json: exit %d", code)
	}
	n := 0
	dec := json.NewDecoder(strings.NewReader(out))
	for dec.More() {
		var j lockRow
		if err := dec.Decode(&j); err != nil {
			t.Fatal(err)
		}
		if j.Key.IsZero() || j.PID == 0 || (j.Name == "" && j.Key != pgcoord.Int64Key(42)) {
			t.Errorf("--json: %+v", j)
		}
		n++
	}
	if n != len(want) {
		t.Errorf("--json: %d objects, want %d", n, len(want))
	}
}

// "pgcoord release" refuses a backend that is not pgcoord's unless forced,
// and frees the locks of the backend it terminates.
func TestRelease(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	startDemo(t, db)
	conn := pgtest.Conn(t, db)
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock(42)"); err != nil {
		t.Fatal(err)
	}
	foreign := strconv.Itoa(int(conn.PgConn().PID()))
	code, _, errOut := cli(t, db, "release", "--pid", foreign)
	if code != exitFailure || !strings.Contains(errOut, "--force") || !strings.Contains(errOut, "not a pgcoord backend") {
		t.Fatalf("release of a foreign backend: exit %d, %q", code, errOut)
	}
	if holders := holdersOf(t, db, pgcoord.Int64Key(42)); len(holders) != 1 {
		t.Fatalf("after a refused release: holders %v", holders)
	}
	code, out, errOut := cli(t, db, "release", "--pid", foreign, "--force")
	if code != exitOK || !strings.Contains(out, "released: int64:42 (exclusive)") {
		t.Fatalf("release --force: exit %d, %q, %q", code, out, errOut)
	}
	if holders := holdersOf(t, db, pgcoord.Int64Key(42)); len(holders) != 0 {
		t.Fatalf("after release --force: holders %v", holders)
	}

	// The demo's backend that holds demo/report: no --force needed, and
	// the demo's waiting client takes the key.
	report := pgcoord.HashKey("demo/report")
	holders := holdersOf(t, db, report)
	if len(holders) != 1 {
		t.Fatalf("demo/report held by %v", holders)
	}
	code, out, errOut = cli(t, db, "release", "--pid", strconv.Itoa(int(holders[0])))
	if code != exitOK || !strings.Contains(out, "demo/report (exclusive)") {
		t.Fatalf("release of the demo's backend: exit %d, %q, %q", code, out, errOut)
	}
	pgtest.Eventually(t, testTimeout, "the demo's waiter to take demo/report", func() bool {
		h := holdersOf(t, db, report)
		return len(h) == 1 && h[0] != holders[0]
	})

	if code, _, errOut := cli(t, db, "release", "--pid", "2147483000"); code != exitFailure || !strings.Contains(errOut, "no backend") {
		t.Errorf("release of no backend: exit %d, %q", code, errOut)
	}

	// A bad --app is a usage error, found before anything is connected
	// or terminated.
	for _, app := range []string{"", strings.Repeat("a", 64)} {
		code, out, errOut := cli(t, db, "release", "--pid", foreign, "--app", app)
		if code != exitUsage || !strings.Contains(errOut, "--app must be") || out != "" {
			t.Errorf("release --app %q: exit %d, %q, %q; want %d and a message about --app", app, code, out, errOut, exitUsage)
		}
	}
}

// The commands that read pgcoord's tables wait for a lock on one of them
// for readLockTimeout, then fail with a message that says what holds them
// up, instead of waiting unseen while another session holds the table
// (here a LOCK TABLE, as an ALTER TABLE or a VACUUM FULL would); migrate,
// which must have its locks, waits.
func TestReadCommandsGiveUpOnLockedTables(t *testing.T) {
	db := pgtest.DB(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*testTimeout)
	defer cancel()
	if code, _, errOut := cli(t, db, "migrate"); code != exitOK {
		t.Fatalf("migrate: exit %d, %q", code, errOut)
	}
	locker := pgtest.Conn(t, db)
	execSQL(t, locker, "BEGIN")
	execSQL(t, locker, "LOCK TABLE "+pgcoord.DefaultSchema+".leaders, "+pgcoord.DefaultSchema+".semaphores IN ACCESS EXCLUSIVE MODE")
	var wg sync.WaitGroup
	for _, args := range [][]string{{"locks"}, {"elections"}, {"leader", "jobs"}, {"semaphores"}} {
		wg.Go(func() { readWhileLocked(t, db, args) })
	}
	wg.Wait()

	// migrate waits for its table until the lock is gone.
	execSQL(t, locker, "ROLLBACK")
	execSQL(t, locker, "BEGIN")
	execSQL(t, locker, "LOCK TABLE "+pgcoord.DefaultSchema+".schema_version IN ACCESS EXCLUSIVE MODE")
	done := make(chan int, 1)
	go func() {
		code, _, _ := cli(t, db, "migrate")
		done <- code
	}()
	watch := pgtest.Conn(t, db)
	pgtest.Eventually(t, testTimeout, "migrate to wait for the locked table", func() bool {
		var n int
		err := watch.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
			WHERE NOT l.granted AND l.locktype = 'relation' AND a.application_name = 'pgcoord-cli'`).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n > 0
	})
	execSQL(t, locker, "ROLLBACK")
	select {
	case code := <-done:
		if code != exitOK {
			t.Errorf("migrate after the lock was gone: exit %d", code)
		}
	case <-ctx.Done():
		t.Fatal("migrate did not return after the lock was gone")
	}
}

// readWhileLocked runs the read command args, which must give up on a
// locked table of pgcoord's after readLockTimeout, saying why.
func readWhileLocked(t *testing.T, db string, args []string) {
	t.Helper()
	start := time.Now()
	code, out, errOut := cli(t, db, args...)
	took := time.Since(start)
	if code != exitFailure || !strings.Contains(errOut, "lock timeout") || !strings.Contains(errOut, "another session holds a lock on one of pgcoord's tables") {
		t.Errorf("%v while pgcoord's tables are locked: exit %d after %v, %q, %q; want %d and a message that says why",
			args, code, took.Round(time.Millisecond), out, errOut, exitFailure)
	}
	if took < readLockTimeout {
		t.Errorf("%v gave up after %v, before its lock timeout of %v", args, took.Round(time.Millisecond), readLockTimeout)
	}
}

// holdersOf returns the pids that hold k in pg_locks.
func holdersOf(t *testing.T, db string, k pgcoord.Key) []int32 {
	t.Helper()
	var pids []int32
	for _, l := range pgtest.AdvisoryLocks(t, db) {
		if got, _ := pgcoord.KeyFromLock(l.ClassID, l.ObjID, l.ObjSubID); got == k && l.Granted {
			pids = append(pids, l.PID)
		}
	}
	return pids
}

func TestMigrate(t *testing.T) {
	db := pgtest.DB(t)
	ups, err := fs.Glob(pgcoord.Migrations(), "*.up.sql")
	if err != nil || len(ups) == 0 {
		t.Fatalf("embedded migrations: %v, %d up files", err, len(ups))
	}
	// migrate says what it did: created the tables, then nothing.
	for _, want := range []string{
		fmt.Sprintf("created pgcoord's tables in schema \"pgcoord\" at version %d\n", len(ups)),
		fmt.Sprintf("schema \"pgcoord\" is already at version %d; nothing to do\n", len(ups)),
	} {
		code, out, errOut := cli(t, db, "migrate")
		if code != exitOK || out != want {
			t.Fatalf("migrate: exit %d, %q, %q; want %q", code, out, errOut, want)
		}
	}
	code, out, _ := cli(t, db, "migrate", "--schema", "other")
	if code != exitOK || !strings.Contains(out, `"other"`) {
		t.Fatalf("migrate --schema: exit %d, %q", code, out)
	}
	conn := pgtest.Conn(t, db)
	var n int
	if err := conn.QueryRow(context.Background(), "SELECT count(*) FROM other.fences").Scan(&n); err != nil {
		t.Fatal(err)
	}
}

func TestLeaderCommand(t *testing.T) {
	db := pgtest.DB(t)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if code, _, stderr := cli(t, db, "migrate"); code != exitOK {
		t.Fatalf("migrate: exit %d: %s", code, stderr)
	}
	if code, _, stderr := cli(t, db, "leader", "cron"); code != exitNone || !strings.Contains(stderr, "no leader") {
		t.Fatalf("leader with nobody leading: exit %d, stderr %q; want %d and \"no leader\"", code, stderr, exitNone)
	}
	if code, _, _ := cli(t, db, "leader"); code != exitUsage {
		t.Fatalf("leader without a name: exit %d, want %d", code, exitUsage)
	}

	c, err := pgcoord.New(pgtest.Pool(t, db))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	ld, err := c.Election("cron", pgcoord.WithIdentity("pod-7")).Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	info, err := c.Election("cron").Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := cli(t, db, "leader", "--json", "cron")
	if code != exitOK {
		t.Fatalf("leader --json: exit %d: %s", code, stderr)
	}
	var got struct {
		Identity string `json:"identity"`
		Term     int64  `json:"term"`
		PID      int32  `json:"pid"`
	}
	if err := json.Unmarshal([]byte(stdout), &got); err != nil {
		t.Fatalf("leader --json output %q: %v", stdout, err)
	}
	if got.Identity != "pod-7" || got.Term != int64(ld.Term()) || got.PID != info.PID {
		t.Fatalf("leader --json = %+v, want pod-7, term %d, pid %d", got, ld.Term(), info.PID)
	}
	code, stdout, stderr = cli(t, db, "leader", "--resign", "cron")
	if code != exitOK || !strings.Contains(stdout, "pod-7") || !strings.Contains(stdout, "asked term") {
		t.Fatalf("leader --resign: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	select {
	case <-ld.Done():
	case <-ctx.Done():
		t.Fatal("the leader did not step down after leader --resign")
	}
	if holders := holdersOf(t, db, c.Election("cron").Key()); len(holders) != 0 {
		t.Fatalf("election lock still held by %v after the resign", holders)
	}
}

func TestSemaphoresCommand(t *testing.T) {
	db := pgtest.DB(t)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if code, _, stderr := cli(t, db, "migrate"); code != exitOK {
		t.Fatalf("migrate: exit %d: %s", code, stderr)
	}
	c, err := pgcoord.New(pgtest.Pool(t, db))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	sem := c.Semaphore("exports", 2, pgcoord.WithIdentity("worker-1"))
	p1, err := sem.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer p1.Release(ctx)
	p2, err := c.Semaphore("idle", 5).TryAcquire(ctx) // creates its row
	if err != nil {
		t.Fatal(err)
	}
	if err := p2.Release(ctx); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := cli(t, db, "semaphores", "--json", "--holders")
	if code != exitOK {
		t.Fatalf("semaphores --json: exit %d: %s", code, stderr)
	}
	var got []semaphoreRow
	for _, line := range strings.Split(strings.TrimSpace(stdout), "\n") {
		var s semaphoreRow
		if err := json.Unmarshal([]byte(line), &s); err != nil {
			t.Fatalf("semaphores --json line %q: %v", line, err)
		}
		got = append(got, s)
	}
	hs, err := sem.Holders(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Name != "exports" || got[0].Limit != 2 || got[0].Held != 1 || got[0].Queued != 0 ||
		len(got[0].Holders) != 1 || got[0].Holders[0].Identity != "worker-1" || got[0].Holders[0].PID != hs[0].PID ||
		got[1].Name != "idle" || got[1].Limit != 5 || got[1].Held != 0 {
		t.Fatalf("semaphores --json = %+v", got)
	}
	code, stdout, _ = cli(t, db, "semaphores")
	if code != exitOK || !strings.Contains(stdout, "exports") || !strings.Contains(stdout, "SEMAPHORE") {
		t.Fatalf("semaphores: exit %d, output %q", code, stdout)
	}
}

// Two applications in one database, each with its own schema, lead
// elections and hold semaphores of the same names; each command given a
// schema finds that schema's leader and permits, on their own keys.
func TestCommandsPerSchema(t *testing.T) {
	db := pgtest.DB(t)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	pids := map[string]int32{}
	for _, schema := range []string{"app_a", "app_b"} {
		if code, _, stderr := cli(t, db, "migrate", "--schema", schema); code != exitOK {
			t.Fatalf("migrate --schema %s: exit %d: %s", schema, code, stderr)
		}
		c, err := pgcoord.New(pgtest.Pool(t, db), pgcoord.WithSchema(schema))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(context.Background())
		ld, err := c.Election("sched", pgcoord.WithIdentity(schema)).Campaign(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer ld.Resign(ctx)
		p, err := c.Semaphore("jobs", 1).TryAcquire(ctx)
		if err != nil {
			t.Fatalf("schema %s: TryAcquire: %v", schema, err)
		}
		defer p.Release(ctx)
		info, err := c.Election("sched").Leader(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pids[schema] = info.PID
	}
	for _, schema := range []string{"app_a", "app_b"} {
		code, stdout, stderr := cli(t, db, "leader", "--schema", schema, "--json", "sched")
		var got leaderJSON
		if code != exitOK || json.Unmarshal([]byte(stdout), &got) != nil {
			t.Fatalf("leader --schema %s: exit %d, stdout %q, stderr %q", schema, code, stdout, stderr)
		}
		if got.Identity != schema || got.PID != pids[schema] {
			t.Errorf("leader --schema %s = %+v, want identity %s on backend %d", schema, got, schema, pids[schema])
		}
		code, stdout, stderr = cli(t, db, "elections", "--schema", schema, "--json")
		var el electionJSON
		if code != exitOK || json.Unmarshal([]byte(stdout), &el) != nil || !el.Leading || el.Identity != schema {
			t.Errorf("elections --schema %s: exit %d, stdout %q, stderr %q; want %s leading", schema, code, stdout, stderr, schema)
		}
		code, stdout, stderr = cli(t, db, "semaphores", "--schema", schema, "--json")
		var sem semaphoreRow
		if code != exitOK || json.Unmarshal([]byte(stdout), &sem) != nil || sem.Name != "jobs" || sem.Held != 1 {
			t.Errorf("semaphores --schema %s: exit %d, stdout %q, stderr %q; want jobs with 1 permit held", schema, code, stdout, stderr)
		}
	}
}
