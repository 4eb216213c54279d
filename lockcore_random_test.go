package pgcoord

// The randomized test of the lock core. Goroutines of several Clients, in
// this process and in child processes (the test binary run again, as the
// fault tests do), mix Lock, RLock, LockAll, TryLock, TryRLock, locks on
// Sessions and fenced locks with fenced writes, with random deadlines and
// cancels, on a few keys, while a nemesis terminates pgcoord backends and
// pauses child processes. Every goroutine records what it did, with times
// and backends; afterwards the records are checked against what
// PostgreSQL said at the time (pg_locks, read inside every critical
// section and after every release) and against a table of fenced writes.
//
//	go test -race -count=1 -run 'TestLockCoreRandomized$' -lockcore.duration=60s .    # 15 s in the normal suite
//	go test -race -count=1 -run 'TestLockCoreRandomized$' -lockcore.seed=N .    # replay a seed
//
// A seed fixes every random choice of the workload and of the nemesis
// (which goroutine does what, on which keys, with which deadline, which
// fault comes next and how long it lasts); the interleaving of goroutines
// and processes is the machine's, so a replay reproduces the schedule of
// faults and operations, not every timing.
//
// What is checked, and what is allowed:
//
//   - No overlap. At the entry of every critical section and before its
//     exit, pg_locks shows each key granted to the holder's backend, in
//     ExclusiveLock mode and to nobody else (a shared holder: in ShareLock
//     mode, with no ExclusiveLock granted to anyone). The server sees
//     the handles of one Client on one backend as one session, so
//     pg_locks cannot tell two of them apart: the test also records, in
//     each Client, which goroutines are in their critical sections on
//     which keys, and no goroutine may enter one on a key that another of
//     the same Client holds in a mode that excludes its own. Allowed only
//     for a lock that was reported lost, for a reason that explains the
//     loss (below): a terminated backend's locks are freed before its
//     holder can know.
//   - Fenced writes. A fenced holder writes to lockcore_writes in a
//     transaction that calls CheckFence first. The accepted writes of a key,
//     in insertion order, never show a fence going back (so the writes of
//     two holders never interleave), one fence belongs to one holder, an
//     acquire that started after another returned got a greater fence, a
//     write is refused as stale only if its lock was reported lost, and the
//     history of acquires and writes is linearizable against the soak's
//     fence model (porcupine). A paused holder that outlived its loss
//     deadline may still believe it holds: its writes must be refused,
//     which these checks cover.
//   - No lock left behind. After Unlock returns nil, the key is no longer
//     granted to the lock's backend; after an acquire fails (ErrLocked, a
//     deadline, a cancel), no backend of that Client holds the key; after
//     Session.Close returns nil, the session's backend holds nothing. Such
//     a check counts only when no other goroutine of the same Client
//     touched the key between the release and the read of pg_locks (it
//     could have been handed the lock, or taken it on the same backend);
//     when one is busy with it, the check waits (at most lcQuietWait) for
//     a moment when none is, and reads then (nothing of the Client may
//     hold the key at that moment, unless its backend was lost); else it
//     is skipped and counted as skipped. The share of skipped checks
//     after a release is logged and must stay below lcMaxSkipped. A failed acquire
//     whose own backend was lost meanwhile (its error wraps ErrLockLost)
//     may leave the key on that backend until the server notices the
//     closed socket: allowed if the key is free within 2 s.
//   - No loss of a lock whose backend lived. A lock reported lost
//     (ErrLockLost from Done or Unlock) must have had its backend terminated
//     by the nemesis before the loss, or its process paused or stalled for
//     at least L/2 within the loss deadline L before it (a stall is a gap
//     seen by a probe goroutine of the process: its timer late, or its
//     round trip to the server slow). After the nemesis terminated a
//     backend, every lock held on it ends (Done closes) within L, plus the
//     time its process was paused or stalled meanwhile. The same holds for
//     a Session lost as a whole.
//   - No release from a dead backend. Unlock of a shared lock (which no
//     handoff passes on) returns nil only if its backend answered: after
//     a release, or, for a hold other handles share, after a round trip
//     that proves the backend alive. One called after the nemesis saw
//     the backend it terminated gone from pg_stat_activity must fail. A
//     run must meet that case at least once: the joiners Client's
//     goroutines share a hold every round, and "terminate reader" aims at
//     one.
//   - No deadlock. No goroutine holds one key while it waits for another,
//     and LockAll takes its keys in one canonical order, so the application
//     has no lock cycle: any ErrDeadlock is a failure. (The test database's
//     deadlock_timeout is 100 ms, so that the server looks for cycles within
//     a wait slice, as it does at the default loss deadline.)
//   - No writer starved by readers. An exclusive single-key Lock that may
//     wait 8L and runs out while the key was granted shared meanwhile is a
//     failure, reported with the key's holders at that moment. One that
//     other writers outran is counted (a wait rejoins the server's queue
//     at every slice, so waiters of different processes are not served in
//     order; the package documentation says so).
//   - At the end, after every lock is released and every Client closed,
//     pg_locks shows no advisory lock in the database.
//
// Failures of an acquire that are neither of the above (a connection error,
// an acquire that reports a lost session) are allowed when a backend of
// that Client (or of that Session) was terminated, or its process paused
// or stalled, around the acquire; otherwise they are failures too.
//
// Every violation is reported with the seed, the operation (process,
// Client, goroutine, sequence number), its keys and backend, and times
// relative to the start of the run; repeats of one cause (a key left on a
// backend, seen by every later check there) are folded into the first.
// The checker is in lockcore_checker_test.go, where TestLockCoreChecker
// shows that it catches each kind of violation and accepts what is
// allowed.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

var (
	lockCoreSeed = flag.Uint64("lockcore.seed", 0, "seed of TestLockCoreRandomized (0: a random one; the seed is logged either way)")
	lockCoreFor  = flag.Duration("lockcore.duration", 15*time.Second, "how long TestLockCoreRandomized runs its workload and its faults (CI passes 60s)")
)

// Environment of a child process of TestLockCoreRandomized, besides
// faultChildEnv ("lockcore") and faultDSNEnv.
const (
	lockCoreSeedEnv = "PGCOORD_LOCKCORE_SEED"
	lockCoreProcEnv = "PGCOORD_LOCKCORE_PROC" // the process's number: 1, 2, ... (this process is 0)
	lockCoreForEnv  = "PGCOORD_LOCKCORE_FOR"  // the run's duration: the child stops by itself well after it
)

const (
	lcLoss     = 2 * time.Second        // WithLossDeadline of every Client: L
	lcBeat     = 500 * time.Millisecond // WithHeartbeat of every Client
	lcKeys     = 4                      // the keys are Int64Key(1) to Int64Key(lcKeys): few, for contention
	lcChildren = 2                      // child processes, besides this one
	lcPatient  = 8 * lcLoss             // bound of a patient acquire
	lcStmt     = 10 * time.Second       // bound of one check, fenced write, Unlock or Close
	lcMaxOps   = 1 << 20                // operations of one goroutine; the duration ends a run long before
	lcApp      = "pgcoord-rand-"        // application_name of the Clients' backends: lcApp + "PROC-CLIENT"
	lcSlow     = 100 * time.Millisecond // a probe gap longer than this is a stall
	// lcQuietWait bounds how long a check after a release waits for the
	// Client's other goroutines to be done with the keys (see after).
	lcQuietWait = 500 * time.Millisecond
	// lcMaxSkipped bounds the share of the checks after a release that
	// may be skipped (see after): measured 5 to 15% at 15 s, about a
	// third without the wait for the Client's other goroutines; above a
	// fifth, too many releases would go unchecked.
	lcMaxSkipped = 0.2
)

var (
	errLockCoreStop   = errors.New("lockcore: the run is over")
	errLockCoreCancel = errors.New("lockcore: cancelled by the workload")
)

