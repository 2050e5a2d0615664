//! Differential fuzzing of the data plane: generated conversations, hostile and corrupted frames, IPv4 and IPv6, go
//! through the real XDP and TC programs (`BPF_PROG_TEST_RUN`; the IPv6 programs in their tail-call slots) and
//! through `model`, a reference model written from docs/design.md's "Data plane rules". Every frame's verdict, output
//! bytes and counters, and every flow-table entry it touches, must agree; both families' tables are compared whole at
//! the end of each epoch. A difference fails with the seed and the shortest sequence found that still shows it.
//! Needs root.
//!
//! `cargo test` runs a short fixed-seed pass per hook; `cargo xtask fuzz dataplane --frames N [--seed S]` runs
//! the ignored `campaign` test with `LB_FUZZ_FRAMES` / `LB_FUZZ_SEED` and prints frames/s.

#[path = "../common/mod.rs"]
mod common;
mod gen;
mod model;

use common::{Harness, Hook};
use gen::{Gen, GenFam, Op, Scenario, TableOp};
use lb_agent::dataplane::maps::{FamilyMaps, Maps};
use lb_common::{Flow, FlowEvent, FlowKey, In6, Transient};
use model::{Clock, Fault, Model, Run, Tables};
use std::collections::{HashMap, HashSet};
use std::time::Instant;

/// A family's tables in the kernel (`FamilyMaps`) and its sync ring buffer, beside the model's (`model::Fam`).
trait KFam: GenFam + FamilyMaps {
    fn events(e: &mut Events) -> &mut RingBuf;
}

impl KFam for u32 {
    fn events(e: &mut Events) -> &mut RingBuf {
        &mut e.0
    }
}

impl KFam for In6 {
    fn events(e: &mut Events) -> &mut RingBuf {
        &mut e.1
    }
}

/// Frames per epoch at most: short epochs keep every timestamp younger than the data plane's 1 s refresh step,
/// so clock-dependent rules stay decidable, and a failure's sequence short.
const EPOCH: usize = 400;

#[test]
fn xdp_short_pass() {
    campaign(Hook::Xdp, 0x5eed_0001, 50_000).print();
}

#[test]
fn tc_short_pass() {
    campaign(Hook::Tc, 0x5eed_0002, 50_000).print();
}

/// The long run behind `cargo xtask fuzz dataplane`.
#[test]
#[ignore]
fn campaign_from_env() {
    let frames = env("LB_FUZZ_FRAMES", 1_000_000);
    let seed = env("LB_FUZZ_SEED", 1);
    for (i, hook) in [Hook::Xdp, Hook::Tc].into_iter().enumerate() {
        campaign(hook, seed + i as u64, frames as usize).print();
    }
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v}: not a number"))
        })
        .unwrap_or(default)
}

/// What a campaign did.
struct Report {
    hook: Hook,
    seed: u64,
    frames: usize,
    /// Frames with IPv6's EtherType, and the counters they moved.
    ipv6: usize,
    ipv6_counters: Vec<u64>,
    refused: usize,
    /// Epochs cut short because a clock-dependent rule fell between the two clock readings, by rule.
    ambiguous: std::collections::BTreeMap<&'static str, usize>,
    epochs: usize,
    secs: f64,
    /// How often each global counter moved: which rules the frames reached.
    counters: Vec<u64>,
}

impl Report {
    fn print(&self) {
        println!(
            "differential {:?} seed {}: {} frames ({} IPv6), 0 differences, {} epochs, {} frames the kernel's test run \
             refuses (shorter than an Ethernet header), epochs cut short at a clock boundary: {:?}; {:.1} s, {:.0} \
             frames/s",
            self.hook,
            self.seed,
            self.frames,
            self.ipv6,
            self.epochs,
            self.refused,
            self.ambiguous,
            self.secs,
            self.frames as f64 / self.secs
        );
        let reached: Vec<String> = (0..self.counters.len())
            .map(|i| format!("{} {}", lb_common::stat::NAMES[i], self.counters[i]))
            .collect();
        println!("  rules reached: {}", reached.join(", "));
        let reached: Vec<String> = (0..self.ipv6_counters.len())
            .filter(|i| self.ipv6_counters[*i] != 0)
            .map(|i| format!("{} {}", lb_common::stat::NAMES[i], self.ipv6_counters[i]))
            .collect();
        println!("  by IPv6 frames: {}", reached.join(", "));
    }
}

