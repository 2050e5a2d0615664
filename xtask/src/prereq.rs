//! Machine prerequisites the project installs itself (a fresh Debian machine has none of them).

use crate::util::run;
use anyhow::{Context, Result};
use std::process::Command;

/// Debian packages the network-namespace tests and the demo use: `ip` (iproute2) and `ethtool` (to turn
/// off TX checksum offload on test veths, so frames carry real checksums as on a wire), and `keepalived` (VRRP
/// of the HA tests, supervised by the agent as on the load-balancer VMs).
pub const NETNS_PACKAGES: &[&str] = &["iproute2", "ethtool", "keepalived"];

/// Debian packages `cargo xtask image build` uses: mmdebstrap (the root filesystem), sfdisk (fdisk), mkfs.vfat
/// (dosfstools) and mtools (the ESP without mounting it), GRUB's BIOS and UEFI images (grub-pc-bin,
/// grub-efi-amd64-bin: only the binaries, nothing is installed on this machine's boot path), mkfs.ext4 -d
/// (e2fsprogs), strip (binutils), qemu-img (qemu-utils).
pub const IMAGE_BUILD_PACKAGES: &[&str] = &[
    "mmdebstrap",
    "fdisk",
    "dosfstools",
    "mtools",
    "grub-pc-bin",
    "grub-efi-amd64-bin",
    "e2fsprogs",
    "binutils",
    "qemu-utils",
];

/// Debian packages `cargo xtask image boot-test` uses: QEMU, OVMF (UEFI firmware), mtools and dosfstools (the
/// NoCloud seed), openssl (the test CA).
pub const IMAGE_TEST_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "ovmf",
    "qemu-utils",
    "mtools",
    "dosfstools",
    "openssl",
];

/// Installs the Debian packages that are missing (one `apt-get update` first).
pub fn debian_packages(pkgs: &[&str]) -> Result<()> {
    let missing: Vec<&str> = pkgs
        .iter()
        .copied()
        .filter(|p| {
            !Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", p])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
                .unwrap_or(false)
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("installing Debian packages: {}", missing.join(" "));
    run(
        Command::new("apt-get").args(["update", "-qq"]),
        "apt-get update (are Debian's package mirrors reachable?)",
    )?;
    run(
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
        "apt-get install",
    )
}

/// Mounts bpffs at /sys/fs/bpf when it is not (pinning needs it).
pub fn bpffs() -> Result<()> {
    let mounts = std::fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    if mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf"))
    {
        return Ok(());
    }
    std::fs::create_dir_all("/sys/fs/bpf")?;
    run(
        Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]),
        "mounting bpffs at /sys/fs/bpf (needs root)",
    )
}

/// Everything the tests and the demo need on the machine.
pub fn all() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        anyhow::bail!(
            "the tests and the demo load eBPF programs and create network namespaces: run as root"
        );
    }
    debian_packages(NETNS_PACKAGES)?;
    bpffs()
}
