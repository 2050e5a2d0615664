//! The config source of Kubernetes mode: the one LoadBalancer, watched and turned into the agent's
//! [`ConfigState`] (with the HA hints from its annotations).

use super::debug::AdHocDebug;
use super::events::{event_reasons, truncate, MachineEvent, Recorder};
use super::status::unsupported_condition;
use super::{KubeSettings, LbFacts};
use crate::health::HealthCheckSpec;
use crate::source::config::desired;
use crate::source::config::{unsupported_options, Unsupported};
use crate::source::ConfigState;
use ::kube::api::Api;
use ::kube::runtime::watcher;
use futures::StreamExt;
use lb_api::watch::{is_gone, WatchBackoff};
use lb_api::LoadBalancer;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// The agent's configuration from its LoadBalancer: the VIPs are `status.portIP` (IPv4) and `status.portIPv6`
/// (IPv6), each when `spec.ipFamilies` asks for its family (absent: IPv4 only, as yawol writes it); `Pending`
/// until the controller has created the port with every wanted address; services from the spec, generation =
/// `metadata.generation`. `proxy_v2` as for [`desired`].
pub fn config_from_lb(
    lb: &LoadBalancer,
    health_check: &HealthCheckSpec,
    proxy_v2: bool,
) -> ConfigState {
    let generation = lb.metadata.generation.unwrap_or(0).max(0) as u64;
    let status = lb.status.as_ref();
    let wanted = [
        (
            "status.portIP",
            lb.spec.wants_ipv4(),
            status.and_then(|s| s.port_ip.as_deref()),
        ),
        (
            "status.portIPv6",
            lb.spec.wants_ipv6(),
            status.and_then(|s| s.port_ipv6.as_deref()),
        ),
    ];
    let mut vips = Vec::new();
    for (field, wanted, value) in wanted {
        if !wanted {
            continue;
        }
        let Some(value) = value.map(str::trim).filter(|s| !s.is_empty()) else {
            return ConfigState::Pending;
        };
        match value.parse::<IpAddr>() {
            Ok(ip) => vips.push((field.to_string(), ip)),
            Err(_) => {
                return ConfigState::Invalid(
                    format!("{field}: {value:?} is not an IP address"),
                    generation,
                )
            }
        }
    }
    // SNAT: `None` = the VIP, which lets a standby replica take over return traffic; the agent's
    // --snat-address overrides it in the agent loop.
    match desired(
        &vips,
        &[],
        lb.spec.ports(),
        lb.spec.endpoints(),
        lb.spec.options(),
        health_check.clone(),
        proxy_v2,
    ) {
        Ok(c) => ConfigState::Valid(Arc::new(c), generation),
        Err(e) => ConfigState::Invalid(format!("{e:#}"), generation),
    }
}

/// Adds what HA needs from the LoadBalancer's annotations to a valid config: the sync peers (machines'
/// addresses, written by the controller) and whether this machine is of the newest revision. A malformed peer
/// is skipped with a warning; the others still sync.
pub fn with_ha_hints(
    state: ConfigState,
    lb: &LoadBalancer,
    machine_revision: Option<&str>,
) -> ConfigState {
    let ConfigState::Valid(cfg, generation) = state else {
        return state;
    };
    let ann = lb.metadata.annotations.as_ref();
    let peers = ann
        .and_then(|a| a.get(lb_api::constants::lb_annotations::SYNC_PEERS))
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .filter_map(|p| match p.parse::<IpAddr>() {
                    Ok(ip) => Some(ip),
                    Err(_) => {
                        tracing::warn!(
                            peer = p,
                            "ignoring a malformed sync peer in the LoadBalancer annotation"
                        );
                        None
                    }
                })
                .collect::<Vec<_>>()
        });
    let newest = machine_revision.map(|mine| {
        ann.and_then(|a| a.get(lb_api::constants::lb_annotations::REVISION))
            .is_some_and(|current| current.trim() == mine.trim())
    });
    let mut c = (*cfg).clone();
    c.sync_peers = peers;
    c.newest_revision = newest;
    ConfigState::Valid(Arc::new(c), generation)
}

