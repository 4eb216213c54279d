// Package pgcoordotel records pgcoord's lock, election and semaphore
// events, and the connections of its Clients, as OpenTelemetry metrics.
//
// A Client takes its hooks when it is built, so [Metrics] are made first,
// their hooks passed to the Client, and then the Client is watched for the
// instruments that come from [pgcoord.Client.Stat]:
//
//	m, err := pgcoordotel.New(pgcoordotel.WithMeterProvider(provider))
//	...
//	client, err := pgcoord.New(pool, m.Option(), pgcoord.WithKeyNames(names))
//	...
//	m.Watch(client)
//
// To keep hooks of your own, pass pgcoord.WithHooks(pgcoordotel.Chain(m.Hooks(), mine))
// instead of m.Option(). One Metrics may serve several Clients: their
// events add up, and so do the Stat figures of the Clients it watches.
//
// # Instruments
//
// Lock events (a Client's Lock, TryLock, RLock, TryRLock, LockAll, Do and
// the same on its Sessions; not the locks that elections and semaphores
// take for themselves):
//
//	pgcoord.lock.held           Int64UpDownCounter {lock}     locks held now; pgcoord.lock.name
//	pgcoord.lock.acquires       Int64Counter {acquire}        acquires that returned; pgcoord.lock.name, pgcoord.lock.mode, pgcoord.result
//	pgcoord.lock.wait.duration  Float64Histogram s            how long each acquire took, whatever its result; pgcoord.lock.name
//	pgcoord.lock.contentions    Int64Counter {contention}     acquires that found the key held; pgcoord.lock.name, pgcoord.lock.mode, pgcoord.contention.location (local, server)
//	pgcoord.lock.releases       Int64Counter {lock}           locks released (Unlock, Close); pgcoord.lock.name
//	pgcoord.lock.losses         Int64Counter {lock}           locks lost; pgcoord.lock.name
//
// Elections and semaphores:
//
//	pgcoord.leader              Int64UpDownCounter {leadership}  leaderships held (1 while leading); pgcoord.election.name
//	pgcoord.leader.term         Int64Gauge {term}             the term of the last leadership gained; pgcoord.election.name
//	pgcoord.leader.losses       Int64Counter {leadership}     leaderships that ended by loss; pgcoord.election.name
//	pgcoord.permit.held         Int64UpDownCounter {permit}   permits held now; pgcoord.semaphore.name
//	pgcoord.permit.acquires     Int64Counter {acquire}        permit acquires that returned; pgcoord.semaphore.name, pgcoord.result
//	pgcoord.permit.wait.duration Float64Histogram s           how long each permit acquire took; pgcoord.semaphore.name
//	pgcoord.permit.losses       Int64Counter {permit}         permits lost with their backend; pgcoord.semaphore.name
//
// Observed from the watched Clients' Stat at each collection:
//
//	pgcoord.connection.count    Int64ObservableUpDownCounter {connection}  pgcoord.connection.role: backend, session, connecting
//	pgcoord.lock.waits          Int64ObservableUpDownCounter {acquire}     blocking acquires; pgcoord.wait.state: server, queued
//	pgcoord.lock.handles        Int64ObservableUpDownCounter {lock}        live Lock handles, those of elections and semaphores included
//	pgcoord.hook.events.dropped Int64ObservableCounter {event}             events the hooks did not get because too many were pending
//
// pgcoord.result is "ok", "locked", "no_permit", "deadlock", "timeout",
// "canceled", "closed" or "error" (see [Result]); pgcoord.lock.mode is
// "exclusive" or "shared".
//
// pgcoord.leader sums the leaderships of the watched Clients: each
// Client's hooks run on a goroutine of its own, so during a handover
// between two watched Clients it may read 2 for a moment.
// pgcoord.leader.term records only terms higher than any recorded before.
//
// # Attributes
//
// Every attribute has a bounded set of values. A lock is described by
// the name that [pgcoord.WithKeyNames] gives its key (its first key, for
// LockAll), never by the key itself; a key without a name is "unnamed".
// Election and semaphore names are used as they are. At most
// [WithMaxNames] distinct values of each of the three names are kept (64
// by default); later ones become "other".
package pgcoordotel

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"weak"

	"github.com/pgcoord/pgcoord"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// ScopeName is the instrumentation scope of the Meter that Metrics use.
