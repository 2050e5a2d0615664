//! High availability on one replica: VRRP ([`crate::ha::vrrp`], keepalived) decides who holds the VIP — or, active-
//! active, every eligible replica serves it and the routers spread it: announced over BGP ([`crate::ha::bgp`], BIRD),
//! or routed by someone else (the cloud controller's router routes, reading the machine's eligibility) —
//! and connection-state sync ([`crate::ha::sync`]) gives every replica the flows of the others, so a new master
//! (or the replica a flow moved to) translates established connections exactly like the old one.
//!
//! The glue here: the data plane's flow events (ring buffer) go to the peers as they happen; the periodic GC
//! pass sends refreshes; the peers' records land in the BPF maps through [`BpfFlowStore`]; and the machine is
//! only eligible for the VIP ([`Keepalived::set_healthy`], [`Bird::announce`]) while its data plane is attached,
//! its config is the latest and its flow table has caught up with every reachable peer.

pub mod bgp;
pub mod flowstore;
pub mod sync;
pub mod vrrp;

use crate::dataplane::{interface_mac, Maps};
use anyhow::{Context, Result};
use aya::maps::{MapData, RingBuf};
use bgp::{BgpOptions, BgpSnapshot, Bird};
use flowstore::BpfFlowStore;
use lb_common::{FlowAddr, FlowEvent, In6, CFG_F_CHECK_DST_MAC, CFG_F_SYNC_EVENTS};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use sync::{ApplyOutcome, FlowRecord, FlowStore, SyncCounters, SyncEvent, SyncHandle, SyncOptions};
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use vrrp::{Keepalived, VrrpOptions, VrrpState, VrrpStats};

/// Flow sync settings.
#[derive(Clone, Debug)]
pub struct SyncSettings {
    /// Listen address (the machine's own address on the VIP network, sync port).
    pub listen: SocketAddr,
    /// The other replicas' sync addresses (may include this one's; it is ignored).
    pub peers: Vec<SocketAddr>,
    /// Pre-shared key of the load balancer's replicas.
    pub secret: Vec<u8>,
}

/// What HA runs on this machine; every part is optional (a single machine runs none), VRRP and active-active
/// exclude each other.
#[derive(Clone, Debug, Default)]
pub struct HaOptions {
    /// VRRP through keepalived.
    pub vrrp: Option<VrrpOptions>,
    /// Active-active: every replica serves the VIPs at once and someone else routes them to the eligible ones
    /// (BGP below, the cloud controller's router routes, static ECMP routes). `bgp` implies it.
    pub active_active: bool,
    /// Active-active with the VIPs announced over BGP through BIRD.
    pub bgp: Option<BgpOptions>,
    /// Connection-state sync.
    pub sync: Option<SyncSettings>,
}

impl HaOptions {
    /// Whether anything is enabled.
    pub fn enabled(&self) -> bool {
        self.vrrp.is_some() || self.is_active_active() || self.sync.is_some()
    }

    /// Whether every replica serves the VIPs at once (announcing them over BGP is one way of it).
    pub fn is_active_active(&self) -> bool {
        self.active_active || self.bgp.is_some()
    }
}

/// Whether the machine should get the VIPs' traffic, and if not, why: the data plane's readiness comes first
/// (sync starts only once it is ready).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VipEligibility {
    /// Data plane attached, config current, flows caught up with every reachable peer.
    Eligible,
    /// The data plane is not attached or does not run the latest config.
    NotReady,
    /// The flow table has not caught up with the peers yet.
    NotSynced,
}

impl VipEligibility {
    fn new(ready: bool, synced: bool) -> Self {
        match (ready, synced) {
            (false, _) => VipEligibility::NotReady,
            (true, false) => VipEligibility::NotSynced,
            (true, true) => VipEligibility::Eligible,
        }
    }

    /// Whether the machine is eligible.
    pub fn eligible(self) -> bool {
        self == VipEligibility::Eligible
    }
}

