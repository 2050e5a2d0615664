//! Incremental Internet checksum updates (RFC 1624: `HC' = ~(~HC + ~m + m')`).
//!
//! All values are the raw memory of the header fields (network order loaded natively); the one's-complement
//! sum is byte-order independent as long as checksum and data are treated alike (RFC 1071 §2(B)).

/// Folds a 64-bit one's-complement accumulator to 16 bits.
#[inline(always)]
pub fn fold(mut s: u64) -> u32 {
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s as u32
}

/// The sum that turns 32-bit word `old` into `new`.
#[inline(always)]
pub fn diff32(old: u32, new: u32) -> u32 {
    let o = !old;
    fold((o & 0xffff) as u64 + (o >> 16) as u64 + (new & 0xffff) as u64 + (new >> 16) as u64)
}

/// The sum that turns 16-bit word `old` into `new`.
#[inline(always)]
pub fn diff16(old: u16, new: u16) -> u32 {
    fold((!old) as u64 + new as u64)
}

/// Adds two partial sums.
#[inline(always)]
pub fn add(a: u32, b: u32) -> u32 {
    fold(a as u64 + b as u64)
}

/// Applies a partial sum to a stored checksum.
#[inline(always)]
pub fn apply(csum: u16, diff: u32) -> u16 {
    !(fold((!csum) as u64 + diff as u64) as u16)
}

/// Applies a partial sum to a UDP checksum: 0 means "no checksum" and stays 0; a result of 0 is sent as
/// 0xffff (RFC 768).
#[inline(always)]
pub fn apply_udp(csum: u16, diff: u32) -> u16 {
    if csum == 0 {
        return 0;
    }
    let c = apply(csum, diff);
    if c == 0 {
        0xffff
    } else {
        c
    }
}

#[cfg(test)]
mod tests {
    //! The incremental update against a full recomputation, over random headers and rewrites. Fields are fed as
    //! the program sees them: network-order bytes loaded natively.
    use super::*;
    use proptest::prelude::*;

    /// RFC 1071 checksum of `b` as stored in the header (network-order bytes).
    fn full(b: &[u8]) -> [u8; 2] {
        let mut s: u32 = b
            .chunks(2)
            .map(|c| u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32)
            .sum();
        while s > 0xffff {
            s = (s & 0xffff) + (s >> 16);
        }
        (!(s as u16)).to_be_bytes()
    }

    fn raw32(b: &[u8]) -> u32 {
        u32::from_ne_bytes(b.try_into().unwrap())
    }

    /// 0x0000 and 0xffff are the same one's-complement number.
    fn same(a: [u8; 2], b: [u8; 2]) -> bool {
        a == b
            || (a.iter().all(|x| *x == 0) && b.iter().all(|x| *x == 0xff))
            || (a.iter().all(|x| *x == 0xff) && b.iter().all(|x| *x == 0))
    }

    proptest! {
        #[test]
        fn rewriting_addresses_and_ports_matches_a_full_checksum(
            mut hdr in proptest::collection::vec(any::<u8>(), 24),
            new_src in any::<u32>(),
            new_dst in any::<u32>(),
            new_sport in any::<u16>(),
            new_dport in any::<u16>(),
        ) {
            // 20 bytes of "header" with the checksum at 10..12, then two ports.
            hdr[10] = 0;
            hdr[11] = 0;
            let ck = full(&hdr);
            hdr[10..12].copy_from_slice(&ck);
            let (src, dst) = (raw32(&hdr[12..16]), raw32(&hdr[16..20]));
            let sport = u16::from_ne_bytes([hdr[20], hdr[21]]);
            let dport = u16::from_ne_bytes([hdr[22], hdr[23]]);
            let d = add(
                add(diff32(src, new_src), diff32(dst, new_dst)),
                add(diff16(sport, new_sport), diff16(dport, new_dport)),
            );
            let updated = apply(u16::from_ne_bytes(ck), d).to_ne_bytes();
            hdr[12..16].copy_from_slice(&new_src.to_ne_bytes());
            hdr[16..20].copy_from_slice(&new_dst.to_ne_bytes());
            hdr[20..22].copy_from_slice(&new_sport.to_ne_bytes());
            hdr[22..24].copy_from_slice(&new_dport.to_ne_bytes());
            hdr[10] = 0;
            hdr[11] = 0;
            prop_assert!(same(updated, full(&hdr)), "{updated:02x?} vs {:02x?}", full(&hdr));
        }

        #[test]
        fn a_udp_checksum_is_never_written_as_zero(csum in any::<u16>(), d in any::<u32>()) {
            let out = apply_udp(csum, fold(d as u64));
            prop_assert_eq!(out == 0, csum == 0, "0 means none, in and out");
        }
    }
}
