#!/bin/bash
# One command for a bare NVIDIA GPU machine: prepare it, run every GPU test,
# then the GPU benchmark; logs and a summary go to LOGDIR.
#   tests/gpu/run.sh LOGDIR [--no-bench]
# The bundle (make gpu-bundle) is larger than one device call carries: carry
# .gpu-bundle/{podman,criu,crun,bench,pytest} in one call and copy it aside
# (GPUSNAP_BUNDLE=DIR), {bin,wheels} in the next, then start this script with
# setsid and read LOGDIR in later calls. The registry tests need ~60 GB of disk
# at 16 GiB (registry, chunk cache, staged pull, Podman's import), each freed
# after its test; the fault tests (test_gpu_faults.py, 8 GiB) ~40 GB at a time.
set -uo pipefail
LOGDIR=${1:?usage: tests/gpu/run.sh LOGDIR [--no-bench]}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$LOGDIR"
cd "$REPO"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 GPUSNAP_TEST_LOGS=$LOGDIR/criu
{
  echo "date: $(date -u +%FT%TZ)"; uname -r
  nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total --format=csv,noheader
  ls -l /dev/nvidia* 2>&1 | head; ldconfig -p | grep -E 'libcuda.so.1|libnvidia-ml.so.1'
  stat -fc 'cgroup fs: %T' /sys/fs/cgroup; grep -E 'MemTotal' /proc/meminfo
} > "$LOGDIR/machine.txt" 2>&1
cat "$LOGDIR/machine.txt"

if ! bash tests/gpu/prepare.sh > "$LOGDIR/prepare.log" 2>&1; then
  tail -30 "$LOGDIR/prepare.log"; echo "SUMMARY: prepare failed"; exit 1
fi
tail -5 "$LOGDIR/prepare.log"
gpusnap doctor > "$LOGDIR/doctor.txt" 2>&1; cat "$LOGDIR/doctor.txt"

PY=/opt/gpusnap/venv/bin/python
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
if [ "$GPUS" -ge 2 ]; then
  echo "GPUs: $GPUS: the 2-GPU tests run first (remap, the shim's remap, two containers at once)"
  TARGETS="tests/gpu/test_gpu_remap.py tests/gpu/test_gpu_shim.py $(ls tests/gpu/test_gpu_*.py | grep -v -e _remap -e _shim | tr "\n" " ")"
else
  echo "GPUs: $GPUS: the 2-GPU tests are skipped (they need nvidia-h200-x2 or nvidia-h100-x2)"
  TARGETS=tests/gpu
fi
# Every test has a timeout (pytest-timeout, tests/gpu/conftest.py): a hang fails
# with its stack in the log instead of eating the device call.
$PY -m pytest -v --durations=0 -p no:cacheprovider -m gpu ${GPUSNAP_PYTEST_TARGETS:-$TARGETS} \
  --junitxml="$LOGDIR/gpu-tests.xml" > "$LOGDIR/gpu-tests.log" 2>&1
rc=$?
grep -E "PASSED|FAILED|ERROR|passed|failed" "$LOGDIR/gpu-tests.log" | tail -20
if [ $rc != 0 ]; then
  grep -E "^E " "$LOGDIR/gpu-tests.log" | head -40
  for f in "$LOGDIR"/criu/*.log; do
    [ -f "$f" ] && { echo "== $f"; grep -E "Error|Warn|gpusnap" "$f" | tail -12; }
  done > "$LOGDIR/criu-errors.txt" 2>&1
  tail -40 "$LOGDIR/criu-errors.txt"
fi
cp /run/gpusnap/journal.jsonl "$LOGDIR/journal.jsonl" 2>/dev/null

brc=0
if [ "${2:-}" != "--no-bench" ]; then
  $PY bench/gpu_checkpoint.py ${GPUSNAP_BENCH_ARGS:-} --out "$LOGDIR/bench.json" > "$LOGDIR/bench.log" 2>&1; brc=$?
  tail -25 "$LOGDIR/bench.log"
fi
echo "SUMMARY: gpu tests rc=$rc, bench rc=$brc, logs in $LOGDIR"
[ $rc = 0 ] && [ $brc = 0 ]
