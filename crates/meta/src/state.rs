//! Commands and their deterministic application.

use crate::model::*;
use crate::sequence::{SequenceBlock, SequenceChange, SequenceParams, SequenceValue};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Who proposed: a node and one run of its pgmr. A restarted pgmr is a new client (its
/// sequence numbers start again at 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ClientId {
    pub node_id: NodeId,
    pub incarnation: u64,
}

/// One change to propose. Times are the proposer's wall clock (Unix ms), but a heartbeat's,
/// which is the meta leader's when it appends it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    /// Allocates the next node id for a joining node.
    AddNode {
        rpc_addr: String,
        sql_addr: String,
        locality: String,
        at_ms: u64,
    },
    /// A node's liveness heartbeat; also records a changed address after a restart.
    Heartbeat {
        node_id: NodeId,
        rpc_addr: String,
        sql_addr: String,
        at_ms: u64,
    },
    Decommission {
        node_id: NodeId,
    },
    PutDatabase {
        config: DatabaseConfig,
    },
    DropDatabase {
        database: String,
    },
    PutTableLocality {
        table: TableRef,
        locality: TableLocality,
    },
    DropTable {
        table: TableRef,
    },
    /// Creates the range for `(table, partition)` with the next range id, unless one exists
    /// already (then its descriptor is returned unchanged): two allocators racing to create
    /// it get the same range.
    CreateRange {
        table: TableRef,
        partition: Option<String>,
        replicas: Vec<Replica>,
        /// The range whose rows it starts from ([`RangeDescriptor::seed`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seed: Option<RangeId>,
        /// The ranges whose rows it starts from together ([`RangeDescriptor::merge`]).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        merge: Vec<RangeId>,
    },
    /// Names the node that initializes the range's Raft group, unless one is named already.
    BootstrapRange {
        range_id: RangeId,
        node_id: NodeId,
    },
    /// Removes a range whose table or partition is gone, with its lease. `sealed_by` names
    /// the node whose replica applied the range's final (seal) entry: it holds every
    /// two-phase commit decision the range ever recorded, and answers for them after the
    /// range is gone (docs/ARCHITECTURE.md §8.5); `None` for a range that could not be
    /// sealed (no leaseholder). Kept as a [`DroppedRange`] for [`DROPPED_RANGE_KEEP_MS`].
    DropRange {
        range_id: RangeId,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sealed_by: Option<NodeId>,
        #[serde(default)]
        at_ms: u64,
    },
    /// Creates (`expected_generation: None`) or replaces a range descriptor, compare-and-set
    /// on its generation so that two concurrent replica changes cannot both win.
    PutRange {
        range: RangeDescriptor,
        expected_generation: Option<u64>,
    },
    /// Takes or extends a lease if the current lease's sequence is `expected_sequence` (`None`
    /// when the range has none) — so two nodes racing for it cannot both succeed.
    AcquireLease {
        range_id: RangeId,
        holder: NodeId,
        start_ms: u64,
        expiration_ms: u64,
        expected_sequence: Option<u64>,
    },
    /// `SET CLUSTER SETTING name = value`; `None` resets it to its default.
    SetClusterSetting {
        name: String,
        value: Option<String>,
    },
    /// A multi-region schema change, compare-and-set on the database's schema version: if
    /// the version is still `expected_version` it becomes `expected_version + 1`, `change`
    /// (opaque to pgmr: the extension writes and reads it) is appended to the database's
    /// schema log, the database's configuration is replaced (`None`: it is no longer
    /// multi-region) and each listed table locality is put (`Some`) or removed (`None`).
    SchemaChange {
        database: String,
        expected_version: u64,
        change: String,
        config: Option<DatabaseConfig>,
        #[serde(default)]
        localities: Vec<(TableRef, Option<TableLocality>)>,
        /// When the change was proposed (Unix ms, the proposer's clock).
        at_ms: u64,
        /// Every table of the database after the change (its replicated tables, each with
        /// its ranges); `None` from proposers that do not send it: the set is unchanged.
        #[serde(default)]
        tables: Option<Vec<TableRef>>,
        /// The replicated tables whose rows the change reshapes, each with the last entry of
        /// each of its ranges written before it (docs/ARCHITECTURE.md §8.6).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        fenced: Vec<Fenced>,
        /// Key tables the change creates from a table's existing rows, each with that table
        /// ([`MetaState::key_seed`]).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        key_seeds: Vec<(TableRef, TableRef)>,
        /// What the change does to sequences' counters (drops, renames, restarts), applied
        /// with it: a transaction rolled back changes none.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        sequences: Vec<SequenceChange>,
        /// `CONFIGURE ZONE` overrides the change sets or discards ([`MetaState::zones`]).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        zones: Vec<ZoneChange>,
    },
    /// `CREATE DATABASE`: the database is cluster-wide from now on (an empty schema log, for
    /// which every node creates its copy); nothing if it has a schema log already.
    CreateDatabase {
        database: String,
    },
    /// `DROP DATABASE` on node `node_id`: the cluster forgets the database (its schema log,
    /// regions, localities, tables and ranges) and every other node drops its copy. A
    /// database created again under the name starts a new schema log at version 0, like
    /// its new copies.
    ForgetDatabase {
        database: String,
        node_id: NodeId,
    },
    /// Node `node_id` has dropped its copy of a database the cluster forgot.
    DatabaseDropped {
        database: String,
        node_id: NodeId,
    },
    /// Draws a block of up to `count` values from a sequence's counter
    /// ([`crate::sequence::allocate`]); a sequence without one starts from `initial`, the
    /// drawing node's copy of its relation.
    NextSequenceValues {
        sequence: TableRef,
        params: SequenceParams,
        initial: SequenceValue,
        count: u64,
    },
    /// `setval` and the like, outside a schema change ([`Command::SchemaChange::sequences`]).
    ChangeSequences {
        changes: Vec<SequenceChange>,
    },
    /// A node has applied its database's schema changes up to `version` to its PostgreSQL.
    SchemaApplied {
        node_id: NodeId,
        database: String,
        version: u64,
    },
    /// A node's applier could not apply `version` (PostgreSQL's error): shown cluster-wide
    /// until the node reports that version applied.
    SchemaApplyFailed {
        node_id: NodeId,
        database: String,
        version: u64,
        error: String,
    },
}

