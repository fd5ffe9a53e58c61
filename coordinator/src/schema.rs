//! The schema-change applier: brings this node's PostgreSQL up to date with every database's
//! schema log in the meta group (docs/ARCHITECTURE.md §5, "Schema changes").
//!
//! A multi-region statement runs in a user's session on one node; the extension commits the
//! change to the meta group (`Command::SchemaChange`, compare-and-set on the database's
//! version) and applies it in that session's own transaction. Every node's applier then
//! hands each change it has not applied yet, in version order, to
//! `multiregion.apply_schema_change(version, change)` in its own PostgreSQL, and reports each
//! applied version to the meta group (`Command::SchemaApplied`), which is what the proposing
//! session waits for (`LocalRequest::AwaitSchemaApplied`).
//!
//! The function is idempotent (it does nothing for a version the database already has), so a
//! change applied twice — by the proposing session and by its node's applier, or again after
//! a report was lost — is harmless. On the proposing node the applier may block on a lock
//! until the user's transaction ends; each database is applied by its own task on its own
//! connection, so that blocks nothing else: neither other databases nor the rest of pgmr.

use crate::meta::Meta;
use crate::postgres::{PgConfig, PgState};
use futures::future::BoxFuture;
use futures::{FutureExt, TryFutureExt};
use mr_meta::{Command, Outcome, SchemaChange};
use mr_wire::local::SchemaApplyStatus;
use sqlx::postgres::PgConnection;
use sqlx::{ConnectOptions, Connection};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How often the applier looks for new changes when no newly applied meta entry wakes it.
const POLL: Duration = Duration::from_millis(200);
/// Retry backoff after a failure, per database.
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How long reporting an applied version may wait for the meta group.
const REPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// Shown in `pg_stat_activity`.
const APPLICATION_NAME: &str = "pgmr schema applier";

/// The applier's progress per database: what `pgmr status` shows, and the applier's own
/// bookkeeping.
#[derive(Default)]
pub struct Progress {
    dbs: Mutex<BTreeMap<String, DbProgress>>,
}

#[derive(Default)]
struct DbProgress {
    /// The latest version this node's PostgreSQL has applied, as far as this pgmr knows.
    applied: u64,
    /// The latest version in the schema log, as last read.
    latest: u64,
    /// The latest version this pgmr has reported applied; the local copy of the meta state
    /// can show it a moment later.
    reported: u64,
    last_error: Option<String>,
    /// A task is applying this database now.
    running: bool,
    /// This node's copy is known to exist (a database created elsewhere with no schema
    /// change yet still gets its copy here).
    present: bool,
    /// The failure last told to the meta group (version, error): the same one again is not.
    failure_reported: Option<(u64, String)>,
    /// After a failure: no new attempt before this.
    retry_at: Option<Instant>,
    backoff: Duration,
}

impl Progress {
    /// For `pgmr status`.
    pub fn snapshot(&self) -> BTreeMap<String, SchemaApplyStatus> {
        self.lock()
            .iter()
            .map(|(db, p)| {
                let s = SchemaApplyStatus {
                    applied: p.applied,
                    latest: p.latest,
                    last_error: p.last_error.clone(),
                };
                (db.clone(), s)
            })
            .collect()
    }

