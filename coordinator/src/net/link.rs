//! The link policy: whether and when each outgoing frame reaches the wire.
//!
//! Two things decide it, per frame, here and nowhere else, so that everything a test can do to
//! the network happens in one place:
//!
//! * the simulated WAN: each frame waits half the region pair's RTT, so a request and its
//!   response cost one RTT, as on a real network;
//! * injected faults ([`LinkFault`]), set at runtime per peer: a partition discards every
//!   frame, a drop rate discards frames at random, an extra delay adds to the WAN's. Faults act
//!   on what this node *sends*; a two-way partition is a rule on each side. The handshake that
//!   opens a connection is not subject to them: a partitioned link connects, then its
//!   requests time out, which is what callers of a partitioned peer see anyway.
//!
//! Delayed frames wait in a [`DelayLine`]: one thread per process that releases each frame at
//! its deadline. tokio's timer wheel has millisecond granularity and rounds deadlines up, which
//! measured here as +1 ms per hop (a "2 ms" intra-region RTT read 5.8 ms); a thread blocked in
//! a timed condition-variable wait wakes within tens of microseconds of its deadline.

use bytes::Bytes;
use mr_topology::RttMatrix;
use mr_wire::local::LinkFault;
use rand::Rng;
use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, HashSet};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

#[derive(Clone)]
pub struct Link {
    my_region: String,
    matrix: Arc<RttMatrix>,
    warned: Arc<Mutex<HashSet<String>>>,
    faults: Arc<RwLock<BTreeMap<u64, LinkFault>>>,
    delay_line: DelayLine,
}

/// One connection's outgoing path: the peer, the link's WAN delay, and ordering state.
pub struct Route {
    peer: Option<u64>,
    base: Duration,
    order: Mutex<RouteOrder>,
}

#[derive(Default)]
struct RouteOrder {
    /// Latest deadline handed out; later frames never get an earlier one (FIFO per connection
    /// even when a fault's delay shrinks).
    last: Option<Instant>,
    /// Once a frame has waited in the delay line, all later ones go through it too, so none can
    /// overtake a predecessor that is due but not yet released.
    delayed: bool,
}

impl Link {
    pub fn new(my_region: String, matrix: RttMatrix) -> Link {
        Link {
            my_region,
            matrix: Arc::new(matrix),
            warned: Arc::default(),
            faults: Arc::default(),
            delay_line: DelayLine::start(),
        }
    }

    /// One-way delay for frames sent to a peer in `peer_region`. A pair the matrix does not
    /// know gets no delay, with one warning per region.
    pub fn delay_to(&self, peer_region: &str) -> Duration {
        match self.matrix.one_way(&self.my_region, peer_region) {
            Some(d) => d,
            None => {
                if self
                    .warned
                    .lock()
                    .expect("warned lock")
                    .insert(peer_region.to_string())
                {
                    tracing::warn!(
                        from = %self.my_region,
                        to = %peer_region,
                        "the latency matrix has no entry for this region pair; not delaying"
                    );
                }
                Duration::ZERO
            }
        }
    }

    /// The route for a connection to `peer` (unknown for a node that has not joined yet).
    pub fn route(&self, peer: Option<u64>, peer_region: &str) -> Route {
        Route {
            peer,
            base: self.delay_to(peer_region),
            order: Mutex::default(),
        }
    }

    /// Sets (`Some`) or clears (`None`) the fault on the links to `peers`.
    pub fn set_faults(&self, peers: &[u64], fault: Option<LinkFault>) {
        let mut faults = self.faults.write().expect("faults lock");
        for p in peers {
            match &fault {
                Some(f) => faults.insert(*p, f.clone()),
                None => faults.remove(p),
            };
        }
    }

    pub fn clear_faults(&self) {
        self.faults.write().expect("faults lock").clear();
    }

