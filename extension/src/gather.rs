//! Reads that need every partition's rows in one place (an aggregate, a sort, a join) over
//! REGIONAL BY ROW tables whose partitions no single node holds (PLACEMENT RESTRICTED:
//! each partition's replicas stay in its region). pgmr answers `gather` for such a read;
//! the statement is then planned again here with each replicated table this node lacks a
//! replica of read through `multiregion.gather_rows(table)`: a plain scan of the table, which
//! runs on each leaseholder over its own partitions (the split read of ARCHITECTURE.md §9)
//! or whole on the leaseholder of a table of one range, and returns the rows, which
//! `jsonb_populate_recordset` turns back into the table's row type. The rest of the plan —
//! filters, aggregates, sorts, joins — runs here over them and the tables held here.
//!
//! Every row of those tables crosses the WAN once per statement (no filter is pushed to
//! the leaseholders): the price of a question no node can answer alone.

use crate::error::MrError;
use crate::regions::spi;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::quote_identifier;
use std::cell::Cell;
use std::ffi::CString;

thread_local! {
    /// Set while a statement is planned again to gather its tables: the planner hook
    /// rewrites them ([`rewrite`]), once.
    static GATHERING: Cell<bool> = const { Cell::new(false) };
    /// The plan last re-planned, or made by re-planning: never re-planned (again).
    static REPLANNED: Cell<usize> = const { Cell::new(0) };
}

/// Whether this read can be planned again with its tables gathered: a plain SELECT, planned
/// here from text this backend has (not already so planned).
///
/// # Safety
/// `qd` is a QueryDesc about to start.
#[allow(unsafe_code)]
pub unsafe fn may_replan(qd: &pg_sys::QueryDesc) -> bool {
    // SAFETY: the planned statement is valid for the query's life.
    unsafe {
        let ps = &*qd.plannedstmt;
        qd.operation == pg_sys::CmdType::CMD_SELECT
            && ps.commandType == pg_sys::CmdType::CMD_SELECT
            && ps.utilityStmt.is_null()
            && ps.rowMarks.is_null()
            && !ps.hasModifyingCTE
            && !qd.sourceText.is_null()
            && REPLANNED.with(Cell::get) != qd.plannedstmt as usize
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
    // whose text is not its query's alone — EXPLAIN ANALYZE, CREATE TABLE AS, COPY (…) TO —
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
        if (*query).commandType != pg_sys::CmdType::CMD_SELECT || !(*query).utilityStmt.is_null() {
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
    // The walk only collects (nothing in it may raise an error through PostgreSQL's C
    // walker); the entries are looked up and changed after it.
    let mut found: Vec<*mut pg_sys::RangeTblEntry> = Vec::new();
    // SAFETY: as this function's contract; the walker follows nodeFuncs.c's contract and
    // its context is `found`, which outlives the walk.
    unsafe { relations(query.cast(), (&mut found as *mut Vec<_>).cast()) };
    for rte in found {
        // SAFETY: each entry is a relation's, in the query being planned.
        unsafe {
            let relid = (*rte).relid;
            if crate::replication::is_replicated_table(relid) && !held_here(relid) {
                to_gathered(rte);
            }
        }
    }
}

/// Walker over a query tree: collects the plain and partitioned tables each Query met reads.
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
            let found = &mut *(cx as *mut Vec<*mut pg_sys::RangeTblEntry>);
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
                        found.push(rte);
                    }
                }
            }
            return pg_sys::query_tree_walker(q, Some(relations), cx, 0);
        }
        pg_sys::expression_tree_walker(node, Some(relations), cx)
    }
}

