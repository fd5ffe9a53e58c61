//! Commands and their deterministic application.

use crate::model::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Who proposed: a node and one run of its pgmr. A restarted pgmr is a new client (its
/// sequence numbers start again at 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ClientId {
    pub node_id: NodeId,
    pub incarnation: u64,
}

/// One change to propose. Times are the proposer's wall clock (Unix ms).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    /// Allocates the next node id for a joining node.
    AddNode {
        rpc_addr: String,
        sql_addr: String,
        locality: String,
        at_ms: u64,
    },
    /// A node's liveness heartbeat; also records a changed address after a restart.
    Heartbeat {
        node_id: NodeId,
        rpc_addr: String,
        sql_addr: String,
        at_ms: u64,
    },
    Decommission {
        node_id: NodeId,
    },
    PutDatabase {
        config: DatabaseConfig,
    },
    DropDatabase {
        database: String,
    },
    PutTableLocality {
        table: TableRef,
        locality: TableLocality,
    },
    DropTable {
        table: TableRef,
    },
    /// Creates (`expected_generation: None`) or replaces a range descriptor, compare-and-set
    /// on its generation so that two concurrent replica changes cannot both win.
    PutRange {
        range: RangeDescriptor,
        expected_generation: Option<u64>,
    },
    /// Takes or extends a lease if the current lease's sequence is `expected_sequence` (`None`
    /// when the range has none) — so two nodes racing for it cannot both succeed.
    AcquireLease {
        range_id: RangeId,
        holder: NodeId,
        start_ms: u64,
        expiration_ms: u64,
        expected_sequence: Option<u64>,
    },
    /// `SET CLUSTER SETTING name = value`; `None` resets it to its default.
    SetClusterSetting {
        name: String,
        value: Option<String>,
    },
}

impl Command {
    /// Whether applying it is recorded in the event log. Heartbeats are not: they are
    /// frequent, and their effect (the latest heartbeat) is in the node record.
    fn logged(&self) -> bool {
        !matches!(self, Command::Heartbeat { .. })
    }
}

/// One entry of the event log (CockroachDB's `system.eventlog`): a command that took effect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// 1, 2, 3, … in apply order, never reused; gaps appear only at the log's head, where old
    /// events are dropped.
    pub id: u64,
    /// The latest proposer time seen when it applied (Unix ms).
    pub at_ms: u64,
    pub client: ClientId,
    pub seq: u64,
    pub command: Command,
}

/// The event log keeps this many of the latest events.
pub const EVENT_LOG_LEN: usize = 1000;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Proposal {
    pub client: ClientId,
    /// 1, 2, 3, … per client; a client proposes one at a time and retries with the same number.
    pub seq: u64,
    pub command: Command,
}

/// Why a command was refused. Deterministic: every replica refuses it alike.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "error", rename_all = "snake_case")]
pub enum MetaError {
    #[error("node {node_id} does not exist")]
    NoSuchNode { node_id: NodeId },
    #[error("node {node_id} is decommissioned")]
    Decommissioned { node_id: NodeId },
    #[error("primary region {region:?} is not one of the database's regions")]
    PrimaryNotInRegions { region: String },
    #[error("database {database:?} is not multi-region")]
    NoSuchDatabase { database: String },
    #[error("range {range_id} is at generation {current:?}, not {expected:?}")]
    RangeChanged {
        range_id: RangeId,
        current: Option<u64>,
        expected: Option<u64>,
    },
    #[error("range {range_id} has lease sequence {current:?}, not {expected:?}")]
    LeaseChanged {
        range_id: RangeId,
        current: Option<u64>,
        expected: Option<u64>,
    },
    #[error("range {range_id} does not exist")]
    NoSuchRange { range_id: RangeId },
    #[error("node {holder} holds no voting replica of range {range_id}")]
    NotAVoter { range_id: RangeId, holder: NodeId },
    #[error("{name:?} is not a valid cluster setting name")]
    BadSettingName { name: String },
    #[error("proposal {seq} of this client was superseded by proposal {last}; its outcome is no longer known")]
    Superseded { seq: u64, last: u64 },
}

/// What applying a proposal produced. Stored per client for exactly-once replies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    Done,
    NodeAdded { node_id: NodeId },
    Lease { lease: Lease },
    Rejected { error: MetaError },
}

/// The last proposal applied for one client, and what it produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Session {
    seq: u64,
    outcome: Outcome,
    last_active_ms: u64,
}

