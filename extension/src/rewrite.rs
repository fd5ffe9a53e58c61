//! What the extension changes in a statement after PostgreSQL has analysed it, for REGIONAL BY
//! ROW tables:
//!
//! * the system-provided `crdb_region` column leaves what a star expands to in the top-level
//!   `SELECT` (also `TABLE t`) and in `RETURNING`, as CockroachDB's hidden columns do; naming it
//!   still reads it;
//! * a region column computed from other columns (`AS (expr) STORED`) is computed by `INSERT`,
//!   `UPDATE` and `ON CONFLICT DO UPDATE`: PostgreSQL cannot partition by a generated column, so
//!   the column is a plain one, and the expression moves into the statement here, where
//!   partition routing will see its value;
//! * a table created with `multiregion.enable_auto_rehoming` on gets
//!   `crdb_region = rehome_row()` on every `UPDATE` that does not set the region itself
//!   (CockroachDB's `ON UPDATE rehome_row()`). A trigger cannot do either of the last two: a
//!   BEFORE ROW trigger runs after the row was routed to a partition, and may not move it.
//!
//! Known gaps: a star inside `INSERT … SELECT *`, `CREATE TABLE … AS`, set operations and
//! whole-row references still include the hidden column; `COPY` and `MERGE` do not compute a
//! region column.

use crate::error::MrError;
use pgrx::pg_sys;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_int;
use std::ffi::{c_void, CStr, CString};
use std::rc::Rc;

// rewriteManip.h, which pgrx does not bind. `ReplaceVarsNoMatchOption` is a C enum: these are
// its values in PostgreSQL 15.
const REPLACEVARS_CHANGE_VARNO: c_int = 1;
pub(crate) const REPLACEVARS_SUBSTITUTE_NULL: c_int = 2;

// Called only through `pg_sys::ffi::pg_guard_ffi_boundary`, so a PostgreSQL ERROR inside them
// unwinds as Rust expects.
#[allow(unsafe_code)]
unsafe extern "C-unwind" {
    fn ReplaceVarsFromTargetList(
        node: *mut pg_sys::Node,
        target_varno: c_int,
        sublevels_up: c_int,
        target_rte: *mut pg_sys::RangeTblEntry,
        targetlist: *mut pg_sys::List,
        nomatch_option: c_int,
        nomatch_varno: c_int,
        outer_has_sublinks: *mut bool,
    ) -> *mut pg_sys::Node;
    pub(crate) fn ChangeVarNodes(
        node: *mut pg_sys::Node,
        old_varno: c_int,
        new_varno: c_int,
        sublevels_up: c_int,
    );
}

/// What the rewrite needs to know about a REGIONAL BY ROW table.
#[derive(Debug)]
pub(crate) struct RbrTable {
    pub(crate) region_attno: i16,
    pub(crate) region_column: String,
    hidden: bool,
    /// The computed region column's expression, as SQL over the table's columns.
    pub(crate) computed: Option<String>,
    auto_rehoming: bool,
    /// Its partitions' indexes, for CockroachDB's duplicate-key texts (`unique_errors`).
    partition_indexes: Vec<crate::unique_errors::PartitionIndex>,
}

/// For a partition's index of a cached REGIONAL BY ROW table (in `schema`, when known): (the
/// table's index, the table) and the region column. Reads only this backend's cache (it runs inside error reporting).
pub(crate) fn partition_index(
    schema: Option<&str>,
    index: &str,
) -> Option<((String, String), String)> {
    TABLES.with(|t| {
        let t = t.try_borrow().ok()?;
        t.values().flatten().find_map(|table| {
            table
                .partition_indexes
                .iter()
                .find(|p| p.name == index && schema.is_none_or(|s| s == p.schema))
                .map(|p| {
                    (
                        (p.parent_index.clone(), p.parent_table.clone()),
                        table.region_column.clone(),
                    )
                })
        })
    })
}

thread_local! {
    /// Per backend; entries leave when PostgreSQL invalidates the relation's cache entry, which
    /// every change to a table's locality causes (see `catalog::store_locality`).
    static TABLES: RefCell<HashMap<pg_sys::Oid, Option<Rc<RbrTable>>>> =
        RefCell::new(HashMap::new());
}

/// Forgets what is cached about `relid`, or about every table for the invalid OID.
pub fn forget(relid: pg_sys::Oid) {
    TABLES.with(|t| {
        let mut t = t.borrow_mut();
        if relid == pg_sys::InvalidOid {
            t.clear();
        } else {
            t.remove(&relid);
        }
    });
    // Any relation's: a new key table's own is one, and no catalog may be read here to tell.
    KEY_TABLES.with(|k| {
        if let Ok(mut k) = k.try_borrow_mut() {
            *k = None;
        }
    });
}

