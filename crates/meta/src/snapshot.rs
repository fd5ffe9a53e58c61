//! Snapshots of [`MetaState`]: `{"format": N, "state": …}`.
//!
//! A release writes the newest format and reads every older one, converting as it goes; a
//! snapshot from a newer release is refused with a message, never misread.

use crate::MetaState;
use serde::Deserialize;

/// The format this release writes.
///
/// * 1: nodes, databases, table localities, ranges, leases, sessions.
/// * 2: adds cluster settings and the event log.
/// * 3: adds each database's schema log.
/// * 4: adds each database's table set and the range id counter.
/// * 5: adds the databases dropped cluster-wide and which nodes dropped their copies.
/// * 6: adds the key tables created from a table's rows, with that table.
/// * 7: adds the sequences' counters.
/// * 8: adds the databases' `CONFIGURE ZONE` overrides.
/// * 9: adds the ranges dropped lately, with the node that answers for their decisions.
pub const FORMAT: u32 = 9;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot format {0} is newer than this release reads (up to {FORMAT}); upgrade pgmr")]
    TooNew(u32),
    #[error("corrupt snapshot: {0}")]
    Corrupt(#[from] serde_json::Error),
}

pub fn encode(state: &MetaState) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "format": FORMAT, "state": state }))
        .expect("metadata state always serializes")
}

pub fn decode(bytes: &[u8]) -> Result<MetaState, SnapshotError> {
    #[derive(Deserialize)]
    struct Envelope {
        format: u32,
        state: serde_json::Value,
    }
    let env: Envelope = serde_json::from_slice(bytes)?;
    match env.format {
        // Formats 2 to 9 only added fields; an older format reads as a format 9 state with
        // no settings, an empty event log, no schema logs, no table sets, no dropped
        // databases, no key-table links, no sequence counters, no zone overrides and no
        // dropped ranges (their `#[serde(default)]`). A
        // format that changes a field's shape adds an arm here that reads the old shape and
        // converts it.
        1..=9 => Ok(serde_json::from_value(env.state)?),
        n => Err(SnapshotError::TooNew(n)),
    }
}
