//! `cargo xtask image boot-test`: boots `target/image/lb-vm.qcow2` in QEMU (KVM when usable, else TCG), once
//! with SeaBIOS and once with OVMF (UEFI), each time from a fresh copy-on-write overlay, with a NoCloud seed:
//!
//! - `user-data`: exactly what lb-controller gives a replicated load balancer's VM, printed by the
//!   `render_user_data` example from `lb_controller::openstack::machine::cloudinit::user_data`. Its kubeconfig names
//!   an API server that does not exist (192.0.2.1, TEST-NET-1; the VM's NIC is `restrict=on` anyway), with a real CA;
//! - `vendor-data`: the test's own part (never in the image) — a `bootcmd` that installs
//!   `image/boot-test/check.sh` under /run and queues it after cloud-final. It prints `LB-IMAGE-CHECK key=value`
//!   lines on the serial console and powers off.
//!
//! A second NIC (QEMU user network with a port forward) carries the data-plane check: the script starts a
//! second agent in file mode on eth1 with one TCP service whose backend is this process's echo server on the
//! host; on `traffic=go` this side opens connections through the forwarded port — each crosses the XDP program
//! twice (DNAT+SNAT to the host and back) — and the guest counts the flows in that agent's metrics.
//!
//! Every key is compared with what it must be; failures are listed, the serial logs stay in
//! `target/image/boot-test/<firmware>/serial.log`, timings go to `target/image/report.json`.

use super::{image_path, out_dir, recipe_dir, rootfs::remove_tree, write_report};
use crate::util::{output, root, run};
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The API server in the kubeconfig: TEST-NET-1 (RFC 5737), never routed.
const API_SERVER: &str = "https://192.0.2.1:6443";
/// The file-mode agent's VIP on eth1 (QEMU user network 10.0.3.0/24, whose host side is 10.0.3.2).
const FILE_VIP: &str = "10.0.3.15";
/// Why a KVM boot was given up: the kernel printed nothing within [`KVM_STALL_AFTER`].
const KVM_STALLED: &str = "the guest kernel did not start under KVM";
const KVM_STALL_AFTER: Duration = Duration::from_secs(45);
/// Connections the host opens through the file-mode agent's data plane.
const TRAFFIC_FLOWS: usize = 20;

/// Which firmware to boot with.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Firmware {
    /// SeaBIOS (GRUB from the BIOS boot partition).
    Bios,
    /// OVMF (GRUB from the EFI system partition).
    Uefi,
    /// One boot each.
    Both,
}

/// QEMU accelerator.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Accel {
    /// KVM when /dev/kvm can be opened and a guest kernel starts under it, else TCG.
    Auto,
    /// KVM.
    Kvm,
    /// Software emulation.
    Tcg,
}

/// Options of `cargo xtask image boot-test`.
#[derive(clap::Args)]
pub struct BootTestArgs {
    /// Firmware to boot with.
    #[arg(long, value_enum, default_value = "both")]
    firmware: Firmware,
    /// Accelerator.
    #[arg(long, value_enum, default_value = "auto")]
    accel: Accel,
    /// Give up on a boot after this many seconds (default: 150 with KVM, 300 with TCG).
    #[arg(long)]
    timeout: Option<u64>,
}

impl Default for BootTestArgs {
    /// The command line's defaults: both firmwares, automatic accelerator, default timeouts.
    fn default() -> Self {
        BootTestArgs {
            firmware: Firmware::Both,
            accel: Accel::Auto,
            timeout: None,
        }
    }
}