// lcClientSpec is one Client of every process of the run.
type lcClientSpec struct {
	workers       int
	shared, waits int  // WithSharedBackends, WithMaxWaits; 0 keeps the default
	noHandoff     bool // WithHandoff(0, 0)
	readers       bool // mostly shared acquires, on keys 1 and 2
	// joiners: every round, the goroutines meet (lcMeet) and each takes
	// lcJoinKey with RLock, so that they join one hold on the Client's
	// backend, and stay in their critical sections up to 60 ms; the
	// heartbeat is L/2, the longest allowed. A backend terminated under
	// the joined hold is noticed up to L/2 later: the Unlock of a handle
	// that other handles still share, called meanwhile, must find out by
	// its own round trip.
	joiners bool
}

var lcClientSpecs = []lcClientSpec{
	{workers: 2},                      // defaults: 2 shared backends, 4 waits, handoff
	{workers: 2, shared: 1, waits: 1}, // the smallest limits, with handoff
	{workers: 3, shared: 1, waits: 2, noHandoff: true, readers: true},
	{workers: 2, shared: 1, waits: 1, joiners: true},
}

// lcMeet bounds how long a goroutine of a joiners Client waits for the
// others at the start of a round.
const lcMeet = 200 * time.Millisecond

// lcJoinKey is the key of the joiners Clients, which take it shared only:
// nothing waits for it, so the goroutines that take it at once join one
// hold (the second while the first's statement is in flight).
const lcJoinKey = lcKeys + 1

func (s lcClientSpec) options(app string) []Option {
	beat := lcBeat
	if s.joiners {
		beat = lcLoss / 2
	}
	opts := []Option{
		WithLossDeadline(lcLoss), WithHeartbeat(beat), WithApplicationName(app),
		WithLogger(slog.New(slog.DiscardHandler)), // losses are expected; the records tell them
	}
	if s.shared > 0 {
		opts = append(opts, WithSharedBackends(s.shared))
	}
	if s.waits > 0 {
		opts = append(opts, WithMaxWaits(s.waits))
	}
	if s.noHandoff {
		opts = append(opts, WithHandoff(0, 0))
	}
	return opts
}

func lcAppName(proc, client int) string { return fmt.Sprintf("%s%d-%d", lcApp, proc, client) }

// lcKind is a kind of acquire, with its weight in the mix of an ordinary
// Client's goroutines and of a reader Client's.
type lcKind struct {
	name                 string
	weight, readerWeight int
	shared, try, fence   bool
	multi                bool // LockAll of 2 or 3 keys
	session              bool // a Session: NewSession, a few acquires on it, Close
}

var lcKinds = []lcKind{
	{name: "Lock", weight: 16, readerWeight: 6},
	{name: "RLock", weight: 12, readerWeight: 36, shared: true},
	{name: "LockAll", weight: 12, readerWeight: 4, multi: true},
	{name: "TryLock", weight: 10, readerWeight: 4, try: true},
	{name: "TryRLock", weight: 8, readerWeight: 28, shared: true, try: true},
	{name: "Lock+fence", weight: 18, readerWeight: 6, fence: true},
	{name: "TryLock+fence", weight: 6, readerWeight: 2, try: true, fence: true},
	{name: "NewSession", weight: 10, readerWeight: 8, session: true},
}

// lcOp is the record of one operation: an acquire and, if it succeeded,
// its critical section and release; or a NewSession and its Close; or a
// Client's Close at the end of the run.
type lcOp struct {
	ID      string  `json:"id"` // pPROC-cCLIENT-wWORKER-SEQ
	Proc    int     `json:"proc"`
	Client  int     `json:"client"`
	Kind    string  `json:"kind"`              // an lcKind's name, "Session." and one, "Client.Close"
	Session int32   `json:"session,omitempty"` // backend of the Session the acquire ran on
	Keys    []int64 `json:"keys,omitempty"`
	Shared  bool    `json:"shared,omitempty"`
	Bound   string  `json:"bound,omitempty"`   // the acquire's deadline or cancel
	Patient bool    `json:"patient,omitempty"` // may wait lcPatient
	Start   int64   `json:"start"`             // Unix nanoseconds, like every time here
	Ret     int64   `json:"ret"`
	Outcome string  `json:"outcome"` // see lcOutcome
	Err     string  `json:"err,omitempty"`
	PID     int32   `json:"pid,omitempty"` // backend of the lock (or of the session)
	Fence   int64   `json:"fence,omitempty"`

	Entry  *lcSeen   `json:"entry,omitempty"` // pg_locks at the entry of the critical section
	Exit   *lcSeen   `json:"exit,omitempty"`  // and before its exit
	Writes []lcWrite `json:"writes,omitempty"`

	UnlockCall int64  `json:"unlockCall,omitempty"` // when Unlock was called
	UnlockAt   int64  `json:"unlockAt,omitempty"`   // when Unlock (Close) returned
	UnlockErr  string `json:"unlockErr,omitempty"`
	UnlockLost bool   `json:"unlockLost,omitempty"` // UnlockErr wraps ErrLockLost
	DoneAt     int64  `json:"doneAt,omitempty"`     // when Done closed (0: not within lcStmt of Unlock)
	DoneErr    string `json:"doneErr,omitempty"`
	DoneLost   bool   `json:"doneLost,omitempty"` // Err wraps ErrLockLost when Done closed

	// After is pg_locks after the release (or the failed acquire, or the
	// Close), restricted to what must be gone; nil when not checked.
	After        *lcSeen  `json:"after,omitempty"`
	AfterSkipped bool     `json:"afterSkipped,omitempty"` // another goroutine of the Client touched the keys meanwhile
	AfterLate    bool     `json:"afterLate,omitempty"`    // After was read once the Client's other goroutines were done with the keys
	AfterGone    int64    `json:"afterGone,omitempty"`    // when After's rows were gone, for an acquire whose backend was lost
	AfterExited  int64    `json:"afterExited,omitempty"`  // when the backends of After's rows had all exited, for another failed acquire
	ErrLost      bool     `json:"errLost,omitempty"`      // the acquire's error wraps ErrLockLost
	Snapshot     []lcHold `json:"snapshot,omitempty"`     // the keys' holders when a patient acquire ran out
	CheckErr     string   `json:"checkErr,omitempty"`     // a read of pg_locks failed

	// Overlaps are the holds of other goroutines of the same Client that
	// were in their critical sections, in a mode that excludes this one,
	// when this one entered its own: pg_locks cannot show two handles of
	// one Client on one backend, which the server sees as one session.
	Overlaps []lcInHold `json:"overlaps,omitempty"`
}

// lcInHold is a critical section of a goroutine of a Client on key.
type lcInHold struct {
	ID     string `json:"id"` // the acquire's op
	Key    int64  `json:"key"`
	PID    int32  `json:"pid"`
	Shared bool   `json:"shared,omitempty"`
}

// lcSeen is one read of pg_locks: granted advisory locks of interest.
type lcSeen struct {
	At   int64    `json:"at"`  // the query was sent
	End  int64    `json:"end"` // and answered
	OK   bool     `json:"ok"`  // for Entry and Exit: what the holder must see
	Rows []lcHold `json:"rows,omitempty"`
}

// lcHold is one row of pg_locks.
type lcHold struct {
	Key     int64  `json:"key"`
	PID     int32  `json:"pid"`
	Mode    string `json:"mode"`
	App     string `json:"app"`
	Granted bool   `json:"granted"`
}

func (h lcHold) String() string {
	s := fmt.Sprintf("key %d: backend %d (%s) %s", h.Key, h.PID, h.App, h.Mode)
	if !h.Granted {
		s += " waiting"
	}
	return s
}

// lcWrite is one fenced write.
type lcWrite struct {
	ID     string `json:"id"`
	Call   int64  `json:"call"`
	Ret    int64  `json:"ret"`
	Result string `json:"result"` // "ok", "stale" (ErrStaleFence) or "error"
	Err    string `json:"err,omitempty"`
}

// lcSpan is a time during which a process was paused (by the nemesis) or
// stalled (as its probe saw).
type lcSpan struct {
	Proc int    `json:"proc"`
	From int64  `json:"from"`
	To   int64  `json:"to"`
	What string `json:"what"`
}

// lcEvent is one line of a process's report.
type lcEvent struct {
	Proc  int     `json:"proc"`
	Op    *lcOp   `json:"op,omitempty"`
	Stall *lcSpan `json:"stall,omitempty"`
	Done  bool    `json:"done,omitempty"` // the process finished and closed its Clients
}

