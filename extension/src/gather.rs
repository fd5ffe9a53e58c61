//! Reads that need every partition's rows in one place (an aggregate, a sort, a join) over
//! REGIONAL BY ROW tables whose partitions no single node holds (PLACEMENT RESTRICTED:
//! each partition's replicas stay in its region). pgmr answers `gather` for such a read;
//! the statement is then planned again here with each replicated table this node lacks a
//! replica of read through `multiregion.gather_rows(table)`: a plain scan of the table, which
//! runs on each leaseholder over its own partitions (the split read of ARCHITECTURE.md §9)
//! or whole on the leaseholder of a table of one range, and returns the rows, which
//! `jsonb_populate_recordset` turns back into the table's row type. The rest of the plan —
//! filters, aggregates, sorts, joins — runs here over them and the tables held here. An
//! `INSERT … SELECT` is gathered the same way (READ COMMITTED): its target is not, and its
//! rows go to their partitions' leaseholders as any INSERT's do (`crate::moved`).
//!
//! What the leaseholders send is cut down where that cannot change the answer: only the
//! columns the query reads (so column privileges hold as for the query itself), and only the
//! rows that pass the query's WHERE conjuncts over that table alone, when they are immutable
//! and the table is not on the nullable side of an outer join. The conjuncts stay in the
//! plan too; what is still shipped is every such row, once per statement (no aggregate is
//! computed at the leaseholders): the price of a question no node can answer alone.

use crate::error::MrError;
use crate::regions::spi;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::{quote_identifier, quote_literal};
use std::cell::Cell;
use std::ffi::CString;

thread_local! {
    /// Set while a statement is planned again to gather its tables: the planner hook
    /// rewrites them ([`rewrite`]), once.
    static GATHERING: Cell<bool> = const { Cell::new(false) };
    /// The plan last re-planned, or made by re-planning: never re-planned (again).
    static REPLANNED: Cell<usize> = const { Cell::new(0) };
    /// Set while `gather_rows` reads: its scan is never gathered itself (it would gather
    /// again, without end).
    static IN_GATHER: Cell<bool> = const { Cell::new(false) };
}

/// Whether this statement can be planned again with the tables it reads gathered: a plain
/// SELECT, or an INSERT (whose rows then go to their partitions' leaseholders as any
/// INSERT's do), planned here from text this backend has (not already so planned).
///
/// # Safety
/// `qd` is a QueryDesc about to start.
#[allow(unsafe_code)]
pub unsafe fn may_replan(qd: &pg_sys::QueryDesc) -> bool {
    use pg_sys::CmdType::{CMD_INSERT, CMD_SELECT};
    // SAFETY: the planned statement is valid for the query's life.
    unsafe {
        let ps = &*qd.plannedstmt;
        matches!(qd.operation, CMD_SELECT | CMD_INSERT)
            && ps.commandType == qd.operation
            && ps.utilityStmt.is_null()
            && ps.rowMarks.is_null()
            && !ps.hasModifyingCTE
            && !qd.sourceText.is_null()
            && REPLANNED.with(Cell::get) != qd.plannedstmt as usize
            && !IN_GATHER.with(Cell::get)
    }
}

/// Plans the statement again with its tables gathered, and runs that plan instead. The new
/// plan keeps the statement's place in its source text, so that it is forwarded as written
/// if the rest of it runs elsewhere. A statement whose text does not plan to one SELECT
/// keeps its plan.
///
/// # Safety
/// `qd` is a QueryDesc about to start for which [`may_replan`] holds; an active snapshot
/// is set (the executor's).
#[allow(unsafe_code)]
pub unsafe fn replan(qd: &mut pg_sys::QueryDesc) {
    // Never asked again for this plan, whether or not a new one replaces it (a statement
    // whose text is not its query's alone — EXPLAIN ANALYZE, CREATE MATERIALIZED VIEW —
    // keeps it, and is refused as before).
    REPLANNED.with(|r| r.set(qd.plannedstmt as usize));
    // SAFETY: as this function's contract.
    let sql = unsafe { crate::routing::statement_sql(qd) };
    let Ok(text) = CString::new(sql) else {
        return;
    };
    // SAFETY: the parameter list, if any, is valid for the query's life and has no fetch
    // hook (the caller checked), so each entry's type is set.
    let types: Vec<pg_sys::Oid> = unsafe {
        let pl = qd.params;
        if pl.is_null() {
            Vec::new()
        } else {
            let n = (*pl).numParams.max(0) as usize;
            (*pl).params.as_slice(n).iter().map(|p| p.ptype).collect()
        }
    };
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            GATHERING.with(|g| g.set(false));
        }
    }
    let _reset = Reset;
    GATHERING.with(|g| g.set(true));
    // SAFETY: PostgreSQL's own parse, analysis and planning of one statement's text, with
    // the parameter types the first planning had; errors unwind through pgrx's guards.
    unsafe {
        let raw = pg_sys::pg_parse_query(text.as_ptr());
        if raw.is_null() || (*raw).length != 1 {
            return;
        }
        let raw = pg_sys::list_nth(raw, 0) as *mut pg_sys::RawStmt;
        let queries = pg_sys::pg_analyze_and_rewrite_fixedparams(
            raw,
            text.as_ptr(),
            types.as_ptr(),
            types.len() as i32,
            std::ptr::null_mut(),
        );
        if queries.is_null() || (*queries).length != 1 {
            return;
        }
        let query = pg_sys::list_nth(queries, 0) as *mut pg_sys::Query;
        if (*query).commandType != qd.operation || !(*query).utilityStmt.is_null() {
            return;
        }
        let plan = pg_sys::pg_plan_query(query, text.as_ptr(), 0, qd.params);
        let old = &*qd.plannedstmt;
        (*plan).stmt_location = old.stmt_location;
        (*plan).stmt_len = old.stmt_len;
        (*plan).queryId = old.queryId;
        (*plan).canSetTag = old.canSetTag;
        qd.plannedstmt = plan;
        REPLANNED.with(|r| r.set(plan as usize));
    }
}

