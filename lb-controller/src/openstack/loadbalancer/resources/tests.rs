use super::*;
use crate::openstack::fake::FakeCloud;

/// A LoadBalancer as the cloud controller writes it (YAML keeps the fixture readable).
pub(crate) fn lb(extra_options: &str) -> LoadBalancer {
    let yaml = format!(
        r#"
apiVersion: yawol.stackit.cloud/v1beta1
kind: LoadBalancer
metadata: {{name: default--web, namespace: yawol, uid: u1}}
spec:
  selector: {{matchLabels: {{yawol.stackit.cloud/loadbalancer: abc}}}}
  replicas: 2
  ports:
  - {{name: http, port: 80, nodePort: 30080, protocol: TCP}}
  - {{name: dns, port: 53, nodePort: 30053, protocol: UDP}}
  infrastructure:
    defaultNetwork: {{networkID: net-1, floatingNetID: ext-1}}
    flavor: {{flavorID: f1}}
    image: {{imageID: i1}}
    authSecretRef: {{name: cloud, namespace: yawol}}
  options: {{{extra_options}}}
"#
    );
    serde_yaml::from_str(&yaml).expect("fixture parses")
}

async fn run(cloud: &FakeCloud, lb: &mut LoadBalancer) -> Result<(), StepError> {
    let mut status = lb.status.clone().unwrap_or_default();
    let mut warnings = Vec::new();
    let r = reconcile(cloud, lb, &mut status, &mut DiscardStatus, &mut warnings).await;
    lb.status = Some(status);
    r
}

#[test]
fn rules_cover_egress_vrrp_icmp_ports_and_ranges() {
    let l = lb("loadBalancerSourceRanges: [10.1.2.3/16, 2001:db8::/32, nonsense]");
    let (rules, warnings) = desired_rules(&l, "sg");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    // 2 egress + 2 vrrp + 2 sync + 2 icmp + 2 ports × 2 ranges.
    assert_eq!(rules.len(), 12, "{rules:#?}");
    assert!(rules.iter().any(
        |r| r.protocol.as_deref() == Some("vrrp") && r.remote_group_id.as_deref() == Some("sg")
    ));
    assert!(rules.iter().any(|r| r.protocol.as_deref() == Some("udp")
        && r.port_range_min == Some(53)
        && r.remote_ip_prefix.as_deref() == Some("10.1.0.0/16")));
    assert!(rules
        .iter()
        .any(|r| r.ethertype == EtherType::V6 && r.protocol.as_deref() == Some("tcp")));
    assert!(!rules.iter().any(|r| r.port_range_min == Some(22)));
}

#[test]
fn sync_port_is_open_to_the_same_group_only() {
    let l = lb("loadBalancerSourceRanges: [10.0.0.0/8]");
    let (rules, _) = desired_rules(&l, "sg");
    let sync: Vec<_> = rules
        .iter()
        .filter(|r| r.port_range_min == Some(lb_api::constants::sync::PORT))
        .collect();
    assert_eq!(sync.len(), 2, "one per IP version: {sync:#?}");
    for r in sync {
        assert_eq!(r.direction, Direction::Ingress);
        assert_eq!(r.protocol.as_deref(), Some("tcp"));
        assert_eq!(r.port_range_max, Some(9190));
        assert_eq!(r.remote_group_id.as_deref(), Some("sg"));
        assert_eq!(r.remote_ip_prefix, None, "never from a source range");
    }
    // A service on the same port still gets its own rule from the source ranges, next to the group rule.
    let mut l = lb("loadBalancerSourceRanges: [10.0.0.0/8]");
    l.spec.ports.as_mut().unwrap()[0].port = 9190;
    let (rules, _) = desired_rules(&l, "sg");
    assert_eq!(
        rules
            .iter()
            .filter(|r| r.port_range_min == Some(9190))
            .count(),
        3
    );
}