/// A snapshot for metrics and status.
#[derive(Clone, Debug, Default)]
pub struct HaSnapshot {
    /// VRRP state, when VRRP runs.
    pub vrrp_state: Option<VrrpState>,
    /// keepalived's counters (when readable).
    pub vrrp_stats: Option<VrrpStats>,
    /// keepalived restarts by the supervisor.
    pub keepalived_restarts: u64,
    /// Every replica serves the VIPs at once (with BGP or without).
    pub active_active: bool,
    /// BIRD's announcement and sessions, when active-active over BGP.
    pub bgp: Option<BgpSnapshot>,
    /// Whether this machine currently offers itself for the VIP.
    pub eligible: bool,
    /// Sync counters, when sync runs.
    pub sync: Option<SyncCounters>,
    /// Sync caught up with the reachable peers.
    pub synced: bool,
}

/// The running HA parts of one agent.
pub struct Ha {
    vrrp_opts: Option<VrrpOptions>,
    keepalived: Option<Keepalived>,
    active_active: bool,
    bgp_opts: Option<BgpOptions>,
    bird: Option<Bird>,
    sync: Option<SyncHandle>,
    /// Sync waits for the first applied config: records for services this machine does not have yet would be
    /// dropped, and a dump received then would mark it synced without the flows.
    pending_sync: Option<PendingSync>,
    tasks: Vec<JoinHandle<()>>,
    peers_tx: Option<watch::Sender<Vec<SocketAddr>>>,
    master: Arc<AtomicBool>,
    eligibility: VipEligibility,
    /// Set while an adopted keepalived (agent restart) must keep the previous agent's health verdict: the
    /// pinned data plane kept forwarding, so demoting the master until this agent has caught up would only
    /// cause a needless failover.
    adopted_until: Option<std::time::Instant>,
    /// keepalived's counters and when they were read: reading makes keepalived write a file (SIGUSR2), so the
    /// agent loop does it every [`STATS_PERIOD`], not on every tick.
    stats: Option<(std::time::Instant, Option<VrrpStats>)>,
}

/// A std mutex that survives a panic elsewhere (the data stays usable: counters and maps of small values).
pub(crate) fn lock<T: ?Sized>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How often keepalived's counters are read for metrics and the LoadBalancerMachine status.
const STATS_PERIOD: std::time::Duration = std::time::Duration::from_secs(10);
/// How long the agent loop waits for keepalived to write them.
const STATS_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// How long an adopted keepalived keeps the previous agent's verdict while this one starts up.
const ADOPTION_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// [`BpfFlowStore`] behind the sync's store interface.
struct SyncStore(BpfFlowStore);

/// What sync needs to start.
struct PendingSync {
    settings: SyncSettings,
    store: SyncStore,
    /// The data plane's flow events: IPv4's ring, IPv6's ring.
    events: (RingBuf<MapData>, RingBuf<MapData>),
    peers_rx: watch::Receiver<Vec<SocketAddr>>,
}

impl FlowStore for SyncStore {
    fn dump(&mut self) -> Result<Vec<FlowRecord>> {
        self.0.dump()
    }

    fn apply(&mut self, recs: &[FlowRecord]) -> Vec<ApplyOutcome> {
        self.0.apply_batch(recs).unwrap_or_else(|e| {
            tracing::debug!(error = %format!("{e:#}"), "applying synced flows failed");
            vec![ApplyOutcome::Error; recs.len()]
        })
    }
}

