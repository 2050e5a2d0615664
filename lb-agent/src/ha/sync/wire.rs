//! The sync protocol on the wire: handshake messages, authenticated frames and the record encoding.
//!
//! Everything is encoded field by field. Integers are little-endian, except addresses and ports, which
//! travel as the bytes the data plane stores (network byte order), so no replica ever converts them.
//!
//! ```text
//! handshake (initiator I = the side that pushes its records, responder R = the side that applies them)
//!   prefix     magic "LBSY" | version u8 | message type u8 | reserved [2] = 0          (8 bytes)
//!   I → R  Hello      prefix | node id u64 | nonce_i [32]                               (48 bytes)
//!   R → I  Challenge  prefix | node id u64 | nonce_r [32] | proof_r [32]                (80 bytes)
//!   I → R  Auth       prefix | proof_i [32]                                             (40 bytes)
//!   R → I  Reject     prefix only, carrying R's version, when it cannot speak I's      (8 bytes)
//!   transcript = Hello || Challenge without its proof;  proof_x = HMAC-SHA256(psk, label_x || transcript);
//!   one session key per direction: HMAC-SHA256(psk, label_dir || transcript)
//! frame (both directions after the handshake)
//!   version u8 | kind u8 | reserved u16 = 0 | payload length u32 | sequence u64         (16 bytes)
//!   payload | HMAC-SHA256(direction key, header || payload)                            (32 bytes)
//!   sequence numbers start at 0 in each direction and grow by one per frame
//! payloads: Records = count u32 | count × (family u8 = 4 | IPv4 record, 110 bytes
//!                                         or family u8 = 6 | IPv6 record, 182 bytes);
//!           DumpDone = records in the dump u64; Ack = sequence of the last applied Records frame u64;
//!           Heartbeat = empty
//! record:   kind u8 | key: src, dst, sport, dport, proto | forward entry | reverse entry | age_ms u32
//! entry:    new_src, new_dst, new_sport, new_dport, mac [6], flags u8, egress u8, svc_id, backend_id, timeout_s,
//!           csum_addr, csum_port (u32 LE each), proxy_seq (network order), proxy_len u16 LE; addresses are 4 (IPv4)
//!           or 16 (IPv6) bytes
//! ```

use super::{FlowRecord, SyncEvent};
use hmac::{Hmac, Mac};
use lb_common::{
    Flow, FlowAddr, FlowEvent, FlowKey, In6, FAMILY_V4, FAMILY_V6, FLOW_EV_CLOSE, FLOW_EV_NEW,
    FLOW_EV_REFRESH,
};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

type HmacSha256 = Hmac<Sha256>;

/// Protocol version spoken by this build; a peer with another one is rejected during the handshake. Version 2
/// added IPv6 records (each record names its family); version 3 the entries' egress interface slot (replicas
/// configured with the same interfaces in the same order share the slots); version 4 the PROXY v2 fields (where
/// the header goes and its length: a peer taking over a PROXY connection keeps translating it).
pub const VERSION: u8 = 4;
/// First bytes of every handshake message.
pub const MAGIC: [u8; 4] = *b"LBSY";
/// Length of an HMAC-SHA256 tag.
pub const MAC_LEN: usize = 32;
/// Length of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Length of the prefix shared by all handshake messages.
pub const PREFIX_LEN: usize = 8;
/// Length of the Hello message (initiator → responder).
pub const HELLO_LEN: usize = PREFIX_LEN + 8 + NONCE_LEN;
/// Length of the Challenge message (responder → initiator).
pub const CHALLENGE_LEN: usize = PREFIX_LEN + 8 + NONCE_LEN + MAC_LEN;
/// Length of the Auth message (initiator → responder).
pub const AUTH_LEN: usize = PREFIX_LEN + MAC_LEN;
/// Length of a frame header.
pub const FRAME_HEADER_LEN: usize = 16;
/// Largest frame payload accepted (and produced): bounds memory per connection and the lag of one batch.
pub const MAX_PAYLOAD: usize = 64 * 1024;
/// Length of one encoded IPv4 record, its family byte included.
pub const RECORD_LEN_V4: usize = 1 + record_len(4);
/// Length of one encoded IPv6 record, its family byte included.
pub const RECORD_LEN_V6: usize = 1 + record_len(16);
/// Records that fit one frame, whatever their families.
pub const RECORDS_PER_FRAME: usize = (MAX_PAYLOAD - 4) / RECORD_LEN_V6;

/// Encoded length of a record without its family byte, for addresses of `addr` bytes: kind, key, two entries
/// (their `last_seen_ns` and padding are not sent), age.
const fn record_len(addr: usize) -> usize {
    let key = 2 * addr + 5;
    let flow = 2 * addr + 4 + 6 + 1 + 1 + 20 + 4 + 2;
    1 + key + 2 * flow + 4
}
const _: () = assert!(RECORD_LEN_V4 == 1 + 110 && RECORD_LEN_V6 == 1 + 182);

const MSG_HELLO: u8 = 1;
const MSG_CHALLENGE: u8 = 2;
const MSG_AUTH: u8 = 3;
const MSG_REJECT: u8 = 4;

// Distinct fixed labels in front of a fixed-length transcript, so no output can stand in for another.
const LABEL_PROOF_R: &[u8] = b"lb-sync v1 responder proof";
const LABEL_PROOF_I: &[u8] = b"lb-sync v1 initiator proof";
const LABEL_KEY_IR: &[u8] = b"lb-sync v1 key initiator to responder";
const LABEL_KEY_RI: &[u8] = b"lb-sync v1 key responder to initiator";

