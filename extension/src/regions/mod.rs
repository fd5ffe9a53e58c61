//! Database regions, survival goals, placement and table localities: the executor behind
//! `multiregion.execute(text)` and the native functions.
//!
//! Every statement runs the same way: check the caller's privileges, lock this database's
//! multi-region catalog row, decide with the pure rules of `mr_zoneconfig::ddl`, change the
//! PostgreSQL objects (the region domain, partitions, tables) as the extension's owner, bump
//! the schema version, and — unless it is itself applying a replicated change — propose the
//! statement to the meta group and wait until every other live node has applied it. A failure
//! anywhere aborts the caller's statement, so nothing is half-applied.

pub(crate) mod catalog;
mod execute;
mod fence;
mod guard;
mod local_fk;
mod primary_key;
mod rbr;
mod replicate;
mod restore;
mod show;
mod show_create;
pub(crate) mod spi;
mod unique;
mod zone;

use crate::error::{MrError, OrRaise};
use crate::sidecar;
use catalog::LocalityRow;
use mr_meta::{DatabaseConfig, TableLocality};
use mr_zoneconfig::ddl::{self, Change, DdlError};
use pgrx::pg_sys::Oid;
use pgrx::prelude::*;
use spi::{ident, lit, run};
use std::collections::BTreeSet;

pub(crate) use fence::before_ddl as fence_before_ddl;
pub(crate) use fence::before_truncate as await_ranges_before_truncate;
pub(crate) use fence::release_truncated_partition_keys;
pub(crate) use guard::refuse_region_type_change;
pub(crate) use replicate::{
    database_ddl, database_ddl_done, foreign_keys_to_key_tables, replicate_ddl, replicated_ddl,
    trusting_foreign_keys, Ddl,
};
pub(crate) use restore::{
    after_partition_change, before_partition_change, existing_capture_trigger,
};
pub(crate) use unique::{
    check_keys as check_added_unique_keys, create_key_tables as create_added_key_tables,
    rename_key as rename_global_key, renamed_key, with_region as unique_keys_with_region,
};

extension_sql_file!("../catalog.sql", name = "catalog", requires = [multiregion]);

/// The regions nodes were started in, from the meta group.
fn cluster_regions() -> Result<BTreeSet<String>, MrError> {
    Ok(sidecar::cluster_regions()?
        .into_iter()
        .map(|r| r.region)
        .collect())
}

/// The caller must own the current database (or be a superuser, or a member of the owner).
fn require_database_owner(database: &str) -> Result<(), MrError> {
    let ok = spi::flag(
        "SELECT pg_catalog.pg_has_role(current_user, datdba, 'USAGE')::text \
         FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database()",
        vec![],
    );
    if ok {
        Ok(())
    } else {
        Err(MrError::NotOwner {
            kind: "database",
            name: database.to_string(),
        })
    }
}

fn require_table_owner(relid: Oid) -> Result<(), MrError> {
    let ok = spi::flag(
        "SELECT pg_catalog.pg_has_role(current_user, relowner, 'USAGE')::text \
         FROM pg_catalog.pg_class WHERE oid = $1",
        vec![relid.into()],
    );
    if ok {
        Ok(())
    } else {
        Err(MrError::NotOwner {
            kind: "table",
            name: relname(relid),
        })
    }
}

/// The table's name as the user wrote it in the search path (qualified if not visible).
fn relname(relid: Oid) -> String {
    spi::one("SELECT $1::regclass::text", vec![relid.into()]).unwrap_or_default()
}

/// Only the current database can be changed: a function runs inside one database.
fn require_current(database: &str) -> Result<String, MrError> {
    let current = catalog::database_name();
    if database != current {
        return Err(MrError::OtherDatabase {
            database: database.to_string(),
            current,
        });
    }
    Ok(current)
}

/// How a statement came to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// A user's statement on this node: propose it, then wait for every other node.
    User,
    /// pgmr applying a change another node committed: neither propose nor wait.
    Replicated,
}

