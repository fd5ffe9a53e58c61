//! Schema changes through the meta Raft group. The statement that ran here is the change:
//! every other node's pgmr hands it, in log order, to `multiregion.apply_schema_change`, which
//! runs it with the same search path and role. The proposal is a compare-and-set on the
//! database's schema version, so two nodes changing one database at once cannot both win.

use super::{catalog, execute, spi, Origin};
use crate::error::{MrError, OrRaise};
use crate::{gucs, sidecar};
use mr_meta::{TableLocality, TableRef};
use pgrx::pg_sys;
use pgrx::prelude::*;
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::time::Duration;

/// How long a statement waits for the other nodes to apply it.
const APPLY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Serialize, Deserialize)]
struct ChangeRecord {
    sql: String,
    search_path: String,
    role: String,
    /// `multiregion.enable_auto_rehoming` of the session, which decides how a new REGIONAL BY
    /// ROW table behaves; absent in records written before it existed.
    #[serde(default)]
    auto_rehoming: bool,
    /// `gateway_region()` where the change was made: every node runs the statement with it,
    /// so that rows given a region by it (existing rows of a table made REGIONAL BY ROW, a
    /// column added with that default) get the same region everywhere.
    #[serde(default)]
    gateway_region: Option<String>,
}

/// Whether pg_class row `c` (in namespace `n`) is a replicated table: a permanent table that
/// is not a partition (a REGIONAL BY ROW table's partitions are ranges of their table),
/// outside PostgreSQL's and the extension's own schema (global key tables, in
/// `multiregion_keys`, are replicated like any table) and not the extension's. A SQL
/// condition, for `concat!`.
macro_rules! replicated_table {
    () => {
        "c.relkind IN ('r', 'p') AND NOT c.relispartition AND c.relpersistence <> 't' \
         AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'multiregion') \
         AND n.nspname NOT LIKE 'pg\\_%' \
         AND NOT EXISTS (SELECT FROM pg_catalog.pg_depend d \
           WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.objid = c.oid AND d.deptype = 'e')"
    };
}
pub(super) use replicated_table;

/// The database's replicated tables.
const TABLES: &str = concat!(
    "SELECT n.nspname::text, c.relname::text \
     FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE ",
    replicated_table!(),
    " ORDER BY 1, 2"
);

/// A transaction's schema changes, proposed together when it commits (so a transaction
/// rolled back reaches no other node): the statements in order, each with the
/// subtransaction that ran it, and the table localities they set.
struct Pending {
    records: Vec<(pg_sys::SubTransactionId, ChangeRecord)>,
    localities: Vec<(pg_sys::SubTransactionId, Locality)>,
    zones: Vec<(pg_sys::SubTransactionId, mr_meta::ZoneChange)>,
}

/// The `CONFIGURE ZONE` changes this transaction made, in order, not yet proposed.
pub(super) fn pending_zones() -> Vec<mr_meta::ZoneChange> {
    PENDING.with(|p| {
        p.borrow()
            .as_ref()
            .map(|p| p.zones.iter().map(|(_, z)| z.clone()).collect())
            .unwrap_or_default()
    })
}

type Locality = (String, String, Option<TableLocality>);

