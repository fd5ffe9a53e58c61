#!/usr/bin/env bash
# The docker-compose demo (docker/docker-compose.yml): nine nodes in three regions and the
# MovR-style workload, from images built here on the local base image (no registry needed).
#
#   scripts/compose.sh up     stage the build, build the images, start everything in the
#                             background, wait until every node is healthy, say what to open
#   scripts/compose.sh down   stop and remove the containers, the network and the volumes
#   scripts/compose.sh test   up under its own project name, check it (below), then down
#
# Expects `make build` (the pgmr binary and the installed extension are what the node image
# carries); PGMR_BIN picks the binary (default target/debug/pgmr; `make compose-up` builds and
# uses target/release/pgmr: nine debug builds idle at ~15 % of a core each). Uses `docker-compose` (1.29) or, where that is missing, `docker compose` (v2).
# The test is skipped, saying so, where no Docker engine answers.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
project=${COMPOSE_PROJECT:-pgmr}
say() { printf '==> %s\n' "$*" >&2; }

compose() {
    if command -v docker-compose >/dev/null; then
        docker-compose -f docker/docker-compose.yml -p "$project" "$@"
    else
        docker compose -f docker/docker-compose.yml -p "$project" "$@"
    fi
}

# The node image's payload, from this machine's build: pgmr without its debug sections, and
# the extension as `cargo pgrx install` put it into PostgreSQL 15's directories.
stage() {
    local out=target/compose
    rm -rf "$out"
    mkdir -p "$out/extension/lib" "$out/extension/share"
    strip --strip-debug -o "$out/pgmr" "${PGMR_BIN:-target/debug/pgmr}"
    cp "$("$PG_CONFIG" --pkglibdir)/pg_multiregion.so" "$out/extension/lib/"
    local ext
    ext="$("$PG_CONFIG" --sharedir)/extension"
    cp "$ext/pg_multiregion.control" "$ext"/pg_multiregion--*.sql "$out/extension/share/"
}

# Waits until every node's health check passes (up to 10 minutes: nine PostgreSQL servers
# start one after another on a small machine).
wait_healthy() {
    local deadline=$((SECONDS + 600)) n status
    for n in 1 2 3 4 5 6 7 8 9; do
        while :; do
            status=$(docker inspect -f '{{.State.Health.Status}}' "$(compose ps -q "node$n")" 2>/dev/null || true)
            [ "$status" = healthy ] && break
            if [ "$SECONDS" -gt "$deadline" ]; then
                say "node$n is not healthy ($status) after 10 minutes; its log:"
                compose logs --tail 40 "node$n" >&2
                return 1
            fi
            sleep 2
        done
    done
}

