//! Harness for data-plane tests: the real eBPF object, loaded into the kernel, run on crafted frames with
//! `BPF_PROG_TEST_RUN`, once through the XDP entry point and once through the TC one. Needs root.
#![allow(dead_code)]

pub use lb_test_support::packets;

use aya::programs::{TestRun, TestRunOptions};
use lb_agent::dataplane::maps::{FamilyMaps, Table};
use lb_agent::dataplane::model::{Protocol, ServiceId, ServiceSpec};
use lb_agent::dataplane::programmer::{ip_to_addr, Programmer};
use lb_agent::dataplane::{ConnectionLru, Dataplane, MapSizes, XDP_PROGRAM};
use lb_agent::ha::sync::SyncEvent;
use lb_common::{Flow, FlowAddr, FlowEvent, FlowKey, In6, NextHop, Transient};
pub use packets::*;
use std::marker::PhantomData;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

/// The virtual IP.
pub const VIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
/// A client.
pub const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
/// Service ports and NodePorts.
pub const WEB_PORT: u16 = 80;
pub const WEB_NODE_PORT: u16 = 30080;
pub const DNS_PORT: u16 = 53;
pub const DNS_NODE_PORT: u16 = 30053;

/// Address of node `i` (1-based).
pub fn node(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, 0, 10 + i)
}

pub const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, 1);
pub const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x10);

/// Node `i`'s IPv6 address.
pub fn node6(i: u8) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x10 + i as u16)
}

/// Which entry point a test drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    Xdp,
    Tc,
}

/// A program's decision, hook-independent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Drop,
    Tx,
    /// XDP's redirect to another interface (TC's redirect is one action for both: `Tx`).
    Redirect,
    Other(u32),
}

/// The address family a test runs in: its addresses, and its key type in the maps. The rules are written once
/// over the family, so most packet tests run in both ([`both_families!`]).
pub trait Fam: 'static {
    /// The key and entry type of the family's connection-tracking maps.
    type A: FamilyMaps;
    /// The virtual IP.
    fn vip() -> IpAddr;
    /// The client.
    fn client() -> IpAddr;
    /// Node `i` (1-based).
    fn node(i: u8) -> IpAddr;
    /// The `i`-th of many other clients (floods, spoofed sources), outside every range the tests configure.
    fn source(i: u32) -> IpAddr;
    /// A configured SNAT address (in the nodes' network).
    fn snat() -> IpAddr;
    /// A flow event of the family as flow sync carries it.
    fn sync_event(e: FlowEvent<Self::A>) -> SyncEvent;
}

/// IPv4: [`VIP`], [`CLIENT`], [`node`].
pub struct V4;
/// IPv6: [`VIP6`], [`CLIENT6`], [`node6`]; the harness loads the IPv6 programs into their slots.
pub struct V6;

impl Fam for V4 {
    type A = u32;
    fn vip() -> IpAddr {
        VIP.into()
    }
    fn client() -> IpAddr {
        CLIENT.into()
    }
    fn node(i: u8) -> IpAddr {
        node(i).into()
    }
    fn source(i: u32) -> IpAddr {
        Ipv4Addr::from(0x0a80_0000 + i).into()
    }
    fn snat() -> IpAddr {
        Ipv4Addr::new(10, 0, 0, 5).into()
    }
    fn sync_event(e: FlowEvent<u32>) -> SyncEvent {
        e.into()
    }
}

impl Fam for V6 {
    type A = In6;
    fn vip() -> IpAddr {
        VIP6.into()
    }
    fn client() -> IpAddr {
        CLIENT6.into()
    }
    fn node(i: u8) -> IpAddr {
        node6(i).into()
    }
    fn source(i: u32) -> IpAddr {
        Ipv6Addr::from(0x2001_0db8_0a80_0000_0000_0000_0000_0000u128 + i as u128).into()
    }
    fn snat() -> IpAddr {
        Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 5).into()
    }
    fn sync_event(e: FlowEvent<In6>) -> SyncEvent {
        e.into()
    }
}

/// A loaded data plane plus the programmer that fills it; `F` is the family its tests send (an IPv4 harness
/// can still be given the IPv6 programs: [`Harness::with_ipv6`]).
pub struct Harness<F: Fam = V4> {
    pub dp: Dataplane,
    pub programmer: Programmer,
    pub hook: Hook,
    family: PhantomData<F>,
}

