#!/bin/bash
# make demo: a container's memory travels through a registry and back.
# A docker-registry on loopback (plain HTTP, a temp folder) is started; a
# signing key is generated and a trust policy written that trusts it for the
# demo registry (docs/trust.md); a counter container is checkpointed, signed
# and pushed (`gpusnap migrate --sign-key`), removed, pulled back into an
# archive Podman imports, inspected, and restored from the registry reference
# once its signature verified; its counter goes on from where it was.
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
echo "registry: http://127.0.0.1:$PORT (loopback, $REG_DIR)"

# Trust: a signing key, and a policy that accepts only what it signed here
gpusnap key generate --output "$REG_DIR/demo-signer" >/dev/null
cat > "$REG_DIR/policy.json" <<EOJ
{"default": {"type": "reject"},
 "scopes": {"127.0.0.1:$PORT/demo": {"type": "signedBy", "keyPaths": ["$REG_DIR/demo-signer.pub"]}}}
EOJ
chmod 0644 "$REG_DIR/policy.json"
export GPUSNAP_POLICY=$REG_DIR/policy.json
echo "signing key: $(gpusnap key id "$REG_DIR/demo-signer.pub"), trusted by $GPUSNAP_POLICY"

podman run -d --name $NAME --network none localhost/gpusnap-demo:latest \
  sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.1; done' >/dev/null
sleep 2
echo "counter before checkpoint: $(podman exec $NAME cat /tmp/c)"
gpusnap migrate $NAME "$REF" --plain-http --sign-key "$REG_DIR/demo-signer.key"  # checkpoint + sign + push
podman rm $NAME >/dev/null
gpusnap pull "$REF" --plain-http -o "$ARCHIVE"        # verified, then an archive plain Podman imports
gpusnap inspect "$REF" --plain-http                   # manifest + config only; signed by whom
gpusnap restore "$REF" --plain-http                   # verify, pull and restore in one go
sleep 1
echo "counter after restore:     $(podman exec $NAME cat /tmp/c)  (it went on, not from 0)"
