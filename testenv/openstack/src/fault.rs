//! A fault-injection HTTP proxy: sits in front of one OpenStack API on 127.0.0.1 and, on demand, answers matching
//! requests with an error (5xx, 409, 413, quota errors), delays them, drops the connection, or forwards them and
//! answers with an error anyway (a create that happened although the client saw a failure); everything else is
//! forwarded unchanged. Controllers' error paths then meet the failures a real cloud produces.
//!
//! Two ways to put a service behind a proxy:
//! - [`FaultProxy::route`] sets the SDK's `<service>_endpoint_override`. Enough for Neutron; not for Nova, because
//!   `openstack_sdk` skips version discovery for an overridden endpoint, so it knows no microversion range and sends
//!   e.g. `compute 2.0`, which Nova answers with 406.
//! - Through the catalog: a second proxy in front of Keystone rewrites the service's catalog URL in the token to the
//!   service's proxy ([`FaultProxy::rewrite_responses`]), and the client authenticates through it. The SDK then
//!   discovers the service (and its microversions) through the proxy as it would on a real cloud.
//!
//! ```no_run
//! # async fn demo(env: openstack_testenv::TestEnv) -> anyhow::Result<()> {
//! use openstack_testenv::{Fault, FaultProxy, Rule};
//! let proxy = FaultProxy::start("http://127.0.0.1:9696").await?;
//! // The next floating IP creation fails as if the project were over quota; everything else passes.
//! proxy.inject(Rule::new("POST", "/floatingips").times(1), Fault::neutron_over_quota("floatingip"));
//! let mut config = env.cloud_config(&env.info.cloud)?;
//! proxy.route(&mut config, "network", "v2.0");
//! let client = env.connect_with(&config).await?;
//!
//! // Nova through the catalog: authenticate through a Keystone proxy whose tokens name the Nova proxy.
//! let nova = FaultProxy::start("http://127.0.0.1:8774").await?;
//! let keystone = FaultProxy::start("http://127.0.0.1:5000").await?;
//! keystone.rewrite_responses("http://127.0.0.1:8774", &nova.url());
//! // A server create that Nova performs while the client gets a 500: duplicate protection is tested.
//! nova.inject(Rule::new("POST", "/servers").times(1), Fault::internal_error().after_forwarding());
//! let mut config = env.cloud_config(&env.info.cloud)?;
//! if let Some(auth) = config.auth.as_mut() {
//!     auth.auth_url = Some(format!("{}/v3", keystone.url()));
//! }
//! let client = env.connect_with(&config).await?;
//! # Ok(()) }
//! ```

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use openstack_sdk::config::CloudConfig;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// What to do with a matching request.
#[derive(Debug, Clone)]
pub enum Fault {
    /// Answer instead of forwarding.
    Respond {
        /// HTTP status.
        status: u16,
        /// JSON body.
        body: String,
    },
    /// Wait, then forward (a slow API; combine with a client timeout to test time-outs).
    Delay(Duration),
    /// Close the connection without an answer (a crashed API worker or a broken load balancer in front of it).
    Drop,
    /// Forward the request (the API acts on it), discard the API's answer and answer this instead: a create that
    /// succeeded although the client saw an error (the API or a load balancer failing after the commit), the case
    /// that catches clients which retry a create without looking for what the first attempt made. Built with
    /// [`Fault::after_forwarding`].
    RespondAfterForwarding {
        /// HTTP status.
        status: u16,
        /// JSON body.
        body: String,
    },
}

impl Fault {
    /// An arbitrary status with an OpenStack-style error body.
    pub fn status(status: u16, message: &str) -> Self {
        let title = StatusCode::from_u16(status)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("Error");
        Fault::Respond {
            status,
            body: error_body(title, status, message),
        }
    }

    /// 500 Internal Server Error.
    pub fn internal_error() -> Self {
        Self::status(500, "injected internal server error")
    }

    /// 503 Service Unavailable (an API restarting behind its load balancer).
    pub fn unavailable() -> Self {
        Self::status(503, "injected: service unavailable")
    }

    /// 409 Conflict, e.g. Nova's "Cannot 'delete' instance while it is in task_state …" or a Neutron IP in use.
    pub fn conflict(message: &str) -> Self {
        Self::status(409, message)
    }