    pub fn faults(&self) -> Vec<(u64, LinkFault)> {
        let faults = self.faults.read().expect("faults lock");
        faults.iter().map(|(p, f)| (*p, f.clone())).collect()
    }

    /// Hands `frame` to the connection's writer when the link says so, or discards it.
    pub fn dispatch(&self, route: &Route, frame: Bytes, writer: &UnboundedSender<Bytes>) {
        let fault = route
            .peer
            .and_then(|p| self.faults.read().expect("faults lock").get(&p).cloned());
        let mut delay = route.base;
        if let Some(f) = fault {
            if f.partitioned || (f.drop_rate > 0.0 && rand::rng().random_bool(f.drop_rate)) {
                return;
            }
            delay += Duration::from_secs_f64(f.extra_delay_ms / 1000.0);
        }
        let now = Instant::now();
        let mut order = route.order.lock().expect("route lock");
        let deadline = order.last.map_or(now + delay, |last| last.max(now + delay));
        order.last = Some(deadline);
        if delay.is_zero() && !order.delayed {
            let _ = writer.send(frame);
        } else {
            order.delayed = true;
            // Pushed while holding the route lock, so pushes on one route keep their order.
            self.delay_line.push(deadline, frame, writer.clone());
        }
    }
}

/// Frames waiting for their deadline, released by one dedicated thread.
#[derive(Clone)]
pub struct DelayLine {
    shared: Arc<(Mutex<Queue>, Condvar)>,
}

#[derive(Default)]
struct Queue {
    heap: BinaryHeap<Pending>,
    seq: u64,
}

struct Pending {
    deadline: Instant,
    seq: u64,
    frame: Bytes,
    to: UnboundedSender<Bytes>,
}

// Min-heap on (deadline, seq): the earliest deadline first, ties in arrival order.
impl Ord for Pending {
    fn cmp(&self, other: &Self) -> Ordering {
        (other.deadline, other.seq).cmp(&(self.deadline, self.seq))
    }
}
impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        (self.deadline, self.seq) == (other.deadline, other.seq)
    }
}
impl Eq for Pending {}

impl DelayLine {
    pub fn start() -> DelayLine {
        let line = DelayLine {
            shared: Arc::new((Mutex::new(Queue::default()), Condvar::new())),
        };
        let shared = line.shared.clone();
        std::thread::Builder::new()
            .name("pgmr-delay-line".into())
            .spawn(move || release_loop(&shared))
            .expect("spawn the delay-line thread");
        line
    }

    pub fn push(&self, deadline: Instant, frame: Bytes, to: UnboundedSender<Bytes>) {
        let (lock, cv) = &*self.shared;
        let mut q = lock.lock().expect("delay line lock");
        q.seq += 1;
        let seq = q.seq;
        let wake = q.heap.peek().is_none_or(|p| deadline < p.deadline);
        q.heap.push(Pending {
            deadline,
            seq,
            frame,
            to,
        });
        if wake {
            cv.notify_one();
        }
    }
}

