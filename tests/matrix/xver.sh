#!/bin/bash
# Podman 4 <-> 5 archives (tests/matrix/run.sh): a counter container exported
# by one Podman, restored by the other under a new name (the checkpoint keeps
# its address, which the other host's network does not hold), counting on.
# Both sides run the same image: the host's, saved for the root to load.
#   xver.sh make  DIR NAME   export a fresh counter into DIR/NAME.tar.zst
#   xver.sh check DIR NAME   restore DIR/NAME.tar.zst as NAME-restored; it counts on
# Restored, not restarted: the process wrote a random token at start (/tmp/born),
# kept with its count before the export in DIR/NAME.seen; a fresh start differs.
set -uo pipefail
verb=$1 dir=$2 name=$3
counter='cat /proc/sys/kernel/random/uuid > /tmp/born; i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.1; done'
count() { podman exec "$1" cat /tmp/c 2>/dev/null || echo 0; }
until_above() {  # NAME N: wait (30 s at most) until NAME has counted past N
  for _ in $(seq 300); do [ "$(count "$1")" -gt "$2" ] && return 0; sleep 0.1; done; return 1
}
case $verb in
  make)
    # no pids limit: the matrix root sees no pids controller (hybrid host).
    # runc, whatever the root's default: crun refuses a hybrid cgroup host, which
    # the root is after its containerd leg, and the Debian 12 side runs runc.
    podman --runtime runc run -d --pids-limit 0 --name "$name" localhost/gpusnap-demo sh -c "$counter" >/dev/null || exit 1
    until_above "$name" 15 || { echo "xver: FAIL: $name never counted to 15"; exit 1; }
    echo "$(podman exec "$name" cat /tmp/born) $(count "$name")" > "$dir/$name.seen"
    podman container checkpoint --export "$dir/$name.tar.zst" "$name" >/dev/null || exit 1
    podman rm -f -t 0 "$name" >/dev/null
    echo "xver: $(podman --version) exported $name";;
  check)
    new=$name-restored
    podman rm -f -t 0 "$new" >/dev/null 2>&1
    if ! err=$(/usr/local/bin/gpusnap restore "$dir/$name.tar.zst" --name "$new" 2>&1 >/dev/null); then
      # A failure understood and written down, not hidden: gpusnap must say it
      # in the words XVER_KNOWN_SAYS expects, or the check fails.
      if [ -n "${XVER_KNOWN_SAYS:-}" ] && [[ "$err" == *"$XVER_KNOWN_SAYS"* ]]; then
        echo "xver: known failure, refused in one line: $(podman --version) could not restore $name: $err"; exit 0
      fi
      echo "$err"; echo "xver: FAIL: $(podman --version) could not restore $name"; exit 1
    fi
    read -r token before < "$dir/$name.seen"
    a=$(count "$new"); born=$(podman exec "$new" cat /tmp/born 2>/dev/null)
    until_above "$new" "$a"; b=$(count "$new")
    podman rm -f -t 0 "$new" >/dev/null
    if [ "$born" = "$token" ] && [ "$a" -ge "$before" ] && [ "$b" -gt "$a" ]; then
      echo "xver: ok: $(podman --version) restored $name, counting on ($before: $a -> $b)"
    else
      echo "xver: FAIL: $name not continued (token ${born:-none} for $token; $before: $a -> $b)"; exit 1
    fi;;
esac