/// Sessions idle this long are forgotten; a client that comes back after that is a new run.
const SESSION_TTL_MS: u64 = 3_600_000;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MetaState {
    next_node_id: NodeId,
    nodes: BTreeMap<NodeId, NodeRecord>,
    databases: BTreeMap<String, DatabaseConfig>,
    #[serde(with = "pairs")]
    tables: BTreeMap<TableRef, TableLocality>,
    ranges: BTreeMap<RangeId, RangeDescriptor>,
    leases: BTreeMap<RangeId, Lease>,
    #[serde(with = "pairs")]
    sessions: BTreeMap<ClientId, Session>,
    /// Latest proposer time seen: the only clock apply knows, used to expire sessions.
    high_water_ms: u64,
    /// Added in snapshot format 2; empty when read from format 1.
    #[serde(default)]
    settings: BTreeMap<String, String>,
    /// Added in snapshot format 2; empty when read from format 1.
    #[serde(default)]
    events: std::collections::VecDeque<Event>,
    #[serde(default)]
    last_event_id: u64,
}

impl MetaState {
    /// A new cluster whose first node is `first`: it gets node id 1.
    pub fn bootstrap(rpc_addr: &str, sql_addr: &str, locality: &str, at_ms: u64) -> MetaState {
        let mut s = MetaState {
            next_node_id: 1,
            ..MetaState::default()
        };
        s.add_node(rpc_addr, sql_addr, locality, at_ms);
        s.high_water_ms = at_ms;
        s
    }

