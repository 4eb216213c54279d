package main

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
)

// The page: HTML, script and style, embedded so the page loads nothing
// from anywhere but the CLI itself.
//
//go:embed ui
var uiFiles embed.FS

func uiCmd(fs *flag.FlagSet) func(context.Context, *env, []string) error {
	addr := fs.String("addr", "127.0.0.1:8080", "serve the page on `HOST:PORT` (port 0: any free port); the page shows\nevery backend's locks to whoever reaches it, so keep it on a loopback address")
	interval := fs.Duration("interval", time.Second, "read the database every `DURATION`, however many pages are open (100ms to 1h)")
	schema := fs.String("schema", pgcoord.DefaultSchema, "show the elections and semaphores whose tables are in schema `NAME`")
	userNames := namesFlags(fs)
	return func(ctx context.Context, e *env, args []string) error {
		if len(args) > 0 {
			return usagef("ui takes no arguments")
		}
		if *interval < 100*time.Millisecond || *interval > time.Hour {
			return usagef("ui: --interval must be 100ms to 1h, got %v", *interval)
		}
		m, err := userNames()
		if err != nil {
			return err
		}
		e.appName = "pgcoord-ui"
		pool, err := openSchemaPool(ctx, e, *schema)
		if err != nil {
			return err
		}
		defer pool.Close()
		ln, err := net.Listen("tcp", *addr)
		if err != nil {
			return usagef("ui: --addr %s: %v", *addr, err)
		}
		h := newHub(pool, *schema, m, *interval)
		srv := &http.Server{
			Handler:           h.handler(isLoopback(ln.Addr())),
			ReadHeaderTimeout: 5 * time.Second,
			BaseContext:       func(net.Listener) context.Context { return ctx },
		}
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { defer wg.Done(); h.run(ctx) }()
		fmt.Fprintf(e.stdout, "serving http://%s/ (read-only; interrupt to stop)\n", ln.Addr())
		if !isLoopback(ln.Addr()) {
			fmt.Fprintf(e.stderr, "pgcoord: warning: %s is not a loopback address: anyone who reaches it sees the database's locks and backends\n", ln.Addr())
		}
		errc := make(chan error, 1)
		go func() { errc <- srv.Serve(ln) }()
		select {
		case err = <-errc:
		case <-ctx.Done():
			shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			err = srv.Shutdown(shutdownCtx)
			cancel()
		}
		wg.Wait()
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
		return err
	}
}

// isLoopback reports whether a is a loopback address.
func isLoopback(a net.Addr) bool {
	ta, ok := a.(*net.TCPAddr)
	return ok && ta.IP.IsLoopback()
}

// hub reads the database once per interval, and only while a page or a
// request wants the state, and fans each result out to every open page:
// many pages cost the database what one does.
type hub struct {
	pool     *pgxpool.Pool
	schema   string
	names    names
	interval time.Duration

	mu      sync.Mutex
	subs    map[chan []byte]struct{}
	last    []byte        // the latest message
	lastAt  time.Time     // when last was read
	good    *state        // the latest state read without error
	next    chan struct{} // closed when the next message is published
	wake    chan struct{} // a request wants a state now
	polls   atomic.Int64  // query sets run
	started time.Time     // of the current outage, if any
}

func newHub(pool *pgxpool.Pool, schema string, m names, interval time.Duration) *hub {
	return &hub{pool: pool, schema: schema, names: m, interval: interval,
		subs: map[chan []byte]struct{}{}, next: make(chan struct{}), wake: make(chan struct{}, 1)}
}

// message is what a page receives: the state, or the error of the last
// read with the last state read without one.
type message struct {
	state
	Error      string     `json:"error,omitempty"`
	ErrorSince *time.Time `json:"error_since,omitempty"`
	IntervalMS int64      `json:"interval_ms"`
	Polls      int64      `json:"polls"` // query sets run since the CLI started
}

// run polls until ctx ends: every interval while a page is open, and at
// once when a request finds no fresh state.
func (h *hub) run(ctx context.Context) {
	for {
		h.mu.Lock()
		watched := len(h.subs) > 0
		h.mu.Unlock()
		if !watched {
			select {
			case <-h.wake:
			case <-ctx.Done():
				return
			}
		}
		start := time.Now()
		h.poll(ctx)
		t := time.NewTimer(h.interval - time.Since(start))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return
		}
	}
}

