#!/usr/bin/env bash
# Mutation run: applies each mutant of scripts/mutants (a small, realistic
# bug: a flipped comparison, a dropped call, a skipped statement) to a
# clean copy of the committed tree, one at a time, and runs the tests that
# its file names as the proof of the promise it breaks. A mutant is caught
# when those tests fail; the run fails if any mutant survives, if a
# mutant's snippet no longer occurs exactly once in the tree, or if a
# mutated tree does not compile.
#
#	bash scripts/mutants.sh            # every mutant
#	bash scripts/mutants.sh semaphore  # the mutants whose file name matches an extended regex
#
# RACE=1 runs the tests with the race detector (slower; not needed to
# catch these bugs). KEEP=1 keeps the temporary directory with the logs.
set -uo pipefail
cd "$(dirname "$0")/.."
filter=${1:-.}

mapfile -t mutants < <(ls scripts/mutants/*.mutant | grep -E -- "$filter")
if [ "${#mutants[@]}" -eq 0 ]; then
	echo "no mutant matches $filter"; exit 2
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/pgcoord-mutants.XXXXXX")
if [ "${KEEP:-0}" = 1 ]; then
	echo "logs in $tmp"
else
	trap 'rm -rf "$tmp"' EXIT
fi
# The tests start PostgreSQL as the postgres OS user when run as root,
# which must be able to reach the test binary's directory.
chmod 755 "$tmp"

go build -o "$tmp/mutate" scripts/mutate.go || exit 2
mkdir "$tmp/clean"
git archive HEAD | tar -x -C "$tmp/clean" || exit 2
echo "== mutants of $(git rev-parse --short HEAD) matching '$filter': ${#mutants[@]}"
if ! "$tmp/mutate" check "$tmp/clean" "${mutants[@]}"; then
	echo "some snippets no longer occur exactly once: update those mutants"; exit 2
fi

race=()
if [ "${RACE:-0}" = 1 ]; then
	race=(-race)
fi
start=$(date +%s)
caught=0 survived=0 broken=0
summary=()
for m in "${mutants[@]}"; do
	name=$(basename "$m" .mutant)
	run=$("$tmp/mutate" field "$m" run)
	read -r -a flags <<<"$("$tmp/mutate" field "$m" flags)"
	timeout=$("$tmp/mutate" field "$m" timeout)
	timeout=${timeout:-10m}
	tree="$tmp/tree"
	rm -rf "$tree"
	cp -a "$tmp/clean" "$tree"
	"$tmp/mutate" apply "$m" "$tree" || { broken=$((broken + 1)); summary+=("BROKEN   $name (does not apply)"); continue; }
	log="$tmp/$name.log"
	t0=$(date +%s)
	if ! (cd "$tree" && go test "${race[@]}" -c -o "$tree/pgcoord.test" . >"$log" 2>&1); then
		broken=$((broken + 1))
		summary+=("BROKEN   $name (does not compile; see $log)")
		echo "BROKEN   $name: does not compile"; sed -n 1,20p "$log"
		continue
	fi
	(cd "$tree" && ./pgcoord.test -test.count=1 -test.timeout="$timeout" -test.run "$run" "${flags[@]}" >>"$log" 2>&1)
	rc=$?
	took=$(($(date +%s) - t0))
	failed=$(grep -E '^\s*--- FAIL' "$log" | sed -E 's/^\s*--- FAIL: ([^ ]+).*/\1/' | sort -u | tr '\n' ' ')
	if grep -q '^panic: test timed out' "$log"; then
		failed="$failed(timed out)"
	fi
	if [ "$rc" -ne 0 ]; then
		caught=$((caught + 1))
		line="CAUGHT   $name (${took}s) by: ${failed:-exit status $rc}"
	else
		survived=$((survived + 1))
		line="SURVIVED $name (${took}s): $run ${flags[*]} passed"
	fi
	summary+=("$line")
	echo "$line"
done
rm -rf "$tmp/tree"
echo "== ${#mutants[@]} mutants: $caught caught, $survived survived, $broken broken, in $(($(date +%s) - start)) s"
printf '%s\n' "${summary[@]}"
[ "$survived" -eq 0 ] && [ "$broken" -eq 0 ]
