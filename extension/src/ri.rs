//! Foreign keys across leaseholders (ARCHITECTURE.md §9, "Foreign keys").
//!
//! A statement served for another node's transaction fires its foreign keys' triggers where it
//! runs. When such a trigger's query reads or writes rows leased on yet another node, running
//! it here would be wrong twice over: this node's copy lacks the transaction's uncommitted
//! changes elsewhere (the parent it inserted a statement ago), and a row lock taken here does
//! not hold off a writer at the leaseholder. Nor can this node send the query there itself: it
//! may be the origin's own rows, in a backend that is waiting for this statement. So the query
//! is not run here but returned to the origin, which runs it right after
//! the statement in the same transaction, with ordinary routing: at the leaseholders, in the
//! transaction's sessions there, where it sees the transaction's changes and takes its locks.
//! Meanwhile the trigger here gets the answer that lets it go on (the referenced row found, no
//! referencing row, nothing cascaded), and the origin raises PostgreSQL's own error if the real
//! answer differs.
//!
//! Which constraint and relation a query comes from is known from the trigger that runs it:
//! while serving, the referential triggers run through [`ri_trigger`], a shim that notes the
//! trigger's constraint and relation around the call ([`shim_triggers`]).

use crate::error::MrError;
use mr_wire::local::{DeferredCheck, DeferredStatement, ForwardStatement, Guard};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::{CStr, CString};

/// What a referential trigger does with the rows its query finds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RiKind {
    /// Checks that new referencing rows' keys exist (`RI_FKey_check_ins`/`_upd`).
    Check,
    /// Refuses to remove a key that is still referenced (NO ACTION, RESTRICT).
    Restrict,
    /// Cascades, or sets the referencing columns to NULL or their defaults.
    Action,
}

/// The referential trigger running now.
#[derive(Clone, Copy, Debug)]
pub struct RiCall {
    pub kind: RiKind,
    /// Its constraint (`pg_constraint` oid).
    constraint: pg_sys::Oid,
    /// The relation it fires on (the referencing one for a check, else the referenced one).
    relation: pg_sys::Oid,
    /// Its constraint is deferred in the transaction (INITIALLY DEFERRED, or by the origin's
    /// `SET CONSTRAINTS`): checked at the transaction's commit.
    pub deferred: bool,
    /// For a check, the referencing row's address (block, offset) in `relation`.
    row: Option<(u32, u16)>,
}

thread_local! {
    /// Referential triggers in progress, innermost last, each with the executor nesting
    /// level it was called at (its own query starts at that level).
    static CALLS: RefCell<Vec<(RiCall, u32)>> = const { RefCell::new(Vec::new()) };
    /// Queries deferred while serving a statement, returned with its rows.
    static DEFERRED: RefCell<Vec<DeferredStatement>> = const { RefCell::new(Vec::new()) };
    /// Queries other nodes returned, for this origin to run next.
    static PENDING: RefCell<Vec<DeferredStatement>> = const { RefCell::new(Vec::new()) };
    /// Queries other nodes returned for this origin to run at commit, each with the
    /// subtransaction it was returned in.
    static AT_COMMIT: RefCell<VecDeque<(pg_sys::SubTransactionId, DeferredStatement)>> =
        const { RefCell::new(VecDeque::new()) };
    /// A deferred NO ACTION trigger's look for another row with its removed key (by
    /// constraint), to guard the look for referencing rows that follows it.
    static KEY_BACK: RefCell<Option<(pg_sys::Oid, Guard)>> = const { RefCell::new(None) };
    /// While serving: whether each deferrable constraint of the statement's triggers is
    /// deferred in the origin's transaction ([`shim_triggers`]).
    static ORIGIN_DEFERRED: RefCell<Vec<(pg_sys::Oid, bool)>> = const { RefCell::new(Vec::new()) };
    /// Checks returned for commit that a `SET CONSTRAINTS … IMMEDIATE` ran early, each with
    /// the subtransaction it was returned in and the one it ran in: a rollback of the
    /// latter puts it back, as PostgreSQL fires such events again at commit.
    static RAN: RefCell<Vec<(pg_sys::SubTransactionId, pg_sys::SubTransactionId, DeferredStatement)>> =
        const { RefCell::new(Vec::new()) };
    /// Each constraint's names up its partition tree ([`constraint_chain`]), this transaction.
    static CHAINS: RefCell<Vec<(pg_sys::Oid, Chain)>> = const { RefCell::new(Vec::new()) };
    /// This transaction ran a `SET CONSTRAINTS`: its modes are forwarded even once empty
    /// again (a rollback to a savepoint), so that a session begun inside the savepoint, which
    /// got them at its start, loses them too.
    static MODES_SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A constraint's (schema, name), then those of the constraints it was cloned from.
type Chain = Vec<(String, String)>;

/// Whether this transaction ran a `SET CONSTRAINTS` ([`MODES_SET`]).
pub fn modes_set() -> bool {
    MODES_SET.with(|m| m.get())
}

/// One `SET CONSTRAINTS` of a transaction, as the nodes serving its statements read it
/// ([`crate::gucs::constraint_modes`]): ALL, or the constraints of one name in one schema
/// (with their partitions' clones), made deferred or immediate. As in PostgreSQL, the last
/// one that names a constraint decides, and ALL forgets the ones before it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Mode {
    /// (schema, constraint name); `None`: ALL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    named: Option<(String, String)>,
    deferred: bool,
}

