//! What the differential fuzzer sends: per epoch a scenario (services, settings), then a sequence of operations —
//! frames of real conversations (clients' SYNs, handshakes, data, FIN and RST, the backends' answers to what was
//! forwarded, UDP both ways, ICMP errors quoting flows), stray and hostile frames, structured corruption of any of
//! them (truncation at every header boundary, IHL and length lies, options, fragments, VLAN tags, unknown
//! EtherTypes and protocols, random bytes) and the clock advanced for a flow (its entries aged in both the kernel
//! and the model). Replies are built from the model's tables: the model knows where a flow was sent.

use crate::common::{
    fix_ip_checksum, icmp_error, internet_checksum, node, node_mac, pseudo_header, spec, udp,
    CLIENT_MAC, LB_MAC, VIP,
};
use crate::model::Model;
use etherparse::PacketBuilder;
use lb_agent::dataplane::model::{Protocol, ServiceSpec};
use lb_common::{
    Config, FlowKeyV4, FlowV4, CFG_F_CHECK_DST_MAC, CFG_F_SYNC_EVENTS, FLOW_F_FORWARD,
    FLOW_F_REVERSE, FLOW_F_SYNCED, PROTO_TCP, PROTO_UDP,
};
use proptest::prelude::Rng;
use proptest::test_runner::{RngAlgorithm, TestRng};
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

/// Clients: two inside the web service's source ranges (when it has some), one outside.
pub const CLIENTS: [Ipv4Addr; 3] = [
    Ipv4Addr::new(198, 51, 100, 10),
    Ipv4Addr::new(198, 51, 100, 11),
    Ipv4Addr::new(192, 0, 2, 7),
];
/// Two clients whose keys (TCP to the VIP's port 80) share a `HANDSHAKES` slot: each one's SYN points the slot at
/// its own handshake, and only the entry that is the client's own handshake counts (checked in `Gen::new`).
const COLLIDING: [(Ipv4Addr, u16); 2] = [
    (Ipv4Addr::new(198, 51, 100, 10), 40001),
    (Ipv4Addr::new(198, 51, 100, 12), 25833),
];
/// A second address of the load balancer, used as SNAT address by some scenarios.
pub const SNAT2: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
/// Ports a client uses: few, so that connections on one port follow each other (reuse, reopen, expiry).
const CLIENT_PORTS: u16 = 12;
/// Node 5 has no next hop (the harness resolves nodes 1–4).
const NODES: u8 = 5;

/// One step of a sequence.
#[derive(Clone, Debug)]
pub enum Op {
    /// A frame through the program (and the model).
    Frame(Vec<u8>),
    /// The clock advanced for a flow: its entry in `FLOWS_V4` (or `TRANSIENT_V4`) made idle since long.
    Age { key: FlowKeyV4, transient: bool },
    /// A connection made on an HA peer arrives by flow sync: both entries written into `FLOWS_V4` as the agent's
    /// flow store writes them, last seen `age_s` seconds ago.
    Synced {
        key: FlowKeyV4,
        fwd: FlowV4,
        rev: FlowV4,
        age_s: u64,
    },
}

/// An epoch's setup: what user space programs before the sequence runs.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub specs: Vec<ServiceSpec>,
    pub cfg: Config,
}

pub struct Gen {
    rng: TestRng,
    /// Sequence numbers the backends used in their SYN-ACKs, by client key (so that a client's ACK can match).
    isn: std::collections::HashMap<FlowKeyV4, u32>,
}

impl Gen {
    pub fn new(seed: u64) -> Self {
        let mut s = [0u8; 32];
        s[..8].copy_from_slice(&seed.to_le_bytes());
        let [a, b] = COLLIDING.map(|(client, port)| {
            lb_common::handshakes::slot(&FlowKeyV4 {
                src: u32::from_ne_bytes(client.octets()),
                dst: u32::from_ne_bytes(VIP.octets()),
                sport: port.to_be(),
                dport: 80u16.to_be(),
                proto: PROTO_TCP,
                _pad: [0; 3],
            })
        });
        assert_eq!(a, b, "the colliding clients' HANDSHAKES slots");
        Gen {
            rng: TestRng::from_seed(RngAlgorithm::ChaCha, &s),
            isn: Default::default(),
        }
    }

