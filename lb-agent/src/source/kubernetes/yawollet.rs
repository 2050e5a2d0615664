//! yawol compatibility: the agent started as `yawollet` (a symlink to `lb-agent` in the VM image, run by
//! `yawollet.service` with yawol-controller's `YAWOLLET_ARGS`) takes yawollet's flags and yawol's keepalived
//! settings, and runs as lb-agent in Kubernetes mode. This is the one place that knows yawollet's command line
//! and yawol's `keepalived.conf`; [`translate`] is pure and unit-tested, `main` applies it before parsing.
//!
//! yawollet's flags (yawol `cmd/yawollet/main.go`, pflag: `--flag=value` or `--flag value`):
//!
//! | yawollet flag | here |
//! |---|---|
//! | `--namespace`, `--loadbalancer-name`, `--loadbalancer-machine-name`, `--kubeconfig` | the same lb-agent flags |
//! | `--requeue-time` (seconds) | `--requeue-period`, clamped to 5..170 s as yawollet does |
//! | `--health-probe-bind-address` (`/readyz` for yawol's keepalived check script) | `--metrics-address`: `/readyz`, `/healthz` and `/metrics` are served there; Go's forms (`:PORT` = every interface, `[v6]:PORT`, `localhost:PORT`); `0` or empty (probes off in yawollet) keeps the default |
//! | `--zap-encoder json\|console` | `--log-format json\|text` |
//! | `--zap-log-level` | `--log-level` (zap's `debug`/`info`/`error`; a number N means debug) |
//! | `--listen-address` (the VIP) | checked against keepalived's VIP; the data plane takes the VIP from the LoadBalancer's `status.portIP`, which yawol-controller writes into both |
//! | `--listen-interface` | the interface when `keepalived.conf` names none |
//! | `--keepalived-stats-file` | empty: no keepalived stats in the status ([`Compat::keepalived_stats`]), as in yawollet; a path is not read: the agent reads keepalived's counters itself (SIGUSR2 into its own run directory) |
//! | `--metrics-bind-address` | checked, not served: yawollet's controller-runtime metrics (off by default); lb-agent's `/metrics` is on the probe address |
//! | `--zap-devel`, `--zap-stacktrace-level`, `--zap-time-encoding` | ignored (log cosmetics) |
//! | anything else | an error naming the flag, as yawollet's flag set exits on it |
//!
//! From yawol's `/etc/keepalived/keepalived.conf` (its one `vrrp_instance`) the agent **keeps** what makes its
//! machines one VRRP group with yawol's, so a switch from yawol's image to this one never has two masters
//! ([`crate::ha::vrrp`], "Switching from yawol"): `interface` (the NIC the data plane attaches to),
//! `virtual_router_id`, `priority` (the base priority), the VRRP version (`vrrp_version`/`version`, keepalived's
//! default 2), `advert_int` and the `auth PASS` password; the priority bonuses are yawol's `track_process` and
//! `track_script` weights (newest revision 50 + 110 = 160, older 150), and it checks the VIP. It **replaces**
//! yawol's health inputs: eligibility comes from a track file the agent writes (data plane attached, latest
//! configuration in the maps; FAULT otherwise, never master) instead of `vrrp_track_process envoy` and the readyz
//! `vrrp_script`; GARP on takeover and every 60 s instead of every 300 s. yawol's script user settings are not
//! carried over (no scripts run). The price of yawol's timers is yawol's failover time (≈ 3 × `advert_int` + skew,
//! ≈ 12–15 s); [`FAST_VRRP_ENV`] opts into VRRPv3 every 200 ms without a password (≈ 0.7 s) for load balancers
//! that never run next to yawol's machines. `yawollet --help` prints [`usage`] and exits 0, as yawollet does.

use anyhow::{bail, Context, Result};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

/// Name the agent recognises in `argv[0]`: started under it, the arguments are yawollet's.
pub const PROGRAM_NAME: &str = "yawollet";
/// yawollet's `--health-probe-bind-address` default.
const DEFAULT_PROBE_ADDRESS: &str = "127.0.0.1:8080";
/// Environment variable that opts a yawol-mode machine into the agent's fast VRRP (VRRPv3, 200 ms, no password):
/// `true` or `1`. Off by default, because such a machine and yawol's keepalived do not hear each other.
pub const FAST_VRRP_ENV: &str = "LB_YAWOL_FAST_VRRP";

/// Where yawol-controller's user data writes the keepalived configuration.
pub const KEEPALIVED_CONF: &str = "/etc/keepalived/keepalived.conf";

/// Whether the process was started as `yawollet` (the file name in `argv[0]`).
pub fn invoked_as_yawollet(argv0: &std::ffi::OsStr) -> bool {
    Path::new(argv0).file_name() == Some(std::ffi::OsStr::new(PROGRAM_NAME))
}

/// Whether yawollet's command line asks for help (`-h`, `--help`, Go's `-help`/`--h`, before `--`): yawollet's
/// flag set then prints its usage and exits 0, and so does the agent ([`usage`]).
pub fn wants_help(args: &[String]) -> bool {
    args.iter()
        .take_while(|a| *a != "--")
        .any(|a| matches!(a.as_str(), "-h" | "--help" | "-help" | "--h"))
}