/// Runs the boot test.
pub fn boot_test(args: &BootTestArgs) -> Result<()> {
    crate::prereq::debian_packages(crate::prereq::IMAGE_TEST_PACKAGES)?;
    let image = image_path();
    if !image.exists() {
        bail!(
            "{} does not exist: run `cargo xtask image build` first",
            image.display()
        );
    }
    let mut kvm = match args.accel {
        Accel::Kvm => true,
        Accel::Tcg => false,
        Accel::Auto => kvm_usable(),
    };
    let mut kvm_fallback = None;
    let dir = out_dir().join("boot-test");
    remove_tree(&dir)?;
    std::fs::create_dir_all(&dir)?;

    let echo_port = echo_server()?;
    let seed = make_seed(&dir, echo_port)?;
    let virtual_bytes = virtual_size(&image)?;
    let firmwares: &[Firmware] = match args.firmware {
        Firmware::Both => &[Firmware::Bios, Firmware::Uefi],
        Firmware::Bios => &[Firmware::Bios],
        Firmware::Uefi => &[Firmware::Uefi],
    };
    let mut report = serde_json::Map::new();
    let mut failed = Vec::new();
    for &fw in firmwares {
        let name = if fw == Firmware::Bios { "bios" } else { "uefi" };
        let b = loop {
            let timeout = Duration::from_secs(args.timeout.unwrap_or(if kvm { 150 } else { 300 }));
            eprintln!(
                "image: booting {} with {name} firmware ({}; timeout {}s)",
                image.display(),
                if kvm { "KVM" } else { "TCG" },
                timeout.as_secs()
            );
            let b = boot(
                &dir.join(name),
                &image,
                &seed,
                fw,
                kvm,
                timeout,
                virtual_bytes,
            )?;
            // /dev/kvm may open and still not run a Linux guest (seen with nested KVM): fall back to TCG.
            if kvm && args.accel == Accel::Auto && b.aborted.as_deref() == Some(KVM_STALLED) {
                eprintln!("image: {KVM_STALLED}; falling back to TCG");
                kvm = false;
                kvm_fallback = Some(KVM_STALLED);
                continue;
            }
            break b;
        };
        let failures = judge(&b, virtual_bytes);
        print_result(name, &b, &failures);
        if failures.is_empty() {
            // The VM's disk is only worth its space for looking into a failure; the logs stay.
            let _ = std::fs::remove_file(dir.join(name).join("overlay.qcow2"));
        }
        report.insert(name.into(), b.json(&failures));
        failed.extend(failures.into_iter().map(|f| format!("{name}: {f}")));
    }
    report.insert("accel".into(), (if kvm { "kvm" } else { "tcg" }).into());
    report.insert("kvm_fallback".into(), kvm_fallback.into());
    write_report("boot_test", &serde_json::Value::Object(report))?;
    if !failed.is_empty() {
        bail!(
            "boot test failed ({} problems; serial logs in {}):\n  {}",
            failed.len(),
            dir.display(),
            failed.join("\n  ")
        );
    }
    println!(
        "boot test: ok; report in {}",
        out_dir().join("report.json").display()
    );
    Ok(())
}

/// Whether KVM can be used: /dev/kvm opens read-write.
fn kvm_usable() -> bool {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok()
}

fn virtual_size(image: &Path) -> Result<u64> {
    let info: serde_json::Value = serde_json::from_str(&output(
        Command::new("qemu-img")
            .args(["info", "--output=json"])
            .arg(image),
        "qemu-img info",
    )?)?;
    info["virtual-size"]
        .as_u64()
        .context("qemu-img info without virtual-size")
}

/// A TCP echo server on 127.0.0.1 (the file-mode agent's backend, reached through QEMU's user network).
fn echo_server() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut conn = conn;
                let mut buf = [0u8; 4096];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 || conn.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    Ok(port)
}

