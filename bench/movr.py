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
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import psycopg2

REGIONS = ["us-east1", "us-west1", "europe-west1"]
CITIES = {
    "us-east1": ["new york", "boston", "washington dc"],
    "us-west1": ["san francisco", "seattle", "los angeles"],
    "europe-west1": ["amsterdam", "paris", "rome"],
}
GATEWAY_BASE = 28257
PG_BASE = 18432
RPC_BASE = 28357

SCHEMA = """
CREATE TABLE users (id UUID PRIMARY KEY, city VARCHAR NOT NULL, name VARCHAR);
CREATE TABLE vehicles (id UUID PRIMARY KEY, city VARCHAR NOT NULL, type VARCHAR,
    owner_id UUID REFERENCES users (id), status VARCHAR, ext JSONB);
CREATE TABLE rides (id UUID PRIMARY KEY, city VARCHAR NOT NULL,
    vehicle_id UUID REFERENCES vehicles (id), rider_id UUID REFERENCES users (id),
    start_time TIMESTAMP, revenue DECIMAL(10,2));
CREATE TABLE promo_codes (code VARCHAR PRIMARY KEY, description VARCHAR);
"""


def region_case():
    arms = " ".join(
        "WHEN city IN (%s) THEN '%s'" % (", ".join("'%s'" % c for c in cs), r) for r, cs in CITIES.items()
    )
    return f"CASE {arms} END"


def configure_multi_region():
    """The tutorial's statements, one transaction each."""
    stmts = [
        'ALTER DATABASE movr PRIMARY REGION "us-east1"',
        'ALTER DATABASE movr ADD REGION "us-west1"',
        'ALTER DATABASE movr ADD REGION "europe-west1"',
        "ALTER TABLE promo_codes SET LOCALITY GLOBAL",
    ]
    for t in ["users", "vehicles", "rides"]:
        stmts += [
            f"ALTER TABLE {t} ADD COLUMN region crdb_internal_region AS ({region_case()}) STORED",
            f"ALTER TABLE {t} ALTER COLUMN region SET NOT NULL",
            f'ALTER TABLE {t} SET LOCALITY REGIONAL BY ROW AS "region"',
        ]
    return stmts


def connect(node, db="movr"):
    c = psycopg2.connect(host="127.0.0.1", port=GATEWAY_BASE + node - 1, user="root", dbname=db)
    c.autocommit = True
    return c


def retrying(cur, sql, args=None):
    """Runs `sql`, retrying 40001 as MovR's run_transaction does (for up to two minutes)."""
    deadline = time.time() + 120
    while True:
        try:
            cur.execute(sql, args)
            return
        except psycopg2.errors.SerializationFailure as e:
            if time.time() > deadline:
                raise
            print(f"retrying after 40001: {str(e).splitlines()[0][:120]}", file=sys.stderr)
            time.sleep(1)


def timed(cur, sql, args):
    t = time.perf_counter()
    cur.execute(sql, args)
    return (time.perf_counter() - t) * 1000.0


