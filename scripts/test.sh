#!/usr/bin/env bash
# Set up (see setup_env.sh) and run the whole test suite plus the linter.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
# As root, install what the tests build real infrastructure from, if missing: ip and iptables
# (tests/test_netns.py: "machines" from network namespaces) and SLURM (tests/test_slurm.py:
# slurmctld and several slurmd). Never fatal: without them those tests skip with a reason.
if [ "$(id -u)" = 0 ] && ! { command -v ip && command -v iptables && command -v slurmctld; } \
    >/dev/null 2>&1; then
  { command -v apt-get >/dev/null 2>&1 && apt-get update -qq \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
         iproute2 iptables slurm-wlm >/dev/null; } \
    || echo "test.sh: could not install iproute2, iptables and slurm-wlm; netns and SLURM" \
            "tests will skip" >&2
fi
ruff check ftlaunch_contract launcher trainer_shim scripts tests
mypy  # configured in pyproject.toml: strict on the contract and the pure decisions
"$PY" -m pytest -q --durations=12 "$@"  # the slowest tests: the suite must stay under 10 min
