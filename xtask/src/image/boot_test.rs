//! `cargo xtask image boot-test`: boots `target/image/lb-vm.qcow2` in QEMU (KVM when usable, else TCG), each
//! time from a fresh copy-on-write overlay — with lb-controller's user data once with SeaBIOS from a NoCloud seed
//! and once with OVMF (UEFI) from a metadata service, and with yawol-controller's user data once (the first
//! firmware, NoCloud seed). QEMU's DMI does not say OpenStack, so the metadata-service boot is the VM of a cloud
//! whose VMs do not identify themselves, booted without a config drive (see image/README.md, "User data"):
//!
//! - `user-data`, lb-controller's: exactly what lb-controller gives a replicated load balancer's VM, printed by the
//!   `render_user_data` example from `lb_controller::openstack::machine::cloudinit::user_data`. Its kubeconfig names
//!   an API server that does not exist (192.0.2.1, TEST-NET-1; the VM's NIC is `restrict=on` anyway), with a real CA;
//! - `user-data`, yawol's: what yawol-controller gives a machine (`GenerateUserData`, transcribed in
//!   `testenv/support/src/yawol.rs`), written by the `yawol_boot` example, which runs a real kube-apiserver
//!   (kube-testenv) on the host's loopback with the LoadBalancer, the machine and its identity under yawol's Role.
//!   The VM reaches it at 10.0.2.2 (QEMU's user network) under the name `kubernetes.default.svc` that the server's
//!   certificate carries; the agent, started as `yawollet`, holds the VIP 10.0.2.100 on eth0 through keepalived
//!   and forwards to this process's echo server; ad-hoc debug is switched on and off by annotating the
//!   LoadBalancer; at the end the machine's status is judged as yawol-controller would, from the API server;
//! - `vendor-data`: the test's own part (never in the image) — a `bootcmd` that installs
//!   `image/boot-test/check.sh` under /run and queues it after cloud-final. It prints `LB-IMAGE-CHECK key=value`
//!   lines on the serial console and powers off;
//! - the metadata service (no seed disk): a thread here answering EC2's paths as Nova's metadata service does
//!   (Nova has no vendor data there, so the test's part goes as a second part of MIME multipart user data). The
//!   guest reaches it at 169.254.169.254:80 through QEMU's guestfwd, which needs that address inside the user
//!   network: this boot's eth0 is 169.254.169.0/24.
//!
//! With lb-controller's user data two more NICs carry the data-plane check, two-armed as a LoadBalancer with
//! `additionalNetworks`: eth1 (QEMU user network with a port forward) the VIP and the clients, eth2 (another user
//! network, no port forward) the backend. The script starts a second agent in file mode on `--interface
//! eth1,eth2,eth3` with one TCP service whose backend is this process's echo server on the host as reached through
//! eth2 only (10.0.4.2, SNAT source the guest's eth2 address). On `traffic=go` this side opens connections through
//! the forwarded port — each frame crosses the XDP program on eth1 and is redirected out of eth2 (DNAT+SNAT), each
//! reply crosses eth2's and is redirected back out of eth1 — and the guest counts the flows in the agent's metrics
//! and the XDP redirects in both NICs' virtio-net counters. A third NIC, eth3, is a multiqueue virtio-net on a tap
//! device with four queue pairs for the two vCPUs: the agent attaches there in native XDP too and reports transmit
//! queues of XDP's own (no lock) and four receive queues, where eth1 and eth2 (one queue pair) report the lock.
//!
//! Every key is compared with what it must be; failures are listed, the serial logs stay in
//! `target/image/boot-test/<boot>/serial.log`, timings go to `target/image/report.json`.

use super::{image_path, out_dir, recipe_dir, rootfs::remove_tree, write_report};
use crate::util::{output, root, run};
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::io::{BufRead, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The API server in the kubeconfig: TEST-NET-1 (RFC 5737), never routed.
const API_SERVER: &str = "https://192.0.2.1:6443";
/// The file-mode agent's VIP on eth1 (QEMU user network 10.0.3.0/24, whose host side is 10.0.3.2).
const FILE_VIP: &str = "10.0.3.15";
/// The guest's address on eth2 (QEMU user network 10.0.4.0/24): the file-mode agent's SNAT source towards its
/// backend, the host's echo server as 10.0.4.2 (slirp forwards only what comes from its guest's own address).
const FILE_SNAT: &str = "10.0.4.15";
/// Why a KVM boot was given up: the kernel printed nothing within [`KVM_STALL_AFTER`].
const KVM_STALLED: &str = "the guest kernel did not start under KVM";
const KVM_STALL_AFTER: Duration = Duration::from_secs(45);
/// The programs of lb.o, each of which `lb-agent --check-programs` must see accepted.
const PROGRAMS_IN_OBJECT: usize = 12;
/// Connections the host opens through the agent's data plane.
const TRAFFIC_FLOWS: usize = 20;
/// The yawol boot's VIP on eth0 (QEMU's default user network 10.0.2.0/24: the host is 10.0.2.2, the guest's DHCP
/// address 10.0.2.15); keepalived adds it when the machine becomes master.
const YAWOL_VIP: &str = "10.0.2.100";
/// The name under which the yawol boot's VM reaches the API server (in the server certificate of kube-testenv).
const YAWOL_API_HOST: &str = "kubernetes.default.svc";
/// The metadata-service boot's eth0 (QEMU user network; guestfwd addresses must lie inside it) and the address
/// Nova's metadata service has.
const METADATA_NET: &str = "169.254.169.0/24";
const METADATA_ADDR: &str = "169.254.169.254";
/// yawol-controller's `--yawollet-requeue-time` in the yawol boot (short: the test waits for two heartbeats).
const YAWOL_REQUEUE: u32 = 10;
/// logForward in the yawol boot's LoadBalancer (reported as not supported).
const YAWOL_LOKI_URL: &str = "http://loki.example:3100/loki/api/v1/push";

/// Which firmware to boot with.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Firmware {
    /// SeaBIOS (GRUB from the BIOS boot partition); lb-controller's user data from a NoCloud seed.
    Bios,
    /// OVMF (GRUB from the EFI system partition); lb-controller's user data from the metadata service.
    Uefi,
    /// One boot each.
    Both,
}

/// Whose user data to boot with.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum UserData {
    /// lb-controller's (one boot per firmware).
    LbController,
    /// yawol-controller's, with a real API server on the host (one boot, the first firmware).
    Yawol,
    /// Both.
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
    /// Whose user data.
    #[arg(long, value_enum, default_value = "both")]
    user_data: UserData,
    /// Give up on a boot after this many seconds (default: 150 with KVM, 420 with TCG; the yawol boot gets 100 s
    /// more).
    #[arg(long)]
    timeout: Option<u64>,
}