/// Small maps: tests load many objects in parallel. The connection tables' LRU lists are per CPU (as built), each
/// CPU's share an even part: sized so that one CPU's share (8192 entries) holds what a test makes from one thread.
pub fn test_sizes() -> MapSizes {
    let flows = 8192 * lb_agent::dataplane::nic::possible_cpus();
    MapSizes {
        connection_lru: ConnectionLru::PerCpu,
        flows,
        transient: 1024,
        flows_v6: flows,
        transient_v6: 1024,
        services: 64,
        backends: 256,
        maglev_slots: 1 << 16,
        nexthops: 64,
        source_ranges: 256,
        trusted_sources: 256,
    }
}

impl Harness<V4> {
    /// Loads the data plane with next hops for nodes 1..=4, for IPv4 tests.
    pub fn new(hook: Hook) -> Self {
        Self::open(hook)
    }
}

impl<F: Fam> Harness<F> {
    /// Loads the data plane with next hops for nodes 1..=4, for tests of family `F` (for IPv6 with the IPv6
    /// programs in their slots).
    pub fn open(hook: Hook) -> Self {
        Self::open_in(hook, None)
    }

    /// As [`Self::open`], with the maps pinned under `pin_dir` (on a bpffs), re-used if pinned there already.
    pub fn open_in(hook: Hook, pin_dir: Option<&std::path::Path>) -> Self {
        let sizes = test_sizes();
        let mut dp =
            Dataplane::load(&sizes, pin_dir).expect("loading the data plane (root needed)");
        // Only the hook under test's program: verifying the other one too took a second of every test.
        match hook {
            Hook::Xdp => dp
                .xdp_program(XDP_PROGRAM)
                .map(drop)
                .expect("XDP program loads"),
            Hook::Tc => dp.tc_program().map(drop).expect("TC program loads"),
        }
        for i in 1..=4 {
            dp.maps
                .nexthops
                .insert(
                    &ip_to_addr(IpAddr::V4(node(i))),
                    &NextHop {
                        mac: node_mac(i),
                        egress: 0,
                        _pad: 0,
                        ifindex: 0,
                    },
                )
                .unwrap();
        }
        let programmer = Programmer::new(sizes.services, sizes.backends, sizes.maglev_slots);
        let h = Harness {
            dp,
            programmer,
            hook,
            family: PhantomData,
        };
        if F::A::FAMILY == lb_common::FAMILY_V6 {
            h.with_ipv6()
        } else {
            h
        }
    }

    /// Puts the IPv6 programs of the harness's hook into their tail-call slots (verifying them takes about a
    /// second: only the tests that send IPv6 ask for it) and gives the IPv6 nodes ([`node6`]) their next hops.
    /// Panics when the object has no IPv6 programs.
    pub fn with_ipv6(mut self) -> Self {
        assert!(
            self.dp
                .load_ipv6_programs(self.hook == Hook::Xdp, false)
                .expect("IPv6 programs load"),
            "the eBPF object has no IPv6 programs"
        );
        for i in 1..=4 {
            self.dp
                .maps
                .nexthops
                .insert(
                    &ip_to_addr(IpAddr::V6(node6(i))),
                    &NextHop {
                        mac: node_mac(i),
                        egress: 0,
                        _pad: 0,
                        ifindex: 0,
                    },
                )
                .unwrap();
        }
        self
    }

    /// The family's virtual IP.
    pub fn vip(&self) -> IpAddr {
        F::vip()
    }

    /// The family's client.
    pub fn client(&self) -> IpAddr {
        F::client()
    }

    /// The family's node `i`.
    pub fn node(&self, i: u8) -> IpAddr {
        F::node(i)
    }

    /// An address of the family as the maps hold it.
    pub fn raw(&self, ip: IpAddr) -> F::A {
        F::A::from_addr(ip_to_addr(ip))
    }

    /// The forward flow key of a client connection (client → VIP).
    pub fn key(&self, sport: u16, proto: u8, dport: u16) -> FlowKey<F::A> {
        FlowKey {
            src: self.raw(F::client()),
            dst: self.raw(F::vip()),
            sport: sport.to_be(),
            dport: dport.to_be(),
            proto,
            _pad: [0; 3],
        }
    }

    /// The family's established connections and UDP flows.
    pub fn flows(&self) -> &Table<FlowKey<F::A>, Flow<F::A>> {
        F::A::flows(&self.dp.maps)
    }

    /// The family's handshakes and closed connections.
    pub fn transient(&self) -> &Table<FlowKey<F::A>, Transient<F::A>> {
        F::A::transient(&self.dp.maps)
    }

    /// As [`Harness::transient`], to write.
    pub fn transient_mut(&mut self) -> &mut Table<FlowKey<F::A>, Transient<F::A>> {
        F::A::transient_mut(&mut self.dp.maps)
    }

