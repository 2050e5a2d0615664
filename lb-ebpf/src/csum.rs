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
