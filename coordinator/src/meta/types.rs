//! The meta group's Raft type configuration.

use mr_meta::{Outcome, Proposal};
use serde::{Deserialize, Serialize};
use std::io::Cursor;

/// A member of the meta group as Raft knows it: where to reach it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaNode {
    pub rpc_addr: String,
    pub locality: String,
}

openraft::declare_raft_types!(
    /// Log entries carry [`Proposal`]s; applying one yields its [`Outcome`].
    pub TypeConfig:
        D = Proposal,
        R = Outcome,
        NodeId = u64,
        Node = MetaNode,
        SnapshotData = Cursor<Vec<u8>>,
);

pub type Raft = openraft::Raft<TypeConfig>;
