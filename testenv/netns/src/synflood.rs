//! SYN flood from spoofed sources: TCP SYNs to one VIP:port, each from a random address of 100.64.0.0/10 (shared
//! address space, never one of the rig's hosts; for an IPv6 VIP, of the documentation prefix 2001:db8::/32) and a
//! random port, sent as fast as one AF_PACKET socket can for a
//! given time. The attack that made the data plane evict established connections before handshakes got a table
//! of their own; the end-to-end tests and `cargo xtask bench pktgen` use it.

use crate::rawsend::RawSocket;
use anyhow::Result;
use etherparse::PacketBuilder;
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

/// Where the flood goes and for how long.
#[derive(Debug, Clone)]
pub struct FloodConfig {
    pub iface: String,
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub dst: IpAddr,
    pub dst_port: u16,
    pub duration: Duration,
    /// Stop after this many SYNs (0: only the duration counts).
    pub max_frames: u64,
    /// SYNs per second at most (0: as fast as the socket sends).
    pub rate: u64,
    /// Seed of the source addresses and ports (runs are reproducible).
    pub seed: u64,
}

/// What `lb-testbed synflood` prints.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FloodReport {
    pub sent: u64,
    pub seconds: f64,
    pub per_second: f64,
    /// Send errors (the socket's queue was full, …).
    pub errors: u64,
}

/// xorshift64*: enough randomness for spoofed sources, no dependency.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

/// One SYN from `src:sport` (of the VIP's family).
pub fn syn_frame(cfg: &FloodConfig, src: IpAddr, sport: u16, seq: u32) -> Vec<u8> {
    let eth = PacketBuilder::ethernet2(cfg.src_mac, cfg.dst_mac);
    let ip = match (src, cfg.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => eth.ipv4(s.octets(), d.octets(), 64),
        (IpAddr::V6(s), IpAddr::V6(d)) => eth.ipv6(s.octets(), d.octets(), 64),
        (s, d) => panic!("a SYN from {s} to {d}: one family, please"),
    };
    let b = ip.tcp(sport, cfg.dst_port, seq, 64240).syn();
    let mut out = Vec::with_capacity(b.size(0));
    b.write(&mut out, &[]).expect("writing to a Vec");
    out
}

/// A spoofed source of `dst`'s family from random bits `x`.
fn spoofed(dst: IpAddr, x: u64) -> IpAddr {
    match dst {
        IpAddr::V4(_) => Ipv4Addr::from(0x6440_0000 | (x as u32 & 0x003f_ffff)).into(),
        IpAddr::V6(_) => {
            Ipv6Addr::from(0x2001_0db8_u128 << 96 | (x as u128 & 0xffff_ffff_ffff)).into()
        }
    }
}

/// Sends SYNs until the duration (or `max_frames`) is reached.
pub fn flood(cfg: &FloodConfig) -> Result<FloodReport> {
    let sock = RawSocket::open(&cfg.iface)?;
    let mut state = cfg.seed | 1;
    let mut r = FloodReport::default();
    let t = Instant::now();
    while t.elapsed() < cfg.duration && (cfg.max_frames == 0 || r.sent < cfg.max_frames) {
        if cfg.rate > 0 {
            // Paced: wait until the next batch is due.
            let due = Duration::from_secs_f64((r.sent + r.errors) as f64 / cfg.rate as f64);
            if let Some(wait) = due.checked_sub(t.elapsed()) {
                std::thread::sleep(wait);
            }
        }
        // A batch between clock reads.
        for _ in 0..256 {
            let x = next(&mut state);
            let src = spoofed(cfg.dst, x);
            let sport = 1024 + ((x >> 32) as u16 % 64000);
            match sock.send(&syn_frame(cfg, src, sport, (x >> 16) as u32)) {
                Ok(()) => r.sent += 1,
                Err(_) => r.errors += 1,
            }
        }
    }
    r.seconds = t.elapsed().as_secs_f64();
    r.per_second = r.sent as f64 / r.seconds.max(1e-9);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use etherparse::{SlicedPacket, TransportSlice};

    #[test]
    fn syns_come_from_the_shared_address_space() {
        let cfg = FloodConfig {
            iface: String::new(),
            src_mac: [2, 0, 0, 0, 0, 1],
            dst_mac: [2, 0, 0, 0, 0, 2],
            dst: Ipv4Addr::new(10, 200, 0, 100).into(),
            dst_port: 80,
            duration: Duration::ZERO,
            max_frames: 0,
            rate: 0,
            seed: 7,
        };
        let f = syn_frame(&cfg, Ipv4Addr::new(100, 64, 1, 2).into(), 5000, 9);
        let s = SlicedPacket::from_ethernet(&f).unwrap();
        match s.transport {
            Some(TransportSlice::Tcp(t)) => {
                assert!(t.syn() && !t.ack() && t.destination_port() == 80)
            }
            _ => panic!("not TCP"),
        }
        let mut st = 7u64;
        for _ in 0..1000 {
            let x = next(&mut st);
            let src = Ipv4Addr::from(0x6440_0000 | (x as u32 & 0x003f_ffff));
            assert!(src.octets()[0] == 100 && (64..128).contains(&src.octets()[1]));
        }
    }
}
