//! CockroachDB's `unique_rowid()`: the default of its `SERIAL` and of many schemas' keys.

use crate::error::OrRaise;
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PgAtomic};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The last 10 µs tick this node handed out, shared by its backends so that two of them in the
/// same tick still get different IDs (a node's IDs are unique because its ticks are).
// SAFETY: the name is this extension's own; no other shared memory of it has this name.
#[allow(unsafe_code)]
static LAST_TICK: PgAtomic<AtomicU64> = unsafe { PgAtomic::new(c"pg_multiregion_unique_rowid") };

/// Reserves the shared memory; from `_PG_init` (the library is always preloaded).
// pgrx's macro tests features for every PostgreSQL version; this crate declares only pg15.
#[allow(unexpected_cfgs)]
pub(crate) fn init() {
    pg_shmem_init!(LAST_TICK);
}

thread_local! {
    /// This node's ID (it never changes for a data directory), asked of pgmr once.
    static NODE_ID: Cell<Option<u64>> = const { Cell::new(None) };
}

/// The low 15 bits: this node's ID (0 without pgmr, where there is one node).
fn node_bits() -> u64 {
    NODE_ID.with(|n| {
        if let Some(id) = n.get() {
            return id;
        }
        let id = if crate::gucs::sidecar_socket().is_some() {
            crate::sidecar::node_info().or_raise().node_id & 0x7fff
        } else {
            0
        };
        n.set(Some(id));
        id
    })
}

/// A 64-bit ID unique in the cluster, in CockroachDB's layout: 10 µs ticks since the Unix
/// epoch in the high 48 bits (strictly increasing per node, so roughly time-ordered), the
/// node's ID in the low 15.
#[pg_extern(schema = "multiregion", volatile, parallel_safe)]
fn unique_rowid() -> i64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| (d.as_micros() / 10) as u64)
        .unwrap_or(0);
    let last = LAST_TICK
        .get()
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |last| {
            Some(now.max(last + 1))
        })
        .unwrap_or(now);
    let tick = now.max(last + 1) & ((1 << 48) - 1);
    ((tick << 15) | node_bits()) as i64
}
