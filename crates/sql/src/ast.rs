//! The statements this crate understands.

pub use mr_meta::{Placement, SurvivalGoal};

/// A possibly qualified name (`db.schema.table`), each part as written (unquoted parts folded
/// to lower case).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectName(pub Vec<String>);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Locality {
    /// `REGIONAL BY TABLE [IN region | IN PRIMARY REGION]`, also `REGIONAL [IN …]`; `None`
    /// is the primary region.
    RegionalByTable {
        region: Option<String>,
    },
    /// `REGIONAL BY ROW [AS column]`; `None` is the system column `crdb_region`.
    RegionalByRow {
        column: Option<String>,
    },
    Global,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ZoneTarget {
    /// `RANGE default` or no target at all.
    Default,
    Database(String),
    Table(ObjectName),
    /// `PARTITION p OF TABLE t` / `PARTITION p OF INDEX t@i`.
    Partition {
        partition: String,
        table: ObjectName,
        index: Option<String>,
    },
    Index {
        table: ObjectName,
        index: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShowRegions {
    /// `SHOW REGIONS`: every region with nodes, with the current database's use of it.
    All,
    Cluster,
    /// `FROM DATABASE [db]`; `None` is the current database.
    Database(Option<String>),
    AllDatabases,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Statement {
    CreateDatabase {
        name: String,
        if_not_exists: bool,
        primary_region: Option<String>,
        regions: Vec<String>,
        survival: Option<SurvivalGoal>,
        placement: Option<Placement>,
        secondary_region: Option<String>,
    },
    AlterDatabasePrimaryRegion {
        database: String,
        region: String,
    },
    AlterDatabaseAddRegion {
        database: String,
        region: String,
        if_not_exists: bool,
    },
    AlterDatabaseDropRegion {
        database: String,
        region: String,
        if_exists: bool,
    },
    AlterDatabaseSurvival {
        database: String,
        goal: SurvivalGoal,
    },
    AlterDatabasePlacement {
        database: String,
        placement: Placement,
    },
    AlterDatabaseSecondaryRegion {
        database: String,
        region: Option<String>,
    },
    /// `CREATE TABLE … LOCALITY …`: `sql` is the statement without the LOCALITY clause (and
    /// with computed columns rewritten), for PostgreSQL; the locality is applied after it.
    CreateTable {
        table: ObjectName,
        sql: String,
        locality: Option<Locality>,
        /// CockroachDB's inline indexes, as `CREATE INDEX` statements to run after `sql`.
        indexes: Vec<String>,
    },
    /// CockroachDB's `CREATE INDEX` forms (`INVERTED`, `STORING`, `USING HASH`) as
    /// PostgreSQL's statements, run in order.
    CreateIndex {
        statements: Vec<String>,
    },
    /// `ALTER target CONFIGURE ZONE USING field = value, …` (`fields`: each field with its
    /// value as written, `None` for `COPY FROM PARENT`) or `… CONFIGURE ZONE DISCARD`
    /// (`fields: None`).
    ConfigureZone {
        target: ZoneTarget,
        fields: Option<Vec<(String, Option<String>)>>,
    },
    /// `ALTER TABLE t ALTER PRIMARY KEY USING COLUMNS (…) [USING HASH …]`.
    AlterPrimaryKey {
        table: ObjectName,
        columns: Vec<String>,
        /// Hash-sharded with this many buckets.
        bucket_count: Option<u32>,
    },
    /// `ALTER TABLE [IF EXISTS] t SET LOCALITY …`.
    AlterTableSetLocality {
        table: ObjectName,
        locality: Locality,
        if_exists: bool,
    },
    /// A statement PostgreSQL runs once rewritten (`ALTER TABLE … ADD COLUMN c t AS (e) STORED`
    /// becomes `… GENERATED ALWAYS AS (e) STORED`).
    Rewritten {
        sql: String,
    },
    ShowRegions(ShowRegions),
    /// `SHOW SURVIVAL GOAL [FROM DATABASE [db]]`.
    ShowSurvivalGoal {
        database: Option<String>,
    },
    ShowZoneConfiguration(ZoneTarget),
    ShowZoneConfigurations,
    ShowLocality,
    /// `SHOW TABLES [FROM db[.schema]]`, with their localities.
    ShowTables {
        from: Option<ObjectName>,
    },
    /// `SHOW RANGES [FROM TABLE t | FROM DATABASE d]`: the ranges of the current database,
    /// one table, or a database.
    ShowRanges(RangesFrom),
    /// `SHOW DATABASES`, with each one's regions and survival goal.
    ShowDatabases,
    /// `SHOW ENUMS`: the region type among them.
    ShowEnums,
    /// `SHOW SEQUENCES`.
    ShowSequences,
    /// `SET CLUSTER SETTING name = value`; `None` is `RESET CLUSTER SETTING name` (or
    /// `= DEFAULT`).
    SetClusterSetting {
        name: String,
        value: Option<String>,
    },
    /// `SHOW CLUSTER SETTING name`: one row, one column named after the setting.
    ShowClusterSetting {
        name: String,
    },
    /// `SHOW [ALL] CLUSTER SETTINGS`: the settings that have been set.
    ShowClusterSettings,
    /// `SHOW CREATE [TABLE] t` / `SHOW CREATE DATABASE d`: the statement that would create it,
    /// as CockroachDB prints it.
    ShowCreate(CreateTarget),
    /// `SHOW INDEXES FROM t` (also `SHOW INDEX`, `SHOW KEYS`): one row per index column.
    ShowIndexes {
        table: ObjectName,
    },
    /// `SHOW PARTITIONS FROM TABLE t | FROM DATABASE d | FROM INDEX t@i`.
    ShowPartitions(PartitionsFrom),
}

/// What `SHOW CREATE` prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateTarget {
    Table(ObjectName),
    Database(String),
}

/// What `SHOW PARTITIONS` lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PartitionsFrom {
    Table(ObjectName),
    Database(String),
    Index { table: ObjectName, index: String },
}

/// What `SHOW RANGES` lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RangesFrom {
    CurrentDatabase,
    Database(String),
    Table(ObjectName),
}

