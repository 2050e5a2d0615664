//! `cargo xtask upgrade-check --from REV`: the upgrade tests with a previous release's real agent. The test suite
//! proves the carry across a map layout change with this build on both sides (its pins renamed as the previous
//! layout's) and flow sync between replicas of one build; before a release that changes the layout (or the sync
//! protocol), this builds the previous release's agent from git and runs the same tests with it on the old side:
//! the single-replica upgrade under 1000 held connections, and the HA rollover from replicas of the previous
//! release to one of this build. Not a CI stage: it builds a second workspace (a few minutes; the worktree and its
//! build directory are kept under target/upgrade-check/ for the next run).

use crate::util::{cargo, root, run};
use anyhow::{Context, Result};
use std::process::Command;

pub fn check(from: &str) -> Result<()> {
    crate::prereq::all()?;
    // A worktree of its own, kept between runs (its build directory with it).
    let tree = root().join("target/upgrade-check/previous");
    if tree.exists() {
        run(
            Command::new("git")
                .current_dir(&tree)
                .args(["checkout", "--detach", "--force", from]),
            &format!("checking {from} out"),
        )?;
    } else {
        run(
            Command::new("git")
                .current_dir(root())
                .args(["worktree", "add", "--detach"])
                .arg(&tree)
                .arg(from),
            &format!("checking {from} out"),
        )?;
    }
    // The previous release's eBPF object and agent, built by its own xtask in its own target directory.
    for args in [&["xtask", "build-ebpf"][..], &["build", "-p", "lb-agent"]] {
        run(
            Command::new("cargo").current_dir(&tree).args(args),
            &format!("building {from}'s agent"),
        )?;
    }
    let previous = tree.join("target/debug/lb-agent");
    let previous = previous
        .canonicalize()
        .with_context(|| format!("{} was not built", previous.display()))?;
    crate::ebpf::build()?;
    run(
        &mut cargo(&["build", "-p", "lb-agent", "-p", "lb-testbed"]),
        "building this agent",
    )?;
    for (test, name) in [
        ("e2e", "an_agent_with_a_new_map_layout"),
        ("ha", "planned_rollover"),
    ] {
        run(
            cargo(&[
                "test",
                "-p",
                "lb-testbed",
                "--test",
                test,
                "--",
                name,
                "--nocapture",
            ])
            .env("LB_PREVIOUS_AGENT_BIN", &previous),
            &format!("{test}::{name} with {from}'s agent"),
        )?;
    }
    println!("upgrade from {from}: both tests passed with its agent on the old side");
    Ok(())
}