#[test]
fn ssh_only_with_debug_and_not_twice() {
    let mut l = lb("");
    l.spec.debug_settings = Some(lb_api::LoadBalancerDebugSettings {
        enabled: true,
        sshkey_name: None,
    });
    let (rules, _) = desired_rules(&l, "sg");
    assert_eq!(
        rules
            .iter()
            .filter(|r| r.port_range_min == Some(22))
            .count(),
        2
    );
    // A service on port 22 already opens it (from the source ranges only).
    l.spec.ports.as_mut().unwrap()[0].port = 22;
    let (rules, _) = desired_rules(&l, "sg");
    assert_eq!(
        rules
            .iter()
            .filter(|r| r.port_range_min == Some(22))
            .count(),
        2
    );
}

#[test]
fn diff_treats_anywhere_and_protocol_numbers_as_neutron_does() {
    let l = lb("");
    let (desired, _) = desired_rules(&l, "sg");
    let group = SecurityGroup {
        id: "sg".into(),
        name: "n".into(),
        rules: desired
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let mut spec = r.clone();
                if spec.protocol.as_deref() == Some("vrrp") {
                    spec.protocol = Some("112".into());
                }
                crate::openstack::SecurityGroupRule {
                    id: format!("r{i}"),
                    spec,
                }
            })
            .chain(std::iter::once(crate::openstack::SecurityGroupRule {
                id: "stale".into(),
                spec: RuleSpec {
                    port_range_min: Some(8080),
                    port_range_max: Some(8080),
                    protocol: Some("tcp".into()),
                    ..desired[0].clone()
                },
            }))
            .collect(),
    };
    let (delete, create) = rule_diff(&group, &desired);
    assert_eq!(delete, ["stale"]);
    assert!(create.is_empty(), "{create:#?}");
}

#[tokio::test]
async fn create_records_everything_and_second_run_changes_nothing() {
    let cloud = FakeCloud::new();
    let mut l = lb("serverGroupPolicy: anti-affinity");
    run(&cloud, &mut l).await.unwrap();
    let st = l.status.clone().unwrap();
    assert!(st.floating_id.is_some() && st.port_id.is_some() && st.security_group_id.is_some());
    assert!(st.server_group_id.is_some());
    assert_eq!(
        st.security_group_name.as_deref(),
        Some("yawol/default--web")
    );
    let fip = &cloud.floating_ips()[0];
    assert_eq!(
        fip.port_id, st.port_id,
        "floating IP associated with the VIP port"
    );
    assert_eq!(st.external_ip.as_deref(), Some(fip.address.as_str()));
    assert_eq!(cloud.counts(), (1, 1, 1, 1, 0));

    cloud.clear_calls();
    run(&cloud, &mut l).await.unwrap();
    let writes: Vec<_> = cloud
        .calls()
        .into_iter()
        .filter(|c| !c.starts_with("find_") && !c.starts_with("get_"))
        .collect();
    assert!(writes.is_empty(), "steady state must not write: {writes:?}");
    assert_eq!(cloud.counts(), (1, 1, 1, 1, 0));
}

#[tokio::test]
async fn outage_and_404_never_replace_the_floating_ip() {
    let cloud = FakeCloud::new();
    let mut l = lb("");
    run(&cloud, &mut l).await.unwrap();
    let before = l.status.clone().unwrap();

    cloud.fail_next(
        "get_floating_ip",
        CloudErrorKind::Unavailable,
        "503 Service Unavailable",
    );
    let err = run(&cloud, &mut l).await.unwrap_err();
    assert_eq!(err.step, "floating IP");
    assert!(
        err.to_string().contains("503"),
        "event text carries the cloud's message: {err}"
    );
    assert_eq!(l.status.as_ref().unwrap().floating_id, before.floating_id);

    // A spurious 404 for the ID: found again by address.
    cloud.fail_next("get_floating_ip", CloudErrorKind::NotFound, "not found");
    run(&cloud, &mut l).await.unwrap();
    assert_eq!(l.status.as_ref().unwrap().floating_id, before.floating_id);

    // Really gone: an error, never a new address.
    cloud
        .delete_floating_ip(before.floating_id.as_deref().unwrap())
        .await
        .unwrap();
    let err = run(&cloud, &mut l).await.unwrap_err();
    assert!(err.to_string().contains("not allocating"), "{err}");
    assert_eq!(cloud.floating_ips().len(), 0);
    assert_eq!(l.status.as_ref().unwrap().external_ip, before.external_ip);
}

