//! The link policy: when each outgoing frame reaches the wire.
//!
//! Today that is the simulated WAN: each frame waits half the region pair's RTT, so a request
//! and its response cost one RTT, as on a real network. Fault injection (drop, extra delay,
//! one-way partitions) will be decided here too, per frame, so that everything a test can do
//! to the network happens in one place.
//!
//! Delayed frames wait in a [`DelayLine`]: one thread per process that releases each frame at
//! its deadline. tokio's timer wheel has millisecond granularity and rounds deadlines up, which
//! measured here as +1 ms per hop (a "2 ms" intra-region RTT read 5.8 ms); a thread blocked in
//! a timed condition-variable wait wakes within tens of microseconds of its deadline.

use bytes::Bytes;
use mr_topology::RttMatrix;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashSet};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

#[derive(Clone)]
pub struct Link {
    my_region: String,
    matrix: Arc<RttMatrix>,
    warned: Arc<Mutex<HashSet<String>>>,
    delay_line: DelayLine,
}

impl Link {
    pub fn new(my_region: String, matrix: RttMatrix) -> Link {
        Link {
            my_region,
            matrix: Arc::new(matrix),
            warned: Arc::default(),
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

    /// Hands `frame` to a connection's writer after `delay`. A link's delay is constant, so
    /// frames on one link keep their order (the delay line breaks deadline ties by arrival).
    pub fn dispatch(&self, delay: Duration, frame: Bytes, writer: &UnboundedSender<Bytes>) {
        if delay.is_zero() {
            let _ = writer.send(frame);
        } else {
            self.delay_line
                .push(Instant::now() + delay, frame, writer.clone());
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
