//! Cluster tests: real `pgmr start` processes, each supervising a real PostgreSQL with the
//! extension, talking over loopback through pgmr's simulated WAN.
//!
//! They need PostgreSQL 15 and the installed extension (`make test` installs both) and run
//! PostgreSQL as the `postgres` OS user when run as root.

mod common;

use common::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use sqlx::Row;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The RTTs `multiregion.network_latency()` reports between three nodes in three regions are
/// within ±25% of the configured matrix, in both directions of every pair, and
/// `multiregion.cluster_regions()` is identical on every node. This proves that every
/// inter-node message passes through the simulated WAN and that membership converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measured_rtts_match_the_configured_matrix_and_regions_agree() {
    let dir = scratch("rtt");
    let expected = |a: &str, b: &str| -> f64 {
        let mut p = [a, b];
        p.sort();
        match p {
            ["green", "red"] => 40.0,
            ["blue", "red"] => 70.0,
            ["blue", "green"] => 100.0,
            other => panic!("unexpected pair {other:?}"),
        }
    };
    let matrix = "intra 2\nred green 40\nred blue 70\ngreen blue 100\n";
    let localities = [
        "region=red,zone=red-a",
        "region=green,zone=green-a",
        "region=blue,zone=blue-a",
    ];
    let cluster = start_cluster(dir.path(), 1, matrix, &localities).await;
    let (n3, nodes) = (&cluster[2], [&cluster[0], &cluster[1], &cluster[2]]);

    // Wait until every node reports all six directed pairs with a full window of samples
    // (median of 9 heartbeats at 500 ms).
    tokio::time::sleep(Duration::from_secs(6)).await;
    for n in nodes {
        let rows = eventually(
            "a complete RTT matrix",
            Duration::from_secs(30),
            || async move {
                let mut c = n.sql().await;
                let rows = sqlx::query(
                    "SELECT from_node, from_region, to_node, to_region, rtt_ms, age_ms \
                     FROM multiregion.network_latency()",
                )
                .fetch_all(&mut c)
                .await
                .ok()?;
                let complete = rows.len() == 6
                    && rows
                        .iter()
                        .all(|r| r.get::<Option<f64>, _>("rtt_ms").is_some());
                complete.then_some(rows)
            },
        )
        .await;
        for r in rows {
            let (from, to): (String, String) = (r.get("from_region"), r.get("to_region"));
            let rtt: f64 = r.get::<Option<f64>, _>("rtt_ms").unwrap();
            let want = expected(&from, &to);
            assert!(
                (rtt - want).abs() <= want * 0.25,
                "{from}->{to}: measured {rtt:.1} ms, configured {want} ms (node on port {})",
                n.pg_port
            );
        }
    }

    let mut views = Vec::new();
    for n in nodes {
        let mut c = n.sql().await;
        let rows: Vec<(String, Vec<String>)> =
            sqlx::query_as("SELECT region, zones FROM multiregion.cluster_regions()")
                .fetch_all(&mut c)
                .await
                .unwrap();
        views.push(rows);
    }
    let want = vec![
        ("blue".to_string(), vec!["blue-a".to_string()]),
        ("green".to_string(), vec!["green-a".to_string()]),
        ("red".to_string(), vec!["red-a".to_string()]),
    ];
    for v in &views {
        assert_eq!(v, &want, "cluster_regions() differs between nodes");
    }

    // node_info() comes live from each node's own pgmr.
    let mut c = n3.sql().await;
    let (id, region, version): (i64, String, String) =
        sqlx::query_as("SELECT node_id, region, pgmr_version FROM multiregion.node_info()")
            .fetch_one(&mut c)
            .await
            .unwrap();
    assert_eq!((id, region.as_str()), (3, "blue"));
    assert_eq!(version, env!("CARGO_PKG_VERSION"));
}

