package pgcoord

// The soak: child processes contend for targets while a fault injector
// cycles through faults, and the recorded history is checked with
// porcupine, the linearizability checker of etcd's robustness tests. A
// short run (15 s of faults, and at least one of each kind) is part of the
// normal suite; give a longer one with -soak:
//
//	go test -race -run 'TestFaultSoak$' -soak=60s .
//
// Every child loops: acquire a target (with a fence), make two fenced
// writes (CheckFence, then a check in pg_locks that the writer's backend
// holds the key, then an insert into fault_writes, in one transaction),
// release. Each operation is recorded with its call and return times;
// operations cut short by a fault are resolved afterwards (a write's row
// is looked up by its id). The history of each lock must be linearizable
// against soakFenceModel: fences are issued one after another to one
// holder at a time, which holds the lock until its release; a write is
// accepted only from the holder while its fence is the newest, and refused
// as stale only once its writer no longer holds the lock. Independently,
// fault_writes read in insertion order must show each target's fences
// never decreasing, and a write that found its key not held, or was
// refused as stale, must be followed by the hold reporting ErrLockLost.
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

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/anishathalye/porcupine"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

var soakFor = flag.Duration("soak", 15*time.Second,
	"how long TestFaultSoak injects faults; it injects at least one of each kind, whatever this says (CI passes -soak=60s)")

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
	Ev      string `json:"ev"`                // "call" or "ret"; "lost" for a hold found lost (see soakAwaitLoss)
	ID      string `json:"id"`                // unique across the run
	Op      string `json:"op,omitempty"`      // call: "acquire", "write" or "release"; "permit" or "unpermit" (its release)
	Target  string `json:"target,omitempty"`  // call; lost
	Holder  string `json:"holder,omitempty"`  // call of a write or a release: the id of the acquire
	Fence   int64  `json:"fence,omitempty"`   // call of a write; ret of an acquire that succeeded; a permit's slot plus one
	Result  string `json:"result,omitempty"`  // ret: "ok", "stale" (a write's ErrStaleFence) or "error"; lost: "reported" or "silent"
	NotHeld bool   `json:"notheld,omitempty"` // ret of a write: pg_locks did not show the writer's backend holding the key
	Err     string `json:"err,omitempty"`
	T       int64  `json:"t"`              // Unix nanoseconds
	From    int64  `json:"from,omitempty"` // call of a permit's release: when the server was last seen holding its slot
}

// soakInput and soakOutput are an operation as the model sees it.
type soakInput struct {
	Op     string // "acquire", "write", "release"; "permit", "unpermit"
	Target string
	Fence  int64  // of a write; a permit's slot plus one, of its end
	Holder string // the acquire id of the hold (of an acquire, a write, a release, a permit and its end)
}

type soakOutput struct {
	Fence  int64  // of an acquire; 0 when unknown (it failed, or was cut short)
	Result string // of a write: "ok" or "stale"
}

// soakFenceModel is one lock with fences. The state is the newest fence
// issued and the acquire that holds the lock. An acquire that returned
// fence f took effect when nobody held the lock and f was the next fence;
// one whose outcome is unknown may or may not have issued one (while it
// held the lock for a moment). A release ends its own hold. A write
// accepted with fence f took effect while its writer held the lock and f
// was the newest fence; a write refused as stale, after a newer fence was
// issued, hence after its writer's hold had ended: a stale write from a
// holder whose hold then ends in a clean release is two holders at once.
func soakFenceModel() porcupine.Model { return fenceModel(true, false) }

// soakTermModel is a model of an election, whose terms are fences: a
// campaign may issue fences it never returns (its lock lost while it was
// winning, the campaign went on), so the term a campaign returns is greater
// than the newest fence, not necessarily the next one. It does not follow
// holds (a Resign returns nil also for a leadership already lost): a write
// is accepted only while its term is the newest, refused only after a
// newer one exists.
func soakTermModel() porcupine.Model { return fenceModel(false, true) }

// soakState is the state of fenceModel.
type soakState struct {
	fence  int64  // the newest fence issued
	holder string // the acquire that holds the target, "" for none; always "" without holds
}