// poll runs one query set and publishes its result.
func (h *hub) poll(ctx context.Context) {
	qctx, cancel := context.WithTimeout(ctx, max(2*time.Second, 3*h.interval))
	st, err := readState(qctx, h.pool, h.schema, h.names)
	cancel()
	if ctx.Err() != nil {
		return
	}
	n := h.polls.Add(1)
	h.mu.Lock()
	defer h.mu.Unlock()
	msg := message{IntervalMS: h.interval.Milliseconds(), Polls: n}
	if err != nil {
		if h.started.IsZero() {
			h.started = time.Now()
		}
		since := h.started
		msg.Error, msg.ErrorSince = strings.TrimPrefix(err.Error(), "pgcoord: "), &since
		if h.good != nil {
			msg.state = *h.good
		} else {
			msg.state = state{Schema: h.schema, Locks: []lockRow{}, Waits: []waitEdge{},
				Elections: []electionRow{}, Semaphores: []semaphoreInfo{}}
		}
		msg.Time = time.Now()
	} else {
		msg.state = *st
		h.good, h.started = st, time.Time{}
	}
	b, jerr := json.Marshal(msg)
	if jerr != nil {
		b, _ = json.Marshal(map[string]string{"error": jerr.Error()})
	}
	h.last, h.lastAt = b, time.Now()
	for ch := range h.subs {
		select { // keep only the newest message for a slow page
		case <-ch:
		default:
		}
		ch <- b
	}
	close(h.next)
	h.next = make(chan struct{})
}

func (h *hub) subscribe() (chan []byte, []byte) {
	ch := make(chan []byte, 1)
	h.mu.Lock()
	h.subs[ch] = struct{}{}
	last := h.last
	h.mu.Unlock()
	h.poke()
	return ch, last
}

func (h *hub) unsubscribe(ch chan []byte) {
	h.mu.Lock()
	delete(h.subs, ch)
	h.mu.Unlock()
}

// poke wakes an idle poller.
func (h *hub) poke() {
	select {
	case h.wake <- struct{}{}:
	default:
	}
}

// current returns a message no older than the interval, waiting for the
// next poll if there is none.
func (h *hub) current(ctx context.Context) ([]byte, error) {
	h.mu.Lock()
	if h.last != nil && time.Since(h.lastAt) < h.interval {
		b := h.last
		h.mu.Unlock()
		return b, nil
	}
	next := h.next
	h.mu.Unlock()
	h.poke()
	select {
	case <-next:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.last, nil
}

// handler serves the page, /api/state (the state as one JSON object) and
// /api/events (server-sent events, one per poll). It answers GET and HEAD
// only. When loopbackOnly, it refuses a Host header that does not name a
// loopback address, so a web page elsewhere cannot read it through DNS
// rebinding.
func (h *hub) handler(loopbackOnly bool) http.Handler {
	static, _ := fs.Sub(uiFiles, "ui")
	files := http.FileServerFS(static)
	mux := http.NewServeMux()
	mux.Handle("GET /", files)
	mux.HandleFunc("GET /api/state", func(w http.ResponseWriter, r *http.Request) {
		b, err := h.current(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write(b)
	})
	mux.HandleFunc("GET /api/events", h.events)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hd := w.Header()
		hd.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
		hd.Set("X-Content-Type-Options", "nosniff")
		hd.Set("Referrer-Policy", "no-referrer")
		hd.Set("Cache-Control", "no-store")
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			hd.Set("Allow", "GET, HEAD")
			http.Error(w, "read-only: GET and HEAD only", http.StatusMethodNotAllowed)
			return
		}
		if loopbackOnly && !loopbackHost(r.Host) {
			http.Error(w, "this page answers on a loopback address only", http.StatusForbidden)
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// loopbackHost reports whether the Host header host names a loopback
// address.
func loopbackHost(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.Trim(host, "[]")
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// events streams a message per poll to one page, until the page or the
// CLI goes away.
func (h *hub) events(w http.ResponseWriter, r *http.Request) {
	fl, ok := w.(http.Flusher)
	if !ok {
		http.Error(w, "streaming unsupported", http.StatusInternalServerError)
		return
	}
	ch, last := h.subscribe()
	defer h.unsubscribe(ch)
	w.Header().Set("Content-Type", "text/event-stream")
	fmt.Fprintf(w, "retry: %d\n\n", max(h.interval.Milliseconds(), 500))
	if last != nil {
		fmt.Fprintf(w, "data: %s\n\n", last)
	}
	fl.Flush()
	keepalive := time.NewTicker(15 * time.Second)
	defer keepalive.Stop()
	for {
		select {
		case b := <-ch:
			if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
				return
			}
			fl.Flush()
		case <-keepalive.C:
			if _, err := fmt.Fprint(w, ": keepalive\n\n"); err != nil {
				return
			}
			fl.Flush()
		case <-r.Context().Done():
			return
		}
	}
}