/// Planner hook, while re-planning: each replicated table the query reads, at any depth
/// (subqueries in FROM, WITH, sublinks), of which this node lacks a replica of some range
/// becomes a function scan of its gathered rows.
///
/// # Safety
/// `query` is the Query the planner is about to plan, ours to change.
#[allow(unsafe_code)]
pub unsafe fn rewrite(query: *mut pg_sys::Query) {
    // One statement's planning: the queries the lookups below run are planned as they are.
    if !GATHERING.with(|g| g.replace(false)) || query.is_null() {
        return;
    }
    // An aggregate over one table the leaseholders can compute in parts.
    // SAFETY: as this function's contract.
    if crate::gucs::gather_pushdown() && unsafe { crate::partial_agg::try_rewrite(query) } {
        return;
    }
    // The walk only collects (nothing in it may raise an error through PostgreSQL's C
    // walker); the entries are looked up and changed after it.
    let mut found: Vec<(*mut pg_sys::Query, i32)> = Vec::new();
    // SAFETY: as this function's contract; the walker follows nodeFuncs.c's contract and
    // its context is `found`, which outlives the walk.
    unsafe { relations(query.cast(), (&mut found as *mut Vec<_>).cast()) };
    for (q, index) in found {
        // An INSERT's target is written, not read: its rows are routed as they are written.
        // SAFETY: `q` is a query of the tree being planned.
        if unsafe { (*q).resultRelation } == index {
            continue;
        }
        // SAFETY: each pair is a query of the tree being planned and the 1-based index of a
        // relation's entry in its range table.
        unsafe {
            let rte = pg_sys::list_nth((*q).rtable, index - 1) as *mut pg_sys::RangeTblEntry;
            let relid = (*rte).relid;
            if crate::replication::is_replicated_table(relid) && !held_here(relid) {
                let pushdown = crate::gucs::gather_pushdown();
                let filter = if pushdown {
                    pushable_filter(q, index)
                } else {
                    std::ptr::null_mut()
                };
                to_gathered(rte, filter, pushdown);
            }
        }
    }
}

/// Walker over a query tree: collects the plain and partitioned tables each Query met reads,
/// as (query, range table index).
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn relations(node: *mut pg_sys::Node, cx: *mut std::ffi::c_void) -> bool {
    if node.is_null() {
        return false;
    }
    // SAFETY: `node` is a valid node of the tree being walked; its tag says which struct it
    // is, and each cast follows the tag. `cx` is the caller's vector.
    unsafe {
        if (*node).type_ == pg_sys::NodeTag::T_Query {
            let q = node as *mut pg_sys::Query;
            let found = &mut *(cx as *mut Vec<(*mut pg_sys::Query, i32)>);
            let rtable = (*q).rtable;
            if !rtable.is_null() {
                for i in 0..(*rtable).length {
                    let rte = pg_sys::list_nth(rtable, i) as *mut pg_sys::RangeTblEntry;
                    if !rte.is_null()
                        && (*rte).rtekind == pg_sys::RTEKind::RTE_RELATION
                        && ((*rte).relkind as u8 == pg_sys::RELKIND_RELATION
                            || ((*rte).relkind as u8 == pg_sys::RELKIND_PARTITIONED_TABLE
                                && (*rte).inh))
                    {
                        found.push((q, i + 1));
                    }
                }
            }
            return pg_sys::query_tree_walker(q, Some(relations), cx, 0);
        }
        pg_sys::expression_tree_walker(node, Some(relations), cx)
    }
}

