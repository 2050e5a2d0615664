//! How every controller here watches the API server: `lb_api::watch`'s backoff after failed attempts, and a relist
//! at once after 410 Gone (`lb_api::watch::relist_at_once`) — kube-runtime's `Controller::new` and `.backoff()` would
//! wait after that too.

use std::fmt::Debug;

use futures::Stream;
use kube::runtime::reflector;
use kube::runtime::watcher::{self, watcher};
use kube::runtime::{Controller, WatchStreamExt};
use kube::{Api, Resource};
use lb_api::watch::{relist_at_once, WatchBackoff};
use serde::de::DeserializeOwned;

/// A watch of `api`'s objects (for a reflector or a controller's secondary triggers).
pub fn events<K>(
    api: Api<K>,
    config: watcher::Config,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    relist_at_once(watcher(api, config)).backoff(WatchBackoff::default())
}

/// A controller of `api`'s objects, like `Controller::new(api, config)` with this module's watch.
pub fn controller<K>(api: Api<K>, config: watcher::Config) -> Controller<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (reader, writer) = reflector::store();
    let trigger = relist_at_once(watcher(api, config))
        .reflect(writer)
        .applied_objects();
    Controller::for_stream(trigger, reader).trigger_backoff(WatchBackoff::default())
}