/// The NoCloud seed: a small FAT image labelled CIDATA (mkfs.vfat + mcopy, nothing to mount).
fn make_seed(dir: &Path, echo_port: u16) -> Result<PathBuf> {
    // A real CA, as the controller would hand over; the agent parses it before it tries the API.
    let ca = dir.join("ca.pem");
    run(
        Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
            ])
            .args([
                "-subj",
                "/CN=lb-image-boot-test",
                "-days",
                "2",
                "-keyout",
                "/dev/null",
                "-out",
            ])
            .arg(&ca)
            .stderr(Stdio::null()),
        "openssl (test CA)",
    )?;
    run(
        &mut crate::util::cargo(&[
            "build",
            "--quiet",
            "-p",
            "lb-controller",
            "--example",
            "render_user_data",
        ]),
        "building lb-controller's render_user_data example",
    )?;
    let user_data = output(
        Command::new(root().join("target/debug/examples/render_user_data"))
            .args(["--api-server", API_SERVER, "--ca-file"])
            .arg(&ca)
            .args([
                "--interface",
                "eth0",
                "--vip",
                "192.0.2.10",
                "--ntp-server",
                "pool.ntp.org",
            ])
            .args(["--vrrp-router-id", "42", "--machine-revision", "1"]),
        "rendering the user data",
    )?;
    let check = std::fs::read_to_string(recipe_dir().join("boot-test/check.sh"))?;
    let vendor = serde_json::json!({
        "bootcmd": [
            // The script as an argument: cloud-init quotes list items for the shell itself.
            ["sh", "-c", "printf '%s' \"$1\" > /run/lb-image-check.sh", "sh", check],
            ["systemd-run", "--no-block", "--unit=lb-image-check",
             "--property=After=cloud-final.service",
             format!("--setenv=FILE_VIP={FILE_VIP}"),
             format!("--setenv=ECHO_PORT={echo_port}"),
             format!("--setenv=TRAFFIC_FLOWS={TRAFFIC_FLOWS}"),
             "/bin/sh", "/run/lb-image-check.sh"],
        ],
    });
    let seed_dir = dir.join("seed");
    std::fs::create_dir_all(&seed_dir)?;
    std::fs::write(seed_dir.join("user-data"), &user_data)?;
    // JSON is YAML: no quoting of the script can go wrong.
    std::fs::write(
        seed_dir.join("vendor-data"),
        format!(
            "#cloud-config\n{}\n",
            serde_json::to_string_pretty(&vendor)?
        ),
    )?;
    std::fs::write(
        seed_dir.join("meta-data"),
        "instance-id: lb-image-boot-test\nlocal-hostname: lb-image-boot-test\n",
    )?;
    let seed = dir.join("seed.img");
    run(
        Command::new("mkfs.vfat")
            .args(["-n", "CIDATA", "-C"])
            .arg(&seed)
            .arg("2048")
            .stdout(Stdio::null()),
        "making the NoCloud seed",
    )?;
    let mut mcopy = Command::new("mcopy");
    mcopy.arg("-i").arg(&seed).env("MTOOLS_SKIP_CHECK", "1");
    for f in ["user-data", "vendor-data", "meta-data"] {
        mcopy.arg(seed_dir.join(f));
    }
    run(mcopy.arg("::/"), "copying the seed files")?;
    Ok(seed)
}

/// What one boot reported.
struct Boot {
    /// `LB-IMAGE-CHECK` keys and values (the last value of a key wins).
    checks: BTreeMap<String, String>,
    /// `LB-IMAGE-INFO` lines.
    infos: Vec<String>,
    /// Host side of the data-plane check: connections that echoed correctly.
    echo_ok: usize,
    /// Seconds from starting QEMU until the check script started (cloud-init done).
    seconds_to_cloud_init_done: Option<f64>,
    /// Seconds from starting QEMU until QEMU exited (or was stopped).
    seconds_total: f64,
    /// Why the boot ended early, if it did.
    aborted: Option<String>,
    serial_log: PathBuf,
}

impl Boot {
    fn num(&self, key: &str) -> Option<f64> {
        self.checks.get(key).and_then(|v| v.parse().ok())
    }

    /// Firmware, GRUB and kernel time before the guest's clock started: host time at the script's start
    /// minus the guest's uptime then.
    fn firmware_seconds(&self) -> Option<f64> {
        Some(self.seconds_to_cloud_init_done? - self.num("uptime_at_start")?)
    }

    fn json(&self, failures: &[String]) -> serde_json::Value {
        let fw = self.firmware_seconds();
        let plus_fw = |k: &str| Some(fw? + self.num(k)?);
        serde_json::json!({
            "ok": failures.is_empty(),
            "failures": failures,
            "seconds_total": self.seconds_total,
            "seconds_to_agent_started": plus_fw("agent_started_at"),
            "seconds_to_agent_dataplane": plus_fw("agent_dataplane_at"),
            "seconds_to_cloud_init_done": self.seconds_to_cloud_init_done,
            "guest_uptime_agent_started": self.num("agent_started_at"),
            "guest_uptime_agent_dataplane": self.num("agent_dataplane_at"),
            "echo_connections_ok": self.echo_ok,
            "checks": self.checks,
            "serial_log": self.serial_log,
        })
    }
}

