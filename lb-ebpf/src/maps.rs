//! The data plane's maps. Names, key and value types are the contract with user space (`lb_common`).
//! Capacities here are defaults; the agent sets the real ones at load time.

use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_F_NO_COMMON_LRU},
    macros::map,
    maps::{
        lpm_trie::LpmTrie, Array, DevMap, HashMap, LruHashMap, PerCpuArray, ProgramArray, RingBuf,
    },
};
use lb_common::{
    defaults, Addr, Backend, Config, Egress, FlowKeyV4, FlowKeyV6, FlowV4, FlowV6, NextHop,
    Service, ServiceKey, ServiceStats, SourceRangeKey, TransientV4, TransientV6,
};

/// (VIP, port, protocol) → service.
#[map]
pub static SERVICES: HashMap<ServiceKey, Service> =
    HashMap::with_max_entries(defaults::MAX_SERVICES, 0);

/// Backend id → node address and NodePort.
#[map]
pub static BACKENDS: Array<Backend> = Array::with_max_entries(defaults::MAX_BACKENDS, 0);

/// Maglev tables of all services (backend ids), each service owning a slice. Memory-mappable so user space
/// writes a whole table with one copy instead of one syscall per slot.
#[map]
pub static MAGLEV: Array<u32> = Array::with_max_entries(defaults::MAGLEV_SLOTS, BPF_F_MMAPABLE);

/// Backend address → next-hop MAC, kept resolved by user space.
#[map]
pub static NEXTHOPS: HashMap<Addr, NextHop> = HashMap::with_max_entries(defaults::MAX_NEXTHOPS, 0);

/// The interfaces a translated frame may leave by other than the one it came in on, by slot (`Flow::egress`,
/// `NextHop::egress`); slot 0 stays empty.
#[map]
pub static EGRESS: Array<Egress> = Array::with_max_entries(lb_common::MAX_INTERFACES, 0);

/// `EGRESS`'s interfaces for `XDP_REDIRECT` (same slots).
#[map]
pub static EGRESS_DEVMAP: DevMap = DevMap::with_max_entries(lb_common::MAX_INTERFACES, 0);

/// Interface index → its `EGRESS` slot: where the replies of a flow that came in on it leave.
#[map]
pub static INTERFACES: HashMap<u32, u32> = HashMap::with_max_entries(lb_common::MAX_INTERFACES, 0);

/// (service id, client prefix) → allowed.
#[map]
pub static SOURCE_RANGES: LpmTrie<SourceRangeKey, u8> =
    LpmTrie::with_max_entries(defaults::MAX_SOURCE_RANGES, 0);

/// Addresses that carry services (for the fragment policy).
#[map]
pub static VIPS: HashMap<Addr, u32> = HashMap::with_max_entries(defaults::MAX_SERVICES, 0);

/// IPv4 connection tracking, both directions of every flow. One hash table for all CPUs (the reply of a full-NAT
/// flow usually arrives on another CPU than the request); its LRU lists are per CPU, as built here — both entries
/// of a flow are made on its client's CPU — unless the agent clears the flag before load because the NICs' receive
/// queues do not cover the CPUs (docs/design.md, "Several CPUs").
#[map]
pub static FLOWS_V4: LruHashMap<FlowKeyV4, FlowV4> =
    LruHashMap::with_max_entries(defaults::MAX_FLOWS, BPF_F_NO_COMMON_LRU);

/// TCP handshakes in progress and closed connections, both directions (see `lb_common::TransientV4`): a small
/// LRU of their own, so SYN floods and the churn of short connections never evict an established connection
/// from `FLOWS_V4`. Its LRU lists are per CPU: every new flow inserts here, on its client's CPU, and common lists
/// would serialise those inserts under one lock (docs/design.md, "Several CPUs").
#[map]
pub static TRANSIENT_V4: LruHashMap<FlowKeyV4, TransientV4> =
    LruHashMap::with_max_entries(defaults::MAX_TRANSIENT, BPF_F_NO_COMMON_LRU);

/// IPv6 connection tracking: `FLOWS_V4`'s rules with IPv6 keys.
#[map]
pub static FLOWS_V6: LruHashMap<FlowKeyV6, FlowV6> =
    LruHashMap::with_max_entries(defaults::MAX_FLOWS_V6, BPF_F_NO_COMMON_LRU);

/// IPv6 handshakes and closed connections: `TRANSIENT_V4`'s rules with IPv6 keys.
#[map]
pub static TRANSIENT_V6: LruHashMap<FlowKeyV6, TransientV6> =
    LruHashMap::with_max_entries(defaults::MAX_TRANSIENT_V6, BPF_F_NO_COMMON_LRU);

/// Which TCP keys `FLOWS_V4` may hold (see `lb_common::flow_filter`): two generations of bits and the active
/// generation's number. Memory-mappable so the agent marks and rebuilds it without a syscall per word.
#[map]
pub static FLOW_FILTER: Array<u64> =
    Array::with_max_entries(lb_common::flow_filter::ENTRIES, BPF_F_MMAPABLE);

