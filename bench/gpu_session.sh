#!/usr/bin/env bash
# One GPU session in ONE call of about 9 minutes (bench/RESULTS.md, "GPU session"). On the GPU machine:
#     bash bench/gpu_session.sh                 # the next window's queue; --out defaults to $OUT, python3
#     bash bench/gpu_session.sh --plan window   # the first window's steps
# Before shipping the tree (it arrives without .git): git rev-parse --short HEAD > bench/COMMIT
# Nothing is installed: nanopt runs from the copied tree (PYTHONPATH is the repository root), and nothing needs the
# network or `datasets`. `timeout 590` keeps the call under the 10-minute limit even if the session's own budget
# (540 s of steps) were overrun: on SIGTERM the session kills its step, records it and prints its summary.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Fewer fragmented reserved blocks under varying shapes (find-batch, memory); what nanopt users are told to set.
export PYTORCH_ALLOC_CONF="${PYTORCH_ALLOC_CONF:-expandable_segments:True}"
# What a first GPU run most needs to see, which nanopt's quiet mode hides unless these are set: C++ warnings
# (an SDPA backend falling back), Python warnings, and every graph break and recompilation.
export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-WARNING}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-default}"
export TORCH_LOGS="${TORCH_LOGS:-graph_breaks,recompiles}"
# torch.cuda.is_available() through NVML, without initializing CUDA: the parent must not (it forks the steps).
export PYTORCH_NVML_BASED_CUDA_CHECK=1
exec timeout --kill-after=10 "${GPU_SESSION_TIMEOUT_S:-590}" "${PYTHON:-python3}" "$repo/bench/gpu_session.py" "$@"
