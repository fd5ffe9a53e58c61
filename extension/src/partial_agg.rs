//! Aggregates computed at the leaseholders for gathered reads (ARCHITECTURE.md §9).
//!
//! A gathered aggregate over one table (`SELECT region, count(*), sum(v) FROM t WHERE …
//! GROUP BY region`) shipped every row that passed its filter to be aggregated here. When
//! every piece of it can be split, it is computed in two steps instead, as PostgreSQL's own
//! parallel aggregation is: each leaseholder runs the aggregates over its partitions, grouped
//! by the same columns (`multiregion.gather_partials`: one row per group and leaseholder
//! crosses the WAN), and the statement here combines them — a sum of the counts and sums, the
//! least of the minimums — with its HAVING, ORDER BY and LIMIT applied as before.
//!
//! Split only when the answer cannot change: one table, the whole WHERE clause sent along
//! (immutable, its own columns), plain grouping columns, and aggregates that combine as
//! themselves (`min`, `max`, `bool_and`, `bool_or`, `every`, `sum` over a type whose sum is the
//! same type) or as a sum (`count`, `sum` of integers), and `avg` of integers, numerics and
//! float8 (a `sum` and a `count` at each leaseholder, divided here as `avg` itself divides).
//! Anything else (DISTINCT or ORDER BY in an aggregate, `avg` of other types, a user-defined
//! aggregate, a grouping set, a window) gathers the rows.
//! A sum of floating-point values may differ in its last digits from one over the rows in
//! another order, as parallel aggregation's does.

use crate::error::MrError;
use crate::gather::{
    column_names, function_oid, function_oid_opt, gathered_jsonb, held_here, int2_array_const,
    into_function_scan, json_object, json_rows, list1, oid_const, only_of, pushable_conjuncts,
    qualified, tree_const, OnlyOf,
};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::quote_identifier;
use std::ffi::{c_void, CString};

type Mutator = unsafe extern "C-unwind" fn() -> *mut pg_sys::Node;

/// How one aggregate's per-leaseholder results combine here.
struct Combine {
    /// The aggregate over the partial results (the same one, or `sum`).
    aggregate: pg_sys::Oid,
    /// Its result type.
    returns: pg_sys::Oid,
    /// A cast of that result back to the original aggregate's type (`count` and sums of
    /// integers: `sum(int8)` is numeric), if needed.
    cast: Option<pg_sys::Oid>,
}

/// What the leaseholders compute for one of the query's aggregates, and how it combines here.
enum Plan {
    /// The aggregate itself (one partial column), combined.
    One(Combine),
    /// `avg`: `sum` and `count` of its argument at the leaseholders (two partial columns),
    /// the sum of sums divided here by the sum of counts — `numeric_div`, as `avg` of
    /// integers and numerics itself divides; `float8div` for `avg(float8)`.
    Avg { sum: Combine, float: bool },
}

