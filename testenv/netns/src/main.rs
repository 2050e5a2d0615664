//! `lb-testbed`: echo servers, load generator, long-lived connections and malformed-frame injector, meant to
//! run inside the test bed's network namespaces (`ip netns exec <ns> lb-testbed …`). Reports are JSON on
//! stdout; diagnostics go to stderr.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use lb_testbed::echo::{EchoConfig, EchoServer};
use lb_testbed::hold::{self, HoldConfig};
use lb_testbed::load::{self, LoadReport, TcpLoadConfig, UdpLoadConfig};
use lb_testbed::rawsend::{self, FrameParams, MalformedKind};
use lb_testbed::topology::{mac_string, parse_mac, Topology, TopologyConfig, DEFAULT_PREFIX};
use tokio::signal::unix::{signal, SignalKind};

#[derive(Parser)]
#[command(
    name = "lb-testbed",
    version,
    about = "Network-namespace test bed tools for the XDP load balancer"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// TCP/UDP echo server greeting with its id; runs until SIGTERM/SIGINT.
    Echo(EchoArgs),
    /// Opens many short TCP connections and/or UDP flows, verifies every byte, prints a JSON report.
    Load(LoadArgs),
    /// Keeps connections open exchanging numbered messages; prints per-connection breakage as JSON.
    Hold(HoldArgs),
    /// Sends malformed Ethernet frames on an interface via AF_PACKET; prints counts as JSON.
    Rawsend(RawsendArgs),
    /// The same frames as XDP live frames (`storm_gen` of lb-bench.o) for a while; prints counts as JSON.
    Stormgen(StormgenArgs),
    /// SYNs from spoofed sources to VIP:port, as fast as one socket sends, for a while; prints JSON.
    Synflood(SynfloodArgs),
    /// Creates a topology for manual experiments, prints it as JSON, tears it down on SIGINT/SIGTERM.
    Up(UpArgs),
    /// Attaches the test-only `xdp_pass` program to an interface until killed (veth peers of a natively
    /// attached load balancer need an XDP program to receive its `XDP_TX` frames).
    XdpPass {
        /// `xdp-pass.o` (built by `cargo xtask build-ebpf`).
        #[arg(long)]
        object: std::path::PathBuf,
        /// Interface (in the current namespace).
        #[arg(long)]
        iface: String,
    },
    /// The demo (`cargo xtask demo`): real traffic through the XDP load balancer, a backend stopped, a table.
    Demo {
        /// TCP connections in the first round.
        #[arg(long, default_value_t = 3000)]
        connections: usize,
        /// UDP flows in the first round.
        #[arg(long, default_value_t = 1000)]
        udp_flows: usize,
        /// Agent attach mode: xdp, xdp-generic or tc.
        #[arg(long, default_value = "xdp")]
        attach_mode: String,
    },
    /// Removes namespaces left behind by crashed runs (only those whose creating process is gone).
    Cleanup {
        /// Namespace name prefix.
        #[arg(long, default_value = DEFAULT_PREFIX)]
        prefix: String,
    },
}

#[derive(clap::Args)]
struct EchoArgs {
    /// Identity sent as greeting (`<id>\n`) and UDP reply prefix.
    #[arg(long)]
    id: String,
    /// TCP listen address (repeatable).
    #[arg(long)]
    tcp: Vec<SocketAddr>,
    /// UDP listen address (repeatable).
    #[arg(long)]
    udp: Vec<SocketAddr>,
}

#[derive(clap::Args)]
struct LoadArgs {
    /// TCP target (VIP:port).
    #[arg(long)]
    tcp: Option<SocketAddr>,
    /// TCP connections in total.
    #[arg(long, default_value_t = 1000)]
    connections: usize,
    /// Connections (and UDP flows) in flight at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Payload bytes per TCP connection and per UDP datagram (keep ≤ 1400 for UDP: no fragmentation).
    #[arg(long, default_value_t = 64)]
    payload: usize,
    /// UDP target (VIP:port).
    #[arg(long)]
    udp: Option<SocketAddr>,
    /// UDP flows (one fresh socket each).
    #[arg(long, default_value_t = 200)]
    udp_flows: usize,
    /// UDP retransmissions after a reply timeout.
    #[arg(long, default_value_t = 2)]
    udp_retries: u32,
    /// Bind UDP flow i to source port FIRST+i (distinct flows even when the kernel would reuse a freed
    /// ephemeral port); default: ephemeral ports.
    #[arg(long)]
    udp_first_port: Option<u16>,
    /// Timeout of each TCP operation (connect, greeting, echo, close), ms.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// Timeout of each UDP reply, ms.
    #[arg(long, default_value_t = 1000)]
    udp_timeout_ms: u64,
    /// Overall deadline per protocol, seconds.
    #[arg(long, default_value_t = 60.0)]
    deadline_secs: f64,
    /// Source address to bind TCP sockets to.
    #[arg(long)]
    bind: Option<IpAddr>,
    /// Exit with status 1 when anything failed (the report is printed anyway).
    #[arg(long)]
    strict: bool,
}

