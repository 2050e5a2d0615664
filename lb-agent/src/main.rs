//! `lb-agent`: runs on each load-balancer VM. Every flag can also be set by the environment variable shown
//! in `--help`. Started as `yawollet` (a symlink in the VM image), it takes yawollet's flags and yawol's
//! keepalived.conf instead ([`lb_agent::source::kubernetes::yawollet`]).

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use lb_agent::agent::{self, AgentOptions};
use lb_agent::dataplane::nic::Nic;
use lb_agent::dataplane::{AttachMode, ConnectionLru, MapSizes};
use lb_agent::ha::bgp::BgpOptions;
use lb_agent::ha::vrrp::VrrpOptions;
use lb_agent::ha::{HaOptions, SyncSettings};
use lb_agent::health::{Bytes, HealthCheckSpec, HttpCheck, UdpCheck};
use lb_agent::report::metrics::SharedSnapshot;
use lb_agent::report::AgentStatus;
use lb_agent::snat_ports::SnatPorts;
use lb_agent::source::kubernetes::{debug, yawollet, KubeSettings};
use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Clone, Copy, ValueEnum, Debug, PartialEq, Eq)]
enum Mode {
    /// Native XDP, falling back to generic XDP with a warning.
    Xdp,
    /// Native XDP only.
    XdpNative,
    /// Generic XDP only.
    XdpGeneric,
    /// TC ingress (tcx): keeps GSO/GRO super-packets; for bulk TCP on virtio/veth.
    Tc,
}

/// The connection tables' LRU lists (`--connection-lru`).
#[derive(Clone, Copy, ValueEnum, Debug, PartialEq, Eq)]
enum LruLists {
    /// Per CPU when every interface has a receive queue per possible CPU, else common.
    Auto,
    /// One list per CPU (new connections scale with the CPUs; each CPU evicts within its share).
    PerCpu,
    /// Lists common to all CPUs.
    Common,
}

