//! The meta Raft group: the cluster's replicated, durable metadata.
//!
//! Every node runs one member of it (openraft): a few voters spread over regions
//! ([`mr_meta::placement`]), the other nodes learners. This module gives the rest of pgmr
//! three things:
//!
//! * [`Meta::propose`]: a metadata change that returns once committed and applied, with its
//!   outcome. Proposals carry a client id and sequence number, so a proposal retried after a
//!   leader change applies once (the state machine remembers each client's last outcome).
//! * [`Meta::linearizable`]: a read barrier (Raft read-index): the leader confirms it still
//!   leads with a quorum round and names its commit index; this node waits until it has
//!   applied that far. A read after it reflects every write acknowledged before it began.
//! * [`Meta::reconcile`] on the leader: adds joined nodes as learners, keeps the voter set
//!   as placement wants it (joint consensus, one change at a time) and drops decommissioned
//!   nodes.

pub mod network;
pub mod ranges;
pub mod store;
pub mod types;

use crate::net::{RpcError, Transport};
use anyhow::{Context, Result};
use mr_meta::placement::{choose_voters, Candidate};
use mr_meta::{ClientId, Command, MetaState, NodeStatus, Outcome, Proposal};
use mr_wire::peer::{PeerRequest, PeerResponse, RaftKind};
use openraft::error::{ClientWriteError, RaftError};
use openraft::{ChangeMembers, Config, ServerState, SnapshotPolicy};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
pub use store::Applied;
pub use types::{MetaNode, Raft};

/// Heartbeats from the leader; also the deadline of one AppendEntries round trip, so it must
/// exceed the slowest simulated inter-region RTT (132 ms) with room for an fsync.
const RAFT_HEARTBEAT_MS: u64 = 400;
/// A follower that hears no leader for a random time in this range starts an election.
const ELECTION_TIMEOUT_MS: (u64, u64) = (1500, 3000);
/// One forwarded attempt at a proposal or read index; a bit more than the longest election
/// timeout, so a proposal outlives one election before it is re-sent.
const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(3500);
/// A learner is promoted to voter only once it is at most this many entries behind.
const PROMOTE_WITHIN: u64 = 100;

/// Why a proposal or read failed.
#[derive(Debug, thiserror::Error)]
pub enum MetaUnavailable {
    /// Nothing was applied; the same request may be sent again.
    #[error("the metadata group has no reachable leader ({0}); nothing was changed")]
    Retryable(String),
    /// The proposal reached a leader but no answer came back in time: it may have committed
    /// or not. Retrying it with the same client id and sequence is safe, which this module
    /// does until the deadline.
    #[error("the outcome of the metadata change is unknown ({0})")]
    Ambiguous(String),
}

pub struct Meta {
    pub raft: Raft,
    applied: Arc<Applied>,
    me: u64,
    transport: Transport,
    /// Idle proposer sessions: (client, next sequence number). A proposal takes one, so each
    /// session has at most one proposal in flight, as exactly-once needs.
    sessions: Mutex<Vec<(ClientId, u64)>>,
    /// Ranges to drop whose seal has failed, since when (the leader's upkeep, [`ranges`]).
    unsealed: Mutex<BTreeMap<u64, Instant>>,
}

/// `p` as the leader appends it: a liveness heartbeat carries the leader's clock, not its
/// sender's, so that a node whose clock runs ahead cannot record beats in the future and
/// look alive after it stops. Readers compare it with their own clocks, which
/// `membership::clock_out_of_bounds` keeps within a second of most others'.
fn stamped(mut p: Proposal) -> Proposal {
    if let Command::Heartbeat { at_ms, .. } = &mut p.command {
        *at_ms = crate::node::now_ms();
    }
    p
}

impl Meta {
    /// Opens the store in `dir` and starts this node's Raft member.
    pub async fn start(dir: &Path, me: u64, transport: Transport) -> Result<Arc<Meta>> {
        let (log, sm, applied) = store::open(dir).context("cannot open the metadata store")?;
        let config = Config {
            cluster_name: "pgmr-meta".into(),
            heartbeat_interval: RAFT_HEARTBEAT_MS,
            election_timeout_min: ELECTION_TIMEOUT_MS.0,
            election_timeout_max: ELECTION_TIMEOUT_MS.1,
            install_snapshot_timeout: 5_000,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(store::SNAPSHOT_EVERY),
            max_in_snapshot_log_to_keep: store::SNAPSHOT_EVERY,
            ..Config::default()
        }
        .validate()
        .context("bad Raft configuration")?;
        let net = network::Network::new(transport.clone(), network::META_GROUP);
        let raft = Raft::new(me, Arc::new(config), net, log, sm)
            .await
            .context("cannot start the metadata Raft member")?;
        Ok(Arc::new(Meta {
            raft,
            applied,
            me,
            transport,
            sessions: Mutex::new(Vec::new()),
            unsealed: Mutex::new(BTreeMap::new()),
        }))
    }

