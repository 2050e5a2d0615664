//! Developer commands. `cargo xtask --help` lists them; the README's two commands are `cargo xtask demo` and
//! `cargo xtask test`.

mod bench;
mod chart;
mod demo;
mod ebpf;
mod fuzz;
mod image;
mod openstack;
mod prereq;
mod stack;
mod test;
mod upgrade;
mod util;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Developer commands for the XDP load balancer")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build the eBPF programs (installs the nightly rust-src component and a cached bpf-linker if needed).
    BuildEbpf,
    /// The demo: real TCP/UDP through the XDP load balancer between network namespaces.
    Demo {
        /// Attach mode of the agent: xdp, xdp-generic or tc.
        #[arg(long, default_value = "xdp")]
        attach_mode: String,
    },
    /// Run every test suite, fast to slow (the README's test command; CI runs exactly this).
    Test(test::TestArgs),
    /// Benchmarks: print a table, write JSON under target/bench/.
    Bench {
        /// What to measure.
        #[arg(value_enum, default_value = "all")]
        which: bench::Which,
        /// A few seconds each, no thresholds: proves every benchmark still loads and runs (the test stage
        /// `bench-smoke` runs this); JSON under target/bench/smoke/.
        #[arg(long)]
        smoke: bool,
        /// Passed on to the one benchmark chosen, after `--`: e.g. `cargo xtask bench dataplane -- --sweep` (the
        /// data plane on 1, 2, 4, … CPUs at once) or `-- --threads 2`; each benchmark's `--help` lists its own.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// A real OpenStack control plane on 127.0.0.1 for tests and local development.
    Openstack {
        #[command(subcommand)]
        cmd: openstack::OpenstackCmd,
    },
    /// The load-balancer VM image: build target/image/lb-vm.qcow2, boot-test it in QEMU; lb-controller's OCI image.
    Image {
        #[command(subcommand)]
        cmd: image::ImageCmd,
    },
    /// Render deploy/cloud-controller.yaml and deploy/openstack-controller.yaml from the Helm chart (deploy/helm/xdp-lb).
    Chart,
    /// Fuzzing campaigns longer than the test passes (`dataplane`: the differential fuzzer).
    Fuzz {
        #[command(subcommand)]
        cmd: fuzz::FuzzCmd,
    },
    /// The upgrade tests with a previous release's agent (built from git) on the old side: the carry across a
    /// map layout change under held connections, and an HA rollover through flow sync between the two.
    UpgradeCheck {
        /// The previous release: a commit, tag or branch.
        #[arg(long)]
        from: String,
    },
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::BuildEbpf => ebpf::build().map(|_| ()),
        Cmd::Demo { attach_mode } => demo::demo(&attach_mode),
        Cmd::Test(args) => test::run_all(args),
        Cmd::Bench { which, smoke, args } => bench::run_bench(which, smoke, args),
        Cmd::Openstack { cmd } => openstack::run(cmd),
        Cmd::Image { cmd } => image::run(cmd),
        Cmd::Chart => chart::render(),
        Cmd::Fuzz { cmd } => fuzz::run_fuzz(cmd),
        Cmd::UpgradeCheck { from } => upgrade::check(&from),
    }
}
