//! The load balancer's packet logic, shared by the XDP and TC entry points (`src/main.rs`) and by the
//! benchmark wrappers (`src/bin/lb-bench.rs`).
//!
//! One implementation, two attach points: [`process::process`] is generic over [`ctx::Ctx`], which supplies the
//! packet bounds and the one operation that differs between hooks (updating a TCP/UDP checksum: plain
//! arithmetic in XDP, the kernel's checksum helpers in TC, which also handle partially offloaded checksums of
//! GSO super-packets).
#![cfg_attr(not(test), no_std)]
// `core::intrinsics::atomic_or` (see `flow_filter`); the BPF build is on nightly anyway (`-Z build-std`).
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

pub mod conntrack;
pub mod csum;
pub mod ctx;
pub mod entry;
pub mod family;
pub mod flow_filter;
pub mod hash;
pub mod hdr;
pub mod icmp;
pub mod ipv6;
pub mod klog;
pub mod lb;
pub mod maps;
pub mod nat;
pub mod packet;
pub mod process;
pub mod proxy;
pub mod reset;
pub mod snat;
pub mod syn_guard;
pub mod trace;
pub mod transient;