/// Where a client's handshake is: its reverse key in `TRANSIENT_V4`, by a hash of the client's key (see
/// `lb_common::handshakes`).
#[map]
pub static HANDSHAKES: Array<FlowKeyV4> =
    Array::with_max_entries(lb_common::handshakes::ENTRIES, 0);

/// IPv6's `HANDSHAKES`.
#[map]
pub static HANDSHAKES_V6: Array<FlowKeyV6> =
    Array::with_max_entries(lb_common::handshakes::ENTRIES_V6, 0);

/// Sources that completed a TCP handshake: the SYN rate guard lets them through (see `syn_guard`).
#[map]
pub static TRUSTED_SOURCES: LruHashMap<Addr, u8> =
    LruHashMap::with_max_entries(defaults::MAX_TRUSTED_SOURCES, 0);

/// The SYN rate guard's per-CPU state: the theoretical arrival time of the next SYN, ns.
#[map]
pub static SYN_GUARD: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Per-CPU scratch space for transient entries under construction: the BPF stack (512 bytes) cannot hold them
/// next to everything else on the new-flow path. Slot 0: a handshake, or a closed connection's reverse entry; slot
/// 1: a closed connection's forward entry; slot 2: the SNAT port search's candidate key.
#[map]
pub static SCRATCH: PerCpuArray<TransientV4> = PerCpuArray::with_max_entries(3, 0);

/// IPv6's `SCRATCH`, and slot 3: a new flow's target (`ipv6::new_flow6`).
#[map]
pub static SCRATCH_V6: PerCpuArray<TransientV6> = PerCpuArray::with_max_entries(4, 0);

/// The IPv6 XDP programs (`lb_common::V6_PROG_*`), reached by tail call from the IPv4 entry points (one
/// program for both families would exceed the verifier's budget), and their new-flow programs, reached by tail
/// call from them (the IPv6 new-flow path needs a stack of its own).
#[map]
pub static V6_PROGS_XDP: ProgramArray = ProgramArray::with_max_entries(lb_common::V6_PROGS, 0);

/// The IPv6 TC programs, as `V6_PROGS_XDP`.
#[map]
pub static V6_PROGS_TC: ProgramArray = ProgramArray::with_max_entries(lb_common::V6_PROGS, 0);

/// What the IPv6 program hands its new-flow program (`ipv6::new_flow6`): where the packet's L4 header is and
/// whether a previous connection on the client's port is to be released. Per CPU: the tail call runs on the same
/// CPU, right after.
#[map]
pub static NEW_FLOW_HANDOFF: PerCpuArray<NewFlowHandoff> = PerCpuArray::with_max_entries(1, 0);

/// See [`NEW_FLOW_HANDOFF`].
#[derive(Clone, Copy)]
#[repr(C)]
pub struct NewFlowHandoff {
    /// Offset of the TCP or UDP header in the frame.
    pub l4_off: u16,
    /// IPv6 total length (fixed header + payload).
    pub tot: u16,
    /// `PROTO_TCP` or `PROTO_UDP`.
    pub proto: u8,
    /// The packet's flow entry is a finished connection on the client's port, released by the new one.
    pub reopen: u8,
    pub _pad: [u8; 2],
}

/// Per-service counters.
#[map]
pub static SERVICE_STATS: PerCpuArray<ServiceStats> =
    PerCpuArray::with_max_entries(defaults::MAX_SERVICES, 0);

/// Global counters, indices in `lb_common::stat`.
#[map]
pub static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(lb_common::stat::COUNT, 0);

/// New and closing flows for the agent's connection-state sync (`CFG_F_SYNC_EVENTS`); 2 MiB ≈ 17k events.
#[map]
pub static FLOW_EVENTS: RingBuf = RingBuf::with_byte_size(1 << 21, 0);

/// IPv6's `FLOW_EVENTS` (records of another size: a ring of their own); 2 MiB ≈ 10k events.
#[map]
pub static FLOW_EVENTS_V6: RingBuf = RingBuf::with_byte_size(1 << 21, 0);

/// Global settings.
#[map]
pub static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

/// Adds one to a global counter.
#[inline(always)]
pub fn count(idx: u32) {
    if let Some(p) = STATS.get_ptr_mut(idx) {
        // SAFETY: per-CPU slot of this CPU; nothing else writes it concurrently.
        unsafe { *p += 1 };
    }
}

/// Runs `f` on this CPU's counters of service `id`.
#[inline(always)]
pub fn with_service_stats(id: u32, f: impl FnOnce(&mut ServiceStats)) {
    if let Some(p) = SERVICE_STATS.get_ptr_mut(id) {
        // SAFETY: per-CPU slot of this CPU.
        f(unsafe { &mut *p });
    }
}
