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
// pgcoord_leader_term keeps the highest term gained under its label:
// elections past WithMaxNames share "other", which shows the highest term
// any of them gained.
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
	"errors"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/contrib/internal/metricmap"
	"github.com/prometheus/client_golang/prometheus"
)

// Label values for names that have none ("unnamed"), and for names beyond
// the bound ("other").
const (
	Unnamed = metricmap.Unnamed
	Other   = metricmap.Other
)

// DefaultMaxNames is how many distinct values of each name label a
// Collector keeps unless WithMaxNames says otherwise: 64.
const DefaultMaxNames = metricmap.DefaultMaxNames

// DefaultBuckets are the upper bounds, in seconds, of the wait-time
// histograms unless WithBuckets says otherwise: 0.5 ms to 32 s, ×4
// (0.0005, 0.002, 0.008, 0.032, 0.128, 0.512, 2.048, 8.192, 32.768).
var DefaultBuckets = metricmap.DefaultBuckets()

// An Option configures a [Collector].
type Option interface {
	apply(*config) error
}

type optionFunc func(*config) error

func (f optionFunc) apply(c *config) error { return f(c) }

type config struct {
	metricmap.Options
}

// WithBuckets sets the upper bounds, in seconds, of the buckets of the
// wait-time histograms. They must be finite, positive and strictly
// increasing; at least one.
func WithBuckets(bounds ...float64) Option {
	return optionFunc(func(c *config) error { return c.SetBuckets("pgcoordprom", bounds) })
}

// WithMaxNames bounds how many distinct values of each of the name,
// election and semaphore labels the Collector keeps (default
// DefaultMaxNames); events of later names are labelled "other". n must be
// at least 1.
func WithMaxNames(n int) Option {
	return optionFunc(func(c *config) error { return c.SetMaxNames("pgcoordprom", n) })
}

// A Collector is a [prometheus.Collector] of pgcoord's metrics (see the
// package documentation). Its hooks feed the event metrics; the Clients it
// watches feed the connection metrics at each scrape. Its methods are safe
// for concurrent use.
type Collector struct {
	mapper  *metricmap.Mapper
	watched metricmap.Watched

	// vectors holds the vector of each event instrument of
	// metricmap.Instruments (a *prometheus.CounterVec, GaugeVec or
	// HistogramVec), descs the description of each observed one.
	vectors [metricmap.NumInstruments]prometheus.Collector
	descs   [metricmap.NumInstruments]*prometheus.Desc
}

// New returns a Collector. It returns an error, saying which, when an
// option is invalid.
func New(opts ...Option) (*Collector, error) {
	cfg := config{Options: metricmap.Options{Buckets: DefaultBuckets, MaxNames: DefaultMaxNames}}
	for _, o := range opts {
		if o == nil {
			return nil, errors.New("pgcoordprom: New: nil Option")
		}
		if err := o.apply(&cfg); err != nil {
			return nil, err
		}
	}
	c := &Collector{mapper: metricmap.New(cfg.MaxNames)}
	for in, d := range metricmap.Instruments {
		var labels []string
		for _, l := range d.Labels {
			labels = append(labels, metricmap.LabelKeys[l].Prom)
		}
		switch d.Kind {
		case metricmap.Counter:
			c.vectors[in] = prometheus.NewCounterVec(prometheus.CounterOpts{Name: d.Prom, Help: d.Help}, labels)
		case metricmap.UpDownCounter, metricmap.Gauge:
			c.vectors[in] = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: d.Prom, Help: d.Help}, labels)
		case metricmap.Histogram:
			c.vectors[in] = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: d.Prom, Help: d.Help, Buckets: cfg.Buckets}, labels)
		case metricmap.ObservedUpDown, metricmap.ObservedCounter:
			c.descs[in] = prometheus.NewDesc(d.Prom, d.Help, labels, nil)
		}
	}
	return c, nil
}

// recorder records the measurements of c's hooks.
type recorder struct{ c *Collector }

func (r recorder) Add(in metricmap.Instrument, delta int64, labels ...string) {
	switch v := r.c.vectors[in].(type) {
	case *prometheus.CounterVec:
		v.WithLabelValues(labels...).Add(float64(delta))
	case *prometheus.GaugeVec:
		v.WithLabelValues(labels...).Add(float64(delta))
	}
}

func (r recorder) Observe(in metricmap.Instrument, seconds float64, labels ...string) {
	r.c.vectors[in].(*prometheus.HistogramVec).WithLabelValues(labels...).Observe(seconds)
}

func (r recorder) Set(in metricmap.Instrument, value int64, labels ...string) {
	r.c.vectors[in].(*prometheus.GaugeVec).WithLabelValues(labels...).Set(float64(value))
}

// Option returns pgcoord.WithHooks(c.Hooks()), for [pgcoord.New] or
// [pgcoord.Open]. It replaces hooks set before it; see [Chain] to keep
// them.
func (c *Collector) Option() pgcoord.Option { return pgcoord.WithHooks(c.Hooks()) }

// Hooks returns the hooks that feed c's event metrics. Pass them to one or
// more Clients with [pgcoord.WithHooks], alone or through [Chain].
func (c *Collector) Hooks() pgcoord.Hooks { return c.mapper.Hooks(recorder{c}) }

// Watch adds client to the Clients whose Stat c reports at each scrape.
// Watching a Client twice counts it once. Call Unwatch to stop, for
// example before dropping a closed Client.
func (c *Collector) Watch(client *pgcoord.Client) { c.watched.Watch(client) }

// Unwatch removes client from the watched Clients. Its dropped hook
// events stay counted in pgcoord_hook_events_dropped_total.
func (c *Collector) Unwatch(client *pgcoord.Client) { c.watched.Unwatch(client) }

// Describe sends the descriptions of every metric of c; it implements
// [prometheus.Collector].
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for in := range metricmap.NumInstruments {
		if v := c.vectors[in]; v != nil {
			v.Describe(ch)
		} else {
			ch <- c.descs[in]
		}
	}
}

// Collect sends the current value of every metric of c, reading the Stat
// of each watched Client; it implements [prometheus.Collector].
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	for _, v := range c.vectors {
		if v != nil {
			v.Collect(ch)
		}
	}
	metricmap.ObserveStat(c.watched.Stat(), func(in metricmap.Instrument, v int64, labels ...string) {
		kind := prometheus.GaugeValue
		if metricmap.Instruments[in].Kind == metricmap.ObservedCounter {
			kind = prometheus.CounterValue
		}
		ch <- prometheus.MustNewConstMetric(c.descs[in], kind, float64(v), labels...)
	})
}

// Result returns the result label of an acquire that returned err: "ok"
// for nil, else "locked", "no_permit", "deadlock", "timeout",
// "canceled", "closed" or "error".
func Result(err error) string { return metricmap.ResultOf(err) }
