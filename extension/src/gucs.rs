//! The extension's settings (GUCs), all under the reserved `multiregion.` prefix.
//!
//! `pgmr start` writes `multiregion.locality` and `multiregion.sidecar_socket` when it starts the
//! server; both are fixed for the life of the postmaster because a node does not move, and
//! because every backend must agree on where it is and on which pgmr to ask.

use crate::error::MrError;
use mr_topology::Locality;
use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::PathBuf;
use std::time::Duration;

/// `region=...,zone=...` of this node; empty means "not configured".
static LOCALITY: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c""));

/// Path of the Unix socket pgmr serves the local channel on; empty means "not managed by pgmr".
static SIDECAR_SOCKET: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c""));

/// CockroachDB's `enable_auto_rehoming`: REGIONAL BY ROW tables given the system-provided region
/// column while it is on move a row to the gateway's region whenever the row is updated.
static ENABLE_AUTO_REHOMING: GucSetting<bool> = GucSetting::<bool>::new(false);

/// Whether a READ ONLY transaction under REPEATABLE READ or SERIALIZABLE (pg_dump's) first
/// waits until this node holds every write acknowledged before it began.
static SNAPSHOT_BARRIER: GucSetting<bool> = GucSetting::<bool>::new(true);

/// Whether a gathered read (gather.rs) asks the leaseholders for only the columns it reads
/// and the rows its own filter keeps. Off, every row and column is sent: the baseline the
/// data-plane benchmark measures against.
static GATHER_PUSHDOWN: GucSetting<bool> = GucSetting::<bool>::new(true);

/// Whether a gathered aggregate over one table is computed in parts at the leaseholders
/// (partial_agg.rs). Off, the rows are sent and aggregated here: the benchmark's baseline.
static GATHER_PARTIAL_AGGREGATES: GucSetting<bool> = GucSetting::<bool>::new(true);

/// CockroachDB's `override_multi_region_zone_config`: lets `CONFIGURE ZONE` change the fields
/// a multi-region database derives.
static OVERRIDE_MULTI_REGION_ZONE_CONFIG: GucSetting<bool> = GucSetting::<bool>::new(false);

/// Whether schema changes typed by clients are replicated to every node (see
/// `regions::replicate_ddl`). Superuser-only: turning it off lets this node's schema diverge,
/// which only repairs and tests of a node without its pgmr should do.
static REPLICATE_DDL: GucSetting<bool> = GucSetting::<bool>::new(true);

/// Set by pgmr (`anchor:gid`, transaction-local) just before `PREPARE TRANSACTION` of a
/// forwarded session that is a part of another node's two-phase commit: the prepare then
/// writes the session's changes as prepared entries anchored there. Superuser-only.
static PREPARE_AS: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c""));

/// `SET CONSTRAINTS` as this transaction has it, for the nodes serving its statements
/// (`crate::ri::after_utility`): set transaction-locally here, so that a rollback to a
/// savepoint undoes it as PostgreSQL undoes its own state, and forwarded with each statement
/// like `search_path`. Superuser-only: the extension sets it on the user's behalf.
static CONSTRAINT_MODES: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c""));

/// The lock timeout of statements in transactions with parts on several nodes: each
/// PostgreSQL detects deadlocks among its own backends only, so a cycle of lock waits across
/// nodes ends by this timeout (55P03) instead of never. 0 turns it off.
static DISTRIBUTED_LOCK_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(2000);

/// Upper bound on one call to pgmr, so that a stuck pgmr cannot hang a backend.
static SIDECAR_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(2000);

