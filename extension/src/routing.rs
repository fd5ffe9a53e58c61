//! Statement routing (ARCHITECTURE.md §9): a statement on rows leased by another node runs
//! in that node's PostgreSQL, and its rows come back here as if it had run locally.
//!
//! * **Deciding** (`ExecutorStart`): a statement that reads or writes replicated tables asks
//!   pgmr where it runs. A write (or a locking read) runs on the node that leases every range
//!   it touches; a read runs here when this node holds a replica of every range (after its
//!   read barrier), else on the node that leases them all.
//! * **Running** (`ExecutorRun`): the statement's own text and parameters (as text) go to the
//!   leaseholder through pgmr; its rows come back as text and are fed to the statement's
//!   destination through the input functions of the columns this node planned, so clients,
//!   cursors, PL/pgSQL and `RETURNING` see ordinary results.
//! * **Transactions**: one session per node the transaction ran a statement on. Under READ
//!   COMMITTED, once it has a part elsewhere its reads go to leaseholders (it reads its own
//!   writes), and its commit is two-phase when it has more than one part (this backend's own
//!   changes count as one), coordinated by pgmr; a lone remote part just commits first. Under
//!   REPEATABLE READ and SERIALIZABLE (read-write) each statement runs on the one node that
//!   leases what it touches, and a transaction with parts on several nodes holds each node's
//!   turn (ARCHITECTURE.md §8.5, "Isolation"). An abort rolls every part back;
//!   savepoints are mirrored lazily, named by subtransaction id. An autocommit statement sent
//!   through the simple query protocol begins, runs and commits remotely in one message.

use crate::error::{MrError, OrRaise};
use crate::{gucs, replication, sidecar};
use mr_wire::local::{
    Finish, ForwardBegin, ForwardRequest, ForwardStatement, Isolation, LocalRequest, Participant,
    SavepointOp,
};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgMemoryContexts;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{CStr, CString};

/// The settings a forwarded statement's meaning or text format depends on.
const FORWARDED_SETTINGS: &[&str] = &[
    "search_path",
    "DateStyle",
    "IntervalStyle",
    "TimeZone",
    "extra_float_digits",
    "bytea_output",
    "lock_timeout",
    "statement_timeout",
    "multiregion.enable_auto_rehoming",
    // SET CONSTRAINTS of the transaction (`crate::ri::after_utility`).
    "multiregion.constraint_modes",
];

/// A statement this backend runs on another node.
struct Forwarded {
    node: u64,
    /// Split over several leaseholders: each (`None`: here) with the partitions of the
    /// statement's target it runs over. Empty: the whole statement runs on `node`.
    shares: Vec<(Option<u64>, Vec<String>)>,
    /// Ranges the shares only read (a subquery's table), whose read barriers each share's
    /// node passes before running it.
    read_ranges: Vec<u64>,
    /// It may write rows into partitions leased elsewhere (so it is never sent as a whole
    /// autocommit transaction: those rows join the transaction after it ran).
    may_move: bool,
    /// Runs with this lock timeout there (the transaction has parts on several nodes).
    lock_timeout_ms: Option<u64>,
    /// Its rows once it ran, and how many were handed to the destination.
    rows: Option<Vec<Vec<Option<String>>>>,
    next: usize,
    processed: u64,
}

/// A statement that runs here and may write rows for partitions leased elsewhere.
#[derive(Clone)]
struct Collect {
    /// Why it must see every row it writes itself, if it must.
    refuse: Option<&'static str>,
    /// What the rows written elsewhere carry of it: its ON CONFLICT clause and RETURNING list.
    tail: Tail,
}

/// A row as text, as statements forwarded to other nodes return them.
type TextRow = Vec<Option<String>>;

/// What the INSERT that writes a statement's rows at another node's leaseholder carries of
/// the statement, as written: its ON CONFLICT clause, decided there, where the conflicting
/// row is leased and locked, and its RETURNING list, whose rows come back from there.
#[derive(Clone, Default)]
struct Tail {
    /// The `ON CONFLICT …` clause.
    on_conflict: Option<String>,
    /// The RETURNING list (after the RETURNING keyword).
    returning: Option<String>,
    /// The target table's alias in the statement, which both may use.
    alias: Option<String>,
}

/// Why a statement that wrote rows for another node's partition could not let them go.
const ON_CONFLICT: &str =
    "has an ON CONFLICT clause with parameters, which cannot go where the row is leased";
const RETURNING: &str = "returns it (RETURNING)";
const MODIFYING_WITH: &str = "has a data-modifying WITH that would not see it";

/// This transaction's session on another node.
struct RemoteTxn {
    node: u64,
    session: String,
    /// Origin subtransactions that have a savepoint there, outermost first.
    savepoints: Vec<u32>,
    /// Savepoint operations to send before the next step.
    pending: Vec<SavepointOp>,
    /// Only global key changes ran there (`apply_key_changes`): a part that neither pins a
    /// REPEATABLE READ transaction's statements nor holds rows it must read back.
    keys_only: bool,
    /// It changed replicated rows. A READ COMMITTED part that did not only read and locked
    /// rows (a foreign key's check, `FOR UPDATE`): it takes no part in the commit, and is
    /// rolled back, releasing its locks, once this transaction has committed.
    wrote: bool,
    /// The forwarded settings as the remote transaction has them (empty: unknown, after a
    /// rollback to a savepoint, which may have undone some).
    settings: Vec<(String, String)>,
}

thread_local! {
    /// Statements to forward, by QueryDesc address.
    static FORWARDED: RefCell<HashMap<usize, Forwarded>> = RefCell::new(HashMap::new());
    /// Statements that run here and may write rows into partitions leased elsewhere, by
    /// QueryDesc address: whether they have ON CONFLICT, and RETURNING (`crate::moved`).
    static COLLECT: RefCell<HashMap<usize, Collect>> = RefCell::new(HashMap::new());
    /// This transaction's sessions on other nodes, in the order they began.
    static REMOTE: RefCell<Vec<RemoteTxn>> = const { RefCell::new(Vec::new()) };
    /// This transaction's open subtransactions, outermost first.
    static OPEN_SUBS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    /// Above zero while this backend runs a statement another node forwarded here: it is
    /// never forwarded again.
    static SERVING: Cell<u32> = const { Cell::new(0) };
    /// Set while a served statement has not started yet: the next statement to start is
    /// it, and the ones after it are its triggers' and functions' statements.
    static SERVE_TOP: Cell<bool> = const { Cell::new(false) };
    /// Above zero while the statement served is another node's transaction's
    /// (`remote_exec`), not this origin's own share of a statement split over leaseholders.
    static SERVING_REMOTE: Cell<u32> = const { Cell::new(0) };
    /// Above zero while the extension reads this node's copy as it is, on purpose
    /// (`count_local`): no routing, no read barrier.
    static LOCAL_READS: Cell<u32> = const { Cell::new(0) };
    /// The forwarding node's region while serving its statement (`gateway_region()`).
    static GATEWAY_REGION: RefCell<Option<String>> = const { RefCell::new(None) };
    /// Executor runs in progress: above zero, a statement is nested in another.
    static RUN_DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Executor finishes in progress (AFTER triggers run in them): above zero, a statement
    /// is nested in another's triggers.
    static FINISH_DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Forwarded statements being run (their shares sent, their moved rows written): the
    /// extension's own queries meanwhile are nested in them.
    static FORWARDING: Cell<u32> = const { Cell::new(0) };
    /// FINISH_DEPTH and RUN_DEPTH when each open subtransaction began: an ERROR leaves the
    /// finishes it interrupted counted, and rolling back to the subtransaction restores the
    /// counts (a statement caught in a PL/pgSQL exception block is still nested as deep as
    /// before: `ri::current` compares levels).
    static SUB_FINISH_DEPTH: RefCell<Vec<(u32, u32, u32)>> = const { RefCell::new(Vec::new()) };
    static SESSION_SEQ: Cell<u64> = const { Cell::new(0) };
    /// This transaction ran a write or locking statement on replicated tables here: it has
    /// a part on this node (its row locks), even before it changed a row.
    static LOCAL_PART: Cell<bool> = const { Cell::new(false) };
    /// This read-write REPEATABLE READ or SERIALIZABLE transaction ran a statement over
    /// replicated tables here: it has a part here, with this node's snapshot and conflicts.
    static SNAPSHOT_HERE: Cell<bool> = const { Cell::new(false) };
    /// Where this read-write REPEATABLE READ or SERIALIZABLE transaction holds the node's
    /// turn (`None`: this node), once it has parts on two nodes or more (`take_turns`).
    static TURNS: RefCell<Vec<Option<u64>>> = const { RefCell::new(Vec::new()) };
    /// Nodes whose next step takes the turn there, and how long it may wait (`begin_step`).
    static TURN_NEXT: RefCell<Vec<(u64, u64)>> = const { RefCell::new(Vec::new()) };
    static DATABASE: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// The region `gateway_region()` answers: the forwarding node's while serving its statement.
pub fn gateway_region_override() -> Option<String> {
    GATEWAY_REGION.with(|g| g.borrow().clone())
}

/// Runs `f` with `gateway_region()` answering `region` (when given), as a statement served for
/// a node of that region would.
pub fn with_gateway_region<R>(region: Option<String>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Option<String>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(prev) = self.0.take() {
                GATEWAY_REGION.with(|g| *g.borrow_mut() = prev);
            }
        }
    }
    let _restore = Restore(region.map(|r| GATEWAY_REGION.with(|g| g.borrow_mut().replace(r))));
    f()
}

/// This backend's database.
#[allow(unsafe_code)]
pub fn database() -> String {
    if let Some(d) = DATABASE.with(|d| d.borrow().clone()) {
        return d;
    }
    // SAFETY: MyDatabaseId is set for the life of a backend connected to a database;
    // get_database_name returns a palloc'd copy (NULL if the database is gone).
    let name = unsafe {
        let p = pg_sys::get_database_name(pg_sys::MyDatabaseId);
        if p.is_null() {
            return String::new();
        }
        CStr::from_ptr(p).to_string_lossy().into_owned()
    };
    DATABASE.with(|d| *d.borrow_mut() = Some(name.clone()));
    name
}

thread_local! {
    /// Statements that run here over several leaseholders' ranges and lock rows of ranges
    /// leased elsewhere: checked once PostgreSQL has started them ([`refuse_locks_on_copies`]).
    static LOCK_CHECKS: RefCell<HashMap<usize, Vec<mr_wire::local::LockedElsewhere>>> =
        RefCell::new(HashMap::new());
}

/// After PostgreSQL started a statement that runs here over several leaseholders' ranges
/// (its partitions pruned by the values it runs with, as a generic plan's are): refused if
/// it still scans, with a row lock, a partition or table leased elsewhere. Its locks would
/// be taken on this node's copy, where they conflict with nothing at the leaseholder, and
/// could hold back this node's applier. A scan is matched to the lock by its range-table
/// entry, not its relation: `FROM t x JOIN t y ... FOR UPDATE OF x` locks nothing through
/// `y`'s scans.
///
/// # Safety
/// `qd` is a QueryDesc PostgreSQL has just started.
#[allow(unsafe_code)]
pub unsafe fn refuse_locks_on_copies(qd: &pg_sys::QueryDesc) {
    let key = qd as *const pg_sys::QueryDesc as usize;
    let Some(elsewhere) = LOCK_CHECKS.with(|l| l.borrow_mut().remove(&key)) else {
        return;
    };
    if qd.planstate.is_null() {
        return;
    }
    /// Collects the relation and range-table index of every scan under `ps`, subplans
    /// included. Not guarded itself (an error unwinds as a panic through the guarded walker
    /// call), so that this function's caller may own values; only the callback PostgreSQL
    /// calls is guarded.
    ///
    /// # Safety
    /// `ps` is a node of a started plan's state tree.
    unsafe fn collect(ps: *mut pg_sys::PlanState, scans: &mut Vec<(pg_sys::Oid, pg_sys::Index)>) {
        use pg_sys::NodeTag::*;
        // SAFETY: as this function's contract; these node types are ScanStates (a PlanState
        // first), whose current relation is open and whose plan is a Scan.
        unsafe {
            if ps.is_null() {
                return;
            }
            if matches!(
                (*ps).type_,
                T_SeqScanState
                    | T_SampleScanState
                    | T_IndexScanState
                    | T_IndexOnlyScanState
                    | T_BitmapHeapScanState
                    | T_TidScanState
                    | T_TidRangeScanState
            ) {
                let rel = (*(ps as *mut pg_sys::ScanState)).ss_currentRelation;
                let plan = (*ps).plan as *mut pg_sys::Scan;
                if !rel.is_null() && !plan.is_null() {
                    scans.push(((*rel).rd_id, (*plan).scanrelid));
                }
            }
            pg_sys::planstate_tree_walker(ps, Some(child), scans as *mut Vec<_> as *mut _);
        }
    }
    /// [`collect`] for each child node, as PostgreSQL's walker calls it.
    #[pg_guard]
    unsafe extern "C-unwind" fn child(
        ps: *mut pg_sys::PlanState,
        scans: *mut std::ffi::c_void,
    ) -> bool {
        // SAFETY: `ps` is a child of a node `collect` walks; `scans` is its Vec, alive for
        // the walk.
        unsafe { collect(ps, &mut *(scans as *mut Vec<(pg_sys::Oid, pg_sys::Index)>)) };
        false
    }
    let mut scans = Vec::new();
    // SAFETY: the started plan's state tree, walked while the QueryDesc lives; the planned
    // statement likewise.
    let marks = unsafe {
        collect(qd.planstate, &mut scans);
        replication::locking_marks(&*qd.plannedstmt)
    };
    for (relid, _) in scans.into_iter().filter(|(_, rti)| marks.contains(rti)) {
        // SAFETY: the executor holds the scanned relations open and locked.
        let Some((table, partition)) = (unsafe { replication::range_target(relid) }) else {
            continue;
        };
        let Some(l) = elsewhere
            .iter()
            .find(|l| l.table == table && (l.partition.is_none() || l.partition == partition))
        else {
            continue;
        };
        let Some(holder) = l.leaseholder else {
            // A failover: the range has a leaseholder again within seconds.
            MrError::Retryable(format!(
                "the statement locks rows of range {}, which has no leaseholder yet",
                l.range_id
            ))
            .raise();
        };
        let message = format!(
            "the statement locks rows of range {} (leaseholder: node {holder}) and touches ranges leased on different nodes: run here, its locks would be taken on this node's copy",
            l.range_id
        );
        let hint = if qd.operation == pg_sys::CmdType::CMD_SELECT {
            "Lock each leaseholder's rows in its own statement (name the rows' region: WHERE crdb_region = ...), or lock only tables leased on this node (FOR UPDATE OF ...)."
        } else {
            "Lock the rows the subquery reads in a statement of their own first (SELECT ... FOR UPDATE, which runs where they are leased), then change rows without FOR UPDATE in the subquery, in the same transaction."
        };
        MrError::WriteNotServed {
            message,
            hint: hint.into(),
        }
        .raise();
    }
}

/// What a statement inside one served for another node waits for before it runs
/// ([`check_nested`]).
enum NestedWait {
    /// Nothing but a SELECT's own read barrier.
    Nothing,
    /// pgmr waited for the read barriers of the ranges it touches (routing it over ranges
    /// leased on several nodes): its snapshot must be taken after the wait.
    Waited,
    /// The read barriers of these ranges (an INSERT's reads), then a snapshot taken after.
    Ranges(Vec<replication::RangeTarget>),
}