#[tokio::test]
async fn adopts_by_description_and_existing_fip_is_renamed_and_kept() {
    let cloud = FakeCloud::new();
    let adopted = cloud.add_floating_ip("203.0.113.77", "yawol/default--web");
    let mut l = lb("");
    run(&cloud, &mut l).await.unwrap();
    assert_eq!(
        l.status.as_ref().unwrap().floating_id.as_deref(),
        Some(adopted.id.as_str())
    );
    delete(&cloud, &l).await.unwrap();
    assert_eq!(cloud.counts(), (0, 0, 0, 0, 0));

    let user = cloud.add_floating_ip("203.0.113.99", "yawol/default--web");
    let mut l = lb("");
    l.spec.existing_floating_ip = Some("203.0.113.99".into());
    run(&cloud, &mut l).await.unwrap();
    assert_eq!(
        l.status.as_ref().unwrap().external_ip.as_deref(),
        Some("203.0.113.99")
    );
    assert!(cloud.floating_ips()[0]
        .description
        .ends_with(USER_MANAGED_SUFFIX));
    delete(&cloud, &l).await.unwrap();
    assert_eq!(
        cloud.floating_ips()[0].id,
        user.id,
        "a user's floating IP survives deletion"
    );
}

#[tokio::test]
async fn internal_lb_has_no_fip_and_external_ip_is_the_vip() {
    let cloud = FakeCloud::new();
    let mut l = lb("internalLB: true");
    run(&cloud, &mut l).await.unwrap();
    let st = l.status.clone().unwrap();
    assert!(st.floating_id.is_none());
    assert_eq!(st.external_ip, st.port_ip);
    assert_eq!(cloud.floating_ips().len(), 0);

    // External → internal releases our floating IP.
    let mut l = lb("");
    run(&cloud, &mut l).await.unwrap();
    l.spec.options.as_mut().unwrap().internal_lb = Some(true);
    run(&cloud, &mut l).await.unwrap();
    assert_eq!(cloud.floating_ips().len(), 0);
}

#[tokio::test]
async fn keep_annotations_are_honoured_on_delete() {
    let cloud = FakeCloud::new();
    let mut l = lb("");
    run(&cloud, &mut l).await.unwrap();
    for key in [
        annotations::KEEP_FLOATING_IP,
        annotations::KEEP_PORT,
        annotations::KEEP_SECURITY_GROUP,
    ] {
        l.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(key.into(), "true".into());
    }
    delete(&cloud, &l).await.unwrap();
    assert_eq!(cloud.counts(), (1, 1, 1, 0, 0));

    // keepPort alone: the port stays, but without the (deleted) security group.
    let cloud = FakeCloud::new();
    let mut l = lb("");
    run(&cloud, &mut l).await.unwrap();
    l.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(annotations::KEEP_PORT.into(), "true".into());
    delete(&cloud, &l).await.unwrap();
    assert_eq!(cloud.counts(), (0, 0, 1, 0, 0));
    assert!(cloud.ports()[0].security_groups.is_empty());
}