thread_local! {
    static PENDING: RefCell<Option<Pending>> = const { RefCell::new(None) };
    /// The version this transaction's pre-commit proposed: its rows carry it (a read-only
    /// query at pre-commit may not see the transaction's own version bump).
    static PROPOSED: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// The schema version this committing transaction proposed, if it changed the schema.
pub fn proposed_version() -> Option<u64> {
    PROPOSED.with(|p| p.get())
}

/// Several statements of one transaction: one schema version, applied in one transaction.
#[derive(Debug, Serialize, Deserialize)]
struct Batch {
    statements: Vec<ChangeRecord>,
}

/// Whether this transaction has made a schema change that other nodes have not seen yet.
pub fn has_pending() -> bool {
    PENDING.with(|p| p.borrow().is_some())
}

/// Records `sql`, a user's change, for the proposal at commit. Without pgmr
/// (`multiregion.sidecar_socket` unset) the node is on its own: the version is bumped now.
pub(super) fn defer(sql: &str, localities: &[Locality], zones: &[mr_meta::ZoneChange]) {
    if gucs::sidecar_socket().is_none() {
        let (config, version) = catalog::load(true);
        spi::as_extension_owner(|| catalog::store(config.as_ref(), version + 1));
        return;
    }
    let record = ChangeRecord {
        sql: sql.to_string(),
        search_path: spi::one("SELECT pg_catalog.current_setting('search_path')", vec![])
            .unwrap_or_default(),
        role: spi::one("SELECT current_user::text", vec![]).unwrap_or_default(),
        auto_rehoming: gucs::enable_auto_rehoming(),
        gateway_region: crate::routing::gateway_region_override()
            .or_else(|| gucs::locality().ok().map(|l| l.region().to_owned())),
    };
    // SAFETY: reads the current subtransaction's id.
    #[allow(unsafe_code)]
    let sub = unsafe { pg_sys::GetCurrentSubTransactionId() };
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        let p = p.get_or_insert_with(|| Pending {
            records: Vec::new(),
            localities: Vec::new(),
            zones: Vec::new(),
        });
        p.records.push((sub, record));
        p.localities
            .extend(localities.iter().map(|l| (sub, l.clone())));
        p.zones.extend(zones.iter().map(|z| (sub, z.clone())));
    });
}

/// A subtransaction rolled back: its changes (and those of subtransactions inside it) are
/// gone here, so they are not proposed.
pub fn sub_aborted(sub: pg_sys::SubTransactionId) {
    super::fence::sub_aborted(sub);
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        if let Some(pending) = p.as_mut() {
            pending.records.retain(|(s, _)| *s < sub);
            pending.localities.retain(|(s, _)| *s < sub);
            pending.zones.retain(|(s, _)| *s < sub);
            if pending.records.is_empty() {
                *p = None;
            }
        }
    });
}

/// Transaction end: nothing is pending any more.
pub fn at_end() {
    super::fence::at_end();
    PENDING.with(|p| p.borrow_mut().take());
    PROPOSED.with(|p| p.set(None));
}

/// At pre-commit: proposes the transaction's schema changes to the meta group as the next
/// version of the database's schema, on top of the version this node has applied
/// (compare-and-set: a change committed elsewhere that this node has not applied yet makes
/// this transaction fail with 40001; one it applied meanwhile did not conflict with this
/// transaction's locks, and comes first everywhere, as it did here). The database and new
/// version, to await.
pub fn propose_pending() -> Result<Option<(String, u64)>, MrError> {
    let Some(pending) = PENDING.with(|p| p.borrow_mut().take()) else {
        return Ok(None);
    };
    let database = catalog::database_name();
    // Locked until this transaction ends: this node's applier applies nothing in between.
    let (config, version) = catalog::load(true);
    spi::as_extension_owner(|| catalog::store(config.as_ref(), version + 1));
    let mut records: Vec<ChangeRecord> = pending.records.into_iter().map(|(_, r)| r).collect();
    let change = if records.len() == 1 {
        serde_json::to_string(&records.remove(0))
    } else {
        serde_json::to_string(&Batch {
            statements: records,
        })
    }
    .expect("a change record serializes");
    // The last locality a table was given in the transaction is the one it has.
    let mut localities: Vec<(TableRef, Option<TableLocality>)> = Vec::new();
    for (_, (schema, table, l)) in pending.localities {
        let t = TableRef {
            database: database.clone(),
            schema,
            table,
        };
        localities.retain(|(u, _)| u != &t);
        localities.push((t, l));
    }
    let tables = spi::read_rows(TABLES, vec![])
        .into_iter()
        .filter_map(|r| {
            Some(TableRef {
                database: database.clone(),
                schema: r.first()?.clone()?,
                table: r.get(1)?.clone()?,
            })
        })
        .collect();
    let key_seeds = key_seeds(&database);
    let sequences = crate::sequences::at_commit(&database);
    let (fenced, notify) = super::fence::take();
    let new = sidecar::propose_schema_change(mr_wire::local::LocalRequest::ProposeSchemaChange {
        database: database.clone(),
        expected_version: u64::try_from(version).unwrap_or(0),
        change,
        config,
        localities,
        tables: Some(tables),
        fenced,
        notify,
        key_seeds,
        sequences,
        zones: pending.zones.into_iter().map(|(_, z)| z).collect(),
    })?;
    PROPOSED.with(|p| p.set(Some(new)));
    Ok(Some((database, new)))
}

