#!/bin/bash
# Inside a matrix root (chroot.sh): install gpusnap from /src into this root as
# `make install` does on the host, then run the integration tests that matter
# most once per OCI runtime. Results: /src/.matrix/DIST-RUNTIME.xml (git-ignored).
#   inside.sh DIST RUNTIME...
set -uo pipefail
DIST=$1
shift
cd /src
# The host's cgroups are hybrid (v1 controllers, an empty v2 at unified/):
# crun refuses hybrid mode, so this root sees the v2 hierarchy alone, as a
# unified host would show it. Without controllers, no pids limit can be set.
if [ "$(stat -fc %T /sys/fs/cgroup)" != cgroup2fs ] && [ -d /sys/fs/cgroup/unified ]; then
  mount --bind /sys/fs/cgroup/unified /sys/fs/cgroup
fi
# CRIU dumps the properties of every cgroup below a container's: the empty
# ones earlier runs left under libpod_parent (nested, after a failed crun
# restore) made one dump of a counter take minutes and a 280 MB log.
find /sys/fs/cgroup/libpod_parent -mindepth 1 -depth -type d -exec rmdir {} + 2>/dev/null || true
# Every run from empty container storage: the root persists between runs and
# /run does not, so Podman would otherwise "refresh" what earlier runs left.
rm -rf /var/lib/containers/storage /var/lib/containers/.gpusnap-* /var/lib/gpusnap
cat > /etc/containers/containers.conf.d/45-gpusnap-matrix-limits.conf <<'EOC'
[containers]
pids_limit = 0
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
EOC
# Where containerd 2 is, as a Kubernetes node gets it (installer.yaml's script).
if command -v containerd >/dev/null && containerd --version | grep -q ' v\?2\.'; then
  GPUSNAP_PYTHON=python3 bash packaging/kubernetes/node-install.sh / >/tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
  tail -1 /tmp/install.log
else
  GPUSNAP_PYTHON=python3 bash packaging/install.sh >/tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
fi
# runc 1.1.13-1.1.x (trixie) fails 1 start in ~20 on this kernel while sealing
# its memfd copy (seal-binary.py says why): give it the sealed copy once.
if command -v runc >/dev/null && runc --version | grep -q '^runc version 1\.1\.'; then
  seal=$(python3 tests/matrix/seal-binary.py "$(command -v runc)") || { echo "$seal"; exit 1; }
  echo "$seal"
  trap 'kill '"$(sed -n 's/.*holder pid \([0-9]*\).*/\1/p' <<<"$seal")"' 2>/dev/null' EXIT
fi
sh packaging/demo-image.sh >/dev/null
echo "matrix $DIST: $(podman --version), $(criu --version | head -1), $(python3 --version)"
TESTS=${GPUSNAP_MATRIX_TESTS:-tests/integration/test_checkpoint_restore.py tests/integration/test_page_fill.py tests/integration/test_dump_ahead.py tests/integration/test_replicas.py tests/integration/test_sockets.py tests/integration/test_runtime_config.py tests/integration/test_registry_podman.py tests/integration/test_registry.py::test_a_leave_running_push_restores_or_is_refused_before_a_reference}
mkdir -p /src/.matrix
# One pytest run per runtime; tests that failed run once more, alone, and are
# counted ("retried: N", docs/reliability.md; goal 0). A clean run prints its
# last lines; one that needed a retry prints each failure whole (with the CRIU
# logs tests/conftest.py adds): the cause of a flake is in the CI log. The
# whole output stays in .matrix/pytest-LABEL.log.
run_tests() {
  local label=$1 log=/src/.matrix/pytest-$1.log rc
  shift
  bash tests/retry-once.sh "$label" "/tmp/pytest-cache-$label" -m "not gpu" "$@" >"$log" 2>&1
  rc=$?
  if grep -q "^retried ($label): 0$" "$log"; then
    tail -15 "$log"
  elif grep -q "= FAILURES =\|= ERRORS =" "$log"; then
    sed -n '/= FAILURES =\|= ERRORS =/,$p' "$log"
  else
    tail -60 "$log"
  fi
  return $rc
}
rc=0
for runtime in "$@"; do
  podman rm -af -t 0 >/dev/null 2>&1  # what an earlier run left (the root persists)
  printf '[engine]\nruntime = "%s"\n' "$runtime" > /etc/containers/containers.conf.d/50-gpusnap-matrix-runtime.conf
  echo "== $DIST + $runtime ($(podman info --format '{{.Host.OCIRuntime.Name}} {{.Host.OCIRuntime.Version}}' | head -1))"
  start=$(date +%s)
  run_tests "$DIST-$runtime" $TESTS || rc=1
  echo "== $DIST + $runtime: $(( $(date +%s) - start )) s"
done
# containerd 2 (sid): the shim's tests and Kubernetes' CRI path. Under the
# host's v1 cgroups: with the empty v2 hierarchy alone runc cannot set the CPU
# weight a CRI sandbox or `ctr run` asks for (containerd 2.1 still runs on v1).
if command -v containerd >/dev/null && containerd --version | grep -q ' v\?2\.'; then
  mountpoint -q /sys/fs/cgroup && [ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ] && umount /sys/fs/cgroup
  echo "== $DIST + $(containerd --version | awk '{print "containerd", $3}') + gpusnap shim, CRI"
  start=$(date +%s)
  CTESTS=${GPUSNAP_MATRIX_CONTAINERD_TESTS:-tests/integration/test_shim.py tests/integration/test_shim_registry.py tests/integration/test_shim_migrate.py tests/integration/test_shim_nerdctl_rpcs.py tests/integration/test_shim_remap.py tests/integration/test_shim_binlog.py tests/integration/test_cri.py}
  run_tests "$DIST-containerd" $CTESTS || rc=1
  echo "== $DIST + containerd: $(( $(date +%s) - start )) s"
fi
X=/src/.matrix/xver  # Podman 4 <-> 5 archives (run.sh, xver.sh), with the host's image
if [ -f $X/from-host.tar.zst ]; then
  podman rm -af -t 0 >/dev/null 2>&1
  podman load -q -i $X/demo.tar >/dev/null
  # Podman 4.3's checkpoint from this hybrid-cgroup host: CRIU in the v2-only
  # view finds a mount it has no mapping for (the v1 controllers' mounts);
  # gpusnap's error must say so (criu/log.py). sid runs on v1 here: restores.
  XVER_KNOWN_SAYS="a checkpoint from a cgroup v1 host does not restore on this cgroup v2 host" \
    bash /src/tests/matrix/xver.sh check $X from-host || rc=1
  bash /src/tests/matrix/xver.sh make $X "from-$DIST" || rc=1
fi
exit $rc
