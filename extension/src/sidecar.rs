//! The client side of the local channel: requests to this node's pgmr, one response each, on
//! a connection the backend keeps.
//!
//! Every call is bounded by `multiregion.sidecar_timeout` and polls for query cancellation
//! while it waits, so neither a missing nor a stuck pgmr can hang a backend. Calls that pgmr
//! serves through the meta Raft group wait at least [`META_TIMEOUT`].

use crate::error::MrError;
use crate::gucs;
use mr_wire::framing::{LocalCallError, LocalClient};
use mr_wire::local::{
    EventRow, LocalRequest, LocalResponse, MetaGroup, NodeInfo, NodeRow, RegionZones, RttRow,
};
use std::cell::RefCell;
use std::path::Path;
use std::time::Duration;

thread_local! {
    /// This backend's connection to pgmr, kept between calls.
    static CLIENT: RefCell<LocalClient> = RefCell::new(LocalClient::default());
}

/// One request to pgmr on this backend's kept connection (see [`LocalClient::call`]).
fn call_local(
    path: &Path,
    req: &LocalRequest,
    timeout: Duration,
    tick: impl FnMut() -> bool,
) -> Result<LocalResponse, LocalCallError> {
    CLIENT.with(|c| match c.try_borrow_mut() {
        Ok(mut client) => client.call(path, req, timeout, tick),
        // A call made while another waits (e.g. from an exit callback that a terminate run
        // inside the first one's `tick`): on a connection of its own.
        Err(_) => LocalClient::default().call(path, req, timeout, tick),
    })
}

/// The least time a meta group call gets: pgmr may wait up to 10 s for a leader election
/// before it answers, and failing a statement that pgmr would still serve helps no one.
const META_TIMEOUT: Duration = Duration::from_secs(15);

pub fn node_info() -> Result<NodeInfo, MrError> {
    match call(LocalRequest::NodeInfo)? {
        LocalResponse::NodeInfo(info) => Ok(info),
        other => Err(unexpected("node_info", &other)),
    }
}

pub fn network_latency() -> Result<Vec<RttRow>, MrError> {
    match call(LocalRequest::NetworkLatency)? {
        LocalResponse::NetworkLatency { rows } => Ok(rows),
        other => Err(unexpected("network_latency", &other)),
    }
}

pub fn cluster_regions() -> Result<Vec<RegionZones>, MrError> {
    match call_meta(LocalRequest::ClusterRegions)? {
        LocalResponse::ClusterRegions { regions } => Ok(regions),
        other => Err(unexpected("cluster_regions", &other)),
    }
}

pub fn nodes() -> Result<Vec<NodeRow>, MrError> {
    match call_meta(LocalRequest::Nodes)? {
        LocalResponse::Nodes { nodes } => Ok(nodes),
        other => Err(unexpected("nodes", &other)),
    }
}

/// What replicating a transaction's changes came to.
pub enum Replication {
    /// Committed (or, for a part of a two-phase commit, prepared) in the ranges' Raft logs as
    /// these (range, index) entries.
    Replicated { entries: Vec<(u64, u64)> },
    /// Replication is off, or the tables are not replicated.
    Off,
}

/// Longest wait for a replicated commit: pgmr answers within 10 s for a leader and 10 s for
/// the quorum and the local apply order, so this only guards against a stuck pgmr.
const REPLICATE_TIMEOUT: Duration = Duration::from_secs(30);

/// Asks pgmr to replicate a transaction's row changes before it commits here. Not
/// interruptible: a cancel cannot take back a write a quorum may already hold; pgmr bounds
/// the wait.
pub fn replicate_txn(req: LocalRequest, bytes: usize) -> Result<Replication, MrError> {
    let path = gucs::sidecar_socket().ok_or(MrError::SocketNotSet)?;
    // pgmr gives a large transaction's entries a second more each (one per MiB).
    let timeout = REPLICATE_TIMEOUT + Duration::from_secs(2 * (bytes >> 20) as u64);
    match call_local(&path, &req, timeout, || true).map_err(lost_commit)? {
        LocalResponse::Replicated { entries } => Ok(Replication::Replicated { entries }),
        LocalResponse::NotReplicated => Ok(Replication::Off),
        other => Err(write_error("replicate_txn", other)),
    }
}

