#!/usr/bin/env bash
# Checks that CONTRIBUTING.md, the map of the code, names every source
# file of the root package and of internal/core (each non-test .go file,
# as `name.go` or `internal/core/name.go` in backquotes) and every
# top-level directory that holds code (as `dir/`), and that every file or
# directory it names in backquotes exists; and that
# every non-test Go file of the repository is at most 700 lines long and
# opens with a comment (what it is for) before its first declaration.
set -euo pipefail
cd "$(dirname "$0")/.."

map=CONTRIBUTING.md
status=0
for f in $( (git ls-files -- '*.go' | grep -v /; git ls-files -- 'internal/core/*.go') | grep -v '_test\.go$'); do
	if ! grep -qF "\`$f\`" "$map"; then
		echo "$map does not name $f: add it to the table of its part"
		status=1
	fi
done
for d in $(git ls-files | grep / | cut -d/ -f1 | sort -u); do
	case "$d" in
	.*) continue ;; # .ci and the like
	esac
	if ! grep -qF "\`$d/" "$map"; then
		echo "$map does not name the directory $d/: add it to the table of the other packages"
		status=1
	fi
done
# Every `name.go` or `dir/...` in backquotes is a path that exists.
for p in $(grep -oE '`[A-Za-z0-9_./-]+(\.go|/)`' "$map" | tr -d '`' | sort -u); do
	case "$p" in
	*\**) continue ;;
	esac
	if [ ! -e "$p" ]; then
		echo "$map names $p, which does not exist"
		status=1
	fi
done
for f in $(git ls-files -- '*.go' | grep -v '_test\.go$'); do
	n=$(wc -l <"$f")
	if [ "$n" -gt 700 ]; then
		echo "$f has $n lines, more than 700: move a part of it to a file of its own"
		status=1
	fi
	if ! awk '/^(func|type|var|const) /{ exit !c } /^\/\/ [A-Za-z]/{ c = 1 } END { exit !c }' "$f"; then
		echo "$f does not open with a comment on what it is for before its first declaration"
		status=1
	fi
done
if [ "$status" -eq 0 ]; then
	echo "check-map: $map names every source file of the root package and of internal/core, and every directory; every Go source file opens with what it is for, in at most 700 lines"
fi
exit $status
