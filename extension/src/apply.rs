//! The row changes of one replicated entry, written into this node's copy
//! (`multiregion.apply_changes`, called by `multiregion.apply_range_txn`).
//!
//! Every follower applies every transaction, so this is on the hot path of replication: it
//! runs one prepared statement per run of changes, kept for the backend's life (pgmr's
//! applier connections live long), instead of building, parsing and planning a dynamic
//! statement and reading the relation's key, columns and sequences from the catalog for each
//! change, as the PL/pgSQL `multiregion.apply_change` / `apply_inserts` do (still used by
//! snapshot installs, which run once per range). A relation's statements are forgotten when
//! its relcache entry is invalidated (any DDL on it, a rename included), and rebuilt on next
//! use. Rows stay JSON text end to end (`RawValue`): numbers are never rounded through f64.

use crate::error::MrError;
use crate::regions::spi;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient};
use pgrx::PgOid;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// One captured change, as `replication::capture` writes it.
#[derive(Deserialize)]
struct Change<'a> {
    s: String,
    t: String,
    op: String,
    #[serde(borrow)]
    old: Option<&'a RawValue>,
    #[serde(borrow)]
    new: Option<&'a RawValue>,
}

/// What applying changes needs of one relation, with its statements prepared.
struct Rel {
    relid: pg_sys::Oid,
    /// The partitioned tables above it, root first: locked before it (see [`lock_ancestors`]).
    ancestors: Vec<pg_sys::Oid>,
    /// Replaces rows by key: `DELETE … WHERE (key) IN (rows of $1)`; `None` without a key.
    delete_keys: Option<OwnedPreparedStatement>,
    /// `INSERT … OVERRIDING SYSTEM VALUE SELECT … FROM jsonb_populate_recordset(…, $1)`.
    insert: OwnedPreparedStatement,
    /// Deletes the one row `$1` names: by key, or (without one) by the whole row.
    delete_one: OwnedPreparedStatement,
    /// Sequences the table's columns draw from, with their columns: moved past the values
    /// drawn, so that this node, once it leases the range, never hands out a logged key.
    sequences: Vec<(pg_sys::Oid, String)>,
}

thread_local! {
    /// By (schema, table) as the changes name them.
    static RELS: RefCell<HashMap<(String, String), Rc<Rel>>> = RefCell::new(HashMap::new());
    /// Statements of forgotten relations, freed on the next call: never inside the
    /// invalidation callback, which can run while one of them is executing.
    static FORGOTTEN: RefCell<Vec<Rc<Rel>>> = const { RefCell::new(Vec::new()) };
}

/// Forgets the statements of `relid` (all relations for `InvalidOid`).
pub fn forget(relid: pg_sys::Oid) {
    RELS.with(|m| {
        let mut m = m.borrow_mut();
        let gone: Vec<(String, String)> = m
            .iter()
            .filter(|(_, r)| relid == pg_sys::InvalidOid || r.relid == relid)
            .map(|(k, _)| k.clone())
            .collect();
        FORGOTTEN.with(|f| {
            let mut f = f.borrow_mut();
            for k in gone {
                if let Some(r) = m.remove(&k) {
                    f.push(r);
                }
            }
        });
    });
}

/// Applies a transaction's changes (a JSON array, in order) to this node's relations;
/// consecutive inserts into one relation in one statement. The caller sets
/// `session_replication_role` so that no trigger or foreign key fires.
#[pg_extern(
    schema = "multiregion",
    sql = r#"