/// The `SET CONSTRAINTS` modes of the transaction: this backend's own, or while serving, the
/// origin's (forwarded with the statement).
fn modes() -> Vec<Mode> {
    let raw = crate::gucs::constraint_modes();
    if raw.is_empty() {
        return Vec::new();
    }
    serde_json::from_str(&raw).unwrap_or_default()
}

/// Whether a deferrable constraint whose names up its partition tree are `chain` is deferred
/// under `modes`, `initially` if none names it.
fn deferred_under(modes: &[Mode], chain: &[(String, String)], initially: bool) -> bool {
    modes
        .iter()
        .rev()
        .find(|m| m.named.as_ref().is_none_or(|n| chain.contains(n)))
        .map_or(initially, |m| m.deferred)
}

/// Constraint `conoid` and the constraints it was cloned from (a partition's foreign key
/// from its table's), each as (schema, name): what `SET CONSTRAINTS` names reach it by.
fn constraint_chain(conoid: pg_sys::Oid) -> Vec<(String, String)> {
    if let Some(c) = CHAINS.with(|c| {
        c.borrow()
            .iter()
            .find(|(o, _)| *o == conoid)
            .map(|(_, c)| c.clone())
    }) {
        return c;
    }
    let chain = read_chain(conoid);
    CHAINS.with(|c| c.borrow_mut().push((conoid, chain.clone())));
    chain
}

fn read_chain(conoid: pg_sys::Oid) -> Vec<(String, String)> {
    let json = crate::regions::spi::read_one(
        "WITH RECURSIVE up(oid, depth) AS ( \
           SELECT $1::pg_catalog.oid, 0 \
           UNION ALL SELECT c.conparentid, up.depth + 1 FROM pg_catalog.pg_constraint c \
             JOIN up ON c.oid = up.oid WHERE c.conparentid <> 0) \
         SELECT pg_catalog.json_agg(pg_catalog.json_build_array(n.nspname, c.conname) ORDER BY up.depth)::text \
         FROM up JOIN pg_catalog.pg_constraint c ON c.oid = up.oid \
         JOIN pg_catalog.pg_namespace n ON n.oid = c.connamespace",
        vec![conoid.into()],
    );
    json.and_then(|j| serde_json::from_str(&j).ok())
        .unwrap_or_default()
}

/// After a utility statement ran here. A `SET CONSTRAINTS` in a transaction block is kept
/// for the nodes that serve this transaction's statements (PostgreSQL's own state covers
/// only this node's triggers); one that makes constraints immediate also runs the checks of
/// theirs that served statements returned for commit, as PostgreSQL runs its own pending
/// ones at that statement.
///
/// # Safety
/// `pstmt` is the statement that just ran, in a transaction.
#[allow(unsafe_code)]
pub unsafe fn after_utility(pstmt: &pg_sys::PlannedStmt) {
    // SAFETY: as this function's contract; the node is a ConstraintsSetStmt by its tag, and
    // its list holds the RangeVars the grammar made of the names.
    unsafe {
        let stmt = pstmt.utilityStmt;
        if stmt.is_null() || (*stmt).type_ != pg_sys::NodeTag::T_ConstraintsSetStmt {
            return;
        }
        MODES_SET.with(|m| m.set(true));
        let stmt = &*(stmt as *mut pg_sys::ConstraintsSetStmt);
        let deferred = stmt.deferred;
        let mut modes = modes();
        let mut named = Vec::new();
        if stmt.constraints.is_null() {
            modes = vec![Mode {
                named: None,
                deferred,
            }];
        } else {
            for i in 0..(*stmt.constraints).length {
                let rv = pg_sys::list_nth(stmt.constraints, i) as *mut pg_sys::RangeVar;
                if rv.is_null() || (*rv).relname.is_null() {
                    continue;
                }
                let name = CStr::from_ptr((*rv).relname).to_string_lossy().into_owned();
                // PostgreSQL took the first schema of the search path that has one so named.
                let schema = if (*rv).schemaname.is_null() {
                    crate::regions::spi::read_one(
                        "SELECT s.nsp::text FROM pg_catalog.unnest(pg_catalog.current_schemas(true)) \
                           WITH ORDINALITY AS s(nsp, i) \
                         WHERE EXISTS (SELECT FROM pg_catalog.pg_constraint c \
                           JOIN pg_catalog.pg_namespace n ON n.oid = c.connamespace \
                           WHERE n.nspname = s.nsp AND c.conname = $1) \
                         ORDER BY s.i LIMIT 1",
                        vec![name.as_str().into()],
                    )
                } else {
                    Some(
                        CStr::from_ptr((*rv).schemaname)
                            .to_string_lossy()
                            .into_owned(),
                    )
                };
                if let Some(schema) = schema {
                    named.push((schema, name));
                }
            }
            modes.retain(|m| m.named.as_ref().is_none_or(|n| !named.contains(n)));
            modes.extend(named.iter().cloned().map(|n| Mode {
                named: Some(n),
                deferred,
            }));
        }
        let json = serde_json::to_string(&modes).unwrap_or_default();
        let value = CString::new(json).unwrap_or_default();
        pg_sys::set_config_option(
            c"multiregion.constraint_modes".as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_LOCAL,
            true,
            0,
            false,
        );
        if !deferred {
            let all = stmt.constraints.is_null();
            run_at_commit_where(|d| all || d.constraint.iter().any(|c| named.contains(c)));
        }
    }
}