    /// The TCP web service VIP:80 → nodes:30080.
    pub fn web(&self, nodes: &[u8]) -> ServiceSpec {
        self.spec(Protocol::Tcp, WEB_PORT, WEB_NODE_PORT, nodes)
    }

    /// The UDP DNS service VIP:53 → nodes:30053.
    pub fn dns(&self, nodes: &[u8]) -> ServiceSpec {
        self.spec(Protocol::Udp, DNS_PORT, DNS_NODE_PORT, nodes)
    }

    /// A service on the family's VIP.
    pub fn spec(&self, protocol: Protocol, port: u16, node_port: u16, nodes: &[u8]) -> ServiceSpec {
        spec_on(F::vip(), protocol, port, node_port, nodes)
    }

    /// A client → VIP TCP frame.
    pub fn client_tcp(&self, sport: u16, flags: Flags, payload: &[u8]) -> Vec<u8> {
        tcp(
            CLIENT_MAC,
            LB_MAC,
            F::client(),
            sport,
            F::vip(),
            WEB_PORT,
            flags,
            payload,
        )
    }

    /// A client → VIP UDP frame.
    pub fn client_udp(&self, sport: u16, payload: &[u8]) -> Vec<u8> {
        udp(
            CLIENT_MAC,
            LB_MAC,
            F::client(),
            sport,
            F::vip(),
            DNS_PORT,
            payload,
        )
    }

    /// Programs the services.
    pub fn apply(&mut self, specs: &[ServiceSpec]) {
        self.programmer
            .apply(&mut self.dp.maps, specs)
            .expect("apply");
    }

    /// Runs one frame through the hook under test; returns the verdict and the frame afterwards.
    pub fn run(&mut self, frame: &[u8]) -> (Verdict, Vec<u8>) {
        self.try_run(frame).expect("test run")
    }

    /// Like [`Self::run`], but returns the kernel's error (e.g. for frames it refuses to run).
    pub fn try_run(&mut self, frame: &[u8]) -> anyhow::Result<(Verdict, Vec<u8>)> {
        let mut out = vec![0u8; frame.len() + 512];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.data_out = Some(&mut out);
        let (ret, size) = match self.hook {
            Hook::Xdp => {
                let r = self.dp.xdp_program(XDP_PROGRAM)?.test_run(opts)?;
                (r.return_value, r.data_size_out)
            }
            Hook::Tc => {
                let r = self.dp.tc_program()?.test_run(opts)?;
                (r.return_value, r.data_size_out)
            }
        };
        let v = match (self.hook, ret) {
            (Hook::Xdp, 1) | (Hook::Tc, 2) => Verdict::Drop,
            (Hook::Xdp, 2) | (Hook::Tc, 0) => Verdict::Pass,
            (Hook::Xdp, 3) | (Hook::Tc, 7) => Verdict::Tx,
            (Hook::Xdp, 4) => Verdict::Redirect,
            (_, n) => Verdict::Other(n),
        };
        out.truncate(size as usize);
        Ok((v, out))
    }

    /// Runs each named malformed frame and asserts it is dropped; returns how many ran (the skb test runner
    /// itself refuses some frames the XDP one accepts: those are reported and not counted).
    pub fn run_malformed(&mut self, cases: &[(&str, Vec<u8>)]) -> u64 {
        let mut ran = 0;
        for (name, f) in cases {
            match self.try_run(f) {
                Ok((v, _)) => {
                    assert_eq!(v, Verdict::Drop, "{name}");
                    ran += 1;
                }
                Err(e) if self.hook == Hook::Tc => {
                    eprintln!("{name}: refused by the kernel's skb test runner: {e}");
                }
                Err(e) => panic!("{name}: {e}"),
            }
        }
        ran
    }

    /// Global counter `idx` (see `lb_common::stat`).
    pub fn stat(&mut self, idx: u32) -> u64 {
        self.dp.maps.stats.totals().unwrap()[idx as usize]
    }

    /// Counters of a service.
    pub fn svc_stats(&mut self, id: &ServiceId) -> lb_common::ServiceStats {
        let idx = self
            .programmer
            .service_index(id)
            .expect("service programmed");
        self.dp.maps.service_stats.total(idx).unwrap()
    }
}

/// The TCP web service VIP:80 → nodes:30080.
pub fn web(nodes: &[u8]) -> ServiceSpec {
    spec(Protocol::Tcp, WEB_PORT, WEB_NODE_PORT, nodes)
}

/// The UDP DNS service VIP:53 → nodes:30053.
pub fn dns(nodes: &[u8]) -> ServiceSpec {
    spec(Protocol::Udp, DNS_PORT, DNS_NODE_PORT, nodes)
}

