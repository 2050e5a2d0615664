//! Switching a live yawol load balancer to this image: two "yawol machines" (Debian's keepalived with the
//! keepalived.conf yawol-controller renders, and a TCP proxy on the VIP standing in for Envoy) hold the VIP; two
//! agents with yawol's VRRP profile (VRRPv2, `advert_int 4`, `auth PASS yawol`, priority 160 = yawol's 50 plus
//! the newest revision's 110) join them, take the VIP over, and the old pair is deleted some seconds later (yawol:
//! about two minutes). Asserted: no ARP probe from the client is answered by two MACs (but for one at the instant
//! of the preemption, VRRP's own overlap), the VIP moves once, new connections fail only around that move,
//! connections opened to the new set survive the old set's removal.
//!
//! The agents run in file mode with the profile given as flags (the yawol-mode translation that selects it from
//! yawol's keepalived.conf is unit-tested in `lb_agent::source::kubernetes::yawollet`). Needs root, keepalived,
//! `lb-agent` and the eBPF objects (`cargo xtask test` provides all of them).

use lb_testbed::ha::{HaRig, HaRigConfig};
use lb_testbed::hold::HoldReport;
use lb_testbed::rig::{TCP_NODE_PORT, TCP_PORT};
use lb_testbed::topology::mac_string;
use lb_testbed::{ChildGuard, Host};
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The old set (yawol's machines) and the new one (our agents). The new machines have the higher addresses, so
/// an equal priority would also make them win: the old machines must be strictly below for the test to mean
/// anything, which is checked before the agents start.
const OLD: [Host; 2] = [Host::Lb, Host::LbReplica(2)];
const NEW: [Host; 2] = [Host::LbReplica(3), Host::LbReplica(4)];
/// Effective priority of a healthy agent of the newest revision in yawol mode: yawol's `priority 50` plus the
/// `track_process` (100) and `track_script` (10) weights.
const NEW_PRIORITY: u8 = 160;
/// How long the old set runs next to the new master before it is deleted (yawol-controller: about two minutes).
const OVERLAP: Duration = Duration::from_secs(8);
/// New connections may fail only this close to the VIP's move (the stated bound).
const FAILURE_WINDOW: Duration = Duration::from_secs(2);

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `f` on a new thread inside `host`'s network namespace, without waiting for it.
fn spawn_in<T: Send + 'static>(
    rig: &HaRig,
    host: Host,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let ns = std::fs::File::open(Path::new("/var/run/netns").join(rig.topo.netns(host)))
        .expect("netns file");
    std::thread::spawn(move || {
        // SAFETY: setns on a valid fd; it changes only this new thread's network namespace.
        assert_eq!(
            unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) },
            0,
            "setns: {}",
            std::io::Error::last_os_error()
        );
        f()
    })
}

/// One yawol machine: keepalived with yawol's configuration and a TCP proxy on the VIP ("Envoy").
struct YawolMachine {
    host: Host,
    dir: PathBuf,
    keepalived: Option<ChildGuard>,
    proxy_stop: Option<tokio::sync::oneshot::Sender<()>>,
    proxy: Option<std::thread::JoinHandle<()>>,
}

/// yawol-controller's keepalived.conf for `vip`, adapted to a network namespace: the interface name, the path of
/// the readyz check script, and — because keepalived's `track_process` needs the process-events connector, which
/// the kernel offers only in the initial network namespace ("process event listen … Connection refused") — the
/// Envoy process check as a `vrrp_script` of the same weight; the scripts run as root (Debian has no
/// `keepalived_script` user). VRRP version, advert interval, password, router id, priority and weights are
/// yawol's, unchanged.
fn yawol_conf(vip: Ipv4Addr, ifname: &str, dir: &Path) -> String {
    let mut conf = lb_test_support::yawol::keepalived_conf(&vip.to_string());
    let mut replace = |from: &str, to: &str| {
        assert!(
            conf.contains(from),
            "yawol's keepalived.conf lacks {from:?}"
        );
        conf = conf.replace(from, to);
    };
    replace("interface eth0", &format!("interface {ifname}"));
    replace(
        lb_test_support::yawol::HEALTH_CHECK_SCRIPT,
        &dir.join("readyz.sh").display().to_string(),
    );
    replace(
        "\tenable_script_security\n",
        "\tenable_script_security\n\tscript_user root\n",
    );
    replace(
        "vrrp_track_process envoy {\n\tprocess envoy\n\tweight 100\n}",
        &format!(
            "vrrp_script envoy {{\n\tscript \"{}\"\n\tinterval 1\n\tweight 100\n}}",
            dir.join("envoy-alive.sh").display()
        ),
    );
    replace(
        "\ttrack_process {\n\t\tenvoy\n\t}",
        "\ttrack_script {\n\t\tenvoy\n\t}",
    );
    conf
}

