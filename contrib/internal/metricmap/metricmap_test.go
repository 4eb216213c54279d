package metricmap

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord"
)

// measurement is one call of a Recorder or of ObserveStat's function.
type measurement struct {
	call   string // "add", "observe", "set" or "observed"
	in     Instrument
	value  float64
	labels string // the label values, joined by ","
}

func (m measurement) String() string {
	return fmt.Sprintf("%s %s %v {%s}", m.call, Instruments[m.in].OTel, m.value, m.labels)
}

// recording is a Recorder that keeps what it is given, and reports a call
// that does not fit the instrument's Desc: the wrong method for its kind,
// or not one value for each of its labels.
type recording struct {
	t  *testing.T
	mu sync.Mutex
	ms []measurement
}

func (r *recording) record(call string, in Instrument, v float64, labels []string, kinds ...Kind) {
	r.t.Helper()
	d := Instruments[in]
	if !slices.Contains(kinds, d.Kind) {
		r.t.Errorf("%s on %s, an instrument of kind %d", call, d.OTel, d.Kind)
	}
	if len(labels) != len(d.Labels) {
		r.t.Errorf("%s on %s with label values %q, want one for each of %v", call, d.OTel, labels, d.Labels)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ms = append(r.ms, measurement{call, in, v, strings.Join(labels, ",")})
}

func (r *recording) Add(in Instrument, delta int64, labels ...string) {
	r.record("add", in, float64(delta), labels, Counter, UpDownCounter)
	if Instruments[in].Kind == Counter && delta < 0 {
		r.t.Errorf("add %d on the counter %s", delta, Instruments[in].OTel)
	}
}

func (r *recording) Observe(in Instrument, seconds float64, labels ...string) {
	r.record("observe", in, seconds, labels, Histogram)
}

func (r *recording) Set(in Instrument, value int64, labels ...string) {
	// Let another goroutine run between the Mapper's choice to set and
	// the set, as a busy SDK would: a Mapper that chose outside its lock
	// would set a lower term after a higher one.
	runtime.Gosched()
	r.record("set", in, float64(value), labels, Gauge)
}

// take returns what r recorded since the last take, as strings.
func (r *recording) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, m := range r.ms {
		out = append(out, m.String())
	}
	r.ms = nil
	return out
}

