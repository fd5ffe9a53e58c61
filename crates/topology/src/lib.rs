//! Where nodes are and how far apart they are.
//!
//! This crate must never depend on pgrx, tokio or any I/O: the extension (inside a PostgreSQL
//! backend) and `pgmr` (a tokio process) both parse localities and latency matrices, and they
//! must agree byte for byte. Everything here is plain data and pure functions.

mod demo;
mod latency;
mod locality;

pub use demo::{demo_layout, DemoNode, GLOBAL_REGIONS};
pub use latency::{LatencyError, RttMatrix};
pub use locality::{Locality, LocalityError};