/// A statement inside one served for another node (a trigger's or a function's) is never
/// routed: it runs here. One that locks rows leased elsewhere would take those locks on this
/// node's copy, so it is refused: at once if one other node leases everything it touches,
/// else once started, if its pruned plan still scans such a range
/// ([`refuse_locks_on_copies`]). A change in place (UPDATE, DELETE, MERGE, or any statement
/// with a data-modifying WITH) of rows all leased on another node is refused at once too;
/// one over ranges leased here and elsewhere runs here, past a read barrier (it must not miss
/// a row its copy has not applied yet), and a row it changes in a range leased elsewhere
/// fails the transaction at commit, this node not being the leaseholder. An INSERT's rows
/// for ranges leased elsewhere go to the origin, but what it reads besides its target
/// (`INSERT … SELECT`) is read here, past the same barrier.
///
/// # Safety
/// As [`executor_start`].
#[allow(unsafe_code)]
unsafe fn check_nested(qd: &pg_sys::QueryDesc, key: usize) -> NestedWait {
    // SAFETY: as this function's contract.
    let locked = unsafe { replication::locked_ranges(qd) };
    // SAFETY: the planned statement is valid for the query's life.
    let modifying_with = unsafe { (*qd.plannedstmt).hasModifyingCTE };
    let changes = modifying_with
        || matches!(
            qd.operation,
            pg_sys::CmdType::CMD_UPDATE | pg_sys::CmdType::CMD_DELETE | pg_sys::CmdType::CMD_MERGE
        );
    let reads = || {
        // SAFETY: as this function's contract.
        let reads = unsafe { replication::insert_reads(qd) };
        if reads.is_empty() {
            NestedWait::Nothing
        } else {
            NestedWait::Ranges(reads)
        }
    };
    if locked.is_empty() && !changes {
        return reads();
    }
    // SAFETY: as this function's contract.
    let (targets, _) = unsafe { replication::touched_ranges(qd) };
    if targets.is_empty() {
        return NestedWait::Nothing;
    }
    // As a change (`modifies`): where the rows are leased, without the read barrier a
    // locking read passes there (a quorum round per row of a row trigger).
    let how = sidecar::RouteHow {
        write: true,
        modifies: true,
        locked,
        ..sidecar::RouteHow::default()
    };
    match sidecar::route_with(database(), targets, Vec::new(), how) {
        Ok(sidecar::Route {
            forward_to: Some(node),
            ..
        }) if changes => nested_change_refused(node),
        Ok(sidecar::Route {
            forward_to: Some(node),
            ..
        }) => MrError::WriteNotServed {
            message: format!(
                "a statement inside one that runs for another node's transaction (a trigger's or a function's) locks rows leased on node {node}: its locks would be taken on this node's copy"
            ),
            hint: "Lock those rows in a statement of the transaction's own, before the statement whose trigger or function needs them.".into(),
        }
        .raise(),
        Ok(r) => {
            if !r.locked_elsewhere.is_empty() {
                LOCK_CHECKS.with(|l| l.borrow_mut().insert(key, r.locked_elsewhere));
            }
            // Not mixed: every range it touches is leased here (or replication is off).
            if r.mixed {
                NestedWait::Waited
            } else {
                NestedWait::Nothing
            }
        }
        Err(e) => e.raise(),
    }
}

/// An UPDATE or DELETE inside a statement served for another node (a trigger's or a
/// function's) would change rows leased on `node` in this node's copy: it read a copy that
/// may lag (changing nothing, silently) and could not commit a change there anyway.
fn nested_change_refused(node: u64) -> ! {
    MrError::WriteNotServed {
        message: format!(
            "a statement inside one that runs for another node's transaction (a trigger's or a function's) changes rows leased on node {node}: it would change this node's copy"
        ),
        hint: "Change those rows in a statement of the transaction's own (it runs where they are leased), or keep the tables a trigger writes in the same region as its table.".into(),
    }
    .raise()
}

/// Before a statement starts: decides where it runs. A read that stays here has passed its
/// read barrier when this returns.
///
/// # Safety
/// `qd` is the QueryDesc PostgreSQL is about to start; its relations are locked.
#[allow(unsafe_code)]
pub unsafe fn executor_start(qd: &mut pg_sys::QueryDesc, eflags: i32) {
    let key = qd as *mut pg_sys::QueryDesc as usize;
    FORWARDED.with(|f| f.borrow_mut().remove(&key));
    COLLECT.with(|c| c.borrow_mut().remove(&key));
    LOCK_CHECKS.with(|l| l.borrow_mut().remove(&key));
    if gucs::sidecar_socket().is_none()
        || eflags & pg_sys::EXEC_FLAG_EXPLAIN_ONLY as i32 != 0
        || qd.plannedstmt.is_null()
    {
        return;
    }
    // SAFETY: reads backend globals. A parallel worker runs its leader's plan (the leader did
    // the routing); a session in replica mode is a range applier writing this node's copy.
    if unsafe {
        pg_sys::ParallelWorkerNumber >= 0
            || pg_sys::SessionReplicationRole == pg_sys::SESSION_REPLICATION_ROLE_REPLICA as i32
    } {
        return;
    }
    if replication::known_off() && REMOTE.with(|r| r.borrow().is_empty()) {
        return;
    }
    if replication::capture_suppressed() || LOCAL_READS.with(Cell::get) > 0 {
        return;
    }
    if SERVING.with(Cell::get) > 0 {
        // SAFETY: as this function's contract.
        if unsafe { defer_referential(qd, key) } {
            return;
        }
        // A foreign key's query over rows leased here runs here.
        let wait = if !SERVE_TOP.with(|t| t.replace(false)) && crate::ri::current().is_none() {
            // SAFETY: as this function's contract.
            unsafe { check_nested(qd, key) }
        } else {
            NestedWait::Nothing
        };
        // SAFETY: as this function's contract (each takes the snapshot anew after its wait).
        unsafe {
            match wait {
                NestedWait::Nothing => replication::read_barrier(qd, eflags),
                NestedWait::Waited => replication::fresh_snapshot(qd),
                NestedWait::Ranges(ranges) => replication::barrier_over(qd, ranges),
            }
        }
        return;
    }
    // SAFETY: the planned statement is valid for the query's life; reads a backend global.
    // Under REPEATABLE READ and SERIALIZABLE a read also goes to the leaseholder: this
    // node's snapshot may predate its read barrier, and serializable conflicts are only seen
    // where the writes are.
    let (write, modifies, can_set_tag) = unsafe {
        let ps = &*qd.plannedstmt;
        let modifies = qd.operation != pg_sys::CmdType::CMD_SELECT || ps.hasModifyingCTE;
        (
            modifies
                || !ps.rowMarks.is_null()
                || pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32,
            modifies,
            ps.canSetTag,
        )
    };
    // SAFETY: the planned statement is valid for the query's life.
    if !write && unsafe { !replication::reads_a_relation(&*qd.plannedstmt) } {
        return;
    }
    // SAFETY: as this function's contract.
    let (targets, inserted) = unsafe { replication::touched_ranges(qd) };
    if targets.is_empty() {
        return;
    }
    // SAFETY: the parameter list, if any, is valid for the query's life. PL/pgSQL passes one
    // with a fetch hook exactly when the statement uses its variables.
    let plpgsql_params = unsafe { !qd.params.is_null() && (*qd.params).paramFetch.is_some() };
    // SAFETY: as this function's contract.
    let named_params = unsafe { names_its_parameters(qd) };
    let dynamic_params = plpgsql_params || named_params;
    // SAFETY: as this function's contract.
    let may_move = unsafe { replication::may_move_rows(qd) };
    let refuse_dynamic = |node: u64| {
        if plpgsql_params {
            // PL/pgSQL resolves its variables while parsing: the statement's text alone
            // does not say what they are.
            MrError::WriteNotServed {
                message: format!("a PL/pgSQL statement that uses variables cannot run on node {node}, which leases the rows it touches"),
                hint: "Call the function on the leaseholder's node (lease_holder in multiregion.ranges), or run the statement from the client.".into(),
            }
            .raise();
        }
        if named_params {
            // So does a SQL function its parameters' names.
            MrError::WriteNotServed {
                message: format!("a SQL function's statement that names its parameters cannot run on node {node}, which leases the rows it touches"),
                hint: "Refer to the parameters as $1, $2, ... in the function's body, or call the function on the leaseholder's node (lease_holder in multiregion.ranges).".into(),
            }
            .raise();
        }
    };
    // SAFETY: ActivePortal, when set, is the portal running this statement or its caller.
    // Rules rewrite one statement into several that share its text; the leaseholder expands
    // the rules itself, so none of them can be sent as text.
    let rewritten = !can_set_tag
        || unsafe {
            let p = pg_sys::ActivePortal;
            !p.is_null()
                && !(*p).stmts.is_null()
                && (*(*p).stmts).length > 1
                && pg_sys::list_member_ptr((*p).stmts, qd.plannedstmt as *const _)
        };
    let forward_to = |node: u64| {
        refuse_with_schema_change(node);
        // SAFETY: as this function's contract.
        unsafe { refuse_unsendable(qd, node) };
        if rewritten {
            MrError::WriteNotServed {
                message: format!("a statement rewritten by a rule cannot run on node {node}, which leases the rows it touches"),
                hint: "Run the statement on that node, or drop the rule.".into(),
            }
            .raise();
        }
        // A part on another node too: lock waits end (see `lock_timeout_for_parts`).
        let several = LOCAL_PART.with(Cell::get)
            || replication::has_local_changes()
            || REMOTE.with(|r| r.borrow().iter().any(|x| x.node != node));
        FORWARDED.with(|f| {
            f.borrow_mut().insert(
                key,
                Forwarded {
                    node,
                    shares: Vec::new(),
                    read_ranges: Vec::new(),
                    may_move,
                    lock_timeout_ms: several.then(lock_timeout_for_parts).flatten(),
                    rows: None,
                    next: 0,
                    processed: 0,
                },
            )
        });
    };
    // SAFETY: reads a backend global.
    let snapshot_isolation = unsafe { pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32 };
    // A read-write transaction under these levels reads where the rows are leased (its
    // snapshot and serializable conflicts there), holding each node's turn once it has parts
    // on several. (A READ ONLY one may read copies: it writes nothing a skew could break.)
    // SAFETY: reads a backend global.
    let one_leaseholder = snapshot_isolation && unsafe { !pg_sys::XactReadOnly };
    // An UPDATE or DELETE (or a plain scan) of one REGIONAL BY ROW table over partitions
    // leased on several nodes runs on each leaseholder over its own partitions, as parts of
    // one transaction (two-phase commit over the parts).
    // SAFETY: as this function's contract.
    let splittable = (!snapshot_isolation || one_leaseholder)
        && !dynamic_params
        && !rewritten
        && unsafe { replication::splittable(qd) };
    // What a split UPDATE or DELETE reads besides its own partitions: each share's node
    // reads it from its copies.
    let split_reads = if splittable && modifies {
        // SAFETY: as this function's contract.
        unsafe { replication::split_write(qd) }
            .filter(|(_, reads)| !reads.is_empty())
            .map(|(changes, reads)| mr_wire::local::SplitReads {
                changes,
                reads,
                changed_here: replication::has_local_changes()
                    && !replication::local_changes_keys_only(),
            })
    } else {
        None
    };
    // Under REPEATABLE READ and SERIALIZABLE a share reads other tables from the copies
    // where it runs, outside their leaseholders' snapshots: not split.
    let (splittable, split_reads) = match split_reads {
        Some(_) if one_leaseholder => (false, None),
        reads => (splittable, reads),
    };
    // Parts that only hold global key changes pin nothing.
    let first_remote = REMOTE.with(|r| r.borrow().iter().find(|r| !r.keys_only).map(|r| r.node));
    // The nodes where this transaction has changes this node's copies lack. Under READ
    // COMMITTED a part that only read (a split read's share, a foreign key's check) has
    // none: reads need not go where it is.
    let txn_nodes: Vec<u64> = REMOTE.with(|r| {
        r.borrow()
            .iter()
            .filter(|x| snapshot_isolation || x.wrote)
            .map(|x| x.node)
            .collect()
    });
    if let (true, false, Some(node)) = (snapshot_isolation, one_leaseholder, first_remote) {
        // A READ ONLY transaction under these levels reads where its first remote statement
        // went: one snapshot.
        refuse_dynamic(node);
        forward_to(node);
        return;
    }
    // A READ COMMITTED transaction with changes elsewhere reads where the rows are leased,
    // so that it sees its own writes there: on their leaseholder, split over them, or
    // gathered from them, every table leased where it changed rows read there
    // (`crate::gather::held_here`). Parts that only read do not count.
    let has_remotes = REMOTE.with(|r| r.borrow().iter().any(|x| !x.keys_only && x.wrote));
    let how = sidecar::RouteHow {
        write: write || has_remotes,
        modifies,
        splittable,
        one_leaseholder,
        // An INSERT may gather what it reads too: its rows go to their partitions'
        // leaseholders after (READ COMMITTED: each gathered table is read as of its own
        // leaseholders' statement, as a read's are).
        // SAFETY: as this function's contract.
        // Under REPEATABLE READ and SERIALIZABLE a read over several leaseholders is
        // gathered too, every table not leased here read through its leaseholders.
        may_gather: (!write
            || (qd.operation == pg_sys::CmdType::CMD_INSERT && !snapshot_isolation && !rewritten)
            || (one_leaseholder && !modifies && qd.operation == pg_sys::CmdType::CMD_SELECT))
            && !dynamic_params
            && unsafe { crate::gather::may_replan(qd) },
        inserted,
        split_reads,
        // SAFETY: as this function's contract.
        locked: unsafe { replication::locked_ranges(qd) },
    };
    match sidecar::route_with(database(), targets, txn_nodes, how) {
        Ok(r) if r.gather => {
            // SAFETY: as this function's contract.
            unsafe { crate::gather::replan(qd) };
            // SAFETY: as this function's contract; the plan now reads the gathered rows.
            unsafe { executor_start(qd, eflags) };
        }
        Ok(r) if !r.enabled => replication::barrier_off_for_a_while(),
        Ok(r) if !r.split.is_empty() => {
            if let Some(node) = r.split.iter().find_map(|(n, _)| *n) {
                refuse_with_schema_change(node);
                // SAFETY: as this function's contract.
                unsafe { refuse_unsendable(qd, node) };
            }
            if one_leaseholder {
                let nodes: Vec<Option<u64>> = r.split.iter().map(|(n, _)| *n).collect();
                take_turns(&nodes).or_raise();
            }
            let here = r.split.iter().any(|(n, _)| n.is_none());
            let lock_timeout_ms = lock_timeout_for_parts();
            if here {
                LOCAL_PART.with(|l| l.set(true));
            }
            let node = r.split.iter().find_map(|(n, _)| *n).unwrap_or(0);
            FORWARDED.with(|f| {
                f.borrow_mut().insert(
                    key,
                    Forwarded {
                        node,
                        shares: r.split,
                        read_ranges: r.read_ranges,
                        may_move,
                        lock_timeout_ms,
                        rows: None,
                        next: 0,
                        processed: 0,
                    },
                )
            });
        }
        Ok(
            r @ sidecar::Route {
                forward_to: None, ..
            },
        ) => {
            if one_leaseholder {
                take_turns(&[None]).or_raise();
                SNAPSHOT_HERE.with(|l| l.set(true));
            }
            if !write {
                // SAFETY: as this function's contract.
                unsafe { replication::fresh_snapshot(qd) };
            } else {
                LOCAL_PART.with(|l| l.set(true));
                if r.mixed || !modifies {
                    // It read past barriers (copies, or a locking read's ranges on a leader
                    // that may have just begun to serve): under READ COMMITTED its snapshot
                    // must be taken after the wait too, as a read's is. Taken before it, rows
                    // the appliers changed meanwhile are seen as concurrently updated, and an
                    // UPDATE … WHERE id IN (subquery) skips them and commits the rest.
                    // SAFETY: as this function's contract.
                    unsafe { replication::fresh_snapshot(qd) };
                }
                if may_move || (r.mixed && qd.operation == pg_sys::CmdType::CMD_INSERT) {
                    // SAFETY: the planned statement is valid for the query's life; its top
                    // node is a ModifyTable when its tag says so.
                    let refuse = unsafe {
                        let ps = &*qd.plannedstmt;
                        let mt = ps.planTree as *mut pg_sys::ModifyTable;
                        if ps.hasModifyingCTE
                            || mt.is_null()
                            || (*mt).plan.type_ != pg_sys::NodeTag::T_ModifyTable
                        {
                            Some(MODIFYING_WITH)
                        } else {
                            None
                        }
                    };
                    // SAFETY: as this function's contract; the plan's top node is a
                    // ModifyTable when nothing was refused above.
                    let carried = refuse.is_none()
                        && unsafe {
                            (*qd.plannedstmt).hasReturning
                                || (*((*qd.plannedstmt).planTree as *mut pg_sys::ModifyTable))
                                    .onConflictAction
                                    != pg_sys::OnConflictAction::ONCONFLICT_NONE
                        };
                    let (refuse, tail) = match refuse {
                        Some(why) => (Some(why), Tail::default()),
                        // SAFETY: as this function's contract.
                        None if carried => match unsafe { tail_of(qd) } {
                            Ok(t) => (None, t),
                            Err(why) => (Some(why), Tail::default()),
                        },
                        None => (None, Tail::default()),
                    };
                    COLLECT.with(|c| c.borrow_mut().insert(key, Collect { refuse, tail }));
                }
                if !r.locked_elsewhere.is_empty() {
                    LOCK_CHECKS.with(|l| l.borrow_mut().insert(key, r.locked_elsewhere));
                }
                // Locks held elsewhere too (a read-only part's FOR UPDATE): a wait here may
                // be one side of a deadlock no node sees whole.
                if first_remote.is_some() {
                    set_local_lock_timeout();
                }
            }
        }
        Ok(sidecar::Route {
            forward_to: Some(node),
            ..
        }) => {
            refuse_dynamic(node);
            if one_leaseholder {
                take_turns(&[Some(node)]).or_raise();
            }
            forward_to(node);
        }
        Err(e) => e.raise(),
    }
}

