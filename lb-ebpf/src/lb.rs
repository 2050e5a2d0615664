//! Load balancing: where a new flow of a service goes — source ranges, the Maglev table indexed by the seeded
//! 5-tuple hash, the backend and its next hop.

use aya_ebpf::maps::lpm_trie::Key;
use lb_common::{
    stat, Config, FlowAddr, Service, SourceRangeKey, SOURCE_RANGE_ID_BITS, SVC_F_SOURCE_RANGES,
};

use crate::{
    ctx::Verdict,
    family::Family,
    hash::{flow_hash, rem},
    klog,
    maps::{count, with_service_stats, BACKENDS, INTERFACES, MAGLEV, NEXTHOPS, SOURCE_RANGES},
    nat::Target,
    packet::L4Pkt,
};

/// Source ranges, Maglev, backend and next hop for a new flow of `svc` that came in on interface `ingress`; the
/// verdict after counting why not.
#[inline(always)]
pub fn pick_backend<F: Family>(
    cfg: &Config,
    p: &L4Pkt<F>,
    svc: &Service,
    ingress: u32,
) -> Result<Target<F::A>, Verdict> {
    let key = &p.key;
    if svc.flags & SVC_F_SOURCE_RANGES != 0 {
        let k = Key::new(
            SOURCE_RANGE_ID_BITS + F::ADDR_BITS,
            SourceRangeKey {
                svc_id_be: svc.id.to_be(),
                addr: key.src.to_addr(),
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
        klog::bad_backend(svc.id, slot);
        return Err(Verdict::Drop);
    };
    let Some(backend) = BACKENDS.get(backend_id) else {
        count(stat::DROP_BAD_BACKEND);
        klog::bad_backend(svc.id, slot);
        return Err(Verdict::Drop);
    };
    if backend.family != F::A::FAMILY {
        count(stat::DROP_BAD_BACKEND);
        klog::bad_backend(svc.id, slot);
        return Err(Verdict::Drop);
    }
    let Some(nh) = NEXTHOPS.get_ptr(backend.addr) else {
        // The kernel gets the packet unchanged and resolves the neighbour; the agent notices the counter
        // and refreshes the table. The client retransmits.
        count(stat::PASS_NO_NEXTHOP);
        with_service_stats(svc.id, |s| s.pass_no_nexthop += 1);
        return Err(Verdict::Pass);
    };
    // SAFETY: a map value, valid under RCU for this program run.
    let (nh_egress, nh_ifindex) = unsafe { ((*nh).egress, (*nh).ifindex) };
    // The backend is reached through another interface than the client came in by: the forward entry
    // redirects to the next hop's, the reverse one back to the client's (one-armed: both 0, `XDP_TX`).
    let (egress, reply_egress) = if nh_egress == 0 || nh_ifindex == ingress {
        (0, 0)
    } else {
        // SAFETY: a map value, valid under RCU for this program run.
        let back = INTERFACES
            .get_ptr(ingress)
            .map_or(0, |s| unsafe { *s } as u8);
        (nh_egress, back)
    };
    Ok(Target {
        backend_id,
        node: F::from_addr(&backend.addr),
        node_port: backend.port_be,
        mac: unsafe { (*nh).mac },
        egress,
        reply_egress,
        snat: F::from_addr(&svc.snat_addr),
        hash,
    })
}
