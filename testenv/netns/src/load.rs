//! Load generator: many short TCP connections and many one-datagram UDP flows, every byte verified.
//!
//! Every operation has a timeout and the whole run an overall deadline, so a broken data path produces a
//! report full of error kinds rather than a hung test.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpSocket, UdpSocket};
use tokio::time::{timeout, timeout_at};

/// TCP load settings.
#[derive(Debug, Clone)]
pub struct TcpLoadConfig {
    /// Where to connect (the VIP and port, or a backend for the direct path).
    pub target: SocketAddr,
    /// Number of connections to open in total.
    pub connections: usize,
    /// How many are in flight at once.
    pub concurrency: usize,
    /// Random bytes sent and expected back on each connection.
    pub payload: usize,
    /// Timeout of each single operation (connect, greeting, echo, close).
    pub op_timeout: Duration,
    /// Overall deadline: whatever has not completed by then counts as failed with kind `deadline`.
    pub deadline: Duration,
    /// Optional source address to bind.
    pub bind: Option<IpAddr>,
}

impl TcpLoadConfig {
    /// Defaults: 1000 connections, 64 at a time, 64-byte payload, 5 s per operation, 60 s overall.
    pub fn new(target: SocketAddr) -> Self {
        Self {
            target,
            connections: 1000,
            concurrency: 64,
            payload: 64,
            op_timeout: Duration::from_secs(5),
            deadline: Duration::from_secs(60),
            bind: None,
        }
    }
}

/// UDP load settings.
#[derive(Debug, Clone)]
pub struct UdpLoadConfig {
    /// Where to send.
    pub target: SocketAddr,
    /// Number of flows; each uses its own freshly bound socket and sends one datagram.
    pub flows: usize,
    /// Source port of flow `i` is `first_port + i`, so every flow of a run (and of runs given disjoint ranges) is
    /// a distinct 5-tuple. `None`: the kernel picks an ephemeral port, and a port freed by a finished flow may be
    /// handed out again within the same run — the load balancer then rightly sees the later datagram as the same
    /// flow (about 8 of 1000 flows in the demo did that).
    pub first_port: Option<u16>,
    /// Flows in flight at once.
    pub concurrency: usize,
    /// Datagram size (keep it ≤ 1400 to avoid IP fragmentation).
    pub payload: usize,
    /// Wait for each reply.
    pub op_timeout: Duration,
    /// Retransmissions after a timeout before the flow counts as failed (reported as `retransmits`).
    pub retries: u32,
    /// Overall deadline.
    pub deadline: Duration,
}

impl UdpLoadConfig {
    /// Defaults: 200 flows, 64 at a time, 64-byte payload, 1 s per reply, 2 retries, 60 s overall.
    pub fn new(target: SocketAddr) -> Self {
        Self {
            target,
            flows: 200,
            concurrency: 64,
            payload: 64,
            op_timeout: Duration::from_secs(1),
            retries: 2,
            deadline: Duration::from_secs(60),
            first_port: None,
        }
    }
}

/// Latency summary in milliseconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Latency {
    /// Number of samples.
    pub samples: usize,
    /// Median.
    pub p50: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
    /// Maximum.
    pub max: f64,
    /// Mean.
    pub mean: f64,
}

impl Latency {
    /// Summarises samples given in milliseconds.
    pub fn from_ms(mut samples: Vec<f64>) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_by(f64::total_cmp);
        let rank = |p: f64| {
            samples[((p * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1]
        };
        Self {
            samples: samples.len(),
            p50: rank(0.50),
            p99: rank(0.99),
            max: *samples.last().unwrap_or(&0.0),
            mean: samples.iter().sum::<f64>() / samples.len() as f64,
        }
    }
}

/// Result of a TCP run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TcpReport {
    /// Target address.
    pub target: String,
    /// Connections requested.
    pub requested: usize,
    /// Connections fully verified (greeting, echo byte for byte, clean close).
    pub ok: usize,
    /// `requested - ok`.
    pub failed: usize,
    /// Failures by kind: `connect_refused`, `connect_timeout`, `connect_unreachable`, `connect_error_<errno>`,
    /// `greeting_timeout`, `greeting_eof`, `greeting_invalid`, `echo_timeout`, `echo_eof`, `echo_mismatch`,
    /// `trailing_data`, `close_timeout`, `reset`, `io_error`, `deadline`.
    pub errors: BTreeMap<String, usize>,
    /// Each failed connection: when it started and how it failed (for placing failures against an event such as a
    /// failover).
    #[serde(default)]
    pub failures: Vec<TcpFailure>,
    /// Verified connections per backend id (from the greeting).
    pub per_backend: BTreeMap<String, usize>,
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// Payload bytes received back (greetings excluded).
    pub bytes_received: u64,
    /// Time to establish each connection (successful connects only).
    pub connect_ms: Latency,
    /// Whole connection: connect to EOF (verified connections only).
    pub total_ms: Latency,
    /// Wall time of the run in seconds.
    pub elapsed_s: f64,
    /// `ok / elapsed_s`.
    pub connections_per_s: f64,
}