/// A builtin function as pgrx binds it (its wrapper turns an ERROR inside into an unwind).
type TriggerFn = unsafe fn(pg_sys::FunctionCallInfo) -> pg_sys::Datum;

/// The referential trigger function with oid `oid`: what it does, and its C entry point.
fn ri_function(oid: pg_sys::Oid) -> Option<(RiKind, TriggerFn)> {
    use RiKind::*;
    let f: (RiKind, TriggerFn) = match oid.to_u32() {
        pg_sys::F_RI_FKEY_CHECK_INS => (Check, pg_sys::RI_FKey_check_ins),
        pg_sys::F_RI_FKEY_CHECK_UPD => (Check, pg_sys::RI_FKey_check_upd),
        pg_sys::F_RI_FKEY_NOACTION_DEL => (Restrict, pg_sys::RI_FKey_noaction_del),
        pg_sys::F_RI_FKEY_NOACTION_UPD => (Restrict, pg_sys::RI_FKey_noaction_upd),
        pg_sys::F_RI_FKEY_RESTRICT_DEL => (Restrict, pg_sys::RI_FKey_restrict_del),
        pg_sys::F_RI_FKEY_RESTRICT_UPD => (Restrict, pg_sys::RI_FKey_restrict_upd),
        pg_sys::F_RI_FKEY_CASCADE_DEL => (Action, pg_sys::RI_FKey_cascade_del),
        pg_sys::F_RI_FKEY_CASCADE_UPD => (Action, pg_sys::RI_FKey_cascade_upd),
        pg_sys::F_RI_FKEY_SETNULL_DEL => (Action, pg_sys::RI_FKey_setnull_del),
        pg_sys::F_RI_FKEY_SETNULL_UPD => (Action, pg_sys::RI_FKey_setnull_upd),
        pg_sys::F_RI_FKEY_SETDEFAULT_DEL => (Action, pg_sys::RI_FKey_setdefault_del),
        pg_sys::F_RI_FKEY_SETDEFAULT_UPD => (Action, pg_sys::RI_FKey_setdefault_upd),
        _ => return None,
    };
    Some(f)
}

/// Before a statement served for another node fires its AFTER triggers (in its
/// ExecutorFinish): its referential triggers are set to run through [`ri_trigger`].
///
/// Their function lookups are cached in the result relations' `ri_TrigFunctions`, filled on
/// first use; builtins, as these are, never pass through the function manager's hooks. So
/// the cache entries are filled here, as PostgreSQL would fill them, with the entry point
/// then pointed at the shim.
///
/// # Safety
/// `qd` is a started QueryDesc whose ExecutorFinish is about to run.
#[allow(unsafe_code)]
pub unsafe fn shim_triggers(qd: *mut pg_sys::QueryDesc) {
    // SAFETY: as this function's contract: the estate's lists hold ResultRelInfos whose
    // trigger arrays (ri_TrigFunctions parallel to ri_TrigDesc's triggers) are valid for the
    // query's life; fmgr_info_cxt fills an entry exactly as ExecCallTriggerFunc would.
    unsafe {
        if qd.is_null() || (*qd).estate.is_null() {
            return;
        }
        let estate = (*qd).estate;
        // AFTER triggers fire through ExecGetTriggerResultRel(…, NULL): a partition's own
        // result relation, made with its table's as root, is not the one they find, but one
        // made for them on first use. Made now, it is patched with the others.
        let partitions: Vec<pg_sys::Oid> = result_relations(estate, false)
            .into_iter()
            .filter(|&rri| !(*rri).ri_RootResultRelInfo.is_null() && !(*rri).ri_TrigDesc.is_null())
            .map(|rri| (*(*rri).ri_RelationDesc).rd_id)
            .collect();
        for relid in partitions {
            pg_sys::ExecGetTriggerResultRel(estate, relid, std::ptr::null_mut());
        }
        cascade_targets(qd);
        let mut immediate = Vec::new();
        for rri in result_relations(estate, true) {
            if (*rri).ri_TrigDesc.is_null() || (*rri).ri_TrigFunctions.is_null() {
                continue;
            }
            let td = &*(*rri).ri_TrigDesc;
            for t in 0..td.numtriggers.max(0) as usize {
                let trigger = &*td.triggers.add(t);
                let finfo = (*rri).ri_TrigFunctions.add(t);
                if ri_function(trigger.tgfoid).is_some() {
                    pg_sys::fmgr_info_cxt(trigger.tgfoid, finfo, (*estate).es_query_cxt);
                    (*finfo).fn_addr = Some(ri_trigger);
                    if !(trigger.tgdeferrable && crate::routing::serving_remote()) {
                        continue;
                    }
                    // Served for another node, a deferrable key between replicated tables
                    // (one to a table that is not replicated is checked here as declared):
                    // deferred or not as the origin's transaction has it (its SET
                    // CONSTRAINTS). It fires with the statement here (INITIALLY DEFERRED
                    // ones are made immediate; no served statement defers a key), and its
                    // queries go to the origin, to run at its commit if it defers the key.
                    let relid = (*(*rri).ri_RelationDesc).rd_id;
                    if !(crate::replication::is_replicated_table_locked(relid)
                        && crate::replication::is_replicated_table_locked(trigger.tgconstrrelid))
                    {
                        continue;
                    }
                    note_origin_deferred(trigger.tgconstraint, trigger.tginitdeferred);
                    if trigger.tginitdeferred {
                        // The constraint's table: the trigger's own for a check, the
                        // referencing one for a removed key's.
                        let table = match ri_function(trigger.tgfoid) {
                            Some((RiKind::Check, _)) => relid,
                            _ => trigger.tgconstrrelid,
                        };
                        if !immediate.contains(&(trigger.tgconstraint, table)) {
                            immediate.push((trigger.tgconstraint, table));
                        }
                    }
                }
            }
        }
        set_constraints(&immediate);
    }
}

