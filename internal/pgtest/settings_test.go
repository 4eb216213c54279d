package pgtest

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// showSettings reads settings on a connection of its own, closed before it
// returns so that it holds no slot afterwards.
func showSettings(t testing.TB, connString string, names ...string) map[string]string {
	t.Helper()
	conn, err := connect(connString)
	if err != nil {
		t.Fatal(err)
	}
	defer closeConn(conn)
	got := map[string]string{}
	for _, name := range names {
		var v string
		if err := conn.QueryRow(ctxT(t), "SHOW "+quoteIdent(name)).Scan(&v); err != nil {
			t.Fatalf("SHOW %s: %v", name, err)
		}
		got[name] = v
	}
	return got
}

// Settings given to NewServer are in force after NewServer, Restart, Crash
// and Stop plus Start, and on a standby of the server.
func TestServerSettingsSurviveRestarts(t *testing.T) {
	t.Parallel()
	want := map[string]string{
		"max_connections":           "12",
		"max_locks_per_transaction": "10",
		"wal_writer_delay":          "10s",
	}
	s := NewServer(t,
		WithSetting("max_connections", "12"),
		WithSetting("MAX_LOCKS_PER_TRANSACTION", "10"),
		WithSetting("wal_writer_delay", "10s"))
	cs := s.ConnString("postgres")
	var started time.Time
	check := func(stage, cs string) {
		t.Helper()
		got := showSettings(t, cs, "max_connections", "max_locks_per_transaction", "wal_writer_delay")
		for name, v := range want {
			if got[name] != v {
				t.Errorf("%s: %s = %q, want %q", stage, name, got[name], v)
			}
		}
		conn, err := connect(cs)
		if err != nil {
			t.Fatal(err)
		}
		defer closeConn(conn)
		now := startTime(t, conn)
		if !now.After(started) {
			t.Fatalf("%s: postmaster start time %v did not change from %v", stage, now, started)
		}
		started = now
	}
	check("after NewServer", cs)
	s.Restart(t)
	check("after Restart", cs)
	s.Crash(t)
	check("after Crash", cs)
	s.Stop(t)
	s.Start(t)
	check("after Stop and Start", cs)

	started = time.Time{}
	st := s.StartStandby(t)
	check("on a standby", st.ConnString("postgres"))
}

// fillSlots opens connections to connString until the server refuses one
// for want of slots, at most limit, and returns them; they are closed in
// t.Cleanup.
func fillSlots(t testing.TB, connString string, limit int) []*pgx.Conn {
	t.Helper()
	var conns []*pgx.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			closeConn(c)
		}
	})
	for range limit + 1 {
		conn, err := connect(connString)
		if err != nil {
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != tooManyConnections {
				t.Fatalf("connection %d: %v, want SQLSTATE %s", len(conns)+1, err, tooManyConnections)
			}
			return conns
		}
		conns = append(conns, conn)
	}
	t.Fatalf("the server accepted %d connections, more than %d", len(conns), limit)
	return nil
}

// pgtest keeps exactly adminSlots connections to a server, before and
// after a restart, and the database of DB is still dropped at the end with
// every other slot taken.
func TestServerConnectionSlots(t *testing.T) {
	t.Parallel()
	const maxConns = 5
	s := NewServer(t, WithSetting("max_connections", "5"), WithSetting("superuser_reserved_connections", "1"))
	cs := s.DB(t)
	for _, fault := range []struct {
		name string
		do   func()
	}{
		{"after NewServer", func() {}},
		{"after Restart", func() { s.Restart(t) }},
		{"after Crash", func() { s.Crash(t) }},
	} {
		fault.do()
		conns := fillSlots(t, cs, maxConns)
		if len(conns) != maxConns-adminSlots {
			t.Fatalf("%s: the test got %d of %d slots, want %d", fault.name, len(conns), maxConns, maxConns-adminSlots)
		}
	}
}

