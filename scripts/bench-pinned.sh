#!/usr/bin/env bash
# Runs the root package's benchmarks against a throwaway PostgreSQL, with the
# server and the benchmark pinned to different CPUs.
#
# Usage: scripts/bench-pinned.sh [BENCH_REGEXP]     (default: all, ".")
#
#   COUNT=6            -count passed to go test
#   BENCHTIME=         -benchtime passed to go test, if set (default: go
#                      test's own, 1s)
#   ROUNDS=1           run the whole pattern this many times in turn, each
#                      time with -count COUNT: with ROUNDS=8 COUNT=1, every
#                      benchmark runs once per round, next to its floor, so a
#                      slow spell of the machine hits both alike
#   OUT=bench.txt      where the go test output goes (relative to the
#                      current directory); printed through benchstat if
#                      benchstat is on PATH
#   SERVER_CPU=1       CPU of PostgreSQL and all its backends
#   CLIENT_CPU=0       CPU of go test and the benchmark binary
#   PGTEST_PG_BINDIR   directory of initdb and pg_ctl (default: PATH)
#   BASELINE=REV       also build the benchmarks of git revision REV and run
#                      them in every round just before the current tree's,
#                      against the same server; their output goes to OUT
#                      with .base before its extension, and benchstat (if on
#                      PATH) compares the two
#
# Why pin: on a 2-core machine the scheduler puts the benchmark and the
# backend it talks to on the same CPU in one run and on different CPUs in the
# next, and moves them around mid-run. A loopback round trip differs 4-7x
# between those placements, which swamps what the benchmarks try to measure.
# With the server on one CPU and the client on the other, every round trip
# crosses CPUs the same way, so runs compare with each other and the ratio of
# a pgcoord benchmark to its raw pgx floor means something. It also means the
# benchmark binary runs with GOMAXPROCS=1.
#
# The cluster lives in a temporary directory, listens on 127.0.0.1 on a free
# port with fsync=off and max_connections=200, and is stopped and removed on
# exit, whether the benchmarks pass, fail or are interrupted. As root, the
# server runs as OS user postgres (PostgreSQL refuses to run as root).
set -euo pipefail

