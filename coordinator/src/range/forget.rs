//! Forgetting committed two-phase commits (ARCHITECTURE.md §8.5, "Forgetting decisions"): without
//! it every distributed transaction left its decision in the anchor's and every part range's
//! records (and in each node's), forever.
//!
//! The coordinator drives it, after the client has its answer: it has every prepared part's
//! node end its prepared transaction (so no sweep will ask), and every part range's log hold
//! the commit (so no part replica needs the anchor: each passes its `Prepare` entries on its
//! own log's record, and one that asks the anchor only ever copies the answer into that log,
//! behind the commit). Each part range then forgets the transaction with a `Forget` entry,
//! and the anchor once all have. A replica deletes its records at its applier's pass over the
//! `Forget` entry, so past every `Prepare` of the transaction in its log (apply.rs). A part
//! that cannot be confirmed (a sealed or dropped range, a node that stays away) keeps the
//! anchor's record: forgetting is never needed for correctness, only for size.

use super::{Ranges, TxnKind, TxnWrite};
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

#[derive(Default)]
pub(super) struct Forgetting {
    work: Mutex<Vec<Work>>,
    /// Per range: transactions it may forget now, with the attempts made.
    ready: Mutex<BTreeMap<u64, Vec<(String, u32)>>>,
    /// The ranges a part's prepare on this node wrote into, by transaction, until its
    /// `PREPARE TRANSACTION` answers (the coordinator learns them in that answer).
    prepared: Mutex<HashMap<String, Vec<u64>>>,
    /// Transactions this node's appliers forgot lately, by (range, gid): a copy of the
    /// decision asked for after that (a replica that passed on this node's record checking
    /// a second later, a part's node slow to copy) is not appended anew, where it would be
    /// a record nothing ever forgets again. Only an optimization: each is a commit.
    forgotten: Mutex<HashMap<(u64, String), Instant>>,
}

/// A committed transaction this node coordinated, on its way to being forgotten.
struct Work {
    gid: String,
    anchor: u64,
    database: String,
    /// The parts' prepared transactions' name.
    name: String,
    /// Part ranges (not the anchor) not yet confirmed to hold the commit in their log.
    parts: Vec<u64>,
    /// Nodes whose prepared transaction has not confirmed its end.
    nodes: Vec<u64>,
    /// A part cannot be confirmed: the anchor keeps its record.
    keep_anchor: bool,
    since: Instant,
}

impl Ranges {
    /// Has committed transaction `gid` (decided in `anchor`) forgotten once its part ranges
    /// hold the commit and its prepared parts on `nodes` have ended: see the module comment.
    pub(super) fn forget_later(
        &self,
        gid: &str,
        anchor: u64,
        database: &str,
        name: String,
        mut parts: Vec<u64>,
        nodes: Vec<u64>,
    ) {
        parts.sort_unstable();
        parts.dedup();
        parts.retain(|&r| r != anchor);
        self.forgetting
            .work
            .lock()
            .expect("forget lock")
            .push(Work {
                gid: gid.to_string(),
                anchor,
                database: database.to_string(),
                name,
                parts,
                nodes,
                keep_anchor: false,
                since: Instant::now(),
            });
    }

    /// The two-phase commit decisions kept here: this node's records and its ranges'.
    pub fn decision_counts(&self) -> (u64, u64) {
        super::store::decision_counts(&self.db).unwrap_or_default()
    }

    /// Notes that this node's replica of `range` forgot `gids` (its applier passed their
    /// `Forget` entry).
    pub(super) fn note_forgotten(&self, range: u64, gids: &[String]) {
        let mut f = self.forgetting.forgotten.lock().expect("forget lock");
        let now = Instant::now();
        for gid in gids {
            f.insert((range, gid.clone()), now);
        }
    }

    /// Whether this node's replica of `range` forgot committed transaction `gid` lately.
    pub(super) fn forgot_lately(&self, range: u64, gid: &str) -> bool {
        self.forgetting
            .forgotten
            .lock()
            .expect("forget lock")
            .contains_key(&(range, gid.to_string()))
    }

    /// Notes the ranges a part's prepare wrote `Prepare` entries into on this node.
    pub(super) fn note_prepared(&self, gid: &str, ranges: impl IntoIterator<Item = u64>) {
        self.forgetting
            .prepared
            .lock()
            .expect("forget lock")
            .entry(gid.to_string())
            .or_default()
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
            self.forgetting
                .forgotten
                .lock()
                .expect("forget lock")
                .retain(|_, at| at.elapsed() < REMEMBER);
        }
    }

    async fn drive_work(&self) {
        let batch: Vec<Work> = {
            let mut w = self.forgetting.work.lock().expect("forget lock");
            let n = w.len().min(CONCURRENT);
            w.drain(..n).collect()
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
                    "a committed transaction's parts were not all confirmed; its anchor keeps its decision"
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

    /// One round for `w`: its prepared parts' ends and its part ranges' commits, as far as
    /// they can be confirmed now. Answers `w` and the part ranges confirmed this round.
    async fn drive(&self, mut w: Work) -> (Work, Vec<u64>) {
        let mut nodes = Vec::new();
        for n in std::mem::take(&mut w.nodes) {
            if !self.end_prepared(n, &w.database, &w.name).await {
                nodes.push(n);
            }
        }
        w.nodes = nodes;
        let mut confirmed = Vec::new();
        let mut parts = Vec::new();
        for r in std::mem::take(&mut w.parts) {
            match self.copy_decision(r, &w.gid, true).await {
                Ok(Some(true)) => confirmed.push(r),
                // Sealed or dropped (no copies), or a record that is not the commit: never
                // forget the anchor's.
                Ok(_) => w.keep_anchor = true,
                Err(_) => parts.push(r),
            }
        }
        w.parts = parts;
        (w, confirmed)
    }

    /// Whether node `n` confirms that its part `name` of a committed transaction has ended.
    async fn end_prepared(&self, n: u64, database: &str, name: &str) -> bool {
        let Some(addr) = self.node_addr(n) else {
            return false;
        };
        let req = PeerRequest::FinishPrepared {
            database: database.to_string(),
            name: name.to_string(),
            commit: true,
        };
        matches!(
            self.transport
                .call(&addr, req, Duration::from_secs(5))
                .await,
            Ok(PeerResponse::Exec { .. })
        )
    }

    fn node_addr(&self, n: u64) -> Option<String> {
        self.meta.read(|s| {
            s.nodes()
                .find(|x| x.node_id == n)
                .map(|x| x.rpc_addr.clone())
        })
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
            g => PeerResponse::NotLeader {
                leader_id: g.and_then(|g| g.raft.metrics().borrow().current_leader),
                leader_addr: None,
            },
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
