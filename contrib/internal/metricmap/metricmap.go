// Package metricmap is the one description of how pgcoord's events, and
// the Stat of the Clients a metrics value watches, become measurements.
// The contrib metric modules (contrib/otel, contrib/prometheus) share it;
// each only adapts it to its SDK:
//
//   - it creates one instrument for each entry of [Instruments], under the
//     name and label keys of its SDK ([Desc.OTel] or [Desc.Prom], and
//     [LabelKeys]), of the [Kind] the entry says;
//   - it passes a [Recorder] that records on those instruments to
//     [Mapper.Hooks], and gives the hooks to its Clients;
//   - at each collection it reads [Watched.Stat] and reports it through
//     [ObserveStat].
//
// The Mapper bounds every label: a lock is labelled by the name that
// pgcoord.WithKeyNames gives its key, never by the key; "" becomes
// [Unnamed]; at most maxNames distinct names of each of locks, elections
// and semaphores are kept, later ones become [Other]. Its state is bounded
// the same way, however many names it sees: the highest term of the term
// gauge is kept per label value, not per election.
//
// The package belongs to the root module (contrib has no go.mod), under
// contrib/internal, so only the contrib modules can import it. It imports
// only the root package and the standard library, so the root module's
// dependency graph is the same with it. The contrib modules are released
// in lockstep with the root module, so its API may change with theirs.
package metricmap

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"

	"github.com/pgcoord/pgcoord"
)

// Label values for names that have none, and for names beyond the bound.
const (
	Unnamed = "unnamed"
	Other   = "other"
)

// DefaultMaxNames is how many distinct names of each kind both modules
// keep unless their WithMaxNames says otherwise.
const DefaultMaxNames = 64

// DefaultBuckets returns the bounds, in seconds, of both modules' wait-time
// histograms unless their WithBuckets says otherwise: 0.5 ms to 32 s, ×4.
// Each call returns a new slice.
func DefaultBuckets() []float64 {
	return []float64{0.0005, 0.002, 0.008, 0.032, 0.128, 0.512, 2.048, 8.192, 32.768}
}

// A Kind says how an instrument is recorded.
type Kind int

// The kinds of instruments.
const (
	// Counter only goes up: Recorder.Add with 1.
	Counter Kind = iota + 1
	// UpDownCounter goes up and down: Recorder.Add with 1 or -1.
	UpDownCounter
	// Histogram takes durations: Recorder.Observe with seconds.
	Histogram
	// Gauge takes the last value: Recorder.Set.
	Gauge
	// ObservedUpDown is read from the watched Clients' Stat at each
	// collection (ObserveStat); it may go down.
	ObservedUpDown
	// ObservedCounter is read from the watched Clients' Stat at each
	// collection (ObserveStat); it only goes up.
	ObservedCounter
)

// A Label is one dimension of a measurement.
type Label int

// The labels, each with a bounded set of values.
const (
	LockName       Label = iota // the name of the lock's key, Unnamed or Other
	LockMode                    // "exclusive" or "shared"
	Result                      // see ResultOf
	Location                    // where an acquire found its key held: "local" or "server"
	ElectionName                // the election's name, Unnamed or Other
	SemaphoreName               // the semaphore's name, Unnamed or Other
	ConnectionRole              // "backend", "session" or "connecting"
	WaitState                   // "server" or "queued"
)

// Keys are the names of a label in each SDK.
type Keys struct {
	OTel string // OpenTelemetry attribute key
	Prom string // Prometheus label name
}

// LabelKeys holds the keys of each Label.
var LabelKeys = [...]Keys{
	LockName:       {"pgcoord.lock.name", "name"},
	LockMode:       {"pgcoord.lock.mode", "mode"},
	Result:         {"pgcoord.result", "result"},
	Location:       {"pgcoord.contention.location", "where"},
	ElectionName:   {"pgcoord.election.name", "election"},
	SemaphoreName:  {"pgcoord.semaphore.name", "semaphore"},
	ConnectionRole: {"pgcoord.connection.role", "role"},
	WaitState:      {"pgcoord.wait.state", "state"},
}

// An Instrument is one measurement, an index into Instruments.
type Instrument int

