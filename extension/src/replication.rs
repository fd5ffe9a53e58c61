//! Row replication, the extension's half: capture a transaction's row changes and have pgmr
//! commit them in their range's Raft log before the transaction commits here.
//!
//! * **Capture.** Every replicated table gets two triggers when it is created (the
//!   `multiregion_install_capture` event trigger): an AFTER row trigger for INSERT, UPDATE and
//!   DELETE (cloned by PostgreSQL onto every partition, so COPY, `ON CONFLICT`, cascades and
//!   rows written by other triggers are seen too) and an AFTER TRUNCATE statement trigger.
//!   Both call `multiregion.capture()`, which appends the change to this backend's buffer.
//!   Savepoints are honoured: a rolled-back subtransaction's changes are dropped.
//! * **Pre-commit.** With changes buffered, the transaction first runs PostgreSQL's own
//!   serializable pre-commit check (so a serialization failure cannot happen after the Raft
//!   commit), records its id in `multiregion.range_txns` (uncommitted: the key's lock orders
//!   the range's applier after this transaction), and asks pgmr to replicate. Any failure
//!   aborts the transaction here, before anyone can see it.
//! * **After.** If the transaction aborts after its entry was committed in Raft, pgmr is told,
//!   so that the range serves no write until its applier has applied the entry; if pgmr
//!   cannot be told, the server must not go on (PANIC: recovery applies the entry).
//!
//! Writes that schema changes make (a REGIONAL BY ROW conversion copying rows) are not
//! captured: every node runs the schema change on its own copy.

use crate::error::{MrError, OrRaise};
use crate::gucs;
use crate::regions::spi;
use crate::sidecar::{self, Replication};
use mr_wire::local::{LocalRequest, LocalWrite, PrepareAs, TargetWrite};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::rc::Rc;
use std::time::{Duration, Instant};

/// Write sets above this size first ask pgmr whether replication is on.
const ASK_FIRST_ABOVE: usize = 256 * 1024;
/// The largest write set one transaction may replicate (pgmr splits it into Raft entries of
/// about 1 MiB); inside the local channel's frame limit with room for JSON escaping.
const MAX_WRITE_SET: usize = 128 << 20;
/// Each (table, partition)'s changes are sent as JSON arrays of about this size, which pgmr
/// packs into Raft entries without parsing them.
const ARRAY_BYTES: usize = 512 << 10;

/// One captured row change.
struct Change {
    relid: pg_sys::Oid,
    op: char,
    old: Option<String>,
    new: Option<String>,
}

#[derive(Default)]
struct Txn {
    changes: Vec<Change>,
    /// `changes.len()` at the start of each open subtransaction.
    marks: Vec<usize>,
    /// The entries this transaction's changes became, once replicated.
    replicated: Vec<(u64, u64)>,
}

thread_local! {
    static TXN: RefCell<Txn> = RefCell::new(Txn::default());
    /// Where each captured relation's rows belong, by relid (`None`: not replicated).
    static TARGETS: RefCell<std::collections::HashMap<u32, Option<Rc<Target>>>> =
        RefCell::new(std::collections::HashMap::new());
    /// Until when reads skip the barrier: pgmr said row replication is off.
    static BARRIER_OFF_UNTIL: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    /// Above zero while the extension runs a schema change.
    static SUPPRESS: RefCell<u32> = const { RefCell::new(0) };
}

/// Runs `f` with capture off (schema changes rewrite rows on every node themselves).
pub fn without_capture<R>(f: impl FnOnce() -> R) -> R {
    struct Guard;
    impl Drop for Guard {
        fn drop(&mut self) {
            SUPPRESS.with(|s| *s.borrow_mut() -= 1);
        }
    }
    SUPPRESS.with(|s| *s.borrow_mut() += 1);
    let _guard = Guard;
    f()
}

/// Whether capture is off: a schema change is rewriting rows, on every node alike, so its
/// statements are neither replicated nor routed.
pub fn capture_suppressed() -> bool {
    SUPPRESS.with(|s| *s.borrow() > 0)
}

/// Appends one change; called only by the capture triggers (EXECUTE is revoked from PUBLIC,
/// so no session can forge changes that other nodes would apply as superuser).
#[pg_extern(schema = "multiregion")]
fn capture(relid: pg_sys::Oid, op: &str, old: Option<&str>, new: Option<&str>) {
    if SUPPRESS.with(|s| *s.borrow()) > 0 || gucs::sidecar_socket().is_none() {
        return;
    }
    let op = match op {
        "INSERT" => 'I',
        "UPDATE" => 'U',
        "DELETE" => 'D',
        "TRUNCATE" => 'T',
        _ => return,
    };
    // A REGIONAL BY ROW table's rows live in its partitions' ranges: TRUNCATE of the table
    // truncates each partition (each partition's own trigger fires too, when the table is
    // truncated and when a partition is truncated by itself: once each is enough).
    let leaves: Vec<pg_sys::Oid> = if op == 'T' {
        crate::regions::spi::read_rows(
            "SELECT relid::oid::text FROM pg_catalog.pg_partition_tree($1) \
              WHERE isleaf AND relid <> $1::regclass",
            vec![relid.into()],
        )
        .into_iter()
        .filter_map(|r| r.into_iter().next().flatten()?.parse::<u32>().ok())
        .map(pg_sys::Oid::from)
        .collect()
    } else {
        Vec::new()
    };
    TXN.with(|t| {
        let mut t = t.borrow_mut();
        let truncated_last = |changes: &[Change], relid: pg_sys::Oid| {
            changes
                .iter()
                .rev()
                .find(|c| c.relid == relid)
                .is_some_and(|c| c.op == 'T')
        };
        if op == 'T' && leaves.is_empty() && truncated_last(&t.changes, relid) {
            return;
        }
        if leaves.is_empty() {
            t.changes.push(Change {
                relid,
                op,
                old: old.map(str::to_string),
                new: new.map(str::to_string),
            });
        }
        for leaf in leaves {
            if truncated_last(&t.changes, leaf) {
                continue;
            }
            t.changes.push(Change {
                relid: leaf,
                op,
                old: None,
                new: None,
            });
        }
    });
}

/// Installs the transaction callbacks; from `_PG_init`.
#[allow(unsafe_code)]
pub fn init() {
    // SAFETY: `_PG_init` runs in the postmaster before any backend exists; the callbacks are
    // plain function pointers that forked backends inherit.
    unsafe {
        pg_sys::RegisterXactCallback(Some(xact_callback), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(subxact_callback), std::ptr::null_mut());
    }
}

#[pg_guard]
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn xact_callback(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::XactEvent::*;
    match event {
        XACT_EVENT_PRE_COMMIT => {
            // SAFETY: the transaction is still in progress at pre-commit; its portal (and so
            // its active snapshot) is gone, and SPI needs one: push the transaction's own and
            // pop it again (on error, abort pops it).
            unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot()) };
            // Checks of INITIALLY DEFERRED keys that statements served elsewhere returned
            // (they may add parts to the transaction: before its parts commit).
            crate::ri::run_at_commit();
            // Global key changes not yet applied (a COPY's: it has no executor finish).
            if crate::global_keys::any_pending() {
                crate::routing::apply_key_changes().or_raise();
            }
            // Schema first: the rows below carry its version, which replicas wait for.
            let schema = crate::regions::pre_commit().or_raise();
            crate::sequences::pre_commit().or_raise();
            crate::routing::pre_commit().or_raise();
            replicate(None).or_raise();
            if let Some((database, version)) = schema {
                crate::regions::await_applied(database, version);
            }
            unsafe { pg_sys::PopActiveSnapshot() };
        }
        XACT_EVENT_PRE_PREPARE => {
            if crate::regions::has_pending_schema_change() {
                MrError::PrepareSchemaChange.raise();
            }
            crate::routing::pre_prepare();
            if TXN.with(|t| !t.borrow().changes.is_empty()) {
                // Only a forwarded session that pgmr prepares as a part of another node's
                // two-phase commit may prepare replicated changes.
                let Some(part) = gucs::prepare_as() else {
                    MrError::PrepareReplicated.raise();
                };
                // SAFETY: as at pre-commit.
                unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot()) };
                replicate(Some(part)).or_raise();
                unsafe { pg_sys::PopActiveSnapshot() };
            }
        }
        XACT_EVENT_ABORT => {
            crate::regions::schema_at_end();
            crate::sequences::at_end();
            crate::routing::at_end(true);
            let t = TXN.with(|t| std::mem::take(&mut *t.borrow_mut()));
            for (range_id, index) in t.replicated {
                if let Err(e) = sidecar::abandon_txn(range_id, index) {
                    // The entry is committed in the range but not here, and the range would
                    // go on serving writes over its rows: stop, and let recovery apply it.
                    pgrx::ereport!(
                        PgLogLevel::PANIC,
                        PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
                        format!("a replicated write (range {range_id}, entry {index}) aborted locally and pgmr could not be told: {e}")
                    );
                }
            }
        }
        XACT_EVENT_COMMIT | XACT_EVENT_PREPARE => {
            crate::regions::schema_at_end();
            crate::sequences::at_end();
            crate::routing::at_end(false);
            TXN.with(|t| *t.borrow_mut() = Txn::default());
        }
        _ => {}
    }
}

#[pg_guard]
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn subxact_callback(
    event: pg_sys::SubXactEvent::Type,
    my: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::SubXactEvent::*;
    crate::routing::on_subxact(event, my);
    TXN.with(|t| {
        let mut t = t.borrow_mut();
        match event {
            SUBXACT_EVENT_START_SUB => {
                let n = t.changes.len();
                t.marks.push(n);
            }
            SUBXACT_EVENT_COMMIT_SUB => {
                t.marks.pop();
            }
            SUBXACT_EVENT_ABORT_SUB => {
                crate::regions::schema_sub_aborted(my);
                crate::sequences::sub_aborted(my);
                if let Some(n) = t.marks.pop() {
                    t.changes.truncate(n);
                }
            }
            _ => {}
        }
    });
}

