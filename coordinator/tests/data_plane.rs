//! The data plane: rows replicated through per-range Raft groups, on real `pgmr start`
//! processes with their PostgreSQL behind the tutorial's simulated WAN, with the leaseholder's
//! node killed under load. Every test ends with every replica holding the same rows.

mod common;

use common::*;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions, Row};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const WAN: &str =
    "intra 2\nus-east1 us-west1 63\nus-east1 europe-west1 87\nus-west1 europe-west1 132\n";
const EAST_B: &str = "region=us-east1,zone=us-east1-b";
const WEST_A: &str = "region=us-west1,zone=us-west1-a";
const EU_B: &str = "region=europe-west1,zone=europe-west1-b";

/// Turns replication on, creates database `bank` with `accounts` on node 1, and waits until
/// the table's range has a leaseholder; returns its node id.
async fn bank(nodes: &[Node]) -> u64 {
    let mut c = nodes[0].sql().await;
    exec(
        &mut c,
        "SELECT multiregion.set_cluster_setting('multiregion.replication.enabled', 'true')",
    )
    .await;
    exec(&mut c, "CREATE DATABASE bank").await;
    let mut b = connect(&nodes[0], "bank").await.unwrap();
    exec(
        &mut b,
        "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL, note text)",
    )
    .await;
    leaseholder(nodes, None).await
}

/// The leaseholder of `accounts` as a live node (not `dead`) reports it, once it is one of the
/// live nodes.
async fn leaseholder(nodes: &[Node], dead: Option<u64>) -> u64 {
    eventually(
        "a leaseholder for accounts",
        Duration::from_secs(30),
        || async {
            for (i, n) in nodes.iter().enumerate() {
                if Some(i as u64 + 1) == dead {
                    continue;
                }
                let Some(mut c) = connect(n, "bank").await else {
                    continue;
                };
                let holder: Option<i64> = sqlx::query_scalar(
                    "SELECT lease_holder FROM multiregion.ranges \
                 WHERE database_name = 'bank' AND table_name = 'accounts'",
                )
                .fetch_optional(&mut c)
                .await
                .ok()
                .flatten()
                .flatten();
                if let Some(h) = holder {
                    if Some(h as u64) != dead {
                        return Some(h as u64);
                    }
                }
            }
            None
        },
    )
    .await
}

/// The next node after `i` of three, skipping `dead`.
fn next_live(i: usize, dead: Option<usize>) -> usize {
    let n = (i + 1) % 3;
    if Some(n) == dead {
        (n + 1) % 3
    } else {
        n
    }
}

/// What a node holds of `accounts`: row count and a digest of every row.
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

/// Waits until every node in `live` holds the same rows, and returns them.
async fn converged(nodes: &[Node], live: &[usize]) -> (i64, String) {
    eventually(
        "every replica to hold the same rows",
        Duration::from_secs(60),
        || async {
            let mut seen = BTreeSet::new();
            for i in live {
                seen.insert(contents(&nodes[*i]).await?);
            }
            (seen.len() == 1).then(|| seen.into_iter().next().unwrap())
        },
    )
    .await
}

/// Inserts, updates, deletes, upserts, savepoints and TRUNCATE on the leaseholder reach every
/// replica; a rolled-back transaction and a rolled-back savepoint reach none; a write through
/// another node reaches them too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_on_the_leaseholder_reach_every_replica_exactly_once() {
    let dir = scratch("data-rows");
    let nodes = start_cluster(dir.path(), 30, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let holder = bank(&nodes).await;
    let lh = &nodes[holder as usize - 1];
    let mut c = connect(lh, "bank").await.unwrap();
    exec(
        &mut c,
        "INSERT INTO accounts SELECT g, 100, 'n' || g FROM generate_series(1, 50) g",
    )
    .await;
    exec(
        &mut c,
        "UPDATE accounts SET balance = balance - 7 WHERE id % 5 = 0",
    )
    .await;
    exec(&mut c, "DELETE FROM accounts WHERE id > 45").await;
    exec(
        &mut c,
        "INSERT INTO accounts VALUES (1, 1, 'upserted'), (60, 60, NULL) \
         ON CONFLICT (id) DO UPDATE SET balance = excluded.balance, note = excluded.note",
    )
    .await;
    exec(
        &mut c,
        "BEGIN; UPDATE accounts SET balance = 0 WHERE id = 2; SAVEPOINT s; \
         DELETE FROM accounts; ROLLBACK TO s; UPDATE accounts SET note = 'kept' WHERE id = 3; COMMIT",
    )
    .await;
    exec(&mut c, "BEGIN; DELETE FROM accounts; ROLLBACK").await;
    let (count, digest) = converged(&nodes, &[0, 1, 2]).await;
    assert_eq!(count, 46);
    let local = contents(lh).await.unwrap();
    assert_eq!((count, digest.clone()), local);

    // Elsewhere: the write is forwarded to the leaseholder and reaches every replica.
    let other = nodes
        .iter()
        .enumerate()
        .find(|(i, _)| *i as u64 + 1 != holder)
        .unwrap()
        .1;
    let mut o = connect(other, "bank").await.unwrap();
    exec(
        &mut o,
        "UPDATE accounts SET note = 'via another node' WHERE id = 3",
    )
    .await;
    let (count, digest) = converged(&nodes, &[0, 1, 2]).await;
    assert_eq!(count, 46);
    assert_eq!(contents(lh).await.unwrap(), (count, digest.clone()));

    exec(&mut c, "TRUNCATE accounts").await;
    assert_eq!(converged(&nodes, &[0, 1, 2]).await.0, 0);
    exec(
        &mut c,
        "INSERT INTO accounts VALUES (7, 7, 'after truncate')",
    )
    .await;
    converged(&nodes, &[0, 1, 2]).await;
    let report = check_consistency(&nodes[0]);
    assert!(report.contains("replicas of 1 ranges agree"), "{report}");

    // A replica changed behind replication's back (triggers off) is found and named.
    let mut o = connect(other, "bank").await.unwrap();
    exec(
        &mut o,
        "SET session_replication_role = replica; UPDATE accounts SET balance = 0; \
         RESET session_replication_role",
    )
    .await;
    let out = std::process::Command::new(PGMR)
        .args(["debug", "check-consistency", "--data-dir"])
        .arg(&nodes[0].data_dir)
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a differing replica must fail the check"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("DIFFERS"), "{stdout}");
    assert!(stderr.contains("ranges 1"), "{stderr}");
}

/// Concurrent one-range commits on the leaseholder are proposed together when more are
/// waiting than the leader keeps in flight: fewer log entries than transactions, and every
/// replica applies every transaction of each shared entry exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_commits_share_log_entries_and_every_replica_applies_each_once() {
    const CLIENTS: i64 = 16;
    const EACH: i64 = 25;
    let dir = scratch("data-batches");
    let nodes = start_cluster(dir.path(), 73, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let holder = bank(&nodes).await;
    let lh = &nodes[holder as usize - 1];
    let mut c = connect(lh, "bank").await.unwrap();
    exec(
        &mut c,
        &format!("INSERT INTO accounts SELECT g, 0, NULL FROM generate_series(1, {CLIENTS}) g"),
    )
    .await;
    let cursor = "SELECT applied_index FROM multiregion.range_state \
                  WHERE range_id = (SELECT range_id FROM multiregion.ranges \
                                     WHERE database_name = 'bank' AND table_name = 'accounts')";
    converged(&nodes, &[0, 1, 2]).await;
    let before: i64 = sqlx::query_scalar(cursor).fetch_one(&mut c).await.unwrap();
    let port = lh.pg_port;
    let clients = (1..=CLIENTS).map(|id| async move {
        let mut c = try_connect_db(port, "bank").await;
        for _ in 0..EACH {
            sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
                .bind(id as i32)
                .execute(&mut c)
                .await
                .unwrap_or_else(|e| panic!("client {id}: {e}"));
        }
    });
    futures::future::join_all(clients).await;
    let (count, _) = converged(&nodes, &[0, 1, 2]).await;
    assert_eq!(count, CLIENTS);
    for n in &nodes {
        let mut r = connect(n, "bank").await.unwrap();
        let full: i64 = sqlx::query_scalar("SELECT count(*) FROM accounts WHERE balance = $1")
            .bind(EACH)
            .fetch_one(&mut r)
            .await
            .unwrap();
        assert_eq!(full, CLIENTS, "every increment once on port {}", n.pg_port);
    }
    let after: i64 = sqlx::query_scalar(cursor).fetch_one(&mut c).await.unwrap();
    let entries = after - before;
    assert!(
        entries < CLIENTS * EACH,
        "{} transactions took {entries} entries: none shared one",
        CLIENTS * EACH
    );
    let report = check_consistency(&nodes[0]);
    assert!(report.contains("replicas of 1 ranges agree"), "{report}");
}

/// `pgmr debug check-consistency` against `node`, which must pass; its output.
fn check_consistency(node: &Node) -> String {
    pgmr_ok(&[
        "debug",
        "check-consistency",
        "--data-dir",
        node.data_dir.to_str().unwrap(),
    ])
}

/// A read on any replica sees every write acknowledged before it began: each insert through
/// the leaseholder is read back at once through both followers, whose appliers lag the
/// leaseholder by at least half a WAN round trip without the read barrier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_on_followers_see_every_acknowledged_write() {
    let dir = scratch("data-reads");
    let nodes = start_cluster(dir.path(), 32, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let holder = bank(&nodes).await as usize - 1;
    let mut w = connect(&nodes[holder], "bank").await.unwrap();
    let mut followers = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        if i != holder {
            followers.push(connect(n, "bank").await.unwrap());
        }
    }
    for id in 1..=30i32 {
        sqlx::query("INSERT INTO accounts VALUES ($1, $1, NULL)")
            .bind(id)
            .execute(&mut w)
            .await
            .unwrap();
        for f in followers.iter_mut() {
            let seen: Option<i64> =
                sqlx::query_scalar("SELECT balance FROM accounts WHERE id = $1")
                    .bind(id)
                    .fetch_optional(&mut *f)
                    .await
                    .unwrap();
            assert_eq!(
                seen,
                Some(id as i64),
                "a follower missed acknowledged write {id}"
            );
        }
    }
    // Inside a READ COMMITTED transaction each statement sees what was acknowledged before it.
    let f = &mut followers[0];
    exec(f, "BEGIN").await;
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM accounts")
        .fetch_one(&mut *f)
        .await
        .unwrap();
    exec(&mut w, "INSERT INTO accounts VALUES (31, 31, NULL)").await;
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM accounts")
        .fetch_one(&mut *f)
        .await
        .unwrap();
    exec(f, "COMMIT").await;
    assert_eq!((before, after), (30, 31));
}

/// Writers insert through the leaseholder while its node (pgmr and PostgreSQL) is killed: the
/// lease moves to another voter within the test's bound, every acknowledged insert is on every
/// replica exactly once afterwards, and the restarted node catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leaseholder_loses_no_acknowledged_write() {
    let dir = scratch("data-failover");
    let mut nodes = start_cluster(dir.path(), 31, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let first = bank(&nodes).await;
    let mut acked: BTreeSet<i32> = BTreeSet::new();
    // A client as a driver with every node's address would be: on an error, it tries the next
    // node; "not the leaseholder" (0A000) sends it on too.
    let mut target = first as usize - 1;
    let mut conn: Option<PgConnection> = None;
    let mut crashed_at: Option<Instant> = None;
    let mut failover: Option<Duration> = None;
    let mut id = 0;
    while id < 120 {
        if id == 40 && crashed_at.is_none() {
            nodes[first as usize - 1].crash();
            crashed_at = Some(Instant::now());
            conn = None;
        }
        if conn.is_none() {
            conn = connect(&nodes[target], "bank").await;
            if conn.is_none() {
                target = next_live(target, crashed_at.map(|_| first as usize - 1));
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        }
        let c = conn.as_mut().unwrap();
        let r = sqlx::query("INSERT INTO accounts VALUES ($1, $1, 'w')")
            .bind(id + 1)
            .execute(&mut *c)
            .await;
        match r {
            Ok(_) => {
                acked.insert(id + 1);
                if let (Some(at), None) = (crashed_at, failover) {
                    failover = Some(at.elapsed());
                }
                id += 1;
            }
            // The earlier attempt of this id committed after all (its answer was lost).
            Err(e) if code(&e) == "23505" => {
                acked.insert(id + 1);
                id += 1;
            }
            Err(e) => {
                let c = code(&e);
                assert!(
                    ["40001", "40003", "0A000", "57P01", "08006", "XX000"].contains(&c.as_str())
                        || c.starts_with("client"),
                    "unexpected error during failover: {e}"
                );
                conn = None;
                target = next_live(target, crashed_at.map(|_| first as usize - 1));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    let holder = target as u64 + 1;
    let failover = failover.expect("writes resumed after the crash");
    assert!(
        failover < Duration::from_secs(10),
        "the lease took {failover:?} to move"
    );
    assert_ne!(holder, first, "a surviving voter holds the lease");
    let live: Vec<usize> = (0..3).filter(|i| *i as u64 + 1 != first).collect();
    let (count, _) = converged(&nodes, &live).await;
    assert_eq!(
        count as usize,
        acked.len(),
        "every acknowledged write, once"
    );

    // The killed node restarts and catches up from the log.
    nodes[first as usize - 1].restart();
    let (count, digest) = converged(&nodes, &[0, 1, 2]).await;
    assert_eq!(count as usize, acked.len());
    let mut c = connect(&nodes[0], "bank").await.unwrap();
    let ids: Vec<i32> = sqlx::query_scalar("SELECT id FROM accounts ORDER BY id")
        .fetch_all(&mut c)
        .await
        .unwrap();
    assert_eq!(ids.into_iter().collect::<BTreeSet<_>>(), acked, "{digest}");
    check_consistency(&nodes[1]);
    eprintln!("failover: writes resumed {failover:?} after the leaseholder was killed");
}

/// A leaseholder cut off from both other voters cannot commit: its writes fail (nothing is
/// acknowledged that a quorum does not hold), the majority elects a new leaseholder that takes
/// writes, and after the partition heals the old one steps down and catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_leaseholder_refuses_writes_and_converges_after_healing() {
    let dir = scratch("data-partition");
    let nodes = start_cluster(dir.path(), 33, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let old = bank(&nodes).await as usize - 1;
    let mut c = connect(&nodes[old], "bank").await.unwrap();
    exec(&mut c, "INSERT INTO accounts VALUES (1, 1, 'before')").await;
    converged(&nodes, &[0, 1, 2]).await;

    // Two-way partition between the leaseholder and everyone else.
    let dd = |i: usize| nodes[i].data_dir.to_str().unwrap().to_string();
    let others: Vec<usize> = (0..3).filter(|i| *i != old).collect();
    let peers = others
        .iter()
        .map(|i| (i + 1).to_string())
        .collect::<Vec<_>>()
        .join(",");
    pgmr_ok(&[
        "debug",
        "partition",
        "--data-dir",
        &dd(old),
        "--peers",
        &peers,
    ]);
    for i in &others {
        let me = (old + 1).to_string();
        pgmr_ok(&["debug", "partition", "--data-dir", &dd(*i), "--peers", &me]);
    }
    let err = sqlx::query("INSERT INTO accounts VALUES (2, 2, 'minority')")
        .execute(&mut c)
        .await
        .expect_err("a minority cannot commit");
    let code = code(&err);
    assert!(
        ["40001", "40003", "0A000"].contains(&code.as_str()),
        "{err}"
    );

    // The majority side takes writes under a new leaseholder.
    let new = eventually(
        "a write on the majority side",
        Duration::from_secs(30),
        || async {
            for i in &others {
                let mut m = connect(&nodes[*i], "bank").await?;
                if sqlx::query("INSERT INTO accounts VALUES (3, 3, 'majority')")
                    .execute(&mut m)
                    .await
                    .is_ok()
                {
                    return Some(*i);
                }
            }
            None
        },
    )
    .await;
    assert_ne!(new, old);

    for i in 0..3 {
        pgmr_ok(&["debug", "heal", "--data-dir", &dd(i)]);
    }
    let (count, _) = converged(&nodes, &[0, 1, 2]).await;
    let mut m = connect(&nodes[new], "bank").await.unwrap();
    let ids: Vec<i32> = sqlx::query_scalar("SELECT id FROM accounts ORDER BY id")
        .fetch_all(&mut m)
        .await
        .unwrap();
    // Row 2 is there only if the minority's entry was committed after all (the error said
    // so with 40003); row 3 always is.
    assert!(ids.contains(&1) && ids.contains(&3), "{ids:?}");
    assert!(code == "40003" || !ids.contains(&2), "{ids:?} after {code}");
    assert_eq!(count as usize, ids.len());
    check_consistency(&nodes[old]);
}

/// Statements through any node take effect at the leaseholder with PostgreSQL's semantics:
/// a primary key holds across nodes (sequentially and under a race), row locks conflict
/// across nodes, a transaction sees its own writes and rolls back or commits as a whole
/// (savepoints included), serializable transactions on different nodes that conflict get
/// 40001, and prepared statements with parameters return their rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_through_any_node_run_at_the_leaseholder_with_postgres_semantics() {
    let dir = scratch("data-routing");
    let nodes = start_cluster(dir.path(), 34, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let holder = bank(&nodes).await as usize - 1;
    let (na, nb) = ((holder + 1) % 3, (holder + 2) % 3);
    let mut a = connect(&nodes[na], "bank").await.unwrap();
    let mut b = connect(&nodes[nb], "bank").await.unwrap();

    // A write through a follower, read back through every node at once.
    exec(
        &mut a,
        "INSERT INTO accounts VALUES (1, 100, 'a'), (2, 100, 'a')",
    )
    .await;
    for n in &nodes {
        let mut c = connect(n, "bank").await.unwrap();
        let total: i64 = sqlx::query_scalar("SELECT sum(balance)::bigint FROM accounts")
            .fetch_one(&mut c)
            .await
            .unwrap();
        assert_eq!(
            total,
            200,
            "{} missed a forwarded write",
            n.data_dir.display()
        );
    }

    // The same key through another node: 23505, as on one PostgreSQL.
    let err = sqlx::query("INSERT INTO accounts VALUES (1, 5, 'b')")
        .execute(&mut b)
        .await
        .expect_err("the key exists");
    assert_eq!(code(&err), "23505", "{err}");

    // The same new key through two nodes at once: exactly one wins.
    for id in 10..15 {
        let ia = sqlx::query("INSERT INTO accounts VALUES ($1, 1, 'race a')")
            .bind(id)
            .execute(&mut a);
        let ib = sqlx::query("INSERT INTO accounts VALUES ($1, 1, 'race b')")
            .bind(id)
            .execute(&mut b);
        let (ra, rb) = tokio::join!(ia, ib);
        let codes: Vec<String> = [ra.err(), rb.err()].iter().flatten().map(code).collect();
        assert_eq!(codes, vec!["23505".to_string()], "key {id}");
    }

    // Row locks conflict across nodes.
    exec(&mut a, "BEGIN").await;
    let locked: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = 1 FOR UPDATE")
        .fetch_one(&mut a)
        .await
        .unwrap();
    assert_eq!(locked, 100);
    exec(&mut b, "SET lock_timeout = '1s'").await;
    let err = sqlx::query("UPDATE accounts SET balance = 0 WHERE id = 1")
        .execute(&mut b)
        .await
        .expect_err("the row is locked through another node");
    assert_eq!(code(&err), "55P03", "{err}");
    exec(
        &mut a,
        "UPDATE accounts SET balance = balance - 10 WHERE id = 1",
    )
    .await;
    let own: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = 1")
        .fetch_one(&mut a)
        .await
        .unwrap();
    assert_eq!(own, 90, "a transaction reads its own forwarded write");
    exec(&mut a, "COMMIT").await;
    exec(
        &mut b,
        "UPDATE accounts SET balance = balance + 10 WHERE id = 2",
    )
    .await;

    // Savepoints and rollbacks, mirrored on the leaseholder.
    exec(
        &mut a,
        "BEGIN; INSERT INTO accounts VALUES (3, 3, 'kept'); SAVEPOINT s; \
         UPDATE accounts SET balance = 0; ROLLBACK TO SAVEPOINT s; \
         INSERT INTO accounts VALUES (4, 4, 'kept'); COMMIT",
    )
    .await;
    exec(&mut a, "BEGIN; DELETE FROM accounts; ROLLBACK").await;
    exec(&mut a, "BEGIN").await;
    exec(&mut a, "SAVEPOINT s").await;
    let err = sqlx::query("INSERT INTO accounts VALUES (1, 0, 'dup')")
        .execute(&mut a)
        .await
        .expect_err("duplicate inside a savepoint");
    assert_eq!(code(&err), "23505");
    exec(&mut a, "ROLLBACK TO SAVEPOINT s").await;
    exec(
        &mut a,
        "INSERT INTO accounts VALUES (5, 5, 'after savepoint')",
    )
    .await;
    exec(&mut a, "COMMIT").await;

    // Write skew between serializable transactions on two nodes: one gets 40001.
    let skew = "SELECT sum(balance)::bigint FROM accounts WHERE id IN (1, 2)";
    exec(&mut a, "BEGIN ISOLATION LEVEL SERIALIZABLE").await;
    exec(&mut b, "BEGIN ISOLATION LEVEL SERIALIZABLE").await;
    let sa: i64 = sqlx::query_scalar(skew).fetch_one(&mut a).await.unwrap();
    let sb: i64 = sqlx::query_scalar(skew).fetch_one(&mut b).await.unwrap();
    assert_eq!((sa, sb), (200, 200));
    let ua = sqlx::raw_sql("UPDATE accounts SET balance = balance - 200 WHERE id = 1; COMMIT")
        .execute(&mut a)
        .await;
    let ub = sqlx::raw_sql("UPDATE accounts SET balance = balance - 200 WHERE id = 2; COMMIT")
        .execute(&mut b)
        .await;
    let failures: Vec<String> = [ua.err(), ub.err()].iter().flatten().map(code).collect();
    assert_eq!(
        failures,
        vec!["40001".to_string()],
        "exactly one of a write skew commits"
    );
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut b).await;
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut a).await;

    // Extended protocol: parameters in, rows out, typed.
    let row = sqlx::query("INSERT INTO accounts VALUES ($1, $2, $3) RETURNING id, balance, note")
        .bind(6i32)
        .bind(600i64)
        .bind("it's \"quoted\"")
        .fetch_one(&mut b)
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<i32, _>(0),
            row.get::<i64, _>(1),
            row.get::<String, _>(2)
        ),
        (6, 600, "it's \"quoted\"".to_string())
    );

    // A data-modifying CTE runs at the leaseholder only (not on this node's copy as well).
    let deleted: i64 = sqlx::query_scalar(
        "WITH d AS (DELETE FROM accounts WHERE id = 5 RETURNING id) SELECT count(*) FROM d",
    )
    .fetch_one(&mut b)
    .await
    .unwrap();
    assert_eq!(deleted, 1);

    // A holdable cursor over forwarded rows keeps every row across its transaction's commit.
    exec(&mut a, "BEGIN ISOLATION LEVEL REPEATABLE READ").await;
    exec(
        &mut a,
        "DECLARE c CURSOR WITH HOLD FOR SELECT id FROM accounts ORDER BY id",
    )
    .await;
    let mut ids: Vec<i32> = sqlx::query_scalar("FETCH 3 FROM c")
        .fetch_all(&mut a)
        .await
        .unwrap();
    exec(&mut a, "COMMIT").await;
    ids.extend(
        sqlx::query_scalar::<_, i32>("FETCH ALL FROM c")
            .fetch_all(&mut a)
            .await
            .unwrap(),
    );
    exec(&mut a, "CLOSE c").await;
    assert_eq!(ids, vec![1, 2, 3, 4, 6, 10, 11, 12, 13, 14]);

    let (count, _) = converged(&nodes, &[0, 1, 2]).await;
    assert_eq!(count, 5 + 4 + 1, "keys 1-6 but 5, and the five raced keys");
    let report = check_consistency(&nodes[0]);
    assert!(report.contains("replicas of 1 ranges agree"), "{report}");
}

/// A compare-and-set register: the sequential specification a history is checked against.
#[derive(Clone, Debug, PartialEq)]
struct CasRegister(i64);

#[derive(Clone, Debug, PartialEq)]
enum RegOp {
    Read,
    Write(i64),
    Cas(i64, i64),
}

#[derive(Clone, Debug, PartialEq)]
enum RegRet {
    Read(i64),
    Written,
    Swapped(bool),
}

impl consistency_model::SequentialSpec for CasRegister {
    type Op = RegOp;
    type Ret = RegRet;
    fn invoke(&mut self, op: &RegOp) -> RegRet {
        match *op {
            RegOp::Read => RegRet::Read(self.0),
            RegOp::Write(v) => {
                self.0 = v;
                RegRet::Written
            }
            RegOp::Cas(old, new) => {
                let ok = self.0 == old;
                if ok {
                    self.0 = new;
                }
                RegRet::Swapped(ok)
            }
        }
    }
}

/// What one client saw: each operation's invocation, and its return if it had a definite
/// outcome (an ambiguous failure stays invoked forever; a definite failure is dropped).
enum Event {
    Invoke(u64, RegOp),
    Return(u64, RegRet),
}

