//! The agent's main loop: desired config + backend health → maps; next hops kept resolved; idle flows
//! collected; a metrics snapshot refreshed. Config sources ([`crate::source`]) feed it through a watch
//! channel of [`ConfigState`], so the file and Kubernetes modes share everything from here on.

use crate::dataplane::gc;
use crate::dataplane::model::{Protocol, ServiceSpec};
use crate::dataplane::neighbor;
use crate::dataplane::nic::Nic;
use crate::dataplane::programmer::{ip_to_addr, Programmer};
use crate::dataplane::route_events::RouteEvents;
use crate::dataplane::{AttachMode, ConnectionLru, Dataplane, MapSizes};
use crate::ha::{Ha, HaOptions, HaSnapshot};
use crate::health::{HealthChecker, HealthMap};
use crate::report::metrics::{ServiceMetrics, SharedSnapshot, Snapshot};
use crate::report::{AgentStatus, BgpStatus};
use crate::source::config::DesiredConfig;
use crate::source::ConfigState;
use anyhow::{Context, Result};
use lb_common::{stat, NextHop};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Agent settings that are not part of the load balancer's config.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// Interface that carries the VIP (VRRP runs there; the pin directory is named after it).
    pub interface: String,
    /// Further interfaces to forward on (backends routed through them).
    pub forward_interfaces: Vec<String>,
    /// XDP (native with generic fallback), or TC.
    pub attach_mode: AttachMode,
    /// bpffs directory for pinned maps and links; `None` = no pinning (state dies with the process).
    pub pin_dir: Option<PathBuf>,
    /// Map capacities.
    pub sizes: MapSizes,
    /// SNAT port range and hash seed.
    pub dataplane: lb_common::Config,
    /// Override every service's SNAT address, at most one per family (a service keeps its own where its
    /// family has none).
    pub snat_override: Vec<IpAddr>,
    /// Idle-flow collection period.
    pub gc_interval: Duration,
    /// Next-hop refresh period.
    pub neighbor_interval: Duration,
    /// Detach the program on exit even when pinned (default: leave it, so a restart keeps flows). Also stops
    /// keepalived on exit (by default it keeps running, so an agent restart does not move the VIP).
    pub detach_on_exit: bool,
    /// VRRP and connection-state sync between replicas.
    pub ha: HaOptions,
    /// Start from empty connection tables where an agent of a map layout this one cannot carry over is attached,
    /// instead of refusing to start (see `dataplane::layouts`).
    pub clean_start: bool,
}

impl AgentOptions {
    /// Every interface the agent forwards on, the VIP's first: slot `i + 1` of the data plane's egress table.
    pub fn interfaces(&self) -> impl Iterator<Item = &String> {
        std::iter::once(&self.interface).chain(&self.forward_interfaces)
    }
}

/// Runs until `shutdown` resolves.
pub async fn run(
    opts: AgentOptions,
    mut config_rx: watch::Receiver<ConfigState>,
    status_tx: watch::Sender<AgentStatus>,
    snapshot: SharedSnapshot,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let mut agent = Agent::start(opts, status_tx, snapshot).await?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    // The initial value of a watch channel is not a change: look at it once.
    let mut config_changed = true;
    loop {
        if config_changed {
            config_changed = false;
            let cs = config_rx.borrow_and_update().clone();
            agent.take_config(cs).await?;
        }
        tokio::select! {
            _ = &mut shutdown => break,
            r = config_rx.changed() => {
                if r.is_err() {
                    tracing::warn!("config source ended");
                    break;
                }
                config_changed = true;
            }
            r = agent.health_rx.changed() => {
                if r.is_ok() {
                    // Seen: `apply` programs the backends' health as it is now.
                    agent.health_rx.borrow_and_update();
                    agent.apply();
                }
            }
            r = route_change(agent.routes.as_ref()) => match r {
                Ok(()) => agent.routes_changed = true,
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "watching route changes failed; next hops follow the periodic refresh only");
                    agent.routes = None;
                }
            },
            _ = tick.tick() => agent.tick().await?,
        }
    }
    agent.stop().await;
    Ok(())
}

