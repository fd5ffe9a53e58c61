//! Rows a statement writes into partitions leased on other nodes (ARCHITECTURE.md §9).
//!
//! An INSERT with rows for several regions (a multi-row VALUES list, `INSERT … SELECT`) or an
//! UPDATE that moves a row to another region (`SET crdb_region = …`, a new city under a
//! computed region, auto-rehoming) writes rows into partitions that the node running it may
//! not lease. While such a statement runs, the `_multiregion_route` BEFORE INSERT trigger (named to fire before any other) keeps
//! those rows out of this node's copy and collects them; once the statement has run, the
//! origin of the transaction writes them at their leaseholders as parts of the same
//! transaction (committed together by two-phase commit), where their uniqueness is checked
//! and their locks are taken, as for any write there. The INSERT there carries the
//! statement's `ON CONFLICT` clause, as written, so the conflict is decided where the
//! conflicting row is leased and locked; its `RETURNING` rows come from there too (it returns
//! the statement's RETURNING list) and reach the statement's destination after its own rows.
//! What the statement itself would have to see of those rows cannot be had: a data-modifying
//! WITH, and an ON CONFLICT clause or RETURNING list that uses parameters (the INSERT there
//! has its own) or, for RETURNING, names other tables (an UPDATE's FROM), are refused instead.

use crate::error::MrError;
use crate::{replication, routing, sidecar};
use mr_wire::local::MovedRows;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};

/// (schema, table, partition): the partition `None` for a table that is one range.
type Partition = (String, String, Option<String>);

/// One running statement whose rows may belong elsewhere.
struct Scope {
    /// Whether each partition met so far is leased here.
    leased: HashMap<Partition, bool>,
    /// Why such rows cannot leave this statement, if they cannot.
    refuse: Option<&'static str>,
    /// Also rows of tables that are one range (a COPY: a statement the executor runs goes
    /// whole to such a table's leaseholder instead).
    whole_tables: bool,
    moved: BTreeMap<Partition, Vec<String>>,
    /// A COPY's table, and its columns that take a sequence's value by default (not listed
    /// by the COPY): PostgreSQL drew those from this node's copy of the sequence, and this
    /// trigger draws them again from the cluster-wide counter (crate::sequences).
    sequence_defaults: Option<crate::sequences::CopyDefaults>,
    /// What `multiregion.conflict_region` asked for the statement's next row of a table
    /// (schema, name): see [`upsert_next_row`].
    next_row: Option<((String, String), NextRow)>,
}

/// What becomes of an upsert's next row (`multiregion.upsert_next_row`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum NextRow {
    /// Written after the statement, with its ON CONFLICT clause, as rows for partitions
    /// leased elsewhere are — also where this node leases its partition.
    WriteAfter,
    /// Left out: `DO NOTHING` on a key that lives in another region.
    Skip,
}

thread_local! {
    /// Innermost last: a statement run by another's trigger or function nests.
    static SCOPES: RefCell<Vec<Scope>> = const { RefCell::new(Vec::new()) };
}

/// Collects rows for partitions leased elsewhere until [`Collecting::finish`] (or its drop,
/// after an error, which discards them with the statement).
pub struct Collecting {
    depth: usize,
    done: bool,
}

/// Starts collecting for a statement about to run; `refuse` says why it must see all its rows
/// itself, if it must (ON CONFLICT, RETURNING, a data-modifying WITH).
pub fn collect(refuse: Option<&'static str>) -> Collecting {
    scope(refuse, false)
}

/// Starts collecting for a `COPY … FROM` about to run: rows for any range leased elsewhere,
/// the table's own range included.
pub fn collect_copy() -> Collecting {
    scope(None, true)
}

/// The COPY being collected fills `columns` of `schema.table` from their sequences.
pub fn draw_defaults(defaults: crate::sequences::CopyDefaults) {
    SCOPES.with(|s| {
        if let Some(sc) = s.borrow_mut().last_mut() {
            sc.sequence_defaults = Some(defaults);
        }
    });
}

fn scope(refuse: Option<&'static str>, whole_tables: bool) -> Collecting {
    let depth = SCOPES.with(|s| {
        let mut s = s.borrow_mut();
        s.push(Scope {
            leased: HashMap::new(),
            refuse,
            whole_tables,
            moved: BTreeMap::new(),
            sequence_defaults: None,
            next_row: None,
        });
        s.len()
    });
    Collecting { depth, done: false }
}

impl Collecting {
    /// Stops collecting: the rows that belong elsewhere.
    pub fn finish(mut self) -> Vec<MovedRows> {
        self.done = true;
        SCOPES.with(|s| {
            let mut s = s.borrow_mut();
            let scope = (s.len() == self.depth).then(|| s.pop()).flatten();
            s.truncate(self.depth.saturating_sub(1));
            scope
                .map(|sc| {
                    sc.moved
                        .into_iter()
                        .map(|((schema, table, partition), rows)| MovedRows {
                            schema,
                            table,
                            partition,
                            rows,
                        })
                        .collect()
                })
                .unwrap_or_default()
        })
    }
}

