//! What the packet logic needs from its attach point.

use crate::csum;

/// A packet under processing, as seen by one hook.
pub trait Ctx {
    /// Start of the directly accessible packet data.
    fn data(&self) -> usize;
    /// End of the directly accessible packet data.
    fn data_end(&self) -> usize;
    /// Length of the whole packet (for an skb, including non-linear parts).
    fn len(&self) -> usize;
    /// Updates the TCP or UDP checksum at packet offset `off` (pointer `p`, already bounds-checked) for an
    /// address change (`addr`, also in the pseudo header) and a port change (`port`). Called last: a TC
    /// implementation may invalidate packet pointers.
    fn l4_csum(&self, off: usize, p: *mut u16, addr: u32, port: u32, udp: bool);
}

/// Bounds-checked pointer to a `T` at offset `off`.
#[inline(always)]
pub fn ptr_at<C: Ctx, T>(c: &C, off: usize) -> Option<*mut T> {
    let start = c.data();
    if start + off + core::mem::size_of::<T>() > c.data_end() {
        return None;
    }
    Some((start + off) as *mut T)
}

/// Plain arithmetic on the checksum field: what XDP (and the benchmarks) use. XDP frames never carry
/// partially offloaded checksums.
#[inline(always)]
pub fn l4_csum_arith(p: *mut u16, addr: u32, port: u32, udp: bool) {
    // SAFETY: the caller bounds-checked `p`.
    unsafe {
        let d = csum::add(addr, port);
        *p = if udp {
            csum::apply_udp(*p, d)
        } else {
            csum::apply(*p, d)
        };
    }
}