/// Every key table of the database, each with the REGIONAL BY ROW table whose key it keeps.
/// Each node fills a new key table from its own copy of the table's rows, which only the
/// leaseholders are sure to hold whole; the meta group uses these links to start a new key
/// table's range from them: from the range of a table this change makes REGIONAL BY ROW, as
/// it does the table's partitions, or from the keys of each partition of a table that is
/// one already (a key added later). A link whose key table has its range is not used again.
fn key_seeds(database: &str) -> Vec<(TableRef, TableRef)> {
    spi::read_rows(
        "SELECT kn.nspname::text, k.relname::text, tn.nspname::text, t.relname::text \
         FROM multiregion.global_key g \
         JOIN pg_catalog.pg_class k ON k.oid = g.key_table \
         JOIN pg_catalog.pg_namespace kn ON kn.oid = k.relnamespace \
         JOIN pg_catalog.pg_class t ON t.oid = g.relid \
         JOIN pg_catalog.pg_namespace tn ON tn.oid = t.relnamespace \
         ORDER BY 1, 2",
        vec![],
    )
    .into_iter()
    .filter_map(|r| {
        let get = |i: usize| r.get(i).cloned().flatten();
        let table = |schema: String, table: String| TableRef {
            database: database.to_string(),
            schema,
            table,
        };
        Some((table(get(0)?, get(1)?), table(get(2)?, get(3)?)))
    })
    .collect()
}

/// After the proposal: waits for every other live node to apply the change. It is committed:
/// a node slow to apply it gets a warning, not an error that would undo the change here while
/// the others go on to apply it.
pub fn await_applied(database: String, version: u64) {
    if let Err(e) = sidecar::await_schema_applied(database, version, APPLY_TIMEOUT) {
        pgrx::warning!("{e}");
    }
}

/// Waits until this node's copy of every replicated table of this database holds every write
/// committed before now (a read barrier on each range; nothing when replication is off).
pub fn barrier_every_table() -> Result<(), MrError> {
    if gucs::sidecar_socket().is_none() || crate::replication::known_off() {
        return Ok(());
    }
    let database = catalog::database_name();
    let targets: Vec<(TableRef, Option<String>)> = spi::read_rows(TABLES, vec![])
        .into_iter()
        .filter_map(|r| {
            Some((
                TableRef {
                    database: database.clone(),
                    schema: r.first()?.clone()?,
                    table: r.get(1)?.clone()?,
                },
                None,
            ))
        })
        .collect();
    if targets.is_empty() {
        return Ok(());
    }
    sidecar::read_barrier(database, targets, true).map(|_| ())
}

/// Applies schema change `version` committed by another node; does nothing if this database
/// has applied it already. Called by pgmr only (superuser).
#[pg_extern(schema = "multiregion")]
fn apply_schema_change(version: i64, change: &str) {
    apply(version, change).or_raise()
}

fn apply(version: i64, change: &str) -> Result<(), MrError> {
    let (_, current) = catalog::load(true);
    if current >= version {
        return Ok(());
    }
    if current + 1 != version {
        return Err(MrError::SchemaGap {
            have: current,
            got: version,
        });
    }
    let records = match serde_json::from_str::<Batch>(change) {
        Ok(batch) => batch.statements,
        Err(_) => vec![serde_json::from_str::<ChangeRecord>(change)
            .map_err(|e| MrError::BadChange(e.to_string()))?],
    };
    crate::sequences::applying(|| records.iter().try_for_each(apply_record))?;
    crate::sequences::after_apply();
    let (_, now) = catalog::load(false);
    if now != version {
        // The statement changed nothing here (e.g. IF NOT EXISTS found it done): record it.
        let (config, _) = catalog::load(true);
        spi::as_extension_owner(|| catalog::store(config.as_ref(), version));
    }
    Ok(())
}