/// A service on the VIP.
pub fn spec(protocol: Protocol, port: u16, node_port: u16, nodes: &[u8]) -> ServiceSpec {
    spec_on(IpAddr::V4(VIP), protocol, port, node_port, nodes)
}

/// A service on `vip`, to the nodes' addresses of its family.
pub fn spec_on(
    vip: IpAddr,
    protocol: Protocol,
    port: u16,
    node_port: u16,
    nodes: &[u8],
) -> ServiceSpec {
    let node_addr = |i: u8| match vip {
        IpAddr::V4(_) => IpAddr::V4(node(i)),
        IpAddr::V6(_) => IpAddr::V6(node6(i)),
    };
    ServiceSpec {
        id: ServiceId {
            vip,
            port,
            protocol,
        },
        snat: None,
        idle_timeout: protocol.default_idle_timeout(),
        source_ranges: vec![],
        backends: nodes
            .iter()
            .map(|i| SocketAddr::new(node_addr(*i), node_port))
            .collect(),
        proxy_v2: false,
    }
}

/// A client → VIP TCP frame.
pub fn client_tcp(sport: u16, flags: Flags, payload: &[u8]) -> Vec<u8> {
    tcp(
        CLIENT_MAC, LB_MAC, CLIENT, sport, VIP, WEB_PORT, flags, payload,
    )
}

/// A client → VIP UDP frame.
pub fn client_udp(sport: u16, payload: &[u8]) -> Vec<u8> {
    udp(CLIENT_MAC, LB_MAC, CLIENT, sport, VIP, DNS_PORT, payload)
}

/// Index (1-based) of the node an output frame goes to (IPv4 or IPv6).
pub fn node_index(p: &Parsed) -> u8 {
    match p.dst {
        IpAddr::V4(a) => {
            let o = a.octets();
            assert_eq!(&o[..3], &[10, 0, 0], "not sent to a node: {p:?}");
            o[3] - 10
        }
        IpAddr::V6(a) => {
            let s = a.segments();
            assert_eq!(
                &s[..7],
                &[0xfd00, 0, 0, 0, 0, 0, 0],
                "not sent to a node: {p:?}"
            );
            (s[7] - 0x10) as u8
        }
    }
}

/// Duration shorthand.
pub fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// Generates one test per hook from a body that takes an IPv4 harness (`ipv6:` first: an IPv6 one).
#[macro_export]
macro_rules! both_hooks {
    (ipv6: $($rest:tt)*) => {
        both_hooks!(@family V6; $($rest)*);
    };
    (@family $fam:ident; $( $(#[$m:meta])* fn $name:ident($h:ident) $body:block )*) => {
        $(
            mod $name {
                #[allow(unused_imports)]
                use super::*;
                $(#[$m])*
                fn body($h: &mut Harness<$fam>) $body
                #[test]
                fn xdp() {
                    body(&mut Harness::<$fam>::open(Hook::Xdp))
                }
                #[test]
                fn tc() {
                    body(&mut Harness::<$fam>::open(Hook::Tc))
                }
            }
        )*
    };
    ($($rest:tt)*) => {
        both_hooks!(@family V4; $($rest)*);
    };
}

/// Generates four tests from a body generic over the family (`F: Fam`): IPv4 and IPv6, each through the XDP
/// and the TC entry point.
#[macro_export]
macro_rules! both_families {
    ($( $(#[$m:meta])* fn $name:ident($h:ident) $body:block )*) => {
        $(
            mod $name {
                #[allow(unused_imports)]
                use super::*;
                $(#[$m])*
                fn body<F: Fam>($h: &mut Harness<F>) $body
                #[test]
                fn v4_xdp() {
                    body(&mut Harness::<V4>::open(Hook::Xdp))
                }
                #[test]
                fn v4_tc() {
                    body(&mut Harness::<V4>::open(Hook::Tc))
                }
                #[test]
                fn v6_xdp() {
                    body(&mut Harness::<V6>::open(Hook::Xdp))
                }
                #[test]
                fn v6_tc() {
                    body(&mut Harness::<V6>::open(Hook::Tc))
                }
            }
        )*
    };
}

/// Generates an IPv4 and an IPv6 test from a body generic over the family (`F: Fam`) that makes its own
/// harnesses (several replicas, one hook).
#[macro_export]
macro_rules! per_family {
    ($( $(#[$m:meta])* fn $name:ident() $body:block )*) => {
        $(
            mod $name {
                #[allow(unused_imports)]
                use super::*;
                $(#[$m])*
                fn body<F: Fam>() $body
                #[test]
                fn v4() {
                    body::<V4>()
                }
                #[test]
                fn v6() {
                    body::<V6>()
                }
            }
        )*
    };
}
