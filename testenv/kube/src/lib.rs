//! A real Kubernetes API server for the tests: etcd + kube-apiserver (+ kube-controller-manager) on loopback with
//! random ports in a temporary directory — controller-runtime's envtest, for Rust.
//!
//! The binaries come from the directory named by `KUBEBUILDER_ASSETS` (envtest's convention; `cargo xtask test`
//! sets it to this workplace's `../shared/envtest` when unset, `setup-envtest` provides them elsewhere); etcd is
//! the `etcd` on `PATH` (Debian's `etcd-server`). The server runs with what a production cluster has and the
//! in-memory imitation it replaces did not: TLS, client-certificate and ServiceAccount-token authentication, RBAC,
//! anonymous access off, the default admission chain, and the controller manager's ServiceAccount, token,
//! garbage-collector and namespace controllers.
//!
//! One cluster per test binary ([`KubeEnv::shared`], a namespace per test from [`KubeEnv::namespace`]); tests that
//! stop the API server or compact etcd start their own ([`KubeEnv::start`], a few seconds).
//!
//! [`Refusals`] makes clients that record every request the server refused (401/403), so a test can assert that
//! the RBAC a controller or agent runs under covered everything it did.

pub mod fake_api;
mod pki;
mod procs;
mod refusals;

pub use refusals::{Refusal, Refusals};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::Client;
use pki::Pki;
use procs::Proc;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The environment variable naming the assets directory (controller-runtime's envtest convention).
pub const ASSETS_ENV: &str = "KUBEBUILDER_ASSETS";

/// One test cluster. Dropping it stops the processes (API server before etcd: the other order makes the API
/// server's shutdown hang) and removes its directory, unless the thread is panicking (the logs stay for reading).
pub struct KubeEnv {
    dir: PathBuf,
    assets: PathBuf,
    api_port: u16,
    etcd_port: u16,
    pki: Pki,
    procs: Mutex<Procs>,
    /// A token of the probe ServiceAccount (see [`KubeEnv::wait_serving`]), minted once at the first start.
    probe_token: Mutex<Option<String>>,
}

/// Namespace and name of the probe: a ServiceAccount under a Role that may read and create ConfigMaps there, and the
/// ConfigMap it reads.
const PROBE_NS: &str = "kube-testenv";
const PROBE: &str = "probe";
const PROBE_OBJECTS: &str = "\
apiVersion: v1
kind: Namespace
metadata: {name: kube-testenv}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: probe, namespace: kube-testenv}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: probe, namespace: kube-testenv}
rules: [{apiGroups: [\"\"], resources: [configmaps], verbs: [get, create]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: probe, namespace: kube-testenv}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: probe}
subjects: [{kind: ServiceAccount, name: probe, namespace: kube-testenv}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: probe, namespace: kube-testenv}
";

#[derive(Default)]
struct Procs {
    etcd: Option<Proc>,
    apiserver: Option<Proc>,
    controller_manager: Option<Proc>,
}

/// The assets directory: `KUBEBUILDER_ASSETS`, or an error saying how to set it.
pub fn assets_dir() -> Result<PathBuf> {
    let dir = std::env::var_os(ASSETS_ENV).map(PathBuf::from).with_context(|| {
        format!(
            "{ASSETS_ENV} is not set: point it at a directory with kube-apiserver and kube-controller-manager \
             (`cargo xtask test` sets it to ../shared/envtest; `setup-envtest use -p path` prints one)"
        )
    })?;
    for binary in ["kube-apiserver", "kube-controller-manager"] {
        if !dir.join(binary).is_file() {
            bail!("{ASSETS_ENV}={}: no {binary} there", dir.display());
        }
    }
    Ok(dir)
}

impl KubeEnv {
    /// The cluster shared by every test of this test binary, started on first use. Its processes belong to a
    /// thread that lives as long as the process, so they die with it; never stop its API server (use
    /// [`KubeEnv::start`] for that).
    pub fn shared() -> &'static KubeEnv {
        static SHARED: OnceLock<KubeEnv> = OnceLock::new();
        SHARED.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name("kube-testenv".into())
                .spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("a tokio runtime");
                    let _ = tx.send(runtime.block_on(KubeEnv::start()));
                    // PR_SET_PDEATHSIG fires when this thread ends: it must not.
                    loop {
                        std::thread::park();
                    }
                })
                .expect("spawning the kube-testenv thread");
            rx.recv()
                .expect("the kube-testenv thread answers")
                .unwrap_or_else(|e| panic!("starting the test Kubernetes API server: {e:#}"))
        })
    }

    /// Starts a cluster of its own (etcd, API server, controller manager) and waits until the API server is ready.
    /// A failed start is retried twice with new ports: a port found free can be taken by another process before
    /// the program binds it (several test binaries start clusters at once).
    pub async fn start() -> Result<KubeEnv> {
        let mut attempt = 1;
        loop {
            match Self::start_once().await {
                Ok(env) => return Ok(env),
                Err(e) if attempt < 3 => {
                    eprintln!("kube-testenv: start attempt {attempt} failed, retrying: {e:#}");
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn start_once() -> Result<KubeEnv> {
        let assets = assets_dir()?;
        procs::sweep_stale_runs();
        static RUN: AtomicU32 = AtomicU32::new(0);
        let dir = procs::runs_dir().join(format!(
            "run-{}-{}",
            std::process::id(),
            RUN.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let pki = Pki::generate(&dir)?;
        let env = KubeEnv {
            api_port: procs::free_port()?,
            etcd_port: procs::free_port()?,
            assets,
            pki,
            dir,
            procs: Mutex::new(Procs::default()),
            probe_token: Mutex::new(None),
        };
        std::fs::write(env.dir.join("admin.kubeconfig"), env.admin_kubeconfig())?;
        env.start_etcd().await?;
        env.start_apiserver().await?;
        env.start_controller_manager()?;
        env.wait_serving().await?;
        Ok(env)
    }

    /// The API server's URL.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.api_port)
    }

    /// The cluster's directory (certificates, kubeconfigs, the processes' logs).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A kubeconfig for the admin (`system:masters`).
    pub fn admin_kubeconfig(&self) -> String {
        self.kubeconfig(&format!(
            "client-certificate-data: {}\n    client-key-data: {}",
            b64(&self.pki.admin_cert_pem),
            b64(&self.pki.admin_key_pem)
        ))
    }

    /// A kubeconfig that authenticates with `token` (a ServiceAccount token from [`KubeEnv::token`]).
    pub fn token_kubeconfig(&self, token: &str) -> String {
        self.kubeconfig(&format!("token: {token}"))
    }

    fn kubeconfig(&self, user: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: testenv\n  cluster:\n    server: {}\n    \
             certificate-authority-data: {}\nusers:\n- name: user\n  user:\n    {user}\ncontexts:\n- name: testenv\n  \
             context:\n    cluster: testenv\n    user: user\ncurrent-context: testenv\n",
            self.url(),
            b64(&self.pki.ca_pem)
        )
    }

    /// An admin client (create it inside the test's runtime: a client belongs to the runtime it was made in).
    pub async fn client(&self) -> Result<Client> {
        client_from(&self.admin_kubeconfig()).await
    }

    /// A client that authenticates with `token`.
    pub async fn token_client(&self, token: &str) -> Result<Client> {
        client_from(&self.token_kubeconfig(token)).await
    }

    /// Mints a token for ServiceAccount `namespace/name` (TokenRequest, one hour), as a kubelet would for a pod.
    pub async fn token(&self, client: &Client, namespace: &str, name: &str) -> Result<String> {
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![],
                expiration_seconds: Some(3600),
                ..Default::default()
            },
            ..Default::default()
        };
        let api: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
        let response: TokenRequest = api
            .create_subresource("token", name, &PostParams::default(), &request)
            .await
            .with_context(|| format!("TokenRequest for ServiceAccount {namespace}/{name}"))?;
        response
            .status
            .map(|s| s.token)
            .context("TokenRequest answered without a token")
    }

    /// Creates a namespace named `<prefix>-<n>` unique in this process, so tests sharing a cluster do not meet.
    pub async fn namespace(&self, client: &Client, prefix: &str) -> Result<String> {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!("{prefix}-{}", N.fetch_add(1, Ordering::SeqCst));
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}
        }))?;
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("creating namespace {name}"))?;
        Ok(name)
    }

    /// Applies CRDs (server-side apply, so a second test applying the same ones is a no-op) and waits until the
    /// server serves them (`Established`).
    pub async fn apply_crds(
        &self,
        client: &Client,
        crds: impl IntoIterator<Item = CustomResourceDefinition>,
    ) -> Result<()> {
        let api: Api<CustomResourceDefinition> = Api::all(client.clone());
        let params = PatchParams::apply("kube-testenv").force();
        let mut names = Vec::new();
        for crd in crds {
            let name = crd.metadata.name.clone().context("a CRD without a name")?;
            api.patch(&name, &params, &Patch::Apply(&crd))
                .await
                .with_context(|| format!("applying CRD {name}"))?;
            names.push(name);
        }
        for name in names {
            wait_for(&format!("CRD {name} established"), || async {
                let crd = api.get(&name).await?;
                Ok(crd
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True"))
            })
            .await?;
        }
        Ok(())
    }

    /// Stops the API server (SIGTERM, as a rolling control-plane upgrade or a crash-looping server would); etcd
    /// keeps the data. Not on [`KubeEnv::shared`].
    pub fn stop_apiserver(&self) {
        let mut procs = self.procs.lock().unwrap();
        procs.controller_manager.take();
        // It stops listening at once but holds open watches until it is killed: 2 s, not the default 10.
        if let Some(mut apiserver) = procs.apiserver.take() {
            apiserver.stop(Duration::from_secs(2));
        }
    }

    /// Starts the API server (again) on the same port and waits until it serves a ServiceAccount's requests as a
    /// running server does ([`KubeEnv::wait_serving`]); the controller manager too.
    pub async fn restart_apiserver(&self) -> Result<()> {
        self.start_apiserver().await?;
        self.start_controller_manager()?;
        self.wait_serving().await
    }

    /// Waits until the API server answers a ServiceAccount (not the admin, whom no RBAC rule or cache concerns) as
    /// it will for the rest of the test: the probe's token authenticated, a GET its Role allows answered 200, and a
    /// namespaced write (dry run) admitted. `/readyz` says ok earlier: a restarted server refused a ServiceAccount's
    /// requests with 403 for about a second after it (its RBAC authorizer's and admission plugins' caches still
    /// syncing), which failed tests that then counted every refusal.
    async fn wait_serving(&self) -> Result<()> {
        if self.probe_token.lock().unwrap().is_none() {
            // The first start: made as admin, whose writes a starting server's admission can still refuse: retried.
            let admin = self.client().await?;
            self.wait_running("kube-apiserver", || async {
                self.create_probe(&admin).await.map(|()| true)
            })
            .await?;
        }
        let token = self.probe_token.lock().unwrap().clone();
        let token = token.context("the probe's token")?;
        let probe: Api<ConfigMap> = Api::namespaced(self.token_client(&token).await?, PROBE_NS);
        let write: ConfigMap =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "probe-write"}}))?;
        let dry_run = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        self.wait_running("kube-apiserver", || async {
            probe.get(PROBE).await?;
            probe.create(&dry_run, &write).await?;
            Ok(true)
        })
        .await
    }

    /// Creates (or finds) the probe's namespace, ServiceAccount, Role, RoleBinding and ConfigMap, and keeps a token of
    /// the ServiceAccount (an hour: longer than a test binary runs).
    async fn create_probe(&self, admin: &Client) -> Result<()> {
        apply_rbac(admin, PROBE_OBJECTS, None).await?;
        let token = self.token(admin, PROBE_NS, PROBE).await?;
        *self.probe_token.lock().unwrap() = Some(token);
        Ok(())
    }

    /// Compacts etcd's history up to its current revision, as the API server does every five minutes: a watch or
    /// list from an older resourceVersion then gets 410 Gone. Returns the revision.
    pub async fn compact_etcd(&self) -> Result<i64> {
        let http = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{}/v3", self.etcd_port);
        let range: serde_json::Value = http
            .post(format!("{base}/kv/range"))
            .json(&serde_json::json!({"key": b64("/"), "limit": 1}))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let revision: i64 = range["header"]["revision"]
            .as_str()
            .context("etcd range without a revision")?
            .parse()?;
        http.post(format!("{base}/kv/compaction"))
            .json(&serde_json::json!({"revision": revision.to_string(), "physical": true}))
            .send()
            .await?
            .error_for_status()
            .context("etcd compaction")?;
        Ok(revision)
    }

    async fn start_etcd(&self) -> Result<()> {
        let peer = procs::free_port()?;
        let client_url = format!("http://127.0.0.1:{}", self.etcd_port);
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut cmd = Command::new("etcd");
        cmd.arg("--name=testenv")
            .arg(format!("--data-dir={}", self.dir.join("etcd").display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=testenv={peer_url}"))
            // Test data: nothing to keep across a power cut.
            .arg("--unsafe-no-fsync");
        let proc = Proc::spawn("etcd", cmd, &self.dir)
            .context("is Debian's etcd-server installed (`cargo xtask test` installs it)?")?;
        self.procs.lock().unwrap().etcd = Some(proc);
        let http = reqwest::Client::new();
        let health = format!("{client_url}/health");
        self.wait_running("etcd", || async {
            Ok(http
                .get(&health)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success()))
        })
        .await
    }

    async fn start_apiserver(&self) -> Result<()> {
        let mut cmd = Command::new(self.assets.join("kube-apiserver"));
        let p = |path: &Path| path.display().to_string();
        cmd.arg(format!(
            "--etcd-servers=http://127.0.0.1:{}",
            self.etcd_port
        ))
        .arg("--bind-address=127.0.0.1")
        .arg("--advertise-address=127.0.0.1")
        .arg(format!("--secure-port={}", self.api_port))
        .arg(format!("--cert-dir={}", p(&self.dir)))
        .arg(format!("--tls-cert-file={}", p(&self.pki.serving_cert)))
        .arg(format!(
            "--tls-private-key-file={}",
            p(&self.pki.serving_key)
        ))
        .arg(format!("--client-ca-file={}", p(&self.pki.ca_cert)))
        .arg(format!(
            "--service-account-key-file={}",
            p(&self.pki.sa_pub)
        ))
        .arg(format!(
            "--service-account-signing-key-file={}",
            p(&self.pki.sa_key)
        ))
        .arg("--service-account-issuer=https://kubernetes.default.svc")
        .arg("--authorization-mode=RBAC")
        .arg("--anonymous-auth=false")
        // Dual-stack service ranges, IPv4 first: a Service that names no family stays IPv4 single-stack (the
        // server's default is the first range's family), and IPv6 or dual-stack Services can be created at all.
        .arg("--service-cluster-ip-range=10.96.0.0/16,fd00:10:96::/112");
        let proc = Proc::spawn("kube-apiserver", cmd, &self.dir)?;
        self.procs.lock().unwrap().apiserver = Some(proc);
        let client = self.client().await?;
        self.wait_running("kube-apiserver", || async {
            let request = http::Request::get("/readyz").body(Vec::new())?;
            Ok(client
                .request_text(request)
                .await
                .is_ok_and(|body| body.trim() == "ok"))
        })
        .await
    }

    fn start_controller_manager(&self) -> Result<()> {
        let kubeconfig = self.dir.join("admin.kubeconfig").display().to_string();
        let mut cmd = Command::new(self.assets.join("kube-controller-manager"));
        cmd.arg(format!("--kubeconfig={kubeconfig}"))
            .arg(format!("--authentication-kubeconfig={kubeconfig}"))
            .arg(format!("--authorization-kubeconfig={kubeconfig}"))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={}", procs::free_port()?))
            .arg(format!("--cert-dir={}", self.dir.display()))
            // Not node-lifecycle: test Nodes have no kubelet and would be tainted NotReady.
            .arg(
                "--controllers=serviceaccount-token-controller,serviceaccount-controller,\
                 garbage-collector-controller,namespace-controller",
            )
            .arg(format!(
                "--service-account-private-key-file={}",
                self.pki.sa_key.display()
            ))
            .arg(format!("--root-ca-file={}", self.pki.ca_cert.display()))
            .arg("--leader-elect=false");
        let proc = Proc::spawn("kube-controller-manager", cmd, &self.dir)?;
        self.procs.lock().unwrap().controller_manager = Some(proc);
        Ok(())
    }

    /// Polls `ready` until it says yes; fails with the tail of the program's log when it exits or after 60 s.
    async fn wait_running<F, Fut>(&self, name: &'static str, ready: F) -> Result<()>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<bool>>,
    {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if ready().await.unwrap_or(false) {
                return Ok(());
            }
            let exited = {
                let mut guard = self.procs.lock().unwrap();
                let procs = &mut *guard;
                let exited = [
                    procs.etcd.as_mut(),
                    procs.apiserver.as_mut(),
                    procs.controller_manager.as_mut(),
                ]
                .into_iter()
                .flatten()
                .find(|p| p.name == name)
                .and_then(|p| p.exited());
                exited
            };
            if exited.is_some() || Instant::now() > deadline {
                let log = std::fs::read_to_string(self.dir.join(format!("{name}.log")))
                    .unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                bail!(
                    "{name} {} (log {}):\n{}",
                    match exited {
                        Some(status) => format!("exited ({status})"),
                        None => "not ready after 60 s".to_string(),
                    },
                    self.dir.join(format!("{name}.log")).display(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for KubeEnv {
    fn drop(&mut self) {
        let mut procs = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        procs.controller_manager.take();
        procs.apiserver.take();
        procs.etcd.take();
        if std::thread::panicking() {
            eprintln!(
                "kube-testenv: logs kept in {} (a test failed)",
                self.dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Applies the objects of a deployment manifest (YAML documents) except its Deployments — its ServiceAccounts,
/// Roles, bindings, or any other object — by server-side apply as `admin`. With `namespace`, they go there instead of the manifest's
/// namespace (each namespaced object and the bindings' subjects, what an operator installing it elsewhere changes);
/// the rules stay exactly as written.
pub async fn apply_rbac(admin: &Client, manifest: &str, namespace: Option<&str>) -> Result<()> {
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    use serde::Deserialize;
    let discovery = kube::Discovery::new(admin.clone()).run().await?;
    for doc in serde_yaml::Deserializer::from_str(manifest) {
        let mut doc = serde_json::Value::deserialize(doc)?;
        if doc.is_null() || doc["kind"] == "Deployment" {
            continue;
        }
        if let Some(ns) = namespace {
            if doc["metadata"]["namespace"].is_string() {
                doc["metadata"]["namespace"] = serde_json::json!(ns);
            }
            // `get_mut`, not indexing: `doc["subjects"]` would add `subjects: null` to every other kind.
            let subjects = doc.get_mut("subjects").and_then(|s| s.as_array_mut());
            for subject in subjects.into_iter().flatten() {
                if subject["namespace"].is_string() {
                    subject["namespace"] = serde_json::json!(ns);
                }
            }
        }
        let object: DynamicObject = serde_json::from_value(doc)?;
        let types = object
            .types
            .as_ref()
            .context("an object without apiVersion/kind")?;
        let gvk = GroupVersionKind::try_from(types)?;
        let (resource, _): (ApiResource, _) = discovery
            .resolve_gvk(&gvk)
            .with_context(|| format!("the server does not serve {gvk:?}"))?;
        let objects: Api<DynamicObject> = match &object.metadata.namespace {
            Some(ns) => Api::namespaced_with(admin.clone(), ns, &resource),
            None => Api::all_with(admin.clone(), &resource),
        };
        let name = object
            .metadata
            .name
            .clone()
            .context("an object without a name")?;
        objects
            .patch(
                &name,
                &PatchParams::apply("kube-testenv").force(),
                &Patch::Apply(&object),
            )
            .await
            .with_context(|| format!("applying {} {name}", gvk.kind))?;
    }
    Ok(())
}

/// A client from a kubeconfig's text.
pub async fn client_from(kubeconfig: &str) -> Result<Client> {
    // Feature unification can enable both of rustls' providers in a test binary, and rustls then refuses to
    // guess: choose the workspace's (see lb_agent::tls). Already installed (by us or the code under test) is fine.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kubeconfig = Kubeconfig::from_yaml(kubeconfig)?;
    let config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// Polls `check` every 50 ms until it holds, for up to 60 s (a generous bound: the condition is what the test
/// waits for, the bound only turns a hang into a failure).
pub async fn wait_for<F, Fut>(what: &str, check: F) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    wait_within(what, Duration::from_secs(60), check).await
}

/// [`wait_for`] with another bound (e.g. recovery after an outage, which waits out a client's backoff).
pub async fn wait_within<F, Fut>(what: &str, bound: Duration, check: F) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = Instant::now() + bound;
    let mut last_error = None;
    loop {
        match check().await {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => last_error = Some(e),
        }
        if Instant::now() > deadline {
            bail!(
                "timed out waiting for {what}{}",
                last_error
                    .map(|e| format!(" (last error: {e:#})"))
                    .unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// RFC 7386 JSON merge patch of `patch` into `target`: objects merge, `null` removes, anything else replaces. For
/// test objects written as overlays on a base (and the in-memory API server's merge patches).
pub fn json_merge(target: &mut serde_json::Value, patch: &serde_json::Value) {
    match patch {
        serde_json::Value::Object(patch) => {
            if !target.is_object() {
                *target = serde_json::Value::Object(serde_json::Map::new());
            }
            let map = target.as_object_mut().expect("object");
            for (key, value) in patch {
                if value.is_null() {
                    map.remove(key);
                } else {
                    json_merge(
                        map.entry(key.clone()).or_insert(serde_json::Value::Null),
                        value,
                    );
                }
            }
        }
        other => *target = other.clone(),
    }
}

fn b64(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}
