#!/usr/bin/env bash
# The launchers scripts/bench_goodput.py measures ftlaunch against, each in a venv of its own
# (their pins must not touch ours): NVRx's ft_launcher in /tmp/nvrx-venv, DLRover's
# dlrover-run in /tmp/dlrover-venv and TorchFT (its lighthouse, torchrun beside it) in
# /tmp/torchft-venv (bench_goodput.py's --nvrx, --dlrover and --torchft defaults).
# torch goes in first, pinned, as in setup_env.sh: an unpinned one pulls a CUDA build.
#   bash scripts/install_competitors.sh            # all;  ONLY=dlrover: one
set -euo pipefail
TORCH=${TORCH:-torch==2.13.0}

install() {  # venv, packages...
  local venv=$1; shift
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q "$TORCH"
  "$venv/bin/pip" install -q "$@" numpy
  echo "installed in $venv: $*"
}
wanted() { [ -z "${ONLY:-}" ] || [ "$ONLY" = "$1" ]; }
if wanted nvrx; then
  install /tmp/nvrx-venv "nvidia-resiliency-ext==0.4.1"
fi
if wanted dlrover; then  # dlrover-run imports grpc (its k8s extra) even for --standalone;
  # its master needs protobuf, which no extra of 0.6.1 installs
  install /tmp/dlrover-venv "dlrover[k8s,torch]==0.6.1" protobuf
fi
if wanted torchft; then
  install /tmp/torchft-venv "torchft==0.2.0"
fi
