#!/usr/bin/env python3
"""The SQL gateway's overhead: pgbench through pgmr's gateway against pgbench straight to the
same PostgreSQL, side by side in one run, alternating rounds so that drift hits both alike.

Throughput: pgbench's select-only (-S) and TPC-B-like workloads, simple and prepared protocols,
4 clients; the median tps over the rounds and the gateway/direct ratio. Latency: one client,
select-only, every transaction logged over many short alternating rounds; the median and p99
of all of them and the difference.

Usage: bench/gateway.py [--pgmr target/release/pgmr] [--rounds 3] [--seconds 8] [--scale 10]
Needs pgbench (postgresql-client) and a pgmr built with `cargo build --release -p pgmr`. With
pgbouncer installed (apt-get install pgbouncer) it is measured too, in session mode in front of
the same PostgreSQL: the reference for what a mature userspace relay costs on this machine.
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

PG_PORT, SQL_PORT, RPC_PORT, BOUNCER_PORT = 19532, 19533, 19534, 19535


def start_pgbouncer(work):
    """pgbouncer in session mode in front of the same PostgreSQL, if it is installed: the
    reference for what a mature userspace relay costs on this machine."""
    exe = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not os.path.exists(exe):
        return None
    d = os.path.join(work, "pgbouncer")
    os.makedirs(d)
    with open(os.path.join(d, "pgbouncer.ini"), "w") as f:
        f.write(f"""[databases]
bench = host=127.0.0.1 port={PG_PORT} dbname=bench user=postgres
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {BOUNCER_PORT}
unix_socket_dir =
auth_type = trust
auth_file = {d}/users.txt
pool_mode = session
max_client_conn = 100
default_pool_size = 20
logfile = {d}/pgbouncer.log
pidfile = {d}/pgbouncer.pid
""")
    with open(os.path.join(d, "users.txt"), "w") as f:
        f.write('"postgres" ""\n')
    run_as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if run_as:
        subprocess.run(["chown", "-R", "postgres", d], check=True)
    subprocess.run(run_as + [exe, "-d", os.path.join(d, "pgbouncer.ini")], check=True)
    wait_port(BOUNCER_PORT, 10)
    return os.path.join(d, "pgbouncer.pid")


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
    ap.add_argument("--latency-only", action="store_true")
    ap.add_argument("--latency-rounds", type=int, default=15)
    ap.add_argument("--latency-seconds", type=int, default=2)
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
        bouncer = start_pgbouncer(work)
        targets = [("direct", PG_PORT), ("gateway", SQL_PORT)]
        if bouncer:
            targets.append(("pgbouncer", BOUNCER_PORT))
        head = f"{'workload':<24} {'direct tps':>11} {'gateway tps':>12} {'ratio':>6}"
        if bouncer:
            head += f" {'pgbouncer tps':>14} {'ratio':>6}"
        print(head)
        workloads = [] if a.latency_only else [
                           ("select-only, simple", ["-S", "-M", "simple"]),
                           ("select-only, prepared", ["-S", "-M", "prepared"]),
                           ("TPC-B-like, simple", ["-M", "simple"]),
                           ("TPC-B-like, prepared", ["-M", "prepared"])]
        for name, args in workloads:
            tps = {t: [] for t, _ in targets}
            for _ in range(a.rounds):
                common = args + ["-c", "4", "-j", "1", "-T", str(a.seconds)]
                for t, port in targets:
                    tps[t].append(pgbench(port, common))
            md = statistics.median(tps["direct"])
            line = f"{name:<24} {md:>11.0f}"
            for t, _ in targets[1:]:
                m = statistics.median(tps[t])
                line += f" {m:>12.0f} {m / md:>6.3f}" if t == "gateway" else f" {m:>14.0f} {m / md:>6.3f}"
            print(line)
        print()
        print(f"{'one client, select-only':<24} {'p50 µs':>8} {'p99 µs':>8}")
        lat = {t: [] for t, _ in targets}
        lat_dir = os.path.join(work, "latency")
        os.makedirs(lat_dir)
        # Short rounds, many of them: a one-client round trip on a VM drifts with the host's
        # load, and fine alternation spreads that drift over every target alike.
        for _ in range(a.latency_rounds):
            for t, port in targets:
                pgbench(port, ["-S", "-M", "simple", "-c", "1", "-T", str(a.latency_seconds)],
                        lat_dir)
                lat[t] += latencies(lat_dir)
        for t, _ in targets:
            print(f"{t:<24} {pct(lat[t], 0.5):>8} {pct(lat[t], 0.99):>8}")
        for t, _ in targets[1:]:
            added = pct(lat[t], 0.5) - pct(lat["direct"], 0.5)
            print(f"{'added by ' + t:<24} {added:>8}")
    finally:
        pidfile = os.path.join(work, "pgbouncer", "pgbouncer.pid")
        if os.path.exists(pidfile):
            os.kill(int(open(pidfile).read()), signal.SIGTERM)
        node.send_signal(signal.SIGTERM)
        node.wait(60)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
