//! `SHOW CREATE`, `SHOW INDEXES` and `SHOW PARTITIONS`: CockroachDB's view of a table, read
//! from PostgreSQL's catalog with the multi-region machinery folded back into the declarations
//! it implements. A REGIONAL BY ROW table's LIST partitions print as its LOCALITY clause, the
//! region column its keys are prefixed with as an implicit key column (CockroachDB's implicit
//! partitioning), the region column's CHECK as the computed column it stands for, and a foreign
//! key retargeted to a key table (`multiregion_keys`) as a key to the table it keeps unique.

use super::catalog::{self, LocalityRow};
use super::rbr::HIDDEN_COLUMN;
use super::spi::{self, ident, read_one, read_rows};
use crate::error::MrError;
use mr_meta::{DatabaseConfig, TableLocality};
use mr_zoneconfig::{zone_config, Target};
use pgrx::pg_sys::Oid;
use serde_json::json;

/// A relation a SHOW statement names.
pub(super) struct Relation {
    pub relid: Oid,
    kind: String,
    schema: String,
    pub name: String,
}

/// Looks up `name_sql` (a name as SQL, qualified or not): PostgreSQL's 42P01 if it is missing.
pub(super) fn relation(name_sql: &str) -> Result<Relation, MrError> {
    let row = read_rows(
        "SELECT c.oid::text, c.relkind::text, n.nspname::text, c.relname::text \
         FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.oid = pg_catalog.to_regclass($1)",
        vec![name_sql.into()],
    );
    let Some(r) = row.into_iter().next() else {
        return Err(MrError::NoSuchTable(name_sql.to_string()));
    };
    let get = |i: usize| r.get(i).cloned().flatten().unwrap_or_default();
    Ok(Relation {
        relid: Oid::from(get(0).parse::<u32>().unwrap_or(0)),
        kind: get(1),
        schema: get(2),
        name: get(3),
    })
}

fn not_a_table(name: &str) -> MrError {
    MrError::Ddl(mr_zoneconfig::ddl::DdlError {
        sqlstate: mr_zoneconfig::ddl::WRONG_OBJECT_TYPE,
        message: format!("\"{name}\" is not a table"),
        hint: None,
    })
}

/// One column of an index, in key order; INCLUDE columns (`storing`) last.
struct IndexColumn {
    /// The column's name, or the key expression's text.
    name: String,
    expression: bool,
    descending: bool,
    storing: bool,
}

struct Index {
    name: String,
    primary: bool,
    unique: bool,
    method: String,
    predicate: Option<String>,
    columns: Vec<IndexColumn>,
}

impl Index {
    /// Whether column `k` is the region column a REGIONAL BY ROW table's keys are prefixed
    /// with (CockroachDB's implicit partitioning column).
    fn implicit(&self, k: usize, region_column: Option<&str>) -> bool {
        k == 0
            && region_column
                .is_some_and(|r| !self.columns[0].expression && self.columns[0].name == r)
    }

    /// `(a ASC, b DESC)` without the implicit region column, then ` STORING (…)`.
    fn key_sql(&self, region_column: Option<&str>) -> String {
        let (mut keys, mut storing, mut buckets) = (vec![], vec![], None);
        for (k, c) in self.columns.iter().enumerate() {
            if self.implicit(k, region_column) {
                continue;
            }
            // A hash-sharded key includes its shard column (crates/sql/src/table.rs).
            if c.storing && !c.expression {
                if let Some(n) = shard_buckets(&c.name) {
                    buckets = Some(n);
                    continue;
                }
            }
            let name = if c.expression {
                format!("({})", c.name)
            } else {
                ident(&c.name)
            };
            if c.storing {
                storing.push(name);
            } else {
                keys.push(format!(
                    "{name} {}",
                    if c.descending { "DESC" } else { "ASC" }
                ));
            }
        }
        let mut s = format!("({})", keys.join(", "));
        if buckets.is_some() {
            s.push_str(" USING HASH");
        }
        if !storing.is_empty() {
            s.push_str(&format!(" STORING ({})", storing.join(", ")));
        }
        if let Some(n) = buckets {
            s.push_str(&format!(" WITH (bucket_count={n})"));
        }
        s
    }
}

