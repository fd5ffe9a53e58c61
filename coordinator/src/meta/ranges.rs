//! Range descriptors kept as the declarations want them, by the meta group's leader.
//!
//! Each pass derives, for every table of every cluster-wide database, its ranges and their
//! zone configurations ([`mr_zoneconfig::table_ranges`]), places each with
//! [`mr_zoneconfig::allocate::allocate`] on the nodes that may hold replicas, and proposes
//! what differs: a missing range is created, a range whose replicas should change gets a new
//! generation (compare-and-set, so a racing leader cannot undo it), a range whose table or
//! partition is gone is dropped — once no new range still has to seed itself from its rows
//! (a table split into REGIONAL BY ROW partitions: [`mr_meta::RangeDescriptor::seed`]; one
//! that becomes one range again: [`mr_meta::RangeDescriptor::merge`]). Region, survival,
//! placement and locality changes, nodes joining, dying or leaving all reach the descriptors
//! this way; nothing else writes them.

use super::Meta;
use mr_meta::{Command, MetaState, NodeStatus, RangeDescriptor, ReplicaKind, TableRef};
use mr_wire::peer::{PeerRequest, PeerResponse};
use mr_zoneconfig::allocate::{allocate, same_replicas, Candidate};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// At most this many descriptor changes per pass, so one pass cannot flood the meta log.
const CHANGES_PER_PASS: usize = 32;
/// How long a range to drop is asked to seal (its leaseholder may be failing over) before it
/// is dropped unsealed; and how long one ask may take.
const SEAL_PATIENCE: Duration = Duration::from_secs(60);
const SEAL_TIMEOUT: Duration = Duration::from_secs(5);

/// One proposed change of the descriptors.
#[derive(Debug, Clone, PartialEq)]
pub enum RangeChange {
    Create {
        table: TableRef,
        partition: Option<String>,
        replicas: Vec<mr_meta::Replica>,
        seed: Option<u64>,
        merge: Vec<u64>,
    },
    Replace {
        range: RangeDescriptor,
    },
    Drop {
        range_id: u64,
    },
}

/// What the descriptors should become, as changes to `state`'s, given the time `now_ms`.
pub fn plan(state: &MetaState, now_ms: u64) -> Vec<RangeChange> {
    let candidates: Vec<Candidate> = state
        .nodes()
        .filter(|n| matches!(n.status(now_ms), NodeStatus::Live | NodeStatus::Suspect))
        .filter_map(|n| {
            let l = mr_topology::Locality::parse(&n.locality).ok()?;
            Some(Candidate {
                node_id: n.node_id,
                region: l.region().to_string(),
                zone: l.zone().unwrap_or_default().to_string(),
            })
        })
        .collect();
    let mut changes = Vec::new();
    let mut wanted: BTreeSet<(TableRef, Option<String>)> = BTreeSet::new();
    for (database, tables) in state.catalog() {
        let config = state.database(database);
        for table in tables {
            let Ok(ranges) = mr_zoneconfig::overrides::table_ranges(
                config,
                state.table_locality(table),
                state.zones(database),
                &table.schema,
                &table.table,
            ) else {
                continue;
            };
            for (partition, zone) in ranges {
                wanted.insert((table.clone(), partition.clone()));
                let existing = state
                    .ranges()
                    .find(|r| &r.table == table && r.partition == partition);
                let current = existing.map(|r| r.replicas.as_slice()).unwrap_or(&[]);
                let a = allocate(&zone, &candidates, current);
                if a.replicas.iter().all(|r| r.kind != ReplicaKind::Voter) {
                    continue; // no node can hold it yet
                }
                match existing {
                    None => {
                        // A partition of a table that was one range starts from its rows;
                        // a table that was partitioned, from its partitions' rows; a key
                        // table filled from a table that was one range, from that range's.
                        let whole = |t: &TableRef| {
                            state
                                .ranges()
                                .find(|r| &r.table == t && r.partition.is_none())
                                .map(|r| r.range_id)
                        };
                        let seed = match &partition {
                            Some(_) => whole(table),
                            None => state.key_seed(table).and_then(whole),
                        };
                        let partitions = |t: &TableRef| -> Vec<u64> {
                            state
                                .ranges()
                                .filter(|r| &r.table == t && r.partition.is_some())
                                .map(|r| r.range_id)
                                .collect()
                        };
                        let merge = match partition {
                            Some(_) => vec![],
                            // A key table added to a REGIONAL BY ROW table: from the keys
                            // of each of its partitions, read at their leaseholders.
                            None if seed.is_none() && partitions(table).is_empty() => {
                                state.key_seed(table).map(&partitions).unwrap_or_default()
                            }
                            None => partitions(table),
                        };
                        changes.push(RangeChange::Create {
                            table: table.clone(),
                            partition,
                            replicas: a.replicas,
                            seed,
                            merge,
                        })
                    }
                    Some(r) if !same_replicas(&r.replicas, &a.replicas) => {
                        let mut next = r.clone();
                        next.replicas = a.replicas;
                        changes.push(RangeChange::Replace { range: next });
                    }
                    Some(_) => {}
                }
            }
        }
    }
    // A range still to seed another (created now, or not bootstrapped yet) keeps its
    // replicas and leaseholder until then.
    let seeds: BTreeSet<u64> = changes
        .iter()
        .flat_map(|c| match c {
            RangeChange::Create { seed, merge, .. } => seed.iter().chain(merge).copied().collect(),
            _ => vec![],
        })
        .chain(
            state
                .ranges()
                .filter(|q| q.bootstrapped_by.is_none())
                .flat_map(|q| q.seed.iter().chain(&q.merge).copied().collect::<Vec<_>>()),
        )
        .collect();
    for r in state.ranges() {
        let seeding = seeds.contains(&r.range_id);
        if !seeding && !wanted.contains(&(r.table.clone(), r.partition.clone())) {
            changes.push(RangeChange::Drop {
                range_id: r.range_id,
            });
        }
    }
    changes.truncate(CHANGES_PER_PASS);
    changes
}