/// Turns a relation's range table entry into
/// `jsonb_populate_recordset(NULL::<its row type>, multiregion.gather_rows(<it>, <columns>,
/// <filter>)::jsonb)`: the same columns, dropped ones included, so the query's references
/// to it stay valid; those it does not read are NULL. The table's privileges and row
/// security are checked by the gathering scan itself, which runs as the current user (so
/// the entry's own row security quals go: they would see the unread columns as NULL).
///
/// # Safety
/// `rte` is a relation's entry in a query being planned; `filter` is null or an expression
/// over that relation alone as range table entry 1. `project`: ask only for the columns the
/// query reads.
#[allow(unsafe_code)]
unsafe fn to_gathered(rte: *mut pg_sys::RangeTblEntry, filter: *mut pg_sys::Node, project: bool) {
    // SAFETY: the relation is locked by analysis; the nodes built are palloc'd in the
    // planner's memory context, like the entry they go into.
    unsafe {
        let relid = (*rte).relid;
        let reltype = pg_sys::get_rel_type_id(relid);
        let rel = pg_sys::RelationIdGetRelation(relid);
        if rel.is_null() || reltype == pg_sys::InvalidOid {
            return;
        }
        let desc = (*rel).rd_att;
        let natts = (*desc).natts;
        // Columns of a domain that refuses NULL are always asked for: `jsonb_populate_recordset`
        // runs a missing column's NULL through its domain's checks.
        let domains: Vec<(i16, pg_sys::Oid)> = (*desc)
            .attrs
            .as_slice(natts as usize)
            .iter()
            .enumerate()
            .filter(|(_, a)| {
                !a.attisdropped && pg_sys::get_typtype(a.atttypid) == pg_sys::TYPTYPE_DOMAIN as i8
            })
            .map(|(i, a)| (i as i16 + 1, a.atttypid))
            .collect();
        pg_sys::RelationClose(rel);
        let domains: Vec<i16> = domains
            .into_iter()
            .filter(|&(_, typ)| refuses_null(typ))
            .map(|(attnum, _)| attnum)
            .collect();
        let gather = function_oid(
            &["multiregion", "gather_rows"],
            &[
                pg_sys::OIDOID,
                pg_sys::INT2ARRAYOID,
                pg_sys::PG_NODE_TREEOID,
            ],
        );
        let populate = function_oid(
            &["pg_catalog", "jsonb_populate_recordset"],
            &[pg_sys::ANYELEMENTOID, pg_sys::JSONBOID],
        );
        let read = if project {
            read_columns((*rte).selectedCols).map(|mut cols| {
                cols.extend(
                    domains
                        .iter()
                        .filter(|d| !cols.contains(d))
                        .collect::<Vec<_>>(),
                );
                cols.sort_unstable();
                cols
            })
        } else {
            None
        };
        // The filter as a pg_node_tree, which no client can write (its input function
        // refuses): the filter gather_rows deparses is always one PostgreSQL built.
        let as_jsonb = gathered_jsonb(
            gather,
            &[
                oid_const(relid),
                int2_array_const(read.as_deref()),
                tree_const(filter),
            ],
        );
        let base = pg_sys::makeNullConst(reltype, -1, pg_sys::InvalidOid);
        let mut args = list1(base.cast());
        args = pg_sys::lappend(args, as_jsonb.cast());
        let scan = pg_sys::makeFuncExpr(
            populate,
            reltype,
            args,
            pg_sys::InvalidOid,
            pg_sys::InvalidOid,
            pg_sys::CoercionForm::COERCE_EXPLICIT_CALL,
        );
        (*scan).funcretset = true;
        let f = pg_sys::palloc0(std::mem::size_of::<pg_sys::RangeTblFunction>())
            as *mut pg_sys::RangeTblFunction;
        (*f).type_ = pg_sys::NodeTag::T_RangeTblFunction;
        (*f).funcexpr = scan.cast();
        (*f).funccolcount = natts;
        into_function_scan(rte, f);
    }
}

/// A relation's range table entry made a scan of function `f` (the gathered rows). The
/// table's privileges and row security are checked by the gathering scans themselves, which
/// run as the current user.
///
/// # Safety
/// `rte` is a relation's entry in a query being planned; `f` a palloc'd RangeTblFunction.
#[allow(unsafe_code)]
pub(crate) unsafe fn into_function_scan(
    rte: *mut pg_sys::RangeTblEntry,
    f: *mut pg_sys::RangeTblFunction,
) {
    // SAFETY: as this function's contract.
    unsafe {
        (*rte).rtekind = pg_sys::RTEKind::RTE_FUNCTION;
        (*rte).functions = list1(f.cast());
        (*rte).funcordinality = false;
        (*rte).relid = pg_sys::InvalidOid;
        (*rte).relkind = 0;
        (*rte).rellockmode = 0;
        (*rte).inh = false;
        (*rte).tablesample = std::ptr::null_mut();
        (*rte).requiredPerms = 0;
        (*rte).checkAsUser = pg_sys::InvalidOid;
        (*rte).selectedCols = std::ptr::null_mut();
        (*rte).insertedCols = std::ptr::null_mut();
        (*rte).updatedCols = std::ptr::null_mut();
        (*rte).securityQuals = std::ptr::null_mut();
    }
}

