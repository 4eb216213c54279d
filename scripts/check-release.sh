#!/usr/bin/env bash
# Checks that the working tree can be released as it is: every module of
# the repository served as the version that the go.mod files require of
# each other (v0.1.0, ...) by a module proxy in a temporary directory
# (scripts/release-proxy.go: the files git would commit, zipped as the
# module proxy would), and used the way a user uses a published module,
# with no go.work and no replace directive:
#
#   - release-proxy first fails on a go.mod that requires a module of the
#     repository at a pseudo-version or v0.0.0, or at another version than
#     the others, on any replace directive in a go.mod, and on a go.work
#     that misses a module;
#   - each module, as its zip holds it: `go mod tidy -diff` passes (its
#     go.mod and go.sum are what a build outside the workspace needs; the
#     go.sum lines of the repository's own modules at the release version
#     are left out, since their hash changes until the tag) and `go vet
#     ./...` passes with the versions its own go.mod selects;
#   - each module in a new consumer module: `go get MODULE@VERSION` alone,
#     then a program that uses its API builds with -mod=readonly (nothing
#     else had to be added) and runs without a database; the CLI is
#     installed with `go install .../cmd/pgcoord@VERSION` and must report
#     VERSION; the examples are installed, the test-only module's tests are
#     compiled.
#
# Third-party modules come from the module cache and then the real module
# proxy (GOPROXY), checked against the checksum database as usual; only the
# repository's modules skip it (GONOSUMDB), since they are not published yet.
# A module cache of its own keeps the unpublished zips away from the user's.
#
# Usage: scripts/check-release.sh    (needs the Go module proxy; under a
# minute with warm caches, a few minutes on the first run)
set -euo pipefail

# golang.org/x/mod builds release-proxy: its zip package makes the zips.
XMOD_VERSION=v0.42.0

repo=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/pgcoord-release.XXXXXX")
trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf -- "$tmp"' EXIT
chmod 755 "$tmp"
start=$SECONDS
echo "== release: every module served by a module proxy in $tmp, used as a user would"

realproxy=$(go env GOPROXY)
realcache=$(go env GOMODCACHE)

mkdir "$tmp/tool"
sed '/^\/\/go:build ignore$/d' "$repo/scripts/release-proxy.go" >"$tmp/tool/main.go"
(
	cd "$tmp/tool"
	export GOWORK=off GOFLAGS=-mod=mod
	go mod init example.com/releaseproxy >/dev/null 2>&1
	go mod edit -require="golang.org/x/mod@$XMOD_VERSION"
	go build -o "$tmp/release-proxy" .
)
listing=$("$tmp/release-proxy" -repo "$repo" -out "$tmp/proxy" -src "$tmp/src")
version=$(head -n1 <<<"$listing")
echo "release: version $version, $(($(wc -l <<<"$listing") - 1)) modules"

export GOWORK=off GOTOOLCHAIN=local
export GONOSUMDB=github.com/pgcoord/pgcoord
export GOMODCACHE="$tmp/modcache"
export GOPROXY="file://$tmp/proxy,file://$realcache/cache/download,$realproxy"
# -trimpath: the build cache keys then do not depend on this run's
# temporary directories, so a second run rebuilds nothing.
export GOFLAGS="-mod=mod -modcacherw -trimpath"

fail=0
# tidy_check DIR: go mod tidy -diff, ignoring the repository's own modules'
# go.sum lines at the release version.
tidy_check() {
	local d=$1 diff rest
	diff=$(cd "$d" && go mod tidy -diff 2>&1) && return 0
	rest=$(grep -E '^[-+]' <<<"$diff" | grep -vE '^(\+\+\+|---) ' |
		grep -vE "^\+github\.com/pgcoord/pgcoord(/[^ ]+)? ${version//./\\.}(/go\.mod)? h1:" || true)
	if [ -n "$rest" ] || ! grep -q '^[-+]' <<<"$diff"; then
		echo "$diff"
		return 1
	fi
}

# consumer NAME MODULE: a new module whose main.go is read from stdin gets
# MODULE at the release version and nothing else, then builds and runs.
consumer() {
	local name=$1 mod=$2 d=$tmp/use/$1
	mkdir -p "$d"
	cat >"$d/main.go"
	(
		cd "$d"
		go mod init "example.com/$name" >/dev/null 2>&1
		local out
		out=$(go get "$mod@$version" 2>&1) || { echo "$out"; exit 1; }
		GOFLAGS="-mod=readonly -trimpath" go build -o prog .
		./prog
	)
}

while read -r dir path copy; do
	echo "release: $path ($dir)"
	if ! tidy_check "$tmp/src/$copy"; then
		echo "release: $dir: go mod tidy would change go.mod or go.sum (above) for a build outside the workspace" >&2
		fail=1
	fi
	if ! (cd "$tmp/src/$copy" && go vet ./...); then
		echo "release: $dir: go vet failed outside the workspace, with the versions its go.mod selects" >&2
		fail=1
	fi
