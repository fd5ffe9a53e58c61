#!/usr/bin/env bash
# Builds the local base image pgmr-base:bookworm: a minimal Debian bookworm root filesystem made
# with debootstrap and imported with `docker import`. No container registry is reachable here, so
# no image can be pulled (not even debian:bookworm); this builds the equivalent from Debian's apt
# mirror instead. Generic on purpose: scripts/fresh-machine-ci.sh and the docker-compose demo both
# start from it.
#
#   docker/base/build.sh            build the image unless it already exists
#   docker/base/build.sh --force    rebuild it
#
# Environment: IMAGE (default pgmr-base:bookworm), MIRROR (default http://deb.debian.org/debian).
set -euo pipefail

IMAGE=${IMAGE:-pgmr-base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
# What a fresh CI machine has besides Rust: git and curl for fetching, a C toolchain for build
# scripts, ps/pgrep/kill for process-level tests.
PACKAGES=ca-certificates,git,curl,make,gcc,libc6-dev,procps
say() { printf '==> %s\n' "$*" >&2; }

force=0
case "${1:-}" in
  --force) force=1 ;;
  "") ;;
  *) echo "usage: $0 [--force]" >&2; exit 2 ;;
esac

[ "$(id -u)" -eq 0 ] || { echo "error: debootstrap needs root" >&2; exit 1; }

if [ "$force" -eq 0 ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  say "$IMAGE already exists (use --force to rebuild)"
  exit 0
fi

if ! command -v debootstrap >/dev/null; then
  say "installing debootstrap"
  # Only Debian's own sources are needed; a broken third-party list must not stop the update.
  apt-get update -qq || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi

rootfs=$(mktemp -d "${TMPDIR:-/tmp}/pgmr-base-rootfs.XXXXXX")
trap 'rm -rf "$rootfs" "$rootfs.log"' EXIT

say "debootstrap $SUITE (minbase + $PACKAGES) from $MIRROR"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" \
  >"$rootfs.log" 2>&1 || { tail -n 40 "$rootfs.log" >&2; exit 1; }

# Apt sources like the official image (updates and security), and an image without the
# package caches debootstrap leaves behind.
cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
SOURCES
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*

say "importing as $IMAGE"
tar -C "$rootfs" --numeric-owner -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --message "debootstrap --variant=minbase $SUITE (+$PACKAGES) from $MIRROR" \
  - "$IMAGE" >/dev/null
docker image inspect -f '{{.Id}} {{.Size}}' "$IMAGE" | awk -v i="$IMAGE" '{printf "==> %s: %s, %.0f MB\n", i, $1, $2/1e6}' >&2