    /// Records how a database's task ended, and the backoff after a failure.
    fn finished(&self, db: &str, result: Result<(), String>) {
        let mut dbs = self.lock();
        let p = dbs.entry(db.to_string()).or_default();
        p.running = false;
        match result {
            Ok(()) => {
                p.last_error = None;
                p.failure_reported = None;
                p.retry_at = None;
                p.backoff = Duration::ZERO;
            }
            Err(e) => {
                p.backoff = (p.backoff * 2).clamp(BACKOFF_MIN, BACKOFF_MAX);
                p.retry_at = Some(Instant::now() + p.backoff);
                // Said once at warn level; the same failure again only at debug.
                if p.last_error.as_deref() == Some(e.as_str()) {
                    tracing::debug!(database = db, "schema change not applied yet: {e}");
                } else {
                    tracing::warn!(
                        database = db,
                        retry_in_ms = p.backoff.as_millis() as u64,
                        "cannot apply a schema change: {e}"
                    );
                }
                p.last_error = Some(e);
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, DbProgress>> {
        self.dbs.lock().expect("schema progress lock")
    }
}

/// What every applier task needs.
#[derive(Clone)]
pub struct Applier {
    pub node_id: u64,
    pub meta: Arc<Meta>,
    pub pg: Arc<PgState>,
    pub pg_cfg: PgConfig,
    pub progress: Arc<Progress>,
    /// This node's replicas: a change that reshapes a table waits for the rows written
    /// before it (docs/ARCHITECTURE.md §8.6).
    pub ranges: Arc<crate::range::Ranges>,
}

/// Waits until the watched value changes or `max` passes, whichever is first.
pub async fn changed_or<T>(rx: &mut watch::Receiver<T>, max: Duration) {
    tokio::select! {
        r = rx.changed() => {
            if r.is_err() {
                // The sender is gone (Raft is shutting down): plain polling from now on.
                tokio::time::sleep(max).await;
            }
        }
        _ = tokio::time::sleep(max) => {}
    }
}

impl Applier {
    /// Runs until `stop`: every [`POLL`], and whenever the meta group applies new entries,
    /// starts a task for each database this node is behind on (or has not reported).
    pub async fn run(self, stop: CancellationToken) {
        let mut applied = self.meta.raft.data_metrics();
        // Copies dropped here whose report this node's copy of the meta state does not show
        // yet: not dropped again (a database created again meanwhile is the new one).
        let mut dropped_here: BTreeSet<String> = BTreeSet::new();
        loop {
            tokio::select! {
                _ = changed_or(&mut applied, POLL) => {}
                _ = stop.cancelled() => return,
            }
            if self.pg.ready_pid().is_none() {
                continue;
            }
            let me = self.node_id;
            let (logs, pending): (Vec<(String, u64, u64)>, Vec<String>) = self.meta.read(|s| {
                let logs = s
                    .schemas()
                    .map(|(db, log)| (db.to_string(), log.version, log.applied_by(me)))
                    .collect();
                let pending = s
                    .dropped_databases()
                    .filter(|(_, done)| !done.contains(&me))
                    .map(|(db, _)| db.to_string())
                    .collect();
                (logs, pending)
            });
            dropped_here.retain(|db| pending.contains(db));
            let to_drop: Vec<String> = pending
                .into_iter()
                .filter(|db| !dropped_here.contains(db))
                .collect();
            // A copy of a database dropped elsewhere goes first: a database created again
            // under its name must not continue the old copy.
            for db in &to_drop {
                if self.progress.lock().get(db).is_some_and(|p| p.running) {
                    continue;
                }
                match self.drop_copy(db).await {
                    Ok(()) => {
                        self.progress.lock().remove(db);
                        dropped_here.insert(db.clone());
                    }
                    Err(e) => {
                        tracing::warn!(database = db, "cannot drop a dropped database's copy: {e}")
                    }
                }
            }
            // A database the cluster forgot (dropped through this node too) starts again from
            // nothing if it is created again.
            self.progress
                .lock()
                .retain(|db, p| p.running || logs.iter().any(|(d, ..)| d == db));
            let now = Instant::now();
            for (db, latest, reported) in logs {
                if to_drop.contains(&db) {
                    continue;
                }
                {
                    let mut dbs = self.progress.lock();
                    let p = dbs.entry(db.clone()).or_default();
                    p.applied = p.applied.max(reported);
                    p.reported = p.reported.max(reported);
                    p.latest = latest;
                    let behind = p.applied < latest || p.reported < p.applied || !p.present;
                    if !behind || p.running || p.retry_at.is_some_and(|t| now < t) {
                        continue;
                    }
                    p.running = true;
                }
                let (this, stop) = (self.clone(), stop.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        result = this.catch_up(&db) => this.progress.finished(&db, result),
                        _ = stop.cancelled() => {}
                    }
                });
            }
        }
    }

    /// Drops this node's copy of `db`, which the cluster forgot (`DROP DATABASE` on another
    /// node), ending its sessions; then tells the meta group.
    async fn drop_copy(&self, db: &str) -> Result<(), String> {
        let mut admin = self
            .pg_cfg
            .connect_options("postgres")
            .application_name(APPLICATION_NAME)
            .connect()
            .await
            .map_err(|e| format!("cannot connect: {}", one_line(&e)))?;
        let drop = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quote_ident(db));
        // Applying the drop is not a new drop to replicate.
        let mut result = simple(&mut admin, "SET multiregion.replicate_ddl = off").await;
        if result.is_ok() {
            result = simple(&mut admin, &drop).await;
        }
        let _ = admin.close().await;
        result.map_err(|e| one_line(&e))?;
        tracing::info!(
            database = db,
            "dropped the copy of a database dropped elsewhere"
        );
        let command = Command::DatabaseDropped {
            database: db.to_string(),
            node_id: self.node_id,
        };
        match self.meta.propose(command, REPORT_TIMEOUT).await {
            Ok(Outcome::Done) => Ok(()),
            Ok(other) => Err(format!("reporting the drop: unexpected outcome {other:?}")),
            Err(e) => Err(format!("reporting the drop: {e}")),
        }
    }

