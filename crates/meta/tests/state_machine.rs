//! Properties of the metadata state machine that replication relies on.

use mr_meta::snapshot;
use mr_meta::*;
use std::collections::BTreeSet;

const T0: u64 = 1_700_000_000_000;

fn client(node_id: u64) -> ClientId {
    ClientId {
        node_id,
        incarnation: 7,
    }
}

fn add_node(seq: u64, port: u16) -> Proposal {
    Proposal {
        client: client(1),
        seq,
        command: Command::AddNode {
            rpc_addr: format!("127.0.0.1:{port}"),
            sql_addr: format!("127.0.0.1:{}", port + 1000),
            locality: "region=us-west1,zone=us-west1-a".into(),
            at_ms: T0 + seq,
        },
    }
}

fn table() -> TableRef {
    TableRef {
        database: "movr".into(),
        schema: "public".into(),
        table: "users".into(),
    }
}

fn movr() -> DatabaseConfig {
    DatabaseConfig {
        database: "movr".into(),
        primary_region: "us-east1".into(),
        regions: BTreeSet::from(["us-east1".into(), "us-west1".into(), "europe-west1".into()]),
        survival: SurvivalGoal::Zone,
        placement: Placement::Default,
        secondary_region: None,
    }
}

fn range(replicas: &[(u64, ReplicaKind)]) -> RangeDescriptor {
    RangeDescriptor {
        range_id: 10,
        table: table(),
        partition: Some("us-east1".into()),
        replicas: replicas
            .iter()
            .map(|(n, k)| Replica {
                node_id: *n,
                kind: *k,
            })
            .collect(),
        generation: 0,
    }
}

fn cluster() -> MetaState {
    let mut s = MetaState::bootstrap("127.0.0.1:1", "127.0.0.1:2", "region=us-east1", T0);
    s.apply(&add_node(1, 3));
    s.apply(&add_node(2, 4));
    s
}

fn propose(s: &mut MetaState, seq: u64, command: Command) -> Outcome {
    s.apply(&Proposal {
        client: client(9),
        seq,
        command,
    })
}

/// A proposal committed twice (a client retried after a leader change, and both copies made
/// it into the log) takes effect once, and both applications answer the same.
#[test]
fn a_retried_proposal_applies_exactly_once() {
    let mut s = MetaState::bootstrap("127.0.0.1:1", "127.0.0.1:2", "region=us-east1", T0);
    let first = s.apply(&add_node(1, 3));
    let again = s.apply(&add_node(1, 3));
    assert_eq!(first, Outcome::NodeAdded { node_id: 2 });
    assert_eq!(again, first);
    assert_eq!(
        s.apply(&add_node(2, 4)),
        Outcome::NodeAdded { node_id: 3 },
        "no id was burnt"
    );
    assert_eq!(s.nodes().count(), 3);
}

/// An older proposal arriving after a newer one from the same client is refused, not applied.
#[test]
fn a_proposal_older_than_the_clients_last_is_refused() {
    let mut s = cluster(); // client 1 has applied its proposals 1 and 2
    assert_eq!(s.apply(&add_node(3, 5)), Outcome::NodeAdded { node_id: 4 });
    let nodes = s.nodes().count();
    let out = s.apply(&add_node(2, 9));
    assert_eq!(
        out,
        Outcome::Rejected {
            error: MetaError::Superseded { seq: 2, last: 3 }
        }
    );
    assert_eq!(s.nodes().count(), nodes, "the stale proposal added nothing");
    assert_eq!(
        s.apply(&add_node(3, 5)),
        Outcome::NodeAdded { node_id: 4 },
        "3 is still remembered"
    );
}

