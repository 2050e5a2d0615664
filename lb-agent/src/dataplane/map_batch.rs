//! Batched access to hash maps: `BPF_MAP_LOOKUP_BATCH`, `BPF_MAP_UPDATE_BATCH` and `BPF_MAP_DELETE_BATCH` take
//! one syscall for thousands of entries, where aya's element-wise calls take one per entry (two per entry when
//! walking a map). The GC walks the connection tables every pass and the flow sync writes every peer record, so
//! per-entry syscalls were most of the agent's CPU under churn. aya 0.14 has no batch operations: the three
//! commands are issued here directly (kernel ≥ 5.6), on maps that aya opened and size-checked.

use aya::maps::{HashMap, IterableMap, MapData};
use aya::Pod;
use std::borrow::{Borrow, BorrowMut};
use std::io;
use std::os::fd::{AsFd, AsRawFd};

/// `union bpf_attr`'s `batch` member (include/uapi/linux/bpf.h); the kernel zero-fills what it is not given.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

/// Entries read per lookup call. A hash map's batch is a whole bucket, so a chunk must hold the fullest bucket
/// (a handful of entries); larger chunks only save calls.
const CHUNK: usize = 8192;

fn bpf(cmd: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is a valid batch attribute whose pointers reference live buffers of `count` elements of
    // the map's key and value sizes (checked by aya when the map was opened as `HashMap<_, K, V>`).
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut BatchAttr,
            std::mem::size_of::<BatchAttr>(),
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn fd<T: Borrow<MapData>, K: Pod, V: Pod>(map: &HashMap<T, K, V>) -> u32 {
    map.map().fd().as_fd().as_raw_fd() as u32
}

/// Every entry of `map`. Entries written or deleted during the walk may or may not be seen, as with element-wise
/// iteration; reading does not mark LRU entries as used.
pub fn entries<T: Borrow<MapData>, K: Pod, V: Pod>(
    map: &HashMap<T, K, V>,
) -> io::Result<Vec<(K, V)>> {
    // SAFETY: K and V are plain data (`Pod`): any bytes, zero included, are valid values.
    let mut keys: Vec<K> = vec![unsafe { std::mem::zeroed() }; CHUNK];
    let mut values: Vec<V> = vec![unsafe { std::mem::zeroed() }; CHUNK];
    let mut out = Vec::new();
    // The kernel's position tokens (a bucket index for hash maps; 8 bytes leave room for any map's).
    let (mut pos, mut next) = (0u64, 0u64);
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { &pos as *const u64 as u64 },
            out_batch: &mut next as *mut u64 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd(map),
            ..Default::default()
        };
        let r = bpf(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let n = (attr.count as usize).min(CHUNK);
        out.extend(keys[..n].iter().copied().zip(values[..n].iter().copied()));
        match r {
            Ok(()) => {}
            // The end of the map (the last chunk may still carry entries).
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(out),
            Err(e) => return Err(e),
        }
        pos = next;
        first = false;
    }
}

/// Writes `entries` in order (a later entry of the same key wins), with `BPF_ANY`.
pub fn update<T: BorrowMut<MapData>, K: Pod, V: Pod>(
    map: &mut HashMap<T, K, V>,
    entries: &[(K, V)],
) -> io::Result<()> {
    if entries.is_empty() {
        return Ok(());
    }
    let (keys, values): (Vec<K>, Vec<V>) = entries.iter().copied().unzip();
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: keys.len() as u32,
        map_fd: fd(map),
        ..Default::default()
    };
    bpf(BPF_MAP_UPDATE_BATCH, &mut attr)
}

/// Deletes `keys`; keys that are not in the map are skipped. Returns how many were deleted.
pub fn delete<T: BorrowMut<MapData>, K: Pod, V: Pod>(
    map: &mut HashMap<T, K, V>,
    keys: &[K],
) -> io::Result<usize> {
    let mut deleted = 0;
    let mut rest = keys;
    while !rest.is_empty() {
        let mut attr = BatchAttr {
            keys: rest.as_ptr() as u64,
            count: rest.len() as u32,
            map_fd: fd(map),
            ..Default::default()
        };
        let r = bpf(BPF_MAP_DELETE_BATCH, &mut attr);
        // The kernel stops at the first key it cannot delete and says how many it did before it.
        let done = (attr.count as usize).min(rest.len());
        deleted += done;
        match r {
            Ok(()) => return Ok(deleted),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                rest = rest.get(done + 1..).unwrap_or(&[])
            }
            Err(e) => return Err(e),
        }
    }
    Ok(deleted)
}
