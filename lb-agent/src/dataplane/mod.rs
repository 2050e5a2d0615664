//! Loading and attaching the eBPF data plane; its maps, typed, are [`Maps`]. Knows the maps, not the
//! load-balancer model (that is [`crate::dataplane::programmer`]).

pub mod arena;
pub mod flow_filter;
pub mod gc;
mod layouts;
pub mod maglev;
pub mod map_batch;
pub mod map_defs;
mod mapped;
pub mod maps;
pub mod model;
pub mod neighbor;
pub mod nic;
pub mod programmer;
pub mod route_events;

pub use layouts::Carried;
pub use maps::Maps;

use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{Map, MapData, ProgramArray},
    programs::{
        links::{FdLink, PinnedLink},
        tc::{self, SchedClassifier, TcAttachOptions, TcAttachType},
        LinkOrder, Xdp, XdpMode,
    },
    Ebpf, EbpfLoader,
};
use lb_common::{map_names as names, LAYOUT_VERSION};
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
/// Every program of the object, and whether it is an XDP program (else TC).
pub const PROGRAMS: &[(&str, bool)] = &[
    (XDP_PROGRAM, true),
    (TC_PROGRAM, false),
    (XDP_TRACE_PROGRAM, true),
    (TC_TRACE_PROGRAM, false),
];
/// The IPv6 programs (the benchmark object, lb-bench.o, has only the fast XDP ones): name, whether it is an XDP
/// program (else TC), and its slot in `V6_PROGS_XDP` / `V6_PROGS_TC`, where the IPv4 entry points (and the IPv6
/// programs, for a new flow) tail-call it.
pub const V6_PROGRAMS: &[(&str, bool, u32)] = &[
    ("lb_xdp6", true, lb_common::V6_PROG_FAST),
    ("lb_xdp6_trace", true, lb_common::V6_PROG_TRACED),
    ("lb_xdp6_new", true, lb_common::V6_PROG_NEW_FLOW),
    (
        "lb_xdp6_new_trace",
        true,
        lb_common::V6_PROG_NEW_FLOW_TRACED,
    ),
    ("lb_tc6", false, lb_common::V6_PROG_FAST),
    ("lb_tc6_trace", false, lb_common::V6_PROG_TRACED),
    ("lb_tc6_new", false, lb_common::V6_PROG_NEW_FLOW),
    (
        "lb_tc6_new_trace",
        false,
        lb_common::V6_PROG_NEW_FLOW_TRACED,
    ),
];

/// The IPv6 programs' tail-call arrays (see [`V6_PROGRAMS`]).
const V6_PROG_ARRAYS: &[&str] = &[names::V6_PROGS_XDP, names::V6_PROGS_TC];

/// Whether the connection tables' (`FLOWS_V4/V6`) LRU lists are per CPU or common to all CPUs — a choice made when
/// the maps are created (docs/design.md, "Several CPUs").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnectionLru {
    /// One LRU list per CPU (as the object is built): new connections on different CPUs never wait for one
    /// another, but each CPU evicts within its even share of the table.
    PerCpu,
    /// Lists common to all CPUs: the whole table for any CPU, inserts from many CPUs serialised when it is full.
    Common,
}

impl ConnectionLru {
    /// The lists for interfaces with `rx_queues` receive queues each on a machine of `possible_cpus`: per CPU only
    /// when every interface spreads its flows over at least as many queues as there are CPUs (RSS then spreads
    /// the new connections, and so the table, evenly); with fewer, the CPUs that receive nothing would hold shares
    /// of the table nobody uses.
    pub fn for_queues(rx_queues: &[u32], possible_cpus: u32) -> Self {
        if !rx_queues.is_empty() && rx_queues.iter().all(|&q| q >= possible_cpus) {
            ConnectionLru::PerCpu
        } else {
            ConnectionLru::Common
        }
    }
}

