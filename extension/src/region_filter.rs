//! Region filters derived from computed region columns, as CockroachDB derives them.
//!
//! A REGIONAL BY ROW table whose region is computed from other columns (MovR's
//! `region AS (CASE WHEN city = 'amsterdam' THEN 'europe-west1' … END) STORED`) is partitioned
//! by that region, but its statements filter on the columns it is computed from
//! (`WHERE city = 'amsterdam' AND id = $1`), which PostgreSQL cannot prune by. Before
//! planning, a query whose WHERE clause fixes every column of the region expression with an
//! equality gets `region = <the expression over those values>` added: implied by the filter
//! (the stored region is that expression of the row's columns), so no row is lost, and
//! folded to a constant (or a parameter expression, pruned when the executor starts), so the
//! statement touches one partition and is routed to one leaseholder (ARCHITECTURE.md §9).
//!
//! Only equalities that mean "the same value" are used: the type's default equality on
//! integers, text under a deterministic collation, uuid, bool, date or an enum. Added at
//! planning, never at analysis, so views and rules never store it, and a cached plan is
//! replanned when the table's locality (and so its expression) changes.

use crate::error::MrError;
use crate::rewrite::{cook, is_a, lookup, ptrs, substitute, REPLACEVARS_SUBSTITUTE_NULL};
use pgrx::pg_sys;
use std::cell::RefCell;
use std::ffi::{c_void, CString};

thread_local! {
    /// The statement kind and partitions of one share of a statement split over several
    /// leaseholders (`crate::routing`): the next planned query of that kind reads or changes
    /// rows of those partitions only.
    static RESTRICT: RefCell<Option<(pg_sys::CmdType::Type, Vec<String>)>> =
        const { RefCell::new(None) };
}

/// Restricts the next planned statement of kind `cmd` (a SELECT, UPDATE or DELETE of a
/// REGIONAL BY ROW table) to rows of `partitions` of its table; `None` lifts a restriction
/// not yet used. Queries of another kind planned meanwhile (lookups made while running the
/// share) are left alone.
pub fn restrict(share: Option<(pg_sys::CmdType::Type, Vec<String>)>) {
    RESTRICT.with(|r| *r.borrow_mut() = share);
}

// rewriteManip.h, which pgrx does not bind. Called through `pg_guard_ffi_boundary`.
#[allow(unsafe_code)]
unsafe extern "C-unwind" {
    fn checkExprHasSubLink(node: *mut pg_sys::Node) -> bool;
}

