//! Malformed-frame storm at the rate XDP live frames reach: the test-only `storm_gen` program of
//! `target/bpf/lb-bench.o` runs with `BPF_PROG_TEST_RUN` and `BPF_F_TEST_XDP_LIVE_FRAMES` on an interface of the
//! current namespace and `XDP_TX`es [`rawsend::build_frame`]'s frames out of it, cycling through the kinds
//! (one template per kind, counted per kind in the program). About twice the rate of one AF_PACKET socket
//! ([`rawsend::send`]) on the netns rig, because no socket or qdisc is in the way.
//!
//! The frames leave as `XDP_TX` frames of a veth: its peer takes them only with NAPI (GRO or an XDP program),
//! so on a bridge without GRO the peer needs `xdp_pass` (see [`crate::rig::attach_xdp_pass`]).

use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use aya::maps::{Array, PerCpuArray};
use aya::programs::{TestRun, TestRunAttrs, TestRunOptions, Xdp};
use aya::Ebpf;

use crate::rawsend::{build_frame, FrameParams, MalformedKind, RawSendReport};

/// Mirror of `StormTemplate` in lb-bench.rs.
const STORM_BYTES: usize = 128;
/// Mirror of `STORM_KINDS` in lb-bench.rs.
const STORM_KINDS: usize = 16;

#[repr(C)]
#[derive(Clone, Copy)]
struct StormTemplate {
    len: u32,
    _pad: u32,
    data: [u8; STORM_BYTES],
}
// SAFETY: repr(C), integers and bytes only, no padding.
unsafe impl aya::Pod for StormTemplate {}

#[repr(C)]
#[derive(Clone, Copy)]
struct StormCfg {
    n: u32,
    counter: u32,
}
// SAFETY: as above.
unsafe impl aya::Pod for StormCfg {}

/// Frames per test run (the kernel caps a live-frames run's repeat; the clock is read between runs).
const REPEAT: u32 = 1 << 16;

/// Generates `kinds` round-robin on `iface` for `duration` with `storm_gen` from `object`, `batch` frames per
/// live-frames batch; returns what the program counted.
pub fn storm(
    object: &std::path::Path,
    iface: &str,
    kinds: &[MalformedKind],
    duration: Duration,
    batch: u32,
    p: &FrameParams,
) -> Result<RawSendReport> {
    ensure!(
        (1..=STORM_KINDS).contains(&kinds.len()),
        "1 to {STORM_KINDS} frame kinds, not {}",
        kinds.len()
    );
    let frames: Vec<Vec<u8>> = kinds.iter().map(|k| build_frame(*k, p, 0)).collect();
    // Every live frame starts as `data_in`, so the longest frame is it; a template holds the first
    // STORM_BYTES bytes of a frame, so a longer frame must be the `data_in` itself (its tail comes from there).
    let data_in = frames
        .iter()
        .max_by_key(|f| f.len())
        .expect("at least one kind")
        .clone();
    ensure!(
        data_in.len() >= STORM_BYTES,
        "the longest frame ({} bytes) must cover a template ({STORM_BYTES} bytes)",
        data_in.len()
    );
    for (k, f) in kinds.iter().zip(&frames) {
        ensure!(
            f.len() <= STORM_BYTES || *f == data_in,
            "{}: only one kind may be longer than {STORM_BYTES} bytes",
            k.name()
        );
    }

    let mut ebpf =
        Ebpf::load_file(object).with_context(|| format!("loading {}", object.display()))?;
    {
        let mut t: Array<_, StormTemplate> =
            Array::try_from(ebpf.map_mut("STORM").context("STORM map")?)?;
        for (i, f) in frames.iter().enumerate() {
            let mut data = [0u8; STORM_BYTES];
            let n = f.len().min(STORM_BYTES);
            data[..n].copy_from_slice(&f[..n]);
            t.set(
                i as u32,
                StormTemplate {
                    len: f.len() as u32,
                    _pad: 0,
                    data,
                },
                0,
            )?;
        }
        let mut c: Array<_, StormCfg> =
            Array::try_from(ebpf.map_mut("STORM_CFG").context("STORM_CFG map")?)?;
        c.set(
            0,
            StormCfg {
                n: frames.len() as u32,
                counter: 0,
            },
            0,
        )?;
    }
    let prog: &mut Xdp = ebpf
        .program_mut("storm_gen")
        .context("storm_gen not in the object (rebuild it: `cargo xtask build-ebpf`)")?
        .try_into()?;
    prog.load().context("loading storm_gen")?;
    let ifindex = crate::rawsend::ifindex(iface)?;
    // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
    let mut ctx = [0u8; 24];
    ctx[4..8].copy_from_slice(&(data_in.len() as u32).to_ne_bytes());
    ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
    let drops_before = xdp_xmit_errors(iface)?;
    let start = Instant::now();
    while start.elapsed() < duration {
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(&data_in);
        opts.ctx_in = Some(&ctx);
        opts.repeat = REPEAT;
        opts.attrs = TestRunAttrs::new().xdp_live_frames(batch);
        prog.test_run(opts).context("live-frames test run")?;
    }
    let seconds = start.elapsed().as_secs_f64();
    let link_drops = xdp_xmit_errors(iface)?.saturating_sub(drops_before);

    let counts: PerCpuArray<_, u64> =
        PerCpuArray::try_from(ebpf.map("STORM_SENT").context("STORM_SENT map")?)?;
    let mut report = RawSendReport {
        iface: iface.to_string(),
        seconds,
        link_drops,
        ..Default::default()
    };
    for (i, k) in kinds.iter().enumerate() {
        let n: u64 = counts.get(&(i as u32), 0)?.iter().sum();
        report.total_sent += n;
        *report.sent.entry(k.name()).or_default() += n;
    }
    report.per_second = report.total_sent as f64 / seconds.max(1e-9);
    Ok(report)
}

/// Frames `iface` (a veth) failed to hand to its peer by `XDP_TX`/redirect so far: the peer's ring was full.
fn xdp_xmit_errors(iface: &str) -> Result<u64> {
    let out = crate::process::run_cmd(["ethtool", "-S", iface])?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut total = None;
    for line in text.lines() {
        if let Some((name, value)) = line.trim().split_once(':') {
            if name.starts_with("tx_queue_") && name.ends_with("_xdp_xmit_errors") {
                let v: u64 = value
                    .trim()
                    .parse()
                    .with_context(|| format!("ethtool -S {iface}: {line}"))?;
                *total.get_or_insert(0) += v;
            }
        }
    }
    total.with_context(|| format!("ethtool -S {iface} reports no xdp_xmit_errors (not a veth?)"))
}