/// The next route change, or never without a subscription.
async fn route_change(routes: Option<&RouteEvents>) -> Result<()> {
    match routes {
        Some(r) => r.changed().await,
        None => std::future::pending().await,
    }
}

/// The main loop's state, owned by [`run`]: the data plane and what programs it, HA, the health checks, where
/// the loop reports, and what it remembers between events.
struct Agent {
    opts: AgentOptions,
    dp: Dataplane,
    programmer: Programmer,
    ha: Ha,
    hc: HealthChecker,
    health_rx: watch::Receiver<HealthMap>,
    status_tx: watch::Sender<AgentStatus>,
    snapshot: SharedSnapshot,
    /// The last valid config and its generation.
    current: Option<Arc<DesiredConfig>>,
    generation: Option<u64>,
    /// Generation now in the maps.
    applied_generation: Option<u64>,
    /// Configs applied and failures (rejected or refused by the maps), for the metrics.
    applied: u64,
    errors: u64,
    /// Idle expiries per service id since the start.
    idle_expired: HashMap<u32, u64>,
    /// The data plane's "no next hop" counter at the last next-hop refresh: a change triggers one.
    last_no_nexthop: u64,
    /// Backends whose connections stay (healthy or draining) at the last apply; `None` before the first.
    serving: Option<BTreeSet<(Protocol, std::net::SocketAddr)>>,
    /// Connections ended per service id since the start because their backend failed or left.
    ended: HashMap<u32, u64>,
    /// Backend addresses with a next hop in the map; only they go into tables.
    /// Next-hop keys in the map (the 16-byte form: its keys carry no family).
    resolved: HashSet<lb_common::Addr>,
    /// Active-active: the VIPs left out of the BGP announcement for want of a SNAT address of their family.
    unannounced: Vec<IpAddr>,
    /// The interfaces the data plane is attached to, with the hook on each.
    attached: Vec<(String, AttachMode)>,
    /// Their NICs, and whether native XDP transmits under a lock there.
    nics: Vec<(String, Nic, bool)>,
    last_gc: Instant,
    last_nh: Instant,
    /// The kernel's route changes (`None` when the subscription failed: the periodic refresh remains), and
    /// whether one arrived since the last next-hop refresh.
    routes: Option<RouteEvents>,
    routes_changed: bool,
}

