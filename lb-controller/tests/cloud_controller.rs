//! The cloud controller end to end against real API servers (kube-testenv; yawol's target/control suites): every
//! test has a target cluster of its own (see `common/mod.rs`), the LoadBalancers live in a namespace of the test's
//! own in the control cluster.

mod common;

use ::kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use ::kube::Api;
use common::{controller_lb_writes, endpoint_names, eventually, Clusters, Harness};
use k8s_openapi::api::core::v1::{Event, Service};
use kube_testenv::json_merge;
use lb_controller::cloud::loadbalancer_spec::ClassFilter;
use serde_json::json;

/// The Services live in their cluster's `default` namespace: the target cluster is the test's own.
const LB: &str = "default--web";

async fn ingress(h: &Harness) -> Option<String> {
    let service = h.service("default", "web").await?;
    lb_controller::cloud::loadbalancer_spec::service_ingress_ip(&service).map(str::to_string)
}

/// The Service's ingress as (ip, ipMode) pairs.
async fn ingress_modes(h: &Harness) -> Vec<(Option<String>, Option<String>)> {
    let service = h.service("default", "web").await.unwrap();
    service
        .status
        .and_then(|s| s.load_balancer)
        .and_then(|l| l.ingress)
        .unwrap_or_default()
        .into_iter()
        .map(|i| (i.ip, i.ip_mode))
        .collect()
}

