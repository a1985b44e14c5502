#!/usr/bin/env bash
# Stand-ins for the base images compose.yaml and the Dockerfile name, built from Debian's packages, for a
# machine that cannot pull from Docker Hub. Each image that can be pulled (or is already here) is left as
# it is. Needs root, debootstrap and a Docker engine.
#   python:3.11-slim  Debian bookworm (minbase) with its python3 (3.11), venv, pip, headers, make and g++,
#                     and this machine's CA bundle (so pip inside reaches the package index)
#   redis:7-alpine    the same root file system with Debian's redis-server (7.0); its entrypoint turns
#                     protected mode off, as the official image's does when it is given no config file
# ROOTFS (default /var/cache/mfs-standins/bookworm) keeps the debootstrap between runs.
set -euo pipefail
ROOTFS=${ROOTFS:-/var/cache/mfs-standins/bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

have() { docker image inspect "$1" >/dev/null 2>&1 || timeout 60 docker pull -q "$1" >/dev/null 2>&1; }

need=()
have python:3.11-slim || need+=(python)
have redis:7-alpine || need+=(redis)
[ ${#need[@]} -gt 0 ] || { echo "standins: python:3.11-slim and redis:7-alpine are here"; exit 0; }

if [ ! -x "$ROOTFS/usr/bin/python3" ]; then
  command -v debootstrap >/dev/null || { echo "standins: debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }
  echo "standins: debootstrap bookworm into $ROOTFS (Debian's packages, a few minutes once)"
  rm -rf "$ROOTFS.tmp" && mkdir -p "$(dirname "$ROOTFS")"
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,python3-dev,redis-server,make,g++,ca-certificates,curl \
    bookworm "$ROOTFS.tmp" "$MIRROR" >"$ROOTFS.log" 2>&1 || { tail -20 "$ROOTFS.log" >&2; exit 1; }
  mv "$ROOTFS.tmp" "$ROOTFS"
fi
cp "$CA" "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
ln -sf python3 "$ROOTFS/usr/bin/python"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
cat >"$ROOTFS/usr/local/bin/redis-entrypoint" <<'SH'
#!/bin/sh
# as the official image: a redis-server given no config file runs with protected mode off
if [ "$1" = redis-server ] && [ "${2#*.conf}" = "$2" ]; then shift; set -- redis-server --protected-mode no "$@"; fi
mkdir -p /data && cd /data && exec "$@"
SH
chmod +x "$ROOTFS/usr/local/bin/redis-entrypoint"
for what in "${need[@]}"; do
  if [ "$what" = python ]; then
    echo "standins: python:3.11-slim from $ROOTFS"
    tar -C "$ROOTFS" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' - python:3.11-slim >/dev/null
  else
    echo "standins: redis:7-alpine from $ROOTFS"
    tar -C "$ROOTFS" -c . | docker import -c 'ENTRYPOINT ["/usr/local/bin/redis-entrypoint"]' \
      -c 'CMD ["redis-server"]' -c 'WORKDIR /data' -c 'EXPOSE 6379' - redis:7-alpine >/dev/null
  fi
done