#[allow(unsafe_code)]
unsafe extern "C-unwind" {
    /// predicate.c's serializable pre-commit check (exported by the server, not bound by pgrx).
    fn PreCommit_CheckForSerializationFailure();
}

/// Where a captured relation's rows belong: the table, its REGIONAL BY ROW partition, and
/// the leaf relation the rows are in.
struct Target {
    leaf_schema: String,
    leaf: String,
    schema: String,
    table: String,
    partition: Option<String>,
}

const TARGET: &str = "SELECT n.nspname::text, c.relname::text, \
        coalesce(pn.nspname, n.nspname)::text, coalesce(p.relname, c.relname)::text, \
        CASE WHEN c.relispartition THEN pg_catalog.pg_get_expr(c.relpartbound, c.oid) END \
    FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
    LEFT JOIN pg_catalog.pg_inherits i ON c.relispartition AND i.inhrelid = c.oid \
    LEFT JOIN pg_catalog.pg_class p ON p.oid = i.inhparent \
    LEFT JOIN pg_catalog.pg_namespace pn ON pn.oid = p.relnamespace \
    WHERE c.oid = $1";

/// Where `relid`'s rows belong; cached per backend until the relation changes.
fn target(relid: pg_sys::Oid) -> Option<Rc<Target>> {
    let key = relid.to_u32();
    if let Some(t) = TARGETS.with(|m| m.borrow().get(&key).cloned()) {
        return t;
    }
    let t = spi::read_rows(TARGET, vec![relid.into()])
        .into_iter()
        .next()
        .and_then(|row| {
            let col = |i: usize| row.get(i).cloned().flatten();
            Some(Rc::new(Target {
                leaf_schema: col(0)?,
                leaf: col(1)?,
                schema: col(2)?,
                table: col(3)?,
                partition: col(4).as_deref().and_then(list_value),
            }))
        });
    TARGETS.with(|m| m.borrow_mut().insert(key, t.clone()));
    t
}

/// The (schema, table, partition) a leaf partition of a replicated REGIONAL BY ROW table
/// holds rows of.
pub fn partition_of(relid: pg_sys::Oid) -> Option<(String, String, String)> {
    let t = target(relid)?;
    Some((t.schema.clone(), t.table.clone(), t.partition.clone()?))
}

/// The range a replicated relation's rows belong to: (schema, table, partition), the
/// partition `None` for a table that is one range.
pub fn range_of(relid: pg_sys::Oid) -> Option<(String, String, Option<String>)> {
    let t = target(relid)?;
    Some((t.schema.clone(), t.table.clone(), t.partition.clone()))
}

/// Forgets what was cached about `relid` (all relations for `InvalidOid`).
pub fn forget(relid: pg_sys::Oid) {
    crate::insert_rows::forget(relid);
    TARGETS.with(|m| {
        let mut m = m.borrow_mut();
        if relid == pg_sys::InvalidOid {
            m.clear();
        } else {
            m.remove(&relid.to_u32());
        }
    });
}

/// Whether a relation's rows are replicated (it has the capture trigger, enabled), read
/// from the catalog: for a relation not locked yet.
pub fn is_replicated_table(relid: pg_sys::Oid) -> bool {
    spi::read_rows(
        "SELECT EXISTS (SELECT FROM pg_catalog.pg_trigger WHERE tgrelid = $1 \
           AND tgname = 'multiregion_capture' AND tgenabled <> 'D')::text",
        vec![relid.into()],
    )
    .into_iter()
    .next()
    .and_then(|r| r.into_iter().next().flatten())
    .is_some_and(|v| v == "true")
}

/// [`is_replicated`] without its SPI query: for a relation the caller holds a lock on, or
/// one a foreign key of a locked relation references (dropping it drops the key, which locks
/// both), so that the answer cannot change under the caller.
pub fn is_replicated_table_locked(relid: pg_sys::Oid) -> bool {
    // SAFETY: reads the relcache entry; an unlocked one may be stale or gone (then false),
    // which this function's contract rules out for its answer's sake, not memory's.
    #[allow(unsafe_code)]
    unsafe {
        is_replicated(relid)
    }
}

/// Whether a relation has the capture trigger, i.e. its rows are replicated.
///
/// # Safety
/// `relid` is locked by the caller (as the executor's relations are).
#[allow(unsafe_code)]
unsafe fn is_replicated(relid: pg_sys::Oid) -> bool {
    // SAFETY: the relation is locked; the relcache entry is pinned between open and close and
    // its trigger descriptor only read.
    unsafe {
        let rel = pg_sys::RelationIdGetRelation(relid);
        if rel.is_null() {
            return false;
        }
        let mut found = false;
        let td = (*rel).trigdesc;
        if !td.is_null() {
            for i in 0..(*td).numtriggers as usize {
                let t = &*(*td).triggers.add(i);
                // A disabled capture trigger (tgenabled 'D') replicates nothing.
                if !t.tgname.is_null()
                    && t.tgenabled as u8 != b'D'
                    && std::ffi::CStr::from_ptr(t.tgname).to_bytes() == b"multiregion_capture"
                {
                    found = true;
                    break;
                }
            }
        }
        pg_sys::RelationClose(rel);
        found
    }
}

/// Whether a plan reads any relation: a scan node anywhere in it, its subplans included. A
/// read whose every relation the planner proved empty for its filter (all partitions
/// excluded by their constraints, `WHERE id IS NULL` on a key) reads none, and needs no
/// leaseholder, barrier or gathering: it is answered here.
///
/// # Safety
/// `ps` is a planned statement, valid for the call.
#[allow(unsafe_code)]
pub unsafe fn reads_a_relation(ps: &pg_sys::PlannedStmt) -> bool {
    // SAFETY: as this function's contract; each cast follows the plan node's tag.
    unsafe fn any(plans: *mut pg_sys::List) -> bool {
        if plans.is_null() {
            return false;
        }
        // SAFETY: a list of plan nodes of the statement.
        unsafe {
            (0..(*plans).length).any(|i| scans(pg_sys::list_nth(plans, i) as *mut pg_sys::Plan))
        }
    }
    // SAFETY: as above.
    unsafe fn scans(plan: *mut pg_sys::Plan) -> bool {
        use pg_sys::NodeTag::*;
        if plan.is_null() {
            return false;
        }
        // SAFETY: `plan` is a node of the statement's plan tree; casts follow its tag.
        unsafe {
            let inner = match (*plan).type_ {
                T_SeqScan | T_SampleScan | T_IndexScan | T_IndexOnlyScan | T_BitmapIndexScan
                | T_BitmapHeapScan | T_TidScan | T_TidRangeScan | T_ForeignScan | T_CustomScan => {
                    return true
                }
                T_Append => any((*(plan as *mut pg_sys::Append)).appendplans),
                T_MergeAppend => any((*(plan as *mut pg_sys::MergeAppend)).mergeplans),
                T_BitmapAnd => any((*(plan as *mut pg_sys::BitmapAnd)).bitmapplans),
                T_BitmapOr => any((*(plan as *mut pg_sys::BitmapOr)).bitmapplans),
                T_SubqueryScan => scans((*(plan as *mut pg_sys::SubqueryScan)).subplan),
                _ => false,
            };
            inner || scans((*plan).lefttree) || scans((*plan).righttree)
        }
    }
    // SAFETY: as this function's contract.
    unsafe { scans(ps.planTree) || any(ps.subplans) }
}

/// A (table, REGIONAL BY ROW partition) range; no partition: every one of the table's.
pub type RangeTarget = (mr_meta::TableRef, Option<String>);

/// The (table, REGIONAL BY ROW partition) ranges a planned statement touches
/// ([`touched_ranges`]).
///
/// # Safety
/// As [`touched_ranges`].
#[allow(unsafe_code)]
pub unsafe fn statement_targets(
    qd: &pg_sys::QueryDesc,
) -> Vec<(mr_meta::TableRef, Option<String>)> {
    // SAFETY: as this function's contract.
    unsafe { touched_ranges(qd) }.0
}

/// The (table, REGIONAL BY ROW partition) ranges a planned statement touches: every
/// replicated relation in its range table; a partitioned table whose partitions are not
/// listed (an INSERT's target: rows are routed as they are written) stands for all of them.
/// Second, the partitions among them that an INSERT's VALUES only write rows into (nothing
/// in the statement scans them): no replica of those is needed where the INSERT runs.
///
/// # Safety
/// `qd` holds a planned statement whose relations are locked by the executor's caller.
#[allow(unsafe_code)]
pub unsafe fn touched_ranges(
    qd: &pg_sys::QueryDesc,
) -> (Vec<RangeTarget>, Vec<(mr_meta::TableRef, String)>) {
    // SAFETY: as this function's contract.
    let mut targets = unsafe { rtable_ranges(qd, None) };
    if targets.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let database = crate::routing::database();
    // An INSERT into a partitioned table: the partitions its rows go to, when they can be
    // known before it runs.
    let mut inserted = Vec::new();
    // SAFETY: as this function's contract; the target relation is in the range table.
    if let Some((relid, values)) = unsafe { insert_partitions(qd) } {
        if let Some(t) = target(relid) {
            let r = mr_meta::TableRef {
                database: database.clone(),
                schema: t.schema.clone(),
                table: t.table.clone(),
            };
            targets.retain(|(x, p)| !(x == &r && p.is_none()));
            for v in values {
                let entry = (r.clone(), Some(v.clone()));
                if !targets.contains(&entry) {
                    targets.push(entry);
                    inserted.push((r.clone(), v));
                }
            }
        }
    }
    (wholes_dropped(targets), inserted)
}

