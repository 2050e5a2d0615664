//! Loading, attaching and reading/writing the eBPF data plane. Knows the maps, not the load-balancer model
//! (that is [`crate::dataplane::programmer`]).

pub mod arena;
pub mod flow_filter;
pub mod gc;
pub mod maglev;
pub mod map_batch;
mod mapped;
pub mod model;
pub mod neighbor;
pub mod programmer;

use mapped::MappedArray;

use crate::dataplane::flow_filter::FlowFilterMap;
use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{
        lpm_trie::{Key as LpmKey, LpmTrie},
        Array, HashMap, Map, MapData, PerCpuArray, PerCpuValues, RingBuf,
    },
    programs::{
        links::{FdLink, PinnedLink},
        tc::{self, SchedClassifier, TcAttachOptions, TcAttachType},
        LinkOrder, Xdp, XdpMode,
    },
    Ebpf, EbpfLoader,
};
use lb_common::{
    map_names as names, stat, Addr, Backend, Config, FlowKeyV4, FlowV4, NextHop, Service,
    ServiceKey, ServiceStats, SourceRangeKey, TransientV4, CONFIG_INDEX, LAYOUT_VERSION,
};
use std::path::{Path, PathBuf};

/// The data-plane object, built by `cargo xtask build-ebpf` and embedded by `build.rs`.
static LB_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb.o"));

/// XDP program name in the object.
pub const XDP_PROGRAM: &str = "lb_xdp";
/// TC program name in the object.
pub const TC_PROGRAM: &str = "lb_tc";
/// The programs with `lbctl trace`'s report (lb-ebpf's `trace`), swapped onto the link while a trace runs.
pub const XDP_TRACE_PROGRAM: &str = "lb_xdp_trace";
pub const TC_TRACE_PROGRAM: &str = "lb_tc_trace";

/// Capacities of the maps, set at load time.
#[derive(Clone, Debug)]
pub struct MapSizes {
    /// Connection-tracking entries (two per connection).
    pub flows: u32,
    /// Entries for TCP handshakes and closed connections (two per connection; `TRANSIENT_V4`).
    pub transient: u32,
    /// Services.
    pub services: u32,
    /// Backend slots.
    pub backends: u32,
    /// Maglev arena slots.
    pub maglev_slots: u32,
    /// Next-hop entries.
    pub nexthops: u32,
    /// Source-range prefixes.
    pub source_ranges: u32,
    /// Sources remembered as having completed a TCP handshake (the SYN rate guard's allow list).
    pub trusted_sources: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        use lb_common::defaults as d;
        MapSizes {
            flows: d::MAX_FLOWS,
            transient: d::MAX_TRANSIENT,
            services: d::MAX_SERVICES,
            backends: d::MAX_BACKENDS,
            maglev_slots: d::MAGLEV_SLOTS,
            nexthops: d::MAX_NEXTHOPS,
            source_ranges: d::MAX_SOURCE_RANGES,
            trusted_sources: d::MAX_TRUSTED_SOURCES,
        }
    }
}

/// How to attach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    /// Native XDP (driver mode), falling back to generic XDP with a warning.
    Xdp,
    /// Native XDP only.
    XdpNative,
    /// Generic (skb) XDP only.
    XdpGeneric,
    /// TC ingress through tcx: keeps GSO/GRO super-packets.
    Tc,
}

/// The loaded data plane — or only its maps, opened from their pins ([`Dataplane::open_pinned`]).
pub struct Dataplane {
    /// The loaded object; `None` when the maps were opened from their pins (no programs then).
    ebpf: Option<Ebpf>,
    /// The maps opened from their pins, by name (only without `ebpf`).
    pinned: std::collections::HashMap<&'static str, Map>,
    pin_dir: Option<PathBuf>,
    maglev: Option<MappedArray>,
    /// The flow filter, marked for every TCP entry written here (`None` when only the pins were opened).
    flow_filter: Option<FlowFilterMap>,
}

/// Every map the agent programs, with the capacity setter's name.
/// The maps pinned (they outlive the agent, and `lbctl` reads them). The flow-event ring buffer too, so that a
/// traced program swapped in by `lbctl trace` publishes new flows to the same consumer.
const MAPS: [&str; 15] = [
    names::SERVICES,
    names::BACKENDS,
    names::MAGLEV,
    names::NEXTHOPS,
    names::SOURCE_RANGES,
    names::VIPS,
    names::FLOWS_V4,
    names::TRANSIENT_V4,
    names::TRUSTED_SOURCES,
    names::FLOW_FILTER,
    names::HANDSHAKES,
    names::SERVICE_STATS,
    names::STATS,
    names::CONFIG,
    names::FLOW_EVENTS,
];

