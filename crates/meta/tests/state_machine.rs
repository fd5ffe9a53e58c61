//! Properties of the metadata state machine that replication relies on.

use mr_meta::sequence::{SequenceChange, SequenceParams, SequenceValue};
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
        bootstrapped_by: None,
        seed: None,
        merge: vec![],
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
        at,
        "the latest beat's time (the meta leader's) replaces the last: a leader whose clock \
         ran ahead does not leave its times behind"
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
    let err = snapshot::decode(br#"{"format": 10, "state": {}}"#).unwrap_err();
    assert!(err.to_string().contains("format 10 is newer"), "{err}");
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
    assert_eq!(s.schemas().count(), 0, "format 2 had no schema logs");
}

/// Format 3 (schema logs) reads back from its golden file.
#[test]
fn format_3_snapshots_stay_readable() {
    let golden = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/snapshot-v3.json"
    ))
    .expect("the golden snapshot is committed");
    let s = snapshot::decode(&golden).expect("format 3 decodes");
    assert_eq!(s.cluster_setting("sql.defaults.demo"), Some("on"));
    let log = s.schema("movr").expect("movr has a schema log");
    assert_eq!(log.version, 2);
    let changes: Vec<(u64, &str)> = log
        .changes
        .iter()
        .map(|c| (c.version, c.change.as_str()))
        .collect();
    assert_eq!(
        changes,
        vec![
            (1, r#"{"op":"add_region"}"#),
            (2, r#"{"op":"set_locality"}"#)
        ]
    );
    assert_eq!(log.applied_by(1), 2);
    assert_eq!(log.applied_by(2), 1);
    assert_eq!(log.applied_by(3), 0);
    assert_eq!(s.table_locality(&table()), Some(&TableLocality::Global));
    assert_eq!(
        snapshot::decode(&snapshot::encode(&s)).unwrap(),
        s,
        "round trip"
    );
}

fn schema_change(
    expected_version: u64,
    change: &str,
    config: Option<DatabaseConfig>,
    localities: Vec<(TableRef, Option<TableLocality>)>,
) -> Command {
    Command::SchemaChange {
        database: "movr".into(),
        expected_version,
        change: change.into(),
        config,
        localities,
        at_ms: T0 + 100 + expected_version,
        tables: None,
        fenced: vec![],
        key_seeds: vec![],
        sequences: vec![],
        zones: vec![],
    }
}

fn applied(node_id: u64, version: u64) -> Command {
    Command::SchemaApplied {
        node_id,
        database: "movr".into(),
        version,
    }
}

/// Schema changes are compare-and-set on the database's version: versions go 1, 2, 3, …,
/// and a change prepared against an older version is refused with both versions named,
/// changing nothing.
#[test]
fn schema_changes_are_compare_and_set_on_the_version() {
    let mut s = cluster();
    assert_eq!(s.schema("movr"), None, "never changed");
    let out = propose(&mut s, 1, schema_change(0, "a", Some(movr()), vec![]));
    assert_eq!(out, Outcome::SchemaVersion { version: 1 });
    let out = propose(&mut s, 2, schema_change(1, "b", Some(movr()), vec![]));
    assert_eq!(out, Outcome::SchemaVersion { version: 2 });
    let before = s.clone();
    // A second session raced from version 1 and loses.
    let out = propose(&mut s, 3, schema_change(1, "c", Some(movr()), vec![]));
    let error = MetaError::SchemaVersionMismatch {
        database: "movr".into(),
        expected: 1,
        current: 2,
    };
    assert_eq!(
        error.to_string(),
        r#"concurrent schema change on database "movr": expected version 1, found 2"#
    );
    assert_eq!(out, Outcome::Rejected { error });
    assert_eq!(s.schema("movr"), before.schema("movr"), "nothing changed");
    assert_eq!(
        s.events().count(),
        before.events().count(),
        "a refusal is not an event"
    );
    let out = propose(&mut s, 4, schema_change(2, "c", Some(movr()), vec![]));
    assert_eq!(out, Outcome::SchemaVersion { version: 3 });
    let log = s.schema("movr").unwrap();
    assert_eq!(log.version, 3);
    let seen: Vec<(u64, u64, &str)> = log
        .changes
        .iter()
        .map(|c| (c.version, c.at_ms, c.change.as_str()))
        .collect();
    assert_eq!(
        seen,
        vec![(1, T0 + 100, "a"), (2, T0 + 101, "b"), (3, T0 + 102, "c")]
    );
    let after: Vec<u64> = log.changes_after(1).iter().map(|c| c.version).collect();
    assert_eq!(after, vec![2, 3]);
    assert!(log.changes_after(3).is_empty());
    assert!(log.changes_after(99).is_empty());
    // Other databases have their own versions.
    let other = Command::SchemaChange {
        database: "bank".into(),
        expected_version: 0,
        change: "x".into(),
        config: None,
        localities: vec![],
        at_ms: T0,
        tables: None,
        fenced: vec![],
        key_seeds: vec![],
        sequences: vec![],
        zones: vec![],
    };
    assert_eq!(
        propose(&mut s, 5, other),
        Outcome::SchemaVersion { version: 1 }
    );
    let names: Vec<&str> = s.schemas().map(|(d, _)| d).collect();
    assert_eq!(names, vec!["bank", "movr"]);
}

/// A schema change replaces the database's configuration and puts or removes the listed
/// table localities; `None` for the configuration drops it and every locality of the
/// database, like `DropDatabase`.
#[test]
fn schema_changes_replace_config_and_localities() {
    let mut s = cluster();
    let users = table();
    let rides = TableRef {
        table: "rides".into(),
        ..table()
    };
    let rbr = TableLocality::RegionalByRow {
        column: "crdb_region".into(),
    };
    let out = propose(
        &mut s,
        1,
        schema_change(
            0,
            "a",
            Some(movr()),
            vec![
                (users.clone(), Some(rbr.clone())),
                (rides.clone(), Some(TableLocality::Global)),
            ],
        ),
    );
    assert_eq!(out, Outcome::SchemaVersion { version: 1 });
    assert_eq!(s.database("movr"), Some(&movr()));
    assert_eq!(s.table_locality(&users), Some(&rbr));
    assert_eq!(s.table_locality(&rides), Some(&TableLocality::Global));

    let mut two = movr();
    two.regions.remove("europe-west1");
    two.survival = SurvivalGoal::Zone;
    let out = propose(
        &mut s,
        2,
        schema_change(1, "b", Some(two.clone()), vec![(rides.clone(), None)]),
    );
    assert_eq!(out, Outcome::SchemaVersion { version: 2 });
    assert_eq!(s.database("movr"), Some(&two), "replaced");
    assert_eq!(s.table_locality(&users), Some(&rbr), "unlisted: kept");
    assert_eq!(s.table_locality(&rides), None, "removed");

    let out = propose(&mut s, 3, schema_change(2, "drop", None, vec![]));
    assert_eq!(out, Outcome::SchemaVersion { version: 3 });
    assert_eq!(s.database("movr"), None);
    assert_eq!(s.table_locality(&users), None, "gone with the database");
    assert_eq!(s.schema("movr").unwrap().version, 3, "the log stays");

    // Refusals change nothing, not even the version.
    let mut bad = movr();
    bad.primary_region = "asia-east1".into();
    let out = propose(&mut s, 4, schema_change(3, "x", Some(bad), vec![]));
    assert!(matches!(
        out,
        Outcome::Rejected {
            error: MetaError::PrimaryNotInRegions { .. }
        }
    ));
    let out = propose(
        &mut s,
        5,
        schema_change(3, "x", None, vec![(users.clone(), Some(rbr.clone()))]),
    );
    assert!(matches!(
        out,
        Outcome::Rejected {
            error: MetaError::NoSuchDatabase { .. }
        }
    ));
    let elsewhere = TableRef {
        database: "bank".into(),
        ..table()
    };
    let out = propose(
        &mut s,
        6,
        schema_change(3, "x", Some(movr()), vec![(elsewhere, Some(rbr))]),
    );
    assert!(matches!(
        out,
        Outcome::Rejected {
            error: MetaError::SchemaWrongDatabase { .. }
        }
    ));
    assert_eq!(s.schema("movr").unwrap().version, 3);
    assert_eq!(s.database("movr"), None);
}

/// Each node's applied version only rises; reports of versions that do not exist are
/// refused; and reports are not events.
#[test]
fn schema_applied_keeps_each_nodes_highest_version() {
    let mut s = cluster();
    for v in 0..3 {
        propose(&mut s, v + 1, schema_change(v, "c", Some(movr()), vec![]));
    }
    let events = s.events().count();
    assert_eq!(propose(&mut s, 10, applied(2, 2)), Outcome::Done);
    assert_eq!(propose(&mut s, 11, applied(2, 1)), Outcome::Done);
    assert_eq!(
        s.schema("movr").unwrap().applied_by(2),
        2,
        "never goes back"
    );
    assert_eq!(propose(&mut s, 12, applied(2, 3)), Outcome::Done);
    assert_eq!(propose(&mut s, 13, applied(3, 1)), Outcome::Done);
    let log = s.schema("movr").unwrap();
    assert_eq!(log.applied_by(2), 3);
    assert_eq!(log.applied_by(3), 1);
    assert_eq!(log.applied_by(1), 0, "never reported");
    assert_eq!(
        propose(&mut s, 14, applied(3, 4)),
        Outcome::Rejected {
            error: MetaError::NoSuchSchemaVersion {
                database: "movr".into(),
                version: 4,
                current: 3
            }
        }
    );
    let out = propose(
        &mut s,
        15,
        Command::SchemaApplied {
            node_id: 1,
            database: "bank".into(),
            version: 1,
        },
    );
    assert!(matches!(
        out,
        Outcome::Rejected {
            error: MetaError::NoSuchSchemaVersion { current: 0, .. }
        }
    ));
    assert_eq!(s.schema("movr").unwrap().applied_by(3), 1);
    assert_eq!(s.events().count(), events, "reports are not logged");
}

/// A schema change committed twice (its proposer retried across a leader change) takes
/// effect once and answers the same version both times, rather than a mismatch.
#[test]
fn a_retried_schema_change_applies_once() {
    let mut s = cluster();
    let c = schema_change(0, "a", Some(movr()), vec![]);
    let first = propose(&mut s, 1, c.clone());
    let again = propose(&mut s, 1, c.clone());
    assert_eq!(first, Outcome::SchemaVersion { version: 1 });
    assert_eq!(again, first);
    assert_eq!(s.schema("movr").unwrap().version, 1);
    assert_eq!(s.schema("movr").unwrap().changes.len(), 1);
    // The same command under a new sequence number is a new proposal, and loses the race.
    assert!(matches!(
        propose(&mut s, 2, c),
        Outcome::Rejected {
            error: MetaError::SchemaVersionMismatch { current: 1, .. }
        }
    ));
    assert_eq!(
        propose(&mut s, 3, applied(2, 1)),
        propose(&mut s, 3, applied(2, 1))
    );
}

/// Schema logs survive a snapshot round trip in the current format.
#[test]
fn schema_logs_round_trip_through_snapshots() {
    let mut s = cluster();
    propose(&mut s, 1, schema_change(0, "a", Some(movr()), vec![]));
    propose(&mut s, 2, schema_change(1, "b\n\"quoted\"", None, vec![]));
    propose(&mut s, 3, applied(3, 2));
    let bytes = snapshot::encode(&s);
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["format"], snapshot::FORMAT);
    assert_eq!(snapshot::FORMAT, 9);
    let back = snapshot::decode(&bytes).unwrap();
    assert_eq!(back, s);
    assert_eq!(back.schema("movr").unwrap().applied_by(3), 2);
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

/// Writes the golden snapshot of the current format, by hand when the format was defined;
/// older formats' files (v1 to v4) are never regenerated:
/// `MR_META_WRITE_GOLDEN=1 cargo test -p mr-meta --test state_machine write_golden`.
#[test]
fn write_golden() {
    if std::env::var_os("MR_META_WRITE_GOLDEN").is_none() {
        return;
    }
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/snapshot-v5.json"
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
    propose(
        &mut s,
        6,
        schema_change(0, r#"{"op":"add_region"}"#, Some(movr()), vec![]),
    );
    propose(
        &mut s,
        7,
        schema_change(
            1,
            r#"{"op":"set_locality"}"#,
            Some(movr()),
            vec![(table(), Some(TableLocality::Global))],
        ),
    );
    propose(&mut s, 8, applied(1, 2));
    propose(&mut s, 9, applied(2, 1));
    let mut with_tables = schema_change(2, r#"{"op":"create_table"}"#, Some(movr()), vec![]);
    if let Command::SchemaChange { tables, .. } = &mut with_tables {
        *tables = Some(vec![table()]);
    }
    propose(&mut s, 10, with_tables);
    propose(
        &mut s,
        11,
        Command::CreateRange {
            table: table(),
            partition: Some("us-west1".into()),
            replicas: vec![replica(2, Voter)],
            seed: None,
            merge: vec![],
        },
    );
    propose(
        &mut s,
        12,
        Command::ForgetDatabase {
            database: "bank".into(),
            node_id: 2,
        },
    );
    let v: serde_json::Value = serde_json::from_slice(&snapshot::encode(&s)).unwrap();
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap() + "\n").unwrap();
}

fn replica(node_id: u64, kind: ReplicaKind) -> Replica {
    Replica { node_id, kind }
}

/// Format 4 (table sets, range ids) reads back from its golden file.
#[test]
fn format_4_snapshots_stay_readable() {
    let golden = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/snapshot-v4.json"
    ))
    .expect("the golden snapshot is committed");
    let s = snapshot::decode(&golden).expect("format 4 decodes");
    let tables: Vec<_> = s.catalog().collect();
    assert_eq!(tables.len(), 1);
    assert!(tables[0].1.contains(&table()));
    let created = s
        .ranges()
        .find(|r| r.partition.as_deref() == Some("us-west1"))
        .expect("the created range");
    assert_eq!(created.range_id, 11, "past the range put with id 10");
    assert_eq!(
        snapshot::decode(&snapshot::encode(&s)).unwrap(),
        s,
        "round trip"
    );
}

