//! Names derived from Services, identical to yawol's so that objects created by yawol are adopted.

use data_encoding::BASE32;
use sha2::{Digest, Sha256};

/// Name of the LoadBalancer for a Service: `<svc-namespace>--<svc-name>`.
pub fn loadbalancer_name(service_namespace: &str, service_name: &str) -> String {
    format!("{service_namespace}--{service_name}")
}

/// Value of the `yawol.stackit.cloud/loadbalancer` selector label:
/// the first 16 characters of lower-case base32(sha256("<lb-namespace>.<svc-namespace>--<svc-name>")).
pub fn loadbalancer_selector_value(
    lb_namespace: &str,
    service_namespace: &str,
    service_name: &str,
) -> String {
    let digest = Sha256::digest(format!(
        "{lb_namespace}.{}",
        loadbalancer_name(service_namespace, service_name)
    ));
    let mut encoded = BASE32.encode(&digest).to_ascii_lowercase();
    encoded.truncate(16);
    encoded
}

/// Value of the `yawol.stackit.cloud/serviceName` annotation: `<svc-namespace>/<svc-name>`.
pub fn service_reference(service_namespace: &str, service_name: &str) -> String {
    format!("{service_namespace}/{service_name}")
}

/// Parses a `<namespace>/<name>` reference (e.g. the serviceName annotation).
pub fn parse_namespaced_name(reference: &str) -> Option<(&str, &str)> {
    let (namespace, name) = reference.split_once('/')?;
    (!namespace.is_empty() && !name.is_empty() && !name.contains('/')).then_some((namespace, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(loadbalancer_name("default", "web"), "default--web");
        assert_eq!(service_reference("default", "web"), "default/web");
        assert_eq!(
            parse_namespaced_name("default/web"),
            Some(("default", "web"))
        );
        assert_eq!(parse_namespaced_name("web"), None);
        assert_eq!(parse_namespaced_name("/web"), None);
        assert_eq!(parse_namespaced_name("a/b/c"), None);
    }

    #[test]
    fn selector_value_is_16_lowercase_base32_chars() {
        let value = loadbalancer_selector_value("kube-system", "default", "web");
        assert_eq!(value.len(), 16);
        assert!(value
            .chars()
            .all(|c| c.is_ascii_lowercase() || ('2'..='7').contains(&c)));
        // Stable across releases: the value is part of existing objects' selectors.
        assert_eq!(
            value,
            loadbalancer_selector_value("kube-system", "default", "web")
        );
        assert_ne!(
            value,
            loadbalancer_selector_value("other", "default", "web")
        );
    }
}
