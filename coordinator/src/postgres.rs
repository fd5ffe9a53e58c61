//! Supervision of the node's own PostgreSQL: initdb, configuration, start, readiness,
//! `CREATE EXTENSION`, restart on death, orderly stop.
//!
//! PostgreSQL refuses to run as root, so when pgmr is root it runs `initdb` and `postgres` as
//! an unprivileged OS user (`--pg-user`, default `postgres`) and hands that user PGDATA and the
//! socket directory. The postmaster is pgmr's direct child, in its own process group (a Ctrl-C
//! meant for pgmr must not reach it), so pgmr learns of its death from `wait()` at once.

use crate::identity::DataDir;
use anyhow::{anyhow, bail, Context, Result};
use futures::FutureExt;
use mr_topology::Locality;
use nix::sys::signal::{kill, Signal};
use nix::unistd::{Gid, Pid, Uid, User};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

/// The superuser initdb creates; pgmr connects as it over the Unix socket only.
pub const SUPERUSER: &str = "postgres";
/// How long a (re)started postmaster may take to accept connections.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Restart backoff bounds: quick first retry, never a hot loop.
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
pub struct PgConfig {
    pub bin: PathBuf,
    pub data: DataDir,
    pub listen_host: String,
    pub port: u16,
    pub locality: Locality,
    /// The OS user to run as when pgmr is root.
    pub run_as: Option<(Uid, Gid)>,
    pub ephemeral: bool,
    /// Networks let in without a password (`--pg-trust`), kept in pg_hba.conf's pgmr block.
    pub trusted_networks: Vec<String>,
}

const HBA_BEGIN: &str = "# BEGIN pgmr --pg-trust (rewritten at every start)";
const HBA_END: &str = "# END pgmr --pg-trust";

/// `text` (a pg_hba.conf) with pgmr's block holding one `trust` line per network, or without
/// the block when there are none.
fn hba_with_trusted(text: &str, networks: &[String]) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in text.lines() {
        match line.trim() {
            HBA_BEGIN => inside = true,
            HBA_END => inside = false,
            _ if !inside => {
                out.push_str(line);
                out.push('\n');
            }
            _ => {}
        }
    }
    if !networks.is_empty() {
        out.push_str(HBA_BEGIN);
        out.push('\n');
        for n in networks {
            out.push_str(&format!("host all all {n} trust\n"));
        }
        out.push_str(HBA_END);
        out.push('\n');
    }
    out
}

/// Finds the PostgreSQL 15 server binaries: the flag, else `pg_config --bindir`, else
/// Debian's path; refuses anything that is not PostgreSQL 15.
pub fn resolve_bin(flag: Option<&Path>) -> Result<PathBuf> {
    let bin = match flag {
        Some(p) => p.to_path_buf(),
        None => std::process::Command::new("pg_config")
            .arg("--bindir")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
            .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin")),
    };
    let postgres = bin.join("postgres");
    let out = std::process::Command::new(&postgres)
        .arg("--version")
        .output()
        .with_context(|| format!("cannot run {} (set --pg-bin)", postgres.display()))?;
    let version = String::from_utf8_lossy(&out.stdout);
    if !version.contains(" 15.") {
        bail!(
            "{} is not PostgreSQL 15 ({})",
            postgres.display(),
            version.trim()
        );
    }
    Ok(bin)
}

/// The uid/gid PostgreSQL runs as: `user` when pgmr is root, pgmr's own otherwise.
pub fn resolve_user(user: &str) -> Result<Option<(Uid, Gid)>> {
    if !Uid::effective().is_root() {
        return Ok(None);
    }
    let u = User::from_name(user)
        .with_context(|| format!("cannot look up OS user {user:?}"))?
        .ok_or_else(|| {
            anyhow!("OS user {user:?} does not exist; PostgreSQL refuses to run as root, so pass --pg-user")
        })?;
    Ok(Some((u.uid, u.gid)))
}

/// Quotes a postgresql.conf string value.
fn conf_quote(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "''"))
}

impl PgConfig {
    fn pgdata(&self) -> PathBuf {
        self.data.pgdata()
    }

