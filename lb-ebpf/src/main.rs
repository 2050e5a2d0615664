//! The load balancer's entry points: XDP (the fast path) and TC ingress via tcx (keeps GSO/GRO
//! super-packets intact). Both run the same logic, [`lb_ebpf::process::process`]; `lbctl trace` swaps in the
//! `*_trace` variants, the same logic reporting each packet ([`lb_ebpf::trace`]), while it runs.
//!
//! IPv6 has programs of its own (`*6`), reached by tail call through `V6_PROGS_XDP` / `V6_PROGS_TC`: both
//! families in one program would exceed the verifier's budget. A packet that opens an IPv6 flow goes on, by a
//! second tail call, to the new-flow program (`*6_new`): with IPv6's keys the lookups and the new-flow path do not
//! fit one 512-byte stack. The tail calls are made here, in the entry functions (through
//! [`lb_ebpf::entry`], inlined, which the benchmark wrappers share): the verifier restricts tail calls from
//! subprograms.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod programs {
    use aya_ebpf::{
        macros::{classifier, xdp},
        programs::{TcContext, XdpContext},
    };
    use lb_common::{V6_PROG_FAST, V6_PROG_NEW_FLOW, V6_PROG_NEW_FLOW_TRACED, V6_PROG_TRACED};
    use lb_ebpf::{
        ctx::{Tc, Xdp},
        entry::{linear_headers, tc_next, tc_verdict, xdp_next, xdp_verdict, HEADERS, HEADERS6},
        ipv6::{new_flow6, process6},
        process::process,
        trace::{traced, traced6, traced6_new},
    };

    /// XDP entry point: attach natively to the LB interface.
    #[xdp]
    pub fn lb_xdp(ctx: XdpContext) -> u32 {
        xdp_next(&ctx, process(&Xdp(&ctx)), V6_PROG_FAST)
    }

    /// [`lb_xdp`] with `lbctl trace`'s report (swapped onto the link only while a trace runs).
    #[xdp]
    pub fn lb_xdp_trace(ctx: XdpContext) -> u32 {
        xdp_next(&ctx, traced(&Xdp(&ctx)), V6_PROG_TRACED)
    }

    /// The IPv6 XDP program (slot `V6_PROG_FAST` of `V6_PROGS_XDP`).
    #[xdp]
    pub fn lb_xdp6(ctx: XdpContext) -> u32 {
        xdp_next(&ctx, process6(&Xdp(&ctx)), V6_PROG_NEW_FLOW)
    }

    /// [`lb_xdp6`] with `lbctl trace`'s report (slot `V6_PROG_TRACED`).
    #[xdp]
    pub fn lb_xdp6_trace(ctx: XdpContext) -> u32 {
        xdp_next(&ctx, traced6(&Xdp(&ctx)), V6_PROG_NEW_FLOW_TRACED)
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

    /// TC ingress entry point (tcx): for interfaces where super-packets matter more than per-packet cost.
    #[classifier]
    pub fn lb_tc(ctx: TcContext) -> i32 {
        linear_headers(&ctx, HEADERS);
        tc_next(&ctx, process(&Tc(&ctx)), V6_PROG_FAST)
    }

    /// [`lb_tc`] with `lbctl trace`'s report (swapped onto the link only while a trace runs).
    #[classifier]
    pub fn lb_tc_trace(ctx: TcContext) -> i32 {
        linear_headers(&ctx, HEADERS);
        tc_next(&ctx, traced(&Tc(&ctx)), V6_PROG_TRACED)
    }

    /// The IPv6 TC program (slot `V6_PROG_FAST` of `V6_PROGS_TC`).
    #[classifier]
    pub fn lb_tc6(ctx: TcContext) -> i32 {
        linear_headers(&ctx, HEADERS6);
        tc_next(&ctx, process6(&Tc(&ctx)), V6_PROG_NEW_FLOW)
    }

    /// [`lb_tc6`] with `lbctl trace`'s report (slot `V6_PROG_TRACED`).
    #[classifier]
    pub fn lb_tc6_trace(ctx: TcContext) -> i32 {
        linear_headers(&ctx, HEADERS6);
        tc_next(&ctx, traced6(&Tc(&ctx)), V6_PROG_NEW_FLOW_TRACED)
    }

    /// The IPv6 TC new-flow program (slot `V6_PROG_NEW_FLOW`; the headers were made linear by `lb_tc6`).
    #[classifier]
    pub fn lb_tc6_new(ctx: TcContext) -> i32 {
        tc_verdict(&ctx, new_flow6(&Tc(&ctx)))
    }

    /// [`lb_tc6_new`] with `lbctl trace`'s report (slot `V6_PROG_NEW_FLOW_TRACED`).
    #[classifier]
    pub fn lb_tc6_new_trace(ctx: TcContext) -> i32 {
        tc_verdict(&ctx, traced6_new(&Tc(&ctx)))
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
