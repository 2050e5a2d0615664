//! A load balancer under test: a [`Topology`] with echo servers on every backend, the real `lb-agent` in the
//! lb namespace with a LoadBalancer-shaped config file (or, with [`RigConfig::kubernetes`], in Kubernetes mode),
//! and the VIP on the lb's interface. Shared by the end-to-end tests and `lb-testbed demo`.

use crate::forward::Forward;
use crate::hold::HoldReport;
use crate::load::LoadReport;
use crate::synflood::FloodReport;
use crate::{ChildGuard, Host, Topology, TopologyConfig};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// TCP service port on the VIP and its NodePort on the backends.
pub const TCP_PORT: u16 = 80;
/// NodePort of the TCP service.
pub const TCP_NODE_PORT: u16 = 30080;
/// UDP service port on the VIP.
pub const UDP_PORT: u16 = 53;
/// NodePort of the UDP service.
pub const UDP_NODE_PORT: u16 = 30053;
/// Where the agent serves metrics inside the lb namespace.
pub const METRICS: &str = "127.0.0.1:9100";
/// Last octet of the VIP in the topology's /24.
pub const VIP_OCTET: u8 = 100;

/// How to build the rig.
#[derive(Clone, Debug)]
pub struct RigConfig {
    /// Backends in the topology.
    pub backends: usize,
    /// How many of them are in the initial config (the rest can be added later).
    pub configured_backends: usize,
    /// `--attach-mode` of the agent (`xdp`, `xdp-native`, `xdp-generic`, `tc`).
    pub attach_mode: String,
    /// The `lb-agent` binary.
    pub agent_bin: PathBuf,
    /// The `xdp-pass.o` test program (see `lb-ebpf/src/bin/xdp-pass.rs`).
    pub xdp_pass_obj: PathBuf,
    /// Extra `options:` lines of the LoadBalancer config (YAML, indented by two spaces).
    pub options: String,
    /// Extra agent flags.
    pub agent_args: Vec<String>,
    /// Topology settings.
    pub topology: TopologyConfig,
    /// Keep GRO on the bridge ports even with native XDP on the lb (only to show what it breaks: the
    /// bridge then hands the lb's veth super-packets, which single-buffer native XDP drops).
    pub bridge_gro_with_native_xdp: bool,
    /// Run the agent in Kubernetes mode instead of on the config file (`options` and `configured_backends` then
    /// have no effect: the LoadBalancer object says what to balance).
    pub kubernetes: Option<KubeAgent>,
}

/// The agent in Kubernetes mode: its configuration comes from its LoadBalancer object (see
/// `lb_testbed::kube_rig`, which creates the objects and this).
#[derive(Clone, Debug)]
pub struct KubeAgent {
    /// Kubernetes-mode flags (namespace, LoadBalancer and machine names) as the controller writes them into a
    /// VM's cloud-init, without `--interface` and `--kubeconfig`: the rig gives its own.
    pub args: Vec<String>,
    /// The machine's kubeconfig (written to the rig's directory).
    pub kubeconfig: String,
    /// The API server's address on this machine. A forwarder listens on the same address in the lb namespace, so
    /// the kubeconfig's server URL (and the serving certificate's IP) hold there as they do here.
    pub api_server: SocketAddr,
}

impl RigConfig {
    /// Defaults: 3 backends, native XDP, binaries found next to this one or under `target/`.
    pub fn new() -> Result<Self> {
        Ok(RigConfig {
            backends: 3,
            configured_backends: 3,
            attach_mode: "xdp".into(),
            agent_bin: find_artifact("LB_AGENT_BIN", "lb-agent")?,
            xdp_pass_obj: find_artifact("LB_XDP_PASS_OBJ", "bpf/xdp-pass.o")?,
            options: String::new(),
            agent_args: Vec::new(),
            topology: TopologyConfig::default(),
            bridge_gro_with_native_xdp: false,
            kubernetes: None,
        })
    }
}

/// Finds a build artifact: `$ENV`, else next to the running executable (or its parent, for test binaries in
/// `target/debug/deps`), else under `target/{debug,release}` of the workspace.
pub fn find_artifact(env: &str, rel: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(env) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let mut candidates = Vec::new();
    for dir in exe.ancestors().skip(1).take(3) {
        candidates.push(dir.join(rel));
    }
    let ws = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
    for d in ["debug", "release", ""] {
        candidates.push(ws.join(d).join(rel));
    }
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| {
            anyhow!("{rel} not found (set {env}, or build it: `cargo build -p lb-agent`, `cargo xtask build-ebpf`)")
        })
}

