//! Full NAT: the two entries of a new flow (forward: client → SNAT, VIP → node; reverse: node → VIP, SNAT → client)
//! and the rewrite of a packet by its entry — MACs, addresses, ports, and the checksums updated incrementally.

use lb_common::{
    stat, Flow, FlowAddr, Service, FLOW_F_FORWARD, FLOW_F_REVERSE, PROTO_UDP, SVC_F_PROXY_V2,
};

use crate::{
    csum,
    ctx::{Ctx, Verdict},
    family::Family,
    hdr::EthHdr,
    maps::{count, with_service_stats, EGRESS},
    packet::L4Pkt,
};

/// Counts a packet of a flow (established or transient) in its direction and rewrites it.
#[inline(always)]
pub fn forward<C: Ctx, F: Family>(c: &C, p: &L4Pkt<F>, fl: &Flow<F::A>) -> Verdict {
    count_packet(p, fl);
    rewrite(c, p, fl)
}

/// Counts a packet of a flow in its direction (the service's rx/tx counters).
#[inline(always)]
pub fn count_packet<F: Family>(p: &L4Pkt<F>, fl: &Flow<F::A>) {
    let fwd_dir = fl.flags & FLOW_F_FORWARD != 0;
    with_service_stats(fl.svc_id, |s| {
        if fwd_dir {
            s.rx_packets += 1;
            s.rx_bytes += p.tot as u64;
        } else {
            s.tx_packets += 1;
            s.tx_bytes += p.tot as u64;
        }
    });
}

/// The backend a new flow goes to, and how to reach it.
pub struct Target<A> {
    pub backend_id: u32,
    pub node: A,
    pub node_port: u16,
    pub mac: [u8; 6],
    /// `EGRESS` slot of the forward entry (towards the backend) and of the reverse one (towards the client).
    pub egress: u8,
    pub reply_egress: u8,
    pub snat: A,
    /// The flow's hash (also seeds the SNAT port search).
    pub hash: u32,
}

impl<A: FlowAddr> Target<A> {
    /// Writes the reverse entry (backend → SNAT) of a new flow into `fl`; its port fields are completed by the SNAT
    /// search. Field by field into the caller's (scratch) entry: an IPv6 entry built by value is a 72-byte
    /// temporary on the BPF stack. IPv6 writes it in a call frame of its own ([`fill_reverse_frame`]): inlined,
    /// the target's and key's address words loaded for it stayed live (spilled) across the SNAT search.
    #[inline(always)]
    pub fn fill_reverse<F: Family<A = A>>(
        &self,
        p: &L4Pkt<F>,
        svc: &Service,
        now: u64,
        fl: &mut Flow<A>,
    ) {
        if F::NEW_FLOW_PROGRAM {
            fl.csum_addr = fill_reverse_frame(self, p, svc, now, fl);
        } else {
            self.write_reverse(p, svc, now, fl)
        }
    }

    #[inline(always)]
    fn write_reverse<F: Family<A = A>>(
        &self,
        p: &L4Pkt<F>,
        svc: &Service,
        now: u64,
        fl: &mut Flow<A>,
    ) {
        let key = &p.key;
        fl.new_src = key.dst;
        fl.new_dst = key.src;
        fl.new_sport = key.dport;
        fl.new_dport = key.sport;
        fl.mac = unsafe { (*p.eth).src };
        fl.flags = FLOW_F_REVERSE;
        fl.egress = self.reply_egress;
        fl.svc_id = svc.id;
        fl.backend_id = self.backend_id;
        fl.timeout_s = svc.idle_timeout_s;
        fl.csum_addr = csum::add(F::diff(&self.node, &key.dst), F::diff(&self.snat, &key.src));
        fl.csum_port = 0;
        set_proxy(p, svc, fl);
        fl.last_seen_ns = now;
    }

    /// Writes the forward entry (client → backend) of a new flow with SNAT port `snat_port` into `fl` (in place,
    /// and for IPv6 in a frame of its own, as [`Self::fill_reverse`]).
    #[inline(always)]
    pub fn fill_forward<F: Family<A = A>>(
        &self,
        p: &L4Pkt<F>,
        svc: &Service,
        snat_port: u16,
        now: u64,
        fl: &mut Flow<A>,
    ) {
        if F::NEW_FLOW_PROGRAM {
            fl.csum_addr = fill_forward_frame(self, p, svc, snat_port, fl);
        } else {
            self.write_forward(p, svc, snat_port, fl)
        }
        fl.last_seen_ns = now;
    }

