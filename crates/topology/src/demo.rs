//! Localities for `pgmr demo`, matching `cockroach demo --global` as the MovR tutorial uses it.

use crate::Locality;

/// The tutorial's regions with their zones, in node order.
pub const GLOBAL_REGIONS: [(&str, [&str; 3]); 3] = [
    ("us-east1", ["b", "c", "d"]),
    ("us-west1", ["a", "b", "c"]),
    ("europe-west1", ["b", "c", "d"]),
];

/// One node of a demo cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoNode {
    /// 1-based, as node ids are.
    pub index: usize,
    pub locality: Locality,
}

/// Spreads `n` nodes over the three regions in contiguous blocks (9 nodes: 1–3 us-east1,
/// 4–6 us-west1, 7–9 europe-west1; 3 nodes: one per region), cycling through each region's
/// zones, as `cockroach demo --global` does.
pub fn demo_layout(n: usize) -> Vec<DemoNode> {
    let regions = GLOBAL_REGIONS.len();
    let mut per_region = [0usize; 3];
    (0..n)
        .map(|i| {
            let r = i * regions / n.max(1);
            let (region, zones) = GLOBAL_REGIONS[r];
            let zone = zones[per_region[r] % zones.len()];
            per_region[r] += 1;
            DemoNode {
                index: i + 1,
                locality: Locality::region_zone(region, &format!("{region}-{zone}"))
                    .expect("demo localities are valid"),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        demo_layout(n)
            .iter()
            .map(|d| d.locality.to_string())
            .collect()
    }

    #[test]
    fn nine_nodes_are_three_per_region_with_the_tutorials_zones() {
        assert_eq!(
            names(9),
            vec![
                "region=us-east1,zone=us-east1-b",
                "region=us-east1,zone=us-east1-c",
                "region=us-east1,zone=us-east1-d",
                "region=us-west1,zone=us-west1-a",
                "region=us-west1,zone=us-west1-b",
                "region=us-west1,zone=us-west1-c",
                "region=europe-west1,zone=europe-west1-b",
                "region=europe-west1,zone=europe-west1-c",
                "region=europe-west1,zone=europe-west1-d",
            ]
        );
    }

    #[test]
    fn three_nodes_are_one_per_region() {
        assert_eq!(
            names(3),
            vec![
                "region=us-east1,zone=us-east1-b",
                "region=us-west1,zone=us-west1-a",
                "region=europe-west1,zone=europe-west1-b",
            ]
        );
    }

    #[test]
    fn every_size_uses_contiguous_blocks_and_numbers_from_one() {
        for n in 1..=12 {
            let layout = demo_layout(n);
            assert_eq!(layout.len(), n);
            assert_eq!(layout[0].index, 1);
            let regions: Vec<&str> = layout.iter().map(|d| d.locality.region()).collect();
            let mut seen = regions.clone();
            seen.dedup();
            let mut sorted = seen.clone();
            sorted.sort();
            sorted.dedup();
            assert_eq!(seen.len(), sorted.len(), "regions are contiguous for n={n}");
        }
    }
}
