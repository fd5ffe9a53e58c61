//! The SQL gateway against a real node (pgmr supervising a real PostgreSQL), with real clients:
//! tokio-postgres over both protocols, and a raw-socket client for what a driver would never
//! send (malformed and oversized messages) or never show (command tags, TLS negotiation).

mod common;

use common::*;
use mr_pgproto as proto;
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_postgres::{NoTls, SimpleQueryMessage};

const REGION: &str = "region=us-east1,zone=us-east1-b";

/// One node for every test in this file (each test uses its own tables and roles). It outlives
/// the tests and stops with the test process (`--die-with-parent`).
fn node() -> &'static Node {
    static NODE: OnceLock<Node> = OnceLock::new();
    NODE.get_or_init(|| {
        std::thread::spawn(|| {
            let dir = Box::leak(Box::new(scratch("gateway")));
            let (rpc, pg) = ports(20);
            let n = start_node(dir.path(), "n1", REGION, rpc, pg, None, &[]);
            tokio::runtime::Runtime::new().unwrap().block_on(async {
                eventually("PostgreSQL", Duration::from_secs(90), || {
                    try_connect(n.pg_port)
                })
                .await;
                eventually("the SQL gateway", Duration::from_secs(30), || async {
                    TcpStream::connect(("127.0.0.1", sql_port(n.pg_port)))
                        .await
                        .ok()
                })
                .await;
            });
            n
        })
        .join()
        .unwrap()
    })
}

fn gateway() -> u16 {
    sql_port(node().pg_port)
}

async fn client_as(
    user: &str,
    password: Option<&str>,
    db: &str,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let mut cfg = tokio_postgres::Config::new();
    cfg.host("127.0.0.1").port(gateway()).user(user).dbname(db);
    if let Some(p) = password {
        cfg.password(p);
    }
    let (client, conn) = cfg.connect(NoTls).await?;
    tokio::spawn(conn);
    Ok(client)
}

async fn client() -> tokio_postgres::Client {
    client_as("root", None, "defaultdb")
        .await
        .expect("connect through the gateway")
}

/// A client speaking the protocol by hand.
struct Raw<S> {
    s: S,
    buf: Vec<u8>,
}

impl Raw<TcpStream> {
    async fn connect() -> Raw<TcpStream> {
        Raw::connect_to(gateway()).await
    }

    async fn connect_to(port: u16) -> Raw<TcpStream> {
        Raw {
            s: TcpStream::connect(("127.0.0.1", port)).await.unwrap(),
            buf: Vec::new(),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Raw<S> {
    async fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).await.unwrap();
    }

    async fn startup(&mut self, db: &str) {
        let mut m = Vec::new();
        proto::startup_message(
            &mut m,
            &[
                ("user".into(), "root".into()),
                ("database".into(), db.into()),
            ],
        );
        self.send(&m).await;
        self.until_ready().await;
    }

    /// The next whole message, or `None` once the gateway closed the connection.
    async fn next(&mut self) -> Option<Vec<u8>> {
        loop {
            if let Ok(Some((_, len))) = proto::header(&self.buf, usize::MAX >> 1) {
                if self.buf.len() >= len {
                    return Some(self.buf.drain(..len).collect());
                }
            }
            let mut chunk = [0u8; 65536];
            match tokio::time::timeout(Duration::from_secs(30), self.s.read(&mut chunk)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return None,
                Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
                Err(_) => panic!("no answer from the gateway within 30 s"),
            }
        }
    }

    /// Every message up to and including ReadyForQuery.
    async fn until_ready(&mut self) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while let Some(m) = self.next().await {
            let done = m[0] == b'Z';
            out.push(m);
            if done {
                return out;
            }
        }
        panic!("connection closed before ReadyForQuery: {out:?}");
    }

    /// The command tags and error SQLSTATEs of one exchange, in order.
    async fn outcomes(&mut self) -> Vec<String> {
        self.until_ready()
            .await
            .iter()
            .filter_map(|m| match m[0] {
                b'C' => Some(proto::read_command_complete(m).unwrap().to_string()),
                b'E' => Some(format!("error {}", field(m, b'C'))),
                _ => None,
            })
            .collect()
    }

    async fn query(&mut self, sql: &str) -> Vec<String> {
        let mut m = Vec::new();
        proto::query(&mut m, sql);
        self.send(&m).await;
        self.outcomes().await
    }
}

fn field(msg: &[u8], code: u8) -> String {
    proto::read_fields(msg)
        .unwrap()
        .into_iter()
        .find(|(c, _)| *c == code)
        .map(|(_, v)| v)
        .unwrap_or_default()
}