impl Meta {
    /// Has range `range_id`'s leaseholder close its log with a seal entry before the range
    /// is dropped (docs/ARCHITECTURE.md §8.5): the node that applied it, which then answers
    /// for the range's two-phase commit decisions. `Ok(None)`: the range never had a
    /// leaseholder, so it recorded no decision and there is nothing to seal.
    async fn seal(&self, range_id: u64, now_ms: u64) -> Result<Option<u64>, String> {
        let Some(mut holder) = self.read(|s| s.lease(range_id).map(|l| l.holder)) else {
            return Ok(None);
        };
        // The lease may have moved without the meta state showing it yet: follow the
        // leader the holder names, once.
        for _ in 0..2 {
            // A node that is not live is not waited for (a cut-off one would hold the pass).
            let addr = self
                .read(|s| {
                    s.node(holder)
                        .filter(|n| n.status(now_ms) == NodeStatus::Live)
                        .map(|n| n.rpc_addr.clone())
                })
                .ok_or_else(|| format!("node {holder} is not live"))?;
            match self
                .transport
                .call(&addr, PeerRequest::SealRange { range_id }, SEAL_TIMEOUT)
                .await
            {
                Ok(PeerResponse::Sealed { node_id }) => return Ok(Some(node_id)),
                Ok(PeerResponse::NotLeader {
                    leader_id: Some(l), ..
                }) if l != holder => holder = l,
                Ok(other) => return Err(format!("node {holder} answered {other:?}")),
                Err(e) => return Err(e.to_string()),
            }
        }
        Err(format!("no leader of range {range_id} found"))
    }

