//! Active health checks of backends (node:NodePort): TCP connect by default, or an HTTP(S) GET with an
//! expected status (for API-server backends: `/healthz`); UDP backends with a request/reply probe when one is
//! configured. Results drive which backends are in the Maglev tables; established flows are never cut by a
//! check.

use crate::dataplane::model::Protocol;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Deserializer};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Health-check settings (config file `healthCheck`, Go-style durations like `5s`).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct HealthCheckSpec {
    /// Off: every configured backend takes traffic.
    pub enabled: bool,
    /// Time between checks of one backend.
    #[serde(deserialize_with = "go_duration")]
    pub interval: Duration,
    /// Time a check may take.
    #[serde(deserialize_with = "go_duration")]
    pub timeout: Duration,
    /// Consecutive failures that take a backend out.
    pub unhealthy_threshold: u32,
    /// Consecutive successes that bring it back.
    pub healthy_threshold: u32,
    /// TCP backends: HTTP(S) check instead of a TCP connect.
    pub http: Option<HttpCheck>,
    /// UDP backends: request/reply probe. Without it a UDP backend follows its node's TCP checks.
    pub udp: Option<UdpCheck>,
}

impl Default for HealthCheckSpec {
    fn default() -> Self {
        HealthCheckSpec {
            enabled: true,
            interval: Duration::from_secs(5),
            timeout: Duration::from_secs(5),
            unhealthy_threshold: 3,
            healthy_threshold: 2,
            http: None,
            udp: None,
        }
    }
}

impl HealthCheckSpec {
    /// Checks the settings for values that cannot work, including TLS files that cannot be read or parsed
    /// (so a bad file is reported with the configuration, not later by every check).
    pub fn validate(&self) -> Result<()> {
        if self.interval.is_zero() || self.timeout.is_zero() {
            bail!("interval and timeout must be > 0");
        }
        if self.unhealthy_threshold == 0 || self.healthy_threshold == 0 {
            bail!("thresholds must be >= 1");
        }
        if let Some(h) = &self.http {
            if !h.path.starts_with('/') {
                bail!("http.path must start with '/'");
            }
            if !(100..=599).contains(&h.expected_status) {
                bail!("http.expectedStatus must be an HTTP status code");
            }
            h.tls_material()?;
        }
        if let Some(u) = &self.udp {
            u.payload.bytes().context("udp.payload")?;
            if let Some(e) = &u.expect {
                e.bytes().context("udp.expect")?;
            }
        }
        Ok(())
    }
}

/// An HTTP(S) GET check.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpCheck {
    /// Request path, e.g. `/healthz`.
    pub path: String,
    /// Use TLS. Without `caFile` the backend's certificate is not verified (yawol's checks do not verify
    /// either, and node certificates rarely name the address the load balancer uses).
    #[serde(default)]
    pub https: bool,
    /// Status that counts as healthy.
    #[serde(default = "ok_status")]
    pub expected_status: u16,
    /// PEM bundle of the CA(s) the backend's certificate must chain to; the certificate must then also name
    /// `serverName`, or the backend's IP address when no `serverName` is set.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate (chain) presented to the backend; needs `clientKeyFile`.
    #[serde(default)]
    pub client_cert_file: Option<PathBuf>,
    /// PEM private key of `clientCertFile`.
    #[serde(default)]
    pub client_key_file: Option<PathBuf>,
    /// DNS name sent as SNI (and `Host`) and, with `caFile`, verified; backends are addressed by IP.
    #[serde(default)]
    pub server_name: Option<String>,
}

fn ok_status() -> u16 {
    200
}

/// What the TLS files of an [`HttpCheck`] hold, read once per settings change.
#[derive(Clone, Default)]
struct TlsMaterial {
    /// Empty: any server certificate is accepted.
    roots: Vec<reqwest::Certificate>,
    identity: Option<reqwest::Identity>,
}

fn read_file(p: &Path) -> Result<Vec<u8>> {
    std::fs::read(p).with_context(|| format!("reading {}", p.display()))
}

