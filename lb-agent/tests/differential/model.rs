//! A reference model of the data plane, written from docs/design.md's "Data plane rules" in plain host Rust: its own frame
//! parser, its own checksum arithmetic (whole-word RFC 1624 updates from the fields as they were and are, not
//! the per-flow deltas the program stores), its own tables. Given what user space programmed and a frame, it
//! says what the program must answer, what the frame must look like afterwards, which counters move and how
//! both flow tables change.
//!
//! Two things are the program's free choice and are taken from what it did, after checking that they obey the
//! rules: the SNAT port of a new flow (in the range, not a service port of the SNAT address, not held by another
//! flow; for TCP not marked in the flow filter either) and the timestamp of an entry (between the clock readings
//! around the run). A decision that depends on the clock and would come out differently at the two readings is
//! reported as ambiguous instead of guessed.

use lb_common::{
    stat, Addr, Backend, Config, FlowKeyV4, FlowV4, Service, ServiceKey, ServiceStats, TransientV4,
    CFG_F_CHECK_DST_MAC, CFG_F_SYNC_EVENTS, FAMILY_V4, FLOW_EV_CLOSE, FLOW_EV_NEW, FLOW_F_FIN,
    FLOW_F_FORWARD, FLOW_F_REVERSE, FLOW_F_RST, FLOW_F_SYNCED, FLOW_F_SYN_ACK, PROTO_ICMP,
    PROTO_TCP, PROTO_UDP, SNAT_PORT_TRIES, SVC_F_SOURCE_RANGES, TCP_CLOSING_TIMEOUT_S,
    TCP_HANDSHAKE_TIMEOUT_S,
};
use std::collections::{HashMap, HashSet};

const NS: u64 = 1_000_000_000;
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

/// The program's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Drop,
    Tx,
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
    /// (service id, IPv4 prefix as on the wire, prefix length).
    pub source_ranges: Vec<(u32, [u8; 4], u32)>,
    pub vips: HashSet<Addr>,
}

/// The flow tables and counters, as the model expects them.
#[derive(Clone, Debug, Default)]
pub struct State {
    pub flows: HashMap<FlowKeyV4, FlowV4>,
    pub transient: HashMap<FlowKeyV4, TransientV4>,
    /// The flow filter's bits (`lb_common::flow_filter::slot`, the map's layout) of every TCP key that entered
    /// `FLOWS_V4` this epoch: a TCP SNAT port whose reverse key shares one counts as taken.
    pub marked: HashSet<(u32, u64)>,
    /// `HANDSHAKES` slots (`lb_common::handshakes::slot` of a client's key) written this epoch: the reverse key of
    /// a handshake. A slot not written this epoch can hold a key of an earlier one, whose entry no longer exists
    /// or, if written again since, is another client's handshake: it finds nothing, like no slot.
    pub handshakes: HashMap<u32, FlowKeyV4>,
    pub stats: Vec<u64>,
    pub svc_stats: HashMap<u32, ServiceStats>,
}

impl State {
    /// Writes a TCP connection's entry into `FLOWS_V4`, marked in the flow filter.
    pub fn enter_flows(&mut self, key: FlowKeyV4, entry: FlowV4) {
        if key.proto == PROTO_TCP {
            self.marked.insert(lb_common::flow_filter::slot(&key));
        }
        self.flows.insert(key, entry);
    }

    /// Whether the flow filter may hold `key` (a mark of it or of a key with the same bit).
    pub fn marked(&self, key: &FlowKeyV4) -> bool {
        self.marked.contains(&lb_common::flow_filter::slot(key))
    }

    /// The handshake of the client's key `key`, as the data plane finds it: the slot's reverse key, and its entry
    /// if that is this client's handshake.
    pub fn handshake(&self, key: &FlowKeyV4) -> Option<(FlowKeyV4, TransientV4)> {
        let rkey = *self.handshakes.get(&lb_common::handshakes::slot(key))?;
        let t = *self.transient.get(&rkey)?;
        handshake_of(&t, key).then_some((rkey, t))
    }

