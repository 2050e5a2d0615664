//! Which requests the API server refused a client: a [`kube::Client`] whose every answer passes a tower layer that
//! records the 401s and 403s. A test runs controllers or agents over such clients and then asserts that nothing was
//! refused — proof that the RBAC they run under covers everything they did, which their own error handling
//! (retries, warning logs, a failed event left unwritten) would otherwise hide.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::SystemTime;

use anyhow::Result;
use kube::client::{Body, ClientBuilder};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::Client;

/// One refused request.
#[derive(Clone, Debug)]
pub struct Refusal {
    /// Whose client it was (the name given to [`Refusals::client`]).
    pub who: String,
    /// 401 (not authenticated) or 403 (Forbidden).
    pub status: u16,
    /// Method and path with query, e.g. `GET /api/v1/namespaces/ns/secrets/cloud`.
    pub request: String,
    pub at: SystemTime,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.who, self.status, self.request)
    }
}

/// The refusals of every client made by [`Refusals::client`] from this value (clones share them).
#[derive(Clone, Default)]
pub struct Refusals(Arc<Mutex<Vec<Refusal>>>);

impl Refusals {
    /// A client from a kubeconfig's text whose refused requests are recorded here under `who`.
    pub async fn client(&self, kubeconfig: &str, who: &str) -> Result<Client> {
        // As in `client_from`: choose the workspace's rustls provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let config = kube::Config::from_custom_kubeconfig(
            Kubeconfig::from_yaml(kubeconfig)?,
            &KubeConfigOptions::default(),
        )
        .await?;
        Ok(ClientBuilder::try_from(config)?
            .with_layer(&Record {
                refusals: self.clone(),
                who: who.into(),
            })
            .build())
    }

    /// Everything refused so far.
    pub fn all(&self) -> Vec<Refusal> {
        self.0.lock().unwrap().clone()
    }

    /// Removes and returns the refusals recorded from `from` to `to`: those a test expects, e.g. while an API server
    /// starts (it serves requests before its authorizer's caches have synced, and refuses them meanwhile).
    pub fn take_between(&self, from: SystemTime, to: SystemTime) -> Vec<Refusal> {
        let mut all = self.0.lock().unwrap();
        let (taken, kept) = all.drain(..).partition(|r| from <= r.at && r.at <= to);
        *all = kept;
        taken
    }

    /// Fails naming every refused request, if there was one.
    pub fn assert_none(&self) -> Result<()> {
        let all = self.all();
        anyhow::ensure!(
            all.is_empty(),
            "{} request(s) refused by the API server:\n{}",
            all.len(),
            all.iter()
                .map(|r| format!("  {r}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        Ok(())
    }
}

/// The layer [`Refusals::client`] puts around kube's stack.
#[derive(Clone)]
struct Record {
    refusals: Refusals,
    who: Arc<str>,
}

impl<S> tower::Layer<S> for Record {
    type Service = Recorded<S>;
    fn layer(&self, inner: S) -> Recorded<S> {
        Recorded {
            inner,
            record: self.clone(),
        }
    }
}

#[derive(Clone)]
struct Recorded<S> {
    inner: S,
    record: Record,
}

impl<S, B> tower::Service<http::Request<Body>> for Recorded<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<B>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
{
    type Response = http::Response<B>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<B>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let what = format!("{} {}", request.method(), request.uri());
        let answer = self.inner.call(request);
        let record = self.record.clone();
        Box::pin(async move {
            let response = answer.await?;
            let status = response.status().as_u16();
            if status == 401 || status == 403 {
                record.refusals.0.lock().unwrap().push(Refusal {
                    who: record.who.to_string(),
                    status,
                    request: what,
                    at: SystemTime::now(),
                });
            }
            Ok(response)
        })
    }
}