/// Rewrites a query to be planned whose one relation is a replicated table this node lacks
/// some ranges of into an aggregate over `multiregion.gather_partials`; whether it did.
///
/// # Safety
/// `q` is the top-level Query the planner is about to plan, ours to change.
#[allow(unsafe_code)]
pub unsafe fn try_rewrite(q: *mut pg_sys::Query) -> bool {
    // SAFETY: as this function's contract; each read follows the Query's documented shape.
    unsafe {
        if !crate::gucs::gather_partial_aggregates() || !shape_fits(q) {
            return false;
        }
        let rte = pg_sys::list_nth((*q).rtable, 0) as *mut pg_sys::RangeTblEntry;
        let relid = (*rte).relid;
        if !crate::replication::is_replicated_table(relid) || held_here(relid) {
            return false;
        }
        let (filter, whole) = pushable_conjuncts(q, 1);
        if !whole {
            return false;
        }
        // The grouping columns, in the order of the GROUP BY clause.
        let mut groups: Vec<*mut pg_sys::Var> = Vec::new();
        let clauses = (*q).groupClause;
        for i in 0..list_len(clauses) {
            let sgc = pg_sys::list_nth(clauses, i) as *mut pg_sys::SortGroupClause;
            let tle = pg_sys::get_sortgroupclause_tle(sgc, (*q).targetList);
            let e = (*tle).expr as *mut pg_sys::Node;
            if e.is_null() || (*e).type_ != pg_sys::NodeTag::T_Var {
                return false;
            }
            let v = e as *mut pg_sys::Var;
            if (*v).varno != 1 || (*v).varlevelsup != 0 || (*v).varattno <= 0 {
                return false;
            }
            if !groups.iter().any(|g| (**g).varattno == (*v).varattno) {
                groups.push(v);
            }
        }
        // The aggregates, and no column read outside them but a grouping one.
        let mut cx = Collect {
            groups: groups.iter().map(|g| (**g).varattno).collect(),
            aggrefs: Vec::new(),
            ok: true,
        };
        let tlist = (*q).targetList;
        for i in 0..list_len(tlist) {
            let tle = pg_sys::list_nth(tlist, i) as *mut pg_sys::TargetEntry;
            collect((*tle).expr.cast(), (&mut cx as *mut Collect).cast());
        }
        collect((*q).havingQual, (&mut cx as *mut Collect).cast());
        if !cx.ok || cx.aggrefs.is_empty() {
            return false;
        }
        let mut plans = Vec::with_capacity(cx.aggrefs.len());
        let mut partials = Vec::with_capacity(cx.aggrefs.len());
        for &a in &cx.aggrefs {
            if let Some((sum, count, plan)) = avg_parts(a) {
                partials.push(sum);
                partials.push(count);
                plans.push(plan);
                continue;
            }
            match combine(a) {
                Some(c) => {
                    partials.push(a);
                    plans.push(Plan::One(c));
                }
                None => return false,
            }
        }
        to_partials(q, rte, filter, &groups, &cx.aggrefs, &plans, &partials);
        true
    }
}

/// One table, aggregated, with nothing that needs its rows here.
///
/// # Safety
/// `q` is a Query being planned.
#[allow(unsafe_code)]
unsafe fn shape_fits(q: *mut pg_sys::Query) -> bool {
    // SAFETY: reads fields of the Query.
    unsafe {
        let q = &*q;
        if q.commandType != pg_sys::CmdType::CMD_SELECT
            || !q.utilityStmt.is_null()
            || !q.hasAggs
            || q.hasWindowFuncs
            || q.hasTargetSRFs
            || q.hasSubLinks
            || q.hasModifyingCTE
            || q.hasForUpdate
            || q.hasRowSecurity
            || !q.groupingSets.is_null()
            || !q.rowMarks.is_null()
            || !q.setOperations.is_null()
            || !q.cteList.is_null()
            || list_len(q.rtable) != 1
            || q.jointree.is_null()
        {
            return false;
        }
        let from = (*q.jointree).fromlist;
        if list_len(from) != 1 {
            return false;
        }
        let item = pg_sys::list_nth(from, 0) as *mut pg_sys::Node;
        if (*item).type_ != pg_sys::NodeTag::T_RangeTblRef
            || (*(item as *mut pg_sys::RangeTblRef)).rtindex != 1
        {
            return false;
        }
        let rte = pg_sys::list_nth(q.rtable, 0) as *mut pg_sys::RangeTblEntry;
        // A partitioned table read with ONLY has no rows of its own: not gathered.
        (*rte).rtekind == pg_sys::RTEKind::RTE_RELATION
            && ((*rte).relkind as u8 == b'r' || ((*rte).relkind as u8 == b'p' && (*rte).inh))
            && (*rte).tablesample.is_null()
            && (*rte).securityQuals.is_null()
    }
}

/// What [`collect`] gathers and checks.
struct Collect {
    groups: Vec<i16>,
    aggrefs: Vec<*mut pg_sys::Aggref>,
    ok: bool,
}

