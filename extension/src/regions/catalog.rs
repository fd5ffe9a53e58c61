//! Reads and writes of this database's multi-region catalog (`catalog.sql`).

use super::spi::{self, one, rows, run_with};
use mr_meta::{DatabaseConfig, Placement, SurvivalGoal, TableLocality};
use pgrx::pg_sys::{self, Oid};

pub fn database_name() -> String {
    spi::read_one("SELECT pg_catalog.current_database()::text", vec![]).unwrap_or_default()
}

/// The database's configuration, `None` if it is not multi-region; and its schema version.
/// `lock` takes the row for update, so that concurrent changes on this node serialize.
pub fn load(lock: bool) -> (Option<DatabaseConfig>, i64) {
    let sql = format!(
        "SELECT primary_region, array_to_string(regions, chr(1)), survival_goal, placement, \
         secondary_region, schema_version::text FROM multiregion.database_config {}",
        if lock { "FOR UPDATE" } else { "" }
    );
    let row = if lock {
        rows(&sql, vec![])
    } else {
        spi::read_rows(&sql, vec![])
    };
    let row = row.into_iter().next().unwrap_or_default();
    let get = |i: usize| row.get(i).cloned().flatten();
    let version = get(5).and_then(|v| v.parse().ok()).unwrap_or(0);
    let Some(primary_region) = get(0) else {
        return (None, version);
    };
    let regions = get(1)
        .unwrap_or_default()
        .split('\u{1}')
        .filter(|r| !r.is_empty())
        .map(str::to_string)
        .collect();
    let config = DatabaseConfig {
        database: database_name(),
        primary_region,
        regions,
        survival: if get(2).as_deref() == Some("region") {
            SurvivalGoal::Region
        } else {
            SurvivalGoal::Zone
        },
        placement: if get(3).as_deref() == Some("restricted") {
            Placement::Restricted
        } else {
            Placement::Default
        },
        secondary_region: get(4),
    };
    (Some(config), version)
}

pub fn survival_str(s: SurvivalGoal) -> &'static str {
    match s {
        SurvivalGoal::Zone => "zone",
        SurvivalGoal::Region => "region",
    }
}

pub fn placement_str(p: Placement) -> &'static str {
    match p {
        Placement::Default => "default",
        Placement::Restricted => "restricted",
    }
}

/// Stores `config` (`None`: not multi-region) as schema version `version`.
pub fn store(config: Option<&DatabaseConfig>, version: i64) {
    match config {
        Some(c) => run_with(
            "UPDATE multiregion.database_config SET primary_region = $1, \
             regions = pg_catalog.string_to_array($2, chr(1)), survival_goal = $3, placement = $4, \
             secondary_region = $5, schema_version = $6",
            vec![
                c.primary_region.as_str().into(),
                c.regions
                    .iter()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join("\u{1}")
                    .into(),
                survival_str(c.survival).into(),
                placement_str(c.placement).into(),
                c.secondary_region.clone().into(),
                version.into(),
            ],
        ),
        None => run_with(
            "UPDATE multiregion.database_config SET primary_region = NULL, regions = '{}', \
             survival_goal = 'zone', placement = 'default', secondary_region = NULL, \
             schema_version = $1",
            vec![version.into()],
        ),
    }
}

/// A table's locality as recorded; tables without a row are REGIONAL BY TABLE IN PRIMARY
/// REGION.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalityRow {
    pub locality: TableLocality,
    pub hidden: bool,
    /// For `REGIONAL BY ROW AS` a computed column: its expression as SQL text.
    pub region_expr_sql: Option<String>,
    pub auto_rehoming: bool,
}

pub fn locality(relid: Oid) -> LocalityRow {
    let row = spi::read_rows(
        "SELECT locality, region, region_column::text, hidden::text, region_expr_sql, \
         auto_rehoming::text FROM multiregion.table_locality WHERE relid = $1",
        vec![relid.into()],
    )
    .into_iter()
    .next();
    let Some(row) = row else {
        return LocalityRow {
            locality: TableLocality::RegionalByTable { region: None },
            hidden: false,
            region_expr_sql: None,
            auto_rehoming: false,
        };
    };
    let get = |i: usize| row.get(i).cloned().flatten();
    let locality = match get(0).as_deref() {
        Some("global") => TableLocality::Global,
        Some("regional_by_row") => TableLocality::RegionalByRow {
            column: get(2).unwrap_or_default(),
        },
        _ => TableLocality::RegionalByTable { region: get(1) },
    };
    LocalityRow {
        locality,
        hidden: get(3).as_deref() == Some("true"),
        region_expr_sql: get(4),
        auto_rehoming: get(5).as_deref() == Some("true"),
    }
}