fn node_port(service: &Service) -> Option<i32> {
    service.spec.as_ref()?.ports.as_ref()?.first()?.node_port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_create_ip_delete() {
    let mut h = Harness::new(Clusters::Split, ClassFilter::default()).await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.put_node("node-b", "True", &["10.0.0.2"]).await;
    h.run().await;
    let service = h
        .create_service("default", "web", json!({}), json!({}))
        .await;
    let allocated = node_port(&service);
    assert!(allocated.is_some(), "the server allocates a nodePort");

    let lb = h.wait_lb(LB, "LoadBalancer created", |_| true).await;
    assert_eq!(lb.metadata.namespace.as_deref(), Some(h.lb_ns.as_str()));
    assert_eq!(
        lb.metadata.annotations.as_ref().unwrap()["yawol.stackit.cloud/serviceName"],
        "default/web"
    );
    assert_eq!(lb.spec.replicas, 1);
    assert_eq!(endpoint_names(&lb), ["node-a", "node-b"]);
    assert_eq!(lb.spec.ports()[0].node_port, allocated);
    assert_eq!(
        lb.spec.infrastructure.default_network.network_id,
        "cluster-net"
    );
    assert_eq!(
        lb.spec.infrastructure.auth_secret_ref.name.as_deref(),
        Some("cloudprovider")
    );
    assert_eq!(
        lb.spec.options().internal_lb,
        Some(false),
        "schema default applied"
    );
    eventually("service finalizer", || async {
        h.service("default", "web")
            .await
            .unwrap()
            .metadata
            .finalizers
            .unwrap_or_default()
            == ["stackit.cloud/loadbalancer"]
    })
    .await;
    h.wait_event("default", "web", "Normal", "LoadBalancer is in creation")
        .await;

    // Not ready yet: no IP on the Service.
    h.set_lb_status(
        LB,
        json!({"externalIP": "192.0.2.7", "readyReplicas": 0, "replicas": 1}),
    )
    .await;
    // Ready: the IP appears, with an event.
    h.set_lb_status(LB, json!({"readyReplicas": 1})).await;
    eventually("ingress IP", || async {
        ingress(&h).await == Some("192.0.2.7".into())
    })
    .await;
    assert_eq!(
        ingress_modes(&h).await,
        [(Some("192.0.2.7".into()), Some("VIP".into()))],
        "ipMode VIP, stored by the API server"
    );
    h.wait_event(
        "default",
        "web",
        "Normal",
        "successfully created with IP 192.0.2.7",
    )
    .await;

    // The OpenStack controllers keep a finalizer on the LoadBalancer until they cleaned up.
    h.lb_api()
        .patch(
            LB,
            &PatchParams::default(),
            &Patch::Merge(
                &json!({"metadata": {"finalizers": ["yawol.stackit.cloud/controller2"]}}),
            ),
        )
        .await
        .unwrap();
    h.service_api("default")
        .delete("web", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_lb(LB, "LoadBalancer deletion requested", |lb| {
        lb.metadata.deletion_timestamp.is_some()
    })
    .await;
    assert!(
        h.service("default", "web").await.is_some(),
        "service waits for the LoadBalancer"
    );
    h.lb_api()
        .patch(
            LB,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    eventually("service released", || async {
        h.service("default", "web").await.is_none()
    })
    .await;
    assert!(h.lb(LB).await.is_none());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn type_change_deletes_loadbalancer_and_clears_ingress() {
    let h = Harness::start().await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.create_service("default", "web", json!({}), json!({}))
        .await;
    h.wait_lb(LB, "created", |_| true).await;
    h.set_lb_status(
        LB,
        json!({"externalIP": "192.0.2.8", "replicas": 1, "readyReplicas": 1}),
    )
    .await;
    eventually("ingress IP", || async { ingress(&h).await.is_some() }).await;

    h.patch_service("default", "web", json!({"spec": {"type": "ClusterIP"}}))
        .await;
    eventually("LoadBalancer deleted", || async {
        h.lb(LB).await.is_none()
    })
    .await;
    eventually("ingress cleared and finalizer removed", || async {
        let svc = h.service("default", "web").await.unwrap();
        ingress(&h).await.is_none() && svc.metadata.finalizers.unwrap_or_default().is_empty()
    })
    .await;

    // Back to LoadBalancer: a new LoadBalancer is created.
    h.patch_service("default", "web", json!({"spec": {"type": "LoadBalancer"}}))
        .await;
    h.wait_lb(LB, "recreated", |_| true).await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn class_filtering() {
    let classes = ClassFilter {
        class_names: vec!["stackit.cloud/yawol".into(), "team-b".into()],
        accept_empty: false,
    };
    let mut h = Harness::new(Clusters::Split, classes).await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.run().await;

    let before = h.metrics.reconcile_count("service");
    h.create_service("default", "empty", json!({}), json!({}))
        .await;
    h.create_service(
        "default",
        "other",
        json!({}),
        json!({"loadBalancerClass": "other.io/lb"}),
    )
    .await;
    h.create_service(
        "default",
        "byclass",
        json!({}),
        json!({"loadBalancerClass": "team-b"}),
    )
    .await;
    h.create_service(
        "default",
        "byannotation",
        json!({"yawol.stackit.cloud/className": "stackit.cloud/yawol"}),
        json!({}),
    )
    .await;
    h.wait_lb("default--byclass", "class in list", |_| true)
        .await;
    h.wait_lb("default--byannotation", "deprecated annotation", |_| true)
        .await;
    h.wait_reconciles(before, 4).await;
    assert!(
        h.lb("default--empty").await.is_none(),
        "empty class not accepted"
    );
    assert!(
        h.lb("default--other").await.is_none(),
        "other class ignored"
    );
    assert!(
        h.service("default", "other")
            .await
            .unwrap()
            .metadata
            .finalizers
            .is_none(),
        "foreign service untouched"
    );

    // The deprecated annotation wins over spec.loadBalancerClass: switching it away deletes the LB.
    h.patch_service(
        "default",
        "byclass",
        json!({"metadata": {"annotations": {"yawol.stackit.cloud/className": "other.io/lb"}}}),
    )
    .await;
    eventually("LoadBalancer of re-classed service deleted", || async {
        h.lb("default--byclass").await.is_none()
    })
    .await;
    eventually("finalizer released", || async {
        h.service("default", "byclass")
            .await
            .unwrap()
            .metadata
            .finalizers
            .unwrap_or_default()
            .is_empty()
    })
    .await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn annotations_applied_and_changed_in_one_write() {
    let mut h = Harness::new(Clusters::Split, ClassFilter::default()).await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.run().await;
    h.create_service("default", "web", json!({}), json!({}))
        .await;
    h.wait_lb(LB, "created", |_| true).await;

    let writes = h.record_lb_writes().await;
    let controller_writes = h.controller_lb_writes_settled().await;
    h.patch_service(
        "default",
        "web",
        json!({"metadata": {"annotations": {
            "yawol.stackit.cloud/replicas": "3",
            "yawol.stackit.cloud/internalLB": "true",
            "yawol.stackit.cloud/imageId": "image-2",
            "yawol.stackit.cloud/flavorId": "flavor-2",
            "yawol.stackit.cloud/availabilityZone": "az-2",
            "yawol.stackit.cloud/defaultNetworkID": "other-net",
            "yawol.stackit.cloud/defaultSubnetID": "other-subnet",
            "yawol.stackit.cloud/floatingNetworkID": "other-floating",
            "yawol.stackit.cloud/additionalNetworks": "extra-net",
            "yawol.stackit.cloud/debug": "true",
            "yawol.stackit.cloud/debugsshkey": "ops",
            "yawol.stackit.cloud/loadBalancerSourceRanges": "10.0.0.0/8",
            "yawol.stackit.cloud/tcpProxyProtocol": "true",
            "yawol.stackit.cloud/tcpProxyProtocolPortsFilter": "80",
            "yawol.stackit.cloud/tcpIdleTimeout": "90s",
            "yawol.stackit.cloud/udpIdleTimeout": "0",
            "yawol.stackit.cloud/logForward": "true",
            "yawol.stackit.cloud/logForwardLokiURL": "http://loki:3100/loki/api/v1/push",
            "yawol.stackit.cloud/logForwardProxyURL": "http://proxy:3128",
            "logging.yawol.stackit.cloud/team": "blue",
            "yawol.stackit.cloud/serverGroupPolicy": "soft-anti-affinity",
        }}}),
    )
    .await;
    let lb = h
        .wait_lb(LB, "all options applied", |lb| lb.spec.replicas == 3)
        .await;
    h.wait_event("default", "web", "Normal", "synced with the service")
        .await;
    // The watch may lag behind the GET above; then no further write may follow.
    eventually("the write seen by the watch", || async {
        writes.count() >= 1
    })
    .await;
    assert_eq!(
        writes.objects()[0].metadata.resource_version,
        lb.metadata.resource_version,
        "all changes in one patch (the first write already had them)"
    );
    assert_eq!(writes.count(), 1, "all changes in one patch");
    assert_eq!(
        h.controller_lb_writes_reaching(controller_writes + 1).await,
        controller_writes + 1
    );
    let infra = &lb.spec.infrastructure;
    assert_eq!(infra.image.image_id.as_deref(), Some("image-2"));
    assert_eq!(infra.flavor.flavor_id.as_deref(), Some("flavor-2"));
    assert_eq!(infra.availability_zone, "az-2");
    assert_eq!(infra.default_network.network_id, "other-net");
    assert_eq!(
        infra.default_network.subnet_id.as_deref(),
        Some("other-subnet")
    );
    assert_eq!(
        infra.default_network.floating_net_id.as_deref(),
        Some("other-floating")
    );
    let extra: Vec<_> = infra
        .additional_networks()
        .iter()
        .map(|n| n.network_id.as_str())
        .collect();
    assert_eq!(extra, ["extra-net", "cluster-net"]);
    assert!(lb.spec.debug_settings().enabled);
    let o = lb.spec.options();
    assert!(o.is_internal());
    assert_eq!(o.source_ranges(), ["10.0.0.0/8"]);
    assert!(o.tcp_proxy_protocol_for_port(80));
    assert_eq!(o.tcp_idle_timeout.as_ref().unwrap().as_str(), "1m30s");
    assert_eq!(o.udp_idle_timeout(), Ok(std::time::Duration::ZERO));
    assert_eq!(
        o.log_forward.as_ref().unwrap().labels.as_ref().unwrap()["team"],
        "blue"
    );
    assert_eq!(o.server_group_policy(), Some("soft-anti-affinity"));

    // Removing the annotations reverts to the defaults (fields are removed, not left behind).
    let service = h.service("default", "web").await.unwrap();
    let nulls: serde_json::Map<String, serde_json::Value> = service
        .metadata
        .annotations
        .unwrap()
        .keys()
        .map(|k| (k.clone(), serde_json::Value::Null))
        .collect();
    h.patch_service(
        "default",
        "web",
        json!({"metadata": {"annotations": nulls}}),
    )
    .await;
    let lb = h
        .wait_lb(LB, "defaults restored", |lb| lb.spec.replicas == 1)
        .await;
    let o = lb.spec.options();
    assert!(!o.is_internal() && !o.tcp_proxy_protocol() && o.tcp_idle_timeout.is_none());
    assert!(lb.spec.infrastructure.additional_networks.is_none());
    assert_eq!(
        lb.spec.infrastructure.image.image_id.as_deref(),
        Some("image-1")
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_annotations_warn_but_do_not_block() {
    let mut h = Harness::new(Clusters::Split, ClassFilter::default()).await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.run().await;
    h.create_service(
        "default",
        "web",
        json!({
            "yawol.stackit.cloud/replicas": "two",
            "yawol.stackit.cloud/tcpIdleTimeout": "1 hour",
            "yawol.stackit.cloud/serverGroupPolicy": "spread-out",
        }),
        json!({}),
    )
    .await;
    let lb = h
        .wait_lb(LB, "created despite bad annotations", |_| true)
        .await;
    assert_eq!(lb.spec.replicas, 1);
    assert!(lb.spec.options().tcp_idle_timeout.is_none());
    h.wait_event("default", "web", "Warning", "yawol.stackit.cloud/replicas")
        .await;
    h.wait_event(
        "default",
        "web",
        "Warning",
        "yawol.stackit.cloud/tcpIdleTimeout",
    )
    .await;
    h.wait_event("default", "web", "Warning", "spread-out")
        .await;
    assert!(h.metrics.annotation_warnings.get() >= 3);

    // projectID is immutable once set.
    h.patch_service(
        "default",
        "web",
        json!({"metadata": {"annotations": {"yawol.stackit.cloud/projectID": "p1"}}}),
    )
    .await;
    h.wait_lb(LB, "projectID set", |lb| {
        lb.spec.infrastructure.project_id.as_deref() == Some("p1")
    })
    .await;
    h.patch_service(
        "default",
        "web",
        json!({"metadata": {"annotations": {"yawol.stackit.cloud/projectID": "p2"}}}),
    )
    .await;
    h.wait_event("default", "web", "Warning", "projectID cannot be changed")
        .await;
    assert_eq!(
        h.lb(LB)
            .await
            .unwrap()
            .spec
            .infrastructure
            .project_id
            .as_deref(),
        Some("p1")
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn existing_floating_ip_cannot_change_after_assignment() {
    let h = Harness::start().await;
    h.create_service(
        "default",
        "web",
        json!({"yawol.stackit.cloud/existingFloatingIP": "192.0.2.50"}),
        json!({}),
    )
    .await;
    let lb = h.wait_lb(LB, "created", |_| true).await;
    assert_eq!(lb.spec.existing_floating_ip.as_deref(), Some("192.0.2.50"));
    h.set_lb_status(
        LB,
        json!({"externalIP": "192.0.2.50", "replicas": 1, "readyReplicas": 1}),
    )
    .await;
    eventually("ingress", || async { ingress(&h).await.is_some() }).await;
    h.patch_service("default", "web", json!({"metadata": {"annotations": {"yawol.stackit.cloud/existingFloatingIP": "192.0.2.51"}}})).await;
    h.wait_event(
        "default",
        "web",
        "Warning",
        "existingFloatingIP cannot be changed",
    )
    .await;
    assert_eq!(
        h.lb(LB).await.unwrap().spec.existing_floating_ip.as_deref(),
        Some("192.0.2.50")
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_errors_are_events_and_nothing_is_created() {
    let h = Harness::start().await;
    h.create_service(
        "default",
        "web",
        json!({}),
        json!({"ports": [{"name": "sctp", "port": 9, "protocol": "SCTP"}]}),
    )
    .await;
    h.wait_event("default", "web", "Warning", "unsupported protocol SCTP")
        .await;
    assert!(h.lb(LB).await.is_none());
    assert_eq!(h.metrics.invalid_services.get(), 1);

    // The target cluster is the test's own: a fixed nodePort cannot collide.
    h.patch_service(
        "default",
        "web",
        json!({"spec": {"allocateLoadBalancerNodePorts": false,
        "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053}]}}),
    )
    .await;
    h.wait_event(
        "default",
        "web",
        "Warning",
        "allocateLoadBalancerNodePorts=false",
    )
    .await;
    assert!(h.lb(LB).await.is_none());

    // Removing the field: the server defaults it to true again.
    h.patch_service(
        "default",
        "web",
        json!({"spec": {"allocateLoadBalancerNodePorts": null}}),
    )
    .await;
    let lb = h.wait_lb(LB, "created once valid", |_| true).await;
    assert_eq!(lb.spec.ports()[0].protocol.as_deref(), Some("UDP"));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_and_protocol_changes() {
    let h = Harness::start().await;
    h.create_service("default", "web", json!({}), json!({}))
        .await;
    h.wait_lb(LB, "created", |_| true).await;
    // A JSON merge patch replaces the whole list (a strategic one would merge by port and protocol).
    h.patch_service("default", "web", json!({"spec": {"ports": [
        {"name": "https", "port": 443, "protocol": "TCP", "nodePort": 30443, "targetPort": 8443},
        {"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053, "targetPort": 53},
    ]}}))
    .await;
    let lb = h
        .wait_lb(LB, "ports synced", |lb| lb.spec.ports().len() == 2)
        .await;
    assert_eq!(lb.spec.ports()[0].port, 443);
    assert_eq!(lb.spec.ports()[1].protocol.as_deref(), Some("UDP"));
    h.patch_service(
        "default",
        "web",
        json!({"spec": {"ports": [
            {"name": "dns", "port": 53, "protocol": "TCP", "nodePort": 30054, "targetPort": 53},
        ]}}),
    )
    .await;
    let lb = h
        .wait_lb(LB, "protocol synced", |lb| lb.spec.ports().len() == 1)
        .await;
    assert_eq!(lb.spec.ports()[0].protocol.as_deref(), Some("TCP"));
    assert_eq!(lb.spec.ports()[0].node_port, Some(30054));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_readiness_termination_and_meltdown() {
    let mut h = Harness::new(Clusters::Split, ClassFilter::default()).await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.put_node("node-b", "True", &["10.0.0.2"]).await;
    h.put_node("node-c", "False", &["10.0.0.3"]).await;
    h.run().await;
    h.create_service("default", "web", json!({}), json!({}))
        .await;
    h.wait_lb(LB, "ready nodes only", |lb| {
        endpoint_names(lb) == ["node-a", "node-b"]
    })
    .await;

    h.put_node("node-c", "True", &["10.0.0.3"]).await;
    h.wait_lb(LB, "node became ready", |lb| {
        endpoint_names(lb) == ["node-a", "node-b", "node-c"]
    })
    .await;

    h.put_node("node-b", "Unknown", &["10.0.0.2"]).await;
    h.wait_lb(LB, "node not ready", |lb| {
        endpoint_names(lb) == ["node-a", "node-c"]
    })
    .await;

    h.put_node_with(
        "node-a",
        "True",
        &["10.0.0.1"],
        json!({"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}),
        vec![],
    )
    .await;
    // Still Ready: it drains (no new connections, the established ones finish) instead of vanishing.
    h.wait_lb(LB, "autoscaler taint", |lb| {
        endpoint_names(lb) == ["node-a (draining)", "node-c"]
    })
    .await;

    h.put_node_with(
        "node-c",
        "True",
        &["10.0.0.3"],
        json!({}),
        vec![json!({"type": "Terminating", "status": "True"})],
    )
    .await;
    // No non-terminating node is Ready now: meltdown protection keeps node-b (NotReady but not
    // terminating) instead of emptying the endpoints.
    h.wait_lb(LB, "meltdown protection", |lb| {
        endpoint_names(lb) == ["node-a (draining)", "node-b", "node-c (draining)"]
    })
    .await;

    h.put_node("node-d", "True", &["10.0.0.4"]).await;
    h.wait_lb(LB, "ready node back", |lb| {
        endpoint_names(lb) == ["node-a (draining)", "node-c (draining)", "node-d"]
    })
    .await;

    h.put_node("node-d", "True", &["10.0.0.40"]).await;
    h.wait_lb(LB, "address change", |lb| {
        lb.spec.endpoints()[2].addresses() == ["10.0.0.40"]
    })
    .await;

    // A draining node that stops being Ready leaves the list (its connections end).
    h.put_node_with(
        "node-a",
        "False",
        &["10.0.0.1"],
        json!({"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}),
        vec![],
    )
    .await;
    h.delete_node("node-d").await;
    h.wait_lb(LB, "node deleted", |lb| {
        endpoint_names(lb) == ["node-b", "node-c (draining)"]
    })
    .await;
    h.stop().await;
}

/// With a LoadBalancer CRD that does not know `endpoints[].draining` (yawol's own, or an older one of ours), the API
/// server drops the field: the controller notices on its first write and leaves terminating nodes out as before
/// (their connections end), with a Warning Event saying why, instead of writing endpoints that would come back as
/// ordinary ones and take new connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crd_without_draining_leaves_terminating_nodes_out() {
    let mut h = Harness::new(Clusters::SplitPrivate, ClassFilter::default()).await;
    let (_, crd) = lb_api::crds()
        .into_iter()
        .find(|(stem, _)| *stem == "yawol.stackit.cloud_loadbalancers")
        .unwrap();
    let mut v = serde_json::to_value(crd).unwrap();
    let endpoint = "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/endpoints/items/properties";
    let removed = v
        .pointer_mut(endpoint)
        .and_then(|p| p.as_object_mut())
        .and_then(|p| p.remove("draining"));
    assert!(removed.is_some(), "our CRD has endpoints[].draining");
    h.apply_control_crd(serde_json::from_value(v).unwrap())
        .await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.put_node_with(
        "node-b",
        "True",
        &["10.0.0.2"],
        json!({"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}),
        vec![],
    )
    .await;
    h.run().await;
    h.create_service("default", "web", json!({}), json!({}))
        .await;
    h.wait_lb(LB, "the terminating node left out", |lb| {
        endpoint_names(lb) == ["node-a"]
    })
    .await;
    h.wait_event("default", "web", "Warning", "endpoints[].draining")
        .await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_heartbeats_do_not_cause_writes() {
    let mut h = Harness::new(Clusters::Split, ClassFilter::default()).await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.run().await;
    h.create_service("default", "web", json!({}), json!({}))
        .await;
    h.wait_lb(LB, "created", |_| true).await;
    let writes = h.record_lb_writes().await;
    let controller_writes = h.controller_lb_writes_settled().await;
    let before = h.metrics.reconcile_count("service");
    // What a kubelet changes all the time: the heartbeat time of its conditions (and, here, a label).
    let start = k8s_openapi::jiff::Timestamp::now();
    for i in 0..25 {
        let heartbeat = start + k8s_openapi::jiff::SignedDuration::from_secs(i + 1);
        h.node_api()
            .patch(
                "node-a",
                &PatchParams::default(),
                &Patch::Merge(&json!({"metadata": {"labels": {"heartbeat": format!("hb-{i}")}}})),
            )
            .await
            .unwrap();
        h.node_api()
            .patch_status(
                "node-a",
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": {"conditions": [
                    {"type": "Ready", "status": "True", "lastHeartbeatTime": heartbeat.to_string()},
                ]}})),
            )
            .await
            .unwrap();
    }
    // A real change afterwards proves the node events were processed in order.
    h.put_node("node-b", "True", &["10.0.0.2"]).await;
    h.wait_lb(LB, "node-b added", |lb| endpoint_names(lb).len() == 2)
        .await;
    eventually("the write seen by the watch", || async {
        writes.count() >= 1
    })
    .await;
    assert_eq!(writes.count(), 1, "only the real change was written");
    assert_eq!(
        h.controller_lb_writes_reaching(controller_writes + 1).await,
        controller_writes + 1
    );
    // The heartbeats themselves trigger nothing (a few reconciles come from the real node change, which
    // re-runs every Service: also the cluster's `kubernetes` Service).
    assert!(h.metrics.reconcile_count("service") - before < 10);
    h.stop().await;
}

/// The Service's IP-family condition as (status, reason, message).
async fn family_condition(h: &Harness, name: &str) -> Option<(String, String, String)> {
    h.service("default", name)
        .await?
        .status?
        .conditions?
        .into_iter()
        .find(|c| c.type_ == "LoadBalancerIPFamilies")
        .map(|c| (c.status, c.reason, c.message))
}

/// Waits until the condition has `status` and `reason`; returns its message.
async fn wait_family_condition(h: &Harness, name: &str, status: &str, reason: &str) -> String {
    common::poll(&format!("{name}: condition {status}/{reason}"), || async {
        family_condition(h, name)
            .await
            .filter(|(s, r, _)| s == status && r == reason)
            .map(|(_, _, m)| m)
    })
    .await
}

/// Warning events about the Service with this reason: (message, count).
async fn warnings(h: &Harness, name: &str, reason: &str) -> Vec<(String, i32)> {
    h.events_for("default", name)
        .await
        .into_iter()
        .filter(|(t, r, _, _)| t == "Warning" && r == reason)
        .map(|(_, _, m, c)| (m, c))
        .collect()
}

async fn wait_warning(h: &Harness, name: &str, reason: &str, contains: &str) {
    eventually(
        &format!("{name}: {reason} event with {contains:?}"),
        || async {
            warnings(h, name, reason)
                .await
                .iter()
                .any(|(m, _)| m.contains(contains))
        },
    )
    .await;
}

fn addresses(lb: &lb_api::LoadBalancer) -> Vec<Vec<String>> {
    lb.spec
        .endpoints()
        .iter()
        .map(|e| e.addresses().to_vec())
        .collect()
}

/// The Service's ingress IPs in order.
async fn ingress_ips(h: &Harness, name: &str) -> Vec<String> {
    h.service("default", name)
        .await
        .and_then(|s| s.status)
        .and_then(|s| s.load_balancer)
        .and_then(|l| l.ingress)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|i| i.ip)
        .collect()
}

/// kube-testenv's API server has IPv4 and IPv6 service ranges, so every combination a user can write exists here.
/// With nodes of both families every combination is served, each LoadBalancer with `spec.ipFamilies` and the nodes'
/// addresses of the served families; a dual-stack LoadBalancer's two addresses both reach the Service's ingress.
/// Once no node has IPv6: PreferDualStack falls back to IPv4 with a warning, RequireDualStack is refused (its
/// LoadBalancer left as it is, never without IPv6 backends), IPv6 single-stack has no backends and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ip_families_are_served_by_the_nodes_addresses_and_refused_never_silently() {
    let mut h = Harness::new(Clusters::Split, ClassFilter::default()).await;
    h.put_node("node-a", "True", &["10.0.0.1", "fd00::1"]).await;
    h.put_node("node-b", "True", &["fd00::2"]).await;
    h.run().await;
    h.create_service("default", "v4", json!({}), json!({"ipFamilies": ["IPv4"]}))
        .await;
    // No ipFamilies: the server fills in its first range's (IPv4), single-stack.
    let plain = h
        .create_service("default", "plain", json!({}), json!({}))
        .await;
    assert_eq!(
        plain.spec.as_ref().unwrap().ip_families.as_deref(),
        Some(["IPv4".to_string()].as_slice())
    );
    let v6 = h
        .create_service("default", "v6", json!({}), json!({"ipFamilies": ["IPv6"]}))
        .await;
    assert_eq!(
        v6.spec.unwrap().ip_family_policy.as_deref(),
        Some("SingleStack")
    );
    h.create_service(
        "default",
        "require",
        json!({}),
        json!({"ipFamilyPolicy": "RequireDualStack"}),
    )
    .await;
    let prefer = h
        .create_service(
            "default",
            "prefer",
            json!({}),
            json!({"ipFamilyPolicy": "PreferDualStack", "ipFamilies": ["IPv6", "IPv4"]}),
        )
        .await;
    assert_eq!(
        prefer.spec.unwrap().ip_families.unwrap(),
        ["IPv6", "IPv4"],
        "the API server is dual-stack"
    );

    for name in ["v4", "plain"] {
        let lb = h.wait_lb(&format!("default--{name}"), name, |_| true).await;
        assert_eq!(endpoint_names(&lb), ["node-a"], "{name}");
        assert_eq!(addresses(&lb), [["10.0.0.1"]], "{name}: IPv4 only");
        assert_eq!(lb.spec.ip_families, None, "{name}: IPv4 as yawol writes it");
        let message = wait_family_condition(&h, name, "True", "Served").await;
        assert_eq!(message, "ipFamilies [IPv4]: served over IPv4");
    }
    let lb = h.wait_lb("default--v6", "v6", |_| true).await;
    assert_eq!(endpoint_names(&lb), ["node-a", "node-b"]);
    assert_eq!(addresses(&lb), [["fd00::1"], ["fd00::2"]], "IPv6 only");
    assert_eq!(
        lb.spec.ip_families.as_deref(),
        Some(["IPv6".to_string()].as_slice())
    );
    wait_family_condition(&h, "v6", "True", "Served").await;
    for (name, families) in [("require", ["IPv4", "IPv6"]), ("prefer", ["IPv6", "IPv4"])] {
        let lb = h.wait_lb(&format!("default--{name}"), name, |_| true).await;
        assert_eq!(endpoint_names(&lb), ["node-a", "node-b"], "{name}");
        assert_eq!(
            addresses(&lb),
            [vec!["10.0.0.1", "fd00::1"], vec!["fd00::2"]],
            "{name}: both families"
        );
        assert_eq!(
            lb.spec.ip_families.unwrap(),
            families,
            "{name}: primary first"
        );
        let message = wait_family_condition(&h, name, "True", "Served").await;
        assert!(message.contains("served over"), "{message}");
    }
    for name in ["v4", "plain", "v6", "require", "prefer"] {
        let events = h.events_for("default", name).await;
        assert!(
            events.iter().all(|(t, _, _, _)| t != "Warning"),
            "{name}: {events:?}"
        );
    }

    // A dual-stack LoadBalancer's addresses: the IPv4 floating IP and the VIP port's IPv6 address, primary first.
    h.set_lb_status(
        "default--prefer",
        json!({"externalIP": "192.0.2.20", "portIP": "10.1.0.20", "portIPv6": "2001:db8::20",
               "replicas": 1, "readyReplicas": 1}),
    )
    .await;
    eventually("prefer's dual-stack ingress", || async {
        ingress_ips(&h, "prefer").await == ["2001:db8::20", "192.0.2.20"]
    })
    .await;
    // Somebody else's condition beside ours stays through what follows.
    h.service_api("default")
        .patch_status(
            "prefer",
            &PatchParams::default(),
            &Patch::Strategic(json!({"status": {"conditions": [{
                "type": "Other", "status": "True", "reason": "Someone", "message": "",
                "lastTransitionTime": "2024-01-01T00:00:00Z",
            }]}})),
        )
        .await
        .unwrap();

    // No node has IPv6 any more.
    let require_before = h.lb("default--require").await.unwrap();
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.put_node("node-b", "True", &["10.0.0.2"]).await;
    let lb = h
        .wait_lb("default--prefer", "prefer falls back to IPv4", |lb| {
            lb.spec.ip_families.is_none()
        })
        .await;
    assert_eq!(addresses(&lb), [["10.0.0.1"], ["10.0.0.2"]]);
    let message = wait_family_condition(&h, "prefer", "False", "NoIPv6Nodes").await;
    assert!(message.contains("IPv6 not served"), "{message}");
    assert!(message.contains("served over IPv4 only"), "{message}");
    wait_warning(&h, "prefer", "NoIPv6Nodes", "IPv6 not served").await;
    eventually("prefer's ingress is IPv4 only", || async {
        ingress_ips(&h, "prefer").await == ["192.0.2.20"]
    })
    .await;
    let status = h
        .service("default", "prefer")
        .await
        .unwrap()
        .status
        .unwrap();
    assert!(
        status
            .conditions
            .unwrap()
            .iter()
            .any(|c| c.type_ == "Other"),
        "the other condition is kept"
    );

    wait_warning(&h, "require", "NoIPv6Nodes", "RequireDualStack").await;
    let message = wait_family_condition(&h, "require", "False", "NoIPv6Nodes").await;
    assert!(
        message.contains("no LoadBalancer is created or changed"),
        "{message}"
    );
    assert_eq!(h.metrics.invalid_services.get(), 1, "the one refusal");
    // Refused: the LoadBalancer keeps what it served (the nodes changed one at a time, so that may be the state
    // between the two updates), never IPv6 without backends.
    let require_after = h.lb("default--require").await.unwrap();
    assert_eq!(
        require_after.spec.ip_families,
        require_before.spec.ip_families
    );
    assert!(
        addresses(&require_after)
            .concat()
            .iter()
            .any(|a| a.contains(':')),
        "{:?}",
        addresses(&require_after)
    );

    let lb = h
        .wait_lb("default--v6", "v6 without backends", |lb| {
            lb.spec.endpoints().is_empty()
        })
        .await;
    assert_eq!(
        lb.spec.ip_families.as_deref(),
        Some(["IPv6".to_string()].as_slice())
    );
    wait_warning(
        &h,
        "v6",
        "NoIPv6Nodes",
        "no backends until the nodes get IPv6",
    )
    .await;
    wait_family_condition(&h, "v6", "False", "NoIPv6Nodes").await;

    // A node change re-runs every Service: nothing is reported twice.
    let before = h.metrics.reconcile_count("service");
    h.put_node("node-c", "True", &["10.0.0.3"]).await;
    h.wait_lb("default--v4", "node-c added", |lb| {
        endpoint_names(lb).len() == 3
    })
    .await;
    h.wait_reconciles(before, 5).await;
    for name in ["v6", "require", "prefer"] {
        let reported = warnings(&h, name, "NoIPv6Nodes").await;
        assert_eq!(reported.len(), 1, "{name}: one event: {reported:?}");
        assert!(
            reported.iter().all(|(_, count)| *count == 1),
            "{name}: reported once"
        );
    }

    // IPv6 back on a node: RequireDualStack is served again, with it.
    h.put_node("node-b", "True", &["10.0.0.2", "fd00::2"]).await;
    h.wait_lb("default--require", "require served again", |lb| {
        lb.spec
            .endpoints()
            .iter()
            .any(|e| e.addresses().contains(&"fd00::2".to_string()))
            && lb.spec.endpoints().len() == 3
    })
    .await;
    wait_family_condition(&h, "require", "True", "Served").await;

    // Another type: the LoadBalancer goes and so does the condition.
    h.patch_service("default", "v4", json!({"spec": {"type": "ClusterIP"}}))
        .await;
    eventually("v4's condition removed", || async {
        h.lb("default--v4").await.is_none() && family_condition(&h, "v4").await.is_none()
    })
    .await;
    h.stop().await;
}

/// Nodes with only IPv6 InternalIPs: the LoadBalancer is created (its address is allocated and stays) without
/// backends, and the Service says why; once the nodes get IPv4 addresses they become its endpoints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_without_ipv4_are_a_warning_not_zero_backends_quietly() {
    let mut h = Harness::new(Clusters::Split, ClassFilter::default()).await;
    h.put_node("node-a", "True", &["fd00::1"]).await;
    h.put_node("node-b", "True", &["fd00::2"]).await;
    h.run().await;
    h.create_service("default", "web", json!({}), json!({}))
        .await;
    let lb = h.wait_lb(LB, "created without backends", |_| true).await;
    assert!(lb.spec.endpoints().is_empty());
    wait_warning(
        &h,
        "web",
        "NoIPv4Nodes",
        "no node that would receive traffic has an IPv4",
    )
    .await;
    let message = wait_family_condition(&h, "web", "False", "NoIPv4Nodes").await;
    assert!(
        message.contains("no backends until the nodes get IPv4 addresses"),
        "{message}"
    );

    h.put_node("node-a", "True", &["10.0.0.1", "fd00::1"]).await;
    let lb = h
        .wait_lb(LB, "node-a's IPv4 address", |lb| {
            !lb.spec.endpoints().is_empty()
        })
        .await;
    assert_eq!(lb.spec.endpoints()[0].addresses(), ["10.0.0.1"]);
    wait_family_condition(&h, "web", "True", "Served").await;
    assert_eq!(warnings(&h, "web", "NoIPv4Nodes").await.len(), 1);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_ip_with_zero_replicas() {
    let h = Harness::start().await;
    h.create_service(
        "default",
        "web",
        json!({"yawol.stackit.cloud/replicas": "0"}),
        json!({}),
    )
    .await;
    let lb = h.wait_lb(LB, "created", |_| true).await;
    assert_eq!(lb.spec.replicas, 0);
    h.set_lb_status(LB, json!({"externalIP": "192.0.2.9"}))
        .await;
    eventually("ingress with 0 replicas", || async {
        ingress(&h).await == Some("192.0.2.9".into())
    })
    .await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_forwarded_to_the_service() {
    let h = Harness::start().await;
    h.create_service("default", "web", json!({}), json!({}))
        .await;
    let lb = h.wait_lb(LB, "created", |_| true).await;
    let events: Api<Event> = Api::namespaced(h.control.clone(), &h.lb_ns);
    let now = k8s_openapi::jiff::Timestamp::now();
    let make = |name: &str, component: &str, reason: &str, message: &str| -> Event {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": h.lb_ns},
            "involvedObject": {
                "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancer",
                "name": LB, "namespace": h.lb_ns, "uid": lb.metadata.uid,
            },
            "source": {"component": component},
            "type": "Warning", "reason": reason, "message": message, "count": 1,
            "firstTimestamp": now.to_string(), "lastTimestamp": now.to_string(),
        }))
        .unwrap()
    };
    events
        .create(
            &PostParams::default(),
            &make("internal", "yawol-controller", "Internal", "not for users"),
        )
        .await
        .unwrap();
    events
        .create(
            &PostParams::default(),
            &make(
                "quota",
                "yawol-service",
                "Failed",
                "Quota exceeded for floatingips",
            ),
        )
        .await
        .unwrap();
    h.wait_event(
        "default",
        "web",
        "Warning",
        "Quota exceeded for floatingips",
    )
    .await;
    // Repeats of the same event are aggregated on the Service, not duplicated.
    events
        .patch(
            "quota",
            &PatchParams::default(),
            &Patch::Merge(&json!({"count": 2})),
        )
        .await
        .unwrap();
    eventually("count bumped", || async {
        h.events_for("default", "web")
            .await
            .iter()
            .any(|(_, _, m, count)| m == "Quota exceeded for floatingips" && *count == 2)
    })
    .await;
    let forwarded = h.events_for("default", "web").await;
    assert_eq!(
        forwarded
            .iter()
            .filter(|(_, _, m, _)| m == "Quota exceeded for floatingips")
            .count(),
        1,
        "aggregated, not duplicated: {forwarded:?}"
    );
    assert!(!forwarded.iter().any(|(_, _, m, _)| m == "not for users"));
    assert_eq!(h.metrics.events_forwarded.get(), 2);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_cluster_and_adoption_of_existing_loadbalancer() {
    // One API server for both roles, and a LoadBalancer that yawol created before (no
    // serviceName annotation, older field shape): it is adopted and converged, not recreated.
    let mut h = Harness::new(Clusters::Single, ClassFilter::default()).await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    let mut lb: serde_json::Value = serde_yaml::from_str(include_str!(
        "../../lb-api/tests/fixtures/loadbalancer.yaml"
    ))
    .unwrap();
    let status = lb["status"].take();
    json_merge(
        &mut lb,
        &json!({"metadata": {
            "namespace": h.lb_ns, "annotations": null, "finalizers": null,
            "resourceVersion": null, "uid": null, "creationTimestamp": null, "generation": null,
        }, "status": null}),
    );
    let lb: lb_api::LoadBalancer = serde_json::from_value(lb).unwrap();
    let uid = h
        .lb_api()
        .create(&PostParams::default(), &lb)
        .await
        .unwrap()
        .metadata
        .uid;
    h.set_lb_status(LB, status).await;
    h.run().await;
    h.create_service("default", "web", json!({}), json!({}))
        .await;
    let lb = h
        .wait_lb(LB, "adopted", |lb| {
            lb.metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key("yawol.stackit.cloud/serviceName"))
                && endpoint_names(lb) == ["node-a"]
        })
        .await;
    assert_eq!(lb.metadata.uid, uid, "not recreated");
    assert_eq!(
        lb.status.unwrap().external_ip.as_deref(),
        Some("192.0.2.10"),
        "status kept"
    );
    eventually("ingress from adopted status", || async {
        ingress(&h).await == Some("192.0.2.10".into())
    })
    .await;
    h.stop().await;
}

/// An ingress published without `ipMode` (by yawol or an older version) gets `ipMode: VIP`, without a second
/// "created" event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingress_published_without_ip_mode_gets_vip() {
    let mut h = Harness::new(Clusters::Split, ClassFilter::default()).await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.create_service("default", "web", json!({}), json!({}))
        .await;
    h.service_api("default")
        .patch_status(
            "web",
            &PatchParams::default(),
            &Patch::Merge(
                &json!({"status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.11"}]}}}),
            ),
        )
        .await
        .unwrap();
    h.run().await;
    h.wait_lb(LB, "created", |_| true).await;
    h.set_lb_status(
        LB,
        json!({"externalIP": "192.0.2.11", "replicas": 1, "readyReplicas": 1}),
    )
    .await;
    eventually("ipMode added", || async {
        ingress_modes(&h).await == [(Some("192.0.2.11".into()), Some("VIP".into()))]
    })
    .await;
    // A new IP is announced; events of one LoadBalancer are written in order, so one for the old IP came first.
    h.set_lb_status(LB, json!({"externalIP": "192.0.2.12"}))
        .await;
    h.wait_event("default", "web", "Normal", "with IP 192.0.2.12")
        .await;
    let created: Vec<_> = h
        .events_for("default", "web")
        .await
        .into_iter()
        .filter(|(_, _, m, _)| m.contains("successfully created with IP"))
        .map(|(_, _, m, _)| m)
        .collect();
    assert_eq!(
        created,
        ["LoadBalancer is successfully created with IP 192.0.2.12"]
    );
    h.stop().await;
}

/// A LoadBalancer that inserts a PROXY header on a TCP port publishes `ipMode: Proxy` (kube-proxy's short-circuit
/// would deliver in-cluster connections without the header); switching the annotation rewrites the stored ipMode,
/// without a second "created" event. Filter ports that get no header are Warning events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ip_mode_follows_proxy_protocol() {
    let mut h = Harness::new(Clusters::Split, ClassFilter::default()).await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.run().await;
    h.create_service(
        "default",
        "web",
        json!({"yawol.stackit.cloud/tcpProxyProtocol": "true"}),
        json!({"ports": [{"name": "http", "port": 80, "protocol": "TCP"},
                         {"name": "dns", "port": 53, "protocol": "UDP"}]}),
    )
    .await;
    h.wait_lb(LB, "created with PROXY protocol", |lb| {
        lb.spec.options().tcp_proxy_protocol()
    })
    .await;
    h.set_lb_status(
        LB,
        json!({"externalIP": "192.0.2.20", "replicas": 1, "readyReplicas": 1}),
    )
    .await;
    let modes = |mode: &str| [(Some("192.0.2.20".to_string()), Some(mode.to_string()))];
    eventually("ipMode Proxy", || async {
        ingress_modes(&h).await == modes("Proxy")
    })
    .await;

    h.patch_service(
        "default",
        "web",
        json!({"metadata": {"annotations": {"yawol.stackit.cloud/tcpProxyProtocol": null}}}),
    )
    .await;
    eventually("ipMode VIP without PROXY protocol", || async {
        ingress_modes(&h).await == modes("VIP")
    })
    .await;

    // The filter selects no TCP port: no header anywhere, and both ports are named in Warnings.
    h.patch_service(
        "default",
        "web",
        json!({"metadata": {"annotations": {
            "yawol.stackit.cloud/tcpProxyProtocol": "true",
            "yawol.stackit.cloud/tcpProxyProtocolPortsFilter": "53,8080",
        }}}),
    )
    .await;
    wait_warning(
        &h,
        "web",
        "ProxyProtocolPortNotTcp",
        "port(s) 53 of the Service",
    )
    .await;
    wait_warning(&h, "web", "ProxyProtocolPortUnknown", "port(s) 8080 that").await;
    h.wait_lb(LB, "filter applied", |lb| {
        lb.spec.options().tcp_proxy_protocol_ports_filter == Some(vec![53, 8080])
    })
    .await;
    assert_eq!(ingress_modes(&h).await, modes("VIP"));

    h.patch_service(
        "default",
        "web",
        json!({"metadata": {"annotations": {"yawol.stackit.cloud/tcpProxyProtocolPortsFilter": "80"}}}),
    )
    .await;
    eventually("ipMode Proxy again", || async {
        ingress_modes(&h).await == modes("Proxy")
    })
    .await;
    let created = h
        .events_for("default", "web")
        .await
        .into_iter()
        .filter(|(_, _, m, _)| m.contains("successfully created with IP"))
        .map(|(_, _, _, count)| count)
        .sum::<i32>();
    assert_eq!(created, 1, "a changed ipMode is no new IP");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_does_not_rewrite_converged_loadbalancers() {
    let mut h = Harness::new(Clusters::Split, ClassFilter::default()).await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.run().await;
    h.create_service(
        "default",
        "web",
        json!({"yawol.stackit.cloud/tcpIdleTimeout": "5m"}),
        json!({}),
    )
    .await;
    let lb = h
        .wait_lb(LB, "created", |lb| {
            lb.spec.options().tcp_idle_timeout.is_some()
        })
        .await;
    let writes = h.record_lb_writes().await;
    // A second controller instance against the same clusters (e.g. after a restart) finds
    // everything converged and writes nothing.
    let (target, control) = h.controller_clients().await;
    let metrics = std::sync::Arc::new(lb_controller::metrics::Metrics::new());
    let health = std::sync::Arc::new(lb_controller::process::http::Health::default());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let second = tokio::spawn(lb_controller::cloud::run::run_controllers(
        target,
        control,
        h.config(),
        metrics.clone(),
        health.clone(),
        async move {
            let _ = stopped.await;
        },
    ));
    // Every Service of the cluster (`web` and `kubernetes`) once.
    let services = h.service_count().await;
    eventually("second instance reconciled", || async {
        metrics.reconcile_count("service") >= services
    })
    .await;
    assert_eq!(controller_lb_writes(&metrics), 0, "no write attempted");
    assert_eq!(writes.count(), 0, "no write seen");
    assert_eq!(
        h.lb(LB).await.unwrap().metadata.resource_version,
        lb.metadata.resource_version
    );
    let _ = stop.send(());
    second.await.unwrap();
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_edits_are_reverted_and_deleted_loadbalancers_recreated() {
    let mut h = Harness::new(Clusters::Split, ClassFilter::default()).await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.run().await;
    h.create_service("default", "web", json!({}), json!({}))
        .await;
    h.wait_lb(LB, "created", |_| true).await;
    h.lb_api()
        .patch(
            LB,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"replicas": 5, "endpoints": null}})),
        )
        .await
        .unwrap();
    h.wait_lb(LB, "reverted", |lb| {
        lb.spec.replicas == 1 && endpoint_names(lb) == ["node-a"]
    })
    .await;
    let uid = h.lb(LB).await.unwrap().metadata.uid;
    h.lb_api()
        .delete(LB, &DeleteParams::default())
        .await
        .unwrap();
    h.wait_lb(LB, "recreated", |lb| lb.metadata.uid != uid)
        .await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_outage_backs_off_and_recovers() {
    let mut h = Harness::new(Clusters::SplitPrivate, ClassFilter::default()).await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.run().await;
    h.create_service("default", "web", json!({}), json!({}))
        .await;
    h.wait_lb(LB, "created", |_| true).await;

    // Both API servers down (SIGTERM, as in a control-plane upgrade); etcd keeps the data. Every try of a watch is
    // one refused connection at the proxy.
    let down = std::time::Instant::now();
    h.stop_apiservers();
    tokio::time::sleep(std::time::Duration::from_millis(11_500)).await;
    let tries: Vec<f64> = h
        .refused_connections()
        .iter()
        .map(|t| t.duration_since(down).as_secs_f64())
        .collect();
    // The watches' backoff (`lb_api::watch::WatchBackoff`): 0.8 s doubling, each delay stretched by a jitter of up to
    // 2x. A watch whose stream broke at the cut retries at once, then at t1 in [0.8, 1.6) s, t2 in [2.4, 4.8) s, t3
    // in [5.6, 11.2) s, t4 after 12 s: exactly one try per watch in each window below. A backoff reset by every
    // attempt (kube-runtime's, which retried about once a second forever) makes two or three per watch in the later
    // windows.
    let count = |from: f64, to: f64| tries.iter().filter(|t| (from..to).contains(*t)).count();
    let watches = count(0.5, 2.4);
    assert!(
        watches >= 2,
        "the outage was noticed: tries at {tries:.2?} s"
    );
    assert!(
        count(2.4, 5.6) <= watches && count(5.6, 11.5) <= watches,
        "{watches} watches made more than one try each after 2.4 s and after 5.6 s (no growing backoff): tries at \
         {tries:.2?} s"
    );
    assert!(
        count(5.6, 11.5) >= 1,
        "still retrying: tries at {tries:.2?} s"
    );

    h.restart_apiservers().await;
    h.put_node("node-b", "True", &["10.0.0.2"]).await;
    // Recovery depends on the watch backoff (at most ~30 s in kube's default backoff).
    h.wait_lb(LB, "endpoints after outage", |lb| {
        endpoint_names(lb) == ["node-a", "node-b"]
    })
    .await;
    h.stop().await;
}

/// Two controller instances with different classes on one target cluster (the reason every test here has a
/// target cluster of its own): each must leave the other's Services alone. Both use the one Service finalizer
/// `stackit.cloud/loadbalancer`; `service_controller::deletion` took any Service carrying it for its own, so the
/// instance of the other class found no LoadBalancer in its namespace, cleared the ingress and removed the finalizer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_controllers_with_different_classes_share_a_target() {
    let only = |class: &str| ClassFilter {
        class_names: vec![class.into()],
        accept_empty: false,
    };
    let mut h = Harness::new(Clusters::Single, only("team-a")).await;
    h.put_node("node-a", "True", &["10.0.0.1"]).await;
    h.run().await;
    h.create_service(
        "default",
        "web",
        json!({}),
        json!({"loadBalancerClass": "team-a"}),
    )
    .await;
    h.wait_lb(LB, "created", |_| true).await;
    h.set_lb_status(
        LB,
        json!({"externalIP": "192.0.2.11", "replicas": 1, "readyReplicas": 1}),
    )
    .await;
    eventually("ingress IP", || async { ingress(&h).await.is_some() }).await;

    // The team-b instance, with LoadBalancers of its own namespace.
    let mut config = h.config();
    config.service.classes = only("team-b");
    config.service.defaults.namespace = h.control_namespace("lbs-b").await;
    let (target, control) = h.controller_clients().await;
    let metrics = std::sync::Arc::new(lb_controller::metrics::Metrics::new());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let second = tokio::spawn(lb_controller::cloud::run::run_controllers(
        target,
        control,
        config,
        metrics.clone(),
        std::sync::Arc::new(lb_controller::process::http::Health::default()),
        async move {
            let _ = stopped.await;
        },
    ));
    let services = h.service_count().await;
    eventually("team-b instance reconciled", || async {
        metrics.reconcile_count("service") >= services
    })
    .await;
    // Long enough for a fight (team-a re-adds the finalizer, team-b removes it) to show.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let service = h.service("default", "web").await.unwrap();
    assert_eq!(
        service.metadata.finalizers.unwrap_or_default(),
        ["stackit.cloud/loadbalancer"],
        "team-a's finalizer kept"
    );
    assert_eq!(
        ingress(&h).await.as_deref(),
        Some("192.0.2.11"),
        "ingress kept"
    );
    let _ = stop.send(());
    second.await.unwrap();
    h.stop().await;
}
