//! An upgrade across a change of the data plane's maps (`lb_common::LAYOUT_VERSION`). Each layout pins in a
//! directory of its own (`<pin dir>/v<N>/`); a new agent finds the previous one's there, its programs still
//! attached through its links and forwarding with its maps. The new agent, as Cilium does with its pinned maps:
//! 1. carries the state of the layout before its own ([`CARRIED_LAYOUT`]) into its new maps before it attaches
//!    ([`Dataplane::carry_over`]): the services, backends and Maglev tables (so the agent re-adopts them as on any
//!    restart), next hops, source ranges, the connection and handshake tables (the flow filter and the
//!    handshake index derived from them), the SYN guard's trusted sources and the counters;
//! 2. takes each old link over in place when it attaches ([`Dataplane::take_over_other_layout`]): no packet meets
//!    no program;
//! 3. copies the connections and handshakes the old program made after step 1 read its tables
//!    ([`Dataplane::finish_carry_over`]): between the attach and step 3 (milliseconds), a connection opened
//!    during the copy is unknown to the new program;
//! 4. frees the old layout's maps once no link is pinned there ([`Dataplane::remove_other_layouts`]).
//!
//! A layout this build cannot carry (older than the one before it, or newer: a downgrade) is refused while a
//! program is attached through it — that program keeps serving its connections — unless the operator asks for a
//! clean start: then its links are taken over and its connections break.

use super::maps::{FamilyMaps, Maps};
use super::{open_pinned_maps, AttachMode, Dataplane};
use anyhow::{bail, Context, Result};
use aya::programs::links::{FdLink, PinnedLink};
use aya::Pod;
#[cfg(test)]
use lb_common::map_names as names;
use lb_common::{FlowKey, In6, Transient, LAYOUT_VERSION};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The layout whose pinned state this build carries over: the one before it. v10 → v11 gave the connection
/// tables per-CPU LRU lists (v9 → v10 the handshake tables) and changed no entry's bytes, so the carried maps are
/// read with this layout's types (aya checks each map's type and key and value sizes). A layout that changes an
/// entry keeps the previous layout's type here and converts it in [`carry`].
pub const CARRIED_LAYOUT: u32 = 10;

/// The maps whose state [`carry`] brings over: copied, or derived from what is (the flow filter, the handshake
/// index). The test checks every map is here or in [`NOT_CARRIED`].
#[cfg(test)]
const CARRIED: &[&str] = &[
    names::SERVICES,
    names::BACKENDS,
    names::MAGLEV,
    names::NEXTHOPS,
    names::SOURCE_RANGES,
    names::VIPS,
    names::FLOWS_V4,
    names::TRANSIENT_V4,
    names::FLOWS_V6,
    names::TRANSIENT_V6,
    names::TRUSTED_SOURCES,
    names::FLOW_FILTER,
    names::HANDSHAKES,
    names::HANDSHAKES_V6,
    names::SERVICE_STATS,
    names::STATS,
];

/// The maps that start anew: the agent writes them before it attaches (the interfaces' egress slots, in the
/// order of `--interface`, and the settings), or they are a process's (the flow-event rings, which the flow sync
/// opens).
#[cfg(test)]
const NOT_CARRIED: &[&str] = &[
    names::EGRESS,
    names::EGRESS_DEVMAP,
    names::INTERFACES,
    names::CONFIG,
    names::FLOW_EVENTS,
    names::FLOW_EVENTS_V6,
];

/// The previous layout's maps, carried over before the attach and kept open for [`Dataplane::finish_carry_over`],
/// with the keys that first copy saw.
pub struct Carried {
    dir: PathBuf,
    old: Maps,
    seen: [Seen; 2],
    started: Instant,
}

/// The keys of one family's tables that a copy saw, as sorted hashes (8 bytes a key, whatever the family).
#[derive(Default)]
struct Seen {
    flows: Vec<u64>,
    transient: Vec<u64>,
}