    /// One pass of the descriptor upkeep; does nothing on a node that is not the leader.
    pub async fn reconcile_ranges(&self, now_ms: u64) -> anyhow::Result<()> {
        if self.metrics().state != openraft::ServerState::Leader {
            return Ok(());
        }
        let changes = self.read(|s| plan(s, now_ms));
        // The ranges to drop are sealed first, together.
        let seals: std::collections::BTreeMap<u64, Result<Option<u64>, String>> =
            futures::future::join_all(changes.iter().filter_map(|c| match c {
                RangeChange::Drop { range_id } => {
                    let id = *range_id;
                    Some(async move { (id, self.seal(id, now_ms).await) })
                }
                _ => None,
            }))
            .await
            .into_iter()
            .collect();
        for change in changes {
            tracing::info!(?change, "range descriptor change");
            let command = match change {
                RangeChange::Create {
                    table,
                    partition,
                    replicas,
                    seed,
                    merge,
                } => Command::CreateRange {
                    table,
                    partition,
                    replicas,
                    seed,
                    merge,
                },
                RangeChange::Replace { range } => Command::PutRange {
                    expected_generation: Some(range.generation),
                    range,
                },
                RangeChange::Drop { range_id } => {
                    let sealed_by = match seals.get(&range_id).cloned().unwrap_or(Ok(None)) {
                        Ok(node) => node,
                        Err(e) => {
                            let since = *self
                                .unsealed
                                .lock()
                                .expect("unsealed lock")
                                .entry(range_id)
                                .or_insert_with(Instant::now);
                            if since.elapsed() < SEAL_PATIENCE {
                                tracing::debug!(range_id, "cannot seal a range to drop yet: {e}");
                                continue;
                            }
                            tracing::warn!(
                                range_id,
                                "dropping a range that could not be sealed: {e}"
                            );
                            None
                        }
                    };
                    self.unsealed
                        .lock()
                        .expect("unsealed lock")
                        .remove(&range_id);
                    Command::DropRange {
                        range_id,
                        sealed_by,
                        at_ms: now_ms,
                    }
                }
            };
            self.propose(command, Duration::from_secs(5)).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mr_meta::{
        ClientId, DatabaseConfig, Outcome, Placement, Proposal, SurvivalGoal, TableLocality,
    };

    const T0: u64 = 1_700_000_000_000;

    fn apply(s: &mut MetaState, seq: u64, command: Command) -> Outcome {
        s.apply(&Proposal {
            client: ClientId {
                node_id: 1,
                incarnation: 1,
            },
            seq,
            command,
        })
    }

    fn table(name: &str) -> TableRef {
        TableRef {
            database: "movr".into(),
            schema: "public".into(),
            table: name.into(),
        }
    }

    /// A key table added to a table that is REGIONAL BY ROW already starts from the keys of
    /// each of its partitions: the plan names their ranges, not a seed of the whole table.
    #[test]
    fn a_key_table_added_later_is_seeded_from_every_partition() {
        let mut s = MetaState::bootstrap("127.0.0.1:1", "127.0.0.1:2", "region=us-east1", T0);
        for (i, locality) in ["region=us-west1", "region=europe-west1"]
            .iter()
            .enumerate()
        {
            apply(
                &mut s,
                1 + i as u64,
                Command::AddNode {
                    rpc_addr: format!("127.0.0.1:{}", 10 + i),
                    sql_addr: format!("127.0.0.1:{}", 20 + i),
                    locality: locality.to_string(),
                    at_ms: T0,
                },
            );
        }
        let config = DatabaseConfig {
            database: "movr".into(),
            primary_region: "us-east1".into(),
            regions: ["us-east1", "us-west1", "europe-west1"]
                .map(String::from)
                .into(),
            survival: SurvivalGoal::Zone,
            placement: Placement::Default,
            secondary_region: None,
        };
        let users = table("users");
        let change = |version: u64, tables: Vec<TableRef>, seeds| Command::SchemaChange {
            database: "movr".into(),
            expected_version: version,
            change: "c".into(),
            config: Some(config.clone()),
            localities: vec![(
                users.clone(),
                Some(TableLocality::RegionalByRow {
                    column: "crdb_region".into(),
                }),
            )],
            at_ms: T0 + version,
            tables: Some(tables),
            fenced: vec![],
            key_seeds: seeds,
            sequences: vec![],
            zones: vec![],
        };
        apply(&mut s, 3, change(0, vec![users.clone()], vec![]));
        for change in plan(&s, T0 + 10) {
            if let RangeChange::Create {
                table,
                partition,
                replicas,
                seed,
                merge,
            } = change
            {
                let seq = 4 + s.ranges().count() as u64;
                apply(
                    &mut s,
                    seq,
                    Command::CreateRange {
                        table,
                        partition,
                        replicas,
                        seed,
                        merge,
                    },
                );
            }
        }
        let partitions: BTreeSet<u64> = s.ranges().map(|r| r.range_id).collect();
        assert_eq!(partitions.len(), 3, "one range per region");
        let keys = table("users_members_email");
        apply(
            &mut s,
            20,
            change(
                1,
                vec![users.clone(), keys.clone()],
                vec![(keys.clone(), users.clone())],
            ),
        );
        let created: Vec<_> = plan(&s, T0 + 20)
            .into_iter()
            .filter_map(|c| match c {
                RangeChange::Create {
                    table, seed, merge, ..
                } if table == keys => Some((seed, merge.into_iter().collect::<BTreeSet<_>>())),
                _ => None,
            })
            .collect();
        assert_eq!(created, vec![(None, partitions)]);
    }
}
