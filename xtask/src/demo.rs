//! `cargo xtask demo`: installs and builds what the demo needs, then runs `lb-testbed demo` (see
//! `testenv/netns/src/demo.rs`) and prints how long each step took.

use crate::util::{binaries, cargo, cargo_executables, run, Steps};
use anyhow::{Context, Result};
use std::process::Command;

/// The user-space build of the demo: its two binaries in the dev profile, which skips the optimiser's time on the
/// whole dependency graph (96 s on a fresh machine, see docs/development.md); the packet path is the eBPF program, built in
/// release by `build-ebpf` either way. The binaries' paths come from cargo's messages below, so this is the one
/// place that decides the profile.
const BUILD: &[&str] = &["build", "-p", "lb-agent", "-p", "lb-testbed", "--bins"];

/// Builds the data plane, the agent and the test bed, then runs the demo.
pub fn demo(attach_mode: &str) -> Result<()> {
    let mut steps = Steps::default();
    let result = run_steps(&mut steps, attach_mode);
    steps.print("demo steps (wall time):");
    result
}

fn run_steps(steps: &mut Steps, attach_mode: &str) -> Result<()> {
    steps.time("prerequisites (apt, bpffs)", crate::prereq::all)?;
    let bpf = crate::ebpf::build_timed(steps)?;
    let bins = steps.time("lb-agent + lb-testbed", || {
        cargo_executables(&mut cargo(BUILD), "building lb-agent and lb-testbed")
            .map(|b| binaries(&b))
    })?;
    let path = |name: &str| {
        bins.get(name)
            .cloned()
            .with_context(|| format!("cargo built no `{name}` binary (built: {bins:?})"))
    };
    let (agent, testbed) = (path("lb-agent")?, path("lb-testbed")?);
    steps.time("the demo itself", || {
        run(
            Command::new(&testbed)
                .args(["demo", "--attach-mode", attach_mode])
                .env("LB_AGENT_BIN", &agent)
                .env("LB_TESTBED_BIN", &testbed)
                .env("LB_XDP_PASS_OBJ", bpf.join("xdp-pass.o")),
            "the demo",
        )
    })
}