/// Runs `frames` generated frames through `hook` and the model; panics with a minimal sequence on a difference.
fn campaign(hook: Hook, seed: u64, frames: usize) -> Report {
    // One CPU: the SYN rate guard's budget is per CPU, and the model follows one.
    // SAFETY: a CPU set for this thread only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
    let mut h = Harness::new(hook).with_ipv6();
    let mut events = (
        h.dp.maps.take_flow_events::<u32>().unwrap(),
        h.dp.maps.take_flow_events::<In6>().unwrap(),
    );
    let mut gen = Gen::new(seed);
    let start = Instant::now();
    let mut report = Report {
        hook,
        seed,
        frames: 0,
        ipv6: 0,
        ipv6_counters: vec![0; lb_common::stat::NAMES.len()],
        refused: 0,
        ambiguous: Default::default(),
        epochs: 0,
        secs: 0.0,
        counters: vec![],
    };
    let before = h.dp.maps.stats.totals().unwrap();
    while report.frames < frames {
        let scenario = gen.scenario();
        let mut model = setup(&mut h, &scenario);
        let mut ops = vec![];
        report.epochs += 1;
        let mut outcome = Ok(());
        while ops.len() < EPOCH && report.frames < frames {
            let op = gen.op(&model);
            ops.push(op.clone());
            let mut ipv6 = None;
            if let Op::Frame(f) = &op {
                report.frames += 1;
                if f.get(12..14) == Some(&[0x86, 0xdd]) {
                    report.ipv6 += 1;
                    ipv6 = Some(model.state.stats.clone());
                }
            }
            outcome = apply(&mut h, &mut events, &mut model, &op, &mut report.refused);
            if let (Some(before), Ok(())) = (ipv6, &outcome) {
                for (i, (a, b)) in model.state.stats.iter().zip(before).enumerate() {
                    report.ipv6_counters[i] += a - b;
                }
            }
            if outcome.is_err() {
                break;
            }
        }
        if outcome.is_ok() {
            outcome = compare_all(&mut h, &model);
        }
        match outcome {
            Ok(()) => {}
            Err(Fault::Ambiguous(rule)) => *report.ambiguous.entry(rule).or_default() += 1,
            Err(Fault::Differs(msg)) => fail(
                &mut h,
                &mut events,
                seed,
                report.epochs,
                &scenario,
                ops,
                &msg,
            ),
        }
    }
    report.secs = start.elapsed().as_secs_f64();
    let after = h.dp.maps.stats.totals().unwrap();
    report.counters = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    report
}

