#!/bin/bash
# Prepare a bare NVIDIA GPU machine (Ubuntu 24.04, no package access, root)
# from the .deb files of `make gpu-bundle` (carried in .gpu-bundle/):
# Podman 4.3 + runc + conmon in /opt/gpusnap/sysroot behind wrappers,
# CRIU 4.1 with its own glibc, gpusnap installed offline over the machine's
# PyTorch venv, and the two test images. Idempotent.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BUNDLE=${GPUSNAP_BUNDLE:-$REPO/.gpu-bundle}
SYS=/opt/gpusnap/sysroot
TORCH_PY=${GPUSNAP_CUDA_PYTHON:-/opt/torch/.venv/bin/python3}
[ -d "$BUNDLE/podman" ] || { echo "prepare: no $BUNDLE/podman: run 'make gpu-bundle' on the Debian machine and carry .gpu-bundle"; exit 1; }

mkdir -p $SYS /opt/gpusnap/bin
for deb in "$BUNDLE"/podman/*.deb; do dpkg -x "$deb" $SYS; done
LIBS=$SYS/usr/lib/x86_64-linux-gnu:$SYS/lib/x86_64-linux-gnu
for tool in podman conmon; do
  cat > /opt/gpusnap/bin/$tool <<EOW
#!/bin/sh
# Debian 12's $tool with the libraries it was built against.
LD_LIBRARY_PATH=$LIBS exec $SYS/usr/bin/$tool "\$@"
EOW
  chmod 755 /opt/gpusnap/bin/$tool
done
ln -sf /opt/gpusnap/bin/podman /usr/local/bin/podman
# CRIU locks the container's network namespace with iptables-restore (nft backend).
for tool in iptables iptables-restore iptables-save ip6tables ip6tables-restore ip6tables-save; do
  cat > /usr/local/sbin/$tool <<EOW
#!/bin/sh
LD_LIBRARY_PATH=$LIBS XTABLES_LIBDIR=$SYS/usr/lib/x86_64-linux-gnu/xtables exec $SYS/usr/sbin/xtables-nft-multi $tool "\$@"
EOW
  chmod 755 /usr/local/sbin/$tool
done
iptables -L -n >/dev/null && echo "iptables (nft) works"
if ! command -v ip >/dev/null && [ -x $SYS/bin/ip ]; then  # CRIU's `ip addr save` (crun)
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s/bin/ip "$@"\n' "$LIBS" "$SYS" > /usr/local/sbin/ip
  chmod 755 /usr/local/sbin/ip
fi
command -v ip >/dev/null && ip -V
if ! command -v zstd >/dev/null; then
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s/usr/bin/zstd "$@"\n' "$LIBS" "$SYS" > /usr/local/bin/zstd
  chmod 755 /usr/local/bin/zstd
fi
zstd --version
ln -sf $SYS/usr/sbin/runc /usr/local/sbin/runc
# netavark gives containers an address on Podman's bridge (an older bundle has none).
mkdir -p /usr/lib/podman
NETWORK=
for helper in netavark aardvark-dns; do
  if [ -x $SYS/usr/lib/podman/$helper ]; then
    ln -sf $SYS/usr/lib/podman/$helper /usr/lib/podman/$helper
    NETWORK='[network]
network_backend = "netavark"'
  fi
done

mkdir -p /etc/containers /usr/share/containers /usr/libexec/podman
cp -rn $SYS/usr/share/containers/. /usr/share/containers/
cp -rn $SYS/etc/containers/. /etc/containers/
cp -n $SYS/usr/libexec/podman/catatonit /usr/libexec/podman/ 2>/dev/null || true
cat > /etc/containers/containers.conf <<EOF2
# gpusnap GPU test machine (tests/gpu/prepare.sh)
[engine]
runtime = "runc"
conmon_path = ["/opt/gpusnap/bin/conmon"]
cgroup_manager = "cgroupfs"
events_logger = "file"
[engine.runtimes]
runc = ["$SYS/usr/sbin/runc"]
$NETWORK
EOF2
install -D -m 644 "$REPO/packaging/containers/50-gpusnap-host.conf" /etc/containers/containers.conf.d/50-gpusnap-host.conf
cat > /etc/containers/storage.conf <<'EOF2'
[storage]
driver = "overlay"
runroot = "/run/containers/storage"
graphroot = "/var/lib/containers/storage"
EOF2

# Driver libraries under /usr/local/nvidia may be missing from the loader cache.
if ! ldconfig -p | grep -q 'libcuda.so.1 '; then
  for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do [ -d $d ] && echo $d; done > /etc/ld.so.conf.d/gpusnap-nvidia.conf
  ldconfig
fi

bash "$REPO/packaging/criu-prefix.sh" "$BUNDLE/criu" /opt/gpusnap/criu /usr/local/sbin/criu
# crun (bundle part crun/, carried where the crun tests run): its own libraries
# beside it, behind a wrapper named crun (Podman and gpusnap know the runtime by
# that name); libcriu.so.2 where every process finds it, as libcriu2 installs
# it, since crun dlopen()s it and gpusnap's probe loads the same one.
if ls "$BUNDLE"/crun/crun_*.deb >/dev/null 2>&1; then
  for deb in "$BUNDLE"/crun/*.deb; do dpkg -x "$deb" /opt/gpusnap/crun; done
  CRUN_LIBS=/opt/gpusnap/crun/usr/lib/x86_64-linux-gnu
  mkdir -p /opt/gpusnap/libcriu
  cp -a $CRUN_LIBS/libcriu.so.2* /opt/gpusnap/libcriu/
  ldconfig -p | grep -q 'libprotobuf-c.so.1 ' || cp -a $CRUN_LIBS/libprotobuf-c.so.1* /opt/gpusnap/libcriu/
  echo /opt/gpusnap/libcriu > /etc/ld.so.conf.d/gpusnap-libcriu.conf
  ldconfig
  # Only what the machine lacks: CRIU and its action script inherit this path.
  CRUN_PATH=$CRUN_LIBS
  LD_LIBRARY_PATH=$CRUN_PATH ldd /opt/gpusnap/crun/usr/bin/crun | grep -q 'not found' && CRUN_PATH=$CRUN_PATH:$LIBS
  printf '#!/bin/sh\n# crun from Debian sid with its libraries (tests/gpu/prepare.sh)\nLD_LIBRARY_PATH=%s exec /opt/gpusnap/crun/usr/bin/crun "$@"\n' \
    "$CRUN_PATH" > /opt/gpusnap/bin/crun
  chmod 755 /opt/gpusnap/bin/crun
  ln -sf /opt/gpusnap/bin/crun /usr/local/bin/crun
  crun --version | head -2
  sed -i "s|^runc = \\[.*|&\ncrun = [\"/opt/gpusnap/bin/crun\"]|" /etc/containers/containers.conf
fi
# What came of the bundle's optional parts (make-bundle.sh: bin/ + wheels/ for
# the shim tests, bench/ for the registry benches): Go binaries and wheels.
for tools in "$BUNDLE/bin/tools.tar.zst" "$BUNDLE/bench/tools.tar.zst"; do
  [ -f "$tools" ] && zstd -dcq --long=27 "$tools" | tar -C /usr/local/bin -xf -
done
if [ -f "$BUNDLE/bench/registry-trixie.tar.zst" ]; then  # make-bundle.sh says why
  mkdir -p /opt/gpusnap/registry-trixie
  zstd -dcq "$BUNDLE/bench/registry-trixie.tar.zst" | tar -C /opt/gpusnap/registry-trixie -xf -
fi
mkdir -p /opt/gpusnap/pylib
for whl in "$BUNDLE"/wheels/*.whl "$BUNDLE"/bench/wheels/*.whl "$BUNDLE"/pytest/*.whl; do
  [ -f "$whl" ] && "$TORCH_PY" -m zipfile -e "$whl" /opt/gpusnap/pylib
done
export GPUSNAP_PYLIB=/opt/gpusnap/pylib
GPUSNAP_OFFLINE=1 GPUSNAP_PYTHON=$TORCH_PY bash "$REPO/packaging/install.sh"
podman info --format 'podman {{.Version.Version}}: {{.Store.GraphDriverName}}, cgroups {{.Host.CgroupsVersion}}, runtime {{.Host.OCIRuntime.Path}}'
bash "$REPO/tests/gpu/gpu-image.sh"
if [ -f "$BUNDLE/bench/busybox" ]; then  # the demo image of the CPU-sized benches
  [ -x /bin/busybox ] || install -m 755 "$BUNDLE/bench/busybox" /bin/busybox
  sh "$REPO/packaging/demo-image.sh"
fi
