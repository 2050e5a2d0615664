//! The data plane's maps, each declared once (name, key and value types) in [`Maps`] and opened once: from the
//! loaded object or from the pins of a running agent.
//!
//! The handles are aya's typed maps behind thin wrappers, one per map kind ([`Table`], [`Slots`], [`Counters`],
//! [`SourceRanges`], [`Maglev`]). aya's types fit; the wrappers only drop the flags argument every call passes
//! as 0, name the map in errors (aya's say "key not found", not where), treat a missing key as `None` (reads)
//! or as done (deletes), and give the hash tables the batch operations aya 0.14 lacks ([`map_batch`]).

use super::flow_filter::FlowFilterMap;
use super::map_batch;
use super::mapped::MappedArray;
use anyhow::{anyhow, bail, Context, Result};
use aya::maps::{
    lpm_trie::{Key as LpmKey, LpmTrie},
    Array, DevMap, HashMap, IterableMap, Map, MapData, MapError, PerCpuArray, PerCpuValues,
    RingBuf,
};
use aya::Pod;
use lb_common::{
    map_names as names, Addr, Backend, Config, Egress, Flow, FlowAddr, FlowKey, FlowKeyV4,
    FlowKeyV6, FlowV4, FlowV6, In6, NextHop, Service, ServiceKey, ServiceStats, SourceRangeKey,
    Transient, TransientV4, TransientV6,
};