/// Whether the statement is a SQL function's that refers to the function's parameters by
/// name: it has parameters, runs inside another statement (its text is not its portal's),
/// and its text has no `$n`. Its text then names what only the function's parser hook
/// resolves, and means something else — or nothing — anywhere else.
///
/// # Safety
/// `qd` is a QueryDesc about to start.
#[allow(unsafe_code)]
unsafe fn names_its_parameters(qd: &pg_sys::QueryDesc) -> bool {
    // SAFETY: the parameter list and source text are valid for the query's life;
    // ActivePortal, when set, is the portal running this statement or its caller.
    unsafe {
        let pl = qd.params;
        if pl.is_null() || (*pl).numParams <= 0 || (*pl).paramFetch.is_some() {
            return false;
        }
        let portal = pg_sys::ActivePortal;
        if !portal.is_null() && (*portal).sourceText == qd.sourceText {
            return false;
        }
        let sql = statement_sql(qd);
        let b = sql.as_bytes();
        !b.windows(2).any(|w| w[0] == b'$' && w[1].is_ascii_digit())
    }
}

/// While serving another node's statement: a foreign key trigger's query over rows leased
/// elsewhere is left for the origin to run (`crate::ri`), which routes it to where they are
/// leased, in the transaction's session there (at every isolation level: this node's copy
/// may lack the transaction's own rows, and a lock taken on it holds off nobody). The trigger
/// meanwhile gets the rows that let it go on, as a forwarded statement's. Whether it was left.
///
/// # Safety
/// `qd` is the QueryDesc PostgreSQL is about to start.
#[allow(unsafe_code)]
unsafe fn defer_referential(qd: &mut pg_sys::QueryDesc, key: usize) -> bool {
    let Some(call) = crate::ri::current() else {
        return false;
    };
    // SAFETY: as this function's contract.
    let targets = unsafe { replication::statement_targets(qd) };
    if targets.is_empty() {
        return false;
    }
    // An INITIALLY DEFERRED key's queries go to the origin wherever their rows are leased:
    // they belong to its commit, not to this statement.
    if !(call.deferred && serving_remote()) {
        let modifies = qd.operation != pg_sys::CmdType::CMD_SELECT;
        // Splittable: the answer says where the rows are leased, without refusing anything.
        let here = match sidecar::route(database(), targets, true, modifies, true, Vec::new()) {
            Ok(r) => !r.enabled || (r.forward_to.is_none() && r.split.is_empty()),
            Err(e) => e.raise(),
        };
        if here {
            return false;
        }
    }
    // SAFETY: the planned statement's range table is valid for the query's life; its first
    // entry is the relation a referential query reads or changes.
    let (statement, queried, width) = unsafe {
        let ps = &*qd.plannedstmt;
        let rte = pg_sys::list_nth(ps.rtable, 0) as *mut pg_sys::RangeTblEntry;
        // The result's columns: the plan's target list without junk (row locks' ctids).
        let tlist = if ps.planTree.is_null() {
            std::ptr::null_mut()
        } else {
            (*ps.planTree).targetlist
        };
        let mut width = 0;
        if !tlist.is_null() {
            for i in 0..(*tlist).length {
                let te = pg_sys::list_nth(tlist, i) as *mut pg_sys::TargetEntry;
                if !te.is_null() && !(*te).resjunk {
                    width += 1;
                }
            }
        }
        (statement_of(qd), (*rte).relid, width)
    };
    let rows = crate::ri::defer(call, &statement, queried, width);
    FORWARDED.with(|f| {
        f.borrow_mut().insert(
            key,
            Forwarded {
                node: 0,
                shares: Vec::new(),
                read_ranges: Vec::new(),
                may_move: false,
                lock_timeout_ms: None,
                rows: Some(rows),
                next: 0,
                processed: 0,
            },
        )
    });
    true
}

/// A statement cannot run on another node in a transaction whose schema changes are proposed
/// only at its commit: that node would run it against the old schema.
pub(crate) fn refuse_with_schema_change(node: u64) {
    if crate::regions::has_pending_schema_change() {
        MrError::SchemaChangePending { node }.raise();
    }
}

/// Whether this transaction is read-write under REPEATABLE READ or SERIALIZABLE.
#[allow(unsafe_code)]
pub(crate) fn snapshot_read_write() -> bool {
    // SAFETY: reads backend globals.
    unsafe { pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32 && !pg_sys::XactReadOnly }
}

/// Whether this transaction's parts must hold their nodes' turns when it commits: it is
/// read-write under REPEATABLE READ or SERIALIZABLE, or was and wrote (`SET TRANSACTION READ
/// ONLY` may come after its writes).
#[allow(unsafe_code)]
fn turns_at_commit() -> bool {
    // SAFETY: reads a backend global.
    let snapshot_isolation = unsafe { pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32 };
    snapshot_isolation
        && (snapshot_read_write()
            || replication::has_local_changes()
            || REMOTE.with(|r| r.borrow().iter().any(|x| x.wrote)))
}

/// The nodes this transaction has a part on whose snapshot and conflicts matter (`None`: this
/// node): parts holding only global key changes read nothing.
fn turn_parts() -> Vec<Option<u64>> {
    let here = SNAPSHOT_HERE.with(Cell::get)
        || LOCAL_PART.with(Cell::get)
        || (replication::has_local_changes() && !replication::local_changes_keys_only());
    let mut parts: Vec<Option<u64>> = here.then_some(None).into_iter().collect();
    REMOTE.with(|r| {
        for x in r.borrow().iter().filter(|x| !x.keys_only) {
            if !parts.contains(&Some(x.node)) {
                parts.push(Some(x.node));
            }
        }
    });
    parts
}

/// Before a read-write REPEATABLE READ or SERIALIZABLE transaction runs a statement on
/// `dests` (`None`: this node; several: a split statement's shares): once it has parts on two
/// nodes or more, each of them holds that node's turn (ARCHITECTURE.md §8.5, "Isolation"). A
/// part already there takes it now (this node's at once, another's by a step of its own),
/// `dests` with the statement's steps. PostgreSQL serializes each node's transactions, and the turns
/// order the transactions over several nodes the same way on every node they share.
fn take_turns(dests: &[Option<u64>]) -> Result<(), MrError> {
    if !snapshot_read_write() {
        return Ok(());
    }
    let mut parts = turn_parts();
    for dest in dests {
        if !parts.contains(dest) {
            parts.push(*dest);
        }
    }
    let with_step: Vec<u64> = dests.iter().flatten().copied().collect();
    hold_turns(&parts, &with_step)
}

/// Makes each of `parts` hold its node's turn, if there are two or more; those of the nodes
/// `with_step` by the next step sent there.
fn hold_turns(parts: &[Option<u64>], with_step: &[u64]) -> Result<(), MrError> {
    if parts.len() < 2 {
        return Ok(());
    }
    for &part in parts {
        if TURNS.with(|t| t.borrow().contains(&part)) {
            continue;
        }
        // Holding a turn, wait only briefly for the next: two transactions that took their
        // first turns on different nodes and now want each other's must not both wait out
        // the lock timeout.
        let wait_ms = match (turn_wait_ms(), TURNS.with(|t| t.borrow().is_empty())) {
            (ms, true) => ms,
            (0, false) => HOLDING_TURN_WAIT_MS,
            (ms, false) => ms.min(HOLDING_TURN_WAIT_MS),
        };
        match part {
            None => take_turn_here(wait_ms)?,
            Some(node) if with_step.contains(&node) => {
                TURN_NEXT.with(|t| t.borrow_mut().push((node, wait_ms)))
            }
            Some(node) => take_turn_there(node, wait_ms)?,
        }
        TURNS.with(|t| t.borrow_mut().push(part));
    }
    Ok(())
}

/// How long a transaction holding a turn waits for another, in milliseconds.
const HOLDING_TURN_WAIT_MS: u64 = 200;

/// How long a turn is waited for, in milliseconds (0: as long as it takes): as long as a
/// lock of a transaction over several nodes, or the session's lock_timeout if shorter.
#[allow(unsafe_code)]
fn turn_wait_ms() -> u64 {
    // SAFETY: reads the lock_timeout setting's backing variable.
    lock_timeout_for_parts().unwrap_or_else(|| unsafe { pg_sys::LockTimeout }.max(0) as u64)
}

/// Takes this node's turn: the lock of `multiregion.turn` (waited for in PostgreSQL's lock
/// queue, up to `wait_ms`; 0: as long as it takes), then an update of its row, which fails
/// with 40001 if another transaction over several nodes committed here after this one's
/// snapshot. As the bootstrap superuser: the table is the extension's.
#[allow(unsafe_code)]
fn take_turn_here(wait_ms: u64) -> Result<(), MrError> {
    crate::sequences::as_superuser(|| {
        let relid = crate::regions::spi::read_one(
            "SELECT 'multiregion.turn'::pg_catalog.regclass::pg_catalog.oid::text",
            vec![],
        )
        .and_then(|o| o.parse::<u32>().ok())
        .map_or(pg_sys::InvalidOid, pg_sys::Oid::from);
        take_turn_in_subtransaction(relid, wait_ms)
    })
}

/// Takes the turn (`relid`'s lock, EXCLUSIVE, and its row's update) in a subtransaction of its
/// own, so that its two ways to fail can be caught and said as what they mean:
/// - the lock is waited for in PostgreSQL's lock queue, as another node's session for this
///   one does (`LOCK TABLE`): first come, first served, and a cycle of waits on this node (a
///   session holding the turn waiting for a row this backend locked) is the deadlock
///   detector's (40P01) instead of two timeouts; `wait_ms` (0: no limit) ends it, TurnBusy;
/// - the update finds the row updated by a transaction committed after this one's snapshot:
///   TurnTaken.
///
/// Released, the subtransaction hands the lock and the update to the transaction.
#[allow(unsafe_code)]
fn take_turn_in_subtransaction(relid: pg_sys::Oid, wait_ms: u64) -> Result<(), MrError> {
    // SAFETY: inside a transaction (in progress, or at its pre-commit, where PostgreSQL
    // allows subtransactions as for deferred triggers); the memory context and resource
    // owner are put back after the subtransaction ends, either way, as PL/pgSQL does.
    let (cxt, owner) = unsafe {
        let saved = (pg_sys::CurrentMemoryContext, pg_sys::CurrentResourceOwner);
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(saved.0);
        saved
    };
    // SAFETY: backend globals, put back by `finally`. LockTimeout is read when the wait starts
    // (ProcSleep). XactReadOnly is only true here at commit (statements take turns only in
    // read-write transactions): a transaction that wrote and then became READ ONLY still
    // takes its turns, the row being the extension's bookkeeping, not the user's data.
    let (timeout, read_only) = unsafe { (pg_sys::LockTimeout, pg_sys::XactReadOnly) };
    // SAFETY: as above; lock_timeout's range is an int of milliseconds.
    unsafe {
        pg_sys::LockTimeout = wait_ms.min(i32::MAX as u64) as i32;
        pg_sys::XactReadOnly = false;
    }
    let end = |commit: bool| {
        // SAFETY: ends the subtransaction begun above, which is the current one: nothing in
        // between begins another without ending it. A caught error's state was flushed when
        // it was caught.
        unsafe {
            if commit {
                pg_sys::ReleaseCurrentSubTransaction();
            } else {
                pg_sys::RollbackAndReleaseCurrentSubTransaction();
            }
            pg_sys::MemoryContextSwitchTo(cxt);
            pg_sys::CurrentResourceOwner = owner;
        }
    };
    let taken = pgrx::PgTryBuilder::new(|| {
        // SAFETY: a relation lock of the current (sub)transaction.
        unsafe { pg_sys::LockRelationOid(relid, pg_sys::ExclusiveLock as pg_sys::LOCKMODE) };
        crate::regions::spi::run_with("UPDATE multiregion.turn SET taken = taken + 1", vec![]);
        Ok(())
    })
    .catch_when(pgrx::PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE, |_| {
        Err(MrError::TurnBusy { wait_ms })
    })
    .catch_when(
        pgrx::PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
        |e| match &e {
            pgrx::pg_sys::panic::CaughtError::PostgresError(r)
                if r.message().contains("concurrent update") =>
            {
                Err(MrError::TurnTaken)
            }
            _ => {
                end(false);
                e.rethrow()
            }
        },
    )
    .catch_others(|e| {
        end(false);
        e.rethrow()
    })
    // SAFETY: as above.
    .finally(|| unsafe {
        pg_sys::LockTimeout = timeout;
        pg_sys::XactReadOnly = read_only;
    })
    .execute();
    end(taken.is_ok());
    taken
}

/// Takes `node`'s turn in this transaction's session there, by a step of its own.
fn take_turn_there(node: u64, wait_ms: u64) -> Result<(), MrError> {
    let open = OPEN_SUBS.with(|o| o.borrow().clone());
    let req = REMOTE.with(|r| {
        let mut r = r.borrow_mut();
        let r = r.iter_mut().find(|x| x.node == node)?;
        Some(ForwardRequest {
            session: r.session.clone(),
            backend_pid: backend_pid(),
            begin: None,
            savepoints: savepoints_to_send(r, &open),
            statement: None,
            finish: None,
            turn: Some(wait_ms),
        })
    });
    match req {
        Some(req) => sidecar::forward(node, req).map(|_| ()),
        None => Ok(()),
    }
}

/// Whether this step to `node` takes the turn there, as `take_turns` decided.
fn turn_for_step(node: u64) -> Option<u64> {
    TURN_NEXT.with(|t| {
        let mut t = t.borrow_mut();
        let at = t.iter().position(|&(n, _)| n == node)?;
        Some(t.remove(at).1)
    })
}

/// The savepoint operations to send with the next step to `r`: those pending, then a
/// savepoint for each of `open` it lacks.
fn savepoints_to_send(r: &mut RemoteTxn, open: &[u32]) -> Vec<SavepointOp> {
    let mut savepoints = std::mem::take(&mut r.pending);
    for id in open.iter().skip(r.savepoints.len()) {
        savepoints.push(SavepointOp::Savepoint(*id));
        r.savepoints.push(*id);
    }
    savepoints
}