fn rows(messages: Vec<SimpleQueryMessage>) -> Vec<Vec<Option<String>>> {
    messages
        .into_iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => {
                Some((0..r.len()).map(|i| r.get(i).map(str::to_string)).collect())
            }
            _ => None,
        })
        .collect()
}

/// A direct connection to the node's PostgreSQL, for checking what the gateway did.
async fn direct() -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(
        &format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            node().pg_port
        ),
        NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    client
}

#[tokio::test]
async fn simple_and_extended_protocols_see_the_same_results() {
    let c = client().await;
    c.batch_execute("CREATE TABLE proto_t (id INT PRIMARY KEY, v TEXT)")
        .await
        .unwrap();
    // Extended: parameters, typed columns, CockroachDB statements prepared like any other
    // (INT is CockroachDB's: 8 bytes).
    c.execute("INSERT INTO proto_t VALUES ($1, $2)", &[&1i64, &"one"])
        .await
        .unwrap();
    let n = c
        .execute(
            "UPSERT INTO proto_t (id, v) VALUES ($1, $2)",
            &[&1i64, &"uno"],
        )
        .await
        .unwrap();
    assert_eq!(n, 1);
    let row = c
        .query_one("SELECT v FROM proto_t WHERE id = $1", &[&1i64])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "uno");
    let regions = c.query("SHOW REGIONS FROM CLUSTER", &[]).await.unwrap();
    assert_eq!(regions.len(), 1);
    assert_eq!(regions[0].get::<_, String>("region"), "us-east1");
    assert_eq!(
        regions[0].get::<_, Vec<String>>("zones"),
        vec!["us-east1-b"]
    );
    let one = c
        .query_one(
            "SELECT region FROM [SHOW REGIONS FROM CLUSTER] WHERE region = $1",
            &[&"us-east1"],
        )
        .await
        .unwrap();
    assert_eq!(one.get::<_, String>(0), "us-east1");
    let gw: String = c
        .query_one("SELECT gateway_region()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(gw, "us-east1");
    // Simple: the same answers as text.
    let simple = rows(
        c.simple_query("SELECT v FROM proto_t WHERE id = 1; SHOW REGIONS FROM CLUSTER")
            .await
            .unwrap(),
    );
    assert_eq!(
        simple,
        vec![
            vec![Some("uno".to_string())],
            vec![
                Some("us-east1".to_string()),
                Some("{us-east1-b}".to_string())
            ]
        ]
    );
    // An error in a prepared CockroachDB statement is PostgreSQL's ordinary error.
    let e = c
        .query("SELECT * FROM proto_t AS OF SYSTEM TIME '-1s'", &[])
        .await
        .unwrap_err();
    assert_eq!(e.code().unwrap().code(), "0A000");
    assert_eq!(
        c.query_one("SELECT 1", &[]).await.unwrap().get::<_, i32>(0),
        1
    );
}

#[tokio::test]
async fn command_tags_are_cockroachdbs_over_both_protocols() {
    let mut r = Raw::connect().await;
    r.startup("defaultdb").await;
    assert_eq!(
        r.query(r#"CREATE DATABASE gw_tags PRIMARY REGION "us-east1""#)
            .await,
        vec!["CREATE DATABASE"]
    );
    assert_eq!(r.query("USE gw_tags").await, vec!["SET"]);
    assert_eq!(
        r.query(r#"ALTER DATABASE gw_tags SURVIVE ZONE FAILURE"#)
            .await,
        vec!["ALTER DATABASE SURVIVE"]
    );
    assert_eq!(
        r.query("CREATE TABLE tags_t (k TEXT PRIMARY KEY, v TEXT) LOCALITY GLOBAL")
            .await,
        vec!["CREATE TABLE"]
    );
    assert_eq!(
        r.query(
            "SHOW REGIONS FROM CLUSTER; SHOW LOCALITY; UPSERT INTO tags_t VALUES ('a', '1'); \
             SELECT 1; ALTER TABLE tags_t SET LOCALITY REGIONAL BY TABLE; SHOW TABLES"
        )
        .await,
        vec![
            "SHOW REGIONS 1",
            "SHOW",
            "INSERT 0 1",
            "SELECT 1",
            "ALTER TABLE SET LOCALITY",
            "SHOW TABLES 1"
        ]
    );
    // An error stops the string where it happens, as in PostgreSQL.
    assert_eq!(
        r.query("SELECT 1; SELECT * FROM tags_t AS OF SYSTEM TIME '-1s'; SELECT 2")
            .await,
        vec!["SELECT 1", "error 0A000"]
    );
    // Extended: Parse/Bind/Describe/Execute/Sync, twice in one pipeline.
    let mut m = Vec::new();
    for sql in [
        "SHOW REGIONS FROM CLUSTER",
        "ALTER TABLE tags_t SET LOCALITY GLOBAL",
    ] {
        proto::parse(&mut m, "", sql, &[0, 0]);
        proto::message(&mut m, b'B', |b| {
            b.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0])
        });
        proto::message(&mut m, b'D', |b| b.extend_from_slice(b"P\0"));
        proto::message(&mut m, b'E', |b| b.extend_from_slice(&[0, 0, 0, 0, 0]));
        proto::message(&mut m, b'S', |_| {});
    }
    r.send(&m).await;
    assert_eq!(r.outcomes().await, vec!["SHOW REGIONS 1"]);
    assert_eq!(r.outcomes().await, vec!["ALTER TABLE SET LOCALITY"]);
}

