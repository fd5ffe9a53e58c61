//! SQL statement latencies of the gateway, over time: what the console's "SQL latency by
//! region" chart plots and `/metrics` exports.
//!
//! Each 10-second window keeps a histogram with geometric buckets (0.05 ms to ~2 min, 1.4×
//! apart), not samples: histograms of several nodes add up exactly, so a region's p99 is
//! computed over all of its nodes' statements instead of averaged from each node's p99.

use mr_wire::peer::SqlWindow;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

/// Bucket `i` holds latencies up to `FIRST_BOUND_MS * GROWTH^i`; the last one everything above.
pub const BUCKETS: usize = 44;
const FIRST_BOUND_MS: f64 = 0.05;
const GROWTH: f64 = 1.4;
/// Window length and how many are kept (30 minutes).
pub const WINDOW_MS: u64 = 10_000;
const KEEP: usize = 180;

/// The upper bound (ms) of bucket `i`.
pub fn bound_ms(i: usize) -> f64 {
    FIRST_BOUND_MS * GROWTH.powi(i as i32)
}

fn bucket_of(ms: f64) -> usize {
    (0..BUCKETS - 1)
        .find(|&i| ms <= bound_ms(i))
        .unwrap_or(BUCKETS - 1)
}

/// The `q` quantile (0..=1) of a bucketed histogram, interpolated geometrically inside its
/// bucket; `None` without samples.
pub fn quantile(counts: &[u32], q: f64) -> Option<f64> {
    let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
    if total == 0 {
        return None;
    }
    let rank = (q.clamp(0.0, 1.0) * total as f64).max(1.0);
    let mut seen = 0u64;
    for (i, &c) in counts.iter().enumerate() {
        if c == 0 {
            continue;
        }
        let before = seen as f64;
        seen += u64::from(c);
        if seen as f64 >= rank {
            let low = if i == 0 { 0.0 } else { bound_ms(i - 1) };
            let high = bound_ms(i);
            let frac = ((rank - before) / f64::from(c)).clamp(0.0, 1.0);
            return Some(if low == 0.0 {
                high * frac
            } else {
                low * (high / low).powf(frac)
            });
        }
    }
    Some(bound_ms(BUCKETS - 1))
}

/// Adds `b` into `a`, bucket by bucket.
pub fn merge(a: &mut Vec<u32>, b: &[u32]) {
    if a.len() < b.len() {
        a.resize(b.len(), 0);
    }
    for (x, y) in a.iter_mut().zip(b) {
        *x = x.saturating_add(*y);
    }
}

/// The gateway's statement latencies: the last 30 minutes in windows, and since start as a
/// Prometheus histogram.
pub struct SqlStats {
    windows: Mutex<VecDeque<SqlWindow>>,
    pub histogram: prometheus_client::metrics::histogram::Histogram,
}

impl Default for SqlStats {
    fn default() -> Self {
        SqlStats {
            windows: Mutex::default(),
            // 0.25 ms to ~2 min.
            histogram: prometheus_client::metrics::histogram::Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.000_25, 2.0, 20),
            ),
        }
    }
}

impl SqlStats {
    /// Records one statement that took `took`, finished at `now_ms` (Unix ms).
    pub fn record(&self, took: Duration, now_ms: u64) {
        self.histogram.observe(took.as_secs_f64());
        let start = now_ms - now_ms % WINDOW_MS;
        let mut w = self.windows.lock().expect("stats lock");
        if w.back().is_none_or(|b| b.start_ms != start) {
            w.push_back(SqlWindow {
                start_ms: start,
                counts: vec![0; BUCKETS],
            });
            while w.len() > KEEP {
                w.pop_front();
            }
        }
        let b = w.back_mut().expect("just pushed");
        let i = bucket_of(took.as_secs_f64() * 1000.0);
        b.counts[i] = b.counts[i].saturating_add(1);
    }

    /// Every kept window, oldest first.
    pub fn windows(&self) -> Vec<SqlWindow> {
        self.windows
            .lock()
            .expect("stats lock")
            .iter()
            .cloned()
            .collect()
    }

    /// Every statement recorded in the kept windows, as one histogram.
    #[cfg(test)]
    pub fn total(&self) -> Vec<u32> {
        let mut all = vec![0; BUCKETS];
        for w in self.windows.lock().expect("stats lock").iter() {
            merge(&mut all, &w.counts);
        }
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_fall_inside_the_bucket_of_the_ranked_sample() {
        let s = SqlStats::default();
        for ms in [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 100.0] {
            s.record(Duration::from_secs_f64(ms / 1000.0), 1_000_000);
        }
        let t = s.total();
        let p50 = quantile(&t, 0.5).unwrap();
        let p99 = quantile(&t, 0.99).unwrap();
        assert!((0.7..=1.0).contains(&p50), "{p50}");
        assert!((70.0..=140.0).contains(&p99), "{p99}");
        assert_eq!(quantile(&[0; BUCKETS], 0.5), None);
    }

    #[test]
    fn windows_roll_over_and_merge_exactly() {
        let s = SqlStats::default();
        s.record(Duration::from_millis(5), 10_000);
        s.record(Duration::from_millis(5), 19_999);
        s.record(Duration::from_millis(5), 20_000);
        let w = s.windows();
        assert_eq!(w.len(), 2);
        assert_eq!(w[0].counts.iter().sum::<u32>(), 2);
        let mut m = w[0].counts.clone();
        merge(&mut m, &w[1].counts);
        assert_eq!(m.iter().sum::<u32>(), 3);
    }
}
