//! Replicated schema: databases, DDL and roles reach every node in one order, and only what
//! commits — on real `pgmr start` processes behind the tutorial's simulated WAN.

mod common;

use common::*;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::ConnectOptions;
use std::time::Duration;

const WAN: &str =
    "intra 2\nus-east1 us-west1 63\nus-east1 europe-west1 87\nus-west1 europe-west1 132\n";
const LOCALITIES: [&str; 3] = [
    "region=us-east1,zone=us-east1-b",
    "region=us-west1,zone=us-west1-a",
    "region=europe-west1,zone=europe-west1-b",
];

async fn one(c: &mut PgConnection, sql: &str) -> String {
    sqlx::query_scalar::<_, Option<String>>(sql)
        .fetch_one(c)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .unwrap_or_default()
}

/// Whether database `db` exists on `node`.
async fn has_database(node: &Node, db: &str) -> bool {
    let mut c = node.sql().await;
    let q = format!("SELECT count(*)::text FROM pg_database WHERE datname = '{db}'");
    one(&mut c, &q).await == "1"
}

/// Creates database `db` through the first node and waits until every node has it.
async fn create_everywhere(nodes: &[Node], db: &str) {
    exec(&mut nodes[0].sql().await, &format!("CREATE DATABASE {db}")).await;
    for n in nodes {
        eventually(
            "the database on every node",
            Duration::from_secs(20),
            || async { has_database(n, db).await.then_some(()) },
        )
        .await;
    }
}

/// The tables of `public` in `db` on `node`, sorted.
async fn tables(node: &Node, db: &str) -> Vec<String> {
    let mut c = connect(node, db).await.expect("the database exists");
    sqlx::query_scalar(
        "SELECT relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') ORDER BY 1",
    )
    .fetch_all(&mut c)
    .await
    .unwrap()
}