#[derive(clap::Args)]
struct HoldArgs {
    /// TCP target (VIP:port).
    #[arg(long)]
    tcp: Option<SocketAddr>,
    /// TCP connections to hold.
    #[arg(long, default_value_t = 100)]
    connections: usize,
    /// UDP target (VIP:port).
    #[arg(long)]
    udp: Option<SocketAddr>,
    /// UDP flows to hold.
    #[arg(long, default_value_t = 0)]
    udp_flows: usize,
    /// Message interval per connection, ms.
    #[arg(long, default_value_t = 100)]
    interval_ms: u64,
    /// Connect / round-trip timeout, ms; exceeding it breaks the connection.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// Message size in bytes.
    #[arg(long, default_value_t = 32)]
    message_size: usize,
    /// Hold this long after establishment, seconds; 0 = until stop file or SIGTERM/SIGINT.
    #[arg(long, default_value_t = 10.0)]
    duration_secs: f64,
    /// Stop when this file appears.
    #[arg(long)]
    stop_file: Option<PathBuf>,
    /// Create this file once every connection has been attempted.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Connects in flight at once while establishing.
    #[arg(long, default_value_t = 64)]
    connect_concurrency: usize,
    /// UDP: resend an unanswered message after this many ms (0 = never; one lost datagram breaks the flow).
    #[arg(long, default_value_t = 0)]
    udp_retry_ms: u64,
    /// Source address to bind to.
    #[arg(long)]
    bind: Option<IpAddr>,
    /// List only broken connections in the report.
    #[arg(long)]
    brief: bool,
    /// Exit with status 1 when any connection broke.
    #[arg(long)]
    strict: bool,
}

#[derive(clap::Args)]
struct SynfloodArgs {
    /// Interface to send on (in the current namespace).
    #[arg(long)]
    iface: String,
    /// Destination MAC (the load balancer's interface).
    #[arg(long)]
    dst_mac: String,
    /// Destination address (the VIP, IPv4 or IPv6).
    #[arg(long)]
    dst_ip: IpAddr,
    /// Destination port.
    #[arg(long, default_value_t = 80)]
    dst_port: u16,
    /// How long to flood, seconds.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Stop after this many SYNs (0: only the time counts).
    #[arg(long, default_value_t = 0)]
    max_frames: u64,
    /// SYNs per second at most (0: as fast as one socket sends).
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// Seed of the spoofed sources.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// The malformed frames' interface and addressing (`rawsend` and `stormgen`).
#[derive(clap::Args)]
struct FrameArgs {
    /// Interface to send on (in the current namespace).
    #[arg(long)]
    iface: String,
    /// Destination MAC (the load balancer's interface).
    #[arg(long)]
    dst_mac: String,
    /// Destination IPv4 (the VIP).
    #[arg(long)]
    dst_ip: Ipv4Addr,
    /// Source MAC; default: the interface's.
    #[arg(long)]
    src_mac: Option<String>,
    /// Source IPv4; default: the interface's first IPv4 address.
    #[arg(long)]
    src_ip: Option<Ipv4Addr>,
    /// Destination port of the TCP/UDP kinds.
    #[arg(long, default_value_t = 80)]
    dst_port: u16,
    /// Base source port.
    #[arg(long, default_value_t = 40000)]
    src_port: u16,
    /// Kinds to send (repeatable); default: all.
    #[arg(long = "kind", value_enum)]
    kinds: Vec<MalformedKind>,
}

impl FrameArgs {
    fn params(&self) -> Result<FrameParams> {
        Ok(FrameParams {
            src_mac: match &self.src_mac {
                Some(m) => parse_mac(m)?,
                None => rawsend::iface_mac(&self.iface)?,
            },
            dst_mac: parse_mac(&self.dst_mac)?,
            src_ip: match self.src_ip {
                Some(ip) => ip,
                None => iface_ipv4(&self.iface)?,
            },
            dst_ip: self.dst_ip,
            dst_port: self.dst_port,
            src_port: self.src_port,
        })
    }

