#!/usr/bin/env bash
# Every test: unit tests of the pure crates and pgmr, cluster tests (real pgmr processes and
# PostgreSQL servers), and the pg_regress suite. Expects scripts/setup.sh and scripts/build.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "==> unit and cluster tests" >&2
cargo test --quiet

echo "==> pg_regress" >&2
scripts/regress.sh

echo "==> docker-compose demo" >&2
scripts/compose.sh test
