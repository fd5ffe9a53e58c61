//! Durable storage for every range Raft group of a node: one redb file
//! (`DATA_DIR/ranges.redb`), keyed by range id, so that a node carrying many ranges has one
//! file and one fsync stream rather than one per range.
//!
//! The state machine of a range is its rows in PostgreSQL, written by the range's applier
//! ([`super::apply`]) in log order from this log. openraft's "applied" here means committed
//! and handed to that applier: the applier keeps its own durable cursor in PostgreSQL, in the
//! same transaction as the rows, and re-reads entries from this log after a crash. A snapshot
//! ([`super::snapshot`]) is built from PostgreSQL at the applier's cursor, kept as a file
//! (`DATA_DIR/range-snapshots/<range>.snap`, its meta in redb), sent to replicas that need
//! entries the log no longer has, and lets openraft purge the log up to it.

#![allow(clippy::result_large_err)]

use super::types::{RangeConfig, RangeNode, TxnKind};
use openraft::storage::{LogFlushed, LogState, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    AnyError, Entry, EntryPayload, LogId, OptionalSend, RaftLogReader, RaftSnapshotBuilder,
    SnapshotMeta, StorageError, StorageIOError, StoredMembership, Vote,
};
use redb::{Database, Durability, ReadableTable, TableDefinition, TableHandle};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::{Bound, RangeBounds};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The state machine's applied log id and membership, as stored.
type AppliedState = (Option<LogId<u64>>, StoredMembership<u64, RangeNode>);

const LOG: TableDefinition<(u64, u64), &[u8]> = TableDefinition::new("range_log");
const META: TableDefinition<(u64, &str), &[u8]> = TableDefinition::new("range_meta");
/// Two-phase commit decisions this node knows, by transaction (1 commit, 0 abort): commits
/// from any range's log (only a coordinator proposes one), aborts only on the coordinator's
/// word (its own decision, `FinishPrepared`, the sweep's resolution of a prepared transaction
/// held here) or a part's failed prepare here (certain). Never an abort read from a log: an anchor that forgot a commit can record a
/// late abort anew, and a node record is what other ranges' appliers here may go by
/// (ARCHITECTURE.md §8.5, "Forgetting decisions", rule 3). A cache: `Forget` entries delete it.
const DECISIONS: TableDefinition<&str, u8> = TableDefinition::new("txn_decisions");
/// The decisions each range's log recorded, by (range, transaction): (1 commit / 0 abort,
/// the index of the `Decide` entry that recorded it, or of the snapshot that carried it; 0:
/// recorded before indexes were kept). Part of the range's replicated state: a snapshot at
/// index I carries those recorded at or below I, so a replica that joined from it answers as
/// one that applied the whole log, and never holds an abort recorded anew after a `Forget`
/// unless its cursor is past that `Forget` too (§8.5, "Forgetting decisions", rule 6).
const RANGE_DECISIONS: TableDefinition<(u64, &str), (u8, u64)> =
    TableDefinition::new("range_decisions_at");
/// What the coordinator's `Decide` said its decision leaves to forget, by (range,
/// transaction): a JSON [`StoredPlan`] (a presumed abort's has no plan). Kept beside the range's record, replicated like it
/// (snapshots carry those up to their index) and forgotten with it, so that the anchor's
/// leader, whichever node that is, can drive a forget its coordinator did not finish.
const RANGE_PLANS: TableDefinition<(u64, &str), &[u8]> = TableDefinition::new("range_plans");
/// [`RANGE_DECISIONS`] as kept before each record had its index (the second value was the
/// entry's time): moved into it, with index 0, when the store opens.
const OLD_RANGE_DECISIONS: TableDefinition<(u64, &str), (u8, u64)> =
    TableDefinition::new("range_decisions");
/// The index of the range's `Seal` entry, once applied here.
const SEALED: &str = "sealed";
const VOTE: &str = "vote";
const COMMITTED: &str = "committed";
const APPLIED: &str = "applied";
const PURGED: &str = "purged";
/// Whether a purge removed entries with rows, or a snapshot with rows was installed: the log
/// alone no longer tells whether this replica has seen rows.
const PURGED_DATA: &str = "purged_data";
const SNAPSHOT: &str = "snapshot";
/// A purge openraft asked for that waits until the state machine has applied up to it.
const PENDING_PURGE: &str = "pending_purge";
/// Which incarnation of this node's replica of the range the stored state belongs to: bumped
/// when the replica is removed, so that a stopped member's late writes (openraft's state
/// machine worker and snapshot tasks outlive `shutdown`) cannot land in the state of the
/// replica that replaces it. Every write checks it in its own transaction.
const INCARNATION: &str = "incarnation";
/// A snapshot is rebuilt only once the applier is this many entries past the last one.
const REBUILD_AFTER: u64 = 64;

type SErr = StorageError<u64>;

/// Opens (creating if needed) the node's range store in `dir`.
pub fn open_db(dir: &Path) -> anyhow::Result<Arc<Database>> {
    let db = Database::create(dir.join("ranges.redb"))?;
    let tx = db.begin_write()?;
    tx.open_table(LOG)?;
    tx.open_table(META)?;
    tx.open_table(DECISIONS)?;
    tx.open_table(RANGE_DECISIONS)?;
    tx.open_table(RANGE_PLANS)?;
    let old = tx
        .list_tables()?
        .any(|t| t.name() == OLD_RANGE_DECISIONS.name());
    if old {
        {
            let from = tx.open_table(OLD_RANGE_DECISIONS)?;
            let mut to = tx.open_table(RANGE_DECISIONS)?;
            for kv in from.iter()? {
                let (k, v) = kv?;
                let (range, gid) = k.value();
                to.insert((range, gid), (v.value().0, 0))?;
            }
        }
        tx.delete_table(OLD_RANGE_DECISIONS)?;
    }
    tx.commit()?;
    Ok(Arc::new(db))
}

fn get<T: DeserializeOwned>(
    db: &Database,
    range: u64,
    key: &str,
) -> Result<Option<T>, redb::Error> {
    let tx = db.begin_read()?;
    let t = tx.open_table(META)?;
    let v = t.get((range, key))?;
    Ok(v.and_then(|v| serde_json::from_slice(v.value()).ok()))
}

/// The current incarnation of this node's replica of `range` (0 before any was removed).
pub fn incarnation(db: &Database, range: u64) -> Result<u64, redb::Error> {
    Ok(get::<u64>(db, range, INCARNATION)?.unwrap_or(0))
}

/// Whether `inc` is still the current incarnation of `range`, read in the write transaction
/// that is about to change its state.
fn current(tx: &redb::WriteTransaction, range: u64, inc: u64) -> Result<bool, redb::Error> {
    let t = tx.open_table(META)?;
    let stored = t
        .get((range, INCARNATION))?
        .and_then(|v| serde_json::from_slice::<u64>(v.value()).ok())
        .unwrap_or(0);
    Ok(stored == inc)
}

fn put<T: Serialize>(
    db: &Database,
    (range, inc): (u64, u64),
    key: &str,
    v: &T,
    durable: bool,
) -> Result<(), redb::Error> {
    let bytes = serde_json::to_vec(v).expect("storage records serialize");
    crate::blocking::run(|| {
        let mut tx = db.begin_write()?;
        if !current(&tx, range, inc)? {
            return Ok(());
        }
        if !durable {
            // Made durable by the next durable commit (every log append is one). Not
            // `Eventual`: on Linux redb syncs the file for that too, which cost each range
            // three fdatasyncs per entry (append, commit index, applied mark), not one.
            tx.set_durability(Durability::None);
        }
        tx.open_table(META)?
            .insert((range, key), bytes.as_slice())?;
        tx.commit()?;
        Ok(())
    })
}

