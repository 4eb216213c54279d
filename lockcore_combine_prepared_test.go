package pgcoord

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// sendCombined runs calls as one combined statement on s, as sendCalls
// does once it holds the connection.
func sendCombined(t *testing.T, ctx context.Context, s *Session, calls []*core.KeyCall) {
	t.Helper()
	if err := s.core.Grab(ctx); err != nil {
		t.Fatal(err)
	}
	s.core.AnswerCalls(context.WithoutCancel(ctx), calls)
	s.core.Release()
}

// serverStatements returns the texts of the statements prepared on s's
// backend, read on the backend itself.
func serverStatements(t *testing.T, ctx context.Context, s *Session) map[string]bool {
	t.Helper()
	var names []string
	err := s.core.Run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		rows, _ := conn.Query(ctx, "SELECT statement FROM pg_prepared_statements", pgx.QueryExecModeSimpleProtocol)
		var err error
		names, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]bool, len(names))
	for _, n := range names {
		out[n] = true
	}
	return out
}

// markedPrepared returns the combined texts s records as prepared.
func markedPrepared(s *Session) []string {
	s.core.State.Lock() // not needed by the library (the holder of the connection uses it); the test reads it between statements
	defer s.core.State.Unlock()
	var out []string
	for sql := range s.core.Calls.Prepared {
		out = append(out, sql)
	}
	return out
}

// reviewTracer records the statements pgx runs and prepares.
type reviewTracer struct {
	mu       sync.Mutex
	queries  []string
	prepares []string
}

func (r *reviewTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.mu.Lock()
	r.queries = append(r.queries, d.SQL)
	r.mu.Unlock()
	return ctx
}

