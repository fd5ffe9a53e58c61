//! Sequences drawn cluster-wide (docs/ARCHITECTURE.md §8.3).
//!
//! Every node has a copy of each sequence's relation, so PostgreSQL's own `nextval` would
//! hand out the same values on two nodes. With row replication on, a permanent sequence's
//! values come from its counter in the meta group instead: the planner hook points calls of
//! `nextval`, `currval`, `setval` and `lastval` — typed in a statement, or in a column default
//! or identity column the rewriter expanded — at this module's functions, which draw a block
//! of `CACHE` values at a time (more within one statement that draws many: see [`block_size`])
//! and hand them out in this session. This node's copy of the relation is moved past each
//! block (so `pg_dump` and `last_value` see a value at least as high as any drawn here).
//!
//! A counter is kept under the sequence's name. `multiregion.sequence_keys` records, per OID,
//! the name under which it is kept: at the commit of a schema change the origin compares it
//! with the catalog and sends what changed (drops, renames) with the change, so that the
//! counters follow it atomically ([`at_commit`]); every other node brings its copy of the
//! table up to date when it applies the change ([`after_apply`]).
//!
//! `COPY FROM` evaluates column defaults without the planner: the routing trigger draws a
//! COPY's defaulted serial and identity columns again ([`copy_defaults`], [`draw_into`]).
//! Sequences drawn while row replication is off are per node.

use crate::error::{MrError, OrRaise};
use crate::gucs;
use crate::regions::spi;
use crate::sidecar::{self, Draw};
use mr_meta::sequence::{SequenceChange, SequenceName, SequenceParams, SequenceValue};
use mr_meta::TableRef;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgRelation;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;

/// The most values one draw takes for a statement that draws many.
const MAX_BLOCK: u64 = 1024;

/// Values of one sequence this session holds, and what it handed out last.
#[derive(Default)]
struct Held {
    next: i64,
    left: u64,
    increment: i64,
    /// `currval`.
    current: Option<i64>,
    /// The statement the draws below were counted in.
    statement: (i64, i64),
    drawn_in_statement: u64,
}

thread_local! {
    static HELD: RefCell<HashMap<pg_sys::Oid, Held>> = RefCell::new(HashMap::new());
    /// The sequence `lastval` reports, when it was drawn here rather than by PostgreSQL.
    static LAST: Cell<Option<pg_sys::Oid>> = const { Cell::new(None) };
    /// Set while internal SQL must reach PostgreSQL's own functions.
    static LOCAL_ONLY: Cell<bool> = const { Cell::new(false) };
    /// Set while this node applies another node's schema change: it proposes nothing.
    static APPLYING: Cell<bool> = const { Cell::new(false) };
    /// Sequences restarted by this transaction (`ALTER SEQUENCE … RESTART`,
    /// `TRUNCATE … RESTART IDENTITY`), with the subtransaction that did it.
    static RESTARTS: RefCell<Vec<(pg_sys::SubTransactionId, pg_sys::Oid, SequenceValue)>> =
        const { RefCell::new(Vec::new()) };
}

