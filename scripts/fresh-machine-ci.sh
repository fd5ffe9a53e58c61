#!/usr/bin/env bash
# Runs the CI entry point .ci/run as on a brand-new Debian bookworm machine and times it: a clean
# clone of the committed HEAD, in a container from pgmr-base:bookworm (docker/base/build.sh), that
# has nothing of ours but the host's Rust toolchain (rustup + the default toolchain, mounted
# read-only). No crate cache, no cargo-pgrx, no ~/.pgrx, no target/: all fetched and built afresh.
# The host's PostgreSQL, ~/.cargo and this checkout's target/ are not touched.
#
#   scripts/fresh-machine-ci.sh [--warm] [--keep] [--with-uncommitted]
#
#   --warm              after the fresh run, run .ci/run again in the same container and time it
#   --keep              keep the container and the scratch directory even on success
#   --with-uncommitted  apply the checkout's uncommitted changes (tracked files, and untracked
#                       files that are not ignored) to the clone; the default tests HEAD only
#
# Logs (one per run, and a summary with exit codes and wall times) are left in <scratch>/logs/.
# On failure the container (stopped) and the whole scratch directory are kept: the clone with its
# target/ and regress/results/ is in <scratch>/src.
#
# Network: the container uses Docker's default bridge network (its own network namespace, so its
# PostgreSQL servers and pgmr ports cannot collide with anything on the host). Egress works from
# there; if the host trusts extra CAs (e.g. a TLS-intercepting egress proxy), those certificates
# are added to the container's trust store, as a machine's provisioning would (HOST_CAS=0: don't).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${IMAGE:-pgmr-base:bookworm}
RUSTUP_HOME_HOST=${RUSTUP_HOME:-$HOME/.rustup}
CARGO_BIN_HOST=${CARGO_HOME:-$HOME/.cargo}/bin
HOST_CAS=${HOST_CAS:-1}
say() { printf '==> %s\n' "$*" >&2; }

warm=0 keep=0 uncommitted=0
for arg in "$@"; do
  case "$arg" in
    --warm) warm=1 ;;
    --keep) keep=1 ;;
    --with-uncommitted) uncommitted=1 ;;
    *) sed -n '8,13p' "$0" >&2; exit 2 ;;
  esac
done

"$repo/docker/base/build.sh"

work=$(mktemp -d "${TMPDIR:-/tmp}/pgmr-fresh-ci.XXXXXX")
name=pgmr-fresh-ci-$(basename "$work" | cut -d. -f2 | tr 'A-Z' 'a-z')
mkdir -p "$work/logs"
say "scratch directory $work, container $name"

# --- the clone --------------------------------------------------------------------------------
head=$(git -C "$repo" rev-parse HEAD)
git clone --quiet --no-hardlinks "$repo" "$work/src"
git -C "$work/src" checkout --quiet --detach "$head"
if [ "$uncommitted" -eq 1 ]; then
  git -C "$repo" diff --binary HEAD | git -C "$work/src" apply --allow-empty
  git -C "$repo" ls-files -z --others --exclude-standard | (cd "$repo" && xargs -0r cp --parents -t "$work/src")
  say "clone of $head plus the uncommitted changes: $(git -C "$work/src" status --short | wc -l) paths"
else
  say "clone of $head"
fi