/// Killing a node's postmaster with SIGKILL makes pgmr start a new one: connections work
/// again, `node_info()` shows a new pid and one restart, and committed data survived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgmr_restarts_postgres_after_it_is_killed() {
    let dir = scratch("restart");
    let (rpc, pg) = ports(2);
    let n = start_node(
        dir.path(),
        "n1",
        "region=us-east1,zone=us-east1-b",
        rpc,
        pg,
        None,
        &[],
    );
    let mut c = eventually("PostgreSQL", Duration::from_secs(90), || {
        try_connect(n.pg_port)
    })
    .await;
    sqlx::raw_sql("CREATE TABLE survivor(v int); INSERT INTO survivor VALUES (42)")
        .execute(&mut c)
        .await
        .unwrap();
    let (old_pid, restarts): (i32, i64) =
        sqlx::query_as("SELECT postmaster_pid, pg_restarts FROM multiregion.node_info()")
            .fetch_one(&mut c)
            .await
            .unwrap();
    assert_eq!(restarts, 0);
    drop(c);

    kill(Pid::from_raw(old_pid), Signal::SIGKILL).unwrap();

    let (new_pid, restarts) = eventually(
        "a restarted PostgreSQL",
        Duration::from_secs(60),
        || async {
            let mut c = try_connect(n.pg_port).await?;
            let row: (Option<i32>, i64) =
                sqlx::query_as("SELECT postmaster_pid, pg_restarts FROM multiregion.node_info()")
                    .fetch_one(&mut c)
                    .await
                    .ok()?;
            match row {
                (Some(pid), r) if pid != old_pid && r >= 1 => Some((pid, r)),
                _ => None,
            }
        },
    )
    .await;
    assert_ne!(new_pid, old_pid);
    assert_eq!(restarts, 1);
    let mut c = n.sql().await;
    let v: i32 = sqlx::query_scalar("SELECT v FROM survivor")
        .fetch_one(&mut c)
        .await
        .unwrap();
    assert_eq!(v, 42);
}

/// Runs `pgmr` with `args` and returns (exit code, stderr lines).
fn pgmr_fails(args: &[&str]) -> (i32, Vec<String>) {
    // Each `pgmr start` gets a SQL gateway port of its own, not the default 26257 another
    // test's cluster may hold.
    static NEXT_SQL_PORT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(25500);
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    if args.first().map(String::as_str) == Some("start")
        && !args.iter().any(|a| a == "--sql-listen")
    {
        let port = NEXT_SQL_PORT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        args.extend(["--sql-listen".to_string(), format!("127.0.0.1:{port}")]);
    }
    let out = Command::new(PGMR)
        .args(&args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    (
        out.status.code().unwrap_or(-1),
        stderr.lines().map(str::to_string).collect(),
    )
}

fn assert_one_line_error(args: &[&str], needle: &str) {
    let (code, lines) = pgmr_fails(args);
    assert_ne!(code, 0, "pgmr {args:?} must fail");
    let errors: Vec<&String> = lines.iter().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        errors.len(),
        1,
        "one line expected for {args:?}, got {lines:#?}"
    );
    assert!(
        errors[0].contains(needle),
        "{:?} should mention {needle:?}",
        errors[0]
    );
}

/// Bad flags and environments stop `pgmr start` at once with one line and a non-zero exit.
#[test]
fn bad_flags_and_environments_fail_with_one_line() {
    let dir = scratch("flags");
    let d = dir.path().join("d").display().to_string();
    assert_one_line_error(
        &[
            "start",
            "--locality",
            "zone=a",
            "--data-dir",
            &d,
            "--listen",
            "127.0.0.1:21901",
        ],
        "region",
    );
    assert_one_line_error(
        &[
            "start",
            "--locality",
            "region=a",
            "--data-dir",
            &d,
            "--listen",
            "127.0.0.1",
        ],
        "HOST:PORT",
    );
    assert_one_line_error(
        &[
            "start",
            "--locality",
            "region=a",
            "--data-dir",
            &d,
            "--listen",
            "127.0.0.1:21901",
            "--latency",
            "/nonexistent",
        ],
        "/nonexistent",
    );
    assert_one_line_error(&["start", "--bogus"], "--bogus");
    assert_one_line_error(
        &[
            "start",
            "--locality",
            "region=a",
            "--data-dir",
            "/proc/pgmr-test",
            "--listen",
            "127.0.0.1:21902",
        ],
        "/proc/pgmr-test",
    );
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_addr = busy.local_addr().unwrap().to_string();
    assert_one_line_error(
        &[
            "start",
            "--locality",
            "region=a",
            "--data-dir",
            &d,
            "--listen",
            &busy_addr,
        ],
        &busy_addr,
    );
    // A busy SQL gateway port, likewise.
    assert_one_line_error(
        &[
            "start",
            "--locality",
            "region=a",
            "--data-dir",
            &d,
            "--listen",
            "127.0.0.1:21905",
            "--sql-listen",
            &busy_addr,
        ],
        &busy_addr,
    );
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef").unwrap();
    let d2 = dir.path().join("d2").display().to_string();
    assert_one_line_error(
        &[
            "start",
            "--locality",
            "region=a",
            "--data-dir",
            &d2,
            "--listen",
            "127.0.0.1:21903",
            "--join",
            "127.0.0.1:1",
            "--join-timeout",
            "1s",
            "--secret-file",
            secret.to_str().unwrap(),
        ],
        "cannot join",
    );
    let d3 = dir.path().join("d3").display().to_string();
    assert_one_line_error(
        &[
            "start",
            "--locality",
            "region=a",
            "--data-dir",
            &d3,
            "--listen",
            "127.0.0.1:21904",
            "--join",
            "127.0.0.1:1",
        ],
        "--secret-file",
    );
}