/// The usage text for `yawollet --help`: yawollet's flags as this agent takes them.
pub fn usage() -> String {
    format!(
        "Usage of {PROGRAM_NAME} (lb-agent in yawol mode):\n\
         \x20     --namespace string                  namespace of the LoadBalancer (required)\n\
         \x20     --loadbalancer-name string          LoadBalancer name (required)\n\
         \x20     --loadbalancer-machine-name string  LoadBalancerMachine name (required)\n\
         \x20     --kubeconfig string                 kubeconfig of the yawol cluster\n\
         \x20     --listen-address string             the VIP (checked against {KEEPALIVED_CONF})\n\
         \x20     --listen-interface string           interface when {KEEPALIVED_CONF} names none\n\
         \x20     --requeue-time int                  reconcile period in seconds (5..170)\n\
         \x20     --health-probe-bind-address string  /readyz, /healthz, /metrics (default \"{DEFAULT_PROBE_ADDRESS}\")\n\
         \x20     --keepalived-stats-file string      empty: no keepalived stats in the machine's status\n\
         \x20     --metrics-bind-address string       checked, not served\n\
         \x20     --zap-encoder string                json or console\n\
         \x20     --zap-log-level string              debug, info, error or a number\n\
         \x20     --zap-devel, --zap-stacktrace-level, --zap-time-encoding  ignored\n\
         VRRP follows {KEEPALIVED_CONF} (interface, router id, priority, version, advert_int, password, track\n\
         weights), so these machines form one VRRP group with yawol's; {FAST_VRRP_ENV}=true switches to\n\
         VRRPv3 every 200 ms for load balancers that never run next to yawol's machines.\n"
    )
}

/// lb-agent's arguments for a yawollet command line, and what was made of each yawollet flag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Translation {
    /// lb-agent's arguments (without the program name).
    pub args: Vec<String>,
    /// One line per decision, logged at start.
    pub notes: Vec<Note>,
    /// What yawollet does differently from lb-agent in Kubernetes mode.
    pub compat: Compat,
}

/// Kubernetes mode as yawollet: set when the agent runs as `yawollet` ([`super::KubeSettings::yawollet`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Compat {
    /// keepalived's statistics go into the machine's status (`KeepalivedStatsFile` and `KeepalivedMaster`
    /// conditions, keepalived metrics); off with yawollet's `--keepalived-stats-file=""`.
    pub keepalived_stats: bool,
}

/// A decision of the translation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    /// A warning (a setting that could not be honoured or does not add up) rather than information.
    pub warning: bool,
    /// What happened.
    pub text: String,
}

/// What yawol's keepalived.conf says about its VRRP instance (the first one).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeepalivedSettings {
    /// `vrrp_instance` name (yawol: `ENVOY`).
    pub instance: String,
    /// `interface`.
    pub interface: Option<String>,
    /// `virtual_router_id`.
    pub router_id: Option<u8>,
    /// `priority`.
    pub priority: Option<u8>,
    /// `advert_int` as written (seconds; keepalived's default 1).
    pub advert_int: Option<String>,
    /// VRRP version: the instance's `version`, else `global_defs`' `vrrp_version` (keepalived's default 2).
    pub version: Option<u8>,
    /// `authentication { auth_type … }` (`PASS` or `AH`).
    pub auth_type: Option<String>,
    /// `authentication { auth_pass … }`.
    pub auth_pass: Option<String>,
    /// The instance's `track_process` entries with their weights (the entry's own, else the
    /// `vrrp_track_process` block's, else 0).
    pub track_process: Vec<(String, i32)>,
    /// The instance's `track_script` entries with their weights (likewise from the `vrrp_script` blocks).
    pub track_script: Vec<(String, i32)>,
    /// The addresses of `virtual_ipaddress`.
    pub vips: Vec<IpAddr>,
    /// Further `vrrp_instance` names (ignored).
    pub other_instances: Vec<String>,
}

/// yawollet's value flags (all others but `--zap-devel` take a value too; see [`translate`]).
const BOOL_FLAGS: &[&str] = &["zap-devel"];

/// Translates yawollet's arguments (without the program name) and the text of yawol's keepalived.conf (`None`:
/// not there) into lb-agent's arguments. Errors: a required yawollet flag is missing, a value does not parse, or
/// keepalived.conf has an invalid router id or priority.
pub fn translate(yawollet_args: &[String], keepalived_conf: Option<&str>) -> Result<Translation> {
    translate_with(yawollet_args, keepalived_conf, false)
}

