//! The cluster's processes: started so that they die with the test process, recorded by PID so that a run killed
//! hard (SIGKILL never runs destructors) is cleaned up by the next one.

use anyhow::{Context, Result};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where every run keeps its directory: `<tmp>/kube-testenv/run-<test process pid>-<n>`.
pub fn runs_dir() -> PathBuf {
    std::env::temp_dir().join("kube-testenv")
}

/// One running program; killed (SIGTERM, then SIGKILL after 10 s) when dropped.
pub struct Proc {
    pub name: &'static str,
    child: Child,
}

impl Proc {
    /// Starts `cmd` with its output in `<dir>/<name>.log` and records its PID in `<dir>/pids`.
    ///
    /// PR_SET_PDEATHSIG ties the child to the *thread* that forks it: callers that outlive their thread (the shared
    /// cluster of a test binary) start it from a thread that lives as long as the process.
    pub fn spawn(name: &'static str, mut cmd: Command, dir: &Path) -> Result<Proc> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("{name}.log")))?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name} ({:?})", cmd.get_program()))?;
        let mut pids = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("pids"))?;
        std::io::Write::write_all(&mut pids, format!("{}\n", child.id()).as_bytes())?;
        Ok(Proc { name, child })
    }

    /// Whether it has exited (with its status), without waiting.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGTERM, wait up to `grace`, then SIGKILL.
    pub fn stop(&mut self, grace: Duration) {
        if self.exited().is_some() {
            return;
        }
        // SAFETY: kill on our own child's PID (not yet reaped, so not reused).
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.exited().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(10));
    }
}

/// Removes the directories of runs whose test process is gone, killing what they recorded (only processes that
/// are still one of ours: a PID can have been reused).
pub fn sweep_stale_runs() {
    let Ok(entries) = std::fs::read_dir(runs_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(owner) = name
            .strip_prefix("run-")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if Path::new(&format!("/proc/{owner}")).exists() {
            continue;
        }
        let pids = std::fs::read_to_string(entry.path().join("pids")).unwrap_or_default();
        for pid in pids.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            if cmdline.contains("etcd") || cmdline.contains("kube-") {
                tracing::warn!(pid, run = %name, "killing a process left by an earlier test run");
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        let _ = std::fs::remove_dir_all(entry.path());
    }
}

/// A free TCP port on 127.0.0.1 (bound and released: the window in which another process could take it is short,
/// and a clash shows as a start-up failure naming the port).
pub fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}
