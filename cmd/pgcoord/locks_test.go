package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// scenario is what the tests of "pgcoord locks" and of the page hold: an
// election with its leader, a semaphore of limit 2 with both permits held
// and two acquires queued, a lock taken with a fence, and a chain of three
// backends, each waiting for the one before.
type scenario struct {
	db                 string
	leaderPID          int32
	term               pgcoord.Term
	holderPIDs         []int32 // of the semaphore's permits
	fence              pgcoord.Term
	chain              [3]*pgx.Conn // chain[i+1] waits for chain[i]
	chainPIDs          [3]int32
	first, second      pgcoord.Key // chain[0] holds first; chain[1] holds second and waits for first; chain[2] waits for second
	fenced             *pgcoord.Lock
	namesFile          string
	queued             int
	election, semaName string
}

// newScenario sets the scenario up in db (migrated here) and returns once
// pg_locks shows every lock and wait of it.
func newScenario(t *testing.T, db string) *scenario {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if err := pgcoord.Migrate(ctx, pgtest.Pool(t, db)); err != nil {
		t.Fatal(err)
	}
	s := &scenario{db: db, election: "scheduler", semaName: "exports",
		first: pgcoord.HashKey("chain", "first"), second: pgcoord.HashKey("chain", "second")}
	c := newClient(t, db)
	ld := campaign(t, c, s.election, "pod-1")
	s.term = ld.Term()
	info, err := c.Election(s.election).Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	s.leaderPID = info.PID

	// Two permits held by a client of their own, and two acquires of
	// another client queued: the head holds the queue key, the other
	// waits for it on the server.
	holders := newClient(t, db)
	for i := range 2 {
		p, err := holders.Semaphore(s.semaName, 2, pgcoord.WithIdentity(fmt.Sprintf("worker-%d", i+1))).Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = p.Release(context.Background()) })
	}
	hs, err := holders.Semaphore(s.semaName, 2).Holders(ctx)
	if err != nil || len(hs) != 2 {
		t.Fatalf("holders %v, %v", hs, err)
	}
	for _, h := range hs {
		s.holderPIDs = append(s.holderPIDs, h.PID)
	}
	for i := range 2 {
		waiter := newClient(t, db) // a client each: one server wait each
		wctx, stop := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			if p, err := waiter.Semaphore(s.semaName, 2, pgcoord.WithIdentity(fmt.Sprintf("queued-%d", i+1))).Acquire(wctx); err == nil {
				_ = p.Release(context.Background())
			}
		}()
		t.Cleanup(func() { stop(); <-done })
		s.queued++
		pgtest.Eventually(t, testTimeout, "the acquire queued on the semaphore", func() bool {
			return len(locksOf(t, db, semaphoreQueue(s.semaName))) == i+1
		})
	}

	// A lock taken with a fence.
	s.fenced, err = c.Lock(ctx, pgcoord.HashKey("invoice", "7"), pgcoord.WithFence())
	if err != nil {
		t.Fatal(err)
	}
	s.fence = s.fenced.Fence()
	t.Cleanup(func() { _ = s.fenced.Unlock(context.Background()) })

	// The chain: three plain connections.
	for i := range s.chain {
		s.chain[i] = pgtest.Conn(t, db)
		s.chainPIDs[i] = int32(s.chain[i].PgConn().PID())
	}
	execSQL(t, s.chain[0], "SELECT pg_advisory_lock($1)", mustInt64(s.first))
	execSQL(t, s.chain[1], "SELECT pg_advisory_lock($1)", mustInt64(s.second))
	waitIn(t, s.chain[1], mustInt64(s.first))
	pgtest.Eventually(t, testTimeout, "the second backend waiting", func() bool { return waiting(t, db, s.chainPIDs[1]) })
	waitIn(t, s.chain[2], mustInt64(s.second))
	pgtest.Eventually(t, testTimeout, "the third backend waiting", func() bool { return waiting(t, db, s.chainPIDs[2]) })

	s.namesFile = filepath.Join(t.TempDir(), "names")
	if err := os.WriteFile(s.namesFile, []byte("# the chain\nchain/first\n\nchain/second\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return s
}

// semaphoreQueue returns the queue key of the semaphore called name in the
// default schema.
func semaphoreQueue(name string) pgcoord.Key {
	return pgcoord.Int64Key(mustInt64(pgcoord.HashKey("pgcoord.semaphore", pgcoord.DefaultSchema, name))>>16<<16 | 0xffff)
}

// locksOf returns the rows of pg_locks for k.
func locksOf(t *testing.T, db string, k pgcoord.Key) []pgtest.AdvisoryLock {
	t.Helper()
	var out []pgtest.AdvisoryLock
	for _, l := range pgtest.AdvisoryLocks(t, db) {
		if got, _ := pgcoord.KeyFromLock(l.ClassID, l.ObjID, l.ObjSubID); got == k {
			out = append(out, l)
		}
	}
	return out
}

// waiting reports whether backend pid waits for an advisory lock.
func waiting(t *testing.T, db string, pid int32) bool {
	t.Helper()
	for _, l := range pgtest.AdvisoryLocks(t, db) {
		if l.PID == pid && !l.Granted {
			return true
		}
	}
	return false
}

func execSQL(t *testing.T, conn *pgx.Conn, sql string, args ...any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if _, err := conn.Exec(ctx, sql, args...); err != nil {
		t.Fatal(err)
	}
}

// waitIn starts a blocking pg_advisory_lock(key) on conn; the test's end
// cancels it if it still waits, and waits for it to return.
func waitIn(t *testing.T, conn *pgx.Conn, key int64) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = conn.Exec(ctx, "SELECT pg_advisory_lock($1)", key)
	}()
	t.Cleanup(func() { cancel(); <-done })
}

