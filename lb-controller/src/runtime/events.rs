//! Publishing core/v1 Events (on Services, LoadBalancers, sets and machines), with client-go style aggregation:
//! repeating the same (object, type, reason, message) bumps `count`/`lastTimestamp` of the existing Event instead of
//! creating a new one. (kube-runtime's `Recorder` aggregates by reason only and would drop differing messages, which
//! matters for forwarded OpenStack errors.)

use std::collections::HashMap;

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::Mutex;
use tracing::warn;

use crate::runtime::api_errors::is_not_found;

/// Event type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventType {
    /// Informational.
    Normal,
    /// Something the user should look at.
    Warning,
}

impl EventType {
    /// The API string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "Normal",
            Self::Warning => "Warning",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    uid: String,
    type_: EventType,
    reason: String,
    message: String,
}

/// Publishes Events as one component.
pub struct EventPublisher {
    client: Client,
    component: String,
    instance: String,
    sent: Mutex<HashMap<Key, (String, i32)>>,
}

impl EventPublisher {
    /// A publisher writing with `client` as `component` (`source.component`, `reportingComponent`).
    pub fn new(client: Client, component: &str, instance: &str) -> Self {
        Self {
            client,
            component: component.to_string(),
            instance: instance.to_string(),
            sent: Mutex::new(HashMap::new()),
        }
    }

    /// Publishes an event about `object`; a failure is logged, not returned. What the controllers report: events are
    /// best effort, the change they tell of has already happened (or its error is returned on its own way).
    pub async fn publish_best_effort(
        &self,
        object: &ObjectReference,
        type_: EventType,
        reason: &str,
        message: &str,
    ) {
        if let Err(e) = self.publish(object, type_, reason, message).await {
            warn!(
                error = %e,
                reason,
                namespace = object.namespace.as_deref().unwrap_or_default(),
                name = object.name.as_deref().unwrap_or_default(),
                "could not publish event"
            );
        }
    }

    /// Publishes an event about `object`, returning a failure (for a caller that counts what it published; most
    /// want [`Self::publish_best_effort`]).
    pub async fn publish(
        &self,
        object: &ObjectReference,
        type_: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), kube::Error> {
        let namespace = object.namespace.clone().unwrap_or_else(|| "default".into());
        let api: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let key = Key {
            uid: object.uid.clone().unwrap_or_default(),
            type_,
            reason: reason.to_string(),
            message: message.to_string(),
        };
        let mut sent = self.sent.lock().await;
        if let Some((name, count)) = sent.get(&key).cloned() {
            let patch = json!({"count": count + 1, "lastTimestamp": now});
            match api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    sent.insert(key, (name, count + 1));
                    return Ok(());
                }
                // The event expired or was deleted: create a new one below.
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(e),
            }
        }
        let name = format!(
            "{}.{:x}",
            object.name.as_deref().unwrap_or("object"),
            k8s_openapi::jiff::Timestamp::now().as_nanosecond()
        );
        let event = Event {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(namespace),
                ..Default::default()
            },
            involved_object: object.clone(),
            type_: Some(type_.as_str().to_string()),
            reason: Some(reason.to_string()),
            message: Some(message.to_string()),
            count: Some(1),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            source: Some(EventSource {
                component: Some(self.component.clone()),
                host: None,
            }),
            reporting_component: Some(self.component.clone()),
            reporting_instance: Some(self.instance.clone()),
            ..Default::default()
        };
        api.create(&PostParams::default(), &event).await?;
        if sent.len() > 10_000 {
            // Bound memory; losing aggregation for old keys only means a new Event object.
            sent.clear();
        }
        sent.insert(key, (name, 1));
        Ok(())
    }
}
