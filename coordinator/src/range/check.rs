//! The consistency check: every replica of every range holds the same rows.
//!
//! Each replica summarises its rows of the range (count and an MD5 over every row's text, in
//! one snapshot with its applier's cursor) through `multiregion.range_checksum`. Replicas are
//! only comparable at the same applied index, so under load the check asks again, up to
//! [`ATTEMPTS`] times, until they agree on one; replicas that still differ in index are
//! reported as not comparable rather than as inconsistent.

use super::Ranges;
use futures::future::BoxFuture;
use futures::FutureExt;
use mr_wire::local::ReplicaChecksum;
use mr_wire::peer::{PeerRequest, PeerResponse};
use sqlx::postgres::PgConnection;
use sqlx::{ConnectOptions, Connection, Row};
use std::collections::BTreeSet;
use std::time::Duration;

const ATTEMPTS: usize = 20;
const PAUSE: Duration = Duration::from_millis(250);

/// (applied index, row count, checksum) of one replica.
type Summary = (u64, u64, String);

impl Ranges {
    /// This node's summary of its replica of `range_id`.
    pub async fn local_checksum(&self, range_id: u64) -> Result<Summary, String> {
        let (table, partition) = self.range_table(range_id)?;
        if self.group(range_id).is_none() {
            return Err(format!(
                "node {} runs no replica of range {range_id}",
                self.me
            ));
        }
        if self.pg.ready_pid().is_none() {
            return Err("PostgreSQL is not ready".into());
        }
        let mut c = self
            .connect_to(&table.database, "pgmr consistency check")
            .await?;
        let r = summarise(
            &mut c,
            range_id,
            &table.schema,
            &table.table,
            partition.as_deref(),
        )
        .await
        .map_err(|e| e.to_string());
        let _ = c.close().await;
        r
    }

