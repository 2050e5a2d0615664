//! The XDP entry points' glue around the packet logic — the tail calls into the IPv6 programs and the verdict's
//! XDP action — shared by the product (`src/main.rs`) and the benchmark wrappers (`src/bin/lb-bench.rs`), so that
//! the benchmark's IPv6 path is the product's, tail calls included.
//!
//! Inlined into each entry function: the verifier restricts tail calls from subprograms.

use aya_ebpf::{bindings::xdp_action, programs::XdpContext};
use lb_common::stat;

use crate::{
    ctx::Verdict,
    maps::{count, V6_PROGS_XDP},
};

/// After the IPv4 logic: an IPv6 frame goes on to the IPv6 program in `slot` of `V6_PROGS_XDP`
/// (`lb_common::V6_PROG_FAST` or `V6_PROG_TRACED`); without one there, to the kernel, counted.
#[inline(always)]
pub fn xdp_after_ipv4(ctx: &XdpContext, v: Verdict, slot: u32) -> u32 {
    match v {
        Verdict::Ipv6 => {
            // SAFETY: a tail call with this program's own context; on success it does not return.
            unsafe { V6_PROGS_XDP.tail_call(ctx, slot) };
            count(stat::PASS_NO_IPV6_PROGRAM);
            xdp_action::XDP_PASS
        }
        v => xdp_verdict(v),
    }
}

/// After the IPv6 logic: a packet that opens a flow goes on to the new-flow program in `slot` of `V6_PROGS_XDP`
/// (`lb_common::V6_PROG_NEW_FLOW` or `V6_PROG_NEW_FLOW_TRACED`); without one there, to the kernel, counted.
#[inline(always)]
pub fn xdp_after_ipv6(ctx: &XdpContext, v: Verdict, slot: u32) -> u32 {
    match v {
        Verdict::NewFlow => {
            // SAFETY: as in `xdp_after_ipv4`.
            unsafe { V6_PROGS_XDP.tail_call(ctx, slot) };
            count(stat::PASS_NO_IPV6_PROGRAM);
            xdp_action::XDP_PASS
        }
        v => xdp_verdict(v),
    }
}

/// The XDP action of a final verdict.
#[inline(always)]
pub fn xdp_verdict(v: Verdict) -> u32 {
    match v {
        Verdict::Pass | Verdict::Ipv6 | Verdict::NewFlow => xdp_action::XDP_PASS,
        Verdict::Drop => xdp_action::XDP_DROP,
        Verdict::Tx => xdp_action::XDP_TX,
    }
}
