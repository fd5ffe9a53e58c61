//! Schema changes through the meta Raft group. The statement that ran here is the change:
//! every other node's pgmr hands it, in log order, to `multiregion.apply_schema_change`, which
//! runs it with the same search path and role. The proposal is a compare-and-set on the
//! database's schema version, so two nodes changing one database at once cannot both win.

use super::{catalog, execute, spi, Origin};
use crate::error::{MrError, OrRaise};
use crate::{gucs, sidecar};
use mr_meta::{DatabaseConfig, TableLocality, TableRef};
use pgrx::pg_sys;
use pgrx::prelude::*;
use serde::{Deserialize, Serialize};
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

/// The database's replicated tables: every permanent table that is not a partition (a REGIONAL
/// BY ROW table's partitions are ranges of their table), outside PostgreSQL's and the
/// extension's own schemas (global key tables are derived on each node) and not the
/// extension's.
const TABLES: &str = "SELECT n.nspname::text, c.relname::text \
    FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
    WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition AND c.relpersistence <> 't' \
      AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'multiregion', 'multiregion_keys') \
      AND n.nspname NOT LIKE 'pg\\_%' \
      AND NOT EXISTS (SELECT FROM pg_catalog.pg_depend d \
        WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.objid = c.oid AND d.deptype = 'e') \
    ORDER BY 1, 2";

/// Proposes `sql` as the change after `version`, then waits for every other live node.
/// Without pgmr (`multiregion.sidecar_socket` unset) the node is on its own: nothing to do.
pub(super) fn propose(
    sql: &str,
    version: i64,
    config: Option<&DatabaseConfig>,
    localities: &[(String, String, Option<TableLocality>)],
) -> Result<(), MrError> {
    if gucs::sidecar_socket().is_none() {
        return Ok(());
    }
    let database = catalog::database_name();
    let record = ChangeRecord {
        sql: sql.to_string(),
        search_path: spi::one("SELECT pg_catalog.current_setting('search_path')", vec![])
            .unwrap_or_default(),
        role: spi::one("SELECT current_user::text", vec![]).unwrap_or_default(),
        auto_rehoming: gucs::enable_auto_rehoming(),
        gateway_region: crate::routing::gateway_region_override()
            .or_else(|| gucs::locality().ok().map(|l| l.region().to_owned())),
    };
    let change = serde_json::to_string(&record).expect("a change record serializes");
    let localities = localities
        .iter()
        .map(|(schema, table, l)| {
            let t = TableRef {
                database: database.clone(),
                schema: schema.clone(),
                table: table.clone(),
            };
            (t, l.clone())
        })
        .collect();
    let expected = u64::try_from(version).unwrap_or(0);
    let tables = spi::rows(TABLES, vec![])
        .into_iter()
        .filter_map(|r| {
            Some(TableRef {
                database: database.clone(),
                schema: r.first()?.clone()?,
                table: r.get(1)?.clone()?,
            })
        })
        .collect();
    let new = sidecar::propose_schema_change(
        database.clone(),
        expected,
        change,
        config.cloned(),
        localities,
        tables,
    )?;
    // The change is committed: a node that is slow to apply it gets a warning, not an error
    // that would undo the change here while the others go on to apply it.
    if let Err(e) = sidecar::await_schema_applied(database, new, APPLY_TIMEOUT) {
        pgrx::warning!("{e}");
    }
    Ok(())
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
    let record: ChangeRecord =
        serde_json::from_str(change).map_err(|e| MrError::BadChange(e.to_string()))?;
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
    let (_, now) = catalog::load(false);
    if now != version {
        // The statement changed nothing here (e.g. IF NOT EXISTS found it done): record it.
        let (config, _) = catalog::load(true);
        spi::as_extension_owner(|| catalog::store(config.as_ref(), version));
    }
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

/// The text of a utility statement a client ran at top level, if it is a schema change that
/// every node must also make. Statements run by functions (`multiregion.execute`, the applier,
/// a DO block) are not top level, so they are never replicated twice.
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run and `query_string` its source text.
#[allow(unsafe_code)]
pub(crate) unsafe fn replicated_ddl(
    pstmt: &pg_sys::PlannedStmt,
    query_string: *const std::ffi::c_char,
) -> Option<String> {
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
            | T_CreateTableAsStmt => {}
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
        Some(
            String::from_utf8_lossy(&text[start..end])
                .trim()
                .to_string(),
        )
    }
}

/// Replicates a schema change a client just made here, in a database of the cluster (one with
/// the extension, not a template): the local change and the proposal commit or fail together
/// as far as the client is concerned; a transaction rolled back after the proposal still sees
/// the change arrive, through this node's own applier.
pub(crate) fn replicate_ddl(sql: &str) {
    let eligible = spi::one(
        "SELECT (NOT d.datistemplate AND EXISTS \
           (SELECT FROM pg_catalog.pg_extension WHERE extname = 'pg_multiregion'))::text \
         FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database()",
        vec![],
    );
    if eligible.as_deref() != Some("true") {
        return;
    }
    let effect = super::Effect {
        changed: true,
        ..Default::default()
    };
    super::finish(effect, sql, Origin::User).or_raise();
}
