//! The local channel: what a PostgreSQL backend may ask its node's pgmr.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LocalRequest {
    /// This node's identity and uptime (`multiregion.node_info()`).
    NodeInfo,
    /// Measured RTT between every pair of known nodes (`multiregion.network_latency()`).
    NetworkLatency,
    /// Regions and their zones from cluster membership (`multiregion.cluster_regions()`).
    ClusterRegions,
    /// Everything `pgmr status` and `pgmr demo` need: this node and its view of every peer.
    Status,
    /// Fault injection on this node's outgoing links (`pgmr debug …`, tests). `fault: None`
    /// heals the links to `peers`; an empty `peers` means every link.
    SetLinkFaults {
        peers: Vec<u64>,
        fault: Option<LinkFault>,
    },
}

/// What happens to frames this node sends to one peer, on top of the simulated WAN latency.
/// Faults act on the sender's side only, so a one-way partition is one node's rule and a full
/// partition is a rule on each side.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkFault {
    /// Every frame is discarded.
    #[serde(default)]
    pub partitioned: bool,
    /// Probability (0 to 1) that a frame is discarded.
    #[serde(default)]
    pub drop_rate: f64,
    /// Added to the link's one-way delay, in milliseconds.
    #[serde(default)]
    pub extra_delay_ms: f64,
}

impl LinkFault {
    /// Checks the values a user can set, with a message that names the bad one.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.drop_rate) {
            return Err(format!(
                "drop rate {} is not between 0 and 1",
                self.drop_rate
            ));
        }
        if !(0.0..=600_000.0).contains(&self.extra_delay_ms) {
            return Err(format!(
                "extra delay {} ms is not between 0 and 600000",
                self.extra_delay_ms
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LocalResponse {
    NodeInfo(NodeInfo),
    NetworkLatency {
        rows: Vec<RttRow>,
    },
    ClusterRegions {
        regions: Vec<RegionZones>,
    },
    Status(Status),
    /// The faults now in force, by peer node id.
    LinkFaults {
        faults: Vec<(u64, LinkFault)>,
    },
    /// pgmr understood the request but could not serve it.
    Error {
        message: String,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub node_id: u64,
    pub cluster_id: String,
    pub locality: String,
    pub region: String,
    pub zone: Option<String>,
    pub pgmr_version: String,
    pub rpc_addr: String,
    pub sql_addr: String,
    /// Milliseconds since pgmr started.
    pub uptime_ms: u64,
    /// Process id of the PostgreSQL postmaster pgmr supervises, if it is up.
    pub postmaster_pid: Option<u32>,
    /// How many times pgmr has had to restart its PostgreSQL.
    pub pg_restarts: u64,
}

/// One directed pair: the RTT that `from` measured to `to`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RttRow {
    pub from_node: u64,
    pub from_region: String,
    pub from_zone: Option<String>,
    pub to_node: u64,
    pub to_region: String,
    pub to_zone: Option<String>,
    /// Median of the recent samples; `None` until the first heartbeat came back.
    pub rtt_ms: Option<f64>,
    /// How old `from`'s report is, as seen by the answering node.
    pub age_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionZones {
    pub region: String,
    pub zones: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    pub node: NodeInfo,
    pub peers: Vec<PeerStatus>,
    /// Injected faults in force on this node's outgoing links, by peer node id.
    #[serde(default)]
    pub faults: Vec<(u64, LinkFault)>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerStatus {
    pub node_id: u64,
    pub locality: String,
    pub rpc_addr: String,
    pub sql_addr: String,
    /// True if this node heard from the peer within the liveness window.
    pub live: bool,
    pub last_heard_ms_ago: Option<u64>,
    pub rtt_ms: Option<f64>,
}
