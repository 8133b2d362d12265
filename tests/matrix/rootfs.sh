#!/bin/bash
# A Debian root filesystem with a newer container stack, for the version matrix
# (tests/matrix/run.sh): debootstrap DIST, then Podman, crun, runc, conmon,
# CRIU and Python from DIST's own archive, as that distribution's users have
# them. Cached in $GPUSNAP_MATRIX_DIR/DIST-root; rebuilt only when the package
# list below changes (a marker file holds its hash).
#   tests/matrix/rootfs.sh trixie|sid
set -euo pipefail
DIST=${1:?usage: rootfs.sh trixie|sid}
DIR=${GPUSNAP_MATRIX_DIR:-/var/cache/gpusnap/matrix}
ROOT=$DIR/$DIST-root
PKGS="podman crun runc conmon catatonit netavark aardvark-dns iptables criu python3-venv zstd busybox-static ca-certificates docker-registry apache2-utils nftables libcriu2 iproute2 procps oras"
# sid also brings containerd 2 and the CNI plugins its CRI needs (tests/matrix/cri.sh).
[ "$DIST" = sid ] && PKGS="$PKGS containerd containernetworking-plugins"
MARK=$ROOT/.gpusnap-matrix
want=$(echo "$DIST $PKGS" | sha256sum | cut -c1-16)
host_settings() {
  # This host's resolver and its local CAs (an egress proxy's, say): pip in
  # the root reaches PyPI as the host does.
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
  if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
    mkdir -p "$ROOT/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
    chroot "$ROOT" update-ca-certificates >/dev/null 2>&1 || true
  fi
  [ -f /etc/pip.conf ] && cp /etc/pip.conf "$ROOT/etc/pip.conf" || true
}
if [ -f "$MARK" ] && [ "$(cat "$MARK")" = "$want" ]; then
  host_settings
  echo "matrix: $ROOT is ready"
  exit 0
fi
command -v debootstrap >/dev/null || apt-get install -y -q --no-install-recommends debootstrap >/dev/null
rm -rf "$ROOT"
mkdir -p "$DIR"
echo "matrix: debootstrap $DIST into $ROOT"
debootstrap --variant=minbase --include=ca-certificates "$DIST" "$ROOT" http://deb.debian.org/debian >"$DIR/$DIST-debootstrap.log" 2>&1 \
  || { tail -5 "$DIR/$DIST-debootstrap.log"; exit 1; }
host_settings
# This machine's Debian mirror is a dated snapshot: sid's Release file has
# expired there by the time it is read (trixie's, a stable release, has not).
echo 'Acquire::Check-Valid-Until "false";' > "$ROOT/etc/apt/apt.conf.d/99gpusnap-matrix"
printf '#!/bin/sh\nexit 101\n' > "$ROOT/usr/sbin/policy-rc.d"  # no services started inside
chmod 755 "$ROOT/usr/sbin/policy-rc.d"
mount --bind /proc "$ROOT/proc"
trap 'umount "$ROOT/proc" 2>/dev/null || true' EXIT
chroot "$ROOT" sh -c "export DEBIAN_FRONTEND=noninteractive; apt-get update -q >/dev/null && \
  apt-get install -y -q --no-install-recommends $PKGS >/var/log/gpusnap-matrix-apt.log 2>&1" \
  || { tail -5 "$ROOT/var/log/gpusnap-matrix-apt.log"; exit 1; }
# No systemd inside: cgroupfs and a file event log, as tests/gpu/prepare.sh sets up Podman 4.
mkdir -p "$ROOT/etc/containers/containers.conf.d"
cat > "$ROOT/etc/containers/containers.conf.d/40-gpusnap-matrix.conf" <<'EOC'
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
# This host's own Podman has 10.88.0.0/16 on its bridge: a subnet of our own.
[network]
default_subnet = "10.89.0.0/24"
EOC
# CRIU before 4.2 cannot dump TCP/UDP sockets on Linux >= 6.16 (criu-debs.list):
# as `make deps` does on the host, CRIU 4.2 goes into a private prefix first
# on PATH (the host's cached .deb files), the root's own CRIU stays installed.
if [ -d /var/cache/gpusnap/debs ] && ls /var/cache/gpusnap/debs/criu_4.2*.deb >/dev/null 2>&1; then
  mkdir -p "$ROOT/var/cache/gpusnap/debs"
  cp /var/cache/gpusnap/debs/*.deb "$ROOT/var/cache/gpusnap/debs/"
  cp "$(dirname "$0")/../../packaging/criu-prefix.sh" "$ROOT/usr/local/sbin/gpusnap-criu-prefix"
  chroot "$ROOT" sh /usr/local/sbin/gpusnap-criu-prefix /var/cache/gpusnap/debs /opt/gpusnap/criu /usr/local/sbin/criu
fi
echo "$want" > "$MARK"
echo "matrix: $ROOT: $(chroot "$ROOT" dpkg-query -W -f='${Package} ${Version}, ' podman crun runc criu)$(chroot "$ROOT" /usr/local/sbin/criu --version 2>/dev/null | head -1)"
