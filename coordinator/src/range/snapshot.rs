//! Range snapshots: one replica's rows of a range at an applied index, built from its
//! PostgreSQL and installed into another's, so that a new replica starts from the range's rows
//! rather than from its own (possibly stale or empty) copy, and so that logs can be purged.
//!
//! **Exact at the index.** The applier's cursor and the rows it applied move in one
//! PostgreSQL transaction, so a REPEATABLE READ snapshot sees rows exactly at the cursor — except
//! for rows this node's own transactions committed locally, whose entries may lie after it (a
//! leaseholder commits locally once a quorum holds its entry, before its applier passes it).
//! Those transactions' keys (`multiregion.range_txns`) are visible in the same snapshot exactly
//! when their rows are, so the builder lists the entries after the cursor that this node
//! proposed and whose keys it sees: the receiver records them as already applied (`skip`) and
//! its applier passes over them. What it then applies after the index are the other entries,
//! and none of them precedes, in the log, a transaction the snapshot holds that it conflicts
//! with (conflicting transactions commit locally in log order, holding their row locks), so
//! the receiver reaches the same rows as the log.
//!
//! Format: the header as one JSON line, then one line per row (`to_jsonb` of the row).

use crate::postgres::{PgConfig, PgState};
use futures::TryStreamExt;
use mr_meta::TableRef;
use redb::Database;
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgConnection;
use sqlx::{ConnectOptions, Connection, Row};
use std::collections::BTreeSet;
use std::sync::Arc;

const APPLICATION_NAME: &str = "pgmr range snapshot";
/// Rows per statement when installing.
const INSTALL_BATCH: usize = 500;

/// What a snapshot's first line says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub range_id: u64,
    /// The applied index the rows are at.
    pub index: u64,
    /// The database's multi-region schema version the rows were read under.
    pub schema_version: u64,
    /// Entries after `index` whose rows the snapshot already holds.
    pub skip: Vec<u64>,
    pub rows: u64,
    /// The two-phase commit decisions the range's log recorded (transaction, commit):
    /// replicated state like the rows, so a replica that starts here answers for them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decisions: Vec<(String, bool)>,
    /// The index of the range's seal entry, if the source had applied it: a `Decide` after
    /// it records only abort, on this replica as on the others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed_at: Option<u64>,
    /// The coordinators' plans kept beside those decisions (up to `index` too), so that a
    /// replica that starts here and comes to lead the range can drive their forget.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plans: Vec<(String, super::store::StoredPlan)>,
}

/// Where a range's rows live on this node.
pub struct Source {
    pub me: u64,
    pub pg_cfg: PgConfig,
    pub pg: Arc<PgState>,
    pub table: TableRef,
    pub partition: Option<String>,
    /// The cluster's state, for whether rows are replicated at all: while they are not, each
    /// node's rows are its own and a snapshot moves only the cursor.
    pub meta: Arc<crate::meta::Meta>,
}

/// Why a snapshot could not be built or installed (always worth retrying: PostgreSQL
/// restarting, a schema change not applied here yet).
pub type Error = String;

impl Source {
    async fn connect(&self) -> Result<PgConnection, Error> {
        if self.pg.ready_pid().is_none() {
            return Err("PostgreSQL is not ready".into());
        }
        // Replica mode, as the appliers: these reads and writes are this node's copy, never
        // routed to a leaseholder (the range being seeded has none yet).
        self.pg_cfg
            .connect_options(&self.table.database)
            .application_name(APPLICATION_NAME)
            .options([
                ("session_replication_role", "replica"),
                ("multiregion.snapshot_barrier", "off"),
            ])
            .connect()
            .await
            .map_err(|e| format!("cannot connect to {}: {e}", self.table.database))
    }

    /// The relation holding the range's rows here (`multiregion.range_relation`), as a
    /// regclass's text: already quoted.
    async fn relation(&self, c: &mut PgConnection) -> Result<String, sqlx::Error> {
        sqlx::query_scalar("SELECT multiregion.range_relation($1, $2, $3)::text")
            .bind(&self.table.schema)
            .bind(&self.table.table)
            .bind(&self.partition)
            .fetch_one(c)
            .await
    }

