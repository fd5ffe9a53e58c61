//! Two-phase commit through the ranges' logs (ARCHITECTURE.md §8.5).
//!
//! A transaction over several ranges writes a `Prepare` entry with its rows into each of them
//! and then its decision, a `Decide` entry, into one range, the anchor: the first `Decide` for
//! a transaction in the anchor's log is its decision, whoever proposed it. The coordinator
//! proposes commit once every participant has prepared; anyone may propose abort for a
//! transaction whose coordinator went silent (a participant's applier waiting on its
//! `Prepare` entry, or the sweep of prepared PostgreSQL transactions), and the log orders the
//! two. Silent means no node says it is still coordinating the transaction: a coordinator
//! whose prepares are slow (a large transaction on a loaded machine) is waited for, up to
//! [`COORDINATOR_LIMIT`]. So a transaction is decided exactly once, durably (a quorum of the anchor's voters
//! holds the decision), and no participant waits on a dead coordinator for long.
//!
//! Participants are (a) the coordinating backend itself, whose changes to ranges this node
//! leases are prepared entries while the backend holds its row locks, and (b) the
//! transaction's sessions on other nodes (§9), which `PREPARE TRANSACTION` after their own
//! backend wrote their prepared entries: PostgreSQL then keeps their locks across a crash,
//! until `COMMIT PREPARED` or `ROLLBACK PREPARED` by the coordinator, the node's applier or
//! the sweep, whichever learns the decision first.

use super::{store, Group, Ranges, TxnKind, TxnMeta, TxnWrite, WriteError};
use mr_wire::local::{Finish, ForwardRequest, LocalResponse, LocalWrite, Participant, PrepareAs};
use mr_wire::peer::{ForgetPlan, PeerRequest, PeerResponse};
use sqlx::postgres::PgConnection;
use sqlx::{ConnectOptions, Connection, Row};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a decision is waited for before asking again or giving up.
const DECIDE_TIMEOUT: Duration = Duration::from_secs(10);
/// A prepared PostgreSQL transaction older than this is resolved by the sweep: its
/// coordinator decides within [`DECIDE_TIMEOUT`] of preparing, or not at all.
pub const SWEEP_AFTER: Duration = Duration::from_secs(20);
/// How long the commit phase waits for a participant before leaving it to the applier and
/// the sweep there.
const FINISH_TIMEOUT: Duration = Duration::from_secs(10);

/// A node whose part of a two-phase commit prepared (a PostgreSQL prepared transaction).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct PreparedNode {
    pub node: u64,
    /// It wrote `Prepare` entries there (it may have only locked rows).
    pub wrote: bool,
}

/// Whether [`Ranges::finish_prepared`] records the decision in this node's records.
#[derive(Clone, Copy, PartialEq)]
enum Record {
    /// First, on the coordinator's word, for a part that wrote `Prepare` entries here: its
    /// appliers pass them on this record.
    First,
    /// Only if the prepared transaction was still there to end (the sweep, on the anchor's
    /// answer): the sweep's list may be stale, and once its part has ended the transaction
    /// may be forgotten, the anchor's answer then a late abort recorded anew.
    IfEnded,
    /// Not at all: a part that only locked rows here has no entries for an applier to pass,
    /// and no range here whose `Forget` would take the record again.
    Never,
}
/// A coordinator's proposal that reaches its anchor this long after it began deciding is
/// stale: the coordinator stopped waiting for any answer long before (after
/// [`DECIDE_TIMEOUT`] and one more attempt), so the proposal decides abort (see
/// [`ForgetPlan::since_ms`]). The two times are two nodes' clocks: their offset must stay
/// well below this (a leader ahead by more than about 40 s would abort every commit
/// proposed to it from elsewhere).
pub const STALE_PROPOSAL: Duration = Duration::from_secs(60);
/// An abort is forgotten this long after a commit proposal it was answered to, or after its
/// plan's `Decide`: then no stale commit frame can follow its `Forget` and be recorded,
/// while any two nodes' clocks are within 30 s of each other (the coordinator's and the
/// proposing leader's offset, plus the forgetting and the proposing leaders').
pub const FORGET_ABORT_AFTER: Duration = Duration::from_secs(120);
/// A coordinator's commit proposal that reaches its anchor more than this after its commit
/// began (its prepares) decides abort ([`ForgetPlan::commit_by_ms`]): well past
/// [`COORDINATOR_LIMIT`] (after which the sweep aborts its parts anyway) and a forwarded
/// prepare's 600 s. It is what lets a range forget an abort recorded without a plan (a
/// sweep's, for a coordinator that died before proposing): no commit can follow it then.
const COMMIT_LIMIT: Duration = Duration::from_secs(720);

/// [`COMMIT_LIMIT`], or the testing knob `PGMR_COMMIT_LIMIT_SECS` (the cluster tests' way to
/// see presumed aborts forgotten; every node of a cluster must have the same).
pub fn commit_limit() -> Duration {
    static LIMIT: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::env::var("PGMR_COMMIT_LIMIT_SECS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&s| s > 0)
            .map_or(COMMIT_LIMIT, Duration::from_secs)
    })
}

