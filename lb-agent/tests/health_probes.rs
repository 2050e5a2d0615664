//! Health checks against real servers: HTTPS (CA, server name, client certificate) served with rustls, and the
//! UDP probe against a UDP echo and a closed port, and every probe against IPv6 listeners.

use lb_agent::dataplane::model::Protocol;
use lb_agent::health::{check_once, Bytes, HealthCheckSpec, HttpCheck, UdpCheck};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A CA that signs serving and client certificates.
struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    /// `name`: the CA's common name (a certificate's issuer is found by name).
    fn new(name: &str) -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(DnType::CommonName, name);
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        Ca {
            issuer: CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap(),
        }
    }

    /// A certificate (PEM) and its key (PEM) for `names` (DNS names or IP addresses).
    fn issue(&self, names: &[&str], usage: ExtendedKeyUsagePurpose) -> (String, String) {
        let mut p = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
        p.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// A fresh directory for PEM files.
fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lb-health-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write(dir: &Path, name: &str, pem: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, pem).unwrap();
    p
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn der_chain(pem: &str) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .map(Result::unwrap)
        .collect()
}

/// An HTTPS server answering 200 to anything, with `cert`; with `client_ca`, it requires a client certificate
/// from that CA. Returns its address and the SNI names it was sent.
async fn https_server(
    (cert, key): (String, String),
    client_ca: Option<&Ca>,
) -> (SocketAddr, Arc<Mutex<Vec<Option<String>>>>) {
    use rustls::pki_types::pem::PemObject;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(ca.issuer.der().clone()).unwrap();
            let v = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider(),
            )
            .build()
            .unwrap();
            builder.with_client_cert_verifier(v)
        }
    };
    let config = builder
        .with_single_cert(
            der_chain(&cert),
            rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sni = Arc::new(Mutex::new(Vec::new()));
    let seen = sni.clone();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let acceptor = acceptor.clone();
            let seen = seen.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                seen.lock()
                    .unwrap()
                    .push(tls.get_ref().1.server_name().map(str::to_string));
                let mut buf = [0u8; 2048];
                let _ = tls.read(&mut buf).await;
                let _ = tls
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
                let _ = tls.shutdown().await;
            });
        }
    });
    (addr, sni)
}

fn https(tweak: impl FnOnce(&mut HttpCheck)) -> HealthCheckSpec {
    let mut h = HttpCheck {
        https: true,
        ..HttpCheck::get("/healthz")
    };
    tweak(&mut h);
    let spec = HealthCheckSpec {
        timeout: Duration::from_secs(3),
        http: Some(h),
        ..Default::default()
    };
    spec.validate().unwrap();
    spec
}

async fn check(addr: SocketAddr, spec: &HealthCheckSpec) -> Result<(), String> {
    check_once((Protocol::Tcp, addr), spec)
        .await
        .map_err(|e| format!("{e:#}"))
}

#[tokio::test]
async fn https_verifies_the_chain_and_the_backend_address_when_a_ca_is_set() {
    let d = dir("chain");
    let ca = Ca::new("backend CA");
    let ca_file = write(&d, "ca.pem", &ca.issuer.pem());
    let other_ca = write(&d, "other.pem", &Ca::new("other CA").issuer.pem());
    let (addr, _) = https_server(
        ca.issue(&["127.0.0.1"], ExtendedKeyUsagePurpose::ServerAuth),
        None,
    )
    .await;

    check(addr, &https(|h| h.ca_file = Some(ca_file.clone())))
        .await
        .expect("valid chain naming the backend's IP");
    let e = check(addr, &https(|h| h.ca_file = Some(other_ca.clone())))
        .await
        .expect_err("a certificate from another CA must fail");
    assert!(e.contains("UnknownIssuer"), "reason reported: {e}");
    // Without a CA any certificate does (yawol's behaviour).
    let any = HttpCheck {
        https: true,
        ..HttpCheck::get("/healthz")
    };
    check(
        addr,
        &HealthCheckSpec {
            http: Some(any),
            ..Default::default()
        },
    )
    .await
    .expect("no CA: not verified");
}