/// [`translate`], with `fast_vrrp` ([`FAST_VRRP_ENV`]): the agent's own VRRP (VRRPv3, 200 ms, no password)
/// instead of yawol's, for load balancers whose machines never run next to yawol's.
pub fn translate_with(
    yawollet_args: &[String],
    keepalived_conf: Option<&str>,
    fast_vrrp: bool,
) -> Result<Translation> {
    let mut notes = Vec::new();
    let mut note = |warning: bool, text: String| notes.push(Note { warning, text });
    let flags = parse_flags(yawollet_args, &mut note)?;
    let get = |name: &str| {
        flags
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    let mut args = Vec::new();
    for name in [
        "namespace",
        "loadbalancer-name",
        "loadbalancer-machine-name",
    ] {
        match get(name) {
            Some(v) if !v.is_empty() => args.push(format!("--{name}={v}")),
            _ => bail!("yawollet needs --{name} (from YAWOLLET_ARGS in /etc/yawol/env.conf)"),
        }
    }
    if let Some(kc) = get("kubeconfig").filter(|v| !v.is_empty()) {
        args.push(format!("--kubeconfig={kc}"));
    }
    if let Some(t) = get("requeue-time") {
        let secs: i64 = t
            .trim()
            .parse()
            .with_context(|| format!("--requeue-time={t:?} is not a number of seconds"))?;
        // yawollet clamps to 5..170 s; so does the agent, with a warning of its own.
        args.push(format!("--requeue-period={}s", secs.clamp(5, 170)));
    }
    // yawollet's default probe address is also where yawol's keepalived check script looks.
    let probe = match get("health-probe-bind-address").unwrap_or(DEFAULT_PROBE_ADDRESS) {
        // controller-runtime serves no probes then; the agent's metrics have to be somewhere all the same.
        off @ ("" | "0") => {
            note(
                true,
                format!(
                    "--health-probe-bind-address={off:?} turns yawollet's probes off; the agent serves /readyz, \
                     /healthz and /metrics on {DEFAULT_PROBE_ADDRESS} all the same"
                ),
            );
            DEFAULT_PROBE_ADDRESS.parse().expect("a socket address")
        }
        addr => go_listen_address("health-probe-bind-address", addr)?,
    };
    args.push(format!("--metrics-address={probe}"));
    note(
        false,
        format!(
            "--health-probe-bind-address: /readyz, /healthz and /metrics are served on {probe}"
        ),
    );
    match get("metrics-bind-address") {
        // yawollet's default: its controller-runtime metrics off.
        None | Some("" | "0") => {}
        Some(addr) => {
            go_listen_address("metrics-bind-address", addr)?;
            note(
                false,
                format!(
                    "--metrics-bind-address={addr}: nothing served there; the agent's /metrics is on {probe}"
                ),
            );
        }
    }
    // yawollet reads keepalived's stats file for the KeepalivedStatsFile and KeepalivedMaster conditions and the
    // keepalived metrics; empty turns all three off. The agent reads keepalived's counters itself, so a path
    // only matters in that it is not empty.
    let keepalived_stats = get("keepalived-stats-file") != Some("");
    if !keepalived_stats {
        note(
            false,
            "--keepalived-stats-file=\"\": no KeepalivedStatsFile / KeepalivedMaster conditions and no \
             keepalived metrics in the machine's status, as with yawollet"
                .to_string(),
        );
    }
    if let Some(enc) = get("zap-encoder") {
        match enc {
            "json" => args.push("--log-format=json".into()),
            "console" => args.push("--log-format=text".into()),
            other => note(true, format!("--zap-encoder={other}: unknown; text logs")),
        }
    }
    if let Some(level) = get("zap-log-level") {
        match zap_level(level) {
            Some(l) => args.push(format!("--log-level={l}")),
            None => note(
                true,
                format!("--zap-log-level={level}: unknown; level info"),
            ),
        }
    }
    for ignored in ["zap-devel", "zap-stacktrace-level", "zap-time-encoding"] {
        if let Some(v) = get(ignored) {
            note(
                false,
                format!("--{ignored}={v}: ignored (see lb-agent's yawollet module)"),
            );
        }
    }

    let keepalived = match keepalived_conf {
        Some(text) => Some(parse_keepalived_conf(text)?),
        None => {
            note(
                true,
                format!("{KEEPALIVED_CONF} not found: no VRRP, so no machine takes the VIP"),
            );
            None
        }
    };
    let interface = keepalived
        .as_ref()
        .and_then(|k| k.interface.clone())
        .or_else(|| get("listen-interface").map(str::to_string))
        .unwrap_or_else(|| "eth0".to_string());
    args.push(format!("--interface={interface}"));
    if let Some(k) = &keepalived {
        let router_id = k.router_id.with_context(|| {
            format!(
                "{KEEPALIVED_CONF}: vrrp_instance {} has no virtual_router_id",
                k.instance
            )
        })?;
        args.push(format!("--vrrp-router-id={router_id}"));
        if let Some(p) = k.priority {
            args.push(format!("--vrrp-priority={p}"));
        }
        if fast_vrrp {
            note(
                true,
                format!(
                    "{FAST_VRRP_ENV}: VRRPv3 every 200 ms without authentication instead of yawol's VRRP \
                     (version {}, advert_int {}): this machine does not hear yawol's keepalived, so next to \
                     yawol's machines both sides hold the VIP; only for load balancers that never run next to \
                     them",
                    k.version.unwrap_or(2),
                    k.advert_int.as_deref().unwrap_or("1"),
                ),
            );
        } else {
            args.extend(yawol_vrrp_args(k)?);
            note(
                false,
                format!(
                    "{KEEPALIVED_CONF}: one VRRP group with yawol's machines: interface {interface}, \
                     virtual_router_id {router_id}, priority {}, {}",
                    k.priority.map_or("default".to_string(), |p| p.to_string()),
                    args.iter()
                        .filter(|a| a.starts_with("--vrrp-") && !a.starts_with("--vrrp-auth-pass"))
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(" "),
                ),
            );
        }
        for other in &k.other_instances {
            note(
                true,
                format!(
                    "{KEEPALIVED_CONF}: vrrp_instance {other} ignored (only the first one is used)"
                ),
            );
        }
        let listen: Option<IpAddr> = get("listen-address").and_then(|a| a.parse().ok());
        if let Some(listen) = listen {
            if !k.vips.contains(&listen) {
                note(
                    true,
                    format!(
                        "--listen-address={listen} is not keepalived's VIP ({}); the data plane serves the \
                         LoadBalancer's status.portIP",
                        k.vips.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(", ")
                    ),
                );
            }
        }
    }
    Ok(Translation {
        args,
        notes,
        compat: Compat { keepalived_stats },
    })
}

/// The agent's VRRP flags that make it one VRRP group with yawol's keepalived, from yawol's own instance: its
/// protocol version, advert interval and password (keepalived drops adverts that differ in any of them), and
/// priority bonuses equal to yawol's weights — `track_process` (Envoy alive) for a healthy machine of an older
/// revision, plus `track_script` (yawollet's readyz, which fails for an older revision) for the newest one. With
/// yawol's `priority 50`, weights 100 and 10 that is 160 for the newest revision and 150 for older ones, as in
/// yawol; an unhealthy agent is in FAULT instead (never master) where yawol drops to 50–60.
fn yawol_vrrp_args(k: &KeepalivedSettings) -> Result<Vec<String>> {
    // keepalived's defaults: VRRPv2, one advert a second.
    let version = k.version.unwrap_or(2);
    let advert = k.advert_int.as_deref().unwrap_or("1");
    let secs: f64 = advert
        .parse()
        .ok()
        .filter(|s: &f64| s.is_finite() && *s > 0.0)
        .with_context(|| {
            format!("{KEEPALIVED_CONF}: advert_int {advert:?} is not a number of seconds")
        })?;
    let ms = (secs * 1000.0).round() as u64;
    if version == 2 && (!ms.is_multiple_of(1000) || !(1..=255).contains(&(ms / 1000))) {
        bail!(
            "{KEEPALIVED_CONF}: advert_int {advert} is not whole seconds 1..=255, as VRRPv2 needs"
        );
    }
    let mut args = vec![
        format!("--vrrp-version={version}"),
        format!("--vrrp-advert-interval={ms}ms"),
    ];
    match (k.auth_type.as_deref(), &k.auth_pass) {
        (None, _) => {}
        (Some(t), Some(pass)) if t.eq_ignore_ascii_case("PASS") => {
            if version != 2 {
                bail!("{KEEPALIVED_CONF}: authentication needs VRRPv2 (keepalived ignores it with version 3)");
            }
            // keepalived uses the first 8 bytes.
            let pass: String = pass.chars().take(8).collect();
            args.push(format!("--vrrp-auth-pass={pass}"));
        }
        (Some(t), _) => bail!(
            "{KEEPALIVED_CONF}: authentication {t} without a password or not PASS (AH is not supported): \
             the agent could not join yawol's VRRP group"
        ),
    }
    let sum = |list: &[(String, i32)]| -> i32 { list.iter().map(|(_, w)| (*w).max(0)).sum() };
    let older = sum(&k.track_process);
    let newest = older + sum(&k.track_script);
    if newest > 0 {
        let base = i32::from(k.priority.unwrap_or(100));
        let clamp = |b: i32| b.min(254 - base).clamp(0, 253);
        args.push(format!("--vrrp-newest-bonus={}", clamp(newest)));
        args.push(format!("--vrrp-older-bonus={}", clamp(older)));
    }
    Ok(args)
}

/// A Go listen address (`net.Listen`'s `host:port`) as a socket address, meaning what Go means: `:PORT` is every
/// interface (Go listens on `[::]`, which takes IPv4 too, and on 0.0.0.0 without IPv6), `localhost` is 127.0.0.1
/// (Go resolves it and prefers IPv4). Other host names would need resolving at start; yawol-controller writes
/// addresses.
pub fn go_listen_address(flag: &str, addr: &str) -> Result<SocketAddr> {
    let bad = |why: &str| {
        anyhow::anyhow!(
            "--{flag}={addr:?}: {why} (give :PORT, IPv4:PORT, [IPv6]:PORT or localhost:PORT)"
        )
    };
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| bad("no port"))?;
    let port: u16 = port.parse().map_err(|_| bad("the port is not a number"))?;
    let ip = match host {
        "" => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
        h if h.starts_with('[') && h.ends_with(']') => h[1..h.len() - 1]
            .parse::<Ipv6Addr>()
            .map(IpAddr::V6)
            .map_err(|_| bad("not an IPv6 address in brackets"))?,
        h => h
            .parse::<Ipv4Addr>()
            .map(IpAddr::V4)
            .map_err(|_| bad("not an IP address (an IPv6 address needs brackets)"))?,
    };
    Ok(SocketAddr::new(ip, port))
}