/// Longest wait for a two-phase commit: pgmr bounds each phase (prepares by the forwarded
/// steps' own limits, the decision and the parts' commits by 10 s each).
const COMMIT_DISTRIBUTED_TIMEOUT: Duration = Duration::from_secs(660);

/// Has pgmr commit a transaction with parts on other nodes (two-phase commit). Not
/// interruptible, like [`replicate_txn`]: the decision may already stand.
pub fn commit_distributed(req: LocalRequest) -> Result<Replication, MrError> {
    let path = gucs::sidecar_socket().ok_or(MrError::SocketNotSet)?;
    match call_local(&path, &req, COMMIT_DISTRIBUTED_TIMEOUT, || true).map_err(lost_commit)? {
        LocalResponse::Replicated { entries } => Ok(Replication::Replicated { entries }),
        other => Err(write_error("commit_distributed", other)),
    }
}

/// The error a data-plane response stands for: not servable here (0A000), a failure with
/// pgmr's retry/ambiguity flags, or PostgreSQL's own error from another node.
fn write_error(request: &'static str, response: LocalResponse) -> MrError {
    match response {
        LocalResponse::SqlError(e) => MrError::Remote(e),
        LocalResponse::Unsupported { message, hint } => MrError::WriteNotServed { message, hint },
        LocalResponse::Error {
            message,
            ambiguous: true,
            ..
        } => MrError::Ambiguous(message),
        LocalResponse::Error {
            message,
            retryable: true,
            ..
        } => MrError::Retryable(message),
        LocalResponse::Error { message, .. } => MrError::Sidecar(message),
        other => unexpected(request, &other),
    }
}

/// Waits until this node has applied every write to `targets` acknowledged before now;
/// `Ok(false)` when row replication is off.
pub fn read_barrier(
    database: String,
    targets: Vec<(mr_meta::TableRef, Option<String>)>,
    local_only: bool,
) -> Result<bool, MrError> {
    let req = LocalRequest::ReadBarrier {
        database,
        targets,
        local_only,
    };
    match call_within(req, gucs::sidecar_timeout().max(META_TIMEOUT))? {
        LocalResponse::ReadBarrier { enabled } => Ok(enabled),
        other => Err(write_error("read_barrier", other)),
    }
}

/// The ranges of these replicated tables and their leaseholders; `None` when row
/// replication is off.
pub fn table_ranges(
    database: String,
    tables: Vec<mr_meta::TableRef>,
) -> Result<Option<Vec<mr_wire::local::TableRange>>, MrError> {
    let req = LocalRequest::TableRanges { database, tables };
    match call_within(req, gucs::sidecar_timeout().max(META_TIMEOUT))? {
        LocalResponse::TableRanges { enabled, ranges } => Ok(enabled.then_some(ranges)),
        other => Err(write_error("table_ranges", other)),
    }
}

/// With the ranges' writers locked out: each range's last entry, applied here where this
/// node holds a replica.
pub fn fence_barrier(database: String, ranges: Vec<u64>) -> Result<Vec<(u64, u64)>, MrError> {
    let req = LocalRequest::FenceBarrier { database, ranges };
    // pgmr waits up to a minute for this node to apply what was written before the change.
    match call_within(req, gucs::sidecar_timeout().max(Duration::from_secs(75)))? {
        LocalResponse::FenceBarrier { after } => Ok(after),
        other => Err(write_error("fence_barrier", other)),
    }
}

/// Where a statement over `targets` runs; a read that stays here has passed its read barrier.
pub fn route(
    database: String,
    targets: Vec<(mr_meta::TableRef, Option<String>)>,
    write: bool,
    modifies: bool,
    splittable: bool,
    txn_nodes: Vec<u64>,
) -> Result<Route, MrError> {
    let how = RouteHow {
        write,
        modifies,
        splittable,
        ..RouteHow::default()
    };
    route_with(database, targets, txn_nodes, how)
}