    fn chown(&self, path: &Path) -> Result<()> {
        if let Some((uid, gid)) = self.run_as {
            std::os::unix::fs::chown(path, Some(uid.as_raw()), Some(gid.as_raw())).with_context(
                || format!("cannot hand {} to the PostgreSQL user", path.display()),
            )?;
        }
        Ok(())
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.bin.join(program));
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid.as_raw()).gid(gid.as_raw());
        }
        // A Rust backtrace setting would make the extension attach backtraces to the errors
        // clients see; the server's environment is ours to choose.
        cmd.env_remove("RUST_BACKTRACE")
            .env_remove("RUST_LIB_BACKTRACE");
        cmd.process_group(0)
            .stdin(Stdio::null())
            .kill_on_drop(false);
        cmd
    }

    /// Runs initdb once; later starts find PG_VERSION and skip it.
    pub async fn ensure_initialized(&self) -> Result<()> {
        let pgdata = self.pgdata();
        self.chown(&self.data.run_dir())?;
        if pgdata.join("PG_VERSION").exists() {
            return self.write_config();
        }
        fs::create_dir_all(&pgdata)?;
        fs::set_permissions(&pgdata, fs::Permissions::from_mode(0o700))?;
        self.chown(&pgdata)?;
        let mut cmd = self.command("initdb");
        cmd.arg("-D")
            .arg(&pgdata)
            .args(["-U", SUPERUSER, "-A", "trust", "-E", "UTF8"]);
        cmd.args(["--locale=C.UTF-8"]);
        if self.ephemeral {
            cmd.arg("--no-sync");
        }
        let out = cmd.output().await.context("cannot run initdb")?;
        if !out.status.success() {
            let text = String::from_utf8_lossy(&out.stderr);
            bail!(
                "initdb failed: {}",
                text.lines().last().unwrap_or("").trim()
            );
        }
        self.write_config()
    }

    /// pgmr owns `pgmr.conf` (rewritten at every start) and includes it from postgresql.conf,
    /// so the user's own settings there stay theirs.
    fn write_config(&self) -> Result<()> {
        let pgdata = self.pgdata();
        let mut conf =
            String::from("# Written by pgmr at every start; edit postgresql.conf instead.\n");
        let mut set = |k: &str, v: String| conf.push_str(&format!("{k} = {v}\n"));
        set("listen_addresses", conf_quote(&self.listen_host));
        set("port", self.port.to_string());
        set(
            "unix_socket_directories",
            conf_quote(&self.data.run_dir().display().to_string()),
        );
        set("shared_preload_libraries", conf_quote("pg_multiregion"));
        set(
            "multiregion.locality",
            conf_quote(&self.locality.to_string()),
        );
        set(
            "multiregion.sidecar_socket",
            conf_quote(&self.data.socket().display().to_string()),
        );
        set("search_path", conf_quote("\"$user\", public, multiregion"));
        set("max_prepared_transactions", "64".into());
        if self.ephemeral {
            // Only an operating-system crash can lose data with these off; a killed postgres
            // still recovers every acknowledged commit (synchronous_commit stays on).
            set("fsync", "off".into());
            set("full_page_writes", "off".into());
            set("shared_buffers", conf_quote("64MB"));
        }
        let path = pgdata.join("pgmr.conf");
        fs::write(&path, conf).with_context(|| format!("cannot write {}", path.display()))?;
        self.chown(&path)?;
        self.write_hba()?;
        let main = pgdata.join("postgresql.conf");
        let text =
            fs::read_to_string(&main).with_context(|| format!("cannot read {}", main.display()))?;
        let include = "include_if_exists = 'pgmr.conf'";
        if !text.lines().any(|l| l.trim() == include) {
            fs::write(
                &main,
                format!("{text}\n# Settings pgmr manages.\n{include}\n"),
            )?;
        }
        Ok(())
    }

    /// pg_hba.conf has no include in PostgreSQL 15, so pgmr's lines (`--pg-trust`) live in a
    /// marked block at its end, replaced at every start and removed when there are none; the
    /// rest of the file stays the user's.
    fn write_hba(&self) -> Result<()> {
        let path = self.pgdata().join("pg_hba.conf");
        let text =
            fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let new = hba_with_trusted(&text, &self.trusted_networks);
        if new != text {
            fs::write(&path, new).with_context(|| format!("cannot write {}", path.display()))?;
        }
        Ok(())
    }

    /// Stops a postmaster left running by a pgmr that was killed: it holds the port and
    /// PGDATA's lock, and nobody else will ever stop it.
    pub async fn stop_orphan(&self) -> Result<()> {
        if let Some(pid) = stop_left_running(&self.pgdata()).await {
            tracing::warn!(pid, "stopped a PostgreSQL left running by an earlier pgmr");
        }
        Ok(())
    }

    /// Fails with one line if something else already listens on the PostgreSQL port.
    pub fn check_port(&self) -> Result<()> {
        let addr = format!("{}:{}", self.listen_host, self.port);
        std::net::TcpListener::bind(&addr)
            .map(drop)
            .with_context(|| format!("cannot use PostgreSQL port {addr}"))
    }

    /// How pgmr connects to database `db` of its PostgreSQL: as the superuser, over the Unix
    /// socket.
    pub fn connect_options(&self, db: &str) -> PgConnectOptions {
        PgConnectOptions::new()
            .host(&self.data.run_dir().display().to_string())
            .port(self.port)
            .username(SUPERUSER)
            .database(db)
            .disable_statement_logging()
    }

    fn spawn(&self) -> Result<Child> {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.data.pg_log())
            .with_context(|| format!("cannot open {}", self.data.pg_log().display()))?;
        let mut cmd = self.command("postgres");
        cmd.arg("-D")
            .arg(self.pgdata())
            .stdout(log.try_clone()?)
            .stderr(log);
        cmd.spawn().context("cannot start postgres")
    }

    /// Waits until the server accepts connections, failing early if the postmaster exits.
    async fn wait_ready(&self, child: &mut Child) -> Result<()> {
        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "postgres exited during startup ({status}); see {}",
                    self.data.pg_log().display()
                );
            }
            match self.connect_options("postgres").connect().await {
                Ok(conn) => {
                    let _ = conn.close().await;
                    return Ok(());
                }
                Err(e) if tokio::time::Instant::now() > deadline => {
                    bail!("postgres did not accept connections within 60 s: {e}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// The extension in `postgres` and in `template1`, so every new database has it; and what
    /// CockroachDB's clients expect to find: the admin user `root` (a superuser, which pg_hba.conf
    /// authenticates like any other) and the database `defaultdb`.
    async fn ensure_extension(&self) -> Result<()> {
        let mut admin = self.connect_options("postgres").connect().await?;
        crate::schema::simple(
            &mut admin,
            "DO $$ BEGIN \
               IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'root') THEN \
                 CREATE ROLE root SUPERUSER LOGIN; \
               END IF; END $$",
        )
        .await
        .context("cannot create the role root")?;
        let has_defaultdb: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_database WHERE datname = 'defaultdb')",
        )
        .fetch_one(&mut admin)
        .boxed()
        .await?;
        admin.close().await?;
        for db in ["template1", "postgres"] {
            let mut conn = self.connect_options(db).connect().await?;
            sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_multiregion")
                .execute(&mut conn)
                .await
                .with_context(|| format!("cannot create extension pg_multiregion in {db}"))?;
            conn.close().await?;
        }
        if !has_defaultdb {
            // After template1 has the extension, so defaultdb has it too.
            // Every node creates its own at start: not a change for the others.
            let mut admin = self.connect_options("postgres").connect().await?;
            crate::schema::simple(&mut admin, "SET multiregion.replicate_ddl = off")
                .await
                .context("cannot create the database defaultdb")?;
            crate::schema::simple(&mut admin, "CREATE DATABASE defaultdb")
                .await
                .context("cannot create the database defaultdb")?;
            admin.close().await?;
        }
        Ok(())
    }
}