/// The lock timeout for statements of a transaction with parts on several nodes: no
/// PostgreSQL sees a cycle of lock waits that spans nodes, so such waits end after
/// `multiregion.distributed_lock_timeout` (unless the session's own lock_timeout is shorter).
#[allow(unsafe_code)]
fn lock_timeout_for_parts() -> Option<u64> {
    // SAFETY: reads the lock_timeout setting's backing variable.
    gucs::distributed_lock_timeout(unsafe { pg_sys::LockTimeout })
}

/// The nodes this transaction has a session on.
pub fn remote_nodes() -> Vec<u64> {
    REMOTE.with(|r| r.borrow().iter().map(|x| x.node).collect())
}

/// The nodes where this transaction has changed rows (its parts there wrote): rows leased
/// there read anywhere else would miss those changes.
pub fn changed_on() -> Vec<u64> {
    REMOTE.with(|r| {
        r.borrow()
            .iter()
            .filter(|x| x.wrote && !x.keys_only)
            .map(|x| x.node)
            .collect()
    })
}

/// Whether this transaction runs statements on another node.
pub fn is_pinned() -> bool {
    REMOTE.with(|r| !r.borrow().is_empty())
}

/// Runs a statement: forwarded ones from their rows, the others through `run` (PostgreSQL's
/// own executor, or the previous hook).
///
/// # Safety
/// `qd` is a started QueryDesc; `run` executes it as `ExecutorRun` would.
#[allow(unsafe_code)]
pub unsafe fn executor_run(
    qd: *mut pg_sys::QueryDesc,
    direction: pg_sys::ScanDirection::Type,
    count: u64,
    run: impl FnOnce(),
) {
    let key = qd as usize;
    let node = FORWARDED.with(|f| f.borrow().get(&key).map(|x| x.node));
    let Some(node) = node else {
        struct Depth;
        impl Drop for Depth {
            fn drop(&mut self) {
                RUN_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
            }
        }
        RUN_DEPTH.with(|d| d.set(d.get() + 1));
        let _depth = Depth;
        match COLLECT.with(|c| c.borrow().get(&key).cloned()) {
            Some(c) => {
                let collecting = crate::moved::collect(c.refuse);
                // SAFETY: `qd` is started; its destination is valid until ExecutorEnd.
                let deferred = c
                    .tail
                    .returning
                    .is_some()
                    .then(|| unsafe { DeferredDest::new(qd) });
                run();
                let moved = collecting.finish();
                let (n, rows) = if moved.is_empty() {
                    (0, Vec::new())
                } else {
                    write_moved(moved, &c.tail).or_raise()
                };
                crate::ri::run_pending();
                if let Some(d) = deferred {
                    // SAFETY: the QueryDesc has run; its result descriptor is valid.
                    unsafe { d.finish(&rows) };
                }
                // SAFETY: the QueryDesc has run; its estate is valid until ExecutorEnd.
                unsafe { (*(*qd).estate).es_processed += n };
            }
            None => run(),
        }
        return;
    };
    struct Forwarding;
    impl Drop for Forwarding {
        fn drop(&mut self) {
            FORWARDING.with(|d| d.set(d.get().saturating_sub(1)));
        }
    }
    FORWARDING.with(|d| d.set(d.get() + 1));
    let _forwarding = Forwarding;
    // SAFETY: as this function's contract.
    unsafe { run_forwarded(&mut *qd, key, node, direction, count) }
}

#[allow(unsafe_code)]
unsafe fn run_forwarded(
    qd: &mut pg_sys::QueryDesc,
    key: usize,
    node: u64,
    direction: pg_sys::ScanDirection::Type,
    count: u64,
) {
    if direction == pg_sys::ScanDirection::NoMovementScanDirection {
        return;
    }
    if direction == pg_sys::ScanDirection::BackwardScanDirection {
        MrError::WriteNotServed {
            message: "a cursor over rows leased on another node cannot move backward".into(),
            hint: "Fetch forward only, or declare the cursor WITH HOLD on a node with replicas."
                .into(),
        }
        .raise();
    }
    let ran = FORWARDED.with(|f| f.borrow().get(&key).is_some_and(|x| x.rows.is_some()));
    if !ran {
        let shares = FORWARDED.with(|f| {
            f.borrow()
                .get(&key)
                .map(|x| x.shares.clone())
                .unwrap_or_default()
        });
        let (mut processed, mut rows, moved) = if shares.is_empty() {
            // SAFETY: `qd` is started: its statement, text and parameters are valid.
            unsafe { forward_statement(qd, node, Vec::new()) }.or_raise()
        } else {
            // SAFETY: as above.
            unsafe { run_shares(qd, shares) }.or_raise()
        };
        if !moved.is_empty() {
            // SAFETY: as above. The rows moved carry the statement's ON CONFLICT clause and
            // return its RETURNING list from where they are written, after the statement's
            // own rows. The node that ran it let them go, so both can travel.
            let tail = unsafe { tail_of(qd) }.unwrap_or_else(|why| {
                MrError::WriteNotServed {
                    message: format!(
                        "rows of this statement are leased on another node, and it {why}"
                    ),
                    hint: "Write each region's rows in their own statement.".into(),
                }
                .raise()
            });
            let (n, returned) = write_moved(moved, &tail).or_raise();
            processed += n;
            rows.extend(returned);
        }
        // Foreign key queries the leaseholders left for this node run next.
        crate::ri::run_pending();
        FORWARDED.with(|f| {
            if let Some(x) = f.borrow_mut().get_mut(&key) {
                x.rows = Some(rows);
                x.processed = processed;
            }
        });
    }
    // SAFETY: the destination is the started QueryDesc's. A holdable cursor persisted at
    // commit is rewound and run again into a tuplestore, which then skips the rows already
    // fetched: the rows start over for it.
    if unsafe { (*qd.dest).mydest } == pg_sys::CommandDest::DestTuplestore {
        FORWARDED.with(|f| {
            if let Some(x) = f.borrow_mut().get_mut(&key) {
                x.next = 0;
            }
        });
    }
    // SAFETY: the QueryDesc is started, so its estate, result descriptor and destination are
    // valid; the slot is made for that descriptor and dropped before returning; each row's
    // datums live in a context reset only after the destination has consumed the row. Calls
    // through the destination's function pointers are guarded, so an ERROR inside them
    // unwinds through Rust frames instead of jumping over them.
    unsafe {
        let ps = &*qd.plannedstmt;
        let send = qd.operation == pg_sys::CmdType::CMD_SELECT || ps.hasReturning;
        let dest = qd.dest;
        let estate = &mut *qd.estate;
        // A data-modifying CTE ran there; ExecutorFinish must not run it here too.
        estate.es_auxmodifytables = std::ptr::null_mut();
        let mut sent = 0u64;
        if send {
            if let Some(startup) = (*dest).rStartup {
                let op = qd.operation as i32;
                let td = qd.tupDesc;
                pg_sys::ffi::pg_guard_ffi_boundary(|| startup(dest, op, td));
            }
            let td = qd.tupDesc;
            let natts = (*td).natts as usize;
            let inputs = input_functions(td);
            let slot = pg_sys::MakeSingleTupleTableSlot(td, &pg_sys::TTSOpsVirtual);
            let mut cx = PgMemoryContexts::new("forwarded rows");
            loop {
                if count != 0 && sent >= count {
                    break;
                }
                let Some(row) = FORWARDED.with(|f| {
                    let mut f = f.borrow_mut();
                    let x = f.get_mut(&key)?;
                    let row = x.rows.as_ref()?.get(x.next)?.clone();
                    x.next += 1;
                    Some(row)
                }) else {
                    break;
                };
                if row.len() != natts {
                    MrError::Sidecar(format!(
                        "node {node} returned a row of {} columns for a result of {natts}",
                        row.len()
                    ))
                    .raise();
                }
                cx.switch_to(|_| fill_slot(slot, &inputs, &row));
                let more = match (*dest).receiveSlot {
                    Some(receive) => pg_sys::ffi::pg_guard_ffi_boundary(|| receive(slot, dest)),
                    None => true,
                };
                cx.reset();
                sent += 1;
                if !more {
                    break;
                }
            }
            pg_sys::ExecDropSingleTupleTableSlot(slot);
            if let Some(shutdown) = (*dest).rShutdown {
                pg_sys::ffi::pg_guard_ffi_boundary(|| shutdown(dest));
            }
            estate.es_processed = sent;
        } else {
            estate.es_processed =
                FORWARDED.with(|f| f.borrow().get(&key).map_or(0, |x| x.processed));
        }
    }
}

/// How deeply the statement starting now is nested in others' runs and finishes (0: a
/// top-level statement): a statement started by a trigger of one at level L is at L + 1.
pub fn executor_level() -> u32 {
    RUN_DEPTH.with(Cell::get) + FINISH_DEPTH.with(Cell::get)
}

/// A statement's ExecutorFinish begins (its AFTER triggers run in it).
pub fn executor_finishing() {
    FINISH_DEPTH.with(|d| d.set(d.get() + 1));
}

/// A statement's ExecutorFinish ended: at the end of a statement of this transaction's origin
/// that is not nested in another, the changes it made to global keys are applied at their key
/// tables' leaseholders.
pub fn executor_finished() {
    FINISH_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    if FINISH_DEPTH.with(Cell::get) == 0
        && RUN_DEPTH.with(Cell::get) == 0
        && FORWARDING.with(Cell::get) == 0
        && SERVING.with(Cell::get) == 0
    {
        // Deferred foreign key queries may change keys, and key changes defer checks.
        loop {
            crate::ri::run_pending();
            if !crate::global_keys::any_pending() {
                break;
            }
            apply_key_changes().or_raise();
        }
    }
}

/// Applies the global key changes recorded since the last statement, each key table's at its
/// leaseholder (here, or in this transaction's session there), as parts of this transaction.
pub fn apply_key_changes() -> Result<(), MrError> {
    for batch in crate::global_keys::take() {
        let json = serde_json::to_string(&batch)
            .map_err(|e| MrError::Sidecar(format!("key changes: {e}")))?;
        pgrx::debug1!("global key changes: {json}");
        let table = mr_meta::TableRef {
            database: database(),
            schema: batch.key_schema.clone(),
            table: batch.key_table.clone(),
        };
        let txn_nodes = REMOTE.with(|r| r.borrow().iter().map(|x| x.node).collect());
        let route = sidecar::route(
            database(),
            vec![(table, None)],
            true,
            true,
            false,
            txn_nodes,
        )?;
        let sql = "SELECT multiregion.apply_key_changes($1)".to_string();
        let params = vec![("pg_catalog.jsonb".to_string(), Some(json))];
        match route.forward_to {
            Some(node) => {
                if crate::regions::has_pending_schema_change() {
                    return Err(MrError::SchemaChangePending { node });
                }
                let statement = ForwardStatement {
                    sql,
                    params,
                    lock_timeout_ms: lock_timeout_for_parts(),
                    partitions: Vec::new(),
                    read_ranges: Vec::new(),
                    settings: Vec::new(),
                    role: None,
                    crosscheck: false,
                };
                send_step(node, statement, false, true)?;
            }
            None => {
                LOCAL_PART.with(|l| l.set(true));
                set_local_lock_timeout();
                let (types, vals): (Vec<String>, Vec<Option<String>>) = params.into_iter().unzip();
                exec_share(None, &sql, &types, &vals, &[], false);
            }
        }
    }
    Ok(())
}

/// After a statement: forgets what was kept for it.
pub fn executor_end(qd: *mut pg_sys::QueryDesc) {
    FORWARDED.with(|f| f.borrow_mut().remove(&(qd as usize)));
    COLLECT.with(|c| c.borrow_mut().remove(&(qd as usize)));
}