impl HttpCheck {
    /// A plain HTTP GET of `path` wanting 200, no TLS settings.
    pub fn get(path: &str) -> Self {
        HttpCheck {
            path: path.into(),
            https: false,
            expected_status: ok_status(),
            ca_file: None,
            client_cert_file: None,
            client_key_file: None,
            server_name: None,
        }
    }

    /// Reads and parses the TLS files; every combination that cannot be honoured is an error.
    fn tls_material(&self) -> Result<TlsMaterial> {
        let uses_tls = self.ca_file.is_some()
            || self.client_cert_file.is_some()
            || self.client_key_file.is_some()
            || self.server_name.is_some();
        if uses_tls && !self.https {
            bail!("http.caFile, clientCertFile, clientKeyFile and serverName need https: true");
        }
        if let Some(n) = &self.server_name {
            // An IP would be dialled instead of the backend; the backend's own IP is what is verified without
            // a name anyway.
            if n.parse::<std::net::IpAddr>().is_ok()
                || rustls::pki_types::ServerName::try_from(n.as_str()).is_err()
            {
                bail!("http.serverName {n:?} must be a DNS name");
            }
        }
        let roots = match &self.ca_file {
            None => Vec::new(),
            Some(p) => {
                let roots = reqwest::Certificate::from_pem_bundle(&read_file(p)?)
                    .with_context(|| format!("http.caFile {}", p.display()))?;
                if roots.is_empty() {
                    bail!("http.caFile {}: no PEM certificate", p.display());
                }
                roots
            }
        };
        let identity = match (&self.client_cert_file, &self.client_key_file) {
            (None, None) => None,
            (Some(c), Some(k)) => {
                let mut pem = read_file(c)?;
                pem.push(b'\n');
                pem.extend(read_file(k)?);
                Some(reqwest::Identity::from_pem(&pem).with_context(|| {
                    format!(
                        "http.clientCertFile {} / clientKeyFile {}",
                        c.display(),
                        k.display()
                    )
                })?)
            }
            _ => bail!("http.clientCertFile and http.clientKeyFile go together"),
        };
        Ok(TlsMaterial { roots, identity })
    }

    /// A client and URL for checking `addr`. One client per backend: with a server name, the name must
    /// resolve to that backend.
    fn client_for(&self, tls: &TlsMaterial, addr: SocketAddr) -> Result<(reqwest::Client, String)> {
        let mut b = reqwest::Client::builder().no_proxy();
        let authority = match &self.server_name {
            Some(n) => {
                b = b.resolve(n, addr);
                format!("{n}:{}", addr.port())
            }
            None => addr.to_string(),
        };
        if self.https {
            if tls.roots.is_empty() {
                b = b.danger_accept_invalid_certs(true);
            } else {
                // Only the configured CA: a public CA must not vouch for a backend.
                b = b.tls_built_in_root_certs(false);
                for c in &tls.roots {
                    b = b.add_root_certificate(c.clone());
                }
            }
            if let Some(id) = &tls.identity {
                b = b.identity(id.clone());
            }
        }
        let scheme = if self.https { "https" } else { "http" };
        Ok((b.build()?, format!("{scheme}://{authority}{}", self.path)))
    }
}

/// Bytes in the config: `{text: "..."}` or `{hex: "..."}`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Bytes {
    /// UTF-8 text, sent as is.
    pub text: Option<String>,
    /// Hex digits (whitespace allowed), for binary protocols.
    pub hex: Option<String>,
}

impl Bytes {
    /// These bytes as text.
    pub fn text(t: &str) -> Self {
        Bytes {
            text: Some(t.into()),
            hex: None,
        }
    }

    /// These bytes as hex digits.
    pub fn hex(h: &str) -> Self {
        Bytes {
            text: None,
            hex: Some(h.into()),
        }
    }