/// A connection to `ports[*target]` as a client with every node's address makes one: on
/// failure it moves on to the next node (after a short pause) and returns `None`.
async fn connect_or_move_on(ports: &[u16], target: &mut usize) -> Option<PgConnection> {
    let c = PgConnectOptions::new()
        .host("127.0.0.1")
        .port(ports[*target])
        .username("postgres")
        .database("bank")
        .connect()
        .await
        .ok();
    if c.is_none() {
        *target = (*target + 1) % ports.len();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c
}

/// The fault of the register and bank tests: 6 s into the clients' run, `node` (the
/// leaseholder's) is killed with SIGKILL, and 8 s later started again on its data.
async fn crash_and_restart_under_load(node: &mut Node) {
    tokio::time::sleep(Duration::from_secs(6)).await;
    node.crash();
    tokio::time::sleep(Duration::from_secs(8)).await;
    node.restart();
}

/// The next value of a xorshift generator: the clients' choices, reproducible per seed.
fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// One client of the register: reads, writes and compare-and-sets through `ports[start]`,
/// moving to the next node when its node fails, until `until`. Each write and swap installs a
/// value no other operation installs, so the checker's search stays narrow.
async fn register_client(
    client: u64,
    ports: Vec<u16>,
    start: usize,
    until: Instant,
    history: std::sync::Arc<std::sync::Mutex<Vec<(Instant, Event)>>>,
) -> (u64, u64) {
    let mut thread = client * 1_000;
    let mut seed = client * 7919 + 17;
    let mut next_value = (client as i64) * 1_000_000;
    let mut last_read = 0i64;
    let mut target = start;
    let mut conn: Option<PgConnection> = None;
    let (mut ok, mut ambiguous) = (0u64, 0u64);
    let record = |e: Event| history.lock().unwrap().push((Instant::now(), e));
    while Instant::now() < until {
        if conn.is_none() {
            conn = connect_or_move_on(&ports, &mut target).await;
            if conn.is_none() {
                continue;
            }
        }
        let c = conn.as_mut().unwrap();
        seed = xorshift(seed);
        next_value += 1;
        let op = match seed % 3 {
            0 => RegOp::Read,
            1 => RegOp::Write(next_value),
            _ => RegOp::Cas(last_read, next_value),
        };
        record(Event::Invoke(thread, op.clone()));
        let result: Result<RegRet, sqlx::Error> = match op {
            RegOp::Read => sqlx::query_scalar("SELECT v FROM register WHERE k = 1")
                .fetch_one(&mut *c)
                .await
                .map(RegRet::Read),
            RegOp::Write(v) => sqlx::query("UPDATE register SET v = $1 WHERE k = 1")
                .bind(v)
                .execute(&mut *c)
                .await
                .map(|_| RegRet::Written),
            RegOp::Cas(old, new) => {
                sqlx::query("UPDATE register SET v = $2 WHERE k = 1 AND v = $1")
                    .bind(old)
                    .bind(new)
                    .execute(&mut *c)
                    .await
                    .map(|r| RegRet::Swapped(r.rows_affected() == 1))
            }
        };
        match result {
            Ok(ret) => {
                if let RegRet::Read(v) = ret {
                    last_read = v;
                }
                record(Event::Return(thread, ret));
                ok += 1;
            }
            Err(e) => {
                let code = code(&e);
                let definite = matches!(op, RegOp::Read)
                    || ["40001", "0A000", "55000", "57P03"].contains(&code.as_str());
                if definite {
                    // Nothing happened: forget the invocation.
                    let mut h = history.lock().unwrap();
                    let at = h
                        .iter()
                        .rposition(|(_, e)| matches!(e, Event::Invoke(t, _) if *t == thread))
                        .expect("the invocation was recorded");
                    h.remove(at);
                } else {
                    // It may or may not have happened: it stays pending; the client goes on
                    // as a new thread.
                    ambiguous += 1;
                    thread += 1;
                }
                conn = None;
                target = (target + 1) % ports.len();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    (ok, ambiguous)
}

/// A single register read, written and compare-and-set through all three nodes while the
/// leaseholder's node is killed and restarted: the recorded history (operations that failed
/// ambiguously left pending) is linearizable by a real checker (`consistency_model`'s
/// `LinearizabilityTester`), and every replica ends with the same rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_register_used_through_every_node_under_a_leaseholder_kill_is_linearizable() {
    use consistency_model::{ConsistencyTester, LinearizabilityTester};
    let dir = scratch("data-linearizable");
    let mut nodes = start_cluster(dir.path(), 35, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let first = bank(&nodes).await as usize - 1;
    let mut c = connect(&nodes[0], "bank").await.unwrap();
    exec(
        &mut c,
        "CREATE TABLE register (k int PRIMARY KEY, v bigint NOT NULL); \
         INSERT INTO register VALUES (1, 0)",
    )
    .await;
    converged(&nodes, &[0, 1, 2]).await;
    let ports: Vec<u16> = nodes.iter().map(|n| n.pg_port).collect();
    let history = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let until = Instant::now() + Duration::from_secs(24);
    let clients: Vec<_> = (0..3u64)
        .map(|i| {
            tokio::spawn(register_client(
                i + 1,
                ports.clone(),
                i as usize,
                until,
                history.clone(),
            ))
        })
        .collect();
    crash_and_restart_under_load(&mut nodes[first]).await;
    let mut totals = (0, 0);
    for c in clients {
        let (ok, amb) = c.await.unwrap();
        totals = (totals.0 + ok, totals.1 + amb);
    }
    let mut events = std::mem::take(&mut *history.lock().unwrap());
    events.sort_by_key(|(at, _)| *at);
    let mut tester = LinearizabilityTester::new(CasRegister(0));
    for (_, e) in &events {
        match e {
            Event::Invoke(t, op) => tester.on_invoke(*t, op.clone()).map(|_| ()),
            Event::Return(t, ret) => tester.on_return(*t, ret.clone()).map(|_| ()),
        }
        .expect("a well-formed history");
    }
    eprintln!(
        "linearizability: {} operations with a definite outcome, {} ambiguous",
        totals.0, totals.1
    );
    assert!(totals.0 > 100, "the clients made progress: {totals:?}");
    // The checker's search finds a linearization of a correct history at once (every value is
    // written once); proving that none exists is exhaustive, so a search that runs long is a
    // failure too (a history with stale reads takes minutes).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(tester.is_consistent());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(consistent) => assert!(consistent, "the register's history is not linearizable"),
        Err(_) => panic!(
            "the checker found no linearization of the register's history within 60 s; {} events:\n{}",
            events.len(),
            events
                .iter()
                .map(|(_, e)| match e {
                    Event::Invoke(t, op) => format!("{t} invoke {op:?}"),
                    Event::Return(t, r) => format!("{t} return {r:?}"),
                })
                .collect::<Vec<_>>()
                .join("\n")
        ),
    }
    converged(&nodes, &[0, 1, 2]).await;
    check_consistency(&nodes[0]);
}

/// The leaseholder's pgmr paused (SIGSTOP) while a client writes through another node: the
/// lease moves to another voter and the writes resume there (a forwarded statement does not
/// wait on a node that stopped heartbeating); nothing acknowledged is lost, and once resumed
/// the old leaseholder steps down and catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leaseholder_loses_its_lease_and_catches_up_when_resumed() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let dir = scratch("data-sigstop");
    let nodes = start_cluster(dir.path(), 36, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let first = bank(&nodes).await as usize - 1;
    let via = (first + 1) % 3;
    let mut c = connect(&nodes[via], "bank").await.unwrap();
    let mut acked = BTreeSet::new();
    let mut paused_at = None;
    let mut resumed_after = None;
    let pid = Pid::from_raw(nodes[first].child.id() as i32);
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut id = 0i32;
    while acked.len() < 60 {
        assert!(
            Instant::now() < deadline,
            "writes did not resume: {acked:?}"
        );
        if id == 20 && paused_at.is_none() {
            stop_process(pid).await;
            paused_at = Some(Instant::now());
        }
        let r = sqlx::query("INSERT INTO accounts VALUES ($1, $1, 'w')")
            .bind(id + 1)
            .execute(&mut c)
            .await;
        match r {
            Ok(_) => {
                acked.insert(id + 1);
                if let (Some(at), None) = (paused_at, resumed_after) {
                    resumed_after = Some(at.elapsed());
                }
                id += 1;
            }
            // An earlier attempt of this id committed after all.
            Err(e) if code(&e) == "23505" => {
                acked.insert(id + 1);
                id += 1;
            }
            Err(e) => {
                let c = code(&e);
                assert!(
                    ["40001", "40003", "0A000"].contains(&c.as_str()),
                    "unexpected error while the leaseholder is paused: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    kill(pid, Signal::SIGCONT).unwrap();
    let resumed_after = resumed_after.expect("writes resumed while the leaseholder was paused");
    assert!(
        resumed_after < Duration::from_secs(20),
        "writes took {resumed_after:?} to resume"
    );
    let (count, _) = converged(&nodes, &[0, 1, 2]).await;
    assert_eq!(
        count as usize,
        acked.len(),
        "every acknowledged write, once"
    );
    let holder = leaseholder(&nodes, None).await;
    eprintln!(
        "sigstop: writes resumed {resumed_after:?} after pausing node {}; lease now on node {holder}",
        first + 1
    );
    check_consistency(&nodes[0]);
}

/// One bank client: transfers between random accounts in explicit transactions through
/// `ports[start]` (moving on when its node fails) until `until`. Returns the transfers
/// acknowledged and those whose outcome is unknown.
async fn bank_client(
    client: u64,
    ports: Vec<u16>,
    start: usize,
    until: Instant,
) -> (Vec<i64>, Vec<i64>) {
    let mut seed = client * 104_729 + 3;
    let mut target = start;
    let mut conn: Option<PgConnection> = None;
    let (mut acked, mut unknown) = (Vec::new(), Vec::new());
    let mut tid = client as i64 * 1_000_000;
    while Instant::now() < until {
        if conn.is_none() {
            conn = connect_or_move_on(&ports, &mut target).await;
            if conn.is_none() {
                continue;
            }
        }
        let c = conn.as_mut().unwrap();
        seed = xorshift(seed);
        let from = (seed % 10) as i32 + 1;
        let to = ((seed / 10) % 9) as i32 + 1;
        let to = if to >= from { to + 1 } else { to };
        let amount = ((seed / 100) % 50) as i64 + 1;
        tid += 1;
        let debit = "UPDATE accounts SET balance = balance - $1, note = note || ' ' || $2::text \
                     WHERE id = $3";
        let credit = "UPDATE accounts SET balance = balance + $1, note = note || ' ' || $2::text \
                      WHERE id = $3";
        // Err(true): the COMMIT failed, so the outcome is unknown.
        let mut result: Result<(), (bool, sqlx::Error)> = Ok(());
        if let Err(e) = sqlx::query("BEGIN").execute(&mut *c).await {
            result = Err((false, e));
        }
        for (sql, id) in [(debit, from), (credit, to)] {
            if result.is_ok() {
                let r = sqlx::query(sql)
                    .bind(amount)
                    .bind(tid.to_string())
                    .bind(id)
                    .execute(&mut *c)
                    .await;
                if let Err(e) = r {
                    result = Err((false, e));
                }
            }
        }
        if result.is_ok() {
            if let Err(e) = sqlx::query("COMMIT").execute(&mut *c).await {
                result = Err((true, e));
            }
        }
        match result {
            Ok(()) => acked.push(tid),
            Err((at_commit, e)) => {
                // A statement error before COMMIT leaves nothing; a failed COMMIT (or a
                // connection lost during it) may have committed, unless it says it did not.
                let code = code(&e);
                if at_commit && !["40001", "0A000", "55000"].contains(&code.as_str()) {
                    unknown.push(tid);
                }
                let _ = sqlx::query("ROLLBACK").execute(&mut *c).await;
                conn = None;
                target = (target + 1) % ports.len();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    (acked, unknown)
}

/// The bank test, on one range (a REGIONAL BY TABLE table: transfers over several
/// leaseholders need two-phase commit, not built yet): transfers in explicit transactions
/// through every node while the leaseholder's node is killed and restarted. The total never
/// changes; every acknowledged transfer is on both of its accounts exactly once; one whose
/// outcome is unknown is on both or on neither; no replica differs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bank_transfers_through_every_node_survive_a_leaseholder_kill() {
    let dir = scratch("data-bank");
    let mut nodes = start_cluster(dir.path(), 37, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let first = bank(&nodes).await as usize - 1;
    let mut c = connect(&nodes[first], "bank").await.unwrap();
    exec(
        &mut c,
        "INSERT INTO accounts SELECT g, 1000, '' FROM generate_series(1, 10) g",
    )
    .await;
    converged(&nodes, &[0, 1, 2]).await;
    let ports: Vec<u16> = nodes.iter().map(|n| n.pg_port).collect();
    let until = Instant::now() + Duration::from_secs(24);
    let clients: Vec<_> = (0..3u64)
        .map(|i| tokio::spawn(bank_client(i + 1, ports.clone(), i as usize, until)))
        .collect();
    crash_and_restart_under_load(&mut nodes[first]).await;
    let (mut acked, mut unknown) = (Vec::new(), Vec::new());
    for c in clients {
        let (a, u) = c.await.unwrap();
        acked.extend(a);
        unknown.extend(u);
    }
    converged(&nodes, &[0, 1, 2]).await;
    let mut c = connect(&nodes[0], "bank").await.unwrap();
    let total: i64 = sqlx::query_scalar("SELECT sum(balance)::bigint FROM accounts")
        .fetch_one(&mut c)
        .await
        .unwrap();
    let notes: Vec<String> = sqlx::query_scalar("SELECT note FROM accounts")
        .fetch_all(&mut c)
        .await
        .unwrap();
    let mut seen: std::collections::BTreeMap<i64, usize> = Default::default();
    for n in &notes {
        for t in n.split_whitespace() {
            *seen.entry(t.parse().unwrap()).or_default() += 1;
        }
    }
    // Which transfers are on one account only, and what the clients knew of them.
    let halves: Vec<String> = seen
        .iter()
        .filter(|(_, &n)| n != 2)
        .map(|(t, n)| {
            let known = if acked.contains(t) {
                "acknowledged"
            } else if unknown.contains(t) {
                "unknown"
            } else {
                "refused"
            };
            format!("{t} on {n} account(s), {known}")
        })
        .collect();
    assert_eq!(
        total, 10_000,
        "the bank's total changed; transfers not on exactly two accounts: {halves:?}"
    );
    for t in &acked {
        assert_eq!(seen.get(t), Some(&2), "acknowledged transfer {t}");
    }
    for t in &unknown {
        assert!(
            matches!(seen.get(t), None | Some(&2)),
            "transfer {t} of unknown outcome applied partly"
        );
    }
    let known: BTreeSet<i64> = acked.iter().chain(&unknown).copied().collect();
    assert!(
        seen.keys().all(|t| known.contains(t)),
        "a refused transfer was applied"
    );
    assert!(acked.len() > 30, "transfers made progress: {}", acked.len());
    eprintln!(
        "bank: {} transfers acknowledged, {} of unknown outcome ({} of those applied)",
        acked.len(),
        unknown.len(),
        unknown.iter().filter(|t| seen.contains_key(t)).count()
    );
    check_consistency(&nodes[1]);
}

/// Inserts rows `from..to` through `port` one transaction each, each retried while it is
/// refused as retryable (40001), until all are in; how many refusals it met.
async fn insert_retrying(port: u16, from: i32, to: i32) -> u32 {
    let mut c = try_connect_db(port, "bank").await;
    let mut refused = 0;
    for id in from..to {
        loop {
            let r = sqlx::query("INSERT INTO accounts (id, balance, note) VALUES ($1, 100, 'w')")
                .bind(id)
                .execute(&mut c)
                .await;
            match r {
                Ok(_) => break,
                Err(e) if code(&e) == "40001" => refused += 1,
                Err(e) => panic!("insert {id}: {e}"),
            }
        }
    }
    refused
}

/// A schema change that reshapes a table reaches every replica after every row written
/// before it and before every row written after it (docs/ARCHITECTURE.md §8.6). Both
/// followers' appliers are held back by a lock on their copy of the table while the
/// leaseholder commits rows; one of them then adds a NOT NULL column with a default, while
/// the leaseholder keeps writing. Without the fence each follower applies the change between
/// two held-back entries, and the entries after it, written without the column, stall its
/// applier on the NOT NULL column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_change_reaches_every_replica_in_order_with_the_rows_around_it() {
    let dir = scratch("data-ddl-order");
    let nodes = start_cluster(dir.path(), 52, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let lh = bank(&nodes).await as usize - 1;
    let (origin, other) = ((lh + 1) % 3, (lh + 2) % 3);
    let mut w = connect(&nodes[lh], "bank").await.unwrap();
    exec(&mut w, "INSERT INTO accounts VALUES (0, 100, 'first')").await;
    converged(&nodes, &[0, 1, 2]).await;
    let mut holds = Vec::new();
    for i in [origin, other] {
        let mut h = connect(&nodes[i], "bank").await.unwrap();
        exec(&mut h, "BEGIN").await;
        exec(&mut h, "LOCK TABLE accounts IN SHARE MODE").await;
        holds.push(h);
    }
    // Committed through the Raft quorum, applied by neither follower yet.
    assert_eq!(insert_retrying(nodes[lh].pg_port, 1, 21).await, 0);
    let writer = tokio::spawn(insert_retrying(nodes[lh].pg_port, 100, 160));
    let mut d = connect(&nodes[origin], "bank").await.unwrap();
    let ddl = tokio::spawn(async move {
        sqlx::query("ALTER TABLE accounts ADD COLUMN c int NOT NULL DEFAULT 7")
            .execute(&mut d)
            .await
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for mut h in holds {
        exec(&mut h, "COMMIT").await;
    }
    ddl.await.unwrap().expect("the schema change commits");
    let refused = writer.await.unwrap();
    let (count, _) = converged(&nodes, &[0, 1, 2]).await;
    assert_eq!(count, 81, "every row on every replica");
    for (i, n) in nodes.iter().enumerate() {
        let mut c = connect(n, "bank").await.unwrap();
        let sevens: i64 = sqlx::query_scalar("SELECT count(*) FROM accounts WHERE c = 7")
            .fetch_one(&mut c)
            .await
            .unwrap();
        assert_eq!(
            sevens,
            81,
            "node {}: every row has the new column's default",
            i + 1
        );
    }
    eprintln!("ddl order: the leaseholder's writer was refused {refused} times during the change");
    check_consistency(&nodes[origin]);
    // Rows this transaction wrote at the leaseholder before the change would follow it
    // there: refused before anything changes.
    let mut t = connect(&nodes[origin], "bank").await.unwrap();
    exec(&mut t, "BEGIN").await;
    exec(
        &mut t,
        "INSERT INTO accounts VALUES (500, 1, 'forwarded', 7)",
    )
    .await;
    let (code, message) = fails_within(&mut t, "ALTER TABLE accounts ADD COLUMN d int").await;
    assert_eq!(code, "0A000", "{message}");
    exec(&mut t, "ROLLBACK").await;
    for (i, n) in nodes.iter().enumerate() {
        let mut c = connect(n, "bank").await.unwrap();
        let d: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = 'accounts'::regclass AND attname = 'd'",
        )
        .fetch_one(&mut c)
        .await
        .unwrap();
        assert_eq!(d, 0, "node {}: the refused change is nowhere", i + 1);
    }
}

/// A transaction too large for one Raft entry (about 16 MB of rows: openraft 0.9 must send
/// each AppendEntries within a heartbeat interval, so pgmr splits it into 512 KiB entries)
/// commits on the leaseholder and reaches both followers whole: a reader on a follower,
/// polling while it is replicated, sees none of its rows or all of them, never a part.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_larger_than_a_raft_entry_reaches_every_replica_whole() {
    let dir = scratch("data-big-txn");
    let nodes = start_cluster(dir.path(), 53, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let lh = bank(&nodes).await as usize - 1;
    let follower = (lh + 1) % 3;
    let mut r = connect(&nodes[follower], "bank").await.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut seen = BTreeSet::new();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                // 40001: the follower had not applied what the leader had committed in time.
                match sqlx::query_scalar::<_, i64>("SELECT count(*) FROM accounts")
                    .fetch_one(&mut r)
                    .await
                {
                    Ok(n) => {
                        seen.insert(n);
                    }
                    Err(e) if code(&e) == "40001" => {}
                    Err(e) => panic!("reading on the follower: {e}"),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            seen
        })
    };
    let mut w = connect(&nodes[lh], "bank").await.unwrap();
    let started = Instant::now();
    exec(
        &mut w,
        "INSERT INTO accounts SELECT g, 100, repeat('x', 200) FROM generate_series(1, 60000) g",
    )
    .await;
    let took = started.elapsed();
    let (count, _) = converged(&nodes, &[0, 1, 2]).await;
    let everywhere = started.elapsed();
    assert_eq!(count, 60000);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = reader.await.unwrap();
    assert!(
        seen.iter().all(|n| *n == 0 || *n == 60000),
        "a follower showed part of the transaction: {seen:?}"
    );
    eprintln!(
        "big transaction: 60000 rows committed in {took:?}, on every replica after {everywhere:?}; follower counts seen {seen:?}"
    );
    check_consistency(&nodes[follower]);
}

const REGIONS: [&str; 3] = ["us-east1", "us-west1", "europe-west1"];

/// Turns replication on and creates database `mr` with regions us-east1 (primary), us-west1
/// and europe-west1 and a REGIONAL BY ROW `accounts (id, balance, note)`: a connection to it
/// through the first node.
async fn regional_accounts(nodes: &[Node]) -> PgConnection {
    let mut m = three_region_db(nodes).await;
    execute_all(
        &mut m,
        &["CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL, note text NOT NULL DEFAULT '') LOCALITY REGIONAL BY ROW"],
    )
    .await;
    m
}

/// Turns replication on and creates database `mr` with regions us-east1 (primary), us-west1
/// and europe-west1: a connection to it through the first node.
async fn three_region_db(nodes: &[Node]) -> PgConnection {
    let mut c = nodes[0].sql().await;
    exec(
        &mut c,
        "SELECT multiregion.set_cluster_setting('multiregion.replication.enabled', 'true')",
    )
    .await;
    exec(&mut c, "CREATE DATABASE mr").await;
    let mut m = eventually("database mr on node 1", Duration::from_secs(30), || {
        connect(&nodes[0], "mr")
    })
    .await;
    execute_all(
        &mut m,
        &[
            r#"ALTER DATABASE mr PRIMARY REGION "us-east1""#,
            r#"ALTER DATABASE mr ADD REGION "us-west1""#,
            r#"ALTER DATABASE mr ADD REGION "europe-west1""#,
        ],
    )
    .await;
    m
}

/// [`regional_accounts`] (one partition, so one range and one leaseholder, per region: node
/// N in region N) holding `per_region` accounts of 1000 per region, inserted through their
/// region's node, and a REGIONAL BY TABLE `audit` (leased in us-east1) with a deferred
/// unique constraint.
async fn regional_bank(nodes: &[Node], per_region: i32) {
    let mut m = regional_accounts(nodes).await;
    exec(
        &mut m,
        "CREATE TABLE audit (id int PRIMARY KEY, note text UNIQUE DEFERRABLE INITIALLY DEFERRED)",
    )
    .await;
    for (i, n) in nodes.iter().enumerate() {
        let mut c = eventually("database mr", Duration::from_secs(30), || connect(n, "mr")).await;
        let first = i as i32 * per_region + 1;
        let insert = format!(
            "INSERT INTO accounts (id, balance) SELECT g, 1000 FROM generate_series({first}, {}) g",
            first + per_region - 1
        );
        // The partition's range and its first leader settle within seconds.
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(e) = sqlx::raw_sql(&insert).execute(&mut c).await {
            assert!(Instant::now() < deadline, "{insert}: {e}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The region of account `id` in [`regional_bank`].
fn region_of(id: i32, per_region: i32) -> &'static str {
    REGIONS[((id - 1) / per_region) as usize]
}

/// Every account's (region, id, balance), as a node sees them. The read needs a replica of
/// every partition on that node (it is ordered, so not split over leaseholders): right after
/// the table is created a non-voting replica may still be joining (it starts from the range's
/// snapshot), and the read is refused (0A000) until it has.
async fn balances(node: &Node) -> Vec<(String, i32, i64)> {
    eventually(
        "a replica of every partition",
        Duration::from_secs(30),
        || async {
            let mut c = connect(node, "mr").await?;
            sqlx::query_as("SELECT crdb_region::text, id, balance FROM accounts ORDER BY id")
                .fetch_all(&mut c)
                .await
                .ok()
        },
    )
    .await
}

/// Waits until every node reports the same balances, and returns them.
async fn balances_converged(nodes: &[Node]) -> Vec<(String, i32, i64)> {
    eventually(
        "every node to report the same balances",
        Duration::from_secs(60),
        || async {
            let first = balances(&nodes[0]).await;
            for n in &nodes[1..] {
                if balances(n).await != first {
                    return None;
                }
            }
            Some(first)
        },
    )
    .await
}

/// Waits until no node holds a prepared transaction.
async fn no_prepared_transactions(nodes: &[Node]) {
    eventually(
        "no prepared transaction left",
        Duration::from_secs(90),
        || async {
            for n in nodes {
                let mut c = connect(n, "mr").await?;
                let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_prepared_xacts")
                    .fetch_one(&mut c)
                    .await
                    .ok()?;
                if left > 0 {
                    return None;
                }
            }
            Some(())
        },
    )
    .await
}

/// One statement's text moving `amount` into (or out of) account `id`, naming its region so
/// that it touches one partition.
fn transfer_sql(id: i32, per_region: i32, amount: i64, tid: i64) -> String {
    format!(
        "UPDATE accounts SET balance = balance + ({amount}), note = note || ' {tid}' \
         WHERE crdb_region = '{}' AND id = {id}",
        region_of(id, per_region)
    )
}

/// Transactions over the leaseholders of several regions commit atomically through any node:
/// a transfer between two regions' rows through a third region's node, a transaction over
/// two ranges of one node, a rollback, a part that fails to prepare (a deferred unique
/// violation on another node aborts the whole transaction with its 23505), and a deadlock
/// across two nodes, which the distributed lock timeout ends. Then concurrent transfers
/// between random regions through every node keep the bank's total, every acknowledged
/// transfer is on both of its accounts, and no prepared transaction is left anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_over_several_leaseholders_commit_atomically() {
    let dir = scratch("data-2pc");
    let nodes = start_cluster(dir.path(), 38, WAN, &[EAST_B, WEST_A, EU_B]).await;
    const PER: i32 = 3;
    regional_bank(&nodes, PER).await;
    let mut c: Vec<PgConnection> = Vec::new();
    for n in &nodes {
        c.push(connect(n, "mr").await.unwrap());
    }

    // us-east1 → us-west1 through the europe-west1 node: both parts are remote.
    exec(
        &mut c[2],
        &format!(
            "BEGIN; {}; {}; COMMIT",
            transfer_sql(1, PER, -100, 1),
            transfer_sql(4, PER, 100, 1)
        ),
    )
    .await;
    // europe-west1 → us-east1 through the us-east1 node: one part here, one remote.
    exec(
        &mut c[0],
        &format!(
            "BEGIN; {}; {}; COMMIT",
            transfer_sql(7, PER, -50, 2),
            transfer_sql(1, PER, 50, 2)
        ),
    )
    .await;
    // Two ranges leased by one node (a partition and a table): one transaction.
    exec(
        &mut c[0],
        &format!(
            "BEGIN; {}; INSERT INTO audit VALUES (1, 'first'); COMMIT",
            transfer_sql(2, PER, 0, 3)
        ),
    )
    .await;
    // A rollback leaves nothing anywhere.
    exec(
        &mut c[1],
        &format!(
            "BEGIN; {}; {}; ROLLBACK",
            transfer_sql(4, PER, -500, 4),
            transfer_sql(8, PER, 500, 4)
        ),
    )
    .await;
    let b = balances_converged(&nodes).await;
    let balance = |id: i32| b.iter().find(|r| r.1 == id).unwrap().2;
    assert_eq!(
        (balance(1), balance(2), balance(4), balance(7), balance(8)),
        (950, 1000, 1100, 950, 1000),
        "{b:?}"
    );
    for n in &nodes {
        let mut m = connect(n, "mr").await.unwrap();
        let both: (i64, String) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM audit), (SELECT note FROM accounts WHERE id = 2)",
        )
        .fetch_one(&mut m)
        .await
        .unwrap();
        assert_eq!(both, (1, " 3".to_string()), "{}", n.data_dir.display());
    }

    // A part that cannot prepare aborts every part: the us-west1 row written here is not
    // changed anywhere, and the client sees the other node's 23505.
    let err = sqlx::raw_sql(&format!(
        "BEGIN; {}; INSERT INTO audit VALUES (2, 'first'); COMMIT",
        transfer_sql(5, PER, -7, 5)
    ))
    .execute(&mut c[1])
    .await
    .expect_err("the deferred unique constraint fails at commit on node 1");
    assert_eq!(code(&err), "23505", "{err}");
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut c[1]).await;

    // A deadlock across two nodes ends within the distributed lock timeout.
    let started = Instant::now();
    let cross = |first: i32, second: i32, tid: i64| {
        format!(
            "BEGIN; {}; SELECT pg_sleep(0.5); {}; COMMIT",
            transfer_sql(first, PER, -1, tid),
            transfer_sql(second, PER, 1, tid)
        )
    };
    let (c0, rest) = c.split_at_mut(1);
    let (s1, s2) = (cross(3, 6, 6), cross(6, 3, 7));
    let (r1, r2) = tokio::join!(
        sqlx::raw_sql(&s1).execute(&mut c0[0]),
        sqlx::raw_sql(&s2).execute(&mut rest[0]),
    );
    let failed: Vec<String> = [r1.err(), r2.err()].iter().flatten().map(code).collect();
    assert!(
        !failed.is_empty(),
        "one of two deadlocked transactions fails"
    );
    assert!(failed.iter().all(|c| c == "55P03"), "{failed:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    for conn in c.iter_mut() {
        let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await;
    }
    no_prepared_transactions(&nodes).await;
    let total: i64 = balances_converged(&nodes).await.iter().map(|r| r.2).sum();
    assert_eq!(total, 9 * 1000, "the bank's total changed");

    // Concurrent transfers between random regions through every node.
    let ports: Vec<u16> = nodes.iter().map(|n| n.pg_port).collect();
    let until = Instant::now() + Duration::from_secs(20);
    let clients: Vec<_> = (0..3u64)
        .map(|i| {
            let port = ports[i as usize];
            tokio::spawn(region_bank_client(port, i, until))
        })
        .collect();
    let (mut acked, mut unknown, mut refused) = (Vec::new(), Vec::new(), 0);
    for cl in clients {
        let (a, u, r) = cl.await.unwrap();
        acked.extend(a);
        unknown.extend(u);
        refused += r;
    }
    no_prepared_transactions(&nodes).await;
    let b = balances_converged(&nodes).await;
    assert_eq!(
        b.iter().map(|r| r.2).sum::<i64>(),
        9 * 1000,
        "the bank's total changed"
    );
    let mut m = connect(&nodes[0], "mr").await.unwrap();
    let notes: Vec<String> = sqlx::query_scalar("SELECT note FROM accounts")
        .fetch_all(&mut m)
        .await
        .unwrap();
    let mut seen: std::collections::BTreeMap<i64, usize> = Default::default();
    for n in &notes {
        for t in n.split_whitespace() {
            *seen.entry(t.parse().unwrap()).or_default() += 1;
        }
    }
    for t in &acked {
        assert_eq!(seen.get(t), Some(&2), "acknowledged transfer {t}");
    }
    // (Transfers below a million are the checks above: number 3 wrote one account.)
    for (t, n) in seen.range(1_000_000..) {
        assert_eq!(*n, 2, "transfer {t} applied on one account only");
    }
    assert!(
        acked.len() >= 10,
        "transfers made progress: {}",
        acked.len()
    );
    eprintln!(
        "2pc bank: {} transfers acknowledged, {} refused (lock timeouts), {} of unknown outcome",
        acked.len(),
        refused,
        unknown.len()
    );
    check_consistency(&nodes[1]);
}

/// Every part range's log gets its two-phase commit's decision before its replicas apply the
/// rows, even when the part's node does not copy it there (`2pc-no-decision-copy`, as when
/// the part's leadership moved meanwhile): the range's leader puts it in when its applier
/// finds none, and every replica passes the `Prepare` entry on its own log's copy. So the
/// europe-west1 node's replica of the us-west1 partition applies a transfer coordinated by
/// the us-east1 node (whose partition is the anchor) while those two nodes cannot reach each
/// other; when appliers took the decision from the anchor it waited for the partition to
/// heal (run and seen). This is what lets an anchor forget a decision once every part range
/// holds it (ARCHITECTURE.md §8.5, "Costs").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_range_takes_its_decision_from_its_own_log_when_the_anchor_is_cut_off() {
    let dir = scratch("data-2pc-own-log");
    let nodes = start_cluster_with_env(
        dir.path(),
        77,
        WAN,
        &[EAST_B, WEST_A, EU_B],
        &[("PGMR_FAILPOINT", "2pc-no-decision-copy")],
    )
    .await;
    const PER: i32 = 3;
    regional_bank(&nodes, PER).await;
    balances_converged(&nodes).await;
    let dd = |i: usize| nodes[i].data_dir.to_str().unwrap().to_string();
    pgmr_ok(&["debug", "partition", "--data-dir", &dd(0), "--peers", "3"]);
    pgmr_ok(&["debug", "partition", "--data-dir", &dd(2), "--peers", "1"]);

    let mut east = connect(&nodes[0], "mr").await.unwrap();
    exec(
        &mut east,
        &format!(
            "BEGIN; {}; {}; COMMIT",
            transfer_sql(1, PER, -100, 1),
            transfer_sql(4, PER, 100, 1)
        ),
    )
    .await;
    // Read on the europe-west1 node's own replica (after a read barrier at the us-west1
    // leaseholder, which it can reach).
    eventually(
        "the europe-west1 node's replica of the us-west1 partition to apply the transfer",
        Duration::from_secs(30),
        || async {
            let mut c = connect(&nodes[2], "mr").await?;
            exec(&mut c, "SET statement_timeout = '5s'").await;
            let b: i64 = sqlx::query_scalar(
                "SELECT balance FROM accounts WHERE crdb_region = 'us-west1' AND id = 4",
            )
            .fetch_one(&mut c)
            .await
            .ok()?;
            (b == 1100).then_some(())
        },
    )
    .await;

    for i in [0, 2] {
        pgmr_ok(&["debug", "heal", "--data-dir", &dd(i)]);
    }
    let b = balances_converged(&nodes).await;
    let balance = |id: i32| b.iter().find(|r| r.1 == id).unwrap().2;
    assert_eq!((balance(1), balance(4)), (900, 1100), "{b:?}");
    no_prepared_transactions(&nodes).await;
    check_consistency(&nodes[1]);
}

/// Two-phase commit decisions kept on `node`: (its own records, its range replicas', the
/// plans kept beside those).
async fn decisions_kept(node: &Node) -> (f64, f64, f64) {
    (
        metric(node.pg_port, "pgmr_decisions_kept{kind=\"node\"}").await,
        metric(node.pg_port, "pgmr_decisions_kept{kind=\"range\"}").await,
        metric(node.pg_port, "pgmr_decisions_kept{kind=\"plan\"}").await,
    )
}

/// Waits until no node keeps a two-phase commit's decision or plan (`pgmr_decisions_kept` is
/// 0 for the node's records, its replicas' and their plans).
async fn all_forgotten(nodes: &[Node], what: &str) {
    // A forget left by its coordinator is taken up a minute after its decision (an abort's
    // two minutes after).
    for n in nodes {
        eventually(what, Duration::from_secs(180), || async {
            (decisions_kept(n).await == (0.0, 0.0, 0.0)).then_some(())
        })
        .await;
    }
}

/// Committed transactions over several ranges are forgotten everywhere once their
/// coordinator has confirmed that every part range's log holds the commit and every prepared
/// part has ended: transfers between regions through each node (a remote part prepared by
/// `PREPARE TRANSACTION`, its ranges named in its answer), and a transaction over two ranges
/// of one node (prepared entries only). No node keeps a record of any of them, the anchors'
/// and the part ranges' records included; the rows are where they were. Before forgetting,
/// every such transaction left about 40 bytes on every replica of each of its ranges and on
/// every node, forever (ARCHITECTURE.md §8.5, "Forgetting decisions").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_decisions_are_forgotten_everywhere() {
    let dir = scratch("data-2pc-forget");
    let nodes = start_cluster(dir.path(), 79, WAN, &[EAST_B, WEST_A, EU_B]).await;
    const PER: i32 = 3;
    regional_bank(&nodes, PER).await;
    balances_converged(&nodes).await;
    let mut tid = 0;
    for (i, (from, to)) in [(1, 4), (4, 7), (7, 1)].into_iter().enumerate() {
        let mut c = connect(&nodes[i], "mr").await.unwrap();
        for _ in 0..3 {
            tid += 1;
            exec(
                &mut c,
                &format!(
                    "BEGIN; {}; {}; COMMIT",
                    transfer_sql(from, PER, -10, tid),
                    transfer_sql(to, PER, 10, tid)
                ),
            )
            .await;
        }
    }
    // Two ranges leased by the us-east1 node: its partition of `accounts` and `audit`.
    let mut east = connect(&nodes[0], "mr").await.unwrap();
    exec(
        &mut east,
        &format!(
            "BEGIN; {}; INSERT INTO audit VALUES (1, 'one'); COMMIT",
            transfer_sql(2, PER, -1, 100)
        ),
    )
    .await;
    // A part that only locks a row (the us-west1 node prepares no entries) is ended and
    // forgotten too. (Its node is not told to record the decision, which nothing there would
    // forget where it holds no replica of the transaction's ranges; here every node holds
    // one of every range, so this cannot show that.)
    exec(
        &mut east,
        &format!(
            "BEGIN; SELECT 1 FROM accounts WHERE crdb_region = 'us-west1' AND id = 5 FOR UPDATE; \
             {}; COMMIT",
            transfer_sql(8, PER, 0, 101)
        ),
    )
    .await;
    all_forgotten(
        &nodes,
        "every committed transaction's decision forgotten on the node",
    )
    .await;
    let b = balances_converged(&nodes).await;
    let balance = |id: i32| b.iter().find(|r| r.1 == id).unwrap().2;
    assert_eq!(
        (balance(1), balance(2), balance(4), balance(7)),
        (1000, 999, 1000, 1000),
        "{b:?}"
    );
    no_prepared_transactions(&nodes).await;
    check_consistency(&nodes[1]);
}

/// Aborted transactions over several ranges are forgotten everywhere too, where their
/// coordinator decided the abort: it confirms that every prepared part was rolled back and
/// every part range's log holds the abort, as for a commit. Two ways a prepare fails: a part
/// whose `PREPARE TRANSACTION` fails after its pre-prepare wrote its `Prepare` entries
/// (PostgreSQL refuses to prepare a transaction that touched a temporary table, which a
/// trigger here does; that part names its ranges in its failure), and a part whose deferred
/// unique check fails before it writes anything, while other parts had prepared. Both
/// clients get the part's error, no row changes anywhere, and no node keeps a record of
/// either transaction. Aborts were kept forever before (ARCHITECTURE.md §8.5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_decisions_are_forgotten_everywhere() {
    let dir = scratch("data-2pc-forget-abort");
    let nodes = start_cluster(dir.path(), 83, WAN, &[EAST_B, WEST_A, EU_B]).await;
    const PER: i32 = 3;
    regional_bank(&nodes, PER).await;
    let mut m = connect(&nodes[0], "mr").await.unwrap();
    exec(
        &mut m,
        "CREATE FUNCTION touch_temp() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.note LIKE '%temp%' THEN CREATE TEMP TABLE IF NOT EXISTS scratch (x int); \
         END IF; RETURN NEW; END $$",
    )
    .await;
    exec(
        &mut m,
        "CREATE TRIGGER touch_temp BEFORE UPDATE ON accounts \
         FOR EACH ROW EXECUTE FUNCTION touch_temp()",
    )
    .await;
    exec(&mut m, "INSERT INTO audit VALUES (1, 'taken')").await;
    balances_converged(&nodes).await;
    all_forgotten(&nodes, "the setup's transactions forgotten on the node").await;

    // us-west1 → europe-west1 through the us-east1 node: the europe-west1 part fails after
    // its `Prepare` entries, the us-west1 part had prepared.
    let mut east = connect(&nodes[0], "mr").await.unwrap();
    let err = sqlx::raw_sql(&format!(
        "BEGIN; {}; UPDATE accounts SET balance = balance + 10, note = note || ' temp' \
         WHERE crdb_region = 'europe-west1' AND id = 7; COMMIT",
        transfer_sql(4, PER, -10, 1)
    ))
    .execute(&mut east)
    .await
    .expect_err("the europe-west1 part cannot prepare");
    assert_eq!(code(&err), "0A000", "{err}");
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut east).await;

    // Through the us-west1 node: its own part and the europe-west1 one prepare, the audit
    // insert at the us-east1 leaseholder fails its deferred unique check first. (Right after
    // the failed prepare, the europe-west1 range's `Prepare` entry is passed already: its
    // node recorded the abort it made certain. Before, this transaction got 40001 from the
    // range's fence there, run and seen.)
    let mut west = connect(&nodes[1], "mr").await.unwrap();
    let err = sqlx::raw_sql(&format!(
        "BEGIN; {}; {}; INSERT INTO audit VALUES (2, 'taken'); COMMIT",
        transfer_sql(5, PER, -10, 2),
        transfer_sql(8, PER, 10, 2)
    ))
    .execute(&mut west)
    .await
    .expect_err("the deferred unique constraint fails at commit on the us-east1 node");
    assert_eq!(code(&err), "23505", "{err}");
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut west).await;

    all_forgotten(
        &nodes,
        "every aborted transaction's decision forgotten on the node",
    )
    .await;
    let b = balances_converged(&nodes).await;
    assert!(b.iter().all(|r| r.2 == 1000), "{b:?}");
    no_prepared_transactions(&nodes).await;
    check_consistency(&nodes[1]);
}

/// A replica whose log lags reaches its `Prepare` entry after the transaction was forgotten
/// everywhere else, and asks the anchor, which no longer knows it: after 20 s it proposes
/// abort, and the anchor records that abort anew (`PGMR_FAILPOINT=2pc-late-ask` on the
/// europe-west1 node: its appliers know nothing of the transaction until then, as when its
/// log had not yet received its range's copy of the decision). It still applies the commit:
/// an anchor's abort only ever reaches it as a copy proposed into its own range's log, behind
/// the commit already there, and it passes on its own log's record. When appliers went by
/// the anchor's answer, that replica skipped the committed rows and differed from the others
/// (run and seen; ARCHITECTURE.md §8.5, "Forgetting decisions").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_abort_after_a_forget_does_not_skip_committed_rows() {
    let dir = scratch("data-2pc-late-abort");
    let mut nodes = start_cluster(dir.path(), 81, WAN, &[EAST_B, WEST_A, EU_B]).await;
    const PER: i32 = 3;
    regional_bank(&nodes, PER).await;
    balances_converged(&nodes).await;
    // The setup's own transactions over several ranges forgotten first (their coordinators'
    // work is in memory: the europe-west1 node's would be lost in its restart).
    all_forgotten(&nodes, "the setup's transactions forgotten on the node").await;
    nodes[2].crash();
    nodes[2].restart_with_env(&[("PGMR_FAILPOINT", "2pc-late-ask")]);
    eventually(
        "the europe-west1 node back",
        Duration::from_secs(90),
        || try_connect(nodes[2].pg_port),
    )
    .await;
    balances_converged(&nodes).await;

    let mut east = connect(&nodes[0], "mr").await.unwrap();
    exec(
        &mut east,
        &format!(
            "BEGIN; {}; {}; COMMIT",
            transfer_sql(1, PER, -100, 1),
            transfer_sql(4, PER, 100, 1)
        ),
    )
    .await;
    // Forgotten by the nodes whose appliers know the decision (the europe-west1 node's
    // replicas still hold theirs, waiting at the transaction's entries).
    for n in &nodes[..2] {
        eventually(
            "the transfer forgotten on the node",
            Duration::from_secs(15),
            || async { (decisions_kept(n).await.1 == 0.0).then_some(()) },
        )
        .await;
    }
    // The europe-west1 node's late question records an abort anew on the anchor...
    eventually(
        "the anchor to record the late abort",
        Duration::from_secs(60),
        || async { (decisions_kept(&nodes[0]).await.1 > 0.0).then_some(()) },
    )
    .await;
    // ... and its replicas still apply the commit, as every other replica did.
    let b = balances_converged(&nodes).await;
    let balance = |id: i32| b.iter().find(|r| r.1 == id).unwrap().2;
    assert_eq!((balance(1), balance(4)), (900, 1100), "{b:?}");
    no_prepared_transactions(&nodes).await;
    check_consistency(&nodes[1]);
}

/// One client of the regional bank: transfers of 5 between random accounts of any region,
/// each one simple-protocol transaction (SERIALIZABLE for odd `i`, holding each node's turn,
/// else READ COMMITTED), through the node at `port` until `until`. Returns the transfers
/// acknowledged, those of unknown outcome (40003), and how many were refused.
async fn region_bank_client(port: u16, i: u64, until: Instant) -> (Vec<i64>, Vec<i64>, u32) {
    const PER: i32 = 3;
    let mut c = try_connect_db(port, "mr").await;
    let mut seed = i * 7919 + 11;
    let (mut acked, mut unknown, mut refused) = (Vec::new(), Vec::new(), 0u32);
    let mut tid = (i as i64 + 1) * 1_000_000;
    while Instant::now() < until {
        seed = xorshift(seed);
        let from = (seed % 9) as i32 + 1;
        let to = ((seed / 9) % 8) as i32 + 1;
        let to = if to >= from { to + 1 } else { to };
        tid += 1;
        let sql = format!(
            "BEGIN{}; {}; {}; COMMIT",
            if i % 2 == 1 {
                " ISOLATION LEVEL SERIALIZABLE"
            } else {
                ""
            },
            transfer_sql(from, PER, -5, tid),
            transfer_sql(to, PER, 5, tid)
        );
        let r = sqlx::Executor::execute(&mut c, sql.as_str()).await;
        match r {
            Ok(_) => acked.push(tid),
            Err(e) => {
                let code = code(&e);
                if code == "40003" {
                    unknown.push(tid);
                } else {
                    assert!(
                        ["55P03", "40001", "40P01"].contains(&code.as_str()),
                        "transfer {tid}: {e}"
                    );
                    refused += 1;
                }
                let _ = sqlx::Executor::execute(&mut c, "ROLLBACK").await;
            }
        }
    }
    (acked, unknown, refused)
}

async fn try_connect_db(port: u16, db: &str) -> PgConnection {
    PgConnectOptions::new()
        .host("127.0.0.1")
        .port(port)
        .username("postgres")
        .database(db)
        .connect()
        .await
        .unwrap()
}

/// Restarts `node` (node 1 of [`regional_bank`]) with `failpoint` armed; a connection to it
/// once it serves a (no-op) transfer again.
async fn restart_with_failpoint(node: &mut Node, failpoint: &str, per: i32) -> PgConnection {
    restart_with_failpoint_probe(node, failpoint, &transfer_sql(1, per, 0, 0)).await
}

/// Restarts `node` with `PGMR_FAILPOINT=failpoint`; a session of database `mr` on it once
/// `probe` runs there.
async fn restart_with_failpoint_probe(
    node: &mut Node,
    failpoint: &str,
    probe: &str,
) -> PgConnection {
    node.crash();
    node.restart_with_env(&[("PGMR_FAILPOINT", failpoint)]);
    eventually("the node back", Duration::from_secs(90), || async {
        let mut c = connect(node, "mr").await?;
        sqlx::raw_sql(probe).execute(&mut c).await.ok()?;
        Some(c)
    })
    .await
}

/// The coordinator's node crashes (`PGMR_FAILPOINT`) between the decision and the parts'
/// commits, and then between the parts' prepares and the decision: after it restarts, the
/// first transaction is committed everywhere (its own part from the anchor's log, the other
/// node's prepared part by that node's applier or sweep) and the second rolled back
/// everywhere; no prepared transaction is left, and the rows they locked are writable again.
/// Both are SERIALIZABLE, so the prepared part also held its node's turn: a SERIALIZABLE
/// transfer over both nodes commits again. The committed one is forgotten everywhere, though
/// its coordinator lost its work in the crash: the anchor's leader drives the forget on the
/// plan its log keeps (before, its records stayed on every node for good), and so are the
/// setup's, whose forget the first restart cut short. So is the aborted one, which no
/// coordinator ever knew (a sweep decided it): each range forgets it once the commit limit
/// (30 s here, `PGMR_COMMIT_LIMIT_SECS`) and a minute have passed, when no commit can follow
/// (before, it stayed everywhere for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_crash_around_the_decision_leaves_no_transaction_in_doubt() {
    let dir = scratch("data-2pc-crash");
    let mut nodes = start_cluster_with_env(
        dir.path(),
        39,
        WAN,
        &[EAST_B, WEST_A, EU_B],
        &[("PGMR_COMMIT_LIMIT_SECS", "30")],
    )
    .await;
    const PER: i32 = 1;
    regional_bank(&nodes, PER).await;
    for (failpoint, tid, expect) in [
        ("2pc-after-decide", 1, (990, 1010)),
        ("2pc-before-decide", 2, (990, 1010)),
    ] {
        let mut c = restart_with_failpoint(&mut nodes[0], failpoint, PER).await;
        let err = sqlx::raw_sql(&format!(
            "BEGIN ISOLATION LEVEL SERIALIZABLE; {}; {}; COMMIT",
            transfer_sql(1, PER, -10, tid),
            transfer_sql(2, PER, 10, tid)
        ))
        .execute(&mut c)
        .await
        .expect_err("the coordinator's pgmr dies during the commit");
        assert_eq!(code(&err), "40003", "{failpoint}: {err}");
        drop(c);
        nodes[0].crash();
        nodes[0].restart();
        eventually("node 1 to serve SQL", Duration::from_secs(90), || {
            try_connect(nodes[0].pg_port)
        })
        .await;
        no_prepared_transactions(&nodes).await;
        let b = balances_converged(&nodes).await;
        assert_eq!((b[0].2, b[1].2), expect, "{failpoint}: {b:?}");
        // The us-west1 row is not locked any more, nor the us-west1 node's turn.
        let mut w = connect(&nodes[1], "mr").await.unwrap();
        exec(&mut w, "SET lock_timeout = '5s'").await;
        exec(&mut w, &transfer_sql(2, PER, 0, 0)).await;
        exec(
            &mut w,
            &format!(
                "BEGIN ISOLATION LEVEL SERIALIZABLE; {}; {}; COMMIT",
                transfer_sql(2, PER, 0, 0),
                transfer_sql(1, PER, 0, 0)
            ),
        )
        .await;
        if failpoint == "2pc-after-decide" {
            all_forgotten(&nodes, "the commit whose coordinator crashed forgotten").await;
        }
    }
    all_forgotten(&nodes, "the abort no coordinator knew forgotten").await;
    check_consistency(&nodes[2]);
}

/// The range holding a two-phase commit's decision (its anchor: a range the coordinator's
/// node leads, here one the transaction does not write, so nothing holds its table) is
/// dropped while the transaction is prepared and undecided (its coordinator pauses,
/// `2pc-slow-decide`): the meta leader has the range's leaseholder seal its log before the
/// drop, and the node that applied the seal answers for the range's decisions from then on.
/// So the coordinator, resuming, finds the transaction decided abort and rolls every part
/// back; and when the coordinator dies instead, the other nodes' prepared parts learn the
/// abort from that node (before it died, or once it is back). With nowhere to ask, both
/// waited forever: the decision had no range left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_whose_anchor_range_is_dropped_undecided_is_aborted_everywhere() {
    let dir = scratch("data-2pc-dropped-anchor");
    let mut nodes = start_cluster(dir.path(), 74, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let mut east = three_region_db(&nodes).await;
    // The us-west1 node leads the anchors only (the lowest range it leads is the anchor of a
    // transaction that writes nothing there); t and u are led in the other regions.
    execute_all(
        &mut east,
        &[
            r#"CREATE TABLE anchor_1 (id int PRIMARY KEY) LOCALITY REGIONAL BY TABLE IN "us-west1""#,
            r#"CREATE TABLE anchor_2 (id int PRIMARY KEY) LOCALITY REGIONAL BY TABLE IN "us-west1""#,
            "CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)",
            r#"CREATE TABLE u (id int PRIMARY KEY, v int NOT NULL) LOCALITY REGIONAL BY TABLE IN "europe-west1""#,
        ],
    )
    .await;
    exec_once_settled(&mut east, "INSERT INTO t VALUES (1, 0)").await;
    exec_once_settled(&mut east, "INSERT INTO u VALUES (1, 0)").await;
    let east_port = nodes[0].pg_port;
    let range_of = move |table: &'static str| {
        let port = east_port;
        async move {
            let mut c = PgConnectOptions::new()
                .host("127.0.0.1")
                .port(port)
                .username("postgres")
                .database("mr")
                .connect()
                .await
                .ok()?;
            sqlx::query_as::<_, (i64, i64)>(
                "SELECT range_id, lease_holder FROM multiregion.ranges WHERE table_name = $1",
            )
            .bind(table)
            .fetch_optional(&mut c)
            .await
            .ok()
            .flatten()
        }
    };
    for (table, holder) in [("anchor_1", 2), ("anchor_2", 2), ("t", 1), ("u", 3)] {
        eventually("the leases settled", Duration::from_secs(60), || async {
            range_of(table).await.filter(|r| r.1 == holder)
        })
        .await;
    }
    let mut w = restart_with_failpoint_probe(&mut nodes[1], "2pc-slow-decide", "SELECT 1").await;
    for (round, table, coordinator_dies) in [(1, "anchor_1", false), (2, "anchor_2", true)] {
        let (anchor, _) = range_of(table).await.unwrap();
        // Through the us-west1 node: rows leased in us-east1 and europe-west1 (parts there).
        let txn = tokio::spawn(async move {
            let mut r = Ok(());
            for sql in [
                "BEGIN",
                "UPDATE t SET v = v + 1 WHERE id = 1",
                "UPDATE u SET v = v + 1 WHERE id = 1",
                "COMMIT",
            ] {
                if let Err(e) = sqlx::query(sql).execute(&mut w).await {
                    r = Err(e);
                    break;
                }
            }
            (w, r)
        });
        let prepared = eventually("the parts prepared", Duration::from_secs(20), || async {
            let mut names = Vec::new();
            for n in [&nodes[0], &nodes[2]] {
                let mut c = connect(n, "mr").await?;
                let name: String = sqlx::query_scalar("SELECT gid FROM pg_prepared_xacts")
                    .fetch_optional(&mut c)
                    .await
                    .ok()??;
                names.push(name);
            }
            Some(names)
        })
        .await;
        assert!(
            prepared[0].starts_with(&format!("mr:{anchor}:")),
            "round {round}: the decision is not in {table}'s range: {prepared:?}"
        );
        exec(&mut east, &format!("DROP TABLE {table}")).await;
        eventually(
            "the anchor's range dropped",
            Duration::from_secs(25),
            || async { range_of(table).await.is_none().then_some(()) },
        )
        .await;
        if coordinator_dies {
            nodes[1].crash();
            let (_, r) = txn.await.unwrap();
            assert!(r.is_err(), "a transaction whose coordinator died committed");
            // The parts learn the decision (abort: sealed undecided) from the node that sealed
            // the anchor, the dead coordinator's: before the crash if they asked it already
            // (their appliers ask a second after reaching their entries; a loaded machine
            // gets there first), else once it is back.
            nodes[1].restart();
            w = eventually("node 2 back", Duration::from_secs(90), || {
                connect(&nodes[1], "mr")
            })
            .await;
        } else {
            let (back, r) = txn.await.unwrap();
            w = back;
            let err = r.expect_err("decided abort: the anchor was sealed undecided");
            assert_eq!(code(&err), "40001", "{err}");
        }
        // … and every part is rolled back.
        no_prepared_transactions(&nodes).await;
        for n in &nodes {
            let mut c = connect(n, "mr").await.unwrap();
            let v: (i32, i32) = sqlx::query_as("SELECT t.v, u.v FROM t, u")
                .fetch_one(&mut c)
                .await
                .unwrap();
            assert_eq!(v, (0, 0), "round {round}, node on {}", n.pg_port);
        }
        exec(&mut east, "SET lock_timeout = '5s'").await;
        exec(&mut east, "UPDATE t SET v = v WHERE id = 1").await;
    }
    check_consistency(&nodes[0]);
}

