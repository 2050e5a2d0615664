//! `lbctl`: looks inside a load balancer from the maps its agent pinned — services and backends, connections,
//! counters — whether the agent runs or not. What `ipvsadm -Ln` and `conntrack -L` are to an IPVS router.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use lb_agent::dataplane::{self, Dataplane};
use lb_agent::report::inspect::{self, FlowFilter};
use lb_common::TraceFilter;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Parser)]
#[command(
    version,
    about = "Inspect the XDP load balancer's data plane (reads the pinned maps)"
)]
struct Cli {
    /// The agent's pin directory (its `--pin-dir`).
    #[arg(
        long,
        env = "LB_PIN_DIR",
        default_value = "/sys/fs/bpf/lb",
        global = true
    )]
    pin_dir: PathBuf,
    /// The agent's interface (its `--interface`: it pins under `<pin-dir>/<interface>`); default: the only one
    /// pinned there.
    #[arg(long, env = "LB_INTERFACE", global = true)]
    interface: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Services (VIP:port/protocol) with their backends' shares of new flows, active flows and counters.
    Services,
    /// Connections (both directions as one), filtered; counts by state.
    Flows {
        /// Only this client address.
        #[arg(long)]
        client: Option<IpAddr>,
        /// Only connections to this node.
        #[arg(long)]
        backend: Option<IpAddr>,
        /// Only connections translated to this source address (active-active: a replica's own ones, which a
        /// drained replica serves until they end).
        #[arg(long)]
        snat: Option<IpAddr>,
        /// Only this service (VIP:port).
        #[arg(long)]
        service: Option<SocketAddr>,
        /// Only this state: syn, syn-ack, established, closing, closed, reset.
        #[arg(long)]
        state: Option<String>,
    },
    /// The data plane's global counters (every pass and drop reason) with their rates.
    Counters {
        /// Seconds between the two readings the rates come from.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
    },
    /// Live per-packet decisions: headers before and after, verdict, and the counters each packet moved (the
    /// reason of a drop or pass, a new flow, a handshake). The traced program is swapped onto the agent's links
    /// (every interface it forwards on) while this runs; the fast one goes back when it ends, however it ends
    /// (Ctrl-C, a kill, an error).
    Trace {
        /// Only packets from or to this address (a client, a node; IPv4 or IPv6).
        #[arg(long)]
        addr: Option<IpAddr>,
        /// Only packets to this VIP:port (port 0: any port; `[v6]:port` for an IPv6 VIP).
        #[arg(long)]
        service: Option<SocketAddr>,
        /// Stop after this many seconds.
        #[arg(long)]
        seconds: Option<f64>,
        /// Stop after this many packets.
        #[arg(long)]
        count: Option<u64>,
    },
    /// The program attached on each of the agent's pinned links (the fast one, or the traced one while a trace
    /// runs).
    Program,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let iface = match cli.interface {
        Some(i) => i,
        None => only_interface(&cli.pin_dir)?,
    };
    let pin = cli.pin_dir.join(iface);
    match cli.cmd {
        Cmd::Trace {
            addr,
            service,
            seconds,
            count,
        } => {
            let (addr_family, addr) = trace_addr(addr);
            let (dst_family, dst) = trace_addr(service.map(|s| s.ip()));
            let filter = TraceFilter {
                addr,
                dst,
                dport_be: service.map_or(0, |s| s.port().to_be()),
                addr_family,
                dst_family,
            };
            return inspect::trace::run(
                &pin,
                filter,
                seconds.map(Duration::from_secs_f64),
                count,
                cli.json,
            );
        }
        Cmd::Program => {
            let dp = Dataplane::open_pinned(&pin)?;
            let (links, _) = dp.pinned_links()?;
            let mut each = Vec::new();
            for link in &links {
                each.push((link, dataplane::pinned_link_program(link)?));
            }
            if cli.json {
                // `link` and `program`: the first interface's (what a one-armed machine has).
                let all: Vec<_> = each
                    .iter()
                    .map(|(l, p)| serde_json::json!({ "link": l, "program": p }))
                    .collect();
                return print_json(&serde_json::json!({
                    "link": each[0].0, "program": each[0].1, "links": all
                }));
            }
            for (link, name) in &each {
                println!("{name} on {}", link.display());
            }
            return Ok(());
        }
        _ => {}
    }
    let dp = Dataplane::open_pinned(&pin)?;
    match cli.cmd {
        Cmd::Trace { .. } | Cmd::Program => unreachable!("handled above"),
        Cmd::Services => {
            let services = inspect::services(&dp.maps)?;
            if cli.json {
                return print_json(&services);
            }
            for s in &services {
                println!(
                    "{}/{}  id {}  snat {}  idle {} s{}",
                    SocketAddr::new(s.vip, s.port),
                    s.protocol,
                    s.id,
                    s.snat_address,
                    s.idle_timeout_s,
                    if s.source_ranges {
                        "  source ranges"
                    } else {
                        ""
                    }
                );
                for b in &s.backends {
                    println!(
                        "  -> {:<24} share {:>5.1} %  active flows {}",
                        b.address.to_string(),
                        b.share * 100.0,
                        b.active_flows
                    );
                }
                let moved: Vec<String> = s
                    .counters
                    .iter()
                    .filter(|(_, v)| **v > 0)
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect();
                println!("  counters: {}", moved.join(", "));
            }
        }
        Cmd::Flows {
            client,
            backend,
            snat,
            service,
            state,
        } => {
            let filter = FlowFilter {
                client,
                backend,
                snat,
                service,
                state,
            };
            let flows = inspect::flows(&dp.maps, &filter)?;
            let counts = inspect::count_by_state(&flows);
            if cli.json {
                return print_json(
                    &serde_json::json!({ "connections": flows, "by_state": counts }),
                );
            }
            // IPv6 socket addresses are up to 47 characters: the columns grow to the longest shown.
            let w = flows
                .iter()
                .flat_map(|c| [c.client, c.service, c.snat, c.backend])
                .map(|a| a.to_string().len())
                .max()
                .unwrap_or(0)
                .max(22);
            println!(
                "{:<5} {:<w$} {:<w$} {:<w$} {:<w$} {:<12} {:>8}",
                "proto", "client", "service", "snat", "backend", "state", "idle s"
            );
            for c in &flows {
                println!(
                    "{:<5} {:<w$} {:<w$} {:<w$} {:<w$} {:<12} {:>8.1}{}",
                    c.protocol,
                    c.client.to_string(),
                    c.service.to_string(),
                    c.snat.to_string(),
                    c.backend.to_string(),
                    c.state,
                    c.idle_s,
                    if c.synced { "  (synced)" } else { "" }
                );
            }
            let by_state: Vec<String> = counts.iter().map(|(k, v)| format!("{k} {v}")).collect();
            println!("{} connections: {}", flows.len(), by_state.join(", "));
        }
        Cmd::Counters { interval } => {
            let counters = inspect::counters(&dp.maps, Duration::from_secs_f64(interval))?;
            if cli.json {
                return print_json(&counters);
            }
            for c in counters {
                println!("{:<22} {:>14} {:>12.1}/s", c.name, c.value, c.per_second);
            }
        }
    }
    Ok(())
}

/// The one interface an agent pinned its state for under `pin_dir`.
fn only_interface(pin_dir: &Path) -> Result<String> {
    let names: Vec<String> = std::fs::read_dir(pin_dir)
        .with_context(|| format!("reading {} (the agent's --pin-dir)", pin_dir.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    match names.as_slice() {
        [one] => Ok(one.clone()),
        [] => bail!("no agent pinned its state under {}", pin_dir.display()),
        many => bail!(
            "several interfaces pinned under {}: {many:?}; choose one with --interface",
            pin_dir.display()
        ),
    }
}

fn print_json(v: &impl serde::Serialize) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// A trace filter's address and its family (0: none).
fn trace_addr(a: Option<IpAddr>) -> (u8, lb_common::Addr) {
    match a {
        Some(ip) => (
            if ip.is_ipv4() {
                lb_common::FAMILY_V4
            } else {
                lb_common::FAMILY_V6
            },
            dataplane::programmer::ip_to_addr(ip),
        ),
        None => (0, lb_common::Addr::default()),
    }
}