/// A node that does not know the cluster secret cannot join: the inter-node handshake
/// authenticates both ends before any request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joining_with_the_wrong_secret_is_refused() {
    let dir = scratch("auth");
    let (rpc, pg) = ports(3);
    let n1 = start_node(dir.path(), "n1", "region=a,zone=a-1", rpc, pg, None, &[]);
    eventually("node 1", Duration::from_secs(90), || {
        try_connect(n1.pg_port)
    })
    .await;
    let wrong = dir.path().join("wrong-secret");
    std::fs::write(&wrong, "this-is-not-the-cluster-secret").unwrap();
    let d = dir.path().join("n2").display().to_string();
    let (code, lines) = pgmr_fails(&[
        "start",
        "--locality",
        "region=b",
        "--data-dir",
        &d,
        "--listen",
        &format!("127.0.0.1:{}", rpc + 1),
        "--join",
        &n1.rpc,
        "--secret-file",
        wrong.to_str().unwrap(),
        "--pg-port",
        &(pg + 1).to_string(),
    ]);
    assert_ne!(code, 0);
    let last = lines.last().cloned().unwrap_or_default();
    assert!(
        last.contains("cluster secret"),
        "refusal should name the secret: {lines:#?}"
    );
}

/// `pgmr demo --no-shell` brings up a cluster whose every node sees every other, prints one
/// connection URL per node, serves SQL on them, and on SIGTERM stops every process it started
/// (a PostgreSQL whose pgmr was killed included) and removes its temporary data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_starts_a_cluster_and_cleans_up_on_sigterm() {
    use std::io::{BufRead, BufReader};
    let mut demo = Command::new(PGMR)
        .args(["demo", "--global", "--nodes", "3", "--no-shell"])
        .args(["--pg-port-base", "23100", "--rpc-port-base", "23200"])
        .args(["--sql-port-base", "23300", "--http-port-base", "23400"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = demo.stdout.take().unwrap();
    let lines = std::thread::spawn(move || {
        let mut urls = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let line = line.unwrap();
            if let Some(i) = line.find("postgres://") {
                urls.push(line[i..].to_string());
            }
            if line.contains("Ctrl-C") {
                break;
            }
        }
        urls
    });
    let urls = lines.join().unwrap();
    assert_eq!(
        urls,
        (0..3)
            .map(|i| format!(
                "postgres://postgres@127.0.0.1:{}/postgres | \
                 postgresql://root@127.0.0.1:{}/defaultdb?sslmode=disable",
                23100 + i,
                23300 + i
            ))
            .collect::<Vec<_>>()
    );
    let mut c = try_connect(23102).await.expect("node 3 serves SQL");
    let (id, region): (i64, String) =
        sqlx::query_as("SELECT node_id, region FROM multiregion.node_info()")
            .fetch_one(&mut c)
            .await
            .unwrap();
    assert_eq!(
        (id, region.as_str()),
        (3, "europe-west1"),
        "node ids follow the layout"
    );
    let regions: Vec<String> =
        sqlx::query_scalar("SELECT region FROM multiregion.cluster_regions()")
            .fetch_all(&mut c)
            .await
            .unwrap();
    assert_eq!(regions, ["europe-west1", "us-east1", "us-west1"]);
    drop(c);

    let children: Vec<i32> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit(')')
                        .next()
                        .map(|r| r.split_whitespace().nth(1) == Some(&demo.id().to_string()))
                })
                .unwrap_or(false)
        })
        .collect();
    assert_eq!(children.len(), 3, "one pgmr child per node");
    // One node's pgmr killed outright leaves its PostgreSQL running: the demo stops it too.
    kill(Pid::from_raw(children[1]), Signal::SIGKILL).unwrap();
    let stderr = demo.stderr.take().unwrap();
    let err_text = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());
    kill(Pid::from_raw(demo.id() as i32), Signal::SIGTERM).unwrap();
    let status = demo.wait().unwrap();
    let err_text = err_text.join().unwrap();
    assert!(status.success(), "demo exit: {status}\n{err_text}");
    for pid in children {
        assert!(
            kill(Pid::from_raw(pid), None).is_err(),
            "pgmr {pid} outlived the demo"
        );
    }
    for port in 23100..23103 {
        assert!(
            std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
            "PostgreSQL port {port} is free again\n{err_text}"
        );
    }
    assert!(
        err_text.contains("which its pgmr left running"),
        "the demo says it stopped a PostgreSQL left running:\n{err_text}"
    );
}

