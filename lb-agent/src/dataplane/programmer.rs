//! Turns the desired model into map contents, safely for packets in flight:
//! - a service's new Maglev table is written into a fresh arena slice, then the service value (offset,
//!   size, flags) is replaced in one map update, then the old slice is freed, so a packet sees the old
//!   table or the new one, never a half-written one;
//! - source ranges are added before that switch and removed after it;
//! - backend slots are written before any table refers to them and cleared after none does.
//!
//! Established flows never look at tables: conntrack keeps them on their backend.

use crate::dataplane::arena::Arena;
use crate::dataplane::maglev::{self, MaglevBackend};
use crate::dataplane::model::{Protocol, ServiceId, ServiceSpec};
use crate::dataplane::Maps;
use anyhow::{bail, Context, Result};
use ipnet::IpNet;
use lb_common::{
    Addr, Backend, Service, ServiceKey, FAMILY_V4, FAMILY_V6, SVC_F_PROXY_V2, SVC_F_SOURCE_RANGES,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};

/// What an apply changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApplyReport {
    /// Services created.
    pub added: usize,
    /// Services whose settings or backends changed.
    pub updated: usize,
    /// Services removed.
    pub removed: usize,
    /// Services left as they were.
    pub unchanged: usize,
    /// Services whose allow-list now denies sources it allowed before: service id and the ranges it allows
    /// (none: every source is denied). Their flows from denied sources are for the caller to end.
    pub narrowed: Vec<(u32, BTreeSet<IpNet>)>,
}

#[derive(Clone, Debug)]
struct Applied {
    id: u32,
    /// Arena slice (offset, len); len 0 = no table.
    table: (u32, u32),
    /// Backends of the current table, sorted; `None` when adopted from pinned maps (unknown).
    backends: Option<Vec<SocketAddr>>,
    source_ranges: BTreeSet<IpNet>,
    value: Service,
}

/// Keeps the data plane's maps equal to the desired services.
pub struct Programmer {
    services: BTreeMap<ServiceId, Applied>,
    /// Backend slot per (node, NodePort) and how many services use it.
    backend_ids: HashMap<SocketAddr, (u32, u32)>,
    free_backend_ids: BTreeSet<u32>,
    free_service_ids: BTreeSet<u32>,
    vips: BTreeSet<IpAddr>,
    arena: Arena,
}

impl Programmer {
    /// A programmer for empty maps of the given capacities.
    pub fn new(max_services: u32, max_backends: u32, maglev_slots: u32) -> Self {
        Programmer {
            services: BTreeMap::new(),
            backend_ids: HashMap::new(),
            free_backend_ids: (0..max_backends).collect(),
            free_service_ids: (0..max_services).collect(),
            vips: BTreeSet::new(),
            arena: Arena::new(maglev_slots),
        }
    }

