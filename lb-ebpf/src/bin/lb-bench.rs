//! Test-only programs for `cargo xtask bench dataplane` (never attached by the agent).
//!
//! `BPF_PROG_TEST_RUN` with `repeat` reuses one buffer, and the load balancer rewrites it, so every repeat
//! after the first would see a NATed packet. The wrappers copy a template packet into the frame first;
//! `bench_restore` measures that copy alone so the report can subtract it.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod programs {
    use aya_ebpf::{
        bindings::xdp_action,
        macros::{map, xdp},
        maps::Array,
        programs::XdpContext,
    };
    use lb_ebpf::{
        ctx::{l4_csum_arith, ptr_at, Ctx},
        hdr::EthHdr,
        nat::{process, Verdict},
    };

    /// Bytes of the template packet (every benchmark frame has exactly this size).
    const FRAME: usize = 64;

    /// The template packet and its options.
    #[repr(C)]
    pub struct BenchPacket {
        /// Non-zero: write a per-repeat counter into the source port and address, so every repeat is a
        /// new flow (for the new-flow benchmark).
        pub vary: u32,
        /// Per-repeat counter.
        pub counter: u32,
        /// The frame.
        pub data: [u8; FRAME],
    }

    #[map]
    static BENCH: Array<BenchPacket> = Array::with_max_entries(1, 0);

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

    #[inline(always)]
    fn restore(ctx: &XdpContext) -> bool {
        let Some(t) = BENCH.get_ptr_mut(0) else {
            return false;
        };
        let Some(dst) = ptr_at::<Xdp, [u8; FRAME]>(&Xdp(ctx), 0) else {
            return false;
        };
        unsafe {
            core::ptr::copy_nonoverlapping(&(*t).data, dst, 1);
            if (*t).vary != 0 {
                let n = (*t).counter;
                (*t).counter = n.wrapping_add(1);
                let d = dst as *mut u8;
                // IPv4 source address bytes 2..4 and the L4 source port (no options in bench frames).
                *d.add(28) = (n >> 24) as u8;
                *d.add(29) = (n >> 16) as u8;
                *d.add(34) = (n >> 8) as u8;
                *d.add(35) = n as u8;
            }
        }
        true
    }

    /// Bare `XDP_TX`.
    #[xdp]
    pub fn bench_tx(_ctx: XdpContext) -> u32 {
        xdp_action::XDP_TX
    }

    /// The reference: swap MACs, send back.
    #[xdp]
    pub fn bench_reflect(ctx: XdpContext) -> u32 {
        if let Some(eth) = ptr_at::<Xdp, EthHdr>(&Xdp(&ctx), 0) {
            unsafe {
                let d = (*eth).dst;
                (*eth).dst = (*eth).src;
                (*eth).src = d;
            }
        }
        xdp_action::XDP_TX
    }

    /// The restore step alone.
    #[xdp]
    pub fn bench_restore(ctx: XdpContext) -> u32 {
        if !restore(&ctx) {
            return xdp_action::XDP_ABORTED;
        }
        xdp_action::XDP_TX
    }

    /// Restore, then the load balancer.
    #[xdp]
    pub fn bench_lb(ctx: XdpContext) -> u32 {
        if !restore(&ctx) {
            return xdp_action::XDP_ABORTED;
        }
        match process(&Xdp(&ctx)) {
            Verdict::Pass => xdp_action::XDP_PASS,
            Verdict::Drop => xdp_action::XDP_DROP,
            Verdict::Tx => xdp_action::XDP_TX,
        }
    }

    #[panic_handler]
    fn panic(_info: &core::panic::PanicInfo) -> ! {
        loop {}
    }
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}