impl Default for BootTestArgs {
    /// The command line's defaults: both firmwares, automatic accelerator, default timeouts.
    fn default() -> Self {
        BootTestArgs {
            firmware: Firmware::Both,
            accel: Accel::Auto,
            user_data: UserData::Both,
            timeout: None,
        }
    }
}

/// Whose user data a boot has, and what goes with it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// lb-controller's (its API server does not exist; a file-mode agent on eth1 and eth2 carries the traffic).
    LbController,
    /// yawol-controller's, with the API server of the `yawol_boot` example.
    Yawol,
}

/// Where a boot's user data comes from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    /// A NoCloud seed disk (the local seed, found by its label).
    NoCloud,
    /// The test's metadata service at 169.254.169.254, no seed disk and no config drive: cloud-init must find it
    /// without OpenStack DMI (the image's Ec2 datasource).
    MetadataService,
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
    let virtual_bytes = virtual_size(&image)?;
    let firmwares: &[Firmware] = match args.firmware {
        Firmware::Both => &[Firmware::Bios, Firmware::Uefi],
        Firmware::Bios => &[Firmware::Bios],
        Firmware::Uefi => &[Firmware::Uefi],
    };
    let fw_name = |fw: Firmware| if fw == Firmware::Bios { "bios" } else { "uefi" };
    // lb-controller's user data comes from the NoCloud seed with BIOS and from the metadata service with UEFI (two
    // boots cover both firmwares and both ways in); the yawol boot needs 10.0.2.0/24 for its API server, which
    // the metadata service's network would not be.
    let source_of = |fw: Firmware| match fw {
        Firmware::Uefi => Source::MetadataService,
        _ => Source::NoCloud,
    };
    let mut plan: Vec<(String, Firmware, Kind, Source)> = Vec::new();
    if args.user_data != UserData::Yawol {
        plan.extend(firmwares.iter().map(|&fw| {
            (
                fw_name(fw).to_string(),
                fw,
                Kind::LbController,
                source_of(fw),
            )
        }));
    }
    if args.user_data != UserData::LbController {
        let fw = firmwares[0];
        plan.push((
            format!("yawol-{}", fw_name(fw)),
            fw,
            Kind::Yawol,
            Source::NoCloud,
        ));
    }
    let lb_user_data = match plan.iter().any(|p| p.2 == Kind::LbController) {
        true => Some(lb_controller_user_data(&dir)?),
        false => None,
    };
    // `lb-agent --check-programs` in the first lb-controller boot only: one kernel, and under TCG the verifier
    // takes a while over twelve programs.
    let programs_in = plan.iter().position(|p| p.2 == Kind::LbController);
    let mut report = serde_json::Map::new();
    let mut failed = Vec::new();
    for (i, (name, fw, kind, source)) in plan.into_iter().enumerate() {
        let check_programs = programs_in == Some(i);
        let lb_env = [
            ("USER_DATA", "lb-controller".to_string()),
            ("FILE_VIP", FILE_VIP.into()),
            ("FILE_SNAT", FILE_SNAT.into()),
            ("ECHO_PORT", echo_port.to_string()),
            ("CHECK_PROGRAMS", (check_programs as u8).to_string()),
        ];
        let boot_dir = dir.join(&name);
        std::fs::create_dir_all(&boot_dir)?;
        let mut yawol = match kind {
            Kind::Yawol => Some(YawolSide::start(&boot_dir, echo_port)?),
            Kind::LbController => None,
        };
        let lb_user_data = || lb_user_data.as_deref().context("lb-controller's user data");
        let way_in = match (&yawol, source) {
            (Some(y), _) => WayIn::Seed(yawol_seed(&boot_dir, y)?),
            (None, Source::NoCloud) => WayIn::Seed(write_seed(
                &boot_dir.join("seed"),
                lb_user_data()?,
                &lb_env,
                &[],
            )?),
            (None, Source::MetadataService) => WayIn::Metadata(MetadataService::start(
                &mime_user_data(lb_user_data()?, &test_cloud_config(&lb_env, &[])?),
            )?),
        };
        let b = loop {
            // TCG: a boot took 260 s on a machine busy with other builds.
            let base = if kvm { 150 } else { 420 };
            let extra = if kind == Kind::Yawol { 100 } else { 0 };
            let timeout = Duration::from_secs(args.timeout.unwrap_or(base) + extra);
            eprintln!(
                "image: booting {} with {} firmware and {} user data from {} ({}; timeout {}s)",
                image.display(),
                fw_name(fw),
                if kind == Kind::Yawol {
                    "yawol-controller's"
                } else {
                    "lb-controller's"
                },
                match &way_in {
                    WayIn::Seed(_) => "a NoCloud seed".to_string(),
                    WayIn::Metadata(_) => format!("a metadata service at {METADATA_ADDR}, no seed"),
                },
                if kvm { "KVM" } else { "TCG" },
                timeout.as_secs()
            );
            let b = boot(
                &boot_dir,
                &image,
                &way_in,
                fw,
                kvm,
                timeout,
                virtual_bytes,
                yawol.as_mut(),
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
        let failures = judge(&b, virtual_bytes, kind, source, check_programs);
        print_result(&name, &b, &failures);
        if failures.is_empty() {
            // The VM's disk is only worth its space for looking into a failure; the logs stay.
            let _ = std::fs::remove_file(boot_dir.join("overlay.qcow2"));
        }
        report.insert(name.clone(), b.json(&failures));
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

/// lb-controller's user data for a replicated load balancer whose API server does not exist, with a real CA.
fn lb_controller_user_data(dir: &Path) -> Result<String> {
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
    output(
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
    )
}

/// The seed of the yawol boot: the user data the `yawol_boot` example wrote, and a hosts entry for the API
/// server's name (the test's part: on OpenStack `API_ENDPOINT` resolves by DNS).
fn yawol_seed(dir: &Path, y: &YawolSide) -> Result<PathBuf> {
    let path = y.ready["user_data"]
        .as_str()
        .context("the yawol_boot example named no user data")?;
    let user_data = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    let hosts = format!(
        "grep -q ' {YAWOL_API_HOST}$' /etc/hosts || echo '10.0.2.2 {YAWOL_API_HOST}' >> /etc/hosts"
    );
    write_seed(
        &dir.join("seed"),
        &user_data,
        &[
            ("USER_DATA", "yawol".into()),
            ("VIP", YAWOL_VIP.into()),
            ("REQUEUE", YAWOL_REQUEUE.to_string()),
        ],
        &[serde_json::json!(["sh", "-c", hosts])],
    )
}

/// The test's own cloud-config (the NoCloud seed's vendor-data, the metadata service's second part of the user
/// data): `bootcmd` (`extra_bootcmd`, then installing check.sh and queueing it after cloud-final with `env` and
/// TRAFFIC_FLOWS).
fn test_cloud_config(
    env: &[(&str, String)],
    extra_bootcmd: &[serde_json::Value],
) -> Result<String> {
    let check = std::fs::read_to_string(recipe_dir().join("boot-test/check.sh"))?;
    let mut run_check = vec![
        "systemd-run".to_string(),
        "--no-block".into(),
        "--unit=lb-image-check".into(),
        "--property=After=cloud-final.service".into(),
        format!("--setenv=TRAFFIC_FLOWS={TRAFFIC_FLOWS}"),
    ];
    run_check.extend(env.iter().map(|(k, v)| format!("--setenv={k}={v}")));
    run_check.extend(["/bin/sh".into(), "/run/lb-image-check.sh".into()]);
    let mut bootcmd = extra_bootcmd.to_vec();
    bootcmd.extend([
        // The script as an argument: cloud-init quotes list items for the shell itself.
        serde_json::json!([
            "sh",
            "-c",
            "printf '%s' \"$1\" > /run/lb-image-check.sh",
            "sh",
            check
        ]),
        serde_json::json!(run_check),
    ]);
    let vendor = serde_json::json!({ "bootcmd": bootcmd });
    // JSON is YAML: no quoting of the script can go wrong.
    Ok(format!(
        "#cloud-config\n{}\n",
        serde_json::to_string_pretty(&vendor)?
    ))
}

/// A NoCloud seed (`<dir>.img`: a small FAT image labelled CIDATA, mkfs.vfat + mcopy, nothing to mount) with
/// `user_data` and the test's vendor-data ([`test_cloud_config`]).
fn write_seed(
    dir: &Path,
    user_data: &str,
    env: &[(&str, String)],
    extra_bootcmd: &[serde_json::Value],
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("user-data"), user_data)?;
    std::fs::write(
        dir.join("vendor-data"),
        test_cloud_config(env, extra_bootcmd)?,
    )?;
    std::fs::write(
        dir.join("meta-data"),
        "instance-id: lb-image-boot-test\nlocal-hostname: lb-image-boot-test\n",
    )?;
    let seed = dir.with_extension("img");
    let _ = std::fs::remove_file(&seed);
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
        mcopy.arg(dir.join(f));
    }
    run(mcopy.arg("::/"), "copying the seed files")?;
    Ok(seed)
}

/// How the user data reaches a boot.
enum WayIn {
    /// This NoCloud seed image as a second disk.
    Seed(PathBuf),
    /// This metadata service behind 169.254.169.254:80, no second disk.
    Metadata(MetadataService),
}

/// User data of two MIME parts, as cloud-init takes it: `user_data` unchanged, then the test's cloud-config, merged
/// into it by appending lists (the test's `bootcmd` must not replace one of the user data's). Base64 parts, so no
/// byte of either is re-encoded on the way.
fn mime_user_data(user_data: &str, test_part: &str) -> Vec<u8> {
    use base64::Engine;
    let boundary = "==lb-image-boot-test==";
    let mut out =
        format!("Content-Type: multipart/mixed; boundary=\"{boundary}\"\nMIME-Version: 1.0\n");
    for (name, merge, body) in [
        ("user-data", "", user_data),
        (
            "boot-test",
            "Merge-Type: list(append)+dict(recurse_array)+str()\n",
            test_part,
        ),
    ] {
        let b64 = base64::engine::general_purpose::STANDARD.encode(body);
        out.push_str(&format!(
            "\n--{boundary}\nContent-Type: text/cloud-config; charset=\"utf-8\"\nMIME-Version: 1.0\n\
             Content-Transfer-Encoding: base64\nContent-Disposition: attachment; filename=\"{name}\"\n{merge}\n"
        ));
        for line in b64.as_bytes().chunks(76) {
            out.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
            out.push('\n');
        }
    }
    out.push_str(&format!("--{boundary}--\n"));
    out.into_bytes()
}

/// A metadata service that answers EC2's paths as Nova's does: the versions up to 2009-04-04 and `latest` (a newer
/// EC2 version is a 404, so cloud-init falls back to 2009-04-04), `meta-data/` with Nova's keys and `user-data`;
/// anything else is a 404. A thread on the host's loopback; QEMU's guestfwd starts `socat` for each connection of
/// the guest to 169.254.169.254:80 and relays it here. Every request is logged, so a failure can say whether the
/// guest asked at all.
struct MetadataService {
    port: u16,
    requests: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl MetadataService {
    fn start(user_data: &[u8]) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let mut paths: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        let meta: &[(&str, &str)] = &[
            ("ami-id", "ami-00000001"),
            ("ami-launch-index", "0"),
            ("hostname", "lb-image-boot-test.novalocal"),
            ("instance-id", "i-00000001"),
            ("instance-type", "m1.small"),
            ("local-hostname", "lb-image-boot-test.novalocal"),
            ("local-ipv4", "169.254.169.15"),
            ("placement/availability-zone", "nova"),
            ("public-hostname", "lb-image-boot-test.novalocal"),
            ("reservation-id", "r-00000001"),
            ("security-groups", "default"),
        ];
        let versions = [
            "1.0",
            "2007-01-19",
            "2007-03-01",
            "2007-08-29",
            "2007-10-10",
            "2007-12-15",
            "2008-02-01",
            "2008-09-01",
            "2009-04-04",
        ];
        paths.insert("/".into(), (versions.join("\n") + "\nlatest").into_bytes());
        for v in versions.iter().chain(&["latest"]) {
            paths.insert(format!("/{v}/user-data"), user_data.to_vec());
            paths.insert(format!("/{v}"), b"meta-data/\nuser-data".to_vec());
            paths.insert(
                format!("/{v}/meta-data"),
                meta.iter()
                    .map(|(k, _)| {
                        k.split_once('/')
                            .map_or(k.to_string(), |(dir, _)| format!("{dir}/"))
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
                    .into_bytes(),
            );
            paths.insert(
                format!("/{v}/meta-data/placement"),
                b"availability-zone".to_vec(),
            );
            for (k, val) in meta {
                paths.insert(format!("/{v}/meta-data/{k}"), val.as_bytes().to_vec());
            }
        }
        let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = requests.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let _ = serve_metadata(conn, &paths, &log);
            }
        });
        Ok(MetadataService { port, requests })
    }

    /// The requests so far, as `METHOD PATH STATUS`.
    fn requests(&self) -> Vec<String> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

/// Answers one HTTP request (the connection is closed after it: cloud-init opens one per request anyway).
fn serve_metadata(
    mut conn: TcpStream,
    paths: &BTreeMap<String, Vec<u8>>,
    log: &std::sync::Mutex<Vec<String>>,
) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16384 {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&head);
    let mut words = head.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    // Nova answers a directory with or without its trailing slash.
    let key = if path.len() > 1 {
        path.trim_end_matches('/')
    } else {
        path
    };
    let (status, body) = match paths.get(key) {
        Some(body) if method == "GET" => ("200 OK", body.as_slice()),
        _ => ("404 Not Found", &b"404 Not Found"[..]),
    };
    if let Ok(mut l) = log.lock() {
        l.push(format!("{method} {target} {}", &status[..3]));
    }
    write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=UTF-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    conn.write_all(body)
}