#[tokio::test]
async fn copy_in_and_out_pass_through() {
    use futures::{SinkExt, StreamExt};
    let c = client().await;
    c.batch_execute("CREATE TABLE copy_t (id INT, v TEXT)")
        .await
        .unwrap();
    let sink = c.copy_in("COPY copy_t FROM STDIN").await.unwrap();
    futures::pin_mut!(sink);
    let mut data = String::new();
    for i in 0..100_000 {
        data.push_str(&format!("{i}\trow {i}\n"));
    }
    sink.send(bytes::Bytes::from(data.clone())).await.unwrap();
    assert_eq!(sink.finish().await.unwrap(), 100_000);
    let out = c.copy_out("COPY copy_t TO STDOUT").await.unwrap();
    futures::pin_mut!(out);
    let mut back = Vec::new();
    while let Some(chunk) = out.next().await {
        back.extend_from_slice(&chunk.unwrap());
    }
    assert_eq!(String::from_utf8(back).unwrap(), data);
}

#[tokio::test]
async fn a_cancel_request_stops_the_running_query() {
    let c = client().await;
    let token = c.cancel_token();
    let canceller = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        token.cancel_query(NoTls).await
    });
    let started = Instant::now();
    let e = c.simple_query("SELECT pg_sleep(30)").await.unwrap_err();
    assert_eq!(e.code().unwrap().code(), "57014", "{e}");
    assert!(started.elapsed() < Duration::from_secs(20));
    canceller.await.unwrap().unwrap();
    // The session goes on.
    assert_eq!(
        rows(c.simple_query("SELECT 7").await.unwrap()),
        vec![vec![Some("7".into())]]
    );
}

