//! One error policy for every controller: the consecutive failures of each object, and a retry delay that
//! doubles per failure from a base up to a cap; the object's first success starts it over. kube-runtime hands
//! `error_policy` one failure at a time and keeps no count, hence the map.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;

/// The controllers' first retry after a failure (the machine controller's is a setting).
pub const BASE: Duration = Duration::from_secs(1);
/// The longest wait between retries: long failures (a quota, a missing Secret) cost at most one attempt per 5
/// minutes per object.
pub const MAX: Duration = Duration::from_secs(300);
/// The cap of the LoadBalancer, set and back-channel controllers: they stand between a cloud or API outage and
/// every LoadBalancer's recovery, so an object waits at most a minute after its cause is gone.
pub const OUTAGE_MAX: Duration = Duration::from_secs(60);

/// Failures per object (`K`: whatever names it, e.g. an `ObjectRef`) and the backoff they earn.
pub struct Retries<K> {
    base: Duration,
    max: Duration,
    failures: Mutex<HashMap<K, u32>>,
}

impl<K: Eq + Hash + Clone> Retries<K> {
    /// First retry after `base`, doubled per further failure, never longer than `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Retries {
            base,
            max,
            failures: Mutex::default(),
        }
    }

    /// Records a failure of `key`: returns how many in a row, and how long to wait before the next attempt.
    pub fn failed(&self, key: &K) -> (u32, Duration) {
        let mut failures = self.failures.lock().unwrap();
        let n = failures.entry(key.clone()).or_default();
        *n = n.saturating_add(1);
        (*n, backoff(*n, self.base, self.max))
    }

    /// `key` reconciled (or is gone): its next failure is a first one again.
    pub fn succeeded(&self, key: &K) {
        self.failures.lock().unwrap().remove(key);
    }
}

/// [`BASE`] doubled up to [`MAX`].
impl<K: Eq + Hash + Clone> Default for Retries<K> {
    fn default() -> Self {
        Retries::new(BASE, MAX)
    }
}

/// Delay before retry number `failures` (1 = first failure): `base` doubled per failure, at most `max`.
pub fn backoff(failures: u32, base: Duration, max: Duration) -> Duration {
    let factor = 2u32.saturating_pow(failures.saturating_sub(1).min(30));
    base.saturating_mul(factor).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let (b, m) = (Duration::from_secs(1), Duration::from_secs(300));
        let delays: Vec<u64> = (1..=12).map(|n| backoff(n, b, m).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]);
        assert_eq!(backoff(u32::MAX, b, m), m);
    }

    #[test]
    fn a_success_starts_the_count_over() {
        let r = Retries::new(Duration::from_secs(2), Duration::from_secs(60));
        assert_eq!(r.failed(&"a"), (1, Duration::from_secs(2)));
        assert_eq!(r.failed(&"a"), (2, Duration::from_secs(4)));
        assert_eq!(r.failed(&"b"), (1, Duration::from_secs(2)), "per object");
        r.succeeded(&"a");
        assert_eq!(r.failed(&"a"), (1, Duration::from_secs(2)));
    }
}