/// The rule that turns a database's current configuration into the change a statement makes.
type Decide<'a> = Box<dyn Fn(Option<&DatabaseConfig>, &str) -> Result<Change, MrError> + 'a>;

/// What the executor decided, for the command tag and for replication.
#[derive(Debug, Default)]
struct Effect {
    /// The configuration changed (or stopped being multi-region): `Some(new)`.
    config: Option<Option<DatabaseConfig>>,
    /// Table localities that changed, as (schema, table, locality).
    localities: Vec<(String, String, Option<TableLocality>)>,
    /// The statement changed something that other nodes must apply.
    changed: bool,
    /// `CONFIGURE ZONE` overrides set or discarded, for the meta group.
    zones: Vec<mr_meta::ZoneChange>,
    /// The statement was typed here (not applied from another node's change): checks that
    /// need the whole cluster's rows ask the ranges' leaseholders.
    typed_here: bool,
}

/// The domain that holds a database's regions, in `public` as CockroachDB has it.
const REGION_TYPE: &str = "public.crdb_internal_region";

/// Replaces the domain's check with one allowing exactly `regions`. Validates every column
/// of the type, so a region still in use cannot disappear.
fn set_region_domain(config: &DatabaseConfig, created: bool) {
    let check = format!(
        "CHECK (multiregion.valid_region(VALUE, {}))",
        catalog::quoted_regions(config)
    );
    if created {
        run(&format!(
            "CREATE DOMAIN {REGION_TYPE} AS text CONSTRAINT crdb_internal_region_valid {check}"
        ));
        run(&format!(
            "COMMENT ON DOMAIN {REGION_TYPE} IS 'pg_multiregion: the regions of this database'"
        ));
        let owner = spi::one(
            "SELECT pg_catalog.pg_get_userbyid(datdba)::text FROM pg_catalog.pg_database \
             WHERE datname = pg_catalog.current_database()",
            vec![],
        )
        .unwrap_or_default();
        run(&format!(
            "ALTER DOMAIN {REGION_TYPE} OWNER TO {}",
            ident(&owner)
        ));
    } else {
        run(&format!(
            "ALTER DOMAIN {REGION_TYPE} DROP CONSTRAINT crdb_internal_region_valid"
        ));
        run(&format!(
            "ALTER DOMAIN {REGION_TYPE} ADD CONSTRAINT crdb_internal_region_valid {check}"
        ));
    }
}

/// Applies a database-level [`Change`] decided by the rules.
fn apply_database_change(
    before: Option<&DatabaseConfig>,
    change: Change,
    effect: &mut Effect,
) -> Result<(), MrError> {
    let next = match change {
        Change::Skip(notice) => {
            pgrx::notice!("{notice}");
            return Ok(());
        }
        Change::Unset => None,
        Change::Set(next) => Some(next),
    };
    spi::as_extension_owner(|| -> Result<(), MrError> {
        match (before, &next) {
            (None, Some(next)) => set_region_domain(next, true),
            (Some(before), Some(next)) => {
                let added: Vec<&String> = next.regions.difference(&before.regions).collect();
                let dropped: Vec<&String> = before.regions.difference(&next.regions).collect();
                for region in &dropped {
                    rbr::check_region_unused(region, effect.typed_here)?;
                }
                // The dropped regions' partitions go before the domain stops allowing them: a
                // node's copy of a partition it no longer holds a replica of can keep rows the
                // range deleted since, which the domain's new check would trip over.
                for region in &dropped {
                    rbr::drop_partitions(region);
                }
                if !added.is_empty() || !dropped.is_empty() {
                    set_region_domain(next, false);
                }
                for region in added {
                    rbr::add_partitions(region);
                }
            }
            (Some(before), None) => {
                for region in &before.regions {
                    rbr::check_region_unused(region, effect.typed_here)?;
                }
                run(&format!("DROP DOMAIN {REGION_TYPE}"));
                run("DELETE FROM multiregion.table_locality");
            }
            (None, None) => {}
        }
        Ok(())
    })?;
    let (_, version) = catalog::load(false);
    spi::as_extension_owner(|| catalog::store(next.as_ref(), version));
    effect.config = Some(next);
    effect.changed = true;
    Ok(())
}

