//! REGIONAL BY ROW tables: LIST-partitioned by their region column, one partition per
//! database region, every unique key prefixed with the region column (PostgreSQL requires the
//! partition key in unique indexes). A unique key that did not name the region stays unique
//! across regions through a key table in schema `multiregion_keys`, which also serves as the
//! target of foreign keys that reference the key.
//!
//! PostgreSQL cannot partition a table in place, so a change of locality to or from REGIONAL
//! BY ROW rebuilds the table: a twin with the new layout receives the rows, indexes,
//! constraints, defaults, grants, triggers, owned sequences and foreign keys (both directions),
//! then takes the table's name. It all happens in the caller's transaction, so it either
//! completes or leaves nothing behind; what cannot be carried over is refused before any change.

use super::catalog::{self, LocalityRow};
use super::spi::{self, ident, lit, one, rows, run, run_with};
use crate::error::MrError;
use mr_meta::{DatabaseConfig, TableLocality};
use pgrx::pg_sys::Oid;

/// The system-provided region column of `REGIONAL BY ROW` without `AS`.
pub const HIDDEN_COLUMN: &str = "crdb_region";

fn oid(s: &str) -> Oid {
    Oid::from(s.parse::<u32>().unwrap_or(0))
}

fn col(r: &[Option<String>], i: usize) -> String {
    r.get(i).cloned().flatten().unwrap_or_default()
}

/// Names of the REGIONAL BY TABLE tables homed in `region`.
pub fn tables_homed_in(region: &str) -> Vec<String> {
    catalog::all_localities()
        .into_iter()
        .filter(|(_, _, row)| {
            row.locality
                == TableLocality::RegionalByTable {
                    region: Some(region.to_string()),
                }
        })
        .map(|(_, name, _)| name)
        .collect()
}

/// The partition of `parent` that holds `region`, if any (qualified as regclass prints it).
pub(crate) fn partition_of(parent: Oid, region: &str) -> Option<String> {
    one(
        "SELECT c.oid::regclass::text FROM pg_catalog.pg_inherits i \
         JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = $1 \
         AND pg_catalog.pg_get_expr(c.relpartbound, c.oid) = 'FOR VALUES IN (' || pg_catalog.quote_literal($2) || ')'",
        vec![parent.into(), region.into()],
    )
}

/// Refuses to drop `region` while a REGIONAL BY ROW table has rows in it; from here to the
/// end of the transaction no row can take the region (the tables are locked against writes
/// here, and fenced at their leaseholders where the statement was typed). With
/// `at_leaseholders` (the node where the statement was typed) each partition
/// is read at its range's leaseholder: placement gives a node only some ranges, so its copy
/// of the others may lack rows (and every node that holds them would refuse the change after
/// it committed) or keep rows deleted since. With rows replicated, an applier of the
/// committed change (not `at_leaseholders`) checks nothing: the change was checked at the
/// leaseholders where it was typed, and its own copy may hold exactly such stale rows.
/// Without replication each node's rows are its own, and each checks them.
pub fn check_region_unused(region: &str, at_leaseholders: bool) -> Result<(), MrError> {
    let database = catalog::database_name();
    let replicated = crate::gucs::sidecar_socket().is_some()
        && crate::sidecar::replication_enabled().unwrap_or(false);
    let checked_where_typed = !at_leaseholders && replicated;
    let tables = catalog::rbr_tables();
    if at_leaseholders && replicated {
        // Writers of the tables are stopped at the leaseholders until the change commits
        // (and, once told of it, refuse rows written under the old schema), and every node
        // applies the rows written before it first: no row can reach the region's
        // partitions between this check and their drop.
        super::fence::fence_tables(tables.iter().map(|(relid, _, _)| *relid).collect())?;
    }
    for (relid, name, _) in tables {
        run(&format!("LOCK TABLE {name} IN SHARE MODE"));
        if checked_where_typed {
            continue;
        }
        if let Some(part) = partition_of(relid, region) {
            let mut sampled = None;
            if at_leaseholders && crate::gucs::sidecar_socket().is_some() {
                let (schema, table) = schema_and_name(relid);
                let t = mr_meta::TableRef {
                    database: database.clone(),
                    schema,
                    table,
                };
                sampled = crate::sidecar::partition_sample(t, region.to_string())?;
            }
            let row = match sampled {
                Some(row) => row,
                None => one(&format!("SELECT t::text FROM {part} t LIMIT 1"), vec![]),
            };
            if let Some(row) = row {
                return Err(MrError::RegionInUse {
                    region: region.to_string(),
                    table: name,
                    row,
                });
            }
        }
    }
    Ok(())
}

fn table_owner(relid: Oid) -> String {
    one(
        "SELECT pg_catalog.pg_get_userbyid(relowner)::text FROM pg_catalog.pg_class WHERE oid = $1",
        vec![relid.into()],
    )
    .unwrap_or_default()
}

fn create_partition(parent: &str, schema: &str, table: &str, region: &str, owner: &str) {
    let part = format!(
        "{}.{}",
        ident(schema),
        ident(&catalog::partition_name(table, region))
    );
    run(&format!(
        "CREATE TABLE {part} PARTITION OF {parent} FOR VALUES IN ({})",
        lit(region)
    ));
    run(&format!("ALTER TABLE {part} OWNER TO {}", ident(owner)));
}