/// `(name, value)` of each `--name=value` / `--name value` / `--bool-flag`; an unknown flag is an error, positional
/// arguments are noted and dropped (yawollet ignores them).
fn parse_flags(
    args: &[String],
    note: &mut impl FnMut(bool, String),
) -> Result<Vec<(String, String)>> {
    const KNOWN: &[&str] = &[
        "namespace",
        "loadbalancer-name",
        "loadbalancer-machine-name",
        "listen-address",
        "listen-interface",
        "requeue-time",
        "keepalived-stats-file",
        "health-probe-bind-address",
        "metrics-bind-address",
        "kubeconfig",
        "zap-devel",
        "zap-encoder",
        "zap-log-level",
        "zap-stacktrace-level",
        "zap-time-encoding",
    ];
    let mut out = Vec::new();
    let mut it = args.iter().peekable();
    while let Some(arg) = it.next() {
        if arg == "--" {
            if it.peek().is_some() {
                note(true, "arguments after -- ignored".to_string());
            }
            break;
        }
        let Some(flag) = arg.strip_prefix("--") else {
            // pflag reads `-x` as shorthand flags, and yawollet defines none.
            if arg.len() > 1 && arg.starts_with('-') {
                bail!("unknown yawollet flag {arg} (yawollet has no single-dash flags)");
            }
            note(
                true,
                format!("argument {arg:?} ignored (yawollet takes flags only)"),
            );
            continue;
        };
        let name = flag.split_once('=').map_or(flag, |(n, _)| n);
        // yawollet's flag set exits on an unknown flag; going on would hide a setting the operator meant.
        if !KNOWN.contains(&name) {
            bail!(
                "unknown yawollet flag --{name} (yawollet refuses it too; yawollet's flags: --{})",
                KNOWN.join(", --")
            );
        }
        let value = match flag.split_once('=') {
            Some((_, v)) => v.to_string(),
            None if BOOL_FLAGS.contains(&name) => "true".to_string(),
            None => match it.peek() {
                Some(v) if !v.starts_with("--") => it.next().unwrap().clone(),
                // A value flag without a value: pflag refuses it.
                _ => bail!("yawollet flag --{name} needs a value"),
            },
        };
        out.push((name.to_string(), value));
    }
    Ok(out)
}

/// zap's level words and numbers as a tracing filter.
fn zap_level(level: &str) -> Option<&'static str> {
    match level {
        "debug" => Some("debug"),
        "info" => Some("info"),
        "warn" => Some("warn"),
        "error" | "dpanic" | "panic" | "fatal" => Some("error"),
        // zap's custom levels: any positive number is more verbose than debug.
        n => n
            .parse::<i8>()
            .ok()
            .map(|n| if n > 0 { "debug" } else { "info" }),
    }
}

