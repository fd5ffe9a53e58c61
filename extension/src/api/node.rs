//! Where this node is and what its pgmr knows about the cluster.

use super::{bigint, out_of_range};
use crate::error::{MrError, OrRaise};
use crate::{gucs, sidecar};
use pgrx::prelude::*;

/// The region tier of `multiregion.locality`: the region this session's statements enter the
/// cluster through (CockroachDB's `gateway_region()`). Needs no pgmr, so it works during
/// pgmr outages.
#[pg_extern(schema = "multiregion", stable, parallel_safe)]
fn gateway_region() -> String {
    if let Some(region) = crate::routing::gateway_region_override() {
        return region;
    }
    gucs::locality().or_raise().region().to_owned()
}

/// The columns of `node_info()`, in order.
type NodeInfoRow = (
    i64,
    String,
    String,
    String,
    Option<String>,
    String,
    String,
    String,
    Interval,
    Option<i32>,
    i64,
);

/// This node's identity as pgmr knows it: exactly one row.
// pgrx reads the column names from `name!()` in the signature itself, so no type alias here.
#[allow(clippy::type_complexity)]
#[pg_extern(schema = "multiregion")]
fn node_info() -> TableIterator<
    'static,
    (
        name!(node_id, i64),
        name!(cluster_id, String),
        name!(locality, String),
        name!(region, String),
        name!(zone, Option<String>),
        name!(pgmr_version, String),
        name!(rpc_addr, String),
        name!(sql_addr, String),
        name!(uptime, Interval),
        name!(postmaster_pid, Option<i32>),
        name!(pg_restarts, i64),
    ),
> {
    TableIterator::once(node_info_row().or_raise())
}

fn node_info_row() -> Result<NodeInfoRow, MrError> {
    let n = sidecar::node_info()?;
    let postmaster_pid = match n.postmaster_pid {
        Some(pid) => Some(i32::try_from(pid).map_err(|_| out_of_range("postmaster_pid", pid))?),
        None => None,
    };
    Ok((
        bigint("node_id", n.node_id)?,
        n.cluster_id,
        n.locality,
        n.region,
        n.zone,
        n.pgmr_version,
        n.rpc_addr,
        n.sql_addr,
        uptime(n.uptime_ms)?,
        postmaster_pid,
        bigint("pg_restarts", n.pg_restarts)?,
    ))
}

/// The columns of `network_latency()`, in order.
type LatencyRow = (
    i64,
    String,
    Option<String>,
    i64,
    String,
    Option<String>,
    Option<f64>,
    i64,
);

/// Round-trip times between every pair of nodes pgmr knows, ordered by (from_node, to_node).
/// `rtt_ms` is NULL until the first heartbeat between the pair came back.
#[allow(clippy::type_complexity)] // as for node_info()
#[pg_extern(schema = "multiregion")]
fn network_latency() -> TableIterator<
    'static,
    (
        name!(from_node, i64),
        name!(from_region, String),
        name!(from_zone, Option<String>),
        name!(to_node, i64),
        name!(to_region, String),
        name!(to_zone, Option<String>),
        name!(rtt_ms, Option<f64>),
        name!(age_ms, i64),
    ),
> {
    TableIterator::new(latency_rows().or_raise())
}

fn latency_rows() -> Result<Vec<LatencyRow>, MrError> {
    let mut rows = sidecar::network_latency()?;
    rows.sort_by_key(|r| (r.from_node, r.to_node));
    rows.into_iter()
        .map(|r| {
            Ok((
                bigint("from_node", r.from_node)?,
                r.from_region,
                r.from_zone,
                bigint("to_node", r.to_node)?,
                r.to_region,
                r.to_zone,
                r.rtt_ms,
                bigint("age_ms", r.age_ms)?,
            ))
        })
        .collect()
}

/// The cluster's regions and their zones, from membership (CockroachDB's
/// `SHOW REGIONS FROM CLUSTER`), ordered by region, zones sorted.
#[pg_extern(schema = "multiregion")]
fn cluster_regions() -> TableIterator<'static, (name!(region, String), name!(zones, Vec<String>))> {
    let mut regions = sidecar::cluster_regions().or_raise();
    regions.sort_by(|a, b| a.region.cmp(&b.region));
    TableIterator::new(regions.into_iter().map(|mut r| {
        r.zones.sort();
        (r.region, r.zones)
    }))
}

/// Days and time, without months: a month has no fixed length, and uptime is elapsed time.
fn uptime(ms: u64) -> Result<Interval, MrError> {
    const MS_PER_DAY: u64 = 86_400_000;
    let days = i32::try_from(ms / MS_PER_DAY).map_err(|_| out_of_range("uptime_ms", ms))?;
    let micros = ((ms % MS_PER_DAY) * 1000) as i64;
    Interval::new(0, days, micros).map_err(|_| out_of_range("uptime_ms", ms))
}
