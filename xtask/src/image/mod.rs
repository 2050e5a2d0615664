//! `cargo xtask image build|boot-test`: the load-balancer VM image (Debian 12) for OpenStack and a boot test
//! of it in QEMU with the user data lb-controller generates. Recipe inputs live in `image/` (see its
//! README.md); everything built goes to `target/image/`.
//!
//! - [`rootfs`]: the root filesystem from Debian packages (mmdebstrap), cached by a hash of its inputs;
//! - [`disk`]: the bootable disk (GPT, GRUB for BIOS and UEFI, ext4 made from the directory) without
//!   mounting anything or using loop devices;
//! - [`boot_test`]: boots it with the user data from a NoCloud seed or a metadata service and checks what the VM
//!   reports on its serial console.
//!
//! `cargo xtask image controller` is the other image: lb-controller's OCI image ([`controller`], [`oci`]).

mod boot_test;
pub mod controller;
mod disk;
mod oci;
mod rootfs;

use crate::util::root;
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;

/// `cargo xtask image …`
#[derive(Subcommand)]
pub enum ImageCmd {
    /// Build target/image/lb-vm.qcow2 (root filesystem cached under target/image/cache/).
    Build(BuildArgs),
    /// Boot the built image in QEMU with lb-controller's user data (BIOS: NoCloud seed, UEFI: metadata service) and
    /// yawol-controller's, and check the VM.
    BootTest(boot_test::BootTestArgs),
    /// Build lb-controller's OCI image (static binary, empty root) into target/image/controller/.
    Controller(controller::ControllerArgs),
}

/// Options of `cargo xtask image build`.
#[derive(Args)]
pub struct BuildArgs {
    /// Rebuild the root filesystem even if its inputs did not change (e.g. to pick up Debian security updates).
    #[arg(long)]
    refresh: bool,
    /// Keep the raw disk next to the qcow2 (target/image/lb-vm.raw, sparse).
    #[arg(long)]
    keep_raw: bool,
}

/// Runs an image command.
pub fn run(cmd: ImageCmd) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        anyhow::bail!(
            "cargo xtask image needs root (chroot for the package installation, KVM; the controller image's file owners)"
        );
    }
    match cmd {
        ImageCmd::Build(args) => build(&args),
        ImageCmd::BootTest(args) => boot_test::boot_test(&args),
        ImageCmd::Controller(args) => controller::build(&args).map(|_| ()),
    }
}

/// The `vm-image` stage of `cargo xtask test`: builds the image (root filesystem from the cache when its inputs did
/// not change) and boots it with BIOS and UEFI, KVM when it works here, else TCG.
pub fn test_stage() -> Result<()> {
    build(&BuildArgs {
        refresh: false,
        keep_raw: false,
    })?;
    boot_test::boot_test(&boot_test::BootTestArgs::default())
}

/// The recipe's inputs: `image/` in the workspace.
fn recipe_dir() -> PathBuf {
    root().join("image")
}

/// Where everything built goes: `target/image/`.
fn out_dir() -> PathBuf {
    root().join("target").join("image")
}

/// The image `build` produces and `boot-test` boots.
fn image_path() -> PathBuf {
    out_dir().join("lb-vm.qcow2")
}

fn build(args: &BuildArgs) -> Result<()> {
    crate::prereq::debian_packages(crate::prereq::IMAGE_BUILD_PACKAGES)?;
    let t = std::time::Instant::now();
    let rootfs = rootfs::ensure(args.refresh)?;
    let agent = rootfs::build_agent()?;
    let disk = disk::assemble(&rootfs, &agent, args.keep_raw)?;
    let total = t.elapsed().as_secs_f64();
    let report = serde_json::json!({
        "image": disk.qcow2,
        "image_bytes": disk.qcow2_bytes,
        "virtual_bytes": disk.virtual_bytes,
        "root_fs_used_mib": disk.used_mib,
        "kernel": disk.kernel,
        "rootfs_cache_key": rootfs.key,
        "rootfs_cached": rootfs.cached,
        "seconds_rootfs": rootfs.seconds,
        "seconds_agent": agent.seconds,
        "seconds_disk": disk.seconds,
        "seconds_total": total,
    });
    write_report("build", &report)?;
    println!(
        "image: {} ({:.0} MiB, virtual {:.0} MiB, {} root filesystem {} MiB used, kernel {})",
        disk.qcow2.display(),
        mib(disk.qcow2_bytes),
        mib(disk.virtual_bytes),
        if rootfs.cached { "cached" } else { "new" },
        disk.used_mib,
        disk.kernel
    );
    println!(
        "build: {total:.1}s (root filesystem {:.1}s, agent {:.1}s, disk {:.1}s); report in {}",
        rootfs.seconds,
        agent.seconds,
        disk.seconds,
        out_dir().join("report.json").display()
    );
    Ok(())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Sets `section` of target/image/report.json, keeping the other sections.
fn write_report(section: &str, value: &serde_json::Value) -> Result<()> {
    let path = out_dir().join("report.json");
    let mut doc: serde_json::Value = std::fs::read_to_string(&path)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .filter(serde_json::Value::is_object)
        .unwrap_or_else(|| serde_json::json!({}));
    doc[section] = value.clone();
    std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("writing {}", path.display()))
}
