//! Foreign keys checked in the row's own region.
//!
//! A foreign key to a REGIONAL BY ROW table references the key table that keeps the key unique
//! across its partitions (`multiregion_keys`, one range leased in the primary region): every
//! check, and the row lock it takes, crosses the WAN from another region (MovR's rides and
//! vehicles: three round trips to us-east1 for an insert in europe-west1). CockroachDB checks
//! such a key in the local region first. Here the same comes from the schema: when the child
//! and the parent are both REGIONAL BY ROW and compute their region by the same expression
//! from columns the key pairs with the same-named column (MovR's `region` from `city`, the
//! key `(city, owner_id) → (city, id)`), a referencing row and the row it references always have
//! the same region, so the key may include it: `(region, city, owner_id) → users (region,
//! city, id)`. It means exactly what the key meant, is checked against the parent's partition
//! in the row's region — leased there — and is served by its unique index, which already
//! leads with the region.
//!
//! Keys are made local when either side becomes REGIONAL BY ROW, and made plain again when
//! the parent stops being REGIONAL BY ROW (its unique keys lose the region again).

use super::catalog;
use super::spi::{flag, ident, one, rows, run};
use mr_meta::TableLocality;
use pgrx::pg_sys::Oid;

/// A foreign key, as `pg_constraint` has it.
struct Fk {
    name: String,
    child: Oid,
    referenced: Oid,
    child_columns: Vec<String>,
    referenced_columns: Vec<String>,
    /// `MATCH …`, `ON UPDATE …`, `ON DELETE …` and deferrability, as SQL.
    tail: String,
    /// ON UPDATE or ON DELETE sets columns to NULL or their default (the region column would
    /// be one of them).
    sets_columns: bool,
}

fn split(s: Option<String>) -> Vec<String> {
    s.unwrap_or_default()
        .split('\u{1}')
        .filter(|c| !c.is_empty())
        .map(str::to_string)
        .collect()
}

fn action(code: &str) -> &'static str {
    match code {
        "r" => "RESTRICT",
        "c" => "CASCADE",
        "n" => "SET NULL",
        "d" => "SET DEFAULT",
        _ => "NO ACTION",
    }
}

/// The (top-level) foreign keys matching `condition` over `pg_constraint c`, with `$1`.
fn foreign_keys(condition: &str, arg: Oid) -> Vec<Fk> {
    let names = |key: &str, rel: &str| {
        format!(
            "(SELECT pg_catalog.string_agg(a.attname::text, chr(1) ORDER BY k.n) \
               FROM unnest(c.{key}) WITH ORDINALITY k(attnum, n) \
               JOIN pg_catalog.pg_attribute a ON a.attrelid = c.{rel} AND a.attnum = k.attnum)"
        )
    };
    rows(
        &format!(
            "SELECT c.conname::text, c.conrelid::oid::text, c.confrelid::oid::text, \
               {}, {}, c.confmatchtype::text, c.confupdtype::text, c.confdeltype::text, \
               c.condeferrable::text, c.condeferred::text \
             FROM pg_catalog.pg_constraint c \
             WHERE c.contype = 'f' AND c.conparentid = 0 AND ({condition}) ORDER BY c.oid",
            names("conkey", "conrelid"),
            names("confkey", "confrelid"),
        ),
        vec![arg.into()],
    )
    .into_iter()
    .map(|r| {
        let text = |i: usize| r.get(i).cloned().flatten().unwrap_or_default();
        let oid = |i: usize| Oid::from(text(i).parse::<u32>().unwrap_or(0));
        let matching = match text(5).as_str() {
            "f" => " MATCH FULL",
            "p" => " MATCH PARTIAL",
            _ => "",
        };
        let deferral = match (text(8).as_str(), text(9).as_str()) {
            ("true", "true") => " DEFERRABLE INITIALLY DEFERRED",
            ("true", _) => " DEFERRABLE",
            _ => "",
        };
        let (on_update, on_delete) = (text(6), text(7));
        Fk {
            name: text(0),
            child: oid(1),
            referenced: oid(2),
            child_columns: split(r.get(3).cloned().flatten()),
            referenced_columns: split(r.get(4).cloned().flatten()),
            tail: format!(
                "{matching} ON UPDATE {} ON DELETE {}{deferral}",
                action(&on_update),
                action(&on_delete)
            ),
            sets_columns: [&on_update, &on_delete]
                .iter()
                .any(|a| a.as_str() == "n" || a.as_str() == "d"),
        }
    })
    .collect()
}

/// A REGIONAL BY ROW table's region column, the expression it is computed by, and the
/// columns that expression reads; `None` for any other table, or a region not computed.
fn computed_region(relid: Oid) -> Option<(String, String, Vec<String>)> {
    let row = catalog::locality(relid);
    let TableLocality::RegionalByRow { column } = row.locality else {
        return None;
    };
    let expr = row.region_expr_sql?;
    // The CHECK constraint that ties the column to its expression names what it reads.
    let reads = split(one(
        "SELECT pg_catalog.string_agg(a.attname::text, chr(1)) \
           FROM pg_catalog.pg_constraint c JOIN pg_catalog.pg_class t ON t.oid = c.conrelid \
           JOIN pg_catalog.pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = ANY (c.conkey) \
          WHERE c.conrelid = $1 AND c.contype = 'c' AND c.conname = t.relname || '_' || $2 || '_computed' \
            AND a.attname <> $2",
        vec![relid.into(), column.as_str().into()],
    ));
    (!reads.is_empty()).then_some((column, expr, reads))
}

