//! High-availability settings of one LoadBalancer's machines, chosen by the controller when it writes their
//! cloud-init: the VRRP virtual router id, base priority and advert interval (the agent runs keepalived with
//! them, see `lb_agent::ha::vrrp`), and the port and shared secret of the connection-state sync between replicas.
//! How they reach the agent (its flags, the secret's file) is the controller's cloud-init's business, not this
//! crate's.
//!
//! Unlike yawol, which gives every LoadBalancer virtual router id 100 and relies on security groups to keep
//! them apart, each LoadBalancer gets its own id on its network ([`router_id_for`]).

use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

/// Default VRRP advert interval (VRRPv3 centiseconds; master-down ≈ 0.7 s).
pub const DEFAULT_ADVERT_INTERVAL: Duration = Duration::from_millis(200);
/// Default base priority; the agent adds a bonus for the newest revision and drops to FAULT when unhealthy.
pub const DEFAULT_BASE_PRIORITY: u8 = 100;
/// Default TCP port of the connection-state sync between replicas (the security group must allow it between
/// the machines, like VRRP, IP protocol 112).
pub const DEFAULT_SYNC_PORT: u16 = crate::constants::sync::PORT;
/// Length of [`new_sync_secret`]: 32 random bytes, hex-encoded.
pub const SYNC_SECRET_LEN: usize = 64;

/// HA settings of one LoadBalancer, the same for all its machines.
#[derive(Clone, PartialEq, Eq)]
pub struct HaSettings {
    /// VRRP virtual router id, 1..=255, distinct from the other LoadBalancers on the network.
    pub router_id: u8,
    /// VRRP base priority, 1..=254.
    pub base_priority: u8,
    /// VRRP advert interval: a multiple of 10 ms in 10 ms..=40.95 s.
    pub advert_interval: Duration,
    /// TCP port of the connection-state sync.
    pub sync_port: u16,
    /// Shared secret of the sync (generated per LoadBalancer, [`new_sync_secret`]); handed to the agent in a file,
    /// never on a command line, and redacted in `Debug`.
    pub sync_secret: String,
}

impl fmt::Debug for HaSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HaSettings")
            .field("router_id", &self.router_id)
            .field("base_priority", &self.base_priority)
            .field("advert_interval", &self.advert_interval)
            .field("sync_port", &self.sync_port)
            .field("sync_secret", &"<redacted>")
            .finish()
    }
}

/// Why [`HaSettings`] cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HaError {
    /// Every router id 1..=255 is taken on the network.
    #[error("no free VRRP router id on the network (all 255 taken)")]
    NoRouterId,
    /// Router id 0.
    #[error("VRRP router id 0 is invalid (1..=255)")]
    RouterIdZero,
    /// Priority 0 or 255.
    #[error("VRRP base priority {0} is invalid (1..=254)")]
    Priority(u8),
    /// Not expressible in VRRPv3 centiseconds.
    #[error("VRRP advert interval {0:?} is invalid: a multiple of 10 ms in 10 ms..=40.95 s")]
    AdvertInterval(Duration),
    /// Port 0.
    #[error("sync port 0 is invalid")]
    SyncPort,
    /// Too short, or with characters that do not survive a file written by cloud-init.
    #[error("sync secret must be at least 32 printable ASCII characters without blanks")]
    SyncSecret,
    /// The system's random source failed.
    #[error("no randomness for the sync secret: {0}")]
    Random(String),
}

impl HaSettings {
    /// Settings with the defaults, a router id for `namespace/name` that is not in `taken`, and a fresh secret.
    pub fn new(namespace: &str, name: &str, taken: &BTreeSet<u8>) -> Result<Self, HaError> {
        Ok(HaSettings {
            router_id: router_id_for(namespace, name, taken).ok_or(HaError::NoRouterId)?,
            base_priority: DEFAULT_BASE_PRIORITY,
            advert_interval: DEFAULT_ADVERT_INTERVAL,
            sync_port: DEFAULT_SYNC_PORT,
            sync_secret: try_new_sync_secret()?,
        })
    }

    /// Checks the ranges the agent (and keepalived) accept.
    pub fn validate(&self) -> Result<(), HaError> {
        if self.router_id == 0 {
            return Err(HaError::RouterIdZero);
        }
        if self.base_priority == 0 || self.base_priority == 255 {
            return Err(HaError::Priority(self.base_priority));
        }
        let ms = self.advert_interval.as_millis();
        if !self
            .advert_interval
            .subsec_nanos()
            .is_multiple_of(10_000_000)
            || !(10..=40_950).contains(&ms)
        {
            return Err(HaError::AdvertInterval(self.advert_interval));
        }
        if self.sync_port == 0 {
            return Err(HaError::SyncPort);
        }
        if self.sync_secret.len() < 32 || !self.sync_secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(HaError::SyncSecret);
        }
        Ok(())
    }
}