const ScopeName = "github.com/pgcoord/pgcoord/contrib/otel"

// Attribute values for names that have none, and for names beyond the
// bound.
const (
	Unnamed = "unnamed"
	Other   = "other"
)

// DefaultMaxNames is how many distinct values of each name attribute
// Metrics keep unless WithMaxNames says otherwise.
const DefaultMaxNames = 64

// DefaultBuckets are the explicit bucket boundaries, in seconds, advised
// for the wait-time histograms unless WithBuckets says otherwise: 0.5 ms
// to 32 s, ×4.
var DefaultBuckets = []float64{0.0005, 0.002, 0.008, 0.032, 0.128, 0.512, 2.048, 8.192, 32.768}

// An Option configures [Metrics].
type Option interface {
	apply(*config) error
}

type optionFunc func(*config) error

func (f optionFunc) apply(c *config) error { return f(c) }

type config struct {
	provider metric.MeterProvider
	buckets  []float64
	maxNames int
}

// WithMeterProvider sets the MeterProvider whose Meter creates the
// instruments (default: otel.GetMeterProvider(), the global one). It must
// not be nil.
func WithMeterProvider(p metric.MeterProvider) Option {
	return optionFunc(func(c *config) error {
		if p == nil {
			return errors.New("pgcoordotel: WithMeterProvider: the provider is nil")
		}
		c.provider = p
		return nil
	})
}

// WithBuckets sets the bucket boundaries, in seconds, advised for the
// wait-time histograms (a View of the SDK may still override them). They
// must be finite, positive and strictly increasing; at least one.
func WithBuckets(bounds ...float64) Option {
	return optionFunc(func(c *config) error {
		if len(bounds) == 0 {
			return errors.New("pgcoordotel: WithBuckets: no bounds given; pass at least one boundary in seconds")
		}
		for i, b := range bounds {
			if b <= 0 || math.IsInf(b, 0) || math.IsNaN(b) {
				return fmt.Errorf("pgcoordotel: WithBuckets: bound %v is not a finite positive number of seconds", b)
			}
			if i > 0 && b <= bounds[i-1] {
				return fmt.Errorf("pgcoordotel: WithBuckets: bounds must increase, but %v follows %v", b, bounds[i-1])
			}
		}
		c.buckets = append([]float64(nil), bounds...)
		return nil
	})
}

// WithMaxNames bounds how many distinct values of each of the lock,
// election and semaphore name attributes Metrics keep (default
// DefaultMaxNames); events of later names get "other". n must be at least
// 1.
func WithMaxNames(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 1 {
			return fmt.Errorf("pgcoordotel: WithMaxNames(%d): the bound must be at least 1", n)
		}
		c.maxNames = n
		return nil
	})
}

// Metrics hold pgcoord's OpenTelemetry instruments (see the package
// documentation). Their hooks feed the event instruments; the Clients they
// watch feed the observable ones at each collection. Their methods are
// safe for concurrent use.
type Metrics struct {
	names, elections, semaphores *labeler

	locksHeld    metric.Int64UpDownCounter
	lockAcquires metric.Int64Counter
	lockWait     metric.Float64Histogram
	contentions  metric.Int64Counter
	releases     metric.Int64Counter
	losses       metric.Int64Counter

	leader       metric.Int64UpDownCounter
	leaderTerm   metric.Int64Gauge
	leaderLosses metric.Int64Counter

	permitsHeld    metric.Int64UpDownCounter
	permitAcquires metric.Int64Counter
	permitWait     metric.Float64Histogram
	permitLosses   metric.Int64Counter

	registration metric.Registration

	mu      sync.Mutex
	clients []*pgcoord.Client
	dropped int64 // dropped hook events of Clients no longer watched
	// folded holds, for each Client unwatched once, its dropped hook
	// events already added to dropped, so that watching it again counts
	// only what it drops after that. Weak: a Client dropped by its user
	// is not kept alive for this.
	folded map[weak.Pointer[pgcoord.Client]]int64
	// terms holds the highest term gained per election label: the events
	// of several Clients arrive on their own goroutines, so an older
	// term's may come after a newer one's.
	terms map[string]int64
}