fn io(e: impl Into<redb::Error>, f: impl FnOnce(AnyError) -> StorageIOError<u64>) -> SErr {
    let e: redb::Error = e.into();
    f(AnyError::error(e)).into()
}

/// Reads committed entries `from..=to` of `range` for the applier.
pub fn read_entries(
    db: &Database,
    range: u64,
    from: u64,
    to: u64,
) -> Result<Vec<Entry<RangeConfig>>, redb::Error> {
    read_entries_within(db, range, from, to, usize::MAX)
}

/// [`read_entries`], stopping before the entry that would take the entries read past
/// `budget` bytes (as stored); at least one entry when there is one.
pub fn read_entries_within(
    db: &Database,
    range: u64,
    from: u64,
    to: u64,
    budget: usize,
) -> Result<Vec<Entry<RangeConfig>>, redb::Error> {
    let tx = db.begin_read()?;
    let t = tx.open_table(LOG)?;
    let mut out = Vec::new();
    let mut bytes = 0usize;
    for kv in t.range((range, from)..=(range, to))? {
        let (_, v) = kv?;
        let value = v.value();
        bytes = bytes.saturating_add(value.len());
        if bytes > budget && !out.is_empty() {
            break;
        }
        out.push(serde_json::from_slice(value).expect("log entries decode"));
    }
    Ok(out)
}

/// The decision recorded here for two-phase commit `gid`, if any.
pub fn decision(db: &Database, gid: &str) -> Result<Option<bool>, redb::Error> {
    let tx = db.begin_read()?;
    let t = tx.open_table(DECISIONS)?;
    Ok(t.get(gid)?.map(|v| v.value() == 1))
}

/// How many decisions this node records (`txn_decisions`), its ranges' records hold in all
/// (`range_decisions_at`), and how many plans they keep (`range_plans`): what forgetting
/// keeps small (`/metrics`).
pub fn decision_counts(db: &Database) -> Result<(u64, u64, u64), redb::Error> {
    use redb::ReadableTableMetadata;
    let tx = db.begin_read()?;
    let node = tx.open_table(DECISIONS)?.len()?;
    let ranges = tx.open_table(RANGE_DECISIONS)?.len()?;
    let plans = tx.open_table(RANGE_PLANS)?.len()?;
    Ok((node, ranges, plans))
}

/// The decision range `range`'s own log recorded for `gid` (its first `Decide` for it), if
/// this replica has applied it.
pub fn range_decision(db: &Database, range: u64, gid: &str) -> Result<Option<bool>, redb::Error> {
    let tx = db.begin_read()?;
    let t = tx.open_table(RANGE_DECISIONS)?;
    Ok(t.get((range, gid))?.map(|v| v.value().0 == 1))
}

/// Every decision range `range`'s log recorded at or below index `upto`, however old, and
/// not forgotten since: (transaction, commit).
pub fn range_decisions(
    db: &Database,
    range: u64,
    upto: u64,
) -> Result<Vec<(String, bool)>, redb::Error> {
    let tx = db.begin_read()?;
    let t = tx.open_table(RANGE_DECISIONS)?;
    let mut out = Vec::new();
    for kv in t.range((range, "")..)? {
        let (k, v) = kv?;
        let (r, gid) = k.value();
        if r != range {
            break;
        }
        let (commit, index) = v.value();
        if index <= upto {
            out.push((gid.to_string(), commit == 1));
        }
    }
    Ok(out)
}

/// Forgets range `range`'s records of transactions `gids` (and their plans), and this
/// node's: done by the range's applier at its `Forget` entry, so past every `Prepare` entry
/// of theirs in this replica's log (rule 5). Nothing needs them again: their coordinator (or
/// the anchor's leader, on its plan) had every part range's log hold the decision and every
/// prepared part end first. Answers the range's records forgotten (transaction, commit).
/// Without `range`, only this node's records (the coordinator's, once it is done with them).
/// `plans_only`: only the range's plans go (a part could not be confirmed; the anchor keeps
/// its record for good).
pub fn forget_decisions(
    db: &Database,
    range: Option<u64>,
    gids: &[String],
    plans_only: bool,
) -> Result<Vec<(String, bool)>, redb::Error> {
    crate::blocking::run(|| {
        // Synced (one per `Forget` entry, which batches many): the applier's cursor moves past
        // the entry next, durably, and a deletion lost in a crash would never be done again.
        let tx = db.begin_write()?;
        let mut forgot = Vec::new();
        {
            let mut node = tx.open_table(DECISIONS)?;
            let mut mine = tx.open_table(RANGE_DECISIONS)?;
            let mut plans = tx.open_table(RANGE_PLANS)?;
            for gid in gids {
                if let Some(r) = range {
                    let plan = plans
                        .remove((r, gid.as_str()))?
                        .and_then(|v| serde_json::from_slice::<StoredPlan>(v.value()).ok());
                    if plans_only {
                        // An abort's plan becomes presumed: the range forgets the record once
                        // no commit can follow. A commit's record stays.
                        let abort = mine
                            .get((r, gid.as_str()))?
                            .is_some_and(|v| v.value().0 == 0);
                        if let (Some(mut p), true) = (plan, abort) {
                            p.presumed = true;
                            p.plan = mr_wire::peer::ForgetPlan::default();
                            let bytes = serde_json::to_vec(&p).expect("plans serialize");
                            plans.insert((r, gid.as_str()), bytes.as_slice())?;
                        }
                        continue;
                    }
                    if let Some(v) = mine.remove((r, gid.as_str()))? {
                        forgot.push((gid.clone(), v.value().0 == 1));
                    }
                }
                node.remove(gid.as_str())?;
            }
        }
        tx.commit()?;
        Ok(forgot)
    })
}

/// A coordinator's plan as range records keep it ([`RANGE_PLANS`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoredPlan {
    /// The index of the `Decide` entry that carried it (a snapshot carries those up to its
    /// own index).
    pub index: u64,
    /// When its `Decide` was proposed (the proposer's clock, Unix ms).
    pub at_ms: u64,
    pub plan: mr_wire::peer::ForgetPlan,
    /// No coordinator's plan: an abort recorded without one (a sweep's or an applier's, a
    /// copy, one recorded anew), forgotten by the range itself once no commit can follow it
    /// (`twophase::forget_presumed_after`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub presumed: bool,
}

/// The plans range `range` keeps, with the range's record of each (`None`: not applied here
/// yet), of `Decide` entries proposed before `before_ms` (all of them with `u64::MAX`).
pub fn range_plans(
    db: &Database,
    range: u64,
    before_ms: u64,
) -> Result<Vec<(String, Option<bool>, StoredPlan)>, redb::Error> {
    let tx = db.begin_read()?;
    let plans = tx.open_table(RANGE_PLANS)?;
    let records = tx.open_table(RANGE_DECISIONS)?;
    let mut out = Vec::new();
    for kv in plans.range((range, "")..(range + 1, ""))? {
        let (k, v) = kv?;
        let Ok(p) = serde_json::from_slice::<StoredPlan>(v.value()) else {
            continue;
        };
        if p.at_ms >= before_ms {
            continue;
        }
        let gid = k.value().1.to_string();
        let record = records
            .get((range, gid.as_str()))?
            .map(|v| v.value().0 == 1);
        out.push((gid, record, p));
    }
    Ok(out)
}

/// Keeps the plans a snapshot of `range` carries (one kept here already stands).
pub fn install_range_plans(
    db: &Database,
    range: u64,
    plans: &[(String, StoredPlan)],
) -> Result<(), redb::Error> {
    if plans.is_empty() {
        return Ok(());
    }
    crate::blocking::run(|| {
        let tx = db.begin_write()?;
        {
            let mut t = tx.open_table(RANGE_PLANS)?;
            for (gid, p) in plans {
                if t.get((range, gid.as_str()))?.is_none() {
                    let bytes = serde_json::to_vec(p).expect("plans serialize");
                    t.insert((range, gid.as_str()), bytes.as_slice())?;
                }
            }
        }
        tx.commit()?;
        Ok(())
    })
}