pub fn add_partitions(region: &str) {
    for (relid, name, _) in catalog::rbr_tables() {
        let (schema, table) = schema_and_name(relid);
        create_partition(&name, &schema, &table, region, &table_owner(relid));
    }
}

pub fn drop_partitions(region: &str) {
    for (relid, _, _) in catalog::rbr_tables() {
        if let Some(part) = partition_of(relid, region) {
            run(&format!("DROP TABLE {part}"));
        }
    }
}

fn schema_and_name(relid: Oid) -> (String, String) {
    let r = rows(
        "SELECT n.nspname::text, c.relname::text FROM pg_catalog.pg_class c \
         JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1",
        vec![relid.into()],
    );
    let r = r.into_iter().next().unwrap_or_default();
    (col(&r, 0), col(&r, 1))
}

/// One index of the table being rebuilt.
struct Index {
    name: String,
    primary: bool,
    unique: bool,
    /// Backed by a PRIMARY KEY or UNIQUE constraint of this name.
    constraint: Option<String>,
    /// Plain key columns; `None` if the index has expressions or a predicate.
    columns: Option<Vec<String>>,
    def: String,
    /// INCLUDE columns (a hash-sharded key's shard column, CockroachDB's STORING).
    include: Vec<String>,
}

/// An incoming foreign key: another table's constraint referencing this one.
struct IncomingFk {
    table: String,
    name: String,
    def: String,
    columns: Vec<String>,
}

/// Everything about a table that a rebuild carries over.
struct Shape {
    relid: Oid,
    qualified: String,
    schema: String,
    name: String,
    owner: String,
    indexes: Vec<Index>,
    outgoing_fks: Vec<(String, String)>,
    incoming_fks: Vec<IncomingFk>,
    triggers: Vec<String>,
    grants: Vec<String>,
    comment: Option<String>,
    owned_sequences: Vec<(String, String)>,
    identity_columns: Vec<String>,
}

fn capture(relid: Oid) -> Result<Shape, MrError> {
    let qualified = super::relname(relid);
    let (schema, name) = schema_and_name(relid);
    let refuse = |reason: String| MrError::CannotRebuild {
        table: qualified.clone(),
        reason,
    };
    let views = rows(
        "SELECT DISTINCT r.ev_class::regclass::text FROM pg_catalog.pg_depend d \
         JOIN pg_catalog.pg_rewrite r ON r.oid = d.objid \
         WHERE d.classid = 'pg_catalog.pg_rewrite'::regclass AND d.refobjid = $1 AND r.ev_class <> $1",
        vec![relid.into()],
    );
    if let Some(v) = views.first() {
        return Err(refuse(format!("view {} depends on it", col(v, 0))));
    }
    if spi::flag(
        "SELECT (EXISTS (SELECT 1 FROM pg_catalog.pg_policy WHERE polrelid = $1) \
          OR EXISTS (SELECT 1 FROM pg_catalog.pg_rewrite WHERE ev_class = $1 AND rulename <> '_RETURN') \
          OR EXISTS (SELECT 1 FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = $1 \
                     WHERE i.inhrelid = $1 OR (i.inhparent = $1 AND c.relkind = 'r')) \
          OR EXISTS (SELECT 1 FROM pg_catalog.pg_constraint WHERE conrelid = $1 AND contype = 'x'))::text",
        vec![relid.into()],
    ) {
        return Err(refuse(
            "it has row-level security policies, rules, inheritance or exclusion constraints"
                .into(),
        ));
    }
    if spi::flag(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_constraint WHERE contype = 'f' \
         AND conrelid = $1 AND confrelid = $1)::text",
        vec![relid.into()],
    ) {
        return Err(refuse("it has a foreign key that references itself".into()));
    }
    let indexes = rows(
        "SELECT ic.relname::text, i.indisprimary::text, i.indisunique::text, con.conname::text, \
           CASE WHEN i.indpred IS NULL AND i.indexprs IS NULL \
                THEN (SELECT pg_catalog.string_agg(a.attname::text, chr(1) ORDER BY k.n) \
                        FROM unnest(i.indkey) WITH ORDINALITY k(attnum, n) \
                        JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
                        WHERE k.n <= i.indnkeyatts) END, \
           pg_catalog.pg_get_indexdef(i.indexrelid), \
           (SELECT pg_catalog.string_agg(a.attname::text, chr(1) ORDER BY k.n) \
              FROM unnest(i.indkey) WITH ORDINALITY k(attnum, n) \
              JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
              WHERE k.n > i.indnkeyatts) \
         FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid \
         LEFT JOIN pg_catalog.pg_constraint con ON con.conindid = i.indexrelid AND con.conrelid = i.indrelid \
           AND con.contype IN ('p', 'u') \
         WHERE i.indrelid = $1 ORDER BY i.indisprimary DESC, ic.relname",
        vec![relid.into()],
    )
    .into_iter()
    .map(|r| Index {
        name: col(&r, 0),
        primary: col(&r, 1) == "true",
        unique: col(&r, 2) == "true",
        constraint: r.get(3).cloned().flatten(),
        columns: r
            .get(4)
            .cloned()
            .flatten()
            .map(|c| c.split('\u{1}').map(str::to_string).collect()),
        def: col(&r, 5),
        include: r
            .get(6)
            .cloned()
            .flatten()
            .map(|c| c.split('\u{1}').map(str::to_string).collect())
            .unwrap_or_default(),
    })
    .collect();
    let outgoing_fks = rows(
        "SELECT conname::text, pg_catalog.pg_get_constraintdef(oid) FROM pg_catalog.pg_constraint \
         WHERE conrelid = $1 AND contype = 'f' ORDER BY conname",
        vec![relid.into()],
    )
    .into_iter()
    .map(|r| (col(&r, 0), col(&r, 1)))
    .collect();
    let triggers = rows(
        "SELECT pg_catalog.pg_get_triggerdef(oid) FROM pg_catalog.pg_trigger \
         WHERE tgrelid = $1 AND NOT tgisinternal AND tgname NOT LIKE 'mr\\_global\\_key\\_%' \
           AND tgname NOT LIKE 'multiregion\\_capture%' AND tgname <> '_multiregion_route' ORDER BY tgname",
        vec![relid.into()],
    )
    .into_iter()
    .map(|r| col(&r, 0))
    .collect();
    let grants = rows(
        "SELECT a.privilege_type, CASE WHEN a.grantee = 0 THEN 'PUBLIC' \
           ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(a.grantee)) END, a.is_grantable::text \
         FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a \
         WHERE c.oid = $1 AND a.grantee <> c.relowner",
        vec![relid.into()],
    )
    .into_iter()
    .map(|r| {
        format!(
            "{} TO {}{}",
            col(&r, 0),
            col(&r, 1),
            if col(&r, 2) == "true" { " WITH GRANT OPTION" } else { "" }
        )
    })
    .collect();
    let owned_sequences = rows(
        "SELECT s.oid::regclass::text, a.attname::text FROM pg_catalog.pg_depend d \
         JOIN pg_catalog.pg_class s ON s.oid = d.objid AND s.relkind = 'S' \
         JOIN pg_catalog.pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid \
         WHERE d.refobjid = $1 AND d.deptype = 'a' AND d.classid = 'pg_catalog.pg_class'::regclass",
        vec![relid.into()],
    )
    .into_iter()
    .map(|r| (col(&r, 0), col(&r, 1)))
    .collect();
    let attrs = |filter: &str| -> Vec<String> {
        rows(
            &format!(
                "SELECT attname::text FROM pg_catalog.pg_attribute WHERE attrelid = $1 \
                 AND attnum > 0 AND NOT attisdropped AND {filter} ORDER BY attnum"
            ),
            vec![relid.into()],
        )
        .into_iter()
        .map(|r| col(&r, 0))
        .collect()
    };
    Ok(Shape {
        indexes,
        outgoing_fks,
        incoming_fks: incoming_fks(relid),
        triggers,
        grants,
        comment: one(
            "SELECT pg_catalog.obj_description($1, 'pg_class')",
            vec![relid.into()],
        ),
        owned_sequences,
        identity_columns: attrs("attidentity <> ''"),
        owner: table_owner(relid),
        relid,
        qualified,
        schema,
        name,
    })
}

