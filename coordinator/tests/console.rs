//! The DB Console and `/metrics` of real `pgmr start` nodes behind the tutorial's simulated
//! WAN: every page renders on every node, the latency matrix shows the simulated round trips,
//! the SQL latency page counts each region's statements, `/metrics` parses with a Prometheus
//! text parser, and headless Chromium renders each page to a screenshot
//! (`target/console-screenshots/`, a test artifact).

mod common;

use common::*;
use sqlx::ConnectOptions;
use std::path::PathBuf;
use std::time::Duration;

const WAN: &str =
    "intra 2\nus-east1 us-west1 63\nus-east1 europe-west1 87\nus-west1 europe-west1 132\n";

/// The round trip a matrix cell shows, from `<td … data-from="a" data-to="b" …>ms</td>`.
fn cell(html: &str, from: u64, to: u64) -> Option<f64> {
    let key = format!("data-from=\"{from}\" data-to=\"{to}\"");
    let at = html.find(&key)?;
    let rest = &html[at..];
    let start = rest.find('>')? + 1;
    let end = rest[start..].find('<')? + start;
    rest[start..end].parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_serves_the_console_and_metrics_of_the_cluster() {
    let dir = scratch("console");
    let nodes = start_cluster(
        dir.path(),
        64,
        WAN,
        &[
            "region=us-east1,zone=us-east1-b",
            "region=us-west1,zone=us-west1-a",
            "region=europe-west1,zone=europe-west1-b",
        ],
    )
    .await;
    for n in &nodes {
        eventually("healthy", Duration::from_secs(30), || async {
            (http_get(n.pg_port, "/health").await.0 == 200).then_some(())
        })
        .await;
    }
    // Statements through two regions' gateways.
    for (i, n) in nodes.iter().enumerate().take(2) {
        let mut c = sqlx::postgres::PgConnectOptions::new()
            .host("127.0.0.1")
            .port(sql_port(n.pg_port))
            .username("root")
            .database("defaultdb")
            .ssl_mode(sqlx::postgres::PgSslMode::Disable)
            .connect()
            .await
            .unwrap();
        for _ in 0..5 {
            sqlx::query(&format!("SELECT {i}"))
                .execute(&mut c)
                .await
                .unwrap();
        }
    }
    // The simulated round trips, within ±25 %, on every node's matrix.
    let expected = [((1, 2), 63.0), ((1, 3), 87.0), ((2, 3), 132.0)];
    for n in &nodes {
        let html = eventually("every pair measured", Duration::from_secs(30), || async {
            let (status, html) = http_get(n.pg_port, "/network").await;
            (status == 200 && !html.contains(">?<")).then_some(html)
        })
        .await;
        for ((a, b), ms) in expected {
            for (from, to) in [(a, b), (b, a)] {
                let shown = cell(&html, from, to).unwrap_or_else(|| panic!("{from}→{to}: {html}"));
                assert!(
                    (shown - ms).abs() <= ms * 0.25,
                    "n{from}→n{to}: {shown} ms shown, {ms} ms simulated"
                );
            }
        }
    }
    let (status, sql) = http_get(nodes[2].pg_port, "/sql").await;
    assert_eq!(status, 200);
    assert!(sql.contains("<svg id=\"sql-chart\""), "{sql}");
    for region in ["us-east1", "us-west1"] {
        // Five statements each (and the connection's own, if any).
        let row = format!("<tr><td>{region}</td><td class=\"num\">");
        let at = sql.find(&row).unwrap_or_else(|| panic!("{region}: {sql}"));
        let count: u64 = sql[at + row.len()..]
            .split('<')
            .next()
            .and_then(|c| c.parse().ok())
            .unwrap();
        assert!(count >= 5, "{region}: {count} statements");
    }
    let (status, overview) = http_get(nodes[1].pg_port, "/").await;
    assert_eq!(status, 200);
    assert_eq!(overview.matches("class=\"live\"").count(), 3, "{overview}");
    let mut c = nodes[0].sql().await;
    sqlx::raw_sql("CREATE TABLE kv (k int PRIMARY KEY, v int)")
        .execute(&mut c)
        .await
        .unwrap();
    eventually(
        "the table's range on the page",
        Duration::from_secs(30),
        || async {
            let (status, ranges) = http_get(nodes[1].pg_port, "/ranges").await;
            (status == 200 && ranges.contains("<td>postgres.public.kv</td>")).then_some(())
        },
    )
    .await;

    // /metrics, through a real Prometheus text parser.
    let (status, text) = http_get(nodes[0].pg_port, "/metrics").await;
    assert_eq!(status, 200);
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("the exposition parses");
    let names: Vec<&str> = scrape.samples.iter().map(|s| s.metric.as_str()).collect();
    for m in [
        "pgmr_node_info",
        "pgmr_peer_rtt_seconds",
        "pgmr_raft_last_log_index",
        "pgmr_raft_applied_index",
        "pgmr_sql_sessions",
        "pgmr_sql_statement_duration_seconds_count",
        "pgmr_range_replicas",
    ] {
        assert!(names.contains(&m), "{m} missing from {text}");
    }
    let rtt = scrape
        .samples
        .iter()
        .find(|s| s.metric == "pgmr_peer_rtt_seconds" && s.labels.get("peer") == Some("3"))
        .expect("node 1's round trip to node 3");
    match rtt.value {
        prometheus_parse::Value::Gauge(v) => assert!((v - 0.087).abs() < 0.087 * 0.25, "{v}"),
        ref other => panic!("{other:?}"),
    }

    screenshots(nodes[0].pg_port).await;
}

/// Renders each page in headless Chromium and keeps the screenshots.
async fn screenshots(pg_port: u16) {
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/console-screenshots");
    std::fs::create_dir_all(&out).unwrap();
    let chromium = ["chromium", "chromium-browser"]
        .into_iter()
        .find(|c| {
            std::process::Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .expect("chromium is installed (scripts/setup.sh installs it)");
    let profile = tempfile::tempdir().unwrap();
    for (name, path) in [
        ("overview", "/"),
        ("network-latency", "/network"),
        ("sql-latency", "/sql"),
        ("ranges", "/ranges"),
    ] {
        let file = out.join(format!("{name}.png"));
        let _ = std::fs::remove_file(&file);
        let status = tokio::process::Command::new(chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                // Containers give /dev/shm 64 MB; Chromium then writes to /tmp instead.
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
                "--window-size=1100,700",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(format!("--screenshot={}", file.display()))
            .arg(format!("http://127.0.0.1:{}{path}", http_port(pg_port)))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .await
            .unwrap();
        assert!(status.success(), "chromium rendering {path}");
        let png = std::fs::read(&file).unwrap_or_default();
        assert!(
            png.len() > 5_000 && png.starts_with(b"\x89PNG"),
            "{name}.png is a rendered page ({} bytes)",
            png.len()
        );
    }
}
