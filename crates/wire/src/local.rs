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