/// Runs one parsed multi-region statement against the current database.
fn run_database_statement(stmt: &mr_sql::Statement, effect: &mut Effect) -> Result<(), MrError> {
    use mr_sql::Statement as S;
    let (database, decide): (&str, Decide<'_>) = match stmt {
        S::AlterDatabasePrimaryRegion { database, region } => (
            database,
            Box::new(move |db, name| {
                Ok(ddl::set_primary_region(
                    db,
                    name,
                    &cluster_regions()?,
                    region,
                )?)
            }),
        ),
        S::AlterDatabaseAddRegion {
            database,
            region,
            if_not_exists,
        } => (
            database,
            Box::new(move |db, name| {
                Ok(ddl::add_region(
                    db,
                    name,
                    &cluster_regions()?,
                    region,
                    *if_not_exists,
                )?)
            }),
        ),
        S::AlterDatabaseDropRegion {
            database,
            region,
            if_exists,
        } => (
            database,
            Box::new(move |db, name| {
                let homed = rbr::tables_homed_in(region);
                Ok(ddl::drop_region(db, name, region, *if_exists, &homed)?)
            }),
        ),
        S::AlterDatabaseSurvival { database, goal } => (
            database,
            Box::new(move |db, name| Ok(ddl::set_survival(db, name, *goal)?)),
        ),
        S::AlterDatabasePlacement {
            database,
            placement,
        } => (
            database,
            Box::new(move |db, name| Ok(ddl::set_placement(db, name, *placement)?)),
        ),
        S::AlterDatabaseSecondaryRegion { database, region } => (
            database,
            Box::new(move |db, name| {
                Ok(ddl::set_secondary_region(
                    db,
                    name,
                    region.as_deref(),
                    false,
                )?)
            }),
        ),
        _ => unreachable!("not a database statement"),
    };
    let name = require_current(database)?;
    require_database_owner(&name)?;
    let (before, _) = catalog::load(true);
    let change = decide(before.as_ref(), &name)?;
    apply_database_change(before.as_ref(), change, effect)
}

/// `ALTER TABLE t SET LOCALITY …` (also the second half of `CREATE TABLE … LOCALITY`).
fn set_locality(
    relid: Oid,
    locality: &mr_sql::Locality,
    effect: &mut Effect,
) -> Result<(), MrError> {
    require_table_owner(relid)?;
    let name = catalog::database_name();
    let (config, _) = catalog::load(true);
    let target = match locality {
        mr_sql::Locality::Global => TableLocality::Global,
        mr_sql::Locality::RegionalByTable { region } => TableLocality::RegionalByTable {
            region: region.clone(),
        },
        mr_sql::Locality::RegionalByRow { column } => TableLocality::RegionalByRow {
            column: column
                .clone()
                .unwrap_or_else(|| rbr::HIDDEN_COLUMN.to_string()),
        },
    };
    ddl::check_locality(config.as_ref(), &name, &target)?;
    let config = config.expect("checked multi-region");
    let current = catalog::locality(relid);
    let (schema, table) = {
        let r = spi::rows(
            "SELECT n.nspname::text, c.relname::text FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1",
            vec![relid.into()],
        );
        let r = r.into_iter().next().unwrap_or_default();
        (
            r.first().cloned().flatten().unwrap_or_default(),
            r.get(1).cloned().flatten().unwrap_or_default(),
        )
    };
    let new_relid = spi::as_extension_owner(|| -> Result<Oid, MrError> {
        let mut relid = relid;
        let was_rbr = matches!(current.locality, TableLocality::RegionalByRow { .. });
        let is_rbr = matches!(target, TableLocality::RegionalByRow { .. });
        if was_rbr {
            relid = rbr::convert_from_rbr(relid, &current)?;
        }
        if let TableLocality::RegionalByRow { column } = &target {
            relid = rbr::convert_to_rbr(relid, column, &config)?;
        } else {
            let row = LocalityRow {
                locality: target.clone(),
                hidden: false,
                region_expr_sql: None,
                auto_rehoming: false,
            };
            catalog::store_locality(relid, &row, None);
        }
        let _ = is_rbr;
        Ok(relid)
    })?;
    let _ = new_relid;
    effect.localities.push((schema, table, Some(target)));
    effect.changed = true;
    Ok(())
}