impl Statement {
    /// CockroachDB's command tag for the statement.
    pub fn tag(&self) -> &'static str {
        match self {
            Statement::CreateDatabase { .. } => "CREATE DATABASE",
            Statement::AlterDatabasePrimaryRegion { .. } => "ALTER DATABASE PRIMARY REGION",
            Statement::AlterDatabaseAddRegion { .. } => "ALTER DATABASE ADD REGION",
            Statement::AlterDatabaseDropRegion { .. } => "ALTER DATABASE DROP REGION",
            Statement::AlterDatabaseSurvival { .. } => "ALTER DATABASE SURVIVE",
            Statement::AlterDatabasePlacement { .. } => "ALTER DATABASE PLACEMENT",
            Statement::AlterDatabaseSecondaryRegion {
                region: Some(_), ..
            } => "ALTER DATABASE SET SECONDARY REGION",
            Statement::AlterDatabaseSecondaryRegion { region: None, .. } => {
                "ALTER DATABASE DROP SECONDARY REGION"
            }
            Statement::CreateTable { .. } => "CREATE TABLE",
            Statement::CreateIndex { .. } => "CREATE INDEX",
            Statement::AlterPrimaryKey { .. } => "ALTER TABLE",
            Statement::ConfigureZone { .. } => "CONFIGURE ZONE",
            Statement::AlterTableSetLocality { .. } => "ALTER TABLE SET LOCALITY",
            Statement::Rewritten { .. } => "ALTER TABLE",
            Statement::ShowRegions(_) => "SHOW REGIONS",
            Statement::ShowSurvivalGoal { .. } => "SHOW SURVIVAL GOAL",
            Statement::ShowZoneConfiguration(_) => "SHOW ZONE CONFIGURATION",
            Statement::ShowZoneConfigurations => "SHOW ZONE CONFIGURATIONS",
            Statement::ShowLocality => "SHOW LOCALITY",
            Statement::ShowTables { .. } => "SHOW TABLES",
            Statement::ShowRanges(_) => "SHOW RANGES",
            Statement::ShowDatabases => "SHOW DATABASES",
            Statement::ShowEnums => "SHOW ENUMS",
            Statement::ShowSequences => "SHOW SEQUENCES",
            Statement::SetClusterSetting { .. } => "SET CLUSTER SETTING",
            Statement::ShowClusterSetting { .. } => "SHOW CLUSTER SETTING",
            Statement::ShowClusterSettings => "SHOW CLUSTER SETTINGS",
            Statement::ShowCreate(_) => "SHOW CREATE",
            Statement::ShowIndexes { .. } => "SHOW INDEXES",
            Statement::ShowPartitions(_) => "SHOW PARTITIONS",
        }
    }
}
