// Package pgcoordprom publishes pgcoord's lock, election and semaphore
// events, and the connections of its Clients, as Prometheus metrics.
//
// A Client takes its hooks when it is built, so a [Collector] is made
// first, its hooks passed to the Client, and then the Client is watched for
// the metrics that come from [pgcoord.Client.Stat]:
//
//	m, err := pgcoordprom.New()
//	...
//	client, err := pgcoord.New(pool, m.Option(), pgcoord.WithKeyNames(names))
//	...
//	m.Watch(client)
//	prometheus.MustRegister(m)
//
// To keep hooks of your own, pass pgcoord.WithHooks(pgcoordprom.Chain(m.Hooks(), mine))
// instead of m.Option(). One Collector may serve several Clients: their
// events add up, and so do the Stat figures of the Clients it watches.
//
// # Metrics
//
// Lock events (a Client's Lock, TryLock, RLock, TryRLock, LockAll, Do and
// the same on its Sessions; not the locks that elections and semaphores
// take for themselves):
//
//	pgcoord_locks_held{name}                            gauge: locks held now (acquired − released − lost)
//	pgcoord_lock_acquires_total{name,mode,result}       counter: acquires that returned, by result
//	pgcoord_lock_acquire_wait_seconds{name}             histogram: how long each acquire took, whatever its result
//	pgcoord_lock_contentions_total{name,mode,where}     counter: acquires that found the key held, where="local"|"server"
//	pgcoord_lock_releases_total{name}                   counter: locks released (Unlock, Close)
//	pgcoord_lock_losses_total{name}                     counter: locks lost (connection failed, backend terminated, lease expired)
//
// Elections and semaphores:
//
//	pgcoord_leader{election}                            gauge: leaderships of the election held by the watched Clients (1 or 0)
//	pgcoord_leader_term{election}                       gauge: the term of the last leadership gained
//	pgcoord_leadership_losses_total{election}           counter: leaderships that ended by loss (not by resignation)
//	pgcoord_permits_held{semaphore}                     gauge: permits held now
//	pgcoord_permit_acquires_total{semaphore,result}     counter: permit acquires that returned, by result
//	pgcoord_permit_acquire_wait_seconds{semaphore}      histogram: how long each permit acquire took
//	pgcoord_permit_losses_total{semaphore}              counter: permits lost with their backend
//
// From the watched Clients' Stat, at each scrape:
//
//	pgcoord_connections{role}                           gauge: role="backend" (shared backends of the Clients' locks), "session" (NewSession), "connecting"
//	pgcoord_lock_waits{state}                           gauge: blocking acquires, state="server" (waiting on the server) or "queued" (trying again until they can wait)
//	pgcoord_lock_handles                                gauge: live Lock handles, those of elections and semaphores included
//	pgcoord_hook_events_dropped_total                   counter: events the hooks did not get because too many were pending
//
// result is "ok", "locked" (ErrLocked), "no_permit" (ErrNoPermit),
// "deadlock" (ErrDeadlock), "timeout" (context.DeadlineExceeded),
// "canceled" (context.Canceled), "closed" (ErrClosed) or "error"; mode is
// "exclusive" or "shared".
//
// # Labels
//
// pgcoord_leader sums the leaderships of the watched Clients: each
// Client's hooks run on a goroutine of its own, so during a handover
// between two watched Clients it may read 2 for a moment.
// pgcoord_leader_term keeps the highest term gained.
//
// Every label has a bounded set of values. A lock is labelled by the name
// that [pgcoord.WithKeyNames] gives its key (its first key, for LockAll),
// never by the key itself, which would make a time series per invoice or
// per user; a key without a name is labelled "unnamed". Election and
// semaphore names are labelled as they are. At most [WithMaxNames]
// distinct values of each of name, election and semaphore are kept (64 by
// default); later ones are labelled "other".
package pgcoordprom

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"weak"

	"github.com/pgcoord/pgcoord"
	"github.com/prometheus/client_golang/prometheus"
)

// Label values for names that have none, and for names beyond the bound.
const (
	Unnamed = "unnamed"
	Other   = "other"
)

// DefaultMaxNames is how many distinct values of each name label a
// Collector keeps unless WithMaxNames says otherwise.
const DefaultMaxNames = 64