/// Programs an epoch's scenario on empty flow tables and returns a model of it.
fn setup(h: &mut Harness, s: &Scenario) -> Model {
    h.apply(&s.specs);
    h.dp.maps
        .config
        .set(lb_common::CONFIG_INDEX, &s.cfg)
        .unwrap();
    clear_tables::<u32>(&mut h.dp.maps);
    clear_tables::<In6>(&mut h.dp.maps);
    // Empty tables, empty flow filter (the model starts with no marks).
    h.dp.maps.flow_filter.clear();
    // The SYN rate guard starts with its whole budget and nobody trusted, like the model.
    let ebpf = h.dp.ebpf_mut().unwrap();
    let mut guard: aya::maps::PerCpuArray<_, u64> =
        aya::maps::PerCpuArray::try_from(ebpf.map_mut("SYN_GUARD").unwrap()).unwrap();
    let cpus = aya::util::nr_cpus().unwrap();
    guard
        .set(
            0,
            aya::maps::PerCpuValues::try_from(vec![0u64; cpus]).unwrap(),
            0,
        )
        .unwrap();
    let trusted = &mut h.dp.maps.trusted_sources;
    for k in trusted.keys().unwrap() {
        trusted.remove(&k).unwrap();
    }
    let mut t = Tables {
        cfg: s.cfg,
        ..Default::default()
    };
    let mut svc_stats = HashMap::new();
    for (k, svc) in h.dp.maps.services.entries().unwrap() {
        if svc.table_size > 0 {
            let table =
                h.dp.maps
                    .maglev
                    .read(svc.table_offset, svc.table_size)
                    .unwrap();
            for id in &table {
                t.backends.insert(*id, h.dp.maps.backends.get(*id).unwrap());
            }
            t.maglev.insert(svc.table_offset, table);
        }
        svc_stats.insert(svc.id, h.dp.maps.service_stats.total(svc.id).unwrap());
        t.services.insert(k, svc);
    }
    t.nexthops =
        h.dp.maps
            .nexthops
            .entries()
            .unwrap()
            .into_iter()
            .map(|(a, nh)| (a, nh.mac))
            .collect();
    t.source_ranges = h.dp.maps.source_ranges.entries().into_iter().collect();
    t.vips = h.dp.maps.vips.keys().unwrap().into_iter().collect();
    // The fragment rule reads this set: every VIP and SNAT address must be in it.
    for svc in t.services.iter().flat_map(|(k, s)| [k.addr, s.snat_addr]) {
        assert!(t.vips.contains(&svc), "{svc:?} missing from VIPS");
    }
    Model::new(t, h.dp.maps.stats.totals().unwrap(), svc_stats)
}

fn coarse_now() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn clear_tables<A: KFam>(m: &mut Maps) {
    for (k, _) in A::flows(m).entries().unwrap() {
        A::flows_mut(m).remove(&k).unwrap();
    }
    for (k, _) in A::transient(m).entries().unwrap() {
        A::transient_mut(m).remove(&k).unwrap();
    }
}

/// Applies one operation to the kernel and the model and compares what it changed.
fn apply(
    h: &mut Harness,
    events: &mut Events,
    m: &mut Model,
    op: &Op,
    refused: &mut usize,
) -> Result<(), Fault> {
    match op {
        Op::V4(op) => {
            table_op(&mut h.dp.maps, m, op);
            Ok(())
        }
        Op::V6(op) => {
            table_op(&mut h.dp.maps, m, op);
            Ok(())
        }
        Op::Frame(frame) => {
            let lo = coarse_now();
            let Ok((verdict, out)) = h.try_run(frame) else {
                *refused += 1;
                return Ok(());
            };
            let clock = Clock {
                lo,
                hi: coarse_now(),
            };
            let verdict = match verdict {
                common::Verdict::Pass => model::Verdict::Pass,
                common::Verdict::Drop => model::Verdict::Drop,
                common::Verdict::Tx => model::Verdict::Tx,
                common::Verdict::Redirect | common::Verdict::Other(_) => {
                    return Err(Fault::Differs(format!("program returned {verdict:?}")))
                }
            };
            m.step(
                frame,
                &Run {
                    verdict,
                    out: &out,
                    clock,
                },
            )?;
            let stats = h.dp.maps.stats.totals().unwrap();
            if stats != m.state.stats {
                return Err(Fault::Differs(format!(
                    "counters differ: {}",
                    stat_diff(&m.state.stats, &stats)
                )));
            }
            compare_frame::<u32>(h, events, m, clock)?;
            compare_frame::<In6>(h, events, m, clock)
        }
    }
}

