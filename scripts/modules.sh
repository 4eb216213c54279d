#!/usr/bin/env bash
# Prints the directories of the repository's modules other than the root
# (integrations, the examples that use them, test-only modules), one per
# line. Each requires the others at the version being released; go.work
# (which uses every one of them) resolves that version to the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
# api/go.mod only keeps the API baseline (scripts/check-api.sh) out of the
# root module's zip: no module.
git ls-files --cached --others --exclude-standard '*/go.mod' | xargs -r -n1 dirname | grep -vx api | sort
