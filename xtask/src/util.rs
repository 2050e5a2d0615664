//! Small helpers shared by the commands.

use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// The workspace root (the parent of `xtask/`).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives inside the workspace")
        .to_path_buf()
}

/// `cargo <args>` run from the workspace root.
pub fn cargo(args: &[&str]) -> Command {
    let mut c = Command::new("cargo");
    c.current_dir(root()).args(args);
    c
}

/// Runs a command, inheriting stdio; `what` names the step in the error message.
pub fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("{what}: could not start {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!("{what} failed ({status}); command: {cmd:?}");
    }
    Ok(())
}

/// Runs a command and returns its stdout as a string.
pub fn output(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("{what}: could not start {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// One executable cargo built, as its JSON messages name it.
#[derive(Clone, Debug)]
pub struct Built {
    /// The target's name (`lb-agent`, or `lb_testbed` for a library's unit-test binary).
    pub target: String,
    /// Target kinds (`bin`, `lib`, `test`, …).
    pub kinds: Vec<String>,
    /// Whether this is a test harness (`profile.test`).
    pub test: bool,
    pub executable: PathBuf,
}

/// Runs a cargo build command (`cargo build …` or `cargo test --no-run …`) with JSON messages on stdout and the
/// rendered diagnostics and progress on stderr, and returns every executable it produced. The paths come from
/// cargo itself, so a caller never guesses a profile directory.
pub fn cargo_executables(cmd: &mut Command, what: &str) -> Result<Vec<Built>> {
    cmd.arg("--message-format=json-render-diagnostics");
    let json = output_inheriting_stderr(cmd, what)?;
    Ok(json
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact")
        .filter_map(|m| {
            Some(Built {
                target: m["target"]["name"].as_str()?.to_owned(),
                kinds: m["target"]["kind"]
                    .as_array()?
                    .iter()
                    .filter_map(|k| k.as_str().map(Into::into))
                    .collect(),
                test: m["profile"]["test"] == true,
                executable: m["executable"].as_str()?.into(),
            })
        })
        .collect())
}

/// Like [`output`], but cargo's progress and compiler messages stay visible on the terminal.
fn output_inheriting_stderr(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("{what}: could not start {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!("{what} failed ({}); command: {cmd:?}", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The binaries (`bin` targets, not test harnesses) among `built`, by name.
pub fn binaries(built: &[Built]) -> BTreeMap<String, PathBuf> {
    built
        .iter()
        .filter(|b| !b.test && b.kinds.iter().any(|k| k == "bin"))
        .map(|b| (b.target.clone(), b.executable.clone()))
        .collect()
}

/// Wall-clock time of a command's named steps, printed as a table at its end (also after a failure, so a slow or
/// broken step is named).
#[derive(Default)]
pub struct Steps {
    steps: Vec<(&'static str, Duration)>,
}

impl Steps {
    /// Runs `f` as the step `name` and records how long it took, whether it succeeded or not.
    pub fn time<T>(&mut self, name: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let t = Instant::now();
        let r = f();
        self.steps.push((name, t.elapsed()));
        r
    }

    /// Prints the steps and their total under `title`.
    pub fn print(&self, title: &str) {
        let total: Duration = self.steps.iter().map(|(_, d)| *d).sum();
        println!("{title}");
        for (name, d) in &self.steps {
            println!("    {name:<28} {:>7.1} s", d.as_secs_f64());
        }
        println!("    {:<28} {:>7.1} s", "total", total.as_secs_f64());
    }
}