/// The entry point, from the `post_parse_analyze_hook`.
#[allow(unsafe_code)]
pub fn after_analysis(pstate: &pg_sys::ParseState, query: &mut pg_sys::Query) {
    if !query.utilityStmt.is_null() {
        return;
    }
    // SAFETY: `p_sourcetext` is null or the NUL-terminated text the statement was parsed
    // from, which outlives analysis.
    let source = unsafe {
        (!pstate.p_sourcetext.is_null()).then(|| {
            CStr::from_ptr(pstate.p_sourcetext)
                .to_string_lossy()
                .into_owned()
        })
    };
    // Only a write can violate a foreign key.
    if query.commandType != pg_sys::CmdType::CMD_SELECT {
        note_key_tables();
    }
    modify(query, true, source.as_deref());
}

thread_local! {
    /// The database's key tables by name, each with the table it keeps unique: a foreign
    /// key's violation names the key table, reported as its table (`unique_errors`). Loaded
    /// whole (the check that fails may have run at another node's leaseholder, so this
    /// backend need not have read the key table itself) by the first write after any
    /// relation's cache entry went (a new key table's among them); `None` until then.
    static KEY_TABLES: RefCell<Option<HashMap<String, String>>> = const { RefCell::new(None) };
}

/// The table a key table (by name) keeps unique. Reads only this backend's cache (it runs
/// inside error reporting).
pub(crate) fn key_table_base(name: &str) -> Option<String> {
    KEY_TABLES.with(|k| k.try_borrow().ok()?.as_ref()?.get(name).cloned())
}

/// Loads the database's key tables, if it has any and they are not loaded.
#[allow(unsafe_code)]
fn note_key_tables() {
    if KEY_TABLES.with(|k| k.borrow().is_some()) {
        return;
    }
    // SAFETY: catalog lookups by name; `missing_ok` makes them return InvalidOid, not raise.
    // The catalog table is looked for too: while CREATE EXTENSION runs its script, the
    // schemas exist before the table does.
    let ready = unsafe {
        let mr = pg_sys::get_namespace_oid(c"multiregion".as_ptr(), true);
        mr != pg_sys::InvalidOid
            && pg_sys::get_namespace_oid(c"multiregion_keys".as_ptr(), true) != pg_sys::InvalidOid
            && pg_sys::get_relname_relid(c"global_key".as_ptr(), mr) != pg_sys::InvalidOid
    };
    if !ready || !extension_installed() {
        return;
    }
    // Loaded before the query runs: the query is analysed too, and must not load again.
    KEY_TABLES.with(|k| *k.borrow_mut() = Some(HashMap::new()));
    let map = crate::regions::spi::read_rows(
        "SELECT k.relname::text, c.relname::text FROM multiregion.global_key g \
         JOIN pg_catalog.pg_class k ON k.oid = g.key_table \
         JOIN pg_catalog.pg_class c ON c.oid = g.relid",
        vec![],
    )
    .into_iter()
    .filter_map(|r| Some((r.first()?.clone()?, r.get(1)?.clone()?)))
    .collect();
    KEY_TABLES.with(|k| *k.borrow_mut() = Some(map));
}

