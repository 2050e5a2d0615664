//! The flow-sync wire protocol as a receiver reads it. The first byte chooses what the rest is:
//! - even: the raw byte stream from a peer that does not know the key (before authentication): every frame must
//!   be refused, and the receive buffer stays bounded;
//! - odd: frames a peer holding the key sends — chunks `[kind][skip][len lo][len hi][payload…]` sealed with the
//!   right key (`skip` > 0 leaves sequence numbers out: a gap or a replay), then whatever bytes are left as
//!   garbage — so the decoders behind the MAC (records, sequence numbers, kinds) get any payload.
#![no_main]

use lb_agent::ha::sync::wire::{decode_records, decode_u64, read_frame, FrameKind, Opener, Sealer};

const KEY: &[u8] = b"fuzz key";

fn frames(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut sealer = Sealer::new(KEY);
    let mut rest = data;
    while rest.len() >= 4 {
        let kind = match rest[0] % 5 {
            0 => FrameKind::Records,
            1 => FrameKind::DumpDone,
            2 => FrameKind::Heartbeat,
            3 => FrameKind::Ack,
            _ => break,
        };
        let len = (u16::from_le_bytes([rest[2], rest[3]]) as usize).min(rest.len() - 4);
        for _ in 0..rest[1] % 3 {
            // A sequence number the receiver never sees.
            let mut lost = Vec::new();
            sealer.seal(FrameKind::Heartbeat, &[], &mut lost);
        }
        sealer.seal(kind, &rest[4..4 + len], &mut out);
        rest = &rest[4 + len..];
    }
    out.extend_from_slice(rest);
    out
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&mode, data)) = data.split_first() else {
        return;
    };
    let authenticated = mode % 2 == 1;
    let stream = if authenticated {
        frames(data)
    } else {
        data.to_vec()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut opener = Opener::new(KEY);
        let mut buf = Vec::new();
        let mut r = &stream[..];
        let mut opened = 0;
        while let Ok((kind, _seq, payload)) = read_frame(&mut r, &mut opener, &mut buf).await {
            opened += 1;
            match kind {
                FrameKind::Records => {
                    let _ = decode_records(payload);
                }
                _ => {
                    let _ = decode_u64(payload);
                }
            }
        }
        // Without the key nothing gets through.
        assert!(
            authenticated || opened == 0,
            "an unauthenticated frame was accepted"
        );
        assert!(
            buf.capacity() <= 1 << 21,
            "receive buffer grew to {}",
            buf.capacity()
        );
    });
});
