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
//! coordinator proposes commit, which it never does once it knows the abort (a stale frame of
//! its proposal arriving later decides abort: `twophase::STALE_PROPOSAL`). An abort decided
//! for a coordinator whose proposal never reaches the anchor (it died first) is presumed
//! (below).
//!
//! **Leftovers.** The coordinator's work is in memory: a restart loses it, and it gives up on
//! a part that stays away. So its decision carries a plan (the part ranges and prepared
//! nodes), which the anchor's log keeps beside the record until the `Forget`. The anchor's
//! leader, whichever node that is, drives the same forget on a plan still there a minute
//! after its `Decide` (the coordinator is usually done in a second). Two drivers at once
//! (a coordinator slow on a part) do the same idempotent steps.
//!
//! **Presumed aborts.** An abort recorded without a plan (a sweep's, for a coordinator that
//! died before proposing; a copy; one recorded anew after a `Forget`) is forgotten by each
//! range that recorded it, on its own, once its commit limit has passed: a commit proposal
//! that late decides abort (`twophase::commit_limit`), so no commit can follow it.

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
/// A plan still kept this long after its `Decide` is driven by the anchor's leader (an
/// abort's only after [`super::twophase::FORGET_ABORT_AFTER`]).
const LEFTOVER_AFTER: Duration = Duration::from_secs(60);
/// How often the ranges led here are looked over for such plans.
const LEFTOVER_EVERY: u32 = 10;
/// A leftover not confirmed everywhere within this long rests before it is driven again.
const LEFTOVER_GIVE_UP: Duration = Duration::from_secs(60);
const LEFTOVER_REST: Duration = Duration::from_secs(600);
/// How long a replica remembers the transactions its applier just forgot.
const REMEMBER: Duration = Duration::from_secs(600);
/// How long a part's note of its ranges is kept if its prepare never answers: well past a
/// forwarded step's timeout (600 s), so no answer finds its note pruned.
const NOTES_KEPT: Duration = Duration::from_secs(1800);

/// A transaction a range may forget, with the attempts made.
type Attempted = (String, u32);

