//! Durable storage for the meta Raft group: the log, the vote and snapshots in one redb file
//! (`DATA_DIR/meta.redb`); the state machine itself lives in memory.
//!
//! Why redb and not PostgreSQL: the meta group must keep working while this node's
//! PostgreSQL is down or restarting (pgmr is what restarts it), and a Raft log write must not
//! queue behind user transactions. redb is an embedded, pure-Rust, crash-safe B-tree store
//! (copy-on-write pages, a commit is durable when `commit` returns), so it needs no C++
//! toolchain and no second server. Why not sled: unmaintained, and its durability story is
//! weaker. Log entries, the vote and snapshots are JSON, like everything else on the wire.
//!
//! The state machine is rebuilt at start from the latest snapshot, then Raft re-applies the
//! committed log after it (the committed index is saved, so that happens before the node
//! serves reads). Snapshots are taken every [`SNAPSHOT_EVERY`] entries, so replay is short.

// redb's error type is large (160 bytes); it only travels on failure paths that end the Raft
// member anyway, so boxing it would buy nothing.
#![allow(clippy::result_large_err)]

use super::types::{MetaNode, TypeConfig};
use mr_meta::{MetaState, Outcome};
use openraft::storage::{LogFlushed, LogState, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    AnyError, Entry, EntryPayload, LogId, OptionalSend, RaftLogReader, RaftSnapshotBuilder,
    SnapshotMeta, StorageError, StorageIOError, StoredMembership, Vote,
};
use redb::{Database, Durability, ReadableTable, TableDefinition};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::{Arc, RwLock};

/// A snapshot is built once the log has this many entries since the last one.
pub const SNAPSHOT_EVERY: u64 = 1000;

const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const VOTE: &str = "vote";
const COMMITTED: &str = "committed";
const LAST_PURGED: &str = "last_purged";
const SNAPSHOT: &str = "snapshot";

type SErr = StorageError<u64>;

/// Opens (creating if needed) the store in `dir`.
pub fn open(dir: &Path) -> anyhow::Result<(LogStore, StateMachine, Arc<Applied>)> {
    let db = Database::create(dir.join("meta.redb"))?;
    let tx = db.begin_write()?;
    tx.open_table(LOG)?;
    tx.open_table(META)?;
    tx.commit()?;
    let db = Arc::new(db);
    let applied = Arc::new(Applied::default());
    let sm = StateMachine {
        db: db.clone(),
        applied: applied.clone(),
    };
    if let Some(snap) = sm.load_snapshot().map_err(|e| anyhow::anyhow!("{e}"))? {
        let state = mr_meta::snapshot::decode(&snap.data)?;
        *applied.inner.write().expect("applied lock") = Inner {
            state,
            last_applied: snap.meta.last_log_id,
            membership: snap.meta.last_membership.clone(),
        };
    }
    Ok((LogStore { db }, sm, applied))
}

fn get<T: DeserializeOwned>(db: &Database, key: &str) -> Result<Option<T>, redb::Error> {
    let tx = db.begin_read()?;
    let t = tx.open_table(META)?;
    let v = t.get(key)?;
    Ok(v.and_then(|v| serde_json::from_slice(v.value()).ok()))
}

fn put<T: Serialize>(db: &Database, key: &str, v: &T, durable: bool) -> Result<(), redb::Error> {
    let bytes = serde_json::to_vec(v).expect("storage records serialize");
    crate::blocking::run(|| {
        let mut tx = db.begin_write()?;
        if !durable {
            // Made durable by the next durable commit (a log append). `Eventual` would sync
            // the file on Linux as well.
            tx.set_durability(Durability::None);
        }
        tx.open_table(META)?.insert(key, bytes.as_slice())?;
        tx.commit()?;
        Ok(())
    })
}

fn io(e: impl Into<redb::Error>, f: impl FnOnce(AnyError) -> StorageIOError<u64>) -> SErr {
    let e: redb::Error = e.into();
    f(AnyError::error(e)).into()
}

