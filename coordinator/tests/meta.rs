//! The meta Raft group under faults: real `pgmr start` processes with their PostgreSQL, the
//! tutorial's three regions behind pgmr's simulated WAN, and faults injected by killing
//! processes and through `pgmr debug partition`.
//!
//! Metadata is written and read the way users do, through SQL on each node's PostgreSQL
//! (`multiregion.set_cluster_setting`, `multiregion.cluster_settings`, `multiregion.eventlog`,
//! `multiregion.nodes`, `multiregion.meta_group`).

mod common;

use common::*;
use sqlx::Row;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// The tutorial's regions with the RTTs `--latency global` uses.
const WAN: &str =
    "intra 2\nus-east1 us-west1 63\nus-east1 europe-west1 87\nus-west1 europe-west1 132\n";
const EAST_B: &str = "region=us-east1,zone=us-east1-b";
const EAST_C: &str = "region=us-east1,zone=us-east1-c";
const WEST_A: &str = "region=us-west1,zone=us-west1-a";
const WEST_B: &str = "region=us-west1,zone=us-west1-b";
const EU_B: &str = "region=europe-west1,zone=europe-west1-b";
const EU_C: &str = "region=europe-west1,zone=europe-west1-c";

/// Writes a cluster setting through `node`'s PostgreSQL; on failure, (SQLSTATE, message).
async fn set(node: &Node, name: &str, value: &str) -> Result<(), (String, String)> {
    let mut c = match try_sql(node).await {
        Some(c) => c,
        None => return Err(("08001".into(), "cannot connect".into())),
    };
    sqlx::query("SELECT multiregion.set_cluster_setting($1, $2)")
        .bind(name)
        .bind(value)
        .execute(&mut c)
        .await
        .map(|_| ())
        .map_err(|e| match e.as_database_error() {
            Some(db) => (
                db.code().unwrap_or_default().to_string(),
                db.message().to_string(),
            ),
            None => ("client".into(), e.to_string()),
        })
}

async fn try_sql(node: &Node) -> Option<sqlx::PgConnection> {
    use sqlx::ConnectOptions;
    sqlx::postgres::PgConnectOptions::new()
        .host("127.0.0.1")
        .port(node.pg_port)
        .username("postgres")
        .database("postgres")
        .connect()
        .await
        .ok()
}