/// Foreign keys of other tables that reference `target` (the table or its key table).
fn incoming_fks(target: Oid) -> Vec<IncomingFk> {
    rows(
        "SELECT conrelid::regclass::text, conname::text, pg_catalog.pg_get_constraintdef(oid), \
           (SELECT pg_catalog.string_agg(a.attname::text, chr(1) ORDER BY k.n) \
              FROM unnest(confkey) WITH ORDINALITY k(attnum, n) \
              JOIN pg_catalog.pg_attribute a ON a.attrelid = confrelid AND a.attnum = k.attnum) \
         FROM pg_catalog.pg_constraint WHERE confrelid = $1 AND contype = 'f' AND conrelid <> $1 \
           AND conparentid = 0",
        vec![target.into()],
    )
    .into_iter()
    .map(|r| IncomingFk {
        table: col(&r, 0),
        name: col(&r, 1),
        def: col(&r, 2),
        columns: col(&r, 3).split('\u{1}').map(str::to_string).collect(),
    })
    .collect()
}

/// Replaces `REFERENCES <from>(` in a foreign key's definition.
fn retarget(def: &str, from: &str, to: &str) -> String {
    def.replacen(
        &format!("REFERENCES {from}("),
        &format!("REFERENCES {to}("),
        1,
    )
}

/// The new key columns of an index, or `None` to keep its definition as it is.
type KeyFn<'a> = Box<dyn Fn(&Index) -> Option<Vec<String>> + 'a>;

/// How the twin differs from the table.
struct Layout<'a> {
    /// REGIONAL BY ROW: the region column and the database's regions.
    partition: Option<(&'a str, &'a DatabaseConfig)>,
    /// The column to drop from the twin (the hidden column, leaving REGIONAL BY ROW).
    drop_column: Option<&'a str>,
    /// Unique keys as they must be on the twin, by constraint or index name.
    keys: KeyFn<'a>,
}

