#!/usr/bin/env bash
# The GPU check of mmpipe (issue 31), one command on a GPU machine:
#   scripts/gpu_check.sh          one table in about 7 minutes (benchmarks/gpu_check.py): the README
#                                 command's first step with an empty and a warm kernel cache; the 0.58 B
#                                 configuration at 256 samples a step in bf16 under data-aware, packed-ffd
#                                 and ds-default, and in fp32 (steady step, samples/s, MFU, fraction of the
#                                 lower bound, optimizer and feed shares, memory measured / predicted);
#                                 pp=2 with two GPUs, pp=2 x dp=2 with four.
#   scripts/gpu_check.sh --full   also the GPU tests (tests/gpu: bf16 / fp16 under ZeRO-1 against fp32,
#                                 attention kernels against the dense reference, host syncs per
#                                 micro-batch), the attention kernels' times against the planner's cost
#                                 (benchmarks/bench_attention.py), and `mmpipe profile` with a short run
#                                 planned with its measured hardware file (about 10 more minutes).
# From anywhere; uses the python on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
PYTHONPATH=. python benchmarks/gpu_check.py
if [[ "${1:-}" == "--full" ]]; then
  timeout 300 python -m pytest -q -s -m gpu tests/gpu/test_gpu_precision.py -p no:cacheprovider
  timeout 400 python -m pytest -q -s -m gpu tests/gpu/test_gpu_attention.py -p no:cacheprovider
  PYTHONPATH=. timeout 300 python benchmarks/bench_attention.py
  python -m mmpipe profile hydra.run.dir=runs/gpu-profile profile.repeats=3
  python -m mmpipe train --config-dir runs/gpu-profile/conf hardware=measured-tiny train.steps=12 \
    hydra.run.dir=runs/gpu-profiled
fi