#[derive(Clone, Copy, ValueEnum, Debug)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Parser, Debug)]
#[command(
    version,
    about = "XDP load-balancer agent: programs the data plane from a LoadBalancer"
)]
struct Cli {
    /// Interfaces to forward on, repeatable or comma-separated: the first carries the VIP (VRRP runs there);
    /// backends routed through another one get their frames redirected there, and replies go back by the
    /// interface their client came in on.
    #[arg(long, env = "LB_INTERFACE", value_delimiter = ',', required = true)]
    interface: Vec<String>,
    /// Local config file (LoadBalancer-shaped YAML); reloaded when it changes.
    #[arg(long, env = "LB_CONFIG", conflicts_with = "loadbalancer_name")]
    config: Option<PathBuf>,
    /// Kubernetes mode: kubeconfig (default: in-cluster or $KUBECONFIG).
    #[arg(long, env = "LB_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Kubernetes mode: namespace of the LoadBalancer and LoadBalancerMachine.
    #[arg(long, env = "LB_NAMESPACE")]
    namespace: Option<String>,
    /// Kubernetes mode: name of this machine's LoadBalancer.
    #[arg(long, env = "LB_LOADBALANCER_NAME")]
    loadbalancer_name: Option<String>,
    /// Kubernetes mode: name of this machine's LoadBalancerMachine.
    #[arg(long, env = "LB_LOADBALANCER_MACHINE_NAME")]
    loadbalancer_machine_name: Option<String>,
    /// Kubernetes mode: the LoadBalancerMachine status (heartbeat) is rewritten at least this often
    /// (Go duration; clamped to 5s..170s like yawol's --requeue-time, so heartbeats stay under 3 min).
    #[arg(long, env = "LB_REQUEUE_PERIOD", default_value = "30s", value_parser = go_duration)]
    requeue_period: Duration,
    /// Kubernetes mode: time between health checks of one backend (Go duration).
    #[arg(long, env = "LB_HC_INTERVAL", default_value = "5s", value_parser = go_duration)]
    hc_interval: Duration,
    /// Kubernetes mode: time one health check may take (Go duration).
    #[arg(long, env = "LB_HC_TIMEOUT", default_value = "5s", value_parser = go_duration)]
    hc_timeout: Duration,
    /// Kubernetes mode: consecutive failed checks that take a backend out.
    #[arg(long, env = "LB_HC_UNHEALTHY_THRESHOLD", default_value_t = 3)]
    hc_unhealthy_threshold: u32,
    /// Kubernetes mode: consecutive successful checks that bring a backend back.
    #[arg(long, env = "LB_HC_HEALTHY_THRESHOLD", default_value_t = 2)]
    hc_healthy_threshold: u32,
    /// Kubernetes mode: HTTP GET this path (e.g. /healthz) instead of a TCP connect.
    #[arg(long, env = "LB_HC_HTTP_PATH")]
    hc_http_path: Option<String>,
    /// Kubernetes mode: the HTTP check uses TLS (certificate verified only with --hc-ca-file).
    #[arg(long, env = "LB_HC_HTTPS", requires = "hc_http_path")]
    hc_https: bool,
    /// Kubernetes mode: HTTP status that counts as healthy.
    #[arg(long, env = "LB_HC_EXPECTED_STATUS", default_value_t = 200)]
    hc_expected_status: u16,
    /// Kubernetes mode: PEM CA bundle the HTTPS check verifies backends against (chain, and the server name
    /// or else the backend's IP address).
    #[arg(long, env = "LB_HC_CA_FILE", requires = "hc_https")]
    hc_ca_file: Option<PathBuf>,
    /// Kubernetes mode: PEM client certificate the HTTPS check presents.
    #[arg(long, env = "LB_HC_CLIENT_CERT", requires_all = ["hc_https", "hc_client_key"])]
    hc_client_cert: Option<PathBuf>,
    /// Kubernetes mode: PEM private key of --hc-client-cert.
    #[arg(long, env = "LB_HC_CLIENT_KEY", requires = "hc_client_cert")]
    hc_client_key: Option<PathBuf>,
    /// Kubernetes mode: DNS name the HTTPS check sends as SNI and Host (and verifies, with --hc-ca-file).
    #[arg(long, env = "LB_HC_SERVER_NAME", requires = "hc_https")]
    hc_server_name: Option<String>,
    /// Kubernetes mode: probe UDP backends with this request (text); without a UDP probe a UDP backend
    /// follows its node's TCP checks.
    #[arg(long, env = "LB_HC_UDP_PAYLOAD", group = "hc_udp_probe")]
    hc_udp_payload: Option<String>,
    /// Kubernetes mode: the UDP probe's request as hex.
    #[arg(long, env = "LB_HC_UDP_PAYLOAD_HEX", group = "hc_udp_probe")]
    hc_udp_payload_hex: Option<String>,
    /// Kubernetes mode: the UDP probe's reply must start with this text (default: any reply).
    #[arg(
        long,
        env = "LB_HC_UDP_EXPECT",
        requires = "hc_udp_probe",
        conflicts_with = "hc_udp_expect_hex"
    )]
    hc_udp_expect: Option<String>,
    /// Kubernetes mode: the UDP probe's reply must start with these bytes (hex).
    #[arg(long, env = "LB_HC_UDP_EXPECT_HEX", requires = "hc_udp_probe")]
    hc_udp_expect_hex: Option<String>,
    /// Attach mode.
    #[arg(long, env = "LB_ATTACH_MODE", value_enum, default_value = "xdp")]
    attach_mode: Mode,
    /// Source address towards backends for every service of its family (default: each service's VIP);
    /// repeatable, one per family.
    #[arg(long = "snat-address", env = "LB_SNAT_ADDRESS", value_delimiter = ',')]
    snat_address: Vec<IpAddr>,
    /// SNAT source-port range: `auto` (the ports outside the kernel's own ephemeral range,
    /// `net.ipv4.ip_local_port_range`) or `MIN-MAX` (the part inside that range is reserved for SNAT in
    /// `net.ipv4.ip_local_reserved_ports`).
    #[arg(long, env = "LB_SNAT_PORTS", default_value = "auto")]
    snat_ports: SnatPorts,
    /// Seed of the flow hash; must be equal on all replicas so they choose the same backends.
    #[arg(long, env = "LB_HASH_SEED", default_value_t = lb_common::Config::default().hash_seed)]
    hash_seed: u32,
    /// bpffs directory for pinned maps and links (state survives agent restarts and upgrades).
    #[arg(long, env = "LB_PIN_DIR", default_value = "/sys/fs/bpf/lb")]
    pin_dir: PathBuf,
    /// Do not pin: the data plane and its flows end with the process (tests, experiments).
    #[arg(long, env = "LB_NO_PIN")]
    no_pin: bool,
    /// Where an agent of a map layout this release cannot carry over (older than the previous release's, or
    /// newer) left programs attached: take them over with empty connection tables (every connection through
    /// this node breaks) instead of refusing to start.
    #[arg(long, env = "LB_CLEAN_START")]
    clean_start: bool,
    /// Connection-tracking entries of established connections and UDP flows (two per connection; ~120 bytes
    /// each).
    #[arg(long, env = "LB_MAX_FLOWS", default_value_t = lb_common::defaults::MAX_FLOWS)]
    max_flows: u32,
    /// Entries for TCP handshakes and closed connections (two per connection): a SYN flood or churn of short
    /// connections recycles these, never the established ones.
    #[arg(long, env = "LB_MAX_TRANSIENT_FLOWS", default_value_t = lb_common::defaults::MAX_TRANSIENT)]
    max_transient_flows: u32,
    /// IPv6 connection-tracking entries (`--max-flows` for the IPv6 table; IPv6 entries are larger).
    #[arg(long, env = "LB_MAX_FLOWS_V6", default_value_t = lb_common::defaults::MAX_FLOWS_V6)]
    max_flows_v6: u32,
    /// IPv6 entries for TCP handshakes and closed connections (`--max-transient-flows` for IPv6).
    #[arg(long, env = "LB_MAX_TRANSIENT_FLOWS_V6", default_value_t = lb_common::defaults::MAX_TRANSIENT_V6)]
    max_transient_flows_v6: u32,
    /// New TCP handshakes per second per CPU (SYN rate guard; 0 = off). Over this rate, SYNs open a handshake
    /// only from sources that completed one before; the rest (a spoofed SYN flood) are dropped and counted.
    #[arg(long, env = "LB_SYN_RATE_LIMIT", default_value_t = lb_common::defaults::SYN_RATE)]
    syn_rate_limit: u32,
    /// SYNs a CPU may take at once above the SYN rate limit.
    #[arg(long, env = "LB_SYN_BURST", default_value_t = lb_common::defaults::SYN_BURST)]
    syn_burst: u32,
    /// Sources remembered as having completed a TCP handshake (let through by the SYN rate guard).
    #[arg(long, env = "LB_MAX_TRUSTED_SOURCES", default_value_t = lb_common::defaults::MAX_TRUSTED_SOURCES)]
    max_trusted_sources: u32,
    /// The connection tables' LRU lists, chosen when they are created (a restart keeps the pinned tables'):
    /// per CPU they let every CPU insert new connections without waiting for the others, but split the table
    /// evenly between the possible CPUs, so they suit interfaces whose receive queues cover the CPUs (`auto`).
    #[arg(long, env = "LB_CONNECTION_LRU", value_enum, default_value_t = LruLists::Auto)]
    connection_lru: LruLists,
    /// Services (VIP, port, protocol).
    #[arg(long, env = "LB_MAX_SERVICES", default_value_t = lb_common::defaults::MAX_SERVICES)]
    max_services: u32,
    /// Backend slots.
    #[arg(long, env = "LB_MAX_BACKENDS", default_value_t = lb_common::defaults::MAX_BACKENDS)]
    max_backends: u32,
    /// Maglev table slots over all services (4 bytes each).
    #[arg(long, env = "LB_MAGLEV_SLOTS", default_value_t = lb_common::defaults::MAGLEV_SLOTS)]
    maglev_slots: u32,
    /// Metrics and probes listen address (`/metrics`, `/healthz`, `/readyz`).
    #[arg(long, env = "LB_METRICS_ADDRESS", default_value = "127.0.0.1:9100")]
    metrics_address: SocketAddr,
    /// Idle-flow collection period (seconds).
    #[arg(long, env = "LB_GC_INTERVAL", default_value_t = 10)]
    gc_interval: u64,
    /// Period of the next-hop refresh (seconds): backends' MACs and interfaces re-resolved from the kernel's
    /// routing and neighbour tables. Route changes are taken within a second anyway (watched over rtnetlink).
    #[arg(long, env = "LB_NEIGHBOR_INTERVAL", default_value_t = 5)]
    neighbor_interval: u64,
    /// Log format.
    #[arg(long, env = "LB_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Log filter when RUST_LOG is not set (error, warn, info, debug, trace, or tracing's directives).
    #[arg(long, env = "LB_LOG_LEVEL", default_value = "info")]
    log_level: String,
    /// Load every program of the data plane into this kernel — the fast ones, `lbctl trace`'s, XDP and TC, IPv4 and
    /// IPv6 — print the kernel's verdict on each and exit (1 if it refused any). Attaches nothing and leaves a
    /// running agent alone: a preflight for a new kernel.
    #[arg(long, exclusive = true)]
    check_programs: bool,
    /// Kubernetes mode: the user whose authorized_keys takes the key of the LoadBalancer's ad-hoc debug
    /// annotations (yawol's `adHocDebug`, `adHocDebugSSHKey`), sshd started meanwhile; empty: not acted on.
    #[arg(long, env = "LB_AD_HOC_DEBUG_USER", default_value = debug::DEFAULT_USER)]
    ad_hoc_debug_user: String,
    /// VRRP virtual router id (1..=255, distinct per load balancer on the network); enables VRRP through
    /// keepalived, which moves the VIPs between the replicas.
    #[arg(long, env = "LB_VRRP_ROUTER_ID", value_parser = clap::value_parser!(u8).range(1..))]
    vrrp_router_id: Option<u8>,
    /// VRRP base priority (1..=254); the newest revision's machines get a bonus on top (Kubernetes mode).
    #[arg(long, env = "LB_VRRP_PRIORITY", default_value_t = lb_agent::ha::vrrp::DEFAULT_BASE_PRIORITY,
          value_parser = clap::value_parser!(u8).range(1..=254))]
    vrrp_priority: u8,
    /// VRRP advertisement interval (VRRPv3: multiple of 10 ms; VRRPv2: whole seconds); a dead master is
    /// replaced after ~3 intervals.
    #[arg(long, env = "LB_VRRP_ADVERT_INTERVAL", default_value = "200ms", value_parser = go_duration)]
    vrrp_advert_interval: Duration,
    /// VRRP protocol version (3, or 2 to share one VRRP group with yawol's keepalived; yawol mode takes it from
    /// yawol's keepalived.conf).
    #[arg(long, env = "LB_VRRP_VERSION", default_value_t = 3,
          value_parser = clap::value_parser!(u8).range(2..=3))]
    vrrp_version: u8,
    /// VRRPv2 password (`auth_type PASS`, up to 8 characters; plain text on the wire, it only keeps groups
    /// apart). yawol mode takes it from yawol's keepalived.conf.
    #[arg(long, env = "LB_VRRP_AUTH_PASS")]
    vrrp_auth_pass: Option<String>,
    /// VRRP priority bonus of a machine of the LoadBalancer's newest revision (Kubernetes mode).
    #[arg(long, env = "LB_VRRP_NEWEST_BONUS", default_value_t = lb_agent::ha::vrrp::DEFAULT_NEWEST_BONUS)]
    vrrp_newest_bonus: u8,
    /// VRRP priority bonus of a healthy machine of an older revision (Kubernetes mode).
    #[arg(long, env = "LB_VRRP_OLDER_BONUS", default_value_t = 0)]
    vrrp_older_bonus: u8,
    /// Unicast VRRP peer (repeatable); none = multicast.
    #[arg(long = "vrrp-peer", env = "LB_VRRP_PEERS", value_delimiter = ',')]
    vrrp_peers: Vec<IpAddr>,
    /// Directory of keepalived's generated config, pid files and FIFOs.
    #[arg(long, env = "LB_VRRP_RUN_DIR", default_value = "/run/lb-agent/vrrp")]
    vrrp_run_dir: PathBuf,
    /// The keepalived binary.
    #[arg(long, env = "LB_KEEPALIVED_BINARY", default_value = lb_agent::ha::vrrp::DEFAULT_KEEPALIVED_BIN)]
    keepalived_binary: PathBuf,
    /// Active-active instead of VRRP: every replica serves the VIPs at once, and someone else routes them to the
    /// eligible ones (the cloud controller's router routes, reading the `VIPEligible` condition, or static ECMP
    /// routes). Needs `--snat-address` (this replica's own address: replies must come back to the replica holding
    /// the flow) and flow sync with every other replica. `--bgp-local-as` implies it.
    #[arg(long, env = "LB_ACTIVE_ACTIVE", conflicts_with = "vrrp_router_id",
          requires_all = ["snat_address", "sync_listen"])]
    active_active: bool,
    /// Active-active, announced by the agent: this replica's BGP AS; enables announcing the VIPs over BGP through
    /// BIRD to the `--bgp-peer` routers while the machine is eligible (instead of VRRP). Needs `--snat-address`
    /// (this replica's own address: replies must come back to the replica holding the flow) and flow sync with
    /// every other replica.
    #[arg(long, env = "LB_BGP_LOCAL_AS", conflicts_with = "vrrp_router_id",
          requires_all = ["bgp_peers", "bgp_peer_as", "snat_address", "sync_listen"])]
    bgp_local_as: Option<u32>,
    /// An upstream router to announce the VIPs to (repeatable).
    #[arg(long = "bgp-peer", env = "LB_BGP_PEERS", value_delimiter = ',')]
    bgp_peers: Vec<IpAddr>,
    /// The upstream routers' AS.
    #[arg(long, env = "LB_BGP_PEER_AS")]
    bgp_peer_as: Option<u32>,
    /// BGP hold time (whole seconds, at least 3): a router stops sending to a replica it has not heard from
    /// for this long; a stopped or crashed BIRD is withdrawn at once (its TCP connection closes).
    #[arg(long, env = "LB_BGP_HOLD_TIME", default_value = "9s", value_parser = go_duration)]
    bgp_hold_time: Duration,
    /// BGP router id (default: BIRD's choice, the machine's lowest IPv4 address).
    #[arg(long, env = "LB_BGP_ROUTER_ID")]
    bgp_router_id: Option<std::net::Ipv4Addr>,
    /// Directory of BIRD's generated config, control socket and pid file.
    #[arg(long, env = "LB_BGP_RUN_DIR", default_value = "/run/lb-agent/bgp")]
    bgp_run_dir: PathBuf,
    /// The bird binary (BIRD 2).
    #[arg(long, env = "LB_BIRD_BINARY", default_value = lb_agent::ha::bgp::DEFAULT_BIRD_BIN)]
    bird_binary: PathBuf,
    /// Listen address of connection-state sync (this machine's address on the VIP network and the sync port);
    /// enables sync with the peers.
    #[arg(long, env = "LB_SYNC_LISTEN", requires = "sync_secret_file")]
    sync_listen: Option<SocketAddr>,
    /// A peer replica's sync address (repeatable); in Kubernetes mode the LoadBalancer's `syncPeers`
    /// annotation replaces the list.
    #[arg(long = "sync-peer", env = "LB_SYNC_PEERS", value_delimiter = ',')]
    sync_peers: Vec<SocketAddr>,
    /// File with the replicas' pre-shared sync key (at least 16 bytes; surrounding whitespace ignored).
    #[arg(long, env = "LB_SYNC_SECRET_FILE")]
    sync_secret_file: Option<PathBuf>,
    /// Revision of this machine's LoadBalancerSet (Kubernetes mode): equal to the LoadBalancer's revision
    /// gives the VRRP priority bonus, so a rollout's new machines take the VIP once they are ready.
    #[arg(long, env = "LB_MACHINE_REVISION")]
    machine_revision: Option<String>,
}

