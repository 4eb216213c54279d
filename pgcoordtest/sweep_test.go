package pgcoordtest

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// On a server that processes share, a process drops the databases of
// processes that died (no keeper connection names their prefix), and
// leaves those of live ones and its own.
func TestSweepDropsOnlyTheDatabasesOfDeadProcesses(t *testing.T) {
	s := sharedTestServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const dead, live = "pgct_0dead0de_", "pgct_0a11fe00_"
	for _, db := range []string{dead + "template", dead + "t_x_1", live + "t_y_2"} {
		if err := s.found.CreateDB(db, ""); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.found.DropDB(db) })
	}
	cfg, err := pgx.ParseConfig(s.found.Admin)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["application_name"] = keeperApp + live
	keeper, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer keeper.Close(ctx)

	other := &server{found: s.found, prefix: "pgct_0123abcd_"}
	if err := other.keep(); err != nil {
		t.Fatal(err)
	}
	defer other.keeper.Close(ctx)

	rows, err := keeper.Query(ctx, `SELECT datname FROM pg_database WHERE datname LIKE 'pgct\_%'`)
	if err != nil {
		t.Fatal(err)
	}
	dbs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	for _, db := range []string{dead + "template", dead + "t_x_1"} {
		if slices.Contains(dbs, db) {
			t.Errorf("database %s of a dead process was not dropped", db)
		}
	}
	for _, db := range []string{live + "t_y_2", s.template} {
		if !slices.Contains(dbs, db) {
			t.Errorf("database %s of a live process was dropped", db)
		}
	}
}

// A live test binary keeps its databases on a shared server whose role
// ends idle sessions (idle_session_timeout): its keeper connection is
// idle all along, and must not look dead to the next test binary, which
// would drop them under it.
func TestSweepKeepsALiveProcessUnderIdleSessionTimeout(t *testing.T) {
	s := sharedTestServer(t) // a server for the children to share
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	admin := adminConn(ctx, t, s)
	var version int
	if err := admin.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		t.Fatal(err)
	}
	if version < 140000 {
		t.Skip("skipped: idle_session_timeout came with PostgreSQL 14")
	}
	const role = "pgct_role_idle"
	if _, err := admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN CREATEDB"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, s.found.Admin)
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP OWNED BY "+role+"; DROP ROLE "+role); err != nil {
			t.Error(err)
		}
	})
	if _, err := admin.Exec(ctx, "ALTER ROLE "+role+" SET idle_session_timeout = '300ms'"); err != nil {
		t.Fatal(err)
	}
	env := EnvDatabaseURL + "=" + withRole(t, s.found.Admin, role)
	_, live := startHangingChild(t, env)
	t.Cleanup(func() {
		for _, db := range pgctDatabases(t, s.found.Admin, live["prefix"]) {
			_ = s.found.DropDB(db)
		}
	})
	// Give the timeout time to fire (1 s, for 300 ms): wait until the live
	// child's keeper is gone, or a second has passed with it idle.
	keeper := keeperApp + live["prefix"]
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) {
		var n int
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", keeper).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	runURLHelper(t, "close", env)
	if dbs := pgctDatabases(t, s.found.Admin, live["prefix"]); len(dbs) != 2 {
		t.Fatalf("the live child's databases are %v after the next child started; want its template and its database", dbs)
	}
}