impl Command {
    /// Whether applying it is recorded in the event log. Heartbeats and schema-applied
    /// reports are not: they are frequent (one per node per change), and their effect is in
    /// the node record and the schema log.
    fn logged(&self) -> bool {
        !matches!(
            self,
            Command::Heartbeat { .. }
                | Command::SchemaApplied { .. }
                | Command::DatabaseDropped { .. }
        )
    }
}

/// One database's multi-region schema changes, in the order every node applies them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchemaLog {
    /// The latest version: the number of changes ever made; 0 means never changed.
    pub version: u64,
    /// Every change, oldest first; `changes[i].version == i + 1`.
    pub changes: Vec<SchemaChange>,
    /// The highest version each node has reported applied to its PostgreSQL.
    pub applied: BTreeMap<NodeId, u64>,
    /// Each node whose applier is failing: the version it cannot apply and why. Added in
    /// snapshot format 8.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub failures: BTreeMap<NodeId, (u64, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchemaChange {
    pub version: u64,
    /// When it was proposed (Unix ms, the proposer's clock).
    pub at_ms: u64,
    /// Opaque to pgmr: produced and applied by the extension.
    pub change: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fenced: Vec<Fenced>,
}

/// A table a schema change reshapes (an `ALTER TABLE`, a rename, a drop): rows written
/// before the change must reach every replica before it, and rows written after it only
/// after (docs/ARCHITECTURE.md §8.6).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fenced {
    pub schema: String,
    pub table: String,
    /// (range, index): the table's ranges and the last entry of each that can hold rows
    /// written under an older version. Its leaseholders were locked against writers from
    /// before these entries were read until they knew of the change.
    pub after: Vec<(RangeId, u64)>,
}

impl SchemaLog {
    /// The version `node` has reported applied (0 if none).
    pub fn applied_by(&self, node: NodeId) -> u64 {
        self.applied.get(&node).copied().unwrap_or(0)
    }

    /// The changes after `version`, oldest first.
    pub fn changes_after(&self, version: u64) -> &[SchemaChange] {
        let from = usize::try_from(version)
            .unwrap_or(usize::MAX)
            .min(self.changes.len());
        &self.changes[from..]
    }

    /// The latest change after `version` that reshapes `schema.table`: rows written under
    /// `version` must not be proposed any more (their leaseholder has not applied it yet).
    pub fn fenced_since(&self, version: u64, schema: &str, table: &str) -> Option<u64> {
        self.changes_after(version)
            .iter()
            .rev()
            .find(|c| {
                c.fenced
                    .iter()
                    .any(|f| f.schema == schema && f.table == table)
            })
            .map(|c| c.version)
    }
}

/// One entry of the event log (CockroachDB's `system.eventlog`): a command that took effect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// 1, 2, 3, … in apply order, never reused; gaps appear only at the log's head, where old
    /// events are dropped.
    pub id: u64,
    /// The latest proposer time seen when it applied (Unix ms).
    pub at_ms: u64,
    pub client: ClientId,
    pub seq: u64,
    pub command: Command,
}

/// The event log keeps this many of the latest events.
pub const EVENT_LOG_LEN: usize = 1000;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Proposal {
    pub client: ClientId,
    /// 1, 2, 3, … per client; a client proposes one at a time and retries with the same number.
    pub seq: u64,
    pub command: Command,
}

