//! Where an INSERT's rows go, before it runs: the REGIONAL BY ROW partitions (list values of
//! the partition key) of the rows a `VALUES` list or a single-row `INSERT` writes, so that the
//! statement is routed to the node leasing exactly those partitions instead of being taken as
//! one over every partition (a node would otherwise have to lease them all).
//!
//! The key of each row is computed as the executor will: the row's value for the key column
//! (a constant, a parameter, a default such as `gateway_region()`), or the key column's
//! generation expression over the row (`REGIONAL BY ROW AS region` with a computed region, as
//! the MovR tutorial does). Expressions with volatile functions (`nextval`, `random`) are not
//! evaluated here (they would run twice); a key that depends on one, a subquery, or an
//! `INSERT … SELECT` leaves the statement as one over every partition.

use crate::regions::spi;
use pgrx::pg_sys;
use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::ffi::CStr;

thread_local! {
    /// The list-partition key column of each partitioned table (`None`: not list-partitioned
    /// on one column), by relid, until the relation changes.
    static KEYS: RefCell<HashMap<u32, Option<i16>>> = RefCell::new(HashMap::new());
}

/// Forgets what was cached about `relid` (it changed).
pub fn forget(relid: pg_sys::Oid) {
    KEYS.with(|k| k.borrow_mut().remove(&relid.to_u32()));
}

fn key_column(relid: pg_sys::Oid) -> Option<i16> {
    let key = relid.to_u32();
    if let Some(k) = KEYS.with(|k| k.borrow().get(&key).copied()) {
        return k;
    }
    let attno = spi::read_one(
        "SELECT partattrs[0]::text FROM pg_catalog.pg_partitioned_table \
         WHERE partrelid = $1 AND partstrat = 'l' AND partnatts = 1",
        vec![relid.into()],
    )
    .and_then(|v| v.parse::<i16>().ok())
    .filter(|&a| a > 0);
    KEYS.with(|k| k.borrow_mut().insert(key, attno));
    attno
}

