use super::ha::*;
use super::routes::*;
use super::sets::*;
use super::*;
use crate::openstack::fake::FakeCloud;
use crate::openstack::{Cloud, CloudError, Route};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use lb_api::constants::conditions;
use lb_api::LoadBalancerSetStatus;
use std::collections::BTreeSet;

fn lb(extra: Value) -> LoadBalancer {
    let mut v = json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": "web", "namespace": "yawol", "uid": "lb-uid"},
        "spec": {
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": "abc"}},
            "replicas": 2,
            "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
            "endpoints": [{"name": "n1", "addresses": ["10.0.0.1"]}],
            "infrastructure": {
                "defaultNetwork": {"networkID": "net", "floatingNetID": "ext"},
                "flavor": {"flavorID": "f1"}, "image": {"imageID": "i1"},
                "availabilityZone": "az1",
                "authSecretRef": {"name": "cloud", "namespace": "yawol"}
            },
            "options": {"tcpIdleTimeout": "1h0m0s"}
        }
    });
    kube_testenv::json_merge(&mut v, &extra);
    serde_json::from_value(v).expect("fixture parses")
}

fn status() -> LoadBalancerStatus {
    LoadBalancerStatus {
        port_id: Some("vip-port".into()),
        server_group_id: Some("sg-group".into()),
        ..Default::default()
    }
}

fn template(l: &LoadBalancer) -> MachineTemplate {
    machine_template(l, &status()).expect("port exists")
}

fn hash(l: &LoadBalancer) -> String {
    template(l).hash
}

fn now() -> jiff::Timestamp {
    jiff::Timestamp::now()
}

fn ago(secs: i64) -> Time {
    Time(now() - jiff::SignedDuration::from_secs(secs))
}

/// A set as the set controller would report it.
fn set(
    l: &LoadBalancer,
    hash: &str,
    revision: u64,
    replicas: i32,
    ready: i32,
    master: Option<(&str, i64)>,
) -> LoadBalancerSet {
    let t = MachineTemplate {
        hash: hash.to_string(),
        ..template(l)
    };
    let mut s = new_set(l, &t, revision);
    s.spec.replicas = replicas;
    s.metadata.creation_timestamp = Some(ago(60));
    s.status = Some(LoadBalancerSetStatus {
        replicas: Some(replicas),
        ready_replicas: Some(ready),
        available_replicas: Some(ready),
        conditions: master.map(|(status, secs)| {
            vec![Condition {
                type_: conditions::HAS_KEEPALIVED_MASTER.into(),
                status: status.into(),
                reason: "r".into(),
                message: "m".into(),
                last_transition_time: ago(secs),
                observed_generation: None,
            }]
        }),
    });
    s
}

#[test]
fn no_template_before_the_vip_port_exists() {
    assert!(machine_template(&lb(json!({})), &LoadBalancerStatus::default()).is_none());
}

#[test]
fn no_template_while_a_requested_server_group_is_missing() {
    let l = lb(json!({"spec": {"options": {"serverGroupPolicy": "anti-affinity"}}}));
    let mut st = status();
    st.server_group_id = None;
    assert!(machine_template(&l, &st).is_none());
    st.server_group_id = Some(String::new());
    assert!(machine_template(&l, &st).is_none());
    st.server_group_id = Some("sg-group".into());
    assert_eq!(
        machine_template(&l, &st)
            .unwrap()
            .spec
            .server_group_id
            .as_deref(),
        Some("sg-group")
    );
    // Without a policy there is no group to wait for.
    st.server_group_id = None;
    let t = machine_template(&lb(json!({})), &st).expect("no policy, no group needed");
    assert_eq!(t.spec.server_group_id, None);
}

#[test]
fn template_carries_infrastructure_port_server_group_and_reference() {
    let l = lb(json!({}));
    let t = template(&l);
    assert_eq!(t.spec.port_id, "vip-port");
    assert_eq!(t.spec.server_group_id.as_deref(), Some("sg-group"));
    assert_eq!(t.spec.load_balancer_ref.name, "web");
    assert_eq!(t.spec.load_balancer_ref.namespace, "yawol");
    assert_eq!(
        t.spec.infrastructure.flavor.flavor_id.as_deref(),
        Some("f1")
    );
    assert_eq!(t.hash.len(), 16);
    assert!(t.hash.chars().all(|c| c.is_ascii_hexdigit()));
    assert_eq!(hash(&l), hash(&lb(json!({}))), "stable");
}