/// The log and the vote. Cloned as the log reader for replication tasks: redb allows any
/// number of concurrent read transactions alongside one writer.
#[derive(Clone)]
pub struct LogStore {
    db: Arc<Database>,
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, SErr> {
        let read = || -> Result<Vec<Entry<TypeConfig>>, redb::Error> {
            let tx = self.db.begin_read()?;
            let t = tx.open_table(LOG)?;
            let bounds: (Bound<u64>, Bound<u64>) =
                (range.start_bound().cloned(), range.end_bound().cloned());
            let mut out = Vec::new();
            for kv in t.range(bounds)? {
                let (_, v) = kv?;
                out.push(serde_json::from_slice(v.value()).expect("log entries decode"));
            }
            Ok(out)
        };
        read().map_err(|e| io(e, StorageIOError::read_logs))
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, SErr> {
        let read = || -> Result<LogState<TypeConfig>, redb::Error> {
            let last_purged: Option<LogId<u64>> = get(&self.db, LAST_PURGED)?;
            let tx = self.db.begin_read()?;
            let t = tx.open_table(LOG)?;
            let last = match t.last()? {
                Some((_, v)) => {
                    let e: Entry<TypeConfig> =
                        serde_json::from_slice(v.value()).expect("log entries decode");
                    Some(e.log_id)
                }
                None => last_purged,
            };
            Ok(LogState {
                last_purged_log_id: last_purged,
                last_log_id: last,
            })
        };
        read().map_err(|e| io(e, StorageIOError::read_logs))
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<u64>) -> Result<(), SErr> {
        put(&self.db, VOTE, vote, true).map_err(|e| io(e, StorageIOError::write_vote))
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<u64>>, SErr> {
        get(&self.db, VOTE).map_err(|e| io(e, StorageIOError::read_vote))
    }

    /// Saved without waiting for the disk: losing the latest value only means a restarted
    /// node re-applies a little less before it hears from the leader again.
    async fn save_committed(&mut self, committed: Option<LogId<u64>>) -> Result<(), SErr> {
        put(&self.db, COMMITTED, &committed, false).map_err(|e| io(e, StorageIOError::write))
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<u64>>, SErr> {
        Ok(get::<Option<LogId<u64>>>(&self.db, COMMITTED)
            .map_err(|e| io(e, StorageIOError::read))?
            .flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), SErr>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let write = || -> Result<(), redb::Error> {
            let tx = self.db.begin_write()?;
            {
                let mut t = tx.open_table(LOG)?;
                for e in entries {
                    let bytes = serde_json::to_vec(&e).expect("log entries serialize");
                    t.insert(e.log_id.index, bytes.as_slice())?;
                }
            }
            // Durable on return: the commit has been fsynced.
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
            tx.open_table(LOG)?
                .retain_in(log_id.index.., |_, _| false)?;
            tx.commit()?;
            Ok(())
        };
        crate::blocking::run(write).map_err(|e| io(e, StorageIOError::write_logs))
    }

    async fn purge(&mut self, log_id: LogId<u64>) -> Result<(), SErr> {
        let write = || -> Result<(), redb::Error> {
            let bytes = serde_json::to_vec(&log_id).expect("log ids serialize");
            let tx = self.db.begin_write()?;
            tx.open_table(META)?.insert(LAST_PURGED, bytes.as_slice())?;
            tx.open_table(LOG)?
                .retain_in(..=log_id.index, |_, _| false)?;
            tx.commit()?;
            Ok(())
        };
        crate::blocking::run(write).map_err(|e| io(e, StorageIOError::write_logs))
    }
}

/// The applied state, shared with readers: the node's read path takes the read lock, apply
/// takes the write lock for one batch of entries.
#[derive(Default)]
pub struct Applied {
    inner: RwLock<Inner>,
}

#[derive(Default)]
struct Inner {
    state: MetaState,
    last_applied: Option<LogId<u64>>,
    membership: StoredMembership<u64, MetaNode>,
}

impl Applied {
    /// Reads the applied state. Linearizable only after a read-index wait ([`super::Meta`]).
    pub fn read<R>(&self, f: impl FnOnce(&MetaState) -> R) -> R {
        f(&self.inner.read().expect("applied lock").state)
    }
}

#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<u64, MetaNode>,
    /// `mr_meta::snapshot` bytes: the versioned state.
    #[serde(with = "bytes_as_string")]
    data: Vec<u8>,
}

/// Snapshot data is JSON text already; store it as a string rather than an array of numbers.
mod bytes_as_string {
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(std::str::from_utf8(b).map_err(serde::ser::Error::custom)?)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        Ok(String::deserialize(d)?.into_bytes())
    }
}

pub struct StateMachine {
    db: Arc<Database>,
    applied: Arc<Applied>,
}

impl StateMachine {
    fn load_snapshot(&self) -> Result<Option<StoredSnapshot>, SErr> {
        get(&self.db, SNAPSHOT).map_err(|e| io(e, |e| StorageIOError::read_snapshot(None, e)))
    }

