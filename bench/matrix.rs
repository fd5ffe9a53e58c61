//! The latency matrix of a 9-node multi-region cluster (issue 12 item 9): p50/p99 of a point
//! read and a single-row write for each (gateway region × row's home region), for REGIONAL BY
//! ROW, REGIONAL BY TABLE and GLOBAL tables, next to plain PostgreSQL on one node and the
//! floor the simulated round-trip times allow.
//!
//! `make bench-matrix` (or `cargo bench -p pgmr --bench matrix`). Real `pgmr` processes and
//! PostgreSQL servers on loopback behind pgmr's simulated WAN (the tutorial's RTTs: 63/87/132
//! ms between regions, 2 ms within one), the shape of `pgmr demo --global --nodes 9`: three
//! nodes in each of us-east1, us-west1 and europe-west1. A database with the three regions
//! (primary us-east1, SURVIVE ZONE FAILURE): each table or partition has three voters and the
//! leaseholder in its home region and a non-voting replica in each other region.
//!
//! Clients connect to one node per region (its PostgreSQL port) and use the simple query
//! protocol, so an autocommit statement on rows leased elsewhere is one message to the
//! leaseholder (statement and commit). GLOBAL tables are placed and leased like REGIONAL BY
//! TABLE IN PRIMARY REGION until non-blocking reads exist (the time work after issue 12).

#[path = "../coordinator/tests/common/mod.rs"]
mod common;

use common::*;
use sqlx::postgres::PgConnection;
use std::time::{Duration, Instant};

const WAN: &str =
    "intra 2\nus-east1 us-west1 63\nus-east1 europe-west1 87\nus-west1 europe-west1 132\n";
const REGIONS: [&str; 3] = ["us-east1", "us-west1", "europe-west1"];
/// Operations per cell.
const OPS: usize = 100;
/// Rows per table (or per REGIONAL BY ROW partition).
const ROWS: usize = 100;

fn rtt(a: &str, b: &str) -> u32 {
    match (a, b) {
        _ if a == b => 2,
        ("us-east1", "us-west1") | ("us-west1", "us-east1") => 63,
        ("us-east1", "europe-west1") | ("europe-west1", "us-east1") => 87,
        _ => 132,
    }
}

/// The floor of a read and of a write from `gateway` to a row homed in `home`: in the home
/// region a read-index or quorum round (2 ms) plus the hop to the leaseholder if the gateway
/// is not it; elsewhere one round trip to the leaseholder (its quorum round on top).
fn floor(gateway: &str, home: &str) -> String {
    if gateway == home {
        "2–4, 2–4".into()
    } else {
        let r = rtt(gateway, home);
        format!("{r}, {r}+2")
    }
}

fn p50_p99(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |p: f64| v[((v.len() as f64 - 1.0) * p).round() as usize];
    (at(0.5), at(0.99))
}

/// A connection to `db` on `node`; the benchmark cannot go on without it.
async fn connect_ok(node: &Node, db: &str) -> PgConnection {
    connect(node, db).await.expect("connect")
}

/// Latencies (ms) of `OPS` runs of `sql` (simple protocol), `{}` replaced by keys from `keys`.
async fn latencies(c: &mut PgConnection, sql: &str, keys: std::ops::Range<usize>) -> Vec<f64> {
    let mut out = Vec::with_capacity(OPS);
    for i in 0..OPS {
        let key = keys.start + i % keys.len();
        let text = sql.replace("{}", &key.to_string());
        let started = Instant::now();
        sqlx::raw_sql(&text)
            .execute(&mut *c)
            .await
            .unwrap_or_else(|e| panic!("{text}: {e}"));
        out.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    out
}

/// Waits until every range of database `bench` has its lease in its home region (the
/// partition's region, or the table's), as `multiregion.ranges` shows.
async fn leases_at_home(node: &Node) {
    eventually(
        "every lease in its home region",
        Duration::from_secs(180),
        || async {
            let mut c = connect_ok(node, "bench").await;
            let away: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM multiregion.ranges r \
             WHERE r.database_name = 'bench' AND (r.lease_holder IS NULL OR \
               r.lease_holder_region IS DISTINCT FROM coalesce(r.partition, \
                 CASE WHEN r.table_name LIKE 'rbt\\_%' THEN \
                   replace(substr(r.table_name, 5), '_', '-') ELSE 'us-east1' END))",
            )
            .fetch_one(&mut c)
            .await
            .ok()?;
            (away == 0).then_some(())
        },
    )
    .await;
}

