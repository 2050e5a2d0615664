//! [`Keepalived`]: runs, adopts, reloads, restarts and stops keepalived, and reports its state.

use super::parse::{log_line_is_warning, parse_data_state, parse_notify_line, strip_log_timestamp};
use super::render::{normalize_vips, render_config};
use super::{RunPaths, VrrpOptions, VrrpState, VrrpStats, INSTANCE_NAME, MAX_PRIORITY_BONUS};
use anyhow::{anyhow, bail, Context, Result};
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::net::IpAddr;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncBufReadExt, BufReader, Interest};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

/// First restart delay after keepalived died; doubled per consecutive failure up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(200);
/// Cap of the restart delay.
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// A keepalived that ran this long resets the backoff.
const STABLE_AFTER: Duration = Duration::from_secs(60);
/// How long a graceful stop may take (keepalived sleeps 1 s to send IGMP leaves; children get 5 s).
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to wait for a SIGUSR1/SIGUSR2 dump file.
const DUMP_TIMEOUT: Duration = Duration::from_secs(3);
/// A keepalived that has not reported a state after this long is signalled anyway if its VRRP child runs.
const READY_FALLBACK: Duration = Duration::from_secs(3);

/// keepalived, configured and supervised by the agent (see the [module documentation](super)).
///
/// Dropping it detaches: keepalived keeps running (and holding the VIP), and the next [`Keepalived::start`] with
/// the same run directory adopts it. [`Keepalived::stop`] stops it.
pub struct Keepalived {
    shared: Arc<Shared>,
    state_rx: watch::Receiver<VrrpState>,
    cmd_tx: mpsc::UnboundedSender<Cmd>,
    supervisor: Option<JoinHandle<()>>,
    readers: Vec<JoinHandle<()>>,
    adopted: bool,
    stats_lock: tokio::sync::Mutex<()>,
}

struct Shared {
    opts: VrrpOptions,
    paths: RunPaths,
    vips: Mutex<Vec<IpAddr>>,
    /// Bumped on every configuration written; the supervisor reloads keepalived until it ran the latest.
    config_gen: AtomicU64,
    /// keepalived's parent process, 0 while none runs.
    pid: AtomicI32,
    restarts: AtomicU64,
    state_tx: watch::Sender<VrrpState>,
}

enum Cmd {
    Reload,
    Stop(oneshot::Sender<()>),
}

