#!/usr/bin/env bash
# The GPU-only paths, for a machine with an NVIDIA GPU (CI never needs one):
#   bash scripts/device_check.sh [OUT_DIR]
# 1. the real NVML backend: every GPU's reading and findings (launcher/gpu_health.py);
# 2. ftlaunch doctor with its NCCL smoke test;
# 3. CUDA checkpoint staging (page-locked, asynchronous copies) round trip, timed;
# 4. a 2-rank NCCL job that survives kill -9 of one rank (rank policy, replacement forked from the rank template);
# 5. the coordinator of 16,384 nodes with cores to spare (CI's 2 cores also carry the simulated
#    agents): its heartbeat CPU and a takeover's round, on one core, on two, and on four with
#    three ZeroMQ I/O threads (do more I/O threads spread a takeover's 16,383 writes?), and
#    a takeover whose joins were queued before the successor served (a cluster's order),
#    the same takeover's messages alone (--socket-floor: what ZeroMQ costs a node), and the
#    takeover on 8 cores with and without 6 intake processes (launcher.intake), its joins
#    queued first and spread over 1 s as a silent coordinator's are;
# 6. 16,384 simulated agents end to end (bench_rendezvous.py: formed, ready, the coordinator's
#    CPU, node loss, a dead agent, coordinator failover), the issue's targets at that size.
# STEPS picks some (default all): the lent machines allow 10 minutes a command, so there
#   STEPS="1 2 3 4 5" first, then STEPS=6.
# On the lent machines python3 holds CUDA torch and nothing can be fetched: run
#   bash scripts/device_wheels.sh here first and carry .whl; its wheels (what that python3
#   lacks) are then installed into /tmp/site and that python3 runs everything, no venv.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -d "$HERE/../.whl" ]; then
  ROOT="$(cd "$HERE/.." && pwd)" PY=python3
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$ROOT"/.whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$ROOT"
else
  source "$HERE/setup_env.sh"
fi
OUT="${1:-${OUT:-/tmp/device_check}}"
STEPS=" ${STEPS:-1 2 3 4 5 6} "
step() { [[ "$STEPS" == *" $1 "* ]]; }
WORK="$(mktemp -d)"  # the job's logs and checkpoints: $OUT keeps one file a check (8 come back)
mkdir -p "$OUT"
cd "$ROOT"
"$PY" -c "import launcher, torch, zmq; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'zmq', zmq.zmq_version())"
step 1 && "$PY" - <<'PY' 2>&1 | tee "$OUT/nvml.txt"
from launcher.gpu_health import Nvml, assess
b = Nvml()
print("driver", b.driver_version(), "cuda", b.cuda_version())
for s in b.samples():
    print(s)
    print("  findings:", [str(f) for f in assess(None, s)] or "none")
b.close()
PY
step 2 && { "$PY" -m launcher doctor --json > "$OUT/doctor.json"; echo "doctor exit $?" | tee -a "$OUT/doctor.json"; }
step 3 && "$PY" - <<'PY' 2>&1 | tee "$OUT/cuda_checkpoint.txt"
import os, tempfile, time, torch
from ftlaunch_contract import staging
from trainer_shim.checkpoint import AsyncCheckpointer
state = {f"t{i}": torch.randn(64 << 20, device="cuda") for i in range(16)}  # 4 GiB
root, shm = tempfile.mkdtemp(), staging.create_dir(f"device-check-{os.getpid()}")
ckpt = AsyncCheckpointer(root, staging_dir=str(shm))
for step in (1, 2, 3):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    ckpt.save(step, s=state)
    print(f"save {step}: blocked {time.perf_counter() - t0:.3f}s for 4 GiB from the GPU")
ckpt.wait()
fresh = AsyncCheckpointer(root, staging_dir=str(shm)); out = {}
t0 = time.perf_counter(); step = fresh.load_latest(s=out)
print(f"restore step {step} from {fresh.restored_from}: {time.perf_counter() - t0:.3f}s")
assert all(torch.equal(out[k], state[k].cpu()) for k in state)
print("bitwise equal")
PY
step 4 && TRAIN_FAULT_RANK=1 TRAIN_FAULT_STEP=30 TRAIN_FAULT_KIND=kill timeout 300 \
  "$PY" -m launcher --standalone --nproc-per-node 2 --log-dir "$WORK/logs" \
  scripts/train_gpt.py --shim --cuda --async-ckpt --steps 60 --ckpt-every 10 \
  --ckpt-dir "$WORK/ckpt" \
  2>&1 | grep -v " loss " | tee "$OUT/recovery.txt"
if step 5 && [ "$(nproc)" -ge 8 ]; then
  for shape in 1:1 2:1 4:3; do  # coordinator CPUs : I/O threads
    cpus="${shape%:*}" io="${shape#*:}"
    timeout 300 "$PY" scripts/bench_coordinator.py --nodes 16384 --window 5 \
      --coordinator-cpus "$cpus" --io-threads "$io" 2>&1 \
      | tee "$OUT/coordinator_16384_cpus${cpus}_io$io.txt"
  done
  for intakes in 0 6; do  # the takeover's per-node work over processes: docs/scale.md
    for order in --joins-first "--joins-spread 1" --formation; do
      echo "coordinator CPUs 8, intakes $intakes, $order" \
        | tee -a "$OUT/coordinator_16384_joins_first.txt"
      timeout 200 "$PY" scripts/bench_coordinator.py --nodes 16384 --takeover-only $order \
        --coordinator-cpus 8 --intakes "$intakes" --agent-procs $(( $(nproc) - 8 )) 2>&1 \
        | tee -a "$OUT/coordinator_16384_joins_first.txt"
    done
  done
  echo "socket floor, coordinator CPUs 2" | tee -a "$OUT/coordinator_16384_joins_first.txt"
  timeout 300 "$PY" scripts/bench_coordinator.py --nodes 16384 --socket-floor \
    --coordinator-cpus 2 2>&1 | tee -a "$OUT/coordinator_16384_joins_first.txt"
fi
if step 6 && [ "$(nproc)" -ge 8 ]; then
  timeout 420 "$PY" scripts/bench_rendezvous.py --sizes 16384 --torch-max 0 --intakes 3 \
    --procs $(( $(nproc) - 4 )) --out-json "$OUT/rendezvous_16384.json" 2>&1 \
    | tee "$OUT/rendezvous_16384.txt"
fi
