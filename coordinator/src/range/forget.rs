//! Forgetting two-phase commits' decisions (ARCHITECTURE.md §8.5, "Forgetting decisions"):
//! without it every distributed transaction left its decision in the anchor's and every part
//! range's records (and in each node's), forever.
//!
//! The coordinator drives it, after the client has its answer: it has every prepared part's
//! node end its prepared transaction (so no sweep will ask), and every part range's log hold
//! the decision (so no part replica needs the anchor: each passes its `Prepare` entries on its
//! own log's record, and one that asks the anchor only ever copies the answer into that log,
//! behind the decision). Each part range then forgets the transaction with a `Forget` entry,
//! and the anchor once all have. A replica deletes its records at its applier's pass over the
//! `Forget` entry, so past every `Prepare` of the transaction in its log (apply.rs). A part
//! that cannot be confirmed (a sealed or dropped range, a node that stays away) keeps the
//! anchor's record: forgetting is never needed for correctness, only for size.
//!
//! Commits, and the aborts a coordinator knows: its own, or one answered to its commit
//! proposal. A forgotten decision may be recorded anew as abort (a late question), which is
//! harmless for an abort; the one hazard would be a commit proposed after it, and only the
//! coordinator proposes commit, which it never does once it knows the abort. An abort decided
//! for a coordinator that never learns it (gone, or too slow) is kept (step 3, not built).

use super::twophase::PreparedNode;
use super::{Ranges, TxnKind, TxnWrite};
use mr_wire::local::PrepareAs;
use mr_wire::peer::{PeerRequest, PeerResponse};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often the work is driven and the ranges' `Forget` entries proposed.
const EVERY: Duration = Duration::from_secs(1);
/// A transaction not confirmed everywhere within this long keeps its anchor's record.
const GIVE_UP_AFTER: Duration = Duration::from_secs(600);
/// At most this many transactions per `Forget` entry.
const BATCH: usize = 512;
/// A range's `Forget` that fails this many times in a row is dropped (its records stay).
const ATTEMPTS: u32 = 30;
/// At most this many transactions are driven at once.
const CONCURRENT: usize = 64;
/// How long a `Forget` proposal is waited for.
const PROPOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a replica remembers the transactions its applier just forgot.
const REMEMBER: Duration = Duration::from_secs(600);
/// How long a part's note of its ranges is kept if its prepare never answers: well past a
/// forwarded step's timeout (600 s), so no answer finds its note pruned.
const NOTES_KEPT: Duration = Duration::from_secs(1800);

#[derive(Default)]
pub(super) struct Forgetting {
    work: Mutex<Vec<Work>>,
    /// Per range: transactions it may forget now, with the attempts made.
    ready: Mutex<BTreeMap<u64, Vec<(String, u32)>>>,
    /// The ranges a part's prepare on this node proposed to, by transaction, until its
    /// `PREPARE TRANSACTION` answers (the coordinator learns them in that answer). Noted
    /// before the proposals, so an answer that comes first still names them; a note that
    /// comes after the answer anyway (a prepare whose backend gave up waiting) is dropped
    /// after [`NOTES_KEPT`].
    prepared: Mutex<HashMap<String, (Instant, Vec<u64>)>>,
    /// Transactions this node's appliers forgot lately, by (range, gid), with their decision:
    /// a copy of the decision asked for after that (a replica that passed on this node's
    /// record checking a second later, a part's node slow to copy) is not appended anew,
    /// where it would be a record nothing ever forgets again.
    forgotten: Mutex<HashMap<(u64, String), (Instant, bool)>>,
    /// The transactions of [`Self::forgotten`], whatever the range: a coordinator's word
    /// arriving after that (a retried `FinishPrepared`) is not recorded anew.
    forgotten_gids: Mutex<HashMap<String, Instant>>,
}