// Each event becomes the measurements the package documentation of the
// contrib modules lists, with one value for each label of the instrument.
func TestHooksMapEvents(t *testing.T) {
	r := &recording{t: t}
	h := New(testMaxNames).Hooks(r)
	for _, tc := range []struct {
		event func()
		want  []string
	}{
		{func() {
			h.OnAcquire(pgcoord.AcquireEvent{Name: "job", Mode: pgcoord.ModeShared, Wait: 250 * time.Millisecond})
		}, []string{
			"add pgcoord.lock.acquires 1 {job,shared,ok}",
			"observe pgcoord.lock.wait.duration 0.25 {job}",
			"add pgcoord.lock.held 1 {job}",
		}},
		{func() {
			h.OnAcquire(pgcoord.AcquireEvent{Name: "job", Wait: time.Second, Err: fmt.Errorf("x: %w", pgcoord.ErrLocked)})
		}, []string{
			"add pgcoord.lock.acquires 1 {job,exclusive,locked}",
			"observe pgcoord.lock.wait.duration 1 {job}",
		}},
		{func() { h.OnRelease(pgcoord.ReleaseEvent{Name: "job"}) }, []string{
			"add pgcoord.lock.releases 1 {job}",
			"add pgcoord.lock.held -1 {job}",
		}},
		{func() { h.OnContention(pgcoord.ContentionEvent{Name: "job", Local: true}) }, []string{
			"add pgcoord.lock.contentions 1 {job,exclusive,local}",
		}},
		{func() { h.OnContention(pgcoord.ContentionEvent{Mode: pgcoord.ModeShared}) }, []string{
			"add pgcoord.lock.contentions 1 {unnamed,shared,server}",
		}},
		{func() { h.OnLoss(pgcoord.LossEvent{Name: "job"}) }, []string{
			"add pgcoord.lock.losses 1 {job}",
			"add pgcoord.lock.held -1 {job}",
		}},
		{func() { h.OnLeadership(pgcoord.LeadershipEvent{Election: "sched", Leading: true, Term: 7}) }, []string{
			"add pgcoord.leader 1 {sched}",
			"set pgcoord.leader.term 7 {sched}",
		}},
		{func() { h.OnLeadership(pgcoord.LeadershipEvent{Election: "sched"}) }, []string{
			"add pgcoord.leader -1 {sched}",
		}},
		{func() {
			h.OnLeadership(pgcoord.LeadershipEvent{Election: "sched", Leading: true, Term: 7})
			h.OnLeadership(pgcoord.LeadershipEvent{Election: "sched", Err: pgcoord.ErrLockLost})
		}, []string{
			"add pgcoord.leader 1 {sched}", // the same term again is not set again
			"add pgcoord.leader -1 {sched}",
			"add pgcoord.leader.losses 1 {sched}",
		}},
		{func() {
			h.OnPermit(pgcoord.PermitEvent{Semaphore: "exports", Kind: pgcoord.PermitAcquired, Wait: time.Millisecond})
		}, []string{
			"add pgcoord.permit.acquires 1 {exports,ok}",
			"observe pgcoord.permit.wait.duration 0.001 {exports}",
			"add pgcoord.permit.held 1 {exports}",
		}},
		{func() {
			h.OnPermit(pgcoord.PermitEvent{Semaphore: "exports", Kind: pgcoord.PermitAcquired, Err: pgcoord.ErrNoPermit})
		}, []string{
			"add pgcoord.permit.acquires 1 {exports,no_permit}",
			"observe pgcoord.permit.wait.duration 0 {exports}",
		}},
		{func() { h.OnPermit(pgcoord.PermitEvent{Semaphore: "exports", Kind: pgcoord.PermitReleased}) }, []string{
			"add pgcoord.permit.held -1 {exports}",
		}},
		{func() { h.OnPermit(pgcoord.PermitEvent{Semaphore: "exports", Kind: pgcoord.PermitLost}) }, []string{
			"add pgcoord.permit.held -1 {exports}",
			"add pgcoord.permit.losses 1 {exports}",
		}},
	} {
		tc.event()
		if got := r.take(); !slices.Equal(got, tc.want) {
			t.Errorf("measurements\n\t%s\nwant\n\t%s", strings.Join(got, "\n\t"), strings.Join(tc.want, "\n\t"))
		}
	}

	ObserveStat(pgcoord.Stat{Backends: 2, Sessions: 3, Connecting: 1, Waits: 4, QueuedWaits: 5, Locks: 6, DroppedHookEvents: 7},
		func(in Instrument, v int64, labels ...string) {
			r.record("observed", in, float64(v), labels, ObservedUpDown, ObservedCounter)
		})
	want := []string{
		"observed pgcoord.connection.count 2 {backend}",
		"observed pgcoord.connection.count 3 {session}",
		"observed pgcoord.connection.count 1 {connecting}",
		"observed pgcoord.lock.waits 4 {server}",
		"observed pgcoord.lock.waits 5 {queued}",
		"observed pgcoord.lock.handles 6 {}",
		"observed pgcoord.hook.events.dropped 7 {}",
	}
	if got := r.take(); !slices.Equal(got, want) {
		t.Errorf("observed\n\t%s\nwant\n\t%s", strings.Join(got, "\n\t"), strings.Join(want, "\n\t"))
	}
}

// testMaxNames is a bound the tests do not reach unless they mean
// to.
const testMaxNames = 64

