#!/bin/bash
# make demo: a container's memory travels through a registry and back.
# A docker-registry on loopback (plain HTTP, a temp folder) is started; a
# counter container is checkpointed, signed with this host's key (`make
# install` made it, and this host trusts it: docs/trust.md) and pushed
# (`gpusnap migrate`), removed, pulled back into an
# archive Podman imports, inspected, and restored from the registry reference
# once its signature verified, with the command the push printed; its counter
# goes on from where it was. Each step is one numbered line ([N/9] ...).
# On a host with an NVIDIA GPU the container holds a CUDA tensor instead
# (tests/gpu/demo-gpu.sh), checked after restore.
set -euo pipefail
NAME=gpusnap-demo
ARCHIVE=${DEMO_ARCHIVE:-/var/tmp/gpusnap-demo.tar.zst}
podman rm -f -t 0 $NAME >/dev/null 2>&1 || true
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  exec bash "$(dirname "$0")/../tests/gpu/demo-gpu.sh"
fi

REG_DIR=$(mktemp -d /var/tmp/gpusnap-demo-registry.XXXXXX)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$REG_DIR/config.yml" <<EOC
version: 0.1
log: {level: warn, accesslog: {disabled: true}}
storage: {filesystem: {rootdirectory: $REG_DIR/storage}}
http: {addr: 127.0.0.1:$PORT, secret: gpusnap-demo}
EOC
docker-registry serve "$REG_DIR/config.yml" > "$REG_DIR/registry.log" 2>&1 &
REG_PID=$!
cleanup() { kill $REG_PID 2>/dev/null || true; rm -rf "$REG_DIR"; podman rm -f -t 0 $NAME >/dev/null 2>&1 || true; }
trap cleanup EXIT
python3 - "$PORT" <<'EOP'
import sys, time, urllib.request
for _ in range(100):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v2/", timeout=1)
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("demo: docker-registry did not start")
EOP
REF=127.0.0.1:$PORT/demo/counter:v1
STEPS=9 N=0
step() { N=$((N+1)); printf '\n[%d/%d] %s\n' $N $STEPS "$*"; }
[ -t 1 ] && export FORCE_COLOR=1  # gpusnap's output keeps its colours through tee below

step "A registry on loopback (plain HTTP, storage in $REG_DIR): 127.0.0.1:$PORT"
# Trust as `make install` leaves it: this host's key signs, and this host trusts it
unset GPUSNAP_POLICY
step "Pushes are signed with this host's key, $(gpusnap key export --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["key_id"][:19])'), which this host trusts (/etc/gpusnap/keys/trusted)"

podman run -d --name $NAME --network none localhost/gpusnap-demo:latest \
  sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.1; done' >/dev/null
sleep 2
step "Container $NAME counts in memory: at $(podman exec $NAME cat /tmp/c)"

step "Checkpoint, sign and push it; the container stops (a move): gpusnap migrate $NAME $REF --plain-http"
gpusnap migrate $NAME "$REF" --plain-http | tee "$REG_DIR/migrate.out"
RESTORE=$(sed 's/\x1b\[[0-9;]*m//g' "$REG_DIR/migrate.out" | grep -A1 '^On the target host run:' | tail -1 | sed 's/^ *//')

step "Remove the container, as if this host were gone: podman rm $NAME ($(podman inspect $NAME --format '{{.State.Status}}') until now)"
podman rm $NAME >/dev/null
podman container exists $NAME && { echo "demo: $NAME is still there"; exit 1; }

step "Inspect the checkpoint in the registry (manifest + config only): gpusnap inspect $REF --plain-http"
gpusnap inspect "$REF" --plain-http

step "Pull it into an archive plain Podman imports (signature verified first): gpusnap pull $REF --plain-http -o $ARCHIVE"
gpusnap pull "$REF" --plain-http -o "$ARCHIVE"

step "Restore it from the registry with the command step 4 printed: $RESTORE"
bash -c "$RESTORE"
sleep 1

step "Container $NAME counts on: at $(podman exec $NAME cat /tmp/c) (from where it was, not from 0)"
