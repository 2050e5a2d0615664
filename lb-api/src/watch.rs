//! How the agent and the controllers watch the API server: one backoff for every watch, and the one error that
//! must not wait for it.

use futures::{Stream, StreamExt};
use kube::runtime::utils::{Backoff, ResetTimerBackoff};
use kube::runtime::watcher::{self, ExponentialBackoff};
use std::time::Duration;

/// kube-runtime's default watch backoff (0.8 s doubling to 30 s, jitter, back to the start after 120 s without
/// errors) minus its reset on every successful event: the watcher emits `Init` before each list attempt, and that
/// reset kept a client whose API server is unreachable retrying about once a second forever — every LB VM at once
/// during a control-plane outage (seen on the VM image's boot test), and each of the controllers' watches (53
/// retries per watch in a 60 s outage of a real API server).
pub struct WatchBackoff(ResetTimerBackoff<ExponentialBackoff>);

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff(ResetTimerBackoff::new(
            backon::ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(800))
                .with_max_delay(Duration::from_secs(30))
                .with_factor(2.0)
                .with_jitter()
                .without_max_times()
                .into(),
            Duration::from_secs(120),
        ))
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        self.0.next()
    }
}

impl Backoff for WatchBackoff {
    /// Only the timer resets it (120 s after the last error), not the stream's successful events.
    fn reset(&mut self) {}
}

/// Whether a watch error is 410 Gone (the resourceVersion was compacted away, typically after an API-server
/// restart): the server is back and a relist is what it asks for, so a client relists at once instead of waiting
/// out a backoff grown during the outage.
pub fn is_gone(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::WatchError(status) => status.code == 410,
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status.code == 410,
        _ => false,
    }
}

/// `stream` (a kube-runtime watcher) without the 410 Gone errors of its watch: the watcher answers them with a
/// relist, which must come at once, but a backoff applied after the stream (`.backoff()`, a controller's
/// `trigger_backoff`) waits after every error alike — after an API-server restart each of the controllers' watches
/// got its 410 and then waited out a backoff grown during the outage (up to a minute per watch, seen on a real API
/// server) before listing again. Only `WatchError` is dropped: after the others the watcher retries the same
/// request, which must stay backed off.
pub fn relist_at_once<S, T>(stream: S) -> impl Stream<Item = Result<T, watcher::Error>>
where
    S: Stream<Item = Result<T, watcher::Error>>,
{
    stream.filter(|item| {
        let gone = matches!(item, Err(watcher::Error::WatchError(status)) if status.code == 410);
        if gone {
            tracing::info!("watch expired (410 Gone); listing again at once");
        }
        std::future::ready(!gone)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn not_reset_by_successful_events() {
        let mut b = WatchBackoff::default();
        let mut last = Duration::ZERO;
        for _ in 0..6 {
            // What the watcher's `Init` before every list attempt does to the stream's backoff.
            b.reset();
            last = b.next().expect("never gives up");
        }
        // 0.8 s doubled five times (at least, with jitter; capped at 30 s): growing, not stuck near 1 s.
        assert!(last >= Duration::from_secs(20), "{last:?}");
    }

    #[tokio::test]
    async fn a_watch_410_is_not_handed_to_the_backoff() {
        use futures::StreamExt;
        let status = |code| {
            Box::new(kube::core::Status {
                code,
                ..Default::default()
            })
        };
        let items: Vec<Result<u8, watcher::Error>> = vec![
            Ok(1),
            Err(watcher::Error::WatchError(status(410))),
            Err(watcher::Error::WatchError(status(500))),
            Ok(2),
        ];
        let seen: Vec<String> = relist_at_once(futures::stream::iter(items))
            .map(|i| match i {
                Ok(n) => n.to_string(),
                Err(watcher::Error::WatchError(s)) => s.code.to_string(),
                Err(e) => e.to_string(),
            })
            .collect()
            .await;
        assert_eq!(seen, ["1", "500", "2"]);
    }

    #[test]
    fn only_410_is_gone() {
        let status = |code| {
            Box::new(kube::core::Status {
                code,
                ..Default::default()
            })
        };
        assert!(is_gone(&watcher::Error::WatchError(status(410))));
        assert!(!is_gone(&watcher::Error::WatchError(status(500))));
        assert!(!is_gone(&watcher::Error::NoResourceVersion));
    }
}
