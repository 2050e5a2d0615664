//! What differs between IPv4 and IPv6 on the packet path, behind one trait: the address type, the maps, the
//! address checksum delta and how the IP header takes new addresses. Everything else — conntrack, handshakes,
//! NAT, SNAT, Maglev, the SYN guard — is written once, generic over [`Family`].

use aya_ebpf::maps::{Array, LruHashMap, PerCpuArray, RingBuf};
use lb_common::{proxy, Addr, Flow, FlowAddr, FlowKey, In6, Transient};

use crate::{
    csum,
    hdr::{Ipv4Hdr, Ipv6Hdr},
    maps::{
        FLOWS_V4, FLOWS_V6, FLOW_EVENTS, FLOW_EVENTS_V6, HANDSHAKES, HANDSHAKES_V6, SCRATCH,
        SCRATCH_V6, TRANSIENT_V4, TRANSIENT_V6,
    },
};

/// An address family's side of the packet path.
pub trait Family: 'static {
    /// The address as read from the header.
    type A: FlowAddr;
    /// The fixed IP header.
    type Ip;
    /// Address bits (a source range's full-address lookup).
    const ADDR_BITS: u32;
    /// Whether a new flow is opened by a program of its own, reached by tail call (`ipv6::new_flow6`): with
    /// IPv6's keys and entries the lookups and the new-flow path do not fit one 512-byte stack; IPv4's do, and
    /// stay in one program.
    const NEW_FLOW_PROGRAM: bool;
    /// Length of this family's PROXY v2 header, and its address-family byte.
    const PROXY_LEN: u16;
    const PROXY_FAM: u8;
    /// Connection tracking (`FLOWS_V4`/`FLOWS_V6`).
    fn flows() -> &'static LruHashMap<FlowKey<Self::A>, Flow<Self::A>>;
    /// Handshakes and closed connections.
    fn transient() -> &'static LruHashMap<FlowKey<Self::A>, Transient<Self::A>>;
    /// The handshake index.
    fn handshakes() -> &'static Array<FlowKey<Self::A>>;
    /// Per-CPU scratch entries (see `maps::SCRATCH`).
    fn scratch() -> &'static PerCpuArray<Transient<Self::A>>;
    /// The sync ring buffer.
    fn flow_events() -> &'static RingBuf;
    /// A backend's or SNAT address from the family-agnostic form.
    fn from_addr(a: &Addr) -> Self::A;
    /// The one's-complement sum that turns address `old` into `new`.
    fn diff(old: &Self::A, new: &Self::A) -> u32;
    /// The one's-complement sum of an address's 16-bit words.
    fn sum(a: &Self::A) -> u32;
    /// Writes new addresses into the IP header (IPv4 also updates its header checksum with `csum_addr`).
    ///
    /// # Safety
    /// `ip` must point at a bounds-checked header of this family.
    unsafe fn set_addrs(ip: *mut Self::Ip, src: &Self::A, dst: &Self::A, csum_addr: u32);
    /// Writes an address at `at` (no alignment), word by word.
    ///
    /// # Safety
    /// `at` must point at as many writable bytes as the address has.
    unsafe fn put(at: *mut u8, a: &Self::A);
    /// Adds `n` to the IP header's length (IPv4 also updates its header checksum).
    ///
    /// # Safety
    /// `ip` must point at a bounds-checked header of this family.
    unsafe fn grow(ip: *mut Self::Ip, n: u16);
}

/// IPv4.
pub struct V4;

impl Family for V4 {
    type A = u32;
    type Ip = Ipv4Hdr;
    const ADDR_BITS: u32 = 32;
    const NEW_FLOW_PROGRAM: bool = false;
    const PROXY_LEN: u16 = proxy::HEADER_LEN_V4;
    const PROXY_FAM: u8 = proxy::FAM_TCP4;
    #[inline(always)]
    fn flows() -> &'static LruHashMap<FlowKey<u32>, Flow<u32>> {
        &FLOWS_V4
    }
    #[inline(always)]
    fn transient() -> &'static LruHashMap<FlowKey<u32>, Transient<u32>> {
        &TRANSIENT_V4
    }
    #[inline(always)]
    fn handshakes() -> &'static Array<FlowKey<u32>> {
        &HANDSHAKES
    }
    #[inline(always)]
    fn scratch() -> &'static PerCpuArray<Transient<u32>> {
        &SCRATCH
    }
    #[inline(always)]
    fn flow_events() -> &'static RingBuf {
        &FLOW_EVENTS
    }
    #[inline(always)]
    fn from_addr(a: &Addr) -> u32 {
        a.v4_raw()
    }
    #[inline(always)]
    fn diff(old: &u32, new: &u32) -> u32 {
        csum::diff32(*old, *new)
    }
    #[inline(always)]
    fn sum(a: &u32) -> u32 {
        csum::fold((*a & 0xffff) as u64 + (*a >> 16) as u64)
    }
    #[inline(always)]
    unsafe fn set_addrs(ip: *mut Ipv4Hdr, src: &u32, dst: &u32, csum_addr: u32) {
        unsafe {
            (*ip).src = *src;
            (*ip).dst = *dst;
            (*ip).check = csum::apply((*ip).check, csum_addr);
        }
    }
    #[inline(always)]
    unsafe fn put(at: *mut u8, a: &u32) {
        unsafe { core::ptr::write_unaligned(at as *mut u32, *a) }
    }
    #[inline(always)]
    unsafe fn grow(ip: *mut Ipv4Hdr, n: u16) {
        unsafe {
            let old = (*ip).tot_len;
            let new = (u16::from_be(old) + n).to_be();
            (*ip).tot_len = new;
            (*ip).check = csum::apply((*ip).check, csum::diff16(old, new));
        }
    }
}

