//! What the packet logic needs from its attach point.

use crate::{csum, maps::EGRESS_DEVMAP};
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    helpers::{
        bpf_l4_csum_replace, bpf_redirect, bpf_skb_load_bytes, bpf_xdp_adjust_head,
        bpf_xdp_load_bytes, bpf_xdp_store_bytes,
    },
    programs::{TcContext, XdpContext},
    EbpfContext,
};

/// A packet under processing, as seen by one hook.
pub trait Ctx {
    /// Start of the directly accessible packet data.
    fn data(&self) -> usize;
    /// End of the directly accessible packet data.
    fn data_end(&self) -> usize;
    /// Length of the whole packet (for an skb, including non-linear parts).
    fn packet_len(&self) -> usize;
    /// Updates the TCP or UDP checksum at packet offset `off` (pointer `p`, already bounds-checked) for an
    /// address change (`addr`, also in the pseudo header) and a port change (`port`). Called last: a TC
    /// implementation may invalidate packet pointers.
    fn l4_csum(&self, off: usize, p: *mut u16, addr: u32, port: u32, udp: bool);
    /// Copies the first bytes of the frame (as many as fit and exist) into `to` through the kernel's helper;
    /// returns how many (`lbctl trace` only).
    fn load_head(&self, to: &mut [u8]) -> usize;
    /// Index of the interface the frame came in on.
    fn ingress_ifindex(&self) -> u32;
    /// Sends the frame out of the interface in `EGRESS` slot `slot` (index `ifindex`): `Verdict::Redirect`, or
    /// `Verdict::Pass` when the hook cannot.
    fn redirect(&self, slot: u32, ifindex: u32) -> Verdict;
    /// Whether this hook can put bytes into a packet ([`Self::push_head`]): a PROXY v2 header.
    const INSERTS: bool = false;
    /// Adds `n` bytes in front of the frame (the caller moves the headers there); false when it cannot. Invalidates
    /// every packet pointer.
    fn push_head(&self, _n: u32) -> bool {
        false
    }
    /// Copies `len` bytes at frame offset `off` to `to` (`INSERTS` hooks only).
    fn copy_out(&self, _off: u32, _to: *mut u8, _len: u32) -> bool {
        false
    }
    /// Copies `len` bytes from `from` to frame offset `off` (`INSERTS` hooks only).
    fn copy_in(&self, _off: u32, _from: *const u8, _len: u32) -> bool {
        false
    }
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
fn l4_csum_arith(p: *mut u16, addr: u32, port: u32, udp: bool) {
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

/// An XDP frame.
pub struct Xdp<'a>(pub &'a XdpContext);

impl Ctx for Xdp<'_> {
    #[inline(always)]
    fn data(&self) -> usize {
        self.0.data()
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        self.0.data_end()
    }
    #[inline(always)]
    fn packet_len(&self) -> usize {
        self.0.data_end() - self.0.data()
    }
    #[inline(always)]
    fn l4_csum(&self, _off: usize, p: *mut u16, addr: u32, port: u32, udp: bool) {
        l4_csum_arith(p, addr, port, udp)
    }
    #[inline(always)]
    fn load_head(&self, to: &mut [u8]) -> usize {
        let n = self.packet_len().min(to.len());
        // The helper refuses a length the verifier cannot prove non-zero; a frame without its link header is
        // nothing to show anyway.
        if n < crate::hdr::ETH_LEN {
            return 0;
        }
        // SAFETY: `to` holds at least `n` bytes; the helper checks the frame's bounds itself.
        let r = unsafe { bpf_xdp_load_bytes(self.0.ctx, 0, to.as_mut_ptr().cast(), n as u32) };
        if r == 0 {
            n
        } else {
            0
        }
    }
    #[inline(always)]
    fn ingress_ifindex(&self) -> u32 {
        // SAFETY: the context's xdp_md is valid for this program run.
        unsafe { (*self.0.ctx).ingress_ifindex }
    }
    #[inline(always)]
    fn redirect(&self, slot: u32, _ifindex: u32) -> Verdict {
        // Through the device map: the kernel bulks the frames of one NAPI poll per device. The agent fills a
        // slot's device-map entry before its `EGRESS` entry, so a frame that got here finds it.
        match EGRESS_DEVMAP.redirect(slot, 0) {
            Ok(_) => Verdict::Redirect,
            Err(_) => Verdict::Pass,
        }
    }
    // An XDP frame has no offload state to keep true (no GSO, checksums complete), and 256 bytes of headroom.
    const INSERTS: bool = true;
    #[inline(always)]
    fn push_head(&self, n: u32) -> bool {
        // SAFETY: the helper checks the headroom itself.
        unsafe { bpf_xdp_adjust_head(self.0.ctx, -(n as i32)) == 0 }
    }
    #[inline(always)]
    fn copy_out(&self, off: u32, to: *mut u8, len: u32) -> bool {
        // SAFETY: the helper checks the frame's bounds, the verifier `to`'s.
        unsafe { bpf_xdp_load_bytes(self.0.ctx, off, to.cast(), len) == 0 }
    }
    #[inline(always)]
    fn copy_in(&self, off: u32, from: *const u8, len: u32) -> bool {
        // SAFETY: as `copy_out`.
        unsafe { bpf_xdp_store_bytes(self.0.ctx, off, from as *mut _, len) == 0 }
    }
}

