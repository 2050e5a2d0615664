//! Leader election over the fake API server, and the probe/metrics endpoints.

use std::sync::Arc;
use std::time::Duration;

use lb_api::fake_api::{FakeApiServer, ResourceKey};
use lb_controller::leader::{run_as_leader, LeaderElectionConfig};
use lb_controller::metrics::Metrics;
use tokio::sync::oneshot;

fn config(identity: &str) -> LeaderElectionConfig {
    LeaderElectionConfig {
        namespace: "yawol".into(),
        name: "lb-cloud-controller".into(),
        identity: identity.into(),
        lease_duration: Duration::from_secs(15),
        renew_deadline: Duration::from_secs(10),
        retry_period: Duration::from_millis(20),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_one_leader_and_handover_on_release() {
    let server = FakeApiServer::new();
    let (a_started_tx, a_started) = oneshot::channel::<()>();
    let (a_stop_tx, a_stop) = oneshot::channel::<()>();
    let metrics_a = Arc::new(Metrics::new());
    let a = tokio::spawn(run_as_leader(
        server.client(),
        config("a"),
        metrics_a.clone(),
        async move {
            let _ = a_started_tx.send(());
            let _ = a_stop.await;
        },
    ));
    a_started.await.unwrap();
    assert_eq!(metrics_a.leader.get(), 1);

    let (b_started_tx, mut b_started) = oneshot::channel::<()>();
    let metrics_b = Arc::new(Metrics::new());
    let b = tokio::spawn(run_as_leader(
        server.client(),
        config("b"),
        metrics_b.clone(),
        async move {
            let _ = b_started_tx.send(());
            std::future::pending::<()>().await;
        },
    ));
    // b keeps trying (several retry periods) but a holds a valid lease.
    let lease_key = ResourceKey::new("coordination.k8s.io", "leases");
    let renewals = |s: &FakeApiServer| {
        s.get(&lease_key, "yawol", "lb-cloud-controller").unwrap()["metadata"]["resourceVersion"]
            .clone()
    };
    let before = renewals(&server);
    while renewals(&server) == before {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        b_started.try_recv().is_err(),
        "b must not lead while a renews"
    );
    assert_eq!(
        server
            .get(&lease_key, "yawol", "lb-cloud-controller")
            .unwrap()["spec"]["holderIdentity"],
        "a"
    );

    // a finishes and releases the lease: b takes over without waiting for expiry.
    a_stop_tx.send(()).unwrap();
    a.await.unwrap().unwrap();
    assert_eq!(metrics_a.leader.get(), 0);
    tokio::time::timeout(Duration::from_secs(10), b_started)
        .await
        .expect("b leads")
        .unwrap();
    assert_eq!(
        server
            .get(&lease_key, "yawol", "lb-cloud-controller")
            .unwrap()["spec"]["holderIdentity"],
        "b"
    );
    assert_eq!(
        server
            .get(&lease_key, "yawol", "lb-cloud-controller")
            .unwrap()["spec"]["leaseTransitions"],
        1
    );
    b.abort();
}

#[tokio::test]
async fn probes_and_metrics() {
    use lb_controller::run::Health;
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    let router = lb_controller::http::router(metrics.clone(), health.clone(), false);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let get = |path: &'static str| async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(
                format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
            )
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response
    };
    assert!(get("/healthz").await.starts_with("HTTP/1.1 200"));
    assert!(
        get("/readyz").await.starts_with("HTTP/1.1 503"),
        "not ready before caches sync"
    );
    health
        .ready
        .store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(get("/readyz").await.starts_with("HTTP/1.1 200"));
    metrics.observe_reconcile("service", true, Duration::from_millis(3));
    let text = get("/metrics").await;
    assert!(
        text.contains(
            "lb_cloud_controller_reconciles_total{controller=\"service\",result=\"ok\"} 1"
        ),
        "{text}"
    );
    assert!(text.contains("lb_cloud_controller_leader 0"));
    health
        .failed
        .store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(get("/healthz").await.starts_with("HTTP/1.1 503"));
}