// lcFault is one action of the nemesis.
type lcFault struct {
	Kind   string `json:"kind"`           // see lcNemesis.run
	At     int64  `json:"at"`             // SIGSTOP sent, or pg_terminate_backend called
	End    int64  `json:"end"`            // SIGCONT sent, or pg_terminate_backend returned
	Gone   int64  `json:"gone,omitempty"` // the terminated backend was seen gone from pg_stat_activity (0: not within 2 s)
	Proc   int    `json:"proc"`           // the paused process, or the terminated backend's
	Client int    `json:"client"`
	PID    int32  `json:"pid,omitempty"` // the terminated backend
	App    string `json:"app,omitempty"`
	Holder bool   `json:"holder,omitempty"` // it held an advisory lock
}

func lcNow() int64 { return time.Now().UnixNano() }

func lcErrString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// lcOutcome names how an acquire (or NewSession, or Close) ended, given
// the state of its context when it returned: "ok", "deadlock", "busy"
// (ErrLocked), "timeout" (its deadline passed), "cancelled" (the workload
// cancelled it), "stopped" (the run ended), "lost" (ErrLockLost or
// ErrClosed) or "error". A deadline or cancel that is not the acquire's
// own (the library's, inside) is an "error".
func lcOutcome(err error, ctx context.Context) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, ErrDeadlock):
		return "deadlock"
	case errors.Is(err, ErrLocked):
		return "busy"
	}
	if ctx != nil {
		switch cause := context.Cause(ctx); {
		case errors.Is(cause, errLockCoreStop):
			return "stopped"
		case errors.Is(cause, errLockCoreCancel):
			return "cancelled"
		case errors.Is(cause, context.DeadlineExceeded):
			return "timeout"
		}
		// On a loaded machine the timer that ends a context at its
		// deadline can fire after a statement timed out on it.
		if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
			return "timeout"
		}
	}
	if errors.Is(err, ErrLockLost) || errors.Is(err, ErrClosed) {
		return "lost"
	}
	return "error"
}

// ---------------------------------------------------------------------
// The workload of one process.

// lcProc is the workload of one process: its Clients and their goroutines.
type lcProc struct {
	proc    int
	pool    *pgxpool.Pool // pg_locks reads and fenced writes; never terminated by the nemesis
	emit    func(lcEvent)
	clients []*lcClient
}

// lcClient is one Client and the test's account of which keys its
// goroutines are busy with.
type lcClient struct {
	idx  int
	spec lcClientSpec
	app  string
	c    *Client

	mu    sync.Mutex
	act   map[int64]*lcActivity
	holds map[int64][]lcInHold // critical sections in progress, by key
	meet  chan struct{}        // closed when the goroutines waiting in meet may go
	met   int                  // goroutines waiting in meet
}