// DefaultBuckets are the upper bounds, in seconds, of the wait-time
// histograms unless WithBuckets says otherwise: 0.5 ms to 32 s, ×4.
var DefaultBuckets = []float64{0.0005, 0.002, 0.008, 0.032, 0.128, 0.512, 2.048, 8.192, 32.768}

// An Option configures a [Collector].
type Option interface {
	apply(*config) error
}

type optionFunc func(*config) error

func (f optionFunc) apply(c *config) error { return f(c) }

type config struct {
	buckets  []float64
	maxNames int
}

// WithBuckets sets the upper bounds, in seconds, of the buckets of the
// wait-time histograms. They must be finite, positive and strictly
// increasing; at least one.
func WithBuckets(bounds ...float64) Option {
	return optionFunc(func(c *config) error {
		if len(bounds) == 0 {
			return errors.New("pgcoordprom: WithBuckets: no bounds given; pass at least one upper bound in seconds")
		}
		for i, b := range bounds {
			if b <= 0 || math.IsInf(b, 0) || math.IsNaN(b) {
				return fmt.Errorf("pgcoordprom: WithBuckets: bound %v is not a finite positive number of seconds", b)
			}
			if i > 0 && b <= bounds[i-1] {
				return fmt.Errorf("pgcoordprom: WithBuckets: bounds must increase, but %v follows %v", b, bounds[i-1])
			}
		}
		c.buckets = append([]float64(nil), bounds...)
		return nil
	})
}

// WithMaxNames bounds how many distinct values of each of the name,
// election and semaphore labels the Collector keeps (default
// DefaultMaxNames); events of later names are labelled "other". n must be
// at least 1.
func WithMaxNames(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 1 {
			return fmt.Errorf("pgcoordprom: WithMaxNames(%d): the bound must be at least 1", n)
		}
		c.maxNames = n
		return nil
	})
}

// A Collector is a [prometheus.Collector] of pgcoord's metrics (see the
// package documentation). Its hooks feed the event metrics; the Clients it
// watches feed the connection metrics at each scrape. Its methods are safe
// for concurrent use.
type Collector struct {
	names, elections, semaphores *labeler

	locksHeld    *prometheus.GaugeVec
	lockAcquires *prometheus.CounterVec
	lockWait     *prometheus.HistogramVec
	contentions  *prometheus.CounterVec
	releases     *prometheus.CounterVec
	losses       *prometheus.CounterVec

	leader       *prometheus.GaugeVec
	leaderTerm   *prometheus.GaugeVec
	leaderLosses *prometheus.CounterVec

	permitsHeld    *prometheus.GaugeVec
	permitAcquires *prometheus.CounterVec
	permitWait     *prometheus.HistogramVec
	permitLosses   *prometheus.CounterVec

	connectionsDesc, waitsDesc, handlesDesc, droppedDesc *prometheus.Desc

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
func (c *Collector) newerTerm(election string, term int64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.terms == nil {
		c.terms = make(map[string]int64)
	}
	if t, ok := c.terms[election]; ok && t >= term {
		return false
	}
	c.terms[election] = term
	return true
}

// New returns a Collector. It returns an error, saying which, when an
// option is invalid.
func New(opts ...Option) (*Collector, error) {
	cfg := config{buckets: DefaultBuckets, maxNames: DefaultMaxNames}
	for _, o := range opts {
		if o == nil {
			return nil, errors.New("pgcoordprom: New: nil Option")
		}
		if err := o.apply(&cfg); err != nil {
			return nil, err
		}
	}
	gauge := func(name, help string, labels ...string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, labels)
	}
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels)
	}
	histogram := func(name, help string, labels ...string) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: cfg.buckets}, labels)
	}
	return &Collector{
		names:      newLabeler(cfg.maxNames),
		elections:  newLabeler(cfg.maxNames),
		semaphores: newLabeler(cfg.maxNames),

		locksHeld:    gauge("pgcoord_locks_held", "Locks held now: acquired minus released minus lost.", "name"),
		lockAcquires: counter("pgcoord_lock_acquires_total", "Lock acquires that returned, by result.", "name", "mode", "result"),
		lockWait:     histogram("pgcoord_lock_acquire_wait_seconds", "How long lock acquires took, from the call to its return, whatever the result.", "name"),
		contentions:  counter("pgcoord_lock_contentions_total", "Acquires that found their key held, in this process (local) or on the server.", "name", "mode", "where"),
		releases:     counter("pgcoord_lock_releases_total", "Locks released by Unlock or Close.", "name"),
		losses:       counter("pgcoord_lock_losses_total", "Locks lost: connection failed, backend terminated or lease expired.", "name"),

		leader:       gauge("pgcoord_leader", "Leaderships of the election held by the watched Clients: 1 while leading.", "election"),
		leaderTerm:   gauge("pgcoord_leader_term", "Term of the last leadership of the election gained.", "election"),
		leaderLosses: counter("pgcoord_leadership_losses_total", "Leaderships that ended by loss rather than resignation.", "election"),

		permitsHeld:    gauge("pgcoord_permits_held", "Semaphore permits held now: acquired minus released minus lost.", "semaphore"),
		permitAcquires: counter("pgcoord_permit_acquires_total", "Permit acquires that returned, by result.", "semaphore", "result"),
		permitWait:     histogram("pgcoord_permit_acquire_wait_seconds", "How long permit acquires took, from the call to its return, whatever the result.", "semaphore"),
		permitLosses:   counter("pgcoord_permit_losses_total", "Permits lost with their backend.", "semaphore"),

		connectionsDesc: prometheus.NewDesc("pgcoord_connections", "Connections of the watched Clients, by role: backend (shared, for their locks), session (NewSession), connecting.", []string{"role"}, nil),
		waitsDesc:       prometheus.NewDesc("pgcoord_lock_waits", "Blocking acquires of the watched Clients: waiting on the server, or queued (trying again until they can wait).", []string{"state"}, nil),
		handlesDesc:     prometheus.NewDesc("pgcoord_lock_handles", "Live Lock handles of the watched Clients, those of elections and semaphores included.", nil, nil),
		droppedDesc:     prometheus.NewDesc("pgcoord_hook_events_dropped_total", "Events not delivered to the hooks because too many were pending.", nil, nil),
	}, nil
}