// Each instrument is described whole, under names that are unique in
// each SDK and follow its conventions.
func TestInstrumentsDescribed(t *testing.T) {
	otelNames, promNames := map[string]bool{}, map[string]bool{}
	for in, d := range Instruments {
		if d.Kind == 0 || d.OTel == "" || d.Prom == "" || d.Unit == "" || d.Help == "" {
			t.Errorf("instrument %d is not described whole: %+v", in, d)
		}
		if otelNames[d.OTel] || promNames[d.Prom] {
			t.Errorf("instrument %d: a name is used twice: %s, %s", in, d.OTel, d.Prom)
		}
		otelNames[d.OTel], promNames[d.Prom] = true, true
		if !strings.HasPrefix(d.OTel, "pgcoord.") || !strings.HasPrefix(d.Prom, "pgcoord_") {
			t.Errorf("%s, %s: not in pgcoord's namespace", d.OTel, d.Prom)
		}
		switch d.Kind {
		case Histogram:
			if d.Unit != "s" || !strings.HasSuffix(d.Prom, "_seconds") {
				t.Errorf("histogram %s (%s) unit %q: want seconds", d.OTel, d.Prom, d.Unit)
			}
		case Counter, ObservedCounter:
			if !strings.HasSuffix(d.Prom, "_total") {
				t.Errorf("counter %s: want a _total suffix", d.Prom)
			}
		}
		if d.Kind != Histogram && !strings.HasPrefix(d.Unit, "{") {
			t.Errorf("%s: unit %q, want a {count} annotation", d.OTel, d.Unit)
		}
		if len(d.Labels) > MaxLabels {
			t.Errorf("%s: %d labels, more than MaxLabels", d.OTel, len(d.Labels))
		}
		for _, l := range d.Labels {
			if k := LabelKeys[l]; k.OTel == "" || k.Prom == "" {
				t.Errorf("%s: label %d has no keys", d.OTel, l)
			}
		}
	}
}

// Past the bound, names share Other; "" is Unnamed; an invalid UTF-8 name
// is made valid. Each kind of name has a bound of its own.
func TestHooksBoundLabels(t *testing.T) {
	r := &recording{t: t}
	h := New(2).Hooks(r)
	for _, name := range []string{"a", "b", "c", "a", "", "d"} {
		h.OnRelease(pgcoord.ReleaseEvent{Name: name})
	}
	h.OnPermit(pgcoord.PermitEvent{Semaphore: "bad\xff", Kind: pgcoord.PermitReleased})
	h.OnLeadership(pgcoord.LeadershipEvent{Election: "x"})
	var labels []string
	for _, m := range r.ms {
		if m.in != LocksHeld {
			labels = append(labels, m.labels)
		}
	}
	want := []string{"a", "b", "other", "a", "unnamed", "other", "bad\uFFFD", "x"}
	if !slices.Equal(labels, want) {
		t.Errorf("labels %q, want %q", labels, want)
	}
}

// The term gauge never goes backwards under a label, though the
// elections past the bound share Other and gain terms out of order, and
// though the hooks of several Clients run at once: each Set under a label
// is higher than the one before it.
func TestHooksTermNeverGoesBack(t *testing.T) {
	r := &recording{t: t}
	m := New(1)
	h := m.Hooks(r)
	h.OnLeadership(pgcoord.LeadershipEvent{Election: "first", Leading: true, Term: 1 << 40})
	const goroutines, terms = 8, 500
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for i := range terms {
				// Each goroutine's own election, with terms that go down
				// as well as up.
				term := pgcoord.Term((i*7919+g*31)%terms + 1)
				h.OnLeadership(pgcoord.LeadershipEvent{Election: fmt.Sprintf("e-%d", g), Leading: true, Term: term})
			}
		})
	}
	wg.Wait()
	last := map[string]float64{}
	sets := 0
	for _, ms := range r.ms {
		if ms.call != "set" {
			continue
		}
		sets++
		if ms.value <= last[ms.labels] {
			t.Fatalf("term under %q set to %v after %v", ms.labels, ms.value, last[ms.labels])
		}
		last[ms.labels] = ms.value
	}
	if last[Other] != terms || last["first"] != 1<<40 {
		t.Errorf("highest terms %v, want %d under other and 1<<40 under first", last, terms)
	}
	if sets < 2 {
		t.Errorf("%d terms set", sets)
	}
}