// meetOthers waits until every goroutine of the Client has called it, or for at
// most lcMeet, or until ctx ends (see lcClientSpec.joiners).
func (c *lcClient) meetOthers(ctx context.Context) {
	c.mu.Lock()
	if c.meet == nil {
		c.meet = make(chan struct{})
	}
	ch := c.meet
	if c.met++; c.met == c.spec.workers {
		close(ch)
		c.meet, c.met = nil, 0
		c.mu.Unlock()
		return
	}
	c.mu.Unlock()
	t := time.NewTimer(lcMeet)
	defer t.Stop()
	select {
	case <-ch:
		return
	case <-t.C:
	case <-ctx.Done():
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.meet == ch {
		c.met--
	}
}

// enter records that op's goroutine entered its critical section on keys,
// and returns the critical sections of the Client's other goroutines that
// its mode excludes: exclusive excludes everyone, shared excludes
// exclusive.
func (c *lcClient) enter(op *lcOp, keys []int64) []lcInHold {
	c.mu.Lock()
	defer c.mu.Unlock()
	var clash []lcInHold
	for _, k := range keys {
		for _, h := range c.holds[k] {
			if !op.Shared || !h.Shared {
				clash = append(clash, h)
			}
		}
		c.holds[k] = append(c.holds[k], lcInHold{ID: op.ID, Key: k, PID: op.PID, Shared: op.Shared})
	}
	return clash
}

// leave records that op's goroutine left its critical section (it is
// about to call Unlock).
func (c *lcClient) leave(op *lcOp, keys []int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, k := range keys {
		c.holds[k] = slices.DeleteFunc(c.holds[k], func(h lcInHold) bool { return h.ID == op.ID })
	}
}

// lcActivity counts the goroutines of a Client that are acquiring or
// holding a key, and how many ever began to.
type lcActivity struct {
	active int
	gen    uint64
}

// begin records that a goroutine starts an acquire of keys.
func (c *lcClient) begin(keys []int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, k := range keys {
		a := c.act[k]
		if a == nil {
			a = &lcActivity{}
			c.act[k] = a
		}
		a.active++
		a.gen++
	}
}

// end records that a goroutine is done with keys (its acquire failed or
// its Unlock returned). It returns the keys' generations and whether no
// other goroutine of the Client is busy with any of them.
func (c *lcClient) end(keys []int64) (gens []uint64, quiet bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	quiet = true
	for _, k := range keys {
		a := c.act[k]
		a.active--
		quiet = quiet && a.active == 0
		gens = append(gens, a.gen)
	}
	return gens, quiet
}

// quiet returns the keys' generations and whether no goroutine of the
// Client is busy with any of them now.
func (c *lcClient) quiet(keys []int64) (gens []uint64, quiet bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	quiet = true
	for _, k := range keys {
		a := c.act[k]
		quiet = quiet && a.active == 0
		gens = append(gens, a.gen)
	}
	return gens, quiet
}

// stillQuiet reports whether no goroutine of the Client has begun on keys
// since end returned gens.
func (c *lcClient) stillQuiet(keys []int64, gens []uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, k := range keys {
		if a := c.act[k]; a.gen != gens[i] || a.active != 0 {
			return false
		}
	}
	return true
}

// runLockCoreProcess runs the workload of process proc until ctx ends,
// then releases everything, closes its Clients and reports each operation
// through emit.
//
// If started is not nil, it is called with the workload once its Clients
// are open (the nemesis of this process looks at its joined holds).
func runLockCoreProcess(ctx context.Context, dsn string, proc int, seed uint64, emit func(lcEvent), started func(*lcProc)) error {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return err
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "lockcore-check"
	cfg.MaxConns = 8
	pctx, cancel := context.WithTimeout(context.Background(), lcStmt)
	pool, err := pgxpool.NewWithConfig(pctx, cfg)
	cancel()
	if err != nil {
		return err
	}
	defer pool.Close()
	p := &lcProc{proc: proc, pool: pool, emit: func(e lcEvent) { e.Proc = proc; emit(e) }}
	for i, spec := range lcClientSpecs {
		c, err := New(pool, spec.options(lcAppName(proc, i))...)
		if err != nil {
			for _, cl := range p.clients {
				_ = cl.c.Close(context.Background())
			}
			return err
		}
		p.clients = append(p.clients, &lcClient{idx: i, spec: spec, app: lcAppName(proc, i), c: c, act: map[int64]*lcActivity{}, holds: map[int64][]lcInHold{}})
	}

	if started != nil {
		started(p)
	}
	probeCtx, stopProbe := context.WithCancel(context.Background())
	var probe sync.WaitGroup
	probe.Go(func() { p.probe(probeCtx, dsn) })
	var workers sync.WaitGroup
	for _, cl := range p.clients {
		for j := range cl.spec.workers {
			w := &lcWorker{p: p, cl: cl, idx: j, rng: rand.New(rand.NewPCG(seed, uint64(proc)<<32|uint64(cl.idx)<<16|uint64(j)))}
			workers.Go(func() { w.run(ctx) })
		}
	}
	workers.Wait()

	for _, cl := range p.clients {
		op := &lcOp{ID: fmt.Sprintf("p%d-c%d-close", proc, cl.idx), Proc: proc, Client: cl.idx, Kind: "Client.Close", Start: lcNow()}
		err := cl.c.Close(context.Background())
		op.Ret, op.UnlockAt, op.Outcome, op.UnlockErr = lcNow(), lcNow(), lcOutcome(err, nil), lcErrString(err)
		p.emit(lcEvent{Op: op})
	}
	// Every lock of this process's backends is gone once its Clients are
	// closed: at once for a backend released with Close, and as soon as
	// the server notices the closed socket of one that was lost.
	end := &lcOp{ID: fmt.Sprintf("p%d-end", proc), Proc: proc, Client: -1, Kind: "end", Start: lcNow()}
	deadline := time.Now().Add(5 * time.Second)
	for pause := time.Millisecond; ; pause = min(2*pause, 50*time.Millisecond) {
		rows, err := p.locks(nil, fmt.Sprintf("%s%d-%%", lcApp, proc), 0)
		if err != nil {
			end.CheckErr = err.Error()
			break
		}
		if len(rows.Rows) == 0 || time.Now().After(deadline) {
			end.After = rows
			break
		}
		time.Sleep(pause) // polling bounded by deadline, for backends to exit
	}
	end.Ret = lcNow()
	p.emit(lcEvent{Op: end})
	stopProbe()
	probe.Wait()
	return nil
}

// lcLocksSQL reads the advisory locks of the database: of some keys (all
// if $1 is NULL), of backends whose application_name is LIKE $2 (all if
// NULL), of one backend (all if $3 is 0).
const lcLocksSQL = `SELECT (l.classid::bigint << 32) | l.objid::bigint, l.pid, l.mode, coalesce(a.application_name, ''), l.granted
	FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
	WHERE l.locktype = 'advisory' AND l.objsubid = 1
	  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
	  AND ($1::bigint[] IS NULL OR ((l.classid::bigint << 32) | l.objid::bigint) = ANY ($1))
	  AND ($2::text IS NULL OR a.application_name LIKE $2)
	  AND ($3::int = 0 OR l.pid = $3)
	ORDER BY 1, 2, 3`

// locks reads pg_locks: granted locks only, unless keys are given (then
// waiters too, for the snapshot of a starved acquire).
func (p *lcProc) locks(keys []int64, app string, pid int32) (*lcSeen, error) {
	ctx, cancel := context.WithTimeout(context.Background(), lcStmt)
	defer cancel()
	var appArg any
	if app != "" {
		appArg = app
	}
	var keysArg any
	if keys != nil {
		keysArg = keys
	}
	seen := &lcSeen{At: lcNow()}
	rows, err := p.pool.Query(ctx, lcLocksSQL, keysArg, appArg, pid)
	if err != nil {
		return nil, err
	}
	all, err := pgx.CollectRows(rows, pgx.RowToStructByPos[lcHold])
	seen.End = lcNow()
	if err != nil {
		return nil, err
	}
	for _, h := range all {
		if h.Granted {
			seen.Rows = append(seen.Rows, h)
		}
	}
	return seen, nil
}

// lcHeldAsExpected reports whether rows (granted locks of keys) show keys
// held by backend pid: exclusively, or shared with no exclusive holder.
func lcHeldAsExpected(rows []lcHold, keys []int64, pid int32, shared bool) bool {
	for _, k := range keys {
		mine := false
		for _, h := range rows {
			if h.Key != k {
				continue
			}
			switch {
			case h.PID == pid && h.Mode == lcMode(shared):
				mine = true
			case shared && h.Mode == "ShareLock":
				// another reader
			default:
				return false
			}
		}
		if !mine {
			return false
		}
	}
	return true
}

// lcMismatch names what rows show that lcHeldAsExpected refused:
// "overlap" if a key is granted in a conflicting mode to someone (another
// backend, or the holder's own backend in the other mode), "not held" if
// a key is merely not granted to the holder's backend.
func lcMismatch(rows []lcHold, keys []int64, pid int32, shared bool) string {
	if _, ok := lcOffender(rows, keys, pid, shared); ok {
		return "overlap"
	}
	return "not held"
}

// lcOffender returns the first row that grants one of keys in a mode that
// conflicts with the holder's.
func lcOffender(rows []lcHold, keys []int64, pid int32, shared bool) (lcHold, bool) {
	for _, h := range rows {
		if !slices.Contains(keys, h.Key) {
			continue
		}
		if h.Mode == "ExclusiveLock" && (shared || h.PID != pid) || !shared && h.Mode == "ShareLock" {
			return h, true
		}
	}
	return lcHold{}, false
}

func lcMode(shared bool) string {
	if shared {
		return "ShareLock"
	}
	return "ExclusiveLock"
}

// probe measures, until ctx ends, how late the process's timers fire and
// how long a round trip to the server takes, and reports every gap longer
// than lcSlow as a stall: a time in which the library's heartbeats could
// not have run or been answered either.
func (p *lcProc) probe(ctx context.Context, dsn string) {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return
	}
	cfg.RuntimeParams["application_name"] = "lockcore-probe"
	cctx, cancel := context.WithTimeout(ctx, lcStmt)
	conn, err := pgx.ConnectConfig(cctx, cfg)
	cancel()
	if err != nil {
		return
	}
	defer core.CloseConn(conn, time.Second)
	const every = 50 * time.Millisecond
	tick := time.NewTicker(every)
	defer tick.Stop()
	last := time.Now()
	for range lcMaxOps {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		t0 := time.Now()
		if t0.Sub(last) > every+lcSlow {
			p.emit(lcEvent{Stall: &lcSpan{From: last.UnixNano(), To: t0.UnixNano(), What: "timer late"}})
		}
		qctx, cancel := context.WithTimeout(ctx, lcStmt)
		_, err := conn.Exec(qctx, "SELECT 1")
		cancel()
		t1 := time.Now()
		if t1.Sub(t0) > lcSlow {
			p.emit(lcEvent{Stall: &lcSpan{From: t0.UnixNano(), To: t1.UnixNano(), What: "round trip slow"}})
		}
		if err != nil {
			return
		}
		last = t1
	}
}

// lcLocker is what Client and Session have in common.
type lcLocker interface {
	Lock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error)
	TryLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error)
	RLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error)
	TryRLock(ctx context.Context, key Key, opts ...LockOption) (*Lock, error)
	LockAll(ctx context.Context, keys ...Key) (*Lock, error)
}

// lcWorker is one goroutine of the workload.
type lcWorker struct {
	p   *lcProc
	cl  *lcClient
	idx int
	rng *rand.Rand
	seq int
}

func (w *lcWorker) run(ctx context.Context) {
	for range lcMaxOps {
		if ctx.Err() != nil {
			return
		}
		if w.cl.spec.joiners {
			w.cl.meetOthers(ctx)
			w.round(ctx, w.cl.c, nil, lcKinds[slices.IndexFunc(lcKinds, func(k lcKind) bool { return k.name == "RLock" })])
		} else if kind := w.pick(true); kind.session {
			w.session(ctx)
		} else {
			w.round(ctx, w.cl.c, nil, kind)
		}
	}
}

// pick draws a kind of operation; sessions only if allowed.
func (w *lcWorker) pick(sessions bool) lcKind {
	weight := func(k lcKind) int {
		switch {
		case k.session && !sessions:
			return 0
		case w.cl.spec.readers:
			return k.readerWeight
		}
		return k.weight
	}
	total := 0
	for _, k := range lcKinds {
		total += weight(k)
	}
	n := w.rng.IntN(total)
	for _, k := range lcKinds {
		if n -= weight(k); n < 0 {
			return k
		}
	}
	panic("unreachable")
}

// keys draws the keys of an acquire: one, or 2 or 3 distinct ones for
// LockAll, given in random order (LockAll takes them in its own).
func (w *lcWorker) keys(kind lcKind) []int64 {
	if !kind.multi {
		if w.cl.spec.joiners {
			return []int64{lcJoinKey}
		}
		if w.cl.spec.readers {
			return []int64{1 + w.rng.Int64N(2)}
		}
		return []int64{1 + w.rng.Int64N(lcKeys)}
	}
	perm := w.rng.Perm(lcKeys)
	keys := make([]int64, 2+w.rng.IntN(2))
	for i := range keys {
		keys[i] = int64(perm[i] + 1)
	}
	return keys
}