impl Dataplane {
    /// Loads the embedded data-plane object. With `pin_dir`, maps are pinned there (and re-used if already
    /// pinned), so a restarted or upgraded agent keeps the flows of established connections.
    pub fn load(sizes: &MapSizes, pin_dir: Option<&Path>) -> Result<Self> {
        if LB_OBJECT.is_empty() {
            bail!("the eBPF object was not built into this binary: run `cargo xtask build-ebpf`, then rebuild");
        }
        Self::load_object(LB_OBJECT, sizes, pin_dir)
    }

    /// Loads another object with the same maps (the benchmark wrappers).
    pub fn load_object(obj: &[u8], sizes: &MapSizes, pin_dir: Option<&Path>) -> Result<Self> {
        let pin_dir = pin_dir.map(|d| d.join(format!("v{LAYOUT_VERSION}")));
        if let Some(dir) = &pin_dir {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating the bpffs pin directory {}", dir.display()))?;
        }
        let mut loader = EbpfLoader::new();
        loader
            .map_max_entries(names::FLOWS_V4, sizes.flows)
            .map_max_entries(names::TRANSIENT_V4, sizes.transient)
            .map_max_entries(names::SERVICES, sizes.services)
            .map_max_entries(names::SERVICE_STATS, sizes.services)
            .map_max_entries(names::VIPS, sizes.services)
            .map_max_entries(names::BACKENDS, sizes.backends)
            .map_max_entries(names::MAGLEV, sizes.maglev_slots)
            .map_max_entries(names::NEXTHOPS, sizes.nexthops)
            .map_max_entries(names::SOURCE_RANGES, sizes.source_ranges)
            .map_max_entries(names::TRUSTED_SOURCES, sizes.trusted_sources);
        let pins: Vec<(&str, PathBuf)> = match &pin_dir {
            Some(dir) => MAPS.iter().map(|m| (*m, dir.join(m))).collect(),
            None => Vec::new(),
        };
        for (name, path) in &pins {
            loader.map_pin_path(name, path.as_path());
        }
        let ebpf = loader.load(obj).context(
            "loading the eBPF object (map creation or pinned-map reuse failed; a pinned map with another size \
             must be removed from bpffs first)",
        )?;
        let maglev = match ebpf.map(names::MAGLEV) {
            Some(aya::maps::Map::Array(data)) => match MappedArray::map(data, sizes.maglev_slots) {
                Ok(m) => Some(m),
                Err(e) => {
                    tracing::warn!(error = %e, "Maglev tables will be written slot by slot (slower)");
                    None
                }
            },
            _ => None,
        };
        // Without the mapping the agent could not mark the entries it writes, and the data plane would skip their
        // lookups: no fallback, a clear error.
        let flow_filter = match ebpf.map(names::FLOW_FILTER) {
            Some(aya::maps::Map::Array(data)) => {
                Some(FlowFilterMap::open(data).context("mapping the flow filter")?)
            }
            _ => bail!("the eBPF object has no {} array", names::FLOW_FILTER),
        };
        Ok(Dataplane {
            ebpf: Some(ebpf),
            pinned: Default::default(),
            pin_dir,
            maglev,
            flow_filter,
        })
    }

    /// Opens the maps an agent pinned under `pin_dir` (running or not), to read them (`lbctl`): nothing is
    /// loaded or created, and the data plane is not touched.
    pub fn open_pinned(pin_dir: &Path) -> Result<Self> {
        let dir = pin_dir.join(format!("v{LAYOUT_VERSION}"));
        let mut pinned = std::collections::HashMap::new();
        for name in MAPS {
            let path = dir.join(name);
            let data = MapData::from_pin(&path).with_context(|| {
                format!(
                    "opening the pinned map {} (does an agent pin here, with map layout v{LAYOUT_VERSION}?)",
                    path.display()
                )
            })?;
            pinned.insert(name, Map::from_map_data(data)?);
        }
        Ok(Dataplane {
            ebpf: None,
            pinned,
            pin_dir: Some(dir),
            maglev: None,
            flow_filter: None,
        })
    }

    /// The directory holding pinned maps and links, if pinning.
    pub fn pin_dir(&self) -> Option<&Path> {
        self.pin_dir.as_deref()
    }

    /// The loaded object, for programs and maps not wrapped here (tests and benchmarks).
    pub fn ebpf_mut(&mut self) -> Result<&mut Ebpf> {
        self.ebpf
            .as_mut()
            .ok_or_else(|| anyhow!("the maps were opened from their pins: no programs here"))
    }

