//! Who is in the cluster, who is alive, and how far apart everyone is.
//!
//! This is the network's view, kept by gossip: who to probe, at which address, and the
//! measured RTTs. The cluster's record of its nodes (ids, liveness, decommissioning) is the
//! meta Raft group's ([`crate::meta`]); gossip only finds peers and measures the WAN. Every
//! heartbeat and its ack carry the sender's descriptor, every node it knows, and the RTTs it
//! measured. A node's own
//! descriptor is authoritative about itself; second-hand reports only introduce nodes we did
//! not know. Each node heartbeats every other, so all views converge within a few intervals.

use mr_topology::Locality;
use mr_wire::local::{PeerStatus, RttRow};
use mr_wire::peer::{Gossip, MeasuredRtt, NodeDescriptor};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often each node probes each other node.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(500);
/// A peer heard from within this window is live.
pub const LIVE_WINDOW: Duration = Duration::from_secs(3);
/// A peer silent for longer than this is dead and leaves `cluster_regions()`.
pub const DEAD_AFTER: Duration = Duration::from_secs(10);
/// RTT is the median of this many recent samples: robust to one slow scheduling hiccup.
const SAMPLES: usize = 9;
/// How far this node's clock may be from the others' before it stops. Liveness compares the
/// meta leader's time of a node's last beat with the reader's clock (suspect after 4 s), and
/// the two-phase commit's stale rule and presumed aborts compare times taken on different
/// nodes (30 s of slack, ARCHITECTURE.md §8.5): a second keeps both well inside. CockroachDB
/// stops a node at 80 % of `--max-offset` (500 ms), which its HLC needs and ours does not
/// yet. Delays cannot make a node look off: a measurement only counts beyond its uncertainty.
pub const MAX_CLOCK_OFFSET_MS: f64 = 1_000.0;

struct Peer {
    desc: NodeDescriptor,
    learned: Instant,
    last_heard: Option<Instant>,
    samples: VecDeque<f64>,
    /// Recent measurements of the peer's clock minus ours, each with its uncertainty (ms).
    offsets: VecDeque<(f64, f64)>,
    reported: Vec<MeasuredRtt>,
    reported_at: Option<Instant>,
}

impl Peer {
    fn new(desc: NodeDescriptor, now: Instant) -> Peer {
        Peer {
            desc,
            learned: now,
            last_heard: None,
            samples: VecDeque::new(),
            offsets: VecDeque::new(),
            reported: Vec::new(),
            reported_at: None,
        }
    }

    fn live(&self, now: Instant) -> bool {
        self.last_heard
            .is_some_and(|t| now.duration_since(t) < LIVE_WINDOW)
    }

    /// Not yet given up on: heard recently, or learned recently and not yet probed long enough.
    fn member(&self, now: Instant) -> bool {
        let since = self.last_heard.unwrap_or(self.learned);
        now.duration_since(since) < DEAD_AFTER
    }

    fn rtt(&self) -> Option<f64> {
        median(self.samples.iter().copied())
    }

    /// The median measured offset of the peer's clock from ours, with the largest
    /// uncertainty among the samples (ms).
    fn clock_offset(&self) -> Option<(f64, f64)> {
        let offset = median(self.offsets.iter().map(|(o, _)| *o))?;
        let uncertainty = self.offsets.iter().map(|(_, u)| *u).fold(0.0, f64::max);
        Some((offset, uncertainty))
    }
}

/// Whether this node's clock is too far from the cluster's: more than `max_ms` (beyond each
/// measurement's uncertainty) from so many peers that fewer than half of all the measured
/// clocks, this node's own included, agree with it. In a cluster of two neither can tell
/// which clock is wrong, and neither stops; with one node off in three or more, only that
/// node stops. `offsets`: each live peer's (offset, uncertainty), in ms.
pub fn clock_out_of_bounds(offsets: &[(f64, f64)], max_ms: f64) -> bool {
    let off = offsets.iter().filter(|(o, u)| o.abs() - u > max_ms).count();
    let agreeing = offsets.len() - off + 1;
    agreeing * 2 < offsets.len() + 1
}

fn median(it: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = it.collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Some(v[v.len() / 2])
}

pub struct Membership {
    state: Mutex<State>,
}

struct State {
    me: NodeDescriptor,
    peers: BTreeMap<u64, Peer>,
}