/// An skb at TC. It inserts nothing (no PROXY v2 header): an skb may be a GSO super-packet, whose inserted
/// payload bytes the segmentation would repeat in every segment, or carry a partial checksum whose start and length
/// the insertion would leave stale.
pub struct Tc<'a>(pub &'a TcContext);

impl Ctx for Tc<'_> {
    #[inline(always)]
    fn data(&self) -> usize {
        self.0.data()
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        self.0.data_end()
    }
    #[inline(always)]
    fn packet_len(&self) -> usize {
        self.0.len() as usize
    }
    #[inline(always)]
    fn l4_csum(&self, off: usize, _p: *mut u16, addr: u32, port: u32, udp: bool) {
        // The kernel helpers know whether the checksum is complete or only the pseudo-header part of an
        // offloaded (GSO) packet: addresses go in as pseudo-header changes, ports as payload.
        let mangled = if udp { BPF_F_MARK_MANGLED_0 as u64 } else { 0 };
        let skb = self.0.as_ptr().cast();
        unsafe {
            bpf_l4_csum_replace(
                skb,
                off as u32,
                0,
                addr as u64,
                BPF_F_PSEUDO_HDR as u64 | mangled,
            );
            bpf_l4_csum_replace(skb, off as u32, 0, port as u64, mangled);
        }
    }
    #[inline(always)]
    fn load_head(&self, to: &mut [u8]) -> usize {
        let n = self.packet_len().min(to.len());
        // As for XDP: a length the verifier can prove non-zero.
        if n < crate::hdr::ETH_LEN {
            return 0;
        }
        // SAFETY: `to` holds at least `n` bytes; the helper checks the skb's bounds itself.
        let r = unsafe {
            bpf_skb_load_bytes(self.0.as_ptr().cast(), 0, to.as_mut_ptr().cast(), n as u32)
        };
        // The length again rather than `n`: kept over the call, `n` went to a callee-saved register copied from the
        // skb's length before `min` compared it, and kernel 6.1's verifier does not carry a bound over a 32-bit
        // copy ("R4 unbounded memory access" in the TC trace programs).
        if r == 0 {
            self.packet_len().min(to.len())
        } else {
            0
        }
    }
    // At the ingress hook the skb's device is the one it came in by (its `ingress_ifindex`, the kernel's
    // skb_iif, is not set in test runs).
    #[allow(clippy::misnamed_getters)]
    #[inline(always)]
    fn ingress_ifindex(&self) -> u32 {
        // SAFETY: the context's skb is valid for this program run.
        unsafe { (*self.0.skb.skb).ifindex }
    }
    #[inline(always)]
    fn redirect(&self, _slot: u32, ifindex: u32) -> Verdict {
        // SAFETY: a helper call with a plain interface index; it only records the target.
        unsafe { bpf_redirect(ifindex, 0) };
        Verdict::Redirect
    }
}

/// What to do with the packet; each hook maps it to its own return code.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Verdict {
    /// Hand to the kernel unchanged.
    Pass,
    /// Drop.
    Drop,
    /// Send back out of the interface it came in on (rewritten).
    Tx,
    /// Send out of another interface (rewritten; the target is set, see `Ctx::redirect`).
    Redirect,
    /// An IPv6 frame: the entry point hands it to the IPv6 program (by tail call).
    Ipv6,
    /// An IPv6 packet that opens a flow: the IPv6 program hands it to its new-flow program (by tail call; see
    /// `maps::NEW_FLOW_HANDOFF`).
    NewFlow,
}

impl Verdict {
    /// The verdict as a number: a BPF call's result must be a plain value (`proxy::proxied`).
    #[inline(always)]
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The verdict of [`Self::code`]; an unknown code drops.
    #[inline(always)]
    pub fn from_code(code: u32) -> Self {
        match code {
            0 => Verdict::Pass,
            2 => Verdict::Tx,
            3 => Verdict::Redirect,
            4 => Verdict::Ipv6,
            5 => Verdict::NewFlow,
            _ => Verdict::Drop,
        }
    }
}