impl Keepalived {
    /// Renders the configuration for `vips` into the run directory and runs keepalived with it — or, when a
    /// keepalived of this run directory is still alive (the agent restarted), adopts that one and reloads it, so
    /// the VIP does not move.
    ///
    /// A fresh start resets the track files to "unhealthy, no bonus": the machine takes the VIP only after
    /// [`Self::set_healthy`]. An adopted keepalived keeps the values the previous agent wrote. Needs a tokio
    /// runtime with IO and time enabled, and at least one VIP (keepalived refuses an instance without one).
    pub async fn start(opts: VrrpOptions, vips: Vec<IpAddr>) -> Result<Self> {
        let vips = normalize_vips(vips);
        let config = render_config(&opts, &vips)?;
        let paths = opts.paths();
        fs::create_dir_all(&paths.dir)
            .with_context(|| format!("creating {}", paths.dir.display()))?;
        fs::set_permissions(&paths.dir, fs::Permissions::from_mode(0o700))?;
        ensure_fifo(&paths.notify_fifo)?;
        ensure_fifo(&paths.log_fifo)?;
        // Our ends are opened read-write: we never see EOF when keepalived restarts, and keepalived's own
        // opens never block. The log FIFO must be open before keepalived's write end is.
        let (notify_rx, notify_backlog) = open_fifo_draining(&paths.notify_fifo)?;
        let log_rx = pipe::OpenOptions::new()
            .read_write(true)
            .open_receiver(&paths.log_fifo)
            .with_context(|| format!("opening {}", paths.log_fifo.display()))?;

        let running = running_keepalived(&paths);
        let (state_tx, state_rx) = watch::channel(VrrpState::Init);
        let shared = Arc::new(Shared {
            opts,
            paths,
            vips: Mutex::new(vips),
            config_gen: AtomicU64::new(1),
            pid: AtomicI32::new(0),
            restarts: AtomicU64::new(0),
            state_tx,
        });
        // Lines keepalived wrote while no agent was reading, in order; the data dump below supersedes them.
        for line in notify_backlog.lines() {
            shared.handle_notify_line(line);
        }
        write_atomic(&shared.paths.config, config.as_bytes())?;

        let (proc, adopted) = match running {
            Some(pid) => {
                tracing::info!(pid, "adopting the running keepalived");
                shared.pid.store(pid, Ordering::SeqCst);
                match shared.dump_state(pid).await {
                    Ok(state) => {
                        shared.state_tx.send_replace(state);
                    }
                    Err(e) => {
                        tracing::warn!(error = %format!("{e:#}"), "state of the adopted keepalived unknown")
                    }
                }
                signal(pid, libc::SIGHUP).context("reloading the adopted keepalived")?;
                (Proc::adopt(pid)?, true)
            }
            None => {
                write_atomic(&shared.paths.healthy, b"0\n")?;
                write_atomic(&shared.paths.priority_bonus, b"0\n")?;
                (shared.spawn()?, false)
            }
        };
        let applied_gen = shared.config_gen.load(Ordering::SeqCst);

        let readers = vec![
            tokio::spawn(read_notify(shared.clone(), notify_rx)),
            tokio::spawn(forward_log(log_rx)),
        ];
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let supervisor = tokio::spawn(supervise(shared.clone(), cmd_rx, proc, applied_gen));
        Ok(Keepalived {
            shared,
            state_rx,
            cmd_tx,
            supervisor: Some(supervisor),
            readers,
            adopted,
            stats_lock: tokio::sync::Mutex::new(()),
        })
    }

    /// Whether [`Self::start`] adopted a keepalived left running by a previous agent.
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    /// keepalived's (parent) process id, if one runs.
    pub fn pid(&self) -> Option<u32> {
        match self.shared.pid.load(Ordering::SeqCst) {
            0 => None,
            pid => Some(pid as u32),
        }
    }

    /// The VRRP state, updated from keepalived's notify FIFO as transitions happen.
    pub fn state(&self) -> watch::Receiver<VrrpState> {
        self.state_rx.clone()
    }

    /// How often keepalived died and was restarted.
    pub fn restarts(&self) -> u64 {
        self.shared.restarts.load(Ordering::SeqCst)
    }

    /// The VIPs keepalived is configured with (sorted).
    pub fn vips(&self) -> Vec<IpAddr> {
        self.shared.vips.lock().expect("vips lock").clone()
    }

    /// Whether this machine may hold the VIP: `false` while the data plane is not attached, the configuration is
    /// stale or flow sync has not finished. Unhealthy puts the instance in FAULT (the VIP moves away) within
    /// milliseconds. Writes the track file only when the value changes.
    pub fn set_healthy(&self, healthy: bool) -> io::Result<()> {
        write_if_changed(
            &self.shared.paths.healthy,
            if healthy { "1\n" } else { "0\n" },
        )
    }

    /// Priority bonus added to the base priority, e.g. for "this machine belongs to the newest revision";
    /// clamped to [`MAX_PRIORITY_BONUS`], and keepalived caps the sum at 254. With preemption, a machine whose
    /// priority now exceeds the master's takes the VIP.
    pub fn set_priority_bonus(&self, bonus: u8) -> io::Result<()> {
        let bonus = bonus.min(MAX_PRIORITY_BONUS);
        write_if_changed(&self.shared.paths.priority_bonus, &format!("{bonus}\n"))
    }

    /// Sets the VIPs: re-renders the configuration and reloads keepalived (SIGHUP) only when the set changed.
    /// Returns whether it changed. A reload keeps the state; the master sends an advert first.
    pub fn set_vips(&self, vips: Vec<IpAddr>) -> Result<bool> {
        let vips = normalize_vips(vips);
        let mut current = self.shared.vips.lock().expect("vips lock");
        if *current == vips {
            return Ok(false);
        }
        let config = render_config(&self.shared.opts, &vips)?;
        write_atomic(&self.shared.paths.config, config.as_bytes())?;
        *current = vips;
        self.shared.config_gen.fetch_add(1, Ordering::SeqCst);
        // The supervisor sends SIGHUP once keepalived can take it; if it is restarting, the new one reads the file.
        let _ = self.cmd_tx.send(Cmd::Reload);
        Ok(true)
    }