impl Membership {
    pub fn new(me: NodeDescriptor) -> Membership {
        Membership {
            state: Mutex::new(State {
                me,
                peers: BTreeMap::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("membership lock")
    }

    pub fn me(&self) -> NodeDescriptor {
        self.lock().me.clone()
    }

    /// What this node tells others.
    pub fn gossip(&self) -> Gossip {
        let s = self.lock();
        let now = Instant::now();
        let mut members = vec![s.me.clone()];
        members.extend(
            s.peers
                .values()
                .filter(|p| p.member(now))
                .map(|p| p.desc.clone()),
        );
        let rtts = s
            .peers
            .values()
            .filter_map(|p| {
                p.rtt().map(|rtt_ms| MeasuredRtt {
                    to_node: p.desc.node_id,
                    rtt_ms,
                })
            })
            .collect();
        Gossip {
            from: s.me.clone(),
            members,
            rtts,
            now_ms: Some(crate::node::now_ms()),
        }
    }

    /// Adds nodes learned from a join response or second-hand gossip.
    pub fn learn(&self, members: &[NodeDescriptor]) {
        let mut s = self.lock();
        let now = Instant::now();
        let me = s.me.node_id;
        for d in members {
            if d.node_id != me && Locality::parse(&d.locality).is_ok() {
                s.peers
                    .entry(d.node_id)
                    .or_insert_with(|| Peer::new(d.clone(), now));
            }
        }
    }

    /// Takes in gossip that came straight from its sender (a heartbeat or its ack): the
    /// sender is alive now and its self-description replaces what we had.
    pub fn heard_from(&self, g: &Gossip) {
        if Locality::parse(&g.from.locality).is_err() {
            return;
        }
        {
            let mut s = self.lock();
            let now = Instant::now();
            if g.from.node_id != s.me.node_id {
                let p = s
                    .peers
                    .entry(g.from.node_id)
                    .or_insert_with(|| Peer::new(g.from.clone(), now));
                p.desc = g.from.clone();
                p.last_heard = Some(now);
                p.reported = g.rtts.clone();
                p.reported_at = Some(now);
            }
        }
        self.learn(&g.members);
    }

    pub fn record_rtt(&self, node_id: u64, rtt: Duration) {
        let mut s = self.lock();
        if let Some(p) = s.peers.get_mut(&node_id) {
            p.samples.push_back(rtt.as_secs_f64() * 1000.0);
            while p.samples.len() > SAMPLES {
                p.samples.pop_front();
            }
        }
    }

    /// A measurement of `node_id`'s clock minus ours, within `uncertainty_ms`.
    pub fn record_offset(&self, node_id: u64, offset_ms: f64, uncertainty_ms: f64) {
        let mut s = self.lock();
        if let Some(p) = s.peers.get_mut(&node_id) {
            p.offsets.push_back((offset_ms, uncertainty_ms));
            while p.offsets.len() > SAMPLES {
                p.offsets.pop_front();
            }
        }
    }

    /// Each live peer's measured clock offset from ours and its uncertainty (ms).
    pub fn clock_offsets(&self) -> Vec<(u64, f64, f64)> {
        let s = self.lock();
        let now = Instant::now();
        s.peers
            .values()
            .filter(|p| p.live(now))
            .filter_map(|p| p.clock_offset().map(|(o, u)| (p.desc.node_id, o, u)))
            .collect()
    }

    /// (node id, address) of every known peer. Dead peers are probed too: they must be able
    /// to come back.
    pub fn probe_targets(&self) -> Vec<(u64, String)> {
        let s = self.lock();
        s.peers
            .values()
            .map(|p| (p.desc.node_id, p.desc.rpc_addr.clone()))
            .collect()
    }

    pub fn knows_addr(&self, addr: &str) -> bool {
        let s = self.lock();
        s.me.rpc_addr == addr || s.peers.values().any(|p| p.desc.rpc_addr == addr)
    }

    /// Members (live or not yet given up on), this node included, sorted by node id.
    pub fn members(&self) -> Vec<NodeDescriptor> {
        let s = self.lock();
        let now = Instant::now();
        let mut v = vec![s.me.clone()];
        v.extend(
            s.peers
                .values()
                .filter(|p| p.member(now))
                .map(|p| p.desc.clone()),
        );
        v.sort_by_key(|d| d.node_id);
        v
    }

    /// Every ordered pair of members with the RTT the first measured to the second: this
    /// node's own measurements, and the latest each peer reported about itself.
    pub fn rtt_rows(&self) -> Vec<RttRow> {
        let s = self.lock();
        let now = Instant::now();
        struct View<'a> {
            desc: &'a NodeDescriptor,
            loc: Locality,
            rtts: BTreeMap<u64, f64>,
            age_ms: u64,
        }
        let mut views: Vec<View<'_>> = Vec::new();
        if let Ok(loc) = Locality::parse(&s.me.locality) {
            let rtts = s
                .peers
                .values()
                .filter_map(|p| p.rtt().map(|r| (p.desc.node_id, r)))
                .collect();
            views.push(View {
                desc: &s.me,
                loc,
                rtts,
                age_ms: 0,
            });
        }
        for p in s.peers.values().filter(|p| p.member(now)) {
            if let Ok(loc) = Locality::parse(&p.desc.locality) {
                let rtts = p.reported.iter().map(|m| (m.to_node, m.rtt_ms)).collect();
                let age_ms = p
                    .reported_at
                    .map_or(u64::MAX, |t| now.duration_since(t).as_millis() as u64);
                views.push(View {
                    desc: &p.desc,
                    loc,
                    rtts,
                    age_ms,
                });
            }
        }
        views.sort_by_key(|v| v.desc.node_id);
        let mut rows = Vec::new();
        for from in &views {
            for to in &views {
                if from.desc.node_id == to.desc.node_id {
                    continue;
                }
                rows.push(RttRow {
                    from_node: from.desc.node_id,
                    from_region: from.loc.region().to_string(),
                    from_zone: from.loc.zone().map(str::to_string),
                    to_node: to.desc.node_id,
                    to_region: to.loc.region().to_string(),
                    to_zone: to.loc.zone().map(str::to_string),
                    rtt_ms: from.rtts.get(&to.desc.node_id).copied(),
                    age_ms: from.age_ms,
                });
            }
        }
        rows
    }

    pub fn peer_status(&self) -> Vec<PeerStatus> {
        let s = self.lock();
        let now = Instant::now();
        s.peers
            .values()
            .map(|p| PeerStatus {
                node_id: p.desc.node_id,
                locality: p.desc.locality.clone(),
                rpc_addr: p.desc.rpc_addr.clone(),
                sql_addr: p.desc.sql_addr.clone(),
                live: p.live(now),
                last_heard_ms_ago: p
                    .last_heard
                    .map(|t| now.duration_since(t).as_millis() as u64),
                rtt_ms: p.rtt(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_clock_off_from_most_of_the_cluster_is_out_of_bounds() {
        let max = MAX_CLOCK_OFFSET_MS;
        // Alone, or with one peer: nothing tells which clock is wrong.
        assert!(!clock_out_of_bounds(&[], max));
        assert!(!clock_out_of_bounds(&[(40_000.0, 1.0)], max));
        // Three nodes: this one 40 s behind both others stops; a peer 40 s ahead does not
        // stop this one.
        assert!(clock_out_of_bounds(
            &[(40_000.0, 1.0), (40_000.0, 1.0)],
            max
        ));
        assert!(!clock_out_of_bounds(&[(40_000.0, 1.0), (3.0, 1.0)], max));
        // Within the measurement's uncertainty (half a round trip) is not off; beyond it is.
        assert!(!clock_out_of_bounds(
            &[(2_500.0, 2_000.0), (-2_500.0, 2_000.0)],
            max
        ));
        assert!(clock_out_of_bounds(
            &[(3_500.0, 2_000.0), (-3_500.0, 2_000.0)],
            max
        ));
        // Five nodes: off from three of four stops, from two of four does not.
        let three = [
            (-9_000.0, 1.0),
            (-9_000.0, 1.0),
            (-9_000.0, 1.0),
            (0.0, 1.0),
        ];
        assert!(clock_out_of_bounds(&three, max));
        let two = [(-9_000.0, 1.0), (-9_000.0, 1.0), (0.0, 1.0), (0.0, 1.0)];
        assert!(!clock_out_of_bounds(&two, max));
    }

    fn desc(id: u64, region: &str) -> NodeDescriptor {
        NodeDescriptor {
            node_id: id,
            rpc_addr: format!("127.0.0.1:{}", 9000 + id),
            sql_addr: format!("127.0.0.1:{}", 5000 + id),
            locality: format!("region={region},zone={region}-a"),
            pgmr_version: "t".into(),
        }
    }

    #[test]
    fn gossip_spreads_members() {
        let a = Membership::new(desc(1, "east"));
        let b = Membership::new(desc(2, "west"));
        let c = Membership::new(desc(3, "eu"));
        b.heard_from(&c.gossip());
        a.heard_from(&b.gossip());
        let ids: Vec<u64> = a.members().iter().map(|d| d.node_id).collect();
        assert_eq!(ids, vec![1, 2, 3], "a learned c through b");
    }

    #[test]
    fn rtt_is_the_median_of_recent_samples_and_rows_cover_every_pair() {
        let a = Membership::new(desc(1, "east"));
        a.heard_from(&Membership::new(desc(2, "west")).gossip());
        for ms in [60, 61, 500, 62, 63] {
            a.record_rtt(2, Duration::from_millis(ms));
        }
        let rows = a.rtt_rows();
        assert_eq!(rows.len(), 2);
        let ab = rows.iter().find(|r| r.from_node == 1).unwrap();
        assert_eq!(ab.rtt_ms, Some(62.0));
        let ba = rows.iter().find(|r| r.from_node == 2).unwrap();
        assert_eq!(ba.rtt_ms, None, "node 2 has not reported yet");
    }

    #[test]
    fn a_nodes_own_descriptor_replaces_second_hand_reports() {
        let a = Membership::new(desc(1, "east"));
        let mut stale = desc(2, "west");
        stale.rpc_addr = "127.0.0.1:1".into();
        a.learn(&[stale]);
        a.heard_from(&Membership::new(desc(2, "west")).gossip());
        let b = a.members().into_iter().find(|d| d.node_id == 2).unwrap();
        assert_eq!(b.rpc_addr, "127.0.0.1:9002");
    }
}
