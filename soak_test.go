package pgcoord

// The soak: child processes contend for targets while a fault injector
// cycles through faults, and the recorded history is checked with
// porcupine, the linearizability checker of etcd's robustness tests.
//
//	go test -run Soak -soak=60s .
//
// Every child loops: acquire a target (with a fence), make two fenced
// writes (CheckFence, then an insert into fault_writes, in one
// transaction), release. Each operation is recorded with its call and
// return times; operations cut short by a fault are resolved afterwards
// (a write's row is looked up by its id). The history of each target must
// be linearizable against soakFenceModel: fences are issued one after
// another, and a write is accepted only while its fence is the newest, so
// no two accepted writes of different holders interleave and no fence goes
// backwards. Independently, fault_writes read in insertion order must show
// each target's fences never decreasing.
//
// Kinds of targets are listed in soakKinds with the model they are checked
// against: locks (soakFenceModel) and elections, whose term is the fence
// (soakTermModel: never two leaders whose accepted writes interleave, terms
// only grow), and a semaphore's permits (soakPermitModel: never more than
// limit holders, no slot granted twice), cross-checked against pg_locks
// through the soak_permits table.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

var soakFor = flag.Duration("soak", 0, "run TestFaultSoak for this long, e.g. -soak=60s (it is skipped without)")

// soakTargetsEnv lists the targets of a soak child, comma-separated.
const soakTargetsEnv = "PGCOORD_SOAK_TARGETS"

// soakKind is a kind of target the soak contends for, with the model its
// histories are checked against.
type soakKind struct {
	name    string
	targets []faultTarget
	model   porcupine.Model
}

func soakKinds() []soakKind {
	return []soakKind{{
		name:    "lock",
		targets: []faultTarget{lockTarget{"soak-a"}, lockTarget{"soak-b"}, lockTarget{"soak-c"}},
		model:   soakFenceModel(),
	}, {
		name:    "election",
		targets: []faultTarget{electionTarget{"soak-x"}, electionTarget{"soak-y"}},
		model:   soakTermModel(),
	}, {
		name:    "semaphore",
		targets: []faultTarget{soakSemaphore},
		model:   soakPermitModel(soakSemaphore.limit),
	}}
}

// soakEvent is one line of a soak child: the call or the return of an
// operation.
type soakEvent struct {
	Ev     string `json:"ev"`               // "call" or "ret"; "lost" for a permit found not held (see soakRound)
	ID     string `json:"id"`               // unique across the run
	Op     string `json:"op,omitempty"`     // call: "acquire" or "write"; "permit" or "unpermit" (its release)
	Target string `json:"target,omitempty"` // call
	Fence  int64  `json:"fence,omitempty"`  // call of a write; ret of an acquire that succeeded; a permit's slot plus one
	Result string `json:"result,omitempty"` // ret: "ok", "stale" (a write's ErrStaleFence) or "error"
	Err    string `json:"err,omitempty"`
	T      int64  `json:"t"` // Unix nanoseconds
}

// soakInput and soakOutput are an operation as the model sees it.
type soakInput struct {
	Op     string // "acquire" or "write"
	Target string
	Fence  int64  // of a write; a permit's slot plus one, of its end
	Holder string // a permit's acquire id, of the acquire and of its end
}

type soakOutput struct {
	Fence  int64  // of an acquire; 0 when unknown (it failed, or was cut short)
	Result string // of a write: "ok" or "stale"
}

// soakFenceModel is one target with fences. The state is the newest fence
// issued. An acquire that returned fence f took effect when f was the next
// fence; one whose outcome is unknown may or may not have issued one. A
// write accepted with fence f took effect while f was the newest fence; a
// write refused as stale, after a newer fence was issued.
func soakFenceModel() porcupine.Model { return fenceModel(false) }

// soakTermModel is soakFenceModel for an election, whose terms are fences:
// a campaign may issue fences it never returns (its lock lost while it
// was winning, the campaign went on), so the term a campaign returns is
// greater than the newest fence, not necessarily the next one.
func soakTermModel() porcupine.Model { return fenceModel(true) }

