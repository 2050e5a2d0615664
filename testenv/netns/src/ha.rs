//! A highly available load balancer under test: two or three load-balancer namespaces on one L2 segment, each
//! running the real agent with VRRP (keepalived) and connection-state sync, sharing a VIP that only the VRRP
//! master holds; backends and client on the same segment, so the VIP moves by gratuitous ARP exactly as on an
//! OpenStack network.
//!
//! ```text
//!                   switch namespace (bridge br0)
//!   p-client ─┬─ p-lb ─┬─ p-lb2 ─┬─ [p-lb3] ─┬─ p-b1 ─┬─ p-b2 …
//!   client .10   lb .2    lb-2 .3    lb-3 .4     backend-1 .11 …
//!                  └──── VIP .100 on the VRRP master ────┘
//! ```
//!
//! Active-active ([`HaRigConfig::active_active`]): no VRRP; every replica's agent announces the VIP over BGP
//! (its own BIRD) to an upstream router between the client and the segment ([`Topology::add_client_router`]):
//! BIRD 2 there installs one route to the VIP with a next hop per announcing replica (`merge paths`), and the
//! router's kernel spreads the client's connections over them by a hash of their addresses and ports.
//! Every replica SNATs to its own address, and flow sync runs between all of them. With
//! [`HaRigConfig::static_routes`] nobody speaks BGP: the agents run `--active-active` alone and the test programs
//! the router's multipath route itself ([`HaRig::set_next_hops`]) from their eligibility
//! ([`HaRig::eligible`]), as the OpenStack controller does with the Neutron router's routes.

use crate::hold::HoldReport;
use crate::rig::{
    agent_http_get, attach_xdp_pass, find_artifact, lb_config_yaml, parse_metric, pin_root,
    run_load, spawn_bird, spawn_echo, spawn_hold, Hold, METRICS,
};
use crate::topology::ClientRouter;
use crate::{ChildGuard, Host, Topology, TopologyConfig};
use anyhow::{bail, Context, Result};
use lb_common::{Flow, FlowAddr, FlowKey};
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Port of the connection-state sync on every replica.
pub const SYNC_PORT: u16 = 9190;
/// The upstream router's AS (active-active).
pub const ROUTER_AS: u32 = 65000;
/// The replicas' AS (active-active).
pub const REPLICA_AS: u32 = 65001;
/// BGP hold time on both sides (BIRD's minimum).
pub const BGP_HOLD_S: u64 = 3;

/// How to build the HA rig.
#[derive(Clone, Debug)]
pub struct HaRigConfig {
    /// Load-balancer replicas (2 or 3).
    pub replicas: usize,
    /// Backends.
    pub backends: usize,
    /// VRRP router id of the load balancer.
    pub router_id: u8,
    /// VRRP advertisement interval.
    pub advert_interval: Duration,
    /// The `lb-agent` binary.
    pub agent_bin: PathBuf,
    /// The `xdp-pass.o` test program.
    pub xdp_pass_obj: PathBuf,
    /// Extra agent flags (all replicas).
    pub agent_args: Vec<String>,
    /// Start every replica's agent at once (`false`: the caller starts them with [`HaRig::start_agent`]).
    pub start_agents: bool,
    /// Connection-state sync between the agents (off: VRRP only, like yawol).
    pub sync: bool,
    /// Dual-stack: an IPv6 VIP beside the IPv4 one (moved by the same VRRP instance) and IPv6 backends.
    pub ipv6: bool,
    /// With `ipv6`: the IPv6 VIP only, so the VRRP instance is an IPv6 one (VRRPv3 from link-local addresses).
    pub ipv6_only: bool,
    /// Extra `options:` lines of the LoadBalancer config (YAML, indented by two spaces).
    pub options: String,
    /// Active-active behind a BGP router between the client and the segment instead of VRRP (IPv4).
    pub active_active: bool,
    /// With `active_active`: no BGP; the agents run `--active-active` and the test sets the router's route.
    pub static_routes: bool,
}