/// Expression walker over the target list and HAVING: collects this level's aggregates whose
/// arguments and filter the leaseholders can compute (the table's columns, immutable), and
/// clears `ok` at any other aggregate or at a column outside them that is not grouped.
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn collect(node: *mut pg_sys::Node, cx: *mut c_void) -> bool {
    if node.is_null() {
        return false;
    }
    // SAFETY: `cx` is the caller's Collect; each cast follows the node's tag. Nothing here
    // raises a PostgreSQL error (the catalog lookups come after the walk).
    unsafe {
        let cx_ref = &mut *(cx as *mut Collect);
        match (*node).type_ {
            pg_sys::NodeTag::T_Aggref => {
                let a = node as *mut pg_sys::Aggref;
                let mut args = OnlyOf { index: 1, ok: true };
                only_of((*a).args.cast(), (&mut args as *mut OnlyOf).cast());
                only_of((*a).aggfilter.cast(), (&mut args as *mut OnlyOf).cast());
                if (*a).agglevelsup != 0
                    || (*a).aggkind != b'n' as std::ffi::c_char
                    || !(*a).aggdistinct.is_null()
                    || !(*a).aggorder.is_null()
                    || !(*a).aggdirectargs.is_null()
                    || (*a).aggvariadic
                    || !args.ok
                    || pg_sys::contain_mutable_functions(node)
                {
                    cx_ref.ok = false;
                    return true;
                }
                cx_ref.aggrefs.push(a);
                false
            }
            pg_sys::NodeTag::T_Var => {
                let v = node as *mut pg_sys::Var;
                if (*v).varlevelsup != 0
                    || (*v).varno != 1
                    || !cx_ref.groups.contains(&(*v).varattno)
                {
                    cx_ref.ok = false;
                    return true;
                }
                false
            }
            pg_sys::NodeTag::T_GroupingFunc
            | pg_sys::NodeTag::T_WindowFunc
            | pg_sys::NodeTag::T_SubLink
            | pg_sys::NodeTag::T_Query => {
                cx_ref.ok = false;
                true
            }
            _ => pg_sys::expression_tree_walker(node, Some(collect), cx),
        }
    }
}

/// How an aggregate of PostgreSQL's combines over per-leaseholder results, if it does.
///
/// # Safety
/// `a` is an Aggref of the query being planned; called in a transaction.
#[allow(unsafe_code)]
unsafe fn combine(a: *mut pg_sys::Aggref) -> Option<Combine> {
    // SAFETY: catalog lookups of the aggregate's function; `function_oid` finds PostgreSQL's
    // own functions of those signatures, which exist.
    unsafe {
        let f = (*a).aggfnoid;
        if pg_sys::get_func_namespace(f) != pg_sys::Oid::from(pg_sys::PG_CATALOG_NAMESPACE) {
            return None;
        }
        let name = pg_sys::get_func_name(f);
        if name.is_null() {
            return None;
        }
        let name = std::ffi::CStr::from_ptr(name).to_str().ok()?;
        let typ = (*a).aggtype;
        let numeric_to_int8 = || function_oid(&["pg_catalog", "int8"], &[pg_sys::NUMERICOID]);
        match name {
            "min" | "max" | "bool_and" | "bool_or" | "every" => Some(Combine {
                aggregate: f,
                returns: typ,
                cast: None,
            }),
            "count" => Some(Combine {
                aggregate: function_oid(&["pg_catalog", "sum"], &[pg_sys::INT8OID]),
                returns: pg_sys::NUMERICOID,
                cast: Some(numeric_to_int8()),
            }),
            "sum" => {
                let sum = function_oid_opt(&["pg_catalog", "sum"], &[typ])?;
                let returns = pg_sys::get_func_rettype(sum);
                if returns == typ {
                    Some(Combine {
                        aggregate: sum,
                        returns,
                        cast: None,
                    })
                } else if typ == pg_sys::INT8OID && returns == pg_sys::NUMERICOID {
                    Some(Combine {
                        aggregate: sum,
                        returns,
                        cast: Some(numeric_to_int8()),
                    })
                } else {
                    None
                }
            }
            _ => None,
        }
    }
}

