#!/usr/bin/env bash
# The GPU checks of mmpipe's precision, ZeRO and attention paths (tests/gpu), with their figures:
# bf16 and fp16 under ZeRO-1 through NCCL (pp=2 on two GPUs, else one stage on one GPU),
# loss curves against fp32, and measured against predicted peak memory per stage; the
# attention kernels (flash-attn varlen where installed, FlexAttention, SDPA per segment)
# against the dense reference, host syncs per micro-batch, and the kernels' times against the
# planner's sum-of-squares attention cost (benchmarks/bench_attention.py); and the calibration
# of this machine: `mmpipe profile` (the layers, a real NCCL pipeline's fixed costs and memory,
# allocated device bytes) writes runs/gpu-profile/conf/hardware/measured-tiny.yaml and prints its
# fits, and a short run planned with it prints measured against predicted peak memory per stage.
# Takes 5-8 minutes on one GPU (the first run may add a minute or two if DeepSpeed compiles
# its FusedAdam kernel; without a CUDA compiler mmpipe falls back to torch AdamW; FlexAttention
# compiles a kernel per mask kind and precision, tens of seconds each).
# Usage: scripts/gpu_check.sh   (from anywhere; uses the python on PATH)
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 300 python -m pytest -q -s -m gpu tests/gpu/test_gpu_precision.py -p no:cacheprovider
timeout 400 python -m pytest -q -s -m gpu tests/gpu/test_gpu_attention.py -p no:cacheprovider
PYTHONPATH=. timeout 300 python benchmarks/bench_attention.py
python -m mmpipe profile hydra.run.dir=runs/gpu-profile profile.repeats=3
python -m mmpipe train --config-dir runs/gpu-profile/conf hardware=measured-tiny train.steps=12 hydra.run.dir=runs/gpu-profiled
