//! The eBPF object's map definitions, adjusted before it is loaded. aya sets a map's size before load
//! (`EbpfLoader::map_max_entries`) but not its flags, and whether the connection tables' LRU lists are per CPU is
//! decided when the agent starts ([`super::ConnectionLru`]). A map built with aya-ebpf's `#[map]` is a
//! `bpf_map_def` in the object's `maps` section under the map's name; its flags are one of its words.

use anyhow::{bail, Context, Result};
use object::{Object, ObjectSection, ObjectSymbol};

/// `BPF_F_NO_COMMON_LRU` (linux/bpf.h): an LRU hash map's lists per CPU.
pub const BPF_F_NO_COMMON_LRU: u32 = 1 << 1;

/// `bpf_map_def`: type, key size, value size, max entries, flags, id, pinning — a little-endian u32 each.
const MAP_DEF_SIZE: u64 = 28;
const MAP_FLAGS_OFFSET: usize = 16;

/// Sets the bits `set` and clears the bits `clear` of map `name`'s flags in `obj`; returns the new flags.
pub fn patch_map_flags(obj: &mut [u8], name: &str, set: u32, clear: u32) -> Result<u32> {
    let at = flags_offset(obj, name)?;
    let word: [u8; 4] = obj[at..at + 4].try_into().expect("four bytes");
    let flags = (u32::from_le_bytes(word) | set) & !clear;
    obj[at..at + 4].copy_from_slice(&flags.to_le_bytes());
    Ok(flags)
}

/// Map `name`'s flags in `obj`.
pub fn map_flags(obj: &[u8], name: &str) -> Result<u32> {
    let at = flags_offset(obj, name)?;
    Ok(u32::from_le_bytes(
        obj[at..at + 4].try_into().expect("four bytes"),
    ))
}

/// Where in `obj` map `name`'s flags word is.
fn flags_offset(obj: &[u8], name: &str) -> Result<usize> {
    let file = object::File::parse(obj).context("parsing the eBPF object")?;
    let sym = file
        .symbols()
        .find(|s| s.name() == Ok(name))
        .with_context(|| format!("map {name} is not in the eBPF object"))?;
    let section = sym
        .section_index()
        .and_then(|i| file.section_by_index(i).ok())
        .with_context(|| format!("map {name}: no section"))?;
    if section.name() != Ok("maps") || sym.size() != MAP_DEF_SIZE {
        bail!(
            "map {name} is not a {MAP_DEF_SIZE}-byte definition in the `maps` section (section {:?}, {} bytes)",
            section.name(),
            sym.size()
        );
    }
    let (start, size) = section
        .file_range()
        .with_context(|| format!("map {name}: its section has no bytes in the file"))?;
    // In a relocatable object a symbol's value is its offset in its section.
    let offset = sym.address() - section.address();
    if offset + MAP_DEF_SIZE > size {
        bail!("map {name}: its definition runs past its section");
    }
    Ok((start + offset) as usize + MAP_FLAGS_OFFSET)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::map_names as names;

    #[test]
    fn the_connection_tables_flags_are_read_and_patched_in_the_embedded_object() {
        let obj = super::super::LB_OBJECT;
        assert!(
            !obj.is_empty(),
            "no eBPF object built in: run `cargo xtask build-ebpf`"
        );
        for name in [names::FLOWS_V4, names::FLOWS_V6] {
            assert_eq!(
                map_flags(obj, name).unwrap(),
                BPF_F_NO_COMMON_LRU,
                "{name} as built"
            );
        }
        let mut patched = obj.to_vec();
        assert_eq!(
            patch_map_flags(&mut patched, names::FLOWS_V4, 0, BPF_F_NO_COMMON_LRU).unwrap(),
            0
        );
        assert_eq!(map_flags(&patched, names::FLOWS_V4).unwrap(), 0);
        // Nothing else moved: the one word differs.
        let differ = obj.iter().zip(&patched).filter(|(a, b)| a != b).count();
        assert_eq!(differ, 1);
        assert_eq!(
            map_flags(&patched, names::FLOWS_V6).unwrap(),
            BPF_F_NO_COMMON_LRU
        );
        assert_eq!(
            map_flags(obj, names::TRANSIENT_V4).unwrap(),
            BPF_F_NO_COMMON_LRU
        );
        assert!(map_flags(obj, "NO_SUCH_MAP").is_err());
        // A symbol that is no map definition.
        assert!(map_flags(obj, "lb_xdp").is_err());
    }
}
