//! Test-only `XDP_PASS` program, no maps. Test topologies attach it to the bridge side of the veth whose other
//! end runs the load balancer natively: veth hands `XDP_TX` frames only to a peer that has an XDP program
//! (its NAPI is otherwise never woken for them). Real NICs need nothing like it.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod programs {
    use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};

    /// Passes every frame to the kernel.
    #[xdp]
    pub fn xdp_pass(_ctx: XdpContext) -> u32 {
        xdp_action::XDP_PASS
    }

    #[panic_handler]
    fn panic(_info: &core::panic::PanicInfo) -> ! {
        loop {}
    }
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}