/// Runs one statement of a change with the origin's search path, role and settings.
fn apply_record(record: &ChangeRecord) -> Result<(), MrError> {
    spi::run_with(
        "SELECT pg_catalog.set_config('search_path', $1, true)",
        vec![record.search_path.as_str().into()],
    );
    spi::run_with(
        "SELECT pg_catalog.set_config('multiregion.enable_auto_rehoming', $1, true)",
        vec![record.auto_rehoming.to_string().as_str().into()],
    );
    spi::run(&format!("SET LOCAL ROLE {}", spi::ident(&record.role)));
    crate::routing::with_gateway_region(record.gateway_region.clone(), || {
        execute::execute_one(&record.sql, Origin::Replicated)
    })?;
    spi::run("RESET ROLE");
    Ok(())
}

/// This database's schema version: how many multi-region schema changes it has applied.
#[pg_extern(schema = "multiregion", stable)]
fn schema_version() -> i64 {
    catalog::load(false).1
}

extension_sql!(
    "REVOKE EXECUTE ON FUNCTION multiregion.apply_schema_change(bigint, text) FROM PUBLIC;",
    name = "revoke_apply",
    requires = [apply_schema_change]
);

/// A utility statement a client ran at top level that every node must also run: its text, or
/// for roles what to read back once it ran.
pub(crate) enum Ddl {
    Text(String),
    /// `CREATE ROLE` / `ALTER ROLE … PASSWORD`: replicated as the role's resulting attributes
    /// (the options the statement named), so that a password travels as the verifier
    /// PostgreSQL stored, never as the client's text.
    Role {
        name: String,
        create: bool,
        options: Vec<String>,
    },
}

/// While another node's schema change is applied, the foreign keys it adds are taken as
/// valid instead of checked against this node's rows: the origin checked them against an
/// up-to-date copy, and this node's copy of the referenced table may lag behind it (a
/// replica still catching up after a restart, a range whose entries wait for this very
/// change). Checked here, a lagging copy refused the change with 23503 and left the node's
/// schema applier stuck behind it. Returns `pstmt`, or a copy whose ADD FOREIGN KEY
/// constraints skip validation and are created valid, as PostgreSQL does for the foreign
/// keys of a table it creates.
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run.
#[allow(unsafe_code)]
pub(crate) unsafe fn trusting_foreign_keys(
    pstmt: *mut pg_sys::PlannedStmt,
) -> *mut pg_sys::PlannedStmt {
    if !crate::sequences::applying_change() {
        return pstmt;
    }
    // SAFETY: the caller's contract. The copy is ours to change (the statement may be a
    // cached plan's read-only tree).
    unsafe {
        if added_foreign_keys(pstmt)
            .iter()
            .all(|c| (**c).skip_validation)
        {
            return pstmt;
        }
        let changed = pg_sys::copyObjectImpl(pstmt.cast()) as *mut pg_sys::PlannedStmt;
        for constraint in added_foreign_keys(changed) {
            if !(*constraint).skip_validation {
                (*constraint).skip_validation = true;
                (*constraint).initially_valid = true;
            }
        }
        changed
    }
}

/// The foreign key constraints an `ALTER TABLE` adds (also those of a `CREATE TABLE`, which
/// PostgreSQL adds through an `ALTER TABLE` of its own).
///
/// # Safety
/// `stmt` is a valid PlannedStmt.
#[allow(unsafe_code)]
unsafe fn added_foreign_keys(stmt: *mut pg_sys::PlannedStmt) -> Vec<*mut pg_sys::Constraint> {
    // SAFETY: the caller's contract; every node's tag is read before it is cast.
    unsafe {
        let node = (*stmt).utilityStmt;
        if node.is_null() || (*node).type_ != pg_sys::NodeTag::T_AlterTableStmt {
            return Vec::new();
        }
        list_ptrs((*(node as *mut pg_sys::AlterTableStmt)).cmds)
            .filter_map(|cmd| {
                let cmd = cmd as *mut pg_sys::AlterTableCmd;
                let def = (*cmd).def;
                ((*cmd).subtype == pg_sys::AlterTableType::AT_AddConstraint
                    && !def.is_null()
                    && (*def).type_ == pg_sys::NodeTag::T_Constraint
                    && (*(def as *mut pg_sys::Constraint)).contype
                        == pg_sys::ConstrType::CONSTR_FOREIGN)
                    .then_some(def as *mut pg_sys::Constraint)
            })
            .collect()
    }
}

