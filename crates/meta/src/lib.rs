//! The cluster's metadata as a deterministic state machine.
//!
//! pgmr replicates this state through the meta Raft group: every node applies the same
//! [`Proposal`]s in the same order and so holds the same [`MetaState`]. It is the source of
//! truth for nodes and their liveness, database region configurations, table localities,
//! ranges with their replica sets, leases, and each database's log of multi-region schema
//! changes with how far every node has applied it.
//!
//! Rules this crate keeps, and must never depend on pgrx, tokio or any I/O to keep:
//!
//! * **Deterministic apply.** [`MetaState::apply`] reads no clock and no randomness: times
//!   come inside commands, stamped by the proposer.
//! * **Exactly once.** A proposal carries its client's id and sequence number; a proposal
//!   re-submitted after a leader change (and so perhaps committed twice) returns the first
//!   result instead of applying again.
//! * **Readable forever.** Snapshots carry a format number; this release reads every format it
//!   has ever written ([`snapshot`]), and golden files in `tests/` pin each format.

mod liveness;
mod model;
pub mod placement;
pub mod sequence;
pub mod snapshot;
mod state;

pub use liveness::{NodeStatus, DEAD_AFTER_MS, SUSPECT_AFTER_MS};
pub use model::*;
pub use state::{
    ClientId, Command, DroppedRange, Event, Fenced, MetaError, MetaState, Outcome, Proposal,
    SchemaChange, SchemaLog, DROPPED_RANGE_KEEP_MS, EVENT_LOG_LEN,
};