    fn below(&mut self, n: u32) -> u32 {
        self.rng.next_u32() % n.max(1)
    }

    fn chance(&mut self, percent: u32) -> bool {
        self.below(100) < percent
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u32) as usize]
    }

    /// A new epoch's services and settings.
    pub fn scenario(&mut self) -> Scenario {
        self.isn.clear();
        let nodes = |g: &mut Gen, min: u32| -> Vec<u8> {
            let n = min + g.below(NODES as u32 - min + 1);
            let mut v: Vec<u8> = (1..=NODES).collect();
            for i in (1..v.len()).rev() {
                let j = g.below(i as u32 + 1) as usize;
                v.swap(i, j);
            }
            v.truncate(n as usize);
            v
        };
        let mut web = spec(Protocol::Tcp, 80, 30080, &nodes(self, 1));
        if self.chance(30) {
            web.source_ranges = vec!["198.51.100.0/28".parse().unwrap()];
        }
        if self.chance(20) {
            web.idle_timeout = Duration::ZERO;
        }
        let mut dns = spec(Protocol::Udp, 53, 30053, &nodes(self, 1));
        if self.chance(30) {
            dns.snat = Some(IpAddr::V4(SNAT2));
        }
        // A TCP service without a healthy backend, and a UDP one on the same port number as the web service.
        let empty = spec(Protocol::Tcp, 443, 30443, &[]);
        let udp80 = spec(Protocol::Udp, 80, 30081, &nodes(self, 0));
        let mut cfg = Config {
            hash_seed: self.rng.next_u32(),
            ..Default::default()
        };
        match self.below(10) {
            // A narrow range that contains the service ports: they must be skipped.
            0..=2 => (cfg.snat_port_min, cfg.snat_port_max) = (40, 500),
            // A few ports only: new flows run out of them.
            3 => {
                cfg.snat_port_min = 1000;
                cfg.snat_port_max = 1000 + self.below(6) as u16;
            }
            _ => {}
        }
        if self.chance(50) {
            cfg.flags |= CFG_F_SYNC_EVENTS;
        }
        if self.chance(20) {
            // The SYN rate guard with a budget of one handshake per 4.3 s: within an epoch, every SYN after the
            // first handshake is over the rate.
            cfg.syn_interval_ns = u32::MAX;
            cfg.syn_burst_ns = 0;
        }
        if self.chance(30) {
            cfg.flags |= CFG_F_CHECK_DST_MAC;
            cfg.local_mac = LB_MAC;
        }
        Scenario {
            specs: vec![web, dns, empty, udp80],
            cfg,
        }
    }

    /// The next operation, given what the model knows now.
    pub fn op(&mut self, model: &Model) -> Op {
        let (client, cport) = if self.chance(6) {
            self.pick(&COLLIDING)
        } else {
            (
                self.pick(&CLIENTS),
                40000 + self.below(CLIENT_PORTS as u32) as u16,
            )
        };
        let (proto, sport_svc): (u8, u16) = match self.below(10) {
            0..=5 => (PROTO_TCP, 80),
            6..=7 => (PROTO_UDP, 53),
            8 => (PROTO_TCP, 443),
            _ => (PROTO_UDP, 80),
        };
        let key = FlowKeyV4 {
            src: u32::from_ne_bytes(client.octets()),
            dst: u32::from_ne_bytes(VIP.octets()),
            sport: cport.to_be(),
            dport: sport_svc.to_be(),
            proto,
            _pad: [0; 3],
        };
        // The client's connection: established, closed, or a handshake (one entry under its reverse key, which
        // the backend answers even when another client's SYN took the slot the client finds it by).
        let handshake = model.state.any_handshake(&key);
        let fwd = model
            .state
            .flows
            .get(&key)
            .copied()
            .or_else(|| model.state.transient.get(&key).map(|t| t.flow))
            .or_else(|| handshake.map(|(_, h)| h.fwd));
        if self.chance(4) {
            if let Some(f) = fwd {
                // Age one direction or the other (a handshake has one entry).
                let (k, transient) = if handshake.is_none() && self.chance(50) {
                    (key, !model.state.flows.contains_key(&key))
                } else {
                    let pk = f.partner_key(proto);
                    (pk, !model.state.flows.contains_key(&pk))
                };
                return Op::Age { key: k, transient };
            }
        }
        if fwd.is_none() && self.chance(3) {
            if let Some(op) = self.synced(model, key) {
                return op;
            }
        }
        let frame = match (self.below(100), fwd) {
            (0..=44, _) => self.client(client, cport, proto, sport_svc, key),
            (45..=79, Some(f)) => self.backend(key, &f, proto),
            (80..=89, Some(f)) => self.icmp(client, cport, sport_svc, &f, proto),
            _ => self.stray(),
        };
        Op::Frame(if self.chance(15) {
            self.corrupt(frame)
        } else {
            frame
        })
    }

    /// A peer's connection for `key`: another backend choice, another SNAT port, the entries as sync writes them.
    fn synced(&mut self, model: &Model, key: FlowKeyV4) -> Option<Op> {
        let svc = *model
            .tables
            .services
            .iter()
            .find(|(k, _)| {
                k.addr.v4_raw() == key.dst && k.port_be == key.dport && k.proto == key.proto
            })?
            .1;
        let node_i = 1 + self.below(NODES as u32) as u8;
        let node_raw = u32::from_ne_bytes(node(node_i).octets());
        let node_port = (30000 + self.below(1000) as u16).to_be();
        let cfg = &model.tables.cfg;
        let port = (cfg.snat_port_min as u32
            + self.below((cfg.snat_port_max - cfg.snat_port_min) as u32 + 1))
            as u16;
        let port = port.to_be();
        let snat = svc.snat_addr.v4_raw();
        let rkey = FlowKeyV4 {
            src: node_raw,
            dst: snat,
            sport: node_port,
            dport: port,
            proto: key.proto,
            _pad: [0; 3],
        };
        let service_port = model
            .tables
            .services
            .keys()
            .any(|k| k.addr.v4_raw() == snat && k.port_be == port && k.proto == key.proto);
        if service_port
            || model.state.flows.contains_key(&rkey)
            || model.state.transient.contains_key(&rkey)
        {
            return None;
        }
        let mac = model
            .tables
            .nexthops
            .get(&lb_common::Addr::from_v4_raw(node_raw))
            .copied()
            .unwrap_or([0; 6]);
        // The stored sums are in the program's byte order (words as loaded from memory, little-endian here).
        let sum = |old: &[u16], new: &[u16]| crate::model::delta(old, new).swap_bytes() as u32;
        let w32 = |raw: u32| {
            let b = raw.to_ne_bytes();
            [
                u16::from_be_bytes([b[0], b[1]]),
                u16::from_be_bytes([b[2], b[3]]),
            ]
        };
        let w16 = u16::from_be;
        let entry = |new_src, new_dst, new_sport, new_dport, mac, flags| FlowV4 {
            new_src,
            new_dst,
            new_sport,
            new_dport,
            mac,
            flags: flags | FLOW_F_SYNCED,
            _pad: 0,
            svc_id: svc.id,
            backend_id: u32::MAX,
            timeout_s: svc.idle_timeout_s,
            csum_addr: 0,
            csum_port: 0,
            last_seen_ns: 0,
        };
        let fwd = FlowV4 {
            csum_addr: sum(
                &[w32(key.src), w32(key.dst)].concat(),
                &[w32(snat), w32(node_raw)].concat(),
            ),
            csum_port: sum(
                &[w16(key.sport), w16(key.dport)],
                &[w16(port), w16(node_port)],
            ),
            ..entry(snat, node_raw, port, node_port, mac, FLOW_F_FORWARD)
        };
        let rev = FlowV4 {
            csum_addr: sum(
                &[w32(node_raw), w32(snat)].concat(),
                &[w32(key.dst), w32(key.src)].concat(),
            ),
            csum_port: sum(
                &[w16(node_port), w16(port)],
                &[w16(key.dport), w16(key.sport)],
            ),
            ..entry(
                key.dst,
                key.src,
                key.dport,
                key.sport,
                CLIENT_MAC,
                FLOW_F_REVERSE,
            )
        };
        Some(Op::Synced {
            key,
            fwd,
            rev,
            age_s: self.pick(&[0, 0, 5]),
        })
    }

    fn client(
        &mut self,
        client: Ipv4Addr,
        cport: u16,
        proto: u8,
        port: u16,
        key: FlowKeyV4,
    ) -> Vec<u8> {
        let payload = self.payload();
        if proto == PROTO_UDP {
            return udp(CLIENT_MAC, LB_MAC, client, cport, VIP, port, &payload);
        }
        let isn = self.isn.get(&key).copied().unwrap_or(0);
        let (flags, ack) = match self.below(12) {
            0..=3 => (SYN, 0),
            4..=6 => (ACK, isn.wrapping_add(1)),
            7 => (ACK, self.rng.next_u32()),
            8 => (ACK | PSH, isn.wrapping_add(1)),
            9 => (FIN | ACK, isn.wrapping_add(1)),
            10 => (RST, 0),
            _ => (self.below(256) as u8, self.rng.next_u32()),
        };
        let payload = if flags & SYN != 0 { vec![] } else { payload };
        tcp(
            CLIENT_MAC, LB_MAC, client, cport, VIP, port, flags, 7000, ack, &payload,
        )
    }

    /// The backend answers what was forwarded for the flow whose forward entry is `f`.
    fn backend(&mut self, key: FlowKeyV4, f: &FlowV4, proto: u8) -> Vec<u8> {
        let (src, dst) = (ip(f.new_dst), ip(f.new_src));
        let (sport, dport) = (u16::from_be(f.new_dport), u16::from_be(f.new_sport));
        let mac = f.mac;
        let payload = self.payload();
        if proto == PROTO_UDP {
            return udp(mac, LB_MAC, src, sport, dst, dport, &payload);
        }
        let (flags, seq) = match self.below(10) {
            0..=3 => {
                let isn = self.rng.next_u32();
                self.isn.insert(key, isn);
                (SYN | ACK, isn)
            }
            4..=5 => (
                ACK | PSH,
                self.isn.get(&key).copied().unwrap_or(0).wrapping_add(1),
            ),
            6 => (FIN | ACK, 1),
            7 => (RST, 1),
            8 => (SYN, 1),
            _ => (self.below(256) as u8, self.rng.next_u32()),
        };
        let payload = if flags & SYN != 0 { vec![] } else { payload };
        tcp(
            mac, LB_MAC, src, sport, dst, dport, flags, seq, 7001, &payload,
        )
    }

    /// An ICMP error about a flow: from the backend's side about a forwarded packet, or from the client's side
    /// about a reply; sometimes of a type that is not an error, or quoting too little.
    fn icmp(&mut self, client: Ipv4Addr, cport: u16, port: u16, f: &FlowV4, proto: u8) -> Vec<u8> {
        let ty = self.pick(&[3u8, 3, 11, 0, 8, 5]);
        let code = self.pick(&[0u8, 1, 3, 4]);
        let (mac, outer_src, outer_dst, inner) = if self.chance(50) {
            // The node (or a router before it) about the packet we sent it.
            let q = packet(
                ip(f.new_src),
                u16::from_be(f.new_sport),
                ip(f.new_dst),
                u16::from_be(f.new_dport),
                proto,
            );
            (f.mac, ip(f.new_dst), ip(f.new_src), q)
        } else {
            // A router on the client's side about a reply we sent the client.
            let q = packet(VIP, port, client, cport, proto);
            (CLIENT_MAC, Ipv4Addr::new(198, 51, 100, 1), VIP, q)
        };
        let cut = match self.below(4) {
            0 => 20 + self.below(8) as usize,
            1 => 28,
            _ => inner.len(),
        };
        icmp_error(
            mac,
            LB_MAC,
            outer_src,
            outer_dst,
            ty,
            code,
            [0, 0, 0x05, 0xdc],
            &inner[..cut.min(inner.len())],
        )
    }

    /// Traffic that belongs to no flow: other ports, SNAT ports from anywhere, other addresses, other protocols.
    fn stray(&mut self) -> Vec<u8> {
        let node_i = 1 + self.below(NODES as u32) as u8;
        let flags = self.below(256) as u8;
        let port = self.below(65536) as u16;
        match self.below(6) {
            0 => tcp(
                CLIENT_MAC, LB_MAC, CLIENTS[0], 5555, VIP, 22, SYN, 1, 0, b"",
            ),
            1 => tcp(
                node_mac(node_i),
                LB_MAC,
                node(node_i),
                30080,
                VIP,
                port,
                flags,
                1,
                2,
                b"x",
            ),
            2 => udp(CLIENT_MAC, LB_MAC, CLIENTS[1], 5353, VIP, port, b"q"),
            3 => tcp(
                CLIENT_MAC,
                LB_MAC,
                CLIENTS[0],
                6000,
                Ipv4Addr::new(10, 9, 9, 9),
                80,
                SYN,
                1,
                0,
                b"",
            ),
            4 => udp(
                node_mac(node_i),
                LB_MAC,
                node(node_i),
                30053,
                SNAT2,
                port,
                b"r",
            ),
            _ => {
                let len = self.below(120) as usize;
                (0..len).map(|_| self.rng.next_u32() as u8).collect()
            }
        }
    }

    fn payload(&mut self) -> Vec<u8> {
        let n = self.pick(&[0usize, 0, 1, 5, 64]);
        (0..n).map(|_| self.rng.next_u32() as u8).collect()
    }

    /// One structured corruption of a frame.
    fn corrupt(&mut self, mut f: Vec<u8>) -> Vec<u8> {
        let ihl = if f.len() > 14 {
            (f[14] & 0x0f) as usize * 4
        } else {
            20
        };
        let l4 = 14 + ihl;
        match self.below(16) {
            // Truncated at or near a header boundary.
            0 => {
                let at = self.pick(&[0usize, 13, 14, 20, 33, 34, l4 + 3, l4 + 7, l4 + 12, l4 + 19]);
                f.truncate(at.min(f.len()));
            }
            1 if f.len() > 14 => f[14] = (f[14] & 0xf0) | self.below(16) as u8,
            2 if f.len() > 17 => {
                let tot = self.pick(&[0u16, 19, 20, 21, 28, 40, (f.len() - 14) as u16 + 1, 1500]);
                f[16..18].copy_from_slice(&tot.to_be_bytes());
            }
            // IPv4 options (NOPs): the packet stays valid and must be forwarded with them.
            3 if f.len() >= 34 => {
                let words = 1 + self.below(3) as usize;
                let opts = vec![1u8; words * 4];
                f.splice(34..34, opts);
                f[14] = (f[14] & 0xf0) | (5 + words as u8);
                let tot = u16::from_be_bytes([f[16], f[17]]) + words as u16 * 4;
                f[16..18].copy_from_slice(&tot.to_be_bytes());
                fix_ip_checksum(&mut f);
            }
            4 if f.len() >= 34 => {
                let frag = self.pick(&[0x2000u16, 0x0001, 0x2010, 0x4000]);
                f[20..22].copy_from_slice(&frag.to_be_bytes());
            }
            5 if f.len() >= 14 => f.splice(12..12, [0x81, 0x00, 0x00, 0x05]).for_each(drop),
            6 if f.len() >= 14 => {
                let et = self.pick(&[0x86ddu16, 0x0806, 0x88cc, 0x0000]);
                f[12..14].copy_from_slice(&et.to_be_bytes());
            }
            7 if f.len() >= 34 => {
                f[23] = self.pick(&[0u8, 2, 47, 50, 132, 255]);
            }
            8 if f.len() > 14 + ihl + 12 => {
                f[l4 + 12] = (self.below(16) as u8) << 4;
            }
            9 if f.len() >= 6 => f[0..6].copy_from_slice(&node_mac(9)),
            // Ethernet padding after the IP packet.
            10 => f.extend((0..self.below(30)).map(|_| 0u8)),
            // A wrong checksum somewhere: the program must carry the error over, not fix or hide it.
            11 if f.len() > l4 + 18 => {
                let at = self.pick(&[24usize, 25, l4 + 6, l4 + 7, l4 + 16, l4 + 17]);
                f[at] ^= 1 + self.below(255) as u8;
            }
            12 if f.len() > 14 => f[14] = (self.below(16) as u8) << 4 | (f[14] & 0x0f),
            // A UDP datagram without checksum (0), which must stay without one.
            13 if f.len() >= l4 + 8 && f.get(23) == Some(&PROTO_UDP) => {
                f[l4 + 6] = 0;
                f[l4 + 7] = 0;
            }
            // TCP options (NOPs) in a longer header: a valid segment, rewritten like any other.
            14 if f.len() >= l4 + 20 && f.get(23) == Some(&PROTO_TCP) => {
                let words = 1 + self.below(3) as usize;
                f.splice(l4 + 20..l4 + 20, vec![1u8; words * 4]);
                f[l4 + 12] = ((5 + words as u8) << 4) | (f[l4 + 12] & 0x0f);
                let tot = u16::from_be_bytes([f[16], f[17]]) + words as u16 * 4;
                f[16..18].copy_from_slice(&tot.to_be_bytes());
                fix_ip_checksum(&mut f);
                fix_l4_checksum(&mut f);
            }
            _ => {
                for _ in 0..1 + self.below(4) {
                    if !f.is_empty() {
                        let at = self.below(f.len() as u32) as usize;
                        f[at] = self.rng.next_u32() as u8;
                    }
                }
            }
        }
        f
    }
}

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const PSH: u8 = 0x08;
pub const ACK: u8 = 0x10;