/// Sets a flag for a scope; restores it when the scope ends, also by an error unwinding.
struct Flag(&'static std::thread::LocalKey<Cell<bool>>, bool);

impl Flag {
    fn set(key: &'static std::thread::LocalKey<Cell<bool>>) -> Flag {
        Flag(key, key.with(|f| f.replace(true)))
    }
}

impl Drop for Flag {
    fn drop(&mut self) {
        let was = self.1;
        self.0.with(|f| f.set(was));
    }
}

/// Runs `f` with sequence calls in it left to PostgreSQL (internal SQL that sets this
/// node's copy of a sequence, e.g. a table rebuilt under its name).
pub fn local_only<R>(f: impl FnOnce() -> R) -> R {
    let _flag = Flag::set(&LOCAL_ONLY);
    f()
}

/// Runs `f`, another node's schema change being applied: it proposes no counter change.
pub fn applying<R>(f: impl FnOnce() -> R) -> R {
    let _flag = Flag::set(&APPLYING);
    f()
}

/// Whether this backend is applying another node's schema change now.
pub fn applying_change() -> bool {
    APPLYING.with(|a| a.get())
}

/// A relation was invalidated (`ALTER SEQUENCE` among others): PostgreSQL forgets the
/// values a session holds then, and so does this.
pub fn forget(relid: pg_sys::Oid) {
    HELD.with(|h| {
        let mut h = h.borrow_mut();
        if relid == pg_sys::InvalidOid {
            h.values_mut().for_each(|held| held.left = 0);
        } else if let Some(held) = h.get_mut(&relid) {
            held.left = 0;
        }
    });
}

// ---------------------------------------------------------------------------------------
// The planner hook's part.

/// The extension's replacements for PostgreSQL's sequence functions, by the OID replaced.
struct Targets {
    map: [(pg_sys::Oid, pg_sys::Oid); 5],
    nextval: pg_sys::Oid,
}

impl Targets {
    fn lookup() -> Option<Targets> {
        #[allow(unsafe_code)]
        let f = |name: &str, args: &[pg_sys::Oid]| -> Option<pg_sys::Oid> {
            let qualified = std::ffi::CString::new(format!("multiregion.{name}")).ok()?;
            // SAFETY: builds a name list from a NUL-terminated string and looks the function
            // up in the catalog; both only read shared state and allocate in the current
            // memory context. `missing_ok` makes a missing function an InvalidOid.
            let oid = unsafe {
                let names = pg_sys::stringToQualifiedNameList(qualified.as_ptr());
                pg_sys::LookupFuncName(names, args.len() as i32, args.as_ptr(), true)
            };
            (oid != pg_sys::InvalidOid).then_some(oid)
        };
        use pg_sys::{BOOLOID, INT8OID, REGCLASSOID};
        let nextval = f("nextval", &[REGCLASSOID])?;
        Some(Targets {
            map: [
                (pg_sys::Oid::from(pg_sys::F_NEXTVAL), nextval),
                (
                    pg_sys::Oid::from(pg_sys::F_CURRVAL),
                    f("currval", &[REGCLASSOID])?,
                ),
                (
                    pg_sys::Oid::from(pg_sys::F_SETVAL_REGCLASS_INT8),
                    f("setval", &[REGCLASSOID, INT8OID])?,
                ),
                (
                    pg_sys::Oid::from(pg_sys::F_SETVAL_REGCLASS_INT8_BOOL),
                    f("setval", &[REGCLASSOID, INT8OID, BOOLOID])?,
                ),
                (pg_sys::Oid::from(pg_sys::F_LASTVAL), f("lastval", &[])?),
            ],
            nextval,
        })
    }

    fn replacement(&self, funcid: pg_sys::Oid) -> Option<pg_sys::Oid> {
        self.map.iter().find(|(f, _)| *f == funcid).map(|(_, t)| *t)
    }
}

fn is_sequence_function(funcid: pg_sys::Oid) -> bool {
    [
        pg_sys::F_NEXTVAL,
        pg_sys::F_CURRVAL,
        pg_sys::F_SETVAL_REGCLASS_INT8,
        pg_sys::F_SETVAL_REGCLASS_INT8_BOOL,
        pg_sys::F_LASTVAL,
    ]
    .iter()
    .any(|f| pg_sys::Oid::from(*f) == funcid)
}

type Mutator = unsafe extern "C-unwind" fn() -> *mut pg_sys::Node;

/// Points the query's sequence calls at the extension's functions, unless the session
/// applies replicated rows (whose `setval`s move this node's copy only), runs internal SQL
/// ([`local_only`]), has no pgmr, or the extension is not installed in this database.
///
/// # Safety
/// `query` is the Query the planner is about to plan, ours to change.
#[allow(unsafe_code)]
pub unsafe fn redirect(query: *mut pg_sys::Query) {
    // SAFETY: reads of backend-local settings.
    let replica = unsafe {
        pg_sys::SessionReplicationRole == pg_sys::SESSION_REPLICATION_ROLE_REPLICA as i32
    };
    if query.is_null()
        || replica
        || LOCAL_ONLY.with(|l| l.get())
        || gucs::sidecar_socket().is_none()
    {
        return;
    }
    // SAFETY: walks the Query PostgreSQL passed, with the walker contract of nodeFuncs.c:
    // the callback receives each node of the tree and our (unused) context.
    let found =
        unsafe { pg_sys::query_tree_walker(query, Some(mentions), std::ptr::null_mut(), 0) };
    if !found {
        return;
    }
    let Some(targets) = Targets::lookup() else {
        return;
    };
    // SAFETY: as above, with nodeFuncs.c's mutator contract; QTW_DONT_COPY_QUERY changes the
    // top-level Query in place (the planner plans the pointer it gave us), and the context
    // outlives the call.
    unsafe {
        pg_sys::query_tree_mutator(
            query,
            Some(std::mem::transmute::<
                unsafe extern "C-unwind" fn(*mut pg_sys::Node, *mut c_void) -> *mut pg_sys::Node,
                Mutator,
            >(replace)),
            &targets as *const Targets as *mut c_void,
            pg_sys::QTW_DONT_COPY_QUERY as i32,
        );
    }
}

#[allow(unsafe_code)]
unsafe extern "C-unwind" fn mentions(node: *mut pg_sys::Node, cx: *mut c_void) -> bool {
    if node.is_null() {
        return false;
    }
    // SAFETY: `node` is a valid node of the tree being walked; its tag says which struct it
    // is, and each cast below follows the tag.
    unsafe {
        match (*node).type_ {
            pg_sys::NodeTag::T_NextValueExpr => return true,
            pg_sys::NodeTag::T_FuncExpr
                if is_sequence_function((*(node as *mut pg_sys::FuncExpr)).funcid) =>
            {
                return true
            }
            pg_sys::NodeTag::T_Query => {
                return pg_sys::query_tree_walker(node as *mut pg_sys::Query, Some(mentions), cx, 0)
            }
            _ => {}
        }
        pg_sys::expression_tree_walker(node, Some(mentions), cx)
    }
}

#[allow(unsafe_code)]
unsafe extern "C-unwind" fn replace(node: *mut pg_sys::Node, cx: *mut c_void) -> *mut pg_sys::Node {
    if node.is_null() {
        return node;
    }
    // SAFETY: as in `mentions`; `cx` is the `Targets` that `redirect` passed, alive for the
    // whole mutation. New nodes are allocated in the planner's memory context.
    unsafe {
        let targets = &*(cx as *const Targets);
        let mutator = std::mem::transmute::<
            unsafe extern "C-unwind" fn(*mut pg_sys::Node, *mut c_void) -> *mut pg_sys::Node,
            Mutator,
        >(replace);
        match (*node).type_ {
            pg_sys::NodeTag::T_Query => {
                return pg_sys::query_tree_mutator(node as *mut pg_sys::Query, Some(mutator), cx, 0)
                    as *mut pg_sys::Node
            }
            pg_sys::NodeTag::T_NextValueExpr => {
                // An identity column: nextval of its sequence, narrowed to the column's type
                // (its sequence's bounds are the type's, so the cast cannot fail).
                let nv = &*(node as *mut pg_sys::NextValueExpr);
                let seq = pg_sys::makeConst(
                    pg_sys::REGCLASSOID,
                    -1,
                    pg_sys::InvalidOid,
                    4,
                    pg_sys::Datum::from(nv.seqid),
                    false,
                    true,
                );
                let call = pg_sys::makeFuncExpr(
                    targets.nextval,
                    pg_sys::INT8OID,
                    pg_sys::list_make1_impl(
                        pg_sys::NodeTag::T_List,
                        pg_sys::ListCell {
                            ptr_value: seq.cast(),
                        },
                    ),
                    pg_sys::InvalidOid,
                    pg_sys::InvalidOid,
                    pg_sys::CoercionForm::COERCE_EXPLICIT_CALL,
                );
                let narrow = match nv.typeId {
                    pg_sys::INT4OID => Some(pg_sys::F_INT4_INT8),
                    pg_sys::INT2OID => Some(pg_sys::F_INT2_INT8),
                    _ => None,
                };
                return match narrow {
                    Some(f) => pg_sys::makeFuncExpr(
                        pg_sys::Oid::from(f),
                        nv.typeId,
                        pg_sys::list_make1_impl(
                            pg_sys::NodeTag::T_List,
                            pg_sys::ListCell {
                                ptr_value: call.cast(),
                            },
                        ),
                        pg_sys::InvalidOid,
                        pg_sys::InvalidOid,
                        pg_sys::CoercionForm::COERCE_IMPLICIT_CAST,
                    )
                    .cast(),
                    None => call.cast(),
                };
            }
            _ => {}
        }
        let new = pg_sys::expression_tree_mutator(node, Some(mutator), cx);
        if !new.is_null() && (*new).type_ == pg_sys::NodeTag::T_FuncExpr {
            let f = &mut *(new as *mut pg_sys::FuncExpr);
            if let Some(to) = targets.replacement(f.funcid) {
                f.funcid = to;
            }
        }
        new
    }
}

// ---------------------------------------------------------------------------------------
// The functions calls are pointed at.

/// What a draw needs to know about a sequence.
struct Info {
    oid: pg_sys::Oid,
    key: TableRef,
    display: String,
    params: SequenceParams,
    cache: i64,
    local: SequenceValue,
}

/// Whether the sequence's values come from the meta group: a permanent sequence of a user
/// schema, with pgmr to ask.
fn cluster_wide(rel: &PgRelation) -> bool {
    let persistent = rel.rd_rel.is_null() || {
        // SAFETY: `rd_rel` of an open relation is its valid pg_class row.
        #[allow(unsafe_code)]
        unsafe {
            (*rel.rd_rel).relpersistence == pg_sys::RELPERSISTENCE_PERMANENT as std::ffi::c_char
        }
    };
    persistent
        && gucs::sidecar_socket().is_some()
        && !LOCAL_ONLY.with(|l| l.get())
        && !matches!(
            rel.namespace(),
            "pg_catalog" | "information_schema" | "multiregion" | "multiregion_keys"
        )
}

fn check_sequence(rel: &PgRelation) -> Result<(), MrError> {
    // SAFETY: as in `cluster_wide`.
    #[allow(unsafe_code)]
    let kind = unsafe { (*rel.rd_rel).relkind };
    if kind != pg_sys::RELKIND_SEQUENCE as std::ffi::c_char {
        return Err(MrError::NotASequence(rel.name().to_string()));
    }
    Ok(())
}

fn check_privilege(rel: &PgRelation, mode: u32) -> Result<(), MrError> {
    // SAFETY: a catalog lookup of the current user's privileges on an open relation.
    #[allow(unsafe_code)]
    let ok = unsafe {
        pg_sys::pg_class_aclcheck(rel.oid(), pg_sys::GetUserId(), mode as pg_sys::AclMode)
            == pg_sys::AclResult::ACLCHECK_OK
    };
    if ok {
        Ok(())
    } else {
        Err(MrError::SequencePermission(rel.name().to_string()))
    }
}

/// PostgreSQL's `nextval`, drawing from the sequence's cluster-wide counter.
#[pg_extern(schema = "multiregion", name = "nextval", volatile, parallel_unsafe)]
fn mr_nextval(seq: PgRelation) -> i64 {
    nextval(&seq).or_raise()
}

#[allow(unsafe_code)]
fn nextval(rel: &PgRelation) -> Result<i64, MrError> {
    check_sequence(rel)?;
    if !cluster_wide(rel) {
        return Ok(local_nextval(rel.oid()));
    }
    check_privilege(rel, pg_sys::ACL_USAGE | pg_sys::ACL_UPDATE)?;
    // SAFETY: PostgreSQL's own checks for a sequence write, with its command name.
    unsafe {
        pg_sys::PreventCommandIfReadOnly(c"nextval()".as_ptr());
        pg_sys::PreventCommandIfParallelMode(c"nextval()".as_ptr());
    }
    let oid = rel.oid();
    restart_now(oid)?;
    // SAFETY: reads the backend's transaction and statement start times.
    let statement = unsafe {
        (
            pg_sys::GetCurrentTransactionStartTimestamp(),
            pg_sys::GetCurrentStatementStartTimestamp(),
        )
    };
    let held = HELD.with(|h| {
        let mut h = h.borrow_mut();
        let held = h.entry(oid).or_default();
        if held.statement != statement {
            held.statement = statement;
            held.drawn_in_statement = 0;
        }
        held.drawn_in_statement += 1;
        (held.left > 0).then(|| {
            let v = held.next;
            held.next = v.wrapping_add(held.increment);
            held.left -= 1;
            held.current = Some(v);
            v
        })
    });
    if let Some(v) = held {
        LAST.with(|l| l.set(Some(oid)));
        return Ok(v);
    }
    let info = info(rel)?;
    let drawn = HELD.with(|h| h.borrow().get(&oid).map_or(1, |h| h.drawn_in_statement));
    let count = block_size(info.cache, drawn);
    let draw = sidecar::next_sequence_values(mr_wire::local::LocalRequest::NextSequenceValues {
        sequence: info.key.clone(),
        params: info.params,
        initial: info.local,
        count,
    })?;
    let (first, count) = match draw {
        Draw::Values { first, count } => (first, count),
        Draw::Limit(limit) => {
            return Err(MrError::SequenceLimit {
                sequence: info.display,
                limit,
                ascending: info.params.increment > 0,
            })
        }
        Draw::NotReplicated => {
            HELD.with(|h| h.borrow_mut().remove(&oid));
            LAST.with(|l| l.set(None));
            return Ok(local_nextval(oid));
        }
    };
    let inc = info.params.increment;
    let last = first.wrapping_add(inc.wrapping_mul(count as i64 - 1));
    HELD.with(|h| {
        let mut h = h.borrow_mut();
        let held = h.entry(oid).or_default();
        held.next = first.wrapping_add(inc);
        held.left = count - 1;
        held.increment = inc;
        held.current = Some(first);
    });
    LAST.with(|l| l.set(Some(oid)));
    advance_local_copy(&info, last);
    Ok(first)
}

/// How many values to draw: the sequence's `CACHE`, or within one statement that has drawn
/// `drawn` values of it already, about as many again (1, 1, 2, 4, … up to [`MAX_BLOCK`]), so
/// that `INSERT … SELECT` of many rows costs a few meta-group writes, not one per row. The
/// values left over stay with the session, as a `CACHE` does.
fn block_size(cache: i64, drawn: u64) -> u64 {
    let cache = u64::try_from(cache).unwrap_or(1).max(1);
    cache.max((drawn.saturating_sub(1)).min(MAX_BLOCK))
}

/// The sequence's key, parameters and this node's copy of its state.
fn info(rel: &PgRelation) -> Result<Info, MrError> {
    let oid = rel.oid();
    let row = spi::read_rows(
        "SELECT n.nspname::text, c.relname::text, coalesce(k.nspname, n.nspname)::text, \
                coalesce(k.relname, c.relname)::text, s.seqstart::text, s.seqincrement::text, \
                s.seqmin::text, s.seqmax::text, s.seqcycle::text, s.seqcache::text \
           FROM pg_catalog.pg_sequence s \
           JOIN pg_catalog.pg_class c ON c.oid = s.seqrelid \
           JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
           LEFT JOIN multiregion.sequence_keys k ON k.seq = s.seqrelid \
          WHERE s.seqrelid = $1",
        vec![oid.into()],
    )
    .into_iter()
    .next()
    .ok_or_else(|| MrError::NotASequence(rel.name().to_string()))?;
    let text = |i: usize| row.get(i).cloned().flatten().unwrap_or_default();
    let int = |i: usize| text(i).parse::<i64>().unwrap_or_default();
    let qualified = format!("{}.{}", spi::ident(&text(0)), spi::ident(&text(1)));
    let local = as_superuser(|| {
        spi::read_rows(
            &format!("SELECT last_value::text, is_called::text FROM {qualified}"),
            vec![],
        )
    });
    let local = local.first().map_or(
        SequenceValue {
            last: int(4),
            is_called: false,
        },
        |r| SequenceValue {
            last: r
                .first()
                .cloned()
                .flatten()
                .and_then(|v| v.parse().ok())
                .unwrap_or(int(4)),
            is_called: r.get(1).cloned().flatten().as_deref() == Some("true"),
        },
    );
    Ok(Info {
        oid,
        key: TableRef {
            database: crate::regions::catalog::database_name(),
            schema: text(2),
            table: text(3),
        },
        display: text(1),
        params: SequenceParams {
            start: int(4),
            increment: int(5),
            min: int(6),
            max: int(7),
            cycle: text(8) == "true",
        },
        cache: int(9),
        local,
    })
}

/// Moves this node's copy of the sequence to `last` if it is behind.
#[allow(unsafe_code)]
fn advance_local_copy(info: &Info, last: i64) {
    let behind = if info.params.increment > 0 {
        info.local.last < last
    } else {
        info.local.last > last
    };
    if !behind {
        return;
    }
    as_superuser(|| {
        // SAFETY: PostgreSQL's setval(regclass, bigint, bool), called directly (not through
        // the planner, which would point it back here) with three non-null arguments.
        unsafe {
            pgrx::direct_function_call::<i64>(
                pg_sys::setval3_oid,
                &[info.oid.into_datum(), last.into_datum(), true.into_datum()],
            )
        }
    });
}

/// PostgreSQL's own nextval on this node's copy.
#[allow(unsafe_code)]
fn local_nextval(oid: pg_sys::Oid) -> i64 {
    // SAFETY: PostgreSQL's nextval(regclass) with one non-null argument; it checks privileges
    // and raises its own errors.
    unsafe { pgrx::direct_function_call::<i64>(pg_sys::nextval_oid, &[oid.into_datum()]) }
        .unwrap_or_default()
}

/// Runs `f` as the bootstrap superuser (reading and moving this node's copy of a sequence
/// the caller may only use); the (sub)transaction's abort restores the user on error.
#[allow(unsafe_code)]
pub(crate) fn as_superuser<R>(f: impl FnOnce() -> R) -> R {
    let (mut user, mut context) = (pg_sys::InvalidOid, 0);
    // SAFETY: reads and writes the backend's current user id, as SECURITY DEFINER does.
    unsafe {
        pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
        pg_sys::SetUserIdAndSecContext(
            pg_sys::BOOTSTRAP_SUPERUSERID.into(),
            context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32,
        );
    }
    let out = f();
    // SAFETY: restores what was saved.
    unsafe { pg_sys::SetUserIdAndSecContext(user, context) };
    out
}

/// PostgreSQL's `currval`: the value this session drew last from the sequence.
#[pg_extern(schema = "multiregion", name = "currval", volatile, parallel_unsafe)]
#[allow(unsafe_code)]
fn mr_currval(seq: PgRelation) -> i64 {
    check_sequence(&seq).or_raise();
    check_privilege(&seq, pg_sys::ACL_SELECT | pg_sys::ACL_USAGE).or_raise();
    match HELD.with(|h| h.borrow().get(&seq.oid()).and_then(|h| h.current)) {
        Some(v) => v,
        // SAFETY: PostgreSQL's currval(regclass) with one non-null argument.
        None => unsafe {
            pgrx::direct_function_call::<i64>(pg_sys::currval_oid, &[seq.oid().into_datum()])
        }
        .unwrap_or_default(),
    }
}

/// PostgreSQL's `lastval`.
#[pg_extern(schema = "multiregion", name = "lastval", volatile, parallel_unsafe)]
#[allow(unsafe_code)]
fn mr_lastval() -> i64 {
    let held = LAST.with(|l| l.get()).and_then(|oid| {
        // SAFETY: a syscache probe by OID.
        let exists = unsafe {
            pg_sys::SearchSysCacheExists(
                pg_sys::SysCacheIdentifier::RELOID as i32,
                oid.into_datum().unwrap_or(pg_sys::Datum::from(0)),
                pg_sys::Datum::from(0),
                pg_sys::Datum::from(0),
                pg_sys::Datum::from(0),
            )
        };
        exists
            .then(|| HELD.with(|h| h.borrow().get(&oid).and_then(|h| h.current)))
            .flatten()
    });
    match held {
        Some(v) => v,
        // SAFETY: PostgreSQL's lastval() without arguments.
        None => {
            unsafe { pgrx::direct_function_call::<i64>(pg_sys::lastval, &[]) }.unwrap_or_default()
        }
    }
}

/// PostgreSQL's `setval(regclass, bigint)`.
#[pg_extern(schema = "multiregion", name = "setval", volatile, parallel_unsafe)]
fn mr_setval(seq: PgRelation, value: i64) -> i64 {
    setval(&seq, value, true).or_raise()
}

/// PostgreSQL's `setval(regclass, bigint, boolean)`.
#[pg_extern(schema = "multiregion", name = "setval", volatile, parallel_unsafe)]
fn mr_setval3(seq: PgRelation, value: i64, is_called: bool) -> i64 {
    setval(&seq, value, is_called).or_raise()
}

/// Sets this node's copy first (PostgreSQL checks the value against the bounds, the
/// privileges and the transaction), then the counter; like PostgreSQL's, not rolled back.
#[allow(unsafe_code)]
fn setval(rel: &PgRelation, value: i64, is_called: bool) -> Result<i64, MrError> {
    // SAFETY: PostgreSQL's setval(regclass, bigint, bool) with three non-null arguments.
    unsafe {
        pgrx::direct_function_call::<i64>(
            pg_sys::setval3_oid,
            &[
                rel.oid().into_datum(),
                value.into_datum(),
                is_called.into_datum(),
            ],
        )
    };
    if !cluster_wide(rel) {
        return Ok(value);
    }
    let info = info(rel)?;
    let value_set = SequenceValue {
        last: value,
        is_called,
    };
    sidecar::change_sequences(vec![SequenceChange::Set {
        sequence: info.key,
        value: value_set,
    }])?;
    HELD.with(|h| {
        let mut h = h.borrow_mut();
        let held = h.entry(rel.oid()).or_default();
        held.left = 0;
        if is_called {
            held.current = Some(value);
        }
    });
    Ok(value)
}

// ---------------------------------------------------------------------------------------
// DDL: counters follow drops, renames and restarts.

/// Records a restart of sequence `oid` by this transaction, to its value in this node's
/// copy now (`ALTER SEQUENCE … RESTART`) or to `value`.
pub fn restarted(oid: pg_sys::Oid, value: Option<SequenceValue>) {
    if APPLYING.with(|a| a.get()) || crate::routing::serving() || gucs::sidecar_socket().is_none() {
        return;
    }
    let value = value.or_else(|| {
        let qualified = spi::read_one("SELECT $1::regclass::text", vec![oid.into()])?;
        let row = as_superuser(|| {
            spi::read_rows(
                &format!("SELECT last_value::text, is_called::text FROM {qualified}"),
                vec![],
            )
        });
        let r = row.first()?;
        Some(SequenceValue {
            last: r.first().cloned().flatten()?.parse().ok()?,
            is_called: r.get(1).cloned().flatten().as_deref() == Some("true"),
        })
    });
    let Some(value) = value else { return };
    // SAFETY: reads the current subtransaction's id.
    #[allow(unsafe_code)]
    let sub = unsafe { pg_sys::GetCurrentSubTransactionId() };
    RESTARTS.with(|r| r.borrow_mut().push((sub, oid, value)));
}

/// The sequences `TRUNCATE … RESTART IDENTITY` of these tables restarts, at their start.
pub fn truncate_restarts(tables: &[pg_sys::Oid]) {
    for t in tables {
        let rows = spi::read_rows(
            "SELECT d.objid::text, s.seqstart::text \
               FROM pg_catalog.pg_depend d \
               JOIN pg_catalog.pg_sequence s ON s.seqrelid = d.objid \
              WHERE d.classid = 'pg_catalog.pg_class'::regclass \
                AND d.refclassid = 'pg_catalog.pg_class'::regclass \
                AND d.refobjid = $1 AND d.deptype IN ('a', 'i')",
            vec![(*t).into()],
        );
        for r in rows {
            let (Some(Some(seq)), Some(Some(start))) = (r.first(), r.get(1)) else {
                continue;
            };
            let (Ok(seq), Ok(start)) = (seq.parse::<u32>(), start.parse::<i64>()) else {
                continue;
            };
            restarted(
                pg_sys::Oid::from(seq),
                Some(SequenceValue {
                    last: start,
                    is_called: false,
                }),
            );
        }
    }
}

pub fn sub_aborted(sub: pg_sys::SubTransactionId) {
    RESTARTS.with(|r| r.borrow_mut().retain(|(s, _, _)| *s < sub));
}

pub fn at_end() {
    RESTARTS.with(|r| r.borrow_mut().clear());
}

/// The eligible sequences of this database, by OID, with their names.
const SEQUENCES: &str = "SELECT c.oid::text, n.nspname::text, c.relname::text \
       FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
      WHERE c.relkind = 'S' AND c.relpersistence = 'p' \
        AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'multiregion', 'multiregion_keys') \
        AND n.nspname NOT LIKE 'pg\\_%'";