/// An INSERT into a REGIONAL BY ROW table runs on the node leasing the partitions its rows
/// go to, whichever node it is typed on: an explicit region, a parameter (custom and generic
/// plans), the `gateway_region()` default, a region computed from another column (the MovR
/// tutorial's `REGIONAL BY ROW AS region`), several rows of one region; rows for several
/// regions in one statement are each written at their own leaseholder. A serial column's
/// sequence advances on every replica with the rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inserts_run_where_their_rows_partitions_are_leased() {
    let dir = scratch("data-insert-route");
    let nodes = start_cluster(dir.path(), 43, WAN, &[EAST_B, WEST_A, EU_B]).await;
    regional_bank(&nodes, 1).await;
    let mut m = connect(&nodes[0], "mr").await.unwrap();
    sqlx::query("SELECT multiregion.execute($1)")
        .bind(
            "CREATE TABLE rides (id int PRIMARY KEY, city text NOT NULL, region crdb_internal_region NOT NULL \
             AS (CASE WHEN city = 'new york' THEN 'us-east1' WHEN city = 'seattle' THEN 'us-west1' \
             ELSE 'europe-west1' END) STORED) LOCALITY REGIONAL BY ROW AS region",
        )
        .execute(&mut m)
        .await
        .unwrap();
    // Through the us-east1 node: rows of other regions.
    exec_once_settled(&mut m, "INSERT INTO rides (id, city) VALUES (1, 'seattle')").await;
    exec(
        &mut m,
        "INSERT INTO rides (id, city) VALUES (2, 'paris'), (3, 'rome')",
    )
    .await;
    exec(
        &mut m,
        "INSERT INTO accounts (crdb_region, id, balance) VALUES ('us-west1', 10, 1), ('us-west1', 11, 1)",
    )
    .await;
    for id in 12..20 {
        // Custom plans, then the generic plan with its parameters.
        sqlx::query("INSERT INTO accounts (crdb_region, id, balance) VALUES ($1::text::crdb_internal_region, $2, 1)")
            .bind("europe-west1")
            .bind(id)
            .execute(&mut m)
            .await
            .unwrap();
    }
    // Through the us-west1 node: the default region is the client's.
    let mut w = connect(&nodes[1], "mr").await.unwrap();
    exec(
        &mut w,
        "INSERT INTO accounts (id, balance) VALUES (20, 1), (21, 1)",
    )
    .await;
    // One statement, two regions' leaseholders: each row is written at its own.
    exec(
        &mut m,
        "INSERT INTO accounts (crdb_region, id, balance) VALUES ('us-west1', 30, 1), ('europe-west1', 31, 1)",
    )
    .await;
    let expect_rides = "europe-west1:2 europe-west1:3 us-west1:1";
    let expect_accounts = "europe-west1:12 europe-west1:13 europe-west1:14 europe-west1:15 \
        europe-west1:16 europe-west1:17 europe-west1:18 europe-west1:19 us-east1:1 us-west1:10 \
        us-west1:11 us-west1:2 us-west1:20 us-west1:21 europe-west1:3 us-west1:30 europe-west1:31";
    for n in &nodes {
        let (rides, accounts): (String, String) = eventually(
            "rows on every node",
            Duration::from_secs(30),
            || async {
                let mut c = connect(n, "mr").await?;
                let r: (String, String) = sqlx::query_as(
                    "SELECT (SELECT string_agg(region || ':' || id, ' ' ORDER BY region, id) FROM rides), \
                            (SELECT string_agg(crdb_region || ':' || id, ' ' ORDER BY id) FROM accounts)",
                )
                .fetch_one(&mut c)
                .await
                .ok()?;
                (r.0 == expect_rides && r.1.split(' ').count() == 17).then_some(r)
            },
        )
        .await;
        assert_eq!(rides, expect_rides);
        let mut got: Vec<&str> = accounts.split(' ').collect();
        got.sort();
        let mut want: Vec<&str> = expect_accounts.split_whitespace().collect();
        want.sort();
        assert_eq!(got, want, "{}", n.data_dir.display());
    }
    // A serial key's sequence follows the applied rows on every replica, so that a new
    // leaseholder's nextval does not hand out a key the table already has.
    exec(
        &mut m,
        "CREATE TABLE events (id serial PRIMARY KEY, note text)",
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) =
        sqlx::raw_sql("INSERT INTO events (note) SELECT 'e' FROM generate_series(1, 5)")
            .execute(&mut m)
            .await
    {
        assert!(Instant::now() < deadline, "{e}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for n in &nodes[1..] {
        let last: i64 = eventually(
            "the sequence to follow",
            Duration::from_secs(30),
            || async {
                let mut c = connect(n, "mr").await?;
                let v: Option<i64> =
                    sqlx::query_scalar("SELECT pg_sequence_last_value('events_id_seq')")
                        .fetch_one(&mut c)
                        .await
                        .ok()?;
                v.filter(|&v| v >= 5)
            },
        )
        .await;
        assert_eq!(last, 5, "{}", n.data_dir.display());
    }
    check_consistency(&nodes[0]);
}