/// What a statement asks of `route_with` besides its targets (`LocalRequest::Route`).
#[derive(Clone, Default)]
pub struct RouteHow {
    pub write: bool,
    pub modifies: bool,
    pub splittable: bool,
    /// A read-write REPEATABLE READ or SERIALIZABLE statement: refused over ranges leased on
    /// several nodes rather than run here.
    pub one_leaseholder: bool,
    /// A read this backend can re-plan over its REGIONAL BY ROW tables gathered from their
    /// leaseholders: answered with `gather` where no node holds a copy of every range.
    pub may_gather: bool,
    /// Partitions among the targets that an INSERT's VALUES only write rows into
    /// ([`crate::replication::touched_ranges`]).
    pub inserted: Vec<(mr_meta::TableRef, String)>,
    /// A splittable UPDATE or DELETE's other reads ([`crate::replication::split_write`]).
    pub split_reads: Option<mr_wire::local::SplitReads>,
    /// Targets whose rows it locks besides its result relations
    /// ([`crate::replication::locked_ranges`]).
    pub locked: Vec<crate::replication::RangeTarget>,
}

/// [`route`] with every question `Route` takes.
pub fn route_with(
    database: String,
    targets: Vec<(mr_meta::TableRef, Option<String>)>,
    txn_nodes: Vec<u64>,
    how: RouteHow,
) -> Result<Route, MrError> {
    let req = LocalRequest::Route {
        database,
        targets,
        write: how.write,
        modifies: how.modifies,
        splittable: how.splittable,
        txn_nodes,
        one_leaseholder: how.one_leaseholder,
        may_gather: how.may_gather,
        inserted: how.inserted,
        split_reads: how.split_reads,
        locked: how.locked,
    };
    match call_within(req, gucs::sidecar_timeout().max(META_TIMEOUT))? {
        LocalResponse::Route {
            enabled,
            forward_to,
            split,
            mixed,
            gather,
            read_ranges,
            locked_elsewhere,
        } => Ok(Route {
            enabled,
            forward_to,
            split,
            mixed,
            gather,
            read_ranges,
            locked_elsewhere,
        }),
        other => Err(write_error("route", other)),
    }
}

/// Where a statement runs, as pgmr answers `Route`.
pub struct Route {
    /// Row replication is on.
    pub enabled: bool,
    /// Runs on that node; `None` (and no `split`): here.
    pub forward_to: Option<u64>,
    /// Runs on each of these leaseholders (`None`: here) over the partitions named.
    pub split: Vec<(Option<u64>, Vec<String>)>,
    /// A write that runs here over ranges leased on several nodes.
    pub mixed: bool,
    /// A read over ranges no node holds a copy of every one of (asked with `may_gather`).
    pub gather: bool,
    /// Ranges the `split` shares only read: their nodes pass these read barriers first.
    pub read_ranges: Vec<u64>,
    /// A `mixed` statement's locked targets leased elsewhere
    /// ([`crate::routing::refuse_locks_on_copies`]).
    pub locked_elsewhere: Vec<mr_wire::local::LockedElsewhere>,
}

/// A forwarded step's result: rows processed, the rows returned as text, and rows it left
/// for partitions leased on other nodes ([`crate::moved`]).
pub type ForwardedRows = (
    u64,
    Vec<Vec<Option<String>>>,
    Vec<mr_wire::local::MovedRows>,
);

/// What one forwarded step returned.
pub struct Forwarded {
    pub rows: ForwardedRows,
    /// Changes it made to global keys ([`crate::global_keys`]).
    pub keys: Vec<mr_wire::local::KeyChanges>,
    /// Referential queries it left for this node ([`crate::ri`]).
    pub deferred: Vec<mr_wire::local::DeferredStatement>,
    /// The remote transaction has changed replicated rows.
    pub wrote: bool,
}