/// An `oid` constant.
///
/// # Safety
/// Called while planning (palloc'd in the current context).
#[allow(unsafe_code)]
pub(crate) unsafe fn oid_const(oid: pg_sys::Oid) -> *mut pg_sys::Node {
    // SAFETY: makeConst of a by-value datum.
    unsafe {
        pg_sys::makeConst(
            pg_sys::OIDOID,
            -1,
            pg_sys::InvalidOid,
            4,
            pg_sys::Datum::from(oid),
            false,
            true,
        )
        .cast()
    }
}

/// An `int2[]` constant of attribute numbers; NULL for `None`.
///
/// # Safety
/// As [`oid_const`].
#[allow(unsafe_code)]
pub(crate) unsafe fn int2_array_const(attnums: Option<&[i16]>) -> *mut pg_sys::Node {
    // SAFETY: construct_array copies the by-value datums into a palloc'd array.
    unsafe {
        let Some(attnums) = attnums else {
            return pg_sys::makeNullConst(pg_sys::INT2ARRAYOID, -1, pg_sys::InvalidOid).cast();
        };
        let datums: Vec<pg_sys::Datum> = attnums.iter().map(|a| pg_sys::Datum::from(*a)).collect();
        let array = pg_sys::construct_array(
            datums.as_ptr() as *mut pg_sys::Datum,
            datums.len() as i32,
            pg_sys::INT2OID,
            2,
            true,
            pg_sys::TYPALIGN_SHORT as std::ffi::c_char,
        );
        pg_sys::makeConst(
            pg_sys::INT2ARRAYOID,
            -1,
            pg_sys::InvalidOid,
            -1,
            pg_sys::Datum::from(array),
            false,
            false,
        )
        .cast()
    }
}

/// A `pg_node_tree` constant of `node` (nodeToString); NULL for a null node.
///
/// # Safety
/// As [`oid_const`]; `node` is a node tree or null.
#[allow(unsafe_code)]
pub(crate) unsafe fn tree_const(node: *mut pg_sys::Node) -> *mut pg_sys::Node {
    // SAFETY: nodeToString reads the tree; the text is palloc'd.
    unsafe {
        if node.is_null() {
            return pg_sys::makeNullConst(pg_sys::PG_NODE_TREEOID, -1, pg_sys::InvalidOid).cast();
        }
        let tree = pg_sys::cstring_to_text(pg_sys::nodeToString(node.cast()));
        pg_sys::makeConst(
            pg_sys::PG_NODE_TREEOID,
            -1,
            pg_sys::DEFAULT_COLLATION_OID,
            -1,
            pg_sys::Datum::from(tree),
            false,
            false,
        )
        .cast()
    }
}

/// `<gather>(<args>)::jsonb`: a gathering function's JSON text as jsonb.
///
/// # Safety
/// As [`oid_const`]; `gather` returns text and takes `args`.
#[allow(unsafe_code)]
pub(crate) unsafe fn gathered_jsonb(
    gather: pg_sys::Oid,
    args: &[*mut pg_sys::Node],
) -> *mut pg_sys::Node {
    // SAFETY: builds palloc'd nodes.
    unsafe {
        let mut list: *mut pg_sys::List = std::ptr::null_mut();
        for &a in args {
            list = pg_sys::lappend(list, a.cast());
        }
        let rows = pg_sys::makeFuncExpr(
            gather,
            pg_sys::TEXTOID,
            list,
            pg_sys::InvalidOid,
            pg_sys::InvalidOid,
            pg_sys::CoercionForm::COERCE_EXPLICIT_CALL,
        );
        let as_jsonb =
            pg_sys::palloc0(std::mem::size_of::<pg_sys::CoerceViaIO>()) as *mut pg_sys::CoerceViaIO;
        (*as_jsonb).xpr.type_ = pg_sys::NodeTag::T_CoerceViaIO;
        (*as_jsonb).arg = rows.cast();
        (*as_jsonb).resulttype = pg_sys::JSONBOID;
        (*as_jsonb).resultcollid = pg_sys::InvalidOid;
        (*as_jsonb).coerceformat = pg_sys::CoercionForm::COERCE_EXPLICIT_CAST;
        (*as_jsonb).location = -1;
        as_jsonb.cast()
    }
}

/// Whether a domain may refuse NULL: NOT NULL at some level of it, or a CHECK constraint not
/// known to be NULL for a NULL value (which passes): `VALUE IS NOT NULL`, `coalesce(VALUE,
/// 0) > 0` may refuse; `VALUE > 0` and the region type's `valid_region(VALUE, …)` do not.
#[allow(unsafe_code)]
fn refuses_null(domain: pg_sys::Oid) -> bool {
    let rows = spi::read_rows(
        "WITH RECURSIVE chain(oid) AS (SELECT $1 UNION ALL \
           SELECT t.typbasetype FROM pg_catalog.pg_type t JOIN chain ON t.oid = chain.oid \
           WHERE t.typtype = 'd') \
         SELECT t.typnotnull::text, c.conbin::text FROM chain \
         JOIN pg_catalog.pg_type t ON t.oid = chain.oid \
         LEFT JOIN pg_catalog.pg_constraint c ON c.contypid = t.oid AND c.contype = 'c'",
        vec![pgrx::datum::DatumWithOid::from(domain)],
    );
    rows.into_iter().any(|row| {
        let not_null = row.first().and_then(|v| v.as_deref()) == Some("true");
        let check = row.get(1).cloned().flatten();
        not_null
            || check.is_some_and(|tree| {
                let Ok(tree) = CString::new(tree) else {
                    return true;
                };
                // SAFETY: `conbin` is nodeToString's output, read back as PostgreSQL's
                // catalog readers do; the walk only reads the tree.
                unsafe { !null_for_null(pg_sys::stringToNode(tree.as_ptr()) as *mut pg_sys::Node) }
            })
    })
}