/// A decided transaction this node coordinated, on its way to being forgotten.
struct Work {
    gid: String,
    anchor: u64,
    database: String,
    /// The parts' prepared transactions' name.
    name: String,
    commit: bool,
    /// Part ranges (not the anchor) not yet confirmed to hold the decision in their log.
    parts: Vec<u64>,
    /// Not driven before: `FinishPrepared` calls sent in the background have ended by then,
    /// so none reaches a node after its `Forget` (where it would record the decision anew).
    not_before: Instant,
    /// Nodes whose prepared transaction has not confirmed its end.
    nodes: Vec<PreparedNode>,
    /// A part cannot be confirmed: the anchor keeps its record.
    keep_anchor: bool,
    since: Instant,
}

impl Ranges {
    /// Has transaction `p`, decided `commit` on this coordinator's word (see the module
    /// comment), forgotten once its part ranges hold the decision and its prepared parts on
    /// `nodes` have ended. `keep_anchor`: only the parts' records go (a part may have written
    /// where nobody knows). `not_before`: see [`Work::not_before`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forget_later(
        &self,
        p: &PrepareAs,
        database: &str,
        commit: bool,
        mut parts: Vec<u64>,
        nodes: Vec<PreparedNode>,
        keep_anchor: bool,
        not_before: Instant,
    ) {
        parts.sort_unstable();
        parts.dedup();
        parts.retain(|&r| r != p.anchor);
        self.forgetting
            .work
            .lock()
            .expect("forget lock")
            .push(Work {
                gid: p.gid.clone(),
                anchor: p.anchor,
                database: database.to_string(),
                name: p.prepared_name(),
                commit,
                parts,
                nodes,
                keep_anchor,
                not_before,
                since: Instant::now(),
            });
    }

    /// The two-phase commit decisions kept here: this node's records and its ranges'.
    pub fn decision_counts(&self) -> (u64, u64) {
        super::store::decision_counts(&self.db).unwrap_or_default()
    }

    /// Notes that this node's replica of `range` forgot `decisions` (its applier passed their
    /// `Forget` entry).
    pub(super) fn note_forgotten(&self, range: u64, decisions: Vec<(String, bool)>) {
        let mut f = self.forgetting.forgotten.lock().expect("forget lock");
        let mut gids = self.forgetting.forgotten_gids.lock().expect("forget lock");
        let now = Instant::now();
        for (gid, commit) in decisions {
            gids.insert(gid.clone(), now);
            f.insert((range, gid), (now, commit));
        }
    }

    /// Whether a replica here forgot transaction `gid` lately.
    pub(super) fn forgot_lately_anywhere(&self, gid: &str) -> bool {
        self.forgetting
            .forgotten_gids
            .lock()
            .expect("forget lock")
            .contains_key(gid)
    }

    /// The decision of `gid` if this node's replica of `range` forgot it lately.
    pub(super) fn forgot_lately(&self, range: u64, gid: &str) -> Option<bool> {
        self.forgetting
            .forgotten
            .lock()
            .expect("forget lock")
            .get(&(range, gid.to_string()))
            .map(|&(_, commit)| commit)
    }

    /// Notes the ranges a part's prepare proposes `Prepare` entries to on this node.
    pub(super) fn note_prepared(&self, gid: &str, ranges: impl IntoIterator<Item = u64>) {
        self.forgetting
            .prepared
            .lock()
            .expect("forget lock")
            .entry(gid.to_string())
            .or_insert_with(|| (Instant::now(), Vec::new()))
            .1
            .extend(ranges);
    }

    /// The ranges noted for `gid`'s part here, taken (its prepare answered).
    pub(super) fn take_prepared(&self, gid: &str) -> Vec<u64> {
        let mut r = self
            .forgetting
            .prepared
            .lock()
            .expect("forget lock")
            .remove(gid)
            .map(|(_, r)| r)
            .unwrap_or_default();
        r.sort_unstable();
        r.dedup();
        r
    }

    /// Drives the forgetting of the transactions this node coordinated, until `stop`.
    pub(super) async fn run_forgetting(
        self: std::sync::Arc<Self>,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            self.drive_work().await;
            self.propose_forgets().await;
            let f = &self.forgetting;
            f.forgotten
                .lock()
                .expect("forget lock")
                .retain(|_, (at, _)| at.elapsed() < REMEMBER);
            f.forgotten_gids
                .lock()
                .expect("forget lock")
                .retain(|_, at| at.elapsed() < REMEMBER);
            f.prepared
                .lock()
                .expect("forget lock")
                .retain(|_, (at, _)| at.elapsed() < NOTES_KEPT);
        }
    }

    async fn drive_work(&self) {
        let batch: Vec<Work> = {
            let mut w = self.forgetting.work.lock().expect("forget lock");
            let now = Instant::now();
            let (mut due, later): (Vec<Work>, Vec<Work>) =
                w.drain(..).partition(|x| x.not_before <= now);
            let rest = due.split_off(due.len().min(CONCURRENT));
            w.extend(rest);
            w.extend(later);
            due
        };
        if batch.is_empty() {
            return;
        }
        let done = futures::future::join_all(batch.into_iter().map(|w| self.drive(w))).await;
        let mut ready = self.forgetting.ready.lock().expect("forget lock");
        let mut again = Vec::new();
        for (w, parts) in done {
            for r in parts {
                ready.entry(r).or_default().push((w.gid.clone(), 0));
            }
            if w.parts.is_empty() && w.nodes.is_empty() {
                if !w.keep_anchor {
                    // This node's own record goes too, even where it holds no replica of
                    // the transaction's ranges (an anchor leased elsewhere): a cache here.
                    if let Err(e) =
                        super::store::forget_decisions(&self.db, None, std::slice::from_ref(&w.gid))
                    {
                        tracing::debug!(gid = w.gid, "could not forget a decision here: {e}");
                    }
                    ready.entry(w.anchor).or_default().push((w.gid, 0));
                }
            } else if w.since.elapsed() < GIVE_UP_AFTER {
                again.push(w);
            } else {
                tracing::info!(
                    gid = w.gid,
                    parts = ?w.parts,
                    nodes = ?w.nodes,
                    "a distributed transaction's parts were not all confirmed; its anchor keeps its decision"
                );
            }
        }
        drop(ready);
        self.forgetting
            .work
            .lock()
            .expect("forget lock")
            .extend(again);
    }

    /// One round for `w`: its prepared parts' ends and its part ranges' records, as far as
    /// they can be confirmed now. Answers `w` and the part ranges confirmed this round.
    async fn drive(&self, mut w: Work) -> (Work, Vec<u64>) {
        let mut nodes = Vec::new();
        for n in std::mem::take(&mut w.nodes) {
            if !self.end_prepared(n, &w.database, &w.name, w.commit).await {
                nodes.push(n);
            }
        }
        w.nodes = nodes;
        let mut confirmed = Vec::new();
        let mut parts = Vec::new();
        for r in std::mem::take(&mut w.parts) {
            match self.copy_decision(r, &w.gid, w.commit).await {
                Ok(Some(d)) if d == w.commit => confirmed.push(r),
                // Sealed or dropped (no copies), or a record that is not the decision: never
                // forget the anchor's.
                Ok(_) => w.keep_anchor = true,
                Err(_) => parts.push(r),
            }
        }
        w.parts = parts;
        (w, confirmed)
    }

    /// Whether node `n` confirms that its part `name` of a decided transaction has ended.
    async fn end_prepared(
        &self,
        n: PreparedNode,
        database: &str,
        name: &str,
        commit: bool,
    ) -> bool {
        let Some(addr) = self.node_addr(n.node) else {
            return false;
        };
        let req = PeerRequest::FinishPrepared {
            database: database.to_string(),
            name: name.to_string(),
            commit,
            record: n.wrote,
        };
        matches!(
            self.transport
                .call(&addr, req, Duration::from_secs(5))
                .await,
            Ok(PeerResponse::Exec { .. })
        )
    }

    /// Proposes each range's `Forget` entry (here, or through its leader).
    async fn propose_forgets(&self) {
        let ready = std::mem::take(&mut *self.forgetting.ready.lock().expect("forget lock"));
        for (range_id, mut gids) in ready {
            while !gids.is_empty() {
                let rest = gids.split_off(gids.len().min(BATCH));
                let names: Vec<String> = gids.iter().map(|(g, _)| g.clone()).collect();
                if let Err(e) = self.forget_in(range_id, names).await {
                    tracing::debug!(range_id, "could not forget decisions yet: {e}");
                    let again: Vec<_> = gids
                        .into_iter()
                        .filter(|(_, n)| n + 1 < ATTEMPTS)
                        .map(|(g, n)| (g, n + 1))
                        .collect();
                    self.forgetting
                        .ready
                        .lock()
                        .expect("forget lock")
                        .entry(range_id)
                        .or_default()
                        .extend(again);
                }
                gids = rest;
            }
        }
    }

    async fn forget_in(&self, range_id: u64, gids: Vec<String>) -> Result<(), String> {
        if !self.range_exists(range_id) {
            return Ok(());
        }
        let local = self.group(range_id);
        if local.as_ref().is_some_and(|g| g.leading().is_some()) {
            return self.serve_forget_here(range_id, gids).await;
        }
        let leader = local
            .and_then(|g| g.raft.metrics().borrow().current_leader)
            .filter(|&l| l != self.me)
            .or_else(|| self.meta.read(|s| s.lease(range_id).map(|l| l.holder)))
            .filter(|&l| l != self.me)
            .ok_or("no leader known")?;
        let addr = self
            .node_addr(leader)
            .ok_or("the leader's address is not known")?;
        let req = PeerRequest::ForgetDecisions { range_id, gids };
        match self
            .transport
            .call(&addr, req, Duration::from_secs(10))
            .await
        {
            Ok(PeerResponse::Forgotten) => Ok(()),
            Ok(PeerResponse::Error { message, .. }) => Err(message),
            Ok(other) => Err(format!("node {leader} answered {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// A coordinator has range `range_id`, which this node may lead, forget `gids`.
    pub async fn serve_forget(&self, range_id: u64, gids: Vec<String>) -> PeerResponse {
        match self.group(range_id) {
            Some(g) if g.leading().is_some() => {
                match self.serve_forget_here(range_id, gids).await {
                    Ok(()) => PeerResponse::Forgotten,
                    Err(message) => PeerResponse::Error {
                        message,
                        retryable: true,
                    },
                }
            }
            _ => self.not_leader(range_id),
        }
    }

    /// Appends a `Forget` entry for `gids` to range `range_id`'s log, on its leader (this
    /// node). A sealed range forgets nothing: its records outlive it (`sealed_decision`).
    async fn serve_forget_here(&self, range_id: u64, gids: Vec<String>) -> Result<(), String> {
        let g = self
            .group(range_id)
            .filter(|g| g.leading().is_some())
            .ok_or_else(|| format!("this node does not lead range {range_id}"))?;
        if matches!(super::store::sealed(&self.db, range_id), Ok(true)) {
            return Ok(());
        }
        let entry = TxnWrite {
            txn_id: format!("forget:{range_id}:{}", crate::node::now_ms()),
            origin: 0,
            schema_version: 0,
            changes: "[]".into(),
            at_ms: crate::node::now_ms(),
            kind: TxnKind::Forget { gids },
            chunk: None,
        };
        // Not `propose`: an ambiguous outcome needs no fence here (the entry writes no rows),
        // and a fence would hold the range's writes back until the applier passed it.
        match tokio::time::timeout(PROPOSE_TIMEOUT, g.raft.client_write(entry)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "no quorum of range {range_id}'s voters confirmed it in time"
            )),
        }
    }
}