// However many names the events carry, the Mapper keeps at most the
// bound of each, plus Other and Unnamed.
func TestMapperStateBounded(t *testing.T) {
	const maxNames, names = 16, 10000
	r := &recording{t: t}
	m := New(maxNames)
	h := m.Hooks(r)
	for i := range names {
		name := fmt.Sprintf("n-%d", i)
		h.OnLeadership(pgcoord.LeadershipEvent{Election: name, Leading: true, Term: pgcoord.Term(i + 1)})
		h.OnRelease(pgcoord.ReleaseEvent{Name: name})
		h.OnPermit(pgcoord.PermitEvent{Semaphore: name, Kind: pgcoord.PermitReleased})
	}
	h.OnLeadership(pgcoord.LeadershipEvent{Leading: true, Term: 1})
	if n := m.TermLabels(); n > maxNames+2 {
		t.Errorf("highest terms kept for %d labels after %d elections, want at most %d", n, names, maxNames+2)
	}
	for what, l := range map[string]*labeler{"lock": m.names, "election": m.elections, "semaphore": m.semaphores} {
		if n := len(l.seen); n > maxNames {
			t.Errorf("%d %s names kept, want at most %d", n, what, maxNames)
		}
	}
}

// ResultOf names the outcome of an acquire, through wrapping.
func TestResultOf(t *testing.T) {
	for err, want := range map[error]string{
		nil:                                      "ok",
		pgcoord.ErrLocked:                        "locked",
		fmt.Errorf("x: %w", pgcoord.ErrNoPermit): "no_permit",
		pgcoord.ErrDeadlock:                      "deadlock",
		errors.New("boom"):                       "error",
	} {
		if got := ResultOf(err); got != want {
			t.Errorf("ResultOf(%v) = %q, want %q", err, got, want)
		}
	}
}

// SetBuckets and SetMaxNames refuse what is not a valid setting, saying
// what is wrong and leaving the setting as it was.
func TestOptionsRefuseInvalid(t *testing.T) {
	var o Options
	if err := o.SetBuckets("pkg", []float64{0.001, 0.1, 10}); err != nil || !slices.Equal(o.Buckets, []float64{0.001, 0.1, 10}) {
		t.Errorf("valid bounds: %v, %v", o.Buckets, err)
	}
	if err := o.SetMaxNames("pkg", 1); err != nil || o.MaxNames != 1 {
		t.Errorf("valid bound: %v, %v", o.MaxNames, err)
	}
	for _, tc := range []struct {
		set  func() error
		want string
	}{
		{func() error { return o.SetBuckets("pkg", nil) }, "pkg: WithBuckets: no bounds"},
		{func() error { return o.SetBuckets("pkg", []float64{1, 1}) }, "must increase"},
		{func() error { return o.SetBuckets("pkg", []float64{-1}) }, "positive"},
		{func() error { return o.SetBuckets("pkg", []float64{1, math.Inf(1)}) }, "finite"},
		{func() error { return o.SetMaxNames("pkg", 0) }, "pkg: WithMaxNames(0): the bound must be at least 1"},
	} {
		if err := tc.set(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("invalid setting: %v, want an error saying %q", err, tc.want)
		}
	}
	if len(o.Buckets) != 3 || o.MaxNames != 1 {
		t.Errorf("after invalid settings: %+v, want the valid ones kept", o)
	}
}

// The defaults are valid settings, and each call of DefaultBuckets returns
// a slice of its own: a module's exported DefaultBuckets that a user
// changes does not change the other module's.
func TestDefaults(t *testing.T) {
	var o Options
	if err := o.SetBuckets("pkg", DefaultBuckets()); err != nil {
		t.Error(err)
	}
	if err := o.SetMaxNames("pkg", DefaultMaxNames); err != nil {
		t.Error(err)
	}
	a := DefaultBuckets()
	a[0] = 99
	if b := DefaultBuckets(); b[0] == 99 {
		t.Errorf("DefaultBuckets() = %v after a change to an earlier result: the slice is shared", b)
	}
}
