//! The load balancer's packet logic, shared by the XDP and TC entry points (`src/main.rs`) and by the
//! benchmark wrappers (`src/bin/lb-bench.rs`).
//!
//! One implementation, two attach points: [`nat::process`] is generic over [`ctx::Ctx`], which supplies the
//! packet bounds and the one operation that differs between hooks (updating a TCP/UDP checksum: plain
//! arithmetic in XDP, the kernel's checksum helpers in TC, which also handle partially offloaded checksums of
//! GSO super-packets).
#![no_std]

pub mod csum;
pub mod ctx;
pub mod hdr;
pub mod maps;
pub mod nat;
pub mod syn_guard;
pub mod transient;