/// One failed connection of a TCP run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TcpFailure {
    /// When it started (its connect), in ms since the UNIX epoch.
    pub started_ms: u64,
    /// When it was given up, in ms since the UNIX epoch.
    pub ended_ms: u64,
    /// Its kind, as in [`TcpReport::errors`].
    pub kind: String,
    /// The client socket's state as the kernel saw it when the connection was given up (`TCP_INFO`: Linux's state
    /// number — 1 established, 4 and 5 FIN_WAIT1/2 —, retransmissions, unacknowledged segments, ms since the last
    /// data and ACK received), empty when it never connected: whether the client was waiting for the backend or
    /// retransmitting its own.
    #[serde(default)]
    pub socket: String,
}

/// Result of a UDP run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct UdpReport {
    /// Target address.
    pub target: String,
    /// Flows requested.
    pub requested: usize,
    /// Flows whose reply was verified.
    pub ok: usize,
    /// `requested - ok`.
    pub failed: usize,
    /// Failures by kind: `timeout`, `refused`, `invalid_reply`, `echo_mismatch`, `io_error`, `deadline`.
    pub errors: BTreeMap<String, usize>,
    /// Verified flows per backend id.
    pub per_backend: BTreeMap<String, usize>,
    /// Datagrams sent again after a timeout.
    pub retransmits: u64,
    /// Payload bytes sent (retransmissions included).
    pub bytes_sent: u64,
    /// Payload bytes received back.
    pub bytes_received: u64,
    /// Round-trip time of the successful attempt.
    pub rtt_ms: Latency,
    /// Wall time in seconds.
    pub elapsed_s: f64,
    /// `ok / elapsed_s`.
    pub flows_per_s: f64,
}

/// What `lb-testbed load` prints.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LoadReport {
    /// Present when TCP load was requested.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp: Option<TcpReport>,
    /// Present when UDP load was requested.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp: Option<UdpReport>,
}

/// Fast non-cryptographic generator for payloads (splitmix64): enough to catch misrouted or corrupted bytes.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded from the clock and `salt`.
    pub fn new(salt: u64) -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Self(t ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        v.truncate(n);
        v
    }
}

/// Maps an I/O error to a report kind, with `stage` as prefix for the common cases.
pub(crate) fn io_kind(stage: &str, e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe => {
            "reset".into()
        }
        ErrorKind::UnexpectedEof => format!("{stage}_eof"),
        ErrorKind::TimedOut => format!("{stage}_timeout"),
        ErrorKind::ConnectionRefused => format!("{stage}_refused"),
        ErrorKind::HostUnreachable | ErrorKind::NetworkUnreachable => {
            format!("{stage}_unreachable")
        }
        _ => "io_error".into(),
    }
}

struct TcpOk {
    backend: String,
    connect: Duration,
    total: Duration,
    payload: usize,
}

/// Connects with an optional source bind, mapping failures to report kinds.
pub(crate) async fn tcp_connect(
    target: SocketAddr,
    bind: Option<IpAddr>,
    op_timeout: Duration,
) -> Result<tokio::net::TcpStream, String> {
    let sock = if target.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }
    .map_err(|e| io_kind("connect", &e))?;
    if let Some(ip) = bind {
        sock.bind(SocketAddr::new(ip, 0))
            .map_err(|e| io_kind("connect", &e))?;
    }
    let stream = timeout(op_timeout, sock.connect(target))
        .await
        .map_err(|_| "connect_timeout".to_string())?
        .map_err(|e| match io_kind("connect", &e) {
            k if k.starts_with("connect_") => k,
            // Named by errno: a local failure (no free port, no buffers) reads differently from a network one.
            _ => format!("connect_error_{}", e.raw_os_error().unwrap_or(0)),
        })?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// Reads the `<id>\n` greeting.