fn ip(raw: u32) -> Ipv4Addr {
    Ipv4Addr::from(raw.to_ne_bytes())
}

/// An Ethernet + IPv4 + TCP frame with any flags, sequence and acknowledgement numbers.
#[allow(clippy::too_many_arguments)]
fn tcp(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: Ipv4Addr,
    sport: u16,
    dst: Ipv4Addr,
    dport: u16,
    flags: u8,
    seq: u32,
    ack: u32,
    payload: &[u8],
) -> Vec<u8> {
    let mut b = PacketBuilder::ethernet2(src_mac, dst_mac)
        .ipv4(src.octets(), dst.octets(), 64)
        .tcp(sport, dport, seq, 65535);
    if flags & SYN != 0 {
        b = b.syn();
    }
    if flags & ACK != 0 {
        b = b.ack(ack);
    }
    if flags & FIN != 0 {
        b = b.fin();
    }
    if flags & RST != 0 {
        b = b.rst();
    }
    if flags & PSH != 0 {
        b = b.psh();
    }
    if flags & 0x20 != 0 {
        b = b.urg(0);
    }
    if flags & 0x40 != 0 {
        b = b.ece();
    }
    if flags & 0x80 != 0 {
        b = b.cwr();
    }
    let mut out = Vec::with_capacity(b.size(payload.len()));
    b.write(&mut out, payload).unwrap();
    out
}

