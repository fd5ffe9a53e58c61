#!/bin/sh
# Starts this container's node: `pgmr start` with the locality and join address from the
# environment (docker-compose.yml), listening on every interface of the container.
#
#   PGMR_LOCALITY   e.g. region=us-east1,zone=us-east1-b (required)
#   PGMR_JOIN       RPC address of a node to join through; unset on the first node, which
#                   bootstraps the cluster (and, restarted, rejoins from its data directory)
#   PGMR_LATENCY    simulated WAN, `global` for the MovR tutorial's RTTs (default: none)
#   PGMR_TRUST      networks PostgreSQL lets in without a password (pgmr --pg-trust)
#
# The cluster secret that authenticates every inter-node connection lives in the volume at
# /secret, shared by the nodes and nothing else: the first node to start writes it.
set -eu
: "${PGMR_LOCALITY:?PGMR_LOCALITY is not set (e.g. region=us-east1,zone=us-east1-b)}"

secret=/secret/cluster-secret
if [ ! -s "$secret" ]; then
    umask 077
    tmp=$(mktemp /secret/.cluster-secret.XXXXXX)
    od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$tmp"
    # A hard link never replaces an existing file: if two nodes race, the first one wins.
    ln "$tmp" "$secret" 2>/dev/null || true
    rm -f "$tmp"
fi

host=$(hostname)
set -- start \
    --locality "$PGMR_LOCALITY" \
    --data-dir /var/lib/pgmr \
    --listen 0.0.0.0:26357 \
    --advertise "$host:26357" \
    --secret-file "$secret" \
    --pg-listen 0.0.0.0 \
    --pg-port 5432 \
    --sql-listen 0.0.0.0:26257 \
    --http-listen 0.0.0.0:8080 \
    --join-timeout 10m \
    "$@"
[ -n "${PGMR_JOIN:-}" ] && set -- "$@" --join "$PGMR_JOIN"
[ -n "${PGMR_LATENCY:-}" ] && set -- "$@" --latency "$PGMR_LATENCY"
[ -n "${PGMR_TRUST:-}" ] && set -- "$@" --pg-trust "$PGMR_TRUST"
exec pgmr "$@"