/// A foreign key to a REGIONAL BY ROW table's key that leaves out the region column (which
/// PostgreSQL cannot reference: the partitioned table's unique indexes all lead with it)
/// references the key table that keeps that key unique across regions instead: the same
/// constraint, as a conversion retargets the keys that existed before it (rbr.rs). Every
/// node applying the statement rewrites it alike. `None` where nothing changes.
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run.
#[allow(unsafe_code)]
pub(crate) unsafe fn foreign_keys_to_key_tables(
    pstmt: *mut pg_sys::PlannedStmt,
) -> *mut pg_sys::PlannedStmt {
    // SAFETY: the caller's contract.
    let fks = unsafe { added_foreign_keys(pstmt) };
    if fks.is_empty() {
        return pstmt;
    }
    // For each key, the key table it should reference, if any.
    let targets: Vec<Option<(String, String)>> = fks
        .iter()
        .map(|&c| {
            // SAFETY: a Constraint of the statement; its referenced table is a RangeVar and
            // its referenced columns a list of String nodes. A missing table is PostgreSQL's
            // to report.
            unsafe {
                let relid = pg_sys::RangeVarGetRelidExtended(
                    (*c).pktable,
                    pg_sys::NoLock as pg_sys::LOCKMODE,
                    pg_sys::RVROption::RVR_MISSING_OK,
                    None,
                    std::ptr::null_mut(),
                );
                if relid == pg_sys::InvalidOid || crate::rewrite::lookup(relid).is_none() {
                    return None;
                }
                let columns: Vec<String> = list_ptrs((*c).pk_attrs)
                    .map(|n| cstr((*(n as *mut pg_sys::String)).sval))
                    .collect();
                key_table_for(relid, &columns)
            }
        })
        .collect();
    if targets.iter().all(Option::is_none) {
        return pstmt;
    }
    // SAFETY: the copy is ours to change (the statement may be a cached plan's read-only
    // tree); its constraints come in the same order as the original's.
    unsafe {
        let changed = pg_sys::copyObjectImpl(pstmt.cast()) as *mut pg_sys::PlannedStmt;
        for (c, target) in added_foreign_keys(changed).into_iter().zip(targets) {
            if let Some((schema, table)) = target {
                let schema = std::ffi::CString::new(schema).unwrap_or_default();
                let table = std::ffi::CString::new(table).unwrap_or_default();
                (*c).pktable = pg_sys::makeRangeVar(
                    pg_sys::pstrdup(schema.as_ptr()),
                    pg_sys::pstrdup(table.as_ptr()),
                    -1,
                );
            }
        }
        changed
    }
}

/// The key table (schema, name) keeping `columns` of REGIONAL BY ROW table `relid` unique;
/// no columns named means the primary key's.
fn key_table_for(relid: pg_sys::Oid, columns: &[String]) -> Option<(String, String)> {
    spi::read_rows(
        "SELECT n.nspname::text, k.relname::text, pg_catalog.array_to_string(g.columns, chr(1)), \
                (c.contype = 'p')::text \
         FROM multiregion.global_key g \
         JOIN pg_catalog.pg_class k ON k.oid = g.key_table \
         JOIN pg_catalog.pg_namespace n ON n.oid = k.relnamespace \
         LEFT JOIN pg_catalog.pg_constraint c \
           ON c.conrelid = g.relid AND c.conname = g.constraint_name \
         WHERE g.relid = $1",
        vec![relid.into()],
    )
    .into_iter()
    .find_map(|r| {
        let get = |i: usize| r.get(i).cloned().flatten().unwrap_or_default();
        let matches = if columns.is_empty() {
            get(3) == "true"
        } else {
            get(2).split('\u{1}').eq(columns.iter().map(String::as_str))
        };
        matches.then(|| (get(0), get(1)))
    })
}