/// Adds derived region filters to `query`, its subqueries and its CTEs.
///
/// # Safety
/// `query` is a Query about to be planned, in the current memory context.
#[allow(unsafe_code)]
pub unsafe fn derive(query: *mut pg_sys::Query, params: pg_sys::ParamListInfo) {
    use pg_sys::CmdType::*;
    // SAFETY: every pointer comes from the Query handed to the planner: lists of the node
    // types its fields are documented to hold.
    unsafe {
        if query.is_null() || !(*query).utilityStmt.is_null() {
            return;
        }
        let q = &mut *query;
        // Taken by the share's own statement, not by a query planned while looking things
        // up for it.
        let share = RESTRICT.with(|r| {
            let mut r = r.borrow_mut();
            match r.as_ref() {
                Some((cmd, _)) if *cmd == q.commandType => r.take().map(|(_, p)| p),
                _ => None,
            }
        });
        if let Some(partitions) = share {
            restrict_target(q, &partitions);
        }
        for cte in ptrs::<pg_sys::CommonTableExpr>(q.cteList) {
            let sub = (*cte).ctequery;
            if is_a(sub, pg_sys::NodeTag::T_Query) {
                derive(sub.cast(), params);
            }
        }
        let rtes = ptrs::<pg_sys::RangeTblEntry>(q.rtable);
        for &rte in &rtes {
            if (*rte).rtekind == pg_sys::RTEKind::RTE_SUBQUERY {
                derive((*rte).subquery, params);
            }
        }
        if !matches!(q.commandType, CMD_SELECT | CMD_UPDATE | CMD_DELETE)
            || q.jointree.is_null()
            || (*q.jointree).quals.is_null()
        {
            return;
        }
        for (i, &rte) in rtes.iter().enumerate() {
            if (*rte).rtekind != pg_sys::RTEKind::RTE_RELATION || (*rte).relkind as u8 != b'p' {
                continue;
            }
            let Some(table) = lookup((*rte).relid) else {
                continue;
            };
            let Some(sql) = table.computed.as_deref() else {
                continue;
            };
            let varno = i as i32 + 1;
            let rel = pg_sys::RelationIdGetRelation((*rte).relid);
            if rel.is_null() {
                continue;
            }
            let (expr, deps) = cook(rel, sql, table.region_attno, varno);
            let region = *(*(*rel).rd_att)
                .attrs
                .as_ptr()
                .add(table.region_attno as usize - 1);
            pg_sys::RelationClose(rel);
            let conjuncts =
                ptrs::<pg_sys::Node>(pg_sys::make_ands_implicit((*q.jointree).quals.cast()));
            let mut values = Vec::new();
            for &attno in &deps {
                match conjuncts.iter().find_map(|&c| fixed_value(c, varno, attno)) {
                    Some(v) => values.push(pg_sys::makeTargetEntry(
                        v.cast(),
                        attno,
                        std::ptr::null_mut(),
                        false,
                    )),
                    None => break,
                }
            }
            if deps.is_empty() || values.len() != deps.len() {
                continue;
            }
            let value = substitute(
                expr,
                varno,
                rte,
                &values,
                REPLACEVARS_SUBSTITUTE_NULL,
                0,
                &mut q.hasSubLinks,
            );
            let value = fold(value, region.atttypid, params);
            let eq = (*pg_sys::lookup_type_cache(region.atttypid, pg_sys::TYPECACHE_EQ_OPR as i32))
                .eq_opr;
            if eq == pg_sys::InvalidOid {
                continue;
            }
            let column = pg_sys::makeVar(
                varno,
                table.region_attno,
                region.atttypid,
                region.atttypmod,
                region.attcollation,
                0,
            );
            let filter = pg_sys::make_opclause(
                eq,
                pg_sys::BOOLOID,
                false,
                column.cast(),
                value.cast(),
                pg_sys::InvalidOid,
                region.attcollation,
            );
            add_filter(q, filter.cast());
        }
    }
}

/// Adds `region IN (partitions)` to an UPDATE or DELETE of a REGIONAL BY ROW table, whose
/// partitions are its regions; anything else cannot be one share of a split statement.
#[allow(unsafe_code)]
unsafe fn restrict_target(q: &mut pg_sys::Query, partitions: &[String]) {
    use pg_sys::CmdType::*;
    // SAFETY: the Query handed to the planner; the result relation is in its range table and
    // locked by analysis.
    unsafe {
        let target = if q.jointree.is_null() {
            None
        } else if matches!(q.commandType, CMD_UPDATE | CMD_DELETE) {
            let rte = ptrs::<pg_sys::RangeTblEntry>(q.rtable)[q.resultRelation as usize - 1];
            lookup((*rte).relid).map(|t| (q.resultRelation, (*rte).relid, t.region_attno))
        } else {
            // A read of one REGIONAL BY ROW table (`replication::splittable`): its only FROM item.
            match ptrs::<pg_sys::Node>((*q.jointree).fromlist).as_slice() {
                [item] if is_a(*item, pg_sys::NodeTag::T_RangeTblRef) => {
                    let varno = (*(*item as *mut pg_sys::RangeTblRef)).rtindex;
                    let rte = ptrs::<pg_sys::RangeTblEntry>(q.rtable)[varno as usize - 1];
                    lookup((*rte).relid).map(|t| (varno, (*rte).relid, t.region_attno))
                }
                _ => None,
            }
        };
        let Some((varno, relid, attno)) = target else {
            MrError::WriteNotServed {
                message: "only a statement on one REGIONAL BY ROW table can run over some of its partitions".into(),
                hint: "This is a bug in statement routing: please report it with the statement.".into(),
            }
            .raise()
        };
        let (mut typ, mut typmod, mut collation) = (pg_sys::InvalidOid, -1, pg_sys::InvalidOid);
        pg_sys::get_atttypetypmodcoll(relid, attno, &mut typ, &mut typmod, &mut collation);
        let eq = (*pg_sys::lookup_type_cache(typ, pg_sys::TYPECACHE_EQ_OPR as i32)).eq_opr;
        let (mut input, mut ioparam) = (pg_sys::InvalidOid, pg_sys::InvalidOid);
        pg_sys::getTypeInputInfo(typ, &mut input, &mut ioparam);
        let (mut len, mut byval) = (0i16, false);
        pg_sys::get_typlenbyval(typ, &mut len, &mut byval);
        let mut any = std::ptr::null_mut();
        for p in partitions {
            let c = CString::new(p.as_str()).unwrap_or_default();
            let value = pg_sys::OidInputFunctionCall(input, c.as_ptr() as *mut _, ioparam, -1);
            let column = pg_sys::makeVar(varno, attno, typ, typmod, collation, 0);
            let konst = pg_sys::makeConst(typ, -1, collation, len.into(), value, false, byval);
            let eq = pg_sys::make_opclause(
                eq,
                pg_sys::BOOLOID,
                false,
                column.cast(),
                konst.cast(),
                pg_sys::InvalidOid,
                collation,
            );
            any = pg_sys::lappend(any, eq as *mut c_void);
        }
        let filter: *mut pg_sys::Node = if partitions.len() == 1 {
            pg_sys::list_nth(any, 0).cast()
        } else {
            pg_sys::makeBoolExpr(pg_sys::BoolExprType::OR_EXPR, any, -1).cast()
        };
        add_filter(q, filter);
    }
}

