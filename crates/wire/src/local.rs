//! The local channel: what a PostgreSQL backend may ask its node's pgmr.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// The metadata records the schema-change requests carry, re-exported so the extension needs
/// no direct dependency on `mr-meta`.
pub use mr_meta::{DatabaseConfig, Placement, SurvivalGoal, TableLocality, TableRef};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LocalRequest {
    /// This node's identity and uptime (`multiregion.node_info()`).
    NodeInfo,
    /// Measured RTT between every pair of known nodes (`multiregion.network_latency()`).
    NetworkLatency,
    /// Regions and their zones from cluster membership (`multiregion.cluster_regions()`).
    ClusterRegions,
    /// Everything `pgmr status` and `pgmr demo` need: this node and its view of every peer.
    Status,
    /// Fault injection on this node's outgoing links (`pgmr debug …`, tests). `fault: None`
    /// heals the links to `peers`; an empty `peers` means every link.
    SetLinkFaults {
        peers: Vec<u64>,
        fault: Option<LinkFault>,
    },
    /// Every node the meta group knows, with its liveness (`multiregion.nodes`). A
    /// linearizable read.
    Nodes,
    /// The meta Raft group as this node sees it, with each member's replication lag from the
    /// leader (`pgmr status`, `multiregion.meta_group`).
    MetaGroup,
    /// Decommissions a node: it leaves the meta group and never counts as a member again
    /// (`pgmr node decommission`). Answers once the group no longer includes it.
    Decommission {
        node_id: u64,
    },
    /// `SET CLUSTER SETTING`: a committed metadata write (`multiregion.set_cluster_setting`).
    SetClusterSetting {
        name: String,
        value: Option<String>,
    },
    /// Cluster settings and the event log, read linearizably
    /// (`multiregion.cluster_settings`, `multiregion.eventlog`).
    ClusterSettings,
    EventLog,
    /// Every node's progress through every database's schema log, from the meta group:
    /// [`LocalResponse::SchemaAppliers`].
    SchemaAppliers,
    /// One row of a REGIONAL BY ROW table's partition as its range's leaseholder holds it:
    /// [`LocalResponse::PartitionSample`], or [`LocalResponse::NotReplicated`] when rows are
    /// not replicated, the partition has no range yet or this node leases it (this node's
    /// copy is then the one).
    PartitionSample {
        table: TableRef,
        partition: String,
    },
    /// A database's `CONFIGURE ZONE` overrides, read linearizably:
    /// [`LocalResponse::ZoneOverrides`].
    ZoneOverrides {
        database: String,
    },
    /// Commits a multi-region schema change to the meta group, compare-and-set on the
    /// database's schema version: answered with [`LocalResponse::SchemaVersion`] (the new
    /// version, `expected_version + 1`), or, if another change got there first, with a
    /// retryable [`LocalResponse::Error`] naming both versions. `change` is opaque to pgmr;
    /// every other node hands it to `multiregion.apply_schema_change(version, change)`.
    /// `config` replaces the database's region configuration (`None`: not multi-region);
    /// each listed table locality is put (`Some`) or removed (`None`).
    ProposeSchemaChange {
        database: String,
        expected_version: u64,
        change: String,
        #[serde(default)]
        config: Option<DatabaseConfig>,
        #[serde(default)]
        localities: Vec<(TableRef, Option<TableLocality>)>,
        /// Every table of the database after the change; `None`: unchanged.
        #[serde(default)]
        tables: Option<Vec<TableRef>>,
        /// The tables the change reshapes, with their ranges' last entries before it
        /// ([`LocalRequest::FenceTables`]).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        fenced: Vec<mr_meta::Fenced>,
        /// Nodes that hold a lock on those tables for this transaction: each is told of the
        /// change (and waits until its copy of the meta state has it) before the transaction
        /// ends there and releases the lock.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        notify: Vec<u64>,
        /// Key tables the change creates from a table's existing rows, each with that table:
        /// their ranges start from its range's rows ([`mr_meta::MetaState::key_seed`]).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        key_seeds: Vec<(TableRef, TableRef)>,
        /// What the change does to sequences' counters, committed with it.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        sequences: Vec<mr_meta::sequence::SequenceChange>,
        /// `CONFIGURE ZONE` overrides it sets or discards, committed with it.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        zones: Vec<mr_meta::ZoneChange>,
    },
    /// Draws up to `count` values from a sequence's cluster-wide counter, which starts from
    /// `initial` if it has none: [`LocalResponse::SequenceValues`],
    /// [`LocalResponse::SequenceLimit`], or [`LocalResponse::NotReplicated`] while row
    /// replication is off (each node's sequences are then its own).
    NextSequenceValues {
        sequence: TableRef,
        params: mr_meta::sequence::SequenceParams,
        initial: mr_meta::sequence::SequenceValue,
        count: u64,
    },
    /// Changes sequences' counters now (`setval`): [`LocalResponse::Done`], or
    /// [`LocalResponse::NotReplicated`] while row replication is off.
    ChangeSequences {
        changes: Vec<mr_meta::sequence::SequenceChange>,
    },
    /// Waits until every live node other than this one has applied `database`'s schema up
    /// to `version`: [`LocalResponse::Done`], or after `timeout_ms` an error naming the
    /// nodes that lag (not retryable: the change is committed and they apply it later).
    AwaitSchemaApplied {
        database: String,
        version: u64,
        timeout_ms: u64,
    },
    /// `CREATE DATABASE` ran here: the database becomes cluster-wide (an empty schema log
    /// that every node's applier creates its copy for). [`LocalResponse::Done`].
    CreateDatabase {
        database: String,
    },
    /// `DROP DATABASE` ran here: the cluster forgets the database and every other node drops
    /// its copy ([`LocalResponse::Done`] once that is committed).
    DropDatabase {
        database: String,
    },
    /// A database's schema log and how far each node has applied it, read linearizably.
    SchemaLog {
        database: String,
    },
    /// Every multi-region database's configuration, read linearizably
    /// (`SHOW REGIONS FROM ALL DATABASES`).
    DatabaseConfigs,
    /// Restarts the read-only READ COMMITTED transactions that SQL gateway sessions hold open
    /// on these PostgreSQL backends, releasing their locks for a schema change (CockroachDB's
    /// schema changes do not wait for idle readers): [`LocalResponse::Restarted`].
    RestartIdleReaders {
        backend_pids: Vec<i32>,
    },
    /// Every range of the cluster (`SHOW RANGES`), read linearizably: [`LocalResponse::Ranges`].
    Ranges,
    /// Each range replica's Raft and apply progress, from every live node:
    /// [`LocalResponse::RangeProgress`].
    RangeProgress,
    /// Replicates a transaction's row changes through their ranges' Raft groups before the
    /// transaction commits here: [`LocalResponse::Replicated`] once a quorum of each range has
    /// them, [`LocalResponse::NotReplicated`] when replication is off or the tables are not
    /// replicated, else an error. Changes to one range are one entry that commits with it;
    /// changes to several ranges (all leased here) commit atomically by two-phase commit
    /// through the ranges' logs. With `prepare`, this transaction is a participant of another
    /// node's two-phase commit: its entries are only prepared, and the decision is made at
    /// range `anchor`.
    ReplicateTxn {
        database: String,
        /// The changes to each (table, REGIONAL BY ROW partition) written.
        writes: Vec<TargetWrite>,
        txn_id: String,
        schema_version: u64,
        /// When the transaction began (Unix ms).
        txn_start_ms: u64,
        #[serde(default)]
        prepare: Option<PrepareAs>,
    },
    /// Commits a transaction that ran statements on other nodes (its sessions there) and
    /// perhaps wrote rows here (`local`): two-phase commit, coordinated by this node's pgmr.
    /// Every participant prepares (the sessions' `PREPARE TRANSACTION`, this backend's
    /// changes as prepared entries), the decision is made durable in range `anchor`'s log,
    /// the sessions' prepared transactions are committed, and then [`LocalResponse::Replicated`]
    /// tells the backend to commit its own part. Any failure before the decision aborts
    /// everywhere.
    CommitDistributed {
        database: String,
        /// The transaction's decision key (this backend's transaction id).
        gid: String,
        backend_pid: i32,
        participants: Vec<Participant>,
        /// This backend's own changes, if it wrote rows.
        #[serde(default)]
        local: Option<LocalWrite>,
    },
    /// A transaction whose changes were replicated as entry `index` of `range_id` did not
    /// commit here: the range is fenced until the applier has caught up past it.
    AbandonTxn {
        range_id: u64,
        index: u64,
    },
    /// Waits until this node has applied every write to these (table, partition) ranges that
    /// was acknowledged before the call (Raft read-index through each range's leader):
    /// [`LocalResponse::ReadBarrier`]. No targets: every replicated table of the database
    /// (a snapshot about to be taken for the whole database, as pg_dump's).
    ReadBarrier {
        database: String,
        targets: Vec<(TableRef, Option<String>)>,
        /// Only the ranges this node holds a replica of (a schema change about to rewrite
        /// this node's copies); otherwise a range without one is an error.
        #[serde(default)]
        local_only: bool,
    },
    /// The ranges of these replicated tables and their leaseholders, before a schema change
    /// that reshapes the tables locks them there: [`LocalResponse::TableRanges`].
    TableRanges {
        database: String,
        tables: Vec<TableRef>,
    },
    /// After those locks: the last entry of each range written before them (the leader's
    /// read index), once this node has applied it where it holds a replica:
    /// [`LocalResponse::FenceBarrier`].
    FenceBarrier {
        database: String,
        ranges: Vec<u64>,
    },
    /// Whether row replication is on (`multiregion.replication.enabled`):
    /// [`LocalResponse::ReadBarrier`] with `enabled`. Asked before sending a large write set.
    ReplicationEnabled,
    /// Compares a checksum of every replica of every range (`pgmr debug check-consistency`,
    /// `multiregion.check_consistency()`): [`LocalResponse::Consistency`].
    CheckConsistency,
    /// Where a statement over these (table, partition) ranges runs: [`LocalResponse::Route`].
    /// A read that stays here has passed its read barrier when this answers. A target with no
    /// partition names every partition of a REGIONAL BY ROW table (an INSERT's rows are
    /// routed to partitions only as they are written).
    Route {
        database: String,
        targets: Vec<(TableRef, Option<String>)>,
        /// Needs the leaseholder: writes or locks rows (INSERT, UPDATE, DELETE, `FOR UPDATE`),
        /// or reads under REPEATABLE READ or SERIALIZABLE.
        write: bool,
        /// Changes rows (so its commit is checked against the range's fence); a statement
        /// that only reads on the leaseholder passes a read barrier instead.
        #[serde(default)]
        modifies: bool,
        /// The statement may be split: an UPDATE or DELETE of one REGIONAL BY ROW table (what
        /// else it reads in `split_reads`), or a plain scan of one. Leased on several nodes,
        /// it then runs on each leaseholder over that node's partitions
        /// ([`LocalResponse::Route`]'s `split`).
        #[serde(default)]
        splittable: bool,
        /// Other nodes this transaction has a part on (changes this node's copies lack).
        #[serde(default)]
        txn_nodes: Vec<u64>,
        /// A read-write REPEATABLE READ or SERIALIZABLE statement: it reads only on the node
        /// that leases every range it reads, whose snapshot and whose serializable conflicts
        /// are the transaction's. Leased on several nodes, it is refused rather than run here
        /// over this node's copies (a write skew across nodes would go unseen).
        #[serde(default)]
        one_leaseholder: bool,
        /// A read whose REGIONAL BY ROW tables the extension can gather from their
        /// leaseholders first: where no node holds a copy of every range it reads, the answer
        /// is `gather` rather than an error.
        #[serde(default)]
        may_gather: bool,
        /// Partitions among `targets` that an INSERT only writes rows into (its VALUES name
        /// their regions) and nothing in the statement reads: like a table named without a
        /// partition, they need no replica here and no read barrier, since rows for a
        /// partition leased elsewhere are written at its leaseholder (`mixed`).
        #[serde(default)]
        inserted: Vec<(TableRef, String)>,
        /// A splittable UPDATE or DELETE that also reads other ranges (a subquery, `FROM` or
        /// `USING`, its own table again): `changes` are the targets its shares change (its
        /// result relation's partitions), `reads` those they only read. Each share's node
        /// reads these from its own copy after a read barrier there. `None`: the shares only
        /// touch `targets`.
        #[serde(default)]
        split_reads: Option<SplitReads>,
        /// Targets whose rows the statement locks (`FOR UPDATE`/`SHARE`, in a subquery too),
        /// its result relations aside. Leased on several nodes, the statement would run here
        /// and take those locks on copies, where they conflict with nothing: it is refused
        /// if one is leased elsewhere.
        #[serde(default)]
        locked: Vec<(TableRef, Option<String>)>,
    },
    /// Runs part of a transaction on another node's PostgreSQL: [`LocalResponse::Forwarded`]
    /// or [`LocalResponse::SqlError`].
    Forward {
        node_id: u64,
        request: ForwardRequest,
    },
    /// Several [`LocalRequest::Forward`]s to different nodes at once (a split statement's
    /// shares): [`LocalResponse::ForwardedEach`], one answer per request, in order.
    ForwardEach {
        requests: Vec<(u64, ForwardRequest)>,
    },
}

