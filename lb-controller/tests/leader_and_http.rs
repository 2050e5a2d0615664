//! Leader election on real Leases of a real API server (kube-testenv), including the binary's hand-over on
//! SIGTERM, and the probe/metrics endpoints.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube_testenv::{wait_for, KubeEnv};
use lb_controller::metrics::Metrics;
use lb_controller::process::leader::{run_as_leader, LeaderElectionConfig};
use tokio::sync::oneshot;

const LEASE: &str = "lb-cloud-controller";

fn config(namespace: &str, identity: &str) -> LeaderElectionConfig {
    LeaderElectionConfig {
        namespace: namespace.into(),
        name: LEASE.into(),
        identity: identity.into(),
        lease_duration: Duration::from_secs(15),
        renew_deadline: Duration::from_secs(10),
        retry_period: Duration::from_millis(100),
    }
}

async fn holder(leases: &Api<Lease>) -> Option<String> {
    leases
        .get_opt(LEASE)
        .await
        .unwrap()
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_one_leader_and_handover_on_release() {
    let env = KubeEnv::shared();
    let client = env.client().await.unwrap();
    let ns = env.namespace(&client, "leader").await.unwrap();
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let (a_started_tx, a_started) = oneshot::channel::<()>();
    let (a_stop_tx, a_stop) = oneshot::channel::<()>();
    let metrics_a = Arc::new(Metrics::new());
    let a = tokio::spawn(run_as_leader(
        client.clone(),
        config(&ns, "a"),
        metrics_a.clone(),
        async move {
            let _ = a_started_tx.send(());
            let _ = a_stop.await;
        },
        std::future::pending(),
    ));
    a_started.await.unwrap();
    assert_eq!(metrics_a.leader.get(), 1);

    let (b_started_tx, mut b_started) = oneshot::channel::<()>();
    let metrics_b = Arc::new(Metrics::new());
    let b = tokio::spawn(run_as_leader(
        client.clone(),
        config(&ns, "b"),
        metrics_b.clone(),
        async move {
            let _ = b_started_tx.send(());
            std::future::pending::<()>().await;
        },
        std::future::pending(),
    ));
    // b keeps trying (several retry periods) while a renews its valid lease.
    let version = |l: Lease| l.metadata.resource_version.unwrap();
    let before = version(leases.get(LEASE).await.unwrap());
    for _ in 0..3 {
        wait_for("a renews", || async {
            Ok(version(leases.get(LEASE).await?) != before)
        })
        .await
        .unwrap();
    }
    assert!(
        b_started.try_recv().is_err(),
        "b must not lead while a renews"
    );
    assert_eq!(holder(&leases).await.as_deref(), Some("a"));

    // a finishes and releases the lease: b takes over without waiting for expiry.
    a_stop_tx.send(()).unwrap();
    a.await.unwrap().unwrap();
    assert_eq!(metrics_a.leader.get(), 0);
    tokio::time::timeout(Duration::from_secs(10), b_started)
        .await
        .expect("b leads")
        .unwrap();
    let lease = leases.get(LEASE).await.unwrap().spec.unwrap();
    assert_eq!(lease.holder_identity.as_deref(), Some("b"));
    assert_eq!(lease.lease_transitions, Some(1));
    b.abort();
}

/// The binary under SIGTERM (what Kubernetes sends a pod being replaced): the leader's Lease goes to the standby
/// while it would still have been valid — before the fix the process died on the signal without releasing it,
/// and the standby waited for expiry (60–70 s with the defaults).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_the_lease_over_before_it_expires() {
    let env = KubeEnv::shared();
    let client = env.client().await.unwrap();
    let ns = env.namespace(&client, "sigterm").await.unwrap();
    env.apply_crds(&client, lb_api::crds().into_iter().map(|(_, c)| c))
        .await
        .unwrap();
    let kubeconfig = env.dir().join(format!("{ns}.kubeconfig"));
    std::fs::write(&kubeconfig, env.admin_kubeconfig()).unwrap();
    let a_probes = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let start = |name: &str, probes: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_lb-controller"))
            .args(["run", "--kubeconfig"])
            .arg(&kubeconfig)
            .args(["--leader-elect", "--leader-election-namespace", &ns])
            .args(["--leader-election-id", LEASE])
            .args(["--leases-duration", "60", "--leases-renew-deadline", "50"])
            .args(["--leases-retry-period", "1"])
            .args([
                "--metrics-bind-address",
                "0",
                "--health-probe-bind-address",
                probes,
            ])
            .args(["--cluster-namespace", &ns, "--secret-name", "cloud"])
            .args(["--floating-net-id", "f", "--network-id", "n"])
            .args(["--flavor-id", "f", "--image-id", "i"])
            .env("POD_NAME", name)
            .spawn()
            .expect("starting lb-controller")
    };
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let mut a = start("a", &a_probes.to_string());
    wait_for("a leads", || async {
        Ok(holder(&leases).await.is_some_and(|h| h.starts_with("a_")))
    })
    .await
    .unwrap();
    let mut b = start("b", "0");
    // SIGTERM once a's controllers run (its caches synced): before `lb_controller::runtime::stop::drive` a shutdown in
    // the first moments after that never finished either (kube-runtime's runner waited for a store that the shutdown
    // kept from becoming ready).
    wait_for("a ready", || async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(a_probes).await?;
        stream
            .write_all(b"GET /readyz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        Ok(response.starts_with("HTTP/1.1 200"))
    })
    .await
    .unwrap();
    let a_lease = leases.get(LEASE).await.unwrap().spec.unwrap();

    // SAFETY: kill on our own child's PID.
    unsafe { libc::kill(a.id() as i32, libc::SIGTERM) };
    let mut status = None;
    for _ in 0..300 {
        status = a.try_wait().unwrap();
        if status.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let Some(status) = status else {
        let _ = (a.kill(), b.kill());
        panic!("a did not exit within 30 s of SIGTERM");
    };
    assert!(
        status.success(),
        "a shuts down cleanly on SIGTERM: {status}"
    );
    wait_for("b leads", || async {
        Ok(holder(&leases).await.is_some_and(|h| h.starts_with("b_")))
    })
    .await
    .unwrap();
    let b_lease = leases.get(LEASE).await.unwrap().spec.unwrap();
    let a_valid_until = a_lease.renew_time.unwrap().0 + Duration::from_secs(60);
    let b_acquired = b_lease.acquire_time.unwrap().0;
    assert!(
        b_acquired < a_valid_until,
        "b took over at {b_acquired}, a's lease was valid until {a_valid_until}: not released"
    );
    let _ = b.kill();
    let _ = b.wait();
}

#[tokio::test]
async fn probes_and_metrics() {
    use lb_controller::process::http::Health;
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    let router = lb_controller::process::http::router(metrics.clone(), health.clone(), false);
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
