//! PROXY protocol v2 end to end: each backend runs a real server that takes the header — HAProxy (`accept-proxy`)
//! on two, nginx (stream module, `listen … proxy_protocol`) on the third — in front of the testbed's echo server,
//! which speaks first (its greeting names the backend), so every connection goes client → load balancer (the
//! header put in by XDP) → HAProxy or nginx (parses it, logs the addresses it carried) → echo server, and back.
//! Every payload byte is verified by the loader, every connection's header by the acceptors' logs: the client's
//! address and port, the VIP and the service port, for IPv4 and IPv6 — also with loss on the way into the client
//! and the backends, and with segments reordered there. Needs root, HAProxy, nginx and nftables. (Failover: `ha.rs`,
//! `master_dies_and_proxy_connections_survive`.)

use lb_testbed::proxy_backend::{Acceptor, ProxyBackend};
use lb_testbed::rig::{Rig, RigConfig, TCP_PORT};
use lb_testbed::Host;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// A dual-stack rig whose TCP port asks for PROXY v2, its backends' echo servers moved behind HAProxy (backends 1
/// and 2) and nginx (backend 3).
fn rig() -> (Rig, Vec<ProxyBackend>) {
    assert!(lb_testbed::is_root(), "end-to-end tests need root");
    let mut cfg = RigConfig::new().expect("artifacts built");
    cfg.topology.ipv6 = true;
    cfg.options = "  tcpProxyProtocol: true\n".into();
    let mut r = Rig::start(cfg).expect("rig starts");
    let dir = std::env::temp_dir().join(format!("lbt-proxy-{}", r.topo.id()));
    std::fs::create_dir_all(&dir).unwrap();
    for i in 1..=3 {
        r.stop_backend(i).unwrap();
    }
    let backends = ProxyBackend::start_all(&r.topo, &dir, |b| match b {
        Host::Backend(3) => Acceptor::Nginx,
        _ => Acceptor::Haproxy,
    })
    .unwrap();
    (r, backends)
}

/// Runs `n` connections (each greeted by its backend, `payload` bytes echoed and verified) against `vip`.
fn load(r: &Rig, vip: IpAddr, n: usize, payload: usize) {
    load_with(r, vip, n, payload, &[]);
}

/// [`load`] with more loader flags.
fn load_with(r: &Rig, vip: IpAddr, n: usize, payload: usize, more: &[&str]) {
    let target = std::net::SocketAddr::new(vip, TCP_PORT).to_string();
    let (n_s, payload_s) = (n.to_string(), payload.to_string());
    let mut args = vec![
        "--tcp",
        &target,
        "--connections",
        &n_s,
        "--payload",
        &payload_s,
    ];
    args.extend_from_slice(more);
    let rep = r.load(&args).unwrap();
    let t = rep.tcp.as_ref().unwrap();
    assert_eq!((t.ok, t.failed), (n, 0), "{:?} {:#?}", t.errors, t.failures);
    if n >= 100 {
        // (Fewer may all land on two of the three by chance.)
        assert_eq!(t.per_backend.len(), 3, "{:?}", t.per_backend);
    }
}

/// Waits until the backends logged `n` connections (a line is written when its connection ends) and checks each
/// one's addresses: the client's, the VIP of its family and the service port; nginx's backend among them.
fn check_logged(r: &Rig, backends: &[ProxyBackend], n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut lines = ProxyBackend::logged_all(backends);
    while lines.len() < n && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        lines = ProxyBackend::logged_all(backends);
    }
    assert_eq!(lines.len(), n, "connections the backends logged");
    assert!(
        !backends[2].logged().is_empty(),
        "nginx (backend 3) logged no connection"
    );
    let client4 = IpAddr::from(r.topo.ip(Host::Client));
    let client6 = IpAddr::from(r.topo.ip6(Host::Client));
    let (vip4, vip6) = (IpAddr::from(r.vip), IpAddr::from(r.vip6.unwrap()));
    for p in &lines {
        let ok = (p.client == client4 && p.dst == vip4) || (p.client == client6 && p.dst == vip6);
        assert!(
            ok && p.dst_port == TCP_PORT && p.client_port >= 1024,
            "{p:?}"
        );
    }
    let v6 = lines.iter().filter(|p| p.client == client6).count();
    assert!(v6 > 0 && v6 < n, "both families: {v6} of {n} over IPv6");
}