/// Why a message or connection was refused. Every error ends its connection.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Socket error.
    #[error("{0}")]
    Io(std::io::Error),
    /// The peer closed the connection.
    #[error("connection closed by the peer")]
    Closed,
    /// Nothing arrived for three heartbeat intervals (or the handshake took as long).
    #[error("peer silent for too long")]
    Timeout,
    /// The handshake failed: the peers do not share the secret (or someone without it tried).
    #[error("authentication failed: {0}")]
    Auth(&'static str),
    /// A frame failed its HMAC or came out of sequence: forged, tampered with, replayed or reordered.
    #[error("frame rejected: {0}")]
    Rejected(&'static str),
    /// The peer speaks another protocol version.
    #[error("unsupported sync protocol version {0} (this node speaks version {v})", v = VERSION)]
    Version(u8),
    /// A well-authenticated message that does not decode (or a handshake message that is not one).
    #[error("malformed message: {0}")]
    Decode(String),
    /// The connection loops back to this very node (its own address is in the peer list).
    #[error("connected to itself")]
    SelfConnection,
}

impl From<std::io::Error> for WireError {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            WireError::Closed
        } else {
            WireError::Io(e)
        }
    }
}

/// Frame kinds. Initiator → responder: `Records`, `DumpDone`, `Heartbeat`; responder → initiator: `Ack`,
/// `Heartbeat`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// A batch of records, applied in order.
    Records = 1,
    /// The full dump that opens every connection is complete; live records follow.
    DumpDone = 2,
    /// Keeps an idle connection alive.
    Heartbeat = 3,
    /// The receiver applied every Records frame up to this sequence number (measures the apply lag).
    Ack = 4,
}

impl FrameKind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => FrameKind::Records,
            2 => FrameKind::DumpDone,
            3 => FrameKind::Heartbeat,
            4 => FrameKind::Ack,
            _ => return None,
        })
    }
}

fn keyed(key: &[u8]) -> HmacSha256 {
    // HMAC accepts keys of any length; this cannot fail.
    HmacSha256::new_from_slice(key).expect("HMAC takes any key length")
}

fn prf(psk: &[u8], label: &[u8], transcript: &[u8]) -> [u8; 32] {
    let mut m = keyed(psk);
    m.update(label);
    m.update(transcript);
    m.finalize().into_bytes().into()
}

/// Adds sequence numbers and HMACs to outgoing frames of one direction of one connection.
pub struct Sealer {
    mac: HmacSha256,
    seq: u64,
}

impl Sealer {
    /// A sealer with the direction's session key, starting at sequence 0.
    pub fn new(key: &[u8]) -> Self {
        Sealer {
            mac: keyed(key),
            seq: 0,
        }
    }

    /// The sequence number the next frame will carry.
    pub fn next_seq(&self) -> u64 {
        self.seq
    }

    /// Appends one sealed frame to `out`. `payload` must not exceed [`MAX_PAYLOAD`].
    pub fn seal(&mut self, kind: FrameKind, payload: &[u8], out: &mut Vec<u8>) {
        assert!(payload.len() <= MAX_PAYLOAD, "frame payload too large");
        let start = out.len();
        out.push(VERSION);
        out.push(kind as u8);
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(payload);
        let mut m = self.mac.clone();
        m.update(&out[start..]);
        out.extend_from_slice(&m.finalize().into_bytes());
        self.seq += 1;
    }
}

/// Checks incoming frames of one direction of one connection: HMAC first, then the sequence number, then
/// the contents.
pub struct Opener {
    mac: HmacSha256,
    seq: u64,
}

impl Opener {
    /// An opener with the direction's session key, expecting sequence 0 first.
    pub fn new(key: &[u8]) -> Self {
        Opener {
            mac: keyed(key),
            seq: 0,
        }
    }

    /// How many bytes follow `header` (payload and MAC). Refuses oversized frames before reading them.
    pub fn body_len(header: &[u8; FRAME_HEADER_LEN]) -> Result<usize, WireError> {
        let len = u32::from_le_bytes(header[4..8].try_into().unwrap()) as usize;
        if len > MAX_PAYLOAD {
            return Err(WireError::Decode(format!(
                "frame payload of {len} bytes exceeds {MAX_PAYLOAD}"
            )));
        }
        Ok(len + MAC_LEN)
    }

    /// Verifies one frame (`body` = payload and MAC, of [`Opener::body_len`] bytes) and returns its kind,
    /// sequence number and payload.
    pub fn open<'a>(
        &mut self,
        header: &[u8; FRAME_HEADER_LEN],
        body: &'a [u8],
    ) -> Result<(FrameKind, u64, &'a [u8]), WireError> {
        let len = Self::body_len(header)?;
        if body.len() != len {
            return Err(WireError::Decode("frame body length mismatch".into()));
        }
        let (payload, tag) = body.split_at(len - MAC_LEN);
        let mut m = self.mac.clone();
        m.update(header);
        m.update(payload);
        m.verify_slice(tag)
            .map_err(|_| WireError::Rejected("bad HMAC"))?;
        let seq = u64::from_le_bytes(header[8..16].try_into().unwrap());
        if seq != self.seq {
            return Err(WireError::Rejected(
                "sequence number out of order (replayed, reordered or dropped frame)",
            ));
        }
        self.seq += 1;
        if header[0] != VERSION {
            return Err(WireError::Version(header[0]));
        }
        if header[2..4] != [0, 0] {
            return Err(WireError::Decode("reserved header bits set".into()));
        }
        let kind = FrameKind::from_u8(header[1])
            .ok_or_else(|| WireError::Decode(format!("unknown frame kind {}", header[1])))?;
        Ok((kind, seq, payload))
    }
}

