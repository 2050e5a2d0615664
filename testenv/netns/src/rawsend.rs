//! Malformed-frame injector: builds broken Ethernet/IPv4/TCP frames (valid parts with etherparse, then the
//! one field that makes each kind malformed patched by hand) and sends them through an AF_PACKET socket, so the
//! kernel's own stack never gets a chance to sanitise them. Used to prove the data plane drops and counts junk
//! without disturbing real traffic. [`build_frame`] is public so data-plane tests can feed the same frames to
//! `BPF_PROG_TEST_RUN`.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use etherparse::{
    EtherType, Ethernet2Header, IpFragOffset, IpNumber, Ipv4Header, TcpHeader, UdpHeader,
};
use serde::{Deserialize, Serialize};

/// The kinds of malformed frames.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    clap::ValueEnum,
    Serialize,
    Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum MalformedKind {
    /// Ethertype IPv4 but only 10 bytes of IPv4 header.
    TruncatedIpv4,
    /// IPv4 header with IHL 3 (< 5).
    IhlTooSmall,
    /// IPv4 total length (1500) far beyond the frame.
    BogusTotalLength,
    /// IPv4 total length (12) smaller than the header itself.
    ShortTotalLength,
    /// Protocol TCP but only 8 bytes of TCP header.
    TruncatedTcp,
    /// TCP header with data offset 2 (< 5).
    TcpDoffTooSmall,
    /// IPv4 protocol 253 (reserved for experiments), addressed to the VIP.
    UnknownProto,
    /// One byte of "IPv4" (`0x45`) after the Ethernet header, zero-padded to the 60-byte Ethernet minimum the
    /// way a NIC's driver pads short frames: long enough to pass a length check, all-zero header fields
    /// (total length 0, protocol 0) behind it. (A frame shorter than the 14-byte link header cannot be sent:
    /// the kernel rejects it with EINVAL.)
    TinyGarbage,
    /// First fragment (MF set, offset 0) of a UDP datagram to the VIP.
    FragmentFirst,
    /// Non-first fragment (offset 1480) to the VIP: no L4 header at all.
    FragmentNonFirst,
}

impl MalformedKind {
    /// Every kind, in declaration order.
    pub const ALL: [MalformedKind; 10] = [
        Self::TruncatedIpv4,
        Self::IhlTooSmall,
        Self::BogusTotalLength,
        Self::ShortTotalLength,
        Self::TruncatedTcp,
        Self::TcpDoffTooSmall,
        Self::UnknownProto,
        Self::TinyGarbage,
        Self::FragmentFirst,
        Self::FragmentNonFirst,
    ];

    /// Kebab-case name (as on the command line and in the report).
    pub fn name(&self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    }
}

/// Addressing of the frames.
#[derive(Debug, Clone)]
pub struct FrameParams {
    /// Source MAC (normally the sending interface's).
    pub src_mac: [u8; 6],
    /// Destination MAC (the load balancer's interface).
    pub dst_mac: [u8; 6],
    /// Source IPv4.
    pub src_ip: Ipv4Addr,
    /// Destination IPv4 (the VIP).
    pub dst_ip: Ipv4Addr,
    /// Destination port for the TCP/UDP kinds (a port the load balancer serves makes the test meaningful).
    pub dst_port: u16,
    /// Base source port; frame `seq` uses `src_port + seq % 1000`.
    pub src_port: u16,
}

fn ipv4(p: &FrameParams, payload_len: usize, proto: IpNumber) -> Ipv4Header {
    let mut ip = Ipv4Header::new(
        payload_len as u16,
        64,
        proto,
        p.src_ip.octets(),
        p.dst_ip.octets(),
    )
    .expect("small payload fits");
    ip.header_checksum = ip.calc_header_checksum();
    ip
}

/// A valid Ethernet + IPv4 + TCP (ACK) frame with `data` as payload, all checksums correct.
fn valid_tcp(p: &FrameParams, seq: u32, data: &[u8]) -> Vec<u8> {
    let mut tcp = TcpHeader::new(
        p.src_port.wrapping_add((seq % 1000) as u16),
        p.dst_port,
        seq,
        64240,
    );
    tcp.ack = true;
    let ip = ipv4(p, tcp.header_len() + data.len(), IpNumber::TCP);
    tcp.checksum = tcp
        .calc_checksum_ipv4(&ip, data)
        .expect("small payload fits");
    let mut f = eth(p).to_vec();
    f.extend_from_slice(&ip.to_bytes());
    f.extend_from_slice(&tcp.to_bytes());
    f.extend_from_slice(data);
    f
}

fn eth(p: &FrameParams) -> [u8; 14] {
    Ethernet2Header {
        source: p.src_mac,
        destination: p.dst_mac,
        ether_type: EtherType::IPV4,
    }
    .to_bytes()
}

/// Recomputes the IPv4 header checksum in place (after patching a field), so that the *only* defect of the
/// frame is the intended one.
fn fix_ip_checksum(frame: &mut [u8], ihl_bytes: usize) {
    let hdr = &mut frame[14..14 + ihl_bytes];
    hdr[10] = 0;
    hdr[11] = 0;
    let mut sum = 0u32;
    for c in hdr.chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    let ck = !(sum as u16);
    hdr[10..12].copy_from_slice(&ck.to_be_bytes());
}