impl Cli {
    /// VRRP, active-active (BGP) and sync settings.
    fn ha(&self) -> Result<HaOptions> {
        let vrrp = self.vrrp_router_id.map(|id| {
            let mut v = VrrpOptions::new(self.interface[0].clone(), id, self.vrrp_run_dir.clone());
            v.base_priority = self.vrrp_priority;
            v.advert_interval = self.vrrp_advert_interval;
            v.version = self.vrrp_version;
            v.auth_pass = self.vrrp_auth_pass.clone();
            v.newest_bonus = self.vrrp_newest_bonus;
            v.older_bonus = self.vrrp_older_bonus;
            v.unicast_peers = self.vrrp_peers.clone();
            v.keepalived_bin = self.keepalived_binary.clone();
            v
        });
        let sync = match (&self.sync_listen, &self.sync_secret_file) {
            (Some(listen), Some(file)) => {
                let secret = std::fs::read_to_string(file)
                    .with_context(|| format!("reading the sync secret {}", file.display()))?;
                Some(SyncSettings {
                    listen: *listen,
                    peers: self.sync_peers.clone(),
                    secret: secret.trim().as_bytes().to_vec(),
                })
            }
            _ => None,
        };
        let bgp = match (self.bgp_local_as, self.bgp_peer_as) {
            (Some(local), Some(peer_as)) => {
                let mut b = BgpOptions::new(
                    local,
                    self.bgp_peers.clone(),
                    peer_as,
                    self.bgp_run_dir.clone(),
                );
                b.hold_time = self.bgp_hold_time;
                b.router_id = self.bgp_router_id;
                b.bird_bin = self.bird_binary.clone();
                b.validate()?;
                Some(b)
            }
            _ => None,
        };
        Ok(HaOptions {
            vrrp,
            // Announcing over BGP is one way of being active-active.
            active_active: self.active_active || bgp.is_some(),
            bgp,
            sync,
        })
    }
}

