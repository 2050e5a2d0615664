//! Test bed tests against real network namespaces (need root, and fail without it). Traffic only
//! flows between the namespaces each test creates.

use std::path::PathBuf;
use std::time::Duration;

use lb_testbed::hold::HoldReport;
use lb_testbed::load::{self, LoadReport, TcpLoadConfig};
use lb_testbed::topology::{list_netns, mac_string};
use lb_testbed::{is_root, ChildGuard, Host, Topology};

const BIN: &str = env!("CARGO_BIN_EXE_lb-testbed");

/// These tests need root; `cargo xtask test` runs as root, and a silent skip would hide a broken suite.
fn root() -> bool {
    assert!(is_root(), "network-namespace tests need root");
    true
}

fn namespaces_of(id: &str) -> Vec<String> {
    let prefix = format!("{id}-");
    list_netns()
        .unwrap()
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

/// Starts `lb-testbed echo` on every backend (TCP 30080, UDP 30053) and waits until each is listening.
fn start_echo(topo: &Topology) -> Vec<ChildGuard> {
    topo.backends()
        .map(|b| {
            let id = b.name();
            let mut child = topo
                .spawn(
                    b,
                    [
                        BIN,
                        "echo",
                        "--id",
                        &id,
                        "--tcp",
                        "0.0.0.0:30080",
                        "--udp",
                        "0.0.0.0:30053",
                    ],
                )
                .unwrap();
            child
                .wait_for_stdout("\"ready\":true", Duration::from_secs(10))
                .unwrap();
            child
        })
        .collect()
}

/// The load generator's TCP run with `cfg`, in-process, from a thread inside the client namespace.
fn tcp_from_client(topo: &Topology, cfg: TcpLoadConfig) -> load::TcpReport {
    topo.run_in(Host::Client, move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(load::run_tcp(cfg))
    })
    .unwrap()
}

fn tmp_path(topo: &Topology, name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("{}-{name}", topo.id()))
}

