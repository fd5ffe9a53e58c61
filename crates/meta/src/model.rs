//! The records the metadata state holds.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

pub type NodeId = u64;
pub type RangeId = u64;

/// A node as the cluster knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub node_id: NodeId,
    pub rpc_addr: String,
    pub sql_addr: String,
    /// `region=...,zone=...`, as given to `pgmr start --locality`.
    pub locality: String,
    pub joined_at_ms: u64,
    /// Proposer's wall clock (Unix ms) at the node's latest liveness heartbeat.
    pub last_heartbeat_ms: u64,
    /// Set by `pgmr node decommission`; a decommissioned node never counts as a member again.
    pub decommissioned: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SurvivalGoal {
    Zone,
    Region,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    Default,
    Restricted,
}

/// A multi-region database's configuration (CockroachDB 2022 paper §2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatabaseConfig {
    pub database: String,
    pub primary_region: String,
    pub regions: BTreeSet<String>,
    pub survival: SurvivalGoal,
    pub placement: Placement,
    pub secondary_region: Option<String>,
}

/// A table, by name within its database.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TableRef {
    pub database: String,
    pub schema: String,
    pub table: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TableLocality {
    /// `REGIONAL BY TABLE [IN region]`; `None` is `IN PRIMARY REGION`.
    RegionalByTable {
        region: Option<String>,
    },
    /// `REGIONAL BY ROW [AS column]`; the column is `crdb_region` unless named.
    RegionalByRow {
        column: String,
    },
    Global,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaKind {
    Voter,
    NonVoter,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replica {
    pub node_id: NodeId,
    pub kind: ReplicaKind,
}

/// A range: a table or one of its partitions, replicated by its own Raft group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeDescriptor {
    pub range_id: RangeId,
    pub table: TableRef,
    /// The LIST partition (a region) of a REGIONAL BY ROW table; `None` for the whole table.
    pub partition: Option<String>,
    pub replicas: Vec<Replica>,
    /// Bumped on every change; updates name the generation they replace.
    pub generation: u64,
    /// The one node that initialized (or is to initialize) the range's Raft group, recorded
    /// by compare-and-set so that a range is never initialized twice.
    #[serde(default)]
    pub bootstrapped_by: Option<NodeId>,
    /// The range whose rows this one starts from: the table's whole range when a table is
    /// split into REGIONAL BY ROW partitions. Its bootstrapper installs the partition's rows
    /// from that range's leaseholder first, and the old range is kept until it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<RangeId>,
    /// The ranges whose rows this one starts from together: a REGIONAL BY ROW table's
    /// partition ranges when it becomes one range again. Its bootstrapper fetches each
    /// partition's rows from that range's leaseholder, and they are kept until it has.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub merge: Vec<RangeId>,
}

/// The right to serve a range's reads and writes until `expiration_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub range_id: RangeId,
    pub holder: NodeId,
    /// Changes only when the holder does: an extension by the same holder keeps it.
    pub sequence: u64,
    pub start_ms: u64,
    pub expiration_ms: u64,
}

/// Where `ALTER … CONFIGURE ZONE` fields apply within a database.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ZoneScope {
    Database,
    Table {
        schema: String,
        table: String,
    },
    /// One region's partition of a REGIONAL BY ROW table.
    Partition {
        schema: String,
        table: String,
        region: String,
    },
}

impl ZoneScope {
    /// Whether the scope is `schema.table` or one of its partitions.
    pub fn is_of(&self, s: &str, t: &str) -> bool {
        match self {
            ZoneScope::Database => false,
            ZoneScope::Table { schema, table } | ZoneScope::Partition { schema, table, .. } => {
                schema == s && table == t
            }
        }
    }
}

/// `CONFIGURE ZONE` fields of one scope: field → value as CockroachDB prints it.
pub type ZoneFields = std::collections::BTreeMap<String, String>;

/// A database's `CONFIGURE ZONE` overrides, by scope.
pub type ZoneOverrides = Vec<(ZoneScope, ZoneFields)>;

/// A scope's `CONFIGURE ZONE` fields (field → value as CockroachDB prints it); `fields: None`
/// is `CONFIGURE ZONE DISCARD`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZoneChange {
    pub scope: ZoneScope,
    pub fields: Option<ZoneFields>,
}
