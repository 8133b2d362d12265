#!/bin/bash
# Install gpusnap and wire it into unchanged Podman/runc/CRIU, as root. Idempotent.
#   /opt/gpusnap/venv           the Python package (console scripts gpusnap, gpusnap-hook, ...)
#   /usr/local/bin/gpusnap      the CLI
#   /opt/gpusnap/libexec/criu-action, named in /etc/criu/runc.conf (a managed block)
#   /usr/share/containers/oci/hooks.d/gpusnap.json   the OCI hook
# GPUSNAP_OFFLINE=1 installs with no package index (the GPU machines): the
# venv then sees the system's site-packages for click, rich and nvidia-ml-py.
# GPUSNAP_PYTHON picks the interpreter.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(dirname "$HERE")
ROOT=/opt/gpusnap
PY=${GPUSNAP_PYTHON:-python3}
[ "$(id -u)" = 0 ] || { echo "install.sh: run as root" >&2; exit 1; }

if [ "${GPUSNAP_OFFLINE:-0}" = 1 ]; then
  [ -x $ROOT/venv/bin/python ] || "$PY" -m venv --system-site-packages $ROOT/venv
  $ROOT/venv/bin/pip install -q --no-index --no-deps --no-build-isolation "$SRC"
else
  [ -x $ROOT/venv/bin/python ] || "$PY" -m venv $ROOT/venv
  $ROOT/venv/bin/pip install -q --upgrade "$SRC[test]"
fi
ln -sf $ROOT/venv/bin/gpusnap /usr/local/bin/gpusnap
install -D -m 755 "$HERE/bin/criu-action" $ROOT/libexec/criu-action
install -D -m 644 "$HERE/hooks.d/gpusnap.json" /usr/share/containers/oci/hooks.d/gpusnap.json

# /etc/criu/runc.conf may hold the admin's own options: manage only our block.
conf=/etc/criu/runc.conf
mkdir -p /etc/criu
touch $conf
sed -i '/^# BEGIN gpusnap/,/^# END gpusnap/d' $conf
{ echo "# BEGIN gpusnap (managed by packaging/install.sh)"; grep -v '^#' "$HERE/criu/runc.conf" | sed '/^$/d'; echo "# END gpusnap"; } >> $conf
install -d -m 700 /run/gpusnap
echo "install: gpusnap $($ROOT/venv/bin/gpusnap --version | awk '{print $3}') in $ROOT"