/// `avg(x)` of integers, numerics or float8 as the two aggregates the leaseholders compute
/// instead, `sum(x)` and `count(x)` (with its FILTER), and how they combine; `None` for any
/// other aggregate (or `avg` of another type: float4 would sum in float4 at the leaseholders,
/// interval has no plain division here).
///
/// # Safety
/// `a` is an Aggref of the query being planned; called in a transaction.
#[allow(unsafe_code)]
unsafe fn avg_parts(
    a: *mut pg_sys::Aggref,
) -> Option<(*mut pg_sys::Aggref, *mut pg_sys::Aggref, Plan)> {
    // SAFETY: catalog lookups of PostgreSQL's own aggregates of those signatures, which
    // exist; the Aggref copies are palloc'd in the planner's context.
    unsafe {
        let f = (*a).aggfnoid;
        if pg_sys::get_func_namespace(f) != pg_sys::Oid::from(pg_sys::PG_CATALOG_NAMESPACE) {
            return None;
        }
        let name = pg_sys::get_func_name(f);
        if name.is_null() || std::ffi::CStr::from_ptr(name).to_bytes() != b"avg" {
            return None;
        }
        if list_len((*a).args) != 1 || list_len((*a).aggargtypes) != 1 {
            return None;
        }
        let arg = pg_sys::list_nth_oid((*a).aggargtypes, 0);
        let float = match arg {
            pg_sys::INT2OID | pg_sys::INT4OID | pg_sys::INT8OID | pg_sys::NUMERICOID => false,
            pg_sys::FLOAT8OID => true,
            _ => return None,
        };
        let sum_fn = function_oid_opt(&["pg_catalog", "sum"], &[arg])?;
        let sum_type = pg_sys::get_func_rettype(sum_fn);
        let count_fn = function_oid(&["pg_catalog", "count"], &[pg_sys::ANYOID]);
        let part = |fnoid: pg_sys::Oid, typ: pg_sys::Oid| {
            let p = pg_sys::copyObjectImpl(a.cast()) as *mut pg_sys::Aggref;
            (*p).aggfnoid = fnoid;
            (*p).aggtype = typ;
            (*p).aggcollid = pg_sys::InvalidOid;
            (*p).aggtranstype = pg_sys::InvalidOid;
            p
        };
        let sum = part(sum_fn, sum_type);
        let count = part(count_fn, pg_sys::INT8OID);
        // The sums of the partial sums: the same type for numeric and float8, numeric for the
        // int8 partial sums of int2 and int4.
        let sum_of_sums = function_oid_opt(&["pg_catalog", "sum"], &[sum_type])?;
        let returns = pg_sys::get_func_rettype(sum_of_sums);
        if returns
            != if float {
                pg_sys::FLOAT8OID
            } else {
                pg_sys::NUMERICOID
            }
        {
            return None;
        }
        Some((
            sum,
            count,
            Plan::Avg {
                sum: Combine {
                    aggregate: sum_of_sums,
                    returns,
                    cast: None,
                },
                float,
            },
        ))
    }
}

/// The length of a possibly empty (NIL) list.
///
/// # Safety
/// `list` is a List or null.
#[allow(unsafe_code)]
unsafe fn list_len(list: *mut pg_sys::List) -> i32 {
    // SAFETY: as this function's contract.
    unsafe {
        if list.is_null() {
            0
        } else {
            (*list).length
        }
    }
}

/// What [`replace`] puts in place of the grouping columns and aggregates.
struct Replace {
    /// Original attribute number of each grouping column, in the partial rows' order.
    groups: Vec<(i16, *mut pg_sys::Var)>,
    /// Each original aggregate and the expression that combines its partial results.
    aggrefs: Vec<(*mut pg_sys::Aggref, *mut pg_sys::Node)>,
}

