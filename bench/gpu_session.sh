#!/usr/bin/env bash
# One GPU session (issues #12 and #13): every measurement into OUT, within ~9 minutes. See bench/RESULTS.md.
#   bench/gpu_session.sh OUT [--commit SHA] [--only STEP,...] [--smoke]
# Runs from a copy of the repository without installing nanopt: PYTHONPATH is the repository root.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: bench/gpu_session.sh OUT [gpu_session.py options]" >&2
    exit 2
fi
out=$1
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# pytest for the gpu-tests step, where the GPU machine has none: build/gpu-pylib, carried beside the tree.
if [ -d "$repo/build/gpu-pylib" ]; then
    export PYTHONPATH="$PYTHONPATH:$repo/build/gpu-pylib"
fi
# Fewer fragmented reserved blocks under varying shapes (find-batch, memory); what nanopt users are told to set.
export PYTORCH_ALLOC_CONF="${PYTORCH_ALLOC_CONF:-expandable_segments:True}"
exec "${PYTHON:-python}" "$repo/bench/gpu_session.py" --out "$out" "$@"
