#!/usr/bin/env bash
# Checks that every Go snippet of the README compiles: a code block that
# follows a line <!-- snippet: PATH --> must equal the lines of PATH (a Go
# file that the tests or vet compile) between "// snippet:start" and
# "// snippet:end", with their common leading indentation removed.
set -euo pipefail
cd "$(dirname "$0")/.."

readme=${1:-README.md}
status=0
checked=0

# snippet_of prints the marked lines of a Go file, dedented.
snippet_of() {
	awk '
		/^[ \t]*\/\/ snippet:end[ \t]*$/ { inside = 0 }
		inside { lines[n++] = $0 }
		/^[ \t]*\/\/ snippet:start[ \t]*$/ { inside = 1 }
		END {
			indent = -1
			for (i = 0; i < n; i++) {
				if (lines[i] ~ /^[ \t]*$/) continue
				match(lines[i], /^\t*/)
				if (indent < 0 || RLENGTH < indent) indent = RLENGTH
			}
			if (indent < 0) indent = 0
			for (i = 0; i < n; i++) {
				if (lines[i] ~ /^[ \t]*$/) print ""
				else print substr(lines[i], indent + 1)
			}
		}' "$1"
}

# block_after prints the code block that follows the marker on line $2.
block_after() {
	awk -v from="$2" '
		NR == from + 1 { if ($0 !~ /^```go[ \t]*$/) { print "NO-CODE-BLOCK"; exit } ; inside = 1; next }
		inside && /^```[ \t]*$/ { exit }
		inside { print }' "$1"
}

while IFS=: read -r line path; do
	path=$(echo "$path" | sed -E 's/^.*<!-- snippet: *([^ ]+) *-->.*$/\1/')
	if [ ! -f "$path" ]; then
		echo "$readme:$line: snippet source $path does not exist"; status=1; continue
	fi
	want=$(snippet_of "$path")
	if [ -z "$want" ]; then
		echo "$readme:$line: $path has no lines between // snippet:start and // snippet:end"; status=1; continue
	fi
	got=$(block_after "$readme" "$line")
	if [ "$got" != "$want" ]; then
		echo "$readme:$line: the code block differs from the snippet in $path:"
		diff <(echo "$want") <(echo "$got") | sed 's/^/    /' || true
		echo "    (copy the lines between // snippet:start and // snippet:end of $path, dedented)"
		status=1
	fi
	checked=$((checked + 1))
done < <(grep -n '<!-- snippet:' "$readme" || true)

if [ "$checked" -eq 0 ]; then
	echo "$readme: no snippets found"; exit 1
fi
[ "$status" -eq 0 ] && echo "$checked README snippets match files that compile"
exit "$status"
