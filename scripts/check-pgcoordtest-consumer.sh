#!/usr/bin/env bash
# Checks pgcoordtest as a user meets it: a module outside the repository
# that requires github.com/pgcoord/pgcoord/pgcoordtest (replaced by this
# checkout) runs a test that gets a migrated database from pgcoordtest.DB,
# holds a lock, and sees it lost through TerminateBackends, with no
# PostgreSQL variable set (so the server comes from the local binaries of
# Debian's postgresql package): once as root, once as an unprivileged OS
# user (pgctuser, created if missing; its Go caches persist in its home
# so later runs are fast). The test uses FailIfUnavailable, so a skip
# cannot pass for a success.
#
# It also checks that a consumer of the root module alone does not get
# testcontainers-go or any container module in `go list -m all`, while a
# consumer of pgcoordtest does.
#
# Usage: scripts/check-pgcoordtest-consumer.sh    (needs the Go module proxy)
set -euo pipefail
echo "== pgcoordtest in a module outside the repository, as root and as another user"

repo=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d "${TMPDIR:-/tmp}/pgcoordtest-consumer.XXXXXX")
trap 'rm -rf -- "$dir"' EXIT
chmod 755 "$dir"
case "$dir" in "$repo"/*)
	echo "consumer: $dir is inside the repository" >&2; exit 1 ;;
esac

# The consumer's test: the one line, a lock, and its loss.
mkdir -p "$dir/app"
cat >"$dir/app/app_test.go" <<'EOF'
package app

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/pgcoordtest"
)

func TestConsumerGetsAMigratedDatabase(t *testing.T) {
	dsn := pgcoordtest.DB(t, pgcoordtest.FailIfUnavailable())
	pool := pgcoordtest.Pool(t, dsn)
	var version int
	if err := pool.QueryRow(context.Background(), "SELECT max(version) FROM pgcoord.schema_version").Scan(&version); err != nil {
		t.Fatalf("not migrated: %v", err)
	}
	c := pgcoordtest.Client(t, dsn, pgcoord.WithHeartbeat(100*time.Millisecond), pgcoord.WithLossDeadline(time.Second))
	l, err := c.Lock(context.Background(), pgcoord.HashKey("consumer"))
	if err != nil {
		t.Fatal(err)
	}
	pgcoordtest.TerminateBackends(t, c)
	select {
	case <-l.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("lock not lost within 10 s")
	}
	if !errors.Is(l.Err(), pgcoord.ErrLockLost) {
		t.Fatalf("lock ended with %v", l.Err())
	}
	t.Logf("schema version %d; lock lost after TerminateBackends", version)
}
EOF
echo 'package app' >"$dir/app/app.go"
(
	cd "$dir/app"
	go mod init example.com/app >/dev/null 2>&1
	go mod edit -require=github.com/pgcoord/pgcoord/pgcoordtest@v0.0.0 -require=github.com/pgcoord/pgcoord@v0.0.0 \
		-replace="github.com/pgcoord/pgcoord/pgcoordtest=$repo/pgcoordtest" -replace="github.com/pgcoord/pgcoord=$repo"
	go mod tidy >/dev/null 2>&1 || go mod tidy
)

# A clean environment: no PGCOORDTEST_*, PGTEST_*, DATABASE_URL or CI, and
# a PATH of the system's folders and Go's alone, so that the server
# binaries are found where Debian's postgresql package puts them
# (/usr/lib/postgresql/*/bin), not through links someone made.
path="$(dirname "$(command -v go)"):/usr/sbin:/usr/bin:/sbin:/bin"
if PATH=$path command -v initdb >/dev/null; then
	echo "consumer: initdb is on $path; the server binaries' search is not checked" >&2
fi
base_env=(PATH="$path" GOPROXY="$(go env GOPROXY)" GOFLAGS=-mod=mod GOTOOLCHAIN=local)
run_test() { # run_test LABEL [runuser -u USER --] ; runs in $dir/app
	local label=$1
	shift
	local start=$SECONDS out
	if ! out=$(cd "$dir/app" && "$@" go test -count=1 -v -timeout 5m . 2>&1); then
		echo "$out"
		echo "consumer: the test failed as $label" >&2
		return 1
	fi
	if ! grep -q -- '--- PASS: TestConsumerGetsAMigratedDatabase' <<<"$out"; then
		echo "$out"
		echo "consumer: the test did not pass as $label" >&2
		return 1
	fi
	echo "consumer: as $label: $(grep -m1 'schema version' <<<"$out" | sed 's/^ *//') ($((SECONDS - start)) s)"
}

if [ "$(id -u)" -eq 0 ]; then
	run_test root env -i HOME=/root GOPATH="$(go env GOPATH)" GOCACHE="$(go env GOCACHE)" "${base_env[@]}"
	user=pgctuser
	if ! id "$user" >/dev/null 2>&1; then
		useradd -m "$user"
	fi
	home=$(getent passwd "$user" | cut -d: -f6)
	chown -R "$user" "$dir"
	run_test "$user" runuser -u "$user" -- env -i HOME="$home" GOPATH="$home/go" GOCACHE="$home/.cache/go-build" "${base_env[@]}"
else
	run_test "$(id -un) (not root)" env -i HOME="$HOME" GOPATH="$(go env GOPATH)" GOCACHE="$(go env GOCACHE)" "${base_env[@]}"
fi

# The root module alone brings no container module into a user's graph;
# pgcoordtest does.
mkdir -p "$dir/rootonly"
printf 'package main\n\nimport _ "github.com/pgcoord/pgcoord"\n\nfunc main() {}\n' >"$dir/rootonly/main.go"
rootonly=$(
	cd "$dir/rootonly"
	go mod init example.com/rootonly >/dev/null 2>&1
	go mod edit -require=github.com/pgcoord/pgcoord@v0.0.0 -replace="github.com/pgcoord/pgcoord=$repo"
	go mod tidy >/dev/null 2>&1 || go mod tidy
	go list -m all
)
withtest=$(cd "$dir/app" && go list -m all)
container='testcontainers|docker|moby|containerd'
if grep -Ei "$container" <<<"$rootonly"; then
	echo "consumer: a container module is in the graph of a consumer of the root module alone" >&2
	exit 1
fi
if ! grep -q 'github.com/testcontainers/testcontainers-go ' <<<"$withtest"; then
	echo "consumer: testcontainers-go is not in the graph of a consumer of pgcoordtest; the check above proves nothing" >&2
	exit 1
fi
echo "consumer: go list -m all: $(wc -l <<<"$rootonly") modules for the root module alone, none a container module;" \
	"$(wc -l <<<"$withtest") with pgcoordtest, $(grep -cEi "$container" <<<"$withtest") of them container modules"