/// Whether a domain check expression is NULL when the value checked is: the value itself,
/// or a strict function or operator of an argument that is (through relabelings and I/O
/// coercions). Anything else is not known to be.
///
/// # Safety
/// `node` is an expression tree, or null.
#[allow(unsafe_code)]
unsafe fn null_for_null(node: *mut pg_sys::Node) -> bool {
    use pg_sys::NodeTag::*;
    if node.is_null() {
        return false;
    }
    // SAFETY: each cast follows the node's tag; lookups of functions by oid.
    unsafe {
        let any_arg = |args: *mut pg_sys::List| {
            !args.is_null()
                && (0..(*args).length)
                    .any(|i| null_for_null(pg_sys::list_nth(args, i) as *mut pg_sys::Node))
        };
        match (*node).type_ {
            T_CoerceToDomainValue => true,
            T_RelabelType => null_for_null((*(node as *mut pg_sys::RelabelType)).arg.cast()),
            T_CoerceViaIO => null_for_null((*(node as *mut pg_sys::CoerceViaIO)).arg.cast()),
            T_FuncExpr => {
                let f = node as *mut pg_sys::FuncExpr;
                pg_sys::func_strict((*f).funcid) && any_arg((*f).args)
            }
            T_OpExpr => {
                let o = node as *mut pg_sys::OpExpr;
                pg_sys::func_strict(pg_sys::get_opcode((*o).opno)) && any_arg((*o).args)
            }
            _ => false,
        }
    }
}

/// The columns a query reads of a relation (its entry's `selectedCols`), or `None` for all
/// of them (a whole-row reference).
///
/// # Safety
/// `cols` is a range table entry's `selectedCols`.
#[allow(unsafe_code)]
unsafe fn read_columns(cols: *mut pg_sys::Bitmapset) -> Option<Vec<i16>> {
    let offset = pg_sys::FirstLowInvalidHeapAttributeNumber;
    let mut out = Vec::new();
    let mut member = -1;
    loop {
        // SAFETY: a valid (possibly empty, null) bitmapset of the entry.
        member = unsafe { pg_sys::bms_next_member(cols, member) };
        if member < 0 {
            return Some(out);
        }
        let attnum = member + offset;
        if attnum == 0 {
            return None;
        }
        if attnum > 0 {
            out.push(attnum as i16);
        }
    }
}

/// The conjuncts of a query's WHERE clause that the leaseholders can apply to a relation's
/// rows before sending them, with the relation as range table entry 1; null if none. A
/// conjunct qualifies when it reads only that relation's columns (no parameters, sublinks
/// or outer references) and no mutable function (a leaseholder's `now()` is not this
/// transaction's), and the relation is not on the nullable side of an outer join (there a
/// WHERE clause filters the joined rows: `WHERE t.x IS NULL` keeps rows t did not match).
///
/// # Safety
/// `q` is a query being planned and `index` the 1-based index of a relation's range table
/// entry in it.
#[allow(unsafe_code)]
pub(crate) unsafe fn pushable_filter(q: *mut pg_sys::Query, index: i32) -> *mut pg_sys::Node {
    // SAFETY: as this function's contract.
    unsafe { pushable_conjuncts(q, index).0 }
}

/// [`pushable_filter`], and whether it is the whole WHERE clause (every conjunct qualified).
///
/// # Safety
/// As [`pushable_filter`].
#[allow(unsafe_code)]
pub(crate) unsafe fn pushable_conjuncts(
    q: *mut pg_sys::Query,
    index: i32,
) -> (*mut pg_sys::Node, bool) {
    // SAFETY: the join tree and its quals are nodes of `q`; the copies are palloc'd in the
    // planner's context.
    unsafe {
        let jt = (*q).jointree;
        if jt.is_null() || (*jt).quals.is_null() {
            return (std::ptr::null_mut(), true);
        }
        if !inner_side(jt.cast(), index).unwrap_or(false) {
            return (std::ptr::null_mut(), false);
        }
        let conjuncts = pg_sys::make_ands_implicit((*jt).quals.cast());
        let mut kept: *mut pg_sys::List = std::ptr::null_mut();
        let mut all = true;
        if !conjuncts.is_null() {
            for i in 0..(*conjuncts).length {
                let c = pg_sys::list_nth(conjuncts, i) as *mut pg_sys::Node;
                let mut cx = OnlyOf { index, ok: true };
                only_of(c, (&mut cx as *mut OnlyOf).cast());
                if !cx.ok || pg_sys::contain_mutable_functions(c) {
                    all = false;
                    continue;
                }
                let copy = pg_sys::copyObjectImpl(c.cast()) as *mut pg_sys::Node;
                pg_sys::ffi::pg_guard_ffi_boundary(|| {
                    crate::rewrite::ChangeVarNodes(copy, index, 1, 0)
                });
                kept = pg_sys::lappend(kept, copy.cast());
            }
        }
        let filter = if kept.is_null() {
            std::ptr::null_mut()
        } else {
            pg_sys::make_ands_explicit(kept).cast()
        };
        (filter, all)
    }
}

