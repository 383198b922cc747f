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
mypy > "$ROOT/.mypy.out" 2>&1 &  # pyproject.toml: strict on the contract and the decisions;
MYPY=$!                          # beside the tests, which leave a core idle part of the time
# Two workers (pytest-xdist; a file's tests stay on one, tests/conftest.py): most of an
# end-to-end test is waiting on real processes, so two at once fill the two cores without
# starving either (pytest here: 11.5 min on one, 8-9.5 on two). `-n 0`: one by one.
# --durations: the slowest tests; the suite must stay under 10 min.
status=0
"$PY" -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=12 "$@" || status=$?
wait "$MYPY" || { cat "$ROOT/.mypy.out"; exit 1; }
tail -1 "$ROOT/.mypy.out"
exit "$status"