#[derive(Default)]
pub(super) struct Forgetting {
    work: Mutex<Vec<Work>>,
    /// Per range (and whether only its plans go): transactions it may forget now, with the
    /// attempts made.
    ready: Mutex<BTreeMap<(u64, bool), Vec<Attempted>>>,
    /// Leftovers that could not be confirmed lately, by when they were given up.
    resting: Mutex<HashMap<String, Instant>>,
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
    /// Driven by the anchor's leader on the plan in its log, not by the coordinator.
    leftover: bool,
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
        parts: Vec<u64>,
        nodes: Vec<PreparedNode>,
        keep_anchor: bool,
        not_before: Instant,
    ) {
        let parts = super::twophase::part_ranges(parts, p.anchor);
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
                leftover: false,
            });
    }

    /// Takes up the plans of the ranges led here that are still kept [`LEFTOVER_AFTER`] their
    /// `Decide` (their coordinator restarted, or gave up on a part), unless being driven here
    /// already or resting.
    fn take_leftovers(&self) {
        let f = &self.forgetting;
        f.resting
            .lock()
            .expect("forget lock")
            .retain(|_, at| at.elapsed() < LEFTOVER_REST);
        let now = crate::node::now_ms();
        let before = now.saturating_sub(LEFTOVER_AFTER.as_millis() as u64);
        let aborts_before =
            now.saturating_sub(super::twophase::FORGET_ABORT_AFTER.as_millis() as u64);
        let presumed_before =
            now.saturating_sub(super::twophase::forget_presumed_after().as_millis() as u64);
        let mut found = Vec::new();
        for g in self.groups() {
            if g.leading().is_none()
                || !matches!(super::store::sealed(&self.db, g.range_id), Ok(false))
            {
                continue;
            }
            let plans = crate::blocking::run(|| {
                super::store::range_plans(&self.db, g.range_id, before).map_err(|e| e.to_string())
            });
            match plans {
                Ok(plans) => found.extend(plans.into_iter().map(|p| (g.range_id, p))),
                Err(e) => tracing::debug!(range_id = g.range_id, "reading plans: {e}"),
            }
        }
        if found.is_empty() {
            return;
        }
        let mut ready = f.ready.lock().expect("forget lock");
        let resting = f.resting.lock().expect("forget lock");
        let mut work = f.work.lock().expect("forget lock");
        for (anchor, (gid, record, stored)) in found {
            // A plan is written with its record, in one transaction.
            let Some(commit) = record else { continue };
            if stored.presumed {
                // An abort without a plan: this range forgets it once no commit can follow.
                let queued = ready.entry((anchor, false)).or_default();
                if !commit
                    && stored.at_ms < presumed_before
                    && !queued.iter().any(|(g, _)| *g == gid)
                {
                    tracing::debug!(gid, range_id = anchor, "forgetting a presumed abort");
                    queued.push((gid, 0));
                }
                continue;
            }
            if !commit && stored.at_ms >= aborts_before {
                continue;
            }
            // Driven here already, or its `Forget` is on its way.
            if resting.contains_key(&gid)
                || work.iter().any(|w| w.gid == gid)
                || ready.values().any(|v| v.iter().any(|(g, _)| *g == gid))
            {
                continue;
            }
            tracing::info!(
                gid,
                anchor,
                commit,
                "driving the forget of a decision its coordinator left"
            );
            let plan = stored.plan;
            let p = PrepareAs {
                anchor,
                gid: gid.clone(),
            };
            work.push(Work {
                gid,
                anchor,
                name: p.prepared_name(),
                database: plan.database,
                commit,
                parts: plan.parts,
                nodes: plan
                    .nodes
                    .into_iter()
                    .map(|(node, wrote)| PreparedNode { node, wrote })
                    .collect(),
                keep_anchor: plan.keep_anchor,
                not_before: Instant::now(),
                since: Instant::now(),
                leftover: true,
            });
        }
    }

    /// The two-phase commit decisions kept here: this node's records, its ranges', and the
    /// plans kept beside those.
    pub fn decision_counts(&self) -> (u64, u64, u64) {
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
        let mut ticks = 0u32;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            ticks = ticks.wrapping_add(1);
            if ticks.is_multiple_of(LEFTOVER_EVERY) {
                self.take_leftovers();
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
                ready
                    .entry((r, false))
                    .or_default()
                    .push((w.gid.clone(), 0));
            }
            let give_up = if w.leftover {
                LEFTOVER_GIVE_UP
            } else {
                GIVE_UP_AFTER
            };
            if w.parts.is_empty() && w.nodes.is_empty() {
                // This node's own record goes too, even where it holds no replica of the
                // transaction's ranges (an anchor leased elsewhere): a cache here. Also when
                // the anchor keeps its record: an applier here with entries of a part
                // nobody named asks the anchor, which answers as this record would.
                if let Err(e) = super::store::forget_decisions(
                    &self.db,
                    None,
                    std::slice::from_ref(&w.gid),
                    false,
                ) {
                    tracing::debug!(gid = w.gid, "could not forget a decision here: {e}");
                }
                // With `keep_anchor` the anchor keeps its record for good, but not the plan:
                // nothing is left to drive.
                ready
                    .entry((w.anchor, w.keep_anchor))
                    .or_default()
                    .push((w.gid, 0));
            } else if w.since.elapsed() < give_up {
                again.push(w);
            } else if w.leftover {
                tracing::debug!(gid = w.gid, parts = ?w.parts, nodes = ?w.nodes, "a leftover forget rests");
                self.forgetting
                    .resting
                    .lock()
                    .expect("forget lock")
                    .insert(w.gid, Instant::now());
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
            // A leftover's call comes long after the decision: it records nothing, where a
            // record would be one nothing forgets (the part's ranges hold the decision).
            let record = n.wrote && !w.leftover;
            if !self
                .end_prepared(n, &w.database, &w.name, w.commit, record)
                .await
            {
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
        record: bool,
    ) -> bool {
        if n.node == self.me {
            return self
                .end_prepared_here(database, name, commit, record)
                .await
                .is_ok();
        }
        let Some(addr) = self.node_addr(n.node) else {
            return false;
        };
        let req = PeerRequest::FinishPrepared {
            database: database.to_string(),
            name: name.to_string(),
            commit,
            record,
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
        for ((range_id, plans_only), mut gids) in ready {
            while !gids.is_empty() {
                let rest = gids.split_off(gids.len().min(BATCH));
                let names: Vec<String> = gids.iter().map(|(g, _)| g.clone()).collect();
                if let Err(e) = self.forget_in(range_id, names, plans_only).await {
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
                        .entry((range_id, plans_only))
                        .or_default()
                        .extend(again);
                }
                gids = rest;
            }
        }
    }

    async fn forget_in(
        &self,
        range_id: u64,
        gids: Vec<String>,
        plans_only: bool,
    ) -> Result<(), String> {
        if !self.range_exists(range_id) {
            return Ok(());
        }
        let local = self.group(range_id);
        if local.as_ref().is_some_and(|g| g.leading().is_some()) {
            return self.serve_forget_here(range_id, gids, plans_only).await;
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
        let req = PeerRequest::ForgetDecisions {
            range_id,
            gids,
            plans_only,
        };
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
    pub async fn serve_forget(
        &self,
        range_id: u64,
        gids: Vec<String>,
        plans_only: bool,
    ) -> PeerResponse {
        match self.group(range_id) {
            Some(g) if g.leading().is_some() => {
                match self.serve_forget_here(range_id, gids, plans_only).await {
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
    async fn serve_forget_here(
        &self,
        range_id: u64,
        gids: Vec<String>,
        plans_only: bool,
    ) -> Result<(), String> {
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
            kind: TxnKind::Forget { gids, plans_only },
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