#[test]
fn hot_changes_keep_the_hash() {
    let base = hash(&lb(json!({})));
    for hot in [
        json!({"spec": {"ports": [{"name": "https", "port": 443, "nodePort": 30443, "protocol": "TCP"}]}}),
        json!({"spec": {"endpoints": [{"name": "n2", "addresses": ["10.0.0.2"]}]}}),
        json!({"spec": {"replicas": 5}}),
        json!({"spec": {"options": {"loadBalancerSourceRanges": ["10.0.0.0/8"], "udpIdleTimeout": "5m0s",
                                     "tcpProxyProtocol": true, "internalLB": true}}}),
        json!({"metadata": {"annotations": {"yawol.stackit.cloud/adHocDebug": "true"}}}),
    ] {
        assert_eq!(hash(&lb(hot.clone())), base, "{hot}");
    }
    // Deprecated fields migrate to the same template.
    let old =
        lb(json!({"spec": {"infrastructure": {"flavor": {"flavorID": null, "flavor_id": "f1"}}}}));
    assert_eq!(hash(&old), base);
}

#[test]
fn rolling_changes_change_the_hash() {
    let base = hash(&lb(json!({})));
    for roll in [
        json!({"spec": {"infrastructure": {"flavor": {"flavorID": "f2"}}}}),
        json!({"spec": {"infrastructure": {"image": {"imageID": "i2"}}}}),
        json!({"spec": {"infrastructure": {"defaultNetwork": {"networkID": "net2"}}}}),
        json!({"spec": {"infrastructure": {"availabilityZone": "az2"}}}),
        json!({"spec": {"infrastructure": {"additionalNetworks": [{"networkID": "x"}]}}}),
        json!({"spec": {"debugSettings": {"enabled": true, "sshkeyName": "k"}}}),
        json!({"spec": {"options": {"serverGroupPolicy": "anti-affinity"}}}),
        json!({"spec": {"options": {"logForward": {"enabled": true, "lokiUrl": "http://l"}}}}),
    ] {
        assert_ne!(hash(&lb(roll.clone())), base, "{roll}");
    }
    // A new VIP port or server group rolls too: the machines' ports and placement depend on them.
    let l = lb(json!({}));
    let mut st = status();
    st.port_id = Some("other-port".into());
    assert_ne!(machine_template(&l, &st).unwrap().hash, base);
    st = status();
    st.server_group_id = None;
    assert_ne!(machine_template(&l, &st).unwrap().hash, base);
}

#[test]
fn bad_templates_are_reported() {
    assert!(template_problems(&lb(json!({}))).is_empty());
    let bad = lb(json!({"spec": {"infrastructure": {
        "flavor": {"flavorID": null, "flavorName": "big"}, "image": {"imageID": ""},
        "defaultNetwork": {"networkID": ""}
    }}}));
    let p = template_problems(&bad);
    assert_eq!(p.len(), 3, "{p:?}");
    assert!(p[0].contains("imageID") && p[1].contains("flavorID") && p[2].contains("networkID"));
}

#[test]
fn new_set_is_named_labelled_annotated_and_owned() {
    let l = lb(json!({}));
    let t = template(&l);
    let s = new_set(&l, &t, 7);
    assert_eq!(s.name_any(), format!("web-{}", t.hash));
    assert_eq!(s.spec.replicas, 2);
    let labels = s.metadata.labels.clone().unwrap();
    assert_eq!(labels["yawol.stackit.cloud/loadbalancer"], "abc");
    assert_eq!(labels["lbm-template-hash"], t.hash);
    assert_eq!(s.spec.selector.match_labels.as_ref(), Some(&labels));
    assert_eq!(s.spec.template.labels.as_ref(), Some(&labels));
    assert_eq!(s.annotations()[lb_annotations::REVISION], "7");
    let owner = &s.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
        ("LoadBalancer", "lb-uid", Some(true))
    );
    assert!(set_of(&s, &l));
    assert_eq!(s.spec.template.spec, t.spec);
}

