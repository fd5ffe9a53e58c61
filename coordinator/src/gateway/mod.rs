//! The SQL gateway: CockroachDB's door into a node. It speaks PostgreSQL's wire protocol on
//! its own port (26257 by default), relays every connection to the node's PostgreSQL over the
//! Unix socket, and rewrites what PostgreSQL's parser would reject but CockroachDB accepts
//! through the shared translator (`mr_sql::translate`). Authentication is PostgreSQL's: the
//! gateway relays it, so pg_hba.conf decides (its `local` lines, since that is how the
//! gateway connects).
//!
//! See docs/ARCHITECTURE.md, "The SQL gateway".

mod session;
mod tls;

use crate::postgres::PgConfig;
use anyhow::{Context, Result};
use futures::{FutureExt, TryFutureExt};
use sqlx::postgres::{PgDatabaseError, PgPool, PgPoolOptions};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio_util::sync::CancellationToken;

/// Flags of `pgmr start` that configure the gateway.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    pub listen: String,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
}

pub struct Gateway {
    pg: PgConfig,
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// Client-visible (pid, key) → the backend's own (pid, key). The gateway hands clients a
    /// key of its own so that a session whose backend changes (`USE`) stays cancellable.
    cancels: Mutex<HashMap<(i32, i32), (i32, i32)>>,
    /// Sessions by their backend's pid, to ask one to restart its idle transaction.
    sessions: Mutex<HashMap<i32, tokio::sync::mpsc::UnboundedSender<session::Control>>>,
    /// Superuser pools per database, for the catalog lookups `UPSERT` needs and for
    /// configuring a database created with regions.
    pools: Mutex<HashMap<String, PgPool>>,
    /// Statement latencies, for the console and `/metrics`.
    pub stats: crate::stats::SqlStats,
    /// Client sessions open now.
    pub sessions_open: std::sync::atomic::AtomicI64,
}

/// Binds the SQL port: a busy port stops `pgmr start` with one line before anything starts.
pub async fn bind(cfg: &GatewayConfig) -> Result<TcpListener> {
    TcpListener::bind(&cfg.listen)
        .await
        .with_context(|| format!("cannot listen for SQL clients on {}", cfg.listen))
}

impl Gateway {
    pub fn new(pg: PgConfig, cfg: &GatewayConfig) -> Result<Arc<Gateway>> {
        let tls = tls::server_config(
            &pg.data.root.join("sql-tls"),
            cfg.tls_cert.as_deref(),
            cfg.tls_key.as_deref(),
        )?;
        Ok(Arc::new(Gateway {
            pg,
            tls: Some(tokio_rustls::TlsAcceptor::from(tls)),
            cancels: Mutex::default(),
            sessions: Mutex::default(),
            pools: Mutex::default(),
            stats: Default::default(),
            sessions_open: Default::default(),
        }))
    }