/// Builds the twin, moves everything over, and gives it the table's name; returns its oid.
fn rebuild(shape: &Shape, layout: &Layout<'_>) -> Result<Oid, MrError> {
    let temp = format!(
        "{}.{}",
        ident(&shape.schema),
        ident(&format!("{}_mr_new", shape.name))
    );
    for fk in &shape.incoming_fks {
        run(&format!(
            "ALTER TABLE {} DROP CONSTRAINT {}",
            fk.table,
            ident(&fk.name)
        ));
    }
    for (n, index) in shape.indexes.iter().enumerate() {
        run(&format!(
            "ALTER INDEX {}.{} RENAME TO {}",
            ident(&shape.schema),
            ident(&index.name),
            ident(&format!("mr_old_{}_{n}", shape.relid.to_u32()))
        ));
    }
    let partition_by = layout
        .partition
        .map(|(c, _)| format!(" PARTITION BY LIST ({})", ident(c)))
        .unwrap_or_default();
    run(&format!(
        "CREATE TABLE {temp} (LIKE {} INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING IDENTITY \
         INCLUDING CONSTRAINTS INCLUDING COMMENTS INCLUDING STORAGE INCLUDING COMPRESSION \
         INCLUDING STATISTICS){partition_by}",
        shape.qualified
    ));
    if let Some(c) = layout.drop_column {
        run(&format!("ALTER TABLE {temp} DROP COLUMN {}", ident(c)));
    }
    if let Some((_, config)) = layout.partition {
        for region in &config.regions {
            create_partition(&temp, &shape.schema, &shape.name, region, &shape.owner);
        }
    }
    for index in &shape.indexes {
        match (index.unique, (layout.keys)(index)) {
            (true, Some(keys)) => {
                let keys: Vec<String> = keys.iter().map(|k| ident(k)).collect();
                let keys = keys.join(", ");
                let include = if index.include.is_empty() {
                    String::new()
                } else {
                    let cols: Vec<String> = index.include.iter().map(|c| ident(c)).collect();
                    format!(" INCLUDE ({})", cols.join(", "))
                };
                match (&index.constraint, index.primary) {
                    (Some(c), true) => run(&format!(
                        "ALTER TABLE {temp} ADD CONSTRAINT {} PRIMARY KEY ({keys}){include}",
                        ident(c)
                    )),
                    (Some(c), false) => run(&format!(
                        "ALTER TABLE {temp} ADD CONSTRAINT {} UNIQUE ({keys}){include}",
                        ident(c)
                    )),
                    (None, _) => run(&format!(
                        "CREATE UNIQUE INDEX {} ON {temp} ({keys}){include}",
                        ident(&index.name)
                    )),
                }
            }
            (true, None) => {
                return Err(MrError::CannotRebuild {
                    table: shape.qualified.clone(),
                    reason: format!(
                        "unique index {} has expressions or a predicate",
                        ident(&index.name)
                    ),
                })
            }
            (false, _) => {
                let on = format!(" ON {} USING ", shape.qualified);
                let only = format!(" ON ONLY {} USING ", shape.qualified);
                let def = index
                    .def
                    .replacen(&only, &format!(" ON {temp} USING "), 1)
                    .replacen(&on, &format!(" ON {temp} USING "), 1);
                run(&def);
            }
        }
    }
    let columns = rows(
        "SELECT pg_catalog.string_agg(pg_catalog.quote_ident(a.attname), ', ' ORDER BY a.attnum) \
         FROM pg_catalog.pg_attribute a WHERE a.attrelid = $1::regclass AND a.attnum > 0 \
         AND NOT a.attisdropped AND a.attgenerated = '' \
         AND a.attname IN (SELECT attname FROM pg_catalog.pg_attribute WHERE attrelid = $2 \
                           AND attnum > 0 AND NOT attisdropped)",
        vec![temp.as_str().into(), shape.relid.into()],
    );
    let columns = col(columns.first().map(Vec::as_slice).unwrap_or(&[]), 0);
    let overriding = if shape.identity_columns.is_empty() {
        ""
    } else {
        " OVERRIDING SYSTEM VALUE"
    };
    run(&format!(
        "INSERT INTO {temp} ({columns}){overriding} SELECT {columns} FROM {}",
        shape.qualified
    ));
    for (name, def) in &shape.outgoing_fks {
        run(&format!(
            "ALTER TABLE {temp} ADD CONSTRAINT {} {def}",
            ident(name)
        ));
    }
    for def in &shape.triggers {
        let on = format!(" ON {} ", shape.qualified);
        run(&def.replacen(&on, &format!(" ON {temp} "), 1));
    }
    for (seq, column) in &shape.owned_sequences {
        if !shape.identity_columns.contains(column) {
            run(&format!(
                "ALTER SEQUENCE {seq} OWNED BY {temp}.{}",
                ident(column)
            ));
        }
    }
    let mut renamed_sequences: Vec<(String, String)> = Vec::new();
    for column in &shape.identity_columns {
        let seq = |table: &str| {
            one(
                "SELECT pg_catalog.pg_get_serial_sequence($1, $2)",
                vec![table.into(), column.as_str().into()],
            )
        };
        if let (Some(old), Some(new)) = (seq(&shape.qualified), seq(&temp)) {
            // This node's copy only: the cluster-wide counter stays the old sequence's, as
            // the new one takes its name below.
            crate::sequences::local_only(|| {
                run(&format!(
                    "SELECT pg_catalog.setval({}::regclass, last_value, is_called) FROM {old}",
                    lit(&new)
                ))
            });
            let old_name = one(
                "SELECT relname::text FROM pg_catalog.pg_class WHERE oid = $1::regclass",
                vec![old.as_str().into()],
            );
            if let Some(old_name) = old_name {
                renamed_sequences.push((new, old_name));
            }
        }
    }
    for grant in &shape.grants {
        let (privilege, rest) = grant.split_once(" TO ").unwrap_or((grant, ""));
        run(&format!("GRANT {privilege} ON {temp} TO {rest}"));
    }
    if let Some(c) = &shape.comment {
        run(&format!("COMMENT ON TABLE {temp} IS {}", lit(c)));
    }
    run(&format!("DROP TABLE {}", shape.qualified));
    run(&format!(
        "ALTER TABLE {temp} RENAME TO {}",
        ident(&shape.name)
    ));
    run(&format!(
        "ALTER TABLE {} OWNER TO {}",
        shape.qualified,
        ident(&shape.owner)
    ));
    // An identity column's new sequence takes the old one's name (free since the old table
    // was dropped), and with it the old one's cluster-wide counter (crate::sequences).
    for (new, old_name) in &renamed_sequences {
        let current = one(
            "SELECT relname::text FROM pg_catalog.pg_class WHERE oid = $1::regclass",
            vec![new.as_str().into()],
        );
        if current.as_deref() != Some(old_name.as_str()) {
            run(&format!(
                "ALTER SEQUENCE {new} RENAME TO {}",
                ident(old_name)
            ));
        }
    }
    let new = one(
        "SELECT $1::regclass::oid::text",
        vec![shape.qualified.as_str().into()],
    )
    .map(|s| oid(&s))
    .unwrap_or(Oid::INVALID);
    Ok(new)
}

