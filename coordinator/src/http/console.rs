//! The console's pages: one per concern, rendered as HTML tables and SVG.

use crate::node::Node;
use crate::stats;
use mr_wire::local::{LocalRequest, LocalResponse, NodeRow, RangeProgress, RangeRow, RttRow};
use std::collections::BTreeMap;
use std::fmt::Write;

/// Text for HTML, escaped.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:0;color:#1d2330;background:#f5f7fa}\
header{background:#0b2545;color:#fff;padding:10px 24px;display:flex;gap:24px;align-items:baseline}\
header b{font-size:18px}header a{color:#cfd8e3;text-decoration:none}header a.on{color:#fff;border-bottom:2px solid #6cf}\
main{padding:16px 24px}h2{font-size:16px;margin:20px 0 8px}\
table{border-collapse:collapse;background:#fff;font-size:13px}td,th{border:1px solid #d9dee7;padding:4px 8px;text-align:left}\
th{background:#eef1f6}td.num{text-align:right;font-variant-numeric:tabular-nums}\
.live{color:#147a2e}.suspect{color:#a66a00}.dead,.decommissioned{color:#b3261e}\
.note{color:#5b6475;font-size:12px}svg{background:#fff;border:1px solid #d9dee7}";

fn page(title: &str, active: &str, node: &Node, body: &str) -> String {
    let mut nav = String::new();
    for (href, name) in [
        ("/", "Overview"),
        ("/network", "Network Latency"),
        ("/sql", "SQL Latency"),
        ("/ranges", "Ranges"),
        ("/metrics", "Metrics"),
    ] {
        let class = if href == active { " class=\"on\"" } else { "" };
        let _ = write!(nav, "<a href=\"{href}\"{class}>{name}</a>");
    }
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{title} · pg_multiregion</title>\
         <style>{STYLE}</style></head><body><header><b>pg_multiregion</b>{nav}\
         <span class=\"note\">node {} · {}</span></header><main><h1 style=\"font-size:20px\">{title}</h1>{body}</main></body></html>",
        node.node_id(),
        esc(node.region()),
    )
}

/// "n1, n2, n3".
fn node_list(nodes: &[u64]) -> String {
    nodes
        .iter()
        .map(|n| format!("n{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn unavailable(what: &str, r: &LocalResponse) -> String {
    let why = match r {
        LocalResponse::Error { message, .. } => message.clone(),
        other => format!("{other:?}"),
    };
    format!(
        "<p class=\"note\">{} unavailable: {}</p>",
        esc(what),
        esc(&why)
    )
}

/// Nodes, their liveness and roles, and the meta group.
pub async fn overview(node: &Node) -> String {
    let mut body = String::new();
    let ranges = match node.local_request(LocalRequest::Ranges).await {
        LocalResponse::Ranges { ranges } => ranges,
        _ => Vec::new(),
    };
    match node.local_request(LocalRequest::Nodes).await {
        LocalResponse::Nodes { nodes } => body.push_str(&nodes_table(&nodes, &ranges)),
        other => body.push_str(&unavailable("nodes", &other)),
    }
    match node.local_request(LocalRequest::MetaGroup).await {
        LocalResponse::MetaGroup(g) => {
            let _ = write!(
                body,
                "<h2>Metadata Raft group</h2><table><tr><th>leader</th><th>term</th>\
                 <th>commit index</th><th>voters</th><th>learners</th></tr>\
                 <tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td></tr></table>",
                g.leader.map_or("none".into(), |l| format!("n{l}")),
                g.term,
                g.commit_index.map_or(String::new(), |c| c.to_string()),
                node_list(&g.voters),
                node_list(&g.learners),
            );
        }
        other => body.push_str(&unavailable("the meta group", &other)),
    }
    page("Cluster Overview", "/", node, &body)
}

fn nodes_table(nodes: &[NodeRow], ranges: &[RangeRow]) -> String {
    let now = crate::node::now_ms();
    let mut t = String::from(
        "<h2>Nodes</h2><table><tr><th>node</th><th>region</th><th>zone</th><th>status</th>\
         <th>meta role</th><th>SQL (PostgreSQL)</th><th>replicas</th><th>leases</th><th>last heartbeat</th></tr>",
    );
    for n in nodes {
        let replicas = ranges
            .iter()
            .filter(|r| {
                r.voting_replicas.contains(&n.node_id) || r.non_voting_replicas.contains(&n.node_id)
            })
            .count();
        let leases = ranges
            .iter()
            .filter(|r| r.lease_holder == Some(n.node_id))
            .count();
        let _ = write!(
            t,
            "<tr><td>n{}</td><td>{}</td><td>{}</td><td class=\"{}\">{}</td><td>{}</td><td>{}</td>\
             <td class=\"num\">{replicas}</td><td class=\"num\">{leases}</td><td class=\"num\">{:.1} s ago</td></tr>",
            n.node_id,
            esc(&n.region),
            esc(n.zone.as_deref().unwrap_or("")),
            esc(&n.status),
            esc(&n.status),
            esc(&n.meta_role),
            esc(&n.sql_addr),
            now.saturating_sub(n.last_heartbeat_ms) as f64 / 1000.0,
        );
    }
    t.push_str("</table>");
    t
}

/// The colour of a round trip: green when near, through yellow, to red at 150 ms and above.
fn rtt_colour(ms: f64) -> String {
    let hue = 120.0 * (1.0 - (ms / 150.0).clamp(0.0, 1.0));
    format!("hsl({hue:.0},70%,80%)")
}

/// The measured round trip between every pair of nodes.
pub async fn network(node: &Node) -> String {
    let rows = match node.local_request(LocalRequest::NetworkLatency).await {
        LocalResponse::NetworkLatency { rows } => rows,
        other => {
            return page(
                "Network Latency",
                "/network",
                node,
                &unavailable("latencies", &other),
            )
        }
    };
    page("Network Latency", "/network", node, &latency_matrix(&rows))
}

fn latency_matrix(rows: &[RttRow]) -> String {
    let mut ids: BTreeMap<u64, String> = BTreeMap::new();
    for r in rows {
        ids.insert(r.from_node, r.from_region.clone());
        ids.insert(r.to_node, r.to_region.clone());
    }
    let cell: BTreeMap<(u64, u64), Option<f64>> = rows
        .iter()
        .map(|r| ((r.from_node, r.to_node), r.rtt_ms))
        .collect();
    let mut t = String::from(
        "<p class=\"note\">Median round-trip time (ms) of the heartbeats from each row's node to \
         each column's node, through pgmr's network layer (simulated WAN included).</p>\
         <table id=\"latency\"><tr><th>from \\ to</th>",
    );
    for (id, region) in &ids {
        let _ = write!(
            t,
            "<th>n{id}<br><span class=\"note\">{}</span></th>",
            esc(region)
        );
    }
    t.push_str("</tr>");
    for (from, region) in &ids {
        let _ = write!(
            t,
            "<tr><th>n{from} <span class=\"note\">{}</span></th>",
            esc(region)
        );
        for to in ids.keys() {
            match cell.get(&(*from, *to)).copied().flatten() {
                _ if from == to => t.push_str("<td class=\"num\">–</td>"),
                Some(ms) => {
                    let _ = write!(
                        t,
                        "<td class=\"num rtt\" data-from=\"{from}\" data-to=\"{to}\" style=\"background:{}\">{ms:.1}</td>",
                        rtt_colour(ms)
                    );
                }
                None => t.push_str("<td class=\"num\">?</td>"),
            }
        }
        t.push_str("</tr>");
    }
    t.push_str("</table>");
    t
}

const PALETTE: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf",
];

/// p50 and p99 of the SQL gateway's statements per region, over the last 30 minutes.
pub async fn sql(node: &Node) -> String {
    let all = node.sql_latency().await;
    // region → window start → merged histogram
    let mut by_region: BTreeMap<String, BTreeMap<u64, Vec<u32>>> = BTreeMap::new();
    for (_, region, windows) in all {
        let r = by_region.entry(region).or_default();
        for w in windows {
            stats::merge(r.entry(w.start_ms).or_default(), &w.counts);
        }
    }
    let mut body = String::from(
        "<p class=\"note\">Statements through the SQL gateways (CockroachDB's door) of each \
         region's nodes, from the client's message to ReadyForQuery, in 10-second windows. \
         Solid: p50; dashed: p99.</p>",
    );
    body.push_str(&latency_chart(&by_region));
    body.push_str(
        "<h2>Last minute</h2><table id=\"sql-latency\"><tr><th>region</th><th>statements</th>\
         <th>p50 (ms)</th><th>p99 (ms)</th></tr>",
    );
    let now = crate::node::now_ms();
    for (region, windows) in &by_region {
        let mut last = Vec::new();
        for (start, counts) in windows {
            if *start + 60_000 >= now {
                stats::merge(&mut last, counts);
            }
        }
        let n: u64 = last.iter().map(|&c| u64::from(c)).sum();
        let q = |p| stats::quantile(&last, p).map_or("–".into(), |v| format!("{v:.2}"));
        let _ = write!(
            body,
            "<tr><td>{}</td><td class=\"num\">{n}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
            esc(region),
            q(0.5),
            q(0.99)
        );
    }
    body.push_str("</table>");
    page("SQL Latency by Region", "/sql", node, &body)
}

/// An SVG line chart: one colour per region, p50 solid and p99 dashed, on a log-free linear
/// scale up to the highest p99 shown.
fn latency_chart(by_region: &BTreeMap<String, BTreeMap<u64, Vec<u32>>>) -> String {
    const W: f64 = 900.0;
    const H: f64 = 300.0;
    const PAD: f64 = 48.0;
    let starts: Vec<u64> = by_region.values().flat_map(|w| w.keys().copied()).collect();
    let (Some(&first), Some(&latest)) = (starts.iter().min(), starts.iter().max()) else {
        return "<p class=\"note\">No statements yet.</p>".into();
    };
    // At least the last five minutes, up to the latest window.
    let t1 = latest;
    let t0 = first.min(t1.saturating_sub(300_000));
    // (window start, p50, p99) per region.
    type Points = Vec<(u64, f64, f64)>;
    let series: Vec<(&String, Points)> = by_region
        .iter()
        .map(|(region, windows)| {
            let points = windows
                .iter()
                .filter_map(|(t, c)| {
                    Some((*t, stats::quantile(c, 0.5)?, stats::quantile(c, 0.99)?))
                })
                .collect();
            (region, points)
        })
        .collect();
    let top = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(_, _, p99)| *p99))
        .fold(1.0_f64, f64::max)
        * 1.1;
    let x = |t: u64| {
        let span = (t1 - t0).max(1) as f64;
        PAD + (t - t0) as f64 / span * (W - 2.0 * PAD)
    };
    let y = |ms: f64| H - PAD + 16.0 - ms / top * (H - PAD - 16.0);
    let mut svg = format!(
        "<svg id=\"sql-chart\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" xmlns=\"http://www.w3.org/2000/svg\">"
    );
    for i in 0..=4 {
        let ms = top * f64::from(i) / 4.0;
        let _ = write!(
            svg,
            "<line x1=\"{PAD}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#e3e7ee\"/>\
             <text x=\"4\" y=\"{:.1}\" font-size=\"11\" fill=\"#5b6475\">{ms:.prec$} ms</text>",
            W - PAD,
            y(ms) + 4.0,
            y = y(ms),
            prec = if top < 10.0 { 2 } else { 0 }
        );
    }
    let minutes = (t1 - t0) as f64 / 60_000.0;
    let _ = write!(
        svg,
        "<text x=\"{PAD}\" y=\"{}\" font-size=\"11\" fill=\"#5b6475\">−{minutes:.1} min</text>\
         <text x=\"{}\" y=\"{}\" font-size=\"11\" fill=\"#5b6475\" text-anchor=\"end\">now</text>",
        H - 6.0,
        W - PAD,
        H - 6.0
    );
    for (i, (region, points)) in series.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        for (dash, pick) in [("", 1usize), (" stroke-dasharray=\"5 4\"", 2)] {
            let path: Vec<String> = points
                .iter()
                .map(|p| {
                    let v = if pick == 1 { p.1 } else { p.2 };
                    format!("{:.1},{:.1}", x(p.0), y(v))
                })
                .collect();
            let _ = write!(
                svg,
                "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\"{dash} points=\"{}\"/>",
                path.join(" ")
            );
            for p in &path {
                if let Some((cx, cy)) = p.split_once(',') {
                    let _ = write!(
                        svg,
                        "<circle cx=\"{cx}\" cy=\"{cy}\" r=\"2.5\" fill=\"{colour}\"/>"
                    );
                }
            }
        }
        let _ = write!(
            svg,
            "<rect x=\"{}\" y=\"{}\" width=\"10\" height=\"10\" fill=\"{colour}\"/>\
             <text x=\"{}\" y=\"{}\" font-size=\"12\">{}</text>",
            W - PAD - 150.0,
            12.0 + 16.0 * i as f64,
            W - PAD - 135.0,
            21.0 + 16.0 * i as f64,
            esc(region)
        );
    }
    svg.push_str("</svg>");
    svg
}

/// Every range: its table, leaseholder and replicas, and how far its replicas lag.
pub async fn ranges(node: &Node) -> String {
    let rows = match node.local_request(LocalRequest::Ranges).await {
        LocalResponse::Ranges { ranges } => ranges,
        other => return page("Ranges", "/ranges", node, &unavailable("ranges", &other)),
    };
    let progress = match node.local_request(LocalRequest::RangeProgress).await {
        LocalResponse::RangeProgress { replicas } => replicas,
        _ => Vec::new(),
    };
    page("Ranges", "/ranges", node, &ranges_table(&rows, &progress))
}

fn ranges_table(rows: &[RangeRow], progress: &[RangeProgress]) -> String {
    let mut t = String::from(
        "<p class=\"note\">Replication lag: entries a replica's PostgreSQL has not applied \
         yet, behind the range's commit index (the largest over its replicas).</p>\
         <table id=\"ranges\"><tr><th>range</th><th>table</th><th>partition</th><th>leaseholder</th>\
         <th>voters</th><th>non-voters</th><th>replica regions</th><th>replication lag</th></tr>",
    );
    for r in rows {
        let commit = progress
            .iter()
            .filter(|p| p.range_id == r.range_id)
            .map(|p| p.committed_index)
            .max()
            .unwrap_or(0);
        let lag = progress
            .iter()
            .filter(|p| p.range_id == r.range_id)
            .map(|p| commit.saturating_sub(p.applied_index))
            .max()
            .unwrap_or(0);
        let _ = write!(
            t,
            "<tr><td class=\"num\">{}</td><td>{}.{}.{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"num\">{lag}</td></tr>",
            r.range_id,
            esc(&r.database_name),
            esc(&r.schema_name),
            esc(&r.table_name),
            esc(r.partition.as_deref().unwrap_or("")),
            r.lease_holder.map_or("none".into(), |h| format!(
                "n{h} ({})",
                esc(r.lease_holder_region.as_deref().unwrap_or(""))
            )),
            node_list(&r.voting_replicas),
            node_list(&r.non_voting_replicas),
            esc(&r.replica_regions.join(", ")),
        );
    }
    t.push_str("</table>");
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rtt(from: u64, to: u64, ms: Option<f64>) -> RttRow {
        RttRow {
            from_node: from,
            from_region: format!("r{from}"),
            from_zone: None,
            to_node: to,
            to_region: format!("r{to}"),
            to_zone: None,
            rtt_ms: ms,
            age_ms: 0,
        }
    }

    #[test]
    fn the_matrix_has_a_cell_per_pair_coloured_by_distance_and_escapes_names() {
        let mut rows = vec![
            rtt(1, 2, Some(2.0)),
            rtt(2, 1, Some(140.0)),
            rtt(1, 3, None),
        ];
        rows[0].to_region = "<script>".into();
        let html = latency_matrix(&rows);
        assert!(html
            .contains("data-from=\"1\" data-to=\"2\" style=\"background:hsl(118,70%,80%)\">2.0<"));
        assert!(html.contains("hsl(8,70%,80%)\">140.0<"), "{html}");
        assert!(html.contains(">?<"), "unmeasured pairs say so");
        assert!(!html.contains("<script>"));
    }

    #[test]
    fn the_chart_draws_a_solid_and_a_dashed_line_per_region() {
        let mut by_region = BTreeMap::new();
        for region in ["us-east1", "europe-west1"] {
            let mut w = BTreeMap::new();
            for t in [0u64, 10_000, 20_000] {
                let mut c = vec![0; stats::BUCKETS];
                c[20] = 5;
                w.insert(t, c);
            }
            by_region.insert(region.to_string(), w);
        }
        let svg = latency_chart(&by_region);
        assert_eq!(svg.matches("<polyline").count(), 4);
        assert_eq!(svg.matches("stroke-dasharray").count(), 2);
        assert!(latency_chart(&BTreeMap::new()).contains("No statements"));
    }
}
