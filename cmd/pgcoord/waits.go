package main

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"
)

// waitNode is a backend in the wait-for forest: under each backend, the
// backends that wait for it (pg_blocking_pids: for a lock it holds, or
// behind it in a lock's queue).
type waitNode struct {
	PID             int32      `json:"pid"`
	ApplicationName string     `json:"application_name"`
	Depth           int        `json:"depth"`                 // 0 for a root
	Awaits          *awaitJSON `json:"awaits,omitempty"`      // the lock it waits for
	Holds           []string   `json:"holds,omitempty"`       // the keys it holds that the backends under it wait for
	BlockedBy       []int32    `json:"blocked_by"`            // every backend it waits for
	Cycle           bool       `json:"cycle,omitempty"`       // it waits for a backend above it: a cycle, shown once
	ShownAbove      bool       `json:"shown_above,omitempty"` // it waits for more than one backend and is shown in full under another
	queued          bool       // waits behind its parent in a lock's queue rather than for a lock the parent holds
	children        []*waitNode
}

// awaitJSON is the lock a backend waits for.
type awaitJSON struct {
	Key   string     `json:"key"`
	Name  string     `json:"name,omitempty"`
	Mode  string     `json:"mode"`
	Since *time.Time `json:"since,omitempty"`
}

// waitForest builds the wait-for forest of st: a root is a backend that
// others wait for and that waits for nobody, ordered by pid; backends in a
// cycle with no such root are shown from the cycle's lowest pid, and the
// backend that closes a cycle is marked instead of repeated. A backend
// that waits for several is shown in full under the first and marked
// under the others.
func waitForest(st *state) []*waitNode {
	blockers := map[int32][]int32{}
	waiters := map[int32][]int32{}
	var pids []int32
	for _, e := range st.Waits {
		blockers[e.Waiter] = append(blockers[e.Waiter], e.Blocker)
		waiters[e.Blocker] = append(waiters[e.Blocker], e.Waiter)
		pids = append(pids, e.Waiter, e.Blocker)
	}
	slices.Sort(pids)
	pids = slices.Compact(pids)
	for _, ws := range waiters {
		slices.Sort(ws)
	}
	awaited := map[int32]*lockRow{}
	held := map[int32][]*lockRow{}
	app := map[int32]string{}
	for i := range st.Locks {
		l := &st.Locks[i]
		app[l.PID] = l.ApplicationName
		if l.Granted {
			held[l.PID] = append(held[l.PID], l)
		} else if awaited[l.PID] == nil {
			awaited[l.PID] = l
		}
	}
	shown := map[int32]bool{}
	onPath := map[int32]bool{}
	var visit func(pid int32, depth int, parent int32) *waitNode
	visit = func(pid int32, depth int, parent int32) *waitNode {
		n := &waitNode{PID: pid, ApplicationName: app[pid], Depth: depth, BlockedBy: blockers[pid]}
		if n.BlockedBy == nil {
			n.BlockedBy = []int32{}
		}
		if a := awaited[pid]; a != nil {
			n.Awaits = &awaitJSON{Key: a.Key.String(), Name: a.Name, Mode: a.Mode, Since: a.Since}
			n.queued = parent != 0 && !holdsKey(held[parent], a)
		}
		switch {
		case onPath[pid]:
			n.Cycle = true
			return n
		case shown[pid]:
			n.ShownAbove = true
			return n
		}
		shown[pid], onPath[pid] = true, true
		defer delete(onPath, pid)
		for _, w := range waiters[pid] {
			c := visit(w, depth+1, pid)
			if a := awaited[w]; a != nil {
				for _, h := range held[pid] {
					if h.Key == a.Key && !slices.Contains(n.Holds, h.label()) {
						n.Holds = append(n.Holds, h.label())
					}
				}
			}
			n.children = append(n.children, c)
		}
		return n
	}
	var roots []*waitNode
	for _, p := range pids {
		if len(blockers[p]) == 0 {
			roots = append(roots, visit(p, 0, 0))
		}
	}
	for _, p := range pids { // cycles that no root reaches
		if !shown[p] {
			roots = append(roots, visit(p, 0, 0))
		}
	}
	return roots
}

func holdsKey(held []*lockRow, a *lockRow) bool {
	return slices.ContainsFunc(held, func(h *lockRow) bool { return h.Key == a.Key })
}

// flatten returns the nodes of the forest depth first.
func flatten(roots []*waitNode) []*waitNode {
	var out []*waitNode
	var walk func(n *waitNode)
	walk = func(n *waitNode) {
		out = append(out, n)
		for _, c := range n.children {
			walk(c)
		}
	}
	for _, r := range roots {
		walk(r)
	}
	return out
}

// printWaits writes the wait-for forest as an indented tree.
func printWaits(w io.Writer, roots []*waitNode, now time.Time) {
	if len(roots) == 0 {
		fmt.Fprintln(w, "no backend waits for another")
		return
	}
	var walk func(n *waitNode, prefix, branch string)
	walk = func(n *waitNode, prefix, branch string) {
		var b strings.Builder
		fmt.Fprintf(&b, "%s%spid %d", prefix, branch, n.PID)
		if n.ApplicationName != "" {
			fmt.Fprintf(&b, " (%s)", n.ApplicationName)
		}
		if a := n.Awaits; a != nil {
			name := cmp.Or(a.Name, a.Key)
			wait := ""
			if a.Since != nil {
				wait = " " + duration(now.Sub(*a.Since))
			}
			fmt.Fprintf(&b, " waits%s for %s (%s)", wait, name, a.Mode)
			if n.queued {
				b.WriteString(", queued behind it")
			}
		}
		if len(n.Holds) > 0 {
			fmt.Fprintf(&b, "; holds %s", strings.Join(n.Holds, ", "))
		}
		switch {
		case n.Cycle:
			b.WriteString("  <- CYCLE: it is above, so these backends wait for each other")
		case n.ShownAbove:
			b.WriteString("  (also waits for another backend: shown above)")
		}
		fmt.Fprintln(w, b.String())
		next := prefix
		switch branch {
		case "├─ ":
			next += "│  "
		case "└─ ":
			next += "   "
		}
		for i, c := range n.children {
			br := "├─ "
			if i == len(n.children)-1 {
				br = "└─ "
			}
			walk(c, next, br)
		}
	}
	for _, r := range roots {
		walk(r, "", "")
	}
}