/// Whether range table entry `index` is in this join tree node: `Some(true)` where every
/// row of the result comes from one of its rows (inner joins, the preserved side of an
/// outer join), `Some(false)` on a nullable side, `None` if it is not there.
///
/// # Safety
/// `node` is a node of a query's join tree (FromExpr, JoinExpr, RangeTblRef) or null.
#[allow(unsafe_code)]
unsafe fn inner_side(node: *mut pg_sys::Node, index: i32) -> Option<bool> {
    if node.is_null() {
        return None;
    }
    // SAFETY: each cast follows the node's tag.
    unsafe {
        match (*node).type_ {
            pg_sys::NodeTag::T_RangeTblRef => {
                ((*(node as *mut pg_sys::RangeTblRef)).rtindex == index).then_some(true)
            }
            pg_sys::NodeTag::T_FromExpr => {
                let list = (*(node as *mut pg_sys::FromExpr)).fromlist;
                if list.is_null() {
                    return None;
                }
                (0..(*list).length)
                    .find_map(|i| inner_side(pg_sys::list_nth(list, i) as *mut pg_sys::Node, index))
            }
            pg_sys::NodeTag::T_JoinExpr => {
                let j = node as *mut pg_sys::JoinExpr;
                let left = inner_side((*j).larg, index);
                let right = inner_side((*j).rarg, index);
                let (left_nullable, right_nullable) = match (*j).jointype {
                    pg_sys::JoinType::JOIN_INNER => (false, false),
                    pg_sys::JoinType::JOIN_LEFT => (false, true),
                    pg_sys::JoinType::JOIN_RIGHT => (true, false),
                    _ => (true, true),
                };
                match (left, right) {
                    (Some(inner), _) => Some(inner && !left_nullable),
                    (_, Some(inner)) => Some(inner && !right_nullable),
                    _ => None,
                }
            }
            _ => None,
        }
    }
}

/// What [`only_of`] checks an expression against.
pub(crate) struct OnlyOf {
    pub(crate) index: i32,
    pub(crate) ok: bool,
}

/// Expression walker: clears `ok` (and stops) at anything but this query level's columns of
/// relation `index`, constants, operators and functions — a parameter, a sublink, an
/// aggregate, a system or whole-row column, another relation's or an outer query's column.
#[allow(unsafe_code)]
pub(crate) unsafe extern "C-unwind" fn only_of(
    node: *mut pg_sys::Node,
    cx: *mut std::ffi::c_void,
) -> bool {
    if node.is_null() {
        return false;
    }
    // SAFETY: `cx` is the caller's OnlyOf; each cast follows the node's tag.
    unsafe {
        let cx_ref = &mut *(cx as *mut OnlyOf);
        match (*node).type_ {
            pg_sys::NodeTag::T_Var => {
                let v = node as *mut pg_sys::Var;
                if (*v).varlevelsup != 0 || (*v).varno != cx_ref.index || (*v).varattno <= 0 {
                    cx_ref.ok = false;
                    return true;
                }
                false
            }
            pg_sys::NodeTag::T_Param
            | pg_sys::NodeTag::T_SubLink
            | pg_sys::NodeTag::T_Query
            | pg_sys::NodeTag::T_Aggref
            | pg_sys::NodeTag::T_WindowFunc
            | pg_sys::NodeTag::T_GroupingFunc
            | pg_sys::NodeTag::T_PlaceHolderVar
            | pg_sys::NodeTag::T_CurrentOfExpr
            | pg_sys::NodeTag::T_NextValueExpr
            | pg_sys::NodeTag::T_SetToDefault => {
                cx_ref.ok = false;
                true
            }
            _ => pg_sys::expression_tree_walker(node, Some(only_of), cx),
        }
    }
}

