//! Long-lived connections: K TCP connections and U UDP flows kept open to a target, each exchanging a small
//! numbered message every interval and verifying the echo. The report says, per connection, whether it ever
//! broke and the longest gap between successful round trips — how tests prove "0 broken connections" across
//! backend changes and agent restarts.
//!
//! A broken connection stays broken (no reconnect): after a timeout the byte stream's position is unknown, and
//! reconnecting would hide exactly what the test wants to see.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::time::{timeout, MissedTickBehavior};

use crate::load::{io_kind, read_greeting, split_udp_reply, tcp_connect};

/// Settings of a hold run.
#[derive(Debug, Clone)]
pub struct HoldConfig {
    /// TCP target (VIP:port); `None` for no TCP connections.
    pub tcp: Option<SocketAddr>,
    /// Number of TCP connections.
    pub connections: usize,
    /// UDP target; `None` for no UDP flows.
    pub udp: Option<SocketAddr>,
    /// Number of UDP flows (one socket, i.e. one source port, each).
    pub udp_flows: usize,
    /// Time between two messages on one connection.
    pub interval: Duration,
    /// Timeout of connect and of each round trip; exceeding it breaks the connection.
    pub op_timeout: Duration,
    /// Size of each message in bytes (at least enough for the sequence number; padded).
    pub message_size: usize,
    /// Stop after this long once every connection is established; `None`: only stop file / stop future.
    pub duration: Option<Duration>,
    /// Stop when this file appears (polled every 50 ms).
    pub stop_file: Option<PathBuf>,
    /// Written (containing `ready`) once every connection has been attempted, so a test knows when to start
    /// disturbing the data path.
    pub ready_file: Option<PathBuf>,
    /// Connects in flight at once while establishing.
    pub connect_concurrency: usize,
    /// Optional source address.
    pub bind: Option<IpAddr>,
    /// UDP: resend an unanswered message after this long (like a DNS client), until `op_timeout`; `None`
    /// sends once, so a single lost datagram breaks the flow.
    pub udp_retry: Option<Duration>,
}

impl Default for HoldConfig {
    fn default() -> Self {
        Self {
            tcp: None,
            connections: 0,
            udp: None,
            udp_flows: 0,
            interval: Duration::from_millis(100),
            op_timeout: Duration::from_secs(5),
            message_size: 32,
            duration: Some(Duration::from_secs(10)),
            stop_file: None,
            ready_file: None,
            connect_concurrency: 64,
            bind: None,
            udp_retry: None,
        }
    }
}

/// The fate of one held connection or flow.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HeldConnection {
    /// Index within its protocol.
    pub index: usize,
    /// `tcp` or `udp`.
    pub proto: String,
    /// Local (source) port, 0 if the socket was never created.
    pub local_port: u16,
    /// Backend that answered first (TCP greeting / first UDP reply).
    pub backend: Option<String>,
    /// UDP only: every backend that answered, in order of first appearance (more than one = remapped flow).
    pub backends_seen: Vec<String>,
    /// UDP only: how many times consecutive replies came from different backends.
    pub backend_changes: u64,
    /// Whether the connection ever failed (connect error, reset, EOF, timeout, mismatch).
    pub broken: bool,
    /// Error kind when broken (same vocabulary as the load report, plus `echo_mismatch`).
    pub error: Option<String>,
    /// Seconds since the start of the run when it broke.
    pub error_at_s: Option<f64>,
    /// Successful round trips.
    pub round_trips: u64,
    /// Longest time between successful round trips (from establishment to the first one included), ms.
    pub max_gap_ms: f64,
}

/// What `lb-testbed hold` prints.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HoldReport {
    /// TCP connections requested.
    pub tcp_connections: usize,
    /// UDP flows requested.
    pub udp_flows: usize,
    /// Connections/flows that were established (TCP: greeting received; UDP: at least one reply).
    pub established: usize,
    /// Connections/flows that broke at any point (including failed establishment).
    pub broken: usize,
    /// Total successful round trips.
    pub round_trips: u64,
    /// Longest gap of any connection, ms.
    pub max_gap_ms: f64,
    /// Established TCP connections per backend.
    pub per_backend: BTreeMap<String, usize>,
    /// UDP flows per (first) backend.
    pub udp_per_backend: BTreeMap<String, usize>,
    /// Sum of UDP backend changes over all flows.
    pub udp_backend_changes: u64,
    /// Why the run stopped: `duration`, `stop_file`, `signal`.
    pub stop_reason: String,
    /// Seconds from start to stop.
    pub elapsed_s: f64,
    /// Per connection details (only the broken ones when the run was asked to be brief).
    pub connections: Vec<HeldConnection>,
}