/// Capacities of the maps, set at load time.
#[derive(Clone, Debug)]
pub struct MapSizes {
    /// The connection tables' LRU lists (flags, not a size: set at load time all the same).
    pub connection_lru: ConnectionLru,
    /// Connection-tracking entries (two per connection).
    pub flows: u32,
    /// Entries for TCP handshakes and closed connections (two per connection; `TRANSIENT_V4`).
    pub transient: u32,
    /// IPv6 connection-tracking entries (`FLOWS_V6`).
    pub flows_v6: u32,
    /// IPv6 handshakes and closed connections (`TRANSIENT_V6`).
    pub transient_v6: u32,
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
            connection_lru: ConnectionLru::PerCpu,
            flows: d::MAX_FLOWS,
            transient: d::MAX_TRANSIENT,
            flows_v6: d::MAX_FLOWS_V6,
            transient_v6: d::MAX_TRANSIENT_V6,
            services: d::MAX_SERVICES,
            backends: d::MAX_BACKENDS,
            maglev_slots: d::MAGLEV_SLOTS,
            nexthops: d::MAX_NEXTHOPS,
            source_ranges: d::MAX_SOURCE_RANGES,
            trusted_sources: d::MAX_TRUSTED_SOURCES,
        }
    }
}

impl MapSizes {
    /// Tables of a few thousand entries at most: for an object loaded only to be checked or to run programs that
    /// do not forward (`--check-programs`, the packet-rate benchmark's generator and reference forwarders), where
    /// production sizes would only cost memory and load time.
    pub fn small() -> Self {
        MapSizes {
            connection_lru: ConnectionLru::PerCpu,
            flows: 1024,
            transient: 1024,
            flows_v6: 1024,
            transient_v6: 1024,
            services: 16,
            backends: 64,
            maglev_slots: 1024,
            nexthops: 16,
            source_ranges: 16,
            trusted_sources: 1024,
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
    /// The loaded object; `None` when the maps were opened from their pins (no programs then). Its maps are
    /// taken out into `maps`; the programs keep referring to them (the fds stay open there).
    ebpf: Option<Ebpf>,
    pin_dir: Option<PathBuf>,
    /// Every map the agent reads or writes, typed.
    pub maps: Maps,
}

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
            .map_max_entries(names::FLOWS_V6, sizes.flows_v6)
            .map_max_entries(names::TRANSIENT_V6, sizes.transient_v6)
            .map_max_entries(names::SERVICES, sizes.services)
            .map_max_entries(names::SERVICE_STATS, sizes.services)
            .map_max_entries(names::VIPS, sizes.services)
            .map_max_entries(names::BACKENDS, sizes.backends)
            .map_max_entries(names::MAGLEV, sizes.maglev_slots)
            .map_max_entries(names::NEXTHOPS, sizes.nexthops)
            .map_max_entries(names::SOURCE_RANGES, sizes.source_ranges)
            .map_max_entries(names::TRUSTED_SOURCES, sizes.trusted_sources);
        // The IPv6 programs' tail-call arrays are pinned with the maps: a kernel empties a program array when no
        // process or pin holds it any more, and the attached IPv4 programs would then pass IPv6 to the kernel
        // while the agent restarts.
        let pins: Vec<(&str, PathBuf)> = match &pin_dir {
            Some(dir) => Maps::NAMES
                .iter()
                .chain(V6_PROG_ARRAYS)
                .map(|m| (*m, dir.join(m)))
                .collect(),
            None => Vec::new(),
        };
        for (name, path) in &pins {
            loader.map_pin_path(name, path.as_path());
        }
        let patched;
        let obj = match sizes.connection_lru {
            ConnectionLru::PerCpu => obj,
            ConnectionLru::Common => {
                let mut o = obj.to_vec();
                for name in [names::FLOWS_V4, names::FLOWS_V6] {
                    map_defs::patch_map_flags(&mut o, name, 0, map_defs::BPF_F_NO_COMMON_LRU)?;
                }
                patched = o;
                &patched[..]
            }
        };
        let mut ebpf = loader.load(obj).context(
            "loading the eBPF object (map creation or pinned-map reuse failed; a pinned map with another size \
             must be removed from bpffs first)",
        )?;
        let maps = Maps::open(|name| {
            ebpf.take_map(name)
                .ok_or_else(|| anyhow!("map {name} missing from the object"))
        })?;
        Ok(Dataplane {
            ebpf: Some(ebpf),
            pin_dir,
            maps,
        })
    }