/// Runs a split statement's shares, each on its leaseholder over its partitions (this
/// node's own through SPI in this transaction, first; the others at once, so the statement
/// costs the farthest leaseholder's round trip, not the sum): their rows together, in share
/// order, the rows processed in all, and the rows they moved to other partitions (for the
/// caller to write).
///
/// # Safety
/// `qd` is a started QueryDesc.
#[allow(unsafe_code)]
unsafe fn run_shares(
    qd: &mut pg_sys::QueryDesc,
    shares: Vec<(Option<u64>, Vec<String>)>,
) -> Result<sidecar::ForwardedRows, MrError> {
    let mut results: Vec<Option<sidecar::ForwardedRows>> = Vec::new();
    let mut remote: Vec<(usize, ForwardRequest, Step)> = Vec::new();
    for (i, (node, partitions)) in shares.into_iter().enumerate() {
        results.push(None);
        match node {
            Some(node) => {
                // SAFETY: as this function's contract.
                let statement = unsafe { share_statement(qd, partitions) };
                let (req, step) = begin_step(node, statement, false, false)?;
                remote.push((i, req, step));
            }
            None => {
                // SAFETY: as this function's contract.
                let st = unsafe { statement_of(qd) };
                set_local_lock_timeout();
                let (types, vals): (Vec<String>, Vec<Option<String>>) =
                    st.params.into_iter().unzip();
                results[i] = Some(exec_share(
                    None,
                    &st.sql,
                    &types,
                    &vals,
                    &partitions,
                    st.crosscheck,
                ));
            }
        }
    }
    let (places, requests, steps): (Vec<usize>, Vec<(u64, ForwardRequest)>, Vec<Step>) =
        remote.into_iter().fold(
            (Vec::new(), Vec::new(), Vec::new()),
            |(mut p, mut r, mut s), (i, req, step)| {
                p.push(i);
                r.push((step.node, req));
                s.push(step);
                (p, r, s)
            },
        );
    let answers = match requests.len() {
        0 => Vec::new(),
        1 => {
            let (node, req) = requests.into_iter().next().expect("one request");
            vec![sidecar::forward(node, req)]
        }
        _ => sidecar::forward_each(requests)?,
    };
    // Every answer is taken in (a failed share's transaction is rolled back with the others
    // when this one aborts); the first failure is the statement's.
    let mut failed = None;
    for ((i, step), answer) in places.into_iter().zip(steps).zip(answers) {
        match answer {
            Ok(f) => results[i] = Some(end_step(step, f)),
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
    }
    if let Some(e) = failed {
        return Err(e);
    }
    let (mut processed, mut rows, mut moved) = (0u64, Vec::new(), Vec::new());
    for (n, mut r, mut m) in results.into_iter().flatten() {
        processed += n;
        rows.append(&mut r);
        moved.append(&mut m);
    }
    // Written by the caller once every share has run, so that no share sees (and changes
    // again) a row another share moved into its partitions, as one statement never sees its
    // own rows.
    Ok((processed, rows, moved))
}

/// This transaction's statements here wait for locks no longer than a distributed lock
/// timeout, as it has parts on other nodes.
fn set_local_lock_timeout() {
    if let Some(ms) = lock_timeout_for_parts() {
        crate::regions::spi::run_with(
            "SELECT pg_catalog.set_config('lock_timeout', $1, true)",
            vec![format!("{ms}ms").into()],
        );
    }
}

/// A `COPY … FROM … (FREEZE)` into a replicated table leased on another node, as a copy
/// without FREEZE; any other statement as it is. Its rows go to the leaseholder, which
/// inserts them as an INSERT does, and this node's copy of the table was not created or
/// truncated in this transaction (`pgbench -i` truncates, then copies with FREEZE: the
/// TRUNCATE ran at the leaseholder).
///
/// # Safety
/// `pstmt` is the valid PlannedStmt PostgreSQL is about to run; a changed one is a copy.
#[allow(unsafe_code)]
pub unsafe fn without_copy_freeze(pstmt: *mut pg_sys::PlannedStmt) -> *mut pg_sys::PlannedStmt {
    // SAFETY: the caller's contract; node tags are read before casts; list cells are the
    // options' DefElems.
    unsafe {
        let node = (*pstmt).utilityStmt;
        if node.is_null() || (*node).type_ != pg_sys::NodeTag::T_CopyStmt {
            return pstmt;
        }
        let copy = &*(node as *mut pg_sys::CopyStmt);
        let is_freeze = |d: *mut std::ffi::c_void| {
            let d = d as *mut pg_sys::DefElem;
            !d.is_null() && CStr::from_ptr((*d).defname).to_bytes() == b"freeze"
        };
        let options: Vec<*mut std::ffi::c_void> = if copy.options.is_null() {
            Vec::new()
        } else {
            (0..(*copy.options).length)
                .map(|i| pg_sys::list_nth(copy.options, i))
                .collect()
        };
        if !copy.is_from
            || copy.relation.is_null()
            || !options.iter().any(|o| is_freeze(*o))
            || gucs::sidecar_socket().is_none()
            || replication::known_off()
            || pg_sys::SessionReplicationRole == pg_sys::SESSION_REPLICATION_ROLE_REPLICA as i32
        {
            return pstmt;
        }
        let Some(relid) = crate::regions::catalog::relid_of(copy.relation) else {
            return pstmt;
        };
        if !replication::is_replicated_table(relid)
            || replication::range_of(relid).is_none_or(|r| crate::moved::leased_here(&r))
        {
            return pstmt;
        }
        let changed = pg_sys::copyObjectImpl(pstmt.cast()) as *mut pg_sys::PlannedStmt;
        let stmt = (*changed).utilityStmt as *mut pg_sys::CopyStmt;
        let mut kept: *mut pg_sys::List = std::ptr::null_mut();
        for i in 0..(*(*stmt).options).length {
            let o = pg_sys::list_nth((*stmt).options, i);
            if !is_freeze(o) {
                kept = pg_sys::lappend(kept, o);
            }
        }
        (*stmt).options = kept;
        changed
    }
}

/// Runs a utility statement; a `COPY … FROM` into a replicated table keeps the rows for
/// ranges this node does not lease out of its copy (`crate::moved`) and writes them at their
/// leaseholders afterwards, as parts of this transaction, as an INSERT's rows for other
/// regions are: so a COPY (`psql \copy`, `pgbench -i`) works through any node.
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run; `qc`, if not null, its completion.
#[allow(unsafe_code)]
pub unsafe fn copy_from(
    pstmt: &pg_sys::PlannedStmt,
    qc: *mut pg_sys::QueryCompletion,
    run: impl FnOnce(),
) {
    let node = pstmt.utilityStmt;
    // SAFETY: the utility statement of a valid PlannedStmt, its tag read before the cast;
    // reads a backend global (an applier, in replica mode, writes this node's copy).
    let copy_from = unsafe {
        !node.is_null()
            && (*node).type_ == pg_sys::NodeTag::T_CopyStmt
            && (*(node as *mut pg_sys::CopyStmt)).is_from
            && !(*(node as *mut pg_sys::CopyStmt)).relation.is_null()
            && pg_sys::SessionReplicationRole != pg_sys::SESSION_REPLICATION_ROLE_REPLICA as i32
    };
    if !copy_from
        || gucs::sidecar_socket().is_none()
        || replication::known_off()
        || replication::capture_suppressed()
    {
        run();
        return;
    }
    let collecting = crate::moved::collect_copy();
    // SAFETY: checked above to be a CopyStmt with a relation.
    if let Some(d) = unsafe { crate::sequences::copy_defaults(&*(node as *mut pg_sys::CopyStmt)) } {
        crate::moved::draw_defaults(d);
    }
    run();
    let moved = collecting.finish();
    if !moved.is_empty() {
        let (n, _) = write_moved(moved, &Tail::default()).or_raise();
        // SAFETY: the caller's contract: the statement's completion, filled in by COPY.
        unsafe {
            if !qc.is_null() {
                (*qc).nprocessed += n;
            }
        }
    }
}

/// Writes rows a statement left for partitions leased elsewhere at their leaseholders (or
/// here, where this node leases the partition), as parts of this transaction: the number of
/// rows written. Their global keys are applied with the statement's other key changes
/// (`crate::global_keys`), where a moved row's key released and taken again stays.
/// Each INSERT carries the statement's ON CONFLICT clause, and returns its RETURNING list
/// (the rows returned, as text), if it has them.
fn write_moved(
    moved: Vec<mr_wire::local::MovedRows>,
    tail: &Tail,
) -> Result<(u64, Vec<TextRow>), MrError> {
    let mut written = 0;
    let mut returned = Vec::new();
    for (m, json) in moved
        .iter()
        .flat_map(|m| crate::moved::rows_json(m).into_iter().map(move |j| (m, j)))
    {
        let mut sql = crate::moved::insert_sql(m, tail.alias.as_deref());
        if let Some(c) = &tail.on_conflict {
            sql.push(' ');
            sql.push_str(c);
        }
        if let Some(r) = &tail.returning {
            sql.push_str(" RETURNING ");
            sql.push_str(r);
        }
        let table = mr_meta::TableRef {
            database: database(),
            schema: m.schema.clone(),
            table: m.table.clone(),
        };
        let txn_nodes = REMOTE.with(|r| r.borrow().iter().map(|x| x.node).collect());
        let route = sidecar::route(
            database(),
            vec![(table, m.partition.clone())],
            true,
            true,
            false,
            txn_nodes,
        )?;
        let (n, rows, again) = match route.forward_to {
            Some(node) => {
                if crate::regions::has_pending_schema_change() {
                    return Err(MrError::SchemaChangePending { node });
                }
                let statement = ForwardStatement {
                    sql,
                    params: vec![("pg_catalog.json".into(), Some(json))],
                    lock_timeout_ms: lock_timeout_for_parts(),
                    partitions: Vec::new(),
                    read_ranges: Vec::new(),
                    settings: Vec::new(),
                    role: Some(current_role()),
                    crosscheck: false,
                };
                send(node, statement, false)?
            }
            None => {
                LOCAL_PART.with(|l| l.set(true));
                set_local_lock_timeout();
                exec_share(
                    None,
                    &sql,
                    &["pg_catalog.json".into()],
                    &[Some(json)],
                    &[],
                    false,
                )
            }
        };
        if !again.is_empty() {
            return Err(MrError::WriteNotServed {
                message: match &m.partition {
                    Some(p) => format!(
                        "the lease of partition {p} of {}.{} moved while rows were written to it",
                        m.schema, m.table
                    ),
                    None => format!(
                        "the lease of {}.{} moved while rows were written to it",
                        m.schema, m.table
                    ),
                },
                hint: "Retry the transaction.".into(),
            });
        }
        written += n;
        returned.extend(rows);
    }
    Ok((written, returned))
}

/// Sends the statement of `qd` to `node` (over `partitions` of its target only, when not
/// empty), beginning the remote transaction if needed.
///
/// # Safety
/// `qd` is a started QueryDesc.
#[allow(unsafe_code)]
unsafe fn forward_statement(
    qd: &mut pg_sys::QueryDesc,
    node: u64,
    partitions: Vec<String>,
) -> Result<sidecar::ForwardedRows, MrError> {
    // SAFETY: as this function's contract.
    let statement = unsafe { share_statement(qd, partitions) };
    let depth = RUN_DEPTH.with(Cell::get);
    // SAFETY: reads backend globals and the destination's kind.
    let autocommit = unsafe {
        !pg_sys::IsTransactionBlock()
            && depth == 0
            && match (*qd.dest).mydest {
                pg_sys::CommandDest::DestRemote => true,
                // An extended-protocol Execute: a SELECT's rows go to the client, a DML's
                // nowhere (PortalRunMulti), RETURNING's to the portal's store first.
                pg_sys::CommandDest::DestRemoteExecute
                | pg_sys::CommandDest::DestNone
                | pg_sys::CommandDest::DestTuplestore => portal_is(qd) && sync_is_next(),
                _ => false,
            }
    };
    // A split statement's share, or one that may leave rows for other leaseholders, is never
    // the whole transaction.
    // Nor is one that may change global keys: those are applied after it, by this node.
    let whole = statement.partitions.is_empty()
        && !FORWARDED.with(|f| {
            f.borrow()
                .get(&(qd as *mut pg_sys::QueryDesc as usize))
                .is_some_and(|x| x.may_move)
        })
        // SAFETY: as this function's contract.
        && !unsafe { crate::global_keys::may_change_keys(qd) };
    send(node, statement, autocommit && whole)
}

/// Whether `qd` runs the one statement of the portal being run (not one of several that a
/// rule made of it, which must commit together; not a statement run inside another).
///
/// # Safety
/// `qd` is a started QueryDesc.
#[allow(unsafe_code)]
unsafe fn portal_is(qd: &pg_sys::QueryDesc) -> bool {
    // SAFETY: `ActivePortal` is this backend's, valid while it runs (or NULL); its statement
    // list is a List of PlannedStmt.
    unsafe {
        let portal = pg_sys::ActivePortal;
        if portal.is_null() || (*portal).stmts.is_null() || (*(*portal).stmts).length != 1 {
            return false;
        }
        let only = pg_sys::list_nth((*portal).stmts, 0).cast::<pg_sys::PlannedStmt>();
        std::ptr::eq(only, qd.plannedstmt)
    }
}

/// Whether the client's next protocol message, already received, is Sync: then the statement
/// of this Execute is the whole of its implicit transaction (the extended protocol commits
/// at Sync), so it can commit where it is forwarded in the same message instead of a second
/// round trip at Sync. Drivers send Bind, Execute and Sync together, so the Sync is normally
/// in the receive buffer already; when it is not (a slower client, TLS buffering), the answer
/// is no, which only costs that round trip. Never blocks: peeks only at buffered bytes.
fn sync_is_next() -> bool {
    // libpq/libpq.h, which pgrx's bindings leave out: exported by the postgres binary. Not
    // guarded: called only where they cannot raise an error (checked below).
    #[allow(unsafe_code)]
    unsafe extern "C" {
        fn pq_is_reading_msg() -> bool;
        fn pq_buffer_has_data() -> bool;
        fn pq_startmsgread();
        fn pq_peekbyte() -> std::ffi::c_int;
        fn pq_endmsgread();
    }
    // SAFETY: pqcomm's receive buffer belongs to this backend, which is between messages
    // (executing an Execute, so not reading one: checked). `pq_peekbyte` reads the buffered
    // next byte without consuming it, and does not block because `pq_buffer_has_data` says
    // a byte is there; the start/end pair is how PostgreSQL itself marks a message read, so
    // its assertions hold, and nothing is consumed.
    #[allow(unsafe_code)]
    unsafe {
        let output = pg_sys::whereToSendOutput;
        if output != pg_sys::CommandDest::DestRemote || pq_is_reading_msg() || !pq_buffer_has_data()
        {
            return false;
        }
        pq_startmsgread();
        let next = pq_peekbyte();
        pq_endmsgread();
        next == i32::from(b'S')
    }
}

/// The statement as it is sent to another node, over `partitions` of its target (all of
/// them when empty), with its lock timeout there.
///
/// # Safety
/// `qd` is a started QueryDesc.
#[allow(unsafe_code)]
unsafe fn share_statement(qd: &mut pg_sys::QueryDesc, partitions: Vec<String>) -> ForwardStatement {
    // SAFETY: as this function's contract.
    let mut statement = unsafe { statement_of(qd) };
    FORWARDED.with(|f| {
        if let Some(x) = f.borrow().get(&(qd as *mut pg_sys::QueryDesc as usize)) {
            statement.lock_timeout_ms = x.lock_timeout_ms;
            if !partitions.is_empty() {
                statement.read_ranges = x.read_ranges.clone();
            }
        }
    });
    statement.partitions = partitions;
    statement
}

/// Sends one statement to `node` in this transaction's session there, beginning it if
/// needed; with `autocommit`, and no other part, it commits there in the same message.
fn send(
    node: u64,
    statement: ForwardStatement,
    autocommit: bool,
) -> Result<sidecar::ForwardedRows, MrError> {
    send_step(node, statement, autocommit, false)
}

/// [`send`], for global key changes when `keys_only`.
fn send_step(
    node: u64,
    statement: ForwardStatement,
    autocommit: bool,
    keys_only: bool,
) -> Result<sidecar::ForwardedRows, MrError> {
    let (req, step) = begin_step(node, statement, autocommit, keys_only)?;
    let f = sidecar::forward(node, req)?;
    Ok(end_step(step, f))
}

/// A step sent to another node, for [`end_step`] once it answered.
struct Step {
    node: u64,
    session: String,
    sent_commit: bool,
    open: Vec<u32>,
    keys_only: bool,
}

/// The request that sends `statement` to `node` in this transaction's session there
/// (beginning it if needed; with `autocommit`, and no other part, it commits there in the same
/// message). A new session is recorded before it is sent: if the answer is lost, the abort
/// still rolls it back.
#[allow(unsafe_code)]
fn begin_step(
    node: u64,
    mut statement: ForwardStatement,
    autocommit: bool,
    keys_only: bool,
) -> Result<(ForwardRequest, Step), MrError> {
    let open = OPEN_SUBS.with(|o| o.borrow().clone());
    let existing = REMOTE.with(|r| r.borrow().iter().position(|x| x.node == node));
    let (req, pin) = if let Some(i) = existing {
        let now = forwarded_settings();
        let req = REMOTE.with(|r| {
            let mut r = r.borrow_mut();
            let r = &mut r[i];
            // The settings that changed here since the remote transaction last had them
            // (a function's SET clause, a SET LOCAL) go with the statement.
            statement.settings = now
                .iter()
                .filter(|s| !r.settings.contains(s))
                .cloned()
                .collect();
            r.settings = now;
            r.keys_only &= keys_only;
            ForwardRequest {
                session: r.session.clone(),
                backend_pid: backend_pid(),
                begin: None,
                savepoints: savepoints_to_send(r, &open),
                statement: Some(statement),
                finish: None,
                turn: turn_for_step(node),
            }
        });
        (req, None)
    } else {
        // One message when this statement is the whole transaction.
        let autocommit = autocommit && !is_pinned() && !replication::has_local_changes();
        let session = new_session();
        // SAFETY: inside a transaction.
        let begin = unsafe { begin_info() }?;
        let settings = begin.settings.clone();
        let req = ForwardRequest {
            session: session.clone(),
            backend_pid: backend_pid(),
            begin: Some(begin),
            savepoints: open.iter().map(|id| SavepointOp::Savepoint(*id)).collect(),
            statement: Some(statement),
            finish: autocommit.then_some(Finish::Commit),
            turn: turn_for_step(node),
        };
        let pin = (!autocommit).then(|| RemoteTxn {
            node,
            session,
            savepoints: open.clone(),
            pending: Vec::new(),
            keys_only,
            wrote: false,
            settings,
        });
        (req, pin)
    };
    if let Some(pin) = pin {
        REMOTE.with(|r| r.borrow_mut().push(pin));
    }
    let step = Step {
        node,
        session: req.session.clone(),
        sent_commit: req.finish == Some(Finish::Commit),
        open,
        keys_only,
    };
    Ok((req, step))
}

/// Takes in what a step's answer says of the transaction (global key changes, whether the
/// part wrote, referential queries left for this node); its rows.
fn end_step(step: Step, f: sidecar::Forwarded) -> sidecar::ForwardedRows {
    let Step {
        node,
        session,
        sent_commit,
        open,
        keys_only,
    } = step;
    crate::global_keys::returned(f.keys);
    REMOTE.with(|r| {
        if let Some(x) = r.borrow_mut().iter_mut().find(|x| x.session == session) {
            x.wrote |= f.wrote;
        }
    });
    if sent_commit && !f.deferred.is_empty() {
        // Its referential queries must run first: the part did not commit, and commits
        // with this transaction.
        REMOTE.with(|r| {
            r.borrow_mut().push(RemoteTxn {
                node,
                session,
                savepoints: open,
                pending: Vec::new(),
                keys_only,
                wrote: f.wrote,
                settings: Vec::new(),
            })
        });
    }
    crate::ri::returned(f.deferred);
    f.rows
}

/// Runs `sql` (text parameters) on `node` in this transaction's session there, which ends
/// with this transaction.
pub fn run_on(node: u64, sql: &str, params: Vec<Option<String>>) -> Result<(), MrError> {
    let statement = ForwardStatement {
        sql: sql.to_string(),
        params: params
            .into_iter()
            .map(|p| ("text".to_string(), p))
            .collect(),
        lock_timeout_ms: None,
        partitions: Vec::new(),
        read_ranges: Vec::new(),
        settings: Vec::new(),
        role: None,
        crosscheck: false,
    };
    send(node, statement, false)?;
    // A TRUNCATE there, or a schema change's lock: either commits with this transaction,
    // before its schema change is awaited on every node (a lock kept past that would hold
    // up the change's own application there).
    REMOTE.with(|r| {
        if let Some(x) = r.borrow_mut().iter_mut().find(|x| x.node == node) {
            x.wrote = true;
        }
    });
    crate::ri::run_pending();
    Ok(())
}

/// Whether this backend is running a statement served for another node's transaction, or
/// its own share of a statement split over leaseholders ([`serving_remote`] tells them
/// apart).
pub fn serving() -> bool {
    SERVING.with(Cell::get) > 0
}

/// Whether the statement served is another node's transaction's: this transaction's commit
/// is then that node's to make.
pub fn serving_remote() -> bool {
    SERVING_REMOTE.with(Cell::get) > 0
}

/// What the rows `qd`'s INSERT or UPDATE writes at other nodes carry of it ([`Tail`]), or
/// why they cannot: see [`portable_tail`].
///
/// # Safety
/// `qd` is a started QueryDesc.
#[allow(unsafe_code)]
unsafe fn tail_of(qd: &pg_sys::QueryDesc) -> Result<Tail, &'static str> {
    // SAFETY: as this function's contract.
    let sql = unsafe { statement_of(qd) }.sql;
    // A statement whose text cannot be parsed alone here is refused as its clauses would be.
    // SAFETY: the plan's top node is read by tag before the cast.
    let why = unsafe {
        let mt = (*qd.plannedstmt).planTree as *mut pg_sys::ModifyTable;
        if !mt.is_null()
            && (*mt).plan.type_ == pg_sys::NodeTag::T_ModifyTable
            && (*mt).onConflictAction != pg_sys::OnConflictAction::ONCONFLICT_NONE
        {
            ON_CONFLICT
        } else {
            RETURNING
        }
    };
    let c = CString::new(sql.as_str()).map_err(|_| why)?;
    // SAFETY: the raw parse tree of the statement's own text, read by node tag.
    unsafe {
        let parsed = pg_sys::raw_parser(c.as_ptr(), pg_sys::RawParseMode::RAW_PARSE_DEFAULT);
        if parsed.is_null() || (*parsed).length != 1 {
            return Err(why);
        }
        let stmt = (*(pg_sys::list_nth(parsed, 0) as *mut pg_sys::RawStmt)).stmt;
        portable_tail(stmt, &sql)
    }
}