struct Shared {
    cfg: HoldConfig,
    start: Instant,
    connect_gate: Semaphore,
}

fn message(proto: &str, index: usize, seq: u64, size: usize) -> Vec<u8> {
    let mut m = format!("{proto}{index}:{seq}:").into_bytes();
    // Pad to the configured size, newline-terminated.
    while m.len() + 1 < size {
        m.push(b'.');
    }
    m.push(b'\n');
    m
}

/// Ticker whose first tick is offset by `phase`, spreading connections across the interval.
fn ticker(interval: Duration, phase: Duration) -> tokio::time::Interval {
    let mut t = tokio::time::interval_at(tokio::time::Instant::now() + phase, interval);
    t.set_missed_tick_behavior(MissedTickBehavior::Delay);
    t
}

/// Waits for the next tick; `false` when the run is stopping.
async fn next_tick(t: &mut tokio::time::Interval, stop: &mut watch::Receiver<bool>) -> bool {
    if *stop.borrow() {
        return false;
    }
    tokio::select! {
        _ = t.tick() => !*stop.borrow(),
        _ = stop.changed() => false,
    }
}

struct Gaps {
    last_ok: Instant,
    max_gap: Duration,
    round_trips: u64,
}

impl Gaps {
    fn new() -> Self {
        Self {
            last_ok: Instant::now(),
            max_gap: Duration::ZERO,
            round_trips: 0,
        }
    }
    fn ok(&mut self) {
        let now = Instant::now();
        self.max_gap = self.max_gap.max(now - self.last_ok);
        self.last_ok = now;
        self.round_trips += 1;
    }
}

async fn hold_tcp(
    sh: Arc<Shared>,
    index: usize,
    established: mpsc::UnboundedSender<()>,
    mut stop: watch::Receiver<bool>,
) -> HeldConnection {
    let cfg = &sh.cfg;
    let target = cfg.tcp.expect("tcp target set");
    let mut rec = HeldConnection {
        index,
        proto: "tcp".into(),
        ..Default::default()
    };
    let fail = |rec: &mut HeldConnection, kind: String| {
        rec.broken = true;
        rec.error = Some(kind);
        rec.error_at_s = Some(sh.start.elapsed().as_secs_f64());
    };
    let setup = async {
        let _permit = sh
            .connect_gate
            .acquire()
            .await
            .expect("semaphore never closed");
        let stream = tcp_connect(target, cfg.bind, cfg.op_timeout).await?;
        let port = stream.local_addr().map(|a| a.port()).unwrap_or(0);
        let (rd, wr) = stream.into_split();
        let mut rd = BufReader::new(rd);
        let backend = read_greeting(&mut rd, cfg.op_timeout).await?;
        Ok::<_, String>((rd, wr, port, backend))
    };
    let res = setup.await;
    let _ = established.send(());
    let (mut rd, mut wr) = match res {
        Ok((rd, wr, port, backend)) => {
            rec.local_port = port;
            rec.backend = Some(backend);
            (rd, wr)
        }
        Err(kind) => {
            fail(&mut rec, kind);
            return rec;
        }
    };
    let n = cfg.connections.max(1) as u32;
    let mut tick = ticker(cfg.interval, cfg.interval * (index as u32 % n) / n);
    let mut gaps = Gaps::new();
    let mut back = vec![0u8; cfg.message_size.max(64)];
    let mut seq = 0u64;
    while next_tick(&mut tick, &mut stop).await {
        seq += 1;
        let msg = message("t", index, seq, cfg.message_size);
        let back = &mut back[..msg.len()];
        let rt = async {
            wr.write_all(&msg).await?;
            rd.read_exact(back).await
        };
        match timeout(cfg.op_timeout, rt).await {
            Err(_) => fail(&mut rec, "echo_timeout".into()),
            Ok(Err(e)) => fail(&mut rec, io_kind("echo", &e)),
            Ok(Ok(_)) if *back != msg[..] => fail(&mut rec, "echo_mismatch".into()),
            Ok(Ok(_)) => gaps.ok(),
        }
        if rec.broken {
            break;
        }
    }
    rec.round_trips = gaps.round_trips;
    rec.max_gap_ms = gaps.max_gap.as_secs_f64() * 1000.0;
    rec
}

