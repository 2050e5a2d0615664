//! Stopping the controllers: the shutdown signal as a state every part can wait on however late it starts
//! waiting, and a way to end a kube-runtime controller that works at any point of its start-up.

use std::future::Future;

use futures::FutureExt;
use kube::runtime::reflector::Store;
use tokio::sync::watch;

/// The shutdown signal, shared by clones. A state, not an event: a part that first waits after the signal (a
/// controller polled only once the caches are synced) still sees it.
#[derive(Clone, Debug)]
pub struct Stop(watch::Receiver<bool>);

impl Stop {
    /// Stops when `signal` resolves (driven by a task of its own, so nobody has to poll it).
    pub fn on(signal: impl Future<Output = ()> + Send + 'static) -> Stop {
        let (tx, rx) = watch::channel(false);
        tokio::spawn(async move {
            signal.await;
            tx.send_replace(true);
            // Receivers wait for `true`; a closed channel would read as "never".
            tx.closed().await;
        });
        Stop(rx)
    }

    /// Resolves once stopping.
    pub async fn wait(mut self) {
        let _ = self.0.wait_for(|stopping| *stopping).await;
    }
}

/// Runs a controller's stream (`run`, built with `graceful_shutdown_on(stop.clone().wait())`) to its end.
///
/// kube-runtime's runner starts only once the controller's store is ready, and its graceful shutdown ends the
/// watch that would make the store ready: a shutdown before that point left the stream waiting forever (seen as a
/// SIGTERMed leader that never exited, so never released its Lease). Nothing is in flight before the store is
/// ready, so the stream is then dropped instead.
pub async fn drive<K>(store: Store<K>, run: impl Future<Output = ()>, stop: Stop)
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    let unstarted = async {
        stop.wait().await;
        if store.wait_until_ready().now_or_never().is_none() {
            return;
        }
        std::future::pending::<()>().await
    };
    tokio::select! {
        () = run => {}
        () = unstarted => tracing::debug!("stopped before the controller's cache was ready"),
    }
}
