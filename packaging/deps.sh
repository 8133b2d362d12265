#!/bin/bash
# System setup for gpusnap on Debian 12, as root. Idempotent: a second run
# installs nothing and takes a few seconds.
#   Podman, runc, conmon, docker-registry, zstd, busybox-static (demo image),
#   containerd 1.7 and oras from Debian 13 (pinned: nothing else is upgraded),
#   CRIU 4.2 (Debian sid) in a private prefix when the system CRIU is older or
#   fails `criu check`,
#   and the host quirks in packaging/containers/.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
export DEBIAN_FRONTEND=noninteractive
CRIU_PREFIX=${CRIU_PREFIX:-/opt/gpusnap/criu}
CACHE=${GPUSNAP_DEB_CACHE:-/var/cache/gpusnap/debs}

[ "$(id -u)" = 0 ] || { echo "deps.sh: run as root (it installs system packages)" >&2; exit 1; }

say() { echo "deps: $*"; }

install -m 644 "$HERE/apt-trixie.sources" /etc/apt/sources.list.d/gpusnap-trixie.sources
install -m 644 "$HERE/apt-trixie.pref" /etc/apt/preferences.d/gpusnap-trixie.pref
install -m 644 "$HERE/apt-sid.sources" /etc/apt/sources.list.d/gpusnap-sid.sources
install -m 644 "$HERE/apt-sid.pref" /etc/apt/preferences.d/gpusnap-sid.pref

BOOKWORM=(podman runc conmon docker-registry apache2-utils zstd busybox-static uidmap
          iptables python3-venv ca-certificates openssl)
TRIXIE=(containerd oras)
missing=()
for p in "${BOOKWORM[@]}" "${TRIXIE[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
policy=$(apt-cache policy criu 2>/dev/null)
if [[ "$policy" == *trixie* && "$policy" == *sid/main* ]]; then updated=1; else updated=0; fi
if [ ${#missing[@]} -gt 0 ] || [ $updated = 0 ]; then
  say "apt-get update"
  apt-get update -q >/dev/null
fi
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  args=()
  for p in "${missing[@]}"; do
    if [[ " ${TRIXIE[*]} " == *" $p "* ]]; then args+=("$p/trixie"); else args+=("$p"); fi
  done
  apt-get install -y -q --no-install-recommends "${args[@]}" >/dev/null
fi
# The registry package starts a service on :5000 on install; tests run their own.
systemctl disable --now docker-registry >/dev/null 2>&1 || true

criu_ok() {
  local v
  v=$(criu --version 2>/dev/null | sed -n 's/^Version: *//p') || return 1
  # 4.2 at least: 4.1 cannot dump inet sockets on Linux >= 6.16 (criu-debs.list)
  [ -n "$v" ] && printf '4.2\n%s\n' "$v" | sort -VC && criu check >/dev/null 2>&1
}
if criu_ok; then
  say "$(criu --version | head -1) passes criu check"
else
  say "installing CRIU 4.2 into $CRIU_PREFIX"
  rm -rf "$CACHE" "$CRIU_PREFIX"  # an older CRIU's libraries must not stay beside the new ones
  mkdir -p "$CACHE"
  mapfile -t pkgs < <(grep -v '^#' "$HERE/criu-debs.list" | tr ' ' '\n' | sed '/^$/d')
  (cd "$CACHE" && apt-get download -q "${pkgs[@]/%//sid}" >/dev/null 2>&1)
  "$HERE/criu-prefix.sh" "$CACHE" "$CRIU_PREFIX" /usr/local/sbin/criu
  criu_ok || { echo "deps.sh: CRIU 4.2 installed but 'criu check' fails:" >&2; criu check >&2; exit 1; }
fi

install -d /etc/containers/containers.conf.d
install -m 644 "$HERE/containers/50-gpusnap-host.conf" /etc/containers/containers.conf.d/
say "ok: podman $(podman --version | awk '{print $3}'), $(runc --version | head -1), $(criu --version | head -1), containerd $(containerd --version | awk '{print $3}'), oras $(oras version | head -1 | awk '{print $2}')"
