#!/bin/bash
# make demo: a container is checkpointed with its memory, exported, removed,
# and restored from the archive; its counter goes on from where it was.
# On a host with an NVIDIA GPU the container holds a CUDA tensor instead
# (tests/gpu/workload.py), checked after restore.
set -euo pipefail
NAME=gpusnap-demo
ARCHIVE=${DEMO_ARCHIVE:-/var/tmp/gpusnap-demo.tar.zst}
podman rm -f -t 0 $NAME >/dev/null 2>&1 || true
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  exec bash "$(dirname "$0")/../tests/gpu/demo-gpu.sh"
fi
podman run -d --name $NAME --network none localhost/gpusnap-demo:latest \
  sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.1; done' >/dev/null
sleep 2
echo "counter before checkpoint: $(podman exec $NAME cat /tmp/c)"
gpusnap checkpoint $NAME --export "$ARCHIVE"
gpusnap inspect "$ARCHIVE"
podman rm $NAME >/dev/null
gpusnap restore "$ARCHIVE"
sleep 1
echo "counter after restore:     $(podman exec $NAME cat /tmp/c)  (it went on, not from 0)"
podman rm -f -t 0 $NAME >/dev/null
