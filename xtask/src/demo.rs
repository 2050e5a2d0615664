//! `cargo xtask demo`: builds what is needed, then runs `lb-testbed demo` (see `testbed/src/demo.rs`).

use crate::util::{root, run};
use anyhow::Result;
use std::process::Command;

/// Builds the data plane, the agent and the test bed, then runs the demo.
pub fn demo(attach_mode: &str) -> Result<()> {
    crate::prereq::all()?;
    let bpf = crate::ebpf::build()?;
    run(
        &mut crate::util::cargo(&["build", "--release", "-p", "lb-agent", "-p", "lb-testbed"]),
        "building lb-agent and lb-testbed",
    )?;
    let bin = root().join("target/debug");
    run(
        Command::new(bin.join("lb-testbed"))
            .args(["demo", "--attach-mode", attach_mode])
            .env("LB_AGENT_BIN", bin.join("lb-agent"))
            .env("LB_TESTBED_BIN", bin.join("lb-testbed"))
            .env("LB_XDP_PASS_OBJ", bpf.join("xdp-pass.o")),
        "the demo",
    )
}