up() {
    "$root/docker/base/build.sh"
    stage
    say "building the images"
    compose build --quiet node1 workload >/dev/null
    say "starting nine nodes, one after another, and the workload"
    compose up -d
    wait_healthy
    cat <<EOF
pg_multiregion on docker-compose: 3 regions x 3 nodes, simulated WAN, MovR workload running.
  SQL (CockroachDB's door):  psql -h 127.0.0.1 -p 26257 -U root defaultdb   (node N: 26257+N-1)
  PostgreSQL:                psql -h 127.0.0.1 -p 15432 -U root defaultdb   (node N: 15432+N-1)
  DB Console:                http://127.0.0.1:8080/   (/network, /sql, /ranges, /metrics)
  Workload latencies:        docker-compose -f docker/docker-compose.yml -p $project logs -f workload
  Stop and remove it all:    make compose-down
EOF
}

down() {
    compose down --volumes --remove-orphans --timeout 60
}

# SQL through node N's gateway, from inside its container (reachable wherever the test runs,
# including a CI container that talks to the host's Docker engine).
sql() {
    local n=$1; shift
    compose exec -T "node$n" psql -X -q -At -v ON_ERROR_STOP=1 -h 127.0.0.1 -p 26257 -U root -d defaultdb "$@"
}

save_logs() {
    local dir=target/compose-test-logs s
    rm -rf "$dir" && mkdir -p "$dir"
    compose ps >&2 || true
    for s in $(compose ps --services 2>/dev/null); do
        compose logs --no-color "$s" >"$dir/$s.log" 2>&1 || true
    done
    grep -h -A4 "panicked at" "$dir"/*.log >&2 || true
    compose logs --no-color --tail 20 >&2 || true
    say "whole logs of every container: $dir/"
}

test_stack() {
    # An engine's socket without the tools to talk to it (a CI container given the host's
    # engine): install Debian's client and docker-compose.
    if [ -S /var/run/docker.sock ] && ! command -v docker >/dev/null && [ "$(id -u)" -eq 0 ]; then
        say "installing docker.io and docker-compose (clients of the engine at /var/run/docker.sock)"
        apt-get update -qq || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            docker.io docker-compose >/dev/null
    fi
    if ! docker info >/dev/null 2>&1; then
        say "compose test SKIPPED: no Docker engine answers here (docker info failed)"
        return 0
    fi
    project=pgmr-test
    local busy
    busy=$(for p in 26257 15432 8080; do (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && echo "$p"; done || true)
    if [ -n "$busy" ]; then
        echo "compose test: ports $busy are in use on this host (a demo running? make compose-down)" >&2
        return 1
    fi
    # On failure: the state, every container's whole log kept in target/compose-test-logs/,
    # and any panic's message shown.
    trap 'status=$?; [ $status -eq 0 ] || save_logs; down >/dev/null 2>&1 || true; exit $status' EXIT
    up

    say "a row written through us-east1 (node 1) is read back through europe-west1 (node 7)"
    sql 1 -c "CREATE DATABASE compose_check"
    sql 1 -d compose_check -c "CREATE TABLE kv (k INT PRIMARY KEY, v TEXT)" \
          -c "INSERT INTO kv VALUES (1, 'written through node1')"
    local got
    got=$(sql 7 -d compose_check -c "SELECT v FROM kv WHERE k = 1")
    [ "$got" = "written through node1" ] || { echo "node 7 read '$got'" >&2; return 1; }

    say "every node is a member, live, in its region"
    got=$(sql 5 -c "SELECT count(*) FILTER (WHERE status = 'live') || ' live of ' || count(DISTINCT region) || ' regions' FROM multiregion.nodes")
    [ "$got" = "9 live of 3 regions" ] || { echo "nodes: $got" >&2; return 1; }

    say "the workload loads, configures multi-region and reports latencies for every region"
    local deadline=$((SECONDS + 600)) log=""
    while [ "$SECONDS" -lt "$deadline" ]; do
        log=$(compose logs --no-color workload 2>&1)
        if grep -q 'workload failed\|Traceback' <<<"$log"; then
            echo "$log" >&2
            return 1
        fi
        if grep -q 'configure-multi-region took' <<<"$log" &&
           [ "$(grep -cE '^\S*\s*\|?\s*(us-east1|us-west1|europe-west1) +insert' <<<"$log")" -ge 3 ]; then
            break
        fi
        sleep 5
    done
    grep -q 'configure-multi-region took' <<<"$log" || { echo "$log" >&2; return 1; }
    echo "$log" | grep -E 'loaded|configure-multi-region|insert' | tail -n 6 >&2

    say "with the workload stopped, every node counts the same rows (one partition at a time)"
    compose stop workload >/dev/null 2>&1
    compose run --rm -T workload check $(printf -- '--gateway=node%d:26257 ' 1 2 3 4 5 6 7 8 9)

    say "the host reaches node 9's published ports: gateway, PostgreSQL and console"
    if [ -z "${PGMR_COMPOSE_NO_HOST_PORTS:-}" ]; then
        command -v psql >/dev/null
        got=$(psql -X -At -h 127.0.0.1 -p 26265 -U root -d compose_check -c "SELECT v FROM kv WHERE k = 1")
        [ "$got" = "written through node1" ] || { echo "gateway of node 9 read '$got'" >&2; return 1; }
        got=$(psql -X -At -h 127.0.0.1 -p 15440 -U root -d compose_check -c "SELECT multiregion.gateway_region()")
        [ "$got" = "europe-west1" ] || { echo "PostgreSQL of node 9 says region '$got'" >&2; return 1; }
        curl -fsS http://127.0.0.1:8088/network | grep -q 'europe-west1'
    else
        say "(skipped: PGMR_COMPOSE_NO_HOST_PORTS is set, the Docker engine is another host's)"
    fi

    say "a restarted node keeps its data (named volume) and serves again"
    compose restart node3 >/dev/null
    wait_healthy
    got=$(sql 3 -d compose_check -c "SELECT v FROM kv WHERE k = 1")
    [ "$got" = "written through node1" ] || { echo "node 3 after restart read '$got'" >&2; return 1; }

    say "down leaves no container, network or volume behind"
    down
    trap - EXIT
    local left
    left=$(docker ps -aq --filter "label=com.docker.compose.project=$project"
           docker network ls -q --filter "label=com.docker.compose.project=$project"
           docker volume ls -q --filter "label=com.docker.compose.project=$project")
    [ -z "$left" ] || { echo "left behind: $left" >&2; return 1; }
    say "compose test passed"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    test) test_stack ;;
    *) sed -n '2,12p' "$0" >&2; exit 2 ;;
esac
