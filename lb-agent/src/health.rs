//! Active health checks of backends (node:NodePort): TCP connect by default, or an HTTP(S) GET with an
//! expected status (for API-server backends: `/healthz`). Results drive which backends are in the Maglev
//! tables; established flows are never cut by a check.

use anyhow::{bail, Result};
use serde::{Deserialize, Deserializer};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
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
    /// HTTP(S) check instead of a TCP connect.
    pub http: Option<HttpCheck>,
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
        }
    }
}

impl HealthCheckSpec {
    /// Checks the settings for values that cannot work.
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
    /// Use TLS. The backend's certificate is not verified: the check asks "is it up", and node
    /// certificates rarely name the address the load balancer uses.
    #[serde(default)]
    pub https: bool,
    /// Status that counts as healthy.
    #[serde(default = "ok_status")]
    pub expected_status: u16,
}

fn ok_status() -> u16 {
    200
}

fn go_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    lb_api::duration::parse_go_duration(&s).map_err(serde::de::Error::custom)
}

/// Health of every checked backend (true = takes new flows).
pub type HealthMap = BTreeMap<SocketAddr, bool>;

/// Runs one check task per backend and publishes the health map.
pub struct HealthChecker {
    tx: watch::Sender<HealthMap>,
    spec: HealthCheckSpec,
    tasks: HashMap<SocketAddr, JoinHandle<()>>,
    client: reqwest::Client,
}

impl HealthChecker {
    /// A checker with no targets, and the receiver of its results.
    pub fn new() -> Result<(Self, watch::Receiver<HealthMap>)> {
        let (tx, rx) = watch::channel(HealthMap::new());
        crate::tls::install_crypto_provider();
        let client = reqwest::Client::builder()
            .danger_accept_invalid_certs(true)
            .no_proxy()
            .build()?;
        Ok((
            HealthChecker {
                tx,
                spec: HealthCheckSpec::default(),
                tasks: HashMap::new(),
                client,
            },
            rx,
        ))
    }

    /// Checks exactly `targets` with `spec`. New backends start healthy (optimistic, so an agent restart
    /// or a config change never empties a service) and are checked at once; removed ones are forgotten.
    pub fn set_targets(&mut self, spec: &HealthCheckSpec, targets: &BTreeSet<SocketAddr>) {
        if *spec != self.spec {
            // New rules: start over, optimistic, rather than judge with results of the old ones.
            for (_, t) in self.tasks.drain() {
                t.abort();
            }
            self.tx.send_modify(|m| m.clear());
            self.spec = spec.clone();
        }
        self.tasks.retain(|addr, task| {
            let keep = targets.contains(addr);
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
        if !self.spec.enabled {
            return;
        }
        for t in targets {
            if self.tasks.contains_key(t) {
                continue;
            }
            let tx = self.tx.clone();
            let spec = self.spec.clone();
            let client = self.client.clone();
            let addr = *t;
            self.tasks
                .insert(addr, tokio::spawn(check_loop(addr, spec, client, tx)));
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
    addr: SocketAddr,
    spec: HealthCheckSpec,
    client: reqwest::Client,
    tx: watch::Sender<HealthMap>,
) {
    let mut ok_run = 0u32;
    let mut fail_run = 0u32;
    let mut ticker = tokio::time::interval(spec.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let result = check_once(addr, &spec, &client).await;
        let healthy_now = tx.borrow().get(&addr).copied().unwrap_or(true);
        match result {
            Ok(()) => {
                ok_run += 1;
                fail_run = 0;
                if !healthy_now && ok_run >= spec.healthy_threshold {
                    tracing::info!(backend = %addr, "backend healthy again");
                    tx.send_modify(|m| {
                        if let Some(h) = m.get_mut(&addr) {
                            *h = true;
                        }
                    });
                }
            }
            Err(e) => {
                fail_run += 1;
                ok_run = 0;
                if healthy_now && fail_run >= spec.unhealthy_threshold {
                    tracing::warn!(backend = %addr, error = %e, "backend unhealthy: no new flows");
                    tx.send_modify(|m| {
                        if let Some(h) = m.get_mut(&addr) {
                            *h = false;
                        }
                    });
                }
            }
        }
    }
}

/// One check: TCP connect, or an HTTP(S) GET with the expected status.
pub async fn check_once(
    addr: SocketAddr,
    spec: &HealthCheckSpec,
    client: &reqwest::Client,
) -> Result<()> {
    match &spec.http {
        None => {
            tokio::time::timeout(spec.timeout, tokio::net::TcpStream::connect(addr))
                .await
                .map_err(|_| anyhow::anyhow!("connect timed out"))??;
            Ok(())
        }
        Some(h) => {
            let scheme = if h.https { "https" } else { "http" };
            let url = format!("{scheme}://{addr}{}", h.path);
            let resp = client.get(&url).timeout(spec.timeout).send().await?;
            if resp.status().as_u16() != h.expected_status {
                bail!(
                    "GET {url}: status {} (want {})",
                    resp.status(),
                    h.expected_status
                );
            }
            Ok(())
        }
    }
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

    async fn wait_for(rx: &mut watch::Receiver<HealthMap>, addr: SocketAddr, want: bool) {
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if rx.borrow().get(&addr) == Some(&want) {
                    return;
                }
                rx.changed().await.unwrap();
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{addr} never became healthy={want}"));
    }

    #[tokio::test]
    async fn tcp_check_takes_a_dead_backend_out_and_back_in() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mut hc, mut rx) = HealthChecker::new().unwrap();
        hc.set_targets(&fast(), &[addr].into());
        assert_eq!(rx.borrow().get(&addr), Some(&true), "starts healthy");
        drop(listener);
        wait_for(&mut rx, addr, false).await;
        let _listener = tokio::net::TcpListener::bind(addr).await.unwrap();
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
            http: Some(HttpCheck {
                path: "/healthz".into(),
                https: false,
                expected_status: 200,
            }),
            ..fast()
        };
        let (mut hc, mut rx) = HealthChecker::new().unwrap();
        hc.set_targets(&spec, &[addr].into());
        assert!(check_once(addr, &spec, &reqwest::Client::new())
            .await
            .is_ok());
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