// newerTerm records term for election and reports whether it is the
// highest seen.
func (m *Metrics) newerTerm(election string, term int64) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.terms == nil {
		m.terms = make(map[string]int64)
	}
	if t, ok := m.terms[election]; ok && t >= term {
		return false
	}
	m.terms[election] = term
	return true
}

// New creates the instruments on a Meter of the configured MeterProvider
// and registers the callback of the observable ones. It returns an error
// when an option is invalid or the Meter refuses an instrument.
func New(opts ...Option) (*Metrics, error) {
	cfg := config{buckets: DefaultBuckets, maxNames: DefaultMaxNames}
	for _, o := range opts {
		if o == nil {
			return nil, errors.New("pgcoordotel: New: nil Option")
		}
		if err := o.apply(&cfg); err != nil {
			return nil, err
		}
	}
	if cfg.provider == nil {
		cfg.provider = otel.GetMeterProvider()
	}
	meter := cfg.provider.Meter(ScopeName)
	m := &Metrics{names: newLabeler(cfg.maxNames), elections: newLabeler(cfg.maxNames), semaphores: newLabeler(cfg.maxNames)}
	var errs []error
	counter := func(name, unit, desc string) metric.Int64Counter {
		c, err := meter.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		return c
	}
	upDown := func(name, unit, desc string) metric.Int64UpDownCounter {
		c, err := meter.Int64UpDownCounter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		return c
	}
	histogram := func(name, desc string) metric.Float64Histogram {
		h, err := meter.Float64Histogram(name, metric.WithUnit("s"), metric.WithDescription(desc),
			metric.WithExplicitBucketBoundaries(cfg.buckets...))
		errs = append(errs, err)
		return h
	}
	m.locksHeld = upDown("pgcoord.lock.held", "{lock}", "Locks held now: acquired minus released minus lost.")
	m.lockAcquires = counter("pgcoord.lock.acquires", "{acquire}", "Lock acquires that returned, by result.")
	m.lockWait = histogram("pgcoord.lock.wait.duration", "How long lock acquires took, from the call to its return, whatever the result.")
	m.contentions = counter("pgcoord.lock.contentions", "{contention}", "Acquires that found their key held, in this process (local) or on the server.")
	m.releases = counter("pgcoord.lock.releases", "{lock}", "Locks released by Unlock or Close.")
	m.losses = counter("pgcoord.lock.losses", "{lock}", "Locks lost: connection failed, backend terminated or lease expired.")
	m.leader = upDown("pgcoord.leader", "{leadership}", "Leaderships of the election held: 1 while leading.")
	var err error
	m.leaderTerm, err = meter.Int64Gauge("pgcoord.leader.term", metric.WithUnit("{term}"), metric.WithDescription("Term of the last leadership of the election gained."))
	errs = append(errs, err)
	m.leaderLosses = counter("pgcoord.leader.losses", "{leadership}", "Leaderships that ended by loss rather than resignation.")
	m.permitsHeld = upDown("pgcoord.permit.held", "{permit}", "Semaphore permits held now: acquired minus released minus lost.")
	m.permitAcquires = counter("pgcoord.permit.acquires", "{acquire}", "Permit acquires that returned, by result.")
	m.permitWait = histogram("pgcoord.permit.wait.duration", "How long permit acquires took, from the call to its return, whatever the result.")
	m.permitLosses = counter("pgcoord.permit.losses", "{permit}", "Permits lost with their backend.")

	connections, err := meter.Int64ObservableUpDownCounter("pgcoord.connection.count", metric.WithUnit("{connection}"),
		metric.WithDescription("Connections of the watched Clients, by role: backend (shared, for their locks), session (NewSession), connecting."))
	errs = append(errs, err)
	waits, err := meter.Int64ObservableUpDownCounter("pgcoord.lock.waits", metric.WithUnit("{acquire}"),
		metric.WithDescription("Blocking acquires of the watched Clients: waiting on the server, or queued (trying again until they can wait)."))
	errs = append(errs, err)
	handles, err := meter.Int64ObservableUpDownCounter("pgcoord.lock.handles", metric.WithUnit("{lock}"),
		metric.WithDescription("Live Lock handles of the watched Clients, those of elections and semaphores included."))
	errs = append(errs, err)
	dropped, err := meter.Int64ObservableCounter("pgcoord.hook.events.dropped", metric.WithUnit("{event}"),
		metric.WithDescription("Events not delivered to the hooks because too many were pending."))
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("pgcoordotel: New: %w", err)
	}
	var (
		backend    = metric.WithAttributes(attribute.String("pgcoord.connection.role", "backend"))
		session    = metric.WithAttributes(attribute.String("pgcoord.connection.role", "session"))
		connecting = metric.WithAttributes(attribute.String("pgcoord.connection.role", "connecting"))
		server     = metric.WithAttributes(attribute.String("pgcoord.wait.state", "server"))
		queued     = metric.WithAttributes(attribute.String("pgcoord.wait.state", "queued"))
	)
	m.registration, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		st := m.stat()
		o.ObserveInt64(connections, int64(st.Backends), backend)
		o.ObserveInt64(connections, int64(st.Sessions), session)
		o.ObserveInt64(connections, int64(st.Connecting), connecting)
		o.ObserveInt64(waits, int64(st.Waits), server)
		o.ObserveInt64(waits, int64(st.QueuedWaits), queued)
		o.ObserveInt64(handles, int64(st.Locks))
		o.ObserveInt64(dropped, st.DroppedHookEvents)
		return nil
	}, connections, waits, handles, dropped)
	if err != nil {
		return nil, fmt.Errorf("pgcoordotel: New: register the callback of the observable instruments: %w", err)
	}
	return m, nil
}

