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
	DB(t) // the server
	s, err := sharedServer(shared.cfg)
	if err != nil {
		t.Fatal(err)
	}
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
