//! Range snapshots, on real `pgmr start` processes behind the simulated WAN: a replica that
//! joins a range, or falls behind its purged log, starts from a snapshot of the leaseholder's
//! rows — never from whatever its own PostgreSQL held — and then follows the log.

mod common;

use common::*;
use sqlx::postgres::PgConnection;
use sqlx::Row;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const WAN: &str =
    "intra 2\nus-east1 us-west1 63\nus-east1 europe-west1 87\nus-west1 europe-west1 132\n";
const EAST_B: &str = "region=us-east1,zone=us-east1-b";
const EAST_C: &str = "region=us-east1,zone=us-east1-c";
const EAST_D: &str = "region=us-east1,zone=us-east1-d";
const WEST_A: &str = "region=us-west1,zone=us-west1-a";
/// Snapshots every 10 entries, 10 kept: a lagging replica soon needs one.
const KNOBS: &[(&str, &str)] = &[("PGMR_RANGE_SNAPSHOT_EVERY", "10")];

async fn bank(node: &Node) -> PgConnection {
    eventually("database bank", Duration::from_secs(30), || {
        connect(node, "bank")
    })
    .await
}

/// Row count and a digest of every row of `accounts` on `node`.
async fn contents(node: &Node) -> Option<(i64, String)> {
    let mut c = connect(node, "bank").await?;
    let row = sqlx::query(
        "SELECT count(*), coalesce(md5(string_agg(t::text, '|' ORDER BY id)), '') FROM accounts t",
    )
    .fetch_one(&mut c)
    .await
    .ok()?;
    Some((row.get(0), row.get(1)))
}

/// Waits until `nodes` hold the same rows of `accounts`; returns them.
async fn converged(nodes: &[&Node]) -> (i64, String) {
    eventually(
        "every replica to hold the same rows",
        Duration::from_secs(90),
        || async {
            let mut seen = BTreeSet::new();
            for n in nodes {
                seen.insert(contents(n).await?);
            }
            (seen.len() == 1).then(|| seen.into_iter().next().unwrap())
        },
    )
    .await
}

/// Rows this node's PostgreSQL holds outside the data plane (written in replica mode, as
/// nothing but an applier does): what a stale copy of a table looks like.
async fn plant_stale_rows(node: &Node) {
    let mut c = bank(node).await;
    exec(
        &mut c,
        "SET session_replication_role = replica; \
         INSERT INTO accounts VALUES (-1, 666, 'stale'), (-2, 666, 'stale'); \
         SET session_replication_role = origin",
    )
    .await;
}

