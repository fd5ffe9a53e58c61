#!/usr/bin/env bash
# Runs the extension's regression tests against throwaway PostgreSQL instances.
#
# Assumes pg_multiregion is already installed into the PostgreSQL that PG_CONFIG names
# (`cargo pgrx install`, as the Makefile does). Each phase needs its own server configuration,
# so each gets its own pg_regress --temp-instance:
#
#   nopreload     without shared_preload_libraries: the extension must refuse to load;
#   preload       configured as "pgmr start" configures a node, but with no pgmr running;
#   unconfigured  preloaded, with neither locality nor sidecar socket set (and, on a server of
#                 its own, the isolation spec of the appliers' lock order);
#   startup       a malformed multiregion.locality in postgresql.conf must stop the server;
#   cluster       against a real three-region cluster ("pgmr demo --nodes 3", one node per
#                 region): the region and locality SQL, replicated through the meta group,
#                 and isolation tests (concurrent sessions) of global uniqueness.
#   gateway       against another such cluster, through node 1's SQL gateway: CockroachDB's
#                 statements verbatim (the MovR tutorial's Step 5 among them), pgbench's
#                 standard workload over the simple, extended and prepared protocols, and an
#                 app written for CockroachDB (SQLAlchemy with CockroachDB's dialect).
#
# initdb and postgres refuse to run as root, so when run as root the tests run as the OS user
# postgres (override with REGRESS_USER). Exits non-zero if any phase fails, after printing its
# differences; results are left in regress/results/<phase>/ for inspection.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
if [ ! -x "$PG_CONFIG" ]; then
    PG_CONFIG=$(command -v pg_config) || { echo "regress.sh: pg_config not found; set PG_CONFIG" >&2; exit 1; }
fi
bindir=$("$PG_CONFIG" --bindir)
pg_regress="$(dirname "$("$PG_CONFIG" --pgxs)")/../test/regress/pg_regress"
pg_isolation_regress="$(dirname "$("$PG_CONFIG" --pgxs)")/../test/isolation/pg_isolation_regress"
if [ ! -x "$pg_regress" ]; then
    echo "regress.sh: pg_regress not found at $pg_regress (install the PostgreSQL server dev package)" >&2
    exit 1
fi

# With a Rust backtrace enabled, pgrx appends it to the DETAIL of PostgreSQL errors that unwind
# through Rust frames (e.g. a query cancel during a pgmr call): machine-specific output.
unset RUST_BACKTRACE RUST_LIB_BACKTRACE

# pg_regress reads and writes everything under one scratch directory, owned by whoever runs it.
work=$(mktemp -d "${TMPDIR:-/tmp}/pg_multiregion-regress.XXXXXX")
trap 'rm -rf "$work"' EXIT
cp -R "$root/regress/sql" "$root/regress/expected" "$root/regress/specs" "$root/regress/"*.conf "$root/regress/"*schedule "$work/"
as_runner=()
if [ "$(id -u)" -eq 0 ]; then
    user=${REGRESS_USER:-postgres}
    chown -R "$user:" "$work"
    as_runner=(runuser -u "$user" --)
fi
run() { "${as_runner[@]}" "$@"; }

rm -rf "$root/regress/results" "$root/regress/regression.diffs" "$root/regress/regression.out"
failed=()

# Keeps a failed phase's outputs in regress/results/<phase>/ and prints what differed.
keep_failure() {
    local phase=$1 out=$2
    mkdir -p "$root/regress/results/$phase"
    cp -R "$out/." "$root/regress/results/$phase/" 2>/dev/null || true
    rm -rf "$root/regress/results/$phase/tmp_check" "$root/regress/results/$phase/data"
    if [ -f "$out/regression.diffs" ]; then
        echo "---- $phase: regression.diffs ----"
        cat "$out/regression.diffs"
    fi
    # Without differences the server itself failed (e.g. did not start): show why.
    local log
    for log in "$out/log/postmaster.log" "$out/postmaster.log"; do
        if [ ! -s "$out/regression.diffs" ] && [ -f "$log" ]; then
            echo "---- $phase: last lines of the server log ----"
            tail -n 30 "$log"
        fi
    done
    failed+=("$phase")
}