impl Seen {
    fn hash<K: Hash>(key: &K) -> u64 {
        let mut h = DefaultHasher::new();
        key.hash(&mut h);
        h.finish()
    }

    fn sorted(mut hashes: Vec<u64>) -> Vec<u64> {
        hashes.sort_unstable();
        hashes
    }
}

/// Entries carried over: connections (both families' flow tables) and handshake-table entries (handshakes and
/// closed connections).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counts {
    flows: usize,
    transient: usize,
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, o: Counts) {
        self.flows += o.flows;
        self.transient += o.transient;
    }
}

/// Copies the state of `old` (the previous layout's maps) into `new`; returns the counts and the keys seen (IPv4's,
/// IPv6's).
fn carry(old: &Maps, new: &mut Maps) -> Result<(Counts, [Seen; 2])> {
    new.services.insert_many(&old.services.entries()?)?;
    new.backends.copy_from(&old.backends)?;
    new.maglev.copy_from(&old.maglev)?;
    new.nexthops.insert_many(&old.nexthops.entries()?)?;
    new.source_ranges.copy_from(&old.source_ranges)?;
    new.vips.insert_many(&old.vips.entries()?)?;
    new.trusted_sources
        .insert_many(&old.trusted_sources.entries()?)?;
    new.service_stats.copy_from(&old.service_stats)?;
    new.stats.copy_from(&old.stats)?;
    let (mut counts, v4) = carry_family::<u32>(old, new, |_, _| Ok(true))?;
    let (c, v6) = carry_family::<In6>(old, new, |_, _| Ok(true))?;
    counts += c;
    Ok((counts, [v4, v6]))
}

/// One family's entries that the old program made after [`carry`] read its tables — keys that copy did not see
/// and the new tables do not hold — carried over. (An entry it did see and the new tables lack was since deleted
/// by the new program: a handshake promoted, a connection closed; not brought back.)
fn carry_late<A: FamilyMaps>(old: &Maps, new: &mut Maps, seen: &Seen) -> Result<Counts>
where
    FlowKey<A>: Pod,
    Transient<A>: Pod,
{
    let unseen = |hashes: &[u64], k: &FlowKey<A>| hashes.binary_search(&Seen::hash(k)).is_err();
    let (counts, _) = carry_family::<A>(old, new, |new, k| {
        Ok(match k {
            Entry::Flow(k) => unseen(&seen.flows, k) && A::flows(new).get(k)?.is_none(),
            Entry::Transient(k) => {
                unseen(&seen.transient, k) && A::transient(new).get(k)?.is_none()
            }
        })
    })?;
    Ok(counts)
}

/// A key of one of a family's two tables, for the choice of what to copy.
enum Entry<'a, A> {
    Flow(&'a FlowKey<A>),
    Transient(&'a FlowKey<A>),
}

/// Copies one family's connection and handshake tables from `old` into `new`, the entries for which `copy`
/// holds. Connections are marked in the flow filter (as `Maps::set_flow` does), handshakes put into the handshake
/// index: both derived from the entries carried, not copied. Returns the counts
/// and the keys copied.
fn carry_family<A: FamilyMaps>(
    old: &Maps,
    new: &mut Maps,
    copy: impl Fn(&Maps, Entry<A>) -> Result<bool>,
) -> Result<(Counts, Seen)>
where
    FlowKey<A>: Pod,
    Transient<A>: Pod,
{
    let flows = chosen(A::flows(old).entries()?, |k| copy(new, Entry::Flow(k)))?;
    new.set_flows(&flows)?;
    let transient = chosen(A::transient(old).entries()?, |k| {
        copy(new, Entry::Transient(k))
    })?;
    A::transient_mut(new).insert_spread(&transient)?;
    // The handshake index, for the handshakes carried: where the client's ACK finds its handshake. Rebuilt from
    // the entries rather than copied, whose 2^18 slots are mostly empty or stale.
    for (rkey, t) in &transient {
        if t.handshake() {
            let client = t.flow.partner_key(rkey.proto);
            A::handshakes_mut(new).set(lb_common::handshakes::slot(&client), rkey)?;
        }
    }
    let counts = Counts {
        flows: flows.len(),
        transient: transient.len(),
    };
    let seen = Seen {
        flows: Seen::sorted(flows.iter().map(|(k, _)| Seen::hash(k)).collect()),
        transient: Seen::sorted(transient.iter().map(|(k, _)| Seen::hash(k)).collect()),
    };
    Ok((counts, seen))
}

/// The entries whose key `keep` holds for.
fn chosen<K, V>(entries: Vec<(K, V)>, keep: impl Fn(&K) -> Result<bool>) -> Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    for (k, v) in entries {
        if keep(&k)? {
            out.push((k, v));
        }
    }
    Ok(out)
}

