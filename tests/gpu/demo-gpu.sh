#!/bin/bash
# make demo on a host with an NVIDIA GPU: a CUDA container holding 2 GiB is
# checkpointed (GPU memory released), exported, removed, restored from the
# archive, and every element of its tensor is compared after restore.
# Needs PyTorch at $GPUSNAP_CUDA_PYTHON (default /opt/torch/.venv/bin/python3).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${GPUSNAP_CUDA_PYTHON:-/opt/torch/.venv/bin/python3}
[ -x "$PY" ] || { echo "demo: no PyTorch at $PY: set GPUSNAP_CUDA_PYTHON to a python with torch"; exit 1; }
bash "$REPO/tests/gpu/gpu-image.sh" >/dev/null
cd "$REPO" && exec /opt/gpusnap/venv/bin/python -m tests.gpu.demo