func (r *reviewTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (r *reviewTracer) TracePrepareStart(ctx context.Context, _ *pgx.Conn, d pgx.TracePrepareStartData) context.Context {
	r.mu.Lock()
	r.prepares = append(r.prepares, d.SQL)
	r.mu.Unlock()
	return ctx
}

func (r *reviewTracer) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

func (r *reviewTracer) sawCombined() (queried, prepared bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	combined := func(sql string) bool { return strings.Contains(sql, "), pg_") }
	for _, q := range r.queries {
		queried = queried || combined(q)
	}
	for _, p := range r.prepares {
		prepared = prepared || combined(p)
	}
	return queried, prepared
}

// combinedRound sends, as two combined statements, the same mix of calls
// each time (so the same two texts): tries of free bigint and pair keys,
// exclusive and shared, tries of keys held elsewhere in a mode that refuses
// them and in one that admits them; then the releases of what was taken. It
// checks each answer and, through pg_locks, what the backend holds after
// each statement.
func combinedRound(t *testing.T, ctx context.Context, dsn string, s *Session, r int, heldExcl1, heldExcl2, heldShared Key) {
	t.Helper()
	base := int64(5_000_000 + r*10)
	type want struct {
		c      *core.KeyCall
		ok     bool
		shared bool
	}
	tries := []want{
		{&core.KeyCall{Fn: core.LockFunc(false, true), Key: Int64Key(base).coreKey()}, true, false},
		{&core.KeyCall{Fn: core.LockFunc(false, true), Key: PairKey(77, int32(r)).coreKey()}, true, false},
		{&core.KeyCall{Fn: core.LockFunc(true, true), Key: Int64Key(base + 1).coreKey()}, true, true},
		{&core.KeyCall{Fn: core.LockFunc(false, true), Key: heldExcl1.coreKey()}, false, false},
		{&core.KeyCall{Fn: core.LockFunc(true, true), Key: heldExcl2.coreKey()}, false, true},
		{&core.KeyCall{Fn: core.LockFunc(true, true), Key: heldShared.coreKey()}, true, true},
	}
	var calls []*core.KeyCall
	for _, w := range tries {
		calls = append(calls, w.c)
	}
	sendCombined(t, ctx, s, calls)
	held := heldBy(t, dsn, s.core.Pid)
	var releases []*core.KeyCall
	for _, w := range tries {
		if w.c.Cause != nil || w.c.Ok != w.ok {
			t.Fatalf("round %d: %s(%v) = %v, %v; want %v", r, w.c.Fn, w.c.Key, w.c.Ok, w.c.Cause, w.ok)
		}
		shared, ok := held[keyOf(w.c.Key)]
		if ok != w.ok || (ok && shared != w.shared) {
			t.Fatalf("round %d: pg_locks: %v granted to backend %d: %v (shared %v), want %v (shared %v)", r, w.c.Key, s.core.Pid, ok, shared, w.ok, w.shared)
		}
		if w.ok {
			releases = append(releases, &core.KeyCall{Fn: core.UnlockFunc(w.shared), Key: w.c.Key})
		}
	}
	if len(held) != len(releases) {
		t.Fatalf("round %d: backend holds %v, want exactly the %d keys taken", r, held, len(releases))
	}
	sendCombined(t, ctx, s, releases)
	for _, c := range releases {
		if c.Cause != nil || !c.Ok {
			t.Fatalf("round %d: %s(%v) = %v, %v; want true", r, c.Fn, c.Key, c.Ok, c.Cause)
		}
	}
	if held := heldBy(t, dsn, s.core.Pid); len(held) != 0 {
		t.Fatalf("round %d: backend still holds %v after the releases", r, held)
	}
}

// Combined statements answer each call, prepared, whatever the pool's
// connection config: a pgx tracer, the simple protocol, describe-exec with
// no statement cache, exec mode, and the server forced to generic plans.
// The same two texts are sent again and again, so each runs prepared after
// its first time (and generic, under force_generic_plan). Every text the
// session records as prepared is prepared on its backend
// (pg_prepared_statements, read there). Then goroutines try and release
// keys through the public API on the same session, and nothing is left
// held.
func TestCombinedPreparedStatementsAnswerEachCallUnderEveryConnConfig(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DB(t)
	configs := []struct {
		name      string
		configure func(*pgxpool.Config, *reviewTracer)
	}{
		{"default", func(*pgxpool.Config, *reviewTracer) {}},
		{"tracer", func(c *pgxpool.Config, tr *reviewTracer) { c.ConnConfig.Tracer = tr }},
		{"simple_protocol", func(c *pgxpool.Config, _ *reviewTracer) {
			c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
		}},
		{"describe_exec_no_cache", func(c *pgxpool.Config, _ *reviewTracer) {
			c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeDescribeExec
			c.ConnConfig.StatementCacheCapacity = 0
			c.ConnConfig.DescriptionCacheCapacity = 0
		}},
		{"exec", func(c *pgxpool.Config, _ *reviewTracer) {
			c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
		}},
		{"force_generic_plan", func(c *pgxpool.Config, _ *reviewTracer) {
			c.ConnConfig.RuntimeParams["plan_cache_mode"] = "force_generic_plan"
		}},
	}
	for i, cfg := range configs {
		t.Run(cfg.name, func(t *testing.T) {
			ctx := testCtx(t)
			tr := &reviewTracer{}
			pool := pgtest.Pool(t, dsn, func(c *pgxpool.Config) { cfg.configure(c, tr) })
			c := newTestClientOn(t, pool)
			s := newTestSession(t, c)
			if cfg.name == "force_generic_plan" {
				var mode string
				err := s.core.Run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
					return conn.QueryRow(ctx, "SHOW plan_cache_mode", pgx.QueryExecModeSimpleProtocol).Scan(&mode)
				})
				if err != nil || mode != "force_generic_plan" {
					t.Fatalf("plan_cache_mode on the session's backend: %q, %v", mode, err)
				}
			}
			other := pgtest.Conn(t, dsn)
			off := int64(i * 100)
			heldExcl1, heldExcl2, heldShared := Int64Key(6_000_001+off), Int64Key(6_000_002+off), Int64Key(6_000_003+off)
			if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1), pg_advisory_lock($2), pg_advisory_lock_shared($3)",
				mustInt64(heldExcl1), mustInt64(heldExcl2), mustInt64(heldShared)); err != nil {
				t.Fatal(err)
			}
			const rounds = 8
			for r := range rounds {
				combinedRound(t, ctx, dsn, s, int(off)+r, heldExcl1, heldExcl2, heldShared)
			}
			marked := markedPrepared(s)
			if len(marked) != 2 {
				t.Errorf("%d combined texts recorded as prepared, want the 2 sent: %q", len(marked), marked)
			}
			onServer := serverStatements(t, ctx, s)
			for _, sql := range marked {
				if !onServer[sql] {
					t.Errorf("%q recorded as prepared, absent from pg_prepared_statements on backend %d", sql, s.core.Pid)
				}
			}
			if cfg.name == "tracer" {
				if q, p := tr.sawCombined(); !q || !p {
					t.Errorf("tracer saw a combined statement run: %v, prepared: %v; want both", q, p)
				}
			}

			// The public path, combining as goroutines meet.
			const workers, n = 8, 40
			errs := make(chan error, workers)
			var wg sync.WaitGroup
			for w := range workers {
				wg.Go(func() {
					for j := range n {
						k := Int64Key(7_000_000 + off*1000 + int64(w*100+j))
						var l *Lock
						var err error
						if j%2 == 0 {
							l, err = s.TryLock(ctx, k)
						} else {
							l, err = s.TryRLock(ctx, k)
						}
						if err != nil {
							errs <- fmt.Errorf("worker %d: try %v: %v", w, k, err)
							return
						}
						if _, err := s.TryLock(ctx, heldShared); !errors.Is(err, ErrLocked) {
							errs <- fmt.Errorf("worker %d: TryLock of %v, held shared elsewhere: %v, want ErrLocked", w, heldShared, err)
							return
						}
						if err := l.Unlock(ctx); err != nil {
							errs <- fmt.Errorf("worker %d: unlock %v: %v", w, k, err)
							return
						}
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			if held := heldBy(t, dsn, s.core.Pid); len(held) != 0 {
				t.Errorf("backend %d still holds %v", s.core.Pid, held)
			}
			if err := s.Err(); err != nil {
				t.Errorf("session ended: %v", err)
			}
			t.Logf("%d combined statements", combinedCount(s.core))
		})
	}
}

// A combined text whose Prepare the server refuses (a statement of that
// name already exists on the backend, unknown to pgx, with another text)
// is not recorded as prepared, and its statement, sent unprepared, answers
// each call: the statement of that name is never run in its place. The
// refused text does not use up the bound either: the next new text is
// still prepared.
func TestCombinedStatementPrepareRefusedIsNotRecordedAndAnswersEachCall(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	s := newTestSession(t, c)
	other := pgtest.Conn(t, dsn)
	held := Int64Key(8_000_001)
	if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1)", mustInt64(held)); err != nil {
		t.Fatal(err)
	}
	shape := func(r int64) []*core.KeyCall {
		return []*core.KeyCall{
			{Fn: core.LockFunc(false, true), Key: Int64Key(8_100_000 + r).coreKey()},
			{Fn: core.LockFunc(false, true), Key: held.coreKey()},
			{Fn: core.LockFunc(false, true), Key: Int64Key(8_200_000 + r).coreKey()},
		}
	}
	sql, _ := core.CombinedSQL(shape(0), s.core.Pid)
	// The name pgx gives a statement prepared under its own text, another
	// statement: three columns, all true.
	digest := sha256.Sum256([]byte(sql))
	err := s.core.Run(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		_, err := conn.PgConn().Prepare(ctx, "stmt_"+hex.EncodeToString(digest[:24]), "SELECT true, true, true", nil)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for r := range int64(3) {
		calls := shape(r)
		sendCombined(t, ctx, s, calls)
		got := heldBy(t, dsn, s.core.Pid)
		for _, c := range calls {
			want := c.Key != held.coreKey()
			if c.Cause != nil || c.Ok != want {
				t.Fatalf("round %d: %s(%v) = %v, %v; want %v", r, c.Fn, c.Key, c.Ok, c.Cause, want)
			}
			if _, ok := got[keyOf(c.Key)]; ok != want {
				t.Fatalf("round %d: pg_locks: %v granted to backend %d: %v, want %v", r, c.Key, s.core.Pid, ok, want)
			}
		}
		var rel []*core.KeyCall
		for _, c := range calls {
			if c.Ok {
				rel = append(rel, &core.KeyCall{Fn: core.UnlockFunc(false), Key: c.Key})
			}
		}
		sendCombined(t, ctx, s, rel)
		if got := heldBy(t, dsn, s.core.Pid); len(got) != 0 {
			t.Fatalf("round %d: backend holds %v after the releases", r, got)
		}
	}
	marked := markedPrepared(s)
	for _, m := range marked {
		if m == sql {
			t.Fatalf("%q recorded as prepared though the server refused to prepare it", sql)
		}
	}
	// The releases' text (two releases) was prepared: the refused text
	// took no place in the bound.
	if len(marked) != 1 {
		t.Errorf("recorded as prepared: %q, want the releases' text alone", marked)
	}
	if onServer := serverStatements(t, ctx, s); len(marked) == 1 && !onServer[marked[0]] {
		t.Errorf("%q recorded as prepared, absent from pg_prepared_statements", marked[0])
	}
	if err := s.Err(); err != nil {
		t.Fatalf("session ended: %v", err)
	}
}

