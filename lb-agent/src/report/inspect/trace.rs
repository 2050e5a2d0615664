//! `lbctl trace`: live per-packet decisions. A second instance of the data-plane object is loaded onto the maps
//! the agent pinned, and its traced program (lb-ebpf's `trace`: the same logic, reporting each selected packet)
//! replaces the fast one on the agent's pinned link — atomically, like an agent upgrade — while the trace runs.
//! The fast program goes back when the trace ends, however it ends: a guard process, forked before the swap,
//! waits for the end of a pipe that only the trace holds open, and swaps back when the kernel closes it (exit,
//! Ctrl-C, SIGKILL). The fast path carries no tracing code at all.

use crate::dataplane::{
    self, Dataplane, TC_PROGRAM, TC_TRACE_PROGRAM, XDP_PROGRAM, XDP_TRACE_PROGRAM,
};
use anyhow::{anyhow, bail, Context, Result};
use aya::maps::{Array, RingBuf};
use lb_common::{map_names, stat, TraceEvent, TraceFilter};
use serde::Serialize;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A packet's headers as the trace shows them.
#[derive(Debug, Serialize)]
pub struct Headers {
    pub protocol: String,
    pub src: String,
    pub dst: String,
    /// TCP flags (`S`, `SA`, `A`, `FA`, `R`, …), empty for others.
    pub flags: String,
}

/// One traced packet.
#[derive(Debug, Serialize)]
pub struct Decision {
    /// Nanoseconds since the trace started.
    pub t_ns: u64,
    pub len: u16,
    pub before: Headers,
    pub verdict: &'static str,
    /// The packet as it left (rewritten), when it was sent back out.
    pub after: Option<Headers>,
    /// Every counter the packet moved: the reason of a pass or a drop, a new flow, a handshake, …
    pub reasons: Vec<&'static str>,
}