    /// Compares every replica of every range; one row per replica.
    pub async fn check_consistency(&self) -> Vec<ReplicaChecksum> {
        let ranges: Vec<(u64, Vec<(u64, String)>)> = self.meta.read(|s| {
            s.ranges()
                .map(|r| {
                    let replicas = r
                        .replicas
                        .iter()
                        .map(|x| {
                            let addr = s.node(x.node_id).map(|n| n.rpc_addr.clone());
                            (x.node_id, addr.unwrap_or_default())
                        })
                        .collect();
                    (r.range_id, replicas)
                })
                .collect()
        });
        let mut out = Vec::new();
        'ranges: for (range_id, replicas) in ranges {
            let mut last = Vec::new();
            for attempt in 0..ATTEMPTS {
                // A range dropped while the check runs (its table dropped or converted) has
                // nothing left to compare.
                if self.meta.read(|s| s.range(range_id).is_none()) {
                    continue 'ranges;
                }
                let asks = replicas.iter().map(|(node, addr)| async move {
                    let r = if *node == self.me {
                        self.local_checksum(range_id).await
                    } else {
                        self.remote_checksum(addr, range_id).await
                    };
                    (*node, r)
                });
                last = futures::future::join_all(asks).await;
                let indexes: BTreeSet<Option<u64>> = last
                    .iter()
                    .map(|(_, r)| r.as_ref().ok().map(|s| s.0))
                    .collect();
                if indexes.len() == 1 && !indexes.contains(&None) {
                    break;
                }
                if attempt + 1 < ATTEMPTS {
                    tokio::time::sleep(PAUSE).await;
                }
            }
            let sums: BTreeSet<Option<&Summary>> =
                last.iter().map(|(_, r)| r.as_ref().ok()).collect();
            let consistent = sums.len() == 1 && !sums.contains(&None);
            let comparable = last
                .iter()
                .map(|(_, r)| r.as_ref().ok().map(|s| s.0))
                .collect::<BTreeSet<_>>()
                .len()
                == 1;
            for (node_id, r) in &last {
                out.push(match r {
                    Ok((applied, rows, sum)) => ReplicaChecksum {
                        range_id,
                        node_id: *node_id,
                        applied_index: Some(*applied),
                        row_count: Some(*rows),
                        checksum: Some(sum.clone()),
                        error: (!comparable).then(|| {
                            "replicas did not reach one applied index during the check".into()
                        }),
                        consistent,
                    },
                    Err(e) => ReplicaChecksum {
                        range_id,
                        node_id: *node_id,
                        applied_index: None,
                        row_count: None,
                        checksum: None,
                        error: Some(e.clone()),
                        consistent,
                    },
                });
            }
        }
        out
    }

    async fn remote_checksum(&self, addr: &str, range_id: u64) -> Result<Summary, String> {
        match self
            .transport
            .call(
                addr,
                PeerRequest::RangeChecksum { range_id },
                Duration::from_secs(10),
            )
            .await
        {
            Ok(PeerResponse::RangeChecksum {
                applied_index,
                row_count,
                checksum,
            }) => Ok((applied_index, row_count, checksum)),
            Ok(PeerResponse::Error { message, .. }) => Err(message),
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// One row of a REGIONAL BY ROW table's partition, read where the partition's range is
    /// leased (a node holds only the ranges placement gives it, so its own copy may lack the
    /// rows, or keep ones deleted since): `Some(None)` when it has none; `None` when the
    /// partition has no range (yet) or this node leases it — the asking session's own copy is
    /// then the one to read (with its transaction's own changes).
    pub async fn partition_sample(
        &self,
        table: &mr_meta::TableRef,
        partition: &str,
    ) -> Result<Option<Option<String>>, String> {
        let found = self.meta.read(|s| {
            let r = s
                .ranges()
                .find(|r| &r.table == table && r.partition.as_deref() == Some(partition))?;
            let holder = s.lease(r.range_id).map(|l| l.holder);
            let addr = holder.and_then(|h| s.node(h)).map(|n| n.rpc_addr.clone());
            Some((r.range_id, holder, addr))
        });
        let Some((range_id, holder, addr)) = found else {
            return Ok(None);
        };
        let row = match (holder, addr) {
            (Some(h), _) if h == self.me => return Ok(None),
            (Some(_), Some(addr)) => {
                match self
                    .transport
                    .call(
                        &addr,
                        PeerRequest::RangeSample { range_id },
                        Duration::from_secs(10),
                    )
                    .await
                {
                    Ok(PeerResponse::RangeSample { row }) => Ok(row),
                    Ok(PeerResponse::Error { message, .. }) => Err(message),
                    Ok(other) => Err(format!("unexpected answer {other:?}")),
                    Err(e) => Err(e.to_string()),
                }
            }
            _ => Err(format!("range {range_id} has no leaseholder")),
        };
        row.map(Some)
    }

    /// One row of this node's copy of a range, served to a peer as the range's leaseholder.
    async fn local_sample(&self, range_id: u64) -> Result<Option<String>, String> {
        let (table, partition) = self.range_table(range_id)?;
        let partition = partition.ok_or_else(|| format!("range {range_id} is a whole table"))?;
        let mut c = self
            .connect_to(&table.database, "pgmr partition check")
            .await?;
        let r = sample(&mut c, &table.schema, &table.table, &partition)
            .await
            .map_err(|e| e.to_string());
        let _ = c.close().await;
        r
    }

    /// The table (and partition) a range holds.
    fn range_table(&self, range_id: u64) -> Result<(mr_meta::TableRef, Option<String>), String> {
        self.meta
            .read(|s| {
                s.range(range_id)
                    .map(|r| (r.table.clone(), r.partition.clone()))
            })
            .ok_or_else(|| format!("range {range_id} does not exist"))
    }

    /// A connection to `database` on this node's PostgreSQL, as `application` in
    /// `pg_stat_activity`.
    async fn connect_to(&self, database: &str, application: &str) -> Result<PgConnection, String> {
        self.pg_cfg
            .connect_options(database)
            .application_name(application)
            .connect()
            .await
            .map_err(|e| e.to_string())
    }

    /// Serves a peer's request for a row of a range it leases.
    pub async fn serve_sample(&self, range_id: u64) -> PeerResponse {
        match self.local_sample(range_id).await {
            Ok(row) => PeerResponse::RangeSample { row },
            Err(message) => PeerResponse::Error {
                message,
                retryable: true,
            },
        }
    }

    /// Serves a peer's request for this node's summary of a range.
    pub async fn serve_checksum(&self, range_id: u64) -> PeerResponse {
        match self.local_checksum(range_id).await {
            Ok((applied_index, row_count, checksum)) => PeerResponse::RangeChecksum {
                applied_index,
                row_count,
                checksum,
            },
            Err(message) => PeerResponse::Error {
                message,
                retryable: true,
            },
        }
    }
}

/// One row of `schema.table`'s partition for `region`, as text (`t::text`).
async fn sample(
    c: &mut PgConnection,
    schema: &str,
    table: &str,
    region: &str,
) -> Result<Option<String>, sqlx::Error> {
    let part: Option<String> = sqlx::query_scalar(
        "SELECT c.oid::regclass::text FROM pg_catalog.pg_inherits i \
         JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = pg_catalog.to_regclass(pg_catalog.format('%I.%I', $1::text, $2::text)) \
           AND pg_catalog.pg_get_expr(c.relpartbound, c.oid) = \
               'FOR VALUES IN (' || pg_catalog.quote_literal($3) || ')'",
    )
    .bind(schema)
    .bind(table)
    .bind(region)
    .fetch_optional(&mut *c)
    .await?;
    let Some(part) = part else {
        return Ok(None);
    };
    // `part` is regclass's own quoted text of an existing relation.
    sqlx::query_scalar(&format!("SELECT t::text FROM ONLY {part} t LIMIT 1"))
        .fetch_optional(&mut *c)
        .await
}

fn summarise<'a>(
    c: &'a mut PgConnection,
    range_id: u64,
    schema: &'a str,
    table: &'a str,
    partition: Option<&'a str>,
) -> BoxFuture<'a, Result<Summary, sqlx::Error>> {
    async move {
        let row = sqlx::query("SELECT * FROM multiregion.range_checksum($1, $2, $3, $4)")
            .bind(range_id as i64)
            .bind(schema)
            .bind(table)
            .bind(partition)
            .fetch_one(c)
            .await?;
        Ok((
            row.get::<i64, _>(0) as u64,
            row.get::<i64, _>(1) as u64,
            row.get::<String, _>(2),
        ))
    }
    .boxed()
}
