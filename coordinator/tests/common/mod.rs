//! What the cluster test files share: real `pgmr start` processes, each supervising a real
//! PostgreSQL with the extension, talking over loopback through pgmr's simulated WAN.
#![allow(dead_code)] // each test file uses its own subset

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::ConnectOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const PGMR: &str = env!("CARGO_BIN_EXE_pgmr");

/// One `pgmr start` child; stopped (SIGTERM, so it stops its PostgreSQL) when dropped.
pub struct Node {
    pub child: Child,
    /// The arguments it was started with, to start it again on the same data dir.
    pub args: Vec<String>,
    pub pg_port: u16,
    pub rpc: String,
    pub data_dir: PathBuf,
    /// The testing knobs it was started with, which it keeps across restarts.
    pub env: Vec<(String, String)>,
}

impl Drop for Node {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- pgmr log of {} ---\n{}",
                self.data_dir.display(),
                self.log()
            );
            let pg =
                std::fs::read_to_string(self.data_dir.join("postgres.log")).unwrap_or_default();
            eprintln!("--- postgres log ---\n{pg}");
        }
        let pid = Pid::from_raw(self.child.id() as i32);
        let _ = kill(pid, Signal::SIGTERM);
        // A test that failed while pgmr was stopped must not leave it stopped: it would never
        // act on the SIGTERM, and its PostgreSQL would outlive the test holding the port.
        let _ = kill(pid, Signal::SIGCONT);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        kill_postmaster(&self.data_dir);
    }
}

/// Kills the PostgreSQL a SIGKILLed pgmr left behind, if any.
pub fn kill_postmaster(data_dir: &Path) {
    let pidfile = data_dir.join("pg").join("postmaster.pid");
    if let Some(pid) = std::fs::read_to_string(pidfile)
        .ok()
        .and_then(|s| s.lines().next().and_then(|l| l.trim().parse::<i32>().ok()))
    {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
}

impl Node {
    /// The whole node dies at once, as when its machine fails: pgmr and PostgreSQL.
    pub fn crash(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        kill_postmaster(&self.data_dir);
    }

    /// Starts pgmr again on the same data dir and ports (after [`Node::crash`] or a stop).
    pub fn restart(&mut self) {
        self.restart_with_env(&[]);
    }

    /// [`Node::restart`] with extra environment variables (a `PGMR_FAILPOINT`), besides
    /// those it was started with.
    pub fn restart_with_env(&mut self, env: &[(&str, &str)]) {
        let _ = self.child.wait();
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(self.data_dir.join("pgmr.log"))
            .unwrap();
        self.child = Command::new(PGMR)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn pgmr");
    }

    /// SIGTERM, then waits for a clean exit.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM);
        self.child.wait().unwrap()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.data_dir.join("pgmr.log")).unwrap_or_default()
    }

    pub async fn sql(&self) -> PgConnection {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.pg_port)
            .username("postgres")
            .database("postgres")
            .connect()
            .await
            .unwrap_or_else(|e| panic!("connect to node on {}: {e}\n{}", self.pg_port, self.log()))
    }
}

/// A scratch directory the PostgreSQL OS user can traverse.
/// A test's directory, removed when the test ends unless `PGMR_TEST_KEEP` is set (to read
/// the nodes' `pgmr.log` after a failure).
pub fn scratch(name: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix(&format!("pgmr-test-{name}-"))
        .disable_cleanup(std::env::var_os("PGMR_TEST_KEEP").is_some())
        .tempdir()
        .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    dir
}

pub fn start_node(
    dir: &Path,
    name: &str,
    locality: &str,
    rpc_port: u16,
    pg_port: u16,
    join: Option<&str>,
    extra: &[&str],
) -> Node {
    start_node_with_env(dir, name, locality, rpc_port, pg_port, join, extra, &[])
}