    /// Makes this node the first member of a new group, if the group was never initialized
    /// here. Safe to repeat after a crash at any point of bootstrapping.
    pub async fn bootstrap(&self, node: MetaNode) -> Result<()> {
        if !self.raft.is_initialized().await? {
            let members = BTreeMap::from([(self.me, node)]);
            self.raft.initialize(members).await?;
        }
        Ok(())
    }

    /// Reads the applied state as it is now on this node; see [`Meta::linearizable`].
    pub fn read<R>(&self, f: impl FnOnce(&MetaState) -> R) -> R {
        self.applied.read(f)
    }

    pub fn metrics(&self) -> openraft::RaftMetrics<u64, MetaNode> {
        self.raft.metrics().borrow().clone()
    }

    fn leader(&self) -> Option<(u64, Option<String>)> {
        let m = self.metrics();
        let id = m.current_leader?;
        let addr = m
            .membership_config
            .membership()
            .get_node(&id)
            .map(|n| n.rpc_addr.clone());
        Some((id, addr))
    }

    /// Proposes `command` and waits until it is committed and applied, or `timeout` passes.
    /// A liveness heartbeat's time is the leader's ([`stamped`]).
    pub async fn propose(
        &self,
        command: Command,
        timeout: Duration,
    ) -> Result<Outcome, MetaUnavailable> {
        let (client, seq) = self.take_session();
        let p = Proposal {
            client,
            seq,
            command,
        };
        let result = self.submit(&p, Instant::now() + timeout).await;
        // The session can be reused whatever happened: its next proposal has a higher
        // sequence number, so a late commit of this one can no longer be confused with it.
        self.sessions
            .lock()
            .expect("sessions lock")
            .push((client, seq + 1));
        result
    }

    fn take_session(&self) -> (ClientId, u64) {
        if let Some(s) = self.sessions.lock().expect("sessions lock").pop() {
            return s;
        }
        let client = ClientId {
            node_id: self.me,
            incarnation: rand::random::<u64>() | 1,
        };
        (client, 1)
    }

