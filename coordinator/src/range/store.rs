//! Durable storage for every range Raft group of a node: one redb file
//! (`DATA_DIR/ranges.redb`), keyed by range id, so that a node carrying many ranges has one
//! file and one fsync stream rather than one per range.
//!
//! The state machine of a range is its rows in PostgreSQL, written by the range's applier
//! ([`super::apply`]) in log order from this log. openraft's "applied" here means committed
//! and handed to that applier: the applier keeps its own durable cursor in PostgreSQL, in the
//! same transaction as the rows, and re-reads entries from this log after a crash. Logs are
//! therefore never purged in this release (no snapshots yet: a new replica replays the log from
//! its first entry), which bounds a range's lifetime by its log size; snapshots from
//! PostgreSQL (COPY of the range's rows at an applied index) are the next step.

#![allow(clippy::result_large_err)]

use super::types::{RangeConfig, RangeNode, TxnKind};
use openraft::storage::{LogFlushed, LogState, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    AnyError, Entry, EntryPayload, LogId, OptionalSend, RaftLogReader, RaftSnapshotBuilder,
    SnapshotMeta, StorageError, StorageIOError, StoredMembership, Vote,
};
use redb::{Database, Durability, ReadableTable, TableDefinition};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// The state machine's applied log id and membership, as stored.
type AppliedState = (Option<LogId<u64>>, StoredMembership<u64, RangeNode>);

const LOG: TableDefinition<(u64, u64), &[u8]> = TableDefinition::new("range_log");
const META: TableDefinition<(u64, &str), &[u8]> = TableDefinition::new("range_meta");
/// Two-phase commit decisions this node knows, by transaction (1 commit, 0 abort): from
/// `Decide` entries of anchor ranges it holds (the first per transaction), and from anchors'
/// leaseholders asked by the applier.
const DECISIONS: TableDefinition<&str, u8> = TableDefinition::new("txn_decisions");
const VOTE: &str = "vote";
const COMMITTED: &str = "committed";
const APPLIED: &str = "applied";

type SErr = StorageError<u64>;

