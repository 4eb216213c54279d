package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// Locks reports holders (one exclusive, two shared on another key) and a
// waiter with their modes, backends, application names, names and times,
// exactly the rows pg_locks has.
func TestLocks(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	start := time.Now()
	a := newTestClient(t, dsn, WithApplicationName("holder-a"))
	b := newTestClient(t, dsn, WithApplicationName("holder-b"))
	w := newTestClient(t, dsn, WithApplicationName("waiter"))
	job, cache, unnamed := HashKey("job"), PairKey(7, -7), Int64Key(-3)
	x := newTestClient(t, dsn, WithKeyNames(map[Key]string{job: "job", cache: "cache"}))

	ex, err := a.Lock(ctx, job)
	if err != nil {
		t.Fatal(err)
	}
	sa, err := a.RLock(ctx, cache)
	if err != nil {
		t.Fatal(err)
	}
	sb, err := b.RLock(ctx, cache)
	if err != nil {
		t.Fatal(err)
	}
	other, err := b.TryLock(ctx, unnamed)
	if err != nil {
		t.Fatal(err)
	}
	waiting := goLock(func() (*Lock, error) { return w.Lock(ctx, job) })
	pgtest.Eventually(t, testTimeout, "the waiter to show in pg_locks", func() bool { return waitingOn(t, dsn, job) == 1 })

	got, err := x.Locks(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// The same rows as pg_locks, read separately.
	type row struct {
		k       Key
		pid     int32
		shared  bool
		granted bool
	}
	var fromLocks, fromPg []row
	for _, li := range got {
		fromLocks = append(fromLocks, row{li.Key, li.PID, li.Mode == ModeShared, li.Granted})
	}
	for k, hs := range lockState(t, dsn) {
		for _, h := range hs {
			fromPg = append(fromPg, row{k, h.pid, h.shared, h.granted})
		}
	}
	cmpRow := func(x, y row) int { return strings.Compare(fmt.Sprint(x), fmt.Sprint(y)) }
	slices.SortFunc(fromLocks, cmpRow)
	slices.SortFunc(fromPg, cmpRow)
	if !slices.Equal(fromLocks, fromPg) {
		t.Fatalf("Locks:\n%v\npg_locks:\n%v", fromLocks, fromPg)
	}

	byKey := make(map[Key][]LockInfo)
	for _, li := range got {
		byKey[li.Key] = append(byKey[li.Key], li)
	}
	now := time.Now()
	for _, li := range got {
		if li.Since.Before(start.Add(-time.Second)) || li.Since.After(now.Add(time.Second)) {
			t.Errorf("%+v: Since %v is not within the test (%v to %v)", li, li.Since, start, now)
		}
		if li.ClientAddr == "" {
			t.Errorf("%+v: no client address", li)
		}
	}
	j := byKey[job]
	if len(j) != 2 ||
		!j[0].Granted || j[0].Mode != ModeExclusive || j[0].PID != ex.core.S.PID() || j[0].ApplicationName != "holder-a" || j[0].Name != "job" ||
		j[1].Granted || j[1].Mode != ModeExclusive || j[1].ApplicationName != "waiter" || j[1].Name != "job" {
		t.Errorf("job: %+v; want holder-a's exclusive hold, then waiter's wait", j)
	}
	c := byKey[cache]
	if len(c) != 2 || c[0].Name != "cache" || c[0].Mode != ModeShared || c[1].Mode != ModeShared || !c[0].Granted || !c[1].Granted {
		t.Errorf("cache: %+v; want two shared holds", c)
	}
	if apps := []string{c[0].ApplicationName, c[1].ApplicationName}; !slices.Contains(apps, "holder-a") || !slices.Contains(apps, "holder-b") {
		t.Errorf("cache held by %v, want holder-a and holder-b", apps)
	}
	if pids := []int32{c[0].PID, c[1].PID}; !slices.Contains(pids, sa.core.S.PID()) || !slices.Contains(pids, sb.core.S.PID()) {
		t.Errorf("cache held by %v, want %d and %d", pids, sa.core.S.PID(), sb.core.S.PID())
	}
	if u := byKey[unnamed]; len(u) != 1 || u[0].Name != "" || u[0].PID != other.core.S.PID() {
		t.Errorf("unnamed key: %+v", u)
	}

	if err := ex.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	r := receive(t, waiting)
	if r.err != nil {
		t.Fatal(r.err)
	}
	got, err = x.Locks(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, li := range got {
		if li.Key == job && (li.ApplicationName != "waiter" || !li.Granted) {
			t.Errorf("after the handover: %+v", li)
		}
	}
	if _, err := New(pgtest.Pool(t, dsn), WithKeyNames(map[Key]string{{}: "zero"})); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("WithKeyNames with the zero Key: %v", err)
	}
}

// Locks lists keys in the order a reader expects and LockAll takes them:
// bigint keys by signed value, negative first, then pair keys by (a, b),
// signed. pg_locks splits a key over classid, objid and objsubid, whose
// order puts a negative key after every positive one and interleaves the
// two key spaces. Within a key, holders come before the waiter.
func TestLocksOrderedByKey(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	a := newTestClient(t, dsn)
	b := newTestClient(t, dsn)
	w := newTestClient(t, dsn)
	x := newTestClient(t, dsn)
	// The order Locks must return, written out by hand.
	want := []Key{
		Int64Key(math.MinInt64),
		Int64Key(-1 << 40),
		Int64Key(-5),
		Int64Key(0),
		Int64Key(3),
		Int64Key(1<<32 | 2), // pg_locks: classid 1, objid 2, like PairKey(1, 2)
		Int64Key(1 << 40),
		Int64Key(math.MaxInt64),
		PairKey(math.MinInt32, 5),
		PairKey(-2, 1),
		PairKey(-1, -7),
		PairKey(-1, 0),
		PairKey(0, 0),
		PairKey(1, -1),
		PairKey(1, 2),
		PairKey(math.MaxInt32, math.MinInt32),
	}
	// Taken in a scrambled order, over two Clients.
	held := make(map[Key]*Lock)
	for i, j := range []int{5, 12, 0, 9, 3, 15, 7, 1, 14, 10, 4, 8, 13, 2, 11, 6} {
		c := a
		if i%2 == 1 {
			c = b
		}
		l, err := c.TryLock(ctx, want[j])
		if err != nil {
			t.Fatalf("TryLock %v: %v", want[j], err)
		}
		held[want[j]] = l
	}
	contended := PairKey(-1, -7)
	waiting := goLock(func() (*Lock, error) { return w.Lock(ctx, contended) })
	pgtest.Eventually(t, testTimeout, "the waiter to show in pg_locks", func() bool { return waitingOn(t, dsn, contended) == 1 })

	got, err := x.Locks(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var keys []Key
	for _, li := range got {
		if slices.Contains(want, li.Key) {
			keys = append(keys, li.Key)
		}
	}
	wantRows := slices.Clone(want)
	wantRows = slices.Insert(wantRows, slices.Index(want, contended)+1, contended)
	if !slices.Equal(keys, wantRows) {
		t.Fatalf("Locks listed the keys in the order\n%v\nwant\n%v", keys, wantRows)
	}
	if len(got) != len(wantRows) {
		t.Errorf("Locks returned %d rows, want %d: %+v", len(got), len(wantRows), got)
	}
	i := slices.IndexFunc(got, func(li LockInfo) bool { return li.Key == contended })
	if i < 0 || i+1 >= len(got) || !got[i].Granted || got[i+1].Key != contended || got[i+1].Granted {
		t.Errorf("the rows of %v are not its holder, then its waiter: %+v", contended, got)
	}
	// The same rows as pg_locks, read separately.
	for _, li := range got {
		if grantedTo(t, dsn, li.Key) == nil {
			t.Errorf("Locks lists %v, which pg_locks shows held by nobody", li.Key)
		}
	}

	if err := held[contended].Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	r := receive(t, waiting)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if err := r.l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
}

// Terminate frees a stuck lock and returns once it is free; it refuses a
// backend that is not pgcoord's, which TerminateAny ends; unknown pids and
// missing privileges give clear errors.
func TestTerminate(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	holder := newTestClient(t, dsn)
	op := newTestClient(t, dsn)
	k := HashKey("stuck")

	l, err := holder.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if err := op.Terminate(ctx, l.core.S.PID()); err != nil {
		t.Fatal(err)
	}
	exited(t, dsn, l.core.S.PID())
	notHeld(t, dsn, k)
	awaitEnd(t, l, "the lock of a terminated backend")
	if !errors.Is(l.Err(), ErrLockLost) {
		t.Errorf("the holder's lock ended with %v, want ErrLockLost", l.Err())
	}

	// A program that does not use pgcoord.
	raw := pgtest.Conn(t, dsn)
	if _, err := raw.Exec(ctx, "SELECT pg_advisory_lock(5)"); err != nil {
		t.Fatal(err)
	}
	rawPID := int32(raw.PgConn().PID())
	err = op.Terminate(ctx, rawPID)
	if !errors.Is(err, ErrForeignBackend) || !strings.Contains(err.Error(), "TerminateAny") {
		t.Fatalf("Terminate of a foreign backend: %v, want ErrForeignBackend", err)
	}
	heldOnlyBy(t, dsn, Int64Key(5), rawPID)
	if err := op.TerminateAny(ctx, rawPID); err != nil {
		t.Fatal(err)
	}
	exited(t, dsn, rawPID)
	notHeld(t, dsn, Int64Key(5))

	if err := op.Terminate(ctx, 0x7fffff00); err == nil || !strings.Contains(err.Error(), "no backend") {
		t.Errorf("Terminate of no backend: %v", err)
	}

	// A role without the privilege to signal the holder's backend.
	l, err = holder.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	weak := weakRolePool(t, dsn)
	wc := newTestClientOn(t, weak)
	err = wc.Terminate(ctx, l.core.S.PID())
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "42501" || !strings.Contains(err.Error(), "pg_signal_backend") {
		t.Fatalf("Terminate without privilege: %v, want SQLSTATE 42501 naming pg_signal_backend", err)
	}
	heldOnlyBy(t, dsn, k, l.core.S.PID())
	if err := l.Unlock(ctx); err != nil {
		t.Fatal(err)
	}

	// A member of pg_signal_backend ends another role's backend, whose
	// start pg_stat_activity does not show it.
	_, holderDSN := newTestRole(t, dsn, "pgcoord_holder")
	signaller, signallerDSN := newTestRole(t, dsn, "pgcoord_signal")
	if _, err := pgtest.Conn(t, dsn).Exec(ctx, "GRANT pg_signal_backend TO "+signaller); err != nil {
		t.Fatal(err)
	}
	l, err = newTestClient(t, holderDSN).Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	sc := newTestClient(t, signallerDSN)
	var started *time.Time
	if err := pgtest.Conn(t, signallerDSN).QueryRow(ctx, "SELECT backend_start FROM pg_stat_activity WHERE pid = $1", l.core.S.PID()).Scan(&started); err != nil || started != nil {
		t.Fatalf("the signaller reads the holder's backend_start as %v (%v), want NULL", started, err)
	}
	if err := sc.Terminate(ctx, l.core.S.PID()); err != nil {
		t.Fatal(err)
	}
	exited(t, dsn, l.core.S.PID())
	notHeld(t, dsn, k)
	awaitEnd(t, l, "the lock of a backend ended by a member of pg_signal_backend")
}

// exited asserts that no backend with pid is in pg_stat_activity.
func exited(t *testing.T, dsn string, pid int32) {
	t.Helper()
	var n int
	if err := pgtest.Conn(t, dsn).QueryRow(testCtx(t), "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("pg_stat_activity: backend %d has not exited", pid)
	}
}

// weakRolePool returns a pool on dsn's database as a new role with no
// privileges beyond LOGIN (see newTestRole).
func weakRolePool(t *testing.T, dsn string) *pgxpool.Pool {
	t.Helper()
	_, weak := newTestRole(t, dsn, "pgcoord_weak")
	return pgtest.Pool(t, weak)
}

// Terminate signals only the backend it checked, and its wait for the exit
// tells that backend from a later one that the server gave the same pid:
// right after Terminate's first statement, the checked backend is ended
// and its pid handed to a new backend of the same application name, which
// takes a lock. Terminate returns nil, and the later backend and its lock
// live on.
func TestTerminateEndsOnlyTheBackendItChecked(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	holder := newTestClient(t, dsn)
	admin := pgtest.Conn(t, dsn)
	k := HashKey("stuck")
	l, err := holder.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	pid := l.core.S.PID()
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err != nil {
		pgtest.SkipOrFail(t, "the server's backend %d is not a process of this machine (%v): the test hands its pid to a new backend", pid, err)
	}
	var start time.Time
	if err := admin.QueryRow(ctx, "SELECT backend_start FROM pg_stat_activity WHERE pid = $1", pid).Scan(&start); err != nil {
		t.Fatal(err)
	}

	var op *Client
	var later *pgx.Conn
	var fired bool
	tracer := &afterQuery{fn: func(sql string) {
		if fired || !strings.Contains(sql, "pg_stat_activity") {
			return
		}
		fired = true
		// Whether or not Terminate has signalled it yet, the checked
		// backend ends now, and a later one takes its pid.
		if _, err := admin.Exec(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
			t.Fatal(err)
		}
		cc, err := pgx.ParseConfig(dsn)
		if err != nil {
			t.Fatal(err)
		}
		cc.RuntimeParams["application_name"] = op.core.Cfg.AppName
		later = connectWithPID(t, ctx, cc, pid)
		if _, err := later.Exec(ctx, "SELECT pg_advisory_lock(9)"); err != nil {
			t.Fatal(err)
		}
	}}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	op = newTestClientOn(t, pool)

	if err := op.Terminate(ctx, pid); err != nil {
		t.Fatalf("Terminate: %v", err)
	}
	if !fired || later == nil {
		t.Fatal("Terminate sent no statement that reads pg_stat_activity")
	}
	var laterStart time.Time
	if err := admin.QueryRow(ctx, "SELECT backend_start FROM pg_stat_activity WHERE pid = $1", pid).Scan(&laterStart); err != nil {
		t.Fatalf("the later backend with pid %d: %v", pid, err)
	}
	if laterStart.Equal(start) {
		t.Fatalf("the backend with pid %d started at %v, as the checked one did", pid, start)
	}
	heldOnlyBy(t, dsn, Int64Key(9), pid)
	notHeld(t, dsn, k)
	awaitEnd(t, l, "the lock of the terminated backend")
}

// afterQuery is a pgx tracer that calls fn with each statement's text
// once the statement has ended, on the goroutine that ran it.
type afterQuery struct{ fn func(sql string) }

type afterQueryKey struct{}

func (a *afterQuery) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, afterQueryKey{}, d.SQL)
}