// Option returns pgcoord.WithHooks(c.Hooks()), for [pgcoord.New] or
// [pgcoord.Open]. It replaces hooks set before it; see [Chain] to keep
// them.
func (c *Collector) Option() pgcoord.Option { return pgcoord.WithHooks(c.Hooks()) }

// Hooks returns the hooks that feed c's event metrics. Pass them to one or
// more Clients with [pgcoord.WithHooks], alone or through [Chain].
func (c *Collector) Hooks() pgcoord.Hooks {
	return pgcoord.Hooks{
		OnAcquire: func(e pgcoord.AcquireEvent) {
			name := c.names.label(e.Name)
			c.lockAcquires.WithLabelValues(name, modeLabel(e.Mode), Result(e.Err)).Inc()
			c.lockWait.WithLabelValues(name).Observe(e.Wait.Seconds())
			if e.Err == nil {
				c.locksHeld.WithLabelValues(name).Inc()
			}
		},
		OnRelease: func(e pgcoord.ReleaseEvent) {
			name := c.names.label(e.Name)
			c.releases.WithLabelValues(name).Inc()
			c.locksHeld.WithLabelValues(name).Dec()
		},
		OnContention: func(e pgcoord.ContentionEvent) {
			where := "server"
			if e.Local {
				where = "local"
			}
			c.contentions.WithLabelValues(c.names.label(e.Name), modeLabel(e.Mode), where).Inc()
		},
		OnLoss: func(e pgcoord.LossEvent) {
			name := c.names.label(e.Name)
			c.losses.WithLabelValues(name).Inc()
			c.locksHeld.WithLabelValues(name).Dec()
		},
		OnLeadership: func(e pgcoord.LeadershipEvent) {
			election := c.elections.label(e.Election)
			if e.Leading {
				c.leader.WithLabelValues(election).Inc()
				if c.newerTerm(election, int64(e.Term)) {
					c.leaderTerm.WithLabelValues(election).Set(float64(e.Term))
				}
				return
			}
			c.leader.WithLabelValues(election).Dec()
			if e.Err != nil {
				c.leaderLosses.WithLabelValues(election).Inc()
			}
		},
		OnPermit: func(e pgcoord.PermitEvent) {
			sem := c.semaphores.label(e.Semaphore)
			switch e.Kind {
			case pgcoord.PermitAcquired:
				c.permitAcquires.WithLabelValues(sem, Result(e.Err)).Inc()
				c.permitWait.WithLabelValues(sem).Observe(e.Wait.Seconds())
				if e.Err == nil {
					c.permitsHeld.WithLabelValues(sem).Inc()
				}
			case pgcoord.PermitReleased:
				c.permitsHeld.WithLabelValues(sem).Dec()
			case pgcoord.PermitLost:
				c.permitsHeld.WithLabelValues(sem).Dec()
				c.permitLosses.WithLabelValues(sem).Inc()
			}
		},
	}
}

