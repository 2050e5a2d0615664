//! [`Bird`]: runs, reconfigures, restarts and stops BIRD, and reads its sessions' states.

use super::{
    is_last_reply_line, parse_protocols, prepare_run_dir, render_config, BgpOptions, BgpSession,
    BgpSnapshot,
};
use crate::ha::lock;
use anyhow::{Context, Result};
use std::collections::HashSet;
use std::net::IpAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// First restart delay after BIRD died; doubled per consecutive failure up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(200);
/// Cap of the restart delay.
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// A BIRD that ran this long resets the backoff.
const STABLE_AFTER: Duration = Duration::from_secs(60);
/// How long a graceful stop may take before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the sessions' states are read.
const POLL: Duration = Duration::from_secs(1);
/// A session first seen down this long ago and not established since is reported.
const PEER_WARN_AFTER: Duration = Duration::from_secs(30);
/// How long one control-socket exchange may take.
const SOCKET_TIMEOUT: Duration = Duration::from_secs(2);

/// BIRD, configured and supervised by the agent (see the [module documentation](super)). Dropping it stops the
/// supervisor, and BIRD with it.
pub struct Bird {
    announce_tx: watch::Sender<Vec<IpAddr>>,
    shared: Arc<Shared>,
    stop_tx: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Shared {
    sessions: Mutex<Vec<BgpSession>>,
    restarts: AtomicU64,
}

impl Bird {
    /// Starts BIRD announcing nothing; [`Self::announce`] says what to announce. Needs a tokio runtime with IO
    /// and time enabled, called from one of its worker threads (BIRD's parent-death signal follows the
    /// spawning thread).
    pub fn start(opts: BgpOptions) -> Result<Self> {
        opts.validate()?;
        prepare_run_dir(&opts.run_dir)
            .with_context(|| format!("creating {}", opts.run_dir.display()))?;
        let (announce_tx, announce_rx) = watch::channel(Vec::new());
        let (stop_tx, stop_rx) = oneshot::channel();
        let shared = Arc::new(Shared::default());
        let task = tokio::spawn(supervise(opts, announce_rx, shared.clone(), stop_rx));
        Ok(Bird {
            announce_tx,
            shared,
            stop_tx: Some(stop_tx),
            task: Some(task),
        })
    }

    /// Announces exactly `vips` (an empty list withdraws everything); BIRD is reconfigured when they changed.
    pub fn announce(&self, mut vips: Vec<IpAddr>) {
        vips.sort();
        vips.dedup();
        self.announce_tx.send_if_modified(|v| {
            let changed = *v != vips;
            if changed {
                tracing::info!(vips = ?vips, "BGP announcement changed");
                *v = vips;
            }
            changed
        });
    }

    /// What is announced and how the sessions are.
    pub fn snapshot(&self) -> BgpSnapshot {
        BgpSnapshot {
            announced: self.announce_tx.borrow().clone(),
            sessions: lock(&self.shared.sessions).clone(),
            restarts: self.shared.restarts.load(Ordering::Relaxed),
        }
    }

    /// Stops BIRD (its sessions close: the routers withdraw this replica at once).
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop_tx.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for Bird {
    fn drop(&mut self) {
        if let Some(tx) = self.stop_tx.take() {
            let _ = tx.send(());
        }
    }
}

/// Writes the config for `vips` (rename over the old one: BIRD never reads half a file).
fn write_config(opts: &BgpOptions, vips: &[IpAddr]) -> Result<()> {
    let path = opts.config_path();
    let tmp = path.with_extension("conf.tmp");
    std::fs::write(&tmp, render_config(opts, vips))
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))
}

