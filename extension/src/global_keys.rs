//! Global keys with row replication on (ARCHITECTURE.md §7, "Global uniqueness").
//!
//! A REGIONAL BY ROW table's unique key without its region column is kept in a key table
//! (`multiregion_keys`), whose own unique index decides. With row replication on, a key table
//! is a replicated table like any other — one range, in the primary region — so there is one
//! index for the whole cluster. The row trigger that maintains it does not write it where the
//! row is written (that node may not lease it, and may be serving another node's statement):
//! it records the change here; after each statement the origin of the transaction applies the
//! statement's changes at the key table's leaseholder, as a part of the same transaction
//! (`apply_key_changes`). There PostgreSQL's unique index makes a concurrent insert of the same
//! key wait for the other transaction and then fail with 23505, under every isolation level.
//!
//! A statement's changes are applied together, by their net effect per key: a row that moves
//! between partitions (PostgreSQL runs it as a DELETE and an INSERT, perhaps on two nodes)
//! releases and takes its key in the same statement, and the key stays as it is, so foreign
//! keys that reference it neither cascade nor fail.

use crate::error::MrError;
use crate::sidecar;
use mr_wire::local::KeyChanges;
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};

/// The schema of the key tables.
pub const KEY_SCHEMA: &str = "multiregion_keys";

/// One row's change to a key: (subtransaction, key table, parent table, constraint, old
/// key, new key); tables as (schema, name).
type Change = (
    pg_sys::SubTransactionId,
    (String, String),
    (String, String),
    String,
    Option<String>,
    Option<String>,
);

thread_local! {
    /// Changes recorded since the last statement's were applied (or handed to the origin).
    static PENDING: RefCell<Vec<Change>> = const { RefCell::new(Vec::new()) };
    /// Whether row replication is on, as pgmr said once in this transaction.
    static ENABLED: Cell<Option<bool>> = const { Cell::new(None) };
    /// Set while `apply_key_changes` writes a key table (`write_key_changes` runs only then).
    static APPLYING: Cell<bool> = const { Cell::new(false) };
}

/// Whether key tables are replicated ranges (row replication on), asked once per transaction.
fn replicated() -> bool {
    if crate::replication::known_off() {
        return false;
    }
    if let Some(on) = ENABLED.with(Cell::get) {
        return on;
    }
    // Without a sidecar there is no replication to speak of.
    let on = sidecar::replication_enabled().unwrap_or(false);
    ENABLED.with(|e| e.set(Some(on)));
    on
}

/// What a key trigger does with its change.
enum Recording {
    /// Row replication is off, or a schema change rewrites rows on every node alike: the
    /// trigger maintains this node's key table itself.
    Off,
    /// A replica applying rows: the key table's own range brings its rows.
    Skip,
    /// Recorded, for the transaction's origin to apply at the key table's leaseholder.
    On,
}

#[allow(unsafe_code)]
fn recording() -> Recording {
    if crate::replication::capture_suppressed() || !replicated() {
        return Recording::Off;
    }
    // SAFETY: reads a backend global.
    if unsafe { pg_sys::SessionReplicationRole } == pg_sys::SESSION_REPLICATION_ROLE_REPLICA as i32
    {
        return Recording::Skip;
    }
    Recording::On
}

/// Records a row's change to a global key (from `multiregion.maintain_global_key`), for its
/// transaction's origin to apply at the key table's leaseholder after the statement. `false`
/// when row replication is off, or while a schema change rewrites rows on every node alike:
/// the caller maintains this node's key table itself. A replica applying rows
/// (`session_replication_role = replica`) records nothing: the key table's own range brings
/// its rows.
#[pg_extern(schema = "multiregion")]
#[allow(unsafe_code)]
fn record_key_change(
    key_table: pg_sys::Oid,
    parent: pg_sys::Oid,
    constraint: &str,
    old_key: Option<pgrx::JsonB>,
    new_key: Option<pgrx::JsonB>,
) -> bool {
    match recording() {
        Recording::Off => return false,
        Recording::Skip => return true,
        Recording::On => {}
    }
    if old_key.is_none() && new_key.is_none() {
        return true;
    }
    let (Some(key_table), Some(parent)) = (qualified(key_table), qualified(parent)) else {
        MrError::NoSuchTable(format!("{key_table:?}")).raise();
    };
    // SAFETY: inside a transaction.
    let sub = unsafe { pg_sys::GetCurrentSubTransactionId() };
    PENDING.with(|p| {
        p.borrow_mut().push((
            sub,
            key_table,
            parent,
            constraint.to_string(),
            old_key.map(|k| k.0.to_string()),
            new_key.map(|k| k.0.to_string()),
        ))
    });
    true
}