// Close unregisters the callback of the observable instruments: the
// watched Clients' Stat is no longer read. The event instruments keep
// working. It returns the Meter's error, if any.
func (m *Metrics) Close() error { return m.registration.Unregister() }

// Option returns pgcoord.WithHooks(m.Hooks()), for [pgcoord.New] or
// [pgcoord.Open]. It replaces hooks set before it; see [Chain] to keep
// them.
func (m *Metrics) Option() pgcoord.Option { return pgcoord.WithHooks(m.Hooks()) }

// Hooks returns the hooks that feed m's event instruments. Pass them to
// one or more Clients with [pgcoord.WithHooks], alone or through [Chain].
// They record with context.Background(): pgcoord's events carry no
// context.
func (m *Metrics) Hooks() pgcoord.Hooks {
	ctx := context.Background()
	lockName := func(name string) attribute.KeyValue {
		return attribute.String("pgcoord.lock.name", m.names.label(name))
	}
	mode := func(mo pgcoord.LockMode) attribute.KeyValue {
		return attribute.String("pgcoord.lock.mode", modeLabel(mo))
	}
	result := func(err error) attribute.KeyValue { return attribute.String("pgcoord.result", Result(err)) }
	return pgcoord.Hooks{
		OnAcquire: func(e pgcoord.AcquireEvent) {
			name := lockName(e.Name)
			m.lockAcquires.Add(ctx, 1, metric.WithAttributes(name, mode(e.Mode), result(e.Err)))
			m.lockWait.Record(ctx, e.Wait.Seconds(), metric.WithAttributes(name))
			if e.Err == nil {
				m.locksHeld.Add(ctx, 1, metric.WithAttributes(name))
			}
		},
		OnRelease: func(e pgcoord.ReleaseEvent) {
			name := metric.WithAttributes(lockName(e.Name))
			m.releases.Add(ctx, 1, name)
			m.locksHeld.Add(ctx, -1, name)
		},
		OnContention: func(e pgcoord.ContentionEvent) {
			where := "server"
			if e.Local {
				where = "local"
			}
			m.contentions.Add(ctx, 1, metric.WithAttributes(lockName(e.Name), mode(e.Mode),
				attribute.String("pgcoord.contention.location", where)))
		},
		OnLoss: func(e pgcoord.LossEvent) {
			name := metric.WithAttributes(lockName(e.Name))
			m.losses.Add(ctx, 1, name)
			m.locksHeld.Add(ctx, -1, name)
		},
		OnLeadership: func(e pgcoord.LeadershipEvent) {
			election := metric.WithAttributes(attribute.String("pgcoord.election.name", m.elections.label(e.Election)))
			if e.Leading {
				m.leader.Add(ctx, 1, election)
				if m.newerTerm(e.Election, int64(e.Term)) {
					m.leaderTerm.Record(ctx, int64(e.Term), election)
				}
				return
			}
			m.leader.Add(ctx, -1, election)
			if e.Err != nil {
				m.leaderLosses.Add(ctx, 1, election)
			}
		},
		OnPermit: func(e pgcoord.PermitEvent) {
			sem := attribute.String("pgcoord.semaphore.name", m.semaphores.label(e.Semaphore))
			switch e.Kind {
			case pgcoord.PermitAcquired:
				m.permitAcquires.Add(ctx, 1, metric.WithAttributes(sem, result(e.Err)))
				m.permitWait.Record(ctx, e.Wait.Seconds(), metric.WithAttributes(sem))
				if e.Err == nil {
					m.permitsHeld.Add(ctx, 1, metric.WithAttributes(sem))
				}
			case pgcoord.PermitReleased:
				m.permitsHeld.Add(ctx, -1, metric.WithAttributes(sem))
			case pgcoord.PermitLost:
				m.permitsHeld.Add(ctx, -1, metric.WithAttributes(sem))
				m.permitLosses.Add(ctx, 1, metric.WithAttributes(sem))
			}
		},
	}
}

