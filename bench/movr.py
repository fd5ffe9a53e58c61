#!/usr/bin/env python3
"""The MovR tutorial's story on a 9-node `pgmr demo --global` (issue 12 item 10): load
through node 1, run a MovR-style workload against one node of each region, convert the
database with the tutorial's statements (configure-multi-region), run again, and report
each region's latencies before and after.

Everything goes through pgmr's SQL gateway in CockroachDB's dialect (psycopg2, simple
protocol, autocommit: a statement is one message). The workload per region, for that
region's cities only (as MovR's `run --region` does): read a vehicle by city and id,
update it, and insert a ride. Regions run one after another so that the 2-core machine
measures latency, not contention.

Usage: movr.py --pgmr target/release/pgmr [--nodes 9] [--ops 100] [--rows 30]
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile

# The workload itself is the docker-compose demo's app; this script only runs it on a local demo.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docker", "workload"))
import movr  # noqa: E402

GATEWAY_BASE = 28257
PG_BASE = 18432
RPC_BASE = 28357


def gateway(node):
    return ("127.0.0.1", GATEWAY_BASE + node - 1)


def run(vehicles, users, ops, nodes):
    """Per region (through its first node), one region after another so that the 2-core
    machine measures latency, not contention: p50/p99 of the three operations."""
    out = {}
    for i, region in enumerate(movr.REGIONS):
        lat = movr.run([(region, gateway(1 + i * nodes // 3))], users, vehicles, ops=ops)[region]
        out[region] = {k: movr.p50_p99(v) for k, v in lat.items()}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pgmr", required=True)
    ap.add_argument("--ops", type=int, default=100)
    ap.add_argument("--rows", type=int, default=30, help="users and vehicles per city")
    ap.add_argument("--nodes", type=int, default=9, help="demo nodes (3 or more, spread over the regions)")
    ap.add_argument("--keep", action="store_true", help="keep the demo's data directories (logs) afterwards")
    a = ap.parse_args()
    log = tempfile.NamedTemporaryFile(prefix="bench-movr-", suffix=".log", delete=False)
    demo = subprocess.Popen(
        [a.pgmr, "demo", "--global", "--nodes", str(a.nodes), "--no-shell",
         "--pg-port-base", str(PG_BASE), "--sql-port-base", str(GATEWAY_BASE), "--rpc-port-base", str(RPC_BASE)]
        + (["--keep"] if a.keep else []),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        for n in range(1, a.nodes + 1):
            movr.wait_ready(gateway(n), timeout=240)
        # Load through node 1.
        users, vehicles = movr.load(gateway(1), a.rows)
        before = run(vehicles, users, a.ops, a.nodes)
        convert_s = movr.configure(gateway(1))
        # Every row reachable from every node: counts through each node agree.
        per_node = {n: movr.counts(gateway(n)) for n in range(1, a.nodes + 1)}
        counts = set(per_node.values())
        if len(counts) != 1:
            sys.exit(f"nodes disagree on row counts (users, vehicles, rides) after the conversion: {per_node}")
        after = run(vehicles, users, a.ops, a.nodes)
        print(f"# MovR on {a.nodes} nodes: {a.ops} operations per cell, {a.rows} users and vehicles per city; p50 / p99 ms\n")
        print(f"configure-multi-region took {convert_s:.1f} s; every node counts {counts.pop()} (users, vehicles, rides)\n")
        print("| client region | operation | before (no regions) | after (REGIONAL BY ROW by city) |")
        print("|---|---|---|---|")
        for r in movr.REGIONS:
            for op in ["read", "update", "insert"]:
                b, f = before[r][op], after[r][op]
                print(f"| {r} | {op} | {b[0]:.1f} / {b[1]:.1f} | {f[0]:.1f} / {f[1]:.1f} |")
    finally:
        os.killpg(demo.pid, signal.SIGTERM)
        demo.wait(timeout=120)


if __name__ == "__main__":
    main()
