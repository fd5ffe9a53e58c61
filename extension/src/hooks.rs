//! PostgreSQL hooks: thin guarded shims. Each chains the hook that was installed before it, then
//! hands the work to [`crate::rewrite`].

use pgrx::pg_sys;
use pgrx::prelude::*;
use std::sync::OnceLock;

/// The `post_parse_analyze_hook` found at load time (another extension's, or none).
static PREV_POST_PARSE_ANALYZE: OnceLock<pg_sys::post_parse_analyze_hook_type> = OnceLock::new();

/// The `planner_hook` found at load time.
static PREV_PLANNER: OnceLock<pg_sys::planner_hook_type> = OnceLock::new();

/// The `ExecutorStart_hook` found at load time.
static PREV_EXECUTOR_START: OnceLock<pg_sys::ExecutorStart_hook_type> = OnceLock::new();

/// The `ExecutorRun_hook` found at load time.
static PREV_EXECUTOR_RUN: OnceLock<pg_sys::ExecutorRun_hook_type> = OnceLock::new();

/// The `ExecutorFinish_hook` found at load time.
static PREV_EXECUTOR_FINISH: OnceLock<pg_sys::ExecutorFinish_hook_type> = OnceLock::new();

/// The `ExecutorEnd_hook` found at load time.
static PREV_EXECUTOR_END: OnceLock<pg_sys::ExecutorEnd_hook_type> = OnceLock::new();

/// The `ProcessUtility_hook` found at load time.
static PREV_PROCESS_UTILITY: OnceLock<pg_sys::ProcessUtility_hook_type> = OnceLock::new();

/// The `emit_log_hook` found at load time.
static PREV_EMIT_LOG: OnceLock<pg_sys::emit_log_hook_type> = OnceLock::new();

/// Installs the hooks. Called once, from `_PG_init` in the postmaster; backends inherit them.
#[allow(unsafe_code)]
pub fn init() {
    // SAFETY: `_PG_init` runs single-threaded in the postmaster while it loads
    // shared_preload_libraries, before any backend exists; saving the previous hook and
    // installing ours is the protocol PostgreSQL defines for chaining hooks. The callback
    // registration copies a function pointer into a fixed array that forked backends inherit.
    unsafe {
        let _ = PREV_POST_PARSE_ANALYZE.set(pg_sys::post_parse_analyze_hook);
        pg_sys::post_parse_analyze_hook = Some(post_parse_analyze);
        let _ = PREV_PROCESS_UTILITY.set(pg_sys::ProcessUtility_hook);
        pg_sys::ProcessUtility_hook = Some(process_utility);
        let _ = PREV_PLANNER.set(pg_sys::planner_hook);
        pg_sys::planner_hook = Some(planner);
        let _ = PREV_EXECUTOR_START.set(pg_sys::ExecutorStart_hook);
        pg_sys::ExecutorStart_hook = Some(executor_start);
        let _ = PREV_EXECUTOR_RUN.set(pg_sys::ExecutorRun_hook);
        pg_sys::ExecutorRun_hook = Some(executor_run);
        let _ = PREV_EXECUTOR_FINISH.set(pg_sys::ExecutorFinish_hook);
        pg_sys::ExecutorFinish_hook = Some(executor_finish);
        let _ = PREV_EXECUTOR_END.set(pg_sys::ExecutorEnd_hook);
        pg_sys::ExecutorEnd_hook = Some(executor_end);
        let _ = PREV_EMIT_LOG.set(pg_sys::emit_log_hook);
        pg_sys::emit_log_hook = Some(emit_log);
        pg_sys::CacheRegisterRelcacheCallback(Some(relcache_invalidated), pg_sys::Datum::from(0));
    }
}

/// Reports an error or message: a duplicate key in a REGIONAL BY ROW table's partition, and a
/// foreign key checked against a key table, are reported as CockroachDB reports them
/// ([`crate::unique_errors`]); then the previous hook runs.
/// Not `#[pg_guard]`ed: it runs inside error reporting, and neither it nor what it calls
/// raises (no catalog access; a Rust panic is caught and the report left as it was).
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn emit_log(edata: *mut pg_sys::ErrorData) {
    // SAFETY: PostgreSQL passes the ErrorData being reported, valid and ours to change for the
    // call, with the error context current; null is checked.
    let _ = std::panic::catch_unwind(|| unsafe {
        if let Some(e) = edata.as_mut() {
            crate::unique_errors::rewrite(e);
        }
    });
    if let Some(Some(prev)) = PREV_EMIT_LOG.get() {
        // SAFETY: the previous hook has the same contract and gets the (rewritten) report.
        unsafe { prev(edata) };
    }
}

