//! `cargo xtask test`: every suite, fast to slow. A stage that cannot run fails loudly; nothing is skipped.

use crate::util::{cargo, root, run};
use anyhow::{Context, Result};
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

/// `cargo <subcommand> --workspace <rest>`. The test stages all select the whole workspace (narrowed with
/// `--exclude` and `--test`, never `-p`) so that cargo resolves features once and every stage reuses the same
/// artifacts: a `-p` selection unifies features differently and rebuilds the dependency graph, which doubled the
/// disk used by `target/` and the CI time.
pub fn workspace_cargo(args: &[&str]) -> Command {
    let mut c = cargo(&args[..1]);
    c.arg("--workspace").args(&args[1..]);
    c
}

const STAGES: &[Stage] = &[
    Stage {
        name: "prerequisites",
        run: crate::prereq::all,
    },
    Stage {
        // The README's first command exactly as a newcomer types it, before any other stage has built anything:
        // on a fresh clone (which CI always is) this is the newcomer's situation, so a demo that only works on a
        // warm `target/` fails here.
        name: "demo",
        run: || run(&mut cargo(&["xtask", "demo"]), "cargo xtask demo"),
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
        // Unit tests, the data-plane packet tests (real programs via BPF_PROG_TEST_RUN, root) and the agent's
        // Kubernetes mode and the controllers against a real kube-apiserver (kube-testenv, KUBEBUILDER_ASSETS).
        name: "unit+dataplane",
        run: || {
            run(
                &mut workspace_cargo(&["test", "--exclude", "lb-testbed"]),
                "cargo test --workspace --exclude lb-testbed",
            )
        },
    },
    Stage {
        // The coverage-guided parser targets, 15 s each from the committed seeds (longer: `cargo xtask fuzz
        // parsers`). A crash fails the stage and names its input.
        name: "fuzz-parsers",
        run: || crate::fuzz::parsers(15, None),
    },
    Stage {
        // lb-controller's OCI image (static binary, empty root) built, pulled by podman from its layout and run
        // against a real kube-apiserver: /healthz, a Service reconciled, the API server's name resolved by DNS.
        name: "controller-image",
        run: crate::image::controller::test_stage,
    },
    Stage {
        // Real TCP/UDP between network namespaces through the real agent and programs.
        name: "netns-e2e",
        run: || {
            // Builds the lb-agent binary the tests start, with the unit stage's features (a no-op after it), and
            // runs lb-testbed's own unit tests, which the unit stage's `--exclude lb-testbed` left out.
            let unit = unit_test_binary("lb-testbed")?;
            run(
                Command::new(&unit).current_dir(root().join("testenv/netns")),
                "lb-testbed unit tests",
            )?;
            let mut cmd = workspace_cargo(&["test"]);
            for target in test_targets("testenv/netns", false)? {
                cmd.args(["--test", &target]);
            }
            run(&mut cmd, "cargo test --workspace --test <lb-testbed tests>")
        },
    },
    Stage {
        // Every `cargo xtask bench` kind at smoke size (seconds each, no thresholds) on the netns rig and the real
        // programs: a benchmark that no longer loads, runs or delivers fails here instead of in the next measuring
        // session. `openstack` needs the test OpenStack: the openstack stage runs its smoke run.
        name: "bench-smoke",
        run: crate::bench::smoke_stage,
    },
    Stage {
        name: "openstack",
        run: crate::openstack::test_stage,
    },
    Stage {
        // The LB VM image built from Debian packages and booted in QEMU with lb-controller's user data.
        name: "vm-image",
        run: crate::image::test_stage,
    },
];

/// The integration-test targets of a workspace package (file stems of `<package>/tests/*.rs`), read from the
/// directory so that a new test file cannot be left out of a stage; with `ignored_only`, only files that hold
/// `#[ignore]`d tests.
pub fn test_targets(package: &str, ignored_only: bool) -> Result<Vec<String>> {
    let dir = root().join(package).join("tests");
    let mut targets = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        if ignored_only {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            if !text.contains("#[ignore") {
                continue;
            }
        }
        let stem = path.file_stem().expect("a .rs file has a stem");
        targets.push(stem.to_string_lossy().into_owned());
    }
    targets.sort();
    anyhow::ensure!(
        !targets.is_empty(),
        "no test files found in {}",
        dir.display()
    );
    Ok(targets)
}

/// Builds every test binary of the workspace (`cargo test --workspace --no-run`) and returns the path of
/// `package`'s library unit-test binary: a way to run one package's unit tests with the workspace's artifacts,
/// which `cargo test -p <package>` would rebuild with other features.
fn unit_test_binary(package: &str) -> Result<std::path::PathBuf> {
    let built = crate::util::cargo_executables(
        &mut workspace_cargo(&["test", "--no-run"]),
        "building the test binaries",
    )?;
    let lib_name = package.replace('-', "_");
    built
        .into_iter()
        .find(|b| b.test && b.target == lib_name && b.kinds.iter().any(|k| k == "lib"))
        .map(|b| b.executable)
        .with_context(|| format!("no unit-test binary of {package} in cargo's output"))
}

/// Runs the stages in order and stops at the first failure (entry point of `cargo xtask test`).
pub fn run_all(args: TestArgs) -> Result<()> {
    let total = Instant::now();
    crate::prereq::kube_assets()?;
    crate::prereq::helm_env()?;
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