#[tokio::test]
async fn server_group_policy_change_recreates_and_empty_deletes() {
    let cloud = FakeCloud::new();
    let mut l = lb("serverGroupPolicy: affinity");
    run(&cloud, &mut l).await.unwrap();
    let first = l.status.as_ref().unwrap().server_group_id.clone();
    l.spec.options.as_mut().unwrap().server_group_policy = Some("anti-affinity".into());
    run(&cloud, &mut l).await.unwrap();
    assert_ne!(l.status.as_ref().unwrap().server_group_id, first);
    assert_eq!(cloud.counts().3, 1);
    l.spec.options.as_mut().unwrap().server_group_policy = None;
    run(&cloud, &mut l).await.unwrap();
    assert_eq!(cloud.counts().3, 0);
    assert!(l.status.as_ref().unwrap().server_group_id.is_none());
}

#[test]
fn reconcile_needed_on_hash_change_and_resync() {
    let mut l = lb("");
    let now = jiff::Timestamp::now();
    let resync = std::time::Duration::from_secs(300);
    assert!(needs_openstack_reconcile(&l, now, resync));
    l.status = Some(LoadBalancerStatus {
        last_openstack_reconcile: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now)),
        openstack_reconcile_hash: Some(openstack_hash(&l)),
        floating_id: Some("f".into()),
        external_ip: Some("203.0.113.1".into()),
        ..Default::default()
    });
    assert!(!needs_openstack_reconcile(&l, now, resync));
    assert!(needs_openstack_reconcile(
        &l,
        now + std::time::Duration::from_secs(301),
        resync
    ));
    l.spec.ports.as_mut().unwrap()[0].port = 8080;
    assert!(needs_openstack_reconcile(&l, now, resync));
}

fn with_families(mut l: LoadBalancer, families: &[&str]) -> LoadBalancer {
    l.spec.ip_families = Some(families.iter().map(|f| f.to_string()).collect());
    l
}

#[tokio::test]
async fn dual_stack_vip_port_gets_an_ipv6_address_and_no_second_floating_ip() {
    let cloud = FakeCloud::new();
    cloud.add_subnet("v6-1", "net-1", 6, "2001:db8:1::/64");
    cloud.add_subnet("v6-other-net", "net-2", 6, "2001:db8:2::/64");
    let mut l = with_families(lb(""), &["IPv4", "IPv6"]);
    run(&cloud, &mut l).await.unwrap();
    let st = l.status.clone().unwrap();
    let port = cloud.port(st.port_id.as_deref().unwrap()).unwrap();
    assert_eq!(port.fixed_ips.len(), 2, "{port:?}");
    let v6 = st.port_ipv6.clone().expect("IPv6 VIP in status");
    assert!(v6.starts_with("2001:db8:1::"), "{v6}");
    assert_eq!(port.ip_on_subnet("v6-1"), Some(v6.as_str()));
    assert!(
        !st.port_ip.as_deref().unwrap().contains(':'),
        "portIP stays IPv4"
    );
    assert_eq!(cloud.floating_ips().len(), 1, "one floating IP, for IPv4");
    assert_eq!(
        st.external_ip.as_deref(),
        Some(cloud.floating_ips()[0].address.as_str())
    );
    assert!(!needs_openstack_reconcile(
        &l,
        jiff::Timestamp::now(),
        std::time::Duration::from_secs(300)
    ));

    // Steady state: no write.
    cloud.clear_calls();
    run(&cloud, &mut l).await.unwrap();
    let writes: Vec<_> = cloud
        .calls()
        .into_iter()
        .filter(|c| !c.starts_with("find_") && !c.starts_with("get_"))
        .collect();
    assert!(writes.is_empty(), "{writes:?}");

    // IPv6 dropped: no longer published (the address stays on the port, unused).
    l.spec.ip_families = None;
    run(&cloud, &mut l).await.unwrap();
    assert_eq!(l.status.as_ref().unwrap().port_ipv6, None);
    delete(&cloud, &l).await.unwrap();
    assert_eq!(cloud.counts(), (0, 0, 0, 0, 0), "nothing leaks");
}

