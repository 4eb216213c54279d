package pgcoordsql_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// waitLimit bounds every wait of these tests for state to change.
const waitLimit = 20 * time.Second

// openDB opens a *sql.DB with pgx's stdlib driver, closed in t.Cleanup.
func openDB(t *testing.T, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// begin begins a transaction on db and returns it with its backend's pid;
// it is rolled back in t.Cleanup if still open.
func begin(t *testing.T, db *sql.DB) (*sql.Tx, int32) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	tx, err := db.BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	var pid int32
	if err := tx.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	return tx, pid
}

// lockOf is one advisory lock of a backend, as pg_locks shows it:
// "int64:10 ExclusiveLock granted" or "... waiting".
func lockOf(t *testing.T, l pgtest.AdvisoryLock) string {
	t.Helper()
	k, err := pgcoord.KeyFromLock(l.ClassID, l.ObjID, l.ObjSubID)
	if err != nil {
		t.Fatal(err)
	}
	state := "granted"
	if !l.Granted {
		state = "waiting"
	}
	return fmt.Sprintf("%v %s %s", k, l.Mode, state)
}

// locksOf returns the advisory locks of backend pid, sorted as text.
func locksOf(t *testing.T, dsn string, pid int32) []string {
	t.Helper()
	var out []string
	for _, l := range pgtest.AdvisoryLocks(t, dsn) {
		if l.PID == pid {
			out = append(out, lockOf(t, l))
		}
	}
	slices.Sort(out)
	return out
}

// want builds the expected locksOf list: each key with mode and state.
func want(mode, state string, keys ...pgcoord.Key) []string {
	out := make([]string, len(keys))
	for i, k := range keys {
		out[i] = fmt.Sprintf("%v %s %s", k, mode, state)
	}
	slices.Sort(out)
	return out
}

// waitLocks waits until backend pid's locks are exactly w, and fails the
// test with what pg_locks showed last if they do not become so.
func waitLocks(t *testing.T, dsn string, pid int32, w []string) {
	t.Helper()
	w = slices.Sorted(slices.Values(w))
	var got []string
	deadline := time.Now().Add(waitLimit)
	for pause := time.Millisecond; ; pause = min(2*pause, 20*time.Millisecond) {
		got = locksOf(t, dsn, pid)
		if slices.Equal(got, w) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("locks of backend %d: got %q, want %q (waited %v)", pid, got, w, waitLimit)
		}
		time.Sleep(pause)
	}
}

// gone waits until backend pid has left pg_stat_activity: its connection
// was closed.
func gone(t *testing.T, db *sql.DB, pid int32) {
	t.Helper()
	pgtest.Eventually(t, waitLimit, fmt.Sprintf("backend %d to exit", pid), func() bool {
		var n int
		if err := db.QueryRow("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
}

// idle waits until db has no connection in use.
func idle(t *testing.T, db *sql.DB) {
	t.Helper()
	pgtest.Eventually(t, waitLimit, "no connection of the *sql.DB in use", func() bool { return db.Stats().InUse == 0 })
}

// result is what a call running in another goroutine returned.
type result chan error

// async runs f in a goroutine; the test must receive its result.
func async(f func() error) result {
	r := make(result, 1)
	go func() { r <- f() }()
	return r
}

// get returns the result, failing the test if it takes longer than waitLimit.
func (r result) get(t *testing.T) error {
	t.Helper()
	select {
	case err := <-r:
		return err
	case <-time.After(waitLimit):
		t.Fatalf("call did not return within %v", waitLimit)
		return nil
	}
}