#[test]
fn topology_layout_and_teardown_leave_nothing_behind() {
    if !root() {
        return;
    }
    let topo = Topology::create().unwrap();
    let id = topo.id().to_string();
    // switch + client + lb + 3 backends
    assert_eq!(namespaces_of(&id).len(), 6);
    assert_eq!(topo.ip(Host::Lb).to_string(), "10.200.0.2");
    assert_eq!(topo.ip(Host::Client).to_string(), "10.200.0.10");
    assert_eq!(topo.ip(Host::Backend(3)).to_string(), "10.200.0.13");
    assert_eq!(mac_string(&topo.mac(Host::Backend(1))), "02:00:0a:c8:00:0b");

    // The kernel agrees with what we expose: MAC, address, TX checksum offload off, lo up.
    let link = topo
        .exec(Host::Backend(1), ["ip", "-o", "link", "show", "eth0"])
        .unwrap();
    assert!(String::from_utf8_lossy(&link.stdout).contains("02:00:0a:c8:00:0b"));
    let features = topo.exec(Host::Client, ["ethtool", "-k", "eth0"]).unwrap();
    assert!(String::from_utf8_lossy(&features.stdout).contains("tx-checksumming: off"));
    let lo = topo
        .exec(Host::Lb, ["ip", "-o", "link", "show", "lo"])
        .unwrap();
    assert!(String::from_utf8_lossy(&lo.stdout).contains("UP"));
    topo.add_addr(Host::Lb, topo.addr(100)).unwrap();
    let addrs = topo
        .exec(Host::Lb, ["ip", "-o", "addr", "show", "eth0"])
        .unwrap();
    assert!(String::from_utf8_lossy(&addrs.stdout).contains("10.200.0.100/32"));
    // IPv6 is off by default: no link-local chatter reaching the load balancer.
    assert!(!String::from_utf8_lossy(&addrs.stdout).contains("inet6"));

    // A failing command names itself and carries stderr.
    let err = topo
        .exec(Host::Client, ["ip", "link", "show", "nosuchdev"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("nosuchdev") && err.contains("does not exist"),
        "{err}"
    );

    // A child whose guard outlives the topology is killed by the topology's teardown.
    let sleeper = topo.spawn(Host::Backend(2), ["sleep", "1000"]).unwrap();
    let pid = sleeper.pid();
    drop(topo);
    assert!(
        namespaces_of(&id).is_empty(),
        "left behind: {:?}",
        namespaces_of(&id)
    );
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    assert!(stat.contains(") Z "), "sleep still running: {stat}");
    drop(sleeper);
}

#[test]
fn teardown_happens_when_a_test_panics() {
    if !root() {
        return;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::thread::spawn(move || {
        let topo = Topology::with_backends(1).unwrap();
        tx.send(topo.id().to_string()).unwrap();
        panic!("simulated test failure");
    })
    .join();
    assert!(result.is_err());
    let id = rx.recv().unwrap();
    assert!(
        namespaces_of(&id).is_empty(),
        "left behind: {:?}",
        namespaces_of(&id)
    );
}

#[test]
fn cleanup_stale_removes_only_dead_owners() {
    if !root() {
        return;
    }
    // A pid that certainly belonged to a process that is gone now.
    let mut dead = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    let prefix = format!("lbtstale{}", std::process::id());
    let stale = format!("{prefix}-{dead_pid}-0-client");
    let live = format!("{prefix}-{}-0-client", std::process::id());
    for ns in [&stale, &live] {
        lb_testbed::topology::run_cmd(["ip", "netns", "add", ns.as_str()]).unwrap();
    }
    let removed = Topology::cleanup_stale(&prefix).unwrap();
    let left = list_netns().unwrap();
    lb_testbed::topology::run_cmd(["ip", "netns", "del", live.as_str()]).unwrap();
    assert_eq!(removed, vec![stale.clone()]);
    assert!(!left.contains(&stale));
    assert!(left.contains(&live));
}

#[test]
fn echo_and_load_on_the_direct_path() {
    if !root() {
        return;
    }
    let topo = Topology::create().unwrap();
    let _echo = start_echo(&topo);
    let b1 = topo.ip(Host::Backend(1));
    let b2 = topo.ip(Host::Backend(2));
    let out = topo
        .spawn(
            Host::Client,
            [
                BIN,
                "load",
                "--tcp",
                &format!("{b1}:30080"),
                "--connections",
                "1000",
                "--concurrency",
                "32",
                "--payload",
                "2000",
                "--udp",
                &format!("{b2}:30053"),
                "--udp-flows",
                "200",
                "--deadline-secs",
                "20",
                "--strict",
            ],
        )
        .unwrap()
        .finish(Duration::from_secs(45))
        .unwrap();
    let report: LoadReport =
        serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    assert!(out.status.success(), "{out:?}");
    let tcp = report.tcp.unwrap();
    assert_eq!((tcp.ok, tcp.failed), (1000, 0), "{tcp:?}");
    assert_eq!(tcp.per_backend.get("backend-1"), Some(&1000));
    assert_eq!(tcp.bytes_received, 2_000_000);
    let udp = report.udp.unwrap();
    assert_eq!((udp.ok, udp.failed), (200, 0), "{udp:?}");
    assert_eq!(udp.per_backend.get("backend-2"), Some(&200));
    eprintln!(
        "direct path (debug build): TCP {:.0} conn/s, connect p50 {:.3} ms p99 {:.3} ms; UDP {:.0} flows/s, rtt p50 {:.3} ms",
        tcp.connections_per_s, tcp.connect_ms.p50, tcp.connect_ms.p99, udp.flows_per_s, udp.rtt_ms.p50
    );

    // The same generator in-process, from a thread inside the client namespace.
    let target = format!("{}:30080", topo.ip(Host::Backend(3)))
        .parse()
        .unwrap();
    let report = tcp_from_client(
        &topo,
        TcpLoadConfig {
            connections: 50,
            ..TcpLoadConfig::new(target)
        },
    );
    assert_eq!(report.per_backend.get("backend-3"), Some(&50), "{report:?}");

    // A backend whose link is down fails cleanly and quickly, and recovers when it comes back.
    topo.set_link(Host::Backend(3), false).unwrap();
    let short = move || TcpLoadConfig {
        connections: 3,
        op_timeout: Duration::from_millis(300),
        ..TcpLoadConfig::new(target)
    };
    let down = tcp_from_client(&topo, short());
    assert_eq!(down.ok, 0, "{down:?}");
    topo.set_link(Host::Backend(3), true).unwrap();
    let up = tcp_from_client(&topo, short());
    assert_eq!(up.ok, 3, "{up:?}");
}

/// With IPv6 on, every host has its /64 address at once (no DAD wait) and a dual-stack echo server answers both
/// families: what the IPv6 load-balancer tests build on.
#[test]
fn ipv6_topology_carries_both_families_on_the_direct_path() {
    if !root() {
        return;
    }
    let topo = Topology::new(lb_testbed::TopologyConfig {
        backends: 1,
        ipv6: true,
        ..Default::default()
    })
    .unwrap();
    let b1 = topo.ip6(Host::Backend(1));
    assert_eq!(b1.to_string(), "fd00:a:c8::b");
    assert_eq!(topo.ip6(Host::Client), topo.addr6(Host::Client.octet()));
    let _echo = lb_testbed::rig::spawn_echo(&topo, Host::Backend(1)).unwrap();
    let v4 = topo.ip(Host::Backend(1));
    let out = topo
        .spawn(
            Host::Client,
            [
                BIN,
                "load",
                "--tcp",
                &format!("[{b1}]:30080"),
                "--connections",
                "200",
                "--udp",
                &format!("[{b1}]:30053"),
                "--udp-flows",
                "100",
                "--deadline-secs",
                "20",
                "--strict",
            ],
        )
        .unwrap()
        .finish(Duration::from_secs(45))
        .unwrap();
    let report: LoadReport =
        serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    let (tcp, udp) = (report.tcp.unwrap(), report.udp.unwrap());
    assert_eq!((tcp.ok, udp.ok), (200, 100), "{tcp:?} {udp:?}");
    // The same dual-stack server over IPv4.
    let target = format!("{v4}:30080").parse().unwrap();
    let rep = tcp_from_client(
        &topo,
        TcpLoadConfig {
            connections: 20,
            ..TcpLoadConfig::new(target)
        },
    );
    assert_eq!(rep.ok, 20, "{rep:?}");
    // An extra IPv6 address (a VIP) is usable at once.
    let vip6 = topo.addr6(100);
    topo.add_addr(Host::Backend(1), vip6).unwrap();
    let target = format!("[{vip6}]:30080").parse().unwrap();
    let rep = tcp_from_client(
        &topo,
        TcpLoadConfig {
            connections: 5,
            ..TcpLoadConfig::new(target)
        },
    );
    assert_eq!(rep.ok, 5, "{rep:?}");
    topo.del_addr(Host::Backend(1), vip6).unwrap();
}

#[test]
fn hold_keeps_every_connection_alive() {
    if !root() {
        return;
    }
    let topo = Topology::create().unwrap();
    let _echo = start_echo(&topo);
    let ready = tmp_path(&topo, "ready");
    let stop = tmp_path(&topo, "stop");
    let b1 = topo.ip(Host::Backend(1));
    let b2 = topo.ip(Host::Backend(2));
    let mut hold = topo
        .spawn(
            Host::Client,
            [
                BIN,
                "hold",
                "--tcp",
                &format!("{b1}:30080"),
                "--connections",
                "100",
                "--udp",
                &format!("{b2}:30053"),
                "--udp-flows",
                "30",
                "--interval-ms",
                "50",
                "--duration-secs",
                "0",
                "--ready-file",
                ready.to_str().unwrap(),
                "--stop-file",
                stop.to_str().unwrap(),
                "--strict",
            ],
        )
        .unwrap();
    // A second holder stopped by SIGTERM, the way the demo ends it.
    let sig_hold = topo
        .spawn(
            Host::Client,
            [
                BIN,
                "hold",
                "--tcp",
                &format!("{b2}:30080"),
                "--connections",
                "10",
                "--duration-secs",
                "0",
            ],
        )
        .unwrap();
    for _ in 0..500 {
        if ready.exists() {
            break;
        }
        assert!(
            hold.try_wait().unwrap().is_none(),
            "hold exited early: {}",
            hold.stderr()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(ready.exists(), "hold never became ready: {}", hold.stderr());
    std::thread::sleep(Duration::from_secs(3));
    std::fs::write(&stop, "").unwrap();
    let out = hold.finish(Duration::from_secs(10)).unwrap();
    let _ = std::fs::remove_file(&ready);
    let _ = std::fs::remove_file(&stop);
    let report: HoldReport =
        serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    assert!(out.status.success(), "{out:?}");
    assert_eq!(report.stop_reason, "stop_file");
    assert_eq!((report.established, report.broken), (130, 0), "{report:?}");
    assert_eq!(report.per_backend.get("backend-1"), Some(&100));
    assert_eq!(report.udp_per_backend.get("backend-2"), Some(&30));
    assert_eq!(report.udp_backend_changes, 0);
    // 3 s at 50 ms: ~60 round trips per connection; allow for scheduling noise on a busy machine.
    assert!(
        report.connections.iter().all(|c| c.round_trips >= 30),
        "{report:?}"
    );
    assert!(report.max_gap_ms < 1000.0, "{}", report.max_gap_ms);
    eprintln!(
        "hold: {} round trips, max gap {:.1} ms",
        report.round_trips, report.max_gap_ms
    );

    let out = sig_hold.terminate(Duration::from_secs(5)).unwrap();
    let report: HoldReport =
        serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    assert_eq!(
        (report.stop_reason.as_str(), report.broken),
        ("signal", 0),
        "{report:?}"
    );
}

#[test]
fn rawsend_reaches_the_lb_interface() {
    if !root() {
        return;
    }
    let topo = Topology::with_backends(1).unwrap();
    let rx_packets = |topo: &Topology| -> u64 {
        let out = topo
            .exec(
                Host::Lb,
                ["cat", "/sys/class/net/eth0/statistics/rx_packets"],
            )
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    };
    let before = rx_packets(&topo);
    let out = topo
        .exec(
            Host::Client,
            [
                BIN,
                "rawsend",
                "--iface",
                "eth0",
                "--dst-mac",
                &mac_string(&topo.mac(Host::Lb)),
                "--dst-ip",
                &topo.addr(100).to_string(),
                "--count",
                "100",
            ],
        )
        .unwrap();
    let report: lb_testbed::rawsend::RawSendReport = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report.total_sent, 100, "{report:?}");
    assert_eq!(
        report.sent.len(),
        lb_testbed::rawsend::MalformedKind::ALL.len()
    );
    assert!(report.errors.is_empty());
    let after = rx_packets(&topo);
    assert!(after - before >= 100, "lb saw {} frames", after - before);
}