    /// Appends every row of `relation` to `out`, one `to_jsonb` text per line, stopping with
    /// `false` once `out` exceeds `limit` bytes; the number of rows.
    async fn read_rows(
        c: &mut PgConnection,
        relation: &str,
        out: &mut Vec<u8>,
        limit: usize,
    ) -> Result<Option<u64>, sqlx::Error> {
        let q = format!("SELECT to_jsonb(t)::text FROM {relation} t");
        let mut s = sqlx::query_scalar::<_, String>(&q).fetch(c);
        let mut rows = 0u64;
        while let Some(line) = s.try_next().await? {
            out.extend_from_slice(line.as_bytes());
            out.push(b'\n');
            rows += 1;
            if out.len() > limit {
                return Ok(None);
            }
        }
        Ok(Some(rows))
    }

    /// The applier's cursor for `range_id` (0 before it applied anything).
    pub async fn cursor(&self, range_id: u64) -> Result<u64, Error> {
        let mut c = self.connect().await?;
        let r = sqlx::query_scalar::<_, i64>(
            "SELECT coalesce((SELECT applied_index FROM multiregion.range_state WHERE range_id = $1), 0)",
        )
        .bind(range_id as i64)
        .fetch_one(&mut c)
        .await
        .map_err(|e| e.to_string());
        let _ = c.close().await;
        Ok(r?.max(0) as u64)
    }

    /// This replica's rows of `range_id`, at its applier's cursor.
    pub async fn build(&self, db: &Database, range_id: u64) -> Result<(Header, Vec<u8>), Error> {
        let mut c = self.connect().await?;
        let r = self.build_on(&mut c, db, range_id).await;
        let _ = c.close().await;
        r
    }

