//! The Grafana dashboard in `deploy/grafana/` queries only metrics that exist: every metric name in
//! its queries is one that the agent or the controllers expose (rendered here from their real registries).

use lb_agent::dataplane::model::{Protocol, ServiceId};
use lb_agent::report::metrics::{registry, ServiceMetrics, Snapshot};
use std::collections::BTreeSet;
use std::sync::{Arc, RwLock};

/// Metric and sample names in Prometheus text (`# TYPE` lines and samples, with their suffixes).
fn names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let name = match line.strip_prefix("# TYPE ") {
            Some(rest) => rest.split(' ').next(),
            None if !line.starts_with('#') => line.split(['{', ' ']).next(),
            None => None,
        };
        if let Some(n) = name.filter(|n| !n.is_empty()) {
            out.insert(n.to_string());
            // Counters are queried by their sample name; histograms by _bucket, _sum, _count.
            for suffix in ["_total", "_bucket", "_sum", "_count"] {
                out.insert(format!("{n}{suffix}"));
            }
        }
    }
    out
}

fn agent_metrics() -> String {
    let snapshot = Snapshot {
        services: vec![ServiceMetrics {
            id: Some(ServiceId {
                vip: "10.0.0.1".parse().unwrap(),
                port: 80,
                protocol: Protocol::Tcp,
            }),
            ..Default::default()
        }],
        dataplane: lb_common::stat::NAMES.iter().map(|n| (*n, 0)).collect(),
        backends: vec![(Protocol::Tcp, "10.0.0.11:30080".parse().unwrap(), true)],
        host: lb_agent::report::hostmetrics::read(),
        ready: true,
        ha: Some(lb_agent::ha::HaSnapshot {
            vrrp_state: Some(lb_agent::ha::vrrp::VrrpState::Master),
            vrrp_stats: Some(Default::default()),
            sync: Some(Default::default()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let reg = registry(Arc::new(RwLock::new(snapshot)));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &reg).unwrap();
    out
}

/// The controllers' metrics, every labelled family with one series (an empty family is not rendered).
fn controller_metrics() -> String {
    let m = lb_controller::metrics::Metrics::new();
    m.observe_reconcile("service", true, std::time::Duration::ZERO);
    m.loadbalancer_write("create");
    m.invalid("loadbalancer", "example");
    m.machine_deleted("example");
    m.openstack_calls.inc("compute", "server", "create");
    m.encode()
}

#[test]
fn every_dashboard_query_names_an_existing_metric() {
    let exposed: BTreeSet<String> = names(&agent_metrics())
        .into_iter()
        .chain(names(&controller_metrics()))
        .collect();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/grafana/lb-dashboard.json"
    );
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut exprs = Vec::new();
    fn collect(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr" | "query", serde_json::Value::String(s)) => out.push(s.clone()),
                        _ => collect(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| collect(v, out)),
            _ => {}
        }
    }
    collect(&dashboard, &mut exprs);
    assert!(
        exprs.len() >= 10,
        "the dashboard has queries: {}",
        exprs.len()
    );
    let mut missing = vec![];
    for expr in &exprs {
        // Metric names are the identifiers of ours in the query (labels and functions are not prefixed).
        for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            let ours = word.starts_with("lb_") || word.starts_with("yawol_");
            if ours && !exposed.contains(word) {
                missing.push(format!("{word} (in `{expr}`)"));
            }
        }
    }
    assert!(missing.is_empty(), "queried but not exposed: {missing:#?}");
}