pub(crate) async fn read_greeting<R: tokio::io::AsyncBufRead + Unpin>(
    rd: &mut R,
    op_timeout: Duration,
) -> Result<String, String> {
    let mut line = Vec::with_capacity(32);
    // `take` bounds the line: a peer that is not our echo server must not make us buffer forever.
    let n = timeout(
        op_timeout,
        (&mut *rd).take(256).read_until(b'\n', &mut line),
    )
    .await
    .map_err(|_| "greeting_timeout".to_string())?
    .map_err(|e| io_kind("greeting", &e))?;
    if n == 0 {
        return Err("greeting_eof".into());
    }
    if line.pop() != Some(b'\n') {
        return Err("greeting_invalid".into());
    }
    String::from_utf8(line).map_err(|_| "greeting_invalid".into())
}

/// A failed connection's kind, and its socket's state then (see [`TcpFailure::socket`]).
type TcpError = (String, String);

async fn one_tcp(cfg: &TcpLoadConfig, payload: Vec<u8>) -> Result<TcpOk, TcpError> {
    let start = Instant::now();
    let mut stream = tcp_connect(cfg.target, cfg.bind, cfg.op_timeout)
        .await
        .map_err(|kind| (kind, String::new()))?;
    let connect = start.elapsed();
    let r = exchange(cfg, payload, &mut stream).await;
    // TCP_INFO is read here, while the socket is still open.
    r.map(|(backend, payload)| TcpOk {
        backend,
        connect,
        total: start.elapsed(),
        payload,
    })
    .map_err(|kind| (kind, tcp_info(&stream)))
}

/// The greeting, the payload echoed and verified, the server's EOF: the backend's id and the payload's length.
async fn exchange(
    cfg: &TcpLoadConfig,
    payload: Vec<u8>,
    stream: &mut tokio::net::TcpStream,
) -> Result<(String, usize), String> {
    let (rd, mut wr) = stream.split();
    let mut rd = BufReader::new(rd);
    let backend = read_greeting(&mut rd, cfg.op_timeout).await?;

    // Write and read concurrently: a payload larger than the socket buffers would deadlock otherwise. The FIN
    // goes right after the payload, so the server echoes, sees EOF and closes: one exchange, no extra RTT.
    let write = async {
        wr.write_all(&payload).await?;
        wr.shutdown().await
    };
    let read = async {
        let mut back = vec![0u8; payload.len()];
        rd.read_exact(&mut back).await?;
        Ok::<_, std::io::Error>(back)
    };
    let (w, r) = timeout(cfg.op_timeout, async { tokio::join!(write, read) })
        .await
        .map_err(|_| "echo_timeout".to_string())?;
    w.map_err(|e| io_kind("echo", &e))?;
    let back = r.map_err(|e| io_kind("echo", &e))?;
    if back != payload {
        return Err("echo_mismatch".into());
    }
    let mut extra = [0u8; 64];
    let n = timeout(cfg.op_timeout, rd.read(&mut extra))
        .await
        .map_err(|_| "close_timeout".to_string())?
        .map_err(|e| io_kind("close", &e))?;
    if n != 0 {
        return Err("trailing_data".into());
    }
    Ok((backend, payload.len()))
}

/// `TCP_INFO` of `stream`, in a line (the fields an `ss -ti` reader looks at first).
fn tcp_info(stream: &tokio::net::TcpStream) -> String {
    use std::os::fd::AsRawFd;
    // SAFETY: tcp_info is plain data (all-zero is valid); getsockopt writes at most `len` bytes into it.
    let mut i: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            &mut i as *mut libc::tcp_info as *mut libc::c_void,
            &mut len,
        )
    };
    if rc != 0 {
        return String::new();
    }
    let local = stream
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    format!(
        "local={local} state={} ca_state={} retransmits={} backoff={} rto_ms={} unacked={} lost={} \
         total_retrans={} last_data_recv_ms={} last_ack_recv_ms={} last_data_sent_ms={}",
        i.tcpi_state,
        i.tcpi_ca_state,
        i.tcpi_retransmits,
        i.tcpi_backoff,
        i.tcpi_rto / 1000,
        i.tcpi_unacked,
        i.tcpi_lost,
        i.tcpi_total_retrans,
        i.tcpi_last_data_recv,
        i.tcpi_last_ack_recv,
        i.tcpi_last_data_sent,
    )
}

#[derive(Default)]
struct Tally {
    ok: usize,
    errors: BTreeMap<String, usize>,
    failures: Vec<TcpFailure>,
    per_backend: BTreeMap<String, usize>,
    bytes_sent: u64,
    bytes_received: u64,
    lat_a: Vec<f64>,
    lat_b: Vec<f64>,
    retransmits: u64,
}