    /// Neutron's quota error: 409 with `OverQuota`, as Neutron answers when a project has used up `resource`
    /// (`port`, `floatingip`, `security_group`, `security_group_rule`, `network`, …).
    pub fn neutron_over_quota(resource: &str) -> Self {
        let message = format!("Quota exceeded for resources: ['{resource}'].");
        Fault::Respond {
            status: 409,
            body: serde_json::json!({"NeutronError": {"type": "OverQuota", "message": message, "detail": ""}})
                .to_string(),
        }
    }

    /// Nova's and Glance's limit error: 413 with `overLimit` (Nova still answers 413 for some limits, e.g. metadata
    /// items, and 403 `Quota exceeded` for instances/cores/ram: see [`Fault::nova_over_quota`]).
    pub fn over_limit(message: &str) -> Self {
        Fault::Respond {
            status: 413,
            body: serde_json::json!({"overLimit": {"code": 413, "message": message, "retryAfter": "0"}}).to_string(),
        }
    }

    /// The same answer, given after the request was forwarded and carried out ([`Fault::RespondAfterForwarding`]),
    /// e.g. `Fault::internal_error().after_forwarding()`. Only [`Fault::Respond`] changes; other faults are
    /// returned as they are.
    pub fn after_forwarding(self) -> Self {
        match self {
            Fault::Respond { status, body } => Fault::RespondAfterForwarding { status, body },
            other => other,
        }
    }

    /// Nova's quota error when creating servers or server groups: 403 `Quota exceeded`.
    pub fn nova_over_quota(resource: &str) -> Self {
        let message = format!(
            "Quota exceeded for {resource}: Requested 1, but already used 10 of 10 {resource}"
        );
        Fault::Respond {
            status: 403,
            body: serde_json::json!({"forbidden": {"code": 403, "message": message}}).to_string(),
        }
    }
}

/// The JSON error body most OpenStack APIs (webob) use.
fn error_body(title: &str, status: u16, message: &str) -> String {
    let key = title.to_ascii_lowercase().replace(' ', "_");
    serde_json::json!({ key: {"code": status, "message": message, "title": title} }).to_string()
}

/// Which requests a [`Fault`] applies to.
#[derive(Debug, Clone)]
pub struct Rule {
    /// HTTP method (`GET`, `POST`, …), or `*` for any.
    method: String,
    /// Matches when the request path contains this (e.g. `/floatingips`, `/servers/`, `/os-server-groups`).
    path_contains: String,
    /// ... and contains none of these.
    except: Vec<String>,
    /// Apply to the next N matching requests only; `None` = until cleared.
    times: Option<u32>,
}

impl Rule {
    /// Requests with `method` (or `*`) whose path contains `path_contains`.
    pub fn new(method: &str, path_contains: &str) -> Self {
        Rule {
            method: method.to_ascii_uppercase(),
            path_contains: path_contains.into(),
            except: Vec::new(),
            times: None,
        }
    }

    /// Does not apply to paths that also contain `path_contains`, e.g. `Rule::new("GET", "/servers/")
    /// .except("/servers/detail")` hits reads of one server but not the server list.
    pub fn except(mut self, path_contains: &str) -> Self {
        self.except.push(path_contains.into());
        self
    }

    /// Applies to the next `n` matching requests, then the rule is gone.
    pub fn times(mut self, n: u32) -> Self {
        self.times = Some(n);
        self
    }

    fn matches(&self, method: &str, path: &str) -> bool {
        (self.method == "*" || self.method == method)
            && path.contains(&self.path_contains)
            && !self.except.iter().any(|e| path.contains(e))
    }
}

/// One request the proxy saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// HTTP method.
    pub method: String,
    /// Path and query.
    pub path: String,
    /// The status returned to the client; `None` when the connection was dropped.
    pub status: Option<u16>,
    /// Whether a fault was applied (a delay counts).
    pub injected: bool,
}

#[derive(Default)]
struct State {
    rules: Vec<(Rule, Fault)>,
    seen: Vec<Seen>,
    /// Extra `(from, to)` replacements in forwarded responses ([`FaultProxy::rewrite_responses`]).
    rewrites: Vec<(String, String)>,
}