done < <(tail -n +2 <<<"$listing")

# What a user writes: each module alone, through a few exported names.
consumer root github.com/pgcoord/pgcoord <<'EOF' || fail=1
package main

import (
	"fmt"
	"os"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/pgcoordsql"
)

func main() {
	k := pgcoord.HashKey("release", "check")
	back, err := pgcoord.ParseKey(k.String())
	if err != nil || back != k {
		fmt.Println("ParseKey(HashKey.String()) =", back, err)
		os.Exit(1)
	}
	var _ = pgcoordsql.XactLock
	fmt.Println("release: pgcoord:", k, pgcoord.ErrLocked)
}
EOF

consumer gocron github.com/pgcoord/pgcoord/contrib/gocron <<'EOF' || fail=1
package main

import (
	"fmt"

	pgcoordgocron "github.com/pgcoord/pgcoord/contrib/gocron"
)

func main() {
	var _ = pgcoordgocron.NewLocker
	var _ = pgcoordgocron.NewElector
	fmt.Println("release: contrib/gocron:", pgcoordgocron.ErrNotLeader, pgcoordgocron.DefaultMinHold)
}
EOF

consumer otel github.com/pgcoord/pgcoord/contrib/otel <<'EOF' || fail=1
package main

import (
	"fmt"
	"os"

	"github.com/pgcoord/pgcoord"
	pgcoordotel "github.com/pgcoord/pgcoord/contrib/otel"
)

func main() {
	if _, err := pgcoordotel.New(); err != nil {
		fmt.Println("New:", err)
		os.Exit(1)
	}
	fmt.Println("release: contrib/otel:", pgcoordotel.ScopeName, pgcoordotel.Result(pgcoord.ErrLocked))
}
EOF

consumer prometheus github.com/pgcoord/pgcoord/contrib/prometheus <<'EOF' || fail=1
package main

import (
	"fmt"
	"os"

	"github.com/pgcoord/pgcoord"
	pgcoordprom "github.com/pgcoord/pgcoord/contrib/prometheus"
)

func main() {
	if _, err := pgcoordprom.New(); err != nil {
		fmt.Println("New:", err)
		os.Exit(1)
	}
	fmt.Println("release: contrib/prometheus:", pgcoordprom.Result(pgcoord.ErrLocked))
}
EOF

consumer pgcoordtest github.com/pgcoord/pgcoord/pgcoordtest <<'EOF' || fail=1
package main

import (
	"fmt"

	"github.com/pgcoord/pgcoord/pgcoordtest"
)

func main() {
	var _ = pgcoordtest.DB
	var _ = pgcoordtest.WithoutContainer()
	fmt.Println("release: pgcoordtest:", pgcoordtest.EnvDatabaseURL, pgcoordtest.DefaultContainerImage)
}
EOF

# The CLI as its README installs it, and the version it reports.
if out=$(GOBIN="$tmp/bin" GOFLAGS="-modcacherw -trimpath" go install "github.com/pgcoord/pgcoord/cmd/pgcoord@$version" 2>&1) &&
	got=$("$tmp/bin/pgcoord" --version 2>&1) && "$tmp/bin/pgcoord" help >/dev/null; then
	if [[ $got != *"$version"* ]]; then
		echo "release: pgcoord --version says \"$got\", not $version" >&2
		fail=1
	else
		echo "release: cmd/pgcoord: go install ...@$version; pgcoord --version: $got"
	fi
else
	echo "$out"
	echo "release: cmd/pgcoord: go install ...@$version, --version or help failed" >&2
	fail=1
fi

# The examples build; the test-only module's tests compile.
for ex in examples/gocron examples/metrics; do
	if ! GOBIN="$tmp/bin" GOFLAGS="-modcacherw -trimpath" go install "github.com/pgcoord/pgcoord/$ex@$version"; then
		echo "release: $ex: go install ...@$version failed" >&2
		fail=1
	fi
done
if ! (
	mkdir -p "$tmp/use/pqtest" && cd "$tmp/use/pqtest" &&
		go mod init example.com/pqtest >/dev/null 2>&1 &&
		go get -t "github.com/pgcoord/pgcoord/pgcoordsql/pqtest@$version" 2>/dev/null &&
		go test -count=1 -run '^$' github.com/pgcoord/pgcoord/pgcoordsql/pqtest >/dev/null
); then
	echo "release: pgcoordsql/pqtest: go get -t ...@$version and its tests' build failed" >&2
	fail=1
fi

if [ "$fail" -ne 0 ]; then
	echo "release: FAILED (above)" >&2
	exit 1
fi
echo "release: every module builds and runs from the proxy as $version ($((SECONDS - start)) s)"