pg_regress_phase() {
    local phase=$1 schedule=$2 conf=$3
    local out="$work/out-$phase"
    echo "== phase $phase ($conf) =="
    run mkdir "$out"
    if ! run "$pg_regress" \
        --bindir="$bindir" \
        --inputdir="$work" \
        --outputdir="$out" \
        --temp-instance="$out/tmp_check" \
        --temp-config="$work/$conf" \
        --schedule="$work/$schedule" \
        --no-locale --encoding=UTF8 \
        --dbname=contrib_regression; then
        keep_failure "$phase" "$out"
    fi
    # Concurrent sessions on a server of the phase's own (a schedule's isolation specs).
    local specs
    specs=$(sed -n 's/^# isolation (pg_isolation_regress, regress.sh): //p' "$work/$schedule")
    if [ -n "$specs" ] && { ! run mkdir -p "$out/isolation" || ! run "$pg_isolation_regress" \
        --bindir="$bindir" \
        --inputdir="$work" \
        --outputdir="$out/isolation" \
        --temp-instance="$out/isolation/tmp_check" \
        --temp-config="$work/$conf" \
        --no-locale --encoding=UTF8 \
        --dbname=isolation_regression \
        $specs; }; then
        keep_failure "$phase-isolation" "$out/isolation"
    fi
}

# pg_regress cannot test a server that must fail to start, so this phase starts one directly
# and compares its FATAL and HINT lines with expected/startup.out.
startup_phase() {
    local out="$work/out-startup"
    echo "== phase startup (malformed multiregion.locality in postgresql.conf) =="
    run mkdir "$out"
    if ! run "$bindir/initdb" -D "$out/data" --no-locale -E UTF8 -A trust >"$out/initdb.log" 2>&1; then
        cat "$out/initdb.log"
        failed+=(startup)
        return
    fi
    run tee -a "$out/data/postgresql.conf" >/dev/null <<CONF
listen_addresses = ''
unix_socket_directories = '$out'
log_line_prefix = ''
shared_preload_libraries = 'pg_multiregion'
multiregion.locality = 'us-east1'
CONF
    if run "$bindir/pg_ctl" -D "$out/data" -l "$out/postmaster.log" -w -t 60 start >"$out/pg_ctl.log" 2>&1; then
        run "$bindir/pg_ctl" -D "$out/data" -m immediate stop >/dev/null 2>&1 || true
        echo "the server started despite a malformed multiregion.locality" >"$out/regression.diffs"
        keep_failure startup "$out"
        return
    fi
    grep -E '^(FATAL|HINT):' "$out/postmaster.log" >"$out/startup.out" || true
    if diff -u "$work/expected/startup.out" "$out/startup.out" >"$out/regression.diffs"; then
        echo "ok: the server refused to start"
    else
        keep_failure startup "$out"
    fi
}

# Starts "pgmr demo --nodes 3" with the given port flags, logging to OUT/demo.log, and waits
# until it serves; sets $demo to its pid. Fails (after showing the log) if it does not come up.
demo=
start_demo() {
    local out=$1; shift
    # --keep: the nodes' logs outlive the cluster, kept by stop_demo when a phase failed.
    "${PGMR:-$root/target/debug/pgmr}" demo --nodes 3 --no-shell --keep "$@" >"$out/demo.log" 2>&1 &
    demo=$!
    for _ in $(seq 1 120); do
        if grep -q "Press Ctrl-C" "$out/demo.log" 2>/dev/null; then return 0; fi
        kill -0 "$demo" 2>/dev/null || break
        sleep 0.5
    done
    cat "$out/demo.log"
    kill "$demo" 2>/dev/null || true
    return 1
}

# Stops the cluster start_demo started. If any phase named after it failed meanwhile, each
# node's PostgreSQL and pgmr logs go to regress/results/<phase>/node<N>/ (a deadlock's report,
# with both sides' statements, is only in the server log) and its deadlock reports are shown.
stop_demo() {
    local out=$1 phase=$2 failed_before=$3
    kill -TERM "$demo" 2>/dev/null || true
    wait "$demo" 2>/dev/null || true
    local kept
    kept=$(sed -n 's/^data kept in //p' "$out/demo.log" | tail -n 1)
    [ -n "$kept" ] && [ -d "$kept" ] || return 0
    if [ "${#failed[@]}" -gt "$failed_before" ]; then
        local node dest
        for node in "$kept"/node*; do
            dest="$root/regress/results/$phase/$(basename "$node")"
            mkdir -p "$dest"
            cp "$node/postgres.log" "$node/pgmr.log" "$dest/" 2>/dev/null || true
            if grep -q "deadlock detected" "$dest/postgres.log" 2>/dev/null; then
                echo "---- $phase: deadlocks in $(basename "$node")'s server log ----"
                grep -B2 -A12 "deadlock detected" "$dest/postgres.log"
            fi
        done
        echo "$phase: node logs kept in regress/results/$phase/"
    fi
    rm -rf "$kept"
}