    /// Opens the maps an agent pinned under `pin_dir` (running or not), to read them (`lbctl`): nothing is
    /// loaded or created, and the data plane is not touched.
    pub fn open_pinned(pin_dir: &Path) -> Result<Self> {
        let dir = pin_dir.join(format!("v{LAYOUT_VERSION}"));
        let maps = open_pinned_maps(&dir, LAYOUT_VERSION)?;
        Ok(Dataplane {
            ebpf: None,
            pin_dir: Some(dir),
            maps,
        })
    }

    /// The directory holding pinned maps and links, if pinning.
    pub fn pin_dir(&self) -> Option<&Path> {
        self.pin_dir.as_deref()
    }

    /// The loaded object, for programs, and for maps not in [`Maps`] (tests and benchmarks).
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

    /// Whether the object has the IPv6 programs (lb-bench.o has only the fast XDP ones, `lb_xdp6` and `lb_xdp6_new`).
    pub fn has_ipv6_programs(&mut self) -> bool {
        self.ebpf
            .as_mut()
            .is_some_and(|e| e.program(V6_PROGRAMS[0].0).is_some())
    }

    /// Loads (verifies) the IPv6 programs of one hook — the fast ones, or `lbctl trace`'s — and puts each into its
    /// tail-call slot, where the entry points find them. Returns false when the object has none (IPv6 then goes
    /// to the kernel, counted as `pass_no_ipv6_program`).
    pub fn load_ipv6_programs(&mut self, xdp: bool, traced: bool) -> Result<bool> {
        if !self.has_ipv6_programs() {
            return Ok(false);
        }
        let traced_slot = |slot: u32| {
            slot == lb_common::V6_PROG_TRACED || slot == lb_common::V6_PROG_NEW_FLOW_TRACED
        };
        for (name, _, slot) in V6_PROGRAMS
            .iter()
            .filter(|(_, x, slot)| *x == xdp && traced_slot(*slot) == traced)
        {
            let fd = if xdp {
                self.xdp_program(name)?.fd()?.try_clone()?
            } else {
                self.tc_program_named(name)?.fd()?.try_clone()?
            };
            let array = if xdp {
                names::V6_PROGS_XDP
            } else {
                names::V6_PROGS_TC
            };
            let mut progs = ProgramArray::try_from(
                self.ebpf_mut()?
                    .map_mut(array)
                    .ok_or_else(|| anyhow!("map {array} missing from the object"))?,
            )?;
            progs
                .set(*slot, &fd, 0)
                .with_context(|| format!("putting {name} into {array}[{slot}]"))?;
        }
        Ok(true)
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
        // The IPv6 programs are in their slots before the first packet can look for them.
        let ipv6 = self.load_ipv6_programs(mode != AttachMode::Tc, false)?;
        tracing::debug!(ipv6, "IPv6 programs");
        match mode {
            AttachMode::Tc => {
                if let Some(pin) = &link_pin {
                    self.take_over_other_layout(iface, mode, pin)?;
                }
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
                if let Some(pin) = &link_pin {
                    self.take_over_other_layout(iface, mode, pin)?;
                }
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

    /// The links this data plane's agent pinned (under the pin directory: one per interface), and whether they
    /// are TC ones.
    pub fn pinned_links(&self) -> Result<(Vec<PathBuf>, bool)> {
        let dir = self.pin_dir.as_ref().context("not pinned")?;
        for tag in ["xdp", "tc"] {
            let mut links: Vec<PathBuf> = std::fs::read_dir(dir)?
                .filter_map(|e| e.ok())
                .filter(|e| {
                    let name = e.file_name().to_string_lossy().to_string();
                    name.starts_with("link-") && name.ends_with(&format!("-{tag}"))
                })
                .map(|e| e.path())
                .collect();
            if !links.is_empty() {
                links.sort();
                return Ok((links, tag == "tc"));
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
}

/// One program of the data plane and this kernel's verdict on it ([`check_programs`]).
#[derive(Debug)]
pub struct ProgramCheck {
    /// The program's name in the object (`lb_xdp`, `lb_tc6_new_trace`, …).
    pub name: String,
    /// `xdp` or `tc`.
    pub hook: &'static str,
    /// Why the kernel refused it (with the verifier log); `None`: accepted.
    pub refused: Option<String>,
}

/// Loads every program of the embedded object into this kernel — the fast ones the agent attaches and the traced
/// ones `lbctl trace` swaps in, XDP and TC, IPv4 and IPv6 — and attaches nothing: whether this kernel's verifier
/// accepts the whole data plane, also the programs a host never loads until someone traces or picks
/// `--attach-mode tc` (`lb-agent --check-programs`). Loading a TC program needs no tcx, so a kernel older than
/// 6.6 verifies them too. The maps are created small and not pinned (the verifier does not depend on their sizes),
/// so a running agent is not touched.
pub fn check_programs() -> Result<Vec<ProgramCheck>> {
    let sizes = MapSizes::small();
    let mut dp = Dataplane::load(&sizes, None)?;
    let ebpf = dp.ebpf_mut()?;
    // The object's own list, not PROGRAMS / V6_PROGRAMS: a program added to lb-ebpf is checked without more code.
    let mut names: Vec<String> = ebpf.programs().map(|(n, _)| n.to_string()).collect();
    names.sort();
    let mut checks = Vec::new();
    for name in names {
        let prog = ebpf
            .program_mut(&name)
            .ok_or_else(|| anyhow!("program {name} vanished from the object"))?;
        let (hook, result) = match prog {
            aya::programs::Program::Xdp(p) => ("xdp", p.load().map_err(verifier_error)),
            aya::programs::Program::SchedClassifier(p) => ("tc", p.load().map_err(verifier_error)),
            other => (
                "other",
                Err(anyhow!(
                    "program type {:?} is not one the agent attaches",
                    other.prog_type()
                )),
            ),
        };
        checks.push(ProgramCheck {
            name,
            hook,
            refused: result.err().map(|e| format!("{e:#}")),
        });
    }
    Ok(checks)
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

/// The maps pinned in `dir`, a directory of map layout `layout`, typed as this layout's (aya checks each map's
/// type and key and value sizes).
fn open_pinned_maps(dir: &Path, layout: u32) -> Result<Maps> {
    Maps::open(|name| {
        let path = dir.join(name);
        let data = MapData::from_pin(&path).with_context(|| {
            format!(
                "opening the pinned map {} (does an agent pin here, with map layout v{layout}?)",
                path.display()
            )
        })?;
        Ok(Map::from_map_data(data)?)
    })
}

/// The sizes of the maps pinned under `pin_dir` (an agent's), to load another instance of the object onto them.
pub fn pinned_sizes(pin_dir: &Path) -> Result<MapSizes> {
    let dir = pin_dir.join(format!("v{LAYOUT_VERSION}"));
    let info = |name: &str| -> Result<aya::maps::MapInfo> {
        let data = MapData::from_pin(dir.join(name))
            .with_context(|| format!("opening the pinned map {name} under {}", dir.display()))?;
        Ok(data.info()?)
    };
    let entries = |name: &str| -> Result<u32> { Ok(info(name)?.max_entries()) };
    let per_cpu = info(names::FLOWS_V4)?.map_flags() & map_defs::BPF_F_NO_COMMON_LRU != 0;
    Ok(MapSizes {
        connection_lru: if per_cpu {
            ConnectionLru::PerCpu
        } else {
            ConnectionLru::Common
        },
        flows: entries(names::FLOWS_V4)?,
        transient: entries(names::TRANSIENT_V4)?,
        flows_v6: entries(names::FLOWS_V6)?,
        transient_v6: entries(names::TRANSIENT_V6)?,
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

#[cfg(test)]
mod tests {
    use super::ConnectionLru::{self, Common, PerCpu};

    #[test]
    fn the_connection_lists_are_per_cpu_only_where_every_interface_has_a_queue_per_cpu() {
        assert_eq!(ConnectionLru::for_queues(&[16], 16), PerCpu);
        assert_eq!(ConnectionLru::for_queues(&[16, 32], 16), PerCpu);
        // One interface short, a single queue (Nova without multiqueue, a veth), no interface at all.
        assert_eq!(ConnectionLru::for_queues(&[16, 4], 16), Common);
        assert_eq!(ConnectionLru::for_queues(&[1], 2), Common);
        assert_eq!(ConnectionLru::for_queues(&[], 2), Common);
        assert_eq!(ConnectionLru::for_queues(&[1], 1), PerCpu);
    }
}
