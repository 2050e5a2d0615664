//! Service controller (target cluster → control cluster): one `LoadBalancer` per Service of type
//! LoadBalancer with a matching class; node changes re-run every Service so endpoints follow.
//!
//! A reconcile is `apply` while the Service is ours (type LoadBalancer, our class, not being deleted), else
//! `cleanup`. `apply` computes the complete desired spec (see [`crate::cloud::loadbalancer_spec`]) and applies all
//! differences in one merge patch (yawol applies at most one option change per reconcile); `cleanup` deletes the
//! LoadBalancer, waits until it is gone, clears the ingress and releases the Service.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, ObjectReference, Service};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, Resource, ResourceExt};
use lb_api::constants::{finalizers, lb_annotations};
use lb_api::{naming, LoadBalancer};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::cloud::ip_families;
use crate::cloud::loadbalancer_spec::{
    self, reasons, ClassFilter, InfrastructureDefaults, Warning,
};
use crate::metrics::Metrics;
use crate::runtime::api_errors::{is_conflict, is_not_found};
use crate::runtime::events::{EventPublisher, EventType};
use crate::runtime::finalizer;
use crate::runtime::retry::Retries;

/// Static configuration of the Service controller.
#[derive(Clone, Debug)]
pub struct Config {
    /// Infrastructure defaults (namespace of the LoadBalancers, networks, flavor, image ...).
    pub defaults: InfrastructureDefaults,
    /// Which Service classes are handled.
    pub classes: ClassFilter,
    /// Periodic re-check of every Service even without changes.
    pub resync: Duration,
    /// Poll interval while waiting for a LoadBalancer to be deleted.
    pub deletion_poll: Duration,
    /// Serve the IPv6 part of Services (`--serve-ipv6`). Off, IPv6 is refused or narrowed to IPv4 with an Event
    /// and a condition ([`ip_families::decide`]).
    pub serve_ipv6: bool,
}

/// Shared state of the Service controller.
pub struct Context {
    /// Client of the cluster holding the Services and Nodes.
    pub target: Client,
    /// Client of the cluster holding the LoadBalancers.
    pub control: Client,
    /// Configuration.
    pub config: Config,
    /// Cache of all Nodes (target cluster).
    pub nodes: Store<Node>,
    /// Cache of the LoadBalancers in the controller namespace (control cluster).
    pub loadbalancers: Store<LoadBalancer>,
    /// Event publisher on the target cluster.
    pub events: Arc<EventPublisher>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Failures per Service, for the error policy's backoff.
    pub retries: Retries<ObjectRef<Service>>,
    /// Fingerprint of the last reported warnings per Service, so node flaps do not repeat them.
    pub reported: std::sync::Mutex<HashMap<ObjectRef<Service>, u64>>,
    /// Our own LoadBalancer writes; see [`OwnWrites`].
    pub own_writes: OwnWrites,
    /// Services of another class whose LoadBalancer of ours is being deleted (their class changed away from ours):
    /// released once it is gone, although their class no longer says they are ours. In memory: after a restart in
    /// between, the finalizer stays until the instance of the Service's class releases it.
    pub releasing: std::sync::Mutex<std::collections::HashSet<ObjectRef<Service>>>,
    /// Set when a write showed that the installed LoadBalancer CRD drops `endpoints[].draining` (yawol's own or an
    /// older one of ours): terminating nodes are then left out of the endpoints, as before draining existed,
    /// instead of being written as draining endpoints the API server would turn into ordinary ones.
    pub draining_dropped: std::sync::atomic::AtomicBool,
}

/// The LoadBalancers as returned by our own last write, by name.
///
/// Two uses: the watch event of our own write carries nothing new, so it does not re-trigger
/// the Service (halves the work per change; writes by anybody else still trigger); and a
/// reconcile that runs before the cache has caught up with our last write diffs against that
/// write's result instead of an older cached object (otherwise a field we added a moment ago
/// and must now remove would be missed).
#[derive(Clone, Default)]
pub struct OwnWrites(Arc<std::sync::Mutex<HashMap<String, Arc<LoadBalancer>>>>);

impl OwnWrites {
    /// Records the object our write produced.
    pub fn record(&self, lb: LoadBalancer) -> Arc<LoadBalancer> {
        let lb = Arc::new(lb);
        self.0.lock().unwrap().insert(lb.name_any(), lb.clone());
        lb
    }

