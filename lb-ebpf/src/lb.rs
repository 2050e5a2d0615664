//! Load balancing: where a new flow of a service goes — source ranges, the Maglev table indexed by the seeded
//! 5-tuple hash, the backend and its next hop.

use aya_ebpf::maps::lpm_trie::Key;
pub use lb_common::fmix;
use lb_common::{
    stat, Addr, Config, FlowKeyV4, Service, SourceRangeKey, FAMILY_V4, SOURCE_RANGE_ID_BITS,
    SVC_F_SOURCE_RANGES,
};

use crate::{
    maps::{count, with_service_stats, BACKENDS, MAGLEV, NEXTHOPS, SOURCE_RANGES},
    nat::Target,
    packet::L4Pkt,
    process::Verdict,
};

/// Source ranges, Maglev, backend and next hop for a new flow of `svc`; the verdict after counting why not.
#[inline(always)]
pub fn pick_backend(cfg: &Config, p: &L4Pkt, svc: &Service) -> Result<Target, Verdict> {
    let key = &p.key;
    if svc.flags & SVC_F_SOURCE_RANGES != 0 {
        let k = Key::new(
            SOURCE_RANGE_ID_BITS + 32,
            SourceRangeKey {
                svc_id_be: svc.id.to_be(),
                addr: Addr::from_v4_raw(key.src),
            },
        );
        if SOURCE_RANGES.get(&k).is_none() {
            count(stat::DROP_SOURCE_RANGE);
            with_service_stats(svc.id, |s| s.drop_source_range += 1);
            return Err(Verdict::Drop);
        }
    }
    if svc.table_size == 0 {
        count(stat::DROP_NO_BACKEND);
        with_service_stats(svc.id, |s| s.drop_no_backend += 1);
        return Err(Verdict::Drop);
    }
    let hash = flow_hash(key, cfg.hash_seed);
    let slot = svc.table_offset + rem(hash, svc.table_size);
    let Some(&backend_id) = MAGLEV.get(slot) else {
        count(stat::DROP_BAD_BACKEND);
        return Err(Verdict::Drop);
    };
    let Some(backend) = BACKENDS.get(backend_id) else {
        count(stat::DROP_BAD_BACKEND);
        return Err(Verdict::Drop);
    };
    if backend.family != FAMILY_V4 {
        count(stat::DROP_BAD_BACKEND);
        return Err(Verdict::Drop);
    }
    let Some(nh) = NEXTHOPS.get_ptr(backend.addr) else {
        // The kernel gets the packet unchanged and resolves the neighbour; the agent notices the counter
        // and refreshes the table. The client retransmits.
        count(stat::PASS_NO_NEXTHOP);
        with_service_stats(svc.id, |s| s.pass_no_nexthop += 1);
        return Err(Verdict::Pass);
    };
    Ok(Target {
        backend_id,
        node: backend.addr.v4_raw(),
        node_port: backend.port_be,
        mac: unsafe { (*nh).mac },
        snat: svc.snat_addr.v4_raw(),
        hash,
    })
}

/// `a % b` without the panic path for `b == 0` (which the verifier would reject as a dead end).
#[inline(always)]
pub fn rem(a: u32, b: u32) -> u32 {
    a.checked_rem(b).unwrap_or_default()
}

/// Hash of a flow's 5-tuple, the same on every replica with the same seed.
#[inline(always)]
pub fn flow_hash(k: &FlowKeyV4, seed: u32) -> u32 {
    let mut h = fmix(seed ^ k.src);
    h = fmix(h ^ k.dst);
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
