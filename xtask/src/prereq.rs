//! Machine prerequisites the project installs itself (a fresh Debian machine has none of them).

use crate::util::run;
use anyhow::{Context, Result};
use std::process::Command;

/// Debian packages the network-namespace tests and the demo use: `ip` (iproute2) and `ethtool` (to turn
/// off TX checksum offload on test veths, so frames carry real checksums as on a wire), and `keepalived` (VRRP
/// of the HA tests, supervised by the agent as on the load-balancer VMs).
pub const NETNS_PACKAGES: &[&str] = &["iproute2", "ethtool", "keepalived"];

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
