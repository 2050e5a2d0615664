//! yawol objects (as stored by the API server after yawol's controllers wrote them) must
//! deserialize into our types and serialize back unchanged.

use std::time::Duration;

use lb_api::{LoadBalancer, LoadBalancerMachine, LoadBalancerSet};
use serde::de::DeserializeOwned;
use serde::Serialize;

fn roundtrip<T: DeserializeOwned + Serialize>(yaml: &str) -> T {
    let original: serde_json::Value = serde_yaml::from_str(yaml).expect("fixture is YAML");
    let typed: T = serde_json::from_value(original.clone()).expect("fixture deserializes");
    let back = serde_json::to_value(&typed).expect("serializes");
    assert_eq!(back, original, "round trip changed the object");
    typed
}

#[test]
fn loadbalancer_roundtrips_and_exposes_fields() {
    let lb: LoadBalancer = roundtrip(include_str!("fixtures/loadbalancer.yaml"));
    let spec = &lb.spec;
    assert_eq!(spec.replicas, 2);
    assert_eq!(spec.endpoints().len(), 2);
    assert_eq!(spec.endpoints()[0].addresses(), ["10.250.0.10", "fd00::10"]);
    assert_eq!(spec.ports()[1].protocol.as_deref(), Some("UDP"));
    let options = spec.options();
    assert!(!options.is_internal());
    assert_eq!(options.tcp_idle_timeout(), Ok(Duration::from_secs(3600)));
    assert_eq!(options.udp_idle_timeout(), Ok(Duration::from_secs(90)));
    assert!(options.tcp_proxy_protocol_for_port(443));
    assert!(!options.tcp_proxy_protocol_for_port(80));
    assert_eq!(
        options.tcp_proxy_protocol_ports(spec.ports()),
        [443],
        "TCP ports in the filter only (53 is UDP)"
    );
    assert_eq!(options.server_group_policy(), Some("soft-anti-affinity"));
    assert_eq!(options.source_ranges().len(), 2);
    let infra = &spec.infrastructure;
    assert_eq!(
        infra.effective_network_id(),
        Some("2b2f1b4e-2222-4a57-9b1e-000000000002")
    );
    assert_eq!(
        infra.default_network.subnet_id.as_deref(),
        Some("3c3f1b4e-3333-4a57-9b1e-000000000003")
    );
    assert_eq!(
        infra.flavor.effective_id(),
        Some("3b11b27e-6c73-470d-b595-1d85b95a8cdf")
    );
    let status = lb.status.as_ref().unwrap();
    assert_eq!(status.external_ip.as_deref(), Some("192.0.2.10"));
    assert_eq!(status.security_group_id_old, status.security_group_id);
}

#[test]
fn legacy_loadbalancer_roundtrips_and_migrates() {
    let mut lb: LoadBalancer = roundtrip(include_str!("fixtures/loadbalancer-legacy.yaml"));
    assert_eq!(lb.spec.replicas, 0);
    assert!(lb.spec.options().is_internal());
    assert!(lb.spec.debug_settings().enabled);
    // Deprecated fields are read through the effective_* accessors ...
    let infra = &mut lb.spec.infrastructure;
    assert_eq!(infra.effective_network_id(), Some("legacy-network"));
    assert_eq!(infra.effective_floating_net_id(), Some("legacy-floating"));
    assert_eq!(infra.flavor.effective_id(), Some("legacy-flavor"));
    assert_eq!(infra.image.effective_id(), Some("legacy-image"));
    // ... and migrated like yawol's LB controller does.
    assert!(infra.migrate_deprecated());
    assert_eq!(infra.default_network.network_id, "legacy-network");
    assert_eq!(
        infra.default_network.floating_net_id.as_deref(),
        Some("legacy-floating")
    );
    assert_eq!(infra.image.image_name.as_deref(), Some("legacy-name"));
    assert!(infra.network_id.is_none() && infra.image.image_id_old.is_none());
    assert!(!infra.migrate_deprecated(), "migration is idempotent");
    // Defaults for unset options.
    assert_eq!(
        lb.spec.options().tcp_idle_timeout(),
        Ok(Duration::from_secs(3600))
    );
    assert_eq!(
        lb.spec.options().udp_idle_timeout(),
        Ok(Duration::from_secs(60))
    );
}

#[test]
fn loadbalancerset_roundtrips() {
    let lbs: LoadBalancerSet = roundtrip(include_str!("fixtures/loadbalancerset.yaml"));
    assert_eq!(lbs.spec.replicas, 2);
    let conditions = lbs.status.unwrap().conditions.unwrap();
    assert_eq!(conditions[0].type_, "HasKeepalivedMaster");
}

#[test]
fn loadbalancermachine_roundtrips() {
    let lbm: LoadBalancerMachine = roundtrip(include_str!("fixtures/loadbalancermachine.yaml"));
    let status = lbm.status.unwrap();
    assert!(status.is_condition_true(lb_api::constants::conditions::ENVOY_UP_TO_DATE));
    assert!(!status.is_condition_true(lb_api::constants::conditions::DATAPLANE_READY));
    assert_eq!(status.metrics.unwrap()[0].value, "0.05");
}

#[test]
fn replicas_default_to_one_when_absent() {
    let yaml = include_str!("fixtures/loadbalancer-legacy.yaml").replace("  replicas: 0\n", "");
    let lb: LoadBalancer = serde_yaml::from_str(&yaml).unwrap();
    assert_eq!(lb.spec.replicas, 1);
}

#[test]
fn invalid_idle_timeout_is_reported_not_defaulted() {
    let mut options = lb_api::LoadBalancerOptions {
        tcp_idle_timeout: Some(lb_api::GoDuration("forever".into())),
        udp_idle_timeout: Some(lb_api::GoDuration("0s".into())),
        ..Default::default()
    };
    assert!(options.tcp_idle_timeout().is_err());
    assert_eq!(
        options.udp_idle_timeout(),
        Ok(Duration::ZERO),
        "0s disables the timeout"
    );
    options.tcp_idle_timeout = Some(Duration::from_secs(330).into());
    assert_eq!(options.tcp_idle_timeout.as_ref().unwrap().as_str(), "5m30s");
}

#[test]
fn set_condition_tracks_transitions() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let t = |s: i64| Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap());
    let mut conditions = Vec::new();
    assert!(lb_api::set_condition(
        &mut conditions,
        "ConfigReady",
        "True",
        "Ok",
        "fine",
        t(10)
    ));
    assert!(!lb_api::set_condition(
        &mut conditions,
        "ConfigReady",
        "True",
        "Ok",
        "fine",
        t(20)
    ));
    assert_eq!(conditions[0].last_heartbeat_time, Some(t(20)));
    assert_eq!(conditions[0].last_transition_time, Some(t(10)));
    assert!(lb_api::set_condition(
        &mut conditions,
        "ConfigReady",
        "False",
        "Bad",
        "broken",
        t(30)
    ));
    assert_eq!(conditions[0].last_transition_time, Some(t(30)));
}