// bound draws the deadline or cancel of an acquire.
func (w *lcWorker) bound(ctx context.Context, kind lcKind, op *lcOp) (context.Context, func()) {
	if kind.try {
		op.Bound = "try"
		return context.WithTimeout(ctx, lcStmt)
	}
	switch r := w.rng.IntN(100); {
	case r < 10:
		op.Bound, op.Patient = fmt.Sprintf("deadline %v", lcPatient), true
		return context.WithTimeout(ctx, lcPatient)
	case r < 35:
		d := time.Millisecond + time.Duration(w.rng.Int64N(int64(800*time.Millisecond)))
		op.Bound = fmt.Sprintf("cancel after %v", d.Round(time.Millisecond))
		cctx, cancel := context.WithCancelCause(ctx)
		t := time.AfterFunc(d, func() { cancel(errLockCoreCancel) })
		tctx, tcancel := context.WithTimeout(cctx, lcPatient)
		return tctx, func() { t.Stop(); tcancel(); cancel(nil) }
	case r < 50:
		d := time.Millisecond + time.Duration(w.rng.Int64N(int64(30*time.Millisecond)))
		op.Bound = fmt.Sprintf("deadline %v", d.Round(time.Millisecond))
		return context.WithTimeout(ctx, d)
	default:
		d := 30*time.Millisecond + time.Duration(w.rng.Int64N(int64(1500*time.Millisecond)))
		op.Bound = fmt.Sprintf("deadline %v", d.Round(time.Millisecond))
		return context.WithTimeout(ctx, d)
	}
}

func lcAcquire(ctx context.Context, on lcLocker, kind lcKind, keys []int64) (*Lock, error) {
	ks := make([]Key, len(keys))
	for i, k := range keys {
		ks[i] = Int64Key(k)
	}
	var opts []LockOption
	if kind.fence {
		opts = append(opts, WithFence())
	}
	switch {
	case kind.multi:
		return on.LockAll(ctx, ks...)
	case kind.shared && kind.try:
		return on.TryRLock(ctx, ks[0])
	case kind.shared:
		return on.RLock(ctx, ks[0])
	case kind.try:
		return on.TryLock(ctx, ks[0], opts...)
	}
	return on.Lock(ctx, ks[0], opts...)
}

// think waits up to max (a critical section's work), or until l ends.
func (w *lcWorker) think(l *Lock, max time.Duration) {
	if max <= 0 {
		return
	}
	t := time.NewTimer(time.Duration(w.rng.Int64N(int64(max))))
	defer t.Stop()
	select {
	case <-t.C:
	case <-l.Done():
	}
}

// round runs one acquire on the Client or on the Session s, and if it
// succeeds, a critical section and the release, checking pg_locks at each
// step, and reports the record.
func (w *lcWorker) round(ctx context.Context, on lcLocker, s *Session, kind lcKind) {
	w.seq++
	op := &lcOp{ID: fmt.Sprintf("p%d-c%d-w%d-%d", w.p.proc, w.cl.idx, w.idx, w.seq), Proc: w.p.proc, Client: w.cl.idx, Kind: kind.name, Shared: kind.shared}
	if s != nil {
		op.Kind, op.Session = "Session."+kind.name, s.PID()
	}
	defer func() { w.p.emit(lcEvent{Op: op}) }()
	keys := w.keys(kind)
	op.Keys = keys
	actx, release := w.bound(ctx, kind, op)
	w.cl.begin(keys)
	op.Start = lcNow()
	l, err := lcAcquire(actx, on, kind, keys)
	op.Ret = lcNow()
	op.Outcome = lcOutcome(err, actx)
	release()
	if err != nil {
		op.Err = err.Error()
		if op.Patient && op.Outcome == "timeout" {
			if seen, err := w.p.locksAll(keys); err == nil {
				op.Snapshot = seen
			}
		}
		op.ErrLost = errors.Is(err, ErrLockLost)
		gens, quiet := w.cl.end(keys)
		switch op.Outcome {
		case "busy", "timeout", "cancelled", "stopped":
			// A failed acquire leaves nothing behind on any backend of
			// the Client; if its backend was lost meanwhile, the server
			// frees what it held when it notices the closed socket.
			w.after(op, keys, gens, quiet, w.cl.app, 0)
			if op.After != nil && len(op.After.Rows) > 0 {
				if op.ErrLost {
					op.AfterGone = w.p.gone(op.After.Rows)
				} else {
					// The Client may have given the backend up (a
					// lease that ran out while the process was
					// paused) with no lock on it to report the loss:
					// the server frees the keys when the backend
					// exits. A key left on a backend that lives on is
					// a leak.
					op.AfterExited = w.p.exited(op.After.Rows)
				}
			}
		}
		return
	}
	op.PID, op.Fence = lockBackendPID(&l.core), int64(l.Fence())
	var doneAt int64
	var doneErr error
	watched := make(chan struct{})
	go func() {
		<-l.Done()
		doneAt, doneErr = lcNow(), l.Err()
		close(watched)
	}()

	think := 15 * time.Millisecond
	if w.cl.spec.joiners {
		think = 30 * time.Millisecond
	}
	op.Overlaps = w.cl.enter(op, keys)
	op.Entry = w.check(op, keys, kind.shared)
	if w.rng.IntN(100) < 5 {
		w.think(l, lcLoss/2+time.Duration(w.rng.Int64N(int64(3*lcLoss/2)))) // a long one, to be lost in
	} else {
		w.think(l, think)
	}
	if kind.fence {
		for i := range 1 + w.rng.IntN(2) {
			op.Writes = append(op.Writes, w.write(l, op, i))
		}
	}
	w.think(l, think)
	op.Exit = w.check(op, keys, kind.shared)
	w.cl.leave(op, keys)

	uctx, cancel := context.WithTimeout(context.Background(), lcStmt)
	if w.rng.IntN(100) < 15 {
		cancel() // Unlock works with a context that has already ended
	}
	op.UnlockCall = lcNow()
	err = l.Unlock(uctx)
	cancel()
	op.UnlockAt, op.UnlockErr, op.UnlockLost = lcNow(), lcErrString(err), errors.Is(err, ErrLockLost)
	select {
	case <-watched:
		op.DoneAt, op.DoneErr, op.DoneLost = doneAt, lcErrString(doneErr), errors.Is(doneErr, ErrLockLost)
	case <-time.After(lcStmt):
	}
	gens, quiet := w.cl.end(keys)
	if err == nil {
		w.after(op, keys, gens, quiet, "", op.PID)
	}
}

// check reads pg_locks for keys inside a critical section.
func (w *lcWorker) check(op *lcOp, keys []int64, shared bool) *lcSeen {
	seen, err := w.p.locks(keys, "", 0)
	if err != nil {
		op.CheckErr = err.Error()
		return nil
	}
	seen.OK = lcHeldAsExpected(seen.Rows, keys, op.PID, shared)
	return seen
}

// after reads which of keys are still granted to the Client's backends
// (app) or to one backend (pid), once the goroutine is done with them, if
// no other goroutine of the Client was busy with them from then until the
// read was answered.
//
// When another goroutine is busy with the keys at first, the read waits,
// at most lcQuietWait, for a moment when none is (op.AfterLate): then no
// goroutine of the Client may hold the keys, so whatever pg_locks shows is
// left behind by this release or a later one of the Client's, unless
// that backend was lost meanwhile (the checker allows that).
func (w *lcWorker) after(op *lcOp, keys []int64, gens []uint64, quiet bool, app string, pid int32) {
	if !quiet {
		deadline := time.Now().Add(lcQuietWait)
		for !quiet && time.Now().Before(deadline) {
			time.Sleep(2 * time.Millisecond)
			gens, quiet = w.cl.quiet(keys)
		}
		if !quiet {
			op.AfterSkipped = true
			return
		}
		op.AfterLate = true
	}
	seen, err := w.p.locks(keys, app, pid)
	if err != nil {
		op.CheckErr = err.Error()
		return
	}
	if !w.cl.stillQuiet(keys, gens) {
		op.AfterSkipped = true
		return
	}
	op.After = seen
}