/// Records the decisions a snapshot of `range` at `index` carries, as its log recorded them
/// (a decision known here already stands: both are the transaction's one decision); the
/// commits are this node's records too.
pub fn install_range_decisions(
    db: &Database,
    range: u64,
    decisions: &[(String, bool)],
    sealed_at: Option<u64>,
    index: u64,
) -> Result<(), redb::Error> {
    if decisions.is_empty() && sealed_at.is_none() {
        return Ok(());
    }
    crate::blocking::run(|| {
        let tx = db.begin_write()?;
        if let Some(index) = sealed_at {
            let at = serde_json::to_vec(&index).expect("numbers serialize");
            tx.open_table(META)?
                .insert((range, SEALED), at.as_slice())?;
        }
        {
            let mut t = tx.open_table(DECISIONS)?;
            let mut mine = tx.open_table(RANGE_DECISIONS)?;
            for (gid, commit) in decisions {
                if *commit && t.get(gid.as_str())?.is_none() {
                    t.insert(gid.as_str(), 1)?;
                }
                if mine.get((range, gid.as_str()))?.is_none() {
                    mine.insert((range, gid.as_str()), (u8::from(*commit), index))?;
                }
            }
        }
        tx.commit()?;
        Ok(())
    })
}

/// The index of range `range`'s `Seal` entry, if this replica applied it (or installed a
/// snapshot that knew it).
pub fn sealed_at(db: &Database, range: u64) -> Result<Option<u64>, redb::Error> {
    get::<u64>(db, range, SEALED)
}

/// Whether this node applied range `range`'s `Seal` entry (and still holds its replica).
pub fn sealed(db: &Database, range: u64) -> Result<bool, redb::Error> {
    Ok(sealed_at(db, range)?.is_some())
}

/// Records `gid`'s decision on its coordinator's word (unless one is known): the coordinator's
/// own, a `FinishPrepared` from it, or the anchor's answer about a prepared transaction held
/// here (its coordinator had it end before the decision could be forgotten). Or an abort on
/// a part's failed prepare here, which makes it certain.
pub fn learn_decision(db: &Database, gid: &str, commit: bool) -> Result<bool, redb::Error> {
    crate::blocking::run(|| {
        let tx = db.begin_write()?;
        let decided = {
            let mut t = tx.open_table(DECISIONS)?;
            let known = t.get(gid)?.map(|v| v.value() == 1);
            match known {
                Some(d) => d,
                None => {
                    t.insert(gid, u8::from(commit))?;
                    commit
                }
            }
        };
        tx.commit()?;
        Ok(decided)
    })
}

