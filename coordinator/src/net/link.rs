//! The link policy: how long each outgoing frame waits before it reaches the wire.
//!
//! Today that is the simulated WAN: half the region pair's RTT, so a request and its response
//! cost one RTT. Fault injection (drop, extra delay, one-way partitions) will be decided here
//! too, per frame, so that everything a test can do to the network happens in one place.

use mr_topology::RttMatrix;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Clone)]
pub struct Link {
    my_region: String,
    matrix: Arc<RttMatrix>,
    warned: Arc<Mutex<HashSet<String>>>,
}

impl Link {
    pub fn new(my_region: String, matrix: RttMatrix) -> Link {
        Link {
            my_region,
            matrix: Arc::new(matrix),
            warned: Arc::default(),
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
}