fn release_loop(shared: &(Mutex<Queue>, Condvar)) {
    let (lock, cv) = shared;
    let mut q = lock.lock().expect("delay line lock");
    loop {
        let now = Instant::now();
        match q.heap.peek() {
            None => q = cv.wait(q).expect("delay line lock"),
            Some(p) if p.deadline <= now => {
                let p = q.heap.pop().expect("peeked");
                // Unbounded send never blocks; a closed writer just drops the frame.
                let _ = p.to.send(p.frame);
            }
            Some(p) => {
                let wait = p.deadline - now;
                q = cv.wait_timeout(q, wait).expect("delay line lock").0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link() -> Link {
        let mut m = RttMatrix::zero();
        m.set("a", "b", 20.0);
        Link::new("a".into(), m)
    }

    async fn drain(
        rx: &mut tokio::sync::mpsc::UnboundedReceiver<Bytes>,
        wait: Duration,
    ) -> Vec<Bytes> {
        let mut got = Vec::new();
        while let Ok(Some(f)) = tokio::time::timeout(wait, rx.recv()).await {
            got.push(f);
        }
        got
    }

    #[tokio::test]
    async fn a_partitioned_link_discards_everything_until_healed() {
        let link = link();
        let route = link.route(Some(2), "b");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        link.set_faults(
            &[2],
            Some(LinkFault {
                partitioned: true,
                ..LinkFault::default()
            }),
        );
        link.dispatch(&route, Bytes::from_static(b"lost"), &tx);
        assert!(drain(&mut rx, Duration::from_millis(50)).await.is_empty());
        link.set_faults(&[2], None);
        link.dispatch(&route, Bytes::from_static(b"kept"), &tx);
        assert_eq!(
            drain(&mut rx, Duration::from_millis(100)).await,
            vec![Bytes::from_static(b"kept")]
        );
        let other = link.route(Some(3), "b");
        link.set_faults(
            &[2],
            Some(LinkFault {
                partitioned: true,
                ..LinkFault::default()
            }),
        );
        link.dispatch(&other, Bytes::from_static(b"other peer"), &tx);
        assert_eq!(
            drain(&mut rx, Duration::from_millis(100)).await.len(),
            1,
            "faults are per peer"
        );
    }

    #[tokio::test]
    async fn a_drop_rate_discards_about_that_share_of_frames() {
        let link = Link::new("a".into(), RttMatrix::zero());
        let route = link.route(Some(2), "a");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        link.set_faults(
            &[2],
            Some(LinkFault {
                drop_rate: 0.5,
                ..LinkFault::default()
            }),
        );
        for _ in 0..4000 {
            link.dispatch(&route, Bytes::from_static(b"x"), &tx);
        }
        let got = drain(&mut rx, Duration::from_millis(50)).await.len();
        assert!(
            (1700..=2300).contains(&got),
            "kept {got} of 4000 at a drop rate of 0.5"
        );
    }

    #[tokio::test]
    async fn extra_delay_adds_to_the_wan_and_order_survives_it_shrinking() {
        let link = link();
        let route = link.route(Some(2), "b");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        link.set_faults(
            &[2],
            Some(LinkFault {
                extra_delay_ms: 60.0,
                ..LinkFault::default()
            }),
        );
        let start = Instant::now();
        link.dispatch(&route, Bytes::from_static(b"1"), &tx);
        link.set_faults(&[2], None);
        link.dispatch(&route, Bytes::from_static(b"2"), &tx);
        assert_eq!(rx.recv().await.unwrap(), Bytes::from_static(b"1"));
        assert!(
            start.elapsed() >= Duration::from_millis(70),
            "10 ms WAN + 60 ms extra"
        );
        assert_eq!(
            rx.recv().await.unwrap(),
            Bytes::from_static(b"2"),
            "2 did not overtake 1"
        );
    }

    #[tokio::test]
    async fn frames_arrive_after_their_delay_in_order_with_sub_millisecond_precision() {
        let line = DelayLine::start();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let start = Instant::now();
        for i in 0..20u8 {
            line.push(
                start + Duration::from_millis(3),
                Bytes::from(vec![i]),
                tx.clone(),
            );
        }
        line.push(
            start + Duration::from_millis(1),
            Bytes::from_static(b"early"),
            tx.clone(),
        );
        assert_eq!(rx.recv().await.unwrap(), Bytes::from_static(b"early"));
        for i in 0..20u8 {
            assert_eq!(
                rx.recv().await.unwrap(),
                Bytes::from(vec![i]),
                "FIFO among equal deadlines"
            );
        }
        let late = start.elapsed();
        assert!(late >= Duration::from_millis(3));
        // Generous bound for a loaded CI machine; tokio's timer alone would often exceed 4 ms.
        assert!(late < Duration::from_millis(30), "released after {late:?}");
    }
}