    async fn build_on(
        &self,
        c: &mut PgConnection,
        db: &Database,
        range_id: u64,
    ) -> Result<(Header, Vec<u8>), Error> {
        let e = |e: sqlx::Error| format!("building a snapshot of range {range_id}: {e}");
        sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *c)
            .await
            .map_err(e)?;
        // The first statement takes the snapshot; everything below reads in it.
        let row = sqlx::query(
            "SELECT coalesce((SELECT applied_index FROM multiregion.range_state WHERE range_id = $1), 0), \
                    multiregion.schema_version(), \
                    pg_catalog.to_regclass(pg_catalog.format('%I.%I', $2::text, $3::text)) IS NOT NULL, \
                    coalesce((SELECT skip FROM multiregion.range_state WHERE range_id = $1), '{}')",
        )
        .bind(range_id as i64)
        .bind(&self.table.schema)
        .bind(&self.table.table)
        .fetch_one(&mut *c)
        .await
        .map_err(e)?;
        let index = row.get::<i64, _>(0).max(0) as u64;
        let schema_version = row.get::<i64, _>(1) as u64;
        let exists: bool = row.get(2);
        // Entries after the cursor whose rows are here already: the later entries of a
        // transaction split over several, applied with its first.
        let applied_ahead: Vec<i64> = row.get(3);
        // A new range's table not committed here yet (created by a transaction that is
        // still writing its first rows, which wait for this range; or a schema change this
        // node has not applied): it has no rows here, and its first rows come through the log.
        let relation: Option<String> = if !exists && index <= 1 {
            None
        } else {
            Some(self.relation(&mut *c).await.map_err(e)?)
        };
        // Entries after the cursor that this node proposed: their rows are here exactly when
        // their keys are (read after the snapshot was taken, so every local commit it shows
        // has its entry in the log already).
        // A batch entry's transactions all count: its rows are here when all of theirs are.
        let proposed: Vec<(u64, Vec<String>)> =
            super::store::read_entries(db, range_id, index + 1, u64::MAX)
                .map_err(|e| format!("reading the log: {e}"))?
                .into_iter()
                .filter_map(|en| match en.payload {
                    openraft::EntryPayload::Normal(w)
                        if w.origin == self.me
                            && !matches!(w.kind, super::TxnKind::Decide { .. }) =>
                    {
                        let mut ids = vec![w.txn_id];
                        if let super::TxnKind::Batch { also } = w.kind {
                            ids.extend(also.into_iter().map(|x| x.txn_id));
                        }
                        Some((en.log_id.index, ids))
                    }
                    _ => None,
                })
                .collect();
        let mut skip: Vec<u64> = applied_ahead
            .into_iter()
            .filter(|i| *i > index as i64)
            .map(|i| i as u64)
            .collect();
        if !proposed.is_empty() {
            let ids: Vec<&str> = proposed
                .iter()
                .flat_map(|(_, t)| t.iter().map(String::as_str))
                .collect();
            let seen: BTreeSet<String> = sqlx::query_scalar(
                "SELECT txn_id FROM multiregion.range_txns WHERE txn_id = ANY($1)",
            )
            .bind(&ids)
            .fetch_all(&mut *c)
            .await
            .map_err(e)?
            .into_iter()
            .collect();
            for (i, t) in proposed {
                let here = t.iter().filter(|t| seen.contains(*t)).count();
                if here == t.len() {
                    skip.push(i);
                } else if here > 0 {
                    // Some of a batch's transactions have committed here and others not
                    // yet (each commits once the entry has): a moment later all have.
                    return Err(format!(
                        "building a snapshot of range {range_id}: entry {i} is committed here in part; retrying"
                    ));
                }
            }
            skip.sort_unstable();
            skip.dedup();
        }
        // `relation` is a regclass's text: already quoted.
        let mut body = Vec::new();
        let mut rows = 0u64;
        if let Some(relation) = relation {
            rows = Self::read_rows(&mut *c, &relation, &mut body, usize::MAX)
                .await
                .map_err(e)?
                .unwrap_or_default();
        }
        sqlx::query("COMMIT").execute(&mut *c).await.map_err(e)?;
        // Every one recorded up to the cursor, however old: a part's replica that was away
        // for a day or a month asks for its transaction's decision when it reaches the
        // `Prepare` entry, and a replica of the anchor that started from this snapshot may be
        // the one that answers (carrying only the last day's let such a leader record an
        // abort for a transaction its log had committed). None recorded after it: the
        // receiver's state machine records those from the entries after the cursor, and one
        // may be a late abort recorded anew after a `Forget` this snapshot's rows precede.
        let decisions = super::store::range_decisions(db, range_id, index)
            .map_err(|e| format!("reading the range's decisions: {e}"))?;
        let sealed_at = super::store::sealed_at(db, range_id)
            .map_err(|e| format!("reading the range's seal: {e}"))?;
        let plans = super::store::range_plans(db, range_id, u64::MAX)
            .map_err(|e| format!("reading the range's plans: {e}"))?
            .into_iter()
            .filter(|(_, _, p)| p.index <= index)
            .map(|(gid, _, p)| (gid, p))
            .collect();
        let header = Header {
            range_id,
            index,
            schema_version,
            skip,
            rows,
            decisions,
            sealed_at,
            plans,
        };
        let mut out = serde_json::to_vec(&header).expect("headers serialize");
        out.push(b'\n');
        out.extend_from_slice(&body);
        Ok((header, out))
    }

    /// Replaces this replica's rows of the range by the snapshot's, and its cursor by the
    /// snapshot's index, in one transaction. `false`: this replica is already past the
    /// snapshot, and nothing changed.
    pub async fn install(&self, data: &[u8]) -> Result<bool, Error> {
        let (header, rows) = parse(data)?;
        let mut c = self.connect().await?;
        if !self.meta.read(super::replication_on) {
            let r = sqlx::query("SELECT multiregion.advance_range($1, $2)")
                .bind(header.range_id as i64)
                .bind(header.index as i64)
                .execute(&mut c)
                .await
                .map_err(|e| e.to_string());
            let _ = c.close().await;
            return r.map(|_| false);
        }
        let r = self.install_on(&mut c, &header, rows, false).await;
        if r.is_err() {
            let _ = sqlx::query("ROLLBACK").execute(&mut c).await;
        }
        let _ = c.close().await;
        r
    }

    async fn install_on(
        &self,
        c: &mut PgConnection,
        h: &Header,
        rows: &[u8],
        append: bool,
    ) -> Result<bool, Error> {
        let range_id = h.range_id;
        let e = |e: sqlx::Error| format!("installing a snapshot of range {range_id}: {e}");
        sqlx::query("BEGIN").execute(&mut *c).await.map_err(e)?;
        let skip: Vec<i64> = h.skip.iter().map(|i| *i as i64).collect();
        let go: bool = append
            || sqlx::query_scalar(
                "SELECT multiregion.begin_range_install($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(range_id as i64)
            .bind(&self.table.schema)
            .bind(&self.table.table)
            .bind(&self.partition)
            .bind(h.index as i64)
            .bind(h.schema_version as i64)
            .bind(&skip)
            .fetch_one(&mut *c)
            .await
            .map_err(e)?;
        if !go {
            sqlx::query("ROLLBACK").execute(&mut *c).await.map_err(e)?;
            return Ok(false);
        }
        let lines: Vec<&[u8]> = rows
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .collect();
        for batch in lines.chunks(INSTALL_BATCH) {
            let mut array =
                Vec::with_capacity(batch.iter().map(|l| l.len() + 1).sum::<usize>() + 2);
            array.push(b'[');
            for (i, l) in batch.iter().enumerate() {
                if i > 0 {
                    array.push(b',');
                }
                array.extend_from_slice(l);
            }
            array.push(b']');
            let text = std::str::from_utf8(&array)
                .map_err(|_| format!("snapshot of range {range_id}: a row is not UTF-8"))?;
            sqlx::query("SELECT multiregion.install_range_rows($1, $2, $3, $4::jsonb)")
                .bind(&self.table.schema)
                .bind(&self.table.table)
                .bind(&self.partition)
                .bind(text)
                .execute(&mut *c)
                .await
                .map_err(e)?;
        }
        sqlx::query("SELECT multiregion.finish_range_install($1, $2, $3)")
            .bind(&self.table.schema)
            .bind(&self.table.table)
            .bind(&self.partition)
            .execute(&mut *c)
            .await
            .map_err(e)?;
        sqlx::query("COMMIT").execute(&mut *c).await.map_err(e)?;
        Ok(true)
    }
}

