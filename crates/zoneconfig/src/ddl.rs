//! The rules of the region DDL (CockroachDB 2022 paper §2, and CockroachDB's documented
//! behaviour): what each database-level statement does to a [`DatabaseConfig`], and which
//! statements are refused, with CockroachDB's messages, hints and SQLSTATEs.
//!
//! Pure: the caller supplies what it read (the cluster's regions, the tables homed in a region)
//! and applies the result. Checks that need the data itself (rows still using a region) are the
//! caller's.

use mr_meta::{DatabaseConfig, Placement, SurvivalGoal, TableLocality};
use std::collections::BTreeSet;
use std::fmt::Write as _;

/// A refused statement. `sqlstate` is PostgreSQL's five-character code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct DdlError {
    pub sqlstate: &'static str,
    pub message: String,
    pub hint: Option<String>,
}

/// What a statement does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The database's new configuration.
    Set(DatabaseConfig),
    /// The database stops being multi-region (its last region was dropped).
    Unset,
    /// Nothing to do (`IF [NOT] EXISTS`); the notice to print.
    Skip(String),
}

pub const INVALID_NAME: &str = "42602";
pub const UNDEFINED_OBJECT: &str = "42704";
pub const DUPLICATE_OBJECT: &str = "42710";
pub const INVALID_DATABASE_DEFINITION: &str = "42P12";
pub const INVALID_TABLE_DEFINITION: &str = "42P16";
pub const INVALID_PARAMETER_VALUE: &str = "22023";
pub const DEPENDENT_OBJECTS_STILL_EXIST: &str = "2BP01";
pub const WRONG_OBJECT_TYPE: &str = "42809";

fn err(sqlstate: &'static str, message: String, hint: Option<String>) -> DdlError {
    DdlError {
        sqlstate,
        message,
        hint,
    }
}

/// Regions are identifiers in CockroachDB's statements; they print double-quoted.
fn q(region: &str) -> String {
    format!("\"{}\"", region.replace('"', "\"\""))
}

/// A region must be one that nodes were started in (`SHOW REGIONS FROM CLUSTER`).
pub fn check_cluster_region(cluster: &BTreeSet<String>, region: &str) -> Result<(), DdlError> {
    if cluster.contains(region) {
        return Ok(());
    }
    let valid: Vec<&str> = cluster.iter().map(String::as_str).collect();
    Err(err(
        INVALID_NAME,
        format!("region {} does not exist", q(region)),
        Some(if valid.is_empty() {
            "no regions are available: start nodes with --locality region=<name>".to_string()
        } else {
            format!("valid regions: {}", valid.join(", "))
        }),
    ))
}

/// `CREATE DATABASE db [PRIMARY REGION r] [REGIONS …] [SURVIVE …]`: what CockroachDB refuses
/// before it creates anything (a survival goal or regions without a primary region, a region
/// listed twice), so that neither door creates a database it then cannot configure.
pub fn check_create_database(
    primary_region: Option<&str>,
    regions: &[String],
    survival: Option<SurvivalGoal>,
) -> Result<(), DdlError> {
    if primary_region.is_none() && survival.is_some() {
        return Err(err(
            INVALID_DATABASE_DEFINITION,
            "PRIMARY REGION must be specified when using SURVIVE".to_string(),
            None,
        ));
    }
    if primary_region.is_none() && !regions.is_empty() {
        return Err(err(
            INVALID_DATABASE_DEFINITION,
            "PRIMARY REGION must be specified if REGIONS are specified".to_string(),
            None,
        ));
    }
    let mut seen = BTreeSet::new();
    match regions.iter().find(|r| !seen.insert(r.as_str())) {
        Some(twice) => Err(err(
            INVALID_NAME,
            format!("region {} defined multiple times", q(twice)),
            None,
        )),
        None => Ok(()),
    }
}