    /// keepalived's VRRP counters (SIGUSR2 → `keepalived.stats` in the run directory) and the current mastership.
    pub async fn stats(&self) -> Result<VrrpStats> {
        let _one_at_a_time = self.stats_lock.lock().await;
        let pid = self.shared.ready_pid()?;
        let path = &self.shared.paths.stats;
        remove_if_exists(path)?;
        signal(pid, libc::SIGUSR2)?;
        let is_master = *self.state_rx.borrow() == VrrpState::Master;
        wait_for_file(path, |text| {
            VrrpStats::parse(text, INSTANCE_NAME, is_master)
        })
        .await
        .context("keepalived did not write its stats")
    }

    /// yawol's keepalived metrics for `LoadBalancerMachine.status.metrics`: `keepalivedIsMaster`,
    /// `keepalivedBecameMaster`, `keepalivedReleasedMaster`, `keepalivedAdvertisementsSent`,
    /// `keepalivedAdvertisementsReceived`. Like yawol, a source that cannot be read is skipped: without stats
    /// only `keepalivedIsMaster` (from the live state) is returned.
    pub async fn yawol_metrics(&self) -> Vec<(String, String)> {
        match self.stats().await {
            Ok(stats) => stats.yawol_metrics(),
            Err(e) => {
                tracing::debug!(error = %format!("{e:#}"), "keepalived stats unavailable");
                let is_master = *self.state_rx.borrow() == VrrpState::Master;
                vec![(
                    "keepalivedIsMaster".to_string(),
                    u64::from(is_master).to_string(),
                )]
            }
        }
    }

    /// Stops keepalived gracefully (SIGTERM: it sends a priority-0 advert, so a backup takes over at once, and
    /// removes the VIPs), waits for it to exit (SIGKILL after 10 s) and stops supervising.
    pub async fn stop(mut self) -> Result<()> {
        let (done_tx, done_rx) = oneshot::channel();
        let result = if self.cmd_tx.send(Cmd::Stop(done_tx)).is_ok() {
            done_rx
                .await
                .map_err(|_| anyhow!("the keepalived supervisor ended unexpectedly"))
        } else {
            Err(anyhow!("the keepalived supervisor is not running"))
        };
        if let Some(task) = self.supervisor.take() {
            let _ = task.await;
        }
        for reader in self.readers.drain(..) {
            reader.abort();
        }
        result
    }
}

impl Drop for Keepalived {
    fn drop(&mut self) {
        // Detach, do not kill: keepalived outlives the agent on purpose.
        if let Some(task) = self.supervisor.take() {
            task.abort();
        }
        for reader in self.readers.drain(..) {
            reader.abort();
        }
    }
}

