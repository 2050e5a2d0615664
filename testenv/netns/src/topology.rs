//! The network-namespace topology: one L2 segment (a Linux bridge in a "switch" namespace) with a client, a
//! load-balancer host and N backends attached by veth pairs.
//!
//! ```text
//!             switch namespace (bridge br0)
//!   p-client ─┬─ p-lb ─┬─ p-b1 ─┬─ p-b2 ─┬─ …
//!      │          │        │        │
//!    eth0       eth0     eth0     eth0        (one namespace each)
//!   client .10  lb .2  backend-1 .11  backend-2 .12 …
//! ```
//!
//! A routed topology ([`TopologyConfig::routed`]) puts the backends on a second bridge in the switch namespace,
//! reached by the load balancer's second interface ([`BACKEND_IFNAME`]) and routing everything else through it.
//!
//! A client router ([`Topology::add_client_router`]) puts the client's traffic to chosen destinations behind a
//! router namespace on the segment, as an upstream router in front of a load balancer's replicas (ECMP).
//!
//! Every veth pair is created directly between the switch namespace and the host namespace (`ip -n <sw> link
//! add … peer … netns <host>`), so nothing ever appears in the caller's namespace and parallel topologies cannot
//! collide on interface names; only namespace names are global, and those carry prefix + pid + counter.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fmt;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

use crate::process::render;
pub use crate::process::{binary_path, is_root, preflight, run_cmd, ChildGuard, ChildOutput};

/// Default prefix of every namespace name created by this crate.
pub const DEFAULT_PREFIX: &str = "lbt";

/// Name of the bridge inside the switch namespace.
pub const BRIDGE: &str = "br0";

/// The backends' bridge of a routed topology ([`TopologyConfig::routed`]).
pub const BACKEND_BRIDGE: &str = "br1";

/// The load balancer's interface on the backends' segment of a routed topology.
pub const BACKEND_IFNAME: &str = "eth1";

/// Per-process counter making names unique between topologies of one process (parallel tests).
static TOPOLOGY_COUNTER: AtomicU32 = AtomicU32::new(0);

/// A host of the topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Host {
    /// The traffic source, 10.200.0.10 by default.
    Client,
    /// The load-balancer host, 10.200.0.2 by default (the caller adds the VIP).
    Lb,
    /// Backend `i`, 1-based (`Backend(1)` is `backend-1`, 10.200.0.11 by default).
    Backend(usize),
    /// Load-balancer replica `i` (2-based: [`Host::Lb`] is the first), 10.200.0.(1+i) by default, for
    /// high-availability setups sharing a VIP ([`TopologyConfig::lb_replicas`]).
    LbReplica(usize),
}

impl Host {
    /// Name used in namespace names and as the echo server id: `client`, `lb`, `backend-<i>`.
    pub fn name(&self) -> String {
        match self {
            Host::Client => "client".into(),
            Host::Lb => "lb".into(),
            Host::Backend(i) => format!("backend-{i}"),
            Host::LbReplica(i) => format!("lb-{i}"),
        }
    }

    /// Last octet of the host's address in the /24.
    pub fn octet(&self) -> u8 {
        match self {
            Host::Client => 10,
            Host::Lb => 2,
            Host::Backend(i) => 10 + *i as u8,
            Host::LbReplica(i) => 1 + *i as u8,
        }
    }

