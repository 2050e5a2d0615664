//! VRRP for the agent: Debian's keepalived (2.2), configured and supervised by the agent.
//!
//! # Decision
//!
//! The VIP moves between the load-balancer machines with **keepalived from Debian, configured and supervised
//! by the agent**, not with a native VRRPv3 implementation in the agent. keepalived is the field's standard and
//! operators know it; it already handles gratuitous ARP / unsolicited NA, VRRPv3 with centisecond adverts and
//! adding/removing the VIP address. What yawol lacked, the agent adds around it:
//!
//! - sub-second timers (VRRPv3, default advert interval 200 ms instead of yawol's 4 s) — outside yawol mode, or
//!   in it with an explicit opt-in (see "Switching from yawol"),
//! - data-plane health and revision feeding the priority (track files written by the agent, see below),
//! - a distinct virtual router id per LoadBalancer ([`lb_api::ha::router_id_for`]) instead of yawol's shared 100
//!   (yawol mode keeps yawol's, to be one group with yawol's machines),
//! - connection sync between replicas (done elsewhere).
//!
//! # How
//!
//! [`render_config`] renders a keepalived.conf (pure, unit-tested): VRRPv3 (VRRPv2 with an optional `auth PASS`
//! for yawol mode), every node `state BACKUP`,
//! preemption on without delay (a higher priority — the newest revision — takes the VIP), GARP/NA bursts on
//! takeover plus a periodic refresh, VIPs as /32 (/128) on the interface, no LVS and no scripts at all.
//! [`Keepalived`] runs it in the foreground (`keepalived -n -l -P`) and restarts it with capped backoff when it
//! dies. Files, all under [`VrrpOptions::run_dir`] (one directory per agent, so several agents in different
//! network namespaces on one host never collide; see [`RunPaths`]):
//!
//! | file | written by | purpose |
//! |---|---|---|
//! | `keepalived.conf` | agent | the rendered configuration |
//! | `keepalived.pid`, `vrrp.pid` | keepalived | `-p`/`-r`: own pid files instead of `/run/keepalived*.pid` |
//! | `notify.fifo` | agent creates, keepalived writes | `vrrp_notify_fifo`: state transitions without polling |
//! | `log.fifo` | agent creates, keepalived writes | keepalived's console log (stdout/stderr), forwarded to `tracing` |
//! | `healthy` | agent | track file, `weight 0 reverse`: `1` = may hold the VIP, `0`/missing = FAULT |
//! | `priority-bonus` | agent | track file, `weight 1`: added to the base priority ("newest revision") |
//! | `keepalived.stats`, `keepalived.data` | keepalived | SIGUSR2 / SIGUSR1 dumps (`TMPDIR` = run dir) |
//!
//! # keepalived 2.2.7 facts this relies on (verified on Debian 12)
//!
//! - **Track files** (`man 5 keepalived.conf`, "Track files"; `vrrp_track.c`): keepalived watches the file's
//!   directory with inotify (`IN_CLOSE_WRITE | IN_DELETE | IN_MOVE`) and reads the number in it. With weight 0 a
//!   non-zero value means failure (status -254 → FAULT); `reverse` inverts that, so with `weight 0 reverse` a zero
//!   value — and a **deleted or unreadable file, which reads as 0** — puts the instance in FAULT: fail-safe. With
//!   weight 1 the value is added to the priority; the effective priority is clamped to 1..=254. A value
//!   written by rename-over (`IN_MOVED_TO`) is applied atomically; the files keep their values over a reload.
//! - **Notify FIFO**: lines `INSTANCE "lb_vip" MASTER 105` (state `MASTER|BACKUP|FAULT|STOP|DELETED`, or
//!   `MASTER_RX_LOWER_PRI`, and the effective priority). keepalived opens the FIFO `O_RDWR|O_NONBLOCK` (a full
//!   FIFO drops lines instead of blocking VRRP), and unlinks it on reload or exit **only if it created it** —
//!   so the agent creates it and keeps one reader open for its whole life. States are *not* re-sent on reload
//!   (`fifo_write_vrrp_states_on_reload` did not do so in 2.2.7), so an adopted keepalived's state is read from
//!   its SIGUSR1 data dump.
//! - **Stats**: SIGUSR2 to the parent makes the VRRP child write `$TMPDIR/keepalived.stats` (default `/tmp`);
//!   setting `TMPDIR` to the run dir makes it per instance. SIGUSR1 writes `$TMPDIR/keepalived.data`.
//! - **Process model**: with `-n` the spawned process is keepalived's parent; it forks the VRRP child, respawns it
//!   if it dies, and the child gets SIGTERM when the parent dies (`PR_SET_PDEATHSIG`: a clean release, priority 0
//!   advert). `ip netns exec` execs, so a command prefix keeps the pid. SIGHUP reloads (a master first sends an
//!   advert; instances keep their state). SIGHUP/USR1/USR2 before keepalived installed its handlers would kill
//!   it, so the supervisor signals only a keepalived that has reported a state.
//! - keepalived ignores SIGPIPE: with the agent gone its console writes fail and it keeps running; a new agent
//!   opening `log.fifo` gets its lines again.
//! - At least one VIP of the instance's address family is required ("No VIP specified").
//!
//! # Switching from yawol (yawol mode)
//!
//! yawol-controller replaces a LoadBalancer's machines by rolling a new LoadBalancerSet next to the old one,
//! waiting until the new set has a master, and deleting the old set about two minutes later. When the old set is
//! yawol's (keepalived with VRRPv2, `auth PASS yawol`, `advert_int 4`) and the new one is ours, the two must be
//! **one VRRP group** for the overlap: with VRRPv3 or another password or interval, keepalived drops the other
//! side's adverts (version, authentication and interval are all checked), both sides hold the VIP, its MAC flips
//! between them and connections reset.
//!
//! The scheme, chosen by the yawol-mode translation ([`crate::source::kubernetes::yawollet`]) from yawol's own
//! keepalived.conf, not from constants:
//!
//! - **Same protocol**: [`VrrpOptions::version`] (the conf's `vrrp_version`/`version`, else keepalived's default
//!   2), [`VrrpOptions::advert_interval`] (`advert_int`, whole seconds for VRRPv2) and [`VrrpOptions::auth_pass`]
//!   (`authentication { auth_type PASS auth_pass … }`), with yawol's interface, router id and base priority. Both
//!   sides then run the same keepalived election on one group: at every moment one master (VRRP's own guarantee
//!   within a group; the only overlap is the instant of a preemption, while the old master processes the new
//!   master's first advert).
//! - **Same priorities**: the bonuses are yawol's weights: `track_process` (Envoy alive, 100) for a healthy
//!   machine of an older revision and that plus `track_script` (yawollet's readyz, which passes only for the
//!   newest revision, 10) for the newest — 50 + 110 = **160** for our new machines against the old machines'
//!   **150** (their readyz fails once the LoadBalancer's revision moved on). So a healthy new machine preempts
//!   the old master; preemption in VRRP happens when the backup's master-down timer runs out (3 × advert + skew,
//!   ≈ 12–13 s at yawol's 4 s), during which the old master keeps forwarding: one clean move. Before our agent is
//!   ready (data plane attached, configuration applied) it is in FAULT through the `healthy` track file — no
//!   adverts, never master — where yawol's machine would sit at 50–60; it cannot take the VIP while unable to
//!   forward. Equal priorities (e.g. both sets at 160 for a moment) still give one master: VRRP breaks the tie by
//!   address and a backup never preempts an equal priority.
//! - **Timers stay yawol's** after the old set is gone: a VRRP group has one advert interval, and switching
//!   every machine to VRRPv3 / 200 ms is a change of protocol the other members of the group do not hear —
//!   without a proof that no yawol machine is left (the agent cannot see the old set's VMs), a switch could
//!   create exactly the second master this scheme avoids. The price: a dead master is replaced after ≈ 3 ×
//!   `advert_int` + skew (≈ 12–15 s with yawol's 4 s) instead of ≈ 0.7 s. Load balancers that never run next to
//!   yawol machines (fresh installs) can opt in with `LB_YAWOL_FAST_VRRP=true` (VRRPv3, 200 ms, no password).
//!
//! What a user loses at the switch (measured by the netns test `yawol_switch`): connections held by the old
//! machines' Envoy end **when the VIP moves** (Envoy terminated them; the new machines have no such connection,
//! so the client's next segment meets a backend that does not know it) — not only when the old set is deleted.
//! New connections go to exactly one owner at every moment; in the test none of about 1 400 new connections
//! (one every 25 ms) failed around the move, and connections opened to the new set survived the old set's
//! deletion.
//!
//! # Surviving the agent
//!
//! keepalived runs in its own process group, with no parent-death signal, and its only links to the agent are
//! the two FIFOs: when the agent is killed hard keepalived keeps running (the data plane keeps forwarding). A
//! restarted agent finds it through `keepalived.pid` ([`Keepalived::start`] adopts it and reloads it with a
//! fresh configuration instead of starting a second one), so an agent restart does not move the VIP. Dropping a
//! [`Keepalived`] detaches from it likewise; only [`Keepalived::stop`] stops it. Under systemd this needs
//! `KillMode=process` (or keepalived in its own scope), or stopping the agent's unit kills keepalived too.

