//! PROXY protocol v2 on the packet path (the rules are `lb_common::proxy`'s): a connection of a PROXY service gets
//! the header in front of the client's first bytes, and the two directions' numbers are translated around it —
//! the client's sequence numbers up by the header's length towards the backend, the backend's acknowledgements
//! down towards the client. The handshake turns SACK off and lowers the MSS the backend announces by the header's
//! length, so that a client segment with the header in front still fits the path. Everything else about the flow
//! (full NAT, sync, close) is unchanged. See docs/design.md, "PROXY protocol v2".
//!
//! Only the XDP hook inserts (`Ctx::INSERTS`; see `ctx::Tc` for why not TC); the agent does not program a PROXY
//! service for TC, and a TC program meeting such a flow (a peer's) drops its client segments and counts them.

use lb_common::{
    proxy::{self, header_due, to_backend_seq, to_client_ack},
    stat, Flow, Transient, FLOW_F_FORWARD, FLOW_F_PROXY_ACKED, PROTO_TCP,
};

use crate::{
    csum,
    ctx::{ptr_at, Ctx, Verdict},
    family::Family,
    hdr::{TcpHdr, TCP_ACK, TCP_CSUM_OFF, TCP_LEN, TCP_RST, TCP_SYN},
    maps::count,
    nat::{self, count_packet, rewrite_headers, send},
    packet::L4Pkt,
};

/// Where a frame's TCP header may start for the PROXY rules to look at it (the headers in front of the PROXY header
/// must also fit a scratch slot: 120 bytes for IPv4, 168 for IPv6).
const MAX_HEADERS: usize = 192;
/// TCP options of a SYN walked for SACK-permitted (40 bytes may hold 40 NOPs; stacks send at most 8 options and
/// NOPs there — macOS: MSS, NOP, window scale, NOP, NOP, timestamps, SACK-permitted, end).
const MAX_OPTIONS: usize = 8;

/// Counts, translates and rewrites a packet of a flow, and sends it: [`nat::forward`], with the PROXY v2 rules
/// for a PROXY connection's entry.
#[inline(always)]
pub fn forward<C: Ctx, F: Family>(c: &C, p: &L4Pkt<F>, fl: &mut Flow<F::A>) -> Verdict {
    if fl.proxy_len == 0 {
        return nat::forward(c, p, fl);
    }
    let r = proxied(c, p, fl);
    if r & INSERTING != 0 {
        // After the rewrite and the send (which only names the way out): the header goes in last.
        if insert_header(c, p) == 0 {
            count(stat::DROP_PROXY);
            return Verdict::Drop;
        }
        count(stat::PROXY_HEADERS);
    }
    if r & ACKED != 0 {
        // The backend's first acknowledgement past the header: the forward entry stops inserting it too. (Here,
        // not in `proxied`: the partner's key is 40 bytes of stack for IPv6, which its frame cannot have.)
        if let Some(f) = F::flows().get_ptr_mut(fl.partner_key(PROTO_TCP)) {
            // SAFETY: a value of the map, valid under RCU for this program run.
            unsafe { (*f).flags |= FLOW_F_PROXY_ACKED };
        }
    }
    Verdict::from_code(r & 0xff)
}

/// In [`proxied`]'s result beside the verdict: the backend acknowledged the header (this entry is marked; the
/// caller marks its partner), and: the header goes in front of this segment's payload (the caller puts it).
const ACKED: u32 = 1 << 8;
const INSERTING: u32 = 1 << 9;

/// The PROXY v2 translation, then the rewrite, in a call of their own rather than inlined into each of the three
/// places a PROXY connection's packet is forwarded (established, the handshake's completion, closed): the verifier then meets their branches once per call instead of carrying
/// their states into everything after each place (inlined, the IPv6 programs passed a million verified
/// instructions). Returns the verdict's code, with [`ACKED`] and [`INSERTING`].
#[inline(never)]
fn proxied<C: Ctx, F: Family>(c: &C, p: &L4Pkt<F>, fl: &mut Flow<F::A>) -> u32 {
    let t = translate(c, p, fl);
    if t == DROP {
        return Verdict::Drop.code();
    }
    count_packet(p, fl);
    let out = match rewrite_headers(c, p, fl) {
        Ok(out) => out,
        Err(v) => return v.code(),
    };
    let more = match t {
        MARKED => ACKED,
        INSERT => INSERTING,
        _ => 0,
    };
    send(c, fl.egress, &out).code() | more
}