    /// Name of the host's port on the bridge (in the switch namespace; ≤ 15 chars).
    fn switch_port(&self) -> String {
        match self {
            Host::Client => "p-client".into(),
            Host::Lb => "p-lb".into(),
            Host::Backend(i) => format!("p-b{i}"),
            Host::LbReplica(i) => format!("p-lb{i}"),
        }
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// Settings of a [`Topology`].
#[derive(Debug, Clone)]
pub struct TopologyConfig {
    /// Prefix of the namespace names (keep it short; [`Topology::cleanup_stale`] matches on it).
    pub prefix: String,
    /// Number of backends (1..=80).
    pub backends: usize,
    /// Network address of the /24 (last octet must be 0).
    pub subnet: Ipv4Addr,
    /// Name of the host-side interface in every host namespace.
    pub host_ifname: String,
    /// GRO on the host-side veths: `None` leaves the kernel default.
    pub host_gro: Option<bool>,
    /// GRO on the bridge ports in the switch namespace. On by default: a veth only receives frames sent by
    /// `XDP_TX`/`XDP_REDIRECT` on its peer when it has NAPI (GRO on or an XDP program), otherwise the kernel
    /// silently drops them — which is exactly the path the load balancer's replies take.
    pub switch_port_gro: Option<bool>,
    /// Widen the client's ephemeral port range and allow TIME_WAIT reuse, so connection benchmarks that open
    /// tens of thousands of short connections are not limited by the client's port space.
    pub tune_client: bool,
    /// Load-balancer hosts: [`Host::Lb`] plus [`Host::LbReplica`] 2..=n (1..=5).
    pub lb_replicas: usize,
    /// Keep IPv6 on (off by default): with it, every interface emits MLD reports that land in the load balancer's
    /// counters and make "exactly N dropped" assertions flaky. With it on, every host also gets an IPv6 address
    /// ([`TopologyConfig::ip6`], a /64 without duplicate-address detection), and router solicitations are off.
    pub ipv6: bool,
    /// Backends on a segment of their own: the next /24 ([`TopologyConfig::backend_subnet`], bridge
    /// [`BACKEND_BRIDGE`]), which the load balancer reaches by a second interface ([`BACKEND_IFNAME`], `.2`
    /// there) and through which the backends route everything else, as behind a router: the client's segment
    /// never sees them. IPv4 only, one load balancer.
    pub routed: bool,
    /// Queues of every veth (each end, each direction; 1 by default). A veth's receive queue is where its peer's
    /// frames land (by the sending CPU for `XDP_TX`/`XDP_REDIRECT`, by the skb's queue otherwise), and each queue
    /// has a NAPI instance of its own: with one queue, frames sent on several CPUs at once all end up in one
    /// softirq, as on a single-queue NIC.
    pub queues: usize,
}

impl Default for TopologyConfig {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.into(),
            backends: 3,
            subnet: Ipv4Addr::new(10, 200, 0, 0),
            host_ifname: "eth0".into(),
            host_gro: None,
            switch_port_gro: Some(true),
            tune_client: true,
            lb_replicas: 1,
            ipv6: false,
            routed: false,
            queues: 1,
        }
    }
}

impl TopologyConfig {
    /// The address `host` will have: known before the topology exists, for objects that name it (a
    /// LoadBalancer's endpoints).
    pub fn ip(&self, host: Host) -> Ipv4Addr {
        match host {
            Host::Backend(_) if self.routed => {
                let o = self.backend_subnet().octets();
                Ipv4Addr::new(o[0], o[1], o[2], host.octet())
            }
            _ => self.addr(host.octet()),
        }
    }

    /// The backends' segment of a routed topology: the /24 after `subnet`.
    pub fn backend_subnet(&self) -> Ipv4Addr {
        let o = self.subnet.octets();
        Ipv4Addr::new(o[0], o[1], o[2] + 1, 0)
    }

    /// An address in the /24 by last octet (see [`Topology::addr`]).
    pub fn addr(&self, last_octet: u8) -> Ipv4Addr {
        let o = self.subnet.octets();
        Ipv4Addr::new(o[0], o[1], o[2], last_octet)
    }

    /// The IPv6 address `host` has when [`TopologyConfig::ipv6`] is on.
    pub fn ip6(&self, host: Host) -> Ipv6Addr {
        self.addr6(host.octet())
    }

    /// An address in the topology's IPv6 /64 by "last octet": `fd00:<subnet's first three octets>::<octet>`, so
    /// each host's two addresses end alike.
    pub fn addr6(&self, last_octet: u8) -> Ipv6Addr {
        let o = self.subnet.octets();
        Ipv6Addr::new(
            0xfd00,
            o[0] as u16,
            o[1] as u16,
            o[2] as u16,
            0,
            0,
            0,
            last_octet as u16,
        )
    }
}

/// Everything a caller needs to know about one host.
#[derive(Debug, Clone)]
pub struct HostInfo {
    /// Which host.
    pub host: Host,
    /// Network namespace name (`ip netns exec <netns> …`).
    pub netns: String,
    /// Interface name inside the namespace.
    pub ifname: String,
    /// Primary IPv4 address (/24).
    pub ip: Ipv4Addr,
    /// IPv6 address (/64), when the topology has IPv6.
    pub ip6: Option<Ipv6Addr>,
    /// Deterministic MAC address of `ifname`: `02:00:` + the four bytes of `ip`.
    pub mac: [u8; 6],
    /// Name of the peer interface (bridge port) in the switch namespace.
    pub switch_port: String,
    /// The load balancer's interface on the backends' segment of a routed topology.
    pub backend_side: Option<Side>,
}

/// A second interface of a host, on another segment.
#[derive(Debug, Clone)]
pub struct Side {
    /// Interface name inside the namespace.
    pub ifname: String,
    /// Its address (/24).
    pub ip: Ipv4Addr,
    /// Its MAC (`02:00:` + the four bytes of `ip`).
    pub mac: [u8; 6],
    /// Its bridge port in the switch namespace.
    pub switch_port: String,
}

/// A router between the client and the segment ([`Topology::add_client_router`]).
#[derive(Debug, Clone)]
pub struct ClientRouter {
    /// Its network namespace.
    pub netns: String,
    /// Its address on the segment (the next hop the load balancers' routing peers see).
    pub ip: Ipv4Addr,
    /// The client's address behind it: the source of the client's traffic through the router.
    pub client_ip: Ipv4Addr,
}

