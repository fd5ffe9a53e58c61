//! The native forms of CockroachDB's SHOW statements (views in schema `multiregion`, same
//! columns), and `SHOW …` through `multiregion.execute`.

use super::catalog;
use super::show_create;
use super::spi;
use crate::error::{MrError, OrRaise};
use mr_meta::TableLocality;
use mr_sql::{CreateTarget, PartitionsFrom, RangesFrom, ShowRegions, Statement, ZoneTarget};
use mr_zoneconfig::{zone_config, Target};
use pgrx::prelude::*;

extension_sql!(
    r#"
CREATE VIEW multiregion.regions AS
WITH cluster AS (SELECT region, zones FROM multiregion.cluster_regions())
SELECT pg_catalog.current_database()::text AS database, r.region,
       r.region = c.primary_region AS "primary",
       r.region IS NOT DISTINCT FROM c.secondary_region AS secondary,
       COALESCE((SELECT zones FROM cluster WHERE cluster.region = r.region), '{}') AS zones
  FROM multiregion.database_config c, unnest(c.regions) AS r(region)
 ORDER BY 3 DESC, 2;
COMMENT ON VIEW multiregion.regions IS 'SHOW REGIONS FROM DATABASE';

CREATE VIEW multiregion.survival_goal AS
SELECT pg_catalog.current_database()::text AS database,
       CASE WHEN primary_region IS NOT NULL THEN survival_goal END AS survival_goal
  FROM multiregion.database_config;
COMMENT ON VIEW multiregion.survival_goal IS 'SHOW SURVIVAL GOAL FROM DATABASE';

CREATE VIEW multiregion.tables AS
SELECT n.nspname::text AS schema_name, c.relname::text AS table_name, 'table'::text AS type,
       pg_catalog.pg_get_userbyid(c.relowner)::text AS owner,
       GREATEST(c.reltuples, 0)::bigint AS estimated_row_count,
       CASE WHEN cfg.primary_region IS NOT NULL THEN multiregion.table_locality_sql(c.oid) END AS locality
  FROM pg_catalog.pg_class c
  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace,
       multiregion.database_config cfg
 WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
   AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'multiregion', 'multiregion_keys')
   AND n.nspname !~ '^pg_(toast|temp)'
 ORDER BY 1, 2;
COMMENT ON VIEW multiregion.tables IS 'SHOW TABLES, with each table''s locality';

CREATE VIEW multiregion.zone_configurations AS
SELECT target, raw_config_sql FROM multiregion.zone_configurations_info();
COMMENT ON VIEW multiregion.zone_configurations IS 'SHOW ZONE CONFIGURATIONS';
GRANT SELECT ON multiregion.regions, multiregion.survival_goal, multiregion.tables,
    multiregion.zone_configurations TO PUBLIC;
"#,
    name = "show_views",
    finalize
);

/// A table's locality as CockroachDB prints it (`GLOBAL`, `REGIONAL BY ROW`, …).
#[pg_extern(schema = "multiregion", stable)]
fn table_locality_sql(relid: pg_sys::Oid) -> String {
    mr_zoneconfig::ddl::locality_sql(&catalog::locality(relid).locality)
}

/// `ALTER … CONFIGURE ZONE` text of every object of the database, derived from its regions,
/// survival goal and the tables' localities.
#[pg_extern(schema = "multiregion", stable)]
fn zone_configurations_info(
) -> TableIterator<'static, (name!(target, String), name!(raw_config_sql, String))> {
    TableIterator::new(zone_rows().or_raise())
}

