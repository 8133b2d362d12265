#!/bin/bash
# Install gpusnap and wire it into unchanged Podman/runc/CRIU, as root. Idempotent.
#   /opt/gpusnap/venv           the Python package (console scripts gpusnap, gpusnap-hook, ...)
#   /usr/local/bin/gpusnap      the CLI
#   /opt/gpusnap/libexec/criu-action, named in /etc/criu/runc.conf (a managed block)
#   /usr/share/containers/oci/hooks.d/gpusnap-{prestart,poststop}.json   the OCI hook
#   /opt/gpusnap/libexec/gpusnap-hook, the hook they name (hands a restore's to gpusnap's agent)
# GPUSNAP_OFFLINE=1 installs with no package index (the GPU machines): the
# venv then uses GPUSNAP_PYTHON's packages for click, rich and nvidia-ml-py.
# GPUSNAP_PYTHON picks the interpreter; GPUSNAP_PYLIB adds a folder of unpacked wheels.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(dirname "$HERE")
ROOT=/opt/gpusnap
PY=${GPUSNAP_PYTHON:-python3}
[ "$(id -u)" = 0 ] || { echo "install.sh: run as root" >&2; exit 1; }

if [ "${GPUSNAP_OFFLINE:-0}" = 1 ]; then
  # No index and maybe no build backend: a venv that sees $PY's own
  # site-packages (a venv's too, which --system-site-packages would miss) and
  # this source tree, with the console scripts written here (an editable install).
  [ -x $ROOT/venv/bin/python ] || "$PY" -m venv --without-pip $ROOT/venv
  host_site=$("$PY" -c 'import site; print(site.getsitepackages()[0])')
  venv_site=$($ROOT/venv/bin/python -c 'import site; print(site.getsitepackages()[0])')
  # GPUSNAP_PYLIB (unpacked wheels the interpreter lacks, e.g. grpcio) goes first.
  printf '%s\n' ${GPUSNAP_PYLIB:-} "$host_site" "$SRC" > "$venv_site/gpusnap-offline.pth"
  # name:module:function, as pyproject.toml's [project.scripts]
  for script in gpusnap:gpusnap.cli.main:main gpusnap-hook:gpusnap.hook.main:entry \
                gpusnap-criu-action:gpusnap.action.action:entry containerd-shim-gpusnap-v1:gpusnap.shim.main:main; do
    target=${script#*:}
    printf '#!%s\nimport sys\nfrom %s import %s\nif __name__ == "__main__":  # spawned workers import this file\n    sys.exit(%s())\n' "$ROOT/venv/bin/python" "${target%:*}" "${target##*:}" "${target##*:}" > "$ROOT/venv/bin/${script%%:*}"
    chmod 755 "$ROOT/venv/bin/${script%%:*}"
  done
  # Compiled now, as pip does for an installed package: where the environment
  # sets PYTHONDONTWRITEBYTECODE (the GPU machines do) every gpusnap process
  # (the CLI, the hook, CRIU's action script, each push and pull worker) would
  # otherwise compile its modules anew: 0.15-0.2 s of each start. GPUSNAP_PYLIB
  # (wheels unpacked, never compiled) likewise.
  "$ROOT/venv/bin/python" -m compileall -q -j 0 "$SRC/gpusnap" ${GPUSNAP_PYLIB:-} > /dev/null ||
    echo "install.sh: not all of $SRC/gpusnap ${GPUSNAP_PYLIB:-} compiled ahead: what did not is compiled at each start" >&2
else
  [ -x $ROOT/venv/bin/python ] || "$PY" -m venv $ROOT/venv
  $ROOT/venv/bin/pip install -q --upgrade "$SRC[test]"
fi
ln -sf $ROOT/venv/bin/gpusnap /usr/local/bin/gpusnap
ln -sf $ROOT/venv/bin/containerd-shim-gpusnap-v1 /usr/local/bin/containerd-shim-gpusnap-v1  # containerd finds shims on PATH
for script in criu-action agent-ask.sh gpusnap-hook; do  # agent-ask.sh: sourced by the other two
  install -D -m 755 "$HERE/bin/$script" $ROOT/libexec/$script
done
# One file per stage: runc reports a container being restored as "stopped",
# so the hook learns its stage from its arguments, not from the state.
rm -f /usr/share/containers/oci/hooks.d/gpusnap.json
for stage in prestart poststop; do
  install -D -m 644 "$HERE/hooks.d/gpusnap-$stage.json" /usr/share/containers/oci/hooks.d/gpusnap-$stage.json
done

# /etc/criu/runc.conf may hold the admin's own options: manage only our block.
# crun (built against libcriu >= 4.2) reads crun.conf, and runc.conf only when
# there is no crun.conf: the block goes into both (gpusnap/criu/runtimes.py).
mkdir -p /etc/criu
for conf in /etc/criu/runc.conf /etc/criu/crun.conf; do
  [ "$conf" = /etc/criu/crun.conf ] && [ ! -f $conf ] && ! command -v crun >/dev/null && continue
  touch $conf
  sed -i '/^# BEGIN gpusnap/,/^# END gpusnap/d' $conf
  { echo "# BEGIN gpusnap (managed by packaging/install.sh)"; grep -v '^#' "$HERE/criu/runc.conf" | sed '/^$/d'; echo "# END gpusnap"; } >> $conf
done
install -d -m 700 /run/gpusnap
# This host's signing key: push and migrate sign with it, and with no policy
# file a restore trusts it (gpusnap/trust/hostkey.py). Made once, kept.
$ROOT/venv/bin/python -c 'from gpusnap.trust import hostkey; print("install: this host signs with", hostkey.ensure())'
echo "install: gpusnap $($ROOT/venv/bin/gpusnap --version | awk '{print $3}') in $ROOT"