/// Longest wait for one forwarded step (pgmr's own bound is 600 s).
const FORWARD_TIMEOUT: Duration = Duration::from_secs(610);

/// Runs one step of this transaction on node `node_id`: what it returned ([`Forwarded`]). Interruptible unless it commits (a cancel cannot take back a
/// commit under way); the transaction then aborts, and its rollback cancels the remote
/// statement.
pub fn forward(
    node_id: u64,
    request: mr_wire::local::ForwardRequest,
) -> Result<Forwarded, MrError> {
    let path = gucs::sidecar_socket().ok_or(MrError::SocketNotSet)?;
    let commits = request.finish == Some(mr_wire::local::Finish::Commit);
    let req = LocalRequest::Forward { node_id, request };
    let tick = || {
        if !commits {
            check_for_interrupts();
        }
        true
    };
    forwarded(call_local(&path, &req, FORWARD_TIMEOUT, tick)?)
}

/// A forwarded step's answer.
fn forwarded(response: LocalResponse) -> Result<Forwarded, MrError> {
    match response {
        LocalResponse::Forwarded {
            processed,
            rows,
            moved,
            keys,
            deferred,
            wrote,
            ..
        } => Ok(Forwarded {
            rows: (processed, rows, moved),
            keys,
            deferred,
            wrote,
        }),
        other => Err(write_error("forward", other)),
    }
}

/// [`forward`] of several steps to different nodes at once (none of them a commit): pgmr
/// sends them together, so they cost the slowest one's round trip, not the sum. One answer
/// per request, in order.
pub fn forward_each(
    requests: Vec<(u64, mr_wire::local::ForwardRequest)>,
) -> Result<Vec<Result<Forwarded, MrError>>, MrError> {
    let path = gucs::sidecar_socket().ok_or(MrError::SocketNotSet)?;
    let n = requests.len();
    let req = LocalRequest::ForwardEach { requests };
    let tick = || {
        check_for_interrupts();
        true
    };
    match call_local(&path, &req, FORWARD_TIMEOUT, tick)? {
        LocalResponse::ForwardedEach { answers } if answers.len() == n => {
            Ok(answers.into_iter().map(forwarded).collect())
        }
        other => Err(write_error("forward_each", other)),
    }
}

/// Whether row replication is on.
pub fn replication_enabled() -> Result<bool, MrError> {
    match call(LocalRequest::ReplicationEnabled)? {
        LocalResponse::ReadBarrier { enabled } => Ok(enabled),
        other => Err(unexpected("replication_enabled", &other)),
    }
}

/// What a draw from a sequence's cluster-wide counter gave.
pub enum Draw {
    /// `first, first + increment, …`, `count` of them.
    Values { first: i64, count: u64 },
    /// The sequence is at this bound and does not cycle.
    Limit(i64),
    /// Row replication is off: each node's sequences are its own.
    NotReplicated,
}

/// Draws from a sequence's counter in the meta group (docs/ARCHITECTURE.md §8.3).
pub fn next_sequence_values(req: LocalRequest) -> Result<Draw, MrError> {
    match call_meta(req) {
        Ok(LocalResponse::SequenceValues { first, count }) => Ok(Draw::Values { first, count }),
        Ok(LocalResponse::SequenceLimit { limit }) => Ok(Draw::Limit(limit)),
        Ok(LocalResponse::NotReplicated) => Ok(Draw::NotReplicated),
        Ok(other) => Err(unexpected("next_sequence_values", &other)),
        // A draw that may have committed only leaves a gap: drawing again is safe.
        Err(MrError::Ambiguous(m)) => Err(MrError::Retryable(m)),
        Err(e) => Err(e),
    }
}

/// Sets sequences' counters now; false while row replication is off.
pub fn change_sequences(changes: Vec<mr_meta::sequence::SequenceChange>) -> Result<bool, MrError> {
    match call_meta(LocalRequest::ChangeSequences { changes })? {
        LocalResponse::Done => Ok(true),
        LocalResponse::NotReplicated => Ok(false),
        other => Err(unexpected("change_sequences", &other)),
    }
}