/// Reads and verifies one frame into `buf`; returns its kind, sequence number and payload (inside `buf`).
pub async fn read_frame<'a, R: AsyncRead + Unpin>(
    r: &mut R,
    opener: &mut Opener,
    buf: &'a mut Vec<u8>,
) -> Result<(FrameKind, u64, &'a [u8]), WireError> {
    let mut header = [0u8; FRAME_HEADER_LEN];
    r.read_exact(&mut header).await?;
    let len = Opener::body_len(&header)?;
    buf.resize(len, 0);
    r.read_exact(buf).await?;
    opener.open(&header, buf)
}

/// A `u64` payload (DumpDone, Ack).
pub fn decode_u64(payload: &[u8]) -> Result<u64, WireError> {
    let b: [u8; 8] = payload
        .try_into()
        .map_err(|_| WireError::Decode(format!("{}-byte payload, want 8", payload.len())))?;
    Ok(u64::from_le_bytes(b))
}

/// An address as the sync sends it: its on-wire bytes.
trait WireAddr: FlowAddr {
    fn put(&self, out: &mut Vec<u8>);
    fn take(r: &mut Rd) -> Self;
}

impl WireAddr for u32 {
    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_ne_bytes());
    }
    fn take(r: &mut Rd) -> Self {
        r.ne32()
    }
}

impl WireAddr for In6 {
    fn put(&self, out: &mut Vec<u8>) {
        for w in self {
            out.extend_from_slice(&w.to_ne_bytes());
        }
    }
    fn take(r: &mut Rd) -> Self {
        [r.ne32(), r.ne32(), r.ne32(), r.ne32()]
    }
}

fn put_flow<A: WireAddr>(f: &Flow<A>, out: &mut Vec<u8>) {
    f.new_src.put(out);
    f.new_dst.put(out);
    out.extend_from_slice(&f.new_sport.to_ne_bytes());
    out.extend_from_slice(&f.new_dport.to_ne_bytes());
    out.extend_from_slice(&f.mac);
    out.push(f.flags);
    out.push(f.egress);
    out.extend_from_slice(&f.svc_id.to_le_bytes());
    out.extend_from_slice(&f.backend_id.to_le_bytes());
    out.extend_from_slice(&f.timeout_s.to_le_bytes());
    out.extend_from_slice(&f.csum_addr.to_le_bytes());
    out.extend_from_slice(&f.csum_port.to_le_bytes());
    out.extend_from_slice(&f.proxy_seq_be.to_ne_bytes());
    out.extend_from_slice(&f.proxy_len.to_le_bytes());
}

/// A cursor over a record; lengths are checked once by the caller.
struct Rd<'a>(&'a [u8]);

impl Rd<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let (h, t) = self.0.split_at(N);
        self.0 = t;
        h.try_into().unwrap()
    }
    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    fn ne16(&mut self) -> u16 {
        u16::from_ne_bytes(self.take())
    }
    fn ne32(&mut self) -> u32 {
        u32::from_ne_bytes(self.take())
    }
    fn le16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }
    fn le32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    fn flow<A: WireAddr>(&mut self) -> Flow<A> {
        Flow {
            new_src: A::take(self),
            new_dst: A::take(self),
            new_sport: self.ne16(),
            new_dport: self.ne16(),
            mac: self.take(),
            flags: self.u8(),
            egress: self.u8(),
            svc_id: self.le32(),
            backend_id: self.le32(),
            timeout_s: self.le32(),
            csum_addr: self.le32(),
            csum_port: self.le32(),
            proxy_seq_be: self.ne32(),
            proxy_len: self.le16(),
            _pad: 0,
            // A monotonic timestamp means nothing on another machine; the age travels instead.
            last_seen_ns: 0,
        }
    }
}

fn put_event<A: WireAddr>(ev: &FlowEvent<A>, age_ms: u32, out: &mut Vec<u8>) {
    out.push(A::FAMILY);
    out.push(ev.kind);
    ev.key.src.put(out);
    ev.key.dst.put(out);
    out.extend_from_slice(&ev.key.sport.to_ne_bytes());
    out.extend_from_slice(&ev.key.dport.to_ne_bytes());
    out.push(ev.key.proto);
    put_flow(&ev.fwd, out);
    put_flow(&ev.rev, out);
    out.extend_from_slice(&age_ms.to_le_bytes());
}

/// Decodes a record's body (after its family byte); unknown event kinds are refused.
fn take_event<A: WireAddr>(r: &mut Rd) -> Result<(FlowEvent<A>, u32), WireError> {
    let kind = r.u8();
    if !matches!(kind, FLOW_EV_NEW | FLOW_EV_CLOSE | FLOW_EV_REFRESH) {
        return Err(WireError::Decode(format!("unknown flow event kind {kind}")));
    }
    let key = FlowKey {
        src: A::take(r),
        dst: A::take(r),
        sport: r.ne16(),
        dport: r.ne16(),
        proto: r.u8(),
        _pad: [0; 3],
    };
    let fwd = r.flow();
    let rev = r.flow();
    let age_ms = r.le32();
    Ok((
        FlowEvent {
            kind,
            _pad: [0; 7],
            key,
            fwd,
            rev,
        },
        age_ms,
    ))
}

