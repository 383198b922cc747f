#!/usr/bin/env bash
# Set up (see setup_env.sh) and run the whole test suite plus the linter.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
ruff check launcher trainer_shim scripts tests
"$PY" -m pytest -q "$@"