    /// Loads (verifies) the XDP program and returns it.
    pub fn xdp_program(&mut self, name: &str) -> Result<&mut Xdp> {
        let prog: &mut Xdp = self
            .ebpf_mut()?
            .program_mut(name)
            .ok_or_else(|| anyhow!("program {name} not in the object"))?
            .try_into()?;
        if prog.fd().is_err() {
            prog.load().map_err(verifier_error)?;
        }
        Ok(prog)
    }

    /// Loads (verifies) the TC program and returns it.
    pub fn tc_program(&mut self) -> Result<&mut SchedClassifier> {
        self.tc_program_named(TC_PROGRAM)
    }

    /// Loads (verifies) TC program `name` and returns it.
    pub fn tc_program_named(&mut self, name: &str) -> Result<&mut SchedClassifier> {
        let prog: &mut SchedClassifier = self
            .ebpf_mut()?
            .program_mut(name)
            .ok_or_else(|| anyhow!("program {name} not in the object"))?
            .try_into()?;
        if prog.fd().is_err() {
            prog.load().map_err(verifier_error)?;
        }
        Ok(prog)
    }

    /// Attaches to `iface`. With a pin directory the link is pinned, and an existing pinned link is
    /// updated in place, which swaps the program atomically: no packet sees no program.
    /// Returns the mode actually used.
    pub fn attach(&mut self, iface: &str, mode: AttachMode) -> Result<AttachMode> {
        if !Path::new("/sys/class/net").join(iface).exists() {
            bail!("interface {iface} does not exist");
        }
        let link_pin = self
            .pin_dir
            .as_ref()
            .map(|d| d.join(format!("link-{iface}-{}", mode_tag(mode))));
        match mode {
            AttachMode::Tc => {
                let prog = self.tc_program()?;
                if let Some(pin) = link_pin.as_deref().filter(|p| p.exists()) {
                    return adopt_pinned_link(prog, pin).map(|()| mode);
                }
                let id = prog
                    .attach_with_options(
                        iface,
                        TcAttachType::Ingress,
                        TcAttachOptions::TcxOrder(LinkOrder::default()),
                    )
                    .with_context(|| {
                        format!("attaching the TC program to {iface} (tcx ingress)")
                    })?;
                if let Some(pin) = &link_pin {
                    pin_link(prog, id, pin)?;
                }
                Ok(mode)
            }
            AttachMode::Xdp | AttachMode::XdpNative | AttachMode::XdpGeneric => {
                let prog = self.xdp_program(XDP_PROGRAM)?;
                if let Some(pin) = link_pin.as_deref().filter(|p| p.exists()) {
                    return adopt_pinned_link(prog, pin).map(|()| mode);
                }
                let (first, used) = match mode {
                    AttachMode::XdpGeneric => (XdpMode::Skb, AttachMode::XdpGeneric),
                    _ => (XdpMode::Driver, AttachMode::XdpNative),
                };
                let (id, used) = match prog.attach(iface, first) {
                    Ok(id) => (id, used),
                    Err(e) if mode == AttachMode::Xdp => {
                        tracing::warn!(%iface, error = %e, "native XDP refused, falling back to generic XDP (slower)");
                        let id = prog
                            .attach(iface, XdpMode::Skb)
                            .with_context(|| format!("attaching XDP to {iface} in generic mode"))?;
                        (id, AttachMode::XdpGeneric)
                    }
                    Err(e) => return Err(e).with_context(|| format!("attaching XDP to {iface}")),
                };
                if let Some(pin) = &link_pin {
                    pin_link(prog, id, pin)?;
                }
                Ok(used)
            }
        }
    }

    /// The link this data plane's agent pinned (under the pin directory), and whether it is a TC one.
    pub fn pinned_link(&self) -> Result<(PathBuf, bool)> {
        let dir = self.pin_dir.as_ref().context("not pinned")?;
        for tag in ["xdp", "tc"] {
            for entry in std::fs::read_dir(dir)?.filter_map(|e| e.ok()) {
                let name = entry.file_name().to_string_lossy().to_string();
                if name.starts_with("link-") && name.ends_with(&format!("-{tag}")) {
                    return Ok((entry.path(), tag == "tc"));
                }
            }
        }
        bail!(
            "no pinned link under {} (is the agent attached?)",
            dir.display()
        )
    }

    /// Puts `program` (XDP, or TC with `tc`) on the pinned link `pin` in place of the one there: atomic, no
    /// packet sees no program.
    pub fn swap_pinned_link(&mut self, program: &str, pin: &Path, tc: bool) -> Result<()> {
        if tc {
            adopt_pinned_link(self.tc_program_named(program)?, pin)
        } else {
            adopt_pinned_link(self.xdp_program(program)?, pin)
        }
    }