/// An abort recorded without a coordinator's plan (a sweep's or an applier's, a copy, one
/// recorded anew after a `Forget`) is forgotten by its range this long after its `Decide`:
/// the commit limit and a margin for clocks, any two within 30 s (presumed abort).
pub fn forget_presumed_after() -> Duration {
    commit_limit() + STALE_PROPOSAL
}

/// When a commit beginning now must be decided by, for [`ForgetPlan::commit_by_ms`].
fn commit_by_ms() -> u64 {
    crate::node::now_ms() + commit_limit().as_millis() as u64
}

/// A transaction undecided this long is decided abort even while a node says it is still
/// coordinating it (a coordinator stuck that long holds its participants' locks no longer).
pub const COORDINATOR_LIMIT: Duration = Duration::from_secs(600);

/// Marks a two-phase commit as coordinated here for as long as it lives.
struct Coordinating<'a>(&'a Ranges, String);

impl<'a> Coordinating<'a> {
    fn new(r: &'a Ranges, gid: &str) -> Self {
        r.coordinating
            .lock()
            .expect("coordinating lock")
            .insert(gid.to_string());
        Coordinating(r, gid.to_string())
    }
}

impl Drop for Coordinating<'_> {
    fn drop(&mut self) {
        self.0
            .coordinating
            .lock()
            .expect("coordinating lock")
            .remove(&self.1);
    }
}

impl Ranges {
    /// Writes `groups`' entries as `Prepare` entries (in parallel) and, when coordinating
    /// (`prepare` is `None`: every range is leased here), the decision into the lowest range.
    pub(super) async fn replicate_prepared(
        &self,
        groups: Vec<(Arc<Group>, TxnWrite)>,
        txn_id: &str,
        prepare: Option<PrepareAs>,
    ) -> Result<Vec<(u64, u64)>, WriteError> {
        let coordinating = prepare.is_none();
        let _coordinating = coordinating.then(|| Coordinating::new(self, txn_id));
        let commit_by = commit_by_ms();
        let p = prepare.unwrap_or_else(|| PrepareAs {
            anchor: groups
                .iter()
                .map(|(g, _)| g.range_id)
                .min()
                .expect("at least one range"),
            gid: txn_id.to_string(),
        });
        // Every range proposed to, an ambiguous proposal's included (its entry may still
        // land): the decision is copied into each before the anchor forgets it. Noted first,
        // so that the part's answer names them even if it comes before the proposals end.
        let proposed: Vec<u64> = groups.iter().map(|(g, _)| g.range_id).collect();
        if !coordinating {
            self.note_prepared(&p.gid, proposed.iter().copied());
        }
        let proposals = groups.iter().map(|(g, e)| {
            let mut e = e.clone();
            e.kind = TxnKind::Prepare {
                anchor: p.anchor,
                gid: p.gid.clone(),
            };
            super::propose(g, e)
        });
        let results = futures::future::join_all(proposals).await;
        let mut entries = Vec::new();
        // Each range written once (a transaction's rows may be several entries of one
        // range): once the decision is known here it is copied into them, abort included.
        let mut written: Vec<Arc<Group>> = Vec::new();
        let mut failure: Option<WriteError> = None;
        for ((g, _), r) in groups.iter().zip(results) {
            match r {
                Ok((index, _)) => {
                    entries.push((g.range_id, index));
                    if !written.iter().any(|r| r.range_id == g.range_id) {
                        written.push(g.clone());
                    }
                }
                // An ambiguous failure says more than a plain one.
                Err(e) => {
                    if failure.is_none() || matches!(e, WriteError::Ambiguous(_)) {
                        failure = Some(e);
                    }
                }
            }
        }
        if !written.is_empty() {
            tokio::spawn(spread_decision(written.clone(), self.db.clone(), p.clone()));
        }
        if let Some(e) = failure {
            if !coordinating || entries.is_empty() && !matches!(e, WriteError::Ambiguous(_)) {
                return Err(e);
            }
            // Decide abort at once, so that no applier waits for the prepared entries; once
            // that decision stands the outcome is known, whatever the proposals did.
            let plan = local_plan(&p, &proposed, commit_by);
            return match self.decided(p.anchor, &p.gid, false, plan).await {
                Ok(Some(false)) => {
                    self.forget_later(&p, "", false, proposed, Vec::new(), false, Instant::now());
                    Err(match e {
                        WriteError::Ambiguous(m) => WriteError::Retryable(m),
                        other => other,
                    })
                }
                _ => Err(e),
            };
        }
        if !coordinating {
            return Ok(entries);
        }
        match self
            .decided(p.anchor, &p.gid, true, local_plan(&p, &proposed, commit_by))
            .await
        {
            Ok(Some(true)) => {
                self.forget_later(&p, "", true, proposed, Vec::new(), false, Instant::now());
                Ok(entries)
            }
            Ok(_) => {
                // Answered: this coordinator proposes nothing more, so the abort can go too
                // (once no stale frame of its commit proposal can arrive).
                let after = Instant::now() + FORGET_ABORT_AFTER;
                self.forget_later(&p, "", false, proposed, Vec::new(), false, after);
                Err(WriteError::Retryable(format!(
                    "transaction {} was decided aborted while it prepared (its coordinator seemed gone)",
                    p.gid
                )))
            }
            Err(e) => {
                // The decision may still commit: then every replica applies the entries,
                // this one included, and the ranges must not serve writes until it has.
                for (g, _) in &groups {
                    g.fence_at(g.raft.metrics().borrow().last_log_index.unwrap_or(0));
                }
                Err(WriteError::Ambiguous(e))
            }
        }
    }