/// Defines the settings. Called once, from `_PG_init` in the postmaster.
pub fn init() {
    // SAFETY: `check_locality` has the signature PostgreSQL expects of a string check hook and
    // is `#[pg_guard]`ed, so a Rust panic inside it becomes a PostgreSQL error instead of
    // unwinding into C.
    #[allow(unsafe_code)]
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"multiregion.locality",
            c"Locality of this node, as comma-separated key=value tiers.",
            c"Most general tier first and a region tier required, e.g. \
              region=us-east1,zone=us-east1-b. Set by \"pgmr start\" from --locality.",
            &LOCALITY,
            GucContext::Postmaster,
            GucFlags::default(),
            Some(check_locality),
            None,
            None,
        );
    }
    GucRegistry::define_string_guc(
        c"multiregion.sidecar_socket",
        c"Path of the Unix socket on which this node's pgmr answers the extension.",
        c"Set by \"pgmr start\". Empty means this server is not managed by pgmr.",
        &SIDECAR_SOCKET,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"multiregion.sidecar_timeout",
        c"How long a SQL function waits for pgmr before failing.",
        c"Calls to pgmr can also be cancelled like any query.",
        &SIDECAR_TIMEOUT_MS,
        10,
        60_000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_bool_guc(
        c"multiregion.enable_auto_rehoming",
        c"REGIONAL BY ROW tables created while on rehome a row to the gateway region on UPDATE.",
        c"Applies to tables given the hidden crdb_region column while the setting is on; an \
          UPDATE that sets crdb_region itself keeps the value it sets.",
        &ENABLE_AUTO_REHOMING,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"multiregion.snapshot_barrier",
        c"A READ ONLY REPEATABLE READ or SERIALIZABLE transaction waits, when it begins, for \
          this node's copies.",
        c"Its one snapshot then holds every write acknowledged anywhere before it began, as \
          pg_dump needs; pgmr's own snapshot readers turn it off.",
        &SNAPSHOT_BARRIER,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"multiregion.gather_pushdown",
        c"A read gathered from the leaseholders asks them only for the columns and rows it needs.",
        c"Its WHERE conjuncts over one table (immutable, not on an outer join's nullable side) \
          and the columns it reads are sent with the request; off, whole tables are sent.",
        &GATHER_PUSHDOWN,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"multiregion.gather_partial_aggregates",
        c"A gathered aggregate over one table is computed in parts at the leaseholders.",
        c"Each leaseholder aggregates its partitions' rows by the query's groups and only those \
          results are sent and combined (count, sum, min, max, bool_and, bool_or); off, the \
          rows are sent.",
        &GATHER_PARTIAL_AGGREGATES,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"multiregion.override_multi_region_zone_config",
        c"CONFIGURE ZONE may change the fields a multi-region database derives.",
        c"Placement fields (num_replicas, num_voters, constraints, voter_constraints, \
          lease_preferences, global_reads) of a multi-region database are derived from its \
          regions, survival goal and localities; with this on they can be overridden.",
        &OVERRIDE_MULTI_REGION_ZONE_CONFIG,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"multiregion.replicate_ddl",
        c"Replicate schema changes made on this node to every node of the cluster.",
        c"Off lets this node's schema diverge from the cluster's; for repairs only.",
        &REPLICATE_DDL,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"multiregion.distributed_lock_timeout",
        c"Lock timeout of statements in transactions with parts on several nodes.",
        c"Ends deadlocks across nodes, which no single PostgreSQL can detect. A smaller \
          lock_timeout of the session wins; 0 turns this off.",
        &DISTRIBUTED_LOCK_TIMEOUT_MS,
        0,
        3_600_000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_string_guc(
        c"multiregion.constraint_modes",
        c"SET CONSTRAINTS of this transaction, for the nodes serving its statements.",
        c"Set by the extension; forwarded with each statement run on another node.",
        &CONSTRAINT_MODES,
        GucContext::Suset,
        GucFlags::NO_SHOW_ALL,
    );
    GucRegistry::define_string_guc(
        c"multiregion.prepare_as",
        c"Set by pgmr when a forwarded transaction prepares as part of a two-phase commit.",
        c"The range that records the decision and the transaction's decision key.",
        &PREPARE_AS,
        GucContext::Suset,
        GucFlags::NO_SHOW_ALL,
    );
    reserve_prefix();
}

/// The lock timeout for a statement of a transaction with parts on several nodes, given the
/// session's own (`current_ms`, 0 = none): `None` when the session's is already as short.
pub fn distributed_lock_timeout(current_ms: i32) -> Option<u64> {
    let d = DISTRIBUTED_LOCK_TIMEOUT_MS.get();
    (d > 0 && (current_ms <= 0 || current_ms > d)).then_some(d as u64)
}

/// The `SET CONSTRAINTS` modes in effect (see [`CONSTRAINT_MODES`]), as set.
pub fn constraint_modes() -> String {
    CONSTRAINT_MODES
        .get()
        .and_then(|c| c.to_str().ok().map(str::to_owned))
        .unwrap_or_default()
}

/// This transaction's part in another node's two-phase commit, if pgmr set one.
pub fn prepare_as() -> Option<mr_wire::local::PrepareAs> {
    let raw = PREPARE_AS.get()?;
    mr_wire::local::PrepareAs::from_setting(raw.to_str().ok()?)
}

/// Turns a misspelt `multiregion.*` setting into an error instead of a silent placeholder.
#[allow(unsafe_code)]
fn reserve_prefix() {
    // SAFETY: a static NUL-terminated string; PostgreSQL copies it and is in the postmaster's
    // single-threaded startup here.
    unsafe { pg_sys::MarkGUCPrefixReserved(c"multiregion".as_ptr()) }
}

/// This node's locality. Errors if none is configured; a malformed value cannot get past
/// [`check_locality`], but is still reported rather than assumed away.
pub fn locality() -> Result<Locality, MrError> {
    let raw = LOCALITY.get().unwrap_or_default();
    parse_locality(raw.as_bytes())?.ok_or(MrError::NoLocality)
}

/// The pgmr socket path, if this server is managed by pgmr.
pub fn sidecar_socket() -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let raw = SIDECAR_SOCKET.get().unwrap_or_default();
    let raw = raw.as_bytes();
    (!raw.is_empty()).then(|| PathBuf::from(std::ffi::OsStr::from_bytes(raw)))
}