impl YawolMachine {
    fn start(rig: &HaRig, host: Host, backend: Ipv4Addr) -> Self {
        let dir = std::env::temp_dir().join(format!("{}-yawol-{}", rig.topo.id(), host.name()));
        std::fs::create_dir_all(&dir).unwrap();
        // Scripts must not be writable by others (enable_script_security).
        let script = |name: &str, body: String| {
            use std::os::unix::fs::PermissionsExt;
            let p = dir.join(name);
            std::fs::write(&p, body).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        };
        // yawollet's readyz passes only while the machine's revision is the LoadBalancer's.
        script(
            "readyz.sh",
            format!(
                "#!/bin/sh\ntest -e {}\n",
                dir.join("current-revision").display()
            ),
        );
        script(
            "envoy-alive.sh",
            format!("#!/bin/sh\ntest -e {}\n", dir.join("envoy-alive").display()),
        );
        std::fs::write(dir.join("current-revision"), "").unwrap();
        std::fs::write(
            dir.join("keepalived.conf"),
            yawol_conf(rig.vip, rig.topo.ifname(host), &dir),
        )
        .unwrap();

        // Envoy binds the VIP with freebind; the proxy needs the namespace's non-local bind for the same.
        rig.topo
            .exec(host, ["sysctl", "-qw", "net.ipv4.ip_nonlocal_bind=1"])
            .unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let listen = SocketAddr::from((rig.vip, TCP_PORT));
        let upstream = SocketAddr::from((backend, TCP_NODE_PORT));
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let proxy = spawn_in(rig, host, move || proxy(listen, upstream, rx, bound_tx));
        bound_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("proxy bound");
        std::fs::write(dir.join("envoy-alive"), "").unwrap();

        let keepalived = rig
            .topo
            .spawn(
                host,
                [
                    "env".to_string(),
                    format!("TMPDIR={}", dir.display()),
                    "keepalived".into(),
                    "-n".into(),
                    "-l".into(),
                    "-P".into(),
                    "-D".into(),
                    "-f".into(),
                    dir.join("keepalived.conf").display().to_string(),
                    "-p".into(),
                    dir.join("keepalived.pid").display().to_string(),
                    "-r".into(),
                    dir.join("vrrp.pid").display().to_string(),
                ],
            )
            .unwrap();
        YawolMachine {
            host,
            dir,
            keepalived: Some(keepalived),
            proxy_stop: Some(tx),
            proxy: Some(proxy),
        }
    }

    /// The LoadBalancer's revision moved on: yawollet's readyz fails from now on (priority 160 → 150 after
    /// `fall 3` × `interval 2`).
    fn become_old_revision(&self) {
        std::fs::remove_file(self.dir.join("current-revision")).unwrap();
    }