/// Replicas that apply the same log end in the same state: apply reads no clock.
#[test]
fn applying_the_same_log_gives_the_same_state() {
    let log = vec![
        add_node(1, 3),
        Proposal {
            client: client(2),
            seq: 1,
            command: Command::PutDatabase { config: movr() },
        },
        Proposal {
            client: client(2),
            seq: 2,
            command: Command::PutTableLocality {
                table: table(),
                locality: TableLocality::RegionalByRow {
                    column: "crdb_region".into(),
                },
            },
        },
    ];
    let run = || {
        let mut s = MetaState::bootstrap("a:1", "a:2", "region=us-east1", T0);
        for p in &log {
            s.apply(p);
        }
        s
    };
    assert_eq!(run(), run());
    assert_eq!(snapshot::encode(&run()), snapshot::encode(&run()));
}

/// A refused command leaves the metadata as it was and names the reason.
#[test]
fn a_refused_command_changes_nothing_and_says_why() {
    let mut s = cluster();
    let before = s.clone();
    let mut bad = movr();
    bad.primary_region = "asia-east1".into();
    let out = propose(&mut s, 1, Command::PutDatabase { config: bad });
    let error = MetaError::PrimaryNotInRegions {
        region: "asia-east1".into(),
    };
    assert_eq!(out, Outcome::Rejected { error });
    let locality = TableLocality::Global;
    let out = propose(
        &mut s,
        2,
        Command::PutTableLocality {
            table: table(),
            locality,
        },
    );
    let error = MetaError::NoSuchDatabase {
        database: "movr".into(),
    };
    assert_eq!(out, Outcome::Rejected { error });
    assert_eq!(s.database("movr"), None);
    assert_eq!(s.table_locality(&table()), None);
    assert!(s.nodes().eq(before.nodes()));
}

/// Two replica changes prepared against the same descriptor: the first wins, the second is
/// refused with the generation it missed.
#[test]
fn range_descriptors_change_by_compare_and_set() {
    let mut s = cluster();
    use ReplicaKind::*;
    let out = propose(
        &mut s,
        1,
        Command::PutRange {
            range: range(&[(1, Voter)]),
            expected_generation: None,
        },
    );
    assert_eq!(out, Outcome::Done);
    assert_eq!(s.range(10).unwrap().generation, 1);
    let a = range(&[(1, Voter), (2, Voter), (3, NonVoter)]);
    let b = range(&[(1, Voter), (3, Voter)]);
    assert_eq!(
        propose(
            &mut s,
            2,
            Command::PutRange {
                range: a,
                expected_generation: Some(1)
            }
        ),
        Outcome::Done
    );
    let out = propose(
        &mut s,
        3,
        Command::PutRange {
            range: b,
            expected_generation: Some(1),
        },
    );
    assert_eq!(
        out,
        Outcome::Rejected {
            error: MetaError::RangeChanged {
                range_id: 10,
                current: Some(2),
                expected: Some(1)
            }
        }
    );
    assert_eq!(s.range(10).unwrap().replicas.len(), 3);
    let ghost = range(&[(42, Voter)]);
    let out = propose(
        &mut s,
        4,
        Command::PutRange {
            range: ghost,
            expected_generation: Some(2),
        },
    );
    assert!(matches!(
        out,
        Outcome::Rejected {
            error: MetaError::NoSuchNode { node_id: 42 }
        }
    ));
}