#[tokio::test]
async fn ipv6_is_added_to_an_existing_ipv4_vip_port() {
    let cloud = FakeCloud::new();
    cloud.add_subnet("v6-1", "net-1", 6, "2001:db8:1::/64");
    let mut l = lb("");
    run(&cloud, &mut l).await.unwrap();
    let before = l.status.clone().unwrap();
    assert_eq!(before.port_ipv6, None);
    l.spec.ip_families = Some(vec!["IPv4".into(), "IPv6".into()]);
    assert!(needs_openstack_reconcile(
        &l,
        jiff::Timestamp::now(),
        std::time::Duration::from_secs(300)
    ));
    run(&cloud, &mut l).await.unwrap();
    let st = l.status.clone().unwrap();
    assert_eq!(st.port_id, before.port_id, "the same port");
    assert_eq!(st.port_ip, before.port_ip, "its IPv4 address kept");
    assert_eq!(st.floating_id, before.floating_id);
    assert!(st.port_ipv6.is_some());
    assert_eq!(cloud.ports()[0].fixed_ips.len(), 2);
}

#[tokio::test]
async fn ipv6_only_has_no_floating_ip_and_the_ipv6_address_is_external() {
    let cloud = FakeCloud::new();
    cloud.add_subnet("v6-1", "net-1", 6, "2001:db8:1::/64");
    let mut l = with_families(lb(""), &["IPv6"]);
    run(&cloud, &mut l).await.unwrap();
    let st = l.status.clone().unwrap();
    assert_eq!(cloud.floating_ips().len(), 0);
    assert_eq!(st.floating_id, None);
    assert!(st.port_ipv6.is_some());
    assert_eq!(st.external_ip, st.port_ipv6);

    // From dual-stack to IPv6 only: our floating IP is released.
    let cloud = FakeCloud::new();
    cloud.add_subnet("v6-1", "net-1", 6, "2001:db8:1::/64");
    let mut l = with_families(lb(""), &["IPv4", "IPv6"]);
    run(&cloud, &mut l).await.unwrap();
    assert_eq!(cloud.floating_ips().len(), 1);
    l.spec.ip_families = Some(vec!["IPv6".into()]);
    run(&cloud, &mut l).await.unwrap();
    assert_eq!(cloud.floating_ips().len(), 0);
    let st = l.status.clone().unwrap();
    assert_eq!(st.external_ip, st.port_ipv6);
}

#[tokio::test]
async fn ipv6_subnet_is_explicit_or_the_only_one_else_an_error_that_says_what_to_set() {
    let cloud = FakeCloud::new();
    let mut l = with_families(lb(""), &["IPv4", "IPv6"]);
    let err = run(&cloud, &mut l).await.unwrap_err();
    assert_eq!(err.step, "port's IPv6 address");
    assert!(err.to_string().contains("has no IPv6 subnet"), "{err}");
    let st = l.status.clone().unwrap();
    assert!(st.port_id.is_some(), "the port is recorded, not leaked");
    assert_eq!(st.port_ipv6, None);

    cloud.add_subnet("v6-a", "net-1", 6, "2001:db8:a::/64");
    cloud.add_subnet("v6-b", "net-1", 6, "2001:db8:b::/64");
    let err = run(&cloud, &mut l).await.unwrap_err();
    assert!(
        err.to_string().contains("2 IPv6 subnets") && err.to_string().contains("subnetIDv6"),
        "{err}"
    );

    l.spec.infrastructure.default_network.subnet_id_v6 = Some("v6-b".into());
    run(&cloud, &mut l).await.unwrap();
    let v6 = l.status.as_ref().unwrap().port_ipv6.clone().unwrap();
    assert!(v6.starts_with("2001:db8:b::"), "{v6}");
    delete(&cloud, &l).await.unwrap();
    assert_eq!(cloud.counts(), (0, 0, 0, 0, 0));
}