/// `ALTER DATABASE db [SET] PRIMARY REGION r`; the first one makes the database multi-region.
pub fn set_primary_region(
    db: Option<&DatabaseConfig>,
    database: &str,
    cluster: &BTreeSet<String>,
    region: &str,
) -> Result<Change, DdlError> {
    check_cluster_region(cluster, region)?;
    match db {
        None => Ok(Change::Set(DatabaseConfig {
            database: database.to_string(),
            primary_region: region.to_string(),
            regions: BTreeSet::from([region.to_string()]),
            survival: SurvivalGoal::Zone,
            placement: Placement::Default,
            secondary_region: None,
        })),
        Some(db) if !db.regions.contains(region) => Err(err(
            INVALID_DATABASE_DEFINITION,
            format!("region {} has not been added to the database", q(region)),
            Some(format!(
                "you must add the region to the database before setting it as primary region, \
                 using ALTER DATABASE {database} ADD REGION {}",
                q(region)
            )),
        )),
        Some(db) if db.secondary_region.as_deref() == Some(region) => Err(err(
            INVALID_DATABASE_DEFINITION,
            format!(
                "region {} is currently the secondary region and cannot also be the primary region",
                q(region)
            ),
            Some(format!(
                "remove the secondary region using ALTER DATABASE {database} DROP SECONDARY REGION first"
            )),
        )),
        Some(db) => {
            let mut next = db.clone();
            next.primary_region = region.to_string();
            Ok(Change::Set(next))
        }
    }
}

/// `ALTER DATABASE db ADD REGION [IF NOT EXISTS] r`.
pub fn add_region(
    db: Option<&DatabaseConfig>,
    database: &str,
    cluster: &BTreeSet<String>,
    region: &str,
    if_not_exists: bool,
) -> Result<Change, DdlError> {
    let Some(db) = db else {
        return Err(err(
            INVALID_DATABASE_DEFINITION,
            format!("cannot add region {} to database {database}", q(region)),
            Some(format!(
                "you must select a primary region using ALTER DATABASE {database} PRIMARY REGION {} \
                 before adding regions",
                q(region)
            )),
        ));
    };
    check_cluster_region(cluster, region)?;
    if db.regions.contains(region) {
        return if if_not_exists {
            Ok(Change::Skip(format!(
                "region {} already exists in database {database}; skipping",
                q(region)
            )))
        } else {
            Err(err(
                DUPLICATE_OBJECT,
                format!("region {} already added to database", q(region)),
                None,
            ))
        };
    }
    let mut next = db.clone();
    next.regions.insert(region.to_string());
    Ok(Change::Set(next))
}

/// `ALTER DATABASE db DROP REGION [IF EXISTS] r`. `homed_tables` are the REGIONAL BY TABLE
/// tables whose home is `r`; rows of REGIONAL BY ROW tables in `r` are the caller's to check.
pub fn drop_region(
    db: Option<&DatabaseConfig>,
    database: &str,
    region: &str,
    if_exists: bool,
    homed_tables: &[String],
) -> Result<Change, DdlError> {
    let missing = || {
        if if_exists {
            Ok(Change::Skip(format!(
                "region {} is not defined on the database; skipping",
                q(region)
            )))
        } else {
            Err(err(
                UNDEFINED_OBJECT,
                format!("region {} has not been added to the database", q(region)),
                None,
            ))
        }
    };
    let Some(db) = db else { return missing() };
    if !db.regions.contains(region) {
        return missing();
    }
    if db.primary_region == region && db.regions.len() > 1 {
        return Err(err(
            INVALID_DATABASE_DEFINITION,
            format!("cannot drop region {}", q(region)),
            Some(format!(
                "You must designate another region as the primary region using ALTER DATABASE \
                 {database} PRIMARY REGION <region name> or remove all other regions before \
                 attempting to drop region {}",
                q(region)
            )),
        ));
    }
    if db.secondary_region.as_deref() == Some(region) {
        return Err(err(
            INVALID_DATABASE_DEFINITION,
            format!("cannot drop region {}", q(region)),
            Some(format!(
                "You must designate another region as the secondary region using ALTER DATABASE \
                 {database} SECONDARY REGION <region name> or remove the secondary region using \
                 ALTER DATABASE {database} DROP SECONDARY REGION in order to drop region {}",
                q(region)
            )),
        ));
    }
    if db.survival == SurvivalGoal::Region && db.regions.len() <= 3 {
        return Err(too_few_regions(database));
    }
    if let Some(table) = homed_tables.first() {
        return Err(err(
            DEPENDENT_OBJECTS_STILL_EXIST,
            format!(
                "could not remove enum value {} as it is the home region for table {table:?}",
                q(region)
            ),
            Some(format!(
                "change the locality of table {table:?} with ALTER TABLE ... SET LOCALITY before \
                 dropping region {}",
                q(region)
            )),
        ));
    }
    if db.regions.len() == 1 {
        return Ok(Change::Unset);
    }
    let mut next = db.clone();
    next.regions.remove(region);
    Ok(Change::Set(next))
}