    /// Whether this version of the LoadBalancer is the result of our last write.
    pub fn is_own(&self, lb: &LoadBalancer) -> bool {
        let writes = self.0.lock().unwrap();
        writes.get(&lb.name_any()).is_some_and(|ours| {
            ours.resource_version().is_some() && ours.resource_version() == lb.resource_version()
        })
    }

    /// The newer of the cached object and our last write (by resourceVersion; when versions
    /// are not numeric the cache wins, as it would without this optimisation).
    pub fn newest(&self, cached: Arc<LoadBalancer>) -> Arc<LoadBalancer> {
        let version = |lb: &LoadBalancer| lb.resource_version().and_then(|v| v.parse::<u64>().ok());
        match self.0.lock().unwrap().get(&cached.name_any()) {
            Some(ours) if version(ours) > version(&cached) && version(&cached).is_some() => {
                ours.clone()
            }
            _ => cached,
        }
    }

    /// Forgets a LoadBalancer (deleted).
    pub fn forget(&self, name: &str) {
        self.0.lock().unwrap().remove(name);
    }
}

/// Errors of a reconciliation; all are retried with backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API call failed.
    #[error("{action}: {source}")]
    Kube {
        /// What was attempted.
        action: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
}

fn kube_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let action = action.into();
    move |source| Error::Kube { action, source }
}

const CONTROLLER: &str = "service";

impl Context {
    fn lb_api(&self) -> Api<LoadBalancer> {
        Api::namespaced(self.control.clone(), &self.config.defaults.namespace)
    }

    /// After a write that asked for draining endpoints (`asked`): whether the stored object lost them, i.e. the
    /// installed CRD prunes the field. Remembered in [`Self::draining_dropped`] and logged once.
    fn check_draining_stored(&self, asked: bool, written: &LoadBalancer) -> bool {
        if !asked || written.spec.endpoints().iter().any(|e| e.is_draining()) {
            return false;
        }
        if !self.draining_dropped.swap(true, Ordering::Relaxed) {
            warn!(
                "the installed LoadBalancer CRD drops endpoints[].draining (not this controller's CRD?): \
                 terminating nodes are left out of the endpoints instead of draining; install deploy/crds"
            );
        }
        true
    }

    /// Emits the given warnings as events unless exactly this set was already reported. All of a reconcile's
    /// warnings go in one call: the fingerprint is one per Service. `refused`: the Service is not served (counted
    /// as invalid, not as a warning about a served one).
    async fn report_warnings(
        &self,
        service: &Service,
        reference: &ObjectRef<Service>,
        warnings: &[Warning],
        refused: bool,
    ) {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        warnings.hash(&mut hasher);
        let fingerprint = hasher.finish();
        {
            let mut reported = self.reported.lock().unwrap();
            if warnings.is_empty() {
                reported.remove(reference);
                return;
            }
            if reported.insert(reference.clone(), fingerprint) == Some(fingerprint) {
                return;
            }
        }
        for Warning { reason, message } in warnings {
            if refused {
                self.metrics.invalid_services.inc();
            } else {
                self.metrics.annotation_warnings.inc();
            }
            warn!(service = %reference, reason, message, "service problem");
            self.event(service, EventType::Warning, reason, message)
                .await;
        }
    }

    async fn event(&self, service: &Service, type_: EventType, reason: &str, message: &str) {
        let reference: ObjectReference = service.object_ref(&());
        self.events
            .publish_best_effort(&reference, type_, reason, message)
            .await;
    }
}

/// Reconciles one Service.
pub async fn reconcile(service: Arc<Service>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let reference = ObjectRef::from_obj(service.as_ref());
    // Ours while it is a LoadBalancer Service of our class that is not being deleted; otherwise our LoadBalancer goes.
    let wanted = ctx.config.classes.accepts(&service)
        && loadbalancer_spec::is_load_balancer_type(&service)
        && service.meta().deletion_timestamp.is_none();
    let result = if wanted {
        apply(&service, &ctx, &reference).await
    } else {
        cleanup(&service, &ctx).await
    };
    ctx.metrics
        .observe_reconcile(CONTROLLER, result.is_ok(), started.elapsed());
    if result.is_ok() {
        ctx.retries.succeeded(&reference);
    }
    result
}

