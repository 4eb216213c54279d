package main

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"sort"
	"sync"

	"github.com/pgcoord/pgcoord"
)

// Probe answers Kubernetes-style readiness and liveness probes from what
// pgcoord reports: the locks the process must hold and the state of its
// election. Its methods are safe for concurrent use.
//
// /readyz answers 200 while every required lock is held and no campaign
// has failed; 503 once a required lock has ended (lost with its backend,
// or its Client closed) or the last campaign returned an error, with a
// JSON body that says why. A follower is ready: it serves, it just does
// not lead. /livez answers 200 as long as the process serves HTTP: a lost
// lock is a reason to stop taking traffic, not to restart the process,
// which would only lose the locks it still has.
type Probe struct {
	mu       sync.Mutex
	locks    map[string]*pgcoord.Lock
	election string
	state    string // "", "following", "leading" or "error"
	term     pgcoord.Term
	err      error
	ld       *pgcoord.Leadership // while leading
}

// NewProbe returns a Probe with no required lock and no election.
func NewProbe() *Probe { return &Probe{locks: make(map[string]*pgcoord.Lock)} }

// Require makes readiness depend on l, a held lock called name: /readyz
// answers 503 once l ends (Done closed) without Release having been asked
// for through Forget.
func (p *Probe) Require(name string, l *pgcoord.Lock) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.locks[name] = l
}

// Forget stops requiring the lock called name, before the program
// releases it on purpose.
func (p *Probe) Forget(name string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.locks, name)
}

// Following records that the process campaigns for election and does not
// lead it.
func (p *Probe) Following(election string) { p.set(election, "following", 0, nil) }

// Leading records that the process leads election with ld. Once ld ends
// (its context is cancelled as soon as it does), the state is following
// again, with the reason it ended.
func (p *Probe) Leading(election string, ld *pgcoord.Leadership) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.election, p.state, p.term, p.err, p.ld = election, "leading", ld.Term(), nil, ld
}

// CampaignFailed records that a campaign for election returned err: the
// process is not ready until it campaigns again (Following or Leading).
func (p *Probe) CampaignFailed(election string, err error) { p.set(election, "error", 0, err) }

func (p *Probe) set(election, state string, term pgcoord.Term, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.election, p.state, p.term, p.err, p.ld = election, state, term, err, nil
}

// Report is the JSON body of /readyz.
type Report struct {
	Ready    bool              `json:"ready"`
	Locks    map[string]string `json:"locks,omitempty"` // name → "held", or why it ended
	Election *ElectionReport   `json:"election,omitempty"`
	Problems []string          `json:"problems,omitempty"`
}

// ElectionReport describes the process's part in its election.
type ElectionReport struct {
	Name  string `json:"name"`
	State string `json:"state"` // following, leading or error
	Term  int64  `json:"term,omitempty"`
	Error string `json:"error,omitempty"`
}

// Report returns the readiness of the process and why.
func (p *Probe) Report() Report {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := Report{Ready: true, Locks: make(map[string]string, len(p.locks))}
	names := make([]string, 0, len(p.locks))
	for name := range p.locks {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		l := p.locks[name]
		select {
		case <-l.Done():
			err := l.Err()
			what := "ended: " + err.Error()
			if errors.Is(err, pgcoord.ErrLockLost) {
				what = "lost: " + err.Error()
			}
			r.Locks[name] = what
			r.Ready = false
			r.Problems = append(r.Problems, "lock "+name+" "+what)
		default:
			r.Locks[name] = "held"
		}
	}
	if p.state == "leading" && p.ld.Context().Err() != nil {
		p.state, p.err, p.ld = "following", context.Cause(p.ld.Context()), nil
	}
	if p.state != "" {
		e := &ElectionReport{Name: p.election, State: p.state, Term: int64(p.term)}
		if p.err != nil {
			e.Error = p.err.Error()
		}
		if p.state == "error" {
			r.Ready = false
			r.Problems = append(r.Problems, "election "+p.election+": campaign failed: "+e.Error)
		}
		r.Election = e
	}
	return r
}

// Handler returns the HTTP handler of /readyz and /livez.
func (p *Probe) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		r := p.Report()
		w.Header().Set("Content-Type", "application/json")
		if !r.Ready {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(r)
	})
	mux.HandleFunc("GET /livez", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte("ok\n"))
	})
	return mux
}
