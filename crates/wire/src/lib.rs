//! The messages pgmr exchanges, and how they are framed.
//!
//! Two channels use the same framing (a 4-byte big-endian length, then a JSON document):
//!
//! * the **local channel** ([`local`]): a PostgreSQL backend (the extension) asks its node's
//!   pgmr over a Unix socket; one response per request, on a connection the backend keeps;
//! * **inter-node RPC** ([`peer`]): pgmr to pgmr over TCP; a connection starts with a mutual
//!   HMAC handshake ([`auth`]) and then carries multiplexed requests and responses tagged with
//!   ids, so that heartbeats, the meta Raft group, range Raft groups and forwarded statements
//!   can share one connection per peer without head-of-line waits on each other's replies.
//!
//! This crate must never depend on pgrx or tokio: the extension links it into PostgreSQL
//! backends, and its blocking client ([`framing::call_local`]) is written against `std` only.

pub mod auth;
pub mod framing;
pub mod local;
pub mod peer;

/// Bumped whenever a message changes incompatibly; peers with another version are refused at
/// the handshake with an error that names both versions. 2: `ForwardRequest.turn`, which a
/// peer that ignored it would leave untaken (a serializability hole, not a missing feature).
/// 3: range logs carry `Forget` entries, which a pgmr of version 2 cannot decode, and the
/// forget's own messages (`PeerRequest::ForgetDecisions`, `Forwarded::prepared_ranges`).
/// 4: `LocalResponse::PrepareFailed`, a failed prepare's answer, which a coordinator of
/// version 3 could not decode, and `FinishPrepared::record`.
/// 5: forget plans in `Decide` entries and `TxnDecision`, and `Forget { plans_only }`, which a
/// pgmr of version 4 would read as forgetting the records too.
/// 6: `ForgetPlan::commit_by_ms` and presumed entries, which a pgmr of version 5 would ignore:
/// its replicas would record commit where others record abort, and it would forget a
/// presumed abort after two minutes.
/// 7: `ForwardStatement::crosscheck` and `DeferredStatement::crosscheck`, which a pgmr of
/// version 6 would drop: a referential query would run with the transaction's snapshot and a
/// key be removed under a row committed since. And `Gossip::now_ms` (clock offsets).
/// 8: `DeferredStatement::at_commit` and `guard`, which a pgmr of version 7 would drop: an
/// INITIALLY DEFERRED key's check would run right after the statement.
pub const PROTOCOL_VERSION: u32 = 8;

/// Largest frame either side accepts. A longer length prefix closes the connection: it is
/// either a bug or an attack, and buffering it would let one peer exhaust memory.
pub const MAX_FRAME_LEN: usize = 16 << 20;

/// Largest frame on the local channel between the extension and its own pgmr (same host,
/// same trust): a transaction's whole write set travels in one request.
pub const MAX_LOCAL_FRAME_LEN: usize = 256 << 20;

/// The pgmr release, reported by `node_info()` and in handshakes.
pub const PGMR_VERSION: &str = env!("CARGO_PKG_VERSION");