func (a *afterQuery) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if sql, ok := ctx.Value(afterQueryKey{}).(string); ok {
		a.fn(sql)
	}
}

// connectWithPID opens a connection with cfg whose backend has process ID
// pid, once pid is free: it sets the kernel's last handed-out pid just
// below pid before each connect (so the server must run on this machine,
// and the test as root). Another process of the machine may fork first
// and take pid; then it waits for that process to exit and tries again.
func connectWithPID(t *testing.T, ctx context.Context, cfg *pgx.ConnConfig, pid int32) *pgx.Conn {
	t.Helper()
	const lastPID = "/proc/sys/kernel/ns_last_pid"
	proc := fmt.Sprintf("/proc/%d", pid)
	for range 50 {
		pgtest.Eventually(t, testTimeout, "pid "+strconv.Itoa(int(pid))+" to be free", func() bool {
			_, err := os.Stat(proc)
			return errors.Is(err, os.ErrNotExist)
		})
		if err := os.WriteFile(lastPID, []byte(strconv.Itoa(int(pid-1))), 0); err != nil {
			pgtest.SkipOrFail(t, "cannot set %s (needs root on the server's machine): %v", lastPID, err)
		}
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		if int32(conn.PgConn().PID()) == pid {
			t.Cleanup(func() { conn.Close(context.Background()) })
			return conn
		}
		conn.Close(ctx)
	}
	t.Fatalf("no backend got pid %d in 50 connects", pid)
	return nil
}