/// Creating a range allocates the next id; creating it again (two allocators racing)
/// returns the existing range instead of a second one; dropping it removes its lease.
#[test]
fn ranges_are_created_once_per_table_partition_and_dropped_with_their_lease() {
    use ReplicaKind::*;
    let mut s = cluster();
    let create = |partition: &str, node: u64| Command::CreateRange {
        table: table(),
        partition: Some(partition.into()),
        replicas: vec![replica(node, Voter)],
        seed: None,
        merge: vec![],
    };
    let first = propose(&mut s, 1, create("us-east1", 1));
    let Outcome::Range { range } = first else {
        panic!("{first:?}")
    };
    assert_eq!((range.range_id, range.generation), (1, 1));
    let again = propose(&mut s, 2, create("us-east1", 2));
    assert_eq!(
        again,
        Outcome::Range {
            range: range.clone()
        },
        "the same range"
    );
    let Outcome::Range { range: other } = propose(&mut s, 3, create("us-west1", 2)) else {
        panic!()
    };
    assert_eq!(other.range_id, 2);
    let lease = Command::AcquireLease {
        range_id: 1,
        holder: 1,
        start_ms: T0,
        expiration_ms: T0 + 9_000,
        expected_sequence: None,
    };
    assert!(matches!(propose(&mut s, 4, lease), Outcome::Lease { .. }));
    let drop = |range_id, sealed_by, at_ms| Command::DropRange {
        range_id,
        sealed_by,
        at_ms,
    };
    assert_eq!(propose(&mut s, 5, drop(1, Some(1), T0)), Outcome::Done);
    assert_eq!(s.range(1), None);
    assert_eq!(s.lease(1), None);
    assert_eq!(s.ranges().count(), 1);
    assert_eq!(
        s.dropped_range(1),
        Some(&mr_meta::DroppedRange {
            sealed_by: Some(1),
            at_ms: T0
        }),
        "the dropped range names who answers for its decisions"
    );
    let out = propose(&mut s, 6, drop(1, None, T0));
    assert_eq!(
        out,
        Outcome::Rejected {
            error: MetaError::NoSuchRange { range_id: 1 }
        }
    );
    let Outcome::Range { range: third } = propose(&mut s, 7, create("us-east1", 1)) else {
        panic!()
    };
    assert_eq!(third.range_id, 3, "ids are never reused");
    // A week later, dropping another range forgets the first.
    let later = T0 + mr_meta::DROPPED_RANGE_KEEP_MS;
    assert_eq!(propose(&mut s, 8, drop(3, None, later)), Outcome::Done);
    assert_eq!(s.dropped_range(1), None, "kept a week, not forever");
    assert_eq!(s.dropped_range(3).map(|d| d.sealed_by), Some(None));
}

