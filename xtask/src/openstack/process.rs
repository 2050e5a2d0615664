//! Background processes with recorded PIDs: start one in its own process group with its output in a log file, tell
//! whether a recorded one still runs, and stop a group (the service and every worker it forked).

use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How one process is started and recorded.
pub struct Spec {
    /// Short name: PID file `<run>/<name>.pid`, log `<logs>/<name>.log`.
    pub name: String,
    pub command: Command,
}

/// Starts `spec` detached from our terminal and stdio: its own process group (so `stop` reaches its workers, and a
/// Ctrl-C of `cargo xtask` does not), stdin from /dev/null, stdout and stderr appended to its log file. Records the
/// PID and the process's start time. Holding none of our pipes matters in CI: a child that kept them open would keep
/// the runner waiting.
pub fn spawn(mut spec: Spec, run_dir: &Path, log_dir: &Path) -> Result<u32> {
    let log_path = log_dir.join(format!("{}.log", spec.name));
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let child = spec
        .command
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {} ({:?})", spec.name, spec.command.get_program()))?;
    let pid = child.id();
    // Our child cannot be reaped before we wait for it, so its /proc entry is there to read.
    let started = proc_stat(pid).map(|s| s.start_time).unwrap_or_default();
    let pid_file = pid_file(run_dir, &spec.name);
    std::fs::write(&pid_file, format!("{pid} {started}\n"))
        .with_context(|| format!("writing {}", pid_file.display()))?;
    // The Child is dropped without waiting: the process outlives xtask and is reaped by init once we exit.
    Ok(pid)
}

/// `<run>/<name>.pid`: "PID START_TIME".
pub fn pid_file(run_dir: &Path, name: &str) -> PathBuf {
    run_dir.join(format!("{name}.pid"))
}

/// The recorded PID of `name` if that process still runs and is still the one we started: same start time as
/// recorded, and leader of its own process group. A recycled PID is then never mistaken for ours (and never
/// signalled by `stop`). (The working directory or environment would not do: mariadbd changes directory, and
/// setproctitle overwrites the environment block of gunicorn and the nova services.)
pub fn running_pid(run_dir: &Path, name: &str) -> Option<u32> {
    let recorded = std::fs::read_to_string(pid_file(run_dir, name)).ok()?;
    let mut fields = recorded.split_whitespace();
    let pid: u32 = fields.next()?.parse().ok()?;
    let started: u64 = fields.next()?.parse().ok()?;
    let stat = proc_stat(pid)?;
    (stat.state != 'Z' && stat.pgrp == pid && stat.start_time == started).then_some(pid)
}

struct ProcStat {
    state: char,
    pgrp: u32,
    /// Clock ticks after boot.
    start_time: u64,
}

/// Fields of `/proc/<pid>/stat`.
fn proc_stat(pid: u32) -> Option<ProcStat> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid pgrp ...": comm may contain spaces and parentheses, so split after the last ')'.
    // Counting from state as 0, pgrp is field 2 and starttime field 19 (field 22 of proc(5)).
    let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split_whitespace().collect();
    Some(ProcStat {
        state: fields.first()?.chars().next()?,
        pgrp: fields.get(2)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

/// Live (non-zombie) processes of process group `pgid`.
pub fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| matches!(proc_stat(pid), Some(s) if s.pgrp == pgid && s.state != 'Z'))
        .collect()
}

/// Sends `signal` to every process of group `pgid`.
fn signal_group(pgid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) with a negative PID signals a process group; it touches no memory of ours.
    unsafe {
        libc::kill(-(pgid as libc::pid_t), signal);
    }
}

/// Stops the process group that `name`'s recorded PID leads: SIGTERM, then SIGKILL for whatever is left after
/// `grace`. Removes the PID file. A PID file whose process is gone is just removed.
pub fn stop(run_dir: &Path, name: &str, grace: Duration) -> Result<()> {
    let file = pid_file(run_dir, name);
    if let Some(pgid) = running_pid(run_dir, name) {
        signal_group(pgid, libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while !group_members(pgid).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
        }
        if !group_members(pgid).is_empty() {
            eprintln!(
                "openstack: {name} did not stop within {}s, killing it",
                grace.as_secs()
            );
            signal_group(pgid, libc::SIGKILL);
            let deadline = Instant::now() + Duration::from_secs(10);
            while !group_members(pgid).is_empty() {
                if Instant::now() > deadline {
                    bail!(
                        "{name} (process group {pgid}) survived SIGKILL: {:?}",
                        group_members(pgid)
                    );
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    match std::fs::remove_file(&file) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", file.display()))
        }
        _ => Ok(()),
    }
}

/// Whether something accepts TCP connections on 127.0.0.1:`port`.
pub fn port_open(port: u16) -> bool {
    TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(300),
    )
    .is_ok()
}

/// Whether an HTTP server on 127.0.0.1:`port` answers `GET /` with any status line.
pub fn http_answers(port: u16) -> bool {
    let attempt = || -> std::io::Result<bool> {
        let mut s = TcpStream::connect_timeout(
            &SocketAddr::from(([127, 0, 0, 1], port)),
            Duration::from_millis(500),
        )?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        s.write_all(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut buf = [0u8; 12];
        s.read_exact(&mut buf)?;
        Ok(buf.starts_with(b"HTTP/"))
    };
    attempt().unwrap_or(false)
}

/// The last `lines` lines of a log file, for error messages.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spawn_records_and_stop_ends_the_whole_group() {
        let dir = std::env::temp_dir().join(format!("lbtest-process-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A group with a worker: the shell forks a sleep, as gunicorn forks workers.
        let mut command = Command::new("sh");
        command.args(["-c", "sleep 60 & wait"]);
        let pid = spawn(
            Spec {
                name: "t".into(),
                command,
            },
            &dir,
            &dir,
        )
        .unwrap();
        assert_eq!(running_pid(&dir, "t"), Some(pid));
        let deadline = Instant::now() + Duration::from_secs(5);
        while group_members(pid).len() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(group_members(pid).len(), 2, "shell and sleep");

        // Same PID, other start time: a recycled PID is not ours.
        let real = std::fs::read_to_string(pid_file(&dir, "t")).unwrap();
        std::fs::write(pid_file(&dir, "t"), format!("{pid} 1\n")).unwrap();
        assert_eq!(running_pid(&dir, "t"), None);
        std::fs::write(pid_file(&dir, "t"), real).unwrap();

        stop(&dir, "t", Duration::from_secs(5)).unwrap();
        assert!(group_members(pid).is_empty());
        assert!(!pid_file(&dir, "t").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