/// The bucket count of a shard column CockroachDB names `crdb_internal_<columns>_shard_<n>`.
fn shard_buckets(column: &str) -> Option<u32> {
    let rest = column.strip_prefix("crdb_internal_")?;
    let (_, n) = rest.rsplit_once("_shard_")?;
    n.parse().ok()
}

fn indexes(relid: Oid) -> Vec<Index> {
    read_rows(
        "SELECT i.indexrelid::text, c.relname::text, i.indisprimary::text, i.indisunique::text, \
                am.amname::text, pg_catalog.pg_get_expr(i.indpred, i.indrelid, true) \
         FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid \
         JOIN pg_catalog.pg_am am ON am.oid = c.relam \
         WHERE i.indrelid = $1 ORDER BY i.indisprimary DESC, c.relname",
        vec![relid.into()],
    )
    .into_iter()
    .map(|r| {
        let get = |i: usize| r.get(i).cloned().flatten().unwrap_or_default();
        let index = Oid::from(get(0).parse::<u32>().unwrap_or(0));
        let columns = read_rows(
            "SELECT COALESCE(a.attname::text, pg_catalog.pg_get_indexdef(i.indexrelid, k, true)), \
                    (a.attname IS NULL)::text, \
                    COALESCE((i.indoption[k - 1] & 1) = 1 AND k <= i.indnkeyatts, false)::text, \
                    (k > i.indnkeyatts)::text \
             FROM pg_catalog.pg_index i CROSS JOIN LATERAL pg_catalog.generate_series(1, i.indnatts) k \
             LEFT JOIN pg_catalog.pg_attribute a \
               ON a.attrelid = i.indrelid AND a.attnum = i.indkey[k - 1] AND i.indkey[k - 1] <> 0 \
             WHERE i.indexrelid = $1 ORDER BY k",
            vec![index.into()],
        )
        .into_iter()
        .map(|c| {
            let get = |i: usize| c.get(i).cloned().flatten().unwrap_or_default();
            IndexColumn {
                name: get(0),
                expression: get(1) == "true",
                descending: get(2) == "true",
                storing: get(3) == "true",
            }
        })
        .collect();
        Index {
            name: get(1),
            primary: get(2) == "true",
            unique: get(3) == "true",
            method: get(4),
            predicate: r.get(5).cloned().flatten(),
            columns,
        }
    })
    .collect()
}

/// The region column of a REGIONAL BY ROW table.
fn region_column(row: &LocalityRow) -> Option<&str> {
    match &row.locality {
        TableLocality::RegionalByRow { column } => Some(column.as_str()),
        _ => None,
    }
}

/// The database's regions, when it has any: a table's LOCALITY is printed only then.
fn config() -> Option<DatabaseConfig> {
    catalog::load(false).0
}

/// `SHOW CREATE [TABLE] t`: (name, statement).
pub(super) fn create_statement(name_sql: &str) -> Result<(String, String), MrError> {
    let rel = relation(name_sql)?;
    let qualified = format!("{}.{}", ident(&rel.schema), ident(&rel.name));
    let text = match rel.kind.as_str() {
        "r" | "p" => create_table(&rel, &qualified),
        "v" | "m" => {
            let columns: Vec<String> = read_rows(
                "SELECT pg_catalog.quote_ident(attname) FROM pg_catalog.pg_attribute \
                 WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
                vec![rel.relid.into()],
            )
            .into_iter()
            .filter_map(|r| r.into_iter().next().flatten())
            .collect();
            let def = read_one(
                "SELECT pg_catalog.pg_get_viewdef($1, true)",
                vec![rel.relid.into()],
            )
            .unwrap_or_default();
            format!(
                "CREATE {}VIEW {qualified} (\n\t{}\n) AS {}",
                if rel.kind == "m" { "MATERIALIZED " } else { "" },
                columns.join(",\n\t"),
                def.trim().trim_end_matches(';')
            )
        }
        "S" => {
            let r = read_rows(
                "SELECT seqmin::text, seqmax::text, seqincrement::text, seqstart::text \
                 FROM pg_catalog.pg_sequence WHERE seqrelid = $1",
                vec![rel.relid.into()],
            );
            let get = |i: usize| {
                r.first()
                    .and_then(|r| r.get(i).cloned().flatten())
                    .unwrap_or_default()
            };
            format!(
                "CREATE SEQUENCE {qualified} MINVALUE {} MAXVALUE {} INCREMENT {} START {}",
                get(0),
                get(1),
                get(2),
                get(3)
            )
        }
        _ => return Err(not_a_table(&rel.name)),
    };
    Ok((rel.name, text))
}

