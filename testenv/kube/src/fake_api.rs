//! `FakeApiServer`: an in-memory, in-process stand-in for kube-apiserver, kept for the controller benchmark
//! (`benches/controller/src/bin/bench-controller.rs`: thousands of objects without an API server's own cost in the
//! numbers) and its own tests; its schema check ([`validate`]) also serves a unit test. Everything that judges
//! Kubernetes behaviour runs against the real API server ([`crate::KubeEnv`]). It is a `tower::Service` that a
//! real [`kube::Client`] talks to, so the controllers run unmodified (reflectors, watches, patches, finalizers)
//! without sockets or timing tricks.
//!
//! Supported semantics (what kube-runtime and the controllers need):
//! - get, list (label and field selectors), watch (replay from any `resourceVersion`, then live),
//!   create (`generateName`, `AlreadyExists`), replace (optimistic concurrency on
//!   `metadata.resourceVersion`), JSON merge patch / strategic merge patch (treated as merge) /
//!   server-side apply (treated as merge, creating when missing), delete;
//! - `status` subresource: writes to the main resource keep the status, writes to `/status`
//!   change only the status; `metadata.generation` increases on spec changes;
//! - finalizers: delete sets `deletionTimestamp`, the object goes away once its last finalizer is
//!   removed;
//! - installed CRDs: structural-schema defaults are applied and simple validation (type, required,
//!   minimum/maximum, minLength/maxLength, pattern, enum) rejects invalid objects with 422, like
//!   the real server;
//! - JSON patch (RFC 6902, with `test`; a failed operation is a 422).
//!
//! Not supported: pagination (lists return everything), garbage collection through
//! owner references, admission, RBAC.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::{json, Map, Value};
use tokio::sync::{broadcast, mpsc};

use crate::json_merge;

/// Boxed response body: either a full JSON document or a stream of watch events.
type FakeBody = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;

/// Identifies a resource collection: API group ("" for core) and plural name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ResourceKey {
    /// API group, "" for the core group.
    pub group: String,
    /// Plural resource name, e.g. `services`.
    pub plural: String,
}

impl ResourceKey {
    /// A resource in the given group.
    pub fn new(group: &str, plural: &str) -> Self {
        Self {
            group: group.to_string(),
            plural: plural.to_string(),
        }
    }
}

#[derive(Clone, Debug)]
struct ResourceInfo {
    api_version: String,
    kind: String,
    namespaced: bool,
    status_subresource: bool,
    /// openAPIV3Schema of an installed CRD (defaults + validation).
    schema: Option<Value>,
}

#[derive(Clone, Debug)]
struct WatchEvent {
    key: ResourceKey,
    resource_version: u64,
    type_: &'static str,
    object: Arc<Value>,
}

#[derive(Default)]
struct Store {
    objects: HashMap<ResourceKey, BTreeMap<(String, String), Value>>,
    /// Every change ever made, so watches can resume from any resourceVersion.
    log: Vec<WatchEvent>,
    resource_version: u64,
    resources: HashMap<ResourceKey, ResourceInfo>,
}

struct Inner {
    store: Mutex<Store>,
    events: broadcast::Sender<WatchEvent>,
    requests: AtomicU64,
    writes: AtomicU64,
    unavailable: std::sync::atomic::AtomicBool,
    uid_counter: AtomicU64,
}

/// In-memory Kubernetes API server (see the module docs). Cloning shares the same state.
#[derive(Clone)]
pub struct FakeApiServer {
    inner: Arc<Inner>,
}

impl Default for FakeApiServer {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeApiServer {
    /// An empty server knowing the core kinds the controllers use (services, nodes, events,
    /// namespaces, secrets, configmaps, service accounts, roles, role bindings, leases,
    /// events.k8s.io events). Install CRDs with [`Self::install_crd`].
    pub fn new() -> Self {
        let (events, _) = broadcast::channel(1 << 16);
        let server = Self {
            inner: Arc::new(Inner {
                store: Mutex::new(Store::default()),
                events,
                requests: AtomicU64::new(0),
                writes: AtomicU64::new(0),
                unavailable: std::sync::atomic::AtomicBool::new(false),
                uid_counter: AtomicU64::new(0),
            }),
        };
        let builtin = [
            ("", "v1", "services", "Service", true, true),
            ("", "v1", "nodes", "Node", false, true),
            ("", "v1", "events", "Event", true, false),
            ("", "v1", "namespaces", "Namespace", false, true),
            ("", "v1", "secrets", "Secret", true, false),
            ("", "v1", "configmaps", "ConfigMap", true, false),
            ("", "v1", "serviceaccounts", "ServiceAccount", true, false),
            (
                "rbac.authorization.k8s.io",
                "v1",
                "roles",
                "Role",
                true,
                false,
            ),
            (
                "rbac.authorization.k8s.io",
                "v1",
                "rolebindings",
                "RoleBinding",
                true,
                false,
            ),
            ("coordination.k8s.io", "v1", "leases", "Lease", true, false),
            ("events.k8s.io", "v1", "events", "Event", true, false),
        ];
        {
            let mut store = server.inner.store.lock().unwrap();
            for (group, version, plural, kind, namespaced, status) in builtin {
                let api_version = if group.is_empty() {
                    version.to_string()
                } else {
                    format!("{group}/{version}")
                };
                store.resources.insert(
                    ResourceKey::new(group, plural),
                    ResourceInfo {
                        api_version,
                        kind: kind.to_string(),
                        namespaced,
                        status_subresource: status,
                        schema: None,
                    },
                );
            }
        }
        server
    }