/// Records that a statement truncated a table with a global key (from
/// `multiregion.truncate_global_key`): every key of it is released at the key table's
/// leaseholder, before the changes that follow. `false` as [`record_key_change`].
#[pg_extern(schema = "multiregion")]
#[allow(unsafe_code)]
fn record_keys_truncated(key_table: pg_sys::Oid, parent: pg_sys::Oid, constraint: &str) -> bool {
    match recording() {
        Recording::Off => return false,
        Recording::Skip => return true,
        Recording::On => {}
    }
    let (Some(key_table), Some(parent)) = (qualified(key_table), qualified(parent)) else {
        MrError::NoSuchTable(format!("{key_table:?}")).raise();
    };
    // SAFETY: inside a transaction.
    let sub = unsafe { pg_sys::GetCurrentSubTransactionId() };
    // (None, None): the truncation marker (no row change has neither key).
    PENDING.with(|p| {
        p.borrow_mut()
            .push((sub, key_table, parent, constraint.to_string(), None, None))
    });
    true
}

/// A relation's (schema, name), by OID.
#[allow(unsafe_code)]
fn qualified(relid: pg_sys::Oid) -> Option<(String, String)> {
    // SAFETY: catalog lookups by OID; NULL (no such relation) is checked.
    unsafe {
        let name = pg_sys::get_rel_name(relid);
        if name.is_null() {
            return None;
        }
        let ns = pg_sys::get_namespace_name(pg_sys::get_rel_namespace(relid));
        if ns.is_null() {
            return None;
        }
        Some((
            std::ffi::CStr::from_ptr(ns).to_string_lossy().into_owned(),
            std::ffi::CStr::from_ptr(name)
                .to_string_lossy()
                .into_owned(),
        ))
    }
}

/// The changes recorded since the last call, one batch per key table, in the order they
/// were first met.
pub fn take() -> Vec<KeyChanges> {
    let pending = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    let mut out: Vec<KeyChanges> = Vec::new();
    for (_, (ks, kt), (ps, pt), constraint, old, new) in pending {
        let i = match out
            .iter()
            .position(|k| k.key_schema == ks && k.key_table == kt && k.constraint == constraint)
        {
            Some(i) => i,
            None => {
                out.push(KeyChanges {
                    key_schema: ks,
                    key_table: kt,
                    parent_schema: ps,
                    parent_table: pt,
                    constraint,
                    changes: Vec::new(),
                    truncated: false,
                });
                out.len() - 1
            }
        };
        let batch = &mut out[i];
        if old.is_none() && new.is_none() {
            // A truncation: what came before it in this batch is gone with every key.
            batch.truncated = true;
            batch.changes.clear();
        } else {
            batch.changes.push((old, new));
        }
    }
    for batch in &mut out {
        batch.cancel_moves();
    }
    out.retain(|b| b.truncated || !b.changes.is_empty());
    out
}

/// Changes another node's share of a statement returned, to be applied with this statement's.
pub fn returned(batches: Vec<KeyChanges>) {
    if batches.is_empty() {
        return;
    }
    // SAFETY: inside a transaction.
    #[allow(unsafe_code)]
    let sub = unsafe { pg_sys::GetCurrentSubTransactionId() };
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        for b in batches {
            // The truncation marker (None, None) first, as it was recorded.
            let marker = b.truncated.then_some((None, None));
            for (old, new) in marker.into_iter().chain(b.changes) {
                p.push((
                    sub,
                    (b.key_schema.clone(), b.key_table.clone()),
                    (b.parent_schema.clone(), b.parent_table.clone()),
                    b.constraint.clone(),
                    old,
                    new,
                ));
            }
        }
    });
}

/// Whether changes wait to be applied.
pub fn any_pending() -> bool {
    PENDING.with(|p| !p.borrow().is_empty())
}