/// The changes a transaction made to one (table, REGIONAL BY ROW partition).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetWrite {
    pub table: TableRef,
    pub partition: Option<String>,
    /// The changes, as the extension's JSON array (opaque to pgmr).
    pub changes: String,
}

/// A remote part of a transaction: its session on `node_id`, and the savepoint operations
/// still to be applied there before it prepares.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Participant {
    pub node_id: u64,
    pub session: String,
    #[serde(default)]
    pub savepoints: Vec<SavepointOp>,
}

/// A coordinating backend's own changes in a two-phase commit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LocalWrite {
    pub writes: Vec<TargetWrite>,
    pub txn_id: String,
    pub schema_version: u64,
    pub txn_start_ms: u64,
}

/// A participant's part in another node's two-phase commit: prepare only; the decision is
/// the first one recorded for `gid` in range `anchor`'s log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrepareAs {
    pub anchor: u64,
    pub gid: String,
}

impl PrepareAs {
    /// The name of the participant's prepared PostgreSQL transaction.
    pub fn prepared_name(&self) -> String {
        format!("mr:{}:{}", self.anchor, self.gid)
    }

    /// Reads [`Self::prepared_name`] back (`None` for other prepared transactions).
    pub fn from_prepared_name(name: &str) -> Option<PrepareAs> {
        let rest = name.strip_prefix("mr:")?;
        let (anchor, gid) = rest.split_once(':')?;
        Some(PrepareAs {
            anchor: anchor.parse().ok()?,
            gid: gid.to_string(),
        })
    }