pub mod parse;
mod render;
mod supervisor;

pub use parse::{parse_data_state, parse_notify_line, NotifyLine, VrrpStats};
pub use render::{render_config, ConfigError};
pub use supervisor::{check_config, Keepalived};

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Default VRRP advertisement interval: VRRPv3 counts in centiseconds; 200 ms gives a master-down time of
/// about 0.7 s (3 intervals plus skew).
pub const DEFAULT_ADVERT_INTERVAL: Duration = Duration::from_millis(200);
/// Debian's keepalived.
pub const DEFAULT_KEEPALIVED_BIN: &str = "/usr/sbin/keepalived";
/// Default base priority; health and revision adjust it through the track files.
pub const DEFAULT_BASE_PRIORITY: u8 = 100;
/// Largest priority bonus keepalived accepts from a weight-1 track file (it clamps to 253).
pub const MAX_PRIORITY_BONUS: u8 = 253;
/// Default priority bonus of the newest revision's machines: with preemption they take the VIP from older ones.
pub const DEFAULT_NEWEST_BONUS: u8 = 100;
/// Name of the one `vrrp_instance` (appears in the notify FIFO, logs and dumps).
pub const INSTANCE_NAME: &str = "lb_vip";

/// How the agent runs VRRP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VrrpOptions {
    /// Interface that sends the adverts and carries the VIPs.
    pub interface: String,
    /// VRRP virtual router id, 1..=255, distinct per LoadBalancer on a network.
    pub router_id: u8,
    /// Base priority, 1..=254 (255 would make this node the address owner, whose priority cannot be changed).
    pub base_priority: u8,
    /// Advertisement interval: VRRPv3 a multiple of 10 ms in 10 ms..=40.95 s (centiseconds), VRRPv2 whole
    /// seconds 1..=255.
    pub advert_interval: Duration,
    /// VRRP protocol version, 2 or 3 (default 3). Version 2 exists to share one VRRP group with yawol's
    /// keepalived during a switch (see "Switching from yawol" above).
    pub version: u8,
    /// VRRPv2 simple-password authentication (`auth_type PASS`), at most 8 bytes: yawol's instances carry one,
    /// and keepalived drops adverts whose password differs. `None`: no authentication.
    pub auth_pass: Option<String>,
    /// Priority bonus of a machine of the LoadBalancer's newest revision (Kubernetes mode).
    pub newest_bonus: u8,
    /// Priority bonus of a healthy machine of an older revision (Kubernetes mode).
    pub older_bonus: u8,
    /// Unicast peers; empty = multicast (224.0.0.18 / ff02::12).
    pub unicast_peers: Vec<IpAddr>,
    /// Source address of unicast adverts (default: the interface's primary address).
    pub unicast_src: Option<IpAddr>,
    /// The keepalived binary.
    pub keepalived_bin: PathBuf,
    /// Words run before the binary, e.g. `["ip", "netns", "exec", "lb1"]`. The prefix must exec keepalived (not
    /// fork it), so the spawned pid is keepalived's.
    pub command_prefix: Vec<String>,
    /// Directory of this agent's keepalived files ([`RunPaths`]); distinct per agent.
    pub run_dir: PathBuf,
}

