//! The allocator: concrete nodes for every zone configuration, checked on the demo's layouts
//! and over every survival goal × placement × locality × region count × nodes per region.

use mr_meta::{DatabaseConfig, Placement, Replica, ReplicaKind, SurvivalGoal, TableLocality};
use mr_zoneconfig::allocate::{allocate, cluster_default, same_replicas, Candidate};
use mr_zoneconfig::table_ranges;
use std::collections::BTreeSet;

const REGIONS: [&str; 5] = [
    "us-east1",
    "us-west1",
    "europe-west1",
    "asia-east1",
    "us-central1",
];

/// `per_region` nodes in each of the first `n` regions, numbered region by region from 1,
/// each in its own zone (a, b, c, …), as `pgmr demo` lays them out.
fn layout(n: usize, per_region: usize) -> Vec<Candidate> {
    let mut out = Vec::new();
    for r in REGIONS.iter().take(n) {
        for z in 0..per_region {
            out.push(Candidate {
                node_id: out.len() as u64 + 1,
                region: r.to_string(),
                zone: format!("{r}-{}", (b'a' + z as u8) as char),
            });
        }
    }
    out
}

fn db(n: usize, survival: SurvivalGoal, placement: Placement) -> DatabaseConfig {
    DatabaseConfig {
        database: "movr".into(),
        primary_region: "us-east1".into(),
        regions: REGIONS[..n].iter().map(|r| r.to_string()).collect(),
        survival,
        placement,
        secondary_region: None,
    }
}

fn ids(rs: &[Replica], kind: ReplicaKind) -> Vec<u64> {
    rs.iter()
        .filter(|r| r.kind == kind)
        .map(|r| r.node_id)
        .collect()
}

/// The tutorial's 9 nodes: a ZONE-survival table homed in us-east1 gets its three voters
/// there (one per zone) and one non-voter in each other region; the lease goes to us-east1.
#[test]
fn zone_survival_puts_three_voters_home_and_a_non_voter_in_every_other_region() {
    let nodes = layout(3, 3);
    let d = db(3, SurvivalGoal::Zone, Placement::Default);
    let ranges = table_ranges(Some(&d), Some(&TableLocality::Global)).unwrap();
    assert_eq!(ranges.len(), 1);
    let a = allocate(&ranges[0].1, &nodes, &[]);
    assert_eq!(ids(&a.replicas, ReplicaKind::Voter), vec![1, 2, 3]);
    assert_eq!(ids(&a.replicas, ReplicaKind::NonVoter), vec![4, 7]);
    assert_eq!(a.lease_order[0], 1);
    assert_eq!((a.missing_voters, a.missing_replicas), (0, 0));
}

/// REGIONAL BY ROW: one range per region partition, each homed in its region.
#[test]
fn regional_by_row_tables_get_one_range_per_region_homed_there() {
    let nodes = layout(3, 3);
    let d = db(3, SurvivalGoal::Zone, Placement::Default);
    let rbr = TableLocality::RegionalByRow {
        column: "crdb_region".into(),
    };
    let ranges = table_ranges(Some(&d), Some(&rbr)).unwrap();
    let homes: Vec<(Option<String>, Vec<u64>, u64)> = ranges
        .iter()
        .map(|(p, zc)| {
            let a = allocate(zc, &nodes, &[]);
            (
                p.clone(),
                ids(&a.replicas, ReplicaKind::Voter),
                a.lease_order[0],
            )
        })
        .collect();
    assert_eq!(
        homes,
        vec![
            (Some("europe-west1".into()), vec![7, 8, 9], 7),
            (Some("us-east1".into()), vec![1, 2, 3], 1),
            (Some("us-west1".into()), vec![4, 5, 6], 4),
        ]
    );
}

/// REGION survival: five voters, two at home, the others spread so that no region holds a
/// majority; losing any one region leaves a quorum.
#[test]
fn region_survival_spreads_five_voters_so_no_region_holds_a_quorum() {
    let nodes = layout(3, 3);
    let d = db(3, SurvivalGoal::Region, Placement::Default);
    let zc = &table_ranges(Some(&d), None).unwrap()[0].1;
    let a = allocate(zc, &nodes, &[]);
    let voters = ids(&a.replicas, ReplicaKind::Voter);
    assert_eq!(voters.len(), 5);
    for region in &REGIONS[..3] {
        let here = voters
            .iter()
            .filter(|v| nodes[**v as usize - 1].region == *region)
            .count();
        assert!(here < 3, "{region} holds {here} of 5 voters: {voters:?}");
    }
    assert_eq!(
        nodes[a.lease_order[0] as usize - 1].region,
        "us-east1",
        "lease at home"
    );
}

/// A database without regions: CockroachDB's default, three voters anywhere, spread.
#[test]
fn tables_of_databases_without_regions_get_three_voters_spread_over_regions() {
    let nodes = layout(3, 3);
    let zc = &table_ranges(None, None).unwrap()[0].1;
    assert_eq!(zc, &cluster_default());
    let a = allocate(zc, &nodes, &[]);
    assert_eq!(ids(&a.replicas, ReplicaKind::Voter), vec![1, 4, 7]);
    assert!(ids(&a.replicas, ReplicaKind::NonVoter).is_empty());
}