/// A partitioned table whose partitions are listed stands for those only.
fn wholes_dropped(mut targets: Vec<RangeTarget>) -> Vec<RangeTarget> {
    let partitioned: Vec<mr_meta::TableRef> = targets
        .iter()
        .filter(|(_, p)| p.is_some())
        .map(|(t, _)| t.clone())
        .collect();
    targets.retain(|(t, p)| p.is_some() || !partitioned.contains(t));
    targets
}

/// The ranges of the replicated relations in a planned statement's range table, but the
/// one at index `skip` (1-based), each once.
///
/// # Safety
/// As [`touched_ranges`].
#[allow(unsafe_code)]
unsafe fn rtable_ranges(qd: &pg_sys::QueryDesc, skip: Option<i32>) -> Vec<RangeTarget> {
    let mut targets = Vec::new();
    // SAFETY: the planned statement's range table is a List of RangeTblEntry nodes, valid for
    // the query's life; each relation in it is locked by the executor's caller.
    unsafe {
        let rtable = (*qd.plannedstmt).rtable;
        if rtable.is_null() {
            return targets;
        }
        for i in 0..(*rtable).length {
            let rte = pg_sys::list_nth(rtable, i) as *mut pg_sys::RangeTblEntry;
            if skip != Some(i + 1)
                && !rte.is_null()
                && (*rte).rtekind == pg_sys::RTEKind::RTE_RELATION
                && matches!((*rte).relkind as u8, b'r' | b'p')
            {
                if let Some(entry) = range_target((*rte).relid) {
                    if !targets.contains(&entry) {
                        targets.push(entry);
                    }
                }
            }
        }
    }
    targets
}

/// The ranges an INSERT reads (`INSERT … SELECT`, a subquery in its VALUES or ON CONFLICT
/// clause), its own target aside: its rows for ranges leased elsewhere leave the statement
/// (`crate::moved`) before anything looks for a conflict, but what it reads is read here.
/// Empty for other statements.
///
/// # Safety
/// As [`touched_ranges`].
#[allow(unsafe_code)]
pub unsafe fn insert_reads(qd: &pg_sys::QueryDesc) -> Vec<RangeTarget> {
    // SAFETY: as this function's contract; the result relation list holds range-table
    // indexes.
    unsafe {
        let ps = &*qd.plannedstmt;
        if qd.operation != pg_sys::CmdType::CMD_INSERT
            || ps.resultRelations.is_null()
            || (*ps.resultRelations).length != 1
        {
            return Vec::new();
        }
        let target = pg_sys::list_nth_int(ps.resultRelations, 0);
        wholes_dropped(rtable_ranges(qd, Some(target)))
    }
}

/// Whether the statement may write rows into partitions of a replicated table other than
/// the ones it was routed by: an INSERT into a partitioned table whose rows' partitions are
/// not known before it runs, or an UPDATE of one that assigns its partition key (the region
/// column, also when computed or rehomed). Such rows may belong to another leaseholder
/// (`crate::moved`). Errs on the side of yes.
///
/// # Safety
/// As [`statement_targets`].
#[allow(unsafe_code)]
pub unsafe fn may_move_rows(qd: &pg_sys::QueryDesc) -> bool {
    use pg_sys::CmdType::*;
    // SAFETY: as this function's contract; the plan's top node is a ModifyTable when its tag
    // says so, and its lists are of the types PostgreSQL documents.
    unsafe {
        if !matches!(qd.operation, CMD_INSERT | CMD_UPDATE) {
            return false;
        }
        let ps = &*qd.plannedstmt;
        if ps.hasModifyingCTE {
            return true;
        }
        let results = ps.resultRelations;
        if results.is_null() || ps.rtable.is_null() {
            return false;
        }
        // The root of an UPDATE over partitions, or the INSERT's target.
        let mt = ps.planTree as *mut pg_sys::ModifyTable;
        if mt.is_null() || (*mt).plan.type_ != pg_sys::NodeTag::T_ModifyTable {
            return true;
        }
        let root = if (*mt).rootRelation > 0 {
            (*mt).rootRelation as i32
        } else {
            pg_sys::list_nth_int(results, 0)
        };
        let rte = pg_sys::list_nth(ps.rtable, root - 1) as *mut pg_sys::RangeTblEntry;
        if rte.is_null() || (*rte).relkind as u8 != b'p' || !is_replicated((*rte).relid) {
            return false;
        }
        if qd.operation == CMD_INSERT {
            return insert_partitions(qd).is_none();
        }
        let Some(table) = crate::rewrite::lookup((*rte).relid) else {
            return true;
        };
        // Each result relation's list holds its own column numbers (a partition made after a
        // column was dropped numbers them differently from the table).
        // The ModifyTable's own result relations match its lists one for one (the
        // statement's also name the root).
        let lists = (*mt).updateColnosLists;
        let leaves = (*mt).resultRelations;
        if lists.is_null() || leaves.is_null() || (*lists).length != (*leaves).length {
            return true;
        }
        let column = std::ffi::CString::new(table.region_column.as_str()).unwrap_or_default();
        (0..(*lists).length).any(|i| {
            let cols = pg_sys::list_nth(lists, i) as *mut pg_sys::List;
            let leaf = pg_sys::list_nth(ps.rtable, pg_sys::list_nth_int(leaves, i) - 1)
                as *mut pg_sys::RangeTblEntry;
            let attno = if leaf.is_null() {
                table.region_attno
            } else {
                pg_sys::get_attnum((*leaf).relid, column.as_ptr())
            };
            pg_sys::list_member_int(cols, attno.into())
        })
    }
}

/// The range-table indexes (1-based) of the relations whose rows the statement locks
/// (`FOR UPDATE`, `FOR NO KEY UPDATE`, `FOR SHARE`, `FOR KEY SHARE`, in a subquery too):
/// each partition of a locked partitioned table has its own mark.
///
/// # Safety
/// `ps` is a planned statement valid for the query's life.
#[allow(unsafe_code)]
pub unsafe fn locking_marks(ps: &pg_sys::PlannedStmt) -> Vec<pg_sys::Index> {
    use pg_sys::RowMarkType::*;
    let mut rtis = Vec::new();
    if ps.rowMarks.is_null() {
        return rtis;
    }
    // SAFETY: as this function's contract; the row marks are a List of PlanRowMark.
    unsafe {
        for i in 0..(*ps.rowMarks).length {
            let rm = pg_sys::list_nth(ps.rowMarks, i) as *mut pg_sys::PlanRowMark;
            if !rm.is_null()
                && matches!(
                    (*rm).markType,
                    ROW_MARK_EXCLUSIVE
                        | ROW_MARK_NOKEYEXCLUSIVE
                        | ROW_MARK_SHARE
                        | ROW_MARK_KEYSHARE
                )
            {
                rtis.push((*rm).rti);
            }
        }
    }
    rtis
}

/// The replicated ranges whose rows the statement locks besides its result relations
/// ([`locking_marks`]): a partition for each locked partition of a REGIONAL BY ROW table, the
/// table for another. Run over several leaseholders' copies, these locks would conflict with
/// nothing where the rows are leased: pgmr answers which are leased elsewhere, and the
/// started statement is refused if it still scans one (`routing::refuse_locks_on_copies`).
///
/// # Safety
/// As [`statement_targets`].
#[allow(unsafe_code)]
pub unsafe fn locked_ranges(qd: &pg_sys::QueryDesc) -> Vec<RangeTarget> {
    let mut locked = Vec::new();
    // SAFETY: as this function's contract; the range table is a List of RangeTblEntry, valid
    // for the query's life, and a row mark's index is within it (checked all the same).
    unsafe {
        let ps = &*qd.plannedstmt;
        for rti in locking_marks(ps) {
            if ps.rtable.is_null() || rti < 1 || rti as i32 > (*ps.rtable).length {
                continue;
            }
            let rte = pg_sys::list_nth(ps.rtable, rti as i32 - 1) as *mut pg_sys::RangeTblEntry;
            if rte.is_null()
                || (*rte).rtekind != pg_sys::RTEKind::RTE_RELATION
                || (*rte).relkind as u8 != b'r'
            {
                continue;
            }
            if let Some(entry) = range_target((*rte).relid) {
                if !locked.contains(&entry) {
                    locked.push(entry);
                }
            }
        }
    }
    locked
}

/// The (table, partition) a replicated relation is (a partition of a REGIONAL BY ROW table:
/// its region), or `None` for a relation that is not replicated.
///
/// # Safety
/// The relation is locked (the executor's caller locked the statement's relations).
#[allow(unsafe_code)]
pub unsafe fn range_target(relid: pg_sys::Oid) -> Option<RangeTarget> {
    // SAFETY: as this function's contract.
    if unsafe { !is_replicated(relid) } {
        return None;
    }
    target(relid).map(|t| {
        (
            mr_meta::TableRef {
                database: crate::routing::database(),
                schema: t.schema.clone(),
                table: t.table.clone(),
            },
            t.partition.clone(),
        )
    })
}

/// Whether the statement can run over each leaseholder's partitions in turn, the shares
/// changing (or reading) exactly the rows the whole statement would: an UPDATE or DELETE of
/// one REGIONAL BY ROW table ([`split_write`]), or a SELECT of one ([`splittable_read`]).
///
/// # Safety
/// As [`statement_targets`].
#[allow(unsafe_code)]
pub unsafe fn splittable(qd: &pg_sys::QueryDesc) -> bool {
    // SAFETY: as this function's contract.
    unsafe {
        match qd.operation {
            pg_sys::CmdType::CMD_SELECT => splittable_read(qd),
            pg_sys::CmdType::CMD_UPDATE | pg_sys::CmdType::CMD_DELETE => split_write(qd).is_some(),
            _ => false,
        }
    }
}