impl VrrpOptions {
    /// Options with the defaults: base priority [`DEFAULT_BASE_PRIORITY`], [`DEFAULT_ADVERT_INTERVAL`],
    /// multicast, [`DEFAULT_KEEPALIVED_BIN`], no command prefix.
    pub fn new(interface: impl Into<String>, router_id: u8, run_dir: impl Into<PathBuf>) -> Self {
        VrrpOptions {
            interface: interface.into(),
            router_id,
            base_priority: DEFAULT_BASE_PRIORITY,
            advert_interval: DEFAULT_ADVERT_INTERVAL,
            version: 3,
            auth_pass: None,
            newest_bonus: DEFAULT_NEWEST_BONUS,
            older_bonus: 0,
            unicast_peers: Vec::new(),
            unicast_src: None,
            keepalived_bin: PathBuf::from(DEFAULT_KEEPALIVED_BIN),
            command_prefix: Vec::new(),
            run_dir: run_dir.into(),
        }
    }

    /// The files under [`Self::run_dir`].
    pub fn paths(&self) -> RunPaths {
        RunPaths::new(&self.run_dir)
    }
}

/// The files of one agent's keepalived (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunPaths {
    /// The run directory itself.
    pub dir: PathBuf,
    /// Rendered configuration.
    pub config: PathBuf,
    /// keepalived's parent process (`-p`).
    pub pid: PathBuf,
    /// keepalived's VRRP child (`-r`).
    pub vrrp_pid: PathBuf,
    /// `vrrp_notify_fifo`.
    pub notify_fifo: PathBuf,
    /// keepalived's stdout and stderr.
    pub log_fifo: PathBuf,
    /// Health track file (`1` healthy, `0` FAULT).
    pub healthy: PathBuf,
    /// Priority-bonus track file.
    pub priority_bonus: PathBuf,
    /// Written by keepalived on SIGUSR2.
    pub stats: PathBuf,
    /// Written by keepalived's VRRP child on SIGUSR1.
    pub data: PathBuf,
}