/// A seed travels in chunks of about this many bytes of rows (one peer message each, well
/// inside the 16 MiB frame once escaped). `PGMR_SEED_CHUNK_BYTES` overrides it (tests).
const SEED_CHUNK: usize = 4 << 20;

fn seed_chunk_bytes() -> usize {
    std::env::var("PGMR_SEED_CHUNK_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(SEED_CHUNK)
}

/// What a seed request asks of the old range's leaseholder ([`mr_wire::peer::PeerRequest::RangeSeed`]).
#[derive(Debug, Clone, Default)]
pub struct SeedAt {
    /// The schema version the new range's bootstrapper has (the split or merge).
    pub schema_version: u64,
    /// Where the previous chunk ended.
    pub after: Option<String>,
    /// The partition's rows as kept when the table stopped being REGIONAL BY ROW.
    pub merge: bool,
}

/// Rows a seed chunk fetches from its cursor at a time: up to 500, fewer for a small chunk.
fn seed_fetch(budget: usize) -> usize {
    (budget / 8192).clamp(1, 500)
}

impl Source {
    /// Whether the relation holding the range's rows is committed here, in the layout the
    /// range has: the partition's leaf of a REGIONAL BY ROW table, or the table.
    pub async fn relation_here(&self) -> Result<bool, Error> {
        let mut c = self.connect().await?;
        let r = sqlx::query_scalar::<_, bool>(
            "SELECT CASE \
               WHEN pg_catalog.to_regclass(pg_catalog.format('%I.%I', $1::text, $2::text)) IS NULL THEN false \
               WHEN $3::text IS NULL THEN true \
               ELSE multiregion.range_leaf($1, $2, $3) IS NOT NULL END",
        )
        .bind(&self.table.schema)
        .bind(&self.table.table)
        .bind(&self.partition)
        .fetch_one(&mut c)
        .await
        .map_err(|e| e.to_string());
        let _ = c.close().await;
        r
    }

    /// The database's multi-region schema version here.
    pub async fn schema_version(&self) -> Result<u64, Error> {
        let mut c = self.connect().await?;
        let r = sqlx::query_scalar::<_, i64>("SELECT multiregion.schema_version()")
            .fetch_one(&mut c)
            .await
            .map_err(|e| e.to_string());
        let _ = c.close().await;
        Ok(r?.max(0) as u64)
    }

    /// One chunk of this node's rows of the source's (table, partition), one `to_jsonb` text
    /// per line, in physical order from after tuple `after`; and where the next chunk starts
    /// (`None`: none is left). Only for rows nobody writes any more (a split's old range,
    /// frozen once this node applied the split): chunks are read in separate transactions.
    pub async fn seed_chunk(&self, after: Option<&str>) -> Result<(String, Option<String>), Error> {
        let mut c = self.connect().await?;
        let r = self.seed_chunk_on(&mut c, after).await;
        let _ = c.close().await;
        r
    }

    async fn seed_chunk_on(
        &self,
        c: &mut PgConnection,
        after: Option<&str>,
    ) -> Result<(String, Option<String>), Error> {
        let e = |e: sqlx::Error| {
            format!(
                "reading the rows of {}.{}: {e}",
                self.table.schema, self.table.table
            )
        };
        let relation = self.relation(&mut *c).await.map_err(e)?;
        sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *c)
            .await
            .map_err(e)?;
        // `relation` is a regclass's text: already quoted. A TID range scan starts where
        // the previous chunk ended; the cursor sorts what is left once.
        sqlx::query(&format!(
            "DECLARE seed NO SCROLL CURSOR FOR SELECT t.ctid::text, to_jsonb(t)::text FROM {relation} t \
             WHERE t.ctid > $1::tid ORDER BY t.ctid"
        ))
        .bind(after.unwrap_or("(0,0)"))
        .execute(&mut *c)
        .await
        .map_err(e)?;
        let budget = seed_chunk_bytes();
        let fetch = seed_fetch(budget);
        let mut out = String::new();
        let mut last = None;
        let mut more = true;
        while out.len() < budget {
            let rows: Vec<(String, String)> = sqlx::query_as(&format!("FETCH {fetch} FROM seed"))
                .fetch_all(&mut *c)
                .await
                .map_err(e)?;
            if rows.len() < fetch {
                more = false;
            }
            for (ctid, row) in rows {
                out.push_str(&row);
                out.push('\n');
                last = Some(ctid);
            }
            if !more {
                break;
            }
        }
        sqlx::query("COMMIT").execute(&mut *c).await.map_err(e)?;
        Ok((out, if more { last } else { None }))
    }

    /// One chunk of the keys of `key_table` (a key table's columns) that the rows of this
    /// source's (table, partition) hold here, one `to_jsonb` text of the key table's row type
    /// per line, in physical order from after tuple `after`, keys with a NULL part left out;
    /// and where the next chunk starts. What a key table added to a REGIONAL BY ROW table
    /// starts from: each partition's keys, read at its leaseholder once it applied the change
    /// (a key is unique within a partition, whose index leads with the region; across them the
    /// change was checked before it committed).
    pub async fn key_chunk(
        &self,
        key_table: &TableRef,
        after: Option<&str>,
    ) -> Result<(String, Option<String>), Error> {
        let mut c = self.connect().await?;
        let r = async {
            let relation = self.relation(&mut c).await?;
            let keys: String = sqlx::query_scalar(
                "SELECT pg_catalog.format('%I.%I', $1::text, $2::text)::regclass::text",
            )
            .bind(&key_table.schema)
            .bind(&key_table.table)
            .fetch_one(&mut c)
            .await?;
            // Both names are regclass texts: already quoted.
            let rows: Vec<(String, String)> = sqlx::query_as(&format!(
                "SELECT t.ctid::text, pg_catalog.to_jsonb(k)::text FROM {relation} t, \
                        LATERAL pg_catalog.jsonb_populate_record(NULL::{keys}, pg_catalog.to_jsonb(t)) k \
                 WHERE t.ctid > $1::tid AND k IS NOT NULL ORDER BY t.ctid LIMIT $2",
            ))
            .bind(after.unwrap_or("(0,0)"))
            .bind(seed_fetch(seed_chunk_bytes()) as i64)
            .fetch_all(&mut c)
            .await?;
            Ok::<_, sqlx::Error>(rows)
        }
        .await;
        let _ = c.close().await;
        let rows = r.map_err(|e| {
            format!(
                "reading the keys of {}.{} for {}.{}: {e}",
                self.table.schema, self.table.table, key_table.schema, key_table.table
            )
        })?;
        let more = rows.len() == seed_fetch(seed_chunk_bytes());
        let last = rows.last().map(|(ctid, _)| ctid.clone());
        let mut out = String::new();
        for (_, row) in rows {
            out.push_str(&row);
            out.push('\n');
        }
        Ok((out, if more { last } else { None }))
    }

    /// Replaces this node's rows of new range `range_id` by `rows` (from [`Source::rows`] on
    /// the node that held them), its cursor at 0: what the range's bootstrapper does before it
    /// initializes the group, whose first snapshot then carries them to every other replica.
    /// One chunk of the rows region `region` of the source's table had here when the table
    /// stopped being REGIONAL BY ROW (`multiregion.merge_seed`, kept by the conversion), in
    /// the order they were kept, from after row `after`; and where the next chunk starts.
    pub async fn merge_chunk(
        &self,
        region: &str,
        after: Option<&str>,
    ) -> Result<(String, Option<String>), Error> {
        let mut c = self.connect().await?;
        let budget = seed_chunk_bytes();
        let fetch = seed_fetch(budget);
        let mut last: i64 = after.and_then(|a| a.parse().ok()).unwrap_or(0);
        let mut out = String::new();
        let mut more = true;
        let r = async {
            while out.len() < budget {
                let rows: Vec<(i64, String)> = sqlx::query_as(
                    "SELECT id, row_data::text FROM multiregion.merge_seed \
                     WHERE schema_name = $1 AND table_name = $2 AND region = $3 AND id > $4 \
                     ORDER BY id LIMIT $5",
                )
                .bind(&self.table.schema)
                .bind(&self.table.table)
                .bind(region)
                .bind(last)
                .bind(fetch as i64)
                .fetch_all(&mut c)
                .await?;
                more = rows.len() == fetch;
                for (id, row) in rows {
                    out.push_str(&row);
                    out.push('\n');
                    last = id;
                }
                if !more {
                    break;
                }
            }
            Ok::<(), sqlx::Error>(())
        }
        .await;
        let _ = c.close().await;
        r.map_err(|e| {
            format!(
                "reading the kept rows of {}.{}: {e}",
                self.table.schema, self.table.table
            )
        })?;
        Ok((out, more.then(|| last.to_string())))
    }

    /// With `append`, a later chunk of the same seed: added to the rows already there.
    pub async fn install_seed(&self, range_id: u64, rows: &str, append: bool) -> Result<(), Error> {
        let header = Header {
            range_id,
            index: 0,
            schema_version: 0,
            skip: vec![],
            rows: rows.lines().count() as u64,
            decisions: vec![],
            sealed_at: None,
            plans: vec![],
        };
        let mut c = self.connect().await?;
        let r = self
            .install_on(&mut c, &header, rows.as_bytes(), append)
            .await;
        if r.is_err() {
            let _ = sqlx::query("ROLLBACK").execute(&mut c).await;
        }
        let _ = c.close().await;
        r.map(|_| ())
    }
}