/// Whether global uniqueness of `keys` needs no check (CockroachDB 2022 paper §4.1): a single
/// UUID key filled by `gen_random_uuid()`, or a region column computed only from the key.
fn unique_by_construction(relid: Oid, keys: &[String], region_deps: &Option<Vec<String>>) -> bool {
    if let Some(deps) = region_deps {
        if !deps.is_empty() && deps.iter().all(|d| keys.contains(d)) {
            return true;
        }
    }
    keys.len() == 1
        && spi::flag(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_attrdef d JOIN pg_catalog.pg_attribute a \
               ON a.attrelid = d.adrelid AND a.attnum = d.adnum \
             WHERE d.adrelid = $1 AND a.attname = $2 AND a.attgenerated = '' \
               AND pg_catalog.pg_get_expr(d.adbin, d.adrelid) = 'gen_random_uuid()')::text",
            vec![relid.into(), keys[0].as_str().into()],
        )
}

/// Makes the table REGIONAL BY ROW on `column`; returns the rebuilt table's oid.
pub fn convert_to_rbr(relid: Oid, column: &str, config: &DatabaseConfig) -> Result<Oid, MrError> {
    let qualified = super::relname(relid);
    let relkind = one(
        "SELECT relkind::text FROM pg_catalog.pg_class WHERE oid = $1",
        vec![relid.into()],
    );
    if relkind.as_deref() != Some("r") {
        return Err(MrError::CannotRebuild {
            table: qualified,
            reason: "only ordinary tables can be REGIONAL BY ROW".into(),
        });
    }
    let attr = rows(
        "SELECT (a.atttypid = 'public.crdb_internal_region'::regtype)::text, a.attnotnull::text, \
                (a.attgenerated <> '')::text, \
                pg_catalog.pg_get_expr(d.adbin, d.adrelid), \
                (SELECT pg_catalog.string_agg(DISTINCT b.attname::text, chr(1)) FROM pg_catalog.pg_depend dep \
                   JOIN pg_catalog.pg_attribute b ON b.attrelid = dep.refobjid AND b.attnum = dep.refobjsubid \
                  WHERE ((dep.classid = 'pg_catalog.pg_attrdef'::regclass AND dep.objid = d.oid) \
                         OR (dep.classid = 'pg_catalog.pg_class'::regclass AND dep.objid = a.attrelid \
                             AND dep.objsubid = a.attnum)) \
                    AND dep.refobjid = a.attrelid AND dep.refobjsubid > 0 \
                    AND dep.refobjsubid <> a.attnum) \
         FROM pg_catalog.pg_attribute a LEFT JOIN pg_catalog.pg_attrdef d \
           ON d.adrelid = a.attrelid AND d.adnum = a.attnum \
         WHERE a.attrelid = $1 AND a.attname = $2 AND a.attnum > 0 AND NOT a.attisdropped",
        vec![relid.into(), column.into()],
    );
    let hidden = column == HIDDEN_COLUMN && attr.is_empty();
    let mut region_expr_sql = None;
    let mut region_deps = None;
    if hidden {
        run(&format!(
            "ALTER TABLE {qualified} ADD COLUMN {HIDDEN_COLUMN} {} NOT NULL \
             DEFAULT multiregion.default_to_database_primary_region(multiregion.gateway_region())::{}",
            super::REGION_TYPE,
            super::REGION_TYPE
        ));
    } else {
        let Some(a) = attr.first() else {
            return Err(MrError::NoSuchColumn {
                table: qualified,
                column: column.to_string(),
            });
        };
        if col(a, 0) != "true" {
            return Err(MrError::RegionColumnType {
                column: column.to_string(),
            });
        }
        if col(a, 1) != "true" {
            return Err(MrError::RegionColumnNullable {
                table: qualified,
                column: column.to_string(),
            });
        }
        if col(a, 2) == "true" {
            // PostgreSQL cannot partition by a generated column: it becomes a plain column
            // whose value a CHECK constraint ties to the expression.
            let expr = col(a, 3);
            run(&format!(
                "ALTER TABLE {qualified} ALTER COLUMN {} DROP EXPRESSION",
                ident(column)
            ));
            let (_, name) = schema_and_name(relid);
            run(&format!(
                "ALTER TABLE {qualified} ADD CONSTRAINT {} CHECK ({}::text IS NOT DISTINCT FROM ({expr})::text)",
                ident(&format!("{name}_{column}_computed")),
                ident(column)
            ));
            // A generated column's dependencies are recorded on the column itself, a
            // default's on its pg_attrdef row: the query reads both.
            region_deps = Some(
                col(a, 4)
                    .split('\u{1}')
                    .filter(|d| !d.is_empty())
                    .map(str::to_string)
                    .collect(),
            );
            region_expr_sql = Some(expr);
        }
    }
    let shape = capture(relid)?;
    let region = column.to_string();
    let keys = |index: &Index| -> Option<Vec<String>> {
        let mut keys = index.columns.clone()?;
        if !keys.contains(&region) {
            keys.insert(0, region.clone());
        }
        Some(keys)
    };
    let layout = Layout {
        partition: Some((column, config)),
        drop_column: None,
        keys: Box::new(keys),
    };
    let new = rebuild(&shape, &layout)?;
    // Unique keys without the region column: a key table each, unless unique by construction.
    let mut retargets: Vec<(Vec<String>, String)> = vec![];
    for index in shape.indexes.iter().filter(|i| i.unique) {
        let Some(cols) = &index.columns else { continue };
        if cols.contains(&column.to_string()) {
            continue;
        }
        let constraint = index
            .constraint
            .clone()
            .unwrap_or_else(|| index.name.clone());
        let referenced = shape.incoming_fks.iter().any(|fk| &fk.columns == cols);
        if !referenced && unique_by_construction(new, cols, &region_deps) {
            continue;
        }
        let key_table = create_key_table(new, &shape, &constraint, cols);
        retargets.push((cols.clone(), key_table));
    }
    for fk in &shape.incoming_fks {
        let target = retargets
            .iter()
            .find(|(cols, _)| cols == &fk.columns)
            .map(|(_, kt)| kt.clone())
            .ok_or_else(|| MrError::CannotRebuild {
                table: shape.qualified.clone(),
                reason: format!(
                    "foreign key {} of {} references no unique key",
                    fk.name, fk.table
                ),
            })?;
        let def = retarget(&fk.def, &shape.qualified, &target);
        run(&format!(
            "ALTER TABLE {} ADD CONSTRAINT {} {def}",
            fk.table,
            ident(&fk.name)
        ));
    }
    let row = LocalityRow {
        locality: TableLocality::RegionalByRow {
            column: column.to_string(),
        },
        hidden,
        region_expr_sql,
        auto_rehoming: hidden && crate::gucs::enable_auto_rehoming(),
    };
    catalog::store_locality(
        relid,
        &LocalityRow {
            locality: TableLocality::RegionalByTable { region: None },
            hidden: false,
            region_expr_sql: None,
            auto_rehoming: false,
        },
        None,
    );
    catalog::store_locality(new, &row, None);
    super::local_fk::localize(new);
    Ok(new)
}

