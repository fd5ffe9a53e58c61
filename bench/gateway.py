#!/usr/bin/env python3
"""The SQL gateway's overhead: pgbench through pgmr's gateway against pgbench straight to the
same PostgreSQL, side by side in one run, alternating rounds so that drift hits both alike.

Throughput: pgbench's select-only (-S) and TPC-B-like workloads, simple and prepared protocols,
4 clients; the median tps over the rounds and the gateway/direct ratio. Latency: one client,
select-only, every transaction logged; the median and p99 of all of them and the difference.

Usage: bench/gateway.py [--pgmr target/release/pgmr] [--rounds 3] [--seconds 8] [--scale 10]
Needs pgbench (postgresql-client) and a pgmr built with `cargo build --release -p pgmr`.
"""

import argparse
import glob
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

PG_PORT, SQL_PORT, RPC_PORT = 19532, 19533, 19534


def wait_port(port, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.3)
    sys.exit(f"nothing listens on port {port} after {timeout} s")


def pgbench(port, args, log_dir=None):
    cmd = ["pgbench", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-n"] + args
    if log_dir:
        cmd += ["-l", "--log-prefix", os.path.join(log_dir, "tx")]
    out = subprocess.run(cmd + ["bench"], capture_output=True, text=True, cwd=log_dir)
    if out.returncode != 0:
        sys.exit(f"pgbench failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    m = re.search(r"tps = ([\d.]+) \(without initial connection time\)", out.stdout)
    return float(m.group(1))


def latencies(log_dir):
    """Per-transaction latencies (µs) from pgbench's logs: the third field of each line."""
    out = []
    for f in glob.glob(os.path.join(log_dir, "tx*")):
        with open(f) as fh:
            out += [int(line.split()[2]) for line in fh if line.strip()]
        os.remove(f)
    return out


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pgmr", default="target/release/pgmr")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--scale", type=int, default=10)
    a = ap.parse_args()
    if not shutil.which("pgbench"):
        sys.exit("pgbench not found (apt-get install postgresql-client-15)")
    work = tempfile.mkdtemp(prefix="pgmr-bench-gateway-")
    os.chmod(work, 0o711)
    log = open(os.path.join(work, "pgmr.log"), "w")
    node = subprocess.Popen(
        [a.pgmr, "start", "--locality", "region=us-east1,zone=us-east1-b",
         "--data-dir", os.path.join(work, "n1"), "--listen", f"127.0.0.1:{RPC_PORT}",
         "--pg-port", str(PG_PORT), "--sql-listen", f"127.0.0.1:{SQL_PORT}",
         "--ephemeral", "--die-with-parent"],
        stdout=log, stderr=log)
    try:
        wait_port(PG_PORT)
        wait_port(SQL_PORT)
        time.sleep(2)  # the extension is created after PostgreSQL first accepts connections
        subprocess.run(["psql", "-X", "-q", "-h", "127.0.0.1", "-p", str(PG_PORT), "-U",
                        "postgres", "-c", "CREATE DATABASE bench"], check=True)
        subprocess.run(["pgbench", "-h", "127.0.0.1", "-p", str(PG_PORT), "-U", "postgres",
                        "-i", "-q", "-s", str(a.scale), "bench"], check=True,
                       capture_output=True)
        print(f"pgbench scale {a.scale}, {a.rounds} alternating rounds of {a.seconds} s, "
              f"release pgmr, {os.cpu_count()} cores\n")
        print(f"{'workload':<28} {'direct tps':>11} {'gateway tps':>12} {'ratio':>7}")
        for name, args in [("select-only, simple", ["-S", "-M", "simple"]),
                           ("select-only, prepared", ["-S", "-M", "prepared"]),
                           ("TPC-B-like, simple", ["-M", "simple"]),
                           ("TPC-B-like, prepared", ["-M", "prepared"])]:
            d, g = [], []
            for _ in range(a.rounds):
                common = args + ["-c", "4", "-j", "1", "-T", str(a.seconds)]
                d.append(pgbench(PG_PORT, common))
                g.append(pgbench(SQL_PORT, common))
            md, mg = statistics.median(d), statistics.median(g)
            print(f"{name:<28} {md:>11.0f} {mg:>12.0f} {mg / md:>7.3f}")
        print()
        print(f"{'one client, select-only':<28} {'p50 µs':>8} {'p99 µs':>8}")
        lat = {}
        for target, port in [("direct", PG_PORT), ("gateway", SQL_PORT)]:
            lat[target] = []
        for _ in range(a.rounds):
            for target, port in [("direct", PG_PORT), ("gateway", SQL_PORT)]:
                pgbench(port, ["-S", "-M", "simple", "-c", "1", "-T", str(a.seconds)], work)
                lat[target] += latencies(work)
        for target in ("direct", "gateway"):
            print(f"{target:<28} {pct(lat[target], 0.5):>8} {pct(lat[target], 0.99):>8}")
        added = pct(lat["gateway"], 0.5) - pct(lat["direct"], 0.5)
        print(f"{'added by the gateway':<28} {added:>8}")
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(60)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