/// A schema change that names the database's tables replaces its table set; one that does
/// not leaves it alone.
#[test]
fn schema_changes_carry_the_table_set() {
    let mut s = cluster();
    let with = |v: u64, tables: Option<Vec<TableRef>>| {
        let mut c = schema_change(v, "x", Some(movr()), vec![]);
        if let Command::SchemaChange { tables: t, .. } = &mut c {
            *t = tables;
        }
        c
    };
    propose(&mut s, 1, with(0, Some(vec![table()])));
    propose(&mut s, 2, with(1, None));
    let set: Vec<_> = s.catalog().flat_map(|(_, t)| t.iter().cloned()).collect();
    assert_eq!(set, vec![table()]);
    propose(&mut s, 3, with(2, Some(vec![])));
    assert_eq!(s.catalog().flat_map(|(_, t)| t.iter()).count(), 0);
}

/// Exactly one node initializes a range's group: the first to claim it; a repeated claim by
/// the same node (a retry after a crash) succeeds, another node's is refused; descriptor
/// updates keep the claim.
#[test]
fn a_range_is_bootstrapped_by_one_node_only() {
    use ReplicaKind::*;
    let mut s = cluster();
    let Outcome::Range { range } = propose(
        &mut s,
        1,
        Command::CreateRange {
            table: table(),
            partition: None,
            replicas: vec![replica(1, Voter), replica(2, Voter)],
            seed: None,
            merge: vec![],
        },
    ) else {
        panic!()
    };
    let claim = |node_id| Command::BootstrapRange {
        range_id: range.range_id,
        node_id,
    };
    assert_eq!(propose(&mut s, 2, claim(2)), Outcome::Done);
    assert_eq!(propose(&mut s, 3, claim(2)), Outcome::Done, "idempotent");
    assert_eq!(
        propose(&mut s, 4, claim(1)),
        Outcome::Rejected {
            error: MetaError::RangeBootstrapped {
                range_id: range.range_id,
                by: 2
            }
        }
    );
    let mut next = s.range(range.range_id).unwrap().clone();
    next.replicas.push(replica(3, NonVoter));
    next.bootstrapped_by = None;
    let put = Command::PutRange {
        expected_generation: Some(next.generation),
        range: next,
    };
    assert_eq!(propose(&mut s, 5, put), Outcome::Done);
    assert_eq!(s.range(range.range_id).unwrap().bootstrapped_by, Some(2));
}