async fn hold_udp(
    sh: Arc<Shared>,
    index: usize,
    established: mpsc::UnboundedSender<()>,
    mut stop: watch::Receiver<bool>,
) -> HeldConnection {
    let cfg = &sh.cfg;
    let target = cfg.udp.expect("udp target set");
    let mut rec = HeldConnection {
        index,
        proto: "udp".into(),
        ..Default::default()
    };
    let fail = |rec: &mut HeldConnection, kind: String| {
        rec.broken = true;
        rec.error = Some(kind);
        rec.error_at_s = Some(sh.start.elapsed().as_secs_f64());
    };
    let setup = async {
        let ip = cfg.bind.unwrap_or(if target.is_ipv4() {
            IpAddr::from([0u8; 4])
        } else {
            IpAddr::from([0u16; 8])
        });
        let sock = UdpSocket::bind(SocketAddr::new(ip, 0))
            .await
            .map_err(|e| io_kind("udp", &e))?;
        sock.connect(target).await.map_err(|e| io_kind("udp", &e))?;
        Ok::<_, String>(sock)
    };
    let res = setup.await;
    let _ = established.send(());
    let sock = match res {
        Ok(s) => s,
        Err(kind) => {
            fail(&mut rec, kind);
            return rec;
        }
    };
    rec.local_port = sock.local_addr().map(|a| a.port()).unwrap_or(0);
    let n = cfg.udp_flows.max(1) as u32;
    let mut tick = ticker(cfg.interval, cfg.interval * (index as u32 % n) / n);
    let mut gaps = Gaps::new();
    let mut buf = vec![0u8; cfg.message_size + 512];
    let mut seq = 0u64;
    while next_tick(&mut tick, &mut stop).await {
        seq += 1;
        let msg = message("u", index, seq, cfg.message_size);
        let retry = cfg.udp_retry.unwrap_or(cfg.op_timeout);
        let current = format!("u{index}:{seq}:").into_bytes();
        let rt = async {
            'send: loop {
                sock.send(&msg).await?;
                let resend_at = tokio::time::Instant::now() + retry;
                loop {
                    match tokio::time::timeout_at(resend_at, sock.recv(&mut buf)).await {
                        Err(_) => continue 'send,
                        Ok(Err(e)) => return Err(e),
                        // A late echo of an earlier, resent message: not an answer to this one.
                        Ok(Ok(len)) if is_older_echo(&buf[..len], index, &current) => continue,
                        Ok(Ok(len)) => return Ok(len),
                    }
                }
            }
        };
        match timeout(cfg.op_timeout, rt).await {
            Err(_) => fail(&mut rec, "echo_timeout".into()),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                fail(&mut rec, "refused".into())
            }
            Ok(Err(_)) => fail(&mut rec, "io_error".into()),
            Ok(Ok(len)) => match split_udp_reply(&buf[..len]) {
                None => fail(&mut rec, "invalid_reply".into()),
                Some((_, echoed)) if echoed != &msg[..] => fail(&mut rec, "echo_mismatch".into()),
                Some((backend, _)) => {
                    gaps.ok();
                    if rec.backend.is_none() {
                        rec.backend = Some(backend.clone());
                    }
                    if rec.backends_seen.last() != Some(&backend) {
                        if !rec.backends_seen.is_empty() {
                            rec.backend_changes += 1;
                        }
                        if !rec.backends_seen.contains(&backend) {
                            rec.backends_seen.push(backend);
                        }
                    }
                }
            },
        }
        if rec.broken {
            break;
        }
    }
    rec.round_trips = gaps.round_trips;
    rec.max_gap_ms = gaps.max_gap.as_secs_f64() * 1000.0;
    rec
}

/// Whether a UDP reply echoes an earlier message of flow `index` than the one starting with `current`.
fn is_older_echo(reply: &[u8], index: usize, current: &[u8]) -> bool {
    let Some((_, echoed)) = split_udp_reply(reply) else {
        return false;
    };
    let prefix = format!("u{index}:").into_bytes();
    echoed.starts_with(&prefix) && !echoed.starts_with(current)
}

