//! `cargo xtask build-ebpf`: nightly `rust-src`, a cached `bpf-linker` built against the nightly toolchain's own
//! LLVM, then `lb-ebpf` for `bpfel-unknown-none` in release with BTF, copied to `target/bpf/` where
//! `lb-agent`'s build script embeds it.
//!
//! Why not `aya-build` from a build script (the aya template's way): it cannot install the linker, and a nested
//! cargo inside a build script hides which step failed. Here every step names itself when it fails.

use crate::stack;
use crate::util::{output, root, run, Steps};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// bpf-linker release that links with LLVM 22 (the nightly toolchain's).
const BPF_LINKER_VERSION: &str = "0.13.0";
/// Programs built from `lb-ebpf` (its `[[bin]]` targets).
const PROGRAMS: [&str; 3] = ["lb", "lb-bench", "xdp-pass"];

/// Where the built objects go: `target/bpf/<name>.o`.
pub fn out_dir() -> PathBuf {
    root().join("target").join("bpf")
}

/// Builds the eBPF objects and returns the output directory.
pub fn build() -> Result<PathBuf> {
    build_timed(&mut Steps::default())
}

/// [`build`], recording its three steps (rust-src, bpf-linker, the programs) in `steps`.
pub fn build_timed(steps: &mut Steps) -> Result<PathBuf> {
    steps.time("nightly rust-src", ensure_rust_src)?;
    let linker = steps.time("bpf-linker", ensure_bpf_linker)?;
    let out = steps.time("eBPF programs", || build_programs(&linker))?;
    steps.time("BPF stack check", || check_stacks(&out))?;
    Ok(out)
}

/// Fails when a program of a built object has a chain of BPF-to-BPF calls whose frames, rounded as kernel 6.1 rounds
/// them, pass 512 bytes (see [`crate::stack`]); otherwise prints one line: each object's deepest program.
fn check_stacks(out: &Path) -> Result<()> {
    let mut summary = Vec::new();
    for prog in PROGRAMS {
        if let Some((name, total)) =
            stack::check_file(&out.join(format!("{prog}.o")), stack::MAX_STACK)?
        {
            summary.push(format!("{prog}.o {total} ({name})"));
        }
    }
    eprintln!(
        "BPF call-chain stack, deepest program (6.1 rounding, limit {}): {}",
        stack::MAX_STACK,
        summary.join(", ")
    );
    Ok(())
}

fn build_programs(linker: &Path) -> Result<PathBuf> {
    let root = root();
    let target_dir = root.join("target").join("ebpf");
    let mut cmd = Command::new("cargo");
    cmd.current_dir(&root)
        .args([
            "+nightly",
            "build",
            "--package",
            "lb-ebpf",
            "--bins",
            "--release",
        ])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
        .arg("--target-dir")
        .arg(&target_dir)
        .env("CARGO_TARGET_BPFEL_UNKNOWN_NONE_LINKER", linker)
        // BTF for map and program introspection; v3 for 32-bit sub-registers and jumps (kernel >= 5.1). The frame
        // limit is 448, not the BPF 512: the LB VM's kernel (6.1) counts every frame of a call chain rounded up to
        // 32 bytes (an empty one as 32) against 512 for the whole chain, and refused a 480-byte frame ("combined
        // stack size of 3 calls is 544") that this machine's 6.18 accepted — the image boot test found it. This
        // flag limits only each function's own frame, giving LLVM's error early; `check_stacks` below then sums
        // every chain as 6.1 does and fails the build past 512.
        .env(
            "CARGO_TARGET_BPFEL_UNKNOWN_NONE_RUSTFLAGS",
            "-C debuginfo=2 -C link-arg=--btf -C target-cpu=v3 -C link-arg=--llvm-args=-bpf-stack-size=448",
        )
        .env("CARGO_PROFILE_RELEASE_PANIC", "abort")
        .env_remove("RUSTFLAGS")
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER");
    run(&mut cmd, "building lb-ebpf for bpfel-unknown-none")?;
    let out = out_dir();
    std::fs::create_dir_all(&out)?;
    for prog in PROGRAMS {
        let built = target_dir
            .join("bpfel-unknown-none")
            .join("release")
            .join(prog);
        let dest = out.join(format!("{prog}.o"));
        copy_if_changed(&built, &dest)
            .with_context(|| format!("copying {} to {}", built.display(), dest.display()))?;
    }
    eprintln!("eBPF objects in {}", out.display());
    Ok(out)
}

