//! `cargo xtask test`: every suite, fast to slow. A stage that cannot run fails loudly; nothing is skipped.

use crate::util::{root, run};
use anyhow::Result;
use clap::Args;
use std::process::Command;
use std::time::Instant;

/// Options of `cargo xtask test`.
#[derive(Args)]
pub struct TestArgs {
    /// Run only the stages whose name contains this text.
    #[arg(long)]
    pub only: Option<String>,
}

struct Stage {
    name: &'static str,
    run: fn() -> Result<()>,
}

fn cargo(args: &[&str]) -> Command {
    let mut c = Command::new("cargo");
    c.current_dir(root()).args(args);
    c
}

const STAGES: &[Stage] = &[
    Stage {
        name: "prerequisites",
        run: crate::prereq::all,
    },
    Stage {
        name: "format",
        run: || {
            run(
                &mut cargo(&["fmt", "--all", "--check"]),
                "cargo fmt --check",
            )
        },
    },
    Stage {
        name: "build-ebpf",
        run: || crate::ebpf::build().map(|_| ()),
    },
    Stage {
        name: "clippy",
        run: || {
            run(
                &mut cargo(&[
                    "clippy",
                    "--workspace",
                    "--all-targets",
                    "--",
                    "-D",
                    "warnings",
                ]),
                "cargo clippy",
            )
        },
    },
    Stage {
        // Unit tests, the data-plane packet tests (real programs via BPF_PROG_TEST_RUN, root) and the
        // controllers against the in-memory API.
        name: "unit+dataplane",
        run: || {
            run(
                &mut cargo(&["test", "--workspace", "--exclude", "lb-testbed"]),
                "cargo test --workspace --exclude lb-testbed",
            )
        },
    },
    Stage {
        // Real TCP/UDP between network namespaces through the real agent and programs.
        name: "netns-e2e",
        run: || {
            run(
                &mut cargo(&["build", "-p", "lb-agent", "-p", "lb-testbed"]),
                "building lb-agent and lb-testbed",
            )?;
            run(
                &mut cargo(&["test", "-p", "lb-testbed"]),
                "cargo test -p lb-testbed",
            )
        },
    },
    Stage {
        name: "openstack",
        run: crate::openstack::test_stage,
    },
];

/// Runs the stages in order and stops at the first failure (entry point of `cargo xtask test`).
pub fn run_all(args: TestArgs) -> Result<()> {
    let total = Instant::now();
    let mut passed = 0;
    for stage in STAGES {
        if let Some(only) = &args.only {
            if !stage.name.contains(only.as_str()) {
                continue;
            }
        }
        eprintln!("==> stage {}", stage.name);
        let t = Instant::now();
        if let Err(e) = (stage.run)() {
            // The plain summary line CI reads, then the error.
            println!("stages: {passed} passed, 1 failed");
            return Err(e);
        }
        passed += 1;
        eprintln!(
            "==> stage {} ok in {:.1}s",
            stage.name,
            t.elapsed().as_secs_f64()
        );
    }
    eprintln!("all stages passed in {:.1}s", total.elapsed().as_secs_f64());
    println!("stages: {passed} passed, 0 failed");
    Ok(())
}
