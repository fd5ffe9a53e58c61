//! Zone configurations derived from declarative multi-region settings (CockroachDB 2022 paper
//! §3.3): given a database's regions, survival goal and placement, and a table's locality (or
//! one partition of a REGIONAL BY ROW table), where its replicas, voters and leaseholder go.
//!
//! The rules, with `N` database regions and home region `H`:
//!
//! * **Home region.** GLOBAL: the primary region. REGIONAL BY TABLE: its region (the primary
//!   region when `IN PRIMARY REGION`). A REGIONAL BY ROW partition: the partition's region; the
//!   table as a whole: the primary region.
//! * **ZONE survival** (default): 3 voters, all in `H` (spread over its zones by the allocator),
//!   and one non-voter in every other region: `num_replicas = 3 + (N - 1)`.
//! * **REGION survival** (needs `N >= 3`): 5 voters, 2 of them in `H`, and at least one replica
//!   in every region: `num_replicas = max(5, 2 + (N - 1))`.
//! * **PLACEMENT RESTRICTED** (ZONE survival only): REGIONAL tables keep every replica in `H`
//!   (`num_replicas = 3`, no non-voters elsewhere); GLOBAL tables are not affected.
//! * **Leaseholder** in `H`; with a secondary region `S != H`, `S` is the second preference
//!   and, under REGION survival, also holds 2 voters, so the lease can move there without
//!   leaving the quorum.
//! * **GLOBAL** tables also serve non-blocking reads everywhere (`global_reads = true`).
//!
//! The SQL forms follow CockroachDB's `SHOW ZONE CONFIGURATION` output, so the two can be
//! compared line by line.

pub mod allocate;
pub mod ddl;
pub mod overrides;

use mr_meta::{DatabaseConfig, Placement, SurvivalGoal, TableLocality};
use std::collections::BTreeMap;
use std::fmt::Write;

/// CockroachDB's defaults for the size and GC fields every zone configuration prints.
pub const RANGE_MIN_BYTES: u64 = 134_217_728;
pub const RANGE_MAX_BYTES: u64 = 536_870_912;
pub const GC_TTL_SECONDS: u64 = 90_000;

