#!/bin/bash
# Remove what install.sh added; checkpoints on disk are not touched.
set -eu
rm -f /usr/local/bin/gpusnap /usr/share/containers/oci/hooks.d/gpusnap{,-prestart,-poststop}.json
[ -f /etc/criu/runc.conf ] && sed -i '/^# BEGIN gpusnap/,/^# END gpusnap/d' /etc/criu/runc.conf
rm -rf /opt/gpusnap/venv /opt/gpusnap/libexec
echo "uninstall: done (CRIU in /opt/gpusnap/criu is left for other users)"
