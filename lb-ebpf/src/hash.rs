//! The hashes the rules share: a flow's 5-tuple hash (Maglev's input, the same on every replica with one seed),
//! murmur3's finaliser (`lb_common::fmix`, also the SNAT port search's) and a remainder the verifier accepts.

pub use lb_common::fmix;
#[cfg(test)]
use lb_common::FlowKeyV4;
use lb_common::{FlowAddr, FlowKey};

/// `a % b` without the panic path for `b == 0` (which the verifier would reject as a dead end).
#[inline(always)]
pub fn rem(a: u32, b: u32) -> u32 {
    a.checked_rem(b).unwrap_or_default()
}

/// Hash of a flow's 5-tuple, the same on every replica with the same seed.
#[inline(always)]
pub fn flow_hash<A: FlowAddr>(k: &FlowKey<A>, seed: u32) -> u32 {
    let mut h = k.src.mix(seed);
    h = k.dst.mix(h);
    h = fmix(h ^ (((k.sport as u32) << 16) | k.dport as u32));
    fmix(h ^ k.proto as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remainder_by_zero_is_zero_not_a_panic() {
        assert_eq!(rem(7, 0), 0);
        assert_eq!(rem(7, 3), 1);
    }

    #[test]
    fn the_hash_is_murmur3s_finaliser_seeded_over_the_tuple() {
        // Reference values of murmur3's fmix32.
        assert_eq!(fmix(0), 0);
        assert_eq!(fmix(1), 0x514e_28b7);
        let k = FlowKeyV4 {
            src: 1,
            dst: 2,
            sport: 3,
            dport: 4,
            proto: 6,
            _pad: [0; 3],
        };
        // Replicas with one seed agree; another seed spreads differently.
        assert_eq!(flow_hash(&k, 9), flow_hash(&k, 9));
        assert_ne!(flow_hash(&k, 9), flow_hash(&k, 10));
        let other = FlowKeyV4 { sport: 5, ..k };
        assert_ne!(flow_hash(&k, 9), flow_hash(&other, 9));
    }
}