/// After PostgreSQL has analysed a statement, before the rewriter and planner see it.
#[pg_guard]
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn post_parse_analyze(
    pstate: *mut pg_sys::ParseState,
    query: *mut pg_sys::Query,
    jstate: *mut pg_sys::JumbleState,
) {
    if let Some(Some(prev)) = PREV_POST_PARSE_ANALYZE.get() {
        // SAFETY: the previous hook has the same contract and gets our arguments untouched.
        unsafe { prev(pstate, query, jstate) };
    }
    // SAFETY: PostgreSQL passes the ParseState and Query it has just built, both valid and
    // exclusively ours for the duration of the call; null is checked rather than assumed away.
    unsafe {
        if let (Some(pstate), Some(query)) = (pstate.as_ref(), query.as_mut()) {
            crate::rewrite::after_analysis(pstate, query);
        }
    }
}

/// Plans a query after adding the region filters its computed region columns imply
/// ([`crate::region_filter`]).
#[pg_guard]
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn planner(
    parse: *mut pg_sys::Query,
    query_string: *const std::ffi::c_char,
    cursor_options: std::ffi::c_int,
    bound_params: pg_sys::ParamListInfo,
) -> *mut pg_sys::PlannedStmt {
    // SAFETY: PostgreSQL passes the Query it is about to plan, ours to change until planned.
    unsafe {
        crate::sequences::redirect(parse);
        crate::gather::rewrite(parse);
        crate::region_filter::derive(parse, bound_params);
    }
    // SAFETY: the previous hook (or PostgreSQL's own planner) with our arguments.
    unsafe {
        match PREV_PLANNER.get() {
            Some(Some(prev)) => prev(parse, query_string, cursor_options, bound_params),
            _ => pg_sys::standard_planner(parse, query_string, cursor_options, bound_params),
        }
    }
}