    pub fn nodes(&self) -> impl Iterator<Item = &NodeRecord> {
        self.nodes.values()
    }
    pub fn node(&self, id: NodeId) -> Option<&NodeRecord> {
        self.nodes.get(&id)
    }
    pub fn database(&self, name: &str) -> Option<&DatabaseConfig> {
        self.databases.get(name)
    }
    pub fn table_locality(&self, t: &TableRef) -> Option<&TableLocality> {
        self.tables.get(t)
    }
    pub fn range(&self, id: RangeId) -> Option<&RangeDescriptor> {
        self.ranges.get(&id)
    }
    pub fn lease(&self, id: RangeId) -> Option<&Lease> {
        self.leases.get(&id)
    }
    pub fn cluster_setting(&self, name: &str) -> Option<&str> {
        self.settings.get(name).map(String::as_str)
    }
    pub fn cluster_settings(&self) -> impl Iterator<Item = (&str, &str)> {
        self.settings.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
    /// The retained event log, oldest first.
    pub fn events(&self) -> impl Iterator<Item = &Event> {
        self.events.iter()
    }

    /// Applies one committed proposal. A proposal already applied for its client returns the
    /// recorded outcome and changes nothing.
    pub fn apply(&mut self, p: &Proposal) -> Outcome {
        if let Some(s) = self.sessions.get(&p.client) {
            if p.seq == s.seq {
                return s.outcome.clone();
            }
            if p.seq < s.seq {
                let error = MetaError::Superseded {
                    seq: p.seq,
                    last: s.seq,
                };
                return Outcome::Rejected { error };
            }
        }
        let at = command_time(&p.command).unwrap_or(self.high_water_ms);
        self.high_water_ms = self.high_water_ms.max(at);
        let outcome = match self.execute(&p.command) {
            Ok(o) => o,
            Err(error) => Outcome::Rejected { error },
        };
        let now = self.high_water_ms;
        if p.command.logged() && !matches!(outcome, Outcome::Rejected { .. }) {
            self.last_event_id += 1;
            self.events.push_back(Event {
                id: self.last_event_id,
                at_ms: now,
                client: p.client,
                seq: p.seq,
                command: p.command.clone(),
            });
            while self.events.len() > EVENT_LOG_LEN {
                self.events.pop_front();
            }
        }
        self.sessions.insert(
            p.client,
            Session {
                seq: p.seq,
                outcome: outcome.clone(),
                last_active_ms: now,
            },
        );
        self.sessions
            .retain(|_, s| now.saturating_sub(s.last_active_ms) < SESSION_TTL_MS);
        outcome
    }

    fn add_node(&mut self, rpc_addr: &str, sql_addr: &str, locality: &str, at_ms: u64) -> NodeId {
        let node_id = self.next_node_id.max(1);
        self.next_node_id = node_id + 1;
        self.nodes.insert(
            node_id,
            NodeRecord {
                node_id,
                rpc_addr: rpc_addr.to_string(),
                sql_addr: sql_addr.to_string(),
                locality: locality.to_string(),
                joined_at_ms: at_ms,
                last_heartbeat_ms: at_ms,
                decommissioned: false,
            },
        );
        node_id
    }

    fn live_node(&mut self, node_id: NodeId) -> Result<&mut NodeRecord, MetaError> {
        let n = self
            .nodes
            .get_mut(&node_id)
            .ok_or(MetaError::NoSuchNode { node_id })?;
        if n.decommissioned {
            return Err(MetaError::Decommissioned { node_id });
        }
        Ok(n)
    }

    fn execute(&mut self, c: &Command) -> Result<Outcome, MetaError> {
        match c {
            Command::AddNode {
                rpc_addr,
                sql_addr,
                locality,
                at_ms,
            } => {
                let node_id = self.add_node(rpc_addr, sql_addr, locality, *at_ms);
                Ok(Outcome::NodeAdded { node_id })
            }
            Command::Heartbeat {
                node_id,
                rpc_addr,
                sql_addr,
                at_ms,
            } => {
                let n = self.live_node(*node_id)?;
                n.last_heartbeat_ms = n.last_heartbeat_ms.max(*at_ms);
                n.rpc_addr.clone_from(rpc_addr);
                n.sql_addr.clone_from(sql_addr);
                Ok(Outcome::Done)
            }
            Command::Decommission { node_id } => {
                let n = self
                    .nodes
                    .get_mut(node_id)
                    .ok_or(MetaError::NoSuchNode { node_id: *node_id })?;
                n.decommissioned = true;
                Ok(Outcome::Done)
            }
            Command::PutDatabase { config } => {
                if !config.regions.contains(&config.primary_region) {
                    return Err(MetaError::PrimaryNotInRegions {
                        region: config.primary_region.clone(),
                    });
                }
                self.databases
                    .insert(config.database.clone(), config.clone());
                Ok(Outcome::Done)
            }
            Command::DropDatabase { database } => {
                self.databases
                    .remove(database)
                    .ok_or_else(|| MetaError::NoSuchDatabase {
                        database: database.clone(),
                    })?;
                self.tables.retain(|t, _| &t.database != database);
                Ok(Outcome::Done)
            }
            Command::PutTableLocality { table, locality } => {
                if !self.databases.contains_key(&table.database) {
                    return Err(MetaError::NoSuchDatabase {
                        database: table.database.clone(),
                    });
                }
                self.tables.insert(table.clone(), locality.clone());
                Ok(Outcome::Done)
            }
            Command::DropTable { table } => {
                self.tables.remove(table);
                Ok(Outcome::Done)
            }
            Command::PutRange {
                range,
                expected_generation,
            } => {
                let current = self.ranges.get(&range.range_id).map(|r| r.generation);
                if current != *expected_generation {
                    return Err(MetaError::RangeChanged {
                        range_id: range.range_id,
                        current,
                        expected: *expected_generation,
                    });
                }
                for r in &range.replicas {
                    self.live_node(r.node_id)?;
                }
                let mut next = range.clone();
                next.generation = current.map_or(1, |g| g + 1);
                self.ranges.insert(range.range_id, next);
                Ok(Outcome::Done)
            }
            Command::AcquireLease {
                range_id,
                holder,
                start_ms,
                expiration_ms,
                expected_sequence,
            } => {
                let range = self.ranges.get(range_id).ok_or(MetaError::NoSuchRange {
                    range_id: *range_id,
                })?;
                let voter = range
                    .replicas
                    .iter()
                    .any(|r| r.node_id == *holder && r.kind == ReplicaKind::Voter);
                if !voter {
                    return Err(MetaError::NotAVoter {
                        range_id: *range_id,
                        holder: *holder,
                    });
                }
                self.live_node(*holder)?;
                let current = self.leases.get(range_id);
                let current_seq = current.map(|l| l.sequence);
                if current_seq != *expected_sequence {
                    return Err(MetaError::LeaseChanged {
                        range_id: *range_id,
                        current: current_seq,
                        expected: *expected_sequence,
                    });
                }
                let sequence = match current {
                    Some(l) if l.holder == *holder => l.sequence,
                    Some(l) => l.sequence + 1,
                    None => 1,
                };
                let lease = Lease {
                    range_id: *range_id,
                    holder: *holder,
                    sequence,
                    start_ms: *start_ms,
                    expiration_ms: *expiration_ms,
                };
                self.leases.insert(*range_id, lease.clone());
                Ok(Outcome::Lease { lease })
            }
            Command::SetClusterSetting { name, value } => {
                if name.is_empty() || name.len() > 256 {
                    return Err(MetaError::BadSettingName { name: name.clone() });
                }
                match value {
                    Some(v) => self.settings.insert(name.clone(), v.clone()),
                    None => self.settings.remove(name),
                };
                Ok(Outcome::Done)
            }
        }
    }
}

fn command_time(c: &Command) -> Option<u64> {
    match c {
        Command::AddNode { at_ms, .. } | Command::Heartbeat { at_ms, .. } => Some(*at_ms),
        Command::AcquireLease { start_ms, .. } => Some(*start_ms),
        _ => None,
    }
}

/// Maps with structured keys, written as lists of `[key, value]` pairs: JSON object keys can
/// only be strings.
mod pairs {
    use serde::de::DeserializeOwned;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::collections::BTreeMap;

    pub fn serialize<K: Serialize, V: Serialize, S: Serializer>(
        map: &BTreeMap<K, V>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(map.iter())
    }

    pub fn deserialize<'de, K, V, D>(d: D) -> Result<BTreeMap<K, V>, D::Error>
    where
        K: DeserializeOwned + Ord,
        V: DeserializeOwned,
        D: Deserializer<'de>,
    {
        Ok(Vec::<(K, V)>::deserialize(d)?.into_iter().collect())
    }
}