fn by_oid(rows: Vec<Vec<Option<String>>>) -> BTreeMap<u32, SequenceName> {
    rows.into_iter()
        .filter_map(|r| {
            let oid = r.first()?.as_deref()?.parse().ok()?;
            Some((oid, (r.get(1)?.clone()?, r.get(2)?.clone()?)))
        })
        .collect()
}

/// Brings `multiregion.sequence_keys` up to date with the catalog; what changed.
fn sync_keys(database: &str) -> Vec<SequenceChange> {
    let before = by_oid(spi::rows(
        "SELECT seq::text, nspname::text, relname::text FROM multiregion.sequence_keys",
        vec![],
    ));
    let after = by_oid(spi::rows(SEQUENCES, vec![]));
    if before == after {
        return Vec::new();
    }
    let changes = mr_meta::sequence::changes(database, &before, &after);
    spi::as_extension_owner(|| {
        spi::run(&format!(
            "DELETE FROM multiregion.sequence_keys k WHERE NOT EXISTS \
               (SELECT FROM ({SEQUENCES}) s(oid, nspname, relname) WHERE s.oid::oid = k.seq)"
        ));
        spi::run(&format!(
            "INSERT INTO multiregion.sequence_keys (seq, nspname, relname) \
             SELECT oid::oid, nspname, relname FROM ({SEQUENCES}) s(oid, nspname, relname) \
             ON CONFLICT (seq) DO UPDATE SET nspname = excluded.nspname, relname = excluded.relname"
        ));
    });
    changes
}