/// The host side of the yawol boot: the `yawol_boot` example (a real API server with the LoadBalancer and its
/// machine, see its documentation), talked to over its stdin and stdout. Dropping it closes its stdin, which ends
/// it and its API server.
struct YawolSide {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<serde_json::Value>,
    /// Its `ready` answer (user data path, names).
    ready: serde_json::Value,
}

impl YawolSide {
    fn start(dir: &Path, echo_port: u16) -> Result<Self> {
        // The workspace selection of the unit stage, which has built the example already.
        run(
            &mut crate::test::workspace_cargo(&[
                "build",
                "--quiet",
                "--exclude",
                "lb-testbed",
                "--example",
                "yawol_boot",
            ]),
            "building lb-agent's yawol_boot example",
        )?;
        let log = std::fs::File::create(dir.join("yawol-api.log"))?;
        let mut child = Command::new(root().join("target/debug/examples/yawol_boot"))
            .arg("--out")
            .arg(dir)
            .args(["--vip", YAWOL_VIP, "--backend", "10.0.2.2", "--node-port"])
            .arg(echo_port.to_string())
            .args(["--api-host", YAWOL_API_HOST, "--requeue-time"])
            .arg(YAWOL_REQUEUE.to_string())
            .args(["--loki-url", YAWOL_LOKI_URL])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .context("starting the yawol_boot example")?;
        let stdout = child.stdout.take().context("yawol_boot's stdout")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                    if tx.send(v).is_err() {
                        break;
                    }
                }
            }
        });
        let stdin = child.stdin.take();
        let mut side = YawolSide {
            child,
            stdin,
            lines,
            ready: serde_json::Value::Null,
        };
        side.ready = side
            .answer("ready", Duration::from_secs(120))
            .with_context(|| {
                format!(
                    "the yawol_boot example did not get ready; its log: {}",
                    dir.join("yawol-api.log").display()
                )
            })?;
        eprintln!(
            "image: API server for the yawol boot on 127.0.0.1:{} (the VM's {YAWOL_API_HOST} → 10.0.2.2); YAWOLLET_ARGS={}",
            side.ready["api_port"].as_str().unwrap_or("?"),
            side.ready["yawollet_args"].as_str().unwrap_or("?")
        );
        Ok(side)
    }

    /// Sends `command` and waits for the answer named `key`.
    fn ask(&mut self, command: &str, key: &str, within: Duration) -> Result<serde_json::Value> {
        let stdin = self.stdin.as_mut().context("yawol_boot's stdin")?;
        writeln!(stdin, "{command}")?;
        stdin.flush()?;
        self.answer(key, within)
    }

    fn answer(&mut self, key: &str, within: Duration) -> Result<serde_json::Value> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(v) if v.get(key).is_some() => return Ok(v[key].clone()),
                Ok(v) => eprintln!("image: yawol_boot said {v}"),
                Err(_) => bail!(
                    "no {key:?} from the yawol_boot example within {}s",
                    within.as_secs()
                ),
            }
        }
    }
}