fn create_table(rel: &Relation, qualified: &str) -> String {
    let row = catalog::locality(rel.relid);
    let region = region_column(&row);
    let mut lines: Vec<String> = vec![];
    for c in read_rows(
        "SELECT a.attname::text, \
                CASE WHEN a.atttypid = pg_catalog.to_regtype('public.crdb_internal_region') \
                     THEN 'public.crdb_internal_region' \
                     ELSE pg_catalog.format_type(a.atttypid, a.atttypmod) END, \
                a.attnotnull::text, a.attgenerated::text, a.attidentity::text, \
                pg_catalog.pg_get_expr(d.adbin, d.adrelid, true) \
         FROM pg_catalog.pg_attribute a LEFT JOIN pg_catalog.pg_attrdef d \
           ON d.adrelid = a.attrelid AND d.adnum = a.attnum \
         WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
        vec![rel.relid.into()],
    ) {
        let get = |i: usize| c.get(i).cloned().flatten().unwrap_or_default();
        let name = get(0);
        let mut line = format!("{} {}", ident(&name), mr_sql::crdb_type_name(&get(1)));
        let is_region = region == Some(name.as_str());
        if is_region && row.hidden && name == HIDDEN_COLUMN {
            // The system-provided column, as CockroachDB declares it.
            line.push_str(
                " NOT VISIBLE NOT NULL DEFAULT default_to_database_primary_region(gateway_region())\
                 ::public.crdb_internal_region",
            );
            if row.auto_rehoming {
                line.push_str(" ON UPDATE rehome_row()::public.crdb_internal_region");
            }
        } else if let (true, Some(expr)) = (is_region, &row.region_expr_sql) {
            // A computed region column: PostgreSQL cannot partition by a generated column, so
            // it is a plain column tied to its expression by a CHECK (rbr.rs).
            line.push_str(if get(2) == "true" {
                " NOT NULL"
            } else {
                " NULL"
            });
            line.push_str(&format!(" AS ({}) STORED", one_line(expr)));
        } else {
            line.push_str(if get(2) == "true" {
                " NOT NULL"
            } else {
                " NULL"
            });
            match (get(3).as_str(), get(4).as_str()) {
                ("s", _) => line.push_str(&format!(" AS ({}) STORED", one_line(&get(5)))),
                (_, "a") => line.push_str(" GENERATED ALWAYS AS IDENTITY"),
                (_, "d") => line.push_str(" GENERATED BY DEFAULT AS IDENTITY"),
                _ => {
                    if let Some(default) = c.get(5).cloned().flatten() {
                        // CockroachDB's function is built in; ours lives in our schema.
                        let default =
                            default.replace("multiregion.unique_rowid()", "unique_rowid()");
                        line.push_str(&format!(" DEFAULT {}", one_line(&default)));
                    }
                }
            }
        }
        lines.push(line);
    }
    let indexes = indexes(rel.relid);
    for i in indexes.iter().filter(|i| i.primary) {
        lines.push(format!(
            "CONSTRAINT {} PRIMARY KEY {}",
            ident(&i.name),
            i.key_sql(region)
        ));
    }
    // Foreign keys, those retargeted to a key table shown with the table it keeps unique.
    for f in read_rows(
        "SELECT con.conname::text, pg_catalog.pg_get_constraintdef(con.oid, true), \
                con.confrelid::regclass::text, g.relid::regclass::text \
         FROM pg_catalog.pg_constraint con \
         LEFT JOIN multiregion.global_key g ON g.key_table = con.confrelid \
         WHERE con.conrelid = $1 AND con.contype = 'f' ORDER BY 1",
        vec![rel.relid.into()],
    ) {
        let get = |i: usize| f.get(i).cloned().flatten().unwrap_or_default();
        let mut def = get(1);
        if let Some(base) = f.get(3).cloned().flatten() {
            def = def.replacen(
                &format!("REFERENCES {}(", get(2)),
                &format!("REFERENCES {base}("),
                1,
            );
        }
        lines.push(format!("CONSTRAINT {} {def}", ident(&get(0))));
    }
    for i in indexes.iter().filter(|i| !i.primary) {
        let kind = match (i.unique, i.method.as_str()) {
            (true, _) => "UNIQUE INDEX",
            (false, "gin") => "INVERTED INDEX",
            _ => "INDEX",
        };
        let mut line = format!("{kind} {} {}", ident(&i.name), i.key_sql(region));
        if !matches!(i.method.as_str(), "btree" | "gin") {
            line.push_str(&format!(" USING {}", i.method));
        }
        if let Some(p) = &i.predicate {
            line.push_str(&format!(" WHERE {p}"));
        }
        lines.push(line);
    }
    // CHECK and EXCLUDE constraints, but not the one tying a computed region column to its
    // expression (printed as the computed column above).
    let computed = region.map(|r| format!("{}_{r}_computed", rel.name));
    for c in read_rows(
        "SELECT conname::text, pg_catalog.pg_get_constraintdef(oid, true) \
         FROM pg_catalog.pg_constraint WHERE conrelid = $1 AND contype IN ('c', 'x') ORDER BY 1",
        vec![rel.relid.into()],
    ) {
        let get = |i: usize| c.get(i).cloned().flatten().unwrap_or_default();
        if row.region_expr_sql.is_some() && computed.as_deref() == Some(get(0).as_str()) {
            continue;
        }
        lines.push(format!(
            "CONSTRAINT {} {}",
            ident(&get(0)),
            one_line(&get(1))
        ));
    }
    let mut s = format!("CREATE TABLE {qualified} (\n\t{}\n)", lines.join(",\n\t"));
    if config().is_some() {
        s.push_str(&format!(
            " LOCALITY {}",
            mr_zoneconfig::ddl::locality_sql(&row.locality)
        ));
    }
    s
}