// The instruments. The event instruments come first, then the ones read
// from Stat.
const (
	LocksHeld Instrument = iota
	LockAcquires
	LockWait
	Contentions
	Releases
	Losses
	Leader
	LeaderTerm
	LeaderLosses
	PermitsHeld
	PermitAcquires
	PermitWait
	PermitLosses
	Connections
	Waits
	Handles
	DroppedEvents
	// NumInstruments is how many instruments there are.
	NumInstruments
)

// MaxLabels is the most labels an instrument has.
const MaxLabels = 3

// A Desc describes an instrument. Its label values are passed to a
// Recorder, and to ObserveStat's function, in the order of Labels.
type Desc struct {
	Kind   Kind
	OTel   string // OpenTelemetry instrument name
	Unit   string // OpenTelemetry unit: "s", or a {count} annotation
	Prom   string // Prometheus metric name
	Help   string // description, the same in both
	Labels []Label
}

// Instruments describes each Instrument.
var Instruments = [NumInstruments]Desc{
	LocksHeld: {UpDownCounter, "pgcoord.lock.held", "{lock}", "pgcoord_locks_held",
		"Locks held now: acquired minus released minus lost.", []Label{LockName}},
	LockAcquires: {Counter, "pgcoord.lock.acquires", "{acquire}", "pgcoord_lock_acquires_total",
		"Lock acquires that returned, by result.", []Label{LockName, LockMode, Result}},
	LockWait: {Histogram, "pgcoord.lock.wait.duration", "s", "pgcoord_lock_acquire_wait_seconds",
		"How long lock acquires took, from the call to its return, whatever the result.", []Label{LockName}},
	Contentions: {Counter, "pgcoord.lock.contentions", "{contention}", "pgcoord_lock_contentions_total",
		"Acquires that found their key held, in this process (local) or on the server.", []Label{LockName, LockMode, Location}},
	Releases: {Counter, "pgcoord.lock.releases", "{lock}", "pgcoord_lock_releases_total",
		"Locks released by Unlock or Close.", []Label{LockName}},
	Losses: {Counter, "pgcoord.lock.losses", "{lock}", "pgcoord_lock_losses_total",
		"Locks lost: connection failed, backend terminated or lease expired.", []Label{LockName}},

	Leader: {UpDownCounter, "pgcoord.leader", "{leadership}", "pgcoord_leader",
		"Leaderships of the election held: 1 while leading.", []Label{ElectionName}},
	LeaderTerm: {Gauge, "pgcoord.leader.term", "{term}", "pgcoord_leader_term",
		"Term of the last leadership of the election gained.", []Label{ElectionName}},
	LeaderLosses: {Counter, "pgcoord.leader.losses", "{leadership}", "pgcoord_leadership_losses_total",
		"Leaderships that ended by loss rather than resignation.", []Label{ElectionName}},

	PermitsHeld: {UpDownCounter, "pgcoord.permit.held", "{permit}", "pgcoord_permits_held",
		"Semaphore permits held now: acquired minus released minus lost.", []Label{SemaphoreName}},
	PermitAcquires: {Counter, "pgcoord.permit.acquires", "{acquire}", "pgcoord_permit_acquires_total",
		"Permit acquires that returned, by result.", []Label{SemaphoreName, Result}},
	PermitWait: {Histogram, "pgcoord.permit.wait.duration", "s", "pgcoord_permit_acquire_wait_seconds",
		"How long permit acquires took, from the call to its return, whatever the result.", []Label{SemaphoreName}},
	PermitLosses: {Counter, "pgcoord.permit.losses", "{permit}", "pgcoord_permit_losses_total",
		"Permits lost with their backend.", []Label{SemaphoreName}},

	Connections: {ObservedUpDown, "pgcoord.connection.count", "{connection}", "pgcoord_connections",
		"Connections of the watched Clients, by role: backend (shared, for their locks), session (NewSession), connecting.", []Label{ConnectionRole}},
	Waits: {ObservedUpDown, "pgcoord.lock.waits", "{acquire}", "pgcoord_lock_waits",
		"Blocking acquires of the watched Clients: waiting on the server, or queued (trying again until they can wait).", []Label{WaitState}},
	Handles: {ObservedUpDown, "pgcoord.lock.handles", "{lock}", "pgcoord_lock_handles",
		"Live Lock handles of the watched Clients, those of elections and semaphores included.", nil},
	DroppedEvents: {ObservedCounter, "pgcoord.hook.events.dropped", "{event}", "pgcoord_hook_events_dropped_total",
		"Events not delivered to the hooks because too many were pending.", nil},
}