/// What to replicate of a utility statement a client ran at top level, if it is a schema
/// change that every node must also make. Statements run by functions (`multiregion.execute`,
/// the applier, a DO block) are not top level, so they are never replicated twice. Roles are
/// cluster-wide objects: they travel through the log of the database where they were
/// changed, and a node applying another database's change that names a role not created
/// there yet retries until it is.
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run and `query_string` its source text.
#[allow(unsafe_code)]
pub(crate) unsafe fn replicated_ddl(
    pstmt: &pg_sys::PlannedStmt,
    query_string: *const std::ffi::c_char,
) -> Option<Ddl> {
    use pg_sys::NodeTag::*;
    if gucs::sidecar_socket().is_none()
        || !gucs::replicate_ddl()
        || pstmt.utilityStmt.is_null()
        || query_string.is_null()
    {
        return None;
    }
    // SAFETY: the caller's contract; each cast follows the node's own tag.
    unsafe {
        let node = pstmt.utilityStmt;
        match (*node).type_ {
            T_IndexStmt if (*(node as *mut pg_sys::IndexStmt)).concurrent => {
                MrError::NotReplicable("CREATE INDEX CONCURRENTLY").raise()
            }
            T_DropStmt => {
                let drop = &*(node as *mut pg_sys::DropStmt);
                if drop.removeType == pg_sys::ObjectType::OBJECT_EXTENSION {
                    return None;
                }
                if drop.concurrent {
                    MrError::NotReplicable("DROP INDEX CONCURRENTLY").raise()
                }
            }
            T_CreateStmt
            | T_AlterTableStmt
            | T_IndexStmt
            | T_ViewStmt
            | T_CreateSeqStmt
            | T_AlterSeqStmt
            | T_CommentStmt
            | T_GrantStmt
            | T_RenameStmt
            | T_CreateSchemaStmt
            | T_CreateDomainStmt
            | T_AlterDomainStmt
            | T_CreateEnumStmt
            | T_AlterEnumStmt
            | T_CompositeTypeStmt
            | T_CreateRangeStmt
            | T_DefineStmt
            | T_CreateFunctionStmt
            | T_AlterFunctionStmt
            | T_CreateTrigStmt
            | T_RuleStmt
            | T_AlterOwnerStmt
            | T_AlterObjectSchemaStmt
            | T_CreatePolicyStmt
            | T_AlterPolicyStmt
            | T_AlterDefaultPrivilegesStmt
            | T_CreateTableAsStmt
            | T_GrantRoleStmt
            | T_AlterRoleSetStmt
            | T_DropOwnedStmt
            | T_ReassignOwnedStmt => {}
            T_CreateRoleStmt => {
                let create = &*(node as *mut pg_sys::CreateRoleStmt);
                return Some(Ddl::Role {
                    name: cstr(create.role),
                    create: true,
                    options: option_names(create.options),
                });
            }
            T_AlterRoleStmt => {
                let alter = &*(node as *mut pg_sys::AlterRoleStmt);
                let options = option_names(alter.options);
                if options.iter().any(|o| o == "password") {
                    return Some(Ddl::Role {
                        name: cstr(pg_sys::get_rolespec_name(alter.role)),
                        create: false,
                        options,
                    });
                }
            }
            T_DropRoleStmt => {
                // Where a role is already gone there is nothing to drop.
                let drop = &*(node as *mut pg_sys::DropRoleStmt);
                let names: Vec<String> = list_ptrs(drop.roles)
                    .map(|r| spi::ident(&cstr((*(r as *mut pg_sys::RoleSpec)).rolename)))
                    .collect();
                return Some(Ddl::Text(format!(
                    "DROP ROLE IF EXISTS {}",
                    names.join(", ")
                )));
            }
            _ => return None,
        }
        let text = std::ffi::CStr::from_ptr(query_string).to_bytes();
        let start = usize::try_from(pstmt.stmt_location)
            .unwrap_or(0)
            .min(text.len());
        let end = match usize::try_from(pstmt.stmt_len).unwrap_or(0) {
            0 => text.len(),
            n => (start + n).min(text.len()),
        };
        Some(Ddl::Text(
            String::from_utf8_lossy(&text[start..end])
                .trim()
                .to_string(),
        ))
    }
}

/// A database created or dropped by a client's top-level statement, which every node must
/// follow.
pub(crate) enum DatabaseDdl {
    Created(String),
    Dropped(String),
}