// A combined statement that runs prepared (its text was prepared by an
// earlier statement) and fails because the server's lock table is full
// costs no call its answer: each try holds its key in pg_locks exactly when
// it says so, and a try that finds no room says so with ErrTooManyLocks's
// server error, not a wrong answer. The session lives, and a release in
// the same failed statement still frees its key.
func TestCombinedPreparedStatementOnFullLockTableAnswersEachCall(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	srv := pgtest.NewServer(t, pgtest.WithSetting("max_locks_per_transaction", "10"), pgtest.WithSetting("max_connections", "20"))
	dsn := srv.DB(t)
	lockState(t, dsn) // open the observer before the lock table fills
	c := newTestClient(t, dsn)
	s := newTestSession(t, c)
	filler := newTestSession(t, c)
	const tries = 8
	// Shape: tries exclusive tries and one release; the release's key
	// is taken alone first.
	// (combinedSQL sorts the calls it is given: the tries and the release
	// are kept apart.)
	shape := func(base int64, relKey Key) (tried []*core.KeyCall, rel *core.KeyCall, calls []*core.KeyCall) {
		for i := range int64(tries) {
			tried = append(tried, &core.KeyCall{Fn: core.LockFunc(false, true), Key: Int64Key(base + i).coreKey()})
		}
		rel = &core.KeyCall{Fn: core.UnlockFunc(false), Key: relKey.coreKey()}
		return tried, rel, append(slices.Clone(tried), rel)
	}
	take := func(k Key) {
		t.Helper()
		if ok, err := s.core.CallKey(ctx, core.LockFunc(false, true), k.coreKey()); err != nil || !ok {
			t.Fatalf("take %v: %v, %v", k, ok, err)
		}
	}
	// First, with room: prepares the text.
	take(Int64Key(9_500_000))
	firstTries, _, first := shape(9_600_000, Int64Key(9_500_000))
	sql, _ := core.CombinedSQL(slices.Clone(first), s.core.Pid)
	sendCombined(t, ctx, s, first)
	for _, c := range first {
		if c.Cause != nil || !c.Ok {
			t.Fatalf("with room: %s(%v) = %v, %v", c.Fn, c.Key, c.Ok, c.Cause)
		}
	}
	prepared := false
	for _, m := range markedPrepared(s) {
		prepared = prepared || m == sql
	}
	if !prepared || !serverStatements(t, ctx, s)[sql] {
		t.Fatalf("the combined text was not prepared on the backend: the test would not run it prepared")
	}
	for _, c := range firstTries {
		if ok, err := s.core.CallKey(ctx, core.UnlockFunc(false), c.Key); err != nil || !ok {
			t.Fatalf("release %v: %v, %v", c.Key, ok, err)
		}
	}
	take(Int64Key(9_500_001))
	// Fill the lock table, then leave fewer slots than the tries.
	var fill []*Lock
	var err error
	for i := range 100_000 {
		var l *Lock
		if l, err = filler.Lock(ctx, Int64Key(int64(i))); err != nil {
			break
		}
		fill = append(fill, l)
	}
	if !errors.Is(err, ErrTooManyLocks) {
		t.Fatalf("filling the lock table: %v, want ErrTooManyLocks", err)
	}
	for _, l := range fill[len(fill)-3:] {
		mustUnlock(t, l)
	}
	secondTries, rel, second := shape(9_700_000, Int64Key(9_500_001))
	if got, _ := core.CombinedSQL(slices.Clone(second), s.core.Pid); got != sql {
		t.Fatalf("second text %q differs from the prepared one %q", got, sql)
	}
	sendCombined(t, ctx, s, second)
	if err := s.Err(); err != nil {
		t.Fatalf("session ended: %v", err)
	}
	if err := filler.Close(ctx); err != nil {
		t.Fatal(err)
	}
	mine := heldBy(t, dsn, s.core.Pid)
	taken, full := 0, 0
	for _, c := range secondTries {
		_, holds := mine[keyOf(c.Key)]
		switch {
		case c.Cause == nil && c.Ok:
			taken++
			if !holds {
				t.Errorf("try %v said yes, pg_locks shows it not granted to backend %d", c.Key, s.core.Pid)
			}
		case c.Cause == nil:
			t.Errorf("try %v of a free key said no", c.Key)
		case core.SqlState(c.Cause) == "53200" || errors.Is(c.Cause, ErrTooManyLocks):
			full++
			if holds {
				t.Errorf("try %v failed (%v), pg_locks shows it granted to backend %d", c.Key, c.Cause, s.core.Pid)
			}
		default:
			t.Errorf("try %v: %v, want an answer or the full table's error", c.Key, c.Cause)
		}
	}
	if rel.Cause != nil || !rel.Ok {
		t.Errorf("release of %v in the failed statement: %v, %v; want true", rel.Key, rel.Ok, rel.Cause)
	}
	if _, holds := mine[keyOf(rel.Key)]; holds {
		t.Errorf("released %v still granted to backend %d", rel.Key, s.core.Pid)
	}
	if len(mine) != taken {
		t.Errorf("backend %d holds %d keys, %d tries said yes: %v", s.core.Pid, len(mine), taken, mine)
	}
	if full == 0 {
		t.Errorf("no try found the table full: the statement did not fail, the test proves nothing (%d taken)", taken)
	}
	t.Logf("%d taken, %d refused for the full table", taken, full)
	for _, c := range secondTries {
		if c.Cause == nil && c.Ok {
			if ok, err := s.core.CallKey(ctx, core.UnlockFunc(false), c.Key); err != nil || !ok {
				t.Errorf("release %v: %v, %v", c.Key, ok, err)
			}
		}
	}
	if mine := heldBy(t, dsn, s.core.Pid); len(mine) != 0 {
		t.Errorf("backend %d still holds %v", s.core.Pid, mine)
	}
}