#[test]
fn first_set_gets_revision_one() {
    let l = lb(json!({}));
    let plan = plan_sets(&l, &template(&l), &[], now(), &RolloutGate::default());
    let created = plan.create.expect("a set");
    assert_eq!(plan.revision, 1);
    assert_eq!(created.annotations()[lb_annotations::REVISION], "1");
    assert!(plan.scale.is_empty() && plan.delete.is_empty());
}

#[test]
fn new_template_gets_the_next_revision_and_keeps_the_old_set() {
    let l = lb(
        json!({"metadata": {"annotations": {"loadbalancer.yawol.stackit.cloud/revision": "3"}}}),
    );
    let old = set(&l, "old", 3, 2, 2, Some(("True", 3600)));
    let plan = plan_sets(&l, &template(&l), &[old], now(), &RolloutGate::default());
    assert_eq!(plan.revision, 4);
    assert_eq!(
        plan.create.unwrap().annotations()[lb_annotations::REVISION],
        "4"
    );
    assert!(
        plan.scale.is_empty(),
        "the old set keeps its machines until the new one is ready"
    );
}

#[test]
fn current_set_follows_the_replicas() {
    let l = lb(json!({"spec": {"replicas": 3}}));
    let h = hash(&l);
    let cur = set(&l, &h, 1, 2, 2, None);
    let plan = plan_sets(&l, &template(&l), &[cur], now(), &RolloutGate::default());
    assert!(plan.create.is_none());
    assert_eq!(plan.scale, [(format!("web-{h}"), 3)]);
    assert_eq!(plan.revision, 1);
}

#[test]
fn old_sets_go_only_when_the_current_is_ready_and_holds_the_vip() {
    let l = lb(json!({}));
    let h = hash(&l);
    let gate = RolloutGate::default();
    let old = set(&l, "old", 1, 2, 2, Some(("True", 3600)));
    let plan_with =
        |cur: LoadBalancerSet| plan_sets(&l, &template(&l), &[old.clone(), cur], now(), &gate);
    // Not ready yet: nothing happens, no timed recheck (the set's status change wakes us).
    let p = plan_with(set(&l, &h, 2, 2, 1, Some(("True", 3600))));
    assert!(p.scale.is_empty() && p.recheck.is_none(), "{p:?}");
    // Ready, master for 30 s: wait ~90 s more.
    let p = plan_with(set(&l, &h, 2, 2, 2, Some(("True", 30))));
    assert!(p.scale.is_empty());
    let wait = p.recheck.unwrap();
    assert!(
        wait > Duration::from_secs(80) && wait <= Duration::from_secs(90),
        "{wait:?}"
    );
    // Master for 2 min: the old set is scaled to 0.
    let p = plan_with(set(&l, &h, 2, 2, 2, Some(("True", 121))));
    assert_eq!(p.scale, [("web-old".to_string(), 0)]);
    // No master reported for 10 min: readiness has to do.
    let p = plan_with(set(&l, &h, 2, 2, 2, Some(("False", 300))));
    assert!(p.scale.is_empty());
    let p = plan_with(set(&l, &h, 2, 2, 2, Some(("False", 601))));
    assert_eq!(p.scale, [("web-old".to_string(), 0)]);
    // No condition at all: after 15 min of the set's life.
    let mut young = set(&l, &h, 2, 2, 2, None);
    young.metadata.creation_timestamp = Some(ago(600));
    assert!(plan_with(young.clone()).scale.is_empty());
    young.metadata.creation_timestamp = Some(ago(901));
    assert_eq!(plan_with(young).scale, [("web-old".to_string(), 0)]);
}

#[test]
fn empty_old_sets_are_deleted_draining_ones_kept() {
    let l = lb(json!({}));
    let h = hash(&l);
    let cur = set(&l, &h, 3, 2, 2, Some(("True", 3600)));
    let empty = set(&l, "empty", 1, 0, 0, None);
    let mut draining = set(&l, "draining", 2, 0, 0, None);
    draining.status.as_mut().unwrap().replicas = Some(1);
    let p = plan_sets(
        &l,
        &template(&l),
        &[cur, empty, draining],
        now(),
        &RolloutGate::default(),
    );
    assert_eq!(p.delete, ["web-empty"]);
    assert!(p.scale.is_empty());
    assert_eq!(p.revision, 3);
}