// A test of the built binary: "pgcoord locks" names an election's lock
// and guard, a semaphore's slots and queue, a fenced key with its fence,
// and the user's names from --name and --names-file (split at --sep);
// sorts by name, then
// mode; and "--waits" shows the chain of three backends in order.
func TestBinaryLocksNamesEveryKey(t *testing.T) {
	bin := buildCLI(t)
	db := pgtest.DB(t)
	s := newScenario(t, db)
	env := []string{"DATABASE_URL=" + db}

	r := exe(t, bin, env, "locks", "--names-file", s.namesFile, "--name", "invoice/7", "--sep", "/")
	if r.code != exitOK {
		t.Fatalf("locks: exit %d, %s", r.code, r.stderr)
	}
	t.Logf("pgcoord locks:\n%s", r.stdout)
	type row struct {
		name, mode, state string
		pid               int32
		fence             string
	}
	var rows []row
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if !strings.HasPrefix(lines[0], "LOCK ") {
		t.Fatalf("no header:\n%s", r.stdout)
	}
	for _, line := range lines[1:] {
		f := columns.Split(line, -1)
		if len(f) != 9 {
			t.Fatalf("row %q: %d columns, want 9", line, len(f))
		}
		pid, _ := strconv.Atoi(f[3])
		rows = append(rows, row{f[0], f[1], f[2], int32(pid), f[7]})
	}
	has := func(name, state string, pid int32) *row {
		for i := range rows {
			if rows[i].name == name && rows[i].state == state && (pid == 0 || rows[i].pid == pid) {
				return &rows[i]
			}
		}
		t.Errorf("no row %q %s by pid %d:\n%s", name, state, pid, r.stdout)
		return nil
	}
	if row := has("election scheduler", "held", s.leaderPID); row != nil && row.fence != strconv.Itoa(int(s.term)) {
		t.Errorf("election scheduler: fence %s, want the term %d", row.fence, s.term)
	}
	has("election scheduler guard", "held", 0)
	for i := range 2 {
		has(fmt.Sprintf("semaphore exports slot %d", i), "held", 0)
	}
	has("semaphore exports queue", "held", 0)
	has("semaphore exports queue", "waiting", 0)
	if row := has("invoice/7", "held", 0); row != nil && row.fence != strconv.Itoa(int(s.fence)) {
		t.Errorf("invoice/7: fence %s, want %d", row.fence, s.fence)
	}
	has("chain/first", "held", s.chainPIDs[0])
	has("chain/first", "waiting", s.chainPIDs[1])
	has("chain/second", "held", s.chainPIDs[1])
	has("chain/second", "waiting", s.chainPIDs[2])
	if len(rows) != len(pgtest.AdvisoryLocks(t, db)) {
		t.Errorf("%d rows, pg_locks has %d advisory locks", len(rows), len(pgtest.AdvisoryLocks(t, db)))
	}
	for _, row := range rows {
		if strings.HasPrefix(row.name, "int64:") {
			t.Errorf("a key without a name: %v", row)
		}
	}
	if !slices.IsSortedFunc(rows, func(a, b row) int { return strings.Compare(a.name+"\x00"+a.mode, b.name+"\x00"+b.mode) }) {
		t.Errorf("rows not sorted by name, then mode:\n%s", r.stdout)
	}

	// The JSON says what each key is.
	r = exe(t, bin, env, "locks", "--json")
	kinds := map[string]int{}
	for _, o := range jsonLines(t, r.stdout) {
		kind, _ := o["kind"].(string)
		kinds[kind]++
		if kind == kindSemaphoreSlot && (o["object"] != "exports" || o["slot"] == nil) {
			t.Errorf("slot without its semaphore or number: %v", o)
		}
	}
	if r.code != exitOK || kinds[kindElection] != 1 || kinds[kindElectionGuard] != 1 || kinds[kindSemaphoreSlot] != 2 || kinds[kindSemaphoreQ] != 2 {
		t.Errorf("locks --json: exit %d, kinds %v", r.code, kinds)
	}

	// --waits: the chain, in order, each one level below the backend it
	// waits for.
	r = exe(t, bin, env, "locks", "--waits", "--names-file", s.namesFile, "--sep", "/")
	t.Logf("pgcoord locks --waits:\n%s", r.stdout)
	if r.code != exitOK {
		t.Fatalf("locks --waits: exit %d, %s", r.code, r.stderr)
	}
	pat := fmt.Sprintf(`(?m)^pid %d(?: \(\S*\))?; holds chain/first\n(?:[│ ]  |[├└]─ )*└─ pid %d .*waits \S+ for chain/first \(exclusive\); holds chain/second\n   (?:[│ ]  )*└─ pid %d .*waits \S+ for chain/second \(exclusive\)$`,
		s.chainPIDs[0], s.chainPIDs[1], s.chainPIDs[2])
	if !regexp.MustCompile(pat).MatchString(r.stdout) {
		t.Errorf("locks --waits does not show the chain %v in order:\n%s", s.chainPIDs, r.stdout)
	}
	r = exe(t, bin, env, "locks", "--waits", "--json")
	var chain []string
	for _, o := range jsonLines(t, r.stdout) {
		for i, pid := range s.chainPIDs {
			if o["pid"] == float64(pid) {
				chain = append(chain, fmt.Sprintf("%d@%v", i, o["depth"]))
			}
		}
	}
	if want := []string{"0@0", "1@1", "2@2"}; !slices.Equal(chain, want) {
		t.Errorf("locks --waits --json: the chain's backends at %v, want %v:\n%s", chain, want, r.stdout)
	}
}

