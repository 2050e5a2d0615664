//! The OpenStack controllers' finalizers: added before any cloud work, removed as the last step of a deletion,
//! each time as one merge patch of the object's whole finalizer list.

use kube::api::{Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::json;
use std::fmt::Debug;

/// Whether `obj` carries `finalizer`.
pub fn has<K: Resource>(obj: &K, finalizer: &str) -> bool {
    obj.finalizers().iter().any(|f| f == finalizer)
}

/// Adds `finalizer` to `obj` unless it is there already.
pub async fn add<K>(api: &Api<K>, obj: &K, finalizer: &str) -> Result<(), kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    if has(obj, finalizer) {
        return Ok(());
    }
    let mut all = obj.finalizers().to_vec();
    all.push(finalizer.to_string());
    patch(api, obj, all).await
}

/// Removes `finalizer` from `obj`, keeping everybody else's.
pub async fn remove<K>(api: &Api<K>, obj: &K, finalizer: &str) -> Result<(), kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let rest: Vec<String> = obj
        .finalizers()
        .iter()
        .filter(|f| *f != finalizer)
        .cloned()
        .collect();
    match patch(api, obj, rest).await {
        // Already gone: a reconcile queued while the previous one removed the finalizer still sees the cached
        // copy. Success, so the caller's cleanup after the removal (forgetting metric series) runs; before, the
        // 404 skipped it and the series of a deleted object stayed until the periodic sweep (seen against the
        // real API server).
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        result => result,
    }
}

async fn patch<K>(api: &Api<K>, obj: &K, finalizers: Vec<String>) -> Result<(), kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    api.patch(
        &obj.name_any(),
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": finalizers}})),
    )
    .await
    .map(|_| ())
}
