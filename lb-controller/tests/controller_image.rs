//! lb-controller's OCI image, as `cargo xtask image controller` builds it, run by podman (rootful, no
//! daemon) against the real API server: it runs as user 65532 on a read-only root with every capability dropped,
//! under the ServiceAccount and RBAC of the generated `deploy/cloud-controller.yaml` with a real token, with
//! leader election; it serves `/healthz` and `/metrics`, reconciles a Service of type LoadBalancer into a
//! LoadBalancer, and stops cleanly on SIGTERM. The kubeconfig names the API server by a DNS name that only a real DNS
//! server (dnsmasq) answers, so the static binary's name resolution in the empty image is part of the run.
//!
//! `test = false` in Cargo.toml: a plain `cargo test` has no image. The controller-image stage of `cargo xtask test`
//! builds it and runs this file with `LB_CONTROLLER_IMAGE=oci:<layout>:<tag>`; by hand:
//! `cargo xtask image controller`, then `LB_CONTROLLER_IMAGE=oci:$PWD/target/image/controller/oci:0.1.0 cargo test
//! --workspace --exclude lb-testbed --test controller_image`.

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Service};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube_testenv::{wait_for, KubeEnv};
use lb_api::LoadBalancer;
use serde_json::json;

/// The namespace and ServiceAccount of `deploy/cloud-controller.yaml`.
const NAMESPACE: &str = "kube-system";
const SERVICE_ACCOUNT: &str = "lb-cloud-controller";
/// The API server's name in the container: in no hosts file, only in the test's DNS server.
const API_NAME: &str = "api.lb-image.test";

/// `podman` with the runtime this machine can use (crun refuses its hybrid cgroup layout).
fn podman() -> Command {
    let mut cmd = Command::new("podman");
    cmd.args(["--runtime", "runc"]);
    cmd
}