/// Runs `keepalived -t` (through the command prefix) on the configuration for `opts` and `vips`, written to
/// `keepalived.conf.check` in the run directory. The interface must exist where keepalived runs.
pub async fn check_config(opts: &VrrpOptions, vips: &[IpAddr]) -> Result<()> {
    let config = render_config(opts, &normalize_vips(vips.to_vec()))?;
    let paths = opts.paths();
    fs::create_dir_all(&paths.dir)?;
    let file = paths.dir.join("keepalived.conf.check");
    write_atomic(&file, config.as_bytes())?;
    let mut cmd = base_command(opts);
    cmd.arg("-t").arg("-f").arg(&file);
    let out = cmd.output().await.context("running keepalived -t")?;
    if !out.status.success() {
        bail!(
            "keepalived rejected the configuration ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(())
}

fn base_command(opts: &VrrpOptions) -> tokio::process::Command {
    let mut cmd = match opts.command_prefix.split_first() {
        Some((program, args)) => {
            let mut c = tokio::process::Command::new(program);
            c.args(args).arg(&opts.keepalived_bin);
            c
        }
        None => tokio::process::Command::new(&opts.keepalived_bin),
    };
    cmd.current_dir("/");
    cmd
}

impl Shared {
    /// Starts keepalived in the foreground with our files.
    fn spawn(&self) -> Result<Proc> {
        // keepalived refuses to start if a pid file names a live process; ours are stale by now.
        remove_if_exists(&self.paths.pid)?;
        remove_if_exists(&self.paths.vrrp_pid)?;
        // Non-blocking write end: with a full FIFO keepalived drops log lines instead of stalling VRRP.
        let log = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&self.paths.log_fifo)
            .with_context(|| format!("opening {}", self.paths.log_fifo.display()))?;
        let mut cmd = base_command(&self.opts);
        cmd.args(["-n", "-l", "-G", "-P", "-f"])
            .arg(&self.paths.config)
            .arg("-p")
            .arg(&self.paths.pid)
            .arg("-r")
            .arg(&self.paths.vrrp_pid)
            // Stats and data dumps go to $TMPDIR: per agent instead of /tmp.
            .env("TMPDIR", &self.paths.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            // Own process group: a Ctrl-C or a signal to the agent's group does not reach keepalived.
            .process_group(0)
            .kill_on_drop(false);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", self.opts.keepalived_bin.display()))?;
        let pid = child
            .id()
            .ok_or_else(|| anyhow!("keepalived exited immediately"))? as i32;
        self.pid.store(pid, Ordering::SeqCst);
        self.state_tx.send_replace(VrrpState::Init);
        tracing::info!(pid, config = %self.paths.config.display(), "keepalived started");
        Ok(Proc::Child {
            child,
            pid,
            started: Instant::now(),
        })
    }

    /// The pid to signal, once keepalived can take signals (before it installed its handlers, SIGHUP/USR1/USR2
    /// would kill it).
    fn ready_pid(&self) -> Result<i32> {
        let pid = self.pid.load(Ordering::SeqCst);
        if pid == 0 {
            bail!("keepalived is not running");
        }
        if self.state_tx.borrow().is_reported() || vrrp_child_alive(&self.paths) {
            Ok(pid)
        } else {
            bail!("keepalived is still starting")
        }
    }

    /// The instance state from a SIGUSR1 data dump.
    async fn dump_state(&self, pid: i32) -> Result<VrrpState> {
        remove_if_exists(&self.paths.data)?;
        signal(pid, libc::SIGUSR1)?;
        wait_for_file(&self.paths.data, |text| {
            parse_data_state(text, INSTANCE_NAME)
        })
        .await
        .context("keepalived did not write its data dump")
    }

    fn handle_notify_line(&self, line: &str) {
        let Some(n) = parse_notify_line(line) else {
            if !line.trim().is_empty() {
                tracing::debug!(line, "unrecognised keepalived notify line");
            }
            return;
        };
        if n.kind != "INSTANCE" || n.name != INSTANCE_NAME {
            return;
        }
        if let Some(state) = n.state() {
            let old = self.state_tx.send_replace(state);
            if old != state {
                tracing::info!(from = %old, to = %state, priority = n.priority, "VRRP state changed");
            }
        }
    }
}

/// A running keepalived: our child, or one adopted from a previous agent (watched through a pidfd).
enum Proc {
    Child {
        child: tokio::process::Child,
        pid: i32,
        started: Instant,
    },
    Adopted {
        pidfd: AsyncFd<OwnedFd>,
        pid: i32,
        started: Instant,
    },
}

impl Proc {
    fn adopt(pid: i32) -> Result<Self> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error()).context("pidfd_open on the adopted keepalived");
        }
        // SAFETY: the fd was just returned to us and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // SAFETY: the OwnedFd stays open, and is the same fd, for as long as the AsyncFd owns it.
        let pidfd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(|e| e.into_parts().1)
            .context("watching the adopted keepalived")?;
        Ok(Proc::Adopted {
            pidfd,
            pid,
            started: Instant::now(),
        })
    }

    fn pid(&self) -> i32 {
        match self {
            Proc::Child { pid, .. } | Proc::Adopted { pid, .. } => *pid,
        }
    }

    fn started(&self) -> Instant {
        match self {
            Proc::Child { started, .. } | Proc::Adopted { started, .. } => *started,
        }
    }

    /// Waits for the process to exit (cancel-safe); describes how it ended.
    async fn wait(&mut self) -> String {
        match self {
            Proc::Child { child, .. } => match child.wait().await {
                Ok(status) => status.to_string(),
                Err(e) => format!("wait failed: {e}"),
            },
            // A pidfd becomes readable when the process exits; not our child, so no exit status.
            Proc::Adopted { pidfd, .. } => match pidfd.readable().await {
                Ok(_) => "exited (adopted, status unknown)".to_string(),
                Err(e) => format!("pidfd failed: {e}"),
            },
        }
    }

    /// SIGTERM, then SIGKILL to its process group if it does not exit in time.
    async fn terminate(&mut self) {
        let pid = self.pid();
        if signal(pid, libc::SIGTERM).is_err() {
            return;
        }
        if tokio::time::timeout(STOP_TIMEOUT, self.wait())
            .await
            .is_err()
        {
            tracing::warn!(pid, "keepalived did not stop in time; killing it");
            // SAFETY: plain syscalls on a pid we started or verified.
            unsafe {
                if libc::getpgid(pid) == pid {
                    libc::kill(-pid, libc::SIGKILL);
                } else {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
            let _ = self.wait().await;
        }
    }
}

/// Keeps keepalived running: reloads it when the configuration changed, restarts it with capped backoff when it
/// dies, stops it on request.
async fn supervise(
    shared: Arc<Shared>,
    mut cmd_rx: mpsc::UnboundedReceiver<Cmd>,
    proc: Proc,
    mut applied_gen: u64,
) {
    enum Event {
        Exited(String),
        Stop(oneshot::Sender<()>),
        Detach,
        Recheck,
    }
    let mut state_rx = shared.state_tx.subscribe();
    let mut backoff = MIN_BACKOFF;
    let mut proc = Some(proc);
    loop {
        let Some(running) = proc.as_mut() else {
            // Not running: wait out the backoff (a stop request ends it), then start a new one. A reload request
            // needs nothing: the next keepalived reads the current file.
            let stop = tokio::select! {
                _ = tokio::time::sleep(backoff) => None,
                cmd = cmd_rx.recv() => match cmd {
                    Some(Cmd::Stop(done)) => Some(Some(done)),
                    Some(Cmd::Reload) => continue,
                    None => Some(None),
                },
            };
            if let Some(done) = stop {
                if let Some(done) = done {
                    let _ = done.send(());
                }
                return;
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
            applied_gen = shared.config_gen.load(Ordering::SeqCst);
            match shared.spawn() {
                Ok(p) => proc = Some(p),
                Err(e) => {
                    shared.restarts.fetch_add(1, Ordering::SeqCst);
                    tracing::error!(error = %format!("{e:#}"), retry_in = ?backoff, "cannot start keepalived");
                }
            }
            continue;
        };

        let wanted_gen = shared.config_gen.load(Ordering::SeqCst);
        let pending_reload = wanted_gen != applied_gen;
        if pending_reload {
            if let Ok(pid) = shared.ready_pid() {
                match signal(pid, libc::SIGHUP) {
                    Ok(()) => tracing::info!(pid, "keepalived reloading its configuration"),
                    Err(e) => tracing::warn!(error = %e, "cannot reload keepalived"),
                }
                applied_gen = wanted_gen;
                continue;
            }
        }
        let started = running.started();
        let pid = running.pid();
        let event = tokio::select! {
            how = running.wait() => Event::Exited(how),
            cmd = cmd_rx.recv() => match cmd {
                Some(Cmd::Reload) => Event::Recheck,
                Some(Cmd::Stop(done)) => Event::Stop(done),
                None => Event::Detach,
            },
            // A first reported state means keepalived now takes signals (a pending reload can go out).
            _ = state_rx.changed() => Event::Recheck,
            // Fallback for a pending reload when no state is reported.
            _ = tokio::time::sleep(READY_FALLBACK), if pending_reload => Event::Recheck,
        };
        match event {
            Event::Recheck => {}
            Event::Detach => return,
            Event::Exited(how) => {
                shared.pid.store(0, Ordering::SeqCst);
                shared.state_tx.send_replace(VrrpState::Stopped);
                let n = shared.restarts.fetch_add(1, Ordering::SeqCst) + 1;
                if started.elapsed() >= STABLE_AFTER {
                    backoff = MIN_BACKOFF;
                }
                tracing::warn!(pid, exit = %how, restarts = n, restart_in = ?backoff, "keepalived died; restarting it");
                proc = None;
            }
            Event::Stop(done) => {
                tracing::info!(pid, "stopping keepalived");
                running.terminate().await;
                shared.pid.store(0, Ordering::SeqCst);
                shared.state_tx.send_replace(VrrpState::Stopped);
                let _ = done.send(());
                return;
            }
        }
    }
}

/// Reads the notify FIFO for the life of the agent.
async fn read_notify(shared: Arc<Shared>, rx: pipe::Receiver) {
    let mut lines = BufReader::new(rx).lines();
    loop {
        match lines.next_line().await {
            Ok(Some(line)) => shared.handle_notify_line(&line),
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "reading keepalived's notify FIFO failed");
                return;
            }
        }
    }
}

