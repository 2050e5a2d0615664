//! Keeps the data plane's next-hop table (backend address → MAC) resolved from the kernel's routing and
//! neighbour tables.
//!
//! Uses `ip -json route get` / `ip -json neigh show` (iproute2 is on every LB image) rather than a netlink
//! crate: route lookup with the kernel's own policy (`RTM_GETROUTE` for one destination) and neighbour
//! states come out exactly as an operator sees them with the same commands, and the parsing is tiny.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::process::Command;

/// Where frames for an address go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// Destination MAC.
    pub mac: [u8; 6],
    /// Egress interface name.
    pub dev: String,
    /// The on-link next hop (the address itself, or its gateway).
    pub via: IpAddr,
}

#[derive(Deserialize)]
struct Route {
    dev: String,
    gateway: Option<IpAddr>,
}

#[derive(Deserialize)]
struct Neigh {
    lladdr: Option<String>,
    #[serde(default)]
    state: Vec<String>,
}

/// Looks up the next hop of `ip`. `Ok(None)`: route known, neighbour not (yet) resolved; resolution is
/// triggered so a later call succeeds.
pub fn resolve(ip: IpAddr) -> Result<Option<Resolved>> {
    let out = Command::new("ip")
        .args(["-json", "route", "get", &ip.to_string()])
        .output()
        .context("running `ip route get` (is iproute2 installed?)")?;
    if !out.status.success() {
        bail!(
            "no route to {ip}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let routes: Vec<Route> =
        serde_json::from_slice(&out.stdout).context("parsing `ip route get`")?;
    let Some(route) = routes.into_iter().next() else {
        bail!("no route to {ip}");
    };
    let via = route.gateway.unwrap_or(ip);
    let out = Command::new("ip")
        .args([
            "-json",
            "neigh",
            "show",
            "to",
            &via.to_string(),
            "dev",
            &route.dev,
        ])
        .output()
        .context("running `ip neigh show`")?;
    let neighs: Vec<Neigh> = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let usable = neighs.into_iter().find_map(|n| {
        let bad = n.state.iter().any(|s| s == "FAILED" || s == "INCOMPLETE");
        n.lladdr.filter(|_| !bad).and_then(|m| parse_mac(&m))
    });
    match usable {
        Some(mac) => Ok(Some(Resolved {
            mac,
            dev: route.dev,
            via,
        })),
        None => {
            provoke_resolution(via);
            Ok(None)
        }
    }
}

/// Makes the kernel resolve `ip` by sending it one empty datagram to the discard port.
fn provoke_resolution(ip: IpAddr) {
    let bind: SocketAddr = if ip.is_ipv4() {
        "0.0.0.0:0".parse().unwrap()
    } else {
        "[::]:0".parse().unwrap()
    };
    if let Ok(s) = UdpSocket::bind(bind) {
        let _ = s.send_to(&[], SocketAddr::new(ip, 9));
    }
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut mac {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_parse() {
        assert_eq!(
            parse_mac("02:1b:00:00:0a:ff"),
            Some([2, 0x1b, 0, 0, 0x0a, 0xff])
        );
        assert_eq!(parse_mac("02:1b:00:00:0a"), None);
        assert_eq!(parse_mac("02:1b:00:00:0a:ff:01"), None);
        assert_eq!(parse_mac("zz:1b:00:00:0a:ff"), None);
    }

    #[test]
    fn loopback_resolves_or_says_why() {
        // 127.0.0.1 routes via lo, which has no neighbours: the answer is "not resolved", not an error.
        assert!(resolve("127.0.0.1".parse().unwrap()).unwrap().is_none());
    }
}