impl Tally {
    fn merge(&mut self, o: Tally) {
        self.ok += o.ok;
        for (k, v) in o.errors {
            *self.errors.entry(k).or_default() += v;
        }
        self.failures.extend(o.failures);
        for (k, v) in o.per_backend {
            *self.per_backend.entry(k).or_default() += v;
        }
        self.bytes_sent += o.bytes_sent;
        self.bytes_received += o.bytes_received;
        self.lat_a.extend(o.lat_a);
        self.lat_b.extend(o.lat_b);
        self.retransmits += o.retransmits;
    }

    fn fail(&mut self, kind: String) {
        *self.errors.entry(kind).or_default() += 1;
    }

    /// A failed TCP connection, started at `started` and given up now.
    fn fail_tcp(&mut self, (kind, socket): TcpError, started: std::time::SystemTime) {
        self.failures.push(TcpFailure {
            started_ms: epoch_ms(started),
            ended_ms: epoch_ms(std::time::SystemTime::now()),
            kind: kind.clone(),
            socket,
        });
        self.fail(kind);
    }
}

/// `t` in ms since the UNIX epoch (the unit of [`TcpFailure`]).
pub fn epoch_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Runs `count` jobs with `concurrency` workers, each pulling the next index; returns the merged tally.
async fn run_workers<F, Fut>(count: usize, concurrency: usize, job: F) -> Tally
where
    F: Fn(usize, Tally) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Tally> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let job = Arc::new(job);
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..concurrency.clamp(1, count.max(1)) {
        let next = next.clone();
        let job = job.clone();
        set.spawn(async move {
            let mut tally = Tally::default();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break tally;
                }
                tally = job(i, tally).await;
            }
        });
    }
    let mut total = Tally::default();
    while let Some(t) = set.join_next().await {
        match t {
            Ok(t) => total.merge(t),
            Err(e) => total.fail(format!("worker_panic: {e}")),
        }
    }
    total
}

/// Opens `connections` TCP connections (`concurrency` at a time) and verifies each.
pub async fn run_tcp(cfg: TcpLoadConfig) -> TcpReport {
    let start = Instant::now();
    let deadline = tokio::time::Instant::now() + cfg.deadline;
    let cfg = Arc::new(cfg);
    let c = cfg.clone();
    let mut t = run_workers(cfg.connections, cfg.concurrency, move |i, mut t| {
        let cfg = c.clone();
        async move {
            let payload = Rng::new(i as u64).bytes(cfg.payload);
            let started = std::time::SystemTime::now();
            match timeout_at(deadline, one_tcp(&cfg, payload)).await {
                Err(_) => t.fail_tcp(("deadline".into(), String::new()), started),
                Ok(Err(e)) => t.fail_tcp(e, started),
                Ok(Ok(r)) => {
                    t.ok += 1;
                    *t.per_backend.entry(r.backend).or_default() += 1;
                    t.bytes_sent += r.payload as u64;
                    t.bytes_received += r.payload as u64;
                    t.lat_a.push(ms(r.connect));
                    t.lat_b.push(ms(r.total));
                }
            }
            t
        }
    })
    .await;
    let elapsed = start.elapsed().as_secs_f64();
    let failed = cfg.connections - t.ok;
    TcpReport {
        target: cfg.target.to_string(),
        requested: cfg.connections,
        ok: t.ok,
        failed,
        errors: std::mem::take(&mut t.errors),
        failures: std::mem::take(&mut t.failures),
        per_backend: std::mem::take(&mut t.per_backend),
        bytes_sent: t.bytes_sent,
        bytes_received: t.bytes_received,
        connect_ms: Latency::from_ms(std::mem::take(&mut t.lat_a)),
        total_ms: Latency::from_ms(std::mem::take(&mut t.lat_b)),
        elapsed_s: elapsed,
        connections_per_s: if elapsed > 0.0 {
            t.ok as f64 / elapsed
        } else {
            0.0
        },
    }
}

/// Splits an echo-server UDP reply into (backend id, echoed bytes).
pub(crate) fn split_udp_reply(reply: &[u8]) -> Option<(String, &[u8])> {
    let nl = reply.iter().position(|&b| b == b'\n')?;
    let id = std::str::from_utf8(&reply[..nl]).ok()?.to_string();
    Some((id, &reply[nl + 1..]))
}

struct UdpOk {
    backend: String,
    rtt: Duration,
    sent: u64,
    retransmits: u64,
}