/// An UPDATE or DELETE whose target is one replicated partitioned table: the (table,
/// partition) ranges it changes (its result relations), and those it only reads (a
/// subquery's, `FROM`'s or `USING`'s tables, its own table read again), which each share
/// reads from the copies where it runs. `None` where it cannot be split: a data-modifying
/// CTE, another target, or a locking read of another table (`FOR UPDATE` in a subquery),
/// whose locks a share would take on a copy rather than where the rows are leased.
///
/// # Safety
/// As [`statement_targets`].
#[allow(unsafe_code)]
pub unsafe fn split_write(qd: &pg_sys::QueryDesc) -> Option<(Vec<RangeTarget>, Vec<RangeTarget>)> {
    // SAFETY: as this function's contract; the range table is a List of RangeTblEntry and
    // the row marks a List of PlanRowMark, valid for the query's life.
    unsafe {
        let ps = &*qd.plannedstmt;
        if ps.hasModifyingCTE || ps.rtable.is_null() || ps.resultRelations.is_null() {
            return None;
        }
        if !locking_marks(ps).is_empty() {
            return None;
        }
        let database = crate::routing::database();
        let target_of = |relid| {
            target(relid).map(|t| {
                let r = mr_meta::TableRef {
                    database: database.clone(),
                    schema: t.schema.clone(),
                    table: t.table.clone(),
                };
                (r, t.partition.clone())
            })
        };
        let (mut parents, mut changes, mut reads) = (0, Vec::new(), Vec::new());
        for i in 0..(*ps.rtable).length {
            let rte = pg_sys::list_nth(ps.rtable, i) as *mut pg_sys::RangeTblEntry;
            if rte.is_null()
                || (*rte).rtekind != pg_sys::RTEKind::RTE_RELATION
                || !matches!((*rte).relkind as u8, b'r' | b'p')
                || !is_replicated((*rte).relid)
            {
                continue;
            }
            let into = if pg_sys::list_member_int(ps.resultRelations, i + 1) {
                if (*rte).relkind as u8 == b'p' {
                    parents += 1;
                    continue;
                }
                &mut changes
            } else {
                &mut reads
            };
            if let Some(t) = target_of((*rte).relid) {
                if !into.contains(&t) {
                    into.push(t);
                }
            }
        }
        if parents != 1 {
            return None;
        }
        // A table read without naming partitions (its parent alone) stands for all of them
        // only when none of its partitions is listed.
        let listed: Vec<mr_meta::TableRef> = reads
            .iter()
            .filter(|(_, p)| p.is_some())
            .map(|(t, _)| t.clone())
            .collect();
        reads.retain(|(t, p)| p.is_some() || !listed.contains(t));
        Some((changes, reads))
    }
}

/// Whether a SELECT is a scan of one REGIONAL BY ROW table whose rows the shares can simply
/// concatenate: the plan is an Append of scans of that table's partitions (under at most a
/// projection and row locks), with no subplan; no aggregate, sort, limit, DISTINCT, window or join above
/// it, each of which needs every partition's rows in one place.
///
/// # Safety
/// As [`statement_targets`].
#[allow(unsafe_code)]
unsafe fn splittable_read(qd: &pg_sys::QueryDesc) -> bool {
    use pg_sys::NodeTag::*;
    // SAFETY: the planned statement and its plan tree are valid for the query's life; each
    // cast follows the node's tag.
    unsafe {
        let ps = &*qd.plannedstmt;
        if ps.hasModifyingCTE || ps.rtable.is_null() || !ps.subplans.is_null() {
            return false;
        }
        // Aggregates computed at the leaseholders for a gathered read: each share's rows are
        // its partial results, which the gathering statement combines.
        if crate::partial_agg::partial_scan() {
            return one_table(ps);
        }
        let mut top = ps.planTree;
        // FOR UPDATE / FOR SHARE: each share locks its rows where they are leased.
        if !top.is_null() && (*top).type_ == T_LockRows && (*top).initPlan.is_null() {
            top = (*top).lefttree;
        }
        if !top.is_null() && (*top).type_ == T_Result && (*top).initPlan.is_null() {
            let result = top as *mut pg_sys::Result;
            if !(*result).resconstantqual.is_null() {
                return false;
            }
            top = (*top).lefttree;
        }
        if top.is_null() || (*top).type_ != T_Append || !(*top).initPlan.is_null() {
            return false;
        }
        let append = top as *mut pg_sys::Append;
        let children = (*append).appendplans;
        if children.is_null() {
            return false;
        }
        for i in 0..(*children).length {
            let child = pg_sys::list_nth(children, i) as *mut pg_sys::Plan;
            if child.is_null()
                || !matches!(
                    (*child).type_,
                    T_SeqScan | T_IndexScan | T_IndexOnlyScan | T_BitmapHeapScan
                )
            {
                return false;
            }
        }
        one_table(ps)
    }
}

/// Whether a plan's relations are one REGIONAL BY ROW table and its partitions: a parent and
/// leaves of it.
///
/// # Safety
/// `ps` is a planned statement whose range table is not empty.
#[allow(unsafe_code)]
unsafe fn one_table(ps: &pg_sys::PlannedStmt) -> bool {
    // SAFETY: as this function's contract.
    unsafe {
        let mut parent = None;
        for i in 0..(*ps.rtable).length {
            let rte = pg_sys::list_nth(ps.rtable, i) as *mut pg_sys::RangeTblEntry;
            if rte.is_null() || (*rte).rtekind != pg_sys::RTEKind::RTE_RELATION {
                continue;
            }
            if (*rte).relkind as u8 == b'p' {
                if parent.replace((*rte).relid).is_some() || !is_replicated((*rte).relid) {
                    return false;
                }
            } else if partition_of((*rte).relid).is_none() {
                return false;
            }
        }
        parent.is_some()
    }
}

/// The partitioned target of an INSERT and the partitions its rows go to, if known.
///
/// # Safety
/// As [`statement_targets`].
#[allow(unsafe_code)]
unsafe fn insert_partitions(
    qd: &pg_sys::QueryDesc,
) -> Option<(pg_sys::Oid, std::collections::BTreeSet<String>)> {
    // SAFETY: the planned statement's lists are valid for the query's life; the target is
    // locked by the executor's caller.
    unsafe {
        if qd.operation != pg_sys::CmdType::CMD_INSERT {
            return None;
        }
        let ps = &*qd.plannedstmt;
        let results = ps.resultRelations;
        if results.is_null() || (*results).length != 1 || ps.rtable.is_null() {
            return None;
        }
        let rti = pg_sys::list_nth_int(results, 0);
        let rte = pg_sys::list_nth(ps.rtable, rti - 1) as *mut pg_sys::RangeTblEntry;
        if rte.is_null() || (*rte).relkind as u8 != b'p' || !is_replicated((*rte).relid) {
            return None;
        }
        let relid = (*rte).relid;
        crate::insert_rows::partition_values(qd, relid).map(|v| (relid, v))
    }
}

/// Whether pgmr said within the last second that row replication is off: statements are
/// then neither routed nor wait for barriers (no call to pgmr per statement).
pub fn known_off() -> bool {
    BARRIER_OFF_UNTIL
        .with(|c| c.get())
        .is_some_and(|t| Instant::now() < t)
}

/// pgmr said row replication is off: reads skip the barrier for a second.
pub fn barrier_off_for_a_while() {
    BARRIER_OFF_UNTIL.with(|c| c.set(Some(Instant::now() + Duration::from_secs(1))));
}

/// Whether this transaction has captured row changes to replicate at commit.
pub fn has_local_changes() -> bool {
    TXN.with(|t| !t.borrow().changes.is_empty())
}

/// Whether this transaction's captured row changes are all of global key tables (its key
/// changes applied here, where the key tables are leased), and so read nothing its snapshot
/// must agree with elsewhere.
pub fn local_changes_keys_only() -> bool {
    TXN.with(|t| {
        t.borrow()
            .changes
            .iter()
            .all(|c| target(c.relid).is_some_and(|t| t.schema == crate::global_keys::KEY_SCHEMA))
    })
}

/// Under READ COMMITTED, gives a query that has passed its read barrier a snapshot taken
/// after the wait (REPEATABLE READ and SERIALIZABLE keep the transaction's).
///
/// # Safety
/// `qd` is the QueryDesc PostgreSQL is about to start.
#[allow(unsafe_code)]
pub unsafe fn fresh_snapshot(qd: &mut pg_sys::QueryDesc) {
    // SAFETY: under READ COMMITTED each statement may take a new snapshot. The QueryDesc
    // holds a registration of its snapshot (CreateQueryDesc registers it, FreeQueryDesc
    // unregisters it) under the current resource owner, so the new one is registered the
    // same way before the old one is let go.
    unsafe {
        if pg_sys::XactIsoLevel < pg_sys::XACT_REPEATABLE_READ as i32 {
            let fresh = pg_sys::RegisterSnapshot(pg_sys::GetTransactionSnapshot());
            pg_sys::UnregisterSnapshot(qd.snapshot);
            qd.snapshot = fresh;
        }
    }
}

/// Before a SELECT of replicated tables runs here without routing (a statement forwarded
/// to this node): waits until this node has applied every write to their ranges acknowledged
/// before now (Raft read-index through each range's leader), then, under READ COMMITTED,
/// gives the query a snapshot taken after the wait. Under REPEATABLE READ and SERIALIZABLE
/// the transaction's snapshot was taken before the first statement's barrier, so a
/// transaction that starts on a follower may miss writes acknowledged just before it
/// (bounded by the apply lag).
///
/// # Safety
/// `qd` is the QueryDesc PostgreSQL is about to start.
#[allow(unsafe_code)]
pub unsafe fn read_barrier(qd: &mut pg_sys::QueryDesc, eflags: i32) {
    if gucs::sidecar_socket().is_none()
        || qd.operation != pg_sys::CmdType::CMD_SELECT
        || eflags & pg_sys::EXEC_FLAG_EXPLAIN_ONLY as i32 != 0
        || qd.plannedstmt.is_null()
    {
        return;
    }
    if known_off() {
        return;
    }
    // SAFETY: as this function's contract.
    unsafe { barrier_over(qd, statement_targets(qd)) }
}

