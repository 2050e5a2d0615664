//! A reference model of the data plane, written from docs/design.md's "Data plane rules" in plain host Rust: its own frame
//! parser, its own checksum arithmetic (whole-word RFC 1624 updates from the fields as they were and are, not
//! the per-flow deltas the program stores), its own tables. Given what user space programmed and a frame, it
//! says what the program must answer, what the frame must look like afterwards, which counters move and how
//! the flow tables of both families change.
//!
//! The rules are written once, generic over the address family ([`Fam`]: where the addresses are in the header,
//! whether it has a header checksum, which tables hold the family's connections), as the data plane's are; only
//! the parsers of the two IP headers and of their ICMP errors are the family's own.
//!
//! Two things are the program's free choice and are taken from what it did, after checking that they obey the
//! rules: the SNAT port of a new flow (in the range, not a service port of the SNAT address, not held by another
//! flow; for TCP not marked in the flow filter either) and the timestamp of an entry (between the clock readings
//! around the run). A decision that depends on the clock and would come out differently at the two readings is
//! reported as ambiguous instead of guessed.

use lb_common::{
    stat, Addr, Backend, Config, Flow, FlowAddr, FlowKey, In6, Service, ServiceKey, ServiceStats,
    Transient, CFG_F_CHECK_DST_MAC, CFG_F_SYNC_EVENTS, FLOW_EV_CLOSE, FLOW_EV_NEW, FLOW_F_FIN,
    FLOW_F_FORWARD, FLOW_F_REVERSE, FLOW_F_RST, FLOW_F_SYNCED, FLOW_F_SYN_ACK, PROTO_ICMP,
    PROTO_ICMPV6, PROTO_TCP, PROTO_UDP, SNAT_PORT_TRIES, SVC_F_SOURCE_RANGES,
    TCP_CLOSING_TIMEOUT_S, TCP_HANDSHAKE_TIMEOUT_S,
};
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

const NS: u64 = 1_000_000_000;
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

/// IPv6 extension headers: hop-by-hop options, routing, fragment, destination options, and those the parser does
/// not walk (authentication, ESP, mobility).
const HOPOPTS: u8 = 0;
const ROUTING: u8 = 43;
const FRAGMENT: u8 = 44;
const DSTOPTS: u8 = 60;
const AH: u8 = 51;
const ESP: u8 = 50;
const MOBILITY: u8 = 135;
/// Extension headers the IPv6 parser walks at most.
const MAX_EXT_HEADERS: usize = 3;

/// The program's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Drop,
    Tx,
}

/// An address family: its address as the key holds it, where its IP header keeps the addresses, and which of
/// the model's tables hold its connections.
pub trait Fam: FlowAddr {
    /// "V4" or "V6", as the maps' names end.
    const NAME: &'static str;
    /// Length of the fixed IP header.
    const IP_LEN: usize;
    /// Offsets of the source and destination address in the IP header.
    const SRC: usize;
    const DST: usize;
    /// Offset of the header checksum (IPv4's), covering the addresses.
    const IP_CSUM: Option<usize>;
    /// Whether the ICMP checksum covers the outer addresses (ICMPv6's pseudo header).
    const ICMP_PSEUDO: bool;
    /// The address at `at` as the program loads it.
    fn read(b: &[u8], at: usize) -> Self;
    /// Writes the address at `at`.
    fn write(self, b: &mut [u8], at: usize);
    /// The address's 32-bit words as loaded (the hashes fold them one by one).
    fn raw_words(self) -> Vec<u32>;
    fn ip(self) -> IpAddr;
    fn from_ip(a: IpAddr) -> Self;
    fn conn(s: &State) -> &Conn<Self>;
    fn conn_mut(s: &mut State) -> &mut Conn<Self>;

    /// The address's one's-complement 16-bit words, network order.
    fn words(self) -> Vec<u16> {
        self.raw_words().into_iter().flat_map(words32).collect()
    }
}

impl Fam for u32 {
    const NAME: &'static str = "V4";
    const IP_LEN: usize = 20;
    const SRC: usize = 12;
    const DST: usize = 16;
    const IP_CSUM: Option<usize> = Some(10);
    const ICMP_PSEUDO: bool = false;
    fn read(b: &[u8], at: usize) -> Self {
        raw32(b, at)
    }
    fn write(self, b: &mut [u8], at: usize) {
        b[at..at + 4].copy_from_slice(&self.to_ne_bytes());
    }
    fn raw_words(self) -> Vec<u32> {
        vec![self]
    }
    fn ip(self) -> IpAddr {
        IpAddr::V4(Ipv4Addr::from(self.to_ne_bytes()))
    }
    fn from_ip(a: IpAddr) -> Self {
        match a {
            IpAddr::V4(a) => u32::from_ne_bytes(a.octets()),
            IpAddr::V6(a) => panic!("{a}: not IPv4"),
        }
    }
    fn conn(s: &State) -> &Conn<Self> {
        &s.v4
    }
    fn conn_mut(s: &mut State) -> &mut Conn<Self> {
        &mut s.v4
    }
}

impl Fam for In6 {
    const NAME: &'static str = "V6";
    const IP_LEN: usize = 40;
    const SRC: usize = 8;
    const DST: usize = 24;
    const IP_CSUM: Option<usize> = None;
    const ICMP_PSEUDO: bool = true;
    fn read(b: &[u8], at: usize) -> Self {
        std::array::from_fn(|i| raw32(b, at + 4 * i))
    }
    fn write(self, b: &mut [u8], at: usize) {
        for (i, w) in self.iter().enumerate() {
            b[at + 4 * i..at + 4 * i + 4].copy_from_slice(&w.to_ne_bytes());
        }
    }
    fn raw_words(self) -> Vec<u32> {
        self.to_vec()
    }
    fn ip(self) -> IpAddr {
        IpAddr::V6(Ipv6Addr::from(Addr::from_v6_raw(self).bytes))
    }
    fn from_ip(a: IpAddr) -> Self {
        match a {
            IpAddr::V6(a) => Addr { bytes: a.octets() }.v6_raw(),
            IpAddr::V4(a) => panic!("{a}: not IPv6"),
        }
    }
    fn conn(s: &State) -> &Conn<Self> {
        &s.v6
    }
    fn conn_mut(s: &mut State) -> &mut Conn<Self> {
        &mut s.v6
    }
}

/// What user space programmed, read back from the maps.
#[derive(Clone, Debug, Default)]
pub struct Tables {
    pub cfg: Config,
    pub services: HashMap<ServiceKey, Service>,
    /// Maglev table of each service, by its offset in the arena.
    pub maglev: HashMap<u32, Vec<u32>>,
    pub backends: HashMap<u32, Backend>,
    pub nexthops: HashMap<Addr, [u8; 6]>,
    /// (service id, prefix as on the wire, CIDR prefix length).
    pub source_ranges: Vec<(u32, Addr, u32)>,
    pub vips: HashSet<Addr>,
}

/// One family's connections as the model expects them (`FLOWS_V4`, `TRANSIENT_V4`, `HANDSHAKES` or IPv6's), and
/// what the frame being processed did to them.
#[derive(Clone, Debug, Default)]
pub struct Conn<A: Fam> {
    pub flows: HashMap<FlowKey<A>, Flow<A>>,
    pub transient: HashMap<FlowKey<A>, Transient<A>>,
    /// `HANDSHAKES` slots (`lb_common::handshakes::slot` of a client's key) written this epoch: the reverse key of
    /// a handshake. A slot not written this epoch can hold a key of an earlier one, whose entry no longer exists
    /// or, if written again since, is another client's handshake: it finds nothing, like no slot.
    pub handshakes: HashMap<u32, FlowKey<A>>,
    /// Keys of both tables this frame read or wrote (the runner compares them with the kernel's).
    pub touched: Vec<FlowKey<A>>,
    /// `HANDSHAKES` slots this frame wrote (the runner compares them with the kernel's).
    pub indexed: Vec<u32>,
    /// What this frame publishes for the HA peers' sync (with `CFG_F_SYNC_EVENTS`): kind, key, entry, and for a
    /// new flow its reverse entry.
    pub events: Vec<Event<A>>,
}

