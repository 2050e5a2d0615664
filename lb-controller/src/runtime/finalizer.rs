//! Every controller's finalizers (the OpenStack controllers' and the service controller's): added before any
//! cloud work, removed as the last step of a deletion.
//!
//! Each change is a JSON patch whose `test` operation checks the list (or our entry's position) as this copy of
//! the object saw it, as kube-runtime's own finalizer helper does: the copy usually comes from a watch cache, and
//! a merge patch of the whole list would silently drop a finalizer someone else added or removed meanwhile. On a
//! changed list the server refuses the patch (422) and the controller retries with a fresh copy. Unlike a
//! resourceVersion precondition, a status heartbeat or label change does not make it fail.

use kube::api::{Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::json;
use std::fmt::Debug;

use crate::runtime::api_errors::is_not_found;

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
    let ops = if obj.finalizers().is_empty() {
        json!([
            {"op": "test", "path": "/metadata/finalizers", "value": null},
            {"op": "add", "path": "/metadata/finalizers", "value": [finalizer]},
        ])
    } else {
        json!([
            {"op": "test", "path": "/metadata/finalizers", "value": obj.finalizers()},
            {"op": "add", "path": "/metadata/finalizers/-", "value": finalizer},
        ])
    };
    patch(api, obj, ops).await
}

/// Removes `finalizer` from `obj`, keeping everybody else's.
pub async fn remove<K>(api: &Api<K>, obj: &K, finalizer: &str) -> Result<(), kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let Some(i) = obj.finalizers().iter().position(|f| f == finalizer) else {
        return Ok(());
    };
    let at = format!("/metadata/finalizers/{i}");
    let ops = json!([
        {"op": "test", "path": at, "value": finalizer},
        {"op": "remove", "path": at},
    ]);
    match patch(api, obj, ops).await {
        // Already gone: a reconcile queued while the previous one removed the finalizer still sees the cached
        // copy. Success, so the caller's cleanup after the removal (forgetting metric series) runs; before, the
        // 404 skipped it and the series of a deleted object stayed until the periodic sweep (seen against the
        // real API server).
        Err(e) if is_not_found(&e) => Ok(()),
        result => result,
    }
}

async fn patch<K>(api: &Api<K>, obj: &K, ops: serde_json::Value) -> Result<(), kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let ops: json_patch::Patch = serde_json::from_value(ops).map_err(kube::Error::SerdeError)?;
    api.patch(
        &obj.name_any(),
        &PatchParams::default(),
        &Patch::Json::<()>(ops),
    )
    .await
    .map(|_| ())
}
