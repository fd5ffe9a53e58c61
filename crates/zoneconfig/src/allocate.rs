//! The allocator: which nodes hold a range's replicas, given its zone configuration.
//!
//! A zone configuration says how many voters and replicas a range has and in which regions
//! (`num_voters`, `num_replicas`, `voter_constraints`, `constraints`) and where its lease
//! should be (`lease_preferences`); this module turns that into concrete nodes. It is the
//! only placement rule: the range reconciler in pgmr calls [`allocate`] and writes what it
//! returns into the range descriptor.
//!
//! Rules, in order of precedence:
//!
//! 1. Only candidates that may hold replicas (live or suspect, not decommissioned) are used;
//!    a replica on any other node is replaced.
//! 2. Per-region minimums of `voter_constraints` are met first, then the rest of the voters
//!    go where `voter_constraints` allow; then non-voters fill every region that
//!    `constraints` requires a replica in, then up to `num_replicas` where allowed.
//! 3. Among eligible nodes: a node that holds a replica already (of the same kind, then of
//!    the other kind) is kept, so that a re-derivation moves as little as possible; then the
//!    region and zone with the fewest chosen replicas (diversity, as CockroachDB's allocator
//!    spreads over localities); then the lowest node id, so the answer is deterministic.
//! 4. If the cluster is too small, the range is under-replicated rather than unplaced: as
//!    many replicas as the candidates allow, never two on one node.

use crate::{Constraints, ZoneConfig};
use mr_meta::{NodeId, Replica, ReplicaKind};
use std::collections::BTreeMap;

/// A node that may be given replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub node_id: NodeId,
    pub region: String,
    pub zone: String,
}

/// The replicas of one range, voters first (in lease preference order), then non-voters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub replicas: Vec<Replica>,
    /// Voters in the order the lease should prefer them: lease preference regions first,
    /// then the rest; within a region, current voters before new ones, then by id.
    pub lease_order: Vec<NodeId>,
    /// How many voters and replicas the configuration wants but the cluster cannot give.
    pub missing_voters: u32,
    pub missing_replicas: u32,
}

/// CockroachDB's default zone configuration, for tables of a database without regions:
/// 3 replicas, all voters, anywhere; no lease preference.
pub fn cluster_default() -> ZoneConfig {
    ZoneConfig {
        home_region: String::new(),
        num_replicas: 3,
        num_voters: 3,
        constraints: Constraints::PerRegion(BTreeMap::new()),
        voter_constraints: Constraints::PerRegion(BTreeMap::new()),
        lease_preferences: vec![],
        global_reads: false,
        gc_ttl_seconds: crate::GC_TTL_SECONDS,
        range_min_bytes: crate::RANGE_MIN_BYTES,
        range_max_bytes: crate::RANGE_MAX_BYTES,
    }
}