/// Holds the connections until `cfg.duration` has passed after establishment, `cfg.stop_file` appears or
/// `stop` completes, whichever comes first; `brief` keeps only broken connections in the list.
pub async fn run(cfg: HoldConfig, stop: impl Future<Output = ()>, brief: bool) -> HoldReport {
    let sh = Arc::new(Shared {
        start: Instant::now(),
        connect_gate: Semaphore::new(cfg.connect_concurrency.max(1)),
        cfg: cfg.clone(),
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    let (est_tx, mut est_rx) = mpsc::unbounded_channel();
    let mut tasks = tokio::task::JoinSet::new();
    let tcp_n = if cfg.tcp.is_some() {
        cfg.connections
    } else {
        0
    };
    let udp_n = if cfg.udp.is_some() { cfg.udp_flows } else { 0 };
    for i in 0..tcp_n {
        tasks.spawn(hold_tcp(sh.clone(), i, est_tx.clone(), stop_rx.clone()));
    }
    for i in 0..udp_n {
        tasks.spawn(hold_udp(sh.clone(), i, est_tx.clone(), stop_rx.clone()));
    }
    drop(est_tx);

    let stop_file = cfg.stop_file.clone();
    let external = async move {
        tokio::select! {
            _ = stop => "signal",
            _ = async {
                match stop_file {
                    Some(p) => while !p.exists() { tokio::time::sleep(Duration::from_millis(50)).await },
                    None => std::future::pending().await,
                }
            } => "stop_file",
        }
    };
    tokio::pin!(external);

    let all_attempted = async {
        let mut n = 0;
        while n < tcp_n + udp_n && est_rx.recv().await.is_some() {
            n += 1;
        }
    };
    let reason = tokio::select! {
        r = &mut external => Some(r),
        _ = all_attempted => None,
    };
    let reason = match reason {
        Some(r) => r,
        None => {
            if let Some(p) = &cfg.ready_file {
                if let Err(e) = std::fs::write(p, "ready\n") {
                    eprintln!(
                        "lb-testbed hold: cannot write ready file {}: {e}",
                        p.display()
                    );
                }
            }
            let duration = cfg.duration;
            tokio::select! {
                r = &mut external => r,
                _ = async {
                    match duration {
                        Some(d) => tokio::time::sleep(d).await,
                        None => std::future::pending().await,
                    }
                } => "duration",
            }
        }
    };
    let _ = stop_tx.send(true);
    let elapsed = sh.start.elapsed().as_secs_f64();

    let mut conns = Vec::with_capacity(tcp_n + udp_n);
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok(c) => conns.push(c),
            Err(e) => conns.push(HeldConnection {
                proto: "?".into(),
                broken: true,
                error: Some(format!("task_failed: {e}")),
                ..Default::default()
            }),
        }
    }
    conns.sort_by(|a, b| (&a.proto, a.index).cmp(&(&b.proto, b.index)));

    let mut report = HoldReport {
        tcp_connections: tcp_n,
        udp_flows: udp_n,
        stop_reason: reason.into(),
        elapsed_s: elapsed,
        ..Default::default()
    };
    for c in &conns {
        if c.backend.is_some() {
            report.established += 1;
        }
        if c.broken {
            report.broken += 1;
        }
        report.round_trips += c.round_trips;
        report.max_gap_ms = report.max_gap_ms.max(c.max_gap_ms);
        report.udp_backend_changes += c.backend_changes;
        if let Some(b) = &c.backend {
            let map = if c.proto == "tcp" {
                &mut report.per_backend
            } else {
                &mut report.udp_per_backend
            };
            *map.entry(b.clone()).or_default() += 1;
        }
    }
    report.connections = if brief {
        conns.into_iter().filter(|c| c.broken).collect()
    } else {
        conns
    };
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_is_padded_and_terminated() {
        let m = message("t", 3, 7, 16);
        assert_eq!(m.len(), 16);
        assert!(m.starts_with(b"t3:7:"));
        assert_eq!(m.last(), Some(&b'\n'));
        // Never truncated below the header, even when the size is too small.
        assert!(message("t", 123, 456, 2).starts_with(b"t123:456:"));
    }
}