    fn kinds(&self) -> Vec<MalformedKind> {
        if self.kinds.is_empty() {
            MalformedKind::ALL.to_vec()
        } else {
            self.kinds.clone()
        }
    }
}

#[derive(clap::Args)]
struct RawsendArgs {
    #[command(flatten)]
    frames: FrameArgs,
    /// Frames in total, cycling through the kinds.
    #[arg(long, default_value_t = 100)]
    count: u64,
    /// Instead of `--count`: send as fast as the socket takes them for this many seconds (a storm).
    #[arg(long)]
    seconds: Option<f64>,
}

#[derive(clap::Args)]
struct StormgenArgs {
    #[command(flatten)]
    frames: FrameArgs,
    /// `lb-bench.o` (built by `cargo xtask build-ebpf`), which holds `storm_gen`.
    #[arg(long)]
    object: PathBuf,
    /// Seconds of storm.
    #[arg(long)]
    seconds: f64,
    /// Live-frames batch size (frames per flush).
    #[arg(long, default_value_t = 64)]
    batch: u32,
}

#[derive(clap::Args)]
struct UpArgs {
    /// Number of backends.
    #[arg(long, default_value_t = 3)]
    backends: usize,
    /// Namespace name prefix.
    #[arg(long, default_value = DEFAULT_PREFIX)]
    prefix: String,
    /// Extra /32 address for the lb host (e.g. the VIP), repeatable.
    #[arg(long)]
    lb_addr: Vec<Ipv4Addr>,
}

fn main() {
    raise_nofile_limit();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(run(cli)) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("lb-testbed: error: {e:#}");
            std::process::exit(2);
        }
    }
}

/// Thousands of held connections need more than the usual 1024 descriptors: raise the soft limit to the hard.
fn raise_nofile_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid pointer to a local rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Resolves on SIGTERM or SIGINT.
async fn terminated() {
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
}

fn print_json<T: serde::Serialize>(v: &T) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