    #[inline(always)]
    fn write_forward<F: Family<A = A>>(
        &self,
        p: &L4Pkt<F>,
        svc: &Service,
        snat_port: u16,
        fl: &mut Flow<A>,
    ) {
        let key = &p.key;
        fl.new_src = self.snat;
        fl.new_dst = self.node;
        fl.new_dport = self.node_port;
        fl.mac = self.mac;
        fl.flags = FLOW_F_FORWARD;
        fl.egress = self.egress;
        fl.svc_id = svc.id;
        fl.backend_id = self.backend_id;
        fl.timeout_s = svc.idle_timeout_s;
        fl.csum_addr = csum::add(F::diff(&key.src, &self.snat), F::diff(&key.dst, &self.node));
        set_proxy(p, svc, fl);
        self.set_snat_port(p, fl, snat_port);
    }

    /// Gives a forward entry its SNAT port, and the port checksum delta that goes with it.
    #[inline(always)]
    pub fn set_snat_port<F: Family<A = A>>(&self, p: &L4Pkt<F>, fl: &mut Flow<A>, snat_port: u16) {
        fl.new_sport = snat_port;
        fl.csum_port = csum::add(
            csum::diff16(p.key.sport, snat_port),
            csum::diff16(p.key.dport, self.node_port),
        );
    }
}

/// A new entry's PROXY v2 fields: the header's length and where it goes (after the client's SYN) for a TCP
/// connection of a PROXY service, none otherwise (scratch entries are reused: every field is written).
#[inline(always)]
fn set_proxy<F: Family>(p: &L4Pkt<F>, svc: &Service, fl: &mut Flow<F::A>) {
    let proxied = svc.flags & SVC_F_PROXY_V2 != 0 && p.is_tcp();
    fl.proxy_len = if proxied { F::PROXY_LEN } else { 0 };
    fl.proxy_seq_be = if proxied {
        u32::from_be(p.seq_be()).wrapping_add(1).to_be()
    } else {
        0
    };
    fl._pad = 0;
}

/// [`Target::fill_reverse`] in a call frame of its own. Returns the entry's address checksum delta, which the caller
/// stores: a BPF function without a result (or with one nobody reads, which LLVM drops) returns whatever r0 held,
/// and the verifier refuses one that returns a pointer to its caller's stack.
#[inline(never)]
fn fill_reverse_frame<F: Family>(
    t: &Target<F::A>,
    p: &L4Pkt<F>,
    svc: &Service,
    now: u64,
    fl: &mut Flow<F::A>,
) -> u32 {
    t.write_reverse(p, svc, now, fl);
    fl.csum_addr
}

/// [`Target::fill_forward`] in a call frame of its own, all but the time (a BPF call takes 5 arguments at most).
/// Returns the entry's address checksum delta, as [`fill_reverse_frame`].
#[inline(never)]
fn fill_forward_frame<F: Family>(
    t: &Target<F::A>,
    p: &L4Pkt<F>,
    svc: &Service,
    snat_port: u16,
    fl: &mut Flow<F::A>,
) -> u32 {
    t.write_forward(p, svc, snat_port, fl);
    fl.csum_addr
}

/// Applies a flow's rewrite to the packet: MACs, addresses, ports, checksums; sends it by the entry's egress.
#[inline(always)]
pub fn rewrite<C: Ctx, F: Family>(c: &C, p: &L4Pkt<F>, fl: &Flow<F::A>) -> Verdict {
    match rewrite_headers(c, p, fl) {
        Ok(out) => send(c, fl.egress, &out),
        Err(v) => v,
    }
}