    /// The decision for `gid`, recorded in range `anchor`: as this node knows it, else from
    /// the anchor's leaseholder, which first records `propose` if the transaction is not
    /// decided yet. `Ok(None)`: not decided (only when `propose` is `None`).
    pub(super) async fn decide(
        &self,
        anchor: u64,
        gid: &str,
        propose: Option<bool>,
    ) -> Result<Option<bool>, String> {
        if let Ok(Some(d)) = store::decision(&self.db, gid) {
            return Ok(Some(d));
        }
        self.ask_range(anchor, gid, propose, false, None).await
    }

    /// [`Self::decide`] by the transaction's coordinator, proposing `commit` with `plan`
    /// (what the decision leaves to forget, kept beside the anchor's record): the decision is
    /// then this node's record, on the coordinator's word (an abort read from a log never is:
    /// `store::DECISIONS`), which the part ranges it prepared in here copy
    /// (`spread_decision`).
    async fn decided(
        &self,
        anchor: u64,
        gid: &str,
        commit: bool,
        mut plan: ForgetPlan,
    ) -> Result<Option<bool>, String> {
        plan.since_ms = crate::node::now_ms();
        let d = match store::decision(&self.db, gid) {
            Ok(Some(d)) => Some(d),
            _ => {
                self.ask_range(anchor, gid, Some(commit), false, Some(&plan))
                    .await?
            }
        };
        // A commit is usually recorded already (from the anchor's log, when it is led here):
        // no write, and no sync, on the commit's path then.
        if let Some(d) =
            d.filter(|&d| !matches!(store::decision(&self.db, gid), Ok(Some(k)) if k == d))
        {
            let _ = store::learn_decision(&self.db, gid, d);
        }
        Ok(d)
    }

    /// Copies `gid`'s decision, `commit`, into part range `range`'s log (a `Decide` entry
    /// proposed by its leader, here or asked), unless its log recorded one already: that
    /// range's replicas then pass their `Prepare` entries on their own log. The answer is
    /// the range's record, which is the decision. Nothing is copied into a sealed or dropped
    /// range (`Ok(None)`): it takes no copies, and the node that sealed it answers only for
    /// its own decisions as an anchor.
    pub(super) async fn copy_decision(
        &self,
        range: u64,
        gid: &str,
        commit: bool,
    ) -> Result<Option<bool>, String> {
        if self.sealed_by(range).is_some() || !self.range_exists(range) {
            return Ok(None);
        }
        self.ask_range(range, gid, Some(commit), true, None).await
    }

    /// [`Self::decide`] without this node's record (the caller read it).
    pub(super) async fn ask(
        &self,
        anchor: u64,
        gid: &str,
        propose: Option<bool>,
    ) -> Result<Option<bool>, String> {
        self.ask_range(anchor, gid, propose, false, None).await
    }

