//! What the meta Raft group records: the nodes, cluster settings and the event log, which pgmr
//! reads linearizably (so every node gives the same answer), and the group itself as this
//! node sees it. The views over these functions are the names users query.

use super::{bigint, timestamptz};
use crate::error::{MrError, OrRaise};
use crate::sidecar;
use mr_wire::local::{EventRow, MetaGroup};
use pgrx::prelude::*;
use pgrx::JsonB;
use std::collections::BTreeMap;

/// The columns of `nodes_info()`, in order.
type NodeRow = (
    i64,
    String,
    String,
    Option<String>,
    String,
    String,
    String,
    String,
    TimestampWithTimeZone,
    TimestampWithTimeZone,
);

/// Every node the meta group knows, decommissioned ones included, ordered by node_id; the
/// view `multiregion.nodes` shows it.
#[allow(clippy::type_complexity)] // pgrx reads the column names from `name!()` here
#[pg_extern(schema = "multiregion")]
fn nodes_info() -> TableIterator<
    'static,
    (
        name!(node_id, i64),
        name!(locality, String),
        name!(region, String),
        name!(zone, Option<String>),
        name!(rpc_addr, String),
        name!(sql_addr, String),
        name!(status, String),
        name!(meta_role, String),
        name!(joined_at, TimestampWithTimeZone),
        name!(last_heartbeat, TimestampWithTimeZone),
    ),
> {
    TableIterator::new(node_rows().or_raise())
}

fn node_rows() -> Result<Vec<NodeRow>, MrError> {
    let mut nodes = sidecar::nodes()?;
    nodes.sort_by_key(|n| n.node_id);
    nodes
        .into_iter()
        .map(|n| {
            Ok((
                bigint("node_id", n.node_id)?,
                n.locality,
                n.region,
                n.zone,
                n.rpc_addr,
                n.sql_addr,
                n.status,
                n.meta_role,
                timestamptz("joined_at_ms", n.joined_at_ms)?,
                timestamptz("last_heartbeat_ms", n.last_heartbeat_ms)?,
            ))
        })
        .collect()
}

/// The columns of `meta_group_info()`, in order.
type MemberRow = (
    i64,
    &'static str,
    bool,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    i64,
    Option<i64>,
    i64,
    String,
);