/// `value` simplified as far as the planner would (with the parameter values of a custom
/// plan), and further where it is a constant
/// coerced to the region type: PostgreSQL leaves a domain's check to the executor, which
/// prunes partitions only after the statement was routed. Unchecked is fine in a filter: a
/// value outside the domain matches no row.
#[allow(unsafe_code)]
unsafe fn fold(
    value: *mut pg_sys::Node,
    typ: pg_sys::Oid,
    params: pg_sys::ParamListInfo,
) -> *mut pg_sys::Node {
    // SAFETY: an expression built for the query being planned; the coercion's argument is
    // a Const when its tag says so. eval_const_expressions reads only `glob->boundParams`
    // of a planner state (and appends plan dependencies to `glob`, which the planner records
    // again for the query itself), so a fresh zeroed one carries the parameters.
    unsafe {
        let root = if params.is_null() {
            std::ptr::null_mut()
        } else {
            let glob = pg_sys::palloc0(std::mem::size_of::<pg_sys::PlannerGlobal>())
                as *mut pg_sys::PlannerGlobal;
            (*glob).type_ = pg_sys::NodeTag::T_PlannerGlobal;
            (*glob).boundParams = params;
            let root = pg_sys::palloc0(std::mem::size_of::<pg_sys::PlannerInfo>())
                as *mut pg_sys::PlannerInfo;
            (*root).type_ = pg_sys::NodeTag::T_PlannerInfo;
            (*root).glob = glob;
            root
        };
        // Parameters of a custom plan become constants, as the planner will make them.
        let value = pg_sys::eval_const_expressions(root, value);
        if !is_a(value, pg_sys::NodeTag::T_CoerceToDomain) {
            return value;
        }
        let cd = value as *mut pg_sys::CoerceToDomain;
        let arg = (*cd).arg as *mut pg_sys::Node;
        if (*cd).resulttype != typ || !is_a(arg, pg_sys::NodeTag::T_Const) {
            return value;
        }
        let c = pg_sys::copyObjectImpl(arg.cast()) as *mut pg_sys::Const;
        (*c).consttype = typ;
        (*c).consttypmod = (*cd).resulttypmod;
        (*c).constcollid = (*cd).resultcollid;
        c.cast()
    }
}

/// `WHERE old AND filter`.
#[allow(unsafe_code)]
unsafe fn add_filter(q: &mut pg_sys::Query, filter: *mut pg_sys::Node) {
    // SAFETY: the caller's Query, with a join tree.
    unsafe {
        let old = (*q.jointree).quals;
        (*q.jointree).quals = if old.is_null() {
            filter
        } else {
            let mut both = pg_sys::lappend(std::ptr::null_mut(), old as *mut c_void);
            both = pg_sys::lappend(both, filter as *mut c_void);
            pg_sys::makeBoolExpr(pg_sys::BoolExprType::AND_EXPR, both, -1).cast()
        };
    }
}

