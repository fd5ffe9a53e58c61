//! `multiregion.execute(text)`: CockroachDB's multi-region statements, verbatim, through the
//! shared translator (`mr_sql`); anything else runs as PostgreSQL's own statement.

use super::{
    catalog, finish, require_current, resolve_table, run_database_statement, set_locality, show,
    spi, Effect, Origin,
};
use crate::error::{MrError, OrRaise};
use mr_sql::{ObjectName, Statement};
use pgrx::prelude::*;
use pgrx::Json;

/// Runs one statement and returns its result rows as JSON objects (column order kept), or for
/// a statement without rows its command tag as a JSON string.
#[pg_extern(schema = "multiregion")]
fn execute(sql: &str) -> SetOfIterator<'static, Json> {
    SetOfIterator::new(
        execute_one(sql, Origin::User)
            .or_raise()
            .into_iter()
            .map(Json),
    )
}

fn tag(t: &str) -> Vec<serde_json::Value> {
    vec![serde_json::Value::String(t.to_string())]
}

/// `a.b.c` with each part quoted.
fn object_sql(name: &ObjectName) -> String {
    name.0
        .iter()
        .map(|p| spi::ident(p))
        .collect::<Vec<_>>()
        .join(".")
}

/// Plain DDL that other nodes must also run when the database is multi-region.
fn is_ddl(sql: &str) -> bool {
    let first = sql
        .trim_start()
        .split(|c: char| !c.is_ascii_alphabetic())
        .next()
        .unwrap_or("")
        .to_ascii_uppercase();
    matches!(
        first.as_str(),
        "CREATE" | "ALTER" | "DROP" | "COMMENT" | "GRANT" | "REVOKE"
    )
}

/// Runs one statement. Rows that a multi-region schema change itself rewrites (a conversion
/// copying a table) are not captured for replication: every node runs the change on its own
/// copy.
pub(super) fn execute_one(sql: &str, origin: Origin) -> Result<Vec<serde_json::Value>, MrError> {
    if let Ok(Some(stmt)) = mr_sql::parse(sql) {
        // CONFIGURE ZONE changes only the meta group's overrides: no copy to bring up to date.
        let rewrites = mr_sql::show_columns(&stmt).is_none()
            && !matches!(stmt, Statement::ConfigureZone { .. });
        if matches!(origin, Origin::User) && rewrites {
            // The change rewrites this node's copies: they must hold every row written
            // before it (a row just written through another node's lease arrives here
            // through replication). Writes racing the change are not ordered with it yet
            // (ARCHITECTURE.md §8, schema and data).
            super::replicate::barrier_every_table()?;
        }
        crate::replication::without_capture(|| execute_statement(sql, origin))
    } else {
        execute_statement(sql, origin)
    }
}

fn execute_statement(sql: &str, origin: Origin) -> Result<Vec<serde_json::Value>, MrError> {
    let stmt = mr_sql::parse(sql).map_err(|e| MrError::Syntax {
        message: e.message,
        position: e.position,
        sqlstate: e.sqlstate,
    })?;
    let mut effect = Effect {
        typed_here: matches!(origin, Origin::User),
        ..Effect::default()
    };
    let multi_region = || catalog::load(false).0.is_some();
    // Plain DDL through this door reaches every node as it does at top level (where the
    // ProcessUtility hook sends it; nested here, it does not see it): in any database,
    // whether it has regions or not.
    let replicated = || {
        multi_region()
            || (matches!(origin, Origin::User)
                && crate::gucs::sidecar_socket().is_some()
                && crate::gucs::replicate_ddl()
                && super::replicate::database_replicates_ddl())
    };
    if matches!(&stmt, Some(s) if mr_sql::show_columns(s).is_none()) {
        restart_idle_readers();
    }
    let out = match &stmt {
        None => {
            spi::run(sql);
            effect.changed = is_ddl(sql) && replicated();
            tag("OK")
        }
        Some(s @ Statement::AlterDatabasePrimaryRegion { .. }) => {
            run_database_statement(s, &mut effect)?;
            tag(s.tag())
        }
        Some(s @ Statement::AlterDatabaseAddRegion { .. }) => {
            run_database_statement(s, &mut effect)?;
            tag(s.tag())
        }
        Some(s @ Statement::AlterDatabaseDropRegion { .. }) => {
            run_database_statement(s, &mut effect)?;
            tag(s.tag())
        }
        Some(s @ Statement::AlterDatabaseSurvival { .. }) => {
            run_database_statement(s, &mut effect)?;
            tag(s.tag())
        }
        Some(s @ Statement::AlterDatabasePlacement { .. }) => {
            run_database_statement(s, &mut effect)?;
            tag(s.tag())
        }
        Some(s @ Statement::AlterDatabaseSecondaryRegion { .. }) => {
            run_database_statement(s, &mut effect)?;
            tag(s.tag())
        }
        Some(Statement::CreateDatabase {
            name,
            if_not_exists,
            primary_region,
            regions,
            survival,
            placement,
            secondary_region,
        }) => {
            create_database(
                name,
                *if_not_exists,
                primary_region.as_deref(),
                regions,
                *survival,
                *placement,
                secondary_region.as_deref(),
                &mut effect,
            )?;
            tag("CREATE DATABASE")
        }
        Some(Statement::CreateTable {
            table,
            sql: create,
            locality,
            indexes,
        }) => {
            spi::run(create);
            for index in indexes {
                spi::run(index);
            }
            if let Some(locality) = locality {
                let relid = resolve_table(&object_sql(table))?;
                set_locality(relid, locality, &mut effect)?;
            }
            effect.changed |= replicated();
            tag("CREATE TABLE")
        }
        Some(Statement::AlterTableSetLocality {
            table,
            locality,
            if_exists,
        }) => {
            let relid = match resolve_table(&object_sql(table)) {
                Err(MrError::NoSuchTable(name)) if *if_exists => {
                    pgrx::notice!("relation \"{name}\" does not exist, skipping");
                    return Ok(tag("ALTER TABLE SET LOCALITY"));
                }
                other => other?,
            };
            set_locality(relid, locality, &mut effect)?;
            tag("ALTER TABLE SET LOCALITY")
        }
        Some(Statement::AlterPrimaryKey {
            table,
            columns,
            bucket_count,
        }) => {
            let relid = resolve_table(&object_sql(table))?;
            super::primary_key::alter_primary_key(
                relid,
                columns,
                *bucket_count,
                matches!(origin, Origin::User),
            )?;
            effect.changed = replicated();
            tag("ALTER TABLE")
        }
        Some(Statement::ConfigureZone { target, fields }) => {
            // The meta group keeps overrides; other nodes have nothing to apply.
            if matches!(origin, Origin::User) {
                super::zone::configure(target, fields.as_deref(), &mut effect)?;
            }
            tag("CONFIGURE ZONE")
        }
        Some(Statement::CreateIndex { statements }) => {
            for statement in statements {
                if matches!(origin, Origin::User) {
                    // A unique key added to a REGIONAL BY ROW table is checked here.
                    super::unique::typed_here(|| spi::run(statement));
                } else {
                    spi::run(statement);
                }
            }
            effect.changed = replicated();
            tag("CREATE INDEX")
        }
        Some(Statement::Rewritten { sql: rewritten }) => {
            spi::run(rewritten);
            effect.changed = replicated();
            tag("ALTER TABLE")
        }
        Some(Statement::SetClusterSetting { name, value }) => {
            crate::api::meta::set_setting(Some(name), value.as_deref())?;
            tag("SET CLUSTER SETTING")
        }
        Some(show_stmt) => show::run(show_stmt)?,
    };
    finish(effect, sql, origin)?;
    Ok(out)
}