/// Leases: only voters may hold one; two nodes racing from the same observed lease cannot both
/// win; an extension keeps the sequence and a transfer bumps it.
#[test]
fn leases_are_taken_by_compare_and_set_on_their_sequence() {
    use ReplicaKind::*;
    let mut s = cluster();
    propose(
        &mut s,
        1,
        Command::PutRange {
            range: range(&[(1, Voter), (2, Voter), (3, NonVoter)]),
            expected_generation: None,
        },
    );
    let take = |holder, start_ms, expected_sequence| Command::AcquireLease {
        range_id: 10,
        holder,
        start_ms,
        expiration_ms: start_ms + 9_000,
        expected_sequence,
    };
    let out = propose(&mut s, 2, take(3, T0, None));
    assert_eq!(
        out,
        Outcome::Rejected {
            error: MetaError::NotAVoter {
                range_id: 10,
                holder: 3
            }
        }
    );
    let Outcome::Lease { lease } = propose(&mut s, 3, take(1, T0, None)) else {
        panic!()
    };
    assert_eq!((lease.holder, lease.sequence), (1, 1));
    let out = propose(&mut s, 4, take(2, T0, None));
    assert!(matches!(
        out,
        Outcome::Rejected {
            error: MetaError::LeaseChanged {
                current: Some(1),
                ..
            }
        }
    ));
    let Outcome::Lease { lease } = propose(&mut s, 5, take(1, T0 + 5_000, Some(1))) else {
        panic!()
    };
    assert_eq!(lease.sequence, 1, "an extension keeps the sequence");
    let Outcome::Lease { lease } = propose(&mut s, 6, take(2, T0 + 20_000, Some(1))) else {
        panic!()
    };
    assert_eq!(
        (lease.holder, lease.sequence),
        (2, 2),
        "a transfer bumps it"
    );
}

#[test]
fn liveness_follows_documented_thresholds_and_decommission_is_final() {
    let mut s = cluster();
    let n2 = s.node(2).unwrap().clone();
    let at = n2.last_heartbeat_ms;
    assert_eq!(n2.status(at + SUSPECT_AFTER_MS - 1), NodeStatus::Live);
    assert_eq!(n2.status(at + SUSPECT_AFTER_MS), NodeStatus::Suspect);
    assert_eq!(n2.status(at + DEAD_AFTER_MS), NodeStatus::Dead);
    let beat = |at_ms| Command::Heartbeat {
        node_id: 2,
        rpc_addr: "127.0.0.1:77".into(),
        sql_addr: "x:1".into(),
        at_ms,
    };
    assert_eq!(propose(&mut s, 1, beat(at + DEAD_AFTER_MS)), Outcome::Done);
    assert_eq!(
        s.node(2).unwrap().status(at + DEAD_AFTER_MS),
        NodeStatus::Live,
        "a heartbeat revives"
    );
    assert_eq!(
        s.node(2).unwrap().rpc_addr,
        "127.0.0.1:77",
        "and records a new address"
    );
    propose(&mut s, 2, beat(at));
    assert_eq!(
        s.node(2).unwrap().last_heartbeat_ms,
        at + DEAD_AFTER_MS,
        "heartbeats never go back"
    );
    propose(&mut s, 3, Command::Decommission { node_id: 2 });
    assert_eq!(s.node(2).unwrap().status(at), NodeStatus::Decommissioned);
    let out = propose(&mut s, 4, beat(at + DEAD_AFTER_MS + 1));
    assert_eq!(
        out,
        Outcome::Rejected {
            error: MetaError::Decommissioned { node_id: 2 }
        }
    );
}

/// A snapshot written by format 1 (the file in tests/fixtures, never regenerated) still
/// decodes: a later release can read an older snapshot. Newer formats are refused.
#[test]
fn format_1_snapshots_stay_readable_and_newer_ones_are_refused() {
    let golden = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/snapshot-v1.json"
    ))
    .expect("the golden snapshot is committed");
    let s = snapshot::decode(&golden).expect("format 1 decodes");
    assert_eq!(s.nodes().count(), 3);
    assert_eq!(s.database("movr").unwrap().primary_region, "us-east1");
    assert_eq!(
        s.table_locality(&table()),
        Some(&TableLocality::RegionalByRow {
            column: "crdb_region".into()
        })
    );
    assert_eq!(s.lease(10).unwrap().holder, 1);
    assert_eq!(
        snapshot::decode(&snapshot::encode(&s)).unwrap(),
        s,
        "round trip"
    );
    assert_eq!(s.events().count(), 0, "format 1 had no event log");
    let err = snapshot::decode(br#"{"format": 3, "state": {}}"#).unwrap_err();
    assert!(err.to_string().contains("format 3 is newer"), "{err}");
    assert!(snapshot::decode(b"{").is_err());
}