/// The ON CONFLICT clause and RETURNING list of raw INSERT or UPDATE `stmt` (parsed from
/// `sql`) as their text, if the rows it writes at other nodes can carry them there: neither
/// uses a parameter (the INSERT there has its own), and the list names only the target table
/// (an UPDATE with FROM may name others). Otherwise why not.
///
/// # Safety
/// `stmt` is a raw parse tree node parsed from `sql` (its locations are offsets into it).
#[allow(unsafe_code)]
unsafe fn portable_tail(stmt: *mut pg_sys::Node, sql: &str) -> Result<Tail, &'static str> {
    // SAFETY: as this function's contract; nodes are read by tag before casts.
    unsafe {
        let (list, relation, on_conflict) = match (*stmt).type_ {
            pg_sys::NodeTag::T_InsertStmt => {
                let i = &*(stmt as *mut pg_sys::InsertStmt);
                (i.returningList, i.relation, i.onConflictClause)
            }
            pg_sys::NodeTag::T_UpdateStmt => {
                let u = &*(stmt as *mut pg_sys::UpdateStmt);
                if !u.fromClause.is_null() && !u.returningList.is_null() {
                    return Err(RETURNING);
                }
                (u.returningList, u.relation, std::ptr::null_mut())
            }
            _ => return Err(RETURNING),
        };
        let returning_at = if list.is_null() || (*list).length == 0 {
            None
        } else {
            let first = pg_sys::list_nth(list, 0) as *mut pg_sys::ResTarget;
            Some(usize::try_from((*first).location).map_err(|_| RETURNING)?)
        };
        let returning = match returning_at {
            None => None,
            Some(at) => {
                let text = sql.get(at..).ok_or(RETURNING)?;
                let text = text.trim_end().trim_end_matches(';').trim_end();
                if text.is_empty() || text.contains('$') {
                    return Err(RETURNING);
                }
                Some(text.to_string())
            }
        };
        let on_conflict = if on_conflict.is_null() {
            None
        } else {
            let at = usize::try_from((*on_conflict).location).map_err(|_| ON_CONFLICT)?;
            let text = mr_sql::on_conflict_clause(sql, at, returning_at).ok_or(ON_CONFLICT)?;
            Some(text.to_string())
        };
        let alias = (!relation.is_null() && !(*relation).alias.is_null()).then(|| {
            CStr::from_ptr((*(*relation).alias).aliasname)
                .to_string_lossy()
                .into_owned()
        });
        Ok(Tail {
            on_conflict,
            returning,
            alias,
        })
    }
}

/// A statement's destination with its end put off: the rows a statement wrote at other
/// nodes return their RETURNING rows after the statement has run here, and are sent to the
/// same destination before it is shut down ([`DeferredDest::finish`]).
#[repr(C)]
struct DeferredReceiver {
    /// First, so that a pointer to this is a `DestReceiver` pointer.
    base: pg_sys::DestReceiver,
    real: *mut pg_sys::DestReceiver,
    started: bool,
}

#[pg_guard]
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn deferred_startup(
    d: *mut pg_sys::DestReceiver,
    operation: std::ffi::c_int,
    td: pg_sys::TupleDesc,
) {
    // SAFETY: `d` is a DeferredReceiver (its `base` first); `real` is the statement's valid
    // destination; the call is guarded so an ERROR unwinds through this frame.
    unsafe {
        let p = d as *mut DeferredReceiver;
        let real = (*p).real;
        if let Some(f) = (*real).rStartup {
            pg_sys::ffi::pg_guard_ffi_boundary(|| f(real, operation, td));
        }
        (*p).started = true;
    }
}

#[pg_guard]
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn deferred_receive(
    slot: *mut pg_sys::TupleTableSlot,
    d: *mut pg_sys::DestReceiver,
) -> bool {
    // SAFETY: as `deferred_startup`.
    unsafe {
        let real = (*(d as *mut DeferredReceiver)).real;
        match (*real).receiveSlot {
            Some(f) => pg_sys::ffi::pg_guard_ffi_boundary(|| f(slot, real)),
            None => true,
        }
    }
}

/// The end comes later, from [`DeferredDest::finish`].
#[pg_guard]
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn deferred_nothing(_d: *mut pg_sys::DestReceiver) {}

/// `qd`'s destination replaced by a [`DeferredReceiver`] until [`DeferredDest::finish`] (or
/// its drop, after an ERROR, which puts the real one back and leaves it as the ERROR does).
struct DeferredDest {
    qd: *mut pg_sys::QueryDesc,
    receiver: *mut DeferredReceiver,
}

impl DeferredDest {
    /// # Safety
    /// `qd` is a started QueryDesc whose destination is valid until ExecutorEnd.
    #[allow(unsafe_code)]
    unsafe fn new(qd: *mut pg_sys::QueryDesc) -> DeferredDest {
        // SAFETY: the receiver lives in the current memory context, which outlives the
        // statement's run; it is fully initialized before the executor sees it.
        unsafe {
            let receiver =
                pg_sys::palloc0(std::mem::size_of::<DeferredReceiver>()) as *mut DeferredReceiver;
            let real = (*qd).dest;
            (*receiver).base = pg_sys::DestReceiver {
                receiveSlot: Some(deferred_receive),
                rStartup: Some(deferred_startup),
                rShutdown: Some(deferred_nothing),
                rDestroy: Some(deferred_nothing),
                mydest: (*real).mydest,
            };
            (*receiver).real = real;
            (*receiver).started = false;
            (*qd).dest = receiver as *mut pg_sys::DestReceiver;
            DeferredDest { qd, receiver }
        }
    }

    /// Sends `rows` (text, in the statement's result columns) to the real destination, ends
    /// it, and puts it back in the QueryDesc.
    ///
    /// # Safety
    /// The QueryDesc has run; its result descriptor is valid.
    #[allow(unsafe_code)]
    unsafe fn finish(self, rows: &[TextRow]) {
        // SAFETY: as this function's contract; the slot is made for the result descriptor and
        // dropped before returning; datums live in a context reset after each row is sent.
        unsafe {
            let real = (*self.receiver).real;
            if (*self.receiver).started {
                let td = (*self.qd).tupDesc;
                let slot = pg_sys::MakeSingleTupleTableSlot(td, &pg_sys::TTSOpsVirtual);
                let inputs = input_functions(td);
                let mut cx = PgMemoryContexts::new("rows returned from other nodes");
                for row in rows {
                    if row.len() != inputs.len() {
                        MrError::Sidecar(format!(
                            "a leaseholder returned a row of {} columns for a result of {}",
                            row.len(),
                            inputs.len()
                        ))
                        .raise();
                    }
                    cx.switch_to(|_| fill_slot(slot, &inputs, row));
                    let more = match (*real).receiveSlot {
                        Some(f) => pg_sys::ffi::pg_guard_ffi_boundary(|| f(slot, real)),
                        None => true,
                    };
                    cx.reset();
                    if !more {
                        break;
                    }
                }
                pg_sys::ExecDropSingleTupleTableSlot(slot);
                if let Some(f) = (*real).rShutdown {
                    pg_sys::ffi::pg_guard_ffi_boundary(|| f(real));
                }
            }
        }
        // `drop` puts the real destination back.
    }
}

impl Drop for DeferredDest {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // SAFETY: the QueryDesc outlives this value (both belong to one executor run).
        unsafe { (*self.qd).dest = (*self.receiver).real };
    }
}

/// Each result column's input function, I/O parameter and typmod, and whether it is dropped.
///
/// # Safety
/// `td` is a valid tuple descriptor.
#[allow(unsafe_code)]
unsafe fn input_functions(td: pg_sys::TupleDesc) -> Vec<(pg_sys::Oid, pg_sys::Oid, i32, bool)> {
    // SAFETY: as this function's contract.
    unsafe {
        let natts = (*td).natts as usize;
        let attrs = (*td).attrs.as_slice(natts);
        let mut inputs = Vec::with_capacity(natts);
        for a in attrs {
            let (mut func, mut ioparam) = (pg_sys::InvalidOid, pg_sys::InvalidOid);
            if !a.attisdropped {
                pg_sys::getTypeInputInfo(a.atttypid, &mut func, &mut ioparam);
            }
            inputs.push((func, ioparam, a.atttypmod, a.attisdropped));
        }
        inputs
    }
}

/// Fills `slot` (cleared first) with `row`'s text values through `inputs` and stores it.
///
/// # Safety
/// `slot` is a virtual slot of the descriptor `inputs` was made from, with as many columns
/// as `row`.
#[allow(unsafe_code)]
unsafe fn fill_slot(
    slot: *mut pg_sys::TupleTableSlot,
    inputs: &[(pg_sys::Oid, pg_sys::Oid, i32, bool)],
    row: &[Option<String>],
) {
    // SAFETY: as this function's contract.
    unsafe {
        if let Some(clear) = (*(*slot).tts_ops).clear {
            clear(slot);
        }
        for (i, &(func, ioparam, typmod, dropped)) in inputs.iter().enumerate() {
            match row.get(i).cloned().flatten() {
                Some(text) if !dropped => {
                    let c = CString::new(text).unwrap_or_default();
                    *(*slot).tts_values.add(i) =
                        pg_sys::OidInputFunctionCall(func, c.as_ptr() as *mut _, ioparam, typmod);
                    *(*slot).tts_isnull.add(i) = false;
                }
                _ => {
                    *(*slot).tts_values.add(i) = pg_sys::Datum::from(0);
                    *(*slot).tts_isnull.add(i) = true;
                }
            }
        }
        pg_sys::ExecStoreVirtualTuple(slot);
    }
}

/// A utility statement's own text (one statement of a multi-statement string).
///
/// # Safety
/// `pstmt` is a valid PlannedStmt and `source` its NUL-terminated source text (or null).
#[allow(unsafe_code)]
pub unsafe fn statement_text(
    pstmt: &pg_sys::PlannedStmt,
    source: *const std::ffi::c_char,
) -> String {
    // SAFETY: the caller's contract; the location and length are byte offsets set by the
    // parser (-1 and 0 mean "all" and "to the end").
    let text = if source.is_null() {
        ""
    } else {
        unsafe { CStr::from_ptr(source) }.to_str().unwrap_or("")
    };
    let start = usize::try_from(pstmt.stmt_location)
        .unwrap_or(0)
        .min(text.len());
    let end = match usize::try_from(pstmt.stmt_len) {
        Ok(0) | Err(_) => text.len(),
        Ok(n) => (start + n).min(text.len()),
    };
    text.get(start..end).unwrap_or(text).to_string()
}

/// The statement's own text: one statement of a multi-statement string; for EXECUTE of a
/// prepared statement, the PREPARE's inner statement; for a cursor, the DECLARE's query; for
/// CREATE TABLE AS, SELECT INTO and `COPY (…) TO`, their query ([`mr_sql::query_of`]).
///
/// # Safety
/// `qd` is a started (or starting) QueryDesc.
#[allow(unsafe_code)]
pub unsafe fn statement_sql(qd: &pg_sys::QueryDesc) -> String {
    // SAFETY: the source text is NUL-terminated and outlives the query; the location and
    // length are byte offsets into it set by the parser (-1 and 0 mean "all" and "to the
    // end").
    unsafe {
        let ps = &*qd.plannedstmt;
        let text = if qd.sourceText.is_null() {
            ""
        } else {
            CStr::from_ptr(qd.sourceText).to_str().unwrap_or("")
        };
        let start = usize::try_from(ps.stmt_location)
            .unwrap_or(0)
            .min(text.len());
        let end = match usize::try_from(ps.stmt_len) {
            Ok(0) | Err(_) => text.len(),
            Ok(n) => (start + n).min(text.len()),
        };
        let sql = text.get(start..end).unwrap_or(text);
        mr_sql::query_of(sql).map_or_else(|| sql.to_string(), |q| q.into_owned())
    }
}

/// The raw parse tree of `sql` if it is a statement another node runs as a forwarded one:
/// exactly one SELECT (without INTO), INSERT, UPDATE, DELETE or TRUNCATE; null otherwise.
/// EXPLAIN ANALYZE and CREATE MATERIALIZED VIEW plan to a query too, but their text is not
/// it (CREATE TABLE AS, SELECT INTO and `COPY (…) TO` are given by their query's, see
/// [`statement_sql`]).
///
/// # Safety
/// Called in a transaction (the tree is palloc'd in the current memory context).
#[allow(unsafe_code)]
pub unsafe fn sendable_stmt(sql: &CStr) -> *mut pg_sys::Node {
    use pg_sys::NodeTag::*;
    // SAFETY: PostgreSQL's raw parser over a NUL-terminated string; it raises only on a
    // syntax error (through pgrx's guard), and its list holds RawStmt nodes.
    unsafe {
        let parsed = pg_sys::raw_parser(sql.as_ptr(), pg_sys::RawParseMode::RAW_PARSE_DEFAULT);
        if parsed.is_null() || (*parsed).length != 1 {
            return std::ptr::null_mut();
        }
        let stmt = (*(pg_sys::list_nth(parsed, 0) as *mut pg_sys::RawStmt)).stmt;
        // A SELECT … INTO creates a table: the node running it would create it again.
        let into = !stmt.is_null()
            && (*stmt).type_ == T_SelectStmt
            && !(*(stmt as *mut pg_sys::SelectStmt)).intoClause.is_null();
        if !stmt.is_null()
            && !into
            && matches!(
                (*stmt).type_,
                T_SelectStmt | T_InsertStmt | T_UpdateStmt | T_DeleteStmt | T_TruncateStmt
            )
        {
            stmt
        } else {
            std::ptr::null_mut()
        }
    }
}