/// Copies only when the content differs, so `lb-agent` is not rebuilt for nothing.
fn copy_if_changed(from: &Path, to: &Path) -> Result<()> {
    let new = std::fs::read(from)?;
    if std::fs::read(to).ok().as_deref() != Some(&new[..]) {
        std::fs::write(to, new)?;
    }
    Ok(())
}

fn ensure_rust_src() -> Result<()> {
    let installed = output(
        Command::new("rustup").args(["component", "list", "--toolchain", "nightly", "--installed"]),
        "listing the nightly toolchain's components (is the nightly toolchain installed? `rustup toolchain list`)",
    )?;
    if installed.lines().any(|l| l.starts_with("rust-src")) {
        return Ok(());
    }
    eprintln!("installing the nightly rust-src component (needed for -Z build-std=core)");
    run(
        Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]),
        "installing rust-src for the nightly toolchain",
    )
}

/// Returns the path of a bpf-linker built against this nightly's LLVM, building it once if needed.
fn ensure_bpf_linker() -> Result<PathBuf> {
    let sysroot = output(
        Command::new("rustc").args(["+nightly", "--print", "sysroot"]),
        "asking the nightly toolchain for its sysroot",
    )?;
    let sysroot = PathBuf::from(sysroot.trim());
    let llvm = find_rust_llvm(&sysroot.join("lib"))?;
    let llvm_name = llvm
        .file_name()
        .and_then(|n| n.to_str())
        .context("LLVM library name is not UTF-8")?
        .to_owned();
    // The cache key names the linker version and the exact LLVM build: a nightly update rebuilds it.
    let cache = cache_dir().join(format!("bpf-linker-{BPF_LINKER_VERSION}-{llvm_name}"));
    let bin = cache.join("bin").join("bpf-linker");
    if bin.exists() {
        return Ok(bin);
    }
    // bpf-linker's build looks for `$LLVM_PREFIX/lib/libLLVM.so`; the toolchain ships only a versioned name.
    let prefix = cache.join("llvm");
    let lib = prefix.join("lib");
    std::fs::create_dir_all(&lib)?;
    for name in ["libLLVM.so", llvm_name.as_str()] {
        let link = lib.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&llvm, &link)
            .with_context(|| format!("linking {} to {}", link.display(), llvm.display()))?;
    }
    eprintln!(
        "building bpf-linker {BPF_LINKER_VERSION} against {} (once; cached in {})",
        llvm.display(),
        cache.display()
    );
    let mut cmd = Command::new("cargo");
    cmd.args(["+nightly", "install", "--locked", "--force"])
        .arg(format!("bpf-linker@{BPF_LINKER_VERSION}"))
        .args(["--no-default-features", "--features", "llvm-22", "--root"])
        .arg(&cache)
        .env("LLVM_PREFIX", &prefix)
        .env("LD_LIBRARY_PATH", &lib)
        .env_remove("RUSTFLAGS");
    run(
        &mut cmd,
        "building bpf-linker (needs crates.io; see docs/development.md, \"Building\", if this keeps failing)",
    )?;
    if !bin.exists() {
        bail!(
            "bpf-linker install finished but {} does not exist",
            bin.display()
        );
    }
    Ok(bin)
}

/// The nightly toolchain's own LLVM shared library (`libLLVM.so.22.1-rust-…`).
fn find_rust_llvm(lib: &Path) -> Result<PathBuf> {
    let entries = std::fs::read_dir(lib).with_context(|| format!("reading {}", lib.display()))?;
    for e in entries {
        let e = e?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("libLLVM.so.22") && name.contains("rust") {
            return Ok(e.path());
        }
    }
    bail!(
        "no libLLVM.so.22*-rust-* in {}: bpf-linker {BPF_LINKER_VERSION} needs the nightly toolchain's LLVM 22",
        lib.display()
    )
}

/// `~/.cache/lb-xtask` (or under `XDG_CACHE_HOME`): tools built or downloaded once (bpf-linker, helm).
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("lb-xtask");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache").join("lb-xtask")
}