/// Appends one record ([`RECORD_LEN_V4`] or [`RECORD_LEN_V6`] bytes). `last_seen_ns` and padding are not sent:
/// the receiver gets `age_ms` (the replicas' clocks differ) and zeroed padding.
pub fn encode_record(rec: &FlowRecord, out: &mut Vec<u8>) {
    match &rec.event {
        SyncEvent::V4(e) => put_event(e, rec.age_ms, out),
        SyncEvent::V6(e) => put_event(e, rec.age_ms, out),
    }
}

/// Decodes the record at the start of `b`; returns it and the bytes it took.
pub fn decode_record(b: &[u8]) -> Result<(FlowRecord, usize), WireError> {
    let (family, len) = match b.first() {
        Some(&FAMILY_V4) => (FAMILY_V4, RECORD_LEN_V4),
        Some(&FAMILY_V6) => (FAMILY_V6, RECORD_LEN_V6),
        Some(f) => return Err(WireError::Decode(format!("record of unknown family {f}"))),
        None => return Err(WireError::Decode("empty record".into())),
    };
    if b.len() < len {
        return Err(WireError::Decode(format!(
            "{}-byte record, want {len}",
            b.len()
        )));
    }
    let mut r = Rd(&b[1..len]);
    let (event, age_ms) = if family == FAMILY_V4 {
        let (e, age) = take_event::<u32>(&mut r)?;
        (SyncEvent::V4(e), age)
    } else {
        let (e, age) = take_event::<In6>(&mut r)?;
        (SyncEvent::V6(e), age)
    };
    Ok((FlowRecord { event, age_ms }, len))
}

/// Encodes a Records payload (at most [`RECORDS_PER_FRAME`] records).
pub fn encode_records(recs: impl ExactSizeIterator<Item = FlowRecord>, out: &mut Vec<u8>) {
    assert!(
        recs.len() <= RECORDS_PER_FRAME,
        "too many records for one frame"
    );
    out.extend_from_slice(&(recs.len() as u32).to_le_bytes());
    for r in recs {
        encode_record(&r, out);
    }
}

/// Decodes a Records payload.
pub fn decode_records(payload: &[u8]) -> Result<Vec<FlowRecord>, WireError> {
    if payload.len() < 4 {
        return Err(WireError::Decode("records payload without count".into()));
    }
    let n = u32::from_le_bytes(payload[..4].try_into().unwrap()) as usize;
    if n > RECORDS_PER_FRAME.max(MAX_PAYLOAD / RECORD_LEN_V4) {
        return Err(WireError::Decode(format!("{n} records in one frame")));
    }
    let mut body = &payload[4..];
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let (rec, len) = decode_record(body)?;
        out.push(rec);
        body = &body[len..];
    }
    if !body.is_empty() {
        return Err(WireError::Decode(format!(
            "{} bytes after {n} records",
            body.len()
        )));
    }
    Ok(out)
}

/// The outcome of a handshake: the peer's node id and the two directions' frame keys.
pub struct Established {
    /// Random id the peer drew at start (changes when it restarts).
    pub peer_node: u64,
    /// Seals this side's frames.
    pub sealer: Sealer,
    /// Opens the peer's frames.
    pub opener: Opener,
}

fn prefix(msg: u8) -> [u8; PREFIX_LEN] {
    [MAGIC[0], MAGIC[1], MAGIC[2], MAGIC[3], VERSION, msg, 0, 0]
}

fn nonce() -> Result<[u8; NONCE_LEN], WireError> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n)
        .map_err(|e| WireError::Io(std::io::Error::other(format!("getrandom: {e}"))))?;
    Ok(n)
}

/// Reads a handshake message of type `want` (`len` bytes in all) into `out`, checking magic and version.
async fn read_msg<S: AsyncRead + Unpin>(
    s: &mut S,
    want: u8,
    out: &mut [u8],
) -> Result<(), WireError> {
    s.read_exact(&mut out[..PREFIX_LEN]).await?;
    if out[..4] != MAGIC {
        return Err(WireError::Decode("not a sync peer (bad magic)".into()));
    }
    if out[4] != VERSION {
        return Err(WireError::Version(out[4]));
    }
    if out[5] == MSG_REJECT {
        return Err(WireError::Decode("peer rejected the handshake".into()));
    }
    if out[5] != want || out[6..8] != [0, 0] {
        return Err(WireError::Decode(format!(
            "unexpected handshake message type {}",
            out[5]
        )));
    }
    s.read_exact(&mut out[PREFIX_LEN..]).await?;
    Ok(())
}

/// Runs the handshake as the connecting side (the one that will push its records).
pub async fn initiate<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    psk: &[u8],
    node_id: u64,
) -> Result<Established, WireError> {
    let mut hello = [0u8; HELLO_LEN];
    hello[..PREFIX_LEN].copy_from_slice(&prefix(MSG_HELLO));
    hello[8..16].copy_from_slice(&node_id.to_le_bytes());
    hello[16..].copy_from_slice(&nonce()?);
    s.write_all(&hello).await?;

    let mut ch = [0u8; CHALLENGE_LEN];
    read_msg(s, MSG_CHALLENGE, &mut ch).await?;
    let peer_node = u64::from_le_bytes(ch[8..16].try_into().unwrap());
    if peer_node == node_id {
        return Err(WireError::SelfConnection);
    }
    let split = CHALLENGE_LEN - MAC_LEN;
    let mut transcript = [0u8; HELLO_LEN + CHALLENGE_LEN - MAC_LEN];
    transcript[..HELLO_LEN].copy_from_slice(&hello);
    transcript[HELLO_LEN..].copy_from_slice(&ch[..split]);
    let mut m = keyed(psk);
    m.update(LABEL_PROOF_R);
    m.update(&transcript);
    m.verify_slice(&ch[split..])
        .map_err(|_| WireError::Auth("the peer's proof does not match our secret"))?;

    let mut auth = [0u8; AUTH_LEN];
    auth[..PREFIX_LEN].copy_from_slice(&prefix(MSG_AUTH));
    auth[PREFIX_LEN..].copy_from_slice(&prf(psk, LABEL_PROOF_I, &transcript));
    s.write_all(&auth).await?;
    Ok(Established {
        peer_node,
        sealer: Sealer::new(&prf(psk, LABEL_KEY_IR, &transcript)),
        opener: Opener::new(&prf(psk, LABEL_KEY_RI, &transcript)),
    })
}

