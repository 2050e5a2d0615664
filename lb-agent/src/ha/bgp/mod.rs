//! Active-active: several replicas serve one VIP at once, and the upstream routers spread its packets over them
//! by ECMP. Each replica announces the VIP (a /32 or /128) over BGP with Debian's BIRD 2, configured and
//! supervised by the agent, while it is eligible — data plane attached, config current, flows synced with the
//! reachable peers, the same rule that offers a VRRP replica for the VIP — and withdraws it otherwise.
//!
//! # Decision
//!
//! **BIRD 2 from Debian, configured and supervised by the agent**, like keepalived for VRRP: the field's engine
//! (FRR, GoBGP and BIRD all do; BIRD is one small process with a text config and a control socket), no routing
//! protocol of our own. The agent only says *what* to announce; BIRD does sessions, timers and the protocol.
//!
//! # How
//!
//! [`render_config`] renders a bird.conf (pure, unit-tested): a static protocol per family holding the
//! announced VIPs as blackhole routes (never exported to the kernel: there is no kernel protocol), and one BGP
//! session per upstream router that exports exactly those routes with `next hop self` and imports nothing.
//! [`Bird`] runs it in the foreground (`bird -f`), restarts it with capped backoff when it dies, and on every
//! change of the announced set rewrites the file and sends SIGHUP. It reads the sessions' states from BIRD's
//! control socket (`show protocols`) for metrics and for a warning about a router that never answers. Files
//! under [`BgpOptions::run_dir`]: `bird.conf`, `bird.ctl` (control socket), `bird.pid`.
//!
//! # Replies and moved flows
//!
//! Full NAT sends a backend's reply to the SNAT address, so every replica SNATs to an address of its own
//! (`--snat-address`, required here, one per family; a VIP of a family without one is not announced): a reply
//! reaches the replica that holds the flow. Flow sync runs as a
//! full mesh (every replica lists the others as peers), so when the routers move a flow — a replica added,
//! drained or lost — the replica that now gets its client packets has the owner's entry and translates them
//! exactly like the owner did (same backend, the owner's SNAT address and port); the backend's replies still go
//! to the owner. Every replica keeps its own entries over a peer's conflicting record (all are "master").
//!
//! # BIRD 2.0.12 facts this relies on (verified on Debian 12)
//!
//! - SIGHUP reconfigures: a static protocol whose routes changed is reloaded in place, the BGP sessions stay
//!   up and send only the changed routes (announce or withdraw). SIGHUP before BIRD installed its handler
//!   would kill it, so the supervisor signals only a BIRD whose control socket has answered.
//! - eBGP needs explicit import and export filters (RFC 8212); `graceful restart off` makes a router drop our
//!   routes as soon as the session ends instead of keeping them stale for the restart time (120 s).
//! - A session ends when BIRD's TCP connection closes (BIRD stopped or killed: the kernel sends the FIN), else
//!   after the hold time (`--bgp-hold-time`, BIRD's minimum 3 s; keepalives every third of it).
//! - Control socket: a greeting `0001 BIRD 2.0.12 ready.`, then per command lines `NNNN-text` or ` text`,
//!   ending with a line `NNNN text` (`0000 ` for success).
//!
//! # The agent's life
//!
//! BIRD gets SIGTERM when the agent dies (`PR_SET_PDEATHSIG`), and the agent stops it on exit: an agent that
//! does not run withdraws, unlike keepalived, which survives the agent so that the VIP does not move. Here a
//! withdrawal costs no connection: the others have this replica's flows, and its pinned data plane keeps
//! translating the replies that come to its SNAT address. Stopping the agent (SIGTERM) is therefore how a
//! replica is drained: its routes go, its data plane serves its connections' replies until they end.

mod bird;

pub use bird::Bird;

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Debian's BIRD 2.
pub const DEFAULT_BIRD_BIN: &str = "/usr/sbin/bird";
/// Default hold time: a router stops sending to a silent replica after this (BIRD's minimum is 3 s).
pub const DEFAULT_HOLD_TIME: Duration = Duration::from_secs(9);
/// Name of the static protocol holding the announced IPv4 VIPs (its IPv6 twin ends in 6).
const VIPS_PROTOCOL: &str = "lb_vips";

/// How the agent announces the VIPs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BgpOptions {
    /// This replica's AS.
    pub local_as: u32,
    /// The upstream routers (one BGP session each; a VIP is announced to the routers of its family).
    pub peers: Vec<IpAddr>,
    /// The routers' AS.
    pub peer_as: u32,
    /// BGP hold time (whole seconds, at least 3).
    pub hold_time: Duration,
    /// BGP router id (BIRD takes the lowest IPv4 address of the machine when unset).
    pub router_id: Option<Ipv4Addr>,
    /// Directory of the config, control socket and pid file.
    pub run_dir: PathBuf,
    /// The `bird` binary.
    pub bird_bin: PathBuf,
}