pattern=${1:-.}
count=${COUNT:-6}
rounds=${ROUNDS:-1}
out=${OUT:-bench.txt}
server_cpu=${SERVER_CPU:-1}
client_cpu=${CLIENT_CPU:-0}
baseline=${BASELINE:-}
[[ $out == /* ]] || out=$PWD/$out
base_out=${out%.*}.base.${out##*.}
[[ $out == *.* ]] || base_out=$out.base
repo=$(cd "$(dirname "$0")/.." && pwd)

die() {
	echo "bench-pinned: $*" >&2
	exit 1
}

# Resolve the tools to absolute paths: runuser may not keep PATH.
if [[ -n ${PGTEST_PG_BINDIR:-} ]]; then
	initdb=$PGTEST_PG_BINDIR/initdb
	pg_ctl=$PGTEST_PG_BINDIR/pg_ctl
else
	initdb=$(command -v initdb) || die "initdb not on PATH (set PGTEST_PG_BINDIR)"
	pg_ctl=$(command -v pg_ctl) || die "pg_ctl not on PATH (set PGTEST_PG_BINDIR)"
fi
[[ -x $initdb && -x $pg_ctl ]] || die "no initdb and pg_ctl in ${PGTEST_PG_BINDIR:-PATH}"
taskset=$(command -v taskset) || die "taskset not on PATH (Debian: apt-get install util-linux)"
command -v go >/dev/null || die "go not on PATH"
for cpu in "$server_cpu" "$client_cpu"; do
	"$taskset" -c "$cpu" true 2>/dev/null || die "cannot pin to CPU $cpu (set SERVER_CPU and CLIENT_CPU to two CPUs of this machine)"
done
[[ $server_cpu != "$client_cpu" ]] || die "SERVER_CPU and CLIENT_CPU are both $server_cpu"

as_pg=()
if [[ $EUID -eq 0 ]]; then
	as_pg=(runuser -u postgres --)
fi

dir=$(mktemp -d "${TMPDIR:-/tmp}/pgcoord-bench.XXXXXX")
data=$dir/data
log=$dir/postgres.log

cleanup() {
	local status=$?
	trap - EXIT INT TERM
	if [[ -f $data/postmaster.pid ]]; then
		if ! "${as_pg[@]}" "$pg_ctl" -D "$data" -m fast -w -t 30 stop >/dev/null 2>&1 &&
			! "${as_pg[@]}" "$pg_ctl" -D "$data" -m immediate -w -t 30 stop >/dev/null 2>&1; then
			local pid
			pid=$(head -n 1 "$data/postmaster.pid" 2>/dev/null) || pid=
			if [[ -n $pid ]]; then
				echo "bench-pinned: PostgreSQL did not stop; killing postmaster $pid" >&2
				kill -KILL "$pid" 2>/dev/null || true
			fi
		fi
	fi
	if [[ -d $dir/base ]]; then
		git -C "$repo" worktree remove --force "$dir/base" >/dev/null 2>&1 || true
	fi
	rm -rf -- "$dir"
	exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ ${#as_pg[@]} -gt 0 ]]; then
	chown postgres: "$dir"
fi
"${as_pg[@]}" "$initdb" -D "$data" -U postgres --auth=trust -E UTF8 --locale=C --no-sync >"$dir/initdb.log" 2>&1 ||
	{
		cat "$dir/initdb.log" >&2
		die "initdb failed"
	}
cat >>"$data/postgresql.conf" <<EOF

# bench-pinned.sh
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir'
fsync = off
max_connections = 200
EOF

# port_in_use succeeds if something accepts connections on 127.0.0.1:$1.
port_in_use() {
	(exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# Pick a random port that looks free; if another process takes it before the
# server binds it, try the next one.
port=
for _ in 1 2 3 4 5; do
	candidate=$((20000 + RANDOM % 40000))
	port_in_use "$candidate" && continue
	# taskset pins pg_ctl, and the postmaster and every backend it forks
	# inherit the CPU mask.
	if "${as_pg[@]}" "$taskset" -c "$server_cpu" "$pg_ctl" -D "$data" -l "$log" -w -t 60 \
		-o "-p $candidate" start >/dev/null; then
		port=$candidate
		break
	fi
	grep -q 'could not bind\|Address already in use' "$log" 2>/dev/null || {
		cat "$log" >&2
		die "PostgreSQL did not start"
	}
done
[[ -n $port ]] || {
	cat "$log" >&2
	die "no free port found for PostgreSQL"
}

export PGTEST_DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable"
version=$("${as_pg[@]}" "$pg_ctl" --version)
echo "bench-pinned: $version on 127.0.0.1:$port, CPU $server_cpu; go test on CPU $client_cpu; output in $out" >&2

cd "$repo"
go test -c -o "$dir/pgcoord.test" . || die "go test -c failed"
if [[ -n $baseline ]]; then
	git worktree add --detach "$dir/base" "$baseline" >/dev/null || die "cannot check out $baseline"
	(cd "$dir/base" && go test -c -o "$dir/base.test" .) || die "go test -c failed for $baseline"
	: >"$base_out"
	echo "bench-pinned: baseline $baseline ($(git rev-parse --short "$baseline")) in $base_out" >&2
fi
: >"$out"

# bench runs one test binary's benchmarks once, appending to a file.
bench() {
	"$taskset" -c "$client_cpu" "$1" -test.run '^$' -test.bench "$pattern" -test.benchmem \
		-test.count "$count" ${BENCHTIME:+-test.benchtime "$BENCHTIME"} 2>&1 | tee -a "$2"
	[[ ${PIPESTATUS[0]} -eq 0 ]] || die "benchmarks of $1 failed in round $round"
}

for ((round = 1; round <= rounds; round++)); do
	if [[ -n $baseline ]]; then
		bench "$dir/base.test" "$base_out"
	fi
	bench "$dir/pgcoord.test" "$out"
done

if command -v benchstat >/dev/null; then
	echo
	if [[ -n $baseline ]]; then
		benchstat base="$base_out" head="$out"
	else
		benchstat "$out"
	fi
fi
