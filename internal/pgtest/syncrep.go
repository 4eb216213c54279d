package pgtest

import (
	"syscall"
	"testing"
	"time"
)

// Synchronous replication. A primary whose synchronous_standby_names names
// a standby makes every commit that wrote WAL wait until that standby has
// flushed the commit's WAL; a commit whose wait is cancelled stays
// committed on the primary only. These helpers make a Server's standby
// synchronous, stop its WAL from reaching the standby, and kill the
// primary for a failover with nothing more sent.

// RequireSynchronousStandby sets synchronous_standby_names = '*' on s, a
// primary with a standby (StartStandby), reloads its configuration, and
// returns once pg_stat_replication on s shows a standby in sync state. From
// then on every commit on s that wrote WAL waits for that standby. t.Cleanup
// resets the setting if s still runs as a primary then (which releases the
// commits that wait), so that the cleanups that follow, such as stopping
// the standby and dropping the database, do not wait for it. It calls
// t.Fatal when that does not happen within a minute.
func (s *Server) RequireSynchronousStandby(t testing.TB) {
	t.Helper()
	set := func(sql string) error {
		ctx, conn, done, err := s.adminConn(readyTimeout)
		if err != nil {
			return err
		}
		defer done()
		for _, sql := range []string{sql, "SELECT pg_reload_conf()"} {
			if _, err := conn.Exec(ctx, sql); err != nil {
				return errorf("synchronous standby: %s: %w", sql, err)
			}
		}
		return nil
	}
	if err := set("ALTER SYSTEM SET synchronous_standby_names = '*'"); err != nil {
		t.Fatalf("%v%s", err, s.logTail())
	}
	t.Cleanup(func() {
		s.mu.Lock()
		running := s.pm != nil && !s.standby
		s.mu.Unlock()
		if running {
			if err := set("ALTER SYSTEM RESET synchronous_standby_names"); err != nil {
				t.Error(err)
			}
		}
	})
	ctx, conn, done := s.mustAdmin(t, readyTimeout)
	defer done()
	if !Poll(readyTimeout, func() bool {
		var sync bool
		err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_stat_replication WHERE sync_state = 'sync')").Scan(&sync)
		return err == nil && sync
	}) {
		t.Fatalf("%v%s", errorf("synchronous standby: no standby in sync state within %v", readyTimeout), s.logTail())
	}
}

// PauseWALSenders stops (SIGSTOP) every WAL sender process of s, a
// primary, so that its standbys receive no more WAL: a commit on s that
// waits for a synchronous standby then waits until resume sends them
// SIGCONT. resume may be called more than once; t.Cleanup calls it too. It
// calls t.Fatal when s has no WAL sender.
func (s *Server) PauseWALSenders(t testing.TB) (resume func()) {
	t.Helper()
	ctx, conn, done := s.mustAdmin(t, readyTimeout)
	defer done()
	rows, err := conn.Query(ctx, "SELECT pid FROM pg_stat_replication")
	if err != nil {
		t.Fatal(errorf("pause WAL senders: %w", err))
	}
	var pids []int
	for rows.Next() {
		var pid int
		if err := rows.Scan(&pid); err != nil {
			t.Fatal(errorf("pause WAL senders: %w", err))
		}
		pids = append(pids, pid)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(errorf("pause WAL senders: %w", err))
	}
	if len(pids) == 0 {
		t.Fatal(errorf("pause WAL senders: the server has none"))
	}
	for _, pid := range pids {
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			t.Fatal(errorf("pause WAL sender %d: %w", pid, err))
		}
	}
	resume = func() {
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}
	t.Cleanup(resume)
	return resume
}

// Kill kills s at once: SIGKILL to the postmaster and to every other
// process of its cluster, stopped ones included (PauseWALSenders), so that
// nothing more is sent to a standby, and returns once they have all
// exited. s stays stopped (Start starts it again, with crash recovery). It
// calls t.Fatal when the processes do not exit.
func (s *Server) Kill(t testing.TB) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pm == nil {
		t.Fatal(errorf("kill: server is not running"))
	}
	if pids, err := clusterProcesses(s.data); err == nil {
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	if err := s.kill(); err != nil {
		t.Fatal(err)
	}
}

// WaitEvents returns how many backends of s wait on wait_event event
// (pg_stat_activity), e.g. "SyncRep" for commits that wait for a
// synchronous standby. It calls t.Fatal when the query fails.
func (s *Server) WaitEvents(t testing.TB, event string) int {
	t.Helper()
	ctx, conn, done := s.mustAdmin(t, 10*time.Second)
	defer done()
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = $1", event).Scan(&n); err != nil {
		t.Fatal(errorf("wait events: %w", err))
	}
	return n
}