    fn save_snapshot(&self, s: &StoredSnapshot) -> Result<(), SErr> {
        put(&self.db, SNAPSHOT, s, true)
            .map_err(|e| io(e, |e| StorageIOError::write_snapshot(None, e)))
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, SErr> {
        let (data, last_log_id, membership) = {
            let a = self.applied.inner.read().expect("applied lock");
            (
                mr_meta::snapshot::encode(&a.state),
                a.last_applied,
                a.membership.clone(),
            )
        };
        let snapshot_id = match last_log_id {
            Some(l) => format!("{}-{}", l.leader_id.term, l.index),
            None => "empty".into(),
        };
        let meta = SnapshotMeta {
            last_log_id,
            last_membership: membership,
            snapshot_id,
        };
        let stored = StoredSnapshot { meta, data };
        self.save_snapshot(&stored)?;
        Ok(Snapshot {
            meta: stored.meta,
            snapshot: Box::new(Cursor::new(stored.data)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = StateMachine;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<u64>>, StoredMembership<u64, MetaNode>), SErr> {
        let a = self.applied.inner.read().expect("applied lock");
        Ok((a.last_applied, a.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Outcome>, SErr>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut a = self.applied.inner.write().expect("applied lock");
        let mut out = Vec::new();
        for e in entries {
            a.last_applied = Some(e.log_id);
            out.push(match e.payload {
                EntryPayload::Blank => Outcome::Done,
                EntryPayload::Normal(p) => a.state.apply(&p),
                EntryPayload::Membership(m) => {
                    a.membership = StoredMembership::new(Some(e.log_id), m);
                    Outcome::Done
                }
            });
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        StateMachine {
            db: self.db.clone(),
            applied: self.applied.clone(),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, SErr> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<u64, MetaNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), SErr> {
        let data = snapshot.into_inner();
        let state = mr_meta::snapshot::decode(&data).map_err(|e| {
            SErr::from(StorageIOError::read_snapshot(
                Some(meta.signature()),
                &std::io::Error::other(e.to_string()),
            ))
        })?;
        self.save_snapshot(&StoredSnapshot {
            meta: meta.clone(),
            data,
        })?;
        let mut a = self.applied.inner.write().expect("applied lock");
        a.state = state;
        a.last_applied = meta.last_log_id;
        a.membership = meta.last_membership.clone();
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, SErr> {
        Ok(self.load_snapshot()?.map(|s| Snapshot {
            meta: s.meta,
            snapshot: Box::new(Cursor::new(s.data)),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::storage::RaftLogStorageExt;
    use openraft::testing::{StoreBuilder, Suite};

    struct Builder;

    impl StoreBuilder<TypeConfig, LogStore, StateMachine, tempfile::TempDir> for Builder {
        async fn build(&self) -> Result<(tempfile::TempDir, LogStore, StateMachine), SErr> {
            let dir = tempfile::tempdir().expect("temp dir");
            let (log, sm, _) = open(dir.path()).expect("open store");
            Ok((dir, log, sm))
        }
    }

    /// openraft's own conformance suite for log stores and state machines: vote, append,
    /// truncate, purge, log state, apply, snapshot build and install.
    #[test]
    fn the_store_passes_openraft_storage_suite() {
        Suite::test_all(Builder).unwrap();
    }

    /// What a restarted node sees: the vote, the log and the latest snapshot's state.
    #[tokio::test]
    async fn a_reopened_store_keeps_its_vote_log_and_snapshot() {
        use mr_meta::{ClientId, Command, Proposal};
        use openraft::{CommittedLeaderId, EntryPayload};
        let dir = tempfile::tempdir().unwrap();
        let entry = |index: u64| Entry::<TypeConfig> {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(Proposal {
                client: ClientId {
                    node_id: 1,
                    incarnation: 1,
                },
                seq: index,
                command: Command::SetClusterSetting {
                    name: "k".into(),
                    value: Some(index.to_string()),
                },
            }),
        };
        {
            let (mut log, mut sm, applied) = open(dir.path()).unwrap();
            log.save_vote(&Vote::new(1, 1)).await.unwrap();
            let entries: Vec<_> = (1..=3).map(entry).collect();
            log.blocking_append(entries.clone()).await.unwrap();
            sm.apply(entries[..2].to_vec()).await.unwrap();
            sm.get_snapshot_builder()
                .await
                .build_snapshot()
                .await
                .unwrap();
            sm.apply(entries[2..].to_vec()).await.unwrap();
            assert_eq!(
                applied.read(|s| s.cluster_setting("k").map(str::to_string)),
                Some("3".into())
            );
        }
        let (mut log, mut sm, applied) = open(dir.path()).unwrap();
        assert_eq!(log.read_vote().await.unwrap(), Some(Vote::new(1, 1)));
        assert_eq!(
            log.get_log_state()
                .await
                .unwrap()
                .last_log_id
                .unwrap()
                .index,
            3
        );
        // The state machine restarts from the snapshot; Raft re-applies entry 3 from the log.
        let (last, _) = sm.applied_state().await.unwrap();
        assert_eq!(last.unwrap().index, 2);
        assert_eq!(
            applied.read(|s| s.cluster_setting("k").map(str::to_string)),
            Some("2".into())
        );
    }
}