impl Agent {
    /// Loads and attaches the data plane (adopting what a previous agent pinned), and opens HA.
    async fn start(
        opts: AgentOptions,
        status_tx: watch::Sender<AgentStatus>,
        snapshot: SharedSnapshot,
    ) -> Result<Self> {
        let mut dp = Dataplane::load(&opts.sizes, opts.pin_dir.as_deref())?;
        let per_cpu = dp.maps.flows.per_cpu_lru();
        if per_cpu != (opts.sizes.connection_lru == ConnectionLru::PerCpu) {
            tracing::info!(
                per_cpu_lists = per_cpu,
                "the pinned connection tables keep the LRU lists they were made with; --connection-lru applies when \
                 they are made again (a map layout change, or a clean start)"
            );
        }
        // Before anything writes the new maps: an upgrade across a map layout change brings the previous layout's
        // state along (the services adopted below included).
        let carried = dp.carry_over(opts.clean_start)?;
        crate::report::kernel_log::spawn(&mut dp)?;
        let ha = Ha::start(opts.ha.clone(), &mut dp.maps).await?;
        let (flags, local_mac) = ha.dataplane_settings(&opts.interface)?;
        dp.maps.config.set(
            lb_common::CONFIG_INDEX,
            &lb_common::Config {
                flags,
                local_mac,
                ..opts.dataplane
            },
        )?;
        let programmer = if opts.pin_dir.is_some() {
            Programmer::adopt(
                &mut dp.maps,
                opts.sizes.services,
                opts.sizes.backends,
                opts.sizes.maglev_slots,
            )
            .context("adopting pinned maps")?
        } else {
            Programmer::new(
                opts.sizes.services,
                opts.sizes.backends,
                opts.sizes.maglev_slots,
            )
        };
        if !programmer.is_empty() {
            tracing::info!(
                services = programmer.len(),
                "adopted the previous agent's services; flows keep running"
            );
        }
        let mut attached = Vec::new();
        let mut nics = Vec::new();
        let possible_cpus = crate::dataplane::nic::possible_cpus();
        for (i, iface) in opts.interfaces().enumerate() {
            // Slot 1 upwards in the order given: replicas configured alike share the slots (flow sync carries
            // them).
            let (ifindex, mac) = neighbor::interface(iface)?;
            dp.maps.set_egress(i as u32 + 1, ifindex, mac)?;
            let used = dp.attach(iface, opts.attach_mode)?;
            tracing::info!(interface = %iface, mode = ?used, "data plane attached");
            if let Some((first, mode)) = attached.first() {
                if used != *mode {
                    tracing::warn!(interface = %iface, mode = ?used, %first, first_mode = ?mode,
                        "attached in another mode than the first interface");
                }
            }
            attached.push((iface.clone(), used));
            let nic = Nic::read(iface);
            let locked = nic.xdp_tx_locked(used, possible_cpus);
            tracing::info!(interface = %iface, driver = nic.driver.as_deref().unwrap_or("-"),
                rx_queues = nic.rx_queues, tx_queues = nic.tx_queues, max_combined = ?nic.max_combined, "NIC queues");
            if locked {
                tracing::warn!(interface = %iface, queue_pairs = ?nic.max_combined, stack_queues = nic.tx_queues,
                    possible_cpus,
                    "virtio-net has too few queue pairs for native XDP's transmits: XDP_TX and XDP_REDIRECT share \
                     the stack's queues under a lock (slower on several CPUs); XDP needs {possible_cpus} queue pairs \
                     of its own beside the stack's N (ethtool -L {iface} combined N), i.e. a NIC with more queue \
                     pairs than CPUs (OpenStack's hw_vif_multiqueue_enabled=true gives one per vCPU)");
            }
            nics.push((iface.clone(), nic, locked));
        }
        // After an upgrade across a map layout change: what the old program added since the carry, then the old
        // layout's maps once every link moved here.
        if let Some(c) = carried {
            dp.finish_carry_over(c)?;
        }
        for dir in dp.remove_other_layouts()? {
            tracing::info!(dir = %dir.display(), "removed the pins of an earlier map layout");
        }
        if attached.len() > 1 && attached.iter().any(|(_, m)| *m == AttachMode::XdpGeneric) {
            // Measured: bulk TCP across interfaces stops (bench connections --routed, generic XDP 0 Gbit/s).
            tracing::warn!(
                "generic XDP cannot redirect GRO/TSO super-packets to another interface (they exceed its MTU and \
                 the kernel drops them): bulk transfers across interfaces stall; use --attach-mode tc or native \
                 XDP, or turn GRO off on these interfaces"
            );
        }
        status_tx.send_modify(|s| {
            s.dataplane_ready = true;
            s.attached = attached.clone();
            s.xdp_tx_locked = nics
                .iter()
                .filter(|(_, _, locked)| *locked)
                .map(|(i, _, _)| i.clone())
                .collect();
        });
        let (hc, health_rx) = HealthChecker::new()?;
        let resolved = resolved_nexthops(&dp)?;
        let last_nh = Instant::now() - opts.neighbor_interval;
        let routes = RouteEvents::open()
            .map_err(|e| {
                tracing::warn!(error = %format!("{e:#}"), "route changes are not watched; next hops follow the periodic refresh only")
            })
            .ok();
        Ok(Agent {
            opts,
            dp,
            programmer,
            ha,
            hc,
            health_rx,
            status_tx,
            snapshot,
            current: None,
            generation: None,
            applied_generation: None,
            applied: 0,
            errors: 0,
            idle_expired: HashMap::new(),
            last_no_nexthop: 0,
            serving: None,
            ended: HashMap::new(),
            resolved,
            unannounced: Vec::new(),
            attached,
            nics,
            last_gc: Instant::now(),
            last_nh,
            routes,
            routes_changed: false,
        })
    }