pub fn snapshot_barrier() -> bool {
    SNAPSHOT_BARRIER.get()
}

pub fn gather_pushdown() -> bool {
    GATHER_PUSHDOWN.get()
}

pub fn gather_partial_aggregates() -> bool {
    GATHER_PARTIAL_AGGREGATES.get()
}

pub fn enable_auto_rehoming() -> bool {
    ENABLE_AUTO_REHOMING.get()
}

pub fn override_multi_region_zone_config() -> bool {
    OVERRIDE_MULTI_REGION_ZONE_CONFIG.get()
}

pub fn replicate_ddl() -> bool {
    REPLICATE_DDL.get()
}

pub fn sidecar_timeout() -> Duration {
    // The GUC's minimum (10) keeps this positive; max(0) only guards the conversion.
    Duration::from_millis(SIDECAR_TIMEOUT_MS.get().max(0) as u64)
}

/// Parses a candidate `multiregion.locality`: `None` if blank (not configured).
fn parse_locality(raw: &[u8]) -> Result<Option<Locality>, MrError> {
    let s = std::str::from_utf8(raw).map_err(|_| MrError::LocalityNotUtf8)?;
    if s.trim().is_empty() {
        return Ok(None);
    }
    Locality::parse(s)
        .map(Some)
        .map_err(MrError::InvalidLocality)
}

/// GUC check hook for `multiregion.locality`; runs for postgresql.conf, `-c` and ALTER SYSTEM.
///
/// When the postmaster applies the configured value while loading the library, PostgreSQL
/// would only log a WARNING for a refused custom setting and start without a locality; a node
/// that does not know where it is must not serve, so that case stops startup with FATAL.
#[pg_guard]
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn check_locality(
    newval: *mut *mut c_char,
    _extra: *mut *mut c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    // SAFETY: PostgreSQL passes a valid pointer to the candidate value, which is either NULL or
    // a NUL-terminated string that outlives this call.
    let raw = unsafe {
        match newval.as_ref() {
            Some(p) if !p.is_null() => CStr::from_ptr(*p).to_bytes(),
            _ => b"",
        }
    };
    let Err(err) = parse_locality(raw) else {
        return true;
    };
    if postmaster_loading_libraries() {
        err.report(PgLogLevel::FATAL);
    }
    set_check_error(&err);
    false
}

/// True while the postmaster itself runs `shared_preload_libraries` (not in a backend).
#[allow(unsafe_code)]
fn postmaster_loading_libraries() -> bool {
    // SAFETY: plain reads of PostgreSQL globals, from the thread PostgreSQL runs us on.
    unsafe { pg_sys::process_shared_preload_libraries_in_progress && !pg_sys::IsUnderPostmaster }
}

/// The equivalent of C's `GUC_check_errmsg()` and `GUC_check_errhint()`: PostgreSQL reports the
/// strings after the hook returns false, then frees them by resetting `ErrorContext`.
#[allow(unsafe_code)]
fn set_check_error(err: &MrError) {
    let msg = pg_cstring(&err.to_string());
    let hint = err.hint().map(pg_cstring);
    // SAFETY: `ErrorContext` always exists in a running server, `MemoryContextStrdup` copies
    // the NUL-terminated strings into it, and PostgreSQL reads these two globals (which it
    // resets before each check hook call) only after the hook returns.
    unsafe {
        pg_sys::GUC_check_errmsg_string =
            pg_sys::MemoryContextStrdup(pg_sys::ErrorContext, msg.as_ptr());
        if let Some(hint) = hint {
            pg_sys::GUC_check_errhint_string =
                pg_sys::MemoryContextStrdup(pg_sys::ErrorContext, hint.as_ptr());
        }
    }
}

/// A C string for a message; interior NULs (impossible in a C-string GUC value) are dropped.
fn pg_cstring(s: &str) -> CString {
    CString::new(s.replace('\0', "")).unwrap_or_default()
}