/// Opens (creating if needed) the node's range store in `dir`.
pub fn open_db(dir: &Path) -> anyhow::Result<Arc<Database>> {
    let db = Database::create(dir.join("ranges.redb"))?;
    let tx = db.begin_write()?;
    tx.open_table(LOG)?;
    tx.open_table(META)?;
    tx.open_table(DECISIONS)?;
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

fn put<T: Serialize>(
    db: &Database,
    range: u64,
    key: &str,
    v: &T,
    durable: bool,
) -> Result<(), redb::Error> {
    let bytes = serde_json::to_vec(v).expect("storage records serialize");
    crate::blocking::run(|| {
        let mut tx = db.begin_write()?;
        if !durable {
            tx.set_durability(Durability::Eventual);
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
    let tx = db.begin_read()?;
    let t = tx.open_table(LOG)?;
    let mut out = Vec::new();
    for kv in t.range((range, from)..=(range, to))? {
        let (_, v) = kv?;
        out.push(serde_json::from_slice(v.value()).expect("log entries decode"));
    }
    Ok(out)
}

/// The decision recorded here for two-phase commit `gid`, if any.
pub fn decision(db: &Database, gid: &str) -> Result<Option<bool>, redb::Error> {
    let tx = db.begin_read()?;
    let t = tx.open_table(DECISIONS)?;
    Ok(t.get(gid)?.map(|v| v.value() == 1))
}

/// Records `gid`'s decision as learned from its anchor's leaseholder (unless one is known).
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

/// Whether `range`'s log holds a transaction's rows at or below `to` (stops at the first).
pub fn has_data_entries(db: &Database, range: u64, to: u64) -> Result<bool, redb::Error> {
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

/// Forgets everything stored for `range` (this node no longer holds a replica of it).
pub fn remove_range(db: &Database, range: u64) -> Result<(), redb::Error> {
    crate::blocking::run(|| {
        let tx = db.begin_write()?;
        tx.open_table(LOG)?
            .retain_in((range, 0)..=(range, u64::MAX), |_, _| false)?;
        tx.open_table(META)?.retain(|(r, _), _| r != range)?;
        tx.commit()?;
        Ok(())
    })
}

/// One range's log and vote.
#[derive(Clone)]
pub struct LogStore {
    pub db: Arc<Database>,
    pub range: u64,
}

impl RaftLogReader<RangeConfig> for LogStore {
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
            Ok(LogState {
                last_purged_log_id: None,
                last_log_id: last,
            })
        };
        read().map_err(|e| io(e, StorageIOError::read_logs))
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<u64>) -> Result<(), SErr> {
        put(&self.db, self.range, VOTE, vote, true).map_err(|e| io(e, StorageIOError::write_vote))
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<u64>>, SErr> {
        get(&self.db, self.range, VOTE).map_err(|e| io(e, StorageIOError::read_vote))
    }

    async fn save_committed(&mut self, committed: Option<LogId<u64>>) -> Result<(), SErr> {
        put(&self.db, self.range, COMMITTED, &committed, false)
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
            tx.open_table(LOG)?.retain_in(
                (self.range, log_id.index)..=(self.range, u64::MAX),
                |_, _| false,
            )?;
            tx.commit()?;
            Ok(())
        };
        crate::blocking::run(write).map_err(|e| io(e, StorageIOError::write_logs))
    }

    /// Never called: no snapshots are built, so openraft has nothing to purge up to.
    async fn purge(&mut self, _log_id: LogId<u64>) -> Result<(), SErr> {
        Ok(())
    }
}

/// What the range's state machine has handed on: the last committed entry and membership.
pub struct Applied {
    pub last: Option<LogId<u64>>,
    pub membership: StoredMembership<u64, RangeNode>,
}

/// The range's state machine as openraft sees it: it records how far the log is committed
/// and wakes the range's applier, which writes the rows.
pub struct StateMachine {
    pub db: Arc<Database>,
    pub range: u64,
    pub applied: Arc<Mutex<Applied>>,
    /// The highest committed index, for the applier and for commit waits.
    pub committed: Arc<watch::Sender<u64>>,
}

impl StateMachine {
    pub fn open(db: Arc<Database>, range: u64) -> anyhow::Result<StateMachine> {
        let stored: Option<AppliedState> = get(&db, range, APPLIED)?;
        let (last, membership) = stored.unwrap_or_default();
        let (committed, _) = watch::channel(last.map_or(0, |l| l.index));
        Ok(StateMachine {
            db,
            range,
            applied: Arc::new(Mutex::new(Applied { last, membership })),
            committed: Arc::new(committed),
        })
    }
}

impl RaftSnapshotBuilder<RangeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<RangeConfig>, SErr> {
        Err(io(
            redb::Error::Io(std::io::Error::other("range snapshots are not built yet")),
            |e| StorageIOError::write_snapshot(None, e),
        ))
    }
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
        let mut decides = Vec::new();
        let record = {
            let mut a = self.applied.lock().expect("applied lock");
            for e in entries {
                a.last = Some(e.log_id);
                match e.payload {
                    EntryPayload::Membership(m) => {
                        a.membership = StoredMembership::new(Some(e.log_id), m);
                    }
                    EntryPayload::Normal(w) => {
                        if let TxnKind::Decide { gid, commit } = w.kind {
                            decides.push((out.len(), gid, commit));
                        }
                    }
                    EntryPayload::Blank => {}
                }
                out.push(None);
            }
            (a.last, a.membership.clone())
        };
        // Not fsynced: after a crash openraft hands the entries after an older mark again,
        // which only re-announces them (and finds the same first decisions); the applier's
        // own cursor is in PostgreSQL.
        let bytes = serde_json::to_vec(&record).expect("storage records serialize");
        let write = || -> Result<(), redb::Error> {
            let mut tx = self.db.begin_write()?;
            tx.set_durability(Durability::Eventual);
            tx.open_table(META)?
                .insert((self.range, APPLIED), bytes.as_slice())?;
            {
                let mut t = tx.open_table(DECISIONS)?;
                for (i, gid, commit) in &decides {
                    let known = t.get(gid.as_str())?.map(|v| v.value() == 1);
                    let decided = match known {
                        Some(d) => d,
                        None => {
                            t.insert(gid.as_str(), u8::from(*commit))?;
                            *commit
                        }
                    };
                    out[*i] = Some(decided);
                }
            }
            tx.commit()?;
            Ok(())
        };
        crate::blocking::run(write).map_err(|e| io(e, StorageIOError::write))?;
        self.committed.send_replace(record.0.map_or(0, |l| l.index));
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        StateMachine {
            db: self.db.clone(),
            range: self.range,
            applied: self.applied.clone(),
            committed: self.committed.clone(),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, SErr> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<u64, RangeNode>,
        _snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), SErr> {
        Err(SErr::from(StorageIOError::read_snapshot(
            Some(meta.signature()),
            &std::io::Error::other("range snapshots are not supported yet"),
        )))
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<RangeConfig>>, SErr> {
        Ok(None)
    }
}