/// What the config source does besides the configuration (see the module documentation of Kubernetes mode).
pub(super) struct Extras {
    /// To the status reporter.
    pub facts: watch::Sender<LbFacts>,
    /// The machine's revision (the flag, or learnt by the status reporter from the LoadBalancerMachine).
    pub revision: watch::Receiver<Option<String>>,
    /// Ad-hoc debug access, when enabled.
    pub ad_hoc_debug: Option<AdHocDebug>,
    /// The unsupported options last reported by Events (each reported once per agent while it stays the same).
    pub unsupported_reported: Vec<Unsupported>,
    /// The configuration warnings last reported by Events (each reported once while it stays).
    pub warnings_reported: Vec<String>,
}

/// Whether two states would make the agent do the same thing (no need to wake it).
pub fn same_config(a: &ConfigState, b: &ConfigState) -> bool {
    match (a, b) {
        (ConfigState::Pending, ConfigState::Pending) => true,
        (ConfigState::Valid(a, ga), ConfigState::Valid(b, gb)) => ga == gb && a == b,
        (ConfigState::Invalid(a, ga), ConfigState::Invalid(b, gb)) => ga == gb && a == b,
        _ => false,
    }
}

/// Watches the LoadBalancer and publishes its configuration; runs until aborted. `stale` says whether what was
/// published is known to be the latest: from a watch error until a fresh list has completed it names the error.
///
/// Every error starts a fresh watcher (a list, then a watch): kube-runtime's watcher resumes a broken watch from
/// its last resourceVersion without a list, and nothing then tells when it has caught up, while a completed list
/// is a definite "in sync" (one object, by name: the list is cheap). A 410 Gone (the watch's resourceVersion was
/// compacted away: the server is up and asks for a relist) is relisted at once instead of waiting out a backoff
/// grown earlier. Other errors wait for the backoff (0.8 s doubling to 30 s, jitter): after an outage the first list
/// comes at its next step, while the status says the configuration is not confirmed.
pub(super) async fn run_config_source(
    lbs: Api<LoadBalancer>,
    settings: KubeSettings,
    tx: watch::Sender<ConfigState>,
    stale: watch::Sender<Option<String>>,
    recorder: Arc<Recorder>,
    mut extras: Extras,
) {
    let name = &settings.loadbalancer;
    let what = format!("LoadBalancer {}/{name}", settings.namespace);
    // The name as a field selector also makes the list and watch authorised by the per-machine Role's
    // resourceNames (a namespace-wide list is Forbidden to the machine's token).
    let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut backoff = WatchBackoff::default();
    loop {
        let mut stream = std::pin::pin!(watcher(lbs.clone(), cfg.clone()));
        // A relist (Init … InitDone) is buffered so a LoadBalancer missing after the relist is noticed.
        let mut relisted: Option<LoadBalancer> = None;
        // The LoadBalancer last published, for a revision learnt later.
        let mut last: Option<LoadBalancer> = None;
        let error = loop {
            let event = tokio::select! {
                event = stream.next() => event,
                Ok(()) = extras.revision.changed() => {
                    if let Some(lb) = &last {
                        publish(lb, &settings, &tx, &recorder, &mut extras).await;
                    }
                    continue;
                }
            };
            let Some(event) = event else {
                break None;
            };
            match event {
                Ok(watcher::Event::Init) => relisted = None,
                Ok(watcher::Event::InitApply(lb)) => relisted = Some(lb),
                Ok(watcher::Event::InitDone) => {
                    match relisted.take() {
                        Some(lb) => {
                            publish(&lb, &settings, &tx, &recorder, &mut extras).await;
                            last = Some(lb);
                        }
                        None => tracing::warn!(object = %what,
                            "not found; waiting for it (a configuration already in the data plane keeps forwarding)"),
                    }
                    if stale.send_replace(None).is_some() {
                        tracing::info!(object = %what, "listed again; the configuration source is in sync");
                    }
                }
                Ok(watcher::Event::Apply(lb)) => {
                    publish(&lb, &settings, &tx, &recorder, &mut extras).await;
                    last = Some(lb);
                }
                Ok(watcher::Event::Delete(_)) => tracing::warn!(object = %what,
                    "deleted; the configuration in the data plane keeps forwarding until the machine is removed"),
                Err(e) => break Some(e),
            }
        };
        let delay = match &error {
            Some(e) if is_gone(e) => Duration::ZERO,
            _ => backoff.next().unwrap_or(Duration::from_secs(30)),
        };
        let message = error.map_or_else(|| "the watch ended".to_string(), |e| e.to_string());
        tracing::warn!(object = %what, error = %message, retry_in = ?delay, "watch failed; listing again");
        stale.send_replace(Some(truncate(&format!(
            "the LoadBalancer watch is not in sync with the API server ({message})"
        ))));
        tokio::time::sleep(delay).await;
    }
}