/// A failed reconcile is retried with the Service's backoff ([`Retries`]).
pub fn error_policy(service: Arc<Service>, error: &Error, ctx: Arc<Context>) -> Action {
    let reference = ObjectRef::from_obj(service.as_ref());
    let (failures, delay) = ctx.retries.failed(&reference);
    warn!(service = %reference, error = %error, failures, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

fn has_finalizer(service: &Service) -> bool {
    finalizer::has(service, finalizers::SERVICE)
}

/// The Services API of `service`'s namespace in the target cluster.
fn service_api(service: &Service, ctx: &Context) -> Api<Service> {
    Api::namespaced(ctx.target.clone(), &service.namespace().unwrap_or_default())
}

/// The Service's LoadBalancer as it should be: finalizer, validation, the desired spec applied in one write.
async fn apply(
    service: &Service,
    ctx: &Context,
    reference: &ObjectRef<Service>,
) -> Result<Action, Error> {
    let namespace = service.namespace().unwrap_or_default();
    let name = service.name_any();
    let lb_name = naming::loadbalancer_name(&namespace, &name);

    if !has_finalizer(service) {
        finalizer::add(&service_api(service, ctx), service, finalizers::SERVICE)
            .await
            .map_err(kube_err(format!(
                "adding the finalizer of service {}",
                service.name_any()
            )))?;
        // The update re-triggers this Service; continue with the fresh object then.
        return Ok(Action::await_change());
    }

    let nodes = ctx.nodes.state();
    let families = ip_families::decide(
        service,
        nodes.iter().map(|n| n.as_ref()),
        ctx.config.serve_ipv6,
    );
    write_condition(service, ctx, &families.verdict).await?;
    let errors = loadbalancer_spec::validate_service(service);
    let endpoints = match families.endpoints {
        Some(endpoints) if errors.is_empty() => endpoints,
        _ => {
            let mut problems = Warning::all(reasons::VALIDATION, errors);
            problems.extend(families.warnings);
            ctx.report_warnings(service, reference, &problems, true)
                .await;
            // Nothing to retry until the Service changes.
            return Ok(Action::await_change());
        }
    };
    let mut desired = loadbalancer_spec::desired_spec(service, endpoints, &ctx.config.defaults);
    desired.spec.ip_families = loadbalancer_spec::ip_families_field(&families.families);
    let mut warnings = desired.warnings;
    warnings.extend(families.warnings);
    if ctx.draining_dropped.load(Ordering::Relaxed) {
        if let Some(eps) = desired.spec.endpoints.as_mut() {
            let before = eps.len();
            eps.retain(|e| !e.is_draining());
            if eps.len() < before {
                warnings.push(Warning {
                    reason: reasons::DRAINING_NOT_STORED,
                    message: "the installed LoadBalancer CRD drops endpoints[].draining: terminating nodes are \
                              left out of the endpoints (their connections end) instead of draining; install \
                              this controller's CRDs (deploy/crds) to drain them"
                        .into(),
                });
            }
        }
    }
    let asked_draining = desired.spec.endpoints().iter().any(|e| e.is_draining());

    let cached = ctx
        .loadbalancers
        .get(&ObjectRef::new(&lb_name).within(&ctx.config.defaults.namespace));
    let existing = match cached {
        Some(lb) => ctx.own_writes.newest(lb),
        None => {
            ctx.report_warnings(service, reference, &warnings, false)
                .await;
            let lb = loadbalancer_spec::new_loadbalancer(
                service,
                desired.spec.clone(),
                &ctx.config.defaults,
            );
            match ctx.lb_api().create(&PostParams::default(), &lb).await {
                Ok(created) => {
                    let dropped = ctx.check_draining_stored(asked_draining, &created);
                    ctx.own_writes.record(created);
                    if dropped {
                        return Ok(Action::requeue(Duration::ZERO));
                    }
                    ctx.metrics.loadbalancer_write("create");
                    info!(service = %reference, loadbalancer = lb_name, "created LoadBalancer");
                    ctx.event(
                        service,
                        EventType::Normal,
                        "creation",
                        "LoadBalancer is in creation",
                    )
                    .await;
                    return Ok(Action::requeue(ctx.config.resync));
                }
                // The cache is behind the API server (e.g. we created it a moment ago): continue
                // with the authoritative object so that no change waits for the next resync.
                Err(e) if is_conflict(&e) => {
                    debug!(loadbalancer = lb_name, "already exists; reading it");
                    match ctx.lb_api().get_opt(&lb_name).await {
                        Ok(Some(lb)) => Arc::new(lb),
                        // Deleted in between: the delete event re-triggers us.
                        Ok(None) => return Ok(Action::requeue(ctx.config.deletion_poll)),
                        Err(e) => {
                            return Err(kube_err(format!("reading LoadBalancer {lb_name}"))(e))
                        }
                    }
                }
                Err(e) => return Err(kube_err(format!("creating LoadBalancer {lb_name}"))(e)),
            }
        }
    };

    if existing.meta().deletion_timestamp.is_some() {
        // A LoadBalancer being deleted (e.g. the Service was briefly of another type) must finish
        // first; it is recreated afterwards.
        return Ok(Action::requeue(ctx.config.deletion_poll));
    }

    let (spec, immutable_warnings) =
        loadbalancer_spec::protect_immutable(desired.spec, &existing.spec, service);
    warnings.extend(Warning::all(reasons::ANNOTATION, immutable_warnings));
    ctx.report_warnings(service, reference, &warnings, false)
        .await;

    let current_spec = serde_json::to_value(&existing.spec).expect("spec serialises");
    let desired_spec = serde_json::to_value(&spec).expect("spec serialises");
    let spec_patch = loadbalancer_spec::merge_patch_diff(&current_spec, &desired_spec);
    let service_ref = naming::service_reference(&namespace, &name);
    let annotation_ok =
        existing.annotations().get(lb_annotations::SERVICE_NAME) == Some(&service_ref);
    if spec_patch.is_none() && annotation_ok {
        return Ok(Action::requeue(ctx.config.resync));
    }
    let mut patch = json!({});
    if !annotation_ok {
        patch["metadata"] = json!({"annotations": {lb_annotations::SERVICE_NAME: service_ref}});
    }
    let fields = spec_patch
        .as_ref()
        .map(loadbalancer_spec::changed_fields)
        .unwrap_or_default();
    if let Some(spec_patch) = spec_patch {
        patch["spec"] = spec_patch;
    }
    let patched = ctx
        .lb_api()
        .patch(&lb_name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(kube_err(format!("patching LoadBalancer {lb_name}")))?;
    let dropped = ctx.check_draining_stored(asked_draining, &patched);
    ctx.own_writes.record(patched);
    if dropped {
        // Written again at once without the draining endpoints (see `Context::draining_dropped`).
        return Ok(Action::requeue(Duration::ZERO));
    }
    ctx.metrics.loadbalancer_write("patch");
    if !fields.is_empty() {
        info!(service = %reference, loadbalancer = lb_name, ?fields, "updated LoadBalancer");
        let message = format!("LoadBalancer {} synced with the service", fields.join(", "));
        ctx.event(service, EventType::Normal, "update", &message)
            .await;
    }
    Ok(Action::requeue(ctx.config.resync))
}

/// Sets the Service's IP-family condition (see [`ip_families::condition_patch`]); no write when it says that already.
async fn write_condition(
    service: &Service,
    ctx: &Context,
    verdict: &ip_families::Verdict,
) -> Result<(), Error> {
    let now =
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
    let Some(patch) = ip_families::condition_patch(service, verdict, now) else {
        return Ok(());
    };
    service_api(service, ctx)
        .patch_status(
            &service.name_any(),
            &PatchParams::default(),
            &Patch::Strategic(&patch),
        )
        .await
        .map_err(kube_err(format!(
            "writing the {} condition of service {}",
            ip_families::CONDITION_TYPE,
            service.name_any()
        )))?;
    Ok(())
}

/// Service deleted, of another type or class: delete the LoadBalancer, wait until it is gone,
/// then clear the ingress and release the Service.
async fn cleanup(service: &Service, ctx: &Context) -> Result<Action, Error> {
    let lb_name = &naming::loadbalancer_name(
        &service.namespace().unwrap_or_default(),
        &service.name_any(),
    );
    // Every instance uses the one finalizer `stackit.cloud/loadbalancer`: it marks a Service ours only when its
    // class is ours too, or when a LoadBalancer of ours served it (its class changed away from ours: `releasing`).
    // Otherwise it belongs to the instance of its class, and releasing it here stripped that instance's finalizer
    // and ingress (found with two instances on one real API server).
    let key = ObjectRef::from_obj(service);
    let ours = has_finalizer(service)
        && (ctx.config.classes.accepts(service) || ctx.releasing.lock().unwrap().contains(&key));
    let cached = ctx
        .loadbalancers
        .get(&ObjectRef::new(lb_name).within(&ctx.config.defaults.namespace));
    if !ours && cached.is_none() {
        // The common case for every other Service in the cluster: nothing to do, no API call.
        return Ok(Action::await_change());
    }
    // Read through (not the cache): this decides whether the Service may go away.
    let lb = ctx
        .lb_api()
        .get_opt(lb_name)
        .await
        .map_err(kube_err(format!("reading LoadBalancer {lb_name}")))?;
    if let Some(lb) = lb {
        let belongs = lb
            .annotations()
            .get(lb_annotations::SERVICE_NAME)
            .map(String::as_str)
            == Some(&naming::service_reference(
                &service.namespace().unwrap_or_default(),
                &service.name_any(),
            ));
        if !ours && !belongs {
            // Not ours (e.g. another controller instance with another class owns it).
            return Ok(Action::await_change());
        }
        if belongs && has_finalizer(service) {
            ctx.releasing.lock().unwrap().insert(key.clone());
        }
        if lb.meta().deletion_timestamp.is_none() {
            match ctx.lb_api().delete(lb_name, &DeleteParams::default()).await {
                Ok(_) => {
                    ctx.metrics.loadbalancer_write("delete");
                    info!(loadbalancer = lb_name, "deleting LoadBalancer");
                }
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(kube_err(format!("deleting LoadBalancer {lb_name}"))(e)),
            }
        }
        return Ok(Action::requeue(ctx.config.deletion_poll));
    }
    if !ours {
        return Ok(Action::await_change());
    }
    let api = service_api(service, ctx);
    let has_ingress = loadbalancer_spec::service_ingress_ip(service).is_some()
        || service
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|l| l.ingress.as_ref())
            .is_some_and(|i| !i.is_empty());
    // Our condition goes with the ingress: whoever serves the Service now says what it serves.
    let mut patch = ip_families::condition_removal(service).unwrap_or_else(|| json!({}));
    if has_ingress {
        patch["status"]["loadBalancer"] = json!({"ingress": null});
    }
    if patch != json!({}) {
        api.patch_status(
            &service.name_any(),
            &PatchParams::default(),
            &Patch::Strategic(&patch),
        )
        .await
        .map_err(kube_err(format!(
            "clearing the status of service {}",
            service.name_any()
        )))?;
    }
    // Already gone (404) counts as released.
    finalizer::remove(&api, service, finalizers::SERVICE)
        .await
        .map_err(kube_err(format!(
            "removing the finalizer of service {}",
            service.name_any()
        )))?;
    info!(service = %key, "released service");
    ctx.releasing.lock().unwrap().remove(&key);
    ctx.reported.lock().unwrap().remove(&key);
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lb(rv: &str) -> LoadBalancer {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "yawol.stackit.cloud/v1beta1",
            "kind": "LoadBalancer",
            "metadata": {"name": "x", "namespace": "ns", "resourceVersion": rv},
            "spec": {"selector": {}, "infrastructure": {"flavor": {}, "image": {}, "authSecretRef": {}}},
        }))
        .unwrap()
    }

    #[test]
    fn own_writes_pick_the_newest_version() {
        let own = OwnWrites::default();
        own.record(lb("10"));
        assert!(own.is_own(&lb("10")));
        assert!(!own.is_own(&lb("11")));
        assert_eq!(
            own.newest(Arc::new(lb("9"))).resource_version().as_deref(),
            Some("10"),
            "cache behind"
        );
        assert_eq!(
            own.newest(Arc::new(lb("12"))).resource_version().as_deref(),
            Some("12"),
            "foreign write"
        );
        own.forget("x");
        assert!(!own.is_own(&lb("10")));
        assert_eq!(
            own.newest(Arc::new(lb("9"))).resource_version().as_deref(),
            Some("9")
        );
    }
}
