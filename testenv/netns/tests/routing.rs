//! Backends behind routes a routing daemon learned: the routed topology with real BIRD 2 in the load balancer's
//! namespace and in each backend's. Every backend announces a service address of its own (a /32 on its loopback,
//! as BGP-speaking nodes do) over BGP; the load balancer's BIRD installs the routes in its kernel, and the agent,
//! knowing nothing of BGP, follows them. A route withdrawn while connections run: new flows leave that backend
//! (its health check finds no route) while established ones go on (the backend still answers them on its
//! segment, so they are not ended); re-announced, the backend takes new flows again. A route that moves reaches
//! new flows within a second (the agent watches the kernel's route changes). Needs root and bird2.

use lb_testbed::rig::{
    lb_config_yaml, spawn_bird, Rig, RigConfig, TCP_NODE_PORT, TCP_PORT, UDP_PORT,
};
use lb_testbed::{ChildGuard, Host};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const LB_AS: u32 = 65000;

/// Backend `i`'s service address (on its loopback, announced over BGP).
fn service_addr(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 210, 0, i as u8)
}

/// BIRD in `host`'s namespace with `conf`; its control socket under `dir`.
fn bird(r: &Rig, dir: &Path, host: Host, conf: &str) -> (ChildGuard, PathBuf) {
    spawn_bird(r.topo.netns(host), dir, &host.name(), conf).expect("bird starts")
}

fn birdc(r: &Rig, host: Host, sock: &Path, args: &[&str]) {
    let mut argv = vec![
        "/usr/sbin/birdc".to_string(),
        "-s".into(),
        sock.display().to_string(),
    ];
    argv.extend(args.iter().map(|a| a.to_string()));
    r.topo.exec(host, argv).expect("birdc");
}

