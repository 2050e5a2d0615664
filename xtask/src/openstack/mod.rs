//! `cargo xtask openstack up|down|status`: a real OpenStack control plane (Keystone, Glance, Placement, Neutron,
//! Nova with the fake driver on two compute hosts) on 127.0.0.1, for the integration tests and for local development.
//!
//! Everything is installed from the package registries (Debian: MariaDB and RabbitMQ; PyPI: the pinned venv of
//! `testenv/openstack/python/`), every process binds to 127.0.0.1 and runs from our own state directory, and the PID
//! of each is recorded so that `down` stops exactly what `up` started. See `testenv/openstack/README.md` for the
//! layout, the knobs and the pitfalls this works around.

mod config;
mod install;
mod process;
mod services;

use crate::util::root;
use anyhow::{Context, Result};
use clap::Subcommand;
use std::path::PathBuf;
use std::time::Instant;

/// OpenStack sub-commands.
#[derive(Subcommand)]
pub enum OpenstackCmd {
    /// Install what is missing, configure and start Keystone, Glance, Placement, Neutron and Nova on 127.0.0.1,
    /// create the test project, and write clouds.yaml and cloudprovider.conf (idempotent).
    Up,
    /// Stop exactly the processes that `up` started.
    Down {
        /// Also drop all state: databases, queues, configs, images, logs, credentials. The venv is kept.
        #[arg(long)]
        purge: bool,
    },
    /// Show which services run and where the client files are.
    Status,
}

/// Runs an OpenStack sub-command.
pub fn run(cmd: OpenstackCmd) -> Result<()> {
    let layout = Layout::from_env();
    match cmd {
        OpenstackCmd::Up => up(&layout),
        OpenstackCmd::Down { purge } => down(&layout, purge),
        OpenstackCmd::Status => {
            services::status(&layout);
            Ok(())
        }
    }
}

/// The `openstack` stage of `cargo xtask test`: brings the environment up (idempotent), runs the ignored integration
/// tests of `openstack-testenv` and `lb-controller` and `bench openstack --smoke` against it, and stops it again if it
/// was not running before (state is kept, so the next start is quicker).
pub fn test_stage() -> Result<()> {
    let layout = Layout::from_env();
    let was_running = services::all_running(&layout);
    let result = up(&layout).and_then(|()| {
        let mut cmd = crate::test::workspace_cargo(&["test", "--exclude", "lb-testbed"]);
        // Every test binary runs even if one fails: the report shows all failures at once.
        cmd.arg("--no-fail-fast");
        for package in OPENSTACK_TEST_PACKAGES {
            for target in crate::test::test_targets(package, true)? {
                cmd.args(["--test", &target]);
            }
        }
        let tests = crate::util::run(
            cmd.env("LB_OPENSTACK_DIR", &layout.state)
                // One test at a time: the leak check after each test sees the whole project.
                .args(["--", "--ignored", "--test-threads=1"]),
            "OpenStack integration tests (openstack-testenv and lb-controller, --ignored)",
        );
        // `cargo xtask bench openstack` at smoke size, while the environment is up (see the bench-smoke stage).
        tests.and_then(|()| crate::bench::openstack_smoke(&layout.state))
    });
    if !was_running {
        // Also after a failure: no stray services after CI. The logs stay in the state directory.
        eprintln!(
            "openstack: stopping the environment this stage started (state and logs kept in {}; \
             `cargo xtask openstack down --purge` drops them)",
            layout.state.display()
        );
        services::stop_all(&layout)?;
    }
    result
}

/// Packages whose `#[ignore]`d integration tests need the test OpenStack. Their targets are found by reading the
/// files ([`crate::test::test_targets`]) and selected with `--test` within the workspace, so that cargo reuses the
/// binaries of the unit stage (`-p <package>` resolves features differently and rebuilds everything).
const OPENSTACK_TEST_PACKAGES: &[&str] = &["testenv/openstack", "lb-controller"];

/// Runs `f` with the environment up (started like the test stage does, when needed) and its state directory, and
/// stops the environment again if it was not running before, also after a failure (state kept). For
/// `cargo xtask bench openstack`.
pub fn with_environment(f: impl FnOnce(&std::path::Path) -> Result<()>) -> Result<()> {
    let layout = Layout::from_env();
    let was_running = services::all_running(&layout);
    let result = up(&layout).and_then(|()| f(&layout.state));
    if !was_running {
        eprintln!(
            "openstack: stopping the environment started for this run (state kept in {})",
            layout.state.display()
        );
        services::stop_all(&layout)?;
    }
    result
}