impl Ha {
    /// Opens what sync needs; sync itself (listener, peers, ring-buffer reader) starts once the first config is
    /// applied, keepalived with the first VIPs (it refuses an instance without one) — both in [`Self::update`].
    pub async fn start(opts: HaOptions, maps: &mut Maps) -> Result<Ha> {
        // Active-active replicas all serve: each keeps its own connections over a peer's conflicting record.
        let active_active = opts.is_active_active();
        let master = Arc::new(AtomicBool::new(active_active));
        let mut ha = Ha {
            vrrp_opts: opts.vrrp,
            keepalived: None,
            active_active,
            bgp_opts: opts.bgp,
            bird: None,
            sync: None,
            pending_sync: None,
            tasks: Vec::new(),
            peers_tx: None,
            master: master.clone(),
            eligibility: VipEligibility::NotReady,
            adopted_until: None,
            stats: None,
        };
        if let Some(s) = opts.sync {
            let store = SyncStore(BpfFlowStore::open(maps, master)?);
            let (peers_tx, peers_rx) = watch::channel(s.peers.clone());
            ha.pending_sync = Some(PendingSync {
                settings: s,
                store,
                events: (
                    maps.take_flow_events::<u32>()?,
                    maps.take_flow_events::<In6>()?,
                ),
                peers_rx,
            });
            ha.peers_tx = Some(peers_tx);
        }
        Ok(ha)
    }

    async fn start_sync(&mut self, p: PendingSync) -> Result<()> {
        let opts = SyncOptions::new(p.settings.listen, p.peers_rx, p.settings.secret);
        let (handle, task) = sync::start(opts, p.store)
            .await
            .context("starting flow sync")?;
        tracing::info!(listen = %handle.local_addr(), "flow sync running");
        self.tasks.push(task);
        self.tasks.push(tokio::spawn(forward_events::<u32>(
            p.events.0,
            handle.clone(),
        )));
        self.tasks.push(tokio::spawn(forward_events::<In6>(
            p.events.1,
            handle.clone(),
        )));
        self.sync = Some(handle);
        Ok(())
    }

    /// Whether this machine has the flows of its peers (always, without sync).
    fn synced(&self) -> bool {
        match (&self.sync, &self.pending_sync) {
            (Some(s), _) => s.synced(),
            (None, Some(_)) => false,
            (None, None) => true,
        }
    }

    /// `lb_common::Config` flags the data plane needs for this setup, and the interface MAC for the check.
    pub fn dataplane_settings(&self, interface: &str) -> Result<(u32, [u8; 6])> {
        let mut flags = 0;
        if self.sync.is_some() || self.pending_sync.is_some() {
            flags |= CFG_F_SYNC_EVENTS;
        }
        if self.vrrp_opts.is_some() || self.active_active {
            // Several replicas on one segment: flooded frames for another one must not be forwarded twice.
            flags |= CFG_F_CHECK_DST_MAC;
        }
        let mac = if flags & CFG_F_CHECK_DST_MAC != 0 {
            interface_mac(interface)?
        } else {
            [0; 6]
        };
        Ok((flags, mac))
    }