/// What the rest of pgmr may know about the supervised server.
#[derive(Debug, Default)]
pub struct PgState {
    pid: Mutex<Option<u32>>,
    restarts: AtomicU64,
}

impl PgState {
    /// The postmaster's pid, once it accepts connections with the extension created.
    pub fn ready_pid(&self) -> Option<u32> {
        *self.pid.lock().expect("pg pid lock")
    }
    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }
    fn set_pid(&self, pid: Option<u32>) {
        *self.pid.lock().expect("pg pid lock") = pid;
    }
}

/// Starts PostgreSQL and returns once it is ready; failure here is fatal for `pgmr start`.
/// The returned task restarts it whenever it dies, until `stop` is cancelled, then shuts it
/// down cleanly.
pub async fn start(
    cfg: PgConfig,
    state: Arc<PgState>,
    stop: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>> {
    cfg.ensure_initialized().await?;
    let mut child = cfg.spawn()?;
    if let Err(e) = cfg.wait_ready(&mut child).await {
        terminate(&mut child).await;
        return Err(e);
    }
    if let Err(e) = cfg.ensure_extension().await {
        terminate(&mut child).await;
        return Err(e);
    }
    state.set_pid(child.id());
    tracing::info!(pid = child.id(), port = cfg.port, "PostgreSQL is ready");
    Ok(tokio::spawn(supervise(cfg, state, stop, child)))
}

async fn supervise(cfg: PgConfig, state: Arc<PgState>, stop: CancellationToken, mut child: Child) {
    let mut backoff = BACKOFF_MIN;
    loop {
        tokio::select! {
            status = child.wait() => {
                state.set_pid(None);
                tracing::warn!("PostgreSQL exited ({}); restarting it",
                    status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()));
            }
            _ = stop.cancelled() => {
                state.set_pid(None);
                terminate(&mut child).await;
                return;
            }
        }
        // Restart until one attempt reaches readiness; orphaned backends of the dead
        // postmaster can hold its shared memory for a moment, hence the backoff.
        loop {
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stop.cancelled() => return,
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
            let attempt = async {
                let mut c = cfg.spawn()?;
                match cfg.wait_ready(&mut c).await.and(Ok(())) {
                    Ok(()) => Ok(c),
                    Err(e) => {
                        terminate(&mut c).await;
                        Err(e)
                    }
                }
            };
            match attempt.await {
                Ok(c) => {
                    child = c;
                    if let Err(e) = cfg.ensure_extension().await {
                        tracing::warn!("after restart: {e:#}");
                    }
                    state.restarts.fetch_add(1, Ordering::Relaxed);
                    state.set_pid(child.id());
                    tracing::info!(pid = child.id(), "PostgreSQL restarted");
                    backoff = BACKOFF_MIN;
                    break;
                }
                Err(e) => tracing::warn!("PostgreSQL restart failed: {e:#}"),
            }
        }
    }
}