/// Boots once and collects the report from the serial console.
fn boot(
    dir: &Path,
    image: &Path,
    seed: &Path,
    fw: Firmware,
    kvm: bool,
    timeout: Duration,
    virtual_bytes: u64,
) -> Result<Boot> {
    std::fs::create_dir_all(dir)?;
    // A fresh overlay per boot, 1 GiB larger than the image: the image stays untouched and growpart has room.
    let overlay = dir.join("overlay.qcow2");
    run(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
            .arg(image)
            .arg(&overlay)
            .arg((virtual_bytes + (1 << 30)).to_string()),
        "creating the boot overlay",
    )?;
    let serial_log = dir.join("serial.log");
    let fwd_port = free_port()?;
    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args([
        "-machine",
        &format!("q35,accel={}", if kvm { "kvm" } else { "tcg" }),
    ])
    // Without arch-capabilities: QEMU 7.2 (Debian 12) aborts setting that MSR under newer host kernels.
    .args([
        "-cpu",
        if kvm {
            "host,-arch-capabilities"
        } else {
            "max"
        },
    ])
    .args([
        "-smp",
        "2",
        "-m",
        "2048",
        "-nodefaults",
        "-display",
        "none",
        "-no-reboot",
    ])
    .arg("-serial")
    .arg(format!("file:{}", serial_log.display()))
    .arg("-drive")
    .arg(format!("if=virtio,format=qcow2,file={}", overlay.display()))
    .arg("-drive")
    .arg(format!(
        "if=virtio,format=raw,readonly=on,file={}",
        seed.display()
    ))
    // eth0: the agent's NIC as on OpenStack; restricted, so nothing leaves the host.
    .args([
        "-netdev",
        "user,id=n0,restrict=on",
        "-device",
        "virtio-net-pci,netdev=n0",
    ])
    // eth1: the data-plane check; the host's echo server is 10.0.3.2:<port> from inside.
    .arg("-netdev")
    .arg(format!(
        "user,id=n1,net=10.0.3.0/24,hostfwd=tcp:127.0.0.1:{fwd_port}-{FILE_VIP}:80"
    ))
    .args(["-device", "virtio-net-pci,netdev=n1"]);
    if fw == Firmware::Uefi {
        let vars = dir.join("OVMF_VARS.fd");
        std::fs::copy("/usr/share/OVMF/OVMF_VARS_4M.fd", &vars)?;
        qemu.arg("-drive")
            .arg("if=pflash,format=raw,unit=0,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.fd")
            .arg("-drive")
            .arg(format!(
                "if=pflash,format=raw,unit=1,file={}",
                vars.display()
            ));
    }
    let qemu_log = std::fs::File::create(dir.join("qemu.log"))?;
    let t = Instant::now();
    let mut child = qemu
        .stdin(Stdio::null())
        .stdout(qemu_log.try_clone()?)
        .stderr(qemu_log)
        .spawn()
        .context("starting qemu-system-x86_64")?;
    let result = watch(&mut child, &serial_log, fwd_port, t, timeout, kvm);
    // Whatever happened: no QEMU left behind.
    if child.try_wait()?.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut b = result?;
    b.seconds_total = t.elapsed().as_secs_f64();
    b.serial_log = serial_log;
    Ok(b)
}