/// An IPv4 packet (no Ethernet) as it would be quoted in an ICMP error.
fn packet(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, proto: u8) -> Vec<u8> {
    let b = PacketBuilder::ipv4(src.octets(), dst.octets(), 64);
    let mut out = vec![];
    if proto == PROTO_TCP {
        let b = b.tcp(sport, dport, 1, 1000).syn();
        b.write(&mut out, &[]).unwrap();
    } else {
        let b = b.udp(sport, dport);
        b.write(&mut out, b"quoted").unwrap();
    }
    out
}

/// Recomputes a TCP or UDP checksum over the pseudo header and the segment (as far as the IP total length says).
fn fix_l4_checksum(f: &mut [u8]) {
    let ihl = (f[14] & 0x0f) as usize * 4;
    let l4 = 14 + ihl;
    let end = (14 + u16::from_be_bytes([f[16], f[17]]) as usize).min(f.len());
    let at = l4 + if f[23] == PROTO_TCP { 16 } else { 6 };
    f[at] = 0;
    f[at + 1] = 0;
    let src = Ipv4Addr::new(f[26], f[27], f[28], f[29]);
    let dst = Ipv4Addr::new(f[30], f[31], f[32], f[33]);
    let ck = internet_checksum(&[&pseudo_header(src, dst, f[23], end - l4), &f[l4..end]]);
    f[at..at + 2].copy_from_slice(&ck.to_be_bytes());
}
