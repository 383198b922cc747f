#!/usr/bin/env bash
# The wheels scripts/device_check.sh needs on a lent GPU machine, whose python3 (3.12, with
# CUDA torch, click, psutil, rich, msgpack, pyyaml, nvidia-ml-py) lacks pyzmq and can fetch
# nothing: downloaded here into .whl (git-ignored), to be carried there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$ROOT/.whl" "pyzmq==27.3.0"
ls "$ROOT/.whl"
