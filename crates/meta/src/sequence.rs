//! Cluster-wide sequences: one counter per sequence in the meta group, handed out in blocks.
//!
//! PostgreSQL keeps a sequence's state in one relation on one server; here every node has a
//! copy of that relation, so a value drawn from a node's copy can be drawn again elsewhere.
//! The counter that matters lives in the meta state instead ([`crate::MetaState`]), keyed by
//! the sequence's name (a sequence is a relation: [`TableRef`]), and [`allocate`] draws from
//! it exactly as PostgreSQL's `nextval` draws from its relation — including its `CACHE`: a
//! block of values is taken at once and handed out by the session that took it.
//!
//! The parameters (increment, bounds, cycling) are the sequence's own, sent with each draw:
//! they change only by DDL, which every node applies, so the caller's copy is current.

use crate::TableRef;
use serde::{Deserialize, Serialize};

/// What `CREATE SEQUENCE` declared (`pg_catalog.pg_sequence`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceParams {
    pub start: i64,
    pub increment: i64,
    pub min: i64,
    pub max: i64,
    pub cycle: bool,
}

/// A sequence's position, as PostgreSQL keeps it: the last value handed out, or with
/// `is_called` false the value the next draw returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceValue {
    pub last: i64,
    pub is_called: bool,
}

/// Values `first, first + increment, …`, `count` of them (at least one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceBlock {
    pub first: i64,
    pub count: u64,
}

/// A draw past the sequence's bound without `CYCLE`: PostgreSQL's "reached maximum value".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceLimit {
    /// The bound reached: the maximum of an ascending sequence, the minimum of a descending
    /// one.
    pub limit: i64,
}

/// A change to the counters that DDL or `setval` makes. Applied in order; a change to a
/// sequence without a counter sets or moves nothing (its counter starts from the drawing
/// node's copy of the relation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum SequenceChange {
    /// `setval`, `ALTER SEQUENCE … RESTART`: the counter is set (created if absent).
    Set {
        sequence: TableRef,
        value: SequenceValue,
    },
    /// The sequence is gone: a new one under its name starts afresh.
    Drop { sequence: TableRef },
    /// `ALTER SEQUENCE … RENAME TO`, `SET SCHEMA`, a renamed schema: each counter moves
    /// from the first name to the second, all at once (two sequences may swap names).
    Move { moves: Vec<(TableRef, TableRef)> },
}

impl SequenceChange {
    /// The database of the sequences it names.
    pub fn database(&self) -> &str {
        match self {
            SequenceChange::Set { sequence, .. } | SequenceChange::Drop { sequence } => {
                &sequence.database
            }
            SequenceChange::Move { moves } => {
                moves.first().map_or("", |(from, _)| from.database.as_str())
            }
        }
    }
}

/// A sequence's name: (schema, name).
pub type SequenceName = (String, String);

/// What a transaction's DDL did to the counters, from the sequences (by OID) and their
/// names before and after it: a sequence whose name no sequence has any more is dropped; a
/// sequence with a new name moves its counter. A sequence dropped while another takes its
/// name in the same transaction (a table rebuilt under its name) leaves the counter to the
/// newcomer, so the values it hands out continue rather than repeat.
pub fn changes<K: Ord>(
    database: &str,
    before: &std::collections::BTreeMap<K, SequenceName>,
    after: &std::collections::BTreeMap<K, SequenceName>,
) -> Vec<SequenceChange> {
    let named: std::collections::BTreeSet<&SequenceName> = after.values().collect();
    let sequence = |(schema, name): &SequenceName| TableRef {
        database: database.to_string(),
        schema: schema.clone(),
        table: name.clone(),
    };
    let mut out: Vec<SequenceChange> = before
        .iter()
        .filter(|(k, name)| !after.contains_key(k) && !named.contains(name))
        .map(|(_, name)| SequenceChange::Drop {
            sequence: sequence(name),
        })
        .collect();
    let moves: Vec<(TableRef, TableRef)> = before
        .iter()
        .filter_map(|(k, from)| {
            let to = after.get(k)?;
            (to != from).then(|| (sequence(from), sequence(to)))
        })
        .collect();
    if !moves.is_empty() {
        out.push(SequenceChange::Move { moves });
    }
    out
}

