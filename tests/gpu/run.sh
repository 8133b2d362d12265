#!/bin/bash
# One command for a bare NVIDIA GPU machine: prepare it, run every GPU test,
# then the GPU benchmark; logs and a summary go to LOGDIR.
#   tests/gpu/run.sh LOGDIR [--no-bench]
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
$PY -m pytest -v -p no:cacheprovider -m gpu ${GPUSNAP_PYTEST_TARGETS:-tests/gpu} --junitxml="$LOGDIR/gpu-tests.xml" \
  > "$LOGDIR/gpu-tests.log" 2>&1
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