/// Under SURVIVE REGION FAILURE every range has voters in three regions, so losing a whole
/// region (here its one node, pgmr and PostgreSQL killed) leaves every table writable through
/// the other regions: the home region's partition, a table leased in the primary region, and
/// the other regions' partitions; nothing acknowledged is lost, and the region catches up
/// when it returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_region_survival_losing_a_region_leaves_every_table_writable() {
    let dir = scratch("data-region-down");
    let mut nodes = start_cluster(dir.path(), 44, WAN, &[EAST_B, WEST_A, EU_B]).await;
    regional_bank(&nodes, 1).await;
    let mut m = connect(&nodes[0], "mr").await.unwrap();
    sqlx::query("SELECT multiregion.execute('ALTER DATABASE mr SURVIVE REGION FAILURE')")
        .execute(&mut m)
        .await
        .unwrap();
    // Every range gets voters in all three regions.
    eventually(
        "voters in three regions",
        Duration::from_secs(60),
        || async {
            let mut c = connect(&nodes[0], "mr").await?;
            let narrow: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM multiregion.ranges WHERE database_name = 'mr' \
             AND cardinality(voting_replicas) < 3",
            )
            .fetch_one(&mut c)
            .await
            .ok()?;
            (narrow == 0).then_some(())
        },
    )
    .await;
    // … and every node's replica of them is a voter in its Raft group already (the
    // descriptor names the voters first; each is promoted from learner once caught up).
    eventually(
        "every replica promoted to voter",
        Duration::from_secs(60),
        || async {
            for n in &nodes {
                let mut c = connect(n, "mr").await?;
                let learners: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM multiregion.range_replicas r \
                     JOIN multiregion.ranges g USING (range_id) \
                     WHERE g.database_name = 'mr' AND r.raft_state = 'learner'",
                )
                .fetch_one(&mut c)
                .await
                .ok()?;
                if learners > 0 {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
    exec(&mut m, "INSERT INTO audit VALUES (1, 'before')").await;
    drop(m);

    nodes[0].crash();
    let lost = Instant::now();
    // Through the us-west1 node: the us-east1 partition (its home region is down), the
    // primary region's table, its own partition; through europe-west1 its own.
    let writes = [
        (1, "UPDATE accounts SET balance = balance - 1 WHERE crdb_region = 'us-east1' AND id = 1"),
        (1, "INSERT INTO audit VALUES (2, 'after')"),
        (1, "UPDATE accounts SET balance = balance + 1 WHERE crdb_region = 'us-west1' AND id = 2"),
        (2, "UPDATE accounts SET balance = balance + 0 WHERE crdb_region = 'europe-west1' AND id = 3"),
    ];
    for (node, sql) in writes {
        eventually(sql, Duration::from_secs(30), || async {
            let mut c = connect(&nodes[node], "mr").await?;
            match sqlx::raw_sql(sql).execute(&mut c).await {
                Ok(_) => Some(()),
                Err(e) => {
                    eprintln!("{sql}: {e}");
                    None
                }
            }
        })
        .await;
    }
    let took = lost.elapsed();
    eprintln!("region down: every table written within {took:?}");

    nodes[0].restart();
    eventually("node 1 to serve SQL", Duration::from_secs(90), || {
        try_connect(nodes[0].pg_port)
    })
    .await;
    let b = balances_converged(&nodes).await;
    assert_eq!(
        b.iter().map(|r| r.2).collect::<Vec<_>>(),
        vec![999, 1001, 1000],
        "{b:?}"
    );
    eventually("audit everywhere", Duration::from_secs(60), || async {
        for n in &nodes {
            let mut c = connect(n, "mr").await?;
            let k: i64 = sqlx::query_scalar("SELECT count(*) FROM audit")
                .fetch_one(&mut c)
                .await
                .ok()?;
            if k != 2 {
                return None;
            }
        }
        Some(())
    })
    .await;
    check_consistency(&nodes[1]);
}

/// A statement over partitions leased on several nodes runs on each leaseholder over its own
/// partitions, as parts of one transaction: an UPDATE or DELETE of a REGIONAL BY ROW table that
/// does not name the rows' region, through any node, changes exactly the rows it names (and
/// returns them), a rollback undoes every share, and a later read in the same transaction that
/// this node's copies would answer without those changes reads through the leaseholders
/// instead, and sees them. A table whose region is
/// computed from a column is reached through that column: a statement that fixes it touches
/// one partition, so even a SERIALIZABLE transaction (which never spans leaseholders) can
/// write a row of another region through it. A node that holds no replica of some partitions
/// reads the table through each leaseholder (and locks there with FOR UPDATE), and where no
/// node holds every partition, gathers them from their leaseholders for what needs them all
/// in one place (an aggregate, a grouping, a sort with LIMIT, a join).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_over_several_leaseholders_run_on_each_leaseholders_partitions() {
    let dir = scratch("data-split");
    let nodes = start_cluster(dir.path(), 45, WAN, &[EAST_B, WEST_A, EU_B]).await;
    const PER: i32 = 2;
    regional_bank(&nodes, PER).await;
    let mut east = connect(&nodes[0], "mr").await.unwrap();
    let mut west = connect(&nodes[1], "mr").await.unwrap();
    let mut eu = connect(&nodes[2], "mr").await.unwrap();

    // Accounts 2 (us-east1), 3 (us-west1) and 6 (europe-west1) through the us-west1 node.
    let rows: Vec<(i32, i64)> = sqlx::query_as(
        "UPDATE accounts SET balance = balance + 1 WHERE id IN (2, 3, 6) RETURNING id, balance",
    )
    .fetch_all(&mut west)
    .await
    .unwrap();
    let mut rows = rows;
    rows.sort();
    assert_eq!(rows, vec![(2, 1001), (3, 1001), (6, 1001)]);
    let deleted = sqlx::raw_sql("DELETE FROM accounts WHERE id = 5")
        .execute(&mut eu)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(deleted, 1);

    // Rolled back: no share keeps its change.
    exec(&mut east, "BEGIN").await;
    let n = sqlx::raw_sql("UPDATE accounts SET balance = 0 WHERE balance > 0")
        .execute(&mut east)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(n, 5);
    exec(&mut east, "ROLLBACK").await;
    // A read of every partition after changing rows leased elsewhere sees those changes
    // (read through the leaseholders, in the transaction's sessions there), not this node's
    // copies without them; it was refused.
    exec(&mut east, "BEGIN").await;
    exec(
        &mut east,
        "UPDATE accounts SET balance = balance - 10 WHERE id IN (1, 4)",
    )
    .await;
    for q in [
        "SELECT sum(balance)::int8 FROM accounts",
        "SELECT sum(a.balance)::int8 FROM accounts a JOIN accounts b ON a.id = b.id",
    ] {
        let total: i64 = sqlx::query_scalar(q)
            .fetch_one(&mut east)
            .await
            .unwrap_or_else(|e| panic!("{q}: {e}"));
        assert_eq!(total, 5003 - 20, "{q}");
    }
    exec(&mut east, "ROLLBACK").await;

    let b = balances_converged(&nodes).await;
    assert_eq!(
        b.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
        vec![(1, 1000), (2, 1001), (3, 1001), (4, 1000), (6, 1001)],
        "{b:?}"
    );
    no_prepared_transactions(&nodes).await;

    // A computed region column: the city fixes the partition.
    sqlx::query("SELECT multiregion.execute($1)")
        .bind(
            "CREATE TABLE riders (id int, city text NOT NULL, fare int NOT NULL DEFAULT 0, \
             region crdb_internal_region NOT NULL AS (CASE WHEN city = 'new york' THEN 'us-east1' \
             WHEN city = 'seattle' THEN 'us-west1' ELSE 'europe-west1' END) STORED, \
             PRIMARY KEY (city, id)) LOCALITY REGIONAL BY ROW AS region",
        )
        .execute(&mut east)
        .await
        .unwrap();
    for (c, city) in [
        (&mut east, "new york"),
        (&mut west, "seattle"),
        (&mut eu, "paris"),
    ] {
        let insert = format!("INSERT INTO riders (id, city) VALUES (1, '{city}')");
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(e) = sqlx::raw_sql(&insert).execute(&mut *c).await {
            assert!(Instant::now() < deadline, "{insert}: {e}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    exec(&mut east, "BEGIN ISOLATION LEVEL SERIALIZABLE").await;
    let fare: i32 = sqlx::query_scalar(
        "UPDATE riders SET fare = fare + 7 WHERE city = 'seattle' AND id = 1 RETURNING fare",
    )
    .fetch_one(&mut east)
    .await
    .unwrap();
    assert_eq!(fare, 7);
    let read: i32 = sqlx::query_scalar("SELECT fare FROM riders WHERE city = $1 AND id = $2")
        .bind("seattle")
        .bind(1)
        .fetch_one(&mut east)
        .await
        .unwrap();
    assert_eq!(read, 7);
    exec(&mut east, "COMMIT").await;
    for n in &nodes {
        eventually(
            "the fare on every node",
            Duration::from_secs(30),
            || async {
                let mut c = connect(n, "mr").await?;
                let f: i32 = sqlx::query_scalar(
                    "SELECT fare FROM riders WHERE region = 'us-west1' AND id = 1",
                )
                .fetch_one(&mut c)
                .await
                .ok()?;
                (f == 7).then_some(())
            },
        )
        .await;
    }

    // Reads. With PLACEMENT RESTRICTED a partition has no replica outside its region, so the
    // us-west1 node holds none of the others: a scan of the table runs on each leaseholder
    // over its own partitions (also with FOR UPDATE, locking there); what needs every
    // partition's rows in one place (an aggregate) is refused with a hint.
    exec(
        &mut east,
        r#"SELECT multiregion.execute('ALTER DATABASE mr PLACEMENT RESTRICTED')"#,
    )
    .await;
    eventually(
        "the us-west1 node without the other partitions",
        Duration::from_secs(60),
        || async {
            let mut w = connect(&nodes[1], "mr").await?;
            let held: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM multiregion.ranges WHERE database_name = 'mr' \
                 AND table_name = 'accounts' AND partition IS NOT NULL \
                 AND 2 = ANY (voting_replicas || non_voting_replicas)",
            )
            .fetch_one(&mut w)
            .await
            .ok()?;
            (held == 1).then_some(())
        },
    )
    .await;
    // No node holds every partition: an aggregate, a grouping, an ordered LIMIT and a join
    // read the partitions through their leaseholders and finish here.
    let total: i64 = sqlx::query_scalar("SELECT sum(balance)::int8 FROM accounts")
        .fetch_one(&mut west)
        .await
        .unwrap();
    assert_eq!(total, 5003);
    let per_region: Vec<(String, i64)> = sqlx::query_as(
        "SELECT crdb_region::text, count(*) FROM accounts WHERE balance > $1 GROUP BY 1 ORDER BY 1",
    )
    .bind(999i64)
    .fetch_all(&mut west)
    .await
    .unwrap();
    assert_eq!(
        per_region,
        vec![
            ("europe-west1".to_string(), 1),
            ("us-east1".to_string(), 2),
            ("us-west1".to_string(), 2)
        ]
    );
    let top: Vec<i32> = sqlx::query_scalar(
        "SELECT a.id FROM accounts a JOIN accounts b ON b.id = a.id + 1 ORDER BY a.balance DESC, a.id LIMIT 2",
    )
    .fetch_all(&mut west)
    .await
    .unwrap();
    assert_eq!(top, vec![2, 3]);
    // The leaseholders send only the rows the query's own filter keeps and the columns it
    // reads — but a filter over the nullable side of an outer join stays here (sent to the
    // leaseholders, `a.id IS NULL` would keep no account, and every id would look missing).
    let rich: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM accounts WHERE balance > 1000 AND note = '' AND random() >= 0",
    )
    .fetch_one(&mut west)
    .await
    .unwrap();
    assert_eq!(rich, 3);
    // Whatever is pushed, the answer is the one whole tables give: each read, with the
    // filter and columns sent and with every row and column sent, agrees.
    for q in [
        "SELECT id FROM accounts WHERE balance >= 1001",
        "SELECT id FROM accounts WHERE note = '' AND id % 2 = 0",
        "SELECT count(*) FROM accounts WHERE crdb_region = 'us-east1' OR balance > 1000",
        "SELECT g, a.id FROM generate_series(1, 7) g LEFT JOIN accounts a ON a.id = g AND a.balance > 1000",
        "SELECT g FROM generate_series(1, 7) g WHERE EXISTS (SELECT 1 FROM accounts a WHERE a.id = g AND a.balance > 1000)",
        "SELECT a.id, b.id FROM accounts a, accounts b WHERE a.id = b.id - 1 AND a.balance > 1000",
        "SELECT g, a.id FROM accounts a RIGHT JOIN generate_series(1, 7) g ON a.id = g WHERE a.balance IS NULL",
        "SELECT g, a.id FROM accounts a FULL JOIN generate_series(3, 9) g ON a.id = g WHERE a.id > 3 OR g > 6",
        "SELECT crdb_region, max(balance) FROM accounts WHERE balance BETWEEN 999 AND 1001 GROUP BY 1",
        "SELECT id FROM accounts WHERE lower(note) = '' AND note LIKE '%'",
        "SELECT count(*) FROM (SELECT * FROM accounts WHERE balance > 1000) s WHERE s.id > 2",
        "WITH r AS (SELECT id FROM accounts WHERE balance = 1001) SELECT count(*) FROM r",
        "SELECT a FROM accounts a WHERE a.id < 4",
    ] {
        let mut answers = Vec::new();
        for pushdown in ["on", "off"] {
            exec(&mut west, &format!("SET multiregion.gather_pushdown = {pushdown}")).await;
            let all: String = sqlx::query_scalar(&format!(
                "SELECT coalesce(string_agg(x::text, ';' ORDER BY x::text), '') FROM ({q}) x"
            ))
            .fetch_one(&mut west)
            .await
            .unwrap_or_else(|e| panic!("{q} (pushdown {pushdown}): {e}"));
            answers.push(all);
        }
        assert_eq!(answers[0], answers[1], "{q}");
        assert!(!answers[0].is_empty(), "{q}");
    }
    exec(&mut west, "RESET multiregion.gather_pushdown").await;
    // Aggregates over one table are computed at the leaseholders and combined here: the
    // same answers as over the rows sent here (nested in expressions, filtered, grouped,
    // with HAVING, over no rows), and the plan asks for partial results, not rows.
    for q in [
        "SELECT count(*) || ',' || sum(balance) || ',' || min(note) || ',' || max(id) FROM accounts",
        "SELECT crdb_region || ':' || count(*) || ':' || sum(balance) FROM accounts \
         WHERE balance > 999 GROUP BY crdb_region ORDER BY crdb_region",
        "SELECT note || ':' || count(*) FILTER (WHERE id > 2) || ':' || max(balance) FROM accounts \
         GROUP BY note HAVING count(*) > 1 ORDER BY 1",
        "SELECT coalesce(sum(balance), -1) || ',' || count(*) || ',' || coalesce(max(note), '-') \
         FROM accounts WHERE id < 0",
        "SELECT bool_and(balance > 0) || ',' || count(id) || ',' || avg(balance)::int8 FROM accounts",
        "SELECT (id % 2) || ':' || count(*) FROM accounts GROUP BY id % 2 ORDER BY 1",
        // avg as a sum and a count at each leaseholder, divided here: the same digits.
        "SELECT avg(balance) || ',' || avg(id) FILTER (WHERE id > 2) || ',' || \
         coalesce(avg(balance) FILTER (WHERE id < 0)::text, 'none') || ',' || \
         avg(balance::float8) || ',' || avg(balance::numeric / 3) FROM accounts",
        "SELECT crdb_region || ':' || avg(balance) || ':' || count(*) FROM accounts \
         GROUP BY crdb_region HAVING avg(balance) > 0 ORDER BY 1",
    ] {
        let mut answers = Vec::new();
        for partial in ["on", "off"] {
            exec(
                &mut west,
                &format!("SET multiregion.gather_partial_aggregates = {partial}"),
            )
            .await;
            let rows: Vec<String> = sqlx::query_scalar(q)
                .fetch_all(&mut west)
                .await
                .unwrap_or_else(|e| panic!("{q} (partial {partial}): {e}"));
            answers.push(rows);
        }
        assert_eq!(answers[0], answers[1], "{q}");
        assert!(!answers[0].is_empty(), "{q}");
    }
    exec(&mut west, "RESET multiregion.gather_partial_aggregates").await;
    let calls = "SELECT coalesce(pg_stat_get_xact_function_calls(\
         'multiregion.gather_partials(oid,int2[],pg_node_tree,pg_node_tree)'::regprocedure), 0), \
         coalesce(pg_stat_get_xact_function_calls(\
         'multiregion.gather_rows(oid,int2[],pg_node_tree)'::regprocedure), 0)";
    for (q, want) in [
        (
            "SELECT crdb_region, count(*) FROM accounts GROUP BY 1",
            (1, 0),
        ),
        ("SELECT avg(balance) FROM accounts", (1, 0)),
        // string_agg does not combine as itself or as a sum: the rows are gathered.
        ("SELECT string_agg(note, ',') FROM accounts", (0, 1)),
    ] {
        // The backend's counts not yet reported (they are reported when it is idle outside
        // a transaction): before and after, inside one.
        exec(&mut west, "BEGIN").await;
        exec(&mut west, "SET LOCAL track_functions = 'all'").await;
        let before: (i64, i64) = sqlx::query_as(calls).fetch_one(&mut west).await.unwrap();
        sqlx::raw_sql(q).execute(&mut west).await.unwrap();
        let after: (i64, i64) = sqlx::query_as(calls).fetch_one(&mut west).await.unwrap();
        exec(&mut west, "COMMIT").await;
        let got = (after.0 - before.0, after.1 - before.1);
        assert_eq!(got, want, "{q}: (gather_partials, gather_rows) calls");
    }
    // In one READ COMMITTED transaction, a read that left parts on other nodes (each
    // leaseholder's share of a split read) and a gathered read after it: the parts only
    // read, so the gathered read goes ahead (it was refused).
    exec(&mut west, "BEGIN").await;
    let ids: Vec<i32> = sqlx::query_scalar("SELECT id FROM accounts WHERE balance > 0")
        .fetch_all(&mut west)
        .await
        .unwrap();
    assert_eq!(ids.len(), 5);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM accounts WHERE id > 0")
        .fetch_one(&mut west)
        .await
        .unwrap();
    assert_eq!(n, 5);
    exec(&mut west, "COMMIT").await;
    // After a change on another node, a gathered read sees it: each table leased where
    // the transaction changed rows is read there (it was refused).
    let before: i64 = sqlx::query_scalar("SELECT sum(balance)::int8 FROM accounts")
        .fetch_one(&mut west)
        .await
        .unwrap();
    exec(&mut west, "BEGIN").await;
    exec(
        &mut west,
        "UPDATE accounts SET balance = balance + 7 WHERE id = 1",
    )
    .await;
    let (n, total): (i64, i64) =
        sqlx::query_as("SELECT count(*), sum(balance)::int8 FROM accounts")
            .fetch_one(&mut west)
            .await
            .unwrap();
    assert_eq!((n, total), (5, before + 7));
    exec(&mut west, "ROLLBACK").await;
    // A column of a NOT NULL domain is sent even when not read: left out, its NULL failed
    // the domain's check when the rows were turned back into the table's type.
    exec(
        &mut east,
        "CREATE DOMAIN positive AS int NOT NULL CHECK (VALUE > 0)",
    )
    .await;
    execute_all(
        &mut east,
        &["CREATE TABLE dom (id int PRIMARY KEY, p positive) LOCALITY REGIONAL BY ROW"],
    )
    .await;
    for (i, region) in REGIONS.iter().enumerate() {
        let mut c = connect(&nodes[i], "mr").await.unwrap();
        exec_once_settled(
            &mut c,
            &format!(
                "INSERT INTO dom (crdb_region, id, p) VALUES ('{region}', {}, 5)",
                i + 1
            ),
        )
        .await;
    }
    eventually(
        "the us-west1 node with dom's us-west1 partition alone",
        Duration::from_secs(60),
        || async {
            let mut w = connect(&nodes[1], "mr").await?;
            let (held, all): (i64, i64) = sqlx::query_as(
                "SELECT count(*) FILTER (WHERE 2 = ANY (voting_replicas || non_voting_replicas)), \
                 count(*) FROM multiregion.ranges WHERE database_name = 'mr' \
                 AND table_name = 'dom' AND partition IS NOT NULL",
            )
            .fetch_one(&mut w)
            .await
            .ok()?;
            (held == 1 && all == 3).then_some(())
        },
    )
    .await;
    let counted: i64 = sqlx::query_scalar("SELECT count(*) FROM dom WHERE id > 0")
        .fetch_one(&mut west)
        .await
        .unwrap();
    assert_eq!(counted, 3);
    // One INSERT with rows for every region, through the node that holds only its own
    // partition: the rows for the others are written at their leaseholders (it was refused:
    // the partitions its VALUES name were taken for partitions it reads).
    let mut ids: Vec<i32> = sqlx::query_scalar(
        "INSERT INTO dom (crdb_region, id, p) VALUES \
         ('us-east1', 11, 1), ('us-west1', 12, 2), ('europe-west1', 13, 3) RETURNING id",
    )
    .fetch_all(&mut west)
    .await
    .unwrap();
    ids.sort();
    assert_eq!(ids, vec![11, 12, 13]);
    // Upserts decided where the conflicting row is leased: 11 exists in us-east1.
    let ids: Vec<i32> = sqlx::query_scalar(
        "INSERT INTO dom (crdb_region, id, p) VALUES ('us-east1', 11, 9), ('europe-west1', 14, 4) \
         ON CONFLICT DO NOTHING RETURNING id",
    )
    .fetch_all(&mut west)
    .await
    .unwrap();
    assert_eq!(ids, vec![14]);
    // A duplicate key in another region's partition fails the whole statement: the new
    // us-west1 row is not kept either.
    let err = sqlx::raw_sql(
        "INSERT INTO dom (crdb_region, id, p) VALUES ('us-west1', 15, 5), ('europe-west1', 13, 3)",
    )
    .execute(&mut west)
    .await
    .expect_err("a duplicate key leased in europe-west1");
    assert_eq!(code(&err), "23505", "{err}");
    // INSERT … SELECT from a table whose other partitions are leased elsewhere: its rows are
    // gathered from their leaseholders, and the new rows go to theirs.
    let mut ids: Vec<i32> = sqlx::query_scalar(
        "INSERT INTO dom (crdb_region, id, p) \
         SELECT crdb_region, id + 100, 7 FROM accounts WHERE id IN (1, 3, 6) RETURNING id",
    )
    .fetch_all(&mut west)
    .await
    .unwrap();
    ids.sort();
    assert_eq!(ids, vec![101, 103, 106]);
    for (i, region) in REGIONS.iter().enumerate() {
        let mut c = connect(&nodes[i], "mr").await.unwrap();
        let mut here: Vec<(i32, i32)> = sqlx::query_as(&format!(
            "SELECT id, p::int FROM dom WHERE crdb_region = '{region}'"
        ))
        .fetch_all(&mut c)
        .await
        .unwrap();
        here.sort();
        let want = match *region {
            "us-east1" => vec![(1, 5), (11, 1), (101, 7)],
            "us-west1" => vec![(2, 5), (12, 2), (103, 7)],
            _ => vec![(3, 5), (13, 3), (14, 4), (106, 7)],
        };
        assert_eq!(here, want, "{region} at its leaseholder");
    }
    // A filter the planner proves false for every partition reads nothing, here: sent to
    // the leaseholders, it made a scan of no partition that asked to be gathered again,
    // without end (the backend's stack overflowed).
    let none: i64 = sqlx::query_scalar("SELECT count(*) FROM accounts WHERE id IS NULL")
        .fetch_one(&mut west)
        .await
        .unwrap();
    assert_eq!(none, 0);
    let none: Vec<(i32,)> =
        sqlx::query_as("SELECT id FROM accounts WHERE balance > 1 AND balance < 0")
            .fetch_all(&mut west)
            .await
            .unwrap();
    assert!(none.is_empty());
    let missing: Vec<i32> = sqlx::query_scalar(
        "SELECT g FROM generate_series(1, 7) g LEFT JOIN accounts a ON a.id = g \
         WHERE a.id IS NULL ORDER BY g",
    )
    .fetch_all(&mut west)
    .await
    .unwrap();
    assert_eq!(missing, vec![5, 7]);
    // A role that may read two columns gets its aggregate: only those columns are asked for
    // (the whole rows were, and the leaseholders refused them: 42501).
    exec(&mut east, "CREATE ROLE teller").await;
    exec(
        &mut east,
        "GRANT SELECT (id, balance) ON accounts TO teller",
    )
    .await;
    let teller_sum = eventually(
        "the teller's grant on the us-west1 node",
        Duration::from_secs(30),
        || async {
            let mut w = connect(&nodes[1], "mr").await?;
            sqlx::raw_sql("SET ROLE teller")
                .execute(&mut w)
                .await
                .ok()?;
            sqlx::query_scalar::<_, i64>("SELECT sum(balance)::int8 FROM accounts WHERE id < 6")
                .fetch_one(&mut w)
                .await
                .map_err(|e| eprintln!("teller: {e}"))
                .ok()
        },
    )
    .await;
    assert_eq!(teller_sum, 4002);
    // Gathered reads are READ COMMITTED's (each leaseholder reads with its own snapshot): a
    // REPEATABLE READ one is refused, with the ways round a read has.
    exec(&mut west, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY").await;
    let err = sqlx::query_scalar::<_, i64>("SELECT sum(balance)::int8 FROM accounts")
        .fetch_one(&mut west)
        .await
        .expect_err("one snapshot over partitions no node holds together");
    assert_eq!(code(&err), "0A000", "{err}");
    let said = hint(&err);
    assert!(said.contains("READ COMMITTED"), "{said}");
    exec(&mut west, "ROLLBACK").await;
    // A statement whose text is not its query's alone (EXPLAIN ANALYZE) is not re-planned:
    // refused as before, not re-planned again and again.
    let err = sqlx::raw_sql("EXPLAIN ANALYZE SELECT sum(balance) FROM accounts")
        .execute(&mut west)
        .await
        .expect_err("EXPLAIN ANALYZE of a read no node holds");
    assert_eq!(code(&err), "0A000", "{err}");
    // CREATE TABLE AS, SELECT INTO and COPY (query) TO send their query, not their own text
    // (each leaseholder refused that, then this node did): a plain scan split over the
    // leaseholders, an aggregate gathered. The new tables are replicated as any.
    exec(
        &mut west,
        "CREATE TABLE acc_copy AS SELECT id, balance FROM accounts WHERE balance > 1000",
    )
    .await;
    exec(
        &mut west,
        "SELECT sum(balance) AS total INTO acc_total FROM accounts",
    )
    .await;
    let mut out = Vec::new();
    let mut copy = west
        .copy_out_raw("COPY (SELECT id, balance FROM accounts ORDER BY id) TO STDOUT (FORMAT csv)")
        .await
        .unwrap();
    while let Some(chunk) = futures::StreamExt::next(&mut copy).await {
        out.extend_from_slice(&chunk.unwrap());
    }
    drop(copy);
    assert_eq!(
        String::from_utf8(out).unwrap(),
        "1,1000\n2,1001\n3,1001\n4,1000\n6,1001\n"
    );
    for (i, n) in nodes.iter().enumerate() {
        let copied = eventually(
            "acc_copy and acc_total everywhere",
            Duration::from_secs(30),
            || async {
                let mut c = connect(n, "mr").await?;
                let copied: (i64, i64) = sqlx::query_as(
                    "SELECT (SELECT count(*) FROM acc_copy), (SELECT total::int8 FROM acc_total)",
                )
                .fetch_one(&mut c)
                .await
                .ok()?;
                (copied.0 == 3).then_some(copied)
            },
        )
        .await;
        assert_eq!(copied, (3, 5003), "node {}", i + 1);
    }
    // A WITH whose statement is an INSERT INTO is sent as written (no SELECT INTO to cut).
    let n = sqlx::raw_sql(
        "WITH v AS (SELECT 7 AS id) INSERT INTO accounts (id, balance, crdb_region) SELECT id, 1000, 'us-east1' FROM v",
    )
    .execute(&mut west)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 1);
    let n = sqlx::raw_sql(
        "WITH v AS (SELECT 7 AS id) DELETE FROM accounts WHERE crdb_region = 'us-east1' AND id IN (SELECT id FROM v)",
    )
    .execute(&mut west)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 1);
    // EXPLAIN ANALYZE's text is not its query's: still refused, not sent.
    let mut rows: Vec<(i32, i64)> = sqlx::query_as("SELECT id, balance FROM accounts")
        .fetch_all(&mut west)
        .await
        .unwrap();
    rows.sort();
    assert_eq!(
        rows,
        vec![(1, 1000), (2, 1001), (3, 1001), (4, 1000), (6, 1001)]
    );
    let by_id: (i32, i64) = sqlx::query_as("SELECT id, balance FROM accounts WHERE id = $1")
        .bind(6)
        .fetch_one(&mut west)
        .await
        .unwrap();
    assert_eq!(by_id, (6, 1001));
    exec(&mut west, "BEGIN").await;
    let locked: Vec<(i32,)> =
        sqlx::query_as("SELECT id FROM accounts WHERE balance > 1000 FOR UPDATE")
            .fetch_all(&mut west)
            .await
            .unwrap();
    assert_eq!(locked.len(), 3, "{locked:?}");
    // Held at the leaseholder: a write there waits, then gives up.
    exec(&mut eu, "SET lock_timeout = '300ms'").await;
    let err = sqlx::raw_sql(
        "UPDATE accounts SET balance = 0 WHERE crdb_region = 'europe-west1' AND id = 6",
    )
    .execute(&mut eu)
    .await
    .unwrap_err();
    assert_eq!(code(&err), "55P03", "{err}");
    exec(&mut west, "ROLLBACK").await;
    no_prepared_transactions(&nodes).await;
    check_consistency(&nodes[0]);
}

/// `query`, prepared on `west` (the us-west1 node) with the region as `$1`, under the
/// session's plan cache mode: run for the partition leased there, it locks its `per` rows;
/// for us-east1's, leased on node 1, it is refused (0A000).
async fn locks_here_and_refused_elsewhere(west: &mut PgConnection, query: &str, per: i32) {
    exec(
        west,
        &format!("PREPARE lock_region(crdb_internal_region) AS {query}"),
    )
    .await;
    let here: Vec<(i32,)> = sqlx::query_as("EXECUTE lock_region('us-west1')")
        .fetch_all(&mut *west)
        .await
        .unwrap();
    assert_eq!(here.len(), per as usize, "{query}: {here:?}");
    let err = sqlx::raw_sql("EXECUTE lock_region('us-east1')")
        .execute(&mut *west)
        .await
        .expect_err("locking rows leased on node 1");
    assert_eq!(code(&err), "0A000", "{query}: {err}");
    exec(west, "DEALLOCATE lock_region").await;
}

/// An UPDATE or DELETE of a REGIONAL BY ROW table over several leaseholders that also reads
/// other tables (a subquery, `FROM`, `USING`, its own table again) runs on each leaseholder
/// over its partitions, the other tables read from that node's copies after a read barrier
/// there: through the us-west1 node, with `flags` leased in us-east1 and written through the
/// europe-west1 node just before (each round's flag must be seen by every share), and a
/// GLOBAL `kinds`. A transaction whose uncommitted changes a share's node would not see is
/// refused (0A000), as is a share on a node without a copy of what it reads (PLACEMENT
/// RESTRICTED); a locking subquery is not split. Before, every such statement was refused at
/// commit ("this node is not the leaseholder").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_over_several_leaseholders_that_reads_other_tables_runs_on_each_leaseholder() {
    let dir = scratch("data-split-reads");
    let nodes = start_cluster(dir.path(), 76, WAN, &[EAST_B, WEST_A, EU_B]).await;
    const PER: i32 = 2;
    regional_bank(&nodes, PER).await;
    let mut east = connect(&nodes[0], "mr").await.unwrap();
    let mut west = connect(&nodes[1], "mr").await.unwrap();
    let mut eu = connect(&nodes[2], "mr").await.unwrap();
    execute_all(
        &mut east,
        &[
            "CREATE TABLE flags (id int PRIMARY KEY, flagged bool NOT NULL DEFAULT false)",
            "CREATE TABLE kinds (id int PRIMARY KEY, bonus int NOT NULL) LOCALITY GLOBAL",
            r#"CREATE TABLE limits (id int PRIMARY KEY) LOCALITY REGIONAL BY TABLE IN "us-west1""#,
        ],
    )
    .await;
    exec_once_settled(
        &mut eu,
        "INSERT INTO flags SELECT g FROM generate_series(1, 6) g",
    )
    .await;
    exec_once_settled(&mut east, "INSERT INTO kinds VALUES (0, 10), (1, 20)").await;
    // Every node holds a copy of every range before the statements below need one.
    balances_converged(&nodes).await;

    // A subquery: each round flags one more account through the europe-west1 node and at
    // once updates the flagged accounts through the us-west1 node. Each share reads `flags`
    // where it runs (us-east1, us-west1, europe-west1), after its barrier: every round sees
    // its own flag and all earlier ones.
    for (round, id) in [1, 4, 6, 3].into_iter().enumerate() {
        exec_once_settled(
            &mut eu,
            &format!("UPDATE flags SET flagged = true WHERE id = {id}"),
        )
        .await;
        let mut rows: Vec<(i32, String)> = sqlx::query_as(
            "UPDATE accounts SET note = note || 'f' WHERE id IN (SELECT id FROM flags WHERE flagged) RETURNING id, note",
        )
        .fetch_all(&mut west)
        .await
        .unwrap_or_else(|e| panic!("round {round}: {e}"));
        rows.sort();
        assert_eq!(rows.len(), round + 1, "round {round}: {rows:?}");
        assert!(
            rows.iter().any(|(i, _)| *i == id),
            "round {round}: {rows:?}"
        );
    }
    // FROM a GLOBAL table, and the table itself read again.
    let n = sqlx::raw_sql(
        "UPDATE accounts a SET balance = a.balance + k.bonus FROM kinds k WHERE k.id = a.id % 2",
    )
    .execute(&mut west)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 6);
    let n = sqlx::raw_sql(
        "UPDATE accounts SET balance = balance + 1 WHERE balance < (SELECT max(balance) FROM accounts)",
    )
    .execute(&mut west)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 3, "the even accounts (1010) below the odd ones (1020)");
    // DELETE … USING.
    let n = sqlx::raw_sql(
        "DELETE FROM accounts a USING flags f WHERE f.id = a.id AND NOT f.flagged AND a.id <> 2",
    )
    .execute(&mut west)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 1, "account 5");

    // A transaction that changed `flags` at its leaseholder (node 1): the us-west1 and
    // europe-west1 shares would read copies without that change.
    exec(&mut west, "BEGIN").await;
    exec(&mut west, "UPDATE flags SET flagged = false WHERE id = 1").await;
    let err = sqlx::raw_sql(
        "UPDATE accounts SET balance = 0 WHERE id IN (SELECT id FROM flags WHERE flagged)",
    )
    .execute(&mut west)
    .await
    .expect_err("a share would miss the transaction's change to flags");
    assert_eq!(code(&err), "0A000", "{err}");
    assert!(
        err.to_string().contains("uncommitted changes on node 1"),
        "{err}"
    );
    exec(&mut west, "ROLLBACK").await;
    // Changed here, where `limits` is leased: the other nodes' shares would miss it.
    exec(&mut west, "BEGIN").await;
    exec(&mut west, "INSERT INTO limits VALUES (1), (6)").await;
    let err = sqlx::raw_sql("UPDATE accounts SET balance = 0 WHERE id IN (SELECT id FROM limits)")
        .execute(&mut west)
        .await
        .expect_err("a share would miss the transaction's rows in limits");
    assert_eq!(code(&err), "0A000", "{err}");
    exec(&mut west, "ROLLBACK").await;
    // Committed first, the same statement runs.
    exec_once_settled(&mut west, "INSERT INTO limits VALUES (1), (6)").await;
    let n =
        sqlx::raw_sql("UPDATE accounts SET note = note || 'l' WHERE id IN (SELECT id FROM limits)")
            .execute(&mut west)
            .await
            .unwrap()
            .rows_affected();
    assert_eq!(n, 2);
    // A subquery that locks rows of another table is not split: its locks would be taken on
    // copies. It fails as a whole, changing nothing.
    let err = sqlx::raw_sql(
        "UPDATE accounts SET balance = 0 WHERE id IN (SELECT id FROM flags WHERE flagged FOR UPDATE)",
    )
    .execute(&mut west)
    .await
    .expect_err("a locking subquery over several leaseholders");
    assert_eq!(code(&err), "0A000", "{err}");
    assert!(
        err.to_string()
            .contains("its locks would be taken on this node's copy"),
        "{err}"
    );
    assert!(
        hint(&err).contains("statement of their own"),
        "{}",
        hint(&err)
    );
    // Nor a locking read that joins a table leased elsewhere: run here, it would lock the
    // copy of `flags`, conflicting with nothing on node 1 (before, it did).
    let err = sqlx::raw_sql(
        "SELECT a.id FROM accounts a JOIN flags f USING (id) WHERE a.crdb_region = 'us-west1' FOR UPDATE",
    )
    .execute(&mut west)
    .await
    .expect_err("a lock on rows leased on node 1, taken on node 2's copy");
    assert_eq!(code(&err), "0A000", "{err}");
    assert!(hint(&err).contains("FOR UPDATE OF"), "{}", hint(&err));
    // Locking only the rows leased here, it runs here.
    let locked: Vec<(i32,)> = sqlx::query_as(
        "SELECT a.id FROM accounts a JOIN flags f USING (id) WHERE a.crdb_region = 'us-west1' ORDER BY a.id FOR UPDATE OF a",
    )
    .fetch_all(&mut west)
    .await
    .unwrap();
    assert_eq!(locked.len(), PER as usize, "{locked:?}");
    // A generic plan names every partition, and the executor prunes them by the value it
    // runs with: what it still scans counts. Locking the rows leased here runs; locking
    // those leased on node 1 is refused.
    exec(&mut west, "SET plan_cache_mode = force_generic_plan").await;
    locks_here_and_refused_elsewhere(
        &mut west,
        "SELECT a.id FROM accounts a JOIN flags f USING (id) WHERE a.crdb_region = $1 \
         ORDER BY a.id FOR UPDATE OF a",
        PER,
    )
    .await;
    // The table joined again, unlocked: its scans of the partitions leased on node 1 take no
    // lock, and the statement runs (before, locks were judged by relation: refused).
    locks_here_and_refused_elsewhere(
        &mut west,
        "SELECT x.id FROM accounts x JOIN accounts y USING (id) WHERE x.crdb_region = $1 \
         ORDER BY x.id FOR UPDATE OF x",
        PER,
    )
    .await;
    exec(&mut west, "RESET plan_cache_mode").await;
    // A trigger's statement inside one served for another node's transaction is not routed:
    // locking `flags` (leased on node 1) there would lock node 2's copy (before, it did).
    exec(
        &mut east,
        "CREATE FUNCTION lock_flag() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN EXECUTE format('SELECT 1 FROM flags WHERE id = %s FOR UPDATE', NEW.id); \
         RETURN NEW; END $$",
    )
    .await;
    exec(
        &mut east,
        "CREATE TRIGGER lock_flag BEFORE UPDATE ON accounts FOR EACH ROW EXECUTE FUNCTION lock_flag()",
    )
    .await;
    let touch = "UPDATE accounts SET note = note WHERE crdb_region = 'us-west1' AND id = 3";
    let err = sqlx::raw_sql(touch)
        .execute(&mut east)
        .await
        .expect_err("served on node 2, its trigger locks rows leased on node 1");
    assert_eq!(code(&err), "0A000", "{err}");
    assert!(
        err.to_string().contains("a trigger's or a function's"),
        "{err}"
    );
    // Through node 2 itself the trigger's statement is routed, and locks at node 1.
    let n = sqlx::raw_sql(touch)
        .execute(&mut west)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(n, 1);
    exec(&mut east, "DROP TRIGGER lock_flag ON accounts").await;
    // A served TRUNCATE starts no executor of its own: its trigger's statements are the
    // nested ones (`limits` is leased on node 2).
    exec(
        &mut east,
        "CREATE TRIGGER lock_flag BEFORE TRUNCATE ON limits EXECUTE FUNCTION lock_flag()",
    )
    .await;
    exec(
        &mut east,
        "CREATE OR REPLACE FUNCTION lock_flag() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN EXECUTE 'SELECT 1 FROM flags WHERE id = 1 FOR UPDATE'; RETURN NULL; END $$",
    )
    .await;
    let err = sqlx::raw_sql("TRUNCATE limits")
        .execute(&mut east)
        .await
        .expect_err("served on node 2, its trigger locks rows leased on node 1");
    assert_eq!(code(&err), "0A000", "{err}");
    assert!(
        err.to_string().contains("a trigger's or a function's"),
        "{err}"
    );
    exec(&mut east, "DROP TRIGGER lock_flag ON limits").await;
    // Nor one fired by the rows an `ON DELETE CASCADE` deletes there: it runs while the
    // referential trigger does, but it is not that trigger's query (before, it was exempt
    // as if it were, and locked node 2's copy of `flags`). An error caught before it leaves
    // it as deeply nested as it was (the nesting counted too low after a caught error, and
    // a function's statement then passed for the trigger's query).
    execute_all(
        &mut east,
        &[
            r#"CREATE TABLE pets (id int PRIMARY KEY, home int NOT NULL REFERENCES limits ON DELETE CASCADE) LOCALITY REGIONAL BY TABLE IN "us-west1""#,
        ],
    )
    .await;
    exec_once_settled(&mut west, "INSERT INTO limits VALUES (7)").await;
    exec_once_settled(&mut west, "INSERT INTO pets VALUES (1, 7)").await;
    exec(
        &mut east,
        "CREATE FUNCTION lock_one_flag() RETURNS int LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM 1 FROM flags WHERE id = 1 FOR UPDATE; RETURN 1; END $$",
    )
    .await;
    exec(
        &mut east,
        "CREATE OR REPLACE FUNCTION lock_flag() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN BEGIN PERFORM 1 / 0; EXCEPTION WHEN division_by_zero THEN NULL; END; \
         EXECUTE 'SELECT lock_one_flag()'; RETURN OLD; END $$",
    )
    .await;
    exec(
        &mut east,
        "CREATE TRIGGER lock_flag BEFORE DELETE ON pets FOR EACH ROW EXECUTE FUNCTION lock_flag()",
    )
    .await;
    let err = sqlx::raw_sql("DELETE FROM limits WHERE id = 7")
        .execute(&mut east)
        .await
        .expect_err("served on node 2, a trigger its cascade fires locks rows leased on node 1");
    assert_eq!(code(&err), "0A000", "{err}");
    assert!(
        err.to_string().contains("a trigger's or a function's"),
        "{err}"
    );
    // Without the lock the cascade runs there as before.
    exec(&mut east, "DROP TRIGGER lock_flag ON pets").await;
    exec(&mut east, "DELETE FROM limits WHERE id = 7").await;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pets")
        .fetch_one(&mut west)
        .await
        .unwrap();
    assert_eq!(left, 0);
    exec(&mut east, "DROP FUNCTION lock_flag()").await;
    exec(&mut east, "DROP FUNCTION lock_one_flag()").await;

    let b = balances_converged(&nodes).await;
    assert_eq!(
        b.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
        vec![(1, 1020), (2, 1011), (3, 1020), (4, 1011), (6, 1011)],
        "{b:?}"
    );
    let notes: Vec<(i32, String)> = sqlx::query_as("SELECT id, note FROM accounts ORDER BY id")
        .fetch_all(&mut eu)
        .await
        .unwrap();
    assert_eq!(
        notes,
        vec![
            (1, "ffffl".to_string()),
            (2, String::new()),
            (3, "f".to_string()),
            (4, "fff".to_string()),
            (6, "ffl".to_string()),
        ]
    );

    // PLACEMENT RESTRICTED: `flags` has no replica outside us-east1, so the other shares
    // cannot read it, and the statement is refused up front; `kinds`, GLOBAL, is everywhere.
    exec(
        &mut east,
        r#"SELECT multiregion.execute('ALTER DATABASE mr PLACEMENT RESTRICTED')"#,
    )
    .await;
    eventually(
        "flags only in us-east1",
        Duration::from_secs(60),
        || async {
            let mut w = connect(&nodes[1], "mr").await?;
            let held: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM multiregion.ranges WHERE database_name = 'mr' \
                 AND table_name IN ('flags', 'accounts') \
                 AND 2 = ANY (voting_replicas || non_voting_replicas)",
            )
            .fetch_one(&mut w)
            .await
            .ok()?;
            (held == 1).then_some(())
        },
    )
    .await;
    let err = sqlx::raw_sql(
        "UPDATE accounts SET balance = 0 WHERE id IN (SELECT id FROM flags WHERE flagged)",
    )
    .execute(&mut west)
    .await
    .expect_err("shares on nodes without a copy of flags");
    assert_eq!(code(&err), "0A000", "{err}");
    assert!(
        err.to_string().contains("holds no replica of range"),
        "{err}"
    );
    assert!(hint(&err).contains("separate statement"), "{}", hint(&err));
    let n = sqlx::raw_sql(
        "UPDATE accounts a SET balance = a.balance - k.bonus FROM kinds k WHERE k.id = a.id % 2",
    )
    .execute(&mut west)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 5);
    for n in &nodes {
        let total = eventually(
            "the total on every node",
            Duration::from_secs(30),
            || async {
                let mut c = connect(n, "mr").await?;
                sqlx::query_scalar::<_, i64>(
                    "SELECT sum(balance)::int8 FROM accounts WHERE crdb_region = 'us-west1'",
                )
                .fetch_one(&mut c)
                .await
                .ok()
                .filter(|&t| t == 1000 + 1001)
            },
        )
        .await;
        assert_eq!(total, 2001);
    }
    no_prepared_transactions(&nodes).await;
    check_consistency(&nodes[0]);
}