/// Whether this node's copy of a replicated table can answer for it (read here, after its
/// read barrier, it needs no gathering): it holds a replica of every range, and none of them
/// is leased on another node where this transaction has changed rows. Those changes are
/// only there, uncommitted: gathered, the table is read through its leaseholders in the
/// transaction's sessions on them, which see them. For a read-write REPEATABLE READ or
/// SERIALIZABLE transaction, only a table whose every range is leased here.
pub(crate) fn held_here(table: pg_sys::Oid) -> bool {
    let Ok((schema, name)) = qualified(table) else {
        return false;
    };
    let table = mr_meta::TableRef {
        database: crate::routing::database(),
        schema,
        table: name,
    };
    match crate::sidecar::table_ranges(crate::routing::database(), vec![table]) {
        Ok(Some(ranges)) => {
            let changed = crate::routing::changed_on();
            // A read-write REPEATABLE READ or SERIALIZABLE transaction reads where the rows
            // are leased: a copy is outside that node's snapshot and conflicts.
            let copies = !crate::routing::snapshot_read_write();
            !ranges.is_empty()
                && ranges.iter().all(|r| {
                    r.here
                        || (copies
                            && r.held
                            && !r.leaseholder.is_some_and(|h| changed.contains(&h)))
                })
        }
        Ok(None) => true,
        Err(e) => e.raise(),
    }
}

/// A one-element list.
///
/// # Safety
/// `node` is a palloc'd node.
#[allow(unsafe_code)]
pub(crate) unsafe fn list1(node: *mut std::ffi::c_void) -> *mut pg_sys::List {
    // SAFETY: as this function's contract; lappend to NIL makes a new list.
    unsafe { pg_sys::lappend(std::ptr::null_mut(), node) }
}

/// The function of that qualified name and argument types (it exists: the extension's own,
/// or PostgreSQL's).
///
/// # Safety
/// Called in a transaction.
#[allow(unsafe_code)]
pub(crate) unsafe fn function_oid(name: &[&str], args: &[pg_sys::Oid]) -> pg_sys::Oid {
    // SAFETY: as this function's contract.
    unsafe { lookup_function(name, args, false) }
}

/// [`function_oid`] for a function that may not exist: its oid, or `None`.
///
/// # Safety
/// Called in a transaction.
#[allow(unsafe_code)]
pub(crate) unsafe fn function_oid_opt(name: &[&str], args: &[pg_sys::Oid]) -> Option<pg_sys::Oid> {
    // SAFETY: as this function's contract.
    let oid = unsafe { lookup_function(name, args, true) };
    (oid != pg_sys::InvalidOid).then_some(oid)
}

/// LookupFuncName over a qualified name: InvalidOid for a missing function when
/// `missing_ok`, an error otherwise.
///
/// # Safety
/// Called in a transaction.
#[allow(unsafe_code)]
unsafe fn lookup_function(name: &[&str], args: &[pg_sys::Oid], missing_ok: bool) -> pg_sys::Oid {
    // SAFETY: builds a list of String nodes from palloc'd copies for LookupFuncName.
    unsafe {
        let mut names: *mut pg_sys::List = std::ptr::null_mut();
        for part in name {
            let c = CString::new(*part).expect("no NUL in a function name");
            names = pg_sys::lappend(
                names,
                pg_sys::makeString(pg_sys::pstrdup(c.as_ptr())).cast(),
            );
        }
        pg_sys::LookupFuncName(names, args.len() as i32, args.as_ptr(), missing_ok)
    }
}

/// The rows of a replicated table as a JSON array of objects, read through the leaseholders
/// as a plain scan of the table is, as the current user (its privileges, column privileges
/// and row security apply): only `columns` (attribute numbers; all if NULL) and only rows
/// passing `filter` (an expression over the table, which only PostgreSQL can have written:
/// no client can make a `pg_node_tree`). For statements re-planned by this module.
#[pg_extern(
    schema = "multiregion",
    sql = r#"
CREATE FUNCTION multiregion."gather_rows"(
	"table" oid,
	"columns" int2[] DEFAULT NULL,
	"filter" pg_node_tree DEFAULT NULL
) RETURNS text
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'gather_rows_wrapper';
"#
)]
fn gather_rows(
    table: Option<pg_sys::Oid>,
    columns: Option<Vec<Option<i16>>>,
    filter: Option<&str>,
) -> String {
    let table = table.unwrap_or_else(|| {
        MrError::BadArgument {
            what: "table",
            value: "NULL".into(),
            expected: "a table's oid",
        }
        .raise()
    });
    let (schema, name) = qualified(table).unwrap_or_else(|e| e.raise());
    let names = column_names(table, columns).unwrap_or_else(|e| e.raise());
    // One object per row, built from the columns asked for. The scan keeps the table as its
    // one FROM item, which is what a share of a split read is.
    let object = json_object(
        &names
            .iter()
            .map(|c| (c.clone(), format!("r.{}", quote_identifier(c))))
            .collect::<Vec<_>>(),
    );
    let filter = match filter {
        None => String::new(),
        Some(tree) => format!(
            " WHERE {}",
            deparse(table, tree).unwrap_or_else(|e| e.raise())
        ),
    };
    let sql = format!(
        "SELECT ({object})::text FROM {}.{} r{filter}",
        quote_identifier(&schema),
        quote_identifier(&name)
    );
    json_rows(&sql)
}