/// Reads the first `vrrp_instance` of a keepalived.conf: `interface`, `virtual_router_id`, `priority`,
/// `advert_int` and the addresses of `virtual_ipaddress`. Comments (`#`, `!`) and quoted strings are handled as
/// keepalived does; other blocks and keywords are skipped.
pub fn parse_keepalived_conf(text: &str) -> Result<KeepalivedSettings> {
    let mut found: Option<KeepalivedSettings> = None;
    let mut others = Vec::new();
    let mut global_version: Option<u8> = None;
    // Top-level `vrrp_track_process` / `vrrp_script` block being read, and the weights they declare.
    let mut track_block: Option<(String, String)> = None;
    let mut block_weights: std::collections::HashMap<(String, String), i32> = Default::default();
    let parse_version = |lineno: usize, v: &str| -> Result<u8> {
        match v {
            "2" => Ok(2),
            "3" => Ok(3),
            _ => bail!("keepalived.conf line {lineno}: VRRP version {v} is not 2 or 3"),
        }
    };
    let parse_weight = |lineno: usize, v: Option<&String>| -> Result<i32> {
        let v = v.map(String::as_str).unwrap_or_default();
        v.parse::<i32>()
            .with_context(|| format!("keepalived.conf line {lineno}: weight {v:?} is not a number"))
    };
    // Open blocks, each with the keyword that opened it; `vrrp_instance` records whether it is the first one.
    let mut stack: Vec<(String, bool)> = Vec::new();
    for (lineno, statement) in statements(text) {
        match statement.as_slice() {
            [] => {}
            [close] if close == "}" => {
                if stack.pop().is_none() {
                    bail!("keepalived.conf line {lineno}: '}}' without an open block");
                }
                if stack.is_empty() {
                    track_block = None;
                }
            }
            [words @ .., open] if open == "{" => {
                let keyword = words.first().cloned().unwrap_or_default();
                let mut first = false;
                if stack.is_empty() && (keyword == "vrrp_track_process" || keyword == "vrrp_script")
                {
                    track_block =
                        Some((keyword.clone(), words.get(1).cloned().unwrap_or_default()));
                }
                if keyword == "vrrp_instance" && stack.is_empty() {
                    let name = words.get(1).cloned().unwrap_or_default();
                    if found.is_none() {
                        found = Some(KeepalivedSettings {
                            instance: name,
                            ..Default::default()
                        });
                        first = true;
                    } else {
                        others.push(name);
                    }
                }
                let inherited = stack.last().is_some_and(|(_, f)| *f);
                stack.push((keyword, first || inherited));
            }
            words => {
                match (stack.len(), stack.last(), words[0].as_str()) {
                    (1, Some((b, _)), "vrrp_version") if b == "global_defs" => {
                        global_version = Some(parse_version(
                            lineno,
                            words.get(1).map_or("", String::as_str),
                        )?);
                    }
                    (1, _, "weight") => {
                        if let Some(key) = &track_block {
                            block_weights.insert(key.clone(), parse_weight(lineno, words.get(1))?);
                        }
                    }
                    _ => {}
                }
                let Some((block, true)) = stack.last() else {
                    continue;
                };
                let s = found.as_mut().expect("an instance is open");
                let value = || {
                    words.get(1).cloned().with_context(|| {
                        format!(
                            "keepalived.conf line {lineno}: {} without a value",
                            words[0]
                        )
                    })
                };
                match (block.as_str(), words[0].as_str()) {
                    ("vrrp_instance", "interface") => s.interface = Some(value()?),
                    ("vrrp_instance", "virtual_router_id") => {
                        let v = value()?;
                        match v.parse::<u8>() {
                            Ok(id) if id > 0 => s.router_id = Some(id),
                            _ => bail!("keepalived.conf line {lineno}: virtual_router_id {v} is not 1..=255"),
                        }
                    }
                    ("vrrp_instance", "priority") => {
                        let v = value()?;
                        match v.parse::<u8>() {
                            // 255 is the address owner, whose priority cannot move; the agent needs it to.
                            Ok(p) if p > 0 => s.priority = Some(p.min(254)),
                            _ => {
                                bail!("keepalived.conf line {lineno}: priority {v} is not 1..=255")
                            }
                        }
                    }
                    ("vrrp_instance", "advert_int") => s.advert_int = Some(value()?),
                    ("vrrp_instance", "version") => {
                        s.version = Some(parse_version(lineno, &value()?)?)
                    }
                    ("authentication", "auth_type") => s.auth_type = Some(value()?),
                    ("authentication", "auth_pass") => s.auth_pass = Some(value()?),
                    ("track_process" | "track_script", name) => {
                        // `NAME [weight N [reverse]]`; without a weight the block's applies (filled in below).
                        let weight = match words.get(1).map(String::as_str) {
                            Some("weight") => Some(parse_weight(lineno, words.get(2))?),
                            _ => None,
                        };
                        let list = if block == "track_process" {
                            &mut s.track_process
                        } else {
                            &mut s.track_script
                        };
                        list.push((name.to_string(), weight.unwrap_or(i32::MIN)));
                    }
                    ("virtual_ipaddress", addr) => {
                        let ip = addr.split('/').next().unwrap_or(addr);
                        let ip: IpAddr = ip.parse().with_context(|| {
                            format!("keepalived.conf line {lineno}: virtual_ipaddress {addr:?} is not an address")
                        })?;
                        s.vips.push(ip);
                    }
                    _ => {}
                }
            }
        }
    }
    if !stack.is_empty() {
        bail!("keepalived.conf: {} block(s) not closed", stack.len());
    }
    let mut s = found.context("keepalived.conf has no vrrp_instance")?;
    s.other_instances = others;
    s.version = s.version.or(global_version);
    for (kind, list) in [
        ("vrrp_track_process", &mut s.track_process),
        ("vrrp_script", &mut s.track_script),
    ] {
        for (name, weight) in list.iter_mut() {
            if *weight == i32::MIN {
                *weight = block_weights
                    .get(&(kind.to_string(), name.clone()))
                    .copied()
                    .unwrap_or(0);
            }
        }
    }
    Ok(s)
}