/// A pgmr that stops answering (SIGSTOP: its socket still accepts connections) cannot hang a
/// backend: `node_info()` fails with 08006 after `multiregion.sidecar_timeout`, and a
/// `statement_timeout` shorter than that cancels the wait with PostgreSQL's own 57014.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_pgmr_cannot_hang_a_backend() {
    let dir = scratch("stuck");
    let (rpc, pg) = ports(4);
    let n = start_node(dir.path(), "n1", "region=a,zone=a-1", rpc, pg, None, &[]);
    let mut c = eventually("PostgreSQL", Duration::from_secs(90), || {
        try_connect(n.pg_port)
    })
    .await;
    let pgmr = Pid::from_raw(n.child.id() as i32);
    stop_process(pgmr).await;

    sqlx::raw_sql("SET multiregion.sidecar_timeout = 300")
        .execute(&mut c)
        .await
        .unwrap();
    let (code, message) = fails_within(&mut c, "SELECT * FROM multiregion.node_info()").await;
    assert_eq!(code, "08006", "{message}");
    assert!(
        message.contains("did not answer within 300 ms"),
        "{message}"
    );

    sqlx::raw_sql("SET multiregion.sidecar_timeout = '60s'; SET statement_timeout = 300")
        .execute(&mut c)
        .await
        .unwrap();
    let (code, message) = fails_within(&mut c, "SELECT * FROM multiregion.cluster_regions()").await;
    assert_eq!(code, "57014", "{message}");

    kill(pgmr, Signal::SIGCONT).unwrap();
    sqlx::raw_sql("RESET statement_timeout; RESET multiregion.sidecar_timeout")
        .execute(&mut c)
        .await
        .unwrap();
    let regions: Vec<String> =
        sqlx::query_scalar("SELECT region FROM multiregion.cluster_regions()")
            .fetch_all(&mut c)
            .await
            .unwrap();
    assert_eq!(
        regions,
        ["a"],
        "the same backend works again once pgmr answers"
    );
}

/// Whether `node` (by data dir) currently sees `peer` as live, from `pgmr status --json`.
fn sees_live(node: &Node, peer: u64) -> bool {
    let json = pgmr_ok(&[
        "status",
        "--json",
        "--data-dir",
        node.data_dir.to_str().unwrap(),
    ]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    v["peers"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["node_id"] == peer && p["live"] == true)
}

async fn rtt(node: &Node, from: i64, to: i64) -> Option<f64> {
    let mut c = node.sql().await;
    sqlx::query_scalar(
        "SELECT rtt_ms FROM multiregion.network_latency() WHERE from_node = $1 AND to_node = $2",
    )
    .bind(from)
    .bind(to)
    .fetch_one(&mut c)
    .await
    .ok()
    .flatten()
}

/// Faults injected at runtime through `pgmr debug` act on the sender's links only: a one-way
/// partition 1→3 makes node 3 lose node 1 while node 1 still hears node 3 (its requests arrive)
/// and node 2 sees both; healing restores it; an extra delay 1→2 shows in the RTT both nodes
/// measure, since every round trip crosses that link once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_partitions_and_delays_act_on_one_direction_and_heal() {
    let dir = scratch("faults");
    let matrix = "intra 2\nred green 20\nred blue 20\ngreen blue 20\n";
    let cluster = start_cluster(
        dir.path(),
        5,
        matrix,
        &["region=red", "region=green", "region=blue"],
    )
    .await;
    let (n1, n2, n3) = (&cluster[0], &cluster[1], &cluster[2]);
    eventually("full mesh", Duration::from_secs(30), || async {
        (sees_live(n1, 3) && sees_live(n3, 1) && sees_live(n2, 1)).then_some(())
    })
    .await;

    let d1 = n1.data_dir.to_str().unwrap().to_string();
    let out = pgmr_ok(&["debug", "partition", "--data-dir", &d1, "--peers", "3"]);
    assert!(out.contains("to node 3: partitioned=true"), "{out}");
    eventually("node 3 to lose node 1", Duration::from_secs(15), || async {
        (!sees_live(n3, 1)).then_some(())
    })
    .await;
    assert!(sees_live(n1, 3), "node 1 still hears node 3's heartbeats");
    assert!(
        sees_live(n2, 1) && sees_live(n2, 3),
        "node 2 is not partitioned"
    );

    let out = pgmr_ok(&["debug", "heal", "--data-dir", &d1]);
    assert!(out.contains("no link faults"), "{out}");
    eventually(
        "node 3 to see node 1 again",
        Duration::from_secs(15),
        || async { sees_live(n3, 1).then_some(()) },
    )
    .await;

    pgmr_ok(&[
        "debug",
        "fault",
        "--data-dir",
        &d1,
        "--peers",
        "2",
        "--extra-delay",
        "100ms",
    ]);
    // The RTT is a median of 9 samples at 500 ms: it moves once most samples are new.
    let (one_two, two_one) = eventually(
        "the extra delay in both measurements",
        Duration::from_secs(20),
        || async {
            let (a, b) = (rtt(n1, 1, 2).await?, rtt(n1, 2, 1).await?);
            (a > 110.0 && b > 110.0).then_some((a, b))
        },
    )
    .await;
    assert!(
        one_two < 150.0 && two_one < 150.0,
        "20 ms WAN + 100 ms: {one_two} / {two_one}"
    );

    let (code, lines) = pgmr_fails(&["debug", "fault", "--data-dir", &d1, "--drop-rate", "2"]);
    assert_ne!(code, 0);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("drop rate 2 is not between 0 and 1"),
        "{lines:?}"
    );
}