fn spawn(opts: &BgpOptions) -> Result<tokio::process::Child> {
    let mut cmd = tokio::process::Command::new(&opts.bird_bin);
    cmd.arg("-f")
        .arg("-c")
        .arg(opts.config_path())
        .arg("-s")
        .arg(opts.socket_path())
        .arg("-P")
        .arg(opts.pid_path())
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            // A dead agent withdraws: BIRD must not announce for a replica nobody supervises.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", opts.bird_bin.display()))?;
    if let Some(err) = child.stderr.take() {
        tokio::spawn(async move {
            let mut lines = BufReader::new(err).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("<ERR>") || line.contains("<FATAL>") || line.contains("<WARN>") {
                    tracing::warn!(target: "bird", "{line}");
                } else {
                    tracing::info!(target: "bird", "{line}");
                }
            }
        });
    }
    Ok(child)
}

/// `show protocols` through the control socket.
async fn show_protocols(sock: &Path) -> std::io::Result<String> {
    let exchange = async {
        let mut s = BufReader::new(UnixStream::connect(sock).await?);
        let mut greeting = String::new();
        s.read_line(&mut greeting).await?;
        s.get_mut().write_all(b"show protocols\n").await?;
        let mut reply = String::new();
        loop {
            let mut line = String::new();
            if s.read_line(&mut line).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            let last = is_last_reply_line(line.trim_end_matches('\n'));
            reply.push_str(&line);
            if last {
                return Ok(reply);
            }
        }
    };
    tokio::time::timeout(SOCKET_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}

fn signal(child: &tokio::process::Child, sig: i32) {
    if let Some(pid) = child.id() {
        // SAFETY: kill(2) on our own child, which has not been reaped (`id` is None after that).
        unsafe { libc::kill(pid as i32, sig) };
    }
}

/// Runs BIRD until `stop`: restarts it when it dies, reconfigures it when the announcement changes, polls the
/// sessions.
async fn supervise(
    opts: BgpOptions,
    mut announce_rx: watch::Receiver<Vec<IpAddr>>,
    shared: Arc<Shared>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut backoff = MIN_BACKOFF;
    loop {
        let vips = announce_rx.borrow_and_update().clone();
        let run = async {
            write_config(&opts, &vips)?;
            spawn(&opts)
        };
        let started = Instant::now();
        match run.await {
            Ok(mut child) => {
                tracing::info!(pid = child.id(), "bird running");
                // BIRD answers on its socket once it has installed its signal handlers.
                let mut answered = false;
                let mut reload_pending = false;
                let mut down_since = std::collections::HashMap::<IpAddr, Instant>::new();
                let mut stuck = HashSet::<IpAddr>::new();
                let mut poll = tokio::time::interval(POLL);
                loop {
                    tokio::select! {
                        status = child.wait() => {
                            tracing::warn!(status = ?status, "bird exited; restarting");
                            shared.restarts.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        changed = announce_rx.changed() => {
                            if changed.is_err() {
                                // Every sender is gone: nothing will be announced again.
                                stop_child(child).await;
                                return;
                            }
                            let vips = announce_rx.borrow_and_update().clone();
                            match write_config(&opts, &vips) {
                                Ok(()) if answered => signal(&child, libc::SIGHUP),
                                Ok(()) => reload_pending = true,
                                Err(e) => tracing::error!(error = %format!("{e:#}"), "bird config"),
                            }
                        }
                        _ = poll.tick() => {
                            match show_protocols(&opts.socket_path()).await {
                                Ok(reply) => {
                                    answered = true;
                                    if std::mem::take(&mut reload_pending) {
                                        signal(&child, libc::SIGHUP);
                                    }
                                    let mut sessions = parse_protocols(&reply, &opts.peers);
                                    mark_stuck(&mut sessions, &mut down_since, &mut stuck);
                                    *lock(&shared.sessions) = sessions;
                                }
                                Err(e) if answered => {
                                    tracing::debug!(error = %e, "bird's control socket");
                                }
                                Err(_) => {}
                            }
                        }
                        _ = &mut stop => {
                            stop_child(child).await;
                            lock(&shared.sessions).clear();
                            return;
                        }
                    }
                }
                lock(&shared.sessions).clear();
            }
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "starting bird failed; retrying");
                shared.restarts.fetch_add(1, Ordering::Relaxed);
            }
        }
        if started.elapsed() >= STABLE_AFTER {
            backoff = MIN_BACKOFF;
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = &mut stop => return,
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Marks the sessions down for [`PEER_WARN_AFTER`] or longer as stuck (`stuck` remembers them), and logs when
/// one gets stuck and when it is established again.
fn mark_stuck(
    sessions: &mut [BgpSession],
    down_since: &mut std::collections::HashMap<IpAddr, Instant>,
    stuck: &mut HashSet<IpAddr>,
) {
    for s in sessions {
        if s.established {
            down_since.remove(&s.peer);
            if stuck.remove(&s.peer) {
                tracing::info!(peer = %s.peer, "BGP session established");
            }
            continue;
        }
        let since = *down_since.entry(s.peer).or_insert_with(Instant::now);
        if since.elapsed() >= PEER_WARN_AFTER && stuck.insert(s.peer) {
            tracing::warn!(peer = %s.peer, state = %s.info, "BGP session not established: the VIPs are not announced to this router");
        }
        s.stuck = stuck.contains(&s.peer);
    }
}

async fn stop_child(mut child: tokio::process::Child) {
    signal(&child, libc::SIGTERM);
    if tokio::time::timeout(STOP_TIMEOUT, child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(name: &str) -> BgpOptions {
        let dir = std::env::temp_dir().join(format!("lb-bgp-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut o = BgpOptions::new(65001, vec!["192.0.2.1".parse().unwrap()], 65000, dir);
        o.hold_time = Duration::from_secs(3);
        o.router_id = Some("192.0.2.2".parse().unwrap());
        o
    }

    async fn until(what: &str, mut ok: impl FnMut() -> bool) {
        let t = Instant::now();
        while !ok() {
            assert!(t.elapsed() < Duration::from_secs(10), "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn a_bird_that_cannot_start_is_retried_and_counted() {
        let mut o = opts("missing");
        o.bird_bin = "/nonexistent/bird".into();
        let b = Bird::start(o.clone()).unwrap();
        until("two failed starts", || b.snapshot().restarts >= 2).await;
        assert!(b.snapshot().sessions.is_empty());
        b.stop().await;
        std::fs::remove_dir_all(&o.run_dir).unwrap();
    }

    /// Debian's BIRD (bird2, a prerequisite of the test suite): it runs, reports its session, takes a new
    /// announcement by SIGHUP without a restart, and is gone after `stop`.
    #[tokio::test]
    async fn runs_real_bird_and_reconfigures_it() {
        let o = opts("real");
        let b = Bird::start(o.clone()).unwrap();
        until("BIRD to report its session", || {
            b.snapshot().sessions.len() == 1
        })
        .await;
        let s = &b.snapshot().sessions[0];
        assert_eq!(s.peer, o.peers[0]);
        assert!(!s.established, "{s:?}");
        let pid: i32 = std::fs::read_to_string(o.pid_path())
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        b.announce(vec!["192.0.2.100".parse().unwrap()]);
        until("the new config", || {
            std::fs::read_to_string(o.config_path())
                .is_ok_and(|c| c.contains("route 192.0.2.100/32 blackhole;"))
        })
        .await;
        // BIRD has taken it (the static protocol's route is in its table) and still runs as the same process.
        let t = Instant::now();
        loop {
            let out = tokio::process::Command::new("/usr/sbin/birdc")
                .arg("-s")
                .arg(o.socket_path())
                .args(["show", "route", "192.0.2.100/32"])
                .output()
                .await
                .unwrap();
            if String::from_utf8_lossy(&out.stdout).contains("192.0.2.100/32") {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "BIRD did not take the route"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(b.snapshot().restarts, 0);
        assert_eq!(
            b.snapshot().announced,
            vec!["192.0.2.100".parse::<IpAddr>().unwrap()]
        );
        b.stop().await;
        // SAFETY: kill with signal 0 only checks for the process.
        assert_ne!(unsafe { libc::kill(pid, 0) }, 0, "BIRD still runs");
        std::fs::remove_dir_all(&o.run_dir).unwrap();
    }
}