/// Tells pgmr that a replicated transaction did not commit here.
pub fn abandon_txn(range_id: u64, index: u64) -> Result<(), MrError> {
    let path = gucs::sidecar_socket().ok_or(MrError::SocketNotSet)?;
    let req = LocalRequest::AbandonTxn { range_id, index };
    match call_local(&path, &req, Duration::from_secs(5), || true)? {
        LocalResponse::Done => Ok(()),
        other => Err(unexpected("abandon_txn", &other)),
    }
}

/// Every range replica's Raft and apply progress, from every live node.
pub fn range_progress() -> Result<Vec<mr_wire::local::RangeProgress>, MrError> {
    match call_meta(LocalRequest::RangeProgress)? {
        LocalResponse::RangeProgress { replicas } => Ok(replicas),
        other => Err(unexpected("range_progress", &other)),
    }
}

/// A checksum of every replica of every range.
pub fn check_consistency() -> Result<Vec<mr_wire::local::ReplicaChecksum>, MrError> {
    match call_within(LocalRequest::CheckConsistency, Duration::from_secs(300))? {
        LocalResponse::Consistency { replicas } => Ok(replicas),
        other => Err(unexpected("check_consistency", &other)),
    }
}

/// Every range of the cluster, read linearizably from the meta group.
pub fn ranges() -> Result<Vec<mr_wire::local::RangeRow>, MrError> {
    match call_meta(LocalRequest::Ranges)? {
        LocalResponse::Ranges { ranges } => Ok(ranges),
        other => Err(unexpected("ranges", &other)),
    }
}

pub fn meta_group() -> Result<MetaGroup, MrError> {
    match call_meta(LocalRequest::MetaGroup)? {
        LocalResponse::MetaGroup(group) => Ok(group),
        other => Err(unexpected("meta_group", &other)),
    }
}

/// Sets (`Some`) or resets (`None`) a cluster setting; returns once the write committed.
pub fn set_cluster_setting(name: String, value: Option<String>) -> Result<(), MrError> {
    match call_meta(LocalRequest::SetClusterSetting { name, value })? {
        LocalResponse::Done => Ok(()),
        other => Err(unexpected("set_cluster_setting", &other)),
    }
}

pub fn cluster_settings() -> Result<Vec<(String, String)>, MrError> {
    match call_meta(LocalRequest::ClusterSettings)? {
        LocalResponse::ClusterSettings { settings } => Ok(settings),
        other => Err(unexpected("cluster_settings", &other)),
    }
}

/// One row of `table`'s partition `partition`, read at its range's leaseholder
/// (`Some(None)`: it has none); `None` while rows are not replicated, the partition has no
/// range yet or this node leases it (this node's copy is then the one to read).
pub fn partition_sample(
    table: mr_meta::TableRef,
    partition: String,
) -> Result<Option<Option<String>>, MrError> {
    match call(LocalRequest::PartitionSample { table, partition })? {
        LocalResponse::PartitionSample { row } => Ok(Some(row)),
        LocalResponse::NotReplicated => Ok(None),
        other => Err(unexpected("partition_sample", &other)),
    }
}

/// Every node's progress through every database's schema log, from the meta group.
pub fn schema_appliers() -> Result<Vec<mr_wire::local::SchemaApplierRow>, MrError> {
    match call_meta(LocalRequest::SchemaAppliers)? {
        LocalResponse::SchemaAppliers { appliers } => Ok(appliers),
        other => Err(unexpected("schema_appliers", &other)),
    }
}

/// A database's `CONFIGURE ZONE` overrides, from the meta group.
pub fn zone_overrides(database: &str) -> Result<mr_meta::ZoneOverrides, MrError> {
    match call_meta(LocalRequest::ZoneOverrides {
        database: database.to_string(),
    })? {
        LocalResponse::ZoneOverrides { zones } => Ok(zones),
        other => Err(unexpected("zone_overrides", &other)),
    }
}