    fn map(&mut self, name: &str) -> Result<&mut aya::maps::Map> {
        match &mut self.ebpf {
            Some(ebpf) => ebpf.map_mut(name),
            None => self.pinned.get_mut(name),
        }
        .ok_or_else(|| anyhow!("map {name} missing from the object"))
    }

    /// Writes the global settings.
    pub fn set_config(&mut self, cfg: &Config) -> Result<()> {
        let mut m: Array<&mut MapData, Config> = Array::try_from(self.map(names::CONFIG)?)?;
        m.set(CONFIG_INDEX, cfg, 0)?;
        Ok(())
    }

    /// Inserts or replaces a service (atomic for packets).
    pub fn set_service(&mut self, key: &ServiceKey, svc: &Service) -> Result<()> {
        let mut m: HashMap<&mut MapData, ServiceKey, Service> =
            HashMap::try_from(self.map(names::SERVICES)?)?;
        m.insert(key, svc, 0)
            .with_context(|| format!("writing service {key:?} (services map full?)"))?;
        Ok(())
    }

    /// Removes a service.
    pub fn remove_service(&mut self, key: &ServiceKey) -> Result<()> {
        let mut m: HashMap<&mut MapData, ServiceKey, Service> =
            HashMap::try_from(self.map(names::SERVICES)?)?;
        ignore_missing(m.remove(key))
    }

    /// All services in the map.
    pub fn services(&mut self) -> Result<Vec<(ServiceKey, Service)>> {
        let m: HashMap<&mut MapData, ServiceKey, Service> =
            HashMap::try_from(self.map(names::SERVICES)?)?;
        Ok(m.iter().filter_map(|r| r.ok()).collect())
    }

    /// Writes backend slot `id`.
    pub fn set_backend(&mut self, id: u32, b: &Backend) -> Result<()> {
        let mut m: Array<&mut MapData, Backend> = Array::try_from(self.map(names::BACKENDS)?)?;
        m.set(id, b, 0)
            .with_context(|| format!("writing backend slot {id}"))?;
        Ok(())
    }

    /// Reads backend slot `id`.
    pub fn backend(&mut self, id: u32) -> Result<Backend> {
        let m: Array<&mut MapData, Backend> = Array::try_from(self.map(names::BACKENDS)?)?;
        Ok(m.get(&id, 0)?)
    }