#[tokio::test]
async fn https_verifies_the_server_name_and_sends_it_as_sni() {
    let d = dir("name");
    let ca = Ca::new("backend CA");
    let ca_file = write(&d, "ca.pem", &ca.issuer.pem());
    let (addr, sni) = https_server(
        ca.issue(&["api.example"], ExtendedKeyUsagePurpose::ServerAuth),
        None,
    )
    .await;

    let e = check(addr, &https(|h| h.ca_file = Some(ca_file.clone())))
        .await
        .expect_err("the certificate does not name the backend's IP");
    assert!(e.contains("not valid for name"), "reason reported: {e}");
    let e = check(
        addr,
        &https(|h| {
            h.ca_file = Some(ca_file.clone());
            h.server_name = Some("other.example".into());
        }),
    )
    .await
    .expect_err("wrong server name");
    assert!(e.contains("not valid for name"), "reason reported: {e}");
    sni.lock().unwrap().clear();
    check(
        addr,
        &https(|h| {
            h.ca_file = Some(ca_file.clone());
            h.server_name = Some("api.example".into());
        }),
    )
    .await
    .expect("the certificate names the server name");
    assert_eq!(*sni.lock().unwrap(), vec![Some("api.example".to_string())]);
    // Without a CA the name is still sent, but any certificate is accepted.
    check(
        addr,
        &https(|h| h.server_name = Some("other.example".into())),
    )
    .await
    .expect("no CA: not verified");
}

#[tokio::test]
async fn https_presents_the_client_certificate() {
    let d = dir("client");
    let ca = Ca::new("backend CA");
    let ca_file = write(&d, "ca.pem", &ca.issuer.pem());
    let (cert, key) = ca.issue(&["lb-agent"], ExtendedKeyUsagePurpose::ClientAuth);
    let cert_file = write(&d, "client.pem", &cert);
    let key_file = write(&d, "client.key", &key);
    let (addr, _) = https_server(
        ca.issue(&["127.0.0.1"], ExtendedKeyUsagePurpose::ServerAuth),
        Some(&ca),
    )
    .await;

    check(addr, &https(|h| h.ca_file = Some(ca_file.clone())))
        .await
        .expect_err("the server requires a client certificate");
    check(
        addr,
        &https(|h| {
            h.ca_file = Some(ca_file.clone());
            h.client_cert_file = Some(cert_file.clone());
            h.client_key_file = Some(key_file.clone());
        }),
    )
    .await
    .expect("with the client certificate");
}

#[test]
fn tls_settings_that_cannot_be_honoured_are_errors() {
    let d = dir("invalid");
    let ca = write(&d, "ca.pem", &Ca::new("CA").issuer.pem());
    let spec = |h: HttpCheck| HealthCheckSpec {
        http: Some(h),
        ..Default::default()
    };
    for (h, needle) in [
        (
            HttpCheck {
                ca_file: Some(ca.clone()),
                ..HttpCheck::get("/healthz")
            },
            "need https",
        ),
        (
            HttpCheck {
                https: true,
                client_cert_file: Some(ca.clone()),
                ..HttpCheck::get("/healthz")
            },
            "go together",
        ),
        (
            HttpCheck {
                https: true,
                ca_file: Some(d.join("missing.pem")),
                ..HttpCheck::get("/healthz")
            },
            "missing.pem",
        ),
        (
            HttpCheck {
                https: true,
                server_name: Some("10.0.0.1".into()),
                ..HttpCheck::get("/healthz")
            },
            "DNS name",
        ),
    ] {
        let e = format!("{:#}", spec(h).validate().unwrap_err());
        assert!(e.contains(needle), "{needle:?} not in {e}");
    }
}

fn udp(expect: Option<&str>) -> HealthCheckSpec {
    HealthCheckSpec {
        timeout: Duration::from_secs(2),
        udp: Some(UdpCheck {
            payload: Bytes::hex("70 69 6e 67"),
            expect: expect.map(Bytes::text),
        }),
        ..Default::default()
    }
}