pub fn database_configs() -> Result<Vec<mr_meta::DatabaseConfig>, MrError> {
    match call_meta(LocalRequest::DatabaseConfigs)? {
        LocalResponse::DatabaseConfigs { databases } => Ok(databases),
        other => Err(unexpected("database_configs", &other)),
    }
}

/// Asks pgmr's SQL gateway to restart the idle read-only transactions of these backends, so
/// they release their locks; the backends it restarted.
pub fn restart_idle_readers(backend_pids: Vec<i32>) -> Result<Vec<i32>, MrError> {
    match call(LocalRequest::RestartIdleReaders { backend_pids })? {
        LocalResponse::Restarted { backend_pids } => Ok(backend_pids),
        other => Err(unexpected("restart_idle_readers", &other)),
    }
}

pub fn eventlog() -> Result<Vec<EventRow>, MrError> {
    match call_meta(LocalRequest::EventLog)? {
        LocalResponse::EventLog { events } => Ok(events),
        other => Err(unexpected("event_log", &other)),
    }
}

/// Proposes a schema change ([`LocalRequest::ProposeSchemaChange`]); the new version.
pub fn propose_schema_change(req: LocalRequest) -> Result<u64, MrError> {
    match call_meta(req)? {
        LocalResponse::SchemaVersion { version } => Ok(version),
        other => Err(unexpected("propose_schema_change", &other)),
    }
}

/// Waits until every other live node applied `version` of `database`'s schema.
pub fn await_schema_applied(
    database: String,
    version: u64,
    timeout: Duration,
) -> Result<(), MrError> {
    let req = LocalRequest::AwaitSchemaApplied {
        database,
        version,
        timeout_ms: timeout.as_millis() as u64,
    };
    match call_within(req, timeout + META_TIMEOUT)? {
        LocalResponse::Done => Ok(()),
        other => Err(unexpected("await_schema_applied", &other)),
    }
}

/// `CREATE DATABASE` ran here: the database becomes cluster-wide.
pub fn create_database(database: String) -> Result<(), MrError> {
    match call_meta(LocalRequest::CreateDatabase { database })? {
        LocalResponse::Done => Ok(()),
        other => Err(unexpected("create_database", &other)),
    }
}

/// `DROP DATABASE` ran here: the cluster forgets the database, every other node drops it.
pub fn drop_database(database: String) -> Result<(), MrError> {
    match call_meta(LocalRequest::DropDatabase { database })? {
        LocalResponse::Done => Ok(()),
        other => Err(unexpected("drop_database", &other)),
    }
}

/// Sends `req` to pgmr within `multiregion.sidecar_timeout`.
fn call(req: LocalRequest) -> Result<LocalResponse, MrError> {
    call_within(req, gucs::sidecar_timeout())
}

/// Sends a request that pgmr serves through the meta group, within
/// `max(multiregion.sidecar_timeout, META_TIMEOUT)`.
fn call_meta(req: LocalRequest) -> Result<LocalResponse, MrError> {
    call_within(req, gucs::sidecar_timeout().max(META_TIMEOUT))
}

/// Sends `req` to pgmr; an `Error` response becomes the [`MrError`] its flags call for.
fn call_within(req: LocalRequest, timeout: Duration) -> Result<LocalResponse, MrError> {
    let path = gucs::sidecar_socket().ok_or(MrError::SocketNotSet)?;
    let tick = || {
        check_for_interrupts();
        true
    };
    match call_local(&path, &req, timeout, tick)? {
        LocalResponse::Error {
            message,
            ambiguous: true,
            ..
        } => Err(MrError::Ambiguous(message)),
        LocalResponse::Error {
            message,
            retryable: true,
            ..
        } => Err(MrError::Retryable(message)),
        LocalResponse::Error { message, .. } => Err(MrError::Sidecar(message)),
        response => Ok(response),
    }
}