fn zone_rows() -> Result<Vec<(String, String)>, MrError> {
    let (Some(config), _) = catalog::load(false) else {
        return Ok(vec![]);
    };
    let db = spi::ident(&config.database);
    let mut out = vec![];
    let zones = super::zone::current()?;
    // Overrides over the derived configuration (an override that no longer fits is shown
    // as not applied, as pgmr does not apply it).
    let overridden =
        |zc: mr_zoneconfig::ZoneConfig, schema: &str, table: &str, partition: Option<&str>| {
            let fields = mr_zoneconfig::overrides::for_range(&zones, schema, table, partition);
            let mut o = zc.clone();
            match mr_zoneconfig::overrides::apply(&mut o, &fields) {
                Ok(()) => o,
                Err(_) => zc,
            }
        };
    let database = overridden(
        zone_config(&config, Target::Database).map_err(zone_error)?,
        "",
        "",
        None,
    );
    out.push((
        format!("DATABASE {db}"),
        database.raw_config_sql(&format!("DATABASE {db}")),
    ));
    let tables = spi::read_rows(
        "SELECT c.oid::text, pg_catalog.quote_ident(n.nspname) || '.' || pg_catalog.quote_ident(c.relname), \
                n.nspname::text, c.relname::text \
         FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition \
           AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'multiregion', 'multiregion_keys') \
           AND n.nspname !~ '^pg_(toast|temp)' ORDER BY 2",
        vec![],
    );
    for t in tables {
        let relid = pg_sys::Oid::from(t[0].as_deref().unwrap_or("0").parse::<u32>().unwrap_or(0));
        let name = format!("{db}.{}", t[1].clone().unwrap_or_default());
        let (schema, table) = (
            t[2].clone().unwrap_or_default(),
            t[3].clone().unwrap_or_default(),
        );
        let locality = catalog::locality(relid).locality;
        let zc = overridden(
            zone_config(&config, Target::Table(&locality)).map_err(zone_error)?,
            &schema,
            &table,
            None,
        );
        out.push((
            format!("TABLE {name}"),
            zc.raw_config_sql(&format!("TABLE {name}")),
        ));
        if matches!(locality, TableLocality::RegionalByRow { .. }) {
            for region in &config.regions {
                let target = format!("PARTITION {} OF TABLE {name}", spi::ident(region));
                let zc = overridden(
                    zone_config(&config, Target::Partition { region }).map_err(zone_error)?,
                    &schema,
                    &table,
                    Some(region),
                );
                out.push((target.clone(), zc.raw_config_sql(&target)));
            }
        }
    }
    Ok(out)
}

fn zone_error(e: mr_zoneconfig::ZoneConfigError) -> MrError {
    MrError::Sidecar(e.to_string())
}

/// Every multi-region database of the cluster: from the meta group when pgmr manages this
/// node (so every node answers the same), else this database alone.
fn cluster_configs() -> Vec<mr_meta::DatabaseConfig> {
    if crate::gucs::sidecar_socket().is_some() {
        crate::sidecar::database_configs().or_raise()
    } else {
        catalog::load(false).0.into_iter().collect()
    }
}

/// Every multi-region database of the cluster and its regions.
#[pg_extern(schema = "multiregion", stable)]
#[allow(clippy::type_complexity)]
fn database_regions() -> TableIterator<
    'static,
    (
        name!(database_name, String),
        name!(regions, Vec<String>),
        name!(primary_region, String),
        name!(secondary_region, Option<String>),
    ),
> {
    TableIterator::new(cluster_configs().into_iter().map(|c| {
        (
            c.database,
            c.regions.into_iter().collect(),
            c.primary_region,
            c.secondary_region,
        )
    }))
}

/// Every multi-region database of the cluster with its survival goal and placement (what
/// `SHOW DATABASES` and the SHOW forms naming another database print).
#[pg_extern(schema = "multiregion", stable)]
#[allow(clippy::type_complexity)]
fn database_goals() -> TableIterator<
    'static,
    (
        name!(database_name, String),
        name!(survival_goal, String),
        name!(placement, String),
    ),
> {
    TableIterator::new(cluster_configs().into_iter().map(|c| {
        (
            c.database,
            catalog::survival_str(c.survival).to_string(),
            catalog::placement_str(c.placement).to_string(),
        )
    }))
}

/// A database named by a SHOW statement must exist (CockroachDB's error).
fn database_exists(database: &str) -> Result<(), MrError> {
    if spi::flag(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_database WHERE datname = $1)::text",
        vec![database.into()],
    ) {
        return Ok(());
    }
    Err(MrError::Ddl(mr_zoneconfig::ddl::DdlError {
        sqlstate: "3D000",
        message: format!("database \"{database}\" does not exist"),
        hint: None,
    }))
}

/// `SHOW REGIONS FROM DATABASE d` for a database other than the session's: the same columns
/// and order as `multiregion.regions`, from the cluster's configuration of `d`.
const OTHER_DATABASE_REGIONS: &str = "\
    WITH cluster AS (SELECT region, zones FROM multiregion.cluster_regions()) \
    SELECT c.database_name AS database, r.region, r.region = c.primary_region AS \"primary\", \
           r.region IS NOT DISTINCT FROM c.secondary_region AS secondary, \
           COALESCE((SELECT zones FROM cluster WHERE cluster.region = r.region), '{}') AS zones \
      FROM multiregion.database_regions() c, unnest(c.regions) AS r(region) \
     WHERE c.database_name = $1 ORDER BY 3 DESC, 2";

fn json_rows(query: &str, args: Vec<pgrx::datum::DatumWithOid<'_>>) -> Vec<serde_json::Value> {
    spi::read_rows(
        &format!("SELECT pg_catalog.row_to_json(q)::text FROM ({query}) q"),
        args,
    )
    .into_iter()
    .filter_map(|r| r.into_iter().next().flatten())
    .filter_map(|s| serde_json::from_str(&s).ok())
    .collect()
}

