//! Test-only programs for `cargo xtask bench dataplane` (never attached by the agent).
//!
//! `BPF_PROG_TEST_RUN` with `repeat` reuses one buffer, and the load balancer rewrites it, so every repeat
//! after the first would see a NATed packet. The wrappers copy a template packet into the frame first;
//! `bench_restore` measures that copy alone so the report can subtract it. A case that grows the frame at its
//! front (the PROXY header's insertion) has it moved back first, by one `bpf_xdp_adjust_head` that the
//! subtraction does not cover.
//!
//! IPv6 takes the product's path, so that its cases cost what a real IPv6 packet costs: `bench_lb` runs `lb_xdp`'s
//! logic (`process`, then `lb_ebpf::entry::xdp_next`), whose `Verdict::Ipv6` tail-calls slot `V6_PROG_FAST`
//! of `V6_PROGS_XDP`, and that program tail-calls slot `V6_PROG_NEW_FLOW` for a new flow. The two IPv6 programs
//! below are the product's (`lb_xdp6`, `lb_xdp6_new` of `src/main.rs`: same names, same library code), built into
//! this object, and the benchmark fills this object's program array as the agent fills lb.o's
//! (`Dataplane::load_ipv6_programs`). Why so: a wrapper calling `process6` directly would leave out the IPv4 entry
//! logic and both tail calls, part of what IPv6 costs; lb.o's own programs, loaded beside, would work on lb.o's
//! maps, not on the ones the benchmark fills (sharing them would take pinning both objects' maps). The restore
//! runs once, in `bench_lb`, before the tail calls.
//!
//! `storm_gen` is the netns e2e's malformed-frame storm (`lb-testbed stormgen`), a live-frames generator too.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod programs {
    use aya_ebpf::{
        bindings::xdp_action,
        helpers::bpf_xdp_adjust_head,
        macros::{map, xdp},
        maps::{Array, DevMap, PerCpuArray},
        programs::XdpContext,
    };
    use lb_common::{V6_PROG_FAST, V6_PROG_NEW_FLOW};
    use lb_ebpf::{
        ctx::{ptr_at, Xdp},
        entry::{xdp_next, xdp_verdict},
        hdr::EthHdr,
        ipv6::{new_flow6, process6},
        process::process,
    };

    /// Bytes of an IPv4 template packet and of every generated frame (`bench_gen`).
    const FRAME: usize = 64;
    /// Bytes of an IPv6 template packet: the IPv4 one's headers and payload, with IPv6's 20 more header bytes.
    const FRAME6: usize = 84;

    /// The template packet and its options.
    #[repr(C)]
    pub struct BenchPacket {
        /// Non-zero: write a per-repeat counter into the source port and address, so every repeat is a
        /// new flow (for the new-flow benchmark).
        pub vary: u32,
        /// Per-repeat counter.
        pub counter: u32,
        /// `FRAME6` for an IPv6 template (all of `data`), else an IPv4 one (the first `FRAME` bytes).
        pub len: u32,
        /// Padding.
        pub _pad: u32,
        /// The frame.
        pub data: [u8; FRAME6],
    }

    /// Per CPU: each thread of the scaling sweep (`bench-dataplane --threads`), pinned to its CPU, runs its own
    /// flows from its own template, and the per-repeat counter is no cache line the CPUs share.
    #[map]
    static BENCH: PerCpuArray<BenchPacket> = PerCpuArray::with_max_entries(1, 0);

    #[inline(always)]
    fn restore(ctx: &XdpContext) -> bool {
        let Some(t) = BENCH.get_ptr_mut(0) else {
            return false;
        };
        // SAFETY: `t` is the map's value; `dst` was bounds-checked for the bytes written.
        unsafe {
            // A case that grew the frame at its front (a PROXY header put in) left it that much longer: the next
            // repeat starts at the template's length again (one helper call, in those cases only).
            let grown = (ctx.data_end() - ctx.data()) as i64 - (*t).len as i64;
            if grown > 0 && bpf_xdp_adjust_head(ctx.ctx, grown as i32) != 0 {
                return false;
            }
            let n = (*t).counter;
            let vary = (*t).vary != 0;
            if vary {
                (*t).counter = n.wrapping_add(1);
            }
            if (*t).len == FRAME6 as u32 {
                let Some(dst) = ptr_at::<Xdp, [u8; FRAME6]>(&Xdp(ctx), 0) else {
                    return false;
                };
                core::ptr::copy_nonoverlapping(&(*t).data, dst, 1);
                if vary {
                    let d = dst as *mut u8;
                    // IPv6 source address bytes 14..16 and the L4 source port (no extension headers).
                    *d.add(36) = (n >> 24) as u8;
                    *d.add(37) = (n >> 16) as u8;
                    *d.add(54) = (n >> 8) as u8;
                    *d.add(55) = n as u8;
                }
            } else {
                let Some(dst) = ptr_at::<Xdp, [u8; FRAME]>(&Xdp(ctx), 0) else {
                    return false;
                };
                core::ptr::copy_nonoverlapping((*t).data.as_ptr() as *const [u8; FRAME], dst, 1);
                if vary {
                    let d = dst as *mut u8;
                    // IPv4 source address bytes 2..4 and the L4 source port (no options in bench frames).
                    *d.add(28) = (n >> 24) as u8;
                    *d.add(29) = (n >> 16) as u8;
                    *d.add(34) = (n >> 8) as u8;
                    *d.add(35) = n as u8;
                }
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

    /// Restore, then the load balancer's XDP entry logic (`lb_xdp`'s): IPv4 here, IPv6 by tail call.
    #[xdp]
    pub fn bench_lb(ctx: XdpContext) -> u32 {
        if !restore(&ctx) {
            return xdp_action::XDP_ABORTED;
        }
        xdp_next(&ctx, process(&Xdp(&ctx)), V6_PROG_FAST)
    }

    /// The product's IPv6 XDP program (slot `V6_PROG_FAST` of this object's `V6_PROGS_XDP`).
    #[xdp]
    pub fn lb_xdp6(ctx: XdpContext) -> u32 {
        xdp_next(&ctx, process6(&Xdp(&ctx)), V6_PROG_NEW_FLOW)
    }

    /// The product's IPv6 XDP new-flow program (slot `V6_PROG_NEW_FLOW`).
    #[xdp]
    pub fn lb_xdp6_new(ctx: XdpContext) -> u32 {
        xdp_verdict(new_flow6(&Xdp(&ctx)))
    }

    // ---- `cargo xtask bench pktgen`: live-frames generator, forwarders (same path, routed), sink counter ----

    /// Last 8 bytes of every generated frame: lets the forwarder and the sink tell benchmark frames from
    /// real traffic (health checks, ARP) that must keep flowing.
    const MAGIC: u64 = 0x4e45_4754_4b50_424c; // "LBPKTGEN" little-endian

    /// The generator's template and options.
    #[repr(C)]
    pub struct GenPacket {
        /// 0: cycle the source port over `mask + 1` ports from the template's; 1: a new flow every frame
        /// (source port and third octet of the source address from a counter).
        pub mode: u32,
        /// Port mask for mode 0 (a power of two minus one).
        pub mask: u32,
        /// Frame counter.
        pub counter: u32,
        /// Padding.
        pub _pad: u32,
        /// The frame.
        pub data: [u8; FRAME],
    }

    /// Per CPU: with `bench-pktgen --cpus N` a generator thread runs on each of N CPUs, each from its own
    /// template and counter (no cache line the generators share).
    #[map]
    static GEN: PerCpuArray<GenPacket> = PerCpuArray::with_max_entries(1, 0);

    /// Live-frames generator (`BPF_F_TEST_XDP_LIVE_FRAMES`): the kernel recycles frames without resetting
    /// them and the load balancer rewrites them downstream, so every run writes the whole frame from the
    /// template, then varies the source. Checksums are not fixed up: the sink counts, nobody verifies.
    #[xdp]
    pub fn bench_gen(ctx: XdpContext) -> u32 {
        let Some(t) = GEN.get_ptr_mut(0) else {
            return xdp_action::XDP_ABORTED;
        };
        let Some(dst) = ptr_at::<Xdp, [u8; FRAME]>(&Xdp(&ctx), 0) else {
            return xdp_action::XDP_ABORTED;
        };
        unsafe {
            core::ptr::copy_nonoverlapping(&(*t).data, dst, 1);
            let n = (*t).counter;
            (*t).counter = n.wrapping_add(1);
            let d = dst as *mut u8;
            if (*t).mode == 1 {
                *d.add(28) = (n >> 16) as u8;
                *d.add(34) = (n >> 8) as u8;
                *d.add(35) = n as u8;
            } else {
                let base = ((*d.add(34) as u32) << 8) | *d.add(35) as u32;
                let port = base.wrapping_add(n & (*t).mask);
                *d.add(34) = (port >> 8) as u8;
                *d.add(35) = port as u8;
            }
        }
        xdp_action::XDP_TX
    }

    #[inline(always)]
    fn is_bench_frame(ctx: &XdpContext) -> bool {
        if ctx.data_end() - ctx.data() != FRAME {
            return false;
        }
        match ptr_at::<Xdp, [u8; 8]>(&Xdp(ctx), FRAME - 8) {
            Some(p) => u64::from_le_bytes(unsafe { *p }) == MAGIC,
            None => false,
        }
    }

    /// Where the same-path forwarder sends frames.
    #[repr(C)]
    pub struct FwdCfg {
        /// Number of destinations (1..=4).
        pub n: u32,
        /// Padding.
        pub _pad: u32,
        /// Source MAC (the forwarder's own), padded to 8 bytes.
        pub src: [u8; 8],
        /// Destination MACs, padded to 8 bytes.
        pub dst: [[u8; 8]; 4],
    }

    #[map]
    static FWD: Array<FwdCfg> = Array::with_max_entries(1, 0);

    /// Rewrites a benchmark frame's MACs towards a backend chosen by source port (`FWD`): `Some(true)` when
    /// rewritten, `Some(false)` for a frame to pass (not the benchmark's, or no backend configured).
    #[inline(always)]
    fn fwd_rewrite(ctx: &XdpContext) -> Option<bool> {
        if !is_bench_frame(ctx) {
            return Some(false);
        }
        let c = FWD.get_ptr(0)?;
        let eth = ptr_at::<Xdp, EthHdr>(&Xdp(ctx), 0)?;
        let sp = ptr_at::<Xdp, [u8; 2]>(&Xdp(ctx), 34)?;
        unsafe {
            let n = (*c).n;
            if n == 0 {
                return Some(false);
            }
            let port = u16::from_be_bytes(*sp) as u32;
            let i = ((port % n) & 3) as usize;
            let m = &(*c).dst[i];
            (*eth).dst = [m[0], m[1], m[2], m[3], m[4], m[5]];
            let s = &(*c).src;
            (*eth).src = [s[0], s[1], s[2], s[3], s[4], s[5]];
        }
        Some(true)
    }

    /// The reference for the packet-rate benchmark: on the load balancer's interface, send benchmark frames
    /// back out to a backend chosen by source port, rewriting only the MACs (a bare `XDP_TX` forwarder on the
    /// same path as the load balancer). Everything else passes.
    #[xdp]
    pub fn bench_fwd(ctx: XdpContext) -> u32 {
        match fwd_rewrite(&ctx) {
            Some(true) => xdp_action::XDP_TX,
            Some(false) => xdp_action::XDP_PASS,
            None => xdp_action::XDP_ABORTED,
        }
    }

    /// The routed topology's egress interface for `bench_fwd_redir` (slot 0).
    #[map]
    static FWD_DEV: DevMap = DevMap::with_max_entries(1, 0);

    /// The routed reference: as `bench_fwd` (`FWD`'s source MAC is then the backend-side interface's), but out
    /// of the other interface by `XDP_REDIRECT` through a device map, as the load balancer's XDP programs do.
    /// Named in 15 characters: the kernel keeps no more of a name, and the benchmark finds its stats by name.
    #[xdp]
    pub fn bench_fwd_redir(ctx: XdpContext) -> u32 {
        match fwd_rewrite(&ctx) {
            Some(true) => FWD_DEV.redirect(0, 0).unwrap_or(xdp_action::XDP_ABORTED),
            Some(false) => xdp_action::XDP_PASS,
            None => xdp_action::XDP_ABORTED,
        }
    }

    #[map]
    static SINK: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

    /// On a backend's interface: counts and drops benchmark frames, passes everything else.
    #[xdp]
    pub fn bench_sink(ctx: XdpContext) -> u32 {
        if !is_bench_frame(&ctx) {
            return xdp_action::XDP_PASS;
        }
        if let Some(c) = SINK.get_ptr_mut(0) {
            unsafe { *c += 1 };
        }
        xdp_action::XDP_DROP
    }

    // ---- The netns e2e's malformed storm: live-frames generator cycling through frame templates ----

    /// Bytes of a storm template copied into the frame each run (every malformed kind's headers fit).
    const STORM_BYTES: usize = 128;
    /// Storm templates at most.
    const STORM_KINDS: u32 = 16;

    /// One storm frame: the first `STORM_BYTES` bytes and the frame's length. A longer frame's remaining
    /// bytes come from the test run's `data_in`, which the kernel copied into every live frame.
    #[repr(C)]
    pub struct StormTemplate {
        /// Frame length (≤ the test run's `data_in` length).
        pub len: u32,
        /// Padding.
        pub _pad: u32,
        /// The frame's first bytes.
        pub data: [u8; STORM_BYTES],
    }

    /// The storm generator's state.
    #[repr(C)]
    pub struct StormCfg {
        /// Templates in use (1..=`STORM_KINDS`).
        pub n: u32,
        /// Frame counter (one test run at a time, so no atomics).
        pub counter: u32,
    }

    #[map]
    static STORM: Array<StormTemplate> = Array::with_max_entries(STORM_KINDS, 0);
    #[map]
    static STORM_CFG: Array<StormCfg> = Array::with_max_entries(1, 0);
    /// Frames sent per template.
    #[map]
    static STORM_SENT: PerCpuArray<u64> = PerCpuArray::with_max_entries(STORM_KINDS, 0);

    /// Live-frames storm generator (`lb-testbed stormgen`): run i sends template `i % n` — its bytes copied
    /// over the frame, the frame trimmed to its length (the kernel restores a live frame's length before
    /// every run, not its bytes) — counts it, and `XDP_TX`es it.
    #[xdp]
    pub fn storm_gen(ctx: XdpContext) -> u32 {
        let Some(c) = STORM_CFG.get_ptr_mut(0) else {
            return xdp_action::XDP_ABORTED;
        };
        let (n, i) = unsafe { ((*c).n, (*c).counter) };
        if n == 0 {
            return xdp_action::XDP_ABORTED;
        }
        unsafe { (*c).counter = i.wrapping_add(1) };
        let k = i % n;
        let Some(t) = STORM.get_ptr(k) else {
            return xdp_action::XDP_ABORTED;
        };
        let Some(dst) = ptr_at::<Xdp, [u8; STORM_BYTES]>(&Xdp(&ctx), 0) else {
            return xdp_action::XDP_ABORTED;
        };
        let len = unsafe {
            core::ptr::copy_nonoverlapping(&(*t).data, dst, 1);
            (*t).len as i64
        };
        let cur = (ctx.data_end() - ctx.data()) as i64;
        if len > cur {
            return xdp_action::XDP_ABORTED;
        }
        if len < cur
            && unsafe { aya_ebpf::helpers::bpf_xdp_adjust_tail(ctx.ctx, (len - cur) as i32) } != 0
        {
            return xdp_action::XDP_ABORTED;
        }
        if let Some(s) = STORM_SENT.get_ptr_mut(k) {
            unsafe { *s += 1 };
        }
        xdp_action::XDP_TX
    }

    #[panic_handler]
    fn panic(_info: &core::panic::PanicInfo) -> ! {
        loop {}
    }
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}
