//! A range's applier: writes committed entries into this node's PostgreSQL, in log order,
//! each exactly once.
//!
//! Its cursor is `multiregion.range_state.applied_index`, updated in the same PostgreSQL
//! transaction as the rows (`multiregion.apply_range_txn`), so after any crash it resumes at
//! the first entry not applied. An entry whose transaction id is already in
//! `multiregion.range_txns` was committed by the local transaction that wrote it (the
//! leaseholder's) and only moves the cursor. The insert of that id waits for a local
//! transaction still holding it, which is what orders the applier after the writer.

use super::store;
use super::Group;
use crate::postgres::{PgConfig, PgState};
use futures::future::BoxFuture;
use futures::FutureExt;
use openraft::EntryPayload;
use redb::Database;
use sqlx::postgres::PgConnection;
use sqlx::{ConnectOptions, Connection, Row};
use std::sync::Arc;
use std::time::Duration;

const APPLICATION_NAME: &str = "pgmr range applier";
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// At most this many entries are read from the log per batch.
const BATCH: u64 = 256;

/// Applies `g`'s committed entries until the group stops.
pub async fn run(g: Arc<Group>, db: Arc<Database>, pg_cfg: PgConfig, pg: Arc<PgState>) {
    let mut committed = g.committed.clone();
    let mut conn: Option<PgConnection> = None;
    let mut cursor: Option<u64> = None;
    let mut backoff = BACKOFF_MIN;
    loop {
        if g.stop.is_cancelled() {
            return;
        }
        let target = *committed.borrow_and_update();
        if cursor.is_some_and(|c| c >= target) {
            tokio::select! {
                _ = committed.changed() => {}
                _ = g.stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
            continue;
        }
        match step(&g, &db, &pg_cfg, &pg, &mut conn, &mut cursor, target).await {
            Ok(()) => backoff = BACKOFF_MIN,
            Err(e) => {
                tracing::debug!(range_id = g.range_id, "range applier: {e}");
                conn = None;
                cursor = None;
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = g.stop.cancelled() => return,
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

/// Connects if needed, then applies entries after the cursor up to `target`.
async fn step(
    g: &Group,
    db: &Database,
    pg_cfg: &PgConfig,
    pg: &PgState,
    conn: &mut Option<PgConnection>,
    cursor: &mut Option<u64>,
    target: u64,
) -> Result<(), String> {
    if pg.ready_pid().is_none() {
        return Err("PostgreSQL is not ready".into());
    }
    if conn.is_none() {
        let c = pg_cfg
            .connect_options(&g.table.database)
            .application_name(APPLICATION_NAME)
            .connect()
            .await
            .map_err(|e| format!("cannot connect to {}: {e}", g.table.database))?;
        *conn = Some(c);
    }
    let c = conn.as_mut().expect("connected above");
    let at = match *cursor {
        Some(at) => at,
        None => {
            let at = load_cursor(c, g.range_id)
                .await
                .map_err(|e| e.to_string())?;
            if !g.data_seen() {
                let data = store::has_data_entries(db, g.range_id, at)
                    .map_err(|e| format!("reading the log: {e}"))?;
                g.saw_data(data);
            }
            g.advance(at);
            *cursor = Some(at);
            at
        }
    };
    let to = target.min(at + BATCH);
    let entries = store::read_entries(db, g.range_id, at + 1, to)
        .map_err(|e| format!("reading the log: {e}"))?;
    for e in entries {
        let index = e.log_id.index;
        let result = match &e.payload {
            EntryPayload::Normal(w) => {
                g.saw_data(true);
                apply_txn(c, g.range_id, index, w).await
            }
            _ => advance(c, g.range_id, index).await,
        };
        result.map_err(|e| format!("applying entry {index}: {e}"))?;
        *cursor = Some(index);
        g.advance(index);
    }
    Ok(())
}

fn load_cursor(c: &mut PgConnection, range_id: u64) -> BoxFuture<'_, Result<u64, sqlx::Error>> {
    async move {
        let row = sqlx::query(
            "SELECT coalesce((SELECT applied_index FROM multiregion.range_state WHERE range_id = $1), 0)",
        )
        .bind(range_id as i64)
        .fetch_one(c)
        .await?;
        Ok(row.get::<i64, _>(0) as u64)
    }
    .boxed()
}

fn apply_txn<'a>(
    c: &'a mut PgConnection,
    range_id: u64,
    index: u64,
    w: &'a super::TxnWrite,
) -> BoxFuture<'a, Result<(), sqlx::Error>> {
    async move {
        sqlx::query("SELECT multiregion.apply_range_txn($1, $2, $3, $4::jsonb, $5)")
            .bind(range_id as i64)
            .bind(index as i64)
            .bind(&w.txn_id)
            .bind(&w.changes)
            .bind(w.schema_version as i64)
            .execute(c)
            .await?;
        Ok(())
    }
    .boxed()
}

fn advance(
    c: &mut PgConnection,
    range_id: u64,
    index: u64,
) -> BoxFuture<'_, Result<(), sqlx::Error>> {
    async move {
        sqlx::query("SELECT multiregion.advance_range($1, $2)")
            .bind(range_id as i64)
            .bind(index as i64)
            .execute(c)
            .await?;
        Ok(())
    }
    .boxed()
}

/// This node no longer holds `range_id`: forget its cursor, so that a later replica here
/// replays the range's log from its start. (Its rows are left; replay is idempotent per
/// key.)
pub async fn forget(pg_cfg: &PgConfig, pg: &PgState, database: &str, range_id: u64) {
    if pg.ready_pid().is_none() {
        return;
    }
    let Ok(mut c) = pg_cfg
        .connect_options(database)
        .application_name(APPLICATION_NAME)
        .connect()
        .await
    else {
        return;
    };
    let _ = forget_cursor(&mut c, range_id).await;
    let _ = c.close().await;
}

fn forget_cursor(c: &mut PgConnection, range_id: u64) -> BoxFuture<'_, Result<(), sqlx::Error>> {
    async move {
        sqlx::query("DELETE FROM multiregion.range_state WHERE range_id = $1")
            .bind(range_id as i64)
            .execute(c)
            .await?;
        Ok(())
    }
    .boxed()
}
