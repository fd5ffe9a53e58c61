//! Data-plane benchmark: what replicating rows through range Raft groups costs, side by side
//! with the same PostgreSQL without it, in one run.
//!
//! `make bench-dataplane` (or `cargo bench -p pgmr --bench dataplane`). Real `pgmr` processes
//! and PostgreSQL servers on loopback behind pgmr's simulated WAN (the tutorial's RTTs: 63/87/132
//! ms between regions, 2 ms within one). Five nodes: three in us-east1 (the table's home: its
//! three voters and leaseholder), one each in us-west1 and europe-west1 (non-voting replicas).
//!
//! * single-row UPDATE latency, one client: on the leaseholder with replication, and on a
//!   table without capture triggers on the same node (plain PostgreSQL); the floor is one
//!   intra-region quorum round trip;
//! * the same UPDATE on a PostgreSQL primary with two synchronous standbys (quorum of one)
//!   behind the same simulated WAN ([`baseline`]): in us-east1, and in the other two regions;
//! * point-read latency: on the leaseholder (a read-index quorum round) and on the us-west1
//!   non-voter (read index from the leaseholder: one inter-region round trip);
//! * write throughput of the leaseholder's node, 8 and 32 clients, replication on and off, next
//!   to a PostgreSQL primary with two synchronous standbys in us-east1;
//! * reads no node can answer alone (PLACEMENT RESTRICTED), gathered from the leaseholders
//!   with only the rows and columns they need, and with whole tables sent;
//! * leaseholder failover (3 nodes, one per region): from `kill -9` of the leaseholder's node
//!   to the first write acknowledged by another node, median of 5.

#[path = "baseline.rs"]
mod baseline;
#[path = "../coordinator/tests/common/mod.rs"]
mod common;

use common::*;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::ConnectOptions;
use std::time::{Duration, Instant};

const WAN: &str =
    "intra 2\nus-east1 us-west1 63\nus-east1 europe-west1 87\nus-west1 europe-west1 132\n";
const OPS: usize = 300;
const CLIENTS: usize = 8;
/// Enough clients to keep several commits of one range waiting (batched proposals).
const CLIENTS_MANY: usize = 32;
const THROUGHPUT_FOR: Duration = Duration::from_secs(8);
const FAILOVERS: usize = 5;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn p50_p99(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (percentile(&v, 0.5), percentile(&v, 0.99))
}

/// A connection to `db` on `node`; the benchmark cannot go on without it.
async fn connect_ok(node: &Node, db: &str) -> PgConnection {
    connect(node, db).await.expect("connect")
}

