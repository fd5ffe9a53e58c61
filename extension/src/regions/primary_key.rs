//! CockroachDB's `ALTER TABLE t ALTER PRIMARY KEY USING COLUMNS (…) [USING HASH …]`.
//!
//! PostgreSQL changes a primary key by dropping the constraint and adding another; CockroachDB
//! does it in one statement and keeps the old key unique (a `UNIQUE` index `<table>_<cols>_key`)
//! so that rows stay addressable and foreign keys to it stay valid. Here: the old key's unique
//! index is created (unless one already covers exactly its columns), foreign keys bound to the
//! old primary key's index are dropped and added back (PostgreSQL binds a foreign key to one
//! index, and would refuse to drop it), then the primary key is replaced, all in the
//! statement's transaction. Every node runs the same steps (the statement is replicated as
//! written, like other DDL through this door).
//!
//! A REGIONAL BY ROW table's keys lead with the region (PostgreSQL's partitioning needs it),
//! and a key without the region is kept unique across regions by a key table (`rbr.rs`): the
//! new key gets the region in front and a key table of its own — its rows checked first where
//! the statement was typed, as a unique key added later (`unique.rs`) — and the old key's key
//! table stays, moved to the unique index that now keeps the old columns.

use super::spi::{flag, ident, rows, run};
use super::{catalog, require_table_owner};
use crate::error::MrError;
use mr_meta::TableLocality;
use mr_zoneconfig::ddl::{DdlError, INVALID_TABLE_DEFINITION};
use pgrx::pg_sys::Oid;

/// CockroachDB's `pgcode.InvalidSchemaDefinition`.
const INVALID_SCHEMA_DEFINITION: &str = "42P15";