#[test]
fn every_connection_reaches_haproxy_and_nginx_with_the_clients_address_ipv4_and_ipv6() {
    let (r, backends) = rig();
    load(&r, IpAddr::from(r.vip), 1000, 64);
    load(&r, IpAddr::from(r.vip6.unwrap()), 300, 64);
    // Bulk: 4 MiB each way on each of 20 connections, every byte verified.
    load(&r, IpAddr::from(r.vip), 20, 4 << 20);
    check_logged(&r, &backends, 1320);
    // The agent's snapshot of the data plane's counters moves once a second.
    let deadline = Instant::now() + Duration::from_secs(10);
    let headers = loop {
        let h = r
            .metric("lb_dataplane_packets_total", "reason=\"proxy_headers\"")
            .unwrap();
        if h >= 1320.0 || Instant::now() > deadline {
            break h;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(headers >= 1320.0, "headers put in: {headers}");
}

/// Reordering, then loss as well, on the way into the client and into every backend — this kernel has no netem,
/// so both are made with what it has. Reordering: on output, nftables sends 10 % of the TCP segments other than SYNs
/// into a slow HTB class (20 Mbit/s: a full segment waits ≥ 0.6 ms there) while the rest leave at once, so those
/// arrive after segments sent later (the receivers' out-of-order queues, with no loss yet, prove it). Loss:
/// nftables drops 5 % of the segments other than SYNs on input (a lost segment's later retransmission also arrives out of order).
/// A lost header segment is sent again (the backend's SYN-ACK retransmission brings the client's ACK again, or the
/// client's data comes at the stream's start), a repeated one is a duplicate the backend drops; the streams stay
/// exact. SYNs keep their way so that no connection waits out SYN retransmissions past the loader's timeouts, which
/// are long here for the same reason.
#[test]
fn reordering_and_loss_keep_every_stream_exact() {
    let (r, backends) = rig();
    let hosts = [
        Host::Client,
        Host::Backend(1),
        Host::Backend(2),
        Host::Backend(3),
    ];
    let run = |h: Host, argv: &[&str]| {
        String::from_utf8_lossy(&r.topo.exec(h, argv).unwrap().stdout).into_owned()
    };
    let dir = std::env::temp_dir();
    // Table `name`: `percent` % of the non-SYN TCP segments through hook `chain` get `action`, counted — only on
    // the way through the load balancer, not on a backend's loopback between its acceptor and its echo server
    // (with loss there, a backend's greeting was seen to wait for the client's FIN, 20 s after the header had been
    // acknowledged: a stall between the acceptor and the echo server, of the test's own making).
    let nft = |name: &str, chain: &str, percent: u32, action: &str| {
        let path = dir.join(format!("lbt-proxy-{name}-{}.nft", std::process::id()));
        let dev = if chain == "input" {
            "iifname"
        } else {
            "oifname"
        };
        std::fs::write(
            &path,
            format!(
                "table inet {name} {{\n  chain {chain} {{\n    type filter hook {chain} priority 0;\n    \
                 {dev} != \"lo\" tcp flags & syn == 0 numgen random mod 100 < {percent} counter {action}\n  }}\n}}\n"
            ),
        )
        .unwrap();
        path.display().to_string()
    };
    let reorder = nft("reorder", "output", 10, "meta priority set 1:20");
    let loss = nft("loss", "input", 5, "drop");
    // Packets of a table's rule: its counter.
    let matched = |h: Host, table: &str| -> u64 {
        let listed = run(h, &["nft", "list", "table", "inet", table]);
        listed
            .split("packets ")
            .nth(1)
            .and_then(|t| t.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let out_of_order = |h: Host| -> u64 {
        let nstat = run(h, &["nstat", "-az", "TcpExtTCPOFOQueue"]);
        nstat
            .lines()
            .filter_map(|l| l.strip_prefix("TcpExtTCPOFOQueue"))
            .filter_map(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    };
    for h in hosts {
        let dev = r.topo.ifname(h);
        run(h, &["nft", "-f", &reorder]);
        // Unclassified traffic (class 1:10) leaves at once; 1:20 is the slow lane.
        run(
            h,
            &[
                "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10",
            ],
        );
        for (class, rate) in [("1:10", "10gbit"), ("1:20", "20mbit")] {
            run(
                h,
                &[
                    "tc", "class", "add", "dev", dev, "parent", "1:", "classid", class, "htb",
                    "rate", rate,
                ],
            );
        }
    }
    // Long loader timeouts: a segment lost several times waits out several retransmission timeouts, and a
    // connection whose handshake lost a segment starts from Linux's 3 s fallback RTO (RFC 6298) — without SACK (off
    // on PROXY connections) a tail lost twice then waits 3 + 6 + 12 s. 20 s was seen to be too short for that.
    let slow = ["--timeout-ms", "60000", "--deadline-secs", "300"];
    load_with(&r, IpAddr::from(r.vip), 150, 8192, &slow);
    load_with(&r, IpAddr::from(r.vip6.unwrap()), 50, 8192, &slow);
    let reordered: u64 = hosts.iter().map(|h| out_of_order(*h)).sum();
    for h in hosts {
        assert!(matched(h, "reorder") > 0, "{h:?} delayed nothing");
        run(h, &["nft", "-f", &loss]);
    }
    load_with(&r, IpAddr::from(r.vip), 300, 8192, &slow);
    load_with(&r, IpAddr::from(r.vip6.unwrap()), 100, 8192, &slow);
    check_logged(&r, &backends, 600);
    for h in hosts {
        assert!(matched(h, "loss") > 0, "{h:?} dropped nothing");
    }
    println!("segments that arrived out of order with reordering alone: {reordered}");
    assert!(reordered > 0, "no segment arrived out of order");
}