/// The REGIONAL BY ROW table whose key table `relid` is, or `relid` itself.
fn keyed_table(relid: Oid) -> Oid {
    one(
        "SELECT relid::oid::text FROM multiregion.global_key WHERE key_table = $1",
        vec![relid.into()],
    )
    .and_then(|o| o.parse::<u32>().ok())
    .map(Oid::from)
    .unwrap_or(relid)
}

/// Whether `relid` has a plain unique index on exactly `columns` (in any order).
fn unique_on(relid: Oid, columns: &[String]) -> bool {
    flag(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_index i \
           WHERE i.indrelid = $1 AND i.indisunique AND i.indpred IS NULL \
             AND i.indexprs IS NULL AND i.indnkeyatts = pg_catalog.cardinality($2::text[]) \
             AND (SELECT pg_catalog.array_agg(a.attname::text ORDER BY a.attname) \
                    FROM pg_catalog.pg_attribute a \
                   WHERE a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey::int2[])) \
                 = (SELECT pg_catalog.array_agg(x ORDER BY x) FROM unnest($2::text[]) x))::text",
        vec![relid.into(), columns.to_vec().into()],
    )
}

fn qualified(relid: Oid) -> String {
    one("SELECT $1::regclass::text", vec![relid.into()]).unwrap_or_default()
}

fn columns_sql(columns: &[String]) -> String {
    columns
        .iter()
        .map(|c| ident(c))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Replaces foreign key `fk` of its table by `columns → parent (parent_columns)`.
fn replace(fk: &Fk, columns: &[String], parent: Oid, parent_columns: &[String]) {
    let child = qualified(fk.child);
    run(&format!(
        "ALTER TABLE {child} DROP CONSTRAINT {}",
        ident(&fk.name)
    ));
    run(&format!(
        "ALTER TABLE {child} ADD CONSTRAINT {} FOREIGN KEY ({}) REFERENCES {}({}){}",
        ident(&fk.name),
        columns_sql(columns),
        qualified(parent),
        columns_sql(parent_columns),
        fk.tail
    ));
}

/// Makes local every foreign key from or to `relid` (just made REGIONAL BY ROW) that can be.
pub fn localize(relid: Oid) {
    let keys = foreign_keys(
        "c.conrelid = $1 OR c.confrelid = $1 OR c.confrelid IN \
           (SELECT key_table FROM multiregion.global_key WHERE relid = $1)",
        relid,
    );
    for fk in keys {
        let parent = keyed_table(fk.referenced);
        if fk.sets_columns || fk.child == parent {
            continue;
        }
        let (Some((child_region, child_expr, reads)), Some((parent_region, parent_expr, _))) =
            (computed_region(fk.child), computed_region(parent))
        else {
            continue;
        };
        // Every column the (same) expression reads is paired by the key with the parent's
        // column of that name: the two rows' regions are then the same value.
        let paired = |r: &String| {
            fk.child_columns
                .iter()
                .zip(&fk.referenced_columns)
                .any(|(c, p)| c == r && p == r)
        };
        if child_expr != parent_expr
            || fk.child_columns.contains(&child_region)
            || !reads.iter().all(paired)
        {
            continue;
        }
        let columns = [vec![child_region], fk.child_columns.clone()].concat();
        let parent_columns = [vec![parent_region], fk.referenced_columns.clone()].concat();
        if !unique_on(parent, &parent_columns) {
            continue;
        }
        replace(&fk, &columns, parent, &parent_columns);
    }
}

/// A local foreign key taken off a REGIONAL BY ROW table about to become another locality.
pub struct Taken {
    fk: Fk,
}

/// Before REGIONAL BY ROW table `relid` is rebuilt as another locality: drops the local
/// foreign keys that reference it, for [`restore`] to add back without the region.
pub fn take_local(relid: Oid) -> Vec<Taken> {
    let Some((parent_region, _, _)) = computed_region(relid) else {
        return Vec::new();
    };
    let mut taken = Vec::new();
    for fk in foreign_keys("c.confrelid = $1 AND c.conrelid <> $1", relid) {
        let child_region = match catalog::locality(fk.child).locality {
            TableLocality::RegionalByRow { column } => column,
            _ => continue,
        };
        if fk.referenced_columns.first() != Some(&parent_region)
            || fk.child_columns.first() != Some(&child_region)
            || fk.child_columns.len() < 2
        {
            continue;
        }
        run(&format!(
            "ALTER TABLE {} DROP CONSTRAINT {}",
            qualified(fk.child),
            ident(&fk.name)
        ));
        taken.push(Taken { fk });
    }
    taken
}

/// Adds the keys [`take_local`] took back to the rebuilt `relid`, without the region.
pub fn restore(relid: Oid, taken: Vec<Taken>) {
    for Taken { fk } in taken {
        run(&format!(
            "ALTER TABLE {} ADD CONSTRAINT {} FOREIGN KEY ({}) REFERENCES {}({}){}",
            qualified(fk.child),
            ident(&fk.name),
            columns_sql(&fk.child_columns[1..]),
            qualified(relid),
            columns_sql(&fk.referenced_columns[1..]),
            fk.tail
        ));
    }
}