impl HaRigConfig {
    /// Defaults: 2 replicas, 3 backends, router id 51, 200 ms adverts, binaries found like [`crate::rig`].
    pub fn new() -> Result<Self> {
        Ok(HaRigConfig {
            replicas: 2,
            backends: 3,
            router_id: 51,
            advert_interval: Duration::from_millis(200),
            agent_bin: find_artifact("LB_AGENT_BIN", "lb-agent")?,
            xdp_pass_obj: find_artifact("LB_XDP_PASS_OBJ", "bpf/xdp-pass.o")?,
            agent_args: Vec::new(),
            start_agents: true,
            sync: true,
            ipv6: false,
            ipv6_only: false,
            options: String::new(),
            active_active: false,
            static_routes: false,
        })
    }
}

/// A forward flow's rewrite: new source, new destination, new source port, new destination port.
pub type Rewrite<A> = (A, A, u16, u16);

/// The running HA rig. Dropping it stops everything and removes the namespaces.
pub struct HaRig {
    /// The namespaces.
    pub topo: Topology,
    /// The shared virtual IP.
    pub vip: Ipv4Addr,
    /// The shared IPv6 virtual IP, when dual-stack.
    pub vip6: Option<Ipv6Addr>,
    /// Settings it was built with.
    pub cfg: HaRigConfig,
    agents: BTreeMap<Host, ChildGuard>,
    /// The upstream router and its BIRD (active-active).
    router: Option<(ClientRouter, Option<ChildGuard>)>,
    echo: Vec<ChildGuard>,
    xdp_pass: Vec<ChildGuard>,
    dir: PathBuf,
    pin_dir: PathBuf,
}

