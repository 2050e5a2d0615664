//! Installing what the environment needs: MariaDB and RabbitMQ from Debian, the pinned Python venv from PyPI, and
//! the ML2 mechanism driver that binds ports without an agent.

use super::Layout;
use crate::util::{output, run};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Debian packages the environment runs from.
const DEBIAN_PACKAGES: &[&str] = &["mariadb-server", "rabbitmq-server"];

/// apt must not start the system-wide daemons: we run our own, from our state directory, on 127.0.0.1.
const POLICY_RC_D: &str = "/usr/sbin/policy-rc.d";

/// The venv records what it was installed from here; a different requirements/constraints pair reinstalls.
const VENV_STAMP: &str = ".lbtest-installed-from";

/// apt-get and the state directories need root (the machines of this project run as root).
pub fn ensure_root() -> Result<()> {
    let uid = output(Command::new("id").arg("-u"), "id -u")?;
    if uid.trim() != "0" {
        bail!("cargo xtask openstack must run as root (it installs Debian packages and runs MariaDB/RabbitMQ as root)");
    }
    Ok(())
}

/// Installs MariaDB and RabbitMQ with apt-get unless they already are. apt's chatter goes to `<logs>/apt.log`.
pub fn ensure_debian_packages(log_dir: &Path) -> Result<()> {
    let missing: Vec<&str> = DEBIAN_PACKAGES
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let t = Instant::now();
    eprintln!(
        "openstack: installing Debian packages {}",
        missing.join(" ")
    );
    if !Path::new(POLICY_RC_D).exists() {
        // exit 101 = "action forbidden": the package scripts then leave the daemons stopped.
        std::fs::write(POLICY_RC_D, "#!/bin/sh\n# written by cargo xtask openstack: do not start daemons on install\nexit 101\n")
            .and_then(|_| set_mode(Path::new(POLICY_RC_D), 0o755))
            .with_context(|| format!("writing {POLICY_RC_D}"))?;
    }
    let log = log_dir.join("apt.log");
    let apt = |args: &[&str], what: &str| {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let status = Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .status()
            .with_context(|| format!("{what}: could not run apt-get"))?;
        if !status.success() {
            bail!(
                "{what} failed ({status}); last lines of {}:\n{}",
                log.display(),
                super::process::log_tail(&log, 20)
            );
        }
        anyhow::Ok(())
    };
    apt(
        &["update", "-q"],
        "apt-get update (are Debian's package mirrors reachable?)",
    )?;
    let mut args = vec!["install", "-y", "-q", "--no-install-recommends"];
    args.extend(&missing);
    apt(
        &args,
        "apt-get install of MariaDB/RabbitMQ (are Debian's package mirrors reachable?)",
    )?;
    eprintln!(
        "openstack: Debian packages installed in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

fn dpkg_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .map(|o| {
            o.status.success()
                && String::from_utf8_lossy(&o.stdout).contains("install ok installed")
        })
        .unwrap_or(false)
}

fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// Creates the venv and installs the pinned packages, unless it was already installed from the same pins; then
/// installs the mechanism driver (cheap, so always).
pub fn ensure_venv(layout: &Layout) -> Result<()> {
    let python_dir = layout.support.join("python");
    let requirements = python_dir.join("requirements.txt");
    let constraints = python_dir.join("constraints.txt");
    let wanted = format!("{}\n{}", read(&requirements)?, read(&constraints)?);
    let stamp = layout.venv.join(VENV_STAMP);
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(wanted.as_str()) {
        let t = Instant::now();
        if !layout.bin("python").exists() {
            let python =
                std::env::var("LB_OPENSTACK_PYTHON").unwrap_or_else(|_| "python3".to_string());
            eprintln!(
                "openstack: creating the venv {} with {python}",
                layout.venv.display()
            );
            run(
                Command::new(&python).args(["-m", "venv"]).arg(&layout.venv),
                "creating the Python venv (set LB_OPENSTACK_PYTHON to a Python >= 3.10 with the venv module)",
            )?;
        }
        eprintln!("openstack: installing the pinned OpenStack packages from PyPI (about a minute from nothing)");
        run(
            Command::new(layout.bin("pip"))
                .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
                .args(["install", "--no-input", "--quiet", "-r"])
                .arg(&requirements)
                .arg("-c")
                .arg(&constraints),
            "pip install of the OpenStack packages (is PyPI reachable?)",
        )?;
        std::fs::write(&stamp, &wanted).with_context(|| format!("writing {}", stamp.display()))?;
        eprintln!("openstack: venv ready in {:.1}s", t.elapsed().as_secs_f64());
    }
    install_fakebind(layout, &python_dir)
}

/// Installs `lbtest_fakebind.py` with a hand-written dist-info: ML2 loads mechanism drivers by entry-point name only,
/// and writing the four metadata lines ourselves avoids building a wheel (which would need setuptools and wheel).
fn install_fakebind(layout: &Layout, python_dir: &Path) -> Result<()> {
    let site = site_packages(&layout.venv)?;
    let dist_info = site.join("lbtest_fakebind-1.0.dist-info");
    std::fs::create_dir_all(&dist_info)
        .with_context(|| format!("creating {}", dist_info.display()))?;
    let files: [(PathBuf, String); 4] = [
        (site.join("lbtest_fakebind.py"), read(&python_dir.join("lbtest_fakebind.py"))?),
        (dist_info.join("METADATA"), "Metadata-Version: 2.1\nName: lbtest-fakebind\nVersion: 1.0\n".into()),
        (
            dist_info.join("entry_points.txt"),
            "[neutron.ml2.mechanism_drivers]\nlbtest_fakebind = lbtest_fakebind:FakeBindMechanismDriver\n".into(),
        ),
        (dist_info.join("top_level.txt"), "lbtest_fakebind\n".into()),
    ];
    for (path, content) in files {
        // Rewriting unchanged files would change mtimes and invalidate stevedore's entry-point cache for nothing.
        if std::fs::read_to_string(&path).ok().as_deref() != Some(content.as_str()) {
            std::fs::write(&path, content)
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}

fn site_packages(venv: &Path) -> Result<PathBuf> {
    let lib = venv.join("lib");
    for entry in std::fs::read_dir(&lib).with_context(|| format!("reading {}", lib.display()))? {
        let dir = entry?.path().join("site-packages");
        if dir.is_dir() {
            return Ok(dir);
        }
    }
    bail!(
        "no lib/python*/site-packages in the venv {}",
        venv.display()
    )
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}