/// Transaction end: nothing recorded survives it.
pub fn at_end() {
    PENDING.with(|p| p.borrow_mut().clear());
    ENABLED.with(|e| e.set(None));
}

/// A subtransaction rolled back: the changes its statements recorded are undone with them.
pub fn sub_aborted(sub: pg_sys::SubTransactionId) {
    PENDING.with(|p| p.borrow_mut().retain(|c| c.0 < sub));
}

/// Applies one statement's changes to a global key table, here at its leaseholder: a key
/// taken that another row holds is a 23505 with the parent table's constraint. Open to
/// anyone who may write the parent table (its rows take and release keys anyway); the key
/// table itself is written by `write_key_changes` as its owner.
#[pg_extern(schema = "multiregion")]
fn apply_key_changes(changes: pgrx::JsonB) {
    let batch: KeyChanges = match serde_json::from_value(changes.0) {
        Ok(b) => b,
        Err(e) => MrError::BadArgument {
            what: "key changes",
            value: e.to_string(),
            expected: "the changes a statement made to one global key table",
        }
        .raise(),
    };
    let parent = format!(
        "{}.{}",
        crate::regions::spi::ident(&batch.parent_schema),
        crate::regions::spi::ident(&batch.parent_table)
    );
    let may = Spi::get_one_with_args::<bool>(
        "SELECT pg_catalog.has_table_privilege($1::regclass, 'INSERT, UPDATE, DELETE')",
        &[parent.as_str().into()],
    )
    .ok()
    .flatten()
    .unwrap_or(false);
    if !may {
        MrError::KeyChangesNotPermitted { table: parent }.raise();
    }
    struct Applying;
    impl Drop for Applying {
        fn drop(&mut self) {
            APPLYING.with(|a| a.set(false));
        }
    }
    APPLYING.with(|a| a.set(true));
    let _applying = Applying;
    let changes: Vec<serde_json::Value> = batch
        .changes
        .iter()
        .map(|(old, new)| {
            let parse = |k: &Option<String>| {
                k.as_deref()
                    .and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok())
                    .unwrap_or(serde_json::Value::Null)
            };
            serde_json::json!([parse(old), parse(new)])
        })
        .collect();
    let key_table = format!(
        "{}.{}",
        crate::regions::spi::ident(&batch.key_schema),
        crate::regions::spi::ident(&batch.key_table)
    );
    let args = [
        parent.as_str().into(),
        key_table.as_str().into(),
        batch.constraint.as_str().into(),
        pgrx::JsonB(serde_json::Value::Array(changes)).into(),
        batch.truncated.into(),
    ];
    if let Err(e) = Spi::run_with_args(
        "SELECT multiregion.write_key_changes($1::regclass, $2::regclass, $3, $4, $5)",
        &args,
    ) {
        MrError::Sidecar(format!("apply_key_changes: {e}")).raise();
    }
}

/// Whether `apply_key_changes` is running in this backend (`write_key_changes` refuses
/// otherwise).
#[pg_extern(schema = "multiregion")]
fn applying_key_changes() -> bool {
    APPLYING.with(Cell::get)
}

extension_sql!(
    r#"
-- Writes one statement's changes to a global key table by their net effect per key (see
-- global_keys.rs), after releasing every key if the table was truncated: keys released and taken again stay; a key whose row changed it is updated
-- in place (ON UPDATE actions of the foreign keys that reference it apply); then released
-- keys are deleted and taken keys inserted, where a key another row holds is a 23505. Runs
-- as the extension's owner, only inside multiregion.apply_key_changes, which checks that
-- the caller may write the table.
CREATE FUNCTION multiregion.write_key_changes(p_parent regclass, p_key_table regclass,
                                              p_constraint text, p_changes jsonb,
                                              p_truncated boolean)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    cols name[];
    key_cols text;
    canon jsonb;
    net jsonb;
    pair jsonb;
    released jsonb;
    taken jsonb;
    dup jsonb;
    inserted int;
