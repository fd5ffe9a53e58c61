//! Meta group benchmark: metadata write and linearizable read latency with all voters in one
//! region and with voters over the tutorial's three regions, and leader failover time.
//!
//! `make bench-meta` (or `cargo bench -p pgmr --bench meta`). Real `pgmr` processes and
//! PostgreSQL servers on loopback behind pgmr's simulated WAN (63/87/132 ms between regions,
//! 2 ms within one). Every operation goes through SQL on a node's PostgreSQL, as a user's
//! would. The floor printed beside each write is the RTT the quorum needs at least: the
//! leader's round trip to the nearest majority of voters, from the configured matrix.

#[path = "../coordinator/tests/common/mod.rs"]
mod common;

use common::*;
use sqlx::{PgConnection, Row};
use std::time::{Duration, Instant};

const WAN: &str =
    "intra 2\nus-east1 us-west1 63\nus-east1 europe-west1 87\nus-west1 europe-west1 132\n";
const WRITES: usize = 200;
const READS: usize = 200;
const FAILOVERS: usize = 5;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

struct Stats {
    p50: f64,
    p99: f64,
}

fn stats(mut v: Vec<f64>) -> Stats {
    v.sort_by(|a, b| a.total_cmp(b));
    Stats {
        p50: percentile(&v, 0.5),
        p99: percentile(&v, 0.99),
    }
}