/// [`translate`]'s answers: forward as translated, put the header in, the backend acknowledged the header (this
/// entry is marked), drop (counted).
const FORWARD: u32 = 0;
const INSERT: u32 = 1;
const MARKED: u32 = 2;
const DROP: u32 = 3;

/// A PROXY connection's segment: the client's sequence number goes up by the header's length (not where the
/// header goes in front of it), the backend's acknowledgement down.
#[inline(always)]
fn translate<C: Ctx, F: Family>(c: &C, p: &L4Pkt<F>, fl: &mut Flow<F::A>) -> u32 {
    // The TCP header found again from the frame's start: through `p.ports` the verifier knows only the ports to be
    // in the frame. Bounded first: the difference of two packet pointers is a number it knows nothing about.
    let tcp_off = p.ports as usize - p.eth as usize;
    let Some(tcp) = (tcp_off <= MAX_HEADERS)
        .then(|| ptr_at::<C, TcpHdr>(c, tcp_off))
        .flatten()
    else {
        count(stat::DROP_MALFORMED);
        return DROP;
    };
    let start = u32::from_be(fl.proxy_seq_be);
    let len = fl.proxy_len;
    let acked = fl.flags & FLOW_F_PROXY_ACKED != 0;
    if fl.flags & FLOW_F_FORWARD != 0 {
        if p.tcp_flags & TCP_SYN != 0 {
            return FORWARD;
        }
        if !C::INSERTS {
            count(stat::DROP_PROXY);
            return DROP;
        }
        let seq = u32::from_be(p.seq_be());
        let new = to_backend_seq(seq, start, len, acked);
        if new != seq {
            let new = new.to_be();
            // SAFETY (both): bounds-checked above.
            unsafe {
                (*tcp).check = csum::apply((*tcp).check, csum::diff32((*tcp).seq, new));
                (*tcp).seq = new;
            }
        }
        return if p.tcp_flags & TCP_RST == 0 && header_due(seq, start, acked) {
            INSERT
        } else {
            FORWARD
        };
    }
    if p.tcp_flags & TCP_ACK == 0 {
        return FORWARD;
    }
    let (ack, covers) = to_client_ack(u32::from_be(p.ack_be()), start, len);
    let ack = ack.to_be();
    // SAFETY (both): bounds-checked above.
    unsafe {
        (*tcp).check = csum::apply((*tcp).check, csum::diff32((*tcp).ack, ack));
        (*tcp).ack = ack;
    }
    if covers && !acked {
        fl.flags |= FLOW_F_PROXY_ACKED;
        return MARKED;
    }
    FORWARD
}

/// The client's SYN of a PROXY connection: its SACK-permitted option becomes two NOPs, so SACK is off on the
/// connection both ways (a backend offers SACK only to a SYN that does). SACK blocks name sequence numbers of one
/// side that the other cannot read, and translating every segment's options would cost more verifier work than
/// the programs have left. Returns the checksum's partial sum for the change (byte-swapped at an odd offset: the
/// bytes then sit in the other halves of the checksum's words), which [`apply_sum`] puts into the TCP checksum. A
/// call of its own, not inlined: the IPv6 new-flow program has no stack left for its frame in the handshake's.
#[inline(never)]
pub fn no_sack<C: Ctx, F: Family>(c: &C, p: &L4Pkt<F>) -> u32 {
    // Bounded first: the difference of two packet pointers is a number the verifier knows nothing about.
    let tcp_off = p.ports as usize - p.eth as usize;
    if !C::INSERTS || tcp_off > MAX_HEADERS {
        return 0;
    }
    let Some(tcp) = ptr_at::<C, TcpHdr>(c, tcp_off) else {
        return 0;
    };
    // SAFETY: bounds-checked.
    let end = tcp_off + (unsafe { (*tcp).doff } >> 4) as usize * 4;
    let mut off = tcp_off + TCP_LEN;
    for _ in 0..MAX_OPTIONS {
        if off + 2 > end {
            break;
        }
        let Some(o) = ptr_at::<C, [u8; 2]>(c, off) else {
            break;
        };
        // SAFETY: bounds-checked.
        let o = unsafe { &mut *o };
        match *o {
            [0, _] => break,
            [1, _] => off += 1,
            [4, 2] => {
                let old = *o;
                *o = [1, 1];
                // The TCP header starts at an even offset (Ethernet 14, IP a multiple of 4).
                return swapped(diff16(old, [1, 1]), off & 1 != 0);
            }
            [_, n] if n >= 2 => off += n as usize,
            _ => break,
        }
    }
    0
}

