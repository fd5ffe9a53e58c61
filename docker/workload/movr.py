#!/usr/bin/env python3
"""A MovR-style workload for pg_multiregion, through pgmr's SQL gateway in CockroachDB's
dialect: the MovR tutorial's story (load, configure multi-region with the tutorial's
statements, run with per-region latencies), as the docker-compose demo's workload service
and as the library bench/movr.py drives on a local `pgmr demo`.

    movr.py load      --gateway HOST:PORT [--rows 30]
    movr.py configure --gateway HOST:PORT
    movr.py run       --region us-east1=HOST:PORT ... [--duration 60 | --ops 100] [--report 10]
    movr.py check     --gateway HOST:PORT ...   (every node counts the same rows)
    movr.py all       --gateway HOST:PORT --region ... (load and configure unless done, then run)

psycopg2, simple protocol, autocommit: a statement is one message. `run` gives each region a
client of its own, for that region's cities only (as MovR's `run --region` does): read a
vehicle by city and id, update it, insert a ride; it prints p50/p99 per region and operation
every --report seconds and at the end. Exits non-zero on the first error that is not a retry.
"""

import argparse
import sys
import threading
import time
import uuid

import psycopg2
import psycopg2.errors

REGIONS = ["us-east1", "us-west1", "europe-west1"]
CITIES = {
    "us-east1": ["new york", "boston", "washington dc"],
    "us-west1": ["san francisco", "seattle", "los angeles"],
    "europe-west1": ["amsterdam", "paris", "rome"],
}
DATABASE = "movr"

# MovR's own keys: (city, id), so that a row's region, computed from its city, is part of
# its key, and foreign keys that include the city (a ride's vehicle and rider are in its city).
SCHEMA = [
    "CREATE TABLE users (id UUID NOT NULL, city VARCHAR NOT NULL, name VARCHAR, "
    "PRIMARY KEY (city, id))",
    "CREATE TABLE vehicles (id UUID NOT NULL, city VARCHAR NOT NULL, type VARCHAR, "
    "owner_id UUID, status VARCHAR, ext JSONB, PRIMARY KEY (city, id), "
    "FOREIGN KEY (city, owner_id) REFERENCES users (city, id))",
    "CREATE TABLE rides (id UUID NOT NULL, city VARCHAR NOT NULL, vehicle_id UUID, "
    "rider_id UUID, start_time TIMESTAMP, revenue DECIMAL(10,2), PRIMARY KEY (city, id), "
    "FOREIGN KEY (city, vehicle_id) REFERENCES vehicles (city, id), "
    "FOREIGN KEY (city, rider_id) REFERENCES users (city, id))",
    "CREATE TABLE promo_codes (code VARCHAR PRIMARY KEY, description VARCHAR)",
]


def region_case():
    arms = " ".join(
        "WHEN city IN (%s) THEN '%s'" % (", ".join("'%s'" % c for c in cs), r) for r, cs in CITIES.items()
    )
    return f"CASE {arms} END"


def configure_statements(db=DATABASE):
    """The tutorial's statements, one transaction each."""
    stmts = [
        f'ALTER DATABASE {db} PRIMARY REGION "us-east1"',
        f'ALTER DATABASE {db} ADD REGION "us-west1"',
        f'ALTER DATABASE {db} ADD REGION "europe-west1"',
        "ALTER TABLE promo_codes SET LOCALITY GLOBAL",
    ]
    for t in ["users", "vehicles", "rides"]:
        stmts += [
            f"ALTER TABLE {t} ADD COLUMN region crdb_internal_region AS ({region_case()}) STORED",
            f"ALTER TABLE {t} ALTER COLUMN region SET NOT NULL",
            f'ALTER TABLE {t} SET LOCALITY REGIONAL BY ROW AS "region"',
        ]
    return stmts


def host_port(s):
    host, _, port = s.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{s!r} is not HOST:PORT")
    return host, int(port)


def region_gateway(s):
    region, _, addr = s.partition("=")
    if region not in CITIES:
        raise argparse.ArgumentTypeError(f"{region!r} is not one of {', '.join(REGIONS)}")
    return region, host_port(addr)


def connect(addr, db=DATABASE):
    c = psycopg2.connect(host=addr[0], port=addr[1], user="root", dbname=db, connect_timeout=10)
    c.autocommit = True
    return c