/// Creates and fills the key table that keeps `cols` unique across the partitions of `relid`,
/// with the trigger that maintains it; returns its qualified name.
fn create_key_table(relid: Oid, shape: &Shape, constraint: &str, cols: &[String]) -> String {
    let primary = cols.len() == 1
        && shape
            .indexes
            .iter()
            .any(|i| i.primary && i.columns.as_deref() == Some(cols));
    key_table(
        relid,
        &shape.qualified,
        &shape.name,
        primary,
        constraint,
        cols,
    )
}

/// Creates and fills the key table of a UNIQUE index or constraint added to REGIONAL BY ROW
/// table `relid` after it became one (`super::unique`); returns its qualified name.
pub(super) fn add_key_table(relid: Oid, constraint: &str, cols: &[String]) -> String {
    let (_, name) = schema_and_name(relid);
    key_table(
        relid,
        &super::relname(relid),
        &name,
        false,
        constraint,
        cols,
    )
}

/// The key table of `cols` of `qualified` (named `name`): named after the table alone for a
/// single-column primary key, else after the table and the constraint.
fn key_table(
    relid: Oid,
    qualified: &str,
    table_name: &str,
    primary: bool,
    constraint: &str,
    cols: &[String],
) -> String {
    let mut name = table_name.to_string();
    if !primary {
        name = format!("{table_name}_{constraint}");
    }
    let base = name.clone();
    let mut n = 1;
    while one(
        "SELECT pg_catalog.to_regclass('multiregion_keys.' || pg_catalog.quote_ident($1))::text",
        vec![name.as_str().into()],
    )
    .is_some()
    {
        n += 1;
        name = format!("{base}_{n}");
    }
    let mut index = constraint.to_string();
    let mut m = 1;
    while one(
        "SELECT pg_catalog.to_regclass('multiregion_keys.' || pg_catalog.quote_ident($1))::text",
        vec![index.as_str().into()],
    )
    .is_some()
    {
        m += 1;
        index = format!("{constraint}_{m}");
    }
    let key_table = format!("multiregion_keys.{}", ident(&name));
    let defs: Vec<String> = cols
        .iter()
        .map(|c| {
            one(
                "SELECT pg_catalog.quote_ident(attname) || ' ' || pg_catalog.format_type(atttypid, atttypmod) \
                 FROM pg_catalog.pg_attribute WHERE attrelid = $1 AND attname = $2",
                vec![relid.into(), c.as_str().into()],
            )
            .unwrap_or_default()
        })
        .collect();
    let keys: Vec<String> = cols.iter().map(|c| ident(c)).collect();
    let keys = keys.join(", ");
    run(&format!(
        "CREATE TABLE {key_table} ({}, CONSTRAINT {} PRIMARY KEY ({keys}))",
        defs.join(", "),
        ident(&index)
    ));
    run(&format!(
        "COMMENT ON TABLE {key_table} IS {}",
        lit(&format!(
            "pg_multiregion: keeps ({keys}) of {} unique across regions",
            qualified
        ))
    ));
    run(&format!(
        "GRANT SELECT, REFERENCES ON {key_table} TO PUBLIC"
    ));
    let not_null: Vec<String> = cols
        .iter()
        .map(|c| format!("{} IS NOT NULL", ident(c)))
        .collect();
    run(&format!(
        "INSERT INTO {key_table} SELECT DISTINCT {keys} FROM {} WHERE {}",
        qualified,
        not_null.join(" AND ")
    ));
    run_with(
        "INSERT INTO multiregion.global_key (relid, constraint_name, key_table, columns) \
         VALUES ($1, $2, $3::regclass, $4::name[])",
        vec![
            relid.into(),
            constraint.into(),
            key_table.as_str().into(),
            cols.to_vec().into(),
        ],
    );
    key_triggers(qualified, &key_table, constraint, cols);
    key_table
}