/// `CREATE DATABASE` / `DROP DATABASE` at top level, if the cluster follows it: a database
/// created from `template1` (which has the extension) becomes cluster-wide; a dropped one
/// is dropped everywhere.
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run.
#[allow(unsafe_code)]
pub(crate) unsafe fn database_ddl(pstmt: &pg_sys::PlannedStmt) -> Option<DatabaseDdl> {
    use pg_sys::NodeTag::*;
    if gucs::sidecar_socket().is_none() || !gucs::replicate_ddl() || pstmt.utilityStmt.is_null() {
        return None;
    }
    // SAFETY: the caller's contract; each cast follows the node's own tag.
    unsafe {
        let node = pstmt.utilityStmt;
        match (*node).type_ {
            T_CreatedbStmt => {
                let create = &*(node as *mut pg_sys::CreatedbStmt);
                let template = list_ptrs(create.options)
                    .map(|d| &*(d as *mut pg_sys::DefElem))
                    .find(|d| cstr(d.defname) == "template")
                    .map(|d| cstr(pg_sys::defGetString(d as *const _ as *mut _)));
                match template.as_deref() {
                    None | Some("template1") => Some(DatabaseDdl::Created(cstr(create.dbname))),
                    Some(_) => None,
                }
            }
            T_DropdbStmt => {
                let drop = &*(node as *mut pg_sys::DropdbStmt);
                Some(DatabaseDdl::Dropped(cstr(drop.dbname)))
            }
            _ => None,
        }
    }
}

/// After `CREATE DATABASE` / `DROP DATABASE` ran here. A new database gets an empty schema
/// log, for which every node's applier creates its copy (within a poll, ~200 ms, of the
/// commit); a dropped one is forgotten by the cluster and every node drops its copy.
/// The statement cannot be undone at this point (PostgreSQL has created or removed the
/// files), so a failure here is a warning saying what is left to do, never an error.
pub(crate) fn database_ddl_done(ddl: DatabaseDdl) {
    match ddl {
        DatabaseDdl::Created(name) => {
            if let Err(e) = sidecar::create_database(name.clone()) {
                pgrx::warning!(
                    "database {} was created here but not on the other nodes: {e}",
                    spi::ident(&name)
                );
            }
        }
        DatabaseDdl::Dropped(name) => {
            if let Err(e) = sidecar::drop_database(name.clone()) {
                pgrx::warning!(
                    "database {} was dropped here but not on the other nodes: {e}",
                    spi::ident(&name)
                );
            }
        }
    }
}

