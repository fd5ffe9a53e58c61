//! UNIQUE indexes and constraints added to a REGIONAL BY ROW table after it became one
//! (`CREATE UNIQUE INDEX … ON t (email)`, `ALTER TABLE t ADD [CONSTRAINT c] UNIQUE (email)`):
//! unique across regions on their own columns, as CockroachDB's are.
//!
//! PostgreSQL requires the partition key in every unique index of a partitioned table, so the
//! statement gets the region column in front of its columns (each partition's index is then
//! unique within its region, and the declared columns are what SHOW CREATE and SHOW INDEXES
//! print, as for the keys a conversion prefixed). Across regions a key table keeps the
//! columns unique, as a conversion makes one (`rbr.rs`). Where the statement is typed, the
//! rows are first checked for a key that repeats across regions, in this node's copy of
//! every partition once the statement's fence (`fence.rs`) stopped writers at the
//! leaseholders and this node applied what they wrote before (a node without a replica of
//! some partition refuses the statement); the key table's range starts from the keys of each
//! partition, read at that partition's leaseholder once it applied the change (pgmr's
//! `key_chunk`), so every replica holds the same keys. A renamed key's key table follows it.

use super::{catalog, rbr, spi};
use crate::error::MrError;
use pgrx::pg_sys;
use std::ffi::CString;

/// A unique key without the region column, added by the statement about to run.
pub(crate) struct AddedKey {
    relid: pg_sys::Oid,
    /// The index's (and constraint's) name: the statement's, or CockroachDB's
    /// `<table>_<columns>_key` (PostgreSQL's would name the region column too).
    name: String,
    columns: Vec<String>,
    region_column: String,
}

/// The statement with the region column put in front of each UNIQUE key it adds to a
/// REGIONAL BY ROW table without naming the region, and those keys. Other statements (and
/// partial, expression or NULLS NOT DISTINCT keys, which PostgreSQL then refuses) unchanged.
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run.
#[allow(unsafe_code)]
pub(crate) unsafe fn with_region(
    pstmt: *mut pg_sys::PlannedStmt,
) -> (*mut pg_sys::PlannedStmt, Vec<AddedKey>) {
    // SAFETY: the caller's contract.
    if unsafe { keys_of(pstmt) }.is_empty() {
        return (pstmt, Vec::new());
    }
    // SAFETY: the copy is ours to change (the statement may be a cached plan's read-only
    // tree); its keys come in the same order as the original's.
    unsafe {
        let changed = pg_sys::copyObjectImpl(pstmt.cast()) as *mut pg_sys::PlannedStmt;
        let keys = keys_of(changed);
        let mut added = Vec::with_capacity(keys.len());
        for (key, info) in keys {
            let region = CString::new(info.region_column.as_str()).unwrap_or_default();
            let region = pg_sys::pstrdup(region.as_ptr());
            let name = CString::new(info.name.as_str()).unwrap_or_default();
            let name = pg_sys::pstrdup(name.as_ptr());
            match key {
                Key::Index(stmt) => {
                    (*stmt).idxname = name;
                    let mut elem =
                        pgrx::PgBox::<pg_sys::IndexElem>::alloc_node(pg_sys::NodeTag::T_IndexElem);
                    elem.name = region;
                    elem.ordering = pg_sys::SortByDir::SORTBY_DEFAULT;
                    elem.nulls_ordering = pg_sys::SortByNulls::SORTBY_NULLS_DEFAULT;
                    (*stmt).indexParams = pg_sys::lcons(elem.into_pg().cast(), (*stmt).indexParams);
                }
                Key::Constraint(c) => {
                    (*c).conname = name;
                    (*c).keys = pg_sys::lcons(pg_sys::makeString(region).cast(), (*c).keys);
                }
            }
            added.push(info);
        }
        (changed, added)
    }
}

enum Key {
    Index(*mut pg_sys::IndexStmt),
    Constraint(*mut pg_sys::Constraint),
}

