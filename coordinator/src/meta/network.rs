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
use openraft::{LogId, RaftLogId, RaftTypeConfig, Vote};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

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
    /// What the target last acknowledged through this client (see [`Peer::append_entries`]).
    acked: Arc<Mutex<Option<Acked>>>,
    config: PhantomData<C>,
}

impl<C> Clone for Peer<C> {
    fn clone(&self) -> Self {
        Peer {
            transport: self.transport.clone(),
            group: self.group,
            target: self.target,
            addr: self.addr.clone(),
            acked: self.acked.clone(),
            config: PhantomData,
        }
    }
}

/// The last AppendEntries a target acknowledged with success: the leader's vote, the entry
/// the target's log matches after it, and the commit index it carried.
#[derive(Debug, Clone, PartialEq)]
struct Acked {
    vote: Vote<u64>,
    matched: Option<LogId<u64>>,
    commit: Option<LogId<u64>>,
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
            acked: Arc::new(Mutex::new(None)),
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
    /// Sends one AppendEntries and waits for the answer — except a commit notice, which is
    /// acknowledged at once and delivered in the background.
    ///
    /// openraft 0.9 keeps one AppendEntries in flight per follower, and after each commit it
    /// sends one without entries that only carries the new commit index. A write arriving
    /// while that notice travels waits for its round trip first, so back-to-back writes paid
    /// about two quorum round trips each. A notice is recognised by what this client (the
    /// leader's replication stream to one target; it lives as long as the stream) last had
    /// acknowledged: same vote, same matching entry, no entries, a higher commit index. Its
    /// answer could only be success (nothing changes for the target) or news that the next
    /// AppendEntries brings anyway (a higher vote, a lost log); openraft uses it only to
    /// advance the target's progress, which it leaves where it is, and its ack time only in
    /// metrics. Leadership checks for reads (`get_read_log_id`) use fresh clients with
    /// nothing acknowledged, so they always wait for real answers. A notice that fails
    /// makes the next message go the normal way.
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<C>,
        option: RPCOption,
    ) -> Rpc<AppendEntriesResponse<u64>> {
        let notice = rpc.entries.is_empty()
            && self
                .acked
                .lock()
                .expect("acked lock")
                .as_ref()
                .is_some_and(|a| {
                    a.vote == rpc.vote
                        && a.matched == rpc.prev_log_id
                        && rpc.leader_commit > a.commit
                });
        if notice {
            let acked = Acked {
                vote: rpc.vote,
                matched: rpc.prev_log_id,
                commit: rpc.leader_commit,
            };
            *self.acked.lock().expect("acked lock") = Some(acked);
            let peer = self.clone();
            tokio::spawn(async move {
                let r: Rpc<AppendEntriesResponse<u64>> =
                    peer.send(RaftKind::AppendEntries, &rpc, &option).await;
                if !matches!(r, Ok(AppendEntriesResponse::Success)) {
                    *peer.acked.lock().expect("acked lock") = None;
                }
            });
            return Ok(AppendEntriesResponse::Success);
        }
        let matched = rpc
            .entries
            .last()
            .map(|e| *e.get_log_id())
            .or(rpc.prev_log_id);
        let key = Acked {
            vote: rpc.vote,
            matched,
            commit: rpc.leader_commit,
        };
        let r = self.send(RaftKind::AppendEntries, &rpc, &option).await;
        *self.acked.lock().expect("acked lock") = match &r {
            Ok(AppendEntriesResponse::Success) => Some(key),
            _ => None,
        };
        r
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