/// The triggers that keep `key_table` (for constraint `constraint`, columns `cols`) with the
/// rows of REGIONAL BY ROW table `qualified`.
pub(super) fn key_triggers(qualified: &str, key_table: &str, constraint: &str, cols: &[String]) {
    let keys: Vec<String> = cols.iter().map(|c| ident(c)).collect();
    let keys = keys.join(", ");
    run(&format!(
        "CREATE TRIGGER {} AFTER INSERT OR DELETE OR UPDATE OF {keys} ON {} FOR EACH ROW \
         EXECUTE FUNCTION multiregion.maintain_global_key({}, {})",
        ident(&format!("mr_global_key_{constraint}")),
        qualified,
        lit(key_table),
        lit(constraint)
    ));
    // Enabled also for replica mode, where it records nothing (with row replication on the
    // key table is a range of its own): a schema change rewriting rows on every node alike
    // keeps each node's key table with its rows.
    run(&format!(
        "ALTER TABLE {} ENABLE ALWAYS TRIGGER {}",
        qualified,
        ident(&format!("mr_global_key_{constraint}"))
    ));
    run(&format!(
        "CREATE TRIGGER {} AFTER TRUNCATE ON {} FOR EACH STATEMENT \
         EXECUTE FUNCTION multiregion.truncate_global_key({}, {})",
        ident(&format!("mr_global_key_truncate_{constraint}")),
        qualified,
        lit(key_table),
        lit(constraint)
    ));
}

/// Moves the key table of `relid`'s global key `from` to constraint `to` (the primary key's
/// old columns, kept unique under a new name): its catalog row and its triggers.
pub(super) fn rename_global_key(relid: Oid, from: &str, to: &str) {
    let Some(row) = rows(
        "SELECT key_table::text, pg_catalog.array_to_string(columns, chr(1)) \
         FROM multiregion.global_key WHERE relid = $1 AND constraint_name = $2",
        vec![relid.into(), from.into()],
    )
    .into_iter()
    .next() else {
        return;
    };
    let key_table = col(&row, 0);
    let cols: Vec<String> = col(&row, 1).split('\u{1}').map(str::to_string).collect();
    let qualified = super::relname(relid);
    // The table before its partitions, as writers and appliers lock them: DROP TRIGGER on a
    // partitioned table takes the partitions first, and deadlocked with an applier holding
    // the table (regress/specs/rename_key_lock_order.spec).
    // SAFETY: LockRelationOid takes a heavyweight lock by OID in the current transaction (a
    // utility statement's); it reads no relation and errors through PostgreSQL's usual path.
    #[allow(unsafe_code)]
    unsafe {
        pgrx::pg_sys::LockRelationOid(
            relid,
            pgrx::pg_sys::AccessExclusiveLock as pgrx::pg_sys::LOCKMODE,
        )
    };
    for trigger in [
        format!("mr_global_key_{from}"),
        format!("mr_global_key_truncate_{from}"),
    ] {
        run(&format!(
            "DROP TRIGGER IF EXISTS {} ON {qualified}",
            ident(&trigger)
        ));
    }
    run_with(
        "UPDATE multiregion.global_key SET constraint_name = $3 \
         WHERE relid = $1 AND constraint_name = $2",
        vec![relid.into(), from.into(), to.into()],
    );
    key_triggers(&qualified, &key_table, to, &cols);
    // Its violations are reported under its index's name: the new one, where it is free.
    if let Some(index) = one(
        "SELECT conname::text FROM pg_catalog.pg_constraint \
         WHERE conrelid = $1::regclass AND contype = 'p'",
        vec![key_table.as_str().into()],
    ) {
        let free = one(
            "SELECT pg_catalog.to_regclass('multiregion_keys.' || pg_catalog.quote_ident($1))::text",
            vec![to.into()],
        )
        .is_none();
        if free {
            run(&format!(
                "ALTER TABLE {key_table} RENAME CONSTRAINT {} TO {}",
                ident(&index),
                ident(to)
            ));
        }
    }
}