/// Format 2 (settings and the event log) reads back from its golden file too.
#[test]
fn format_2_snapshots_stay_readable() {
    let golden = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/snapshot-v2.json"
    ))
    .expect("the golden snapshot is committed");
    let s = snapshot::decode(&golden).expect("format 2 decodes");
    assert_eq!(s.cluster_setting("sql.defaults.demo"), Some("on"));
    let seqs: Vec<(u64, u64)> = s.events().map(|e| (e.client.node_id, e.seq)).collect();
    assert_eq!(
        seqs,
        vec![(1, 1), (1, 2), (9, 1), (9, 2), (9, 3), (9, 4), (9, 5)],
        "events in apply order"
    );
}

/// Applied commands are in the event log once each, in order; heartbeats, refusals and
/// retried duplicates are not.
#[test]
fn the_event_log_records_each_effect_once_in_order() {
    let mut s = cluster();
    let before = s.events().count();
    let set = |v: &str| Command::SetClusterSetting {
        name: "x".into(),
        value: Some(v.into()),
    };
    propose(&mut s, 1, set("a"));
    propose(&mut s, 1, set("a"));
    propose(
        &mut s,
        2,
        Command::DropDatabase {
            database: "nope".into(),
        },
    );
    propose(
        &mut s,
        3,
        Command::Heartbeat {
            node_id: 1,
            rpc_addr: "127.0.0.1:1".into(),
            sql_addr: "127.0.0.1:2".into(),
            at_ms: T0 + 50,
        },
    );
    propose(&mut s, 4, set("b"));
    let new: Vec<(u64, Command)> = s
        .events()
        .skip(before)
        .map(|e| (e.seq, e.command.clone()))
        .collect();
    assert_eq!(new, vec![(1, set("a")), (4, set("b"))]);
    let ids: Vec<u64> = s.events().map(|e| e.id).collect();
    assert!(ids.windows(2).all(|w| w[1] == w[0] + 1), "{ids:?}");
    assert_eq!(s.cluster_setting("x"), Some("b"));
    for i in 0..(EVENT_LOG_LEN as u64 + 10) {
        propose(&mut s, 5 + i, set(&i.to_string()));
    }
    assert_eq!(s.events().count(), EVENT_LOG_LEN, "bounded");
}

/// Writes the golden snapshots, once per format, by hand when the format was defined (the
/// format 1 file predates this test writing format 2, and is never regenerated):
/// `MR_META_WRITE_GOLDEN=1 cargo test -p mr-meta --test state_machine write_golden`.
#[test]
fn write_golden() {
    if std::env::var_os("MR_META_WRITE_GOLDEN").is_none() {
        return;
    }
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/snapshot-v2.json"
    );
    use ReplicaKind::*;
    let mut s = cluster();
    propose(&mut s, 1, Command::PutDatabase { config: movr() });
    propose(
        &mut s,
        2,
        Command::PutTableLocality {
            table: table(),
            locality: TableLocality::RegionalByRow {
                column: "crdb_region".into(),
            },
        },
    );
    propose(
        &mut s,
        3,
        Command::PutRange {
            range: range(&[(1, Voter), (2, Voter), (3, NonVoter)]),
            expected_generation: None,
        },
    );
    propose(
        &mut s,
        4,
        Command::AcquireLease {
            range_id: 10,
            holder: 1,
            start_ms: T0,
            expiration_ms: T0 + 9_000,
            expected_sequence: None,
        },
    );
    propose(
        &mut s,
        5,
        Command::SetClusterSetting {
            name: "sql.defaults.demo".into(),
            value: Some("on".into()),
        },
    );
    let v: serde_json::Value = serde_json::from_slice(&snapshot::encode(&s)).unwrap();
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap() + "\n").unwrap();
}