/// Puts a partial sum of [`no_sack`] into the segment's TCP checksum.
#[inline(always)]
pub fn apply_sum<C: Ctx, F: Family>(c: &C, p: &L4Pkt<F>, sum: u32) {
    let (ck, _) = p.csum();
    if sum != 0 && ck as usize + 2 <= c.data_end() {
        // SAFETY: bounds-checked.
        unsafe { *ck = csum::apply(*ck, sum) };
    }
}

/// The backend's SYN-ACK of a PROXY connection: the MSS it announces goes down by the header's length `len`, so
/// that a client segment with the header in front still fits the path. Read where every stack writes it, as the
/// first option; a SYN-ACK without it leaves the client at the small default MSS, which takes the header too.
#[inline(always)]
pub fn clamp_mss<C: Ctx, F: Family>(c: &C, p: &L4Pkt<F>, len: u16) {
    let tcp_off = p.ports as usize - p.eth as usize;
    if !C::INSERTS || tcp_off > MAX_HEADERS {
        return;
    }
    let (Some(tcp), Some(m)) = (
        ptr_at::<C, TcpHdr>(c, tcp_off),
        ptr_at::<C, [u8; 4]>(c, tcp_off + TCP_LEN),
    ) else {
        return;
    };
    // SAFETY (both): bounds-checked.
    let (doff, m) = unsafe { ((*tcp).doff >> 4, &mut *m) };
    if doff < 6 || m[0] != 2 || m[1] != 4 {
        return;
    }
    let mss = u16::from_be_bytes([m[2], m[3]]);
    // Never below what IPv4 requires every host to take (RFC 879).
    let new = mss.saturating_sub(len).max(536).min(mss).to_be_bytes();
    let d = diff16([m[2], m[3]], new);
    [m[2], m[3]] = new;
    // SAFETY: the TCP header, bounds-checked.
    unsafe { (*tcp).check = csum::apply((*tcp).check, d) };
}

/// The sum that turns two bytes `old` into `new` (as stored).
#[inline(always)]
fn diff16(old: [u8; 2], new: [u8; 2]) -> u32 {
    csum::diff16(u16::from_ne_bytes(old), u16::from_ne_bytes(new))
}

/// A partial sum of a field at an odd offset: the same bytes count in the other half of each 16-bit word.
#[inline(always)]
fn swapped(d: u32, odd: bool) -> u32 {
    if odd {
        (d as u16).swap_bytes() as u32
    } else {
        d
    }
}

/// Puts the PROXY v2 header between the (rewritten) TCP header and the payload: the frame grows at its front, the
/// headers move there, the header fills the gap; the IP length and the TCP checksum (the header's words and the
/// pseudo header's longer length) follow. 0 when the frame cannot take it (a number, not a `bool`: a BPF call's
/// result the caller reads). A call of its own beside [`proxied`], not inside it: nested, their frames passed the
/// 512 bytes of stack kernel 6.1 allows a chain of calls.
#[inline(never)]
fn insert_header<C: Ctx, F: Family>(c: &C, p: &L4Pkt<F>) -> u32 {
    u32::from(put_header(c, p))
}

