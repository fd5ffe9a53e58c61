#!/usr/bin/env bash
# Installs what building and running pg_multiregion needs on Debian bookworm, and nothing that
# is already there: a second run takes a second or two.
set -euo pipefail

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
PGRX_VERSION=0.18.0
sudo_() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
say() { printf '==> %s\n' "$*" >&2; }

missing=()
# chromium (headless) and a font: the console tests render every page and save screenshots.
for pkg in postgresql-15 postgresql-server-dev-15 libclang-dev clang pkg-config gcc make libc6-dev ca-certificates python3 python3-venv chromium fonts-dejavu-core; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  sudo_ apt-get update -qq
  sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

command -v cargo >/dev/null || { echo "error: cargo not found; install Rust (rustup) first" >&2; exit 1; }

if ! cargo pgrx --version 2>/dev/null | grep -q " ${PGRX_VERSION}\$"; then
  say "installing cargo-pgrx ${PGRX_VERSION} (about 6 minutes, once)"
  cargo install cargo-pgrx --version "${PGRX_VERSION}" --locked --quiet
fi

PGRX_HOME=${PGRX_HOME:-$HOME/.pgrx}
if ! grep -q "^pg15 *= *\"${PG_CONFIG}\"" "$PGRX_HOME/config.toml" 2>/dev/null; then
  say "pointing pgrx at ${PG_CONFIG}"
  cargo pgrx init --pg15 "${PG_CONFIG}" >/dev/null
fi

# PostgreSQL refuses to run as root; pgmr runs it as this user.
id postgres >/dev/null 2>&1 || { echo "error: OS user 'postgres' is missing (it comes with postgresql-15)" >&2; exit 1; }
