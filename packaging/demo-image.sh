#!/bin/sh
# Build the local demo image (no image registry is reachable here): a
# busybox-static root filesystem, imported as localhost/gpusnap-demo:latest.
set -eu
IMAGE=${1:-localhost/gpusnap-demo:latest}
if podman image exists "$IMAGE"; then exit 0; fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/bin" "$root/tmp" "$root/proc" "$root/sys" "$root/dev" "$root/etc"
cp /bin/busybox "$root/bin/busybox"
for applet in sh sleep echo cat ls ps kill date seq head dd; do ln -s busybox "$root/bin/$applet"; done
echo "root:x:0:0:root:/:/bin/sh" > "$root/etc/passwd"
tar -C "$root" -c . | podman import --change 'CMD ["/bin/sh"]' - "$IMAGE" >/dev/null
echo "demo image: $IMAGE"