/// The value `clause` fixes column `attno` of range table entry `varno` to, if it is
/// `column = expr` (either way round) with an equality that means "the same value" and an
/// `expr` that is the same for every row: no Vars of this level, nothing volatile, no
/// subquery.
#[allow(unsafe_code)]
unsafe fn fixed_value(
    clause: *mut pg_sys::Node,
    varno: i32,
    attno: i16,
) -> Option<*mut pg_sys::Node> {
    // SAFETY: `clause` is an analysed expression node of the query being planned.
    unsafe {
        if !is_a(clause, pg_sys::NodeTag::T_OpExpr) {
            return None;
        }
        let op = clause as *mut pg_sys::OpExpr;
        let args = ptrs::<pg_sys::Node>((*op).args);
        let [a, b] = args.as_slice() else {
            return None;
        };
        let (var, other) = if is_column(*a, varno, attno) {
            (strip(*a), *b)
        } else if is_column(*b, varno, attno) {
            (strip(*b), *a)
        } else {
            return None;
        };
        let var = var as *mut pg_sys::Var;
        let typ = (*var).vartype;
        if !identity_equality(typ, (*op).opno, (*op).inputcollid) {
            return None;
        }
        if pg_sys::contain_var_clause(other)
            || pg_sys::contain_volatile_functions(other)
            || pg_sys::ffi::pg_guard_ffi_boundary(|| checkExprHasSubLink(other))
        {
            return None;
        }
        let other = pg_sys::copyObjectImpl(other.cast()) as *mut pg_sys::Node;
        let other_type = pg_sys::exprType(other);
        if other_type == typ {
            Some(other)
        } else if typ == pg_sys::VARCHAROID && other_type == pg_sys::TEXTOID {
            // varchar compares as text: the same bytes either way.
            Some(
                pg_sys::makeRelabelType(
                    other.cast(),
                    typ,
                    -1,
                    (*var).varcollid,
                    pg_sys::CoercionForm::COERCE_IMPLICIT_CAST,
                )
                .cast(),
            )
        } else {
            None
        }
    }
}

/// Whether `node` is column `attno` of `varno` at this query level, possibly relabelled
/// (varchar compared as text).
#[allow(unsafe_code)]
unsafe fn is_column(node: *mut pg_sys::Node, varno: i32, attno: i16) -> bool {
    // SAFETY: an analysed expression node.
    unsafe {
        let v = strip(node);
        is_a(v, pg_sys::NodeTag::T_Var) && {
            let v = v as *mut pg_sys::Var;
            (*v).varno == varno && (*v).varattno == attno && (*v).varlevelsup == 0
        }
    }
}

#[allow(unsafe_code)]
unsafe fn strip(mut node: *mut pg_sys::Node) -> *mut pg_sys::Node {
    // SAFETY: an analysed expression node; a RelabelType's argument is one too.
    unsafe {
        while is_a(node, pg_sys::NodeTag::T_RelabelType) {
            node = (*(node as *mut pg_sys::RelabelType)).arg.cast();
        }
        node
    }
}

/// Whether `opno` is `typ`'s default equality and equal values under it are identical, so
/// that an expression of the column gives the same result for both.
#[allow(unsafe_code)]
fn identity_equality(typ: pg_sys::Oid, opno: pg_sys::Oid, collation: pg_sys::Oid) -> bool {
    const SAME_BYTES: &[pg_sys::Oid] = &[
        pg_sys::INT2OID,
        pg_sys::INT4OID,
        pg_sys::INT8OID,
        pg_sys::TEXTOID,
        pg_sys::VARCHAROID,
        pg_sys::UUIDOID,
        pg_sys::BOOLOID,
        pg_sys::DATEOID,
        pg_sys::OIDOID,
    ];
    // SAFETY: catalog lookups by OID; the type cache entry lives for the backend.
    unsafe {
        if !(SAME_BYTES.contains(&typ) || pg_sys::type_is_enum(typ)) {
            return false;
        }
        if collation != pg_sys::InvalidOid && !pg_sys::get_collation_isdeterministic(collation) {
            return false;
        }
        let entry = pg_sys::lookup_type_cache(typ, pg_sys::TYPECACHE_EQ_OPR as i32);
        !entry.is_null() && (*entry).eq_opr == opno
    }
}
