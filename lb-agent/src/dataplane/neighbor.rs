//! Keeps the data plane's next-hop table (backend address → MAC) resolved from the kernel's routing and
//! neighbour tables.
//!
//! Uses `ip -json route get` / `ip -json neigh show` (iproute2 is on every LB image) rather than a netlink
//! crate: route lookup with the kernel's own policy (`RTM_GETROUTE` for one destination) and neighbour
//! states come out exactly as an operator sees them with the same commands, and the parsing is tiny.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::net::{IpAddr, SocketAddr, SocketAddrV6, UdpSocket};
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
            provoke_resolution(via, &route.dev);
            Ok(None)
        }
    }
}

/// Makes the kernel resolve `ip` (ARP or NDP) by sending it one empty datagram to the discard port. An IPv6
/// gateway is usually link-local (`fe80::/10`), which names no interface by itself: the datagram is scoped to
/// the route's device.
fn provoke_resolution(ip: IpAddr, dev: &str) {
    let (bind, to): (SocketAddr, SocketAddr) = match ip {
        IpAddr::V4(_) => ("0.0.0.0:0".parse().unwrap(), SocketAddr::new(ip, 9)),
        IpAddr::V6(v6) => {
            let scope = if v6.is_unicast_link_local() {
                let name = std::ffi::CString::new(dev).unwrap_or_default();
                // SAFETY: a NUL-terminated name; 0 (unknown) leaves the send to fail harmlessly.
                unsafe { libc::if_nametoindex(name.as_ptr()) }
            } else {
                0
            };
            (
                "[::]:0".parse().unwrap(),
                SocketAddr::V6(SocketAddrV6::new(v6, 9, 0, scope)),
            )
        }
    };
    if let Ok(s) = UdpSocket::bind(bind) {
        let _ = s.send_to(&[], to);
    }
}

/// An interface's index and MAC, from sysfs.
pub fn interface(name: &str) -> Result<(u32, [u8; 6])> {
    let dir = std::path::Path::new("/sys/class/net").join(name);
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f))
            .map(|s| s.trim().to_string())
            .with_context(|| format!("interface {name}: reading {}", dir.join(f).display()))
    };
    let ifindex = read("ifindex")?
        .parse()
        .with_context(|| format!("interface {name}: its index"))?;
    let address = read("address")?;
    let mac = parse_mac(&address).with_context(|| format!("interface {name}: MAC {address}"))?;
    Ok((ifindex, mac))
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

    fn ip(args: &str) {
        let out = Command::new("ip")
            .args(args.split_whitespace())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "ip {args}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn resolve_within(ip: IpAddr, tries: u32) -> Option<Resolved> {
        for _ in 0..tries {
            if let Some(r) = resolve(ip).unwrap() {
                return Some(r);
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        None
    }

    /// IPv6 backends resolve through NDP like IPv4 ones through ARP: on-link ones directly, others through
    /// their (link-local) gateway. A veth pair between this thread's own network namespace and a named one
    /// (root needed; skipped without).
    #[test]
    fn ipv6_next_hops_resolve_through_ndp() {
        let peer_ns = format!("lbv6nd{}", std::process::id());
        let ns = peer_ns.clone();
        let result = std::thread::spawn(move || {
            // SAFETY: moves only this thread (and the processes it starts) into a new network namespace.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                eprintln!("skipped: no network namespace (not root?)");
                return None;
            }
            ip(&format!("netns add {ns}"));
            ip("link set lo up");
            ip(&format!(
                "link add lbv6a type veth peer name lbv6b netns {ns}"
            ));
            ip(&format!("-n {ns} link set lbv6b address 02:00:00:00:06:02"));
            ip(&format!("-n {ns} addr add fd00:6::2/64 dev lbv6b nodad"));
            ip(&format!("-n {ns} addr add fe80::2/64 dev lbv6b nodad"));
            ip(&format!("-n {ns} link set lbv6b up"));
            ip("addr add fd00:6::1/64 dev lbv6a nodad");
            ip("link set lbv6a up");
            ip("route add 2001:db8:6::/64 via fe80::2 dev lbv6a");
            let on_link = resolve_within("fd00:6::2".parse().unwrap(), 60);
            let routed = resolve_within("2001:db8:6::10".parse().unwrap(), 60);
            Some((on_link, routed))
        })
        .join();
        let _ = Command::new("ip").args(["netns", "del", &peer_ns]).output();
        let Some((on_link, routed)) = result.unwrap() else {
            return;
        };
        let mac = [2, 0, 0, 0, 6, 2];
        let on_link = on_link.expect("on-link IPv6 backend resolved");
        assert_eq!(
            (on_link.mac, on_link.dev.as_str(), on_link.via),
            (mac, "lbv6a", "fd00:6::2".parse().unwrap())
        );
        let routed = routed.expect("IPv6 backend behind a link-local gateway resolved");
        assert_eq!((routed.mac, routed.via), (mac, "fe80::2".parse().unwrap()));
    }

    #[test]
    fn loopback_resolves_or_says_why() {
        // 127.0.0.1 routes via lo, which has no neighbours: the answer is "not resolved", not an error.
        assert!(resolve("127.0.0.1".parse().unwrap()).unwrap().is_none());
    }
}
