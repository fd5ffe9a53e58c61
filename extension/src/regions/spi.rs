//! Small conveniences over SPI for the region DDL: every value travels as text, every
//! identifier and literal is quoted by PostgreSQL's own rules, and catalog work runs as the
//! extension's owner with a fixed search_path.

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::{quote_identifier, quote_literal};

/// Runs a statement; PostgreSQL errors propagate as errors of the calling statement.
pub fn run(sql: &str) {
    run_with(sql, vec![]);
}

pub fn run_with(sql: &str, args: Vec<DatumWithOid<'_>>) {
    Spi::run_with_args(sql, &args).unwrap_or_else(|e| spi_failed(sql, e));
}

/// Every row of a query, each column as text (the query casts what is not text).
pub fn rows(sql: &str, args: Vec<DatumWithOid<'_>>) -> Vec<Vec<Option<String>>> {
    Spi::connect_mut(|c| text_rows(c.update(sql, None, &args)?))
        .unwrap_or_else(|e| spi_failed(sql, e))
}

/// [`rows`] for a query that only reads. pgrx's read-write path gives the transaction an id
/// first, even for a SELECT; this one does not (it runs read-only until the transaction has
/// written, when PostgreSQL's rules need a fresh snapshot anyway). A session that only reads,
/// through the extension's functions too, so stays a reader: it holds no transaction id, and
/// pgmr's gateway may restart its idle transaction for a schema change.
#[allow(unsafe_code)]
pub fn read_rows(sql: &str, args: Vec<DatumWithOid<'_>>) -> Vec<Vec<Option<String>>> {
    use pgrx::spi::Query;
    // SAFETY: reads a backend-local flag. A read-only SPI query runs on the active snapshot, so
    // without one (possible in some hook contexts) take the read-write path.
    if !unsafe { pg_sys::ActiveSnapshotSet() } {
        return rows(sql, args);
    }
    Spi::connect(|c| text_rows(sql.execute(c, None, &args)?)).unwrap_or_else(|e| spi_failed(sql, e))
}

/// [`one`] for a query that only reads (see [`read_rows`]).
pub fn read_one(sql: &str, args: Vec<DatumWithOid<'_>>) -> Option<String> {
    read_rows(sql, args)
        .into_iter()
        .next()
        .and_then(|r| r.into_iter().next().flatten())
}

/// The first column of the first row, as text; `None` without rows or for NULL.
pub fn one(sql: &str, args: Vec<DatumWithOid<'_>>) -> Option<String> {
    rows(sql, args)
        .into_iter()
        .next()
        .and_then(|r| r.into_iter().next().flatten())
}

pub fn flag(sql: &str, args: Vec<DatumWithOid<'_>>) -> bool {
    one(sql, args).as_deref() == Some("true")
}

/// Every row of a result, each column as text.
fn text_rows(
    table: pgrx::spi::SpiTupleTable<'_>,
) -> Result<Vec<Vec<Option<String>>>, pgrx::spi::SpiError> {
    let n = table.columns()?;
    table
        .map(|row| {
            (1..=n)
                .map(|i| row.get::<String>(i))
                .collect::<Result<Vec<_>, _>>()
        })
        .collect()
}

fn spi_failed(sql: &str, e: pgrx::spi::SpiError) -> ! {
    pgrx::error!("pg_multiregion: internal query failed: {e}: {sql}")
}

pub fn ident(s: &str) -> String {
    quote_identifier(s)
}

pub fn lit(s: &str) -> String {
    quote_literal(s)
}

/// `ARRAY['a','b']::text[]`, quoted.
pub fn text_array(items: impl IntoIterator<Item = impl AsRef<str>>) -> String {
    let items: Vec<String> = items.into_iter().map(|s| lit(s.as_ref())).collect();
    format!("ARRAY[{}]::text[]", items.join(", "))
}

/// Runs `f` as the extension's owner with `search_path = pg_catalog, pg_temp`, as a SECURITY
/// DEFINER function would: callers check the user's privileges first, and every name in the
/// generated SQL is schema-qualified. An error inside `f` aborts the (sub)transaction, which
/// restores the user and the setting.
#[allow(unsafe_code)]
pub fn as_extension_owner<R>(f: impl FnOnce() -> R) -> R {
    let owner: pg_sys::Oid = Spi::get_one(
        "SELECT extowner FROM pg_catalog.pg_extension WHERE extname = 'pg_multiregion'",
    )
    .ok()
    .flatten()
    .unwrap_or(pg_sys::BOOTSTRAP_SUPERUSERID.into());
    let path = one("SELECT pg_catalog.current_setting('search_path')", vec![]).unwrap_or_default();
    let (mut user, mut context) = (pg_sys::Oid::INVALID, 0);
    // SAFETY: plain reads and writes of the backend's current user id, on the backend's thread,
    // exactly as fmgr's SECURITY DEFINER handling does; the (sub)transaction abort path restores
    // the saved values if `f` raises an error.
    unsafe {
        pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
        pg_sys::SetUserIdAndSecContext(
            owner,
            context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32,
        );
    }
    run("SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true)");
    let result = f();
    run_with(
        "SELECT pg_catalog.set_config('search_path', $1, true)",
        vec![path.into()],
    );
    // SAFETY: as above; restores what was saved.
    unsafe { pg_sys::SetUserIdAndSecContext(user, context) };
    result
}
