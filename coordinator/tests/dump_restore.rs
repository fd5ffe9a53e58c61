//! `pg_dump` of a multi-region database and `pg_restore` into a fresh cluster, on real
//! `pgmr start` processes behind the tutorial's simulated WAN: the restored database keeps its
//! regions, localities, hidden column, computed region, global keys, sequences and rows on
//! every node, and behaves as the original did.

mod common;

use common::*;
use sqlx::postgres::PgConnection;
use sqlx::{Column, Row};
use std::path::Path;
use std::time::Duration;

const WAN: &str =
    "intra 2\nus-east1 us-west1 63\nus-east1 europe-west1 87\nus-west1 europe-west1 132\n";
const LOCALITIES: [&str; 3] = [
    "region=us-east1,zone=us-east1-b",
    "region=us-west1,zone=us-west1-a",
    "region=europe-west1,zone=europe-west1-b",
];

/// Every locality, a hidden region column with a key unique across regions, a computed
/// region, a serial and an identity column.
const SCHEMA: &[&str] = &[
    r#"ALTER DATABASE shop PRIMARY REGION "us-east1""#,
    r#"ALTER DATABASE shop ADD REGION "us-west1""#,
    r#"ALTER DATABASE shop ADD REGION "europe-west1""#,
    "CREATE TABLE users (id serial PRIMARY KEY, email text UNIQUE, name text)",
    "ALTER TABLE users SET LOCALITY REGIONAL BY ROW",
    "CREATE TABLE promo (code text PRIMARY KEY, pct int)",
    "ALTER TABLE promo SET LOCALITY GLOBAL",
    "CREATE TABLE audit (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, what text)",
    r#"ALTER TABLE audit SET LOCALITY REGIONAL BY TABLE IN "us-west1""#,
    "CREATE TABLE rides (id int PRIMARY KEY, city text NOT NULL, user_id int REFERENCES users (id))",
    "ALTER TABLE rides ADD COLUMN region crdb_internal_region AS (CASE WHEN city = 'paris' \
     THEN 'europe-west1' WHEN city = 'seattle' THEN 'us-west1' ELSE 'us-east1' END) STORED",
    "ALTER TABLE rides ALTER COLUMN region SET NOT NULL",
    r#"ALTER TABLE rides SET LOCALITY REGIONAL BY ROW AS "region""#,
];

const ROWS: &str = "\
    INSERT INTO users (email, name, crdb_region) SELECT 'u' || i || '@x', 'user ' || i, \
      (ARRAY['us-east1', 'us-west1', 'europe-west1'])[i % 3 + 1]::crdb_internal_region \
      FROM generate_series(1, 30) i; \
    INSERT INTO promo SELECT 'c' || i, i FROM generate_series(1, 5) i; \
    INSERT INTO audit (what) SELECT 'a' || i FROM generate_series(1, 7) i; \
    INSERT INTO rides SELECT i, (ARRAY['paris', 'seattle', 'boston'])[i % 3 + 1], i \
      FROM generate_series(1, 12) i";

/// What the restored database must show on every node, as one text per line.
const SHAPE: &[&str] = &[
    "SELECT string_agg((r::jsonb ->> 'region') || CASE WHEN (r::jsonb ->> 'primary')::bool \
       THEN '*' ELSE '' END, ',' ORDER BY r::jsonb ->> 'region') \
       FROM multiregion.execute('SHOW REGIONS FROM DATABASE') AS e(r)",
    "SELECT string_agg((r::jsonb ->> 'table_name') || ': ' || (r::jsonb ->> 'locality'), '; ' \
       ORDER BY r::jsonb ->> 'table_name') FROM multiregion.execute('SHOW TABLES') AS e(r)",
    "SELECT string_agg(crdb_region || '=' || n, ',' ORDER BY crdb_region) \
       FROM (SELECT crdb_region, count(*) n FROM users GROUP BY 1) s",
    "SELECT string_agg(region || '=' || n, ',' ORDER BY region) \
       FROM (SELECT region, count(*) n FROM rides GROUP BY 1) s",
    "SELECT (SELECT count(*) FROM promo) || ' promo, ' || (SELECT count(*) FROM audit) || ' audit'",
    "SELECT string_agg(c.relname || ':' || (SELECT count(*) FROM multiregion.global_key g \
       WHERE g.relid = c.oid), ',' ORDER BY c.relname) FROM pg_class c \
       WHERE c.relname IN ('users', 'rides') AND c.relnamespace = 'public'::regnamespace",
];