/// Why a command was refused. Deterministic: every replica refuses it alike.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "error", rename_all = "snake_case")]
pub enum MetaError {
    #[error("node {node_id} does not exist")]
    NoSuchNode { node_id: NodeId },
    #[error("node {node_id} is decommissioned")]
    Decommissioned { node_id: NodeId },
    #[error("primary region {region:?} is not one of the database's regions")]
    PrimaryNotInRegions { region: String },
    #[error("database {database:?} is not multi-region")]
    NoSuchDatabase { database: String },
    #[error("range {range_id} is at generation {current:?}, not {expected:?}")]
    RangeChanged {
        range_id: RangeId,
        current: Option<u64>,
        expected: Option<u64>,
    },
    #[error("range {range_id} has lease sequence {current:?}, not {expected:?}")]
    LeaseChanged {
        range_id: RangeId,
        current: Option<u64>,
        expected: Option<u64>,
    },
    #[error("range {range_id} was bootstrapped by node {by}")]
    RangeBootstrapped { range_id: RangeId, by: NodeId },
    #[error("range {range_id} does not exist")]
    NoSuchRange { range_id: RangeId },
    #[error("node {holder} holds no voting replica of range {range_id}")]
    NotAVoter { range_id: RangeId, holder: NodeId },
    #[error("{name:?} is not a valid cluster setting name")]
    BadSettingName { name: String },
    #[error("concurrent schema change on database {database:?}: expected version {expected}, found {current}")]
    SchemaVersionMismatch {
        database: String,
        expected: u64,
        current: u64,
    },
    #[error("a schema change on database {database:?} names database {other:?}")]
    SchemaWrongDatabase { database: String, other: String },
    #[error("database {database:?} has no schema version {version} (the latest is {current})")]
    NoSuchSchemaVersion {
        database: String,
        version: u64,
        current: u64,
    },
    #[error("proposal {seq} of this client was superseded by proposal {last}; its outcome is no longer known")]
    Superseded { seq: u64, last: u64 },
}

/// What applying a proposal produced. Stored per client for exactly-once replies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    Done,
    NodeAdded {
        node_id: NodeId,
    },
    Lease {
        lease: Lease,
    },
    Range {
        range: RangeDescriptor,
    },
    /// A schema change committed as this version of its database's schema log.
    SchemaVersion {
        version: u64,
    },
    /// The values a [`Command::NextSequenceValues`] drew.
    SequenceValues {
        block: SequenceBlock,
    },
    /// A [`Command::NextSequenceValues`] found its sequence at its bound (no `CYCLE`).
    SequenceLimit {
        limit: i64,
    },
    Rejected {
        error: MetaError,
    },
}

/// The last proposal applied for one client, and what it produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Session {
    seq: u64,
    outcome: Outcome,
    last_active_ms: u64,
}

/// Sessions idle this long are forgotten; a client that comes back after that is a new run.
const SESSION_TTL_MS: u64 = 3_600_000;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MetaState {
    next_node_id: NodeId,
    nodes: BTreeMap<NodeId, NodeRecord>,
    databases: BTreeMap<String, DatabaseConfig>,
    #[serde(with = "pairs")]
    tables: BTreeMap<TableRef, TableLocality>,
    ranges: BTreeMap<RangeId, RangeDescriptor>,
    leases: BTreeMap<RangeId, Lease>,
    #[serde(with = "pairs")]
    sessions: BTreeMap<ClientId, Session>,
    /// Latest proposer time seen: the only clock apply knows, used to expire sessions.
    high_water_ms: u64,
    /// Added in snapshot format 2; empty when read from format 1.
    #[serde(default)]
    settings: BTreeMap<String, String>,
    /// Added in snapshot format 2; empty when read from format 1.
    #[serde(default)]
    events: std::collections::VecDeque<Event>,
    #[serde(default)]
    last_event_id: u64,
    /// Added in snapshot format 3; empty when read from formats 1 and 2.
    #[serde(default)]
    schemas: BTreeMap<String, SchemaLog>,
    /// Every table of each cluster-wide database, whether or not it has a locality. Added in
    /// snapshot format 4; empty when read from older formats.
    #[serde(default)]
    catalog: BTreeMap<String, std::collections::BTreeSet<TableRef>>,
    /// The next range id to allocate (ids start at 1). Added in snapshot format 4.
    #[serde(default)]
    next_range_id: RangeId,
    /// Databases dropped cluster-wide, with the nodes that have dropped their copy (the
    /// others still must). Added in snapshot format 5; empty when read from older formats.
    #[serde(default)]
    dropped: BTreeMap<String, std::collections::BTreeSet<NodeId>>,
    /// Key tables created from a table's existing rows, each with that table, while both are
    /// in the catalog. Added in snapshot format 6; empty when read from older formats.
    #[serde(default, with = "pairs")]
    key_seeds: BTreeMap<TableRef, TableRef>,
    /// Each cluster-wide sequence's counter, once drawn from or set (docs/ARCHITECTURE.md
    /// §8.3). Added in snapshot format 7; empty when read from older formats.
    #[serde(default, with = "pairs")]
    sequences: BTreeMap<TableRef, SequenceValue>,
    /// Each database's `CONFIGURE ZONE` overrides, by scope; a scope's table leaving the
    /// catalog takes them along. Added in snapshot format 8; empty when read from older ones.
    #[serde(default)]
    zones: BTreeMap<String, ZoneOverrides>,
    /// Ranges dropped in the last [`DROPPED_RANGE_KEEP_MS`], with the node that holds their
    /// decisions. Added in snapshot format 9; empty when read from older formats.
    #[serde(default)]
    dropped_ranges: BTreeMap<RangeId, DroppedRange>,
}

