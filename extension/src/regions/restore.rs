//! `pg_dump` and `pg_restore` of a multi-region database (docs/ARCHITECTURE.md §2.1.1).
//!
//! A dump holds the database's objects as PostgreSQL sees them (the region domain, the
//! partitioned tables with their region column, the key tables, every row) and, through
//! `multiregion.dump_catalog` (`pg_extension_config_dump`), the declarations: regions,
//! localities, global keys, keyed by `regclass`, which dumps as a qualified name and restores
//! as the new OID. `pg_restore` into a database of another cluster runs like any client's
//! statements there: its DDL replicates to every node, its rows through the ranges of a
//! database without regions. `multiregion.post_restore()` then adopts the declarations in one
//! schema change, as `ALTER DATABASE … PRIMARY REGION` and `SET LOCALITY` would have, except
//! that the tables are already in their layout: the meta group derives the ranges, and each
//! partition's range starts from the rows of its table's range.

use super::catalog::{self, LocalityRow};
use super::replicate::{cstr, list_ptrs};
use super::{cluster_regions, finish, require_database_owner, spi, Effect, Origin, REGION_TYPE};
use crate::error::{MrError, OrRaise};
use mr_meta::{DatabaseConfig, Placement, SurvivalGoal, TableLocality};
use mr_zoneconfig::ddl::{self, Change};
use pgrx::pg_sys;
use pgrx::prelude::*;
use serde::{Deserialize, Serialize};

/// The declarations of a dumped database, by name: what `post_restore` adopts, and what
/// travels in its schema change to every other node.
#[derive(Debug, Serialize, Deserialize)]
struct Declarations {
    config: DumpedConfig,
    #[serde(default)]
    tables: Vec<DumpedTable>,
    #[serde(default)]
    global_keys: Vec<DumpedKey>,
}

