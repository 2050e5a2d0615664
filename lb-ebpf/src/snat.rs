//! The SNAT source port of a new flow: claimed atomically, never a service port of the SNAT address.

use lb_common::{Config, FlowAddr, FlowKey, ServiceKey, SNAT_PORT_TRIES};

use crate::{
    csum,
    family::Family,
    hash::{fmix, rem},
    maps::SERVICES,
    nat::Target,
    packet::L4Pkt,
};

/// Claims a free SNAT source port for a new flow: for each candidate port, `claim(reverse key, csum_port)` must
/// store the reverse entry (with that port checksum delta) only if the key is free — atomically against other
/// CPUs — so a port is never handed out twice. `taken(reverse key)` rules a port out cheaply first (it runs before
/// the service lookup, and most ports a full table rules out never get that far). Ports that are service ports on
/// the SNAT address are skipped, so a reply can never be mistaken for a new client connection. Returns the port in
/// network order.
#[inline(always)]
pub fn alloc_snat_port<F: Family>(
    cfg: &Config,
    t: &Target<F::A>,
    p: &L4Pkt<F>,
    taken: impl Fn(&FlowKey<F::A>) -> bool,
    mut claim: impl FnMut(&FlowKey<F::A>, u32) -> bool,
) -> Option<u16> {
    let proto = p.key.proto;
    let min = cfg.snat_port_min as u32;
    let range = cfg.snat_port_max as u32 - min + 1;
    let start = rem(fmix(t.hash ^ 0x9e37_79b9), range);
    // The reverse entry rewrites node:NodePort → VIP:service port and SNAT port → client port.
    let (svc_port, client_port) = (p.key.dport, p.key.sport);
    // The candidate reverse key lives in scratch slot 2, not on the stack (40 bytes for IPv6, on the deepest path).
    let rkey = F::scratch().get_ptr_mut(2)? as *mut FlowKey<F::A>;
    // SAFETY: this CPU's scratch slot, larger than a key and as aligned; nothing else runs on this CPU meanwhile.
    let rkey = unsafe { &mut *rkey };
    rkey.src = t.node;
    rkey.dst = t.snat;
    rkey.sport = t.node_port;
    rkey.proto = proto;
    rkey._pad = [0; 3];
    let mut i = 0;
    while i < SNAT_PORT_TRIES {
        let port = ((min + rem(start + i, range)) as u16).to_be();
        i += 1;
        rkey.dport = port;
        if taken(rkey) {
            continue;
        }
        let skey = ServiceKey {
            addr: t.snat.to_addr(),
            port_be: port,
            proto,
            family: F::A::FAMILY,
        };
        if SERVICES.get_ptr(skey).is_some() {
            continue;
        }
        let csum_port = csum::add(
            csum::diff16(t.node_port, svc_port),
            csum::diff16(port, client_port),
        );
        if claim(rkey, csum_port) {
            return Some(port);
        }
    }
    None
}