// A Recorder records measurements on the instruments of one SDK. labels
// are the values of the instrument's Desc.Labels, in their order. Its
// methods may be called from several goroutines at once (the hooks of
// each Client run on a goroutine of their own).
type Recorder interface {
	// Add adds delta to a Counter or UpDownCounter.
	Add(in Instrument, delta int64, labels ...string)
	// Observe records a duration in seconds on a Histogram.
	Observe(in Instrument, seconds float64, labels ...string)
	// Set sets a Gauge.
	Set(in Instrument, value int64, labels ...string)
}

// A Mapper turns pgcoord's events into measurements, with bounded labels.
// Its methods are safe for concurrent use.
type Mapper struct {
	names, elections, semaphores *labeler

	mu sync.Mutex
	// terms holds the highest term recorded per election label (at most
	// maxNames names, Unnamed and Other): the events of several Clients
	// arrive on their own goroutines, so an older term's may come after a
	// newer one's, and elections past the bound share Other.
	terms map[string]pgcoord.Term
}

// New returns a Mapper that keeps at most maxNames (at least 1) distinct
// names of each of locks, elections and semaphores.
func New(maxNames int) *Mapper {
	return &Mapper{
		names:      newLabeler(maxNames),
		elections:  newLabeler(maxNames),
		semaphores: newLabeler(maxNames),
		terms:      make(map[string]pgcoord.Term),
	}
}

// Hooks returns the hooks that record pgcoord's events on r.
func (m *Mapper) Hooks(r Recorder) pgcoord.Hooks {
	return pgcoord.Hooks{
		OnAcquire: func(e pgcoord.AcquireEvent) {
			name := m.names.label(e.Name)
			r.Add(LockAcquires, 1, name, ModeOf(e.Mode), ResultOf(e.Err))
			r.Observe(LockWait, e.Wait.Seconds(), name)
			if e.Err == nil {
				r.Add(LocksHeld, 1, name)
			}
		},
		OnRelease: func(e pgcoord.ReleaseEvent) {
			name := m.names.label(e.Name)
			r.Add(Releases, 1, name)
			r.Add(LocksHeld, -1, name)
		},
		OnContention: func(e pgcoord.ContentionEvent) {
			where := "server"
			if e.Local {
				where = "local"
			}
			r.Add(Contentions, 1, m.names.label(e.Name), ModeOf(e.Mode), where)
		},
		OnLoss: func(e pgcoord.LossEvent) {
			name := m.names.label(e.Name)
			r.Add(Losses, 1, name)
			r.Add(LocksHeld, -1, name)
		},
		OnLeadership: func(e pgcoord.LeadershipEvent) {
			election := m.elections.label(e.Election)
			if e.Leading {
				r.Add(Leader, 1, election)
				m.recordTerm(r, election, e.Term)
				return
			}
			r.Add(Leader, -1, election)
			if e.Err != nil {
				r.Add(LeaderLosses, 1, election)
			}
		},
		OnPermit: func(e pgcoord.PermitEvent) {
			sem := m.semaphores.label(e.Semaphore)
			switch e.Kind {
			case pgcoord.PermitAcquired:
				r.Add(PermitAcquires, 1, sem, ResultOf(e.Err))
				r.Observe(PermitWait, e.Wait.Seconds(), sem)
				if e.Err == nil {
					r.Add(PermitsHeld, 1, sem)
				}
			case pgcoord.PermitReleased:
				r.Add(PermitsHeld, -1, sem)
			case pgcoord.PermitLost:
				r.Add(PermitsHeld, -1, sem)
				r.Add(PermitLosses, 1, sem)
			}
		},
	}
}