    /// Sends `p` to the leader, following leader changes, until it is applied or the
    /// deadline passes. Every attempt is the same (client, seq), so at most one applies.
    pub async fn submit(
        &self,
        p: &Proposal,
        deadline: Instant,
    ) -> Result<Outcome, MetaUnavailable> {
        let mut maybe_sent = false;
        let mut last = String::from("no leader is known to this node");
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(if maybe_sent {
                    MetaUnavailable::Ambiguous(last)
                } else {
                    MetaUnavailable::Retryable(last)
                });
            }
            match self.leader() {
                None => {}
                Some((id, _)) if id == self.me => {
                    maybe_sent = true;
                    let attempt = remaining.min(ATTEMPT_TIMEOUT);
                    match tokio::time::timeout(attempt, self.raft.client_write(stamped(p.clone())))
                        .await
                    {
                        Ok(Ok(resp)) => return Ok(resp.data),
                        Ok(Err(e)) => last = e.to_string(),
                        Err(_) => last = "timed out waiting for commit".into(),
                    }
                }
                Some((id, None)) => last = format!("leader {id} has no known address"),
                Some((id, Some(addr))) => {
                    let req = PeerRequest::MetaPropose {
                        proposal: serde_json::to_value(p).expect("proposals serialize"),
                    };
                    // A bounded attempt: a leader cut off mid-call is replaced by a new one
                    // within an election timeout, and the retry should go there.
                    let attempt = remaining.min(ATTEMPT_TIMEOUT);
                    match self.transport.call(&addr, req, attempt).await {
                        Ok(PeerResponse::Proposed { outcome }) => {
                            return serde_json::from_value(outcome).map_err(|e| {
                                MetaUnavailable::Ambiguous(format!("undecodable outcome: {e}"))
                            });
                        }
                        Ok(PeerResponse::NotLeader { .. }) => {
                            maybe_sent = true;
                            last = format!("node {id} is no longer the leader");
                        }
                        Ok(other) => {
                            maybe_sent = true;
                            last = format!("node {id} answered {other:?}");
                        }
                        Err(e @ (RpcError::Dial { .. } | RpcError::Handshake { .. })) => {
                            last = e.to_string()
                        }
                        Err(e) => {
                            maybe_sent = true;
                            last = e.to_string();
                        }
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Serves a proposal forwarded by another node.
    pub async fn serve_propose(&self, proposal: serde_json::Value) -> PeerResponse {
        let p: Proposal = match serde_json::from_value(proposal) {
            Ok(p) => p,
            Err(e) => {
                return PeerResponse::Error {
                    message: format!("malformed proposal: {e}"),
                    retryable: false,
                }
            }
        };
        match self.raft.client_write(stamped(p)).await {
            Ok(resp) => PeerResponse::Proposed {
                outcome: serde_json::to_value(resp.data).expect("outcomes serialize"),
            },
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                PeerResponse::NotLeader {
                    leader_id: f.leader_id,
                    leader_addr: f.leader_node.map(|n| n.rpc_addr),
                }
            }
            Err(e) => PeerResponse::Error {
                message: e.to_string(),
                retryable: true,
            },
        }
    }

    /// Waits until this node has applied every write committed before the call: the leader
    /// confirms its leadership with a quorum and names its commit index (read-index), then
    /// this node waits to apply that far.
    pub async fn linearizable(&self, timeout: Duration) -> Result<(), MetaUnavailable> {
        let deadline = Instant::now() + timeout;
        let mut last = String::from("no leader is known to this node");
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(MetaUnavailable::Retryable(last));
            }
            let index = match self.leader() {
                None => None,
                Some((id, _)) if id == self.me => {
                    let attempt = remaining.min(ATTEMPT_TIMEOUT);
                    match tokio::time::timeout(attempt, self.raft.get_read_log_id()).await {
                        Ok(Ok((read, _))) => Some(read.map_or(0, |l| l.index)),
                        Ok(Err(e)) => {
                            last = e.to_string();
                            None
                        }
                        Err(_) => {
                            last = "leadership not confirmed in time".into();
                            None
                        }
                    }
                }
                Some((id, None)) => {
                    last = format!("leader {id} has no known address");
                    None
                }
                Some((id, Some(addr))) => {
                    let attempt = remaining.min(ATTEMPT_TIMEOUT);
                    match self
                        .transport
                        .call(&addr, PeerRequest::MetaReadIndex, attempt)
                        .await
                    {
                        Ok(PeerResponse::ReadIndex { index }) => Some(index),
                        Ok(other) => {
                            last = format!("node {id} answered {other:?}");
                            None
                        }
                        Err(e) => {
                            last = e.to_string();
                            None
                        }
                    }
                }
            };
            if let Some(index) = index {
                let remaining = deadline.saturating_duration_since(Instant::now());
                return match self
                    .raft
                    .wait(Some(remaining))
                    .applied_index_at_least(Some(index), "read index")
                    .await
                {
                    Ok(_) => Ok(()),
                    Err(e) => Err(MetaUnavailable::Retryable(format!(
                        "this node has not applied up to the read index {index}: {e}"
                    ))),
                };
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn serve_read_index(&self) -> PeerResponse {
        match self.raft.get_read_log_id().await {
            Ok((read, _)) => PeerResponse::ReadIndex {
                index: read.map_or(0, |l| l.index),
            },
            Err(e) => match e.forward_to_leader() {
                Some(f) => PeerResponse::NotLeader {
                    leader_id: f.leader_id,
                    leader_addr: f.leader_node.clone().map(|n| n.rpc_addr),
                },
                None => PeerResponse::Error {
                    message: e.to_string(),
                    retryable: true,
                },
            },
        }
    }

    /// The leader's view of each member's replication.
    pub async fn serve_progress(&self) -> PeerResponse {
        let m = self.metrics();
        if m.state != ServerState::Leader {
            return PeerResponse::NotLeader {
                leader_id: m.current_leader,
                leader_addr: None,
            };
        }
        let matched = m
            .replication
            .unwrap_or_default()
            .into_iter()
            .map(|(id, l)| (id, l.map(|l| l.index)))
            .collect();
        PeerResponse::MetaProgress {
            term: m.current_term,
            last_log_index: m.last_log_index.unwrap_or(0),
            matched,
        }
    }

    /// Hands a Raft message from a peer to this node's member.
    pub async fn serve_raft(
        &self,
        to: u64,
        kind: RaftKind,
        body: serde_json::Value,
    ) -> PeerResponse {
        if to != self.me {
            return PeerResponse::Error {
                message: format!(
                    "this is node {}, not node {to} (the address was reused by a new node)",
                    self.me
                ),
                retryable: false,
            };
        }
        fn answer<T: serde::Serialize>(r: T) -> PeerResponse {
            PeerResponse::Raft {
                body: serde_json::to_value(r).expect("Raft responses serialize"),
            }
        }
        fn bad(e: serde_json::Error) -> PeerResponse {
            PeerResponse::Error {
                message: format!("malformed Raft message: {e}"),
                retryable: false,
            }
        }
        match kind {
            RaftKind::AppendEntries => match serde_json::from_value(body) {
                Ok(req) => answer(self.raft.append_entries(req).await),
                Err(e) => bad(e),
            },
            RaftKind::Vote => match serde_json::from_value(body) {
                Ok(req) => answer(self.raft.vote(req).await),
                Err(e) => bad(e),
            },
            RaftKind::InstallSnapshot => match serde_json::from_value(body) {
                Ok(req) => answer(self.raft.install_snapshot(req).await),
                Err(e) => bad(e),
            },
        }
    }

    /// One pass of the leader's membership upkeep; does nothing on other nodes. Makes at most
    /// one membership change per pass, so each change commits before the next is decided.
    pub async fn reconcile(&self, now_ms: u64) -> Result<()> {
        let m = self.metrics();
        if m.state != ServerState::Leader {
            return Ok(());
        }
        let membership = m.membership_config.membership().clone();
        if membership.get_joint_config().len() > 1 {
            return Ok(()); // a joint configuration is still being committed
        }
        let voters: BTreeSet<u64> = membership.voter_ids().collect();
        let members: BTreeSet<u64> = membership.nodes().map(|(id, _)| *id).collect();
        let nodes: Vec<mr_meta::NodeRecord> = self.read(|s| s.nodes().cloned().collect());

        // 1. Joined nodes become learners.
        if let Some(n) = nodes
            .iter()
            .find(|n| !n.decommissioned && !members.contains(&n.node_id))
        {
            let node = MetaNode {
                rpc_addr: n.rpc_addr.clone(),
                locality: n.locality.clone(),
            };
            tracing::info!(
                node_id = n.node_id,
                "adding node to the metadata group as a learner"
            );
            self.raft.add_learner(n.node_id, node, false).await?;
            return Ok(());
        }

        // 2. Voters as placement wants them.
        let last = m.last_log_index.unwrap_or(0);
        let matched = m.replication.clone().unwrap_or_default();
        let caught_up = |id: u64| {
            id == self.me
                || matched
                    .get(&id)
                    .and_then(|l| l.map(|l| l.index))
                    .is_some_and(|i| last.saturating_sub(i) <= PROMOTE_WITHIN)
        };
        let candidates: Vec<Candidate> = nodes
            .iter()
            .filter(|n| members.contains(&n.node_id))
            .map(|n| {
                let status = n.status(now_ms);
                let region = mr_topology::Locality::parse(&n.locality)
                    .map(|l| l.region().to_string())
                    .unwrap_or_default();
                let eligible = matches!(status, NodeStatus::Live | NodeStatus::Suspect)
                    && (voters.contains(&n.node_id) || caught_up(n.node_id));
                Candidate {
                    node_id: n.node_id,
                    region,
                    eligible,
                }
            })
            .collect();
        let want = choose_voters(&candidates, &voters);
        if want != voters {
            tracing::info!(from = ?voters, to = ?want, "changing the metadata group's voters");
            self.raft
                .change_membership(ChangeMembers::ReplaceAllVoters(want), true)
                .await?;
            return Ok(());
        }

        // 3. Decommissioned nodes leave the group entirely.
        let gone: BTreeSet<u64> = nodes
            .iter()
            .filter(|n| {
                n.decommissioned && members.contains(&n.node_id) && !voters.contains(&n.node_id)
            })
            .map(|n| n.node_id)
            .collect();
        if !gone.is_empty() {
            tracing::info!(nodes = ?gone, "removing decommissioned nodes from the metadata group");
            self.raft
                .change_membership(ChangeMembers::RemoveNodes(gone), false)
                .await?;
        }
        Ok(())
    }
}