// exited waits, at most 2 s, until every backend of rows has left
// pg_stat_activity, and returns when that was seen (0 if not).
func (p *lcProc) exited(rows []lcHold) int64 {
	var pids []int32
	for _, h := range rows {
		pids = append(pids, h.PID)
	}
	deadline := time.Now().Add(2 * time.Second)
	for pause := time.Millisecond; time.Now().Before(deadline); pause = min(2*pause, 50*time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), lcStmt)
		var n int
		err := p.pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY ($1)", pids).Scan(&n)
		cancel()
		if err != nil {
			return 0
		}
		if n == 0 {
			return lcNow()
		}
		time.Sleep(pause) // polling bounded by deadline, for a backend to exit
	}
	return 0
}

// gone waits, at most 2 s, until none of rows is granted any more, and
// returns when that was seen (0 if not).
func (p *lcProc) gone(rows []lcHold) int64 {
	var keys []int64
	for _, h := range rows {
		keys = append(keys, h.Key)
	}
	deadline := time.Now().Add(2 * time.Second)
	for pause := time.Millisecond; time.Now().Before(deadline); pause = min(2*pause, 50*time.Millisecond) {
		seen, err := p.locks(keys, "", 0)
		if err != nil {
			return 0
		}
		if !slices.ContainsFunc(seen.Rows, func(h lcHold) bool {
			return slices.ContainsFunc(rows, func(r lcHold) bool { return r.PID == h.PID && r.Key == h.Key })
		}) {
			return seen.End
		}
		time.Sleep(pause) // polling bounded by deadline, for a backend to exit
	}
	return 0
}

// locksAll reads the holders and waiters of keys.
func (p *lcProc) locksAll(keys []int64) ([]lcHold, error) {
	ctx, cancel := context.WithTimeout(context.Background(), lcStmt)
	defer cancel()
	rows, err := p.pool.Query(ctx, lcLocksSQL, keys, nil, 0)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[lcHold])
}

// write makes a fenced write with l's fence, as the data l protects would
// be written: CheckFence, the work (a random pause while the fence's row
// is share-locked), the insert, the commit.
func (w *lcWorker) write(l *Lock, op *lcOp, n int) lcWrite {
	wr := lcWrite{ID: fmt.Sprintf("%s-w%d", op.ID, n)}
	work := time.Duration(w.rng.Int64N(int64(15 * time.Millisecond)))
	ctx, cancel := context.WithTimeout(context.Background(), lcStmt)
	defer cancel()
	wr.Call = lcNow()
	err := pgx.BeginFunc(ctx, w.p.pool, func(tx pgx.Tx) error {
		if err := CheckFence(ctx, tx, l.Key(), l.Fence()); err != nil {
			return err
		}
		t := time.NewTimer(work)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		_, err := tx.Exec(ctx, "INSERT INTO lockcore_writes (key, fence, holder, op, pid) VALUES ($1, $2, $3, $4, $5)",
			op.Keys[0], l.Fence(), op.ID, wr.ID, op.PID)
		return err
	})
	wr.Ret = lcNow()
	switch {
	case err == nil:
		wr.Result = "ok"
	case errors.Is(err, ErrStaleFence):
		wr.Result = "stale"
	default:
		wr.Result, wr.Err = "error", err.Error()
	}
	return wr
}

// session opens a Session, runs a few acquires on it, closes it, and
// checks that its backend holds nothing after Close returned nil.
func (w *lcWorker) session(ctx context.Context) {
	w.seq++
	op := &lcOp{ID: fmt.Sprintf("p%d-c%d-w%d-%d", w.p.proc, w.cl.idx, w.idx, w.seq), Proc: w.p.proc, Client: w.cl.idx, Kind: "NewSession"}
	defer func() { w.p.emit(lcEvent{Op: op}) }()
	sctx, cancel := context.WithTimeout(ctx, lcStmt)
	op.Start = lcNow()
	s, err := w.cl.c.NewSession(sctx)
	op.Ret = lcNow()
	op.Outcome = lcOutcome(err, sctx)
	cancel()
	if err != nil {
		op.Err = err.Error()
		return
	}
	op.PID, op.Session = s.PID(), s.PID()
	var doneAt int64
	var doneErr error
	watched := make(chan struct{})
	go func() {
		<-s.Done()
		doneAt, doneErr = lcNow(), s.Err()
		close(watched)
	}()
	for range 1 + w.rng.IntN(4) {
		if ctx.Err() != nil {
			break
		}
		w.round(ctx, s, s, w.pick(false))
	}
	cctx, cancel := context.WithTimeout(context.Background(), lcStmt)
	err = s.Close(cctx)
	cancel()
	op.UnlockAt, op.UnlockErr = lcNow(), lcErrString(err)
	select {
	case <-watched:
		op.DoneAt, op.DoneErr, op.DoneLost = doneAt, lcErrString(doneErr), errors.Is(doneErr, ErrLockLost)
	case <-time.After(lcStmt):
	}
	if err == nil && !op.DoneLost {
		// Close returned nil on a session that was not lost: its
		// backend released everything.
		if seen, err := w.p.locks(nil, "", op.PID); err == nil {
			op.After = seen
		} else {
			op.CheckErr = err.Error()
		}
	}
}

// runLockCoreChild is the child process of TestLockCoreRandomized: it runs
// the workload of its process number until it reads "stop" (or its
// standard input ends), printing an lcEvent per line, and then
// {"done":true}.
func runLockCoreChild(out *childOut) error {
	seed, err := strconv.ParseUint(os.Getenv(lockCoreSeedEnv), 10, 64)
	if err != nil {
		return fmt.Errorf("%s: %w", lockCoreSeedEnv, err)
	}
	proc, err := strconv.Atoi(os.Getenv(lockCoreProcEnv))
	if err != nil {
		return fmt.Errorf("%s: %w", lockCoreProcEnv, err)
	}
	runFor, err := time.ParseDuration(os.Getenv(lockCoreForEnv))
	if err != nil {
		return fmt.Errorf("%s: %w", lockCoreForEnv, err)
	}
	ctx, stop := context.WithCancelCause(context.Background())
	defer stop(nil)
	safety := time.AfterFunc(runFor+2*time.Minute, func() { stop(errLockCoreStop) })
	defer safety.Stop()
	go func() {
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() && in.Text() != "stop" {
		}
		stop(errLockCoreStop)
	}()
	emit := func(e lcEvent) {
		b, err := json.Marshal(e)
		if err != nil {
			out.printf("error %v", err)
			return
		}
		out.printf("%s", b)
	}
	if err := runLockCoreProcess(ctx, os.Getenv(faultDSNEnv), proc, seed, emit, nil); err != nil {
		return err
	}
	emit(lcEvent{Proc: proc, Done: true})
	return nil
}

// ---------------------------------------------------------------------
// The nemesis.

// lcNemesis terminates the Clients' backends and pauses child processes.
type lcNemesis struct {
	rng   *rand.Rand
	admin *pgxpool.Pool
	procs []*faultProc           // child process i+1
	own   atomic.Pointer[lcProc] // the workload of this process, once it runs

	mu     sync.Mutex // faults and notes
	faults []lcFault
	notes  []string // what went wrong with the nemesis itself
}

// note records what went wrong with the nemesis itself.
func (n *lcNemesis) note(format string, args ...any) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.notes = append(n.notes, fmt.Sprintf(format, args...))
}

// record records a fault.
func (n *lcNemesis) record(f lcFault) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.faults = append(n.faults, f)
}

// The kinds of faults, each injected in turn (in a shuffled order per
// cycle), every 100 to 500 ms:
//   - "terminate holder": pg_terminate_backend of a backend that holds an
//     advisory lock;
//   - "terminate reader": of one that holds a key shared, which several
//     goroutines of its Client may hold at once (a joined hold, whose
//     releases but the last send nothing to the server): first, for up to
//     a second, one under a hold that two goroutines of a Client of this
//     process share at that moment (joinedReader; the joiners Client
//     makes them common), else any; "terminate holder" when none does;
//   - "terminate any": of any backend of the Clients, holding, waiting or
//     idle;
//   - "pause < L": SIGSTOP of a child for 50 ms to L/2, then SIGCONT;
//   - "pause > L": for L + 100 ms to 2.5L: the child's sessions are lost
//     by its own clock when it resumes, but the server kept its locks;
//   - "pause + terminate": SIGSTOP of a child, termination of one of its
//     backends (one that holds a lock, if any), SIGCONT after 100 ms to
//     1.5L: others take over before the child can know.
var lcFaultKinds = []string{"terminate holder", "terminate reader", "terminate any", "pause < L", "pause > L", "pause + terminate"}