    /// Takes what the config source published: a valid config goes into the maps (and to HA and the health
    /// checks); an invalid one is reported while the last valid one keeps forwarding.
    async fn take_config(&mut self, cs: ConfigState) -> Result<()> {
        match cs {
            ConfigState::Pending => {}
            ConfigState::Valid(cfg, generation) => {
                self.hc
                    .set_targets(&cfg.health_check, &cfg.health_targets());
                self.current = Some(cfg);
                self.generation = Some(generation);
                self.status_tx.send_modify(|s| {
                    s.config_error = None;
                    s.desired_generation = Some(generation);
                });
                // Resolve the new backends' next hops before they enter tables (bounded wait for ARP); known
                // ones are refreshed by the periodic pass, off the config path.
                self.refresh_nexthops(Duration::from_millis(500), true)?;
                self.apply();
                self.update_ha().await?;
            }
            ConfigState::Invalid(msg, generation) => {
                tracing::error!(error = %msg, "configuration rejected; the last valid one keeps forwarding");
                self.errors += 1;
                self.status_tx.send_modify(|s| {
                    s.config_error = Some(msg);
                    s.desired_generation = Some(generation);
                });
            }
        }
        Ok(())
    }

    /// The once-a-second pass: next hops (periodically, or when the data plane met an unknown one), idle flows
    /// (every GC interval), HA, and the metrics snapshot.
    async fn tick(&mut self) -> Result<()> {
        let stats = self.dp.maps.stats.totals()?;
        let no_nh = stats[stat::PASS_NO_NEXTHOP as usize];
        // A route change (a routing daemon moved a backend) is taken at this tick: one refresh per burst.
        if self.last_nh.elapsed() >= self.opts.neighbor_interval
            || no_nh != self.last_no_nexthop
            || self.routes_changed
        {
            self.last_no_nexthop = no_nh;
            self.routes_changed = false;
            match self.refresh_nexthops(Duration::ZERO, false) {
                Ok(true) => self.apply(),
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "next-hop refresh failed"),
            }
            self.last_nh = Instant::now();
        }
        let mut gc = None;
        if self.last_gc.elapsed() >= self.opts.gc_interval {
            self.last_gc = Instant::now();
            gc = Some(self.collect_flows()?);
        }
        self.update_ha().await?;
        let ha = self.opts.ha.enabled().then_some(self.ha.snapshot().await);
        self.update_snapshot(gc, &stats, ha);
        Ok(())
    }

    /// One GC pass over the flow tables; with sync, the connections used since the last pass go to the peers.
    fn collect_flows(&mut self) -> Result<gc::GcReport> {
        let gc_interval = self.opts.gc_interval;
        // Connections used since the last pass (plus slack: data-plane timestamps move once a second).
        let window = self
            .ha
            .syncing()
            .then(|| (gc_interval * 2 + Duration::from_secs(1)).as_nanos() as u64);
        let r = gc::collect(&mut self.dp.maps, gc::now_ns(), window)?;
        self.ha.publish_refresh(&r.refresh);
        self.ha.publish_refresh(&r.refresh_v6);
        for (svc, n) in &r.expired {
            *self.idle_expired.entry(*svc).or_default() += n;
        }
        for (entries, capacity, flag) in [
            (r.entries, self.opts.sizes.flows, "--max-flows"),
            (r.entries_v6, self.opts.sizes.flows_v6, "--max-flows-v6"),
        ] {
            if entries as f64 / capacity.max(1) as f64 > 0.9 {
                tracing::warn!(
                    entries,
                    capacity,
                    "flow table over 90% full: the oldest flows get evicted; raise {flag}"
                );
            }
        }
        Ok(r)
    }

    /// Stops HA; the data plane stays attached when pinned (unless `detach_on_exit`).
    async fn stop(self) {
        let Agent { opts, dp, ha, .. } = self;
        ha.stop(opts.detach_on_exit).await;
        if opts.detach_on_exit || opts.pin_dir.is_none() {
            tracing::info!("detaching the data plane");
        } else {
            tracing::info!("exiting; the pinned data plane keeps forwarding");
        }
        drop(dp);
    }

    /// Programs the config as the backends' health and next hops allow now. Failures are reported (status,
    /// counters); the services keep their previous state.
    fn apply(&mut self) {
        let Some(cfg) = self.current.clone() else {
            return;
        };
        // (At TC the config source built the services without PROXY v2 headers: only XDP puts them in.)
        let services = effective(
            &cfg,
            &self.health_rx.borrow(),
            &self.resolved,
            &self.opts.snat_override,
        );
        // Backends whose connections stay (healthy or draining); those that left the set since the last applied
        // configuration have their connections ended below (see gc::end_flows). Before the first apply every
        // configured backend counts as serving, so that flows pinned by an earlier agent to a backend found dead
        // now end too.
        let serving = cfg.serving(&self.health_rx.borrow());
        let gone: BTreeSet<_> = match &self.serving {
            Some(before) => before.difference(&serving).copied().collect(),
            None => cfg.all_backends().difference(&serving).copied().collect(),
        };
        let t = Instant::now();
        match self.programmer.apply(&mut self.dp.maps, &services) {
            Ok(r) => {
                self.applied += 1;
                tracing::info!(
                    added = r.added,
                    updated = r.updated,
                    removed = r.removed,
                    unchanged = r.unchanged,
                    elapsed_ms = t.elapsed().as_secs_f64() * 1e3,
                    "configuration applied"
                );
                self.serving = Some(serving);
                match gc::end_flows(&mut self.dp.maps, &gone) {
                    Ok(ended) if ended.is_empty() => {}
                    Ok(ended) => {
                        let n: u64 = ended.values().sum();
                        tracing::info!(
                            connections = n,
                            backends = ?gone,
                            "ended the connections of backends that failed or left (UDP flows move; TCP clients \
                             get a reset at their next segment once the backend is silent)"
                        );
                        for (svc, n) in ended {
                            *self.ended.entry(svc).or_default() += n;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "ending the connections of failed backends failed")
                    }
                }
                match gc::end_denied_udp(&mut self.dp.maps, &r.narrowed) {
                    Ok(ended) if ended.is_empty() => {}
                    Ok(ended) => tracing::info!(
                        flows = ended.values().sum::<u64>(),
                        "deleted the UDP flows of clients a narrowed source-range list denies now"
                    ),
                    Err(e) => {
                        tracing::warn!(error = %e, "deleting the UDP flows of denied clients failed")
                    }
                }
                // Published last: whoever waits for this generation finds its flows ended too.
                let generation = self.generation;
                self.applied_generation = generation;
                self.status_tx
                    .send_modify(|s| s.applied_generation = generation);
            }
            Err(e) => {
                self.errors += 1;
                tracing::error!(error = %format!("{e:#}"), "applying the configuration failed; services keep their previous state");
                let msg = format!("{e:#}");
                self.status_tx.send_modify(|s| s.config_error = Some(msg));
            }
        }
    }

    /// Resolves backend addresses (only those without a next hop yet when `only_new`), waiting up to `wait` for
    /// ARP to answer; updates changed MACs, including in the flows that cached them. Returns whether the set of
    /// resolved addresses changed.
    fn refresh_nexthops(&mut self, wait: Duration, only_new: bool) -> Result<bool> {
        let Some(cfg) = &self.current else {
            return Ok(false);
        };
        let maps = &mut self.dp.maps;
        let ips: BTreeSet<IpAddr> = cfg.backends().iter().map(|b| b.ip()).collect();
        let existing: HashMap<lb_common::Addr, NextHop> =
            maps.nexthops.entries()?.into_iter().collect();
        let mut changed: HashMap<lb_common::Addr, gc::NewNextHop> = HashMap::new();
        let deadline = Instant::now() + wait;
        let mut pending: BTreeSet<IpAddr> = if only_new {
            ips.iter()
                .filter(|ip| !self.resolved.contains(&ip_to_addr(**ip)))
                .copied()
                .collect()
        } else {
            ips.clone()
        };
        loop {
            for ip in pending.clone() {
                let addr = ip_to_addr(ip);
                match neighbor::resolve(ip) {
                    Ok(Some(r)) => {
                        pending.remove(&ip);
                        // The interface the route names, by its egress slot; a route through an interface
                        // the agent does not forward on is followed out of the first one (and reported).
                        let slot = self.opts.interfaces().position(|i| *i == r.dev);
                        let (egress, ifindex) = match slot {
                            Some(i) => (
                                i as u8 + 1,
                                neighbor::interface(&r.dev).map(|(x, _)| x).unwrap_or(0),
                            ),
                            None => (0, 0),
                        };
                        let nh = NextHop {
                            mac: r.mac,
                            egress,
                            _pad: 0,
                            ifindex,
                        };
                        match existing.get(&addr) {
                            Some(old) if *old == nh => {}
                            old => {
                                if slot.is_none() {
                                    tracing::warn!(backend = %ip, dev = %r.dev, interface = %self.opts.interface,
                                        "backend is routed via an interface the agent does not forward on (add it with --interface); frames to it leave by the first one");
                                }
                                if let Some(old) = old {
                                    tracing::info!(backend = %ip, dev = %r.dev, "next hop changed (MAC or interface)");
                                    // An entry without an interface index was written by an agent before
                                    // multi-interface forwarding: its flows' slots stay (0: `XDP_TX`).
                                    let moved = old.ifindex != 0 && old.egress != nh.egress;
                                    changed.insert(
                                        addr,
                                        gc::NewNextHop {
                                            mac: nh.mac,
                                            egress: moved.then_some(nh.egress),
                                        },
                                    );
                                }
                                maps.nexthops.insert(&addr, &nh)?;
                            }
                        }
                    }
                    // A known MAC stays until a new one is learnt (a node that stopped answering ARP is the
                    // health checks' business).
                    Ok(None) if existing.contains_key(&addr) => {
                        pending.remove(&ip);
                    }
                    Ok(None) => {}
                    Err(e) => {
                        pending.remove(&ip);
                        tracing::warn!(backend = %ip, error = %e, "cannot resolve next hop");
                    }
                }
            }
            if pending.is_empty() || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for ip in &pending {
            tracing::debug!(backend = %ip, "next hop not resolved yet; kept out of the tables");
        }
        for addr in existing.keys() {
            if !ips.iter().any(|ip| ip_to_addr(*ip) == *addr) {
                maps.nexthops.remove(addr)?;
            }
        }
        if !changed.is_empty() {
            for k in gc::retarget(&mut maps.flows, &changed)? {
                maps.flow_filter.mark(&k);
            }
            for k in gc::retarget(&mut maps.flows_v6, &changed)? {
                maps.flow_filter.mark(&k);
            }
        }
        let resolved = resolved_nexthops(&self.dp)?;
        let differs = resolved != self.resolved;
        self.resolved = resolved;
        Ok(differs)
    }

    /// Active-active: leaves out the VIPs of a family this replica has no SNAT address of — their replies would
    /// go to the VIP, which no replica holds — and says so when that set changes.
    fn keep_announceable(&mut self, vips: &mut Vec<IpAddr>) {
        let (keep, left_out) = announceable(vips, &self.opts.snat_override);
        if left_out != self.unannounced {
            if !left_out.is_empty() {
                tracing::error!(vips = ?left_out, "not announced over BGP: no --snat-address of their family, so their replies could not come back to this replica");
            }
            self.unannounced = left_out;
        }
        *vips = keep;
    }

    /// Keeps VRRP and sync in line with the loop: VIPs and eligibility, peers and revision from the config source.
    async fn update_ha(&mut self) -> Result<()> {
        if !self.opts.ha.enabled() {
            return Ok(());
        }
        let ready = self.status_tx.borrow().up_to_date();
        let mut vips = self.current.as_ref().map(|c| c.vips()).unwrap_or_default();
        if self.opts.ha.bgp.is_some() {
            self.keep_announceable(&mut vips);
        }
        self.ha.update(ready, vips).await?;
        let vrrp = self.ha.vrrp_state();
        let bgp = self.ha.bgp().as_ref().map(BgpStatus::from);
        let vip_eligibility = self.ha.vip_eligibility();
        self.status_tx.send_if_modified(|s| {
            let changed = s.vrrp != vrrp || s.bgp != bgp || s.vip_eligibility != vip_eligibility;
            s.vrrp = vrrp;
            s.bgp = bgp;
            s.vip_eligibility = vip_eligibility;
            changed
        });
        if let Some(cfg) = &self.current {
            if let (Some(peers), Some(sync)) = (&cfg.sync_peers, &self.opts.ha.sync) {
                let port = sync.listen.port();
                self.ha.set_peers(
                    peers
                        .iter()
                        .map(|ip| std::net::SocketAddr::new(*ip, port))
                        .collect(),
                );
            }
            if let (Some(newest), Some(v)) = (cfg.newest_revision, &self.opts.ha.vrrp) {
                // Newest revision above older ones: with preemption a rollout's new machines take the VIP.
                self.ha.set_priority_bonus(if newest {
                    v.newest_bonus
                } else {
                    v.older_bonus
                });
            }
        }
        Ok(())
    }

    /// Refreshes the metrics snapshot: per-service counters and active connections (from this tick's GC pass,
    /// or as the last pass counted them), the data plane's counters `stats`, health, HA.
    fn update_snapshot(&self, gc: Option<gc::GcReport>, stats: &[u64], ha: Option<HaSnapshot>) {
        let mut services = Vec::new();
        let prev: HashMap<_, _> = self
            .snapshot
            .read()
            .unwrap()
            .services
            .iter()
            .filter_map(|m| m.id.map(|id| (id, m.active)))
            .collect();
        for (id, idx) in self.programmer.service_indices() {
            let stats = self.dp.maps.service_stats.total(idx).unwrap_or_default();
            let active = match &gc {
                Some(r) => r.active.get(&idx).copied().unwrap_or(0),
                None => prev.get(id).copied().unwrap_or(0),
            };
            services.push(ServiceMetrics {
                id: Some(*id),
                stats,
                active,
                idle_expired: self.idle_expired.get(&idx).copied().unwrap_or(0),
                ended: self.ended.get(&idx).copied().unwrap_or(0),
            });
        }
        let mut s = self.snapshot.write().unwrap();
        let flow_entries = gc.as_ref().map_or(s.flow_entries, |r| r.entries);
        let transient_entries = gc
            .as_ref()
            .map_or(s.transient_entries, |r| r.transient_entries);
        let (flow_entries_v6, transient_entries_v6) = gc
            .as_ref()
            .map_or((s.flow_entries_v6, s.transient_entries_v6), |r| {
                (r.entries_v6, r.transient_entries_v6)
            });
        let flow_filter_bits = gc
            .as_ref()
            .and_then(|r| r.flow_filter_bits)
            .unwrap_or(s.flow_filter_bits);
        // Active-active: the connections translated to this replica's own address, which no other replica can
        // carry — a machine drained on OpenStack keeps its server until they are gone.
        let own_connections = ha.as_ref().filter(|h| h.active_active).map(|_| match &gc {
            Some(r) => self
                .opts
                .snat_override
                .iter()
                .filter_map(|a| r.active_by_snat.get(a))
                .sum(),
            None => s.own_connections.unwrap_or(0),
        });
        *s = Snapshot {
            services,
            dataplane: stat::NAMES
                .iter()
                .copied()
                .zip(stats.iter().copied())
                .collect(),
            backends: self
                .health_rx
                .borrow()
                .iter()
                .map(|((p, a), h)| (*p, *a, *h))
                .collect(),
            flow_entries,
            flow_capacity: self.opts.sizes.flows as u64,
            flow_table_per_cpu_lists: self.dp.maps.flows.per_cpu_lru(),
            transient_entries,
            transient_capacity: self.opts.sizes.transient as u64,
            flow_entries_v6,
            flow_capacity_v6: self.opts.sizes.flows_v6 as u64,
            transient_entries_v6,
            transient_capacity_v6: self.opts.sizes.transient_v6 as u64,
            flow_filter_bits,
            host: crate::report::hostmetrics::read(),
            config_applied: self.applied,
            config_generation: self.applied_generation.unwrap_or(0),
            config_errors: self.errors,
            ready: self.applied > 0,
            interfaces: self
                .attached
                .iter()
                .map(|(i, m)| (i.clone(), m.describe()))
                .collect(),
            nics: self.nics.clone(),
            own_connections,
            ha,
        };
    }
}

