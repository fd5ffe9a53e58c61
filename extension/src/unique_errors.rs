//! CockroachDB's texts for a duplicate key in a REGIONAL BY ROW table, and for a foreign key
//! checked against one of its key tables (which is named as the table it keeps unique).
//!
//! A duplicate key. The table is LIST
//! partitioned with its keys prefixed by the region column (rbr.rs), so PostgreSQL reports a
//! duplicate within a region by the partition's index, over the prefixed key:
//! `"accounts_us_east1_pkey"`, `Key (crdb_region, id)=(us-east1, 1)`. CockroachDB names the
//! table's index and the key the user declared: `"accounts_pkey"`, `Key (id)=(1)` (a
//! duplicate across regions already reads so: the key table reports it).
//!
//! The rewrite happens in `emit_log_hook`, where no catalog may be read (an error there
//! recurses): it uses only what [`crate::rewrite::lookup`] cached when the statement that failed
//! was analysed, which every statement writing the table goes through.

use pgrx::pg_sys;
use std::ffi::{CStr, CString};

/// A partition's index of a REGIONAL BY ROW table, and what CockroachDB calls it.
#[derive(Debug)]
pub(crate) struct PartitionIndex {
    pub schema: String,
    pub name: String,
    pub parent_index: String,
    pub parent_table: String,
}

/// Rewrites a unique violation reported by a partition's index of a cached REGIONAL BY ROW
/// table; leaves every other report alone.
///
/// # Safety
/// `edata` must be the ErrorData PostgreSQL passes to `emit_log_hook`, and the current memory
/// context the error context, as it is there.
#[allow(unsafe_code)]
pub(crate) unsafe fn rewrite(edata: &mut pg_sys::ErrorData) {
    if edata.elevel < pgrx::PgLogLevel::ERROR as i32 {
        return;
    }
    if edata.sqlerrcode == pgrx::PgSqlErrorCode::ERRCODE_FOREIGN_KEY_VIOLATION as i32 {
        // SAFETY: the caller's contract.
        unsafe { name_key_tables_as_their_tables(edata) };
        return;
    }
    if edata.sqlerrcode != pgrx::PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION as i32 {
        return;
    }
    // SAFETY: the ErrorData's strings, each NUL-terminated where not null.
    let text = |p: *mut std::ffi::c_char| {
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    // A duplicate found at another node's leaseholder is raised here again with its message,
    // detail and SQLSTATE only: the constraint is then read from the message.
    let constraint = text(edata.constraint_name).or_else(|| {
        text(edata.message)?
            .strip_prefix("duplicate key value violates unique constraint \"")?
            .strip_suffix('"')
            .map(str::to_string)
    });
    let Some(constraint) = constraint else {
        return;
    };
    let schema = text(edata.schema_name);
    let Some((index, column)) = crate::rewrite::partition_index(schema.as_deref(), &constraint)
    else {
        return;
    };
    let cstr = |s: String| CString::new(s).ok();
    let message = cstr(format!(
        "duplicate key value violates unique constraint \"{}\"",
        index.0
    ));
    // SAFETY: the detail, when present, is a NUL-terminated string of the ErrorData.
    let detail = (!edata.detail.is_null())
        .then(|| {
            unsafe { CStr::from_ptr(edata.detail) }
                .to_string_lossy()
                .into_owned()
        })
        .and_then(|d| mr_sql::key_detail_without(&d, &column))
        .and_then(cstr);
    // SAFETY: pstrdup copies into the current (error) context, which owns the ErrorData's
    // strings and outlives the report.
    unsafe {
        if let Some(m) = message {
            edata.message = pg_sys::pstrdup(m.as_ptr());
        }
        if let Some(d) = detail {
            edata.detail = pg_sys::pstrdup(d.as_ptr());
        }
        if let Some(c) = cstr(index.0) {
            edata.constraint_name = pg_sys::pstrdup(c.as_ptr());
        }
        if let Some(t) = cstr(index.1) {
            edata.table_name = pg_sys::pstrdup(t.as_ptr());
        }
    }
}

/// In a foreign key violation's message and detail, a key table's quoted name becomes its
/// table's (`is not present in table "accounts_accounts_email_key"` → `"accounts"`).
///
/// # Safety
/// As [`rewrite`].
#[allow(unsafe_code)]
unsafe fn name_key_tables_as_their_tables(edata: &mut pg_sys::ErrorData) {
    for field in [&mut edata.message, &mut edata.detail] {
        if field.is_null() {
            continue;
        }
        // SAFETY: a non-null NUL-terminated string of the ErrorData.
        let text = unsafe { CStr::from_ptr(*field) }
            .to_string_lossy()
            .into_owned();
        let renamed = mr_sql::rename_quoted(&text, crate::rewrite::key_table_base);
        if renamed != text {
            if let Ok(c) = CString::new(renamed) {
                // SAFETY: as in `rewrite`: a copy in the error context.
                *field = unsafe { pg_sys::pstrdup(c.as_ptr()) };
            }
        }
    }
}