/// Under REPEATABLE READ and SERIALIZABLE a read-write transaction's statements run where the
/// rows they touch are leased, and a transaction with parts on several nodes holds each
/// node's turn until it commits there (ARCHITECTURE.md §8.5, "Isolation"): PostgreSQL sees a
/// snapshot and serializable conflicts only on its own node, so without the turns a write
/// skew whose two edges are on different nodes commits on both sides. Here it cannot: the
/// skew run one after the other and run at once commits at most one side (40001 for the
/// other), and withdrawals that each read two regions' accounts never overdraw their sum,
/// through every node at once. A transfer between regions, a REPEATABLE READ transaction
/// over two leaseholders and a rollback to a savepoint that undid a turn commit. One
/// statement over several leaseholders reads or writes each through its leaseholder (the
/// skew over an aggregate of both accounts commits one side only); a split write whose
/// shares would read copies is refused (0A000).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serializable_transactions_over_several_leaseholders_commit_no_write_skew() {
    let dir = scratch("data-serializable");
    let nodes = start_cluster(dir.path(), 72, WAN, &[EAST_B, WEST_A, EU_B]).await;
    // Account 1 in us-east1 (leased on node 1), 2 in us-west1 (node 2), 3 in europe-west1.
    regional_bank(&nodes, 1).await;
    balances_converged(&nodes).await;
    let mut east = connect(&nodes[0], "mr").await.unwrap();
    let mut west = connect(&nodes[1], "mr").await.unwrap();
    let mut eu = connect(&nodes[2], "mr").await.unwrap();
    let read_own = |region: &str, id: i32| {
        format!("SELECT balance FROM accounts WHERE crdb_region = '{region}' AND id = {id}")
    };
    let take_other = |region: &str, id: i32, amount: i64| {
        format!(
            "UPDATE accounts SET balance = balance - {amount} WHERE crdb_region = '{region}' AND id = {id}"
        )
    };

    // Each reads its own region's account and takes that much from the other's: run one
    // after the other, the second would read what the first left (1000, 0 or 0, 1000).
    // East's commits first; west's snapshot on node 2 predates it, so west's turn there
    // finds a transaction over several nodes committed since: 40001.
    let (x, y) = begin_skew(&mut east, &mut west).await;
    assert_eq!((x, y), (1000, 1000));
    sqlx::raw_sql(&format!("{}; COMMIT", take_other("us-west1", 2, x)))
        .execute(&mut east)
        .await
        .expect("the first side of the skew commits");
    let err = sqlx::raw_sql(&format!("{}; COMMIT", take_other("us-east1", 1, y)))
        .execute(&mut west)
        .await
        .expect_err("both sides of a write skew over two nodes committed");
    assert_eq!(code(&err), "40001", "{err}");
    assert!(
        err.to_string()
            .contains("another transaction over several nodes committed on this node"),
        "{err}"
    );
    exec(&mut west, "ROLLBACK").await;
    let b = balances_converged(&nodes).await;
    assert_eq!((b[0].2, b[1].2), (1000, 0), "{b:?}");

    // The same skew with both sides at once: at most one commits.
    reset_two_accounts(&mut east).await;
    for _ in 0..3 {
        let (x, y) = begin_skew(&mut east, &mut west).await;
        let e_sql = format!("{}; COMMIT", take_other("us-west1", 2, x));
        let w_sql = format!("{}; COMMIT", take_other("us-east1", 1, y));
        let (te, tw) = tokio::join!(
            sqlx::raw_sql(&e_sql).execute(&mut east),
            sqlx::raw_sql(&w_sql).execute(&mut west)
        );
        let codes: Vec<String> = [te.as_ref().err(), tw.as_ref().err()]
            .into_iter()
            .flatten()
            .map(code)
            .collect();
        assert!(
            !codes.is_empty(),
            "both sides of a concurrent write skew committed"
        );
        assert!(
            codes.iter().all(|c| c == "40001" || c == "55P03"),
            "{te:?} {tw:?}"
        );
        for c in [&mut east, &mut west] {
            let _ = sqlx::raw_sql("ROLLBACK").execute(c).await;
        }
        let b = balances_converged(&nodes).await;
        assert!(
            matches!((b[0].2, b[1].2), (1000, 0) | (0, 1000) | (1000, 1000)),
            "not a serial outcome: {b:?}"
        );
        reset_two_accounts(&mut east).await;
    }

    // Withdrawals through every node at once, each reading both accounts (two leaseholders)
    // and taking 300 from one only if their sum covers it: serializable, the sum never goes
    // below zero, and each withdrawal that committed took exactly 300.
    let mut workers = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let mut c = connect(node, "mr").await.unwrap();
        let (region, id) = if i % 2 == 0 {
            ("us-east1", 1)
        } else {
            ("us-west1", 2)
        };
        let take = take_other(region, id, 300);
        workers.push(tokio::spawn(async move {
            let mut committed = 0i64;
            for _ in 0..40 {
                let attempt = withdraw_if_covered(&mut c, &take).await;
                match attempt {
                    Ok(Some(())) => committed += 1,
                    Ok(None) => break,
                    Err(e) => {
                        let c2 = code(&e);
                        assert!(c2 == "40001" || c2 == "55P03", "{e}");
                        let _ = sqlx::query("ROLLBACK").execute(&mut c).await;
                    }
                }
            }
            committed
        }));
    }
    let mut committed = 0;
    for w in workers {
        committed += w.await.unwrap();
    }
    let b = balances_converged(&nodes).await;
    let sum = b[0].2 + b[1].2;
    assert!((0..300).contains(&sum), "withdrawals overdrew: {b:?}");
    assert_eq!(2000 - 300 * committed, sum, "{b:?}");
    reset_two_accounts(&mut east).await;

    // A transfer between two regions through the third, SERIALIZABLE; a REPEATABLE READ one
    // that reads one leaseholder's rows after writing another's.
    exec(&mut eu, "BEGIN ISOLATION LEVEL SERIALIZABLE").await;
    exec(&mut eu, &take_other("us-east1", 1, 100)).await;
    exec(&mut eu, &take_other("us-west1", 2, -100)).await;
    exec(&mut eu, "COMMIT").await;
    exec(&mut eu, "BEGIN ISOLATION LEVEL REPEATABLE READ").await;
    exec(&mut eu, &take_other("us-east1", 1, 0)).await;
    let b2: i64 = sqlx::query_scalar(&read_own("us-west1", 2))
        .fetch_one(&mut eu)
        .await
        .unwrap();
    assert_eq!(b2, 1100);
    exec(&mut eu, "COMMIT").await;
    // A rollback to a savepoint undoes the turns taken after it: taken again, it commits.
    exec(&mut west, "BEGIN ISOLATION LEVEL SERIALIZABLE").await;
    let _: i64 = sqlx::query_scalar(&read_own("us-west1", 2))
        .fetch_one(&mut west)
        .await
        .unwrap();
    exec(&mut west, "SAVEPOINT s").await;
    exec(&mut west, &take_other("us-east1", 1, 50)).await;
    exec(&mut west, "ROLLBACK TO SAVEPOINT s").await;
    exec(&mut west, &take_other("us-east1", 1, 1)).await;
    exec(&mut west, "COMMIT").await;
    // Or before the commit, which takes them again.
    exec(&mut west, "BEGIN ISOLATION LEVEL SERIALIZABLE").await;
    let _: i64 = sqlx::query_scalar(&read_own("us-west1", 2))
        .fetch_one(&mut west)
        .await
        .unwrap();
    exec(&mut west, "SAVEPOINT s").await;
    exec(&mut west, &take_other("us-east1", 1, 50)).await;
    exec(&mut west, "ROLLBACK TO SAVEPOINT s").await;
    exec(&mut west, "COMMIT").await;

    // One statement over several leaseholders reads each through its leaseholder, in the
    // transaction's session there (gathered, or split over the partitions), holding each
    // node's turn: the same skew with each side reading both accounts at once commits one
    // side only. A split write whose shares would read another table from their copies is
    // still refused (0A000).
    // East's read holds both nodes' turns; west's, begun before east commits, waits for
    // them and then finds east committed after its snapshot: 40001 (a read of the old sum
    // followed by a write would be the other side of a skew).
    let both = "SELECT sum(balance)::int8 FROM accounts WHERE id IN (1, 2)";
    exec(&mut east, "BEGIN ISOLATION LEVEL SERIALIZABLE").await;
    let se: i64 = sqlx::query_scalar(both).fetch_one(&mut east).await.unwrap();
    assert_eq!(se, 899 + 1100);
    exec(&mut west, "BEGIN ISOLATION LEVEL SERIALIZABLE").await;
    let take = format!("{}; COMMIT", take_other("us-east1", 1, 99));
    let (sw, committed) = tokio::join!(
        sqlx::query_scalar::<_, i64>(both).fetch_one(&mut west),
        async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            sqlx::raw_sql(&take).execute(&mut east).await
        }
    );
    committed.expect("the first side commits");
    let err = sw.expect_err("a read over both nodes while another transaction held their turns");
    assert_eq!(code(&err), "40001", "{err}");
    exec(&mut west, "ROLLBACK").await;
    exec(&mut eu, "BEGIN ISOLATION LEVEL REPEATABLE READ").await;
    let n = sqlx::raw_sql("UPDATE accounts SET balance = balance + 1")
        .execute(&mut eu)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(n, 3, "one UPDATE split over the three leaseholders");
    let rows: Vec<(i32, i64)> = sqlx::query_as("SELECT id, balance FROM accounts ORDER BY id")
        .fetch_all(&mut eu)
        .await
        .unwrap();
    assert_eq!(rows, vec![(1, 801), (2, 1101), (3, 1001)]);
    let err = sqlx::raw_sql(
        "UPDATE accounts SET balance = balance - 1 WHERE id IN (SELECT id FROM accounts WHERE balance > 1000)",
    )
    .execute(&mut eu)
    .await
    .expect_err("a split write whose shares read copies");
    assert_eq!(code(&err), "0A000", "{err}");
    exec(&mut eu, "ROLLBACK").await;
    exec(&mut eu, "BEGIN ISOLATION LEVEL SERIALIZABLE").await;
    exec(&mut eu, "UPDATE accounts SET balance = balance + 1").await;
    exec(&mut eu, "UPDATE accounts SET balance = balance - 1").await;
    exec(&mut eu, "COMMIT").await;

    // READ ONLY reads every region from this node's copies.
    exec(&mut east, "BEGIN ISOLATION LEVEL SERIALIZABLE READ ONLY").await;
    let total: i64 = sqlx::query_scalar("SELECT sum(balance)::int8 FROM accounts")
        .fetch_one(&mut east)
        .await
        .unwrap();
    assert_eq!(total, 3000 - 1 - 99);
    exec(&mut east, "COMMIT").await;
    let b = balances_converged(&nodes).await;
    assert_eq!(
        b.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
        vec![(1, 800), (2, 1100), (3, 1000)],
        "{b:?}"
    );

    // A transaction that wrote and then became READ ONLY holds its turns at its commit: T,
    // through node 1, writes account 2 (node 2) and reads account 1 (node 1) in a savepoint
    // rolled back (which undid its turns; the read stands), then is made READ ONLY; U,
    // through node 2, reads account 2 before T commits and writes account 1 after. U must
    // fail (T's commit on node 2 took the turn U's snapshot there predates; here PostgreSQL's
    // SSI on node 2 would also catch it through the rolled-back turn's read of the turn row,
    // so the turn's count there is checked too).
    exec(&mut east, "BEGIN ISOLATION LEVEL SERIALIZABLE").await;
    exec(&mut east, &take_other("us-west1", 2, 0)).await;
    exec(&mut east, "SAVEPOINT s").await;
    let _: i64 = sqlx::query_scalar(&read_own("us-east1", 1))
        .fetch_one(&mut east)
        .await
        .unwrap();
    exec(
        &mut east,
        "ROLLBACK TO SAVEPOINT s; RELEASE SAVEPOINT s; SET TRANSACTION READ ONLY",
    )
    .await;
    exec(&mut west, "BEGIN ISOLATION LEVEL SERIALIZABLE").await;
    let _: i64 = sqlx::query_scalar(&read_own("us-west1", 2))
        .fetch_one(&mut west)
        .await
        .unwrap();
    let turns_taken = || async {
        let mut c = connect(&nodes[1], "mr").await.unwrap();
        sqlx::query_scalar::<_, i64>("SELECT taken FROM multiregion.turn")
            .fetch_one(&mut c)
            .await
            .unwrap()
    };
    let before = turns_taken().await;
    exec(&mut east, "COMMIT").await;
    assert_eq!(
        turns_taken().await,
        before + 1,
        "T committed on node 2 without taking its turn"
    );
    let err = sqlx::raw_sql(&format!("{}; COMMIT", take_other("us-east1", 1, 0)))
        .execute(&mut west)
        .await
        .expect_err("both sides of a write skew committed: T's turns were not held at its commit");
    assert_eq!(code(&err), "40001", "{err}");
    exec(&mut west, "ROLLBACK").await;

    // A wait for a turn is one of PostgreSQL's lock waits: T, through node 1, locks account
    // 1 there; U, through node 2, holds node 2's turn (account 2), takes node 1's and waits
    // for account 1; T then wants node 1's turn. The cycle is on node 1, and its deadlock
    // detector ends it (40P01) instead of two lock timeouts (55P03); the other commits.
    exec(&mut east, "BEGIN ISOLATION LEVEL SERIALIZABLE").await;
    exec(&mut east, &take_other("us-east1", 1, 0)).await;
    exec(&mut west, "BEGIN ISOLATION LEVEL SERIALIZABLE").await;
    exec(&mut west, &take_other("us-west1", 2, 0)).await;
    let u_sql = take_other("us-east1", 1, 0);
    let t_sql = take_other("us-west1", 2, 0);
    let (u, t) = tokio::join!(sqlx::raw_sql(&u_sql).execute(&mut west), async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        sqlx::raw_sql(&t_sql).execute(&mut east).await
    });
    let codes: Vec<String> = [u.as_ref().err(), t.as_ref().err()]
        .into_iter()
        .flatten()
        .map(code)
        .collect();
    assert_eq!(codes, vec!["40P01".to_string()], "{u:?} {t:?}");
    for c in [&mut east, &mut west] {
        let _ = sqlx::raw_sql("COMMIT").execute(c).await;
    }
    no_prepared_transactions(&nodes).await;
    check_consistency(&nodes[0]);
}

/// One SERIALIZABLE transaction that reads accounts 1 (us-east1) and 2 (us-west1) and runs
/// `take` (a withdrawal of 300) if their sum covers it: `Some` if it withdrew, `None` if not.
async fn withdraw_if_covered(c: &mut PgConnection, take: &str) -> Result<Option<()>, sqlx::Error> {
    sqlx::query("BEGIN ISOLATION LEVEL SERIALIZABLE")
        .execute(&mut *c)
        .await?;
    let a: i64 = sqlx::query_scalar(
        "SELECT balance FROM accounts WHERE crdb_region = 'us-east1' AND id = 1",
    )
    .fetch_one(&mut *c)
    .await?;
    let b: i64 = sqlx::query_scalar(
        "SELECT balance FROM accounts WHERE crdb_region = 'us-west1' AND id = 2",
    )
    .fetch_one(&mut *c)
    .await?;
    if a + b < 300 {
        sqlx::query("COMMIT").execute(&mut *c).await?;
        return Ok(None);
    }
    sqlx::query(take).execute(&mut *c).await?;
    sqlx::query("COMMIT").execute(&mut *c).await?;
    Ok(Some(()))
}

/// Opens both sides of a write skew: a SERIALIZABLE transaction on each connection, `east`
/// reading account 1 (us-east1), `west` account 2 (us-west1). Returns what each read.
async fn begin_skew(east: &mut PgConnection, west: &mut PgConnection) -> (i64, i64) {
    let mut read = Vec::new();
    for (c, region, id) in [(east, "us-east1", 1), (west, "us-west1", 2)] {
        exec(c, "BEGIN ISOLATION LEVEL SERIALIZABLE").await;
        let sql =
            format!("SELECT balance FROM accounts WHERE crdb_region = '{region}' AND id = {id}");
        read.push(
            sqlx::query_scalar::<_, i64>(&sql)
                .fetch_one(c)
                .await
                .unwrap(),
        );
    }
    (read[0], read[1])
}

/// Accounts 1 (us-east1) and 2 (us-west1) of [`regional_bank`] back to 1000 each.
async fn reset_two_accounts(c: &mut PgConnection) {
    exec(
        c,
        "UPDATE accounts SET balance = 1000 WHERE crdb_region = 'us-east1' AND id = 1; \
         UPDATE accounts SET balance = 1000 WHERE crdb_region = 'us-west1' AND id = 2",
    )
    .await;
}