def wait_ready(addr, timeout=600):
    """Waits until the gateway at `addr` accepts a session."""
    deadline = time.time() + timeout
    while True:
        try:
            connect(addr, "defaultdb").close()
            return
        except psycopg2.Error as e:
            if time.time() > deadline:
                sys.exit(f"{addr[0]}:{addr[1]} did not accept a session: {e}")
            time.sleep(1)


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
            print(f"retrying after 40001: {str(e).splitlines()[0][:120]}", file=sys.stderr, flush=True)
            time.sleep(1)


def p50_p99(v):
    v = sorted(v)
    return v[len(v) // 2], v[min(len(v) - 1, round((len(v) - 1) * 0.99))]


def database_exists(addr, db=DATABASE):
    with connect(addr, "defaultdb") as c, c.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,))
        return cur.fetchone() is not None


def load(addr, rows, db=DATABASE):
    """Creates the database and MovR's tables, `rows` users and vehicles per city and a
    promo code; returns (users, vehicles) as (id, city) lists."""
    c = connect(addr, "defaultdb")
    c.cursor().execute(f"CREATE DATABASE {db}")
    c.close()
    c = connect(addr, db)
    cur = c.cursor()
    for s in SCHEMA:
        cur.execute(s)
    users, vehicles = [], []
    for cities in CITIES.values():
        for city in cities:
            for _ in range(rows):
                users.append((str(uuid.uuid4()), city))
                vehicles.append((str(uuid.uuid4()), city))
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
    return users, vehicles


def is_configured(addr, db=DATABASE):
    with connect(addr, db) as c, c.cursor() as cur:
        cur.execute(f"SHOW REGIONS FROM DATABASE {db}")
        return len(cur.fetchall()) > 0


def configure(addr, db=DATABASE):
    """Runs the tutorial's statements; returns how long they took, in seconds."""
    c = connect(addr, db)
    cur = c.cursor()
    t = time.perf_counter()
    for s in configure_statements(db):
        retrying(cur, s)
    c.close()
    return time.perf_counter() - t


def rows_of(addr, db=DATABASE):
    """(users, vehicles) as (id, city) lists, read back through `addr`."""
    with connect(addr, db) as c, c.cursor() as cur:
        out = []
        for t in ["users", "vehicles"]:
            cur.execute(f"SELECT id::text, city FROM {t} ORDER BY city, id")
            out.append(cur.fetchall())
        return out


def counts(addr, db=DATABASE):
    """Rows of users, vehicles and rides as seen through `addr`; once the tables are REGIONAL
    BY ROW, one region's partition per statement (a read over partitions leased on several
    nodes runs only on a node with a replica of each: reads are not split over leaseholders)."""
    with connect(addr, db) as c, c.cursor() as cur:
        got = []
        for t in ["users", "vehicles", "rides"]:
            cur.execute(
                "SELECT count(*) FROM information_schema.columns "
                "WHERE table_schema = 'public' AND table_name = %s AND column_name = 'region'",
                (t,),
            )
            if cur.fetchone()[0]:
                total = 0
                for r in REGIONS:
                    cur.execute(f"SELECT count(*) FROM {t} WHERE region = %s", (r,))
                    total += cur.fetchone()[0]
            else:
                cur.execute(f"SELECT count(*) FROM {t}")
                total = cur.fetchone()[0]
            got.append(total)
        return tuple(got)


class RegionClient:
    """One region's client: MovR's three operations on that region's cities, with latencies."""

    def __init__(self, region, addr, users, vehicles, db=DATABASE):
        self.region, self.addr, self.db = region, addr, db
        self.vehicles = [v for v in vehicles if v[1] in CITIES[region]]
        self.rider = {}
        for u, city in users:
            self.rider.setdefault(city, u)
        self.lat = {"read": [], "update": [], "insert": []}
        self.lock = threading.Lock()
        self.error = None
        self.n = 0

    def one(self, cur):
        vid, city = self.vehicles[self.n % len(self.vehicles)]
        self.n += 1
        steps = [
            ("read", "SELECT id, status FROM vehicles WHERE city = %s AND id = %s", (city, vid)),
            ("update", "UPDATE vehicles SET status = %s WHERE city = %s AND id = %s", (f"s{self.n}", city, vid)),
            (
                "insert",
                "INSERT INTO rides (id, city, vehicle_id, rider_id, start_time, revenue) "
                "VALUES (%s, %s, %s, %s, now(), 10.5)",
                (str(uuid.uuid4()), city, vid, self.rider[city]),
            ),
        ]
        for op, sql, args in steps:
            t = time.perf_counter()
            cur.execute(sql, args)
            ms = (time.perf_counter() - t) * 1000.0
            with self.lock:
                self.lat[op].append(ms)

    def loop(self, ops, until):
        try:
            c = connect(self.addr, self.db)
            cur = c.cursor()
            while (ops is None or self.n < ops) and (until is None or time.time() < until):
                try:
                    self.one(cur)
                except psycopg2.errors.SerializationFailure:
                    time.sleep(0.1)
            c.close()
        except Exception as e:  # reported by the caller, which exits non-zero
            self.error = f"{self.region} via {self.addr[0]}:{self.addr[1]}: {e}"

    def take(self):
        """The latencies since the last take, and clears them."""
        with self.lock:
            lat, self.lat = self.lat, {"read": [], "update": [], "insert": []}
        return lat