    /// Re-adopts what a previous agent left in pinned maps, so that the next [`Self::apply`] replaces it
    /// step by step (flows keep running meanwhile) instead of starting from scratch.
    pub fn adopt(
        maps: &mut Maps,
        max_services: u32,
        max_backends: u32,
        maglev_slots: u32,
    ) -> Result<Self> {
        let mut p = Programmer::new(max_services, max_backends, maglev_slots);
        let mut used = Vec::new();
        for (key, value) in maps.services.entries()? {
            let Some(id) = service_id(&key) else {
                continue;
            };
            p.free_service_ids.remove(&value.id);
            used.push((value.table_offset, value.table_size));
            p.services.insert(
                id,
                Applied {
                    id: value.id,
                    table: (value.table_offset, value.table_size),
                    backends: None,
                    source_ranges: BTreeSet::new(),
                    value,
                },
            );
        }
        p.arena = Arena::from_used(maglev_slots, &used).context("pinned Maglev tables overlap")?;
        let by_svc: HashMap<u32, ServiceId> = p.services.iter().map(|(k, a)| (a.id, *k)).collect();
        for (svc, addr, len) in maps.source_ranges.entries() {
            if let Some(sid) = by_svc.get(&svc) {
                if let Ok(net) = IpNet::new(addr_to_ip(&addr, sid.vip.is_ipv4()), len as u8) {
                    p.services.get_mut(sid).unwrap().source_ranges.insert(net);
                }
            }
        }
        // VIPS keys carry no family: an address that an adopted IPv6 service uses is IPv6, any other with
        // nothing after its first four bytes IPv4.
        let v6: std::collections::HashSet<Addr> = p
            .services
            .iter()
            .filter(|(k, _)| k.vip.is_ipv6())
            .flat_map(|(k, a)| [ip_to_addr(k.vip), a.value.snat_addr])
            .collect();
        for a in maps.vips.keys()? {
            let v4 = !v6.contains(&a) && a.bytes[4..].iter().all(|b| *b == 0);
            p.vips.insert(addr_to_ip(&a, v4));
        }
        // Backend slots in use: every slot that any adopted table references. They are released when the
        // adopted tables are replaced.
        let mut slots = BTreeSet::new();
        for a in p.services.values() {
            for id in maps.maglev.read(a.table.0, a.table.1)? {
                slots.insert(id);
            }
        }
        for id in slots {
            let b = maps.backends.get(id)?;
            if b.family == 0 {
                continue;
            }
            let ip = addr_to_ip(&b.addr, b.family == FAMILY_V4);
            let sa = SocketAddr::new(ip, u16::from_be(b.port_be));
            p.free_backend_ids.remove(&id);
            p.backend_ids.insert(sa, (id, 0));
        }
        Ok(p)
    }

    /// Number of services programmed.
    pub fn len(&self) -> usize {
        self.services.len()
    }