/// One row per voter and learner of the meta group, ordered by node_id, as the answering node
/// (`observed_by`) sees the group. Replication progress comes from the leader, so
/// `matched_index` and `lag` are NULL when no leader answered.
#[allow(clippy::type_complexity)] // as for nodes_info()
#[pg_extern(schema = "multiregion")]
fn meta_group_info() -> TableIterator<
    'static,
    (
        name!(node_id, i64),
        name!(role, &'static str),
        name!(is_leader, bool),
        name!(matched_index, Option<i64>),
        name!(lag, Option<i64>),
        name!(leader, Option<i64>),
        name!(term, i64),
        name!(commit_index, Option<i64>),
        name!(observed_by, i64),
        name!(observer_state, String),
    ),
> {
    let group = sidecar::meta_group().or_raise();
    TableIterator::new(member_rows(group).or_raise())
}

fn member_rows(g: MetaGroup) -> Result<Vec<MemberRow>, MrError> {
    // A voter's role wins should pgmr ever list a node as both (mid membership change).
    let mut roles: BTreeMap<u64, &'static str> = BTreeMap::new();
    roles.extend(g.learners.iter().map(|&id| (id, "learner")));
    roles.extend(g.voters.iter().map(|&id| (id, "voter")));
    let leader = g.leader.map(|id| bigint("leader", id)).transpose()?;
    let term = bigint("term", g.term)?;
    let commit_index = g
        .commit_index
        .map(|i| bigint("commit_index", i))
        .transpose()?;
    let observed_by = bigint("node_id", g.node_id)?;
    roles
        .into_iter()
        .map(|(id, role)| {
            let progress = g.members.iter().find(|m| m.node_id == id);
            let matched_index = progress
                .and_then(|m| m.matched_index)
                .map(|i| bigint("matched_index", i))
                .transpose()?;
            let lag = progress.map(|m| bigint("lag", m.lag)).transpose()?;
            Ok((
                bigint("node_id", id)?,
                role,
                g.leader == Some(id),
                matched_index,
                lag,
                leader,
                term,
                commit_index,
                observed_by,
                g.state.clone(),
            ))
        })
        .collect()
}

/// `SET CLUSTER SETTING name = value`, or `RESET CLUSTER SETTING name` when `value` is NULL:
/// a committed metadata write that every node sees. Superusers only, checked here as well as
/// by the script's REVOKE, so that a grant cannot hand it to anyone else.
#[pg_extern(schema = "multiregion")]
fn set_cluster_setting(name: Option<&str>, value: Option<&str>) {
    set_setting(name, value).or_raise()
}

pub(crate) fn set_setting(name: Option<&str>, value: Option<&str>) -> Result<(), MrError> {
    if !is_superuser() {
        return Err(MrError::NotSuperuser);
    }
    let name = name
        .filter(|n| !n.is_empty())
        .ok_or(MrError::SettingNameMissing)?;
    sidecar::set_cluster_setting(name.to_owned(), value.map(str::to_owned))
}

#[allow(unsafe_code)]
fn is_superuser() -> bool {
    // SAFETY: `superuser()` only reads the session's current user and the syscache, which a
    // backend running a SQL function always has.
    unsafe { pg_sys::superuser() }
}

/// Every cluster setting that has been set, ordered by name; a reset one is gone.
#[pg_extern(schema = "multiregion")]
fn cluster_settings_info() -> TableIterator<'static, (name!(variable, String), name!(value, String))>
{
    let mut settings = sidecar::cluster_settings().or_raise();
    settings.sort();
    TableIterator::new(settings)
}

/// The columns of `schema_appliers_info()`, in order.
type SchemaApplierRow = (String, i64, i64, i64, Option<i64>, Option<String>);

/// Every node's progress through every database's schema log, from the meta group: the
/// version each applied, the latest, and a change its applier reported it cannot apply
/// (with PostgreSQL's error) until it applies it. The applier retries by itself (within
/// 5 s); a failure stays here until the cause is fixed on that node (docs/ARCHITECTURE.md
/// §5, "Schema changes").
#[allow(clippy::type_complexity)] // as for nodes_info()
#[pg_extern(schema = "multiregion")]
fn schema_appliers_info() -> TableIterator<
    'static,
    (
        name!(database_name, String),
        name!(node_id, i64),
        name!(applied_version, i64),
        name!(latest_version, i64),
        name!(failed_version, Option<i64>),
        name!(error, Option<String>),
    ),
> {
    TableIterator::new(schema_applier_rows().or_raise())
}

fn schema_applier_rows() -> Result<Vec<SchemaApplierRow>, MrError> {
    let mut rows = sidecar::schema_appliers()?;
    rows.sort_by(|a, b| (&a.database, a.node_id).cmp(&(&b.database, b.node_id)));
    rows.into_iter()
        .map(|r| {
            Ok((
                r.database,
                bigint("node_id", r.node_id)?,
                bigint("applied", r.applied)?,
                bigint("latest", r.latest)?,
                r.failed_version
                    .map(|v| bigint("failed_version", v))
                    .transpose()?,
                r.error,
            ))
        })
        .collect()
}

/// The columns of `eventlog_info()`, in order.
type EventLogRow = (i64, TimestampWithTimeZone, i64, i64, String, JsonB);

/// Every metadata change the meta group applied, ordered by id (CockroachDB's
/// `system.eventlog`).
#[allow(clippy::type_complexity)] // as for nodes_info()
#[pg_extern(schema = "multiregion")]
fn eventlog_info() -> TableIterator<
    'static,
    (
        name!(id, i64),
        name!(timestamp, TimestampWithTimeZone),
        name!(node_id, i64),
        name!(seq, i64),
        name!(event_type, String),
        name!(info, JsonB),
    ),
> {
    TableIterator::new(event_rows().or_raise())
}

fn event_rows() -> Result<Vec<EventLogRow>, MrError> {
    let mut events = sidecar::eventlog()?;
    events.sort_by_key(|e| e.id);
    events.into_iter().map(event_row).collect()
}

fn event_row(e: EventRow) -> Result<EventLogRow, MrError> {
    let info =
        pgrx::json_from_slice(e.info.as_bytes()).map_err(|err| MrError::MalformedEventInfo {
            id: e.id,
            reason: err.to_string(),
        })?;
    Ok((
        bigint("id", e.id)?,
        timestamptz("at_ms", e.at_ms)?,
        bigint("node_id", e.node_id)?,
        bigint("seq", e.seq)?,
        e.event_type,
        JsonB(info),
    ))
}

// The views are the names users query; they are created after the functions they read, and
// `set_cluster_setting` loses its default EXECUTE grant to PUBLIC.
/// The columns of `ranges_info()`, in order.
type RangeInfoRow = (
    i64,
    String,
    String,
    String,
    Option<String>,
    Option<i64>,
    Option<String>,
    Vec<i64>,
    Vec<i64>,
    Vec<String>,
    i64,
);

/// Every range of the cluster (CockroachDB's `SHOW RANGES`), ordered by range id; the view
/// `multiregion.ranges` shows it.
#[allow(clippy::type_complexity)]
#[pg_extern(schema = "multiregion")]
fn ranges_info() -> TableIterator<
    'static,
    (
        name!(range_id, i64),
        name!(database_name, String),
        name!(schema_name, String),
        name!(table_name, String),
        name!(partition, Option<String>),
        name!(lease_holder, Option<i64>),
        name!(lease_holder_region, Option<String>),
        name!(voting_replicas, Vec<i64>),
        name!(non_voting_replicas, Vec<i64>),
        name!(replica_regions, Vec<String>),
        name!(generation, i64),
    ),
> {
    TableIterator::new(range_rows().or_raise())
}

fn range_rows() -> Result<Vec<RangeInfoRow>, MrError> {
    let ids = |field: &'static str, v: Vec<u64>| -> Result<Vec<i64>, MrError> {
        v.into_iter().map(|id| bigint(field, id)).collect()
    };
    let mut ranges = sidecar::ranges()?;
    ranges.sort_by_key(|r| r.range_id);
    ranges
        .into_iter()
        .map(|r| {
            Ok((
                bigint("range_id", r.range_id)?,
                r.database_name,
                r.schema_name,
                r.table_name,
                r.partition,
                r.lease_holder
                    .map(|l| bigint("lease_holder", l))
                    .transpose()?,
                r.lease_holder_region,
                ids("voting_replicas", r.voting_replicas)?,
                ids("non_voting_replicas", r.non_voting_replicas)?,
                r.replica_regions,
                bigint("generation", r.generation)?,
            ))
        })
        .collect()
}