pub fn store_locality(relid: Oid, row: &LocalityRow, region_expr: Option<&str>) {
    invalidate(relid);
    run_with(
        "DELETE FROM multiregion.table_locality WHERE relid = $1",
        vec![relid.into()],
    );
    if row.locality == (TableLocality::RegionalByTable { region: None }) {
        return;
    }
    let (kind, region, column) = match &row.locality {
        TableLocality::Global => ("global", None, None),
        TableLocality::RegionalByTable { region } => ("regional_by_table", region.clone(), None),
        TableLocality::RegionalByRow { column } => ("regional_by_row", None, Some(column.clone())),
    };
    run_with(
        "INSERT INTO multiregion.table_locality \
         (relid, locality, region, region_column, hidden, region_expr, region_expr_sql, auto_rehoming) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        vec![
            relid.into(),
            kind.into(),
            region.into(),
            column.into(),
            row.hidden.into(),
            region_expr.map(str::to_string).into(),
            row.region_expr_sql.clone().into(),
            row.auto_rehoming.into(),
        ],
    );
}

/// Every table with a recorded locality, as (relid, qualified name, row).
pub fn all_localities() -> Vec<(Oid, String, LocalityRow)> {
    rows(
        "SELECT l.relid::text, l.relid::regclass::text FROM multiregion.table_locality l \
         JOIN pg_catalog.pg_class c ON c.oid = l.relid ORDER BY 2",
        vec![],
    )
    .into_iter()
    .filter_map(|r| {
        let oid: u32 = r.first()?.as_ref()?.parse().ok()?;
        let relid = Oid::from(oid);
        Some((relid, r.get(1)?.clone()?, locality(relid)))
    })
    .collect()
}

/// Tables that are REGIONAL BY ROW, as (relid, qualified name, region column).
pub fn rbr_tables() -> Vec<(Oid, String, String)> {
    all_localities()
        .into_iter()
        .filter_map(|(relid, name, row)| match row.locality {
            TableLocality::RegionalByRow { column } => Some((relid, name, column)),
            _ => None,
        })
        .collect()
}

/// The name of the partition of `table` (unqualified) that holds `region`.
pub fn partition_name(table: &str, region: &str) -> String {
    let region: String = region
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    let mut name = format!("{table}_{region}");
    while name.len() > 63 {
        name.pop();
    }
    name
}

pub fn quoted_regions(config: &DatabaseConfig) -> String {
    spi::text_array(config.regions.iter())
}

/// Makes every backend forget what it cached about `relid` (the rewrite of statements on
/// REGIONAL BY ROW tables reads the locality once per backend), once this transaction commits.
#[allow(unsafe_code)]
fn invalidate(relid: Oid) {
    // A dropped relation (the old one, after a rebuild) was invalidated by its drop.
    let exists = one(
        "SELECT EXISTS (SELECT FROM pg_catalog.pg_class WHERE oid = $1)::text",
        vec![relid.into()],
    );
    if exists.as_deref() == Some("true") {
        // SAFETY: queues a relcache invalidation for a relation that exists; PostgreSQL
        // delivers it at command end and at commit, to every backend.
        unsafe { pg_sys::CacheInvalidateRelcacheByRelid(relid) }
    }
}

/// The relation a RangeVar names, without locking it; `None` when there is none.
///
/// # Safety
/// `rv` is a valid RangeVar, in a transaction.
#[allow(unsafe_code)]
pub(crate) unsafe fn relid_of(rv: *mut pg_sys::RangeVar) -> Option<pg_sys::Oid> {
    // SAFETY: as this function's contract; a missing relation is InvalidOid, not an error.
    let oid = unsafe {
        pg_sys::RangeVarGetRelidExtended(
            rv,
            pg_sys::NoLock as pg_sys::LOCKMODE,
            pg_sys::RVROption::RVR_MISSING_OK,
            None,
            std::ptr::null_mut(),
        )
    };
    (oid != pg_sys::InvalidOid).then_some(oid)
}