/// A snapshot's header and the bytes of its rows.
pub fn parse(data: &[u8]) -> Result<(Header, &[u8]), Error> {
    let end = data
        .iter()
        .position(|b| *b == b'\n')
        .ok_or("a range snapshot without a header")?;
    let header: Header = serde_json::from_slice(&data[..end])
        .map_err(|e| format!("a range snapshot's header is malformed: {e}"))?;
    Ok((header, &data[end + 1..]))
}

/// How long a seed's source waits for the schema change and for its applier.
const SEED_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl super::Ranges {
    fn source(&self, table: TableRef, partition: Option<String>) -> Source {
        Source {
            me: self.me,
            pg_cfg: self.pg_cfg.clone(),
            pg: self.pg.clone(),
            table,
            partition,
            meta: self.meta.clone(),
        }
    }

    /// Fetches and installs the rows new range `d` starts from: a split partition's rows
    /// from its seed range's leaseholder, or a merged table's rows from each old partition
    /// range's leaseholder; the number of rows and of chunks they came in.
    pub(super) async fn seed(&self, d: &mr_meta::RangeDescriptor) -> Result<(u64, u64), Error> {
        if !self.enabled() {
            return Ok((0, 0));
        }
        let here = self.source(d.table.clone(), d.partition.clone());
        // The range's relation must be here first — on the node that made the change, that
        // is once its own transaction has committed — or this node would skip the fetch as
        // the seed's source, or install into a layout the table is leaving. Only the
        // relation: a later change of another table committed meanwhile must not hold the
        // seed up (this node may only be able to apply that one once the seed is in).
        let deadline = tokio::time::Instant::now() + SEED_WAIT;
        while !here.relation_here().await? {
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "node {} has not committed the new range's relation yet",
                    self.me
                ));
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let schema_version = here.schema_version().await?;
        // (old range, the rows of it wanted: a partition or the whole (key) table, a merge)
        let sources: Vec<(u64, Option<String>, bool)> = if d.merge.is_empty() {
            let from = d.seed.ok_or("the range has no seed")?;
            vec![(from, d.partition.clone(), false)]
        } else {
            self.meta.read(|s| {
                d.merge
                    .iter()
                    .filter_map(|q| Some((*q, Some(s.range(*q)?.partition.clone()?), true)))
                    .collect()
            })
        };
        // Chunk by chunk, source by source: the first chunk replaces this node's rows, the
        // others add to them. A failure anywhere starts the seed over (the range is not
        // initialized before the last chunk is in).
        let (mut total, mut chunks, mut first) = (0u64, 0u64, true);
        for (from, partition, merge) in sources {
            let (holder, replicated, addr) = self.meta.read(|s| {
                let holder = s.lease(from).map(|l| l.holder);
                let replicated = s.range(from).is_some_and(|r| r.bootstrapped_by.is_some());
                let addr = holder.and_then(|h| s.node(h)).map(|n| n.rpc_addr.clone());
                (holder, replicated, addr)
            });
            let holder = match holder {
                // The old range never had a group (it replicated no rows).
                None if !replicated => {
                    tracing::warn!(
                        range_id = d.range_id,
                        from,
                        "the seed range holds no replicated rows; nothing to seed from it"
                    );
                    continue;
                }
                None => return Err(format!("range {from} has no leaseholder yet")),
                Some(h) => h,
            };
            if holder == self.me && !merge {
                // This node's rows of the partition are the seed already (and reading them
                // in chunks while replacing them would read its own writes).
                let at = SeedAt {
                    schema_version,
                    ..SeedAt::default()
                };
                self.seed_ready(
                    from,
                    &d.table.schema,
                    &d.table.table,
                    partition.as_deref(),
                    &at,
                )
                .await?;
                return Ok((0, 0));
            }
            let mut after: Option<String> = None;
            loop {
                let at = SeedAt {
                    schema_version,
                    after: after.clone(),
                    merge,
                };
                let answer = if holder == self.me {
                    self.serve_seed(
                        from,
                        &d.table.schema,
                        &d.table.table,
                        partition.as_deref(),
                        at,
                    )
                    .await
                } else {
                    let addr = addr
                        .clone()
                        .ok_or_else(|| format!("node {holder} is unknown"))?;
                    let request = mr_wire::peer::PeerRequest::RangeSeed {
                        from,
                        schema: d.table.schema.clone(),
                        table: d.table.table.clone(),
                        partition: partition.clone(),
                        schema_version,
                        after: at.after,
                        merge,
                    };
                    self.transport
                        .call(&addr, request, SEED_WAIT * 3)
                        .await
                        .map_err(|e| format!("asking node {holder} for the rows: {e}"))?
                };
                let (rows, next) = match answer {
                    mr_wire::peer::PeerResponse::SeedRows { rows, next } => (rows, next),
                    mr_wire::peer::PeerResponse::Error { message, .. } => return Err(message),
                    other => return Err(format!("unexpected answer {other:?}")),
                };
                here.install_seed(d.range_id, &rows, !first).await?;
                first = false;
                total += rows.lines().count() as u64;
                chunks += 1;
                match next {
                    Some(n) => after = Some(n),
                    None => break,
                }
            }
        }
        Ok((total, chunks))
    }

    /// Serves a new range's request for its rows: as the leaseholder of `from`, once this
    /// node has applied the split or merge (after which it takes no writes into `from`) and
    /// every committed entry of `from`. `partition`: `None` for a key table's rows (filled
    /// from this node's copy of `from`'s table when it applied the split).
    pub async fn serve_seed(
        &self,
        from: u64,
        schema: &str,
        table: &str,
        partition: Option<&str>,
        at: SeedAt,
    ) -> mr_wire::peer::PeerResponse {
        match self.seed_rows(from, schema, table, partition, at).await {
            Ok((rows, next)) => mr_wire::peer::PeerResponse::SeedRows { rows, next },
            Err(message) => mr_wire::peer::PeerResponse::Error {
                message,
                retryable: true,
            },
        }
    }

    async fn seed_rows(
        &self,
        from: u64,
        schema: &str,
        table: &str,
        partition: Option<&str>,
        at: SeedAt,
    ) -> Result<(String, Option<String>), Error> {
        let src = self.seed_ready(from, schema, table, partition, &at).await?;
        // A key table's range seeded from the partitions of the table whose keys it keeps.
        let from_table = self.group(from).map(|g| g.table.clone());
        if let Some(base) = from_table.filter(|t| t.schema != schema || t.table != table) {
            return self
                .source(base, partition.map(str::to_string))
                .key_chunk(&src.table, at.after.as_deref())
                .await;
        }
        if at.merge {
            let region = partition.ok_or("a merge's rows are asked for by partition")?;
            src.merge_chunk(region, at.after.as_deref()).await
        } else {
            src.seed_chunk(at.after.as_deref()).await
        }
    }

    /// Waits until this node, the leaseholder of `from`, can serve a seed of `partition`:
    /// it has applied the split and every committed entry of `from`. Its rows of the
    /// partition are then the new range's.
    async fn seed_ready(
        &self,
        from: u64,
        schema: &str,
        table: &str,
        partition: Option<&str>,
        at: &SeedAt,
    ) -> Result<Source, Error> {
        let schema_version = at.schema_version;
        let g = self
            .group(from)
            .ok_or_else(|| format!("node {} holds no replica of range {from}", self.me))?;
        if g.leading().is_none() {
            return Err(format!(
                "node {} is not the leaseholder of range {from}",
                self.me
            ));
        }
        let src = self.source(
            TableRef {
                database: g.table.database.clone(),
                schema: schema.to_string(),
                table: table.to_string(),
            },
            partition.map(str::to_string),
        );
        let deadline = tokio::time::Instant::now() + SEED_WAIT;
        while src.schema_version().await? < schema_version {
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "node {} has not applied schema version {schema_version} yet",
                    self.me
                ));
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let committed = *g.committed.borrow();
        while g.applied_index() < committed {
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "node {}'s applier of range {from} is at {} of {committed}",
                    self.me,
                    g.applied_index()
                ));
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        Ok(src)
    }
}