    /// The setting value that tells a participant backend its part (`anchor:gid`).
    pub fn setting(&self) -> String {
        format!("{}:{}", self.anchor, self.gid)
    }

    pub fn from_setting(v: &str) -> Option<PrepareAs> {
        let (anchor, gid) = v.split_once(':')?;
        Some(PrepareAs {
            anchor: anchor.parse().ok()?,
            gid: gid.to_string(),
        })
    }
}

/// One step of a transaction that runs on another node (its leaseholder), in a session that
/// node's pgmr keeps for the transaction: begin it if `begin` is given, apply the savepoint
/// operations, run the statement, then finish if asked. Everything a step needs travels with
/// it, so an autocommit statement is one message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForwardRequest {
    /// Unique per origin node and transaction.
    pub session: String,
    /// The origin backend, so the origin's pgmr can end sessions whose backend is gone.
    pub backend_pid: i32,
    #[serde(default)]
    pub begin: Option<ForwardBegin>,
    #[serde(default)]
    pub savepoints: Vec<SavepointOp>,
    #[serde(default)]
    pub statement: Option<ForwardStatement>,
    #[serde(default)]
    pub finish: Option<Finish>,
    /// Take this node's turn for transactions over several nodes before the statement,
    /// waiting at most this many milliseconds for it (0: as long as it takes). A read-write
    /// REPEATABLE READ or SERIALIZABLE transaction with parts on several nodes holds each
    /// one's turn until it commits there (ARCHITECTURE.md §8.5, "Isolation").
    #[serde(default)]
    pub turn: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForwardBegin {
    pub database: String,
    /// The role the statements run as (the origin session's current user).
    pub role: String,
    pub isolation: Isolation,
    pub read_only: bool,
    /// Session settings the statement's meaning depends on (search_path, DateStyle, …).
    pub settings: Vec<(String, String)>,
    /// The origin's region: `gateway_region()` answers it on the remote node too.
    pub gateway_region: String,
    /// The database's multi-region schema version at the origin: the remote node runs the
    /// statements only once it has applied it (they were planned against that schema).
    #[serde(default)]
    pub schema_version: u64,
}

