//! The SNAT source ports and the kernel's own ephemeral ports: never the same port.
//!
//! The data plane translates connections to an address of this host (the VIP, or `--snat-address`), and the
//! kernel opens connections of its own from the host's addresses too — the health checks to the very backends the
//! data plane talks to, among others (for IPv6 the kernel may well choose the VIP as their source). A port both use towards one backend is one 4-tuple for two connections: the backend's answer to the
//! health check finds the data plane's entry and goes to a client (the check fails, the client gets a stray
//! segment), or a SNAT'ed SYN lands on the check's socket. So the two sets of ports are kept apart: by default SNAT
//! takes the ports outside `net.ipv4.ip_local_port_range`; a range given explicitly that overlaps it is taken out
//! of the kernel's choice with `net.ipv4.ip_local_reserved_ports` (which the kernel honours for every port it
//! picks itself, IPv4 and IPv6).

use anyhow::{bail, Context, Result};
use std::path::Path;

/// The SNAT range asked for: `auto` or `MIN-MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnatPorts {
    /// The ports outside the kernel's ephemeral range (the larger side of it).
    Auto,
    /// Exactly these ports (inclusive).
    Range(u16, u16),
}

/// Fewest ports `auto` accepts: below that the kernel's range is nearly everything and the operator must choose.
const MIN_AUTO_PORTS: u32 = 1024;
/// Lowest port `auto` uses (the well-known ports stay free for services of the host).
const AUTO_FLOOR: u16 = 1024;

impl std::str::FromStr for SnatPorts {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        if s.trim() == "auto" {
            return Ok(Self::Auto);
        }
        let (a, b) = s
            .split_once('-')
            .context("--snat-ports must be `auto` or look like MIN-MAX")?;
        let (a, b): (u16, u16) = (a.trim().parse()?, b.trim().parse()?);
        if a == 0 || a > b {
            bail!("--snat-ports: need 1 <= MIN <= MAX");
        }
        Ok(Self::Range(a, b))
    }
}

/// The SNAT range to program, and the ports to take out of the kernel's choice for it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Plan {
    range: (u16, u16),
    /// Ports of `range` inside the kernel's ephemeral range, to reserve; `None` when they are apart.
    reserve: Option<(u16, u16)>,
}

/// Decides the SNAT range for `asked`, given the kernel's ephemeral range `ephemeral` (inclusive) and the ports
/// already reserved there (`reserved`, as the sysctl lists them).
fn plan(asked: SnatPorts, ephemeral: (u16, u16), reserved: &[(u16, u16)]) -> Result<Plan> {
    let (lo, hi) = ephemeral;
    let range = match asked {
        SnatPorts::Auto => {
            let below = (lo > AUTO_FLOOR).then(|| (AUTO_FLOOR, lo - 1));
            let above = (hi < u16::MAX).then(|| (hi.saturating_add(1).max(AUTO_FLOOR), u16::MAX));
            let size = |r: Option<(u16, u16)>| r.map_or(0, |(a, b)| (b - a) as u32 + 1);
            let (best, n) = if size(below) >= size(above) {
                (below, size(below))
            } else {
                (above, size(above))
            };
            if n < MIN_AUTO_PORTS {
                bail!(
                    "--snat-ports auto: the kernel's ephemeral ports (net.ipv4.ip_local_port_range {lo} {hi}) leave \
                     only {n} ports for SNAT; narrow that range (e.g. to 60000 65535) or give --snat-ports MIN-MAX"
                );
            }
            best.unwrap_or_default()
        }
        SnatPorts::Range(a, b) => (a, b),
    };
    let overlap = (range.0.max(lo), range.1.min(hi));
    if overlap.0 > overlap.1 {
        return Ok(Plan {
            range,
            reserve: None,
        });
    }
    // What the kernel keeps once the overlap is reserved as well.
    let left = (lo..=hi)
        .filter(|p| !(overlap.0..=overlap.1).contains(p))
        .filter(|p| !reserved.iter().any(|(a, b)| (a..=b).contains(&p)))
        .count();
    if left == 0 {
        bail!(
            "--snat-ports {}-{} covers every ephemeral port the kernel has left (net.ipv4.ip_local_port_range \
             {lo} {hi}): the host could open no connection of its own, health checks included; give SNAT fewer \
             ports or the kernel a range of its own",
            range.0,
            range.1
        );
    }
    Ok(Plan {
        range,
        reserve: Some(overlap),
    })
}

/// `net.ipv4.ip_local_port_range` of this network namespace.
fn ephemeral_range(sysctl: &Path) -> Result<(u16, u16)> {
    let path = sysctl.join("ip_local_port_range");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut it = text.split_whitespace().map(str::parse::<u16>);
    match (it.next(), it.next()) {
        (Some(Ok(a)), Some(Ok(b))) if a <= b => Ok((a, b)),
        _ => bail!("{}: unexpected {text:?}", path.display()),
    }
}

/// Parses `net.ipv4.ip_local_reserved_ports` (`a-b,c,...`, or empty).
fn parse_reserved(text: &str) -> Result<Vec<(u16, u16)>> {
    text.trim()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| {
            Ok(match s.split_once('-') {
                Some((a, b)) => (a.trim().parse()?, b.trim().parse()?),
                None => {
                    let p = s.trim().parse()?;
                    (p, p)
                }
            })
        })
        .collect()
}