/// The settings as `node` reads them (a linearizable read), or None if it cannot.
async fn settings(node: &Node) -> Option<BTreeMap<String, String>> {
    let mut c = try_sql(node).await?;
    let rows = sqlx::query("SELECT variable, value FROM multiregion.cluster_settings")
        .fetch_all(&mut c)
        .await
        .ok()?;
    Some(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// (leader, voters with their regions) as `node` sees the meta group.
async fn group(node: &Node) -> Option<(Option<i64>, BTreeMap<i64, String>)> {
    let mut c = try_sql(node).await?;
    let rows = sqlx::query(
        "SELECT g.node_id, g.role, g.leader, n.region \
         FROM multiregion.meta_group g JOIN multiregion.nodes n USING (node_id)",
    )
    .fetch_all(&mut c)
    .await
    .ok()?;
    let leader = rows.first().and_then(|r| r.get::<Option<i64>, _>("leader"));
    let voters = rows
        .iter()
        .filter(|r| r.get::<String, _>("role") == "voter")
        .map(|r| (r.get("node_id"), r.get("region")))
        .collect();
    Some((leader, voters))
}

/// Waits until the group has `n` voters, no region holding more than half of them, and an
/// elected leader; returns the leader.
async fn settled(node: &Node, n: usize) -> i64 {
    eventually(
        &format!("{n} voters spread over regions"),
        Duration::from_secs(90),
        || async {
            let (leader, voters) = group(node).await?;
            let mut per_region: BTreeMap<&str, usize> = BTreeMap::new();
            for r in voters.values() {
                *per_region.entry(r).or_default() += 1;
            }
            let spread = per_region.values().all(|c| *c * 2 < n.max(2));
            (voters.len() == n && spread).then_some(leader).flatten()
        },
    )
    .await
}

/// The values written to setting `name`, in the order the event log applied them.
async fn history(node: &Node, name: &str) -> Option<Vec<String>> {
    let mut c = try_sql(node).await?;
    sqlx::query_scalar(
        "SELECT info->>'value' FROM multiregion.eventlog \
         WHERE event_type = 'set_cluster_setting' AND info->>'name' = $1 ORDER BY id",
    )
    .bind(name)
    .fetch_all(&mut c)
    .await
    .ok()
}

fn partition(node: &Node, peers: &[usize]) {
    let peers: Vec<String> = peers.iter().map(|p| p.to_string()).collect();
    pgmr_ok(&[
        "debug",
        "partition",
        "--data-dir",
        node.data_dir.to_str().unwrap(),
        "--peers",
        &peers.join(","),
    ]);
}

fn heal(node: &Node) {
    pgmr_ok(&[
        "debug",
        "heal",
        "--data-dir",
        node.data_dir.to_str().unwrap(),
    ]);
}

/// Five voters over three regions: a write acknowledged by one node is visible at once on
/// every other (reads go through the leader's read index); killing the leader's whole node
/// leaves the group writable after a bounded election; the node, restarted on its data dir,
/// rejoins under its id and catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_group_survives_losing_its_leader_and_the_node_rejoins_with_its_state() {
    let dir = scratch("meta-failover");
    let mut nodes = start_cluster(
        dir.path(),
        11,
        WAN,
        &[EAST_B, EAST_C, WEST_A, WEST_B, EU_B, EU_C],
    )
    .await;
    let leader = settled(&nodes[0], 5).await;

    for (i, writer) in nodes.iter().enumerate() {
        let value = format!("from-{}", i + 1);
        set(writer, "test.rw", &value).await.unwrap();
        for reader in &nodes {
            let s = settings(reader).await.expect("every node reads");
            assert_eq!(
                s.get("test.rw"),
                Some(&value),
                "node {} read after node {} wrote",
                reader.pg_port,
                i + 1
            );
        }
    }

    let l = (leader - 1) as usize;
    nodes[l].crash();
    let writer = if l == 0 { 1 } else { 0 };
    let killed = Instant::now();
    eventually(
        "a write after the leader died",
        Duration::from_secs(30),
        || {
            let n = &nodes[writer];
            async move { set(n, "test.after", "yes").await.ok() }
        },
    )
    .await;
    let failover = killed.elapsed();
    eprintln!("leader {leader} killed; writable again after {failover:?}");
    assert!(
        failover < Duration::from_secs(20),
        "failover took {failover:?}"
    );
    let (new_leader, _) = group(&nodes[writer]).await.unwrap();
    assert_ne!(new_leader, Some(leader));

    nodes[l].restart();
    let back = &nodes[l];
    eventually(
        "the old leader to rejoin and catch up",
        Duration::from_secs(90),
        || async {
            let s = settings(back).await?;
            (s.get("test.after").map(String::as_str) == Some("yes")).then_some(())
        },
    )
    .await;
    let mut c = back.sql().await;
    let id: i64 = sqlx::query_scalar("SELECT node_id FROM multiregion.node_info()")
        .fetch_one(&mut c)
        .await
        .unwrap();
    assert_eq!(id, leader, "it rejoined under its own id");
}

/// A minority cut off from the rest cannot write or read (its requests fail with a
/// retryable or ambiguous error rather than succeed), while the majority keeps writing; once
/// healed, the minority converges on the majority's state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_minority_refuses_writes_and_converges_after_healing() {
    let dir = scratch("meta-minority");
    let nodes = start_cluster(dir.path(), 12, WAN, &[EAST_B, EAST_C, WEST_A, WEST_B, EU_B]).await;
    settled(&nodes[0], 5).await;
    set(&nodes[0], "test.before", "1").await.unwrap();

    // Nodes 4 and 5 on one side, 1–3 on the other, both directions.
    for n in &nodes[3..] {
        partition(n, &[1, 2, 3]);
    }
    for n in &nodes[..3] {
        partition(n, &[4, 5]);
    }
    eventually(
        "the majority to accept a write",
        Duration::from_secs(30),
        || async { set(&nodes[1], "test.majority", "yes").await.ok() },
    )
    .await;
    let minority = &nodes[4];
    let err = set(minority, "test.minority", "yes")
        .await
        .expect_err("a minority node cannot commit");
    assert!(
        err.0 == "40001" || err.0 == "40003",
        "a retryable or ambiguous error, got {err:?}"
    );
    assert!(
        settings(minority).await.is_none(),
        "nor serve a linearizable read"
    );

    for n in &nodes {
        heal(n);
    }
    for n in &nodes {
        eventually(
            "every node to see the majority's write",
            Duration::from_secs(60),
            || async {
                let s = settings(n).await?;
                (s.get("test.majority").map(String::as_str) == Some("yes")).then_some(())
            },
        )
        .await;
    }
    let h = history(&nodes[0], "test.minority").await.unwrap();
    assert!(
        h.len() <= 1,
        "the refused write applied at most once: {h:?}"
    );
    set(minority, "test.healed", "yes").await.unwrap();
}