    /// keepalived's state and effective priority, from a fresh SIGUSR1 data dump.
    fn vrrp(&self) -> Option<(String, u32)> {
        let pid: i32 = std::fs::read_to_string(self.dir.join("keepalived.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let data = self.dir.join("keepalived.data");
        let _ = std::fs::remove_file(&data);
        // SAFETY: kill(2) on keepalived's pid from its own pid file; it handles SIGUSR1 once started.
        unsafe { libc::kill(pid, libc::SIGUSR1) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(2) {
            if let Ok(text) = std::fs::read_to_string(&data) {
                let instance = text.split("VRRP Instance = ENVOY").nth(1)?;
                let field = |name: &str| {
                    instance
                        .lines()
                        .find_map(|l| l.trim().strip_prefix(name).map(|v| v.trim().to_string()))
                };
                if let (Some(state), Some(prio)) =
                    (field("State = "), field("Effective priority = "))
                {
                    return Some((state, prio.parse().ok()?));
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// yawol-controller deletes the machine: the VM and everything on it is gone at once.
    fn delete(&mut self, rig: &HaRig) {
        rig.cut_link(self.host, true).unwrap();
        if let Some(mut k) = self.keepalived.take() {
            k.kill();
        }
        if let Some(tx) = self.proxy_stop.take() {
            let _ = tx.send(());
        }
        if let Some(p) = self.proxy.take() {
            p.join().unwrap();
        }
    }

    fn log(&self) -> String {
        self.keepalived
            .as_ref()
            .map(|k| k.stderr() + &k.stdout())
            .unwrap_or_default()
    }
}

impl Drop for YawolMachine {
    fn drop(&mut self) {
        if let Some(mut k) = self.keepalived.take() {
            k.kill();
        }
        if let Some(tx) = self.proxy_stop.take() {
            let _ = tx.send(());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The stand-in for Envoy: a TCP proxy from `listen` to `upstream` (a backend's NodePort) until `stop`; its
/// connections end with it, as Envoy's do when its machine is deleted.
fn proxy(
    listen: SocketAddr,
    upstream: SocketAddr,
    stop: tokio::sync::oneshot::Receiver<()>,
    bound: std::sync::mpsc::Sender<()>,
) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let l = tokio::net::TcpListener::bind(listen)
            .await
            .expect("bind VIP");
        bound.send(()).unwrap();
        let accept = async {
            loop {
                let Ok((mut down, _)) = l.accept().await else {
                    continue;
                };
                tokio::spawn(async move {
                    if let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
            }
        };
        tokio::select! {
            _ = accept => {}
            _ = stop => {}
        }
    });
    rt.shutdown_background();
}

/// One ARP probe from the client: who-has VIP, and the MACs that answered within the window.
struct ArpSample {
    at: Instant,
    macs: BTreeSet<[u8; 6]>,
}

/// Sends an ARP request for `vip` every 50 ms on the client's interface and records who answers, until `stop`.
fn arp_watch(
    ifname: String,
    mac: [u8; 6],
    ip: Ipv4Addr,
    vip: Ipv4Addr,
    stop: Arc<AtomicBool>,
) -> Vec<ArpSample> {
    let proto = (libc::ETH_P_ARP as u16).to_be();
    // SAFETY: plain socket(2); the fd is closed below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto as i32) };
    assert!(
        fd >= 0,
        "packet socket: {}",
        std::io::Error::last_os_error()
    );
    let cname = std::ffi::CString::new(ifname).unwrap();
    // SAFETY: valid C string.
    let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
    assert!(ifindex > 0, "no interface");
    // SAFETY: sockaddr_ll is plain data; zeroed is a valid value.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = proto;
    sll.sll_ifindex = ifindex as i32;
    sll.sll_halen = 6;
    sll.sll_addr[..6].copy_from_slice(&[0xff; 6]);
    // SAFETY: bind/setsockopt with correctly sized arguments on our fd.
    unsafe {
        assert_eq!(
            libc::bind(
                fd,
                &sll as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32
            ),
            0
        );
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 5_000,
        };
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        );
    }
    let mut req = Vec::with_capacity(42);
    req.extend_from_slice(&[0xff; 6]);
    req.extend_from_slice(&mac);
    req.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
    req.extend_from_slice(&mac);
    req.extend_from_slice(&ip.octets());
    req.extend_from_slice(&[0; 6]);
    req.extend_from_slice(&vip.octets());
    let mut samples = Vec::new();
    let mut buf = [0u8; 128];
    while !stop.load(Ordering::Relaxed) {
        let at = Instant::now();
        // SAFETY: sendto on our fd with the bound link-layer address.
        unsafe {
            libc::sendto(
                fd,
                req.as_ptr() as *const libc::c_void,
                req.len(),
                0,
                &sll as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            );
        }
        let mut macs = BTreeSet::new();
        while at.elapsed() < Duration::from_millis(40) {
            // SAFETY: recv into a buffer of the given size.
            let n = unsafe { libc::recv(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
            if n < 42 {
                continue;
            }
            let f = &buf[..n as usize];
            // An ARP reply (op 2) whose sender address is the VIP.
            if f[12..14] == [0x08, 0x06] && f[20..22] == [0, 2] && f[28..32] == vip.octets() {
                let mut m = [0u8; 6];
                m.copy_from_slice(&f[22..28]);
                macs.insert(m);
            }
        }
        samples.push(ArpSample { at, macs });
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: our fd, closed once.
    unsafe { libc::close(fd) };
    samples
}

/// One new connection of the stream: when it started and whether a backend answered through the VIP.
struct Attempt {
    at: Instant,
    ok: bool,
    error: String,
}

/// Opens a new connection to `target` every 25 ms (a backend greets with its id), until `stop`.
fn connect_stream(target: SocketAddr, stop: Arc<AtomicBool>) -> Vec<Attempt> {
    let mut out = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let at = Instant::now();
        let r = (|| -> std::io::Result<()> {
            let mut s = TcpStream::connect_timeout(&target, Duration::from_millis(500))?;
            s.set_read_timeout(Some(Duration::from_millis(500)))?;
            let mut greeting = [0u8; 64];
            let n = s.read(&mut greeting)?;
            if n == 0 || !greeting[..n].contains(&b'\n') {
                return Err(std::io::Error::other("no greeting"));
            }
            s.write_all(b"ping\n")?;
            Ok(())
        })();
        out.push(Attempt {
            at,
            ok: r.is_ok(),
            error: r.err().map(|e| e.to_string()).unwrap_or_default(),
        });
        std::thread::sleep(Duration::from_millis(25));
    }
    out
}

fn hold_args(vip: Ipv4Addr, conns: usize) -> Vec<String> {
    [
        "--tcp".to_string(),
        format!("{vip}:{TCP_PORT}"),
        "--connections".into(),
        conns.to_string(),
        "--interval-ms".into(),
        "100".into(),
        "--timeout-ms".into(),
        "3000".into(),
        "--brief".into(),
    ]
    .into()
}

fn start_hold(rig: &HaRig, conns: usize) -> lb_testbed::rig::Hold {
    let args = hold_args(rig.vip, conns);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    rig.start_hold(&args).expect("hold starts")
}

fn report(what: &str, rep: &HoldReport) {
    println!(
        "{what}: {} TCP established {}, broken {}, longest gap {:.0} ms",
        rep.tcp_connections, rep.established, rep.broken, rep.max_gap_ms
    );
}

#[test]
fn yawol_machines_hand_the_vip_to_agents_in_one_move() {
    assert!(lb_testbed::is_root(), "needs root");
    let mut cfg = HaRigConfig::new().expect("artifacts built");
    cfg.replicas = 4;
    cfg.backends = 2;
    cfg.router_id = 100;
    cfg.advert_interval = Duration::from_secs(4);
    cfg.sync = false;
    cfg.start_agents = false;
    cfg.agent_args = ["--vrrp-version", "2", "--vrrp-auth-pass", "yawol"]
        .map(String::from)
        .into();
    let mut rig = HaRig::start(cfg).expect("rig starts");
    let backend = rig.topo.ip(Host::Backend(1));
    let host_of = |rig: &HaRig, mac: &[u8; 6]| {
        rig.topo
            .lbs()
            .into_iter()
            .find(|h| rig.topo.mac(*h) == *mac)
            .map_or_else(|| mac_string(mac), |h| h.to_string())
    };

    // The yawol load balancer as it runs today: both machines of the current revision (160), one master.
    let mut old: Vec<YawolMachine> = OLD
        .iter()
        .map(|h| YawolMachine::start(&rig, *h, backend))
        .collect();
    let old_master = rig
        .wait_master_where(Duration::from_secs(60), |h| OLD.contains(&h))
        .unwrap_or_else(|e| {
            panic!(
                "{e}\n{}",
                old.iter().map(YawolMachine::log).collect::<String>()
            )
        });
    println!("yawol master: {old_master}");

    let stop = Arc::new(AtomicBool::new(false));
    let arp = {
        let (ifname, mac, ip, vip, stop) = (
            rig.topo.ifname(Host::Client).to_string(),
            rig.topo.mac(Host::Client),
            rig.topo.ip(Host::Client),
            rig.vip,
            stop.clone(),
        );
        spawn_in(&rig, Host::Client, move || {
            arp_watch(ifname, mac, ip, vip, stop)
        })
    };
    let stream = {
        let (target, stop) = (SocketAddr::from((rig.vip, TCP_PORT)), stop.clone());
        spawn_in(&rig, Host::Client, move || connect_stream(target, stop))
    };
    // Connections the old Envoy holds across the switch.
    let t_hold_old = Instant::now();
    let hold_old = start_hold(&rig, 20);

    // yawol-controller created the new LoadBalancerSet: the LoadBalancer's revision moved on, the old machines'
    // readyz fails and they drop to 150.
    for m in &old {
        m.become_old_revision();
    }
    let at_150 = |m: &YawolMachine| m.vrrp().is_some_and(|(_, p)| p == 150);
    wait_until(
        "the old machines at priority 150",
        Duration::from_secs(30),
        || old.iter().all(at_150),
    );
    assert_eq!(rig.master().unwrap(), Some(old_master));

    // The new machines boot. Each takes part in VRRP only once ready (FAULT before), then at 160 > 150 preempts.
    let t_agents = Instant::now();
    let mut t_ready = t_agents;
    for h in NEW {
        rig.start_agent(h, NEW_PRIORITY)
            .unwrap_or_else(|e| panic!("{e}"));
        if h == NEW[0] {
            t_ready = Instant::now();
        }
    }
    let new_master = rig
        .wait_master_where(Duration::from_secs(30), |h| NEW.contains(&h))
        .unwrap_or_else(|e| {
            panic!(
                "{e}\n{}",
                old.iter().map(YawolMachine::log).collect::<String>()
            )
        });
    println!(
        "new master {new_master} {:.1} s after the agents started",
        t_agents.elapsed().as_secs_f64()
    );
    // One group: the old machines hear the new master and are backups, not masters of a group of their own.
    wait_until(
        "the old machines to be backups",
        Duration::from_secs(20),
        || {
            old.iter()
                .all(|m| m.vrrp().is_some_and(|(s, _)| s == "BACKUP"))
        },
    );

    // Connections opened to the new set, then the overlap, then yawol-controller deletes the old machines.
    let hold_new = start_hold(&rig, 20);
    std::thread::sleep(OVERLAP);
    let old_hold = hold_old.stop().expect("hold report");
    let t_deleted = Instant::now();
    for m in &mut old {
        m.delete(&rig);
    }
    std::thread::sleep(Duration::from_secs(10));
    let new_hold = hold_new.stop().expect("hold report");
    assert_eq!(
        rig.master().unwrap(),
        Some(new_master),
        "the VIP stayed on the new master after the old set was deleted"
    );
    stop.store(true, Ordering::Relaxed);
    let samples = arp.join().unwrap();
    let attempts = stream.join().unwrap();

    // No ARP probe was answered by two machines, but for VRRP's one overlap: the instant of the preemption, while
    // the old master processes the new master's first advert (a probe arriving then meets both; it was seen on a
    // loaded machine). At most that one probe, answered by exactly the old and the new master, and the next
    // answer is the new master's alone. The VIP's MAC changed exactly once: old → new master.
    let answered: Vec<&ArpSample> = samples.iter().filter(|s| !s.macs.is_empty()).collect();
    let doubles: Vec<usize> = (0..samples.len())
        .filter(|i| samples[*i].macs.len() > 1)
        .collect();
    let names = |s: &ArpSample| s.macs.iter().map(|m| host_of(&rig, m)).collect::<Vec<_>>();
    assert!(
        doubles.len() <= 1,
        "the VIP answered by two machines in {} probes, e.g. {:?}",
        doubles.len(),
        names(&samples[doubles[0]])
    );
    for &i in &doubles {
        let both: BTreeSet<[u8; 6]> = [rig.topo.mac(old_master), rig.topo.mac(new_master)].into();
        assert_eq!(
            samples[i].macs,
            both,
            "the VIP answered by {:?} at once",
            names(&samples[i])
        );
        let next = samples[i + 1..].iter().find(|s| !s.macs.is_empty());
        assert_eq!(
            next.map(|s| s.macs.clone()),
            Some([rig.topo.mac(new_master)].into()),
            "after the preemption's overlap the new master alone answers"
        );
        println!("one probe met the preemption's overlap (answered by the old and the new master)");
    }
    let mut owners: Vec<[u8; 6]> = answered
        .iter()
        .filter(|s| s.macs.len() == 1)
        .map(|s| *s.macs.first().unwrap())
        .collect();
    owners.dedup();
    let owners: Vec<String> = owners.iter().map(|m| host_of(&rig, m)).collect();
    assert_eq!(
        owners,
        [old_master.to_string(), new_master.to_string()],
        "the VIP's owners over time, as the client's ARP probes saw them"
    );
    let moved_at = answered
        .iter()
        .find(|s| s.macs.contains(&rig.topo.mac(new_master)))
        .unwrap()
        .at;
    println!(
        "ARP: {} probes, {} answered, VIP moved {:.1} s after the agents started, {:.1} s after the first was \
         ready; the old set was deleted {:.1} s after the move",
        samples.len(),
        answered.len(),
        moved_at.duration_since(t_agents).as_secs_f64(),
        moved_at.duration_since(t_ready).as_secs_f64(),
        t_deleted.duration_since(moved_at).as_secs_f64()
    );

    // An agent takes part only once ready (FAULT before): the VIP cannot have moved before the first one was.
    assert!(
        moved_at >= t_ready,
        "the VIP moved before any new machine was ready"
    );

    // New connections fail only around the move (within FAILURE_WINDOW of it).
    let failed: Vec<&Attempt> = attempts.iter().filter(|a| !a.ok).collect();
    let distance = |a: &Attempt| {
        if a.at > moved_at {
            a.at - moved_at
        } else {
            moved_at - a.at
        }
    };
    let max_distance = failed.iter().map(|a| distance(a)).max().unwrap_or_default();
    println!(
        "new connections: {} attempts, {} failed, the farthest failure {:.0} ms from the move; first errors: {:?}",
        attempts.len(),
        failed.len(),
        max_distance.as_secs_f64() * 1000.0,
        failed.iter().take(3).map(|a| &a.error).collect::<Vec<_>>()
    );
    assert!(
        attempts.iter().filter(|a| a.ok).count() > 100,
        "the stream of new connections ran"
    );
    assert!(
        max_distance <= FAILURE_WINDOW,
        "a new connection failed {max_distance:?} from the VIP's move"
    );

    // What the switch costs: the old Envoy's connections end (measured, not asserted); the new set's survive.
    report("held through the old proxy", &old_hold);
    // When they broke, relative to the VIP's move (negative: before it).
    let broke: Vec<f64> = old_hold
        .connections
        .iter()
        .filter_map(|c| c.error_at_s)
        .map(|s| {
            (t_hold_old + Duration::from_secs_f64(s))
                .duration_since(t_hold_old)
                .as_secs_f64()
                - moved_at.duration_since(t_hold_old).as_secs_f64()
        })
        .collect();
    if !broke.is_empty() {
        println!(
            "old proxy's connections broke {:.2}..{:.2} s after the VIP's move (the old set was deleted {:.1} s \
             after it): {:?}",
            broke.iter().cloned().fold(f64::INFINITY, f64::min),
            broke.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
            t_deleted.duration_since(moved_at).as_secs_f64(),
            old_hold.connections.iter().filter_map(|c| c.error.clone()).collect::<BTreeSet<_>>()
        );
    }
    report("held through the new set", &new_hold);
    assert_eq!(new_hold.established, 20);
    assert_eq!(
        new_hold.broken, 0,
        "connections to the new set broke when the old set was deleted"
    );
}
