//! `cargo xtask fuzz …`: fuzzing campaigns longer than the short passes `cargo xtask test` runs.
//!
//! `dataplane`: the differential fuzzer of the data plane (`lb-agent/tests/differential/`), its ignored long
//! campaign with the number of frames and the seed passed through the environment; it prints frames/s, the rules
//! the frames reached and, on a difference, the shortest sequence that shows it.
//!
//! `parsers`: the coverage-guided targets in `fuzz/` (libFuzzer through `libfuzzer-sys`): the flow-sync wire
//! protocol, the agent's config, keepalived's output, the controller's reading of OpenStack's answers and of
//! yawol's `cloudprovider.conf`. They are built the way `cargo fuzz` builds them — the same
//! instrumentation flags, for the host target explicitly so that build scripts and proc macros stay plain — but
//! without installing cargo-fuzz: that would add a cargo install to every fresh machine for what three flags
//! and a `cargo build` do. No sanitizer: Rust code has no memory errors for ASan to find here (the targets
//! are safe code), and panics, hangs and unbounded allocation are what libFuzzer reports anyway. Each run
//! starts from the seeds committed in `fuzz/corpus/<target>` and keeps what it finds under `target/fuzz/`.

use crate::{
    ebpf,
    test::workspace_cargo,
    util::{root, run},
};
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use std::path::PathBuf;
use std::process::Command;

#[derive(Subcommand)]
pub enum FuzzCmd {
    /// Generated and corrupted frames through the real XDP and TC programs and the reference model.
    Dataplane {
        /// Frames per hook.
        #[arg(long, default_value_t = 1_000_000)]
        frames: u64,
        /// Seed of the XDP campaign (the TC one uses the next).
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// The coverage-guided parser targets (`fuzz/fuzz_targets/`), each for a while.
    Parsers {
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Only this target (default: all).
        #[arg(long)]
        target: Option<String>,
    },
}

/// The parser targets, as named in `fuzz/Cargo.toml`.
pub const PARSER_TARGETS: [&str; 5] = [
    "sync_wire",
    "agent_config",
    "keepalived",
    "openstack_answers",
    "cloudprovider_conf",
];

const HOST: &str = "x86_64-unknown-linux-gnu";

/// Builds the parser targets with coverage instrumentation; returns the directory of the binaries.
fn build_parsers() -> Result<PathBuf> {
    ebpf::build()?;
    let target_dir = root().join("target/fuzz");
    let mut c = Command::new("cargo");
    c.current_dir(root().join("fuzz"))
        .args(["build", "--release", "--target", HOST])
        .env("CARGO_TARGET_DIR", &target_dir)
        .env(
            "RUSTFLAGS",
            "-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
             -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
             -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing",
        );
    run(&mut c, "building the fuzz targets")?;
    Ok(target_dir.join(HOST).join("release"))
}

/// Runs the parser targets (or `only`) for `seconds` each; fails on the first crash, with where its input is.
pub fn parsers(seconds: u64, only: Option<&str>) -> Result<()> {
    let bins = build_parsers()?;
    for target in PARSER_TARGETS
        .iter()
        .filter(|t| only.is_none_or(|o| o == **t))
    {
        let corpus = root().join("target/fuzz/corpus").join(target);
        let artifacts = root().join("target/fuzz/artifacts").join(target);
        std::fs::create_dir_all(&corpus)?;
        std::fs::create_dir_all(&artifacts)?;
        let seeds = root().join("fuzz/corpus").join(target);
        // New inputs go to the first directory (under target/); the committed seeds are only read.
        let out = Command::new(bins.join(target))
            .arg(format!("-max_total_time={seconds}"))
            .arg("-print_final_stats=1")
            .arg(format!("-artifact_prefix={}/", artifacts.display()))
            .arg(&corpus)
            .arg(&seeds)
            .output()
            .with_context(|| format!("starting fuzz target {target}"))?;
        let log = String::from_utf8_lossy(&out.stderr);
        let stat = |name: &str| {
            log.lines()
                .find_map(|l| l.strip_prefix(&format!("stat::{name}:")))
                .map(|v| v.trim().to_string())
                .unwrap_or_else(|| "?".into())
        };
        println!(
            "fuzz {target}: {} runs in {seconds} s ({} exec/s), {} new inputs, peak RSS {} MB",
            stat("number_of_executed_units"),
            stat("average_exec_per_sec"),
            stat("new_units_added"),
            stat("peak_rss_mb"),
        );
        if !out.status.success() {
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "fuzz target {target} found a crash (input under {}):\n{}",
                artifacts.display(),
                tail.join("\n")
            );
        }
    }
    Ok(())
}

pub fn run_fuzz(cmd: FuzzCmd) -> Result<()> {
    match cmd {
        FuzzCmd::Dataplane { frames, seed } => {
            ebpf::build()?;
            // The workspace selection of the test stages, so this reuses their build.
            let mut c =
                workspace_cargo(&["test", "--exclude", "lb-testbed", "--test", "differential"]);
            c.args(["--", "--ignored", "--nocapture", "campaign_from_env"])
                .env("LB_FUZZ_FRAMES", frames.to_string())
                .env("LB_FUZZ_SEED", seed.to_string());
            run(&mut c, "the data-plane differential fuzzer")
        }
        FuzzCmd::Parsers { seconds, target } => parsers(seconds, target.as_deref()),
    }
}