impl HaRig {
    /// Builds the topology, starts echo servers and (unless told otherwise) every replica's agent, all with
    /// priority 100 (one revision: a restarted machine must not preempt), and waits until one of them holds the
    /// VIP.
    pub fn start(cfg: HaRigConfig) -> Result<Self> {
        let topo = Topology::new(TopologyConfig {
            backends: cfg.backends,
            lb_replicas: cfg.replicas,
            // Native XDP: frames reach the replicas at wire size; their bridge ports get NAPI from xdp_pass.
            switch_port_gro: Some(false),
            ipv6: cfg.ipv6,
            ..TopologyConfig::default()
        })?;
        let vip = topo.addr(100);
        let vip6 = cfg.ipv6.then(|| topo.addr6(100));
        let dir = std::env::temp_dir().join(format!("{}-ha", topo.id()));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("sync-secret"),
            "testbed-sync-secret-0123456789abcdef\n",
        )?;
        let pin_dir = pin_root()?.join(topo.id());
        let mut rig = HaRig {
            topo,
            vip,
            vip6,
            cfg,
            agents: BTreeMap::new(),
            router: None,
            echo: Vec::new(),
            xdp_pass: Vec::new(),
            dir,
            pin_dir,
        };
        for h in rig.topo.lbs() {
            rig.xdp_pass
                .push(attach_xdp_pass(&rig.topo, &rig.cfg.xdp_pass_obj, h)?);
        }
        for b in rig.topo.backends().collect::<Vec<_>>() {
            rig.echo.push(spawn_echo(&rig.topo, b)?);
        }
        let nodes: Vec<Vec<IpAddr>> = rig
            .topo
            .backends()
            .map(|b| {
                let h = rig.topo.host(b);
                std::iter::once(IpAddr::from(h.ip))
                    .chain(h.ip6.map(IpAddr::from))
                    .collect()
            })
            .collect();
        let vips: Vec<IpAddr> = std::iter::once(IpAddr::from(vip))
            .filter(|_| !rig.cfg.ipv6_only)
            .chain(vip6.map(IpAddr::from))
            .collect();
        std::fs::write(
            rig.config_path(),
            lb_config_yaml(&vips, &nodes, &rig.cfg.options),
        )?;
        if rig.cfg.active_active {
            rig.start_router()?;
        }
        if rig.cfg.start_agents {
            for h in rig.topo.lbs() {
                rig.start_agent(h, 100)?;
            }
            if rig.cfg.static_routes {
                let lbs = rig.topo.lbs();
                rig.wait_eligible(&lbs, Duration::from_secs(20))?;
                rig.set_next_hops(&lbs)?;
            } else if rig.cfg.active_active {
                rig.wait_next_hops(&rig.topo.lbs(), Duration::from_secs(20))?;
            } else {
                rig.wait_master(Duration::from_secs(20))?;
            }
        }
        Ok(rig)
    }

    /// The upstream router: a namespace between the client and the segment running BIRD 2 with a session to
    /// every replica's address and their routes merged into one multipath route, hashed on the five-tuple.
    fn start_router(&mut self) -> Result<()> {
        if self.cfg.ipv6 || !self.cfg.sync {
            bail!("an active-active rig is IPv4 with flow sync");
        }
        let router = self.topo.add_client_router(&[self.vip])?;
        if self.cfg.static_routes {
            self.router = Some((router, None));
            return Ok(());
        }
        let mut conf = format!(
            "router id {};\nprotocol device {{}}\n\
             protocol kernel {{ ipv4 {{ import none; export all; }}; merge paths on; }}\n\
             template bgp replica {{\n  local as {ROUTER_AS};\n  hold time {BGP_HOLD_S};\n  keepalive time 1;\n  \
             connect delay time 1;\n  connect retry time 2;\n  error wait time 1, 5;\n  graceful restart off;\n  \
             ipv4 {{ import all; export none; }};\n}}\n",
            router.ip,
        );
        for (i, h) in self.topo.lbs().into_iter().enumerate() {
            conf += &format!(
                "protocol bgp replica{i} from replica {{ neighbor {} as {REPLICA_AS}; }}\n",
                self.topo.ip(h)
            );
        }
        let (bird, _) = spawn_bird(&router.netns, &self.dir, "router", &conf)?;
        self.router = Some((router, Some(bird)));
        Ok(())
    }

    /// Whether replica `host`'s agent says it should get the VIP's traffic (`lb_vip_eligible`; false when it
    /// does not answer).
    pub fn eligible(&self, host: Host) -> bool {
        self.metric(host, "lb_vip_eligible", "")
            .is_ok_and(|v| v == 1.0)
    }

    /// Waits until every one of `hosts` is eligible.
    pub fn wait_eligible(&self, hosts: &[Host], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while !hosts.iter().all(|h| self.eligible(*h)) {
            if Instant::now() > deadline {
                bail!(
                    "not every one of {hosts:?} became eligible:\n{}",
                    self.all_logs()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Sets the router's route to the VIP to one next hop per replica of `hosts` (none: no route), as a
    /// controller reading the replicas' eligibility does ([`HaRigConfig::static_routes`]).
    pub fn set_next_hops(&self, hosts: &[Host]) -> Result<()> {
        let router = self.router().context("no upstream router")?;
        let vip = format!("{}/32", self.vip);
        let mut cmd: Vec<String> = ["ip", "-n", router.netns.as_str(), "-4", "route"]
            .map(String::from)
            .to_vec();
        if hosts.is_empty() {
            cmd.extend(["del".into(), vip]);
        } else {
            cmd.extend(["replace".into(), vip]);
            for h in hosts {
                cmd.extend(["nexthop".into(), "via".into(), self.topo.ip(*h).to_string()]);
            }
        }
        crate::process::run_cmd(cmd)?;
        Ok(())
    }

    /// The upstream router (active-active).
    pub fn router(&self) -> Option<&ClientRouter> {
        self.router.as_ref().map(|(r, _)| r)
    }

    /// The replicas the upstream router's route to the VIP leads to now (active-active).
    pub fn next_hops(&self) -> Result<Vec<Host>> {
        let vip = format!("{}/32", self.vip);
        let router = self.router().context("no upstream router")?;
        let out = crate::process::run_cmd([
            "ip",
            "-n",
            router.netns.as_str(),
            "-4",
            "route",
            "show",
            vip.as_str(),
        ])?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let via: Vec<Ipv4Addr> = text
            .split_whitespace()
            .collect::<Vec<_>>()
            .windows(2)
            .filter(|w| w[0] == "via")
            .filter_map(|w| w[1].parse().ok())
            .collect();
        Ok(self
            .topo
            .lbs()
            .into_iter()
            .filter(|h| via.contains(&self.topo.ip(*h)))
            .collect())
    }

    /// Waits until the route to the VIP leads to exactly `hosts` (active-active).
    pub fn wait_next_hops(&self, hosts: &[Host], timeout: Duration) -> Result<()> {
        let mut want = hosts.to_vec();
        want.sort();
        let deadline = Instant::now() + timeout;
        loop {
            let now = self.next_hops()?;
            if now == want {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "the route to the VIP leads to {now:?}, not {want:?}:\n{}",
                    self.all_logs()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The config file every replica reads.
    pub fn config_path(&self) -> PathBuf {
        self.dir.join("lb.yaml")
    }

    /// The agent's command line for replica `host` with VRRP priority `priority` (unused when active-active).
    pub fn agent_argv(&self, host: Host, priority: u8) -> Vec<String> {
        let me = self.topo.ip(host);
        let mut argv: Vec<String> = vec![
            self.cfg.agent_bin.display().to_string(),
            "--interface".into(),
            self.topo.ifname(host).into(),
            "--config".into(),
            self.config_path().display().to_string(),
            "--attach-mode".into(),
            "xdp".into(),
            "--pin-dir".into(),
            self.pin_dir.join(host.name()).display().to_string(),
            "--max-flows".into(),
            "131072".into(),
            "--gc-interval".into(),
            "1".into(),
            "--metrics-address".into(),
            METRICS.into(),
        ];
        if self.cfg.static_routes {
            argv.extend([
                "--active-active".into(),
                "--snat-address".into(),
                me.to_string(),
            ]);
        } else if self.cfg.active_active {
            argv.extend([
                "--bgp-local-as".into(),
                REPLICA_AS.to_string(),
                "--bgp-peer".into(),
                self.router().map_or_else(String::new, |r| r.ip.to_string()),
                "--bgp-peer-as".into(),
                ROUTER_AS.to_string(),
                "--bgp-hold-time".into(),
                format!("{BGP_HOLD_S}s"),
                "--bgp-router-id".into(),
                me.to_string(),
                "--bgp-run-dir".into(),
                self.dir
                    .join(format!("{}-bgp", host.name()))
                    .display()
                    .to_string(),
                "--snat-address".into(),
                me.to_string(),
            ]);
        } else {
            argv.extend([
                "--vrrp-router-id".into(),
                self.cfg.router_id.to_string(),
                "--vrrp-priority".into(),
                priority.to_string(),
                "--vrrp-advert-interval".into(),
                format!("{}ms", self.cfg.advert_interval.as_millis()),
                "--vrrp-run-dir".into(),
                self.dir
                    .join(format!("{}-vrrp", host.name()))
                    .display()
                    .to_string(),
            ]);
        }
        if self.cfg.sync {
            argv.extend([
                "--sync-listen".into(),
                format!("{me}:{SYNC_PORT}"),
                "--sync-secret-file".into(),
                self.dir.join("sync-secret").display().to_string(),
            ]);
            for peer in self.topo.lbs().into_iter().filter(|p| *p != host) {
                argv.push("--sync-peer".into());
                argv.push(format!("{}:{SYNC_PORT}", self.topo.ip(peer)));
            }
        }
        argv.extend(self.cfg.agent_args.iter().cloned());
        argv
    }

    /// Starts replica `host`'s agent and waits for its `/readyz`.
    pub fn start_agent(&mut self, host: Host, priority: u8) -> Result<()> {
        let argv = self.agent_argv(host, priority);
        let child = self.topo.spawn(host, &argv)?;
        self.agents.insert(host, child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(a) = self.agents.get_mut(&host) {
                if let Some(status) = a.try_wait()? {
                    bail!("agent {host} exited ({status}):\n{}", self.agent_log(host));
                }
            }
            if self
                .http_get(host, "/readyz")
                .is_ok_and(|b| b.starts_with("ready"))
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("agent {host} not ready:\n{}", self.agent_log(host));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops replica `host`'s agent with `signal` (SIGTERM: graceful, stops its keepalived too; SIGKILL: the
    /// agent dies, its keepalived and data plane stay).
    pub fn stop_agent(&mut self, host: Host, signal: i32) -> Result<String> {
        let mut a = self.agents.remove(&host).context("agent not running")?;
        a.signal(signal)?;
        a.wait_timeout(Duration::from_secs(15))?;
        Ok(a.stderr() + &a.stdout())
    }

    /// Kills every process of replica `host` (agent, keepalived) — the VIP stays configured on its interface
    /// and its data plane stays attached, like a machine whose processes all crashed.
    pub fn kill_all(&mut self, host: Host) -> Result<()> {
        if let Some(mut a) = self.agents.remove(&host) {
            a.kill();
        }
        let ns = self.topo.netns(host).to_string();
        let pids = crate::process::run_cmd(["ip", "netns", "pids", &ns])?;
        for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
            if let Ok(pid) = pid.parse::<i32>() {
                // SAFETY: plain kill(2) on a pid listed for the namespace.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        Ok(())
    }

    /// Cuts replica `host` off the segment (its bridge port down), like a machine or hypervisor dying.
    pub fn cut_link(&self, host: Host, down: bool) -> Result<()> {
        let port = self.topo.switch_port(host).to_string();
        let state = if down { "down" } else { "up" };
        self.topo
            .exec_switch(["ip", "link", "set", port.as_str(), state])?;
        Ok(())
    }

    /// The replicas whose interface carries the VIP (a cut-off old master still has it configured).
    pub fn vip_holders(&self) -> Result<Vec<Host>> {
        let mut holders = Vec::new();
        // The IPv6 VIP when it is the only one.
        let (family, vip) = match self.vip6.filter(|_| self.cfg.ipv6_only) {
            Some(v6) => ("-6", IpAddr::from(v6)),
            None => ("-4", IpAddr::from(self.vip)),
        };
        for h in self.topo.lbs() {
            let out = self.topo.exec(h, ["ip", family, "-o", "addr", "show"])?;
            if String::from_utf8_lossy(&out.stdout).contains(&format!(" {vip}/")) {
                holders.push(h);
            }
        }
        Ok(holders)
    }

    /// The replica whose interface carries the VIP, if exactly one does (VRRP's ground truth).
    pub fn master(&self) -> Result<Option<Host>> {
        Ok(match self.vip_holders()?.as_slice() {
            [one] => Some(*one),
            _ => None,
        })
    }

    /// Waits until exactly one replica holds the VIP and returns it.
    pub fn wait_master(&self, timeout: Duration) -> Result<Host> {
        self.wait_master_where(timeout, |_| true)
    }

    /// Two replicas: waits for the VRRP master and returns it with the other one (the backup).
    pub fn wait_master_and_backup(&self, timeout: Duration) -> Result<(Host, Host)> {
        let master = self.wait_master(timeout)?;
        let others: Vec<Host> = self
            .topo
            .lbs()
            .into_iter()
            .filter(|h| *h != master)
            .collect();
        match others[..] {
            [backup] => Ok((master, backup)),
            _ => bail!("{} replicas, not two", others.len() + 1),
        }
    }

    /// Waits until exactly one replica holds the VIP and it satisfies `ok`.
    pub fn wait_master_where(&self, timeout: Duration, ok: impl Fn(Host) -> bool) -> Result<Host> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(m) = self.master()? {
                if ok(m) {
                    return Ok(m);
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "no (suitable) VRRP master after {timeout:?}; logs:\n{}",
                    self.all_logs()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops every backend's echo server: its NodePorts are free for another server (e.g.
    /// [`crate::proxy_backend::ProxyBackend`]).
    pub fn stop_echo(&mut self) {
        self.echo.clear();
    }

    /// The rig's scratch directory.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// GET on replica `host`'s metrics listener; returns the body.
    pub fn http_get(&self, host: Host, path: &str) -> Result<String> {
        agent_http_get(&self.topo, host, path)
    }

    /// The sum of the samples of metric `name` on replica `host` whose labels contain `labels`.
    pub fn metric(&self, host: Host, name: &str, labels: &str) -> Result<f64> {
        Ok(parse_metric(
            &self.http_get(host, "/metrics")?,
            name,
            labels,
        ))
    }

    /// Replica `host`'s agent log so far.
    pub fn agent_log(&self, host: Host) -> String {
        self.agents
            .get(&host)
            .map(|a| a.stderr() + &a.stdout())
            .unwrap_or_default()
    }

    /// Every running agent's log, labelled.
    pub fn all_logs(&self) -> String {
        self.agents
            .iter()
            .map(|(h, a)| format!("--- {h}\n{}{}", a.stderr(), a.stdout()))
            .collect()
    }

    /// Starts `lb-testbed hold` in the client namespace.
    pub fn start_hold(&self, args: &[&str]) -> Result<Hold> {
        spawn_hold(&self.topo, &self.dir, args)
    }

    /// Runs `lb-testbed load` in the client namespace.
    pub fn load(&self, args: &[&str]) -> Result<crate::load::LoadReport> {
        run_load(&self.topo, args)
    }

    /// Process id of replica `host`'s agent, if running.
    pub fn agent_pid(&self, host: Host) -> Option<u32> {
        self.agents.get(&host).map(|a| a.pid())
    }

    /// Every entry of replica `host`'s connection table of one family (`FLOWS_V4` or `FLOWS_V6` as `A` is; forward
    /// and reverse), read from its pinned map: this layout's, or the previous layout's where that replica runs the
    /// previous release's agent (`LB_PREVIOUS_AGENT_BIN`; the table's entries are the same).
    pub fn flow_table<A: FlowAddr>(&self, host: Host) -> Result<HashMap<FlowKey<A>, Flow<A>>> {
        let name = if A::FAMILY == lb_common::FAMILY_V6 {
            lb_common::map_names::FLOWS_V6
        } else {
            lb_common::map_names::FLOWS_V4
        };
        let dir = self.pin_dir.join(host.name()).join(self.topo.ifname(host));
        let layout = lb_common::LAYOUT_VERSION;
        let path = [layout, layout - 1]
            .map(|v| dir.join(format!("v{v}")).join(name))
            .into_iter()
            .find(|p| p.exists())
            .unwrap_or_else(|| dir.join(format!("v{layout}")).join(name));
        let data = aya::maps::MapData::from_pin(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let map: aya::maps::HashMap<_, FlowKey<A>, Flow<A>> =
            aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(data))?;
        Ok(map.iter().filter_map(|r| r.ok()).collect())
    }

    /// Every forward flow entry of replica `host` (client tuple → rewritten tuple).
    pub fn forward_flows<A: FlowAddr>(
        &self,
        host: Host,
    ) -> Result<HashMap<FlowKey<A>, Rewrite<A>>> {
        Ok(self
            .flow_table::<A>(host)?
            .into_iter()
            .filter(|(_, f)| f.flags & lb_common::FLOW_F_FORWARD != 0)
            .map(|(k, f)| (k, (f.new_src, f.new_dst, f.new_sport, f.new_dport)))
            .collect())
    }
}

impl Drop for HaRig {
    fn drop(&mut self) {
        for (_, mut a) in std::mem::take(&mut self.agents) {
            a.kill();
        }
        self.router = None;
        self.echo.clear();
        self.xdp_pass.clear();
        let _ = std::fs::remove_dir_all(&self.pin_dir);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Arguments of `lb-testbed hold` ([`HaRig::start_hold`]): `tcp` connections to `vip`'s TCP port and `udp` flows
/// to its UDP port (an IPv6 `vip` in brackets), a message on each every `interval`, an unanswered datagram resent
/// after 200 ms (as a DNS client does), a round trip broken after `timeout`, only the broken ones listed.
pub fn hold_args(
    vip: &str,
    tcp: usize,
    udp: usize,
    interval: Duration,
    timeout: Duration,
) -> Vec<String> {
    [
        "--tcp".to_string(),
        format!("{vip}:{}", crate::rig::TCP_PORT),
        "--connections".into(),
        tcp.to_string(),
        "--udp".into(),
        format!("{vip}:{}", crate::rig::UDP_PORT),
        "--udp-flows".into(),
        udp.to_string(),
        "--udp-retry-ms".into(),
        "200".into(),
        "--interval-ms".into(),
        interval.as_millis().to_string(),
        "--timeout-ms".into(),
        timeout.as_millis().to_string(),
        "--brief".into(),
    ]
    .into()
}

/// One line about a hold run: what was held, what broke, the longest gap.
pub fn hold_summary(r: &HoldReport) -> String {
    format!(
        "{} TCP + {} UDP, broken {}, survival {:.2} %, longest gap {:.0} ms, round trips {}",
        r.tcp_connections,
        r.udp_flows,
        r.broken,
        survival(r) * 100.0,
        r.max_gap_ms,
        r.round_trips
    )
}

/// Surviving share of a hold run's connections and flows (0..=1).
pub fn survival(r: &HoldReport) -> f64 {
    let total = (r.tcp_connections + r.udp_flows).max(1);
    (total - r.broken.min(total)) as f64 / total as f64
}
