//! `cargo xtask image controller`: the OCI image of `lb-controller` — a static binary on an empty root (CA
//! certificates, `/etc/passwd` with the non-root user 65532, `nsswitch.conf`), no base image to pull — written to
//! `target/image/controller/` as an OCI layout (`oci/`) and an `oci-archive` (`lb-controller-oci.tar`).
//!
//! The binary: static glibc (`-C target-feature=+crt-static`) passed by `cargo rustc` to the final compile and link
//! only, so every dependency comes from the dev (or release) artifacts already built; a musl target would rebuild
//! the whole dependency graph for a second target (and needs musl-gcc for ring and aws-lc). Name resolution works
//! in the empty image: glibc ≥ 2.34 has its `files` and `dns` NSS modules inside libc, so a static binary reads
//! `/etc/hosts` and asks the servers of `/etc/resolv.conf` without loading any library (the controller-image stage
//! resolves the API server's name through a real DNS server to prove it).

use super::oci::{self, ImageConfig};
use crate::util::{output, root};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// Where the image goes: `target/image/controller/`.
pub fn out_dir() -> PathBuf {
    super::out_dir().join("controller")
}

/// The OCI layout `podman pull oci:<dir>` and `skopeo copy oci:<dir> docker://…` take.
pub fn layout_dir() -> PathBuf {
    out_dir().join("oci")
}

/// The non-root user the image runs as (distroless' `nonroot`).
const USER: u32 = 65532;
/// The binary's place in the image.
const BINARY: &str = "usr/local/bin/lb-controller";
/// Debian's bundle (ca-certificates), at the path Debian-based images and `rustls-native-certs` use.
const CA_BUNDLE: &str = "etc/ssl/certs/ca-certificates.crt";

/// Options of `cargo xtask image controller`.
#[derive(Args, Default)]
pub struct ControllerArgs {
    /// Build the binary in the release profile (the image to publish; a full optimised build of the dependency
    /// graph). Without it the dev profile's artifacts are reused, as in CI.
    #[arg(long)]
    pub release: bool,
    /// `org.opencontainers.image.source`; default: the git remote `origin`, else the workspace as a `git+file` URL.
    #[arg(long)]
    pub source: Option<String>,
}

/// What [`build`] made.
pub struct Built {
    pub layout: PathBuf,
    pub tag: String,
}