impl RunPaths {
    /// The layout under `dir`.
    pub fn new(dir: &Path) -> Self {
        RunPaths {
            dir: dir.to_path_buf(),
            config: dir.join("keepalived.conf"),
            pid: dir.join("keepalived.pid"),
            vrrp_pid: dir.join("vrrp.pid"),
            notify_fifo: dir.join("notify.fifo"),
            log_fifo: dir.join("log.fifo"),
            healthy: dir.join("healthy"),
            priority_bonus: dir.join("priority-bonus"),
            stats: dir.join("keepalived.stats"),
            data: dir.join("keepalived.data"),
        }
    }
}

/// VRRP state of this machine as keepalived reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VrrpState {
    /// keepalived was (re)started and has not reported a state yet.
    Init,
    /// Ready to take over; another machine holds the VIP.
    Backup,
    /// Holds the VIP.
    Master,
    /// Not eligible: unhealthy (track file), or the interface is down.
    Fault,
    /// keepalived is not running.
    Stopped,
}

impl VrrpState {
    /// keepalived's word for a state (notify FIFO, data dump): `MASTER`, `BACKUP`, `FAULT`, `STOP`, `INIT`.
    pub fn from_keepalived(word: &str) -> Option<Self> {
        match word {
            "MASTER" => Some(VrrpState::Master),
            "BACKUP" => Some(VrrpState::Backup),
            "FAULT" => Some(VrrpState::Fault),
            "STOP" | "DELETED" => Some(VrrpState::Stopped),
            "INIT" => Some(VrrpState::Init),
            _ => None,
        }
    }

    /// Lower-case name, for logs and conditions.
    pub fn as_str(self) -> &'static str {
        match self {
            VrrpState::Init => "init",
            VrrpState::Backup => "backup",
            VrrpState::Master => "master",
            VrrpState::Fault => "fault",
            VrrpState::Stopped => "stopped",
        }
    }

    /// keepalived reported a state, so it is up and handles signals.
    pub fn is_reported(self) -> bool {
        matches!(
            self,
            VrrpState::Backup | VrrpState::Master | VrrpState::Fault
        )
    }
}

impl std::fmt::Display for VrrpState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