    /// The bytes meant.
    pub fn bytes(&self) -> Result<Vec<u8>> {
        match (&self.text, &self.hex) {
            (Some(t), None) => Ok(t.as_bytes().to_vec()),
            (None, Some(h)) => {
                let digits: Vec<u8> = h.bytes().filter(|c| !c.is_ascii_whitespace()).collect();
                if !digits.len().is_multiple_of(2) {
                    bail!("hex {h:?} has an odd number of digits");
                }
                digits
                    .chunks(2)
                    .map(|p| {
                        std::str::from_utf8(p)
                            .ok()
                            .and_then(|s| u8::from_str_radix(s, 16).ok())
                            .with_context(|| format!("hex {h:?} is not hex"))
                    })
                    .collect()
            }
            _ => bail!("give exactly one of text and hex"),
        }
    }
}

/// A UDP probe: send `payload` from a connected socket, wait for a reply.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UdpCheck {
    /// The request datagram.
    pub payload: Bytes,
    /// What the reply must start with; unset: any reply counts.
    #[serde(default)]
    pub expect: Option<Bytes>,
}

fn go_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    lb_api::duration::parse_go_duration(&s).map_err(serde::de::Error::custom)
}

/// A checked backend: TCP and UDP backends may share an address (a NodePort number per protocol).
pub type HealthTarget = (Protocol, SocketAddr);

/// Health of every checked backend (true = takes new flows).
pub type HealthMap = BTreeMap<HealthTarget, bool>;

/// How one backend is checked, prepared once per task.
enum Probe {
    Tcp,
    Http {
        client: reqwest::Client,
        url: String,
        expected_status: u16,
    },
    Udp {
        payload: Vec<u8>,
        expect: Option<Vec<u8>>,
    },
    /// The settings cannot be used (e.g. a TLS file changed since validation): every check fails with this.
    Broken(String),
}

impl Probe {
    fn new(
        spec: &HealthCheckSpec,
        tls: &Result<Arc<TlsMaterial>, String>,
        t: HealthTarget,
    ) -> Self {
        let prepared = || -> Result<Probe> {
            Ok(match (t.0, &spec.http, &spec.udp) {
                (Protocol::Tcp, None, _) => Probe::Tcp,
                (Protocol::Tcp, Some(h), _) => {
                    let tls = tls.as_ref().map_err(|e| anyhow::anyhow!("{e}"))?;
                    let (client, url) = h.client_for(tls, t.1)?;
                    Probe::Http {
                        client,
                        url,
                        expected_status: h.expected_status,
                    }
                }
                (Protocol::Udp, _, Some(u)) => Probe::Udp {
                    payload: u.payload.bytes()?,
                    expect: u.expect.as_ref().map(Bytes::bytes).transpose()?,
                },
                (Protocol::Udp, _, None) => bail!("no UDP probe configured"),
            })
        };
        prepared().unwrap_or_else(|e| Probe::Broken(format!("{e:#}")))
    }

    /// One check.
    async fn check(&self, addr: SocketAddr, timeout: Duration) -> Result<()> {
        match self {
            Probe::Tcp => {
                tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr))
                    .await
                    .map_err(|_| anyhow::anyhow!("connect timed out"))??;
                Ok(())
            }
            Probe::Http {
                client,
                url,
                expected_status,
            } => {
                let resp = client
                    .get(url)
                    .timeout(timeout)
                    .send()
                    .await
                    .with_context(|| format!("GET {url}"))?;
                if resp.status().as_u16() != *expected_status {
                    bail!(
                        "GET {url}: status {} (want {expected_status})",
                        resp.status()
                    );
                }
                Ok(())
            }
            Probe::Udp { payload, expect } => {
                tokio::time::timeout(timeout, udp_probe(addr, payload, expect.as_deref()))
                    .await
                    .map_err(|_| anyhow::anyhow!("no UDP reply within {timeout:?}"))?
            }
            Probe::Broken(e) => bail!("{e}"),
        }
    }
}

/// Sends `payload` to `addr` from a connected socket (so an ICMP port unreachable comes back as
/// ECONNREFUSED and fails the check at once) and waits for a reply.
async fn udp_probe(addr: SocketAddr, payload: &[u8], expect: Option<&[u8]>) -> Result<()> {
    let any: SocketAddr = if addr.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let sock = tokio::net::UdpSocket::bind(any).await?;
    sock.connect(addr).await?;
    let refused = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::ConnectionRefused => anyhow::anyhow!("port unreachable (ICMP)"),
        _ => e.into(),
    };
    sock.send(payload).await.map_err(refused)?;
    let mut buf = vec![0u8; 65536];
    let n = sock.recv(&mut buf).await.map_err(refused)?;
    match expect {
        Some(want) if !buf[..n].starts_with(want) => bail!(
            "UDP reply {:?} does not start with {:?}",
            String::from_utf8_lossy(&buf[..n.min(64)]),
            String::from_utf8_lossy(want)
        ),
        _ => Ok(()),
    }
}