// Watch adds client to the Clients whose Stat m observes at each
// collection. Watching a Client twice counts it once. Call Unwatch to
// stop, for example before dropping a closed Client.
func (m *Metrics) Watch(client *pgcoord.Client) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, w := range m.clients {
		if w == client {
			return
		}
	}
	m.clients = append(m.clients, client)
}

// Unwatch removes client from the watched Clients. Its dropped hook
// events stay counted in pgcoord.hook.events.dropped.
func (m *Metrics) Unwatch(client *pgcoord.Client) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for i, w := range m.clients {
		if w == client {
			d := client.Stat().DroppedHookEvents
			if m.folded == nil {
				m.folded = make(map[weak.Pointer[pgcoord.Client]]int64)
			}
			wp := weak.Make(client)
			m.dropped += d - m.folded[wp]
			m.folded[wp] = d
			m.clients = append(m.clients[:i:i], m.clients[i+1:]...)
			return
		}
	}
}

// stat sums the Stat of the watched Clients.
func (m *Metrics) stat() pgcoord.Stat {
	m.mu.Lock()
	defer m.mu.Unlock()
	sum := pgcoord.Stat{DroppedHookEvents: m.dropped}
	for _, c := range m.clients {
		st := c.Stat()
		st.DroppedHookEvents -= m.folded[weak.Make(c)]
		sum.Backends += st.Backends
		sum.Sessions += st.Sessions
		sum.Connecting += st.Connecting
		sum.Waits += st.Waits
		sum.QueuedWaits += st.QueuedWaits
		sum.Locks += st.Locks
		sum.DroppedHookEvents += st.DroppedHookEvents
	}
	return sum
}

// Result returns the pgcoord.result attribute of an acquire that returned
// err: "ok" for nil, else "locked", "no_permit", "deadlock", "timeout",
// "canceled", "closed" or "error".
func Result(err error) string {
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

// modeLabel returns "shared" for ModeShared, else "exclusive".
func modeLabel(m pgcoord.LockMode) string {
	if m == pgcoord.ModeShared {
		return "shared"
	}
	return "exclusive"
}

// labeler maps names to attribute values: "" to Unnamed, the first max
// distinct names to themselves (made valid UTF-8), the rest to Other.
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