/// Go-style duration (`30s`, `1m30s`, `500ms`), as in the LoadBalancer objects.
fn go_duration(s: &str) -> Result<Duration, String> {
    lb_api::parse_go_duration(s).map_err(|e| e.to_string())
}

impl Cli {
    /// Health-check settings of Kubernetes mode (the LoadBalancer object has none).
    fn health_check(&self) -> HealthCheckSpec {
        HealthCheckSpec {
            enabled: true,
            interval: self.hc_interval,
            timeout: self.hc_timeout,
            unhealthy_threshold: self.hc_unhealthy_threshold,
            healthy_threshold: self.hc_healthy_threshold,
            http: self.hc_http_path.as_deref().map(|path| HttpCheck {
                https: self.hc_https,
                expected_status: self.hc_expected_status,
                ca_file: self.hc_ca_file.clone(),
                client_cert_file: self.hc_client_cert.clone(),
                client_key_file: self.hc_client_key.clone(),
                server_name: self.hc_server_name.clone(),
                ..HttpCheck::get(path)
            }),
            udp: bytes_flag(&self.hc_udp_payload, &self.hc_udp_payload_hex).map(|payload| {
                UdpCheck {
                    payload,
                    expect: bytes_flag(&self.hc_udp_expect, &self.hc_udp_expect_hex),
                }
            }),
        }
    }
}

