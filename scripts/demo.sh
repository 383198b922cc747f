#!/usr/bin/env bash
# Set up (see setup_env.sh) and run the demo: 4 ranks, one killed with SIGKILL, job recovers.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec "$PY" "$ROOT/scripts/demo.py"