/// Forwards keepalived's console output to `tracing` (target `keepalived`).
async fn forward_log(rx: pipe::Receiver) {
    let mut lines = BufReader::new(rx).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let msg = strip_log_timestamp(&line);
        // Every stats()/adoption dump makes keepalived log this; not worth an info line per scrape.
        if msg.starts_with("Printing VRRP") {
            tracing::debug!(target: "keepalived", "{msg}");
        } else if log_line_is_warning(msg) {
            tracing::warn!(target: "keepalived", "{msg}");
        } else {
            tracing::info!(target: "keepalived", "{msg}");
        }
    }
}

/// Opens the notify FIFO read-write and returns what is already buffered in it (whole lines from a keepalived
/// that ran while no agent read) together with a tokio receiver for the rest.
fn open_fifo_draining(path: &Path) -> Result<(pipe::Receiver, String)> {
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let mut backlog = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => backlog.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }
    // keepalived writes each line with one write() (< PIPE_BUF), so the backlog ends with a whole line.
    let rx = pipe::Receiver::from_file(file)?;
    Ok((rx, String::from_utf8_lossy(&backlog).into_owned()))
}

/// Creates a FIFO (mode 0600) unless one exists; an existing FIFO must be kept, because a running keepalived
/// holds it open (that is how a restarted agent keeps receiving its notifications and log).
fn ensure_fifo(path: &Path) -> Result<()> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_fifo() => return Ok(()),
        Ok(_) => fs::remove_file(path)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("inspecting {}", path.display())),
    }
    let c_path = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: mkfifo reads a NUL-terminated path.
    if unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) } != 0 {
        return Err(io::Error::last_os_error())
            .with_context(|| format!("mkfifo {}", path.display()));
    }
    Ok(())
}