/// Updates random accounts through node 1 until told to stop; the number of commits.
async fn writer(node_port: u16, stop: Arc<AtomicBool>, commits: Arc<AtomicU64>) {
    let mut c = None::<PgConnection>;
    let mut i = 0u64;
    while !stop.load(Ordering::SeqCst) {
        if c.is_none() {
            c = sqlx::postgres::PgConnectOptions::new()
                .host("127.0.0.1")
                .port(node_port)
                .username("postgres")
                .database("bank")
                .connect_with_options()
                .await;
        }
        let Some(conn) = c.as_mut() else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        i += 1;
        let id = (i * 7919) % 200;
        match sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
            .bind(id as i32)
            .execute(&mut *conn)
            .await
        {
            Ok(_) => {
                commits.fetch_add(1, Ordering::SeqCst);
            }
            Err(_) => {
                c = None;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

trait ConnectWith {
    async fn connect_with_options(self) -> Option<PgConnection>;
}

impl ConnectWith for sqlx::postgres::PgConnectOptions {
    async fn connect_with_options(self) -> Option<PgConnection> {
        use sqlx::ConnectOptions;
        self.connect().await.ok()
    }
}

/// Snapshots a node installed, as its log says.
fn installed(node: &Node) -> usize {
    node.log()
        .lines()
        .filter(|l| l.contains("installed a range snapshot") && l.contains("installed=true"))
        .count()
}

/// How many replicas this node has stopped and forgotten.
fn forgot(node: &Node) -> usize {
    node.log()
        .lines()
        .filter(|l| l.contains("this node no longer holds a replica of the range"))
        .count()
}

/// Four nodes (three in us-east1, one in us-west1) with snapshots every 10 entries, replication
/// on, and database `bank` with primary region us-east1; a connection to it through node 1.
async fn east_bank(dir: &std::path::Path, block: u16) -> (Vec<Node>, PgConnection) {
    let nodes =
        start_cluster_with_env(dir, block, WAN, &[EAST_B, EAST_C, EAST_D, WEST_A], KNOBS).await;
    enable_replication(&nodes[0]).await;
    let mut c = nodes[0].sql().await;
    exec(&mut c, "CREATE DATABASE bank").await;
    let mut b = bank(&nodes[0]).await;
    execute_all(
        &mut b,
        &[r#"ALTER DATABASE bank PRIMARY REGION "us-east1""#],
    )
    .await;
    (nodes, b)
}

/// A range's voters (nodes 1–3, us-east1) start from the bootstrapper's snapshot; a replica
/// added later (node 4, when the database adds us-west1) and a voter that was down while the
/// log was purged past it (node 2) install a snapshot taken under concurrent writes, and their
/// stale rows are gone: every replica ends with the same rows and the consistency check passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_that_join_or_fall_behind_start_from_a_snapshot_of_the_ranges_rows() {
    let dir = scratch("snapshots");
    let (mut nodes, mut b) = east_bank(dir.path(), 48).await;
    exec(
        &mut b,
        "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL, note text)",
    )
    .await;
    // Node 4 holds a stale copy before it holds a replica.
    plant_stale_rows(&nodes[3]).await;
    // The range and its voters settle within seconds.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while let Err(e) = sqlx::raw_sql(
        "INSERT INTO accounts SELECT g, 100, 'row ' || g FROM generate_series(0, 199) g",
    )
    .execute(&mut b)
    .await
    {
        assert!(std::time::Instant::now() < deadline, "{e}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Dozens of entries: snapshots with rows, logs purged.
    for id in 0..40 {
        exec(
            &mut b,
            &format!("UPDATE accounts SET balance = balance + 1 WHERE id = {id}"),
        )
        .await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let commits = Arc::new(AtomicU64::new(0));
    let w = tokio::spawn(writer(nodes[0].pg_port, stop.clone(), commits.clone()));

    // A replica joins under load.
    execute_all(&mut b, &[r#"ALTER DATABASE bank ADD REGION "us-west1""#]).await;
    eventually(
        "node 4 installs a snapshot",
        Duration::from_secs(60),
        || async { (installed(&nodes[3]) > 0).then_some(()) },
    )
    .await;
    // It leaves, is forgotten (its log and rows dropped once it has been unlisted for
    // KEEP_UNLISTED), and joins again: a fresh replica, whatever its previous incarnation left
    // behind. (Added back sooner, it would find its log and catch up from it, or from a
    // snapshot only if the leader had purged past it: a race this test must not depend on.)
    let forgotten = forgot(&nodes[3]);
    execute_all(&mut b, &[r#"ALTER DATABASE bank DROP REGION "us-west1""#]).await;
    eventually(
        "node 4 forgets its replica",
        Duration::from_secs(60),
        || async { (forgot(&nodes[3]) > forgotten).then_some(()) },
    )
    .await;
    execute_all(&mut b, &[r#"ALTER DATABASE bank ADD REGION "us-west1""#]).await;
    eventually(
        "node 4 installs a snapshot again",
        Duration::from_secs(60),
        || async { (installed(&nodes[3]) > 1).then_some(()) },
    )
    .await;

    // A voter falls behind the purged log.
    nodes[1].crash();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = installed(&nodes[1]);
    nodes[1].restart();
    eventually(
        "node 2 installs a snapshot",
        Duration::from_secs(90),
        || async { (installed(&nodes[1]) > before).then_some(()) },
    )
    .await;

    // Seen in SQL: every replica has a snapshot and has purged its log up to one.
    eventually(
        "every replica's snapshot and purged log in multiregion.range_replicas",
        Duration::from_secs(30),
        || async {
            let mut c = bank(&nodes[0]).await;
            let replicas: Vec<(i64, i64, i64)> = sqlx::query_as(
                "SELECT node_id, snapshot_index, first_log_index FROM multiregion.range_replicas \
                 JOIN multiregion.ranges USING (range_id) WHERE table_name = 'accounts'",
            )
            .fetch_all(&mut c)
            .await
            .ok()?;
            (replicas.len() == 4 && replicas.iter().all(|(_, s, f)| *s > 0 && *f > 1)).then_some(())
        },
    )
    .await;

    stop.store(true, Ordering::SeqCst);
    w.await.unwrap();
    assert!(
        commits.load(Ordering::SeqCst) > 20,
        "the writer made progress"
    );
    let all: Vec<&Node> = nodes.iter().collect();
    let (count, _) = converged(&all).await;
    assert_eq!(count, 200, "no stale row survives and no row is missing");
    let out = pgmr_ok(&[
        "debug",
        "check-consistency",
        "--data-dir",
        nodes[0].data_dir.to_str().unwrap(),
    ]);
    assert!(!out.contains("DIFFERS"), "{out}");
}

/// How many rows of `trips` in `region` this node's own PostgreSQL holds (replica mode: read
/// here, not routed to the leaseholder).
async fn local_rows(node: &Node, region: &str) -> i64 {
    local_rows_in(node, "split", region).await
}

async fn local_rows_in(node: &Node, database: &str, region: &str) -> i64 {
    let mut c = connect(node, database).await.unwrap();
    exec(&mut c, "SET session_replication_role = replica").await;
    sqlx::query_scalar("SELECT count(*) FROM trips WHERE region::text = $1")
        .bind(region)
        .fetch_one(&mut c)
        .await
        .unwrap()
}

/// Three nodes (one in us-east1, two in us-west1), seeds in chunks of about 1 KB, replication
/// on, and database `db` with both regions under PLACEMENT RESTRICTED (each range's replicas
/// in its home region only); a connection to it through node 1.
async fn restricted_database(
    dir: &std::path::Path,
    block: u16,
    db: &str,
) -> (Vec<Node>, PgConnection) {
    let nodes = start_cluster_with_env(
        dir,
        block,
        WAN,
        &[EAST_B, WEST_A, "region=us-west1,zone=us-west1-b"],
        &[("PGMR_SEED_CHUNK_BYTES", "1000")],
    )
    .await;
    enable_replication(&nodes[0]).await;
    let mut c = nodes[0].sql().await;
    exec(&mut c, &format!("CREATE DATABASE {db}")).await;
    let mut s = eventually(&format!("database {db}"), Duration::from_secs(30), || {
        connect(&nodes[0], db)
    })
    .await;
    execute_all(
        &mut s,
        &[
            &format!(r#"ALTER DATABASE {db} PRIMARY REGION "us-east1""#),
            &format!(r#"ALTER DATABASE {db} ADD REGION "us-west1""#),
            &format!("ALTER DATABASE {db} PLACEMENT RESTRICTED"),
        ],
    )
    .await;
    (nodes, s)
}

/// Asserts that `count` (a `count(*)` query on `db`) answers `want` through every node, once
/// each node can answer it (routed to the leaseholders).
async fn count_through_every_node(nodes: &[Node], db: &str, count: &str, want: i64) {
    for (i, n) in nodes.iter().enumerate() {
        let got: i64 = eventually(
            "every row through every node",
            Duration::from_secs(30),
            || async {
                let mut c = connect(n, db).await?;
                sqlx::query_scalar(count).fetch_one(&mut c).await.ok()
            },
        )
        .await;
        assert_eq!(got, want, "node {}", i + 1);
    }
}

/// A table that was one range (REGIONAL BY TABLE, its replicas in us-east1 only under
/// PLACEMENT RESTRICTED) split into REGIONAL BY ROW partitions: the us-west1 partition's new
/// range lives on nodes that never held the table's rows, and starts from the old range's
/// rows as its leaseholder held them, fetched in chunks — every row stays reachable, on every
/// replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_split_into_partitions_starts_each_partition_from_the_old_ranges_rows() {
    let dir = scratch("snapshots-split");
    // Seeds travel in chunks of about 1 KB: the 50 rows of the us-west1 partition take several.
    let (nodes, mut s) = restricted_database(dir.path(), 49, "split").await;
    exec(
        &mut s,
        "CREATE TABLE trips (id int PRIMARY KEY, city text NOT NULL, \
         region crdb_internal_region NOT NULL GENERATED ALWAYS AS (CASE WHEN city = 'seattle' THEN 'us-west1' \
         ELSE 'us-east1' END) STORED)",
    )
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while let Err(e) = sqlx::raw_sql(
        "INSERT INTO trips SELECT g, CASE WHEN g % 2 = 0 THEN 'seattle' ELSE 'new york' END \
         FROM generate_series(1, 100) g",
    )
    .execute(&mut s)
    .await
    {
        assert!(std::time::Instant::now() < deadline, "{e}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The us-west1 nodes hold no replica of the table, so no row.
    assert_eq!(local_rows(&nodes[1], "us-west1").await, 0);
    assert_eq!(local_rows(&nodes[2], "us-west1").await, 0);

    execute_all(
        &mut s,
        &["ALTER TABLE trips SET LOCALITY REGIONAL BY ROW AS region"],
    )
    .await;
    for n in &nodes[1..] {
        eventually(
            "the us-west1 partition's rows on its replicas",
            Duration::from_secs(60),
            || async { (local_rows(n, "us-west1").await == 50).then_some(()) },
        )
        .await;
    }
    let chunks: Vec<u64> = nodes
        .iter()
        .flat_map(|n| {
            n.log()
                .lines()
                .filter(|l| {
                    l.contains("seeded the new range with its rows") && l.contains("rows=50")
                })
                .filter_map(|l| {
                    l.split("chunks=")
                        .nth(1)?
                        .split_whitespace()
                        .next()?
                        .parse()
                        .ok()
                })
                .collect::<Vec<u64>>()
        })
        .collect();
    assert!(
        chunks.iter().any(|c| *c > 1),
        "the us-west1 partition's seed came in several chunks: {chunks:?}"
    );
    // Through every node, every row (routed to each partition's leaseholder), and writes.
    count_through_every_node(
        &nodes,
        "split",
        "SELECT count(*) FROM trips WHERE region = 'us-west1'",
        50,
    )
    .await;
    for (i, n) in nodes.iter().enumerate() {
        let mut c = connect(n, "split").await.unwrap();
        exec(
            &mut c,
            &format!("INSERT INTO trips VALUES ({}, 'seattle')", 1000 + i),
        )
        .await;
    }
    for n in &nodes[1..] {
        eventually(
            "the new rows on every us-west1 replica",
            Duration::from_secs(30),
            || async { (local_rows(n, "us-west1").await == 53).then_some(()) },
        )
        .await;
    }
    let out = pgmr_ok(&[
        "debug",
        "check-consistency",
        "--data-dir",
        nodes[0].data_dir.to_str().unwrap(),
    ]);
    assert!(!out.contains("DIFFERS"), "{out}");
}

/// Row count and digest of `table` on `node`, read in its own PostgreSQL (replica mode).
async fn local_contents(node: &Node, table: &str) -> Option<(i64, String)> {
    let mut c = connect(node, "bank").await?;
    sqlx::raw_sql("SET session_replication_role = replica")
        .execute(&mut c)
        .await
        .ok()?;
    let row = sqlx::query(&format!(
        "SELECT count(*), coalesce(md5(string_agg(t::text, '|' ORDER BY id)), '') FROM {table} t"
    ))
    .fetch_one(&mut c)
    .await
    .ok()?;
    Some((row.get(0), row.get(1)))
}

/// Waits until `node` has died at `failpoint`.
async fn died_at(node: &Node, failpoint: &str) {
    let mark = format!("failpoint=\"{failpoint}\"");
    eventually(
        &format!("node to die at {failpoint}"),
        Duration::from_secs(60),
        || async { node.log().contains(&mark).then_some(()) },
    )
    .await;
}

/// A replica that dies while installing a snapshot — its rows committed in PostgreSQL but
/// not recorded in Raft's storage, or recorded as applied but not yet kept as its latest
/// snapshot (so that on restart openraft purges its log and a snapshot is rebuilt from the
/// rows) — starts again with every one of its replicas and ends with each range's rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_dies_while_installing_a_snapshot_starts_again_and_catches_up() {
    let dir = scratch("snapshots-crash");
    let (mut nodes, mut b) = east_bank(dir.path(), 50).await;
    for table in ["accounts", "notes"] {
        exec(
            &mut b,
            &format!(
                "CREATE TABLE {table} (id int PRIMARY KEY, balance bigint NOT NULL, note text)"
            ),
        )
        .await;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while let Err(e) = sqlx::raw_sql(&format!(
            "INSERT INTO {table} SELECT g, 100, 'row ' || g FROM generate_series(0, 99) g"
        ))
        .execute(&mut b)
        .await
        {
            assert!(std::time::Instant::now() < deadline, "{e}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let knobs_and = |failpoint: &'static str| {
        let mut env = KNOBS.to_vec();
        env.push(("PGMR_FAILPOINT", failpoint));
        env
    };
    // Node 4 (us-west1) gets a replica of each range when the database adds its region, and
    // dies installing the first snapshot; then, restarted, the next one.
    nodes[3].crash();
    nodes[3].restart_with_env(&knobs_and("snapshot-after-rows"));
    eventually("node 4 back", Duration::from_secs(60), || {
        try_connect(nodes[3].pg_port)
    })
    .await;
    execute_all(&mut b, &[r#"ALTER DATABASE bank ADD REGION "us-west1""#]).await;
    died_at(&nodes[3], "snapshot-after-rows").await;
    for id in 0..20 {
        exec(
            &mut b,
            &format!("UPDATE accounts SET balance = balance + 1 WHERE id = {id}; UPDATE notes SET note = 'changed' WHERE id = {id}"),
        )
        .await;
    }
    nodes[3].crash();
    nodes[3].restart_with_env(&knobs_and("snapshot-before-keep"));
    died_at(&nodes[3], "snapshot-before-keep").await;
    for id in 20..40 {
        exec(
            &mut b,
            &format!("UPDATE accounts SET balance = balance + 1 WHERE id = {id}; UPDATE notes SET note = 'changed' WHERE id = {id}"),
        )
        .await;
    }
    nodes[3].crash();
    nodes[3].restart_with_env(KNOBS);

    for table in ["accounts", "notes"] {
        let want = local_contents(&nodes[0], table).await.unwrap();
        eventually(
            &format!("node 4's replica of {table} to hold the range's rows"),
            Duration::from_secs(90),
            || async { (local_contents(&nodes[3], table).await? == want).then_some(()) },
        )
        .await;
    }
    let log = nodes[3].log();
    assert!(
        !log.contains("starting the range replica"),
        "every replica of node 4 started at once:\n{log}"
    );
    let out = pgmr_ok(&[
        "debug",
        "check-consistency",
        "--data-dir",
        nodes[0].data_dir.to_str().unwrap(),
    ]);
    assert!(!out.contains("DIFFERS"), "{out}");
}

/// How many rows of `trips` this node's own PostgreSQL holds (replica mode).
async fn local_count(node: &Node) -> i64 {
    let mut c = connect(node, "merge").await.unwrap();
    exec(&mut c, "SET session_replication_role = replica").await;
    sqlx::query_scalar("SELECT count(*) FROM trips")
        .fetch_one(&mut c)
        .await
        .unwrap()
}

/// A REGIONAL BY ROW table whose partitions live in their own regions only (PLACEMENT
/// RESTRICTED) made one range again (REGIONAL BY TABLE in the primary region): the new range's
/// replica (the us-east1 node, which never held the us-west1 rows) starts from every old
/// partition's rows as each partition's leaseholder held them, fetched in chunks — no row is
/// lost. The rows kept for the merge are dropped once the old ranges are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_merged_into_one_range_starts_from_every_partitions_rows() {
    let dir = scratch("snapshots-merge");
    let (nodes, mut m) = restricted_database(dir.path(), 51, "merge").await;
    execute_all(
        &mut m,
        &[
            "CREATE TABLE trips (id int PRIMARY KEY, city text NOT NULL, \
             region crdb_internal_region NOT NULL AS (CASE WHEN city = 'seattle' THEN 'us-west1' \
             ELSE 'us-east1' END) STORED) LOCALITY REGIONAL BY ROW AS region",
        ],
    )
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    for region in ["us-east1", "us-west1"] {
        let city = if region == "us-west1" {
            "seattle"
        } else {
            "new york"
        };
        let base = if region == "us-west1" { 0 } else { 1000 };
        while let Err(e) = sqlx::raw_sql(&format!(
            "INSERT INTO trips SELECT {base} + g, '{city}' FROM generate_series(1, 50) g"
        ))
        .execute(&mut m)
        .await
        {
            assert!(std::time::Instant::now() < deadline, "{e}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    // Each partition lives in its region only: the us-east1 node holds none of us-west1's rows.
    for n in &nodes[1..] {
        eventually(
            "the us-west1 rows on the us-west1 replicas",
            Duration::from_secs(30),
            || async { (local_rows_in(n, "merge", "us-west1").await == 50).then_some(()) },
        )
        .await;
    }
    assert_eq!(local_rows_in(&nodes[0], "merge", "us-west1").await, 0);

    execute_all(
        &mut m,
        &["ALTER TABLE trips SET LOCALITY REGIONAL BY TABLE IN PRIMARY REGION"],
    )
    .await;
    // The one range's only replica (us-east1, PLACEMENT RESTRICTED) has every row.
    eventually(
        "every row on the merged range's replica",
        Duration::from_secs(60),
        || async { (local_count(&nodes[0]).await == 100).then_some(()) },
    )
    .await;
    count_through_every_node(&nodes, "merge", "SELECT count(*) FROM trips", 100).await;
    let merged: Vec<String> = nodes[0]
        .log()
        .lines()
        .filter(|l| l.contains("seeded the new range with its rows") && l.contains("merge="))
        .map(str::to_string)
        .collect();
    assert!(
        merged
            .iter()
            .any(|l| l.contains("rows=100") && !l.contains("chunks=1 ")),
        "the merged range was seeded with every row, in chunks: {merged:?}"
    );
    let mut w = connect(&nodes[1], "merge").await.unwrap();
    exec(&mut w, "INSERT INTO trips VALUES (5000, 'seattle')").await;
    eventually(
        "the new row on the merged range's replica",
        Duration::from_secs(30),
        || async { (local_count(&nodes[0]).await == 101).then_some(()) },
    )
    .await;
    // The rows kept for the merge go once the old ranges are gone (swept every 30 s).
    for n in &nodes {
        eventually(
            "the rows kept for the merge dropped",
            Duration::from_secs(90),
            || async {
                let mut c = connect(n, "merge").await?;
                let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM multiregion.merge_seed")
                    .fetch_one(&mut c)
                    .await
                    .ok()?;
                (kept == 0).then_some(())
            },
        )
        .await;
    }
    let out = pgmr_ok(&[
        "debug",
        "check-consistency",
        "--data-dir",
        nodes[0].data_dir.to_str().unwrap(),
    ]);
    assert!(!out.contains("DIFFERS"), "{out}");
}