/// Whether `range`'s log holds a transaction's rows at or below `to` (stops at the first), or
/// held them before a purge.
pub fn has_data_entries(db: &Database, range: u64, to: u64) -> Result<bool, redb::Error> {
    if get::<bool>(db, range, PURGED_DATA)?.unwrap_or(false) {
        return Ok(true);
    }
    let tx = db.begin_read()?;
    let t = tx.open_table(LOG)?;
    for kv in t.range((range, 0)..=(range, to))? {
        let (_, v) = kv?;
        let e: Entry<RangeConfig> = serde_json::from_slice(v.value()).expect("log entries decode");
        if matches!(e.payload, openraft::EntryPayload::Normal(_)) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Where incarnation `inc` of `range`'s replica keeps its latest snapshot.
pub fn snapshot_path(dir: &Path, range: u64, inc: u64) -> PathBuf {
    dir.join("range-snapshots")
        .join(format!("{range}-{inc}.snap"))
}

/// Forgets everything stored for `range` (this node no longer holds a replica of it) and
/// starts a new incarnation, which the state of a later replica here belongs to.
pub fn remove_range(db: &Database, dir: &Path, range: u64) -> Result<(), redb::Error> {
    let inc = incarnation(db, range)?;
    let _ = std::fs::remove_file(snapshot_path(dir, range, inc));
    crate::blocking::run(|| {
        let tx = db.begin_write()?;
        tx.open_table(LOG)?
            .retain_in((range, 0)..=(range, u64::MAX), |_, _| false)?;
        // The range's record of its decisions goes with its replica (a replica added again
        // gets them from its snapshot), unless the range was sealed: once it is dropped, the
        // node that applied the seal answers for them from these (`sealed_decision`).
        let sealed = tx.open_table(META)?.get((range, SEALED))?.is_some();
        if !sealed {
            tx.open_table(RANGE_DECISIONS)?
                .retain_in((range, "")..(range + 1, ""), |_, _| false)?;
        }
        // Plans are for the range's leader to drive; a sealed range forgets nothing.
        tx.open_table(RANGE_PLANS)?
            .retain_in((range, "")..(range + 1, ""), |_, _| false)?;
        {
            let mut m = tx.open_table(META)?;
            m.retain(|(r, _), _| r != range)?;
            let next = serde_json::to_vec(&(inc + 1)).expect("numbers serialize");
            m.insert((range, INCARNATION), next.as_slice())?;
        }
        tx.commit()?;
        Ok(())
    })
}

/// One range's log and vote.
#[derive(Clone)]
pub struct LogStore {
    pub db: Arc<Database>,
    pub range: u64,
    /// This replica's incarnation ([`incarnation`]).
    pub inc: u64,
}

/// The most one AppendEntries carries (a single larger entry travels alone): each must
/// arrive, be decoded and be made durable within a heartbeat interval (see `ENTRY_BYTES`);
/// 2 MiB took longer than that across the WAN on a busy 2-core machine, and every retry
/// resent the same batch.
const APPEND_BYTES: usize = 512 << 10;

impl RaftLogReader<RangeConfig> for LogStore {
    async fn limited_get_log_entries(
        &mut self,
        start: u64,
        end: u64,
    ) -> Result<Vec<Entry<RangeConfig>>, SErr> {
        if end <= start {
            return Ok(Vec::new());
        }
        read_entries_within(&self.db, self.range, start, end - 1, APPEND_BYTES)
            .map_err(|e| io(e, StorageIOError::read_logs))
    }

    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<RangeConfig>>, SErr> {
        let read = || -> Result<Vec<Entry<RangeConfig>>, redb::Error> {
            let tx = self.db.begin_read()?;
            let t = tx.open_table(LOG)?;
            let start = match range.start_bound() {
                Bound::Included(i) => Bound::Included((self.range, *i)),
                Bound::Excluded(i) => Bound::Excluded((self.range, *i)),
                Bound::Unbounded => Bound::Included((self.range, 0)),
            };
            let end = match range.end_bound() {
                Bound::Included(i) => Bound::Included((self.range, *i)),
                Bound::Excluded(i) => Bound::Excluded((self.range, *i)),
                Bound::Unbounded => Bound::Included((self.range, u64::MAX)),
            };
            let mut out = Vec::new();
            for kv in t.range::<(u64, u64)>((start, end))? {
                let (_, v) = kv?;
                out.push(serde_json::from_slice(v.value()).expect("log entries decode"));
            }
            Ok(out)
        };
        read().map_err(|e| io(e, StorageIOError::read_logs))
    }
}

impl RaftLogStorage<RangeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<RangeConfig>, SErr> {
        let read = || -> Result<LogState<RangeConfig>, redb::Error> {
            let tx = self.db.begin_read()?;
            let t = tx.open_table(LOG)?;
            let last = match t
                .range((self.range, 0)..=(self.range, u64::MAX))?
                .next_back()
            {
                Some(kv) => {
                    let (_, v) = kv?;
                    let e: Entry<RangeConfig> =
                        serde_json::from_slice(v.value()).expect("log entries decode");
                    Some(e.log_id)
                }
                None => None,
            };
            drop(t);
            drop(tx);
            let purged: Option<LogId<u64>> = get(&self.db, self.range, PURGED)?;
            Ok(LogState {
                last_purged_log_id: purged,
                last_log_id: last.or(purged),
            })
        };
        read().map_err(|e| io(e, StorageIOError::read_logs))
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<u64>) -> Result<(), SErr> {
        put(&self.db, (self.range, self.inc), VOTE, vote, true)
            .map_err(|e| io(e, StorageIOError::write_vote))
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<u64>>, SErr> {
        get(&self.db, self.range, VOTE).map_err(|e| io(e, StorageIOError::read_vote))
    }

    async fn save_committed(&mut self, committed: Option<LogId<u64>>) -> Result<(), SErr> {
        put(
            &self.db,
            (self.range, self.inc),
            COMMITTED,
            &committed,
            false,
        )
        .map_err(|e| io(e, StorageIOError::write))
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<u64>>, SErr> {
        Ok(get::<Option<LogId<u64>>>(&self.db, self.range, COMMITTED)
            .map_err(|e| io(e, StorageIOError::read))?
            .flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<RangeConfig>) -> Result<(), SErr>
    where
        I: IntoIterator<Item = Entry<RangeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let write = || -> Result<(), redb::Error> {
            let tx = self.db.begin_write()?;
            if !current(&tx, self.range, self.inc)? {
                return Ok(());
            }
            {
                let mut t = tx.open_table(LOG)?;
                for e in entries {
                    let bytes = serde_json::to_vec(&e).expect("log entries serialize");
                    t.insert((self.range, e.log_id.index), bytes.as_slice())?;
                }
            }
            tx.commit()?;
            Ok(())
        };
        let result = crate::blocking::run(write);
        let flushed = result
            .as_ref()
            .map(|_| ())
            .map_err(|e| std::io::Error::other(e.to_string()));
        callback.log_io_completed(flushed);
        result.map_err(|e| io(e, StorageIOError::write_logs))
    }

    async fn truncate(&mut self, log_id: LogId<u64>) -> Result<(), SErr> {
        let write = || -> Result<(), redb::Error> {
            let tx = self.db.begin_write()?;
            if !current(&tx, self.range, self.inc)? {
                return Ok(());
            }
            tx.open_table(LOG)?.retain_in(
                (self.range, log_id.index)..=(self.range, u64::MAX),
                |_, _| false,
            )?;
            tx.commit()?;
            Ok(())
        };
        crate::blocking::run(write).map_err(|e| io(e, StorageIOError::write_logs))
    }

    /// Removes entries up to `log_id` (which may lie past the last entry, after a snapshot was
    /// installed), remembering whether any held rows — once the state machine has applied
    /// them. openraft 0.9 purges the log up to a snapshot it received at once, concurrently
    /// with the state machine installing it: done here, a crash in between would leave a
    /// replica whose log starts past everything it applied, which openraft refuses to start
    /// (and whose rows no snapshot here holds). So a purge past the applied entry waits
    /// ([`PENDING_PURGE`]) for the install to record it (or is forgotten by a crash, leaving
    /// the replica as it was before the snapshot came, to be sent it again).
    async fn purge(&mut self, log_id: LogId<u64>) -> Result<(), SErr> {
        let write = || -> Result<(), redb::Error> {
            let tx = self.db.begin_write()?;
            if !current(&tx, self.range, self.inc)? {
                return Ok(());
            }
            let applied = {
                let m = tx.open_table(META)?;
                let v = m.get((self.range, APPLIED))?;
                v.and_then(|v| serde_json::from_slice::<AppliedState>(v.value()).ok())
                    .and_then(|(last, _)| last)
                    .map(|l| l.index)
            };
            // Nothing applied yet waits too, even for a purge up to entry 0 (a new range's
            // first snapshot): recorded, it would outlive a crash before the install and
            // leave openraft a purged log with nothing committed, which it refuses to start.
            if applied.is_none_or(|a| a < log_id.index) {
                let bytes = serde_json::to_vec(&log_id).expect("log ids serialize");
                tx.open_table(META)?
                    .insert((self.range, PENDING_PURGE), bytes.as_slice())?;
            } else {
                purge_in(&tx, self.range, log_id)?;
            }
            tx.commit()?;
            Ok(())
        };
        crate::blocking::run(write).map_err(|e| io(e, StorageIOError::write_logs))
    }
}

/// Removes `range`'s entries up to `log_id` in `tx` and records the purge (see
/// [`LogStore::purge`]).
fn purge_in(
    tx: &redb::WriteTransaction,
    range: u64,
    log_id: LogId<u64>,
) -> Result<(), redb::Error> {
    let mut data = false;
    {
        let mut t = tx.open_table(LOG)?;
        t.retain_in((range, 0)..=(range, log_id.index), |_, v| {
            if !data {
                let e: Entry<RangeConfig> = serde_json::from_slice(v).expect("log entries decode");
                data = matches!(e.payload, EntryPayload::Normal(_));
            }
            false
        })?;
    }
    let mut m = tx.open_table(META)?;
    let pending = m
        .get((range, PENDING_PURGE))?
        .and_then(|v| serde_json::from_slice::<LogId<u64>>(v.value()).ok());
    if pending.is_some_and(|p| p.index <= log_id.index) {
        m.remove((range, PENDING_PURGE))?;
    }
    let bytes = serde_json::to_vec(&log_id).expect("log ids serialize");
    m.insert((range, PURGED), bytes.as_slice())?;
    if data {
        m.insert((range, PURGED_DATA), b"true".as_slice())?;
    }
    Ok(())
}

/// Carries out a purge that waited for the state machine ([`LogStore::purge`]) once it has
/// applied up to `applied`.
fn purge_pending(tx: &redb::WriteTransaction, range: u64, applied: u64) -> Result<(), redb::Error> {
    let pending = tx
        .open_table(META)?
        .get((range, PENDING_PURGE))?
        .and_then(|v| serde_json::from_slice::<LogId<u64>>(v.value()).ok());
    match pending {
        Some(p) if p.index <= applied => purge_in(tx, range, p),
        _ => Ok(()),
    }
}

/// What the range's state machine has handed on: the last committed entry and membership.
pub struct Applied {
    pub last: Option<LogId<u64>>,
    pub membership: StoredMembership<u64, RangeNode>,
}

/// The range's state machine as openraft sees it: it records how far the log is committed
/// and wakes the range's applier, which writes the rows.
#[derive(Clone)]
pub struct StateMachine {
    pub db: Arc<Database>,
    pub range: u64,
    /// This replica's incarnation ([`incarnation`]).
    inc: u64,
    pub applied: Arc<Mutex<Applied>>,
    /// The highest committed index, for the applier and for commit waits.
    pub committed: Arc<watch::Sender<u64>>,
    /// This node's rows of the range, for snapshots.
    source: Arc<super::snapshot::Source>,
    /// Where snapshots are kept.
    dir: PathBuf,
    /// Cancelled when the group stops: snapshot work, which retries, gives up then.
    stop: CancellationToken,
}

/// Snapshot work retries (PostgreSQL restarting, a schema change not applied here yet) at
/// this pace until it succeeds or the group stops: openraft treats a storage error as fatal.
const SNAPSHOT_RETRY: Duration = Duration::from_millis(500);

impl StateMachine {
    pub fn open(
        db: Arc<Database>,
        (range, inc): (u64, u64),
        source: super::snapshot::Source,
        dir: &Path,
        stop: CancellationToken,
    ) -> anyhow::Result<StateMachine> {
        // A purge that waited for a snapshot install a crash cut short is void: openraft
        // starts from the log as it is and asks for the snapshot again.
        crate::blocking::run(|| -> Result<(), redb::Error> {
            let tx = db.begin_write()?;
            if current(&tx, range, inc)? {
                tx.open_table(META)?.remove((range, PENDING_PURGE))?;
            }
            Ok(tx.commit()?)
        })?;
        let stored: Option<AppliedState> = get(&db, range, APPLIED)?;
        let (last, membership) = stored.unwrap_or_default();
        let (committed, _) = watch::channel(last.map_or(0, |l| l.index));
        std::fs::create_dir_all(dir.join("range-snapshots"))?;
        Ok(StateMachine {
            db,
            range,
            inc,
            applied: Arc::new(Mutex::new(Applied { last, membership })),
            committed: Arc::new(committed),
            source: Arc::new(source),
            dir: dir.to_path_buf(),
            stop,
        })
    }

    fn snapshot_error(&self, why: String) -> SErr {
        io(redb::Error::Io(std::io::Error::other(why)), |e| {
            StorageIOError::write_snapshot(None, e)
        })
    }

    /// The latest snapshot built or installed here.
    fn current(&self) -> Result<Option<Snapshot<RangeConfig>>, SErr> {
        let meta: Option<SnapshotMeta<u64, RangeNode>> = get(&self.db, self.range, SNAPSHOT)
            .map_err(|e| io(e, |e| StorageIOError::read_snapshot(None, e)))?;
        let Some(meta) = meta else {
            return Ok(None);
        };
        let data = std::fs::read(snapshot_path(&self.dir, self.range, self.inc))
            .map_err(|e| SErr::from(StorageIOError::read_snapshot(Some(meta.signature()), &e)))?;
        Ok(Some(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        }))
    }

    /// Keeps `data` as the latest snapshot (the file first, then its meta).
    fn keep(&self, meta: &SnapshotMeta<u64, RangeNode>, data: &[u8]) -> Result<(), SErr> {
        let path = snapshot_path(&self.dir, self.range, self.inc);
        let tmp = path.with_extension("tmp");
        let w = || -> std::io::Result<()> {
            std::fs::write(&tmp, data)?;
            std::fs::File::open(&tmp)?.sync_all()?;
            std::fs::rename(&tmp, &path)
        };
        crate::blocking::run(w)
            .map_err(|e| SErr::from(StorageIOError::write_snapshot(Some(meta.signature()), &e)))?;
        put(&self.db, (self.range, self.inc), SNAPSHOT, meta, true).map_err(|e| {
            io(e, |e| {
                StorageIOError::write_snapshot(Some(meta.signature()), e)
            })
        })
    }

    /// The log id of entry `index` and the membership in force at it, from the log, the
    /// purge mark or the latest snapshot.
    fn at(
        &self,
        index: u64,
        current: Option<&SnapshotMeta<u64, RangeNode>>,
    ) -> Result<(LogId<u64>, StoredMembership<u64, RangeNode>), String> {
        let e = |e: redb::Error| format!("reading range {}'s log: {e}", self.range);
        let entries = read_entries(&self.db, self.range, 0, index).map_err(e)?;
        let purged: Option<LogId<u64>> = get(&self.db, self.range, PURGED).map_err(e)?;
        let log_id = entries
            .last()
            .filter(|en| en.log_id.index == index)
            .map(|en| en.log_id)
            .or(purged.filter(|p| p.index == index))
            .or(current
                .and_then(|c| c.last_log_id)
                .filter(|l| l.index == index))
            .ok_or_else(|| format!("range {}: entry {index} is not in the log", self.range))?;
        let membership = entries
            .iter()
            .rev()
            .find_map(|en| match &en.payload {
                EntryPayload::Membership(m) => {
                    Some(StoredMembership::new(Some(en.log_id), m.clone()))
                }
                _ => None,
            })
            .or_else(|| current.map(|c| c.last_membership.clone()))
            .or_else(|| {
                let a = self.applied.lock().expect("applied lock");
                let m = a.membership.clone();
                (m.log_id().is_none_or(|l| l.index <= index)).then_some(m)
            })
            .ok_or_else(|| format!("range {}: no membership at entry {index}", self.range))?;
        Ok((log_id, membership))
    }

    async fn build(&self) -> Result<Snapshot<RangeConfig>, String> {
        let current = self.current().map_err(|e| e.to_string())?;
        let cursor = self.source.cursor(self.range).await?;
        if let Some(c) = current.as_ref() {
            let at = c.meta.last_log_id.map_or(0, |l| l.index);
            if cursor < at + REBUILD_AFTER {
                return Ok(current.expect("checked above"));
            }
        }
        let (header, data) = self.source.build(&self.db, self.range).await?;
        let (last_log_id, last_membership) =
            self.at(header.index, current.as_ref().map(|c| &c.meta))?;
        let meta = SnapshotMeta {
            last_log_id: Some(last_log_id),
            last_membership,
            snapshot_id: format!(
                "{}-{}-{}-{}",
                self.range,
                last_log_id.leader_id.term,
                header.index,
                crate::node::now_ms()
            ),
        };
        self.keep(&meta, &data).map_err(|e| e.to_string())?;
        tracing::info!(
            range_id = self.range,
            index = header.index,
            rows = header.rows,
            skipped = header.skip.len(),
            bytes = data.len(),
            "built a range snapshot"
        );
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

/// Logs a failed snapshot attempt: quietly at first (PostgreSQL starting, a schema change
/// on its way), as a warning every 10 seconds once it lasts.
fn retrying(range_id: u64, attempt: u64, what: &str, e: &str) {
    if attempt.is_multiple_of(20) {
        tracing::warn!(range_id, attempt, "{what}: {e}; retrying");
    } else {
        tracing::debug!(range_id, attempt, "{what}: {e}; retrying");
    }
}

impl RaftSnapshotBuilder<RangeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<RangeConfig>, SErr> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.build().await {
                Ok(s) => return Ok(s),
                Err(e) => {
                    retrying(self.range, attempt, "building a snapshot", &e);
                    tokio::select! {
                        _ = tokio::time::sleep(SNAPSHOT_RETRY) => {}
                        _ = self.stop.cancelled() => return Err(self.snapshot_error(e)),
                    }
                }
            }
        }
    }
}

/// What the state machine records of an entry, in log order.
enum Recorded {
    /// A `Decide` entry, answered in `out[slot]`: its proposer's time, and its coordinator's
    /// plan if it is the coordinator's proposal.
    Decide {
        slot: usize,
        gid: String,
        commit: bool,
        index: u64,
        at_ms: u64,
        plan: Option<mr_wire::peer::ForgetPlan>,
    },
    Seal {
        index: u64,
    },
}

/// Records the decisions and seal a batch of range `range`'s entries carries, in `tx`: the
/// first `Decide` per transaction in the range's log is its decision there (after the seal,
/// only abort can be first), answered in `out`. A commit is also this node's record of the
/// transaction's decision; an abort never is (see [`DECISIONS`]: after a `Forget` it may be
/// a late abort recorded anew, and a part range's copy of a commit reaching it after its seal
/// is recorded as abort there).
fn record_decisions(
    tx: &redb::WriteTransaction,
    range: u64,
    decides: &[Recorded],
    out: &mut [Option<bool>],
) -> Result<(), redb::Error> {
    let mut sealed_at: Option<u64> = tx
        .open_table(META)?
        .get((range, SEALED))?
        .and_then(|v| serde_json::from_slice(v.value()).ok());
    let mut t = tx.open_table(DECISIONS)?;
    let mut mine = tx.open_table(RANGE_DECISIONS)?;
    let mut plans = tx.open_table(RANGE_PLANS)?;
    for d in decides {
        let (i, gid, commit, index, at_ms, plan) = match d {
            Recorded::Decide {
                slot,
                gid,
                commit,
                index,
                at_ms,
                plan,
            } => (slot, gid, commit, index, *at_ms, plan),
            Recorded::Seal { index } => {
                sealed_at = Some(*index);
                let at = serde_json::to_vec(index).expect("numbers serialize");
                tx.open_table(META)?
                    .insert((range, SEALED), at.as_slice())?;
                continue;
            }
        };
        let known = t.get(gid.as_str())?.map(|v| v.value() == 1);
        let own = mine.get((range, gid.as_str()))?.map(|v| v.value().0 == 1);
        let sealed = sealed_at.is_some_and(|s| *index > s);
        // The range's first `Decide` is its record, whatever this node heard elsewhere: its
        // replicas apply its `Prepare` entries by it, so they must all read the same.
        // After the seal, abort, whatever this node knows: every replica must record the
        // same, and a commit copied in then must not confirm the range to the coordinator
        // (which would let the anchor forget while a lagging replica of this range, which
        // takes no copies, still needs its answer).
        // A coordinator's proposal that arrived long after it began deciding is a stale
        // frame, and one past its commit limit is too late: abort
        // (`twophase::STALE_PROPOSAL`, `twophase::commit_limit`). The times are in the
        // entry, so every replica reads the same.
        let stale = plan.as_ref().is_some_and(|p| {
            (p.since_ms > 0
                && at_ms.saturating_sub(p.since_ms)
                    > super::twophase::STALE_PROPOSAL.as_millis() as u64)
                || (p.commit_by_ms > 0 && at_ms > p.commit_by_ms)
        });
        let decided = match own {
            Some(d) => d,
            None if sealed || stale => false,
            None => *commit,
        };
        if known.is_none() && decided {
            t.insert(gid.as_str(), 1)?;
        }
        if own.is_none() {
            mine.insert((range, gid.as_str()), (u8::from(decided), *index))?;
        }
        // The coordinator's plan, whichever `Decide` made the record: once its proposal is in
        // the log it proposes nothing more, so forgetting the record (commit or abort) on
        // the plan is safe. An abort recorded without one is presumed: forgotten once no
        // commit can follow it. Not in a sealed range, which forgets nothing.
        if !sealed {
            let kept = plans
                .get((range, gid.as_str()))?
                .and_then(|v| serde_json::from_slice::<StoredPlan>(v.value()).ok());
            let p = match plan {
                Some(plan) if kept.as_ref().is_none_or(|k| k.presumed) => Some(StoredPlan {
                    index: *index,
                    at_ms,
                    plan: plan.clone(),
                    presumed: false,
                }),
                None if kept.is_none() && own.is_none() && !decided => Some(StoredPlan {
                    index: *index,
                    at_ms,
                    plan: mr_wire::peer::ForgetPlan::default(),
                    presumed: true,
                }),
                _ => None,
            };
            if let Some(p) = p {
                let bytes = serde_json::to_vec(&p).expect("plans serialize");
                plans.insert((range, gid.as_str()), bytes.as_slice())?;
            }
        }
        out[*i] = Some(decided);
    }
    Ok(())
}

impl RaftStateMachine<RangeConfig> for StateMachine {
    type SnapshotBuilder = StateMachine;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<u64>>, StoredMembership<u64, RangeNode>), SErr> {
        let a = self.applied.lock().expect("applied lock");
        Ok((a.last, a.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Option<bool>>, SErr>
    where
        I: IntoIterator<Item = Entry<RangeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut out = Vec::new();
        let mut decides: Vec<Recorded> = Vec::new();
        let record = {
            let mut a = self.applied.lock().expect("applied lock");
            for e in entries {
                a.last = Some(e.log_id);
                match e.payload {
                    EntryPayload::Membership(m) => {
                        a.membership = StoredMembership::new(Some(e.log_id), m);
                    }
                    EntryPayload::Normal(w) => match w.kind {
                        TxnKind::Decide { gid, commit, plan } => decides.push(Recorded::Decide {
                            slot: out.len(),
                            gid,
                            commit,
                            index: e.log_id.index,
                            at_ms: w.at_ms,
                            plan,
                        }),
                        TxnKind::Seal => decides.push(Recorded::Seal {
                            index: e.log_id.index,
                        }),
                        _ => {}
                    },
                    EntryPayload::Blank => {}
                }
                out.push(None);
            }
            (a.last, a.membership.clone())
        };
        // Not synced (made durable with the next log append): after a crash openraft hands
        // the entries after an older mark again, which only re-announces them (and finds the
        // same first decisions, and purges again); the applier's own cursor is in PostgreSQL.
        let bytes = serde_json::to_vec(&record).expect("storage records serialize");
        let write = || -> Result<(), redb::Error> {
            let mut tx = self.db.begin_write()?;
            if !current(&tx, self.range, self.inc)? {
                return Ok(());
            }
            // A seal's answer is read from this node's decisions once the range is gone, so
            // a batch with one is synced.
            tx.set_durability(
                if decides.iter().any(|d| matches!(d, Recorded::Seal { .. })) {
                    Durability::Immediate
                } else {
                    Durability::None
                },
            );
            tx.open_table(META)?
                .insert((self.range, APPLIED), bytes.as_slice())?;
            purge_pending(&tx, self.range, record.0.map_or(0, |l| l.index))?;
            if !decides.is_empty() {
                record_decisions(&tx, self.range, &decides, &mut out)?;
            }
            tx.commit()?;
            Ok(())
        };
        crate::blocking::run(write).map_err(|e| io(e, StorageIOError::write))?;
        self.committed.send_replace(record.0.map_or(0, |l| l.index));
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, SErr> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    /// Replaces this replica's rows by the snapshot's (in PostgreSQL, with the applier's
    /// cursor), then records it as applied and as the latest snapshot.
    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<u64, RangeNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), SErr> {
        let data = snapshot.into_inner();
        let (header, _) = super::snapshot::parse(&data).map_err(|e| {
            SErr::from(StorageIOError::read_snapshot(
                Some(meta.signature()),
                &std::io::Error::other(e),
            ))
        })?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.source.install(&data).await {
                Ok(installed) => {
                    tracing::info!(
                        range_id = self.range,
                        index = header.index,
                        rows = header.rows,
                        installed,
                        "installed a range snapshot"
                    );
                    break;
                }
                Err(e) => {
                    retrying(self.range, attempt, "installing a snapshot", &e);
                    tokio::select! {
                        _ = tokio::time::sleep(SNAPSHOT_RETRY) => {}
                        _ = self.stop.cancelled() => return Err(self.snapshot_error(e)),
                    }
                }
            }
        }
        install_range_decisions(
            &self.db,
            self.range,
            &header.decisions,
            header.sealed_at,
            header.index,
        )
        .map_err(|e| io(e, StorageIOError::write))?;
        install_range_plans(&self.db, self.range, &header.plans)
            .map_err(|e| io(e, StorageIOError::write))?;
        crate::failpoint::hit(crate::failpoint::SNAPSHOT_AFTER_ROWS);
        if header.rows > 0 || !header.skip.is_empty() {
            put(&self.db, (self.range, self.inc), PURGED_DATA, &true, true)
                .map_err(|e| io(e, StorageIOError::write))?;
        }
        let record = {
            let mut a = self.applied.lock().expect("applied lock");
            a.last = meta.last_log_id;
            a.membership = meta.last_membership.clone();
            (a.last, a.membership.clone())
        };
        put(&self.db, (self.range, self.inc), APPLIED, &record, true)
            .map_err(|e| io(e, StorageIOError::write))?;
        crate::failpoint::hit(crate::failpoint::SNAPSHOT_BEFORE_KEEP);
        self.keep(meta, &data)?;
        let index = meta.last_log_id.map_or(0, |l| l.index);
        let (range, inc) = (self.range, self.inc);
        crate::blocking::run(|| -> Result<(), redb::Error> {
            let tx = self.db.begin_write()?;
            if current(&tx, range, inc)? {
                purge_pending(&tx, range, index)?;
            }
            Ok(tx.commit()?)
        })
        .map_err(|e| io(e, StorageIOError::write_logs))?;
        self.committed.send_modify(|c| *c = (*c).max(index));
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<RangeConfig>>, SErr> {
        self.current()
    }
}

#[cfg(test)]
mod tests {
    use super::Recorded;

    fn decide(slot: usize, gid: &str, commit: bool, index: u64) -> Recorded {
        Recorded::Decide {
            slot,
            gid: gid.into(),
            commit,
            index,
            at_ms: 0,
            plan: None,
        }
    }

    /// Node records take commits from any log and never an abort: a `Decide` for abort may
    /// be a late one recorded anew by an anchor that forgot the commit, and other part
    /// ranges' appliers on this node go by node records. A commit copied after a range's
    /// seal is abort in that range, and no node record either. A sealed range keeps its
    /// records when its replica goes (its sealing node answers from them once it is
    /// dropped); another range's go with it.
    #[test]
    fn node_records_take_commits_from_logs_and_never_an_abort() {
        let dir = tempfile::tempdir().unwrap();
        let db = super::open_db(dir.path()).unwrap();
        let decides = [
            decide(0, "mr:1:1", true, 4),
            Recorded::Seal { index: 5 },
            decide(2, "mr:1:2", true, 6),
            decide(3, "mr:1:3", false, 7),
        ];
        let mut out = vec![None; 4];
        let tx = db.begin_write().unwrap();
        super::record_decisions(&tx, 7, &decides, &mut out).unwrap();
        tx.commit().unwrap();
        assert_eq!(out, vec![Some(true), None, Some(false), Some(false)]);
        assert_eq!(super::decision(&db, "mr:1:1").unwrap(), Some(true));
        assert_eq!(super::decision(&db, "mr:1:2").unwrap(), None);
        assert_eq!(super::decision(&db, "mr:1:3").unwrap(), None);
        let mut range = super::range_decisions(&db, 7, u64::MAX).unwrap();
        range.sort();
        assert_eq!(
            range,
            vec![
                ("mr:1:1".to_string(), true),
                ("mr:1:2".to_string(), false),
                ("mr:1:3".to_string(), false),
            ]
        );
        assert_eq!(super::sealed_at(&db, 7).unwrap(), Some(5));
        super::install_range_decisions(&db, 8, &[("mr:1:4".into(), false)], None, 3).unwrap();
        assert_eq!(super::decision(&db, "mr:1:4").unwrap(), None);
        super::remove_range(&db, dir.path(), 7).unwrap();
        super::remove_range(&db, dir.path(), 8).unwrap();
        assert_eq!(super::range_decisions(&db, 7, u64::MAX).unwrap().len(), 3);
        assert!(super::range_decisions(&db, 8, u64::MAX).unwrap().is_empty());
        assert_eq!(super::decision(&db, "mr:1:1").unwrap(), Some(true));
        assert_eq!(super::sealed_at(&db, 7).unwrap(), None);
    }

    /// A range records the first `Decide` of its own log, even where this node recorded
    /// another decision for the transaction: its replicas pass its `Prepare` entries by that
    /// record, so each must read the same whatever it heard elsewhere. A later `Decide`
    /// changes nothing.
    #[test]
    fn a_range_records_its_own_logs_first_decision() {
        let dir = tempfile::tempdir().unwrap();
        let db = super::open_db(dir.path()).unwrap();
        super::learn_decision(&db, "mr:1:9", false).unwrap();
        let decides = [decide(0, "mr:1:9", true, 3), decide(1, "mr:1:9", false, 4)];
        let mut out = vec![None; 2];
        let tx = db.begin_write().unwrap();
        super::record_decisions(&tx, 7, &decides, &mut out).unwrap();
        tx.commit().unwrap();
        assert_eq!(out, vec![Some(true), Some(true)]);
        assert_eq!(super::range_decision(&db, 7, "mr:1:9").unwrap(), Some(true));
        assert_eq!(super::range_decision(&db, 8, "mr:1:9").unwrap(), None);
    }

    /// A snapshot at index I carries the decisions recorded at or below I, however old, and
    /// none recorded later: a late abort recorded anew after a `Forget` (the replica's
    /// applier past it) must not reach a replica whose rows are from before that `Forget`,
    /// where it would overrule the commit its log is about to record.
    #[test]
    fn a_snapshot_carries_the_decisions_recorded_up_to_its_index() {
        let dir = tempfile::tempdir().unwrap();
        let db = super::open_db(dir.path()).unwrap();
        let old = [("mr:1:2".to_string(), true), ("mr:1:3".to_string(), false)];
        super::install_range_decisions(&db, 7, &old, None, 10).unwrap();
        let mut out = vec![None; 1];
        let tx = db.begin_write().unwrap();
        super::record_decisions(&tx, 7, &[decide(0, "mr:1:4", false, 30)], &mut out).unwrap();
        tx.commit().unwrap();
        super::install_range_decisions(&db, 8, &[("mr:1:5".into(), true)], None, 0).unwrap();
        let mut carried = super::range_decisions(&db, 7, 20).unwrap();
        carried.sort();
        assert_eq!(
            carried,
            vec![("mr:1:2".to_string(), true), ("mr:1:3".to_string(), false)]
        );
        assert_eq!(super::range_decisions(&db, 7, 30).unwrap().len(), 3);
    }

    /// A `Forget` takes the range's records of its transactions and this node's, and no
    /// other range's: each range forgets at its own `Forget` entry. It answers what the
    /// range's records said, aborts included (a copy asked for later is answered with it).
    #[test]
    fn forgetting_takes_the_ranges_and_the_nodes_records() {
        let dir = tempfile::tempdir().unwrap();
        let db = super::open_db(dir.path()).unwrap();
        let both = [("mr:1:2".to_string(), true), ("mr:1:3".to_string(), true)];
        super::install_range_decisions(&db, 7, &both, None, 5).unwrap();
        super::install_range_decisions(&db, 7, &[("mr:1:4".to_string(), false)], None, 6).unwrap();
        super::install_range_decisions(&db, 8, &both[..1], None, 5).unwrap();
        let gids = ["mr:1:2", "mr:1:4", "mr:1:9"].map(String::from);
        assert_eq!(
            super::forget_decisions(&db, Some(7), &gids, false).unwrap(),
            vec![("mr:1:2".to_string(), true), ("mr:1:4".to_string(), false)]
        );
        assert_eq!(super::range_decision(&db, 7, "mr:1:4").unwrap(), None);
        assert_eq!(super::range_decision(&db, 7, "mr:1:2").unwrap(), None);
        assert_eq!(super::range_decision(&db, 7, "mr:1:3").unwrap(), Some(true));
        assert_eq!(super::range_decision(&db, 8, "mr:1:2").unwrap(), Some(true));
        assert_eq!(super::decision(&db, "mr:1:2").unwrap(), None);
        assert_eq!(super::decision(&db, "mr:1:3").unwrap(), Some(true));
    }

    fn plan(since_ms: u64) -> mr_wire::peer::ForgetPlan {
        mr_wire::peer::ForgetPlan {
            database: "mr".into(),
            parts: vec![8, 9],
            nodes: vec![(2, true), (3, false)],
            keep_anchor: false,
            since_ms,
            commit_by_ms: since_ms + 600_000,
        }
    }

    /// A coordinator's plan is kept beside the range's record, whichever `Decide` made that
    /// record (its proposal is its last word either way; it replaces the presumed abort's
    /// entry a sweep's record made), and answered with the record once
    /// its `Decide` is old enough; a `Forget` takes both, one for plans only takes the plan
    /// and leaves the record (an abort's plan becomes presumed: the record goes once no
    /// commit can follow). A sealed range keeps no plan: it forgets nothing.
    #[test]
    fn a_coordinators_plan_is_kept_beside_the_record_until_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let db = super::open_db(dir.path()).unwrap();
        let at = 1_700_000_000_000;
        let with_plan = |slot, gid: &str, commit, index| super::Recorded::Decide {
            slot,
            gid: gid.into(),
            commit,
            index,
            at_ms: at + 5,
            plan: Some(plan(at)),
        };
        let decides = [
            decide(0, "mr:1:1", false, 3),
            with_plan(1, "mr:1:1", true, 4),
            with_plan(2, "mr:1:2", true, 5),
            Recorded::Seal { index: 6 },
            with_plan(4, "mr:1:3", true, 7),
        ];
        let mut out = vec![None; 5];
        let tx = db.begin_write().unwrap();
        super::record_decisions(&tx, 7, &decides[..3], &mut out).unwrap();
        tx.commit().unwrap();
        assert_eq!(out[..3], [Some(false), Some(false), Some(true)]);
        assert!(super::range_plans(&db, 7, at + 5).unwrap().is_empty());
        let mut plans = super::range_plans(&db, 7, at + 6).unwrap();
        plans.sort_by(|a, b| a.0.cmp(&b.0));
        let kept: Vec<_> = plans
            .iter()
            .map(|(g, d, p)| (g.as_str(), *d, p.index, p.at_ms))
            .collect();
        assert_eq!(
            kept,
            [
                ("mr:1:1", Some(false), 4, at + 5),
                ("mr:1:2", Some(true), 5, at + 5)
            ]
        );
        assert_eq!(plans[0].2.plan, plan(at));
        super::forget_decisions(&db, Some(7), &["mr:1:1".into()], true).unwrap();
        assert_eq!(
            super::range_decision(&db, 7, "mr:1:1").unwrap(),
            Some(false)
        );
        super::forget_decisions(&db, Some(7), &["mr:1:2".into()], false).unwrap();
        let left = super::range_plans(&db, 7, u64::MAX).unwrap();
        assert_eq!(left.len(), 1, "{left:?}");
        let (gid, record, p) = &left[0];
        assert_eq!(
            (gid.as_str(), *record, p.at_ms),
            ("mr:1:1", Some(false), at + 5)
        );
        assert!(p.presumed && p.plan.parts.is_empty());
        super::forget_decisions(&db, Some(7), &["mr:1:1".into()], false).unwrap();
        assert!(super::range_plans(&db, 7, u64::MAX).unwrap().is_empty());
        let tx = db.begin_write().unwrap();
        super::record_decisions(&tx, 7, &decides[3..], &mut out).unwrap();
        tx.commit().unwrap();
        assert_eq!(out[4], Some(false));
        assert!(super::range_plans(&db, 7, u64::MAX).unwrap().is_empty());
    }

    /// A coordinator's proposal that reaches the anchor long after it began deciding (a
    /// stale frame: it answered its client 40003 long ago) decides abort, on every replica
    /// alike (both times are in the entry), so no commit is recorded after an abort that was
    /// answered to it has been forgotten. One in time commits; a record already there stands.
    #[test]
    fn a_stale_commit_proposal_decides_abort() {
        let dir = tempfile::tempdir().unwrap();
        let db = super::open_db(dir.path()).unwrap();
        let since = 1_700_000_000_000;
        let late = since + super::super::twophase::STALE_PROPOSAL.as_millis() as u64 + 1;
        let proposal = |slot, gid: &str, since, at_ms| super::Recorded::Decide {
            slot,
            gid: gid.into(),
            commit: true,
            index: 10 + slot as u64,
            at_ms,
            plan: Some(plan(since)),
        };
        // The last one began deciding in time, but past its commit limit (its prepares took
        // that long).
        let mut past_limit = proposal(3, "mr:1:3", since, since + 601_000);
        if let super::Recorded::Decide { plan: Some(p), .. } = &mut past_limit {
            p.since_ms = since + 599_000;
        }
        let decides = [
            proposal(0, "mr:1:1", since, since + 20_000),
            proposal(1, "mr:1:2", since, late),
            proposal(2, "mr:1:1", since, late),
            past_limit,
        ];
        let mut out = vec![None; 4];
        let tx = db.begin_write().unwrap();
        super::record_decisions(&tx, 7, &decides, &mut out).unwrap();
        tx.commit().unwrap();
        assert_eq!(out, [Some(true), Some(false), Some(true), Some(false)]);
        assert_eq!(super::decision(&db, "mr:1:2").unwrap(), None);
    }

    /// An abort recorded without a coordinator's plan (a sweep's, a copy) keeps a presumed
    /// entry with its `Decide`'s time, which the range's leader forgets it by once no commit
    /// can follow; a commit, or a range's later `Decide` for a transaction it recorded, does
    /// not; a sealed range keeps none. A snapshot carries it like a plan.
    #[test]
    fn an_abort_without_a_plan_is_presumed() {
        let dir = tempfile::tempdir().unwrap();
        let db = super::open_db(dir.path()).unwrap();
        let at = |slot, gid: &str, commit, at_ms| super::Recorded::Decide {
            slot,
            gid: gid.into(),
            commit,
            index: 20 + slot as u64,
            at_ms,
            plan: None,
        };
        let decides = [
            at(0, "mr:1:1", false, 1_000),
            at(1, "mr:1:1", false, 9_000),
            at(2, "mr:1:2", true, 1_000),
            at(3, "mr:1:3", true, 1_000),
            at(4, "mr:1:3", false, 2_000),
            Recorded::Seal { index: 25 },
            at(6, "mr:1:4", false, 3_000),
        ];
        let mut out = vec![None; 7];
        let tx = db.begin_write().unwrap();
        super::record_decisions(&tx, 7, &decides, &mut out).unwrap();
        tx.commit().unwrap();
        let plans = super::range_plans(&db, 7, u64::MAX).unwrap();
        assert_eq!(plans.len(), 1, "{plans:?}");
        let (gid, record, p) = &plans[0];
        assert_eq!((gid.as_str(), *record), ("mr:1:1", Some(false)));
        assert!(p.presumed);
        assert_eq!((p.index, p.at_ms), (20, 1_000));
        assert!(super::range_plans(&db, 7, 1_000).unwrap().is_empty());
    }

    /// Records kept before they had an index move into the indexed table with index 0, which
    /// every snapshot carries (as every one did before).
    #[test]
    fn records_without_an_index_are_moved_and_always_carried() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = redb::Database::create(dir.path().join("ranges.redb")).unwrap();
            let tx = db.begin_write().unwrap();
            tx.open_table(super::OLD_RANGE_DECISIONS)
                .unwrap()
                .insert((7, "mr:1:2"), (1, 1_700_000_000_000))
                .unwrap();
            tx.commit().unwrap();
        }
        let db = super::open_db(dir.path()).unwrap();
        assert_eq!(
            super::range_decisions(&db, 7, 1).unwrap(),
            vec![("mr:1:2".to_string(), true)]
        );
        drop(db);
        let db = super::open_db(dir.path()).unwrap();
        assert_eq!(super::range_decisions(&db, 7, 1).unwrap().len(), 1);
    }
}