/// CockroachDB's schema changes do not wait for readers; PostgreSQL's DDL waits for every lock
/// holder, and an application that leaves a transaction open after reading (the MovR app does)
/// would block it forever. Before a multi-region schema change, pgmr's SQL gateway is asked to
/// restart the idle, read-only READ COMMITTED transactions holding locks in this database,
/// which it can do without their clients noticing. Best effort: any other holder is waited
/// for, as PostgreSQL always does.
fn restart_idle_readers() {
    if crate::gucs::sidecar_socket().is_none() {
        return;
    }
    let pids: Vec<i32> = spi::rows(
        "SELECT DISTINCT a.pid::text FROM pg_catalog.pg_stat_activity a \
           JOIN pg_catalog.pg_locks l ON l.pid = a.pid \
          WHERE a.datname = pg_catalog.current_database() AND a.pid <> pg_catalog.pg_backend_pid() \
            AND a.state = 'idle in transaction' AND a.backend_xid IS NULL \
            AND l.locktype = 'relation' AND l.granted",
        vec![],
    )
    .into_iter()
    .filter_map(|r| r.into_iter().next().flatten()?.parse().ok())
    .collect();
    if pids.is_empty() {
        return;
    }
    match crate::sidecar::restart_idle_readers(pids) {
        Ok(done) if !done.is_empty() => {
            pgrx::debug1!("restarted idle readers {done:?} for a schema change")
        }
        Ok(_) => {}
        Err(e) => pgrx::debug1!("cannot restart idle readers: {e}"),
    }
}

/// A function cannot run `CREATE DATABASE`; the equivalent is to create the database with
/// PostgreSQL's statement and run this one connected to it, which configures its regions.
#[allow(clippy::too_many_arguments)]
fn create_database(
    name: &str,
    if_not_exists: bool,
    primary_region: Option<&str>,
    regions: &[String],
    survival: Option<mr_sql::SurvivalGoal>,
    placement: Option<mr_sql::Placement>,
    secondary_region: Option<&str>,
    effect: &mut Effect,
) -> Result<(), MrError> {
    mr_zoneconfig::ddl::check_create_database(primary_region, regions, survival)
        .map_err(MrError::Ddl)?;
    let current = catalog::database_name();
    let exists = spi::flag(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_database WHERE datname = $1)::text",
        vec![name.into()],
    );
    if name != current {
        return Err(MrError::CreateDatabaseInFunction {
            name: name.to_string(),
            exists,
        });
    }
    if catalog::load(false).0.is_some() {
        if if_not_exists {
            pgrx::notice!("database \"{name}\" already exists, skipping");
            return Ok(());
        }
        return Err(MrError::DatabaseExists(name.to_string()));
    }
    require_current(name)?;
    let Some(primary) = primary_region else {
        return Ok(());
    };
    use mr_sql::Statement as S;
    let database = name.to_string();
    let mut steps = vec![S::AlterDatabasePrimaryRegion {
        database: database.clone(),
        region: primary.to_string(),
    }];
    for r in regions.iter().filter(|r| r.as_str() != primary) {
        steps.push(S::AlterDatabaseAddRegion {
            database: database.clone(),
            region: r.clone(),
            if_not_exists: false,
        });
    }
    if let Some(goal) = survival {
        steps.push(S::AlterDatabaseSurvival {
            database: database.clone(),
            goal,
        });
    }
    if let Some(placement) = placement {
        steps.push(S::AlterDatabasePlacement {
            database: database.clone(),
            placement,
        });
    }
    if let Some(s) = secondary_region {
        steps.push(S::AlterDatabaseSecondaryRegion {
            database: database.clone(),
            region: Some(s.to_string()),
        });
    }
    for step in &steps {
        run_database_statement(step, effect)?;
    }
    Ok(())
}