/// Whether an agent's link is pinned in the layout directory `dir` (its programs are attached through it).
fn has_links(dir: &Path) -> Result<bool> {
    Ok(std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok())
        .any(|e| e.file_name().to_string_lossy().starts_with("link-")))
}

impl Dataplane {
    /// Step 1 (see the module): carries the previous layout's pinned state into this data plane's maps, before
    /// anything else writes them. Refuses a layout with programs attached that it cannot carry, unless
    /// `clean_start` (then that layout's connections break when its links are taken over). `None`: nothing to
    /// carry.
    pub fn carry_over(&mut self, clean_start: bool) -> Result<Option<Carried>> {
        let mut carried = None;
        for (dir, layout) in self.other_layouts()? {
            let attached = has_links(&dir)?;
            let refusal = |why: String| -> Result<()> {
                if !attached {
                    // No program uses these maps: nothing runs on them, nothing to lose.
                    return Ok(());
                }
                if clean_start {
                    tracing::warn!(dir = %dir.display(), "{why}; starting from empty connection tables as asked \
                        (--clean-start): the connections through the programs attached now break");
                    return Ok(());
                }
                bail!(
                    "{why}. Refusing to start, so that the programs attached now keep serving their connections. \
                     Upgrade through the release that uses layout v{CARRIED_LAYOUT}, or pass --clean-start \
                     (LB_CLEAN_START=true) to start from empty connection tables: every connection through this \
                     node breaks"
                )
            };
            if layout != CARRIED_LAYOUT {
                refusal(format!(
                    "an agent with map layout v{layout} pinned its maps under {} (this one uses v{LAYOUT_VERSION} \
                     and carries over only v{CARRIED_LAYOUT}'s)",
                    dir.display()
                ))?;
                continue;
            }
            let started = Instant::now();
            let result = open_pinned_maps(&dir, layout)
                .and_then(|old| Ok((carry(&old, &mut self.maps)?, old)));
            match result {
                Ok(((counts, seen), old)) => {
                    tracing::info!(from = %dir.display(), connections = counts.flows / 2,
                        flow_entries = counts.flows, handshake_entries = counts.transient,
                        ms = started.elapsed().as_millis() as u64,
                        "carried the previous map layout's state over (v{layout} → v{LAYOUT_VERSION})");
                    carried = Some(Carried {
                        dir,
                        old,
                        seen,
                        started,
                    });
                }
                Err(e) => refusal(format!(
                    "the maps of layout v{layout} under {} could not be carried over: {e:#}",
                    dir.display()
                ))?,
            }
        }
        Ok(carried)
    }

    /// Step 3 (see the module), after every interface is attached: copies the connections and handshakes that the
    /// old program made while [`Self::carry_over`] ran and the new tables lack, then closes the old maps.
    pub fn finish_carry_over(&mut self, carried: Carried) -> Result<()> {
        let Carried {
            dir,
            old,
            seen: [v4, v6],
            started,
        } = carried;
        let mut late = carry_late::<u32>(&old, &mut self.maps, &v4)?;
        late += carry_late::<In6>(&old, &mut self.maps, &v6)?;
        tracing::info!(from = %dir.display(), flow_entries = late.flows, handshake_entries = late.transient,
            total_ms = started.elapsed().as_millis() as u64,
            "carried over what the previous layout's program added meanwhile");
        Ok(())
    }