// fenceModel is soakFenceModel, or with skips soakTermModel.
func fenceModel(skips bool) porcupine.Model {
	m := &porcupine.NondeterministicModel{
		Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
			byTarget := map[string][]porcupine.Operation{}
			var names []string
			for _, op := range history {
				name := op.Input.(soakInput).Target
				if byTarget[name] == nil {
					names = append(names, name)
				}
				byTarget[name] = append(byTarget[name], op)
			}
			var parts [][]porcupine.Operation
			for _, name := range names {
				parts = append(parts, byTarget[name])
			}
			return parts
		},
		Init: func() []any { return []any{int64(0)} },
		Step: func(state, input, output any) []any {
			s, in, out := state.(int64), input.(soakInput), output.(soakOutput)
			switch {
			case in.Op == "acquire" && out.Fence == 0:
				return []any{s, s + 1}
			case in.Op == "acquire" && (out.Fence == s+1 || skips && out.Fence > s):
				return []any{out.Fence}
			case in.Op == "write" && out.Result == "ok" && in.Fence == s:
				return []any{s}
			case in.Op == "write" && out.Result == "stale" && in.Fence < s:
				return []any{s}
			}
			return nil
		},
		DescribeOperation: func(input, output any) string {
			in, out := input.(soakInput), output.(soakOutput)
			if in.Op == "acquire" {
				if out.Fence == 0 {
					return "acquire -> ?"
				}
				return fmt.Sprintf("acquire -> %d", out.Fence)
			}
			return fmt.Sprintf("write(%d) -> %s", in.Fence, out.Result)
		},
	}
	return m.ToModel()
}