/// At the commit of a schema change on its origin: what it does to the counters (drops and
/// renames, then restarts), to be committed with it.
pub fn at_commit(database: &str) -> Vec<SequenceChange> {
    let mut changes = sync_keys(database);
    changes.extend(take_restarts(database));
    changes
}

/// A sequence this transaction restarted (`TRUNCATE … RESTART IDENTITY`, `ALTER SEQUENCE …
/// RESTART`) and now draws from: the transaction must see the restart, as in PostgreSQL, so
/// its counter is set now rather than at commit (if the transaction then rolls back, the
/// counter stays restarted: a key drawn again is refused by its unique index, not repeated
/// silently where one exists).
fn restart_now(oid: pg_sys::Oid) -> Result<(), MrError> {
    let mine: Vec<SequenceValue> = RESTARTS.with(|r| {
        let mut r = r.borrow_mut();
        let mine = r
            .iter()
            .filter(|(_, o, _)| *o == oid)
            .map(|(_, _, v)| *v)
            .collect();
        r.retain(|(_, o, _)| *o != oid);
        mine
    });
    let Some(value) = mine.last().copied() else {
        return Ok(());
    };
    let row = spi::read_rows(
        "SELECT coalesce(k.nspname, n.nspname)::text, coalesce(k.relname, c.relname)::text \
           FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
           LEFT JOIN multiregion.sequence_keys k ON k.seq = c.oid WHERE c.oid = $1",
        vec![oid.into()],
    );
    let Some((Some(schema), Some(table))) = row
        .first()
        .map(|r| (r.first().cloned().flatten(), r.get(1).cloned().flatten()))
    else {
        return Ok(());
    };
    sidecar::change_sequences(vec![SequenceChange::Set {
        sequence: TableRef {
            database: crate::regions::catalog::database_name(),
            schema,
            table,
        },
        value,
    }])?;
    HELD.with(|h| {
        if let Some(held) = h.borrow_mut().get_mut(&oid) {
            held.left = 0;
        }
    });
    Ok(())
}