    /// Serves the CRD's kind (first served version), applying its schema defaults and validation.
    pub fn install_crd(&self, crd: &CustomResourceDefinition) {
        let version = crd
            .spec
            .versions
            .iter()
            .find(|v| v.served)
            .expect("CRD has a served version");
        let schema = version
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .map(|s| serde_json::to_value(s).expect("schema serialises"));
        let info = ResourceInfo {
            api_version: format!("{}/{}", crd.spec.group, version.name),
            kind: crd.spec.names.kind.clone(),
            namespaced: crd.spec.scope == "Namespaced",
            status_subresource: version
                .subresources
                .as_ref()
                .is_some_and(|s| s.status.is_some()),
            schema,
        };
        let key = ResourceKey::new(&crd.spec.group, &crd.spec.names.plural);
        self.inner.store.lock().unwrap().resources.insert(key, info);
    }

    /// A `kube::Client` talking to this server. Must be called inside a Tokio runtime.
    pub fn client(&self) -> kube::Client {
        kube::Client::new(
            FakeService {
                server: self.clone(),
            },
            "default",
        )
    }

    /// Number of HTTP requests served so far.
    pub fn request_count(&self) -> u64 {
        self.inner.requests.load(Ordering::Relaxed)
    }

    /// Simulates an API-server outage: while set, every request fails with 503 and open watches
    /// are ended (clients must back off and re-watch).
    pub fn set_unavailable(&self, unavailable: bool) {
        self.inner.unavailable.store(unavailable, Ordering::SeqCst);
        if unavailable {
            // Wake every watch task so it notices the outage and closes its stream.
            let _ = self.inner.events.send(WatchEvent {
                key: ResourceKey::new("", ""),
                resource_version: 0,
                type_: "BOOKMARK",
                object: Arc::new(Value::Null),
            });
        }
    }

    /// Number of successful writes (create, update, patch, delete) so far.
    pub fn write_count(&self) -> u64 {
        self.inner.writes.load(Ordering::Relaxed)
    }