/// A JSON object of (key, SQL expression) pairs as SQL: `jsonb_build_object` converts each
/// value as `to_jsonb` of a row would, in calls of at most 50 pairs (a function takes 100
/// arguments). Keys are quoted as literals; the expressions are the caller's, built from
/// quoted identifiers or deparsed trees.
pub(crate) fn json_object(pairs: &[(String, String)]) -> String {
    if pairs.is_empty() {
        return "'{}'::pg_catalog.jsonb".to_string();
    }
    pairs
        .chunks(50)
        .map(|chunk| {
            let pairs = chunk
                .iter()
                .map(|(k, v)| format!("{}, {v}", quote_literal(k)))
                .collect::<Vec<_>>()
                .join(", ");
            format!("pg_catalog.jsonb_build_object({pairs})")
        })
        .collect::<Vec<_>>()
        .join(" OPERATOR(pg_catalog.||) ")
}

/// The rows of `sql`, a gathering read whose one column is a row as JSON text, as one JSON
/// array. Its scan is never gathered itself.
pub(crate) fn json_rows(sql: &str) -> String {
    struct Leave(bool);
    impl Drop for Leave {
        fn drop(&mut self) {
            IN_GATHER.with(|g| g.set(self.0));
        }
    }
    let _leave = Leave(IN_GATHER.with(|g| g.replace(true)));
    let rows = spi::read_rows(sql, vec![]);
    let mut out = String::from("[");
    for (i, row) in rows.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(
            row.into_iter()
                .next()
                .flatten()
                .as_deref()
                .unwrap_or("null"),
        );
    }
    out.push(']');
    out
}

/// The names of a table's columns by attribute number (every column not dropped, in order,
/// for `None`).
#[allow(unsafe_code)]
pub(crate) fn column_names(
    table: pg_sys::Oid,
    columns: Option<Vec<Option<i16>>>,
) -> Result<Vec<String>, MrError> {
    // SAFETY: the relation is opened and closed here; its descriptor is read while open.
    unsafe {
        let rel = pg_sys::RelationIdGetRelation(table);
        if rel.is_null() {
            return Err(MrError::NoSuchTable(table.to_u32().to_string()));
        }
        let desc = (*rel).rd_att;
        let natts = (*desc).natts;
        let attrs = (*desc).attrs.as_slice(natts as usize);
        let live = |n: i16| -> Option<String> {
            let a = attrs.get((n as usize).checked_sub(1)?)?;
            (!a.attisdropped).then(|| {
                std::ffi::CStr::from_ptr(a.attname.data.as_ptr())
                    .to_string_lossy()
                    .into_owned()
            })
        };
        let out = match columns {
            None => Ok((1..=natts as i16).filter_map(live).collect()),
            Some(wanted) => wanted
                .into_iter()
                .map(|n| {
                    n.and_then(live).ok_or_else(|| MrError::NoSuchColumn {
                        table: table.to_u32().to_string(),
                        column: n.map(|n| n.to_string()).unwrap_or_else(|| "NULL".into()),
                    })
                })
                .collect::<Result<Vec<_>, _>>(),
        };
        pg_sys::RelationClose(rel);
        out
    }
}

/// A filter tree over a table (as range table entry 1) as SQL text over alias `r`, checked to
/// read only that table's columns.
#[allow(unsafe_code)]
pub(crate) fn deparse(table: pg_sys::Oid, tree: &str) -> Result<String, MrError> {
    let bad = || MrError::BadArgument {
        what: "filter",
        value: tree.chars().take(80).collect(),
        expected: "an expression over the table's own columns",
    };
    let text = CString::new(tree).map_err(|_| bad())?;
    // SAFETY: a pg_node_tree is nodeToString's output (its input function refuses anything
    // else), which stringToNode reads back; the walker only reads it; deparsing runs
    // PostgreSQL's own rule printer over a context naming the table.
    unsafe {
        let node = pg_sys::stringToNode(text.as_ptr()) as *mut pg_sys::Node;
        let mut cx = OnlyOf { index: 1, ok: true };
        only_of(node, (&mut cx as *mut OnlyOf).cast());
        if node.is_null() || !cx.ok {
            return Err(bad());
        }
        let context = pg_sys::deparse_context_for(c"r".as_ptr(), table);
        let sql = pg_sys::deparse_expression(node, context, true, false);
        Ok(std::ffi::CStr::from_ptr(sql).to_string_lossy().into_owned())
    }
}

/// A table's schema and name.
#[allow(unsafe_code)]
pub(crate) fn qualified(table: pg_sys::Oid) -> Result<(String, String), MrError> {
    // SAFETY: catalog lookups returning palloc'd copies, or null for a missing relation.
    unsafe {
        let name = pg_sys::get_rel_name(table);
        let schema = pg_sys::get_namespace_name(pg_sys::get_rel_namespace(table));
        if name.is_null() || schema.is_null() {
            return Err(MrError::Sidecar(format!(
                "relation {} does not exist",
                table.to_u32()
            )));
        }
        Ok((
            std::ffi::CStr::from_ptr(schema)
                .to_string_lossy()
                .into_owned(),
            std::ffi::CStr::from_ptr(name)
                .to_string_lossy()
                .into_owned(),
        ))
    }
}
