//! Region-pair round-trip times for the simulated WAN.
//!
//! The kernel here has no `tc netem`, so pgmr delays every inter-node message itself. Each side
//! of a link delays what it sends by half the pair's RTT, so a request/response pair costs one
//! full RTT, as on a real network.
//!
//! File format, one entry per line, `#` starts a comment:
//!
//! ```text
//! intra 2                      # default RTT between two nodes of the same region (ms)
//! us-east1 us-west1 63         # symmetric: us-west1 us-east1 is the same pair
//! us-east1 us-east1 1.5        # overrides `intra` for one region
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

/// A parse error, with the 1-based line it was found on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LatencyError {
    #[error("line {line}: expected \"REGION REGION RTT_MS\" or \"intra RTT_MS\", found {found:?}")]
    Syntax { line: usize, found: String },
    #[error("line {line}: {value:?} is not a round-trip time in milliseconds (a number from 0 to 60000)")]
    BadRtt { line: usize, value: String },
    #[error("line {line}: the pair {a}/{b} is given twice")]
    Duplicate { line: usize, a: String, b: String },
}

/// Symmetric region-pair RTTs in milliseconds, plus a default for pairs inside one region.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RttMatrix {
    pairs: BTreeMap<(String, String), f64>,
    intra_ms: f64,
}

fn key(a: &str, b: &str) -> (String, String) {
    if a <= b {
        (a.to_string(), b.to_string())
    } else {
        (b.to_string(), a.to_string())
    }
}

fn parse_ms(line: usize, s: &str) -> Result<f64, LatencyError> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=60_000.0).contains(&v) => Ok(v),
        _ => Err(LatencyError::BadRtt {
            line,
            value: s.to_string(),
        }),
    }
}

impl RttMatrix {
    /// No simulated latency at all.
    pub fn zero() -> RttMatrix {
        RttMatrix::default()
    }

    /// The `global` preset: the MovR tutorial's three regions with the round-trip times of
    /// Table 1 of the CockroachDB multi-region paper (SIGMOD 2022), and ~2 ms inside a region.
    pub fn global() -> RttMatrix {
        let mut m = RttMatrix {
            intra_ms: 2.0,
            ..RttMatrix::default()
        };
        m.set("us-east1", "us-west1", 63.0);
        m.set("us-east1", "europe-west1", 87.0);
        m.set("us-west1", "europe-west1", 132.0);
        m
    }

    pub fn parse(text: &str) -> Result<RttMatrix, LatencyError> {
        let mut m = RttMatrix::default();
        let mut intra_seen = false;
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let content = raw.split('#').next().unwrap_or("").trim();
            if content.is_empty() {
                continue;
            }
            let words: Vec<&str> = content.split_whitespace().collect();
            match words.as_slice() {
                ["intra", ms] => {
                    if intra_seen {
                        return Err(LatencyError::Duplicate {
                            line,
                            a: "intra".into(),
                            b: "intra".into(),
                        });
                    }
                    intra_seen = true;
                    m.intra_ms = parse_ms(line, ms)?;
                }
                [a, b, ms] => {
                    let ms = parse_ms(line, ms)?;
                    if m.pairs.insert(key(a, b), ms).is_some() {
                        return Err(LatencyError::Duplicate {
                            line,
                            a: a.to_string(),
                            b: b.to_string(),
                        });
                    }
                }
                _ => {
                    return Err(LatencyError::Syntax {
                        line,
                        found: content.to_string(),
                    })
                }
            }
        }
        Ok(m)
    }

    pub fn set(&mut self, a: &str, b: &str, rtt_ms: f64) {
        self.pairs.insert(key(a, b), rtt_ms);
    }

    /// The configured RTT between two regions; `None` when the matrix says nothing about an
    /// inter-region pair (the caller decides whether that is zero or an error).
    pub fn rtt_ms(&self, a: &str, b: &str) -> Option<f64> {
        match self.pairs.get(&key(a, b)) {
            Some(v) => Some(*v),
            None if a == b => Some(self.intra_ms),
            None => None,
        }
    }

    /// The delay a sender in region `from` applies to each message to region `to`: half the RTT.
    pub fn one_way(&self, from: &str, to: &str) -> Option<Duration> {
        self.rtt_ms(from, to)
            .map(|ms| Duration::from_secs_f64(ms / 2000.0))
    }

    /// True if the matrix delays nothing (then pgmr skips the delay queue entirely).
    pub fn is_zero(&self) -> bool {
        self.intra_ms == 0.0 && self.pairs.values().all(|v| *v == 0.0)
    }

    /// Renders the matrix in the file format `parse` reads.
    pub fn to_text(&self) -> String {
        let mut out = format!("intra {}\n", self.intra_ms);
        for ((a, b), ms) in &self.pairs {
            out.push_str(&format!("{a} {b} {ms}\n"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn global_preset_has_the_papers_table_1_rtts() {
        let m = RttMatrix::global();
        assert_eq!(m.rtt_ms("us-east1", "us-west1"), Some(63.0));
        assert_eq!(m.rtt_ms("europe-west1", "us-east1"), Some(87.0));
        assert_eq!(m.rtt_ms("us-west1", "europe-west1"), Some(132.0));
        assert_eq!(m.rtt_ms("us-west1", "us-west1"), Some(2.0));
        assert_eq!(
            m.one_way("us-east1", "us-west1"),
            Some(Duration::from_micros(31_500))
        );
    }

    #[test]
    fn file_format_is_symmetric_with_intra_default_and_overrides() {
        let m = RttMatrix::parse("# test\nintra 3\na b 40 # comment\nc a 80\nb b 0.5\n").unwrap();
        assert_eq!(m.rtt_ms("b", "a"), Some(40.0));
        assert_eq!(m.rtt_ms("a", "c"), Some(80.0));
        assert_eq!(m.rtt_ms("a", "a"), Some(3.0));
        assert_eq!(m.rtt_ms("b", "b"), Some(0.5));
        assert_eq!(m.rtt_ms("b", "c"), None);
    }

    #[test]
    fn intra_defaults_to_zero_when_absent() {
        let m = RttMatrix::parse("a b 10").unwrap();
        assert_eq!(m.rtt_ms("a", "a"), Some(0.0));
        assert!(!m.is_zero());
        assert!(RttMatrix::zero().is_zero());
    }

    #[test]
    fn round_trips_through_text() {
        let m = RttMatrix::global();
        assert_eq!(RttMatrix::parse(&m.to_text()).unwrap(), m);
    }

    #[test]
    fn errors_name_the_line() {
        assert_eq!(
            RttMatrix::parse("a b\n"),
            Err(LatencyError::Syntax {
                line: 1,
                found: "a b".into()
            })
        );
        assert_eq!(
            RttMatrix::parse("\na b -1"),
            Err(LatencyError::BadRtt {
                line: 2,
                value: "-1".into()
            })
        );
        assert_eq!(
            RttMatrix::parse("a b NaN"),
            Err(LatencyError::BadRtt {
                line: 1,
                value: "NaN".into()
            })
        );
        assert_eq!(
            RttMatrix::parse("a b 1\nb a 2"),
            Err(LatencyError::Duplicate {
                line: 2,
                a: "b".into(),
                b: "a".into()
            })
        );
        assert!(matches!(
            RttMatrix::parse("intra 1\nintra 2"),
            Err(LatencyError::Duplicate { .. })
        ));
    }
}
