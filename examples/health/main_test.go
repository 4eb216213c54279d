package main

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const testTimeout = 30 * time.Second

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*testTimeout)
	t.Cleanup(cancel)
	return ctx
}

// probe GETs path from srv and returns the status and the decoded report
// (zero for /livez).
func probe(t *testing.T, srv *httptest.Server, path string) (int, Report) {
	t.Helper()
	req, err := http.NewRequestWithContext(testCtx(t), http.MethodGet, srv.URL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var r Report
	if path == "/readyz" {
		if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
			t.Fatalf("GET %s: body: %v", path, err)
		}
	}
	return resp.StatusCode, r
}

func newClient(t *testing.T, dsn string, opts ...pgcoord.Option) *pgcoord.Client {
	t.Helper()
	c, err := pgcoord.New(pgtest.Pool(t, dsn), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

// lockHolder returns the backend that holds k, from pg_locks.
func lockHolder(t *testing.T, dsn string, k pgcoord.Key) int32 {
	t.Helper()
	v, _ := k.Int64()
	var pid int32
	err := pgtest.Conn(t, dsn).QueryRow(testCtx(t), `SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1
		AND (classid::bigint << 32) | objid::bigint = $1
		AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`, v).Scan(&pid)
	if err != nil {
		t.Fatalf("holder of %v in pg_locks: %v", k, err)
	}
	return pid
}

// /readyz is 200 while the required lock is held and 503, saying the lock
// was lost, once its backend is terminated; /livez stays 200. A lock
// released on purpose after Forget leaves the process ready.
func TestProbeFlipsOnLockLoss(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newClient(t, dsn)
	p := NewProbe()
	srv := httptest.NewServer(p.Handler())
	defer srv.Close()

	singleton, other := pgcoord.HashKey("singleton"), pgcoord.HashKey("other")
	l, err := c.Lock(ctx, singleton)
	if err != nil {
		t.Fatal(err)
	}
	p.Require("singleton", l)
	o, err := c.Lock(ctx, other)
	if err != nil {
		t.Fatal(err)
	}
	p.Require("other", o)
	if code, r := probe(t, srv, "/readyz"); code != http.StatusOK || !r.Ready || r.Locks["singleton"] != "held" || r.Locks["other"] != "held" {
		t.Fatalf("/readyz with the locks held: %d %+v", code, r)
	}

	// Released on purpose: still ready.
	p.Forget("other")
	if err := o.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if code, r := probe(t, srv, "/readyz"); code != http.StatusOK || !r.Ready {
		t.Fatalf("/readyz after a lock was released on purpose: %d %+v", code, r)
	}

	// Lost: 503, and why.
	pgtest.Terminate(t, dsn, lockHolder(t, dsn, singleton))
	select {
	case <-l.Done():
	case <-ctx.Done():
		t.Fatal("the lock of a terminated backend did not end")
	}
	code, r := probe(t, srv, "/readyz")
	if code != http.StatusServiceUnavailable || r.Ready || !strings.HasPrefix(r.Locks["singleton"], "lost: ") ||
		len(r.Problems) != 1 || !strings.Contains(r.Problems[0], "singleton") {
		t.Fatalf("/readyz after the lock's backend was terminated: %d %+v", code, r)
	}
	if !errors.Is(l.Err(), pgcoord.ErrLockLost) {
		t.Errorf("Lock.Err = %v, want ErrLockLost", l.Err())
	}
	if code, _ := probe(t, srv, "/livez"); code != http.StatusOK {
		t.Errorf("/livez after a loss: %d, want 200", code)
	}
}

// The election's state shows in /readyz: leading with the term the
// server records; following (and ready) once the leadership is lost with
// its backend; not ready after a campaign fails; ready again when
// campaigning.
func TestProbeElection(t *testing.T) {
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	if err := pgcoord.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	c := newClient(t, dsn)
	p := NewProbe()
	srv := httptest.NewServer(p.Handler())
	defer srv.Close()

	e := c.Election("scheduler")
	ld, err := e.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	p.Leading(e.Name(), ld)
	info, err := e.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	code, r := probe(t, srv, "/readyz")
	if code != http.StatusOK || r.Election == nil || r.Election.State != "leading" || r.Election.Term != int64(info.Term) || r.Election.Name != "scheduler" {
		t.Fatalf("/readyz while leading term %d: %d %+v", info.Term, code, r.Election)
	}

	pgtest.Terminate(t, dsn, info.PID)
	select {
	case <-ld.Done():
	case <-ctx.Done():
		t.Fatal("the leadership of a terminated backend did not end")
	}
	code, r = probe(t, srv, "/readyz")
	if code != http.StatusOK || r.Election == nil || r.Election.State != "following" || !strings.Contains(r.Election.Error, "lost") {
		t.Fatalf("/readyz after the leader's backend was terminated: %d %+v", code, r.Election)
	}

	// A campaign that fails: this Client's schema has no tables.
	bad := newClient(t, dsn, pgcoord.WithSchema("nowhere"))
	_, err = bad.Election("scheduler").Campaign(ctx)
	if !errors.Is(err, pgcoord.ErrNotMigrated) {
		t.Fatalf("Campaign without tables = %v, want ErrNotMigrated", err)
	}
	p.CampaignFailed("scheduler", err)
	code, r = probe(t, srv, "/readyz")
	if code != http.StatusServiceUnavailable || r.Ready || r.Election.State != "error" || len(r.Problems) != 1 {
		t.Fatalf("/readyz after a failed campaign: %d %+v", code, r)
	}
	p.Following("scheduler")
	if code, r := probe(t, srv, "/readyz"); code != http.StatusOK || r.Election.State != "following" {
		t.Fatalf("/readyz while campaigning again: %d %+v", code, r)
	}
}
