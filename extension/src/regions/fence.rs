//! The origin's side of a schema change that reshapes replicated tables
//! (docs/ARCHITECTURE.md §8.6): before the statement runs, each of the tables' ranges is
//! locked against writers at its leaseholder (this transaction's session there, or here),
//! and this node applies every row written before the locks. The change is proposed with
//! each range's last such entry, so that every other node applies those rows before the
//! change, and the leaseholders, told of the change before their locks go, refuse rows
//! written under the old shape afterwards.

use super::{catalog, spi};
use crate::error::{MrError, OrRaise};
use crate::{gucs, replication, routing, sidecar};
use mr_meta::{Fenced, TableRef};
use pgrx::pg_sys;
use std::cell::RefCell;

/// What this transaction has fenced, per subtransaction (a savepoint rolled back releases
/// its locks, on other nodes too, and forgets them here).
#[derive(Default)]
struct State {
    tables: Vec<(pg_sys::SubTransactionId, pg_sys::Oid, Fenced)>,
    /// Nodes whose session of this transaction holds a lock.
    nodes: Vec<(pg_sys::SubTransactionId, u64)>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

/// Before a client's top-level schema change runs: fences the replicated tables it alters,
/// renames or drops (once per table and transaction).
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run.
#[allow(unsafe_code)]
pub(crate) unsafe fn before_ddl(pstmt: &pg_sys::PlannedStmt, text: Option<&str>) {
    if gucs::sidecar_socket().is_none() || replication::known_off() {
        return;
    }
    // SAFETY: the caller's contract.
    let relids = unsafe { reshaped_relations(pstmt) };
    if relids.is_empty() {
        return;
    }
    fence(relids.clone()).or_raise();
    // SAFETY: the caller's contract.
    if let Some(sql) = text.filter(|_| unsafe { checks_rows(pstmt) }) {
        validate_elsewhere(relids, sql).or_raise();
    }
}

/// Whether the statement checks the table's rows as it runs, and so could fail on a node
/// whose copy holds rows this one lacks: an ALTER TABLE that adds or validates a constraint,
/// sets NOT NULL, changes a column's type or adds a column with constraints; a unique index.
///
/// # Safety
/// `pstmt` is a valid PlannedStmt.
#[allow(unsafe_code)]
unsafe fn checks_rows(pstmt: &pg_sys::PlannedStmt) -> bool {
    use pg_sys::AlterTableType::*;
    use pg_sys::NodeTag::*;
    let node = pstmt.utilityStmt;
    // SAFETY: each cast follows the node's own tag; the lists are the statement's own.
    unsafe {
        if node.is_null() {
            return false;
        }
        match (*node).type_ {
            T_IndexStmt => (*(node as *mut pg_sys::IndexStmt)).unique,
            T_AlterTableStmt => super::replicate::list_ptrs(
                (*(node as *mut pg_sys::AlterTableStmt)).cmds,
            )
            .any(|cmd| {
                let cmd = &*(cmd as *mut pg_sys::AlterTableCmd);
                let checking = [
                    AT_AddConstraint,
                    AT_ValidateConstraint,
                    AT_SetNotNull,
                    AT_AlterColumnType,
                    AT_AddIndex,
                    AT_AddIndexConstraint,
                ];
                let def = cmd.def;
                checking.contains(&cmd.subtype)
                    || (cmd.subtype == AT_AddColumn
                        && !def.is_null()
                        && (*def).type_ == T_ColumnDef
                        && {
                            let col = &*(def as *mut pg_sys::ColumnDef);
                            col.is_not_null || !col.constraints.is_null()
                        })
            }),
            _ => false,
        }
    }
}

/// A schema change that checks rows, typed on a node that holds no replica of some of the
/// tables' ranges (PLACEMENT RESTRICTED, more nodes than replicas): its copy of those holds
/// nothing, so the statement would pass here and fail on the nodes that hold them, after it
/// committed. It is first run at each such range's leaseholder, in this transaction's
/// session there (which holds the fence's lock), and rolled back
/// (`multiregion.validate_ddl`): its error, if any, is PostgreSQL's there, before anything
/// commits.
fn validate_elsewhere(relids: Vec<pg_sys::Oid>, sql: &str) -> Result<(), MrError> {
    let database = catalog::database_name();
    let names: Vec<TableRef> = replicated_tables(&database, relids)
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    if names.is_empty() {
        return Ok(());
    }
    let Some(ranges) = sidecar::table_ranges(database, names)? else {
        return Ok(());
    };
    let mut nodes: Vec<u64> = Vec::new();
    for r in ranges.iter().filter(|r| !r.held && !r.here) {
        let Some(node) = r.leaseholder else {
            return Err(MrError::Retryable(format!(
                "range {} of table {}.{} has no leaseholder to check the schema change's rows",
                r.range_id, r.table.schema, r.table.table
            )));
        };
        if !nodes.contains(&node) {
            nodes.push(node);
        }
    }
    let search_path = spi::read_one("SELECT pg_catalog.current_setting('search_path')", vec![]);
    for node in nodes {
        routing::run_on(
            node,
            "SELECT multiregion.validate_ddl($1, $2)",
            vec![Some(sql.to_string()), search_path.clone()],
        )?;
    }
    Ok(())
}

/// Before a TRUNCATE runs here: a REGIONAL BY ROW table's partition truncated by itself
/// releases its rows' keys unique across regions (`multiregion.release_partition_keys`),
/// which a TRUNCATE of the table releases by its own trigger. PostgreSQL fires no row
/// trigger for a TRUNCATE, and the parent's statement trigger not for a partition's: the
/// keys stayed taken, and the same key was refused (23505) in every region afterwards.
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run.
#[allow(unsafe_code)]
pub(crate) unsafe fn release_truncated_partition_keys(pstmt: &pg_sys::PlannedStmt) {
    let node = pstmt.utilityStmt;
    // SAFETY: the utility statement of a valid PlannedStmt, its tag read before the cast; an
    // applier (replica mode) writes this node's copy, and key tables keep their own rows.
    unsafe {
        if node.is_null()
            || (*node).type_ != pg_sys::NodeTag::T_TruncateStmt
            || pg_sys::SessionReplicationRole == pg_sys::SESSION_REPLICATION_ROLE_REPLICA as i32
        {
            return;
        }
        let stmt = &*(node as *mut pg_sys::TruncateStmt);
        for rv in super::replicate::list_ptrs(stmt.relations) {
            if let Some(relid) = catalog::relid_of(rv as *mut pg_sys::RangeVar) {
                spi::run_with(
                    "SELECT multiregion.release_partition_keys($1::pg_catalog.oid::pg_catalog.regclass)",
                    vec![relid.into()],
                );
            }
        }
    }
}

/// Fences `relids` for a change made inside the extension's own statements (run through SPI,
/// where [`before_ddl`] does not see them): a unique key added to a REGIONAL BY ROW table
/// through `multiregion.execute`, or its primary key changed.
pub(super) fn fence_tables(relids: Vec<pg_sys::Oid>) -> Result<(), MrError> {
    if gucs::sidecar_socket().is_none() || replication::known_off() {
        return Ok(());
    }
    fence(relids)
}

/// The relations a statement reshapes: `ALTER TABLE` (any form), renames of a table or its
/// parts, `DROP TABLE`, `CREATE UNIQUE INDEX`. Missing ones are left to the statement's own error.
///
/// # Safety
/// `pstmt` is a valid PlannedStmt.
#[allow(unsafe_code)]
unsafe fn reshaped_relations(pstmt: &pg_sys::PlannedStmt) -> Vec<pg_sys::Oid> {
    use pg_sys::NodeTag::*;
    let node = pstmt.utilityStmt;
    if node.is_null() {
        return Vec::new();
    }
    // SAFETY: each cast follows the node's own tag; RangeVars and name lists are the
    // statement's own, valid for the call.
    unsafe {
        let vars: Vec<*mut pg_sys::RangeVar> = match (*node).type_ {
            T_AlterTableStmt => vec![(*(node as *mut pg_sys::AlterTableStmt)).relation],
            T_RenameStmt => vec![(*(node as *mut pg_sys::RenameStmt)).relation],
            // A unique index is checked against every row first (a REGIONAL BY ROW table's
            // key across regions: `super::unique`), so no row may arrive meanwhile.
            T_IndexStmt if (*(node as *mut pg_sys::IndexStmt)).unique => {
                vec![(*(node as *mut pg_sys::IndexStmt)).relation]
            }
            T_DropStmt => {
                let drop = &*(node as *mut pg_sys::DropStmt);
                if drop.removeType != pg_sys::ObjectType::OBJECT_TABLE {
                    return Vec::new();
                }
                super::replicate::list_ptrs(drop.objects)
                    .map(|names| pg_sys::makeRangeVarFromNameList(names as *mut pg_sys::List))
                    .collect()
            }
            _ => return Vec::new(),
        };
        vars.into_iter()
            .filter(|rv| !rv.is_null())
            .filter_map(|rv| catalog::relid_of(rv))
            .collect()
    }
}

/// Before a TRUNCATE of replicated tables runs: waits until their ranges are ready for the
/// table to be locked outright ([`sidecar::table_ranges`]). A table created a moment ago
/// (`pgbench -i` truncates the tables it has just created) would otherwise hold its range's
/// first snapshot up with its lock while its commit waited for that range's voters. When
/// one other node leases every range the statement truncates, the statement runs there
/// instead, in this transaction's session on that node: `true`, and it is not to run here.
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run and `query_string` its source text.
#[allow(unsafe_code)]
pub(crate) unsafe fn before_truncate(
    pstmt: &pg_sys::PlannedStmt,
    query_string: *const std::ffi::c_char,
) -> bool {
    let node = pstmt.utilityStmt;
    // SAFETY: the utility statement of a valid PlannedStmt, its tag read before the cast.
    if node.is_null() || unsafe { (*node).type_ } != pg_sys::NodeTag::T_TruncateStmt {
        return false;
    }
    // SAFETY: reads a backend global: an applier (replica mode) writes this node's copy.
    if gucs::sidecar_socket().is_none()
        || replication::known_off()
        || routing::serving()
        || unsafe {
            pg_sys::SessionReplicationRole == pg_sys::SESSION_REPLICATION_ROLE_REPLICA as i32
        }
    {
        return false;
    }
    // SAFETY: a TruncateStmt's relations are RangeVars, valid for the call.
    let (relids, restart, cascade) = unsafe {
        let stmt = &*(node as *mut pg_sys::TruncateStmt);
        let relids: Vec<pg_sys::Oid> = super::replicate::list_ptrs(stmt.relations)
            .filter_map(|rv| catalog::relid_of(rv as *mut pg_sys::RangeVar))
            .collect();
        (
            relids,
            stmt.restart_seqs,
            stmt.behavior == pg_sys::DropBehavior::DROP_CASCADE,
        )
    };
    let database = catalog::database_name();
    let replicated = replicated_tables(&database, relids.clone());
    let tables: Vec<TableRef> = replicated.iter().map(|(_, t)| t.clone()).collect();
    if tables.is_empty() {
        return false;
    }
    let Some(ranges) = sidecar::table_ranges(database, tables).or_raise() else {
        return false;
    };
    let targets = truncated(&relids, &replicated, &ranges).or_raise();
    let holders: std::collections::BTreeSet<Option<u64>> =
        targets.iter().map(|(n, _)| *n).collect();
    let mut holders = holders.into_iter();
    match (holders.next(), holders.next()) {
        (Some(Some(node)), None) => {
            // SAFETY: the caller's contract: the statement's text and its place in it.
            let sql = unsafe { routing::statement_text(pstmt, query_string) };
            routing::refuse_with_schema_change(node);
            routing::run_on(node, &sql, Vec::new()).or_raise();
            true
        }
        (None, _) | (Some(None), None) => false,
        _ => {
            truncate_split(&relids, &replicated, targets, restart, cascade).or_raise();
            true
        }
    }
}

/// The relations a TRUNCATE of `relids` empties among `ranges` (of the `replicated` tables it
/// names), each with its range's leaseholder (`None`: this node): a REGIONAL BY ROW table's
/// partitions (only those named, when the table itself is not), or whole tables.
fn truncated(
    relids: &[pg_sys::Oid],
    replicated: &[(pg_sys::Oid, TableRef)],
    ranges: &[mr_wire::local::TableRange],
) -> Result<Vec<(Option<u64>, String)>, MrError> {
    let named = |name: &str| {
        spi::read_one("SELECT $1::regclass::oid::text", vec![name.into()])
            .and_then(|o| o.parse::<u32>().ok())
            .is_some_and(|o| relids.iter().any(|r| r.to_u32() == o))
    };
    let mut out = Vec::new();
    for r in ranges {
        let Some(&(oid, _)) = replicated.iter().find(|(_, t)| *t == r.table) else {
            continue;
        };
        let relation = match &r.partition {
            Some(region) => super::rbr::partition_of(oid, region).ok_or_else(|| {
                MrError::Retryable(format!(
                    "table {}.{} has no partition for region {region} here yet",
                    r.table.schema, r.table.table
                ))
            })?,
            None => format!(
                "{}.{}",
                spi::ident(&r.table.schema),
                spi::ident(&r.table.table)
            ),
        };
        if !relids.contains(&oid) && !named(&relation) {
            continue;
        }
        let node = if r.here {
            None
        } else {
            Some(r.leaseholder.ok_or_else(|| {
                MrError::Retryable(format!(
                    "range {} of table {}.{} has no leaseholder yet",
                    r.range_id, r.table.schema, r.table.table
                ))
            })?)
        };
        out.push((node, relation));
    }
    Ok(out)
}

/// A TRUNCATE of tables whose ranges are leased on several nodes: each leaseholder truncates
/// the relations of its own ranges (a REGIONAL BY ROW table's partitions, or whole tables) in
/// this transaction's session there, this node its own and the statement's unreplicated
/// tables, and the global keys of the tables truncated whole are released at their key
/// tables' leaseholders (the table's TRUNCATE trigger, which records that, does not fire for
/// its partitions).
fn truncate_split(
    relids: &[pg_sys::Oid],
    replicated: &[(pg_sys::Oid, TableRef)],
    targets: Vec<(Option<u64>, String)>,
    restart: bool,
    cascade: bool,
) -> Result<(), MrError> {
    if cascade {
        return Err(MrError::WriteNotServed {
            message: "TRUNCATE … CASCADE of tables whose ranges are leased on several nodes is not supported".into(),
            hint: "Name the referencing tables in the TRUNCATE instead of CASCADE.".into(),
        });
    }
    let mut by_node: std::collections::BTreeMap<Option<u64>, Vec<String>> = Default::default();
    for (node, relation) in targets {
        by_node.entry(node).or_default().push(relation);
    }
    // Tables of the statement that are not replicated are this node's own.
    for &relid in relids {
        let root = spi::read_one(
            "SELECT coalesce(pg_catalog.pg_partition_root($1::oid::regclass), $1::oid::regclass)::oid::text",
            vec![relid.into()],
        );
        let replicated_root = root
            .and_then(|o| o.parse::<u32>().ok())
            .is_some_and(|o| replicated.iter().any(|(r, _)| r.to_u32() == o));
        if !replicated_root {
            let name = spi::read_one("SELECT $1::oid::regclass::text", vec![relid.into()]);
            by_node.entry(None).or_default().extend(name);
        }
    }
    let suffix = if restart { " RESTART IDENTITY" } else { "" };
    for (node, relations) in &by_node {
        let sql = format!("TRUNCATE {}{suffix}", relations.join(", "));
        match node {
            Some(n) => {
                routing::refuse_with_schema_change(*n);
                routing::run_on(*n, &sql, Vec::new())?;
            }
            None => spi::run(&sql),
        }
    }
    for (oid, _) in replicated.iter().filter(|(o, _)| relids.contains(o)) {
        spi::run_with(
            "SELECT multiregion.record_keys_truncated(key_table, relid, constraint_name) \
               FROM multiregion.global_key WHERE relid = $1",
            vec![(*oid).into()],
        );
    }
    Ok(())
}

/// The replicated tables among `relids` (a partition stands for its table), once each.
fn replicated_tables(database: &str, relids: Vec<pg_sys::Oid>) -> Vec<(pg_sys::Oid, TableRef)> {
    let mut tables: Vec<(pg_sys::Oid, TableRef)> = Vec::new();
    for relid in relids {
        let rows = spi::read_rows(
            concat!(
                "SELECT c.oid::text, n.nspname::text, c.relname::text ",
                "FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace ",
                "WHERE c.oid = coalesce(pg_catalog.pg_partition_root($1::oid::regclass), $1::oid::regclass) AND ",
                super::replicate::replicated_table!()
            ),
            vec![relid.into()],
        );
        let Some((oid, schema, table)) = rows.into_iter().next().and_then(|r| {
            let mut r = r.into_iter().flatten();
            Some((r.next()?, r.next()?, r.next()?))
        }) else {
            continue;
        };
        let oid = pg_sys::Oid::from(oid.parse::<u32>().unwrap_or(0));
        if !tables.iter().any(|(o, _)| *o == oid) {
            let t = TableRef {
                database: database.to_string(),
                schema,
                table,
            };
            tables.push((oid, t));
        }
    }
    tables
}

fn fence(relids: Vec<pg_sys::Oid>) -> Result<(), MrError> {
    let database = catalog::database_name();
    // The replicated tables among them (a partition stands for its table), not fenced yet.
    let mut tables: Vec<(pg_sys::Oid, TableRef)> = Vec::new();
    for (oid, t) in replicated_tables(&database, relids) {
        let done = STATE.with(|s| s.borrow().tables.iter().any(|(_, o, _)| *o == oid));
        if !done {
            tables.push((oid, t));
        }
    }
    if tables.is_empty() {
        return Ok(());
    }
    // Sessions elsewhere that this transaction did not open to fence: statements ran there
    // before, under the old schema, and their rows would follow the change.
    let fenced_at: Vec<u64> = STATE.with(|s| s.borrow().nodes.iter().map(|(_, n)| *n).collect());
    if routing::remote_nodes()
        .iter()
        .any(|n| !fenced_at.contains(n))
    {
        let t = &tables[0].1;
        return Err(MrError::DdlAfterRemoteStatements {
            table: format!("{}.{}", spi::ident(&t.schema), spi::ident(&t.table)),
        });
    }
    let names: Vec<TableRef> = tables.iter().map(|(_, t)| t.clone()).collect();
    let Some(ranges) = sidecar::table_ranges(database.clone(), names)? else {
        return Ok(());
    };
    // SAFETY: reads the current subtransaction's id.
    #[allow(unsafe_code)]
    let sub = unsafe { pg_sys::GetCurrentSubTransactionId() };
    let mut nodes: Vec<u64> = Vec::new();
    let mut locked_remotely: Vec<(u64, TableRef)> = Vec::new();
    for r in &ranges {
        let t = &r.table;
        if r.here {
            // The relation holding this range's rows only: this node's appliers of the
            // table's other ranges must still pass the barrier below.
            spi::run_with(
                "SELECT multiregion.fence_range($1, $2, $3)",
                vec![
                    t.schema.as_str().into(),
                    t.table.as_str().into(),
                    r.partition.as_deref().into(),
                ],
            );
            continue;
        }
        let Some(node) = r.leaseholder else {
            return Err(MrError::Retryable(format!(
                "range {} of table {}.{} has no leaseholder to lock before the schema change",
                r.range_id, t.schema, t.table
            )));
        };
        if locked_remotely.iter().any(|(n, u)| *n == node && u == t) {
            continue;
        }
        // The whole table there: that node's writers of any of its ranges wait.
        routing::run_on(
            node,
            "SELECT multiregion.fence_range($1, $2, NULL)",
            vec![Some(t.schema.clone()), Some(t.table.clone())],
        )?;
        locked_remotely.push((node, t.clone()));
        if !nodes.contains(&node) {
            nodes.push(node);
        }
    }
    let ids: Vec<u64> = ranges.iter().map(|r| r.range_id).collect();
    let after = sidecar::fence_barrier(database, ids)?;
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        for (oid, t) in tables {
            let after = ranges
                .iter()
                .filter(|r| r.table == t)
                .filter_map(|r| after.iter().find(|(id, _)| *id == r.range_id).copied())
                .collect();
            let f = Fenced {
                schema: t.schema,
                table: t.table,
                after,
            };
            s.tables.push((sub, oid, f));
        }
        for n in nodes {
            s.nodes.push((sub, n));
        }
    });
    Ok(())
}

/// For the proposal at commit: the fenced tables and the nodes holding locks.
pub(super) fn take() -> (Vec<Fenced>, Vec<u64>) {
    STATE.with(|s| {
        let s = std::mem::take(&mut *s.borrow_mut());
        let mut nodes: Vec<u64> = s.nodes.into_iter().map(|(_, n)| n).collect();
        nodes.sort_unstable();
        nodes.dedup();
        (s.tables.into_iter().map(|(_, _, f)| f).collect(), nodes)
    })
}

/// A subtransaction rolled back: its locks are gone (here and in the sessions elsewhere).
pub(super) fn sub_aborted(sub: pg_sys::SubTransactionId) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.tables.retain(|(x, ..)| *x < sub);
        s.nodes.retain(|(x, _)| *x < sub);
    });
}

pub(super) fn at_end() {
    STATE.with(|s| *s.borrow_mut() = State::default());
}