#[test]
fn zero_replicas_scale_everything_down_at_once() {
    let l = lb(json!({"spec": {"replicas": 0}}));
    let h = hash(&l);
    let cur = set(&l, &h, 2, 2, 0, None);
    let old = set(&l, "old", 1, 2, 2, Some(("True", 3600)));
    let p = plan_sets(
        &l,
        &template(&l),
        &[cur, old],
        now(),
        &RolloutGate::default(),
    );
    assert_eq!(
        p.scale,
        [(format!("web-{h}"), 0), ("web-old".to_string(), 0)]
    );
}

#[test]
fn a_deleting_set_is_not_current() {
    let l = lb(json!({}));
    let h = hash(&l);
    let mut cur = set(&l, &h, 2, 2, 2, None);
    cur.metadata.deletion_timestamp = Some(ago(1));
    let p = plan_sets(&l, &template(&l), &[cur], now(), &RolloutGate::default());
    assert_eq!(
        p.revision, 3,
        "a new revision is created (once the old one is gone)"
    );
    assert!(p.create.is_some());
}

#[test]
fn replicas_are_summed_over_sets() {
    let l = lb(json!({}));
    let a = set(&l, "a", 1, 2, 1, None);
    let b = set(&l, "b", 2, 3, 3, None);
    assert_eq!(replica_sums(&[a, b]), (5, 4));
    assert_eq!(replica_sums(&[]), (0, 0));
}

fn machine(name: &str, lb_name: &str, ip: Option<&str>, deleting: bool) -> LoadBalancerMachine {
    let mut v = json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancerMachine",
        "metadata": {"name": name, "namespace": "yawol"},
        "spec": {
            "infrastructure": {"flavor": {}, "image": {}, "authSecretRef": {}},
            "portID": "p", "loadBalancerRef": {"name": lb_name, "namespace": "yawol"}
        },
        "status": {}
    });
    if let Some(ip) = ip {
        v["status"]["defaultPortIP"] = json!(ip);
    }
    if deleting {
        v["metadata"]["deletionTimestamp"] = json!("2024-01-01T00:00:00Z");
    }
    serde_json::from_value(v).unwrap()
}

#[test]
fn sync_peers_are_the_sorted_addresses_of_live_machines() {
    let l = lb(json!({}));
    let ms = [
        machine("a", "web", Some("10.0.0.12"), false),
        machine("b", "web", Some("10.0.0.9"), false),
        machine("c", "web", Some("10.0.0.12"), false),
        machine("d", "web", None, false),
        machine("e", "web", Some("10.0.0.5"), true),
        machine("f", "other", Some("10.0.0.1"), false),
    ];
    assert_eq!(sync_peers(&l, &ms), "10.0.0.12,10.0.0.9");
    assert_eq!(sync_peers(&l, &[]), "");
}

#[test]
fn router_ids_are_read_and_counted_per_network() {
    let with = |name: &str, net: &str, id: &str| {
        let mut l = lb(
            json!({"metadata": {"annotations": {"loadbalancer.yawol.stackit.cloud/vrrpRouterID": id}},
                              "spec": {"infrastructure": {"defaultNetwork": {"networkID": net}}}}),
        );
        l.metadata.name = Some(name.into());
        l
    };
    assert_eq!(router_id(&with("a", "net", "7")), Ok(Some(7)));
    // The machine controller reads the same annotation (`ha::router_id`) into the cloud-init.
    assert_eq!(router_id(&with("a", "net", " 255 ")), Ok(Some(255)));
    assert_eq!(router_id(&lb(json!({}))), Ok(None));
    for bad in ["0", "256", "x", ""] {
        assert!(router_id(&with("a", "net", bad)).is_err(), "{bad}");
    }
    let me = with("web", "net", "9");
    let all = [
        me.clone(),
        with("a", "net", "7"),
        with("b", "net", "8"),
        with("c", "elsewhere", "10"),
        with("d", "net", "junk"),
    ];
    assert_eq!(taken_router_ids(&me, &all), BTreeSet::from([7, 8]));
}

