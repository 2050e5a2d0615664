//! The entry points' glue around the packet logic — the tail calls into the IPv6 programs, the verdict's XDP or TC
//! action, TC's linear headers — shared by the product (`src/main.rs`) and the benchmark wrappers
//! (`src/bin/lb-bench.rs`), so that the benchmark's IPv6 path is the product's, tail calls included.
//!
//! Inlined into each entry function: the verifier restricts tail calls from subprograms.

use aya_ebpf::{
    bindings::{xdp_action, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT},
    helpers::bpf_redirect,
    programs::{TcContext, XdpContext},
};
use lb_common::stat;

use crate::{
    ctx::Verdict,
    maps::{count, V6_PROGS_TC, V6_PROGS_XDP},
};

/// The XDP action for verdict `v`. The verdicts that go on to another program — `Verdict::Ipv6` (from the IPv4
/// logic) and `Verdict::NewFlow` (from the IPv6 logic) — are handed to the program in `slot` of `V6_PROGS_XDP`
/// (`lb_common::V6_PROG_*`); without one there, the packet goes to the kernel, counted.
#[inline(always)]
pub fn xdp_next(ctx: &XdpContext, v: Verdict, slot: u32) -> u32 {
    if matches!(v, Verdict::Ipv6 | Verdict::NewFlow) {
        // SAFETY: a tail call with this program's own context; on success it does not return.
        unsafe { V6_PROGS_XDP.tail_call(ctx, slot) };
        count(stat::PASS_NO_IPV6_PROGRAM);
    }
    xdp_verdict(v)
}

/// The XDP action of a final verdict.
#[inline(always)]
pub fn xdp_verdict(v: Verdict) -> u32 {
    match v {
        Verdict::Pass | Verdict::Ipv6 | Verdict::NewFlow => xdp_action::XDP_PASS,
        Verdict::Drop => xdp_action::XDP_DROP,
        Verdict::Tx => xdp_action::XDP_TX,
        Verdict::Redirect => xdp_action::XDP_REDIRECT,
    }
}

/// [`xdp_next`] for TC (`V6_PROGS_TC`).
#[inline(always)]
pub fn tc_next(ctx: &TcContext, v: Verdict, slot: u32) -> i32 {
    if matches!(v, Verdict::Ipv6 | Verdict::NewFlow) {
        // SAFETY: as in `xdp_next`.
        unsafe { V6_PROGS_TC.tail_call(ctx, slot) };
        count(stat::PASS_NO_IPV6_PROGRAM);
    }
    tc_verdict(ctx, v)
}

/// The TC action of a final verdict (`Tx`: redirected out of the interface it came in on; `Redirect`: to the
/// interface `Ctx::redirect` set).
#[inline(always)]
pub fn tc_verdict(ctx: &TcContext, v: Verdict) -> i32 {
    match v {
        Verdict::Pass | Verdict::Ipv6 | Verdict::NewFlow => TC_ACT_OK,
        Verdict::Drop => TC_ACT_SHOT,
        Verdict::Tx => {
            // SAFETY: the context's skb is valid for this program run.
            let ifindex = unsafe { (*ctx.skb.skb).ifindex };
            // SAFETY: a helper call with a plain interface index.
            unsafe { bpf_redirect(ifindex, 0) as i32 }
        }
        Verdict::Redirect => TC_ACT_REDIRECT,
    }
}

/// Headers the IPv4 logic may read directly: Ethernet + IPv4 with options + ICMP + inner IPv4 + inner ports.
pub const HEADERS: u32 = 14 + 60 + 8 + 20 + 20;
/// The same for IPv6: Ethernet + IPv6 + walked extension headers (typically small) + ICMPv6 + inner IPv6 + inner
/// ports.
pub const HEADERS6: u32 = 14 + 40 + 64 + 8 + 40 + 20;

/// GRO'd skbs may hold headers in paged data; direct access needs the first `headers` bytes linear.
#[inline(always)]
pub fn linear_headers(ctx: &TcContext, headers: u32) {
    let want = if ctx.len() < headers {
        ctx.len()
    } else {
        headers
    };
    if ((ctx.data_end() - ctx.data()) as u32) < want {
        let _ = ctx.pull_data(want);
    }
}
