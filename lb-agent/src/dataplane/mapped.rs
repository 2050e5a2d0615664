//! [`MappedArray`]: a memory-mapped BPF array (the Maglev arena, the flow filter), read and written without
//! syscalls.

use anyhow::{bail, Result};
use aya::maps::MapData;

/// A `BPF_F_MMAPABLE` array mapped into this process (the Maglev arena, the flow filter). The kernel lays array
/// elements out 8-byte aligned, so each `u32` slot of the arena is the low half of a `u64` in the mapping.
pub(crate) struct MappedArray {
    ptr: *mut u64,
    entries: usize,
    bytes: usize,
}

// SAFETY: the mapping is owned by this struct; writes go through `&mut self` (the Maglev arena) or are atomic (the
// flow filter).
unsafe impl Send for MappedArray {}

impl MappedArray {
    pub(crate) fn map(data: &MapData, entries: u32) -> Result<Self> {
        use std::os::fd::{AsFd, AsRawFd};
        let page = 4096usize;
        let bytes = (entries as usize * 8).div_ceil(page) * page;
        // SAFETY: mapping a map fd the kernel created with BPF_F_MMAPABLE; checked for MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                data.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            bail!(
                "mmap of a memory-mappable array map failed: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(MappedArray {
            ptr: ptr.cast(),
            entries: entries as usize,
            bytes,
        })
    }

    pub(crate) fn ptr(&self) -> *mut u64 {
        self.ptr
    }

    pub(crate) fn slots(&self) -> &[u64] {
        // SAFETY: `entries` 8-byte elements are mapped for the lifetime of self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.entries) }
    }

    pub(crate) fn slots_mut(&mut self) -> &mut [u64] {
        // SAFETY: `entries` 8-byte elements are mapped read-write for the lifetime of self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.entries) }
    }
}

impl Drop for MappedArray {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped.
        unsafe { libc::munmap(self.ptr.cast(), self.bytes) };
    }
}