#[test]
fn revisions_parse() {
    let l = lb(
        json!({"metadata": {"annotations": {"loadbalancer.yawol.stackit.cloud/revision": "12"}}}),
    );
    assert_eq!(revision_of(&l.metadata), Ok(Some(12)));
    assert_eq!(revision_of(&lb(json!({})).metadata), Ok(None));
    let bad = lb(
        json!({"metadata": {"annotations": {"loadbalancer.yawol.stackit.cloud/revision": "v2"}}}),
    );
    assert!(revision_of(&bad.metadata).is_err());
}

#[test]
fn sets_of_other_loadbalancers_are_not_ours() {
    let l = lb(json!({}));
    let mut s = set(&l, "x", 1, 1, 1, None);
    assert!(set_of(&s, &l));
    s.metadata.owner_references.as_mut().unwrap()[0].uid = "someone-else".into();
    assert!(!set_of(&s, &l));
    // Without owner references the selector labels decide.
    s.metadata.owner_references = None;
    assert!(set_of(&s, &l));
    s.metadata.labels = Some(BTreeMap::new());
    assert!(!set_of(&s, &l));
}

fn aa_lb(active: bool, families: Option<Vec<&str>>) -> LoadBalancer {
    let mut extra = json!({"spec": {"options": {"activeActive": active}}});
    if let Some(f) = families {
        extra["spec"]["ipFamilies"] = json!(f);
    }
    lb(extra)
}

fn aa_machine(
    name: &str,
    ip: &str,
    eligible: &str,
    age_s: i64,
    now: jiff::Timestamp,
) -> LoadBalancerMachine {
    let mut m = machine(name, "web", Some(ip), false);
    m.status.as_mut().unwrap().conditions = Some(vec![k8s_openapi::api::core::v1::NodeCondition {
        type_: conditions::VIP_ELIGIBLE.into(),
        status: eligible.into(),
        last_heartbeat_time: Some(Time(now - jiff::SignedDuration::from_secs(age_s))),
        ..Default::default()
    }]);
    m
}

#[test]
fn active_active_is_ipv4_only_for_now() {
    assert!(active_active(&aa_lb(true, None)));
    assert!(!active_active(&aa_lb(false, None)));
    let dual = aa_lb(true, Some(vec!["IPv4", "IPv6"]));
    assert!(!active_active(&dual));
    assert!(active_active_problem(&dual).unwrap().contains("VRRP pair"));
    assert_eq!(active_active_problem(&aa_lb(true, None)), None);
}

#[test]
fn only_fresh_eligible_live_machines_are_next_hops() {
    let now = jiff::Timestamp::now();
    let l = aa_lb(true, None);
    let mut deleting = aa_machine("d", "10.0.0.5", "True", 1, now);
    deleting.metadata.deletion_timestamp = Some(Time(now));
    let mut other = aa_machine("o", "10.0.0.6", "True", 1, now);
    other.spec.load_balancer_ref.name = "other".into();
    let ms = [
        aa_machine("a", "10.0.0.2", "True", 5, now),
        aa_machine("b", "10.0.0.3", "False", 5, now),
        aa_machine("c", "10.0.0.4", "True", 31, now),
        aa_machine("e", "10.0.0.1", "True", 29, now),
        deleting,
        other,
    ];
    let hops: Vec<String> = eligible_next_hops(&l, &ms, now).into_iter().collect();
    assert_eq!(hops, ["10.0.0.1", "10.0.0.2"]);
}