/// Rows a statement writes into partitions leased on other nodes go there, in the same
/// transaction: a multi-region VALUES list and an `INSERT … SELECT` through one node, an
/// UPDATE that moves a row between two other regions (its globally unique key still guards
/// it afterwards, and a moved row's other unique key still meets the rows it left behind), a
/// rolled-back move, RETURNING and ON CONFLICT of such rows (decided and returned where they
/// are written). A table made REGIONAL BY ROW through the us-west1 node gives its existing
/// rows that node's region on every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_for_partitions_leased_elsewhere_are_written_there_in_the_same_transaction() {
    let dir = scratch("data-moved");
    let nodes = start_cluster(dir.path(), 46, WAN, &[EAST_B, WEST_A, EU_B]).await;
    regional_bank(&nodes, 1).await;
    let mut east = connect(&nodes[0], "mr").await.unwrap();
    let mut west = connect(&nodes[1], "mr").await.unwrap();

    exec(
        &mut east,
        "INSERT INTO accounts (crdb_region, id, balance) VALUES \
         ('us-west1', 10, 1), ('europe-west1', 11, 1), ('us-east1', 12, 1)",
    )
    .await;
    let n = sqlx::raw_sql(
        "INSERT INTO accounts (crdb_region, id, balance) \
         SELECT (ARRAY['us-east1', 'us-west1', 'europe-west1'])[g % 3 + 1]::crdb_internal_region, g, 1 \
         FROM generate_series(20, 25) g",
    )
    .execute(&mut east)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 6);
    // Account 2 moves from us-west1 to europe-west1 through the us-east1 node.
    let n = sqlx::raw_sql("UPDATE accounts SET crdb_region = 'europe-west1' WHERE id = 2")
        .execute(&mut east)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(n, 1);
    // A move rolled back leaves the row where it was.
    exec(&mut west, "BEGIN").await;
    exec(
        &mut west,
        "UPDATE accounts SET crdb_region = 'us-east1' WHERE id = 3",
    )
    .await;
    exec(&mut west, "ROLLBACK").await;
    // The moved account's key is still taken, in any region.
    let err =
        sqlx::raw_sql("INSERT INTO accounts (crdb_region, id, balance) VALUES ('us-west1', 2, 1)")
            .execute(&mut west)
            .await
            .expect_err("account 2 exists in europe-west1");
    assert_eq!(code(&err), "23505", "{err}");
    // Rows for partitions leased elsewhere carry the statement's ON CONFLICT clause there,
    // where the conflict is decided against the leased, locked row: an upsert over three
    // regions through the us-west1 node, then a DO NOTHING that finds every row taken.
    let upserted: Vec<(i32, i64)> = sqlx::query_as(
        "INSERT INTO accounts AS a (crdb_region, id, balance) \
         VALUES ('us-west1', 10, 100), ('europe-west1', 11, 100), ('us-east1', 12, 100) \
         ON CONFLICT (crdb_region, id) DO UPDATE SET balance = a.balance + excluded.balance \
         RETURNING a.id, a.balance",
    )
    .fetch_all(&mut west)
    .await
    .unwrap();
    let mut upserted = upserted;
    upserted.sort();
    assert_eq!(upserted, vec![(10, 101), (11, 101), (12, 101)]);
    let n = sqlx::raw_sql(
        "INSERT INTO accounts (crdb_region, id, balance) \
         VALUES ('us-east1', 12, 5), ('europe-west1', 11, 5) ON CONFLICT DO NOTHING",
    )
    .execute(&mut west)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 0, "every row was taken: nothing inserted");
    let eleven: i64 = sqlx::query_scalar(
        "SELECT balance FROM accounts WHERE crdb_region = 'europe-west1' AND id = 11",
    )
    .fetch_one(&mut east)
    .await
    .unwrap();
    assert_eq!(eleven, 101, "the upsert updated the row at its leaseholder");
    // RETURNING rows written elsewhere come back from there, after the statement's own: an
    // INSERT over three regions (with the table's alias) and an UPDATE that rehomes a row.
    let returned: Vec<(i32, String, i64)> = sqlx::query_as(
        "INSERT INTO accounts AS a (crdb_region, id, balance) \
         VALUES ('us-west1', 30, 5), ('us-east1', 32, 6), ('europe-west1', 31, 7) \
         RETURNING a.id, crdb_region::text, a.balance * 10",
    )
    .fetch_all(&mut east)
    .await
    .unwrap();
    let mut sorted = returned.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        vec![
            (30, "us-west1".to_string(), 50),
            (31, "europe-west1".to_string(), 70),
            (32, "us-east1".to_string(), 60)
        ]
    );
    assert_eq!(
        returned[0].0, 32,
        "the statement's own row first: {returned:?}"
    );
    let moved: Vec<(i32, String)> = sqlx::query_as(
        "UPDATE accounts SET crdb_region = 'us-west1' WHERE id = 32 RETURNING id, crdb_region::text",
    )
    .fetch_all(&mut east)
    .await
    .unwrap();
    assert_eq!(moved, vec![(32, "us-west1".to_string())]);
    let b = balances_converged(&nodes).await;
    let got: Vec<(String, i32)> = b.into_iter().map(|r| (r.0, r.1)).collect();
    let want: Vec<(String, i32)> = [
        ("us-east1", 1),
        ("europe-west1", 2),
        ("europe-west1", 3),
        ("us-west1", 10),
        ("europe-west1", 11),
        ("us-east1", 12),
        ("europe-west1", 20),
        ("us-east1", 21),
        ("us-west1", 22),
        ("europe-west1", 23),
        ("us-east1", 24),
        ("us-west1", 25),
        ("us-west1", 30),
        ("europe-west1", 31),
        ("us-west1", 32),
    ]
    .into_iter()
    .map(|(r, i)| (r.to_string(), i))
    .collect();
    assert_eq!(got, want);
    no_prepared_transactions(&nodes).await;

    // A moved row's other unique key is checked against every other row, also those left
    // behind in the partition it moved out of.
    sqlx::query("SELECT multiregion.execute($1)")
        .bind(
            "CREATE TABLE people (id int PRIMARY KEY, email text UNIQUE) LOCALITY REGIONAL BY ROW",
        )
        .execute(&mut east)
        .await
        .unwrap();
    exec_once_settled(&mut east, "INSERT INTO people VALUES (1, 'a'), (3, 'c')").await;
    // The check runs against the key table of the node the row moves to (europe-west1's),
    // derived from its replicas of the other partitions: wait until it holds them (a new
    // range's non-voters join through a snapshot, after the voters).
    eventually(
        "the europe-west1 node to hold every person",
        Duration::from_secs(30),
        || async {
            let mut c = connect(&nodes[2], "mr").await?;
            exec(&mut c, "SET session_replication_role = replica").await;
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM people")
                .fetch_one(&mut c)
                .await
                .ok()?;
            (n == 2).then_some(())
        },
    )
    .await;
    let err =
        sqlx::raw_sql("UPDATE people SET crdb_region = 'europe-west1', email = 'c' WHERE id = 1")
            .execute(&mut west)
            .await
            .expect_err("email c belongs to person 3");
    assert_eq!(code(&err), "23505", "{err}");
    exec(
        &mut west,
        "UPDATE people SET crdb_region = 'europe-west1' WHERE id = 1",
    )
    .await;
    let moved: String =
        sqlx::query_scalar("SELECT crdb_region::text || ':' || email FROM people WHERE id = 1")
            .fetch_one(&mut east)
            .await
            .unwrap();
    assert_eq!(moved, "europe-west1:a");

    // Existing rows of a table made REGIONAL BY ROW through the us-west1 node.
    exec(
        &mut west,
        "CREATE TABLE notes (id int PRIMARY KEY, body text)",
    )
    .await;
    exec_once_settled(
        &mut west,
        "INSERT INTO notes SELECT g, 'n' FROM generate_series(1, 4) g",
    )
    .await;
    sqlx::query("SELECT multiregion.execute('ALTER TABLE notes SET LOCALITY REGIONAL BY ROW')")
        .execute(&mut west)
        .await
        .unwrap();
    for n in &nodes {
        let regions: String = eventually("notes converted", Duration::from_secs(30), || async {
            let mut c = connect(n, "mr").await?;
            sqlx::query_scalar("SELECT string_agg(DISTINCT crdb_region::text, ',') FROM notes")
                .fetch_one(&mut c)
                .await
                .ok()
        })
        .await;
        assert_eq!(regions, "us-west1", "{}", n.data_dir.display());
    }

    // Auto-rehoming through a node that does not lease the row: the UPDATE runs at the
    // row's leaseholder, and the row moves to the region of the node it was sent through
    // (rehome_row() answered the leaseholder's own region there, and the row stayed).
    exec(&mut east, "SET multiregion.enable_auto_rehoming = on").await;
    sqlx::query("SELECT multiregion.execute($1)")
        .bind("CREATE TABLE sessions (id int PRIMARY KEY, hits int) LOCALITY REGIONAL BY ROW")
        .execute(&mut east)
        .await
        .unwrap();
    exec(&mut east, "RESET multiregion.enable_auto_rehoming").await;
    exec_once_settled(&mut west, "INSERT INTO sessions VALUES (1, 0)").await;
    exec(
        &mut east,
        "UPDATE sessions SET hits = hits + 1 WHERE id = 1",
    )
    .await;
    for n in &nodes {
        eventually(
            "the session rehomed to us-east1 everywhere",
            Duration::from_secs(30),
            || async {
                let mut c = connect(n, "mr").await?;
                let r: String = sqlx::query_scalar(
                    "SELECT crdb_region::text || ':' || hits FROM sessions WHERE id = 1",
                )
                .fetch_one(&mut c)
                .await
                .ok()?;
                (r == "us-east1:1").then_some(())
            },
        )
        .await;
    }
    check_consistency(&nodes[0]);
}

/// A REGIONAL BY ROW table's primary key without its region is unique across the cluster,
/// not only against the rows a node has applied: the key table is one range in the primary
/// region, written by each statement's origin in the same transaction. The same key inserted
/// into two regions' partitions at the same moment, each through its own region's
/// leaseholder, succeeds exactly once; a key taken in one region cannot be taken in another,
/// until its row is deleted; a REPEATABLE READ transaction in a non-primary region still
/// commits (its key part pins nothing); a row moved between regions keeps its key (a row
/// referencing it is no obstacle); every node ends with the same keys, one per row; and a
/// TRUNCATE releases every key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_unique_across_regions_even_when_two_regions_take_it_at_once() {
    let dir = scratch("data-global-keys");
    let nodes = start_cluster(dir.path(), 54, WAN, &[EAST_B, WEST_A, EU_B]).await;
    regional_bank(&nodes, 1).await;
    let mut west = connect(&nodes[1], "mr").await.unwrap();
    let mut eu = connect(&nodes[2], "mr").await.unwrap();
    let insert = |region: &'static str| {
        format!("INSERT INTO accounts (crdb_region, id, balance) VALUES ('{region}', $1, 1)")
    };
    let (in_west, in_eu) = (insert("us-west1"), insert("europe-west1"));

    // Taken in one region, refused in another: 23505 with the table's own constraint.
    sqlx::query(&in_west)
        .bind(40)
        .execute(&mut west)
        .await
        .unwrap();
    let err = sqlx::query(&in_eu)
        .bind(40)
        .execute(&mut eu)
        .await
        .expect_err("account 40 exists in us-west1");
    assert_eq!(code(&err), "23505", "{err}");
    assert!(err.to_string().contains("accounts_pkey"), "{err}");

    // The same key through two regions' leaseholders at once: exactly one wins.
    for id in 100..110 {
        let w = sqlx::query(&in_west).bind(id).execute(&mut west);
        let e = sqlx::query(&in_eu).bind(id).execute(&mut eu);
        let (rw, re) = tokio::join!(w, e);
        let codes: Vec<String> = [rw.err(), re.err()].iter().flatten().map(code).collect();
        assert_eq!(codes, vec!["23505".to_string()], "key {id}");
    }

    // A deleted row's key is free again, in any region.
    exec(&mut west, "DELETE FROM accounts WHERE id = 40").await;
    sqlx::query(&in_eu).bind(40).execute(&mut eu).await.unwrap();

    // REPEATABLE READ in a region other than the key table's: its key part pins nothing.
    exec(&mut west, "BEGIN ISOLATION LEVEL REPEATABLE READ").await;
    sqlx::query(&in_west)
        .bind(200)
        .execute(&mut west)
        .await
        .unwrap();
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM accounts WHERE crdb_region = 'us-west1' AND id = 200",
    )
    .fetch_one(&mut west)
    .await
    .unwrap();
    assert_eq!(n, 1);
    exec(&mut west, "COMMIT").await;

    // A row moved between regions by a statement that does not name its region (split over
    // the leaseholders, the row written at its new one) keeps its key: a row that
    // references the key stops neither the move nor is lost.
    exec(
        &mut west,
        "CREATE TABLE cards (id int PRIMARY KEY, account int NOT NULL REFERENCES multiregion_keys.accounts (id))",
    )
    .await;
    exec_once_settled(&mut west, "INSERT INTO cards VALUES (1, 40)").await;
    let moved = sqlx::raw_sql("UPDATE accounts SET crdb_region = 'us-west1' WHERE id = 40")
        .execute(&mut west)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(moved, 1);
    let region: String = sqlx::query_scalar("SELECT crdb_region::text FROM accounts WHERE id = 40")
        .fetch_one(&mut eu)
        .await
        .unwrap();
    assert_eq!(region, "us-west1");

    // Every node holds one key per row, and the same keys.
    let want: Vec<i32> = {
        let b = balances_converged(&nodes).await;
        let mut ids: Vec<i32> = b.into_iter().map(|r| r.1).collect();
        ids.sort();
        ids
    };
    assert_eq!(ids_len_distinct(&want), want.len(), "{want:?}");
    for n in &nodes {
        let keys: Vec<i32> =
            eventually("the node's key table", Duration::from_secs(30), || async {
                let mut c = connect(n, "mr").await?;
                let keys: Vec<i32> =
                    sqlx::query_scalar("SELECT id FROM multiregion_keys.accounts ORDER BY id")
                        .fetch_all(&mut c)
                        .await
                        .ok()?;
                (keys == want).then_some(keys)
            })
            .await;
        assert_eq!(keys, want);
    }
    no_prepared_transactions(&nodes).await;

    // TRUNCATE releases every key (it fires no row trigger): in a database with one region,
    // whose only partition and key table the us-east1 node leases, as TRUNCATE needs.
    let mut c = nodes[0].sql().await;
    exec(&mut c, "CREATE DATABASE solo").await;
    let mut solo = eventually("database solo", Duration::from_secs(30), || {
        connect(&nodes[0], "solo")
    })
    .await;
    execute_all(
        &mut solo,
        &[
            r#"ALTER DATABASE solo PRIMARY REGION "us-east1""#,
            "CREATE TABLE t (id int PRIMARY KEY) LOCALITY REGIONAL BY ROW",
        ],
    )
    .await;
    exec_once_settled(&mut solo, "INSERT INTO t VALUES (1), (2)").await;
    // Right after CREATE TABLE the ranges may still be adding their replicas (TRUNCATE is
    // refused with a hint to retry until they have).
    exec_once_settled(&mut solo, "TRUNCATE t").await;
    exec(&mut solo, "INSERT INTO t VALUES (1)").await;
    for n in &nodes {
        eventually("one key left", Duration::from_secs(30), || async {
            let mut c = connect(n, "solo").await?;
            let keys: Vec<i32> = sqlx::query_scalar("SELECT id FROM multiregion_keys.t")
                .fetch_all(&mut c)
                .await
                .ok()?;
            (keys == vec![1]).then_some(())
        })
        .await;
    }
    check_consistency(&nodes[0]);
}

/// How many distinct values `ids` holds.
fn ids_len_distinct(ids: &[i32]) -> usize {
    ids.iter().collect::<BTreeSet<_>>().len()
}

/// A read that needs every partition's rows in one place (an aggregate, an ordered LIMIT)
/// through a node that holds no replica of some partitions runs whole on a node that holds
/// one of each, after its read barrier there: with two nodes per region, a partition's five
/// replicas (three voters wanted at home, one replica in each other region) leave some node
/// without one, and every node answers the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aggregate_through_a_node_without_every_partition_reads_where_they_all_are() {
    let dir = scratch("data-full-copy");
    const EAST_C: &str = "region=us-east1,zone=us-east1-c";
    const WEST_B: &str = "region=us-west1,zone=us-west1-b";
    const EU_C: &str = "region=europe-west1,zone=europe-west1-c";
    let nodes = start_cluster(
        dir.path(),
        55,
        WAN,
        &[EAST_B, EAST_C, WEST_A, WEST_B, EU_B, EU_C],
    )
    .await;
    let mut m = regional_accounts(&nodes).await;
    let insert = "INSERT INTO accounts (crdb_region, id, balance) VALUES \
                  ('us-east1', 1, 10), ('us-west1', 2, 20), ('europe-west1', 3, 30)";
    exec_once_settled(&mut m, insert).await;
    // Which nodes hold a replica of every partition, once placement has settled.
    let (full, lacking): (Vec<i64>, Vec<i64>) =
        eventually("replicas placed", Duration::from_secs(60), || async {
            let mut c = connect(&nodes[0], "mr").await?;
            let per_node: Vec<(i64, i64)> = sqlx::query_as(
                "SELECT n, count(*) FROM multiregion.ranges r, \
                   unnest(r.voting_replicas || r.non_voting_replicas) n \
                 WHERE r.table_name = 'accounts' AND r.partition IS NOT NULL GROUP BY n",
            )
            .fetch_all(&mut c)
            .await
            .ok()?;
            let full: Vec<i64> = per_node.iter().filter(|r| r.1 == 3).map(|r| r.0).collect();
            let lacking: Vec<i64> = (1..=6).filter(|n| !full.contains(n)).collect();
            (!full.is_empty() && !lacking.is_empty()).then_some((full, lacking))
        })
        .await;
    for (i, n) in nodes.iter().enumerate() {
        let (count, sum): (i64, i64) = eventually(
            "the aggregate through every node",
            Duration::from_secs(30),
            || async {
                let mut c = connect(n, "mr").await?;
                sqlx::query_as("SELECT count(*), sum(balance)::int8 FROM accounts")
                    .fetch_one(&mut c)
                    .await
                    .ok()
            },
        )
        .await;
        let mut c = connect(n, "mr").await.unwrap();
        assert_eq!(
            (count, sum),
            (3, 60),
            "node {} (full copies on {full:?}, not on {lacking:?})",
            i + 1
        );
        let top: Vec<i32> =
            sqlx::query_scalar("SELECT id FROM accounts ORDER BY balance DESC LIMIT 2")
                .fetch_all(&mut c)
                .await
                .unwrap();
        assert_eq!(top, vec![3, 2], "node {}", i + 1);
    }
    // A write is immediately visible to the next such read through a lacking node.
    let lacker = lacking[0] as usize - 1;
    let mut l = connect(&nodes[lacker], "mr").await.unwrap();
    exec(
        &mut l,
        "UPDATE accounts SET balance = balance + 5 WHERE crdb_region = 'europe-west1' AND id = 3",
    )
    .await;
    let sum: i64 = sqlx::query_scalar("SELECT sum(balance)::int8 FROM accounts")
        .fetch_one(&mut l)
        .await
        .unwrap();
    assert_eq!(sum, 65);
    check_consistency(&nodes[0]);
}

