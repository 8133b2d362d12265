#!/bin/bash
# Run a command inside a matrix root filesystem (rootfs.sh), in a mount namespace
# of its own whose root it is (pivot_root): /proc, /sys and /dev of this host,
# fresh tmpfs on /run and /tmp, this source tree at /src. Not systemd-nspawn:
# Podman inside must share this host's PID and network namespaces, cgroups and
# devices as Podman on the host does (CRIU dumps through the same kernel), and
# no init runs.
#   tests/matrix/chroot.sh DIST COMMAND...
set -euo pipefail
DIST=${1:?usage: chroot.sh DIST COMMAND...}
shift
ROOT=${GPUSNAP_MATRIX_DIR:-/var/cache/gpusnap/matrix}/$DIST-root
SRC=$(cd "$(dirname "$0")/../.." && pwd)
[ -f "$ROOT/.gpusnap-matrix" ] || { echo "no $ROOT: run tests/matrix/rootfs.sh $DIST" >&2; exit 1; }
exec unshare --mount --propagation private bash -c '
  set -e
  R=$1 SRC=$2
  shift 2
  # The root a mount of its own: Podman unpacks layers in a chroot that remounts "/".
  mount --bind "$R" "$R"
  mount -t proc proc "$R/proc"
  mount --rbind /sys "$R/sys"
  mount --rbind /dev "$R/dev"
  mount -t tmpfs -o mode=755 tmpfs "$R/run"
  mount -t tmpfs -o mode=1777 tmpfs "$R/tmp"
  mkdir -p "$R/src" "$R/.oldroot"
  mount --bind "$SRC" "$R/src"
  # pivot_root, not chroot: the root of this mount namespace must be the
  # matrix root, or a runtime that joins a container later (exec) lands on
  # the files of this host
  cd "$R"
  pivot_root . .oldroot
  cd /
  umount -l /.oldroot
  exec env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
' _ "$ROOT" "$SRC" "$@"