// Watch adds client to the Clients whose Stat c reports at each scrape.
// Watching a Client twice counts it once. Call Unwatch to stop, for
// example before dropping a closed Client.
func (c *Collector) Watch(client *pgcoord.Client) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, w := range c.clients {
		if w == client {
			return
		}
	}
	c.clients = append(c.clients, client)
}

// Unwatch removes client from the watched Clients. Its dropped hook
// events stay counted in pgcoord_hook_events_dropped_total.
func (c *Collector) Unwatch(client *pgcoord.Client) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, w := range c.clients {
		if w == client {
			d := client.Stat().DroppedHookEvents
			if c.folded == nil {
				c.folded = make(map[weak.Pointer[pgcoord.Client]]int64)
			}
			wp := weak.Make(client)
			c.dropped += d - c.folded[wp]
			c.folded[wp] = d
			c.clients = append(c.clients[:i:i], c.clients[i+1:]...)
			return
		}
	}
}

func (c *Collector) vectors() []prometheus.Collector {
	return []prometheus.Collector{
		c.locksHeld, c.lockAcquires, c.lockWait, c.contentions, c.releases, c.losses,
		c.leader, c.leaderTerm, c.leaderLosses,
		c.permitsHeld, c.permitAcquires, c.permitWait, c.permitLosses,
	}
}

// Describe sends the descriptions of every metric of c; it implements
// [prometheus.Collector].
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, v := range c.vectors() {
		v.Describe(ch)
	}
	ch <- c.connectionsDesc
	ch <- c.waitsDesc
	ch <- c.handlesDesc
	ch <- c.droppedDesc
}

// Collect sends the current value of every metric of c, reading the Stat
// of each watched Client; it implements [prometheus.Collector].
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	for _, v := range c.vectors() {
		v.Collect(ch)
	}
	c.mu.Lock()
	var sum pgcoord.Stat
	sum.DroppedHookEvents = c.dropped
	for _, client := range c.clients {
		st := client.Stat()
		st.DroppedHookEvents -= c.folded[weak.Make(client)]
		sum.Backends += st.Backends
		sum.Sessions += st.Sessions
		sum.Connecting += st.Connecting
		sum.Waits += st.Waits
		sum.QueuedWaits += st.QueuedWaits
		sum.Locks += st.Locks
		sum.DroppedHookEvents += st.DroppedHookEvents
	}
	c.mu.Unlock()
	gauge := func(d *prometheus.Desc, v int, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), labels...)
	}
	gauge(c.connectionsDesc, sum.Backends, "backend")
	gauge(c.connectionsDesc, sum.Sessions, "session")
	gauge(c.connectionsDesc, sum.Connecting, "connecting")
	gauge(c.waitsDesc, sum.Waits, "server")
	gauge(c.waitsDesc, sum.QueuedWaits, "queued")
	gauge(c.handlesDesc, sum.Locks)
	ch <- prometheus.MustNewConstMetric(c.droppedDesc, prometheus.CounterValue, float64(sum.DroppedHookEvents))
}

// Result returns the result label of an acquire that returned err: "ok"
// for nil, else "locked", "no_permit", "deadlock", "timeout",
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

// labeler maps names to label values: "" to Unnamed, the first max
// distinct names to themselves, the rest to Other.
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
	name = strings.ToValidUTF8(name, "\uFFFD") // Prometheus refuses invalid UTF-8
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