/// How often a node looks for rows kept for merges that are done.
const MERGE_SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

impl super::Ranges {
    /// Drops rows kept for merges (`multiregion.merge_seed`) once they cannot be asked for
    /// any more, every [`MERGE_SWEEP_EVERY`] until `stop`.
    pub(super) async fn run_merge_seed_sweep(
        self: std::sync::Arc<Self>,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let mut tick = tokio::time::interval(MERGE_SWEEP_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            self.sweep_merge_seeds().await;
        }
    }

    /// A table's kept rows go once it is gone or REGIONAL BY ROW again, or once none of its
    /// partition ranges is left (the merged range is bootstrapped; the meta group keeps
    /// them until then).
    async fn sweep_merge_seeds(&self) {
        if self.pg.ready_pid().is_none() {
            return;
        }
        let databases: Vec<String> = self
            .meta
            .read(|s| s.catalog().map(|(db, _)| db.clone()).collect());
        for database in databases {
            let Ok(mut c) = self
                .pg_cfg
                .connect_options(&database)
                .application_name(APPLICATION_NAME)
                .connect()
                .await
            else {
                continue;
            };
            let kept: Vec<(String, String)> = sqlx::query_as(
                "SELECT DISTINCT schema_name, table_name FROM multiregion.merge_seed",
            )
            .fetch_all(&mut c)
            .await
            .unwrap_or_default();
            for (schema, table) in kept {
                let t = TableRef {
                    database: database.clone(),
                    schema,
                    table,
                };
                let wanted = self.meta.read(|s| {
                    !matches!(
                        s.table_locality(&t),
                        None | Some(mr_meta::TableLocality::RegionalByRow { .. })
                    ) && s.ranges().any(|r| r.table == t && r.partition.is_some())
                });
                if wanted {
                    continue;
                }
                let r = sqlx::query(
                    "DELETE FROM multiregion.merge_seed WHERE schema_name = $1 AND table_name = $2",
                )
                .bind(&t.schema)
                .bind(&t.table)
                .execute(&mut c)
                .await;
                if let Err(e) = r {
                    tracing::debug!(table = %t.table, "dropping rows kept for a merge: {e}");
                }
            }
            let _ = c.close().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_parses_into_its_header_and_rows() {
        let h = Header {
            range_id: 7,
            index: 42,
            schema_version: 3,
            skip: vec![44, 46],
            rows: 2,
            decisions: vec![("mr:1:2".into(), true), ("mr:1:3".into(), false)],
            sealed_at: Some(50),
            plans: vec![(
                "mr:1:2".into(),
                super::super::store::StoredPlan {
                    index: 40,
                    at_ms: 1_700_000_000_000,
                    plan: mr_wire::peer::ForgetPlan {
                        database: "mr".into(),
                        parts: vec![3, 4],
                        nodes: vec![(2, true)],
                        keep_anchor: false,
                        since_ms: 1_700_000_000_000,
                        commit_by_ms: 1_700_000_720_000,
                    },
                    presumed: false,
                },
            )],
        };
        let mut data = serde_json::to_vec(&h).unwrap();
        data.push(b'\n');
        data.extend_from_slice(b"{\"id\": 1}\n{\"id\": 2, \"s\": \"a\\nb\"}\n");
        let (parsed, rows) = parse(&data).unwrap();
        assert_eq!(parsed, h);
        assert_eq!(
            rows.split(|b| *b == b'\n')
                .filter(|l| !l.is_empty())
                .count(),
            2
        );
    }

    #[test]
    fn a_snapshot_without_a_header_is_refused() {
        assert!(parse(b"").is_err());
        assert!(parse(b"not json\n").is_err());
    }
}
