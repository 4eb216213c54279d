package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// startUI runs "pgcoord ui" from bin on a free loopback port with args
// and returns the page's URL; the test's end interrupts it and checks
// that it exits 0.
func startUI(t *testing.T, bin string, args ...string) string {
	t.Helper()
	cmd := exec.Command(bin, append([]string{"ui", "--addr", "127.0.0.1:0"}, args...)...)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir()}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr syncBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			default:
			}
		}
		exited <- cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("pgcoord ui: %v\n%s", err, stderr.String())
			}
		case <-time.After(testTimeout):
			_ = cmd.Process.Kill()
			t.Errorf("pgcoord ui did not exit after an interrupt\n%s", stderr.String())
		}
	})
	select {
	case line := <-lines:
		url, ok := strings.CutPrefix(line, "serving ")
		url, _, _ = strings.Cut(url, " ")
		if !ok || !strings.HasPrefix(url, "http://127.0.0.1:") {
			t.Fatalf("pgcoord ui printed %q", line)
		}
		return url
	case err := <-exited:
		t.Fatalf("pgcoord ui exited: %v\n%s", err, stderr.String())
	case <-time.After(testTimeout):
		t.Fatalf("pgcoord ui printed no address\n%s", stderr.String())
	}
	return ""
}

// sseClient reads the events of a page's stream and counts them.
type sseClient struct {
	events atomic.Int64
	last   atomic.Pointer[message]
}

// openEvents opens the event stream of the page at url, as a page does,
// until the test ends.
func openEvents(t *testing.T, url string) *sseClient {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"api/events", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "text/event-stream" {
		cancel()
		t.Fatalf("api/events: %s, %s", resp.Status, resp.Header.Get("Content-Type"))
	}
	c := &sseClient{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(nil, 16<<20)
		for sc.Scan() {
			if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
				var m message
				if json.Unmarshal([]byte(data), &m) == nil {
					c.last.Store(&m)
				}
				c.events.Add(1)
			}
		}
	}()
	t.Cleanup(func() { cancel(); resp.Body.Close(); <-done })
	return c
}