/// Expression mutator: a grouping column becomes the partial rows' column, an aggregate its
/// combination; both built before the walk (nothing here raises an error).
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn replace(node: *mut pg_sys::Node, cx: *mut c_void) -> *mut pg_sys::Node {
    if node.is_null() {
        return node;
    }
    // SAFETY: `cx` is the caller's Replace; each cast follows the node's tag; copies are
    // palloc'd in the planner's context.
    unsafe {
        let r = &*(cx as *const Replace);
        match (*node).type_ {
            pg_sys::NodeTag::T_Aggref => {
                if let Some((_, new)) = r
                    .aggrefs
                    .iter()
                    .find(|(a, _)| *a as *mut pg_sys::Node == node)
                {
                    return pg_sys::copyObjectImpl((*new).cast()).cast();
                }
                node
            }
            pg_sys::NodeTag::T_Var => {
                let v = node as *mut pg_sys::Var;
                if (*v).varno == 1 && (*v).varlevelsup == 0 {
                    if let Some(i) = r
                        .groups
                        .iter()
                        .position(|(attno, _)| *attno == (*v).varattno)
                    {
                        let g = r.groups[i].1;
                        let new = pg_sys::makeVar(
                            1,
                            i as i16 + 1,
                            (*g).vartype,
                            (*g).vartypmod,
                            (*g).varcollid,
                            0,
                        );
                        (*new).location = (*v).location;
                        return new.cast();
                    }
                }
                node
            }
            _ => pg_sys::expression_tree_mutator(
                node,
                Some(std::mem::transmute::<
                    unsafe extern "C-unwind" fn(
                        *mut pg_sys::Node,
                        *mut c_void,
                    ) -> *mut pg_sys::Node,
                    Mutator,
                >(replace)),
                cx,
            ),
        }
    }
}