// A server whose every slot is taken is ready all the same, and pgtest opens
// its admin connection later, once a slot is free.
func TestServerReadyWhenFull(t *testing.T) {
	t.Parallel()
	s := NewServer(t, WithSetting("max_connections", "3"), WithSetting("superuser_reserved_connections", "0"))
	first := s.DB(t)
	s.admin.mu.Lock()
	adminPID := int(s.admin.conn.PgConn().PID())
	s.admin.mu.Unlock()
	s.admin.close() // give up pgtest's slot
	waitExited(t, adminPID)
	conns := fillSlots(t, first, 3)
	if len(conns) != 3 {
		t.Fatalf("the test got %d of 3 slots", len(conns))
	}
	s.mu.Lock()
	conn, err := s.waitReady(time.Now().Add(readyTimeout))
	s.mu.Unlock()
	if err != nil || conn != nil {
		t.Fatalf("waitReady on a full server = %v, %v; want nil, nil", conn, err)
	}
	for _, c := range conns[:2] {
		pid := int(c.PgConn().PID())
		closeConn(c)
		waitExited(t, pid)
	}
	second := s.DB(t)
	if !queryBool(t, Conn(t, second), "SELECT true") {
		t.Fatal("no answer from the second database")
	}
}

// waitExited waits until the backend with process id pid has exited and
// been reaped, which frees its connection slot.
func waitExited(t testing.TB, pid int) {
	t.Helper()
	Eventually(t, terminateWait, fmt.Sprintf("backend %d to exit", pid), func() bool { return !alive(pid) })
}

// NewServer refuses options that cannot work, naming the problem.
func TestServerOptionsSayNo(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []ServerOption
		want string // "" for no error
	}{
		{"plain", []ServerOption{WithSetting("work_mem", "8MB")}, ""},
		{"custom", []ServerOption{WithSetting("pgcoord.test", "x")}, ""},
		{"enough slots", []ServerOption{WithSetting("max_connections", "3"), WithSetting("superuser_reserved_connections", "2")}, ""},
		{"space", []ServerOption{WithSetting("work mem", "8MB")}, "not a configuration parameter name"},
		{"three parts", []ServerOption{WithSetting("a.b.c", "1")}, "not a configuration parameter name"},
		{"empty", []ServerOption{WithSetting("", "1")}, "not a configuration parameter name"},
		{"port", []ServerOption{WithSetting("Port", "5432")}, "pgtest sets port itself"},
		{"listen", []ServerOption{WithSetting("listen_addresses", "*")}, "pgtest sets listen_addresses itself"},
		{"twice", []ServerOption{WithSetting("work_mem", "8MB"), WithSetting("WORK_MEM", "16MB")}, `work_mem is already set to "8MB"`},
		{"no slot", []ServerOption{WithSetting("max_connections", "1"), WithSetting("superuser_reserved_connections", "0")}, "leaves no slot for the test"},
		{"reserved default", []ServerOption{WithSetting("max_connections", "3")}, "must exceed superuser_reserved_connections (3, PostgreSQL's default)"},
		{"reserved set", []ServerOption{WithSetting("max_connections", "4"), WithSetting("superuser_reserved_connections", "4")}, "must exceed superuser_reserved_connections (4, as set)"},
		{"nil", []ServerOption{nil}, "nil option"},
	} {
		_, err := newServerConfig(tc.opts)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.want != "" && err == nil:
			t.Errorf("%s: no error, want one with %q", tc.name, tc.want)
		case tc.want != "" && (!strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "pgcoord: pgtest: ")):
			t.Errorf("%s: %v, want pgcoord: pgtest: ... %s", tc.name, err, tc.want)
		}
	}
}

// A value PostgreSQL rejects fails the start with the server's reason.
func TestServerBadSettingValue(t *testing.T) {
	t.Parallel()
	l, err := getLocal()
	if errors.Is(err, errNoBinaries) {
		SkipOrFail(t, "this test needs local PostgreSQL binaries (Debian: apt-get install postgresql): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	s, err := newServer(l, []setting{{"max_connections", "many"}})
	if err == nil {
		_ = s.close()
		t.Fatal("a server started with max_connections=many")
	}
	if !strings.Contains(err.Error(), `invalid value for parameter "max_connections"`) {
		t.Fatalf("error lacks PostgreSQL's reason: %v", err)
	}
}