#[derive(Debug, Serialize, Deserialize)]
struct DumpedConfig {
    primary_region: String,
    regions: Vec<String>,
    survival_goal: String,
    placement: String,
    secondary_region: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
struct DumpedTable {
    schema: String,
    table: String,
    locality: String,
    region: Option<String>,
    region_column: Option<String>,
    #[serde(default)]
    hidden: bool,
    region_expr_sql: Option<String>,
    #[serde(default)]
    auto_rehoming: bool,
}

#[derive(Debug, Serialize, Deserialize)]
struct DumpedKey {
    schema: String,
    table: String,
    constraint_name: String,
    key_schema: String,
    key_table: String,
    columns: Vec<String>,
}

/// The restored declarations waiting in `multiregion.dump_catalog`: rows another server (or
/// another database) wrote, resolved to this database's names. Rows naming a relation the
/// restore did not create are left out with it.
const RESTORED: &str = "\
    WITH restored AS (SELECT * FROM multiregion.dump_catalog \
                       WHERE origin IS DISTINCT FROM multiregion.dump_origin()) \
    SELECT (SELECT count(DISTINCT origin) FROM restored)::text, \
           pg_catalog.jsonb_build_object( \
             'config', (SELECT entry FROM restored WHERE kind = 'database' LIMIT 1), \
             'tables', COALESCE((SELECT pg_catalog.jsonb_agg(r.entry || pg_catalog.jsonb_build_object( \
                   'schema', n.nspname, 'table', c.relname) ORDER BY n.nspname, c.relname) \
                 FROM restored r JOIN pg_catalog.pg_class c ON c.oid = r.rel \
                 JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                WHERE r.kind = 'table'), '[]'), \
             'global_keys', COALESCE((SELECT pg_catalog.jsonb_agg(r.entry || pg_catalog.jsonb_build_object( \
                   'schema', n.nspname, 'table', c.relname, 'key_schema', kn.nspname, \
                   'key_table', k.relname) ORDER BY n.nspname, c.relname, r.entry ->> 'constraint_name') \
                 FROM restored r JOIN pg_catalog.pg_class c ON c.oid = r.rel \
                 JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                 JOIN pg_catalog.pg_class k ON k.oid = r.key_table \
                 JOIN pg_catalog.pg_namespace kn ON kn.oid = k.relnamespace \
                WHERE r.kind = 'global_key'), '[]') \
           )::text";

/// `multiregion.post_restore()`: after `pg_restore` of a multi-region database's dump, makes
/// this database what the dump's was — its regions, survival goal, placement, table
/// localities and global keys — on every node, in one schema change. With `declarations`
/// (what the change carries to the other nodes), adopts those instead of the restored rows.
#[pg_extern(schema = "multiregion")]
fn post_restore(declarations: default!(Option<pgrx::JsonB>, "NULL")) -> String {
    let replicated = crate::sequences::applying_change();
    let declarations = match declarations {
        Some(pgrx::JsonB(v)) => serde_json::from_value::<Declarations>(v)
            .map_err(|e| MrError::BadArgument {
                what: "declarations",
                value: e.to_string(),
                expected: "the JSON that multiregion.post_restore() sends to the other nodes",
            })
            .or_raise(),
        None => restored().or_raise(),
    };
    let origin = if replicated {
        Origin::Replicated
    } else {
        Origin::User
    };
    let effect = adopt(&declarations, origin).or_raise();
    if origin == Origin::User {
        spi::as_extension_owner(|| {
            spi::run(
                "DELETE FROM multiregion.dump_catalog \
                 WHERE origin IS DISTINCT FROM multiregion.dump_origin()",
            )
        });
        let json = serde_json::to_string(&declarations).expect("declarations serialize");
        let sql = format!(
            "SELECT multiregion.post_restore({}::jsonb)",
            spi::lit(&json)
        );
        finish(effect, &sql, origin).or_raise();
    }
    format!(
        "database {} restored as multi-region: {} regions, {} table localities, {} global keys",
        catalog::database_name(),
        declarations.config.regions.len(),
        declarations.tables.len(),
        declarations.global_keys.len()
    )
}

/// The declarations a restore left in `multiregion.dump_catalog`.
fn restored() -> Result<Declarations, MrError> {
    let row = spi::read_rows(RESTORED, vec![])
        .into_iter()
        .next()
        .unwrap_or_default();
    let origins: i64 = row
        .first()
        .cloned()
        .flatten()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let json = row.get(1).cloned().flatten().unwrap_or_default();
    let value: serde_json::Value = serde_json::from_str(&json).unwrap_or_default();
    if origins > 1 {
        return Err(MrError::RestoreRefused {
            message: "this database holds the multi-region declarations of more than one dump"
                .into(),
            hint: "restore one multi-region dump into an empty database".into(),
        });
    }
    if value.get("config").is_none_or(|c| c.is_null()) {
        return Err(MrError::RestoreRefused {
            message: format!(
                "database {} holds no restored multi-region declarations",
                catalog::database_name()
            ),
            hint: "run multiregion.post_restore() once, after pg_restore of a dump of a multi-region database".into(),
        });
    }
    serde_json::from_value(value).map_err(|e| MrError::BadChange(e.to_string()))
}

/// Writes `d` into this database's catalog. Typed here, it is checked first: the caller owns
/// the database, the database has no regions yet, the cluster has the regions, and every
/// table is in the layout its locality needs.
fn adopt(d: &Declarations, origin: Origin) -> Result<Effect, MrError> {
    let name = catalog::database_name();
    let config = if origin == Origin::User {
        require_database_owner(&name)?;
        let (current, _) = catalog::load(true);
        if current.is_some() {
            return Err(MrError::RestoreRefused {
                message: format!("database {name} is already multi-region"),
                hint: "restore the dump into a new database, created without regions".into(),
            });
        }
        checked_config(&name, &d.config)?
    } else {
        config_of(&name, &d.config)
    };
    let mut effect = Effect {
        typed_here: origin == Origin::User,
        ..Effect::default()
    };
    spi::as_extension_owner(|| -> Result<(), MrError> {
        let exists = spi::one(
            "SELECT pg_catalog.to_regtype($1)::text",
            vec![REGION_TYPE.into()],
        );
        super::set_region_domain(&config, exists.is_none());
        let (_, version) = catalog::load(true);
        catalog::store(Some(&config), version);
        for t in &d.tables {
            let relid = relation(&t.schema, &t.table)?;
            let locality = match t.locality.as_str() {
                "global" => TableLocality::Global,
                "regional_by_table" => TableLocality::RegionalByTable {
                    region: t.region.clone(),
                },
                "regional_by_row" => TableLocality::RegionalByRow {
                    column: t.region_column.clone().unwrap_or_default(),
                },
                other => return Err(MrError::BadChange(format!("unknown locality {other:?}"))),
            };
            if origin == Origin::User {
                check_layout(relid, &t.schema, &t.table, &locality)?;
            }
            let row = LocalityRow {
                locality: locality.clone(),
                hidden: t.hidden,
                region_expr_sql: t.region_expr_sql.clone(),
                auto_rehoming: t.auto_rehoming,
            };
            catalog::store_locality(relid, &row, None);
            effect
                .localities
                .push((t.schema.clone(), t.table.clone(), Some(locality)));
        }
        for k in &d.global_keys {
            let relid = relation(&k.schema, &k.table)?;
            let key_table = relation(&k.key_schema, &k.key_table)?;
            spi::run_with(
                "INSERT INTO multiregion.global_key (relid, constraint_name, key_table, columns) \
                 VALUES ($1, $2, $3, $4) ON CONFLICT (relid, constraint_name) DO UPDATE \
                 SET key_table = excluded.key_table, columns = excluded.columns",
                vec![
                    relid.into(),
                    k.constraint_name.as_str().into(),
                    key_table.into(),
                    k.columns.clone().into(),
                ],
            );
        }
        Ok(())
    })?;
    effect.config = Some(Some(config));
    effect.changed = true;
    Ok(effect)
}

/// The dumped configuration, checked as the statements that made it would be: each region
/// must be one of this cluster's.
fn checked_config(name: &str, c: &DumpedConfig) -> Result<DatabaseConfig, MrError> {
    let cluster = cluster_regions()?;
    let set = |change: Change, before: DatabaseConfig| match change {
        Change::Set(next) => next,
        _ => before,
    };
    let Change::Set(mut config) = ddl::set_primary_region(None, name, &cluster, &c.primary_region)?
    else {
        return Err(MrError::BadChange("no primary region".into()));
    };
    for region in c.regions.iter().filter(|r| **r != c.primary_region) {
        let change = ddl::add_region(Some(&config), name, &cluster, region, true)?;
        config = set(change, config);
    }
    let want = config_of(name, c);
    if want.survival != config.survival {
        let change = ddl::set_survival(Some(&config), name, want.survival)?;
        config = set(change, config);
    }
    if want.placement != config.placement {
        let change = ddl::set_placement(Some(&config), name, want.placement)?;
        config = set(change, config);
    }
    if want.secondary_region.is_some() {
        let change = ddl::set_secondary_region(
            Some(&config),
            name,
            want.secondary_region.as_deref(),
            false,
        )?;
        config = set(change, config);
    }
    Ok(config)
}

/// The dumped configuration as the meta group keeps it.
fn config_of(name: &str, c: &DumpedConfig) -> DatabaseConfig {
    DatabaseConfig {
        database: name.to_string(),
        primary_region: c.primary_region.clone(),
        regions: c.regions.iter().cloned().collect(),
        survival: if c.survival_goal == "region" {
            SurvivalGoal::Region
        } else {
            SurvivalGoal::Zone
        },
        placement: if c.placement == "restricted" {
            Placement::Restricted
        } else {
            Placement::Default
        },
        secondary_region: c.secondary_region.clone(),
    }
}

fn relation(schema: &str, table: &str) -> Result<pg_sys::Oid, MrError> {
    spi::one(
        "SELECT pg_catalog.to_regclass(pg_catalog.format('%I.%I', $1::text, $2::text))::oid::text",
        vec![schema.into(), table.into()],
    )
    .and_then(|o| o.parse::<u32>().ok())
    .map(pg_sys::Oid::from)
    .ok_or_else(|| MrError::NoSuchTable(format!("{}.{}", spi::ident(schema), spi::ident(table))))
}

/// A REGIONAL BY ROW table must be partitioned by its region column, any other table not
/// partitioned at all: the restore recreated what the dump held, and the declarations must
/// describe it.
fn check_layout(
    relid: pg_sys::Oid,
    schema: &str,
    table: &str,
    locality: &TableLocality,
) -> Result<(), MrError> {
    let key = spi::one(
        "SELECT COALESCE((SELECT a.attname::text FROM pg_catalog.pg_partitioned_table p \
           JOIN pg_catalog.pg_attribute a ON a.attrelid = p.partrelid AND a.attnum = p.partattrs[0] \
          WHERE p.partrelid = $1 AND p.partnatts = 1), '')",
        vec![relid.into()],
    )
    .unwrap_or_default();
    let ok = match locality {
        TableLocality::RegionalByRow { column } => &key == column,
        _ => key.is_empty(),
    };
    if ok {
        return Ok(());
    }
    Err(MrError::RestoreRefused {
        message: format!(
            "table {}.{} is not in the layout of its dumped locality",
            spi::ident(schema),
            spi::ident(table)
        ),
        hint: "restore the whole dump, unchanged, into an empty database".into(),
    })
}

/// The capture triggers every replicated table gets when it is created
/// (`multiregion.install_capture`), with their functions.
const CAPTURE_TRIGGERS: [(&str, &str); 3] = [
    ("multiregion_capture", "capture_row"),
    ("_multiregion_route", "route_row"),
    ("multiregion_capture_truncate", "capture_truncate"),
];

/// Whether `pstmt` creates a capture trigger that its table already has: a dump holds the
/// triggers the table's CREATE TABLE made, and its restore runs that CREATE TABLE first.
/// The statement is then skipped: it would only fail.
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run.
#[allow(unsafe_code)]
pub(crate) unsafe fn existing_capture_trigger(pstmt: &pg_sys::PlannedStmt) -> bool {
    let node = pstmt.utilityStmt;
    // SAFETY: the caller's contract; the cast follows the node's tag.
    if node.is_null() || unsafe { (*node).type_ } != pg_sys::NodeTag::T_CreateTrigStmt {
        return false;
    }
    // SAFETY: as above.
    let s = unsafe { &*(node as *mut pg_sys::CreateTrigStmt) };
    if s.replace || s.isconstraint || s.trigname.is_null() || s.relation.is_null() {
        return false;
    }
    // SAFETY: NUL-terminated strings of the parse tree; funcname is a list of String nodes.
    let (trigger, function, schema, rel_schema, rel_name) = unsafe {
        let names: Vec<String> = list_ptrs(s.funcname)
            .map(|p| cstr((*(p as *mut pg_sys::String)).sval))
            .collect();
        let rv = &*s.relation;
        (
            cstr(s.trigname),
            names.last().cloned().unwrap_or_default(),
            if names.len() == 2 {
                names[0].clone()
            } else {
                String::new()
            },
            cstr(rv.schemaname),
            cstr(rv.relname),
        )
    };
    if schema != "multiregion"
        || !CAPTURE_TRIGGERS
            .iter()
            .any(|(t, f)| *t == trigger && *f == function)
    {
        return false;
    }
    let rel = if rel_schema.is_empty() {
        spi::ident(&rel_name)
    } else {
        format!("{}.{}", spi::ident(&rel_schema), spi::ident(&rel_name))
    };
    spi::flag(
        "SELECT EXISTS (SELECT FROM pg_catalog.pg_trigger t \
           JOIN pg_catalog.pg_proc p ON p.oid = t.tgfoid \
           JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace \
          WHERE t.tgrelid = pg_catalog.to_regclass($1) AND t.tgname = $2 \
            AND n.nspname = 'multiregion' AND p.proname = $3)::text",
        vec![
            rel.as_str().into(),
            trigger.as_str().into(),
            function.as_str().into(),
        ],
    )
}

/// A table attached as a partition, and one detached: `ATTACH PARTITION` clones the parent's
/// row triggers onto the table, which fails on the capture triggers the table got as a table
/// of its own (a dump creates each partition by itself, then attaches it); `DETACH PARTITION`
/// takes the clones away, and the table, a table of its own again, needs its own.
pub(crate) enum PartitionChange {
    Attach(String),
    Detach(String),
}

/// The partition an `ALTER TABLE … ATTACH|DETACH PARTITION` names, if `pstmt` is one; an
/// attached table's own capture row triggers are dropped before it runs.
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run.
#[allow(unsafe_code)]
pub(crate) unsafe fn before_partition_change(
    pstmt: &pg_sys::PlannedStmt,
) -> Option<PartitionChange> {
    let node = pstmt.utilityStmt;
    // SAFETY: the caller's contract; each cast follows the node's tag.
    if node.is_null() || unsafe { (*node).type_ } != pg_sys::NodeTag::T_AlterTableStmt {
        return None;
    }
    // SAFETY: as above; an ALTER TABLE's commands are AlterTableCmds, a partition command's
    // definition a PartitionCmd whose name is a RangeVar.
    let change = unsafe {
        let s = &*(node as *mut pg_sys::AlterTableStmt);
        list_ptrs(s.cmds).find_map(|c| {
            let cmd = &*(c as *mut pg_sys::AlterTableCmd);
            let attach = cmd.subtype == pg_sys::AlterTableType::AT_AttachPartition;
            let detach = cmd.subtype == pg_sys::AlterTableType::AT_DetachPartition;
            if !(attach || detach) || cmd.def.is_null() {
                return None;
            }
            let p = &*(cmd.def as *mut pg_sys::PartitionCmd);
            if p.name.is_null() || (detach && p.concurrent) {
                return None;
            }
            let rv = &*p.name;
            let name = if rv.schemaname.is_null() {
                spi::ident(&cstr(rv.relname))
            } else {
                format!(
                    "{}.{}",
                    spi::ident(&cstr(rv.schemaname)),
                    spi::ident(&cstr(rv.relname))
                )
            };
            Some(if attach {
                PartitionChange::Attach(name)
            } else {
                PartitionChange::Detach(name)
            })
        })
    }?;
    if let PartitionChange::Attach(table) = &change {
        for (trigger, _) in &CAPTURE_TRIGGERS[..2] {
            if own_trigger(table, trigger) {
                spi::as_extension_owner(|| {
                    spi::run(&format!(
                        "DROP TRIGGER {} ON {}",
                        spi::ident(trigger),
                        pg_regclass_text(table)
                    ))
                });
            }
        }
    }
    Some(change)
}

/// After the statement: a detached table that captures TRUNCATE (a replicated table's
/// partition) gets the capture row triggers back.
pub(crate) fn after_partition_change(change: Option<PartitionChange>) {
    let Some(PartitionChange::Detach(table)) = change else {
        return;
    };
    if !own_trigger(&table, "multiregion_capture_truncate")
        || own_trigger(&table, "multiregion_capture")
    {
        return;
    }
    let rel = pg_regclass_text(&table);
    spi::as_extension_owner(|| {
        spi::run(&format!(
            "CREATE TRIGGER multiregion_capture AFTER INSERT OR UPDATE OR DELETE ON {rel} \
             FOR EACH ROW EXECUTE FUNCTION multiregion.capture_row()"
        ));
        spi::run(&format!(
            "CREATE TRIGGER \"_multiregion_route\" BEFORE INSERT ON {rel} \
             FOR EACH ROW EXECUTE FUNCTION multiregion.route_row()"
        ));
    });
}

/// Whether `table` (as written, quoted) has trigger `name` of its own (not a clone of its
/// parent's).
fn own_trigger(table: &str, name: &str) -> bool {
    spi::flag(
        "SELECT EXISTS (SELECT FROM pg_catalog.pg_trigger \
          WHERE tgrelid = pg_catalog.to_regclass($1) AND tgname = $2 AND tgparentid = 0)::text",
        vec![table.into(), name.into()],
    )
}

/// `table`'s regclass text, fully qualified, for a statement run with another search path.
fn pg_regclass_text(table: &str) -> String {
    spi::one(
        "SELECT pg_catalog.format('%I.%I', n.nspname, c.relname) FROM pg_catalog.pg_class c \
           JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
          WHERE c.oid = pg_catalog.to_regclass($1)",
        vec![table.into()],
    )
    .unwrap_or_else(|| table.to_string())
}