async fn one(c: &mut PgConnection, sql: &str) -> String {
    sqlx::query_scalar::<_, Option<String>>(sql)
        .fetch_one(c)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .unwrap_or_default()
}

async fn shape(node: &Node) -> Vec<String> {
    let mut c = connect(node, "shop").await.expect("database shop");
    let mut out = Vec::new();
    for q in SHAPE {
        out.push(one(&mut c, q).await);
    }
    // The hidden column stays out of SELECT *.
    let row = sqlx::query("SELECT * FROM users WHERE id = 1")
        .fetch_one(&mut c)
        .await
        .unwrap();
    out.push(
        row.columns()
            .iter()
            .map(|c| c.name().to_string())
            .collect::<Vec<_>>()
            .join(","),
    );
    out
}

fn pg_tool(name: &str) -> String {
    let bindir = std::process::Command::new(
        std::env::var("PG_CONFIG").unwrap_or("/usr/lib/postgresql/15/bin/pg_config".into()),
    )
    .arg("--bindir")
    .output()
    .expect("pg_config runs");
    format!("{}/{name}", String::from_utf8_lossy(&bindir.stdout).trim())
}

/// Runs a PostgreSQL client tool against `node`, which must succeed; its stdout.
fn run_tool(tool: &str, node: &Node, args: &[&str]) -> String {
    let port = node.pg_port.to_string();
    let out = std::process::Command::new(pg_tool(tool))
        .args(["-h", "127.0.0.1", "-p", &port, "-U", "postgres"])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{tool} runs: {e}"));
    assert!(
        out.status.success(),
        "{tool} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn subdir(root: &Path, name: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let d = root.join(name);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o711)).unwrap();
    d
}

/// A multi-region database dumped with pg_dump through one node of a cluster (right after
/// rows were written through another: the dump's snapshot must hold them) and restored with
/// pg_restore and `multiregion.post_restore()` into a new database of a fresh cluster has the
/// same regions, localities, hidden column, global keys and rows on every node; new rows
/// continue its sequences, keys stay unique across regions, partitions are leased in their
/// regions, and every replica agrees. Adopting twice, or adopting nothing, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dump_restored_into_a_fresh_cluster_keeps_regions_localities_hidden_columns_and_rows() {
    let dir = scratch("dump-restore");
    let source = start_cluster(&subdir(dir.path(), "a"), 70, WAN, &LOCALITIES).await;
    exec(&mut source[0].sql().await, "CREATE DATABASE shop").await;
    let mut c = eventually("database shop", Duration::from_secs(30), || {
        connect(&source[0], "shop")
    })
    .await;
    execute_all(&mut c, SCHEMA).await;
    exec_once_settled(&mut c, ROWS).await;
    let expected = shape(&source[0]).await;
    assert_eq!(
        expected[0], "europe-west1,us-east1*,us-west1",
        "{expected:?}"
    );
    assert_eq!(expected[2], "europe-west1=10,us-east1=10,us-west1=10");
    assert_eq!(expected[6], "id,email,name", "the hidden column is hidden");
    // Through the europe-west1 node at once: its copies of the other regions' ranges lag.
    let dump = dir.path().join("shop.dump");
    run_tool(
        "pg_dump",
        &source[2],
        &["-d", "shop", "-Fc", "-f", dump.to_str().unwrap()],
    );
    let listing = run_tool(
        "pg_restore",
        &source[2],
        &["-f", "-", dump.to_str().unwrap()],
    );
    assert!(
        listing.contains("COPY multiregion.dump_catalog"),
        "the declarations are in the dump"
    );

    let target = start_cluster(&subdir(dir.path(), "b"), 71, WAN, &LOCALITIES).await;
    exec(&mut target[0].sql().await, "CREATE DATABASE shop").await;
    for n in &target {
        eventually("database shop everywhere", Duration::from_secs(30), || {
            connect(n, "shop")
        })
        .await;
    }
    let mut r = connect(&target[1], "shop").await.unwrap();
    let nothing = sqlx::query("SELECT multiregion.post_restore()")
        .execute(&mut r)
        .await
        .expect_err("nothing restored yet");
    assert_eq!(code(&nothing), "55000", "{nothing}");
    run_tool(
        "pg_restore",
        &target[1],
        &["-d", "shop", "--exit-on-error", dump.to_str().unwrap()],
    );
    let adopted = one(&mut r, "SELECT multiregion.post_restore()").await;
    assert!(
        adopted.contains("3 regions, 4 table localities, 3 global keys"),
        "{adopted}"
    );
    let again = sqlx::query("SELECT multiregion.post_restore()")
        .execute(&mut r)
        .await
        .expect_err("adopted once");
    assert_eq!(code(&again), "55000", "{again}");

    for n in &target {
        let got = eventually("the restored shape", Duration::from_secs(60), || async {
            let s = shape(n).await;
            (s == expected).then_some(s)
        })
        .await;
        assert_eq!(got, expected, "node {}", n.pg_port);
    }
    // Each partition is its own range, leased in its region, once the split settles.
    eventually(
        "partition ranges leased at home",
        Duration::from_secs(60),
        || async {
            let mut c = connect(&target[0], "shop").await?;
            let s = one(
            &mut c,
            "SELECT string_agg(partition || '@' || lease_holder_region, ',' ORDER BY partition) \
             FROM multiregion.ranges WHERE database_name = 'shop' AND table_name = 'users' \
               AND partition IS NOT NULL",
        )
        .await;
            (s == "europe-west1@europe-west1,us-east1@us-east1,us-west1@us-west1").then_some(())
        },
    )
    .await;
    // Sequences go on from the dumped values; keys stay unique across regions.
    let mut c3 = connect(&target[2], "shop").await.unwrap();
    let id = one(
        &mut c3,
        "INSERT INTO users (email, name) VALUES ('new@x', 'new') RETURNING id::text",
    )
    .await;
    assert!(id.parse::<i64>().unwrap() > 30, "serial continues: {id}");
    let audit = one(
        &mut c3,
        "INSERT INTO audit (what) VALUES ('after') RETURNING id::text",
    )
    .await;
    assert_eq!(audit, "8", "identity continues");
    let dup = sqlx::raw_sql(
        "INSERT INTO users (email, name, crdb_region) VALUES ('u1@x', 'dup', 'us-east1')",
    )
    .execute(&mut c3)
    .await
    .expect_err("u1@x lives in us-west1");
    assert_eq!(code(&dup), "23505", "{dup}");
    assert_eq!(
        one(
            &mut c3,
            "INSERT INTO rides VALUES (100, 'paris', 1) RETURNING region::text"
        )
        .await,
        "europe-west1"
    );
    // A COPY TO reads this node's copy: with PLACEMENT RESTRICTED the us-east1 node holds no
    // replica of the us-west1 partition, and refuses rather than dump nothing.
    let mut c1 = connect(&target[0], "shop").await.unwrap();
    execute_all(&mut c1, &["ALTER DATABASE shop PLACEMENT RESTRICTED"]).await;
    let refused = eventually(
        "the us-west1 replica gone from node 1",
        Duration::from_secs(60),
        || async {
            let mut c = connect(&target[0], "shop").await?;
            let e = c
                .copy_out_raw("COPY public.users_us_west1 TO STDOUT")
                .await
                .err()?;
            (code(&e) == "0A000").then_some(e)
        },
    )
    .await;
    assert_eq!(code(&refused), "0A000", "{refused}");
    let through = one(
        &mut c1,
        "SELECT count(*)::text FROM users WHERE crdb_region = 'us-west1'",
    )
    .await;
    assert_eq!(through, "10", "a read goes through the leaseholder");
    pgmr_ok(&[
        "debug",
        "check-consistency",
        "--data-dir",
        target[0].data_dir.to_str().unwrap(),
    ]);
}