// A holder's Since is no later than the moment its lock was taken, also
// for a session lock whose backend has since begun a transaction: it is
// the backend's start, not the transaction's.
func TestLocksSinceOfSessionLockInLaterTransaction(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	op := newTestClient(t, dsn)
	raw := pgtest.Conn(t, dsn)
	k := Int64Key(4242)
	var takenBy time.Time // the server's clock just after the lock was granted
	if err := raw.QueryRow(ctx, "SELECT pg_advisory_lock(4242) IS NOT NULL, clock_timestamp()").Scan(new(bool), &takenBy); err != nil {
		t.Fatal(err)
	}
	pgtest.AwaitClockPast(t, ctx, raw, takenBy, testTimeout)
	tx, err := raw.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	var xactStart, backendStart time.Time
	if err := tx.QueryRow(ctx, "SELECT xact_start, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()").Scan(&xactStart, &backendStart); err != nil {
		t.Fatal(err)
	}
	if !xactStart.After(takenBy) {
		t.Fatalf("the transaction started at %v, not after the lock was taken (%v)", xactStart, takenBy)
	}
	got, err := op.Locks(ctx)
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(got, func(li LockInfo) bool { return li.Key == k && li.Granted })
	if i < 0 {
		t.Fatalf("Locks did not list the held key %v: %+v", k, got)
	}
	if since := got[i].Since; since.After(takenBy) || !since.Equal(backendStart) {
		t.Errorf("the holder's Since is %v; the lock was held by %v, its backend started at %v", since, takenBy, backendStart)
	}
}

