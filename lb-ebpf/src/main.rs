//! The load balancer's entry points: XDP (the fast path) and TC ingress via tcx (keeps GSO/GRO
//! super-packets intact). Both run the same logic, [`lb_ebpf::process::process`]; `lbctl trace` swaps in the
//! `*_trace` variants, the same logic reporting each packet ([`lb_ebpf::trace`]), while it runs.
//!
//! IPv6 has programs of its own (`*6`), reached by tail call through `V6_PROGS_XDP` / `V6_PROGS_TC`: both
//! families in one program would exceed the verifier's budget. A packet that opens an IPv6 flow goes on, by a
//! second tail call, to the new-flow program (`*6_new`): with IPv6's keys the lookups and the new-flow path do not
//! fit one 512-byte stack. The tail calls are made here, in the entry functions (the XDP ones through
//! [`lb_ebpf::entry`], inlined, which the benchmark wrappers share): the verifier restricts tail calls from
//! subprograms.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod programs {
    use aya_ebpf::{
        bindings::{TC_ACT_OK, TC_ACT_SHOT},
        helpers::bpf_redirect,
        macros::{classifier, xdp},
        programs::{TcContext, XdpContext},
    };
    use lb_common::{
        stat, V6_PROG_FAST, V6_PROG_NEW_FLOW, V6_PROG_NEW_FLOW_TRACED, V6_PROG_TRACED,
    };
    use lb_ebpf::{
        ctx::{Tc, Verdict, Xdp},
        entry::{xdp_after_ipv4, xdp_after_ipv6, xdp_verdict},
        ipv6::{new_flow6, process6},
        maps::{count, V6_PROGS_TC},
        process::process,
        trace::{traced, traced6, traced6_new},
    };

    /// XDP entry point: attach natively to the LB interface.
    #[xdp]
    pub fn lb_xdp(ctx: XdpContext) -> u32 {
        xdp_after_ipv4(&ctx, process(&Xdp(&ctx)), V6_PROG_FAST)
    }

    /// [`lb_xdp`] with `lbctl trace`'s report (swapped onto the link only while a trace runs).
    #[xdp]
    pub fn lb_xdp_trace(ctx: XdpContext) -> u32 {
        xdp_after_ipv4(&ctx, traced(&Xdp(&ctx)), V6_PROG_TRACED)
    }

    /// The IPv6 XDP program (slot `V6_PROG_FAST` of `V6_PROGS_XDP`).
    #[xdp]
    pub fn lb_xdp6(ctx: XdpContext) -> u32 {
        xdp_after_ipv6(&ctx, process6(&Xdp(&ctx)), V6_PROG_NEW_FLOW)
    }

    /// [`lb_xdp6`] with `lbctl trace`'s report (slot `V6_PROG_TRACED`).
    #[xdp]
    pub fn lb_xdp6_trace(ctx: XdpContext) -> u32 {
        xdp_after_ipv6(&ctx, traced6(&Xdp(&ctx)), V6_PROG_NEW_FLOW_TRACED)
    }

    /// The IPv6 XDP new-flow program (slot `V6_PROG_NEW_FLOW`).
    #[xdp]
    pub fn lb_xdp6_new(ctx: XdpContext) -> u32 {
        xdp_verdict(new_flow6(&Xdp(&ctx)))
    }

    /// [`lb_xdp6_new`] with `lbctl trace`'s report (slot `V6_PROG_NEW_FLOW_TRACED`).
    #[xdp]
    pub fn lb_xdp6_new_trace(ctx: XdpContext) -> u32 {
        xdp_verdict(traced6_new(&Xdp(&ctx)))
    }

    /// Headers the logic may read directly: Ethernet + IPv4 with options + ICMP + inner IPv4 + inner ports.
    const HEADERS: u32 = 14 + 60 + 8 + 20 + 20;
    /// The same for IPv6: Ethernet + IPv6 + walked extension headers (typically small) + ICMPv6 + inner IPv6 +
    /// inner ports.
    const HEADERS6: u32 = 14 + 40 + 64 + 8 + 40 + 20;

    /// TC ingress entry point (tcx): for interfaces where super-packets matter more than per-packet cost.
    #[classifier]
    pub fn lb_tc(ctx: TcContext) -> i32 {
        linear_headers(&ctx, HEADERS);
        match process(&Tc(&ctx)) {
            Verdict::Ipv6 => {
                // SAFETY: as in `lb_xdp`.
                unsafe { V6_PROGS_TC.tail_call(&ctx, V6_PROG_FAST) };
                count(stat::PASS_NO_IPV6_PROGRAM);
                TC_ACT_OK
            }
            v => tc_action(&ctx, v),
        }
    }

    /// [`lb_tc`] with `lbctl trace`'s report (swapped onto the link only while a trace runs).
    #[classifier]
    pub fn lb_tc_trace(ctx: TcContext) -> i32 {
        linear_headers(&ctx, HEADERS);
        match traced(&Tc(&ctx)) {
            Verdict::Ipv6 => {
                // SAFETY: as in `lb_xdp`.
                unsafe { V6_PROGS_TC.tail_call(&ctx, V6_PROG_TRACED) };
                count(stat::PASS_NO_IPV6_PROGRAM);
                TC_ACT_OK
            }
            v => tc_action(&ctx, v),
        }
    }

    /// The IPv6 TC program (slot `V6_PROG_FAST` of `V6_PROGS_TC`).
    #[classifier]
    pub fn lb_tc6(ctx: TcContext) -> i32 {
        linear_headers(&ctx, HEADERS6);
        match process6(&Tc(&ctx)) {
            Verdict::NewFlow => {
                // SAFETY: as in `lb_xdp`.
                unsafe { V6_PROGS_TC.tail_call(&ctx, V6_PROG_NEW_FLOW) };
                count(stat::PASS_NO_IPV6_PROGRAM);
                TC_ACT_OK
            }
            v => tc_action(&ctx, v),
        }
    }

    /// [`lb_tc6`] with `lbctl trace`'s report (slot `V6_PROG_TRACED`).
    #[classifier]
    pub fn lb_tc6_trace(ctx: TcContext) -> i32 {
        linear_headers(&ctx, HEADERS6);
        match traced6(&Tc(&ctx)) {
            Verdict::NewFlow => {
                // SAFETY: as in `lb_xdp`.
                unsafe { V6_PROGS_TC.tail_call(&ctx, V6_PROG_NEW_FLOW_TRACED) };
                count(stat::PASS_NO_IPV6_PROGRAM);
                TC_ACT_OK
            }
            v => tc_action(&ctx, v),
        }
    }

    /// The IPv6 TC new-flow program (slot `V6_PROG_NEW_FLOW`; the headers were made linear by `lb_tc6`).
    #[classifier]
    pub fn lb_tc6_new(ctx: TcContext) -> i32 {
        tc_action(&ctx, new_flow6(&Tc(&ctx)))
    }

    /// [`lb_tc6_new`] with `lbctl trace`'s report (slot `V6_PROG_NEW_FLOW_TRACED`).
    #[classifier]
    pub fn lb_tc6_new_trace(ctx: TcContext) -> i32 {
        tc_action(&ctx, traced6_new(&Tc(&ctx)))
    }

    /// GRO'd skbs may hold headers in paged data; direct access needs them linear.
    #[inline(always)]
    fn linear_headers(ctx: &TcContext, headers: u32) {
        let want = if ctx.len() < headers {
            ctx.len()
        } else {
            headers
        };
        if ((ctx.data_end() - ctx.data()) as u32) < want {
            let _ = ctx.pull_data(want);
        }
    }

    #[inline(always)]
    fn tc_action(ctx: &TcContext, v: Verdict) -> i32 {
        match v {
            Verdict::Pass | Verdict::Ipv6 | Verdict::NewFlow => TC_ACT_OK,
            Verdict::Drop => TC_ACT_SHOT,
            Verdict::Tx => {
                let ifindex = unsafe { (*ctx.skb.skb).ifindex };
                unsafe { bpf_redirect(ifindex, 0) as i32 }
            }
        }
    }

    #[panic_handler]
    fn panic(_info: &core::panic::PanicInfo) -> ! {
        loop {}
    }
}

#[cfg(not(target_arch = "bpf"))]
fn main() {
    // Built for bpfel-unknown-none only (`cargo xtask build-ebpf`); this stub lets host tooling (clippy) work.
}