/// A text or hex flag pair as [`Bytes`] (clap lets at most one be given).
fn bytes_flag(text: &Option<String>, hex: &Option<String>) -> Option<Bytes> {
    (text.is_some() || hex.is_some()).then(|| Bytes {
        text: text.clone(),
        hex: hex.clone(),
    })
}

/// `--check-programs`: a line per program of the object, then a summary; an error naming the refused ones.
fn check_programs() -> Result<()> {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|k| k.trim().to_string())
        .unwrap_or_else(|_| "?".into());
    let checks = lb_agent::dataplane::check_programs()?;
    for c in &checks {
        let verdict = if c.refused.is_some() {
            "REFUSED"
        } else {
            "accepted"
        };
        println!("{:<20} {:<3} {verdict}", c.name, c.hook);
    }
    let refused: Vec<_> = checks.iter().filter(|c| c.refused.is_some()).collect();
    for c in &refused {
        // A verifier log runs to thousands of lines; what failed is at its end.
        let text = c.refused.as_deref().unwrap_or("");
        let lines: Vec<&str> = text.lines().collect();
        let shown = if lines.len() > 40 {
            format!(
                "{}\n… ({} lines of the verifier log left out)\n{}",
                lines[0],
                lines.len() - 31,
                lines[lines.len() - 30..].join("\n")
            )
        } else {
            text.to_string()
        };
        println!("\n{} ({}): {shown}", c.name, c.hook);
    }
    if !refused.is_empty() {
        let names: Vec<&str> = refused.iter().map(|c| c.name.as_str()).collect();
        bail!(
            "kernel {kernel} refused {} of {} programs: {}",
            refused.len(),
            checks.len(),
            names.join(", ")
        );
    }
    println!("kernel {kernel} accepts all {} programs", checks.len());
    Ok(())
}