/// How long a dropped range's record is kept: far longer than any part of a two-phase
/// commit waits for its decision (seconds; a node down for a day asks its own ranges).
pub const DROPPED_RANGE_KEEP_MS: u64 = 7 * 24 * 3600 * 1000;

/// A range no longer in the descriptors ([`Command::DropRange`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DroppedRange {
    /// The node whose replica applied its seal entry, if it was sealed.
    pub sealed_by: Option<NodeId>,
    pub at_ms: u64,
}

impl MetaState {
    /// A new cluster whose first node is `first`: it gets node id 1.
    pub fn bootstrap(rpc_addr: &str, sql_addr: &str, locality: &str, at_ms: u64) -> MetaState {
        let mut s = MetaState {
            next_node_id: 1,
            ..MetaState::default()
        };
        s.add_node(rpc_addr, sql_addr, locality, at_ms);
        s.high_water_ms = at_ms;
        s
    }

    pub fn nodes(&self) -> impl Iterator<Item = &NodeRecord> {
        self.nodes.values()
    }
    pub fn node(&self, id: NodeId) -> Option<&NodeRecord> {
        self.nodes.get(&id)
    }
    pub fn database(&self, name: &str) -> Option<&DatabaseConfig> {
        self.databases.get(name)
    }
    /// Every multi-region database's configuration, by name.
    pub fn databases(&self) -> impl Iterator<Item = &DatabaseConfig> {
        self.databases.values()
    }
    pub fn table_locality(&self, t: &TableRef) -> Option<&TableLocality> {
        self.tables.get(t)
    }
    /// The table whose rows key table `t` was filled from when a schema change created it
    /// (a table becoming REGIONAL BY ROW): its range starts from that table's range's
    /// leaseholder's copy, as the table's partitions do (docs/ARCHITECTURE.md §8.2).
    pub fn key_seed(&self, t: &TableRef) -> Option<&TableRef> {
        self.key_seeds.get(t)
    }
    /// A database's `CONFIGURE ZONE` overrides, by scope.
    pub fn zones(&self, database: &str) -> &[(ZoneScope, ZoneFields)] {
        self.zones.get(database).map(Vec::as_slice).unwrap_or(&[])
    }
    /// Every sequence's counter, by sequence.
    pub fn sequences(&self) -> impl Iterator<Item = (&TableRef, &SequenceValue)> {
        self.sequences.iter()
    }
    pub fn range(&self, id: RangeId) -> Option<&RangeDescriptor> {
        self.ranges.get(&id)
    }
    pub fn lease(&self, id: RangeId) -> Option<&Lease> {
        self.leases.get(&id)
    }
    /// A range dropped lately: who answers for its two-phase commit decisions.
    pub fn dropped_range(&self, id: RangeId) -> Option<&DroppedRange> {
        self.dropped_ranges.get(&id)
    }
    /// Every range, by id.
    pub fn ranges(&self) -> impl Iterator<Item = &RangeDescriptor> {
        self.ranges.values()
    }
    /// Every cluster-wide database whose table set is known, with its tables.
    pub fn catalog(
        &self,
    ) -> impl Iterator<Item = (&String, &std::collections::BTreeSet<TableRef>)> {
        self.catalog.iter()
    }
    pub fn cluster_setting(&self, name: &str) -> Option<&str> {
        self.settings.get(name).map(String::as_str)
    }
    pub fn cluster_settings(&self) -> impl Iterator<Item = (&str, &str)> {
        self.settings.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
    /// A database's schema log; `None` if its schema was never changed.
    pub fn schema(&self, database: &str) -> Option<&SchemaLog> {
        self.schemas.get(database)
    }
    /// Databases dropped cluster-wide, each with the nodes that have dropped their copy.
    pub fn dropped_databases(
        &self,
    ) -> impl Iterator<Item = (&str, &std::collections::BTreeSet<NodeId>)> {
        self.dropped.iter().map(|(k, v)| (k.as_str(), v))
    }
    /// Every database's schema log, by database name.
    pub fn schemas(&self) -> impl Iterator<Item = (&str, &SchemaLog)> {
        self.schemas.iter().map(|(k, v)| (k.as_str(), v))
    }
    /// The retained event log, oldest first.
    pub fn events(&self) -> impl Iterator<Item = &Event> {
        self.events.iter()
    }

    /// Applies one committed proposal. A proposal already applied for its client returns the
    /// recorded outcome and changes nothing.
    pub fn apply(&mut self, p: &Proposal) -> Outcome {
        if let Some(s) = self.sessions.get(&p.client) {
            if p.seq == s.seq {
                return s.outcome.clone();
            }
            if p.seq < s.seq {
                let error = MetaError::Superseded {
                    seq: p.seq,
                    last: s.seq,
                };
                return Outcome::Rejected { error };
            }
        }
        let at = command_time(&p.command).unwrap_or(self.high_water_ms);
        self.high_water_ms = self.high_water_ms.max(at);
        let outcome = match self.execute(&p.command) {
            Ok(o) => o,
            Err(error) => Outcome::Rejected { error },
        };
        let now = self.high_water_ms;
        if p.command.logged() && !matches!(outcome, Outcome::Rejected { .. }) {
            self.last_event_id += 1;
            self.events.push_back(Event {
                id: self.last_event_id,
                at_ms: now,
                client: p.client,
                seq: p.seq,
                command: p.command.clone(),
            });
            while self.events.len() > EVENT_LOG_LEN {
                self.events.pop_front();
            }
        }
        self.sessions.insert(
            p.client,
            Session {
                seq: p.seq,
                outcome: outcome.clone(),
                last_active_ms: now,
            },
        );
        self.sessions
            .retain(|_, s| now.saturating_sub(s.last_active_ms) < SESSION_TTL_MS);
        outcome
    }

    fn add_node(&mut self, rpc_addr: &str, sql_addr: &str, locality: &str, at_ms: u64) -> NodeId {
        let node_id = self.next_node_id.max(1);
        self.next_node_id = node_id + 1;
        self.nodes.insert(
            node_id,
            NodeRecord {
                node_id,
                rpc_addr: rpc_addr.to_string(),
                sql_addr: sql_addr.to_string(),
                locality: locality.to_string(),
                joined_at_ms: at_ms,
                last_heartbeat_ms: at_ms,
                decommissioned: false,
            },
        );
        node_id
    }

    fn live_node(&mut self, node_id: NodeId) -> Result<&mut NodeRecord, MetaError> {
        let n = self
            .nodes
            .get_mut(&node_id)
            .ok_or(MetaError::NoSuchNode { node_id })?;
        if n.decommissioned {
            return Err(MetaError::Decommissioned { node_id });
        }
        Ok(n)
    }

    fn execute(&mut self, c: &Command) -> Result<Outcome, MetaError> {
        match c {
            Command::AddNode {
                rpc_addr,
                sql_addr,
                locality,
                at_ms,
            } => {
                let node_id = self.add_node(rpc_addr, sql_addr, locality, *at_ms);
                Ok(Outcome::NodeAdded { node_id })
            }
            Command::Heartbeat {
                node_id,
                rpc_addr,
                sql_addr,
                at_ms,
            } => {
                let n = self.live_node(*node_id)?;
                // The meta leader's time when it appended the beat (pgmr stamps it there), so
                // the latest beat is the latest time: a leader whose clock ran ahead is
                // overwritten by the next one's, not kept as a maximum for as long as it ran
                // ahead.
                n.last_heartbeat_ms = *at_ms;
                n.rpc_addr.clone_from(rpc_addr);
                n.sql_addr.clone_from(sql_addr);
                Ok(Outcome::Done)
            }
            Command::Decommission { node_id } => {
                let n = self
                    .nodes
                    .get_mut(node_id)
                    .ok_or(MetaError::NoSuchNode { node_id: *node_id })?;
                n.decommissioned = true;
                Ok(Outcome::Done)
            }
            Command::PutDatabase { config } => {
                if !config.regions.contains(&config.primary_region) {
                    return Err(MetaError::PrimaryNotInRegions {
                        region: config.primary_region.clone(),
                    });
                }
                self.databases
                    .insert(config.database.clone(), config.clone());
                Ok(Outcome::Done)
            }
            Command::DropDatabase { database } => {
                self.databases
                    .remove(database)
                    .ok_or_else(|| MetaError::NoSuchDatabase {
                        database: database.clone(),
                    })?;
                self.tables.retain(|t, _| &t.database != database);
                self.drop_database_data(database);
                Ok(Outcome::Done)
            }
            Command::PutTableLocality { table, locality } => {
                if !self.databases.contains_key(&table.database) {
                    return Err(MetaError::NoSuchDatabase {
                        database: table.database.clone(),
                    });
                }
                self.tables.insert(table.clone(), locality.clone());
                Ok(Outcome::Done)
            }
            Command::DropTable { table } => {
                self.tables.remove(table);
                Ok(Outcome::Done)
            }
            Command::CreateRange {
                table,
                partition,
                replicas,
                seed,
                merge,
            } => {
                if let Some(existing) = self
                    .ranges
                    .values()
                    .find(|r| &r.table == table && &r.partition == partition)
                {
                    return Ok(Outcome::Range {
                        range: existing.clone(),
                    });
                }
                for r in replicas {
                    self.live_node(r.node_id)?;
                }
                // Past every id in use, also those of descriptors put with explicit ids.
                let id = self
                    .next_range_id
                    .max(self.ranges.keys().next_back().map_or(1, |k| k + 1));
                let range = RangeDescriptor {
                    range_id: id,
                    table: table.clone(),
                    partition: partition.clone(),
                    replicas: replicas.clone(),
                    generation: 1,
                    bootstrapped_by: None,
                    seed: seed.filter(|s| self.ranges.contains_key(s)),
                    merge: merge
                        .iter()
                        .copied()
                        .filter(|m| self.ranges.contains_key(m))
                        .collect(),
                };
                self.next_range_id = id + 1;
                self.ranges.insert(range.range_id, range.clone());
                Ok(Outcome::Range { range })
            }
            Command::BootstrapRange { range_id, node_id } => {
                let range = self
                    .ranges
                    .get_mut(range_id)
                    .ok_or(MetaError::NoSuchRange {
                        range_id: *range_id,
                    })?;
                match range.bootstrapped_by {
                    Some(by) if by != *node_id => Err(MetaError::RangeBootstrapped {
                        range_id: *range_id,
                        by,
                    }),
                    _ => {
                        range.bootstrapped_by = Some(*node_id);
                        Ok(Outcome::Done)
                    }
                }
            }
            Command::DropRange {
                range_id,
                sealed_by,
                at_ms,
            } => {
                self.ranges.remove(range_id).ok_or(MetaError::NoSuchRange {
                    range_id: *range_id,
                })?;
                self.leases.remove(range_id);
                self.dropped_ranges
                    .retain(|_, d| d.at_ms.saturating_add(DROPPED_RANGE_KEEP_MS) > *at_ms);
                self.dropped_ranges.insert(
                    *range_id,
                    DroppedRange {
                        sealed_by: *sealed_by,
                        at_ms: *at_ms,
                    },
                );
                Ok(Outcome::Done)
            }
            Command::PutRange {
                range,
                expected_generation,
            } => {
                let current = self.ranges.get(&range.range_id).map(|r| r.generation);
                if current != *expected_generation {
                    return Err(MetaError::RangeChanged {
                        range_id: range.range_id,
                        current,
                        expected: *expected_generation,
                    });
                }
                for r in &range.replicas {
                    self.live_node(r.node_id)?;
                }
                let mut next = range.clone();
                next.generation = current.map_or(1, |g| g + 1);
                // Who bootstrapped the group, and from what, is not the proposer's to change.
                if let Some(stored) = self.ranges.get(&range.range_id) {
                    next.bootstrapped_by = stored.bootstrapped_by;
                    next.seed = stored.seed;
                    next.merge = stored.merge.clone();
                }
                self.ranges.insert(range.range_id, next);
                Ok(Outcome::Done)
            }
            Command::AcquireLease {
                range_id,
                holder,
                start_ms,
                expiration_ms,
                expected_sequence,
            } => {
                let range = self.ranges.get(range_id).ok_or(MetaError::NoSuchRange {
                    range_id: *range_id,
                })?;
                let voter = range
                    .replicas
                    .iter()
                    .any(|r| r.node_id == *holder && r.kind == ReplicaKind::Voter);
                if !voter {
                    return Err(MetaError::NotAVoter {
                        range_id: *range_id,
                        holder: *holder,
                    });
                }
                self.live_node(*holder)?;
                let current = self.leases.get(range_id);
                let current_seq = current.map(|l| l.sequence);
                if current_seq != *expected_sequence {
                    return Err(MetaError::LeaseChanged {
                        range_id: *range_id,
                        current: current_seq,
                        expected: *expected_sequence,
                    });
                }
                let sequence = match current {
                    Some(l) if l.holder == *holder => l.sequence,
                    Some(l) => l.sequence + 1,
                    None => 1,
                };
                let lease = Lease {
                    range_id: *range_id,
                    holder: *holder,
                    sequence,
                    start_ms: *start_ms,
                    expiration_ms: *expiration_ms,
                };
                self.leases.insert(*range_id, lease.clone());
                Ok(Outcome::Lease { lease })
            }
            Command::SetClusterSetting { name, value } => {
                if name.is_empty() || name.len() > 256 {
                    return Err(MetaError::BadSettingName { name: name.clone() });
                }
                match value {
                    Some(v) => self.settings.insert(name.clone(), v.clone()),
                    None => self.settings.remove(name),
                };
                Ok(Outcome::Done)
            }
            Command::SchemaChange {
                database,
                expected_version,
                change,
                config,
                localities,
                at_ms,
                tables,
                fenced,
                key_seeds,
                sequences,
                zones,
            } => {
                if let Some(c) = sequences.iter().find(|c| c.database() != database) {
                    return Err(MetaError::SchemaWrongDatabase {
                        database: database.clone(),
                        other: c.database().to_string(),
                    });
                }
                let outcome = self.schema_change(
                    database,
                    *expected_version,
                    change,
                    config.as_ref(),
                    localities,
                    *at_ms,
                    tables.as_deref(),
                    fenced,
                    key_seeds,
                )?;
                self.change_sequences(sequences);
                self.change_zones(database, zones);
                Ok(outcome)
            }
            Command::NextSequenceValues {
                sequence,
                params,
                initial,
                count,
            } => {
                let state = self.sequences.get(sequence).copied().unwrap_or(*initial);
                match crate::sequence::allocate(state, params, *count) {
                    Ok((block, next)) => {
                        self.sequences.insert(sequence.clone(), next);
                        Ok(Outcome::SequenceValues { block })
                    }
                    Err(l) => Ok(Outcome::SequenceLimit { limit: l.limit }),
                }
            }
            Command::ChangeSequences { changes } => {
                self.change_sequences(changes);
                Ok(Outcome::Done)
            }
            Command::CreateDatabase { database } => {
                self.schemas.entry(database.clone()).or_default();
                Ok(Outcome::Done)
            }
            Command::ForgetDatabase { database, node_id } => {
                self.databases.remove(database);
                self.tables.retain(|t, _| &t.database != database);
                self.drop_database_data(database);
                self.schemas.remove(database);
                self.dropped
                    .insert(database.clone(), std::iter::once(*node_id).collect());
                Ok(Outcome::Done)
            }
            Command::DatabaseDropped { database, node_id } => {
                if let Some(done) = self.dropped.get_mut(database) {
                    done.insert(*node_id);
                }
                Ok(Outcome::Done)
            }
            Command::SchemaApplied {
                node_id,
                database,
                version,
            } => {
                let current = self.schemas.get(database).map_or(0, |l| l.version);
                if *version == 0 || *version > current {
                    return Err(MetaError::NoSuchSchemaVersion {
                        database: database.clone(),
                        version: *version,
                        current,
                    });
                }
                let log = self.schemas.get_mut(database).expect("checked above");
                let applied = log.applied.entry(*node_id).or_insert(0);
                *applied = (*applied).max(*version);
                let applied = *applied;
                log.failures
                    .retain(|n, (v, _)| n != node_id || *v > applied);
                Ok(Outcome::Done)
            }
            Command::SchemaApplyFailed {
                node_id,
                database,
                version,
                error,
            } => {
                let Some(log) = self.schemas.get_mut(database) else {
                    return Err(MetaError::NoSuchDatabase {
                        database: database.clone(),
                    });
                };
                if log.applied_by(*node_id) < *version {
                    log.failures.insert(*node_id, (*version, error.clone()));
                }
                Ok(Outcome::Done)
            }
        }
    }

    /// [`Command::SchemaChange`]: checks everything first, so a refusal changes nothing.
    // The command's fields, unpacked: a struct for them would only repeat `Command`.
    #[allow(clippy::too_many_arguments)]
    fn schema_change(
        &mut self,
        database: &str,
        expected_version: u64,
        change: &str,
        config: Option<&DatabaseConfig>,
        localities: &[(TableRef, Option<TableLocality>)],
        at_ms: u64,
        tables: Option<&[TableRef]>,
        fenced: &[Fenced],
        key_seeds: &[(TableRef, TableRef)],
    ) -> Result<Outcome, MetaError> {
        let current = self.schemas.get(database).map_or(0, |l| l.version);
        if current != expected_version {
            return Err(MetaError::SchemaVersionMismatch {
                database: database.to_string(),
                expected: expected_version,
                current,
            });
        }
        let wrong = |other: &str| MetaError::SchemaWrongDatabase {
            database: database.to_string(),
            other: other.to_string(),
        };
        if let Some(c) = config {
            if c.database != database {
                return Err(wrong(&c.database));
            }
            if !c.regions.contains(&c.primary_region) {
                return Err(MetaError::PrimaryNotInRegions {
                    region: c.primary_region.clone(),
                });
            }
        }
        if let Some(t) = tables
            .into_iter()
            .flatten()
            .find(|t| t.database != database)
        {
            return Err(wrong(&t.database));
        }
        if let Some((t, _)) = key_seeds
            .iter()
            .find(|(k, p)| k.database != database || p.database != database)
        {
            return Err(wrong(&t.database));
        }
        for (t, l) in localities {
            if t.database != database {
                return Err(wrong(&t.database));
            }
            if l.is_some() && config.is_none() {
                return Err(MetaError::NoSuchDatabase {
                    database: database.to_string(),
                });
            }
        }
        match config {
            Some(c) => {
                self.databases.insert(database.to_string(), c.clone());
            }
            None => {
                self.databases.remove(database);
                self.tables.retain(|t, _| t.database != database);
            }
        }
        for (t, l) in localities {
            match l {
                Some(l) => self.tables.insert(t.clone(), l.clone()),
                None => self.tables.remove(t),
            };
        }
        if let Some(tables) = tables {
            self.catalog
                .insert(database.to_string(), tables.iter().cloned().collect());
        }
        for (k, p) in key_seeds {
            self.key_seeds.insert(k.clone(), p.clone());
        }
        // A link is needed only until the key table's range exists; it goes with either table.
        let catalog = &self.catalog;
        self.key_seeds.retain(|k, p| {
            k.database != database
                || catalog
                    .get(database)
                    .is_some_and(|c| c.contains(k) && c.contains(p))
        });
        let log = self.schemas.entry(database.to_string()).or_default();
        log.version += 1;
        log.changes.push(SchemaChange {
            version: log.version,
            at_ms,
            change: change.to_string(),
            fenced: fenced.to_vec(),
        });
        Ok(Outcome::SchemaVersion {
            version: log.version,
        })
    }
}

impl MetaState {
    fn change_sequences(&mut self, changes: &[SequenceChange]) {
        for c in changes {
            match c {
                SequenceChange::Set { sequence, value } => {
                    self.sequences.insert(sequence.clone(), *value);
                }
                SequenceChange::Drop { sequence } => {
                    self.sequences.remove(sequence);
                }
                SequenceChange::Move { moves } => {
                    let taken: Vec<_> = moves
                        .iter()
                        .map(|(from, to)| (to, self.sequences.remove(from)))
                        .collect();
                    for (to, v) in taken {
                        match v {
                            Some(v) => self.sequences.insert(to.clone(), v),
                            None => self.sequences.remove(to),
                        };
                    }
                }
            }
        }
    }