/// The running rig. Dropping it stops everything and removes the namespaces.
pub struct Rig {
    /// The namespaces.
    pub topo: Topology,
    /// The virtual IP (on the lb's interface).
    pub vip: Ipv4Addr,
    /// The IPv6 virtual IP, when the topology has IPv6 (a dual-stack load balancer).
    pub vip6: Option<Ipv6Addr>,
    /// Settings it was built with.
    pub cfg: RigConfig,
    echo: BTreeMap<usize, ChildGuard>,
    agent: Option<ChildGuard>,
    /// The API server forwarded into the lb namespace (Kubernetes mode).
    api_forward: Option<Forward>,
    xdp_pass: Vec<ChildGuard>,
    dir: PathBuf,
    pin_dir: PathBuf,
}

impl Rig {
    /// Builds the topology, starts the echo servers and the agent, and waits until the agent is ready.
    pub fn start(cfg: RigConfig) -> Result<Self> {
        Self::start_with(cfg, |_| {})
    }

    /// [`Rig::start`], telling `on_topology` the topology id first (for cleanup from a signal handler).
    pub fn start_with(cfg: RigConfig, on_topology: impl FnOnce(&str)) -> Result<Self> {
        let native_xdp = matches!(cfg.attach_mode.as_str(), "xdp" | "xdp-native");
        let mut topology = cfg.topology.clone();
        if native_xdp && !cfg.bridge_gro_with_native_xdp {
            // Frames must reach the lb's veth at wire size, as from a real NIC; the lb's bridge port gets
            // NAPI for XDP_TX from the xdp_pass program instead of GRO.
            topology.switch_port_gro = Some(false);
        }
        let topo = Topology::new(TopologyConfig {
            backends: cfg.backends,
            ..topology
        })?;
        on_topology(topo.id());
        let vip = topo.addr(VIP_OCTET);
        topo.add_addr(Host::Lb, vip)?;
        let vip6 = topology.ipv6.then(|| topo.addr6(VIP_OCTET));
        if let Some(vip6) = vip6 {
            topo.add_addr(Host::Lb, vip6)?;
        }
        let dir = std::env::temp_dir().join(format!("{}-rig", topo.id()));
        std::fs::create_dir_all(&dir)?;
        let pin_dir = pin_root()?.join(topo.id());
        let mut rig = Rig {
            topo,
            vip,
            vip6,
            cfg,
            echo: BTreeMap::new(),
            agent: None,
            api_forward: None,
            xdp_pass: Vec::new(),
            dir,
            pin_dir,
        };
        if native_xdp {
            rig.attach_xdp_pass()?;
        }
        for i in 1..=rig.cfg.backends {
            rig.start_backend(i)?;
        }
        if rig.cfg.kubernetes.is_none() {
            let n = rig.cfg.configured_backends;
            rig.write_config(
                &rig.config_yaml(&(1..=n).collect::<Vec<_>>(), &rig.cfg.options.clone()),
            )?;
        }
        rig.start_agent()?;
        Ok(rig)
    }

    /// The config file the agent reads.
    pub fn config_path(&self) -> PathBuf {
        self.dir.join("lb.yaml")
    }

    /// A LoadBalancer-shaped config with the given backends (1-based) and extra `options:` lines; dual-stack
    /// (both VIPs, each backend with both addresses) when the topology has IPv6.
    pub fn config_yaml(&self, backends: &[usize], options: &str) -> String {
        let nodes: Vec<Vec<IpAddr>> = backends
            .iter()
            .map(|i| {
                let h = self.topo.host(Host::Backend(*i));
                std::iter::once(IpAddr::from(h.ip))
                    .chain(h.ip6.map(IpAddr::from))
                    .collect()
            })
            .collect();
        let vips: Vec<IpAddr> = std::iter::once(IpAddr::from(self.vip))
            .chain(self.vip6.map(IpAddr::from))
            .collect();
        lb_config_yaml(&vips, &nodes, options)
    }

    /// Replaces the config file (atomically: the agent never reads half a file).
    pub fn write_config(&self, yaml: &str) -> Result<()> {
        let tmp = self.dir.join("lb.yaml.tmp");
        std::fs::write(&tmp, yaml)?;
        std::fs::rename(&tmp, self.config_path())?;
        Ok(())
    }