// Goroutines try and release keys on one Session while a blocking Lock of
// the same Session waits on it and is then granted, and the Session is
// closed while their calls (combined, prepared) are queued and in flight:
// every call returns, each success held its key, the blocking Lock is
// granted on the session's backend (pg_locks) and then ends with the
// session, and once Close returns the backend holds nothing. Run under
// -race, this also checks that the record of prepared texts is touched only
// by the connection's holder.
func TestCombinedPreparedCallsRaceBlockingLockAndCloseLeaveNothingHeld(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	s, err := c.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pid := s.core.Pid
	other := pgtest.Conn(t, dsn)
	blocked := Int64Key(9_900_000)
	if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1)", mustInt64(blocked)); err != nil {
		t.Fatal(err)
	}
	lockDone := make(chan error, 1)
	go func() {
		_, err := s.Lock(ctx, blocked)
		lockDone <- err
	}()
	pgtest.Eventually(t, testTimeout, "the blocking Lock waits on the server", func() bool {
		return waitingOn(t, dsn, blocked) == 1
	})
	const workers = 8
	stop := make(chan struct{})
	errs := make(chan error, workers*4)
	var calls sync.WaitGroup
	for w := range workers {
		calls.Go(func() {
			for j := range 100_000 {
				select {
				case <-stop:
					return
				default:
				}
				k := Int64Key(9_910_000 + int64(w*10_000+j))
				l, err := s.TryLock(ctx, k)
				if err != nil {
					if !errors.Is(err, ErrClosed) {
						errs <- fmt.Errorf("worker %d: try %v: %v", w, k, err)
					}
					return
				}
				if err := l.Unlock(ctx); err != nil && !errors.Is(err, ErrClosed) && !errors.Is(err, ErrLockLost) {
					errs <- fmt.Errorf("worker %d: unlock %v: %v", w, k, err)
					return
				}
			}
		})
	}
	pgtest.Eventually(t, testTimeout, "combined statements while the Lock waits", func() bool {
		return combinedCount(s.core) >= 20
	})
	if _, err := other.Exec(ctx, "SELECT pg_advisory_unlock($1)", mustInt64(blocked)); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-lockDone:
		if err != nil {
			t.Fatalf("blocking Lock: %v", err)
		}
	case <-ctx.Done():
		t.Fatal("the blocking Lock was not granted")
	}
	if pids := grantedTo(t, dsn, blocked); len(pids) != 1 || pids[0] != pid {
		t.Fatalf("pg_locks: %v granted to %v, want backend %d", blocked, pids, pid)
	}
	before := combinedCount(s.core)
	pgtest.Eventually(t, testTimeout, "more combined statements after the grant", func() bool {
		return combinedCount(s.core) >= before+20
	})
	if err := s.Close(ctx); err != nil {
		t.Fatalf("Close with calls in flight: %v", err)
	}
	close(stop)
	returned := make(chan struct{})
	go func() { calls.Wait(); close(returned) }()
	select {
	case <-returned:
	case <-ctx.Done():
		t.Fatal("calls still in flight after Close returned")
	}
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if held := heldBy(t, dsn, pid); len(held) != 0 {
		t.Errorf("after Close returned nil, backend %d holds %v", pid, held)
	}
	if n := len(markedPrepared(s)); n == 0 || n > core.MaxCombinedTexts {
		t.Errorf("%d combined texts recorded as prepared, want between 1 and %d", n, core.MaxCombinedTexts)
	}
	t.Logf("%d combined statements, %d texts prepared", combinedCount(s.core), len(markedPrepared(s)))
}