/// Notes for [`ri_trigger`] whether deferrable constraint `conoid` is deferred in the
/// origin's transaction, served here (`initially`: as declared, when the origin named it in
/// no `SET CONSTRAINTS`); decided once per statement.
fn note_origin_deferred(conoid: pg_sys::Oid, initially: bool) {
    let modes = modes();
    let deferred = if modes.is_empty() {
        initially
    } else {
        deferred_under(&modes, &constraint_chain(conoid), initially)
    };
    ORIGIN_DEFERRED.with(|o| {
        let mut o = o.borrow_mut();
        o.retain(|(c, _)| *c != conoid);
        o.push((conoid, deferred));
    });
}

/// Makes INITIALLY DEFERRED foreign keys (`(constraint, its table)`) checked when the
/// statement's AFTER triggers fire, in this served transaction, as `SET CONSTRAINTS …
/// IMMEDIATE` would (as the bootstrap superuser: naming a
/// constraint by its schema takes USAGE on it, which PostgreSQL's own check, run as the table
/// owner, does not need). A key deferred at the origin between replicated tables is made
/// immediate here: fired at this node's commit, its checks would run outside any served
/// statement, against this node's copies (a parent the transaction inserted on its
/// leaseholder a statement later was missing: 23503 for a valid row). Fired with the
/// statement, they reach [`ri_trigger`], which returns their queries to the origin to run
/// at its commit.
///
/// # Safety
/// In a transaction, inside a statement's ExecutorFinish.
#[allow(unsafe_code)]
unsafe fn set_constraints(constraints: &[(pg_sys::Oid, pg_sys::Oid)]) {
    if constraints.is_empty() {
        return;
    }
    // SAFETY: catalog lookups by oid; the node and its list are palloc'd in the current
    // memory context for AfterTriggerSetState, which resolves each name as SET CONSTRAINTS
    // does (a name matching another deferrable constraint of the schema sets that one too).
    unsafe {
        let mut names = std::ptr::null_mut();
        for &(constraint, table) in constraints {
            let name = pg_sys::get_constraint_name(constraint);
            let schema = pg_sys::get_namespace_name(pg_sys::get_rel_namespace(table));
            if name.is_null() || schema.is_null() {
                continue;
            }
            let rv = pg_sys::makeRangeVar(schema, name, -1);
            names = pg_sys::lappend(names, rv as *mut std::ffi::c_void);
        }
        if names.is_null() {
            return;
        }
        let stmt = pg_sys::palloc0(std::mem::size_of::<pg_sys::ConstraintsSetStmt>())
            as *mut pg_sys::ConstraintsSetStmt;
        (*stmt).type_ = pg_sys::NodeTag::T_ConstraintsSetStmt;
        (*stmt).constraints = names;
        (*stmt).deferred = false;
        crate::sequences::as_superuser(|| pg_sys::AfterTriggerSetState(stmt));
    }
}

/// The estate's result relations: the statement's own, those made for tuple routing, and
/// with `triggers` those made for firing triggers.
///
/// # Safety
/// `estate` is a started query's, its lists valid for its life.
#[allow(unsafe_code)]
unsafe fn result_relations(
    estate: *mut pg_sys::EState,
    triggers: bool,
) -> Vec<*mut pg_sys::ResultRelInfo> {
    // SAFETY: as this function's contract; each list holds ResultRelInfo pointers.
    unsafe {
        let mut lists = vec![
            (*estate).es_opened_result_relations,
            (*estate).es_tuple_routing_result_relations,
        ];
        if triggers {
            lists.push((*estate).es_trig_target_relations);
        }
        let mut out = Vec::new();
        for list in lists.into_iter().filter(|l| !l.is_null()) {
            for i in 0..(*list).length {
                let rri = pg_sys::list_nth(list, i) as *mut pg_sys::ResultRelInfo;
                if !rri.is_null() {
                    out.push(rri);
                }
            }
        }
        out
    }
}

/// What a statement, or a referential action, does to rows.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Change {
    Delete,
    Update,
}

/// The change referential action trigger `tgfoid` makes to the referencing rows when the
/// referenced ones undergo `change`, if it fires for it.
fn cascade_of(tgfoid: pg_sys::Oid, change: Change) -> Option<Change> {
    match (tgfoid.to_u32(), change) {
        (pg_sys::F_RI_FKEY_CASCADE_DEL, Change::Delete) => Some(Change::Delete),
        (pg_sys::F_RI_FKEY_SETNULL_DEL | pg_sys::F_RI_FKEY_SETDEFAULT_DEL, Change::Delete) => {
            Some(Change::Update)
        }
        (
            pg_sys::F_RI_FKEY_CASCADE_UPD
            | pg_sys::F_RI_FKEY_SETNULL_UPD
            | pg_sys::F_RI_FKEY_SETDEFAULT_UPD,
            Change::Update,
        ) => Some(Change::Update),
        _ => None,
    }
}