/// [`read_barrier`] over `targets`, also for a statement that is not a SELECT: an INSERT
/// inside a statement served for another node (`routing::check_nested`), whose copies of
/// what it reads must hold every write acknowledged before it, or it would find nothing to
/// insert.
///
/// # Safety
/// `qd` is the QueryDesc PostgreSQL is about to start.
#[allow(unsafe_code)]
pub unsafe fn barrier_over(qd: &mut pg_sys::QueryDesc, targets: Vec<RangeTarget>) {
    if targets.is_empty() {
        return;
    }
    match sidecar::read_barrier(crate::routing::database(), targets, false) {
        Ok(false) => barrier_off_for_a_while(),
        // SAFETY: as this function's contract.
        Ok(true) => unsafe { fresh_snapshot(qd) },
        Err(e) => e.raise(),
    }
}

/// The value of a one-value LIST partition bound, `FOR VALUES IN ('us-east1')`.
fn list_value(bound: &str) -> Option<String> {
    let start = bound.find('\'')? + 1;
    let mut out = String::new();
    let mut chars = bound[start..].chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\'' {
            if chars.peek() == Some(&'\'') {
                chars.next();
                out.push('\'');
                continue;
            }
            return Some(out);
        }
        out.push(c);
    }
    None
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).expect("strings serialize")
}

/// This transaction's id, unique in the cluster and for all time: this server's system
/// identifier, the transaction's full id (assigned now if it has none), and this backend's
/// process id and start time. The full id alone can come again: an aborted transaction's WAL
/// is not flushed, so after a crash PostgreSQL may hand its id out anew, and a decision (or a
/// key in `range_txns`) recorded for the first would be read for the second.
#[allow(unsafe_code)]
pub fn txn_id() -> String {
    // SAFETY: plain reads of this transaction's and this backend's identity, inside them.
    unsafe {
        let fxid = pg_sys::GetTopFullTransactionId();
        let sysid = pg_sys::GetSystemIdentifier();
        let (pid, started) = (pg_sys::MyProcPid, pg_sys::MyStartTimestamp);
        format!("{sysid:x}-{:x}-{pid:x}.{started:x}", fxid.value)
    }
}

/// Replicates this transaction's changes before it commits (or, as `part` of another
/// node's two-phase commit, prepares them).
fn replicate(part: Option<PrepareAs>) -> Result<(), MrError> {
    let Some(w) = take_write()? else {
        return Ok(());
    };
    let bytes = w.writes.iter().map(|t| t.changes.len()).sum();
    let req = LocalRequest::ReplicateTxn {
        database: crate::routing::database(),
        writes: w.writes,
        txn_id: w.txn_id.clone(),
        schema_version: w.schema_version,
        txn_start_ms: w.txn_start_ms,
        prepare: part,
    };
    match sidecar::replicate_txn(req, bytes)? {
        Replication::Replicated { entries } => set_replicated(entries),
        Replication::Off => forget_key(&w.txn_id),
    }
    Ok(())
}

/// Records the entries this transaction's changes became (fenced if it then aborts).
pub fn set_replicated(entries: Vec<(u64, u64)>) {
    TXN.with(|t| t.borrow_mut().replicated = entries);
}

fn forget_key(txn_id: &str) {
    spi::as_extension_owner(|| {
        spi::run_with(
            "DELETE FROM multiregion.range_txns WHERE txn_id = $1",
            vec![txn_id.into()],
        )
    })
}

/// Under SERIALIZABLE, PostgreSQL's own serializable pre-commit check, now rather than inside
/// CommitTransaction: it raises 40001 for a dangerous structure and otherwise marks this
/// transaction prepared, so that later conflicts abort the other side (its second run inside
/// CommitTransaction then finds nothing to do). After it the transaction cannot fail for its
/// own reasons, and may be committed elsewhere.
#[allow(unsafe_code)]
pub fn serializable_pre_commit() {
    // SAFETY: reads a backend global; the check is PostgreSQL's, called where a commit is
    // under way.
    unsafe {
        if pg_sys::XactIsoLevel == pg_sys::XACT_SERIALIZABLE as i32 {
            pg_sys::ffi::pg_guard_ffi_boundary(|| PreCommit_CheckForSerializationFailure());
        }
    }
}

/// Takes this transaction's changes for replication, per (table, partition), once it can no
/// longer fail for its own reasons: runs PostgreSQL's serializable pre-commit check and
/// records the transaction's key in `multiregion.range_txns` (uncommitted: replicas' appliers
/// wait on it). `None`: nothing to replicate. Needs an active snapshot (SPI).
#[allow(unsafe_code)]
pub fn take_write() -> Result<Option<LocalWrite>, MrError> {
    let changes = TXN.with(|t| std::mem::take(&mut t.borrow_mut().changes));
    if changes.is_empty() || gucs::sidecar_socket().is_none() {
        return Ok(None);
    }
    serializable_pre_commit();
    // A large write set is only built once replication is known to be on (a bulk load into a
    // cluster without row replication must not pay for it); small ones ask in the same call.
    let approx: usize = changes
        .iter()
        .map(|c| c.old.as_ref().map_or(0, String::len) + c.new.as_ref().map_or(0, String::len) + 64)
        .sum();
    if approx > ASK_FIRST_ABOVE && !sidecar::replication_enabled()? {
        return Ok(None);
    }
    if approx > MAX_WRITE_SET {
        return Err(MrError::WriteSetTooLarge {
            bytes: approx,
            limit: MAX_WRITE_SET,
        });
    }
    let database = crate::routing::database();
    // Each (table, partition)'s changes as one JSON array, in the order they were made.
    let mut targets: BTreeMap<u32, Rc<Target>> = BTreeMap::new();
    let mut arrays: BTreeMap<(String, String, Option<String>), Vec<String>> = BTreeMap::new();
    for c in &changes {
        let key = c.relid.to_u32();
        if let std::collections::btree_map::Entry::Vacant(e) = targets.entry(key) {
            if let Some(t) = target(c.relid) {
                e.insert(t);
            }
        }
        let Some(t) = targets.get(&key) else {
            continue;
        };
        let list = arrays
            .entry((t.schema.clone(), t.table.clone(), t.partition.clone()))
            .or_default();
        if list.last().is_none_or(|j| j.len() >= ARRAY_BYTES) {
            list.push(String::from("["));
        }
        let json = list.last_mut().expect("pushed above");
        if json.len() > 1 {
            json.push(',');
        }
        let _ = write!(
            json,
            r#"{{"s":{},"t":{},"op":"{}","old":{},"new":{}}}"#,
            json_str(&t.leaf_schema),
            json_str(&t.leaf),
            c.op,
            c.old.as_deref().unwrap_or("null"),
            c.new.as_deref().unwrap_or("null"),
        );
    }
    if arrays.is_empty() {
        return Ok(None);
    }
    let writes = arrays
        .into_iter()
        .flat_map(|((schema, table, partition), list)| {
            let database = database.clone();
            list.into_iter().map(move |mut changes| {
                changes.push(']');
                TargetWrite {
                    table: mr_meta::TableRef {
                        database: database.clone(),
                        schema: schema.clone(),
                        table: table.clone(),
                    },
                    partition: partition.clone(),
                    changes,
                }
            })
        })
        .collect();
    let schema_version = crate::regions::proposed_version().unwrap_or_else(|| {
        spi::read_one("SELECT multiregion.schema_version()::text", vec![])
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    });
    let txn_id = txn_id();
    // SAFETY: reads this transaction's start time.
    let start = unsafe { pg_sys::GetCurrentTransactionStartTimestamp() };
    // TimestampTz counts microseconds from 2000-01-01; Unix ms from 1970.
    let txn_start_ms = (start / 1000 + 946_684_800_000).max(0) as u64;
    spi::as_extension_owner(|| {
        spi::run_with(
            "INSERT INTO multiregion.range_txns (txn_id) VALUES ($1)",
            vec![txn_id.as_str().into()],
        )
    });
    Ok(Some(LocalWrite {
        writes,
        txn_id,
        schema_version,
        txn_start_ms,
    }))
}

extension_sql!(
    r#"
-- The data plane's bookkeeping, per database: how far each range's log is applied here, and
-- which transactions' changes are (the key of the leaseholder's own transactions, written in
-- the same transaction as their rows, and of every entry the applier applied).
CREATE TABLE multiregion.range_state (
    range_id bigint PRIMARY KEY,
    applied_index bigint NOT NULL,
    -- Entries after applied_index whose rows the installed snapshot already holds: the
    -- applier passes over them (docs/ARCHITECTURE.md §8.2, snapshots).
    skip bigint[] NOT NULL DEFAULT '{}'
);
CREATE TABLE multiregion.range_txns (
    txn_id text PRIMARY KEY,
    recorded_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);
-- The rows a REGIONAL BY ROW table had here, by region, when it stopped being REGIONAL BY
-- ROW: its partitions' ranges become one range, whose bootstrapper fetches each old
-- partition's rows from that partition's leaseholder's copy here (docs/ARCHITECTURE.md §8.2,
-- merges). pgmr clears a table's rows once its old ranges are gone.
CREATE TABLE multiregion.merge_seed (
    id bigserial PRIMARY KEY,
    schema_name text NOT NULL,
    table_name text NOT NULL,
    region text NOT NULL,
    row_data jsonb NOT NULL
);
-- One row. A read-write REPEATABLE READ or SERIALIZABLE transaction with parts on several
-- nodes holds each one's turn until it ends there: this table's lock, so that no two such
-- transactions overlap on a node, and an update of the row, which fails with 40001 if one of
-- them committed here after the transaction's snapshot was taken (docs/ARCHITECTURE.md §8.5,
-- "Isolation").
CREATE TABLE multiregion.turn (taken bigint NOT NULL);
INSERT INTO multiregion.turn VALUES (0);
REVOKE ALL ON multiregion.range_state, multiregion.range_txns, multiregion.merge_seed, multiregion.turn FROM PUBLIC;
GRANT SELECT ON multiregion.range_state TO PUBLIC;

