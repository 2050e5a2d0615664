//! The frontend-node shape (the keepalived + HAProxy pairs in front of API servers): the VIP on the public
//! interface, three API-server-like backends on the private one (a routed topology), each real nginx serving
//! HTTPS with `/healthz` on the TCP NodePort and a UDP answer on the UDP NodePort. The agent, in file mode, checks
//! `/healthz` over HTTPS against a CA and probes UDP. Needs root, nginx with its stream module, openssl and curl.

use lb_testbed::rig::{Rig, RigConfig, TCP_NODE_PORT, TCP_PORT, UDP_NODE_PORT, UDP_PORT};
use lb_testbed::{ChildGuard, Host};
use std::collections::BTreeMap;
use std::net::{Ipv4Addr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("running openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA (`<name>.pem`, `<name>.key`) in `dir`.
fn ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
        ],
    );
}

/// A server certificate for `ip` signed by CA `ca`: `<name>.pem`, `<name>.key`.
fn server_cert(dir: &Path, ca: &str, name: &str, ip: Ipv4Addr) {
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    std::fs::write(
        dir.join(format!("{name}.ext")),
        format!("subjectAltName=IP:{ip}\n"),
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
        ],
    );
}

/// nginx in backend `i`'s namespace: HTTPS on the TCP NodePort (`/healthz` answering `healthz_status`, `/`
/// naming the backend) with certificate `cert`, and the backend's name to any datagram on the UDP NodePort. One
/// process (no master and workers): killing it stops the server.
fn nginx(r: &Rig, dir: &Path, i: usize, cert: &str, healthz_status: u16) -> ChildGuard {
    let ip = r.topo.ip(Host::Backend(i));
    let d = dir.join(format!("nginx-{i}"));
    std::fs::create_dir_all(&d).unwrap();
    let conf = format!(
        "daemon off;\nmaster_process off;\npid {d}/nginx.pid;\nerror_log stderr;\n\
         load_module /usr/lib/nginx/modules/ngx_stream_module.so;\nevents {{ worker_connections 256; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d};\n  proxy_temp_path {d};\n  fastcgi_temp_path {d};\n\
           uwsgi_temp_path {d};\n  scgi_temp_path {d};\n\
           server {{\n    listen {ip}:{TCP_NODE_PORT} ssl;\n    ssl_certificate {dir}/{cert}.pem;\n\
             ssl_certificate_key {dir}/{cert}.key;\n    location = /healthz {{ return {healthz_status} \"ok\\n\"; }}\n\
             location / {{ return 200 \"backend-{i}\\n\"; }}\n  }}\n}}\n\
         stream {{\n  server {{ listen {ip}:{UDP_NODE_PORT} udp; return \"backend-{i}\\n\"; }}\n}}\n",
        d = d.display(),
        dir = dir.display(),
    );
    let path = d.join("nginx.conf");
    std::fs::write(&path, conf).unwrap();
    let mut c = r
        .topo
        .spawn(
            Host::Backend(i),
            [
                "/usr/sbin/nginx",
                "-c",
                &path.display().to_string(),
                "-e",
                "stderr",
            ],
        )
        .expect("nginx starts");
    // Listening once its pid file is written.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !d.join("nginx.pid").exists() {
        assert!(
            c.try_wait().unwrap().is_none(),
            "nginx {i} exited: {}",
            c.stderr()
        );
        assert!(
            Instant::now() < deadline,
            "nginx {i} did not start: {}",
            c.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    c
}

/// `lb_backend_healthy` of backend `i` for `proto` (`TCP` or `UDP`).
fn healthy(r: &Rig, i: usize, proto: &str) -> f64 {
    let ip = r.topo.ip(Host::Backend(i));
    let port = if proto == "TCP" {
        TCP_NODE_PORT
    } else {
        UDP_NODE_PORT
    };
    r.metric(
        "lb_backend_healthy",
        &format!("backend=\"{ip}:{port}\",protocol=\"{proto}\""),
    )
    .unwrap()
}

fn wait_for(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
    t.elapsed()
}

/// Which backend answered each of `n` HTTPS requests to the VIP (curl from the client; the certificates name the
/// backends, not the VIP, so the client does not verify: the agent's checks are what this test is about).
fn https_answers(r: &Rig, n: usize) -> BTreeMap<String, usize> {
    let url = format!("https://{}:{TCP_PORT}/", r.vip);
    let mut seen = BTreeMap::new();
    for _ in 0..n {
        let out = r
            .topo
            .exec(Host::Client, ["curl", "-sk", "--max-time", "3", &url])
            .expect("curl through the VIP");
        *seen
            .entry(String::from_utf8_lossy(&out.stdout).trim().to_string())
            .or_insert(0) += 1;
    }
    seen
}

/// Which backend answered each of `n` UDP flows (one datagram from a new source port each).
fn udp_answers(r: &Rig, n: usize) -> BTreeMap<String, usize> {
    let to = (r.vip, UDP_PORT);
    r.topo
        .run_in(Host::Client, move || -> std::io::Result<_> {
            let mut seen = BTreeMap::new();
            for _ in 0..n {
                let s = UdpSocket::bind("0.0.0.0:0")?;
                s.set_read_timeout(Some(Duration::from_secs(2)))?;
                s.send_to(b"ping", to)?;
                let mut buf = [0u8; 64];
                let answer = match s.recv(&mut buf) {
                    Ok(len) => String::from_utf8_lossy(&buf[..len]).trim().to_string(),
                    Err(e) => format!("no answer: {e}"),
                };
                *seen.entry(answer).or_insert(0) += 1;
            }
            Ok(seen)
        })
        .unwrap()
        .unwrap()
}

#[test]
fn api_server_frontend_checks_healthz_over_https_against_its_ca_and_probes_udp() {
    assert!(lb_testbed::is_root(), "end-to-end tests need root");
    let mut cfg = RigConfig::new().expect("artifacts built");
    cfg.attach_mode = "xdp-native".into();
    cfg.topology.routed = true;
    let mut r = Rig::start(cfg).expect("rig starts");
    let dir: PathBuf = std::env::temp_dir().join(format!("{}-frontend", r.topo.id()));
    std::fs::create_dir_all(&dir).unwrap();
    ca(&dir, "ca");
    ca(&dir, "other-ca");
    for i in 1..=3 {
        let issuer = if i == 3 { "other-ca" } else { "ca" };
        server_cert(
            &dir,
            issuer,
            &format!("backend-{i}"),
            r.topo.ip(Host::Backend(i)),
        );
    }
    // The rig's echo servers make way for the API servers: backend 1 healthy, backend 2 failing its /healthz,
    // backend 3 with a certificate from another CA.
    let mut servers = BTreeMap::new();
    for (i, status) in [(1, 200), (2, 500), (3, 200)] {
        r.stop_backend(i).unwrap();
        servers.insert(i, nginx(&r, &dir, i, &format!("backend-{i}"), status));
    }
    let yaml = r.config_yaml(&[1, 2, 3], "").replace(
        "healthCheck: {interval: 1s, timeout: 1s, unhealthyThreshold: 2, healthyThreshold: 1}\n",
        &format!(
            "healthCheck:\n  interval: 1s\n  timeout: 1s\n  unhealthyThreshold: 2\n  healthyThreshold: 1\n\
             \x20 http: {{path: /healthz, https: true, caFile: {}}}\n\
             \x20 udp: {{payload: {{text: ping}}, expect: {{text: backend}}}}\n",
            dir.join("ca.pem").display()
        ),
    );
    assert!(yaml.contains("caFile"), "{yaml}");
    r.update_config(&yaml).unwrap();

    wait_for(
        "backend 1 alone healthy for TCP, all three for UDP",
        Duration::from_secs(20),
        || {
            healthy(&r, 1, "TCP") == 1.0
                && healthy(&r, 2, "TCP") == 0.0
                && healthy(&r, 3, "TCP") == 0.0
                && (1..=3).all(|i| healthy(&r, i, "UDP") == 1.0)
        },
    );
    let log = r.agent_log();
    assert!(
        log.contains("UnknownIssuer") || log.contains("unknown issuer"),
        "the agent names why backend 3 fails: {log}"
    );
    let tcp = https_answers(&r, 30);
    assert_eq!(
        tcp,
        BTreeMap::from([("backend-1".to_string(), 30)]),
        "only the backend with a healthy /healthz and a certificate from the CA"
    );
    let udp = udp_answers(&r, 60);
    assert_eq!(udp.values().sum::<usize>(), 60);
    assert!(
        (1..=3).all(|i| udp.contains_key(&format!("backend-{i}"))),
        "UDP to all three: {udp:?}"
    );

    // Backend 2's server stops: its UDP probe meets a port unreachable and it leaves UDP selection within the
    // probe's thresholds (2 checks 1 s apart); new flows go to the others.
    servers.remove(&2);
    let gone = wait_for(
        "backend 2 out of UDP selection",
        Duration::from_secs(10),
        || healthy(&r, 2, "UDP") == 0.0,
    );
    eprintln!("backend 2 left UDP selection {gone:?} after its server stopped");
    let udp = udp_answers(&r, 60);
    assert_eq!(udp.get("backend-2"), None, "{udp:?}");
    assert_eq!(
        udp.iter()
            .filter(|(k, _)| k.starts_with("backend-"))
            .map(|(_, v)| v)
            .sum::<usize>(),
        60,
        "every flow answered by backend 1 or 3: {udp:?}"
    );
    drop(servers);
    let _ = std::fs::remove_dir_all(&dir);
}