/// A published flow event: kind, key, entry and (new flows) reverse entry.
pub type Event<A> = (u8, FlowKey<A>, Flow<A>, Flow<A>);

impl<A: Fam> Conn<A> {
    /// The handshake of the client's key `key`, as the data plane finds it: the slot's reverse key, and its entry
    /// if that is this client's handshake.
    pub fn handshake(&self, key: &FlowKey<A>) -> Option<(FlowKey<A>, Transient<A>)> {
        let rkey = *self.handshakes.get(&lb_common::handshakes::slot(key))?;
        let t = *self.transient.get(&rkey)?;
        handshake_of(&t, key).then_some((rkey, t))
    }

    /// A handshake of the client's key `key` wherever it is (what its backend was sent), even one its slot no
    /// longer names.
    pub fn any_handshake(&self, key: &FlowKey<A>) -> Option<(FlowKey<A>, Transient<A>)> {
        self.handshake(key).or_else(|| {
            self.transient
                .iter()
                .find(|(_, t)| handshake_of(t, key))
                .map(|(k, t)| (*k, *t))
        })
    }

    fn new_frame(&mut self) {
        self.touched.clear();
        self.indexed.clear();
        self.events.clear();
    }
}

/// The flow tables and counters, as the model expects them.
#[derive(Clone, Debug, Default)]
pub struct State {
    pub v4: Conn<u32>,
    pub v6: Conn<In6>,
    /// The flow filter's bits (`lb_common::flow_filter::slot`, the map's layout) of every TCP key that entered
    /// `FLOWS_V4` or `FLOWS_V6` this epoch (one filter for both): a TCP SNAT port whose reverse key shares one
    /// counts as taken.
    pub marked: HashSet<(u32, u64)>,
    pub stats: Vec<u64>,
    pub svc_stats: HashMap<u32, ServiceStats>,
}

impl State {
    /// Writes a TCP connection's entry into `FLOWS_V4`/`FLOWS_V6`, marked in the flow filter.
    pub fn enter_flows<A: Fam>(&mut self, key: FlowKey<A>, entry: Flow<A>) {
        if key.proto == PROTO_TCP {
            self.marked.insert(lb_common::flow_filter::slot(&key));
        }
        A::conn_mut(self).flows.insert(key, entry);
    }

    /// Whether the flow filter may hold `key` (a mark of it or of a key with the same bit).
    pub fn marked<A: Fam>(&self, key: &FlowKey<A>) -> bool {
        self.marked.contains(&lb_common::flow_filter::slot(key))
    }
}

/// A handshake's entry (both directions, under the reverse key), as opposed to one of a closed connection's two.
fn is_handshake<A: Fam>(t: &Transient<A>) -> bool {
    t.fwd.flags & FLOW_F_FORWARD != 0
}

/// Whether `t` is the handshake of the client's key `key`: its reverse entry leads back to that client.
fn handshake_of<A: Fam>(t: &Transient<A>, key: &FlowKey<A>) -> bool {
    is_handshake(t) && t.flow.partner_key(key.proto) == *key
}

/// The monotonic coarse clock read just before and just after the program ran: its `now` lies in between.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    pub lo: u64,
    pub hi: u64,
}

/// Why the model could not follow the program.
#[derive(Debug)]
pub enum Fault {
    /// The program did something the rules do not allow.
    Differs(String),
    /// A rule depends on the clock and the answer changes between the two readings: nothing can be said.
    Ambiguous(&'static str),
}

type Step<T> = Result<T, Fault>;

fn differs<T>(msg: String) -> Step<T> {
    Err(Fault::Differs(msg))
}

/// What the model needs from the program's run to resolve its free choices.
pub struct Run<'a> {
    pub verdict: Verdict,
    pub out: &'a [u8],
    pub clock: Clock,
}

/// A timestamp written in this run: any value within the clock readings; the runner checks and adopts it.
pub const FRESH: u64 = u64::MAX;

pub struct Model {
    pub tables: Tables,
    pub state: State,
    /// The SYN rate guard of the one CPU the runner runs on (one for both families): when its budget was last
    /// taken, as the range of the clock then plus one interval (`None`: never).
    guard_tat: Option<(u64, u64)>,
    /// Sources that completed a handshake while the guard is on.
    trusted: HashSet<Addr>,
}

/// A parsed TCP/UDP packet.
struct L4<A: Fam> {
    key: FlowKey<A>,
    flags: u8,
    seq: u32,
    ack: u32,
    /// IP total length (IPv6: fixed header and payload).
    tot: u64,
    l4_off: usize,
    /// The frame's Ethernet source and destination.
    eth_src: [u8; 6],
    eth_dst: [u8; 6],
}