CREATE FUNCTION multiregion."apply_changes"("p_changes" text) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
LANGUAGE c
AS 'MODULE_PATHNAME', 'apply_changes_wrapper';
REVOKE EXECUTE ON FUNCTION multiregion.apply_changes(text) FROM PUBLIC;
"#
)]
fn apply_changes(p_changes: &str) {
    FORGOTTEN.with(|f| f.borrow_mut().clear());
    let changes: Vec<Change> = serde_json::from_str(p_changes).unwrap_or_else(|e| {
        MrError::BadArgument {
            what: "changes",
            value: e.to_string(),
            expected: "a JSON array of captured row changes",
        }
        .raise()
    });
    Spi::connect_mut(|c| {
        let mut i = 0;
        while i < changes.len() {
            let ch = &changes[i];
            if ch.op == "I" {
                // A run of inserts into one relation: one statement.
                let mut rows = String::from("[");
                let mut j = i;
                while j < changes.len()
                    && changes[j].op == "I"
                    && changes[j].s == ch.s
                    && changes[j].t == ch.t
                {
                    if j > i {
                        rows.push(',');
                    }
                    rows.push_str(changes[j].new.map_or("null", |v| v.get()));
                    j += 1;
                }
                rows.push(']');
                let rel = rel(c, &ch.s, &ch.t);
                insert_rows(c, &rel, &rows, changes[i..j].iter().filter_map(|x| x.new));
                i = j;
                continue;
            }
            match ch.op.as_str() {
                "T" => {
                    rel(c, &ch.s, &ch.t); // locks its ancestors first
                    let sql = format!("TRUNCATE {}.{}", spi::ident(&ch.s), spi::ident(&ch.t));
                    run(c.update(sql.as_str(), None, &[]), &sql);
                }
                "U" | "D" => {
                    let rel = rel(c, &ch.s, &ch.t);
                    let old = ch.old.map_or("null", |v| v.get());
                    run(
                        c.update(&rel.delete_one, None, &[old.into()]),
                        "delete of a replicated row",
                    );
                    if ch.op == "U" {
                        let new = ch.new.map_or("null", |v| v.get());
                        let rows = format!("[{new}]");
                        insert_rows(c, &rel, &rows, ch.new.into_iter());
                    }
                }
                other => MrError::BadArgument {
                    what: "change kind",
                    value: other.to_string(),
                    expected: "I, U, D or T",
                }
                .raise(),
            }
            i += 1;
        }
    });
}

/// Replaces the rows with the keys of `rows` (a JSON array) by them, then moves the
/// relation's sequences past the values they hold.
fn insert_rows<'a>(
    c: &mut SpiClient<'_>,
    rel: &Rel,
    rows: &str,
    each: impl Iterator<Item = &'a RawValue> + Clone,
) {
    let mut each = each.peekable();
    let first = each.peek().copied();
    let one = first.is_some() && {
        let mut probe = each.clone();
        probe.next();
        probe.next().is_none()
    };
    match (&rel.delete_keys, one, first) {
        // One row (the common case): by its key, an index probe whatever the table's size.
        (Some(_), true, Some(row)) => run(
            c.update(&rel.delete_one, None, &[row.get().into()]),
            "replace of a replicated row",
        ),
        (Some(d), _, _) => run(
            c.update(d, None, &[rows.into()]),
            "replace of replicated rows",
        ),
        (None, _, _) => {}
    }
    run(
        c.update(&rel.insert, None, &[rows.into()]),
        "insert of replicated rows",
    );
    if rel.sequences.is_empty() {
        return;
    }
    let rows: Vec<serde_json::Map<String, serde_json::Value>> = each
        .filter_map(|r| serde_json::from_str(r.get()).ok())
        .collect();
    for (seq, col) in &rel.sequences {
        let max = rows
            .iter()
            .filter_map(|r| r.get(col))
            .filter_map(|v| v.as_i64().or_else(|| v.as_f64().map(|f| f.round() as i64)))
            .max();
        if let Some(max) = max {
            run(
                c.update(
                    "SELECT pg_catalog.setval($1::pg_catalog.regclass, $2) \
                     WHERE $2 > coalesce(pg_catalog.pg_sequence_last_value($1::pg_catalog.regclass), 0)",
                    None,
                    &[(*seq).into(), max.into()],
                ),
                "sequence advance",
            );
        }
    }
}

/// Locks a partition's ancestors, root first, before the partition itself is touched: the
/// order PostgreSQL's own DDL takes (a parent, then its partitions). Writing a partition
/// directly takes them the other way round (the partition when the statement starts, its
/// parent when the partition constraint is loaded), and an applier doing so deadlocked with
/// a schema change on the parent on the same node (an `ALTER TABLE … SET LOCALITY` whose
/// rebuild drops a foreign key of the partitioned table referencing it), which PostgreSQL
/// resolved by failing the user's statement.
#[allow(unsafe_code)]
fn lock_ancestors(ancestors: &[pg_sys::Oid]) {
    for &oid in ancestors {
        // SAFETY: LockRelationOid takes a heavyweight lock by OID in this backend's current
        // transaction (an SPI caller is always in one); it reads no relation and errors
        // through PostgreSQL's usual path, which pgrx turns into a panic.
        unsafe { pg_sys::LockRelationOid(oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE) };
    }
}

fn run<T>(r: Result<T, pgrx::spi::SpiError>, what: &str) {
    if let Err(e) = r {
        pgrx::error!("pg_multiregion: {what} failed: {e}");
    }
}