/// The database a SHOW statement names, when it is not the session's (which the views in
/// schema `multiregion` answer for); it must exist.
fn other_database(database: Option<&String>) -> Result<Option<&String>, MrError> {
    match database {
        Some(d) if *d != catalog::database_name() => database_exists(d).map(|_| Some(d)),
        _ => Ok(None),
    }
}

pub(super) fn run(stmt: &Statement) -> Result<Vec<serde_json::Value>, MrError> {
    Ok(match stmt {
        Statement::ShowRegions(ShowRegions::Cluster) => json_rows(
            "SELECT region, zones FROM multiregion.cluster_regions()",
            vec![],
        ),
        Statement::ShowRegions(ShowRegions::Database(db)) => match other_database(db.as_ref())? {
            Some(d) => json_rows(OTHER_DATABASE_REGIONS, vec![d.as_str().into()]),
            None => json_rows("SELECT * FROM multiregion.regions", vec![]),
        },
        Statement::ShowRegions(ShowRegions::All) => json_rows(
            "SELECT c.region, c.zones, \
               ARRAY(SELECT d.database_name FROM multiregion.database_regions() d \
                      WHERE c.region = ANY (d.regions) ORDER BY 1) AS database_names, \
               ARRAY(SELECT d.database_name FROM multiregion.database_regions() d \
                      WHERE d.primary_region = c.region ORDER BY 1) AS primary_region_of, \
               ARRAY(SELECT d.database_name FROM multiregion.database_regions() d \
                      WHERE d.secondary_region = c.region ORDER BY 1) AS secondary_region_of \
             FROM multiregion.cluster_regions() c ORDER BY c.region",
            vec![],
        ),
        Statement::ShowRegions(ShowRegions::AllDatabases) => json_rows(
            "SELECT d.datname::text AS database_name, COALESCE(r.regions, '{}') AS regions, \
               r.primary_region, r.secondary_region \
             FROM pg_catalog.pg_database d \
             LEFT JOIN multiregion.database_regions() r ON r.database_name = d.datname \
             WHERE NOT d.datistemplate ORDER BY 1",
            vec![],
        ),
        Statement::ShowSurvivalGoal { database } => match other_database(database.as_ref())? {
            Some(d) => json_rows(
                "SELECT $1::text AS database, \
                   (SELECT survival_goal FROM multiregion.database_goals() \
                     WHERE database_name = $1) AS survival_goal",
                vec![d.as_str().into()],
            ),
            None => json_rows("SELECT * FROM multiregion.survival_goal", vec![]),
        },
        Statement::ShowDatabases => json_rows(
            "SELECT d.datname::text AS database_name, \
               pg_catalog.pg_get_userbyid(d.datdba)::text AS owner, \
               r.primary_region, r.secondary_region, COALESCE(r.regions, '{}') AS regions, \
               g.survival_goal \
             FROM pg_catalog.pg_database d \
             LEFT JOIN multiregion.database_regions() r ON r.database_name = d.datname \
             LEFT JOIN multiregion.database_goals() g ON g.database_name = d.datname \
             WHERE NOT d.datistemplate ORDER BY 1",
            vec![],
        ),
        Statement::ShowSequences => json_rows(
            "SELECT n.nspname::text AS sequence_schema, c.relname::text AS sequence_name \
             FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.relkind = 'S' \
               AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'multiregion') \
             ORDER BY 1, 2",
            vec![],
        ),
        // A setting never set shows NULL: pgmr keeps only the settings that were set, and
        // each reader applies its own default.
        Statement::ShowClusterSetting { name } => json_rows(
            &format!(
                "SELECT (SELECT value FROM multiregion.cluster_settings WHERE variable = $1) AS {}",
                spi::ident(name)
            ),
            vec![name.as_str().into()],
        ),
        Statement::ShowClusterSettings => json_rows(
            "SELECT variable, value FROM multiregion.cluster_settings",
            vec![],
        ),
        // The region type is a domain here, an enum in CockroachDB: listed with the
        // database's regions as its values, beside PostgreSQL's own enums.
        Statement::ShowEnums => json_rows(
            "SELECT n.nspname::text AS schema, t.typname::text AS name, \
               CASE WHEN t.typtype = 'e' THEN \
                 ARRAY(SELECT e.enumlabel::text FROM pg_catalog.pg_enum e \
                        WHERE e.enumtypid = t.oid ORDER BY e.enumsortorder) \
               ELSE (SELECT ARRAY(SELECT unnest(c.regions) ORDER BY 1) \
                       FROM multiregion.database_config c) END AS \"values\", \
               pg_catalog.pg_get_userbyid(t.typowner)::text AS owner \
             FROM pg_catalog.pg_type t JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace \
             WHERE (t.typtype = 'e' AND n.nspname NOT IN ('pg_catalog', 'information_schema')) \
                OR t.oid = pg_catalog.to_regtype('public.crdb_internal_region') \
             ORDER BY 1, 2",
            vec![],
        ),
        Statement::ShowZoneConfigurations => {
            json_rows("SELECT * FROM multiregion.zone_configurations", vec![])
        }
        Statement::ShowZoneConfiguration(target) => {
            let (kind, name) = match target {
                ZoneTarget::Default => ("RANGE", "default".to_string()),
                ZoneTarget::Database(d) => ("DATABASE", spi::ident(d)),
                ZoneTarget::Table(t) => ("TABLE", qualify(&t.0)),
                ZoneTarget::Partition {
                    partition, table, ..
                } => (
                    "PARTITION",
                    format!("{} OF TABLE {}", spi::ident(partition), qualify(&table.0)),
                ),
                ZoneTarget::Index { table, .. } => ("TABLE", qualify(&table.0)),
            };
            json_rows(
                "SELECT * FROM multiregion.zone_configurations WHERE target = $1",
                vec![format!("{kind} {name}").into()],
            )
        }
        Statement::ShowLocality => json_rows(
            "SELECT pg_catalog.current_setting('multiregion.locality') AS locality",
            vec![],
        ),
        Statement::ShowTables { from } => {
            let schema = from.as_ref().and_then(|f| f.0.last().cloned());
            json_rows(
                "SELECT * FROM multiregion.tables WHERE $1::text IS NULL OR schema_name = $1",
                vec![schema.into()],
            )
        }
        Statement::ShowRanges(from) => match from {
            RangesFrom::CurrentDatabase => json_rows(
                "SELECT * FROM multiregion.ranges \
                 WHERE database_name = pg_catalog.current_database()",
                vec![],
            ),
            RangesFrom::Database(d) => json_rows(
                "SELECT * FROM multiregion.ranges WHERE database_name = $1",
                vec![d.clone().into()],
            ),
            RangesFrom::Table(t) => {
                let name =
                    t.0.iter()
                        .map(|p| spi::ident(p))
                        .collect::<Vec<_>>()
                        .join(".");
                json_rows(
                    "SELECT r.* FROM multiregion.ranges r, pg_catalog.pg_class c \
                     JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                     WHERE c.oid = $1::text::regclass \
                       AND r.database_name = pg_catalog.current_database() \
                       AND r.schema_name = n.nspname AND r.table_name = c.relname \
                     ORDER BY r.range_id",
                    vec![name.into()],
                )
            }
        },
        Statement::ShowCreate(CreateTarget::Table(t)) => {
            let (name, text) = show_create::create_statement(&object_sql(t))?;
            vec![serde_json::json!({ "table_name": name, "create_statement": text })]
        }
        Statement::ShowCreate(CreateTarget::Database(d)) => {
            database_exists(d)?;
            let config = if *d == catalog::database_name() {
                catalog::load(false).0
            } else {
                cluster_configs().into_iter().find(|c| c.database == *d)
            };
            vec![serde_json::json!({
                "database_name": d,
                "create_statement":
                    mr_zoneconfig::ddl::create_database_sql(&spi::ident(d), config.as_ref()),
            })]
        }
        Statement::ShowIndexes { table } => show_create::index_rows(&object_sql(table))?,
        Statement::ShowPartitions(PartitionsFrom::Table(t)) => {
            show_create::table_partitions(&object_sql(t), None)?
        }
        Statement::ShowPartitions(PartitionsFrom::Index { table, index }) => {
            show_create::table_partitions(&object_sql(table), Some(index))?
        }
        Statement::ShowPartitions(PartitionsFrom::Database(d)) => {
            database_exists(d)?;
            show_create::database_partitions(d, &cluster_configs())?
        }
        other => unreachable!("not a SHOW statement: {other:?}"),
    })
}

/// A possibly qualified name as SQL, each part quoted as needed.
fn object_sql(name: &mr_sql::ObjectName) -> String {
    name.0
        .iter()
        .map(|p| spi::ident(p))
        .collect::<Vec<_>>()
        .join(".")
}

/// `db.schema.table` for a zone target written as `t`, `s.t` or `db.s.t`.
fn qualify(parts: &[String]) -> String {
    let db = catalog::database_name();
    let q: Vec<String> = match parts {
        [t] => vec![db, "public".into(), t.clone()],
        [s, t] => vec![db, s.clone(), t.clone()],
        other => other.to_vec(),
    };
    q.iter()
        .map(|p| spi::ident(p))
        .collect::<Vec<_>>()
        .join(".")
}
