//! The cloud controller against the real API server (kube-testenv): under exactly the ServiceAccount and RBAC of
//! `deploy/cloud-controller.yaml` with a real token, with the server's own nodePort allocation and defaulting;
//! and through an API-server outage.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::Client;
use kube_testenv::{wait_for, KubeEnv};
use lb_api::LoadBalancer;
use lb_controller::cloud::loadbalancer_spec::ClassFilter;
use lb_controller::cloud::run::run_controllers;
use lb_controller::metrics::Metrics;
use lb_controller::process::http::Health;
use serde_json::json;
use tokio::sync::oneshot;

/// Where `deploy/cloud-controller.yaml` keeps the LoadBalancers (its Role's namespace).
const CONTROL_NS: &str = "kube-system";

struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    fn start(client: Client, lb_namespace: &str) -> Running {
        let mut config = common::run_config(ClassFilter::default());
        config.service.defaults.namespace = lb_namespace.into();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(run_controllers(
            client.clone(),
            client,
            config,
            Arc::new(Metrics::new()),
            Arc::new(Health::default()),
            async move {
                let _ = stopped.await;
            },
        ));
        Running {
            stop: Some(stop),
            task,
        }
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the controllers stop")
            .unwrap();
    }
}

async fn node(admin: &Client, name: &str, ip: &str) {
    let nodes: Api<Node> = Api::all(admin.clone());
    let node: Node = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    match nodes.create(&PostParams::default(), &node).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("creating node {name}: {e}"),
    }
    nodes
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "conditions": [{"type": "Ready", "status": "True"}],
                "addresses": [{"type": "InternalIP", "address": ip}],
            }})),
        )
        .await
        .unwrap();
}

/// A Service of type LoadBalancer as a user writes it: no nodePort, no clusterIP, no ipFamilies.
async fn service(admin: &Client, namespace: &str, name: &str) -> Service {
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"type": "LoadBalancer", "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
    }))
    .unwrap();
    Api::<Service>::namespaced(admin.clone(), namespace)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_under_the_deploy_rbac_with_a_real_token() {
    let probe = log_probe();
    let env = KubeEnv::shared();
    let admin = env.client().await.unwrap();
    let controller = common::kube::deployed_controller(
        env,
        &admin,
        "../deploy/cloud-controller.yaml",
        CONTROL_NS,
        "lb-cloud-controller",
    )
    .await;
    let ns = env.namespace(&admin, "rbac").await.unwrap();
    node(&admin, "rbac-node-a", "10.0.0.1").await;
    let running = Running::start(controller, CONTROL_NS);

    let svc = service(&admin, &ns, "web").await;
    let node_port = svc.spec.unwrap().ports.unwrap()[0].node_port;
    assert!(node_port.is_some(), "the server allocates a nodePort");
    let lbs: Api<LoadBalancer> = Api::namespaced(admin.clone(), CONTROL_NS);
    let lb_name = format!("{ns}--web");
    wait_for("the LoadBalancer with the allocated nodePort", || async {
        Ok(lbs.get_opt(&lb_name).await?.is_some_and(|lb| {
            lb.spec.ports().first().and_then(|p| p.node_port) == node_port
                && lb.spec.endpoints().iter().any(|e| {
                    e.addresses
                        .as_deref()
                        .unwrap_or_default()
                        .contains(&"10.0.0.1".to_string())
                })
        }))
    })
    .await
    .unwrap();

    // The Service's IP-family condition, written to its status under the same RBAC.
    let services: Api<Service> = Api::namespaced(admin.clone(), &ns);
    wait_for("the Service's IP-family condition", || async {
        Ok(services
            .get("web")
            .await?
            .status
            .and_then(|s| s.conditions)
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.type_ == "LoadBalancerIPFamilies" && c.status == "True")
            }))
    })
    .await
    .unwrap();

    // The OpenStack side reports the address; the controller writes it into the Service's status.
    lbs.patch_status(
        &lb_name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"externalIP": "203.0.113.7", "portIP": "10.0.0.100", "readyReplicas": 1, "replicas": 1}})),
    )
    .await
    .unwrap();
    wait_for("the Service's ingress IP", || async {
        Ok(services
            .get("web")
            .await?
            .status
            .and_then(|s| s.load_balancer)
            .and_then(|l| l.ingress)
            .is_some_and(|i| i.iter().any(|i| i.ip.as_deref() == Some("203.0.113.7"))))
    })
    .await
    .unwrap();

    // Deletion: the LoadBalancer goes, then the Service's finalizer.
    services
        .delete("web", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the LoadBalancer deleted", || async {
        Ok(lbs.get_opt(&lb_name).await?.is_none())
    })
    .await
    .unwrap();
    wait_for("the Service gone", || async {
        Ok(services.get_opt("web").await?.is_none())
    })
    .await
    .unwrap();
    // Conflicts are real here (the user's delete races the finalizer update) and are retried; a Forbidden is not.
    assert_eq!(
        probe.forbidden.load(Ordering::SeqCst),
        0,
        "a Forbidden was logged"
    );
    running.stop().await;
}

