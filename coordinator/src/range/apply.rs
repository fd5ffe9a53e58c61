//! A range's applier: writes committed entries into this node's PostgreSQL, in log order,
//! each exactly once.
//!
//! Its cursor is `multiregion.range_state.applied_index`, updated in the same PostgreSQL
//! transaction as the rows (`multiregion.apply_range_txn`), so after any crash it resumes at
//! the first entry not applied. An entry whose transaction id is already in
//! `multiregion.range_txns` was committed by the local transaction that wrote it (the
//! leaseholder's) and only moves the cursor. The insert of that id waits for a local
//! transaction still holding it, which is what orders the applier after the writer.
//!
//! A `Prepare` entry (two-phase commit, [`super::twophase`]) waits here until its
//! transaction's decision is known: from the range's own log (a copy of the anchor's;
//! [`decision`] has one put there if none comes), this node's record, or the anchor's
//! leaseholder, which is asked to decide abort once the entry has waited [`ABORT_AFTER`]
//! (its coordinator is gone). The node's own prepared PostgreSQL transaction
//! for it, if any, is ended first; then the rows are applied (or skipped) as for a `Commit`
//! entry, at the `Prepare` entry's place in the log.

use super::store;
use super::{Group, Ranges, TxnKind};
use crate::postgres::{PgConfig, PgState};
use futures::future::BoxFuture;
use futures::FutureExt;
use openraft::EntryPayload;
use redb::Database;
use sqlx::postgres::PgConnection;
use sqlx::{ConnectOptions, Connection, Row};
use std::sync::Arc;
use std::sync::Weak;
use std::time::Duration;
use std::time::Instant;

const APPLICATION_NAME: &str = "pgmr range applier";
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// At most this many entries, and about this many bytes, are read from the log per batch.
const BATCH: u64 = 256;
const BATCH_BYTES: usize = 8 << 20;
/// A prepared entry's decision is asked of the anchor after this long, and decided abort
/// after [`ABORT_AFTER`] if no node is still coordinating it (the coordinator decides within
/// seconds, or has gone).
const ASK_AFTER: Duration = Duration::from_secs(1);
const ABORT_AFTER: Duration = super::twophase::SWEEP_AFTER;