/// The columns of `range_replicas_info()`, in order.
type ReplicaRow = (
    i64,
    i64,
    String,
    Option<i64>,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
);

/// Every range replica's Raft and apply progress, as each live node reports it; the view
/// `multiregion.range_replicas` shows it. `lag` counts the committed entries this replica has
/// not applied yet (against the highest commit index any replica of the range reports);
/// `snapshot_index` is where its latest snapshot is (0: none), `first_log_index` the first
/// entry its log still holds (snapshots let it purge the ones before).
#[allow(clippy::type_complexity)]
#[pg_extern(schema = "multiregion")]
fn range_replicas_info() -> TableIterator<
    'static,
    (
        name!(range_id, i64),
        name!(node_id, i64),
        name!(raft_state, String),
        name!(leader, Option<i64>),
        name!(term, i64),
        name!(last_log_index, i64),
        name!(committed_index, i64),
        name!(applied_index, i64),
        name!(lag, i64),
        name!(snapshot_index, i64),
        name!(first_log_index, i64),
    ),
> {
    TableIterator::new(replica_rows().or_raise())
}

fn replica_rows() -> Result<Vec<ReplicaRow>, MrError> {
    let replicas = sidecar::range_progress()?;
    let mut top: BTreeMap<u64, u64> = BTreeMap::new();
    for r in &replicas {
        let t = top.entry(r.range_id).or_default();
        *t = (*t).max(r.committed_index);
    }
    replicas
        .into_iter()
        .map(|r| {
            let lag = top[&r.range_id].saturating_sub(r.applied_index);
            Ok((
                bigint("range_id", r.range_id)?,
                bigint("node_id", r.node_id)?,
                r.raft_state,
                r.leader.map(|l| bigint("leader", l)).transpose()?,
                bigint("term", r.term)?,
                bigint("last_log_index", r.last_log_index)?,
                bigint("committed_index", r.committed_index)?,
                bigint("applied_index", r.applied_index)?,
                bigint("lag", lag)?,
                bigint("snapshot_index", r.snapshot_index)?,
                bigint("first_log_index", r.first_log_index)?,
            ))
        })
        .collect()
}