/// The backend addresses with a next hop in the map.
fn resolved_nexthops(dp: &Dataplane) -> Result<HashSet<lb_common::Addr>> {
    Ok(dp.maps.nexthops.keys()?.into_iter().collect())
}

/// Active-active: the VIPs of a family `snat` has an address of, and the others.
fn announceable(vips: &[IpAddr], snat: &[IpAddr]) -> (Vec<IpAddr>, Vec<IpAddr>) {
    vips.iter()
        .partition(|v| snat.iter().any(|a| a.is_ipv4() == v.is_ipv4()))
}

/// The services as they must be in the maps now: healthy backends whose next hop is known, SNAT override
/// applied.
fn effective(
    cfg: &DesiredConfig,
    health: &HealthMap,
    resolved: &HashSet<lb_common::Addr>,
    snat_override: &[IpAddr],
) -> Vec<ServiceSpec> {
    let mut services = cfg.effective(health);
    for s in &mut services {
        s.backends
            .retain(|b| resolved.contains(&ip_to_addr(b.ip())));
        // An override is of one family; a family without one keeps the services' own.
        if let Some(snat) = snat_override
            .iter()
            .find(|a| a.is_ipv4() == s.id.vip.is_ipv4())
        {
            s.snat = Some(*snat);
        }
    }
    services
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::config::LocalConfig;

    #[test]
    fn only_vips_with_a_snat_address_of_their_family_are_announced() {
        let v4: IpAddr = "10.0.0.1".parse().unwrap();
        let v6: IpAddr = "fd00::1".parse().unwrap();
        let snat4: IpAddr = "10.0.0.5".parse().unwrap();
        assert_eq!(announceable(&[v4, v6], &[snat4]), (vec![v4], vec![v6]));
        let snat6: IpAddr = "fd00::5".parse().unwrap();
        assert_eq!(
            announceable(&[v4, v6], &[snat6, snat4]),
            (vec![v4, v6], vec![])
        );
    }

    #[test]
    fn resolved_backends_and_the_snat_override_apply_per_family() {
        let c: LocalConfig = serde_yaml::from_str(
            "vips: [10.0.0.1, \"fd00::1\"]\nports: [{port: 80, nodePort: 30080}]\nendpoints: [{name: n, addresses: [10.0.0.11, \"fd00::11\"]}]\n",
        )
        .unwrap();
        let cfg = DesiredConfig::try_from(&c).unwrap();
        let resolved: HashSet<lb_common::Addr> = [ip_to_addr("fd00::11".parse().unwrap())].into();
        let s = effective(
            &cfg,
            &HealthMap::new(),
            &resolved,
            &["10.0.0.5".parse().unwrap()],
        );
        assert_eq!(s[0].id.vip, "10.0.0.1".parse::<IpAddr>().unwrap());
        assert!(s[0].backends.is_empty(), "10.0.0.11 has no next hop yet");
        assert_eq!(s[0].snat, Some("10.0.0.5".parse().unwrap()));
        assert_eq!(s[1].backends, vec!["[fd00::11]:30080".parse().unwrap()]);
        assert_eq!(
            s[1].snat, None,
            "an IPv4 override leaves the IPv6 VIP its own"
        );
        Programmer::validate(&s).unwrap();
        let both: [IpAddr; 2] = ["10.0.0.5".parse().unwrap(), "fd00::5".parse().unwrap()];
        let s = effective(&cfg, &HealthMap::new(), &resolved, &both);
        assert_eq!((s[0].snat, s[1].snat), (Some(both[0]), Some(both[1])));
    }
}
