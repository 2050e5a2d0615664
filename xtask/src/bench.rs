//! `cargo xtask bench <what>`: benchmarks that print a table and write JSON under `target/bench/`.
//! Numbers come from here, never from timed assertions in tests.

use crate::util::{cargo_executables, root, run};
use anyhow::{Context, Result};
use clap::ValueEnum;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Which benchmark to run.
#[derive(Clone, Copy, ValueEnum)]
pub enum Which {
    /// ns/packet of the XDP program via BPF_PROG_TEST_RUN, next to a bare XDP_TX reflector.
    Dataplane,
    /// 1000 Services → LoadBalancers and a node flap, against the in-memory API.
    Controller,
    /// Packet rate on the netns topology with XDP live frames, next to a bare XDP_TX forwarder (root).
    Pktgen,
    /// `pktgen` on the routed topology (the agent on eth0 and eth1, backends behind eth1), next to a bare XDP
    /// forwarder that redirects to eth1 (root).
    PktgenRouted,
    /// SYN flood from spoofed sources against the real agent while 10 000 connections are held and new ones
    /// are made: surviving and succeeding shares, program cost per frame (root).
    Synflood,
    /// Connection-level comparison: our modes vs HAProxy, nginx, Envoy, nftables DNAT and the direct path
    /// (root; installs the peers from Debian and PyPI when missing).
    Connections,
    /// `connections` on the routed topology (backends behind the load balancer's second interface), against the
    /// kernel's IP forwarding through the load balancer's namespace (root).
    Routed,
    /// Map memory at 1M flows, 1000 x 100 apply time, config change to first packet (root).
    Scale,
    /// VRRP failover between replicas: takeover time, traffic pause and surviving connections over 10
    /// failovers, next to yawol's keepalived timing without sync; sync throughput and CPU (root).
    Failover,
    /// Active-active behind a BGP router with ECMP: connections/s and packets/s through 1, 2 and 3 replicas,
    /// each replica's share, XDP time per packet and agent CPU per connection, connections broken when a
    /// replica is added or drained (root).
    Scaleout,
    /// LoadBalancer port change → first packet through the new port: the real agent in Kubernetes mode against a
    /// real kube-apiserver, XDP on the netns rig, 50 changes (root).
    KubeConfig,
    /// The OpenStack-side controllers against the real OpenStack of `cargo xtask openstack up` (started if needed,
    /// stopped again afterwards): new LoadBalancer to floating IP and to ACTIVE servers, deletion, OpenStack calls
    /// per reconcile in steady state.
    Openstack,
    /// Everything above.
    All,
}

/// Every kind, in the order `all` runs them.
const ALL: [Which; 12] = [
    Which::Dataplane,
    Which::Controller,
    Which::Pktgen,
    Which::PktgenRouted,
    Which::Synflood,
    Which::Connections,
    Which::Routed,
    Which::Scale,
    Which::Failover,
    Which::Scaleout,
    Which::KubeConfig,
    Which::Openstack,
];

/// Runs the chosen benchmarks. With `smoke`, each runs at a few seconds' size (its `--smoke`) from the dev-profile
/// build the test stages share: that only proves it still loads and runs, and its JSON goes to `target/bench/smoke/`
/// so that it never overwrites a measurement.
pub fn run_bench(which: Which, smoke: bool, args: Vec<String>) -> Result<()> {
    let kinds: Vec<Which> = match which {
        Which::All if !args.is_empty() => {
            anyhow::bail!("arguments after `--` go to one benchmark: name it (e.g. `bench dataplane -- --sweep`)")
        }
        Which::All => ALL.to_vec(),
        one => vec![one],
    };
    let mut bins = Binaries::build(&kinds, smoke)?;
    bins.args = args;
    for kind in kinds {
        bins.run(kind)?;
    }
    Ok(())
}

/// The `bench-smoke` stage of `cargo xtask test`: every kind but `openstack` at smoke size, timed one by one. The
/// openstack benchmark needs the test OpenStack, so the `openstack` stage runs its smoke run ([`openstack_smoke`]).
pub fn smoke_stage() -> Result<()> {
    let kinds: Vec<Which> = ALL
        .into_iter()
        .filter(|k| !matches!(k, Which::Openstack))
        .collect();
    let bins = Binaries::build(&kinds, true)?;
    let mut times = Vec::new();
    for kind in kinds {
        let t = Instant::now();
        let result = bins.run(kind);
        times.push((kind.name(), t.elapsed()));
        result.with_context(|| format!("bench {} --smoke", kind.name()))?;
    }
    eprintln!("bench smoke runs (wall time):");
    for (name, d) in times {
        eprintln!("    {name:<14} {:>6.1} s", d.as_secs_f64());
    }
    Ok(())
}