/// Refuses a statement that must run on `node` (whole, or a share of it) when its text
/// cannot be sent there ([`sendable_tag`]): the node would refuse it, in words about a
/// forwarded statement the user never wrote.
///
/// # Safety
/// `qd` is a QueryDesc about to start.
#[allow(unsafe_code)]
unsafe fn refuse_unsendable(qd: &pg_sys::QueryDesc, node: u64) {
    // SAFETY: as this function's contract.
    let sql = CString::new(unsafe { statement_sql(qd) }).unwrap_or_default();
    // SAFETY: in the statement's transaction.
    if unsafe { sendable_stmt(&sql) }.is_null() {
        MrError::WriteNotServed {
            message: format!(
                "this statement reads rows it must read on node {node}, and only a SELECT, INSERT, UPDATE, DELETE, TRUNCATE or the query of a CREATE TABLE AS, SELECT INTO or COPY (query) TO can be sent there (not EXPLAIN ANALYZE, nor a materialized view's query)"
            ),
            hint: "Run the query on its own, or run the statement on a node listed in voting_replicas or non_voting_replicas of multiregion.ranges for every table it reads.".into(),
        }
        .raise();
    }
}

/// The statement's own text ([`statement_sql`]) and parameters.
///
/// # Safety
/// `qd` is a started QueryDesc.
#[allow(unsafe_code)]
unsafe fn statement_of(qd: &pg_sys::QueryDesc) -> ForwardStatement {
    // SAFETY: as [`statement_sql`]; parameters are read through their fetch hook when one is
    // set, as the executor does.
    unsafe {
        let sql = statement_sql(qd);
        let mut params = Vec::new();
        let pl = qd.params;
        if !pl.is_null() {
            let n = (*pl).numParams.max(0) as usize;
            for i in 0..n {
                let mut workspace = pg_sys::ParamExternData::default();
                let p: *const pg_sys::ParamExternData = match (*pl).paramFetch {
                    Some(fetch) => pg_sys::ffi::pg_guard_ffi_boundary(|| {
                        fetch(pl, i as i32 + 1, false, &mut workspace)
                    }),
                    None => (*pl).params.as_ptr().add(i),
                };
                if p.is_null() || (*p).ptype == pg_sys::InvalidOid {
                    params.push(("unknown".to_string(), None));
                    continue;
                }
                let typ = CStr::from_ptr(pg_sys::format_type_extended(
                    (*p).ptype,
                    -1,
                    pg_sys::FORMAT_TYPE_FORCE_QUALIFY as u16,
                ))
                .to_string_lossy()
                .into_owned();
                let value = if (*p).isnull {
                    None
                } else {
                    let (mut out, mut varlena) = (pg_sys::InvalidOid, false);
                    pg_sys::getTypeOutputInfo((*p).ptype, &mut out, &mut varlena);
                    let s = pg_sys::OidOutputFunctionCall(out, (*p).value);
                    Some(CStr::from_ptr(s).to_string_lossy().into_owned())
                };
                params.push((typ, value));
            }
        }
        ForwardStatement {
            sql,
            params,
            lock_timeout_ms: None,
            partitions: Vec::new(),
            read_ranges: Vec::new(),
            settings: Vec::new(),
            role: Some(current_role()),
            // Set by `ri_PerformCheck` alone, for a query that must see rows committed since
            // the transaction's snapshot (REPEATABLE READ and SERIALIZABLE).
            crosscheck: !qd.crosscheck_snapshot.is_null(),
        }
    }
}

/// The role statements run as now (a SECURITY DEFINER function's owner inside it).
#[allow(unsafe_code)]
fn current_role() -> String {
    // SAFETY: GetUserNameFromId returns a palloc'd copy of the current user's name (it raises
    // if the role is gone, as any statement would); copied at once.
    unsafe {
        CStr::from_ptr(pg_sys::GetUserNameFromId(pg_sys::GetUserId(), false))
            .to_string_lossy()
            .into_owned()
    }
}

#[allow(unsafe_code)]
fn backend_pid() -> i32 {
    // SAFETY: MyProcPid is set once at backend start.
    unsafe { pg_sys::MyProcPid }
}

#[allow(unsafe_code)]
fn new_session() -> String {
    let seq = SESSION_SEQ.with(|s| {
        s.set(s.get() + 1);
        s.get()
    });
    // SAFETY: MyStartTime is set once at backend start.
    let started = unsafe { pg_sys::MyStartTime };
    format!("{}-{started}-{seq}", backend_pid())
}

/// The current values of the settings a forwarded statement's meaning depends on.
#[allow(unsafe_code)]
fn forwarded_settings() -> Vec<(String, String)> {
    let mut settings = Vec::new();
    for name in FORWARDED_SETTINGS {
        let c = CString::new(*name).expect("no NUL");
        // SAFETY: GetConfigOption returns NULL (missing_ok) or the setting's current value,
        // valid until it next changes; it is copied at once.
        unsafe {
            let v = pg_sys::GetConfigOption(c.as_ptr(), true, false);
            // Set only by a SET CONSTRAINTS, and not sent before: a node on an older
            // version of the extension does not know it.
            let unset = *name == "multiregion.constraint_modes"
                && !v.is_null()
                && *v == 0
                && !crate::ri::modes_set();
            if !v.is_null() && !unset {
                settings.push((
                    name.to_string(),
                    CStr::from_ptr(v).to_string_lossy().into_owned(),
                ));
            }
        }
    }
    settings
}

/// What the remote transaction needs to behave like this one.
///
/// # Safety
/// Called inside a transaction.
#[allow(unsafe_code)]
unsafe fn begin_info() -> Result<ForwardBegin, MrError> {
    // SAFETY: reads backend globals; the returned strings are copied at once.
    unsafe {
        let role = CStr::from_ptr(pg_sys::GetUserNameFromId(pg_sys::GetUserId(), false))
            .to_string_lossy()
            .into_owned();
        let isolation = match pg_sys::XactIsoLevel as u32 {
            pg_sys::XACT_SERIALIZABLE => Isolation::Serializable,
            pg_sys::XACT_REPEATABLE_READ => Isolation::RepeatableRead,
            _ => Isolation::ReadCommitted,
        };
        Ok(ForwardBegin {
            database: database(),
            role,
            isolation,
            read_only: pg_sys::XactReadOnly,
            settings: forwarded_settings(),
            gateway_region: gucs::locality()?.region().to_owned(),
            schema_version: crate::regions::catalog::load(false).1.max(0) as u64,
        })
    }
}

/// Transaction pre-commit: commits the transaction's parts on other nodes first; their
/// failure aborts this one. One remote part and no rows written here: its commit is this
/// transaction's. Otherwise two-phase commit, coordinated by this node's pgmr, with this
/// backend's own changes as one of the parts. Needs an active snapshot (SPI).
#[allow(unsafe_code)]
pub fn pre_commit() -> Result<(), MrError> {
    // Under REPEATABLE READ and SERIALIZABLE, every part of a transaction over several nodes
    // holds its node's turn until it commits (again after a rollback to a savepoint undid
    // one; an error here rolls every part back). Its part here, if any, is then one of the
    // commit's: it must not fail after the others committed, so PostgreSQL's serializable
    // check runs first.
    let parts = turn_parts();
    let turns = turns_at_commit();
    let turn_here = turns && parts.len() > 1 && parts.contains(&None);
    if turns {
        // A turn left for a step that was never sent is not held: taken now. (None is
        // known: a statement that took turns and did not run its steps failed, or was a
        // cursor, which cannot be sent to other nodes.)
        let unsent: Vec<u64> = TURN_NEXT.with(|t| t.borrow_mut().drain(..).map(|x| x.0).collect());
        TURNS.with(|t| {
            t.borrow_mut()
                .retain(|p| !p.is_some_and(|n| unsent.contains(&n)))
        });
        hold_turns(&parts, &[])?;
    }
    if turn_here {
        replication::serializable_pre_commit();
    }
    // SAFETY: reads a backend global.
    let read_committed = unsafe { pg_sys::XactIsoLevel < pg_sys::XACT_REPEATABLE_READ as i32 };
    // Under READ COMMITTED a part that only read and locked rows has nothing to commit: it
    // stays behind, to be rolled back once this transaction has committed (`at_end`), so
    // that its locks (a foreign key check's) last until the rows that needed them are
    // visible. Under REPEATABLE READ and SERIALIZABLE its commit may be what detects a
    // conflict: it commits with the others.
    let remotes = REMOTE.with(|r| {
        let mut r = r.borrow_mut();
        let (writers, readers): (Vec<RemoteTxn>, Vec<RemoteTxn>) = std::mem::take(&mut *r)
            .into_iter()
            .partition(|x| x.wrote || !read_committed);
        *r = readers;
        writers
    });
    let roll_back = |remotes: &[RemoteTxn]| {
        for r in remotes {
            let _ = finish(r, Finish::Rollback);
        }
    };

    match remotes.as_slice() {
        [] => return Ok(()),
        [one] if !replication::has_local_changes() && !turn_here => {
            return finish(one, Finish::Commit)
        }
        _ => {}
    }
    let local = match replication::take_write() {
        Ok(local) => local,
        Err(e) => {
            roll_back(&remotes);
            return Err(e);
        }
    };
    let participants = remotes
        .iter()
        .map(|r| Participant {
            node_id: r.node,
            session: r.session.clone(),
            savepoints: r.pending.clone(),
        })
        .collect();
    let req = LocalRequest::CommitDistributed {
        database: database(),
        gid: replication::txn_id(),
        backend_pid: backend_pid(),
        participants,
        local,
    };
    // pgmr rolls the parts back itself when the commit fails.
    match sidecar::commit_distributed(req)? {
        sidecar::Replication::Replicated { entries } => replication::set_replicated(entries),
        sidecar::Replication::Off => {}
    }
    Ok(())
}

fn finish(r: &RemoteTxn, how: Finish) -> Result<(), MrError> {
    let req = ForwardRequest {
        session: r.session.clone(),
        backend_pid: backend_pid(),
        begin: None,
        savepoints: r.pending.clone(),
        statement: None,
        finish: Some(how),
        turn: None,
    };
    sidecar::forward(r.node, req).map(|_| ())
}

/// Before PREPARE TRANSACTION: a transaction with a remote part cannot be prepared here.
pub fn pre_prepare() {
    if is_pinned() {
        MrError::PrepareReplicated.raise();
    }
}

/// Transaction end: an aborted transaction's remote part is rolled back (best effort: the
/// remote session also ends when this backend is gone).
pub fn at_end(aborted: bool) {
    crate::global_keys::at_end();
    crate::ri::reset();
    FINISH_DEPTH.with(|d| d.set(0));
    FORWARDING.with(|d| d.set(0));
    SUB_FINISH_DEPTH.with(|s| s.borrow_mut().clear());
    FORWARDED.with(|f| f.borrow_mut().clear());
    COLLECT.with(|c| c.borrow_mut().clear());
    OPEN_SUBS.with(|o| o.borrow_mut().clear());
    LOCAL_PART.with(|l| l.set(false));
    SNAPSHOT_HERE.with(|l| l.set(false));
    TURNS.with(|t| t.borrow_mut().clear());
    TURN_NEXT.with(|t| t.borrow_mut().clear());
    RUN_DEPTH.with(|d| d.set(0));
    // After a commit only the parts that read and locked rows are left (`pre_commit`):
    // rolled back too, which releases their locks.
    for r in REMOTE.with(|r| std::mem::take(&mut *r.borrow_mut())) {
        if aborted || !r.wrote {
            if let Err(e) = finish(&r, Finish::Rollback) {
                pgrx::warning!(
                    "could not roll back this transaction's part on node {}: {e}; it is rolled back when the node notices this backend is gone",
                    r.node
                );
            }
        }
    }
}

/// Mirrors subtransaction starts and ends onto the remote transaction's savepoints.
pub fn on_subxact(event: pg_sys::SubXactEvent::Type, my: pg_sys::SubTransactionId) {
    use pg_sys::SubXactEvent::*;
    match event {
        SUBXACT_EVENT_START_SUB => {
            OPEN_SUBS.with(|o| o.borrow_mut().push(my));
            let depth = FINISH_DEPTH.with(Cell::get);
            let runs = RUN_DEPTH.with(Cell::get);
            SUB_FINISH_DEPTH.with(|s| s.borrow_mut().push((my, depth, runs)));
        }
        SUBXACT_EVENT_COMMIT_SUB | SUBXACT_EVENT_ABORT_SUB => {
            OPEN_SUBS.with(|o| {
                let mut o = o.borrow_mut();
                if let Some(pos) = o.iter().position(|&s| s == my) {
                    o.truncate(pos);
                }
            });
            let abort = event == SUBXACT_EVENT_ABORT_SUB;
            let ended = SUB_FINISH_DEPTH.with(|s| {
                let mut s = s.borrow_mut();
                let at = s.iter().position(|(id, _, _)| *id == my);
                at.map(|i| s.split_off(i))
            });
            REMOTE.with(|r| {
                for r in r.borrow_mut().iter_mut() {
                    if let Some(pos) = r.savepoints.iter().position(|&s| s == my) {
                        if abort {
                            r.pending.push(SavepointOp::RollbackTo(my));
                            // It undoes the settings the subtransaction sent there.
                            r.settings.clear();
                        }
                        r.pending.push(SavepointOp::Release(my));
                        r.savepoints.truncate(pos);
                    }
                }
            });
            if abort {
                // Statements of the rolled-back subtransaction that never ended.
                match ended.as_ref().and_then(|e| e.first()) {
                    Some(&(_, depth, runs)) => {
                        FINISH_DEPTH.with(|d| d.set(depth));
                        RUN_DEPTH.with(|d| d.set(runs));
                    }
                    None => RUN_DEPTH.with(|d| d.set(0)),
                }
                crate::global_keys::sub_aborted(my);
                crate::ri::sub_aborted(my);
                // A turn taken in it is released: taken again before the next statement
                // elsewhere, or at commit.
                TURNS.with(|t| t.borrow_mut().clear());
                TURN_NEXT.with(|t| t.borrow_mut().clear());
            }
        }
        _ => {}
    }
}

/// The columns of `remote_exec()`, in order.
type RemoteExecRow = (
    i64,
    Option<Vec<Option<String>>>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<bool>,
);

/// Runs one statement forwarded by another node, as `role`, with `gateway_region()` answering
/// that node's region: its rows as text, each with the number of rows processed (one row
/// with a NULL `row` when it returns none), and on the first, as JSON, the rows it left for
/// partitions leased elsewhere (`crate::moved`), the changes it made to global keys
/// (`crate::global_keys`) and the referential queries it left for the origin (`crate::ri`),
/// and whether the transaction has changed replicated rows so far. With `partitions`, an UPDATE or DELETE changes
/// only rows of those partitions of its target (one share of a statement split over several
/// leaseholders). With `crosscheck`, it runs with the latest snapshot checked against the
/// transaction's, as the origin ran it (`ForwardStatement::crosscheck`). Only pgmr calls this
/// (EXECUTE is revoked from PUBLIC): the forwarding node vouches for the role over the
/// authenticated peer link.
#[pg_extern(schema = "multiregion")]
#[allow(unsafe_code, clippy::type_complexity)]
fn remote_exec(
    role: &str,
    gateway_region: &str,
    sql: &str,
    types: Vec<String>,
    vals: Vec<Option<String>>,
    partitions: default!(Vec<String>, "'{}'"),
    crosscheck: default!(bool, false),
) -> TableIterator<
    'static,
    (
        name!(processed, i64),
        name!(row, Option<Vec<Option<String>>>),
        name!(moved, Option<String>),
        name!(keys, Option<String>),
        name!(deferred, Option<String>),
        name!(wrote, Option<bool>),
    ),