async fn one_udp(cfg: &UdpLoadConfig, i: usize, payload: Vec<u8>) -> Result<UdpOk, String> {
    let port = match cfg.first_port {
        None => 0,
        Some(first) => u16::try_from(first as usize + i).map_err(|_| "source_port_range")?,
    };
    let local = SocketAddr::new(
        if cfg.target.is_ipv4() {
            Ipv4Addr::UNSPECIFIED.into()
        } else {
            Ipv6Addr::UNSPECIFIED.into()
        },
        port,
    );
    let sock = UdpSocket::bind(local)
        .await
        .map_err(|e| io_kind("udp", &e))?;
    // Connected: the kernel filters replies from other peers and reports ICMP port unreachable as ECONNREFUSED.
    sock.connect(cfg.target)
        .await
        .map_err(|e| io_kind("udp", &e))?;
    let mut buf = vec![0u8; payload.len() + 512];
    let mut sent = 0u64;
    for attempt in 0..=cfg.retries {
        let t0 = Instant::now();
        sock.send(&payload).await.map_err(|e| udp_kind(&e))?;
        sent += payload.len() as u64;
        match timeout(cfg.op_timeout, sock.recv(&mut buf)).await {
            Err(_) => continue,
            Ok(Err(e)) => return Err(udp_kind(&e)),
            Ok(Ok(n)) => {
                let rtt = t0.elapsed();
                let (backend, echoed) = split_udp_reply(&buf[..n]).ok_or("invalid_reply")?;
                if echoed != payload.as_slice() {
                    return Err("echo_mismatch".into());
                }
                return Ok(UdpOk {
                    backend,
                    rtt,
                    sent,
                    retransmits: attempt as u64,
                });
            }
        }
    }
    Err("timeout".into())
}

fn udp_kind(e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::ConnectionRefused => "refused".into(),
        _ => "io_error".into(),
    }
}

/// Sends one datagram on each of `flows` fresh sockets and verifies every reply.
pub async fn run_udp(cfg: UdpLoadConfig) -> UdpReport {
    let start = Instant::now();
    let deadline = tokio::time::Instant::now() + cfg.deadline;
    let cfg = Arc::new(cfg);
    let c = cfg.clone();
    let mut t = run_workers(cfg.flows, cfg.concurrency, move |i, mut t| {
        let cfg = c.clone();
        async move {
            let payload = Rng::new(i as u64 ^ 0x5555).bytes(cfg.payload);
            match timeout_at(deadline, one_udp(&cfg, i, payload)).await {
                Err(_) => t.fail("deadline".into()),
                Ok(Err(kind)) => t.fail(kind),
                Ok(Ok(r)) => {
                    t.ok += 1;
                    *t.per_backend.entry(r.backend).or_default() += 1;
                    t.bytes_sent += r.sent;
                    t.bytes_received += cfg.payload as u64;
                    t.retransmits += r.retransmits;
                    t.lat_a.push(ms(r.rtt));
                }
            }
            t
        }
    })
    .await;
    let elapsed = start.elapsed().as_secs_f64();
    UdpReport {
        target: cfg.target.to_string(),
        requested: cfg.flows,
        ok: t.ok,
        failed: cfg.flows - t.ok,
        errors: std::mem::take(&mut t.errors),
        per_backend: std::mem::take(&mut t.per_backend),
        retransmits: t.retransmits,
        bytes_sent: t.bytes_sent,
        bytes_received: t.bytes_received,
        rtt_ms: Latency::from_ms(std::mem::take(&mut t.lat_a)),
        elapsed_s: elapsed,
        flows_per_s: if elapsed > 0.0 {
            t.ok as f64 / elapsed
        } else {
            0.0
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_percentiles() {
        let l = Latency::from_ms((1..=100).map(f64::from).collect());
        assert_eq!((l.samples, l.p50, l.p99, l.max), (100, 50.0, 99.0, 100.0));
        assert_eq!(Latency::from_ms(vec![]), Latency::default());
        assert_eq!(Latency::from_ms(vec![3.0]).p99, 3.0);
    }

    #[test]
    fn udp_reply_split() {
        assert_eq!(
            split_udp_reply(b"backend-1\nabc"),
            Some(("backend-1".into(), &b"abc"[..]))
        );
        assert_eq!(split_udp_reply(b"no newline"), None);
    }

    #[test]
    fn rng_bytes_len() {
        let mut r = Rng::new(1);
        assert_eq!(r.bytes(13).len(), 13);
        assert_ne!(r.bytes(16), r.bytes(16));
    }
}