    /// The stored object, if any (`namespace` is "" for cluster-scoped objects).
    pub fn get(&self, key: &ResourceKey, namespace: &str, name: &str) -> Option<Value> {
        let store = self.inner.store.lock().unwrap();
        store
            .objects
            .get(key)?
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// All stored objects of a resource.
    pub fn list(&self, key: &ResourceKey) -> Vec<Value> {
        let store = self.inner.store.lock().unwrap();
        store
            .objects
            .get(key)
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Number of stored objects of a resource satisfying `predicate` (no copies; for polling
    /// in benchmarks).
    pub fn count(&self, key: &ResourceKey, predicate: impl Fn(&Value) -> bool) -> usize {
        let store = self.inner.store.lock().unwrap();
        store
            .objects
            .get(key)
            .map_or(0, |m| m.values().filter(|v| predicate(v)).count())
    }

    /// Test helper: stores `object` as given (including status), bypassing subresource rules,
    /// and notifies watchers. Sets uid/resourceVersion/creationTimestamp when missing.
    pub fn put(&self, key: &ResourceKey, mut object: Value) -> Value {
        let mut store = self.inner.store.lock().unwrap();
        let namespace = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let name = object["metadata"]["name"]
            .as_str()
            .expect("object has a name")
            .to_string();
        let existing = store
            .objects
            .get(key)
            .and_then(|m| m.get(&(namespace.clone(), name.clone())));
        let type_ = if existing.is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        if let Some(info) = store.resources.get(key) {
            object["apiVersion"] = json!(info.api_version);
            object["kind"] = json!(info.kind);
        }
        let meta = object["metadata"]
            .as_object_mut()
            .expect("metadata is an object");
        if !meta.contains_key("uid") {
            let uid = existing
                .and_then(|e| e["metadata"]["uid"].as_str().map(str::to_string))
                .unwrap_or_else(|| self.new_uid());
            meta.insert("uid".into(), json!(uid));
        }
        meta.entry("creationTimestamp")
            .or_insert_with(|| json!(now_rfc3339()));
        self.commit(&mut store, key, namespace, name, type_, object)
    }

    /// Test helper: deletes an object immediately (ignoring finalizers) and notifies watchers.
    pub fn remove(&self, key: &ResourceKey, namespace: &str, name: &str) -> Option<Value> {
        let mut store = self.inner.store.lock().unwrap();
        let object = store
            .objects
            .get_mut(key)?
            .remove(&(namespace.to_string(), name.to_string()))?;
        Some(self.commit_delete(&mut store, key, object))
    }

    fn new_uid(&self) -> String {
        let n = self.inner.uid_counter.fetch_add(1, Ordering::Relaxed) + 1;
        format!("00000000-0000-4000-8000-{n:012x}")
    }

    /// Stores a new version of an object, bumps its resourceVersion and notifies watchers.
    fn commit(
        &self,
        store: &mut Store,
        key: &ResourceKey,
        namespace: String,
        name: String,
        type_: &'static str,
        mut object: Value,
    ) -> Value {
        store.resource_version += 1;
        let rv = store.resource_version;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        store
            .objects
            .entry(key.clone())
            .or_default()
            .insert((namespace, name), object.clone());
        self.publish(store, key, rv, type_, object.clone());
        object
    }

    fn commit_delete(&self, store: &mut Store, key: &ResourceKey, mut object: Value) -> Value {
        store.resource_version += 1;
        let rv = store.resource_version;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.publish(store, key, rv, "DELETED", object.clone());
        object
    }

    fn publish(
        &self,
        store: &mut Store,
        key: &ResourceKey,
        rv: u64,
        type_: &'static str,
        object: Value,
    ) {
        let event = WatchEvent {
            key: key.clone(),
            resource_version: rv,
            type_,
            object: Arc::new(object),
        };
        store.log.push(event.clone());
        // No receivers is fine: nobody is watching yet.
        let _ = self.inner.events.send(event);
    }

    async fn handle(&self, request: Request<kube::client::Body>) -> Response<FakeBody> {
        self.inner.requests.fetch_add(1, Ordering::Relaxed);
        if self.inner.unavailable.load(Ordering::SeqCst) {
            return status_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "fake outage",
            );
        }
        let (parts, body) = request.into_parts();
        let body = match body.collect_bytes().await {
            Ok(bytes) => bytes,
            Err(e) => {
                return status_response(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string())
            }
        };
        let query: HashMap<String, String> = parts
            .uri
            .query()
            .map(|q| url_decode_pairs(q).collect())
            .unwrap_or_default();
        let Some(route) = Route::parse(parts.uri.path()) else {
            return status_response(StatusCode::NOT_FOUND, "NotFound", "unknown path");
        };
        let info = {
            let store = self.inner.store.lock().unwrap();
            store.resources.get(&route.key).cloned()
        };
        let Some(info) = info else {
            return status_response(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!(
                    "the server could not find the requested resource ({})",
                    route.key.plural
                ),
            );
        };
        let content_type = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let body: Option<Value> = if body.is_empty() {
            None
        } else {
            match serde_json::from_slice(&body).or_else(|_| serde_yaml::from_slice(&body)) {
                Ok(v) => Some(v),
                Err(e) => {
                    return status_response(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string())
                }
            }
        };
        let result = match (
            &parts.method,
            route.name.as_deref(),
            route.subresource.as_deref(),
        ) {
            (&Method::GET, None, None)
                if query.get("watch").is_some_and(|w| w == "true" || w == "1") =>
            {
                return self.watch(&route, &query);
            }
            (&Method::GET, None, None) => self.list_objects(&route, &info, &query),
            (&Method::GET, Some(name), _) => self.get_object(&route, name),
            (&Method::POST, None, None) => self.create(&route, &info, body),
            (&Method::PUT, Some(name), sub) => self.replace(&route, &info, name, sub, body),
            (&Method::PATCH, Some(name), sub) => {
                self.patch(&route, &info, name, sub, body, &content_type)
            }
            (&Method::DELETE, Some(name), None) => self.delete(&route, name),
            _ => Err(ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                "not supported",
            )),
        };
        match result {
            Ok((code, value)) => json_response(code, &value),
            Err(e) => status_response(e.code, e.reason, &e.message),
        }
    }

    fn list_objects(
        &self,
        route: &Route,
        info: &ResourceInfo,
        query: &HashMap<String, String>,
    ) -> Result<(StatusCode, Value), ApiError> {
        let store = self.inner.store.lock().unwrap();
        let items: Vec<Value> = store
            .objects
            .get(&route.key)
            .map(|m| {
                m.values()
                    .filter(|o| matches(o, route, query))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        Ok((
            StatusCode::OK,
            json!({
                "apiVersion": info.api_version,
                "kind": format!("{}List", info.kind),
                "metadata": {"resourceVersion": store.resource_version.to_string()},
                "items": items,
            }),
        ))
    }

    fn get_object(&self, route: &Route, name: &str) -> Result<(StatusCode, Value), ApiError> {
        let store = self.inner.store.lock().unwrap();
        store
            .objects
            .get(&route.key)
            .and_then(|m| m.get(&(route.namespace.clone(), name.to_string())))
            .map(|o| (StatusCode::OK, o.clone()))
            .ok_or_else(|| ApiError::not_found(&route.key, name))
    }

    fn watch(&self, route: &Route, query: &HashMap<String, String>) -> Response<FakeBody> {
        let since: u64 = query
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        tracing::debug!(
            resource = route.key.plural,
            namespace = route.namespace,
            since,
            "fake watch started"
        );
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        let mut live = {
            // Subscribe while holding the lock: no event can slip between replay and live.
            let store = self.inner.store.lock().unwrap();
            let live = self.inner.events.subscribe();
            let replay: Vec<&WatchEvent> = if since == 0 {
                // "Any" version: synthesize ADDED for the current state, like the real server.
                Vec::new()
            } else {
                store
                    .log
                    .iter()
                    .filter(|e| e.resource_version > since && e.key == route.key)
                    .collect()
            };
            if since == 0 {
                for object in store
                    .objects
                    .get(&route.key)
                    .into_iter()
                    .flat_map(|m| m.values())
                {
                    if matches(object, route, query) {
                        let _ = tx.send(watch_line("ADDED", object));
                    }
                }
            }
            for event in replay {
                if matches(&event.object, route, query) {
                    let _ = tx.send(watch_line(event.type_, &event.object));
                }
            }
            live
        };
        let route = route.clone();
        let query = query.clone();
        let inner = self.inner.clone();
        tokio::spawn(async move {
            loop {
                if inner.unavailable.load(Ordering::SeqCst) {
                    return;
                }
                match live.recv().await {
                    Ok(event) => {
                        if event.key == route.key
                            && event.resource_version > since
                            && matches(&event.object, &route, &query)
                            && tx.send(watch_line(event.type_, &event.object)).is_err()
                        {
                            return; // client went away
                        }
                    }
                    // Lagging or shutdown: end the watch; the client re-watches from its last
                    // resourceVersion and the log replays what it missed.
                    Err(_) => return,
                }
                if tx.is_closed() {
                    return;
                }
            }
        });
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|line| (Ok::<_, Infallible>(http_body::Frame::data(line)), rx))
        });
        Response::builder()
            .status(StatusCode::OK)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(BodyExt::boxed_unsync(StreamBody::new(stream)))
            .expect("valid response")
    }