/// CREATE DATABASE and DROP DATABASE through any node reach every node; DDL takes effect on
/// the other nodes only when its transaction commits (a rolled-back transaction or savepoint
/// reaches none; a transaction's changes are one schema version); a transaction that lost a
/// race with another node's schema change fails with 40001 and leaves nothing anywhere; a
/// transaction with uncommitted DDL cannot send statements to another node's leaseholder;
/// roles, their passwords (as PostgreSQL's verifier) and memberships are cluster-wide.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_changes_reach_every_node_when_they_commit_and_databases_and_roles_are_cluster_wide()
{
    let dir = scratch("schema");
    let nodes = start_cluster(dir.path(), 47, WAN, &LOCALITIES).await;

    // A plain database, created through node 1, exists everywhere.
    create_everywhere(&nodes, "app").await;

    // A rolled-back transaction's DDL reaches no node; a committed one reaches all (its
    // COMMIT returns once every live node applied it).
    let mut a = connect(&nodes[0], "app").await.unwrap();
    exec(&mut a, "BEGIN; CREATE TABLE gone (id int); ROLLBACK").await;
    exec(
        &mut a,
        "BEGIN; CREATE TABLE kept (id int PRIMARY KEY); SAVEPOINT s; CREATE TABLE undone (x int); \
         ROLLBACK TO s; ALTER TABLE kept ADD COLUMN note text; COMMIT",
    )
    .await;
    for n in &nodes {
        assert_eq!(tables(n, "app").await, vec!["kept"], "node {}", n.pg_port);
        let mut c = connect(n, "app").await.unwrap();
        assert_eq!(
            one(&mut c, "SELECT multiregion.schema_version()::text").await,
            "1",
            "one version for the transaction, on node {}",
            n.pg_port
        );
        assert_eq!(
            one(
                &mut c,
                "SELECT count(*)::text FROM pg_attribute WHERE attrelid = 'kept'::regclass AND attname = 'note'"
            )
            .await,
            "1"
        );
    }

    // Two nodes change the schema at once. Changes that do not conflict both commit, in the
    // order they committed; for two that conflict (one table name), the one committed second
    // fails with 40001 and is nowhere, not even where it ran, while the first waits for it
    // (as PostgreSQL's DDL waits for a lock) and then is everywhere.
    let mut b = connect(&nodes[1], "app").await.unwrap();
    exec(&mut a, "BEGIN; CREATE TABLE mine (id int)").await;
    exec(&mut b, "CREATE TABLE theirs (id int)").await;
    exec(&mut a, "COMMIT").await;
    for n in &nodes {
        assert_eq!(
            tables(n, "app").await,
            vec!["kept", "mine", "theirs"],
            "node {}",
            n.pg_port
        );
    }
    exec(&mut a, "BEGIN; CREATE TABLE dup (id int)").await;
    let first = exec(&mut b, "CREATE TABLE dup (label text)");
    let second = async {
        // Node 3 applied it: the change is committed in the meta group.
        eventually(
            "the first change elsewhere",
            Duration::from_secs(20),
            || async {
                let mut c = connect(&nodes[2], "app").await?;
                let v = one(&mut c, "SELECT multiregion.schema_version()::text").await;
                (v == "4").then_some(())
            },
        )
        .await;
        sqlx::raw_sql("COMMIT").execute(&mut a).await.unwrap_err()
    };
    let ((), err) = tokio::join!(first, second);
    assert_eq!(code(&err), "40001", "{err}");
    for n in &nodes {
        let mut c = connect(n, "app").await.unwrap();
        assert_eq!(
            one(
                &mut c,
                "SELECT string_agg(attname, ',') FROM pg_attribute \
                 WHERE attrelid = 'dup'::regclass AND attnum > 0"
            )
            .await,
            "label",
            "node {}",
            n.pg_port
        );
        assert_eq!(
            one(&mut c, "SELECT multiregion.schema_version()::text").await,
            "4"
        );
    }

    // With replication on, a transaction that changed the schema cannot send a statement to a
    // leaseholder elsewhere (that node would run it against the old schema).
    exec(
        &mut a,
        "SELECT multiregion.set_cluster_setting('multiregion.replication.enabled', 'true')",
    )
    .await;
    exec(&mut a, "INSERT INTO kept VALUES (0, 'first')").await;
    let holder: i64 = eventually("a leaseholder", Duration::from_secs(30), || async {
        let mut c = connect(&nodes[0], "app").await?;
        sqlx::query_scalar::<_, Option<i64>>(
            "SELECT lease_holder FROM multiregion.ranges WHERE table_name = 'kept'",
        )
        .fetch_one(&mut c)
        .await
        .ok()
        .flatten()
    })
    .await;
    // Node ids follow the start order.
    let other = (0..nodes.len()).find(|&i| i as i64 + 1 != holder).unwrap();
    let mut o = connect(&nodes[other], "app").await.unwrap();
    exec(&mut o, "BEGIN; ALTER TABLE kept ADD COLUMN extra int").await;
    let err = sqlx::raw_sql("INSERT INTO kept VALUES (1, 'x', 1)")
        .execute(&mut o)
        .await
        .unwrap_err();
    assert_eq!(code(&err), "0A000", "{err}");
    exec(&mut o, "ROLLBACK").await;
    exec(
        &mut o,
        "INSERT INTO kept VALUES (1, 'through another node')",
    )
    .await;

    // Roles: created, altered and dropped through one node, everywhere; the password travels
    // as the verifier PostgreSQL stored, and logging in works on another node.
    exec(
        &mut a,
        "CREATE ROLE regress_reader LOGIN PASSWORD 'swordfish' CONNECTION LIMIT 7; \
         CREATE ROLE regress_group; GRANT regress_group TO regress_reader; \
         GRANT SELECT ON kept TO regress_reader",
    )
    .await;
    let verifier = one(
        &mut a,
        "SELECT rolpassword FROM pg_authid WHERE rolname = 'regress_reader'",
    )
    .await;
    assert!(verifier.starts_with("SCRAM-SHA-256$"), "{verifier}");
    for n in &nodes[1..] {
        let mut c = connect(n, "app").await.unwrap();
        assert_eq!(
            one(
                &mut c,
                "SELECT rolpassword || ' ' || rolconnlimit || ' ' || rolcanlogin \
                 FROM pg_authid WHERE rolname = 'regress_reader'"
            )
            .await,
            format!("{verifier} 7 true")
        );
        assert_eq!(
            one(
                &mut c,
                "SELECT pg_has_role('regress_reader', 'regress_group', 'MEMBER')::text || ' ' || \
                 has_table_privilege('regress_reader', 'kept', 'SELECT')::text"
            )
            .await,
            "true true"
        );
    }
    let mut reader = PgConnectOptions::new()
        .host("127.0.0.1")
        .port(nodes[2].pg_port)
        .username("regress_reader")
        .password("swordfish")
        .database("app")
        .connect()
        .await
        .expect("the role logs in on another node");
    assert_eq!(
        one(&mut reader, "SELECT count(*)::text FROM kept").await,
        "2"
    );
    drop(reader);
    exec(
        &mut a,
        "ALTER ROLE regress_reader NOLOGIN; REVOKE SELECT ON kept FROM regress_reader; \
         DROP ROLE regress_reader; DROP ROLE regress_group",
    )
    .await;
    for n in &nodes[1..] {
        let mut c = connect(n, "app").await.unwrap();
        assert_eq!(
            one(
                &mut c,
                "SELECT count(*)::text FROM pg_roles WHERE rolname LIKE 'regress\\_%'"
            )
            .await,
            "0",
            "node {}",
            n.pg_port
        );
    }

    // DROP DATABASE through node 2 drops every copy; created again through node 3, it starts
    // from nothing everywhere (not from an old copy's schema).
    drop((a, b, o));
    exec(
        &mut nodes[1].sql().await,
        "SELECT multiregion.set_cluster_setting('multiregion.replication.enabled', 'false')",
    )
    .await;
    exec(&mut nodes[1].sql().await, "DROP DATABASE app WITH (FORCE)").await;
    for n in &nodes {
        eventually(
            "the database dropped everywhere",
            Duration::from_secs(20),
            || async { (!has_database(n, "app").await).then_some(()) },
        )
        .await;
    }
    exec(&mut nodes[2].sql().await, "CREATE DATABASE app").await;
    exec(
        &mut connect(&nodes[2], "app").await.unwrap(),
        "CREATE TABLE fresh (id int)",
    )
    .await;
    for n in &nodes {
        eventually(
            "the new database everywhere",
            Duration::from_secs(20),
            || async { has_database(n, "app").await.then_some(()) },
        )
        .await;
        assert_eq!(tables(n, "app").await, vec!["fresh"], "node {}", n.pg_port);
        let mut c = connect(n, "app").await.unwrap();
        assert_eq!(
            one(&mut c, "SELECT multiregion.schema_version()::text").await,
            "1"
        );
    }
}