/// An operation on a family's tables, in the kernel and the model.
fn table_op<A: KFam>(maps: &mut Maps, m: &mut Model, op: &TableOp<A>) {
    match op {
        TableOp::Age { key, transient } => {
            let age = |f: &mut Flow<A>| {
                f.last_seen_ns = 1;
                f.timeout_s = f.timeout_s.min(1);
            };
            if *transient {
                if let Some(mut t) = A::transient(maps).get(key).unwrap() {
                    age(&mut t.flow);
                    A::transient_mut(maps).insert(key, &t).unwrap();
                }
                if let Some(t) = A::conn_mut(&mut m.state).transient.get_mut(key) {
                    age(&mut t.flow);
                }
            } else {
                if let Some(mut f) = A::flows(maps).get(key).unwrap() {
                    age(&mut f);
                    maps.set_flow(key, &f).unwrap();
                }
                if let Some(f) = A::conn_mut(&mut m.state).flows.get_mut(key) {
                    age(f);
                }
            }
        }
        TableOp::Synced {
            key,
            fwd,
            rev,
            age_s,
        } => {
            let seen = coarse_now().saturating_sub(age_s * 1_000_000_000);
            let (fwd, rev) = (
                Flow {
                    last_seen_ns: seen,
                    ..*fwd
                },
                Flow {
                    last_seen_ns: seen,
                    ..*rev
                },
            );
            let rkey = fwd.partner_key(key.proto);
            // Reverse first, as the flow store writes them.
            maps.set_flow(&rkey, &rev).unwrap();
            maps.set_flow(key, &fwd).unwrap();
            m.state.enter_flows(rkey, rev);
            m.state.enter_flows(*key, fwd);
        }
    }
}

/// Both flow-event ring buffers (connection-state sync), read after every frame.
type RingBuf = aya::maps::RingBuf<aya::maps::MapData>;
type Events = (RingBuf, RingBuf);

/// What a frame did to family `A`'s tables and sync events, against the model.
fn compare_frame<A: KFam>(
    h: &mut Harness,
    events: &mut Events,
    m: &mut Model,
    clock: Clock,
) -> Result<(), Fault> {
    compare_events::<A>(A::events(events), m, clock)?;
    let touched: HashSet<FlowKey<A>> = A::conn(&m.state).touched.iter().copied().collect();
    for k in touched {
        compare_key(h, m, &k, clock)?;
    }
    let indexed = A::conn(&m.state).indexed.clone();
    compare_slots::<A>(h, m, indexed.into_iter())
}

/// What the frame published against what the model says it must.
fn compare_events<A: KFam>(events: &mut RingBuf, m: &Model, clock: Clock) -> Result<(), Fault> {
    let mut published = vec![];
    while let Some(item) = events.next() {
        assert_eq!(item.len(), std::mem::size_of::<FlowEvent<A>>());
        // SAFETY: the data plane writes whole `FlowEvent`s of the family; read_unaligned copes with any alignment.
        published.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<FlowEvent<A>>()) });
    }
    let expected = &A::conn(&m.state).events;
    if published.len() != expected.len() {
        return Err(Fault::Differs(format!(
            "{} {} sync events published, the model says {}: {published:?}",
            published.len(),
            A::NAME,
            expected.len()
        )));
    }
    for (ev, (kind, key, fwd, rev)) in published.iter().zip(expected) {
        if (ev.kind, ev.key) != (*kind, *key) {
            return Err(Fault::Differs(format!(
                "sync event {} for {:?}, the model says {kind} for {key:?}",
                ev.kind, ev.key
            )));
        }
        model::compare_flow("sync event", key, fwd, &ev.fwd, clock).map_err(Fault::Differs)?;
        model::compare_flow("sync event (reverse)", key, rev, &ev.rev, clock)
            .map_err(Fault::Differs)?;
    }
    Ok(())
}