fn podman_out(args: &[&str]) -> String {
    let out = podman()
        .args(args)
        .output()
        .expect("podman runs (Debian's podman; the controller-image stage installs it)");
    assert!(
        out.status.success(),
        "podman {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// What the test started, removed however it ends.
struct Cleanup {
    container: String,
    image: Option<String>,
    dnsmasq: Option<Child>,
    dir: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = podman()
            .args(["rm", "--force", &self.container])
            .stdout(Stdio::null())
            .status();
        if let Some(image) = &self.image {
            let _ = podman()
                .args(["rmi", "--force", image])
                .stdout(Stdio::null())
                .status();
        }
        if let Some(mut dnsmasq) = self.dnsmasq.take() {
            let _ = dnsmasq.kill();
            let _ = dnsmasq.wait();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn write(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    // Readable by the image's user 65532.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET path` over plain HTTP/1.0: the status code and the body.
fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let code = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((code, body))
}

/// The container's state, failing the test with its logs once it has exited.
fn assert_running(container: &str) {
    if podman_out(&["inspect", "--format", "{{.State.Running}}", container]) != "true" {
        let logs = podman()
            .args(["logs", container])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout).into_owned()
                    + &String::from_utf8_lossy(&o.stderr)
            })
            .unwrap_or_default();
        panic!("the controller container exited:\n{logs}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_runs_serves_health_and_reconciles_a_service() {
    let image_ref = std::env::var("LB_CONTROLLER_IMAGE").expect(
        "LB_CONTROLLER_IMAGE is not set: build the image (`cargo xtask image controller`) and set it to \
         oci:<layout>:<tag> (the controller-image stage of `cargo xtask test` does both)",
    );
    let env = KubeEnv::shared();
    let admin = env.client().await.unwrap();
    // The CRDs and the RBAC of the generated manifest, and a token of its ServiceAccount, as a kubelet mints one.
    common::kube::deployed_controller(
        env,
        &admin,
        "../deploy/cloud-controller.yaml",
        NAMESPACE,
        SERVICE_ACCOUNT,
    )
    .await;
    let token = env.token(&admin, NAMESPACE, SERVICE_ACCOUNT).await.unwrap();

    let pid = std::process::id();
    let dir = std::env::temp_dir().join(format!("lb-controller-image-test-{pid}"));
    std::fs::create_dir_all(&dir).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let mut cleanup = Cleanup {
        container: format!("lb-controller-image-test-{pid}"),
        image: None,
        dnsmasq: None,
        dir: dir.clone(),
    };

    // The API server by name: the kubeconfig's server is API_NAME (TLS still verifies the serving certificate, for
    // `localhost`), which resolves only through the DNS server below.
    let url = env.url();
    let kubeconfig = env.token_kubeconfig(&token).replace(
        &format!("server: {url}"),
        &format!(
            "tls-server-name: localhost\n    server: {}",
            url.replace("127.0.0.1", API_NAME)
        ),
    );
    assert!(kubeconfig.contains(API_NAME), "{kubeconfig}");
    write(&dir.join("kubeconfig"), &kubeconfig);
    // A loopback address of its own per run, so parallel runs on one machine do not share port 53.
    let dns = format!("127.0.53.{}", 10 + pid % 240);
    write(
        &dir.join("resolv.conf"),
        &format!("nameserver {dns}\noptions timeout:1 attempts:3\n"),
    );
    write(&dir.join("hosts"), "127.0.0.1 localhost\n");
    let dns_log = dir.join("dnsmasq.log");
    cleanup.dnsmasq = Some(
        Command::new("dnsmasq")
            .args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
            ])
            .arg(format!("--listen-address={dns}"))
            .args([
                "--bind-interfaces",
                "--port=53",
                "--log-queries",
                "--log-facility=-",
            ])
            .arg(format!("--address=/{API_NAME}/127.0.0.1"))
            .arg(format!("--pid-file={}", dir.join("dnsmasq.pid").display()))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&dns_log).unwrap())
            .spawn()
            .expect("dnsmasq starts (Debian's dnsmasq-base)"),
    );

    // podman checks the layout as it pulls (index, manifest, config and layer digests).
    let image = podman_out(&["pull", "--quiet", &image_ref]);
    let image = image.lines().last().unwrap().to_owned();
    cleanup.image = Some(image.clone());
    let labels: serde_json::Value = serde_json::from_str(&podman_out(&[
        "image",
        "inspect",
        "--format",
        "{{json .Labels}}",
        &image,
    ]))
    .unwrap();
    for label in ["version", "revision", "source", "created", "title"] {
        let key = format!("org.opencontainers.image.{label}");
        assert!(
            labels[&key].as_str().is_some_and(|v| !v.is_empty()),
            "no {key} label: {labels}"
        );
    }

    let (probes, metrics) = (free_port(), free_port());
    // podman's default open-files limit (1048576) is above what this machine lets a process set (no
    // CAP_SYS_RESOURCE here), and podman lowers its own process limit to 32768, below ours, before the runtime
    // starts: the container gets our open-files limit and a process limit under podman's.
    let mut nofile = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    assert_eq!(
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut nofile) },
        0
    );
    let nofile = format!("{}:{}", nofile.rlim_cur, nofile.rlim_max);
    let nproc = "4096:4096";
    let mount = |file: &str, at: &str| format!("{}:{at}:ro", dir.join(file).display());
    let mut run = podman();
    run.args([
        "run",
        "--detach",
        "--name",
        &cleanup.container,
        "--network",
        "host",
    ])
    .args([
        "--read-only",
        "--cap-drop",
        "all",
        "--security-opt",
        "no-new-privileges",
    ])
    .arg(format!("--ulimit=nofile={nofile}"))
    .arg(format!("--ulimit=nproc={nproc}"))
    .args([
        "--volume",
        &mount("kubeconfig", "/etc/lb-controller/kubeconfig"),
    ])
    .args(["--volume", &mount("resolv.conf", "/etc/resolv.conf")])
    .args(["--volume", &mount("hosts", "/etc/hosts")]);
    for (name, value) in [
        ("KUBECONFIG", "/etc/lb-controller/kubeconfig"),
        ("POD_NAME", "image-test"),
        ("CLUSTER_NAMESPACE", NAMESPACE),
        ("SECRET_NAME", "cloudprovider"),
        ("FLOATING_NET_ID", "ext"),
        ("NETWORK_ID", "net"),
        ("FLAVOR_ID", "f"),
        ("IMAGE_ID", "i"),
    ] {
        run.args(["--env", &format!("{name}={value}")]);
    }
    run.arg(&image)
        .args([
            "run",
            "--leader-elect",
            "--leader-election-id=lb-cloud-controller",
        ])
        .arg(format!("--health-probe-bind-address=127.0.0.1:{probes}"))
        .arg(format!("--metrics-bind-address=127.0.0.1:{metrics}"));
    let out = run.output().unwrap();
    assert!(
        out.status.success(),
        "podman run: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let container = cleanup.container.clone();

    wait_for("/healthz answers 200", || async {
        assert_running(&container);
        Ok(http_get(probes, "/healthz").is_ok_and(|(code, _)| code == 200))
    })
    .await
    .unwrap();
    let uid = {
        let pid = podman_out(&["inspect", "--format", "{{.State.Pid}}", &container]);
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().next())
            .unwrap()
            .to_owned()
    };
    assert_eq!(uid, "65532", "the image's user");

    // A Service of type LoadBalancer becomes a LoadBalancer with the allocated nodePort and the node's address.
    let nodes: Api<Node> = Api::all(admin.clone());
    let node: Node = serde_json::from_value(json!({"metadata": {"name": "image-node-a"}})).unwrap();
    match nodes.create(&PostParams::default(), &node).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("creating the node: {e}"),
    }
    nodes
        .patch_status(
            "image-node-a",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "conditions": [{"type": "Ready", "status": "True"}],
                "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
            }})),
        )
        .await
        .unwrap();
    let ns = env.namespace(&admin, "image").await.unwrap();
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"type": "LoadBalancer", "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
    }))
    .unwrap();
    let svc = Api::<Service>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    let node_port = svc.spec.unwrap().ports.unwrap()[0].node_port;
    let lbs: Api<LoadBalancer> = Api::namespaced(admin.clone(), NAMESPACE);
    let lb_name = format!("{ns}--web");
    wait_for("the LoadBalancer of the Service", || async {
        assert_running(&container);
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

    let (code, body) = http_get(metrics, "/metrics").unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("lb_cloud_controller_"), "{body}");
    let lease = Api::<Lease>::namespaced(admin.clone(), NAMESPACE)
        .get("lb-cloud-controller")
        .await
        .unwrap();
    let holder = lease
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    // The identity is POD_NAME with a suffix per process.
    assert!(
        holder.starts_with("image-test"),
        "the container holds the leader Lease, not {holder:?}"
    );
    let queries = std::fs::read_to_string(&dns_log).unwrap();
    assert!(
        queries.contains(&format!("query[A] {API_NAME}")),
        "the container asked the DNS server for {API_NAME}:\n{queries}"
    );

    // SIGTERM, as a rolling update sends: the controller finishes, releases the Lease and exits 0.
    podman_out(&["stop", "--time", "30", &container]);
    let exit = podman_out(&["inspect", "--format", "{{.State.ExitCode}}", &container]);
    let logs = podman()
        .args(["logs", &container])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
        })
        .unwrap();
    assert_eq!(exit, "0", "exit code after SIGTERM; logs:\n{logs}");
    assert!(
        !logs.contains("Forbidden"),
        "a Forbidden was logged:\n{logs}"
    );
    // Released, not left to expire: a standby takes over at its next try instead of after the lease's 15 s. Exit 0
    // alone would also pass if the release's write were refused or never made (it ignores its error).
    let released = Api::<Lease>::namespaced(admin.clone(), NAMESPACE)
        .get("lb-cloud-controller")
        .await
        .unwrap()
        .spec
        .unwrap_or_default();
    assert_eq!(
        (
            released.holder_identity.as_deref(),
            released.lease_duration_seconds
        ),
        (None, Some(1)),
        "the Lease after SIGTERM; logs:\n{logs}"
    );
    drop(cleanup);
}