async fn leader(c: &mut PgConnection) -> i64 {
    loop {
        let l: Option<i64> =
            sqlx::query_scalar("SELECT leader FROM multiregion.meta_group LIMIT 1")
                .fetch_optional(&mut *c)
                .await
                .ok()
                .flatten()
                .flatten();
        if let Some(l) = l {
            return l;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn voters(c: &mut PgConnection) -> usize {
    let n: i64 =
        sqlx::query_scalar("SELECT count(*) FROM multiregion.meta_group WHERE role = 'voter'")
            .fetch_one(c)
            .await
            .unwrap_or(0);
    n as usize
}

async fn wait_voters(node: &Node, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let mut c = node.sql().await;
        if voters(&mut c).await == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the group never reached {n} voters"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Runs `sql` (with `$1` bound to the iteration number) `n` times on one connection to
/// `node`, timing each.
async fn timed(node: &Node, n: usize, sql: &str) -> Stats {
    let mut c = node.sql().await;
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        sqlx::query(sql)
            .bind(i.to_string())
            .execute(&mut c)
            .await
            .unwrap();
        v.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    stats(v)
}

async fn timed_writes(node: &Node, n: usize) -> Stats {
    timed(
        node,
        n,
        "SELECT multiregion.set_cluster_setting('bench.value', $1)",
    )
    .await
}

async fn timed_reads(node: &Node, n: usize) -> Stats {
    timed(
        node,
        n,
        "SELECT value FROM multiregion.cluster_settings WHERE variable = 'bench.value' AND $1 IS NOT NULL",
    )
    .await
}

/// A local PostgreSQL write on the same node, through the same client: the part of each
/// metadata write that is not consensus.
async fn timed_local(node: &Node, n: usize) -> Stats {
    let mut c = node.sql().await;
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS bench_kv (k int PRIMARY KEY, v text); INSERT INTO bench_kv VALUES (1, '') ON CONFLICT DO NOTHING")
        .execute(&mut c)
        .await
        .unwrap();
    timed(node, n, "UPDATE bench_kv SET v = $1 WHERE k = 1").await
}

async fn region_of(c: &mut PgConnection, id: i64) -> String {
    sqlx::query("SELECT region FROM multiregion.nodes WHERE node_id = $1")
        .bind(id)
        .fetch_one(c)
        .await
        .unwrap()
        .get(0)
}

fn row(what: &str, s: &Stats, floor: &str) {
    println!("| {what} | {:.1} | {:.1} | {floor} |", s.p50, s.p99);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes --bench; nothing else is accepted.
    println!("# meta group benchmark ({WRITES} writes, {READS} reads per row; ms)\n");
    println!("| scenario | p50 | p99 | quorum RTT floor |");
    println!("|---|---|---|---|");

    // All three voters in us-east1.
    {
        let dir = scratch("bench-meta-one");
        let nodes = start_cluster(
            dir.path(),
            40,
            WAN,
            &[
                "region=us-east1,zone=us-east1-b",
                "region=us-east1,zone=us-east1-c",
                "region=us-east1,zone=us-east1-d",
            ],
        )
        .await;
        wait_voters(&nodes[0], 3).await;
        let mut c = nodes[0].sql().await;
        let l = leader(&mut c).await;
        let on_leader = &nodes[(l - 1) as usize];
        let follower = &nodes[if l == 1 { 1 } else { 0 }];
        row(
            "local PostgreSQL UPDATE (baseline)",
            &timed_local(on_leader, WRITES).await,
            "-",
        );
        row(
            "1 region, write via leader",
            &timed_writes(on_leader, WRITES).await,
            "2 ms",
        );
        row(
            "1 region, write via follower",
            &timed_writes(follower, WRITES).await,
            "4 ms",
        );
        row(
            "1 region, read via follower",
            &timed_reads(follower, READS).await,
            "2 ms",
        );
    }

    // Five voters over three regions (2 us-east1, 2 us-west1, 1 europe-west1).
    let dir = scratch("bench-meta-three");
    let mut nodes = start_cluster(
        dir.path(),
        41,
        WAN,
        &[
            "region=us-east1,zone=us-east1-b",
            "region=us-east1,zone=us-east1-c",
            "region=us-west1,zone=us-west1-a",
            "region=us-west1,zone=us-west1-b",
            "region=europe-west1,zone=europe-west1-b",
        ],
    )
    .await;
    wait_voters(&nodes[0], 5).await;
    let mut c = nodes[0].sql().await;
    let l = leader(&mut c).await;
    let region = region_of(&mut c, l).await;
    // Majority of 5 is 3: the leader, its same-region peer (2 ms) and the nearest other region.
    let floor = match region.as_str() {
        "us-east1" => "63 ms",
        "us-west1" => "63 ms",
        _ => "87 ms",
    };
    let on_leader = &nodes[(l - 1) as usize];
    let far = nodes
        .iter()
        .enumerate()
        .find(|(i, _)| {
            let r = [
                "us-east1",
                "us-east1",
                "us-west1",
                "us-west1",
                "europe-west1",
            ][*i];
            r != region
        })
        .map(|(_, n)| n)
        .unwrap();
    row(
        &format!("3 regions, write via leader ({region})"),
        &timed_writes(on_leader, WRITES).await,
        floor,
    );
    row(
        "3 regions, write via a node in another region",
        &timed_writes(far, WRITES).await,
        "floor + RTT to leader",
    );
    row(
        "3 regions, read via a node in another region",
        &timed_reads(far, READS).await,
        "RTT to leader + quorum",
    );

    // Failover: kill the leader's node, time until a write through another node commits.
    let mut times = Vec::new();
    for _ in 0..FAILOVERS {
        let mut c = nodes[0].sql().await;
        let l = leader(&mut c).await;
        drop(c);
        let i = (l - 1) as usize;
        let writer = if i == 0 { 1 } else { 0 };
        let mut wc = nodes[writer].sql().await;
        nodes[i].crash();
        let t = Instant::now();
        loop {
            let ok = sqlx::query("SELECT multiregion.set_cluster_setting('bench.failover', 'x')")
                .execute(&mut wc)
                .await
                .is_ok();
            if ok {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        times.push(t.elapsed().as_secs_f64() * 1000.0);
        nodes[i].restart();
        // Let the node come back and the group settle before the next round.
        let deadline = Instant::now() + Duration::from_secs(120);
        while try_connect(nodes[i].pg_port).await.is_none() {
            assert!(Instant::now() < deadline, "restarted node never came back");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        wait_voters(&nodes[0], 5).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let all: Vec<String> = times.iter().map(|t| format!("{:.0}", t)).collect();
    let s = stats(times);
    println!(
        "\nleader failover ({FAILOVERS} kills of the leader's node; election timeout 1.5-3 s): median {:.0} ms, max {:.0} ms; all: {}",
        s.p50,
        s.p99,
        all.join(", ")
    );
}