/// Where everything lives.
pub struct Layout {
    /// `testenv/openstack/` in the workspace: templates and Python support files.
    pub support: PathBuf,
    /// Databases, queues, configs, logs, PIDs and the client files (`LB_OPENSTACK_DIR`, default `target/openstack`).
    pub state: PathBuf,
    /// The Python venv with the pinned OpenStack packages (`LB_OPENSTACK_VENV`, default `target/openstack-venv`).
    /// Not state: `down --purge` keeps it, like the Debian packages.
    pub venv: PathBuf,
    /// The one password of the environment: admin, services, test user, database (`LB_OPENSTACK_PASSWORD`).
    pub password: String,
}

impl Layout {
    fn from_env() -> Self {
        let root = root();
        let absolute = |p: PathBuf| if p.is_absolute() { p } else { root.join(p) };
        let state = std::env::var_os("LB_OPENSTACK_DIR")
            .map(PathBuf::from)
            .map(absolute)
            .unwrap_or_else(|| root.join("target/openstack"));
        let venv = std::env::var_os("LB_OPENSTACK_VENV")
            .map(PathBuf::from)
            .map(absolute)
            .unwrap_or_else(|| root.join("target/openstack-venv"));
        let password =
            std::env::var("LB_OPENSTACK_PASSWORD").unwrap_or_else(|_| "lbtest-secret".to_string());
        Layout {
            support: root.join("testenv/openstack"),
            state,
            venv,
            password,
        }
    }

    /// PID files, the MariaDB socket.
    fn run_dir(&self) -> PathBuf {
        self.state.join("run")
    }

    /// One log file per service.
    fn log_dir(&self) -> PathBuf {
        self.state.join("logs")
    }

    /// Rendered configuration files.
    fn etc(&self) -> PathBuf {
        self.state.join("etc")
    }

    /// Markers of one-time steps that are done (schema syncs).
    fn stamps(&self) -> PathBuf {
        self.state.join("stamps")
    }

    /// A program of the venv.
    fn bin(&self, name: &str) -> PathBuf {
        self.venv.join("bin").join(name)
    }
}

fn up(layout: &Layout) -> Result<()> {
    let started = Instant::now();
    install::ensure_root()?;
    for dir in [
        layout.run_dir(),
        layout.log_dir(),
        layout.etc(),
        layout.stamps(),
    ] {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    install::ensure_debian_packages(&layout.log_dir())?;
    install::ensure_venv(layout)?;
    config::render_all(layout)?;
    let newly_started = services::start_all(layout)?;
    let info = layout.state.join("testenv.json");
    let files = if newly_started == 0 && info.exists() {
        // Everything was up and set up: the idempotent re-run stays at a few seconds. (register.py re-checks the
        // whole project in about 10 s; it runs whenever a service had to be started.)
        eprintln!("openstack: every service was already running; the test project is set up");
        ["clouds.yaml", "cloudprovider.conf", "testenv.json"]
            .iter()
            .map(|f| layout.state.join(f))
            .collect()
    } else {
        let ids = services::register(layout, "resources")?;
        config::write_client_files(layout, &ids)?
    };
    eprintln!(
        "openstack: up in {:.1}s; every service listens on 127.0.0.1 only",
        started.elapsed().as_secs_f64()
    );
    print_usage(layout, &files);
    Ok(())
}

fn down(layout: &Layout, purge: bool) -> Result<()> {
    services::stop_all(layout)?;
    if purge {
        if layout.state.exists() {
            std::fs::remove_dir_all(&layout.state).with_context(|| {
                format!("removing the state directory {}", layout.state.display())
            })?;
        }
        eprintln!(
            "openstack: state dropped ({}); the venv {} is kept",
            layout.state.display(),
            layout.venv.display()
        );
    }
    Ok(())
}

fn print_usage(layout: &Layout, files: &[PathBuf]) {
    println!("# client files:");
    for f in files {
        println!("#   {}", f.display());
    }
    let clouds = layout.state.join("clouds.yaml");
    println!("# OpenStack CLI (admin: OS_CLOUD=lbtest-admin):");
    println!(
        "export OS_CLIENT_CONFIG_FILE={} OS_CLOUD=lbtest",
        clouds.display()
    );
    println!(
        "# then e.g.: {} server list",
        layout.bin("openstack").display()
    );
    println!("# stop: cargo xtask openstack down [--purge]");
}