func (n *lcNemesis) run(deadline time.Time) {
	kinds := slices.Clone(lcFaultKinds)
	for i := range lcMaxOps {
		if i%len(kinds) == 0 {
			n.rng.Shuffle(len(kinds), func(a, b int) { kinds[a], kinds[b] = kinds[b], kinds[a] })
		}
		n.wait(100*time.Millisecond + time.Duration(n.rng.Int64N(int64(400*time.Millisecond))))
		if !time.Now().Before(deadline) {
			return
		}
		switch kind := kinds[i%len(kinds)]; kind {
		case "terminate holder", "terminate reader":
			n.terminate(kind, "", true)
		case "terminate any":
			n.terminate(kind, "", false)
		case "pause < L":
			n.pause(kind, 50*time.Millisecond+time.Duration(n.rng.Int64N(int64(lcLoss/2-50*time.Millisecond))), false)
		case "pause > L":
			n.pause(kind, lcLoss+100*time.Millisecond+time.Duration(n.rng.Int64N(int64(3*lcLoss/2-100*time.Millisecond))), false)
		case "pause + terminate":
			n.pause(kind, 100*time.Millisecond+time.Duration(n.rng.Int64N(int64(lcLoss+lcLoss/2-100*time.Millisecond))), true)
		}
	}
}

// wait is the time between two faults, or a pause's length.
func (n *lcNemesis) wait(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	<-t.C
}

// terminate ends one backend of the Clients whose application_name is
// LIKE app (all Clients' if empty), preferring one that holds a lock if
// holders is set. It reports whether it ended one.
func (n *lcNemesis) terminate(kind, app string, holders bool) bool {
	if app == "" {
		app = lcApp + "%"
	}
	if kind == "terminate reader" {
		if b, ok := n.joinedReader(); ok {
			return n.end(kind, b)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), lcStmt)
	defer cancel()
	type backend = lcBackend
	rows, err := n.admin.Query(ctx, `SELECT a.pid, a.application_name,
			EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted),
			EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted AND l.mode = 'ShareLock')
		FROM pg_stat_activity a WHERE a.datname = current_database() AND a.application_name LIKE $1 ORDER BY a.pid`, app)
	if err != nil {
		n.note("%s: list backends: %v", kind, err)
		return false
	}
	all, err := pgx.CollectRows(rows, pgx.RowToStructByPos[backend])
	if err != nil || len(all) == 0 {
		n.note("%s: no backend to terminate (%v)", kind, err)
		return false
	}
	pick := all
	if kind == "terminate reader" {
		if r := slices.DeleteFunc(slices.Clone(all), func(b backend) bool { return !b.Reader }); len(r) > 0 {
			pick, holders = r, false
		} else {
			kind = "terminate holder" // nobody holds a key shared just now
		}
	}
	if holders {
		if h := slices.DeleteFunc(slices.Clone(all), func(b backend) bool { return !b.Holder }); len(h) > 0 {
			pick = h
		} else if kind == "terminate holder" {
			kind = "terminate any" // nobody holds anything just now
		}
	}
	return n.end(kind, pick[n.rng.IntN(len(pick))])
}

// lcBackend is a backend of the Clients, as terminate lists them.
type lcBackend struct {
	PID    int32
	App    string
	Holder bool
	Reader bool // holds a key shared, which several handles of its Client may share
}

// joinedReader looks, for at most a second, for a hold that goroutines
// of one Client of this process share (a joined hold): two or more in
// their critical sections on one key, shared, on one backend. Terminated,
// such a backend leaves the handles whose Unlock sends no release, which
// only Unlock's round trip can tell (lcClientSpec.joiners makes them
// common).
func (n *lcNemesis) joinedReader() (lcBackend, bool) {
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); <-tick.C {
		p := n.own.Load()
		if p == nil {
			continue
		}
		for _, cl := range p.clients {
			cl.mu.Lock()
			for _, hs := range cl.holds {
				for i, h := range hs {
					if h.Shared && slices.ContainsFunc(hs[i+1:], func(o lcInHold) bool { return o.Shared && o.PID == h.PID }) {
						cl.mu.Unlock()
						return lcBackend{PID: h.PID, App: cl.app, Holder: true, Reader: true}, true
					}
				}
			}
			cl.mu.Unlock()
		}
	}
	return lcBackend{}, false
}

// end terminates the backend b, waits (at most 2 s) until it has left
// pg_stat_activity, and records the fault. It reports whether it ended
// the backend.
func (n *lcNemesis) end(kind string, b lcBackend) bool {
	ctx, cancel := context.WithTimeout(context.Background(), lcStmt)
	defer cancel()
	f := lcFault{Kind: kind, PID: b.PID, App: b.App, Holder: b.Holder, Client: -1}
	if _, err := fmt.Sscanf(strings.TrimPrefix(b.App, lcApp), "%d-%d", &f.Proc, &f.Client); err != nil {
		n.note("%s: application_name %q: %v", kind, b.App, err)
	}
	var ok bool
	f.At = lcNow()
	err := n.admin.QueryRow(ctx, "SELECT pg_terminate_backend($1)", b.PID).Scan(&ok)
	f.End = lcNow()
	if err != nil || !ok {
		n.note("%s: terminate backend %d: %v, %v", kind, b.PID, ok, err)
		return false
	}
	// When the backend has left pg_stat_activity it has exited: a
	// statement sent to it from then on fails.
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		var gone bool
		if err := n.admin.QueryRow(ctx, "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", b.PID).Scan(&gone); err != nil {
			break
		}
		if gone {
			f.Gone = lcNow()
			break
		}
		time.Sleep(2 * time.Millisecond)
	}
	n.record(f)
	return true
}

// pause stops a child process for d, terminating one of its backends
// meanwhile if terminate is set.
func (n *lcNemesis) pause(kind string, d time.Duration, terminate bool) {
	proc := 1 + n.rng.IntN(len(n.procs))
	p := n.procs[proc-1]
	f := lcFault{Kind: kind, Proc: proc, Client: -1, At: lcNow()}
	p.Signal(syscall.SIGSTOP)
	if terminate {
		n.terminate("terminate while paused", fmt.Sprintf("%s%d-%%", lcApp, proc), true)
	}
	n.wait(d)
	p.Signal(syscall.SIGCONT)
	f.End = lcNow()
	n.record(f)
}

// ---------------------------------------------------------------------
// The test.

// lcCollector gathers the reports of every process.
type lcCollector struct {
	mu     sync.Mutex
	ops    []lcOp
	stalls []lcSpan
	done   map[int]bool
	junk   []string // lines of a child that are no event
}

func (c *lcCollector) add(e lcEvent) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case e.Op != nil:
		c.ops = append(c.ops, *e.Op)
	case e.Stall != nil:
		s := *e.Stall
		s.Proc = e.Proc
		c.stalls = append(c.stalls, s)
	case e.Done:
		c.done[e.Proc] = true
	}
}

func (c *lcCollector) read(proc int, p *faultProc) {
	for line := range p.Lines() {
		var e lcEvent
		if err := json.Unmarshal([]byte(line), &e); err != nil || e.Proc != proc {
			c.mu.Lock()
			c.junk = append(c.junk, fmt.Sprintf("process %d: %s", proc, line))
			c.mu.Unlock()
			continue
		}
		c.add(e)
	}
}

func startLockCoreChild(t testing.TB, dsn string, proc int, seed uint64, runFor time.Duration) *faultProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(),
		faultChildEnv+"=lockcore",
		faultDSNEnv+"="+dsn,
		lockCoreSeedEnv+"="+strconv.FormatUint(seed, 10),
		lockCoreProcEnv+"="+strconv.Itoa(proc),
		lockCoreForEnv+"="+runFor.String())
	return &faultProc{Process: pgtest.StartProcess(t, cmd)}
}

