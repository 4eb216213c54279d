package pgcoord

// The checker of TestLockCoreRandomized (lockcore_random_test.go): it
// reads the records of every process, the nemesis's faults, the stalls the
// processes saw and the table of fenced writes, and reports each breach of
// the lock core's promises with the operation, keys, backends and times
// that show it. The top of lockcore_random_test.go lists what is checked
// and what is allowed.

import (
	"cmp"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// lcRow is one row of lockcore_writes.
type lcRow struct {
	ID     int64
	Key    int64
	Fence  int64
	Holder string // the acquire's id
	Op     string // the write's id
	PID    int32
}

// lcInput is everything the checker looks at.
type lcInput struct {
	t0     int64
	loss   time.Duration
	ops    []lcOp
	faults []lcFault
	stalls []lcSpan
	rows   []lcRow // lockcore_writes in insertion order
}

func (in *lcInput) ts(at int64) string {
	if at == 0 {
		return "never"
	}
	return fmt.Sprintf("+%.3fs", float64(at-in.t0)/1e9)
}

type lcViolation struct {
	kind  string
	at    int64
	msg   string
	group string // violations of one group after the first are counted with it
	more  int
	last  int64
}

type lcReport struct {
	violations []lcViolation
	counts     map[string]int
}

func (r *lcReport) violate(kind string, at int64, format string, args ...any) {
	r.violations = append(r.violations, lcViolation{kind: kind, at: at, msg: fmt.Sprintf(format, args...)})
}

// violateGroup is violate for violations that repeat one cause (a lock
// left on a backend is seen again by every later check of that key there):
// the first of a group is reported, and the others counted with it.
func (r *lcReport) violateGroup(kind, group string, at int64, format string, args ...any) {
	r.violations = append(r.violations, lcViolation{kind: kind, at: at, msg: fmt.Sprintf(format, args...), group: group})
}

// fold sorts the violations by time and folds each group into its first.
func (r *lcReport) fold() {
	slices.SortStableFunc(r.violations, func(a, b lcViolation) int { return cmp.Compare(a.at, b.at) })
	first := map[string]int{}
	var out []lcViolation
	for _, v := range r.violations {
		if v.group != "" {
			if i, ok := first[v.group]; ok {
				out[i].more++
				out[i].last = v.at
				continue
			}
			first[v.group] = len(out)
		}
		out = append(out, v)
	}
	r.violations = out
}

func (r *lcReport) byKind() map[string]int {
	m := map[string]int{}
	for _, v := range r.violations {
		m[v.kind] += 1 + v.more
	}
	return m
}

func (r *lcReport) sum(match func(string) bool) int {
	n := 0
	for k, v := range r.counts {
		if match(k) {
			n += v
		}
	}
	return n
}

// summary is the counts in one line.
func (r *lcReport) summary() string {
	keys := slices.Sorted(func(yield func(string) bool) {
		for k := range r.counts {
			if !yield(k) {
				return
			}
		}
	})
	var b strings.Builder
	for i, k := range keys {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s=%d", k, r.counts[k])
	}
	fmt.Fprintf(&b, "; violations: %d %v", len(r.violations), r.byKind())
	return b.String()
}

// lcIndex is the input arranged for the checks.
type lcIndex struct {
	in         *lcInput
	r          *lcReport
	terminated map[int32]int64    // backend -> when the nemesis asked to terminate it
	terms      []lcFault          // every termination
	busy       map[int][]lcSpan   // per process: pauses and stalls, merged
	lostAt     map[[2]int64]int64 // (process, backend) -> first loss the process reported on it
	opByID     map[string]*lcOp   // acquires that succeeded, by id
	byPID      map[int32][]*lcOp  // acquires that succeeded, by backend
	inTable    map[string]bool    // ids of the writes in lockcore_writes
	fenced     map[int64][]*lcOp  // fenced acquires that succeeded, by key
	sessions   map[int32]*lcOp    // NewSession records, by backend
}

// lcAnalyze checks the records of a run.
func lcAnalyze(in *lcInput) *lcReport {
	x := &lcIndex{
		in: in, r: &lcReport{counts: map[string]int{}},
		terminated: map[int32]int64{}, busy: map[int][]lcSpan{}, lostAt: map[[2]int64]int64{},
		opByID: map[string]*lcOp{}, byPID: map[int32][]*lcOp{}, inTable: map[string]bool{},
		fenced: map[int64][]*lcOp{}, sessions: map[int32]*lcOp{},
	}
	spans := map[int][]lcSpan{}
	for _, f := range in.faults {
		x.r.counts["fault "+f.Kind]++
		if f.PID != 0 {
			x.terms = append(x.terms, f)
			if at, ok := x.terminated[f.PID]; !ok || f.At < at {
				x.terminated[f.PID] = f.At
			}
			continue
		}
		spans[f.Proc] = append(spans[f.Proc], lcSpan{Proc: f.Proc, From: f.At, To: f.End, What: f.Kind})
	}
	for _, s := range in.stalls {
		spans[s.Proc] = append(spans[s.Proc], s)
		x.r.counts["stalls"]++
	}
	for proc, ss := range spans {
		x.busy[proc] = lcMerge(ss)
	}
	for _, row := range in.rows {
		x.inTable[row.Op] = true
	}
	for i := range in.ops {
		op := &in.ops[i]
		if op.Outcome != "ok" || op.PID == 0 {
			continue
		}
		if op.Kind == "NewSession" {
			x.sessions[op.PID] = op
		} else {
			x.opByID[op.ID] = op
			x.byPID[op.PID] = append(x.byPID[op.PID], op)
		}
		if lost, at, _ := op.loss(); lost {
			k := [2]int64{int64(op.Proc), int64(op.PID)}
			if old, ok := x.lostAt[k]; !ok || at < old {
				x.lostAt[k] = at
			}
		}
	}
	for i := range in.ops {
		x.checkOp(&in.ops[i])
	}
	x.checkLossNotices()
	x.checkFences()
	x.checkHistory()
	x.r.fold()
	return x.r
}

// lcMerge merges overlapping spans.
func lcMerge(ss []lcSpan) []lcSpan {
	slices.SortFunc(ss, func(a, b lcSpan) int { return cmp.Compare(a.From, b.From) })
	var out []lcSpan
	for _, s := range ss {
		if n := len(out); n > 0 && s.From <= out[n-1].To {
			out[n-1].To = max(out[n-1].To, s.To)
			continue
		}
		out = append(out, s)
	}
	return out
}

// busyIn returns how long process proc was paused or stalled in [from, to].
func (x *lcIndex) busyIn(proc int, from, to int64) time.Duration {
	var d int64
	for _, s := range x.busy[proc] {
		if lo, hi := max(s.From, from), min(s.To, to); hi > lo {
			d += hi - lo
		}
	}
	return time.Duration(d)
}

// loss reports whether the lock was reported lost, when, and why.
func (op *lcOp) loss() (bool, int64, string) {
	switch {
	case op.DoneLost && op.DoneAt != 0:
		return true, op.DoneAt, op.DoneErr
	case op.UnlockLost:
		return true, op.UnlockAt, op.UnlockErr
	}
	return false, 0, ""
}

// who names an operation in a message.
func (x *lcIndex) who(op *lcOp) string {
	s := fmt.Sprintf("%s (%s of keys %v on %s%d-%d", op.ID, op.Kind, op.Keys, lcApp, op.Proc, op.Client)
	if op.PID != 0 {
		s += fmt.Sprintf(", backend %d", op.PID)
	}
	if op.Session != 0 && op.Session != op.PID {
		s += fmt.Sprintf(", Session backend %d", op.Session)
	}
	if op.Fence != 0 {
		s += fmt.Sprintf(", fence %d", op.Fence)
	}
	return s + fmt.Sprintf(", %s, called %s, returned %s)", op.Bound, x.in.ts(op.Start), x.in.ts(op.Ret))
}

// explainLoss returns why a lock on backend pid of process proc could be
// lost at at: its backend terminated before, or its process paused or
// stalled for L/2 of the L before.
func (x *lcIndex) explainLoss(proc int, pid int32, at int64) (string, bool) {
	if t, ok := x.terminated[pid]; ok && t <= at {
		return fmt.Sprintf("backend %d terminated at %s", pid, x.in.ts(t)), true
	}
	L := x.in.loss
	if b := x.busyIn(proc, at-int64(L)-int64(100*time.Millisecond), at); b >= L/2 {
		return fmt.Sprintf("process %d paused or stalled for %v in the %v before", proc, b.Round(time.Millisecond), L), true
	}
	return "", false
}

// explainFailure returns why an acquire (or NewSession) could fail with a
// lost session or a connection error: its Session was lost before it
// returned (that loss is checked on its own), or a backend of its Client
// was terminated, or its process paused or stalled, around it. The window
// reaches back 2L before the call: a connection the acquire waited for
// may have begun to open then (its timeout is 2L).
func (x *lcIndex) explainFailure(op *lcOp) (string, bool) {
	if s := x.sessions[op.Session]; op.Session != 0 && s != nil && s.DoneAt != 0 && s.DoneAt <= op.Ret {
		return fmt.Sprintf("its Session ended at %s", x.in.ts(s.DoneAt)), true
	}
	L := x.in.loss
	from := op.Start - 2*int64(L) - int64(time.Second)
	for _, f := range x.terms {
		if f.At < from || f.At > op.Ret {
			continue
		}
		if op.Session != 0 && f.PID == op.Session || op.Session == 0 && f.Proc == op.Proc && f.Client == op.Client {
			return fmt.Sprintf("backend %d terminated at %s", f.PID, x.in.ts(f.At)), true
		}
	}
	if b := x.busyIn(op.Proc, op.Start-3*int64(L), op.Ret); b >= L/2 {
		return fmt.Sprintf("process %d paused or stalled for %v meanwhile", op.Proc, b.Round(time.Millisecond)), true
	}
	return "", false
}

// faultsNear lists the faults (in every process) in the 2L before at, for
// a message about something they may explain indirectly.
func (x *lcIndex) faultsNear(at int64) string {
	var b strings.Builder
	n := 0
	for _, f := range x.in.faults {
		if f.End < at-2*int64(x.in.loss) || f.At > at {
			continue
		}
		if n++; n > 6 {
			b.WriteString("; ...")
			break
		}
		if f.PID != 0 {
			fmt.Fprintf(&b, "; %s: backend %d (%s) at %s", f.Kind, f.PID, f.App, x.in.ts(f.At))
		} else {
			fmt.Fprintf(&b, "; %s: process %d from %s to %s", f.Kind, f.Proc, x.in.ts(f.At), x.in.ts(f.End))
		}
	}
	if n == 0 {
		return " (no fault in the 2L before)"
	}
	return " (faults in the 2L before" + b.String() + ")"
}

// inFlight lists the acquires of process proc's Client client (or of the
// Session with backend session) that were running at at: what may have
// kept a backend from answering.
func (x *lcIndex) inFlight(proc, client int, session int32, at int64) string {
	var b strings.Builder
	n := 0
	for i := range x.in.ops {
		o := &x.in.ops[i]
		if o.Proc != proc || o.Kind == "NewSession" || o.Start > at || o.Ret < at {
			continue
		}
		if session != 0 && o.Session != session || session == 0 && (o.Client != client || o.Session != 0) {
			continue
		}
		if n++; n > 4 {
			b.WriteString("; ...")
			break
		}
		fmt.Fprintf(&b, "; %s %s of keys %v (%s, called %s, returned %s: %s)", o.ID, o.Kind, o.Keys, o.Bound, x.in.ts(o.Start), x.in.ts(o.Ret), o.Outcome)
	}
	if n == 0 {
		return ""
	}
	return " (in flight then" + b.String() + ")"
}

// grantsDuring describes the grants of key to others while op waited, and
// returns how many of them were shared and how many exclusive.
func (x *lcIndex) grantsDuring(op *lcOp, key int64) (shared, exclusive int, desc string) {
	counts := map[string]int{}
	for i := range x.in.ops {
		o := &x.in.ops[i]
		if o == op || o.Outcome != "ok" || o.PID == 0 || o.Ret < op.Start || o.Ret > op.Ret || !slices.Contains(o.Keys, key) || o.Kind == "NewSession" {
			continue
		}
		mode := "exclusive"
		if o.Shared {
			mode = "shared"
			shared++
		} else {
			exclusive++
		}
		counts[fmt.Sprintf("%s by process %d", mode, o.Proc)]++
	}
	return shared, exclusive, fmt.Sprintf("meanwhile the key was granted %d times: %v", shared+exclusive, counts)
}

func (x *lcIndex) checkOp(op *lcOp) {
	r := x.r
	switch op.Kind {
	case "end":
		if op.After != nil && len(op.After.Rows) > 0 {
			r.violate("locks at end", op.After.At, "process %d closed its Clients at %s, and 5 s later pg_locks still showed its backends holding %v", op.Proc, x.in.ts(op.Start), op.After.Rows)
		}
		return
	case "Client.Close":
		r.counts["Client.Close "+op.Outcome]++
		if op.UnlockErr != "" {
			r.counts["Client.Close errors"]++
		}
		return
	case "NewSession":
		r.counts["session NewSession "+op.Outcome]++
		if op.Outcome != "ok" {
			if op.Outcome != "stopped" && op.Outcome != "timeout" {
				if _, ok := x.explainFailure(op); ok {
					r.counts["failures explained"]++
				} else {
					r.violate("unexpected error", op.Ret, "NewSession %s of %s%d-%d failed with no fault to explain it: %s", op.ID, lcApp, op.Proc, op.Client, op.Err)
				}
			}
			return
		}
		if op.DoneAt == 0 {
			r.violate("Done not closed", op.UnlockAt, "Session %s (backend %d): Done was still open %v after Close returned %q at %s", op.ID, op.PID, lcStmt, op.UnlockErr, x.in.ts(op.UnlockAt))
		}
		if op.DoneLost {
			r.counts["sessions lost"]++
			if _, ok := x.explainLoss(op.Proc, op.PID, op.DoneAt); ok {
				r.counts["losses explained"]++
			} else {
				r.violate("unexplained loss", op.DoneAt, "Session %s of %s%d-%d (backend %d, opened %s) was lost at %s, with its backend not terminated and process %d not paused or stalled for %v in the %v before%s%s: %s",
					op.ID, lcApp, op.Proc, op.Client, op.PID, x.in.ts(op.Ret), x.in.ts(op.DoneAt), op.Proc, x.in.loss/2, x.in.loss, x.faultsNear(op.DoneAt), x.inFlight(op.Proc, op.Client, op.PID, op.DoneAt), op.DoneErr)
			}
		}
		if op.After != nil {
			r.counts["after Session.Close checked"]++
			if len(op.After.Rows) > 0 {
				r.violate("left after Session.Close", op.After.At, "Session %s (backend %d) Close returned nil at %s, but pg_locks at %s still showed %v",
					op.ID, op.PID, x.in.ts(op.UnlockAt), x.in.ts(op.After.At), op.After.Rows)
			}
		}
		return
	}

	r.counts["acquire "+op.Kind+" "+op.Outcome]++
	switch op.Outcome {
	case "deadlock":
		r.violate("deadlock", op.Ret, "%s returned ErrDeadlock, though no goroutine holds a key while it waits for another and LockAll takes keys in one order: %s", x.who(op), op.Err)
	case "lost", "error":
		if _, ok := x.explainFailure(op); ok {
			r.counts["failures explained"]++
		} else {
			kind := "unexpected error"
			if op.Outcome == "lost" {
				kind = "unexplained loss"
			}
			r.violate(kind, op.Ret, "%s failed with no backend of its Client terminated and its process not paused or stalled%s: %s", x.who(op), x.faultsNear(op.Ret), op.Err)
		}
	case "timeout":
		if op.Patient && !op.Shared && len(op.Keys) == 1 {
			// RLock promises that readers do not starve a waiting writer:
			// readers that pass the key among themselves for the whole of
			// its wait. Writers may outrun each other: a wait rejoins the
			// server's queue at every slice, so waiters of different
			// processes are not served first come first served (see the
			// package documentation), and readers that queued meanwhile
			// take their turns between the writers'; that is counted, not
			// a violation.
			if shared, exclusive, grants := x.grantsDuring(op, op.Keys[0]); shared > 0 && exclusive == 0 {
				r.violate("starved writer", op.Ret, "%s waited %v for the key and ran out (%s); %s; holders and waiters of the key then: %v",
					x.who(op), time.Duration(op.Ret-op.Start).Round(time.Millisecond), op.Err, grants, op.Snapshot)
			} else {
				r.counts["patient writers outrun by writers"]++
			}
		}
	}
	if op.CheckErr != "" {
		r.counts["pg_locks reads failed"]++
	}
	if op.Outcome != "ok" {
		switch {
		case op.AfterSkipped:
			r.counts["after failure skipped"]++
		case op.After != nil && op.ErrLost && op.AfterGone != 0:
			r.counts["after failure: rows of a lost backend gone"]++
		case op.After != nil && op.AfterExited != 0:
			// The Client closed the backend: destroying the connection
			// is one of the two ways a failed wait leaves nothing (see
			// DESIGN, Sessions).
			r.counts["after failure: backend of the rows exited"]++
		case op.After != nil:
			r.counts["after failure checked"]++
			if op.AfterLate {
				r.counts["after failure checked late"]++
			}
			left := x.notLost(op.Proc, op.After.Rows, op.After.End)
			if len(left) > 0 {
				r.violateGroup("left after failed acquire", fmt.Sprintf("left %d %d", left[0].PID, left[0].Key), op.After.At, "%s failed (%s), and at %s, with no other goroutine of its Client busy with the keys, pg_locks showed them held by the Client's backends: %v",
					x.who(op), op.Err, x.in.ts(op.After.At), left)
			}
		}
		return
	}

	lost, lossAt, lossErr := op.loss()
	explained := false
	if lost {
		r.counts["locks lost"]++
		if _, explained = x.explainLoss(op.Proc, op.PID, lossAt); explained {
			r.counts["losses explained"]++
		} else {
			r.violate("unexplained loss", lossAt, "%s was reported lost at %s, with backend %d not terminated and process %d not paused or stalled for %v in the %v before%s%s: %s",
				x.who(op), x.in.ts(lossAt), op.PID, op.Proc, x.in.loss/2, x.in.loss, x.faultsNear(lossAt), x.inFlight(op.Proc, op.Client, op.Session, lossAt), lossErr)
		}
	}
	x.checkOverlaps(op, lost && explained)
	for _, c := range []struct {
		name string
		seen *lcSeen
	}{{"entry", op.Entry}, {"exit", op.Exit}} {
		if c.seen == nil {
			continue
		}
		r.counts[c.name+" checked"]++
		if c.seen.OK {
			continue
		}
		mode := "exclusively"
		if op.Shared {
			mode = "shared, with no exclusive holder"
		}
		kind := lcMismatch(c.seen.Rows, op.Keys, op.PID, op.Shared)
		// Overlaps with one holder (a key left on a backend is seen by
		// every later holder there) are folded together.
		group := ""
		if h, ok := lcOffender(c.seen.Rows, op.Keys, op.PID, op.Shared); ok {
			group = fmt.Sprintf("overlap %d %d %s", h.PID, h.Key, h.Mode)
		}
		switch {
		case lost && explained:
			r.counts["pg_locks mismatches of lost locks"]++
		case lost && kind == "not held":
			r.counts["pg_locks mismatches of lost locks"]++ // the loss is reported
		case lost:
			r.violateGroup(kind, group, c.seen.At, "%s: at its %s check (%s) pg_locks showed %v, not the keys held %s by backend %d; the lock was reported lost only at %s, unexplained: %s",
				x.who(op), c.name, x.in.ts(c.seen.At), c.seen.Rows, mode, op.PID, x.in.ts(lossAt), lossErr)
		default:
			// What the faults say about the backend, to tell a lock the
			// library lost track of from one whose end it never saw.
			why := ""
			if t, ok := x.terminated[op.PID]; ok {
				why = fmt.Sprintf("; backend %d was terminated at %s", op.PID, x.in.ts(t))
			}
			r.violateGroup(kind, group, c.seen.At, "%s: at its %s check (%s) pg_locks showed %v, not the keys held %s by backend %d, and the lock was never reported lost (Unlock returned %q at %s)%s%s",
				x.who(op), c.name, x.in.ts(c.seen.At), c.seen.Rows, mode, op.PID, op.UnlockErr, x.in.ts(op.UnlockAt), why, x.faultsNear(c.seen.At))
		}
	}
	for _, w := range op.Writes {
		r.counts["write "+w.Result]++
		if w.Result == "stale" && !lost {
			r.violate("stale while held", w.Ret, "%s: its fenced write %s (%s to %s) was refused as stale, so a newer fence was issued for key %d while this lock, never reported lost, was held: %s",
				x.who(op), w.ID, x.in.ts(w.Call), x.in.ts(w.Ret), op.Keys[0], w.Err)
		}
	}
	if op.DoneAt == 0 {
		r.violate("Done not closed", op.UnlockAt, "%s: Done was still open %v after Unlock returned %q at %s", x.who(op), lcStmt, op.UnlockErr, x.in.ts(op.UnlockAt))
	}
	if op.UnlockErr != "" && !lost {
		r.violate("Unlock error", op.UnlockAt, "%s: Unlock returned an error though the lock was not lost: %s", x.who(op), op.UnlockErr)
	}
	if op.Shared && op.UnlockCall != 0 && slices.ContainsFunc(x.terms, func(f lcFault) bool { return f.PID == op.PID && f.Gone != 0 && f.Gone < op.UnlockCall }) {
		r.counts["shared Unlock called after its backend was gone"]++
	}
	if op.UnlockErr == "" && op.Shared && op.UnlockCall != 0 {
		r.counts["shared Unlock checked against terminations"]++
		for _, f := range x.terms {
			if f.PID == op.PID && f.Gone != 0 && f.Gone < op.UnlockCall {
				r.violate("release from a dead backend", op.UnlockAt, "%s: Unlock, called at %s, returned nil at %s, though its backend %d, terminated at %s, had left pg_stat_activity at %s: it never proved the backend alive",
					x.who(op), x.in.ts(op.UnlockCall), x.in.ts(op.UnlockAt), op.PID, x.in.ts(f.At), x.in.ts(f.Gone))
				break
			}
		}
	}
	if op.UnlockErr == "" {
		switch {
		case op.AfterSkipped:
			r.counts["after Unlock skipped"]++
		case op.After != nil:
			r.counts["after Unlock checked"]++
			rows := op.After.Rows
			if op.AfterLate {
				// Read once the Client's other goroutines were done with
				// the keys: one of them may have lost this backend
				// meanwhile, whose locks the server frees when it notices.
				r.counts["after Unlock checked late"]++
				rows = x.notLost(op.Proc, rows, op.After.End)
			}
			if len(rows) > 0 {
				r.violateGroup("left after Unlock", fmt.Sprintf("left %d %d", rows[0].PID, rows[0].Key), op.After.At, "%s: Unlock returned nil at %s, but at %s, with no other goroutine of its Client busy with the keys, pg_locks showed %v",
					x.who(op), x.in.ts(op.UnlockAt), x.in.ts(op.After.At), rows)
			}
		}
	}
}

// notLost returns the rows that are on neither a backend the nemesis
// terminated nor one that process proc reported lost, by end.
func (x *lcIndex) notLost(proc int, rows []lcHold, end int64) []lcHold {
	var left []lcHold
	for _, h := range rows {
		if t, ok := x.terminated[h.PID]; ok && t <= end {
			continue // a dying backend
		}
		if at, ok := x.lostAt[[2]int64{int64(proc), int64(h.PID)}]; ok && at <= end {
			continue // a backend its Client gave up, whose locks the server frees when it notices
		}
		left = append(left, h)
	}
	return left
}

// checkOverlaps checks that no other goroutine of op's Client was in a
// critical section on one of op's keys, in a mode that excludes op's,
// when op entered its own, which pg_locks cannot show when both handles
// are on one backend. Allowed only when one of the two locks was reported
// lost for a reason that explains the loss (lostOK: op's), as for the
// overlaps that pg_locks shows.
func (x *lcIndex) checkOverlaps(op *lcOp, lostOK bool) {
	r := x.r
	r.counts["in-Client overlap checked"]++
	for _, h := range op.Overlaps {
		other := x.opByID[h.ID]
		otherOK := false
		if other != nil {
			if lost, at, _ := other.loss(); lost {
				_, otherOK = x.explainLoss(other.Proc, other.PID, at)
			}
		}
		if lostOK || otherOK {
			r.counts["in-Client overlaps of lost locks"]++
			continue
		}
		same := "another backend"
		if h.PID == op.PID {
			same = "the same backend"
		}
		mode := map[bool]string{true: "shared", false: "exclusively"}
		r.violateGroup("overlap in one Client", fmt.Sprintf("in-Client %s %d", h.ID, h.Key), op.Ret,
			"%s entered its critical section holding key %d %s on backend %d while %s of the same Client held it %s on %s (backend %d), and neither lock was reported lost",
			x.who(op), h.Key, mode[op.Shared], op.PID, h.ID, mode[h.Shared], same, h.PID)
	}
}

// checkLossNotices checks that every lock held on a backend the nemesis
// terminated ended (Done closed) within L of the termination, plus the
// time its process was paused or stalled meanwhile.
func (x *lcIndex) checkLossNotices() {
	for _, f := range x.terms {
		for _, op := range x.byPID[f.PID] {
			if op.DoneAt == 0 || op.DoneAt <= f.At {
				continue // ended before (or never: reported by checkOp)
			}
			from := max(f.At, op.Ret)
			// The heartbeat notices within H and a round trip; the lease
			// ends the session at the latest L after the last answer
			// before the termination. lcSlow is a timer's lateness that
			// a probe does not call a stall.
			bound := x.in.loss + lcSlow + x.busyIn(op.Proc, from, op.DoneAt)
			x.r.counts["loss notices checked"]++
			if took := time.Duration(op.DoneAt - from); took > bound {
				x.r.violate("late loss notice", op.DoneAt, "%s: its backend %d was terminated at %s (%s), but Done closed only at %s (%v later, bound %v): %s",
					x.who(op), f.PID, x.in.ts(f.At), f.Kind, x.in.ts(op.DoneAt), took.Round(time.Millisecond), bound.Round(time.Millisecond), op.DoneErr)
			}
		}
	}
}

// checkFences checks the fences that acquires returned and the writes
// made with them.
func (x *lcIndex) checkFences() {
	r := x.r
	for i := range x.in.ops {
		op := &x.in.ops[i]
		if op.Fence != 0 && op.Outcome == "ok" {
			x.fenced[op.Keys[0]] = append(x.fenced[op.Keys[0]], op)
		}
	}
	for key, ops := range x.fenced {
		// One fence, one holder.
		byFence := map[int64]*lcOp{}
		for _, op := range ops {
			if other := byFence[op.Fence]; other != nil {
				r.violate("fence issued twice", op.Ret, "key %d: fence %d was returned to %s and to %s", key, op.Fence, x.who(other), x.who(op))
			}
			byFence[op.Fence] = op
		}
		// An acquire that started after another returned has a greater
		// fence.
		byRet := slices.SortedFunc(slices.Values(ops), func(a, b *lcOp) int { return cmp.Compare(a.Ret, b.Ret) })
		byStart := slices.SortedFunc(slices.Values(ops), func(a, b *lcOp) int { return cmp.Compare(a.Start, b.Start) })
		var top *lcOp
		j := 0
		for _, op := range byStart {
			for ; j < len(byRet) && byRet[j].Ret < op.Start; j++ {
				if top == nil || byRet[j].Fence > top.Fence {
					top = byRet[j]
				}
			}
			if top != nil && op.Fence <= top.Fence {
				r.violate("fence order", op.Ret, "key %d: %s got fence %d, though %s had already returned fence %d", key, x.who(op), op.Fence, x.who(top), top.Fence)
			}
		}
	}

	// The accepted writes of a key, in insertion order: fences never go
	// back, and one fence is one holder's.
	newest := map[int64]lcRow{}
	holderOf := map[[2]int64]string{}
	for _, row := range x.in.rows {
		if prev, ok := newest[row.Key]; ok && row.Fence < prev.Fence {
			r.violate("fenced writes interleave", 0, "key %d: row %d (fence %d, holder %s, backend %d) was written after row %d (fence %d, holder %s, backend %d)",
				row.Key, row.ID, row.Fence, row.Holder, row.PID, prev.ID, prev.Fence, prev.Holder, prev.PID)
		} else {
			newest[row.Key] = row
		}
		k := [2]int64{row.Key, row.Fence}
		if h, ok := holderOf[k]; ok && h != row.Holder {
			r.violate("fenced writes interleave", 0, "key %d: fence %d wrote rows for two holders, %s and %s (row %d)", row.Key, row.Fence, h, row.Holder, row.ID)
		}
		holderOf[k] = row.Holder
		if op := x.opByID[row.Holder]; op != nil && op.Fence != row.Fence {
			r.violate("fenced writes interleave", 0, "key %d: row %d has fence %d, but its holder %s had fence %d", row.Key, row.ID, row.Fence, row.Holder, op.Fence)
		}
	}
	for i := range x.in.ops {
		op := &x.in.ops[i]
		for _, w := range op.Writes {
			switch {
			case w.Result == "ok" && !x.inTable[w.ID]:
				r.violate("write outcome", w.Ret, "%s: write %s returned ok at %s but is not in lockcore_writes", x.who(op), w.ID, x.in.ts(w.Ret))
			case w.Result == "stale" && x.inTable[w.ID]:
				r.violate("write outcome", w.Ret, "%s: write %s was refused as stale at %s but is in lockcore_writes", x.who(op), w.ID, x.in.ts(w.Ret))
			case w.Result == "error" && x.inTable[w.ID]:
				r.counts["write errors committed"]++
			}
		}
	}
}

// checkHistory checks the fenced acquires and writes with porcupine
// against a fence model: fences are issued one after another, a write is
// accepted only while its fence is the newest, and refused only after a
// newer one was issued. The model does not follow holds (the soak's model
// does, from its releases): who holds a key is checked in pg_locks at
// every entry and exit, and a holder whose lock was lost before it knew
// may have its write refused before it learns of the loss.
func (x *lcIndex) checkHistory() {
	var ops []porcupine.Operation
	for i := range x.in.ops {
		op := &x.in.ops[i]
		if !strings.HasSuffix(op.Kind, "+fence") {
			continue
		}
		target := fmt.Sprintf("key %d", op.Keys[0])
		switch op.Outcome {
		case "ok":
			ops = append(ops, porcupine.Operation{Input: soakInput{Op: "acquire", Target: target}, Call: op.Start, Output: soakOutput{Fence: op.Fence}, Return: op.Ret})
		case "busy":
			continue // a try that found the key held took nothing
		case "timeout", "cancelled", "stopped":
			if !op.ErrLost {
				// It may have issued a fence before it returned: a
				// cancelled statement on a connection that stays
				// usable has ended on the server when it returns.
				ops = append(ops, porcupine.Operation{Input: soakInput{Op: "acquire", Target: target}, Call: op.Start, Output: soakOutput{}, Return: op.Ret})
				break
			}
			fallthrough
		default:
			// Its connection was lost: a statement cut short on the
			// client may still commit a fence after it returned.
			ops = append(ops, porcupine.Operation{Input: soakInput{Op: "acquire", Target: target}, Call: op.Start, Output: soakOutput{}, Return: math.MaxInt64})
		}
		for _, w := range op.Writes {
			in := soakInput{Op: "write", Target: target, Fence: op.Fence}
			switch {
			case w.Result == "ok" || w.Result == "stale":
				ops = append(ops, porcupine.Operation{Input: in, Call: w.Call, Output: soakOutput{Result: w.Result}, Return: w.Ret})
			case x.inTable[w.ID]:
				ops = append(ops, porcupine.Operation{Input: in, Call: w.Call, Output: soakOutput{Result: "ok"}, Return: math.MaxInt64})
			}
		}
	}
	x.r.counts["history operations"] = len(ops)
	err := checkSoakHistory(fenceModel(false, false), ops, 2*time.Minute)
	switch {
	case err == nil:
	case strings.HasPrefix(err.Error(), "porcupine did not finish"):
		x.r.counts["history check inconclusive"]++
	default:
		x.r.violate("history", 0, "fenced acquires and writes: %v", err)
	}
}

// The checker of TestLockCoreRandomized catches each kind of violation,
// with no false alarm on what is allowed: a lock whose backend was
// terminated, or whose process was paused, may be seen not held before it
// is reported lost; a lock left by a backend that was terminated is no
// leak.
func TestLockCoreChecker(t *testing.T) {
	t.Parallel()
	ms := func(n int) int64 { return int64(n) * int64(time.Millisecond) }
	// held is a lock of key held by backend pid from 10 to 30 ms, checked
	// at entry and exit, released, and checked after.
	held := func(id string, pid int32, key int64) lcOp {
		return lcOp{ID: id, Proc: 1, Kind: "Lock", Keys: []int64{key}, Start: ms(0), Ret: ms(10), Outcome: "ok", PID: pid,
			Entry: &lcSeen{At: ms(11), End: ms(12), OK: true}, Exit: &lcSeen{At: ms(20), End: ms(21), OK: true},
			UnlockAt: ms(30), DoneAt: ms(30), DoneErr: "pgcoord: lock not held", After: &lcSeen{At: ms(31), End: ms(32)}}
	}
	fenced := func(id string, pid int32, fence int64, start int) lcOp {
		op := held(id, pid, 1)
		op.Kind, op.Fence = "Lock+fence", fence
		op.Start, op.Ret = ms(start), ms(start+10)
		op.Writes = []lcWrite{{ID: id + "-w0", Call: ms(start + 12), Ret: ms(start + 14), Result: "ok"}}
		op.Entry.At, op.Exit.At, op.UnlockAt, op.DoneAt = ms(start+11), ms(start+15), ms(start+20), ms(start+20)
		op.After.At = ms(start + 21)
		return op
	}
	row := func(id int64, op lcOp) lcRow {
		return lcRow{ID: id, Key: op.Keys[0], Fence: op.Fence, Holder: op.ID, Op: op.Writes[0].ID, PID: op.PID}
	}
	lost := func(op lcOp, at int) lcOp {
		op.DoneAt, op.DoneLost, op.DoneErr = ms(at), true, "pgcoord: lock lost: heartbeat: terminating connection"
		op.UnlockAt, op.UnlockLost, op.UnlockErr, op.After = ms(at+1), true, "pgcoord: unlock: lock lost", nil
		return op
	}
	notHeld := func(op lcOp, other int32) lcOp {
		op.Entry.OK = false
		op.Entry.Rows = []lcHold{{Key: op.Keys[0], PID: other, Mode: "ExclusiveLock", Granted: true}}
		return op
	}
	terminate := func(pid int32, at int) lcFault {
		return lcFault{Kind: "terminate holder", At: ms(at), End: ms(at + 1), Proc: 1, PID: pid}
	}
	exited := func(f lcFault, at int) lcFault { f.Gone = ms(at); return f }
	pause := func(from, to int) lcFault { return lcFault{Kind: "pause > L", At: ms(from), End: ms(to), Proc: 1} }

	a, b := fenced("a", 101, 1, 0), fenced("b", 102, 2, 100)
	interleaved := a
	interleaved.Writes = []lcWrite{{ID: "a-w0", Call: ms(120), Ret: ms(125), Result: "ok"}}
	interleaved.UnlockAt, interleaved.DoneAt = ms(130), ms(130)
	staleHeld := a
	staleHeld.Writes = []lcWrite{{ID: "a-w0", Call: ms(12), Ret: ms(14), Result: "stale", Err: "stale fence"}}
	backwards := fenced("c", 103, 1, 100)
	// a's backend is terminated at 50, b takes fence 2 at 100, and a,
	// not yet told, writes at 120 and is refused.
	staleLost := lost(a, 130)
	staleLost.Writes = append(slices.Clone(a.Writes), lcWrite{ID: "a-w1", Call: ms(120), Ret: ms(125), Result: "stale", Err: "stale fence"})
	a2, early := fenced("a", 101, 2, 0), fenced("b", 102, 1, 100)
	patient := held("p", 0, 2)
	patient.Outcome, patient.Patient, patient.PID, patient.Err = "timeout", true, 0, "context deadline exceeded"
	reader := held("r", 106, 2) // granted shared while the writer waited
	reader.Kind, reader.Shared, reader.Start, reader.Ret = "RLock", true, ms(2), ms(5)
	otherWriter := held("w", 108, 2) // granted exclusive while the writer waited
	otherWriter.Start, otherWriter.Ret = ms(3), ms(6)
	failed := held("f", 0, 3)
	failed.Outcome, failed.PID = "busy", 0
	failed.After.Rows = []lcHold{{Key: 3, PID: 104, Mode: "ExclusiveLock", Granted: true}}
	left := held("l", 105, 3)
	left.After.Rows = []lcHold{{Key: 3, PID: 105, Mode: "ExclusiveLock", Granted: true}}
	leftAgain := left
	leftAgain.ID, leftAgain.Start, leftAgain.Ret, leftAgain.After = "l2", ms(40), ms(50), &lcSeen{At: ms(60), Rows: left.After.Rows}
	failedLost := failed
	failedLost.ErrLost, failedLost.AfterGone = true, ms(300)
	failedExited := failed
	failedExited.AfterExited = ms(300)
	deadlock := held("d", 0, 4)
	deadlock.Kind, deadlock.Outcome, deadlock.Keys, deadlock.Err = "LockAll", "deadlock", []int64{2, 4}, "deadlock detected"
	empty := held("x", 100, 2)
	empty.Entry.OK = false
	sess := lcOp{ID: "s", Proc: 1, Kind: "NewSession", Start: ms(0), Ret: ms(5), Outcome: "ok", PID: 107, Session: 107,
		UnlockAt: ms(2000), DoneAt: ms(1500), DoneLost: true, DoneErr: "pgcoord: lock lost: no answer from the server"}
	onLost := held("o", 0, 2)
	onLost.Kind, onLost.Session, onLost.Start, onLost.Ret, onLost.Outcome = "Session.Lock", 107, ms(1600), ms(1601), "lost"
	// Two exclusive handles of one Client on backend 100, which pg_locks
	// shows as one holder; allowed only if one of them was lost.
	first, second := held("h1", 100, 5), held("h2", 100, 5)
	second.Start, second.Ret = ms(12), ms(15)
	second.Overlaps = []lcInHold{{ID: "h1", Key: 5, PID: 100}}
	readerFirst, readerSecond := held("r1", 100, 5), held("r2", 100, 5)
	readerFirst.Kind, readerFirst.Shared, readerSecond.Kind, readerSecond.Shared = "RLock", true, "RLock", true
	// Joined shared handles: neither is in the other's Overlaps.
	// A shared hold whose Unlock returned nil after its terminated
	// backend had exited (and the loss noticed later), and one whose
	// Unlock ran while the backend was still exiting.
	deadRelease := held("dr", 100, 5)
	deadRelease.Kind, deadRelease.Shared, deadRelease.Exit = "RLock", true, nil
	deadRelease.UnlockCall, deadRelease.UnlockAt, deadRelease.DoneAt, deadRelease.After = ms(320), ms(321), ms(321), nil
	exitingRelease := deadRelease
	exitingRelease.UnlockCall = ms(17)
	unlockErr := held("u", 106, 4)
	unlockErr.UnlockErr = "pgcoord: the server did not hold int64:4 for backend 106: lock not held"

	for _, tc := range []struct {
		name   string
		ops    []lcOp
		faults []lcFault
		stalls []lcSpan
		rows   []lcRow
		want   []string // kinds of violations, sorted
		folded int      // violations folded into the first of their group
	}{
		{name: "clean", ops: []lcOp{held("x", 100, 2), a, b}, rows: []lcRow{row(1, a), row(2, b)}},
		{name: "overlap", ops: []lcOp{notHeld(held("x", 100, 2), 200)}, want: []string{"overlap"}},
		{name: "overlap of a lock lost with its terminated backend", ops: []lcOp{lost(notHeld(held("x", 100, 2), 200), 50)}, faults: []lcFault{terminate(100, 5)}},
		{name: "overlap of a lock lost unexplained", ops: []lcOp{lost(notHeld(held("x", 100, 2), 200), 50)}, want: []string{"overlap", "unexplained loss"}},
		{name: "loss after a pause past L", ops: []lcOp{lost(held("x", 100, 2), 2000)}, faults: []lcFault{pause(600, 1900)}},
		{name: "loss after a stall past L/2", ops: []lcOp{lost(held("x", 100, 2), 2000)}, stalls: []lcSpan{{Proc: 1, From: ms(1200), To: ms(1800), What: "timer late"}}},
		{name: "loss after a short pause", ops: []lcOp{lost(held("x", 100, 2), 2000)}, faults: []lcFault{pause(1800, 1900)}, want: []string{"unexplained loss"}},
		{name: "loss of another backend's termination", ops: []lcOp{lost(held("x", 100, 2), 50)}, faults: []lcFault{terminate(99, 5)}, want: []string{"unexplained loss"}},
		{name: "loss noticed late", ops: []lcOp{lost(held("x", 100, 2), 1500)}, faults: []lcFault{terminate(100, 20)}, want: []string{"late loss notice"}},
		{name: "not held", ops: []lcOp{empty}, want: []string{"not held"}},
		{name: "not held after an unexplained loss", ops: []lcOp{lost(empty, 50)}, want: []string{"unexplained loss"}},
		{name: "an acquire on a lost Session", ops: []lcOp{sess, onLost}, faults: []lcFault{terminate(107, 1400)}},
		{name: "an acquire on a Session lost unexplained", ops: []lcOp{sess, onLost}, want: []string{"unexplained loss"}},
		{name: "deadlock", ops: []lcOp{deadlock}, want: []string{"deadlock"}},
		{name: "starved writer", ops: []lcOp{patient, reader}, want: []string{"starved writer"}},
		{name: "writer outrun by writers", ops: []lcOp{patient}},
		{name: "writer outrun by writers and readers", ops: []lcOp{patient, reader, otherWriter}},
		{name: "left after Unlock", ops: []lcOp{left}, want: []string{"left after Unlock"}},
		{name: "left after failed acquire", ops: []lcOp{failed}, want: []string{"left after failed acquire"}},
		{name: "left by the failed acquire's lost backend", ops: []lcOp{failedLost}},
		{name: "left on a backend that then exited", ops: []lcOp{failedExited}},
		{name: "left after Unlock, seen again", ops: []lcOp{left, leftAgain}, want: []string{"left after Unlock"}, folded: 1},
		{name: "left by a terminated backend", ops: []lcOp{failed}, faults: []lcFault{terminate(104, 25)}},
		{name: "Unlock error", ops: []lcOp{unlockErr}, want: []string{"Unlock error"}},
		{name: "overlap in one Client", ops: []lcOp{first, second}, want: []string{"overlap in one Client"}},
		{name: "overlap in one Client of a lost lock", ops: []lcOp{lost(first, 14), second}, faults: []lcFault{terminate(100, 5)}},
		{name: "joined readers of one Client", ops: []lcOp{readerFirst, readerSecond}},
		{name: "release from a dead backend", ops: []lcOp{deadRelease}, faults: []lcFault{exited(terminate(100, 15), 20)}, want: []string{"release from a dead backend"}},
		{name: "release while the backend exits", ops: []lcOp{exitingRelease}, faults: []lcFault{exited(terminate(100, 15), 20)}},
		{name: "fenced writes interleave", ops: []lcOp{interleaved, b}, rows: []lcRow{row(1, b), row(2, interleaved)}, want: []string{"fenced writes interleave", "history"}},
		{name: "stale after a loss", ops: []lcOp{staleLost, b}, faults: []lcFault{terminate(101, 50)}, rows: []lcRow{row(1, a), row(2, b)}},
		{name: "stale while held", ops: []lcOp{staleHeld}, want: []string{"history", "stale while held"}},
		{name: "fence issued twice", ops: []lcOp{a, backwards}, rows: []lcRow{row(1, a), row(2, backwards)}, want: []string{"fence issued twice", "fence order", "fenced writes interleave", "history"}},
		{name: "fence order", ops: []lcOp{a2, early}, rows: []lcRow{row(1, a2), row(2, early)}, want: []string{"fence order", "fenced writes interleave", "history"}},
		{name: "accepted write missing", ops: []lcOp{a}, want: []string{"write outcome"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := lcAnalyze(&lcInput{loss: time.Second, ops: tc.ops, faults: tc.faults, stalls: tc.stalls, rows: tc.rows})
			var got []string
			for _, v := range rep.violations {
				if !slices.Contains(got, v.kind) {
					got = append(got, v.kind)
				}
				if _, path, ok := strings.Cut(v.msg, "history is not linearizable: see "); ok {
					_ = os.Remove(path)
				}
			}
			slices.Sort(got)
			folded := 0
			for _, v := range rep.violations {
				folded += v.more
			}
			if folded != tc.folded {
				t.Errorf("%d violations folded, want %d", folded, tc.folded)
			}
			if !slices.Equal(got, tc.want) {
				for _, v := range rep.violations {
					t.Logf("%s: %s", v.kind, v.msg)
				}
				t.Fatalf("violations %q, want %q", got, tc.want)
			}
		})
	}
}