    /// What this pgmr knows it has applied and reported for `db`.
    fn local(&self, db: &str) -> (u64, u64) {
        self.progress
            .lock()
            .get(db)
            .map_or((0, 0), |p| (p.applied, p.reported))
    }

    /// Applies every change of `db` this node has not applied, in order, reporting each;
    /// re-reads the log until nothing is left. A report lost earlier is made again first.
    async fn catch_up(&self, db: &str) -> Result<(), String> {
        let me = self.node_id;
        let mut conn: Option<PgConnection> = None;
        if !self.progress.lock().get(db).is_some_and(|p| p.present) {
            conn = Some(self.connect(db).await?);
        }
        loop {
            let (done, reported_here) = self.local(db);
            let (pending, reported): (Vec<SchemaChange>, u64) = self.meta.read(|s| {
                s.schema(db).map_or((Vec::new(), 0), |l| {
                    (l.changes_after(done).to_vec(), l.applied_by(me))
                })
            });
            if reported.max(reported_here) < done {
                self.report(db, done).await?;
            }
            if pending.is_empty() {
                if let Some(c) = conn.take() {
                    let _ = c.close().await;
                }
                return Ok(());
            }
            let mut c = match conn.take() {
                Some(c) => c,
                None => self.connect(db).await?,
            };
            for change in pending {
                let v = change.version;
                if !change.fenced.is_empty() {
                    self.ranges.await_fenced(db, v, &change.fenced).await;
                }
                if let Err(e) = apply(&mut c, v, &change.change).await {
                    let error = one_line(&e);
                    self.report_failure(db, v, &error).await;
                    return Err(format!("version {v}: {error}"));
                }
                tracing::info!(database = db, version = v, "applied a schema change");
                if let Some(p) = self.progress.lock().get_mut(db) {
                    p.applied = p.applied.max(v);
                }
                self.report(db, v).await?;
            }
            conn = Some(c);
        }
    }

    /// Tells the meta group this node cannot apply `version` of `db` (shown cluster-wide in
    /// `multiregion.schema_appliers` and `pgmr status` until it is applied); once per distinct
    /// failure. A report that does not get through is made again at the next failure.
    async fn report_failure(&self, db: &str, version: u64, error: &str) {
        let failure = (version, error.to_string());
        let known = self
            .progress
            .lock()
            .get(db)
            .is_some_and(|p| p.failure_reported.as_ref() == Some(&failure));
        if known {
            return;
        }
        let command = Command::SchemaApplyFailed {
            node_id: self.node_id,
            database: db.to_string(),
            version,
            error: error.to_string(),
        };
        match self.meta.propose(command, REPORT_TIMEOUT).await {
            Ok(Outcome::Done) => {
                if let Some(p) = self.progress.lock().get_mut(db) {
                    p.failure_reported = Some(failure);
                }
            }
            other => {
                tracing::debug!(
                    database = db,
                    "cannot report a failed schema change: {other:?}"
                )
            }
        }
    }

    /// Tells the meta group this node has applied `db` up to `version`.
    async fn report(&self, db: &str, version: u64) -> Result<(), String> {
        let command = Command::SchemaApplied {
            node_id: self.node_id,
            database: db.to_string(),
            version,
        };
        match self.meta.propose(command, REPORT_TIMEOUT).await {
            Ok(Outcome::Done) => {
                if let Some(p) = self.progress.lock().get_mut(db) {
                    p.reported = p.reported.max(version);
                }
                Ok(())
            }
            Ok(Outcome::Rejected { error }) => {
                Err(format!("reporting version {version} applied: {error}"))
            }
            Ok(other) => Err(format!(
                "reporting version {version} applied: unexpected outcome {other:?}"
            )),
            Err(e) => Err(format!("reporting version {version} applied: {e}")),
        }
    }

