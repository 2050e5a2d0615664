//! The real agent in Kubernetes mode with its real data plane: the rig's `lb-agent` (XDP on the lb namespace's
//! interface) takes its configuration from a LoadBalancer on a real API server (kube-testenv), with the identity
//! the controller gives a machine ([`KubeRig`]). What is written to the LoadBalancer must reach the maps (read
//! with `lbctl`) and the packets: a moved port, the TCP idle timeout, and TCP timeout 0 (never). And what the
//! agent writes back for the controller, started active-active with the controller's flags: `VIPEligible` and the
//! connections of its own.
//! `lb-agent/tests/kube_mode.rs` covers the API side with a stand-in for the data plane; this is the whole way.
//!
//! Needs root, `lb-agent` and `lbctl` built, the eBPF objects and `KUBEBUILDER_ASSETS`; `cargo xtask test`
//! provides all of them. Every wait is on an observed condition with a bound; the bounds are generous (a
//! 2-core machine running the API server, the agent and the test), and only turn a hang into a failure.

use lb_testbed::kube_rig::{service, KubeEnv, KubeRig};
use lb_testbed::load::LoadReport;
use lb_testbed::rig::{RigConfig, TCP_PORT, UDP_PORT};
use lb_testbed::Host;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

/// Bound of every wait.
const WITHIN: Duration = Duration::from_secs(30);
/// The idle timeout the tests set: short, so an expiry is seconds away.
const SHORT: &str = "2s";

fn kube_rig(options: Value) -> KubeRig {
    assert!(lb_testbed::is_root(), "these tests need root");
    let mut cfg = RigConfig::new().expect("artifacts built");
    cfg.topology.prefix = "lbk".into();
    KubeRig::start(KubeEnv::shared(), cfg, options)
        .expect("the rig with the agent in Kubernetes mode")
}

fn wait_until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WITHIN;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every connection and flow of `rep` went through, spread over more than one backend.
fn assert_all_through(rep: &LoadReport, tcp: usize, udp: usize) {
    if let Some(t) = &rep.tcp {
        assert_eq!(
            (t.ok, t.failed),
            (tcp, 0),
            "TCP {}: {:?}",
            t.target,
            t.errors
        );
        assert!(t.per_backend.len() > 1, "TCP spread: {:?}", t.per_backend);
    }
    if let Some(u) = &rep.udp {
        assert_eq!((u.ok, u.failed), (udp, 0), "UDP: {:?}", u.errors);
    }
}

/// What a connection attempt from the client to `target` ends in.
fn connect_outcome(k: &KubeRig, target: SocketAddr) -> Result<(), ErrorKind> {
    k.rig
        .topo
        .run_in(Host::Client, move || {
            TcpStream::connect_timeout(&target, Duration::from_secs(2))
        })
        .unwrap()
        .map(drop)
        .map_err(|e| e.kind())
}

/// A client connection through the load balancer, greeted by its backend.
struct Conn {
    stream: TcpStream,
    reader: BufReader<TcpStream>,
    local: SocketAddr,
}

impl Conn {
    fn open(k: &KubeRig, port: u16) -> Conn {
        let target = SocketAddr::from((k.rig.vip, port));
        let stream = k
            .rig
            .topo
            .run_in(Host::Client, move || {
                TcpStream::connect_timeout(&target, Duration::from_secs(5))
            })
            .unwrap()
            .unwrap_or_else(|e| panic!("connecting to {target}: {e}"));
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut greeting = String::new();
        reader.read_line(&mut greeting).unwrap();
        assert!(greeting.starts_with("backend-"), "greeting {greeting:?}");
        let mut c = Conn {
            local: stream.local_addr().unwrap(),
            stream,
            reader,
        };
        c.round_trip().expect("an echo through a new connection");
        c
    }

    /// Sends a line and reads it back.
    fn round_trip(&mut self) -> std::io::Result<()> {
        self.stream.write_all(b"ping\n")?;
        let mut back = [0u8; 5];
        self.reader.read_exact(&mut back)?;
        assert_eq!(&back, b"ping\n");
        Ok(())
    }
}

