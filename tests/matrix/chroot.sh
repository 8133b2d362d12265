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
# On a hybrid-cgroup host (v1 controllers beside an empty v2: this one), a
# runtime in v2 mode (crun) leaves its containers in the v1 cgroups its caller
# had. From the host's v1 roots, CRIU dumped every v1 cgroup of the host, then
# failed restoring the root cpuset's cpu_exclusive, and each failed restore
# left its copies nested under libpod_parent (172,048 of them after a few
# runs). So the matrix runs in an empty child of each v1 hierarchy.
if [ -d /sys/fs/cgroup/unified ]; then
  for c in /sys/fs/cgroup/*/; do
    [ "$(basename "$c")" = unified ] && continue
    d=${c}gpusnap-matrix
    mkdir -p "$d"
    if [ -f "$d/cpuset.cpus" ]; then
      cat "${c}cpuset.cpus" > "$d/cpuset.cpus"
      cat "${c}cpuset.mems" > "$d/cpuset.mems"
    fi
    echo $$ > "$d/cgroup.procs"
  done
fi
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