/// Draws up to `count` values (at least one) after `state`, as PostgreSQL's `nextval` with
/// `CACHE count` does; returns the block and the new state (its last value, called). A
/// block stops short at the sequence's bound; it never wraps inside, so that its values
/// stay evenly spaced: with `CYCLE`, a draw at the bound starts the next block at the
/// other end.
pub fn allocate(
    state: SequenceValue,
    params: &SequenceParams,
    count: u64,
) -> Result<(SequenceBlock, SequenceValue), SequenceLimit> {
    let count = count.max(1);
    let inc = params.increment;
    let first = if state.is_called {
        match step(state.last, inc, params) {
            Some(v) => v,
            None if params.cycle => {
                if inc > 0 {
                    params.min
                } else {
                    params.max
                }
            }
            None => {
                return Err(SequenceLimit {
                    limit: if inc > 0 { params.max } else { params.min },
                })
            }
        }
    } else {
        state.last
    };
    let mut last = first;
    let mut n = 1;
    while n < count {
        match step(last, inc, params) {
            Some(v) => {
                last = v;
                n += 1;
            }
            None => break,
        }
    }
    Ok((
        SequenceBlock { first, count: n },
        SequenceValue {
            last,
            is_called: true,
        },
    ))
}

/// `v + inc` if it stays within the bounds (computed without overflow).
fn step(v: i64, inc: i64, params: &SequenceParams) -> Option<i64> {
    let next = v.checked_add(inc)?;
    (params.min..=params.max).contains(&next).then_some(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(increment: i64, min: i64, max: i64, cycle: bool) -> SequenceParams {
        SequenceParams {
            start: if increment > 0 { min } else { max },
            increment,
            min,
            max,
            cycle,
        }
    }

    fn fresh(v: i64) -> SequenceValue {
        SequenceValue {
            last: v,
            is_called: false,
        }
    }

    fn names(items: &[(u32, &str)]) -> std::collections::BTreeMap<u32, SequenceName> {
        items
            .iter()
            .map(|(k, n)| (*k, ("public".to_string(), n.to_string())))
            .collect()
    }

    fn r(name: &str) -> TableRef {
        TableRef {
            database: "d".into(),
            schema: "public".into(),
            table: name.into(),
        }
    }

    #[test]
    fn ddl_drops_moves_and_swaps_counters_by_oid() {
        let before = names(&[(1, "a"), (2, "b"), (3, "c"), (4, "x")]);
        // 1 and 2 swap names, 3 is dropped, 4 is dropped and 5 takes its name, 6 is new.
        let after = names(&[(1, "b"), (2, "a"), (5, "x"), (6, "n")]);
        assert_eq!(
            changes("d", &before, &after),
            vec![
                SequenceChange::Drop { sequence: r("c") },
                SequenceChange::Move {
                    moves: vec![(r("a"), r("b")), (r("b"), r("a"))]
                },
            ]
        );
        assert!(changes("d", &after, &after).is_empty());
    }

    #[test]
    fn a_fresh_sequence_hands_out_its_start_then_steps() {
        let p = params(1, 1, i64::MAX, false);
        let (b, s) = allocate(fresh(1), &p, 1).unwrap();
        assert_eq!((b.first, b.count), (1, 1));
        let (b, s) = allocate(s, &p, 10).unwrap();
        assert_eq!((b.first, b.count), (2, 10));
        assert_eq!(s.last, 11);
        assert!(s.is_called);
    }

    #[test]
    fn a_block_stops_at_the_bound_and_the_next_draw_fails_without_cycle() {
        let p = params(5, 1, 20, false);
        let (b, s) = allocate(fresh(1), &p, 100).unwrap();
        assert_eq!((b.first, b.count, s.last), (1, 4, 16));
        assert_eq!(allocate(s, &p, 1), Err(SequenceLimit { limit: 20 }));
    }

    #[test]
    fn descending_sequences_step_down_and_cycle_to_their_maximum() {
        let p = params(-2, -5, -1, true);
        let (b, s) = allocate(fresh(-1), &p, 10).unwrap();
        assert_eq!((b.first, b.count, s.last), (-1, 3, -5));
        let (b, _) = allocate(s, &p, 1).unwrap();
        assert_eq!(b.first, -1, "cycled to the maximum");
    }

    #[test]
    fn steps_near_the_type_limits_do_not_overflow() {
        let p = params(i64::MAX, i64::MIN + 1, i64::MAX, false);
        let s = SequenceValue {
            last: 1,
            is_called: true,
        };
        assert_eq!(allocate(s, &p, 1), Err(SequenceLimit { limit: i64::MAX }));
    }
}