impl Drop for Collecting {
    fn drop(&mut self) {
        if !self.done {
            SCOPES.with(|s| s.borrow_mut().truncate(self.depth.saturating_sub(1)));
        }
    }
}

/// Whether this node leases `p`: asked of pgmr once per statement and partition.
pub fn leased_here(p: &Partition) -> bool {
    let table = mr_meta::TableRef {
        database: routing::database(),
        schema: p.0.clone(),
        table: p.1.clone(),
    };
    match sidecar::route(
        routing::database(),
        vec![(table, p.2.clone())],
        true,
        true,
        false,
        Vec::new(),
    ) {
        Ok(r) => !r.enabled || r.forward_to.is_none(),
        Err(e) => e.raise(),
    }
}

/// BEFORE INSERT on every replicated table (`multiregion.route_row()`): a row for a partition
/// leased on another node, inserted while a statement collects such rows, is kept out of this
/// node's copy and collected; every other row passes untouched.
#[allow(unsafe_code)]
pub fn route_row<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, pgrx::AllocatedByPostgres>>, PgHeapTupleError> {
    let mut new = trigger.new();
    if SCOPES.with(|s| s.borrow().is_empty()) {
        return Ok(new);
    }
    let td = trigger.trigger_data();
    // SAFETY: PostgreSQL passes the trigger's relation, open and locked for the insert.
    let relid = unsafe { (*td.tg_relation).rd_id };
    let whole_tables = SCOPES.with(|s| s.borrow().last().is_some_and(|sc| sc.whole_tables));
    let range = if whole_tables {
        replication::range_of(relid)
    } else {
        replication::partition_of(relid).map(|(s, t, p)| (s, t, Some(p)))
    };
    let Some(partition) = range else {
        return Ok(new);
    };
    let asked = asked_for(&partition);
    if asked == Some(NextRow::Skip) {
        return Ok(None);
    }
    let mut tuple = td.tg_trigtuple;
    let defaults = SCOPES.with(|s| {
        s.borrow().last().and_then(|sc| {
            sc.sequence_defaults
                .as_ref()
                .filter(|d| d.schema == partition.0 && d.table == partition.1)
                .map(|d| d.columns.clone())
        })
    });
    if let Some(columns) = defaults {
        // SAFETY: the trigger's new tuple and its open relation; the replacement is built in
        // the trigger's memory context, which PostgreSQL frees after the row.
        unsafe {
            tuple = crate::sequences::draw_into(td.tg_relation, tuple, &columns);
            new = Some(PgHeapTuple::from_heap_tuple(
                pgrx::PgTupleDesc::from_pg_unchecked((*td.tg_relation).rd_att),
                tuple,
            ));
        }
    }
    let known = SCOPES.with(|s| {
        s.borrow()
            .last()
            .and_then(|sc| sc.leased.get(&partition).copied())
    });
    let here = match known {
        Some(h) => h,
        None => {
            let h = leased_here(&partition);
            SCOPES.with(|s| {
                if let Some(sc) = s.borrow_mut().last_mut() {
                    sc.leased.insert(partition.clone(), h);
                }
            });
            h
        }
    };
    if here && asked.is_none() {
        return Ok(new);
    }
    if let Some(why) = SCOPES.with(|s| s.borrow().last().and_then(|sc| sc.refuse)) {
        MrError::WriteNotServed {
            message: if here {
                format!(
                    "a row of {}.{} moved to partition {} must be upserted after this statement, and it {why}",
                    partition.0,
                    partition.1,
                    partition.2.as_deref().unwrap_or_default(),
                )
            } else {
                format!(
                    "a row for partition {} of {}.{} is leased on another node, and this statement {why}",
                    partition.2.as_deref().unwrap_or_default(),
                    partition.0,
                    partition.1
                )
            },
            hint: "Write each region's rows in their own statement, or leave out what cannot go with them: a data-modifying WITH, parameters in ON CONFLICT or RETURNING, other tables in RETURNING.".into(),
        }
        .raise();
    }
    // The row as replication captures it (to_jsonb: typed JSON values, json columns as JSON).
    // SAFETY: the trigger's new tuple and its open relation; the composite datum is built in
    // the current memory context and read by SPI before the trigger returns.
    let row: String = unsafe {
        let rel = td.tg_relation;
        let datum = pg_sys::heap_copy_tuple_as_datum(tuple, (*rel).rd_att);
        let arg = pgrx::datum::DatumWithOid::new(datum, (*(*rel).rd_rel).reltype);
        Spi::get_one_with_args::<String>("SELECT pg_catalog.to_jsonb($1)::text", &[arg])
            .ok()
            .flatten()
            .unwrap_or_else(|| {
                MrError::Sidecar("could not read a row for another node's partition".into()).raise()
            })
    };
    SCOPES.with(|s| {
        if let Some(sc) = s.borrow_mut().last_mut() {
            sc.moved.entry(partition).or_default().push(row);
        }
    });
    Ok(None)
}

