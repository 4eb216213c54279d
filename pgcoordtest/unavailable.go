package pgcoordtest

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"testing"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// howToEnable says how to provide each kind of server, in the order DB
// tries them.
const howToEnable = `Provide one of them:
  - a server: set ` + EnvDatabaseURL + ` (or ` + EnvProjectDatabaseURL + `) to a connection string whose role may create
    databases, e.g. postgres://postgres:pw@localhost:5432/postgres?sslmode=disable;
  - local PostgreSQL server binaries: apt-get install postgresql (Debian, Ubuntu),
    brew install postgresql@17 (macOS), or point ` + EnvBinDir + ` (or WithBinDir) at the folder
    holding initdb, postgres and pg_ctl; as root they run as OS user postgres (PGTEST_OS_USER);
  - a Docker engine that testcontainers-go can reach (a running docker daemon, or DOCKER_HOST)
    to start ` + DefaultContainerImage + ` (WithContainerImage chooses another).`

// unavailable ends t because err left it without a server: it skips t
// when nothing at all was found, unless fail is set or CI is true, and
// fails it otherwise.
func unavailable(t testing.TB, err error, fail bool) {
	t.Helper()
	var none *pgtest.NoServerError
	if !errors.As(err, &none) || !none.Absent() {
		t.Fatalf("pgcoordtest: %v", err)
	}
	msg := fmt.Sprintf("pgcoordtest: %v\n%s", err, howToEnable)
	switch {
	case fail:
		t.Fatalf("%s\n(FailIfUnavailable: failing instead of skipping)", msg)
	case underCI():
		t.Fatalf("%s\n(CI=%s: a test that cannot run fails instead of skipping)", msg, os.Getenv("CI"))
	}
	t.Skip(msg)
}

// underCI reports whether the environment variable CI is true.
func underCI() bool {
	ci, _ := strconv.ParseBool(os.Getenv("CI"))
	return ci
}
