#!/bin/bash
# Remove what install.sh added; checkpoints on disk are not touched.
set -eu
rm -f /usr/local/bin/gpusnap /usr/share/containers/oci/hooks.d/gpusnap{,-prestart,-poststop}.json
for conf in /etc/criu/runc.conf /etc/criu/crun.conf; do
  [ -f $conf ] && sed -i '/^# BEGIN gpusnap/,/^# END gpusnap/d' $conf
done
rm -rf /opt/gpusnap/venv /opt/gpusnap/libexec
# The huge-page tmpfs of pages in RAM, only when empty: a kept checkpoint's pages may lie there.
ram=/run/gpusnap/ram
if mountpoint -q $ram && [ -z "$(ls -A $ram)" ]; then umount $ram && rmdir $ram; fi
echo "uninstall: done (CRIU in /opt/gpusnap/criu is left for other users)"