    fn create(
        &self,
        route: &Route,
        info: &ResourceInfo,
        body: Option<Value>,
    ) -> Result<(StatusCode, Value), ApiError> {
        let mut object = body.ok_or_else(|| ApiError::bad_request("missing body"))?;
        if !object["metadata"].is_object() {
            object["metadata"] = json!({});
        }
        let mut name = object["metadata"]["name"]
            .as_str()
            .unwrap_or("")
            .to_string();
        if name.is_empty() {
            let prefix = object["metadata"]["generateName"].as_str().unwrap_or("");
            if prefix.is_empty() {
                return Err(ApiError::invalid(
                    "metadata.name or metadata.generateName is required",
                ));
            }
            name = format!(
                "{prefix}{:05x}",
                self.inner.uid_counter.load(Ordering::Relaxed) + 1
            );
        }
        object["apiVersion"] = json!(info.api_version);
        object["kind"] = json!(info.kind);
        {
            let meta = object["metadata"].as_object_mut().expect("object");
            meta.insert("name".into(), json!(name));
            if info.namespaced {
                meta.insert("namespace".into(), json!(route.namespace));
            }
            meta.insert("uid".into(), json!(self.new_uid()));
            meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
            meta.insert("generation".into(), json!(1));
            meta.remove("deletionTimestamp");
        }
        if info.status_subresource {
            if let Some(map) = object.as_object_mut() {
                map.remove("status");
            }
        }
        apply_schema(info, &mut object)?;
        let mut store = self.inner.store.lock().unwrap();
        let id = (route.namespace.clone(), name.clone());
        if store
            .objects
            .get(&route.key)
            .is_some_and(|m| m.contains_key(&id))
        {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "AlreadyExists",
                &format!("{} \"{name}\" already exists", route.key.plural),
            ));
        }
        self.inner.writes.fetch_add(1, Ordering::Relaxed);
        let stored = self.commit(&mut store, &route.key, id.0, id.1, "ADDED", object);
        Ok((StatusCode::CREATED, stored))
    }

    fn replace(
        &self,
        route: &Route,
        info: &ResourceInfo,
        name: &str,
        subresource: Option<&str>,
        body: Option<Value>,
    ) -> Result<(StatusCode, Value), ApiError> {
        let new = body.ok_or_else(|| ApiError::bad_request("missing body"))?;
        self.update(route, info, name, subresource, |_| Ok(new))
    }

    fn patch(
        &self,
        route: &Route,
        info: &ResourceInfo,
        name: &str,
        subresource: Option<&str>,
        body: Option<Value>,
        content_type: &str,
    ) -> Result<(StatusCode, Value), ApiError> {
        let patch = body.ok_or_else(|| ApiError::bad_request("missing body"))?;
        if content_type.starts_with("application/json-patch+json") {
            // RFC 6902 (the controllers' finalizer changes use its `test` operation): a failed operation is
            // refused with 422, as the real server does.
            return self.update(route, info, name, subresource, |current| {
                // The real server's implementation lets a `test` for null pass on a missing path (kube-runtime's
                // finalizer relies on it); RFC 6902 and the json-patch crate do not.
                let ops: Vec<Value> = patch
                    .as_array()
                    .ok_or_else(|| ApiError::bad_request("a JSON patch is an array"))?
                    .iter()
                    .filter(|op| {
                        !(op["op"] == "test"
                            && op["value"].is_null()
                            && op["path"]
                                .as_str()
                                .is_some_and(|p| current.pointer(p).is_none()))
                    })
                    .cloned()
                    .collect();
                let ops: json_patch::Patch = serde_json::from_value(Value::Array(ops))
                    .map_err(|e| ApiError::bad_request(&format!("invalid JSON patch: {e}")))?;
                let mut patched = current.clone();
                json_patch::patch(&mut patched, &ops)
                    .map_err(|e| ApiError::invalid(&format!("JSON patch: {e}")))?;
                // The real server stores no empty list (omitempty), so the next `test` of a missing list holds.
                if patched["metadata"]["finalizers"] == json!([]) {
                    if let Some(m) = patched["metadata"].as_object_mut() {
                        m.remove("finalizers");
                    }
                }
                Ok(patched)
            });
        }
        let is_apply = content_type.starts_with("application/apply-patch");
        let exists = self.get_object(route, name).is_ok();
        if !exists && is_apply && subresource.is_none() {
            let mut object = patch;
            object["metadata"]["name"] = json!(name);
            return self.create(route, info, Some(object));
        }
        self.update(route, info, name, subresource, |current| {
            let mut merged = current.clone();
            json_merge(&mut merged, &patch);
            Ok(merged)
        })
    }

    /// Shared replace/patch path: computes the new object from the current one, applies the
    /// subresource rules, metadata bookkeeping, schema, and the finalizer/deletion rule.
    fn update(
        &self,
        route: &Route,
        info: &ResourceInfo,
        name: &str,
        subresource: Option<&str>,
        compute: impl FnOnce(&Value) -> Result<Value, ApiError>,
    ) -> Result<(StatusCode, Value), ApiError> {
        if subresource.is_some_and(|s| s != "status") {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "NotFound",
                "unknown subresource",
            ));
        }
        let mut store = self.inner.store.lock().unwrap();
        let id = (route.namespace.clone(), name.to_string());
        let current = store
            .objects
            .get(&route.key)
            .and_then(|m| m.get(&id))
            .cloned()
            .ok_or_else(|| ApiError::not_found(&route.key, name))?;
        let mut new = compute(&current)?;
        // Optimistic concurrency: a resourceVersion in the request must match.
        let requested_rv = new["metadata"]["resourceVersion"]
            .as_str()
            .map(str::to_string);
        if let Some(rv) = requested_rv {
            if !rv.is_empty()
                && Some(rv.as_str()) != current["metadata"]["resourceVersion"].as_str()
            {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "Conflict",
                    &format!(
                        "Operation cannot be fulfilled on {} \"{name}\": the object has been modified",
                        route.key.plural
                    ),
                ));
            }
        }
        if subresource == Some("status") {
            // Only the status changes through /status.
            let status = new.get("status").cloned();
            new = current.clone();
            match status {
                Some(status) if !status.is_null() => new["status"] = status,
                _ => {
                    new.as_object_mut().expect("object").remove("status");
                }
            }
        } else {
            if info.status_subresource {
                let map = new
                    .as_object_mut()
                    .ok_or_else(|| ApiError::bad_request("not an object"))?;
                match current.get("status") {
                    Some(status) => map.insert("status".into(), status.clone()),
                    None => map.remove("status"),
                };
            }
            // Immutable / server-owned metadata.
            for field in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "generation",
            ] {
                match current["metadata"].get(field) {
                    Some(v) => new["metadata"][field] = v.clone(),
                    None => {
                        if let Some(m) = new["metadata"].as_object_mut() {
                            m.remove(field);
                        }
                    }
                }
            }
            apply_schema(info, &mut new)?;
            let spec_changed = strip_meta_status(&new) != strip_meta_status(&current);
            if spec_changed {
                let generation = current["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
                new["metadata"]["generation"] = json!(generation);
            }
        }
        new["apiVersion"] = json!(info.api_version);
        new["kind"] = json!(info.kind);
        new["metadata"]["name"] = json!(name);
        if info.namespaced {
            new["metadata"]["namespace"] = json!(route.namespace);
        }
        new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"].clone();
        if new == current {
            // No-op writes do not bump the resourceVersion (like the real server).
            return Ok((StatusCode::OK, current));
        }
        self.inner.writes.fetch_add(1, Ordering::Relaxed);
        let deleting = new["metadata"]["deletionTimestamp"].is_string();
        let no_finalizers = new["metadata"]["finalizers"]
            .as_array()
            .is_none_or(|f| f.is_empty());
        if deleting && no_finalizers {
            store
                .objects
                .get_mut(&route.key)
                .expect("exists")
                .remove(&id);
            let deleted = self.commit_delete(&mut store, &route.key, new);
            return Ok((StatusCode::OK, deleted));
        }
        let stored = self.commit(&mut store, &route.key, id.0, id.1, "MODIFIED", new);
        Ok((StatusCode::OK, stored))
    }

    fn delete(&self, route: &Route, name: &str) -> Result<(StatusCode, Value), ApiError> {
        let mut store = self.inner.store.lock().unwrap();
        let id = (route.namespace.clone(), name.to_string());
        let current = store
            .objects
            .get(&route.key)
            .and_then(|m| m.get(&id))
            .cloned()
            .ok_or_else(|| ApiError::not_found(&route.key, name))?;
        let has_finalizers = current["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        self.inner.writes.fetch_add(1, Ordering::Relaxed);
        if has_finalizers {
            if current["metadata"]["deletionTimestamp"].is_string() {
                return Ok((StatusCode::OK, current));
            }
            let mut marked = current;
            marked["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
            marked["metadata"]["deletionGracePeriodSeconds"] = json!(0);
            let stored = self.commit(&mut store, &route.key, id.0, id.1, "MODIFIED", marked);
            return Ok((StatusCode::OK, stored));
        }
        store
            .objects
            .get_mut(&route.key)
            .expect("exists")
            .remove(&id);
        let deleted = self.commit_delete(&mut store, &route.key, current);
        Ok((StatusCode::OK, deleted))
    }
}

/// The `tower::Service` handed to `kube::Client::new`.
#[derive(Clone)]
struct FakeService {
    server: FakeApiServer,
}

impl tower::Service<Request<kube::client::Body>> for FakeService {
    type Response = Response<FakeBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<kube::client::Body>) -> Self::Future {
        let server = self.server.clone();
        Box::pin(async move { Ok(server.handle(request).await) })
    }
}