/// A partition split from a table's range names that range as its seed, and keeps it through
/// descriptor updates; a seed that does not exist (dropped meanwhile) is not recorded.
#[test]
fn a_new_partition_range_remembers_the_range_it_is_seeded_from() {
    use ReplicaKind::*;
    let mut s = cluster();
    let Outcome::Range { range: whole } = propose(
        &mut s,
        1,
        Command::CreateRange {
            table: table(),
            partition: None,
            replicas: vec![replica(1, Voter)],
            seed: None,
            merge: vec![],
        },
    ) else {
        panic!()
    };
    let Outcome::Range { range: part } = propose(
        &mut s,
        2,
        Command::CreateRange {
            table: table(),
            partition: Some("us-east1".into()),
            replicas: vec![replica(2, Voter)],
            seed: Some(whole.range_id),
            merge: vec![],
        },
    ) else {
        panic!()
    };
    assert_eq!(part.seed, Some(whole.range_id));
    let mut next = part.clone();
    next.seed = None;
    next.replicas.push(replica(3, NonVoter));
    let put = Command::PutRange {
        expected_generation: Some(next.generation),
        range: next,
    };
    assert_eq!(propose(&mut s, 3, put), Outcome::Done);
    assert_eq!(s.range(part.range_id).unwrap().seed, Some(whole.range_id));
    let Outcome::Range { range: other } = propose(
        &mut s,
        4,
        Command::CreateRange {
            table: table(),
            partition: Some("us-west1".into()),
            replicas: vec![replica(2, Voter)],
            seed: Some(999),
            merge: vec![],
        },
    ) else {
        panic!()
    };
    assert_eq!(other.seed, None);
}

