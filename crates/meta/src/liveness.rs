//! Node liveness, derived from the latest heartbeat recorded in the state.

use crate::NodeRecord;
use serde::{Deserialize, Serialize};

/// A node whose latest heartbeat is older than this is suspect: it may be partitioned or
/// overloaded. Nodes heartbeat every second, so this is four missed beats.
pub const SUSPECT_AFTER_MS: u64 = 4_000;
/// A node silent this long is dead: its replicas are to be replaced elsewhere (CockroachDB's
/// `server.time_until_store_dead` defaults to 5 minutes; a minute suits demos and tests).
pub const DEAD_AFTER_MS: u64 = 60_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeStatus {
    Live,
    Suspect,
    Dead,
    Decommissioned,
}

impl NodeRecord {
    /// The node's status at `now_ms` (Unix ms, the caller's clock).
    pub fn status(&self, now_ms: u64) -> NodeStatus {
        if self.decommissioned {
            return NodeStatus::Decommissioned;
        }
        let silent = now_ms.saturating_sub(self.last_heartbeat_ms);
        if silent >= DEAD_AFTER_MS {
            NodeStatus::Dead
        } else if silent >= SUSPECT_AFTER_MS {
            NodeStatus::Suspect
        } else {
            NodeStatus::Live
        }
    }
}