/// Ends a statement that changed something. A user's statement is kept for the proposal at
/// commit ([`pre_commit`]), which bumps the schema version once for the whole transaction
/// (so that, until then, this node's applier can apply other nodes' changes that do not
/// conflict with it); a replicated one bumps the version as it goes, and the applier records
/// the version it applied.
fn finish(effect: Effect, sql: &str, origin: Origin) -> Result<(), MrError> {
    if !effect.changed {
        return Ok(());
    }
    match origin {
        Origin::User => replicate::defer(sql, &effect.localities, &effect.zones),
        Origin::Replicated => {
            let (config, version) = catalog::load(true);
            spi::as_extension_owner(|| catalog::store(config.as_ref(), version + 1));
        }
    }
    Ok(())
}

/// This transaction made schema changes other nodes have not seen yet: statements it sends
/// to another node would meet the old schema there.
pub fn has_pending_schema_change() -> bool {
    replicate::has_pending()
}

/// At pre-commit, before the transaction's rows are replicated (they carry the new schema
/// version, which replicas wait for): proposes its schema changes. The database and version
/// to await once the rest of the commit went through.
pub fn pre_commit() -> Result<Option<(String, u64)>, MrError> {
    replicate::propose_pending()
}

pub use replicate::{
    at_end as schema_at_end, await_applied, proposed_version, sub_aborted as schema_sub_aborted,
};

impl From<DdlError> for MrError {
    fn from(e: DdlError) -> Self {
        MrError::Ddl(e)
    }
}

/// The region type's check: `value` must be one of `regions`, else CockroachDB's error for an
/// unknown region with the valid ones as hint.
#[pg_extern(schema = "multiregion", immutable, parallel_safe)]
fn valid_region(value: &str, regions: Vec<String>) -> bool {
    if regions.iter().any(|r| r == value) {
        return true;
    }
    MrError::Ddl(DdlError {
        sqlstate: "22P02",
        message: format!(
            "invalid input value for enum crdb_internal_region: {}",
            lit(value)
        ),
        hint: Some(format!("valid regions: {}", regions.join(", "))),
    })
    .raise()
}

/// CockroachDB's `default_to_database_primary_region(region)`: the region if it is one of
/// the database's, else the primary region.
#[pg_extern(schema = "multiregion", stable, parallel_safe)]
fn default_to_database_primary_region(region: &str) -> Option<String> {
    let (config, _) = catalog::load(false);
    let config = config?;
    if config.regions.contains(region) {
        Some(region.to_string())
    } else {
        Some(config.primary_region)
    }
}

/// CockroachDB's `rehome_row()`: the gateway region if it is a database region, else the
/// primary region; used as `ON UPDATE` value of region columns under auto-rehoming. A
/// statement served for another node's transaction rehomes to that node's region, not to
/// this (the leaseholder's) one.
#[pg_extern(schema = "multiregion", stable, parallel_safe)]
fn rehome_row() -> Option<String> {
    let gateway = match crate::routing::gateway_region_override() {
        Some(region) => region,
        None => crate::gucs::locality().ok()?.region().to_owned(),
    };
    default_to_database_primary_region(&gateway)
}

fn native(sql: String) {
    execute::execute_one(&sql, Origin::User).or_raise();
}