/// The relation `schema.table` with its statements, prepared on first use; its ancestors
/// locked (in this transaction) before anything touches it.
fn rel(c: &mut SpiClient<'_>, schema: &str, table: &str) -> Rc<Rel> {
    let key = (schema.to_string(), table.to_string());
    if let Some(r) = RELS.with(|m| m.borrow().get(&key).cloned()) {
        lock_ancestors(&r.ancestors);
        return r;
    }
    let name = format!("{}.{}", spi::ident(schema), spi::ident(table));
    let relid: pg_sys::Oid = c
        .select(
            "SELECT pg_catalog.to_regclass($1)::pg_catalog.oid",
            None,
            &[name.as_str().into()],
        )
        .ok()
        .and_then(|t| t.first().get_one::<pg_sys::Oid>().ok().flatten())
        .unwrap_or_else(|| MrError::NoSuchTable(name.clone()).raise());
    let text_rows = |c: &SpiClient<'_>, sql: &str| -> Vec<Vec<Option<String>>> {
        let t = c
            .select(sql, None, &[relid.into()])
            .unwrap_or_else(|e| pgrx::error!("pg_multiregion: catalog read failed: {e}"));
        let n = t.columns().unwrap_or(0);
        t.map(|row| {
            (1..=n)
                .map(|i| row.get::<String>(i).ok().flatten())
                .collect()
        })
        .collect()
    };
    let mut ancestors: Vec<pg_sys::Oid> = text_rows(
        c,
        "SELECT a.relid::pg_catalog.oid::text \
           FROM pg_catalog.pg_partition_ancestors($1) WITH ORDINALITY a(relid, n) \
          WHERE a.relid <> $1::pg_catalog.regclass ORDER BY a.n DESC",
    )
    .into_iter()
    .filter_map(|r| r.into_iter().next().flatten()?.parse::<u32>().ok())
    .map(pg_sys::Oid::from)
    .collect();
    ancestors.dedup();
    // Before anything below (preparing locks the relation itself).
    lock_ancestors(&ancestors);
    let key_cols: Vec<String> = text_rows(
        c,
        "SELECT a.attname::text FROM pg_catalog.pg_index i \
           CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, ord) \
           JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
          WHERE i.indrelid = $1 AND i.indisprimary ORDER BY k.ord",
    )
    .into_iter()
    .filter_map(|r| r.into_iter().next().flatten())
    .collect();
    let cols: Vec<String> = text_rows(
        c,
        "SELECT attname::text FROM pg_catalog.pg_attribute \
          WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped AND attgenerated = '' \
          ORDER BY attnum",
    )
    .into_iter()
    .filter_map(|r| r.into_iter().next().flatten())
    .collect();
    let sequences = text_rows(
        c,
        "SELECT seq::pg_catalog.oid::text, col::text FROM multiregion.owned_sequences($1)",
    )
    .into_iter()
    .filter_map(|r| {
        let mut it = r.into_iter();
        let seq = it.next().flatten()?.parse::<u32>().ok()?;
        Some((pg_sys::Oid::from(seq), it.next().flatten()?))
    })
    .collect();
    let list = |v: &[String]| {
        v.iter()
            .map(|c| spi::ident(c))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (keys, cols) = (list(&key_cols), list(&cols));
    let text = [PgOid::BuiltIn(PgBuiltInOids::TEXTOID)];
    let prepare = |c: &SpiClient<'_>, sql: String| -> OwnedPreparedStatement {
        c.prepare_mut(sql.as_str(), &text)
            .unwrap_or_else(|e| pgrx::error!("pg_multiregion: cannot prepare {sql}: {e}"))
            .keep()
    };
    let delete_keys = (!key_cols.is_empty()).then(|| {
        prepare(
            c,
            format!(
                "DELETE FROM {name} WHERE ({keys}) IN \
                 (SELECT {keys} FROM pg_catalog.jsonb_populate_recordset(NULL::{name}, $1::pg_catalog.jsonb))"
            ),
        )
    });
    let insert = prepare(
        c,
        format!(
            "INSERT INTO {name} ({cols}) OVERRIDING SYSTEM VALUE \
             SELECT {cols} FROM pg_catalog.jsonb_populate_recordset(NULL::{name}, $1::pg_catalog.jsonb)"
        ),
    );
    let delete_one = prepare(
        c,
        if key_cols.is_empty() {
            format!(
                "DELETE FROM {name} WHERE ctid = (SELECT x.ctid FROM {name} x \
                 WHERE pg_catalog.to_jsonb(x) = $1::pg_catalog.jsonb LIMIT 1)"
            )
        } else {
            format!(
                "DELETE FROM {name} WHERE ({keys}) = \
                 (SELECT {keys} FROM pg_catalog.jsonb_populate_record(NULL::{name}, $1::pg_catalog.jsonb))"
            )
        },
    );
    let r = Rc::new(Rel {
        relid,
        ancestors,
        delete_keys,
        insert,
        delete_one,
        sequences,
    });
    RELS.with(|m| m.borrow_mut().insert(key, r.clone()));
    r
}
