//! `/metrics`: the node's state in Prometheus' text format (OpenMetrics), read at scrape time.

use crate::node::Node;
use mr_wire::local::{LocalRequest, LocalResponse};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Peer {
    peer: String,
    region: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerId {
    peer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Group {
    group: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Step {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabels {
    node_id: String,
    region: String,
    zone: String,
    version: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

fn gauge(registry: &mut Registry, name: &str, help: &str, v: f64) {
    let g = FloatGauge::default();
    g.set(v);
    registry.register(name, help, g);
}

fn family<L>(registry: &mut Registry, name: &str, help: &str, values: Vec<(L, f64)>)
where
    L: Clone + std::fmt::Debug + std::hash::Hash + Eq + EncodeLabelSet + Send + Sync + 'static,
{
    let f = Family::<L, FloatGauge>::default();
    for (labels, v) in values {
        f.get_or_create(&labels).set(v);
    }
    registry.register(name, help, f);
}

pub async fn render(node: &Node) -> String {
    let mut r = Registry::with_prefix("pgmr");
    let info = match node.local_request(LocalRequest::NodeInfo).await {
        LocalResponse::NodeInfo(i) => Some(i),
        _ => None,
    };
    if let Some(i) = &info {
        family(
            &mut r,
            "node_info",
            "This node (always 1), labelled with its identity",
            vec![(
                NodeLabels {
                    node_id: i.node_id.to_string(),
                    region: i.region.clone(),
                    zone: i.zone.clone().unwrap_or_default(),
                    version: i.pgmr_version.clone(),
                },
                1.0,
            )],
        );
        gauge(
            &mut r,
            "uptime_seconds",
            "Seconds since pgmr started",
            i.uptime_ms as f64 / 1000.0,
        );
        gauge(
            &mut r,
            "postgres_restarts",
            "Times pgmr restarted its PostgreSQL",
            i.pg_restarts as f64,
        );
    }
    family(
        &mut r,
        "peer_rtt_seconds",
        "Median measured round trip of heartbeats to each peer (simulated WAN included)",
        node.peer_rtts()
            .into_iter()
            .map(|(peer, region, ms)| {
                (
                    Peer {
                        peer: peer.to_string(),
                        region,
                    },
                    ms / 1000.0,
                )
            })
            .collect(),
    );
    family(
        &mut r,
        "peer_clock_offset_seconds",
        "Each peer's clock minus this node's, measured by heartbeats (median; within half a \
         round trip). A node off by more than 1 s from most others stops",
        node.peer_clock_offsets()
            .into_iter()
            .map(|(peer, ms)| {
                (
                    PeerId {
                        peer: peer.to_string(),
                    },
                    ms / 1000.0,
                )
            })
            .collect(),
    );
    let steps = Family::<Step, Counter>::default();
    for (kind, n) in node.forwarded_steps() {
        steps.get_or_create(&Step { kind: kind.into() }).inc_by(n);
    }
    r.register(
        "forwarded_steps",
        "Steps of transactions sent by this node's backends to other nodes' leaseholders, by \
         kind (a statement that commits in the same message costs one round trip)",
        steps,
    );
    let (node_records, range_records, plans) = node.decision_counts();
    family(
        &mut r,
        "decisions_kept",
        "Two-phase commit decisions recorded here and not forgotten yet: this node's records \
         (kind=node), its range replicas' (kind=range), and the coordinators' plans kept \
         beside those (kind=plan)",
        vec![
            (
                Step {
                    kind: "node".into(),
                },
                node_records as f64,
            ),
            (
                Step {
                    kind: "range".into(),
                },
                range_records as f64,
            ),
            (
                Step {
                    kind: "plan".into(),
                },
                plans as f64,
            ),
        ],
    );
    // Raft: the meta group and every range replica here.
    let mut last = Vec::new();
    let mut commit = Vec::new();
    let mut applied = Vec::new();
    let mut leader = Vec::new();
    let mut lag = Vec::new();
    if let Some(m) = node.meta_metrics() {
        let g = Group {
            group: "meta".into(),
        };
        last.push((g.clone(), m.last_log_index.unwrap_or(0) as f64));
        applied.push((g.clone(), m.last_applied.map_or(0, |l| l.index) as f64));
        leader.push((
            g,
            f64::from(u8::from(m.current_leader == Some(node.node_id()))),
        ));
    }
    let progress = node.local_range_progress();
    for p in &progress {
        let g = Group {
            group: format!("range/{}", p.range_id),
        };
        last.push((g.clone(), p.last_log_index as f64));
        commit.push((g.clone(), p.committed_index as f64));
        applied.push((g.clone(), p.applied_index as f64));
        leader.push((g.clone(), f64::from(u8::from(p.raft_state == "leader"))));
        lag.push((g, p.committed_index.saturating_sub(p.applied_index) as f64));
    }
    family(
        &mut r,
        "raft_last_log_index",
        "Index of the last entry in the group's log here: entries proposed and appended",
        last,
    );
    family(
        &mut r,
        "raft_committed_index",
        "Highest entry known committed by a quorum",
        commit,
    );
    family(
        &mut r,
        "raft_applied_index",
        "Highest entry applied here (for a range: in this node's PostgreSQL)",
        applied,
    );
    family(
        &mut r,
        "raft_is_leader",
        "1 where this node leads the group",
        leader,
    );
    family(
        &mut r,
        "range_replication_lag_entries",
        "Committed entries of the range not applied to this node's PostgreSQL yet",
        lag,
    );
    gauge(
        &mut r,
        "range_replicas",
        "Range replicas on this node",
        progress.len() as f64,
    );
    if let LocalResponse::Ranges { ranges } = node.local_request(LocalRequest::Ranges).await {
        let me = node.node_id();
        gauge(
            &mut r,
            "range_leases",
            "Ranges whose lease this node holds",
            ranges.iter().filter(|x| x.lease_holder == Some(me)).count() as f64,
        );
        gauge(
            &mut r,
            "ranges",
            "Ranges in the cluster",
            ranges.len() as f64,
        );
    }
    gauge(
        &mut r,
        "sql_sessions",
        "SQL gateway sessions open",
        node.gateway_sessions() as f64,
    );
    if let Some(s) = node.gateway_stats() {
        r.register(
            "sql_statement_duration_seconds",
            "SQL gateway statements, from the client's message to ReadyForQuery",
            s.histogram.clone(),
        );
    }
    let mut out = String::new();
    if encode(&mut out, &r).is_err() {
        out = "# metrics could not be encoded\n".into();
    }
    out
}
