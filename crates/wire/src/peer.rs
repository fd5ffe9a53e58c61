//! Inter-node RPC messages.
//!
//! A connection carries [`PeerFrame`]s: first the handshake (`Hello`, then `Proof`), then
//! `Request`/`Response` pairs matched by id. Either side may send requests on a connection
//! it accepted or dialled. New message kinds (Raft, range traffic, forwarded statements) are
//! added as new variants of [`PeerRequest`]/[`PeerResponse`]; a peer that receives a variant
//! it does not know answers with [`PeerResponse::Error`] instead of dropping the connection.

use serde::{Deserialize, Serialize};

/// What a two-phase commit's decision leaves to forget once it is decided (ARCHITECTURE.md
/// §8.5, "Forgetting decisions"): the coordinator proposes it with its decision, so the
/// anchor's log keeps it beside the record and the anchor's leader can drive the forget
/// itself when the coordinator does not (it restarted, or gave up on a part for a while).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForgetPlan {
    /// The database the parts' prepared transactions are in.
    pub database: String,
    /// Part ranges (not the anchor) whose logs must hold the decision first.
    pub parts: Vec<u64>,
    /// Nodes with a prepared part, and whether it wrote `Prepare` entries there.
    pub nodes: Vec<(u64, bool)>,
    /// A part may have written where nobody knows: only the parts' records go.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep_anchor: bool,
    /// When the coordinator began deciding (its clock, Unix ms; 0: not known). Its proposal
    /// reaching the anchor much later is a stale frame of a coordinator that no longer
    /// waits for it (its client had 40003), and decides abort there: so no commit can be
    /// recorded after an abort it was answered is forgotten.
    #[serde(default)]
    pub since_ms: u64,
    /// The latest a commit proposal may reach the anchor (the coordinator's clock: when its
    /// commit began, its prepares, plus its commit limit; 0: none). One later decides abort,
    /// so a range may forget an abort recorded without a plan once that limit has passed
    /// since: no commit can follow it.
    #[serde(default)]
    pub commit_by_ms: u64,
}

/// How a node is known to its peers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeDescriptor {
    pub node_id: u64,
    pub rpc_addr: String,
    pub sql_addr: String,
    pub locality: String,
    pub pgmr_version: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum PeerFrame {
    Hello(Hello),
    Proof { mac: String },
    Request { id: u64, body: PeerRequest },
    Response { id: u64, body: PeerResponse },
}