    /// Called every loop tick and after config changes: `ready` says the data plane is attached and runs the
    /// latest config. Starts sync once ready, keepalived once there are VIPs and BIRD at once, keeps their VIPs
    /// in line, and offers the machine for the VIP (VRRP) or announces it (BGP) only when ready and synced (without
    /// BGP, active-active only reports that: [`Self::vip_eligibility`]).
    /// Fails only when sync cannot start (its listen address cannot be bound): a replica that cannot sync must
    /// not run as if it could.
    pub async fn update(&mut self, ready: bool, vips: Vec<IpAddr>) -> Result<()> {
        if ready {
            if let Some(p) = self.pending_sync.take() {
                self.start_sync(p).await?;
            }
        }
        if self.keepalived.is_none() && !vips.is_empty() {
            if let Some(opts) = self.vrrp_opts.clone() {
                match Keepalived::start(opts, vips.clone()).await {
                    Ok(k) => {
                        tracing::info!(adopted = k.adopted(), "keepalived running");
                        if k.adopted() {
                            self.adopted_until = Some(std::time::Instant::now() + ADOPTION_GRACE);
                        }
                        self.keepalived = Some(k);
                    }
                    Err(e) => {
                        tracing::error!(error = %format!("{e:#}"), "starting keepalived failed; retrying")
                    }
                }
            }
        }
        if self.bird.is_none() {
            if let Some(opts) = self.bgp_opts.clone() {
                match Bird::start(opts) {
                    Ok(b) => self.bird = Some(b),
                    Err(e) => {
                        tracing::error!(error = %format!("{e:#}"), "starting bird failed; retrying")
                    }
                }
            }
        }
        let synced = self.synced();
        let eligibility = VipEligibility::new(ready, synced);
        let eligible = eligibility.eligible();
        if eligible != self.eligibility.eligible() {
            tracing::info!(eligible, ready, synced, "eligibility for the VIP changed");
        }
        self.eligibility = eligibility;
        if let Some(b) = &self.bird {
            b.announce(if eligible { vips.clone() } else { Vec::new() });
        }
        let hold_verdict = match self.adopted_until {
            Some(until) if !eligible && std::time::Instant::now() < until => true,
            _ => {
                self.adopted_until = None;
                false
            }
        };
        if let Some(k) = &self.keepalived {
            if !hold_verdict {
                if let Err(e) = k.set_healthy(eligible) {
                    tracing::warn!(error = %e, "writing the VRRP health file failed");
                }
            }
            if !vips.is_empty() {
                if let Err(e) = k.set_vips(vips) {
                    tracing::warn!(error = %format!("{e:#}"), "updating keepalived's VIPs failed");
                }
            }
            let master = *k.state().borrow() == VrrpState::Master;
            self.master.store(master, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Priority bonus for "this machine belongs to the newest revision" (Kubernetes mode).
    pub fn set_priority_bonus(&self, bonus: u8) {
        if let Some(k) = &self.keepalived {
            if let Err(e) = k.set_priority_bonus(bonus) {
                tracing::warn!(error = %e, "writing the VRRP priority file failed");
            }
        }
    }

    /// Replaces the sync peers (Kubernetes mode reads them from the LoadBalancer).
    pub fn set_peers(&self, peers: Vec<SocketAddr>) {
        if let Some(tx) = &self.peers_tx {
            tx.send_if_modified(|p| {
                let changed = *p != peers;
                *p = peers;
                changed
            });
        }
    }

    /// Sends the periodic refresh of the connections this machine carried (from the GC pass).
    pub fn publish_refresh<A: FlowAddr>(&self, events: &[(FlowEvent<A>, u32)])
    where
        SyncEvent: From<FlowEvent<A>>,
    {
        if let Some(s) = &self.sync {
            let records: Vec<FlowRecord> = events
                .iter()
                .map(|(event, age_ms)| FlowRecord {
                    event: SyncEvent::from(*event),
                    age_ms: *age_ms,
                })
                .collect();
            s.publish(&records);
        }
    }

    /// The VRRP state, when VRRP is configured (`Stopped` until keepalived runs).
    pub fn vrrp_state(&self) -> Option<VrrpState> {
        self.vrrp_opts.as_ref()?;
        Some(
            self.keepalived
                .as_ref()
                .map_or(VrrpState::Stopped, |k| *k.state().borrow()),
        )
    }

    /// The BGP announcement and sessions, when active-active over BGP (`None` until BIRD runs).
    pub fn bgp(&self) -> Option<BgpSnapshot> {
        self.bird.as_ref().map(Bird::snapshot)
    }

    /// Whether the machine should get the VIPs' traffic as of the last [`Self::update`], when active-active (the
    /// cloud controller routes the VIPs to the machines that say so).
    pub fn vip_eligibility(&self) -> Option<VipEligibility> {
        self.active_active.then_some(self.eligibility)
    }

    /// Whether sync runs (the GC pass then collects refreshes).
    pub fn syncing(&self) -> bool {
        self.sync.is_some()
    }

    /// Current numbers (keepalived's counters as of the last read, at most [`STATS_PERIOD`] old).
    pub async fn snapshot(&mut self) -> HaSnapshot {
        let mut s = HaSnapshot {
            active_active: self.active_active,
            bgp: self.bgp(),
            eligible: self.eligibility.eligible(),
            synced: self.synced(),
            sync: self.sync.as_ref().map(|s| s.counters()),
            ..Default::default()
        };
        if let Some(k) = &self.keepalived {
            let state = *k.state().borrow();
            if self
                .stats
                .as_ref()
                .is_none_or(|(at, _)| at.elapsed() >= STATS_PERIOD)
            {
                let read = tokio::time::timeout(STATS_WAIT, k.stats()).await;
                self.stats = Some((std::time::Instant::now(), read.ok().and_then(|r| r.ok())));
            }
            s.vrrp_state = Some(state);
            s.keepalived_restarts = k.restarts();
            s.vrrp_stats = self.stats.as_ref().and_then(|(_, st)| *st).map(|mut st| {
                // The counters may be a few seconds old; the role is not.
                st.is_master = state == VrrpState::Master;
                st
            });
        } else if self.vrrp_opts.is_some() {
            s.vrrp_state = Some(VrrpState::Stopped);
        }
        s
    }

    /// Stops sync and BIRD (the routers withdraw this replica; its pinned data plane goes on translating the
    /// replies to its SNAT address). keepalived is stopped only with `stop_keepalived` (the VIP then moves to a
    /// peer); otherwise it keeps running with the data plane, and the next agent adopts it without a failover.
    pub async fn stop(mut self, stop_keepalived: bool) {
        if let Some(b) = self.bird.take() {
            b.stop().await;
        }
        if let Some(k) = self.keepalived.take().filter(|_| stop_keepalived) {
            if let Err(e) = k.stop().await {
                tracing::warn!(error = %format!("{e:#}"), "stopping keepalived");
            }
        }
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

/// Reads the data plane's flow events of family `A` as they come and hands them to the sync in batches.
async fn forward_events<A: FlowAddr>(events: RingBuf<MapData>, sync: SyncHandle)
where
    SyncEvent: From<FlowEvent<A>>,
{
    // SAFETY: the ring buffer owns its map fd for as long as the AsyncFd owns the ring buffer, and its
    // `as_raw_fd` always returns that fd.
    let mut fd = match unsafe { AsyncFd::register(events) } {
        Ok(fd) => fd,
        Err(e) => {
            tracing::error!(error = %e, "polling the flow-event ring buffer failed; flows sync only by refresh");
            return;
        }
    };
    let mut batch: Vec<FlowRecord> = Vec::with_capacity(256);
    loop {
        let mut guard = match fd.readable_mut().await {
            Ok(g) => g,
            Err(e) => {
                tracing::error!(error = %e, "flow-event ring buffer");
                return;
            }
        };
        let rb = guard.get_inner_mut();
        while let Some(item) = rb.next() {
            if item.len() >= size_of::<FlowEvent<A>>() {
                // SAFETY: the data plane writes whole `FlowEvent<A>`s on this ring; read_unaligned copes with any
                // alignment.
                let event =
                    unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<FlowEvent<A>>()) };
                batch.push(FlowRecord {
                    event: SyncEvent::from(event),
                    age_ms: 0,
                });
            }
        }
        if !batch.is_empty() {
            sync.publish(&batch);
            batch.clear();
        }
        guard.clear_ready();
        // Under churn events come thousands a second: reading each as it arrives cost a wake-up here, a frame, an
        // HMAC, a send, and on the peer a receive, an apply call and an ack — most of the sync's CPU. Letting
        // them gather for a moment sends them a frame at a time (the ring buffer holds far more than a
        // millisecond's worth), for a millisecond of sync lag.
        tokio::time::sleep(EVENT_GATHER).await;
    }
}

/// How long flow events gather in the ring buffer before they are read and sent (see `forward_events`).
const EVENT_GATHER: std::time::Duration = std::time::Duration::from_millis(5);