/// Turns a relation's range table entry into
/// `jsonb_populate_recordset(NULL::<its row type>, multiregion.gather_rows(<it>)::jsonb)`:
/// the same columns, dropped ones included, so the query's references to it stay valid.
/// The table's privileges and row security are checked by the gathering scan itself, which
/// runs as the current user.
///
/// # Safety
/// `rte` is a relation's entry in a query being planned.
#[allow(unsafe_code)]
unsafe fn to_gathered(rte: *mut pg_sys::RangeTblEntry) {
    // SAFETY: the relation is locked by analysis; the nodes built are palloc'd in the
    // planner's memory context, like the entry they go into.
    unsafe {
        let relid = (*rte).relid;
        let reltype = pg_sys::get_rel_type_id(relid);
        let rel = pg_sys::RelationIdGetRelation(relid);
        if rel.is_null() || reltype == pg_sys::InvalidOid {
            return;
        }
        let natts = (*(*rel).rd_att).natts;
        pg_sys::RelationClose(rel);
        let gather = function_oid(&["multiregion", "gather_rows"], &[pg_sys::OIDOID]);
        let populate = function_oid(
            &["pg_catalog", "jsonb_populate_recordset"],
            &[pg_sys::ANYELEMENTOID, pg_sys::JSONBOID],
        );
        let table = pg_sys::makeConst(
            pg_sys::OIDOID,
            -1,
            pg_sys::InvalidOid,
            4,
            pg_sys::Datum::from(relid),
            false,
            true,
        );
        let rows = pg_sys::makeFuncExpr(
            gather,
            pg_sys::TEXTOID,
            list1(table.cast()),
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
    }
}

/// Whether this node holds a replica of every range of a replicated table (read here, after
/// its read barrier, it needs no gathering).
fn held_here(table: pg_sys::Oid) -> bool {
    let Ok((schema, name)) = qualified(table) else {
        return false;
    };
    let table = mr_meta::TableRef {
        database: crate::routing::database(),
        schema,
        table: name,
    };
    match crate::sidecar::table_ranges(crate::routing::database(), vec![table]) {
        Ok(Some(ranges)) => !ranges.is_empty() && ranges.iter().all(|r| r.held),
        Ok(None) => true,
        Err(e) => e.raise(),
    }
}

/// A one-element list.
///
/// # Safety
/// `node` is a palloc'd node.
#[allow(unsafe_code)]
unsafe fn list1(node: *mut std::ffi::c_void) -> *mut pg_sys::List {
    // SAFETY: as this function's contract; lappend to NIL makes a new list.
    unsafe { pg_sys::lappend(std::ptr::null_mut(), node) }
}

/// The function of that qualified name and argument types (it exists: the extension's own,
/// or PostgreSQL's).
///
/// # Safety
/// Called in a transaction.
#[allow(unsafe_code)]
unsafe fn function_oid(name: &[&str], args: &[pg_sys::Oid]) -> pg_sys::Oid {
    // SAFETY: builds a list of String nodes from palloc'd copies; LookupFuncName raises an
    // error if the function is missing.
    unsafe {
        let mut names: *mut pg_sys::List = std::ptr::null_mut();
        for part in name {
            let c = CString::new(*part).expect("no NUL in a function name");
            names = pg_sys::lappend(
                names,
                pg_sys::makeString(pg_sys::pstrdup(c.as_ptr())).cast(),
            );
        }
        pg_sys::LookupFuncName(names, args.len() as i32, args.as_ptr(), false)
    }
}

/// Every row of a replicated table as a JSON array of objects (`to_jsonb` of each), read
/// through the leaseholders as a plain scan of the table is, as the current user (its
/// privileges and row security apply). For statements re-planned by this module.
#[pg_extern(schema = "multiregion", volatile, parallel_unsafe)]
fn gather_rows(table: pg_sys::Oid) -> String {
    let (schema, name) = qualified(table).unwrap_or_else(|e| e.raise());
    let sql = format!(
        "SELECT pg_catalog.to_jsonb(r)::text FROM {}.{} r",
        quote_identifier(&schema),
        quote_identifier(&name)
    );
    let rows = spi::read_rows(&sql, vec![]);
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

/// A table's schema and name.
#[allow(unsafe_code)]
fn qualified(table: pg_sys::Oid) -> Result<(String, String), MrError> {
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