/// What the controllers log, counted: "watch failed" warnings (one per retry of a broken watch) and anything
/// mentioning Forbidden. One global subscriber for the test binary (the controllers log from the runtime's
/// worker threads); only the outage test breaks watches.
#[derive(Default)]
struct LogProbe {
    watch_retries: AtomicUsize,
    forbidden: AtomicUsize,
}

fn log_probe() -> &'static LogProbe {
    use tracing_subscriber::layer::SubscriberExt;
    static PROBE: std::sync::OnceLock<&'static LogProbe> = std::sync::OnceLock::new();
    PROBE.get_or_init(|| {
        let probe: &'static LogProbe = Box::leak(Box::default());
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(probe))
            .expect("the only global subscriber of this test binary");
        probe
    })
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for &'static LogProbe {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        #[derive(Default)]
        struct Text(String);
        impl tracing::field::Visit for Text {
            fn record_debug(&mut self, _: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0 += &format!("{value:?} ");
            }
        }
        let mut text = Text::default();
        event.record(&mut text);
        if text.0.contains("watch failed") {
            self.watch_retries.fetch_add(1, Ordering::SeqCst);
        }
        if text.0.contains("Forbidden") || text.0.contains("forbidden") {
            self.forbidden.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// The API server down for 20 s: the controllers' watches back off (0.8 s doubling: about 5 tries per watch;
/// kube-runtime's default backoff, reset by every `Init`, retried about once a second — 53 LoadBalancer-watch
/// retries in a 60 s outage), nothing crashes, and a Service created after the restart is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_outage_backs_off_and_recovers() {
    let probe = log_probe();
    let env = KubeEnv::start().await.unwrap();
    let admin = env.client().await.unwrap();
    env.apply_crds(&admin, lb_api::crds().into_iter().map(|(_, c)| c))
        .await
        .unwrap();
    let ns = env.namespace(&admin, "outage").await.unwrap();
    node(&admin, "node-a", "10.0.0.1").await;
    let running = Running::start(admin.clone(), CONTROL_NS);
    service(&admin, &ns, "before").await;
    let lbs: Api<LoadBalancer> = Api::namespaced(admin.clone(), CONTROL_NS);
    wait_for("the first LoadBalancer", || async {
        Ok(lbs.get_opt(&format!("{ns}--before")).await?.is_some())
    })
    .await
    .unwrap();

    env.stop_apiserver();
    let before = probe.watch_retries.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(20)).await;
    let during = probe.watch_retries.load(Ordering::SeqCst) - before;
    env.restart_apiserver().await.unwrap();
    // Two watches of the controller's own (Nodes, LoadBalancers), plus the kube-runtime controllers' (Services,
    // LoadBalancers) which log through kube-runtime, not this message.
    assert!(
        during <= 2 * 8,
        "{during} watch retries in a 20 s outage: no backoff"
    );
    assert!(during >= 2, "the outage was noticed ({during} retries)");

    let admin = env.client().await.unwrap();
    service(&admin, &ns, "after").await;
    let lbs: Api<LoadBalancer> = Api::namespaced(admin.clone(), CONTROL_NS);
    // The watches come back after their current backoff delay: up to 30 s plus jitter.
    kube_testenv::wait_within(
        "a LoadBalancer for a Service created after the outage",
        Duration::from_secs(120),
        || async { Ok(lbs.get_opt(&format!("{ns}--after")).await?.is_some()) },
    )
    .await
    .unwrap();
    assert!(!running.task.is_finished(), "the controllers kept running");
    running.stop().await;
}
