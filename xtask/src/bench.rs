//! `cargo xtask bench <what>`: benchmarks that print a table and write JSON under `target/bench/`.
//! Numbers come from here, never from timed assertions in tests.

use crate::util::{root, run};
use anyhow::Result;
use clap::ValueEnum;
use std::process::Command;

/// Which benchmark to run.
#[derive(Clone, Copy, ValueEnum)]
pub enum Which {
    /// ns/packet of the XDP program via BPF_PROG_TEST_RUN, next to a bare XDP_TX reflector.
    Dataplane,
    /// 1000 Services → LoadBalancers and a node flap, against the in-memory API.
    Controller,
    /// Everything above.
    All,
}

/// Runs the chosen benchmarks.
pub fn run_bench(which: Which) -> Result<()> {
    match which {
        Which::Dataplane => dataplane(),
        Which::Controller => controller(),
        Which::All => {
            dataplane()?;
            controller()
        }
    }
}

fn dataplane() -> Result<()> {
    let out = crate::ebpf::build()?;
    run(
        Command::new("cargo")
            .current_dir(root())
            .args([
                "run",
                "--release",
                "--quiet",
                "-p",
                "lb-benches",
                "--bin",
                "bench-dataplane",
                "--",
            ])
            .arg("--object")
            .arg(out.join("lb-bench.o")),
        "bench dataplane",
    )
}

fn controller() -> Result<()> {
    run(
        Command::new("cargo")
            .current_dir(root())
            .args([
                "run",
                "--release",
                "--quiet",
                "-p",
                "lb-controller",
                "--example",
                "bench_controller",
                "--",
            ])
            .arg("--json")
            .arg(root().join("target/bench/controller.json")),
        "bench controller",
    )
}
