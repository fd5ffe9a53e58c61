//! Raft messages over pgmr's transport, so they see the same simulated latency, injected
//! faults and authentication as every other inter-node message.

use super::types::MetaNode;
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
use openraft::RaftTypeConfig;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::marker::PhantomData;

/// The meta group is group 0; a range's group is its range id (ids start at 1).
pub const META_GROUP: u64 = 0;

/// Raft messages of one group (`group`), for any type configuration whose nodes are
/// addressed like the meta group's.
pub struct Network<C> {
    pub transport: Transport,
    pub group: u64,
    pub config: PhantomData<C>,
}

impl<C> Network<C> {
    pub fn new(transport: Transport, group: u64) -> Self {
        Network {
            transport,
            group,
            config: PhantomData,
        }
    }
}

pub struct Peer<C> {
    transport: Transport,
    group: u64,
    target: u64,
    addr: String,
    config: PhantomData<C>,
}

impl<C> RaftNetworkFactory<C> for Network<C>
where
    C: RaftTypeConfig<NodeId = u64, Node = MetaNode>,
{
    type Network = Peer<C>;

    async fn new_client(&mut self, target: u64, node: &MetaNode) -> Peer<C> {
        Peer {
            transport: self.transport.clone(),
            group: self.group,
            target,
            addr: node.rpc_addr.clone(),
            config: PhantomData,
        }
    }
}

type Rpc<T, E = openraft::error::Infallible> =
    Result<T, RPCError<u64, MetaNode, RaftError<u64, E>>>;

impl<C> Peer<C> {
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
            group: self.group,
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

impl<C> RaftNetwork<C> for Peer<C>
where
    C: RaftTypeConfig<NodeId = u64, Node = MetaNode>,
{
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<C>,
        option: RPCOption,
    ) -> Rpc<AppendEntriesResponse<u64>> {
        self.send(RaftKind::AppendEntries, &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<C>,
        option: RPCOption,
    ) -> Rpc<InstallSnapshotResponse<u64>, InstallSnapshotError> {
        self.send(RaftKind::InstallSnapshot, &rpc, &option).await
    }

    async fn vote(&mut self, rpc: VoteRequest<u64>, option: RPCOption) -> Rpc<VoteResponse<u64>> {
        self.send(RaftKind::Vote, &rpc, &option).await
    }
}