    /// Whether no service is programmed.
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }

    /// The data-plane id of a service (its counters' index).
    pub fn service_index(&self, id: &ServiceId) -> Option<u32> {
        self.services.get(id).map(|a| a.id)
    }

    /// Every programmed service with its data-plane id.
    pub fn service_indices(&self) -> impl Iterator<Item = (&ServiceId, u32)> {
        self.services.iter().map(|(k, a)| (k, a.id))
    }

    /// Validates the whole desired state; nothing is written when this fails. A service's backends and SNAT
    /// address must be of its VIP's family (the data plane translates addresses, not families).
    pub fn validate(desired: &[ServiceSpec]) -> Result<()> {
        let mut seen = BTreeSet::new();
        for s in desired {
            if s.id.port == 0 {
                bail!("service {}: port 0 is not a valid service port", s.id);
            }
            if !seen.insert(s.id) {
                bail!("service {} is listed twice", s.id);
            }
            let v4 = s.id.vip.is_ipv4();
            if let Some(snat) = s.snat {
                if snat.is_ipv4() != v4 {
                    bail!(
                        "service {}: SNAT address {snat} is not of the VIP's family",
                        s.id
                    );
                }
            }
            for b in &s.backends {
                if b.ip().is_ipv4() != v4 {
                    bail!(
                        "service {}: backend {b} is not of the VIP's family (no NAT46/NAT64)",
                        s.id
                    );
                }
                if b.port() == 0 {
                    bail!("service {}: backend {b} has port 0", s.id);
                }
            }
        }
        Ok(())
    }

    /// Makes the maps equal to `desired`. On error, services already switched keep their new state and the
    /// others their old one; every service stays consistent and the next apply converges.
    pub fn apply(&mut self, maps: &mut Maps, desired: &[ServiceSpec]) -> Result<ApplyReport> {
        Self::validate(desired)?;
        let mut report = ApplyReport::default();
        let wanted: BTreeSet<ServiceId> = desired.iter().map(|s| s.id).collect();

        // Remove first: frees ids, arena space and backend slots for what comes.
        let gone: Vec<ServiceId> = self
            .services
            .keys()
            .filter(|k| !wanted.contains(k))
            .copied()
            .collect();
        for id in gone {
            self.remove(maps, &id)?;
            report.removed += 1;
        }
        for spec in desired {
            match self.upsert(maps, spec, &mut report)? {
                Change::Added => report.added += 1,
                Change::Updated => report.updated += 1,
                Change::Unchanged => report.unchanged += 1,
            }
        }
        self.sync_vips(maps, desired)?;
        Ok(report)
    }

    fn upsert(
        &mut self,
        maps: &mut Maps,
        spec: &ServiceSpec,
        report: &mut ApplyReport,
    ) -> Result<Change> {
        let mut backends = spec.backends.clone();
        backends.sort();
        backends.dedup();
        // Only the VIP's family's ranges can match its clients. The allow-list is on whenever any range is
        // configured, so a list naming only the other family denies this service's clients rather than
        // allowing everyone.
        let ranges: BTreeSet<IpNet> = spec
            .source_ranges
            .iter()
            .filter(|r| r.addr().is_ipv4() == spec.id.vip.is_ipv4())
            .map(|r| r.trunc())
            .collect();
        let restricted = !spec.source_ranges.is_empty();
        let key = service_key(&spec.id);
        let existing = self.services.get(&spec.id).cloned();
        let (svc_idx, is_new) = match &existing {
            Some(a) => (a.id, false),
            None => {
                let Some(id) = self.free_service_ids.pop_first() else {
                    bail!(
                        "service {}: the services map is full ({} services); raise --max-services",
                        spec.id,
                        self.services.len()
                    );
                };
                maps.service_stats.reset(id)?;
                (id, true)
            }
        };

        // Table: rebuild only when the backend set changed (or is unknown after adoption).
        let same_backends = existing
            .as_ref()
            .and_then(|a| a.backends.as_ref())
            .is_some_and(|b| *b == backends);
        let table = if same_backends {
            existing.as_ref().unwrap().table
        } else if backends.is_empty() {
            (0, 0)
        } else {
            let mb: Vec<MaglevBackend> = backends
                .iter()
                .map(|b| {
                    Ok(MaglevBackend {
                        key: b.to_string().into_bytes(),
                        id: self.acquire_backend(maps, *b)?,
                        weight: 1,
                    })
                })
                .collect::<Result<_>>()?;
            let size = maglev::table_size_for(mb.len());
            let t = maglev::build(&mb, size);
            let Some(offset) = self.arena.alloc(size) else {
                for b in &backends {
                    self.release_backend(maps, *b)?;
                }
                bail!(
                    "service {}: no room for a Maglev table of {size} slots ({} free of {}); raise --maglev-slots",
                    spec.id,
                    self.arena.free_slots(),
                    self.arena.total()
                );
            };
            maps.maglev.write(offset, &t)?;
            (offset, size)
        };

        let old_ranges = existing
            .as_ref()
            .map(|a| a.source_ranges.clone())
            .unwrap_or_default();
        for r in ranges.difference(&old_ranges) {
            maps.source_ranges
                .insert(svc_idx, ip_to_addr(r.addr()), r.prefix_len() as u32)?;
        }

        let value = Service {
            id: svc_idx,
            flags: if restricted { SVC_F_SOURCE_RANGES } else { 0 }
                | if spec.proxy_v2 && spec.id.protocol == Protocol::Tcp {
                    SVC_F_PROXY_V2
                } else {
                    0
                },
            table_offset: table.0,
            table_size: table.1,
            idle_timeout_s: spec.idle_timeout.as_secs().min(u32::MAX as u64) as u32,
            _pad: 0,
            snat_addr: ip_to_addr(spec.snat.unwrap_or(spec.id.vip)),
        };
        let changed = existing.as_ref().map(|a| a.value) != Some(value);
        if changed {
            maps.services.insert(&key, &value)?;
        }

        for r in old_ranges.difference(&ranges) {
            maps.source_ranges
                .remove(svc_idx, ip_to_addr(r.addr()), r.prefix_len() as u32)?;
        }
        let ranges_changed = ranges != old_ranges;
        let was_restricted = existing
            .as_ref()
            .is_some_and(|a| a.value.flags & SVC_F_SOURCE_RANGES != 0);
        if !is_new
            && restricted
            && (!was_restricted || old_ranges.difference(&ranges).next().is_some())
        {
            report.narrowed.push((svc_idx, ranges.clone()));
        }
        self.services.insert(
            spec.id,
            Applied {
                id: svc_idx,
                table,
                backends: Some(backends),
                source_ranges: ranges,
                value,
            },
        );
        if !same_backends {
            // The service now uses the new table (or none): the old one and its backend references go.
            if let Some(old) = &existing {
                if old.table.1 > 0 {
                    self.arena.free(old.table.0, old.table.1);
                }
                match &old.backends {
                    Some(bs) => {
                        for b in bs.clone() {
                            self.release_backend(maps, b)?;
                        }
                    }
                    None => self.release_orphan_backends(maps)?,
                }
            }
        }
        Ok(if is_new {
            Change::Added
        } else if changed || ranges_changed || !same_backends {
            Change::Updated
        } else {
            Change::Unchanged
        })
    }

    fn remove(&mut self, maps: &mut Maps, id: &ServiceId) -> Result<()> {
        let Some(a) = self.services.get(id).cloned() else {
            return Ok(());
        };
        maps.services.remove(&service_key(id))?;
        for r in &a.source_ranges {
            maps.source_ranges
                .remove(a.id, ip_to_addr(r.addr()), r.prefix_len() as u32)?;
        }
        if a.table.1 > 0 {
            self.arena.free(a.table.0, a.table.1);
        }
        self.services.remove(id);
        match &a.backends {
            Some(bs) => {
                for b in bs {
                    self.release_backend(maps, *b)?;
                }
            }
            None => self.release_orphan_backends(maps)?,
        }
        self.free_service_ids.insert(a.id);
        Ok(())
    }

    fn acquire_backend(&mut self, maps: &mut Maps, b: SocketAddr) -> Result<u32> {
        if let Some((id, refs)) = self.backend_ids.get_mut(&b) {
            *refs += 1;
            return Ok(*id);
        }
        let Some(id) = self.free_backend_ids.pop_first() else {
            bail!("backend {b}: the backends map is full; raise --max-backends");
        };
        maps.backends.set(
            id,
            &Backend {
                addr: ip_to_addr(b.ip()),
                port_be: b.port().to_be(),
                family: if b.is_ipv4() { FAMILY_V4 } else { FAMILY_V6 },
                _pad: 0,
            },
        )?;
        self.backend_ids.insert(b, (id, 1));
        Ok(id)
    }

    fn release_backend(&mut self, maps: &mut Maps, b: SocketAddr) -> Result<()> {
        let adopted = self.adopted_tables_remain();
        let Some((id, refs)) = self.backend_ids.get_mut(&b) else {
            return Ok(());
        };
        *refs = refs.saturating_sub(1);
        if *refs == 0 && !adopted {
            let id = *id;
            self.backend_ids.remove(&b);
            maps.backends.set(id, &Backend::default())?;
            self.free_backend_ids.insert(id);
        }
        Ok(())
    }

    /// Adopted backend slots carry no reference counts; once no adopted table is left, every slot without
    /// a reference is free.
    fn release_orphan_backends(&mut self, maps: &mut Maps) -> Result<()> {
        if self.adopted_tables_remain() {
            return Ok(());
        }
        let orphans: Vec<SocketAddr> = self
            .backend_ids
            .iter()
            .filter(|(_, (_, refs))| *refs == 0)
            .map(|(k, _)| *k)
            .collect();
        for b in orphans {
            let (id, _) = self.backend_ids.remove(&b).unwrap();
            maps.backends.set(id, &Backend::default())?;
            self.free_backend_ids.insert(id);
        }
        Ok(())
    }

    fn adopted_tables_remain(&self) -> bool {
        self.services.values().any(|a| a.backends.is_none())
    }

    fn sync_vips(&mut self, maps: &mut Maps, desired: &[ServiceSpec]) -> Result<()> {
        let mut want = BTreeSet::new();
        for s in desired {
            want.insert(s.id.vip);
            want.insert(s.snat.unwrap_or(s.id.vip));
        }
        for ip in want.difference(&self.vips) {
            maps.vips.insert(&ip_to_addr(*ip), &1)?;
        }
        for ip in self.vips.difference(&want) {
            maps.vips.remove(&ip_to_addr(*ip))?;
        }
        self.vips = want;
        Ok(())
    }
}

