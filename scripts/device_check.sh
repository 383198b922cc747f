#!/usr/bin/env bash
# The GPU-only paths, for a machine with an NVIDIA GPU (CI never needs one):
#   bash scripts/device_check.sh [OUT_DIR]
# 1. the real NVML backend: every GPU's reading and findings (launcher/gpu_health.py);
# 2. ftlaunch doctor with its NCCL smoke test;
# 3. CUDA checkpoint staging (page-locked, asynchronous copies) round trip, timed;
# 4. a 2-rank NCCL job that survives kill -9 of one rank (rank policy, replacement forked from the rank template);
# 5. the coordinator of 16,384 nodes with cores to spare (CI's 2 cores also carry the simulated
#    agents): its heartbeat CPU and a takeover's round, on one core, on two, and on four with
#    three ZeroMQ I/O threads (do more I/O threads spread a takeover's 16,383 writes?).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
OUT="${1:-${OUT:-/tmp/device_check}}"
mkdir -p "$OUT"
cd "$ROOT"
"$PY" - <<'PY' 2>&1 | tee "$OUT/nvml.txt"
from launcher.gpu_health import Nvml, assess
b = Nvml()
print("driver", b.driver_version(), "cuda", b.cuda_version())
for s in b.samples():
    print(s)
    print("  findings:", [str(f) for f in assess(None, s)] or "none")
b.close()
PY
"$PY" -m launcher doctor --json > "$OUT/doctor.json"; echo "doctor exit $?" | tee -a "$OUT/doctor.json"
"$PY" - <<'PY' 2>&1 | tee "$OUT/cuda_checkpoint.txt"
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
TRAIN_FAULT_RANK=1 TRAIN_FAULT_STEP=30 TRAIN_FAULT_KIND=kill timeout 300 \
  "$PY" -m launcher --standalone --nproc-per-node 2 --log-dir "$OUT/logs" \
  scripts/train_gpt.py --shim --cuda --async-ckpt --steps 60 --ckpt-every 10 \
  --ckpt-dir "$OUT/ckpt" \
  2>&1 | grep -v " loss " | tee "$OUT/recovery.txt"
if [ "$(nproc)" -ge 8 ]; then
  for shape in 1:1 2:1 4:3; do  # coordinator CPUs : I/O threads
    cpus="${shape%:*}" io="${shape#*:}"
    timeout 300 "$PY" scripts/bench_coordinator.py --nodes 16384 --window 5 \
      --coordinator-cpus "$cpus" --io-threads "$io" 2>&1 \
      | tee "$OUT/coordinator_16384_cpus${cpus}_io$io.txt"
  done
fi