# --- the Rust toolchain: rustup, its proxies and the default toolchain, nothing else ----------
# A fresh machine with Rust from rustup has ~/.rustup and ~/.cargo/bin with the rustup proxies;
# here the toolchain directory itself is bind-mounted read-only (1.4 GB, not worth copying).
toolchain=$(sed -n 's/^default_toolchain *= *"\(.*\)"/\1/p' "$RUSTUP_HOME_HOST/settings.toml")
toolchain_dir=$(readlink -f "$RUSTUP_HOME_HOST/toolchains/$toolchain")
[ -x "$toolchain_dir/bin/cargo" ] || { echo "error: no toolchain at $toolchain_dir" >&2; exit 1; }
mkdir -p "$work/rustup/toolchains" "$work/cargo/bin" "$work/tmp"
cp "$RUSTUP_HOME_HOST/settings.toml" "$work/rustup/"
# Other names of the same toolchain (e.g. 1.95.0 -> stable) stay usable.
for t in "$RUSTUP_HOME_HOST"/toolchains/*; do
  if [ "$t" != "$toolchain_dir" ] && [ "$(readlink -f "$t")" = "$toolchain_dir" ]; then
    ln -s "/root/.rustup/toolchains/$(basename "$toolchain_dir")" "$work/rustup/toolchains/$(basename "$t")"
  fi
done
cp "$CARGO_BIN_HOST/rustup" "$work/cargo/bin/"
# Proxies only (links to rustup): whatever else `cargo install` put there (cargo-pgrx!) stays out.
for f in "$CARGO_BIN_HOST"/*; do
  [ "$(basename "$f")" = rustup ] && continue
  if [ "$(readlink -f "$f")" = "$(readlink -f "$CARGO_BIN_HOST/rustup")" ] || [ "$f" -ef "$CARGO_BIN_HOST/rustup" ]; then
    ln -s rustup "$work/cargo/bin/$(basename "$f")"
  fi
done
# PostgreSQL (run as user postgres) and cargo install write to /tmp.
chmod 1777 "$work/tmp"

# --- the machine ------------------------------------------------------------------------------
# --init: a real PID 1 that reaps orphans (pg_ctl-started servers are reparented to it; without
# it they would linger as zombies). --shm-size: PostgreSQL's dynamic shared memory lives in
# /dev/shm, which Docker caps at 64 MB; a real machine has half its RAM there. /tmp, ~/.cargo and
# /src are host directories: bind mounts bypass the container's (FUSE) overlay filesystem, which
# would make compiling and initdb much slower than on a real disk.
# The host's Docker engine, as a CI machine of this kind has one: the compose test builds its
# images and runs its stack there (the stack's published ports are the host's, not this
# container's, hence PGMR_COMPOSE_NO_HOST_PORTS). HOST_DOCKER=0: no engine, the test skips.
docker_args=()
if [ "${HOST_DOCKER:-1}" = 1 ] && [ -S /var/run/docker.sock ]; then
  docker_args=(-v /var/run/docker.sock:/var/run/docker.sock -e PGMR_COMPOSE_NO_HOST_PORTS=1)
fi
say "starting $name from $IMAGE"
docker run -d --init --name "$name" --hostname fresh-ci --shm-size=2g "${docker_args[@]}" \
  -e CI=true -e HOME=/root -e USER=root -e LOGNAME=root \
  -e PATH=/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  -v "$work/src:/src" -v "$work/tmp:/tmp" -v "$work/cargo:/root/.cargo" -v "$work/rustup:/root/.rustup" \
  -v "$toolchain_dir:/root/.rustup/toolchains/$(basename "$toolchain_dir"):ro" \
  -w /src "$IMAGE" sleep infinity >/dev/null

if [ "$HOST_CAS" = 1 ]; then
  # Certificates the host trusts beyond what Debian's ca-certificates ships.
  docker exec "$name" cat /etc/ssl/certs/ca-certificates.crt >"$work/container-cas.pem"
  python3 - /etc/ssl/certs/ca-certificates.crt "$work/container-cas.pem" "$work/extra-cas" <<'PY'
import os, re, sys
pem = lambda p: re.findall(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", open(p).read(), re.S)
known = {c.strip() for c in pem(sys.argv[2])}
extra = [c for c in pem(sys.argv[1]) if c.strip() not in known]
os.makedirs(sys.argv[3], exist_ok=True)
for i, c in enumerate(extra):
    open(os.path.join(sys.argv[3], f"host-extra-{i}.crt"), "w").write(c + "\n")
PY
  n=$(find "$work/extra-cas" -name '*.crt' | wc -l)
  if [ "$n" -gt 0 ]; then
    say "adding $n CA certificate(s) the host trusts to the container's trust store"
    docker cp "$work/extra-cas/." "$name:/usr/local/share/ca-certificates/"
    docker exec "$name" update-ca-certificates >/dev/null 2>&1
  fi
fi

# --- the runs ---------------------------------------------------------------------------------
status=0
# Prefixes each line with the minutes:seconds since the run started, to see where time goes.
stamp() {
  local t0=$SECONDS line
  while IFS= read -r line || [ -n "$line" ]; do
    printf '%02d:%02d %s\n' $(((SECONDS - t0) / 60)) $(((SECONDS - t0) % 60)) "$line"
  done
}
run_ci() {
  local label=$1 log="$work/logs/$1.log" start secs rc=0
  say "$label run: /src/.ci/run (log: $log)"
  start=$(date +%s)
  docker exec "$name" /src/.ci/run 2>&1 | stamp >"$log" || rc=${PIPESTATUS[0]}
  secs=$(( $(date +%s) - start ))
  tail -n 25 "$log" | sed "s/^/    [$label] /" >&2
  printf '==> %s run: exit code %d, wall time %dm%02ds (%d s)\n' "$label" "$rc" $((secs / 60)) $((secs % 60)) "$secs" |
    tee -a "$work/logs/summary" >&2
  [ "$rc" -eq 0 ] || status=$rc
  return "$rc"
}

if run_ci fresh && [ "$warm" -eq 1 ]; then
  run_ci warm || true
fi

if [ "$status" -ne 0 ]; then
  docker exec "$name" bash -c 'ps -ef; echo; dpkg -l | grep -i postgres' >"$work/logs/container-state.txt" 2>&1 || true
  docker logs "$name" >"$work/logs/container.log" 2>&1 || true
  docker stop -t 5 "$name" >/dev/null || true
  say "FAILED: kept container $name (stopped; docker start $name to inspect) and $work (logs in $work/logs)"
  exit "$status"
fi
if [ "$keep" -eq 1 ]; then
  say "kept container $name and $work"
else
  docker rm -f "$name" >/dev/null
  # Everything but the logs.
  find "$work" -mindepth 1 -maxdepth 1 ! -name logs -exec rm -rf {} +
  say "logs in $work/logs"
fi
say "passed"