fn too_few_regions(database: &str) -> DdlError {
    err(
        INVALID_NAME,
        "at least 3 regions are required for surviving a region failure".to_string(),
        Some(format!(
            "you must add additional regions to the database using ALTER DATABASE {database} \
             ADD REGION <region_name>"
        )),
    )
}

fn not_multi_region(database: &str, what: &str) -> DdlError {
    err(
        INVALID_DATABASE_DEFINITION,
        format!("database {database} is not multi-region enabled, so {what} cannot be set"),
        Some(format!(
            "database must first be multi-region enabled using ALTER DATABASE {database} SET \
             PRIMARY REGION <region>"
        )),
    )
}

fn restricted_with_region_survival() -> DdlError {
    err(
        INVALID_PARAMETER_VALUE,
        "a region-survivable database cannot also have a restricted placement policy".to_string(),
        Some("use SURVIVE ZONE FAILURE with PLACEMENT RESTRICTED".to_string()),
    )
}

/// `ALTER DATABASE db SURVIVE { ZONE | REGION } FAILURE`.
pub fn set_survival(
    db: Option<&DatabaseConfig>,
    database: &str,
    goal: SurvivalGoal,
) -> Result<Change, DdlError> {
    let db = db.ok_or_else(|| not_multi_region(database, "a survival goal"))?;
    if goal == SurvivalGoal::Region {
        if db.regions.len() < 3 {
            return Err(too_few_regions(database));
        }
        if db.placement == Placement::Restricted {
            return Err(restricted_with_region_survival());
        }
    }
    let mut next = db.clone();
    next.survival = goal;
    Ok(Change::Set(next))
}

/// `ALTER DATABASE db PLACEMENT { RESTRICTED | DEFAULT }`.
pub fn set_placement(
    db: Option<&DatabaseConfig>,
    database: &str,
    placement: Placement,
) -> Result<Change, DdlError> {
    let db = db.ok_or_else(|| not_multi_region(database, "a placement policy"))?;
    if placement == Placement::Restricted && db.survival == SurvivalGoal::Region {
        return Err(restricted_with_region_survival());
    }
    let mut next = db.clone();
    next.placement = placement;
    Ok(Change::Set(next))
}

