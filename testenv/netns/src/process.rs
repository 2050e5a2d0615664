//! Running commands and child processes: clear errors (command line, exit status, stderr), tool and
//! privilege checks, and [`ChildGuard`], which never leaks a process.

use std::ffi::OsStr;
use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// Per-process counter for the output files of spawned children.
static CHILD_COUNTER: AtomicU32 = AtomicU32::new(0);

pub(crate) fn render<S: AsRef<OsStr>>(argv: &[S]) -> String {
    argv.iter()
        .map(|a| a.as_ref().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs a command to completion; a non-zero exit becomes an error naming the command, status and stderr.
pub fn run_cmd<I, S>(argv: I) -> Result<Output>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let argv: Vec<std::ffi::OsString> = argv
        .into_iter()
        .map(|a| a.as_ref().to_os_string())
        .collect();
    let (prog, args) = argv.split_first().ok_or_else(|| anyhow!("empty command"))?;
    let out = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run `{}`", render(&argv)))?;
    if !out.status.success() {
        bail!(
            "`{}` failed ({}): {}",
            render(&argv),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
}

/// Tools the topology needs, with the Debian package providing each.
const TOOLS: &[(&str, &str)] = &[
    ("ip", "iproute2"),
    ("ethtool", "ethtool"),
    ("sysctl", "procps"),
];

/// Checks for root and the external tools, with an actionable message.
pub fn preflight() -> Result<()> {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("lb-testbed needs root (network namespaces, veth, bridges)");
    }
    let missing: Vec<String> = TOOLS
        .iter()
        .filter(|(tool, _)| find_in_path(tool).is_none())
        .map(|(tool, pkg)| format!("`{tool}` (Debian package `{pkg}`)"))
        .collect();
    if !missing.is_empty() {
        bail!(
            "missing tools: {}; install with `apt-get install -y {}`",
            missing.join(", "),
            TOOLS
                .iter()
                .filter(|(t, _)| find_in_path(t).is_none())
                .map(|(_, p)| *p)
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    Ok(())
}

fn find_in_path(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// True when running as root (tests skip themselves otherwise).
pub fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Path of the `lb-testbed` binary: `$LB_TESTBED_BIN`, else next to the running executable or its parent
/// directories (how `target/debug/deps/<test>` finds `target/debug/lb-testbed`). Build it first with
/// `cargo build -p lb-testbed`.
pub fn binary_path() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("LB_TESTBED_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().context("cannot locate current executable")?;
    exe.ancestors()
        .skip(1)
        .take(3)
        .map(|d| d.join("lb-testbed"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            anyhow!(
                "lb-testbed binary not found near {}: run `cargo build -p lb-testbed` or set LB_TESTBED_BIN",
                exe.display()
            )
        })
}

/// A process started by [`Topology::spawn`](crate::Topology::spawn); killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub struct ChildGuard {
    child: Option<Child>,
    label: String,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
}

/// Exit status and captured output of a finished child.
#[derive(Debug, Clone)]
pub struct ChildOutput {
    /// Exit status.
    pub status: ExitStatus,
    /// Everything written to stdout.
    pub stdout: String,
    /// Everything written to stderr.
    pub stderr: String,
}

impl ChildGuard {
    /// Starts `argv` (already including any `ip netns exec` prefix) with output captured to temp files.
    pub fn spawn<S: AsRef<OsStr>>(argv: &[S], label: &str) -> Result<Self> {
        let (prog, args) = argv.split_first().ok_or_else(|| anyhow!("empty command"))?;
        let n = CHILD_COUNTER.fetch_add(1, Ordering::Relaxed);
        let base = std::env::temp_dir().join(format!("lb-testbed-{}-{n}", std::process::id()));
        let stdout_path = base.with_extension("out");
        let stderr_path = base.with_extension("err");
        let out = File::create(&stdout_path)
            .with_context(|| format!("cannot create {}", stdout_path.display()))?;
        let err = File::create(&stderr_path)
            .with_context(|| format!("cannot create {}", stderr_path.display()))?;
        let child = Command::new(prog)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("cannot start `{}`", render(argv)))?;
        Ok(Self {
            child: Some(child),
            label: label.to_string(),
            stdout_path,
            stderr_path,
        })
    }

    fn child(&mut self) -> &mut Child {
        self.child.as_mut().expect("child present until drop")
    }

    /// Process id (with `ip netns exec` the id of the command itself: `ip` execs it).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    /// Sends a signal (e.g. `libc::SIGTERM`) unless the process has already been reaped.
    pub fn signal(&mut self, sig: i32) -> Result<()> {
        if self.child().try_wait()?.is_some() {
            return Ok(());
        }
        // SAFETY: the pid is our unreaped child, so it cannot have been reused.
        if unsafe { libc::kill(self.pid() as i32, sig) } != 0 {
            bail!(
                "kill({}, {sig}) for {}: {}",
                self.pid(),
                self.label,
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    }

    /// Exit status if the process has exited.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        Ok(self.child().try_wait()?)
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let end = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child().try_wait()? {
                return Ok(Some(s));
            }
            if Instant::now() >= end {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits up to `timeout` for the process to exit on its own and returns its output; kills it and fails
    /// (with its stderr) when it does not.
    pub fn finish(mut self, timeout: Duration) -> Result<ChildOutput> {
        match self.wait_timeout(timeout)? {
            Some(status) => Ok(self.output(status)),
            None => {
                self.kill();
                bail!(
                    "{} did not exit within {timeout:?}; stderr: {}",
                    self.label,
                    self.stderr().trim()
                )
            }
        }
    }

    /// SIGTERM, then SIGKILL after `grace`; returns the output.
    pub fn terminate(mut self, grace: Duration) -> Result<ChildOutput> {
        self.signal(libc::SIGTERM)?;
        let status = match self.wait_timeout(grace)? {
            Some(s) => s,
            None => {
                self.kill();
                self.child().wait()?
            }
        };
        Ok(self.output(status))
    }

    fn output(&self, status: ExitStatus) -> ChildOutput {
        ChildOutput {
            status,
            stdout: self.stdout(),
            stderr: self.stderr(),
        }
    }

    /// SIGKILL and reap (idempotent).
    pub fn kill(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Everything the process wrote to stdout so far.
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout_path).unwrap_or_default()
    }

    /// Everything the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Waits until stdout contains `needle` (e.g. the `"ready"` line of `lb-testbed echo`). Fails early, with
    /// stderr, if the process exits.
    pub fn wait_for_stdout(&mut self, needle: &str, timeout: Duration) -> Result<()> {
        let end = Instant::now() + timeout;
        loop {
            if self.stdout().contains(needle) {
                return Ok(());
            }
            if let Some(s) = self.child().try_wait()? {
                bail!(
                    "{} exited ({s}) before printing {needle:?}; stderr: {}",
                    self.label,
                    self.stderr().trim()
                );
            }
            if Instant::now() >= end {
                bail!(
                    "{} did not print {needle:?} within {timeout:?}; stderr: {}",
                    self.label,
                    self.stderr().trim()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.stdout_path);
        let _ = std::fs::remove_file(&self.stderr_path);
    }
}