/// PostgreSQL's CHECK_FOR_INTERRUPTS(): a pending cancel, statement timeout or terminate raises
/// PostgreSQL's usual error here, which pgrx turns into a panic that unwinds out of the call
/// (closing the socket on the way).
// The lint does not see unsafe blocks expanded from another crate's macro; the allow marks
// this as the item that does unsafe work anyway, so the policy stays greppable.
#[allow(unsafe_code)]
fn check_for_interrupts() {
    // SAFETY: pgrx's macro reads PostgreSQL's `InterruptPending` flag and calls the guarded
    // `ProcessInterrupts()`; we run on the backend's main thread, where both are meant to be used.
    pgrx::check_for_interrupts!();
}

/// A commit request whose answer was lost: it may have taken effect (40003).
fn lost_commit(e: LocalCallError) -> MrError {
    match e {
        LocalCallError::Broken { path, source } => MrError::Ambiguous(format!(
            "the connection to pgmr at {} broke before it answered: {source}",
            path
        )),
        LocalCallError::Timeout { path, timeout } => MrError::Ambiguous(format!(
            "pgmr at {} did not answer within {} ms",
            path,
            timeout.as_millis()
        )),
        other => other.into(),
    }
}

impl From<LocalCallError> for MrError {
    fn from(e: LocalCallError) -> Self {
        match e {
            LocalCallError::Connect { path, source } => MrError::Unreachable { path, source },
            LocalCallError::Timeout { path, timeout } => MrError::Timeout {
                path,
                timeout_ms: timeout.as_millis(),
            },
            LocalCallError::Broken { path, source } => MrError::Broken { path, source },
            LocalCallError::Interrupted => MrError::Interrupted,
        }
    }
}

fn unexpected(request: &'static str, response: &LocalResponse) -> MrError {
    let response = match response {
        LocalResponse::NodeInfo(_) => "node_info",
        LocalResponse::NetworkLatency { .. } => "network_latency",
        LocalResponse::ClusterRegions { .. } => "cluster_regions",
        LocalResponse::Status(_) => "status",
        LocalResponse::LinkFaults { .. } => "link_faults",
        LocalResponse::Nodes { .. } => "nodes",
        LocalResponse::MetaGroup(_) => "meta_group",
        LocalResponse::Done => "done",
        LocalResponse::SequenceValues { .. } => "sequence_values",
        LocalResponse::SequenceLimit { .. } => "sequence_limit",
        LocalResponse::ClusterSettings { .. } => "cluster_settings",
        LocalResponse::ZoneOverrides { .. } => "zone_overrides",
        LocalResponse::SchemaAppliers { .. } => "schema_appliers",
        LocalResponse::PartitionSample { .. } => "partition_sample",
        LocalResponse::EventLog { .. } => "event_log",
        LocalResponse::Error { .. } => "error",
        LocalResponse::SchemaVersion { .. } => "schema_version",
        LocalResponse::SchemaLog { .. } => "schema_log",
        LocalResponse::DatabaseConfigs { .. } => "database_configs",
        LocalResponse::Restarted { .. } => "restarted",
        LocalResponse::Ranges { .. } => "ranges",
        LocalResponse::RangeProgress { .. } => "range_progress",
        LocalResponse::Replicated { .. } => "replicated",
        LocalResponse::NotReplicated => "not_replicated",
        LocalResponse::ReadBarrier { .. } => "read_barrier",
        LocalResponse::TableRanges { .. } => "table_ranges",
        LocalResponse::FenceBarrier { .. } => "fence_barrier",
        LocalResponse::Route { .. } => "route",
        LocalResponse::Forwarded { .. } => "forwarded",
        LocalResponse::ForwardedEach { .. } => "forwarded_each",
        LocalResponse::SqlError(_) => "sql_error",
        LocalResponse::PrepareFailed { .. } => "prepare_failed",
        LocalResponse::Consistency { .. } => "consistency",
        LocalResponse::Unsupported { .. } => "unsupported",
    };
    MrError::UnexpectedResponse { request, response }
}