/// Fast shutdown (SIGINT), then immediate (SIGQUIT), then SIGKILL, each given this long.
const STOP_LADDER: [(Signal, Duration); 3] = [
    (Signal::SIGINT, Duration::from_secs(20)),
    (Signal::SIGQUIT, Duration::from_secs(5)),
    (Signal::SIGKILL, Duration::from_secs(5)),
];

/// Stops our own child, reaping it.
async fn terminate(child: &mut Child) {
    let Some(pid) = child.id() else { return };
    for (sig, wait) in STOP_LADDER {
        let _ = kill(Pid::from_raw(pid as i32), sig);
        if tokio::time::timeout(wait, child.wait()).await.is_ok() {
            return;
        }
    }
}

/// Stops the postmaster `pgdata`'s `postmaster.pid` names, if one is still running there
/// (a pgmr that died, or was killed, before stopping it): its pid, if it was.
pub async fn stop_left_running(pgdata: &Path) -> Option<i32> {
    let text = fs::read_to_string(pgdata.join("postmaster.pid")).ok()?;
    let pid: i32 = text.lines().next()?.trim().parse().ok()?;
    let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    if comm.trim() != "postgres" || kill(Pid::from_raw(pid), None).is_err() {
        return None;
    }
    stop_pid(pid).await;
    Some(pid)
}

/// Stops a postmaster that is not our child (so it can only be polled, not waited for).
async fn stop_pid(pid: i32) {
    for (sig, wait) in STOP_LADDER {
        let _ = kill(Pid::from_raw(pid), sig);
        let deadline = tokio::time::Instant::now() + wait;
        while tokio::time::Instant::now() < deadline {
            if kill(Pid::from_raw(pid), None).is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conf_values_are_quoted() {
        assert_eq!(conf_quote("a'b\\c"), "'a''b\\\\c'");
    }

    #[test]
    fn trusted_networks_replace_pgmrs_own_block_and_nothing_else() {
        let user = "local all all trust\nhost all all 127.0.0.1/32 trust\n";
        let one = hba_with_trusted(user, &["172.16.0.0/12".into()]);
        assert!(one.starts_with(user));
        assert!(one.contains("host all all 172.16.0.0/12 trust\n"));
        let other = hba_with_trusted(&one, &["10.0.0.0/8".into()]);
        assert!(!other.contains("172.16.0.0/12"));
        assert_eq!(other.matches(HBA_BEGIN).count(), 1);
        assert_eq!(hba_with_trusted(&other, &[]), user);
    }
}
