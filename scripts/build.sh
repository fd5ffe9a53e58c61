#!/usr/bin/env bash
# Builds pgmr and installs the extension into the system PostgreSQL 15. Incremental.
set -euo pipefail
cd "$(dirname "$0")/.."
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
sudo_flag=()
[ "$(id -u)" -eq 0 ] || sudo_flag=(--sudo)

echo "==> building pgmr" >&2
cargo build --quiet -p pgmr
echo "==> building and installing the pg_multiregion extension" >&2
# Release: the extension runs in every backend (capture, routing hooks); a debug build made a
# bulk load's capture 1.6x slower. Quiet when it works, everything when it does not.
log=$(mktemp)
if ! (cd extension && cargo pgrx install --release --pg-config "$PG_CONFIG" "${sudo_flag[@]}") >"$log" 2>&1; then
  cat "$log" >&2
  rm -f "$log"
  exit 1
fi
rm -f "$log"
# Released versions' install scripts and the upgrade scripts between them (sql/README.md),
# next to the current version's, which pgrx generated.
extdir="$("$PG_CONFIG" --sharedir)/extension"
if [ "$(id -u)" -eq 0 ]; then
  install -m 0644 sql/pg_multiregion--*.sql "$extdir/"
else
  sudo install -m 0644 sql/pg_multiregion--*.sql "$extdir/"
fi