/// A node that cannot apply a committed schema change (its copy has a table of the same name,
/// made behind replication's back) is shown failing on every node — version and PostgreSQL's
/// error in `multiregion.schema_appliers`; once the cause is removed on that node, its
/// applier catches up by itself and the failure is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_schema_applier_is_shown_everywhere_and_catches_up_once_fixed() {
    let dir = scratch("schema-failing");
    let nodes = start_cluster(dir.path(), 66, WAN, &LOCALITIES).await;
    create_everywhere(&nodes, "app").await;
    let mut b = connect(&nodes[1], "app").await.unwrap();
    let b_id = one(&mut b, "SELECT crdb_internal.node_id()::text").await;
    exec(
        &mut b,
        "SET multiregion.replicate_ddl = off; CREATE TABLE clash (label text)",
    )
    .await;

    let mut a = connect(&nodes[0], "app").await.unwrap();
    exec(&mut a, "CREATE TABLE clash (id int PRIMARY KEY)").await;
    let failing = format!(
        "SELECT failed_version::text || ': ' || error FROM multiregion.schema_appliers \
         WHERE database_name = 'app' AND node_id = {b_id}"
    );
    for n in &nodes {
        let shown = eventually(
            "the failure shown on every node",
            Duration::from_secs(20),
            || async {
                let s = one(&mut connect(n, "app").await?, &failing).await;
                (!s.is_empty()).then_some(s)
            },
        )
        .await;
        assert!(
            shown.contains("relation \"clash\" already exists"),
            "node {}: {shown}",
            n.pg_port
        );
    }

    // Fixed on that node (its own table dropped, behind replication's back again): the
    // applier retries on its own and the replicated table arrives there.
    exec(&mut b, "DROP TABLE clash").await;
    eventually(
        "the failing node caught up",
        Duration::from_secs(30),
        || async {
            let mut c = connect(&nodes[0], "app").await?;
            let s = one(
                &mut c,
                &format!(
                    "SELECT (applied_version = latest_version AND failed_version IS NULL)::text \
                     FROM multiregion.schema_appliers WHERE database_name = 'app' AND node_id = {b_id}"
                ),
            )
            .await;
            (s == "true").then_some(())
        },
    )
    .await;
    assert_eq!(
        one(
            &mut b,
            "SELECT string_agg(attname, ',') FROM pg_attribute \
             WHERE attrelid = 'clash'::regclass AND attnum > 0"
        )
        .await,
        "id"
    );
}