/// Keeps this node's rows of the REGIONAL BY ROW table, by region, as they are before its
/// partitions go (`multiregion.merge_seed`): the one range the table becomes starts from
/// each old partition's rows as that partition's leaseholder held them. Only with row
/// replication on (otherwise each node's rows stay its own).
fn keep_merge_seed(relid: Oid, column: &str, qualified: &str) {
    if !crate::sidecar::replication_enabled().unwrap_or(true) {
        return;
    }
    let (schema, name) = schema_and_name(relid);
    run_with(
        "DELETE FROM multiregion.merge_seed WHERE schema_name = $1 AND table_name = $2",
        vec![schema.as_str().into(), name.as_str().into()],
    );
    run_with(
        &format!(
            "INSERT INTO multiregion.merge_seed (schema_name, table_name, region, row_data) \
             SELECT $1, $2, t.{}::text, pg_catalog.to_jsonb(t) FROM {qualified} t",
            ident(column)
        ),
        vec![schema.as_str().into(), name.as_str().into()],
    );
}

/// Makes a REGIONAL BY ROW table an ordinary table again (its locality is set by the caller);
/// the system-provided region column goes, a computed one is computed by PostgreSQL again.
pub fn convert_from_rbr(relid: Oid, current: &LocalityRow) -> Result<Oid, MrError> {
    let TableLocality::RegionalByRow { column } = &current.locality else {
        return Ok(relid);
    };
    let global_keys: Vec<(String, Vec<String>, String)> = rows(
        "SELECT constraint_name::text, pg_catalog.array_to_string(columns, chr(1)), key_table::text \
         FROM multiregion.global_key WHERE relid = $1",
        vec![relid.into()],
    )
    .into_iter()
    .map(|r| (col(&r, 0), col(&r, 1).split('\u{1}').map(str::to_string).collect(), col(&r, 2)))
    .collect();
    // Keys made local to the row's region lose the region, which leaves the unique keys.
    let local_fks = super::local_fk::take_local(relid);
    let mut shape = capture(relid)?;
    // Foreign keys that reference the key tables come back to the table.
    let mut incoming = vec![];
    for (_, _, kt) in &global_keys {
        let kt_oid =
            one("SELECT $1::regclass::oid::text", vec![kt.as_str().into()]).map(|s| oid(&s));
        if let Some(kt_oid) = kt_oid {
            for fk in incoming_fks(kt_oid) {
                run(&format!(
                    "ALTER TABLE {} DROP CONSTRAINT {}",
                    fk.table,
                    ident(&fk.name)
                ));
                incoming.push((fk, kt.clone()));
            }
        }
    }
    if let Some(expr) = &current.region_expr_sql {
        let (_, name) = schema_and_name(relid);
        run(&format!(
            "ALTER TABLE {} DROP CONSTRAINT IF EXISTS {}",
            shape.qualified,
            ident(&format!("{name}_{column}_computed"))
        ));
        let _ = expr;
    }
    let hidden = current.hidden;
    let region = column.clone();
    let gk = global_keys.clone();
    let keys = move |index: &Index| -> Option<Vec<String>> {
        let name = index
            .constraint
            .clone()
            .unwrap_or_else(|| index.name.clone());
        if let Some((_, cols, _)) = gk.iter().find(|(c, _, _)| *c == name) {
            return Some(cols.clone());
        }
        let mut keys = index.columns.clone()?;
        if hidden {
            keys.retain(|k| k != &region);
        }
        Some(keys)
    };
    // Indexes were captured under their current names; the PRIMARY KEY and UNIQUE ones keep
    // their constraint names.
    shape.incoming_fks.clear();
    let layout = Layout {
        partition: None,
        drop_column: if current.hidden {
            Some(column.as_str())
        } else {
            None
        },
        keys: Box::new(keys),
    };
    keep_merge_seed(relid, column, &shape.qualified);
    let new = rebuild(&shape, &layout)?;
    if let Some(expr) = &current.region_expr_sql {
        run(&format!(
            "ALTER TABLE {} DROP COLUMN {c}, ADD COLUMN {c} {} NOT NULL GENERATED ALWAYS AS ({expr}) STORED",
            shape.qualified,
            super::REGION_TYPE,
            c = ident(column)
        ));
    }
    for (_, _, kt) in &global_keys {
        // Usually gone already: the drop of the old table took it (multiregion.forget_dropped).
        if one(
            "SELECT pg_catalog.to_regclass($1)::text",
            vec![kt.as_str().into()],
        )
        .is_some()
        {
            run(&format!("DROP TABLE {kt}"));
        }
    }
    run_with(
        "DELETE FROM multiregion.global_key WHERE relid = $1",
        vec![relid.into()],
    );
    for (fk, kt) in incoming {
        let def = retarget(&fk.def, &kt, &shape.qualified);
        run(&format!(
            "ALTER TABLE {} ADD CONSTRAINT {} {def}",
            fk.table,
            ident(&fk.name)
        ));
    }
    super::local_fk::restore(new, local_fks);
    run_with(
        "DELETE FROM multiregion.table_locality WHERE relid = $1",
        vec![relid.into()],
    );
    Ok(new)
}