impl State {
    /// The fault of the first matching rule, consuming one use of it.
    fn take_fault(&mut self, method: &str, path: &str) -> Option<Fault> {
        let i = self
            .rules
            .iter()
            .position(|(r, _)| r.matches(method, path))?;
        let fault = self.rules[i].1.clone();
        if let Some(n) = &mut self.rules[i].0.times {
            *n -= 1;
            if *n == 0 {
                self.rules.remove(i);
            }
        }
        Some(fault)
    }
}

struct Shared {
    upstream: Uri,
    upstream_origin: String,
    own_origin: String,
    client: Client<HttpConnector, Full<Bytes>>,
    state: Mutex<State>,
}

/// A running proxy; stops when dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// Starts a proxy on 127.0.0.1 (a free port) in front of `upstream`, e.g. `http://127.0.0.1:9696`. Only plain
    /// HTTP upstreams on loopback are accepted: tests send traffic to this machine only.
    pub async fn start(upstream: &str) -> Result<Self> {
        let uri: Uri = upstream
            .parse()
            .with_context(|| format!("fault proxy: bad upstream URL {upstream:?}"))?;
        let host = uri.host().unwrap_or_default();
        if uri.scheme_str() != Some("http")
            || !(host == "localhost" || host == "[::1]" || host.starts_with("127."))
        {
            bail!("fault proxy: the upstream must be http:// on loopback, not {upstream:?}");
        }
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("fault proxy: binding 127.0.0.1")?;
        let addr = listener.local_addr()?;
        let authority = uri.authority().map(|a| a.as_str()).unwrap_or_default();
        let shared = Arc::new(Shared {
            upstream_origin: format!("http://{authority}"),
            own_origin: format!("http://{addr}"),
            upstream: uri,
            client: Client::builder(TokioExecutor::new()).build_http(),
            state: Mutex::new(State::default()),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(FaultProxy {
            addr,
            shared,
            accept,
        })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Adds a rule; rules are tried in the order they were added, the first match wins.
    pub fn inject(&self, rule: Rule, fault: Fault) {
        self.state().rules.push((rule, fault));
    }

    /// Removes every rule: all requests pass through again.
    pub fn clear(&self) {
        self.state().rules.clear();
    }

    /// From now on, replaces `from` by `to` in the bodies and `Location` headers of forwarded responses, after the
    /// proxy's own rewrite of the upstream's origin to its own. Meant for a proxy in front of Keystone:
    /// `rewrite_responses("http://127.0.0.1:8774", &nova_proxy.url())` makes the catalog in its tokens point compute
    /// at `nova_proxy`, so a client authenticating through it reaches Nova through that proxy after the SDK's normal
    /// version discovery (unlike [`FaultProxy::route`]). Injected answers are not rewritten.
    pub fn rewrite_responses(&self, from: &str, to: &str) {
        self.state().rewrites.push((from.into(), to.into()));
    }

    /// Every request seen so far, oldest first.
    pub fn seen(&self) -> Vec<Seen> {
        self.state().seen.clone()
    }

    /// How many requests got an injected fault.
    pub fn injected_count(&self) -> usize {
        self.state().seen.iter().filter(|s| s.injected).count()
    }

    /// Points `service_type` (`network`, `compute`, `image`, …) of `config` at this proxy, at API version path
    /// `version` (`v2.0` for Neutron, `v2.1` for Nova): sets the `<service>_endpoint_override` option that
    /// `openstack_sdk` honours instead of the catalog.
    pub fn route(&self, config: &mut CloudConfig, service_type: &str, version: &str) {
        let key = format!("{}_endpoint_override", service_type.replace('-', "_"));
        let url = format!("{}/{}/", self.url(), version.trim_matches('/'));
        config.options.insert(key, config::Value::from(url));
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| handle(shared.clone(), req));
            // Errors here are clients going away or injected drops: nothing to report.
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The error a service returns to make hyper close the connection without a response.
#[derive(Debug)]
struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped by fault injection")
    }
}

impl std::error::Error for Dropped {}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Dropped> {
    let method = req.method().as_str().to_string();
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string();
    let fault = shared
        .state
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take_fault(&method, &path);
    let record = |status: Option<u16>, injected: bool| {
        let seen = Seen {
            method: method.clone(),
            path: path.clone(),
            status,
            injected,
        };
        shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .seen
            .push(seen);
    };
    let injected = fault.is_some();
    match fault {
        Some(Fault::Respond { status, body }) => {
            record(Some(status), true);
            return Ok(json_response(status, body));
        }
        Some(Fault::Drop) => {
            record(None, true);
            return Err(Dropped);
        }
        Some(Fault::RespondAfterForwarding { status, body }) => {
            // The upstream's answer (or failure) is what the client must not see.
            let _ = forward(&shared, req, &path).await;
            record(Some(status), true);
            return Ok(json_response(status, body));
        }
        Some(Fault::Delay(d)) => tokio::time::sleep(d).await,
        None => {}
    }
    let response = match forward(&shared, req, &path).await {
        Ok(r) => r,
        Err(e) => json_response(
            502,
            error_body(
                "Bad Gateway",
                502,
                &format!("fault proxy: upstream failed: {e:#}"),
            ),
        ),
    };
    record(Some(response.status().as_u16()), injected);
    Ok(response)
}

fn json_response(status: u16, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("x-openstack-request-id", "req-fault-proxy")
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}

/// Forwards a request upstream. Bodies are buffered (API payloads are small) so that links in the answer that
/// point at the upstream (pagination `next`, `Location`, version documents) can be rewritten to the proxy:
/// a client following them stays behind the proxy.
async fn forward(
    shared: &Shared,
    req: Request<Incoming>,
    path: &str,
) -> Result<Response<Full<Bytes>>> {
    let (mut parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .context("reading the request body")?
        .to_bytes();
    let authority = shared
        .upstream
        .authority()
        .context("upstream without authority")?
        .clone();
    parts.uri = Uri::builder()
        .scheme("http")
        .authority(authority.clone())
        .path_and_query(path)
        .build()?;
    parts
        .headers
        .insert(hyper::header::HOST, authority.as_str().parse()?);
    let response = shared
        .client
        .request(Request::from_parts(parts, Full::new(body)))
        .await
        .context("sending upstream")?;
    let (mut parts, body) = response.into_parts();
    let body = body
        .collect()
        .await
        .context("reading the upstream response")?
        .to_bytes();
    let mut rewrites = vec![(shared.upstream_origin.clone(), shared.own_origin.clone())];
    rewrites.extend(
        shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .rewrites
            .iter()
            .cloned(),
    );
    let body = rewrites
        .iter()
        .fold(body, |body, (from, to)| rewrite(&body, from, to));
    if let Some(location) = parts
        .headers
        .get(hyper::header::LOCATION)
        .and_then(|v| v.to_str().ok())
    {
        let location = rewrites
            .iter()
            .fold(location.to_string(), |l, (from, to)| l.replace(from, to));
        parts
            .headers
            .insert(hyper::header::LOCATION, location.parse()?);
    }
    // The body may have changed length; Full sets the right Content-Length on the way out.
    parts.headers.remove(hyper::header::CONTENT_LENGTH);
    parts.headers.remove(hyper::header::TRANSFER_ENCODING);
    Ok(Response::from_parts(parts, Full::new(body)))
}

fn rewrite(body: &Bytes, from: &str, to: &str) -> Bytes {
    match std::str::from_utf8(body) {
        Ok(text) if text.contains(from) => Bytes::from(text.replace(from, to)),
        _ => body.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A tiny upstream on 127.0.0.1 that answers every request with 200 and a body naming its own URL and the path.
    async fn upstream() -> (String, JoinHandle<()>) {
        let (origin, task, _) = counted_upstream().await;
        (origin, task)
    }

    /// [`upstream`], also counting the requests it answered.
    async fn counted_upstream() -> (String, JoinHandle<()>, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let origin = format!("http://{}", listener.local_addr().unwrap());
        let me = origin.clone();
        let count = Arc::new(AtomicUsize::new(0));
        let counter = count.clone();
        let task = tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let me = me.clone();
                let counter = counter.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        counter.fetch_add(1, Ordering::SeqCst);
                        let body = format!(r#"{{"self": "{me}{}"}}"#, req.uri().path());
                        async move { Ok::<_, std::convert::Infallible>(json_response(200, body)) }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        (origin, task, count)
    }

    /// A bare HTTP/1.0 GET, so the tests do not depend on any client's retry behaviour.
    async fn get(addr: SocketAddr, method: &str, path: &str) -> std::io::Result<(u16, String)> {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(
            format!("{method} {path} HTTP/1.0\r\nHost: x\r\nContent-Length: 0\r\n\r\n").as_bytes(),
        )
        .await?;
        let mut buf = String::new();
        s.read_to_string(&mut buf).await?;
        let status = buf
            .get(9..12)
            .and_then(|s| s.parse().ok())
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        let body = buf.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
        Ok((status, body))
    }

    #[tokio::test]
    async fn forwards_and_rewrites_upstream_links() {
        let (origin, _up) = upstream().await;
        let proxy = FaultProxy::start(&origin).await.unwrap();
        let (status, body) = get(proxy.addr(), "GET", "/v2.0/ports?limit=1")
            .await
            .unwrap();
        assert_eq!(status, 200);
        assert_eq!(body, format!(r#"{{"self": "{}/v2.0/ports"}}"#, proxy.url()));
        assert_eq!(
            proxy.seen(),
            vec![Seen {
                method: "GET".into(),
                path: "/v2.0/ports?limit=1".into(),
                status: Some(200),
                injected: false
            }]
        );
    }

    #[tokio::test]
    async fn injects_errors_for_matching_requests_only_and_counts_uses() {
        let (origin, _up) = upstream().await;
        let proxy = FaultProxy::start(&origin).await.unwrap();
        proxy.inject(
            Rule::new("POST", "/floatingips").times(2),
            Fault::neutron_over_quota("floatingip"),
        );
        proxy.inject(Rule::new("*", "/servers"), Fault::internal_error());

        let (status, body) = get(proxy.addr(), "POST", "/v2.0/floatingips")
            .await
            .unwrap();
        assert_eq!(status, 409);
        assert!(body.contains("OverQuota"), "{body}");
        assert_eq!(
            get(proxy.addr(), "GET", "/v2.0/floatingips")
                .await
                .unwrap()
                .0,
            200,
            "GET does not match"
        );
        assert_eq!(
            get(proxy.addr(), "POST", "/v2.0/floatingips")
                .await
                .unwrap()
                .0,
            409
        );
        assert_eq!(
            get(proxy.addr(), "POST", "/v2.0/floatingips")
                .await
                .unwrap()
                .0,
            200,
            "used up after 2"
        );
        assert_eq!(
            get(proxy.addr(), "DELETE", "/v2.1/servers/x")
                .await
                .unwrap()
                .0,
            500
        );
        assert_eq!(
            get(proxy.addr(), "GET", "/v2.1/servers").await.unwrap().0,
            500,
            "until cleared"
        );
        proxy.clear();
        assert_eq!(
            get(proxy.addr(), "GET", "/v2.1/servers").await.unwrap().0,
            200
        );
        assert_eq!(proxy.injected_count(), 4);
    }

    #[tokio::test]
    async fn status_helpers_produce_openstack_bodies() {
        let (origin, _up) = upstream().await;
        let proxy = FaultProxy::start(&origin).await.unwrap();
        proxy.inject(Rule::new("*", "/a").times(1), Fault::over_limit("too many"));
        proxy.inject(Rule::new("*", "/b").times(1), Fault::conflict("in use"));
        proxy.inject(Rule::new("*", "/c").times(1), Fault::unavailable());
        proxy.inject(
            Rule::new("*", "/d").times(1),
            Fault::nova_over_quota("instances"),
        );
        let (s, body) = get(proxy.addr(), "GET", "/a").await.unwrap();
        assert_eq!((s, body.contains("overLimit")), (413, true), "{body}");
        let (s, body) = get(proxy.addr(), "GET", "/b").await.unwrap();
        assert_eq!((s, body.contains("in use")), (409, true), "{body}");
        assert_eq!(get(proxy.addr(), "GET", "/c").await.unwrap().0, 503);
        let (s, body) = get(proxy.addr(), "GET", "/d").await.unwrap();
        assert_eq!((s, body.contains("Quota exceeded")), (403, true), "{body}");
    }

    #[tokio::test]
    async fn extra_rewrites_apply_to_forwarded_answers_only() {
        let (origin, _up) = upstream().await;
        let proxy = FaultProxy::start(&origin).await.unwrap();
        proxy.rewrite_responses("/v2.0/", "/v9/");
        proxy.inject(
            Rule::new("GET", "/injected").times(1),
            Fault::internal_error(),
        );
        let (status, body) = get(proxy.addr(), "GET", "/v2.0/ports").await.unwrap();
        assert_eq!(status, 200);
        // After the origin rewrite: the upstream's URL became the proxy's, then the path changed.
        assert_eq!(body, format!(r#"{{"self": "{}/v9/ports"}}"#, proxy.url()));
        let (status, body) = get(proxy.addr(), "GET", "/v2.0/injected").await.unwrap();
        assert_eq!(status, 500);
        assert!(!body.contains("/v9/"), "{body}");
    }

    #[tokio::test]
    async fn respond_after_forwarding_reaches_the_upstream_and_hides_its_answer() {
        let (origin, _up, count) = counted_upstream().await;
        let proxy = FaultProxy::start(&origin).await.unwrap();
        proxy.inject(
            Rule::new("POST", "/servers").times(1),
            Fault::internal_error().after_forwarding(),
        );
        let (status, body) = get(proxy.addr(), "POST", "/v2.1/servers").await.unwrap();
        assert_eq!(status, 500);
        assert!(body.contains("injected internal server error"), "{body}");
        assert_eq!(
            count.load(Ordering::SeqCst),
            1,
            "the request was carried out"
        );
        assert_eq!(
            get(proxy.addr(), "POST", "/v2.1/servers").await.unwrap().0,
            200
        );
        assert_eq!(count.load(Ordering::SeqCst), 2);
        assert_eq!(proxy.injected_count(), 1);
        assert!(matches!(Fault::Drop.after_forwarding(), Fault::Drop));
    }

    #[tokio::test]
    async fn except_narrows_a_rule() {
        let (origin, _up) = upstream().await;
        let proxy = FaultProxy::start(&origin).await.unwrap();
        proxy.inject(
            Rule::new("GET", "/servers/").except("/servers/detail"),
            Fault::unavailable(),
        );
        assert_eq!(
            get(proxy.addr(), "GET", "/v2.1/servers/detail?name=x")
                .await
                .unwrap()
                .0,
            200
        );
        assert_eq!(
            get(proxy.addr(), "GET", "/v2.1/servers/0b5c")
                .await
                .unwrap()
                .0,
            503
        );
    }

    #[tokio::test]
    async fn delays_and_drops() {
        let (origin, _up) = upstream().await;
        let proxy = FaultProxy::start(&origin).await.unwrap();
        proxy.inject(
            Rule::new("GET", "/slow").times(1),
            Fault::Delay(Duration::from_millis(300)),
        );
        proxy.inject(Rule::new("GET", "/gone").times(1), Fault::Drop);
        let t = std::time::Instant::now();
        assert_eq!(get(proxy.addr(), "GET", "/slow").await.unwrap().0, 200);
        assert!(t.elapsed() >= Duration::from_millis(300));
        assert!(
            get(proxy.addr(), "GET", "/gone").await.is_err(),
            "no response on a dropped connection"
        );
        let seen = proxy.seen();
        assert!(seen[0].injected);
        assert_eq!(seen[1].status, None);
    }

    #[tokio::test]
    async fn refuses_non_loopback_upstreams() {
        assert!(FaultProxy::start("http://192.0.2.1:9696").await.is_err());
        assert!(FaultProxy::start("https://127.0.0.1:9696").await.is_err());
    }

    #[test]
    fn route_sets_the_endpoint_override() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let proxy = FaultProxy::start("http://127.0.0.1:9").await.unwrap();
            let mut config = CloudConfig::default();
            proxy.route(&mut config, "network", "v2.0");
            let value = config
                .options
                .get("network_endpoint_override")
                .unwrap()
                .to_string();
            assert_eq!(value, format!("{}/v2.0/", proxy.url()));
        });
    }
}