    /// An upgrade across a map layout change: an agent of another layout left its link for `iface` pinned in its
    /// own directory (`<base>/v<N>/`), and the kernel holds that link on the interface (a second native XDP
    /// attach would be refused; a second tcx program would run before ours with the old maps). The link moves to
    /// this layout's `pin` (pinned there, unpinned there), and the caller then puts this agent's program on it in
    /// place as on any restart: no packet meets no program. Its connections are in this layout's maps when
    /// [`Self::carry_over`] carried them.
    pub(super) fn take_over_other_layout(
        &self,
        iface: &str,
        mode: AttachMode,
        pin: &Path,
    ) -> Result<()> {
        if pin.exists() {
            return Ok(());
        }
        let name = pin.file_name().context("link pin without a name")?;
        for (dir, _) in self.other_layouts()? {
            let old = dir.join(name);
            if !old.exists() {
                continue;
            }
            tracing::warn!(
                %iface,
                hook = mode.describe(),
                from = %dir.display(),
                "the programs on this interface were attached by an agent with another map layout (this one uses \
                 v{LAYOUT_VERSION}): taking its link over in place"
            );
            let link = FdLink::from(
                PinnedLink::from_pin(&old)
                    .with_context(|| format!("opening pinned link {}", old.display()))?,
            );
            link.pin(pin)
                .with_context(|| format!("pinning the link at {}", pin.display()))?;
            std::fs::remove_file(&old)
                .with_context(|| format!("unpinning the link at {}", old.display()))?;
            return Ok(());
        }
        Ok(())
    }

    /// The pin directories of other map layouts beside this one's (`v<N>` under the same base directory), with
    /// their layouts.
    fn other_layouts(&self) -> Result<Vec<(PathBuf, u32)>> {
        let Some(dir) = &self.pin_dir else {
            return Ok(Vec::new());
        };
        let Some(base) = dir.parent() else {
            return Ok(Vec::new());
        };
        let mut dirs = Vec::new();
        for e in std::fs::read_dir(base)
            .with_context(|| format!("reading the pin directory {}", base.display()))?
        {
            let e = e?;
            let name = e.file_name().to_string_lossy().to_string();
            let layout = name.strip_prefix('v').and_then(|n| n.parse::<u32>().ok());
            if let Some(v) = layout.filter(|v| *v != LAYOUT_VERSION && e.path().is_dir()) {
                dirs.push((e.path(), v));
            }
        }
        dirs.sort();
        Ok(dirs)
    }

    /// Removes the pins of other map layouts that hold no link any more (every interface was taken over, see
    /// [`Self::take_over_other_layout`]): their maps, flow tables included, are freed. Returns the directories
    /// removed.
    pub fn remove_other_layouts(&self) -> Result<Vec<PathBuf>> {
        let mut removed = Vec::new();
        for (dir, _) in self.other_layouts()? {
            if has_links(&dir)? {
                continue;
            }
            let pins: Vec<PathBuf> = std::fs::read_dir(&dir)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .collect();
            for p in &pins {
                std::fs::remove_file(p).with_context(|| format!("unpinning {}", p.display()))?;
            }
            std::fs::remove_dir(&dir).with_context(|| format!("removing {}", dir.display()))?;
            removed.push(dir);
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_map_is_carried_or_said_not_to_be() {
        let mut listed: Vec<&str> = CARRIED.iter().chain(NOT_CARRIED).copied().collect();
        listed.sort();
        let mut all = Maps::NAMES.to_vec();
        all.sort();
        assert_eq!(
            listed, all,
            "a map added to Maps belongs in CARRIED or NOT_CARRIED"
        );
    }

    #[test]
    fn the_carried_layout_is_the_one_before() {
        assert_eq!(
            CARRIED_LAYOUT + 1,
            LAYOUT_VERSION,
            "a new map layout: say what carries over from the one before (CARRIED_LAYOUT, carry)"
        );
    }
}