    /// A handshake of the client's key `key` wherever it is (what its backend was sent), even one its slot no
    /// longer names.
    pub fn any_handshake(&self, key: &FlowKeyV4) -> Option<(FlowKeyV4, TransientV4)> {
        self.handshake(key).or_else(|| {
            self.transient
                .iter()
                .find(|(_, t)| handshake_of(t, key))
                .map(|(k, t)| (*k, *t))
        })
    }
}

/// A handshake's entry (both directions, under the reverse key), as opposed to one of a closed connection's two.
fn is_handshake(t: &TransientV4) -> bool {
    t.fwd.flags & FLOW_F_FORWARD != 0
}

/// Whether `t` is the handshake of the client's key `key`: its reverse entry leads back to that client.
fn handshake_of(t: &TransientV4, key: &FlowKeyV4) -> bool {
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
    /// Keys of both tables this frame read or wrote (the runner compares them with the kernel's).
    pub touched: Vec<FlowKeyV4>,
    /// `HANDSHAKES` slots this frame wrote (the runner compares them with the kernel's).
    pub indexed: Vec<u32>,
    /// What this frame publishes for the HA peers' sync (with `CFG_F_SYNC_EVENTS`): kind, key, entry, and for a
    /// new flow its reverse entry.
    pub events: Vec<(u8, FlowKeyV4, FlowV4, FlowV4)>,
    /// The SYN rate guard of the one CPU the runner runs on: when its budget was last taken, as the range of the
    /// clock then plus one interval (`None`: never).
    guard_tat: Option<(u64, u64)>,
    /// Sources that completed a handshake while the guard is on.
    trusted: HashSet<u32>,
}

/// A parsed TCP/UDP packet.
struct L4 {
    key: FlowKeyV4,
    flags: u8,
    seq: u32,
    ack: u32,
    /// IP total length.
    tot: u64,
    l4_off: usize,
    /// The frame's Ethernet source and destination.
    eth_src: [u8; 6],
    eth_dst: [u8; 6],
}

impl L4 {
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

/// One's-complement 16-bit words of an address or port as on the wire.
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
            touched: vec![],
            indexed: vec![],
            events: vec![],
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

    fn flow(&mut self, key: FlowKeyV4) -> Option<FlowV4> {
        self.touched.push(key);
        self.state.flows.get(&key).copied()
    }

    fn transient(&mut self, key: FlowKeyV4) -> Option<TransientV4> {
        self.touched.push(key);
        self.state.transient.get(&key).copied()
    }