    /// Accepts clients until `stop` and hands them round-robin to the gateway's threads. Each
    /// thread runs its sessions on a single-threaded runtime: a relayed round trip then costs
    /// its socket calls and no cross-thread wake-ups (which on a 2-core machine cost more
    /// than the relaying itself). Each connection is its own task, so one client's malformed
    /// input or hang never touches the others.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, stop: CancellationToken) {
        let threads = std::thread::available_parallelism()
            .map(|n| (n.get() / 2).max(1))
            .unwrap_or(1);
        let mut workers = Vec::new();
        for i in 0..threads {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<std::net::TcpStream>();
            let gw = self.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("pgmr-sql-{i}"))
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => return tracing::error!("SQL gateway thread: {e}"),
                    };
                    rt.block_on(async move {
                        while let Some(std_tcp) = rx.recv().await {
                            let gw = gw.clone();
                            tokio::spawn(async move {
                                let peer = std_tcp.peer_addr().ok();
                                let result = match TcpStream::from_std(std_tcp) {
                                    Ok(tcp) => session::run(gw, tcp).await,
                                    Err(e) => Err(e.into()),
                                };
                                if let Err(e) = result {
                                    tracing::debug!(?peer, "SQL connection ended: {e:#}");
                                }
                            });
                        }
                    });
                });
            match spawned {
                Ok(_) => workers.push(tx),
                Err(e) => tracing::error!("cannot start a SQL gateway thread: {e}"),
            }
        }
        let mut next = 0usize;
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = stop.cancelled() => return,
            };
            match accepted.and_then(|(tcp, _)| tcp.into_std()) {
                Ok(tcp) => {
                    if workers.is_empty() {
                        return;
                    }
                    next = (next + 1) % workers.len();
                    let _ = workers[next].send(tcp);
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("SQL gateway accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    fn pg_socket(&self) -> PathBuf {
        self.pg
            .data
            .run_dir()
            .join(format!(".s.PGSQL.{}", self.pg.port))
    }

    async fn connect_pg(&self) -> std::io::Result<UnixStream> {
        UnixStream::connect(self.pg_socket()).await
    }

    fn register_cancel(&self, backend: (i32, i32)) -> (i32, i32) {
        let mut raw = [0u8; 4];
        let key = loop {
            let _ = getrandom::fill(&mut raw);
            let key = i32::from_be_bytes(raw);
            if !self
                .cancels
                .lock()
                .expect("cancels")
                .contains_key(&(backend.0, key))
            {
                break key;
            }
        };
        self.cancels
            .lock()
            .expect("cancels")
            .insert((backend.0, key), backend);
        (backend.0, key)
    }

    fn rebind_cancel(&self, client: (i32, i32), backend: (i32, i32)) {
        self.cancels
            .lock()
            .expect("cancels")
            .insert(client, backend);
    }

    fn forget_cancel(&self, client: (i32, i32)) {
        self.cancels.lock().expect("cancels").remove(&client);
    }

    /// Relays a cancel request to the backend the key belongs to; an unknown key is ignored,
    /// as PostgreSQL ignores it.
    async fn cancel(&self, pid: i32, key: i32) {
        let target = self
            .cancels
            .lock()
            .expect("cancels")
            .get(&(pid, key))
            .copied();
        let Some((bpid, bkey)) = target else {
            tracing::debug!(pid, "cancel request with an unknown key ignored");
            return;
        };
        if let Ok(mut s) = self.connect_pg().await {
            let mut msg = Vec::new();
            mr_pgproto::cancel_request(&mut msg, bpid, bkey);
            let _ = s.write_all(&msg).await;
            let _ = s.shutdown().await;
        }
    }

    /// Asks the sessions on these backends to restart their transaction if it is idle,
    /// read-only and READ COMMITTED (see `Session::restart_idle_reader`); the pids restarted.
    pub async fn restart_idle_readers(&self, backend_pids: &[i32]) -> Vec<i32> {
        let mut asked = Vec::new();
        {
            let sessions = self.sessions.lock().expect("sessions");
            for pid in backend_pids {
                if let Some(tx) = sessions.get(pid) {
                    let (reply, answer) = tokio::sync::oneshot::channel();
                    if tx.send(session::Control::RestartIdleReader(reply)).is_ok() {
                        asked.push((*pid, answer));
                    }
                }
            }
        }
        let mut restarted = Vec::new();
        for (pid, answer) in asked {
            if let Ok(Ok(true)) = tokio::time::timeout(Duration::from_secs(2), answer).await {
                restarted.push(pid);
            }
        }
        restarted
    }

    fn register_session(
        &self,
        backend_pid: i32,
        tx: tokio::sync::mpsc::UnboundedSender<session::Control>,
    ) {
        self.sessions
            .lock()
            .expect("sessions")
            .insert(backend_pid, tx);
    }

    fn forget_session(&self, backend_pid: i32) {
        self.sessions.lock().expect("sessions").remove(&backend_pid);
    }

    fn pool(&self, db: &str) -> PgPool {
        let mut pools = self.pools.lock().expect("pools");
        pools
            .entry(db.to_string())
            .or_insert_with(|| {
                PgPoolOptions::new()
                    .max_connections(2)
                    .idle_timeout(Duration::from_secs(60))
                    .connect_lazy_with(self.pg.connect_options(db).application_name("pgmr gateway"))
            })
            .clone()
    }

    /// The columns of the table an `UPSERT` names, resolved as the client's session would
    /// with PostgreSQL's default search path (`"$user", public`).
    async fn upsert_columns(
        &self,
        db: &str,
        user: &str,
        table: &mr_sql::ObjectName,
    ) -> Result<Vec<mr_sql::Column>, String> {
        let parts = &table.0;
        let (schemas, name) = match parts.as_slice() {
            [t] => (vec![user.to_string(), "public".to_string()], t.clone()),
            [.., s, t] => (vec![s.clone()], t.clone()),
            [] => return Err("UPSERT names no table".into()),
        };
        let rows: Vec<(String, bool, bool, bool, bool)> = sqlx::query_as(
            "WITH t AS ( \
               SELECT c.oid FROM pg_catalog.pg_class c \
               JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
               WHERE c.relname = $1 AND c.relkind IN ('r', 'p') AND n.nspname = ANY ($2) \
               ORDER BY pg_catalog.array_position($2, n.nspname::text) LIMIT 1) \
             SELECT a.attname::text, COALESCE(a.attnum = ANY (i.indkey), false), \
                    a.attgenerated <> '' OR COALESCE(l.region_expr_sql IS NOT NULL, false), \
                    COALESCE(l.hidden, false), l.relid IS NOT NULL \
             FROM t JOIN pg_catalog.pg_attribute a ON a.attrelid = t.oid \
             LEFT JOIN pg_catalog.pg_index i ON i.indrelid = t.oid AND i.indisprimary \
             LEFT JOIN multiregion.table_locality l ON l.relid = t.oid \
                   AND l.locality = 'regional_by_row' AND l.region_column = a.attname \
             WHERE a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
        )
        .bind(&name)
        .bind(&schemas)
        .fetch_all(&self.pool(db))
        .boxed()
        .await
        .map_err(|e| format!("cannot look up table \"{name}\": {}", one_line(&e)))?;
        if rows.is_empty() {
            return Err(format!("relation \"{}\" does not exist", parts.join(".")));
        }
        Ok(rows
            .into_iter()
            .map(
                |(name, primary_key, generated, hidden, region)| mr_sql::Column {
                    name,
                    primary_key,
                    generated,
                    hidden,
                    region,
                },
            )
            .collect())
    }

    /// Runs `CREATE DATABASE … PRIMARY REGION …` (the client's text) through the extension,
    /// connected to the new database as the session's user, so its privileges decide.
    async fn configure_database(&self, db: &str, user: &str, sql: &str) -> Result<(), DbError> {
        use sqlx::{ConnectOptions, Connection};
        let mut conn = self
            .pg
            .connect_options(db)
            .application_name("pgmr gateway")
            .connect()
            .boxed()
            .await
            .map_err(DbError::from)?;
        let set_role = format!("SET ROLE {}", mr_sql::ident(user));
        let mut result = crate::schema::simple(&mut conn, &set_role).await;
        if result.is_ok() {
            result = sqlx::query("SELECT count(*) FROM multiregion.execute($1)")
                .bind(sql)
                .execute(&mut conn)
                .map_ok(drop)
                .boxed()
                .await;
        }
        let _ = conn.close().boxed().await;
        result.map_err(DbError::from)
    }

    /// Undoes a `CREATE DATABASE` whose regions could not be configured.
    async fn drop_database(&self, db: &str) {
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", mr_sql::ident(db));
        let pool = self.pool("postgres");
        if let Err(e) = sqlx::raw_sql(&sql).execute(&pool).boxed().await {
            tracing::warn!(database = db, "cannot drop a half-created database: {e}");
        }
    }

    /// The stored password verifier of `user` (`md5…` or `SCRAM-SHA-256$…`), used to log a
    /// session that already authenticated into another database (`USE`).
    async fn verifier(&self, user: &str) -> Option<String> {
        sqlx::query_scalar("SELECT rolpassword FROM pg_catalog.pg_authid WHERE rolname = $1")
            .bind(user)
            .fetch_optional(&self.pool("postgres"))
            .boxed()
            .await
            .ok()
            .flatten()
            .flatten()
    }
}

/// A PostgreSQL error from a side connection, to relay to the client as its own.
#[derive(Debug)]
pub struct DbError {
    pub sqlstate: String,
    pub message: String,
    pub hint: Option<String>,
    pub detail: Option<String>,
}

impl From<sqlx::Error> for DbError {
    fn from(e: sqlx::Error) -> DbError {
        match e
            .as_database_error()
            .and_then(|d| d.try_downcast_ref::<PgDatabaseError>())
        {
            Some(pg) => DbError {
                sqlstate: pg.code().to_string(),
                message: pg.message().to_string(),
                hint: pg.hint().map(str::to_string),
                detail: pg.detail().map(str::to_string),
            },
            None => DbError {
                sqlstate: "58000".into(),
                message: one_line(&e),
                hint: None,
                detail: None,
            },
        }
    }
}

fn one_line(e: &dyn std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// Where a node's SQL gateway listens by default: the RPC host, port 26257.
pub fn default_listen(rpc_listen: &str) -> String {
    let host = rpc_listen
        .rsplit_once(':')
        .map(|(h, _)| h)
        .unwrap_or("127.0.0.1");
    format!("{host}:26257")
}