    /// Forgets a dropped database's tables and ranges (its schema log stays: a database
    /// created again under the name continues it).
    /// Puts or discards `CONFIGURE ZONE` overrides, then forgets those of tables the
    /// database's catalog no longer has (a dropped table's go with it).
    fn change_zones(&mut self, database: &str, changes: &[ZoneChange]) {
        let zones = self.zones.entry(database.to_string()).or_default();
        for c in changes {
            zones.retain(|(s, _)| s != &c.scope);
            if let Some(fields) = c.fields.as_ref().filter(|f| !f.is_empty()) {
                zones.push((c.scope.clone(), fields.clone()));
            }
        }
        zones.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(catalog) = self.catalog.get(database) {
            zones.retain(|(s, _)| match s {
                ZoneScope::Database => true,
                ZoneScope::Table { schema, table } | ZoneScope::Partition { schema, table, .. } => {
                    catalog.contains(&TableRef {
                        database: database.to_string(),
                        schema: schema.clone(),
                        table: table.clone(),
                    })
                }
            });
        }
        if zones.is_empty() {
            self.zones.remove(database);
        }
    }

    fn drop_database_data(&mut self, database: &str) {
        self.catalog.remove(database);
        self.zones.remove(database);
        self.key_seeds.retain(|k, _| k.database != database);
        self.sequences.retain(|k, _| k.database != database);
        let gone: Vec<RangeId> = self
            .ranges
            .values()
            .filter(|r| r.table.database == database)
            .map(|r| r.range_id)
            .collect();
        for id in gone {
            self.ranges.remove(&id);
            self.leases.remove(&id);
        }
    }
}

fn command_time(c: &Command) -> Option<u64> {
    match c {
        Command::AddNode { at_ms, .. }
        | Command::Heartbeat { at_ms, .. }
        | Command::SchemaChange { at_ms, .. } => Some(*at_ms),
        Command::AcquireLease { start_ms, .. } => Some(*start_ms),
        _ => None,
    }
}

/// Maps with structured keys, written as lists of `[key, value]` pairs: JSON object keys can
/// only be strings.
mod pairs {
    use serde::de::DeserializeOwned;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::collections::BTreeMap;

    pub fn serialize<K: Serialize, V: Serialize, S: Serializer>(
        map: &BTreeMap<K, V>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(map.iter())
    }

    pub fn deserialize<'de, K, V, D>(d: D) -> Result<BTreeMap<K, V>, D::Error>
    where
        K: DeserializeOwned + Ord,
        V: DeserializeOwned,
        D: Deserializer<'de>,
    {
        Ok(Vec::<(K, V)>::deserialize(d)?.into_iter().collect())
    }
}
