#!/usr/bin/env bash
# Checks the exported API of every public package against the baseline in
# api/ (apidiff export data of the last release, one file per package:
# api/pgcoord.export for github.com/pgcoord/pgcoord, and the path after it
# with / as _ for the others, e.g. api/pgcoord_contrib_otel.export), and
# fails on an incompatible change: a removed or renamed identifier, a
# changed signature, a removed package. Compatible changes (additions) are
# listed and pass.
#
# The public packages: every package that is not a command and not under
# internal/ in the modules that users import (the root module, pgcoordtest
# and contrib/*; the examples and the test-only pgcoordsql/pqtest are
# left out).
#
# Usage:
#
#	scripts/check-api.sh          # compare the tree with api/
#	scripts/check-api.sh -write   # rewrite api/ from the tree: only when
#	                              # cutting a release (RELEASING.md)
#
# apidiff comes from golang.org/x/exp at the version pinned below, through
# the module proxy.
set -euo pipefail

APIDIFF_VERSION=v0.0.0-20261113113407-e3970619a1a4

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
write=
case "${1:-}" in
"") ;;
-write) write=1 ;;
*) echo "usage: scripts/check-api.sh [-write]" >&2; exit 2 ;;
esac

tmp=$(mktemp -d "${TMPDIR:-/tmp}/pgcoord-api.XXXXXX")
trap 'rm -rf -- "$tmp"' EXIT
GOWORK=off GOFLAGS= GOBIN="$tmp" go install "golang.org/x/exp/cmd/apidiff@$APIDIFF_VERSION"
apidiff=$tmp/apidiff

# The modules whose packages users import, and their public packages.
modules=(. pgcoordtest $(bash scripts/modules.sh | grep '^contrib/'))
declare -A dirOf # import path -> module directory
for m in "${modules[@]}"; do
	while read -r name path; do
		[ "$name" = main ] && continue
		case "$path" in */internal/* | */internal) continue ;; esac
		dirOf[$path]=$m
	done < <(cd "$m" && go list -f '{{.Name}} {{.ImportPath}}' ./...)
done

file_of() { # file_of IMPORT_PATH
	local rest=${1#github.com/pgcoord/}
	echo "api/${rest//\//_}.export"
}

if [ -n "$write" ]; then
	# Export data records the path of each source file: write it from a copy
	# of the tree in the temporary directory, so that the baseline carries
	# no path of the checkout it was written from.
	src=$tmp/src/pgcoord
	mkdir -p "$src"
	git ls-files -co --exclude-standard -z -- . ':!api' | tar --null -T - -cf - | tar -xf - -C "$src"
	rm -f api/*.export
	mkdir -p api
	for p in $(printf '%s\n' "${!dirOf[@]}" | sort); do
		f=$repo/$(file_of "$p")
		(cd "$src/${dirOf[$p]}" && "$apidiff" -w "$f" "$p")
		echo "api: wrote $(file_of "$p") ($p)"
	done
	exit 0
fi

status=0
for p in $(printf '%s\n' "${!dirOf[@]}" | sort); do
	f=$(file_of "$p")
	if [ ! -f "$f" ]; then
		echo "api: $p has no baseline ($f): a package added since the last release; scripts/check-api.sh -write records it when the next one is cut"
		continue
	fi
	report=$(cd "${dirOf[$p]}" && "$apidiff" "$repo/$f" "$p")
	if grep -q '^Incompatible changes:' <<<"$report"; then
		echo "api: $p: incompatible with the baseline $f:"
		sed 's/^/    /' <<<"$report"
		status=1
	elif [ -n "$report" ]; then
		echo "api: $p: compatible changes since the baseline:"
		sed 's/^/    /' <<<"$report"
	fi
done
for f in api/*.export; do
	[ -e "$f" ] || continue
	found=
	for p in "${!dirOf[@]}"; do
		[ "$(file_of "$p")" = "$f" ] && found=1 && break
	done
	if [ -z "$found" ]; then
		echo "api: $f: its package is gone (or became internal or a command), an incompatible change"
		status=1
	fi
done
if [ "$status" -ne 0 ]; then
	echo "api: FAILED: an exported identifier that a release had must keep its meaning; restore it, or, if the break is deliberate, see RELEASING.md" >&2
	exit 1
fi
echo "api: ${#dirOf[@]} public packages compatible with api/"