/// `pgmr start --log-format json` writes each of its log lines as one JSON object, with the
/// level and the event's fields (PostgreSQL's own lines, which pgmr passes through, stay
/// PostgreSQL's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_lines_are_json_objects_on_request() {
    let dir = scratch("json-log");
    let (rpc, pg) = ports(65);
    let n = start_node(
        dir.path(),
        "n1",
        "region=us-east1,zone=us-east1-b",
        rpc,
        pg,
        None,
        &["--log-format", "json"],
    );
    let log = eventually("the node up", Duration::from_secs(90), || async {
        let log = n.log();
        log.contains("node is up").then_some(log)
    })
    .await;
    let mut up = false;
    for line in log.lines().filter(|l| l.starts_with('{')) {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["level"].is_string(), "{line}");
        up |= v["fields"]["message"] == "node is up";
    }
    assert!(up, "the start-up line is a JSON object:\n{log}");
    assert!(!log.contains(" INFO pgmr"), "no text-format line:\n{log}");
}

/// A node whose clock is 40 s off from the others' stops itself, with its reason, and the
/// others go on: the commit protocol compares times taken on different nodes and tolerates
/// 30 s (ARCHITECTURE.md §8.5, "Clocks"). Node 3 restarts with its clock shifted
/// (`PGMR_CLOCK_SKEW_MS`); nodes 1 and 2 each see one peer off out of two, which does not
/// tell them their own clock is wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_clock_is_far_from_the_others_stops_and_the_others_go_on() {
    let dir = scratch("clock");
    let matrix = "intra 2\nred green 20\nred blue 20\ngreen blue 20\n";
    let localities = [
        "region=red,zone=red-a",
        "region=green,zone=green-a",
        "region=blue,zone=blue-a",
    ];
    let mut cluster = start_cluster(dir.path(), 85, matrix, &localities).await;
    let mut c = cluster[0].sql().await;
    sqlx::raw_sql("CREATE TABLE after_the_stop (v int)")
        .execute(&mut c)
        .await
        .unwrap();
    assert!(cluster[2].stop().success());
    cluster[2].restart_with_env(&[("PGMR_CLOCK_SKEW_MS", "40000")]);
    let status = eventually("node 3 to stop itself", Duration::from_secs(120), || {
        let exited = cluster[2].child.try_wait().unwrap();
        async move { exited }
    })
    .await;
    assert!(!status.success(), "node 3 exits with an error");
    let log = cluster[2].log();
    assert!(
        log.contains("node 3's clock is more than 1000 ms from most other nodes'"),
        "node 3's log gives the reason:\n{log}"
    );
    for n in &mut cluster[..2] {
        assert!(
            n.child.try_wait().unwrap().is_none(),
            "nodes with agreeing clocks keep running"
        );
    }
    // Its ranges' other voters carry on without it.
    eventually("a write through node 1", Duration::from_secs(30), || {
        let port = cluster[0].pg_port;
        async move {
            let mut c = try_connect(port).await?;
            sqlx::query("INSERT INTO after_the_stop VALUES (1)")
                .execute(&mut c)
                .await
                .ok()
        }
    })
    .await;
    let port = cluster[1].pg_port;
    eventually(
        "the row on node 2",
        Duration::from_secs(30),
        || async move {
            let mut c = try_connect(port).await?;
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM after_the_stop")
                .fetch_one(&mut c)
                .await
                .ok()?;
            (n == 1).then_some(())
        },
    )
    .await;
}
