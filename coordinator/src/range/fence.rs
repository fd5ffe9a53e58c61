//! Schema changes and rows in one order (docs/ARCHITECTURE.md §8.6).
//!
//! A change that reshapes a replicated table (an `ALTER TABLE`, a rename, a drop) must reach
//! every replica after every row written under the old schema and before every row written
//! under the new one, or a replica applies a row to a shape its leaseholder never wrote it
//! for. The origin's extension therefore, before the statement runs, locks the table's ranges
//! against writers at their leaseholders ([`Ranges::table_ranges`] names them), then asks for
//! [`Ranges::fence_barrier`]: the last entry of each range written before the locks, applied
//! here. The change is committed with those entries ([`mr_meta::Fenced`]); each leaseholder
//! learns of it ([`Ranges::notify_schema`]) before its lock is released, and from then on
//! refuses rows written under an older version of that table ([`Ranges::fenced`]); every other
//! node's schema applier applies the change only once its replicas have applied those entries
//! ([`Ranges::await_fenced`]).

use super::{replication_on, Ranges, WriteError, WRITE_TIMEOUT};
use crate::meta::Meta;
use mr_meta::{Fenced, TableRef};
use mr_wire::local::{LocalResponse, TableRange};
use mr_wire::peer::{PeerRequest, PeerResponse};
use std::time::{Duration, Instant};

/// How long a leaseholder may take to learn of a committed change before its lock goes.
const NOTIFY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a schema applier waits for its replicas to apply the rows written before a
/// change. Past it the change is applied anyway (with a warning): a replica that waits for
/// a snapshot taken under the new schema cannot get there first.
const AWAIT_FENCED: Duration = Duration::from_secs(10);
/// How long the origin of a schema change waits to apply the rows written before it
/// ([`Ranges::fence_barrier`]); the extension waits a little longer for the answer.
const FENCE_APPLY_WAIT: Duration = Duration::from_secs(60);

/// Waits (at most `timeout`) until this node's copy of the meta state holds `database`'s
/// schema version `version`.
pub async fn schema_known(meta: &Meta, database: &str, version: u64, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut applied = meta.raft.data_metrics();
    loop {
        let known = meta.read(|s| s.schema(database).map_or(0, |l| l.version)) >= version;
        if known {
            return true;
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return false;
        }
        crate::schema::changed_or(&mut applied, remaining.min(Duration::from_millis(50))).await;
    }
}