/// First frame in each direction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub protocol_version: u32,
    /// `None` only for a node that has not joined yet.
    pub cluster_id: Option<String>,
    /// `None` only for a node that has not joined yet.
    pub node_id: Option<u64>,
    /// The sender's locality: the receiver needs its region to delay what it sends back.
    pub locality: String,
    /// 32 random bytes, hex; the peer's proof must cover it, so proofs cannot be replayed.
    pub nonce: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum PeerRequest {
    /// A new node asks for a node id and the current membership. `token` is random per
    /// joining attempt and stays the same across its retries, so a retry whose first try did
    /// commit gets the same node id instead of a second one.
    Join {
        rpc_addr: String,
        sql_addr: String,
        locality: String,
        #[serde(default)]
        token: u64,
    },
    /// A Raft message for node `to` in group `group` (0 is the meta group). The body is the
    /// Raft library's request, as JSON; node ids are checked so that a message meant for a
    /// node that was wiped and rejoined under a new id at the same address is refused.
    Raft {
        group: u64,
        to: u64,
        kind: RaftKind,
        body: serde_json::Value,
    },
    /// Proposes a metadata change (an `mr_meta::Proposal`) to the meta group's leader.
    MetaPropose { proposal: serde_json::Value },
    /// Asks the meta group's leader for a read index: confirmed leader, the log index a
    /// linearizable read must wait for.
    MetaReadIndex,
    /// Asks the meta group's leader for each member's replication progress.
    MetaProgress,
    /// Asks a range's leader for a read index (leadership confirmed by a quorum):
    /// [`PeerResponse::ReadIndex`] or [`PeerResponse::NotLeader`].
    RangeReadIndex { range_id: u64 },
    /// A checksum of this node's rows of a range at its applied index:
    /// [`PeerResponse::RangeChecksum`].
    RangeChecksum { range_id: u64 },
    /// One row of a range as its leaseholder holds it (a region dropped while a REGIONAL BY
    /// ROW partition still has rows): [`PeerResponse::RangeSample`].
    RangeSample { range_id: u64 },
    /// This node's range replicas' progress: answered with [`PeerResponse::RangeProgress`].
    RangeProgress,
    /// This node's SQL gateway statement latencies over time (the console's chart):
    /// answered with [`PeerResponse::SqlLatency`].
    SqlLatency,
    /// Asks the leaseholder of range `from` (a table's whole range) for the rows of its table
    /// that belong to REGIONAL BY ROW partition `partition`, once it has applied every entry
    /// of `from` and the database's schema version `schema_version` (the table's split):
    /// [`PeerResponse::SeedRows`]. The bootstrapper of the partition's new range asks.
    RangeSeed {
        from: u64,
        schema: String,
        table: String,
        /// The partition of `table` whose rows are asked for; `None`: the whole table (a key
        /// table, seeded from its copy on the leaseholder of the table it keeps keys of).
        #[serde(default)]
        partition: Option<String>,
        schema_version: u64,
        /// Where the previous chunk ended (`SeedRows::next`); `None`: from the start.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after: Option<String>,
        /// The rows `partition` had here when the table stopped being REGIONAL BY ROW (a
        /// merge), rather than the partition's rows now (a split).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        merge: bool,
    },
    /// Runs one step of a transaction forwarded by the calling node (its statements on rows
    /// this node leases): [`PeerResponse::Exec`].
    Exec(Box<crate::local::ForwardRequest>),
    /// The calling node's forwarded sessions that are still in use: the others of that node
    /// are rolled back.
    ExecKeepalive { sessions: Vec<String> },
    /// The decision of a two-phase commit whose decision is recorded in range `anchor` (asked
    /// of its leaseholder): [`PeerResponse::TxnDecision`] or [`PeerResponse::NotLeader`]. With
    /// `propose`, an undecided transaction is decided so first (the first decision in the
    /// anchor's log wins): the coordinator proposes commit, anyone else abort, so a
    /// coordinator that died cannot leave participants waiting.
    TxnDecision {
        anchor: u64,
        gid: String,
        propose: Option<bool>,
        /// `anchor` is a part range being given a copy of the decision in `propose`, not the
        /// range that decides: refused once it is sealed or gone (only an anchor's sealing
        /// node answers for a dropped range, and only for its own decisions).
        #[serde(default)]
        copy: bool,
        /// With the coordinator's own proposal: what its decision leaves to forget, recorded
        /// with it in the anchor's log ([`ForgetPlan`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        plan: Option<ForgetPlan>,
    },
    /// Whether this node is coordinating two-phase commit `gid` now (its prepares or its
    /// decision under way): [`PeerResponse::TxnCoordinating`]. Asked before a participant
    /// decides abort for a transaction whose decision is late, so that a slow coordinator
    /// (a large transaction on a loaded machine) is waited for, and only a gone one is not.
    TxnCoordinating { gid: String },
    /// Closes range `range_id`'s log before the range is dropped (asked of its leaseholder
    /// by the meta leader): a final `Seal` entry, after which no two-phase commit can be
    /// decided in the range; answered with [`PeerResponse::Sealed`] once this node has applied
    /// it (and so holds every decision the range recorded, durably) or `NotLeader`.
    SealRange { range_id: u64 },
    /// Forgets committed two-phase commits `gids` in range `range_id` (asked of its leader by
    /// their coordinator, once nothing can need their decision there again: ARCHITECTURE.md
    /// §8.5): a `Forget` entry, proposed and answered with [`PeerResponse::Forgotten`], or
    /// `NotLeader`.
    ForgetDecisions {
        range_id: u64,
        gids: Vec<String>,
        /// Only the anchor's plans go, not the records (a part could not be confirmed): an
        /// abort's plan becomes presumed, forgotten once no commit can follow.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        plans_only: bool,
    },
    /// Commits (or rolls back) this node's prepared transaction `name` in `database`, after
    /// the decision: [`PeerResponse::Exec`] with `Done`, or an error.
    FinishPrepared {
        database: String,
        name: String,
        commit: bool,
        /// The node records the decision first: its part wrote `Prepare` entries there,
        /// which its appliers pass on that record. A part that only locked rows has none,
        /// and a record there would be one nothing forgets.
        record: bool,
    },
    /// Answers once this node's copy of the meta state holds `database`'s schema version
    /// `version` (at most `timeout_ms`): [`PeerResponse::SchemaKnown`]. A node whose lock on a
    /// reshaped table is about to be released must refuse rows written under older versions
    /// from then on (docs/ARCHITECTURE.md §8.6).
    AwaitSchemaKnown {
        database: String,
        version: u64,
        timeout_ms: u64,
    },
    /// Periodic liveness probe that also gossips membership and measured RTTs.
    Heartbeat(Gossip),
    #[serde(other)]
    Unknown,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum PeerResponse {
    Joined {
        node_id: u64,
        cluster_id: String,
        members: Vec<NodeDescriptor>,
    },
    /// This node cannot allocate ids; ask the node at `rpc_addr` instead.
    Redirect {
        rpc_addr: String,
    },
    HeartbeatAck(Gossip),
    /// A Raft library response (`Result<Response, RaftError>`), as JSON.
    Raft {
        body: serde_json::Value,
    },
    /// This node is not the meta group's leader; the leader, if known, is given.
    NotLeader {
        leader_id: Option<u64>,
        leader_addr: Option<String>,
    },
    /// The proposal committed and applied; `outcome` is its `mr_meta::Outcome`.
    Proposed {
        outcome: serde_json::Value,
    },
    ReadIndex {
        index: u64,
    },
    MetaProgress {
        term: u64,
        last_log_index: u64,
        /// (node id, highest log index known replicated to it).
        matched: Vec<(u64, Option<u64>)>,
    },
    RangeProgress {
        ranges: Vec<crate::local::RangeProgress>,
    },
    SqlLatency {
        region: String,
        windows: Vec<SqlWindow>,
    },
    RangeChecksum {
        applied_index: u64,
        row_count: u64,
        checksum: String,
    },
    /// A row of the range as text (`t::text`), or none if it has no rows.
    RangeSample {
        row: Option<String>,
    },
    /// What a forwarded step did: a `LocalResponse::Forwarded` or `LocalResponse::SqlError`.
    Exec {
        response: Box<crate::local::LocalResponse>,
    },
    /// Rows for a new range, one chunk: one `to_jsonb` text per line.
    SeedRows {
        rows: String,
        /// Where the next chunk starts (ask again with `after`); `None`: that was the last.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        next: Option<String>,
    },
    /// Whether the version asked for is known here now.
    SchemaKnown {
        known: bool,
    },
    /// Whether the node is coordinating the two-phase commit asked about.
    TxnCoordinating {
        coordinating: bool,
    },
    /// A two-phase commit's decision (`None`: not decided yet).
    TxnDecision {
        decision: Option<bool>,
    },
    /// A `Forget` entry was committed in the range (or nothing was to be forgotten there: the
    /// range is sealed).
    Forgotten,
    /// The range is sealed, and this node applied the seal.
    Sealed {
        node_id: u64,
    },
    Error {
        message: String,
        retryable: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RaftKind {
    AppendEntries,
    Vote,
    InstallSnapshot,
}

/// What a heartbeat (and its ack) carries: the sender, the nodes it knows, and the RTTs it has
/// measured to them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gossip {
    pub from: NodeDescriptor,
    pub members: Vec<NodeDescriptor>,
    pub rtts: Vec<MeasuredRtt>,
    /// The sender's wall clock (Unix ms) when it wrote this: a heartbeat's ack gives the
    /// prober its offset from the peer's clock, within half the round trip.
    #[serde(default)]
    pub now_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MeasuredRtt {
    pub to_node: u64,
    pub rtt_ms: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_request_kinds_decode_instead_of_failing() {
        let f: PeerFrame =
            serde_json::from_str(r#"{"type":"request","id":7,"body":{"type":"raft_vote"}}"#)
                .unwrap();
        assert_eq!(
            f,
            PeerFrame::Request {
                id: 7,
                body: PeerRequest::Unknown
            }
        );
    }

    #[test]
    fn a_seed_request_and_answer_from_before_chunks_decode_as_the_whole_seed() {
        let r: PeerRequest = serde_json::from_str(
            r#"{"type":"range_seed","from":1,"schema":"public","table":"t","partition":"us-east1","schema_version":4}"#,
        )
        .unwrap();
        assert!(matches!(
            r,
            PeerRequest::RangeSeed {
                after: None,
                merge: false,
                ..
            }
        ));
        let a: PeerResponse =
            serde_json::from_str(r#"{"type":"seed_rows","rows":"{\"id\": 1}\n"}"#).unwrap();
        assert!(matches!(a, PeerResponse::SeedRows { next: None, .. }));
    }
}

/// The SQL statements a gateway finished in one 10-second window, as a histogram: `counts[i]`
/// statements took up to bucket `i`'s bound (pgmr's `stats` module defines the buckets).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SqlWindow {
    /// Unix ms the window starts at.
    pub start_ms: u64,
    pub counts: Vec<u32>,
}