async fn leaseholder(node: &Node, table: &str) -> u64 {
    let mut c = connect_ok(node, "bench").await;
    loop {
        let h: Option<i64> = sqlx::query_scalar(
            "SELECT lease_holder FROM multiregion.ranges WHERE database_name = 'bench' AND table_name = $1",
        )
        .bind(table)
        .fetch_optional(&mut c)
        .await
        .ok()
        .flatten()
        .flatten();
        if let Some(h) = h {
            return h as u64;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Latencies (ms) of `OPS` runs of `sql` with `$1` a key in 1..=1000.
async fn latencies(c: &mut PgConnection, sql: &str) -> Vec<f64> {
    let mut out = Vec::with_capacity(OPS);
    for i in 0..OPS {
        let started = Instant::now();
        sqlx::query(sql)
            .bind((i % 1000) as i32 + 1)
            .execute(&mut *c)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        out.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    out
}

/// Sequences (docs/ARCHITECTURE.md §8.3): a `CACHE 1` draw is one meta-group write, on top
/// of the insert's own quorum; `CACHE 100` pays it once per hundred rows.
async fn sequences(nodes: &[Node], b: &mut PgConnection) {
    for sql in [
        "CREATE TABLE ev (id bigint PRIMARY KEY, v int NOT NULL)",
        "CREATE TABLE ev_serial (id bigserial PRIMARY KEY, v int NOT NULL)",
        "CREATE SEQUENCE ev_cached_ids CACHE 100",
        "CREATE TABLE ev_cached (id bigint PRIMARY KEY DEFAULT nextval('ev_cached_ids'), v int NOT NULL)",
    ] {
        exec(b, sql).await;
    }
    for (table, insert, what, floor) in [
        (
            "ev",
            "INSERT INTO ev VALUES ($1, 0)",
            "INSERT with an explicit key, on the leaseholder",
            "2 ms (intra-region quorum RTT)",
        ),
        (
            "ev_serial",
            "INSERT INTO ev_serial (v) VALUES ($1)",
            "INSERT with a bigserial key (CACHE 1), on the leaseholder",
            "4 ms (+ a meta-group write, quorum in us-east1)",
        ),
        (
            "ev_cached",
            "INSERT INTO ev_cached (v) VALUES ($1)",
            "INSERT with a CACHE 100 sequence's key, on the leaseholder",
            "2 ms (a meta-group write per 100 rows)",
        ),
    ] {
        let holder = leaseholder(&nodes[0], table).await as usize - 1;
        let mut lh = connect_ok(&nodes[holder], "bench").await;
        // The range's first leader and the sequence's first draw settle first.
        let _ = sqlx::query(insert).bind(0).execute(&mut lh).await;
        row(what, p50_p99(latencies(&mut lh, insert).await), floor);
    }
    let mut west = connect_ok(&nodes[3], "bench").await;
    row(
        "nextval() of a CACHE 1 sequence through the us-west1 node",
        p50_p99(latencies(&mut west, "SELECT nextval('ev_serial_id_seq') + $1").await),
        "63 ms (RTT to the meta leader, in us-east1)",
    );
}

/// Latencies (ms) of `OPS` runs of `sql` through the simple query protocol (psql's and
/// psycopg2's), with `{}` replaced by a key in 1..=1000.
async fn latencies_simple(c: &mut PgConnection, sql: &str) -> Vec<f64> {
    let mut out = Vec::with_capacity(OPS);
    for i in 0..OPS {
        let text = sql.replace("{}", &((i % 1000) + 1).to_string());
        let started = Instant::now();
        sqlx::raw_sql(&text)
            .execute(&mut *c)
            .await
            .unwrap_or_else(|e| panic!("{text}: {e}"));
        out.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    out
}

/// `n` connections to `db` on `node`.
async fn clients(node: &Node, db: &str, n: usize) -> Vec<PgConnection> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(connect_ok(node, db).await);
    }
    out
}

/// Transactions per second of `conns` updating random keys of `table`, one client each.
async fn throughput(conns: Vec<PgConnection>, table: &str) -> f64 {
    let sql = format!("UPDATE {table} SET v = v + 1 WHERE k = $1");
    let deadline = Instant::now() + THROUGHPUT_FOR;
    let mut tasks = Vec::new();
    for (t, mut c) in conns.into_iter().enumerate() {
        let sql = sql.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            let mut k = t as i32 * 97;
            while Instant::now() < deadline {
                k = (k * 31 + 7) % 1000;
                sqlx::query(&sql).bind(k + 1).execute(&mut c).await.unwrap();
                n += 1;
            }
            n
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total as f64 / THROUGHPUT_FOR.as_secs_f64()
}

/// Latencies (ms) of `n` runs of the simple-protocol text `sql` (one message per
/// transaction).
async fn latencies_text(c: &mut PgConnection, sql: &str, n: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        sqlx::raw_sql(sql)
            .execute(&mut *c)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        out.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    out
}

/// Transactions over several ranges: two ranges of one leaseholder, and a REGIONAL BY ROW
/// table's us-east1 and us-west1 rows (leased 63 ms apart) through the us-east1 leaseholder's
/// node, each against the same transaction on one range.
async fn two_phase(nodes: &[Node], b: &mut PgConnection) -> usize {
    exec(b, "CREATE TABLE kv2 (k int PRIMARY KEY, v int NOT NULL)").await;
    exec(
        b,
        "SELECT multiregion.execute('CREATE TABLE rbr (k int PRIMARY KEY, v int NOT NULL) LOCALITY REGIONAL BY ROW')",
    )
    .await;
    let h1 = leaseholder(&nodes[0], "kv").await as usize - 1;
    let h2 = leaseholder(&nodes[0], "kv2").await as usize - 1;
    let mut c = connect_ok(&nodes[h1], "bench").await;
    if h1 == h2 {
        exec(&mut c, "INSERT INTO kv2 VALUES (1, 0)").await;
        let one = p50_p99(
            latencies_text(
                &mut c,
                "BEGIN; UPDATE kv SET v = v + 1 WHERE k = 1; UPDATE kv SET v = v + 1 WHERE k = 2; COMMIT",
                OPS,
            )
            .await,
        );
        row(
            "two UPDATEs, one range (one message)",
            one,
            "2 ms (one quorum round)",
        );
        let two = p50_p99(
            latencies_text(
                &mut c,
                "BEGIN; UPDATE kv SET v = v + 1 WHERE k = 1; UPDATE kv2 SET v = v + 1 WHERE k = 1; COMMIT",
                OPS,
            )
            .await,
        );
        row(
            "two UPDATEs, two ranges of one leaseholder (two-phase commit)",
            two,
            "4 ms (prepare, then decide: two quorum rounds)",
        );
    }
    // Each region's rows written through a node of that region (INSERT runs where it is).
    let east_holder = loop {
        let h: Option<i64> = sqlx::query_scalar(
            "SELECT lease_holder FROM multiregion.ranges WHERE table_name = 'rbr' AND partition = 'us-east1'",
        )
        .fetch_optional(&mut *b)
        .await
        .ok()
        .flatten()
        .flatten();
        if let Some(h) = h {
            break h as usize - 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for (node, first) in [(east_holder, 1), (3, 101)] {
        let mut n = connect_ok(&nodes[node], "bench").await;
        let sql = format!(
            "INSERT INTO rbr (k, v) SELECT g, 0 FROM generate_series({first}, {}) g",
            first + 1
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(err) = sqlx::raw_sql(&sql).execute(&mut n).await {
            assert!(Instant::now() < deadline, "{sql}: {err}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let mut e = connect_ok(&nodes[east_holder], "bench").await;
    let local = p50_p99(
        latencies_text(
            &mut e,
            "BEGIN; UPDATE rbr SET v = v - 1 WHERE crdb_region = 'us-east1' AND k = 1; \
             UPDATE rbr SET v = v + 1 WHERE crdb_region = 'us-east1' AND k = 2; COMMIT",
            50,
        )
        .await,
    );
    row(
        "transfer between two us-east1 rows of a REGIONAL BY ROW table (one range)",
        local,
        "2 ms",
    );
    // Under SERIALIZABLE each node's turn is taken with the statement that goes there (here:
    // a local lock and row update), so no round trip more.
    for (isolation, what, floor) in [
        (
            "",
            "transfer from a us-east1 row to a us-west1 row, through the us-east1 leaseholder (two-phase commit)",
            "189 ms (statement, prepare and commit: three round trips of 63 ms)",
        ),
        (
            " ISOLATION LEVEL SERIALIZABLE",
            "the same transfer, SERIALIZABLE (each node's turn, ARCHITECTURE.md §8.5 \"Isolation\")",
            "189 ms (the turns travel with the statements)",
        ),
    ] {
        let sql = format!(
            "BEGIN{isolation}; UPDATE rbr SET v = v - 1 WHERE crdb_region = 'us-east1' AND k = 1; \
             UPDATE rbr SET v = v + 1 WHERE crdb_region = 'us-west1' AND k = 101; COMMIT"
        );
        row(what, p50_p99(latencies_text(&mut e, &sql, 50).await), floor);
    }
    east_holder
}

/// Statements whose rows are leased on several nodes, through the us-east1 leaseholder of
/// `rbr` (rows 1, 2 in us-east1, 101, 102 in us-west1): naming the row's region (one
/// leaseholder), not naming it (split over the three regions' leaseholders; also with the
/// row chosen by a subquery over a GLOBAL table, which each share reads where it runs), a region
/// computed from a city (the filter derived from the city: one leaseholder), and a row moved
/// to another region and back.
async fn several_leaseholders(nodes: &[Node], b: &mut PgConnection, east: usize) {
    let mut e = connect_ok(&nodes[east], "bench").await;
    let named = p50_p99(
        latencies_text(
            &mut e,
            "UPDATE rbr SET v = v + 1 WHERE crdb_region = 'us-west1' AND k = 101",
            50,
        )
        .await,
    );
    row(
        "UPDATE of a us-west1 row naming its region, through the us-east1 leaseholder",
        named,
        "63 ms (one round trip: statement and commit in one message)",
    );
    let split = p50_p99(latencies_text(&mut e, "UPDATE rbr SET v = v + 1 WHERE k = 101", 50).await);
    row(
        "same row, without its region: split over the us-east1 (here), us-west1 and europe-west1 leaseholders",
        split,
        "87 (this node's share, then the us-west1 and europe-west1 shares at once) + 63 (commit at us-west1, the one share that wrote: one phase)",
    );
    // The same split, reading a GLOBAL table in a subquery: each share reads its node's copy
    // after a read barrier there, which on a non-voter asks the us-east1 leaseholder.
    exec(
        b,
        "SELECT multiregion.execute('CREATE TABLE hot (k int PRIMARY KEY) LOCALITY GLOBAL')",
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(err) = sqlx::raw_sql("INSERT INTO hot VALUES (101)")
        .execute(&mut e)
        .await
    {
        assert!(Instant::now() < deadline, "{err}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Until every share's node holds its copy of `hot` (a new non-voter starts from a
    // snapshot), the statement is refused.
    let sql = "UPDATE rbr SET v = v + 1 WHERE k IN (SELECT k FROM hot)";
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Err(err) = sqlx::raw_sql(sql).execute(&mut e).await {
        assert!(Instant::now() < deadline, "{err}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let with_reads = p50_p99(latencies_text(&mut e, sql, 50).await);
    row(
        "same row, without its region, chosen by a subquery over a GLOBAL table: split, each share reading its node's copy after a barrier",
        with_reads,
        "174 (the europe-west1 share, whose barrier asks the us-east1 leaseholder: 87 + 87) + 63 (commit at us-west1, one phase)",
    );
    exec(
        b,
        "SELECT multiregion.execute('CREATE TABLE riders (id int, city text NOT NULL, v int NOT NULL DEFAULT 0,          region crdb_internal_region NOT NULL AS (CASE WHEN city = ''new york'' THEN ''us-east1''          WHEN city = ''seattle'' THEN ''us-west1'' ELSE ''europe-west1'' END) STORED,          PRIMARY KEY (city, id)) LOCALITY REGIONAL BY ROW AS region')",
    )
    .await;
    let mut w = connect_ok(&nodes[3], "bench").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(err) = sqlx::raw_sql("INSERT INTO riders (id, city) VALUES (1, 'seattle')")
        .execute(&mut w)
        .await
    {
        assert!(Instant::now() < deadline, "{err}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let by_city = p50_p99(
        latencies_text(
            &mut e,
            "UPDATE riders SET v = v + 1 WHERE city = 'seattle' AND id = 1",
            50,
        )
        .await,
    );
    row(
        "UPDATE of a seattle rider by city and id (region computed from the city), through the us-east1 node",
        by_city,
        "63 ms (the derived region filter: one leaseholder)",
    );
    let mut moves = Vec::new();
    for i in 0..25 {
        let (to, from) = if i % 2 == 0 {
            ("us-west1", "us-east1")
        } else {
            ("us-east1", "us-west1")
        };
        let sql =
            format!("UPDATE rbr SET crdb_region = '{to}' WHERE crdb_region = '{from}' AND k = 2");
        moves.extend(latencies_text(&mut e, &sql, 1).await);
    }
    row(
        "UPDATE moving a row between us-east1 (here) and us-west1, through the us-east1 leaseholder",
        p50_p99(moves),
        "189 ms (the moved row's INSERT there, prepare, commit: three round trips of 63 ms)",
    );
    // The same moves by an upsert by the declared key that names the region (CockroachDB's
    // UPSERT with crdb_region): the row is found, moved by an UPDATE, then upserted.
    let mut upsert_moves = Vec::new();
    for i in 0..25 {
        let to = if i % 2 == 0 { "us-east1" } else { "us-west1" };
        let sql = format!(
            "INSERT INTO rbr (crdb_region, k, v) VALUES ('{to}', 2, {i}) ON CONFLICT (k) \
             DO UPDATE SET crdb_region = excluded.crdb_region, v = excluded.v"
        );
        upsert_moves.extend(latencies_text(&mut e, &sql, 1).await);
    }
    row(
        "same moves by an upsert by k alone naming the region (DO UPDATE SET crdb_region = excluded.crdb_region)",
        p50_p99(upsert_moves),
        "the lookup in the other regions' partitions (up to 2 × 63 ms), then the moving UPDATE and the row written after it, prepare, commit",
    );
    // Keys unique across regions, taken in us-west1 through its leaseholder: an int key goes
    // to its key table, leased in us-east1; a gen_random_uuid() key needs none.
    exec(
        b,
        "SELECT multiregion.execute('CREATE TABLE rbr_uuid (k uuid PRIMARY KEY DEFAULT gen_random_uuid(), v int NOT NULL) LOCALITY REGIONAL BY ROW')",
    )
    .await;
    let uuid_insert = "INSERT INTO rbr_uuid (crdb_region, v) VALUES ('us-west1', 0)";
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(err) = sqlx::raw_sql(uuid_insert).execute(&mut w).await {
        assert!(Instant::now() < deadline, "{err}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut int_keys = Vec::new();
    for k in 0..50 {
        let sql = format!(
            "INSERT INTO rbr (crdb_region, k, v) VALUES ('us-west1', {}, 0)",
            500_000 + k
        );
        int_keys.extend(latencies_text(&mut w, &sql, 1).await);
    }
    row(
        "INSERT of a us-west1 row with an int key (unique across regions), through the us-west1 leaseholder",
        p50_p99(int_keys),
        "189 ms (the key at its table's us-east1 leaseholder, prepare, commit: three round trips of 63 ms, as a transfer between regions)",
    );
    row(
        "same, a gen_random_uuid() key (unique by construction: no key table)",
        p50_p99(latencies_text(&mut w, uuid_insert, 50).await),
        "local quorum in us-west1",
    );
    // Upserts by the declared key (CockroachDB's ON CONFLICT (k) and UPSERT: the row looked up
    // in whichever region holds it), against the region-prefixed key PostgreSQL's partitions
    // allow (the conflict looked for in the proposed region only), through us-west1.
    let upsert = |key: &str, k: i64| {
        format!("INSERT INTO rbr (k, v) VALUES ({k}, 1) ON CONFLICT ({key}) DO UPDATE SET v = excluded.v")
    };
    row(
        "upsert of an existing us-west1 row by (crdb_region, k) (baseline), through the us-west1 leaseholder",
        p50_p99(latencies_text(&mut w, &upsert("crdb_region, k", 101), 50).await),
        "local quorum in us-west1",
    );
    row(
        "same, by k alone (found in this region's partition first)",
        p50_p99(latencies_text(&mut w, &upsert("k", 101), 50).await),
        "local quorum in us-west1",
    );
    let mut fresh = (Vec::new(), Vec::new());
    for i in 0..50 {
        fresh
            .0
            .extend(latencies_text(&mut w, &upsert("crdb_region, k", 600_000 + i), 1).await);
        fresh
            .1
            .extend(latencies_text(&mut w, &upsert("k", 700_000 + i), 1).await);
    }
    row(
        "upsert of a new key by (crdb_region, k) (baseline), through the us-west1 leaseholder",
        p50_p99(fresh.0),
        "189 ms (as the INSERT of an int key above)",
    );
    row(
        "same, by k alone (the key table read at its us-east1 leaseholder first)",
        p50_p99(fresh.1),
        "189 + 63 ms (one more round trip)",
    );
    row(
        "upsert of an existing us-east1 row by k alone, through the us-west1 node (updated at its leaseholder)",
        p50_p99(latencies_text(&mut w, &upsert("k", 1), 25).await),
        "key table read, the other regions' partitions read (63 + 63 ms), the row at its us-east1 leaseholder, prepare, commit",
    );
}

/// Rows of a bulk load: about 15 MB of changes, several Raft entries.
const BULK_ROWS: i64 = 60_000;
const BULK_RUNS: usize = 3;

/// Seconds each of [`BULK_RUNS`] loads of [`BULK_ROWS`] rows into `table` took (emptied
/// before each), sorted.
/// Reads no node can answer alone — the database made PLACEMENT RESTRICTED, so each region's
/// partition stays in its region — through the us-west1 node, gathered from the three
/// leaseholders: with only the rows the query's filter keeps and the columns it reads sent
/// (the default), next to every row and column sent (`multiregion.gather_pushdown = off`).
/// Last in the run: the placement change moves every partition's replicas.
async fn gathered(nodes: &[Node], b: &mut PgConnection) {
    const PER_REGION: i32 = 10_000;
    exec(
        b,
        "SELECT multiregion.execute('CREATE TABLE wide (id int PRIMARY KEY, v int NOT NULL, \
         pad text NOT NULL) LOCALITY REGIONAL BY ROW')",
    )
    .await;
    for (i, region) in ["us-east1", "us-west1", "europe-west1"].iter().enumerate() {
        let first = i as i32 * PER_REGION + 1;
        exec_once_settled(
            b,
            &format!(
                "INSERT INTO wide (crdb_region, id, v, pad) SELECT '{region}', g, g % 1000, \
                 repeat('x', 200) FROM generate_series({first}, {}) g",
                first + PER_REGION - 1
            ),
        )
        .await;
    }
    exec(
        b,
        "SELECT multiregion.execute('ALTER DATABASE bench PLACEMENT RESTRICTED')",
    )
    .await;
    let mut w = connect_ok(&nodes[3], "bench").await;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let held: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM multiregion.ranges WHERE database_name = 'bench' \
             AND table_name = 'wide' AND 4 = ANY (voting_replicas || non_voting_replicas)",
        )
        .fetch_one(&mut w)
        .await
        .unwrap();
        let all: Result<i64, _> = sqlx::query_scalar("SELECT count(*) FROM wide")
            .fetch_one(&mut w)
            .await;
        if held == 1 && matches!(all, Ok(n) if n == 3 * PER_REGION as i64) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "wide: {held} partitions held, {all:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "\n| gathered read through the us-west1 node ({} rows of ~220 bytes in three regions' partitions) | p50 | p99 | floor |",
        3 * PER_REGION
    );
    println!("|---|---|---|---|");
    for (what, sql) in [
        (
            "count(*) with a filter keeping 1 %",
            "SELECT count(*) FROM wide WHERE v < 10",
        ),
        ("sum of one column", "SELECT sum(v) FROM wide"),
        (
            "count and sum per region",
            "SELECT crdb_region, count(*), sum(v) FROM wide GROUP BY 1",
        ),
    ] {
        // Aggregated at the leaseholders; the rows the filter keeps, only the columns read;
        // every row and column.
        for (partial, pushdown, how) in [
            ("on", "on", "aggregated at the leaseholders"),
            (
                "off",
                "on",
                "the filter and columns sent, rows aggregated here",
            ),
            ("off", "off", "every row and column sent"),
        ] {
            exec(
                &mut w,
                &format!(
                    "SET multiregion.gather_partial_aggregates = {partial}; \
                     SET multiregion.gather_pushdown = {pushdown}"
                ),
            )
            .await;
            row(
                &format!("{what}: {how}"),
                p50_p99(latencies_text(&mut w, sql, 15).await),
                "132 ms (RTT to the farthest leaseholder, europe-west1)",
            );
        }
    }
    exec(&mut w, "RESET multiregion.gather_partial_aggregates").await;
    exec(&mut w, "RESET multiregion.gather_pushdown").await;
}

async fn bulk_seconds(c: &mut PgConnection, table: &str) -> Vec<f64> {
    let mut out = Vec::new();
    for _ in 0..BULK_RUNS {
        exec(c, &format!("TRUNCATE {table}")).await;
        let t = Instant::now();
        exec(
            c,
            &format!(
                "INSERT INTO {table} SELECT g, repeat('x', 200) FROM generate_series(1, {BULK_ROWS}) g"
            ),
        )
        .await;
        out.push(t.elapsed().as_secs_f64());
    }
    out.sort_by(|a, b| a.total_cmp(b));
    out
}

/// Latencies (ms) of [`OPS`] runs of `sql` (`:k` a key) through `node`'s database `bench` by
/// pgbench, PostgreSQL's libpq client, in `mode` (`-M`): libpq sends an extended-protocol
/// statement as Parse, Bind, Describe, Execute and Sync together, as most drivers do (sqlx,
/// [`latencies`], closes the portal before Sync).
fn latencies_pgbench(node: &Node, dir: &std::path::Path, mode: &str, sql: &str) -> Vec<f64> {
    let script = dir.join("pgbench-latency.sql");
    std::fs::write(&script, format!("\\set k random(1, 1000)\n{sql};\n")).unwrap();
    let prefix = dir.join("pgbench-latency");
    let out = pgbench(node.pg_port)
        .current_dir(dir)
        .args(["-n", "-M", mode, "-t", &OPS.to_string(), "-l"])
        .arg(format!("--log-prefix={}", prefix.display()))
        .arg("-f")
        .arg(&script)
        .arg("bench")
        .output()
        .expect("pgbench runs");
    assert!(
        out.status.success(),
        "pgbench: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut ms = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("pgbench-latency.") {
            let text = std::fs::read_to_string(entry.path()).unwrap();
            // client transaction latency_us script epoch_s epoch_us
            ms.extend(text.lines().filter_map(|l| {
                l.split_whitespace()
                    .nth(2)?
                    .parse::<f64>()
                    .ok()
                    .map(|us| us / 1000.0)
            }));
            std::fs::remove_file(entry.path()).unwrap();
        }
    }
    assert_eq!(ms.len(), OPS, "one logged latency per transaction");
    ms
}

fn row(what: &str, (p50, p99): (f64, f64), floor: &str) {
    println!("| {what} | {p50:.2} | {p99:.2} | {floor} |");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dir = scratch("bench-dataplane");
    println!("# data-plane benchmark ({OPS} operations per row; ms)\n");
    let localities = [
        "region=us-east1,zone=us-east1-b",
        "region=us-east1,zone=us-east1-c",
        "region=us-east1,zone=us-east1-d",
        "region=us-west1,zone=us-west1-a",
        "region=europe-west1,zone=europe-west1-b",
    ];
    let nodes = start_cluster(dir.path(), 40, WAN, &localities).await;
    enable_replication(&nodes[0]).await;
    let mut c = nodes[0].sql().await;
    exec(&mut c, "CREATE DATABASE bench").await;
    let mut b = connect_ok(&nodes[0], "bench").await;
    for sql in [
        r#"SELECT multiregion.execute('ALTER DATABASE bench PRIMARY REGION "us-east1"')"#,
        r#"SELECT multiregion.execute('ALTER DATABASE bench ADD REGION "us-west1"')"#,
        r#"SELECT multiregion.execute('ALTER DATABASE bench ADD REGION "europe-west1"')"#,
        "CREATE TABLE kv (k int PRIMARY KEY, v int NOT NULL)",
        "CREATE TABLE plain_kv (k int PRIMARY KEY, v int NOT NULL)",
        "CREATE TABLE bulk (k int PRIMARY KEY, v text NOT NULL)",
        "CREATE TABLE plain_bulk (k int PRIMARY KEY, v text NOT NULL)",
    ] {
        exec(&mut b, sql).await;
    }
    let holder = leaseholder(&nodes[0], "kv").await as usize - 1;
    let mut lh = connect_ok(&nodes[holder], "bench").await;
    // The baseline: the same node's PostgreSQL, a table whose rows nothing captures.
    exec(
        &mut lh,
        "SET session_replication_role = replica; \
         INSERT INTO plain_kv SELECT g, 0 FROM generate_series(1, 1000) g; \
         RESET session_replication_role; \
         ALTER TABLE plain_kv DISABLE TRIGGER multiregion_capture, \
             DISABLE TRIGGER multiregion_capture_truncate, \
             DISABLE TRIGGER _multiregion_route; \
         ALTER TABLE plain_bulk DISABLE TRIGGER multiregion_capture, \
             DISABLE TRIGGER multiregion_capture_truncate, \
             DISABLE TRIGGER _multiregion_route",
    )
    .await;
    exec(
        &mut lh,
        "INSERT INTO kv SELECT g, 0 FROM generate_series(1, 1000) g",
    )
    .await;
    println!("| operation | p50 | p99 | floor |");
    println!("|---|---|---|---|");
    let plain = p50_p99(latencies(&mut lh, "UPDATE plain_kv SET v = v + 1 WHERE k = $1").await);
    row(
        "UPDATE, plain PostgreSQL (same node)",
        plain,
        "local commit",
    );
    let repl = p50_p99(latencies(&mut lh, "UPDATE kv SET v = v + 1 WHERE k = $1").await);
    row(
        "UPDATE on the leaseholder, 3 voters in us-east1",
        repl,
        "2 ms (intra-region quorum RTT)",
    );
    // A database without regions: three voters, one per region (CockroachDB's default
    // spreads them), so the nearest quorum is one inter-region round trip away.
    exec(&mut c, "CREATE DATABASE bench_wide").await;
    let mut w = connect_ok(&nodes[0], "bench_wide").await;
    exec(
        &mut w,
        "CREATE TABLE kv (k int PRIMARY KEY, v int NOT NULL)",
    )
    .await;
    let wide_holder = loop {
        let h: Option<i64> = sqlx::query_scalar(
            "SELECT lease_holder FROM multiregion.ranges WHERE database_name = 'bench_wide'",
        )
        .fetch_optional(&mut c)
        .await
        .ok()
        .flatten()
        .flatten();
        if let Some(h) = h {
            break h as usize - 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut wl = connect_ok(&nodes[wide_holder], "bench_wide").await;
    exec(
        &mut wl,
        "INSERT INTO kv SELECT g, 0 FROM generate_series(1, 1000) g",
    )
    .await;
    let wide = p50_p99(latencies(&mut wl, "UPDATE kv SET v = v + 1 WHERE k = $1").await);
    row(
        "UPDATE on the leaseholder, voters in 3 regions (no database regions)",
        wide,
        "63 ms (RTT us-east1 ↔ us-west1, the nearest other voter)",
    );
    // The baseline: PostgreSQL's own synchronous replication behind the same simulated WAN.
    let mut baseline_bulk: Vec<(String, Vec<f64>)> = Vec::new();
    // Clients and tx/s of the primary with synchronous standbys in us-east1.
    let mut baseline_throughput: Vec<(usize, f64)> = Vec::new();
    for (i, (what, rtts, floor)) in [
        (
            "UPDATE on a PostgreSQL primary, 2 synchronous standbys in us-east1 (ANY 1)",
            [Duration::from_millis(2), Duration::from_millis(2)],
            "2 ms (RTT to the nearer standby)",
        ),
        (
            "UPDATE on a PostgreSQL primary, synchronous standbys in us-west1 and europe-west1 (ANY 1)",
            [Duration::from_millis(63), Duration::from_millis(87)],
            "63 ms (RTT to the nearer standby)",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let base = baseline::StandbyCluster::start(dir.path(), 23400 + 30 * i as u16, PGMR, rtts);
        let primary = PgConnectOptions::new()
            .host("127.0.0.1")
            .port(base.primary_port)
            .username("postgres")
            .database("postgres");
        let mut p = primary
            .connect()
            .await
            .expect("connect to the baseline primary");
        exec(
            &mut p,
            "CREATE TABLE kv (k int PRIMARY KEY, v int NOT NULL); \
             INSERT INTO kv SELECT g, 0 FROM generate_series(1, 1000) g",
        )
        .await;
        // Both standbys streaming, one of them synchronous.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = 'quorum'",
            )
            .fetch_one(&mut p)
            .await
            .expect("pg_stat_replication");
            if n == 2 {
                break;
            }
            assert!(Instant::now() < deadline, "the standbys did not start streaming");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let r = p50_p99(latencies(&mut p, "UPDATE kv SET v = v + 1 WHERE k = $1").await);
        row(what, r, floor);
        if i == 0 {
            for n in [CLIENTS, CLIENTS_MANY] {
                let mut conns = Vec::with_capacity(n);
                for _ in 0..n {
                    conns.push(
                        primary
                            .connect()
                            .await
                            .expect("connect to the baseline primary"),
                    );
                }
                baseline_throughput.push((n, throughput(conns, "kv").await));
            }
        }
        exec(&mut p, "CREATE TABLE bulk (k int PRIMARY KEY, v text NOT NULL)").await;
        baseline_bulk.push((what.replace("UPDATE on", "bulk load into"), bulk_seconds(&mut p, "bulk").await));
        drop(p);
        drop(base);
    }
    // Forwarded: through a node that is not the leaseholder.
    let east_other = (0..3).find(|i| *i != holder).expect("three us-east1 nodes");
    let mut eo = connect_ok(&nodes[east_other], "bench").await;
    let fwd_east = p50_p99(latencies_simple(&mut eo, "UPDATE kv SET v = v + 1 WHERE k = {}").await);
    row(
        "UPDATE through another us-east1 node (forwarded, simple protocol)",
        fwd_east,
        "4 ms (to the leaseholder and back, plus its quorum)",
    );
    let mut wf = connect_ok(&nodes[3], "bench").await;
    let fwd_west = p50_p99(latencies_simple(&mut wf, "UPDATE kv SET v = v + 1 WHERE k = {}").await);
    row(
        "UPDATE through the us-west1 node (forwarded, simple protocol)",
        fwd_west,
        "65 ms (RTT to the leaseholder plus its quorum)",
    );
    let fwd_west_ext = p50_p99(latencies(&mut wf, "UPDATE kv SET v = v + 1 WHERE k = $1").await);
    row(
        "UPDATE through the us-west1 node (forwarded, extended protocol, sqlx)",
        fwd_west_ext,
        "65 ms; 130 ms here: sqlx closes the portal before Sync, so the commit is a second round trip",
    );
    let fwd_west_libpq = p50_p99(latencies_pgbench(
        &nodes[3],
        dir.path(),
        "extended",
        "UPDATE kv SET v = v + 1 WHERE k = :k",
    ));
    row(
        "UPDATE through the us-west1 node (forwarded, extended protocol, libpq)",
        fwd_west_libpq,
        "65 ms (Sync follows Execute: commits with the statement)",
    );
    let plain_read = p50_p99(latencies(&mut lh, "SELECT v FROM plain_kv WHERE k = $1").await);
    row("point read, plain PostgreSQL", plain_read, "local");
    let lh_read = p50_p99(latencies(&mut lh, "SELECT v FROM kv WHERE k = $1").await);
    row(
        "point read on the leaseholder (read index)",
        lh_read,
        "2 ms (quorum heartbeat)",
    );
    let mut west = connect_ok(&nodes[3], "bench").await;
    let west_read = p50_p99(latencies(&mut west, "SELECT v FROM kv WHERE k = $1").await);
    row(
        "point read on the us-west1 non-voter",
        west_read,
        "63 ms (RTT to the leaseholder)",
    );
    let east = two_phase(&nodes, &mut b).await;
    several_leaseholders(&nodes, &mut b, east).await;
    sequences(&nodes, &mut b).await;
    println!();
    // Bulk loads: one transaction of about 15 MB of rows, split into 1 MiB Raft entries.
    let bulk_holder = leaseholder(&nodes[0], "bulk").await as usize - 1;
    let mut bl = connect_ok(&nodes[bulk_holder], "bench").await;
    let unreplicated = bulk_seconds(&mut bl, "plain_bulk").await;
    let replicated = bulk_seconds(&mut bl, "bulk").await;
    let median = |v: &[f64]| v[v.len() / 2];
    println!(
        "bulk load of {BULK_ROWS} rows (~15 MB) in one transaction, median of {BULK_RUNS} (s): \
         {:.2} replicated (voters in us-east1), {:.2} on the same node without replication",
        median(&replicated),
        median(&unreplicated)
    );
    for (what, v) in &baseline_bulk {
        println!("{what}: {:.2}", median(v));
    }
    println!();
    for n in [CLIENTS, CLIENTS_MANY] {
        let off = throughput(clients(&nodes[holder], "bench", n).await, "plain_kv").await;
        let on = throughput(clients(&nodes[holder], "bench", n).await, "kv").await;
        let standbys = baseline_throughput
            .iter()
            .find(|(c, _)| *c == n)
            .map_or(f64::NAN, |(_, t)| *t);
        println!(
            "throughput of the leaseholder's node, {n} clients: {on:.0} tx/s replicated (voters in \
             us-east1), {off:.0} tx/s without replication ({:.0} %); PostgreSQL primary with 2 \
             synchronous standbys in us-east1: {standbys:.0} tx/s (replicated / that: {:.0} %)",
            on / off * 100.0,
            on / standbys * 100.0
        );
    }
    println!();
    gathered(&nodes, &mut b).await;
    drop(nodes);

    // Failover, on a cluster of its own.
    let dir3 = scratch("bench-failover");
    let nodes3 = start_cluster(
        dir3.path(),
        41,
        WAN,
        &[
            "region=us-east1,zone=us-east1-b",
            "region=us-west1,zone=us-west1-a",
            "region=europe-west1,zone=europe-west1-b",
        ],
    )
    .await;
    let mut nodes3 = nodes3;
    enable_replication(&nodes3[0]).await;
    let mut c = nodes3[0].sql().await;
    exec(&mut c, "CREATE DATABASE bench").await;
    let mut b = connect_ok(&nodes3[0], "bench").await;
    exec(
        &mut b,
        "CREATE TABLE kv (k int PRIMARY KEY, v int NOT NULL)",
    )
    .await;
    let mut times = Vec::new();
    let mut key = 0;
    for _ in 0..FAILOVERS {
        let holder = leaseholder(&nodes3[0], "kv").await as usize - 1;
        // The leaseholder takes a write, then dies.
        let mut lh = connect_ok(&nodes3[holder], "bench").await;
        key += 1;
        sqlx::query("INSERT INTO kv VALUES ($1, 0)")
            .bind(key)
            .execute(&mut lh)
            .await
            .unwrap();
        drop(lh);
        nodes3[holder].crash();
        let killed = Instant::now();
        key += 1;
        'found: loop {
            for (i, n) in nodes3.iter().enumerate() {
                if i == holder {
                    continue;
                }
                let Ok(mut c) = PgConnectOptions::new()
                    .host("127.0.0.1")
                    .port(n.pg_port)
                    .username("postgres")
                    .database("bench")
                    .connect()
                    .await
                else {
                    continue;
                };
                if sqlx::query("INSERT INTO kv VALUES ($1, 0)")
                    .bind(key)
                    .execute(&mut c)
                    .await
                    .is_ok()
                {
                    break 'found;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        times.push(killed.elapsed().as_secs_f64());
        nodes3[holder].restart();
        // Wait until the restarted node serves again and holds every row.
        eventually(
            "the restarted node to catch up",
            Duration::from_secs(60),
            || async {
                let mut c = PgConnectOptions::new()
                    .host("127.0.0.1")
                    .port(nodes3[holder].pg_port)
                    .username("postgres")
                    .database("bench")
                    .connect()
                    .await
                    .ok()?;
                let n: i64 = sqlx::query_scalar("SELECT count(*) FROM kv")
                    .fetch_one(&mut c)
                    .await
                    .ok()?;
                (n == key as i64).then_some(())
            },
        )
        .await;
        // Let the preferred leaseholder take the lease back before the next kill.
        tokio::time::sleep(Duration::from_secs(6)).await;
    }
    times.sort_by(|a, b| a.total_cmp(b));
    println!(
        "leaseholder failover (kill -9 to the next acknowledged write elsewhere), {FAILOVERS} kills: \
         median {:.1} s, min {:.1} s, max {:.1} s",
        times[times.len() / 2],
        times[0],
        times[times.len() - 1]
    );
}
