//! Which nodes vote in the meta Raft group.
//!
//! Voters are spread over regions so that, once there are three regions, losing any one of
//! them leaves a majority: with five voters across three regions no region holds more than
//! two. The count is odd (an even count tolerates no more failures than one fewer voter, and
//! needs a larger quorum) and at most [`MAX_VOTERS`]: every write waits for a majority of
//! them, so more voters would only add latency. Current voters are kept where the rules allow,
//! so a membership change moves as few voters as possible.

use crate::NodeId;
use std::collections::{BTreeMap, BTreeSet};

pub const MAX_VOTERS: usize = 5;

/// A node that could vote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub node_id: NodeId,
    pub region: String,
    /// Live or merely suspect, and not decommissioned. A suspect voter is kept: replacing a
    /// voter on a short partition would churn membership exactly when the group is weakest.
    pub eligible: bool,
}

/// The voter set the group should have. With no eligible candidate the current set is kept.
pub fn choose_voters(candidates: &[Candidate], current: &BTreeSet<NodeId>) -> BTreeSet<NodeId> {
    let eligible: Vec<&Candidate> = candidates.iter().filter(|c| c.eligible).collect();
    if eligible.is_empty() {
        return current.clone();
    }
    let target = {
        let n = eligible.len().min(MAX_VOTERS);
        if n.is_multiple_of(2) {
            n - 1
        } else {
            n
        }
    };
    // Per region: current voters first, then by node id.
    let mut by_region: BTreeMap<&str, Vec<NodeId>> = BTreeMap::new();
    for c in &eligible {
        by_region.entry(&c.region).or_default().push(c.node_id);
    }
    for ids in by_region.values_mut() {
        ids.sort_by_key(|id| (!current.contains(id), *id));
    }
    let mut chosen = BTreeSet::new();
    let mut taken: BTreeMap<&str, usize> = BTreeMap::new();
    while chosen.len() < target {
        // One voter per region per round; within a round, regions whose next pick is already
        // a voter go first, so that the region left short is one that had no voter to keep.
        let mut round: Vec<(&str, NodeId)> = by_region
            .iter()
            .filter_map(|(r, ids)| ids.get(*taken.get(r).unwrap_or(&0)).map(|id| (*r, *id)))
            .collect();
        round.sort_by_key(|(r, id)| (!current.contains(id), *r));
        for (r, id) in round {
            if chosen.len() == target {
                break;
            }
            chosen.insert(id);
            *taken.entry(r).or_default() += 1;
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(spec: &[(u64, &str)]) -> Vec<Candidate> {
        spec.iter()
            .map(|(id, r)| Candidate {
                node_id: *id,
                region: r.to_string(),
                eligible: true,
            })
            .collect()
    }

    fn per_region(c: &[Candidate], voters: &BTreeSet<NodeId>) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for n in c.iter().filter(|n| voters.contains(&n.node_id)) {
            *m.entry(n.region.clone()).or_default() += 1;
        }
        m
    }

    const NINE: [(u64, &str); 9] = [
        (1, "east"),
        (2, "east"),
        (3, "east"),
        (4, "west"),
        (5, "west"),
        (6, "west"),
        (7, "eu"),
        (8, "eu"),
        (9, "eu"),
    ];

    #[test]
    fn five_voters_over_three_regions_survive_any_one_region() {
        let c = nodes(&NINE);
        let v = choose_voters(&c, &BTreeSet::new());
        assert_eq!(v.len(), 5);
        let spread = per_region(&c, &v);
        assert_eq!(spread.len(), 3);
        assert!(spread.values().all(|n| *n <= 2), "{spread:?}");
    }

    #[test]
    fn voter_count_is_odd_and_grows_with_the_cluster() {
        for (n, want) in [(1, 1), (2, 1), (3, 3), (4, 3), (5, 5), (6, 5), (9, 5)] {
            let c = nodes(&NINE[..n]);
            assert_eq!(choose_voters(&c, &BTreeSet::new()).len(), want, "{n} nodes");
        }
    }

    #[test]
    fn a_good_voter_set_is_kept_as_it_is() {
        let c = nodes(&NINE);
        let current = BTreeSet::from([3, 6, 9, 2, 5]);
        assert_eq!(choose_voters(&c, &current), current);
        // Growing from 3 voters keeps the three.
        let three = BTreeSet::from([3, 6, 9]);
        assert!(choose_voters(&c, &three).is_superset(&three));
    }

    #[test]
    fn a_dead_or_decommissioned_voter_is_replaced_in_its_region() {
        let mut c = nodes(&NINE);
        let current = BTreeSet::from([1, 2, 4, 5, 7]);
        c[0].eligible = false; // node 1, east
        let v = choose_voters(&c, &current);
        assert_eq!(v.len(), 5);
        assert!(!v.contains(&1));
        assert!(v.is_superset(&BTreeSet::from([2, 4, 5, 7])), "{v:?}");
        assert!(v.contains(&3) || v.contains(&8) || v.contains(&9));
        assert!(per_region(&c, &v).values().all(|n| *n <= 2));
    }

    #[test]
    fn one_region_gets_every_voter_when_it_is_the_only_one() {
        let c = nodes(&[
            (1, "east"),
            (2, "east"),
            (3, "east"),
            (4, "east"),
            (5, "east"),
        ]);
        assert_eq!(choose_voters(&c, &BTreeSet::new()).len(), 5);
    }

    #[test]
    fn with_nobody_eligible_nothing_changes() {
        let mut c = nodes(&NINE[..3]);
        c.iter_mut().for_each(|n| n.eligible = false);
        let current = BTreeSet::from([1, 2, 3]);
        assert_eq!(choose_voters(&c, &current), current);
    }
}
