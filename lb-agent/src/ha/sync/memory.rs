//! [`MemoryFlowStore`]: an in-memory connection-tracking table.

use super::{lock, ApplyOutcome, FlowRecord, FlowStore, SyncEvent};
use lb_common::{
    Flow, FlowAddr, FlowEvent, FlowKey, FlowKeyV4, FlowKeyV6, FlowV4, FlowV6, In6, FLOW_EV_CLOSE,
    FLOW_EV_NEW, FLOW_EV_REFRESH, FLOW_F_FORWARD,
};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A stand-in for the BPF connection-tracking maps, used where no data plane runs (the sync transport's tests;
/// the BPF store, `ha::flowstore`, is tested with the real maps). Its rules are simpler than the real store's:
/// any entry that translates differently from the local one is a conflict and the local one wins (the real store
/// counts a conflict only against a connection it carries itself, and mirrors closes); FIN/RST flags only
/// accumulate; last-used times never move backwards. Both families, one table each. Clones share the tables,
/// so a test can keep a handle on the store it gave to [`super::start`].
#[derive(Clone, Default)]
pub struct MemoryFlowStore {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    v4: Entries<u32>,
    v6: Entries<In6>,
    /// `None`: every service id is known.
    services: Option<HashSet<u32>>,
}

/// One family's entries with their last use.
struct Entries<A>(HashMap<FlowKey<A>, (Flow<A>, Instant)>);

impl<A> Default for Entries<A> {
    fn default() -> Self {
        Entries(HashMap::new())
    }
}

/// The fields that decide where a flow's packets go; a difference here is a conflict.
fn translation<A: FlowAddr>(f: &Flow<A>) -> (A, A, u16, u16, u32, u32) {
    (
        f.new_src,
        f.new_dst,
        f.new_sport,
        f.new_dport,
        f.svc_id,
        f.backend_id,
    )
}

/// Last-use times are coarse (the data plane writes them at most once a second): smaller moves are noise,
/// e.g. the same record applied twice, and leave an entry unchanged.
const LAST_SEEN_GRAIN: Duration = Duration::from_secs(1);

/// Whether `at` is a real step forward from `seen`.
fn newer(at: Instant, seen: Instant) -> bool {
    at > seen + LAST_SEEN_GRAIN
}

fn used_at(age_ms: u32) -> Instant {
    let now = Instant::now();
    now.checked_sub(Duration::from_millis(age_ms.into()))
        .unwrap_or(now)
}

impl<A: FlowAddr> Entries<A> {
    fn apply(&mut self, ev: &FlowEvent<A>, at: Instant) -> ApplyOutcome {
        let flows = &mut self.0;
        let entries: Vec<(FlowKey<A>, Flow<A>)> = match ev.kind {
            FLOW_EV_NEW => vec![(ev.key, ev.fwd), (ev.fwd.partner_key(ev.key.proto), ev.rev)],
            FLOW_EV_CLOSE => vec![(ev.key, ev.fwd)],
            FLOW_EV_REFRESH => {
                return match flows.get_mut(&ev.key) {
                    Some((_, seen)) if newer(at, *seen) => {
                        *seen = at;
                        ApplyOutcome::Applied
                    }
                    _ => ApplyOutcome::Unchanged,
                };
            }
            _ => return ApplyOutcome::Error,
        };
        // All or nothing: one conflicting entry leaves both as they are.
        for (k, f) in &entries {
            if let Some((old, _)) = flows.get(k) {
                if translation(old) != translation(f) {
                    return ApplyOutcome::Conflict;
                }
            }
        }
        let mut changed = false;
        for (k, mut f) in entries {
            f.last_seen_ns = 0;
            match flows.get_mut(&k) {
                None => {
                    flows.insert(k, (f, at));
                    changed = true;
                }
                Some((old, seen)) => {
                    if old.flags | f.flags != old.flags {
                        old.flags |= f.flags;
                        changed = true;
                    }
                    if newer(at, *seen) {
                        *seen = at;
                        changed = true;
                    }
                }
            }
        }
        if changed {
            ApplyOutcome::Applied
        } else {
            ApplyOutcome::Unchanged
        }
    }

    /// Forward entries with their partner, as `FLOW_EV_NEW`; the age is that of the more recently used one.
    fn dump(&self, now: Instant, out: &mut Vec<FlowRecord>)
    where
        SyncEvent: From<FlowEvent<A>>,
    {
        for (k, (f, seen)) in &self.0 {
            if f.flags & FLOW_F_FORWARD == 0 {
                continue;
            }
            let Some((rev, rseen)) = self.0.get(&f.partner_key(k.proto)) else {
                continue;
            };
            let age = now.duration_since(*seen.max(rseen));
            out.push(FlowRecord {
                event: SyncEvent::from(FlowEvent {
                    kind: FLOW_EV_NEW,
                    _pad: [0; 7],
                    key: *k,
                    fwd: *f,
                    rev: *rev,
                }),
                age_ms: age.as_millis().min(u32::MAX as u128) as u32,
            });
        }
    }
}

impl MemoryFlowStore {
    /// An empty table that knows every service.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty table that knows only these service ids; records of others are
    /// [`ApplyOutcome::UnknownService`].
    pub fn with_services(ids: impl IntoIterator<Item = u32>) -> Self {
        let s = Self::default();
        lock(&s.inner).services = Some(ids.into_iter().collect());
        s
    }

    /// Applies a record (locally created flows go in this way too).
    pub fn apply_record(&self, rec: &FlowRecord) -> ApplyOutcome {
        let mut t = lock(&self.inner);
        let svc_id = match &rec.event {
            SyncEvent::V4(e) => e.fwd.svc_id,
            SyncEvent::V6(e) => e.fwd.svc_id,
        };
        if let Some(s) = &t.services {
            if !s.contains(&svc_id) {
                return ApplyOutcome::UnknownService;
            }
        }
        let at = used_at(rec.age_ms);
        match &rec.event {
            SyncEvent::V4(e) => t.v4.apply(e, at),
            SyncEvent::V6(e) => t.v6.apply(e, at),
        }
    }

    /// Number of entries (two per connection), both families.
    pub fn len(&self) -> usize {
        let t = lock(&self.inner);
        t.v4.0.len() + t.v6.0.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The IPv4 entry at `key` (its `last_seen_ns` is always 0 here; see [`MemoryFlowStore::age`]).
    pub fn get(&self, key: &FlowKeyV4) -> Option<FlowV4> {
        lock(&self.inner).v4.0.get(key).map(|(f, _)| *f)
    }

    /// How long ago the IPv4 entry at `key` was last used.
    pub fn age(&self, key: &FlowKeyV4) -> Option<Duration> {
        lock(&self.inner).v4.0.get(key).map(|(_, t)| t.elapsed())
    }

    /// Every IPv4 entry, in no particular order.
    pub fn entries(&self) -> Vec<(FlowKeyV4, FlowV4)> {
        lock(&self.inner)
            .v4
            .0
            .iter()
            .map(|(k, (f, _))| (*k, *f))
            .collect()
    }

    /// Every IPv6 entry, in no particular order.
    pub fn entries_v6(&self) -> Vec<(FlowKeyV6, FlowV6)> {
        lock(&self.inner)
            .v6
            .0
            .iter()
            .map(|(k, (f, _))| (*k, *f))
            .collect()
    }
}

impl FlowStore for MemoryFlowStore {
    /// Forward entries with their partner, as `FLOW_EV_NEW`; the age is that of the more recently used one.
    fn dump(&mut self) -> anyhow::Result<Vec<FlowRecord>> {
        let t = lock(&self.inner);
        let now = Instant::now();
        let mut out = Vec::new();
        t.v4.dump(now, &mut out);
        t.v6.dump(now, &mut out);
        Ok(out)
    }

    fn apply(&mut self, recs: &[FlowRecord]) -> Vec<ApplyOutcome> {
        recs.iter().map(|r| self.apply_record(r)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{FLOW_F_FIN, FLOW_F_REVERSE, PROTO_TCP};

    fn new_flow(port: u16, backend: u32) -> FlowRecord {
        let key = FlowKeyV4 {
            src: 1,
            dst: 2,
            sport: port,
            dport: 80,
            proto: PROTO_TCP,
            _pad: [0; 3],
        };
        let fwd = FlowV4 {
            new_src: 2,
            new_dst: 3,
            new_sport: port,
            new_dport: 30080,
            flags: FLOW_F_FORWARD,
            svc_id: 1,
            backend_id: backend,
            ..Default::default()
        };
        let rev = FlowV4 {
            new_src: 2,
            new_dst: 1,
            new_sport: 80,
            new_dport: port,
            flags: FLOW_F_REVERSE,
            svc_id: 1,
            backend_id: backend,
            ..Default::default()
        };
        FlowRecord {
            event: SyncEvent::V4(lb_common::FlowEventV4 {
                kind: FLOW_EV_NEW,
                _pad: [0; 7],
                key,
                fwd,
                rev,
            }),
            age_ms: 5000,
        }
    }

    #[test]
    fn applies_detects_conflicts_and_dumps() {
        let mut s = MemoryFlowStore::new();
        let a = new_flow(1000, 1);
        assert_eq!(s.apply_record(&a), ApplyOutcome::Applied);
        assert_eq!(s.len(), 2);
        assert_eq!(s.apply_record(&a), ApplyOutcome::Unchanged);
        assert_eq!(s.apply_record(&new_flow(1000, 2)), ApplyOutcome::Conflict);
        let SyncEvent::V4(ev) = a.event else {
            unreachable!()
        };
        assert_eq!(s.get(&ev.key).unwrap().backend_id, 1);
        // FIN accumulates.
        let mut c = ev;
        c.kind = FLOW_EV_CLOSE;
        c.fwd.flags |= FLOW_F_FIN;
        c.rev = FlowV4::default();
        let close = FlowRecord {
            event: SyncEvent::V4(c),
            ..a
        };
        assert_eq!(s.apply_record(&close), ApplyOutcome::Applied);
        assert_eq!(s.apply_record(&close), ApplyOutcome::Unchanged);
        // Refresh moves the age forward only.
        let mut r = ev;
        r.kind = FLOW_EV_REFRESH;
        let mut refresh = FlowRecord {
            event: SyncEvent::V4(r),
            age_ms: 10,
        };
        assert_eq!(s.apply_record(&refresh), ApplyOutcome::Applied);
        refresh.age_ms = 4000;
        assert_eq!(s.apply_record(&refresh), ApplyOutcome::Unchanged);
        assert!(s.age(&ev.key).unwrap() < Duration::from_secs(1));
        let d = s.dump().unwrap();
        assert_eq!(d.len(), 1);
        let SyncEvent::V4(dumped) = d[0].event else {
            unreachable!()
        };
        assert_eq!(dumped.fwd.flags, FLOW_F_FORWARD | FLOW_F_FIN);
        assert!(d[0].age_ms < 1000);
        // A dump applied elsewhere reproduces the table.
        let other = MemoryFlowStore::new();
        assert_eq!(other.apply_record(&d[0]), ApplyOutcome::Applied);
        let mut e1 = s.entries();
        let mut e2 = other.entries();
        e1.sort_by_key(|(k, _)| (k.src, k.sport));
        e2.sort_by_key(|(k, _)| (k.src, k.sport));
        assert_eq!(e1, e2);
    }

    #[test]
    fn unknown_services_and_kinds() {
        let s = MemoryFlowStore::with_services([7]);
        assert_eq!(
            s.apply_record(&new_flow(1, 1)),
            ApplyOutcome::UnknownService
        );
        let mut bad = new_flow(1, 1);
        if let SyncEvent::V4(e) = &mut bad.event {
            e.kind = 0;
        }
        assert_eq!(
            MemoryFlowStore::new().apply_record(&bad),
            ApplyOutcome::Error
        );
    }
}