/// Runs the handshake as the accepting side (the one that will apply the peer's records).
pub async fn respond<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    psk: &[u8],
    node_id: u64,
) -> Result<Established, WireError> {
    let mut hello = [0u8; HELLO_LEN];
    match read_msg(s, MSG_HELLO, &mut hello).await {
        Err(WireError::Version(v)) => {
            // Tell the initiator which version we speak, so both sides log the mismatch clearly. Then drain
            // the rest of its Hello briefly: closing with unread input would reset the connection and could
            // destroy the reply before it is read.
            let _ = s.write_all(&prefix(MSG_REJECT)).await;
            let _ = s.shutdown().await;
            let drain = async {
                let mut sink = [0u8; 512];
                while let Ok(1..) = s.read(&mut sink).await {}
            };
            let _ = tokio::time::timeout(std::time::Duration::from_millis(500), drain).await;
            return Err(WireError::Version(v));
        }
        r => r?,
    }
    let peer_node = u64::from_le_bytes(hello[8..16].try_into().unwrap());

    let mut ch = [0u8; CHALLENGE_LEN];
    ch[..PREFIX_LEN].copy_from_slice(&prefix(MSG_CHALLENGE));
    ch[8..16].copy_from_slice(&node_id.to_le_bytes());
    ch[16..48].copy_from_slice(&nonce()?);
    let split = CHALLENGE_LEN - MAC_LEN;
    let mut transcript = [0u8; HELLO_LEN + CHALLENGE_LEN - MAC_LEN];
    transcript[..HELLO_LEN].copy_from_slice(&hello);
    transcript[HELLO_LEN..].copy_from_slice(&ch[..split]);
    ch[split..].copy_from_slice(&prf(psk, LABEL_PROOF_R, &transcript));
    s.write_all(&ch).await?;
    // Answered even to ourselves: the initiator learns from our node id that it dialled itself.
    if peer_node == node_id {
        return Err(WireError::SelfConnection);
    }

    let mut auth = [0u8; AUTH_LEN];
    match read_msg(s, MSG_AUTH, &mut auth).await {
        // An initiator closes here when our proof did not check out: the secrets differ.
        Err(WireError::Closed) => {
            return Err(WireError::Auth(
                "the peer left before proving the secret (secrets differ?)",
            ))
        }
        r => r?,
    }
    let mut m = keyed(psk);
    m.update(LABEL_PROOF_I);
    m.update(&transcript);
    m.verify_slice(&auth[PREFIX_LEN..])
        .map_err(|_| WireError::Auth("the peer's proof does not match our secret"))?;
    Ok(Established {
        peer_node,
        sealer: Sealer::new(&prf(psk, LABEL_KEY_RI, &transcript)),
        opener: Opener::new(&prf(psk, LABEL_KEY_IR, &transcript)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{FlowEventV4, FlowKeyV4, FlowV4, FLOW_F_FIN, FLOW_F_FORWARD, PROTO_TCP};

    fn sample_v4() -> FlowEventV4 {
        FlowEventV4 {
            kind: FLOW_EV_NEW,
            _pad: [0; 7],
            key: FlowKeyV4 {
                src: u32::from_ne_bytes([10, 0, 0, 1]),
                dst: u32::from_ne_bytes([10, 200, 0, 100]),
                sport: 40000u16.to_be(),
                dport: 80u16.to_be(),
                proto: PROTO_TCP,
                _pad: [0; 3],
            },
            fwd: FlowV4 {
                new_src: u32::from_ne_bytes([10, 200, 0, 100]),
                new_dst: u32::from_ne_bytes([10, 0, 1, 11]),
                new_sport: 2000u16.to_be(),
                new_dport: 30080u16.to_be(),
                mac: [2, 3, 4, 5, 6, 7],
                flags: FLOW_F_FORWARD | FLOW_F_FIN,
                egress: 2,
                svc_id: 7,
                backend_id: 0x0102_0304,
                timeout_s: 3600,
                csum_addr: 0xdead_beef,
                csum_port: 0x1234_5678,
                proxy_seq_be: 0x0a0b_0c0d,
                proxy_len: 28,
                _pad: 0,
                last_seen_ns: 0,
            },
            rev: FlowV4 {
                new_src: 9,
                new_dst: 8,
                new_sport: 7,
                new_dport: 6,
                mac: [0xff; 6],
                flags: 2,
                svc_id: u32::MAX,
                backend_id: 1,
                timeout_s: 0,
                csum_addr: 5,
                csum_port: 4,
                ..Default::default()
            },
        }
    }

    fn sample() -> FlowRecord {
        FlowRecord {
            event: SyncEvent::V4(sample_v4()),
            age_ms: 123_456,
        }
    }

    /// An IPv6 record: the same entries with 16-byte addresses.
    fn sample6() -> FlowRecord {
        let v4 = sample_v4();
        let a6 = |w: u32| -> In6 { [0x20010db8u32.to_be(), 0, 0, w] };
        let flow = |f: &FlowV4| lb_common::FlowV6 {
            new_src: a6(f.new_src),
            new_dst: a6(f.new_dst),
            new_sport: f.new_sport,
            new_dport: f.new_dport,
            mac: f.mac,
            flags: f.flags,
            egress: f.egress,
            svc_id: f.svc_id,
            backend_id: f.backend_id,
            timeout_s: f.timeout_s,
            csum_addr: f.csum_addr,
            csum_port: f.csum_port,
            proxy_seq_be: f.proxy_seq_be,
            proxy_len: f.proxy_len,
            _pad: 0,
            last_seen_ns: 0,
        };
        FlowRecord {
            event: SyncEvent::V6(lb_common::FlowEventV6 {
                kind: FLOW_EV_NEW,
                _pad: [0; 7],
                key: FlowKey {
                    src: a6(v4.key.src),
                    dst: a6(v4.key.dst),
                    sport: v4.key.sport,
                    dport: v4.key.dport,
                    proto: PROTO_TCP,
                    _pad: [0; 3],
                },
                fwd: flow(&v4.fwd),
                rev: flow(&v4.rev),
            }),
            age_ms: 7,
        }
    }

    #[test]
    fn records_round_trip_field_by_field() {
        let a = sample();
        let mut close = sample_v4();
        close.kind = FLOW_EV_CLOSE;
        close.rev = FlowV4::default();
        let b = FlowRecord {
            event: SyncEvent::V4(close),
            age_ms: u32::MAX,
        };
        let c = sample6();
        let mut payload = Vec::new();
        encode_records([a, b, c].into_iter(), &mut payload);
        assert_eq!(payload.len(), 4 + 2 * RECORD_LEN_V4 + RECORD_LEN_V6);
        // The family first; network-order fields keep their on-wire bytes; little-endian integers are LE.
        assert_eq!(payload[4], FAMILY_V4);
        assert_eq!(&payload[6..10], &[10, 0, 0, 1]);
        assert_eq!(&payload[14..16], &40000u16.to_be_bytes());
        let end = 4 + RECORD_LEN_V4;
        assert_eq!(&payload[end - 4..end], &123_456u32.to_le_bytes());
        // The reverse entry's PROXY fields before it (zero), the forward entry's before those.
        assert_eq!(&payload[end - 10..end - 4], &[0; 6]);
        let fwd_end = end - 4 - (RECORD_LEN_V4 - 1 - 1 - 13 - 4) / 2;
        assert_eq!(
            &payload[fwd_end - 6..fwd_end],
            &[0x0d, 0x0c, 0x0b, 0x0a, 28, 0]
        );
        let v6 = 4 + 2 * RECORD_LEN_V4;
        assert_eq!(payload[v6], FAMILY_V6);
        assert_eq!(&payload[v6 + 2..v6 + 6], &[0x20, 0x01, 0x0d, 0xb8]);
        assert_eq!(decode_records(&payload).unwrap(), vec![a, b, c]);
    }

    #[test]
    fn last_seen_and_padding_are_not_sent() {
        let mut e = sample_v4();
        e.fwd.last_seen_ns = 99;
        e._pad = [1; 7];
        e.key._pad = [1; 3];
        let a = FlowRecord {
            event: SyncEvent::V4(e),
            ..sample()
        };
        let mut buf = Vec::new();
        encode_record(&a, &mut buf);
        let (d, len) = decode_record(&buf).unwrap();
        assert_eq!((d, len), (sample(), RECORD_LEN_V4));
    }

    #[test]
    fn malformed_records_are_refused() {
        let mut buf = Vec::new();
        encode_records([sample()].into_iter(), &mut buf);
        assert!(matches!(
            decode_records(&buf[..buf.len() - 1]),
            Err(WireError::Decode(_))
        ));
        assert!(matches!(
            decode_records(&buf[..3]),
            Err(WireError::Decode(_))
        ));
        buf[5] = 9; // event kind
        assert!(matches!(decode_records(&buf), Err(WireError::Decode(_))));
        buf[5] = FLOW_EV_NEW;
        buf[4] = 5; // family
        assert!(matches!(decode_records(&buf), Err(WireError::Decode(_))));
        // An IPv6 family byte on an IPv4 record's bytes: too short for its family.
        buf[4] = FAMILY_V6;
        assert!(matches!(decode_records(&buf), Err(WireError::Decode(_))));
    }

    #[test]
    fn frames_round_trip_in_sequence() {
        let key = [7u8; 32];
        let (mut s, mut o) = (Sealer::new(&key), Opener::new(&key));
        let mut wire = Vec::new();
        s.seal(FrameKind::Ack, &42u64.to_le_bytes(), &mut wire);
        s.seal(FrameKind::Heartbeat, &[], &mut wire);
        let (h1, rest) = wire.split_at(FRAME_HEADER_LEN);
        let h1: [u8; FRAME_HEADER_LEN] = h1.try_into().unwrap();
        let n = Opener::body_len(&h1).unwrap();
        let (kind, seq, p) = o.open(&h1, &rest[..n]).unwrap();
        assert_eq!((kind, seq, decode_u64(p).unwrap()), (FrameKind::Ack, 0, 42));
        let rest = &rest[n..];
        let h2: [u8; FRAME_HEADER_LEN] = rest[..FRAME_HEADER_LEN].try_into().unwrap();
        let (kind, seq, p) = o.open(&h2, &rest[FRAME_HEADER_LEN..]).unwrap();
        assert_eq!((kind, seq, p.len()), (FrameKind::Heartbeat, 1, 0));
    }

    fn one_frame(s: &mut Sealer, kind: FrameKind) -> ([u8; FRAME_HEADER_LEN], Vec<u8>) {
        let mut w = Vec::new();
        s.seal(kind, &1u64.to_le_bytes(), &mut w);
        (
            w[..FRAME_HEADER_LEN].try_into().unwrap(),
            w[FRAME_HEADER_LEN..].to_vec(),
        )
    }

    #[test]
    fn tampered_replayed_reordered_and_foreign_frames_are_rejected() {
        let key = [7u8; 32];
        let mut s = Sealer::new(&key);
        let f0 = one_frame(&mut s, FrameKind::Ack);
        let f1 = one_frame(&mut s, FrameKind::Ack);
        // Any flipped bit, in header, payload or tag.
        for i in 0..FRAME_HEADER_LEN + f0.1.len() {
            let (mut h, mut b) = f0.clone();
            if i < FRAME_HEADER_LEN {
                h[i] ^= 0x01;
            } else {
                b[i - FRAME_HEADER_LEN] ^= 0x01;
            }
            let r = Opener::new(&key).open(&h, &b);
            assert!(
                matches!(r, Err(WireError::Rejected(_)) | Err(WireError::Decode(_))),
                "byte {i}: {r:?}"
            );
        }
        // Reordered: frame 1 before frame 0.
        assert!(matches!(
            Opener::new(&key).open(&f1.0, &f1.1),
            Err(WireError::Rejected(_))
        ));
        // Replayed: frame 0 twice.
        let mut o = Opener::new(&key);
        o.open(&f0.0, &f0.1).unwrap();
        assert!(matches!(o.open(&f0.0, &f0.1), Err(WireError::Rejected(_))));
        // Another key (another session or direction).
        assert!(matches!(
            Opener::new(&[8u8; 32]).open(&f0.0, &f0.1),
            Err(WireError::Rejected(_))
        ));
    }

    #[test]
    fn unknown_versions_and_kinds_are_refused() {
        // A frame that authenticates but carries another version (sealed by hand as a newer peer would).
        let key = [7u8; 32];
        let mut s = Sealer::new(&key);
        let mut w = Vec::new();
        s.seal(FrameKind::Heartbeat, &[], &mut w);
        w[0] = VERSION + 1;
        let mut m = keyed(&key);
        m.update(&w[..FRAME_HEADER_LEN]);
        let tag = m.finalize().into_bytes();
        let h: [u8; FRAME_HEADER_LEN] = w[..FRAME_HEADER_LEN].try_into().unwrap();
        let r = Opener::new(&key).open(&h, &tag);
        assert!(
            matches!(r, Err(WireError::Version(v)) if v == VERSION + 1),
            "{r:?}"
        );
        assert!(r
            .unwrap_err()
            .to_string()
            .contains(&format!("version {}", VERSION + 1)));
        let mut h2 = h;
        h2[0] = VERSION;
        h2[1] = 99;
        let mut m = keyed(&key);
        m.update(&h2);
        let tag = m.finalize().into_bytes();
        assert!(matches!(
            Opener::new(&key).open(&h2, &tag),
            Err(WireError::Decode(_))
        ));
        // Oversized frames are refused from the header alone.
        let mut h3 = h2;
        h3[4..8].copy_from_slice(&(MAX_PAYLOAD as u32 + 1).to_le_bytes());
        assert!(matches!(Opener::body_len(&h3), Err(WireError::Decode(_))));
    }

    #[tokio::test]
    async fn handshake_derives_matching_keys() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let psk = b"0123456789abcdef".to_vec();
        let p2 = psk.clone();
        let resp = tokio::spawn(async move { respond(&mut b, &p2, 2).await });
        let mut i = initiate(&mut a, &psk, 1).await.unwrap();
        let mut r = resp.await.unwrap().unwrap();
        assert_eq!((i.peer_node, r.peer_node), (2, 1));
        let mut w = Vec::new();
        i.sealer.seal(FrameKind::Heartbeat, &[], &mut w);
        let h = w[..FRAME_HEADER_LEN].try_into().unwrap();
        r.opener.open(&h, &w[FRAME_HEADER_LEN..]).unwrap();
        w.clear();
        r.sealer.seal(FrameKind::Ack, &0u64.to_le_bytes(), &mut w);
        let h = w[..FRAME_HEADER_LEN].try_into().unwrap();
        i.opener.open(&h, &w[FRAME_HEADER_LEN..]).unwrap();
        // The directions have different keys: a frame cannot be reflected back to its sender.
        w.clear();
        i.sealer.seal(FrameKind::Heartbeat, &[], &mut w);
        let h = w[..FRAME_HEADER_LEN].try_into().unwrap();
        assert!(i.opener.open(&h, &w[FRAME_HEADER_LEN..]).is_err());
    }

    #[tokio::test]
    async fn handshake_with_different_secrets_fails_on_both_sides() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let resp = tokio::spawn(async move {
            let r = respond(&mut b, b"0123456789abcdef", 2).await;
            drop(b);
            r
        });
        let r = initiate(&mut a, b"fedcba9876543210", 1).await;
        assert!(matches!(r, Err(WireError::Auth(_))), "{:?}", r.err());
        drop(a);
        assert!(matches!(resp.await.unwrap(), Err(WireError::Auth(_))));
    }

    #[tokio::test]
    async fn handshake_rejects_other_versions_clearly() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let resp = tokio::spawn(async move { respond(&mut b, b"0123456789abcdef", 2).await });
        let mut hello = [0u8; HELLO_LEN];
        hello[..PREFIX_LEN].copy_from_slice(&prefix(MSG_HELLO));
        hello[4] = VERSION + 1;
        a.write_all(&hello).await.unwrap();
        // The initiator is told which version the responder speaks.
        let mut reject = [0u8; PREFIX_LEN];
        a.read_exact(&mut reject).await.unwrap();
        assert_eq!((reject[4], reject[5]), (VERSION, MSG_REJECT));
        drop(a);
        let e = resp.await.unwrap().err().unwrap();
        assert!(
            matches!(e, WireError::Version(v) if v == VERSION + 1),
            "{e}"
        );
        // And an initiator reading a reply of another version says so.
        let (mut a, mut b) = tokio::io::duplex(4096);
        let init = tokio::spawn(async move { initiate(&mut a, b"0123456789abcdef", 1).await });
        let mut hello = [0u8; HELLO_LEN];
        b.read_exact(&mut hello).await.unwrap();
        let mut reply = prefix(MSG_REJECT);
        reply[4] = 7;
        b.write_all(&reply).await.unwrap();
        assert!(matches!(init.await.unwrap(), Err(WireError::Version(7))));
    }

    #[tokio::test]
    async fn a_node_dialling_itself_is_told_so() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let resp = tokio::spawn(async move { respond(&mut b, b"0123456789abcdef", 5).await });
        let r = initiate(&mut a, b"0123456789abcdef", 5).await;
        assert!(matches!(r, Err(WireError::SelfConnection)));
        assert!(matches!(
            resp.await.unwrap(),
            Err(WireError::SelfConnection)
        ));
    }

    /// Hostile input, generated: whatever bytes a peer (or anyone reaching port 9190) sends, the parsers refuse
    /// them with an error — never a panic, never a buffer beyond one frame — and no change to a sealed frame
    /// gets through.
    mod hostile {
        use super::*;
        use proptest::prelude::*;

        fn block_on<F: std::future::Future>(f: F) -> F::Output {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(f)
        }

        /// Frames as a sender would write them, then `bytes` of garbage.
        fn stream_of(frames: usize, payload: &[u8], garbage: &[u8]) -> Vec<u8> {
            let mut out = Vec::new();
            let mut sealer = Sealer::new(b"k");
            for _ in 0..frames {
                sealer.seal(FrameKind::Records, payload, &mut out);
            }
            out.extend_from_slice(garbage);
            out
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

            #[test]
            fn frames_of_arbitrary_bytes_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
                let mut buf = Vec::new();
                let mut opener = Opener::new(b"k");
                let r = block_on(read_frame(&mut &bytes[..], &mut opener, &mut buf)).map(|_| ());
                prop_assert!(r.is_err());
                prop_assert!(buf.len() <= MAX_PAYLOAD + MAC_LEN);
            }

            #[test]
            fn garbage_after_good_frames_is_refused(
                frames in 0usize..4,
                payload in proptest::collection::vec(any::<u8>(), 0..300),
                garbage in proptest::collection::vec(any::<u8>(), 1..600),
            ) {
                let bytes = stream_of(frames, &payload, &garbage);
                let mut reader = &bytes[..];
                let mut opener = Opener::new(b"k");
                let mut buf = Vec::new();
                for _ in 0..frames {
                    let (kind, _, got) = block_on(read_frame(&mut reader, &mut opener, &mut buf)).unwrap();
                    prop_assert_eq!(kind, FrameKind::Records);
                    prop_assert_eq!(got, &payload[..]);
                }
                prop_assert!(block_on(read_frame(&mut reader, &mut opener, &mut buf)).is_err());
            }

            #[test]
            fn every_changed_byte_of_a_frame_is_caught(
                payload in proptest::collection::vec(any::<u8>(), 0..300),
                at in any::<prop::sample::Index>(),
                flip in 1u8..=255,
            ) {
                let mut bytes = stream_of(1, &payload, &[]);
                let i = at.index(bytes.len());
                bytes[i] ^= flip;
                let mut buf = Vec::new();
                let r = block_on(read_frame(&mut &bytes[..], &mut Opener::new(b"k"), &mut buf)).map(|_| ());
                prop_assert!(r.is_err(), "byte {} changed, frame accepted", i);
            }

            #[test]
            fn record_payloads_of_arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
                let _ = decode_records(&bytes);
                let _ = decode_u64(&bytes);
            }

            #[test]
            fn handshakes_of_arbitrary_bytes_are_refused(
                bytes in proptest::collection::vec(any::<u8>(), 0..400),
                magic in any::<bool>(),
            ) {
                // Half the cases start like a real hello, so the parser gets past the magic and version.
                let mut bytes = bytes;
                if magic && bytes.len() >= PREFIX_LEN {
                    bytes[..PREFIX_LEN].copy_from_slice(&prefix(MSG_HELLO));
                }
                let r = block_on(async {
                    let (mut a, mut b) = tokio::io::duplex(8192);
                    b.write_all(&bytes).await.unwrap();
                    drop(b);
                    respond(&mut a, b"0123456789abcdef", 1).await.map(|_| ())
                });
                prop_assert!(r.is_err());
            }
        }
    }
}