REVOKE EXECUTE ON FUNCTION multiregion.capture(oid, text, text, text) FROM PUBLIC;

CREATE FUNCTION multiregion.capture_row() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
    PERFORM multiregion.capture(TG_RELID, TG_OP,
        CASE WHEN TG_OP <> 'INSERT' THEN to_jsonb(OLD)::text END,
        CASE WHEN TG_OP <> 'DELETE' THEN to_jsonb(NEW)::text END);
    RETURN NULL;
END
$fn$;

CREATE FUNCTION multiregion.capture_truncate() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
    PERFORM multiregion.capture(TG_RELID, TG_OP, NULL, NULL);
    RETURN NULL;
END
$fn$;

-- Every permanent table created outside PostgreSQL's and the extension's schemas gets the
-- capture triggers. Partitions inherit their parent's row triggers but not its statement
-- trigger: a TRUNCATE of one partition by itself must be captured too.
CREATE FUNCTION multiregion.install_capture() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_rel regclass;
    v_partition boolean;
BEGIN
    FOR v_rel, v_partition IN
        SELECT DISTINCT c.oid::regclass, c.relispartition
          FROM pg_catalog.pg_event_trigger_ddl_commands() d
          JOIN pg_catalog.pg_class c ON c.oid = d.objid
          JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
         WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.objsubid = 0
           AND c.relkind IN ('r', 'p') AND c.relpersistence <> 't'
           AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'multiregion')
           AND n.nspname NOT LIKE 'pg\_%'
           AND NOT EXISTS (SELECT FROM pg_catalog.pg_trigger t
                            WHERE t.tgrelid = c.oid AND t.tgname = 'multiregion_capture_truncate')
    LOOP
        IF NOT v_partition THEN
            EXECUTE format('CREATE TRIGGER multiregion_capture AFTER INSERT OR UPDATE OR DELETE ON %s '
                           'FOR EACH ROW EXECUTE FUNCTION multiregion.capture_row()', v_rel);
            EXECUTE format('CREATE TRIGGER "_multiregion_route" BEFORE INSERT ON %s '
                           'FOR EACH ROW EXECUTE FUNCTION multiregion.route_row()', v_rel);
        END IF;
        EXECUTE format('CREATE TRIGGER multiregion_capture_truncate AFTER TRUNCATE ON %s '
                       'FOR EACH STATEMENT EXECUTE FUNCTION multiregion.capture_truncate()', v_rel);
    END LOOP;
END
$fn$;
CREATE EVENT TRIGGER multiregion_install_capture ON ddl_command_end
    WHEN TAG IN ('CREATE TABLE', 'CREATE TABLE AS', 'SELECT INTO')
    EXECUTE FUNCTION multiregion.install_capture();

-- Applies one captured change to a leaf relation: by primary key (or, without one, by the
-- whole row), delete-then-insert, so replaying an entry converges on the same row.
CREATE FUNCTION multiregion.apply_change(p_schema text, p_table text, p_op text, p_old jsonb, p_new jsonb)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_rel regclass := format('%I.%I', p_schema, p_table)::regclass;
BEGIN
    IF p_op = 'T' THEN
        EXECUTE format('TRUNCATE %s', v_rel);
        RETURN;
    END IF;
    IF p_op IN ('U', 'D') THEN
        PERFORM multiregion.delete_row(v_rel, multiregion.key_columns(v_rel), p_old);
    END IF;
    IF p_op IN ('I', 'U') THEN
        PERFORM multiregion.apply_inserts(p_schema, p_table, jsonb_build_array(p_new));
    END IF;
END
$fn$;

-- The primary key's columns of a relation, quoted and comma-separated (NULL without one).
CREATE FUNCTION multiregion.key_columns(p_rel regclass)
RETURNS text LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
    SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY k.ord)
      FROM pg_catalog.pg_index i
      CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, ord)
      JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
     WHERE i.indrelid = p_rel AND i.indisprimary;
$fn$;

-- The ascending sequences the columns of a relation's table draw from, with their columns:
-- those they own (serial, identity) and those their defaults call nextval() of. Replicas
-- move them past the values the leaseholder drew, so that a node's nextval, once it leases
-- the range, never hands out a key the log already holds.
CREATE FUNCTION multiregion.owned_sequences(p_rel regclass, OUT seq regclass, OUT col name)
RETURNS SETOF record LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
    SELECT d.objid::regclass, a.attname
      FROM pg_catalog.pg_depend d
      JOIN pg_catalog.pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
      JOIN pg_catalog.pg_sequence q ON q.seqrelid = d.objid AND q.seqincrement > 0
     WHERE d.classid = 'pg_catalog.pg_class'::regclass
       AND d.refclassid = 'pg_catalog.pg_class'::regclass
       AND d.refobjid = coalesce(pg_catalog.pg_partition_root(p_rel), p_rel)
       AND d.deptype IN ('a', 'i')
    UNION
    SELECT d.refobjid::regclass, a.attname
      FROM pg_catalog.pg_attrdef ad
      JOIN pg_catalog.pg_attribute a ON a.attrelid = ad.adrelid AND a.attnum = ad.adnum
      JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_attrdef'::regclass
                                 AND d.objid = ad.oid
                                 AND d.refclassid = 'pg_catalog.pg_class'::regclass
      JOIN pg_catalog.pg_sequence q ON q.seqrelid = d.refobjid AND q.seqincrement > 0
     WHERE ad.adrelid = coalesce(pg_catalog.pg_partition_root(p_rel), p_rel);
$fn$;

-- Inserts captured rows (a JSON array of whole rows) into a leaf relation in one statement,
-- replacing rows with the same primary key (a replayed entry converges). Consecutive
-- inserts of one transaction into one relation arrive here together: a bulk load is applied
-- set-wise, not row by row.
CREATE FUNCTION multiregion.apply_inserts(p_schema text, p_table text, p_rows jsonb)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_rel regclass := format('%I.%I', p_schema, p_table)::regclass;
    v_key text := multiregion.key_columns(v_rel);
    v_cols text;
    v_seq regclass;
    v_col name;
    v_val bigint;
BEGIN
    IF v_key IS NOT NULL THEN
        EXECUTE format('DELETE FROM %s WHERE (%s) IN (SELECT %s FROM jsonb_populate_recordset(NULL::%s, $1))',
                       v_rel, v_key, v_key, v_rel) USING p_rows;
    END IF;
    SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) INTO v_cols
      FROM pg_catalog.pg_attribute
     WHERE attrelid = v_rel AND attnum > 0 AND NOT attisdropped AND attgenerated = '';
    EXECUTE format('INSERT INTO %s (%s) OVERRIDING SYSTEM VALUE SELECT %s FROM jsonb_populate_recordset(NULL::%s, $1)',
                   v_rel, v_cols, v_cols, v_rel) USING p_rows;
    -- Owned sequences past the values drawn (setval is not rolled back; a gap is fine).
    FOR v_seq, v_col IN
        SELECT seq, col FROM multiregion.owned_sequences(v_rel)
    LOOP
        SELECT max((r ->> v_col::text)::numeric)::bigint INTO v_val
          FROM jsonb_array_elements(p_rows) r
         WHERE jsonb_typeof(r -> v_col::text) = 'number';
        IF v_val > coalesce(pg_catalog.pg_sequence_last_value(v_seq), 0) THEN
            PERFORM pg_catalog.setval(v_seq, v_val);
        END IF;
    END LOOP;
END
$fn$;

CREATE FUNCTION multiregion.delete_row(p_rel regclass, p_key text, p_row jsonb)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
    IF p_key IS NULL THEN
        EXECUTE format('DELETE FROM %s WHERE ctid = (SELECT x.ctid FROM %s x WHERE to_jsonb(x) = $1 LIMIT 1)',
                       p_rel, p_rel) USING p_row;
    ELSE
        EXECUTE format('DELETE FROM %s WHERE (%s) = (SELECT %s FROM jsonb_populate_record(NULL::%s, $1))',
                       p_rel, p_key, p_key, p_rel) USING p_row;
    END IF;
END
$fn$;