/// A sequence a column's default draws from, though no column owns it, moves past the values
/// the leaseholder drew on every replica: the node that leases the range next never hands
/// out a key the table already holds. (Created through `multiregion.execute`, whose plain
/// DDL reaches every node in a database without regions too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_a_default_draws_from_moves_past_the_rows_on_every_replica() {
    let dir = scratch("data-sequences");
    let nodes = start_cluster(dir.path(), 56, WAN, &[EAST_B, WEST_A, EU_B]).await;
    bank(&nodes).await;
    let mut b = connect(&nodes[0], "bank").await.unwrap();
    execute_all(
        &mut b,
        &[
            "CREATE SEQUENCE ticket_ids",
            "CREATE TABLE tickets (id bigint PRIMARY KEY DEFAULT nextval('ticket_ids'), note text)",
        ],
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) =
        sqlx::raw_sql("INSERT INTO tickets (note) SELECT 'x' FROM generate_series(1, 5)")
            .execute(&mut b)
            .await
    {
        assert!(Instant::now() < deadline, "{e}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let max: i64 = sqlx::query_scalar("SELECT max(id) FROM tickets")
        .fetch_one(&mut b)
        .await
        .unwrap();
    for n in &nodes {
        eventually(
            "the sequence past the rows",
            Duration::from_secs(30),
            || async {
                let mut c = connect(n, "bank").await?;
                let last: Option<i64> =
                    sqlx::query_scalar("SELECT pg_sequence_last_value('ticket_ids')")
                        .fetch_one(&mut c)
                        .await
                        .ok()?;
                (last >= Some(max)).then_some(())
            },
        )
        .await;
    }
}

/// A key table that a conversion to REGIONAL BY ROW creates from the table's rows starts on
/// every replica with the keys of those rows as the table's leaseholder held them. Node 2's
/// schema applier is held back by a lock, so node 1 — the table's leaseholder, where the
/// conversion runs, and (primary region) the first voter of the key table's range — waits
/// for node 2 before its own transaction commits, while the new ranges are created. Its
/// snapshot of a key table it had not committed yet used to be empty, and the other replicas
/// installed it over the keys they had filled in (found by CI in the replicated MovR app).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_table_made_by_a_conversion_starts_with_the_tables_keys_on_every_replica() {
    let dir = scratch("data-key-seed");
    let nodes = start_cluster(dir.path(), 57, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let mut m = regional_accounts(&nodes).await;
    exec(
        &mut m,
        "CREATE TABLE vehicles (id int PRIMARY KEY, kind text NOT NULL)",
    )
    .await;
    exec_once_settled(
        &mut m,
        "INSERT INTO vehicles SELECT g, 'scooter' FROM generate_series(1, 50) g",
    )
    .await;
    for n in &nodes {
        eventually(
            "every vehicle on every node",
            Duration::from_secs(30),
            || async {
                (count_in(n, "SELECT count(*) FROM vehicles").await == Some(50)).then_some(())
            },
        )
        .await;
    }
    let mut hold = connect(&nodes[1], "mr").await.unwrap();
    exec(&mut hold, "BEGIN").await;
    exec(&mut hold, "LOCK TABLE vehicles IN ACCESS SHARE MODE").await;
    let ddl = tokio::spawn(async move {
        sqlx::query(
            "SELECT multiregion.execute($$ALTER TABLE vehicles SET LOCALITY REGIONAL BY ROW$$)",
        )
        .execute(&mut m)
        .await
    });
    // Long enough for the key table's range to be created and, before the fix, bootstrapped.
    tokio::time::sleep(Duration::from_secs(5)).await;
    exec(&mut hold, "COMMIT").await;
    ddl.await.unwrap().expect("the conversion commits");
    for (i, n) in nodes.iter().enumerate() {
        eventually(
            &format!("node {}: the key table holds every vehicle's key", i + 1),
            Duration::from_secs(60),
            || async {
                let keys = count_in(n, "SELECT count(*) FROM multiregion_keys.vehicles").await;
                let leased = count_in(
                    n,
                    "SELECT count(*) FROM multiregion.ranges WHERE schema_name = 'multiregion_keys' \
                     AND table_name = 'vehicles' AND lease_holder IS NOT NULL",
                )
                .await;
                (keys == Some(50) && leased == Some(1)).then_some(())
            },
        )
        .await;
    }
    // The keys hold across regions: an existing id is refused in another region's partition.
    let mut west = connect(&nodes[1], "mr").await.unwrap();
    let err =
        sqlx::query("INSERT INTO vehicles (crdb_region, id, kind) VALUES ('us-west1', 7, 'bike')")
            .execute(&mut west)
            .await
            .expect_err("vehicle 7 exists");
    assert_eq!(code(&err), "23505", "{err}");
    check_consistency(&nodes[2]);
}

/// A count through `node` in database `mr`; `None` while it cannot be read.
async fn count_in(node: &Node, sql: &str) -> Option<i64> {
    let mut c = connect(node, "mr").await?;
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(&mut c)
        .await
        .ok()
}

/// `pgbench` (PostgreSQL's own, unchanged) initializes and runs through nodes that lease
/// none of its tables: its `-i` creates the tables, then in one transaction truncates them
/// and COPYs 100 000 rows (with FREEZE into the truncated table) and adds primary keys; its
/// run updates three tables and inserts into a fourth per transaction, and truncates the
/// history table first. The database's primary region is us-east1, so node 1 leases every
/// table and pgbench runs through the us-west1 and europe-west1 nodes, 63 and 87 ms away.
/// Before, the TRUNCATE right after the CREATE held the new ranges' first snapshots up until
/// its commit gave up waiting for their voters, and a COPY or TRUNCATE through a node that
/// did not lease the table was refused. By the extended protocol, a statement alone in its
/// transaction commits at the leaseholder with the statement (one round trip, counted on
/// `/metrics`), and a pipeline of two stays one transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_initializes_and_runs_through_nodes_that_lease_none_of_its_tables() {
    let dir = scratch("data-pgbench");
    let nodes = start_cluster(dir.path(), 58, WAN, &[EAST_B, WEST_A, EU_B]).await;
    enable_replication(&nodes[0]).await;
    let mut c = nodes[0].sql().await;
    exec(&mut c, "CREATE DATABASE pgb").await;
    let mut m = eventually("database pgb on node 1", Duration::from_secs(30), || {
        connect(&nodes[0], "pgb")
    })
    .await;
    execute_all(&mut m, &[r#"ALTER DATABASE pgb PRIMARY REGION "us-east1""#]).await;
    let run = |node: &Node, args: &[&str]| {
        let out = pgbench(node.pg_port)
            .args(args)
            .arg("pgb")
            .output()
            .expect("pgbench runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "pgbench {args:?}: {text}");
        assert!(!text.contains("ERROR"), "pgbench {args:?}: {text}");
        text
    };
    eventually(
        "the database's regions on node 3",
        Duration::from_secs(30),
        || async {
            let mut c = connect(&nodes[2], "pgb").await?;
            sqlx::query_scalar::<_, String>("SELECT multiregion.gateway_region()")
                .fetch_one(&mut c)
                .await
                .ok()
                .and(
                    count_in_db(&nodes[2], "pgb", "SELECT count(*) FROM multiregion.regions").await,
                )
                .filter(|n| *n == 1)
        },
    )
    .await;
    run(&nodes[2], &["-i", "-s", "1"]);
    let leased: Vec<i64> = sqlx::query_scalar(
        "SELECT DISTINCT lease_holder FROM multiregion.ranges WHERE database_name = 'pgb'",
    )
    .fetch_all(&mut m)
    .await
    .unwrap();
    assert_eq!(leased, vec![1], "node 1 leases every table");
    // The first run truncates the history table first (through us-west1), the second not.
    run(&nodes[1], &["-t", "10", "-c", "2"]);
    run(&nodes[2], &["-n", "-t", "10", "-c", "2"]);
    // By the extended protocol (libpq sends Bind, Execute and Sync together): a statement
    // alone in its implicit transaction commits at the leaseholder in the message that runs
    // it, one round trip as by the simple protocol; two pipelined before one Sync stay one
    // transaction, committed at Sync.
    let steps = || async {
        let mut n = [0.0; 3];
        for (i, kind) in ["statement_and_commit", "statement", "commit"]
            .iter()
            .enumerate()
        {
            let name = format!("pgmr_forwarded_steps_total{{kind=\"{kind}\"}}");
            n[i] = metric(nodes[1].pg_port, &name).await;
        }
        n
    };
    let script = |name: &str, body: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, body).unwrap();
        path.display().to_string()
    };
    let touch = "UPDATE pgbench_accounts SET abalance = abalance + 0 WHERE aid = 1;\n";
    let alone = script("alone.sql", touch);
    let piped = script(
        "piped.sql",
        &format!("\\startpipeline\n{touch}{touch}\\endpipeline\n"),
    );
    let before = steps().await;
    run(
        &nodes[1],
        &["-n", "-M", "extended", "-t", "5", "-f", &alone],
    );
    let after = steps().await;
    assert_eq!(
        [0, 1, 2].map(|i| after[i] - before[i]),
        [5.0, 0.0, 0.0],
        "alone: one step each"
    );
    run(
        &nodes[1],
        &["-n", "-M", "extended", "-t", "2", "-f", &piped],
    );
    let piped_steps = steps().await;
    assert_eq!(
        [0, 1, 2].map(|i| piped_steps[i] - after[i]),
        [0.0, 4.0, 2.0],
        "pipelined: two statements and a commit each"
    );
    // Every transfer is on every node, in every table, once.
    for (i, n) in nodes.iter().enumerate() {
        let sums = eventually(
            &format!("node {}: pgbench's tables agree", i + 1),
            Duration::from_secs(30),
            || async {
                let mut c = connect(n, "pgb").await?;
                let row = sqlx::query(
                    "SELECT (SELECT count(*) FROM pgbench_accounts), \
                            (SELECT sum(abalance) FROM pgbench_accounts), \
                            (SELECT sum(tbalance) FROM pgbench_tellers), \
                            (SELECT sum(bbalance) FROM pgbench_branches), \
                            (SELECT coalesce(sum(delta), 0) FROM pgbench_history), \
                            (SELECT count(*) FROM pgbench_history)",
                )
                .fetch_one(&mut c)
                .await
                .ok()?;
                let v: Vec<i64> = (0..6).map(|k| row.get::<i64, _>(k)).collect();
                (v[0] == 100_000 && v[5] == 40).then_some(v)
            },
        )
        .await;
        assert!(
            sums[1] == sums[2] && sums[2] == sums[3] && sums[3] == sums[4],
            "node {}: {sums:?}",
            i + 1
        );
    }
    check_consistency(&nodes[1]);
}

/// A count through `node` in database `db`; `None` while it cannot be read.
async fn count_in_db(node: &Node, db: &str, sql: &str) -> Option<i64> {
    let mut c = connect(node, db).await?;
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(&mut c)
        .await
        .ok()
}

/// A `DELETE` of parent `key` through `node` waits for the lock the open transaction on
/// `holder` took checking a row that references it, then, once `holder` commits, fails with
/// 23503: the check locked the parent where it is leased.
async fn delete_waits_then_fails(node: &Node, holder: &mut PgConnection, key: i32) {
    let deleting = tokio::spawn({
        let port = node.pg_port;
        async move {
            let mut c = try_connect_db(port, "mr").await;
            sqlx::query(&format!("DELETE FROM parent WHERE id = {key}"))
                .execute(&mut c)
                .await
        }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !deleting.is_finished(),
        "the delete of parent {key} waits for the referencing transaction's lock"
    );
    exec(holder, "COMMIT").await;
    let err = deleting
        .await
        .unwrap()
        .expect_err("a committed row references the parent");
    assert_eq!(code(&err), "23503", "parent {key}: {err}");
}

/// Foreign keys hold across leaseholders, with the transaction's own changes and row locks.
/// `parent` is leased in us-west1 (node 2), `child` (ON UPDATE/DELETE CASCADE) and `pinned`
/// (NO ACTION) in europe-west1 (node 3), and node 1 leases neither. A statement served for
/// another node used to check its foreign keys against that node's copy: a parent inserted
/// earlier in the same transaction on its leaseholder was missing there (23503 for a valid
/// row), a cascade's check failed the same way, and the lock a check takes was taken on a
/// copy, holding off no writer at the leaseholder. The same holds under REPEATABLE READ, where
/// a removed key's queries also see rows committed since the transaction's snapshot (as
/// PostgreSQL's do); a cascade two levels deep reaches a third node; and a user trigger of a
/// served statement that would change rows leased elsewhere is refused, before it runs when
/// they all are, else at commit if it changed one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_keys_hold_across_leaseholders_with_the_transactions_own_changes() {
    let dir = scratch("data-fk");
    let nodes = start_cluster(dir.path(), 59, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let mut m = regional_accounts(&nodes).await;
    execute_all(
        &mut m,
        &[
            r#"CREATE TABLE parent (id int PRIMARY KEY, v text) LOCALITY REGIONAL BY TABLE IN "us-west1""#,
            r#"CREATE TABLE child (id int PRIMARY KEY, pid int REFERENCES parent (id) ON UPDATE CASCADE ON DELETE CASCADE) LOCALITY REGIONAL BY TABLE IN "europe-west1""#,
            r#"CREATE TABLE pinned (id int PRIMARY KEY, pid int REFERENCES parent (id)) LOCALITY REGIONAL BY TABLE IN "europe-west1""#,
            r#"CREATE TABLE sibling (id int PRIMARY KEY, pid int REFERENCES parent (id) ON DELETE CASCADE) LOCALITY REGIONAL BY TABLE IN "us-west1""#,
            r#"CREATE TABLE grand (id int PRIMARY KEY, sid int REFERENCES sibling (id) ON DELETE CASCADE) LOCALITY REGIONAL BY TABLE IN "europe-west1""#,
        ],
    )
    .await;
    // The new tables' ranges and leases settle first.
    exec_once_settled(&mut m, "INSERT INTO parent VALUES (100, 'settled')").await;
    exec_once_settled(&mut m, "INSERT INTO child VALUES (100, 100)").await;
    exec_once_settled(&mut m, "INSERT INTO parent VALUES (101, 'pinned')").await;
    exec_once_settled(&mut m, "INSERT INTO pinned VALUES (101, 101)").await;

    // A parent and its child in one transaction through node 1: the child's check, run by
    // node 3 for node 1, sees the parent node 2 holds uncommitted for this transaction.
    let mut east = connect(&nodes[0], "mr").await.unwrap();
    exec(
        &mut east,
        "BEGIN; INSERT INTO parent VALUES (1, 'a'); INSERT INTO child VALUES (10, 1); \
         INSERT INTO pinned VALUES (10, 1); COMMIT",
    )
    .await;
    // A child of no parent: PostgreSQL's own error, text and all.
    let err = sqlx::query("INSERT INTO child VALUES (11, 99)")
        .execute(&mut east)
        .await
        .expect_err("parent 99 does not exist");
    assert_eq!(code(&err), "23503", "{err}");
    let db = err.as_database_error().unwrap();
    assert_eq!(
        db.message(),
        "insert or update on table \"child\" violates foreign key constraint \"child_pid_fkey\""
    );
    // A cascade through the parent's leaseholder, served for node 1: node 3's rows follow,
    // and their own checks see the renamed parent.
    exec(&mut east, "UPDATE parent SET id = 2 WHERE id = 100").await;
    // A removed key still referenced: refused, from wherever it is removed.
    let err = sqlx::query("DELETE FROM parent WHERE id = 1")
        .execute(&mut east)
        .await
        .expect_err("pinned 10 references parent 1");
    assert_eq!(code(&err), "23503", "{err}");
    assert!(err.to_string().contains("on table \"pinned\""), "{err}");

    // The check's lock is taken at the parent's leaseholder: a delete of the parent through
    // another node waits for the referencing transaction, then sees its row.
    let mut eu = connect(&nodes[2], "mr").await.unwrap();
    exec(&mut east, "INSERT INTO parent VALUES (7, 'locked')").await;
    exec(&mut eu, "BEGIN; INSERT INTO pinned VALUES (70, 7)").await;
    delete_waits_then_fails(&nodes[0], &mut eu, 7).await;

    // The same under REPEATABLE READ, whose served statements' checks used to read the
    // serving node's copy: the parent this transaction inserted on node 2 was missing on
    // node 3 (23503 for a valid row), and the check's lock held off no writer of the parent.
    exec(
        &mut east,
        "BEGIN ISOLATION LEVEL REPEATABLE READ; INSERT INTO parent VALUES (3, 'rr'); \
         INSERT INTO child VALUES (30, 3); INSERT INTO pinned VALUES (30, 3); COMMIT",
    )
    .await;
    exec(&mut east, "BEGIN ISOLATION LEVEL REPEATABLE READ").await;
    let err = sqlx::query("INSERT INTO child VALUES (31, 99)")
        .execute(&mut east)
        .await
        .expect_err("parent 99 does not exist, under REPEATABLE READ either");
    assert_eq!(code(&err), "23503", "{err}");
    exec(&mut east, "ROLLBACK").await;
    exec(
        &mut east,
        "INSERT INTO parent VALUES (8, 'locked under rr')",
    )
    .await;
    let mut east_rr = connect(&nodes[0], "mr").await.unwrap();
    exec(
        &mut east_rr,
        "BEGIN ISOLATION LEVEL REPEATABLE READ; INSERT INTO pinned VALUES (80, 8)",
    )
    .await;
    delete_waits_then_fails(&nodes[1], &mut east_rr, 8).await;

    // A key removed under REPEATABLE READ while a row referencing it was committed after the
    // transaction's snapshot there: the referential queries read the latest snapshot, as
    // PostgreSQL's do, so a NO ACTION key is found still referenced (23503) and a cascade
    // meets a row its snapshot does not see (40001). Through node 1 (the parent's delete
    // served by node 2, its queries returned to node 1) and through node 2 (its own queries,
    // forwarded to node 3). They used to read with the transaction's snapshot, find nothing,
    // and remove the key under the committed row.
    let mut west = connect(&nodes[1], "mr").await.unwrap();
    for (through, key) in [(&mut east, 9), (&mut west, 12)] {
        for (table, key, expected) in [("pinned", key, "23503"), ("child", key + 1, "40001")] {
            exec(
                through,
                &format!("INSERT INTO parent VALUES ({key}, 'removed under rr')"),
            )
            .await;
            exec(
                through,
                &format!("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM {table}"),
            )
            .await;
            exec(
                &mut eu,
                &format!("INSERT INTO {table} VALUES ({key}5, {key})"),
            )
            .await;
            let err = sqlx::query(&format!("DELETE FROM parent WHERE id = {key}"))
                .execute(&mut *through)
                .await
                .expect_err(&format!(
                    "{table} {key}: removed under a row committed meanwhile"
                ));
            assert_eq!(code(&err), expected, "{table} {key}: {err}");
            exec(through, "ROLLBACK").await;
        }
    }

    // A cascade two levels deep, served by node 2 for node 1: the parent's delete cascades to
    // `sibling` there, whose rows cascade in turn to `grand`, leased on node 3. That second
    // cascade's trigger belongs to a relation the statement opened only while its triggers
    // fired, so its query was not known as referential and deleted node 2's copy.
    exec(&mut east, "INSERT INTO parent VALUES (20, 'two levels')").await;
    exec_once_settled(&mut east, "INSERT INTO sibling VALUES (20, 20)").await;
    exec_once_settled(&mut east, "INSERT INTO grand VALUES (20, 20)").await;
    exec(&mut east, "DELETE FROM parent WHERE id = 20").await;
    for (i, n) in nodes.iter().enumerate() {
        eventually(
            &format!("node {}: the grandchild cascaded away", i + 1),
            Duration::from_secs(30),
            || async {
                (count_in(n, "SELECT count(*) FROM grand").await == Some(0)
                    && count_in(n, "SELECT count(*) FROM sibling").await == Some(0))
                .then_some(())
            },
        )
        .await;
    }

    // A user trigger of a statement served by node 2 for node 1 that deletes rows leased on
    // node 3: refused before it runs. It used to read node 2's copy, which may not have the
    // rows yet: right after they were written the UPDATE committed, its trigger having
    // deleted nothing anywhere.
    execute_all(
        &mut m,
        &[
            r#"CREATE TABLE audit (id int PRIMARY KEY) LOCALITY REGIONAL BY TABLE IN "europe-west1""#,
            "CREATE FUNCTION forget_audit() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN DELETE FROM audit WHERE id = NEW.id; RETURN NEW; END $$",
            "CREATE TRIGGER forget_audit AFTER UPDATE ON parent FOR EACH ROW EXECUTE FUNCTION forget_audit()",
        ],
    )
    .await;
    exec_once_settled(&mut east, "INSERT INTO audit VALUES (7), (8)").await;
    let err = sqlx::query("UPDATE parent SET v = 'audited' WHERE id = 7")
        .execute(&mut east)
        .await
        .expect_err("the trigger changes rows leased on node 3");
    assert_eq!(code(&err), "0A000", "{err}");
    assert!(
        err.to_string().contains("changes rows leased on node 3"),
        "{err}"
    );
    exec(&mut m, "DROP TRIGGER forget_audit ON parent").await;
    // One whose UPDATE scans partitions leased here and elsewhere (no region in its filter)
    // runs, past a read barrier: a row leased here changes, a row leased elsewhere fails the
    // transaction at commit (this node not its leaseholder), nothing half-applied.
    exec_once_settled(
        &mut east,
        "INSERT INTO accounts (crdb_region, id, balance) \
         VALUES ('us-west1', 1, 100), ('europe-west1', 3, 100)",
    )
    .await;
    execute_all(
        &mut m,
        &[
            "CREATE FUNCTION pay() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN UPDATE accounts SET balance = balance + 1 WHERE id = NEW.id; RETURN NEW; END $$",
            "CREATE TRIGGER pay AFTER UPDATE ON parent FOR EACH ROW EXECUTE FUNCTION pay()",
        ],
    )
    .await;
    exec(&mut east, "UPDATE parent SET v = 'paid' WHERE id = 1").await;
    let err = sqlx::query("UPDATE parent SET v = 'paid' WHERE id = 3")
        .execute(&mut east)
        .await
        .expect_err("the trigger changes a row leased on node 3");
    assert_eq!(code(&err), "0A000", "{err}");
    exec(&mut m, "DROP TRIGGER pay ON parent").await;
    for (i, n) in nodes.iter().enumerate() {
        eventually(
            &format!("node {}: the local row paid, the other not", i + 1),
            Duration::from_secs(30),
            || async {
                let paid = count_in(n, "SELECT count(*) FROM parent WHERE v = 'paid'").await;
                let balances = count_in(
                    n,
                    "SELECT sum(balance * CASE id WHEN 1 THEN 1000 ELSE 1 END)::bigint FROM accounts",
                )
                .await;
                (paid == Some(1) && balances == Some(101_100)).then_some(())
            },
        )
        .await;
    }
    for (i, n) in nodes.iter().enumerate() {
        assert_eq!(
            count_in(n, "SELECT count(*) FROM parent WHERE v = 'audited'").await,
            Some(0),
            "node {}",
            i + 1
        );
    }

    // A cascading delete through node 1 removes node 3's rows.
    exec(&mut east, "DELETE FROM parent WHERE id = 2").await;
    for (i, n) in nodes.iter().enumerate() {
        eventually(
            &format!("node {}: every row where it belongs", i + 1),
            Duration::from_secs(30),
            || async {
                let children = count_in(n, "SELECT count(*) FROM child").await;
                let parents = count_in(n, "SELECT count(*) FROM parent").await;
                let pinned = count_in(n, "SELECT count(*) FROM pinned").await;
                (children == Some(4)
                    && parents == Some(9)
                    && pinned == Some(7)
                    && count_in(n, "SELECT count(*) FROM audit").await == Some(2))
                .then_some(())
            },
        )
        .await;
    }
    no_prepared_transactions(&nodes).await;
    check_consistency(&nodes[0]);
}

/// Statements a trigger runs inside a statement served for another node read current copies
/// of what is leased elsewhere. `parent` and `log` are leased in us-west1 (node 2), `audit`
/// in europe-west1 (node 3); `UPDATE parent` through node 1 is served by node 2, where its
/// triggers run. An `INSERT … SELECT` from `audit` used to read node 2's copy without a read
/// barrier, so right after a row was written to `audit` it could copy nothing; a MERGE or a
/// data-modifying WITH into `audit` was neither checked nor waited for: it changed node 2's
/// copy, or, missing a row that copy had not applied yet, committed having changed nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_inside_served_statements_read_current_copies() {
    let dir = scratch("data-nested");
    let nodes = start_cluster(dir.path(), 86, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let mut m = three_region_db(&nodes).await;
    execute_all(
        &mut m,
        &[
            r#"CREATE TABLE parent (id int PRIMARY KEY, v text) LOCALITY REGIONAL BY TABLE IN "us-west1""#,
            r#"CREATE TABLE log (id int PRIMARY KEY, note text) LOCALITY REGIONAL BY TABLE IN "us-west1""#,
            r#"CREATE TABLE audit (id int PRIMARY KEY, note text) LOCALITY REGIONAL BY TABLE IN "europe-west1""#,
            "CREATE FUNCTION copy_note() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN INSERT INTO log SELECT id, note FROM audit WHERE id = NEW.id; RETURN NEW; END $$",
            "CREATE TRIGGER copy_note AFTER UPDATE ON parent FOR EACH ROW EXECUTE FUNCTION copy_note()",
        ],
    )
    .await;
    exec_once_settled(
        &mut m,
        "INSERT INTO parent SELECT g, 'new' FROM generate_series(1, 6) g",
    )
    .await;
    exec_once_settled(&mut m, "INSERT INTO log VALUES (0, 'settled')").await;
    exec_once_settled(&mut m, "INSERT INTO audit VALUES (0, 'settled')").await;

    // Each note is written to `audit` (a quorum of nodes 3 and 1) and copied at once by a
    // trigger on node 2: the copy holds it by then.
    let mut east = connect(&nodes[0], "mr").await.unwrap();
    for k in 1..=4 {
        exec(
            &mut east,
            &format!("INSERT INTO audit VALUES ({k}, 'note {k}')"),
        )
        .await;
        exec(
            &mut east,
            &format!("UPDATE parent SET v = 'copied' WHERE id = {k}"),
        )
        .await;
    }
    for (i, n) in nodes.iter().enumerate() {
        eventually(
            &format!("node {}: every note copied", i + 1),
            Duration::from_secs(30),
            || async {
                (count_in(n, "SELECT count(*) FROM log WHERE note = 'note ' || id").await
                    == Some(4))
                .then_some(())
            },
        )
        .await;
    }
    exec(&mut m, "DROP TRIGGER copy_note ON parent").await;

    // A MERGE into `audit`, all of it leased on node 3: refused before it runs.
    execute_all(
        &mut m,
        &[
            "CREATE FUNCTION merge_note() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN MERGE INTO audit a USING (SELECT NEW.id AS id) s ON a.id = s.id \
             WHEN MATCHED THEN UPDATE SET note = 'merged' \
             WHEN NOT MATCHED THEN INSERT VALUES (s.id, 'merged'); RETURN NEW; END $$",
            "CREATE TRIGGER merge_note AFTER UPDATE ON parent FOR EACH ROW EXECUTE FUNCTION merge_note()",
        ],
    )
    .await;
    let err = sqlx::query("UPDATE parent SET v = 'merged' WHERE id = 1")
        .execute(&mut east)
        .await
        .expect_err("the MERGE changes rows leased on node 3");
    assert_eq!(code(&err), "0A000", "{err}");
    assert!(
        err.to_string().contains("changes rows leased on node 3"),
        "{err}"
    );
    exec(&mut m, "DROP TRIGGER merge_note ON parent").await;

    // A data-modifying WITH deleting from `audit` and writing `log`, over ranges leased here
    // and on node 3: run past a read barrier, so it finds the row just written, and refused
    // at commit for changing node 3's row here. Nothing applied.
    execute_all(
        &mut m,
        &[
            "CREATE FUNCTION move_note() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN WITH gone AS (DELETE FROM audit WHERE id = NEW.id RETURNING id, note) \
             INSERT INTO log SELECT id + 100, note FROM gone; RETURN NEW; END $$",
            "CREATE TRIGGER move_note AFTER UPDATE ON parent FOR EACH ROW EXECUTE FUNCTION move_note()",
        ],
    )
    .await;
    for k in 5..=6 {
        exec(
            &mut east,
            &format!("INSERT INTO audit VALUES ({k}, 'note {k}')"),
        )
        .await;
        let err = sqlx::query(&format!("UPDATE parent SET v = 'moved' WHERE id = {k}"))
            .execute(&mut east)
            .await
            .expect_err("the WITH deletes a row leased on node 3");
        assert_eq!(code(&err), "0A000", "{k}: {err}");
        // At commit: it ran, and changed a row of node 3's range here.
        assert!(
            err.to_string().contains("is not the leaseholder"),
            "{k}: {err}"
        );
    }
    exec(&mut m, "DROP TRIGGER move_note ON parent").await;
    for (i, n) in nodes.iter().enumerate() {
        eventually(
            &format!("node {}: nothing merged or moved", i + 1),
            Duration::from_secs(30),
            || async {
                let audit =
                    count_in(n, "SELECT count(*) FROM audit WHERE note LIKE 'note %'").await;
                let merged = count_in(
                    n,
                    "SELECT count(*) FROM parent WHERE v IN ('merged', 'moved')",
                )
                .await;
                let log = count_in(n, "SELECT count(*) FROM log").await;
                (audit == Some(6) && merged == Some(0) && log == Some(5)).then_some(())
            },
        )
        .await;
    }
    no_prepared_transactions(&nodes).await;
    check_consistency(&nodes[0]);
}

/// A foreign key declared DEFERRABLE INITIALLY DEFERRED is checked when the transaction
/// commits, as PostgreSQL checks it, also when the statement that wrote the row was served by
/// another node. `p` is leased in us-west1 (node 2), `c` in europe-west1 (node 3), and the
/// statements run through node 1. Node 3 used to check the key at its own commit, against
/// its copy of `p`: a child inserted before its parent in one transaction failed with 23503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initially_deferred_foreign_keys_are_checked_at_commit_across_leaseholders() {
    let dir = scratch("data-deferred-fk");
    let nodes = start_cluster(dir.path(), 87, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let mut m = three_region_db(&nodes).await;
    execute_all(
        &mut m,
        &[
            r#"CREATE TABLE p (id int PRIMARY KEY) LOCALITY REGIONAL BY TABLE IN "us-west1""#,
            r#"CREATE TABLE c (id int PRIMARY KEY, pid int REFERENCES p (id) DEFERRABLE INITIALLY DEFERRED) LOCALITY REGIONAL BY TABLE IN "europe-west1""#,
            "CREATE TABLE r (id int PRIMARY KEY, pid int REFERENCES p (id) DEFERRABLE INITIALLY DEFERRED, note text) LOCALITY REGIONAL BY ROW",
        ],
    )
    .await;
    exec_once_settled(&mut m, "INSERT INTO p VALUES (100)").await;
    exec_once_settled(&mut m, "INSERT INTO c VALUES (100, 100)").await;
    for region in ["us-east1", "us-west1", "europe-west1"] {
        exec_once_settled(
            &mut m,
            &format!("INSERT INTO r (crdb_region, id, pid) VALUES ('{region}', 0, 100)"),
        )
        .await;
        exec(&mut m, "DELETE FROM r WHERE id = 0").await;
    }

    let mut east = connect(&nodes[0], "mr").await.unwrap();
    // The child first, then its parent: the key holds at commit.
    exec(
        &mut east,
        "BEGIN; INSERT INTO c VALUES (1, 1); INSERT INTO p VALUES (1); COMMIT",
    )
    .await;
    // A child of no parent: the statement goes through, the commit fails with PostgreSQL's
    // error, and nothing is applied.
    exec(&mut east, "BEGIN").await;
    exec(&mut east, "INSERT INTO c VALUES (2, 99)").await;
    let err = sqlx::query("COMMIT")
        .execute(&mut east)
        .await
        .expect_err("parent 99 does not exist");
    assert_eq!(code(&err), "23503", "{err}");
    assert_eq!(
        err.as_database_error().unwrap().message(),
        "insert or update on table \"c\" violates foreign key constraint \"c_pid_fkey\""
    );
    // A check whose row is gone by the commit is skipped, as PostgreSQL skips it: the row
    // deleted, or updated to a key that exists (its new version checked instead), or
    // written in a subtransaction rolled back.
    exec(
        &mut east,
        "BEGIN; INSERT INTO c VALUES (3, 98); DELETE FROM c WHERE id = 3; COMMIT",
    )
    .await;
    exec(
        &mut east,
        "BEGIN; INSERT INTO c VALUES (4, 97); UPDATE c SET pid = 1 WHERE id = 4; COMMIT",
    )
    .await;
    exec(
        &mut east,
        "BEGIN; SAVEPOINT s; INSERT INTO c VALUES (5, 96); ROLLBACK TO SAVEPOINT s; COMMIT",
    )
    .await;
    // The check runs as the key's owner, as PostgreSQL runs it: a role that may only insert
    // into `c` needs no right on `p`.
    execute_all(
        &mut m,
        &[
            "CREATE ROLE app",
            "GRANT USAGE ON SCHEMA public TO app",
            "GRANT INSERT ON c TO app",
        ],
    )
    .await;
    eventually("role app on node 3", Duration::from_secs(30), || async {
        count_in(
            &nodes[2],
            "SELECT count(*) FROM pg_roles WHERE rolname = 'app'",
        )
        .await
        .filter(|&n| n == 1)
    })
    .await;
    exec(
        &mut east,
        "BEGIN; SET LOCAL ROLE app; INSERT INTO c VALUES (6, 1); COMMIT",
    )
    .await;
    // Nor on the schema of a key that references a removed row: `app` may delete from `p`
    // without USAGE on `priv`, where `priv.k` references it.
    execute_all(
        &mut m,
        &[
            "CREATE SCHEMA priv",
            r#"CREATE TABLE priv.k (id int PRIMARY KEY, pid int REFERENCES p (id) DEFERRABLE INITIALLY DEFERRED) LOCALITY REGIONAL BY TABLE IN "europe-west1""#,
            "GRANT SELECT, DELETE ON p TO app",
        ],
    )
    .await;
    exec_once_settled(&mut m, "INSERT INTO priv.k VALUES (100, 100)").await;
    exec(&mut east, "INSERT INTO p VALUES (8)").await;
    exec(
        &mut east,
        "BEGIN; SET LOCAL ROLE app; DELETE FROM p WHERE id = 8; COMMIT",
    )
    .await;
    // A statement split over the leaseholders of `r`'s partitions, node 1's share run by this
    // transaction itself, leaves its keys deferred: the row inserted before it, whose parent
    // comes after it, is checked at commit.
    exec(
        &mut east,
        "BEGIN; INSERT INTO r (crdb_region, id, pid) VALUES ('us-east1', 1, 7); \
         UPDATE r SET note = 'split'; INSERT INTO p VALUES (7); COMMIT",
    )
    .await;
    // A referenced key removed: refused at commit, unless its referencing rows go too or
    // the key is back by then.
    exec(&mut east, "BEGIN").await;
    exec(&mut east, "DELETE FROM p WHERE id = 100").await;
    let err = sqlx::query("COMMIT")
        .execute(&mut east)
        .await
        .expect_err("c 100 references p 100");
    assert_eq!(code(&err), "23503", "{err}");
    assert!(err.to_string().contains("on table \"c\""), "{err}");
    exec(
        &mut east,
        "BEGIN; DELETE FROM p WHERE id = 1; INSERT INTO p VALUES (1); COMMIT",
    )
    .await;
    exec(
        &mut east,
        "BEGIN; DELETE FROM p WHERE id = 100; DELETE FROM c WHERE id = 100; \
         DELETE FROM priv.k WHERE id = 100; COMMIT",
    )
    .await;

    for (i, n) in nodes.iter().enumerate() {
        eventually(
            &format!("node {}: the rows that committed", i + 1),
            Duration::from_secs(30),
            || async {
                let children = count_in(n, "SELECT count(*) FROM c WHERE pid = 1").await;
                let all = count_in(n, "SELECT count(*) FROM c").await;
                let parents = count_in(n, "SELECT count(*) FROM p").await;
                let split = count_in(n, "SELECT count(*) FROM r WHERE note = 'split'").await;
                (children == Some(3) && all == Some(3) && parents == Some(2) && split == Some(1))
                    .then_some(())
            },
        )
        .await;
    }
    no_prepared_transactions(&nodes).await;
    check_consistency(&nodes[0]);
}

/// `SET CONSTRAINTS` in the origin's transaction governs the keys that nodes serving its
/// statements check, as it governs the origin's own. `p` is leased in us-west1 (node 2); `c`
/// (a key DEFERRABLE INITIALLY IMMEDIATE) and `d` (INITIALLY DEFERRED) in europe-west1
/// (node 3); statements run through node 1. Node 3 used to check as the key was declared:
/// after `SET CONSTRAINTS ALL DEFERRED` a child inserted before its parent failed with 23503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_constraints_reaches_the_nodes_serving_the_transactions_statements() {
    let dir = scratch("data-set-constraints");
    let nodes = start_cluster(dir.path(), 88, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let mut m = three_region_db(&nodes).await;
    execute_all(
        &mut m,
        &[
            r#"CREATE TABLE p (id int PRIMARY KEY) LOCALITY REGIONAL BY TABLE IN "us-west1""#,
            r#"CREATE TABLE c (id int PRIMARY KEY, pid int REFERENCES p (id) DEFERRABLE INITIALLY IMMEDIATE) LOCALITY REGIONAL BY TABLE IN "europe-west1""#,
            r#"CREATE TABLE d (id int PRIMARY KEY, pid int REFERENCES p (id) DEFERRABLE INITIALLY DEFERRED) LOCALITY REGIONAL BY TABLE IN "europe-west1""#,
        ],
    )
    .await;
    exec_once_settled(&mut m, "INSERT INTO p VALUES (100)").await;
    exec_once_settled(&mut m, "INSERT INTO c VALUES (100, 100)").await;
    exec_once_settled(&mut m, "INSERT INTO d VALUES (100, 100)").await;

    let mut east = connect(&nodes[0], "mr").await.unwrap();
    async fn fails(c: &mut PgConnection, sql: &str) -> (String, String) {
        let err = sqlx::query(sql).execute(c).await.expect_err(sql);
        let db = err.as_database_error().expect("a SQL error");
        (
            db.code().unwrap_or_default().to_string(),
            db.message().to_string(),
        )
    }
    let violated = "insert or update on table \"c\" violates foreign key constraint \"c_pid_fkey\"";
    // Deferred, by ALL or by name: the child first, then its parent.
    exec(
        &mut east,
        "BEGIN; SET CONSTRAINTS ALL DEFERRED; INSERT INTO c VALUES (1, 1); \
         INSERT INTO p VALUES (1); COMMIT",
    )
    .await;
    exec(
        &mut east,
        "BEGIN; SET CONSTRAINTS public.c_pid_fkey DEFERRED; INSERT INTO c VALUES (2, 2); \
         INSERT INTO p VALUES (2); COMMIT",
    )
    .await;
    // Made immediate again, the pending checks run at that statement: here one passes…
    exec(
        &mut east,
        "BEGIN; SET CONSTRAINTS c_pid_fkey DEFERRED; INSERT INTO c VALUES (3, 3); \
         INSERT INTO p VALUES (3); SET CONSTRAINTS ALL IMMEDIATE; COMMIT",
    )
    .await;
    // …and here one fails, at the SET CONSTRAINTS, with PostgreSQL's error.
    exec(&mut east, "BEGIN; SET CONSTRAINTS ALL DEFERRED").await;
    exec(&mut east, "INSERT INTO c VALUES (4, 99)").await;
    let (code, message) = fails(&mut east, "SET CONSTRAINTS c_pid_fkey IMMEDIATE").await;
    assert_eq!((code.as_str(), message.as_str()), ("23503", violated));
    exec(&mut east, "ROLLBACK").await;
    // A rollback to a savepoint undoes the SET CONSTRAINTS made in it, here and there (the
    // transaction's session on node 3 began before it).
    exec(
        &mut east,
        "BEGIN; INSERT INTO c VALUES (5, 100); SAVEPOINT s; SET CONSTRAINTS ALL DEFERRED; \
         INSERT INTO c VALUES (6, 98); ROLLBACK TO SAVEPOINT s",
    )
    .await;
    let (code, message) = fails(&mut east, "INSERT INTO c VALUES (7, 97)").await;
    assert_eq!((code.as_str(), message.as_str()), ("23503", violated));
    exec(&mut east, "ROLLBACK").await;
    // A session begun inside the savepoint (it got the deferral as it began) loses it too.
    exec(
        &mut east,
        "BEGIN; SAVEPOINT a; SET CONSTRAINTS ALL DEFERRED; INSERT INTO c VALUES (10, 94); \
         ROLLBACK TO SAVEPOINT a",
    )
    .await;
    let (code, message) = fails(&mut east, "INSERT INTO c VALUES (11, 93)").await;
    assert_eq!((code.as_str(), message.as_str()), ("23503", violated));
    exec(&mut east, "ROLLBACK").await;
    // A check run early by a SET CONSTRAINTS … IMMEDIATE that a rollback to a savepoint
    // undoes is due again at commit.
    exec(
        &mut east,
        "BEGIN; SET CONSTRAINTS ALL DEFERRED; INSERT INTO c VALUES (9, 95); SAVEPOINT s",
    )
    .await;
    let (code, _) = fails(&mut east, "SET CONSTRAINTS ALL IMMEDIATE").await;
    assert_eq!(code, "23503");
    exec(&mut east, "ROLLBACK TO SAVEPOINT s").await;
    let (code, message) = fails(&mut east, "COMMIT").await;
    assert_eq!((code.as_str(), message.as_str()), ("23503", violated));
    // In a function's body too, for the rest of the transaction.
    exec(
        &mut east,
        "DO $$BEGIN SET CONSTRAINTS ALL DEFERRED; INSERT INTO c VALUES (12, 12); \
         INSERT INTO p VALUES (12); END$$",
    )
    .await;
    // An INITIALLY DEFERRED key made immediate is checked with the statement.
    exec(&mut east, "BEGIN; SET CONSTRAINTS d_pid_fkey IMMEDIATE").await;
    let (code, message) = fails(&mut east, "INSERT INTO d VALUES (8, 96)").await;
    assert_eq!(
        (code.as_str(), message.as_str()),
        (
            "23503",
            "insert or update on table \"d\" violates foreign key constraint \"d_pid_fkey\""
        )
    );
    exec(&mut east, "ROLLBACK").await;

    for (i, n) in nodes.iter().enumerate() {
        eventually(
            &format!("node {}: the rows that committed", i + 1),
            Duration::from_secs(30),
            || async {
                let children = count_in(n, "SELECT count(*) FROM c").await;
                let parents = count_in(n, "SELECT count(*) FROM p").await;
                let others = count_in(n, "SELECT count(*) FROM d").await;
                (children == Some(5) && parents == Some(5) && others == Some(1)).then_some(())
            },
        )
        .await;
    }
    no_prepared_transactions(&nodes).await;
    check_consistency(&nodes[0]);
}

/// A coordinator slow to decide is waited for, not overruled: with every part of a transfer
/// between two regions prepared, node 1's pgmr pauses 30 s before deciding
/// (`PGMR_FAILPOINT=2pc-slow-decide`), longer than the 20 s after which the participant's
/// sweep resolves a prepared transaction. The participant asks every live node whether it
/// still coordinates the transaction, node 1 says so, and the transfer commits. Before, the
/// sweep decided abort at 20 s and the client got "decided aborted while it prepared" (a
/// loaded CI run hit the same with prepares slowed by load).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_coordinator_is_waited_for_not_overruled() {
    let dir = scratch("data-2pc-slow");
    let mut nodes = start_cluster(dir.path(), 60, WAN, &[EAST_B, WEST_A, EU_B]).await;
    const PER: i32 = 1;
    regional_bank(&nodes, PER).await;
    let mut c = restart_with_failpoint(&mut nodes[0], "2pc-slow-decide", PER).await;
    sqlx::raw_sql(&format!(
        "BEGIN; {}; {}; COMMIT",
        transfer_sql(1, PER, -10, 1),
        transfer_sql(2, PER, 10, 1)
    ))
    .execute(&mut c)
    .await
    .expect("the transfer commits once its slow coordinator decides");
    no_prepared_transactions(&nodes).await;
    let b = balances_converged(&nodes).await;
    assert_eq!((b[0].2, b[1].2), (990, 1010), "{b:?}");
    check_consistency(&nodes[2]);
}

/// A TRUNCATE runs at the leaseholders of what it empties. `TRUNCATE accounts` of a REGIONAL
/// BY ROW table, whose partitions are leased on three nodes, through any node: every
/// partition is emptied on every replica and the table's global keys are released (the same
/// ids are taken again, in other regions). A partition truncated by itself is emptied on its
/// replicas too. Before, the first was refused at commit ("this node is not the
/// leaseholder"), and the second emptied only the leaseholder's copy (a partition has no
/// TRUNCATE trigger of its own to capture it), leaving the replicas differing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncate_runs_at_the_leaseholders_of_what_it_empties() {
    let dir = scratch("data-truncate");
    let nodes = start_cluster(dir.path(), 61, WAN, &[EAST_B, WEST_A, EU_B]).await;
    const PER: i32 = 2;
    regional_bank(&nodes, PER).await;
    let mut west = connect(&nodes[1], "mr").await.unwrap();
    exec(&mut west, "TRUNCATE accounts").await;
    for (i, n) in nodes.iter().enumerate() {
        eventually(
            &format!("node {}: no account left", i + 1),
            Duration::from_secs(30),
            || async {
                (count_in(n, "SELECT count(*) FROM accounts").await == Some(0)).then_some(())
            },
        )
        .await;
    }
    // The keys are free again: account 1 (us-east1 before) now in europe-west1, and so on.
    exec(
        &mut west,
        "INSERT INTO accounts (crdb_region, id, balance) VALUES \
         ('europe-west1', 1, 5), ('us-east1', 3, 5), ('us-west1', 5, 5), ('europe-west1', 2, 5)",
    )
    .await;
    let mut east = connect(&nodes[0], "mr").await.unwrap();
    exec(&mut east, "TRUNCATE accounts_europe_west1").await;
    for (i, n) in nodes.iter().enumerate() {
        eventually(
            &format!(
                "node {}: the europe-west1 accounts gone, the others kept",
                i + 1
            ),
            Duration::from_secs(30),
            || async {
                (count_in(n, "SELECT count(*) FROM accounts").await == Some(2)
                    && count_in(n, "SELECT count(*) FROM accounts_europe_west1").await == Some(0))
                .then_some(())
            },
        )
        .await;
    }
    // CASCADE over several leaseholders is refused, cleanly.
    let err = sqlx::query("TRUNCATE accounts CASCADE")
        .execute(&mut east)
        .await
        .expect_err("CASCADE over several leaseholders");
    assert_eq!(code(&err), "0A000", "{err}");
    check_consistency(&nodes[0]);
}