/// The UNIQUE keys without the region column that `pstmt` adds to REGIONAL BY ROW tables.
#[allow(unsafe_code)]
unsafe fn keys_of(pstmt: *mut pg_sys::PlannedStmt) -> Vec<(Key, AddedKey)> {
    use pg_sys::NodeTag::*;
    // SAFETY: each cast follows the node's own tag; lists hold the node types PostgreSQL's
    // grammar puts there (IndexElem, AlterTableCmd, Constraint, String).
    unsafe {
        let node = (*pstmt).utilityStmt;
        if node.is_null() {
            return Vec::new();
        }
        let rbr = |rv: *mut pg_sys::RangeVar| {
            let relid = catalog::relid_of(rv)?;
            Some((relid, crate::rewrite::lookup(relid)?))
        };
        let str_of = |p: *mut std::ffi::c_char| {
            (!p.is_null()).then(|| std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned())
        };
        let mut out = Vec::new();
        match (*node).type_ {
            T_IndexStmt => {
                let stmt = node as *mut pg_sys::IndexStmt;
                let s = &*stmt;
                if !s.unique || s.primary || !s.whereClause.is_null() || s.nulls_not_distinct {
                    return out;
                }
                let Some((relid, table)) = rbr(s.relation) else {
                    return out;
                };
                let mut columns = Vec::new();
                for elem in super::replicate::list_ptrs(s.indexParams) {
                    let elem = elem as *mut pg_sys::IndexElem;
                    match str_of((*elem).name) {
                        Some(c) if (*elem).expr.is_null() => columns.push(c),
                        _ => return out,
                    }
                }
                if columns.is_empty() || columns.contains(&table.region_column) {
                    return out;
                }
                let name = str_of(s.idxname).unwrap_or_else(|| default_name(relid, &columns));
                out.push((
                    Key::Index(stmt),
                    AddedKey {
                        relid,
                        name,
                        columns,
                        region_column: table.region_column.clone(),
                    },
                ));
            }
            T_AlterTableStmt => {
                let stmt = &*(node as *mut pg_sys::AlterTableStmt);
                let Some((relid, table)) = rbr(stmt.relation) else {
                    return out;
                };
                for cmd in super::replicate::list_ptrs(stmt.cmds) {
                    let cmd = &*(cmd as *mut pg_sys::AlterTableCmd);
                    if cmd.subtype != pg_sys::AlterTableType::AT_AddConstraint
                        || cmd.def.is_null()
                        || (*cmd.def).type_ != T_Constraint
                    {
                        continue;
                    }
                    let c = cmd.def as *mut pg_sys::Constraint;
                    if (*c).contype != pg_sys::ConstrType::CONSTR_UNIQUE
                        || !(*c).indexname.is_null()
                        || (*c).nulls_not_distinct
                    {
                        continue;
                    }
                    let columns: Vec<String> = super::replicate::list_ptrs((*c).keys)
                        .filter_map(|n| str_of((*(n as *mut pg_sys::String)).sval))
                        .collect();
                    if columns.is_empty() || columns.contains(&table.region_column) {
                        continue;
                    }
                    let name =
                        str_of((*c).conname).unwrap_or_else(|| default_name(relid, &columns));
                    out.push((
                        Key::Constraint(c),
                        AddedKey {
                            relid,
                            name,
                            columns,
                            region_column: table.region_column.clone(),
                        },
                    ));
                }
            }
            _ => {}
        }
        out
    }
}

