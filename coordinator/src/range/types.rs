//! The range groups' Raft type configuration and what their log carries.

use serde::{Deserialize, Serialize};
use std::io::Cursor;

/// A replica as Raft knows it: where to reach its node (the same shape as the meta group's).
pub type RangeNode = crate::meta::MetaNode;

/// One log entry of a range: a whole transaction's row changes to it, applied atomically by
/// every replica, in log order, exactly once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxnWrite {
    /// Unique per transaction (the proposing node, its PostgreSQL's system identifier epoch
    /// and the transaction id): the key replicas record applied transactions under.
    pub txn_id: String,
    /// The node whose PostgreSQL ran the transaction (the leaseholder when it proposed).
    pub origin: u64,
    /// The database's multi-region schema version the rows were written under.
    pub schema_version: u64,
    /// The row changes as the extension captured them (JSON, opaque to pgmr; read by
    /// `multiregion.apply_range_txn`).
    pub changes: String,
    /// The proposer's wall clock (Unix ms); room for the HLC timestamp of the next issue.
    pub at_ms: u64,
}

openraft::declare_raft_types!(
    /// Range logs carry [`TxnWrite`]s; the state machine's answer is empty (the writer
    /// learns its entry's index from the log id).
    pub RangeConfig:
        D = TxnWrite,
        R = (),
        NodeId = u64,
        Node = RangeNode,
        SnapshotData = Cursor<Vec<u8>>,
);

pub type RangeRaft = openraft::Raft<RangeConfig>;