/// Compares one key's entries in both tables, adopting the timestamps the program wrote.
fn compare_key<A: KFam>(
    h: &mut Harness,
    m: &mut Model,
    k: &FlowKey<A>,
    clock: Clock,
) -> Result<(), Fault> {
    let (flows, transient) = (
        format!("FLOWS_{}", A::NAME),
        format!("TRANSIENT_{}", A::NAME),
    );
    let kernel = A::flows(&h.dp.maps).get(k).unwrap();
    let c = A::conn_mut(&mut m.state);
    match (c.flows.get(k).copied(), kernel) {
        (None, None) => {}
        (Some(e), Some(a)) => {
            let kept = model::compare_flow(&flows, k, &e, &a, clock).map_err(Fault::Differs)?;
            c.flows.insert(*k, kept);
        }
        (e, a) => {
            return Err(Fault::Differs(format!(
                "{flows} {k:?}: model {e:?}, kernel {a:?}"
            )))
        }
    }
    let kernel = A::transient(&h.dp.maps).get(k).unwrap();
    match (c.transient.get(k).copied(), kernel) {
        (None, None) => {}
        (Some(e), Some(a)) => {
            let kept = model::compare_flow(&transient, k, &e.flow, &a.flow, clock)
                .map_err(Fault::Differs)?;
            let kept_fwd = model::compare_flow(
                &format!("{transient} (forward entry)"),
                k,
                &e.fwd,
                &a.fwd,
                clock,
            )
            .map_err(Fault::Differs)?;
            if (e.ack_be, e._pad) != (a.ack_be, a._pad) {
                return Err(Fault::Differs(format!(
                    "{transient} {k:?}: ack {:#x}, the model says {:#x}",
                    a.ack_be, e.ack_be
                )));
            }
            let t = c.transient.get_mut(k).unwrap();
            t.flow = kept;
            t.fwd = kept_fwd;
        }
        (e, a) => {
            return Err(Fault::Differs(format!(
                "{transient} {k:?}: model {e:?}, kernel {a:?}"
            )))
        }
    }
    Ok(())
}

/// `HANDSHAKES` slots: the kernel's must name what the model's do. (Only slots the model wrote this epoch: the
/// others may hold keys of earlier epochs, which find nothing — see `model::State::handshakes`.)
fn compare_slots<A: KFam>(
    h: &mut Harness,
    m: &Model,
    slots: impl Iterator<Item = u32>,
) -> Result<(), Fault> {
    for slot in slots {
        let kernel = A::handshakes(&h.dp.maps).get(slot).unwrap();
        let model = A::conn(&m.state).handshakes[&slot];
        if kernel != model {
            return Err(Fault::Differs(format!(
                "HANDSHAKES ({}) slot {slot}: {kernel:?}, the model says {model:?}",
                A::NAME
            )));
        }
    }
    Ok(())
}

/// Both families' tables whole, the `HANDSHAKES` slots written, and the services' counters.
fn compare_all(h: &mut Harness, m: &Model) -> Result<(), Fault> {
    compare_tables::<u32>(h, m)?;
    compare_tables::<In6>(h, m)?;
    for (id, expected) in &m.state.svc_stats {
        let actual = h.dp.maps.service_stats.total(*id).unwrap();
        if *expected != actual {
            return Err(Fault::Differs(format!(
                "service {id} counters:\n  model  {expected:?}\n  kernel {actual:?}"
            )));
        }
    }
    Ok(())
}