/// Turns the query's relation into `jsonb_to_recordset(multiregion.gather_partials(…)::jsonb)
/// AS p(g1, …, a1, …)` (the grouping columns' values, then each aggregate's partial result),
/// its grouping columns into the partial rows' and its aggregates into their combinations,
/// and drops its WHERE clause (the leaseholders applied all of it).
///
/// # Safety
/// As [`try_rewrite`], after its checks; `rte` is the query's one entry.
#[allow(unsafe_code)]
unsafe fn to_partials(
    q: *mut pg_sys::Query,
    rte: *mut pg_sys::RangeTblEntry,
    filter: *mut pg_sys::Node,
    groups: &[*mut pg_sys::Var],
    aggrefs: &[*mut pg_sys::Aggref],
    plans: &[Plan],
    partials: &[*mut pg_sys::Aggref],
) {
    // SAFETY: as this function's contract; nodes are built palloc'd in the planner's context.
    unsafe {
        let relid = (*rte).relid;
        let gather = function_oid(
            &["multiregion", "gather_partials"],
            &[
                pg_sys::OIDOID,
                pg_sys::INT2ARRAYOID,
                pg_sys::PG_NODE_TREEOID,
                pg_sys::PG_NODE_TREEOID,
            ],
        );
        let to_recordset = function_oid(&["pg_catalog", "jsonb_to_recordset"], &[pg_sys::JSONBOID]);
        let mut aggs: *mut pg_sys::List = std::ptr::null_mut();
        for &a in partials {
            aggs = pg_sys::lappend(aggs, a.cast());
        }
        let attnums: Vec<i16> = groups.iter().map(|g| (**g).varattno).collect();
        let as_jsonb = gathered_jsonb(
            gather,
            &[
                oid_const(relid),
                int2_array_const(Some(&attnums)),
                tree_const(aggs.cast()),
                tree_const(filter),
            ],
        );
        let scan = pg_sys::makeFuncExpr(
            to_recordset,
            pg_sys::RECORDOID,
            list1(as_jsonb.cast()),
            pg_sys::InvalidOid,
            pg_sys::InvalidOid,
            pg_sys::CoercionForm::COERCE_EXPLICIT_CALL,
        );
        (*scan).funcretset = true;
        // The partial rows' columns: g1.. (the grouping columns' types), a1.. (each
        // aggregate's type, which is its partial result's).
        let mut names: *mut pg_sys::List = std::ptr::null_mut();
        let mut types: *mut pg_sys::List = std::ptr::null_mut();
        let mut typmods: *mut pg_sys::List = std::ptr::null_mut();
        let mut collations: *mut pg_sys::List = std::ptr::null_mut();
        let mut column = |name: String, typ: pg_sys::Oid, typmod: i32, coll: pg_sys::Oid| {
            let c = CString::new(name).expect("no NUL in a column name");
            names = pg_sys::lappend(
                names,
                pg_sys::makeString(pg_sys::pstrdup(c.as_ptr())).cast(),
            );
            types = pg_sys::lappend_oid(types, typ);
            typmods = pg_sys::lappend_int(typmods, typmod);
            collations = pg_sys::lappend_oid(collations, coll);
        };
        for (i, &g) in groups.iter().enumerate() {
            column(
                format!("g{}", i + 1),
                (*g).vartype,
                (*g).vartypmod,
                (*g).varcollid,
            );
        }
        for (i, &a) in partials.iter().enumerate() {
            column(format!("a{}", i + 1), (*a).aggtype, -1, (*a).aggcollid);
        }
        let f = pg_sys::palloc0(std::mem::size_of::<pg_sys::RangeTblFunction>())
            as *mut pg_sys::RangeTblFunction;
        (*f).type_ = pg_sys::NodeTag::T_RangeTblFunction;
        (*f).funcexpr = scan.cast();
        (*f).funccolcount = (groups.len() + partials.len()) as i32;
        (*f).funccolnames = names;
        (*f).funccoltypes = types;
        (*f).funccoltypmods = typmods;
        (*f).funccolcollations = collations;
        // Each aggregate's combination over its partial column(s).
        let mut replaced = Vec::with_capacity(aggrefs.len());
        let mut column = groups.len() as i16;
        for (&a, plan) in aggrefs.iter().zip(plans) {
            let combined: *mut pg_sys::Node = match plan {
                Plan::One(c) => {
                    column += 1;
                    combined_over(
                        a,
                        (*a).aggtype,
                        (*a).aggcollid,
                        column,
                        c,
                        Some((*a).aggtype),
                    )
                }
                Plan::Avg { sum, float } => {
                    let sum_type = (*partials[(column - groups.len() as i16) as usize]).aggtype;
                    let sums =
                        combined_over(a, sum_type, pg_sys::InvalidOid, column + 1, sum, None);
                    let count = Combine {
                        aggregate: function_oid(&["pg_catalog", "sum"], &[pg_sys::INT8OID]),
                        returns: pg_sys::NUMERICOID,
                        cast: None,
                    };
                    let counts = combined_over(
                        a,
                        pg_sys::INT8OID,
                        pg_sys::InvalidOid,
                        column + 2,
                        &count,
                        None,
                    );
                    column += 2;
                    let (div, counts) = if *float {
                        let to_float =
                            function_oid(&["pg_catalog", "float8"], &[pg_sys::NUMERICOID]);
                        (
                            function_oid(
                                &["pg_catalog", "float8div"],
                                &[pg_sys::FLOAT8OID, pg_sys::FLOAT8OID],
                            ),
                            call(to_float, pg_sys::FLOAT8OID, vec![counts], true),
                        )
                    } else {
                        (
                            function_oid(
                                &["pg_catalog", "numeric_div"],
                                &[pg_sys::NUMERICOID, pg_sys::NUMERICOID],
                            ),
                            counts,
                        )
                    };
                    call(div, (*a).aggtype, vec![sums, counts], false)
                }
            };
            replaced.push((a, combined));
        }
        let r = Replace {
            groups: groups.iter().map(|&g| ((*g).varattno, g)).collect(),
            aggrefs: replaced,
        };
        // The mutator itself at the top of each expression (nodeFuncs' mutator only visits a
        // node's children).
        let cx = &r as *const Replace as *mut c_void;
        let tlist = (*q).targetList;
        for i in 0..list_len(tlist) {
            let tle = pg_sys::list_nth(tlist, i) as *mut pg_sys::TargetEntry;
            (*tle).expr = replace((*tle).expr.cast(), cx).cast();
        }
        (*q).havingQual = replace((*q).havingQual, cx);
        (*(*q).jointree).quals = std::ptr::null_mut();
        (*rte).eref = pg_sys::makeAlias(c"partials".as_ptr(), pg_sys::list_copy(names));
        (*rte).alias = std::ptr::null_mut();
        into_function_scan(rte, f);
    }
}