/// A created topology. Dropping it kills every process left in its namespaces and deletes them (also while
/// unwinding from a panic).
#[derive(Debug)]
pub struct Topology {
    id: String,
    switch_ns: String,
    hosts: BTreeMap<Host, HostInfo>,
    subnet: Ipv4Addr,
    /// Namespaces created so far: a half-built topology is torn down by `Drop` too.
    created: Vec<String>,
}

impl Topology {
    /// Creates the default topology (client, lb, 3 backends, 10.200.0.0/24).
    pub fn create() -> Result<Self> {
        Self::new(TopologyConfig::default())
    }

    /// Creates a topology with `backends` backends and otherwise default settings.
    pub fn with_backends(backends: usize) -> Result<Self> {
        Self::new(TopologyConfig {
            backends,
            ..TopologyConfig::default()
        })
    }

    /// Creates a topology. Needs root, `ip` (iproute2) and `ethtool`.
    pub fn new(cfg: TopologyConfig) -> Result<Self> {
        preflight()?;
        if cfg.backends == 0 || cfg.backends > 80 {
            bail!("backends must be in 1..=80, got {}", cfg.backends);
        }
        if cfg.subnet.octets()[3] != 0 {
            bail!(
                "subnet must be a /24 network address ending in .0, got {}",
                cfg.subnet
            );
        }
        if cfg.host_ifname.is_empty() || cfg.host_ifname.len() > 15 {
            bail!("interface name {:?} must be 1..=15 chars", cfg.host_ifname);
        }
        if cfg.prefix.is_empty()
            || cfg.prefix.contains('/')
            || cfg.prefix.contains(char::is_whitespace)
        {
            bail!("invalid namespace prefix {:?}", cfg.prefix);
        }
        let n = TOPOLOGY_COUNTER.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}-{}-{}", cfg.prefix, std::process::id(), n);
        let switch_ns = format!("{id}-sw");
        if cfg.lb_replicas == 0 || cfg.lb_replicas > 5 {
            bail!("lb_replicas must be in 1..=5, got {}", cfg.lb_replicas);
        }
        if cfg.routed && (cfg.lb_replicas > 1 || cfg.ipv6) {
            bail!("a routed topology has one load balancer and IPv4 only");
        }
        let mut all = vec![Host::Client, Host::Lb];
        all.extend((2..=cfg.lb_replicas).map(Host::LbReplica));
        all.extend((1..=cfg.backends).map(Host::Backend));
        let hosts: BTreeMap<Host, HostInfo> = all
            .into_iter()
            .map(|h| {
                let ip = cfg.ip(h);
                let o = ip.octets();
                let info = HostInfo {
                    host: h,
                    netns: format!("{id}-{}", h.name()),
                    ifname: cfg.host_ifname.clone(),
                    ip,
                    ip6: cfg.ipv6.then(|| cfg.ip6(h)),
                    mac: [0x02, 0x00, o[0], o[1], o[2], o[3]],
                    switch_port: h.switch_port(),
                    backend_side: (cfg.routed && h == Host::Lb).then(|| {
                        let b = cfg.backend_subnet().octets();
                        Side {
                            ifname: BACKEND_IFNAME.into(),
                            ip: Ipv4Addr::new(b[0], b[1], b[2], h.octet()),
                            mac: [0x02, 0x00, b[0], b[1], b[2], h.octet()],
                            switch_port: format!("{}-b", h.switch_port()),
                        }
                    }),
                };
                (h, info)
            })
            .collect();
        let mut topo = Topology {
            id,
            switch_ns,
            hosts,
            subnet: cfg.subnet,
            created: Vec::new(),
        };
        // On error `topo` is dropped here, which removes whatever was already created.
        topo.build(&cfg)?;
        Ok(topo)
    }

    fn build(&mut self, cfg: &TopologyConfig) -> Result<()> {
        let sw = self.switch_ns.clone();
        self.add_netns(&sw)?;
        self.prepare_netns(&sw, cfg)?;
        let bridges: &[&str] = if cfg.routed {
            &[BRIDGE, BACKEND_BRIDGE]
        } else {
            &[BRIDGE]
        };
        for bridge in bridges {
            // STP off and no forward delay: ports forward immediately. Multicast snooping off: nothing to learn
            // here.
            run_cmd([
                "ip",
                "-n",
                &sw,
                "link",
                "add",
                bridge,
                "type",
                "bridge",
                "stp_state",
                "0",
                "forward_delay",
                "0",
                "mcast_snooping",
                "0",
            ])?;
            run_cmd(["ip", "-n", &sw, "link", "set", bridge, "up"])?;
        }
        // When br_netfilter is loaded (it is on many hosts, e.g. for Docker), a bridge hands IPv4 frames to
        // netfilter and first *validates* them: bad IHL, total length or header checksum are dropped on the
        // switch. A switch must be dumb, or malformed-frame tests never reach the load balancer and its
        // checksum bugs are hidden. `-e`: the keys only exist while br_netfilter is loaded.
        run_cmd([
            "ip",
            "netns",
            "exec",
            &sw,
            "sysctl",
            "-q",
            "-e",
            "-w",
            "net.bridge.bridge-nf-call-iptables=0",
            "net.bridge.bridge-nf-call-ip6tables=0",
            "net.bridge.bridge-nf-call-arptables=0",
        ])?;

        let infos: Vec<HostInfo> = self.hosts.values().cloned().collect();
        for h in &infos {
            self.add_netns(&h.netns)?;
            let ns = h.netns.as_str();
            self.prepare_netns(ns, cfg)?;
            if matches!(h.host, Host::Lb | Host::LbReplica(_)) {
                // As the VM image does: the host's own connections (health checks among them) take the top ports,
                // the agent's SNAT (`--snat-ports auto`) the ones below.
                sysctl(ns, &["net.ipv4.ip_local_port_range=60000 65535"])?;
            }
            let bridge = match h.host {
                Host::Backend(_) if cfg.routed => BACKEND_BRIDGE,
                _ => BRIDGE,
            };
            let side = Side {
                ifname: h.ifname.clone(),
                ip: h.ip,
                mac: h.mac,
                switch_port: h.switch_port.clone(),
            };
            self.plug(ns, &side, h.ip6, bridge, cfg)?;
            if let Some(b) = &h.backend_side {
                self.plug(ns, b, None, BACKEND_BRIDGE, cfg)?;
            }
        }
        if cfg.routed {
            // The backends reach everything beyond their segment (the client, the VIP) through the load
            // balancer's interface there.
            let gw = self.info(Host::Lb).backend_side.as_ref().map(|b| b.ip);
            let gw = gw.context("a routed topology's load balancer has a backend side")?;
            for h in infos.iter().filter(|h| matches!(h.host, Host::Backend(_))) {
                run_cmd([
                    "ip",
                    "-n",
                    &h.netns,
                    "route",
                    "add",
                    "default",
                    "via",
                    &gw.to_string(),
                ])?;
            }
        }
        if cfg.tune_client {
            let ns = self.netns(Host::Client).to_string();
            sysctl(
                &ns,
                &[
                    "net.ipv4.ip_local_port_range=1024 65535",
                    "net.ipv4.tcp_tw_reuse=1",
                ],
            )?;
        }
        Ok(())
    }

    /// Connects interface `side` of namespace `ns` to `bridge` by a veth pair, with its address(es), full
    /// checksums and the configured GRO.
    fn plug(
        &self,
        ns: &str,
        side: &Side,
        ip6: Option<Ipv6Addr>,
        bridge: &str,
        cfg: &TopologyConfig,
    ) -> Result<()> {
        let sw = self.switch_ns.as_str();
        let o = side.ip.octets();
        let port_mac = mac_string(&[0x06, 0x00, o[0], o[1], o[2], o[3]]);
        let queues = cfg.queues.to_string();
        let host_mac = mac_string(&side.mac);
        let q: &[&str] = if cfg.queues > 1 {
            &["numtxqueues", &queues, "numrxqueues", &queues]
        } else {
            &[]
        };
        let mut cmd = vec!["ip", "-n", sw, "link", "add", &side.switch_port];
        cmd.extend(["address", &port_mac]);
        cmd.extend(q);
        cmd.extend(["type", "veth", "peer", "name", &side.ifname]);
        cmd.extend(["address", &host_mac]);
        cmd.extend(q);
        cmd.extend(["netns", ns]);
        run_cmd(cmd)?;
        run_cmd([
            "ip",
            "-n",
            sw,
            "link",
            "set",
            &side.switch_port,
            "master",
            bridge,
        ])?;
        run_cmd(["ip", "-n", sw, "link", "set", &side.switch_port, "up"])?;
        run_cmd([
            "ip",
            "-n",
            ns,
            "addr",
            "add",
            &format!("{}/24", side.ip),
            "dev",
            &side.ifname,
        ])?;
        if let Some(ip6) = ip6 {
            run_cmd([
                "ip",
                "-n",
                ns,
                "-6",
                "addr",
                "add",
                &format!("{ip6}/64"),
                "dev",
                &side.ifname,
                "nodad",
            ])?;
        }
        run_cmd(["ip", "-n", ns, "link", "set", &side.ifname, "up"])?;
        // Without this the kernel leaves checksums to "hardware" that a veth never has: frames would carry
        // partial checksums, and the load balancer's incremental checksum rewrite would produce garbage that only
        // works because the receiver trusts CHECKSUM_PARTIAL. Full checksums, like a real wire.
        let mut features = vec!["tx", "off"];
        if let Some(gro) = cfg.host_gro {
            features.extend(["gro", on_off(gro)]);
        }
        self.ethtool(ns, &side.ifname, &features)?;
        if let Some(gro) = cfg.switch_port_gro {
            self.ethtool(sw, &side.switch_port, &["gro", on_off(gro)])?;
        }
        if cfg.queues > 1 {
            self.steer_queues(ns, &side.ifname, cfg.queues)?;
            self.steer_queues(sw, &side.switch_port, cfg.queues)?;
        }
        Ok(())
    }

    /// Transmit queue `q` of `ifname` for the frames CPU `q` sends (XPS), so that they land in its peer's receive
    /// queue `q`, whose softirq the same CPU runs: each CPU's frames stay on it along the chain, as a NIC's queue
    /// stays on the CPU its interrupt is bound to. (Without it the skb's hash chooses, and a queue whose softirq
    /// runs on one CPU overflowed with the other CPU's frames: half of them lost with native XDP on two CPUs.)
    fn steer_queues(&self, ns: &str, ifname: &str, queues: usize) -> Result<()> {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let script: String = (0..queues)
            .map(|q| {
                format!(
                    "echo {} > /sys/class/net/{ifname}/queues/tx-{q}/xps_cpus; ",
                    cpu_mask(q % cpus)
                )
            })
            .collect();
        run_cmd(["ip", "netns", "exec", ns, "sh", "-c", &script]).map(|_| ())
    }

    fn add_netns(&mut self, name: &str) -> Result<()> {
        run_cmd(["ip", "netns", "add", name])?;
        self.created.push(name.to_string());
        Ok(())
    }

    /// `lo` up (local services, health checks against 127.0.0.1) and IPv6 off unless asked for; done before any
    /// other interface exists in the namespace so none of them ever gets an IPv6 address.
    fn prepare_netns(&self, ns: &str, cfg: &TopologyConfig) -> Result<()> {
        if cfg.ipv6 {
            // Addresses usable at once (no DAD: the topology hands them out uniquely) and no router
            // solicitations: there is no router, and fewer stray frames reach the load balancer.
            sysctl(
                ns,
                &[
                    "net.ipv6.conf.default.accept_dad=0",
                    "net.ipv6.conf.default.dad_transmits=0",
                    "net.ipv6.conf.default.router_solicitations=0",
                    "net.ipv6.conf.default.accept_ra=0",
                ],
            )?;
        } else {
            sysctl(
                ns,
                &[
                    "net.ipv6.conf.all.disable_ipv6=1",
                    "net.ipv6.conf.default.disable_ipv6=1",
                ],
            )?;
        }
        run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"]).map(|_| ())
    }

    fn ethtool(&self, ns: &str, ifname: &str, features: &[&str]) -> Result<()> {
        let mut argv = vec!["ip", "netns", "exec", ns, "ethtool", "-K", ifname];
        argv.extend_from_slice(features);
        run_cmd(argv).map(|_| ())
    }

    fn info(&self, host: Host) -> &HostInfo {
        self.hosts.get(&host).unwrap_or_else(|| {
            panic!(
                "{host} is not part of topology {} (has {} backends)",
                self.id,
                self.backend_count()
            )
        })
    }

    /// Unique id of this topology (`<prefix>-<pid>-<counter>`); every namespace name starts with it.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// All hosts, client and lb first, then the backends in order.
    pub fn hosts(&self) -> impl Iterator<Item = &HostInfo> {
        self.hosts.values()
    }

    /// The backends, `Backend(1)..=Backend(n)`.
    pub fn backends(&self) -> impl Iterator<Item = Host> + '_ {
        self.hosts
            .keys()
            .copied()
            .filter(|h| matches!(h, Host::Backend(_)))
    }

    /// The load-balancer hosts: [`Host::Lb`] first, then the replicas.
    pub fn lbs(&self) -> Vec<Host> {
        let mut v = vec![Host::Lb];
        v.extend(
            self.hosts
                .keys()
                .copied()
                .filter(|h| matches!(h, Host::LbReplica(_))),
        );
        v
    }

    /// Number of backends.
    pub fn backend_count(&self) -> usize {
        self.backends().count()
    }

    /// Details of one host. Panics if the host is not part of the topology (a test bug).
    pub fn host(&self, host: Host) -> &HostInfo {
        self.info(host)
    }

    /// Namespace name of `host`.
    pub fn netns(&self, host: Host) -> &str {
        &self.info(host).netns
    }

    /// Interface name of `host` inside its namespace.
    pub fn ifname(&self, host: Host) -> &str {
        &self.info(host).ifname
    }

    /// Primary address of `host`.
    pub fn ip(&self, host: Host) -> Ipv4Addr {
        self.info(host).ip
    }

    /// MAC of `host`'s interface.
    pub fn mac(&self, host: Host) -> [u8; 6] {
        self.info(host).mac
    }

    /// `host`'s interface on the backends' segment of a routed topology.
    pub fn backend_side(&self, host: Host) -> Option<&Side> {
        self.info(host).backend_side.as_ref()
    }

    /// An address in the segment's /24 by last octet (e.g. `addr(100)` for the conventional VIP).
    pub fn addr(&self, last_octet: u8) -> Ipv4Addr {
        let o = self.subnet.octets();
        Ipv4Addr::new(o[0], o[1], o[2], last_octet)
    }

    /// The switch namespace (holds [`BRIDGE`] and the bridge ports).
    pub fn switch_netns(&self) -> &str {
        &self.switch_ns
    }

    /// Name of `host`'s bridge port in the switch namespace.
    pub fn switch_port(&self, host: Host) -> &str {
        &self.info(host).switch_port
    }

    /// Adds an extra address (e.g. the VIP or a SNAT address) as /32 (IPv6: /128, without DAD) to `host`'s
    /// interface.
    pub fn add_addr(&self, host: Host, ip: impl Into<IpAddr>) -> Result<()> {
        let h = self.info(host);
        let ip = ip.into();
        let mut argv = vec![
            "ip".to_string(),
            "-n".into(),
            h.netns.clone(),
            "addr".into(),
            "add".into(),
            host_prefix(ip),
            "dev".into(),
            h.ifname.clone(),
        ];
        if ip.is_ipv6() {
            argv.push("nodad".into());
        }
        run_cmd(argv).map(|_| ())
    }

    /// Removes an address added by [`Topology::add_addr`].
    pub fn del_addr(&self, host: Host, ip: impl Into<IpAddr>) -> Result<()> {
        let h = self.info(host);
        run_cmd([
            "ip",
            "-n",
            &h.netns,
            "addr",
            "del",
            &host_prefix(ip.into()),
            "dev",
            &h.ifname,
        ])
        .map(|_| ())
    }

    /// `host`'s IPv6 address; panics when the topology has no IPv6.
    pub fn ip6(&self, host: Host) -> Ipv6Addr {
        self.info(host)
            .ip6
            .unwrap_or_else(|| panic!("topology {} has no IPv6", self.id))
    }

    /// An address in the topology's IPv6 /64 by last octet (see [`TopologyConfig::addr6`]).
    pub fn addr6(&self, last_octet: u8) -> Ipv6Addr {
        TopologyConfig {
            subnet: self.subnet,
            ..TopologyConfig::default()
        }
        .addr6(last_octet)
    }

    /// Sets `host`'s interface up or down (its bridge port loses carrier accordingly).
    pub fn set_link(&self, host: Host, up: bool) -> Result<()> {
        let h = self.info(host);
        let state = if up { "up" } else { "down" };
        run_cmd(["ip", "-n", &h.netns, "link", "set", &h.ifname, state]).map(|_| ())
    }

    /// Runs `argv` inside `host`'s namespace and waits for it. Fails (with the command line, exit status and
    /// stderr) when it exits non-zero; use [`Topology::exec_unchecked`] to inspect failures yourself.
    pub fn exec<I, S>(&self, host: Host, argv: I) -> Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        run_cmd(netns_argv(self.netns(host), argv))
    }

    /// Like [`Topology::exec`] but returns the output whatever the exit status.
    pub fn exec_unchecked<I, S>(&self, host: Host, argv: I) -> Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let argv = netns_argv(self.netns(host), argv);
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..]).stdin(Stdio::null());
        cmd.output()
            .with_context(|| format!("cannot run `{}`", render(&argv)))
    }

    /// Runs `argv` in the switch namespace (e.g. `tcpdump -i br0`, `ethtool` on a bridge port).
    pub fn exec_switch<I, S>(&self, argv: I) -> Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        run_cmd(netns_argv(&self.switch_ns, argv))
    }

    /// Starts `argv` inside `host`'s namespace. stdout/stderr go to files (never a pipe that could fill up and
    /// block the child) readable through the guard. The process is killed when the guard drops, and at the
    /// latest when the topology drops.
    pub fn spawn<I, S>(&self, host: Host, argv: I) -> Result<ChildGuard>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let argv = netns_argv(self.netns(host), argv);
        ChildGuard::spawn(&argv, &format!("{}@{}", render(&argv[4..]), host))
    }

    /// Runs `f` on a new thread that has entered `host`'s network namespace, and returns its result. Sockets
    /// created inside keep that namespace for their whole life, so this runs in-process load generators or
    /// servers: e.g. `topo.run_in(Host::Client, || tokio_runtime.block_on(load::run_tcp(cfg)))` where the
    /// runtime is built inside `f`.
    pub fn run_in<F, T>(&self, host: Host, f: F) -> Result<T>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let path = netns_path(self.netns(host));
        let file = File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
        let handle = std::thread::Builder::new()
            .name(format!("netns-{host}"))
            .spawn(move || -> Result<T> {
                // SAFETY: plain syscall on a valid fd; it only changes this (new) thread's network namespace.
                let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                if rc != 0 {
                    bail!(
                        "setns({}) failed: {}",
                        path.display(),
                        std::io::Error::last_os_error()
                    );
                }
                Ok(f())
            })
            .context("cannot spawn thread")?;
        match handle.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// Deletes the topology now (idempotent; `Drop` does the same and reports errors on stderr).
    pub fn teardown(&mut self) -> Result<()> {
        let mut errors = Vec::new();
        // Hosts first, the switch last (reverse creation order).
        while let Some(ns) = self.created.pop() {
            if let Err(e) = delete_netns(&ns) {
                errors.push(format!("{e:#}"));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(anyhow!(
                "teardown of {} incomplete: {}",
                self.id,
                errors.join("; ")
            ))
        }
    }

    /// Puts a router between the client and the segment for traffic to `dsts`: a namespace `<id>-router` with a
    /// port on the bridge (`.9` of the /24) and a point-to-point link to the client, forwarding, and choosing a
    /// multipath route's next hop by a hash of each packet's addresses, protocol and ports, as a hardware router
    /// in front of a load balancer's replicas does. The client gets an address of its own behind the router
    /// (`192.0.2.10`, outside the segment) and sends to `dsts` from it, so both directions pass the router.
    /// The router's routes to `dsts` are the caller's (a routing daemon's).
    ///
    /// Why the custom hash (`fib_multipath_hash_policy=3` on the five fields) and not the usual L4 policy 1:
    /// policy 1 takes a packet's existing L4 hash when it has one, and a frame from a local socket crosses a
    /// veth with its socket's random `sk_txhash` — a new one per connection, also when a connection reuses an
    /// earlier one's ports — so the same five-tuple would land on another replica.
    pub fn add_client_router(&mut self, dsts: &[Ipv4Addr]) -> Result<ClientRouter> {
        let ns = format!("{}-router", self.id);
        self.add_netns(&ns)?;
        let sw = self.switch_ns.clone();
        let ip = Ipv4Addr::from(u32::from(self.subnet) | 9);
        let client_ip = Ipv4Addr::new(192, 0, 2, 10);
        let client = self.host(Host::Client).clone();
        run_cmd(["ip", "-n", &ns, "link", "set", "lo", "up"])?;
        let o = ip.octets();
        run_cmd([
            "ip",
            "-n",
            &sw,
            "link",
            "add",
            "p-router",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "address",
            &mac_string(&[0x02, 0x00, o[0], o[1], o[2], o[3]]),
            "netns",
            &ns,
        ])?;
        run_cmd(["ip", "-n", &sw, "link", "set", "p-router", "master", BRIDGE])?;
        run_cmd(["ip", "-n", &sw, "link", "set", "p-router", "up"])?;
        run_cmd([
            "ip",
            "-n",
            &ns,
            "link",
            "add",
            "to-client",
            "type",
            "veth",
            "peer",
            "name",
            "to-router",
            "netns",
            &client.netns,
        ])?;
        for (n, dev, addr) in [
            (ns.as_str(), "eth0", format!("{ip}/24")),
            (ns.as_str(), "to-client", "169.254.10.1/30".into()),
            (client.netns.as_str(), "to-router", "169.254.10.2/30".into()),
            (client.netns.as_str(), "lo", format!("{client_ip}/32")),
        ] {
            run_cmd(["ip", "-n", n, "addr", "add", &addr, "dev", dev])?;
            run_cmd(["ip", "-n", n, "link", "set", dev, "up"])?;
            // Full checksums, as on a wire (see `plug`).
            if dev != "lo" {
                self.ethtool(n, dev, &["tx", "off"])?;
            }
        }
        sysctl(
            &ns,
            &[
                "net.ipv4.ip_forward=1",
                "net.ipv4.fib_multipath_hash_policy=3",
                // Source and destination address, protocol, source and destination port.
                "net.ipv4.fib_multipath_hash_fields=0x0037",
                "net.ipv4.conf.all.send_redirects=0",
                "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0",
            ],
        )?;
        let client_host = format!("{client_ip}/32");
        run_cmd([
            "ip",
            "-n",
            &ns,
            "route",
            "add",
            &client_host,
            "via",
            "169.254.10.2",
        ])?;
        for dst in dsts {
            run_cmd([
                "ip",
                "-n",
                &client.netns,
                "route",
                "add",
                &format!("{dst}/32"),
                "via",
                "169.254.10.1",
                "src",
                &client_ip.to_string(),
            ])?;
        }
        Ok(ClientRouter {
            netns: ns,
            ip,
            client_ip,
        })
    }

    /// Removes leftovers of crashed runs: every namespace named `<prefix>-<pid>-…` whose creating process `pid`
    /// no longer exists (namespaces of live processes, e.g. parallel tests, are left alone). Returns the names
    /// removed.
    pub fn cleanup_stale(prefix: &str) -> Result<Vec<String>> {
        preflight()?;
        let mut removed = Vec::new();
        for ns in list_netns()? {
            let Some(rest) = ns.strip_prefix(prefix).and_then(|r| r.strip_prefix('-')) else {
                continue;
            };
            let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            delete_netns(&ns)?;
            removed.push(ns);
        }
        Ok(removed)
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            eprintln!("lb-testbed: {e:#}");
        }
    }
}

