#!/usr/bin/env bash
# Checks that the tests RELIABILITY.md names exist and sit beside their
# concept. For each backquoted `TestX` or `TestX/sub` in a table row, it
# finds the file that defines `func TestX(` (the root package first, then
# any other package of the repository: pgcoordsql, contrib/*, pgcoordtest,
# cmd/pgcoord) and, for a subtest, that the file names the subtest ("sub"
# in quotes). It prints section, row, test and file, one line each, and
# fails if a test or subtest is found nowhere.
#
# The rule for where a test lives: each section of RELIABILITY.md is a
# concept, with the files of its tests (concept_files below). A row may
# also cite a test of another concept, as long as the test has a home: a
# row of its own concept's section that names it (such a line is marked
# "see [section]"). The check fails for a test that has no home, and
# says which files its section allows. The soak, the nemesis and the
# contrib packages prove several concepts at once and count anywhere; the
# mutation run's table lists mutants, not concepts, and is not checked for
# homes.
#
# Usage: scripts/check-reliability-tests.sh [-q]   (-q: print failures only)
set -euo pipefail
cd "$(dirname "$0")/.."

quiet=false
if [ "${1:-}" = "-q" ]; then quiet=true; fi

# The definitions: "file<TAB>TestName", the root package's first.
defs=$(
	{
		grep -H -o -E '^func Test[A-Za-z0-9_]+\(' -- *_test.go || true
		grep -r -H -o -E --include='*_test.go' '^func Test[A-Za-z0-9_]+\(' -- */ || true
	} | sed -E 's/^([^:]+):func (Test[A-Za-z0-9_]+)\($/\1\t\2/'
)

# The names: "section<TAB>row<TAB>TestName[/sub]", from table rows only
# (lines that start with "|"), the section being the last heading.
names=$(awk '
	/^#+ / { sub(/^#+ /, ""); section = $0; next }
	/^\|/ {
		if ($0 ~ /^\| *---/) next
		row = $0
		sub(/^\| */, "", row); sub(/ *\|.*$/, "", row)
		if (length(row) > 40) row = substr(row, 1, 37) "..."
		line = $0
		while (match(line, /`Test[A-Za-z0-9_]+(\/[^`]+)?`/)) {
			print section "\t" row "\t" substr(line, RSTART + 1, RLENGTH - 2)
			line = substr(line, RSTART + RLENGTH)
		}
	}
' RELIABILITY.md)

if [ -z "$names" ]; then
	echo "check-reliability-tests: no test names found in RELIABILITY.md's tables" >&2
	exit 1
fi

# concept_files SECTION: the files (globs, from the repository's root)
# whose tests prove the concept of a section; empty for a section that
# names tests across concepts.
concept_files() {
	case "$1" in
	"The promises") echo "fault_test.go fault_*_test.go liveness_test.go limits_test.go pooling_test.go ha_test.go fence*_test.go token_*_test.go term_*_test.go" ;;
	"The lock core on shared backends") echo "lockcore_test.go lockcore_*_test.go backends_test.go lockroute_test.go routing_rule_test.go" ;;
	"Leader election") echo "leader_test.go leader_*_test.go" ;;
	"Semaphores") echo "semaphore_test.go semaphore_*_test.go" ;;
	"Hooks") echo "hooks_test.go hooks_*_test.go" ;;
	"Operators") echo "inspect_test.go cmd/pgcoord/*_test.go" ;;
	"Settings and pools that are not the default") echo "settings_test.go cmd/pgcoord/*_test.go" ;;
	"Transaction-level locks and fences") echo "xact_test.go xact_*_test.go fence_test.go fence_*_test.go pgcoordsql/*_test.go pgcoordsql/*/*_test.go" ;;
	*) echo "" ;;
	esac
}
anywhere="soak_test.go nemesis_test.go contrib/*/*_test.go"

# in_files FILES PATTERNS: whether one of the comma-separated FILES
# matches one of the PATTERNS.
in_files() {
	local f p
	IFS=, read -r -a fs <<<"$1"
	for f in "${fs[@]}"; do
		for p in $2; do
			# shellcheck disable=SC2053 # $p is a glob
			if [[ $f == $p ]]; then return 0; fi
		done
	done
	return 1
}

fail=0
count=0
# rows: "section<TAB>row<TAB>name<TAB>files" of every name that exists.
rows=""
# homes: "name<TAB>section" of every row in the test's own concept.
homes=""
while IFS=$'\t' read -r section row name; do
	count=$((count + 1))
	top=${name%%/*}
	files=$(awk -F'\t' -v t="$top" '$2 == t { print $1 }' <<<"$defs" | paste -sd, -)
	if [ -z "$files" ]; then
		echo "MISSING  [$section] $row: $name: no func $top( in any _test.go file"
		fail=1
		continue
	fi
	if [ "$name" != "$top" ]; then
		sub=${name#*/}
		found=false
		IFS=, read -r -a fs <<<"$files"
		for f in "${fs[@]}"; do
			if grep -q -F "\"$sub\"" -- "$f"; then found=true; fi
		done
		if ! $found; then
			echo "MISSING  [$section] $row: $name: $files does not name the subtest \"$sub\""
			fail=1
			continue
		fi
	fi
	rows+="$section"$'\t'"$row"$'\t'"$name"$'\t'"$files"$'\n'
	pats=$(concept_files "$section")
	if [ -n "$pats" ] && in_files "$files" "$pats $anywhere"; then
		homes+="$top"$'\t'"$section"$'\n'
	fi
done <<<"$names"

while IFS=$'\t' read -r section row name files; do
	[ -n "$section" ] || continue
	top=${name%%/*}
	pats=$(concept_files "$section")
	if [ -z "$pats" ]; then
		mark=""
	elif in_files "$files" "$pats $anywhere"; then
		mark="ok"
	else
		home=$(awk -F'\t' -v t="$top" '$1 == t { print $2; exit }' <<<"$homes")
		if [ -n "$home" ]; then
			mark="see [$home]"
		else
			echo "MISPLACED [$section] $row: $name is in $files, which is not a file of this section ($pats), and no row of its own concept names it"
			fail=1
			continue
		fi
	fi
	if ! $quiet; then
		printf '%-44s %-40s %-58s %s %s\n' "[$section]" "$row" "$name" "$files" "$mark"
	fi
done <<<"$rows"

if [ "$fail" -ne 0 ]; then
	echo "check-reliability-tests: RELIABILITY.md names tests that do not exist or have no row in their concept's section (above)" >&2
	exit 1
fi
echo "check-reliability-tests: all $count test names in RELIABILITY.md's tables exist and have a row in their concept's section"