/// `ALTER DATABASE <current> PRIMARY REGION region`.
#[pg_extern(schema = "multiregion")]
fn set_primary_region(region: &str) {
    native(format!(
        "ALTER DATABASE {} PRIMARY REGION {}",
        ident(&catalog::database_name()),
        ident(region)
    ));
}

/// `ALTER DATABASE <current> ADD REGION [IF NOT EXISTS] region`.
#[pg_extern(schema = "multiregion")]
fn add_region(region: &str, if_not_exists: default!(bool, false)) {
    native(format!(
        "ALTER DATABASE {} ADD REGION {}{}",
        ident(&catalog::database_name()),
        if if_not_exists { "IF NOT EXISTS " } else { "" },
        ident(region)
    ));
}

/// `ALTER DATABASE <current> DROP REGION [IF EXISTS] region`.
#[pg_extern(schema = "multiregion")]
fn drop_region(region: &str, if_exists: default!(bool, false)) {
    native(format!(
        "ALTER DATABASE {} DROP REGION {}{}",
        ident(&catalog::database_name()),
        if if_exists { "IF EXISTS " } else { "" },
        ident(region)
    ));
}

/// `ALTER DATABASE <current> SURVIVE { ZONE | REGION } FAILURE`; `goal` is `zone` or `region`.
#[pg_extern(schema = "multiregion")]
fn set_survival_goal(goal: &str) {
    let goal = match goal.to_ascii_lowercase().as_str() {
        "zone" => "ZONE",
        "region" => "REGION",
        _ => MrError::BadArgument {
            what: "survival goal",
            value: goal.to_string(),
            expected: "zone or region",
        }
        .raise(),
    };
    native(format!(
        "ALTER DATABASE {} SURVIVE {goal} FAILURE",
        ident(&catalog::database_name())
    ));
}

/// `ALTER DATABASE <current> PLACEMENT { RESTRICTED | DEFAULT }`.
#[pg_extern(schema = "multiregion")]
fn set_placement(placement: &str) {
    let placement = match placement.to_ascii_lowercase().as_str() {
        "default" => "DEFAULT",
        "restricted" => "RESTRICTED",
        _ => MrError::BadArgument {
            what: "placement",
            value: placement.to_string(),
            expected: "default or restricted",
        }
        .raise(),
    };
    native(format!(
        "ALTER DATABASE {} PLACEMENT {placement}",
        ident(&catalog::database_name())
    ));
}

/// `ALTER TABLE t SET LOCALITY <locality>`, the locality written as CockroachDB does
/// (`GLOBAL`, `REGIONAL BY TABLE IN "us-east1"`, `REGIONAL BY ROW AS region`, …).
#[pg_extern(schema = "multiregion", name = "set_locality")]
fn set_locality_native(tbl: &str, locality: &str) {
    let relid = resolve_table(tbl).or_raise();
    let name = spi::as_extension_owner(|| relname(relid));
    native(format!("ALTER TABLE {name} SET LOCALITY {locality}"));
}

/// A table name as PostgreSQL resolves it in the caller's search path.
fn resolve_table(name: &str) -> Result<Oid, MrError> {
    let row = spi::rows(
        "SELECT c.oid::text, c.relkind::text, c.relname::text FROM pg_catalog.pg_class c \
         WHERE c.oid = pg_catalog.to_regclass($1)",
        vec![name.into()],
    );
    let col = |i: usize| row.first().and_then(|r| r.get(i).cloned().flatten());
    match col(1).as_deref() {
        None => Err(MrError::NoSuchTable(name.to_string())),
        // Views, materialized views, sequences, foreign tables: CockroachDB's refusal.
        Some(kind) if kind != "r" && kind != "p" => Err(MrError::Ddl(DdlError {
            sqlstate: ddl::WRONG_OBJECT_TYPE,
            message: format!("\"{}\" is not a table", col(2).unwrap_or_default()),
            hint: None,
        })),
        Some(_) => col(0)
            .and_then(|o| o.parse::<u32>().ok())
            .map(Oid::from)
            .ok_or_else(|| MrError::NoSuchTable(name.to_string())),
    }
}