async fn run(cli: Cli) -> Result<i32> {
    match cli.cmd {
        Cmd::Echo(a) => {
            let cfg = EchoConfig {
                id: a.id,
                tcp: a.tcp,
                udp: a.udp,
            };
            let server = EchoServer::bind(&cfg).await?;
            // One machine-readable line once every socket is bound: callers wait for it instead of sleeping.
            println!(
                "{}",
                serde_json::json!({"ready": true, "id": cfg.id, "tcp": server.tcp_addrs(), "udp": server.udp_addrs()})
            );
            tokio::select! {
                r = server.serve() => r?,
                _ = terminated() => {},
            }
            Ok(0)
        }
        Cmd::Load(a) => {
            if a.tcp.is_none() && a.udp.is_none() {
                bail!("nothing to do: give --tcp and/or --udp");
            }
            let deadline = Duration::from_secs_f64(a.deadline_secs);
            let mut report = LoadReport::default();
            if let Some(target) = a.tcp {
                report.tcp = Some(
                    load::run_tcp(TcpLoadConfig {
                        target,
                        connections: a.connections,
                        concurrency: a.concurrency,
                        payload: a.payload,
                        op_timeout: Duration::from_millis(a.timeout_ms),
                        deadline,
                        bind: a.bind,
                    })
                    .await,
                );
            }
            if let Some(target) = a.udp {
                report.udp = Some(
                    load::run_udp(UdpLoadConfig {
                        target,
                        flows: a.udp_flows,
                        concurrency: a.concurrency,
                        payload: a.payload,
                        op_timeout: Duration::from_millis(a.udp_timeout_ms),
                        retries: a.udp_retries,
                        deadline,
                        first_port: a.udp_first_port,
                    })
                    .await,
                );
            }
            print_json(&report)?;
            let failed = report.tcp.as_ref().map_or(0, |r| r.failed)
                + report.udp.as_ref().map_or(0, |r| r.failed);
            Ok(if a.strict && failed > 0 { 1 } else { 0 })
        }
        Cmd::Hold(a) => {
            if a.tcp.is_none() && a.udp.is_none() {
                bail!("nothing to do: give --tcp and/or --udp");
            }
            let cfg = HoldConfig {
                tcp: a.tcp,
                connections: a.connections,
                udp: a.udp,
                udp_flows: a.udp_flows,
                interval: Duration::from_millis(a.interval_ms.max(1)),
                op_timeout: Duration::from_millis(a.timeout_ms),
                message_size: a.message_size.clamp(1, 60000),
                duration: (a.duration_secs > 0.0).then(|| Duration::from_secs_f64(a.duration_secs)),
                stop_file: a.stop_file,
                ready_file: a.ready_file,
                connect_concurrency: a.connect_concurrency,
                bind: a.bind,
                udp_retry: (a.udp_retry_ms > 0).then(|| Duration::from_millis(a.udp_retry_ms)),
            };
            let report = hold::run(cfg, terminated(), a.brief).await;
            print_json(&report)?;
            Ok(if a.strict && report.broken > 0 { 1 } else { 0 })
        }
        Cmd::Rawsend(a) => {
            let duration = a.seconds.map(Duration::from_secs_f64);
            let report = rawsend::send(
                &a.frames.iface,
                &a.frames.kinds(),
                a.count,
                duration,
                &a.frames.params()?,
            )?;
            print_json(&report)?;
            Ok(if report.errors.is_empty() { 0 } else { 1 })
        }
        Cmd::Stormgen(a) => {
            let report = lb_testbed::stormgen::storm(
                &a.object,
                &a.frames.iface,
                &a.frames.kinds(),
                Duration::from_secs_f64(a.seconds),
                a.batch,
                &a.frames.params()?,
            )?;
            print_json(&report)?;
            Ok(0)
        }
        Cmd::Synflood(a) => {
            let report = lb_testbed::synflood::flood(&lb_testbed::synflood::FloodConfig {
                src_mac: rawsend::iface_mac(&a.iface)?,
                dst_mac: parse_mac(&a.dst_mac)?,
                iface: a.iface,
                dst: a.dst_ip,
                dst_port: a.dst_port,
                duration: Duration::from_secs_f64(a.seconds),
                max_frames: a.max_frames,
                rate: a.rate,
                seed: a.seed,
            })?;
            print_json(&report)?;
            Ok(0)
        }
        Cmd::Up(a) => {
            let topo = Topology::new(TopologyConfig {
                backends: a.backends,
                prefix: a.prefix,
                ..TopologyConfig::default()
            })?;
            for ip in &a.lb_addr {
                topo.add_addr(lb_testbed::Host::Lb, *ip)?;
            }
            let hosts: Vec<_> = topo
                .hosts()
                .map(|h| {
                    serde_json::json!({"host": h.host.name(), "netns": h.netns, "ifname": h.ifname,
                        "ip": h.ip, "mac": mac_string(&h.mac), "switch_port": h.switch_port})
                })
                .collect();
            print_json(
                &serde_json::json!({"id": topo.id(), "switch_netns": topo.switch_netns(), "hosts": hosts}),
            )?;
            eprintln!("lb-testbed: topology {} up; Ctrl-C to tear down", topo.id());
            terminated().await;
            drop(topo);
            Ok(0)
        }
        Cmd::XdpPass { object, iface } => {
            let mut ebpf = aya::Ebpf::load_file(&object)
                .with_context(|| format!("loading {}", object.display()))?;
            let prog: &mut aya::programs::Xdp = ebpf
                .program_mut("xdp_pass")
                .context("xdp_pass not in the object")?
                .try_into()?;
            prog.load()?;
            prog.attach(&iface, aya::programs::XdpMode::Driver)
                .with_context(|| format!("attaching xdp_pass to {iface}"))?;
            println!("attached");
            terminated().await;
            drop(ebpf);
            Ok(0)
        }
        Cmd::Demo {
            connections,
            udp_flows,
            attach_mode,
        } => {
            let cfg = lb_testbed::demo::DemoConfig {
                connections,
                udp_flows,
                attach_mode,
            };
            let id = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
            let id2 = id.clone();
            let task = tokio::task::spawn_blocking(move || {
                lb_testbed::demo::run(&cfg, |t| *id2.lock().unwrap() = Some(t.to_string()))
            });
            tokio::select! {
                r = task => {
                    match r? {
                        Ok(()) => Ok(0),
                        Err(e) => {
                            eprintln!("lb-testbed: {e:#}");
                            Ok(1)
                        }
                    }
                }
                _ = terminated() => {
                    eprintln!("lb-testbed: interrupted; tearing down");
                    if let Some(t) = id.lock().unwrap().clone() {
                        lb_testbed::topology::remove_topology(&t)?;
                    }
                    Ok(130)
                }
            }
        }
        Cmd::Cleanup { prefix } => {
            let removed = Topology::cleanup_stale(&prefix)?;
            print_json(&serde_json::json!({ "removed": removed }))?;
            Ok(0)
        }
    }
}

/// First IPv4 address of `iface` (getifaddrs).
fn iface_ipv4(iface: &str) -> Result<Ipv4Addr> {
    let mut addrs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free below; every pointer is checked before use.
    unsafe {
        if libc::getifaddrs(&mut addrs) != 0 {
            return Err(std::io::Error::last_os_error()).context("getifaddrs");
        }
        let mut found = None;
        let mut cur = addrs;
        while !cur.is_null() {
            let ifa = &*cur;
            if !ifa.ifa_addr.is_null()
                && i32::from((*ifa.ifa_addr).sa_family) == libc::AF_INET
                && std::ffi::CStr::from_ptr(ifa.ifa_name).to_bytes() == iface.as_bytes()
            {
                let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                found = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
                break;
            }
            cur = ifa.ifa_next;
        }
        libc::freeifaddrs(addrs);
        found.with_context(|| format!("interface {iface:?} has no IPv4 address; pass --src-ip"))
    }
}