#[allow(unsafe_code)]
fn modify(query: &mut pg_sys::Query, top_level: bool, source: Option<&str>) {
    use pg_sys::CmdType::*;
    // SAFETY: every pointer below comes from the Query PostgreSQL just analysed: lists of the
    // node types its fields are documented to hold, valid in the current memory context.
    unsafe {
        for cte in ptrs::<pg_sys::CommonTableExpr>(query.cteList) {
            let sub = (*cte).ctequery as *mut pg_sys::Query;
            if is_a(sub.cast(), pg_sys::NodeTag::T_Query) && (*sub).commandType != CMD_SELECT {
                // Its RETURNING feeds the outer statement, whose Vars count its columns.
                modify(&mut *sub, false, None);
            }
        }
        match query.commandType {
            CMD_SELECT if top_level && query.setOperations.is_null() => {
                query.targetList = hide_stars(query.targetList, source, Hidden::Junk);
            }
            CMD_INSERT | CMD_UPDATE | CMD_DELETE => {
                let rte = rt_fetch(query, query.resultRelation);
                let table = lookup((*rte).relid);
                if let Some(table) = &table {
                    write_region(query, rte, table);
                }
                if top_level {
                    query.returningList = hide_stars(query.returningList, source, Hidden::Drop);
                }
            }
            _ => {}
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Hidden {
    /// Keep the column as a junk column at the end: sort and group clauses may point at it.
    Junk,
    /// Drop it (RETURNING, where junk columns would still be returned).
    Drop,
}

/// Takes the hidden region column out of what stars expanded to in `list`.
#[allow(unsafe_code)]
unsafe fn hide_stars(
    list: *mut pg_sys::List,
    source: Option<&str>,
    how: Hidden,
) -> *mut pg_sys::List {
    let entries = unsafe { ptrs::<pg_sys::TargetEntry>(list) };
    let hidden = |tle: *mut pg_sys::TargetEntry| -> bool {
        // SAFETY: target list entries of an analysed query.
        let tle = unsafe { &*tle };
        if tle.resjunk || tle.resorigtbl == pg_sys::InvalidOid {
            return false;
        }
        let expr = tle.expr as *mut pg_sys::Node;
        // SAFETY: `expr` is a node; checked to be a Var before the cast.
        if !unsafe { is_a(expr, pg_sys::NodeTag::T_Var) } {
            return false;
        }
        let location = unsafe { (*(expr as *mut pg_sys::Var)).location };
        let from_star = match (location, source) {
            (-1, _) => true, // TABLE t: the grammar's own star, with no location
            (l, Some(s)) if l >= 0 => mr_sql::is_star_reference(s, l as usize),
            _ => false,
        };
        from_star
            && lookup(tle.resorigtbl).is_some_and(|t| t.hidden && t.region_attno == tle.resorigcol)
    };
    let (hide, keep): (Vec<_>, Vec<_>) = entries.iter().partition(|&&e| hidden(e));
    if hide.is_empty() {
        return list;
    }
    let mut out: Vec<*mut pg_sys::TargetEntry> = keep;
    if how == Hidden::Junk {
        for &tle in &hide {
            // SAFETY: as above; the entry is ours to modify until the query is rewritten.
            unsafe { (*tle).resjunk = true };
        }
        out.extend(hide);
    }
    for (i, &tle) in out.iter().enumerate() {
        // SAFETY: as above; resno counts from 1 and target lists are far below i16::MAX.
        unsafe { (*tle).resno = (i + 1) as pg_sys::AttrNumber };
    }
    unsafe { list_of(&out) }
}

/// Computes the region column into INSERT, UPDATE and ON CONFLICT DO UPDATE, and rehomes on
/// UPDATE where the table asks for it.
#[allow(unsafe_code)]
unsafe fn write_region(
    query: &mut pg_sys::Query,
    rte: *mut pg_sys::RangeTblEntry,
    table: &RbrTable,
) {
    use pg_sys::CmdType::*;
    let (computed, rehome) = (table.computed.as_deref(), table.auto_rehoming);
    // SAFETY: the analysed statement's ON CONFLICT clause, read only.
    let by_key = unsafe { conflict_key_without_region(query, rte, table) };
    if computed.is_none() && !rehome && by_key.is_none() {
        return;
    }
    // SAFETY: the relation is the statement's target, locked by the analysis that named it;
    // the relcache entry is held only while expressions are built from it.
    unsafe {
        let rel = pg_sys::RelationIdGetRelation((*rte).relid);
        if rel.is_null() {
            return;
        }
        let varno = query.resultRelation;
        let has_sublinks: *mut bool = &mut query.hasSubLinks;
        match query.commandType {
            CMD_INSERT => {
                if let Some(sql) = computed {
                    query.targetList = compute_on_insert(
                        rel,
                        rte,
                        varno,
                        query.targetList,
                        table,
                        sql,
                        has_sublinks,
                    );
                }
                if let Some(key) = &by_key {
                    query.targetList = conflict_in_row_region(
                        rel,
                        rte,
                        varno,
                        query.targetList,
                        query.onConflict,
                        table,
                        key,
                        has_sublinks,
                    );
                    let oc = query.onConflict;
                    let region = pg_sys::makeVar(
                        varno,
                        table.region_attno,
                        attribute(rel, table.region_attno).atttypid,
                        -1,
                        attribute(rel, table.region_attno).attcollation,
                        0,
                    );
                    let mut elem = pgrx::PgBox::<pg_sys::InferenceElem>::alloc_node(
                        pg_sys::NodeTag::T_InferenceElem,
                    );
                    elem.expr = region.cast();
                    (*oc).arbiterElems = pg_sys::lappend((*oc).arbiterElems, elem.into_pg().cast());
                }
                let oc = query.onConflict;
                // A row found by its key in another region and rehomed is moved before the
                // proposed row is written (`conflict_in_row_region`): PostgreSQL's ON
                // CONFLICT DO UPDATE cannot move it between partitions itself.
                let rehoming_moves = by_key.is_none() || computed.is_some();
                if !oc.is_null()
                    && (*oc).action == pg_sys::OnConflictAction::ONCONFLICT_UPDATE
                    && rehoming_moves
                {
                    (*oc).onConflictSet =
                        on_update(rel, rte, varno, (*oc).onConflictSet, table, has_sublinks);
                }
            }
            CMD_UPDATE => {
                query.targetList =
                    on_update(rel, rte, varno, query.targetList, table, has_sublinks);
            }
            _ => {}
        }
        pg_sys::RelationClose(rel);
    }
}

/// The columns (names, in the clause's order) of an INSERT's `ON CONFLICT (…)` target that
/// leaves out the region column of a REGIONAL BY ROW table, where the table has a unique key
/// on exactly those columns and the region (every key of such a table leads with its region:
/// PostgreSQL's partitioning needs it). CockroachDB's keys of such a table are the declared
/// columns, unique across regions; PostgreSQL would find no arbiter index for them.
#[allow(unsafe_code)]
unsafe fn conflict_key_without_region(
    query: &pg_sys::Query,
    rte: *mut pg_sys::RangeTblEntry,
    table: &RbrTable,
) -> Option<Vec<String>> {
    use pg_sys::CmdType::CMD_INSERT;
    // SAFETY: the caller's analysed INSERT: its OnConflictExpr's arbiter elements are
    // InferenceElems whose `expr` is an analysed expression.
    unsafe {
        let oc = query.onConflict;
        if query.commandType != CMD_INSERT || oc.is_null() || !(*oc).arbiterWhere.is_null() {
            return None;
        }
        let mut attnos = vec![];
        for elem in ptrs::<pg_sys::InferenceElem>((*oc).arbiterElems) {
            let expr = (*elem).expr;
            if !is_a(expr, pg_sys::NodeTag::T_Var) {
                return None;
            }
            let var = &*(expr as *mut pg_sys::Var);
            if var.varno != query.resultRelation || var.varlevelsup != 0 {
                return None;
            }
            if var.varattno == table.region_attno {
                return None;
            }
            attnos.push(var.varattno);
        }
        if attnos.is_empty() {
            return None;
        }
        let mut key: Vec<i16> = attnos.iter().copied().chain([table.region_attno]).collect();
        key.sort_unstable();
        key.dedup();
        let key = format!(
            "{{{}}}",
            key.iter().map(i16::to_string).collect::<Vec<_>>().join(",")
        );
        let relid = (*rte).relid;
        let found = crate::regions::spi::read_one(
            "SELECT 'yes' FROM pg_catalog.pg_index i \
              WHERE i.indrelid = $1 AND i.indisunique AND i.indpred IS NULL \
                AND i.indexprs IS NULL \
                AND (SELECT array_agg(k ORDER BY k) \
                       FROM unnest((i.indkey::int2[])[0:i.indnkeyatts - 1]) k) = $2::int2[] \
              LIMIT 1",
            vec![relid.into(), key.into()],
        );
        found?;
        let names = crate::regions::spi::read_rows(
            "SELECT a.attname::text FROM unnest($2::int2[]) WITH ORDINALITY AS u(n, o) \
               JOIN pg_catalog.pg_attribute a ON a.attrelid = $1 AND a.attnum = u.n \
              ORDER BY u.o",
            vec![
                relid.into(),
                format!(
                    "{{{}}}",
                    attnos
                        .iter()
                        .map(i16::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                )
                .into(),
            ],
        );
        Some(
            names
                .into_iter()
                .filter_map(|r| r.into_iter().next().flatten())
                .collect(),
        )
    }
}

/// INSERT … ON CONFLICT by a key without the region: the region column becomes the region of
/// the row already holding the key, wherever it lives, or else the value it had
/// (`multiregion.conflict_region`), so the row goes to — and its conflict is decided in — the
/// partition that holds the key. Where the statement decides the region itself (given, or
/// computed by `compute_on_insert`, run first) and the key lives in another region, the
/// clause says what happens, as in CockroachDB: DO NOTHING leaves the row out; a DO UPDATE
/// that assigns the region (or a column it is computed from; or any, under auto-rehoming)
/// moves the existing row first (`moved.rs`, "rows an upsert moves"); any other DO UPDATE
/// updates the row where it is.
#[allow(unsafe_code)]
#[allow(clippy::too_many_arguments)]
unsafe fn conflict_in_row_region(
    rel: pg_sys::Relation,
    rte: *mut pg_sys::RangeTblEntry,
    varno: i32,
    list: *mut pg_sys::List,
    oc: *mut pg_sys::OnConflictExpr,
    table: &RbrTable,
    key: &[String],
    has_sublinks: *mut bool,
) -> *mut pg_sys::List {
    use crate::regions::spi::{ident, lit};
    // SAFETY: the caller's contract: an analysed INSERT's target list, its ON CONFLICT clause
    // and its open target.
    unsafe {
        let entries = ptrs::<pg_sys::TargetEntry>(list);
        let own = entries
            .iter()
            .copied()
            .find(|&t| (*t).resno == table.region_attno);
        // Decided by the statement: given, or computed from its values (a CHECK constraint
        // ties a computed region to the row, so the row cannot be redirected to another).
        let decided = if table.computed.is_some() {
            "computed"
        } else if own.is_some_and(|t| !is_a((*t).expr.cast(), pg_sys::NodeTag::T_SetToDefault)) {
            "given"
        } else {
            "default"
        };
        // The columns that place a row: the region, or those it is computed from.
        let placing: Vec<i16> = match &table.computed {
            Some(sql) => cook(rel, sql, table.region_attno, varno).1,
            None => vec![table.region_attno],
        };
        let assigned: Vec<i16> = if (*oc).action == pg_sys::OnConflictAction::ONCONFLICT_UPDATE {
            ptrs::<pg_sys::TargetEntry>((*oc).onConflictSet)
                .iter()
                .filter(|&&t| !(*t).resjunk)
                .map(|&t| (*t).resno)
                .collect()
        } else {
            Vec::new()
        };
        let rehomes = table.auto_rehoming && table.computed.is_none();
        let action = if (*oc).action == pg_sys::OnConflictAction::ONCONFLICT_NOTHING {
            "nothing"
        } else if rehomes || placing.iter().any(|a| assigned.contains(a)) {
            "move"
        } else {
            "update"
        };
        // The existing row moves by these columns, set to the proposed row's values: those of
        // a computed region that the DO UPDATE assigns (it will assign them again, as
        // written), else the region itself.
        let placed = if action == "move" {
            let pairs: Vec<String> = placing
                .iter()
                .filter(|a| table.computed.is_none() || assigned.contains(a))
                .map(|&a| {
                    let name = pgrx::name_data_to_str(&attribute(rel, a).attname).to_string();
                    format!("{}, {}", lit(&name), ident(&name))
                })
                .collect();
            format!("pg_catalog.jsonb_build_object({})", pairs.join(", "))
        } else {
            "NULL::pg_catalog.jsonb".into()
        };
        let region_value = match own {
            Some(t) => with_defaults(rel, t),
            None => default_entry(rel, table.region_attno),
        };
        let pairs: Vec<String> = key
            .iter()
            .map(|c| format!("{}, {}", lit(c), ident(c)))
            .collect();
        let sql = format!(
            "multiregion.conflict_region({}::pg_catalog.oid::pg_catalog.regclass, \
             pg_catalog.jsonb_build_object({}), {}::pg_catalog.text, {}, {}, {placed})",
            (*rte).relid.to_u32(),
            pairs.join(", "),
            ident(&table.region_column),
            lit(decided),
            lit(action),
        );
        let (expr, _) = cook(rel, &sql, table.region_attno, varno);
        let others: Vec<_> = entries.into_iter().filter(|&t| Some(t) != own).collect();
        let mut values: Vec<_> = others.iter().map(|&t| with_defaults(rel, t)).collect();
        values.push(region_value);
        let value = substitute(
            expr,
            varno,
            rte,
            &values,
            REPLACEVARS_SUBSTITUTE_NULL,
            0,
            has_sublinks,
        );
        let mut out = others;
        out.push(new_entry(value, table));
        list_of(&out)
    }
}

/// INSERT: the region column becomes the expression over the values being inserted.
#[allow(unsafe_code)]
unsafe fn compute_on_insert(
    rel: pg_sys::Relation,
    rte: *mut pg_sys::RangeTblEntry,
    varno: i32,
    list: *mut pg_sys::List,
    table: &RbrTable,
    sql: &str,
    has_sublinks: *mut bool,
) -> *mut pg_sys::List {
    // SAFETY: the caller's contract: an analysed INSERT's target list and its open target.
    unsafe {
        let (expr, deps) = cook(rel, sql, table.region_attno, varno);
        let mut kept = vec![];
        let mut values = vec![];
        for tle in ptrs::<pg_sys::TargetEntry>(list) {
            if (*tle).resno == table.region_attno {
                if !is_a((*tle).expr.cast(), pg_sys::NodeTag::T_SetToDefault) {
                    MrError::WriteComputedColumn {
                        column: table.region_column.clone(),
                    }
                    .raise();
                }
                continue;
            }
            kept.push(tle);
            values.push(with_defaults(rel, tle));
        }
        let given: Vec<i16> = kept.iter().map(|&t| (*t).resno).collect();
        for attno in deps.into_iter().filter(|a| !given.contains(a)) {
            let default = pg_sys::build_column_default(rel, attno.into());
            if !default.is_null() {
                values.push(pg_sys::makeTargetEntry(
                    default.cast(),
                    attno,
                    std::ptr::null_mut(),
                    false,
                ));
            }
        }
        let value = substitute(
            expr,
            varno,
            rte,
            &values,
            REPLACEVARS_SUBSTITUTE_NULL,
            0,
            has_sublinks,
        );
        kept.push(new_entry(value, table));
        list_of(&kept)
    }
}

/// UPDATE (or ON CONFLICT DO UPDATE): recompute a computed region column when a column it is
/// computed from is assigned; otherwise rehome if the table asks for it.
#[allow(unsafe_code)]
unsafe fn on_update(
    rel: pg_sys::Relation,
    rte: *mut pg_sys::RangeTblEntry,
    varno: i32,
    list: *mut pg_sys::List,
    table: &RbrTable,
    has_sublinks: *mut bool,
) -> *mut pg_sys::List {
    // SAFETY: the caller's contract: an analysed UPDATE target list and its open target.
    unsafe {
        let entries = ptrs::<pg_sys::TargetEntry>(list);
        let own = entries
            .iter()
            .copied()
            .find(|&t| (*t).resno == table.region_attno);
        let Some(sql) = table.computed.as_deref() else {
            // Auto-rehoming: an explicit region wins.
            if own.is_some() {
                return list;
            }
            let (expr, _) = cook(rel, "multiregion.rehome_row()", table.region_attno, varno);
            let mut out = entries;
            out.push(new_entry(expr, table));
            return list_of(&out);
        };
        let reset = match own {
            Some(t) if is_a((*t).expr.cast(), pg_sys::NodeTag::T_SetToDefault) => true,
            Some(_) => MrError::WriteComputedColumn {
                column: table.region_column.clone(),
            }
            .raise(),
            None => false,
        };
        let (expr, deps) = cook(rel, sql, table.region_attno, varno);
        let others: Vec<_> = entries.into_iter().filter(|&t| Some(t) != own).collect();
        if !reset && !others.iter().any(|&t| deps.contains(&(*t).resno)) {
            return list;
        }
        let values: Vec<_> = others.iter().map(|&t| with_defaults(rel, t)).collect();
        let value = substitute(
            expr,
            varno,
            rte,
            &values,
            REPLACEVARS_CHANGE_VARNO,
            varno,
            has_sublinks,
        );
        let mut out = others;
        out.push(new_entry(value, table));
        list_of(&out)
    }
}

/// `expr` with the Vars of `varno` replaced by the matching entries of `values` (by column
/// number); unmatched ones become NULL or stay, as `nomatch` says.
#[allow(unsafe_code)]
pub(crate) unsafe fn substitute(
    expr: *mut pg_sys::Node,
    varno: i32,
    rte: *mut pg_sys::RangeTblEntry,
    values: &[*mut pg_sys::TargetEntry],
    nomatch: c_int,
    nomatch_varno: c_int,
    has_sublinks: *mut bool,
) -> *mut pg_sys::Node {
    // SAFETY: the caller's nodes, all of the statement being rewritten; the guard turns a
    // PostgreSQL ERROR inside into a Rust unwind.
    unsafe {
        let values = list_of(values);
        pg_sys::ffi::pg_guard_ffi_boundary(|| {
            ReplaceVarsFromTargetList(
                expr,
                varno,
                0,
                rte,
                values,
                nomatch,
                nomatch_varno,
                has_sublinks,
            )
        })
    }
}

/// `tle` with a `DEFAULT` value replaced by the column's default expression (or NULL), so it
/// can be substituted into another expression, where the rewriter would not look for it.
#[allow(unsafe_code)]
unsafe fn with_defaults(
    rel: pg_sys::Relation,
    tle: *mut pg_sys::TargetEntry,
) -> *mut pg_sys::TargetEntry {
    // SAFETY: a target entry of the statement and its open target relation.
    unsafe {
        if !is_a((*tle).expr.cast(), pg_sys::NodeTag::T_SetToDefault) {
            return tle;
        }
        default_entry(rel, (*tle).resno)
    }
}

/// Column `attno`'s default expression (or NULL) as a target entry of that column.
#[allow(unsafe_code)]
unsafe fn default_entry(rel: pg_sys::Relation, attno: i16) -> *mut pg_sys::TargetEntry {
    // SAFETY: `rel` is the statement's open target relation and `attno` one of its columns.
    unsafe {
        let mut expr = pg_sys::build_column_default(rel, attno.into());
        if expr.is_null() {
            let att = attribute(rel, attno);
            expr = pg_sys::makeNullConst(att.atttypid, att.atttypmod, att.attcollation).cast();
        }
        pg_sys::makeTargetEntry(expr.cast(), attno, std::ptr::null_mut(), false)
    }
}

#[allow(unsafe_code)]
unsafe fn new_entry(expr: *mut pg_sys::Node, table: &RbrTable) -> *mut pg_sys::TargetEntry {
    let name = CString::new(table.region_column.as_str()).unwrap_or_default();
    // SAFETY: makeTargetEntry keeps the pointers; pstrdup copies the name into the current
    // memory context, which lives as long as the query.
    unsafe {
        pg_sys::makeTargetEntry(
            expr.cast(),
            table.region_attno,
            pg_sys::pstrdup(name.as_ptr()),
            false,
        )
    }
}

/// Parses and analyses `sql`, an expression over `rel`'s columns, coerced to the type of
/// column `attno`, as PostgreSQL does for a generated column; returns it with its Vars
/// numbered `varno`, and the attribute numbers it reads.
#[allow(unsafe_code)]
pub(crate) unsafe fn cook(
    rel: pg_sys::Relation,
    sql: &str,
    attno: i16,
    varno: i32,
) -> (*mut pg_sys::Node, Vec<i16>) {
    let text = CString::new(format!("SELECT ({sql})")).unwrap_or_default();
    // SAFETY: PostgreSQL's own parse-analysis entry points, used as cookDefault() uses them;
    // the raw parse of `SELECT (expr)` is one RawStmt holding a SelectStmt with one ResTarget.
    unsafe {
        let pstate = pg_sys::make_parsestate(std::ptr::null_mut());
        (*pstate).p_sourcetext = pg_sys::pstrdup(text.as_ptr());
        let nsitem = pg_sys::addRangeTableEntryForRelation(
            pstate,
            rel,
            pg_sys::AccessShareLock as i32,
            std::ptr::null_mut(),
            false,
            true,
        );
        pg_sys::addNSItemToQuery(pstate, nsitem, true, true, true);
        let raw = pg_sys::raw_parser(
            (*pstate).p_sourcetext,
            pg_sys::RawParseMode::RAW_PARSE_DEFAULT,
        );
        let stmt = ptrs::<pg_sys::RawStmt>(raw)[0];
        let select = (*stmt).stmt as *mut pg_sys::SelectStmt;
        let target = ptrs::<pg_sys::ResTarget>((*select).targetList)[0];
        let expr = pg_sys::transformExpr(
            pstate,
            (*target).val,
            pg_sys::ParseExprKind::EXPR_KIND_GENERATED_COLUMN,
        );
        let att = attribute(rel, attno);
        let expr = pg_sys::coerce_to_target_type(
            pstate,
            expr,
            pg_sys::exprType(expr),
            att.atttypid,
            att.atttypmod,
            pg_sys::CoercionContext::COERCION_ASSIGNMENT,
            pg_sys::CoercionForm::COERCE_IMPLICIT_CAST,
            -1,
        );
        if expr.is_null() {
            MrError::BadArgument {
                what: "region expression",
                value: sql.to_string(),
                expected: "an expression castable to crdb_internal_region",
            }
            .raise();
        }
        pg_sys::assign_expr_collations(pstate, expr);
        let mut attrs: *mut pg_sys::Bitmapset = std::ptr::null_mut();
        pg_sys::pull_varattnos(expr, 1, &mut attrs);
        let mut deps = vec![];
        let mut m = -1;
        loop {
            m = pg_sys::bms_next_member(attrs, m);
            if m < 0 {
                break;
            }
            deps.push((m + pg_sys::FirstLowInvalidHeapAttributeNumber) as i16);
        }
        pg_sys::ffi::pg_guard_ffi_boundary(|| ChangeVarNodes(expr, 1, varno, 0));
        pg_sys::free_parsestate(pstate);
        (expr, deps)
    }
}

/// Column `attno` (1-based) of an open relation.
#[allow(unsafe_code)]
unsafe fn attribute(rel: pg_sys::Relation, attno: i16) -> pg_sys::FormData_pg_attribute {
    // SAFETY: `rel` is open, and `attno` is a column of it (the caller got it from its catalog).
    unsafe {
        let desc = (*rel).rd_att;
        *(*desc).attrs.as_ptr().add((attno - 1) as usize)
    }
}

/// What is known about `relid` as a REGIONAL BY ROW table, from the cache or the catalog.
pub(crate) fn lookup(relid: pg_sys::Oid) -> Option<Rc<RbrTable>> {
    if let Some(hit) = TABLES.with(|t| t.borrow().get(&relid).cloned()) {
        return hit;
    }
    let found = if has_region_column(relid) && extension_installed() {
        read_catalog(relid)
    } else {
        None
    };
    let found = found.map(Rc::new);
    TABLES.with(|t| t.borrow_mut().insert(relid, found.clone()));
    found
}

/// A cheap test, from caches only, that spares tables without a region-typed column (and
/// databases without the extension) the catalog query.
#[allow(unsafe_code)]
fn has_region_column(relid: pg_sys::Oid) -> bool {
    // SAFETY: syscache and relcache lookups; the relcache reference is released before return.
    unsafe {
        let region_type = pg_sys::GetSysCacheOid(
            pg_sys::SysCacheIdentifier::TYPENAMENSP as c_int,
            pg_sys::Anum_pg_type_oid as pg_sys::AttrNumber,
            pg_sys::Datum::from(c"crdb_internal_region".as_ptr()),
            pg_sys::Datum::from(pg_sys::PG_PUBLIC_NAMESPACE),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
        );
        if region_type == pg_sys::InvalidOid {
            return false;
        }
        let rel = pg_sys::RelationIdGetRelation(relid);
        if rel.is_null() {
            return false;
        }
        let desc = (*rel).rd_att;
        let attrs = (*desc).attrs.as_slice((*desc).natts as usize);
        let found = attrs
            .iter()
            .any(|a| !a.attisdropped && a.atttypid == region_type);
        pg_sys::RelationClose(rel);
        found
    }
}

/// Whether this database has the extension (a type of the same name alone proves nothing).
#[allow(unsafe_code)]
fn extension_installed() -> bool {
    // SAFETY: a catalog lookup by name; `missing_ok` makes it return InvalidOid, not raise.
    unsafe { pg_sys::get_extension_oid(c"pg_multiregion".as_ptr(), true) != pg_sys::InvalidOid }
}

fn read_catalog(relid: pg_sys::Oid) -> Option<RbrTable> {
    let row = crate::regions::spi::read_rows(
        "SELECT a.attnum::text, l.region_column::text, l.hidden::text, l.region_expr_sql, \
                l.auto_rehoming::text \
         FROM multiregion.table_locality l JOIN pg_catalog.pg_attribute a \
           ON a.attrelid = l.relid AND a.attname = l.region_column AND NOT a.attisdropped \
         WHERE l.relid = $1 AND l.locality = 'regional_by_row'",
        vec![relid.into()],
    )
    .into_iter()
    .next()?;
    let get = |i: usize| row.get(i).cloned().flatten();
    let partition_indexes = crate::regions::spi::read_rows(
        "SELECT pn.nspname::text, pi.relname::text, ci.relname::text, pc.relname::text \
         FROM pg_catalog.pg_inherits t \
         JOIN pg_catalog.pg_index x ON x.indrelid = t.inhrelid \
         JOIN pg_catalog.pg_class pi ON pi.oid = x.indexrelid \
         JOIN pg_catalog.pg_namespace pn ON pn.oid = pi.relnamespace \
         JOIN pg_catalog.pg_inherits ii ON ii.inhrelid = x.indexrelid \
         JOIN pg_catalog.pg_class ci ON ci.oid = ii.inhparent \
         JOIN pg_catalog.pg_class pc ON pc.oid = t.inhparent \
         WHERE t.inhparent = $1",
        vec![relid.into()],
    )
    .into_iter()
    .filter_map(|r| {
        let get = |i: usize| r.get(i).cloned().flatten();
        Some(crate::unique_errors::PartitionIndex {
            schema: get(0)?,
            name: get(1)?,
            parent_index: get(2)?,
            parent_table: get(3)?,
        })
    })
    .collect();
    Some(RbrTable {
        region_attno: get(0)?.parse().ok()?,
        region_column: get(1)?,
        hidden: get(2).as_deref() == Some("true"),
        computed: get(3),
        auto_rehoming: get(4).as_deref() == Some("true"),
        partition_indexes,
    })
}

/// The elements of a pointer list, copied out.
#[allow(unsafe_code)]
pub(crate) unsafe fn ptrs<T>(list: *mut pg_sys::List) -> Vec<*mut T> {
    if list.is_null() {
        return vec![];
    }
    // SAFETY: a valid List of pointers holds `length` initialised cells at `elements`.
    unsafe {
        let l = &*list;
        (0..l.length as usize)
            .map(|i| (*l.elements.add(i)).ptr_value as *mut T)
            .collect()
    }
}

/// A new pointer list (NIL when empty) in the current memory context.
#[allow(unsafe_code)]
unsafe fn list_of<T>(items: &[*mut T]) -> *mut pg_sys::List {
    let mut list = std::ptr::null_mut();
    for &item in items {
        // SAFETY: lappend allocates in the current memory context; NIL starts a new list.
        list = unsafe { pg_sys::lappend(list, item as *mut c_void) };
    }
    list
}

#[allow(unsafe_code)]
pub(crate) unsafe fn is_a(node: *mut pg_sys::Node, tag: pg_sys::NodeTag) -> bool {
    // SAFETY: every node starts with its tag.
    !node.is_null() && unsafe { (*node).type_ } == tag
}

/// Range table entry `index` (1-based) of `query`.
#[allow(unsafe_code)]
unsafe fn rt_fetch(query: &pg_sys::Query, index: i32) -> *mut pg_sys::RangeTblEntry {
    // SAFETY: `index` is the query's result relation, always within its range table.
    unsafe { ptrs::<pg_sys::RangeTblEntry>(query.rtable)[(index - 1) as usize] }
}