/// Makes the result relations a cascade run here fires triggers on, so that they are patched
/// with the others: a cascade's UPDATE or DELETE (run through SPI without firing triggers)
/// queues its rows' events for this statement, whose ExecutorFinish fires them on result
/// relations it makes as it meets them, after [`shim_triggers`] ran. Unpatched, the
/// referencing table's own foreign keys (a second cascade, to a table leased elsewhere) ran
/// their queries against this node's copy. Follows the actions the statement's change can set
/// off, to any depth: the referencing tables of each action trigger that fires for it
/// (`tgconstrrelid`), their leaf partitions (locked as the cascade's query would lock them),
/// and theirs for the change the action makes. An INSERT sets off none (unless it upserts).
///
/// # Safety
/// `qd` is a started query's QueryDesc, in its ExecutorFinish.
#[allow(unsafe_code)]
unsafe fn cascade_targets(qd: *mut pg_sys::QueryDesc) {
    use pg_sys::CmdType::*;
    // SAFETY: as this function's contract; relations are locked before they are opened, and
    // the result relations made are the estate's (closed with it), as PostgreSQL's own.
    unsafe {
        let estate = (*qd).estate;
        let upsert = || {
            let ps = (*qd).plannedstmt;
            let mt = if ps.is_null() {
                std::ptr::null_mut()
            } else {
                (*ps).planTree as *mut pg_sys::ModifyTable
            };
            !mt.is_null()
                && (*mt).plan.type_ == pg_sys::NodeTag::T_ModifyTable
                && (*mt).onConflictAction == pg_sys::OnConflictAction::ONCONFLICT_UPDATE
        };
        let first: &[Change] = match (*qd).operation {
            CMD_DELETE => &[Change::Delete],
            CMD_UPDATE => &[Change::Update],
            CMD_INSERT if upsert() => &[Change::Update],
            CMD_MERGE => &[Change::Delete, Change::Update],
            _ => return,
        };
        let mut queue: Vec<_> = result_relations(estate, true)
            .into_iter()
            .flat_map(|rri| first.iter().map(move |&c| (rri, c)))
            .collect();
        let mut seen = std::collections::HashSet::new();
        while let Some((rri, change)) = queue.pop() {
            if rri.is_null() || (*rri).ri_TrigDesc.is_null() {
                continue;
            }
            let td = &*(*rri).ri_TrigDesc;
            for t in 0..td.numtriggers.max(0) as usize {
                let trigger = &*td.triggers.add(t);
                let Some(next) = cascade_of(trigger.tgfoid, change) else {
                    continue;
                };
                if !seen.insert((trigger.tgconstrrelid, next)) {
                    continue;
                }
                for leaf in leaves(trigger.tgconstrrelid) {
                    let rri = pg_sys::ExecGetTriggerResultRel(estate, leaf, std::ptr::null_mut());
                    queue.push((rri, next));
                }
            }
        }
    }
}

/// `relid` if it holds rows itself, else its partitions' leaves; each locked as a write to
/// it would lock it.
#[allow(unsafe_code)]
fn leaves(relid: pg_sys::Oid) -> Vec<pg_sys::Oid> {
    // SAFETY: the relation is locked before it is opened, and closed again keeping the lock;
    // its partition descriptor is read while it is open.
    unsafe {
        pg_sys::LockRelationOid(relid, pg_sys::RowExclusiveLock as i32);
        if pg_sys::get_rel_relkind(relid) as u8 != pg_sys::RELKIND_PARTITIONED_TABLE {
            return vec![relid];
        }
        let rel = pg_sys::relation_open(relid, pg_sys::NoLock as i32);
        let pd = pg_sys::RelationGetPartitionDesc(rel, true);
        let parts: Vec<pg_sys::Oid> = if pd.is_null() {
            Vec::new()
        } else {
            (0..(*pd).nparts.max(0) as usize)
                .map(|i| *(*pd).oids.add(i))
                .collect()
        };
        pg_sys::relation_close(rel, pg_sys::NoLock as i32);
        parts.into_iter().flat_map(leaves).collect()
    }
}

/// A referential trigger function, called with its constraint and relation noted.
#[pg_guard]
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn ri_trigger(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            CALLS.with(|c| c.borrow_mut().pop());
        }
    }
    // SAFETY: PostgreSQL calls a trigger function with its FmgrInfo and, as context, the
    // TriggerData (checked by tag) whose trigger and relation are valid for the call.
    let (f, call) = unsafe {
        let oid = (*(*fcinfo).flinfo).fn_oid;
        let Some((kind, f)) = ri_function(oid) else {
            MrError::Sidecar(format!(
                "function {} is not a referential trigger",
                oid.to_u32()
            ))
            .raise();
        };
        let td = (*fcinfo).context as *mut pg_sys::TriggerData;
        let call = (!td.is_null()
            && (*td).type_ == pg_sys::NodeTag::T_TriggerData
            && !(*td).tg_trigger.is_null()
            && !(*td).tg_relation.is_null())
        .then(|| {
            // The row a check is about: the new version for an UPDATE (RI_FKey_check's).
            let slot =
                if (*td).tg_event & pg_sys::TRIGGER_EVENT_OPMASK == pg_sys::TRIGGER_EVENT_UPDATE {
                    (*td).tg_newslot
                } else {
                    (*td).tg_trigslot
                };
            let row = (kind == RiKind::Check && !slot.is_null()).then(|| {
                let tid = (*slot).tts_tid;
                (
                    (u32::from(tid.ip_blkid.bi_hi) << 16) | u32::from(tid.ip_blkid.bi_lo),
                    tid.ip_posid,
                )
            });
            RiCall {
                kind,
                constraint: (*(*td).tg_trigger).tgconstraint,
                relation: (*(*td).tg_relation).rd_id,
                deferred: {
                    let t = &*(*td).tg_trigger;
                    ORIGIN_DEFERRED
                        .with(|o| {
                            o.borrow()
                                .iter()
                                .find(|(c, _)| *c == t.tgconstraint)
                                .map(|(_, d)| *d)
                        })
                        .unwrap_or(t.tginitdeferred)
                },
                row,
            }
        });
        (f, call)
    };
    let _pop = call.map(|c| {
        // A removed key's guard comes from this call's own look for the key, or none.
        if c.kind == RiKind::Restrict {
            KEY_BACK.with(|k| k.take());
        }
        let level = crate::routing::executor_level();
        CALLS.with(|s| s.borrow_mut().push((c, level)));
        Pop
    });
    // SAFETY: the function PostgreSQL meant to call, with its arguments; an ERROR inside it
    // unwinds through this frame (popping the note) instead of jumping over it.
    unsafe { f(fcinfo) }
}