// statements returns how many statements have run in database dbname, by
// pg_stat_statements, read on conn (connected to another database).
func statements(t *testing.T, conn *pgx.Conn, dbname string) int64 {
	t.Helper()
	var n int64
	err := conn.QueryRow(context.Background(), `SELECT coalesce(sum(s.calls), 0)::int8 FROM pg_stat_statements s
		JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = $1`, dbname).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// Fifty open pages cost the database no more statements per interval than
// one: the page's server reads the database once per interval and sends
// every page the result. The statements are counted by the server
// (pg_stat_statements), not by pgcoord.
func TestUIManyPagesCostOneQuerySet(t *testing.T) {
	srv := pgtest.NewServer(t, pgtest.WithSetting("shared_preload_libraries", "pg_stat_statements"))
	db := srv.DB(t)
	cfg, err := pgx.ParseConfig(db)
	if err != nil {
		t.Fatal(err)
	}
	admin := pgtest.Conn(t, srv.ConnString("postgres"))
	if _, err := admin.Exec(context.Background(), "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"); err != nil {
		t.Fatal(err)
	}
	if err := pgcoord.Migrate(context.Background(), pgtest.Pool(t, db)); err != nil {
		t.Fatal(err)
	}
	holder := pgtest.Conn(t, db) // a lock to show; then idle
	execSQL(t, holder, "SELECT pg_advisory_lock(7)")

	bin := buildCLI(t)
	const interval = 200 * time.Millisecond
	url := startUI(t, bin, "--db", db, "--interval", interval.String())

	// measure counts the statements run while watch receives n more
	// events: the statements of n query sets, read right after an event
	// arrives, when its query set has ended and the next has not begun.
	const n = 10
	measure := func(watch *sseClient) int64 {
		t.Helper()
		next := func(after int64) {
			t.Helper()
			if !pgtest.Poll(testTimeout, func() bool { return watch.events.Load() > after }) {
				t.Fatalf("no event after %d", after)
			}
		}
		e0 := watch.events.Load()
		next(e0)
		e0 = watch.events.Load()
		s0 := statements(t, admin, cfg.Database)
		next(e0 + n - 1)
		return statements(t, admin, cfg.Database) - s0
	}

	one := openEvents(t, url)
	pgtest.Eventually(t, testTimeout, "the first page's first event", func() bool { return one.events.Load() > 0 })
	withOne := measure(one)

	pages := []*sseClient{one}
	for range 49 {
		pages = append(pages, openEvents(t, url))
	}
	pgtest.Eventually(t, testTimeout, "every page's first event", func() bool {
		return !slices.ContainsFunc(pages, func(p *sseClient) bool { return p.events.Load() == 0 })
	})
	before := make([]int64, len(pages))
	for i, p := range pages {
		before[i] = p.events.Load()
	}
	withFifty := measure(one)
	t.Logf("statements in %d intervals of %v: %d with one page open, %d with fifty", n, interval, withOne, withFifty)
	// Reading the count a little late at either end of a window moves
	// at most one query set across it: allow that at each end.
	if withOne == 0 || withFifty > withOne+2*withOne/n {
		t.Errorf("fifty pages: %d statements in %d intervals; one page: %d; want no more", withFifty, n, withOne)
	}
	for i, p := range pages {
		if got := p.events.Load() - before[i]; got < n-1 {
			t.Errorf("page %d received %d events while the first received %d", i, got, n)
		}
		if m := p.last.Load(); m == nil || len(m.Locks) != 1 || m.Error != "" {
			t.Errorf("page %d: last event %+v", i, m)
		}
	}
}

// chromiumPath returns Debian's chromium, or skips the test (fails it under
// CI).
func chromiumPath(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	pgtest.SkipOrFail(t, "this test drives a headless Chromium and none is installed (Debian: apt-get install chromium)")
	return ""
}

// artifactDir is where tests write what a person may want to look at: the
// directory $PGCOORD_ARTIFACTS, or pgcoord-artifacts in the temporary
// directory.
func artifactDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("PGCOORD_ARTIFACTS")
	if dir == "" {
		dir = filepath.Join(os.TempDir(), "pgcoord-artifacts")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// The page in a real browser: it renders the scenario (names, the chain in
// the wait-for graph, the election, the semaphore), a released lock leaves
// the page within 2 s without a reload, and the page says so while the
// database is down and carries on once it is back, still without a
// reload. A screenshot of the scenario goes to the artifacts directory.
func TestUIPageInBrowser(t *testing.T) {
	chromium := chromiumPath(t)
	srv := pgtest.NewServer(t)
	db := srv.DB(t)
	s := newScenario(t, db)
	bin := buildCLI(t)
	url := startUI(t, bin, "--db", db, "--names-file", s.namesFile, "--name", "invoice/7", "--sep", "/")

	profile := t.TempDir()
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(chromium),
		chromedp.Flag("headless", true),
		chromedp.Flag("no-sandbox", true),
		chromedp.Flag("disable-gpu", true),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("no-first-run", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(profile),
		chromedp.WindowSize(1280, 1000),
	)
	defer cancelAlloc()
	ctx, cancelTab := chromedp.NewContext(allocCtx)
	defer cancelTab()
	ctx, cancel := context.WithTimeout(ctx, 3*testTimeout)
	defer cancel()

	eval := func(js string) any {
		t.Helper()
		v, err := chromedp.Run(ctx, chromedp.Evaluate[any](js))
		if err != nil {
			t.Fatalf("evaluate %s: %v", js, err)
		}
		return v
	}
	waitFor := func(timeout time.Duration, what, js string) time.Duration {
		t.Helper()
		start := time.Now()
		if !pgtest.Poll(timeout, func() bool { return eval(js) == true }) {
			page := eval(`document.body.innerText`)
			t.Fatalf("the page did not show, within %v, %s\n%v", timeout, what, page)
		}
		return time.Since(start)
	}
	if err := chromedp.Do(ctx, chromedp.Navigate(url)); err != nil {
		t.Fatal(err)
	}
	row := func(name string) string {
		return fmt.Sprintf(`!!document.querySelector('#locks tbody tr[data-name=%q]')`, name)
	}
	waitFor(testTimeout, "the chain", row("chain/second"))
	eval(`window.pgcoordTestMark = "loaded once"; true`)

	// The scenario: every key by its name, the election, the semaphore.
	names := eval(`[...document.querySelectorAll('#locks tbody tr')].map(r => r.dataset.name + "/" + r.dataset.granted)`).([]any)
	for _, want := range []string{"election scheduler/true", "election scheduler guard/true", "semaphore exports slot 0/true",
		"semaphore exports slot 1/true", "semaphore exports queue/true", "semaphore exports queue/false", "invoice/7/true",
		"chain/first/true", "chain/first/false", "chain/second/true", "chain/second/false"} {
		if !slices.Contains(names, any(want)) {
			t.Errorf("the locks table lacks %s: %v", want, names)
		}
	}
	el := eval(`(r => r && [r.dataset.leading, r.cells[1].textContent, r.cells[2].textContent, r.cells[4].textContent])(document.querySelector('#elections tr[data-election="scheduler"]'))`)
	if want := []any{"true", "pod-1", fmt.Sprint(s.term), fmt.Sprint(s.leaderPID)}; !slices.Equal(el.([]any), want) {
		t.Errorf("election row %v, want %v", el, want)
	}
	sem := eval(`(r => r && [r.dataset.held, r.dataset.queued, r.cells[2].textContent])(document.querySelector('#semaphores tr[data-semaphore="exports"]'))`).([]any)
	if sem[0] != "2" || sem[1] != "2" || !strings.Contains(sem[2].(string), "worker-1") || !strings.Contains(sem[2].(string), "worker-2") {
		t.Errorf("semaphore row %v, want 2 held by worker-1 and worker-2, 2 queued", sem)
	}
	// The graph: a node per backend of the chain, an arrow from each to
	// the one it waits for, labelled with the lock.
	edges := eval(`[...document.querySelectorAll('#graph g.edge')].map(g => g.dataset.waiter + "->" + g.dataset.blocker + ":" + g.querySelector('text').textContent)`).([]any)
	for _, want := range []string{
		fmt.Sprintf("%d->%d:chain/first", s.chainPIDs[1], s.chainPIDs[0]),
		fmt.Sprintf("%d->%d:chain/second", s.chainPIDs[2], s.chainPIDs[1]),
	} {
		if !slices.Contains(edges, any(want)) {
			t.Errorf("the graph lacks the edge %s: %v", want, edges)
		}
	}
	// Drawn left to right along the chain.
	xs := eval(fmt.Sprintf(`[%d, %d, %d].map(p => +document.querySelector('#graph g.node[data-pid="' + p + '"] rect').getAttribute('x'))`,
		s.chainPIDs[0], s.chainPIDs[1], s.chainPIDs[2])).([]any)
	if !(xs[0].(float64) < xs[1].(float64) && xs[1].(float64) < xs[2].(float64)) {
		t.Errorf("the chain's nodes at x %v, want left to right", xs)
	}
	shot, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(artifactDir(t), "ui.png")
	if err := os.WriteFile(path, shot, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot of the page: %s (%d bytes)", path, len(shot))

	// A released lock leaves the page within 2 s, without a reload.
	if err := s.fenced.Unlock(context.Background()); err != nil {
		t.Fatal(err)
	}
	took := waitFor(2*time.Second, "invoice/7 gone within 2 s", "!"+row("invoice/7"))
	t.Logf("the released lock left the page after %v", took)

	// The database goes away: the page says so and keeps the last state;
	// it comes back: the page shows what the database has now.
	srv.Stop(t)
	waitFor(testTimeout, "the banner", `!document.getElementById('banner').hidden && document.getElementById('banner').textContent.includes('cannot be reached')`)
	if got := eval(`document.querySelectorAll('#locks tbody tr[data-name]').length`); got == float64(0) {
		t.Errorf("the page dropped the last state while the database was down")
	}
	srv.Start(t)
	after := pgtest.Conn(t, db)
	execSQL(t, after, "SELECT pg_advisory_lock(4242)")
	waitFor(testTimeout, "the lock taken after the restart, and no banner",
		`document.getElementById('banner').hidden && !!document.querySelector('#locks tbody tr[data-key="int64:4242"]')`)
	if got := eval(`window.pgcoordTestMark`); got != "loaded once" {
		t.Errorf("the page was reloaded: mark %v", got)
	}
	if got := eval(`document.querySelectorAll('#locks tbody tr[data-name="chain/first"]').length`); got != float64(0) {
		t.Errorf("the chain's locks, ended with the server, still show: %v", got)
	}
}

// external matches a reference to an asset elsewhere.
var external = regexp.MustCompile(`(?i)(src|href)\s*=\s*["']?(https?:)?//|url\(\s*["']?(https?:)?//|import\s*\(`)

// The page's server answers GET and HEAD only, refuses a Host that is
// not a loopback address, and serves no asset from elsewhere.
func TestUIServerIsReadOnlyAndLocal(t *testing.T) {
	db := pgtest.DB(t)
	bin := buildCLI(t)
	url := startUI(t, bin, "--db", db)
	for _, m := range []string{http.MethodPost, http.MethodPut, http.MethodDelete} {
		req, _ := http.NewRequest(m, url+"api/state", strings.NewReader("{}"))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusMethodNotAllowed {
			t.Errorf("%s api/state: %s, want 405", m, resp.Status)
		}
	}
	req, _ := http.NewRequest(http.MethodGet, url+"api/state", nil)
	req.Host = "attacker.example:8080"
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("Host attacker.example: %s, want 403", resp.Status)
	}
	for _, path := range []string{"", "app.js", "style.css"} {
		resp, err := http.Get(url + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || external.Match(body) {
			t.Errorf("GET /%s: %s; it must load nothing from elsewhere", path, resp.Status)
		}
		if csp := resp.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'none'") {
			t.Errorf("GET /%s: Content-Security-Policy %q", path, csp)
		}
	}
	resp, err = http.Get(url + "api/state")
	if err != nil {
		t.Fatal(err)
	}
	var m message
	err = json.NewDecoder(resp.Body).Decode(&m)
	resp.Body.Close()
	if err != nil || m.Schema != pgcoord.DefaultSchema || m.Migrated || m.Error != "" {
		t.Errorf("api/state: %+v, %v", m, err)
	}
}