/// The routes BIRD installed in the load balancer's kernel.
fn bird_routes(r: &Rig) -> String {
    let out = r
        .topo
        .exec(Host::Lb, ["ip", "route", "show", "proto", "bird"])
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn wait_for(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn healthy(r: &Rig, i: usize) -> bool {
    r.metric(
        "lb_backend_healthy",
        &format!("backend=\"{}:{TCP_NODE_PORT}\"", service_addr(i)),
    )
    .unwrap()
        == 1.0
}

/// The routed topology, the agent in native XDP with `agent_args` added.
fn routed_rig(agent_args: &[&str]) -> Rig {
    assert!(lb_testbed::is_root(), "end-to-end tests need root");
    let mut cfg = RigConfig::new().expect("artifacts built");
    cfg.attach_mode = "xdp-native".into();
    cfg.topology.routed = true;
    cfg.agent_args
        .extend(agent_args.iter().map(|a| a.to_string()));
    Rig::start(cfg).expect("rig starts")
}

#[test]
fn backends_behind_bgp_routes_and_a_route_withdrawn_under_traffic() {
    let r = routed_rig(&[]);
    let dir = std::env::temp_dir().join(format!("{}-bird", r.topo.id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lb_ip = r.topo.backend_side(Host::Lb).unwrap().ip;

    // The load balancer: one BGP session per backend, routes into the kernel, nothing announced.
    let mut lb_conf = format!(
        "router id {lb_ip};\nprotocol device {{}}\n\
         protocol kernel {{ ipv4 {{ import none; export all; }}; }}\n"
    );
    for i in 1..=3 {
        let b = r.topo.ip(Host::Backend(i));
        lb_conf += &format!(
            "protocol bgp b{i} {{ local {lb_ip} as {LB_AS}; neighbor {b} as {}; \
             ipv4 {{ import all; export none; }}; }}\n",
            LB_AS + i as u32
        );
    }
    let mut daemons = vec![bird(&r, &dir, Host::Lb, &lb_conf).0];
    let mut socks = Vec::new();
    for i in 1..=3 {
        let h = Host::Backend(i);
        let b = r.topo.ip(h);
        r.topo
            .exec(
                h,
                [
                    "ip",
                    "addr",
                    "add",
                    &format!("{}/32", service_addr(i)),
                    "dev",
                    "lo",
                ],
            )
            .unwrap();
        // Replies from the service address (a UDP server on 0.0.0.0 answers from the route's source address):
        // the load balancer's reverse entry expects the address it sent to.
        let (gw, src) = (lb_ip.to_string(), service_addr(i).to_string());
        r.topo
            .exec(
                h,
                ["ip", "route", "replace", "default", "via", &gw, "src", &src],
            )
            .unwrap();
        let conf = format!(
            "router id {b};\nprotocol device {{}}\n\
             protocol direct {{ ipv4; interface \"lo\"; }}\n\
             protocol bgp lb {{ local {b} as {}; neighbor {lb_ip} as {LB_AS}; \
             ipv4 {{ import none; export where net ~ [ 10.210.0.0/16+ ]; }}; }}\n",
            LB_AS + i as u32
        );
        let (c, sock) = bird(&r, &dir, h, &conf);
        daemons.push(c);
        socks.push(sock);
    }
    wait_for(
        "the three routes learned over BGP",
        Duration::from_secs(60),
        || {
            let routes = bird_routes(&r);
            (1..=3).all(|i| routes.contains(&format!("{} via", service_addr(i))))
        },
    );

    // The LoadBalancer's endpoints are the service addresses: reachable only through the learned routes.
    let vip = IpAddr::from(r.vip);
    let nodes: Vec<Vec<IpAddr>> = (1..=3).map(|i| vec![service_addr(i).into()]).collect();
    r.update_config(&lb_config_yaml(&[vip], &nodes, ""))
        .unwrap();
    wait_for("all three healthy", Duration::from_secs(20), || {
        (1..=3).all(|i| healthy(&r, i))
    });
    let tcp = format!("{}:{TCP_PORT}", r.vip);
    let udp = format!("{}:{UDP_PORT}", r.vip);
    let load = |n: &str| {
        r.load(&[
            "--tcp",
            &tcp,
            "--connections",
            n,
            "--udp",
            &udp,
            "--udp-flows",
            n,
        ])
        .unwrap()
    };
    let rep = load("300");
    let t = rep.tcp.as_ref().unwrap();
    assert_eq!((t.ok, t.failed), (300, 0), "{:?}", t.errors);
    assert_eq!(t.per_backend.len(), 3, "{:?}", t.per_backend);
    assert_eq!(rep.udp.as_ref().unwrap().failed, 0);

    // Held connections, then backend 1's route is withdrawn.
    let hold = r
        .start_hold(&["--tcp", &tcp, "--connections", "30", "--interval-ms", "100"])
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    birdc(&r, Host::Backend(1), &socks[0], &["disable", "lb"]);
    wait_for(
        "backend 1's route withdrawn",
        Duration::from_secs(20),
        || !bird_routes(&r).contains(&format!("{} via", service_addr(1))),
    );
    wait_for(
        "backend 1 out of selection",
        Duration::from_secs(20),
        || !healthy(&r, 1),
    );
    let rep = load("300");
    let t = rep.tcp.as_ref().unwrap();
    assert_eq!((t.ok, t.failed), (300, 0), "{:?}", t.errors);
    assert!(
        !t.per_backend.contains_key("backend-1"),
        "no new flow to the withdrawn backend: {:?}",
        t.per_backend
    );
    assert_eq!(rep.udp.as_ref().unwrap().failed, 0);

    // Re-announced: it takes new flows again.
    birdc(&r, Host::Backend(1), &socks[0], &["enable", "lb"]);
    wait_for("backend 1 back", Duration::from_secs(30), || healthy(&r, 1));
    let rep = load("300");
    let t = rep.tcp.as_ref().unwrap();
    assert_eq!((t.ok, t.failed), (300, 0), "{:?}", t.errors);
    assert!(
        t.per_backend.contains_key("backend-1"),
        "{:?}",
        t.per_backend
    );

    // The held connections lived through it all: backend 1 failed its checks (no route), which ends its
    // connections only once it is silent on them, and it was not — it still answered on its segment through the
    // cached next hop.
    let held = hold.stop().unwrap();
    assert_eq!(held.established, 30);
    assert_eq!(held.broken, 0, "{held:?}");
    assert!(
        held.per_backend.contains_key("backend-1"),
        "some held connections went to the backend whose route was withdrawn: {:?}",
        held.per_backend
    );
    drop(daemons);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A route that moves to another host — an anycast service address on two backends, its route switched from
/// one to the other as a routing daemon would — reaches new flows at once: the agent watches the kernel's route
/// changes, with the periodic next-hop refresh set to a minute here so that only the watch can explain a move
/// within the wait.
#[test]
fn a_route_moved_to_another_host_reaches_new_flows_at_once() {
    let r = routed_rig(&["--neighbor-interval=60"]);
    let anycast = Ipv4Addr::new(10, 210, 0, 100);
    for i in 1..=2 {
        r.topo
            .exec(
                Host::Backend(i),
                ["ip", "addr", "add", &format!("{anycast}/32"), "dev", "lo"],
            )
            .unwrap();
    }
    let via = |i: usize| {
        let (to, gw) = (
            format!("{anycast}/32"),
            r.topo.ip(Host::Backend(i)).to_string(),
        );
        r.topo
            .exec(Host::Lb, ["ip", "route", "replace", &to, "via", &gw])
            .unwrap();
    };
    via(1);
    r.update_config(&lb_config_yaml(
        &[IpAddr::from(r.vip)],
        &[vec![anycast.into()]],
        "",
    ))
    .unwrap();
    let backend = format!("backend=\"{anycast}:{TCP_NODE_PORT}\"");
    wait_for(
        "the anycast backend healthy",
        Duration::from_secs(20),
        || r.metric("lb_backend_healthy", &backend).unwrap() == 1.0,
    );
    let tcp = format!("{}:{TCP_PORT}", r.vip);
    let answered_by = || {
        let rep = r.load(&["--tcp", &tcp, "--connections", "5"]).unwrap();
        let t = rep.tcp.unwrap();
        assert_eq!(t.failed, 0, "{:?}", t.errors);
        t.per_backend.keys().cloned().collect::<Vec<_>>()
    };
    assert_eq!(answered_by(), ["backend-1"]);
    let t = Instant::now();
    via(2);
    wait_for(
        "new flows through the moved route",
        Duration::from_secs(20),
        || answered_by() == ["backend-2"],
    );
    eprintln!("new flows followed the moved route after {:?}", t.elapsed());
}