/// Removes every namespace of topology `id` (processes inside killed), for signal handlers that cannot run
/// the owner's `Drop`: hosts first, the switch last.
pub fn remove_topology(id: &str) -> Result<()> {
    let prefix = format!("{id}-");
    let mut names: Vec<String> = list_netns()?
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .collect();
    names.sort_by_key(|n| n.ends_with("-sw"));
    for ns in names {
        delete_netns(&ns)?;
    }
    Ok(())
}

/// Names of all named network namespaces (`ip netns list`).
pub fn list_netns() -> Result<Vec<String>> {
    let out = run_cmd(["ip", "netns", "list"])?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        // Lines look like "name" or "name (id: 3)".
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect())
}

/// Kills every process inside `ns`, then deletes it. A process still inside would keep the namespace (and its
/// veths) alive after the name is gone, invisible to `ip netns list`.
fn delete_netns(ns: &str) -> Result<()> {
    for _ in 0..50 {
        let pids = netns_pids(ns)?;
        if pids.is_empty() {
            break;
        }
        for pid in pids {
            // SAFETY: sending a signal has no memory-safety implications.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    run_cmd(["ip", "netns", "del", ns]).map(|_| ())
}

fn netns_pids(ns: &str) -> Result<Vec<i32>> {
    let out = Command::new("ip")
        .args(["netns", "pids", ns])
        .output()
        .context("cannot run `ip netns pids`")?;
    if !out.status.success() {
        // The namespace is already gone: nothing to kill.
        return Ok(Vec::new());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        // Never signal ourselves (a test thread may have entered the namespace through `run_in`).
        .filter(|p| *p as u32 != std::process::id())
        .collect())
}

fn netns_path(ns: &str) -> PathBuf {
    Path::new("/var/run/netns").join(ns)
}

fn netns_argv<I, S>(ns: &str, argv: I) -> Vec<std::ffi::OsString>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut v: Vec<std::ffi::OsString> =
        ["ip", "netns", "exec", ns].iter().map(Into::into).collect();
    v.extend(argv.into_iter().map(|a| a.as_ref().to_os_string()));
    v
}

/// CPU `cpu` alone as a mask the kernel parses (`xps_cpus`): 32-bit hex groups, most significant first, separated
/// by commas.
fn cpu_mask(cpu: usize) -> String {
    (0..=cpu / 32)
        .rev()
        .map(|w| {
            let bits = if w == cpu / 32 { 1u32 << (cpu % 32) } else { 0 };
            format!("{bits:x}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// A single address as a prefix: `/32` for IPv4, `/128` for IPv6.
fn host_prefix(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(ip) => format!("{ip}/32"),
        IpAddr::V6(ip) => format!("{ip}/128"),
    }
}

/// Formats a MAC as `aa:bb:cc:dd:ee:ff`.
pub fn mac_string(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let parts: Vec<&str> = s.trim().split(':').collect();
    if parts.len() != 6 {
        bail!("invalid MAC address {s:?}");
    }
    let mut mac = [0u8; 6];
    for (m, p) in mac.iter_mut().zip(parts) {
        *m = u8::from_str_radix(p, 16).with_context(|| format!("invalid MAC address {s:?}"))?;
    }
    Ok(mac)
}

/// Sets kernel `settings` (`key=value`) in namespace `ns`.
fn sysctl(ns: &str, settings: &[&str]) -> Result<()> {
    let mut argv = vec!["ip", "netns", "exec", ns, "sysctl", "-q", "-w"];
    argv.extend_from_slice(settings);
    run_cmd(argv).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::cpu_mask;

    #[test]
    fn cpu_masks_in_32_bit_groups() {
        assert_eq!(cpu_mask(0), "1");
        assert_eq!(cpu_mask(5), "20");
        assert_eq!(cpu_mask(31), "80000000");
        assert_eq!(cpu_mask(32), "1,0");
        assert_eq!(cpu_mask(70), "40,0,0");
    }
}
