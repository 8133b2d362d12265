#!/bin/bash
# The version matrix: the integration tests that matter most, run with newer
# container stacks than the host's Debian 12 (Podman 4.3 + runc), each in a
# Debian root filesystem of its own (rootfs.sh, cached) entered by chroot.sh.
#   tests/matrix/run.sh [DIST:RUNTIME,RUNTIME ...]   default: trixie:crun,runc sid:crun,runc
# (a root with containerd 2, sid's, also runs the shim's tests and the CRI path)
# (see docs/version-matrix.md)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
[ "$(id -u)" = 0 ] || { echo "run.sh: run as root" >&2; exit 1; }
rc=0
# Podman 4 <-> 5 archives: this host's Podman exports, each root restores it
# and exports its own, which this host restores (xver.sh).
X=$HERE/../../.matrix/xver
rm -rf "$X" && mkdir -p "$X"
podman save -q localhost/gpusnap-demo -o "$X/demo.tar" && bash "$HERE/xver.sh" make "$X" from-host || rc=1
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=(trixie:crun,runc sid:crun,runc)
for spec in "${specs[@]}"; do
  dist=${spec%%:*}
  runtimes=${spec#*:}
  bash "$HERE/rootfs.sh" "$dist" || { rc=1; continue; }
  bash "$HERE/chroot.sh" "$dist" bash /src/tests/matrix/inside.sh "$dist" ${runtimes//,/ } || rc=1
  [ -f "$X/from-$dist.tar.zst" ] && { bash "$HERE/xver.sh" check "$X" "from-$dist" || rc=1; }
done
exit $rc