impl<A: Fam> L4<A> {
    fn tcp(&self) -> bool {
        self.key.proto == PROTO_TCP
    }
    fn syn(&self) -> bool {
        self.tcp() && self.flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn raw32(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn raw16(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

/// One's-complement 16-bit words of an address word or port as on the wire.
fn words32(raw: u32) -> [u16; 2] {
    let b = raw.to_ne_bytes();
    [
        u16::from_be_bytes([b[0], b[1]]),
        u16::from_be_bytes([b[2], b[3]]),
    ]
}
fn word16(raw: u16) -> u16 {
    u16::from_be(raw)
}

/// RFC 1624 eqn. 3: the checksum `hc` after the words `old` became `new`.
pub fn update(hc: u16, old: &[u16], new: &[u16]) -> u16 {
    let mut s: u32 = (!hc) as u32;
    for w in old {
        s += (!*w) as u32;
    }
    for w in new {
        s += *w as u32;
    }
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// The delta that the program stores for a rewrite, folded to 16 bits (0 and 0xffff are the same one's-complement
/// number).
pub fn delta(old: &[u16], new: &[u16]) -> u16 {
    !update(0xffff, old, new)
}

/// Equal as one's-complement numbers.
pub fn same_ones(a: u16, b: u16) -> bool {
    a == b || (a == 0 && b == 0xffff) || (a == 0xffff && b == 0)
}

fn fold32(x: u32) -> u16 {
    let mut s = x;
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// The frame the program must send, and where its checksums are: those compare as one's-complement numbers.
pub struct Out {
    pub frame: Vec<u8>,
    /// Offsets of the 16-bit checksums, and whether each is a UDP one (where 0 means "none").
    pub csums: Vec<(usize, bool)>,
}

type Answer = (Verdict, Option<Out>);

impl Model {
    pub fn new(tables: Tables, stats: Vec<u64>, svc_stats: HashMap<u32, ServiceStats>) -> Self {
        Model {
            tables,
            state: State {
                stats,
                svc_stats,
                ..Default::default()
            },
            guard_tat: None,
            trusted: HashSet::new(),
        }
    }

    fn count(&mut self, idx: u32) {
        self.state.stats[idx as usize] += 1;
    }

    fn svc(&mut self, id: u32) -> &mut ServiceStats {
        self.state.svc_stats.entry(id).or_default()
    }

    /// The connections of family `A`.
    fn c<A: Fam>(&mut self) -> &mut Conn<A> {
        A::conn_mut(&mut self.state)
    }

    fn flow<A: Fam>(&mut self, key: FlowKey<A>) -> Option<Flow<A>> {
        let c = self.c::<A>();
        c.touched.push(key);
        c.flows.get(&key).copied()
    }

    fn transient<A: Fam>(&mut self, key: FlowKey<A>) -> Option<Transient<A>> {
        let c = self.c::<A>();
        c.touched.push(key);
        c.transient.get(&key).copied()
    }

    fn malformed(&mut self) -> Step<Answer> {
        self.count(stat::DROP_MALFORMED);
        Ok((Verdict::Drop, None))
    }

    fn pass(&mut self, idx: u32) -> Step<Answer> {
        self.count(idx);
        Ok((Verdict::Pass, None))
    }

    /// Runs one frame through the model and checks the program's run against it.
    pub fn step(&mut self, frame: &[u8], run: &Run) -> Step<()> {
        self.state.v4.new_frame();
        self.state.v6.new_frame();
        let (verdict, out) = self.process(frame, run)?;
        if verdict != run.verdict {
            return differs(format!(
                "verdict {:?}, the model says {verdict:?}",
                run.verdict
            ));
        }
        match (verdict, out) {
            (Verdict::Tx, Some(expected)) => compare_frames(&expected, run.out),
            // A frame handed to the kernel must be the one that arrived.
            (Verdict::Pass, _) if run.out != frame => differs(format!(
                "passed frame was modified: {}",
                first_difference(frame, run.out)
            )),
            _ => Ok(()),
        }
    }

    fn process(&mut self, f: &[u8], run: &Run) -> Step<Answer> {
        let cfg = self.tables.cfg;
        if f.len() < 14 {
            return self.malformed();
        }
        let ethertype = be16(f, 12);
        if ethertype != 0x0800 && ethertype != 0x86dd {
            return self.pass(stat::PASS_NOT_IP);
        }
        if cfg.flags & CFG_F_CHECK_DST_MAC != 0 && f[0..6] != cfg.local_mac {
            return self.pass(stat::PASS_OTHER_HOST);
        }
        if ethertype == 0x86dd {
            // The IPv6 program, by tail call.
            return self.ipv6(f, run);
        }
        if f.len() < 14 + 20 {
            return self.malformed();
        }
        let (version, ihl) = (f[14] >> 4, (f[14] & 0x0f) as usize);
        let tot = be16(f, 16) as usize;
        if version != 4 || ihl < 5 || tot < ihl * 4 || tot + 14 > f.len() {
            return self.malformed();
        }
        if ihl > 5 {
            self.count(stat::IP_OPTIONS);
        }
        // More fragments, or an offset: not a whole packet.
        if be16(f, 20) & 0x3fff != 0 {
            return self.fragment::<u32>(f);
        }
        let l4_off = 14 + ihl * 4;
        match f[23] {
            PROTO_ICMP => self.icmp(f, l4_off, 14 + tot),
            proto => self.transport::<u32>(f, proto, l4_off, tot, run),
        }
    }

    /// The IPv6 program: the fixed header, at most `MAX_EXT_HEADERS` hop-by-hop, routing (none with segments
    /// left) and destination options headers walked, then TCP, UDP (with a checksum), ICMPv6; fragments as
    /// IPv4's.
    fn ipv6(&mut self, f: &[u8], run: &Run) -> Step<Answer> {
        if f.len() < 14 + 40 || f[14] >> 4 != 6 {
            return self.malformed();
        }
        let tot = 40 + be16(f, 18) as usize;
        if tot + 14 > f.len() {
            return self.malformed();
        }
        let (mut nh, mut off, mut walked) = (f[20], 14 + 40, 0);
        while walked < MAX_EXT_HEADERS && matches!(nh, HOPOPTS | ROUTING | DSTOPTS) {
            if off + 4 > f.len() {
                return self.malformed();
            }
            if nh == ROUTING && f[off + 3] != 0 {
                // Segments left: the destination is not the final one.
                return self.pass(stat::PASS_IPV6_EXT);
            }
            nh = f[off];
            off += (f[off + 1] as usize + 1) * 8;
            walked += 1;
        }
        if walked > 0 {
            self.count(stat::IPV6_EXT_HEADERS);
        }
        if off > 14 + tot {
            return self.malformed();
        }
        match nh {
            PROTO_UDP if off + 8 <= f.len() && off - 14 + 8 <= tot && be16(f, off + 6) == 0 => {
                // No checksum (mandatory in IPv6): dropped when it belongs to a flow or a service.
                let key = FlowKey::<In6> {
                    src: In6::read(f, 14 + In6::SRC),
                    dst: In6::read(f, 14 + In6::DST),
                    sport: raw16(f, off),
                    dport: raw16(f, off + 2),
                    proto: PROTO_UDP,
                    _pad: [0; 3],
                };
                let ours = self.flow(key).is_some()
                    || self.tables.services.contains_key(&service_key(&key));
                if ours {
                    self.count(stat::DROP_UDP6_NO_CHECKSUM);
                    return Ok((Verdict::Drop, None));
                }
                self.pass(stat::PASS_NOT_SERVICE)
            }
            PROTO_TCP | PROTO_UDP => self.transport::<In6>(f, nh, off, tot, run),
            PROTO_ICMPV6 => self.icmp6(f, off, 14 + tot),
            FRAGMENT => self.fragment::<In6>(f),
            HOPOPTS | ROUTING | DSTOPTS | AH | ESP | MOBILITY => self.pass(stat::PASS_IPV6_EXT),
            _ => self.pass(stat::PASS_NOT_SERVICE),
        }
    }

    /// A fragment: dropped when it is for one of our addresses, the kernel's otherwise.
    fn fragment<A: Fam>(&mut self, f: &[u8]) -> Step<Answer> {
        let dst = A::read(f, 14 + A::DST);
        if self.tables.vips.contains(&dst.to_addr()) {
            self.count(stat::DROP_FRAGMENT);
            Ok((Verdict::Drop, None))
        } else {
            self.pass(stat::PASS_FRAGMENT)
        }
    }

    /// A TCP or UDP header at `l4_off` (the IP header, with its options or extension headers, is `l4_off - 14`
    /// bytes long; the packet `tot`), or another protocol.
    fn transport<A: Fam>(
        &mut self,
        f: &[u8],
        proto: u8,
        l4_off: usize,
        tot: usize,
        run: &Run,
    ) -> Step<Answer> {
        let hl = l4_off - 14;
        let (flags, seq, ack) = match proto {
            PROTO_TCP => {
                if l4_off + 20 > f.len() {
                    return self.malformed();
                }
                let doff = (f[l4_off + 12] >> 4) as usize * 4;
                if doff < 20 || hl + doff > tot {
                    return self.malformed();
                }
                (
                    f[l4_off + 13],
                    u32::from_be_bytes(f[l4_off + 4..l4_off + 8].try_into().unwrap()),
                    u32::from_be_bytes(f[l4_off + 8..l4_off + 12].try_into().unwrap()),
                )
            }
            PROTO_UDP => {
                if l4_off + 8 > f.len() || hl + 8 > tot {
                    return self.malformed();
                }
                (0, 0, 0)
            }
            _ => return self.pass(stat::PASS_NOT_SERVICE),
        };
        let p = L4 {
            key: FlowKey {
                src: A::read(f, 14 + A::SRC),
                dst: A::read(f, 14 + A::DST),
                sport: raw16(f, l4_off),
                dport: raw16(f, l4_off + 2),
                proto,
                _pad: [0; 3],
            },
            flags,
            seq,
            ack,
            tot: tot as u64,
            l4_off,
            eth_dst: f[0..6].try_into().unwrap(),
            eth_src: f[6..12].try_into().unwrap(),
        };
        self.l4(f, &p, run)
    }

    fn l4<A: Fam>(&mut self, f: &[u8], p: &L4<A>, run: &Run) -> Step<Answer> {
        let key = p.key;
        let clock = run.clock;
        let skey = service_key(&key);
        // Over the new-handshake rate, a service's SYN gets in only from a source that completed a handshake.
        if p.syn() && self.over_rate(clock)? {
            if let Some(svc) = self.tables.services.get(&skey).copied() {
                if self.trusted.contains(&key.src.to_addr()) {
                    self.count(stat::SYN_TRUSTED);
                } else {
                    self.count(stat::DROP_SYN_RATE);
                    self.svc(svc.id).drop_syn_rate += 1;
                    return Ok((Verdict::Drop, None));
                }
            }
        }
        // A SYN's own key is looked up only when the flow filter may hold it; every other packet's always.
        let lookup = !p.syn() || self.state.marked(&key);
        // Established flows and reply directions.
        let mut reopen = None;
        if let Some(fl) = lookup.then(|| self.flow(key)).flatten() {
            let forward = fl.flags & FLOW_F_FORWARD != 0;
            let closing_syn = p.syn() && fl.flags & (FLOW_F_FIN | FLOW_F_RST) != 0;
            if !forward || !(closing_syn || self.expired(&fl, key.proto, clock)?) {
                return self.established(f, p, fl, clock);
            }
            reopen = Some(fl);
        }
        let svc = self.tables.services.get(&skey).copied();
        // Closed connections and handshakes under the packet's own key: a client's segment to a service (a SYN
        // only when the filter may hold its key: a closed connection's forward key was marked in FLOWS_V4), a
        // backend's to a SNAT port.
        let cfg = self.tables.cfg;
        let own = match svc {
            Some(_) => lookup,
            None => (cfg.snat_port_min..=cfg.snat_port_max).contains(&u16::from_be(key.dport)),
        };
        if p.tcp() && own {
            if let Some(t) = self.transient(key) {
                if let Some(v) = self.segment(f, p, t, run)? {
                    return Ok(v);
                }
            }
        }
        let Some(svc) = svc else {
            return self.pass(stat::PASS_NOT_SERVICE);
        };
        if p.tcp() && !p.syn() {
            // The client's handshake in progress, through its HANDSHAKES slot.
            if let Some((rkey, h)) = self.find(&key) {
                if let Some(v) = self.client_segment(f, p, rkey, h, reopen, run)? {
                    return Ok(v);
                }
            }
            self.count(stat::DROP_NO_FLOW);
            self.svc(svc.id).drop_no_flow += 1;
            return Ok((Verdict::Drop, None));
        }
        let target = match self.pick_backend(p, &svc) {
            Ok(t) => t,
            Err(v) => return Ok((v, None)),
        };
        // A TCP connection on a reused client port ends the old one before the new one takes a SNAT port; a UDP
        // flow's old entries go once the new one has its port.
        if let (Some(old), true) = (reopen, p.tcp()) {
            self.remove_flow(old.partner_key(key.proto));
            self.remove_flow(key);
        }
        // With a range no larger than the bounded search, exhaustion is exact: every port held.
        let range = (cfg.snat_port_min..=cfg.snat_port_max).map(u16::to_be);
        if range.len() as u32 <= SNAT_PORT_TRIES
            && range
                .clone()
                .all(|port| self.snat_port_held(&target, &key, port))
        {
            self.count(stat::DROP_SNAT_EXHAUSTED);
            self.svc(svc.id).drop_snat_exhausted += 1;
            return Ok((Verdict::Drop, None));
        }
        // Otherwise the SNAT port is the program's choice: read it from the frame and check it.
        if run.verdict != Verdict::Tx || run.out.len() < p.l4_off + 2 {
            return differs(format!(
                "a new flow for service {} must be forwarded",
                svc.id
            ));
        }
        let port = raw16(run.out, p.l4_off);
        let in_range = (cfg.snat_port_min..=cfg.snat_port_max).contains(&u16::from_be(port));
        if !in_range || self.snat_port_held(&target, &key, port) {
            return differs(format!(
                "SNAT port {} is outside the range, a service port or held by another flow",
                u16::from_be(port)
            ));
        }
        if p.tcp() {
            return self.open(f, p, &svc, &target, port, clock);
        }
        if let Some(old) = reopen {
            self.remove_flow(old.partner_key(key.proto));
        }
        let fwd = target.forward(p, &svc, port);
        let rev = target.reverse(p, &svc, port);
        let rkey = fwd.partner_key(key.proto);
        let c = self.c::<A>();
        c.touched.push(rkey);
        c.flows.insert(rkey, rev);
        c.flows.insert(key, fwd);
        self.established_new(key, fwd, rev);
        self.count_dir(&fwd, p);
        Ok((Verdict::Tx, Some(rewrite(f, p, &fwd))))
    }

    /// A client's TCP SYN on SNAT port `port` (the program's choice, checked): the handshake waits in the transient
    /// table, one entry under its reverse key holding both directions, found from the client's side through its
    /// `HANDSHAKES` slot. When the port holds this client's handshake already and the client's slot names it, that
    /// one goes on (a retransmitted SYN: no new handshake) unless it is over (stale or closed), and then the new one
    /// takes its place.
    fn open<A: Fam>(
        &mut self,
        f: &[u8],
        p: &L4<A>,
        svc: &Service,
        target: &Target<A>,
        port: u16,
        clock: Clock,
    ) -> Step<Answer> {
        let key = p.key;
        let fwd = target.forward(p, svc, port);
        let rkey = fwd.partner_key(PROTO_TCP);
        // `snat_port_held` let only a free port or this client's handshake through.
        let current = match self.transient(rkey) {
            Some(h) if !closed(&h.flow) && !stale(&h, clock)? => Some(h),
            _ => None,
        };
        self.index(&key, rkey);
        if let Some(mut h) = current {
            h.flow.last_seen_ns = FRESH;
            self.c::<A>().transient.insert(rkey, h);
            self.count_dir(&h.fwd, p);
            return Ok((Verdict::Tx, Some(rewrite(f, p, &h.fwd))));
        }
        let h = Transient {
            flow: target.reverse(p, svc, port),
            fwd,
            ..Default::default()
        };
        self.c::<A>().transient.insert(rkey, h);
        self.take_budget(clock)?;
        self.count(stat::NEW_HANDSHAKES);
        let s = self.svc(svc.id);
        s.handshakes += 1;
        s.rx_packets += 1;
        s.rx_bytes += p.tot;
        Ok((Verdict::Tx, Some(rewrite(f, p, &fwd))))
    }

    /// Points the `HANDSHAKES` slot of the client's key `key` at its handshake's reverse key.
    fn index<A: Fam>(&mut self, key: &FlowKey<A>, rkey: FlowKey<A>) {
        let slot = lb_common::handshakes::slot(key);
        let c = self.c::<A>();
        c.handshakes.insert(slot, rkey);
        c.indexed.push(slot);
    }

    /// The handshake of the client's key `key`, found through its `HANDSHAKES` slot.
    fn find<A: Fam>(&mut self, key: &FlowKey<A>) -> Option<(FlowKey<A>, Transient<A>)> {
        let c = self.c::<A>();
        let rkey = *c.handshakes.get(&lb_common::handshakes::slot(key))?;
        c.touched.push(rkey);
        c.handshake(key)
    }

    /// The guard is on and this CPU used its budget: the next handshake is due after `now` (burst 0 here).
    fn over_rate(&self, clock: Clock) -> Step<bool> {
        if self.tables.cfg.syn_interval_ns == 0 {
            return Ok(false);
        }
        match self.guard_tat {
            None => Ok(false),
            Some((lo, _)) if lo > clock.hi => Ok(true),
            Some((_, hi)) if hi <= clock.lo => Ok(false),
            Some(_) => Err(Fault::Ambiguous("the SYN rate guard's budget")),
        }
    }

    /// A handshake opened: under the rate it uses one interval of the budget (over it, a trusted source's uses
    /// none).
    fn take_budget(&mut self, clock: Clock) -> Step<()> {
        if self.tables.cfg.syn_interval_ns == 0 || self.over_rate(clock)? {
            return Ok(());
        }
        let i = self.tables.cfg.syn_interval_ns as u64;
        self.guard_tat = Some((clock.lo + i, clock.hi + i));
        Ok(())
    }

    /// Whether SNAT port `port_be` cannot be given to a new flow of the client's key `key` to `t`: a service port of
    /// the SNAT address, or the reverse key of another flow (a TCP one's marked, or in the transient table as
    /// anything but this client's handshake that the client's slot names — the program looks a taken port up only
    /// then).
    fn snat_port_held<A: Fam>(&self, t: &Target<A>, key: &FlowKey<A>, port_be: u16) -> bool {
        let proto = key.proto;
        let rkey = FlowKey {
            src: t.node,
            dst: t.snat,
            sport: t.node_port,
            dport: port_be,
            proto,
            _pad: [0; 3],
        };
        let c = A::conn(&self.state);
        self.tables.services.contains_key(&service_key(&rkey))
            || c.flows.contains_key(&rkey)
            || (proto == PROTO_TCP
                && (self.state.marked(&rkey)
                    || c.transient.get(&rkey).is_some_and(|t| {
                        !(handshake_of(t, key)
                            && c.handshakes.get(&lb_common::handshakes::slot(key)) == Some(&rkey))
                    })))
    }

    fn remove_flow<A: Fam>(&mut self, key: FlowKey<A>) {
        let c = self.c::<A>();
        c.touched.push(key);
        c.flows.remove(&key);
    }

    /// A flow entered the big table: counted and published.
    fn established_new<A: Fam>(&mut self, key: FlowKey<A>, fwd: Flow<A>, rev: Flow<A>) {
        self.count(stat::NEW_FLOWS);
        self.svc(fwd.svc_id).new_flows += 1;
        self.publish(FLOW_EV_NEW, key, fwd, rev);
    }

    fn publish<A: Fam>(&mut self, kind: u8, key: FlowKey<A>, fl: Flow<A>, rev: Flow<A>) {
        if self.tables.cfg.flags & CFG_F_SYNC_EVENTS != 0 {
            self.c::<A>().events.push((kind, key, fl, rev));
        }
    }

    fn count_dir<A: Fam>(&mut self, fl: &Flow<A>, p: &L4<A>) {
        let s = self.svc(fl.svc_id);
        if fl.flags & FLOW_F_FORWARD != 0 {
            s.rx_packets += 1;
            s.rx_bytes += p.tot;
        } else {
            s.tx_packets += 1;
            s.tx_bytes += p.tot;
        }
    }

    /// A forward entry past its idle timeout, with its partner idle too (or gone).
    fn expired<A: Fam>(&mut self, fl: &Flow<A>, proto: u8, clock: Clock) -> Step<bool> {
        if !idle(fl, clock)? {
            return Ok(false);
        }
        match self.flow(fl.partner_key(proto)) {
            Some(p) => idle(&p, clock),
            None => Ok(true),
        }
    }

    fn established<A: Fam>(
        &mut self,
        f: &[u8],
        p: &L4<A>,
        mut fl: Flow<A>,
        clock: Clock,
    ) -> Step<Answer> {
        let key = p.key;
        // The timestamp moves at most once a second.
        if fl.last_seen_ns != FRESH {
            let lo = clock.lo.saturating_sub(fl.last_seen_ns) > NS;
            let hi = clock.hi.saturating_sub(fl.last_seen_ns) > NS;
            if lo != hi {
                return Err(Fault::Ambiguous("the once-a-second timestamp"));
            }
            if lo {
                fl.last_seen_ns = FRESH;
                fl.flags &= !FLOW_F_SYNCED;
            }
        }
        let mut closed = false;
        if p.tcp() && p.flags & (TCP_FIN | TCP_RST) != 0 {
            if let Some(bit) = self.close_bit(&mut fl, p.flags) {
                self.publish(FLOW_EV_CLOSE, key, fl, Flow::default());
                let pkey = fl.partner_key(key.proto);
                closed = match self.flow(pkey) {
                    None => true,
                    Some(mut partner) => {
                        if bit == FLOW_F_RST {
                            partner.flags |= FLOW_F_RST;
                            partner.timeout_s = TCP_CLOSING_TIMEOUT_S;
                            self.c::<A>().flows.insert(pkey, partner);
                            true
                        } else {
                            partner.flags & (FLOW_F_FIN | FLOW_F_RST) != 0
                        }
                    }
                };
            }
        }
        self.c::<A>().flows.insert(key, fl);
        self.count_dir(&fl, p);
        let out = rewrite(f, p, &fl);
        if closed {
            // Both entries leave the big table for the transient one, as they are now.
            let pkey = fl.partner_key(key.proto);
            let partner = self.flow(pkey);
            let c = self.c::<A>();
            if let Some(partner) = partner {
                c.transient.insert(pkey, transient(partner));
            }
            c.transient.insert(key, transient(fl));
            c.flows.remove(&key);
            c.flows.remove(&pkey);
        }
        Ok((Verdict::Tx, Some(out)))
    }

    /// FIN or RST seen for the first time in an entry's direction.
    fn close_bit<A: Fam>(&mut self, fl: &mut Flow<A>, flags: u8) -> Option<u8> {
        let bit = if flags & TCP_RST != 0 {
            FLOW_F_RST
        } else if flags & TCP_FIN != 0 {
            FLOW_F_FIN
        } else {
            return None;
        };
        if fl.flags & bit != 0 {
            return None;
        }
        if fl.flags & (FLOW_F_FIN | FLOW_F_RST) == 0 {
            self.svc(fl.svc_id).closed_flows += 1;
        }
        fl.flags |= bit;
        fl.last_seen_ns = FRESH;
        if fl.timeout_s == 0 || fl.timeout_s > TCP_CLOSING_TIMEOUT_S {
            fl.timeout_s = TCP_CLOSING_TIMEOUT_S;
        }
        Some(bit)
    }

    /// A TCP segment with an entry in the transient table under its own key: a backend's segment of a handshake,
    /// or a segment of a closed connection. `None` when the entry no longer counts.
    fn segment<A: Fam>(
        &mut self,
        f: &[u8],
        p: &L4<A>,
        mut t: Transient<A>,
        run: &Run,
    ) -> Step<Option<Answer>> {
        let stale = stale(&t, run.clock)?;
        if is_handshake(&t) {
            // The backend's side: its SYN-ACK records what the client must acknowledge, and points the client's
            // slot at the handshake again.
            if stale {
                return Ok(None);
            }
            if !closed(&t.flow) && p.flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK {
                t.flow.flags |= FLOW_F_SYN_ACK;
                t.ack_be = p.seq.wrapping_add(1).to_be();
                self.index(&t.flow.partner_key(PROTO_TCP), p.key);
            }
            t.flow.last_seen_ns = FRESH;
            self.close_bit(&mut t.flow, p.flags);
            self.c::<A>().transient.insert(p.key, t);
            self.count_dir(&t.flow, p);
            return Ok(Some((Verdict::Tx, Some(rewrite(f, p, &t.flow)))));
        }
        let partner = t.flow.partner_key(PROTO_TCP);
        if stale || (p.syn() && t.flow.flags & FLOW_F_FORWARD != 0) {
            // Both entries go.
            let c = self.c::<A>();
            c.touched.push(partner);
            c.transient.remove(&partner);
            c.transient.remove(&p.key);
            return Ok(None);
        }
        Ok(Some(self.track_transient(f, p, t, partner)))
    }

    /// The last segments of a closed connection: timestamp, FIN/RST (a RST closes the partner too), forwarded.
    fn track_transient<A: Fam>(
        &mut self,
        f: &[u8],
        p: &L4<A>,
        mut t: Transient<A>,
        partner: FlowKey<A>,
    ) -> Answer {
        t.flow.last_seen_ns = FRESH;
        if self.close_bit(&mut t.flow, p.flags) == Some(FLOW_F_RST) {
            if let Some(mut pe) = self.transient(partner) {
                pe.flow.flags |= FLOW_F_RST;
                pe.flow.timeout_s = TCP_CLOSING_TIMEOUT_S;
                self.c::<A>().transient.insert(partner, pe);
            }
        }
        self.c::<A>().transient.insert(p.key, t);
        self.count_dir(&t.flow, p);
        (Verdict::Tx, Some(rewrite(f, p, &t.flow)))
    }

    /// A client's segment (not a SYN) of its handshake `h` (under `rkey`); `None` when the handshake is past its
    /// time.
    fn client_segment<A: Fam>(
        &mut self,
        f: &[u8],
        p: &L4<A>,
        rkey: FlowKey<A>,
        mut h: Transient<A>,
        reopen: Option<Flow<A>>,
        run: &Run,
    ) -> Step<Option<Answer>> {
        if stale(&h, run.clock)? {
            self.c::<A>().transient.remove(&rkey);
            return Ok(None);
        }
        if closed(&h.flow) || p.flags & TCP_RST != 0 {
            // A reset handshake's last segments, or the client giving up: the backend must hear it.
            h.flow.last_seen_ns = FRESH;
            self.close_bit(&mut h.flow, p.flags);
            self.c::<A>().transient.insert(rkey, h);
            self.count_dir(&h.fwd, p);
            return Ok(Some((Verdict::Tx, Some(rewrite(f, p, &h.fwd)))));
        }
        if p.flags & TCP_ACK != 0
            && h.flow.flags & FLOW_F_SYN_ACK != 0
            && u32::from_be(h.ack_be) == p.ack
        {
            return Ok(Some(self.promote(f, p, rkey, h, reopen)));
        }
        self.count(stat::DROP_HANDSHAKE);
        self.svc(h.flow.svc_id).drop_handshake += 1;
        Ok(Some((Verdict::Drop, None)))
    }

    /// The client acknowledged the backend's SYN-ACK: both directions enter the flow table (marked), the handshake
    /// leaves the transient table.
    fn promote<A: Fam>(
        &mut self,
        f: &[u8],
        p: &L4<A>,
        rkey: FlowKey<A>,
        mut h: Transient<A>,
        reopen: Option<Flow<A>>,
    ) -> Answer {
        let key = p.key;
        h.fwd.last_seen_ns = FRESH;
        h.flow.last_seen_ns = FRESH;
        h.flow.flags &= !FLOW_F_SYN_ACK;
        self.close_bit(&mut h.fwd, p.flags);
        if let Some(old) = reopen {
            let old = old.partner_key(PROTO_TCP);
            if old != rkey {
                self.remove_flow(old);
            }
        }
        self.state.enter_flows(rkey, h.flow);
        self.state.enter_flows(key, h.fwd);
        self.established_new(key, h.fwd, h.flow);
        if self.tables.cfg.syn_interval_ns != 0 {
            self.trusted.insert(key.src.to_addr());
        }
        self.count_dir(&h.fwd, p);
        self.c::<A>().transient.remove(&rkey);
        (Verdict::Tx, Some(rewrite(f, p, &h.fwd)))
    }

    fn pick_backend<A: Fam>(&mut self, p: &L4<A>, svc: &Service) -> Result<Target<A>, Verdict> {
        let key = &p.key;
        if svc.flags & SVC_F_SOURCE_RANGES != 0 {
            let src = key.src.to_addr();
            let bits = 32 * key.src.raw_words().len() as u32;
            let allowed = self
                .tables
                .source_ranges
                .iter()
                .any(|(id, net, len)| *id == svc.id && prefix_match(&src, net, *len, bits));
            if !allowed {
                self.count(stat::DROP_SOURCE_RANGE);
                self.svc(svc.id).drop_source_range += 1;
                return Err(Verdict::Drop);
            }
        }
        if svc.table_size == 0 {
            self.count(stat::DROP_NO_BACKEND);
            self.svc(svc.id).drop_no_backend += 1;
            return Err(Verdict::Drop);
        }
        let hash = flow_hash(key, self.tables.cfg.hash_seed);
        let table = &self.tables.maglev[&svc.table_offset];
        let backend_id = table[(hash % svc.table_size) as usize];
        let Some(backend) = self
            .tables
            .backends
            .get(&backend_id)
            .filter(|b| b.family == A::FAMILY)
            .copied()
        else {
            self.count(stat::DROP_BAD_BACKEND);
            return Err(Verdict::Drop);
        };
        let Some(mac) = self.tables.nexthops.get(&backend.addr).copied() else {
            self.count(stat::PASS_NO_NEXTHOP);
            self.svc(svc.id).pass_no_nexthop += 1;
            return Err(Verdict::Pass);
        };
        Ok(Target {
            backend_id,
            node: A::from_addr(backend.addr),
            node_port: backend.port_be,
            mac,
            snat: A::from_addr(svc.snat_addr),
        })
    }

    /// An ICMP error: types 3 and 11 quoting an IPv4 packet of ours (header without options, TCP or UDP) are
    /// translated; all else is the kernel's. The message ends where the IP packet does (`end`): Ethernet padding
    /// after it is no part of the quote.
    fn icmp(&mut self, f: &[u8], l4_off: usize, end: usize) -> Step<Answer> {
        if l4_off + 8 > end {
            return self.malformed();
        }
        let ty = f[l4_off];
        if ty != 3 && ty != 11 {
            return self.pass(stat::PASS_NOT_SERVICE);
        }
        let inner = l4_off + 8;
        if inner + 24 > end || f[inner] != 0x45 || !matches!(f[inner + 9], PROTO_TCP | PROTO_UDP) {
            return self.pass(stat::PASS_ICMP_UNKNOWN);
        }
        self.translate::<u32>(f, l4_off, f[inner + 9], end)
    }

    /// An ICMPv6 message: echo, neighbour discovery and router messages are the kernel's; errors (destination
    /// unreachable, packet too big, time exceeded) quoting a TCP or UDP packet of ours right after its fixed
    /// header are translated; other types are the kernel's.
    fn icmp6(&mut self, f: &[u8], l4_off: usize, end: usize) -> Step<Answer> {
        if l4_off + 8 > end {
            return self.malformed();
        }
        let ty = f[l4_off];
        if matches!(ty, 128 | 129 | 133..=137) {
            return self.pass(stat::PASS_NOT_SERVICE);
        }
        if !matches!(ty, 1..=3) {
            return self.pass(stat::PASS_ICMP_UNKNOWN);
        }
        let inner = l4_off + 8;
        // The quoted header whole in the frame, its ports within the message.
        if inner + 40 > f.len()
            || inner + 44 > end
            || !matches!(f[inner + 6], PROTO_TCP | PROTO_UDP)
        {
            return self.pass(stat::PASS_ICMP_UNKNOWN);
        }
        self.translate::<In6>(f, l4_off, f[inner + 6], end)
    }

    /// ICMP errors about one of our flows are translated, outer and inner headers, and sent the way the flow goes.
    /// The quote (an IP header without options or extension headers, then `iproto`'s ports) starts at `l4_off + 8`.
    fn translate<A: Fam>(
        &mut self,
        f: &[u8],
        l4_off: usize,
        iproto: u8,
        end: usize,
    ) -> Step<Answer> {
        let inner = l4_off + 8;
        let ports = inner + A::IP_LEN;
        // The quoted packet is one we sent: turned around, it is the key of this direction's entry.
        let key = FlowKey::<A> {
            src: A::read(f, inner + A::DST),
            dst: A::read(f, inner + A::SRC),
            sport: raw16(f, ports + 2),
            dport: raw16(f, ports),
            proto: iproto,
            _pad: [0; 3],
        };
        // Established flows first, then (TCP) an entry under the key, then a client's handshake.
        let fl = match self.flow(key) {
            Some(fl) => Some(fl),
            None if iproto == PROTO_TCP => match self.transient(key) {
                Some(t) => Some(t.flow),
                None => self.find(&key).map(|(_, h)| h.fwd),
            },
            None => None,
        };
        let Some(fl) = fl else {
            return self.pass(stat::PASS_ICMP_UNKNOWN);
        };
        let mut o = f.to_vec();
        let set16 = |o: &mut Vec<u8>, at: usize, raw: u16| {
            o[at..at + 2].copy_from_slice(&raw.to_ne_bytes())
        };
        let word = |o: &Vec<u8>, at: usize| be16(o, at);
        let mut csums = vec![(l4_off + 2, false)];
        // Outer: from us to the far side of the flow.
        let (osrc, odst) = (A::read(f, 14 + A::SRC), A::read(f, 14 + A::DST));
        let old_outer = [osrc.words(), odst.words()].concat();
        let new_outer = [fl.new_src.words(), fl.new_dst.words()].concat();
        fl.new_src.write(&mut o, 14 + A::SRC);
        fl.new_dst.write(&mut o, 14 + A::DST);
        if let Some(at) = A::IP_CSUM {
            let ck = update(word(&o, 14 + at), &old_outer, &new_outer);
            o[14 + at..14 + at + 2].copy_from_slice(&ck.to_be_bytes());
            csums.push((14 + at, false));
        }
        // Inner: the packet as the far side sent it.
        let (isrc, idst) = (A::read(f, inner + A::SRC), A::read(f, inner + A::DST));
        let (isport, idport) = (raw16(f, ports), raw16(f, ports + 2));
        let old_addrs = [isrc.words(), idst.words()].concat();
        let new_addrs = [fl.new_dst.words(), fl.new_src.words()].concat();
        let old_words = [old_addrs.as_slice(), &[word16(isport), word16(idport)]].concat();
        let new_words = [
            new_addrs.as_slice(),
            &[word16(fl.new_dport), word16(fl.new_sport)],
        ]
        .concat();
        fl.new_dst.write(&mut o, inner + A::SRC);
        fl.new_src.write(&mut o, inner + A::DST);
        if let Some(at) = A::IP_CSUM {
            let ick = update(word(&o, inner + at), &old_addrs, &new_addrs);
            o[inner + at..inner + at + 2].copy_from_slice(&ick.to_be_bytes());
            csums.push((inner + at, false));
        }
        set16(&mut o, ports, fl.new_dport);
        set16(&mut o, ports + 2, fl.new_sport);
        // The inner L4 checksum, when the quote reaches it.
        let ck_at = ports + if iproto == PROTO_TCP { 16 } else { 6 };
        if ck_at + 2 <= end {
            csums.push((ck_at, iproto == PROTO_UDP));
            let old = word(&o, ck_at);
            let new = if iproto == PROTO_UDP && old == 0 {
                0
            } else {
                let c = update(old, &old_words, &new_words);
                if iproto == PROTO_UDP && c == 0 {
                    0xffff
                } else {
                    c
                }
            };
            o[ck_at..ck_at + 2].copy_from_slice(&new.to_be_bytes());
        }
        // The ICMP checksum covers the whole message: every 16-bit word that changed in it (and for ICMPv6 the
        // outer addresses, in its pseudo header).
        let (mut old_icmp, mut new_icmp) = if A::ICMP_PSEUDO {
            (old_outer, new_outer)
        } else {
            (vec![], vec![])
        };
        let mut at = l4_off;
        while at + 1 < end {
            if at != l4_off + 2 {
                old_icmp.push(be16(f, at));
                new_icmp.push(be16(&o, at));
            }
            at += 2;
        }
        let ck = update(word(&o, l4_off + 2), &old_icmp, &new_icmp);
        o[l4_off + 2..l4_off + 4].copy_from_slice(&ck.to_be_bytes());
        o.copy_within(0..6, 6);
        o[0..6].copy_from_slice(&fl.mac);
        self.count(stat::ICMP_TRANSLATED);
        self.svc(fl.svc_id).icmp_translated += 1;
        Ok((Verdict::Tx, Some(Out { frame: o, csums })))
    }
}

/// The `SERVICES` key a packet with flow key `key` is for.
fn service_key<A: Fam>(key: &FlowKey<A>) -> ServiceKey {
    ServiceKey {
        addr: key.dst.to_addr(),
        port_be: key.dport,
        proto: key.proto,
        family: A::FAMILY,
    }
}

/// The backend chosen for a new flow.
struct Target<A: Fam> {
    backend_id: u32,
    node: A,
    node_port: u16,
    mac: [u8; 6],
    snat: A,
}

impl<A: Fam> Target<A> {
    /// Backend → client: node:NodePort → VIP:service port, SNAT port `port` → client port.
    fn reverse(&self, p: &L4<A>, svc: &Service, port: u16) -> Flow<A> {
        let k = &p.key;
        Flow {
            new_src: k.dst,
            new_dst: k.src,
            new_sport: k.dport,
            new_dport: k.sport,
            mac: p.eth_src,
            flags: FLOW_F_REVERSE,
            egress: 0,
            svc_id: svc.id,
            backend_id: self.backend_id,
            timeout_s: svc.idle_timeout_s,
            csum_addr: delta(
                &[self.node.words(), self.snat.words()].concat(),
                &[k.dst.words(), k.src.words()].concat(),
            ) as u32,
            csum_port: delta(
                &[word16(self.node_port), word16(port)],
                &[word16(k.dport), word16(k.sport)],
            ) as u32,
            last_seen_ns: FRESH,
            // The model's services never ask for PROXY v2 (its rules have their own packet tests).
            ..Default::default()
        }
    }

    /// Client → backend: client:port → SNAT:port, VIP:service port → node:NodePort.
    fn forward(&self, p: &L4<A>, svc: &Service, port: u16) -> Flow<A> {
        let k = &p.key;
        Flow {
            new_src: self.snat,
            new_dst: self.node,
            new_sport: port,
            new_dport: self.node_port,
            mac: self.mac,
            flags: FLOW_F_FORWARD,
            egress: 0,
            svc_id: svc.id,
            backend_id: self.backend_id,
            timeout_s: svc.idle_timeout_s,
            csum_addr: delta(
                &[k.src.words(), k.dst.words()].concat(),
                &[self.snat.words(), self.node.words()].concat(),
            ) as u32,
            csum_port: delta(
                &[word16(k.sport), word16(k.dport)],
                &[word16(port), word16(self.node_port)],
            ) as u32,
            last_seen_ns: FRESH,
            // The model's services never ask for PROXY v2 (its rules have their own packet tests).
            ..Default::default()
        }
    }
}

/// A closed connection's entry.
fn transient<A: Fam>(flow: Flow<A>) -> Transient<A> {
    Transient {
        flow,
        ..Default::default()
    }
}

/// FIN or RST seen.
fn closed<A: Fam>(fl: &Flow<A>) -> bool {
    fl.flags & (FLOW_F_FIN | FLOW_F_RST) != 0
}

/// Idle past the timeout at `now` (0 = never).
fn idle<A: Fam>(fl: &Flow<A>, clock: Clock) -> Step<bool> {
    if fl.timeout_s == 0 || fl.last_seen_ns == FRESH {
        return Ok(false);
    }
    let limit = fl.timeout_s as u64 * NS;
    decide(
        clock,
        |now| now.saturating_sub(fl.last_seen_ns) > limit,
        "idle timeout",
    )
}

/// A handshake past its 30 s, or a closed connection past its closing timeout.
fn stale<A: Fam>(t: &Transient<A>, clock: Clock) -> Step<bool> {
    if t.flow.flags & (FLOW_F_FIN | FLOW_F_RST) != 0 {
        return idle(&t.flow, clock);
    }
    if t.flow.last_seen_ns == FRESH {
        return Ok(false);
    }
    decide(
        clock,
        |now| now.saturating_sub(t.flow.last_seen_ns) > TCP_HANDSHAKE_TIMEOUT_S as u64 * NS,
        "handshake timeout",
    )
}

fn decide(clock: Clock, rule: impl Fn(u64) -> bool, what: &'static str) -> Step<bool> {
    let (lo, hi) = (rule(clock.lo), rule(clock.hi));
    if lo != hi {
        return Err(Fault::Ambiguous(what));
    }
    Ok(lo)
}

/// Whether `addr` (an address of `bits` bits) is in the prefix `net`/`len`: a range longer than the address's
/// family never matches (the LPM lookup's key is that long).
fn prefix_match(addr: &Addr, net: &Addr, len: u32, bits: u32) -> bool {
    if len > bits {
        return false;
    }
    (0..len as usize).all(|i| {
        let bit = |a: &Addr| (a.bytes[i / 8] >> (7 - i % 8)) & 1;
        bit(addr) == bit(net)
    })
}

/// murmur3's finaliser over the 5-tuple, seeded, each address word by word: docs/design.md's "seeded 5-tuple
/// hash" that replicas share.
pub fn flow_hash<A: Fam>(k: &FlowKey<A>, seed: u32) -> u32 {
    fn fmix(mut h: u32) -> u32 {
        h ^= h >> 16;
        h = h.wrapping_mul(0x85eb_ca6b);
        h ^= h >> 13;
        h = h.wrapping_mul(0xc2b2_ae35);
        h ^ (h >> 16)
    }
    let mut h = seed;
    for w in k.src.raw_words().into_iter().chain(k.dst.raw_words()) {
        h = fmix(h ^ w);
    }
    h = fmix(h ^ (((k.sport as u32) << 16) | k.dport as u32));
    fmix(h ^ k.proto as u32)
}

/// The frame after a flow's rewrite: MACs, addresses, ports, the IPv4 header checksum and the L4 checksum.
fn rewrite<A: Fam>(f: &[u8], p: &L4<A>, fl: &Flow<A>) -> Out {
    let mut o = f.to_vec();
    let k = &p.key;
    o[6..12].copy_from_slice(&p.eth_dst);
    o[0..6].copy_from_slice(&fl.mac);
    let old_addr = [k.src.words(), k.dst.words()].concat();
    let new_addr = [fl.new_src.words(), fl.new_dst.words()].concat();
    let mut csums = vec![];
    if let Some(at) = A::IP_CSUM {
        let at = 14 + at;
        let ipck = update(be16(f, at), &old_addr, &new_addr);
        o[at..at + 2].copy_from_slice(&ipck.to_be_bytes());
        csums.push((at, false));
    }
    fl.new_src.write(&mut o, 14 + A::SRC);
    fl.new_dst.write(&mut o, 14 + A::DST);
    o[p.l4_off..p.l4_off + 2].copy_from_slice(&fl.new_sport.to_ne_bytes());
    o[p.l4_off + 2..p.l4_off + 4].copy_from_slice(&fl.new_dport.to_ne_bytes());
    let ck_at = p.l4_off + if p.tcp() { 16 } else { 6 };
    let old = be16(f, ck_at);
    let old_words = [old_addr.as_slice(), &[word16(k.sport), word16(k.dport)]].concat();
    let new_words = [
        new_addr.as_slice(),
        &[word16(fl.new_sport), word16(fl.new_dport)],
    ]
    .concat();
    let new = if !p.tcp() && old == 0 {
        0
    } else {
        let c = update(old, &old_words, &new_words);
        if !p.tcp() && c == 0 {
            0xffff
        } else {
            c
        }
    };
    o[ck_at..ck_at + 2].copy_from_slice(&new.to_be_bytes());
    csums.push((ck_at, !p.tcp()));
    Out { frame: o, csums }
}

/// Compares the expected output frame with the program's. Checksums compare as one's-complement numbers (0 and
/// 0xffff are the same to a receiver), except that a UDP checksum is 0 exactly when it means "none".
fn compare_frames(expected: &Out, actual: &[u8]) -> Step<()> {
    let mut e = expected.frame.clone();
    if e.len() == actual.len() {
        for &(at, udp) in &expected.csums {
            let (x, y) = (be16(&e, at), be16(actual, at));
            if same_ones(x, y) && !(udp && (x == 0) != (y == 0)) {
                e[at..at + 2].copy_from_slice(&actual[at..at + 2]);
            }
        }
    }
    if e != actual {
        return differs(format!(
            "output frame differs: {}",
            first_difference(&e, actual)
        ));
    }
    Ok(())
}

/// Where two frames first differ, with some context.
pub fn first_difference(a: &[u8], b: &[u8]) -> String {
    let at = a
        .iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()));
    let lo = at.saturating_sub(4);
    format!(
        "at byte {at} (lengths {} / {}): expected {:02x?} got {:02x?}",
        a.len(),
        b.len(),
        &a[lo..(at + 8).min(a.len())],
        &b[lo..(at + 8).min(b.len())]
    )
}

/// Compares a table entry of the kernel with the model's; timestamps written in this run must lie within the
/// clock readings and are adopted. Returns the entry the model keeps.
pub fn compare_flow<A: Fam>(
    what: &str,
    key: &FlowKey<A>,
    model: &Flow<A>,
    kernel: &Flow<A>,
    clock: Clock,
) -> Result<Flow<A>, String> {
    let mut m = *model;
    if m.last_seen_ns == FRESH {
        if !(clock.lo..=clock.hi).contains(&kernel.last_seen_ns) {
            return Err(format!(
                "{what} {key:?}: timestamp {} outside this run's clock {:?}",
                kernel.last_seen_ns, clock
            ));
        }
        m.last_seen_ns = kernel.last_seen_ns;
    }
    // The program sums the header words as loaded from memory (little-endian here), the model in network order:
    // the same one's-complement number with its bytes swapped.
    let same = |model: u32, kernel: u32| same_ones(fold32(model).swap_bytes(), fold32(kernel));
    let same_sums = same(m.csum_addr, kernel.csum_addr) && same(m.csum_port, kernel.csum_port);
    let mut k = *kernel;
    if same_sums {
        k.csum_addr = m.csum_addr;
        k.csum_port = m.csum_port;
    }
    if m != k {
        return Err(format!(
            "{what} {key:?} differs:\n  model  {m:?}\n  kernel {kernel:?}"
        ));
    }
    Ok(m)
}