/// Places the replicas of a range configured by `config` on `candidates`, keeping what
/// `current` has where the configuration allows.
pub fn allocate(config: &ZoneConfig, candidates: &[Candidate], current: &[Replica]) -> Allocation {
    let current_kind = |id: NodeId| current.iter().find(|r| r.node_id == id).map(|r| r.kind);
    let mut chosen: Vec<(&Candidate, ReplicaKind)> = Vec::new();

    // Picks the best unchosen candidate satisfying `allowed`, preferring one that is
    // currently `kind`.
    let pick = |chosen: &Vec<(&Candidate, ReplicaKind)>,
                allowed: &dyn Fn(&Candidate) -> bool,
                kind: ReplicaKind|
     -> Option<usize> {
        let count = |f: &dyn Fn(&Candidate) -> bool| chosen.iter().filter(|(c, _)| f(c)).count();
        candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| allowed(c) && !chosen.iter().any(|(x, _)| x.node_id == c.node_id))
            .min_by_key(|(_, c)| {
                let keep = match current_kind(c.node_id) {
                    Some(k) if k == kind => 0,
                    Some(_) => 1,
                    None => 2,
                };
                let in_region = count(&|x| x.region == c.region);
                let in_zone = count(&|x| x.region == c.region && x.zone == c.zone);
                (keep, in_region, in_zone, c.node_id)
            })
            .map(|(i, _)| i)
    };

    // Voters: per-region minimums, then the rest where allowed.
    let voter_allowed = allowed_regions(&config.voter_constraints);
    for (region, min) in minimums(&config.voter_constraints) {
        for _ in 0..min {
            if chosen.len() as u32 >= config.num_voters {
                break;
            }
            let in_region = |c: &Candidate| c.region == region;
            match pick(&chosen, &in_region, ReplicaKind::Voter) {
                Some(i) => chosen.push((&candidates[i], ReplicaKind::Voter)),
                None => break,
            }
        }
    }
    while (chosen.len() as u32) < config.num_voters {
        let ok = |c: &Candidate| {
            voter_allowed
                .as_ref()
                .is_none_or(|rs| rs.contains(&c.region))
        };
        match pick(&chosen, &ok, ReplicaKind::Voter) {
            Some(i) => chosen.push((&candidates[i], ReplicaKind::Voter)),
            None => break,
        }
    }
    let voters = chosen.len() as u32;

    // Non-voters: every region the constraints require a replica in, then the rest.
    let replica_allowed = allowed_regions(&config.constraints);
    for (region, min) in minimums(&config.constraints) {
        let have = chosen.iter().filter(|(c, _)| c.region == region).count() as u32;
        for _ in have..min {
            if chosen.len() as u32 >= config.num_replicas {
                break;
            }
            let in_region = |c: &Candidate| c.region == region;
            match pick(&chosen, &in_region, ReplicaKind::NonVoter) {
                Some(i) => chosen.push((&candidates[i], ReplicaKind::NonVoter)),
                None => break,
            }
        }
    }
    while (chosen.len() as u32) < config.num_replicas {
        let ok = |c: &Candidate| {
            replica_allowed
                .as_ref()
                .is_none_or(|rs| rs.contains(&c.region))
        };
        match pick(&chosen, &ok, ReplicaKind::NonVoter) {
            Some(i) => chosen.push((&candidates[i], ReplicaKind::NonVoter)),
            None => break,
        }
    }

    // Lease order: by preference region, then current voters, then id.
    let mut lease: Vec<&Candidate> = chosen
        .iter()
        .filter(|(_, k)| *k == ReplicaKind::Voter)
        .map(|(c, _)| *c)
        .collect();
    lease.sort_by_key(|c| {
        let pref = config
            .lease_preferences
            .iter()
            .position(|r| *r == c.region)
            .unwrap_or(usize::MAX);
        let was = current_kind(c.node_id) != Some(ReplicaKind::Voter);
        (pref, was, c.node_id)
    });
    let lease_order: Vec<NodeId> = lease.iter().map(|c| c.node_id).collect();

    let mut replicas: Vec<Replica> = lease_order
        .iter()
        .map(|&node_id| Replica {
            node_id,
            kind: ReplicaKind::Voter,
        })
        .collect();
    let mut non_voters: Vec<NodeId> = chosen
        .iter()
        .filter(|(_, k)| *k == ReplicaKind::NonVoter)
        .map(|(c, _)| c.node_id)
        .collect();
    non_voters.sort_unstable();
    replicas.extend(non_voters.into_iter().map(|node_id| Replica {
        node_id,
        kind: ReplicaKind::NonVoter,
    }));
    Allocation {
        missing_voters: config.num_voters.saturating_sub(voters),
        missing_replicas: config.num_replicas.saturating_sub(replicas.len() as u32),
        replicas,
        lease_order,
    }
}

/// The regions every replica must be in (`Some`), or `None` when any region will do.
fn allowed_regions(c: &Constraints) -> Option<Vec<String>> {
    match c {
        Constraints::All(rs) => Some(rs.clone()),
        Constraints::PerRegion(_) => None,
    }
}

/// Per-region minimum replica counts.
fn minimums(c: &Constraints) -> Vec<(String, u32)> {
    match c {
        Constraints::All(_) => vec![],
        Constraints::PerRegion(m) => m.iter().map(|(r, n)| (r.clone(), *n)).collect(),
    }
}

/// Whether two replica sets are the same, whatever their order.
pub fn same_replicas(a: &[Replica], b: &[Replica]) -> bool {
    let key = |rs: &[Replica]| {
        let mut v: Vec<(NodeId, bool)> = rs
            .iter()
            .map(|r| (r.node_id, r.kind == ReplicaKind::Voter))
            .collect();
        v.sort_unstable();
        v
    };
    key(a) == key(b)
}