/// TLS material for `spec` (none needed: empty), or why it cannot be had.
fn tls_for(spec: &HealthCheckSpec) -> Result<Arc<TlsMaterial>, String> {
    match &spec.http {
        Some(h) => h
            .tls_material()
            .map(Arc::new)
            .map_err(|e| format!("health-check TLS settings: {e:#}")),
        None => Ok(Arc::default()),
    }
}

/// Runs one check task per backend and publishes the health map.
pub struct HealthChecker {
    tx: watch::Sender<HealthMap>,
    /// `None` until the first settings arrive.
    spec: Option<HealthCheckSpec>,
    tls: Result<Arc<TlsMaterial>, String>,
    tasks: HashMap<HealthTarget, JoinHandle<()>>,
}

impl HealthChecker {
    /// A checker with no targets, and the receiver of its results.
    pub fn new() -> Result<(Self, watch::Receiver<HealthMap>)> {
        let (tx, rx) = watch::channel(HealthMap::new());
        crate::tls::install_crypto_provider();
        Ok((
            HealthChecker {
                tx,
                spec: None,
                tls: Ok(Arc::default()),
                tasks: HashMap::new(),
            },
            rx,
        ))
    }

    /// Checks exactly `targets` with `spec`. New backends start healthy (optimistic, so an agent restart
    /// or a config change never empties a service) and are checked at once; removed ones are forgotten.
    pub fn set_targets(&mut self, spec: &HealthCheckSpec, targets: &BTreeSet<HealthTarget>) {
        if self.spec.as_ref() != Some(spec) {
            // New rules: start over, optimistic, rather than judge with results of the old ones.
            for (_, t) in self.tasks.drain() {
                t.abort();
            }
            self.tx.send_modify(|m| m.clear());
            self.spec = Some(spec.clone());
            // The TLS files are read once per settings change (and at start).
            self.tls = tls_for(spec);
            if let Err(e) = &self.tls {
                tracing::error!(error = %e, "HTTPS health checks cannot run: backends fail them");
            }
            if let Some(h) = spec
                .http
                .as_ref()
                .filter(|h| h.https && h.ca_file.is_none())
            {
                tracing::warn!(
                    path = %h.path,
                    "HTTPS health checks accept any backend certificate (no CA file configured)"
                );
            }
        }
        self.tasks.retain(|t, task| {
            let keep = targets.contains(t);
            if !keep {
                task.abort();
            }
            keep
        });
        self.tx.send_modify(|m| {
            m.retain(|a, _| targets.contains(a));
            for t in targets {
                m.entry(*t).or_insert(true);
            }
        });
        if !spec.enabled {
            return;
        }
        for t in targets {
            if self.tasks.contains_key(t) {
                continue;
            }
            let probe = Probe::new(spec, &self.tls, *t);
            self.tasks.insert(
                *t,
                tokio::spawn(check_loop(*t, spec.clone(), probe, self.tx.clone())),
            );
        }
    }
}

impl Drop for HealthChecker {
    fn drop(&mut self) {
        for (_, t) in self.tasks.drain() {
            t.abort();
        }
    }
}