fn take_restarts(database: &str) -> Vec<SequenceChange> {
    let restarts = RESTARTS.with(|r| std::mem::take(&mut *r.borrow_mut()));
    restarts
        .into_iter()
        .filter_map(|(_, oid, value)| {
            let row = spi::rows(
                "SELECT n.nspname::text, c.relname::text FROM pg_catalog.pg_class c \
                   JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1",
                vec![oid.into()],
            );
            let r = row.first()?;
            Some(SequenceChange::Set {
                sequence: TableRef {
                    database: database.to_string(),
                    schema: r.first()?.clone()?,
                    table: r.get(1)?.clone()?,
                },
                value,
            })
        })
        .collect()
}

/// At pre-commit of a transaction without a schema change (a `TRUNCATE … RESTART
/// IDENTITY`): its restarts, set before it commits.
pub fn pre_commit() -> Result<(), MrError> {
    if RESTARTS.with(|r| r.borrow().is_empty()) {
        return Ok(());
    }
    let changes = take_restarts(&crate::regions::catalog::database_name());
    if !changes.is_empty() {
        sidecar::change_sequences(changes)?;
    }
    Ok(())
}

/// After this node applied another node's schema change: its copy of the keys follows.
pub fn after_apply() {
    sync_keys(&crate::regions::catalog::database_name());
}