/// The openstack benchmark at smoke size against the environment `state` (already up): for the `openstack` stage.
pub fn openstack_smoke(state: &Path) -> Result<()> {
    let t = Instant::now();
    Binaries::build(&[Which::Openstack], true)?.openstack(state)?;
    eprintln!(
        "bench openstack --smoke ok in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

impl Which {
    /// The name on the command line (clap's).
    fn name(self) -> String {
        self.to_possible_value()
            .map(|v| v.get_name().to_owned())
            .unwrap_or_default()
    }
}

/// The built benchmark programs: `target/<profile>/<bin>`.
struct Binaries {
    dir: PathBuf,
    smoke: bool,
    /// Passed on to the benchmark (`cargo xtask bench <kind> -- …`).
    args: Vec<String>,
}

impl Binaries {
    /// Builds the eBPF objects and what `kinds` run. A measurement builds in release; a smoke run builds the whole
    /// workspace's binaries and examples in the dev profile, the test stages' artifacts (a release build of the
    /// dependency graph would add minutes to `cargo xtask test`). The netns rigs find `lb-agent` and `lb-testbed`
    /// next to the benchmark binary.
    fn build(kinds: &[Which], smoke: bool) -> Result<Binaries> {
        // The rigs' tools (ethtool, nginx, HAProxy, BIRD, etcd …), as `demo` and `test` install them: a benchmark
        // run first on a fresh machine would otherwise stop at the first missing one. The bench-smoke stage runs
        // after the prerequisites stage; the openstack stage's smoke run may run alone (`--only openstack`).
        if !smoke || matches!(kinds, [Which::Openstack]) {
            crate::prereq::all()?;
        }
        crate::ebpf::build()?;
        if kinds.iter().any(|k| matches!(k, Which::KubeConfig)) {
            // A real kube-apiserver (kube-testenv): KUBEBUILDER_ASSETS made absolute for the benchmark's process.
            crate::prereq::kube_assets()?;
        }
        if matches!(kinds, [Which::Openstack]) {
            // It starts its own real kube-apiserver: etcd (a Debian package of the prerequisites), KUBEBUILDER_ASSETS.
            crate::prereq::kube_assets()?;
        }
        if smoke {
            let built = cargo_executables(
                &mut crate::test::workspace_cargo(&["build", "--bins", "--examples"]),
                "building the benchmarks (dev profile)",
            )?;
            let dir = built
                .iter()
                .find(|b| b.target == "lb-agent" && b.kinds.iter().any(|k| k == "bin"))
                .and_then(|b| b.executable.parent())
                .context("cargo built no lb-agent binary")?
                .to_path_buf();
            return Ok(Binaries {
                dir,
                smoke,
                args: Vec::new(),
            });
        }
        let mut args = vec!["build", "--release", "--quiet"];
        for kind in kinds {
            args.extend_from_slice(match kind {
                Which::Controller | Which::Openstack => &["-p", "lb-controller-benches"],
                // `--bins` too: with a target named, cargo builds only the named ones, and the rig starts the
                // lb-agent and lb-testbed binaries.
                Which::KubeConfig => &[
                    "-p",
                    "lb-agent",
                    "-p",
                    "lb-testbed",
                    "-p",
                    "lb-benches",
                    "--bins",
                    "--example",
                    "bench-kube-config",
                ],
                _ => &["-p", "lb-agent", "-p", "lb-testbed", "-p", "lb-benches"],
            });
        }
        run(&mut crate::util::cargo(&args), "building the benchmarks")?;
        Ok(Binaries {
            dir: root().join("target/release"),
            smoke,
            args: Vec::new(),
        })
    }

    fn run(&self, kind: Which) -> Result<()> {
        match kind {
            Which::Dataplane => self.bin("bench-dataplane"),
            Which::Controller => self.controller(),
            Which::Pktgen => self.bin("bench-pktgen"),
            Which::PktgenRouted => run(
                self.command(self.dir.join("bench-pktgen")).arg("--routed"),
                "bench-pktgen --routed",
            ),
            Which::Connections => self.bin("bench-connections"),
            Which::Routed => run(
                self.command(self.dir.join("bench-connections"))
                    .arg("--routed"),
                "bench-connections --routed",
            ),
            Which::Synflood => self.bin("bench-synflood"),
            Which::Scale => self.bin("bench-scale"),
            Which::Failover => self.bin("bench-failover"),
            Which::Scaleout => self.bin("bench-scaleout"),
            Which::KubeConfig => self.bin("examples/bench-kube-config"),
            Which::Openstack => crate::openstack::with_environment(|state| self.openstack(state)),
            Which::All => unreachable!("run_bench expands all"),
        }
    }

    /// A benchmark with `--smoke` when this is a smoke run.
    fn command(&self, path: PathBuf) -> Command {
        let mut cmd = Command::new(path);
        cmd.current_dir(root());
        if self.smoke {
            cmd.arg("--smoke");
        }
        cmd.args(&self.args);
        cmd
    }

    /// A benchmark of `lb-benches`, run from the workspace root. Every such benchmark creates its own namespaces
    /// and removes them, also after a failure.
    fn bin(&self, name: &str) -> Result<()> {
        run(&mut self.command(self.dir.join(name)), name)
    }

    /// Where a benchmark that is told its JSON's path (controller, openstack) writes it.
    fn json(&self, name: &str) -> PathBuf {
        let dir = root().join("target/bench");
        if self.smoke {
            dir.join("smoke").join(name)
        } else {
            dir.join(name)
        }
    }

    fn controller(&self) -> Result<()> {
        run(
            self.command(self.dir.join("bench-controller"))
                .arg("--json")
                .arg(self.json("controller.json")),
            "bench controller",
        )
    }

    /// `bench-openstack` against the test OpenStack whose state directory is `state`.
    fn openstack(&self, state: &Path) -> Result<()> {
        run(
            self.command(self.dir.join("bench-openstack"))
                .env("LB_OPENSTACK_DIR", state)
                .arg("--json")
                .arg(self.json("openstack.json")),
            "bench openstack",
        )
    }
}