/// The aggregate `c` over partial column `column` (of type `typ`), made from `template` (the
/// original Aggref: its location and flags), cast back to `cast_to` where `c` says so.
///
/// # Safety
/// In [`to_partials`]; `template` is an Aggref of the query.
#[allow(unsafe_code)]
unsafe fn combined_over(
    template: *mut pg_sys::Aggref,
    typ: pg_sys::Oid,
    collation: pg_sys::Oid,
    column: i16,
    c: &Combine,
    cast_to: Option<pg_sys::Oid>,
) -> *mut pg_sys::Node {
    // SAFETY: as this function's contract; nodes are palloc'd in the planner's context.
    unsafe {
        let partial = pg_sys::makeVar(1, column, typ, -1, collation, 0);
        let new = pg_sys::copyObjectImpl(template.cast()) as *mut pg_sys::Aggref;
        (*new).aggfnoid = c.aggregate;
        (*new).aggtype = c.returns;
        (*new).aggcollid = collation;
        (*new).aggtranstype = pg_sys::InvalidOid;
        (*new).aggargtypes = pg_sys::lappend_oid(std::ptr::null_mut(), typ);
        (*new).aggdirectargs = std::ptr::null_mut();
        (*new).args =
            list1(pg_sys::makeTargetEntry(partial.cast(), 1, std::ptr::null_mut(), false).cast());
        (*new).aggorder = std::ptr::null_mut();
        (*new).aggdistinct = std::ptr::null_mut();
        (*new).aggfilter = std::ptr::null_mut();
        (*new).aggstar = false;
        (*new).aggvariadic = false;
        (*new).aggsplit = pg_sys::AggSplit::AGGSPLIT_SIMPLE;
        (*new).aggno = -1;
        (*new).aggtransno = -1;
        match (c.cast, cast_to) {
            (Some(cast), Some(to)) => call(cast, to, vec![new.cast()], true),
            _ => new.cast(),
        }
    }
}

/// A call of function `f` returning `returns` (an explicit cast when `cast`).
///
/// # Safety
/// In [`to_partials`]; `args` are expressions of the query.
#[allow(unsafe_code)]
unsafe fn call(
    f: pg_sys::Oid,
    returns: pg_sys::Oid,
    args: Vec<*mut pg_sys::Node>,
    cast: bool,
) -> *mut pg_sys::Node {
    // SAFETY: as this function's contract.
    unsafe {
        let mut list: *mut pg_sys::List = std::ptr::null_mut();
        for a in args {
            list = pg_sys::lappend(list, a.cast());
        }
        pg_sys::makeFuncExpr(
            f,
            returns,
            list,
            pg_sys::InvalidOid,
            pg_sys::InvalidOid,
            if cast {
                pg_sys::CoercionForm::COERCE_EXPLICIT_CAST
            } else {
                pg_sys::CoercionForm::COERCE_EXPLICIT_CALL
            },
        )
        .cast()
    }
}