/// The node pointers of a PostgreSQL `List`.
///
/// # Safety
/// `list` is null or a valid pointer List.
#[allow(unsafe_code)]
unsafe fn nodes(list: *mut pg_sys::List) -> Vec<*mut pg_sys::Node> {
    if list.is_null() {
        return Vec::new();
    }
    // SAFETY: per the contract, `elements` holds `length` cells of a pointer list.
    unsafe {
        let l = &*list;
        (0..l.length as usize)
            .map(|i| (*l.elements.add(i)).ptr_value as *mut pg_sys::Node)
            .collect()
    }
}

/// Whether a DefElem list (of CREATE/ALTER SEQUENCE or an identity column) restarts.
///
/// # Safety
/// `options` is null or a valid List of DefElem.
#[allow(unsafe_code)]
unsafe fn restarts(options: *mut pg_sys::List) -> bool {
    // SAFETY: per the contract.
    unsafe { nodes(options) }.into_iter().any(|n| {
        // SAFETY: each element is a DefElem with a NUL-terminated name.
        unsafe {
            !n.is_null()
                && (*n).type_ == pg_sys::NodeTag::T_DefElem
                && std::ffi::CStr::from_ptr((*(n as *mut pg_sys::DefElem)).defname).to_bytes()
                    == b"restart"
        }
    })
}

