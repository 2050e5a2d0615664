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
    bpffs()?;
    target_hygiene()
}

/// Keeps `target/debug` from filling the disk (it did, on CI): when the `[profile.dev]` section of the workspace
/// manifest changed since the last build, every debug artifact is stale and is removed before the new ones are
/// built (cargo keeps the old ones otherwise); and `target/debug/incremental`, which only grows, is dropped when
/// it passes 10 GiB. Both cost one rebuild of what they remove, nothing else.
fn target_hygiene() -> Result<()> {
    let debug = crate::util::root().join("target/debug");
    let manifest = std::fs::read_to_string(crate::util::root().join("Cargo.toml"))?;
    let profile: String = manifest
        .lines()
        .skip_while(|l| l.trim() != "[profile.dev]")
        .take_while({
            let mut first = true;
            move |l| std::mem::take(&mut first) || !l.trim_start().starts_with('[')
        })
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let stamp = debug.join(".xtask-profile");
    let built_with = std::fs::read_to_string(&stamp).ok();
    if debug.exists() && built_with.as_deref() != Some(profile.as_str()) {
        eprintln!(
            "prerequisites: [profile.dev] changed since target/debug was built; removing the stale artifacts"
        );
        std::fs::remove_dir_all(&debug).context("removing target/debug")?;
    }
    let incremental = debug.join("incremental");
    let size = dir_size(&incremental);
    if size > 10 << 30 {
        eprintln!(
            "prerequisites: target/debug/incremental holds {:.1} GiB; removing it",
            size as f64 / (1u64 << 30) as f64
        );
        std::fs::remove_dir_all(&incremental).context("removing target/debug/incremental")?;
    }
    std::fs::create_dir_all(&debug)?;
    std::fs::write(&stamp, profile).context("writing target/debug/.xtask-profile")
}

/// Bytes in the files below `dir` (0 when it does not exist).
fn dir_size(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_size(&e.path()),
            _ => e.metadata().map(|m| m.len()).unwrap_or(0),
        })
        .sum()
}