/// Applies `g`'s committed entries until the group stops.
pub async fn run(
    g: Arc<Group>,
    db: Arc<Database>,
    pg_cfg: PgConfig,
    pg: Arc<PgState>,
    ranges: Weak<Ranges>,
) {
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
        let ctx = Ctx {
            g: &g,
            db: &db,
            pg_cfg: &pg_cfg,
            pg: &pg,
            ranges: &ranges,
        };
        match step(&ctx, &mut conn, &mut cursor, target).await {
            Ok(()) => backoff = BACKOFF_MIN,
            // Nothing is wrong: the rest of a transaction's entries are still on their way.
            Err(Halt::Wait(e)) => {
                tracing::debug!(range_id = g.range_id, "range applier waits: {e}");
                tokio::select! {
                    _ = committed.changed() => {}
                    _ = g.stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
            }
            Err(Halt::Fail(e)) => {
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

/// Why a step stopped before `target`.
enum Halt {
    /// Something failed: reconnect, reload the cursor, back off.
    Fail(String),
    /// An entry needs later entries not committed here yet: wait for them, keep the rest.
    Wait(String),
}

impl From<String> for Halt {
    fn from(e: String) -> Halt {
        Halt::Fail(e)
    }
}

/// What one step of an applier works with.
struct Ctx<'a> {
    g: &'a Group,
    db: &'a Database,
    pg_cfg: &'a PgConfig,
    pg: &'a PgState,
    ranges: &'a Weak<Ranges>,
}

/// Connects if needed, then applies entries after the cursor up to `target`.
async fn step(
    ctx: &Ctx<'_>,
    conn: &mut Option<PgConnection>,
    cursor: &mut Option<u64>,
    target: u64,
) -> Result<(), Halt> {
    let Ctx {
        g, db, pg_cfg, pg, ..
    } = *ctx;
    if pg.ready_pid().is_none() {
        return Err(Halt::Fail("PostgreSQL is not ready".into()));
    }
    if conn.is_none() {
        let mut c = pg_cfg
            .connect_options(&g.table.database)
            .application_name(APPLICATION_NAME)
            .connect()
            .await
            .map_err(|e| format!("cannot connect to {}: {e}", g.table.database))?;
        // Applied rows fire no triggers. Set once for the session: PostgreSQL empties a
        // backend's plan cache whenever this setting changes, so setting it per entry would
        // re-plan every statement of every entry.
        sqlx::query("SET session_replication_role = replica")
            .execute(&mut c)
            .await
            .map_err(|e| format!("cannot set up the applier's session: {e}"))?;
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
    let entries = store::read_entries_within(db, g.range_id, at + 1, to, BATCH_BYTES)
        .map_err(|e| format!("reading the log: {e}"))?;
    if entries.first().map(|e| e.log_id.index) != Some(at + 1) {
        // The log no longer starts after the cursor: a snapshot was installed (and the log
        // purged up to it) since the cursor was read. Read it again.
        *cursor = None;
        return Err(Halt::Fail(format!(
            "range {}: entry {} is not in the log; reloading the cursor",
            g.range_id,
            at + 1
        )));
    }
    for e in entries {
        let index = e.log_id.index;
        let result = match &e.payload {
            EntryPayload::Normal(w) => match &w.kind {
                TxnKind::Commit => {
                    g.saw_data(true);
                    apply_txn(c, g.range_id, index, w, &w.changes, true, &[]).await
                }
                TxnKind::Prepare { anchor, gid } => {
                    g.saw_data(true);
                    let commit = decision(ctx, *anchor, gid, w.at_ms).await?;
                    let name = mr_wire::local::PrepareAs {
                        anchor: *anchor,
                        gid: gid.clone(),
                    }
                    .prepared_name();
                    // This node's part, if it was one, holds the rows' locks (and the
                    // transaction's key) until it ends.
                    if prepared_here(c, &name).await.map_err(|e| e.to_string())? {
                        super::twophase::finish_prepared_on(c, &name, commit)
                            .await
                            .map_err(|e| format!("ending prepared transaction {name}: {e}"))?;
                    }
                    if commit {
                        match w.chunk {
                            // A transaction split over several entries: all of them here,
                            // in one PostgreSQL transaction; the later ones are skipped.
                            Some(ch) if ch.seq == 0 && ch.of > 1 => {
                                // The decision may be known (from the anchor) before the
                                // other entries reach this replica's log: wait for them
                                // without reading the log again for each one that arrives.
                                let last = *g.committed.borrow();
                                if last < index + u64::from(ch.of) - 1 {
                                    return Err(Halt::Wait(format!(
                                        "entry {index} starts a transaction of {} entries; the log is committed up to {last}",
                                        ch.of
                                    )));
                                }
                                let (changes, skip) =
                                    chunks(g, db, index, gid, w, ch.of).map_err(Halt::Wait)?;
                                apply_txn(c, g.range_id, index, w, &changes, false, &skip).await
                            }
                            _ => apply_txn(c, g.range_id, index, w, &w.changes, false, &[]).await,
                        }
                    } else {
                        advance(c, g.range_id, index).await
                    }
                }
                TxnKind::Decide { .. } | TxnKind::Seal => advance(c, g.range_id, index).await,
                TxnKind::Forget { gids, plans_only } => {
                    // Here, not in the state machine: this replica's applier is past every
                    // `Prepare` of these transactions now, however far behind the log it
                    // runs. Deleted before the cursor moves: a crash between deletes again.
                    let sealed = store::sealed(db, g.range_id)
                        .map_err(|e| format!("reading the seal: {e}"))?;
                    if !sealed {
                        let forgot =
                            store::forget_decisions(db, Some(g.range_id), gids, *plans_only)
                                .map_err(|e| format!("forgetting decisions: {e}"))?;
                        if let Some(r) = ctx.ranges.upgrade() {
                            r.note_forgotten(g.range_id, forgot);
                        }
                    }
                    advance(c, g.range_id, index).await
                }
                TxnKind::Batch { also } => {
                    g.saw_data(true);
                    apply_batch(c, g.range_id, index, w, also).await
                }
            },
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

/// Whether this node's PostgreSQL holds prepared transaction `name`.
fn prepared_here<'a>(
    c: &'a mut PgConnection,
    name: &'a str,
) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
    async move {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_prepared_xacts WHERE gid = $1)",
        )
        .bind(name)
        .fetch_one(c)
        .await
    }
    .boxed()
}

/// Waits for the decision of the two-phase commit `gid` (recorded in range `anchor`): the
/// first `Decide` for it in this range's own log, which the part's node copies in once it
/// knows the decision (`spread_decision`), or this node's record of it (a decision it holds
/// is the transaction's). If neither has come after [`ASK_AFTER`] (the part's leadership
/// moved, its node died, the decision came late), this replica asks the anchor, watching its
/// own log meanwhile ([`learned`]): it takes a commit, but has an abort copied into its
/// range's log and passes on its own log's record, which is the first `Decide` there. An
/// anchor that forgot a commit (every part range's log held it first) can answer a late
/// abort, which lands behind the commit in this log (ARCHITECTURE.md §8.5, "Forgetting
/// decisions").
/// Passing on this node's record, it has the range's leader copy the decision in if none has
/// come a moment later: so every part range's log comes to hold its transaction's decision.
/// A sealed range (being dropped) takes no copies: a commit copied after its seal is abort
/// there, so its entries go by a commit it recorded, this node's record, or the anchor.
async fn decision(ctx: &Ctx<'_>, anchor: u64, gid: &str, at_ms: u64) -> Result<bool, String> {
    let first = Instant::now();
    let mut asked = None::<Instant>;
    let late = crate::failpoint::armed_as(crate::failpoint::LATE_ASK)
        && at_ms >= crate::failpoint::started_ms();
    let blind = || late && first.elapsed() < ABORT_AFTER + Duration::from_secs(5);
    let ask_after = if late { ABORT_AFTER } else { ASK_AFTER };
    loop {
        if let Some(d) = own_decision(ctx, gid)?.filter(|_| !blind()) {
            return Ok(d);
        }
        let waited = first.elapsed();
        if waited >= ask_after && asked.is_none_or(|a| a.elapsed() >= ASK_AFTER) {
            asked = Some(Instant::now());
            // The copy may land while the anchor is still being asked (or cannot be
            // reached): keep looking at the log meanwhile.
            let learned = learned(ctx, anchor, gid, waited, blind());
            tokio::pin!(learned);
            loop {
                tokio::select! {
                    d = &mut learned => match d? {
                        Some(d) => return Ok(d),
                        None => break,
                    },
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {
                        if let Some(d) = own_decision(ctx, gid)?.filter(|_| !blind()) {
                            return Ok(d);
                        }
                    }
                    _ = ctx.g.stop.cancelled() => return Err("the range stopped".into()),
                }
            }
            continue;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(10)) => {}
            _ = ctx.g.stop.cancelled() => return Err("the range stopped".into()),
        }
    }
}

/// `gid`'s decision as the applier may take it without asking: the range's own record
/// (of a sealed range, only a commit: an abort there may be a commit copied after the seal),
/// else this node's; taking the node's, it makes sure a copy reaches the range's log.
fn own_decision(ctx: &Ctx<'_>, gid: &str) -> Result<Option<bool>, String> {
    let range = ctx.g.range_id;
    let read = |e: redb::Error| format!("reading decisions: {e}");
    let sealed = store::sealed(ctx.db, range).map_err(|e| format!("reading the seal: {e}"))?;
    match store::range_decision(ctx.db, range, gid).map_err(read)? {
        Some(d) if d || !sealed => return Ok(Some(d)),
        _ => {}
    }
    let known = store::decision(ctx.db, gid).map_err(read)?;
    if let Some(d) = known {
        ensure_copy(ctx, gid, d, ASK_AFTER);
    }
    Ok(known)
}

/// After `delay`, has `gid`'s decision copied into this range's log by its leader unless the
/// range recorded one by then (the part's node copies it there as soon as it knows it, so
/// this rarely writes anything), is sealed or gone. One at a time per (range, gid) on this
/// node; a replica that passed its `Prepare` entry without the range's record starts one,
/// so the copy comes while any replica that knew the decision lives.
fn ensure_copy(ctx: &Ctx<'_>, gid: &str, commit: bool, delay: Duration) {
    let range = ctx.g.range_id;
    let key = (range, gid.to_string());
    {
        let Some(r) = ctx.ranges.upgrade() else {
            return;
        };
        if !r.copying.lock().expect("copying lock").insert(key.clone()) {
            return;
        }
    }
    let ranges = ctx.ranges.clone();
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        let Some(r) = ranges.upgrade() else {
            return;
        };
        let (_, gid) = &key;
        let wanted = r.group(range).is_some()
            && matches!(store::sealed(&r.db, range), Ok(false))
            && matches!(store::range_decision(&r.db, range, gid), Ok(None))
            && r.forgot_lately(range, gid).is_none();
        if wanted {
            if let Err(e) = r.copy_decision(range, gid, commit).await {
                tracing::debug!(range, gid, "could not copy a decision into the range: {e}");
            }
        }
        r.copying.lock().expect("copying lock").remove(&key);
    });
}