/// A table's range made from its partitions' ranges names them (those that exist) as the
/// ranges it merges, and keeps them through descriptor updates.
#[test]
fn a_merged_range_remembers_the_partition_ranges_it_starts_from() {
    use ReplicaKind::*;
    let mut s = cluster();
    let mut parts = vec![];
    for (i, region) in ["us-east1", "us-west1"].into_iter().enumerate() {
        let Outcome::Range { range } = propose(
            &mut s,
            1 + i as u64,
            Command::CreateRange {
                table: table(),
                partition: Some(region.into()),
                replicas: vec![replica(1, Voter)],
                seed: None,
                merge: vec![],
            },
        ) else {
            panic!()
        };
        parts.push(range.range_id);
    }
    let Outcome::Range { range: whole } = propose(
        &mut s,
        3,
        Command::CreateRange {
            table: table(),
            partition: None,
            replicas: vec![replica(2, Voter)],
            seed: None,
            merge: vec![parts[0], parts[1], 999],
        },
    ) else {
        panic!()
    };
    assert_eq!(whole.merge, parts);
    let mut next = whole.clone();
    next.merge = vec![];
    next.replicas.push(replica(3, NonVoter));
    let put = Command::PutRange {
        expected_generation: Some(next.generation),
        range: next,
    };
    assert_eq!(propose(&mut s, 4, put), Outcome::Done);
    assert_eq!(s.range(whole.range_id).unwrap().merge, parts);
}