/// Statements with their line numbers: a line's words up to and including `{`, a lone `}`, or the words of a
/// line; comments (`#`/`!` outside quotes) removed, quotes stripped.
fn statements(text: &str) -> Vec<(usize, Vec<String>)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let mut words: Vec<String> = Vec::new();
        let mut word = String::new();
        let mut quoted = false;
        let flush = |word: &mut String, words: &mut Vec<String>| {
            if !word.is_empty() {
                words.push(std::mem::take(word));
            }
        };
        for c in line.chars() {
            match c {
                '"' => quoted = !quoted,
                '#' | '!' if !quoted => break,
                // A brace ends a statement: what follows on the line is another one. `{` ends the statement that
                // names the block, `}` is a statement of its own.
                '{' if !quoted => {
                    flush(&mut word, &mut words);
                    words.push("{".to_string());
                    out.push((i + 1, std::mem::take(&mut words)));
                }
                '}' if !quoted => {
                    flush(&mut word, &mut words);
                    if !words.is_empty() {
                        out.push((i + 1, std::mem::take(&mut words)));
                    }
                    out.push((i + 1, vec!["}".to_string()]));
                }
                c if c.is_whitespace() && !quoted => flush(&mut word, &mut words),
                c => word.push(c),
            }
        }
        flush(&mut word, &mut words);
        if !words.is_empty() {
            out.push((i + 1, words));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_test_support::yawol as yawol_fixture;

    /// yawol-controller's output for a machine (the boot test's fixture), VIP 10.0.2.100.
    fn machine(requeue_time: u32) -> yawol_fixture::Machine {
        yawol_fixture::Machine {
            kubeconfig: String::new(),
            namespace: "yawol".into(),
            loadbalancer: "default--web".into(),
            machine: "default--web-1a2b3-x9y8z".into(),
            vip: "10.0.2.100".into(),
            requeue_time,
            ntp_pools: vec![],
            ntp_servers: vec![],
            log_forward: Default::default(),
            debug: false,
        }
    }

    fn yawol_keepalived() -> String {
        yawol_fixture::keepalived_conf("10.0.2.100")
    }

    /// `YAWOLLET_ARGS` as yawol writes them, split by systemd's `$YAWOLLET_ARGS` (note `--kubeconfig` with a
    /// blank, and no `--requeue-time` for 0).
    fn yawol_args(requeue: Option<u32>) -> Vec<String> {
        yawol_fixture::yawollet_args(&machine(requeue.unwrap_or(0)))
            .split_whitespace()
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn yawols_user_data_becomes_kubernetes_mode_with_vrrp() {
        let t = translate(&yawol_args(Some(20)), Some(&yawol_keepalived())).unwrap();
        assert_eq!(
            t.compat,
            Compat {
                keepalived_stats: true
            }
        );
        assert_eq!(
            t.args,
            [
                "--namespace=yawol",
                "--loadbalancer-name=default--web",
                "--loadbalancer-machine-name=default--web-1a2b3-x9y8z",
                "--kubeconfig=/etc/yawol/kubeconfig",
                "--requeue-period=20s",
                "--metrics-address=127.0.0.1:8080",
                "--interface=eth0",
                "--vrrp-router-id=100",
                "--vrrp-priority=50",
                "--vrrp-version=2",
                "--vrrp-advert-interval=4000ms",
                "--vrrp-auth-pass=yawol",
                "--vrrp-newest-bonus=110",
                "--vrrp-older-bonus=100",
            ]
        );
        assert!(t.notes.iter().all(|n| !n.warning), "{:?}", t.notes);
        assert!(t
            .notes
            .iter()
            .any(|n| n.text.contains("one VRRP group with yawol's machines")
                && !n.text.contains("auth-pass")));
    }

    /// The yawol VRRP profile comes from the conf, not from constants: other values there, other flags.
    #[test]
    fn yawol_vrrp_profile_follows_the_conf() {
        let k = parse_keepalived_conf(&yawol_keepalived()).unwrap();
        assert_eq!(k.version, None, "yawol relies on keepalived's default (2)");
        assert_eq!(k.advert_int.as_deref(), Some("4"));
        assert_eq!(
            (k.auth_type.as_deref(), k.auth_pass.as_deref()),
            (Some("PASS"), Some("yawol"))
        );
        assert_eq!(k.track_process, [("envoy".to_string(), 100)]);
        assert_eq!(k.track_script, [("yawollethealth".to_string(), 10)]);

        let conf = yawol_keepalived()
            .replace("global_defs {", "global_defs {\n\tvrrp_version 3")
            .replace("advert_int 4", "advert_int 0.5")
            .replace(
                "\tauthentication {\n\t\tauth_type PASS\n\t\tauth_pass yawol\n\t}",
                "",
            )
            .replace("\t\tenvoy\n", "\t\tenvoy weight 40\n")
            .replace("weight 10\n", "weight 5\n");
        let t = translate(&yawol_args(None), Some(&conf)).unwrap();
        let vrrp: Vec<&str> = t
            .args
            .iter()
            .filter(|a| a.starts_with("--vrrp"))
            .map(String::as_str)
            .collect();
        assert_eq!(
            vrrp,
            [
                "--vrrp-router-id=100",
                "--vrrp-priority=50",
                "--vrrp-version=3",
                "--vrrp-advert-interval=500ms",
                "--vrrp-newest-bonus=45",
                "--vrrp-older-bonus=40",
            ]
        );

        // VRRPv2 cannot say half a second; AH is not supported: refusing beats a second master.
        let half = yawol_keepalived().replace("advert_int 4", "advert_int 0.5");
        let e = format!(
            "{:#}",
            translate(&yawol_args(None), Some(&half)).unwrap_err()
        );
        assert!(e.contains("whole seconds"), "{e}");
        let ah = yawol_keepalived().replace("auth_type PASS", "auth_type AH");
        let e = format!("{:#}", translate(&yawol_args(None), Some(&ah)).unwrap_err());
        assert!(e.contains("AH is not supported"), "{e}");
    }

    #[test]
    fn fast_vrrp_opt_in_keeps_the_agents_own_vrrp_with_a_warning() {
        let t = translate_with(&yawol_args(None), Some(&yawol_keepalived()), true).unwrap();
        let vrrp: Vec<&str> = t
            .args
            .iter()
            .filter(|a| a.starts_with("--vrrp"))
            .map(String::as_str)
            .collect();
        assert_eq!(vrrp, ["--vrrp-router-id=100", "--vrrp-priority=50"]);
        assert!(t
            .notes
            .iter()
            .any(|n| n.warning && n.text.contains(FAST_VRRP_ENV)));
    }

    #[test]
    fn help_is_recognised_like_yawollets_flag_set() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        for h in ["-h", "--help", "-help", "--h"] {
            assert!(wants_help(&args(&["--namespace=x", h])), "{h}");
        }
        assert!(!wants_help(&args(&["--namespace=x"])));
        assert!(!wants_help(&args(&["--", "--help"])));
        let u = usage();
        for flag in [
            "--namespace",
            "--loadbalancer-name",
            "--loadbalancer-machine-name",
            "--listen-address",
            "--requeue-time",
            FAST_VRRP_ENV,
        ] {
            assert!(u.contains(flag), "{flag} missing from the usage");
        }
    }

    #[test]
    fn keepalived_settings_of_the_first_instance() {
        let k = parse_keepalived_conf(&yawol_keepalived()).unwrap();
        assert_eq!(
            k,
            KeepalivedSettings {
                instance: "ENVOY".into(),
                interface: Some("eth0".into()),
                router_id: Some(100),
                priority: Some(50),
                advert_int: Some("4".into()),
                version: None,
                auth_type: Some("PASS".into()),
                auth_pass: Some("yawol".into()),
                track_process: vec![("envoy".into(), 100)],
                track_script: vec![("yawollethealth".into(), 10)],
                vips: vec!["10.0.2.100".parse().unwrap()],
                other_instances: vec![],
            }
        );
        // One-line blocks, prefixes and options after the address, a second instance, a comment after a value.
        let k = parse_keepalived_conf(
            "vrrp_instance A { interface ens3 ! the NIC\n virtual_router_id 7\n priority 255\n\
             virtual_ipaddress { 192.0.2.1/32 dev ens3 label ens3:1\n2001:db8::1/128 }\n}\n\
             vrrp_instance B {\n virtual_router_id 8\n}\n",
        )
        .unwrap();
        assert_eq!(k.interface.as_deref(), Some("ens3"));
        assert_eq!((k.router_id, k.priority), (Some(7), Some(254)), "255 → 254");
        assert_eq!(
            k.vips,
            vec![
                "192.0.2.1".parse::<IpAddr>().unwrap(),
                "2001:db8::1".parse().unwrap()
            ]
        );
        assert_eq!(k.other_instances, ["B"]);
    }

    #[test]
    fn bad_keepalived_conf_is_an_error_naming_the_line() {
        for (text, needle) in [
            (
                "vrrp_instance A {\n virtual_router_id 0\n}",
                "line 2: virtual_router_id 0",
            ),
            ("vrrp_instance A {\n priority x\n}", "priority x"),
            (
                "vrrp_instance A {\n virtual_ipaddress {\n vip\n }\n}",
                "line 3: virtual_ipaddress \"vip\"",
            ),
            ("vrrp_instance A {\n", "not closed"),
            ("global_defs {\n}\n}", "without an open block"),
            ("global_defs {\n}", "no vrrp_instance"),
        ] {
            let e = format!("{:#}", parse_keepalived_conf(text).unwrap_err());
            assert!(e.contains(needle), "{needle:?} not in {e:?}");
        }
        let e = translate(
            &yawol_args(None),
            Some("vrrp_instance A {\n interface eth0\n}"),
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("no virtual_router_id"), "{e:#}");
    }

    #[test]
    fn flags_honoured_ignored_and_missing() {
        let mut args = yawol_args(Some(1));
        args.extend(
            [
                "--zap-encoder",
                "json",
                "--zap-log-level=2",
                "--zap-devel",
                "--keepalived-stats-file=",
                "stray",
            ]
            .map(String::from),
        );
        let t = translate(&args, Some(&yawol_keepalived())).unwrap();
        assert!(
            t.args.contains(&"--requeue-period=5s".to_string()),
            "clamped like yawollet"
        );
        assert!(t.args.contains(&"--log-format=json".to_string()));
        assert!(t.args.contains(&"--log-level=debug".to_string()));
        let warnings: Vec<&str> = t
            .notes
            .iter()
            .filter(|n| n.warning)
            .map(|n| n.text.as_str())
            .collect();
        assert_eq!(
            warnings,
            ["argument \"stray\" ignored (yawollet takes flags only)"]
        );
        assert!(!t.compat.keepalived_stats, "empty stats file: no stats");
        assert!(t
            .notes
            .iter()
            .any(|n| n.text.starts_with("--zap-devel=true: ignored")));

        let without_lbm: Vec<String> = yawol_args(None)
            .into_iter()
            .filter(|a| !a.starts_with("--loadbalancer-machine-name"))
            .collect();
        let e = translate(&without_lbm, Some(&yawol_keepalived())).unwrap_err();
        assert!(e.to_string().contains("--loadbalancer-machine-name"), "{e}");
        let e = translate(&["--namespace".to_string()], None).unwrap_err();
        assert!(e.to_string().contains("--namespace needs a value"), "{e}");
        let e = translate(
            &[yawol_args(None), vec!["--requeue-time=soon".into()]].concat(),
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("--requeue-time"), "{e}");
    }

    #[test]
    fn without_keepalived_conf_no_vrrp_and_a_warning() {
        let mut args = yawol_args(None);
        args.push("--listen-interface=ens7".into());
        let t = translate(&args, None).unwrap();
        assert!(t.args.contains(&"--interface=ens7".to_string()));
        assert!(t.args.iter().all(|a| !a.starts_with("--vrrp")));
        assert!(t
            .notes
            .iter()
            .any(|n| n.warning && n.text.contains("no VRRP")));
        // Defaults: probe address 127.0.0.1:8080, eth0.
        let t = translate(&yawol_args(None)[..3], None).unwrap();
        assert!(t
            .args
            .contains(&"--metrics-address=127.0.0.1:8080".to_string()));
        assert!(t.args.contains(&"--interface=eth0".to_string()));
    }

    #[test]
    fn a_listen_address_other_than_keepalived_vip_is_a_warning() {
        let args: Vec<String> = yawol_args(None)
            .into_iter()
            .map(|a| a.replace("--listen-address=10.0.2.100", "--listen-address=10.0.2.101"))
            .collect();
        let t = translate(&args, Some(&yawol_keepalived())).unwrap();
        assert!(t.notes.iter().any(|n| n.warning
            && n.text
                .contains("10.0.2.101 is not keepalived's VIP (10.0.2.100)")));
    }

    /// yawollet's flag set exits on an unknown flag (pflag, `ExitOnError`): so does the agent, naming it.
    #[test]
    fn an_unknown_flag_is_an_error_naming_it() {
        for (extra, needle) in [
            (
                &["--future-flag", "x"][..],
                "unknown yawollet flag --future-flag",
            ),
            (&["--future-flag=x"], "unknown yawollet flag --future-flag"),
            (&["--future-flag"], "unknown yawollet flag --future-flag"),
            (&["-n", "x"], "unknown yawollet flag -n"),
            // lb-agent's own flags are not yawollet's.
            (&["--interface=eth1"], "unknown yawollet flag --interface"),
        ] {
            let args = [
                yawol_args(None),
                extra.iter().map(|a| a.to_string()).collect(),
            ]
            .concat();
            let e = translate(&args, Some(&yawol_keepalived())).unwrap_err();
            assert!(e.to_string().contains(needle), "{extra:?}: {e}");
        }
        // Positional arguments are no flags: yawollet ignores them, the agent warns.
        let t = translate(
            &[yawol_args(None), vec!["-".into(), "x".into()]].concat(),
            Some(&yawol_keepalived()),
        )
        .unwrap();
        assert_eq!(t.notes.iter().filter(|n| n.warning).count(), 2);
    }

    /// Go's listen addresses (`net.Listen`), as yawol and operators write them.
    #[test]
    fn go_listen_addresses_mean_what_go_means() {
        for (given, want) in [
            (":8080", "[::]:8080"),
            ("127.0.0.1:8080", "127.0.0.1:8080"),
            ("0.0.0.0:9000", "0.0.0.0:9000"),
            ("[::1]:8080", "[::1]:8080"),
            ("[::]:8080", "[::]:8080"),
            ("localhost:8081", "127.0.0.1:8081"),
        ] {
            let got = go_listen_address("health-probe-bind-address", given).unwrap();
            assert_eq!(got, want.parse::<SocketAddr>().unwrap(), "{given}");
            let args = [
                yawol_args(None),
                vec![format!("--health-probe-bind-address={given}")],
            ]
            .concat();
            let t = translate(&args, None).unwrap();
            assert!(
                t.args.contains(&format!("--metrics-address={want}")),
                "{given}: {:?}",
                t.args
            );
        }
        for (given, needle) in [
            ("8080", "no port"),
            (":http", "the port is not a number"),
            ("::1:8080", "needs brackets"),
            ("[10.0.0.1]:8080", "not an IPv6 address"),
            ("probe.example:8080", "not an IP address"),
        ] {
            let e = go_listen_address("health-probe-bind-address", given).unwrap_err();
            assert!(e.to_string().contains(needle), "{given}: {e}");
            assert!(e.to_string().contains("--health-probe-bind-address"), "{e}");
        }
        // Probes off in yawollet ("0" or empty): the agent's endpoints stay on the default, with a warning.
        for off in ["0", ""] {
            let args = [
                yawol_args(None),
                vec![format!("--health-probe-bind-address={off}")],
            ]
            .concat();
            let t = translate(&args, None).unwrap();
            assert!(t
                .args
                .contains(&"--metrics-address=127.0.0.1:8080".to_string()));
            assert!(t
                .notes
                .iter()
                .any(|n| n.warning && n.text.contains("turns yawollet's probes off")));
        }
        // --metrics-bind-address: checked the same way; "0" (yawollet's default) is off.
        let with = |v: &str| {
            translate(
                &[
                    yawol_args(None),
                    vec![format!("--metrics-bind-address={v}")],
                ]
                .concat(),
                None,
            )
        };
        assert!(with("0").is_ok());
        assert!(with(":8081").unwrap().notes.iter().any(|n| n
            .text
            .contains("--metrics-bind-address=:8081: nothing served there")));
        let e = with("8081").unwrap_err();
        assert!(e.to_string().contains("--metrics-bind-address"), "{e}");
    }

    #[test]
    fn keepalived_stats_file_empty_turns_stats_off() {
        let with = |extra: &[&str]| {
            let args = [
                yawol_args(None),
                extra.iter().map(|a| a.to_string()).collect(),
            ]
            .concat();
            translate(&args, Some(&yawol_keepalived())).unwrap().compat
        };
        assert!(with(&[]).keepalived_stats, "yawollet's default path");
        assert!(with(&["--keepalived-stats-file=/tmp/k.stats"]).keepalived_stats);
        assert!(!with(&["--keepalived-stats-file="]).keepalived_stats);
        assert!(!with(&["--keepalived-stats-file", ""]).keepalived_stats);
        // The last occurrence counts, as in pflag.
        assert!(with(&["--keepalived-stats-file=", "--keepalived-stats-file=/x"]).keepalived_stats);
    }

    #[test]
    fn argv0_decides() {
        assert!(invoked_as_yawollet(std::ffi::OsStr::new(
            "/usr/local/bin/yawollet"
        )));
        assert!(invoked_as_yawollet(std::ffi::OsStr::new("yawollet")));
        assert!(!invoked_as_yawollet(std::ffi::OsStr::new(
            "/usr/local/bin/lb-agent"
        )));
    }
}