// fenceModel is soakFenceModel (holds) or soakTermModel (skips).
func fenceModel(holds, skips bool) porcupine.Model {
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
		Init: func() []any { return []any{soakState{}} },
		Step: func(state, input, output any) []any {
			s, in, out := state.(soakState), input.(soakInput), output.(soakOutput)
			free := !holds || s.holder == ""
			switch in.Op {
			case "acquire":
				var holder string
				if holds {
					holder = in.Holder
				}
				switch {
				case out.Fence == 0 && free:
					return []any{s, soakState{s.fence + 1, ""}}
				case out.Fence == 0:
					return []any{s}
				case free && (out.Fence == s.fence+1 || skips && out.Fence > s.fence):
					return []any{soakState{out.Fence, holder}}
				}
			case "release":
				if !holds {
					return []any{s}
				}
				if s.holder == in.Holder {
					return []any{soakState{s.fence, ""}}
				}
			case "write":
				mine := !holds || s.holder == in.Holder
				if out.Result == "ok" && in.Fence == s.fence && mine {
					return []any{s}
				}
				if out.Result == "stale" && in.Fence < s.fence && (!holds || !mine) {
					return []any{s}
				}
			}
			return nil
		},
		DescribeOperation: func(input, output any) string {
			in, out := input.(soakInput), output.(soakOutput)
			switch in.Op {
			case "acquire":
				if out.Fence == 0 {
					return in.Holder + ": acquire -> ?"
				}
				return fmt.Sprintf("%s: acquire -> %d", in.Holder, out.Fence)
			case "release":
				return in.Holder + ": release"
			}
			return fmt.Sprintf("%s: write(%d) -> %s", in.Holder, in.Fence, out.Result)
		},
		DescribeState: func(state any) string {
			s := state.(soakState)
			return fmt.Sprintf("fence %d, held by %q", s.fence, s.holder)
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
	defer c.Close(context.Background())
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
		emit(soakEvent{Ev: "ret", ID: id, Result: "ok", Fence: int64(h.Fence())})
		lossChecked := false
		for w := range 2 {
			wid := fmt.Sprintf("%s-w%d", id, w)
			emit(soakEvent{Ev: "call", ID: wid, Op: "write", Target: target.String(), Holder: id, Fence: int64(h.Fence())})
			wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			held, err := soakWrite(wctx, pool, target, h, me, wid)
			cancel()
			var lost string
			switch {
			case err == nil:
				emit(soakEvent{Ev: "ret", ID: wid, Result: "ok", NotHeld: !held})
				if !held {
					lost = fmt.Sprintf("write %s was accepted, but pg_locks did not show backend %d holding the key", wid, h.pid())
				}
			case errors.Is(err, ErrStaleFence):
				emit(soakEvent{Ev: "ret", ID: wid, Result: "stale"})
				lost = fmt.Sprintf("write %s with fence %d was refused as stale", wid, h.Fence())
			default:
				emit(soakEvent{Ev: "ret", ID: wid, Result: "error", Err: err.Error()})
			}
			if lost != "" && !lossChecked {
				lossChecked = true
				soakAwaitLoss(id, target.String(), lost, h, emit)
			}
			time.Sleep(time.Duration(5+rand.IntN(20)) * time.Millisecond) // the critical section's work: long enough for others to queue
		}
		rid := id + "/release"
		emit(soakEvent{Ev: "call", ID: rid, Op: "release", Target: target.String(), Holder: id})
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err = h.release(rctx)
		cancel()
		// A release is clean when it returned nil for a hold that was not
		// lost before (a Resign returns nil for a lost leadership too).
		if err == nil && !errors.Is(h.Err(), ErrLockLost) {
			emit(soakEvent{Ev: "ret", ID: rid, Result: "ok"})
		} else {
			emit(soakEvent{Ev: "ret", ID: rid, Result: "error", Err: fmt.Sprintf("%v; the hold: %v", err, h.Err())})
		}
	}
	return nil
}

// soakHeldSQL reports whether pg_locks shows backend $1 holding the
// bigint key $2, granted.
const soakHeldSQL = `SELECT EXISTS (SELECT FROM pg_locks
	WHERE locktype = 'advisory' AND granted AND pid = $1 AND objsubid = 1
	  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
	  AND ((classid::bigint << 32) | objid::bigint) = $2)`

// soakWrite is fencedWrite by the holder h of target, which also reads,
// in the same transaction and after the fence check (which holds off any
// newer fence until the transaction ends), whether pg_locks shows h's
// backend holding the target's key. The row records the answer in held.
func soakWrite(ctx context.Context, pool *pgxpool.Pool, target faultTarget, h faultHold, writer, op string) (held bool, err error) {
	k, ok := target.(interface{ key() Key }).key().Int64()
	if !ok {
		return false, fmt.Errorf("%v: not a bigint key", target)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := target.check(ctx, tx, int64(h.Fence())); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, soakHeldSQL, h.pid(), k).Scan(&held); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "INSERT INTO fault_writes (target, fence, writer, op, held) VALUES ($1, $2, $3, $4, $5)",
			target.String(), h.Fence(), writer, op, held)
		return err
	})
	return held, err
}

