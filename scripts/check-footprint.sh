#!/usr/bin/env bash
# Checks what depending on pgcoord costs a user: a consumer module that
# imports pgcoord and pgxpool must list at most 4 modules more in
# `go list -m all` than the same program with pgx alone, none of them a
# container, Docker or OpenTelemetry module; and the module's zip (what
# the module proxy serves: the tracked files of the root module, without
# nested modules) must stay under 1 MB.
#
# Usage: scripts/check-footprint.sh    (needs the Go module proxy)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d "${TMPDIR:-/tmp}/pgcoord-footprint.XXXXXX")
trap 'rm -rf -- "$dir"' EXIT
pgx=$(cd "$repo" && go list -m -f '{{.Version}}' github.com/jackc/pgx/v5)

consumer() { # consumer NAME IMPORTS...
	local d=$dir/$1
	shift
	mkdir -p "$d"
	{
		echo "package main"
		echo
		echo "import ("
		for imp in "$@"; do echo "	_ \"$imp\""; done
		echo ")"
		echo
		echo "func main() {}"
	} >"$d/main.go"
	(
		cd "$d"
		go mod init example.com/consumer >/dev/null 2>&1
		go mod edit -require="github.com/jackc/pgx/v5@$pgx"
		if [[ " $* " == *" github.com/pgcoord/pgcoord "* ]]; then
			go mod edit -require=github.com/pgcoord/pgcoord@v0.0.0 -replace="github.com/pgcoord/pgcoord=$repo"
		fi
		go mod tidy >/dev/null 2>&1 || go mod tidy
		go build ./...
		go list -m all
	)
}

alone=$(consumer alone github.com/jackc/pgx/v5/pgxpool)
with=$(consumer with github.com/jackc/pgx/v5/pgxpool github.com/pgcoord/pgcoord)
n_alone=$(wc -l <<<"$alone")
n_with=$(wc -l <<<"$with")
echo "footprint: go list -m all: $n_alone modules with pgx alone, $n_with with pgcoord"
extra=$(comm -13 <(awk '{print $1}' <<<"$alone" | sort) <(awk '{print $1}' <<<"$with" | sort))
echo "footprint: added: $(tr '\n' ' ' <<<"$extra")"
status=0
if ((n_with - n_alone > 4)); then
	echo "footprint: pgcoord adds $((n_with - n_alone)) modules, more than 4" >&2
	status=1
fi
if grep -Ei 'testcontainers|docker|moby|opentelemetry' <<<"$with"; then
	echo "footprint: a container, Docker or OpenTelemetry module is in a user's build" >&2
	status=1
fi

# The module zip holds the root module's tracked files, without nested
# modules (directories with a go.mod of their own) and their files.
cd "$repo"
nested=$(git ls-files '*/go.mod' | xargs -r -n1 dirname)
files=$(git ls-files | while read -r f; do
	skip=
	for n in $nested; do [[ $f == "$n"/* ]] && skip=1 && break; done
	[[ -z $skip ]] && echo "$f"
done)
git archive --format=zip -o "$dir/module.zip" HEAD -- $files
size=$(stat -c %s "$dir/module.zip")
echo "footprint: module zip $size bytes"
if ((size >= 1000000)); then
	echo "footprint: module zip is $size bytes, 1 MB or more" >&2
	status=1
fi
exit $status