/// How a read-write REPEATABLE READ or SERIALIZABLE statement stays on one leaseholder: the
/// hint of every refusal that keeps it there (pgmr's and the extension's).
pub const ONE_LEASEHOLDER_HINT: &str = "Under REPEATABLE READ and SERIALIZABLE a read-write transaction reads rows only where they are leased, never from a copy: name the rows' region so that the statement touches ranges leased on one node, write each region's rows in a statement of its own, use READ COMMITTED, or make the transaction READ ONLY.";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Isolation {
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

impl Isolation {
    /// The BEGIN statement that starts a transaction at this level.
    pub fn begin_sql(self, read_only: bool) -> &'static str {
        match (self, read_only) {
            (Isolation::ReadCommitted, false) => "BEGIN ISOLATION LEVEL READ COMMITTED",
            (Isolation::ReadCommitted, true) => "BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY",
            (Isolation::RepeatableRead, false) => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            (Isolation::RepeatableRead, true) => "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
            (Isolation::Serializable, false) => "BEGIN ISOLATION LEVEL SERIALIZABLE",
            (Isolation::Serializable, true) => "BEGIN ISOLATION LEVEL SERIALIZABLE READ ONLY",
        }
    }
}

/// A savepoint of the origin transaction mirrored on the remote one, named by the origin's
/// subtransaction id (so no user text reaches the remote SQL).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SavepointOp {
    Savepoint(u32),
    Release(u32),
    RollbackTo(u32),
}

impl SavepointOp {
    pub fn sql(self) -> String {
        match self {
            SavepointOp::Savepoint(id) => format!("SAVEPOINT mr_{id}"),
            SavepointOp::Release(id) => format!("RELEASE SAVEPOINT mr_{id}"),
            SavepointOp::RollbackTo(id) => format!("ROLLBACK TO SAVEPOINT mr_{id}"),
        }
    }
}

/// A target a statement locks, leased on another node ([`LocalResponse::Route`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockedElsewhere {
    pub table: TableRef,
    pub partition: Option<String>,
    /// 0: no range is known for it yet.
    pub range_id: u64,
    pub leaseholder: Option<u64>,
}

/// What a split UPDATE or DELETE changes and what it only reads ([`LocalRequest::Route`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SplitReads {
    /// Its result relation's partitions: the shares are made of these.
    pub changes: Vec<(TableRef, Option<String>)>,
    /// Every other (table, partition) it reads; a partition it also changes is read by the
    /// other shares' nodes from their copies.
    pub reads: Vec<(TableRef, Option<String>)>,
    /// The transaction has changed rows on the asking node: no other node's share may read
    /// ranges leased there.
    pub changed_here: bool,
}

/// A statement and its parameters as (type name, text value).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForwardStatement {
    pub sql: String,
    pub params: Vec<(String, Option<String>)>,
    /// The lock timeout the statement runs with there, when the transaction has parts on
    /// several nodes (a deadlock across nodes is invisible to each PostgreSQL's detector).
    #[serde(default)]
    pub lock_timeout_ms: Option<u64>,
    /// Runs over these partitions of its target table only (a share of a statement split
    /// over several leaseholders); empty: the whole statement.
    #[serde(default)]
    pub partitions: Vec<String>,
    /// Ranges the share reads besides its partitions, from the copies on the node it runs on
    /// (a subquery's table): that node passes their read barriers before running it, so the
    /// share sees every write acknowledged before the statement began.
    #[serde(default)]
    pub read_ranges: Vec<u64>,
    /// Session settings (of the forwarded ones) whose value at the origin changed since the
    /// remote transaction last had them: set there, for the transaction, before it runs. A
    /// function's `SET search_path` clause, say, lasts only for its own statements.
    #[serde(default)]
    pub settings: Vec<(String, String)>,
    /// The role the statement runs as at the origin, when it is not the transaction's first
    /// (`ForwardBegin::role`) or may not be: a SECURITY DEFINER function's statements run as
    /// its owner, the caller's as the caller, in one remote transaction.
    #[serde(default)]
    pub role: Option<String>,
    /// Run as PostgreSQL runs a referential query that must see rows committed since the
    /// transaction's snapshot under REPEATABLE READ or SERIALIZABLE (`ri_PerformCheck`'s
    /// `detectNewRows`): with the latest snapshot, rows the transaction's snapshot does not
    /// see raising 40001. Without it a removed key's look for referencing rows missed a
    /// referencing row committed meanwhile, and the key went.
    #[serde(default)]
    pub crosscheck: bool,
}

/// A node that does not say whether its part wrote is taken to have written.
fn wrote_unknown() -> bool {
    true
}

/// A statement a foreign key's trigger ran while serving another node's statement, over rows
/// leased elsewhere: not run there (that node cannot see the transaction's changes on other
/// nodes, nor lock rows it does not lease), but returned for the origin to run in the same
/// transaction, where its routing reaches every part (ARCHITECTURE.md §9, "Foreign keys").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeferredStatement {
    /// The trigger's query (a referential check, or a cascade's UPDATE or DELETE).
    pub sql: String,
    /// Its parameters as (type name, text value).
    pub params: Vec<(String, Option<String>)>,
    /// The role it ran as (a table owner: PostgreSQL runs referential queries so).
    pub role: String,
    /// A check: the violation to report unless the query finds rows as expected.
    #[serde(default)]
    pub check: Option<DeferredCheck>,
    /// Run with the latest snapshot, checked against the transaction's
    /// (`ForwardStatement::crosscheck`).
    #[serde(default)]
    pub crosscheck: bool,
    /// Of a constraint declared INITIALLY DEFERRED: run when the transaction commits, not
    /// after the statement.
    #[serde(default)]
    pub at_commit: bool,
    /// For such a query, whether it still applies at commit, as PostgreSQL decides: a check
    /// of a new referencing row is skipped if the row is gone (deleted, or updated: its new
    /// version has a check of its own); a removed key's, if a row with the key is back.
    #[serde(default)]
    pub guard: Option<Guard>,
    /// For such a query, its constraint and those it was cloned from (a partition's key from
    /// its table's), each as (schema, name): a `SET CONSTRAINTS … IMMEDIATE` naming one of
    /// them runs the query then instead.
    #[serde(default)]
    pub constraint: Vec<(String, String)>,
}