# A real three-node cluster, one node per region; pg_regress runs against node 1.
cluster_phase() {
    local out="$work/out-cluster"
    local pg_port=${REGRESS_CLUSTER_PORT:-17532}
    local failed_before=${#failed[@]}
    echo "== phase cluster (pgmr demo --nodes 3) =="
    run mkdir "$out"
    if ! start_demo "$out" --pg-port-base "$pg_port" --rpc-port-base 27532 \
        --sql-port-base 17832 --http-port-base 17932; then
        failed+=(cluster)
        return
    fi
    if ! "$bindir/psql" -X -q -h 127.0.0.1 -p "$pg_port" -U postgres -d postgres \
        -c "CREATE DATABASE regress_mr" >"$out/createdb.log" 2>&1; then
        cat "$out/createdb.log"
        failed+=(cluster)
    elif ! run "$pg_regress" \
        --bindir="$bindir" \
        --inputdir="$work" \
        --outputdir="$out" \
        --use-existing --host=127.0.0.1 --port="$pg_port" --user=postgres \
        --schedule="$work/cluster_schedule" \
        --dbname=regress_mr; then
        keep_failure cluster "$out"
        tail -n 30 "$out/demo.log"
    fi
    # Concurrent sessions, in a database of their own made multi-region first.
    local psql_node1=("$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$pg_port" -U postgres)
    if ! { "${psql_node1[@]}" -d postgres -c "CREATE DATABASE regress_iso" &&
           "${psql_node1[@]}" -d regress_iso \
               -c "SELECT multiregion.execute('ALTER DATABASE regress_iso PRIMARY REGION \"us-east1\"')" \
               -c "SELECT multiregion.execute('ALTER DATABASE regress_iso ADD REGION \"us-west1\"')"; \
         } >"$out/iso-setup.log" 2>&1; then
        cat "$out/iso-setup.log"
        failed+=(cluster-isolation)
    elif ! run mkdir -p "$out/isolation" || ! run "$pg_isolation_regress" \
        --bindir="$bindir" \
        --inputdir="$work" \
        --outputdir="$out/isolation" \
        --use-existing --host=127.0.0.1 --port="$pg_port" --user=postgres \
        --dbname=regress_iso \
        global_unique rename_key_lock_order; then
        keep_failure cluster-isolation "$out/isolation"
    fi
    stop_demo "$out" cluster "$failed_before"
}

# The SQL gateway, with psql and pgbench as its clients, on a cluster of its own (the MovR
# tutorial needs a database named movr, which the cluster phase already made on its cluster).
gateway_phase() {
    local out="$work/out-gateway"
    local pg_port=${REGRESS_GATEWAY_PG_PORT:-17632} sql_port=${REGRESS_GATEWAY_PORT:-17732}
    local failed_before=${#failed[@]}
    echo "== phase gateway (pgmr demo --nodes 3, psql and pgbench on the SQL gateway) =="
    run mkdir "$out"
    if ! start_demo "$out" --pg-port-base "$pg_port" --rpc-port-base 27632 \
        --sql-port-base "$sql_port" --http-port-base 27732; then
        failed+=(gateway)
        return
    fi
    if ! run "$pg_regress" \
        --bindir="$bindir" \
        --inputdir="$work" \
        --outputdir="$out" \
        --use-existing --host=127.0.0.1 --port="$sql_port" --user=postgres \
        --schedule="$work/gateway_schedule" \
        --dbname=defaultdb; then
        keep_failure gateway "$out"
        tail -n 30 "$out/demo.log"
    fi
    # pgbench's standard workload, each protocol: the run must finish with no failed
    # transactions (pgbench exits non-zero otherwise).
    local pgb=("$bindir/pgbench" -h 127.0.0.1 -p "$sql_port" -U root)
    # The load is one 100 000-row transaction; a range leader that loses its lease under it
    # (a debug build on 2 busy cores can miss heartbeats) refuses the commit with a
    # retryable error, and a client retries it, as CockroachDB's clients do: once, here.
    init_bench() {
        "${pgb[@]}" -i -q -s 1 bench >"$out/pgbench-init.log" 2>&1 && return 0
        cat "$out/pgbench-init.log"
        grep -q "retry the statement" "$out/pgbench-init.log" &&
            echo "pgbench -i: retrying once after a retryable error" &&
            "${pgb[@]}" -i -q -s 1 bench
    }
    if ! { "$bindir/psql" -X -q -h 127.0.0.1 -p "$sql_port" -U root -d defaultdb \
               -c "CREATE DATABASE bench" &&
           init_bench &&
           "${pgb[@]}" -M simple -c 2 -t 100 bench &&
           "${pgb[@]}" -M extended -c 2 -t 100 bench &&
           "${pgb[@]}" -M prepared -c 2 -t 100 -S bench; } >"$out/pgbench.log" 2>&1; then
        cat "$out/pgbench.log"
        failed+=(gateway-pgbench)
    fi
    # An application written for CockroachDB, unchanged: SQLAlchemy with CockroachDB's own
    # dialect (from PyPI, into a virtualenv kept under target/), in the MovR app's patterns.
    local venv=${REGRESS_APP_VENV:-$root/target/venv-apps}
    if ! { { [ -x "$venv/bin/python" ] || python3 -m venv "$venv"; } &&
           "$venv/bin/pip" install -q --disable-pip-version-check 'SQLAlchemy>=1.4,<2' \
               'sqlalchemy-cockroachdb==1.4.6' 'psycopg2-binary>=2.9' &&
           "$bindir/psql" -X -q -h 127.0.0.1 -p "$sql_port" -U root -d defaultdb \
               -c "CREATE DATABASE movr_app" &&
           "$venv/bin/python" "$root/regress/apps/movr_like.py" "$sql_port"; } >"$out/app.log" 2>&1; then
        cat "$out/app.log"
        failed+=(gateway-app)
    fi
    # The same app again (row replication is on by default; the setting is repeated so the
    # check stands on its own), its replicas then compared: its rows, their moves between
    # regions (the rehome UPDATEs) and the conversion's region assignment end up alike on
    # every node.
    local psql_gw=("$bindir/psql" -X -q -At -h 127.0.0.1 -p "$sql_port" -U root)
    if ! { "${psql_gw[@]}" -d defaultdb \
               -c "SELECT multiregion.set_cluster_setting('multiregion.replication.enabled', 'true')" \
               -c "CREATE DATABASE movr_app_replicated" &&
           "$venv/bin/python" "$root/regress/apps/movr_like.py" "$sql_port" movr_app_replicated &&
           consistent=$("${psql_gw[@]}" -d movr_app_replicated -c \
               "SELECT count(*) FILTER (WHERE NOT c.consistent) || ' of ' || count(*) \
                  FROM multiregion.check_consistency() c \
                  JOIN multiregion.ranges r USING (range_id) \
                 WHERE r.database_name = 'movr_app_replicated'") &&
           echo "replicas differing: $consistent" &&
           [[ "$consistent" == "0 of "* && "$consistent" != "0 of 0" ]] ||
           { "${psql_gw[@]}" -d movr_app_replicated -c \
                 "SELECT c.*, r.schema_name, r.table_name, r.partition \
                    FROM multiregion.check_consistency() c \
                    JOIN multiregion.ranges r USING (range_id) \
                   WHERE r.database_name = 'movr_app_replicated' ORDER BY range_id, node_id"; false; }; } \
           >"$out/app-replicated.log" 2>&1; then
        cat "$out/app-replicated.log"
        failed+=(gateway-app-replicated)
    fi
    stop_demo "$out" gateway "$failed_before"
}

# REGRESS_PHASES picks phases (space-separated) while developing; all run by default.
phases=" ${REGRESS_PHASES:-nopreload preload unconfigured startup cluster gateway} "
want() { [[ "$phases" == *" $1 "* ]]; }
want nopreload && pg_regress_phase nopreload nopreload_schedule nopreload.conf
want preload && pg_regress_phase preload schedule preload.conf
want unconfigured && pg_regress_phase unconfigured unconfigured_schedule unconfigured.conf
want startup && startup_phase
want cluster && cluster_phase
want gateway && gateway_phase

if [ "${#failed[@]}" -gt 0 ]; then
    # Again at the end, where a CI log's tail shows it: the start of each failed phase's diffs.
    for phase in "${failed[@]}"; do
        diffs="$root/regress/results/$phase/regression.diffs"
        if [ -s "$diffs" ]; then
            echo "---- $phase: first lines of regression.diffs ----"
            head -n 60 "$diffs"
        fi
    done
    echo "regress.sh: FAILED phases: ${failed[*]} (outputs in regress/results/)" >&2
    exit 1
fi
echo "regress.sh: all phases passed"