/// [`learn`], from a weak handle on the node's ranges. A commit is taken as answered (only a
/// coordinator proposes one, once the anchor recorded it: it is the decision wherever it is
/// read), and copied in. An abort may be a forgetful anchor's late one: it is copied into
/// this range's log, and `None` answered (the range's own record, read by the caller, is
/// what counts; a commit copied before stands first there). A range that takes no copies
/// takes an abort once this replica has applied the range's seal (any commit copied before
/// it is then in its records, and without one the anchor kept its decision: the coordinator
/// forgets nothing it could not copy), or if the range was dropped unsealed.
async fn learned(
    ctx: &Ctx<'_>,
    anchor: u64,
    gid: &str,
    waited: Duration,
    blind: bool,
) -> Result<Option<bool>, String> {
    let Some(r) = ctx.ranges.upgrade() else {
        return Ok(None);
    };
    let Some(d) = learn(ctx, &r, anchor, gid, waited, blind).await? else {
        return Ok(None);
    };
    let range = ctx.g.range_id;
    if d {
        ensure_copy(ctx, gid, true, Duration::ZERO);
        return Ok(Some(true));
    }
    match r.copy_decision(range, gid, false).await {
        // In the log now (this replica reads its record once it applies that far).
        Ok(Some(_)) => Ok(None),
        Ok(None) => {
            let sealed_here =
                store::sealed(ctx.db, range).map_err(|e| format!("reading the seal: {e}"))?;
            let dropped_unsealed = !r.range_exists(range) && r.sealed_by(range).is_none();
            Ok((sealed_here || dropped_unsealed).then_some(false))
        }
        Err(e) => {
            tracing::debug!(
                range = ctx.g.range_id,
                gid,
                "could not copy a decision into the range: {e}"
            );
            Ok(None)
        }
    }
}