/// Runs a trace of `filter` on the data plane pinned under `pin` (an agent's `<pin-dir>/<interface>`), printing
/// each decision, until `duration` or `count` is reached (or forever).
pub fn run(
    pin: &Path,
    filter: TraceFilter,
    duration: Option<Duration>,
    count: Option<u64>,
    json: bool,
) -> Result<()> {
    let sizes = dataplane::pinned_sizes(pin)?;
    let mut dp = Dataplane::load(&sizes, Some(pin))?;
    // Every interface the agent is attached to: a flow's replies may come in by another one.
    let (links, tc) = dp.pinned_links()?;
    let (fast, traced) = if tc {
        (TC_PROGRAM, TC_TRACE_PROGRAM)
    } else {
        (XDP_PROGRAM, XDP_TRACE_PROGRAM)
    };
    // Both verified before the link is touched.
    for name in [fast, traced] {
        if tc {
            dp.tc_program_named(name)?;
        } else {
            dp.xdp_program(name)?;
        }
    }
    // The traced IPv6 programs go into their own slots of the (pinned, shared) tail-call arrays; the agent's
    // fast ones stay in theirs.
    dp.load_ipv6_programs(!tc, true)?;
    let ebpf = dp.ebpf_mut()?;
    let mut f: Array<_, TraceFilter> = Array::try_from(
        ebpf.map_mut(map_names::TRACE_FILTER)
            .context("TRACE_FILTER missing from the object")?,
    )?;
    f.set(0, filter, 0)?;
    let mut events = RingBuf::try_from(
        ebpf.take_map(map_names::TRACE_EVENTS)
            .ok_or_else(|| anyhow!("TRACE_EVENTS missing from the object"))?,
    )?;
    guard(&mut dp, &links, fast, tc)?;
    for link in &links {
        dp.swap_pinned_link(traced, link, tc)?;
    }
    let on: Vec<String> = links.iter().map(|l| l.display().to_string()).collect();
    eprintln!(
        "tracing on {} ({traced} until this ends, then {fast} again)",
        on.join(", ")
    );
    let start = Instant::now();
    let mut first_ns = None;
    let mut seen = 0u64;
    loop {
        while let Some(item) = events.next() {
            if item.len() < std::mem::size_of::<TraceEvent>() {
                continue;
            }
            // SAFETY: the traced program writes whole `TraceEvent`s; read_unaligned copes with any alignment.
            let e: TraceEvent = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
            let t0 = *first_ns.get_or_insert(e.ts_ns);
            let d = decision(&e, t0);
            if json {
                println!("{}", serde_json::to_string(&d)?);
            } else {
                println!("{}", describe(&d));
            }
            seen += 1;
            if count.is_some_and(|c| seen >= c) {
                return Ok(());
            }
        }
        if duration.is_some_and(|d| start.elapsed() >= d) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Forks the guard that puts `fast` back on `links` once this process is gone (the read end of a pipe whose write
/// end only this process holds returns end-of-file then).
fn guard(dp: &mut Dataplane, links: &[PathBuf], fast: &str, tc: bool) -> Result<()> {
    let mut fds = [0i32; 2];
    // SAFETY: plain syscalls on owned descriptors; the child only reads, swaps and exits.
    unsafe {
        if libc::pipe(fds.as_mut_ptr()) != 0 {
            bail!("pipe: {}", std::io::Error::last_os_error());
        }
        match libc::fork() {
            -1 => bail!("fork: {}", std::io::Error::last_os_error()),
            0 => {
                libc::close(fds[1]);
                // Its own session: a terminal's Ctrl-C (or a kill of the trace's process group) ends the trace,
                // not the guard.
                libc::setsid();
                let mut b = [0u8; 1];
                while libc::read(fds[0], b.as_mut_ptr().cast(), 1) > 0 {}
                let mut code = 0;
                for link in links {
                    if let Err(e) = dp.swap_pinned_link(fast, link, tc) {
                        eprintln!(
                            "lbctl trace guard: putting {fast} back on {} failed: {e:#}",
                            link.display()
                        );
                        code = 1;
                    }
                }
                libc::_exit(code)
            }
            _ => {
                libc::close(fds[0]);
                Ok(())
            }
        }
    }
}

fn decision(e: &TraceEvent, t0: u64) -> Decision {
    let n = (e.hdr_len as usize).min(e.before.len());
    let reasons = (0..stat::COUNT as usize)
        .filter(|i| e.reasons & (1 << i) != 0)
        .map(|i| stat::NAMES[i])
        .collect();
    let verdict = match e.verdict {
        1 => "pass",
        2 => "drop",
        3 => "tx",
        4 => "redirect",
        _ => "?",
    };
    Decision {
        t_ns: e.ts_ns.saturating_sub(t0),
        len: e.len,
        before: headers(&e.before[..n]),
        verdict,
        after: matches!(e.verdict, 3 | 4).then(|| headers(&e.after[..n])),
        reasons,
    }
}

/// The addresses, ports and TCP flags of a frame's first bytes (as much as is there).
fn headers(h: &[u8]) -> Headers {
    let unknown = |what: String| Headers {
        protocol: what,
        src: String::new(),
        dst: String::new(),
        flags: String::new(),
    };
    if h.len() < 14 {
        return unknown(format!("{} bytes", h.len()));
    }
    let ethertype = u16::from_be_bytes([h[12], h[13]]);
    // Addresses, the L4 protocol and where its header starts (IPv6: extension headers are not walked).
    let (src, dst, proto, l4): (IpAddr, IpAddr, u8, usize) = match ethertype {
        0x0800 if h.len() >= 34 => {
            let src = Ipv4Addr::new(h[26], h[27], h[28], h[29]);
            let dst = Ipv4Addr::new(h[30], h[31], h[32], h[33]);
            let ihl = (h[14] & 0x0f) as usize;
            if h[14] >> 4 != 4 || ihl < 5 {
                return Headers {
                    protocol: format!("IPv4 header {:#04x}", h[14]),
                    src: src.to_string(),
                    dst: dst.to_string(),
                    flags: String::new(),
                };
            }
            (src.into(), dst.into(), h[23], 14 + ihl * 4)
        }
        0x86dd if h.len() >= 54 => {
            let addr = |at: usize| IpAddr::from(<[u8; 16]>::try_from(&h[at..at + 16]).unwrap());
            (addr(22), addr(38), h[20], 54)
        }
        _ => return unknown(format!("ethertype {ethertype:#06x}")),
    };
    let ports = (l4 + 4 <= h.len()).then(|| {
        (
            u16::from_be_bytes([h[l4], h[l4 + 1]]),
            u16::from_be_bytes([h[l4 + 2], h[l4 + 3]]),
        )
    });
    let (protocol, with_ports) = match proto {
        6 => ("TCP".to_string(), true),
        17 => ("UDP".to_string(), true),
        1 => (
            format!("ICMP type {}", h.get(l4).copied().unwrap_or(0)),
            false,
        ),
        58 => (
            format!("ICMPv6 type {}", h.get(l4).copied().unwrap_or(0)),
            false,
        ),
        p => (format!("protocol {p}"), false),
    };
    let mut flags = String::new();
    if proto == 6 && l4 + 14 <= h.len() {
        let f = h[l4 + 13];
        for (bit, c) in [
            (0x02, 'S'),
            (0x10, 'A'),
            (0x01, 'F'),
            (0x04, 'R'),
            (0x08, 'P'),
        ] {
            if f & bit != 0 {
                flags.push(c);
            }
        }
    }
    let at = |ip: IpAddr, port: Option<u16>| match (with_ports, port) {
        (true, Some(p)) => SocketAddr::new(ip, p).to_string(),
        _ => ip.to_string(),
    };
    Headers {
        protocol,
        src: at(src, ports.map(|p| p.0)),
        dst: at(dst, ports.map(|p| p.1)),
        flags,
    }
}

/// One line per decision.
pub fn describe(d: &Decision) -> String {
    let hdr = |h: &Headers| {
        let flags = if h.flags.is_empty() {
            String::new()
        } else {
            format!(" [{}]", h.flags)
        };
        format!("{} {} → {}{flags}", h.protocol, h.src, h.dst)
    };
    let out = match &d.after {
        Some(a) => format!(" as {}", hdr(a)),
        None => String::new(),
    };
    format!(
        "+{:>10.6}s {} ⇒ {}{out}  ({})",
        d.t_ns as f64 / 1e9,
        hdr(&d.before),
        d.verdict.to_uppercase(),
        d.reasons.join(", ")
    )
}
