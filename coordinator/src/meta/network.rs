//! Raft messages over pgmr's transport, so they see the same simulated latency, injected
//! faults and authentication as every other inter-node message.

use super::types::{MetaNode, TypeConfig};
use crate::net::{RpcError, Transport};
use mr_wire::peer::{PeerRequest, PeerResponse, RaftKind};
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// The meta group is group 0; range groups will take other ids.
pub const META_GROUP: u64 = 0;

pub struct Network {
    pub transport: Transport,
}

pub struct Peer {
    transport: Transport,
    target: u64,
    addr: String,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Peer;

    async fn new_client(&mut self, target: u64, node: &MetaNode) -> Peer {
        Peer {
            transport: self.transport.clone(),
            target,
            addr: node.rpc_addr.clone(),
        }
    }
}

type Rpc<T, E = openraft::error::Infallible> =
    Result<T, RPCError<u64, MetaNode, RaftError<u64, E>>>;

impl Peer {
    async fn send<Req, Resp, E>(
        &self,
        kind: RaftKind,
        req: &Req,
        option: &RPCOption,
    ) -> Rpc<Resp, E>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: DeserializeOwned + std::error::Error,
    {
        let body =
            serde_json::to_value(req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let msg = PeerRequest::Raft {
            group: META_GROUP,
            to: self.target,
            kind,
            body,
        };
        match self
            .transport
            .call(&self.addr, msg, option.hard_ttl())
            .await
        {
            Ok(PeerResponse::Raft { body }) => {
                match serde_json::from_value::<Result<Resp, RaftError<u64, E>>>(body) {
                    Ok(Ok(r)) => Ok(r),
                    Ok(Err(e)) => Err(RPCError::RemoteError(RemoteError::new(self.target, e))),
                    Err(e) => Err(RPCError::Network(NetworkError::new(&e))),
                }
            }
            Ok(PeerResponse::Error { message, .. }) => Err(RPCError::Network(NetworkError::new(
                &std::io::Error::other(message),
            ))),
            Ok(other) => Err(RPCError::Network(NetworkError::new(
                &std::io::Error::other(format!("unexpected answer to a Raft message: {other:?}")),
            ))),
            // Not even connected: back off instead of retrying at once.
            Err(e @ (RpcError::Dial { .. } | RpcError::Handshake { .. })) => {
                Err(RPCError::Unreachable(Unreachable::new(&e)))
            }
            Err(e) => Err(RPCError::Network(NetworkError::new(&e))),
        }
    }
}

impl RaftNetwork<TypeConfig> for Peer {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Rpc<AppendEntriesResponse<u64>> {
        self.send(RaftKind::AppendEntries, &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Rpc<InstallSnapshotResponse<u64>, InstallSnapshotError> {
        self.send(RaftKind::InstallSnapshot, &rpc, &option).await
    }

    async fn vote(&mut self, rpc: VoteRequest<u64>, option: RPCOption) -> Rpc<VoteResponse<u64>> {
        self.send(RaftKind::Vote, &rpc, &option).await
    }
}