/// The type of `check_consistency()`'s rows.
type ChecksumRow = (
    i64,
    i64,
    Option<i64>,
    Option<i64>,
    Option<String>,
    bool,
    Option<String>,
);

/// Compares a checksum of every replica of every range (`pgmr debug check-consistency`):
/// one row per replica, `consistent` false for every replica of a range whose replicas
/// differ. Superuser only: it reads every table of every database.
#[allow(clippy::type_complexity)]
#[pg_extern(schema = "multiregion")]
fn check_consistency() -> TableIterator<
    'static,
    (
        name!(range_id, i64),
        name!(node_id, i64),
        name!(applied_index, Option<i64>),
        name!(row_count, Option<i64>),
        name!(checksum, Option<String>),
        name!(consistent, bool),
        name!(error, Option<String>),
    ),
> {
    TableIterator::new(checksum_rows().or_raise())
}

fn checksum_rows() -> Result<Vec<ChecksumRow>, MrError> {
    sidecar::check_consistency()?
        .into_iter()
        .map(|r| {
            Ok((
                bigint("range_id", r.range_id)?,
                bigint("node_id", r.node_id)?,
                r.applied_index
                    .map(|v| bigint("applied_index", v))
                    .transpose()?,
                r.row_count.map(|v| bigint("row_count", v)).transpose()?,
                r.checksum,
                r.consistent,
                r.error,
            ))
        })
        .collect()
}

extension_sql!(
    r#"
CREATE VIEW multiregion.ranges AS
    SELECT * FROM multiregion.ranges_info() ORDER BY range_id;
CREATE VIEW multiregion.range_replicas AS
    SELECT * FROM multiregion.range_replicas_info() ORDER BY range_id, node_id;
REVOKE EXECUTE ON FUNCTION multiregion.check_consistency() FROM PUBLIC;
"#,
    name = "ranges_view",
    requires = [ranges_info, range_replicas_info, check_consistency]
);

extension_sql!(
    r#"
CREATE VIEW multiregion.nodes AS
    SELECT * FROM multiregion.nodes_info() ORDER BY node_id;
CREATE VIEW multiregion.meta_group AS
    SELECT * FROM multiregion.meta_group_info() ORDER BY node_id;
CREATE VIEW multiregion.cluster_settings AS
    SELECT * FROM multiregion.cluster_settings_info() ORDER BY variable;
CREATE VIEW multiregion.eventlog AS
    SELECT * FROM multiregion.eventlog_info() ORDER BY id;
CREATE VIEW multiregion.schema_appliers AS
    SELECT * FROM multiregion.schema_appliers_info() ORDER BY database_name, node_id;
REVOKE EXECUTE ON FUNCTION multiregion.set_cluster_setting(text, text) FROM PUBLIC;
"#,
    name = "meta_views",
    requires = [
        nodes_info,
        meta_group_info,
        cluster_settings_info,
        eventlog_info,
        schema_appliers_info,
        set_cluster_setting
    ],
);
