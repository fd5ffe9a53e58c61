//! Injected crashes and stalls for the cluster tests: `PGMR_FAILPOINT=<name>` in pgmr's
//! environment makes the process abort (or, at a pause point, wait) when it reaches the point
//! of that name, exactly where a machine could fail or stall (CockroachDB's testing knobs play
//! this part). Unset, a point costs one comparison.

use std::sync::OnceLock;

/// The points, where they are.
pub const BEFORE_DECIDE: &str = "2pc-before-decide";
pub const AFTER_DECIDE: &str = "2pc-after-decide";
/// A coordinator slow to decide (a pause, not a crash): every part has prepared.
pub const SLOW_DECIDE: &str = "2pc-slow-decide";
/// A replica installing a snapshot: its rows are in PostgreSQL, Raft's storage does not know.
pub const SNAPSHOT_AFTER_ROWS: &str = "snapshot-after-rows";
/// A replica installing a snapshot: recorded as applied, not yet kept as its latest snapshot
/// (openraft then purges the log and rebuilds a snapshot when it starts).
pub const SNAPSHOT_BEFORE_KEEP: &str = "snapshot-before-keep";
/// A part's node that knows the decision does not copy it into the ranges it prepared in
/// (as when their leadership moved meanwhile): their appliers must get it there themselves.
pub const NO_DECISION_COPY: &str = "2pc-no-decision-copy";
/// A replica whose log lags (its range's copy of the decision, and anything else that would
/// tell it, not there yet): its appliers wait at a `Prepare` entry knowing nothing, ask the
/// anchor only once they would propose abort, and see their own records again a few seconds
/// after that. By then the transaction may be forgotten everywhere else. Only entries
/// proposed after this process started ([`started_ms`]): a test arms it on a node it
/// restarts, for the transactions it runs next, not for those of its setup.
pub const LATE_ASK: &str = "2pc-late-ask";

static STARTED_MS: OnceLock<u64> = OnceLock::new();

/// Notes the process's start (call first thing in `main`).
pub fn init() {
    started_ms();
    armed();
}

/// When this process started (ms since the Unix epoch).
pub fn started_ms() -> u64 {
    *STARTED_MS.get_or_init(crate::node::now_ms)
}

fn armed() -> Option<&'static str> {
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            std::env::var("PGMR_FAILPOINT")
                .ok()
                .filter(|v| !v.is_empty())
        })
        .as_deref()
}

/// Waits `for_` here if `name` is armed; the process goes on serving meanwhile.
pub async fn pause(name: &str, for_: std::time::Duration) {
    if armed() == Some(name) {
        tracing::warn!(failpoint = name, ?for_, "failpoint reached: pausing");
        tokio::time::sleep(for_).await;
    }
}

/// Aborts the process here if `name` is armed.
pub fn hit(name: &str) {
    if armed() == Some(name) {
        tracing::error!(failpoint = name, "failpoint reached: aborting");
        std::process::abort();
    }
}

/// Whether `name` is armed (a point that changes behaviour rather than crash or stall).
pub fn armed_as(name: &str) -> bool {
    armed() == Some(name)
}