#[tokio::test]
async fn next_hops_follow_the_eligible_machines_and_leave_other_routes_alone() {
    let cloud = FakeCloud::new();
    cloud.add_router("r1", "net", "sub", "10.0.0.1");
    let foreign = Route {
        destination: "192.0.2.0/24".into(),
        nexthop: "10.0.0.9".into(),
    };
    cloud
        .add_router_routes("r1", std::slice::from_ref(&foreign))
        .await
        .unwrap();
    assert_eq!(
        find_router(&cloud, "net", "sub").await.unwrap().as_deref(),
        Some("r1")
    );
    assert_eq!(find_router(&cloud, "net", "other").await.unwrap(), None);

    let dst = vip_destination("10.0.0.100");
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    let c = set_next_hops(&cloud, "r1", &dst, &set(&["10.0.0.2", "10.0.0.3"]))
        .await
        .unwrap();
    assert_eq!(c.added, ["10.0.0.2", "10.0.0.3"]);
    let c = set_next_hops(&cloud, "r1", &dst, &set(&["10.0.0.3", "10.0.0.4"]))
        .await
        .unwrap();
    assert_eq!(
        (c.added, c.removed),
        (vec!["10.0.0.4".into()], vec!["10.0.0.2".to_string()])
    );
    // Unchanged: one read, no write.
    cloud.clear_calls();
    let c = set_next_hops(&cloud, "r1", &dst, &set(&["10.0.0.3", "10.0.0.4"]))
        .await
        .unwrap();
    assert_eq!(c, RouteChange::default());
    assert_eq!(cloud.calls(), ["router_routes"]);
    // Nobody eligible: the routes stay.
    set_next_hops(&cloud, "r1", &dst, &BTreeSet::new())
        .await
        .unwrap();
    assert_eq!(cloud.routes("r1").len(), 3);

    assert_eq!(remove_all(&cloud, "net", &dst).await.unwrap(), 2);
    assert_eq!(cloud.routes("r1"), [foreign]);
    assert_eq!(remove_all(&cloud, "net", &dst).await.unwrap(), 0);
}

#[test]
fn the_condition_says_why() {
    let now = jiff::Timestamp::now();
    let hops = |v: &[&str]| Outcome::Programmed {
        router: "r1".into(),
        next_hops: v.iter().map(|s| s.to_string()).collect(),
    };
    let c = condition(
        None,
        &hops(&["10.0.0.2", "10.0.0.3"]),
        "10.0.0.100/32",
        2,
        now,
    )
    .unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        (conditions::TRUE, conditions::REASON_ROUTES_PROGRAMMED)
    );
    assert!(c.message.contains("10.0.0.2, 10.0.0.3"), "{}", c.message);
    let c1 = condition(Some(&c), &hops(&["10.0.0.2"]), "v", 1, now).unwrap();
    assert_eq!(c1.reason, conditions::REASON_TOO_FEW_REPLICAS);
    assert_eq!(
        condition(None, &hops(&[]), "v", 2, now).unwrap().reason,
        conditions::REASON_NO_ELIGIBLE_MACHINE
    );
    let later = now + jiff::SignedDuration::from_secs(60);
    let c2 = condition(
        Some(&c1),
        &Outcome::NoRouter { subnet: "s".into() },
        "v",
        2,
        later,
    )
    .unwrap();
    assert_eq!(c2.reason, conditions::REASON_NO_ROUTER);
    // Still False: the transition time stays.
    assert_eq!(c2.last_transition_time, c1.last_transition_time);
    let failed = Outcome::Failed(CloudError::new(
        crate::openstack::CloudErrorKind::BadRequest,
        "adding router routes",
        "Invalid input for routes",
    ));
    let c3 = condition(None, &failed, "v", 2, now).unwrap();
    assert_eq!(c3.reason, conditions::REASON_ROUTES_FAILED);
    assert!(c3.message.contains("Invalid input for routes"));
    // No VIP yet: nothing to say.
    assert_eq!(condition(Some(&c3), &Outcome::NoVip, "v", 2, now), None);
}

#[test]
fn switching_to_active_active_rolls_new_machines_and_leaves_vrrp_hashes_alone() {
    let vrrp = lb(json!({}));
    assert_eq!(hash(&vrrp), hash(&aa_lb(false, None)));
    assert_ne!(hash(&vrrp), hash(&aa_lb(true, None)));
    // Asked for but not used (dual stack): the machines stay what they are.
    let dual = |active| aa_lb(active, Some(vec!["IPv4", "IPv6"]));
    assert_eq!(hash(&dual(true)), hash(&dual(false)));
}