> {
    struct AsUser(Option<(pg_sys::Oid, i32)>);
    impl Drop for AsUser {
        #[allow(unsafe_code)]
        fn drop(&mut self) {
            if let Some((uid, cx)) = self.0 {
                // SAFETY: restores the user id saved below, as fmgr_security_definer does.
                unsafe { pg_sys::SetUserIdAndSecContext(uid, cx) };
            }
        }
    }
    // SAFETY: the user id is switched as SECURITY DEFINER functions do and restored by the
    // guard (and by abort).
    let guard = unsafe {
        let role_c = CString::new(role).unwrap_or_default();
        let roleid = pg_sys::get_role_oid(role_c.as_ptr(), false);
        let (mut uid, mut cx) = (pg_sys::InvalidOid, 0i32);
        pg_sys::GetUserIdAndSecContext(&mut uid, &mut cx);
        let guard = AsUser(Some((uid, cx)));
        pg_sys::SetUserIdAndSecContext(roleid, cx | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32);
        guard
    };
    crate::ri::take_deferred();
    let (processed, rows, moved) = exec_share(
        Some(gateway_region),
        sql,
        &types,
        &vals,
        &partitions,
        crosscheck,
    );
    drop(guard);
    let keys = crate::global_keys::take();
    let deferred = crate::ri::take_deferred();
    let processed = processed as i64;
    let mut out: Vec<RemoteExecRow> = rows
        .into_iter()
        .map(|r| (processed, Some(r), None, None, None, None))
        .collect();
    if out.is_empty() {
        out.push((processed, None, None, None, None, None));
    }
    out[0].5 = Some(replication::has_local_changes());
    if !moved.is_empty() {
        out[0].2 = serde_json::to_string(&moved).ok();
    }
    if !keys.is_empty() {
        out[0].3 = serde_json::to_string(&keys).ok();
    }
    if !deferred.is_empty() {
        out[0].4 = serde_json::to_string(&deferred).ok();
    }
    TableIterator::new(out)
}

/// Runs one SELECT, INSERT, UPDATE, DELETE or TRUNCATE through SPI as a statement served for another
/// node's transaction (never routed again), with `gateway_region()` answering
/// `gateway_region` when given, over `partitions` of its target only when not empty, and
/// with `crosscheck` as [`spi_execute`] says: rows processed, the rows as text, and rows left
/// for partitions leased elsewhere.
#[allow(unsafe_code)]
fn exec_share(
    gateway_region: Option<&str>,
    sql: &str,
    types: &[String],
    vals: &[Option<String>],
    partitions: &[String],
    crosscheck: bool,
) -> sidecar::ForwardedRows {
    struct Serving {
        prev_region: Option<Option<String>>,
    }
    impl Drop for Serving {
        fn drop(&mut self) {
            SERVING.with(|s| s.set(s.get().saturating_sub(1)));
            SERVE_TOP.with(|t| t.set(false));
            if let Some(prev) = self.prev_region.take() {
                GATEWAY_REGION.with(|g| *g.borrow_mut() = prev);
                SERVING_REMOTE.with(|s| s.set(s.get().saturating_sub(1)));
            }
            crate::region_filter::restrict(None);
        }
    }
    if types.len() != vals.len() {
        MrError::BadArgument {
            what: "parameter list",
            value: format!("{} types, {} values", types.len(), vals.len()),
            expected: "as many types as values",
        }
        .raise();
    }
    SERVING.with(|s| s.set(s.get() + 1));
    if gateway_region.is_some() {
        SERVING_REMOTE.with(|s| s.set(s.get() + 1));
    }
    let guard = Serving {
        prev_region: gateway_region
            .map(|r| GATEWAY_REGION.with(|g| g.borrow_mut().replace(r.to_string()))),
    };
    let mut rows: Vec<Vec<Option<String>>> = Vec::new();
    let processed;
    let collecting: Option<crate::moved::Collecting>;
    // SAFETY: SPI is connected and finished here, around one statement; the argument arrays
    // outlive the call; result tuples are read before SPI_finish frees them.
    unsafe {
        let (mut argtypes, mut values, nulls) = spi_args(types, vals);
        let sql_c = CString::new(sql).unwrap_or_default();
        // Exactly one SELECT, INSERT, UPDATE or DELETE (the forwarding node planned one).
        let stmt = sendable_stmt(&sql_c);
        if stmt.is_null() {
            MrError::BadArgument {
                what: "forwarded statement",
                value: sql.chars().take(60).collect(),
                expected: "one SELECT, INSERT, UPDATE, DELETE or TRUNCATE",
            }
            .raise();
        }
        let tag = (*stmt).type_;
        if !partitions.is_empty() {
            let cmd = match tag {
                pg_sys::NodeTag::T_SelectStmt => pg_sys::CmdType::CMD_SELECT,
                pg_sys::NodeTag::T_UpdateStmt => pg_sys::CmdType::CMD_UPDATE,
                pg_sys::NodeTag::T_DeleteStmt => pg_sys::CmdType::CMD_DELETE,
                _ => pg_sys::CmdType::CMD_INSERT,
            };
            crate::region_filter::restrict(Some((cmd, partitions.to_vec())));
        }
        // An INSERT, or an UPDATE that moves rows, may write partitions leased elsewhere.
        collecting = match tag {
            // RETURNING rows written elsewhere come back from there when the list can be
            // asked of them (the origin writes them: `run_forwarded`).
            pg_sys::NodeTag::T_InsertStmt => {
                let ins = stmt as *mut pg_sys::InsertStmt;
                Some(crate::moved::collect(if !(*ins).withClause.is_null() {
                    Some(MODIFYING_WITH)
                } else {
                    portable_tail(stmt, sql).err()
                }))
            }
            pg_sys::NodeTag::T_UpdateStmt => {
                let upd = stmt as *mut pg_sys::UpdateStmt;
                Some(crate::moved::collect(if !(*upd).withClause.is_null() {
                    Some(MODIFYING_WITH)
                } else {
                    portable_tail(stmt, sql).err()
                }))
            }
            _ => None,
        };
        // The next statement to start is the served one (its parameters were read above, a
        // domain's check included); a TRUNCATE starts none, so its triggers' are all nested.
        SERVE_TOP.with(|t| t.set(tag != pg_sys::NodeTag::T_TruncateStmt));
        pg_sys::SPI_connect();
        let rc = spi_execute(&sql_c, &mut argtypes, &mut values, &nulls, crosscheck);
        if rc < 0 {
            pg_sys::SPI_finish();
            MrError::Sidecar(format!("SPI execution failed with code {rc}")).raise();
        }
        processed = pg_sys::SPI_processed;
        let tt = pg_sys::SPI_tuptable;
        if !tt.is_null() && rc != pg_sys::SPI_OK_UTILITY as i32 {
            let td = (*tt).tupdesc;
            let natts = (*td).natts;
            for i in 0..(*tt).numvals as usize {
                let tuple = *(*tt).vals.add(i);
                let mut row = Vec::with_capacity(natts as usize);
                for a in 1..=natts {
                    let v = pg_sys::SPI_getvalue(tuple, td, a);
                    row.push(if v.is_null() {
                        None
                    } else {
                        Some(CStr::from_ptr(v).to_string_lossy().into_owned())
                    });
                }
                rows.push(row);
            }
        }
        pg_sys::SPI_finish();
    }
    let moved = collecting.map(|c| c.finish()).unwrap_or_default();
    drop(guard);
    if gateway_region.is_none() {
        // This node's own share: what its foreign keys left is this origin's to run.
        crate::ri::returned(crate::ri::take_deferred());
    }
    (processed, rows, moved)
}

/// SPI arguments from parameters as (type name, text value): types, datums and null flags.
///
/// # Safety
/// In a transaction; the datums live in the current memory context.
#[allow(unsafe_code)]
unsafe fn spi_args(
    types: &[String],
    vals: &[Option<String>],
) -> (Vec<pg_sys::Oid>, Vec<pg_sys::Datum>, Vec<std::ffi::c_char>) {
    // SAFETY: as this function's contract; types are parsed and values read by their input
    // functions as the parser would.
    unsafe {
        let mut argtypes = Vec::with_capacity(types.len());
        let mut values = Vec::with_capacity(types.len());
        let mut nulls = Vec::with_capacity(types.len());
        for (t, v) in types.iter().zip(vals) {
            let tc = CString::new(t.as_str()).unwrap_or_default();
            let (mut oid, mut typmod) = (pg_sys::InvalidOid, -1i32);
            pg_sys::parseTypeString(tc.as_ptr(), &mut oid, &mut typmod, false);
            argtypes.push(oid);
            match v {
                Some(text) => {
                    let (mut func, mut ioparam) = (pg_sys::InvalidOid, pg_sys::InvalidOid);
                    pg_sys::getTypeInputInfo(oid, &mut func, &mut ioparam);
                    let c = CString::new(text.as_str()).unwrap_or_default();
                    values.push(pg_sys::OidInputFunctionCall(
                        func,
                        c.as_ptr() as *mut _,
                        ioparam,
                        typmod,
                    ));
                    nulls.push(b' ' as std::ffi::c_char);
                }
                None => {
                    values.push(pg_sys::Datum::from(0));
                    nulls.push(b'n' as std::ffi::c_char);
                }
            }
        }
        (argtypes, values, nulls)
    }
}

/// Runs one statement through SPI (connected): with `crosscheck`, as `ri_PerformCheck` runs a
/// referential query that must see rows committed since the transaction's snapshot — its
/// own changes made visible, the latest snapshot read, and rows the transaction's snapshot
/// does not see raising 40001 (under READ COMMITTED, PostgreSQL never asks for it). The
/// SPI result code.
///
/// # Safety
/// SPI is connected; the arrays hold one entry per parameter and outlive the call.
#[allow(unsafe_code)]
unsafe fn spi_execute(
    sql: &CStr,
    argtypes: &mut [pg_sys::Oid],
    values: &mut [pg_sys::Datum],
    nulls: &[std::ffi::c_char],
    crosscheck: bool,
) -> i32 {
    // SAFETY: as this function's contract; the plan is SPI's, freed with its connection.
    unsafe {
        if !crosscheck || pg_sys::XactIsoLevel < pg_sys::XACT_REPEATABLE_READ as i32 {
            return pg_sys::SPI_execute_with_args(
                sql.as_ptr(),
                argtypes.len() as i32,
                argtypes.as_mut_ptr(),
                values.as_mut_ptr(),
                nulls.as_ptr(),
                false,
                0,
            );
        }
        let plan = pg_sys::SPI_prepare(sql.as_ptr(), argtypes.len() as i32, argtypes.as_mut_ptr());
        if plan.is_null() {
            return pg_sys::SPI_result;
        }
        pg_sys::CommandCounterIncrement();
        pg_sys::SPI_execute_snapshot(
            plan,
            values.as_mut_ptr(),
            nulls.as_ptr(),
            pg_sys::GetLatestSnapshot(),
            pg_sys::GetTransactionSnapshot(),
            false,
            true,
            0,
        )
    }
}

/// Runs `sql` through SPI with parameters as (type name, text value) in this transaction,
/// routed as any nested statement is (with `crosscheck` as [`spi_execute`] says); the rows it
/// processed.
#[allow(unsafe_code)]
pub fn spi_run(sql: &str, types: &[String], vals: &[Option<String>], crosscheck: bool) -> u64 {
    if types.len() != vals.len() {
        MrError::BadArgument {
            what: "parameter list",
            value: format!("{} types, {} values", types.len(), vals.len()),
            expected: "as many types as values",
        }
        .raise();
    }
    // SAFETY: SPI is connected and finished around one statement; the argument arrays
    // outlive the call.
    unsafe {
        let (mut argtypes, mut values, nulls) = spi_args(types, vals);
        let sql_c = CString::new(sql).unwrap_or_default();
        pg_sys::SPI_connect();
        let rc = spi_execute(&sql_c, &mut argtypes, &mut values, &nulls, crosscheck);
        let processed = pg_sys::SPI_processed;
        pg_sys::SPI_finish();
        if rc < 0 {
            MrError::Sidecar(format!("SPI execution failed with code {rc}")).raise();
        }
        processed
    }
}

/// The count a query over this node's copy returns (`$1`: `key`), read as the copy is: not
/// routed to leaseholders and without a read barrier. For the global key tables' checks with
/// row replication off, which are of this node's copy by design (each node then keeps its
/// own key tables from the rows it holds); EXECUTE is revoked from PUBLIC.
#[pg_extern(schema = "multiregion")]
fn count_local(sql: &str, key: pgrx::JsonB) -> i64 {
    let args = vec![pgrx::datum::DatumWithOid::from(key)];
    read_locally(|| Spi::get_one_with_args::<i64>(sql, &args))
        .unwrap_or_else(|e| {
            MrError::Sidecar(format!("count_local: {e}")).raise();
        })
        .unwrap_or(0)
}

/// Runs `f`, whose statements read this node's copy as it is: not routed to leaseholders,
/// without a read barrier. Only for reads whose caller knows the copy is the one to read.
pub(crate) fn read_locally<R>(f: impl FnOnce() -> R) -> R {
    struct Local;
    impl Drop for Local {
        fn drop(&mut self) {
            LOCAL_READS.with(|l| l.set(l.get().saturating_sub(1)));
        }
    }
    LOCAL_READS.with(|l| l.set(l.get() + 1));
    let _local = Local;
    f()
}

/// Whether this node's copy of REGIONAL BY ROW table `table`'s partition for `region` holds a
/// row with `key` (column → value), read as the copy is: not routed, no read barrier. Exact
/// where this node leases the partition (it wrote every row there); elsewhere a hint. For
/// `multiregion.conflict_region`'s first look, in the row's own region: an upsert of a row of
/// this node's region then reads nothing elsewhere. Only this SELECT runs, as the caller.
#[pg_extern(schema = "multiregion")]
fn key_in_local_partition(table: pg_sys::Oid, region: &str, key: pgrx::JsonB) -> bool {
    use crate::regions::spi::ident;
    let Some(column) = crate::regions::spi::read_one(
        "SELECT region_column::text FROM multiregion.table_locality \
          WHERE relid = $1 AND locality = 'regional_by_row'",
        vec![table.into()],
    ) else {
        return false;
    };
    let Some(columns) = key
        .0
        .as_object()
        .map(|o| o.keys().cloned().collect::<Vec<_>>())
    else {
        return false;
    };
    if columns.is_empty() {
        return false;
    }
    let qualified =
        crate::regions::spi::read_one("SELECT $1::oid::regclass::text", vec![table.into()])
            .unwrap_or_default();
    let matches: Vec<String> = columns
        .iter()
        .map(|c| format!("t.{c} = k.{c}", c = ident(c)))
        .collect();
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM {qualified} t, \
                pg_catalog.jsonb_populate_record(NULL::{qualified}, $1) k \
          WHERE t.{} = $2 AND {})",
        ident(&column),
        matches.join(" AND ")
    );
    let args = vec![
        pgrx::datum::DatumWithOid::from(key),
        pgrx::datum::DatumWithOid::from(region),
    ];
    read_locally(|| Spi::get_one_with_args::<bool>(&sql, &args))
        .unwrap_or_else(|e| MrError::Sidecar(format!("key_in_local_partition: {e}")).raise())
        .unwrap_or(false)
}

extension_sql!(
    r#"
REVOKE EXECUTE ON FUNCTION multiregion.remote_exec(text, text, text, text[], text[], text[], bool) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION multiregion.count_local(text, jsonb) FROM PUBLIC;
"#,
    name = "routing",
    requires = [remote_exec, count_local]
);