impl Drop for YawolSide {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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
    /// The yawol boot: the LoadBalancerMachine as the API server has it (the `yawol_boot` example's report), or why
    /// there is none.
    machine_report: Option<Result<serde_json::Value, String>>,
    /// The metadata-service boot: the requests the guest made (`METHOD PATH STATUS`).
    metadata_requests: Option<Vec<String>>,
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
            "machine_report": match &self.machine_report {
                Some(Ok(r)) => r.clone(),
                Some(Err(e)) => serde_json::json!({ "error": e }),
                None => serde_json::Value::Null,
            },
            "metadata_requests": self.metadata_requests,
            "serial_log": self.serial_log,
        })
    }
}

/// Boots once and collects the report from the serial console; with `yawol`, the yawol boot's network and host
/// side.
#[allow(clippy::too_many_arguments)]
fn boot(
    dir: &Path,
    image: &Path,
    way_in: &WayIn,
    fw: Firmware,
    kvm: bool,
    timeout: Duration,
    virtual_bytes: u64,
    yawol: Option<&mut YawolSide>,
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
    // The lb-controller boots' eth3: a NIC with several queue pairs (QEMU's user network has one queue only), on a
    // tap device removed when the boot ends.
    let multiqueue = if yawol.is_none() {
        Some(Tap::multiqueue()?)
    } else {
        None
    };
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
    .arg(format!("if=virtio,format=qcow2,file={}", overlay.display()));
    if let WayIn::Seed(seed) = way_in {
        qemu.arg("-drive").arg(format!(
            "if=virtio,format=raw,readonly=on,file={}",
            seed.display()
        ));
    }
    // eth0 of the lb-controller boots: restricted, so nothing leaves the host; with the metadata service on
    // 169.254.169.0/24 (guestfwd only forwards addresses inside the user network) and 169.254.169.254:80 relayed to
    // it, as Nova's metadata service is reached from a VM.
    let lb_eth0 = match way_in {
        WayIn::Seed(_) => "user,id=n0,restrict=on".to_string(),
        WayIn::Metadata(m) => {
            if let Ok(mut r) = m.requests.lock() {
                r.clear();
            }
            format!(
                "user,id=n0,restrict=on,net={METADATA_NET},guestfwd=tcp:{METADATA_ADDR}:80-cmd:socat STDIO TCP:127.0.0.1:{}",
                m.port
            )
        }
    };
    if yawol.is_some() {
        // eth0: the agent's NIC, reaching the API server and the echo server on the host's loopback at 10.0.2.2;
        // the host reaches the VIP through the port forward.
        qemu.arg("-netdev")
            .arg(format!(
                "user,id=n0,hostfwd=tcp:127.0.0.1:{fwd_port}-{YAWOL_VIP}:80"
            ))
            .args(["-device", "virtio-net-pci,netdev=n0"]);
    } else {
        // eth0: the agent's NIC as on OpenStack.
        qemu.arg("-netdev")
            .arg(&lb_eth0)
            .args(["-device", "virtio-net-pci,netdev=n0"])
            // eth1: the data-plane check's VIP, where the host's connections come in through the port forward.
            .arg("-netdev")
            .arg(format!(
                "user,id=n1,net=10.0.3.0/24,hostfwd=tcp:127.0.0.1:{fwd_port}-{FILE_VIP}:80"
            ))
            .args(["-device", "virtio-net-pci,netdev=n1"])
            // eth2: the data-plane check's backend side; the host's echo server is 10.0.4.2:<port> from inside.
            .arg("-netdev")
            .arg("user,id=n2,net=10.0.4.0/24")
            .args(["-device", "virtio-net-pci,netdev=n2"]);
    }
    if let Some(tap) = &multiqueue {
        // eth3: MQ_QUEUES queue pairs (MSI-X vectors: one per queue and two more), no traffic; the agent attaches
        // to it too and reports its queues.
        qemu.arg("-netdev")
            .arg(format!(
                "tap,id=n3,ifname={},script=no,downscript=no,queues={MQ_QUEUES}",
                tap.0
            ))
            .args(["-device"])
            .arg(format!(
                "virtio-net-pci,netdev=n3,mq=on,vectors={}",
                2 * MQ_QUEUES + 2
            ));
    }
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
    let result = watch(&mut child, &serial_log, fwd_port, t, timeout, kvm, yawol);
    // Whatever happened: no QEMU left behind.
    if child.try_wait()?.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut b = result?;
    b.seconds_total = t.elapsed().as_secs_f64();
    b.serial_log = serial_log;
    if let WayIn::Metadata(m) = way_in {
        b.metadata_requests = Some(m.requests());
    }
    Ok(b)
}