impl Ranges {
    /// Every range of these replicated tables (the layout they have, and one they are
    /// leaving), with its leaseholder; waits (up to [`WRITE_TIMEOUT`]) until they are ready
    /// for a statement that locks the table outright (a schema change, TRUNCATE): every
    /// range the declarations want exists and has a leaseholder, and each one this node
    /// holds a replica of has its voters here. A table created a moment ago has neither:
    /// its ranges, first election and lease follow, and its bootstrapper snapshots the
    /// table and the other replicas install that — which a lock held here would block,
    /// while the statement's commit waited for those very replicas.
    pub async fn table_ranges(&self, database: &str, tables: &[TableRef]) -> LocalResponse {
        let deadline = Instant::now() + WRITE_TIMEOUT;
        loop {
            let r = self.table_ranges_now(database, tables);
            let settled = match &r {
                LocalResponse::TableRanges { ranges, .. } => {
                    ranges.iter().all(|r| r.leaseholder.is_some())
                        && self.every_range_exists(database, tables)
                        && ranges.iter().all(|r| self.voters_here(r.range_id))
                }
                _ => true,
            };
            if settled || Instant::now() >= deadline {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether each of these tables the meta group knows has every range its declarations
    /// want (the meta leader creates them a moment after the table).
    fn every_range_exists(&self, database: &str, tables: &[TableRef]) -> bool {
        self.meta.read(|s| {
            let known = s.catalog().find(|(db, _)| db.as_str() == database);
            tables.iter().all(|t| {
                if !known.is_some_and(|(_, ts)| ts.contains(t)) {
                    return true; // created by a transaction not committed yet
                }
                let Ok(wanted) =
                    mr_zoneconfig::table_ranges(s.database(database), s.table_locality(t))
                else {
                    return true;
                };
                wanted
                    .iter()
                    .all(|(p, _)| s.ranges().any(|r| &r.table == t && &r.partition == p))
            })
        })
    }

    /// Whether this node, if the range names it as a replica, has the range's group with
    /// as many voters as the descriptor names (so its snapshot is built and installed).
    fn voters_here(&self, range_id: u64) -> bool {
        let wanted = self.meta.read(|s| {
            s.range(range_id).and_then(|r| {
                r.replicas.iter().any(|x| x.node_id == self.me).then(|| {
                    r.replicas
                        .iter()
                        .filter(|x| x.kind == mr_meta::ReplicaKind::Voter)
                        .count()
                })
            })
        });
        let Some(wanted) = wanted else { return true };
        self.group(range_id).is_some_and(|g| {
            g.raft
                .metrics()
                .borrow()
                .membership_config
                .membership()
                .voter_ids()
                .count()
                >= wanted
        })
    }

    fn table_ranges_now(&self, database: &str, tables: &[TableRef]) -> LocalResponse {
        self.meta.read(|s| {
            if !replication_on(s) {
                return LocalResponse::TableRanges {
                    enabled: false,
                    ranges: Vec::new(),
                };
            }
            let ranges = s
                .ranges()
                .filter(|r| r.table.database == database && tables.contains(&r.table))
                .map(|r| {
                    let leaseholder = s.lease(r.range_id).map(|l| l.holder);
                    TableRange {
                        range_id: r.range_id,
                        table: r.table.clone(),
                        partition: r.partition.clone(),
                        leaseholder,
                        here: leaseholder == Some(self.me),
                        held: r.replicas.iter().any(|x| x.node_id == self.me)
                            && self.group(r.range_id).is_some(),
                    }
                })
                .collect();
            LocalResponse::TableRanges {
                enabled: true,
                ranges,
            }
        })
    }

    /// With writers of these ranges locked out at their leaseholders: each range's last
    /// entry (its leader's read index), applied here where this node holds a replica.
    pub async fn fence_barrier(
        &self,
        database: &str,
        ranges: &[u64],
    ) -> Result<Vec<(u64, u64)>, WriteError> {
        let deadline = Instant::now() + WRITE_TIMEOUT;
        // Applying here what was written before may take a while after a bulk load (a COPY
        // of 100 000 rows reaches a node across the WAN some seconds after its commit).
        let applied_deadline = Instant::now() + FENCE_APPLY_WAIT;
        let mut after = Vec::with_capacity(ranges.len());
        for &range_id in ranges {
            let index = loop {
                let read = match self.listed_group(range_id) {
                    Some(g) => self.read_index(&g).await,
                    None => self.leaseholder_read_index(database, range_id).await,
                };
                match read {
                    Ok(i) => break i,
                    Err(e) if Instant::now() >= deadline => return Err(WriteError::Retryable(e)),
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            };
            if let Some(g) = self.listed_group(range_id) {
                if !g.applied_by(index, applied_deadline).await {
                    return Err(WriteError::Retryable(format!(
                        "this node has not applied range {range_id} up to entry {index} before a schema change of its table"
                    )));
                }
            }
            after.push((range_id, index));
        }
        Ok(after)
    }

    /// The read index of a range this node holds no replica of, from its leaseholder.
    async fn leaseholder_read_index(&self, database: &str, range_id: u64) -> Result<u64, String> {
        let addr = self.meta.read(|s| {
            let holder = s.lease(range_id).map(|l| l.holder)?;
            s.nodes()
                .find(|n| n.node_id == holder)
                .map(|n| n.rpc_addr.clone())
        });
        let Some(addr) = addr else {
            return Err(format!(
                "range {range_id} of database {database} has no leaseholder"
            ));
        };
        let req = PeerRequest::RangeReadIndex { range_id };
        match self
            .transport
            .call(&addr, req, Duration::from_secs(3))
            .await
        {
            Ok(PeerResponse::ReadIndex { index }) => Ok(index),
            Ok(other) => Err(format!(
                "the leaseholder of range {range_id} answered {other:?}"
            )),
            Err(e) => Err(e.to_string()),
        }
    }

    /// After a change committed as `version`: tells each node in `nodes` (leaseholders
    /// holding this transaction's locks), and waits until each knows it, so that none
    /// releases its lock and then accepts rows written under the older version.
    pub async fn notify_schema(&self, database: &str, version: u64, nodes: &[u64]) {
        let calls = nodes.iter().filter(|&&n| n != self.me).map(|&node| async move {
            let Some(addr) = self.node_addr(node) else {
                return;
            };
            let req = PeerRequest::AwaitSchemaKnown {
                database: database.to_string(),
                version,
                timeout_ms: NOTIFY_TIMEOUT.as_millis() as u64,
            };
            let timeout = NOTIFY_TIMEOUT + Duration::from_secs(1);
            match self.transport.call(&addr, req, timeout).await {
                Ok(PeerResponse::SchemaKnown { known: true }) => {}
                other => tracing::warn!(
                    node,
                    database,
                    version,
                    "a leaseholder did not confirm it knows a schema change before its lock goes: {other:?}"
                ),
            }
        });
        futures::future::join_all(calls).await;
    }

    /// Whether rows of `table` written under schema version `version` may still be
    /// proposed: not once a later change that reshapes the table is committed.
    pub fn fenced(&self, database: &str, table: &TableRef, version: u64) -> Result<(), WriteError> {
        let since = self.meta.read(|s| {
            s.schema(database)
                .and_then(|l| l.fenced_since(version, &table.schema, &table.table))
        });
        match since {
            None => Ok(()),
            Some(v) => Err(WriteError::Retryable(format!(
                "table {}.{} was changed by schema version {v} of database {database}, which this transaction did not see (it has version {version}); retry",
                table.schema, table.table
            ))),
        }
    }

    /// Before this node applies a change that reshapes tables: waits (at most
    /// [`AWAIT_FENCED`]) until every replica it holds of their ranges has applied the rows
    /// written before the change.
    pub async fn await_fenced(&self, database: &str, version: u64, fenced: &[Fenced]) {
        let deadline = Instant::now() + AWAIT_FENCED;
        for (range_id, index) in fenced.iter().flat_map(|f| f.after.iter().copied()) {
            let Some(g) = self.listed_group(range_id) else {
                continue;
            };
            if !g.applied_by(index, deadline).await {
                tracing::warn!(
                    database,
                    version,
                    range_id,
                    index,
                    applied = g.applied_index(),
                    "applying a schema change before this replica applied the rows written before it"
                );
            }
        }
    }
}