#[derive(Clone, Debug)]
struct Route {
    key: ResourceKey,
    /// "" for cluster-scoped requests and all-namespace lists.
    namespace: String,
    name: Option<String>,
    subresource: Option<String>,
}

impl Route {
    fn parse(path: &str) -> Option<Self> {
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (group, rest) = match segments.as_slice() {
            ["api", "v1", rest @ ..] => ("", rest),
            ["apis", group, _version, rest @ ..] => (*group, rest),
            _ => return None,
        };
        let (namespace, rest) = match rest {
            ["namespaces", ns, plural, rest @ ..] => (ns.to_string(), [&[*plural], rest].concat()),
            rest => (String::new(), rest.to_vec()),
        };
        let plural = rest.first()?;
        Some(Self {
            key: ResourceKey::new(group, plural),
            namespace,
            name: rest.get(1).map(|s| s.to_string()),
            subresource: rest.get(2).map(|s| s.to_string()),
        })
    }
}

struct ApiError {
    code: StatusCode,
    reason: &'static str,
    message: String,
}

impl ApiError {
    fn new(code: StatusCode, reason: &'static str, message: &str) -> Self {
        Self {
            code,
            reason,
            message: message.to_string(),
        }
    }
    fn not_found(key: &ResourceKey, name: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("{} \"{name}\" not found", key.plural),
        )
    }
    fn bad_request(message: &str) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "BadRequest", message)
    }
    fn invalid(message: &str) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", message)
    }
}

