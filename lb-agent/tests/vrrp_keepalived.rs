//! VRRP with real keepalived (Debian's 2.2): two or three network namespaces joined by a bridge (in a namespace
//! of its own), one `Keepalived` supervisor per node whose keepalived runs inside the node's namespace through
//! `ip netns exec`. Needs root and keepalived.

use lb_agent::ha::vrrp::{check_config, Keepalived, VrrpOptions, VrrpState};
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const VIP: &str = "10.77.0.100";
const VIP2: &str = "10.77.0.101";
const ROUTER_ID: u8 = 51;

fn vip() -> IpAddr {
    VIP.parse().unwrap()
}

fn ip(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Nodes `n0..` with `eth0` = 10.77.0.(i+1)/24 on a bridge in a switch namespace. Dropping it (also while a test
/// panics) kills every process left in the namespaces, deletes them and removes the run directories.
struct Net {
    switch: String,
    nodes: Vec<String>,
    dir: PathBuf,
}

impl Net {
    fn new(n: usize) -> Net {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let id = format!(
            "kv{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        // Names first, so the guard cleans up whatever part of the set-up succeeded.
        let net = Net {
            switch: format!("{id}-sw"),
            nodes: (0..n).map(|i| format!("{id}-n{i}")).collect(),
            dir: std::env::temp_dir().join(format!("lb-vrrp-{id}")),
        };
        ip(&["netns", "add", &net.switch]);
        ip(&["-n", &net.switch, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &net.switch, "link", "set", "br0", "up"]);
        for (i, ns) in net.nodes.iter().enumerate() {
            let port = format!("p{i}");
            ip(&["netns", "add", ns]);
            ip(&[
                "-n",
                ns,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                &port,
                "netns",
                &net.switch,
            ]);
            ip(&[
                "-n",
                &net.switch,
                "link",
                "set",
                &port,
                "master",
                "br0",
                "up",
            ]);
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("10.77.0.{}/24", i + 1),
                "dev",
                "eth0",
            ]);
            ip(&["-n", ns, "link", "set", "eth0", "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        net
    }

    fn opts(&self, i: usize, priority: u8) -> VrrpOptions {
        let mut o = VrrpOptions::new("eth0", ROUTER_ID, self.dir.join(format!("n{i}")));
        o.base_priority = priority;
        o.command_prefix = ["ip", "netns", "exec", &self.nodes[i]]
            .map(String::from)
            .to_vec();
        o
    }

    fn has_vip(&self, i: usize, vip: &str) -> bool {
        ip(&["-n", &self.nodes[i], "-o", "addr", "show", "dev", "eth0"])
            .contains(&format!("inet {vip}/32 "))
    }

    /// Which nodes carry `vip`.
    fn vip_holders(&self, vip: &str) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|i| self.has_vip(*i, vip))
            .collect()
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.nodes.iter().chain([&self.switch]) {
            if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    if let Ok(pid) = pid.parse::<i32>() {
                        // SAFETY: plain syscall on a process inside our test namespace.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    }
                }
            }
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn wait_state(k: &Keepalived, want: VrrpState, within: Duration, what: &str) -> Duration {
    let start = Instant::now();
    let mut rx = k.state();
    let reached = matches!(
        tokio::time::timeout(within, rx.wait_for(|s| *s == want)).await,
        Ok(Ok(_))
    );
    assert!(
        reached,
        "{what}: state {} after {within:?}, wanted {want}",
        *rx.borrow()
    );
    start.elapsed()
}

async fn wait_until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ok() {
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn alive(pid: u32) -> bool {
    // A zombie still answers kill(0); its cmdline is empty.
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty())
}

const T: Duration = Duration::from_secs(10);

/// Two healthy keepalived on `net`: n0 (priority 100) MASTER, n1 (90) BACKUP.
async fn master_and_backup(net: &Net) -> (Keepalived, Keepalived) {
    let k0 = Keepalived::start(net.opts(0, 100), vec![vip()])
        .await
        .unwrap();
    let k1 = Keepalived::start(net.opts(1, 90), vec![vip()])
        .await
        .unwrap();
    k0.set_healthy(true).unwrap();
    k1.set_healthy(true).unwrap();
    wait_state(&k0, VrrpState::Master, T, "n0 master").await;
    wait_state(&k1, VrrpState::Backup, T, "n1 backup").await;
    (k0, k1)
}

/// keepalived's forwarded log and the supervisor's messages, shown with `--nocapture`.
fn init_tracing() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
}

#[tokio::test]
async fn election_health_bonus_vips_and_stats() {
    init_tracing();
    let net = Net::new(3);
    check_config(&net.opts(0, 100), &[vip(), VIP2.parse().unwrap()])
        .await
        .expect("keepalived -t accepts the rendered configuration");

    let mut ks = Vec::new();
    for (i, prio) in [100, 90, 80].into_iter().enumerate() {
        ks.push(
            Keepalived::start(net.opts(i, prio), vec![vip()])
                .await
                .unwrap(),
        );
    }
    // A fresh start is unhealthy: nobody may hold the VIP.
    for (i, k) in ks.iter().enumerate() {
        assert!(!k.adopted());
        wait_state(k, VrrpState::Fault, T, &format!("n{i} starts in FAULT")).await;
    }
    assert!(net.vip_holders(VIP).is_empty());

    for k in &ks {
        k.set_healthy(true).unwrap();
    }
    wait_state(
        &ks[0],
        VrrpState::Master,
        T,
        "highest priority becomes master",
    )
    .await;
    wait_state(&ks[1], VrrpState::Backup, T, "n1 backup").await;
    wait_state(&ks[2], VrrpState::Backup, T, "n2 backup").await;
    wait_until("VIP on n0 only", T, || net.vip_holders(VIP) == [0]).await;

    // An unhealthy master goes to FAULT and the VIP moves; healthy again, it preempts.
    ks[0].set_healthy(false).unwrap();
    let moved = wait_state(&ks[1], VrrpState::Master, T, "n1 takes over").await;
    wait_state(&ks[0], VrrpState::Fault, T, "n0 in FAULT").await;
    wait_until("VIP on n1 only", T, || net.vip_holders(VIP) == [1]).await;
    println!("set_healthy(false) on the master: VIP moved in {moved:?}");
    ks[0].set_healthy(true).unwrap();
    wait_state(&ks[0], VrrpState::Master, T, "n0 preempts back").await;
    wait_state(&ks[1], VrrpState::Backup, T, "n1 back to backup").await;
    wait_until("VIP back on n0", T, || net.vip_holders(VIP) == [0]).await;

    // A priority bonus (newest revision) preempts: 80 + 30 > 100.
    ks[2].set_priority_bonus(30).unwrap();
    wait_state(&ks[2], VrrpState::Master, T, "bonus preempts").await;
    wait_state(&ks[0], VrrpState::Backup, T, "n0 yields").await;
    wait_until("VIP on n2 only", T, || net.vip_holders(VIP) == [2]).await;

    // VIPs: unchanged → no reload; a new VIP is reloaded in without moving the master.
    assert!(!ks[2].set_vips(vec![vip(), vip()]).unwrap());
    let mut n0_state = ks[0].state();
    n0_state.borrow_and_update();
    for k in &ks {
        assert!(k.set_vips(vec![VIP2.parse().unwrap(), vip()]).unwrap());
    }
    wait_until("second VIP on n2", T, || net.has_vip(2, VIP2)).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(*ks[2].state().borrow(), VrrpState::Master);
    assert!(!n0_state.has_changed().unwrap(), "a reload moved n0");
    assert_eq!(net.vip_holders(VIP), [2]);
    assert_eq!(net.vip_holders(VIP2), [2]);
    assert_eq!(ks[2].vips().len(), 2);

    // Stats (SIGUSR2 → keepalived.stats in each run directory) and yawol's metric names.
    let s2 = ks[2].stats().await.unwrap();
    assert!(s2.is_master);
    assert!(
        s2.became_master >= 1 && s2.advertisements_sent > 0,
        "{s2:?}"
    );
    let s0 = ks[0].stats().await.unwrap();
    assert!(!s0.is_master);
    assert!(s0.became_master >= 2 && s0.released_master >= 2, "{s0:?}");
    assert!(s0.advertisements_received > 0, "{s0:?}");
    for i in [0, 2] {
        assert!(net.opts(i, 1).paths().stats.exists(), "stats file of n{i}");
    }
    let metrics = ks[2].yawol_metrics().await;
    let names: Vec<&str> = metrics.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "keepalivedIsMaster",
            "keepalivedBecameMaster",
            "keepalivedReleasedMaster",
            "keepalivedAdvertisementsSent",
            "keepalivedAdvertisementsReceived"
        ]
    );
    assert_eq!(metrics[0].1, "1");
    println!("n0 {s0:?}\nn2 {s2:?}");

    // A graceful stop releases at once (priority-0 advert) and removes the VIPs; stop() itself takes a second
    // more (keepalived lingers to send IGMP leaves).
    let k2 = ks.pop().unwrap();
    let pid = k2.pid().unwrap();
    let t = Instant::now();
    let stopping = tokio::spawn(k2.stop());
    let takeover = wait_state(
        &ks[0],
        VrrpState::Master,
        T,
        "n0 takes over after n2 stopped",
    )
    .await;
    stopping.await.unwrap().unwrap();
    println!(
        "graceful stop of the master: n0 master after {takeover:?}, stop() returned after {:?}",
        t.elapsed()
    );
    assert!(!alive(pid), "keepalived still running after stop()");
    wait_until("VIP on n0 only", T, || net.vip_holders(VIP) == [0]).await;
    for k in ks {
        k.stop().await.unwrap();
    }
    assert!(net.vip_holders(VIP).is_empty());
}

#[tokio::test]
async fn crashed_keepalived_fails_over_and_is_restarted() {
    init_tracing();
    let net = Net::new(2);
    let (k0, k1) = master_and_backup(&net).await;

    // A crash: SIGKILL to keepalived's process group (parent and VRRP child), so no priority-0 advert is sent.
    let pid = k0.pid().unwrap();
    let start = Instant::now();
    // SAFETY: plain syscall on the process group of the keepalived we started.
    assert_eq!(unsafe { libc::kill(-(pid as i32), libc::SIGKILL) }, 0);
    wait_state(&k1, VrrpState::Master, T, "backup takes over").await;
    let takeover = start.elapsed();
    println!(
        "killed master's keepalived (SIGKILL): backup MASTER after {takeover:?} (advert 200 ms)"
    );
    wait_until("n1 carries the VIP", T, || net.has_vip(1, VIP)).await;

    // The supervisor restarts it; with the higher priority it preempts again.
    wait_until("restart counted", T, || k0.restarts() == 1).await;
    wait_until("new keepalived", T, || k0.pid().is_some_and(|p| p != pid)).await;
    wait_state(&k0, VrrpState::Master, T, "restarted n0 preempts").await;
    wait_state(&k1, VrrpState::Backup, T, "n1 back to backup").await;
    wait_until("VIP on n0 only", T, || net.vip_holders(VIP) == [0]).await;
    println!(
        "supervisor restarted keepalived: pid {pid} → {}, master again after {:?}",
        k0.pid().unwrap(),
        start.elapsed()
    );
    k0.stop().await.unwrap();
    k1.stop().await.unwrap();
}

#[tokio::test]
async fn restarted_agent_adopts_keepalived_without_moving_the_vip() {
    init_tracing();
    let net = Net::new(2);
    let (k0, k1) = master_and_backup(&net).await;
    wait_until("VIP on n0", T, || net.vip_holders(VIP) == [0]).await;
    let pid = k0.pid().unwrap();
    let mut n1_state = k1.state();
    n1_state.borrow_and_update();

    // The agent dies without stopping keepalived: its FIFO readers go away, keepalived keeps running and
    // logging into a FIFO nobody reads.
    drop(k0);
    k1.set_priority_bonus(5).unwrap(); // 95 < 100: no change, but keepalived logs the priority change
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(alive(pid), "keepalived died with its agent");
    assert_eq!(net.vip_holders(VIP), [0]);

    // The new agent adopts it: same process, state read from its data dump, configuration reloaded.
    let k0 = Keepalived::start(net.opts(0, 100), vec![vip()])
        .await
        .unwrap();
    assert!(k0.adopted());
    assert_eq!(k0.pid(), Some(pid));
    assert_eq!(*k0.state().borrow(), VrrpState::Master);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(
        !n1_state.has_changed().unwrap(),
        "the adoption moved the VIP"
    );
    assert_eq!(net.vip_holders(VIP), [0]);
    assert_eq!(*k0.state().borrow(), VrrpState::Master);
    let stats = k0.stats().await.unwrap();
    assert!(stats.is_master && stats.became_master == 1, "{stats:?}");

    // Transitions still reach the adopting agent.
    k0.set_healthy(false).unwrap();
    wait_state(&k0, VrrpState::Fault, T, "adopted n0 reports FAULT").await;
    wait_state(&k1, VrrpState::Master, T, "n1 takes over").await;
    k0.stop().await.unwrap();
    assert!(!alive(pid));
    k1.stop().await.unwrap();
}

/// yawol's VRRP profile (VRRPv2, whole-second adverts, `auth PASS`): nodes with the same password form one group
/// (one master), a node with another password does not hear it — which is why yawol mode takes the password,
/// version and interval from yawol's keepalived.conf.
#[tokio::test]
async fn vrrpv2_password_decides_who_is_one_group() {
    init_tracing();
    let net = Net::new(3);
    let v2 = |i: usize, priority: u8, pass: &str| {
        let mut o = net.opts(i, priority);
        o.version = 2;
        o.advert_interval = Duration::from_secs(1);
        o.auth_pass = Some(pass.to_string());
        o
    };
    check_config(&v2(0, 160, "yawol"), &[vip()])
        .await
        .expect("keepalived -t accepts the VRRPv2 configuration");
    let k0 = Keepalived::start(v2(0, 160, "yawol"), vec![vip()])
        .await
        .unwrap();
    k0.set_healthy(true).unwrap();
    wait_state(&k0, VrrpState::Master, T, "n0 master").await;
    let k1 = Keepalived::start(v2(1, 150, "yawol"), vec![vip()])
        .await
        .unwrap();
    k1.set_healthy(true).unwrap();
    wait_state(&k1, VrrpState::Backup, T, "n1 backup").await;
    // Longer than a master-down interval (3 adverts and skew): n1 hears n0 and stays backup.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(net.vip_holders(VIP), [0], "one group, one master");
    assert_eq!(*k1.state().borrow(), VrrpState::Backup);

    let k2 = Keepalived::start(v2(2, 150, "other"), vec![vip()])
        .await
        .unwrap();
    k2.set_healthy(true).unwrap();
    wait_state(&k2, VrrpState::Master, T, "n2 master of a group of its own").await;
    assert_eq!(
        net.vip_holders(VIP),
        [0, 2],
        "another password: two masters"
    );
}