/// Builds the image (the command and the first step of the controller-image stage).
pub fn build(args: &ControllerArgs) -> Result<Built> {
    crate::prereq::debian_packages(crate::prereq::CONTROLLER_IMAGE_PACKAGES)?;
    let t = Instant::now();
    let binary = static_binary(args.release)?;
    let seconds_binary = t.elapsed().as_secs_f64();

    let t = Instant::now();
    let out = out_dir();
    std::fs::create_dir_all(&out)?;
    let rootfs = out.join("rootfs");
    assemble_rootfs(&binary, &rootfs)?;
    let version = binary_version(&rootfs.join(BINARY))?;
    let (created, epoch) = source_time()?;
    let revision = revision()?;
    let source = match &args.source {
        Some(s) => s.clone(),
        None => default_source()?,
    };
    let labels: BTreeMap<String, String> = [
        ("title", "lb-controller".to_string()),
        (
            "description",
            "Control plane of the XDP load balancer: cloud controller (`run`) and OpenStack-side controllers (`controller`)"
                .to_string(),
        ),
        ("version", version.clone()),
        ("revision", revision.clone()),
        ("source", source.clone()),
        ("created", created.clone()),
        ("licenses", "Apache-2.0".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (format!("org.opencontainers.image.{k}"), v))
    .collect();
    let config = ImageConfig {
        entrypoint: vec![format!("/{BINARY}")],
        user: format!("{USER}:{USER}"),
        env: vec![
            "PATH=/usr/local/bin".into(),
            format!("SSL_CERT_FILE=/{CA_BUNDLE}"),
            "HOME=/home/nonroot".into(),
        ],
        exposed_ports: vec![8080, 8081],
        labels,
        created,
        epoch,
        tag: version.clone(),
    };
    let layout = layout_dir();
    let written = oci::write_layout(&rootfs, &config, &layout)?;
    let archive = out.join("lb-controller-oci.tar");
    oci::archive(&layout, &archive, epoch)?;
    super::rootfs::remove_tree(&rootfs)?;
    let seconds_image = t.elapsed().as_secs_f64();

    let report = serde_json::json!({
        "layout": layout,
        "archive": archive,
        "tag": version,
        "manifest_digest": written.manifest_digest,
        "revision": revision,
        "source": source,
        "profile": if args.release { "release" } else { "dev" },
        "layer_bytes": written.layer_bytes,
        "rootfs_bytes": written.rootfs_bytes,
        "seconds_binary": seconds_binary,
        "seconds_image": seconds_image,
    });
    super::write_report("controller", &report)?;
    println!(
        "controller image: {} ({}, {}) {:.1} MiB compressed, {:.1} MiB unpacked; binary {:.1}s ({} profile), image {:.1}s",
        layout.display(),
        version,
        written.manifest_digest,
        super::mib(written.layer_bytes),
        super::mib(written.rootfs_bytes),
        seconds_binary,
        if args.release { "release" } else { "dev" },
        seconds_image,
    );
    println!(
        "  run it: podman run --rm oci:{}:{version} --help; archive: {}",
        layout.display(),
        archive.display()
    );
    Ok(Built {
        layout,
        tag: version,
    })
}

/// Builds `lb-controller` linked statically and returns a stripped copy under `target/image/controller/`.
///
/// `cargo rustc -p lb-controller` resolves features for lb-controller alone (not the whole workspace), so a few
/// dozen crates are compiled once more than the test stages' artifacts (≈ 50 s); its binary replaces
/// `target/debug/lb-controller` (an equivalent, static one). Another build on the same `target/` can put its own
/// binary back at that path between cargo's end and the copy: the copy is checked and the (then fresh, instant)
/// cargo call repeated.
fn static_binary(release: bool) -> Result<PathBuf> {
    let dest = out_dir().join("lb-controller");
    std::fs::create_dir_all(out_dir())?;
    for _attempt in 0..3 {
        let built = cargo_rustc_static(release)?;
        std::fs::copy(&built, &dest)
            .with_context(|| format!("copying {} to {}", built.display(), dest.display()))?;
        if !is_dynamic(&dest)? {
            crate::util::run(
                Command::new("strip").arg("--strip-all").arg(&dest),
                "strip lb-controller",
            )?;
            return Ok(dest);
        }
        eprintln!(
            "{} is dynamically linked: another build replaced it meanwhile; asking cargo again",
            built.display()
        );
    }
    bail!("could not get a static lb-controller from cargo (another build keeps replacing it)")
}

/// `cargo rustc … -- -C target-feature=+crt-static`: the executable's path from cargo's JSON messages.
fn cargo_rustc_static(release: bool) -> Result<PathBuf> {
    let mut args = vec![
        "rustc",
        "-p",
        "lb-controller",
        "--bin",
        "lb-controller",
        "--message-format=json-render-diagnostics",
    ];
    if release {
        args.push("--release");
    }
    args.extend(["--", "-C", "target-feature=+crt-static"]);
    let out = crate::util::cargo(&args)
        .stderr(Stdio::inherit())
        .output()
        .context("starting cargo rustc")?;
    anyhow::ensure!(
        out.status.success(),
        "building a static lb-controller failed ({})",
        out.status
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "lb-controller")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .context("cargo named no lb-controller executable")
}

/// Whether an ELF64 file asks for a program interpreter (`PT_INTERP`): a static or static-pie binary does not.
fn is_dynamic(path: &Path) -> Result<bool> {
    let elf = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    anyhow::ensure!(
        elf.len() > 64 && elf[..4] == *b"\x7fELF" && elf[4] == 2,
        "{} is not an ELF64 file",
        path.display()
    );
    let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into()?) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    const PT_INTERP: u32 = 3;
    Ok((0..phnum).any(|i| {
        let o = phoff + i * phentsize;
        elf.get(o..o + 4)
            .is_some_and(|t| u32::from_le_bytes(t.try_into().unwrap()) == PT_INTERP)
    }))
}