/// The referential trigger whose query is starting, if one is: the innermost one, called at
/// this executor nesting level. A statement deeper down (a user trigger fired by the rows an
/// `ON DELETE CASCADE` deletes) is not the trigger's query, whatever trigger it runs under.
pub fn current() -> Option<RiCall> {
    let level = crate::routing::executor_level();
    CALLS.with(|c| {
        c.borrow()
            .last()
            .filter(|(_, at)| *at == level)
            .map(|(call, _)| *call)
    })
}

/// Defers `statement`, a query of referential trigger `call` over rows leased elsewhere
/// (`queried`: the relation it reads), to the origin; returns the rows the trigger gets here
/// meanwhile (as text, `width` columns).
#[allow(unsafe_code)]
pub fn defer(
    call: RiCall,
    statement: &ForwardStatement,
    queried: pg_sys::Oid,
    width: usize,
) -> Vec<Vec<Option<String>>> {
    // SAFETY: reads the current user, valid in a transaction.
    let role = unsafe {
        let p = pg_sys::GetUserNameFromId(pg_sys::GetUserId(), true);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    let values: Vec<String> = statement
        .params
        .iter()
        .map(|(_, v)| v.clone().unwrap_or_else(|| "null".into()))
        .collect();
    let (check, rows) = match call.kind {
        RiKind::Action => (None, Vec::new()),
        RiKind::Check => (
            Some(violation(call, true, queried, &values)),
            vec![vec![Some("1".to_string()); width]],
        ),
        // ri_restrict compares parameters to the referencing columns (`$1 = "col"`);
        // ri_Check_Pk_Match, the referenced columns to parameters.
        RiKind::Restrict if statement.sql.contains(" x WHERE $") => {
            (Some(violation(call, false, queried, &values)), Vec::new())
        }
        // Its look for another row with the removed key: none (keys are unique across the
        // cluster), so the referencing rows are checked — never a wrong "found" from a copy.
        // Checked at commit, the key may be back by then: the look guards the check.
        RiKind::Restrict => {
            if call.deferred && crate::routing::serving_remote() {
                let guard = Guard {
                    sql: statement.sql.clone(),
                    params: statement.params.clone(),
                    role,
                    skip_if_found: true,
                };
                KEY_BACK.with(|k| k.replace(Some((call.constraint, guard))));
            }
            return Vec::new();
        }
    };
    let at_commit = call.deferred && crate::routing::serving_remote();
    let guard = match (call.kind, call.row) {
        (RiKind::Check, Some((block, offset))) if at_commit => {
            row_guard(call.relation, block, offset)
        }
        (RiKind::Restrict, _) if at_commit => KEY_BACK
            .with(|k| k.take())
            .filter(|(constraint, _)| *constraint == call.constraint)
            .map(|(_, g)| g),
        _ => None,
    };
    let constraint = if at_commit {
        constraint_chain(call.constraint)
    } else {
        Vec::new()
    };
    DEFERRED.with(|d| {
        d.borrow_mut().push(DeferredStatement {
            sql: statement.sql.clone(),
            params: statement.params.clone(),
            role,
            check,
            crosscheck: statement.crosscheck,
            at_commit,
            guard,
            constraint,
        })
    });
    rows
}

/// The query finding row `(block, offset)` of `relid` at commit, run as its owner.
#[allow(unsafe_code)]
fn row_guard(relid: pg_sys::Oid, block: u32, offset: u16) -> Option<Guard> {
    // SAFETY: catalog lookups by oid, in a transaction (the relation is locked: its trigger
    // is running); quote_identifier returns its argument or a palloc'd quoted copy.
    unsafe {
        let name = pg_sys::get_rel_name(relid);
        let schema = pg_sys::get_namespace_name(pg_sys::get_rel_namespace(relid));
        if name.is_null() || schema.is_null() {
            return None;
        }
        let quoted = |p: *const std::ffi::c_char| {
            CStr::from_ptr(pg_sys::quote_identifier(p))
                .to_string_lossy()
                .into_owned()
        };
        let rel = pg_sys::RelationIdGetRelation(relid);
        if rel.is_null() {
            return None;
        }
        let owner = (*(*rel).rd_rel).relowner;
        pg_sys::RelationClose(rel);
        let role = pg_sys::GetUserNameFromId(owner, true);
        if role.is_null() {
            return None;
        }
        Some(Guard {
            sql: format!(
                "SELECT 1 FROM ONLY {}.{} WHERE ctid = '({block},{offset})'::pg_catalog.tid",
                quoted(schema),
                quoted(name)
            ),
            params: Vec::new(),
            role: CStr::from_ptr(role).to_string_lossy().into_owned(),
            skip_if_found: false,
        })
    }
}

/// PostgreSQL's error for a failed check of `call` (`ri_ReportViolation`): a referencing key
/// that is not present (`exists`), or a removed key still referenced (`queried`: the
/// referencing table its query reads); `values` are the key's.
#[allow(unsafe_code)]
fn violation(call: RiCall, exists: bool, queried: pg_sys::Oid, values: &[String]) -> DeferredCheck {
    // SAFETY: catalog lookups by oid, in a transaction; a relation is opened only to read its
    // foreign key list (it is locked: its trigger is running) and closed again.
    let (conname, fk) = unsafe {
        let name = pg_sys::get_constraint_name(call.constraint);
        let conname = if name.is_null() {
            String::new()
        } else {
            CStr::from_ptr(name).to_string_lossy().into_owned()
        };
        // A check fires on the referencing table; a removed key's query reads it.
        let fk = foreign_key(
            if exists { call.relation } else { queried },
            call.constraint,
        );
        (conname, fk)
    };
    let Some(fk) = fk else {
        return DeferredCheck {
            exists,
            message: format!("foreign key constraint \"{conname}\" is violated"),
            detail: None,
        };
    };
    // A check names the referencing columns, a removed key the referenced ones.
    let (rel, cols) = if exists {
        (fk.conrelid, &fk.conkey)
    } else {
        (fk.confrelid, &fk.confkey)
    };
    let names: Vec<String> = cols.iter().map(|&a| attname(rel, a)).collect();
    let key = format!("Key ({})=({})", names.join(", "), values.join(", "));
    if exists {
        DeferredCheck {
            exists,
            message: format!(
                "insert or update on table \"{}\" violates foreign key constraint \"{conname}\"",
                relname(call.relation)
            ),
            detail: Some(format!(
                "{key} is not present in table \"{}\".",
                relname(fk.confrelid)
            )),
        }
    } else {
        DeferredCheck {
            exists,
            message: format!(
                "update or delete on table \"{}\" violates foreign key constraint \"{conname}\" on table \"{}\"",
                relname(call.relation),
                relname(fk.conrelid)
            ),
            detail: Some(format!(
                "{key} is still referenced from table \"{}\".",
                relname(fk.conrelid)
            )),
        }
    }
}

/// A foreign key as the relcache lists it.
struct ForeignKey {
    conrelid: pg_sys::Oid,
    confrelid: pg_sys::Oid,
    conkey: Vec<i16>,
    confkey: Vec<i16>,
}

/// Constraint `conoid` among the foreign keys of relation `relid`.
#[allow(unsafe_code)]
unsafe fn foreign_key(relid: pg_sys::Oid, conoid: pg_sys::Oid) -> Option<ForeignKey> {
    // SAFETY: as the caller's; the relcache's foreign key list is read before the relation
    // is closed.
    unsafe {
        let rel = pg_sys::RelationIdGetRelation(relid);
        if rel.is_null() {
            return None;
        }
        let list = pg_sys::RelationGetFKeyList(rel);
        let mut found = None;
        if !list.is_null() {
            for i in 0..(*list).length {
                let info = pg_sys::list_nth(list, i) as *const pg_sys::ForeignKeyCacheInfo;
                if !info.is_null() && (*info).conoid == conoid {
                    let info = &*info;
                    let n = (info.nkeys.max(0) as usize).min(32);
                    found = Some(ForeignKey {
                        conrelid: info.conrelid,
                        confrelid: info.confrelid,
                        conkey: info.conkey[..n].to_vec(),
                        confkey: info.confkey[..n].to_vec(),
                    });
                    break;
                }
            }
        }
        pg_sys::RelationClose(rel);
        found
    }
}

#[allow(unsafe_code)]
fn relname(relid: pg_sys::Oid) -> String {
    // SAFETY: a catalog lookup by oid; NULL when the relation is gone.
    unsafe {
        let p = pg_sys::get_rel_name(relid);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

#[allow(unsafe_code)]
fn attname(relid: pg_sys::Oid, attnum: i16) -> String {
    // SAFETY: a catalog lookup; NULL (missing_ok) when the column is gone.
    unsafe {
        let p = pg_sys::get_attname(relid, attnum, true);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// The queries deferred while serving the statement just run, to return with its rows.
pub fn take_deferred() -> Vec<DeferredStatement> {
    DEFERRED.with(|d| std::mem::take(&mut *d.borrow_mut()))
}

/// Queries another node returned for this origin to run: next, or at commit.
#[allow(unsafe_code)]
pub fn returned(deferred: Vec<DeferredStatement>) {
    let (at_commit, next): (Vec<_>, Vec<_>) = deferred.into_iter().partition(|d| d.at_commit);
    if !next.is_empty() {
        PENDING.with(|p| p.borrow_mut().extend(next));
    }
    if !at_commit.is_empty() {
        // SAFETY: reads the current subtransaction's id, in a transaction.
        let sub = unsafe { pg_sys::GetCurrentSubTransactionId() };
        AT_COMMIT.with(|p| {
            p.borrow_mut()
                .extend(at_commit.into_iter().map(|d| (sub, d)))
        });
    }
}

/// At pre-commit, before the transaction's parts commit: runs the checks of INITIALLY
/// DEFERRED foreign keys that statements served elsewhere returned, as [`run_pending`] runs
/// the others, each skipped if the row it is about is gone by now (its guard finds nothing).
pub fn run_at_commit() {
    run_at_commit_where(|_| true);
}

/// Runs the checks returned for commit that `which` picks, in the order they came.
#[allow(unsafe_code)]
fn run_at_commit_where(which: impl Fn(&DeferredStatement) -> bool) {
    loop {
        let next = AT_COMMIT.with(|p| {
            let mut p = p.borrow_mut();
            let i = p.iter().position(|(_, d)| which(d))?;
            p.remove(i)
        });
        let Some((returned_in, d)) = next else {
            return;
        };
        // SAFETY: reads the current subtransaction's id, in a transaction.
        let sub = unsafe { pg_sys::GetCurrentSubTransactionId() };
        RAN.with(|r| r.borrow_mut().push((returned_in, sub, d.clone())));
        if let Some(g) = &d.guard {
            let guard = DeferredStatement {
                sql: g.sql.clone(),
                params: g.params.clone(),
                role: g.role.clone(),
                check: None,
                crosscheck: false,
                at_commit: false,
                guard: None,
                constraint: Vec::new(),
            };
            if (run_as(&guard) > 0) == g.skip_if_found {
                continue;
            }
        }
        PENDING.with(|p| p.borrow_mut().push(d));
        run_pending();
    }
}

/// Runs the queries other nodes returned, in order, in this transaction: each is routed as
/// any statement is (so it runs where its rows are leased, in the transaction's session
/// there), as the role the trigger ran as; a check that finds otherwise than it expects
/// raises the trigger's error. Queries they return in turn run before the next.
#[allow(unsafe_code)]
pub fn run_pending() {
    loop {
        let Some(d) = PENDING.with(|p| {
            let mut p = p.borrow_mut();
            (!p.is_empty()).then(|| p.remove(0))
        }) else {
            return;
        };
        let found = run_as(&d);
        if let Some(check) = d.check {
            if check.exists != (found > 0) {
                MrError::Remote(mr_wire::local::SqlError {
                    code: "23503".into(),
                    message: check.message,
                    detail: check.detail,
                    hint: None,
                })
                .raise();
            }
        }
    }
}

/// Runs `d` through SPI as its role; the rows it found or changed.
#[allow(unsafe_code)]
fn run_as(d: &DeferredStatement) -> u64 {
    struct AsUser(pg_sys::Oid, i32);
    impl Drop for AsUser {
        #[allow(unsafe_code)]
        fn drop(&mut self) {
            // SAFETY: restores the user id saved below (abort restores it too).
            unsafe { pg_sys::SetUserIdAndSecContext(self.0, self.1) };
        }
    }
    // SAFETY: the user id is switched as ri_PerformCheck does for its queries, and restored.
    let _as_user = unsafe {
        let (mut uid, mut cx) = (pg_sys::InvalidOid, 0i32);
        pg_sys::GetUserIdAndSecContext(&mut uid, &mut cx);
        let role = CString::new(d.role.as_str()).unwrap_or_default();
        let roleid = pg_sys::get_role_oid(role.as_ptr(), true);
        if roleid != pg_sys::InvalidOid {
            pg_sys::SetUserIdAndSecContext(
                roleid,
                cx | (pg_sys::SECURITY_LOCAL_USERID_CHANGE | pg_sys::SECURITY_NOFORCE_RLS) as i32,
            );
        }
        AsUser(uid, cx)
    };
    let (types, vals): (Vec<String>, Vec<Option<String>>) = d.params.iter().cloned().unzip();
    crate::routing::spi_run(&d.sql, &types, &vals, d.crosscheck)
}

/// Subtransaction `sub` aborted (a statement failed, or ROLLBACK TO SAVEPOINT): what its
/// statements deferred goes with it.
pub fn sub_aborted(sub: pg_sys::SubTransactionId) {
    DEFERRED.with(|d| d.borrow_mut().clear());
    PENDING.with(|p| p.borrow_mut().clear());
    AT_COMMIT.with(|p| p.borrow_mut().retain(|(s, _)| *s < sub));
    // Checks run early in the aborted subtransaction are due again at commit (unless they
    // were returned in it).
    let back: Vec<_> = RAN.with(|r| {
        let mut r = r.borrow_mut();
        let (back, kept) = std::mem::take(&mut *r)
            .into_iter()
            .partition(|(_, ran_in, _)| *ran_in >= sub);
        *r = kept;
        back
    });
    AT_COMMIT.with(|p| {
        let mut p = p.borrow_mut();
        for (returned_in, _, d) in back.into_iter().rev() {
            if returned_in < sub {
                p.push_front((returned_in, d));
            }
        }
    });
}

/// Transaction end.
pub fn reset() {
    CALLS.with(|c| c.borrow_mut().clear());
    KEY_BACK.with(|k| k.take());
    DEFERRED.with(|d| d.borrow_mut().clear());
    PENDING.with(|p| p.borrow_mut().clear());
    AT_COMMIT.with(|p| p.borrow_mut().clear());
    ORIGIN_DEFERRED.with(|o| o.borrow_mut().clear());
    RAN.with(|r| r.borrow_mut().clear());
    CHAINS.with(|c| c.borrow_mut().clear());
    MODES_SET.with(|m| m.set(false));
}