#[inline(always)]
fn put_header<C: Ctx, F: Family>(c: &C, p: &L4Pkt<F>) -> bool {
    let len = F::PROXY_LEN as usize;
    // Bounded first: the difference of two packet pointers is a number the verifier knows nothing about.
    let tcp_off = p.ports as usize - p.eth as usize;
    if tcp_off > MAX_HEADERS {
        return false;
    }
    let Some(tcp) = ptr_at::<C, TcpHdr>(c, tcp_off) else {
        return false;
    };
    // SAFETY: bounds-checked.
    let doff = (unsafe { (*tcp).doff } >> 4) as usize * 4;
    let h = tcp_off + doff;
    // Even: Ethernet's 14 bytes, IP and TCP headers in multiples of 4.
    if h > MAX_HEADERS || h & 1 != 0 {
        return false;
    }
    // `p.key` is read where it is (on the stack, untouched by the move): a copy of an IPv6 key costs 40 bytes of
    // stack.
    let key = &p.key;
    // The headers wait in this CPU's scratch slot while the frame grows (the slot is free: only a new flow and a
    // closing connection use it, neither of which inserts).
    let Some(buf) = F::scratch().get_ptr_mut(0) else {
        return false;
    };
    let buf = buf as *mut u8;
    // A lower bound the verifier can keep (kernel 6.1 does not narrow a range by `!= 0`, and refuses a helper
    // length that may be 0): at least the Ethernet header.
    if h < crate::hdr::ETH_LEN || h > core::mem::size_of::<Transient<F::A>>() {
        return false;
    }
    if !c.copy_out(0, buf, h as u32) || !c.push_head(len as u32) || !c.copy_in(0, buf, h as u32) {
        return false;
    }
    let at = c.data() + h;
    if at + len > c.data_end() {
        return false;
    }
    let alen = core::mem::size_of::<F::A>();
    // SAFETY: `at .. at + len` is in the frame (checked above); the header's fields end at `16 + 2 * alen + 4 = len`.
    unsafe {
        let b = at as *mut u8;
        // Word by word: an array copy became a call to `memmove`, a frame 6.1 counts on this chain.
        for (i, w) in SIGNATURE_WORDS.iter().enumerate() {
            core::ptr::write_unaligned(b.add(4 * i) as *mut u32, *w);
        }
        *b.add(12) = proxy::VER_CMD;
        *b.add(13) = F::PROXY_FAM;
        core::ptr::write_unaligned(b.add(14) as *mut u16, ((len - 16) as u16).to_be());
        F::put(b.add(16), &key.src);
        F::put(b.add(16 + alen), &key.dst);
        core::ptr::write_unaligned(b.add(16 + 2 * alen) as *mut u16, key.sport);
        core::ptr::write_unaligned(b.add(18 + 2 * alen) as *mut u16, key.dport);
    }
    let words = csum::add(
        csum::add(
            SIGNATURE_SUM,
            u16::from_ne_bytes([proxy::VER_CMD, F::PROXY_FAM]) as u32,
        ),
        csum::add(
            ((len - 16) as u16).to_be() as u32,
            csum::add(F::sum(&key.src), F::sum(&key.dst)),
        ),
    );
    let words = csum::add(words, csum::add(key.sport as u32, key.dport as u32));
    // The pseudo header's TCP length grows by `len` too.
    let d = csum::add(words, (len as u16).to_be() as u32);
    let (Some(ip), Some(ck)) = (
        ptr_at::<C, F::Ip>(c, crate::hdr::ETH_LEN),
        ptr_at::<C, u16>(c, tcp_off + TCP_CSUM_OFF),
    ) else {
        return false;
    };
    // SAFETY: both bounds-checked.
    unsafe {
        F::grow(ip, len as u16);
        *ck = csum::apply(*ck, d);
    }
    true
}

/// The signature as stored, in 32-bit words.
const SIGNATURE_WORDS: [u32; 3] = {
    let s = proxy::SIGNATURE;
    [
        u32::from_ne_bytes([s[0], s[1], s[2], s[3]]),
        u32::from_ne_bytes([s[4], s[5], s[6], s[7]]),
        u32::from_ne_bytes([s[8], s[9], s[10], s[11]]),
    ]
};

/// The signature's 16-bit words, summed (as stored: native loads of the network-order bytes).
const SIGNATURE_SUM: u32 = {
    let s = proxy::SIGNATURE;
    let mut sum = 0u32;
    let mut i = 0;
    while i < 12 {
        sum += u16::from_ne_bytes([s[i], s[i + 1]]) as u32;
        i += 2;
    }
    (sum & 0xffff) + (sum >> 16)
};