async fn check_loop(
    target: HealthTarget,
    spec: HealthCheckSpec,
    probe: Probe,
    tx: watch::Sender<HealthMap>,
) {
    let addr = target.1;
    let protocol = target.0.name();
    let mut ok_run = 0u32;
    let mut fail_run = 0u32;
    let mut ticker = tokio::time::interval(spec.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let result = probe.check(addr, spec.timeout).await;
        let healthy_now = tx.borrow().get(&target).copied().unwrap_or(true);
        match result {
            Ok(()) => {
                ok_run += 1;
                fail_run = 0;
                if !healthy_now && ok_run >= spec.healthy_threshold {
                    tracing::info!(backend = %addr, protocol, "backend healthy again");
                    tx.send_modify(|m| {
                        if let Some(h) = m.get_mut(&target) {
                            *h = true;
                        }
                    });
                }
            }
            Err(e) => {
                fail_run += 1;
                ok_run = 0;
                if healthy_now && fail_run >= spec.unhealthy_threshold {
                    tracing::warn!(backend = %addr, protocol, error = format!("{e:#}"), "backend unhealthy: no new flows");
                    tx.send_modify(|m| {
                        if let Some(h) = m.get_mut(&target) {
                            *h = false;
                        }
                    });
                }
            }
        }
    }
}

/// One check of `target` as `spec` says (TCP connect, HTTP(S) GET, UDP probe); the error says why it failed.
pub async fn check_once(target: HealthTarget, spec: &HealthCheckSpec) -> Result<()> {
    crate::tls::install_crypto_provider();
    Probe::new(spec, &tls_for(spec), target)
        .check(target.1, spec.timeout)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fast() -> HealthCheckSpec {
        HealthCheckSpec {
            interval: Duration::from_millis(50),
            timeout: Duration::from_millis(200),
            unhealthy_threshold: 2,
            healthy_threshold: 2,
            ..Default::default()
        }
    }

    async fn wait_for(rx: &mut watch::Receiver<HealthMap>, t: HealthTarget, want: bool) {
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if rx.borrow().get(&t) == Some(&want) {
                    return;
                }
                rx.changed().await.unwrap();
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{t:?} never became healthy={want}"));
    }

    #[tokio::test]
    async fn tcp_check_takes_a_dead_backend_out_and_back_in() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = (Protocol::Tcp, listener.local_addr().unwrap());
        let (mut hc, mut rx) = HealthChecker::new().unwrap();
        hc.set_targets(&fast(), &[addr].into());
        assert_eq!(rx.borrow().get(&addr), Some(&true), "starts healthy");
        drop(listener);
        wait_for(&mut rx, addr, false).await;
        let _listener = tokio::net::TcpListener::bind(addr.1).await.unwrap();
        wait_for(&mut rx, addr, true).await;
        hc.set_targets(&fast(), &BTreeSet::new());
        assert!(rx.borrow().is_empty(), "removed targets are forgotten");
    }

    #[tokio::test]
    async fn http_check_wants_the_expected_status() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let status = std::sync::Arc::new(std::sync::atomic::AtomicU16::new(200));
        let s2 = status.clone();
        tokio::spawn(async move {
            loop {
                let (mut c, _) = listener.accept().await.unwrap();
                let code = s2.load(std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    let _ = c.read(&mut buf).await;
                    let _ = c
                        .write_all(format!("HTTP/1.1 {code} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").as_bytes())
                        .await;
                });
            }
        });
        let spec = HealthCheckSpec {
            http: Some(HttpCheck::get("/healthz")),
            ..fast()
        };
        let addr = (Protocol::Tcp, addr);
        let (mut hc, mut rx) = HealthChecker::new().unwrap();
        hc.set_targets(&spec, &[addr].into());
        check_once(addr, &spec).await.unwrap();
        status.store(503, std::sync::atomic::Ordering::SeqCst);
        wait_for(&mut rx, addr, false).await;
        status.store(200, std::sync::atomic::Ordering::SeqCst);
        wait_for(&mut rx, addr, true).await;
    }

    #[test]
    fn settings_parse_and_validate() {
        let s: HealthCheckSpec = serde_yaml::from_str(
            "interval: 2s\nunhealthyThreshold: 1\nhttp: {path: /healthz, https: true}\n",
        )
        .unwrap();
        assert_eq!(s.interval, Duration::from_secs(2));
        assert_eq!(s.timeout, Duration::from_secs(5));
        assert_eq!(s.http.as_ref().unwrap().expected_status, 200);
        s.validate().unwrap();
        let bad = HealthCheckSpec {
            healthy_threshold: 0,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
    }
}