/// The image's root filesystem: the binary, Debian's CA bundle, the users, name-service order, a home and /tmp.
fn assemble_rootfs(binary: &Path, rootfs: &Path) -> Result<()> {
    super::rootfs::remove_tree(rootfs)?;
    let file = |rel: &str, data: &[u8], mode: u32| -> Result<()> {
        let path = rootfs.join(rel);
        std::fs::create_dir_all(path.parent().expect("a path inside the root"))?;
        std::fs::write(&path, data).with_context(|| format!("writing {}", path.display()))?;
        set_mode(&path, mode)
    };
    file(BINARY, &std::fs::read(binary)?, 0o755)?;
    let bundle = Path::new("/").join(CA_BUNDLE);
    file(
        CA_BUNDLE,
        &std::fs::read(&bundle)
            .with_context(|| format!("reading {} (Debian's ca-certificates)", bundle.display()))?,
        0o644,
    )?;
    file(
        "etc/passwd",
        format!("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:{USER}:{USER}:nonroot:/home/nonroot:/sbin/nologin\n")
            .as_bytes(),
        0o644,
    )?;
    file(
        "etc/group",
        format!("root:x:0:\nnonroot:x:{USER}:\n").as_bytes(),
        0o644,
    )?;
    // Without it glibc asks DNS before /etc/hosts for a name.
    file(
        "etc/nsswitch.conf",
        b"passwd: files\ngroup: files\nhosts: files dns\n",
        0o644,
    )?;
    let home = rootfs.join("home/nonroot");
    std::fs::create_dir_all(&home)?;
    set_mode(&home, 0o700)?;
    std::os::unix::fs::chown(&home, Some(USER), Some(USER))
        .with_context(|| format!("chown {}", home.display()))?;
    let tmp = rootfs.join("tmp");
    std::fs::create_dir_all(&tmp)?;
    set_mode(&tmp, 0o1777)?;
    // Directories the writes above created: 0755 whatever the umask.
    for dir in [
        "etc",
        "etc/ssl",
        "etc/ssl/certs",
        "home",
        "usr",
        "usr/local",
        "usr/local/bin",
    ] {
        set_mode(&rootfs.join(dir), 0o755)?;
    }
    set_mode(rootfs, 0o755)
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {}", path.display()))
}

/// The version the binary reports (`lb-controller 0.1.0` → `0.1.0`): the label says what is inside.
fn binary_version(binary: &Path) -> Result<String> {
    let out = output(
        Command::new(binary).arg("--version"),
        "lb-controller --version",
    )?;
    out.split_whitespace()
        .nth(1)
        .map(str::to_owned)
        .with_context(|| format!("unexpected `lb-controller --version`: {out}"))
}

/// The commit, with `-dirty` when tracked files differ from it.
fn revision() -> Result<String> {
    let head = git(&["rev-parse", "HEAD"])?;
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"])?.is_empty();
    Ok(if dirty { format!("{head}-dirty") } else { head })
}

/// The image's time: `SOURCE_DATE_EPOCH` (the reproducible-builds convention) or the commit's time.
fn source_time() -> Result<(String, i64)> {
    let epoch: i64 = match std::env::var("SOURCE_DATE_EPOCH") {
        Ok(s) => s.parse().context("SOURCE_DATE_EPOCH is not a number")?,
        Err(_) => git(&["log", "-1", "--format=%ct"])?.parse()?,
    };
    let created = output(
        Command::new("date").args(["-u", "-d", &format!("@{epoch}"), "+%Y-%m-%dT%H:%M:%SZ"]),
        "date",
    )?;
    Ok((created.trim().to_owned(), epoch))
}

fn default_source() -> Result<String> {
    match git(&["config", "--get", "remote.origin.url"]) {
        Ok(url) if !url.is_empty() => Ok(url),
        _ => Ok(format!("git+file://{}", root().display())),
    }
}

fn git(args: &[&str]) -> Result<String> {
    Ok(output(
        Command::new("git").current_dir(root()).args(args),
        &format!("git {}", args.join(" ")),
    )?
    .trim()
    .to_owned())
}

/// The controller-image stage of `cargo xtask test`: builds the image (dev profile) and runs
/// `lb-controller/tests/controller_image.rs` against it — podman pulls it from the layout and runs it against a
/// real API server. That test target has `test = false` (a plain `cargo test` has no image to run), so the clippy
/// stage's `--all-targets` does not reach it and it is linted here.
pub fn test_stage() -> Result<()> {
    let built = build(&ControllerArgs::default())?;
    crate::util::run(
        // The clippy stage's workspace selection (all members), so its check artifacts are reused.
        &mut crate::test::workspace_cargo(&[
            "clippy",
            "--test",
            "controller_image",
            "--",
            "-D",
            "warnings",
        ]),
        "cargo clippy --test controller_image",
    )?;
    crate::util::run(
        crate::test::workspace_cargo(&[
            "test",
            "--exclude",
            "lb-testbed",
            "--test",
            "controller_image",
        ])
        .env(
            "LB_CONTROLLER_IMAGE",
            format!("oci:{}:{}", built.layout.display(), built.tag),
        ),
        "the controller image against the real API server (tests/controller_image.rs)",
    )
}
