//! The root filesystem stage: Debian packages into a directory with mmdebstrap, then the overlay and
//! `image/customize.sh`. It is the slow part (a few minutes, mostly downloads), so the finished directory is
//! kept in `target/image/cache/rootfs/` together with the hash of everything that went into it; a build whose
//! inputs hash the same reuses it. The .debs are kept in `target/image/cache/debs/` so that a changed recipe
//! does not download them again.
//!
//! Why mmdebstrap rather than debootstrap: one apt run resolves the whole package list (debootstrap's
//! `--include` resolves dependencies poorly and installs Recommends), dpkg path excludes keep docs, man pages
//! and translations out, hooks run the customisation in the same step, and it is faster.

use super::{out_dir, recipe_dir};
use crate::util::{output, root, run};
use anyhow::{bail, Context, Result};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// The suite the image is built from.
const SUITE: &str = "bookworm";

/// Options of the mmdebstrap run besides the package list and hooks.
const MMDEBSTRAP_OPTIONS: &[&str] = &[
    "--mode=root",
    "--variant=minbase",
    "--format=directory",
    // Keep the essential packages' .debs for the package cache.
    "--skip=essential/unlink",
    "--aptopt=APT::Install-Recommends \"false\"",
    // Written to /etc/dpkg/dpkg.cfg.d/ in the image too, so later installs on the VM stay lean.
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/info/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/lintian/*",
];

/// Files of `image/` that the root filesystem is made from (besides everything under `image/rootfs/`).
const INPUTS: &[&str] = &[
    "packages.txt",
    "sources.list",
    "customize.sh",
    "grub/grub.cfg",
];

/// A finished root filesystem directory.
pub struct Rootfs {
    /// The directory (never modified after it is finished; the disk stage works on a hard-linked copy).
    pub dir: PathBuf,
    /// UUID the root filesystem must get (fstab and grub.cfg name it).
    pub root_uuid: String,
    /// Hash of the inputs.
    pub key: String,
    /// Whether the cache was used.
    pub cached: bool,
    /// Time spent on this stage.
    pub seconds: f64,
}

fn cache_dir() -> PathBuf {
    out_dir().join("cache")
}

/// Returns the cached root filesystem when its inputs did not change (and `refresh` is off), else builds it.
pub fn ensure(refresh: bool) -> Result<Rootfs> {
    let t = Instant::now();
    let key = cache_key()?;
    let dir = cache_dir().join("rootfs");
    let stamp = cache_dir().join("rootfs.json");
    let recorded: Option<serde_json::Value> = std::fs::read_to_string(&stamp)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok());
    if let Some(rec) = recorded.filter(|r| !refresh && r["key"] == key.as_str() && dir.is_dir()) {
        eprintln!(
            "image: root filesystem unchanged (key {}), reusing {}",
            &key[..12],
            dir.display()
        );
        return Ok(Rootfs {
            dir,
            root_uuid: rec["root_uuid"]
                .as_str()
                .context("rootfs.json without root_uuid")?
                .into(),
            key,
            cached: true,
            seconds: t.elapsed().as_secs_f64(),
        });
    }
    let root_uuid = std::fs::read_to_string("/proc/sys/kernel/random/uuid")?
        .trim()
        .to_string();
    let new = cache_dir().join("rootfs.new");
    remove_tree(&new)?;
    // The stamp goes first: a half-replaced cache must never look valid.
    let _ = std::fs::remove_file(&stamp);
    eprintln!(
        "image: building the root filesystem with mmdebstrap (key {}; a few minutes)",
        &key[..12]
    );
    mmdebstrap(&new, &root_uuid)?;
    remove_tree(&dir)?;
    std::fs::rename(&new, &dir)?;
    let manifest = output(
        Command::new("chroot")
            .arg(&dir)
            .args(["dpkg-query", "-W", "-f=${Package} ${Version}\\n"]),
        "listing the image's packages",
    )?;
    std::fs::write(cache_dir().join("packages.lock"), manifest)?;
    std::fs::write(
        &stamp,
        serde_json::to_string_pretty(&serde_json::json!({"key": key, "root_uuid": root_uuid}))?,
    )?;
    let seconds = t.elapsed().as_secs_f64();
    eprintln!("image: root filesystem built in {seconds:.0}s");
    Ok(Rootfs {
        dir,
        root_uuid,
        key,
        cached: false,
        seconds,
    })
}

/// mmdebstrap's arguments up to the suite (options, package list, hooks). Part of the cache key.
fn mmdebstrap_args() -> Result<Vec<String>> {
    let recipe = recipe_dir();
    let debs = cache_dir().join("debs");
    let q = |p: &Path| shell_quote(&p.display().to_string());
    let mut args: Vec<String> = MMDEBSTRAP_OPTIONS.iter().map(|s| s.to_string()).collect();
    args.extend([
        format!("--include={}", packages()?.join(",")),
        "--setup-hook=mkdir -p \"$1\"/var/cache/apt/archives".to_string(),
        format!("--setup-hook=sync-in {} /var/cache/apt/archives/", q(&debs)),
        format!("--customize-hook=sync-in {} /", q(&recipe.join("rootfs"))),
        format!("--customize-hook=sh {} \"$1\"", q(&recipe.join("customize.sh"))),
        // Exactly this build's .debs, for the next build.
        format!("--customize-hook=rm -rf {0} && mkdir {0}", q(&debs)),
        format!("--customize-hook=sync-out /var/cache/apt/archives {}", q(&debs)),
        // No apt state in the image: mmdebstrap's own cleanup/apt left the .debs and lists behind here
        // (1.3.5, with the archive directory synced in).
        "--customize-hook=rm -rf \"$1\"/var/cache/apt/archives/*.deb \"$1\"/var/cache/apt/*.bin \"$1\"/var/lib/apt/lists/*".to_string(),
        SUITE.to_string(),
    ]);
    Ok(args)
}

fn mmdebstrap(target: &Path, root_uuid: &str) -> Result<()> {
    let recipe = recipe_dir();
    std::fs::create_dir_all(cache_dir().join("debs"))?;
    let mut cmd = Command::new("mmdebstrap");
    cmd.args(mmdebstrap_args()?)
        .arg(target)
        .arg(recipe.join("sources.list"))
        .env("ROOT_UUID", root_uuid)
        .env("GRUB_CFG", recipe.join("grub/grub.cfg"));
    let log = cache_dir().join("mmdebstrap.log");
    let file = std::fs::File::create(&log)?;
    let status = cmd
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .status()
        .context("starting mmdebstrap")?;
    if !status.success() {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(25).collect();
        bail!(
            "mmdebstrap failed ({status}); last lines of {}:\n{}",
            log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(())
}

/// The package list of `image/packages.txt`.
fn packages() -> Result<Vec<String>> {
    let path = recipe_dir().join("packages.txt");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect())
}

/// SHA-256 over the recipe inputs (names, modes, contents) and mmdebstrap's arguments.
fn cache_key() -> Result<String> {
    let recipe = recipe_dir();
    let mut files: Vec<PathBuf> = INPUTS.iter().map(|f| recipe.join(f)).collect();
    walk(&recipe.join("rootfs"), &mut files)?;
    let mut data = Vec::new();
    writeln!(data, "{}", mmdebstrap_args()?.join("\n"))?;
    for f in &files {
        use std::os::unix::fs::PermissionsExt;
        let meta =
            std::fs::symlink_metadata(f).with_context(|| format!("reading {}", f.display()))?;
        let rel = f.strip_prefix(&recipe).unwrap_or(f);
        writeln!(data, "\0{} {:o}", rel.display(), meta.permissions().mode())?;
        if meta.is_file() {
            data.extend(std::fs::read(f)?);
        }
    }
    sha256(&data)
}

/// Every path under `dir`, sorted (directories too: their modes end up in the image).
fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    entries.sort();
    for e in entries {
        out.push(e.clone());
        if e.is_dir() && !e.is_symlink() {
            walk(&e, out)?;
        }
    }
    Ok(())
}

/// sha256sum of `data` (coreutils, so xtask needs no hashing crate).
pub fn sha256(data: &[u8]) -> Result<String> {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting sha256sum")?;
    child
        .stdin
        .take()
        .context("sha256sum stdin")?
        .write_all(data)?;
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    match text.split_whitespace().next() {
        Some(h) if out.status.success() && h.len() == 64 => Ok(h.to_string()),
        _ => bail!("sha256sum failed: {text}"),
    }
}

/// Removes a directory tree this command made, refusing to go near anything still mounted inside it (an
/// interrupted mmdebstrap may leave /proc or /dev bind-mounted in its chroot).
pub fn remove_tree(dir: &Path) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    let prefix = format!("{}/", dir.display());
    if let Some(m) = mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .find(|m| m.starts_with(&prefix))
    {
        bail!(
            "{m} is still mounted inside {}; unmount it (umount -R) and run again",
            dir.display()
        );
    }
    run(
        Command::new("rm")
            .args(["-rf", "--one-file-system"])
            .arg(dir),
        "removing an old build directory",
    )
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The release agent binary, built the way the benchmarks build it.
pub struct Agent {
    /// `target/release/lb-agent`.
    pub path: PathBuf,
    /// Time spent building (eBPF objects and the agent).
    pub seconds: f64,
}

/// Builds the eBPF objects and the release `lb-agent` (which embeds them).
pub fn build_agent() -> Result<Agent> {
    let t = Instant::now();
    crate::ebpf::build()?;
    run(
        &mut crate::util::cargo(&["build", "--release", "--quiet", "-p", "lb-agent"]),
        "building lb-agent (release)",
    )?;
    Ok(Agent {
        path: root().join("target/release/lb-agent"),
        seconds: t.elapsed().as_secs_f64(),
    })
}