fn cell((p50, p99): (f64, f64)) -> String {
    format!("{p50:.1} / {p99:.1}")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dir = scratch("bench-matrix");
    println!("# latency matrix, 9 nodes ({OPS} operations per cell; p50 / p99 ms)\n");
    let zones = [["b", "c", "d"], ["a", "b", "c"], ["b", "c", "d"]];
    let localities: Vec<String> = REGIONS
        .iter()
        .zip(zones)
        .flat_map(|(r, zs)| zs.map(|z| format!("region={r},zone={r}-{z}")))
        .collect();
    let localities: Vec<&str> = localities.iter().map(String::as_str).collect();
    let nodes = start_cluster(dir.path(), 41, WAN, &localities).await;
    // The first node of each region is that region's gateway.
    let gateway = |region: usize| &nodes[region * 3];
    enable_replication(&nodes[0]).await;
    exec(&mut nodes[0].sql().await, "CREATE DATABASE bench").await;
    let mut b = connect_ok(&nodes[0], "bench").await;
    exec(
        &mut b,
        r#"SELECT multiregion.execute('ALTER DATABASE bench PRIMARY REGION "us-east1"');
           SELECT multiregion.execute('ALTER DATABASE bench ADD REGION "us-west1"');
           SELECT multiregion.execute('ALTER DATABASE bench ADD REGION "europe-west1"');
           CREATE TABLE rbr (k int PRIMARY KEY, v int NOT NULL);
           SELECT multiregion.execute('ALTER TABLE rbr SET LOCALITY REGIONAL BY ROW');
           CREATE TABLE glob (k int PRIMARY KEY, v int NOT NULL);
           SELECT multiregion.execute('ALTER TABLE glob SET LOCALITY GLOBAL');
           CREATE TABLE plain (k int PRIMARY KEY, v int NOT NULL);"#,
    )
    .await;
    for r in REGIONS {
        let t = format!("rbt_{}", r.replace('-', "_"));
        exec(
            &mut b,
            &format!(
                "CREATE TABLE {t} (k int PRIMARY KEY, v int NOT NULL); \
                 SELECT multiregion.execute('ALTER TABLE {t} SET LOCALITY REGIONAL BY TABLE IN \"{r}\"')"
            ),
        )
        .await;
    }
    leases_at_home(&nodes[0]).await;
    // Rows, each written through its home region.
    for (i, r) in REGIONS.iter().enumerate() {
        let mut g = connect_ok(gateway(i), "bench").await;
        let t = format!("rbt_{}", r.replace('-', "_"));
        exec(
            &mut g,
            &format!(
                "INSERT INTO rbr (crdb_region, k, v) SELECT '{r}', {base} + g, 0 FROM generate_series(1, {ROWS}) g; \
                 INSERT INTO {t} SELECT g, 0 FROM generate_series(1, {ROWS}) g",
                base = i * 1000
            ),
        )
        .await;
    }
    exec(
        &mut b,
        &format!("INSERT INTO glob SELECT g, 0 FROM generate_series(1, {ROWS}) g"),
    )
    .await;
    // The baseline: node 1's PostgreSQL, a table whose rows nothing captures or routes.
    exec(
        &mut b,
        &format!(
            "ALTER TABLE plain DISABLE TRIGGER multiregion_capture, \
                 DISABLE TRIGGER multiregion_capture_truncate, DISABLE TRIGGER _multiregion_route; \
             SET session_replication_role = replica; \
             INSERT INTO plain SELECT g, 0 FROM generate_series(1, {ROWS}) g; \
             RESET session_replication_role"
        ),
    )
    .await;
    let plain_read =
        p50_p99(latencies(&mut b, "SELECT v FROM plain WHERE k = {}", 1..ROWS + 1).await);
    let plain_write = p50_p99(
        latencies(
            &mut b,
            "UPDATE plain SET v = v + 1 WHERE k = {}",
            1..ROWS + 1,
        )
        .await,
    );
    println!(
        "plain PostgreSQL on one node (no replication): read {}, write {}\n",
        cell(plain_read),
        cell(plain_write)
    );
    println!("| table | gateway | home | read | write | floor ms (read, write) |");
    println!("|---|---|---|---|---|---|");
    for (gi, g) in REGIONS.iter().enumerate() {
        let mut c = connect_ok(gateway(gi), "bench").await;
        for (hi, h) in REGIONS.iter().enumerate() {
            let floor = floor(g, h);
            let keys = hi * 1000 + 1..hi * 1000 + ROWS + 1;
            let read = latencies(
                &mut c,
                &format!("SELECT v FROM rbr WHERE crdb_region = '{h}' AND k = {{}}"),
                keys.clone(),
            )
            .await;
            let write = latencies(
                &mut c,
                &format!("UPDATE rbr SET v = v + 1 WHERE crdb_region = '{h}' AND k = {{}}"),
                keys,
            )
            .await;
            println!(
                "| REGIONAL BY ROW | {g} | {h} | {} | {} | {floor} |",
                cell(p50_p99(read)),
                cell(p50_p99(write)),
            );
        }
        for h in REGIONS {
            let t = format!("rbt_{}", h.replace('-', "_"));
            let read = latencies(
                &mut c,
                &format!("SELECT v FROM {t} WHERE k = {{}}"),
                1..ROWS + 1,
            )
            .await;
            let write = latencies(
                &mut c,
                &format!("UPDATE {t} SET v = v + 1 WHERE k = {{}}"),
                1..ROWS + 1,
            )
            .await;
            let floor = floor(g, h);
            println!(
                "| REGIONAL BY TABLE | {g} | {h} | {} | {} | {floor} |",
                cell(p50_p99(read)),
                cell(p50_p99(write)),
            );
        }
        let read = latencies(&mut c, "SELECT v FROM glob WHERE k = {}", 1..ROWS + 1).await;
        let write = latencies(
            &mut c,
            "UPDATE glob SET v = v + 1 WHERE k = {}",
            1..ROWS + 1,
        )
        .await;
        let floor = floor(g, "us-east1");
        println!(
            "| GLOBAL | {g} | us-east1 | {} | {} | {floor} |",
            cell(p50_p99(read)),
            cell(p50_p99(write)),
        );
    }
}
