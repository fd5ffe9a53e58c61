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
    /// How the entry's rows take effect.
    #[serde(default)]
    pub kind: TxnKind,
    /// One of the `Prepare` entries a transaction too large for one entry was split into
    /// (all in one range): the applier applies them together, at the first one's place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk: Option<Chunk>,
}

/// Entry `seq` (0-based) of the `of` entries of one transaction's rows in one range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    pub seq: u32,
    pub of: u32,
}

/// How an entry's rows take effect. A transaction over one range is one `Commit` entry. A
/// transaction over several ranges (two-phase commit) writes a `Prepare` entry with its rows
/// into each, and its decision as a `Decide` entry into one of them, the anchor: the first
/// `Decide` for a transaction in the anchor's log is its decision, whoever proposed it (the
/// coordinator deciding commit, or anyone deciding abort for a coordinator that went
/// silent). A `Prepare` entry's rows are applied at its place in the log once the decision
/// is known: the transaction held its row locks from before the entry was proposed until
/// after the decision, so no entry after it touches the same rows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TxnKind {
    #[default]
    Commit,
    Prepare {
        anchor: u64,
        gid: String,
    },
    /// No rows: the decision for `gid` (recorded per node as the state machine applies it).
    Decide {
        gid: String,
        commit: bool,
        /// The coordinator's proposal carries what the decision leaves to forget: the range
        /// keeps it beside its record, whichever `Decide` made that, until a `Forget`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        plan: Option<mr_wire::peer::ForgetPlan>,
    },
    /// One-range transactions committed in one entry: this entry's own (`txn_id`,
    /// `changes`, …) first, then each of `also` (all `Commit`s, proposed by this range's
    /// leader while its earlier proposals were in flight: one log append and flush, one
    /// replication payload and one applier transaction for all of them). A pgmr from before
    /// batching fails to decode it rather than applying only the first.
    Batch {
        also: Vec<TxnWrite>,
    },
    /// No rows: the range's last entry before it is dropped (its table or partition gone).
    /// A `Decide` after it records abort for a transaction not decided before it, so the
    /// replica that applied it holds every decision the range will ever record and answers
    /// for them once the range is gone (the meta group names it).
    Seal,
    /// No rows: the range forgets its records of decided transactions `gids` (their
    /// coordinator, or the anchor's leader on its plan, confirmed nothing needs them:
    /// ARCHITECTURE.md §8.5). Carried out by each replica's applier as it passes the entry,
    /// so after every `Prepare` of theirs in the log; a sealed range ignores it.
    Forget {
        gids: Vec<String>,
        /// Only the plans go: the anchor keeps its records (a part could not be confirmed),
        /// an abort's until no commit can follow it (its plan becomes presumed).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        plans_only: bool,
    },
}

openraft::declare_raft_types!(
    /// Range logs carry [`TxnWrite`]s; the state machine answers a `Decide` entry with the
    /// transaction's decision (the first in the log), anything else with `None` (the writer
    /// learns its entry's index from the log id).
    pub RangeConfig:
        D = TxnWrite,
        R = Option<bool>,
        NodeId = u64,
        Node = RangeNode,
        SnapshotData = Cursor<Vec<u8>>,
);

pub type RangeRaft = openraft::Raft<RangeConfig>;