// runSoakChild loops over its targets until its standard input ends: it
// acquires one at random (waiting at most 3 s), writes twice with its
// fence, and releases it, printing a soakEvent line before and after each
// operation.
func runSoakChild(out *childOut) error {
	ctx := context.Background()
	pool, c, _, err := childClient(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	defer c.Close()
	var targets []faultTarget
	for _, s := range strings.Split(os.Getenv(soakTargetsEnv), ",") {
		target, err := parseFaultTarget(s)
		if err != nil {
			return err
		}
		targets = append(targets, target)
	}
	var stop atomic.Bool
	go func() {
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() && in.Text() != "stop" {
		}
		stop.Store(true)
	}()
	emit := func(e soakEvent) {
		e.T = time.Now().UnixNano()
		b, _ := json.Marshal(e)
		out.printf("%s", b)
	}
	me := fmt.Sprintf("child-%d", os.Getpid())
	for seq := 0; !stop.Load(); seq++ {
		target := targets[rand.IntN(len(targets))]
		id := fmt.Sprintf("%s-%d", me, seq)
		if s, ok := target.(semaphoreTarget); ok {
			s.soakRound(ctx, c, pool, id, emit)
			continue
		}
		emit(soakEvent{Ev: "call", ID: id, Op: "acquire", Target: target.String()})
		actx, cancel := context.WithTimeout(ctx, 3*time.Second)
		h, err := target.acquire(actx, c)
		cancel()
		if err != nil {
			emit(soakEvent{Ev: "ret", ID: id, Result: "error", Err: err.Error()})
			time.Sleep(50 * time.Millisecond) // the server may be restarting
			continue
		}
		emit(soakEvent{Ev: "ret", ID: id, Result: "ok", Fence: h.Fence()})
		for w := range 2 {
			wid := fmt.Sprintf("%s-w%d", id, w)
			emit(soakEvent{Ev: "call", ID: wid, Op: "write", Target: target.String(), Fence: h.Fence()})
			wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			err := fencedWrite(wctx, pool, target, h.Fence(), me, wid)
			cancel()
			switch {
			case err == nil:
				emit(soakEvent{Ev: "ret", ID: wid, Result: "ok"})
			case errors.Is(err, ErrStaleFence):
				emit(soakEvent{Ev: "ret", ID: wid, Result: "stale"})
			default:
				emit(soakEvent{Ev: "ret", ID: wid, Result: "error", Err: err.Error()})
			}
			time.Sleep(time.Duration(rand.IntN(5)) * time.Millisecond) // the critical section's work
		}
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_ = h.release(rctx)
		cancel()
	}
	return nil
}

// soakHistory collects the events of every child.
type soakHistory struct {
	mu     sync.Mutex
	calls  map[string]soakEvent
	rets   map[string]soakEvent
	losses []soakEvent // "lost" events of permits
	errors []string
}

func (h *soakHistory) read(p *faultProc) {
	for line := range p.Lines() {
		var e soakEvent
		if err := json.Unmarshal([]byte(line), &e); err != nil {
			h.mu.Lock()
			h.errors = append(h.errors, fmt.Sprintf("child %d: %s", p.Pid(), line))
			h.mu.Unlock()
			continue
		}
		h.mu.Lock()
		if e.Ev == "lost" {
			h.losses = append(h.losses, e)
		} else if e.Ev == "call" {
			h.calls[e.ID] = e
		} else {
			h.rets[e.ID] = e
		}
		h.mu.Unlock()
	}
}

// soakFigures are what a soak run reports.
type soakFigures struct {
	acquired, acquireUnknown               int
	written, stale, writeUnknown           int
	resolvedWritten, resolvedNotFound      int
	permits, permitsReleased, permitFailed int
	faults                                 map[string]int
	maxFence                               map[string]int64
}

// operations turns the history into porcupine operations, resolving the
// writes whose outcome the child did not see with the rows of
// fault_writes (ops: the ids of the rows). Operations cut short have no
// return: they may take effect until the end of time.
func (h *soakHistory) operations(ops map[string]bool, f *soakFigures) []porcupine.Operation {
	var out []porcupine.Operation
	for id, call := range h.calls {
		if call.Op == "permit" {
			out = append(out, h.permitOperations(id, call, f)...)
			continue
		} else if call.Op == "unpermit" {
			continue // with its permit
		}
		ret, returned := h.rets[id]
		end := int64(math.MaxInt64)
		if returned {
			end = ret.T
		}
		in := soakInput{Op: call.Op, Target: call.Target, Fence: call.Fence}
		var o soakOutput
		switch {
		case call.Op == "acquire" && returned && ret.Result == "ok":
			o.Fence = ret.Fence
			f.acquired++
			f.maxFence[call.Target] = max(f.maxFence[call.Target], ret.Fence)
		case call.Op == "acquire":
			f.acquireUnknown++
		case returned && ret.Result == "ok":
			o.Result = "ok"
			f.written++
		case returned && ret.Result == "stale":
			o.Result = "stale"
			f.stale++
		default: // a write that failed or was cut short: did it commit?
			f.writeUnknown++
			if !ops[id] {
				f.resolvedNotFound++
				continue // it did not: it constrains nothing
			}
			f.resolvedWritten++
			o.Result = "ok"
		}
		out = append(out, porcupine.Operation{Input: in, Call: call.T, Output: o, Return: end})
	}
	return out
}

// checkSoakHistory checks a history against model, writing a
// visualization of an illegal one to a file named in the error.
func checkSoakHistory(model porcupine.Model, ops []porcupine.Operation, timeout time.Duration) error {
	res, info := porcupine.CheckOperationsVerbose(model, ops, timeout)
	switch res {
	case porcupine.Ok:
		return nil
	case porcupine.Unknown:
		return fmt.Errorf("porcupine did not finish checking %d operations within %v", len(ops), timeout)
	}
	path := fmt.Sprintf("%s/pgcoord-soak-%d.html", os.TempDir(), time.Now().UnixNano())
	if err := porcupine.VisualizePath(model, info, path); err != nil {
		return fmt.Errorf("history is not linearizable (visualization failed: %v)", err)
	}
	return fmt.Errorf("history is not linearizable: see %s", path)
}

// The checker itself: it accepts a legal history, and catches a write
// accepted with a fence that is no longer the newest (two holders'
// accepted writes interleaving), a fence issued twice, and a fence that
// goes backwards. The election's model accepts a term that skips fences,
// and catches the same faults.
func TestFaultSoakChecker(t *testing.T) {
	t.Parallel()
	acq := func(call, ret, fence int64) porcupine.Operation {
		return porcupine.Operation{Input: soakInput{Op: "acquire", Target: "x"}, Call: call, Output: soakOutput{Fence: fence}, Return: ret}
	}
	write := func(call, ret, fence int64, result string) porcupine.Operation {
		return porcupine.Operation{Input: soakInput{Op: "write", Target: "x", Fence: fence}, Call: call, Output: soakOutput{Result: result}, Return: ret}
	}
	fences, terms := soakFenceModel(), soakTermModel()
	for _, tc := range []struct {
		name       string
		ops        []porcupine.Operation
		legal      bool
		termsLegal bool
	}{
		{"legal", []porcupine.Operation{acq(0, 1, 1), write(2, 3, 1, "ok"), acq(4, 5, 0), acq(6, 7, 3), write(8, 9, 1, "stale"), write(8, 9, 3, "ok")}, true, true},
		{"cut short", []porcupine.Operation{acq(0, 1, 1), write(2, math.MaxInt64, 1, "ok"), acq(4, 5, 2), write(6, 7, 2, "ok")}, true, true},
		{"skipped fence", []porcupine.Operation{acq(0, 1, 1), write(2, 3, 1, "ok"), acq(4, 5, 3), write(6, 7, 1, "stale"), write(6, 7, 3, "ok")}, false, true},
		{"interleaved writes", []porcupine.Operation{acq(0, 1, 1), acq(2, 3, 2), write(4, 5, 1, "ok")}, false, false},
		{"interleaved writes after a skip", []porcupine.Operation{acq(0, 1, 1), acq(2, 3, 4), write(4, 5, 1, "ok")}, false, false},
		{"fence issued twice", []porcupine.Operation{acq(0, 1, 1), acq(2, 3, 1)}, false, false},
		{"fence backwards", []porcupine.Operation{acq(0, 1, 1), acq(2, 3, 2), acq(4, 5, 0), acq(6, 7, 2)}, false, false},
		{"term backwards", []porcupine.Operation{acq(0, 1, 3), acq(2, 3, 2)}, false, false},
		{"stale without a newer fence", []porcupine.Operation{acq(0, 1, 1), write(2, 3, 1, "stale")}, false, false},
	} {
		for _, m := range []struct {
			name  string
			model porcupine.Model
			legal bool
		}{{"fences", fences, tc.legal}, {"terms", terms, tc.termsLegal}} {
			err := checkSoakHistory(m.model, tc.ops, time.Minute)
			if (err == nil) != m.legal {
				t.Errorf("%s, %s: %v, want legal=%v", tc.name, m.name, err, m.legal)
			}
			if err != nil {
				_ = os.Remove(strings.TrimPrefix(err.Error(), "history is not linearizable: see "))
			}
		}
	}
}

// A soak: four child processes contend for three locks and two elections
// (a child campaigns, writes twice with its term as the fence, and
// resigns) for -soak long while faults come every 1.5 s, in turn: the
// backend of a lock holder, leader or leader's guard terminated, a child
// killed with SIGKILL (and replaced), a child paused
// while its backends are terminated (SIGCONT after 1 s), a child paused for
// twice its loss deadline, a fast server restart, and a server crash.
// The history must be linearizable (see the top of this file), and the
// accepted writes in fault_writes must show no fence going backwards.
func TestFaultSoak(t *testing.T) {
	if *soakFor == 0 {
		t.Skip("soak: give -soak=DURATION to run it, e.g. go test -run Soak -soak=60s")
	}
	const children, loss, beat = 4, 2 * time.Second, 500 * time.Millisecond
	srv := pgtest.NewServer(t)
	dsn := srv.DB(t)
	pool := faultTables(t, dsn)
	if _, err := pool.Exec(testCtx(t), soakPermitsTable); err != nil {
		t.Fatal(err)
	}
	kinds := soakKinds()
	var names []string
	for _, k := range kinds {
		for _, target := range k.targets {
			names = append(names, target.String())
		}
	}

	h := &soakHistory{calls: map[string]soakEvent{}, rets: map[string]soakEvent{}}
	var readers sync.WaitGroup
	procs := make([]*faultProc, children)
	spawn := func(slot int) {
		p := startFaultChild(t, "soak", dsn, kinds[0].targets[0], childOptions(loss, beat)+fmt.Sprintf(",app=soak-%d", slot),
			soakTargetsEnv+"="+strings.Join(names, ","))
		procs[slot] = p
		readers.Go(func() { h.read(p) })
	}
	for i := range children {
		spawn(i)
	}

	admin := pgtest.Pool(t, dsn)
	terminate := func(where string, args ...any) int {
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		var n int
		err := admin.QueryRow(ctx, "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE "+where, args...).Scan(&n)
		if err != nil {
			admin.Reset() // after a restart
			t.Logf("terminate: %v", err)
		}
		return n
	}
	// holderSlot picks a child that holds a lock now, if any, so that a
	// pause catches it inside its critical section.
	holderSlot := func() int {
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		var slot int
		err := admin.QueryRow(ctx, `SELECT substr(application_name, 6)::int FROM pg_stat_activity JOIN pg_locks USING (pid)
			WHERE locktype = 'advisory' AND granted AND application_name LIKE 'soak-%' ORDER BY random() LIMIT 1`).Scan(&slot)
		if err != nil {
			admin.Reset()
			return rand.IntN(children)
		}
		return slot
	}
	f := soakFigures{faults: map[string]int{}, maxFence: map[string]int64{}}
	faults := []func(){
		func() {
			if terminate("pid = (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted ORDER BY random() LIMIT 1)") > 0 {
				f.faults["terminate holder"]++
			}
		},
		func() {
			slot := rand.IntN(children)
			procs[slot].Kill(t)
			spawn(slot)
			f.faults["kill -9 child"]++
		},
		func() {
			slot := holderSlot()
			procs[slot].Signal(syscall.SIGSTOP)
			terminate("application_name = $1", fmt.Sprintf("soak-%d", slot))
			time.Sleep(time.Second) // others take over meanwhile
			procs[slot].Signal(syscall.SIGCONT)
			f.faults["pause + terminate"]++
		},
		func() {
			slot := holderSlot()
			procs[slot].Signal(syscall.SIGSTOP)
			time.Sleep(2 * loss) // past its loss deadline, its locks still held
			procs[slot].Signal(syscall.SIGCONT)
			f.faults["pause past the loss deadline"]++
		},
		func() { srv.Restart(t); f.faults["server restart"]++ },
		func() { srv.Crash(t); f.faults["server crash"]++ },
	}
	start := time.Now()
	for i := 0; time.Since(start) < *soakFor; i++ {
		time.Sleep(1500 * time.Millisecond)
		faults[i%len(faults)]()
	}
	for _, p := range procs {
		p.Signal(syscall.SIGCONT)
		p.Send(t, "stop") // the child stops at its next iteration
	}
	for _, p := range procs {
		select {
		case <-p.Exited():
			// A child that stopped by itself also passed the race detector.
			if err := p.ExitErr(); err != nil {
				t.Errorf("soak child %d: %v\n%s", p.Pid(), err, p.Stderr())
			}
		case <-time.After(testTimeout):
			t.Errorf("soak child %d did not stop within %v", p.Pid(), testTimeout)
			p.Kill(t)
		}
	}
	readers.Wait()

	// Which writes committed, and in what order.
	ctx := testCtx(t)
	pool.Reset()
	rows, err := pool.Query(ctx, "SELECT target, fence, coalesce(op, '') FROM fault_writes ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		Target string
		Fence  int64
		Op     string
	}
	written, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		t.Fatal(err)
	}
	committed := map[string]bool{}
	last := map[string]int64{}
	backwards := 0
	for _, r := range written {
		committed[r.Op] = true
		if r.Fence < last[r.Target] {
			backwards++
			t.Errorf("fault_writes: %s written with fence %d after fence %d", r.Target, r.Fence, last[r.Target])
		}
		last[r.Target] = r.Fence
	}

	h.mu.Lock()
	ops := h.operations(committed, &f)
	for _, e := range h.errors {
		t.Logf("soak child: %s", e)
	}
	h.mu.Unlock()
	for id, call := range h.calls {
		if ret, ok := h.rets[id]; ok && call.Op == "write" && ret.Result == "ok" && !committed[id] {
			t.Errorf("write %s returned ok but is not in fault_writes", id)
		}
	}
	t.Logf("soak of %v with %d children: %d operations: %d acquires returned a fence, %d failed or were cut short; "+
		"%d writes accepted, %d refused as stale, %d failed or cut short (%d of them committed, %d not)",
		*soakFor, children, len(h.calls), f.acquired, f.acquireUnknown, f.written, f.stale, f.writeUnknown, f.resolvedWritten, f.resolvedNotFound)
	t.Logf("faults injected: %v", f.faults)
	illegal := 0
	checked := time.Now()
	for _, k := range kinds {
		var mine []porcupine.Operation
		for _, op := range ops {
			if slices.ContainsFunc(k.targets, func(x faultTarget) bool { return x.String() == op.Input.(soakInput).Target }) {
				mine = append(mine, op)
			}
		}
		t.Logf("%s: %d operations", k.name, len(mine))
		if err := checkSoakHistory(k.model, mine, 10*time.Minute); err != nil {
			illegal++
			t.Errorf("%s: %v", k.name, err)
		}
	}
	stored := storedFences(t, testCtx(t), pool, &config{schema: DefaultSchema})
	checkSoakPermits(t, pool, h, &f)
	t.Logf("porcupine checked the histories in %v: %d not linearizable; fences going backwards in fault_writes: %d; highest fence returned per target: %v; fences table: %v",
		time.Since(checked).Round(time.Millisecond), illegal, backwards, f.maxFence, stored)
}