    /// Runs one frame through the model and checks the program's run against it.
    pub fn step(&mut self, frame: &[u8], run: &Run) -> Step<()> {
        self.touched.clear();
        self.indexed.clear();
        self.events.clear();
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
            self.count(stat::DROP_MALFORMED);
            return Ok((Verdict::Drop, None));
        }
        let ethertype = be16(f, 12);
        if ethertype != 0x0800 && ethertype != 0x86dd {
            self.count(stat::PASS_NOT_IP);
            return Ok((Verdict::Pass, None));
        }
        if cfg.flags & CFG_F_CHECK_DST_MAC != 0 && f[0..6] != cfg.local_mac {
            self.count(stat::PASS_OTHER_HOST);
            return Ok((Verdict::Pass, None));
        }
        if ethertype == 0x86dd {
            // IPv6 goes to the IPv6 program by tail call; the harness loads none, so the entry point passes it.
            self.count(stat::PASS_NO_IPV6_PROGRAM);
            return Ok((Verdict::Pass, None));
        }
        if f.len() < 14 + 20 {
            self.count(stat::DROP_MALFORMED);
            return Ok((Verdict::Drop, None));
        }
        let (version, ihl) = (f[14] >> 4, (f[14] & 0x0f) as usize);
        let tot = be16(f, 16) as usize;
        if version != 4 || ihl < 5 || tot < ihl * 4 || tot + 14 > f.len() {
            self.count(stat::DROP_MALFORMED);
            return Ok((Verdict::Drop, None));
        }
        if ihl > 5 {
            self.count(stat::IP_OPTIONS);
        }
        let dst = raw32(f, 30);
        // More fragments, or an offset: not a whole packet.
        if be16(f, 20) & 0x3fff != 0 {
            return Ok(if self.tables.vips.contains(&Addr::from_v4_raw(dst)) {
                self.count(stat::DROP_FRAGMENT);
                (Verdict::Drop, None)
            } else {
                self.count(stat::PASS_FRAGMENT);
                (Verdict::Pass, None)
            });
        }
        let l4_off = 14 + ihl * 4;
        let proto = f[23];
        let l4 = |flags, seq, ack| L4 {
            key: FlowKeyV4 {
                src: raw32(f, 26),
                dst,
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
        match proto {
            PROTO_TCP => {
                if l4_off + 20 > f.len() {
                    self.count(stat::DROP_MALFORMED);
                    return Ok((Verdict::Drop, None));
                }
                let doff = (f[l4_off + 12] >> 4) as usize * 4;
                if doff < 20 || ihl * 4 + doff > tot {
                    self.count(stat::DROP_MALFORMED);
                    return Ok((Verdict::Drop, None));
                }
                let p = l4(
                    f[l4_off + 13],
                    u32::from_be_bytes(f[l4_off + 4..l4_off + 8].try_into().unwrap()),
                    u32::from_be_bytes(f[l4_off + 8..l4_off + 12].try_into().unwrap()),
                );
                self.l4(f, &p, run)
            }
            PROTO_UDP => {
                if l4_off + 8 > f.len() {
                    self.count(stat::DROP_MALFORMED);
                    return Ok((Verdict::Drop, None));
                }
                if ihl * 4 + 8 > tot {
                    self.count(stat::DROP_MALFORMED);
                    return Ok((Verdict::Drop, None));
                }
                let p = l4(0, 0, 0);
                self.l4(f, &p, run)
            }
            PROTO_ICMP => self.icmp(f, l4_off, 14 + tot),
            _ => {
                self.count(stat::PASS_NOT_SERVICE);
                Ok((Verdict::Pass, None))
            }
        }
    }

    fn l4(&mut self, f: &[u8], p: &L4, run: &Run) -> Step<Answer> {
        let key = p.key;
        let clock = run.clock;
        let skey = ServiceKey {
            addr: Addr::from_v4_raw(key.dst),
            port_be: key.dport,
            proto: key.proto,
            family: FAMILY_V4,
        };
        // Over the new-handshake rate, a service's SYN gets in only from a source that completed a handshake.
        if p.syn() && self.over_rate(clock)? {
            if let Some(svc) = self.tables.services.get(&skey).copied() {
                if self.trusted.contains(&key.src) {
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
            self.count(stat::PASS_NOT_SERVICE);
            return Ok((Verdict::Pass, None));
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
        let cfg = self.tables.cfg;
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
        self.touched.push(rkey);
        self.state.flows.insert(rkey, rev);
        self.state.flows.insert(key, fwd);
        self.established_new(key, fwd, rev);
        self.count_dir(&fwd, p);
        Ok((Verdict::Tx, Some(rewrite(f, p, &fwd))))
    }

    /// A client's TCP SYN on SNAT port `port` (the program's choice, checked): the handshake waits in the transient
    /// table, one entry under its reverse key holding both directions, found from the client's side through its
    /// `HANDSHAKES` slot. When the port holds this client's handshake already and the client's slot names it, that
    /// one goes on (a retransmitted SYN: no new handshake) unless it is over (stale or closed), and then the new one
    /// takes its place.
    fn open(
        &mut self,
        f: &[u8],
        p: &L4,
        svc: &Service,
        target: &Target,
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
            self.state.transient.insert(rkey, h);
            self.count_dir(&h.fwd, p);
            return Ok((Verdict::Tx, Some(rewrite(f, p, &h.fwd))));
        }
        let h = TransientV4 {
            flow: target.reverse(p, svc, port),
            fwd,
            ..Default::default()
        };
        self.state.transient.insert(rkey, h);
        self.take_budget(clock)?;
        self.count(stat::NEW_HANDSHAKES);
        let s = self.svc(svc.id);
        s.handshakes += 1;
        s.rx_packets += 1;
        s.rx_bytes += p.tot;
        Ok((Verdict::Tx, Some(rewrite(f, p, &fwd))))
    }

    /// Points the `HANDSHAKES` slot of the client's key `key` at its handshake's reverse key.
    fn index(&mut self, key: &FlowKeyV4, rkey: FlowKeyV4) {
        let slot = lb_common::handshakes::slot(key);
        self.state.handshakes.insert(slot, rkey);
        self.indexed.push(slot);
    }

    /// The handshake of the client's key `key`, found through its `HANDSHAKES` slot.
    fn find(&mut self, key: &FlowKeyV4) -> Option<(FlowKeyV4, TransientV4)> {
        let rkey = *self
            .state
            .handshakes
            .get(&lb_common::handshakes::slot(key))?;
        self.touched.push(rkey);
        self.state.handshake(key)
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
    fn snat_port_held(&self, t: &Target, key: &FlowKeyV4, port_be: u16) -> bool {
        let proto = key.proto;
        let skey = ServiceKey {
            addr: Addr::from_v4_raw(t.snat),
            port_be,
            proto,
            family: FAMILY_V4,
        };
        let rkey = FlowKeyV4 {
            src: t.node,
            dst: t.snat,
            sport: t.node_port,
            dport: port_be,
            proto,
            _pad: [0; 3],
        };
        self.tables.services.contains_key(&skey)
            || self.state.flows.contains_key(&rkey)
            || (proto == PROTO_TCP
                && (self.state.marked(&rkey)
                    || self.state.transient.get(&rkey).is_some_and(|t| {
                        !(handshake_of(t, key)
                            && self.state.handshakes.get(&lb_common::handshakes::slot(key))
                                == Some(&rkey))
                    })))
    }

    fn remove_flow(&mut self, key: FlowKeyV4) {
        self.touched.push(key);
        self.state.flows.remove(&key);
    }

    /// A flow entered the big table: counted and published.
    fn established_new(&mut self, key: FlowKeyV4, fwd: FlowV4, rev: FlowV4) {
        self.count(stat::NEW_FLOWS);
        self.svc(fwd.svc_id).new_flows += 1;
        self.publish(FLOW_EV_NEW, key, fwd, rev);
    }

    fn publish(&mut self, kind: u8, key: FlowKeyV4, fl: FlowV4, rev: FlowV4) {
        if self.tables.cfg.flags & CFG_F_SYNC_EVENTS != 0 {
            self.events.push((kind, key, fl, rev));
        }
    }

    fn count_dir(&mut self, fl: &FlowV4, p: &L4) {
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
    fn expired(&mut self, fl: &FlowV4, proto: u8, clock: Clock) -> Step<bool> {
        if !idle(fl, clock)? {
            return Ok(false);
        }
        match self.flow(fl.partner_key(proto)) {
            Some(p) => idle(&p, clock),
            None => Ok(true),
        }
    }

    fn established(&mut self, f: &[u8], p: &L4, mut fl: FlowV4, clock: Clock) -> Step<Answer> {
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
                self.publish(FLOW_EV_CLOSE, key, fl, FlowV4::default());
                let pkey = fl.partner_key(key.proto);
                closed = match self.flow(pkey) {
                    None => true,
                    Some(mut partner) => {
                        if bit == FLOW_F_RST {
                            partner.flags |= FLOW_F_RST;
                            partner.timeout_s = TCP_CLOSING_TIMEOUT_S;
                            self.state.flows.insert(pkey, partner);
                            true
                        } else {
                            partner.flags & (FLOW_F_FIN | FLOW_F_RST) != 0
                        }
                    }
                };
            }
        }
        self.state.flows.insert(key, fl);
        self.count_dir(&fl, p);
        let out = rewrite(f, p, &fl);
        if closed {
            // Both entries leave the big table for the transient one, as they are now.
            let pkey = fl.partner_key(key.proto);
            if let Some(partner) = self.flow(pkey) {
                self.state.transient.insert(pkey, transient(partner));
            }
            self.state.transient.insert(key, transient(fl));
            self.state.flows.remove(&key);
            self.state.flows.remove(&pkey);
        }
        Ok((Verdict::Tx, Some(out)))
    }

    /// FIN or RST seen for the first time in an entry's direction.
    fn close_bit(&mut self, fl: &mut FlowV4, flags: u8) -> Option<u8> {
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
    fn segment(&mut self, f: &[u8], p: &L4, mut t: TransientV4, run: &Run) -> Step<Option<Answer>> {
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
            self.state.transient.insert(p.key, t);
            self.count_dir(&t.flow, p);
            return Ok(Some((Verdict::Tx, Some(rewrite(f, p, &t.flow)))));
        }
        let partner = t.flow.partner_key(PROTO_TCP);
        if stale || (p.syn() && t.flow.flags & FLOW_F_FORWARD != 0) {
            // Both entries go.
            self.touched.push(partner);
            self.state.transient.remove(&partner);
            self.state.transient.remove(&p.key);
            return Ok(None);
        }
        Ok(Some(self.track_transient(f, p, t, partner)))
    }

    /// The last segments of a closed connection: timestamp, FIN/RST (a RST closes the partner too), forwarded.
    fn track_transient(
        &mut self,
        f: &[u8],
        p: &L4,
        mut t: TransientV4,
        partner: FlowKeyV4,
    ) -> Answer {
        t.flow.last_seen_ns = FRESH;
        if self.close_bit(&mut t.flow, p.flags) == Some(FLOW_F_RST) {
            if let Some(mut pe) = self.transient(partner) {
                pe.flow.flags |= FLOW_F_RST;
                pe.flow.timeout_s = TCP_CLOSING_TIMEOUT_S;
                self.state.transient.insert(partner, pe);
            }
        }
        self.state.transient.insert(p.key, t);
        self.count_dir(&t.flow, p);
        (Verdict::Tx, Some(rewrite(f, p, &t.flow)))
    }

    /// A client's segment (not a SYN) of its handshake `h` (under `rkey`); `None` when the handshake is past its
    /// time.
    fn client_segment(
        &mut self,
        f: &[u8],
        p: &L4,
        rkey: FlowKeyV4,
        mut h: TransientV4,
        reopen: Option<FlowV4>,
        run: &Run,
    ) -> Step<Option<Answer>> {
        if stale(&h, run.clock)? {
            self.state.transient.remove(&rkey);
            return Ok(None);
        }
        if closed(&h.flow) || p.flags & TCP_RST != 0 {
            // A reset handshake's last segments, or the client giving up: the backend must hear it.
            h.flow.last_seen_ns = FRESH;
            self.close_bit(&mut h.flow, p.flags);
            self.state.transient.insert(rkey, h);
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
    fn promote(
        &mut self,
        f: &[u8],
        p: &L4,
        rkey: FlowKeyV4,
        mut h: TransientV4,
        reopen: Option<FlowV4>,
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
            self.trusted.insert(key.src);
        }
        self.count_dir(&h.fwd, p);
        self.state.transient.remove(&rkey);
        (Verdict::Tx, Some(rewrite(f, p, &h.fwd)))
    }

    fn pick_backend(&mut self, p: &L4, svc: &Service) -> Result<Target, Verdict> {
        let key = &p.key;
        if svc.flags & SVC_F_SOURCE_RANGES != 0 {
            let src = key.src.to_ne_bytes();
            let allowed = self
                .tables
                .source_ranges
                .iter()
                .any(|(id, net, len)| *id == svc.id && prefix_match(&src, net, *len));
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
            .filter(|b| b.family == FAMILY_V4)
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
            node: backend.addr.v4_raw(),
            node_port: backend.port_be,
            mac,
            snat: svc.snat_addr.v4_raw(),
        })
    }

    /// ICMP errors about one of our flows are translated, outer and inner headers; all else is the kernel's. The
    /// message ends where the IP packet does (`end`): Ethernet padding after it is no part of the quote.
    fn icmp(&mut self, f: &[u8], l4_off: usize, end: usize) -> Step<Answer> {
        if l4_off + 8 > end {
            self.count(stat::DROP_MALFORMED);
            return Ok((Verdict::Drop, None));
        }
        let ty = f[l4_off];
        if ty != 3 && ty != 11 {
            self.count(stat::PASS_NOT_SERVICE);
            return Ok((Verdict::Pass, None));
        }
        let inner = l4_off + 8;
        let ports = inner + 20;
        if ports + 4 > end || f[inner] != 0x45 || !matches!(f[inner + 9], PROTO_TCP | PROTO_UDP) {
            self.count(stat::PASS_ICMP_UNKNOWN);
            return Ok((Verdict::Pass, None));
        }
        let iproto = f[inner + 9];
        // The quoted packet is one we sent: turned around, it is the key of this direction's entry.
        let key = FlowKeyV4 {
            src: raw32(f, inner + 16),
            dst: raw32(f, inner + 12),
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
            self.count(stat::PASS_ICMP_UNKNOWN);
            return Ok((Verdict::Pass, None));
        };
        let mut o = f.to_vec();
        let set32 = |o: &mut Vec<u8>, at: usize, raw: u32| {
            o[at..at + 4].copy_from_slice(&raw.to_ne_bytes())
        };
        let set16 = |o: &mut Vec<u8>, at: usize, raw: u16| {
            o[at..at + 2].copy_from_slice(&raw.to_ne_bytes())
        };
        let word = |o: &Vec<u8>, at: usize| be16(o, at);
        // Outer: from us to the far side of the flow.
        let (osrc, odst) = (raw32(f, 26), raw32(f, 30));
        let ock = update(
            word(&o, 24),
            &[words32(osrc), words32(odst)].concat(),
            &[words32(fl.new_src), words32(fl.new_dst)].concat(),
        );
        set32(&mut o, 26, fl.new_src);
        set32(&mut o, 30, fl.new_dst);
        o[24..26].copy_from_slice(&ock.to_be_bytes());
        // Inner: the packet as the far side sent it.
        let (isrc, idst) = (raw32(f, inner + 12), raw32(f, inner + 16));
        let (isport, idport) = (raw16(f, ports), raw16(f, ports + 2));
        let old_words = [
            words32(isrc).as_slice(),
            &words32(idst),
            &[word16(isport), word16(idport)],
        ]
        .concat();
        let new_words = [
            words32(fl.new_dst).as_slice(),
            &words32(fl.new_src),
            &[word16(fl.new_dport), word16(fl.new_sport)],
        ]
        .concat();
        set32(&mut o, inner + 12, fl.new_dst);
        set32(&mut o, inner + 16, fl.new_src);
        let ick = update(word(&o, inner + 10), &old_words[..4], &new_words[..4]);
        o[inner + 10..inner + 12].copy_from_slice(&ick.to_be_bytes());
        set16(&mut o, ports, fl.new_dport);
        set16(&mut o, ports + 2, fl.new_sport);
        // The inner L4 checksum, when the quote reaches it.
        let mut csums = vec![(24, false), (inner + 10, false), (l4_off + 2, false)];
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
        // The ICMP checksum covers the whole message: every 16-bit word that changed in it.
        let mut old_icmp = vec![];
        let mut new_icmp = vec![];
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

/// The backend chosen for a new flow.
struct Target {
    backend_id: u32,
    node: u32,
    node_port: u16,
    mac: [u8; 6],
    snat: u32,
}

impl Target {
    /// Backend → client: node:NodePort → VIP:service port, SNAT port `port` → client port.
    fn reverse(&self, p: &L4, svc: &Service, port: u16) -> FlowV4 {
        let k = &p.key;
        FlowV4 {
            new_src: k.dst,
            new_dst: k.src,
            new_sport: k.dport,
            new_dport: k.sport,
            mac: p.eth_src,
            flags: FLOW_F_REVERSE,
            _pad: 0,
            svc_id: svc.id,
            backend_id: self.backend_id,
            timeout_s: svc.idle_timeout_s,
            csum_addr: delta(
                &[words32(self.node), words32(self.snat)].concat(),
                &[words32(k.dst), words32(k.src)].concat(),
            ) as u32,
            csum_port: delta(
                &[word16(self.node_port), word16(port)],
                &[word16(k.dport), word16(k.sport)],
            ) as u32,
            last_seen_ns: FRESH,
        }
    }

    /// Client → backend: client:port → SNAT:port, VIP:service port → node:NodePort.
    fn forward(&self, p: &L4, svc: &Service, port: u16) -> FlowV4 {
        let k = &p.key;
        FlowV4 {
            new_src: self.snat,
            new_dst: self.node,
            new_sport: port,
            new_dport: self.node_port,
            mac: self.mac,
            flags: FLOW_F_FORWARD,
            _pad: 0,
            svc_id: svc.id,
            backend_id: self.backend_id,
            timeout_s: svc.idle_timeout_s,
            csum_addr: delta(
                &[words32(k.src), words32(k.dst)].concat(),
                &[words32(self.snat), words32(self.node)].concat(),
            ) as u32,
            csum_port: delta(
                &[word16(k.sport), word16(k.dport)],
                &[word16(port), word16(self.node_port)],
            ) as u32,
            last_seen_ns: FRESH,
        }
    }
}

/// A closed connection's entry.
fn transient(flow: FlowV4) -> TransientV4 {
    TransientV4 {
        flow,
        ..Default::default()
    }
}

/// FIN or RST seen.
fn closed(fl: &FlowV4) -> bool {
    fl.flags & (FLOW_F_FIN | FLOW_F_RST) != 0
}

/// Idle past the timeout at `now` (0 = never).
fn idle(fl: &FlowV4, clock: Clock) -> Step<bool> {
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
fn stale(t: &TransientV4, clock: Clock) -> Step<bool> {
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

fn prefix_match(addr: &[u8; 4], net: &[u8; 4], len: u32) -> bool {
    let a = u32::from_be_bytes(*addr);
    let n = u32::from_be_bytes(*net);
    let mask = if len == 0 {
        0
    } else {
        u32::MAX << (32 - len.min(32))
    };
    a & mask == n & mask
}

/// murmur3's finaliser over the 5-tuple, seeded: docs/design.md's "seeded 5-tuple hash" that replicas share.
pub fn flow_hash(k: &FlowKeyV4, seed: u32) -> u32 {
    fn fmix(mut h: u32) -> u32 {
        h ^= h >> 16;
        h = h.wrapping_mul(0x85eb_ca6b);
        h ^= h >> 13;
        h = h.wrapping_mul(0xc2b2_ae35);
        h ^ (h >> 16)
    }
    let mut h = fmix(seed ^ k.src);
    h = fmix(h ^ k.dst);
    h = fmix(h ^ (((k.sport as u32) << 16) | k.dport as u32));
    fmix(h ^ k.proto as u32)
}

/// The frame after a flow's rewrite: MACs, addresses, ports, the IP and L4 checksums.
fn rewrite(f: &[u8], p: &L4, fl: &FlowV4) -> Out {
    let mut o = f.to_vec();
    let k = &p.key;
    o[6..12].copy_from_slice(&p.eth_dst);
    o[0..6].copy_from_slice(&fl.mac);
    let old_addr = [words32(k.src), words32(k.dst)].concat();
    let new_addr = [words32(fl.new_src), words32(fl.new_dst)].concat();
    let ipck = update(be16(f, 24), &old_addr, &new_addr);
    o[24..26].copy_from_slice(&ipck.to_be_bytes());
    o[26..30].copy_from_slice(&fl.new_src.to_ne_bytes());
    o[30..34].copy_from_slice(&fl.new_dst.to_ne_bytes());
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
    Out {
        frame: o,
        csums: vec![(24, false), (ck_at, !p.tcp())],
    }
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
pub fn compare_flow(
    what: &str,
    key: &FlowKeyV4,
    model: &FlowV4,
    kernel: &FlowV4,
    clock: Clock,
) -> Result<FlowV4, String> {
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