// Two backends that wait for each other, with the deadlock detector held
// off, show as a cycle in "pgcoord locks --waits", each backend once.
func TestBinaryLocksWaitsMarksCycles(t *testing.T) {
	bin := buildCLI(t)
	db := pgtest.DB(t)
	a, b := pgtest.Conn(t, db), pgtest.Conn(t, db)
	for _, c := range []*pgx.Conn{a, b} {
		execSQL(t, c, "SET deadlock_timeout = '1h'") // the test's role is a superuser
	}
	execSQL(t, a, "SELECT pg_advisory_lock(1)")
	execSQL(t, b, "SELECT pg_advisory_lock(2)")
	waitIn(t, a, 2)
	waitIn(t, b, 1)
	pa, pb := int32(a.PgConn().PID()), int32(b.PgConn().PID())
	pgtest.Eventually(t, testTimeout, "both backends waiting", func() bool { return waiting(t, db, pa) && waiting(t, db, pb) })
	t.Cleanup(func() { // end the cycle: cancel both waits
		admin := pgtest.Conn(t, db)
		execSQL(t, admin, "SELECT pg_cancel_backend(pid) FROM unnest($1::int4[]) AS pid", []int32{pa, pb})
	})
	r := exe(t, bin, []string{"DATABASE_URL=" + db}, "locks", "--waits")
	t.Logf("pgcoord locks --waits:\n%s", r.stdout)
	lo, hi := min(pa, pb), max(pa, pb)
	pat := fmt.Sprintf(`(?s)^pid %d(?: \(\S*\))? waits \S+ for int64:\d \(exclusive\); holds int64:\d\n└─ pid %d .*\n   └─ pid %d .*CYCLE`, lo, hi, lo)
	if r.code != exitOK || !regexp.MustCompile(pat).MatchString(r.stdout) {
		t.Errorf("locks --waits: exit %d; want the cycle %d -> %d -> %d marked:\n%s%s", r.code, lo, hi, lo, r.stdout, r.stderr)
	}
}

// A held lock's time in "locks --json" is no later than the moment the
// lock was taken, also for a session lock whose backend has since begun a
// transaction: it is the backend's start, not the transaction's.
func TestLocksSinceOfSessionLockInLaterTransaction(t *testing.T) {
	db := pgtest.DB(t)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	raw := pgtest.Conn(t, db)
	var takenBy, backendStart time.Time
	if err := raw.QueryRow(ctx, "SELECT pg_advisory_lock(5150) IS NOT NULL, clock_timestamp(), backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()").Scan(new(bool), &takenBy, &backendStart); err != nil {
		t.Fatal(err)
	}
	pgtest.AwaitClockPast(t, ctx, raw, takenBy, testTimeout)
	execSQL(t, raw, "BEGIN")
	execSQL(t, raw, "SELECT 1")
	defer execSQL(t, raw, "ROLLBACK")

	code, out, errOut := cli(t, db, "locks", "--json")
	if code != exitOK {
		t.Fatalf("locks --json: exit %d, %q", code, errOut)
	}
	found := false
	for _, row := range jsonLines(t, out) {
		if row["key"] != pgcoord.Int64Key(5150).String() || row["granted"] != true {
			continue
		}
		found = true
		since, err := time.Parse(time.RFC3339Nano, fmt.Sprint(row["since"]))
		if err != nil {
			t.Fatalf("since %v: %v", row["since"], err)
		}
		if since.After(takenBy) || !since.Equal(backendStart) {
			t.Errorf("the holder's since is %v; the lock was held by %v, its backend started at %v", since, takenBy, backendStart)
		}
	}
	if !found {
		t.Fatalf("no held row for int64:5150 in %s", out)
	}
}