/// Format 5 (databases dropped cluster-wide) reads back from its golden file.
#[test]
fn format_5_snapshots_stay_readable() {
    let golden = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/snapshot-v5.json"
    ))
    .expect("the golden snapshot is committed");
    let s = snapshot::decode(&golden).expect("format 5 decodes");
    let dropped: Vec<_> = s.dropped_databases().collect();
    assert_eq!(dropped.len(), 1);
    assert_eq!(dropped[0].0, "bank");
    assert!(dropped[0].1.contains(&2));
    assert!(s.schema("movr").is_some(), "other databases stay");
    assert_eq!(
        snapshot::decode(&snapshot::encode(&s)).unwrap(),
        s,
        "round trip"
    );
}

/// `DROP DATABASE` forgets the database everywhere: its schema log, regions, tables and
/// ranges; each node records that it dropped its copy; a database created again under the
/// name starts a new schema log at version 0.
#[test]
fn a_dropped_database_is_forgotten_and_starts_again_at_version_zero() {
    use ReplicaKind::*;
    let mut s = cluster();
    propose(&mut s, 1, schema_change(0, "{}", Some(movr()), vec![]));
    let mut with_tables = schema_change(1, "{}", Some(movr()), vec![]);
    if let Command::SchemaChange { tables, .. } = &mut with_tables {
        *tables = Some(vec![table()]);
    }
    propose(&mut s, 2, with_tables);
    propose(
        &mut s,
        3,
        Command::CreateRange {
            table: table(),
            partition: None,
            replicas: vec![replica(1, Voter)],
            seed: None,
            merge: vec![],
        },
    );
    assert_eq!(s.ranges().count(), 1);
    let forget = Command::ForgetDatabase {
        database: "movr".into(),
        node_id: 2,
    };
    assert_eq!(propose(&mut s, 4, forget), Outcome::Done);
    assert!(s.schema("movr").is_none());
    assert_eq!(s.ranges().count(), 0);
    assert_eq!(s.catalog().count(), 0);
    let done = |s: &MetaState| -> Vec<u64> {
        s.dropped_databases()
            .find(|(d, _)| *d == "movr")
            .map(|(_, n)| n.iter().copied().collect())
            .unwrap_or_default()
    };
    assert_eq!(done(&s), vec![2], "the origin dropped its copy itself");
    let ack = Command::DatabaseDropped {
        database: "movr".into(),
        node_id: 1,
    };
    propose(&mut s, 5, ack);
    assert_eq!(done(&s), vec![1, 2]);
    let again = propose(&mut s, 6, schema_change(0, "{}", None, vec![]));
    assert_eq!(again, Outcome::SchemaVersion { version: 1 });
}

/// A change that reshapes tables records them with their ranges' last entries before it, and
/// rows written under an older version of the schema are fenced only for those tables.
#[test]
fn a_change_that_reshapes_a_table_fences_only_that_tables_older_rows() {
    let mut s = cluster();
    let mut c = schema_change(
        0,
        "ALTER TABLE users ADD COLUMN c int",
        Some(movr()),
        vec![],
    );
    let users = Fenced {
        schema: "public".into(),
        table: "users".into(),
        after: vec![(3, 41), (4, 7)],
    };
    if let Command::SchemaChange { fenced, .. } = &mut c {
        fenced.push(users.clone());
    }
    assert_eq!(propose(&mut s, 1, c), Outcome::SchemaVersion { version: 1 });
    let plain = schema_change(1, "CREATE INDEX ON rides (city)", Some(movr()), vec![]);
    assert_eq!(
        propose(&mut s, 2, plain),
        Outcome::SchemaVersion { version: 2 }
    );
    let log = s.schema("movr").unwrap();
    assert_eq!(log.changes[0].fenced, vec![users]);
    assert!(log.changes[1].fenced.is_empty());
    assert_eq!(log.fenced_since(0, "public", "users"), Some(1));
    assert_eq!(
        log.fenced_since(1, "public", "users"),
        None,
        "written after it"
    );
    assert_eq!(
        log.fenced_since(0, "public", "rides"),
        None,
        "another table"
    );
    // A change from before fences existed reads as fencing nothing.
    let old = r#"{"version":1,"at_ms":5,"change":"x"}"#;
    let old: mr_meta::SchemaChange = serde_json::from_str(old).unwrap();
    assert!(old.fenced.is_empty());
}