/// `typed_here`: the statement was typed on this node (its rows are checked here).
pub(super) fn alter_primary_key(
    relid: Oid,
    columns: &[String],
    bucket_count: Option<u32>,
    typed_here: bool,
) -> Result<(), MrError> {
    require_table_owner(relid)?;
    let table = super::relname(relid);
    let region = match catalog::locality(relid).locality {
        TableLocality::RegionalByRow { column } => Some(column),
        _ => None,
    };
    // The new key's columns: present, and NOT NULL (CockroachDB does not make them so).
    for c in columns {
        let nullable = rows(
            "SELECT (NOT attnotnull)::text FROM pg_catalog.pg_attribute \
             WHERE attrelid = $1 AND attname = $2 AND attnum > 0 AND NOT attisdropped",
            vec![relid.into(), c.as_str().into()],
        );
        match nullable.first().and_then(|r| r.first().cloned().flatten()) {
            None => {
                return Err(MrError::NoSuchColumn {
                    table: table.clone(),
                    column: c.clone(),
                })
            }
            Some(n) if n == "true" => {
                return Err(MrError::Ddl(DdlError {
                    sqlstate: INVALID_SCHEMA_DEFINITION,
                    message: format!("cannot use nullable column \"{c}\" in primary key"),
                    hint: None,
                }))
            }
            Some(_) => {}
        }
    }
    let mut distinct = columns.to_vec();
    distinct.sort();
    distinct.dedup();
    if distinct.len() != columns.len() {
        return Err(MrError::Ddl(DdlError {
            sqlstate: INVALID_TABLE_DEFINITION,
            message: "a primary key cannot name a column twice".into(),
            hint: None,
        }));
    }
    let bare = table_name(relid);
    let shard = bucket_count.map(|n| mr_sql::Shard::new(columns.to_vec(), n));
    // A REGIONAL BY ROW table's key as PostgreSQL holds it: the region in front, unless named;
    // a key without it is unique across regions through a key table.
    let declared = columns.to_vec();
    let global = region.as_ref().filter(|r| !declared.contains(r));
    let columns: &[String] = &match global {
        Some(r) => std::iter::once(r.clone())
            .chain(declared.iter().cloned())
            .collect(),
        None => declared.clone(),
    };
    // The old primary key: its constraint, index and key columns.
    let old = rows(
        "SELECT con.conname::text, con.conindid::oid::text, \
           (SELECT pg_catalog.string_agg(a.attname::text, chr(1) ORDER BY k.n) \
              FROM unnest(con.conkey) WITH ORDINALITY k(attnum, n) \
              JOIN pg_catalog.pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = k.attnum), \
           (SELECT pg_catalog.string_agg(a.attname::text, chr(1) ORDER BY k.n) \
              FROM pg_catalog.pg_index i, unnest(i.indkey) WITH ORDINALITY k(attnum, n) \
              JOIN pg_catalog.pg_attribute a ON a.attnum = k.attnum \
             WHERE i.indexrelid = con.conindid AND a.attrelid = con.conrelid \
               AND k.n > i.indnkeyatts) \
         FROM pg_catalog.pg_constraint con WHERE con.conrelid = $1 AND con.contype = 'p'",
        vec![relid.into()],
    );
    let split = |s: Option<String>| -> Vec<String> {
        s.map(|s| s.split('\u{1}').map(str::to_string).collect())
            .unwrap_or_default()
    };
    let old = old.into_iter().next().map(|r| {
        let get = |i: usize| r.get(i).cloned().flatten();
        (
            get(0).unwrap_or_default(),
            get(1).unwrap_or_default(),
            split(get(2)),
            split(get(3)),
        )
    });
    if let Some((_, _, old_columns, include)) = &old {
        let same_shard = match &shard {
            Some(s) => include == &vec![s.name()],
            None => include.is_empty(),
        };
        if old_columns == columns && same_shard {
            return Ok(());
        }
    }
    if let (Some(r), true) = (global, typed_here) {
        super::unique::check_columns(relid, &format!("{bare}_pkey"), &declared, r)?;
    }
    if let Some(s) = &shard {
        run(&format!(
            "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {}",
            s.definition()
        ));
    }
    let mut foreign_keys = vec![];
    if let Some((name, index, old_columns, _)) = &old {
        // The old key stays unique, as CockroachDB keeps it.
        let covered = flag(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = $1 \
               AND i.indisunique AND NOT i.indisprimary AND i.indpred IS NULL \
               AND i.indexprs IS NULL AND i.indnkeyatts = $2 \
               AND (SELECT pg_catalog.array_agg(a.attname::text ORDER BY k.n) \
                      FROM unnest(i.indkey) WITH ORDINALITY k(attnum, n) \
                      JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid \
                       AND a.attnum = k.attnum WHERE k.n <= i.indnkeyatts) = $3)::text",
            vec![
                relid.into(),
                (old_columns.len() as i16).into(),
                old_columns.clone().into(),
            ],
        );
        // (Only the sharding changing leaves the key as unique as it was.) A REGIONAL BY ROW
        // table's index is named after the declared columns, without the region.
        let old_declared: Vec<&String> = old_columns
            .iter()
            .filter(|c| Some(*c) != region.as_ref())
            .collect();
        let keep = format!(
            "{bare}_{}_key",
            old_declared
                .iter()
                .map(|c| c.as_str())
                .collect::<Vec<_>>()
                .join("_")
        );
        if !covered && old_columns != columns {
            let cols: Vec<String> = old_columns.iter().map(|c| ident(c)).collect();
            run(&format!(
                "CREATE UNIQUE INDEX {} ON {table} ({})",
                ident(&keep),
                cols.join(", ")
            ));
        }
        // The old key's key table now keeps the old columns under that index's name (before
        // the constraint goes: dropping an index with a key table drops the key table).
        if region.is_some() && old_columns != columns {
            super::rbr::rename_global_key(relid, name, &keep);
        }
        // Foreign keys bound to the old primary key's index move to the unique one.
        for r in rows(
            "SELECT conrelid::regclass::text, conname::text, \
                    pg_catalog.pg_get_constraintdef(oid) \
             FROM pg_catalog.pg_constraint \
             WHERE contype = 'f' AND confrelid = $1 AND conindid = $2::oid AND conparentid = 0 \
             ORDER BY oid",
            vec![relid.into(), index.as_str().into()],
        ) {
            let get = |i: usize| r.get(i).cloned().flatten().unwrap_or_default();
            run(&format!(
                "ALTER TABLE {} DROP CONSTRAINT {}",
                get(0),
                ident(&get(1))
            ));
            foreign_keys.push((get(0), get(1), get(2)));
        }
        run(&format!(
            "ALTER TABLE {table} DROP CONSTRAINT {}",
            ident(name)
        ));
    }
    let cols: Vec<String> = columns.iter().map(|c| ident(c)).collect();
    let include = shard
        .as_ref()
        .map(|s| format!(" INCLUDE ({})", s.quoted_name()))
        .unwrap_or_default();
    run(&format!(
        "ALTER TABLE {table} ADD CONSTRAINT {} PRIMARY KEY ({}){include}",
        ident(&format!("{bare}_pkey")),
        cols.join(", ")
    ));
    for (child, name, def) in foreign_keys {
        run(&format!(
            "ALTER TABLE {child} ADD CONSTRAINT {} {def}",
            ident(&name)
        ));
    }
    if global.is_some() {
        super::spi::as_extension_owner(|| {
            super::rbr::add_key_table(relid, &format!("{bare}_pkey"), &declared)
        });
    }
    Ok(())
}

fn table_name(relid: Oid) -> String {
    rows(
        "SELECT relname::text FROM pg_catalog.pg_class WHERE oid = $1",
        vec![relid.into()],
    )
    .into_iter()
    .next()
    .and_then(|r| r.first().cloned().flatten())
    .unwrap_or_default()
}
