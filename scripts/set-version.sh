#!/usr/bin/env bash
# Sets the version at which the repository's modules require each other:
# every requirement of one module of the repository by another, in every
# go.mod, and the replacements of go.work that resolve that version to the
# checkout until it is tagged. All modules are released together at one
# version (RELEASING.md), so there is one version to set.
#
# Usage: scripts/set-version.sh vX.Y.Z
set -euo pipefail
cd "$(dirname "$0")/.."

version=${1:-}
if ! [[ $version =~ ^v(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$ ]] || [ "$version" = v0.0.0 ]; then
	echo "usage: scripts/set-version.sh vX.Y.Z (a release version, above v0.0.0)" >&2
	exit 2
fi
if [ "${BASH_REMATCH[1]}" -ge 2 ]; then
	echo "set-version: $version: a major version 2 or above changes every module path (/v${BASH_REMATCH[1]}); this script does not" >&2
	exit 2
fi

dirs=(. $(bash scripts/modules.sh))
declare -A paths # module path -> directory
for d in "${dirs[@]}"; do
	paths[$(awk '$1 == "module" { print $2; exit }' "$d/go.mod")]=$d
done

# versions_of FILE PATH: the versions at which FILE (a go.mod or go.work)
# names PATH on a require or replace line.
versions_of() {
	sed -E 's#//.*##' "$1" | awk -v p="$2" '{
		i = ($1 == "require" || $1 == "replace") ? 2 : 1
		if ($i == p && $(i + 1) ~ /^v/) print $(i + 1)
	}'
}

for d in "${dirs[@]}"; do
	args=()
	for p in "${!paths[@]}"; do
		[ -n "$(versions_of "$d/go.mod" "$p")" ] && args+=("-require=$p@$version")
	done
	if [ "${#args[@]}" -gt 0 ]; then
		(cd "$d" && GOWORK=off go mod edit "${args[@]}")
		echo "set-version: $d/go.mod: ${#args[@]} requirement(s) of the repository's modules at $version"
	fi
done

# go.work: its replacements (of the repository's modules only, which
# scripts/check-release.sh checks) make way for the new version's, in the
# order of the module directories.
{
	awk '/^replace \($/ { block = 1; next } block && /^\)$/ { block = 0; next } block || /^replace / { next } { print }' go.work |
		cat -s | sed -e :a -e '/^\n*$/{$d;N;ba' -e '}'
	echo
	echo "replace ("
	for d in "${dirs[@]}"; do
		for p in "${!paths[@]}"; do
			[ "${paths[$p]}" = "$d" ] || continue
			[ "$d" = . ] && target=./ || target=./$d
			printf '\t%s %s => %s\n' "$p" "$version" "$target"
		done
	done
	echo ")"
} >go.work.new
mv go.work.new go.work
go work edit -fmt
echo "set-version: go.work: the repository's modules at $version resolve to the checkout"