#[tokio::test]
async fn an_error_in_the_middle_of_a_result_keeps_the_rows_before_it_and_the_session() {
    use futures::StreamExt;
    let c = client().await;
    let stream = c
        .query_raw(
            "SELECT 1 / (5000 - i) FROM generate_series(1, 10000) i",
            std::iter::empty::<i32>(),
        )
        .await
        .unwrap();
    futures::pin_mut!(stream);
    let mut ok = 0;
    let mut error = None;
    while let Some(r) = stream.next().await {
        match r {
            Ok(_) => ok += 1,
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    assert_eq!(error.unwrap().code().unwrap().code(), "22012");
    assert!(ok < 5000, "{ok} rows before the error");
    assert_eq!(
        rows(c.simple_query("SELECT 8").await.unwrap()),
        vec![vec![Some("8".into())]]
    );
}

#[tokio::test]
async fn a_client_that_disconnects_mid_query_leaves_no_backend_running_it() {
    let mut r = Raw::connect().await;
    r.startup("defaultdb").await;
    let mut m = Vec::new();
    proto::query(&mut m, "SELECT pg_sleep(120) /* disconnect-test */");
    r.send(&m).await;
    let admin = direct().await;
    let running = "SELECT count(*) FROM pg_stat_activity \
                   WHERE query LIKE '%disconnect-test%' AND pid <> pg_backend_pid()";
    eventually("the query to start", Duration::from_secs(10), || async {
        let n: i64 = admin.query_one(running, &[]).await.unwrap().get(0);
        (n == 1).then_some(())
    })
    .await;
    drop(r);
    eventually("its backend to end", Duration::from_secs(10), || async {
        let n: i64 = admin.query_one(running, &[]).await.unwrap().get(0);
        (n == 0).then_some(())
    })
    .await;
}

/// Each bad input ends only its own connection, with a FATAL 08P01; a session opened before
/// keeps working and new ones connect.
#[tokio::test]
async fn malformed_and_oversized_messages_close_only_their_connection() {
    let bystander = client().await;
    let startup_too_short = 3u32.to_be_bytes().to_vec();
    let mut startup_too_long = 100_000u32.to_be_bytes().to_vec();
    startup_too_long.extend_from_slice(&[0; 4]);
    let bad_version = [0, 0, 0, 8, 0, 9, 0, 0].to_vec();
    for (what, startup, after) in [
        ("startup length 3", startup_too_short, None),
        ("oversized startup", startup_too_long, None),
        ("protocol 9.0", bad_version, None),
        ("message length 2", Vec::new(), Some(vec![b'Q', 0, 0, 0, 2])),
        (
            "oversized query",
            Vec::new(),
            Some(vec![b'Q', 0x7f, 0xff, 0xff, 0xff]),
        ),
    ] {
        let mut r = Raw::connect().await;
        if let Some(bad) = after {
            r.startup("defaultdb").await;
            r.send(&bad).await;
        } else {
            r.send(&startup).await;
        }
        let m = r.next().await.unwrap_or_else(|| panic!("{what}: no error"));
        assert_eq!(m[0], b'E', "{what}");
        assert_eq!(field(&m, b'S'), "FATAL", "{what}");
        assert_eq!(field(&m, b'C'), "08P01", "{what}");
        assert!(r.next().await.is_none(), "{what}: connection left open");
        assert_eq!(
            rows(bystander.simple_query("SELECT 1").await.unwrap()),
            vec![vec![Some("1".into())]]
        );
    }
    client().await.simple_query("SELECT 1").await.unwrap();
}

/// PostgreSQL authenticates through the gateway: trust, md5 and SCRAM as pg_hba.conf says.
/// A session that switches database (`USE`) logs in again as the same user.
#[tokio::test]
async fn passwords_are_checked_by_postgres_with_md5_and_scram() {
    let admin = direct().await;
    admin
        .batch_execute(
            "SET password_encryption = 'md5'; CREATE ROLE gw_md5 LOGIN PASSWORD 'md5-secret'; \
             SET password_encryption = 'scram-sha-256'; \
             CREATE ROLE gw_scram LOGIN PASSWORD 'scram-secret'",
        )
        .await
        .unwrap();
    admin
        .batch_execute("CREATE DATABASE gw_auth_other")
        .await
        .unwrap();
    let hba: String = admin.query_one("SHOW hba_file", &[]).await.unwrap().get(0);
    let old = std::fs::read_to_string(&hba).unwrap();
    std::fs::write(
        &hba,
        format!("local all gw_md5 md5\nlocal all gw_scram scram-sha-256\n{old}"),
    )
    .unwrap();
    admin
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;

    for (user, password) in [("gw_md5", "md5-secret"), ("gw_scram", "scram-secret")] {
        let c = client_as(user, Some(password), "postgres")
            .await
            .unwrap_or_else(|e| panic!("{user}: {e}"));
        let who = rows(c.simple_query("SELECT current_user").await.unwrap());
        assert_eq!(who, vec![vec![Some(user.to_string())]]);
        let e = client_as(user, Some("wrong"), "postgres")
            .await
            .err()
            .unwrap();
        assert_eq!(e.code().unwrap().code(), "28P01", "{user}");
        assert!(
            client_as(user, None, "postgres").await.is_err(),
            "{user} without a password"
        );
        // USE: md5 from the stored verifier; SCRAM cannot be replayed and says so.
        let used = c.simple_query("USE gw_auth_other").await;
        match user {
            "gw_md5" => {
                used.unwrap();
                let db = rows(
                    c.simple_query("SELECT current_database(), current_user")
                        .await
                        .unwrap(),
                );
                assert_eq!(
                    db,
                    vec![vec![Some("gw_auth_other".into()), Some("gw_md5".into())]]
                );
            }
            _ => assert_eq!(used.unwrap_err().code().unwrap().code(), "0A000"),
        }
    }
    // Trust, as the demo's pg_hba.conf has it for everyone else.
    client().await.simple_query("SELECT 1").await.unwrap();
}

#[tokio::test]
async fn tls_is_offered_and_a_session_runs_over_it() {
    use rustls::pki_types::{pem::PemObject, CertificateDer, ServerName};
    let mut tcp = TcpStream::connect(("127.0.0.1", gateway())).await.unwrap();
    tcp.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
        .await
        .unwrap();
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"S");
    let cert_file = node().data_dir.join("sql-tls").join("cert.pem");
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&cert_file).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("TLS handshake with the gateway's certificate");
    let mut r = Raw {
        s: tls,
        buf: Vec::new(),
    };
    r.startup("defaultdb").await;
    assert_eq!(r.query("SHOW LOCALITY").await, vec!["SHOW"]);
}