/// Queue pairs of the multiqueue NIC: twice the vCPUs, so that virtio-net has a transmit queue per CPU for
/// native XDP beside the stack's (one per CPU).
const MQ_QUEUES: usize = 4;

/// A multiqueue tap device on the host for one boot (QEMU opens its queues), deleted when dropped.
struct Tap(String);

impl Tap {
    fn multiqueue() -> Result<Self> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("lbmq{}-{n}", std::process::id() % 100_000);
        run(
            Command::new("ip").args(["tuntap", "add", "dev", &name, "mode", "tap", "multi_queue"]),
            "creating the multiqueue tap for the boot test (needs root and /dev/net/tun)",
        )?;
        let tap = Self(name);
        run(
            Command::new("ip").args(["link", "set", &tap.0, "up"]),
            "setting the multiqueue tap up",
        )?;
        Ok(tap)
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.0])
            .stderr(Stdio::null())
            .status();
    }
}

/// Follows the serial log until QEMU exits or time is up; runs the host side of the data-plane check and, with
/// `yawol`, of the ad-hoc debug check and the machine's report.
fn watch(
    child: &mut Child,
    serial_log: &Path,
    fwd_port: u16,
    t: Instant,
    timeout: Duration,
    kvm: bool,
    mut yawol: Option<&mut YawolSide>,
) -> Result<Boot> {
    let mut b = Boot {
        checks: BTreeMap::new(),
        infos: Vec::new(),
        echo_ok: 0,
        seconds_to_cloud_init_done: None,
        seconds_total: 0.0,
        aborted: None,
        serial_log: serial_log.to_path_buf(),
        machine_report: None,
        metadata_requests: None,
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
                ("adhoc", on_off) => {
                    if let Some(y) = yawol.as_deref_mut() {
                        let command = if on_off == "on" {
                            "adhoc-on"
                        } else {
                            "adhoc-off"
                        };
                        if let Err(e) = y.ask(command, "adhoc", Duration::from_secs(30)) {
                            b.infos.push(format!("host: {command}: {e:#}"));
                        }
                    }
                }
                ("report", "go") => {
                    if let Some(y) = yawol.as_deref_mut() {
                        eprintln!(
                            "image: reading the LoadBalancerMachine as yawol-controller would"
                        );
                        let command = format!("report {TRAFFIC_FLOWS}");
                        b.machine_report = Some(
                            y.ask(&command, "report", Duration::from_secs(180))
                                .map_err(|e| format!("{e:#}")),
                        );
                    }
                }
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

/// The failures found in one boot's report.
struct Judge<'a> {
    b: &'a Boot,
    fails: Vec<String>,
}

impl Judge<'_> {
    /// `key` must be reported and satisfy `ok`; `what` says what it means.
    fn want(&mut self, key: &str, what: &str, ok: impl Fn(&str) -> bool) {
        match self.b.checks.get(key) {
            Some(v) if ok(v) => {}
            Some(v) => self.fails.push(format!("{what}: {key}={v}")),
            None => self.fails.push(format!("{what}: {key} not reported")),
        }
    }

    fn want_eq(&mut self, key: &str, what: &str, value: &str) {
        self.want(key, what, |v| v == value);
    }

    fn want_positive(&mut self, key: &str, what: &str) {
        self.want(key, what, |v| v.parse::<u64>().is_ok_and(|n| n > 0));
    }

    fn want_files(&mut self, files: &[(&str, &str)]) {
        for (file, mode_owner) in files {
            self.want_eq(
                &format!("file:{file}"),
                "user-data file with mode and owner",
                mode_owner,
            );
        }
    }
}