/// The partition key values (as text) of the rows the INSERT `qd` writes into its
/// partitioned target `relid`, or `None` when they cannot be known before it runs.
///
/// # Safety
/// `qd` is a planned INSERT about to start; `relid` is its target, locked by the caller.
#[allow(unsafe_code)]
pub unsafe fn partition_values(
    qd: &pg_sys::QueryDesc,
    relid: pg_sys::Oid,
) -> Option<BTreeSet<String>> {
    let keyattno = key_column(relid)?;
    // SAFETY: the plan tree, its target lists and VALUES lists are valid for the query's life
    // and only read. The expressions evaluated are copies planned for this evaluation in an
    // executor state of their own, freed before returning (and by the memory context reset on
    // error); the relation is locked by the caller and its relcache entry pinned between open
    // and close; the slot is made for the relation's descriptor and dropped before returning.
    unsafe {
        let ps = &*qd.plannedstmt;
        let top = ps.planTree;
        if top.is_null() || (*top).type_ != pg_sys::NodeTag::T_ModifyTable {
            return None;
        }
        let sub = (*top).lefttree;
        if sub.is_null() {
            return None;
        }
        // The target list (column, expression), and for a VALUES scan the lists its Vars
        // read from (one per row); a single-row INSERT's expressions read nothing.
        let tlist = (*sub).targetlist;
        let mut columns: Vec<(i16, *mut pg_sys::Expr)> = Vec::new();
        if !tlist.is_null() {
            for i in 0..(*tlist).length {
                let te = pg_sys::list_nth(tlist, i) as *mut pg_sys::TargetEntry;
                columns.push(((*te).resno, (*te).expr));
            }
        }
        let values_lists: Vec<*mut pg_sys::List> = match (*sub).type_ {
            pg_sys::NodeTag::T_Result if (*sub).lefttree.is_null() => vec![std::ptr::null_mut()],
            pg_sys::NodeTag::T_ValuesScan => {
                let lists = (*(sub as *mut pg_sys::ValuesScan)).values_lists;
                if lists.is_null() {
                    return None;
                }
                (0..(*lists).length)
                    .map(|r| pg_sys::list_nth(lists, r) as *mut pg_sys::List)
                    .collect()
            }
            _ => return None,
        };
        let rel = pg_sys::RelationIdGetRelation(relid);
        if rel.is_null() {
            return None;
        }
        let td = (*rel).rd_att;
        let natts = (*td).natts as usize;
        let key_att = (*td)
            .attrs
            .as_slice(natts)
            .get(keyattno as usize - 1)
            .copied();
        let Some(key_att) = key_att else {
            pg_sys::RelationClose(rel);
            return None;
        };
        let generated = key_att.attgenerated != 0;
        let genexpr = if generated {
            pg_sys::build_column_default(rel, keyattno as i32) as *mut pg_sys::Expr
        } else {
            std::ptr::null_mut()
        };
        let evaluable = |e: *mut pg_sys::Expr| {
            !e.is_null()
                && !pg_sys::contain_volatile_functions(e as *mut pg_sys::Node)
                && !pg_sys::contain_subplans(e as *mut pg_sys::Node)
                && !pg_sys::expression_returns_set(e as *mut pg_sys::Node)
        };
        if generated && !evaluable(genexpr) {
            pg_sys::RelationClose(rel);
            return None;
        }
        let estate = pg_sys::CreateExecutorState();
        let econtext = pg_sys::MakePerTupleExprContext(estate);
        (*econtext).ecxt_param_list_info = qd.params;
        let slot = pg_sys::MakeSingleTupleTableSlot(td, &pg_sys::TTSOpsVirtual);
        // A VALUES row, which the target list's Vars read.
        let first_values = values_lists
            .first()
            .copied()
            .unwrap_or(std::ptr::null_mut());
        let values_slot = if first_values.is_null() {
            std::ptr::null_mut()
        } else {
            let vtd = pg_sys::ExecTypeFromExprList(first_values);
            pg_sys::MakeSingleTupleTableSlot(vtd, &pg_sys::TTSOpsVirtual)
        };
        let gen_state = if generated {
            pg_sys::ExecPrepareExpr(genexpr, estate)
        } else {
            std::ptr::null_mut()
        };
        // Evaluates `state` with `scan` as the row its Vars read.
        let eval = |state: *mut pg_sys::ExprState,
                    scan: *mut pg_sys::TupleTableSlot|
         -> Option<pg_sys::Datum> {
            let f = (*state).evalfunc?;
            (*econtext).ecxt_scantuple = scan;
            let mut isnull = false;
            let old = pg_sys::MemoryContextSwitchTo((*econtext).ecxt_per_tuple_memory);
            let v = pg_sys::ffi::pg_guard_ffi_boundary(|| f(state, econtext, &mut isnull));
            pg_sys::MemoryContextSwitchTo(old);
            (!isnull).then_some(v)
        };
        // Fills `s` (of `n` columns) from `exprs` (1-based column, expression), leaving NULL
        // what cannot be evaluated here; false if `must` (a column) could not be.
        let fill = |s: *mut pg_sys::TupleTableSlot,
                    n: usize,
                    exprs: &[(i16, *mut pg_sys::Expr)],
                    scan: *mut pg_sys::TupleTableSlot,
                    must: Option<i16>|
         -> bool {
            if let Some(clear) = (*(*s).tts_ops).clear {
                clear(s);
            }
            for i in 0..n {
                *(*s).tts_values.add(i) = pg_sys::Datum::from(0);
                *(*s).tts_isnull.add(i) = true;
            }
            let mut ok = true;
            for &(col, expr) in exprs {
                if col < 1 || col as usize > n {
                    continue;
                }
                if !evaluable(expr) {
                    ok &= must != Some(col);
                    continue;
                }
                let state = pg_sys::ExecPrepareExpr(expr, estate);
                if let Some(v) = eval(state, scan) {
                    *(*s).tts_values.add(col as usize - 1) = v;
                    *(*s).tts_isnull.add(col as usize - 1) = false;
                }
            }
            pg_sys::ExecStoreVirtualTuple(s);
            ok
        };
        let (mut out_fn, mut varlena) = (pg_sys::InvalidOid, false);
        pg_sys::getTypeOutputInfo(key_att.atttypid, &mut out_fn, &mut varlena);
        // Without a generation expression only the key column is needed.
        let needed: Vec<(i16, *mut pg_sys::Expr)> = columns
            .iter()
            .copied()
            .filter(|&(col, _)| generated || col == keyattno)
            .collect();
        let mut found = Some(BTreeSet::new());
        for &values in &values_lists {
            if !values.is_null() {
                let exprs: Vec<(i16, *mut pg_sys::Expr)> = (0..(*values).length)
                    .map(|i| {
                        (
                            (i + 1) as i16,
                            pg_sys::list_nth(values, i) as *mut pg_sys::Expr,
                        )
                    })
                    .collect();
                let n = (*(*values_slot).tts_tupleDescriptor).natts as usize;
                fill(values_slot, n, &exprs, std::ptr::null_mut(), None);
            }
            let must = (!generated).then_some(keyattno);
            if !fill(slot, natts, &needed, values_slot, must) {
                found = None;
                break;
            }
            let key = if generated {
                eval(gen_state, slot)
            } else {
                (!*(*slot).tts_isnull.add(keyattno as usize - 1))
                    .then(|| *(*slot).tts_values.add(keyattno as usize - 1))
            };
            let Some(k) = key else {
                found = None;
                break;
            };
            let text = CStr::from_ptr(pg_sys::OidOutputFunctionCall(out_fn, k))
                .to_string_lossy()
                .into_owned();
            if let Some(f) = found.as_mut() {
                f.insert(text);
            }
            pg_sys::MemoryContextReset((*econtext).ecxt_per_tuple_memory);
        }
        if !values_slot.is_null() {
            pg_sys::ExecDropSingleTupleTableSlot(values_slot);
        }
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::FreeExecutorState(estate);
        pg_sys::RelationClose(rel);
        found.filter(|f| !f.is_empty())
    }
}