/// [`start_node`] with extra environment variables (testing knobs).
#[allow(clippy::too_many_arguments)]
pub fn start_node_with_env(
    dir: &Path,
    name: &str,
    locality: &str,
    rpc_port: u16,
    pg_port: u16,
    join: Option<&str>,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Node {
    let data_dir = dir.join(name);
    std::fs::create_dir_all(&data_dir).unwrap();
    let log = std::fs::File::create(data_dir.join("pgmr.log")).unwrap();
    let rpc = format!("127.0.0.1:{rpc_port}");
    let mut args: Vec<String> = vec![
        "start".into(),
        "--locality".into(),
        locality.into(),
        "--listen".into(),
        rpc.clone(),
        "--ephemeral".into(),
        "--die-with-parent".into(),
        "--data-dir".into(),
        data_dir.display().to_string(),
        "--pg-port".into(),
        pg_port.to_string(),
        "--sql-listen".into(),
        format!("127.0.0.1:{}", sql_port(pg_port)),
        "--http-listen".into(),
        format!("127.0.0.1:{}", http_port(pg_port)),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    if let Some(j) = join {
        args.extend(["--join".to_string(), j.to_string()]);
    }
    let child = Command::new(PGMR)
        .args(&args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("spawn pgmr");
    Node {
        child,
        args,
        pg_port,
        rpc,
        data_dir,
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

/// Polls `f` until it yields a value or `timeout` passes.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A connection to the node's PostgreSQL once pgmr reports it ready (accepting connections,
/// extension created), as `pgmr demo` waits for it.
pub async fn try_connect(port: u16) -> Option<PgConnection> {
    let mut c = PgConnectOptions::new()
        .host("127.0.0.1")
        .port(port)
        .username("postgres")
        .database("postgres")
        .connect()
        .await
        .ok()?;
    let pid: Option<i32> = sqlx::query_scalar("SELECT postmaster_pid FROM multiregion.node_info()")
        .fetch_one(&mut c)
        .await
        .ok()?;
    pid.map(|_| c)
}

/// Starts one node per locality from port block `block`, all simulating the latency matrix
/// `matrix` (file text), one after another so that node N has the Nth locality, and returns
/// once each serves SQL. Node 1 bootstraps; the others join it with its secret.
pub async fn start_cluster(dir: &Path, block: u16, matrix: &str, localities: &[&str]) -> Vec<Node> {
    start_cluster_with_env(dir, block, matrix, localities, &[]).await
}

/// [`start_cluster`] with extra environment variables for every node (testing knobs).
pub async fn start_cluster_with_env(
    dir: &Path,
    block: u16,
    matrix: &str,
    localities: &[&str],
    env: &[(&str, &str)],
) -> Vec<Node> {
    let matrix_file = dir.join("matrix.txt");
    std::fs::write(&matrix_file, matrix).unwrap();
    let lat = matrix_file.to_str().unwrap();
    let (rpc, pg) = ports(block);
    let mut nodes: Vec<Node> = Vec::new();
    for (i, locality) in localities.iter().enumerate() {
        let i16 = i as u16;
        let name = format!("n{}", i + 1);
        let node = match nodes.first() {
            None => start_node_with_env(
                dir,
                &name,
                locality,
                rpc,
                pg,
                None,
                &["--latency", lat],
                env,
            ),
            Some(first) => {
                let secret = first.data_dir.join("cluster-secret");
                let extra = ["--latency", lat, "--secret-file", secret.to_str().unwrap()];
                let join = first.rpc.clone();
                start_node_with_env(
                    dir,
                    &name,
                    locality,
                    rpc + i16,
                    pg + i16,
                    Some(&join),
                    &extra,
                    env,
                )
            }
        };
        eventually(
            &format!("node {} to serve SQL", i + 1),
            Duration::from_secs(90),
            || try_connect(node.pg_port),
        )
        .await;
        nodes.push(node);
    }
    nodes
}

/// The SQL gateway port of the node whose PostgreSQL port is `pg_port`.
pub fn sql_port(pg_port: u16) -> u16 {
    pg_port + 2000
}

/// The console's port of the node whose PostgreSQL listens on `pg_port`.
pub fn http_port(pg_port: u16) -> u16 {
    pg_port + 4000
}

/// Each test uses its own port block so tests can run in parallel. All test ports are below
/// Linux's ephemeral range (32768–60999), where a lingering client socket could hold them.
pub fn ports(block: u16) -> (u16, u16) {
    (21000 + block * 10, 22000 + block * 10)
}

/// SIGSTOPs `pid` and returns once every one of its threads is stopped. `kill` only queues the
/// stop: it takes effect when the thread chosen to receive it next runs, and until then the
/// process's other threads keep running (seen on a loaded CI machine: a tokio worker answered
/// a request after `kill` had returned).
pub async fn stop_process(pid: Pid) {
    kill(pid, Signal::SIGSTOP).unwrap();
    let all_stopped = || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .all(|t| {
                let stat =
                    std::fs::read_to_string(t.unwrap().path().join("stat")).unwrap_or_default();
                // The state is the first field after the parenthesised command name.
                matches!(
                    stat.rsplit(')')
                        .next()
                        .and_then(|r| r.split_whitespace().next()),
                    Some("T" | "t")
                )
            })
    };
    eventually("every thread to stop", Duration::from_secs(10), || async {
        all_stopped().then_some(())
    })
    .await;
}

/// Runs `sql`, which must fail within 5 s; returns (SQLSTATE, message). The outer 10 s timeout
/// turns a hang, the bug these checks exist for, into a failure.
pub async fn fails_within(c: &mut PgConnection, sql: &str) -> (String, String) {
    let started = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(10), sqlx::query(sql).execute(c))
        .await
        .unwrap_or_else(|_| panic!("{sql} hung"))
        .expect_err("must fail");
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(5), "{sql} took {waited:?}");
    let db = err.as_database_error().expect("a SQL error");
    (
        db.code().unwrap_or_default().to_string(),
        db.message().to_string(),
    )
}

/// Runs `pgmr` and returns its stdout, failing the test if it fails.
pub fn pgmr_ok(args: &[&str]) -> String {
    let out = Command::new(PGMR)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pgmr {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A connection to database `db` on `node` as `postgres`, if the node accepts one.
pub async fn connect(node: &Node, db: &str) -> Option<PgConnection> {
    PgConnectOptions::new()
        .host("127.0.0.1")
        .port(node.pg_port)
        .username("postgres")
        .database(db)
        .connect()
        .await
        .ok()
}

/// Runs `sql` (simple protocol: several statements allowed), failing the test on an error.
/// Runs each CockroachDB-dialect statement through `multiregion.execute`, panicking with the
/// statement on the first error.
pub async fn execute_all(c: &mut PgConnection, statements: &[&str]) {
    for sql in statements {
        sqlx::query("SELECT multiregion.execute($1)")
            .bind(sql)
            .execute(&mut *c)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
}

pub async fn exec(c: &mut PgConnection, sql: &str) {
    sqlx::raw_sql(sql)
        .execute(&mut *c)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Runs `sql` until it succeeds, for at most 30 s: right after a table is created its ranges
/// and their first leases settle within seconds, and a write meanwhile is refused with a
/// retryable error. Returns the rows it affected.
pub async fn exec_once_settled(c: &mut PgConnection, sql: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match sqlx::raw_sql(sql).execute(&mut *c).await {
            Ok(r) => return r.rows_affected(),
            Err(e) => assert!(Instant::now() < deadline, "{sql}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An error's SQLSTATE, or what the client said when it is not a SQL error.
pub fn code(e: &sqlx::Error) -> String {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.to_string())
        .unwrap_or_else(|| format!("client: {e}"))
}

/// An error's hint, or empty when it has none (or is not a SQL error).
pub fn hint(e: &sqlx::Error) -> String {
    e.as_database_error()
        .and_then(|d| d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>())
        .and_then(|d| d.hint())
        .unwrap_or_default()
        .to_string()
}

/// Turns row replication on for the cluster, retrying while a new cluster's meta group
/// settles.
pub async fn enable_replication(node: &Node) {
    eventually("replication on", Duration::from_secs(60), || async {
        let mut c = node.sql().await;
        sqlx::query(
            "SELECT multiregion.set_cluster_setting('multiregion.replication.enabled', 'true')",
        )
        .execute(&mut c)
        .await
        .ok()
        .map(|_| ())
    })
    .await;
}

/// `GET path` from the console of the node whose PostgreSQL is on `pg_port`: (status, body).
pub async fn http_get(pg_port: u16, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", http_port(pg_port)))
        .await
        .unwrap();
    tokio::io::AsyncWriteExt::write_all(
        &mut s,
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut raw = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut s, &mut raw)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, body.to_string())
}

/// A counter of the node's `/metrics` with these labels (`name{labels}`), 0 when absent.
pub async fn metric(pg_port: u16, name_and_labels: &str) -> f64 {
    let (_, text) = http_get(pg_port, "/metrics").await;
    text.lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// PostgreSQL's own pgbench (from `pg_config --bindir`, `PG_CONFIG` if set), connecting as
/// `postgres` to the node whose PostgreSQL is on `pg_port`; the caller adds the rest.
pub fn pgbench(pg_port: u16) -> Command {
    let bindir = Command::new(
        std::env::var("PG_CONFIG").unwrap_or("/usr/lib/postgresql/15/bin/pg_config".into()),
    )
    .arg("--bindir")
    .output()
    .expect("pg_config runs");
    let mut c = Command::new(format!(
        "{}/pgbench",
        String::from_utf8_lossy(&bindir.stdout).trim()
    ));
    c.args([
        "-h",
        "127.0.0.1",
        "-p",
        &pg_port.to_string(),
        "-U",
        "postgres",
    ]);
    c
}
