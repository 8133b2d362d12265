#!/bin/sh
# The skeleton image for CUDA test containers: directories and the usrmerge
# symlinks only; /usr, the PyTorch venv and the driver come from the host.
#   gpu-image.sh [IMAGE [WEIGHTS]]   WEIGHTS: a folder moved into the image as
#                                    /weights (bench/coldstart.py's server image)
set -eu
IMAGE=${1:-localhost/gpusnap-cuda:latest}
podman image exists "$IMAGE" && exit 0
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/usr" "$root/opt/torch" "$root/etc" "$root/tmp" "$root/proc" "$root/sys" \
         "$root/dev" "$root/status" "$root/work" "$root/root"
for d in bin sbin lib lib64; do ln -s "usr/$d" "$root/$d"; done
echo "root:x:0:0:root:/root:/bin/sh" > "$root/etc/passwd"
touch "$root/etc/ld.so.cache"
chmod 1777 "$root/tmp"
[ -n "${2:-}" ] && mv "$2" "$root/weights"
tar -C "$root" -c . | podman import - "$IMAGE" >/dev/null
echo "cuda test image: $IMAGE"