/// `gid`'s decision as this node knows it, or as the anchor's leaseholder answers, which is
/// asked to decide abort once the entry has waited [`ABORT_AFTER`] and no node is still
/// coordinating the transaction.
async fn learn(
    ctx: &Ctx<'_>,
    r: &Ranges,
    anchor: u64,
    gid: &str,
    waited: Duration,
    blind: bool,
) -> Result<Option<bool>, String> {
    if let Some(d) = store::decision(ctx.db, gid).map_err(|e| format!("reading decisions: {e}"))? {
        if !blind {
            return Ok(Some(d));
        }
    }
    // An anchor that no longer exists (its table or partition dropped, e.g. by DROP REGION,
    // after the transaction prepared and before it was decided there) records nothing more:
    // the node that applied its seal answers for its decisions; else (a range dropped without
    // a seal) this range's leader, which holds the transaction's part and hears the decision
    // from the coordinator. A decision a node knows is the transaction's (only the
    // coordinator proposes commit, after the anchor recorded it), so asking without proposing
    // is always safe.
    if !r.range_exists(anchor) {
        // Sealed before its drop: the node that applied the seal answers for it (a
        // transaction it holds no decision for is decided abort there).
        if r.sealed_by(anchor).is_some() {
            if let Ok(Some(d)) = r.decide(anchor, gid, None).await {
                return Ok(Some(d));
            }
        }
        if ctx.g.range_id != anchor {
            if let Ok(Some(d)) = r.decide(ctx.g.range_id, gid, None).await {
                return Ok(Some(d));
            }
        }
        return Ok(None);
    }
    // A coordinator still at work (slow prepares) is waited for, not overruled.
    let propose = (waited >= ABORT_AFTER
        && (waited >= super::twophase::COORDINATOR_LIMIT || !r.coordinator_alive(gid).await))
        .then_some(false);
    Ok(r.ask(anchor, gid, propose).await.ok().flatten())
}