thread_local! {
    /// Set while `gather_partials` reads: its aggregate over one table may be split over the
    /// leaseholders, whose rows are its partial results.
    static PARTIAL_SCAN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the statement being routed is `gather_partials`' own aggregate.
pub fn partial_scan() -> bool {
    PARTIAL_SCAN.with(|p| p.get())
}

/// Each leaseholder's aggregates over its partitions of a replicated table, grouped by
/// `groups` (attribute numbers), as a JSON array of objects (`g1`…: the grouping columns,
/// `a1`…: the aggregates), read as the current user. `aggregates` is a list of aggregate
/// calls over the table (as range table entry 1) and `filter` an expression over it: trees
/// only PostgreSQL can have written (no client can make a `pg_node_tree`), checked to read
/// only the table's columns. For statements re-planned by `crate::gather`.
#[pg_extern(
    schema = "multiregion",
    sql = r#"
CREATE FUNCTION multiregion."gather_partials"(
	"table" oid,
	"groups" int2[],
	"aggregates" pg_node_tree,
	"filter" pg_node_tree DEFAULT NULL
) RETURNS text
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'gather_partials_wrapper';
"#
)]
fn gather_partials(
    table: Option<pg_sys::Oid>,
    groups: Option<Vec<Option<i16>>>,
    aggregates: Option<&str>,
    filter: Option<&str>,
) -> String {
    fn bad(what: &'static str, expected: &'static str) -> ! {
        MrError::BadArgument {
            what,
            value: "NULL".into(),
            expected,
        }
        .raise()
    }
    let table = table.unwrap_or_else(|| bad("table", "a table's oid"));
    let groups = groups.unwrap_or_default();
    let aggregates = aggregates.unwrap_or_else(|| bad("aggregates", "a list of aggregates"));
    let (schema, name) = qualified(table).unwrap_or_else(|e| e.raise());
    let group_names = column_names(table, Some(groups)).unwrap_or_else(|e| e.raise());
    let aggs = deparse_aggregates(table, aggregates).unwrap_or_else(|e| e.raise());
    let mut pairs: Vec<(String, String)> = group_names
        .iter()
        .enumerate()
        .map(|(i, c)| (format!("g{}", i + 1), format!("r.{}", quote_identifier(c))))
        .collect();
    pairs.extend(
        aggs.into_iter()
            .enumerate()
            .map(|(i, a)| (format!("a{}", i + 1), a)),
    );
    let object = json_object(&pairs);
    let filter = match filter {
        None => String::new(),
        Some(tree) => format!(
            " WHERE {}",
            crate::gather::deparse(table, tree).unwrap_or_else(|e| e.raise())
        ),
    };
    let group_by = if group_names.is_empty() {
        String::new()
    } else {
        format!(
            " GROUP BY {}",
            group_names
                .iter()
                .map(|c| format!("r.{}", quote_identifier(c)))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    let sql = format!(
        "SELECT ({object})::text FROM {}.{} r{filter}{group_by}",
        quote_identifier(&schema),
        quote_identifier(&name)
    );
    struct Leave(bool);
    impl Drop for Leave {
        fn drop(&mut self) {
            PARTIAL_SCAN.with(|p| p.set(self.0));
        }
    }
    let _leave = Leave(PARTIAL_SCAN.with(|p| p.replace(true)));
    json_rows(&sql)
}

/// A list of aggregate calls over a table (as range table entry 1) as SQL over alias `r`,
/// each checked to be a plain aggregate of this query level over the table's own columns.
#[allow(unsafe_code)]
fn deparse_aggregates(table: pg_sys::Oid, tree: &str) -> Result<Vec<String>, MrError> {
    let bad = || MrError::BadArgument {
        what: "aggregates",
        value: tree.chars().take(80).collect(),
        expected: "a list of aggregates over the table's own columns",
    };
    let text = CString::new(tree).map_err(|_| bad())?;
    // SAFETY: a pg_node_tree is nodeToString's output, which stringToNode reads back; the
    // walker only reads it; deparsing runs PostgreSQL's rule printer over a context naming
    // the table.
    unsafe {
        let list = pg_sys::stringToNode(text.as_ptr()) as *mut pg_sys::List;
        if list.is_null() || (*list).type_ != pg_sys::NodeTag::T_List {
            return Err(bad());
        }
        let context = pg_sys::deparse_context_for(c"r".as_ptr(), table);
        let mut out = Vec::new();
        for i in 0..(*list).length {
            let node = pg_sys::list_nth(list, i) as *mut pg_sys::Node;
            if node.is_null() || (*node).type_ != pg_sys::NodeTag::T_Aggref {
                return Err(bad());
            }
            let a = node as *mut pg_sys::Aggref;
            let mut cx = OnlyOf { index: 1, ok: true };
            only_of((*a).args.cast(), (&mut cx as *mut OnlyOf).cast());
            only_of((*a).aggfilter.cast(), (&mut cx as *mut OnlyOf).cast());
            if !cx.ok
                || (*a).agglevelsup != 0
                || !(*a).aggdirectargs.is_null()
                || !(*a).aggorder.is_null()
                || !(*a).aggdistinct.is_null()
            {
                return Err(bad());
            }
            let sql = pg_sys::deparse_expression(node, context, true, false);
            out.push(std::ffi::CStr::from_ptr(sql).to_string_lossy().into_owned());
        }
        Ok(out)
    }
}
