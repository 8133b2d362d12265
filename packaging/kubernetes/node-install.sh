#!/bin/bash
# Install gpusnap on the node whose root filesystem is mounted at HOST (the
# DaemonSet in installer.yaml mounts / there): the package, the OCI hook, the
# CRIU action script (packaging/install.sh, run in the node's root), the shim
# on containerd's PATH, and the `gpusnap` runtime handler in containerd's
# conf.d; then containerd is restarted so the CRI sees the handler. Idempotent.
#   node-install.sh [HOST]
set -euo pipefail
HOST=${1:-/host}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
[ -d "$HOST/etc" ] || { echo "node-install: $HOST is not a root filesystem" >&2; exit 1; }
mkdir -p "$HOST/opt/gpusnap/src"
tar -C "$SRC" --exclude=.git --exclude=.gpu-bundle --exclude=.matrix -cf - . | tar -C "$HOST/opt/gpusnap/src" -xf -
chroot "$HOST" bash /opt/gpusnap/src/packaging/install.sh
mkdir -p "$HOST/etc/containerd/conf.d"
cp "$SRC/packaging/kubernetes/containerd-gpusnap.toml" "$HOST/etc/containerd/conf.d/gpusnap.toml"
# containerd 2.x's default config imports conf.d; an existing config.toml must too.
cfg=$HOST/etc/containerd/config.toml
if [ -f "$cfg" ] && ! grep -q 'conf.d' "$cfg"; then
  echo "node-install: $cfg does not import /etc/containerd/conf.d/*.toml; add" >&2
  echo "  imports = [\"/etc/containerd/conf.d/*.toml\"]  to its top" >&2
  exit 1
fi
# A node whose runc handler uses systemd's cgroups (kubeadm's default, as its
# kubelet does) gets the same for gpusnap's: runc needs --systemd-cgroup there.
if grep -Eqs '^[[:space:]]*SystemdCgroup[[:space:]]*=[[:space:]]*true' "$cfg" "$HOST"/etc/containerd/conf.d/*.toml; then
  printf '%s\n' "  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.gpusnap.options]" \
    "    SystemdCgroup = true" >> "$HOST/etc/containerd/conf.d/gpusnap.toml"
fi
if chroot "$HOST" systemctl is-active -q containerd 2>/dev/null; then
  chroot "$HOST" systemctl restart containerd
fi
echo "node-install: gpusnap $(chroot "$HOST" /opt/gpusnap/venv/bin/gpusnap --version 2>/dev/null | head -1) installed; handler gpusnap added to containerd"
