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
// pgcoord.leader.term records only terms higher than any recorded before
// under its attribute value: elections past WithMaxNames share "other",
// which shows the highest term any of them gained.
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
	"sync"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/contrib/internal/metricmap"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// ScopeName is the instrumentation scope of the Meter that Metrics use.
const ScopeName = "github.com/pgcoord/pgcoord/contrib/otel"

// Attribute values for names that have none ("unnamed"), and for names
// beyond the bound ("other").
const (
	Unnamed = metricmap.Unnamed
	Other   = metricmap.Other
)

// DefaultMaxNames is how many distinct values of each name attribute
// Metrics keep unless WithMaxNames says otherwise: 64.
const DefaultMaxNames = metricmap.DefaultMaxNames

// DefaultBuckets are the explicit bucket boundaries, in seconds, advised
// for the wait-time histograms unless WithBuckets says otherwise: 0.5 ms
// to 32 s, ×4 (0.0005, 0.002, 0.008, 0.032, 0.128, 0.512, 2.048, 8.192,
// 32.768).
var DefaultBuckets = metricmap.DefaultBuckets()

// An Option configures [Metrics].
type Option interface {
	apply(*config) error
}

type optionFunc func(*config) error

func (f optionFunc) apply(c *config) error { return f(c) }

type config struct {
	provider metric.MeterProvider
	metricmap.Options
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
	return optionFunc(func(c *config) error { return c.SetBuckets("pgcoordotel", bounds) })
}

// WithMaxNames bounds how many distinct values of each of the lock,
// election and semaphore name attributes Metrics keep (default
// DefaultMaxNames); events of later names get "other". n must be at least
// 1.
func WithMaxNames(n int) Option {
	return optionFunc(func(c *config) error { return c.SetMaxNames("pgcoordotel", n) })
}

// Metrics hold pgcoord's OpenTelemetry instruments (see the package
// documentation). Their hooks feed the event instruments; the Clients they
// watch feed the observable ones at each collection. Their methods are
// safe for concurrent use.
type Metrics struct {
	mapper  *metricmap.Mapper
	watched metricmap.Watched

	// The instruments of metricmap.Instruments, by kind.
	adders      [metricmap.NumInstruments]int64Adder
	histograms  [metricmap.NumInstruments]metric.Float64Histogram
	gauges      [metricmap.NumInstruments]metric.Int64Gauge
	observables [metricmap.NumInstruments]metric.Int64Observable
	// keys holds the attribute keys of each instrument, in the order of
	// its metricmap.Desc.Labels.
	keys [metricmap.NumInstruments][]attribute.Key
	// attrs holds the attributes of each instrument and label values
	// recorded: an attrKey's metric.MeasurementOption.
	attrs sync.Map

	registration metric.Registration
}

// int64Adder is an Int64Counter or an Int64UpDownCounter.
type int64Adder interface {
	Add(ctx context.Context, incr int64, options ...metric.AddOption)
}

// New creates the instruments on a Meter of the configured MeterProvider
// and registers the callback of the observable ones. It returns an error
// when an option is invalid or the Meter refuses an instrument.
func New(opts ...Option) (*Metrics, error) {
	cfg := config{Options: metricmap.Options{Buckets: DefaultBuckets, MaxNames: DefaultMaxNames}}
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
	m := &Metrics{mapper: metricmap.New(cfg.MaxNames)}
	var errs []error
	var observables []metric.Observable
	for in, d := range metricmap.Instruments {
		for _, l := range d.Labels {
			m.keys[in] = append(m.keys[in], attribute.Key(metricmap.LabelKeys[l].OTel))
		}
		unit, desc := metric.WithUnit(d.Unit), metric.WithDescription(d.Help)
		var err error
		switch d.Kind {
		case metricmap.Counter:
			m.adders[in], err = meter.Int64Counter(d.OTel, unit, desc)
		case metricmap.UpDownCounter:
			m.adders[in], err = meter.Int64UpDownCounter(d.OTel, unit, desc)
		case metricmap.Histogram:
			m.histograms[in], err = meter.Float64Histogram(d.OTel, unit, desc, metric.WithExplicitBucketBoundaries(cfg.Buckets...))
		case metricmap.Gauge:
			m.gauges[in], err = meter.Int64Gauge(d.OTel, unit, desc)
		case metricmap.ObservedUpDown:
			var o metric.Int64ObservableUpDownCounter
			o, err = meter.Int64ObservableUpDownCounter(d.OTel, unit, desc)
			m.observables[in] = o
			observables = append(observables, o)
		case metricmap.ObservedCounter:
			var o metric.Int64ObservableCounter
			o, err = meter.Int64ObservableCounter(d.OTel, unit, desc)
			m.observables[in] = o
			observables = append(observables, o)
		}
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("pgcoordotel: New: %w", err)
	}
	var err error
	m.registration, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		metricmap.ObserveStat(m.watched.Stat(), func(in metricmap.Instrument, v int64, labels ...string) {
			o.ObserveInt64(m.observables[in], v, m.attributes(in, labels))
		})
		return nil
	}, observables...)
	if err != nil {
		return nil, fmt.Errorf("pgcoordotel: New: register the callback of the observable instruments: %w", err)
	}
	return m, nil
}

// attributes returns the attributes of instrument in with the values
// labels. It builds each set once: every label has a bounded set of
// values, so attrs stays bounded.
func (m *Metrics) attributes(in metricmap.Instrument, labels []string) metric.MeasurementOption {
	k := attrKey{in: in}
	copy(k.labels[:], labels)
	if o, ok := m.attrs.Load(k); ok {
		return o.(metric.MeasurementOption)
	}
	kvs := make([]attribute.KeyValue, len(labels))
	for i, v := range labels {
		kvs[i] = m.keys[in][i].String(v)
	}
	o, _ := m.attrs.LoadOrStore(k, metric.WithAttributeSet(attribute.NewSet(kvs...)))
	return o.(metric.MeasurementOption)
}

// attrKey is an instrument and its label values.
type attrKey struct {
	in     metricmap.Instrument
	labels [metricmap.MaxLabels]string
}

// recorder records the measurements of m's hooks, with context.Background().
type recorder struct{ m *Metrics }

func (r recorder) Add(in metricmap.Instrument, delta int64, labels ...string) {
	r.m.adders[in].Add(context.Background(), delta, r.m.attributes(in, labels))
}

func (r recorder) Observe(in metricmap.Instrument, seconds float64, labels ...string) {
	r.m.histograms[in].Record(context.Background(), seconds, r.m.attributes(in, labels))
}

func (r recorder) Set(in metricmap.Instrument, value int64, labels ...string) {
	r.m.gauges[in].Record(context.Background(), value, r.m.attributes(in, labels))
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
func (m *Metrics) Hooks() pgcoord.Hooks { return m.mapper.Hooks(recorder{m}) }

// Watch adds client to the Clients whose Stat m observes at each
// collection. Watching a Client twice counts it once. Call Unwatch to
// stop, for example before dropping a closed Client.
func (m *Metrics) Watch(client *pgcoord.Client) { m.watched.Watch(client) }

// Unwatch removes client from the watched Clients. Its dropped hook
// events stay counted in pgcoord.hook.events.dropped.
func (m *Metrics) Unwatch(client *pgcoord.Client) { m.watched.Unwatch(client) }

// Result returns the pgcoord.result attribute of an acquire that returned
// err: "ok" for nil, else "locked", "no_permit", "deadlock", "timeout",
// "canceled", "closed" or "error".
func Result(err error) string { return metricmap.ResultOf(err) }