fn seq(name: &str) -> TableRef {
    TableRef {
        database: "movr".into(),
        schema: "public".into(),
        table: name.into(),
    }
}

fn draw(name: &str, count: u64, initial: i64) -> Command {
    Command::NextSequenceValues {
        sequence: seq(name),
        params: SequenceParams {
            start: 1,
            increment: 1,
            min: 1,
            max: 10,
            cycle: false,
        },
        initial: SequenceValue {
            last: initial,
            is_called: false,
        },
        count,
    }
}

fn first_of(o: Outcome) -> (i64, u64) {
    match o {
        Outcome::SequenceValues { block } => (block.first, block.count),
        other => panic!("{other:?}"),
    }
}

/// A sequence's counter starts from the first drawer's copy, then only moves forward
/// however many nodes draw; a replayed proposal returns its first block again; the bound is
/// reported, not passed.
#[test]
fn sequence_counters_hand_out_each_value_once_cluster_wide() {
    let mut s = cluster();
    assert_eq!(first_of(propose(&mut s, 1, draw("s", 3, 1))), (1, 3));
    // Another node's copy says 1 too: the counter, not the copy, decides.
    assert_eq!(first_of(propose(&mut s, 2, draw("s", 2, 1))), (4, 2));
    let again = s.apply(&Proposal {
        client: client(9),
        seq: 2,
        command: draw("s", 2, 1),
    });
    assert_eq!(first_of(again), (4, 2), "exactly once");
    assert_eq!(first_of(propose(&mut s, 3, draw("s", 100, 1))), (6, 5));
    assert_eq!(
        propose(&mut s, 4, draw("s", 1, 1)),
        Outcome::SequenceLimit { limit: 10 }
    );
    let (_, v) = s.sequences().next().unwrap();
    assert_eq!(v.last, 10);
}

/// Renames move a counter, drops forget it (a new sequence under the name starts from its
/// own copy), `setval` sets it, and a dropped database takes its counters along; a schema
/// change that is refused changes no counter.
#[test]
fn sequence_counters_follow_renames_drops_and_sets() {
    let mut s = cluster();
    propose(&mut s, 1, draw("a", 5, 1));
    propose(&mut s, 2, draw("b", 2, 1));
    let mut change = schema_change(0, "rename", None, vec![]);
    if let Command::SchemaChange { sequences, .. } = &mut change {
        *sequences = vec![
            SequenceChange::Move {
                moves: vec![(seq("a"), seq("c"))],
            },
            SequenceChange::Drop { sequence: seq("b") },
        ];
    }
    let mut stale = change.clone();
    if let Command::SchemaChange {
        expected_version, ..
    } = &mut stale
    {
        *expected_version = 7;
    }
    assert!(matches!(
        propose(&mut s, 3, stale),
        Outcome::Rejected { .. }
    ));
    assert_eq!(s.sequences().count(), 2, "a refused change moves nothing");
    propose(&mut s, 4, change);
    assert_eq!(first_of(propose(&mut s, 5, draw("c", 1, 1))), (6, 1));
    assert_eq!(first_of(propose(&mut s, 6, draw("b", 1, 1))), (1, 1));
    propose(
        &mut s,
        7,
        Command::ChangeSequences {
            changes: vec![SequenceChange::Set {
                sequence: seq("c"),
                value: SequenceValue {
                    last: 2,
                    is_called: false,
                },
            }],
        },
    );
    assert_eq!(first_of(propose(&mut s, 8, draw("c", 1, 1))), (2, 1));
    propose(
        &mut s,
        9,
        Command::ForgetDatabase {
            database: "movr".into(),
            node_id: 1,
        },
    );
    assert_eq!(s.sequences().count(), 0);
}