/// Resolves `asked` against the kernel settings under `sysctl` (`/proc/sys/net/ipv4` of the agent's namespace) and
/// reserves what must be reserved there. Returns the SNAT range.
pub fn apply(asked: SnatPorts, sysctl: &Path) -> Result<(u16, u16)> {
    let ephemeral = ephemeral_range(sysctl)?;
    let reserved_path = sysctl.join("ip_local_reserved_ports");
    let reserved_text = std::fs::read_to_string(&reserved_path)
        .with_context(|| format!("reading {}", reserved_path.display()))?;
    let reserved = parse_reserved(&reserved_text)?;
    let p = plan(asked, ephemeral, &reserved)?;
    match p.reserve {
        None => tracing::info!(
            "SNAT ports {}-{}; the kernel's own ephemeral ports {}-{} are apart",
            p.range.0,
            p.range.1,
            ephemeral.0,
            ephemeral.1
        ),
        Some((a, b)) => {
            if !reserved.iter().any(|&(x, y)| x <= a && b <= y) {
                let t = reserved_text.trim();
                let new = if t.is_empty() {
                    format!("{a}-{b}")
                } else {
                    format!("{t},{a}-{b}")
                };
                std::fs::write(&reserved_path, &new).with_context(|| {
                    format!(
                        "reserving the SNAT ports {a}-{b} in {}",
                        reserved_path.display()
                    )
                })?;
            }
            tracing::info!(
                "SNAT ports {}-{}; {a}-{b} of them are in the kernel's ephemeral range {}-{} and now reserved there \
                 (net.ipv4.ip_local_reserved_ports)",
                p.range.0,
                p.range.1,
                ephemeral.0,
                ephemeral.1
            );
        }
    }
    Ok(p.range)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_the_larger_side_of_the_kernels_range() {
        // Linux's default 32768-60999: below is larger.
        let p = plan(SnatPorts::Auto, (32768, 60999), &[]).unwrap();
        assert_eq!(
            p,
            Plan {
                range: (1024, 32767),
                reserve: None
            }
        );
        // The image's 60000-65535.
        let p = plan(SnatPorts::Auto, (60000, 65535), &[]).unwrap();
        assert_eq!(p.range, (1024, 59999));
        // A kernel range low down: above.
        let p = plan(SnatPorts::Auto, (1024, 9999), &[]).unwrap();
        assert_eq!(p.range, (10000, 65535));
    }

    #[test]
    fn auto_refuses_when_the_kernel_has_nearly_everything() {
        let e = plan(SnatPorts::Auto, (1024, 65000), &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("ip_local_port_range 1024 65000"), "{e}");
        assert!(plan(SnatPorts::Auto, (1500, 65535), &[]).is_err());
    }

    #[test]
    fn an_explicit_range_inside_the_kernels_is_reserved_there() {
        let p = plan(SnatPorts::Range(40000, 50000), (32768, 60999), &[]).unwrap();
        assert_eq!(p.reserve, Some((40000, 50000)));
        let p = plan(SnatPorts::Range(1024, 40000), (32768, 60999), &[]).unwrap();
        assert_eq!(p.reserve, Some((32768, 40000)));
        let p = plan(SnatPorts::Range(1024, 20000), (32768, 60999), &[]).unwrap();
        assert_eq!(p.reserve, None);
    }

    #[test]
    fn an_explicit_range_that_leaves_the_kernel_nothing_is_refused() {
        let e = plan(SnatPorts::Range(1024, 65535), (32768, 60999), &[]).unwrap_err();
        assert!(e.to_string().contains("health checks"), "{e}");
        // What is reserved already counts as gone.
        assert!(plan(
            SnatPorts::Range(1024, 50000),
            (32768, 60999),
            &[(50001, 60999)]
        )
        .is_err());
        assert!(plan(
            SnatPorts::Range(1024, 50000),
            (32768, 60999),
            &[(50001, 60998)]
        )
        .is_ok());
    }

    #[test]
    fn parses_its_flag_and_the_kernels_list() {
        assert_eq!("auto".parse::<SnatPorts>().unwrap(), SnatPorts::Auto);
        assert_eq!(
            "2000-3000".parse::<SnatPorts>().unwrap(),
            SnatPorts::Range(2000, 3000)
        );
        assert!("3000-2000".parse::<SnatPorts>().is_err());
        assert!("0-10".parse::<SnatPorts>().is_err());
        assert_eq!(parse_reserved("\n").unwrap(), vec![]);
        assert_eq!(
            parse_reserved("8080,9000-9100\n").unwrap(),
            vec![(8080, 8080), (9000, 9100)]
        );
    }

    #[test]
    fn apply_writes_the_reservation_once() {
        let d = std::env::temp_dir().join(format!("lb-snat-ports-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("ip_local_port_range"), "32768\t60999\n").unwrap();
        std::fs::write(d.join("ip_local_reserved_ports"), "8080\n").unwrap();
        assert_eq!(
            apply(SnatPorts::Range(40000, 40100), &d).unwrap(),
            (40000, 40100)
        );
        let r = std::fs::read_to_string(d.join("ip_local_reserved_ports")).unwrap();
        assert_eq!(r, "8080,40000-40100");
        // A restart finds it reserved and leaves the list alone.
        apply(SnatPorts::Range(40000, 40100), &d).unwrap();
        let r2 = std::fs::read_to_string(d.join("ip_local_reserved_ports")).unwrap();
        assert_eq!(r2, r);
        assert_eq!(apply(SnatPorts::Auto, &d).unwrap(), (1024, 32767));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