    /// Writes a Maglev table into the arena at `offset`.
    pub fn write_table(&mut self, offset: u32, table: &[u32]) -> Result<()> {
        if let Some(m) = self.maglev.as_mut() {
            let range = offset as usize..offset as usize + table.len();
            let Some(dst) = m.slots().get_mut(range) else {
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
        let mut m: Array<&mut MapData, u32> = Array::try_from(self.map(names::MAGLEV)?)?;
        for (i, id) in table.iter().enumerate() {
            m.set(offset + i as u32, id, 0)
                .with_context(|| format!("writing Maglev slot {}", offset as usize + i))?;
        }
        Ok(())
    }

    /// Reads `len` arena slots from `offset`.
    pub fn read_table(&mut self, offset: u32, len: u32) -> Result<Vec<u32>> {
        if let Some(m) = self.maglev.as_mut() {
            let range = offset as usize..offset as usize + len as usize;
            return m
                .slots()
                .get(range)
                .map(|s| s.iter().map(|v| *v as u32).collect())
                .with_context(|| format!("Maglev table [{offset}, +{len}) is outside the arena"));
        }
        let m: Array<&mut MapData, u32> = Array::try_from(self.map(names::MAGLEV)?)?;
        (offset..offset + len)
            .map(|i| m.get(&i, 0).map_err(Into::into))
            .collect()
    }

    /// Sets the next hop of an address.
    pub fn set_nexthop(&mut self, addr: &Addr, nh: &NextHop) -> Result<()> {
        let mut m: HashMap<&mut MapData, Addr, NextHop> =
            HashMap::try_from(self.map(names::NEXTHOPS)?)?;
        m.insert(addr, nh, 0).context("writing a next hop")?;
        Ok(())
    }

    /// Removes the next hop of an address.
    pub fn remove_nexthop(&mut self, addr: &Addr) -> Result<()> {
        let mut m: HashMap<&mut MapData, Addr, NextHop> =
            HashMap::try_from(self.map(names::NEXTHOPS)?)?;
        ignore_missing(m.remove(addr))
    }

    /// All next hops.
    pub fn nexthops(&mut self) -> Result<Vec<(Addr, NextHop)>> {
        let m: HashMap<&mut MapData, Addr, NextHop> =
            HashMap::try_from(self.map(names::NEXTHOPS)?)?;
        Ok(m.iter().filter_map(|r| r.ok()).collect())
    }

    /// Allows `addr/prefix_len` for service `svc_id`.
    pub fn add_source_range(&mut self, svc_id: u32, addr: Addr, prefix_len: u32) -> Result<()> {
        let mut m: LpmTrie<&mut MapData, SourceRangeKey, u8> =
            LpmTrie::try_from(self.map(names::SOURCE_RANGES)?)?;
        m.insert(&source_range_key(svc_id, addr, prefix_len), 1, 0)
            .context("writing a source range (source-range map full?)")?;
        Ok(())
    }

    /// Removes `addr/prefix_len` for service `svc_id`.
    pub fn remove_source_range(&mut self, svc_id: u32, addr: Addr, prefix_len: u32) -> Result<()> {
        let mut m: LpmTrie<&mut MapData, SourceRangeKey, u8> =
            LpmTrie::try_from(self.map(names::SOURCE_RANGES)?)?;
        ignore_missing(m.remove(&source_range_key(svc_id, addr, prefix_len)))
    }

    /// All source-range entries as (svc id, address, CIDR prefix length).
    pub fn source_ranges(&mut self) -> Result<Vec<(u32, Addr, u32)>> {
        let m: LpmTrie<&mut MapData, SourceRangeKey, u8> =
            LpmTrie::try_from(self.map(names::SOURCE_RANGES)?)?;
        Ok(m.keys()
            .filter_map(|k| k.ok())
            .map(|k| {
                let d = k.data();
                (
                    u32::from_be(d.svc_id_be),
                    d.addr,
                    k.prefix_len() - lb_common::SOURCE_RANGE_ID_BITS,
                )
            })
            .collect())
    }

    /// Marks an address as carrying services (fragment policy).
    pub fn add_vip(&mut self, addr: &Addr) -> Result<()> {
        let mut m: HashMap<&mut MapData, Addr, u32> = HashMap::try_from(self.map(names::VIPS)?)?;
        m.insert(addr, 1, 0).context("writing a VIP address")?;
        Ok(())
    }

    /// Unmarks an address.
    pub fn remove_vip(&mut self, addr: &Addr) -> Result<()> {
        let mut m: HashMap<&mut MapData, Addr, u32> = HashMap::try_from(self.map(names::VIPS)?)?;
        ignore_missing(m.remove(addr))
    }

    /// All VIP addresses.
    pub fn vips(&mut self) -> Result<Vec<Addr>> {
        let m: HashMap<&mut MapData, Addr, u32> = HashMap::try_from(self.map(names::VIPS)?)?;
        Ok(m.keys().filter_map(|k| k.ok()).collect())
    }

    /// Takes the flow-event ring buffer (`lb_common::FlowEvent`s for connection-state sync); it has one consumer,
    /// so this succeeds once.
    pub fn take_flow_events(&mut self) -> Result<RingBuf<MapData>> {
        let m = self
            .ebpf_mut()?
            .take_map(names::FLOW_EVENTS)
            .ok_or_else(|| anyhow!("map {} missing or already taken", names::FLOW_EVENTS))?;
        Ok(RingBuf::try_from(m)?)
    }

    /// A second, independent handle on one of the maps, for a task that must not borrow the data plane (the sync
    /// receiver writes flows while the main loop owns `self`).
    pub fn open_map(&mut self, name: &str) -> Result<Map> {
        let data = match self.map(name)? {
            Map::HashMap(d) | Map::LruHashMap(d) | Map::Array(d) | Map::PerCpuArray(d) => d,
            _ => bail!("map {name}: no second handle for this map type"),
        };
        let id = data.info()?.id();
        Ok(Map::from_map_data(MapData::from_id(id)?)?)
    }

    /// A snapshot of every IPv4 flow entry.
    pub fn flows(&mut self) -> Result<Vec<(FlowKeyV4, FlowV4)>> {
        let m: HashMap<&mut MapData, FlowKeyV4, FlowV4> =
            HashMap::try_from(self.map(names::FLOWS_V4)?)?;
        crate::dataplane::map_batch::entries(&m).context("reading the flow table")
    }

    /// One flow entry.
    pub fn flow(&mut self, key: &FlowKeyV4) -> Result<Option<FlowV4>> {
        let m: HashMap<&mut MapData, FlowKeyV4, FlowV4> =
            HashMap::try_from(self.map(names::FLOWS_V4)?)?;
        match m.get(key, 0) {
            Ok(v) => Ok(Some(v)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Writes a flow entry (tests, state sync), marked in the flow filter.
    pub fn set_flow(&mut self, key: &FlowKeyV4, v: &FlowV4) -> Result<()> {
        let mut m: HashMap<&mut MapData, FlowKeyV4, FlowV4> =
            HashMap::try_from(self.map(names::FLOWS_V4)?)?;
        m.insert(key, v, 0)?;
        if let Some(f) = &self.flow_filter {
            f.mark(key);
        }
        Ok(())
    }

    /// The flow filter of this data plane (`None` when only the pins were opened).
    pub fn flow_filter(&mut self) -> Option<&mut FlowFilterMap> {
        self.flow_filter.as_mut()
    }

    /// A second mapping of the flow filter, for a task that writes `FLOWS_V4` through its own handle (flow sync).
    pub fn open_flow_filter(&mut self) -> Result<FlowFilterMap> {
        match self.open_map(names::FLOW_FILTER)? {
            Map::Array(data) => FlowFilterMap::open(&data),
            _ => bail!("{} is not an array", names::FLOW_FILTER),
        }
    }

    /// Deletes a flow entry.
    pub fn remove_flow(&mut self, key: &FlowKeyV4) -> Result<()> {
        let mut m: HashMap<&mut MapData, FlowKeyV4, FlowV4> =
            HashMap::try_from(self.map(names::FLOWS_V4)?)?;
        ignore_missing(m.remove(key))
    }

    /// Deletes flow entries in one call; missing ones are skipped. Returns how many were deleted.
    pub fn remove_flows(&mut self, keys: &[FlowKeyV4]) -> Result<usize> {
        let mut m: HashMap<&mut MapData, FlowKeyV4, FlowV4> =
            HashMap::try_from(self.map(names::FLOWS_V4)?)?;
        crate::dataplane::map_batch::delete(&mut m, keys).context("deleting flow entries")
    }

    /// Deletes entries of `TRANSIENT_V4` in one call; missing ones are skipped.
    pub fn remove_transient_flows(&mut self, keys: &[FlowKeyV4]) -> Result<usize> {
        let mut m: HashMap<&mut MapData, FlowKeyV4, TransientV4> =
            HashMap::try_from(self.map(names::TRANSIENT_V4)?)?;
        crate::dataplane::map_batch::delete(&mut m, keys)
            .context("deleting handshake and closed-connection entries")
    }

    /// A snapshot of every entry of `TRANSIENT_V4` (TCP handshakes and closed connections).
    pub fn transient_flows(&mut self) -> Result<Vec<(FlowKeyV4, TransientV4)>> {
        let m: HashMap<&mut MapData, FlowKeyV4, TransientV4> =
            HashMap::try_from(self.map(names::TRANSIENT_V4)?)?;
        crate::dataplane::map_batch::entries(&m)
            .context("reading the handshake and closed-connection table")
    }

    /// The SYN rate guard's trusted sources (`TRUSTED_SOURCES`).
    pub fn trusted_sources(&mut self) -> Result<Vec<Addr>> {
        let m: HashMap<&mut MapData, Addr, u8> =
            HashMap::try_from(self.map(names::TRUSTED_SOURCES)?)?;
        Ok(m.keys().filter_map(|r| r.ok()).collect())
    }

    /// One entry of `TRANSIENT_V4`.
    pub fn transient_flow(&mut self, key: &FlowKeyV4) -> Result<Option<TransientV4>> {
        let m: HashMap<&mut MapData, FlowKeyV4, TransientV4> =
            HashMap::try_from(self.map(names::TRANSIENT_V4)?)?;
        match m.get(key, 0) {
            Ok(v) => Ok(Some(v)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The handshake in progress of a client's key (client → VIP): its reverse key and its entry in
    /// `TRANSIENT_V4`, found the way the data plane finds it (see `lb_common::handshakes`).
    pub fn handshake(&mut self, key: &FlowKeyV4) -> Result<Option<(FlowKeyV4, TransientV4)>> {
        let index: aya::maps::Array<&mut MapData, FlowKeyV4> =
            aya::maps::Array::try_from(self.map(names::HANDSHAKES)?)?;
        let rkey = index.get(&lb_common::handshakes::slot(key), 0)?;
        Ok(self
            .transient_flow(&rkey)?
            .filter(|t| t.handshake_of(key))
            .map(|t| (rkey, t)))
    }

    /// Writes an entry of `TRANSIENT_V4` (tests).
    pub fn set_transient_flow(&mut self, key: &FlowKeyV4, v: &TransientV4) -> Result<()> {
        let mut m: HashMap<&mut MapData, FlowKeyV4, TransientV4> =
            HashMap::try_from(self.map(names::TRANSIENT_V4)?)?;
        m.insert(key, v, 0)?;
        Ok(())
    }

    /// Deletes an entry of `TRANSIENT_V4`.
    pub fn remove_transient_flow(&mut self, key: &FlowKeyV4) -> Result<()> {
        let mut m: HashMap<&mut MapData, FlowKeyV4, TransientV4> =
            HashMap::try_from(self.map(names::TRANSIENT_V4)?)?;
        ignore_missing(m.remove(key))
    }

    /// Global counters summed over CPUs, indexed like `lb_common::stat`.
    pub fn stats(&mut self) -> Result<Vec<u64>> {
        let m: PerCpuArray<&mut MapData, u64> = PerCpuArray::try_from(self.map(names::STATS)?)?;
        (0..stat::COUNT)
            .map(|i| Ok(m.get(&i, 0)?.iter().sum()))
            .collect()
    }

    /// Counters of service `id` summed over CPUs.
    pub fn service_stats(&mut self, id: u32) -> Result<ServiceStats> {
        let m: PerCpuArray<&mut MapData, ServiceStats> =
            PerCpuArray::try_from(self.map(names::SERVICE_STATS)?)?;
        let per_cpu = m.get(&id, 0)?;
        Ok(sum_service_stats(per_cpu.iter()))
    }

    /// Zeroes the counters of service `id` (when the id is given to a new service).
    pub fn reset_service_stats(&mut self, id: u32) -> Result<()> {
        let mut m: PerCpuArray<&mut MapData, ServiceStats> =
            PerCpuArray::try_from(self.map(names::SERVICE_STATS)?)?;
        let n = aya::util::nr_cpus().map_err(|(_, e)| e)?;
        m.set(
            id,
            PerCpuValues::try_from(vec![ServiceStats::default(); n])?,
            0,
        )?;
        Ok(())
    }
}

/// The MAC address of `iface` (for `Config::local_mac`).
pub fn interface_mac(iface: &str) -> Result<[u8; 6]> {
    let path = format!("/sys/class/net/{iface}/address");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let mut mac = [0u8; 6];
    let parts: Vec<&str> = text.trim().split(':').collect();
    if parts.len() != 6 {
        bail!("{path}: not a MAC address: {}", text.trim());
    }
    for (b, p) in mac.iter_mut().zip(parts) {
        *b = u8::from_str_radix(p, 16)
            .with_context(|| format!("{path}: bad MAC {}", text.trim()))?;
    }
    Ok(mac)
}

/// The programs the agent attaches through a pinned `bpf_link` (tcx and XDP): adopting a pinned link and pinning
/// a new one are the same steps for both, only aya's link types differ.
trait LinkedProgram {
    type Link: TryFrom<FdLink, Error = aya::programs::links::LinkError> + TryInto<FdLink>;
    type LinkId;
    fn take_link(&mut self, id: Self::LinkId) -> Result<Self::Link, aya::programs::ProgramError>;
    fn attach_to_link(
        &mut self,
        link: Self::Link,
    ) -> Result<Self::LinkId, aya::programs::ProgramError>;
}

impl LinkedProgram for SchedClassifier {
    type Link = tc::SchedClassifierLink;
    type LinkId = tc::SchedClassifierLinkId;
    fn take_link(&mut self, id: Self::LinkId) -> Result<Self::Link, aya::programs::ProgramError> {
        SchedClassifier::take_link(self, id)
    }
    fn attach_to_link(
        &mut self,
        link: Self::Link,
    ) -> Result<Self::LinkId, aya::programs::ProgramError> {
        SchedClassifier::attach_to_link(self, link)
    }
}

impl LinkedProgram for Xdp {
    type Link = aya::programs::xdp::XdpLink;
    type LinkId = aya::programs::xdp::XdpLinkId;
    fn take_link(&mut self, id: Self::LinkId) -> Result<Self::Link, aya::programs::ProgramError> {
        Xdp::take_link(self, id)
    }
    fn attach_to_link(
        &mut self,
        link: Self::Link,
    ) -> Result<Self::LinkId, aya::programs::ProgramError> {
        Xdp::attach_to_link(self, link)
    }
}

/// Replaces the program on the link pinned at `pin` (left by an earlier agent): atomic for packets.
fn adopt_pinned_link<P: LinkedProgram>(prog: &mut P, pin: &Path) -> Result<()> {
    let old = PinnedLink::from_pin(pin)
        .with_context(|| format!("opening pinned link {}", pin.display()))?;
    let link = P::Link::try_from(FdLink::from(old))?;
    prog.attach_to_link(link)
        .with_context(|| format!("replacing the program on the pinned link {}", pin.display()))?;
    Ok(())
}

/// The name of the program on the pinned link `pin`.
pub fn pinned_link_program(pin: &Path) -> Result<String> {
    let link = FdLink::from(
        PinnedLink::from_pin(pin)
            .with_context(|| format!("opening pinned link {}", pin.display()))?,
    );
    // The link's program can be replaced (and the old one freed) between reading its id and listing the programs
    // — a trace starting or ending: then the link names another program, and that one is looked up.
    let mut id = link.info()?.program_id();
    for _ in 0..10 {
        for p in aya::programs::loaded_programs().filter_map(|p| p.ok()) {
            if p.id() == id {
                return Ok(p.name_as_str().unwrap_or("?").to_string());
            }
        }
        let now = link.info()?.program_id();
        if now == id {
            break;
        }
        id = now;
    }
    bail!("program {id} of link {} not found", pin.display())
}

/// The sizes of the maps pinned under `pin_dir` (an agent's), to load another instance of the object onto them.
pub fn pinned_sizes(pin_dir: &Path) -> Result<MapSizes> {
    let dir = pin_dir.join(format!("v{LAYOUT_VERSION}"));
    let entries = |name: &str| -> Result<u32> {
        let data = MapData::from_pin(dir.join(name))
            .with_context(|| format!("opening the pinned map {name} under {}", dir.display()))?;
        Ok(data.info()?.max_entries())
    };
    Ok(MapSizes {
        flows: entries(names::FLOWS_V4)?,
        transient: entries(names::TRANSIENT_V4)?,
        services: entries(names::SERVICES)?,
        backends: entries(names::BACKENDS)?,
        maglev_slots: entries(names::MAGLEV)?,
        nexthops: entries(names::NEXTHOPS)?,
        source_ranges: entries(names::SOURCE_RANGES)?,
        trusted_sources: entries(names::TRUSTED_SOURCES)?,
    })
}

/// Pins the link `id` just attached at `pin`, and re-adopts the pinned link so that it stays attached when this
/// process exits.
fn pin_link<P: LinkedProgram>(prog: &mut P, id: P::LinkId, pin: &Path) -> Result<()> {
    let link = prog.take_link(id)?;
    let fd: FdLink = link
        .try_into()
        .map_err(|_| anyhow!("the link is not an fd link"))?;
    let pinned = fd
        .pin(pin)
        .with_context(|| format!("pinning the link at {}", pin.display()))?;
    prog.attach_to_link(P::Link::try_from(FdLink::from(pinned))?)?;
    Ok(())
}

impl AttachMode {
    /// How the status message names the hook the programs run at.
    pub fn describe(self) -> &'static str {
        match self {
            AttachMode::Xdp | AttachMode::XdpNative => "XDP",
            AttachMode::XdpGeneric => "generic XDP",
            AttachMode::Tc => "TC (tcx)",
        }
    }
}

fn mode_tag(mode: AttachMode) -> &'static str {
    match mode {
        AttachMode::Tc => "tc",
        _ => "xdp",
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

fn ignore_missing(r: Result<(), aya::maps::MapError>) -> Result<()> {
    match r {
        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// Sums per-CPU service counters.
pub fn sum_service_stats<'a>(it: impl Iterator<Item = &'a ServiceStats>) -> ServiceStats {
    let mut t = ServiceStats::default();
    for s in it {
        t.rx_packets += s.rx_packets;
        t.rx_bytes += s.rx_bytes;
        t.tx_packets += s.tx_packets;
        t.tx_bytes += s.tx_bytes;
        t.new_flows += s.new_flows;
        t.closed_flows += s.closed_flows;
        t.drop_source_range += s.drop_source_range;
        t.drop_no_backend += s.drop_no_backend;
        t.drop_snat_exhausted += s.drop_snat_exhausted;
        t.drop_no_flow += s.drop_no_flow;
        t.pass_no_nexthop += s.pass_no_nexthop;
        t.icmp_translated += s.icmp_translated;
        t.handshakes += s.handshakes;
        t.drop_handshake += s.drop_handshake;
        t.drop_syn_rate += s.drop_syn_rate;
    }
    t
}

/// Turns a program load error into one that carries the verifier log.
fn verifier_error(e: aya::programs::ProgramError) -> anyhow::Error {
    match e {
        aya::programs::ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            anyhow!("the kernel refused the program ({io_error}); verifier log:\n{verifier_log}")
        }
        e => anyhow!(e).context("loading the program"),
    }
}