-- One transaction's rows, applied by an applier that holds its range's cursor (below): the
-- transaction id is inserted first, and the rows applied only if it was new (an entry the
-- leaseholder's own transaction committed, or one applied before, is passed over). Returns
-- whether it applied them. A transaction over several ranges (p_keep false) has one key for
-- all of its entries: an applier that applied one removes the key again, so the next
-- range's entry applies too.
CREATE FUNCTION multiregion.apply_txn_rows(p_range bigint, p_index bigint, p_txn text,
                                           p_changes text, p_schema_version bigint,
                                           p_keep boolean)
RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_set_role boolean;
BEGIN
    IF multiregion.schema_version() < p_schema_version THEN
        RAISE EXCEPTION 'entry % of range % needs schema version %; this node has %',
            p_index, p_range, p_schema_version, multiregion.schema_version()
            USING ERRCODE = '55000';
    END IF;
    INSERT INTO multiregion.range_txns (txn_id) VALUES (p_txn) ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    -- pgmr's applier sets the role for its session: changing it empties the backend's
    -- plan cache (PostgreSQL's rule), which would make every statement plan again.
    v_set_role := pg_catalog.current_setting('session_replication_role') <> 'replica';
    IF v_set_role THEN
        PERFORM pg_catalog.set_config('session_replication_role', 'replica', true);
    END IF;
    -- In order; consecutive inserts into one relation together, by statements each
    -- backend prepares once per relation (apply.rs).
    PERFORM multiregion.apply_changes(p_changes);
    IF v_set_role THEN
        PERFORM pg_catalog.set_config('session_replication_role', 'origin', true);
    END IF;
    IF NOT p_keep THEN
        -- A prepared entry: the same transaction's entries of other ranges use the key too.
        DELETE FROM multiregion.range_txns WHERE txn_id = p_txn;
    END IF;
    RETURN true;
END
$fn$;

-- Locks range p_range's applier cursor and says whether entry p_index is still to apply:
-- false when the cursor is past it, or when an installed snapshot already holds its rows
-- (then the cursor moves to it here). The cursor row is locked first: a snapshot being
-- installed moves it too.
CREATE FUNCTION multiregion.begin_range_entry(p_range bigint, p_index bigint)
RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_at bigint;
    v_skip bigint[];
BEGIN
    SELECT applied_index, skip INTO v_at, v_skip FROM multiregion.range_state
     WHERE range_id = p_range FOR UPDATE;
    IF v_at >= p_index THEN
        RETURN false;
    END IF;
    IF p_index = ANY (v_skip) THEN
        UPDATE multiregion.range_state SET applied_index = p_index,
               skip = pg_catalog.array_remove(skip, p_index)
         WHERE range_id = p_range;
        RETURN false;
    END IF;
    RETURN true;
END
$fn$;

-- Moves range p_range's applier cursor to p_index, adding p_skip's later entries to pass over.
CREATE FUNCTION multiregion.end_range_entry(p_range bigint, p_index bigint, p_skip bigint[])
RETURNS void LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $fn$
    INSERT INTO multiregion.range_state (range_id, applied_index, skip)
        VALUES (p_range, p_index, p_skip)
        ON CONFLICT (range_id) DO UPDATE SET applied_index = excluded.applied_index,
            skip = multiregion.range_state.skip || excluded.skip;
$fn$;

-- pgmr's range applier: applies entry p_index of range p_range once, in the caller's
-- transaction with the cursor. The insert of the transaction's id waits for a local
-- transaction holding it, then skips the entry (it committed) or applies it (it aborted). A
-- transaction split over several entries of one range is applied whole at the first; p_skip
-- names the others, which the applier then passes over.
CREATE FUNCTION multiregion.apply_range_txn(p_range bigint, p_index bigint, p_txn text,
                                            p_changes jsonb, p_schema_version bigint,
                                            p_keep boolean DEFAULT true,
                                            p_skip bigint[] DEFAULT '{}')
RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_new boolean := false;
BEGIN
    IF NOT multiregion.begin_range_entry(p_range, p_index) THEN
        RETURN false;
    END IF;
    v_new := multiregion.apply_txn_rows(p_range, p_index, p_txn, p_changes::text,
                                        p_schema_version, p_keep);
    PERFORM multiregion.end_range_entry(p_range, p_index, p_skip);
    RETURN v_new;
END
$fn$;

-- pgmr's range applier: a batch entry (several one-range transactions committed together,
-- each as apply_range_txn would apply it), all in the caller's transaction with the cursor.
CREATE FUNCTION multiregion.apply_range_batch(p_range bigint, p_index bigint, p_txns text[],
                                              p_changes text[], p_schema_versions bigint[])
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
    IF NOT multiregion.begin_range_entry(p_range, p_index) THEN
        RETURN;
    END IF;
    FOR i IN 1 .. coalesce(pg_catalog.array_length(p_txns, 1), 0) LOOP
        PERFORM multiregion.apply_txn_rows(p_range, p_index, p_txns[i], p_changes[i],
                                           p_schema_versions[i], true);
    END LOOP;
    PERFORM multiregion.end_range_entry(p_range, p_index, '{}');
END
$fn$;

-- The leaf partition of table p_schema.p_table that holds REGIONAL BY ROW partition
-- p_partition's rows; NULL when there is none (a table not partitioned, or not that way).
CREATE FUNCTION multiregion.range_leaf(p_schema text, p_table text, p_partition text)
RETURNS regclass LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
    SELECT c.oid::regclass
      FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
     WHERE i.inhparent = format('%I.%I', p_schema, p_table)::regclass
       AND pg_catalog.pg_get_expr(c.relpartbound, c.oid) = format('FOR VALUES IN (%L)', p_partition);
$fn$;

-- The relation holding a range's rows: a REGIONAL BY ROW partition's leaf, else the table.
CREATE FUNCTION multiregion.range_relation(p_schema text, p_table text, p_partition text)
RETURNS regclass LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_rel regclass := format('%I.%I', p_schema, p_table)::regclass;
    v_leaf regclass;
BEGIN
    IF p_partition IS NOT NULL AND EXISTS (SELECT FROM pg_catalog.pg_inherits WHERE inhparent = v_rel) THEN
        v_leaf := multiregion.range_leaf(p_schema, p_table, p_partition);
        IF v_leaf IS NULL THEN
            RAISE EXCEPTION 'table %.% has no partition for region %', p_schema, p_table, p_partition
                USING ERRCODE = '55000';
        END IF;
        RETURN v_leaf;
    END IF;
    RETURN v_rel;
END
$fn$;

-- Before a schema change that reshapes a replicated table (docs/ARCHITECTURE.md §8.6): locks
-- the relation holding a range's rows (the table, where the partition is not one here: a
-- layout the table is leaving) against writers until the transaction ends. Runs with the
-- caller's privileges, so LOCK's own checks apply.
CREATE FUNCTION multiregion.fence_range(p_schema text, p_table text, p_partition text)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
BEGIN
    EXECUTE format('LOCK TABLE %s IN SHARE MODE',
                   coalesce(multiregion.range_leaf(p_schema, p_table, p_partition),
                            format('%I.%I', p_schema, p_table)::regclass));
END
$fn$;

-- Locks a partition's parents, root first, as DDL locks them (apply.rs, lock_ancestors):
-- writing a partition directly locks its parent after it (when the partition constraint is
-- loaded), which crosses a schema change's order on the same node and deadlocks with it.
CREATE FUNCTION multiregion.lock_partition_parents(p_rel regclass)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_parent regclass;
BEGIN
    FOR v_parent IN
        SELECT a.relid FROM pg_catalog.pg_partition_ancestors(p_rel) WITH ORDINALITY a(relid, n)
         WHERE a.relid <> p_rel ORDER BY a.n DESC
    LOOP
        EXECUTE format('LOCK TABLE ONLY %s IN ACCESS SHARE MODE', v_parent);
    END LOOP;
END
$fn$;

-- Installing a snapshot of a range (pgmr, one transaction): begin_range_install replaces this
-- replica's rows of the range by nothing and sets the cursor to the snapshot's index (false,
-- changing nothing, when the replica is already past it; a new range's seed is index 0); install_range_rows adds the
-- snapshot's rows in batches; finish_range_install moves owned sequences past them. Rows are
-- written as the applier writes them (session_replication_role = replica: user triggers and
-- foreign keys ran where the rows were written; global-key triggers run ALWAYS).
CREATE FUNCTION multiregion.begin_range_install(p_range bigint, p_schema text, p_table text,
    p_partition text, p_index bigint, p_schema_version bigint, p_skip bigint[])
RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_rel regclass;
    v_at bigint;
BEGIN
    IF multiregion.schema_version() < p_schema_version THEN
        RAISE EXCEPTION 'the snapshot of range % needs schema version %; this node has %',
            p_range, p_schema_version, multiregion.schema_version()
            USING ERRCODE = '55000';
    END IF;
    v_rel := multiregion.range_relation(p_schema, p_table, p_partition);
    INSERT INTO multiregion.range_state (range_id, applied_index) VALUES (p_range, -1)
        ON CONFLICT (range_id) DO NOTHING;
    SELECT applied_index INTO v_at FROM multiregion.range_state WHERE range_id = p_range FOR UPDATE;
    IF v_at > p_index THEN
        RETURN false;
    END IF;
    PERFORM multiregion.lock_partition_parents(v_rel);
    PERFORM pg_catalog.set_config('session_replication_role', 'replica', true);
    EXECUTE format('DELETE FROM %s', v_rel);
    UPDATE multiregion.range_state SET applied_index = p_index, skip = coalesce(p_skip, '{}')
     WHERE range_id = p_range;
    RETURN true;
END
$fn$;

CREATE FUNCTION multiregion.install_range_rows(p_schema text, p_table text, p_partition text, p_rows jsonb)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_rel regclass := multiregion.range_relation(p_schema, p_table, p_partition);
    v_cols text;
BEGIN
    PERFORM multiregion.lock_partition_parents(v_rel);
    SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) INTO v_cols
      FROM pg_catalog.pg_attribute
     WHERE attrelid = v_rel AND attnum > 0 AND NOT attisdropped AND attgenerated = '';
    EXECUTE format('INSERT INTO %s (%s) OVERRIDING SYSTEM VALUE SELECT %s FROM jsonb_populate_recordset(NULL::%s, $1)',
                   v_rel, v_cols, v_cols, v_rel) USING p_rows;
END
$fn$;

CREATE FUNCTION multiregion.finish_range_install(p_schema text, p_table text, p_partition text)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_rel regclass := multiregion.range_relation(p_schema, p_table, p_partition);
    v_seq regclass;
    v_col name;
    v_max bigint;
BEGIN
    FOR v_seq, v_col IN
        SELECT seq, col FROM multiregion.owned_sequences(v_rel)
    LOOP
        EXECUTE format('SELECT max(%I)::bigint FROM %s', v_col, v_rel) INTO v_max;
        IF v_max > coalesce(pg_catalog.pg_sequence_last_value(v_seq), 0) THEN
            PERFORM pg_catalog.setval(v_seq, v_max);
        END IF;
    END LOOP;
    PERFORM pg_catalog.set_config('session_replication_role', 'origin', true);
END
$fn$;

-- One replica's rows of a range, summarised in one snapshot with its applier's cursor: the
-- consistency check compares these across replicas at the same applied index.
CREATE FUNCTION multiregion.range_checksum(p_range bigint, p_schema text, p_table text, p_partition text,
    OUT applied_index bigint, OUT row_count bigint, OUT checksum text)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_rel regclass := multiregion.range_relation(p_schema, p_table, p_partition);