BEGIN
    IF NOT multiregion.applying_key_changes() THEN
        RAISE EXCEPTION 'write_key_changes runs only inside multiregion.apply_key_changes'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    SELECT g.columns INTO cols FROM multiregion.global_key g
     WHERE g.relid = p_parent AND g.key_table = p_key_table AND g.constraint_name = p_constraint;
    IF cols IS NULL THEN
        RAISE EXCEPTION 'key table % does not belong to table %', p_key_table, p_parent
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    SELECT string_agg(format('%I', c), ', ' ORDER BY o) INTO key_cols
      FROM unnest(cols) WITH ORDINALITY AS u(c, o);
    -- The table was truncated: its keys go first (a row that references one stops it, as
    -- PostgreSQL refuses to truncate a referenced table).
    IF p_truncated THEN
        EXECUTE format('DELETE FROM %s', p_key_table);
    END IF;
    -- Each key as this node prints it (keys come from sessions of several nodes).
    EXECUTE format($q$
        SELECT coalesce(jsonb_agg(jsonb_build_array(
                 (SELECT to_jsonb(r) FROM jsonb_populate_record(NULL::%1$s, nullif(e -> 0, 'null')) r
                   WHERE e -> 0 <> 'null'),
                 (SELECT to_jsonb(r) FROM jsonb_populate_record(NULL::%1$s, nullif(e -> 1, 'null')) r
                   WHERE e -> 1 <> 'null')) ORDER BY o), '[]')
          FROM jsonb_array_elements($1) WITH ORDINALITY t(e, o)$q$, p_key_table)
        INTO canon USING p_changes;
    SELECT coalesce(jsonb_object_agg(k, n), '{}') INTO net FROM (
        SELECT k, sum(d)::int AS n FROM (
            SELECT (e -> 0)::text AS k, -1 AS d FROM jsonb_array_elements(canon) e WHERE e -> 0 <> 'null'
            UNION ALL
            SELECT (e -> 1)::text, 1 FROM jsonb_array_elements(canon) e WHERE e -> 1 <> 'null') s
         GROUP BY k) g;
    -- A row that changed its key: the key is updated in place.
    FOR pair IN SELECT e FROM jsonb_array_elements(canon) e
                 WHERE e -> 0 <> 'null' AND e -> 1 <> 'null' AND e -> 0 <> e -> 1 LOOP
        IF (net ->> (pair -> 0)::text)::int < 0 AND (net ->> (pair -> 1)::text)::int = 1 THEN
            BEGIN
                EXECUTE format('UPDATE %s SET (%s) = (SELECT %s FROM jsonb_populate_record(NULL::%s, $2)) '
                               'WHERE (%s) = (SELECT %s FROM jsonb_populate_record(NULL::%s, $1))',
                               p_key_table, key_cols, key_cols, p_key_table,
                               key_cols, key_cols, p_key_table)
                    USING pair -> 0, pair -> 1;
            EXCEPTION WHEN unique_violation THEN
                dup := pair -> 1;
                EXIT;
            END;
            net := net || jsonb_build_object((pair -> 0)::text, (net ->> (pair -> 0)::text)::int + 1,
                                             (pair -> 1)::text, 0);
        END IF;
    END LOOP;
    IF dup IS NULL THEN
        SELECT (k::jsonb) INTO dup FROM jsonb_each_text(net) n(k, v) WHERE v::int > 1 LIMIT 1;
    END IF;
    IF dup IS NULL THEN
        SELECT coalesce(jsonb_agg(k::jsonb), '[]') INTO released
          FROM jsonb_each_text(net) n(k, v) WHERE v::int < 0;
        SELECT coalesce(jsonb_agg(k::jsonb), '[]') INTO taken
          FROM jsonb_each_text(net) n(k, v) WHERE v::int = 1;
        IF jsonb_array_length(released) > 0 THEN
            EXECUTE format('DELETE FROM %s WHERE (%s) IN (SELECT %s FROM jsonb_populate_recordset(NULL::%s, $1))',
                           p_key_table, key_cols, key_cols, p_key_table)
                USING released;
        END IF;
        IF jsonb_array_length(taken) > 0 THEN
            -- A key another row holds (committed, or by a transaction this one waited for
            -- and that committed) is not inserted: the first such is the duplicate.
            EXECUTE format('WITH ins AS (INSERT INTO %1$s AS kt '
                           'SELECT * FROM jsonb_populate_recordset(NULL::%1$s, $1) '
                           'ON CONFLICT DO NOTHING RETURNING to_jsonb(kt) AS k) '
                           'SELECT (SELECT count(*) FROM ins)::int, '
                           '(SELECT t FROM jsonb_array_elements($1) t '
                           '  WHERE t NOT IN (SELECT k FROM ins) LIMIT 1)', p_key_table)
                INTO inserted, dup USING taken;
        END IF;
    END IF;
    -- Worded as maintain_global_key's own check (catalog.sql), which raises it in place so
    -- that its CONTEXT stays one line.
    IF dup IS NOT NULL THEN
        RAISE EXCEPTION 'duplicate key value violates unique constraint "%"', p_constraint
            USING ERRCODE = 'unique_violation',
                  DETAIL = format('Key (%s)=(%s) already exists.', array_to_string(cols, ', '),
                                  (SELECT string_agg(e.value #>> '{}', ', ' ORDER BY o)
                                     FROM unnest(cols) WITH ORDINALITY u(c, o)
                                     JOIN jsonb_each(dup) e ON e.key = u.c)),
                  CONSTRAINT = p_constraint,
                  TABLE = (SELECT relname FROM pg_catalog.pg_class WHERE oid = p_parent),
                  SCHEMA = (SELECT n.nspname FROM pg_catalog.pg_class c
                              JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                             WHERE c.oid = p_parent);
    END IF;
END
$fn$;
"#,
    name = "global_keys",
    requires = [apply_key_changes, applying_key_changes]
);