/// `ALTER DATABASE db SET SECONDARY REGION r` (`Some`) / `DROP SECONDARY REGION [IF EXISTS]`.
pub fn set_secondary_region(
    db: Option<&DatabaseConfig>,
    database: &str,
    region: Option<&str>,
    if_exists: bool,
) -> Result<Change, DdlError> {
    let db = db.ok_or_else(|| not_multi_region(database, "a secondary region"))?;
    let mut next = db.clone();
    match region {
        Some(r) if !db.regions.contains(r) => Err(err(
            INVALID_DATABASE_DEFINITION,
            format!("region {} has not been added to the database", q(r)),
            Some(format!(
                "you must add the region to the database before setting it as secondary region, \
                 using ALTER DATABASE {database} ADD REGION {}",
                q(r)
            )),
        )),
        Some(r) if r == db.primary_region => Err(err(
            INVALID_DATABASE_DEFINITION,
            format!(
                "the secondary region cannot be the same as the current primary region {}",
                q(r)
            ),
            None,
        )),
        Some(r) => {
            next.secondary_region = Some(r.to_string());
            Ok(Change::Set(next))
        }
        None if db.secondary_region.is_none() => {
            if if_exists {
                Ok(Change::Skip(format!(
                    "database {database} has no secondary region; skipping"
                )))
            } else {
                Err(err(
                    UNDEFINED_OBJECT,
                    format!("database {database} does not have a secondary region"),
                    None,
                ))
            }
        }
        None => {
            next.secondary_region = None;
            Ok(Change::Set(next))
        }
    }
}

/// Whether `locality` may be set on a table of `db`.
pub fn check_locality(
    db: Option<&DatabaseConfig>,
    database: &str,
    locality: &TableLocality,
) -> Result<(), DdlError> {
    let Some(db) = db else {
        return Err(err(
            INVALID_TABLE_DEFINITION,
            "cannot set LOCALITY on a table in a database that is not multi-region enabled"
                .to_string(),
            Some(format!(
                "database must first be multi-region enabled using ALTER DATABASE {database} SET \
                 PRIMARY REGION <region>"
            )),
        ));
    };
    if let TableLocality::RegionalByTable { region: Some(r) } = locality {
        if !db.regions.contains(r) {
            let valid: Vec<&str> = db.regions.iter().map(String::as_str).collect();
            return Err(err(
                INVALID_NAME,
                format!("region {} has not been added to database {database}", q(r)),
                Some(format!(
                    "available regions: {}; add it using ALTER DATABASE {database} ADD REGION {}",
                    valid.join(", "),
                    q(r)
                )),
            ));
        }
    }
    Ok(())
}

/// CockroachDB's `locality` column of `SHOW TABLES` and `SHOW CREATE TABLE`.
pub fn locality_sql(locality: &TableLocality) -> String {
    match locality {
        TableLocality::Global => "GLOBAL".to_string(),
        TableLocality::RegionalByTable { region: None } => {
            "REGIONAL BY TABLE IN PRIMARY REGION".to_string()
        }
        TableLocality::RegionalByTable { region: Some(r) } => {
            format!("REGIONAL BY TABLE IN {}", q(r))
        }
        TableLocality::RegionalByRow { column } if column == "crdb_region" => {
            "REGIONAL BY ROW".to_string()
        }
        TableLocality::RegionalByRow { column } => format!("REGIONAL BY ROW AS {}", q(column)),
    }
}

/// CockroachDB's `SHOW CREATE DATABASE` text: `name_sql` is the database's name as SQL
/// (quoted where it must be), `config` its regions (`None`: a database without regions).
/// Regions are listed in the region type's order (sorted), as CockroachDB lists them.
pub fn create_database_sql(name_sql: &str, config: Option<&DatabaseConfig>) -> String {
    let mut s = format!("CREATE DATABASE {name_sql}");
    let Some(c) = config else {
        return s;
    };
    let regions: Vec<String> = c.regions.iter().map(|r| q(r)).collect();
    let _ = write!(
        s,
        " PRIMARY REGION {} REGIONS = {}",
        q(&c.primary_region),
        regions.join(", ")
    );
    if let Some(r) = &c.secondary_region {
        let _ = write!(s, " SECONDARY REGION {}", q(r));
    }
    s.push_str(match c.survival {
        SurvivalGoal::Zone => " SURVIVE ZONE FAILURE",
        SurvivalGoal::Region => " SURVIVE REGION FAILURE",
    });
    if c.placement == Placement::Restricted {
        s.push_str(" PLACEMENT RESTRICTED");
    }
    s
}