/// Stopping every node and starting them again on their data dirs restores the metadata:
/// nodes, settings and the event log (persisted Raft log, vote and snapshots).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_every_node_restores_the_metadata() {
    let dir = scratch("meta-restart");
    let mut nodes = start_cluster(dir.path(), 13, WAN, &[EAST_B, WEST_A, EU_B]).await;
    settled(&nodes[0], 3).await;
    for i in 0..5 {
        set(&nodes[i % 3], "test.counter", &i.to_string())
            .await
            .unwrap();
    }
    let before = history(&nodes[2], "test.counter").await.unwrap();
    for n in nodes.iter_mut() {
        assert!(n.stop().success(), "clean stop");
    }
    for n in nodes.iter_mut() {
        n.restart();
    }
    for n in &nodes {
        eventually(
            "the restarted node to serve SQL",
            Duration::from_secs(90),
            || try_connect(n.pg_port),
        )
        .await;
    }
    settled(&nodes[0], 3).await;
    for n in &nodes {
        let h = eventually(
            "metadata after the restart",
            Duration::from_secs(60),
            || history(n, "test.counter"),
        )
        .await;
        assert_eq!(h, before);
        let s = settings(n).await.unwrap();
        assert_eq!(s.get("test.counter").map(String::as_str), Some("4"));
    }
    let mut c = nodes[1].sql().await;
    let ids: Vec<i64> = sqlx::query_scalar("SELECT node_id FROM multiregion.nodes")
        .fetch_all(&mut c)
        .await
        .unwrap();
    assert_eq!(ids, [1, 2, 3]);
    set(&nodes[1], "test.counter", "5").await.unwrap();
}

/// `pgmr node decommission` takes a node out for good: it leaves the meta group, shows as
/// decommissioned, its pgmr stops, and it cannot come back on that data dir. A node whose
/// data dir was wiped joins as a new node with a new id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decommissioned_nodes_leave_for_good_and_wiped_nodes_join_as_new() {
    let dir = scratch("meta-decommission");
    let mut nodes = start_cluster(dir.path(), 14, WAN, &[EAST_B, WEST_A, EU_B, EU_C]).await;
    settled(&nodes[0], 3).await;

    let out = pgmr_ok(&[
        "node",
        "decommission",
        "4",
        "--data-dir",
        nodes[0].data_dir.to_str().unwrap(),
    ]);
    assert!(out.contains("node 4 is decommissioned"), "{out}");
    let status = nodes[3].child.wait().unwrap();
    assert!(!status.success(), "its pgmr stops with an error");
    assert!(nodes[3].log().contains("node 4 was decommissioned"));
    let mut c = nodes[0].sql().await;
    let row = sqlx::query("SELECT status, meta_role FROM multiregion.nodes WHERE node_id = 4")
        .fetch_one(&mut c)
        .await
        .unwrap();
    assert_eq!(row.get::<String, _>(0), "decommissioned");
    assert_eq!(row.get::<String, _>(1), "none");
    nodes[3].restart();
    let status = nodes[3].child.wait().unwrap();
    assert!(
        !status.success(),
        "a decommissioned data dir cannot start again"
    );

    // Wipe node 3 (europe-west1) and start it again: it joins as node 5.
    nodes[2].crash();
    std::fs::remove_dir_all(&nodes[2].data_dir).unwrap();
    std::fs::create_dir_all(&nodes[2].data_dir).unwrap();
    // Same flags as before (it joined node 1 with the cluster secret file).
    std::fs::write(nodes[2].data_dir.join("pgmr.log"), "").unwrap();
    nodes[2].restart();
    let mut c3 = eventually(
        "the wiped node to serve SQL",
        Duration::from_secs(90),
        || try_connect(nodes[2].pg_port),
    )
    .await;
    let id: i64 = sqlx::query_scalar("SELECT node_id FROM multiregion.node_info()")
        .fetch_one(&mut c3)
        .await
        .unwrap();
    assert_eq!(id, 5, "a wiped node is a new node");

    // The old node 3 is gone for good once decommissioned; voters come from 1, 2 and 5.
    pgmr_ok(&[
        "node",
        "decommission",
        "3",
        "--data-dir",
        nodes[1].data_dir.to_str().unwrap(),
    ]);
    eventually("voters 1, 2 and 5", Duration::from_secs(60), || async {
        let (_, voters) = group(&nodes[0]).await?;
        (voters.keys().copied().collect::<Vec<_>>() == [1, 2, 5]).then_some(())
    })
    .await;
}