/// The connection of client `client` in the maps (`lbctl flows`), if listed.
fn flow(k: &KubeRig, client: SocketAddr) -> Option<Value> {
    let v = k
        .rig
        .lbctl_json(&["flows", "--client", &client.ip().to_string()])
        .unwrap();
    v["connections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["client"] == client.to_string())
        .cloned()
}

/// The data plane's global counter `name`.
fn counter(k: &KubeRig, name: &str) -> u64 {
    let v = k
        .rig
        .lbctl_json(&["counters", "--interval", "0.05"])
        .unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .and_then(|c| c["value"].as_u64())
        .unwrap_or_else(|| panic!("no counter {name}: {v}"))
}

fn idle_timeout(services: &[Value], protocol: &str, port: u16) -> Option<u64> {
    service(services, protocol, port).and_then(|s| s["idle_timeout_s"].as_u64())
}

/// A port moved in the LoadBalancer moves the packets: a new flow through the new port is forwarded (timed from
/// the write, the benchmark's measurement), the old port is no longer forwarded, and the maps say the same.
#[test]
fn a_port_moved_in_the_loadbalancer_moves_new_flows() {
    const NEW_PORT: u16 = 8080;
    let k = kube_rig(json!({}));
    let vip = k.rig.vip;
    let rep = k
        .rig
        .load(&[
            "--tcp",
            &format!("{vip}:{TCP_PORT}"),
            "--connections",
            "30",
            "--udp",
            &format!("{vip}:{UDP_PORT}"),
            "--udp-flows",
            "30",
        ])
        .unwrap();
    assert_all_through(&rep, 30, 30);

    // Fails unless the agent forwards the new port within the bound, and when it did before the write.
    let change = k.change_port(NEW_PORT, WITHIN).unwrap();
    eprintln!(
        "port {TCP_PORT} -> {NEW_PORT}: write answered in {:?}, first connection through {NEW_PORT} after {:?} \
         (to {}; {} attempts refused before)",
        change.write, change.first_packet, change.backend, change.refused
    );
    let services = k
        .wait_services("TCP on the new port only", |s| {
            service(s, "TCP", TCP_PORT).is_none() && service(s, "TCP", NEW_PORT).is_some()
        })
        .unwrap();
    assert!(
        service(&services, "UDP", UDP_PORT).is_some(),
        "the UDP port stays: {services:?}"
    );
    // Not forwarded, the SYN reaches the lb's own kernel, where nothing listens on the VIP.
    let old = SocketAddr::from((vip, TCP_PORT));
    wait_until("the old port refused", || {
        (connect_outcome(&k, old) == Err(ErrorKind::ConnectionRefused)).then_some(())
    });
    let rep = k
        .rig
        .load(&["--tcp", &format!("{vip}:{NEW_PORT}"), "--connections", "30"])
        .unwrap();
    assert_all_through(&rep, 30, 0);
}

/// The TCP idle timeout written to the LoadBalancer reaches the service in the maps and the flows opened under
/// it: an idle connection is expired (gone from the flow table; its next segment is not forwarded as that flow).
/// Timeout 0 then keeps an idle connection past the point where a UDP flow under the short timeout expired (the
/// proof that the collector ran meanwhile), and it still carries data. Each connection is opened after its
/// change: a connection keeps the timeout it was opened under (the data plane copies the service's into its flow
/// entries).
#[test]
fn the_tcp_idle_timeout_of_the_loadbalancer_expires_flows_and_zero_never_does() {
    let k = kube_rig(json!({}));
    let s = k.services().unwrap();
    assert_eq!(
        idle_timeout(&s, "TCP", TCP_PORT),
        Some(3600),
        "yawol's default first"
    );

    k.patch_spec(json!({"options": {"tcpIdleTimeout": SHORT}}))
        .unwrap();
    k.wait_services("TCP idle timeout 2 s in the maps", |s| {
        idle_timeout(s, "TCP", TCP_PORT) == Some(2)
    })
    .unwrap();
    // Counted by the collector when it deletes an idle connection: with the flow gone from the table, proof that
    // it was there and left by its timeout (no listing before it is needed, which a stall of 2 s could miss).
    let idle_expiries = || {
        k.rig
            .metric("lb_upstream_cx_idle_timeout_total", "protocol=\"TCP\"")
            .unwrap()
    };
    let expired_before = idle_expiries();
    let mut a = Conn::open(&k, TCP_PORT);
    wait_until("the idle connection expired from the flow table", || {
        (flow(&k, a.local).is_none() && idle_expiries() > expired_before).then_some(())
    });
    // Its next segment finds no flow: dropped and counted, never echoed.
    let dropped = counter(&k, "drop_no_flow");
    a.stream
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let echoed = a.round_trip();
    assert!(echoed.is_err(), "an expired connection still carried data");
    wait_until("the segment counted as drop_no_flow", || {
        (counter(&k, "drop_no_flow") > dropped).then_some(())
    });

    k.patch_spec(json!({"options": {"tcpIdleTimeout": "0s", "udpIdleTimeout": SHORT}}))
        .unwrap();
    k.wait_services("TCP idle timeout 0 and UDP 2 s in the maps", |s| {
        idle_timeout(s, "TCP", TCP_PORT) == Some(0) && idle_timeout(s, "UDP", UDP_PORT) == Some(2)
    })
    .unwrap();
    let mut b = Conn::open(&k, TCP_PORT);
    // Opened after the TCP connection's last segment: once this flow has expired, the collector has seen the TCP
    // connection idle for longer than the short timeout.
    let udp = udp_flow(&k);
    wait_until("the idle UDP flow expired", || {
        flow(&k, udp).is_none().then_some(())
    });
    let kept =
        flow(&k, b.local).expect("the TCP connection under timeout 0 is still in the flow table");
    assert_eq!(kept["state"], "established", "{kept}");
    assert!(
        kept["idle_s"].as_f64().unwrap() >= 2.0,
        "idle past the short timeout: {kept}"
    );
    b.round_trip()
        .expect("the connection under timeout 0 still carries data");
}

/// A UDP flow through the load balancer (one datagram answered); returns the client's address.
fn udp_flow(k: &KubeRig) -> SocketAddr {
    let target = SocketAddr::from((k.rig.vip, UDP_PORT));
    let port = k
        .rig
        .topo
        .run_in(Host::Client, move || -> std::io::Result<u16> {
            let s = UdpSocket::bind("0.0.0.0:0")?;
            s.set_read_timeout(Some(Duration::from_secs(1)))?;
            let mut buf = [0u8; 256];
            // A datagram can be lost; the flow exists once one is answered.
            for _ in 0..5 {
                s.send_to(b"ping", target)?;
                if s.recv(&mut buf).is_ok() {
                    return Ok(s.local_addr()?.port());
                }
            }
            Err(std::io::Error::new(ErrorKind::TimedOut, "no UDP answer"))
        })
        .unwrap()
        .unwrap();
    SocketAddr::from((k.rig.topo.ip(Host::Client), port))
}

#[test]
fn an_active_active_agent_reports_its_eligibility_and_its_own_connections() {
    let k = kube_rig(json!({"activeActive": true}));
    let condition = |status: &Value, type_: &str| -> Option<Value> {
        status["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == type_)
            .cloned()
    };
    // Eligible: attached, configured, synced (no peer to wait for).
    let eligible = wait_until("VIPEligible=True", || {
        condition(&k.machine_status().ok()?, "VIPEligible").filter(|c| c["status"] == "True")
    });
    assert_eq!(eligible["reason"], "Eligible", "{eligible}");
    // A held connection is translated to the machine's own address and counted as its own.
    let mut c = Conn::open(&k, TCP_PORT);
    let own = k.rig.topo.ip(Host::Lb).to_string();
    let f = wait_until("the connection in the maps", || flow(&k, c.local));
    assert_eq!(
        f["snat"].as_str().map(|s| s.split(':').next().unwrap_or(s)),
        Some(own.as_str()),
        "{f}"
    );
    let n = wait_until("ownConnectionsActive >= 1 in the machine's status", || {
        let status = k.machine_status().ok()?;
        let n: u64 = status["metrics"]
            .as_array()?
            .iter()
            .find(|m| m["type"] == "ownConnectionsActive")?["value"]
            .as_str()?
            .parse()
            .ok()?;
        (n >= 1).then_some(n)
    });
    println!("ownConnectionsActive = {n}");
    c.round_trip().expect("the connection still works");
}
