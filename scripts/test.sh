#!/usr/bin/env bash
# Set up (see setup_env.sh) and run the whole test suite plus the linter.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
# tests/test_netns.py builds throwaway "machines" from network namespaces: as root, install
# ip and iptables if missing. Never fatal: without them those tests skip with a reason.
if [ "$(id -u)" = 0 ] && ! { command -v ip && command -v iptables; } >/dev/null 2>&1; then
  { command -v apt-get >/dev/null 2>&1 && apt-get update -qq \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
         iproute2 iptables >/dev/null; } \
    || echo "test.sh: could not install iproute2 and iptables; netns tests will skip" >&2
fi
ruff check ftlaunch_contract launcher trainer_shim scripts tests
mypy  # configured in pyproject.toml: strict on the contract and the pure decisions
"$PY" -m pytest -q --durations=12 "$@"  # the slowest tests: the suite must stay under 10 min