/// Compares the report with what it must be; returns the failures.
fn judge(
    b: &Boot,
    virtual_bytes: u64,
    kind: Kind,
    source: Source,
    check_programs: bool,
) -> Vec<String> {
    let mut j = Judge {
        b,
        fails: Vec::new(),
    };
    if let Some(why) = &b.aborted {
        j.fails.push(why.clone());
    }
    if b.checks.is_empty() {
        // Nothing to compare: show where the boot stopped instead of every missing key.
        let serial = std::fs::read(&b.serial_log).unwrap_or_default();
        let text = String::from_utf8_lossy(&serial);
        let tail: Vec<&str> = text.lines().rev().take(15).collect();
        let qemu =
            std::fs::read_to_string(b.serial_log.with_file_name("qemu.log")).unwrap_or_default();
        // The check comes with the user data: without it, say whether any datasource asked for it.
        let asked = match &b.metadata_requests {
            Some(r) if r.is_empty() => {
                "; the guest never asked the metadata service (no datasource gave it the user data)"
                    .into()
            }
            Some(r) => {
                let user_data = r
                    .iter()
                    .find(|q| q.contains("/user-data "))
                    .map_or("never asked for", String::as_str);
                format!("; the user data from the metadata service: {user_data}; all its requests: {r:?}")
            }
            None => String::new(),
        };
        j.fails.push(format!(
            "the check never ran{asked}; qemu.log: {:?}; last serial lines:\n      {}",
            qemu.trim(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n      ")
        ));
        return j.fails;
    }
    j.want_eq("cloud_init_status", "cloud-init must finish", "done");
    j.want_eq(
        "cloud_init_warnings",
        "cloud-init must log no warnings (schema, modules)",
        "0",
    );
    j.want_eq("cloud_init_errors", "cloud-init must report no errors", "0");
    // The datasource cloud-init used, and ds-identify's choice before it (only that one, then None: a boot never
    // tries a second source).
    match source {
        Source::NoCloud => {
            j.want(
                "cloud_init_datasource",
                "the NoCloud seed must be the datasource",
                |v| v.starts_with("DataSourceNoCloud"),
            );
            j.want_eq(
                "ds_identify",
                "ds-identify must pick the NoCloud seed alone",
                "NoCloud,None",
            );
            j.want_eq(
                "cloud_init_known_warnings",
                "the Ec2 datasource's known warnings cannot come from the NoCloud seed",
                "0",
            );
        }
        Source::MetadataService => {
            j.want_eq(
                "cloud_init_datasource",
                "without OpenStack DMI, config drive or seed, the Ec2 datasource must read Nova's metadata service",
                "DataSourceEc2",
            );
            j.want_eq(
                "ds_identify",
                "ds-identify must fall back to Ec2 alone",
                "Ec2,None",
            );
            let requests = b.metadata_requests.clone().unwrap_or_default();
            if !requests.iter().any(|r| r.ends_with("/user-data 200")) {
                j.fails.push(format!(
                    "the user data was never read from the metadata service; requests: {requests:?}"
                ));
            }
        }
    }
    j.want_eq(
        "nic_eth0",
        "the NIC must be eth0 (the controller's default interface)",
        "1",
    );
    j.want_eq("btf", "kernel BTF at /sys/kernel/btf/vmlinux", "1");
    j.want_eq("bpffs", "bpffs mounted at /sys/fs/bpf", "1");
    j.want("keepalived", "keepalived installed", |v| {
        !v.is_empty() && !v.contains("missing")
    });
    j.want_eq(
        "keepalived_unit",
        "keepalived runs only under the agent",
        "disabled",
    );
    j.want(
        "keepalived_unit_active",
        "Debian's keepalived.service must not run (keepalived runs under the agent)",
        |v| v != "active",
    );
    j.want("bird", "BIRD 2 installed (active-active's BGP)", |v| {
        v.starts_with('2')
    });
    j.want_eq("bird_unit", "BIRD runs only under the agent", "disabled");
    j.want(
        "bird_unit_active",
        "Debian's bird.service must not run (BIRD runs under the agent)",
        |v| v != "active",
    );
    j.want("sshd_active", "sshd must not run without debug", |v| {
        v != "active"
    });
    j.want_eq(
        "sshd_enabled",
        "sshd must not be enabled in the image",
        "disabled",
    );
    j.want_eq("sshd_processes", "no sshd process", "0");
    j.want_positive("ssh_host_keys", "host keys generated on first boot");
    j.want_eq("root_password", "root locked", "L");
    j.want_eq(
        "machine_id",
        "machine-id generated on first boot",
        "generated",
    );
    j.want_eq("chrony", "chrony running", "active");
    j.want_eq("failed_units", "no failed systemd units", "");
    let image_mib = virtual_bytes >> 20;
    j.want(
        "root_fs_mib",
        "root filesystem grown to the disk (growpart)",
        |v| v.parse::<u64>().is_ok_and(|n| n > image_mib),
    );
    match kind {
        Kind::LbController => judge_lb_controller(&mut j, check_programs),
        Kind::Yawol => judge_yawol(&mut j),
    }
    if b.echo_ok != TRAFFIC_FLOWS {
        j.fails.push(format!(
            "connections echoed through the VM's data plane: {} of {TRAFFIC_FLOWS}",
            b.echo_ok
        ));
    }
    j.fails
}

fn judge_lb_controller(j: &mut Judge, check_programs: bool) {
    // Every program of the object through the image kernel's verifier, by `lb-agent --check-programs`: the agents
    // here attach only the fast XDP ones; the TC ones and `lbctl trace`'s would otherwise meet 6.1 nowhere.
    if check_programs {
        j.want_eq(
            "programs_exit",
            "lb-agent --check-programs: the kernel must accept every program of the data plane",
            "0",
        );
        j.want_eq("programs_refused", "programs the kernel refused", "");
        j.want_eq(
            "programs_accepted",
            "programs accepted (lb.o: lb_xdp, lb_tc, their traced twins and the eight IPv6 programs)",
            &PROGRAMS_IN_OBJECT.to_string(),
        );
    }
    j.want_files(&[
        ("/etc/lb-agent/kubeconfig", "600:root:root"),
        ("/etc/lb-agent/agent.env", "600:root:root"),
        ("/etc/lb-agent/sync-secret", "600:root:root"),
        ("/etc/systemd/system/lb-agent.service", "644:root:root"),
        ("/etc/chrony/chrony.conf", "644:root:root"),
    ]);
    j.want_eq(
        "kubeconfig_server",
        "the kubeconfig must name the test's API server",
        API_SERVER,
    );
    j.want_eq(
        "yawollet_condition",
        "yawollet.service must be skipped without yawol's env.conf",
        "no",
    );
    j.want_eq("agent_active", "lb-agent.service running", "active");
    j.want_eq(
        "agent_restarts",
        "lb-agent must not crash on an unreachable API",
        "0",
    );
    j.want_positive(
        "agent_api_retrying",
        "lb-agent must log that it retries the API",
    );
    j.want("agent_mode", "lb-agent attached the data plane", |v| {
        !v.is_empty()
    });
    j.want_eq("xdp_on_eth0", "XDP program on eth0", "1");
    j.want_eq("agent_pinned", "pinned maps under /sys/fs/bpf/lb/eth0", "1");
    j.want_eq("agent_healthz", "lb-agent /healthz", "200 ok");
    j.want_eq(
        "file_agent_ready",
        "file-mode agent on eth1,eth2,eth3 ready",
        "1",
    );
    // Native XDP on every virtio-net NIC: redirecting into eth2 (and back into eth1) needs its driver's
    // ndo_xdp_xmit, which virtio-net offers only with an XDP program attached; eth3 (no traffic) for its queues.
    for nic in ["eth1", "eth2", "eth3"] {
        j.want_eq(
            &format!("file_agent_mode_{nic}"),
            &format!("file-mode agent attached to {nic} in native XDP"),
            "XdpNative",
        );
        j.want_eq(
            &format!("xdp_on_{nic}"),
            &format!("XDP program on {nic}"),
            "1",
        );
    }
    // The image gives the host's own connections the top ports and the agent's SNAT the rest: never one port for
    // both towards a backend.
    j.want_eq(
        "kernel_port_range",
        "the image's ephemeral ports for the host's own connections",
        "60000-65535",
    );
    j.want_eq(
        "file_agent_snat_ports",
        "SNAT ports the agent chose (auto): below the kernel's",
        "1024-59999",
    );
    // lb_interface_attached's hook label says "XDP" for native XDP ("generic XDP", "TC (tcx)" otherwise).
    j.want_eq(
        "file_agent_attached",
        "lb_interface_attached of the file-mode agent: every interface, native XDP",
        "eth1:XDP,eth2:XDP,eth3:XDP",
    );
    // One queue pair per user-network NIC for two vCPUs: virtio-net shares the stack's queue with native XDP's
    // transmits under a lock, and the agent says so. On the multiqueue NIC native XDP turns all four queue pairs on:
    // the stack transmits on two, XDP on the other two (no lock), all four receive.
    j.want_eq(
        "file_agent_xdp_tx_locked",
        "lb_interface_xdp_tx_locked of the file-mode agent: the one-queue NICs locked, the multiqueue one not",
        "eth1:1,eth2:1,eth3:0",
    );
    j.want_eq(
        "file_agent_rx_queues",
        "lb_interface_queues (rx) of the file-mode agent: all four on the multiqueue NIC",
        "eth1:1,eth2:1,eth3:4",
    );
    j.want_eq(
        "file_agent_per_cpu_lists",
        "lb_flow_table_per_cpu_lists of the file-mode agent (auto): 0, eth1 and eth2 have one receive queue for two vCPUs",
        "0",
    );
    let at_least_flows = |v: &str| v.parse::<usize>().is_ok_and(|n| n >= TRAFFIC_FLOWS);
    j.want(
        "file_agent_flows",
        "flows through the data plane",
        at_least_flows,
    );
    j.want(
        "file_agent_client_packets",
        "frames client to backend (in on eth1, out of eth2)",
        at_least_flows,
    );
    j.want(
        "file_agent_backend_packets",
        "frames backend to client (in on eth2, out of eth1)",
        at_least_flows,
    );
    // Every connection's frames are redirected both ways, at least its SYN and its SYN-ACK: XDP_REDIRECT on the
    // way in (rx) and ndo_xdp_xmit on the way out (tx), as virtio-net counts them.
    for (key, what) in [
        ("eth1_xdp_redirects", "XDP redirects from eth1 to eth2"),
        ("eth2_xdp_xmit", "XDP frames sent out of eth2"),
        ("eth2_xdp_redirects", "XDP redirects from eth2 to eth1"),
        ("eth1_xdp_xmit", "XDP frames sent out of eth1"),
    ] {
        j.want(key, what, at_least_flows);
    }
}

/// The yawol boot: yawol's files and runcmd, the agent as yawollet with yawol's VRRP settings, the readyz probe,
/// traffic to the VIP, ad-hoc debug, and the machine's status as yawol-controller reads it.
fn judge_yawol(j: &mut Judge) {
    j.want_files(&[
        ("/etc/chrony/chrony.conf", "644:root:root"),
        ("/etc/yawol/kubeconfig", "600:yawol:yawol"),
        ("/etc/keepalived/keepalived.conf", "644:root:root"),
        ("/var/lib/yawol/check_yawollet_health.sh", "755:root:root"),
        ("/etc/promtail/promtail.yaml", "644:promtail:promtail"),
        ("/etc/yawol/env.conf", "644:root:root"),
    ]);
    j.want_eq(
        "shim_calls",
        "runcmd's eight OpenRC commands through the shim",
        "8",
    );
    j.want_eq("shim_failures", "no OpenRC command failed", "0");
    j.want(
        "lb_agent_unit",
        "lb-controller's unit is not part of it",
        |v| v != "active",
    );
    j.want_eq(
        "yawollet_active",
        "yawollet.service (the agent) running",
        "active",
    );
    j.want_eq("yawollet_restarts", "the agent never restarted", "0");
    j.want("agent_mode", "the agent attached the data plane", |v| {
        !v.is_empty()
    });
    j.want_eq("xdp_on_eth0", "XDP program on eth0", "1");
    j.want_eq(
        "vip_on_eth0",
        "keepalived (under the agent) holds the VIP on eth0",
        "1",
    );
    j.want_eq(
        "vrrp_router_id",
        "virtual_router_id kept from yawol's keepalived.conf",
        "100",
    );
    j.want_eq(
        "vrrp_priority",
        "priority kept from yawol's keepalived.conf",
        "50",
    );
    // yawol's VRRP, so that old and new machines form one group during a switch of image (lb-agent's
    // ha::vrrp, "Switching from yawol").
    j.want_eq(
        "vrrp_advert_int",
        "yawol's advert interval from its keepalived.conf (one VRRP group with yawol's machines)",
        "4",
    );
    j.want_eq(
        "vrrp_priority_bonus",
        "newest revision (from the machine's annotation): yawol's weights, track_process 100 + track_script 10",
        "110",
    );
    j.want_positive(
        "keepalived_under_agent",
        "keepalived runs with the agent's configuration",
    );
    j.want_eq(
        "readyz_8080",
        "/readyz on yawol's probe address 127.0.0.1:8080",
        "200",
    );
    j.want("agent_flows", "flows through the data plane", |v| {
        v.parse::<usize>().is_ok_and(|n| n >= TRAFFIC_FLOWS)
    });
    j.want_eq("adhoc_key_installed", "ad-hoc debug key installed", "1");
    j.want_eq("adhoc_sshd", "sshd started for ad-hoc debugging", "active");
    j.want_eq(
        "adhoc_keys_mode",
        "authorized_keys keeps its owner and mode",
        "600:yawoldebug:yawoldebug",
    );
    j.want_eq(
        "adhoc_key_removed",
        "ad-hoc debug key removed with the annotation",
        "1",
    );
    j.want(
        "adhoc_sshd_after",
        "sshd stopped with the annotation",
        |v| v != "active",
    );
    j.want_eq(
        "agent_refused",
        "no Forbidden/Unauthorized in the agent's log",
        "0",
    );
    let report = match &j.b.machine_report {
        Some(Ok(r)) => r.clone(),
        Some(Err(e)) => {
            j.fails
                .push(format!("the machine's status could not be read: {e}"));
            return;
        }
        None => {
            j.fails
                .push("the machine's status was not read (no report=go)".into());
            return;
        }
    };
    let mut check = |ok: bool, what: String| {
        if !ok {
            j.fails.push(what);
        }
    };
    check(
        report["yawol_ready"] == true,
        format!(
            "yawol-controller would not count the machine ready: {}",
            report["yawol_not_ready_because"]
        ),
    );
    check(
        report["keepalived_master"] == true,
        "KeepalivedMaster must be True (the set has its keepalived master)".into(),
    );
    check(
        report["refused_requests"] == 0,
        format!(
            "the API server refused requests under yawol's Role: {}",
            report["refused_requests"]
        ),
    );
    check(
        report["flows_counted"].as_u64().unwrap_or(0) >= TRAFFIC_FLOWS as u64,
        format!(
            "TCP-80-upstream_cx_total in the machine's metrics: {}",
            report["flows_counted"]
        ),
    );
    check(
        report["unparsable_metrics"]
            .as_array()
            .is_some_and(|a| a.is_empty()),
        format!(
            "metrics yawol-controller cannot parse: {}",
            report["unparsable_metrics"]
        ),
    );
    let metrics: Vec<&str> = report["metrics"]
        .as_array()
        .map(|a| a.iter().filter_map(|m| m[0].as_str()).collect())
        .unwrap_or_default();
    for name in [
        "load1",
        "load5",
        "load15",
        "uptime",
        "memTotal",
        "memFree",
        "memAvailable",
        "stealTime",
        "numCPU",
        "keepalivedIsMaster",
        "keepalivedBecameMaster",
        "keepalivedReleasedMaster",
        "keepalivedAdvertisementsSent",
        "keepalivedAdvertisementsReceived",
        "TCP-80-upstream_cx_active",
        "TCP-80-upstream_cx_total",
        "TCP-80-upstream_cx_connect_fail",
        "TCP-80-upstream_cx_rx_bytes_total",
        "TCP-80-upstream_cx_tx_bytes_total",
        "envoytcp-idle_timeout",
    ] {
        check(
            metrics.contains(&name),
            format!("metric {name} missing in the machine's status"),
        );
    }
    let condition = |ty: &str| {
        report["conditions"]
            .as_array()
            .and_then(|a| a.iter().find(|c| c["type"] == ty))
            .map(|c| {
                format!(
                    "{}/{}",
                    c["status"].as_str().unwrap_or(""),
                    c["reason"].as_str().unwrap_or("")
                )
            })
            .unwrap_or_else(|| "missing".into())
    };
    for (ty, want) in [
        // yawollet's reason between configuration changes (the report comes after two heartbeats).
        ("ConfigReady", "True/EnvoyConfigurationCreated"),
        ("EnvoyReady", "True/EnvoyReady"),
        ("EnvoyUpToDate", "True/EnvoySnapshotUpToDate"),
        ("KeepalivedMaster", "True/KeepalivedStatus"),
        ("KeepalivedProcess", "True/KeepalivedIsRunning"),
        ("KeepalivedStatsFile", "True/StatsUpToDate"),
        ("LogForward", "False/LogForwardNotSupported"),
    ] {
        let got = condition(ty);
        check(got == want, format!("condition {ty}: {got}, want {want}"));
    }
    let events: Vec<String> = report["events"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| {
                    format!(
                        "{} {}",
                        e["type"].as_str().unwrap_or(""),
                        e["reason"].as_str().unwrap_or("")
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    for want in [
        "Warning LogForwardNotSupported",
        "Warning AdHocDebuggingEnabled",
        "Normal AdHocDebuggingDisabled",
        "Normal Update",
    ] {
        check(
            events.iter().any(|e| e == want),
            format!("Event {want} missing on the machine (events: {events:?})"),
        );
    }
}

fn print_result(name: &str, b: &Boot, failures: &[String]) {
    println!("boot test ({name}):");
    for (k, v) in &b.checks {
        println!("  {k:<42} {v}");
    }
    for i in &b.infos {
        println!("  info: {i}");
    }
    if let Some(r) = &b.metadata_requests {
        println!("  metadata service: {} requests: {}", r.len(), r.join(", "));
    }
    match &b.machine_report {
        Some(Ok(r)) => {
            println!("  LoadBalancerMachine as the API server has it:");
            for c in r["conditions"].as_array().into_iter().flatten() {
                println!(
                    "    condition {:<20} {:<6} {}",
                    c["type"].as_str().unwrap_or(""),
                    c["status"].as_str().unwrap_or(""),
                    c["reason"].as_str().unwrap_or("")
                );
            }
            for m in r["metrics"].as_array().into_iter().flatten() {
                println!(
                    "    metric {:<36} {}",
                    m[0].as_str().unwrap_or(""),
                    m[1].as_str().unwrap_or("")
                );
            }
            for e in r["events"].as_array().into_iter().flatten() {
                println!(
                    "    event {} {} on {} ({}): {}",
                    e["type"].as_str().unwrap_or(""),
                    e["reason"].as_str().unwrap_or(""),
                    e["object"].as_str().unwrap_or(""),
                    e["component"].as_str().unwrap_or(""),
                    e["message"].as_str().unwrap_or("")
                );
            }
            println!(
                "    yawol-controller: ready={} keepalived master={}; requests refused by the API server: {}",
                r["yawol_ready"], r["keepalived_master"], r["refused_requests"]
            );
        }
        Some(Err(e)) => println!("  LoadBalancerMachine: not read: {e}"),
        None => {}
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