// TestLockCoreRandomized: see the top of this file.
func TestLockCoreRandomized(t *testing.T) {
	if *lockCoreFor <= 0 {
		t.Fatalf("-lockcore.duration=%v: give a positive duration", *lockCoreFor)
	}
	t.Parallel()
	seed := *lockCoreSeed
	if seed == 0 {
		seed = rand.Uint64()
	}
	runFor := *lockCoreFor
	t.Logf("seed %d, duration %v; replay: go test -race -count=1 -run 'TestLockCoreRandomized$' -lockcore.seed=%d -lockcore.duration=%v .", seed, runFor, seed, runFor)
	fail := func(format string, args ...any) {
		t.Helper()
		t.Errorf("seed %d: "+format, append([]any{seed}, args...)...)
	}

	dsn := pgtest.DB(t)
	pool := migrated(t, dsn)
	if _, err := pool.Exec(testCtx(t), `CREATE TABLE lockcore_writes (
		id     bigserial PRIMARY KEY,
		key    bigint NOT NULL,
		fence  bigint NOT NULL,
		holder text NOT NULL,
		op     text NOT NULL UNIQUE,
		pid    integer NOT NULL)`); err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	// A wait slice at L = 1s is 375 ms, shorter than PostgreSQL's default
	// deadlock_timeout of 1 s, so the deadlock detector would never look
	// at a cycle of backends before lock_timeout ends the slice (at the
	// default L of 5 s, a slice is 2 s and it does). Detecting sooner
	// changes nothing else: what it reports is a cycle among backends,
	// which this workload's goroutines never form.
	if _, err := pool.Exec(testCtx(t), `DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET deadlock_timeout = %L', current_database(), '100ms'); END $$`); err != nil {
		t.Logf("seed %d: deadlock_timeout stays at its default: %v", seed, err)
	}

	col := &lcCollector{done: map[int]bool{}}
	start := time.Now()
	procs := make([]*faultProc, lcChildren)
	var readers sync.WaitGroup
	for i := range procs {
		procs[i] = startLockCoreChild(t, dsn, i+1, seed, runFor)
		readers.Go(func() { col.read(i+1, procs[i]) })
	}
	runCtx, stopRun := context.WithCancelCause(context.Background())
	defer stopRun(errLockCoreStop)
	own := make(chan error, 1)
	nemesis := &lcNemesis{rng: rand.New(rand.NewPCG(seed, math.MaxUint64)), admin: pgtest.Pool(t, dsn), procs: procs}
	go func() { own <- runLockCoreProcess(runCtx, dsn, 0, seed, col.add, nemesis.own.Store) }()

	nemesis.run(start.Add(runFor))
	stopRun(errLockCoreStop)
	for _, p := range procs {
		p.Signal(syscall.SIGCONT)
		p.Send(t, "stop")
	}
	// Each goroutine ends its current operation: an acquire ends with
	// the run's context, a critical section with its checks, writes and
	// release, each bounded by lcStmt.
	stopBound := 6*lcStmt + lcLoss
	select {
	case err := <-own:
		if err != nil {
			t.Fatalf("seed %d: workload of this process: %v", seed, err)
		}
	case <-time.After(stopBound):
		t.Fatalf("seed %d: the workload of this process did not stop within %v", seed, stopBound)
	}
	for i, p := range procs {
		select {
		case <-p.Exited():
			if err := p.ExitErr(); err != nil {
				fail("child process %d (pid %d): %v\n%s", i+1, p.Pid(), err, p.Stderr())
			}
		case <-time.After(stopBound):
			fail("child process %d (pid %d) did not stop within %v", i+1, p.Pid(), stopBound)
			p.Kill(t)
		}
	}
	readers.Wait()
	for i := range procs {
		if !col.done[i+1] {
			fail("child process %d did not report the end of its workload", i+1)
		}
	}
	for _, line := range col.junk {
		fail("unexpected output: %s", line)
	}

	// Nothing is left on the server once every process is done.
	var left []pgtest.AdvisoryLock
	deadline := time.Now().Add(10 * time.Second)
	for pause := time.Millisecond; ; pause = min(2*pause, 50*time.Millisecond) {
		left = pgtest.AdvisoryLocks(t, dsn)
		if len(left) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(pause) // polling bounded by deadline, for backends to exit
	}
	if len(left) > 0 {
		fail("locks at end: 10 s after every process closed its Clients and exited, pg_locks shows %d advisory locks: %v", len(left), left)
	}

	rows, err := pool.Query(testCtx(t), "SELECT id, key, fence, holder, op, pid FROM lockcore_writes ORDER BY id")
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	written, err := pgx.CollectRows(rows, pgx.RowToStructByPos[lcRow])
	if err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	for _, note := range nemesis.notes {
		t.Logf("nemesis: %s", note)
	}

	in := &lcInput{t0: start.UnixNano(), loss: lcLoss, ops: col.ops, faults: nemesis.faults, stalls: col.stalls, rows: written}
	rep := lcAnalyze(in)
	const shown = 40
	for i, v := range rep.violations {
		if i == shown {
			fail("%d more violations (%v in all)", len(rep.violations)-shown, rep.byKind())
			break
		}
		if v.more > 0 {
			v.msg += fmt.Sprintf(" [and %d more violations of one cause, the last at %s]", v.more, in.ts(v.last))
		}
		fail("%s at %s: %s", v.kind, in.ts(v.at), v.msg)
	}
	t.Logf("seed %d, %v, %d processes of %d goroutines: %s", seed, runFor, 1+lcChildren, lcWorkers(), rep.summary())

	// Floors: the run did enough, and every fault happened, for its
	// duration to mean something.
	secs := runFor.Seconds()
	floor := func(what string, got int, want float64) {
		if float64(got) < want {
			fail("floor: %s: %d, want at least %.0f for a run of %v", what, got, want, runFor)
		}
	}
	floor("acquires that succeeded", rep.sum(func(k string) bool { return strings.HasSuffix(k, " ok") && strings.HasPrefix(k, "acquire ") }), 2*secs)
	for _, k := range lcKinds {
		if k.session {
			floor("NewSession that succeeded", rep.counts["session NewSession ok"], 1)
			continue
		}
		floor(k.name+" that succeeded", rep.counts["acquire "+k.name+" ok"], 1)
	}
	floor("acquires on a Session that succeeded", rep.sum(func(k string) bool { return strings.HasPrefix(k, "acquire Session.") && strings.HasSuffix(k, " ok") }), 1)
	floor("fenced writes accepted", rep.counts["write ok"], secs/2)
	floor("checks after Unlock that counted", rep.counts["after Unlock checked"], secs/2)
	// The checks after a release (Unlock returned nil) that were skipped,
	// because the Client's other goroutines did not leave the keys alone
	// for lcQuietWait: a check skipped too often would let a lock left
	// behind pass unseen. The checks after a failed acquire are skipped
	// more often (the acquire failed because the key was busy, often with
	// the Client's own readers): logged, not bounded.
	share := func(what, checked, late, skipped string) float64 {
		c, l, k := rep.counts[checked], rep.counts[late], rep.counts[skipped]
		if c+k == 0 {
			return 0
		}
		f := float64(k) / float64(c+k)
		t.Logf("checks %s: %d made, %d skipped (%.1f%%); %d of those made waited for the Client's other goroutines to be done with the keys (without that wait, %.1f%% skipped)",
			what, c, k, 100*f, l, 100*float64(k+l)/float64(c+k))
		return f
	}
	if f := share("after a release", "after Unlock checked", "after Unlock checked late", "after Unlock skipped"); f > lcMaxSkipped {
		fail("%.1f%% of the checks after a release were skipped, want at most %.0f%%", 100*f, 100*lcMaxSkipped)
	}
	share("after a failed acquire", "after failure checked", "after failure checked late", "after failure skipped")
	floor("critical sections checked at entry and exit", rep.counts["entry checked"], 2*secs)
	floor("locks lost", rep.counts["locks lost"], 1)
	// A handle of a joined shared hold unlocked after its backend was
	// seen gone: the case only Unlock's round trip tells (see joiners).
	floor("shared Unlocks called after their backend was gone", rep.counts["shared Unlock called after its backend was gone"], 1)
	for _, kind := range lcFaultKinds {
		floor("faults "+kind, rep.counts["fault "+kind], max(1, secs/15))
	}
}

func lcWorkers() int {
	n := 0
	for _, s := range lcClientSpecs {
		n += s.workers
	}
	return n
}