// soakAwaitLoss is called for the hold id of target when the server has
// shown that it is no longer held (why says how): the hold must report
// ErrLockLost within soakLossBound. It emits a "lost" event: "reported",
// or "silent" when the hold ended otherwise or not in time.
func soakAwaitLoss(id, target, why string, h interface {
	Done() <-chan struct{}
	Err() error
}, emit func(soakEvent)) {
	select {
	case <-h.Done():
		if errors.Is(h.Err(), ErrLockLost) {
			emit(soakEvent{Ev: "lost", ID: id, Target: target, Result: "reported", Err: h.Err().Error()})
			return
		}
		emit(soakEvent{Ev: "lost", ID: id, Target: target, Result: "silent", Err: fmt.Sprintf("%s, and the hold ended with %v", why, h.Err())})
	case <-time.After(soakLossBound):
		emit(soakEvent{Ev: "lost", ID: id, Target: target, Result: "silent", Err: fmt.Sprintf("%s, and the hold was not lost %v later", why, soakLossBound)})
	}
}

// soakHistory collects the events of every child.
type soakHistory struct {
	mu     sync.Mutex
	calls  map[string]soakEvent
	rets   map[string]soakEvent
	losses []soakEvent // "lost" events
	errors []string
	// killed has, for each child killed with SIGKILL ("child-PID"), when it
	// had been reaped (Unix nanoseconds): its sockets were closed by then.
	killed map[string]int64
}