/// PostgreSQL's pretty-printed expression (a `CASE` spans lines) on one line, as CockroachDB
/// prints a column's expression.
fn one_line(expr: &str) -> String {
    expr.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// `SHOW INDEXES FROM t`: one row per index column, CockroachDB's columns; a REGIONAL BY ROW
/// table's region column leads every index as an implicit column, and a hash-sharded index's
/// shard column follows it as one (CockroachDB's key is (shard, columns); ours includes the
/// shard column after the key, crates/sql/src/table.rs).
pub(super) fn index_rows(name_sql: &str) -> Result<Vec<serde_json::Value>, MrError> {
    let rel = relation(name_sql)?;
    if !matches!(rel.kind.as_str(), "r" | "p" | "m") {
        return Err(not_a_table(&rel.name));
    }
    let row = catalog::locality(rel.relid);
    let region = region_column(&row);
    let mut out = vec![];
    for i in indexes(rel.relid) {
        let shard =
            |c: &IndexColumn| c.storing && !c.expression && shard_buckets(&c.name).is_some();
        // (column, implicit), in CockroachDB's order.
        let mut ordered: Vec<(&IndexColumn, bool)> = vec![];
        let (lead, rest): (Vec<_>, Vec<_>) = i
            .columns
            .iter()
            .enumerate()
            .partition(|(k, _)| i.implicit(*k, region));
        ordered.extend(lead.into_iter().map(|(_, c)| (c, true)));
        ordered.extend(
            rest.iter()
                .filter(|(_, c)| shard(c))
                .map(|(_, c)| (*c, true)),
        );
        ordered.extend(
            rest.iter()
                .filter(|(_, c)| !shard(c))
                .map(|(_, c)| (*c, false)),
        );
        for (k, (c, implicit)) in ordered.into_iter().enumerate() {
            let storing = c.storing && !implicit;
            out.push(json!({
                "table_name": rel.name,
                "index_name": i.name,
                "non_unique": !i.unique,
                "seq_in_index": k + 1,
                "column_name": c.name,
                "definition": c.name,
                "direction": if storing { "N/A" } else if c.descending { "DESC" } else { "ASC" },
                "storing": storing,
                "implicit": implicit,
                "visible": true,
            }));
        }
    }
    Ok(out)
}

/// One row of `SHOW PARTITIONS`: a region partition of a REGIONAL BY ROW table's index, with
/// the partition's own zone configuration and the full one it takes effect with.
fn partition_row(
    config: &DatabaseConfig,
    table: &str,
    index: Option<String>,
    column: Option<&str>,
    region: &str,
) -> Result<serde_json::Value, MrError> {
    let zc = zone_config(config, Target::Partition { region })
        .map_err(|e| MrError::Sidecar(e.to_string()))?;
    Ok(json!({
        "database_name": config.database,
        "table_name": table,
        "partition_name": region,
        "parent_partition": null,
        "column_names": column,
        "index_name": index,
        "partition_value": format!("('{}')", region.replace('\'', "''")),
        "zone_config": zc.partition_fields().join(",\n"),
        "full_zone_config": zc.fields().join(",\n"),
    }))
}

/// `SHOW PARTITIONS FROM TABLE t` (every index; `index` narrows it to one): a REGIONAL BY ROW
/// table's indexes are partitioned by region, other tables have no partitions.
pub(super) fn table_partitions(
    name_sql: &str,
    only_index: Option<&str>,
) -> Result<Vec<serde_json::Value>, MrError> {
    let rel = relation(name_sql)?;
    if !matches!(rel.kind.as_str(), "r" | "p") {
        return Err(not_a_table(&rel.name));
    }
    let indexes = indexes(rel.relid);
    if let Some(wanted) = only_index {
        if !indexes.iter().any(|i| i.name == wanted) {
            return Err(MrError::Ddl(mr_zoneconfig::ddl::DdlError {
                sqlstate: "42704",
                message: format!("index \"{wanted}\" does not exist"),
                hint: None,
            }));
        }
    }
    let row = catalog::locality(rel.relid);
    let (Some(config), Some(column)) = (config(), region_column(&row)) else {
        return Ok(vec![]);
    };
    let mut out = vec![];
    for i in indexes
        .iter()
        .filter(|i| only_index.is_none_or(|w| w == i.name))
    {
        for region in &config.regions {
            out.push(partition_row(
                &config,
                &rel.name,
                Some(format!("{}@{}", rel.name, i.name)),
                Some(column),
                region,
            )?);
        }
    }
    Ok(out)
}

/// `SHOW PARTITIONS FROM DATABASE d`: the session's database from its catalog; another one
/// from the cluster's ranges (its catalog is not readable from here: index and column names
/// are NULL), with the same zone configurations.
pub(super) fn database_partitions(
    database: &str,
    configs: &[DatabaseConfig],
) -> Result<Vec<serde_json::Value>, MrError> {
    if database == catalog::database_name() {
        let mut out = vec![];
        for (_, name, _) in catalog::rbr_tables() {
            out.extend(table_partitions(&name, None)?);
        }
        return Ok(out);
    }
    let Some(config) = configs.iter().find(|c| c.database == database) else {
        return Ok(vec![]);
    };
    let mut out = vec![];
    for r in spi::read_rows(
        "SELECT DISTINCT table_name, partition FROM multiregion.ranges \
         WHERE database_name = $1 AND partition IS NOT NULL ORDER BY 1, 2",
        vec![database.into()],
    ) {
        let get = |i: usize| r.get(i).cloned().flatten().unwrap_or_default();
        out.push(partition_row(config, &get(0), None, None, &get(1))?);
    }
    Ok(out)
}