/// A map opened from aya's untyped [`Map`], checked against the type it is declared with.
trait Open: Sized {
    fn open(name: &'static str, map: Map) -> Result<Self>;
}

/// Declares [`Maps`]: one line per map, its field, handle type and name in `lb_common::map_names`.
macro_rules! maps {
    ($($(#[doc = $doc:literal])* $field:ident: $ty:ty = $name:ident,)*) => {
        /// Every map the agent reads or writes, typed. All of them are pinned when the agent pins (they outlive
        /// it, and `lbctl` reads them); the flow-event ring buffer too, so that a traced program swapped in by
        /// `lbctl trace` publishes new flows to the same consumer.
        pub struct Maps {
            $($(#[doc = $doc])* pub $field: $ty,)*
        }

        impl Maps {
            /// The names of the maps, as in the object and under the pin directory.
            pub const NAMES: &'static [&'static str] = &[$(names::$name),*];

            /// Opens every map, getting each by name from `map`.
            pub(super) fn open(mut map: impl FnMut(&'static str) -> Result<Map>) -> Result<Self> {
                Ok(Maps {
                    $($field: Open::open(names::$name, map(names::$name)?)?,)*
                })
            }
        }
    };
}

maps! {
    /// Services by (VIP, port, protocol).
    services: Table<ServiceKey, Service> = SERVICES,
    /// Backend slots, referenced by the Maglev tables.
    backends: Slots<Backend> = BACKENDS,
    /// The arena of all services' Maglev tables.
    maglev: Maglev = MAGLEV,
    /// Next hops (MACs) of backend addresses.
    nexthops: Table<Addr, NextHop> = NEXTHOPS,
    /// The interfaces frames may leave by other than the one they came in on, by slot (see [`Maps::set_egress`]).
    egress: Slots<Egress> = EGRESS,
    /// `egress`'s interfaces for the XDP programs' redirects.
    egress_devmap: DevMap<MapData> = EGRESS_DEVMAP,
    /// Interface index → its `egress` slot.
    interfaces: Table<u32, u32> = INTERFACES,
    /// Allowed client prefixes per service.
    source_ranges: SourceRanges = SOURCE_RANGES,
    /// Every address that carries a service (fragment policy).
    vips: Table<Addr, u32> = VIPS,
    /// Established connections and UDP flows. Write entries through [`Maps::set_flow`], which marks them in the
    /// flow filter (the data plane skips lookups of unmarked TCP keys).
    flows: Table<FlowKeyV4, FlowV4> = FLOWS_V4,
    /// TCP handshakes and closed connections.
    transient: Table<FlowKeyV4, TransientV4> = TRANSIENT_V4,
    /// IPv6's `flows`.
    flows_v6: Table<FlowKeyV6, FlowV6> = FLOWS_V6,
    /// IPv6's `transient`.
    transient_v6: Table<FlowKeyV6, TransientV6> = TRANSIENT_V6,
    /// Sources that completed a TCP handshake (the SYN rate guard's allow list).
    trusted_sources: Table<Addr, u8> = TRUSTED_SOURCES,
    /// Which TCP keys `flows` may hold.
    flow_filter: FlowFilterMap = FLOW_FILTER,
    /// The reverse key of a client's handshake, by a hash of the client's key (see [`Maps::handshake`]).
    handshakes: Slots<FlowKeyV4> = HANDSHAKES,
    /// IPv6's `handshakes`.
    handshakes_v6: Slots<FlowKeyV6> = HANDSHAKES_V6,
    /// Counters per service id.
    service_stats: Counters<ServiceStats> = SERVICE_STATS,
    /// Global counters, indexed like `lb_common::stat`.
    stats: Counters<u64> = STATS,
    /// The global settings, at `lb_common::CONFIG_INDEX`.
    config: Slots<Config> = CONFIG,
    /// `lb_common::FlowEventV4`s for connection-state sync; one consumer takes it ([`Maps::take_flow_events`]).
    flow_events: Option<RingBuf<MapData>> = FLOW_EVENTS,
    /// `lb_common::FlowEventV6`s, as `flow_events`.
    flow_events_v6: Option<RingBuf<MapData>> = FLOW_EVENTS_V6,
}

/// One address family's connection-tracking maps (`u32`: IPv4, `In6`: IPv6), so that code written once over
/// `lb_common::FlowAddr` reaches its family's tables.
pub trait FamilyMaps: FlowAddr {
    /// `flows` or `flows_v6`.
    fn flows(m: &Maps) -> &Table<FlowKey<Self>, Flow<Self>>;
    /// As [`FamilyMaps::flows`], to write.
    fn flows_mut(m: &mut Maps) -> &mut Table<FlowKey<Self>, Flow<Self>>;
    /// `transient` or `transient_v6`.
    fn transient(m: &Maps) -> &Table<FlowKey<Self>, Transient<Self>>;
    /// As [`FamilyMaps::transient`], to write.
    fn transient_mut(m: &mut Maps) -> &mut Table<FlowKey<Self>, Transient<Self>>;
    /// `handshakes` or `handshakes_v6`.
    fn handshakes(m: &Maps) -> &Slots<FlowKey<Self>>;
    /// As [`FamilyMaps::handshakes`], to write.
    fn handshakes_mut(m: &mut Maps) -> &mut Slots<FlowKey<Self>>;
    /// `flow_events` or `flow_events_v6`, with the map's name.
    fn flow_events(m: &mut Maps) -> (&mut Option<RingBuf<MapData>>, &'static str);
}

macro_rules! family_maps {
    ($a:ty: $flows:ident, $transient:ident, $handshakes:ident, $events:ident = $events_name:ident) => {
        impl FamilyMaps for $a {
            fn flows(m: &Maps) -> &Table<FlowKey<Self>, Flow<Self>> {
                &m.$flows
            }
            fn flows_mut(m: &mut Maps) -> &mut Table<FlowKey<Self>, Flow<Self>> {
                &mut m.$flows
            }
            fn transient(m: &Maps) -> &Table<FlowKey<Self>, Transient<Self>> {
                &m.$transient
            }
            fn transient_mut(m: &mut Maps) -> &mut Table<FlowKey<Self>, Transient<Self>> {
                &mut m.$transient
            }
            fn handshakes(m: &Maps) -> &Slots<FlowKey<Self>> {
                &m.$handshakes
            }
            fn handshakes_mut(m: &mut Maps) -> &mut Slots<FlowKey<Self>> {
                &mut m.$handshakes
            }
            fn flow_events(m: &mut Maps) -> (&mut Option<RingBuf<MapData>>, &'static str) {
                (&mut m.$events, names::$events_name)
            }
        }
    };
}

family_maps!(u32: flows, transient, handshakes, flow_events = FLOW_EVENTS);
family_maps!(In6: flows_v6, transient_v6, handshakes_v6, flow_events_v6 = FLOW_EVENTS_V6);

impl Maps {
    /// Puts interface `ifindex` with MAC `mac` into egress slot `slot` (1..`lb_common::MAX_INTERFACES`): the
    /// device map first, then the MAC, then the index, so that a program that finds the slot's entry finds all
    /// of it.
    pub fn set_egress(&mut self, slot: u32, ifindex: u32, mac: [u8; 6]) -> Result<()> {
        if slot == 0 || slot >= lb_common::MAX_INTERFACES {
            bail!(
                "egress slot {slot} out of range (1..{})",
                lb_common::MAX_INTERFACES
            );
        }
        self.egress_devmap
            .set(slot, ifindex, None, 0)
            .with_context(|| format!("{}[{slot}] = interface {ifindex}", names::EGRESS_DEVMAP))?;
        self.egress.set(
            slot,
            &Egress {
                ifindex,
                mac,
                _pad: 0,
            },
        )?;
        self.interfaces.insert(&ifindex, &slot)
    }

    /// Writes a flow entry of either family (tests, next-hop changes), marked in the flow filter.
    pub fn set_flow<A: FamilyMaps>(&mut self, key: &FlowKey<A>, v: &Flow<A>) -> Result<()> {
        A::flows_mut(self).insert(key, v)?;
        self.flow_filter.mark(key);
        Ok(())
    }

    /// Writes many flow entries of either family as [`Self::set_flow`] does one, spread over the CPUs
    /// ([`Table::insert_spread`]).
    pub fn set_flows<A: FamilyMaps>(&mut self, entries: &[(FlowKey<A>, Flow<A>)]) -> Result<()> {
        A::flows_mut(self).insert_spread(entries)?;
        for (k, _) in entries {
            self.flow_filter.mark(k);
        }
        Ok(())
    }

    /// The handshake in progress of a client's key (client → VIP): its reverse key and its entry in the
    /// family's transient table, found the way the data plane finds it (see `lb_common::handshakes`).
    pub fn handshake<A: FamilyMaps>(
        &self,
        key: &FlowKey<A>,
    ) -> Result<Option<(FlowKey<A>, Transient<A>)>> {
        let rkey = A::handshakes(self).get(lb_common::handshakes::slot(key))?;
        Ok(A::transient(self)
            .get(&rkey)?
            .filter(|t| t.handshake_of(key))
            .map(|t| (rkey, t)))
    }

    /// Takes a family's flow-event ring buffer (`FlowEvent<A>`s); it has one consumer, so this succeeds once.
    pub fn take_flow_events<A: FamilyMaps>(&mut self) -> Result<RingBuf<MapData>> {
        let (ring, name) = A::flow_events(self);
        ring.take()
            .ok_or_else(|| anyhow!("map {name} already taken"))
    }
}

/// A hash or LRU hash map (aya's `HashMap` opens both).
pub struct Table<K, V> {
    name: &'static str,
    map: HashMap<MapData, K, V>,
    /// An LRU map with a list per CPU (`BPF_F_NO_COMMON_LRU`), as the kernel reports it.
    per_cpu_lru: bool,
}

impl<K: Pod, V: Pod> Open for Table<K, V> {
    fn open(name: &'static str, map: Map) -> Result<Self> {
        let map: HashMap<MapData, K, V> = typed(name, map)?;
        let flags = map
            .map()
            .info()
            .with_context(|| format!("reading the kernel's information on {name}"))?
            .map_flags();
        Ok(Table {
            name,
            map,
            per_cpu_lru: flags & super::map_defs::BPF_F_NO_COMMON_LRU != 0,
        })
    }
}

impl<K: Pod, V: Pod> Table<K, V> {
    /// The entry of `key`, if any.
    pub fn get(&self, key: &K) -> Result<Option<V>> {
        match self.map.get(key, 0) {
            Ok(v) => Ok(Some(v)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading an entry of {}", self.name)),
        }
    }

    /// Inserts or replaces the entry of `key` (atomic for packets).
    pub fn insert(&mut self, key: &K, value: &V) -> Result<()> {
        self.map
            .insert(key, value, 0)
            .with_context(|| format!("writing an entry of {} (map full?)", self.name))
    }

    /// Deletes the entry of `key`; a missing one is not an error.
    pub fn remove(&mut self, key: &K) -> Result<()> {
        missing_ok(self.map.remove(key))
            .with_context(|| format!("deleting an entry of {}", self.name))
    }

    /// A snapshot of every entry, read in batches (a few syscalls for the whole table).
    pub fn entries(&self) -> Result<Vec<(K, V)>> {
        map_batch::entries(&self.map).with_context(|| format!("reading {}", self.name))
    }

    /// Every key.
    pub fn keys(&self) -> Result<Vec<K>> {
        Ok(self.entries()?.into_iter().map(|(k, _)| k).collect())
    }

    /// Writes `entries` in order (a later entry of the same key wins), in batches.
    pub fn insert_many(&mut self, entries: &[(K, V)]) -> Result<()> {
        map_batch::update(&mut self.map, entries)
            .with_context(|| format!("writing entries of {}", self.name))
    }

    /// Deletes `keys` in batches; missing ones are skipped. Returns how many were deleted.
    pub fn remove_many(&mut self, keys: &[K]) -> Result<usize> {
        map_batch::delete(&mut self.map, keys)
            .with_context(|| format!("deleting entries of {}", self.name))
    }

    /// A second, independent handle on the same map, for a task that must not borrow the data plane (the sync
    /// receiver writes flows while the main loop owns the maps).
    pub fn reopen(&self) -> Result<Self> {
        let data = reopen(self.name, self.map.map())?;
        Self::open(self.name, Map::from_map_data(data)?)
    }

    /// Whether this is an LRU table with a list per CPU.
    pub fn per_cpu_lru(&self) -> bool {
        self.per_cpu_lru
    }

    /// Writes `entries` (as [`Self::insert_many`]) so that a table with per-CPU LRU lists keeps them spread over
    /// the CPUs. Each CPU's list covers an even share of such a table, and a write from user space — a new entry or
    /// a replaced one — takes its element from the writing CPU's share: written from one CPU, more than that share
    /// would evict one another, and that CPU's connections with them. Large batches are written from one thread
    /// per CPU this process may run on, an even share each; small ones from the calling thread moved to the next
    /// CPU in turn. Other tables are written as they are.
    pub fn insert_spread(&mut self, entries: &[(K, V)]) -> Result<()>
    where
        K: Send + Sync,
        V: Send + Sync,
    {
        let cpus = crate::cpus::allowed();
        if !self.per_cpu_lru || cpus.len() < 2 || entries.is_empty() {
            return self.insert_many(entries);
        }
        if entries.len() < 256 {
            // Threads cost more than they spread here.
            static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let cpu = cpus[NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % cpus.len()];
            return crate::cpus::on_cpu(cpu, || self.insert_many(entries))?;
        }
        let share = entries.len().div_ceil(cpus.len());
        let this = &*self;
        std::thread::scope(|s| {
            let writers: Vec<_> = cpus
                .iter()
                .zip(entries.chunks(share))
                .map(|(&cpu, chunk)| {
                    s.spawn(move || -> Result<()> {
                        crate::cpus::pin_current_thread(cpu)?;
                        this.reopen()?.insert_many(chunk)
                    })
                })
                .collect();
            writers
                .into_iter()
                .try_for_each(|w| w.join().expect("a table writer panicked"))
        })
    }
}

/// An array map.
pub struct Slots<V: Pod> {
    name: &'static str,
    map: Array<MapData, V>,
}

impl<V: Pod> Open for Slots<V> {
    fn open(name: &'static str, map: Map) -> Result<Self> {
        Ok(Slots {
            name,
            map: typed(name, map)?,
        })
    }
}

impl<V: Pod> Slots<V> {
    /// Element `index`.
    pub fn get(&self, index: u32) -> Result<V> {
        self.map
            .get(&index, 0)
            .with_context(|| format!("reading {}[{index}]", self.name))
    }

    /// Writes element `index`.
    pub fn set(&mut self, index: u32, value: &V) -> Result<()> {
        self.map
            .set(index, value, 0)
            .with_context(|| format!("writing {}[{index}]", self.name))
    }

    /// Copies `other`'s elements that are not all zero (those this array starts with) into the same indices;
    /// returns how many. Indices beyond this array's length are left out.
    pub fn copy_from(&mut self, other: &Slots<V>) -> Result<usize> {
        let mut copied = 0;
        for i in 0..self.map.len().min(other.map.len()) {
            let v = other.get(i)?;
            // SAFETY: `V` is plain data of `size_of::<V>()` bytes.
            let bytes = unsafe {
                std::slice::from_raw_parts((&v as *const V).cast::<u8>(), std::mem::size_of::<V>())
            };
            if bytes.iter().any(|b| *b != 0) {
                self.set(i, &v)?;
                copied += 1;
            }
        }
        Ok(copied)
    }
}

/// Values that a per-CPU counter element adds up to.
pub trait CpuTotal: Pod + Default {
    /// Adds `other` (another CPU's value) to `self`.
    fn add(&mut self, other: &Self);
}

impl CpuTotal for u64 {
    fn add(&mut self, other: &Self) {
        *self += other;
    }
}

impl CpuTotal for ServiceStats {
    fn add(&mut self, s: &Self) {
        self.rx_packets += s.rx_packets;
        self.rx_bytes += s.rx_bytes;
        self.tx_packets += s.tx_packets;
        self.tx_bytes += s.tx_bytes;
        self.new_flows += s.new_flows;
        self.closed_flows += s.closed_flows;
        self.drop_source_range += s.drop_source_range;
        self.drop_no_backend += s.drop_no_backend;
        self.drop_snat_exhausted += s.drop_snat_exhausted;
        self.drop_no_flow += s.drop_no_flow;
        self.pass_no_nexthop += s.pass_no_nexthop;
        self.icmp_translated += s.icmp_translated;
        self.handshakes += s.handshakes;
        self.drop_handshake += s.drop_handshake;
        self.drop_syn_rate += s.drop_syn_rate;
        self.reset_backend_gone += s.reset_backend_gone;
    }
}

/// A per-CPU array of counters, read as totals over the CPUs.
pub struct Counters<V: Pod> {
    name: &'static str,
    map: PerCpuArray<MapData, V>,
}

impl<V: CpuTotal> Open for Counters<V> {
    fn open(name: &'static str, map: Map) -> Result<Self> {
        Ok(Counters {
            name,
            map: typed(name, map)?,
        })
    }
}

impl<V: CpuTotal> Counters<V> {
    /// Element `index` summed over CPUs.
    pub fn total(&self, index: u32) -> Result<V> {
        let per_cpu = self
            .map
            .get(&index, 0)
            .with_context(|| format!("reading {}[{index}]", self.name))?;
        let mut t = V::default();
        for v in per_cpu.iter() {
            t.add(v);
        }
        Ok(t)
    }

    /// Every element summed over CPUs.
    pub fn totals(&self) -> Result<Vec<V>> {
        (0..self.map.len()).map(|i| self.total(i)).collect()
    }

    /// Copies every CPU's value of every element of `other` (the same machine's CPUs) into this array.
    pub fn copy_from(&mut self, other: &Counters<V>) -> Result<()> {
        for i in 0..self.map.len().min(other.map.len()) {
            let values = other
                .map
                .get(&i, 0)
                .with_context(|| format!("reading {}[{i}]", other.name))?;
            self.map
                .set(i, values, 0)
                .with_context(|| format!("writing {}[{i}]", self.name))?;
        }
        Ok(())
    }

    /// Zeroes element `index` on every CPU (when a service id is given to a new service).
    pub fn reset(&mut self, index: u32) -> Result<()> {
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
        self.map
            .set(index, PerCpuValues::try_from(vec![V::default(); cpus])?, 0)
            .with_context(|| format!("zeroing {}[{index}]", self.name))
    }
}

/// The source-range trie: `addr/prefix_len` allowed for a service id (the id's bits lead the key).
pub struct SourceRanges {
    map: LpmTrie<MapData, SourceRangeKey, u8>,
}

impl Open for SourceRanges {
    fn open(name: &'static str, map: Map) -> Result<Self> {
        Ok(SourceRanges {
            map: typed(name, map)?,
        })
    }
}

impl SourceRanges {
    /// Allows `addr/prefix_len` for service `svc_id`.
    pub fn insert(&mut self, svc_id: u32, addr: Addr, prefix_len: u32) -> Result<()> {
        self.map
            .insert(&source_range_key(svc_id, addr, prefix_len), 1, 0)
            .context("writing a source range (source-range map full?)")
    }

    /// Removes `addr/prefix_len` for service `svc_id`; a missing one is not an error.
    pub fn remove(&mut self, svc_id: u32, addr: Addr, prefix_len: u32) -> Result<()> {
        missing_ok(self.map.remove(&source_range_key(svc_id, addr, prefix_len)))
            .context("removing a source range")
    }

    /// Copies every entry of `other` into this trie; returns how many.
    pub fn copy_from(&mut self, other: &SourceRanges) -> Result<usize> {
        let entries = other.entries();
        for (svc, addr, len) in &entries {
            self.insert(*svc, *addr, *len)?;
        }
        Ok(entries.len())
    }

    /// Every entry as (svc id, address, CIDR prefix length).
    pub fn entries(&self) -> Vec<(u32, Addr, u32)> {
        self.map
            .keys()
            .filter_map(|k| k.ok())
            .map(|k| {
                let d = k.data();
                (
                    u32::from_be(d.svc_id_be),
                    d.addr,
                    k.prefix_len() - lb_common::SOURCE_RANGE_ID_BITS,
                )
            })
            .collect()
    }
}

fn source_range_key(svc_id: u32, addr: Addr, prefix_len: u32) -> LpmKey<SourceRangeKey> {
    LpmKey::new(
        lb_common::SOURCE_RANGE_ID_BITS + prefix_len,
        SourceRangeKey {
            svc_id_be: svc_id.to_be(),
            addr,
        },
    )
}

/// The Maglev arena: an array of `u32` slots, written through a memory mapping when the kernel allows one (a
/// table is thousands of slots: one syscall each otherwise).
pub struct Maglev {
    slots: Slots<u32>,
    mapped: Option<MappedArray>,
}

impl Open for Maglev {
    fn open(name: &'static str, map: Map) -> Result<Self> {
        let slots = Slots::<u32>::open(name, map)?;
        let data = slots.map.map();
        let mapped = match data
            .info()
            .map_err(anyhow::Error::from)
            .and_then(|i| MappedArray::map(data, i.max_entries()))
        {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::warn!(error = %e, "Maglev tables will be written slot by slot (slower)");
                None
            }
        };
        Ok(Maglev { slots, mapped })
    }
}

impl Maglev {
    /// Writes a Maglev table into the arena at `offset`.
    pub fn write(&mut self, offset: u32, table: &[u32]) -> Result<()> {
        if let Some(m) = self.mapped.as_mut() {
            let range = offset as usize..offset as usize + table.len();
            let Some(dst) = m.slots_mut().get_mut(range) else {
                bail!(
                    "Maglev table [{offset}, +{}) is outside the arena",
                    table.len()
                );
            };
            for (d, id) in dst.iter_mut().zip(table) {
                // Little-endian host: the low half of the element is the u32 the program reads.
                *d = *id as u64;
            }
            // The service switch that makes packets use this slice is a later bpf() syscall, which orders
            // these stores before it.
            return Ok(());
        }
        for (i, id) in table.iter().enumerate() {
            self.slots.set(offset + i as u32, id)?;
        }
        Ok(())
    }

    /// Copies the whole of `other`'s arena (of the same length) into this one.
    pub fn copy_from(&mut self, other: &Maglev) -> Result<()> {
        let len = other.slots.map.len();
        if len != self.slots.map.len() {
            bail!(
                "the Maglev arenas differ in length ({len} and {} slots)",
                self.slots.map.len()
            );
        }
        self.write(0, &other.read(0, len)?)
    }

    /// Reads `len` arena slots from `offset`.
    pub fn read(&self, offset: u32, len: u32) -> Result<Vec<u32>> {
        if let Some(m) = &self.mapped {
            let range = offset as usize..offset as usize + len as usize;
            return m
                .slots()
                .get(range)
                .map(|s| s.iter().map(|v| *v as u32).collect())
                .with_context(|| format!("Maglev table [{offset}, +{len}) is outside the arena"));
        }
        (offset..offset + len).map(|i| self.slots.get(i)).collect()
    }
}

impl Open for DevMap<MapData> {
    fn open(name: &'static str, map: Map) -> Result<Self> {
        DevMap::try_from(map).with_context(|| format!("{name} is not a device map"))
    }
}

impl Open for FlowFilterMap {
    fn open(name: &'static str, map: Map) -> Result<Self> {
        match map {
            // Without the mapping the agent could not mark the entries it writes, and the data plane would skip
            // their lookups: no fallback, a clear error.
            Map::Array(data) => FlowFilterMap::open(data).context("mapping the flow filter"),
            _ => bail!("{name} is not an array"),
        }
    }
}

impl Open for Option<RingBuf<MapData>> {
    fn open(name: &'static str, map: Map) -> Result<Self> {
        Ok(Some(typed(name, map)?))
    }
}

/// `map` as the typed handle `T` (aya checks the map type and the key and value sizes).
fn typed<T: TryFrom<Map, Error = MapError>>(name: &str, map: Map) -> Result<T> {
    T::try_from(map).with_context(|| format!("opening map {name}"))
}

/// A delete's result, with a key that was not there counted as deleted.
fn missing_ok(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        r => r,
    }
}

/// A new handle on the map behind `data`, by its id.
pub(super) fn reopen(name: &str, data: &MapData) -> Result<MapData> {
    let id = data
        .info()
        .with_context(|| format!("map {name}: reading its id"))?
        .id();
    MapData::from_id(id).with_context(|| format!("map {name}: opening a second handle"))
}