/// A VRRP virtual router id for the LoadBalancer `namespace/name` that is not in `taken` (the ids of the other
/// LoadBalancers on the same network). Stable: the preferred id is derived from a hash of the name, and the
/// next free one (wrapping within 1..=255) is used when it is taken. `None` when all 255 are taken.
///
/// Once chosen, the id must be kept (stored with the LoadBalancer): recomputing it later with a different
/// `taken` set could give another id and split the machines of one LoadBalancer.
pub fn router_id_for(namespace: &str, name: &str, taken: &BTreeSet<u8>) -> Option<u8> {
    let digest = Sha256::digest(format!("{namespace}/{name}"));
    let preferred = u16::from_be_bytes([digest[0], digest[1]]) % 255; // 0..=254
    (0..255u16)
        .map(|step| ((preferred + step) % 255 + 1) as u8) // 1..=255
        .find(|id| !taken.contains(id))
}

/// A new sync secret: 32 random bytes from the operating system, hex-encoded (64 characters).
///
/// # Panics
///
/// If the operating system's random source fails (see [`HaSettings::new`] for the fallible form).
pub fn new_sync_secret() -> String {
    try_new_sync_secret().expect("operating-system randomness")
}

fn try_new_sync_secret() -> Result<String, HaError> {
    let mut bytes = [0u8; SYNC_SECRET_LEN / 2];
    getrandom::fill(&mut bytes).map_err(|e| HaError::Random(e.to_string()))?;
    Ok(data_encoding::HEXLOWER.encode(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_id_is_stable_and_in_range() {
        let none = BTreeSet::new();
        let a = router_id_for("ns", "lb-a", &none).unwrap();
        assert_eq!(router_id_for("ns", "lb-a", &none), Some(a));
        assert_ne!(a, 0);
        // Different LoadBalancers spread over the range.
        let ids: BTreeSet<u8> = (0..100)
            .map(|i| router_id_for("ns", &format!("lb-{i}"), &none).unwrap())
            .collect();
        assert!(
            ids.len() > 70,
            "only {} distinct ids for 100 names",
            ids.len()
        );
        assert!(!ids.contains(&0));
    }

    #[test]
    fn router_id_avoids_taken_ids() {
        let preferred = router_id_for("ns", "lb", &BTreeSet::new()).unwrap();
        let taken = BTreeSet::from([preferred]);
        let next = router_id_for("ns", "lb", &taken).unwrap();
        assert_ne!(next, preferred);
        assert_eq!(next, if preferred == 255 { 1 } else { preferred + 1 });

        // Assigning ids one after another on one network never collides, until all 255 are used.
        let mut taken = BTreeSet::new();
        for i in 0..255 {
            let id = router_id_for("ns", &format!("lb-{i}"), &taken).unwrap();
            assert!(taken.insert(id), "id {id} handed out twice");
        }
        assert_eq!(taken.len(), 255);
        assert!(!taken.contains(&0));
        assert_eq!(router_id_for("ns", "one-more", &taken), None);
    }

    #[test]
    fn sync_secrets_are_long_random_and_printable() {
        let a = new_sync_secret();
        let b = new_sync_secret();
        assert_eq!(a.len(), SYNC_SECRET_LEN);
        assert!(a.len() >= 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn secrets_are_redacted_in_debug_output() {
        let s = HaSettings::new("ns", "lb", &BTreeSet::new()).unwrap();
        assert!(!format!("{s:?}").contains(&s.sync_secret));
    }

    #[test]
    fn new_and_validate() {
        let s = HaSettings::new("ns", "lb", &BTreeSet::new()).unwrap();
        s.validate().unwrap();
        assert_eq!(s.advert_interval, DEFAULT_ADVERT_INTERVAL);
        let bad = |f: &dyn Fn(&mut HaSettings)| {
            let mut s = s.clone();
            f(&mut s);
            s.validate().unwrap_err()
        };
        assert_eq!(bad(&|s| s.router_id = 0), HaError::RouterIdZero);
        assert_eq!(bad(&|s| s.base_priority = 255), HaError::Priority(255));
        assert_eq!(
            bad(&|s| s.advert_interval = Duration::from_millis(205)),
            HaError::AdvertInterval(Duration::from_millis(205))
        );
        assert_eq!(bad(&|s| s.sync_port = 0), HaError::SyncPort);
        assert_eq!(
            bad(&|s| s.sync_secret = "short".into()),
            HaError::SyncSecret
        );
        assert_eq!(
            bad(&|s| s.sync_secret = format!("{} x", "a".repeat(40))),
            HaError::SyncSecret
        );
        let all: BTreeSet<u8> = (1..=255).collect();
        assert_eq!(
            HaSettings::new("ns", "lb", &all).unwrap_err(),
            HaError::NoRouterId
        );
    }
}