/// A result far larger than pgmr's buffers, read slowly: pgmr's memory stays flat because it
/// stops reading from PostgreSQL while the client is behind. On a node of its own: the other
/// tests of this file run at the same time on the shared node, and once moved its memory by
/// 88 MB in these 2 s (a fresh-machine CI run failed so).
#[tokio::test]
async fn large_results_stream_without_being_buffered_whole() {
    let dir = scratch("gateway-stream");
    let (rpc, pg) = ports(21);
    let n = start_node(dir.path(), "n1", REGION, rpc, pg, None, &[]);
    eventually("PostgreSQL", Duration::from_secs(90), || {
        try_connect(n.pg_port)
    })
    .await;
    eventually("the SQL gateway", Duration::from_secs(30), || async {
        TcpStream::connect(("127.0.0.1", sql_port(n.pg_port)))
            .await
            .ok()
    })
    .await;
    let pid = n.child.id();
    let rss = || -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse().ok())
            .unwrap()
    };
    let mut r = Raw::connect_to(sql_port(n.pg_port)).await;
    r.startup("defaultdb").await;
    let before = rss();
    let mut m = Vec::new();
    // 400 MB of rows.
    proto::query(
        &mut m,
        "SELECT repeat('x', 8000) FROM generate_series(1, 50000)",
    );
    r.send(&m).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let during = rss();
    let mut rows = 0;
    let mut bytes = 0usize;
    loop {
        let m = r.next().await.expect("result");
        match m[0] {
            b'D' => {
                rows += 1;
                bytes += m.len();
            }
            b'Z' => break,
            _ => {}
        }
    }
    assert_eq!(rows, 50_000);
    assert!(bytes > 400_000_000);
    assert!(
        during.saturating_sub(before) < 64 * 1024,
        "pgmr grew from {before} kB to {during} kB while the client was not reading"
    );
}

/// CockroachDB's schema changes do not wait for a session that read and went idle inside its
/// transaction (the MovR app leaves one open while it runs `configure-multi-region`). Through
/// the gateway, such a READ COMMITTED reader's transaction is restarted, savepoints and all,
/// and the schema change goes ahead; a transaction that wrote is waited for, as PostgreSQL
/// always does.
#[tokio::test]
async fn an_idle_reader_does_not_block_a_schema_change() {
    let admin = client().await;
    admin
        .simple_query(r#"CREATE DATABASE gw_idle PRIMARY REGION "us-east1""#)
        .await
        .unwrap();
    let ddl = client_as("root", None, "gw_idle").await.unwrap();
    ddl.batch_execute("CREATE TABLE readers_t (id INT PRIMARY KEY, v TEXT); INSERT INTO readers_t VALUES (1, 'a')")
        .await
        .unwrap();
    let reader = client_as("root", None, "gw_idle").await.unwrap();
    reader
        .batch_execute("BEGIN; SAVEPOINT cockroach_restart; SELECT * FROM readers_t")
        .await
        .unwrap();
    let altered = tokio::time::timeout(
        Duration::from_secs(20),
        ddl.simple_query("ALTER TABLE readers_t SET LOCALITY REGIONAL BY ROW"),
    )
    .await
    .expect("the schema change waited for an idle reader");
    altered.unwrap();
    // The reader's transaction goes on, savepoint included, and sees the new table.
    reader
        .batch_execute(
            "SELECT crdb_region FROM readers_t; RELEASE SAVEPOINT cockroach_restart; COMMIT",
        )
        .await
        .unwrap();

    // A transaction that wrote keeps its locks: the schema change waits (here: times out).
    let writer = client_as("root", None, "gw_idle").await.unwrap();
    writer
        .batch_execute("BEGIN; UPDATE readers_t SET v = 'b' WHERE id = 1")
        .await
        .unwrap();
    let e = ddl
        .batch_execute("SET lock_timeout = '1s'; ALTER TABLE readers_t SET LOCALITY GLOBAL")
        .await
        .unwrap_err();
    assert_eq!(e.code().unwrap().code(), "55P03", "{e}");
    writer.batch_execute("COMMIT").await.unwrap();
}