func newSoakHistory() *soakHistory {
	return &soakHistory{calls: map[string]soakEvent{}, rets: map[string]soakEvent{}, killed: map[string]int64{}}
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

// soakClosedBound is how long after its connection was closed a hold may
// still be held on the server: the server frees the locks of a closed
// connection at once (promise 1 of RELIABILITY.md: a contender gets them
// within 1 s).
const soakClosedBound = time.Second

// endBy returns the latest time at which the hold acquired by the
// operation id can have ended on the server if its release was not clean:
// soakClosedBound after a release that returned an error (which closed
// the connection before it returned) or after the child was reaped from
// SIGKILL; never, as far as the history knows, otherwise.
func (h *soakHistory) endBy(id string) int64 {
	end := int64(math.MaxInt64)
	if r, ok := h.rets[id+"/release"]; ok {
		end = r.T + int64(soakClosedBound)
	}
	child, _, _ := strings.Cut(strings.TrimPrefix(id, "child-"), "-")
	if k, ok := h.killed["child-"+child]; ok {
		end = min(end, k+int64(soakClosedBound))
	}
	return end
}

// soakFigures are what a soak run reports.
type soakFigures struct {
	acquired, acquireUnknown               int
	written, stale, writeUnknown           int
	resolvedWritten, resolvedNotFound      int
	notHeld                                int // writes accepted whose writer's backend did not hold the key
	released, releaseFailed                int
	permits, permitsReleased, permitFailed int
	faults                                 map[string]int
	maxFence                               map[string]int64
	perTarget                              map[string]*soakTargetFigures
}

// soakTargetFigures are the figures of one target.
type soakTargetFigures struct{ acquired, written int }

func (f *soakFigures) target(name string) *soakTargetFigures {
	if f.perTarget[name] == nil {
		f.perTarget[name] = &soakTargetFigures{}
	}
	return f.perTarget[name]
}

// operations turns the history into porcupine operations, resolving the
// writes whose outcome the child did not see with the rows of
// fault_writes (ops: the ids of the rows). Operations cut short have no
// return: they may take effect until the end of time, except the end of a
// hold, bounded by endBy.
func (h *soakHistory) operations(ops map[string]bool, f *soakFigures) []porcupine.Operation {
	var out []porcupine.Operation
	for id, call := range h.calls {
		if call.Op == "permit" {
			out = append(out, h.permitOperations(id, call, f)...)
			continue
		} else if call.Op == "unpermit" || call.Op == "release" {
			continue // with its acquire
		}
		ret, returned := h.rets[id]
		end := int64(math.MaxInt64)
		if returned {
			end = ret.T
		}
		in := soakInput{Op: call.Op, Target: call.Target, Fence: call.Fence, Holder: call.Holder}
		var o soakOutput
		switch {
		case call.Op == "acquire" && returned && ret.Result == "ok":
			in.Holder = id
			o.Fence = ret.Fence
			f.acquired++
			f.target(call.Target).acquired++
			f.maxFence[call.Target] = max(f.maxFence[call.Target], ret.Fence)
			out = append(out, h.releaseOperation(id, call, f))
		case call.Op == "acquire":
			in.Holder = id
			f.acquireUnknown++
		case returned && ret.Result == "ok":
			o.Result = "ok"
			f.written++
			f.target(call.Target).written++
			if ret.NotHeld {
				f.notHeld++
			}
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

// releaseOperation is the end of the hold that the acquire id (called)
// returned: within its release when that was clean, otherwise
// at any time after the acquire was called and no later than endBy. A
// hold that was not released cleanly may have ended before its acquire
// returned: a child paused between the grant and the return while its
// backend was terminated resumes and returns a lock already lost, which no
// lock can prevent (its writes are refused as stale).
func (h *soakHistory) releaseOperation(id string, called soakEvent, f *soakFigures) porcupine.Operation {
	op := porcupine.Operation{Input: soakInput{Op: "release", Target: called.Target, Holder: id}, Call: called.T, Output: soakOutput{}, Return: h.endBy(id)}
	rcall, ok := h.calls[id+"/release"]
	if rret, returned := h.rets[id+"/release"]; ok && returned && rret.Result == "ok" {
		op.Call, op.Return = rcall.T, rret.T
		f.released++
	} else {
		f.releaseFailed++
	}
	return op
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
// goes backwards. The lock's model also catches two holders at once: a
// lock acquired while another hold lasts until a clean release, the stale
// write of such a holder, and a write after its writer's release. The
// election's model accepts a term that skips fences, and catches the same
// faults except those of holds.
func TestFaultSoakChecker(t *testing.T) {
	t.Parallel()
	const never = math.MaxInt64
	acq := func(who string, call, ret, fence int64) porcupine.Operation {
		return porcupine.Operation{Input: soakInput{Op: "acquire", Target: "x", Holder: who}, Call: call, Output: soakOutput{Fence: fence}, Return: ret}
	}
	write := func(who string, call, ret, fence int64, result string) porcupine.Operation {
		return porcupine.Operation{Input: soakInput{Op: "write", Target: "x", Fence: fence, Holder: who}, Call: call, Output: soakOutput{Result: result}, Return: ret}
	}
	rel := func(who string, call, ret int64) porcupine.Operation {
		return porcupine.Operation{Input: soakInput{Op: "release", Target: "x", Holder: who}, Call: call, Output: soakOutput{}, Return: ret}
	}
	locks, terms := soakFenceModel(), soakTermModel()
	for _, tc := range []struct {
		name       string
		ops        []porcupine.Operation
		legal      bool
		termsLegal bool
	}{
		{"legal", []porcupine.Operation{acq("a", 0, 1, 1), write("a", 2, 3, 1, "ok"), rel("a", 4, 5), acq("b", 6, 7, 0), acq("c", 8, 9, 3), write("c", 10, 11, 3, "ok"), rel("c", 12, 13)}, true, true},
		{"lost holder's stale write", []porcupine.Operation{acq("a", 0, 1, 1), rel("a", 1, 20), acq("b", 4, 5, 2), write("a", 6, 7, 1, "stale"), write("b", 6, 7, 2, "ok"), rel("b", 8, 9)}, true, true},
		{"holder paused between its grant and its return", []porcupine.Operation{acq("a", 0, 10, 1), rel("a", 0, 30), acq("b", 4, 5, 2), write("b", 6, 7, 2, "ok"), rel("b", 8, 9), write("a", 11, 12, 1, "stale")}, true, true},
		{"cut short", []porcupine.Operation{acq("a", 0, 1, 1), write("a", 2, never, 1, "ok"), rel("a", 1, never), acq("b", 4, 5, 2), write("b", 6, 7, 2, "ok")}, true, true},
		{"skipped fence", []porcupine.Operation{acq("a", 0, 1, 1), write("a", 2, 3, 1, "ok"), rel("a", 3, never), acq("b", 4, 5, 3), write("a", 6, 7, 1, "stale"), write("b", 6, 7, 3, "ok")}, false, true},
		{"interleaved writes", []porcupine.Operation{acq("a", 0, 1, 1), rel("a", 1, never), acq("b", 2, 3, 2), write("a", 4, 5, 1, "ok")}, false, false},
		{"interleaved writes after a skip", []porcupine.Operation{acq("a", 0, 1, 1), rel("a", 1, never), acq("b", 2, 3, 4), write("a", 4, 5, 1, "ok")}, false, false},
		{"fence issued twice", []porcupine.Operation{acq("a", 0, 1, 1), rel("a", 1, 2), acq("b", 2, 3, 1)}, false, false},
		{"fence backwards", []porcupine.Operation{acq("a", 0, 1, 1), rel("a", 1, 2), acq("b", 2, 3, 2), rel("b", 3, 4), acq("c", 4, 5, 0), acq("d", 6, 7, 2)}, false, false},
		{"term backwards", []porcupine.Operation{acq("a", 0, 1, 3), rel("a", 1, 2), acq("b", 2, 3, 2)}, false, false},
		{"stale without a newer fence", []porcupine.Operation{acq("a", 0, 1, 1), write("a", 2, 3, 1, "stale")}, false, false},
		{"stale write of a concurrent holder", []porcupine.Operation{acq("a", 0, 1, 1), acq("b", 2, 3, 2), write("a", 4, 5, 1, "stale"), rel("a", 6, 7), rel("b", 8, 9)}, false, true},
		{"two holders at once", []porcupine.Operation{acq("a", 0, 1, 1), acq("b", 2, 3, 2), rel("a", 4, 5), rel("b", 6, 7)}, false, true},
		{"write after its release", []porcupine.Operation{acq("a", 0, 1, 1), rel("a", 2, 3), write("a", 4, 5, 1, "ok")}, false, true},
	} {
		for _, m := range []struct {
			name  string
			model porcupine.Model
			legal bool
		}{{"locks", locks, tc.legal}, {"terms", terms, tc.termsLegal}} {
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

// A soak: four child processes contend for three locks, two elections (a
// child campaigns, writes twice with its term as the fence, and resigns)
// and a semaphore's permits for -soak long (15 s by default), and at least
// until one fault of each kind has come, while faults come every 1.5 s, in
// turn: the backend of a lock holder, leader or leader's guard terminated,
// a child killed with SIGKILL (and replaced), a child paused while its
// backends are terminated (SIGCONT after 1 s), a child paused for twice
// its loss deadline, a fast server restart, and a server crash. The
// history must be linearizable (see the top of this file), the accepted
// writes in fault_writes must show no fence going backwards, every hold
// that the server showed lost must have reported ErrLockLost, no fence
// returned may be above the fences table's, and the run must have done
// enough: a floor of fences returned and writes accepted on every target,
// of permits verified on the server, and one fault of each kind.
func TestFaultSoak(t *testing.T) {
	const children, loss, beat = 4, 2 * time.Second, 500 * time.Millisecond
	srv := pgtest.NewServer(t)
	dsn := srv.DB(t)
	pool := faultTables(t, dsn)
	for _, sql := range []string{soakPermitsTable, "ALTER TABLE fault_writes ADD COLUMN held boolean"} {
		if _, err := pool.Exec(testCtx(t), sql); err != nil {
			t.Fatal(err)
		}
	}
	kinds := soakKinds()
	var names []string
	for _, k := range kinds {
		for _, target := range k.targets {
			names = append(names, target.String())
		}
	}

	h := newSoakHistory()
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
	f := soakFigures{faults: map[string]int{}, maxFence: map[string]int64{}, perTarget: map[string]*soakTargetFigures{}}
	faults := []func(){
		func() {
			if terminate("pid = (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted ORDER BY random() LIMIT 1)") > 0 {
				f.faults["terminate holder"]++
			}
		},
		func() {
			slot := rand.IntN(children)
			procs[slot].Kill(t)
			h.mu.Lock()
			h.killed[fmt.Sprintf("child-%d", procs[slot].Pid())] = time.Now().UnixNano()
			h.mu.Unlock()
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
	// Faults come for -soak, and at least until each kind has come once.
	start := time.Now()
	for i := 0; time.Since(start) < *soakFor || len(f.faults) < len(faults); i++ {
		if time.Since(start) > *soakFor+2*time.Minute {
			t.Fatalf("after %v, only these faults were injected: %v", time.Since(start).Round(time.Second), f.faults)
		}
		time.Sleep(1500 * time.Millisecond)
		faults[i%len(faults)]()
	}
	ran := time.Since(start)
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
	rows, err := pool.Query(ctx, "SELECT target, fence, coalesce(op, ''), held FROM fault_writes ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		Target string
		Fence  int64
		Op     string
		Held   bool
	}
	written, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		t.Fatal(err)
	}
	committed := map[string]bool{}
	last := map[string]int64{}
	backwards, notHeld := 0, 0
	for _, r := range written {
		committed[r.Op] = true
		if r.Fence < last[r.Target] {
			backwards++
			t.Errorf("fault_writes: %s written with fence %d after fence %d", r.Target, r.Fence, last[r.Target])
		}
		last[r.Target] = r.Fence
		if !r.Held {
			notHeld++
		}
	}

	// The readers are done: the history no longer changes.
	ops := h.operations(committed, &f)
	for _, e := range h.errors {
		t.Errorf("soak child wrote a line that is no event: %s", e)
	}
	for id, call := range h.calls {
		if ret, ok := h.rets[id]; ok && call.Op == "write" && ret.Result == "ok" && !committed[id] {
			t.Errorf("write %s returned ok but is not in fault_writes", id)
		}
	}
	var reported, silent int
	for _, e := range h.losses {
		if e.Result == "reported" {
			reported++
			continue
		}
		silent++
		t.Errorf("lost hold %s of %s: %s", e.ID, e.Target, e.Err)
	}
	t.Logf("soak of %v (-soak=%v) with %d children: %d operations: %d acquires returned a fence, %d failed or were cut short; "+
		"%d released cleanly, %d not; %d writes accepted (%d of them found the key not held), %d refused as stale, %d failed or cut short (%d of them committed, %d not); "+
		"%d holds found lost on the server and reported lost, %d lost silently",
		ran.Round(time.Second), *soakFor, children, len(h.calls), f.acquired, f.acquireUnknown, f.released, f.releaseFailed,
		f.written, f.notHeld, f.stale, f.writeUnknown, f.resolvedWritten, f.resolvedNotFound, reported, silent)
	t.Logf("faults injected: %v", f.faults)
	if notHeld < f.notHeld || notHeld > f.notHeld+f.resolvedWritten {
		t.Errorf("fault_writes has %d writes whose writer did not hold the key; the children saw %d, and %d more committed unseen", notHeld, f.notHeld, f.resolvedWritten)
	}

	// Floors: the soak must have done something worth checking.
	floor := max(3, int(*soakFor/(5*time.Second)))
	if len(f.faults) < len(faults) {
		t.Errorf("faults injected: %v, want each of the %d kinds", f.faults, len(faults))
	}
	for _, k := range kinds {
		if k.name == "semaphore" {
			continue // checkSoakPermits
		}
		for _, target := range k.targets {
			tf := f.target(target.String())
			if tf.acquired < floor || tf.written < floor {
				t.Errorf("%v: %d acquires returned a fence and %d writes were accepted, want at least %d of each", target, tf.acquired, tf.written, floor)
			}
		}
	}

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

	// No fence returned is above the fences table's: every fence handed
	// out was committed first, also across the restarts and crashes.
	stored := map[int64]int64{}
	frows, err := pool.Query(ctx, "SELECT key, fence FROM "+(&core.Config{Schema: DefaultSchema}).Table("fences")+" WHERE key_space = 1")
	if err != nil {
		t.Fatal(err)
	}
	var key, fence int64
	if _, err := pgx.ForEachRow(frows, []any{&key, &fence}, func() error { stored[key] = fence; return nil }); err != nil {
		t.Fatal(err)
	}
	storedOf := map[string]int64{}
	for _, k := range kinds {
		for _, target := range k.targets {
			kt, ok := target.(interface{ key() Key })
			if !ok {
				continue
			}
			v, _ := kt.key().Int64()
			storedOf[target.String()] = stored[v]
			if f.maxFence[target.String()] > stored[v] {
				t.Errorf("%v: fence %d returned, above the fences table's %d", target, f.maxFence[target.String()], stored[v])
			}
		}
	}
	checkSoakPermits(t, pool, h, &f, floor)
	t.Logf("porcupine checked the histories in %v: %d not linearizable; fences going backwards in fault_writes: %d; highest fence returned per target: %v; fences table: %v",
		time.Since(checked).Round(time.Millisecond), illegal, backwards, f.maxFence, storedOf)
}