/// Builds frame number `seq` of `kind`.
pub fn build_frame(kind: MalformedKind, p: &FrameParams, seq: u32) -> Vec<u8> {
    const IP: usize = 14; // offset of the IPv4 header
    const TCP: usize = 14 + 20; // offset of the TCP header (IHL 5)
    let data = b"lb-testbed malformed";
    match kind {
        MalformedKind::TruncatedIpv4 => {
            let mut f = valid_tcp(p, seq, data);
            f.truncate(IP + 10);
            f
        }
        MalformedKind::IhlTooSmall => {
            let mut f = valid_tcp(p, seq, data);
            f[IP] = 0x43;
            fix_ip_checksum(&mut f, 12);
            f
        }
        MalformedKind::BogusTotalLength => {
            let mut f = valid_tcp(p, seq, data);
            f[IP + 2..IP + 4].copy_from_slice(&1500u16.to_be_bytes());
            fix_ip_checksum(&mut f, 20);
            f
        }
        MalformedKind::ShortTotalLength => {
            let mut f = valid_tcp(p, seq, data);
            f[IP + 2..IP + 4].copy_from_slice(&12u16.to_be_bytes());
            fix_ip_checksum(&mut f, 20);
            f
        }
        MalformedKind::TruncatedTcp => {
            let mut f = valid_tcp(p, seq, &[]);
            f.truncate(TCP + 8);
            f[IP + 2..IP + 4].copy_from_slice(&28u16.to_be_bytes());
            fix_ip_checksum(&mut f, 20);
            f
        }
        MalformedKind::TcpDoffTooSmall => {
            let mut f = valid_tcp(p, seq, data);
            f[TCP + 12] = (2 << 4) | (f[TCP + 12] & 0x0f);
            f
        }
        MalformedKind::UnknownProto => {
            let ip = ipv4(p, data.len(), IpNumber(253));
            let mut f = eth(p).to_vec();
            f.extend_from_slice(&ip.to_bytes());
            f.extend_from_slice(data);
            f
        }
        MalformedKind::TinyGarbage => {
            let mut f = eth(p).to_vec();
            f.push(0x45);
            f.resize(60, 0);
            f
        }
        MalformedKind::FragmentFirst | MalformedKind::FragmentNonFirst => {
            // A 3000-byte UDP datagram: only one fragment is sent, so reassembly can never complete.
            let full = vec![0x42u8; 3000];
            let first = kind == MalformedKind::FragmentFirst;
            let frag_payload = if first { 1480 - UdpHeader::LEN } else { 64 };
            let mut ip = Ipv4Header::new(
                (if first { UdpHeader::LEN } else { 0 } + frag_payload) as u16,
                64,
                IpNumber::UDP,
                p.src_ip.octets(),
                p.dst_ip.octets(),
            )
            .expect("fits");
            ip.identification = seq as u16;
            ip.more_fragments = first;
            ip.fragment_offset = IpFragOffset::try_new(if first { 0 } else { 185 }).expect("fits");
            ip.header_checksum = ip.calc_header_checksum();
            let mut f = eth(p).to_vec();
            f.extend_from_slice(&ip.to_bytes());
            if first {
                let udp_ip = ipv4(p, UdpHeader::LEN + full.len(), IpNumber::UDP);
                let udp = UdpHeader::with_ipv4_checksum(
                    p.src_port.wrapping_add((seq % 1000) as u16),
                    p.dst_port,
                    &udp_ip,
                    &full,
                )
                .expect("fits");
                f.extend_from_slice(&udp.to_bytes());
            }
            f.extend_from_slice(&full[..frag_payload]);
            f
        }
    }
}

/// What `lb-testbed rawsend` prints.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RawSendReport {
    /// Interface the frames left on.
    pub iface: String,
    /// Frames sent in total.
    pub total_sent: u64,
    /// Frames sent per kind.
    pub sent: BTreeMap<String, u64>,
    /// How long sending took, and the rate.
    pub seconds: f64,
    pub per_second: f64,
    /// Send errors by message (should stay empty).
    pub errors: BTreeMap<String, u64>,
    /// Frames the socket refused because its queue was full (a storm outrunning the interface): not sent,
    /// not an error.
    pub queue_full: u64,
    /// `stormgen` only: frames generated (and so in `sent`) that the veth could not hand to its peer because
    /// the peer's ring was full (`ethtool -S`: `xdp_xmit_errors`). Known only in total, not per kind.
    #[serde(default)]
    pub link_drops: u64,
}

/// An AF_PACKET raw socket bound for sending on one interface.
pub struct RawSocket {
    fd: std::os::fd::OwnedFd,
    ifindex: i32,
    iface: String,
}