/// Before a utility statement runs: `TRUNCATE … RESTART IDENTITY` restarts the sequences
/// its tables own (recorded now: the statement may run at other nodes' leaseholders).
///
/// # Safety
/// `pstmt` is the statement PostgreSQL is about to run.
#[allow(unsafe_code)]
pub unsafe fn before_utility(pstmt: &pg_sys::PlannedStmt) {
    let node = pstmt.utilityStmt;
    // SAFETY: the tag says which statement it is; a TruncateStmt's relations are RangeVars.
    unsafe {
        if node.is_null() || (*node).type_ != pg_sys::NodeTag::T_TruncateStmt {
            return;
        }
        let stmt = &*(node as *mut pg_sys::TruncateStmt);
        if !stmt.restart_seqs || gucs::sidecar_socket().is_none() {
            return;
        }
        let tables: Vec<pg_sys::Oid> = nodes(stmt.relations)
            .into_iter()
            .filter_map(|rv| crate::regions::catalog::relid_of(rv as *mut pg_sys::RangeVar))
            .collect();
        truncate_restarts(&tables);
    }
}

/// After a utility statement ran: `ALTER SEQUENCE … RESTART` and `ALTER TABLE … ALTER
/// COLUMN … RESTART` (an identity column) are recorded with the value they set.
///
/// # Safety
/// `pstmt` is the statement PostgreSQL has just run.
#[allow(unsafe_code)]
pub unsafe fn after_utility(pstmt: &pg_sys::PlannedStmt) {
    let node = pstmt.utilityStmt;
    if node.is_null() || gucs::sidecar_socket().is_none() {
        return;
    }
    // SAFETY: the tag says which statement it is; the fields read are those of that struct.
    unsafe {
        match (*node).type_ {
            pg_sys::NodeTag::T_AlterSeqStmt => {
                let stmt = &*(node as *mut pg_sys::AlterSeqStmt);
                if restarts(stmt.options) {
                    if let Some(oid) = crate::regions::catalog::relid_of(stmt.sequence) {
                        restarted(oid, None);
                    }
                }
            }
            pg_sys::NodeTag::T_AlterTableStmt => {
                let stmt = &*(node as *mut pg_sys::AlterTableStmt);
                let Some(table) = crate::regions::catalog::relid_of(stmt.relation) else {
                    return;
                };
                for cmd in nodes(stmt.cmds) {
                    let cmd = &*(cmd as *mut pg_sys::AlterTableCmd);
                    if cmd.subtype != pg_sys::AlterTableType::AT_SetIdentity
                        || !restarts(cmd.def as *mut pg_sys::List)
                        || cmd.name.is_null()
                    {
                        continue;
                    }
                    let column = std::ffi::CStr::from_ptr(cmd.name).to_string_lossy();
                    let seq = spi::read_one(
                        "SELECT pg_catalog.pg_get_serial_sequence($1::regclass::text, $2)::regclass::oid::text",
                        vec![table.into(), column.as_ref().into()],
                    );
                    if let Some(seq) = seq.and_then(|s| s.parse::<u32>().ok()) {
                        restarted(pg_sys::Oid::from(seq), None);
                    }
                }
            }
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------------------
// COPY: column defaults are evaluated without the planner.

/// A COPY's table and the columns it leaves to a sequence's value, with their sequences.
#[derive(Clone)]
pub struct CopyDefaults {
    pub schema: String,
    pub table: String,
    pub columns: Vec<(String, pg_sys::Oid)>,
}

/// For a `COPY … FROM` with a column list: its table, and the columns it leaves to a
/// default that is just a cluster-wide sequence's `nextval` (serial, identity), with that
/// sequence. PostgreSQL draws those from this node's copy; the routing trigger then draws
/// each row's value again from the counter ([`draw_into`]).
///
/// # Safety
/// `stmt` is a valid COPY FROM statement with a relation.
#[allow(unsafe_code)]
pub unsafe fn copy_defaults(stmt: &pg_sys::CopyStmt) -> Option<CopyDefaults> {
    if stmt.attlist.is_null() || LOCAL_ONLY.with(|l| l.get()) {
        return None;
    }
    // SAFETY: per the contract; the column list holds String nodes.
    let listed: Vec<String> = unsafe { nodes(stmt.attlist) }
        .into_iter()
        .filter_map(|n| {
            // SAFETY: a String node's NUL-terminated value.
            unsafe {
                (!n.is_null() && (*n).type_ == pg_sys::NodeTag::T_String).then(|| {
                    std::ffi::CStr::from_ptr((*(n as *mut pg_sys::String)).sval)
                        .to_string_lossy()
                        .into_owned()
                })
            }
        })
        .collect();
    // SAFETY: per the contract.
    let relid = unsafe { crate::regions::catalog::relid_of(stmt.relation) }?;
    let rows = spi::read_rows(
        "SELECT n.nspname::text, c.relname::text, a.attname::text, s.oid::text \
           FROM pg_catalog.pg_attribute a \
           JOIN pg_catalog.pg_class c ON c.oid = a.attrelid \
           JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
           CROSS JOIN LATERAL ( \
             SELECT d.refobjid AS oid FROM pg_catalog.pg_attrdef ad \
               JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_attrdef'::regclass \
                AND d.objid = ad.oid AND d.refclassid = 'pg_catalog.pg_class'::regclass \
              WHERE ad.adrelid = a.attrelid AND ad.adnum = a.attnum \
                AND pg_catalog.pg_get_expr(ad.adbin, ad.adrelid) ~ '^nextval\\(''[^'']*''::regclass\\)$' \
             UNION ALL \
             SELECT pg_catalog.pg_get_serial_sequence(a.attrelid::regclass::text, a.attname)::regclass::oid \
              WHERE a.attidentity <> '') s \
           JOIN pg_catalog.pg_class q ON q.oid = s.oid AND q.relkind = 'S' AND q.relpersistence = 'p' \
          WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped",
        vec![relid.into()],
    );
    let mut table = None;
    let columns: Vec<(String, pg_sys::Oid)> = rows
        .into_iter()
        .filter_map(|r| {
            let schema = r.first()?.clone()?;
            let name = r.get(1)?.clone()?;
            let column = r.get(2)?.clone()?;
            let seq = r.get(3)?.as_deref()?.parse::<u32>().ok()?;
            table = Some((schema, name));
            (!listed.contains(&column)).then(|| (column, pg_sys::Oid::from(seq)))
        })
        .collect();
    let (schema, table) = table?;
    (!columns.is_empty()).then_some(CopyDefaults {
        schema,
        table,
        columns,
    })
}

/// A copy of `tuple` (a row of `rel`) with each of `columns` drawn from its sequence.
///
/// # Safety
/// `rel` is the open relation `tuple` belongs to, in a trigger's context.
#[allow(unsafe_code)]
pub unsafe fn draw_into(
    rel: pg_sys::Relation,
    tuple: pg_sys::HeapTuple,
    columns: &[(String, pg_sys::Oid)],
) -> pg_sys::HeapTuple {
    let mut cols = Vec::new();
    let mut values = Vec::new();
    let mut nulls = Vec::new();
    for (column, seq) in columns {
        let Ok(name) = std::ffi::CString::new(column.as_str()) else {
            continue;
        };
        // SAFETY: per the contract; the attribute is looked up by name in the relation's
        // own descriptor, whose type decides the width of the value.
        unsafe {
            let attno = pg_sys::get_attnum((*rel).rd_id, name.as_ptr());
            if attno <= 0 {
                continue;
            }
            let seq_rel = PgRelation::with_lock(*seq, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
            let v = nextval(&seq_rel).or_raise();
            let typ = (*(*rel).rd_att)
                .attrs
                .as_slice((*(*rel).rd_att).natts as usize)[attno as usize - 1]
                .atttypid;
            let datum = match typ {
                pg_sys::INT2OID => i16::try_from(v).ok().into_datum(),
                pg_sys::INT4OID => i32::try_from(v).ok().into_datum(),
                _ => v.into_datum(),
            };
            let Some(datum) = datum else {
                MrError::SequenceLimit {
                    sequence: seq_rel.name().to_string(),
                    limit: v,
                    ascending: v > 0,
                }
                .raise()
            };
            cols.push(attno as i32);
            values.push(datum);
            nulls.push(false);
        }
    }
    if cols.is_empty() {
        return tuple;
    }
    // SAFETY: per the contract; the arrays have one entry per replaced column.
    unsafe {
        pg_sys::heap_modify_tuple_by_cols(
            tuple,
            (*rel).rd_att,
            cols.len() as i32,
            cols.as_mut_ptr(),
            values.as_mut_ptr(),
            nulls.as_mut_ptr(),
        )
    }
}