/// The pid of a keepalived started with this run directory's configuration, if one is alive.
fn running_keepalived(paths: &RunPaths) -> Option<i32> {
    let pid = read_pid(&paths.pid)?;
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let mut args = cmdline.split(|b| *b == 0).filter(|a| !a.is_empty());
    let program = args.next()?;
    let is_keepalived = Path::new(std::ffi::OsStr::from_bytes(program))
        .file_name()
        .is_some_and(|n| n == "keepalived");
    // Guards against a reused pid: it must be keepalived, run with our configuration file.
    let config = paths.config.as_os_str().as_bytes();
    let ours = args.any(|a| a == config);
    // A zombie has an empty cmdline, so it fails the checks above.
    (is_keepalived && ours).then_some(pid)
}

fn vrrp_child_alive(paths: &RunPaths) -> bool {
    read_pid(&paths.vrrp_pid).is_some_and(|pid| {
        // SAFETY: signal 0 only checks for existence.
        unsafe { libc::kill(pid, 0) == 0 }
    })
}

fn read_pid(path: &Path) -> Option<i32> {
    let pid: i32 = fs::read_to_string(path).ok()?.trim().parse().ok()?;
    (pid > 0).then_some(pid)
}

fn signal(pid: i32, sig: i32) -> io::Result<()> {
    // SAFETY: plain syscall; pid > 0 is checked by callers (0 would signal our own group).
    if pid <= 0 || unsafe { libc::kill(pid, sig) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Polls for a dump file keepalived writes after a signal until `parse` accepts it.
async fn wait_for_file<T>(path: &Path, parse: impl Fn(&str) -> Option<T>) -> Result<T> {
    let deadline = Instant::now() + DUMP_TIMEOUT;
    loop {
        if let Ok(text) = fs::read_to_string(path) {
            if let Some(value) = parse(&text) {
                return Ok(value);
            }
        }
        if Instant::now() >= deadline {
            bail!("{} not written within {DUMP_TIMEOUT:?}", path.display());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Write-then-rename, so keepalived (inotify `IN_MOVED_TO`) never reads a half-written file.
fn write_atomic(path: &Path, contents: &[u8]) -> io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path without a file name"))?;
    let tmp = path.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    {
        let mut f = File::create(&tmp)?;
        io::Write::write_all(&mut f, contents)?;
    }
    fs::rename(&tmp, path)
}

fn write_if_changed(path: &Path, contents: &str) -> io::Result<()> {
    if fs::read_to_string(path).is_ok_and(|current| current == contents) {
        return Ok(());
    }
    write_atomic(path, contents.as_bytes())
}

fn remove_if_exists(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("lb-vrrp-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn atomic_writes_and_unchanged_skips() {
        let dir = tmpdir("write");
        let f = dir.join("healthy");
        write_if_changed(&f, "1\n").unwrap();
        let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&fs::metadata(p).unwrap());
        let first = inode(&f);
        write_if_changed(&f, "1\n").unwrap();
        assert_eq!(inode(&f), first, "unchanged value must not be rewritten");
        write_if_changed(&f, "0\n").unwrap();
        assert_eq!(fs::read_to_string(&f).unwrap(), "0\n");
        assert!(!dir.join(".healthy.tmp").exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fifo_is_created_once_and_kept() {
        let dir = tmpdir("fifo");
        let f = dir.join("notify.fifo");
        fs::write(&f, "not a fifo").unwrap();
        ensure_fifo(&f).unwrap();
        let meta = fs::symlink_metadata(&f).unwrap();
        assert!(meta.file_type().is_fifo());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let ino = std::os::unix::fs::MetadataExt::ino(&meta);
        ensure_fifo(&f).unwrap();
        assert_eq!(
            std::os::unix::fs::MetadataExt::ino(&fs::symlink_metadata(&f).unwrap()),
            ino
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn fifo_backlog_is_drained_in_order() {
        let dir = tmpdir("drain");
        let f = dir.join("notify.fifo");
        ensure_fifo(&f).unwrap();
        // A writer that keeps the FIFO open, as keepalived does (O_RDWR), writes before we read.
        let mut w = OpenOptions::new().read(true).write(true).open(&f).unwrap();
        io::Write::write_all(
            &mut w,
            b"INSTANCE \"lb_vip\" BACKUP 100\nINSTANCE \"lb_vip\" MASTER 100\n",
        )
        .unwrap();
        let (_rx, backlog) = open_fifo_draining(&f).unwrap();
        assert_eq!(
            backlog,
            "INSTANCE \"lb_vip\" BACKUP 100\nINSTANCE \"lb_vip\" MASTER 100\n"
        );
        drop(w);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn no_keepalived_without_pid_file_or_with_foreign_pid() {
        let dir = tmpdir("pid");
        let paths = RunPaths::new(&dir);
        assert_eq!(running_keepalived(&paths), None);
        // Our own pid is alive but not keepalived with our configuration.
        fs::write(&paths.pid, format!("{}\n", std::process::id())).unwrap();
        assert_eq!(running_keepalived(&paths), None);
        fs::remove_dir_all(&dir).unwrap();
    }
}