    /// [`Self::decide`] without this node's record: the leader of range `anchor` answers (or
    /// the node that applied its seal, once it is dropped). `copy`: see
    /// [`Self::copy_decision`]. `plan`: see [`Self::decided`].
    async fn ask_range(
        &self,
        anchor: u64,
        gid: &str,
        propose: Option<bool>,
        copy: bool,
        plan: Option<&ForgetPlan>,
    ) -> Result<Option<bool>, String> {
        let deadline = Instant::now() + DECIDE_TIMEOUT;
        let mut last_error = String::from("no leaseholder known");
        loop {
            // A dropped anchor's decisions are answered for by the node that applied its seal.
            let sealed_by = self.sealed_by(anchor);
            if copy && sealed_by.is_some() {
                return Ok(None);
            }
            if sealed_by == Some(self.me) {
                return self.sealed_decision(anchor, gid).map(Some);
            }
            let local = self.group(anchor).filter(|_| sealed_by.is_none());
            if let Some(g) = local.as_ref().filter(|g| g.leading().is_some()) {
                if copy && matches!(store::sealed(&self.db, anchor), Ok(true)) {
                    return Ok(None);
                }
                // Forgotten here: the log holds the decision before the `Forget`.
                if let (true, Some(d)) = (copy, self.forgot_lately(anchor, gid)) {
                    return Ok(Some(d));
                }
                match self.decide_here(g, gid, propose, plan).await {
                    Ok(d) => return Ok(d),
                    Err(e) => last_error = e,
                }
            } else {
                let leader = sealed_by
                    .or_else(|| {
                        local
                            .as_ref()
                            .and_then(|g| g.raft.metrics().borrow().current_leader)
                            .filter(|&l| l != self.me)
                    })
                    .or_else(|| self.meta.read(|s| s.lease(anchor).map(|l| l.holder)))
                    .filter(|&l| l != self.me);
                let addr = leader.and_then(|l| self.node_addr(l));
                if let Some(addr) = addr {
                    let req = PeerRequest::TxnDecision {
                        anchor,
                        gid: gid.to_string(),
                        propose,
                        copy,
                        plan: plan.cloned(),
                    };
                    // The answer is not recorded here: only the coordinator's word is (see
                    // `store::DECISIONS`), and its callers record it where it is that.
                    match self.transport.call(&addr, req, DECIDE_TIMEOUT).await {
                        Ok(PeerResponse::TxnDecision { decision }) => return Ok(decision),
                        Ok(PeerResponse::Error { message, .. }) => last_error = message,
                        Ok(_) => {
                            last_error = format!("node {leader:?} does not lead range {anchor}")
                        }
                        Err(e) => last_error = e.to_string(),
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the decision of transaction {gid} (recorded in range {anchor}) is not known: {last_error}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether range `range_id` is in the meta group's descriptors (not dropped).
    pub(super) fn range_exists(&self, range_id: u64) -> bool {
        self.meta.read(|s| s.range(range_id).is_some())
    }

    /// The node that answers for the decisions of range `range_id`, if the range was dropped
    /// after its seal.
    pub(super) fn sealed_by(&self, range_id: u64) -> Option<u64> {
        self.meta.read(|s| {
            s.range(range_id)
                .is_none()
                .then(|| s.dropped_range(range_id).and_then(|d| d.sealed_by))
                .flatten()
        })
    }

    /// The decision of `gid` as the node that applied its dropped anchor's seal knows it:
    /// every decision the anchor recorded is in its records here (applied before the seal,
    /// in log order, synced with it, and kept after the replica went), and none can be
    /// recorded there any more, so a transaction without a commit is decided abort, for
    /// good. (One whose commit the anchor forgot before its seal reads abort here too: its
    /// parts' logs all hold the commit, which is what their replicas go by.)
    fn sealed_decision(&self, anchor: u64, gid: &str) -> Result<bool, String> {
        let read = |e: redb::Error| format!("reading a decision: {e}");
        // This node's record too: a commit is always the decision, and a range sealed and
        // removed before records outlived their replica has its commits only there.
        Ok(
            store::range_decision(&self.db, anchor, gid).map_err(read)? == Some(true)
                || store::decision(&self.db, gid).map_err(read)? == Some(true),
        )
    }

    /// Seals range `range_id` before the meta group drops it (the meta leader asks its
    /// leaseholder): a `Seal` entry, applied here before the answer, so this node holds
    /// every decision the range recorded.
    pub async fn serve_seal(&self, range_id: u64) -> PeerResponse {
        let Some(g) = self.group(range_id).filter(|g| g.leading().is_some()) else {
            return self.not_leader(range_id);
        };
        if !matches!(store::sealed(&self.db, range_id), Ok(true)) {
            let entry = TxnWrite {
                txn_id: format!("seal:{range_id}"),
                origin: 0,
                schema_version: 0,
                changes: "[]".into(),
                at_ms: crate::node::now_ms(),
                kind: TxnKind::Seal,
                chunk: None,
            };
            if let Err(
                WriteError::Retryable(m)
                | WriteError::Ambiguous(m)
                | WriteError::Unsupported { message: m, .. },
            ) = super::propose(&g, entry).await
            {
                return PeerResponse::Error {
                    message: format!("sealing range {range_id}: {m}"),
                    retryable: true,
                };
            }
        }
        tracing::info!(range_id, "sealed a range before its drop");
        PeerResponse::Sealed { node_id: self.me }
    }

    /// [`Self::decide`] on the anchor's leader. A `plan` is proposed even when the range
    /// decided already: it is the coordinator's last word, and what lets the range's leader
    /// drive the forget.
    async fn decide_here(
        &self,
        g: &Group,
        gid: &str,
        propose: Option<bool>,
        plan: Option<&ForgetPlan>,
    ) -> Result<Option<bool>, String> {
        let Some(commit) = propose else {
            let read = |e: redb::Error| e.to_string();
            return match store::range_decision(&self.db, g.range_id, gid).map_err(read)? {
                Some(d) => Ok(Some(d)),
                None => store::decision(&self.db, gid).map_err(read),
            };
        };
        // The range's log decided already (its first `Decide` for `gid` is its record).
        if let Ok(Some(d)) = store::range_decision(&self.db, g.range_id, gid) {
            if plan.is_none() {
                return Ok(Some(d));
            }
        }
        let entry = TxnWrite {
            txn_id: gid.to_string(),
            origin: self.me,
            schema_version: 0,
            changes: "[]".into(),
            at_ms: crate::node::now_ms(),
            kind: TxnKind::Decide {
                gid: gid.to_string(),
                commit,
                plan: plan.cloned(),
            },
            chunk: None,
        };
        match super::propose(g, entry).await {
            Ok((_, decision)) => Ok(decision),
            Err(WriteError::Retryable(m) | WriteError::Ambiguous(m)) => Err(m),
            Err(WriteError::Unsupported { message, .. }) => Err(message),
        }
    }

    /// A peer asks for (or proposes) a decision recorded in a range this node may lead, or
    /// (`copy`) has a decision copied into a part range this node may lead.
    pub async fn serve_decision(
        &self,
        anchor: u64,
        gid: String,
        propose: Option<bool>,
        copy: bool,
        plan: Option<ForgetPlan>,
    ) -> PeerResponse {
        if copy
            && (self.sealed_by(anchor).is_some()
                || !self.range_exists(anchor)
                || matches!(store::sealed(&self.db, anchor), Ok(true)))
        {
            return PeerResponse::TxnDecision { decision: None };
        }
        if self.sealed_by(anchor) == Some(self.me) {
            return match self.sealed_decision(anchor, &gid) {
                Ok(d) => PeerResponse::TxnDecision { decision: Some(d) },
                Err(message) => PeerResponse::Error {
                    message,
                    retryable: true,
                },
            };
        }
        if let (true, Some(d)) = (copy, self.forgot_lately(anchor, &gid)) {
            return PeerResponse::TxnDecision { decision: Some(d) };
        }
        match self.group(anchor) {
            Some(g) if g.leading().is_some() => {
                match self.decide_here(&g, &gid, propose, plan.as_ref()).await {
                    Ok(decision) => PeerResponse::TxnDecision { decision },
                    Err(message) => PeerResponse::Error {
                        message,
                        retryable: true,
                    },
                }
            }
            _ => self.not_leader(anchor),
        }
    }

    /// Commits a transaction with parts on other nodes (the coordinator, on the origin
    /// node): see [`mr_wire::local::LocalRequest::CommitDistributed`].
    pub async fn commit_distributed(
        &self,
        database: String,
        gid: String,
        backend_pid: i32,
        participants: Vec<Participant>,
        local: Option<LocalWrite>,
    ) -> LocalResponse {
        let _coordinating = Coordinating::new(self, &gid);
        let commit_by = commit_by_ms();
        let Some(anchor) = self.choose_anchor(local.as_ref(), &participants) else {
            return LocalResponse::Error {
                message: "no range leaseholder is known to record the transaction's decision"
                    .into(),
                retryable: true,
                ambiguous: false,
            };
        };
        let p = PrepareAs {
            anchor,
            gid: gid.clone(),
        };
        // Phase one: every part prepares, in parallel.
        let local_prepare = async {
            match local {
                Some(w) => {
                    let meta = TxnMeta {
                        txn_id: w.txn_id,
                        schema_version: w.schema_version,
                        start_ms: w.txn_start_ms,
                    };
                    self.replicate(database.clone(), w.writes, meta, Some(p.clone()))
                        .await
                }
                None => Ok(None),
            }
        };
        let remote_prepares = futures::future::join_all(participants.iter().map(|part| {
            let req = ForwardRequest {
                session: part.session.clone(),
                backend_pid,
                begin: None,
                savepoints: part.savepoints.clone(),
                statement: None,
                finish: Some(Finish::Prepare(p.clone())),
                turn: None,
            };
            self.forward(part.node_id, req)
        }));
        let (local_result, remote_results) = tokio::join!(local_prepare, remote_prepares);
        let mut failure: Option<LocalResponse> = None;
        let mut prepared = Vec::new();
        // The part ranges: this node's, noted as its prepare wrote them, and each remote
        // part's, in its answer.
        let mut parts = self.take_prepared(&gid);
        // A part whose prepare failed without saying where it wrote (its node lost, its
        // answer too): the anchor keeps the abort for that part's replicas and sweep.
        let mut parts_unknown = false;
        for (part, r) in participants.iter().zip(remote_results) {
            match r {
                LocalResponse::Forwarded {
                    prepared_ranges, ..
                } => {
                    prepared.push(PreparedNode {
                        node: part.node_id,
                        wrote: !prepared_ranges.is_empty(),
                    });
                    parts.extend(prepared_ranges);
                }
                // Read only: committed already, no part of the decision.
                LocalResponse::Done => {}
                // PostgreSQL refused to prepare after the pre-prepare proposed `Prepare`
                // entries, or the connection broke (when it may have prepared, and entries
                // may land that nobody names: the anchor keeps its record). Rolled back with
                // the prepared parts.
                LocalResponse::PrepareFailed {
                    error,
                    prepared_ranges,
                    broken,
                } => {
                    prepared.push(PreparedNode {
                        node: part.node_id,
                        wrote: !prepared_ranges.is_empty(),
                    });
                    parts.extend(prepared_ranges);
                    parts_unknown |= broken;
                    failure.get_or_insert(LocalResponse::SqlError(error));
                }
                // Failed in PostgreSQL before its pre-prepare wrote anything.
                other @ LocalResponse::SqlError(_) => {
                    failure.get_or_insert(other);
                }
                other => {
                    parts_unknown = true;
                    failure.get_or_insert(other);
                }
            }
        }
        let entries = match local_result {
            Ok(e) => e.unwrap_or_default(),
            Err(e) => {
                failure = Some(super::write_error(e));
                Vec::new()
            }
        };
        // What the decision leaves to forget, proposed with it (the anchor's leader drives
        // the forget on it if this node does not).
        let plan = ForgetPlan {
            database: database.clone(),
            parts: part_ranges(parts.iter().copied(), anchor),
            nodes: prepared.iter().map(|n| (n.node, n.wrote)).collect(),
            keep_anchor: parts_unknown,
            since_ms: 0,
            commit_by_ms: commit_by,
        };
        if let Some(failure) = failure {
            // Nothing is decided: decide abort, so that no part waits, and roll back the
            // prepared ones (their appliers and the sweep would, too).
            let decided = self.decided(anchor, &gid, false, plan).await;
            if decided != Ok(Some(false)) {
                tracing::warn!(gid, ?decided, "could not record the abort of a failed two-phase commit; the parts resolve it later");
            }
            let unconfirmed = self
                .finish_parts(&database, &p, &prepared, false, false)
                .await;
            if decided == Ok(Some(false)) {
                let after = Instant::now() + FINISH_TIMEOUT;
                self.forget_later(
                    &p,
                    &database,
                    false,
                    parts,
                    unconfirmed,
                    parts_unknown,
                    after,
                );
            }
            return failure;
        }
        // Phase two: the decision, then the parts' commits.
        crate::failpoint::pause(crate::failpoint::SLOW_DECIDE, SWEEP_AFTER + SWEEP_AFTER / 2).await;
        crate::failpoint::hit(crate::failpoint::BEFORE_DECIDE);
        match self.decided(anchor, &gid, true, plan).await {
            Ok(Some(true)) => {
                crate::failpoint::hit(crate::failpoint::AFTER_DECIDE);
                let unconfirmed = self
                    .finish_parts(&database, &p, &prepared, true, true)
                    .await;
                self.forget_later(
                    &p,
                    &database,
                    true,
                    parts,
                    unconfirmed,
                    false,
                    Instant::now(),
                );
                LocalResponse::Replicated { entries }
            }
            Ok(_) => {
                let unconfirmed = self
                    .finish_parts(&database, &p, &prepared, false, false)
                    .await;
                // Answered: this coordinator proposes nothing more, so the abort can go too
                // (once no stale frame of its commit proposal can arrive).
                let after = Instant::now() + FORGET_ABORT_AFTER;
                self.forget_later(&p, &database, false, parts, unconfirmed, false, after);
                LocalResponse::Error {
                    message: format!("transaction {gid} was decided aborted while it prepared (its coordinator seemed gone)"),
                    retryable: true,
                    ambiguous: false,
                }
            }
            Err(e) => {
                for &(range_id, index) in &entries {
                    self.abandon(range_id, index);
                }
                LocalResponse::Error {
                    message: e,
                    retryable: false,
                    ambiguous: true,
                }
            }
        }
    }

    /// The range that records a distributed transaction's decision: one this node leads if
    /// possible (its Raft round is then local), preferring one the transaction writes; else
    /// one leased by the first participant.
    fn choose_anchor(
        &self,
        local: Option<&LocalWrite>,
        participants: &[Participant],
    ) -> Option<u64> {
        // A sealed range (about to be dropped) records only aborts: never an anchor.
        let led_here = |r: &u64| {
            self.group(*r).is_some_and(|g| g.leading().is_some())
                && !matches!(store::sealed(&self.db, *r), Ok(true))
        };
        if let Some(w) = local {
            let written = w
                .writes
                .iter()
                .filter_map(|t| self.range_of(&t.table, &t.partition))
                .filter(led_here)
                .min();
            if written.is_some() {
                return written;
            }
        }
        if let Some(r) = self.groups().iter().map(|g| g.range_id).find(led_here) {
            return Some(r);
        }
        let first = participants.first()?.node_id;
        self.meta.read(|s| {
            s.ranges()
                .map(|r| r.range_id)
                .find(|&r| s.lease(r).is_some_and(|l| l.holder == first))
        })
    }

    /// Commits (or rolls back) the parts' prepared transactions on `nodes`, in parallel.
    /// `wait`: the answer waits for them (a commit is acknowledged only once every part's
    /// rows are visible there); a part that does not answer in time is left to its applier
    /// and the sweep. Otherwise they are sent in the background. Answers the nodes that did
    /// not confirm (all of them without `wait`).
    async fn finish_parts(
        &self,
        database: &str,
        p: &PrepareAs,
        nodes: &[PreparedNode],
        commit: bool,
        wait: bool,
    ) -> Vec<PreparedNode> {
        let calls: Vec<_> = nodes
            .iter()
            .map(|&part| {
                let n = part.node;
                let addr = self.node_addr(n);
                let req = PeerRequest::FinishPrepared {
                    database: database.to_string(),
                    name: p.prepared_name(),
                    commit,
                    record: part.wrote,
                };
                let transport = self.transport.clone();
                async move {
                    let r = match addr {
                        Some(addr) => transport.call(&addr, req, FINISH_TIMEOUT).await.ok(),
                        None => None,
                    };
                    let ok = matches!(r, Some(PeerResponse::Exec { .. }));
                    if !ok {
                        tracing::warn!(node = n, commit, ?r, "a part of a two-phase commit did not confirm its end; its applier and the sweep there finish it");
                    }
                    (!ok).then_some(part)
                }
            })
            .collect();
        let all = futures::future::join_all(calls);
        if wait {
            all.await.into_iter().flatten().collect()
        } else {
            tokio::spawn(all);
            nodes.to_vec()
        }
    }

    /// Ends prepared transaction `name` in `database` on this node (a part of another
    /// node's two-phase commit), on its coordinator's word. One already ended is not an
    /// error. `record`: the part wrote `Prepare` entries here (see [`Record::First`]).
    pub async fn serve_finish_prepared(
        &self,
        database: String,
        name: String,
        commit: bool,
        record: bool,
    ) -> PeerResponse {
        match self
            .end_prepared_here(&database, &name, commit, record)
            .await
        {
            Ok(()) => PeerResponse::Exec {
                response: Box::new(LocalResponse::Done),
            },
            Err(message) => PeerResponse::Error {
                message,
                retryable: true,
            },
        }
    }

    /// Ends this node's prepared transaction `name` (a part of a decided transaction whose
    /// forget is driven here), recording the decision as [`Record::First`] if `record`.
    pub(super) async fn end_prepared_here(
        &self,
        database: &str,
        name: &str,
        commit: bool,
        record: bool,
    ) -> Result<(), String> {
        let record = if record { Record::First } else { Record::Never };
        self.finish_prepared(database, name, commit, record).await
    }

    /// Ends prepared transaction `name`, recording its decision here as `record` says.
    async fn finish_prepared(
        &self,
        database: &str,
        name: &str,
        commit: bool,
        record: Record,
    ) -> Result<(), String> {
        let gid = PrepareAs::from_prepared_name(name).map(|p| p.gid);
        // Not once a replica here forgot it: a retried call after the `Forget` would leave a
        // record nothing forgets again.
        if let (Some(gid), Record::First) = (&gid, record) {
            if !self.forgot_lately_anywhere(gid) {
                let _ = store::learn_decision(&self.db, gid, commit);
            }
        }
        let mut conn = self
            .pg_cfg
            .connect_options(database)
            .application_name("pgmr two-phase commit")
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        let r = finish_prepared_on(&mut conn, name, commit).await;
        let _ = conn.close().await;
        if let (Some(gid), Record::IfEnded, Ok(true)) = (&gid, record, &r) {
            let _ = store::learn_decision(&self.db, gid, commit);
        }
        r.map(|_| ())
    }

    /// Whether this node is coordinating two-phase commit `gid` now.
    pub fn coordinating(&self, gid: &str) -> bool {
        self.coordinating
            .lock()
            .expect("coordinating lock")
            .contains(gid)
    }

    /// Whether some live node (this one included) says it is coordinating `gid` now. Asked
    /// of every live node: the prepared name does not say which coordinates it, and the
    /// question is only asked of transactions whose decision is late.
    pub(super) async fn coordinator_alive(&self, gid: &str) -> bool {
        if self.coordinating(gid) {
            return true;
        }
        let now = crate::node::now_ms();
        let others: Vec<String> = self.meta.read(|s| {
            s.nodes()
                .filter(|n| n.node_id != self.me && n.status(now) == mr_meta::NodeStatus::Live)
                .map(|n| n.rpc_addr.clone())
                .collect()
        });
        let asks = others.iter().map(|addr| {
            self.transport.call(
                addr,
                PeerRequest::TxnCoordinating {
                    gid: gid.to_string(),
                },
                Duration::from_secs(2),
            )
        });
        futures::future::join_all(asks)
            .await
            .into_iter()
            .any(|r| matches!(r, Ok(PeerResponse::TxnCoordinating { coordinating: true })))
    }

    /// Resolves this node's prepared transactions older than [`SWEEP_AFTER`] (their
    /// coordinator died or lost them): asks each one's anchor for the decision, proposing
    /// abort if there is none and no node is still coordinating it, and ends it
    /// accordingly.
    pub(super) async fn sweep_prepared(&self) {
        if self.pg.ready_pid().is_none() {
            return;
        }
        let Ok(mut conn) = self
            .pg_cfg
            .connect_options("postgres")
            .application_name("pgmr two-phase commit")
            .connect()
            .await
        else {
            return;
        };
        let stale = sqlx::query(
            "SELECT gid, database::text, \
                    extract(epoch FROM pg_catalog.now() - prepared)::float8 \
               FROM pg_catalog.pg_prepared_xacts \
              WHERE gid LIKE 'mr:%' AND prepared < pg_catalog.now() - make_interval(secs => $1)",
        )
        .bind(SWEEP_AFTER.as_secs_f64())
        .fetch_all(&mut conn)
        .await
        .unwrap_or_default();
        let _ = conn.close().await;
        for row in stale {
            let (Ok(name), Ok(database)) =
                (row.try_get::<String, _>(0), row.try_get::<String, _>(1))
            else {
                continue;
            };
            let Some(p) = PrepareAs::from_prepared_name(&name) else {
                continue;
            };
            let age = row.try_get::<f64, _>(2).unwrap_or(0.0);
            let propose = (age >= COORDINATOR_LIMIT.as_secs_f64()
                || !self.coordinator_alive(&p.gid).await)
                .then_some(false);
            match self.decide(p.anchor, &p.gid, propose).await {
                Ok(Some(commit)) => {
                    tracing::info!(
                        name,
                        commit,
                        "resolved a prepared transaction left by its coordinator"
                    );
                    if let Err(e) = self
                        .finish_prepared(&database, &name, commit, Record::IfEnded)
                        .await
                    {
                        tracing::warn!(name, "could not end a prepared transaction: {e}");
                    }
                }
                other => tracing::debug!(
                    name,
                    ?other,
                    "a prepared transaction's decision is not known yet"
                ),
            }
        }
    }
}

/// A transaction's part ranges, as plans and forgets list them: its ranges but the anchor,
/// sorted, each once.
pub(super) fn part_ranges(ranges: impl IntoIterator<Item = u64>, anchor: u64) -> Vec<u64> {
    let mut parts: Vec<u64> = ranges.into_iter().filter(|&r| r != anchor).collect();
    parts.sort_unstable();
    parts.dedup();
    parts
}

/// The plan of a transaction whose every range is led here: part ranges only, no prepared
/// node (its coordinator's backend commits its own).
fn local_plan(p: &PrepareAs, proposed: &[u64], commit_by_ms: u64) -> ForgetPlan {
    ForgetPlan {
        parts: part_ranges(proposed.iter().copied(), p.anchor),
        commit_by_ms,
        ..ForgetPlan::default()
    }
}

/// Once `p`'s decision is known here, copies it into the other ranges the transaction
/// prepared in on this node (a `Decide` entry there records the same first decision): their
/// replicas' appliers pass their `Prepare` entries on their own log's record, and have one
/// put there if this copy never comes (`apply::decision`).
async fn spread_decision(groups: Vec<Arc<Group>>, db: Arc<redb::Database>, p: PrepareAs) {
    if crate::failpoint::armed_as(crate::failpoint::NO_DECISION_COPY) {
        return;
    }
    let until = Instant::now() + SWEEP_AFTER;
    let commit = loop {
        if let Ok(Some(d)) = store::decision(&db, &p.gid) {
            break d;
        }
        if Instant::now() >= until {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    for g in groups.iter().filter(|g| g.range_id != p.anchor) {
        if g.leading().is_none() {
            continue;
        }
        let entry = TxnWrite {
            txn_id: p.gid.clone(),
            origin: 0,
            schema_version: 0,
            changes: "[]".into(),
            at_ms: crate::node::now_ms(),
            kind: TxnKind::Decide {
                gid: p.gid.clone(),
                commit,
                plan: None,
            },
            chunk: None,
        };
        if let Err(WriteError::Ambiguous(e) | WriteError::Retryable(e)) =
            super::propose(g, entry).await
        {
            tracing::debug!(
                range_id = g.range_id,
                gid = p.gid,
                "could not copy a decision: {e}"
            );
        }
    }
}

/// `COMMIT PREPARED` or `ROLLBACK PREPARED` of `name` on `conn` (in its database); one that
/// no longer exists (ended by someone else) is fine. Answers whether it ended one.
pub async fn finish_prepared_on(
    conn: &mut PgConnection,
    name: &str,
    commit: bool,
) -> Result<bool, String> {
    let verb = if commit {
        "COMMIT PREPARED"
    } else {
        "ROLLBACK PREPARED"
    };
    let sql = format!("{verb} {}", quote_literal(name));
    match sqlx::query(&sql)
        .persistent(false)
        .execute(&mut *conn)
        .await
    {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42704") => Ok(false),
        Err(e) => Err(e.to_string()),
    }
}

/// A SQL string literal (utility statements take no parameters).
pub fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}