/// Sends the LoadBalancer's configuration to the agent if it changed; reports rejections. Acts on ad-hoc debug
/// access and reports unsupported options first (they do not depend on the configuration's validity).
async fn publish(
    lb: &LoadBalancer,
    settings: &KubeSettings,
    tx: &watch::Sender<ConfigState>,
    recorder: &Recorder,
    extras: &mut Extras,
) {
    if let Some(debug) = &mut extras.ad_hoc_debug {
        for e in debug.reconcile(lb).await {
            recorder.publish(&e).await;
        }
    }
    let unsupported = unsupported_options(lb.spec.ports(), lb.spec.options(), settings.proxy_v2);
    for u in &unsupported {
        if extras.unsupported_reported.contains(u) {
            continue;
        }
        tracing::warn!(option = u.option.field(), message = %u.message,
            "the LoadBalancer asks for an option this image does not implement; forwarding without it");
        recorder
            .publish_spec_event(
                lb,
                &MachineEvent {
                    warning: true,
                    reason: unsupported_condition(u.option).1,
                    message: truncate(&u.message),
                },
            )
            .await;
    }
    extras.unsupported_reported = unsupported.clone();
    extras.facts.send_if_modified(|f| {
        std::mem::replace(&mut f.unsupported, unsupported.clone()) != unsupported
    });
    let revision = extras.revision.borrow_and_update().clone();
    let state = with_ha_hints(
        config_from_lb(lb, &settings.health_check, settings.proxy_v2),
        lb,
        revision.as_deref(),
    );
    // Status-only updates (replica counts, reconcile timestamps) must not wake the agent.
    if same_config(&tx.borrow(), &state) {
        return;
    }
    match &state {
        ConfigState::Pending => {
            tracing::info!(
                "LoadBalancer has no VIP of a family it serves yet (status.portIP, status.portIPv6); waiting"
            )
        }
        ConfigState::Valid(c, generation) => {
            tracing::info!(
                generation,
                services = c.services.len(),
                "new configuration from the LoadBalancer"
            );
            for w in &c.warnings {
                if extras.warnings_reported.contains(w) {
                    continue;
                }
                tracing::warn!(generation, warning = %w, "LoadBalancer accepted with a warning");
                recorder
                    .publish_spec_event(
                        lb,
                        &MachineEvent {
                            warning: true,
                            reason: event_reasons::CONFIG_WARNING,
                            message: truncate(w),
                        },
                    )
                    .await;
            }
            extras.warnings_reported = c.warnings.clone();
        }
        ConfigState::Invalid(msg, generation) => {
            tracing::error!(generation, error = %msg, "LoadBalancer rejected; the last valid configuration keeps forwarding");
            recorder
                .publish_spec_event(
                    lb,
                    &MachineEvent {
                        warning: true,
                        reason: event_reasons::CONFIG_REJECTED,
                        message: truncate(&format!(
                            "LoadBalancer generation {generation} rejected, the last valid configuration keeps \
                             forwarding: {msg}"
                        )),
                    },
                )
                .await;
        }
    }
    // No receiver only happens during shutdown.
    let _ = tx.send(state);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::model::Protocol;
    use lb_api::constants::API_VERSION;
    use serde_json::json;
    use std::net::SocketAddr;

    #[test]
    fn ha_hints_come_from_the_loadbalancer_annotations() {
        use lb_api::constants::lb_annotations::{REVISION, SYNC_PEERS};
        let mut l = lb(json!({
            "spec": {"ports": [{"name": "web", "protocol": "TCP", "port": 80, "nodePort": 30080}]},
            "status": {"portIP": "10.0.0.9"}
        }));
        let base = config_from_lb(&l, &HealthCheckSpec::default(), true);
        let ConfigState::Valid(c, _) = with_ha_hints(base.clone(), &l, Some("3")) else {
            panic!("valid")
        };
        assert_eq!(
            (c.sync_peers.clone(), c.newest_revision),
            (None, Some(false))
        );
        l.metadata.annotations = Some(
            [
                (
                    SYNC_PEERS.to_string(),
                    "10.0.0.5, bogus,10.0.0.6".to_string(),
                ),
                (REVISION.to_string(), "3".to_string()),
            ]
            .into(),
        );
        let ConfigState::Valid(c, _) = with_ha_hints(base, &l, Some("3")) else {
            panic!("valid")
        };
        let peers: Vec<IpAddr> = vec!["10.0.0.5".parse().unwrap(), "10.0.0.6".parse().unwrap()];
        assert_eq!(c.sync_peers, Some(peers), "the malformed peer is skipped");
        assert_eq!(c.newest_revision, Some(true));
    }

    fn lb(json: serde_json::Value) -> LoadBalancer {
        let mut base = json!({
            "apiVersion": API_VERSION, "kind": "LoadBalancer",
            "metadata": {"name": "lb", "namespace": "ns", "generation": 3},
            "spec": {
                "selector": {},
                "infrastructure": {
                    "defaultNetwork": {"networkID": "net"},
                    "flavor": {"flavorID": "f"}, "image": {"imageID": "i"},
                    "availabilityZone": "az", "authSecretRef": {"name": "s", "namespace": "ns"}
                }
            }
        });
        kube_testenv::json_merge(&mut base, &json);
        serde_json::from_value(base).unwrap()
    }

    #[test]
    fn lb_without_port_ip_is_pending() {
        let l = lb(json!({"spec": {"ports": [{"port": 80, "nodePort": 30080}]}}));
        assert!(matches!(
            config_from_lb(&l, &HealthCheckSpec::default(), true),
            ConfigState::Pending
        ));
        let l = lb(json!({"status": {"portIP": " "}}));
        assert!(matches!(
            config_from_lb(&l, &HealthCheckSpec::default(), true),
            ConfigState::Pending
        ));
    }

    #[test]
    fn lb_spec_becomes_services_with_the_objects_generation() {
        let l = lb(json!({
            "status": {"portIP": "192.0.2.10"},
            "spec": {
                "ports": [{"name": "web", "protocol": "TCP", "port": 80, "nodePort": 30080},
                          {"protocol": "UDP", "port": 53, "nodePort": 30053}],
                "endpoints": [{"name": "n1", "addresses": ["10.0.0.1"]}, {"name": "n2", "addresses": ["10.0.0.2", "fd00::2"]}],
                "options": {"loadBalancerSourceRanges": ["10.0.0.0/8"], "udpIdleTimeout": "10s"}
            }
        }));
        let ConfigState::Valid(c, generation) =
            config_from_lb(&l, &HealthCheckSpec::default(), true)
        else {
            panic!("not valid")
        };
        assert_eq!(generation, 3);
        assert_eq!(c.services.len(), 2);
        let tcp = &c.services[0];
        assert_eq!(tcp.id.vip, "192.0.2.10".parse::<IpAddr>().unwrap());
        assert_eq!((tcp.id.port, tcp.id.protocol), (80, Protocol::Tcp));
        assert_eq!(
            tcp.backends,
            vec![
                "10.0.0.1:30080".parse().unwrap(),
                "10.0.0.2:30080".parse().unwrap()
            ]
        );
        assert_eq!(tcp.snat, None, "SNAT to the VIP");
        assert_eq!(c.services[1].idle_timeout, Duration::from_secs(10));
        assert_eq!(
            c.health_check,
            HealthCheckSpec::default(),
            "health checks from the flags"
        );
    }

    /// The controller's dual-stack fields: both VIPs served when `spec.ipFamilies` names both, each with the
    /// endpoints' addresses of its family; a wanted family without its address is still pending.
    #[test]
    fn dual_stack_serves_port_ip_and_port_ipv6() {
        let spec = json!({
            "ipFamilies": ["IPv4", "IPv6"],
            "ports": [{"protocol": "TCP", "port": 443, "nodePort": 30443}],
            "endpoints": [{"name": "n1", "addresses": ["10.0.0.1", "2001:db8::1"]}]
        });
        let l = lb(
            json!({"status": {"portIP": "192.0.2.10", "portIPv6": "2001:db8::10"}, "spec": spec}),
        );
        let ConfigState::Valid(c, _) = config_from_lb(&l, &HealthCheckSpec::default(), true) else {
            panic!("not valid")
        };
        let vips: Vec<(IpAddr, SocketAddr)> = c
            .services
            .iter()
            .map(|s| (s.id.vip, s.backends[0]))
            .collect();
        assert_eq!(
            vips,
            vec![
                (
                    "192.0.2.10".parse().unwrap(),
                    "10.0.0.1:30443".parse().unwrap()
                ),
                (
                    "2001:db8::10".parse().unwrap(),
                    "[2001:db8::1]:30443".parse().unwrap()
                ),
            ]
        );
        let l = lb(json!({"status": {"portIP": "192.0.2.10"}, "spec": spec}));
        assert!(matches!(
            config_from_lb(&l, &HealthCheckSpec::default(), true),
            ConfigState::Pending
        ));
        // IPv6 only: the IPv4 port address exists but is not served.
        let mut v6only = spec.clone();
        v6only["ipFamilies"] = json!(["IPv6"]);
        let l = lb(
            json!({"status": {"portIP": "192.0.2.10", "portIPv6": "2001:db8::10"}, "spec": v6only}),
        );
        let ConfigState::Valid(c, _) = config_from_lb(&l, &HealthCheckSpec::default(), true) else {
            panic!("not valid")
        };
        assert_eq!(c.vips(), vec!["2001:db8::10".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn an_ipv6_port_ip_gets_the_endpoints_ipv6_addresses() {
        let l = lb(json!({
            "status": {"portIP": "2001:db8::10"},
            "spec": {
                "ports": [{"protocol": "TCP", "port": 443, "nodePort": 30443}],
                "endpoints": [{"name": "n1", "addresses": ["10.0.0.1"]}, {"name": "n2", "addresses": ["10.0.0.2", "2001:db8::2"]}]
            }
        }));
        let ConfigState::Valid(c, _) = config_from_lb(&l, &HealthCheckSpec::default(), true) else {
            panic!("not valid")
        };
        assert_eq!(
            c.services[0].id.vip,
            "2001:db8::10".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            c.services[0].backends,
            vec!["[2001:db8::2]:30443".parse().unwrap()]
        );
        assert_eq!(
            c.warnings.len(),
            1,
            "n1 has no IPv6 address: {:?}",
            c.warnings
        );
        assert!(c.warnings[0].contains("endpoints[0] (n1) has no IPv6 address"));
        // Only IPv4 endpoints: a mixed-family service, refused naming the VIP's field.
        let l = lb(json!({
            "status": {"portIP": "2001:db8::10"},
            "spec": {"ports": [{"port": 443, "nodePort": 30443}], "endpoints": [{"name": "n1", "addresses": ["10.0.0.1"]}]}
        }));
        let ConfigState::Invalid(msg, 3) = config_from_lb(&l, &HealthCheckSpec::default(), true)
        else {
            panic!()
        };
        assert!(
            msg.contains(
                "status.portIP: IPv6 VIP 2001:db8::10 but no endpoint has an IPv6 address"
            ),
            "{msg}"
        );
    }

    #[test]
    fn bad_vip_or_spec_is_invalid_with_the_generation() {
        let l = lb(json!({"status": {"portIP": "not-an-ip"}}));
        let ConfigState::Invalid(msg, 3) = config_from_lb(&l, &HealthCheckSpec::default(), true)
        else {
            panic!()
        };
        assert!(msg.contains("status.portIP"), "{msg}");
        let l = lb(json!({
            "status": {"portIP": "192.0.2.10"},
            "spec": {"ports": [{"protocol": "SCTP", "port": 80, "nodePort": 30080}, {"port": 0, "nodePort": 30081}],
                     "options": {"loadBalancerSourceRanges": ["10.0.0.0/33"]}}
        }));
        let ConfigState::Invalid(msg, 3) = config_from_lb(&l, &HealthCheckSpec::default(), true)
        else {
            panic!()
        };
        for needle in ["protocol \"SCTP\"", "port 0", "loadBalancerSourceRanges[0]"] {
            assert!(msg.contains(needle), "{needle} missing in {msg}");
        }
    }

    #[test]
    fn same_config_ignores_identity_but_not_generation() {
        let l = lb(
            json!({"status": {"portIP": "192.0.2.10"}, "spec": {"ports": [{"port": 80, "nodePort": 30080}]}}),
        );
        let a = config_from_lb(&l, &HealthCheckSpec::default(), true);
        let b = config_from_lb(&l, &HealthCheckSpec::default(), true);
        assert!(same_config(&a, &b));
        let mut l2 = l.clone();
        l2.metadata.generation = Some(4);
        assert!(!same_config(
            &a,
            &config_from_lb(&l2, &HealthCheckSpec::default(), true)
        ));
        assert!(!same_config(&a, &ConfigState::Pending));
        assert!(same_config(&ConfigState::Pending, &ConfigState::Pending));
    }
}