/// `CONFIGURE ZONE` overrides are kept per scope with the schema change that sets them,
/// replaced or discarded by later ones, and go with their table or database.
#[test]
fn zone_overrides_follow_schema_changes_and_their_tables() {
    let mut s = cluster();
    let users = ZoneScope::Table {
        schema: "public".into(),
        table: "users".into(),
    };
    let fields = |pairs: &[(&str, &str)]| -> std::collections::BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(f, v)| (f.to_string(), v.to_string()))
            .collect()
    };
    let with = |version: u64, tables: Vec<TableRef>, zones: Vec<ZoneChange>| {
        let mut c = schema_change(version, "{}", Some(movr()), vec![]);
        if let Command::SchemaChange {
            tables: t,
            zones: z,
            ..
        } = &mut c
        {
            *t = Some(tables);
            *z = zones;
        }
        c
    };
    propose(
        &mut s,
        1,
        with(
            0,
            vec![table()],
            vec![
                ZoneChange {
                    scope: users.clone(),
                    fields: Some(fields(&[("gc.ttlseconds", "600")])),
                },
                ZoneChange {
                    scope: ZoneScope::Database,
                    fields: Some(fields(&[("num_replicas", "5")])),
                },
            ],
        ),
    );
    assert_eq!(s.zones("movr").len(), 2);
    assert!(s
        .zones("movr")
        .contains(&(users.clone(), fields(&[("gc.ttlseconds", "600")]))));
    // Replaced, then discarded.
    propose(
        &mut s,
        2,
        with(
            1,
            vec![table()],
            vec![ZoneChange {
                scope: users.clone(),
                fields: Some(fields(&[("num_voters", "3")])),
            }],
        ),
    );
    assert!(s
        .zones("movr")
        .contains(&(users.clone(), fields(&[("num_voters", "3")]))));
    propose(
        &mut s,
        3,
        with(
            2,
            vec![table()],
            vec![ZoneChange {
                scope: users.clone(),
                fields: None,
            }],
        ),
    );
    assert_eq!(s.zones("movr").len(), 1);
    // A table dropped takes its overrides along; the database's stay.
    propose(
        &mut s,
        4,
        with(
            3,
            vec![table()],
            vec![ZoneChange {
                scope: users.clone(),
                fields: Some(fields(&[("gc.ttlseconds", "60")])),
            }],
        ),
    );
    assert_eq!(s.zones("movr").len(), 2);
    propose(&mut s, 5, with(4, vec![], vec![]));
    assert_eq!(
        s.zones("movr"),
        &[(ZoneScope::Database, fields(&[("num_replicas", "5")]))]
    );
    let decoded = snapshot::decode(&snapshot::encode(&s)).unwrap();
    assert_eq!(decoded.zones("movr"), s.zones("movr"));
}

/// A node's applier failure is kept with the database's schema log until that node reports
/// the version applied; a failure reported for a version it has already applied is stale.
#[test]
fn a_failed_schema_change_is_shown_until_the_node_applies_it() {
    let mut s = cluster();
    propose(&mut s, 1, schema_change(0, "{}", Some(movr()), vec![]));
    propose(&mut s, 2, schema_change(1, "{}", Some(movr()), vec![]));
    let failed = |node_id: u64, version: u64| Command::SchemaApplyFailed {
        node_id,
        database: "movr".into(),
        version,
        error: "relation \"t\" already exists".into(),
    };
    assert_eq!(propose(&mut s, 3, failed(2, 2)), Outcome::Done);
    let log = s.schema("movr").unwrap();
    assert_eq!(log.failures.get(&2).map(|f| f.0), Some(2));
    // Reported applied up to 1: still failing at 2.
    propose(&mut s, 4, applied(2, 1));
    assert!(s.schema("movr").unwrap().failures.contains_key(&2));
    propose(&mut s, 5, applied(2, 2));
    assert!(s.schema("movr").unwrap().failures.is_empty());
    // Stale: version 1 is applied there already.
    propose(&mut s, 6, failed(2, 1));
    assert!(s.schema("movr").unwrap().failures.is_empty());
    // Survives a snapshot.
    propose(&mut s, 7, failed(3, 2));
    let decoded = snapshot::decode(&snapshot::encode(&s)).unwrap();
    assert_eq!(decoded.schema("movr").unwrap().failures.len(), 1);
    assert!(matches!(
        propose(
            &mut s,
            8,
            Command::SchemaApplyFailed {
                node_id: 2,
                database: "nosuch".into(),
                version: 1,
                error: "x".into(),
            }
        ),
        Outcome::Rejected { .. }
    ));
}