/// Whether the statement of `qd` may change global keys: it writes, its range table names a
/// table with a global key (or a partition of one), and, for an UPDATE, it sets a column of
/// such a key (a row it moves between partitions also sets the region column, and is never
/// sent whole anyway).
///
/// # Safety
/// `qd` is a started QueryDesc.
#[allow(unsafe_code)]
pub unsafe fn may_change_keys(qd: &pg_sys::QueryDesc) -> bool {
    // SAFETY: the planned statement, its range table and result relations are valid for the
    // query's life; the bitmapset is read with PostgreSQL's own iterator.
    let (relids, updated): (Vec<pg_sys::Oid>, Option<(pg_sys::Oid, Vec<i32>)>) = unsafe {
        let ps = &*qd.plannedstmt;
        if qd.operation == pg_sys::CmdType::CMD_SELECT && !ps.hasModifyingCTE {
            return false;
        }
        let rtable = ps.rtable;
        if rtable.is_null() {
            return false;
        }
        let rte = |i: i32| pg_sys::list_nth(rtable, i) as *mut pg_sys::RangeTblEntry;
        let relids = (0..(*rtable).length)
            .map(rte)
            .filter(|r| (**r).rtekind == pg_sys::RTEKind::RTE_RELATION)
            .map(|r| (*r).relid)
            .collect();
        let updated = (qd.operation == pg_sys::CmdType::CMD_UPDATE
            && !ps.hasModifyingCTE
            && !ps.resultRelations.is_null()
            && (*ps.resultRelations).length > 0)
            .then(|| {
                let target = rte(pg_sys::list_nth_int(ps.resultRelations, 0) - 1);
                let mut cols = Vec::new();
                let mut x = -1;
                loop {
                    x = pg_sys::bms_next_member((*target).updatedCols, x);
                    if x < 0 {
                        break;
                    }
                    cols.push(x + pg_sys::FirstLowInvalidHeapAttributeNumber);
                }
                ((*target).relid, cols)
            });
        (relids, updated)
    };
    if relids.is_empty() {
        return false;
    }
    match updated {
        Some((target, attnums)) => crate::regions::spi::flag(
            "SELECT EXISTS (SELECT FROM multiregion.global_key g \
               WHERE (g.relid = $1 OR g.relid IN (SELECT i.inhparent FROM pg_catalog.pg_inherits i \
                                                  WHERE i.inhrelid = $1)) \
                 AND g.columns && ARRAY(SELECT a.attname FROM pg_catalog.pg_attribute a \
                                         WHERE a.attrelid = $1 AND a.attnum = ANY ($2)))::text",
            vec![target.into(), attnums.into()],
        ),
        None => crate::regions::spi::flag(
            "SELECT EXISTS (SELECT FROM multiregion.global_key g WHERE g.relid = ANY ($1) \
               OR g.relid IN (SELECT i.inhparent FROM pg_catalog.pg_inherits i \
                               WHERE i.inhrelid = ANY ($1)))::text",
            vec![relids.into()],
        ),
    }
}