/// A setting BIRD would refuse or a setup that cannot work.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("active-active needs at least one BGP peer (--bgp-peer)")]
    NoPeers,
    #[error("AS numbers must be 1..=4294967295")]
    ZeroAs,
    #[error("the BGP hold time must be 3..=65535 whole seconds, got {0:?}")]
    HoldTime(Duration),
}

impl BgpOptions {
    /// Options for `peers` in AS `peer_as`, defaults elsewhere.
    pub fn new(local_as: u32, peers: Vec<IpAddr>, peer_as: u32, run_dir: PathBuf) -> Self {
        BgpOptions {
            local_as,
            peers,
            peer_as,
            hold_time: DEFAULT_HOLD_TIME,
            router_id: None,
            run_dir,
            bird_bin: DEFAULT_BIRD_BIN.into(),
        }
    }

    /// Checks what BIRD would refuse, so that the agent fails at start with a reason.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.peers.is_empty() {
            return Err(ConfigError::NoPeers);
        }
        if self.local_as == 0 || self.peer_as == 0 {
            return Err(ConfigError::ZeroAs);
        }
        let s = self.hold_time.as_secs();
        if !(3..=65535).contains(&s) || self.hold_time.subsec_nanos() != 0 {
            return Err(ConfigError::HoldTime(self.hold_time));
        }
        Ok(())
    }

    fn config_path(&self) -> PathBuf {
        self.run_dir.join("bird.conf")
    }

    fn socket_path(&self) -> PathBuf {
        self.run_dir.join("bird.ctl")
    }

    fn pid_path(&self) -> PathBuf {
        self.run_dir.join("bird.pid")
    }
}

/// BIRD's name of the session with `opts.peers[i]`.
fn session_name(i: usize) -> String {
    format!("upstream{}", i + 1)
}

/// The bird.conf announcing `announce` (see the [module documentation](self)).
pub fn render_config(opts: &BgpOptions, announce: &[IpAddr]) -> String {
    let hold = opts.hold_time.as_secs();
    let mut c =
        String::from("# Written by lb-agent; rewritten whenever the announced VIPs change.\n");
    if let Some(id) = opts.router_id {
        let _ = writeln!(c, "router id {id};");
    }
    c.push_str("log stderr all;\nprotocol device {}\n");
    for (family, suffix, len) in [("ipv4", "", 32), ("ipv6", "6", 128)] {
        let _ = writeln!(c, "protocol static {VIPS_PROTOCOL}{suffix} {{\n  {family};");
        for vip in announce.iter().filter(|v| v.is_ipv4() == (len == 32)) {
            let _ = writeln!(c, "  route {vip}/{len} blackhole;");
        }
        c.push_str("}\n");
    }
    for (i, peer) in opts.peers.iter().enumerate() {
        let (family, suffix) = if peer.is_ipv4() {
            ("ipv4", "")
        } else {
            ("ipv6", "6")
        };
        let _ = write!(
            c,
            "protocol bgp {name} {{\n  local as {local};\n  neighbor {peer} as {remote};\n  \
             hold time {hold};\n  keepalive time {ka};\n  \
             connect delay time 1;\n  connect retry time 5;\n  error wait time 1, 10;\n  \
             graceful restart off;\n  \
             {family} {{ import none; export where proto = \"{VIPS_PROTOCOL}{suffix}\"; next hop self; }};\n}}\n",
            name = session_name(i),
            local = opts.local_as,
            remote = opts.peer_as,
            ka = (hold / 3).max(1),
        );
    }
    c
}

/// One BGP session as BIRD reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BgpSession {
    /// The router.
    pub peer: IpAddr,
    /// Routes are exchanged.
    pub established: bool,
    /// BIRD's words (`Established`, `Active Socket: Connection refused`, …).
    pub info: String,
    /// Down for 30 s or longer (a router that does not answer, not one still connecting).
    pub stuck: bool,
}

/// What the announcement looks like now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BgpSnapshot {
    /// The VIPs in BIRD's configuration.
    pub announced: Vec<IpAddr>,
    /// The sessions, as of BIRD's last answer (empty while it does not run).
    pub sessions: Vec<BgpSession>,
    /// BIRD processes restarted by the agent.
    pub restarts: u64,
}