/// The command line to parse: the process's own, or — started as `yawollet` — lb-agent's arguments for yawollet's
/// flags and yawol's keepalived.conf, with that translation (its notes and what yawollet does differently).
fn command_line() -> Result<(Vec<OsString>, Option<yawollet::Translation>)> {
    let argv: Vec<OsString> = std::env::args_os().collect();
    if !argv
        .first()
        .is_some_and(|a| yawollet::invoked_as_yawollet(a))
    {
        return Ok((argv, None));
    }
    let args: Vec<String> = argv[1..]
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    if yawollet::wants_help(&args) {
        // As yawollet's Go flag set does: usage on stderr, exit 0.
        eprint!("{}", yawollet::usage());
        std::process::exit(0);
    }
    let conf = match std::fs::read_to_string(yawollet::KEEPALIVED_CONF) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e).with_context(|| format!("reading {}", yawollet::KEEPALIVED_CONF)),
    };
    let fast_vrrp = std::env::var(yawollet::FAST_VRRP_ENV)
        .is_ok_and(|v| matches!(v.trim(), "1" | "true" | "TRUE" | "True"));
    let t = yawollet::translate_with(&args, conf.as_deref(), fast_vrrp)
        .context("yawollet compatibility")?;
    let mut out = vec![OsString::from("lb-agent")];
    out.extend(t.args.iter().map(OsString::from));
    Ok((out, Some(t)))
}