/// One family's tables whole and its `HANDSHAKES` slots written.
fn compare_tables<A: KFam>(h: &mut Harness, m: &Model) -> Result<(), Fault> {
    let flows: HashMap<_, _> = A::flows(&h.dp.maps)
        .entries()
        .unwrap()
        .into_iter()
        .collect();
    let transient: HashMap<_, _> = A::transient(&h.dp.maps)
        .entries()
        .unwrap()
        .into_iter()
        .collect();
    let c = A::conn(&m.state);
    let fresh = c
        .flows
        .values()
        .chain(c.transient.values().flat_map(|t| [&t.flow, &t.fwd]))
        .any(|f| f.last_seen_ns == model::FRESH);
    if fresh {
        return Err(Fault::Differs("a timestamp was never checked".into()));
    }
    let no_clock = Clock { lo: 0, hi: 0 };
    // Flow entries as transient ones without ack or forward entry, so that one loop compares both tables.
    let as_transient = |f: &Flow<A>| Transient {
        flow: *f,
        ..Default::default()
    };
    let model_flows: HashMap<_, _> = c.flows.iter().map(|(k, f)| (*k, as_transient(f))).collect();
    let kernel_flows: HashMap<_, _> = flows.iter().map(|(k, f)| (*k, as_transient(f))).collect();
    for (name, model, kernel) in [
        ("FLOWS", model_flows, kernel_flows),
        ("TRANSIENT", c.transient.clone(), transient),
    ] {
        let name = format!("{name}_{}", A::NAME);
        for k in model.keys().chain(kernel.keys()) {
            match (model.get(k), kernel.get(k)) {
                (Some(e), Some(a)) => {
                    model::compare_flow(&name, k, &e.flow, &a.flow, no_clock)
                        .map_err(Fault::Differs)?;
                    model::compare_flow(&name, k, &e.fwd, &a.fwd, no_clock)
                        .map_err(Fault::Differs)?;
                    if (e.ack_be, e._pad) != (a.ack_be, a._pad) {
                        return Err(Fault::Differs(format!(
                            "{name} {k:?}: ack {:#x}, the model says {:#x}",
                            a.ack_be, e.ack_be
                        )));
                    }
                }
                (e, a) => {
                    return Err(Fault::Differs(format!(
                        "{name} at the end of the epoch, {k:?}: model {e:?}, kernel {a:?}"
                    )))
                }
            }
        }
    }
    compare_slots::<A>(h, m, c.handshakes.keys().copied())
}

fn stat_diff(model: &[u64], kernel: &[u64]) -> String {
    (0..model.len())
        .filter(|i| model[*i] != kernel[*i])
        .map(|i| {
            format!(
                "{}: kernel {} model {}",
                lb_common::stat::NAMES[i],
                kernel[i],
                model[i]
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Replays `ops` from a fresh epoch of `scenario`: the first difference, if any.
fn replay(h: &mut Harness, events: &mut Events, scenario: &Scenario, ops: &[Op]) -> Option<String> {
    let mut m = setup(h, scenario);
    let mut refused = 0;
    for op in ops {
        match apply(h, events, &mut m, op, &mut refused) {
            Ok(()) => {}
            Err(Fault::Differs(msg)) => return Some(msg),
            Err(Fault::Ambiguous(_)) => return None,
        }
    }
    match compare_all(h, &m) {
        Err(Fault::Differs(msg)) => Some(msg),
        _ => None,
    }
}

/// Shrinks a failing sequence (removing ever smaller chunks while it still fails) and panics with it.
fn fail(
    h: &mut Harness,
    events: &mut Events,
    seed: u64,
    epoch: usize,
    scenario: &Scenario,
    mut ops: Vec<Op>,
    msg: &str,
) -> ! {
    let mut chunk = ops.len() / 2;
    while chunk >= 1 {
        let mut i = 0;
        while i + chunk <= ops.len() {
            let mut shorter = ops.clone();
            shorter.drain(i..i + chunk);
            if replay(h, events, scenario, &shorter).is_some() {
                ops = shorter;
            } else {
                i += chunk;
            }
        }
        chunk /= 2;
    }
    let last = replay(h, events, scenario, &ops).unwrap_or_else(|| msg.to_string());
    let mut text = format!(
        "data plane and model differ ({:?} hook, seed {seed}, epoch {epoch}): {msg}\n\
         minimal sequence ({} steps) on scenario {scenario:#?}, its difference: {last}\n",
        h.hook,
        ops.len()
    );
    for (i, op) in ops.iter().enumerate() {
        text += &match op {
            Op::Frame(f) => format!("  {i}: frame {}\n", hex(f)),
            Op::V4(op) => describe(i, op),
            Op::V6(op) => describe(i, op),
        };
    }
    panic!("{text}");
}

fn describe<A: KFam>(i: usize, op: &TableOp<A>) -> String {
    match op {
        TableOp::Age { key, transient } => format!("  {i}: age {key:?} (transient: {transient})\n"),
        TableOp::Synced {
            key,
            fwd,
            rev,
            age_s,
        } => {
            format!("  {i}: synced {key:?} seen {age_s} s ago\n    fwd {fwd:?}\n    rev {rev:?}\n")
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