def report(title, per_region):
    print(title, flush=True)
    print("  region         op       count   p50 ms   p99 ms")
    for region, lat in per_region.items():
        for op, v in lat.items():
            if v:
                p50, p99 = p50_p99(v)
                print(f"  {region:<14} {op:<8} {len(v):>5} {p50:>8.1f} {p99:>8.1f}")
    sys.stdout.flush()


def run(gateways, users, vehicles, ops=None, duration=None, every=None, db=DATABASE):
    """Runs one client per region at once; returns {region: {op: [ms]}} of the whole run."""
    clients = [RegionClient(r, a, users, vehicles, db) for r, a in gateways]
    until = time.time() + duration if duration else None
    threads = [threading.Thread(target=c.loop, args=(ops, until), daemon=True) for c in clients]
    for t in threads:
        t.start()
    total = {c.region: {"read": [], "update": [], "insert": []} for c in clients}
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(timeout=every or 1.0)
        if every:
            window = {c.region: c.take() for c in clients}
            for r, lat in window.items():
                for op, v in lat.items():
                    total[r][op] += v
            report(f"-- last {every:.0f} s", window)
    for c in clients:
        for op, v in c.take().items():
            total[c.region][op] += v
    errors = [c.error for c in clients if c.error]
    if errors:
        sys.exit("workload failed: " + "; ".join(errors))
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["load", "configure", "run", "check", "all"])
    ap.add_argument("--gateway", type=host_port, action="append", default=[],
                    help="a node's SQL gateway, HOST:PORT (check: repeat for each node)")
    ap.add_argument("--region", type=region_gateway, action="append", default=[],
                    help="REGION=HOST:PORT, the gateway a region's client uses (repeat)")
    ap.add_argument("--rows", type=int, default=30, help="users and vehicles per city (load)")
    ap.add_argument("--ops", type=int, help="operations per region, then stop (run)")
    ap.add_argument("--duration", type=float, help="seconds to run; 0 or none: until stopped")
    ap.add_argument("--report", type=float, default=10.0, help="seconds between latency reports")
    a = ap.parse_args()
    first = (a.gateway or [addr for _, addr in a.region] or [None])[0]
    if first is None:
        ap.error("give --gateway or --region")
    for addr in a.gateway + [addr for _, addr in a.region]:
        wait_ready(addr)

    if a.command in ("load", "all"):
        if a.command == "all" and database_exists(first):
            print(f"database {DATABASE} exists: not loading again", flush=True)
        else:
            users, vehicles = load(first, a.rows)
            print(f"loaded {len(users)} users and {len(vehicles)} vehicles through {first[0]}:{first[1]}", flush=True)
    if a.command in ("configure", "all"):
        if a.command == "all" and is_configured(first):
            print(f"database {DATABASE} has regions: not configuring again", flush=True)
        else:
            print(f"configure-multi-region took {configure(first):.1f} s", flush=True)
    if a.command == "check":
        seen = {f"{h}:{p}": counts((h, p)) for h, p in a.gateway}
        print("rows (users, vehicles, rides) through each node:", seen, flush=True)
        if len(set(seen.values())) != 1:
            sys.exit("nodes disagree on row counts")
    if a.command in ("run", "all"):
        if not a.region:
            ap.error("run needs --region REGION=HOST:PORT")
        users, vehicles = rows_of(first)
        duration = a.duration or None
        total = run(a.region, users, vehicles, ops=a.ops, duration=duration, every=a.report)
        report("-- whole run", total)


if __name__ == "__main__":
    main()