// Picking, among backends of equal load, the one with the fewest calls
// queued keeps the routing rule: while a blocking Lock of the Client waits
// on a backend, goroutines that try and release keys through the same
// Client (their calls combined on the other backends) never take a key on
// the waiting backend, which holds nothing but its wait in pg_locks until
// it is granted; and a shared key the Client holds, taken again shared,
// is never taken on the waiting backend either.
func TestCombinedRouteTieBreakNeverTriesOnWaitingBackend(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	other := pgtest.Conn(t, dsn)
	c := newTestClient(t, dsn, WithSharedBackends(3), WithMaxWaits(1))
	waited := Int64Key(9_800_000)
	if _, err := other.Exec(ctx, "SELECT pg_advisory_lock($1)", mustInt64(waited)); err != nil {
		t.Fatal(err)
	}
	shared, err := c.TryRLock(ctx, Int64Key(9_800_001))
	if err != nil {
		t.Fatal(err)
	}
	blocked := goLock(func() (*Lock, error) { return c.Lock(ctx, waited) })
	var waiter int32
	pgtest.Eventually(t, testTimeout, "the Lock waits on the server", func() bool {
		for _, h := range lockState(t, dsn)[waited] {
			if !h.granted {
				waiter = h.pid
				return true
			}
		}
		return false
	})
	if waiter == shared.core.S.Pid {
		t.Fatalf("the blocking Lock waits on backend %d, which holds a shared key", waiter)
	}
	const workers, rounds = 12, 60
	errs := make(chan error, workers*rounds*4)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range rounds {
				k := Int64Key(9_810_000 + int64(w*1000+i))
				l, err := c.TryLock(ctx, k)
				if err != nil {
					errs <- fmt.Errorf("worker %d: TryLock %v: %v", w, k, err)
					return
				}
				if l.core.S.Pid == waiter {
					errs <- fmt.Errorf("worker %d: %v taken on backend %d, which waits", w, k, waiter)
				}
				if i%15 == 0 {
					if pids := grantedTo(t, dsn, k); len(pids) != 1 || pids[0] == waiter || pids[0] != l.core.S.Pid {
						errs <- fmt.Errorf("worker %d: pg_locks: %v granted to %v, want backend %d (waiter %d)", w, k, pids, l.core.S.Pid, waiter)
					}
				}
				if i%10 == 5 {
					j, err := c.TryRLock(ctx, shared.Key())
					if err != nil {
						errs <- fmt.Errorf("worker %d: TryRLock of a key the Client holds shared: %v", w, err)
						return
					}
					// Past the handoff bounds a reader takes the key on
					// another backend (see backends.go), never on the
					// one that waits.
					if j.core.S.Pid == waiter {
						errs <- fmt.Errorf("worker %d: shared %v taken on backend %d, which waits", w, shared.Key(), waiter)
					}
					mustUnlock(t, j)
				}
				if err := l.Unlock(ctx); err != nil {
					errs <- fmt.Errorf("worker %d: Unlock %v: %v", w, k, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if held := heldBy(t, dsn, waiter); len(held) != 0 {
		t.Errorf("pg_locks: the waiting backend %d holds %v", waiter, held)
	}
	if pids := grantedTo(t, dsn, shared.Key()); len(pids) != 1 || pids[0] != shared.core.S.Pid {
		t.Errorf("pg_locks: shared %v granted to %v, want backend %d alone", shared.Key(), pids, shared.core.S.Pid)
	}
	combined := 0
	c.core.Mu.Lock()
	for _, b := range c.core.Backends {
		b.State.Lock()
		combined += b.Calls.Combined
		b.State.Unlock()
	}
	c.core.Mu.Unlock()
	t.Logf("%d combined statements", combined)
	if _, err := other.Exec(ctx, "SELECT pg_advisory_unlock($1)", mustInt64(waited)); err != nil {
		t.Fatal(err)
	}
	r := receive(t, blocked)
	if r.err != nil {
		t.Fatalf("blocking Lock: %v", r.err)
	}
	heldOnlyBy(t, dsn, waited, waiter)
	mustUnlock(t, r.l)
	mustUnlock(t, shared)
}
