//! The client side of the local channel: one request to this node's pgmr, one response.
//!
//! Every call is bounded by `multiregion.sidecar_timeout` and polls for query cancellation
//! while it waits, so neither a missing nor a stuck pgmr can hang a backend.

use crate::error::MrError;
use crate::gucs;
use mr_wire::framing::{call_local, LocalCallError};
use mr_wire::local::{LocalRequest, LocalResponse, NodeInfo, RegionZones, RttRow};

pub fn node_info() -> Result<NodeInfo, MrError> {
    match call(LocalRequest::NodeInfo)? {
        LocalResponse::NodeInfo(info) => Ok(info),
        other => Err(unexpected("node_info", &other)),
    }
}

pub fn network_latency() -> Result<Vec<RttRow>, MrError> {
    match call(LocalRequest::NetworkLatency)? {
        LocalResponse::NetworkLatency { rows } => Ok(rows),
        other => Err(unexpected("network_latency", &other)),
    }
}

pub fn cluster_regions() -> Result<Vec<RegionZones>, MrError> {
    match call(LocalRequest::ClusterRegions)? {
        LocalResponse::ClusterRegions { regions } => Ok(regions),
        other => Err(unexpected("cluster_regions", &other)),
    }
}

/// Sends `req` to pgmr; an `Error` response becomes [`MrError::Sidecar`].
fn call(req: LocalRequest) -> Result<LocalResponse, MrError> {
    let path = gucs::sidecar_socket().ok_or(MrError::SocketNotSet)?;
    let tick = || {
        check_for_interrupts();
        true
    };
    match call_local(&path, &req, gucs::sidecar_timeout(), tick)? {
        LocalResponse::Error { message } => Err(MrError::Sidecar(message)),
        response => Ok(response),
    }
}

/// PostgreSQL's CHECK_FOR_INTERRUPTS(): a pending cancel, statement timeout or terminate raises
/// PostgreSQL's usual error here, which pgrx turns into a panic that unwinds out of the call
/// (closing the socket on the way).
// The lint does not see unsafe blocks expanded from another crate's macro; the allow marks
// this as the item that does unsafe work anyway, so the policy stays greppable.
#[allow(unsafe_code)]
fn check_for_interrupts() {
    // SAFETY: pgrx's macro reads PostgreSQL's `InterruptPending` flag and calls the guarded
    // `ProcessInterrupts()`; we run on the backend's main thread, where both are meant to be used.
    pgrx::check_for_interrupts!();
}

impl From<LocalCallError> for MrError {
    fn from(e: LocalCallError) -> Self {
        match e {
            LocalCallError::Connect { path, source } => MrError::Unreachable { path, source },
            LocalCallError::Timeout { path, timeout } => MrError::Timeout {
                path,
                timeout_ms: timeout.as_millis(),
            },
            LocalCallError::Broken { path, source } => MrError::Broken { path, source },
            LocalCallError::Interrupted => MrError::Interrupted,
        }
    }
}

fn unexpected(request: &'static str, response: &LocalResponse) -> MrError {
    let response = match response {
        LocalResponse::NodeInfo(_) => "node_info",
        LocalResponse::NetworkLatency { .. } => "network_latency",
        LocalResponse::ClusterRegions { .. } => "cluster_regions",
        LocalResponse::Status(_) => "status",
        LocalResponse::LinkFaults { .. } => "link_faults",
        LocalResponse::Error { .. } => "error",
    };
    MrError::UnexpectedResponse { request, response }
}