/// A C string of a parse tree as an owned string (empty for null).
///
/// # Safety
/// `p` is null or a NUL-terminated string.
#[allow(unsafe_code)]
pub(super) unsafe fn cstr(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller's contract.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

/// The elements of a pointer `List` (none for NIL).
///
/// # Safety
/// `list` is NIL or a valid pointer list that outlives the iterator.
#[allow(unsafe_code)]
pub(super) unsafe fn list_ptrs(
    list: *mut pg_sys::List,
) -> impl Iterator<Item = *mut std::ffi::c_void> {
    let n = if list.is_null() {
        0
    } else {
        unsafe { (*list).length }
    };
    // SAFETY: the caller's contract; indexes are within the list's length.
    (0..n).map(move |i| unsafe { pg_sys::list_nth(list, i) })
}

/// The names of a role statement's options (`DefElem.defname`).
///
/// # Safety
/// `options` is NIL or a valid list of DefElem.
#[allow(unsafe_code)]
unsafe fn option_names(options: *mut pg_sys::List) -> Vec<String> {
    // SAFETY: the caller's contract.
    unsafe {
        list_ptrs(options)
            .map(|d| cstr((*(d as *mut pg_sys::DefElem)).defname))
            .collect()
    }
}

/// The statements that give `name` on another node what the statement named by `options`
/// gave it here: created if missing, then the attributes named, read back from the catalog
/// (the password as the verifier PostgreSQL stored), then the memberships a CREATE ROLE set.
fn role_sql(name: &str, create: bool, options: &[String]) -> String {
    let has = |o: &str| options.iter().any(|x| x == o);
    let mut out = Vec::new();
    if create {
        let body = format!(
            "BEGIN IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = {}) THEN \
             EXECUTE {}; END IF; END",
            spi::lit(name),
            spi::lit(&format!("CREATE ROLE {}", spi::ident(name)))
        );
        out.push(format!("DO {}", spi::lit(&body)));
    }
    // pg_authid (the password) is readable by superusers only: read as the extension's owner.
    let row = spi::as_extension_owner(|| {
        spi::rows(
            "SELECT rolsuper::text, rolcreatedb::text, rolcreaterole::text, rolinherit::text, \
                    rolcanlogin::text, rolreplication::text, rolbypassrls::text, \
                    rolconnlimit::text, rolpassword, rolvaliduntil::text \
             FROM pg_catalog.pg_authid WHERE rolname = $1",
            vec![name.into()],
        )
    })
    .into_iter()
    .next()
    .unwrap_or_default();
    let get = |i: usize| row.get(i).cloned().flatten();
    let flag = |i: usize, on: &str, off: &str| {
        if get(i).as_deref() == Some("true") {
            on.to_string()
        } else {
            off.to_string()
        }
    };
    let mut attrs = Vec::new();
    for (option, i, on, off) in [
        ("superuser", 0, "SUPERUSER", "NOSUPERUSER"),
        ("createdb", 1, "CREATEDB", "NOCREATEDB"),
        ("createrole", 2, "CREATEROLE", "NOCREATEROLE"),
        ("inherit", 3, "INHERIT", "NOINHERIT"),
        ("canlogin", 4, "LOGIN", "NOLOGIN"),
        ("isreplication", 5, "REPLICATION", "NOREPLICATION"),
        ("bypassrls", 6, "BYPASSRLS", "NOBYPASSRLS"),
    ] {
        if has(option) {
            attrs.push(flag(i, on, off));
        }
    }
    if has("connectionlimit") {
        attrs.push(format!(
            "CONNECTION LIMIT {}",
            get(7).and_then(|v| v.parse::<i32>().ok()).unwrap_or(-1)
        ));
    }
    if has("password") {
        attrs.push(match get(8) {
            Some(p) => format!("PASSWORD {}", spi::lit(&p)),
            None => "PASSWORD NULL".into(),
        });
    }
    if has("validUntil") {
        attrs.push(format!(
            "VALID UNTIL {}",
            spi::lit(get(9).as_deref().unwrap_or("infinity"))
        ));
    }
    if !attrs.is_empty() {
        out.push(format!(
            "ALTER ROLE {} WITH {}",
            spi::ident(name),
            attrs.join(" ")
        ));
    }
    if create && (has("addroleto") || has("rolemembers") || has("adminmembers")) {
        let grants = spi::rows(
            "SELECT r.rolname::text, m.rolname::text, am.admin_option::text \
             FROM pg_catalog.pg_auth_members am \
             JOIN pg_catalog.pg_roles r ON r.oid = am.roleid \
             JOIN pg_catalog.pg_roles m ON m.oid = am.member \
             WHERE r.rolname = $1 OR m.rolname = $1 ORDER BY 1, 2",
            vec![name.into()],
        );
        for g in grants {
            let (Some(role), Some(member)) =
                (g.first().cloned().flatten(), g.get(1).cloned().flatten())
            else {
                continue;
            };
            let admin = g.get(2).cloned().flatten().as_deref() == Some("true");
            out.push(format!(
                "GRANT {} TO {}{}",
                spi::ident(&role),
                spi::ident(&member),
                if admin { " WITH ADMIN OPTION" } else { "" }
            ));
        }
    }
    out.join(";\n")
}

/// Replicates a schema change a client just made here, in a database of the cluster (one with
/// the extension, not a template): kept for the proposal when the transaction commits, so
/// the local change and the other nodes' commit or neither does.
/// Whether this database's schema changes reach every node: it is not a template, and it
/// has the extension.
pub(super) fn database_replicates_ddl() -> bool {
    spi::one(
        "SELECT (NOT d.datistemplate AND EXISTS \
           (SELECT FROM pg_catalog.pg_extension WHERE extname = 'pg_multiregion'))::text \
         FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database()",
        vec![],
    )
    .as_deref()
        == Some("true")
}

pub(crate) fn replicate_ddl(ddl: Ddl) {
    if !database_replicates_ddl() {
        return;
    }
    let effect = super::Effect {
        changed: true,
        ..Default::default()
    };
    let sql = match ddl {
        Ddl::Text(sql) => sql,
        Ddl::Role {
            name,
            create,
            options,
        } => role_sql(&name, create, &options),
    };
    super::finish(effect, &sql, Origin::User).or_raise();
}
