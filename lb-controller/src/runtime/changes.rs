//! Which watch events wake a controller: a fingerprint of what it reacts to per object, so that heartbeat-only
//! updates (every 30 s per agent) wake nobody.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use futures::{Stream, StreamExt};
use kube::runtime::watcher;
use kube::Resource;

/// A watch stream reduced to the changes that matter: an object is passed on when `fingerprint` changes and always
/// when it is deleted (a fingerprint filter alone would swallow deletions). Heartbeat-only updates of machines, every
/// 30 s per agent, thus wake nobody.
pub fn relevant_changes<K, S>(
    stream: S,
    fingerprint: fn(&K) -> u64,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send
where
    K: Resource + Send + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    let mut seen: HashMap<String, u64> = HashMap::new();
    let key = |k: &K| {
        let m = k.meta();
        format!(
            "{}/{}/{}",
            m.namespace.as_deref().unwrap_or(""),
            m.name.as_deref().unwrap_or(""),
            m.uid.as_deref().unwrap_or("")
        )
    };
    stream.filter_map(move |event| {
        let out = match event {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                let f = fingerprint(&o);
                (seen.insert(key(&o), f) != Some(f)).then_some(Ok(o))
            }
            Ok(watcher::Event::Delete(o)) => {
                seen.remove(&key(&o));
                Some(Ok(o))
            }
            Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
            Err(e) => Some(Err(e)),
        };
        std::future::ready(out)
    })
}

/// A fingerprint of `value` (what of an object a controller reacts to).
pub fn hash_of(value: &impl Hash) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut h);
    h.finish()
}
