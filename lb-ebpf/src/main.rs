//! The load balancer's entry points: XDP (the fast path) and TC ingress via tcx (keeps GSO/GRO
//! super-packets intact). Both run the same logic, [`lb_ebpf::process::process`]; `lbctl trace` swaps in the
//! `*_trace` variants, the same logic reporting each packet ([`lb_ebpf::trace`]), while it runs.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod programs {
    use aya_ebpf::{
        bindings::{xdp_action, TC_ACT_OK, TC_ACT_SHOT},
        helpers::bpf_redirect,
        macros::{classifier, xdp},
        programs::{TcContext, XdpContext},
    };
    use lb_ebpf::{
        ctx::{Tc, Verdict, Xdp},
        process::process,
        trace::traced,
    };

    /// XDP entry point: attach natively to the LB interface.
    #[xdp]
    pub fn lb_xdp(ctx: XdpContext) -> u32 {
        xdp_action(process(&Xdp(&ctx)))
    }

    /// [`lb_xdp`] with `lbctl trace`'s report (swapped onto the link only while a trace runs).
    #[xdp]
    pub fn lb_xdp_trace(ctx: XdpContext) -> u32 {
        xdp_action(traced(&Xdp(&ctx)))
    }

    #[inline(always)]
    fn xdp_action(v: Verdict) -> u32 {
        match v {
            Verdict::Pass => xdp_action::XDP_PASS,
            Verdict::Drop => xdp_action::XDP_DROP,
            Verdict::Tx => xdp_action::XDP_TX,
        }
    }

    /// Headers the logic may read directly: Ethernet + IPv4 with options + ICMP + inner IPv4 + inner ports.
    const HEADERS: u32 = 14 + 60 + 8 + 20 + 20;

    /// TC ingress entry point (tcx): for interfaces where super-packets matter more than per-packet cost.
    #[classifier]
    pub fn lb_tc(ctx: TcContext) -> i32 {
        linear_headers(&ctx);
        tc_action(&ctx, process(&Tc(&ctx)))
    }

    /// [`lb_tc`] with `lbctl trace`'s report (swapped onto the link only while a trace runs).
    #[classifier]
    pub fn lb_tc_trace(ctx: TcContext) -> i32 {
        linear_headers(&ctx);
        tc_action(&ctx, traced(&Tc(&ctx)))
    }

    /// GRO'd skbs may hold headers in paged data; direct access needs them linear.
    #[inline(always)]
    fn linear_headers(ctx: &TcContext) {
        let want = if ctx.len() < HEADERS {
            ctx.len()
        } else {
            HEADERS
        };
        if ((ctx.data_end() - ctx.data()) as u32) < want {
            let _ = ctx.pull_data(want);
        }
    }

    #[inline(always)]
    fn tc_action(ctx: &TcContext, v: Verdict) -> i32 {
        match v {
            Verdict::Pass => TC_ACT_OK,
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