/// Where a zone configuration applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target<'a> {
    /// The database itself: what tables without their own configuration inherit.
    Database,
    /// A table with its locality (for REGIONAL BY ROW, the table as a whole).
    Table(&'a TableLocality),
    /// One region's partition of a REGIONAL BY ROW table.
    Partition { region: &'a str },
}

/// Replica placement constraints on the `region` tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Constraints {
    /// Every replica in each listed region (`'[+region=a]'`).
    All(Vec<String>),
    /// At least this many replicas per region, the rest placed freely (`'{+region=a: 1}'`).
    PerRegion(BTreeMap<String, u32>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZoneConfig {
    pub home_region: String,
    pub num_replicas: u32,
    pub num_voters: u32,
    pub constraints: Constraints,
    pub voter_constraints: Constraints,
    /// In order of preference; each inner list is one conjunction of `+region=` tiers.
    pub lease_preferences: Vec<String>,
    pub global_reads: bool,
    /// CockroachDB's GC and range-size fields: printed, and settable by `CONFIGURE ZONE`
    /// (PostgreSQL's own vacuum and a range per table or partition make them informational).
    pub gc_ttl_seconds: u64,
    pub range_min_bytes: u64,
    pub range_max_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ZoneConfigError {
    #[error("database has no regions")]
    NoRegions,
    #[error("region {region:?} is not a region of the database")]
    UnknownRegion { region: String },
    #[error("at least 3 regions are required for surviving a region failure")]
    TooFewRegionsForRegionSurvival,
    #[error("PLACEMENT RESTRICTED can only be used with SURVIVE ZONE FAILURE")]
    RestrictedWithRegionSurvival,
}

/// The zone configuration for `target` in database `db`.
pub fn zone_config(db: &DatabaseConfig, target: Target<'_>) -> Result<ZoneConfig, ZoneConfigError> {
    let n = db.regions.len() as u32;
    if n == 0 {
        return Err(ZoneConfigError::NoRegions);
    }
    let known = |r: &str| -> Result<String, ZoneConfigError> {
        if db.regions.contains(r) {
            Ok(r.to_string())
        } else {
            Err(ZoneConfigError::UnknownRegion {
                region: r.to_string(),
            })
        }
    };
    let primary = known(&db.primary_region)?;
    let (home, regional) = match target {
        Target::Database => (primary, false),
        Target::Table(TableLocality::Global) => (primary, false),
        Target::Table(TableLocality::RegionalByTable { region: None }) => (primary, true),
        Target::Table(TableLocality::RegionalByTable { region: Some(r) }) => (known(r)?, true),
        Target::Table(TableLocality::RegionalByRow { .. }) => (primary, true),
        Target::Partition { region } => (known(region)?, true),
    };
    let global_reads = matches!(target, Target::Table(TableLocality::Global));
    let secondary = db
        .secondary_region
        .as_deref()
        .filter(|s| *s != home && db.regions.contains(*s));
    let mut lease_preferences = vec![home.clone()];
    lease_preferences.extend(secondary.map(str::to_string));
    let one_per_region =
        || Constraints::PerRegion(db.regions.iter().map(|r| (r.clone(), 1)).collect());

    let config = match (db.survival, db.placement) {
        (SurvivalGoal::Region, _) if n < 3 => {
            return Err(ZoneConfigError::TooFewRegionsForRegionSurvival)
        }
        (SurvivalGoal::Region, Placement::Restricted) => {
            return Err(ZoneConfigError::RestrictedWithRegionSurvival)
        }
        (SurvivalGoal::Region, Placement::Default) => {
            let mut voters = BTreeMap::from([(home.clone(), 2)]);
            if let Some(s) = secondary {
                voters.insert(s.to_string(), 2);
            }
            ZoneConfig {
                num_replicas: 5.max(2 + (n - 1)),
                num_voters: 5,
                constraints: one_per_region(),
                voter_constraints: Constraints::PerRegion(voters),
                home_region: home,
                lease_preferences,
                global_reads,
                ..ZoneConfig::sizes()
            }
        }
        (SurvivalGoal::Zone, Placement::Restricted) if regional => ZoneConfig {
            num_replicas: 3,
            num_voters: 3,
            constraints: Constraints::All(vec![home.clone()]),
            voter_constraints: Constraints::All(vec![home.clone()]),
            home_region: home,
            lease_preferences,
            global_reads,
            ..ZoneConfig::sizes()
        },
        (SurvivalGoal::Zone, _) => ZoneConfig {
            num_replicas: 3 + (n - 1),
            num_voters: 3,
            constraints: one_per_region(),
            voter_constraints: Constraints::All(vec![home.clone()]),
            home_region: home,
            lease_preferences,
            global_reads,
            ..ZoneConfig::sizes()
        },
    };
    Ok(config)
}

fn region(r: &str) -> String {
    format!("+region={r}")
}

impl Constraints {
    /// CockroachDB's text form, as it appears inside the quotes of `constraints = '…'`.
    pub fn to_crdb(&self) -> String {
        match self {
            Constraints::All(rs) => {
                let items: Vec<String> = rs.iter().map(|r| region(r)).collect();
                format!("[{}]", items.join(", "))
            }
            Constraints::PerRegion(m) => {
                let items: Vec<String> = m
                    .iter()
                    .map(|(r, c)| format!("{}: {c}", region(r)))
                    .collect();
                format!("{{{}}}", items.join(", "))
            }
        }
    }
}

impl ZoneConfig {
    /// CockroachDB's default GC and size fields over an empty placement, for `..` filling.
    fn sizes() -> ZoneConfig {
        ZoneConfig {
            home_region: String::new(),
            num_replicas: 0,
            num_voters: 0,
            constraints: Constraints::PerRegion(BTreeMap::new()),
            voter_constraints: Constraints::PerRegion(BTreeMap::new()),
            lease_preferences: vec![],
            global_reads: false,
            gc_ttl_seconds: GC_TTL_SECONDS,
            range_min_bytes: RANGE_MIN_BYTES,
            range_max_bytes: RANGE_MAX_BYTES,
        }
    }

    /// `lease_preferences` as CockroachDB prints it: `[[+region=a], [+region=b]]`.
    pub fn lease_preferences_crdb(&self) -> String {
        let items: Vec<String> = self
            .lease_preferences
            .iter()
            .map(|r| format!("[{}]", region(r)))
            .collect();
        format!("[{}]", items.join(", "))
    }

    /// The `raw_config_sql` column of `SHOW ZONE CONFIGURATION`: `ALTER <target> CONFIGURE
    /// ZONE USING` with one field per line, as CockroachDB prints it. `target_sql` is the part
    /// after ALTER, e.g. `DATABASE movr` or `PARTITION "us-east1" OF INDEX movr.public.users@users_pkey`.
    pub fn raw_config_sql(&self, target_sql: &str) -> String {
        let mut s = format!("ALTER {target_sql} CONFIGURE ZONE USING\n");
        let fields = self.fields();
        let last = fields.len() - 1;
        for (i, f) in fields.iter().enumerate() {
            let _ = write!(s, "\t{f}{}", if i == last { "" } else { ",\n" });
        }
        s
    }

    /// The fields a REGIONAL BY ROW partition's own zone configuration sets (the rest it
    /// inherits from its table), as `SHOW PARTITIONS` prints its `zone_config`.
    pub fn partition_fields(&self) -> Vec<String> {
        self.fields()
            .into_iter()
            .filter(|f| {
                f.starts_with("num_voters")
                    || f.starts_with("voter_constraints")
                    || f.starts_with("lease_preferences")
            })
            .collect()
    }

    /// Every field of the configuration, `name = value`, in CockroachDB's order.
    pub fn fields(&self) -> Vec<String> {
        let mut fields = vec![
            format!("range_min_bytes = {}", self.range_min_bytes),
            format!("range_max_bytes = {}", self.range_max_bytes),
            format!("gc.ttlseconds = {}", self.gc_ttl_seconds),
        ];
        if self.global_reads {
            fields.push("global_reads = true".into());
        }
        fields.push(format!("num_replicas = {}", self.num_replicas));
        fields.push(format!("num_voters = {}", self.num_voters));
        fields.push(format!("constraints = '{}'", self.constraints.to_crdb()));
        fields.push(format!(
            "voter_constraints = '{}'",
            self.voter_constraints.to_crdb()
        ));
        fields.push(format!(
            "lease_preferences = '{}'",
            self.lease_preferences_crdb()
        ));
        fields
    }
}

/// The ranges of a table and the zone configuration of each: one for the whole table, or one
/// per region partition of a REGIONAL BY ROW table (`Some(region)`). `db` is `None` for a
/// database without regions (CockroachDB's default configuration); a table of a
/// multi-region database without a recorded locality is REGIONAL BY TABLE IN PRIMARY REGION,
/// as CockroachDB makes every table there. GLOBAL tables are placed and leased like
/// REGIONAL BY TABLE IN PRIMARY REGION until non-blocking reads exist.
pub fn table_ranges(
    db: Option<&DatabaseConfig>,
    locality: Option<&TableLocality>,
) -> Result<Vec<(Option<String>, ZoneConfig)>, ZoneConfigError> {
    let Some(db) = db else {
        return Ok(vec![(None, allocate::cluster_default())]);
    };
    let default = TableLocality::RegionalByTable { region: None };
    match locality.unwrap_or(&default) {
        TableLocality::RegionalByRow { .. } => db
            .regions
            .iter()
            .map(|r| {
                Ok((
                    Some(r.clone()),
                    zone_config(db, Target::Partition { region: r })?,
                ))
            })
            .collect(),
        l => Ok(vec![(None, zone_config(db, Target::Table(l))?)]),
    }
}