/// IPv6: no header checksum; the address delta enters only the L4 (pseudo-header) checksum.
pub struct V6;

impl Family for V6 {
    type A = In6;
    type Ip = Ipv6Hdr;
    const ADDR_BITS: u32 = 128;
    const NEW_FLOW_PROGRAM: bool = true;
    const PROXY_LEN: u16 = proxy::HEADER_LEN_V6;
    const PROXY_FAM: u8 = proxy::FAM_TCP6;
    #[inline(always)]
    fn flows() -> &'static LruHashMap<FlowKey<In6>, Flow<In6>> {
        &FLOWS_V6
    }
    #[inline(always)]
    fn transient() -> &'static LruHashMap<FlowKey<In6>, Transient<In6>> {
        &TRANSIENT_V6
    }
    #[inline(always)]
    fn handshakes() -> &'static Array<FlowKey<In6>> {
        &HANDSHAKES_V6
    }
    #[inline(always)]
    fn scratch() -> &'static PerCpuArray<Transient<In6>> {
        &SCRATCH_V6
    }
    #[inline(always)]
    fn flow_events() -> &'static RingBuf {
        &FLOW_EVENTS_V6
    }
    #[inline(always)]
    fn from_addr(a: &Addr) -> In6 {
        a.v6_raw()
    }
    #[inline(always)]
    fn diff(old: &In6, new: &In6) -> u32 {
        diff128(old, new)
    }
    #[inline(always)]
    fn sum(a: &In6) -> u32 {
        csum::fold(
            a.iter()
                .map(|w| (w & 0xffff) as u64 + (w >> 16) as u64)
                .sum(),
        )
    }
    #[inline(always)]
    unsafe fn set_addrs(ip: *mut Ipv6Hdr, src: &In6, dst: &In6, _csum_addr: u32) {
        unsafe {
            (*ip).src = *src;
            (*ip).dst = *dst;
        }
    }
    #[inline(always)]
    unsafe fn put(at: *mut u8, a: &In6) {
        for (i, w) in a.iter().enumerate() {
            unsafe { core::ptr::write_unaligned(at.add(4 * i) as *mut u32, *w) }
        }
    }
    #[inline(always)]
    unsafe fn grow(ip: *mut Ipv6Hdr, n: u16) {
        unsafe { (*ip).payload_len = (u16::from_be((*ip).payload_len) + n).to_be() }
    }
}

/// The sum that turns IPv6 address `old` into `new` (its four words' deltas).
#[inline(always)]
pub fn diff128(old: &In6, new: &In6) -> u32 {
    csum::add(
        csum::add(csum::diff32(old[0], new[0]), csum::diff32(old[1], new[1])),
        csum::add(csum::diff32(old[2], new[2]), csum::diff32(old[3], new[3])),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One's-complement sum of `b` (network-order 16-bit words), folded.
    fn sum(b: &[u8]) -> u16 {
        let mut s: u32 = b
            .chunks(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]) as u32)
            .sum();
        while s > 0xffff {
            s = (s & 0xffff) + (s >> 16);
        }
        s as u16
    }

    fn words(b: &[u8; 16]) -> In6 {
        core::array::from_fn(|i| u32::from_ne_bytes(b[i * 4..i * 4 + 4].try_into().unwrap()))
    }

    proptest! {
        /// A checksum over an IPv6 address, updated with `diff128`, equals one computed over the new address.
        #[test]
        fn an_address_delta_matches_a_full_checksum(old in any::<[u8; 16]>(), new in any::<[u8; 16]>()) {
            let ck = !sum(&old);
            let updated = csum::apply(u16::from_ne_bytes(ck.to_be_bytes()), diff128(&words(&old), &words(&new)));
            let full = (!sum(&new)).to_be_bytes();
            let got = updated.to_ne_bytes();
            // 0x0000 and 0xffff are the same one's-complement number.
            prop_assert!(got == full || (got.iter().all(|b| *b == 0) && full.iter().all(|b| *b == 0xff))
                || (got.iter().all(|b| *b == 0xff) && full.iter().all(|b| *b == 0)), "{got:02x?} vs {full:02x?}");
        }
    }
}