/// Tables moved to another region get a leaseholder there: six tables of the primary region
/// made REGIONAL BY TABLE IN us-west1, one after another, each take a write through node 1
/// right after. The move replaces the range's only voter (node 1) by node 2; before, node 2
/// asked for the lease as soon as the joint configuration reached it, took a term in which
/// node 1 could not replicate the final configuration to it, and node 1, a learner under
/// that configuration, would not vote for node 2's shorter log: the range stayed without a
/// leader for good (the first move in a `--global` demo hit it; here two runs of three
/// failed, at a later table's move: "range N has no leader").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_moved_to_another_region_get_a_leaseholder_there() {
    let dir = scratch("data-move");
    let nodes = start_cluster(dir.path(), 62, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let mut m = regional_accounts(&nodes).await;
    for i in 1..=6 {
        exec(
            &mut m,
            &format!("CREATE TABLE moved{i} (id int PRIMARY KEY)"),
        )
        .await;
        execute_all(
            &mut m,
            &[&format!(
                r#"ALTER TABLE moved{i} SET LOCALITY REGIONAL BY TABLE IN "us-west1""#
            )],
        )
        .await;
    }
    for i in 1..=6 {
        exec_once_settled(&mut m, &format!("INSERT INTO moved{i} VALUES (1)")).await;
        let sql = format!(
            "SELECT count(*) FROM multiregion.range_replicas r \
               JOIN multiregion.ranges USING (range_id) \
              WHERE table_name = 'moved{i}' AND r.node_id = 2 AND r.raft_state = 'leader' \
                AND lease_holder = 2"
        );
        eventually(
            &format!("moved{i} led and leased by node 2"),
            Duration::from_secs(30),
            || async { (count_in(&nodes[0], &sql).await == Some(1)).then_some(()) },
        )
        .await;
    }
    check_consistency(&nodes[0]);
}

/// One value a query returns, through a connection to `node`'s database `mr`.
async fn value_on(node: &Node, sql: &str) -> i64 {
    let mut c = eventually("database mr", Duration::from_secs(30), || {
        connect(node, "mr")
    })
    .await;
    sqlx::query_scalar(sql)
        .fetch_one(&mut c)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// A sequence is one counter for the cluster: a `bigserial` key of a REGIONAL BY ROW table,
/// whose partitions are leased by three nodes, takes distinct values when every region
/// inserts at once (each node drew from its own copy before: the same ids, and 23505 from
/// the key's global uniqueness); `nextval` through the nodes in turn climbs; and renames,
/// `setval`, `ALTER SEQUENCE … RESTART`, a drop and re-create, and `TRUNCATE … RESTART
/// IDENTITY` on one node are what the next draw on another node sees. A COPY that leaves
/// the key to its default draws from the counter as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_hands_out_each_value_once_through_every_node() {
    let dir = scratch("data-sequence-counter");
    let nodes = start_cluster(dir.path(), 63, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let mut m = regional_accounts(&nodes).await;
    execute_all(
        &mut m,
        &["CREATE TABLE orders (id bigserial PRIMARY KEY, note text) LOCALITY REGIONAL BY ROW"],
    )
    .await;
    exec(&mut m, "CREATE SEQUENCE s").await;
    for n in &nodes {
        let mut c = eventually("database mr", Duration::from_secs(30), || connect(n, "mr")).await;
        exec_once_settled(&mut c, "INSERT INTO orders (note) VALUES ('first')").await;
    }
    let inserts = nodes.iter().map(|n| async move {
        let port = n.pg_port;
        let mut c = try_connect_db(port, "mr").await;
        for i in 0..20 {
            let sql = format!("INSERT INTO orders (note) VALUES ('{port}-{i}')");
            sqlx::query(&sql)
                .execute(&mut c)
                .await
                .unwrap_or_else(|e| panic!("insert through port {port}: {e}"));
        }
    });
    futures::future::join_all(inserts).await;
    let distinct = "SELECT count(*) - count(DISTINCT id) FROM orders";
    assert_eq!(value_on(&nodes[0], "SELECT count(*) FROM orders").await, 63);
    assert_eq!(value_on(&nodes[0], distinct).await, 0, "every id distinct");
    let max = "SELECT max(id) FROM orders";
    assert_eq!(value_on(&nodes[2], max).await, 63, "dense");
    // COPY fills the key from the counter too (its defaults bypass the planner).
    let mut w = eventually("database mr", Duration::from_secs(30), || {
        connect(&nodes[1], "mr")
    })
    .await;
    let mut copy = w
        .copy_in_raw("COPY orders (note) FROM STDIN")
        .await
        .unwrap();
    copy.send("c1\nc2\nc3\n".as_bytes()).await.unwrap();
    assert_eq!(copy.finish().await.unwrap(), 3);
    exec(&mut m, "INSERT INTO orders (note) VALUES ('last')").await;
    assert_eq!(value_on(&nodes[0], "SELECT count(*) FROM orders").await, 67);
    assert_eq!(value_on(&nodes[0], distinct).await, 0, "every id distinct");
    assert!(value_on(&nodes[2], max).await > 66, "past the COPY's");

    let mut last = 0;
    for round in 0..2 {
        for n in &nodes {
            let v = value_on(n, "SELECT nextval('s')").await;
            assert!(v > last, "round {round}: {v} after {last}");
            last = v;
        }
    }
    assert_eq!(last, 6);

    exec(&mut m, "ALTER SEQUENCE s RENAME TO s2").await;
    assert_eq!(
        value_on(&nodes[1], "SELECT nextval('s2')").await,
        7,
        "renamed"
    );
    assert_eq!(value_on(&nodes[2], "SELECT setval('s2', 100)").await, 100);
    assert_eq!(
        value_on(&nodes[0], "SELECT nextval('s2')").await,
        101,
        "set"
    );
    exec(&mut m, "ALTER SEQUENCE s2 RESTART WITH 50").await;
    assert_eq!(
        value_on(&nodes[1], "SELECT nextval('s2')").await,
        50,
        "restarted"
    );
    exec(&mut m, "DROP SEQUENCE s2").await;
    exec(&mut m, "CREATE SEQUENCE s2").await;
    assert_eq!(
        value_on(&nodes[2], "SELECT nextval('s2')").await,
        1,
        "created again"
    );

    exec(&mut w, "TRUNCATE orders RESTART IDENTITY").await;
    assert_eq!(
        value_on(
            &nodes[2],
            "INSERT INTO orders (note) VALUES ('again') RETURNING id"
        )
        .await,
        1,
        "identity restarted"
    );
}

/// A foreign key added by a schema change is checked where the change is made, against a
/// copy that is up to date, and taken as valid by every node that applies the change after
/// it: a node whose copy of the referenced table lags (here node 3 lacks a parent row,
/// removed behind replication's back, as a replica still catching up after a restart lacks
/// it) refused the change with 23503 and its schema applier stayed stuck behind it (seen in
/// the compose demo: a conversion re-added `vehicles`' key to `users` on a restarted
/// learner, and the new partitions waited for that node for minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_key_added_elsewhere_is_not_rechecked_against_a_lagging_copy() {
    let dir = scratch("data-fk-lagging");
    let nodes = start_cluster(dir.path(), 64, WAN, &[EAST_B, WEST_A, EU_B]).await;
    bank(&nodes).await;
    let mut c = connect(&nodes[0], "bank").await.unwrap();
    exec(&mut c, "CREATE TABLE owners (id int PRIMARY KEY)").await;
    exec_once_settled(&mut c, "INSERT INTO owners VALUES (1), (2)").await;
    exec_once_settled(
        &mut c,
        "INSERT INTO accounts VALUES (1, 10, 'one'), (2, 20, 'two')",
    )
    .await;
    for n in &nodes {
        eventually(
            "both owners on every node",
            Duration::from_secs(30),
            || async {
                (count_in_db(n, "bank", "SELECT count(*) FROM owners").await? == 2).then_some(())
            },
        )
        .await;
    }
    converged(&nodes, &[0, 1, 2]).await;
    let mut lagging = connect(&nodes[2], "bank").await.unwrap();
    exec(
        &mut lagging,
        "SET session_replication_role = replica; DELETE FROM owners WHERE id = 2; \
         RESET session_replication_role",
    )
    .await;

    exec(
        &mut c,
        "ALTER TABLE accounts ADD CONSTRAINT accounts_owner FOREIGN KEY (id) REFERENCES owners (id)",
    )
    .await;
    for (i, n) in nodes.iter().enumerate() {
        eventually(
            &format!("node {} to have the valid foreign key", i + 1),
            Duration::from_secs(30),
            || async {
                let valid = count_in_db(
                    n,
                    "bank",
                    "SELECT count(*) FROM pg_constraint \
                     WHERE conname = 'accounts_owner' AND convalidated",
                )
                .await?;
                (valid == 1).then_some(())
            },
        )
        .await;
    }
    // The copy catches up; the key holds, and rows keep flowing to every node.
    exec(
        &mut lagging,
        "SET session_replication_role = replica; INSERT INTO owners VALUES (2); \
         RESET session_replication_role",
    )
    .await;
    exec(&mut lagging, "INSERT INTO owners VALUES (3)").await;
    exec(&mut lagging, "INSERT INTO accounts VALUES (3, 30, 'three')").await;
    let err = sqlx::query("INSERT INTO accounts VALUES (4, 40, 'no owner')")
        .execute(&mut lagging)
        .await
        .expect_err("owner 4 does not exist");
    assert_eq!(code(&err), "23503", "{err}");
    assert_eq!(converged(&nodes, &[0, 1, 2]).await.0, 3);
    check_consistency(&nodes[0]);
}

/// The foreign key of `table` named `name`, as node `node` prints it.
async fn fk_def(node: &Node, table: &str, name: &str) -> Option<String> {
    let mut c = connect(node, "mr").await?;
    sqlx::query_scalar(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = $1::regclass AND conname = $2",
    )
    .bind(table)
    .bind(name)
    .fetch_optional(&mut c)
    .await
    .ok()
    .flatten()
}

/// MovR's keys between REGIONAL BY ROW tables whose region is computed from `city` alike
/// (`vehicles (city, owner_id) → users (city, id)`) include the region once both tables are
/// REGIONAL BY ROW, on every node: a vehicle's check and its lock are taken in the owner's
/// partition in the row's own region, not in `users`' key table in the primary region. The
/// key means what it meant: a missing owner is 23503 through any node, an owner with
/// vehicles cannot go, a cascade still reaches the vehicles. When `users` stops being
/// REGIONAL BY ROW the key loses the region again; a key the region cannot be added to
/// (ON DELETE SET NULL) is left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_keys_between_tables_computing_the_region_alike_are_checked_in_the_rows_region() {
    let dir = scratch("data-fk-local");
    let nodes = start_cluster(dir.path(), 65, WAN, &[EAST_B, WEST_A, EU_B]).await;
    let mut m = regional_accounts(&nodes).await;
    let region = "CASE WHEN city IN ('new york', 'boston') THEN 'us-east1' \
                  WHEN city IN ('seattle', 'los angeles') THEN 'us-west1' ELSE 'europe-west1' END";
    let mut statements = vec![
        "CREATE TABLE users (city text, id int, name text, PRIMARY KEY (city, id))".to_string(),
        "CREATE TABLE vehicles (city text, id int, owner_id int, PRIMARY KEY (city, id), \
         CONSTRAINT vehicles_owner FOREIGN KEY (city, owner_id) REFERENCES users (city, id) ON DELETE CASCADE)"
            .to_string(),
        "CREATE TABLE notes (city text, id int PRIMARY KEY, owner_id int, \
         CONSTRAINT notes_owner FOREIGN KEY (city, owner_id) REFERENCES users (city, id) ON DELETE SET NULL)"
            .to_string(),
    ];
    for t in ["users", "vehicles", "notes"] {
        statements.push(format!(
            "ALTER TABLE {t} ADD COLUMN region crdb_internal_region AS ({region}) STORED"
        ));
        statements.push(format!("ALTER TABLE {t} ALTER COLUMN region SET NOT NULL"));
        statements.push(format!(
            r#"ALTER TABLE {t} SET LOCALITY REGIONAL BY ROW AS "region""#
        ));
    }
    let statements: Vec<&str> = statements.iter().map(String::as_str).collect();
    execute_all(&mut m, &statements).await;
    for (i, n) in nodes.iter().enumerate() {
        eventually(
            &format!("node {}: the vehicles' key includes the region", i + 1),
            Duration::from_secs(30),
            || async {
                let def = fk_def(n, "vehicles", "vehicles_owner").await?;
                (def == "FOREIGN KEY (region, city, owner_id) REFERENCES users(region, city, id) ON DELETE CASCADE")
                    .then_some(())
            },
        )
        .await;
    }
    assert_eq!(
        fk_def(&nodes[0], "notes", "notes_owner").await.unwrap(),
        "FOREIGN KEY (city, owner_id) REFERENCES multiregion_keys.users_users_pkey(city, id) ON DELETE SET NULL",
        "SET NULL would null the region: left as it was"
    );

    // Through the us-west1 node, for a seattle owner; through node 1 for a paris one.
    let mut west = connect(&nodes[1], "mr").await.unwrap();
    exec_once_settled(
        &mut west,
        "INSERT INTO users (city, id, name) VALUES ('seattle', 1, 'ann')",
    )
    .await;
    exec_once_settled(
        &mut west,
        "INSERT INTO vehicles (city, id, owner_id) VALUES ('seattle', 10, 1)",
    )
    .await;
    let mut east = connect(&nodes[0], "mr").await.unwrap();
    exec_once_settled(
        &mut east,
        "INSERT INTO users (city, id, name) VALUES ('paris', 2, 'bob')",
    )
    .await;
    exec_once_settled(
        &mut east,
        "INSERT INTO vehicles (city, id, owner_id) VALUES ('paris', 20, 2)",
    )
    .await;
    for (node, sql) in [
        (
            1,
            "INSERT INTO vehicles (city, id, owner_id) VALUES ('seattle', 11, 2)",
        ),
        (
            0,
            "INSERT INTO vehicles (city, id, owner_id) VALUES ('paris', 21, 1)",
        ),
        (0, "UPDATE vehicles SET owner_id = 3 WHERE id = 10"),
    ] {
        let c = if node == 0 { &mut east } else { &mut west };
        let err = sqlx::query(sql).execute(&mut *c).await.expect_err(sql);
        assert_eq!(code(&err), "23503", "{sql}: {err}");
        assert!(err.to_string().contains("vehicles_owner"), "{err}");
    }
    exec(&mut east, "DELETE FROM users WHERE id = 1").await;
    for (i, n) in nodes.iter().enumerate() {
        eventually(
            &format!("node {}: the cascade removed seattle's vehicle", i + 1),
            Duration::from_secs(30),
            || async {
                let v = count_in(n, "SELECT count(*) FROM vehicles").await?;
                (v == 1).then_some(())
            },
        )
        .await;
    }

    exec(&mut m, r#"SELECT multiregion.execute('ALTER TABLE users SET LOCALITY REGIONAL BY TABLE IN PRIMARY REGION')"#).await;
    for (i, n) in nodes.iter().enumerate() {
        eventually(
            &format!("node {}: the key without the region again", i + 1),
            Duration::from_secs(30),
            || async {
                let def = fk_def(n, "vehicles", "vehicles_owner").await?;
                (def == "FOREIGN KEY (city, owner_id) REFERENCES users(city, id) ON DELETE CASCADE")
                    .then_some(())
            },
        )
        .await;
    }
    let err = sqlx::query("INSERT INTO vehicles (city, id, owner_id) VALUES ('paris', 22, 9)")
        .execute(&mut west)
        .await
        .expect_err("owner 9 does not exist");
    assert_eq!(code(&err), "23503", "{err}");
    exec_once_settled(
        &mut west,
        "INSERT INTO vehicles (city, id, owner_id) VALUES ('paris', 22, 2)",
    )
    .await;
    no_prepared_transactions(&nodes).await;
    check_consistency(&nodes[0]);
}

/// DROP REGION is refused where it is typed while the region's partitions hold rows, even on
/// a node that holds no replica of them (PLACEMENT RESTRICTED keeps every replica in its
/// region): the check asks each partition's leaseholder, so no node is left unable to apply a
/// committed change and no row is dropped with its partition. Once the leaseholder has none
/// the region drops everywhere, the nodes that left its partition included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_with_rows_elsewhere_cannot_be_dropped_through_a_node_without_them() {
    let dir = scratch("data-drop-region");
    let nodes = start_cluster(dir.path(), 67, WAN, &[EAST_B, WEST_A, EU_B]).await;
    regional_bank(&nodes, 1).await;
    let mut east = connect(&nodes[0], "mr").await.unwrap();
    let mut west = connect(&nodes[1], "mr").await.unwrap();
    // Account 2 leaves us-west1 while every node has a replica there; account 21 arrives
    // there and stays on the other nodes' copies after they lose their replicas.
    exec(&mut west, "DELETE FROM accounts WHERE id = 2").await;
    exec(
        &mut west,
        "INSERT INTO accounts (id, balance) VALUES (21, 5)",
    )
    .await;
    for n in &nodes {
        eventually("account 21 everywhere", Duration::from_secs(30), || async {
            let mut c = connect(n, "mr").await?;
            let here: i64 =
                sqlx::query_scalar("SELECT count(*) FROM accounts_us_west1 WHERE id = 21")
                    .fetch_one(&mut c)
                    .await
                    .ok()?;
            (here == 1).then_some(())
        })
        .await;
    }
    restrict_to_home_regions(&nodes, &mut east).await;
    // Account 21 leaves, account 20 arrives: only the us-west1 node's copy knows.
    exec(&mut west, "DELETE FROM accounts WHERE id = 21").await;
    exec(
        &mut west,
        "INSERT INTO accounts (id, balance) VALUES (20, 7)",
    )
    .await;
    let drop_west = r#"SELECT multiregion.execute('ALTER DATABASE mr DROP REGION "us-west1"')"#;
    let err = sqlx::raw_sql(drop_west)
        .execute(&mut east)
        .await
        .unwrap_err();
    assert_eq!(code(&err), "2BP01", "{err}");
    assert!(
        err.to_string().contains(
            r#"could not remove enum value "us-west1" as it is being used by "public.accounts" in row: (20,7"#
        ),
        "{err}"
    );
    let regions = "SELECT cardinality(regions)::int8 FROM multiregion.database_regions() \
                   WHERE database_name = 'mr'";
    for n in &nodes {
        let mut c = connect(n, "mr").await.unwrap();
        let n_regions: i64 = sqlx::query_scalar(regions).fetch_one(&mut c).await.unwrap();
        assert_eq!(n_regions, 3, "node {}: nothing changed", n.pg_port);
    }

    // Without the row (deleted through the same node, at its leaseholder) it drops, and
    // every node applies it, those whose copy still holds account 21 too.
    exec(
        &mut east,
        "DELETE FROM accounts WHERE crdb_region = 'us-west1'",
    )
    .await;
    exec(&mut east, drop_west).await;
    for n in &nodes {
        eventually(
            "the region dropped on every node",
            Duration::from_secs(30),
            || async {
                let mut c = connect(n, "mr").await?;
                let (regions, failing): (i64, i64) = sqlx::query_as(&format!(
                    "SELECT ({regions}), (SELECT count(*) FROM multiregion.schema_appliers \
                     WHERE failed_version IS NOT NULL)"
                ))
                .fetch_one(&mut c)
                .await
                .ok()?;
                (regions == 2 && failing == 0).then_some(())
            },
        )
        .await;
    }
    check_consistency(&nodes[0]);
}

/// Schema changes that check rows, typed on a node that holds no replica of some partitions
/// (PLACEMENT RESTRICTED), check the rows of every region before they commit. A UNIQUE index
/// on a REGIONAL BY ROW table reads each partition where it can be: a key held in two
/// regions refuses it with PostgreSQL's 23505; without one it is created and enforced across
/// regions, through any node. A CHECK constraint is tried at the leaseholders of the
/// partitions that node lacks: a row there that violates it refuses it with PostgreSQL's
/// 23514 (it passed on that node's empty copy, and failed on the holder's applier after
/// the commit). The copies of the partitions that node left are emptied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_changes_that_check_rows_check_every_region_through_a_node_without_them() {
    let dir = scratch("data-unique-restricted");
    let nodes = start_cluster(dir.path(), 68, WAN, &[EAST_B, WEST_A, EU_B]).await;
    regional_bank(&nodes, 1).await;
    let mut east = connect(&nodes[0], "mr").await.unwrap();
    let mut west = connect(&nodes[1], "mr").await.unwrap();
    restrict_to_home_regions(&nodes, &mut east).await;
    // Its copies of the partitions it left are emptied (they would only age: reads go to
    // the replicas, and a schema change applied here would meet rows deleted since).
    eventually(
        "the us-east1 node's copies of the other partitions emptied",
        Duration::from_secs(60),
        || async {
            let mut c = connect(&nodes[0], "mr").await?;
            let left: i64 = sqlx::query_scalar(
                "SELECT multiregion.count_local('SELECT count(*) FROM accounts_us_west1', '{}') \
                      + multiregion.count_local('SELECT count(*) FROM accounts_europe_west1', '{}')",
            )
            .fetch_one(&mut c)
            .await
            .ok()?;
            (left == 0).then_some(())
        },
    )
    .await;
    let kept: i64 = sqlx::query_scalar(
        "SELECT multiregion.count_local('SELECT count(*) FROM accounts_us_east1', '{}')",
    )
    .fetch_one(&mut east)
    .await
    .unwrap();
    assert_eq!(kept, 1, "the partition it still holds keeps its row");
    // Every account holds 1000: the same balance in three regions.
    let create = "CREATE UNIQUE INDEX accounts_balance ON accounts (balance)";
    let err = sqlx::raw_sql(create).execute(&mut east).await.unwrap_err();
    assert_eq!(code(&err), "23505", "{err}");
    assert!(
        err.to_string()
            .contains(r#"could not create unique index "accounts_balance""#),
        "{err}"
    );
    let indexes = "SELECT count(*) FROM pg_indexes \
                   WHERE schemaname = 'public' AND indexname = 'accounts_balance'";
    let n: i64 = sqlx::query_scalar(indexes)
        .fetch_one(&mut east)
        .await
        .unwrap();
    assert_eq!(n, 0, "nothing created");

    // Distinct balances (written at each partition's leaseholder): created, and enforced
    // through the us-west1 node against the us-east1 row.
    exec(&mut east, "UPDATE accounts SET balance = id * 10").await;
    exec(&mut east, create).await;
    for n in &nodes {
        eventually("the index everywhere", Duration::from_secs(30), || async {
            let mut c = connect(n, "mr").await?;
            let k: i64 = sqlx::query_scalar(indexes).fetch_one(&mut c).await.ok()?;
            (k == 1).then_some(())
        })
        .await;
    }
    let err = sqlx::raw_sql("INSERT INTO accounts (id, balance) VALUES (22, 10)")
        .execute(&mut west)
        .await
        .unwrap_err();
    assert_eq!(code(&err), "23505", "{err}");
    exec(
        &mut west,
        "INSERT INTO accounts (id, balance) VALUES (22, 220)",
    )
    .await;

    // Account 22 (us-west1, 220) breaks the constraint; this node holds none of its rows.
    let err = sqlx::raw_sql("ALTER TABLE accounts ADD CONSTRAINT small CHECK (balance < 100)")
        .execute(&mut east)
        .await
        .unwrap_err();
    assert_eq!(code(&err), "23514", "{err}");
    assert!(err.to_string().contains("is violated by some row"), "{err}");
    exec(
        &mut east,
        "ALTER TABLE accounts ADD CONSTRAINT small CHECK (balance < 1000)",
    )
    .await;
    for n in &nodes {
        eventually(
            "the constraint everywhere, no applier failing",
            Duration::from_secs(30),
            || async {
                let mut c = connect(n, "mr").await?;
                let (k, failing): (i64, i64) = sqlx::query_as(
                    "SELECT (SELECT count(*) FROM pg_constraint WHERE conname = 'small' \
                              AND conrelid = 'accounts'::regclass), \
                            (SELECT count(*) FROM multiregion.schema_appliers \
                              WHERE failed_version IS NOT NULL)",
                )
                .fetch_one(&mut c)
                .await
                .ok()?;
                assert_eq!(failing, 0, "node {}: an applier failed", n.pg_port);
                (k == 1).then_some(())
            },
        )
        .await;
    }
    check_consistency(&nodes[0]);
}

/// DROP REGION fences the REGIONAL BY ROW tables at their leaseholders where it is typed: a
/// row written into the region at its partition's leaseholder while the change is open waits
/// for it, and is refused once it commits, instead of being acknowledged into a partition the
/// change drops (and every node with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_written_into_a_region_being_dropped_waits_and_is_refused() {
    let dir = scratch("data-drop-region-fence");
    let nodes = start_cluster(dir.path(), 69, WAN, &[EAST_B, WEST_A, EU_B]).await;
    regional_bank(&nodes, 1).await;
    let mut east = connect(&nodes[0], "mr").await.unwrap();
    exec(
        &mut east,
        "DELETE FROM accounts WHERE crdb_region = 'us-west1'",
    )
    .await;
    exec(&mut east, "BEGIN").await;
    exec(
        &mut east,
        r#"SELECT multiregion.execute('ALTER DATABASE mr DROP REGION "us-west1"')"#,
    )
    .await;
    // Written through the us-west1 node, the partition's leaseholder.
    let west_port = nodes[1].pg_port;
    let writer = tokio::spawn(async move {
        let mut west = try_connect_db(west_port, "mr").await;
        sqlx::query("INSERT INTO accounts (crdb_region, id, balance) VALUES ('us-west1', 99, 1)")
            .execute(&mut west)
            .await
            .map(|_| ())
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    exec(&mut east, "COMMIT").await;
    let written = writer.await.unwrap();
    assert!(
        written.is_err(),
        "a row acknowledged into the dropped region"
    );
    for n in &nodes {
        eventually(
            "the region dropped on every node",
            Duration::from_secs(30),
            || async {
                let mut c = connect(n, "mr").await?;
                let (regions, failing, lost): (i64, i64, i64) = sqlx::query_as(
                    "SELECT (SELECT cardinality(regions)::int8 FROM multiregion.database_regions() \
                              WHERE database_name = 'mr'), \
                            (SELECT count(*) FROM multiregion.schema_appliers \
                              WHERE failed_version IS NOT NULL), \
                            multiregion.count_local('SELECT count(*) FROM accounts WHERE id = 99', '{}')",
                )
                .fetch_one(&mut c)
                .await
                .ok()?;
                assert_eq!(lost, 0, "node {}: the refused row is nowhere", n.pg_port);
                (regions == 2 && failing == 0).then_some(())
            },
        )
        .await;
    }
    check_consistency(&nodes[0]);
}

/// Makes database `mr` PLACEMENT RESTRICTED through `east`, the first node's session, and
/// waits until that node holds no replica of the other regions' `accounts` partitions.
async fn restrict_to_home_regions(nodes: &[Node], east: &mut PgConnection) {
    exec(
        east,
        r#"SELECT multiregion.execute('ALTER DATABASE mr PLACEMENT RESTRICTED')"#,
    )
    .await;
    let east_id: i64 = sqlx::query_scalar("SELECT node_id FROM multiregion.node_info()")
        .fetch_one(&mut *east)
        .await
        .unwrap();
    eventually(
        "the us-east1 node without a replica of the other regions' partitions",
        Duration::from_secs(60),
        || async {
            let mut c = connect(&nodes[0], "mr").await?;
            let holds: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM multiregion.ranges \
                 WHERE database_name = 'mr' AND table_name = 'accounts' \
                   AND partition <> 'us-east1' \
                   AND $1 = ANY (voting_replicas || non_voting_replicas)",
            )
            .bind(east_id)
            .fetch_one(&mut c)
            .await
            .ok()?;
            (holds == 0).then_some(())
        },
    )
    .await;
}
