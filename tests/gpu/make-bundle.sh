#!/bin/bash
# Download, on the Debian machine, the .deb files a bare GPU machine (Ubuntu
# 24.04, no package access) needs to run Podman + runc + CRIU 4, into DIR
# (git-ignored; carried to the GPU machine with the tree). Idempotent.
set -euo pipefail
DIR=${1:-.gpu-bundle}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$DIR/podman" "$DIR/criu" "$DIR/crun"
[[ "$(apt-cache policy criu)" == *sid/main* ]] || { echo "run 'make deps' first (adds the pinned trixie and sid sources)"; exit 1; }
# Podman and what it and conmon load that Ubuntu 24.04 names differently or lacks.
PODMAN=(podman conmon runc golang-github-containers-common golang-github-containers-image
        libgpgme11 libassuan0 libgpg-error0 libsubid4 libdevmapper1.02.1 libglib2.0-0
        libyajl2 libseccomp2 catatonit
        # CRIU locks a container's network with iptables-restore; the GPU machine has none.
        iptables libxtables12 libip4tc2 libip6tc2 libnetfilter-conntrack3 libnfnetlink0
        libnftnl11 libmnl0
        # CRIU saves and restores a network namespace it dumps (crun hands it
        # Podman's --network none namespace) with ip(8); the GPU machine has none.
        iproute2 libbpf1 libelf1 libbsd0 libmd0
        # Checkpoint archives are zstd streams; the GPU machine has no zstd binary.
        zstd
        # Containers with an address (bench/coldstart.py's replicas): Podman 4.3's backend.
        netavark aardvark-dns)
(cd "$DIR/podman" && apt-get download -q "${PODMAN[@]}" >/dev/null 2>&1)
mapfile -t pkgs < <(grep -v '^#' "$HERE/../../packaging/criu-debs.list" | tr ' ' '\n' | sed '/^$/d')
rm -f "$DIR"/criu/*.deb  # CRIU 4.2 from sid: no 4.1 library may stay beside it
(cd "$DIR/criu" && apt-get download -q "${pkgs[@]/%//sid}" >/dev/null 2>&1)
# crun 1.28 (sid; Podman's default runtime on Fedora/RHEL) with what Ubuntu
# 24.04 lacks (its glibc 2.39 is new enough), and libcriu 4.2, which crun
# dlopen()s: with it crun hands CRIU gpusnap's configuration (criu/runtimes.py).
mkdir -p "$DIR/crun" && rm -f "$DIR"/crun/*.deb
(cd "$DIR/crun" && apt-get download -q crun/sid libblake3-0/sid libjson-c5/sid libcriu2/sid libprotobuf-c1/sid >/dev/null 2>&1)
# The device tool carries 64 MiB in all, so the rest comes in two parts that
# travel in separate runs (name the folders in `carry`):
# - bin/ + wheels/, the containerd shim's tests: containerd 1.7 and ctr
#   (trixie, pinned by `make deps`), squeezed, and the gRPC wheels for the GPU
#   machine's Python (3.12, the PyTorch venv), unzipped there;
# - bench/, the registry benches: docker-registry and oras, and the wheels the
#   registry code needs that the PyTorch image lacks (zstandard, cryptography,
#   pyroute2 for the benches' registry helper, bcrypt for its htpasswd) and a
#   static busybox for the demo image the CPU-sized benches run.
mkdir -p "$DIR/bin" "$DIR/wheels" "$DIR/bench/wheels"
rm -rf "$DIR/containerd"  # the older layout
if [ ! -f "$DIR/bin/tools.tar.zst" ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -q containerd >/dev/null 2>&1 && dpkg -x containerd_*.deb root)
  tar -C "$tmp/root/usr/bin" -cf - containerd ctr | zstd -q -19 -T0 -o "$DIR/bin/tools.tar.zst"
  rm -rf "$tmp"
fi
cp /bin/busybox "$DIR/bench/busybox"  # static: the CPU benches' demo image (packaging/demo-image.sh)
if [ ! -f "$DIR/bench/tools.tar.zst" ]; then
  tmp=$(mktemp -d)
  cp "$(command -v docker-registry)" "$(command -v oras)" "$tmp/"
  tar -C "$tmp" -cf - docker-registry oras | zstd -q -19 --long=27 -T0 -o "$DIR/bench/tools.tar.zst"
  rm -rf "$tmp"
fi
# Debian 13's docker-registry (2.8.3, built with Go 1.24, whose sha256 uses the
# CPU's SHA extensions: half the registry's CPU per byte stored), for benches
# that compare it with Debian 12's: prepare.sh puts it in
# /opt/gpusnap/registry-trixie, a folder to put first on PATH.
if [ ! -f "$DIR/bench/registry-trixie.tar.zst" ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -q docker-registry/trixie >/dev/null 2>&1 \
     && dpkg -x docker-registry_*.deb root)
  tar -C "$tmp/root/usr/bin" -cf - docker-registry | zstd -q -19 -T0 -o "$DIR/bench/registry-trixie.tar.zst"
  rm -rf "$tmp"
fi
VENV_PIP=${GPUSNAP_VENV:-/opt/gpusnap/venv}/bin/pip
versions=$("$VENV_PIP" list --format=freeze 2>/dev/null | grep -iE '^(grpcio|grpcio-tools|protobuf)==')
pip download -q --only-binary=:all: --no-deps --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$DIR/wheels" $versions
# pytest-timeout for the GPU tests (every test bounded), in a folder of its own
# that travels with the first part.
mkdir -p "$DIR/pytest"
pytest_timeout=$("$VENV_PIP" list --format=freeze 2>/dev/null | grep -iE '^pytest-timeout==')
pip download -q --only-binary=:all: --no-deps -d "$DIR/pytest" ${pytest_timeout:-pytest-timeout}
bench_versions=$("$VENV_PIP" list --format=freeze 2>/dev/null | grep -iE '^(zstandard|cryptography|cffi|bcrypt|pyroute2)==')
pip download -q --only-binary=:all: --no-deps --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$DIR/bench/wheels" $bench_versions
du -sh "$DIR" "$DIR"/*
