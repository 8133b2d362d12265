#!/bin/sh
# Unpack the CRIU 4 .deb files of DEBDIR into PREFIX and put a `criu` wrapper
# that runs it through PREFIX's own loader at WRAPPER (default /usr/local/sbin/criu,
# ahead of /usr/sbin on PATH). Idempotent.
set -eu
DEBDIR=$1
PREFIX=${2:-/opt/gpusnap/criu}
WRAPPER=${3:-/usr/local/sbin/criu}
mkdir -p "$PREFIX" "$(dirname "$WRAPPER")"
for deb in "$DEBDIR"/*.deb; do dpkg -x "$deb" "$PREFIX"; done
LIB=$PREFIX/usr/lib/x86_64-linux-gnu
cat > "$WRAPPER" <<EOW
#!/bin/sh
# CRIU 4 from $PREFIX, run with its own glibc (installed by gpusnap).
exec $LIB/ld-linux-x86-64.so.2 --library-path $LIB $PREFIX/usr/sbin/criu "\$@"
EOW
chmod 755 "$WRAPPER"
"$WRAPPER" --version | head -1
