package pgcoordtest

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// EnvRequireDocker, when true, makes TestContainerServer fail instead of
// skip where no Docker engine answers: for a CI runner that has one.
const envRequireDocker = "PGCOORDTEST_REQUIRE_DOCKER"

// The container step starts PostgreSQL through testcontainers-go's postgres
// module when a Docker engine answers, and DB's databases come from it as
// from any other server: a copy of the migrated template. Where no engine
// answers, the test skips and says why.
func TestContainerServer(t *testing.T) {
	if err := pingDocker(); err != nil {
		if require, _ := strconv.ParseBool(os.Getenv(envRequireDocker)); require {
			t.Fatalf("%s is set, and the container step cannot run: %v", envRequireDocker, err)
		}
		t.Skipf("skipped: the container step needs a Docker engine, and %v (set %s=true to fail instead)", err, envRequireDocker)
	}
	t.Setenv(EnvDatabaseURL, "")
	t.Setenv(EnvProjectDatabaseURL, "")
	// An empty bin folder: no local binaries, so the container step runs.
	s, err := newServer(serverConfig{binDir: t.TempDir(), container: true, image: DefaultContainerImage})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := s.close(); err != nil {
			t.Errorf("stop the container: %v", err)
		}
	}()
	if s.found.Source != "container" {
		t.Fatalf("server from %q, want the container", s.found.Source)
	}
	name := s.prefix + "container_test"
	if err := s.found.CreateDB(name, s.template); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.found.ConnString(name))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var version int
	if err := conn.QueryRow(ctx, "SELECT max(version) FROM pgcoord.schema_version").Scan(&version); err != nil {
		t.Fatalf("the database is not migrated: %v", err)
	}
	t.Logf("container database migrated to version %d", version)
}