thread_local! {
    /// Above zero while `multiregion.execute` runs a statement typed on this node: the keys
    /// its SPI statements add are checked here, as a client's own statement's are.
    static TYPED_HERE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs `f`, a statement typed on this node that the extension runs through SPI.
pub(super) fn typed_here<R>(f: impl FnOnce() -> R) -> R {
    struct Guard;
    impl Drop for Guard {
        fn drop(&mut self) {
            TYPED_HERE.with(|t| t.set(t.get().saturating_sub(1)));
        }
    }
    TYPED_HERE.with(|t| t.set(t.get() + 1));
    let _guard = Guard;
    f()
}

/// Before the statement runs, where it was typed (`top_level`, or inside [`typed_here`]): a
/// key held by rows of two regions refuses it, with PostgreSQL's error for a unique index
/// that cannot be built. A statement run through SPI is fenced here (a client's own was
/// fenced before it ran).
pub(crate) fn check_keys(keys: &[AddedKey], top_level: bool) {
    if !top_level && TYPED_HERE.with(|t| t.get()) == 0 {
        return;
    }
    for key in keys {
        let fenced = if top_level {
            Ok(())
        } else {
            super::fence::fence_tables(vec![key.relid])
        };
        if let Err(e) = fenced.and_then(|()| check_unique(key)) {
            e.raise();
        }
    }
}

/// After the statement ran: each added key's key table, filled from this node's rows for
/// now: its range starts from the partitions' leaseholders (replication on), or this node
/// keeps its own (off).
pub(crate) fn create_key_tables(keys: Vec<AddedKey>) {
    for key in keys {
        if !index_exists(&key) {
            continue; // IF NOT EXISTS found one
        }
        crate::replication::without_capture(|| {
            spi::as_extension_owner(|| rbr::add_key_table(key.relid, &key.name, &key.columns))
        });
    }
}

/// CockroachDB's name for an unnamed unique key, `<table>_<columns>_key`, numbered as
/// PostgreSQL numbers a name already taken in the table's schema.
fn default_name(relid: pg_sys::Oid, columns: &[String]) -> String {
    let (schema, table) = names(relid);
    let base = format!("{table}_{}_key", columns.join("_"));
    let taken = |name: &str| {
        spi::read_one(
            "SELECT 'taken' FROM pg_catalog.pg_class c \
               JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
              WHERE n.nspname = $1 AND c.relname = $2",
            vec![schema.as_str().into(), name.into()],
        )
        .is_some()
    };
    let mut name = base.clone();
    let mut n = 0;
    while taken(&name) {
        n += 1;
        name = format!("{base}{n}");
    }
    name
}

/// Whether the statement left a unique index of that name on the table.
fn index_exists(key: &AddedKey) -> bool {
    spi::read_one(
        "SELECT 'yes' FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid \
          WHERE i.indrelid = $1 AND i.indisunique AND c.relname = $2 \
            AND NOT EXISTS (SELECT FROM multiregion.global_key g \
                             WHERE g.relid = i.indrelid AND g.constraint_name = c.relname)",
        vec![key.relid.into(), key.name.as_str().into()],
    )
    .is_some()
}

/// Whether `key`'s columns are unique across the table's rows (keys with a NULL part aside),
/// after the statement's fence (`fence.rs`) stopped writers at the leaseholders. Where this
/// node holds a replica of every partition, read in its copies, which it has by then applied
/// whole (one GROUP BY; a read here would otherwise go to the leaseholders, and a read over
/// several of them cannot be served in a transaction already holding locks there). Elsewhere
/// (PLACEMENT RESTRICTED, more nodes than replicas) each partition is read where it can be —
/// one statement per region, as `multiregion.conflict_region` does — and the keys compared
/// here.
fn check_unique(key: &AddedKey) -> Result<(), MrError> {
    let (schema, table) = names(key.relid);
    let database = catalog::database_name();
    let route = crate::sidecar::route(
        database.clone(),
        vec![(
            mr_meta::TableRef {
                database,
                schema,
                table,
            },
            None,
        )],
        false,
        false,
        false,
        vec![],
    );
    // Not here: leased elsewhere, split, or refused (no node holds a copy of each).
    match route {
        Ok(r) if !r.enabled || (r.forward_to.is_none() && r.split.is_empty()) => {
            crate::routing::read_locally(|| duplicate(key))
        }
        _ => duplicate_by_region(key),
    }
}

/// [`duplicate`], one region's partition at a time: its keys come here (as JSON arrays, so
/// values compare exactly) and meet every other region's. Holds the table's keys in memory.
fn duplicate_by_region(key: &AddedKey) -> Result<(), MrError> {
    let cols: Vec<String> = key.columns.iter().map(|c| spi::ident(c)).collect();
    let not_null: Vec<String> = cols.iter().map(|c| format!("{c} IS NOT NULL")).collect();
    let values: Vec<String> = cols.iter().map(|c| format!("{c}::text")).collect();
    let regions = spi::read_rows(
        "SELECT r::text FROM multiregion.database_config c, unnest(c.regions) r ORDER BY 1",
        vec![],
    );
    let mut seen = std::collections::HashSet::new();
    for region in regions
        .into_iter()
        .filter_map(|r| r.into_iter().next().flatten())
    {
        let rows = spi::read_rows(
            &format!(
                "SELECT pg_catalog.jsonb_build_array({})::text, pg_catalog.concat_ws(', ', {}) \
                   FROM {} WHERE {} = {} AND {}",
                cols.join(", "),
                values.join(", "),
                super::relname(key.relid),
                spi::ident(&key.region_column),
                spi::lit(&region),
                not_null.join(" AND ")
            ),
            vec![],
        );
        for row in rows {
            let mut row = row.into_iter();
            let exact = row.next().flatten().unwrap_or_default();
            if !seen.insert(exact) {
                return Err(MrError::DuplicateKey {
                    index: key.name.clone(),
                    key: format!(
                        "({})=({})",
                        key.columns.join(", "),
                        row.next().flatten().unwrap_or_default()
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Fences `relid` and checks that `columns` are unique across its rows, for a key named
/// `name` about to be made of them (a REGIONAL BY ROW table's new primary key).
pub(super) fn check_columns(
    relid: pg_sys::Oid,
    name: &str,
    columns: &[String],
    region_column: &str,
) -> Result<(), MrError> {
    super::fence::fence_tables(vec![relid])?;
    check_unique(&AddedKey {
        relid,
        name: name.to_string(),
        columns: columns.to_vec(),
        region_column: region_column.to_string(),
    })
}

fn names(relid: pg_sys::Oid) -> (String, String) {
    let row = spi::read_rows(
        "SELECT n.nspname::text, c.relname::text FROM pg_catalog.pg_class c \
           JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1",
        vec![relid.into()],
    );
    let get = |i: usize| {
        row.first()
            .and_then(|r| r.get(i).cloned().flatten())
            .unwrap_or_default()
    };
    (get(0), get(1))
}

fn duplicate(key: &AddedKey) -> Result<(), MrError> {
    let cols: Vec<String> = key.columns.iter().map(|c| spi::ident(c)).collect();
    let cols = cols.join(", ");
    let not_null: Vec<String> = key
        .columns
        .iter()
        .map(|c| format!("{} IS NOT NULL", spi::ident(c)))
        .collect();
    let values: Vec<String> = key
        .columns
        .iter()
        .map(|c| format!("{}::text", spi::ident(c)))
        .collect();
    let dup = spi::read_one(
        &format!(
            "SELECT pg_catalog.concat_ws(', ', {}) FROM {} WHERE {} GROUP BY {cols} \
             HAVING count(*) > 1 LIMIT 1",
            values.join(", "),
            super::relname(key.relid),
            not_null.join(" AND ")
        ),
        vec![],
    );
    match dup {
        None => Ok(()),
        Some(values) => Err(MrError::DuplicateKey {
            index: key.name.clone(),
            key: format!("({})=({values})", key.columns.join(", ")),
        }),
    }
}

/// A unique key with a key table, renamed by the statement about to run (`ALTER INDEX …
/// RENAME TO`, `ALTER TABLE … RENAME CONSTRAINT`): its table, old and new name.
pub(crate) struct RenamedKey {
    relid: pg_sys::Oid,
    from: String,
    to: String,
}

/// The key `pstmt` renames, if it is one a key table keeps unique across regions.
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run.
#[allow(unsafe_code)]
pub(crate) unsafe fn renamed_key(pstmt: &pg_sys::PlannedStmt) -> Option<RenamedKey> {
    let node = pstmt.utilityStmt;
    // SAFETY: the cast follows the node's tag; the RangeVar and names are the statement's.
    unsafe {
        if node.is_null() || (*node).type_ != pg_sys::NodeTag::T_RenameStmt {
            return None;
        }
        let s = &*(node as *mut pg_sys::RenameStmt);
        let str_of = |p: *mut std::ffi::c_char| {
            (!p.is_null()).then(|| std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned())
        };
        let to = str_of(s.newname)?;
        let (relid, from) = match s.renameType {
            pg_sys::ObjectType::OBJECT_INDEX => {
                let index = catalog::relid_of(s.relation)?;
                let row = spi::read_rows(
                    "SELECT i.indrelid::text, c.relname::text FROM pg_catalog.pg_index i \
                       JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid WHERE i.indexrelid = $1",
                    vec![index.into()],
                );
                let get = |i: usize| row.first().and_then(|r| r.get(i).cloned().flatten());
                (pg_sys::Oid::from(get(0)?.parse::<u32>().ok()?), get(1)?)
            }
            pg_sys::ObjectType::OBJECT_TABCONSTRAINT => {
                (catalog::relid_of(s.relation)?, str_of(s.subname)?)
            }
            _ => return None,
        };
        spi::read_one(
            "SELECT 'yes' FROM multiregion.global_key WHERE relid = $1 AND constraint_name = $2",
            vec![relid.into(), from.as_str().into()],
        )?;
        Some(RenamedKey { relid, from, to })
    }
}

/// After the rename ran: the key table follows its key's new name (catalog row, triggers,
/// its own index's name), on every node alike.
pub(crate) fn rename_key(key: Option<RenamedKey>) {
    if let Some(k) = key {
        crate::replication::without_capture(|| {
            spi::as_extension_owner(|| rbr::rename_global_key(k.relid, &k.from, &k.to))
        });
    }
}
