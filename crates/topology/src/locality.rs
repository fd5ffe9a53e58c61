//! A node's locality: ordered `key=value` tiers, most general first, as CockroachDB's
//! `--locality region=us-east1,zone=us-east1-b`.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Why a locality string was refused. Each variant carries enough to print a hint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LocalityError {
    #[error("locality is empty")]
    Empty,
    #[error("locality tier \"{0}\" is not of the form key=value")]
    NotKeyValue(String),
    #[error("locality has an empty tier (two commas in a row, or a trailing comma)")]
    EmptyTier,
    #[error("locality tier \"{0}\" has an empty key or value")]
    EmptyPart(String),
    #[error("locality tier \"{tier}\" contains the character \"{ch}\", which is not allowed")]
    BadChar { tier: String, ch: char },
    #[error("locality key \"{0}\" appears more than once")]
    DuplicateKey(String),
    #[error("locality has no \"region\" tier")]
    NoRegion,
}

impl LocalityError {
    /// A one-line suggestion for the user, shown as the HINT of the SQL error or after the
    /// command-line error.
    pub fn hint(&self) -> &'static str {
        match self {
            LocalityError::NoRegion => {
                "Every node needs a region tier, e.g. region=us-east1,zone=us-east1-b."
            }
            _ => {
                "Use comma-separated key=value tiers of letters, digits, '-', '_' or '.', \
                 e.g. region=us-east1,zone=us-east1-b."
            }
        }
    }
}

/// Ordered locality tiers. `region` is mandatory: every multi-region decision keys on it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Locality {
    tiers: Vec<(String, String)>,
}

fn allowed(ch: char) -> bool {
    ch.is_ascii_alphanumeric() || matches!(ch, '-' | '_' | '.')
}

impl Locality {
    /// Parses `region=us-east1,zone=us-east1-b`. Surrounding whitespace around tiers is
    /// ignored; anything else unusual is an error rather than a silent normalisation.
    pub fn parse(s: &str) -> Result<Locality, LocalityError> {
        let s = s.trim();
        if s.is_empty() {
            return Err(LocalityError::Empty);
        }
        let mut tiers: Vec<(String, String)> = Vec::new();
        for raw in s.split(',') {
            let tier = raw.trim();
            if tier.is_empty() {
                return Err(LocalityError::EmptyTier);
            }
            let (k, v) = tier
                .split_once('=')
                .ok_or_else(|| LocalityError::NotKeyValue(tier.to_string()))?;
            let (k, v) = (k.trim(), v.trim());
            if k.is_empty() || v.is_empty() {
                return Err(LocalityError::EmptyPart(tier.to_string()));
            }
            if let Some(ch) = k.chars().chain(v.chars()).find(|c| !allowed(*c)) {
                return Err(LocalityError::BadChar {
                    tier: tier.to_string(),
                    ch,
                });
            }
            if tiers.iter().any(|(key, _)| key == k) {
                return Err(LocalityError::DuplicateKey(k.to_string()));
            }
            tiers.push((k.to_string(), v.to_string()));
        }
        if !tiers.iter().any(|(k, _)| k == "region") {
            return Err(LocalityError::NoRegion);
        }
        Ok(Locality { tiers })
    }

    /// Builds `region=R,zone=Z`; both parts are validated like a parsed string.
    pub fn region_zone(region: &str, zone: &str) -> Result<Locality, LocalityError> {
        Locality::parse(&format!("region={region},zone={zone}"))
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.tiers
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The region tier; present by construction.
    pub fn region(&self) -> &str {
        self.get("region")
            .expect("a Locality always has a region tier")
    }

    /// The zone tier, if the node has one.
    pub fn zone(&self) -> Option<&str> {
        self.get("zone")
    }

    pub fn tiers(&self) -> &[(String, String)] {
        &self.tiers
    }
}

impl fmt::Display for Locality {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (k, v)) in self.tiers.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{k}={v}")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Locality {
    type Err = LocalityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Locality::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_region_and_zone_in_order() {
        let l = Locality::parse("region=us-east1,zone=us-east1-b").unwrap();
        assert_eq!(l.region(), "us-east1");
        assert_eq!(l.zone(), Some("us-east1-b"));
        assert_eq!(l.to_string(), "region=us-east1,zone=us-east1-b");
    }

    #[test]
    fn keeps_extra_tiers_and_trims_whitespace() {
        let l = Locality::parse(" cloud=gce , region=eu ,zone=eu-a,dc=7 ").unwrap();
        assert_eq!(l.to_string(), "cloud=gce,region=eu,zone=eu-a,dc=7");
        assert_eq!(l.get("dc"), Some("7"));
    }

    #[test]
    fn region_only_is_enough() {
        let l = Locality::parse("region=x").unwrap();
        assert_eq!(l.zone(), None);
    }

    #[test]
    fn rejects_malformed_strings() {
        assert_eq!(Locality::parse("  "), Err(LocalityError::Empty));
        assert_eq!(
            Locality::parse("us-east1"),
            Err(LocalityError::NotKeyValue("us-east1".into()))
        );
        assert_eq!(
            Locality::parse("region="),
            Err(LocalityError::EmptyPart("region=".into()))
        );
        assert_eq!(
            Locality::parse("region=a,,zone=b"),
            Err(LocalityError::EmptyTier)
        );
        assert_eq!(Locality::parse("region=a,"), Err(LocalityError::EmptyTier));
        assert_eq!(
            Locality::parse("region=a b"),
            Err(LocalityError::BadChar {
                tier: "region=a b".into(),
                ch: ' '
            })
        );
        assert_eq!(
            Locality::parse("region=a,region=b"),
            Err(LocalityError::DuplicateKey("region".into()))
        );
        assert_eq!(Locality::parse("zone=a"), Err(LocalityError::NoRegion));
        assert!(
            Locality::parse("region='x'").is_err(),
            "quotes are not part of a name"
        );
    }

    #[test]
    fn every_error_has_a_hint_with_an_example() {
        for e in [LocalityError::Empty, LocalityError::NoRegion] {
            assert!(e.hint().contains("region=us-east1"));
        }
    }
}