impl RawSocket {
    /// Opens a send-only AF_PACKET socket for `iface` (protocol 0: it never receives, so nothing piles up).
    pub fn open(iface: &str) -> Result<Self> {
        let ifindex = ifindex(iface)?;
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            bail!(
                "socket(AF_PACKET) failed (needs CAP_NET_RAW): {}",
                std::io::Error::last_os_error()
            );
        }
        // SAFETY: fd is a fresh, owned descriptor.
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(Self {
            fd,
            ifindex: ifindex as i32,
            iface: iface.to_string(),
        })
    }

    /// Sends one complete Ethernet frame as is.
    pub fn send(&self, frame: &[u8]) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        // SAFETY: sockaddr_ll is plain old data; all-zero is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = self.ifindex;
        addr.sll_halen = 6;
        if frame.len() >= 14 {
            addr.sll_addr[..6].copy_from_slice(&frame[..6]);
            addr.sll_protocol = u16::from_be_bytes([frame[12], frame[13]]).to_be();
        }
        // SAFETY: frame and addr are valid for the given lengths.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

/// The index of `iface` in the current network namespace.
pub fn ifindex(iface: &str) -> Result<u32> {
    let cname = CString::new(iface).context("interface name contains NUL")?;
    // SAFETY: cname is a valid C string.
    let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
    if ifindex == 0 {
        bail!("interface {iface:?} not found in this network namespace");
    }
    Ok(ifindex)
}

/// Reads the MAC of `iface` (in the current network namespace) from sysfs.
pub fn iface_mac(iface: &str) -> Result<[u8; 6]> {
    let path = format!("/sys/class/net/{iface}/address");
    let s = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    crate::topology::parse_mac(&s)
}

/// Sends `count` frames on `iface`, cycling through `kinds` — or, with `duration`, as many as the socket sends
/// in that time (a storm).
pub fn send(
    iface: &str,
    kinds: &[MalformedKind],
    count: u64,
    duration: Option<Duration>,
    p: &FrameParams,
) -> Result<RawSendReport> {
    anyhow::ensure!(!kinds.is_empty(), "no frame kinds selected");
    let sock = RawSocket::open(iface)?;
    let mut report = RawSendReport {
        iface: sock.iface.clone(),
        ..Default::default()
    };
    // One frame per kind and source port, built before the clock starts: building costs more than sending.
    let frames: Vec<(MalformedKind, Vec<u8>)> = (0..kinds.len() as u32 * 1000)
        .map(|i| {
            let kind = kinds[i as usize % kinds.len()];
            (kind, build_frame(kind, p, i / kinds.len() as u32))
        })
        .collect();
    let start = Instant::now();
    for i in 0u64.. {
        let done = match duration {
            // The clock is read once per 256 frames.
            Some(d) => i % 256 == 0 && start.elapsed() >= d,
            None => i >= count,
        };
        if done {
            break;
        }
        let (kind, frame) = &frames[(i % frames.len() as u64) as usize];
        let kind = *kind;
        match sock.send(frame) {
            Ok(()) => {
                report.total_sent += 1;
                *report.sent.entry(kind.name()).or_default() += 1;
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => report.queue_full += 1,
            Err(e) => {
                *report
                    .errors
                    .entry(format!("{}: {e}", kind.name()))
                    .or_default() += 1
            }
        }
    }
    report.seconds = start.elapsed().as_secs_f64();
    report.per_second = report.total_sent as f64 / report.seconds.max(1e-9);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use etherparse::{LaxSlicedPacket, SlicedPacket};

    fn params() -> FrameParams {
        FrameParams {
            src_mac: [2, 0, 10, 200, 0, 10],
            dst_mac: [2, 0, 10, 200, 0, 2],
            src_ip: Ipv4Addr::new(10, 200, 0, 10),
            dst_ip: Ipv4Addr::new(10, 200, 0, 100),
            dst_port: 80,
            src_port: 40000,
        }
    }

    #[test]
    fn no_kind_yields_a_usable_transport_header() {
        for kind in MalformedKind::ALL {
            let f = build_frame(kind, &params(), 1);
            // Either a strict parser rejects the frame, or (unknown protocol, fragments) there is no L4 header a
            // load balancer could use: every kind must end up dropped, not forwarded.
            match SlicedPacket::from_ethernet(&f) {
                Err(_) => {}
                Ok(s) => assert!(
                    s.transport.is_none(),
                    "{kind:?} parsed with a transport header"
                ),
            }
            assert!(!kind.name().is_empty());
        }
    }

    #[test]
    fn valid_base_frame_parses() {
        let f = valid_tcp(&params(), 7, b"x");
        let s = SlicedPacket::from_ethernet(&f).expect("valid frame");
        assert!(s.transport.is_some());
        let frag = build_frame(MalformedKind::FragmentNonFirst, &params(), 1);
        assert!(LaxSlicedPacket::from_ethernet(&frag).is_ok());
    }

    #[test]
    fn fixed_checksum_matches_etherparse() {
        let mut f = valid_tcp(&params(), 7, b"x");
        let orig = [f[24], f[25]];
        fix_ip_checksum(&mut f, 20);
        assert_eq!(orig, [f[24], f[25]]);
    }
}