// recordTerm sets LeaderTerm of election to term if term is higher than
// any set before under that label. It sets it while holding m.mu, so that
// two Clients' events cannot set a lower term after a higher one.
func (m *Mapper) recordTerm(r Recorder, election string, term pgcoord.Term) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if t, ok := m.terms[election]; ok && t >= term {
		return
	}
	m.terms[election] = term
	r.Set(LeaderTerm, int64(term), election)
}

// TermLabels returns how many election labels m keeps a highest term for:
// at most maxNames, Unnamed and Other.
func (m *Mapper) TermLabels() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.terms)
}

// ObserveStat reports st, the sum of the watched Clients' Stat, as the
// measurements of the observed instruments, calling observe once for each
// with the instrument's label values.
func ObserveStat(st pgcoord.Stat, observe func(in Instrument, value int64, labels ...string)) {
	observe(Connections, int64(st.Backends), "backend")
	observe(Connections, int64(st.Sessions), "session")
	observe(Connections, int64(st.Connecting), "connecting")
	observe(Waits, int64(st.Waits), "server")
	observe(Waits, int64(st.QueuedWaits), "queued")
	observe(Handles, int64(st.Locks))
	observe(DroppedEvents, st.DroppedHookEvents)
}

// ResultOf returns the Result label of an acquire that returned err: "ok"
// for nil, else "locked", "no_permit", "deadlock", "timeout", "canceled",
// "closed" or "error".
func ResultOf(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, pgcoord.ErrLocked):
		return "locked"
	case errors.Is(err, pgcoord.ErrNoPermit):
		return "no_permit"
	case errors.Is(err, pgcoord.ErrDeadlock):
		return "deadlock"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, pgcoord.ErrClosed):
		return "closed"
	}
	return "error"
}

// ModeOf returns the LockMode label: "shared" for ModeShared, else
// "exclusive".
func ModeOf(m pgcoord.LockMode) string {
	if m == pgcoord.ModeShared {
		return "shared"
	}
	return "exclusive"
}

// Options are the settings that both contrib modules take, each through
// an Option of its own.
type Options struct {
	Buckets  []float64 // the bounds of the wait-time histograms' buckets, in seconds
	MaxNames int       // how many distinct names of each kind are kept
}

// SetBuckets sets o.Buckets to a copy of bounds. It returns an error,
// prefixed by pkg and saying what is wrong, unless bounds are at least
// one, finite, positive and strictly increasing.
func (o *Options) SetBuckets(pkg string, bounds []float64) error {
	if len(bounds) == 0 {
		return fmt.Errorf("%s: WithBuckets: no bounds given; pass at least one bound in seconds", pkg)
	}
	for i, b := range bounds {
		if b <= 0 || math.IsInf(b, 0) || math.IsNaN(b) {
			return fmt.Errorf("%s: WithBuckets: bound %v is not a finite positive number of seconds", pkg, b)
		}
		if i > 0 && b <= bounds[i-1] {
			return fmt.Errorf("%s: WithBuckets: bounds must increase, but %v follows %v", pkg, b, bounds[i-1])
		}
	}
	o.Buckets = append([]float64(nil), bounds...)
	return nil
}

// SetMaxNames sets o.MaxNames to n. It returns an error, prefixed by pkg,
// if n is less than 1.
func (o *Options) SetMaxNames(pkg string, n int) error {
	if n < 1 {
		return fmt.Errorf("%s: WithMaxNames(%d): the bound must be at least 1", pkg, n)
	}
	o.MaxNames = n
	return nil
}

// labeler maps names to label values: "" to Unnamed, the first max
// distinct names to themselves (made valid UTF-8: Prometheus refuses
// invalid UTF-8), the rest to Other. It keeps at most max names.
type labeler struct {
	mu   sync.Mutex
	max  int
	seen map[string]struct{}
}

func newLabeler(max int) *labeler { return &labeler{max: max, seen: make(map[string]struct{})} }

func (l *labeler) label(name string) string {
	if name == "" {
		return Unnamed
	}
	name = strings.ToValidUTF8(name, "\uFFFD")
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.seen[name]; ok {
		return name
	}
	if len(l.seen) >= l.max {
		return Other
	}
	l.seen[name] = struct{}{}
	return name
}