enum Change {
    Added,
    Updated,
    Unchanged,
}

/// The map key of a service.
pub fn service_key(id: &ServiceId) -> ServiceKey {
    ServiceKey {
        addr: ip_to_addr(id.vip),
        port_be: id.port.to_be(),
        proto: id.protocol.number(),
        family: if id.vip.is_ipv4() {
            FAMILY_V4
        } else {
            FAMILY_V6
        },
    }
}

fn service_id(key: &ServiceKey) -> Option<ServiceId> {
    let protocol = match key.proto {
        lb_common::PROTO_TCP => crate::dataplane::model::Protocol::Tcp,
        lb_common::PROTO_UDP => crate::dataplane::model::Protocol::Udp,
        _ => return None,
    };
    Some(ServiceId {
        vip: addr_to_ip(&key.addr, key.family == FAMILY_V4),
        port: u16::from_be(key.port_be),
        protocol,
    })
}

/// An address in the data plane's 16-byte form.
pub fn ip_to_addr(ip: IpAddr) -> Addr {
    let mut bytes = [0u8; 16];
    match ip {
        IpAddr::V4(v4) => bytes[..4].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => bytes = v6.octets(),
    }
    Addr { bytes }
}

/// The address of the data plane's 16-byte form.
pub fn addr_to_ip(a: &Addr, v4: bool) -> IpAddr {
    if v4 {
        IpAddr::from([a.bytes[0], a.bytes[1], a.bytes[2], a.bytes[3]])
    } else {
        IpAddr::from(a.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::model::Protocol;
    use std::time::Duration;

    fn spec(vip: &str, snat: Option<&str>, backends: &[&str]) -> ServiceSpec {
        ServiceSpec {
            id: ServiceId {
                vip: vip.parse().unwrap(),
                port: 80,
                protocol: Protocol::Tcp,
            },
            snat: snat.map(|s| s.parse().unwrap()),
            idle_timeout: Duration::from_secs(60),
            source_ranges: vec![],
            backends: backends.iter().map(|b| b.parse().unwrap()).collect(),
            proxy_v2: false,
        }
    }

    #[test]
    fn ipv6_services_validate_and_families_must_match() {
        Programmer::validate(&[
            spec("10.0.0.1", None, &["10.0.0.11:30080"]),
            spec("fd00::1", Some("fd00::5"), &["[fd00::11]:30080"]),
        ])
        .unwrap();
        let e = Programmer::validate(&[spec("10.0.0.1", None, &["[fd00::11]:30080"])]).unwrap_err();
        assert!(e.to_string().contains("not of the VIP's family"), "{e}");
        let e = Programmer::validate(&[spec("fd00::1", Some("10.0.0.5"), &[])]).unwrap_err();
        assert!(e.to_string().contains("SNAT address 10.0.0.5"), "{e}");
    }

    #[test]
    fn service_keys_carry_the_family() {
        let k = service_key(&spec("fd00::1", None, &[]).id);
        assert_eq!(k.family, FAMILY_V6);
        assert_eq!(
            service_id(&k).unwrap().vip,
            "fd00::1".parse::<IpAddr>().unwrap()
        );
        let k = service_key(&spec("10.0.0.1", None, &[]).id);
        assert_eq!(k.family, FAMILY_V4);
        assert_eq!(
            service_id(&k).unwrap().vip,
            "10.0.0.1".parse::<IpAddr>().unwrap()
        );
    }
}