/// Runs a utility statement; a schema change typed by a client is then replicated to every
/// node (see [`crate::regions::replicated_ddl`]).
#[pg_guard]
#[allow(unsafe_code, clippy::too_many_arguments)]
unsafe extern "C-unwind" fn process_utility(
    pstmt: *mut pg_sys::PlannedStmt,
    query_string: *const std::ffi::c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    query_env: *mut pg_sys::QueryEnvironment,
    dest: *mut pg_sys::DestReceiver,
    qc: *mut pg_sys::QueryCompletion,
) {
    // SAFETY: PostgreSQL passes a valid PlannedStmt and its NUL-terminated source text; the
    // statement's text is copied out before it runs, since running may scribble on the tree.
    let top_level = context == pg_sys::ProcessUtilityContext::PROCESS_UTILITY_TOPLEVEL;
    // SAFETY: as above; a restored dump's CREATE TRIGGER of a capture trigger its table's
    // CREATE TABLE already made is a no-op (docs/ARCHITECTURE.md §2.1.1).
    if unsafe { crate::regions::existing_capture_trigger(&*pstmt) } {
        // SAFETY: the statement's completion, when PostgreSQL asked for one.
        unsafe {
            if !qc.is_null() {
                (*qc).commandTag = pg_sys::CommandTag::CMDTAG_CREATE_TRIGGER;
                (*qc).nprocessed = 0;
            }
        }
        return;
    }
    let (replicate, database) = unsafe {
        if top_level {
            crate::regions::refuse_region_type_change(&*pstmt);
            (
                crate::regions::replicated_ddl(&*pstmt, query_string),
                crate::regions::database_ddl(&*pstmt),
            )
        } else {
            (None, None)
        }
    };
    // SAFETY: as above; a TRUNCATE … RESTART IDENTITY restarts its tables' sequences.
    unsafe { crate::sequences::before_utility(&*pstmt) };
    if replicate.is_some() {
        // SAFETY: as above; a change that reshapes replicated tables first locks them
        // against writers at their leaseholders (docs/ARCHITECTURE.md §8.6).
        unsafe {
            let text = match &replicate {
                Some(crate::regions::Ddl::Text(sql)) => Some(sql.as_str()),
                _ => None,
            };
            crate::regions::fence_before_ddl(&*pstmt, text)
        };
    }
    // SAFETY: as above; a TRUNCATE waits for new ranges before it locks their tables, and
    // one of tables another node leases runs there.
    if unsafe { crate::regions::await_ranges_before_truncate(&*pstmt, query_string) } {
        // SAFETY: the statement's completion, when PostgreSQL asked for one.
        unsafe {
            if !qc.is_null() {
                (*qc).commandTag = pg_sys::CommandTag::CMDTAG_TRUNCATE_TABLE;
                (*qc).nprocessed = 0;
            }
        }
        return;
    }
    // SAFETY: as above; a partition truncated by itself releases its rows' global keys.
    unsafe { crate::regions::release_truncated_partition_keys(&*pstmt) };
    // SAFETY: as above; a table attached as a partition gives up its own capture row
    // triggers for its parent's, a detached one gets them back after.
    let partition_change = unsafe { crate::regions::before_partition_change(&*pstmt) };
    // SAFETY: as above; a COPY TO reads this node's copy, which must be whole and current.
    let copy_snapshot = unsafe { crate::replication::before_copy_to(&*pstmt) };
    // SAFETY: as above; a COPY FREEZE whose rows all go to another node drops the FREEZE,
    // and another node's schema change adds foreign keys without checking this node's rows.
    let pstmt = unsafe { crate::routing::without_copy_freeze(pstmt) };
    let pstmt = unsafe { crate::regions::trusting_foreign_keys(pstmt) };
    // SAFETY: as above; a foreign key to a REGIONAL BY ROW table's key without the region
    // references the key table that keeps it unique.
    let pstmt = unsafe { crate::regions::foreign_keys_to_key_tables(pstmt) };
    // SAFETY: as above; a UNIQUE key added to a REGIONAL BY ROW table gets the region column
    // in front (PostgreSQL's partitioning needs it) and a key table across regions, after
    // the rows are checked where the statement was typed.
    let (pstmt, unique_keys) = unsafe { crate::regions::unique_keys_with_region(pstmt) };
    // SAFETY: as above; a renamed key's key table follows it.
    let renamed_key = unsafe { crate::regions::renamed_key(&*pstmt) };
    crate::regions::check_added_unique_keys(&unique_keys, replicate.is_some());
    // SAFETY: the previous hook (or PostgreSQL's own implementation) with our arguments as
    // given; a COPY FROM's rows for other nodes' ranges are collected around it.
    unsafe {
        crate::routing::copy_from(&*pstmt, qc, || match PREV_PROCESS_UTILITY.get() {
            // Guarded: an ERROR inside unwinds through our frames (the collecting scope).
            Some(Some(prev)) => pg_sys::ffi::pg_guard_ffi_boundary(|| {
                prev(
                    pstmt,
                    query_string,
                    read_only_tree,
                    context,
                    params,
                    query_env,
                    dest,
                    qc,
                )
            }),
            _ => pg_sys::standard_ProcessUtility(
                pstmt,
                query_string,
                read_only_tree,
                context,
                params,
                query_env,
                dest,
                qc,
            ),
        });
    }
    // SAFETY: as above; the statement ran (an ALTER SEQUENCE … RESTART is recorded).
    unsafe { crate::sequences::after_utility(&*pstmt) };
    // SAFETY: as above; a SET CONSTRAINTS is kept for the nodes serving this transaction.
    unsafe { crate::ri::after_utility(&*pstmt) };
    crate::replication::after_copy_to(copy_snapshot);
    crate::regions::after_partition_change(partition_change);
    // SAFETY: as above; a snapshot transaction begun now (pg_dump's) waits for this node's
    // copies before its first statement takes the snapshot.
    unsafe { crate::replication::snapshot_barrier(&*pstmt) };
    crate::regions::create_added_key_tables(unique_keys);
    crate::regions::rename_global_key(renamed_key);
    if let Some(ddl) = replicate {
        crate::regions::replicate_ddl(ddl);
    }
    if let Some(ddl) = database {
        crate::regions::database_ddl_done(ddl);
    }
}