fn json_response(code: StatusCode, value: &Value) -> Response<FakeBody> {
    Response::builder()
        .status(code)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(BodyExt::boxed_unsync(Full::new(Bytes::from(
            value.to_string(),
        ))))
        .expect("valid response")
}

fn status_response(code: StatusCode, reason: &str, message: &str) -> Response<FakeBody> {
    json_response(
        code,
        &json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code.as_u16(),
        }),
    )
}

fn watch_line(type_: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": type_, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

fn url_decode_pairs(query: &str) -> impl Iterator<Item = (String, String)> + '_ {
    query.split('&').filter(|p| !p.is_empty()).map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (percent_decode(k), percent_decode(v))
    })
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether an object is visible to a list/watch request (namespace and selectors).
fn matches(object: &Value, route: &Route, query: &HashMap<String, String>) -> bool {
    if !route.namespace.is_empty()
        && object["metadata"]["namespace"].as_str().unwrap_or("") != route.namespace
    {
        return false;
    }
    if let Some(selector) = query.get("labelSelector").filter(|s| !s.is_empty()) {
        let labels = object["metadata"]["labels"].as_object();
        if !label_selector_matches(selector, labels) {
            return false;
        }
    }
    if let Some(selector) = query.get("fieldSelector").filter(|s| !s.is_empty()) {
        for requirement in selector.split(',') {
            let (path, want, negate) = if let Some((p, v)) = requirement.split_once("!=") {
                (p, v, true)
            } else if let Some((p, v)) = requirement.split_once("==") {
                (p, v, false)
            } else if let Some((p, v)) = requirement.split_once('=') {
                (p, v, false)
            } else {
                return false;
            };
            let value = path.split('.').fold(object, |o, seg| &o[seg]);
            let actual = match value {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            };
            if (actual == want) == negate {
                return false;
            }
        }
    }
    true
}