    /// A connection to `db` on this node's PostgreSQL, creating the database first if it
    /// does not exist here yet (`template1` has the extension, so the new database has it).
    async fn connect(&self, db: &str) -> Result<PgConnection, String> {
        let opts = |db: &str| {
            self.pg_cfg
                .connect_options(db)
                .application_name(APPLICATION_NAME)
        };
        match opts(db).connect().await {
            Ok(c) => {
                self.present(db);
                return Ok(c);
            }
            Err(e) if sqlstate(&e).as_deref() == Some("3D000") => {}
            Err(e) => return Err(format!("cannot connect: {}", one_line(&e))),
        }
        let mut admin = opts("postgres")
            .connect()
            .await
            .map_err(|e| format!("cannot connect to create the database: {}", one_line(&e)))?;
        let create = format!("CREATE DATABASE {}", quote_ident(db));
        // Creating the copy is not a new database to replicate.
        simple(&mut admin, "SET multiregion.replicate_ddl = off")
            .await
            .map_err(|e| format!("cannot create the database: {}", one_line(&e)))?;
        match simple(&mut admin, &create).await {
            Ok(_) => tracing::info!(database = db, "created the database for its schema changes"),
            // Someone else created it meanwhile.
            Err(e) if sqlstate(&e).as_deref() == Some("42P04") => {}
            Err(e) => return Err(format!("cannot create the database: {}", one_line(&e))),
        }
        let _ = admin.close().await;
        let c = opts(db)
            .connect()
            .await
            .map_err(|e| format!("cannot connect: {}", one_line(&e)))?;
        self.present(db);
        Ok(c)
    }

    fn present(&self, db: &str) {
        self.progress
            .lock()
            .entry(db.to_string())
            .or_default()
            .present = true;
    }
}

/// Hands one change to the extension; bound parameters, never spliced. (Boxed: sqlx's
/// executor futures are `Send` only for each concrete lifetime, which rustc cannot see
/// through inside a spawned task's state machine otherwise.)
fn apply<'a>(
    conn: &'a mut PgConnection,
    version: u64,
    change: &'a str,
) -> BoxFuture<'a, Result<(), sqlx::Error>> {
    sqlx::query("SELECT multiregion.apply_schema_change($1::bigint, $2::text)")
        .bind(i64::try_from(version).unwrap_or(i64::MAX))
        .bind(change)
        .execute(conn)
        .map_ok(drop)
        .boxed()
}

/// Runs one statement with the simple query protocol (which `CREATE DATABASE` needs). Boxed
/// as [`apply`] is.
pub(crate) fn simple<'a>(
    conn: &'a mut PgConnection,
    sql: &'a str,
) -> BoxFuture<'a, Result<(), sqlx::Error>> {
    sqlx::Executor::execute(conn, sqlx::raw_sql(sql))
        .map_ok(drop)
        .boxed()
}

fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(d) => d.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// The error's first line, with its SQLSTATE if PostgreSQL gave one.
fn one_line(e: &sqlx::Error) -> String {
    let text = match e {
        sqlx::Error::Database(d) => d.message().to_string(),
        other => other.to_string(),
    };
    let line = text.lines().next().unwrap_or("").trim().to_string();
    match sqlstate(e) {
        Some(code) => format!("{line} (SQLSTATE {code})"),
        None => line,
    }
}

/// A PostgreSQL identifier, quoted: `"…"` with every `"` doubled.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("movr"), r#""movr""#);
        assert_eq!(quote_ident(r#"a"b"#), r#""a""b""#);
        assert_eq!(
            quote_ident(r#"x"; DROP DATABASE y; --"#),
            r#""x""; DROP DATABASE y; --""#
        );
        assert_eq!(quote_ident("Üñí cödé"), "\"Üñí cödé\"");
    }

    #[test]
    fn failures_back_off_and_a_success_clears_them() {
        let progress = Progress::default();
        let fail = |e: &str| {
            progress.finished("movr", Err(e.into()));
            progress.lock()["movr"].backoff
        };
        assert_eq!(fail("x"), BACKOFF_MIN);
        assert_eq!(fail("x"), BACKOFF_MIN * 2);
        for _ in 0..10 {
            fail("y");
        }
        assert_eq!(fail("y"), BACKOFF_MAX, "bounded");
        assert!(progress.lock()["movr"].retry_at.is_some());
        assert_eq!(progress.snapshot()["movr"].last_error.as_deref(), Some("y"));
        progress.finished("movr", Ok(()));
        let p = &progress.lock()["movr"];
        assert_eq!(
            (p.backoff, p.retry_at, p.running),
            (Duration::ZERO, None, false)
        );
        assert_eq!(p.last_error, None);
    }
}