/// Too few nodes: under-replicated, never doubled up, and the shortfall is reported.
#[test]
fn a_small_cluster_under_replicates_and_says_by_how_much() {
    let nodes = layout(3, 1);
    let d = db(3, SurvivalGoal::Zone, Placement::Default);
    let zc = &table_ranges(Some(&d), None).unwrap()[0].1;
    let a = allocate(zc, &nodes, &[]);
    assert_eq!(ids(&a.replicas, ReplicaKind::Voter), vec![1]);
    assert_eq!(ids(&a.replicas, ReplicaKind::NonVoter), vec![2, 3]);
    assert_eq!((a.missing_voters, a.missing_replicas), (2, 2));
}

/// A node that leaves is replaced by one node of the same region; every other replica stays.
#[test]
fn losing_a_node_moves_only_its_replica() {
    let nodes = layout(3, 4);
    let d = db(3, SurvivalGoal::Zone, Placement::Default);
    let zc = &table_ranges(Some(&d), None).unwrap()[0].1;
    let before = allocate(zc, &nodes, &[]);
    let gone = before.replicas[1].node_id;
    let fewer: Vec<Candidate> = nodes
        .iter()
        .filter(|c| c.node_id != gone)
        .cloned()
        .collect();
    let after = allocate(zc, &fewer, &before.replicas);
    let b: BTreeSet<u64> = before.replicas.iter().map(|r| r.node_id).collect();
    let a: BTreeSet<u64> = after.replicas.iter().map(|r| r.node_id).collect();
    assert_eq!(b.difference(&a).copied().collect::<Vec<_>>(), vec![gone]);
    assert_eq!(a.difference(&b).count(), 1);
    let new = *a.difference(&b).next().unwrap();
    assert_eq!(
        nodes[new as usize - 1].region,
        nodes[gone as usize - 1].region
    );
}

/// Every survival goal × placement × locality × 3–5 regions × 1–4 nodes per region: no node
/// twice, voter and replica counts as configured or short by what the cluster lacks, voter
/// constraints met, every required region covered, RESTRICTED regional tables at home,
/// the lease preferring home, and re-deriving from the result changes nothing.
#[test]
fn every_configuration_is_placed_within_its_constraints_and_is_stable() {
    let localities = [
        TableLocality::Global,
        TableLocality::RegionalByTable { region: None },
        TableLocality::RegionalByTable {
            region: Some("us-west1".into()),
        },
        TableLocality::RegionalByRow {
            column: "crdb_region".into(),
        },
    ];
    let mut checked = 0;
    for n in 3..=5 {
        for per in 1..=4 {
            let nodes = layout(n, per);
            let region_of = |id: u64| nodes[id as usize - 1].region.clone();
            for (survival, placement) in [
                (SurvivalGoal::Zone, Placement::Default),
                (SurvivalGoal::Zone, Placement::Restricted),
                (SurvivalGoal::Region, Placement::Default),
            ] {
                let d = db(n, survival, placement);
                for l in &localities {
                    for (part, zc) in table_ranges(Some(&d), Some(l)).unwrap() {
                        let a = allocate(&zc, &nodes, &[]);
                        let what = format!(
                            "{n} regions × {per}, {survival:?} {placement:?} {l:?} {part:?}"
                        );
                        let all: BTreeSet<u64> = a.replicas.iter().map(|r| r.node_id).collect();
                        assert_eq!(all.len(), a.replicas.len(), "a node twice: {what}");
                        let voters = ids(&a.replicas, ReplicaKind::Voter);
                        assert_eq!(
                            voters.len() as u32 + a.missing_voters,
                            zc.num_voters,
                            "{what}"
                        );
                        assert_eq!(
                            a.replicas.len() as u32 + a.missing_replicas,
                            zc.num_replicas,
                            "{what}"
                        );
                        match &zc.voter_constraints {
                            mr_zoneconfig::Constraints::All(rs) => {
                                assert!(
                                    voters.iter().all(|v| rs.contains(&region_of(*v))),
                                    "{what}"
                                )
                            }
                            mr_zoneconfig::Constraints::PerRegion(m) => {
                                for (r, min) in m {
                                    let have =
                                        voters.iter().filter(|v| region_of(**v) == *r).count();
                                    assert!(have as u32 >= (*min).min(per as u32), "{what}: {r}");
                                }
                            }
                        }
                        if let mr_zoneconfig::Constraints::PerRegion(m) = &zc.constraints {
                            for r in m.keys() {
                                assert!(
                                    all.iter().any(|id| region_of(*id) == *r),
                                    "{what}: no replica in {r}"
                                );
                            }
                        }
                        if let mr_zoneconfig::Constraints::All(rs) = &zc.constraints {
                            assert!(all.iter().all(|id| rs.contains(&region_of(*id))), "{what}");
                        }
                        assert_eq!(region_of(a.lease_order[0]), zc.home_region, "{what}");
                        let again = allocate(&zc, &nodes, &a.replicas);
                        assert!(
                            same_replicas(&again.replicas, &a.replicas),
                            "{what}: unstable"
                        );
                        assert_eq!(again.lease_order, a.lease_order, "{what}");
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 200, "{checked}");
}