    /// Replaces the config and waits until the agent has applied it (its `lb_config_generation` moves on).
    pub fn update_config(&self, yaml: &str) -> Result<()> {
        let before = self.metric("lb_config_generation", "")?;
        self.write_config(yaml)?;
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.metric("lb_config_generation", "")? <= before {
            if Instant::now() > deadline {
                bail!(
                    "the agent did not apply the new config:\n{}",
                    self.agent_log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Starts the agent (pinning its state in a per-rig bpffs directory) and waits for `/readyz`.
    pub fn start_agent(&mut self) -> Result<()> {
        // The client's interface first (it carries the VIP), then the backends' in a routed topology.
        let interfaces: Vec<&str> = std::iter::once(self.topo.ifname(Host::Lb))
            .chain(self.topo.backend_side(Host::Lb).map(|b| b.ifname.as_str()))
            .collect();
        let mut argv: Vec<String> = vec![
            self.cfg.agent_bin.display().to_string(),
            "--interface".into(),
            interfaces.join(","),
            "--attach-mode".into(),
            self.cfg.attach_mode.clone(),
            "--pin-dir".into(),
            self.pin_dir.display().to_string(),
            "--max-flows".into(),
            "131072".into(),
            "--gc-interval".into(),
            "1".into(),
            "--metrics-address".into(),
            METRICS.into(),
        ];
        match self.cfg.kubernetes.clone() {
            None => argv.extend(["--config".into(), self.config_path().display().to_string()]),
            Some(k) => {
                if self.api_forward.is_none() {
                    self.api_forward = Some(Forward::start(
                        &self.topo,
                        Host::Lb,
                        k.api_server,
                        k.api_server,
                    )?);
                }
                let kubeconfig = self.dir.join("kubeconfig");
                std::fs::write(&kubeconfig, &k.kubeconfig)?;
                argv.push(format!("--kubeconfig={}", kubeconfig.display()));
                argv.extend(k.args);
            }
        }
        argv.extend(self.cfg.agent_args.iter().cloned());
        let child = self.topo.spawn(Host::Lb, &argv)?;
        self.agent = Some(child);
        self.wait_ready(Duration::from_secs(30))
    }

    /// Kills the agent with `signal` (e.g. `libc::SIGKILL`) and waits for it to be gone.
    pub fn kill_agent(&mut self, signal: i32) -> Result<String> {
        let mut a = self.agent.take().context("agent not running")?;
        a.signal(signal)?;
        a.wait_timeout(Duration::from_secs(10))?;
        Ok(a.stderr())
    }

    /// The agent's log so far.
    pub fn agent_log(&self) -> String {
        self.agent
            .as_ref()
            .map(|a| a.stderr() + &a.stdout())
            .unwrap_or_default()
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(a) = self.agent.as_mut() {
                if let Some(status) = a.try_wait()? {
                    bail!("agent exited ({status}):\n{}", self.agent_log());
                }
            }
            if let Ok(body) = self.http_get("/readyz") {
                if body.starts_with("ready") {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!("agent not ready after {timeout:?}:\n{}", self.agent_log());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts the echo server of backend `i` (1-based).
    pub fn start_backend(&mut self, i: usize) -> Result<()> {
        let c = spawn_echo(&self.topo, Host::Backend(i))?;
        self.echo.insert(i, c);
        Ok(())
    }

    /// Stops the echo server of backend `i`: the node stays, its NodePort refuses connections.
    pub fn stop_backend(&mut self, i: usize) -> Result<()> {
        if let Some(mut c) = self.echo.remove(&i) {
            c.kill();
        }
        Ok(())
    }

    /// GET on the agent's metrics listener from inside the lb namespace; returns the body.
    pub fn http_get(&self, path: &str) -> Result<String> {
        agent_http_get(&self.topo, Host::Lb, path)
    }

    /// The sum of every sample of metric `name` whose label text contains `labels` (e.g. `port="80"`).
    pub fn metric(&self, name: &str, labels: &str) -> Result<f64> {
        let body = self.http_get("/metrics")?;
        Ok(parse_metric(&body, name, labels))
    }

    /// The agent's pin directory (what `lbctl --pin-dir` reads).
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// `lbctl` with this rig's pin directory and `args`, to run in the lb's namespace as an operator on the VM
    /// would (the agent's bpffs view).
    pub fn lbctl_argv(&self, args: &[&str]) -> Result<Vec<String>> {
        let bin = find_artifact("LB_LBCTL_BIN", "lbctl")?;
        let mut argv = vec![
            bin.display().to_string(),
            "--pin-dir".into(),
            self.pin_dir.display().to_string(),
        ];
        argv.extend(args.iter().map(|a| a.to_string()));
        Ok(argv)
    }

    /// `lbctl --json <args>` in the lb's namespace: what the maps hold.
    pub fn lbctl_json(&self, args: &[&str]) -> Result<serde_json::Value> {
        let mut argv = self.lbctl_argv(&["--json"])?;
        argv.extend(args.iter().map(|a| a.to_string()));
        let out = self.topo.exec_unchecked(Host::Lb, &argv)?;
        if !out.status.success() {
            bail!(
                "lbctl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        serde_json::from_slice(&out.stdout).with_context(|| format!("lbctl {args:?} output"))
    }

    /// Runs `lb-testbed load` in the client namespace with `args` (targets default to the VIP services).
    pub fn load(&self, args: &[&str]) -> Result<LoadReport> {
        run_load(&self.topo, args)
    }

    /// Starts `lb-testbed synflood` in the client namespace: SYNs from spoofed sources to VIP:`port` for
    /// `seconds`, at most `rate` per second (0: as fast as one socket sends); [`Flood::finish`] waits for its
    /// report.
    pub fn start_synflood(&self, port: u16, seconds: f64, rate: u64) -> Result<Flood> {
        self.start_synflood_to(self.vip.into(), port, seconds, rate)
    }

    /// [`Self::start_synflood`] to `vip` (the IPv6 VIP, say).
    pub fn start_synflood_to(
        &self,
        vip: IpAddr,
        port: u16,
        seconds: f64,
        rate: u64,
    ) -> Result<Flood> {
        let bin = crate::binary_path()?;
        let child = self.topo.spawn(
            Host::Client,
            [
                bin.display().to_string(),
                "synflood".into(),
                "--iface".into(),
                self.topo.ifname(Host::Client).into(),
                "--dst-mac".into(),
                crate::topology::mac_string(&self.topo.mac(Host::Lb)),
                "--dst-ip".into(),
                vip.to_string(),
                "--dst-port".into(),
                port.to_string(),
                "--seconds".into(),
                seconds.to_string(),
                "--rate".into(),
                rate.to_string(),
            ],
        )?;
        Ok(Flood {
            child,
            timeout: Duration::from_secs_f64(seconds + 30.0),
        })
    }

    /// Starts `lb-testbed hold` in the client namespace; stop it with [`Hold::stop`].
    pub fn start_hold(&self, args: &[&str]) -> Result<Hold> {
        spawn_hold(&self.topo, &self.dir, args)
    }

    /// Attaches `xdp_pass` to the bridge side of the lb's veths (a veth needs it to receive `XDP_TX` and
    /// `XDP_REDIRECT` frames).
    fn attach_xdp_pass(&mut self) -> Result<()> {
        let obj = &self.cfg.xdp_pass_obj;
        self.xdp_pass
            .push(attach_xdp_pass(&self.topo, obj, Host::Lb)?);
        if let Some(b) = self.topo.backend_side(Host::Lb) {
            self.xdp_pass
                .push(xdp_pass_on_port(&self.topo, obj, &b.switch_port)?);
        }
        Ok(())
    }
}

/// A LoadBalancer-shaped config file: TCP [`TCP_PORT`] and UDP [`UDP_PORT`] on `vip` to the NodePorts of
/// `backends`, extra `options:` lines (YAML, indented by two spaces), fast health checks.
/// A LoadBalancer-shaped config: `vips` (the first as `vip`, a second of the other family in `vips`), the rig's
/// two ports, one endpoint per node with its addresses, extra `options:` lines.
pub fn lb_config_yaml(vips: &[IpAddr], backends: &[Vec<IpAddr>], options: &str) -> String {
    let list = |a: &[IpAddr]| {
        a.iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut y = format!("vip: {}\n", vips[0]);
    if vips.len() > 1 {
        y += &format!("vips: [{}]\n", list(&vips[1..]));
    }
    y += &format!(
        "ports:\n  - {{name: web, protocol: TCP, port: {TCP_PORT}, nodePort: {TCP_NODE_PORT}}}\n  - {{name: dns, protocol: UDP, port: {UDP_PORT}, nodePort: {UDP_NODE_PORT}}}\nendpoints:\n"
    );
    for (i, ips) in backends.iter().enumerate() {
        y += &format!("  - {{name: node-{}, addresses: [{}]}}\n", i + 1, list(ips));
    }
    y += "options:\n";
    y += if options.is_empty() {
        "  {}\n"
    } else {
        options
    };
    y += "healthCheck: {interval: 1s, timeout: 1s, unhealthyThreshold: 2, healthyThreshold: 1}\n";
    y
}

/// GET on the metrics listener ([`METRICS`]) of the agent in `host`'s namespace; returns the body.
pub fn agent_http_get(topo: &Topology, host: Host, path: &str) -> Result<String> {
    let path = path.to_string();
    topo.run_in(host, move || -> Result<String> {
        let mut s = TcpStream::connect_timeout(&METRICS.parse()?, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: lb\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string());
        body.context("no HTTP body")
    })?
}

/// Starts an echo server on `host` (a backend) on the TCP and UDP NodePorts and waits until it listens (on
/// both families when the topology has IPv6: one dual-stack socket each).
pub fn spawn_echo(topo: &Topology, host: Host) -> Result<ChildGuard> {
    let any = if topo.host(host).ip6.is_some() {
        "[::]"
    } else {
        "0.0.0.0"
    };
    spawn_echo_on(
        topo,
        host,
        &format!("{any}:{TCP_NODE_PORT}"),
        &format!("{any}:{UDP_NODE_PORT}"),
    )
}

/// Starts an echo server on `host` listening on `tcp` and `udp` (socket addresses) and waits until it listens.
pub fn spawn_echo_on(topo: &Topology, host: Host, tcp: &str, udp: &str) -> Result<ChildGuard> {
    let bin = crate::binary_path()?;
    let mut c = topo.spawn(
        host,
        [
            bin.display().to_string(),
            "echo".into(),
            "--id".into(),
            host.name(),
            "--tcp".into(),
            tcp.to_string(),
            "--udp".into(),
            udp.to_string(),
        ],
    )?;
    c.wait_for_stdout("\"ready\":true", Duration::from_secs(10))?;
    Ok(c)
}

/// Runs `lb-testbed load` in the client namespace of `topo` with `args`; returns its report.
pub fn run_load(topo: &Topology, args: &[&str]) -> Result<LoadReport> {
    let bin = crate::binary_path()?;
    let mut argv = vec![bin.display().to_string(), "load".into()];
    argv.extend(args.iter().map(|s| s.to_string()));
    let out = topo
        .spawn(Host::Client, &argv)?
        .finish(Duration::from_secs(120))?;
    serde_json::from_str(&out.stdout).with_context(|| {
        format!(
            "load output is not a report: {}\n{}",
            out.stdout, out.stderr
        )
    })
}

/// Starts `lb-testbed hold` in the client namespace of `topo` (stop and ready files under `dir`).
pub fn spawn_hold(topo: &Topology, dir: &Path, args: &[&str]) -> Result<Hold> {
    let bin = crate::binary_path()?;
    let stop = dir.join(format!("hold-stop-{}", rand_suffix()));
    let ready = dir.join(format!("hold-ready-{}", rand_suffix()));
    let mut argv = vec![
        bin.display().to_string(),
        "hold".into(),
        "--duration-secs".into(),
        "0".into(),
        "--stop-file".into(),
        stop.display().to_string(),
        "--ready-file".into(),
        ready.display().to_string(),
    ];
    argv.extend(args.iter().map(|s| s.to_string()));
    let child = topo.spawn(Host::Client, &argv)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready.exists() {
        if Instant::now() > deadline {
            bail!("hold never became ready: {}", child.stderr());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(Hold { child, stop })
}

/// Attaches `xdp_pass` to the bridge side of `host`'s veth (a veth needs it to receive `XDP_TX` frames).
pub fn attach_xdp_pass(topo: &Topology, obj: &Path, host: Host) -> Result<ChildGuard> {
    xdp_pass_on_port(topo, obj, topo.switch_port(host))
}

/// Attaches `xdp_pass` to bridge port `port` in the switch namespace.
fn xdp_pass_on_port(topo: &Topology, obj: &Path, port: &str) -> Result<ChildGuard> {
    let bin = crate::binary_path()?;
    let argv = vec![
        "ip".to_string(),
        "netns".into(),
        "exec".into(),
        topo.switch_netns().to_string(),
        bin.display().to_string(),
        "xdp-pass".into(),
        "--object".into(),
        obj.display().to_string(),
        "--iface".into(),
        port.to_string(),
    ];
    let mut c = ChildGuard::spawn(&argv, "xdp-pass@switch")?;
    c.wait_for_stdout("attached", Duration::from_secs(10))?;
    Ok(c)
}

impl Drop for Rig {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            a.kill();
        }
        self.api_forward.take();
        self.echo.clear();
        self.xdp_pass.clear();
        let _ = std::fs::remove_dir_all(&self.pin_dir);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A running `hold`.
pub struct Hold {
    child: ChildGuard,
    stop: PathBuf,
}

impl Hold {
    /// Stops it and returns its report.
    pub fn stop(self) -> Result<HoldReport> {
        std::fs::write(&self.stop, b"stop")?;
        let out = self.child.finish(Duration::from_secs(60))?;
        serde_json::from_str(&out.stdout).with_context(|| {
            format!(
                "hold output is not a report: {}\n{}",
                out.stdout, out.stderr
            )
        })
    }
}

/// A running `synflood`.
pub struct Flood {
    child: ChildGuard,
    /// How long it may still take: its duration and a margin.
    timeout: Duration,
}

impl Flood {
    /// Waits for the flood to end and returns its report.
    pub fn finish(self) -> Result<FloodReport> {
        let out = self.child.finish(self.timeout)?;
        serde_json::from_str(&out.stdout).with_context(|| {
            format!(
                "synflood output is not a report: {}\n{}",
                out.stdout, out.stderr
            )
        })
    }
}

/// A bpffs mount for the rigs' pinned state. `ip netns exec` remounts /sys, hiding /sys/fs/bpf, so the
/// agent pins under /run instead, which every namespace sees.
pub(crate) fn pin_root() -> Result<PathBuf> {
    let root = PathBuf::from("/run/lb-testbed-bpf");
    let mounts = std::fs::read_to_string("/proc/mounts")?;
    let mounted = mounts.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.get(1) == Some(&"/run/lb-testbed-bpf") && f.get(2) == Some(&"bpf")
    });
    if !mounted {
        std::fs::create_dir_all(&root)?;
        crate::process::run_cmd(["mount", "-t", "bpf", "bpf", "/run/lb-testbed-bpf"])
            .context("mounting a bpffs for pinned test state")?;
    }
    Ok(root)
}

pub(crate) fn rand_suffix() -> u64 {
    use std::time::SystemTime;
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Debian's BIRD 2 in network namespace `netns`, in the foreground with `conf` written to `<dir>/<name>.conf`;
/// returns it and its control socket (`<dir>/<name>.ctl`).
pub fn spawn_bird(
    netns: &str,
    dir: &Path,
    name: &str,
    conf: &str,
) -> Result<(ChildGuard, PathBuf)> {
    let base = dir.join(name);
    let conf_path = base.with_extension("conf");
    let sock = base.with_extension("ctl");
    std::fs::write(&conf_path, conf)?;
    let argv = [
        "ip".to_string(),
        "netns".into(),
        "exec".into(),
        netns.into(),
        "/usr/sbin/bird".into(),
        "-f".into(),
        "-c".into(),
        conf_path.display().to_string(),
        "-s".into(),
        sock.display().to_string(),
        "-P".into(),
        base.with_extension("pid").display().to_string(),
    ];
    let bird = ChildGuard::spawn(&argv, &format!("bird@{name}"))?;
    Ok((bird, sock))
}

/// Sums the samples of `name` (exact metric name) whose label text contains `labels`.
pub fn parse_metric(body: &str, name: &str, labels: &str) -> f64 {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, lab) = match series.split_once('{') {
                Some((n, rest)) => (n, rest),
                None => (series, ""),
            };
            (n == name && lab.contains(labels)).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_parse() {
        let body = "# HELP x\nlb_upstream_cx_total{protocol=\"TCP\",port=\"80\"} 7\nlb_upstream_cx_total{protocol=\"UDP\",port=\"53\"} 2\nlb_flow_table_entries{} 4\n";
        assert_eq!(
            parse_metric(body, "lb_upstream_cx_total", "port=\"80\""),
            7.0
        );
        assert_eq!(parse_metric(body, "lb_upstream_cx_total", ""), 9.0);
        assert_eq!(parse_metric(body, "lb_flow_table_entries", ""), 4.0);
        assert_eq!(parse_metric(body, "missing", ""), 0.0);
    }
}