/// A small deterministic PRNG (xorshift), so a failing run can be replayed from its seed.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// Sequential writes through random nodes while nodes crash and restart, get partitioned and
/// healed, a node joins and another is decommissioned. Afterwards every node's event log holds
/// each acknowledged write exactly once, in acknowledgement order, and each failed write at
/// most once: committed metadata is never lost, duplicated or reordered. `MR_SEED` replays a
/// run; the seed is printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_faults_never_lose_duplicate_or_reorder_committed_metadata() {
    let seed: u64 = std::env::var("MR_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("randomized meta test: MR_SEED={seed}");
    let mut rng = Rng(seed);
    let dir = scratch("meta-random");
    let (rpc, pg) = ports(15);
    let mut nodes =
        start_cluster(dir.path(), 15, WAN, &[EAST_B, EAST_C, WEST_A, WEST_B, EU_B]).await;
    settled(&nodes[0], 5).await;

    let mut acked: Vec<String> = Vec::new();
    let mut failed: BTreeSet<String> = BTreeSet::new();
    let mut down: Option<usize> = None;
    let mut cut: Option<usize> = None;
    let mut joined = false;
    let mut decommissioned: Option<usize> = None;
    let usable =
        |i: usize, down: Option<usize>, dec: Option<usize>| Some(i) != down && Some(i) != dec;

    for step in 0..30 {
        // One fault action every other step.
        if step % 2 == 1 {
            match rng.below(5) {
                0 if down.is_none() => {
                    let i = rng.below(nodes.len());
                    if usable(i, down, decommissioned) && Some(i) != cut {
                        eprintln!("step {step}: crash node {}", i + 1);
                        nodes[i].crash();
                        down = Some(i);
                    }
                }
                1 if down.is_some() => {
                    let i = down.take().unwrap();
                    eprintln!("step {step}: restart node {}", i + 1);
                    nodes[i].restart();
                    // Later faults are injected through its local socket: wait for it.
                    let dir = nodes[i].data_dir.clone();
                    eventually(
                        "the restarted node's local socket",
                        Duration::from_secs(60),
                        || {
                            let dir = dir.clone();
                            async move {
                                std::process::Command::new(PGMR)
                                    .args(["status", "--data-dir", dir.to_str().unwrap()])
                                    .stdin(std::process::Stdio::null())
                                    .output()
                                    .ok()
                                    .filter(|o| o.status.success())
                                    .map(drop)
                            }
                        },
                    )
                    .await;
                }
                2 if cut.is_none() => {
                    let i = rng.below(nodes.len());
                    if usable(i, down, decommissioned) {
                        eprintln!("step {step}: partition node {}", i + 1);
                        let others: Vec<usize> =
                            (1..=nodes.len()).filter(|p| *p != i + 1).collect();
                        partition(&nodes[i], &others);
                        for (j, n) in nodes.iter().enumerate() {
                            if j != i && usable(j, down, decommissioned) {
                                partition(n, &[i + 1]);
                            }
                        }
                        cut = Some(i);
                    }
                }
                3 if cut.is_some() => {
                    eprintln!("step {step}: heal");
                    for (j, n) in nodes.iter().enumerate() {
                        if usable(j, down, decommissioned) {
                            heal(n);
                        }
                    }
                    cut = None;
                }
                4 if !joined => {
                    joined = true;
                    let secret = nodes[0].data_dir.join("cluster-secret");
                    let matrix = dir.path().join("matrix.txt");
                    eprintln!("step {step}: node 6 joins");
                    // Every node as a seed, as an operator would: one may be cut off.
                    let seeds: Vec<String> = nodes.iter().map(|n| n.rpc.clone()).collect();
                    let seeds = seeds.join(",");
                    let n = start_node(
                        dir.path(),
                        "n6",
                        EU_C,
                        rpc + 5,
                        pg + 5,
                        Some(&seeds),
                        &[
                            "--latency",
                            matrix.to_str().unwrap(),
                            "--secret-file",
                            secret.to_str().unwrap(),
                        ],
                    );
                    eventually("node 6 to serve SQL", Duration::from_secs(90), || {
                        try_connect(n.pg_port)
                    })
                    .await;
                    nodes.push(n);
                }
                4 if decommissioned.is_none() && down.is_none() => {
                    // Never node 1: the writer prefers it less, but the seeds point at it.
                    let i = 1 + rng.below(nodes.len() - 1);
                    if Some(i) != cut {
                        eprintln!("step {step}: decommission node {}", i + 1);
                        let via = nodes[0].data_dir.to_str().unwrap().to_string();
                        let out = std::process::Command::new(PGMR)
                            .args([
                                "node",
                                "decommission",
                                &(i + 1).to_string(),
                                "--data-dir",
                                &via,
                            ])
                            .output()
                            .unwrap();
                        eprintln!("  -> {}", String::from_utf8_lossy(&out.stderr).trim());
                        decommissioned = Some(i);
                    }
                }
                _ => {}
            }
        }
        let value = format!("v{step}");
        let candidates: Vec<usize> = (0..nodes.len())
            .filter(|i| usable(*i, down, decommissioned))
            .collect();
        let via = candidates[rng.below(candidates.len())];
        match set(&nodes[via], "test.chaos", &value).await {
            Ok(()) => acked.push(value),
            Err(e) => {
                eprintln!(
                    "step {step}: write {value} via node {} failed: {e:?}",
                    via + 1
                );
                failed.insert(value);
            }
        }
    }

    // Heal everything and bring the crashed node back.
    if let Some(i) = down.take() {
        nodes[i].restart();
    }
    for (j, n) in nodes.iter().enumerate() {
        if Some(j) != decommissioned {
            eventually("the node to serve SQL", Duration::from_secs(90), || {
                try_connect(n.pg_port)
            })
            .await;
            heal(n);
        }
    }
    assert!(
        acked.len() >= 10,
        "most writes succeed: {} of 30",
        acked.len()
    );
    let mut seen: Option<Vec<String>> = None;
    for (j, n) in nodes.iter().enumerate() {
        if Some(j) == decommissioned {
            continue;
        }
        let h = eventually("the event log", Duration::from_secs(60), || {
            history(n, "test.chaos")
        })
        .await;
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for v in &h {
            *counts.entry(v).or_default() += 1;
        }
        for (v, c) in &counts {
            assert_eq!(*c, 1, "node {}: {v} applied {c} times (seed {seed})", j + 1);
        }
        let acked_in_log: Vec<&String> = h.iter().filter(|v| acked.contains(v)).collect();
        assert_eq!(
            acked_in_log,
            acked.iter().collect::<Vec<_>>(),
            "node {}: every acknowledged write, once, in order (seed {seed})",
            j + 1
        );
        for v in &h {
            assert!(
                acked.contains(v) || failed.contains(v),
                "{v} was never written"
            );
        }
        match &seen {
            None => seen = Some(h),
            Some(first) => assert_eq!(first, &h, "every node has the same log (seed {seed})"),
        }
    }
}