#[tokio::test]
async fn udp_probe_wants_a_reply() {
    let echo = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = echo.local_addr().unwrap();
    let got = Arc::new(Mutex::new(Vec::new()));
    let seen = got.clone();
    tokio::spawn(async move {
        let mut buf = [0u8; 1500];
        loop {
            let (n, from) = echo.recv_from(&mut buf).await.unwrap();
            seen.lock().unwrap().push(buf[..n].to_vec());
            let mut reply = b"pong:".to_vec();
            reply.extend_from_slice(&buf[..n]);
            echo.send_to(&reply, from).await.unwrap();
        }
    });
    let t = (Protocol::Udp, addr);
    check_once(t, &udp(None)).await.expect("any reply");
    check_once(t, &udp(Some("pong:ping")))
        .await
        .expect("matching reply");
    assert_eq!(
        got.lock().unwrap()[0],
        b"ping",
        "the payload is sent as given"
    );
    let e = format!("{:#}", check_once(t, &udp(Some("ok"))).await.unwrap_err());
    assert!(e.contains("does not start with"), "{e}");

    // A closed port answers with ICMP port unreachable: down at once, not after the timeout.
    let closed = {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        s.local_addr().unwrap()
    };
    let start = Instant::now();
    let e = format!(
        "{:#}",
        check_once((Protocol::Udp, closed), &udp(None))
            .await
            .unwrap_err()
    );
    assert!(e.contains("port unreachable"), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );

    // A silent backend: down after the timeout.
    let silent = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let spec = HealthCheckSpec {
        timeout: Duration::from_millis(300),
        ..udp(None)
    };
    let e = format!(
        "{:#}",
        check_once((Protocol::Udp, silent.local_addr().unwrap()), &spec)
            .await
            .unwrap_err()
    );
    assert!(e.contains("no UDP reply"), "{e}");
}

/// IPv6 backends are checked like IPv4 ones: TCP connect, HTTP GET (the URL's authority in brackets) and the
/// UDP probe, against real listeners on `::1`.
#[tokio::test]
async fn ipv6_backends_are_checked_by_every_probe() {
    let tcp = tokio::net::TcpListener::bind("[::1]:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let host = Arc::new(Mutex::new(String::new()));
    let seen = host.clone();
    tokio::spawn(async move {
        loop {
            let (mut c, _) = tcp.accept().await.unwrap();
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 2048];
                let n = c.read(&mut buf).await.unwrap_or(0);
                let req = String::from_utf8_lossy(&buf[..n]).to_lowercase();
                if let Some(h) = req.lines().find(|l| l.starts_with("host:")) {
                    *seen.lock().unwrap() = h.trim().to_string();
                }
                let _ = c
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
            });
        }
    });
    check(addr, &HealthCheckSpec::default())
        .await
        .expect("TCP connect to [::1]");
    let http = HealthCheckSpec {
        timeout: Duration::from_secs(3),
        http: Some(HttpCheck::get("/healthz")),
        ..Default::default()
    };
    check(addr, &http).await.expect("HTTP GET to [::1]");
    assert_eq!(
        *host.lock().unwrap(),
        format!("host: [::1]:{}", addr.port())
    );

    let echo = tokio::net::UdpSocket::bind("[::1]:0").await.unwrap();
    let uaddr = echo.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = [0u8; 1500];
        loop {
            let (n, from) = echo.recv_from(&mut buf).await.unwrap();
            let mut reply = b"pong:".to_vec();
            reply.extend_from_slice(&buf[..n]);
            echo.send_to(&reply, from).await.unwrap();
        }
    });
    check_once((Protocol::Udp, uaddr), &udp(Some("pong:ping")))
        .await
        .expect("UDP probe to [::1]");

    // A closed IPv6 port is down (refused, not a timeout).
    let closed = {
        let l = std::net::TcpListener::bind("[::1]:0").unwrap();
        l.local_addr().unwrap()
    };
    let start = Instant::now();
    let e = check(closed, &HealthCheckSpec::default())
        .await
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(1), "{e}");
}