/// Before a query runs: where it runs is decided ([`crate::routing::executor_start`]); a
/// read that stays here first waits until this node has applied every write acknowledged
/// before it.
#[pg_guard]
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn executor_start(query_desc: *mut pg_sys::QueryDesc, eflags: i32) {
    // SAFETY: PostgreSQL passes the QueryDesc it is about to start, valid and ours for the
    // call; null is checked.
    unsafe {
        if let Some(qd) = query_desc.as_mut() {
            crate::routing::executor_start(qd, eflags);
        }
    }
    // SAFETY: the previous hook (or PostgreSQL's own implementation) with our arguments.
    unsafe {
        match PREV_EXECUTOR_START.get() {
            Some(Some(prev)) => prev(query_desc, eflags),
            _ => pg_sys::standard_ExecutorStart(query_desc, eflags),
        }
    }
    // SAFETY: the QueryDesc just started, as above.
    unsafe {
        if let Some(qd) = query_desc.as_ref() {
            crate::routing::refuse_locks_on_copies(qd);
        }
    }
}

/// Runs a query: one routed to another node yields that node's rows
/// ([`crate::routing::executor_run`]); the others run as usual.
#[pg_guard]
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn executor_run(
    query_desc: *mut pg_sys::QueryDesc,
    direction: pg_sys::ScanDirection::Type,
    count: u64,
    execute_once: bool,
) {
    // SAFETY: PostgreSQL passes a started QueryDesc; the closure runs the previous hook (or
    // PostgreSQL's own implementation) with our arguments untouched.
    unsafe {
        crate::routing::executor_run(query_desc, direction, count, || {
            match PREV_EXECUTOR_RUN.get() {
                // Guarded: an ERROR inside unwinds through our frames (the depth guard).
                Some(Some(prev)) => pg_sys::ffi::pg_guard_ffi_boundary(|| {
                    prev(query_desc, direction, count, execute_once)
                }),
                _ => pg_sys::standard_ExecutorRun(query_desc, direction, count, execute_once),
            }
        });
    }
}

/// Finishes a query (its AFTER triggers run here), then applies the global key changes of a
/// statement that is not nested in another ([`crate::routing::executor_finished`]).
#[pg_guard]
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn executor_finish(query_desc: *mut pg_sys::QueryDesc) {
    crate::routing::executor_finishing();
    if crate::routing::serving() {
        // SAFETY: PostgreSQL passes the QueryDesc whose ExecutorFinish this is.
        unsafe { crate::ri::shim_triggers(query_desc) };
    }
    // SAFETY: the previous hook (or PostgreSQL's own implementation) with our argument. Called
    // without pgrx's guard, as C hooks call it: an ERROR in an AFTER trigger then reaches the
    // client with its CONTEXT, which pgrx's guard drops when it rethrows. The ERROR longjmps
    // over this frame, which holds nothing to drop; the depth counter it leaves raised is
    // restored when the (sub)transaction aborts.
    unsafe {
        match PREV_EXECUTOR_FINISH.get() {
            Some(Some(prev)) => prev(query_desc),
            _ => standard_ExecutorFinish_unguarded(query_desc),
        }
    }
    crate::routing::executor_finished();
}

#[allow(unsafe_code)]
unsafe extern "C-unwind" {
    /// execMain.c's ExecutorFinish, bound without pgrx's guard (see `executor_finish`).
    #[link_name = "standard_ExecutorFinish"]
    fn standard_ExecutorFinish_unguarded(query_desc: *mut pg_sys::QueryDesc);
}

/// After a query: forgets its routing.
#[pg_guard]
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn executor_end(query_desc: *mut pg_sys::QueryDesc) {
    crate::routing::executor_end(query_desc);
    // SAFETY: the previous hook (or PostgreSQL's own implementation) with our argument.
    unsafe {
        match PREV_EXECUTOR_END.get() {
            Some(Some(prev)) => prev(query_desc),
            _ => pg_sys::standard_ExecutorEnd(query_desc),
        }
    }
}

/// A relation's cached definition changed (or, with an invalid OID, all of them may have).
#[pg_guard]
#[allow(unsafe_code)]
unsafe extern "C-unwind" fn relcache_invalidated(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    crate::rewrite::forget(relid);
    crate::replication::forget(relid);
    crate::apply::forget(relid);
    crate::sequences::forget(relid);
}