def p50_p99(v):
    v = sorted(v)
    return v[len(v) // 2], v[min(len(v) - 1, round((len(v) - 1) * 0.99))]


def run(vehicles, users, ops, nodes):
    """Per region (through its first node): latencies of the three operations."""
    out = {}
    for i, region in enumerate(REGIONS):
        c = connect(1 + i * nodes // 3)
        cur = c.cursor()
        mine = [v for v in vehicles if v[1] in CITIES[region]]
        riders = [u for u in users if u[1] in CITIES[region]]
        lat = {"read": [], "update": [], "insert": []}
        for n in range(ops):
            vid, city = mine[n % len(mine)]
            lat["read"].append(timed(cur, "SELECT id, status FROM vehicles WHERE city = %s AND id = %s", (city, vid)))
            lat["update"].append(
                timed(cur, "UPDATE vehicles SET status = %s WHERE city = %s AND id = %s", (f"s{n}", city, vid))
            )
            rider = next(u for u in riders if u[1] == city)
            lat["insert"].append(
                timed(
                    cur,
                    "INSERT INTO rides (id, city, vehicle_id, rider_id, start_time, revenue) "
                    "VALUES (%s, %s, %s, %s, now(), 10.5)",
                    (str(uuid.uuid4()), city, vid, rider[0]),
                )
            )
        c.close()
        out[region] = {k: p50_p99(v) for k, v in lat.items()}
    return out


def wait_ready(node, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            connect(node, "defaultdb").close()
            return
        except psycopg2.Error:
            time.sleep(1)
    sys.exit(f"node {node} did not come up")


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
            wait_ready(n)
        c = connect(1, "defaultdb")
        cur = c.cursor()
        cur.execute("SELECT multiregion.set_cluster_setting('multiregion.replication.enabled', 'true')")
        cur.execute("CREATE DATABASE movr")
        c.close()
        # Load through node 1.
        c = connect(1)
        cur = c.cursor()
        for s in SCHEMA.strip().split(";"):
            if s.strip():
                cur.execute(s)
        users, vehicles = [], []
        for cities in CITIES.values():
            for city in cities:
                for _ in range(a.rows):
                    u, v = str(uuid.uuid4()), str(uuid.uuid4())
                    users.append((u, city))
                    vehicles.append((v, city))
        cur.execute(
            "INSERT INTO users (id, city, name) VALUES " + ", ".join(["(%s, %s, 'rider')"] * len(users)),
            [x for u in users for x in u],
        )
        cur.execute(
            "INSERT INTO vehicles (id, city, type, owner_id, status) VALUES "
            + ", ".join(["(%s, %s, 'scooter', %s, 'available')"] * len(vehicles)),
            [x for v, u in zip(vehicles, users) for x in (v[0], v[1], u[0])],
        )
        cur.execute("INSERT INTO promo_codes VALUES ('welcome', 'first ride free')")
        c.close()
        before = run(vehicles, users, a.ops, a.nodes)
        c = connect(1)
        cur = c.cursor()
        t = time.perf_counter()
        for s in configure_multi_region():
            retrying(cur, s)
        convert_s = time.perf_counter() - t
        c.close()
        # Every row reachable from every node: counts through each node agree. One region's
        # partition per statement: a read over partitions leased on several nodes runs only
        # on a node with a replica of each (reads are not split over leaseholders yet).
        counts, per_node = set(), {}
        for n in range(1, a.nodes + 1):
            c = connect(n)
            cur = c.cursor()
            got = []
            for t in ["users", "vehicles", "rides"]:
                total = 0
                for r in REGIONS:
                    cur.execute(f"SELECT count(*) FROM {t} WHERE region = %s", (r,))
                    total += cur.fetchone()[0]
                got.append(total)
            counts.add(tuple(got))
            per_node[n] = tuple(got)
            c.close()
        if len(counts) != 1:
            sys.exit(f"nodes disagree on row counts (users, vehicles, rides) after the conversion: {per_node}")
        after = run(vehicles, users, a.ops, a.nodes)
        print(f"# MovR on {a.nodes} nodes: {a.ops} operations per cell, {a.rows} users and vehicles per city; p50 / p99 ms\n")
        print(f"configure-multi-region took {convert_s:.1f} s; every node counts {counts.pop()} (users, vehicles, rides)\n")
        print("| client region | operation | before (no regions) | after (REGIONAL BY ROW by city) |")
        print("|---|---|---|---|")
        for r in REGIONS:
            for op in ["read", "update", "insert"]:
                b, f = before[r][op], after[r][op]
                print(f"| {r} | {op} | {b[0]:.1f} / {b[1]:.1f} | {f[0]:.1f} / {f[1]:.1f} |")
    finally:
        os.killpg(demo.pid, signal.SIGTERM)
        demo.wait(timeout=120)


if __name__ == "__main__":
    main()
