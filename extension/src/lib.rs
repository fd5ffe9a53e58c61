//! pg_multiregion, the PostgreSQL half of CockroachDB-style multi-region databases.
//!
//! The extension is thin: it knows where its node is (`multiregion.locality`) and asks the
//! node's `pgmr` sidecar, over a Unix socket, about everything else. See [`api`] for the SQL
//! functions, [`gucs`] for the settings and [`sidecar`] for the local channel.

mod api;
mod apply;
mod error;
mod gather;
mod global_keys;
mod gucs;
mod hooks;
mod insert_rows;
mod moved;
mod partial_agg;
mod region_filter;
mod regions;
mod replication;
mod rewrite;
mod ri;
mod routing;
mod sequences;
mod sidecar;
mod unique_errors;

use error::MrError;
use pgrx::prelude::*;

pgrx::pg_module_magic!();

/// Runs once, in the postmaster, while it loads `shared_preload_libraries`; loaded any other
/// way, the library refuses before defining anything.
#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    require_shared_preload();
    gucs::init();
    hooks::init();
    replication::init();
    api::rowid::init();
}

/// The settings are postmaster-level and every backend must see the same ones, so loading the
/// library any other way (`CREATE EXTENSION` or `LOAD` alone) is refused.
#[allow(unsafe_code)]
fn require_shared_preload() {
    // SAFETY: a plain read of a PostgreSQL global, on the thread PostgreSQL runs us on.
    let preloading = unsafe { pg_sys::process_shared_preload_libraries_in_progress };
    if !preloading {
        MrError::NotPreloaded.raise();
    }
}