/// A query run before a [`DeferredStatement`] at commit, which is skipped if the guard finds
/// a row (`skip_if_found`) or finds none (otherwise).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Guard {
    pub sql: String,
    #[serde(default)]
    pub params: Vec<(String, Option<String>)>,
    /// The role it runs as (a table owner).
    pub role: String,
    #[serde(default)]
    pub skip_if_found: bool,
}

/// What a deferred referential check expects, and the error PostgreSQL would raise.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeferredCheck {
    /// The referenced row must exist (a check of new referencing rows); else it must not be
    /// referenced any more (NO ACTION or RESTRICT of a removed key).
    pub exists: bool,
    pub message: String,
    pub detail: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    Commit,
    Rollback,
    /// `PREPARE TRANSACTION` as a participant of the origin's two-phase commit.
    Prepare(PrepareAs),
}

/// Rows a statement wrote into a partition leased on another node, left for the origin of
/// its transaction to write at that partition's leaseholder (ARCHITECTURE.md §9).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MovedRows {
    pub schema: String,
    pub table: String,
    /// The REGIONAL BY ROW partition; `None`: a table that is one range (rows a COPY
    /// through a node that does not lease it read).
    #[serde(default)]
    pub partition: Option<String>,
    /// Each row as a JSON object of column name to its text form (null for NULL), as
    /// `json_populate_recordset` reads it.
    pub rows: Vec<String>,
}

/// Changes a statement made to the keys of one global key table (a REGIONAL BY ROW table's
/// unique key without its region), left for the origin of its transaction to apply at the key
/// table's leaseholder, where PostgreSQL's own unique index decides (ARCHITECTURE.md §7).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyChanges {
    /// The key table (in schema `multiregion_keys`).
    pub key_schema: String,
    pub key_table: String,
    /// The table whose key it keeps, and the constraint that declares the key.
    pub parent_schema: String,
    pub parent_table: String,
    pub constraint: String,
    /// Each row's key before and after, as JSON objects of column to value (`None`: the row
    /// was inserted, or deleted).
    pub changes: Vec<(Option<String>, Option<String>)>,
    /// The table was truncated first: every key it held is released before `changes`.
    #[serde(default)]
    pub truncated: bool,
}

impl KeyChanges {
    /// Drops each key the statement both released and took again in the same form (a row
    /// moved between partitions): such a key stays as it is, and a statement that only moved
    /// rows need not reach the key table's leaseholder at all. Keys equal in value but
    /// printed differently are left for the key table's leaseholder, which compares values.
    pub fn cancel_moves(&mut self) {
        let mut taken: HashMap<String, usize> = HashMap::new();
        for (old, new) in &self.changes {
            if let (None, Some(k)) = (old, new) {
                *taken.entry(k.clone()).or_default() += 1;
            }
        }
        if taken.is_empty() {
            return;
        }
        // Per key, how many releases found a take to cancel against.
        let mut cancelled: HashMap<String, usize> = HashMap::new();
        self.changes.retain(|(old, new)| match (old, new) {
            (Some(k), None) => match taken.get_mut(k) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    *cancelled.entry(k.clone()).or_default() += 1;
                    false
                }
                _ => true,
            },
            _ => true,
        });
        self.changes.retain(|(old, new)| match (old, new) {
            (None, Some(k)) => match cancelled.get_mut(k) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    false
                }
                _ => true,
            },
            _ => true,
        });
    }
}

/// One range of a table, as `TableRanges` answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableRange {
    pub range_id: u64,
    pub table: TableRef,
    pub partition: Option<String>,
    pub leaseholder: Option<u64>,
    /// The leaseholder is this node.
    pub here: bool,
    /// This node holds a replica the range's descriptor lists: its copy is whole once the
    /// fence barrier passed. Elsewhere the copy holds nothing of the range.
    #[serde(default)]
    pub held: bool,
}

/// Where a range's statements run, as `Route` answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteRange {
    pub range_id: u64,
    pub leaseholder: Option<u64>,
    pub local_replica: bool,
}

/// What happens to frames this node sends to one peer, on top of the simulated WAN latency.
/// Faults act on the sender's side only, so a one-way partition is one node's rule and a full
/// partition is a rule on each side.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkFault {
    /// Every frame is discarded.
    #[serde(default)]
    pub partitioned: bool,
    /// Probability (0 to 1) that a frame is discarded.
    #[serde(default)]
    pub drop_rate: f64,
    /// Added to the link's one-way delay, in milliseconds.
    #[serde(default)]
    pub extra_delay_ms: f64,
}

