//! `cargo xtask bench <what>`: benchmarks that print a table and write JSON under `target/bench/`.
//! Numbers come from here, never from timed assertions in tests.

use crate::util::{root, run};
use anyhow::Result;
use clap::ValueEnum;
use std::process::Command;

/// Which benchmark to run.
#[derive(Clone, Copy, ValueEnum)]
pub enum Which {
    /// ns/packet of the XDP program via BPF_PROG_TEST_RUN, next to a bare XDP_TX reflector.
    Dataplane,
    /// 1000 Services → LoadBalancers and a node flap, against the in-memory API.
    Controller,
    /// Packet rate on the netns topology with XDP live frames, next to a bare XDP_TX forwarder (root).
    Pktgen,
    /// SYN flood from spoofed sources against the real agent while 10 000 connections are held and new ones
    /// are made: surviving and succeeding shares, program cost per frame (root).
    Synflood,
    /// Connection-level comparison: our modes vs HAProxy, nginx, Envoy, nftables DNAT and the direct path
    /// (root; installs the peers from Debian and PyPI when missing).
    Connections,
    /// Map memory at 1M flows, 1000 x 100 apply time, config change to first packet (root).
    Scale,
    /// VRRP failover between replicas: takeover time, traffic pause and surviving connections over 10
    /// failovers, next to yawol's keepalived timing without sync; sync throughput and CPU (root).
    Failover,
    /// The OpenStack-side controllers against the real OpenStack of `cargo xtask openstack up` (started if needed,
    /// stopped again afterwards): new LoadBalancer to floating IP and to ACTIVE servers, deletion, OpenStack calls
    /// per reconcile in steady state.
    Openstack,
    /// Everything above.
    All,
}

/// Runs the chosen benchmarks.
pub fn run_bench(which: Which) -> Result<()> {
    match which {
        Which::Dataplane => dataplane(),
        Which::Controller => controller(),
        Which::Pktgen => netns_bench("bench-pktgen"),
        Which::Connections => netns_bench("bench-connections"),
        Which::Synflood => netns_bench("bench-synflood"),
        Which::Scale => netns_bench("bench-scale"),
        Which::Failover => netns_bench("bench-failover"),
        Which::Openstack => openstack(),
        Which::All => {
            dataplane()?;
            controller()?;
            netns_bench("bench-pktgen")?;
            netns_bench("bench-synflood")?;
            netns_bench("bench-connections")?;
            netns_bench("bench-scale")?;
            netns_bench("bench-failover")?;
            openstack()
        }
    }
}

/// Builds the eBPF objects, the agent (which embeds `lb.o`), the test bed and the benchmarks in release,
/// then runs `target/release/<bin>` from the workspace root (the rig finds `lb-agent` and `lb-testbed` next
/// to it). Every such benchmark creates its own namespaces and removes them, also after a failure.
fn netns_bench(bin: &str) -> Result<()> {
    crate::ebpf::build()?;
    run(
        &mut crate::util::cargo(&[
            "build",
            "--release",
            "--quiet",
            "-p",
            "lb-agent",
            "-p",
            "lb-testbed",
            "-p",
            "lb-benches",
        ]),
        "building the benchmarks",
    )?;
    run(
        Command::new(root().join("target/release").join(bin)).current_dir(root()),
        bin,
    )
}

fn dataplane() -> Result<()> {
    let out = crate::ebpf::build()?;
    run(
        crate::util::cargo(&[
            "run",
            "--release",
            "--quiet",
            "-p",
            "lb-benches",
            "--bin",
            "bench-dataplane",
            "--",
        ])
        .arg("--object")
        .arg(out.join("lb-bench.o")),
        "bench dataplane",
    )
}

fn controller() -> Result<()> {
    run(
        crate::util::cargo(&[
            "run",
            "--release",
            "--quiet",
            "-p",
            "lb-controller",
            "--example",
            "bench_controller",
            "--",
        ])
        .arg("--json")
        .arg(root().join("target/bench/controller.json")),
        "bench controller",
    )
}

/// `bench_openstack` (release) against the test OpenStack, which is started for it when it is not running.
fn openstack() -> Result<()> {
    // The benchmark runs the controllers against a real kube-apiserver of its own: etcd (a Debian package of the
    // prerequisites) and the KUBEBUILDER_ASSETS binaries.
    crate::prereq::all()?;
    crate::prereq::kube_assets()?;
    // Built before the environment starts: the services and the compiler would share the 2 cores.
    run(
        &mut crate::util::cargo(&[
            "build",
            "--release",
            "--quiet",
            "-p",
            "lb-controller",
            "--example",
            "bench_openstack",
        ]),
        "building bench_openstack",
    )?;
    crate::openstack::with_environment(|state| {
        run(
            Command::new(root().join("target/release/examples/bench_openstack"))
                .current_dir(root())
                .env("LB_OPENSTACK_DIR", state)
                .arg("--json")
                .arg(root().join("target/bench/openstack.json")),
            "bench openstack",
        )
    })
}