/// [`rewrite`] without the send: the frame's way out, or the verdict when it has none.
#[inline(always)]
pub fn rewrite_headers<C: Ctx, F: Family>(
    c: &C,
    p: &L4Pkt<F>,
    fl: &Flow<F::A>,
) -> Result<Out, Verdict> {
    let Ok(out) = egress(fl.egress) else {
        return Err(Verdict::Pass);
    };
    unsafe {
        set_macs(p.eth, &fl.mac, &out);
        F::set_addrs(p.ip, &fl.new_src, &fl.new_dst, fl.csum_addr);
        (*p.ports).sport = fl.new_sport;
        (*p.ports).dport = fl.new_dport;
    }
    // Bounds-checked again here: LLVM may merge this tail of the TCP and UDP paths, and the verifier then knows
    // only the shorter UDP header to be in the packet. (The parser checked it: never taken.)
    let (csum_p, csum_off) = p.csum();
    if csum_p as usize + 2 > c.data_end() {
        count(stat::DROP_MALFORMED);
        return Err(Verdict::Drop);
    }
    c.l4_csum(
        csum_off,
        csum_p,
        fl.csum_addr,
        fl.csum_port,
        p.key.proto == PROTO_UDP,
    );
    Ok(out)
}

/// A frame's way out, copied out of `EGRESS`: `ifindex` 0 is the interface it came in on. Values, not a pointer
/// into the map: kernel 6.1's verifier lost a nullable pointer's null check over the checksum code and the TC
/// helper calls between it and its use, and refused the TC programs.
#[derive(Clone, Copy)]
pub struct Out {
    pub ifindex: u32,
    pub mac: [u8; 6],
}

/// An egress slot the agent has not filled (counted as a missing next hop: the kernel gets the frame unchanged,
/// the agent refreshes).
pub struct NoEgress;

/// The way out of an entry with egress slot `slot`: 0 is the interface the frame came in on.
#[inline(always)]
pub fn egress(slot: u8) -> Result<Out, NoEgress> {
    if slot == 0 {
        return Ok(Out {
            ifindex: 0,
            mac: [0; 6],
        });
    }
    match EGRESS.get_ptr(slot as u32) {
        // SAFETY: a value of the map, valid under RCU for this program run.
        Some(e) if unsafe { (*e).ifindex } != 0 => Ok(unsafe {
            Out {
                ifindex: (*e).ifindex,
                mac: (*e).mac,
            }
        }),
        _ => {
            count(stat::PASS_NO_NEXTHOP);
            Err(NoEgress)
        }
    }
}

/// The frame's MACs for its way out: to `dst`, from the egress interface's MAC, or (back out of the interface it
/// came in on) from the MAC it was sent to.
///
/// # Safety
/// `eth` points to the frame's bounds-checked Ethernet header.
#[inline(always)]
pub unsafe fn set_macs(eth: *mut EthHdr, dst: &[u8; 6], out: &Out) {
    // SAFETY: as the function's.
    unsafe {
        let src = if out.ifindex == 0 {
            mac_words(&(*eth).dst)
        } else {
            mac_words(&out.mac)
        };
        set_mac(&mut (*eth).src, src);
        set_mac(&mut (*eth).dst, mac_words(dst));
    }
}

/// A MAC address as two words. MACs are copied this way, not as 6-byte arrays: chosen between two sources, such a
/// copy became a call to `memmove` (a frame kernel 6.1 counts) wherever the rewrite is not inlined.
#[inline(always)]
fn mac_words(m: &[u8; 6]) -> (u32, u16) {
    // SAFETY: 6 readable bytes.
    unsafe {
        (
            core::ptr::read_unaligned(m.as_ptr() as *const u32),
            core::ptr::read_unaligned(m.as_ptr().add(4) as *const u16),
        )
    }
}

#[inline(always)]
fn set_mac(to: &mut [u8; 6], (a, b): (u32, u16)) {
    // SAFETY: 6 writable bytes.
    unsafe {
        core::ptr::write_unaligned(to.as_mut_ptr() as *mut u32, a);
        core::ptr::write_unaligned(to.as_mut_ptr().add(4) as *mut u16, b);
    }
}

/// The verdict that sends a rewritten frame: `Tx`, or a redirect to the egress interface in slot `slot`.
#[inline(always)]
pub fn send<C: Ctx>(c: &C, slot: u8, out: &Out) -> Verdict {
    if out.ifindex == 0 {
        Verdict::Tx
    } else {
        c.redirect(slot as u32, out.ifindex)
    }
}