#[tokio::main]
async fn main() -> Result<()> {
    let (argv, as_yawollet) = command_line()?;
    // Before clap: alone, the flag would leave the required --interface without a value (clap's derive fails then);
    // with anything else, clap refuses it as exclusive.
    if argv.len() == 2 && argv[1] == "--check-programs" {
        return check_programs();
    }
    let cli = Cli::parse_from(&argv);
    debug_assert!(
        !cli.check_programs,
        "alone it returned above; with others clap refuses it"
    );
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&cli.log_level))
        .with_context(|| format!("--log-level {:?}", cli.log_level))?;
    match cli.log_format {
        LogFormat::Text => tracing_subscriber::fmt().with_env_filter(filter).init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init(),
    }
    if let Some(yawollet::Translation { notes, .. }) = &as_yawollet {
        let args: Vec<_> = argv[1..].iter().map(|a| a.to_string_lossy()).collect();
        tracing::info!(args = %args.join(" "), "started as yawollet: yawollet's flags and yawol's keepalived.conf translated");
        for n in notes {
            if n.warning {
                tracing::warn!("yawollet compatibility: {}", n.text);
            } else {
                tracing::info!("yawollet compatibility: {}", n.text);
            }
        }
    }
    // Before anything is changed on the machine: a setting the HA parts would refuse stops the agent here.
    let ha = cli.ha()?;
    if cli.snat_address.iter().filter(|a| a.is_ipv4()).count() > 1
        || cli.snat_address.iter().filter(|a| a.is_ipv6()).count() > 1
    {
        anyhow::bail!(
            "--snat-address takes one address per family, got {:?}",
            cli.snat_address
        );
    }
    let (min, max) = lb_agent::snat_ports::apply(cli.snat_ports, Path::new("/proc/sys/net/ipv4"))?;
    let connection_lru = match cli.connection_lru {
        LruLists::PerCpu => ConnectionLru::PerCpu,
        LruLists::Common => ConnectionLru::Common,
        LruLists::Auto => {
            let queues: Vec<u32> = cli
                .interface
                .iter()
                .map(|i| Nic::read(i).rx_queues)
                .collect();
            let cpus = lb_agent::dataplane::nic::possible_cpus();
            let lists = ConnectionLru::for_queues(&queues, cpus);
            tracing::info!(receive_queues = ?queues, possible_cpus = cpus, lists = ?lists,
                "connection tables' LRU lists (--connection-lru auto): per CPU when every interface has a receive \
                 queue per possible CPU");
            lists
        }
    };
    let opts = AgentOptions {
        interface: cli.interface[0].clone(),
        forward_interfaces: cli.interface[1..].to_vec(),
        attach_mode: match cli.attach_mode {
            Mode::Xdp => AttachMode::Xdp,
            Mode::XdpNative => AttachMode::XdpNative,
            Mode::XdpGeneric => AttachMode::XdpGeneric,
            Mode::Tc => AttachMode::Tc,
        },
        pin_dir: (!cli.no_pin).then(|| cli.pin_dir.join(&cli.interface[0])),
        sizes: MapSizes {
            connection_lru,
            flows: cli.max_flows,
            transient: cli.max_transient_flows,
            flows_v6: cli.max_flows_v6,
            transient_v6: cli.max_transient_flows_v6,
            services: cli.max_services,
            backends: cli.max_backends,
            maglev_slots: cli.maglev_slots,
            trusted_sources: cli.max_trusted_sources,
            ..MapSizes::default()
        },
        dataplane: lb_common::Config {
            snat_port_min: min,
            snat_port_max: max,
            hash_seed: cli.hash_seed,
            ..Default::default()
        }
        .with_syn_rate(cli.syn_rate_limit, cli.syn_burst),
        snat_override: cli.snat_address.clone(),
        gc_interval: Duration::from_secs(cli.gc_interval.max(1)),
        neighbor_interval: Duration::from_secs(cli.neighbor_interval.max(1)),
        detach_on_exit: false,
        ha,
        clean_start: cli.clean_start,
    };
    if let Some(dir) = &opts.pin_dir {
        ensure_bpffs(dir)?;
    }
    let (status_tx, status_rx) = tokio::sync::watch::channel(AgentStatus::default());
    let snapshot: SharedSnapshot = Default::default();
    // Kept alive for the whole run: dropping it stops the Kubernetes tasks.
    let mut _kube_mode = None;
    let config_rx = match (&cli.config, &cli.loadbalancer_name) {
        (Some(path), None) => lb_agent::source::file::watch_file(
            path.clone(),
            Duration::from_millis(50),
            cli.attach_mode != Mode::Tc,
        ),
        (None, Some(lb)) => {
            let settings = kube_settings(&cli, lb, as_yawollet.as_ref().map(|t| t.compat))?;
            tracing::info!(namespace = %settings.namespace, loadbalancer = %settings.loadbalancer,
                machine = %settings.machine, requeue = ?settings.requeue, "Kubernetes mode");
            let client = lb_agent::source::kubernetes::client(cli.kubeconfig.as_deref()).await?;
            let mode = lb_agent::source::kubernetes::start(client, settings, status_rx, snapshot.clone());
            let rx = mode.config.clone();
            _kube_mode = Some(mode);
            rx
        }
        _ => bail!("give either --config FILE or the Kubernetes flags (--namespace, --loadbalancer-name, --loadbalancer-machine-name)"),
    };
    let metrics_addr = cli.metrics_address;
    let snap2 = snapshot.clone();
    tokio::spawn(async move {
        if let Err(e) = lb_agent::report::metrics::serve(metrics_addr, snap2).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    agent::run(opts, config_rx, status_tx, snapshot, shutdown).await
}

/// Kubernetes-mode settings from the flags; every required flag is named when missing.
fn kube_settings(
    cli: &Cli,
    loadbalancer: &str,
    yawollet: Option<yawollet::Compat>,
) -> Result<KubeSettings> {
    let namespace = cli
        .namespace
        .clone()
        .context("Kubernetes mode needs --namespace")?;
    let machine = cli
        .loadbalancer_machine_name
        .clone()
        .context("Kubernetes mode needs --loadbalancer-machine-name")?;
    let health_check = cli.health_check();
    health_check
        .validate()
        .context("health-check flags (--hc-*)")?;
    let (min, max) = (Duration::from_secs(5), Duration::from_secs(170));
    let requeue = cli.requeue_period.clamp(min, max);
    if requeue != cli.requeue_period {
        tracing::warn!(given = ?cli.requeue_period, used = ?requeue, "--requeue-period clamped to 5s..170s");
    }
    Ok(KubeSettings {
        namespace,
        loadbalancer: loadbalancer.to_string(),
        machine,
        health_check,
        requeue,
        clock: lb_agent::source::kubernetes::system_clock(),
        machine_revision: cli.machine_revision.clone(),
        ad_hoc_debug: (!cli.ad_hoc_debug_user.is_empty())
            .then(|| debug::AdHocDebugSettings::for_user(&cli.ad_hoc_debug_user)),
        yawollet,
        proxy_v2: cli.attach_mode != Mode::Tc,
    })
}

/// Makes sure `pin_dir` lives on a bpffs: mounts /sys/fs/bpf when the directory is under it and nothing is
/// mounted there; any other location must already be a bpffs mount.
fn ensure_bpffs(pin_dir: &Path) -> Result<()> {
    const BPF_FS_MAGIC: i64 = 0xcafe4a11;
    let on_bpffs = |p: &Path| -> bool {
        let mut dir = p.to_path_buf();
        while !dir.exists() {
            if !dir.pop() {
                return false;
            }
        }
        let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
            return false;
        };
        // SAFETY: valid C string and out pointer.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == BPF_FS_MAGIC }
    };
    if on_bpffs(pin_dir) {
        return Ok(());
    }
    if pin_dir.starts_with("/sys/fs/bpf") {
        std::fs::create_dir_all("/sys/fs/bpf")?;
        let status = std::process::Command::new("mount")
            .args(["-t", "bpf", "bpf", "/sys/fs/bpf"])
            .status()
            .context("running mount -t bpf")?;
        if status.success() && on_bpffs(pin_dir) {
            return Ok(());
        }
    }
    bail!(
        "pin directory {} is not on a bpffs mount: mount one (mount -t bpf bpf DIR) or pass --no-pin",
        pin_dir.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> Result<Cli, clap::Error> {
        let base = [
            "lb-agent",
            "--interface",
            "eth0",
            "--config",
            "/etc/lb.yaml",
        ];
        Cli::try_parse_from(base.iter().chain(extra))
    }

    const ACTIVE: [&str; 5] = [
        "--snat-address=10.0.0.5",
        "--sync-listen=10.0.0.5:9190",
        "--sync-secret-file=/dev/null",
        "--sync-peer=10.0.0.6:9190",
        "--active-active",
    ];

    #[test]
    fn active_active_with_or_without_bgp() {
        let ha = parse(&ACTIVE).unwrap().ha().unwrap();
        assert!(ha.active_active && ha.bgp.is_none() && ha.vrrp.is_none() && ha.enabled());
        // BGP implies it, with the flag or without.
        let bgp = [
            "--bgp-local-as=65001",
            "--bgp-peer=10.0.0.1",
            "--bgp-peer-as=65000",
        ];
        for flags in [&ACTIVE[..], &ACTIVE[..4]] {
            let args: Vec<&str> = flags.iter().chain(&bgp).copied().collect();
            let ha = parse(&args).unwrap().ha().unwrap();
            assert!(ha.active_active && ha.bgp.is_some(), "{args:?}");
        }
        assert!(!parse(&[]).unwrap().ha().unwrap().active_active);
    }

    #[test]
    fn active_active_refuses_vrrp_and_needs_snat_and_sync() {
        let e = parse(&[&ACTIVE[..], &["--vrrp-router-id=7"]].concat()).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
        for missing in [0, 1] {
            let args: Vec<&str> = ACTIVE
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != missing)
                .map(|(_, a)| *a)
                .collect();
            let e = parse(&args).unwrap_err();
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::MissingRequiredArgument,
                "{args:?}"
            );
        }
    }
}