BEGIN
    EXECUTE format('SELECT coalesce((SELECT s.applied_index FROM multiregion.range_state s WHERE s.range_id = $1), 0), '
                   'count(*), md5(coalesce(string_agg(t::text, %L ORDER BY t::text), %L)) FROM %s t',
                   E'\n', '', v_rel)
       INTO applied_index, row_count, checksum USING p_range;
END
$fn$;

-- Moves a range's cursor over an entry without rows (a leader's first entry, a membership
-- change).
CREATE FUNCTION multiregion.advance_range(p_range bigint, p_index bigint)
RETURNS void LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $fn$
    INSERT INTO multiregion.range_state (range_id, applied_index) VALUES (p_range, p_index)
        ON CONFLICT (range_id) DO UPDATE
        SET applied_index = greatest(multiregion.range_state.applied_index, excluded.applied_index),
            skip = pg_catalog.array_remove(multiregion.range_state.skip, excluded.applied_index);
$fn$;
-- pgmr, once this node no longer holds a replica of a range whose table keeps its layout
-- (the replica moved to another node): the copy's rows go, with the applier's cursor. Reads
-- go to the replicas, but a schema change's checks and rewrites on this node would meet the
-- copy's rows as they were when it left (rows deleted or moved since, keys repeated: an
-- applier refusing a change the replicas accept). Removed as the applier removes rows
-- (nothing captured; a key table keeps its own range's rows). A partition that is no longer
-- one, or a table that is now partitioned, is left alone: its layout changed.
CREATE FUNCTION multiregion.drop_range_copy(p_range bigint, p_schema text, p_table text,
                                            p_partition text)
RETURNS void LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    v_rel regclass := pg_catalog.to_regclass(format('%I.%I', p_schema, p_table));
BEGIN
    DELETE FROM multiregion.range_state WHERE range_id = p_range;
    IF v_rel IS NULL THEN
        RETURN;
    END IF;
    IF p_partition IS NULL THEN
        IF EXISTS (SELECT FROM pg_catalog.pg_inherits WHERE inhparent = v_rel) THEN
            RETURN;
        END IF;
    ELSE
        v_rel := multiregion.range_leaf(p_schema, p_table, p_partition);
        IF v_rel IS NULL THEN
            RETURN;
        END IF;
    END IF;
    PERFORM pg_catalog.set_config('session_replication_role', 'replica', true);
    EXECUTE format('DELETE FROM %s', v_rel);
    PERFORM pg_catalog.set_config('session_replication_role', 'origin', true);
END
$fn$;

REVOKE EXECUTE ON FUNCTION multiregion.apply_change(text, text, text, jsonb, jsonb),
    multiregion.apply_inserts(text, text, jsonb),
    multiregion.delete_row(regclass, text, jsonb),
    multiregion.apply_range_txn(bigint, bigint, text, jsonb, bigint, boolean, bigint[]),
    multiregion.apply_range_batch(bigint, bigint, text[], text[], bigint[]),
    multiregion.apply_txn_rows(bigint, bigint, text, text, bigint, boolean),
    multiregion.begin_range_entry(bigint, bigint),
    multiregion.end_range_entry(bigint, bigint, bigint[]),
    multiregion.advance_range(bigint, bigint),
    multiregion.range_checksum(bigint, text, text, text),
    multiregion.range_relation(text, text, text),
    multiregion.lock_partition_parents(regclass),
    multiregion.begin_range_install(bigint, text, text, text, bigint, bigint, bigint[]),
    multiregion.install_range_rows(text, text, text, jsonb),
    multiregion.finish_range_install(text, text, text),
    multiregion.drop_range_copy(bigint, text, text, text) FROM PUBLIC;
"#,
    name = "replication",
    requires = [capture, "catalog"]
);

/// Before a `COPY table TO` (pg_dump reads every table so): the copy of a table is read
/// straight from this node's copy, without the executor's routing, so it must be whole and
/// current here. A range this node holds no replica of is refused (its copy is empty or
/// stale: `COPY (SELECT …) TO` reads through the leaseholder). Under READ COMMITTED the read
/// first passes a read barrier and gets a snapshot taken after it, which the caller pops once
/// the COPY ran (`true`); under REPEATABLE READ and SERIALIZABLE the transaction's snapshot
/// is older than any barrier now, and a read-only one passed its barrier when it began
/// ([`snapshot_barrier`]).
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run.
#[allow(unsafe_code)]
pub unsafe fn before_copy_to(pstmt: &pg_sys::PlannedStmt) -> bool {
    let node = pstmt.utilityStmt;
    // SAFETY: the caller's contract; the cast follows the node's tag.
    if node.is_null() || unsafe { (*node).type_ } != pg_sys::NodeTag::T_CopyStmt {
        return false;
    }
    // SAFETY: as above.
    let s = unsafe { &*(node as *mut pg_sys::CopyStmt) };
    if s.is_from || s.relation.is_null() || gucs::sidecar_socket().is_none() || known_off() {
        return false;
    }
    // SAFETY: a RangeVar of the parse tree; a missing relation is InvalidOid (COPY reports it).
    let relid = unsafe {
        pg_sys::RangeVarGetRelidExtended(
            s.relation,
            pg_sys::AccessShareLock as pg_sys::LOCKMODE,
            pg_sys::RVROption::RVR_MISSING_OK,
            None,
            std::ptr::null_mut(),
        )
    };
    if relid == pg_sys::InvalidOid || !is_replicated_table(relid) {
        return false;
    }
    let Some(t) = target(relid) else {
        return false;
    };
    let database = crate::routing::database();
    let table = mr_meta::TableRef {
        database: database.clone(),
        schema: t.schema.clone(),
        table: t.table.clone(),
    };
    let ranges = match sidecar::table_ranges(database.clone(), vec![table.clone()]) {
        Ok(Some(ranges)) => ranges,
        Ok(None) => return false,
        Err(e) => e.raise(),
    };
    if let Some(r) = ranges
        .iter()
        .find(|r| !r.held && (t.partition.is_none() || r.partition == t.partition))
    {
        MrError::CopyNotHeld {
            table: format!("{}.{}", spi::ident(&t.leaf_schema), spi::ident(&t.leaf)),
            range_id: r.range_id,
        }
        .raise();
    }
    // SAFETY: reads a backend global.
    if unsafe { pg_sys::XactIsoLevel } >= pg_sys::XACT_REPEATABLE_READ as i32 {
        return false;
    }
    match sidecar::read_barrier(database, vec![(table, t.partition.clone())], true) {
        Ok(false) => {
            barrier_off_for_a_while();
            false
        }
        // SAFETY: under READ COMMITTED each statement may take a new snapshot; COPY TO reads
        // the active one, pushed here and popped by the caller after the COPY.
        Ok(true) => unsafe {
            pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
            true
        },
        Err(e) => e.raise(),
    }
}

/// After [`before_copy_to`] pushed a snapshot.
#[allow(unsafe_code)]
pub fn after_copy_to(pushed: bool) {
    if pushed {
        // SAFETY: pops the snapshot `before_copy_to` pushed; the COPY left the stack as it
        // found it.
        unsafe { pg_sys::PopActiveSnapshot() };
    }
}

/// After `BEGIN` or `SET TRANSACTION`: a READ ONLY transaction under REPEATABLE READ or
/// SERIALIZABLE (pg_dump's) takes its one snapshot at its first statement. Before that, this
/// node's copy of every range of the database it holds is brought up to every write
/// acknowledged before now, so the snapshot reflects them all (a COPY TO reads this node's
/// copies: [`before_copy_to`]).
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL just ran.
#[allow(unsafe_code)]
pub unsafe fn snapshot_barrier(pstmt: &pg_sys::PlannedStmt) {
    let node = pstmt.utilityStmt;
    if node.is_null()
        || gucs::sidecar_socket().is_none()
        || known_off()
        || !gucs::snapshot_barrier()
    {
        return;
    }
    // SAFETY: reads a backend global: a session in replica mode reads this node's copy as
    // it is (pgmr's range snapshots).
    if unsafe { pg_sys::SessionReplicationRole } == pg_sys::SESSION_REPLICATION_ROLE_REPLICA as i32
    {
        return;
    }
    // SAFETY: the caller's contract; each cast follows the node's tag; reads backend globals.
    let starts = unsafe {
        match (*node).type_ {
            pg_sys::NodeTag::T_TransactionStmt => {
                let k = (*(node as *mut pg_sys::TransactionStmt)).kind;
                k == pg_sys::TransactionStmtKind::TRANS_STMT_BEGIN
                    || k == pg_sys::TransactionStmtKind::TRANS_STMT_START
            }
            pg_sys::NodeTag::T_VariableSetStmt => {
                let v = &*(node as *mut pg_sys::VariableSetStmt);
                !v.name.is_null() && std::ffi::CStr::from_ptr(v.name).to_bytes() == b"TRANSACTION"
            }
            _ => false,
        }
    };
    // SAFETY: reads backend globals of the transaction just begun or set.
    let snapshot_reader = unsafe {
        pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32
            && pg_sys::XactReadOnly
            && !pg_sys::FirstSnapshotSet
            && pg_sys::IsTransactionBlock()
    };
    // No SPI here: any query would take the transaction's snapshot before the barrier. The
    // barrier with no targets covers every table of the database that this node holds.
    if starts && snapshot_reader {
        if let Ok(false) = sidecar::read_barrier(crate::routing::database(), Vec::new(), true)
            .map_err(|e| e.raise())
        {
            barrier_off_for_a_while();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::list_value;

    #[test]
    fn list_partition_bounds_give_their_value() {
        assert_eq!(
            list_value("FOR VALUES IN ('us-east1')").as_deref(),
            Some("us-east1")
        );
        assert_eq!(
            list_value("FOR VALUES IN ('it''s')").as_deref(),
            Some("it's")
        );
        assert_eq!(list_value("DEFAULT"), None);
    }
}
