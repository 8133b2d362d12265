#!/bin/bash
# Podman 4 <-> 5 archives (tests/matrix/run.sh): a counter container exported
# by one Podman, restored by the other under a new name (the checkpoint keeps
# its address, which the other host's network does not hold), counting on.
# Both sides run the same image: the host's, saved for the root to load.
#   xver.sh make  DIR NAME   export a fresh counter into DIR/NAME.tar.zst
#   xver.sh check DIR NAME   restore DIR/NAME.tar.zst as NAME-restored; it counts on
set -uo pipefail
verb=$1 dir=$2 name=$3
counter='i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.1; done'
case $verb in
  make)
    # no pids limit: the matrix root sees no pids controller (hybrid host)
    podman run -d --pids-limit 0 --name "$name" localhost/gpusnap-demo sh -c "$counter" >/dev/null || exit 1
    sleep 2
    podman container checkpoint --export "$dir/$name.tar.zst" "$name" >/dev/null || exit 1
    podman rm -f "$name" >/dev/null
    echo "xver: $(podman --version) exported $name";;
  check)
    new=$name-restored
    podman rm -f "$new" >/dev/null 2>&1
    if ! err=$(/usr/local/bin/gpusnap restore "$dir/$name.tar.zst" --name "$new" 2>&1 >/dev/null); then
      # A failure understood and written down, not hidden: gpusnap must say it
      # in the words XVER_KNOWN_SAYS expects, or the check fails.
      if [ -n "${XVER_KNOWN_SAYS:-}" ] && [[ "$err" == *"$XVER_KNOWN_SAYS"* ]]; then
        echo "xver: known failure, refused in one line: $(podman --version) could not restore $name: $err"; exit 0
      fi
      echo "$err"; echo "xver: FAIL: $(podman --version) could not restore $name"; exit 1
    fi
    a=$(podman exec "$new" cat /tmp/c); sleep 1; b=$(podman exec "$new" cat /tmp/c)
    podman rm -f "$new" >/dev/null
    # from the checkpoint's count (~20 after 2 s), not from 1
    if [ "${b:-0}" -gt "${a:-0}" ] && [ "${a:-0}" -ge 15 ]; then
      echo "xver: ok: $(podman --version) restored $name, counting on ($a -> $b)"
    else
      echo "xver: FAIL: $name restored but not counting on ($a -> $b)"; exit 1
    fi;;
esac