/// The rows of the `of` entries of a transaction split over several entries of this range,
/// the first of which is `first`, as one JSON array; and the indexes of the others (the
/// applier passes over them). They are all in the log: they were committed before its
/// decision, which is known.
fn chunks(
    g: &Group,
    db: &Database,
    first: u64,
    gid: &str,
    w: &super::TxnWrite,
    of: u32,
) -> Result<(String, Vec<i64>), String> {
    let mut parts: Vec<(u32, u64, String)> = vec![(0, first, w.changes.clone())];
    let last = *g.committed.borrow();
    let mut from = first + 1;
    while parts.len() < of as usize && from <= last {
        let batch = store::read_entries_within(db, g.range_id, from, last, BATCH_BYTES)
            .map_err(|e| format!("reading the log: {e}"))?;
        let Some(end) = batch.last().map(|e| e.log_id.index) else {
            break;
        };
        for e in batch {
            if let EntryPayload::Normal(x) = e.payload {
                let same = matches!(&x.kind, TxnKind::Prepare { gid: other, .. } if other == gid);
                if let (true, Some(ch)) = (same, x.chunk) {
                    if ch.seq > 0 && !parts.iter().any(|(s, ..)| *s == ch.seq) {
                        parts.push((ch.seq, e.log_id.index, x.changes));
                    }
                }
            }
        }
        from = end + 1;
    }
    if parts.len() < of as usize {
        return Err(format!(
            "range {}: {} of the {of} entries of transaction {gid} are in the log up to {last}",
            g.range_id,
            parts.len()
        ));
    }
    parts.sort_by_key(|(seq, ..)| *seq);
    let bodies = parts
        .iter()
        .map(|(_, _, c)| super::array_body(c))
        .filter(|b| !b.is_empty())
        .collect::<Vec<_>>();
    let skip = parts.iter().skip(1).map(|(_, i, _)| *i as i64).collect();
    Ok((format!("[{}]", bodies.join(",")), skip))
}

/// Applies one transaction's rows, `changes` (`keep`: leave its key, as a `Commit` entry
/// does; a `Prepare` entry's key is removed again, since other ranges' entries of the same
/// transaction use it too); the entries in `skip` are the same transaction's, applied with
/// it.
fn apply_txn<'a>(
    c: &'a mut PgConnection,
    range_id: u64,
    index: u64,
    w: &'a super::TxnWrite,
    changes: &'a str,
    keep: bool,
    skip: &'a [i64],
) -> BoxFuture<'a, Result<(), sqlx::Error>> {
    async move {
        sqlx::query("SELECT multiregion.apply_range_txn($1, $2, $3, $4::jsonb, $5, $6, $7)")
            .bind(range_id as i64)
            .bind(index as i64)
            .bind(&w.txn_id)
            .bind(changes)
            .bind(w.schema_version as i64)
            .bind(keep)
            .bind(skip)
            .execute(c)
            .await?;
        Ok(())
    }
    .boxed()
}

/// A [`TxnKind::Batch`] entry: `first`'s rows, then each of `also`'s, in one transaction.
fn apply_batch<'a>(
    c: &'a mut PgConnection,
    range_id: u64,
    index: u64,
    first: &'a super::TxnWrite,
    also: &'a [super::TxnWrite],
) -> BoxFuture<'a, Result<(), sqlx::Error>> {
    async move {
        let all = std::iter::once(first).chain(also);
        let txns: Vec<&str> = all.clone().map(|w| w.txn_id.as_str()).collect();
        let changes: Vec<&str> = all.clone().map(|w| w.changes.as_str()).collect();
        let versions: Vec<i64> = all.map(|w| w.schema_version as i64).collect();
        sqlx::query("SELECT multiregion.apply_range_batch($1, $2, $3, $4, $5)")
            .bind(range_id as i64)
            .bind(index as i64)
            .bind(&txns)
            .bind(&changes)
            .bind(&versions)
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

/// This node no longer holds `g`'s range: forget its applier's cursor (a later replica here
/// starts from a snapshot: every range's log is purged up to one before anyone joins), and
/// with `moved_away` (the range's descriptor, which no longer lists this node) the copy's
/// rows too (`multiregion.drop_range_copy`).
pub async fn forget(
    pg_cfg: &PgConfig,
    pg: &PgState,
    g: &Group,
    moved_away: Option<&mr_meta::RangeDescriptor>,
) {
    if pg.ready_pid().is_none() {
        return;
    }
    let Ok(mut c) = pg_cfg
        .connect_options(&g.table.database)
        .application_name(APPLICATION_NAME)
        .connect()
        .await
    else {
        return;
    };
    let forgotten = if let Some(d) = moved_away {
        sqlx::query("SELECT multiregion.drop_range_copy($1, $2, $3, $4)")
            .bind(g.range_id as i64)
            .bind(&d.table.schema)
            .bind(&d.table.table)
            .bind(&d.partition)
            .execute(&mut c)
            .await
            .map(drop)
    } else {
        forget_cursor(&mut c, g.range_id).await
    };
    if let Err(e) = forgotten {
        tracing::warn!(
            range_id = g.range_id,
            "could not forget this node's copy of the range: {e}"
        );
    }
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