// Terminate of a backend that does not exit (stopped with SIGSTOP) ends
// with ctx's deadline, or after 10 seconds when ctx has none, with an
// error that says the backend was signalled; once it runs again, the
// backend exits.
func TestTerminateGivesUpOnBackendThatDoesNotExit(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	holder := newTestClient(t, dsn)
	op := newTestClient(t, dsn)
	k := HashKey("stuck-stopped")
	l, err := holder.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	pid := l.core.S.PID()
	if err := syscall.Kill(int(pid), syscall.SIGSTOP); err != nil {
		pgtest.SkipOrFail(t, "cannot stop backend %d (the test stops it as root on the server's machine): %v", pid, err)
	}
	t.Cleanup(func() { _ = syscall.Kill(int(pid), syscall.SIGCONT) })

	for _, c := range []struct {
		name     string
		deadline time.Duration // 0: none
		bound    time.Duration
	}{{"ctx with a deadline", 2 * time.Second, 2 * time.Second}, {"ctx without a deadline", 0, terminateWait}} {
		tctx := context.Background()
		if c.deadline > 0 {
			var cancel context.CancelFunc
			tctx, cancel = context.WithTimeout(tctx, c.deadline)
			defer cancel()
		}
		// Should Terminate not give up, the backend runs again and exits,
		// and Terminate returns.
		watchdog := time.AfterFunc(c.bound+10*time.Second, func() { _ = syscall.Kill(int(pid), syscall.SIGCONT) })
		start := time.Now()
		err := op.Terminate(tctx, pid)
		took := time.Since(start)
		watchdog.Stop()
		if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "signalled, but it has not exited yet") {
			t.Errorf("%s: Terminate of a stopped backend: %v; want ctx's deadline and a word that it was signalled", c.name, err)
		}
		if took < c.bound || took > c.bound+10*time.Second {
			t.Errorf("%s: Terminate gave up after %v; want %v", c.name, took.Round(time.Millisecond), c.bound)
		}
	}
	heldOnlyBy(t, dsn, k, pid)
	if err := syscall.Kill(int(pid), syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, testTimeout, "the signalled backend to exit once it runs", func() bool {
		return len(grantedTo(t, dsn, k)) == 0
	})
}