/// Follows the serial log until QEMU exits or time is up; runs the host side of the data-plane check.
fn watch(
    child: &mut Child,
    serial_log: &Path,
    fwd_port: u16,
    t: Instant,
    timeout: Duration,
    kvm: bool,
) -> Result<Boot> {
    let mut b = Boot {
        checks: BTreeMap::new(),
        infos: Vec::new(),
        echo_ok: 0,
        seconds_to_cloud_init_done: None,
        seconds_total: 0.0,
        aborted: None,
        serial_log: serial_log.to_path_buf(),
    };
    let mut seen = 0usize;
    let mut pending = String::new();
    let mut done_at: Option<Instant> = None;
    let mut kernel_started = false;
    loop {
        let exited = child.try_wait()?.is_some();
        if let Ok(bytes) = std::fs::read(serial_log) {
            if bytes.len() > seen {
                pending.push_str(&String::from_utf8_lossy(&bytes[seen..]));
                seen = bytes.len();
            }
        }
        while let Some(nl) = pending.find('\n') {
            let line: String = pending.drain(..=nl).collect();
            kernel_started |= line.contains("Linux version");
            if let Some(i) = line.find("LB-IMAGE-INFO ") {
                b.infos.push(line[i + 14..].trim().to_string());
            }
            let Some(i) = line.find("LB-IMAGE-CHECK ") else {
                continue;
            };
            let Some((k, v)) = line[i + 15..].trim().split_once('=') else {
                continue;
            };
            match (k, v) {
                ("stage", "start") => {
                    b.seconds_to_cloud_init_done = Some(t.elapsed().as_secs_f64());
                    eprintln!(
                        "image: cloud-init done after {:.1}s",
                        t.elapsed().as_secs_f64()
                    );
                }
                ("traffic", "go") => b.echo_ok = traffic(fwd_port),
                ("done", _) => done_at = Some(Instant::now()),
                _ => {}
            }
            b.checks.insert(k.to_string(), v.to_string());
        }
        if exited {
            if done_at.is_none() {
                b.aborted = Some("QEMU exited before the check finished".into());
            }
            return Ok(b);
        }
        if kvm && !kernel_started && t.elapsed() > KVM_STALL_AFTER {
            b.aborted = Some(KVM_STALLED.into());
            return Ok(b);
        }
        if t.elapsed() > timeout {
            b.aborted = Some(format!("no complete report within {}s", timeout.as_secs()));
            return Ok(b);
        }
        // The guest powers off after `done`; don't wait forever for it.
        if done_at.is_some_and(|d| d.elapsed() > Duration::from_secs(60)) {
            return Ok(b);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A port that was free a moment ago (for QEMU's port forward).
fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Opens [`TRAFFIC_FLOWS`] connections through the forwarded port; returns how many echoed correctly.
fn traffic(port: u16) -> usize {
    let mut ok = 0;
    for i in 0..TRAFFIC_FLOWS {
        let one = || -> std::io::Result<bool> {
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            let msg: Vec<u8> = format!("lb-image-boot-test {i} ")
                .bytes()
                .cycle()
                .take(1024)
                .collect();
            s.write_all(&msg)?;
            let mut back = vec![0u8; msg.len()];
            s.read_exact(&mut back)?;
            Ok(back == msg)
        };
        if matches!(one(), Ok(true)) {
            ok += 1;
        }
    }
    eprintln!("image: {ok} of {TRAFFIC_FLOWS} connections echoed through the VM's XDP data plane");
    ok
}

/// Compares the report with what it must be; returns the failures.
fn judge(b: &Boot, virtual_bytes: u64) -> Vec<String> {
    let mut fails = Vec::new();
    if let Some(why) = &b.aborted {
        fails.push(why.clone());
    }
    if b.checks.is_empty() {
        // Nothing to compare: show where the boot stopped instead of every missing key.
        let serial = std::fs::read(&b.serial_log).unwrap_or_default();
        let text = String::from_utf8_lossy(&serial);
        let tail: Vec<&str> = text.lines().rev().take(15).collect();
        let qemu =
            std::fs::read_to_string(b.serial_log.with_file_name("qemu.log")).unwrap_or_default();
        fails.push(format!(
            "the check never ran; qemu.log: {:?}; last serial lines:\n      {}",
            qemu.trim(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n      ")
        ));
        return fails;
    }
    let get = |k: &str| b.checks.get(k).map(String::as_str);
    let mut want = |key: &str, what: &str, ok: &dyn Fn(&str) -> bool| match get(key) {
        Some(v) if ok(v) => {}
        Some(v) => fails.push(format!("{what}: {key}={v}")),
        None => fails.push(format!("{what}: {key} not reported")),
    };
    let eq = |x: &'static str| move |v: &str| v == x;
    let positive = |v: &str| v.parse::<u64>().is_ok_and(|n| n > 0);
    want("cloud_init_status", "cloud-init must finish", &eq("done"));
    want(
        "cloud_init_warnings",
        "cloud-init must log no warnings (schema, modules)",
        &eq("0"),
    );
    want(
        "cloud_init_errors",
        "cloud-init must report no errors",
        &eq("0"),
    );
    want(
        "cloud_init_datasource",
        "the NoCloud seed must be the datasource",
        &|v| v.starts_with("DataSourceNoCloud"),
    );
    for (file, mode) in [
        ("/etc/lb-agent/kubeconfig", "600"),
        ("/etc/lb-agent/agent.env", "600"),
        ("/etc/lb-agent/sync-secret", "600"),
        ("/etc/systemd/system/lb-agent.service", "644"),
        ("/etc/chrony/chrony.conf", "644"),
    ] {
        let expect = format!("{mode}:root:root");
        want(
            &format!("file:{file}"),
            "user-data file with mode and owner",
            &|v| v == expect,
        );
    }
    want(
        "kubeconfig_server",
        "the kubeconfig must name the test's API server",
        &eq(API_SERVER),
    );
    want(
        "nic_eth0",
        "the NIC must be eth0 (the controller's default interface)",
        &eq("1"),
    );
    want("btf", "kernel BTF at /sys/kernel/btf/vmlinux", &eq("1"));
    want("bpffs", "bpffs mounted at /sys/fs/bpf", &eq("1"));
    want("keepalived", "keepalived installed", &|v| {
        !v.is_empty() && !v.contains("missing")
    });
    want(
        "keepalived_unit",
        "keepalived runs only under the agent",
        &eq("disabled"),
    );
    want("sshd_active", "sshd must not run without debug", &|v| {
        v != "active"
    });
    want(
        "sshd_enabled",
        "sshd must not be enabled in the image",
        &eq("disabled"),
    );
    want("sshd_processes", "no sshd process", &eq("0"));
    want(
        "ssh_host_keys",
        "host keys generated on first boot",
        &positive,
    );
    want("root_password", "root locked", &eq("L"));
    want(
        "machine_id",
        "machine-id generated on first boot",
        &eq("generated"),
    );
    want("chrony", "chrony running", &eq("active"));
    want("failed_units", "no failed systemd units", &eq(""));
    let image_mib = virtual_bytes >> 20;
    want(
        "root_fs_mib",
        "root filesystem grown to the disk (growpart)",
        &|v| v.parse::<u64>().is_ok_and(|n| n > image_mib),
    );
    want("agent_active", "lb-agent.service running", &eq("active"));
    want(
        "agent_restarts",
        "lb-agent must not crash on an unreachable API",
        &eq("0"),
    );
    want(
        "agent_api_retrying",
        "lb-agent must log that it retries the API",
        &positive,
    );
    want("agent_mode", "lb-agent attached the data plane", &|v| {
        !v.is_empty()
    });
    want("xdp_on_eth0", "XDP program on eth0", &eq("1"));
    want(
        "agent_pinned",
        "pinned maps under /sys/fs/bpf/lb/eth0",
        &eq("1"),
    );
    want("agent_healthz", "lb-agent /healthz", &eq("200 ok"));
    want(
        "file_agent_ready",
        "file-mode agent on eth1 ready",
        &eq("1"),
    );
    want("xdp_on_eth1", "XDP program on eth1", &eq("1"));
    want("file_agent_flows", "flows through the data plane", &|v| {
        v.parse::<usize>().is_ok_and(|n| n >= TRAFFIC_FLOWS)
    });
    if b.echo_ok != TRAFFIC_FLOWS {
        fails.push(format!(
            "connections echoed through eth1's data plane: {} of {TRAFFIC_FLOWS}",
            b.echo_ok
        ));
    }
    fails
}

fn print_result(name: &str, b: &Boot, failures: &[String]) {
    println!("boot test ({name}):");
    for (k, v) in &b.checks {
        println!("  {k:<42} {v}");
    }
    for i in &b.infos {
        println!("  info: {i}");
    }
    let fw = b.firmware_seconds();
    let show = |x: Option<f64>| x.map_or("-".to_string(), |s| format!("{s:.1}s"));
    println!(
        "  timings: cloud-init done {}, agent started {}, data plane attached {} (from QEMU start), whole boot {:.1}s",
        show(b.seconds_to_cloud_init_done),
        show(fw.zip(b.num("agent_started_at")).map(|(a, b)| a + b)),
        show(fw.zip(b.num("agent_dataplane_at")).map(|(a, b)| a + b)),
        b.seconds_total
    );
    if failures.is_empty() {
        println!("  result: ok");
    } else {
        println!("  result: {} problems", failures.len());
        for f in failures {
            println!("    - {f}");
        }
    }
}
