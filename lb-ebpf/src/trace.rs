//! `lbctl trace`: the same packet logic with a report around it. `lbctl` loads the traced entry points
//! (`lb_xdp_trace`, `lb_tc_trace`) and swaps them onto the agent's pinned link only while a trace runs, so the fast
//! programs carry none of this. Each selected packet yields one [`TraceEvent`]: its headers before and after,
//! the verdict, and every global counter it moved — the reason of a pass or drop, a new flow, a handshake.

use aya_ebpf::{
    helpers::bpf_ktime_get_ns,
    macros::map,
    maps::{Array, PerCpuArray, RingBuf},
};
use lb_common::{stat, Addr, TraceEvent, TraceFilter, FAMILY_V4, FAMILY_V6, TRACE_HDR};

use crate::{
    ctx::Ctx,
    ctx::Verdict,
    ipv6::{new_flow6, process6},
    maps::STATS,
    process::process,
};

/// What to report (written by `lbctl`; this program's own map, never pinned).
#[map]
static TRACE_FILTER: Array<TraceFilter> = Array::with_max_entries(1, 0);

/// The reports, read by `lbctl`.
#[map]
static TRACE_EVENTS: RingBuf = RingBuf::with_byte_size(1 << 20, 0);

/// This CPU's counters as they were before the packet.
#[map]
static TRACE_STATS: PerCpuArray<[u64; stat::COUNT as usize]> = PerCpuArray::with_max_entries(1, 0);

/// [`process`] with a report of the packet when the filter selects it (before or after the rewrite: a client's
/// address is in a reply only once it is rewritten).
#[inline(always)]
pub fn traced<C: Ctx>(c: &C) -> Verdict {
    around(c, process_frame)
}

/// The IPv6 program's [`traced`].
#[inline(always)]
pub fn traced6<C: Ctx>(c: &C) -> Verdict {
    around(c, process6_frame)
}

/// The IPv6 new-flow program's [`traced`]. The packet is reported by this program only: its counters are those
/// the new-flow program moved (the IPv6 program's, such as `ipv6_ext_headers`, are not in the report).
#[inline(always)]
pub fn traced6_new<C: Ctx>(c: &C) -> Verdict {
    around(c, new_flow6_frame)
}

#[inline(always)]
fn around<C: Ctx>(c: &C, run: impl Fn(&C) -> Verdict) -> Verdict {
    let Some(mut ev) = TRACE_EVENTS.reserve::<TraceEvent>(0) else {
        return run(c);
    };
    before(c, ev.as_mut_ptr());
    let v = run(c);
    // An IPv6 frame goes on to the IPv6 traced program, a new IPv6 flow to its new-flow program: they report it.
    if v != Verdict::Ipv6 && v != Verdict::NewFlow && after(c, ev.as_mut_ptr(), v) {
        ev.submit(0);
    } else {
        ev.discard(0);
    }
    v
}

/// [`process`] in a call frame of its own: it needs nearly all of the 512-byte stack itself, and the record is
/// live across it.
#[inline(never)]
fn process_frame<C: Ctx>(c: &C) -> Verdict {
    process(c)
}

/// [`process6`] in a call frame of its own, as [`process_frame`].
#[inline(never)]
fn process6_frame<C: Ctx>(c: &C) -> Verdict {
    process6(c)
}

/// [`new_flow6`] in a call frame of its own, as [`process_frame`].
#[inline(never)]
fn new_flow6_frame<C: Ctx>(c: &C) -> Verdict {
    new_flow6(c)
}

/// Fills the record with the packet as it arrived and keeps this CPU's counters.
#[inline(never)]
fn before<C: Ctx>(c: &C, e: *mut TraceEvent) {
    let Some(snap) = TRACE_STATS.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: `e` is an exclusively owned ring-buffer record and `snap` this CPU's slot.
    unsafe {
        (*e).ts_ns = bpf_ktime_get_ns();
        (*e).len = c.packet_len() as u16;
        (*e).hdr_len = c.load_head(&mut (*e).before) as u8;
        for i in 0..stat::COUNT {
            (*snap)[i as usize] = STATS.get(i).copied().unwrap_or(0);
        }
    }
}

/// Completes the record with the packet as it leaves, the verdict and the counters that moved; whether the
/// filter selects it.
#[inline(never)]
fn after<C: Ctx>(c: &C, e: *mut TraceEvent, v: Verdict) -> bool {
    let (Some(filter), Some(snap)) = (TRACE_FILTER.get(0), TRACE_STATS.get_ptr_mut(0)) else {
        return false;
    };
    // SAFETY: as in `before`.
    unsafe {
        c.load_head(&mut (*e).after);
        let mut reasons = 0u32;
        for i in 0..stat::COUNT {
            if STATS.get(i).copied().unwrap_or(0) != (*snap)[i as usize] {
                reasons |= 1 << i;
            }
        }
        (*e).reasons = reasons;
        (*e).verdict = match v {
            Verdict::Pass => 1,
            Verdict::Drop => 2,
            Verdict::Tx => 3,
            Verdict::Redirect => 4,
            Verdict::Ipv6 | Verdict::NewFlow => 1,
        };
        let n = (*e).hdr_len as usize;
        matches(filter, &(*e).before, n) || matches(filter, &(*e).after, n)
    }
}

/// Whether headers `h` (the first `n` bytes of a frame) are what `f` asks for (unset fields match anything; an
/// address of one family matches no frame of the other).
#[inline(always)]
fn matches(f: &TraceFilter, h: &[u8; TRACE_HDR], n: usize) -> bool {
    let any = f.addr_family == 0 && f.dst_family == 0 && f.dport_be == 0;
    // Where the frame's addresses are, their length and where its L4 header is.
    let (family, at, len, l4) = match (h[12], h[13]) {
        (0x08, 0x00) if n >= 34 => (FAMILY_V4, 26, 4, 14 + (h[14] & 0x0f) as usize * 4),
        (0x86, 0xdd) if n >= 54 => (FAMILY_V6, 22, 16, 54),
        _ => return any,
    };
    let is = |fam: u8, a: &Addr, off: usize| fam == family && same(&a.bytes, h, off, len);
    if f.addr_family != 0
        && !is(f.addr_family, &f.addr, at)
        && !is(f.addr_family, &f.addr, at + len)
    {
        return false;
    }
    if f.dst_family != 0 && !is(f.dst_family, &f.dst, at + len) {
        return false;
    }
    if f.dport_be != 0 {
        let at = l4 + 2;
        if at + 2 > n || at + 2 > TRACE_HDR {
            return false;
        }
        return u16::from_ne_bytes([h[at], h[at + 1]]) == f.dport_be;
    }
    true
}

/// Whether `h[off..off + len]` is `a[..len]` (`len` 4 or 16).
#[inline(always)]
fn same(a: &[u8; 16], h: &[u8; TRACE_HDR], off: usize, len: usize) -> bool {
    let mut i = 0;
    while i < len {
        if off + i >= TRACE_HDR || a[i] != h[off + i] {
            return false;
        }
        i += 1;
    }
    true
}