/// Label selector syntax: `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`.
fn label_selector_matches(selector: &str, labels: Option<&Map<String, Value>>) -> bool {
    let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    // Split on commas that are not inside parentheses.
    let mut requirements = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                requirements.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    requirements.push(&selector[start..]);
    requirements
        .into_iter()
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .all(|r| {
            if let Some((k, v)) = r.split_once("!=") {
                get(k.trim()) != Some(v.trim())
            } else if let Some((k, v)) = r.split_once("==").or_else(|| r.split_once('=')) {
                get(k.trim()) == Some(v.trim())
            } else if let Some((k, set)) = r.split_once(" notin ") {
                let set = parse_set(set);
                get(k.trim()).is_none_or(|v| !set.contains(&v))
            } else if let Some((k, set)) = r.split_once(" in ") {
                let set = parse_set(set);
                get(k.trim()).is_some_and(|v| set.contains(&v))
            } else if let Some(k) = r.strip_prefix('!') {
                get(k.trim()).is_none()
            } else {
                get(r).is_some()
            }
        })
}

fn parse_set(set: &str) -> Vec<&str> {
    set.trim()
        .trim_start_matches('(')
        .trim_end_matches(')')
        .split(',')
        .map(str::trim)
        .collect()
}

fn strip_meta_status(object: &Value) -> Value {
    let mut copy = object.clone();
    if let Some(map) = copy.as_object_mut() {
        map.remove("metadata");
        map.remove("status");
    }
    copy
}

