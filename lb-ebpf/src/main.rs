//! The load balancer's entry points: XDP (the fast path) and TC ingress via tcx (keeps GSO/GRO
//! super-packets intact). Both run the same logic, [`lb_ebpf::nat::process`].
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod programs {
    use aya_ebpf::{
        bindings::{xdp_action, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_OK, TC_ACT_SHOT},
        helpers::{bpf_l4_csum_replace, bpf_redirect},
        macros::{classifier, xdp},
        programs::{TcContext, XdpContext},
        EbpfContext,
    };
    use lb_ebpf::{
        ctx::{l4_csum_arith, Ctx},
        nat::{process, Verdict},
    };

    struct Xdp<'a>(&'a XdpContext);

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
        fn len(&self) -> usize {
            self.0.data_end() - self.0.data()
        }
        #[inline(always)]
        fn l4_csum(&self, _off: usize, p: *mut u16, addr: u32, port: u32, udp: bool) {
            l4_csum_arith(p, addr, port, udp)
        }
    }

    /// XDP entry point: attach natively to the LB interface.
    #[xdp]
    pub fn lb_xdp(ctx: XdpContext) -> u32 {
        match process(&Xdp(&ctx)) {
            Verdict::Pass => xdp_action::XDP_PASS,
            Verdict::Drop => xdp_action::XDP_DROP,
            Verdict::Tx => xdp_action::XDP_TX,
        }
    }

    struct Tc<'a>(&'a TcContext);

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
        fn len(&self) -> usize {
            self.0.len() as usize
        }
        #[inline(always)]
        fn l4_csum(&self, off: usize, _p: *mut u16, addr: u32, port: u32, udp: bool) {
            // The kernel helpers know whether the checksum is complete or only the pseudo-header part of
            // an offloaded (GSO) packet: addresses go in as pseudo-header changes, ports as payload.
            let mangled = if udp { BPF_F_MARK_MANGLED_0 as u64 } else { 0 };
            let skb = self.0.as_ptr().cast();
            unsafe {
                bpf_l4_csum_replace(skb, off as u32, 0, addr as u64, BPF_F_PSEUDO_HDR as u64 | mangled);
                bpf_l4_csum_replace(skb, off as u32, 0, port as u64, mangled);
            }
        }
    }

    /// Headers the logic may read directly: Ethernet + IPv4 with options + ICMP + inner IPv4 + inner ports.
    const HEADERS: u32 = 14 + 60 + 8 + 20 + 20;

    /// TC ingress entry point (tcx): for interfaces where super-packets matter more than per-packet cost.
    #[classifier]
    pub fn lb_tc(ctx: TcContext) -> i32 {
        let want = if ctx.len() < HEADERS { ctx.len() } else { HEADERS };
        if ((ctx.data_end() - ctx.data()) as u32) < want {
            // GRO'd skbs may hold headers in paged data; direct access needs them linear.
            let _ = ctx.pull_data(want);
        }
        match process(&Tc(&ctx)) {
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