/// The BGP sessions in a `show protocols` reply, with their routers (`peers` in configuration order).
fn parse_protocols(reply: &str, peers: &[IpAddr]) -> Vec<BgpSession> {
    reply
        .lines()
        .filter_map(|line| {
            // `1002-name …` opens the table, ` name …` continues it.
            let row = match line.as_bytes().get(4) {
                Some(b'-') if line[..4].bytes().all(|b| b.is_ascii_digit()) => &line[5..],
                _ => line.strip_prefix(' ')?,
            };
            let cols: Vec<&str> = row.split_whitespace().collect();
            if cols.get(1) != Some(&"BGP") {
                return None;
            }
            let i = (0..peers.len()).find(|&i| session_name(i) == cols[0])?;
            let info = cols.get(5..).map(|c| c.join(" ")).unwrap_or_default();
            Some(BgpSession {
                peer: peers[i],
                established: info.starts_with("Established"),
                info,
                stuck: false,
            })
        })
        .collect()
}

/// Whether `line` ends a control-socket reply (a code followed by a space).
fn is_last_reply_line(line: &str) -> bool {
    line.len() >= 5 && line[..4].bytes().all(|b| b.is_ascii_digit()) && line.as_bytes()[4] == b' '
}

/// Creates the run directory (owner-only: the control socket can change the announcement).
fn prepare_run_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> BgpOptions {
        let mut o = BgpOptions::new(
            65001,
            vec!["10.0.0.1".parse().unwrap(), "fd00::1".parse().unwrap()],
            65000,
            "/run/x".into(),
        );
        o.hold_time = Duration::from_secs(3);
        o.router_id = Some("10.0.0.2".parse().unwrap());
        o
    }

    #[test]
    fn renders_vips_per_family_and_a_session_per_router() {
        let c = render_config(
            &opts(),
            &["10.0.0.100".parse().unwrap(), "fd00::100".parse().unwrap()],
        );
        assert!(c.contains("router id 10.0.0.2;"));
        assert!(
            c.contains("protocol static lb_vips {\n  ipv4;\n  route 10.0.0.100/32 blackhole;\n}")
        );
        assert!(
            c.contains("protocol static lb_vips6 {\n  ipv6;\n  route fd00::100/128 blackhole;\n}")
        );
        assert!(c.contains(
            "protocol bgp upstream1 {\n  local as 65001;\n  neighbor 10.0.0.1 as 65000;"
        ));
        assert!(c.contains("hold time 3;\n  keepalive time 1;"));
        assert!(
            c.contains("ipv4 { import none; export where proto = \"lb_vips\"; next hop self; };")
        );
        assert!(
            c.contains("ipv6 { import none; export where proto = \"lb_vips6\"; next hop self; };")
        );
        assert!(c.contains("graceful restart off;"));
        // Withdrawn: the static protocols stay, empty.
        let w = render_config(&opts(), &[]);
        assert!(w.contains("protocol static lb_vips {\n  ipv4;\n}"));
        assert!(!w.contains("route "));
    }

    #[test]
    fn refuses_what_bird_would() {
        assert_eq!(opts().validate(), Ok(()));
        let mut o = opts();
        o.peers.clear();
        assert_eq!(o.validate(), Err(ConfigError::NoPeers));
        let mut o = opts();
        o.local_as = 0;
        assert_eq!(o.validate(), Err(ConfigError::ZeroAs));
        let mut o = opts();
        o.hold_time = Duration::from_secs(2);
        assert!(matches!(o.validate(), Err(ConfigError::HoldTime(_))));
        o.hold_time = Duration::from_millis(3500);
        assert!(matches!(o.validate(), Err(ConfigError::HoldTime(_))));
    }

    #[test]
    fn reads_session_states_from_show_protocols() {
        // BIRD 2.0.12's reply, as read from its control socket.
        let reply = "2002-Name       Proto      Table      State  Since         Info\n\
                     1002-device1    Device     ---        up     21:36:58.497  \n \
                     lb_vips    Static     master4    up     21:36:58.497  \n \
                     upstream1  BGP        ---        up     21:36:58.498  Established   \n \
                     upstream2  BGP        ---        start  21:36:58.498  Active        Socket: Connection refused\n\
                     0000 \n";
        let s = parse_protocols(reply, &opts().peers);
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].peer, opts().peers[0]);
        assert!(s[0].established);
        assert_eq!(s[0].info, "Established");
        assert!(!s[1].established);
        assert_eq!(s[1].info, "Active Socket: Connection refused");
        assert!(is_last_reply_line("0000 "));
        assert!(is_last_reply_line("0001 BIRD 2.0.12 ready."));
        assert!(!is_last_reply_line("1002-device1 …"));
        assert!(!is_last_reply_line(" upstream1 BGP"));
    }
}