fn apply_schema(info: &ResourceInfo, object: &mut Value) -> Result<(), ApiError> {
    let Some(schema) = &info.schema else {
        return Ok(());
    };
    // Like the API server: drop explicit nulls (no field is nullable in our CRDs), default,
    // then validate.
    prune_nulls(object);
    apply_defaults(schema, object);
    let mut errors = Vec::new();
    validate(schema, object, "", &mut errors);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(&format!(
            "{} is invalid: {}",
            info.kind,
            errors.join(", ")
        )))
    }
}

fn prune_nulls(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.retain(|_, v| !v.is_null());
            map.values_mut().for_each(prune_nulls);
        }
        Value::Array(items) => items.iter_mut().for_each(prune_nulls),
        _ => {}
    }
}

/// Structural-schema defaulting: fills `default`s of absent properties of present objects.
pub fn apply_defaults(schema: &Value, value: &mut Value) {
    if let (Some(properties), Some(map)) = (schema["properties"].as_object(), value.as_object_mut())
    {
        for (name, property) in properties {
            if !map.contains_key(name) {
                if let Some(default) = property.get("default") {
                    map.insert(name.clone(), default.clone());
                }
            }
            if let Some(child) = map.get_mut(name) {
                apply_defaults(property, child);
            }
        }
    }
    if let (Some(items), Some(array)) = (schema.get("items"), value.as_array_mut()) {
        array.iter_mut().for_each(|v| apply_defaults(items, v));
    }
}

/// The subset of OpenAPI v3 validation our CRDs use.
pub fn validate(schema: &Value, value: &Value, path: &str, errors: &mut Vec<String>) {
    let at = |p: &str| {
        if p.is_empty() {
            "<root>".to_string()
        } else {
            p.to_string()
        }
    };
    if schema
        .get("x-kubernetes-int-or-string")
        .is_some_and(|v| v == true)
    {
        if !(value.is_i64() || value.is_u64() || value.is_string()) {
            errors.push(format!("{}: must be an integer or a string", at(path)));
        }
        return;
    }
    if let Some(type_) = schema["type"].as_str() {
        let ok = match type_ {
            "object" => value.is_object(),
            "array" => value.is_array(),
            "string" => value.is_string(),
            "integer" => value.is_i64() || value.is_u64(),
            "number" => value.is_number(),
            "boolean" => value.is_boolean(),
            _ => true,
        };
        if !ok {
            errors.push(format!("{}: must be of type {type_}", at(path)));
            return;
        }
    }
    if let (Some(min), Some(n)) = (schema["minimum"].as_f64(), value.as_f64()) {
        if n < min {
            errors.push(format!(
                "{}: should be greater than or equal to {min}",
                at(path)
            ));
        }
    }
    if let (Some(max), Some(n)) = (schema["maximum"].as_f64(), value.as_f64()) {
        if n > max {
            errors.push(format!(
                "{}: should be less than or equal to {max}",
                at(path)
            ));
        }
    }
    if let Some(s) = value.as_str() {
        let len = s.chars().count() as u64;
        if let Some(min) = schema["minLength"].as_u64().filter(|min| len < *min) {
            errors.push(format!("{}: should be at least {min} chars long", at(path)));
        }
        if let Some(max) = schema["maxLength"].as_u64().filter(|max| len > *max) {
            errors.push(format!("{}: may not be more than {max} chars", at(path)));
        }
    }
    if let (Some(pattern), Some(s)) = (schema["pattern"].as_str(), value.as_str()) {
        match regex::Regex::new(pattern) {
            Ok(re) if !re.is_match(s) => {
                errors.push(format!("{}: {s:?} should match '{pattern}'", at(path)))
            }
            _ => {}
        }
    }
    if let Some(allowed) = schema["enum"].as_array() {
        if !allowed.contains(value) {
            errors.push(format!("{}: Unsupported value: {value}", at(path)));
        }
    }
    if let Some(map) = value.as_object() {
        if let Some(required) = schema["required"].as_array() {
            for name in required.iter().filter_map(Value::as_str) {
                if !map.contains_key(name) {
                    errors.push(format!("{path}.{name}: Required value"));
                }
            }
        }
        if let Some(properties) = schema["properties"].as_object() {
            for (name, child) in map {
                if let Some(child_schema) = properties.get(name) {
                    validate(child_schema, child, &format!("{path}.{name}"), errors);
                }
            }
        } else if let Some(additional) =
            schema.get("additionalProperties").filter(|a| a.is_object())
        {
            for (name, child) in map {
                validate(additional, child, &format!("{path}.{name}"), errors);
            }
        }
    }
    if let (Some(items), Some(array)) = (schema.get("items"), value.as_array()) {
        for (i, item) in array.iter().enumerate() {
            validate(items, item, &format!("{path}[{i}]"), errors);
        }
    }
}