impl LinkFault {
    /// Checks the values a user can set, with a message that names the bad one.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.drop_rate) {
            return Err(format!(
                "drop rate {} is not between 0 and 1",
                self.drop_rate
            ));
        }
        if !(0.0..=600_000.0).contains(&self.extra_delay_ms) {
            return Err(format!(
                "extra delay {} ms is not between 0 and 600000",
                self.extra_delay_ms
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LocalResponse {
    NodeInfo(NodeInfo),
    NetworkLatency {
        rows: Vec<RttRow>,
    },
    ClusterRegions {
        regions: Vec<RegionZones>,
    },
    Status(Status),
    /// The faults now in force, by peer node id.
    LinkFaults {
        faults: Vec<(u64, LinkFault)>,
    },
    Nodes {
        nodes: Vec<NodeRow>,
    },
    MetaGroup(MetaGroup),
    /// A metadata write committed.
    Done,
    /// Values `first, first + increment, …` drawn from a sequence, `count` of them.
    SequenceValues {
        first: i64,
        count: u64,
    },
    /// The sequence is at `limit`, its bound, and does not cycle.
    SequenceLimit {
        limit: i64,
    },
    ClusterSettings {
        settings: Vec<(String, String)>,
    },
    ZoneOverrides {
        zones: mr_meta::ZoneOverrides,
    },
    SchemaAppliers {
        appliers: Vec<SchemaApplierRow>,
    },
    PartitionSample {
        row: Option<String>,
    },
    EventLog {
        events: Vec<EventRow>,
    },
    /// A schema change committed as this version of its database's schema.
    SchemaVersion {
        version: u64,
    },
    /// A database's schema log: its latest version (0: never changed), every change as
    /// `(version, change)` oldest first, and each node's applied version as
    /// `(node_id, version)`.
    SchemaLog {
        version: u64,
        changes: Vec<(u64, String)>,
        applied: Vec<(u64, u64)>,
    },
    /// Every multi-region database's configuration, by database name.
    DatabaseConfigs {
        databases: Vec<DatabaseConfig>,
    },
    /// The backends whose idle transaction was restarted.
    Restarted {
        backend_pids: Vec<i32>,
    },
    Ranges {
        ranges: Vec<RangeRow>,
    },
    RangeProgress {
        replicas: Vec<RangeProgress>,
    },
    /// The (range, log index) of each entry the transaction's changes became.
    Replicated {
        entries: Vec<(u64, u64)>,
    },
    NotReplicated,
    /// The barrier is passed; `enabled: false` when row replication is off (the caller may
    /// skip barriers for a while).
    ReadBarrier {
        enabled: bool,
    },
    Consistency {
        replicas: Vec<ReplicaChecksum>,
    },
    /// `enabled: false`: row replication is off, nothing to fence.
    TableRanges {
        enabled: bool,
        ranges: Vec<TableRange>,
    },
    /// (range, index) per range asked.
    FenceBarrier {
        after: Vec<(u64, u64)>,
    },
    /// `forward_to: None`: run here (a read has passed its barrier); `Some(node)`: run the
    /// statement on that node. `enabled: false`: row replication is off.
    Route {
        enabled: bool,
        forward_to: Option<u64>,
        /// A splittable statement over partitions leased on several nodes: each leaseholder
        /// (`None`: this node) and the partitions it runs the statement over.
        #[serde(default)]
        split: Vec<(Option<u64>, Vec<String>)>,
        /// A write that runs here although the ranges it touches are leased on several
        /// nodes: rows it writes into ranges leased elsewhere must go there.
        #[serde(default)]
        mixed: bool,
        /// A read (asked with `may_gather`) over ranges no node holds a copy of every one of:
        /// re-planned with its REGIONAL BY ROW tables read through their leaseholders first.
        #[serde(default)]
        gather: bool,
        /// The ranges a `split` statement's shares only read ([`SplitReads`]): a share sent
        /// to another node passes their read barriers there before it runs
        /// ([`ForwardStatement::read_ranges`]); this node's own share has passed them.
        #[serde(default)]
        read_ranges: Vec<u64>,
        /// A `mixed` statement's locked targets (asked in `locked`) leased on another node,
        /// or on none yet: if its plan still scans one once the executor has pruned its
        /// partitions (a generic plan's parameters), it is refused there, its locks would be
        /// taken on this node's copy.
        #[serde(default)]
        locked_elsewhere: Vec<LockedElsewhere>,
    },
    /// A forwarded step ran: its rows as text (the result columns the origin planned) and the
    /// number of rows it processed.
    Forwarded {
        processed: u64,
        rows: Vec<Vec<Option<String>>>,
        /// Rows the statement wrote into partitions leased on other nodes: not written
        /// there, for the origin to write at their leaseholders in the same transaction.
        #[serde(default)]
        moved: Vec<MovedRows>,
        /// Changes the statement made to global keys, for the origin to apply at their key
        /// tables' leaseholders in the same transaction.
        #[serde(default)]
        keys: Vec<KeyChanges>,
        /// Referential statements over rows leased elsewhere, for the origin to run next in
        /// the same transaction. A step sent to commit at once that returns some did not
        /// commit: its session stays open, as a part of the origin's transaction.
        #[serde(default)]
        deferred: Vec<DeferredStatement>,
        /// The remote transaction has changed replicated rows (so far): a part that only read
        /// and locked rows takes no part in the commit, and is released after it.
        #[serde(default = "wrote_unknown")]
        wrote: bool,
        /// The ranges a part's prepare (`Finish::Prepare`) wrote `Prepare` entries into: the
        /// coordinator has its decision copied into each before the anchor forgets it.
        #[serde(default)]
        prepared_ranges: Vec<u64>,
    },
    /// A forwarded step failed in PostgreSQL on the remote node, with its error as is.
    SqlError(SqlError),
    /// A part's prepare (`Finish::Prepare`) failed after proposing `Prepare` entries to
    /// `prepared_ranges` (PostgreSQL's serializable check and its refusal of temporary
    /// objects come after the pre-prepare), or its connection broke (`broken`: it may have
    /// prepared, and written where nobody knows). The coordinator has its abort copied into
    /// each range, and the node roll back, before the anchor forgets it. The client sees
    /// `error`, as for [`LocalResponse::SqlError`].
    PrepareFailed {
        error: SqlError,
        prepared_ranges: Vec<u64>,
        broken: bool,
    },
    /// The answers to [`LocalRequest::ForwardEach`], in its order.
    ForwardedEach {
        answers: Vec<LocalResponse>,
    },
    /// The request cannot be served as things are (SQLSTATE 0A000), with a hint.
    Unsupported {
        message: String,
        hint: String,
    },
    /// pgmr understood the request but could not serve it. `retryable`: nothing was applied
    /// and the same request may simply be sent again. `ambiguous`: a write may or may not
    /// have committed.
    Error {
        message: String,
        #[serde(default)]
        retryable: bool,
        #[serde(default)]
        ambiguous: bool,
    },
}

/// A PostgreSQL error as a client sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SqlError {
    pub code: String,
    pub message: String,
    #[serde(default)]
    pub detail: Option<String>,
    #[serde(default)]
    pub hint: Option<String>,
}

impl LocalResponse {
    pub fn error(message: impl Into<String>) -> LocalResponse {
        LocalResponse::Error {
            message: message.into(),
            retryable: false,
            ambiguous: false,
        }
    }
}

/// A node as the meta group records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRow {
    pub node_id: u64,
    pub rpc_addr: String,
    pub sql_addr: String,
    pub locality: String,
    pub region: String,
    pub zone: Option<String>,
    pub joined_at_ms: u64,
    pub last_heartbeat_ms: u64,
    /// live, suspect, dead or decommissioned, from the latest heartbeat and the answering
    /// node's clock.
    pub status: String,
    /// voter, learner, or none (not a member of the meta group).
    pub meta_role: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetaGroup {
    pub node_id: u64,
    /// leader, follower, candidate or learner.
    pub state: String,
    pub leader: Option<u64>,
    pub term: u64,
    pub last_log_index: Option<u64>,
    pub commit_index: Option<u64>,
    pub applied_index: Option<u64>,
    pub voters: Vec<u64>,
    pub learners: Vec<u64>,
    /// Each member's replication progress, from the leader; empty when no leader answered.
    pub members: Vec<MemberProgress>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberProgress {
    pub node_id: u64,
    pub role: String,
    pub matched_index: Option<u64>,
    /// Entries the leader has that this member is not known to have.
    pub lag: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventRow {
    pub id: u64,
    pub at_ms: u64,
    pub node_id: u64,
    pub seq: u64,
    /// The command's name (`add_node`, `set_cluster_setting`, …).
    pub event_type: String,
    /// The command, as JSON.
    pub info: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub node_id: u64,
    pub cluster_id: String,
    pub locality: String,
    pub region: String,
    pub zone: Option<String>,
    pub pgmr_version: String,
    pub rpc_addr: String,
    pub sql_addr: String,
    /// Milliseconds since pgmr started.
    pub uptime_ms: u64,
    /// Process id of the PostgreSQL postmaster pgmr supervises, if it is up.
    pub postmaster_pid: Option<u32>,
    /// How many times pgmr has had to restart its PostgreSQL.
    pub pg_restarts: u64,
}

/// One directed pair: the RTT that `from` measured to `to`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RttRow {
    pub from_node: u64,
    pub from_region: String,
    pub from_zone: Option<String>,
    pub to_node: u64,
    pub to_region: String,
    pub to_zone: Option<String>,
    /// Median of the recent samples; `None` until the first heartbeat came back.
    pub rtt_ms: Option<f64>,
    /// How old `from`'s report is, as seen by the answering node.
    pub age_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionZones {
    pub region: String,
    pub zones: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    pub node: NodeInfo,
    pub peers: Vec<PeerStatus>,
    /// Injected faults in force on this node's outgoing links, by peer node id.
    #[serde(default)]
    pub faults: Vec<(u64, LinkFault)>,
    /// This node's schema-change applier, by database.
    #[serde(default)]
    pub schema: std::collections::BTreeMap<String, SchemaApplyStatus>,
}

/// One node's progress through one database's schema log, as the meta group knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchemaApplierRow {
    pub database: String,
    pub node_id: u64,
    /// The latest version the node reported applied.
    pub applied: u64,
    /// The latest version in the log.
    pub latest: u64,
    /// The version the node's applier reported it cannot apply, with PostgreSQL's error.
    pub failed_version: Option<u64>,
    pub error: Option<String>,
}

/// How far this node's PostgreSQL has applied one database's schema log.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchemaApplyStatus {
    /// The latest version this node has applied.
    pub applied: u64,
    /// The latest version in the meta group's log, as this node last read it.
    pub latest: u64,
    /// The last failure to apply or report a change, cleared by the next success.
    pub last_error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerStatus {
    pub node_id: u64,
    pub locality: String,
    pub rpc_addr: String,
    pub sql_addr: String,
    /// True if this node heard from the peer within the liveness window.
    pub live: bool,
    pub last_heard_ms_ago: Option<u64>,
    pub rtt_ms: Option<f64>,
}

/// One replica's Raft and apply progress, as its node reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeProgress {
    pub range_id: u64,
    pub node_id: u64,
    /// leader, follower, learner, candidate.
    pub raft_state: String,
    pub leader: Option<u64>,
    pub term: u64,
    pub last_log_index: u64,
    pub committed_index: u64,
    /// The applier's cursor: every entry up to it is in this node's PostgreSQL.
    pub applied_index: u64,
    /// On the leader: each member's highest replicated index.
    pub matched: Vec<(u64, u64)>,
    /// The index this replica's latest snapshot is at (0: none yet).
    #[serde(default)]
    pub snapshot_index: u64,
    /// The first index its log still holds (entries before it were purged up to a snapshot).
    #[serde(default)]
    pub first_log_index: u64,
}

/// One replica's rows, summarised at its applied index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaChecksum {
    pub range_id: u64,
    pub node_id: u64,
    /// `None` when the node could not be asked or has no replica running.
    pub applied_index: Option<u64>,
    pub row_count: Option<u64>,
    pub checksum: Option<String>,
    /// Why there is no checksum, if there is none.
    pub error: Option<String>,
    /// Every replica of the range agrees (at one applied index).
    pub consistent: bool,
}

/// One range as `multiregion.ranges` shows it (CockroachDB's `SHOW RANGES` columns).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RangeRow {
    pub range_id: u64,
    pub database_name: String,
    pub schema_name: String,
    pub table_name: String,
    /// The region of a REGIONAL BY ROW partition; `None` for a whole table.
    pub partition: Option<String>,
    pub lease_holder: Option<u64>,
    pub lease_holder_region: Option<String>,
    /// Voters in lease preference order.
    pub voting_replicas: Vec<u64>,
    pub non_voting_replicas: Vec<u64>,
    /// The regions of the replicas, in the order of `voting_replicas` then
    /// `non_voting_replicas`.
    pub replica_regions: Vec<String>,
    pub generation: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn keys(changes: &[(Option<&str>, Option<&str>)]) -> KeyChanges {
        KeyChanges {
            key_schema: "multiregion_keys".into(),
            key_table: "users".into(),
            parent_schema: "public".into(),
            parent_table: "users".into(),
            constraint: "users_pkey".into(),
            changes: changes
                .iter()
                .map(|(o, n)| (o.map(str::to_string), n.map(str::to_string)))
                .collect(),
            truncated: false,
        }
    }

    #[test]
    fn a_key_released_and_taken_again_by_one_statement_cancels_out() {
        let mut k = keys(&[
            (Some("a"), None),
            (None, Some("b")),
            (None, Some("a")),
            (Some("c"), None),
            (Some("d"), Some("e")),
        ]);
        k.cancel_moves();
        assert_eq!(
            k,
            keys(&[(None, Some("b")), (Some("c"), None), (Some("d"), Some("e"))])
        );
    }

    #[test]
    fn a_key_taken_twice_and_released_once_keeps_one_take() {
        let mut k = keys(&[(None, Some("a")), (Some("a"), None), (None, Some("a"))]);
        k.cancel_moves();
        assert_eq!(k, keys(&[(None, Some("a"))]));
    }

    /// The schema-change requests' JSON, as the extension and pgmr exchange it.
    #[test]
    fn schema_change_messages_have_a_stable_shape() {
        let req = LocalRequest::ProposeSchemaChange {
            database: "movr".into(),
            expected_version: 3,
            change: r#"{"op":"x"}"#.into(),
            config: None,
            localities: vec![(
                TableRef {
                    database: "movr".into(),
                    schema: "public".into(),
                    table: "users".into(),
                },
                Some(TableLocality::RegionalByRow {
                    column: "crdb_region".into(),
                }),
            )],
            tables: None,
            fenced: vec![],
            notify: vec![],
            key_seeds: vec![],
            sequences: vec![],
            zones: vec![],
        };
        let v = serde_json::to_value(&req).unwrap();
        assert_eq!(
            v,
            json!({
                "type": "propose_schema_change",
                "database": "movr",
                "expected_version": 3,
                "change": "{\"op\":\"x\"}",
                "config": null,
                "localities": [[
                    {"database": "movr", "schema": "public", "table": "users"},
                    {"kind": "regional_by_row", "column": "crdb_region"}
                ]],
                "tables": null
            })
        );
        assert_eq!(serde_json::from_value::<LocalRequest>(v).unwrap(), req);
        // config and localities may be left out.
        let short: LocalRequest = serde_json::from_value(json!({
            "type": "propose_schema_change", "database": "d", "expected_version": 0, "change": ""
        }))
        .unwrap();
        assert!(
            matches!(short, LocalRequest::ProposeSchemaChange { config: None, localities, .. } if localities.is_empty())
        );
        let resp = LocalResponse::SchemaLog {
            version: 2,
            changes: vec![(1, "a".into()), (2, "b".into())],
            applied: vec![(1, 2), (3, 1)],
        };
        let v = serde_json::to_value(&resp).unwrap();
        assert_eq!(
            v,
            json!({"type": "schema_log", "version": 2, "changes": [[1, "a"], [2, "b"]], "applied": [[1, 2], [3, 1]]})
        );
        assert_eq!(serde_json::from_value::<LocalResponse>(v).unwrap(), resp);
        let v = serde_json::to_value(LocalRequest::AwaitSchemaApplied {
            database: "movr".into(),
            version: 4,
            timeout_ms: 30_000,
        })
        .unwrap();
        assert_eq!(
            v,
            json!({"type": "await_schema_applied", "database": "movr", "version": 4, "timeout_ms": 30000})
        );
        assert_eq!(
            serde_json::to_value(LocalResponse::SchemaVersion { version: 4 }).unwrap(),
            json!({"type": "schema_version", "version": 4})
        );
        // A status from a pgmr without the applier still decodes.
        let s: Status = serde_json::from_value(json!({
            "node": {"node_id": 1, "cluster_id": "c", "locality": "region=a", "region": "a",
                     "zone": null, "pgmr_version": "0", "rpc_addr": "x", "sql_addr": "y",
                     "uptime_ms": 0, "postmaster_pid": null, "pg_restarts": 0},
            "peers": []
        }))
        .unwrap();
        assert!(s.schema.is_empty());
    }
}