/// What `multiregion.upsert_next_row` asked for this row of `partition`, taken once.
fn asked_for(partition: &Partition) -> Option<NextRow> {
    SCOPES.with(|s| {
        let mut s = s.borrow_mut();
        let sc = s.last_mut()?;
        let (table, how) = sc.next_row.as_ref()?;
        if partition.2.is_none() || table.0 != partition.0 || table.1 != partition.1 {
            return None;
        }
        let how = *how;
        sc.next_row = None;
        Some(how)
    })
}

/// Rows an upsert moves: `multiregion.conflict_region`, evaluated for an INSERT … ON CONFLICT
/// row whose key lives in another region than the statement gives it, asks here what becomes
/// of that row, the next the statement inserts into `table`. `write_after`: the conflict
/// must be decided after the existing row has been moved into the proposed row's partition
/// (by an UPDATE of its own), which this statement cannot see — PostgreSQL's speculative
/// insertion does not lock a row its own command wrote — so the row is collected, like one
/// for a partition leased elsewhere, and written after the statement with its ON CONFLICT
/// clause (at the partition's leaseholder, here or elsewhere), where it finds the moved
/// row. `skip`: DO NOTHING on a key that lives elsewhere leaves the row out. False when no
/// running statement collects rows (the caller then refuses).
#[pg_extern(schema = "multiregion")]
fn upsert_next_row(table: pg_sys::Oid, how: &str) -> bool {
    let how = match how {
        "write_after" => NextRow::WriteAfter,
        "skip" => NextRow::Skip,
        other => MrError::BadArgument {
            what: "upsert action",
            value: other.into(),
            expected: "write_after or skip",
        }
        .raise(),
    };
    if SCOPES.with(|s| s.borrow().is_empty()) {
        return false;
    }
    let Some((schema, name, _)) = replication::range_of(table) else {
        return false;
    };
    SCOPES.with(|s| match s.borrow_mut().last_mut() {
        Some(sc) => {
            sc.next_row = Some(((schema, name), how));
            true
        }
        None => false,
    })
}

/// The INSERT that writes a group of moved rows at their leaseholder, as the appliers write
/// replicated rows: every column the rows can give (not generated ones, nor a region column
/// computed from others, which the insert computes again), identity columns included, read
/// from the rows' to_jsonb form; the table named `alias` when given (a RETURNING list may
/// use the statement's alias). Identifiers are quoted by PostgreSQL.
pub fn insert_sql(m: &MovedRows, alias: Option<&str>) -> String {
    let row = crate::regions::spi::read_rows(
        "SELECT format('INSERT INTO %I.%I%s (%s) OVERRIDING SYSTEM VALUE SELECT %s FROM pg_catalog.jsonb_populate_recordset(NULL::%I.%I, $1::pg_catalog.jsonb)', \
                $1, $2, coalesce(' AS ' || pg_catalog.quote_ident($3), ''), cols, cols, $1, $2) \
           FROM (SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum) AS cols \
                   FROM pg_catalog.pg_attribute a \
                  WHERE a.attrelid = pg_catalog.format('%I.%I', $1, $2)::regclass \
                    AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '' \
                    AND NOT EXISTS (SELECT FROM multiregion.table_locality l \
                                     WHERE l.relid = a.attrelid AND l.region_column = a.attname \
                                       AND l.region_expr_sql IS NOT NULL)) c",
        vec![m.schema.clone().into(), m.table.clone().into(), alias.into()],
    );
    row.into_iter()
        .next()
        .and_then(|r| r.into_iter().next().flatten())
        .unwrap_or_default()
}

/// Rows go to their leaseholder in statements of about this many bytes of JSON (a COPY may
/// collect far more than one message between nodes carries).
const CHUNK_BYTES: usize = 4 << 20;

/// The rows as the JSON arrays `insert_sql` reads, one per statement.
pub fn rows_json(m: &MovedRows) -> Vec<String> {
    let mut out = Vec::new();
    let mut chunk = String::from("[");
    for row in &m.rows {
        if chunk.len() > 1 && chunk.len() + row.len() > CHUNK_BYTES {
            chunk.push(']');
            out.push(std::mem::replace(&mut chunk, String::from("[")));
        }
        if chunk.len() > 1 {
            chunk.push(',');
        }
        chunk.push_str(row);
    }
    if chunk.len() > 1 {
        chunk.push(']');
        out.push(chunk);
    }
    out
}
