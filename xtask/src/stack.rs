//! The BPF stack check `build-ebpf` runs on each object it builds: the kernel limits the stack of every chain of
//! BPF-to-BPF calls from a program's entry to 512 bytes, frames summed. `-bpf-stack-size` only limits each
//! function's own frame, and kernel 6.1 (the LB VM image's) rounds every frame up to 32 bytes, an empty one counting
//! as 32 (`round_up(max(depth, 1), 32)` in `check_max_stack_depth`), where newer kernels round JITed frames less.
//! So a chain that this machine's 6.18 loads can be refused on 6.1; CI cannot load every program there, so this
//! check computes the worst chain of each program from the object itself, with 6.1's rounding.
//!
//! A program is every function symbol in an executable section other than `.text` (`xdp`, `classifier`); the
//! functions it calls live in `.text`. A function's frame is the deepest `r10 - N` it touches: loads from and stores
//! to the stack, and stack pointers it forms (`rX = r10; rX += -N`), which it may hand to helpers. Calls are resolved
//! as aya links them (`aya-obj`'s `relocate_calls`).

use anyhow::{bail, Context, Result};
use object::{
    Object, ObjectSection, ObjectSymbol, RelocationTarget, SectionIndex, SectionKind, SymbolKind,
};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

/// The kernel's `MAX_BPF_STACK`: the most a chain of calls may use, frames summed.
pub const MAX_STACK: u64 = 512;

/// The size of one BPF instruction; `lddw` takes two.
const INSN: usize = 8;
/// `BPF_JMP | BPF_CALL`.
const CALL: u8 = 0x85;
/// `src_reg` of a call to a BPF function (`BPF_PSEUDO_CALL`); helpers have 0.
const PSEUDO_CALL: u8 = 1;
/// `BPF_LD | BPF_IMM | BPF_DW`: the 16-byte 64-bit immediate load.
const LDDW: u8 = 0x18;
/// `BPF_ALU64 | BPF_MOV | BPF_X`: `dst = src`.
const MOV64_REG: u8 = 0xbf;
/// `BPF_ALU64 | BPF_ADD | BPF_K`: `dst += imm`.
const ADD64_IMM: u8 = 0x07;
/// The frame pointer.
const R10: u8 = 10;

/// A frame as kernel 6.1 counts it: rounded up to 32 bytes, an empty frame counting as 32.
pub fn rounded(frame: u64) -> u64 {
    frame.max(1).div_ceil(32) * 32
}

/// One function of an object: its own frame (bytes below r10) and the functions it calls (indexes into the list).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    pub name: String,
    pub frame: u64,
    pub calls: Vec<usize>,
    /// Whether it is a program's entry (a function in an executable section other than `.text`).
    pub program: bool,
}

/// The deepest chain of calls from one program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// Frames summed, each rounded as 6.1 does.
    pub total: u64,
    /// The functions on the chain, the program first.
    pub path: Vec<usize>,
}

/// A function's frame: the deepest `r10 - N` its instructions load from, store to or point at.
pub fn frame(code: &[u8]) -> u64 {
    // What each register holds when it is known to be r10 plus a constant (straight-line; jumps are ignored, which
    // at worst counts a pointer formed on a path that does not use it).
    let mut fp: [Option<i64>; 11] = [None; 11];
    fp[R10 as usize] = Some(0);
    let mut deepest: i64 = 0;
    let mut pc = 0;
    while pc + INSN <= code.len() {
        let i = &code[pc..pc + INSN];
        let (op, dst, src) = (i[0], (i[1] & 0xf) as usize, (i[1] >> 4) as usize);
        let off = i64::from(i16::from_le_bytes([i[2], i[3]]));
        let imm = i64::from(i32::from_le_bytes([i[4], i[5], i[6], i[7]]));
        let base = |r: usize| fp.get(r).copied().flatten();
        match op & 7 {
            // LDX: dst = *(src + off).
            1 => {
                if let Some(b) = base(src) {
                    deepest = deepest.max(-(b + off));
                }
            }
            // ST, STX: *(dst + off) = ...
            2 | 3 => {
                if let Some(b) = base(dst) {
                    deepest = deepest.max(-(b + off));
                }
            }
            _ => {}
        }
        // What the instruction leaves in its destination register.
        if dst < R10 as usize {
            match op {
                MOV64_REG => fp[dst] = base(src),
                ADD64_IMM => {
                    if let Some(b) = fp[dst] {
                        fp[dst] = Some(b + imm);
                        deepest = deepest.max(-(b + imm));
                    }
                }
                CALL => fp[..=5].fill(None),
                // Other ALU, ALU64, LDX and LD instructions write dst.
                _ if matches!(op & 7, 0 | 1 | 4 | 7) => fp[dst] = None,
                _ => {}
            }
        }
        pc += if op == LDDW { 2 * INSN } else { INSN };
    }
    deepest.max(0) as u64
}

/// The functions of a BPF object (ELF) with their frames and calls.
pub fn functions(data: &[u8]) -> Result<Vec<Function>> {
    let file = object::File::parse(data).context("parsing the ELF")?;
    // Every function symbol, by (section, offset); the list keeps the symbols' order.
    let mut funcs = Vec::new();
    let mut at: HashMap<(SectionIndex, u64), usize> = HashMap::new();
    let mut spans = Vec::new();
    for sym in file.symbols() {
        if sym.kind() != SymbolKind::Text {
            continue;
        }
        let Some(section) = sym.section_index() else {
            continue;
        };
        if at.contains_key(&(section, sym.address())) {
            continue;
        }
        let sec = file.section_by_index(section)?;
        if sec.kind() != SectionKind::Text {
            continue;
        }
        let name = sym.name().unwrap_or("?").to_owned();
        let program = sec.name()? != ".text";
        at.insert((section, sym.address()), funcs.len());
        spans.push((section, sym.address(), sym.size()));
        funcs.push(Function {
            name,
            frame: 0,
            calls: Vec::new(),
            program,
        });
    }
    let mut relocations: HashMap<SectionIndex, HashMap<u64, RelocationTarget>> = HashMap::new();
    for (f, &(section, start, size)) in spans.iter().enumerate() {
        let sec = file.section_by_index(section)?;
        let data = sec.data()?;
        let (start, end) = (start as usize, (start + size) as usize);
        let code = data
            .get(start..end)
            .with_context(|| format!("{} lies outside its section", funcs[f].name))?;
        funcs[f].frame = frame(code);
        let relocs = relocations.entry(section).or_insert_with(|| {
            sec.relocations()
                .map(|(offset, r)| (offset, r.target()))
                .collect()
        });
        let mut pc = start;
        while pc + INSN <= end {
            let op = data[pc];
            if op == CALL && data[pc + 1] >> 4 == PSEUDO_CALL {
                let imm = i64::from(i32::from_le_bytes(data[pc + 4..pc + 8].try_into()?));
                let (target_section, target) = match relocs.get(&(pc as u64)) {
                    // As aya links them: against a function, that function; against a section (`.text`), the
                    // instruction imm + 1 of it.
                    Some(RelocationTarget::Symbol(s)) => {
                        let sym = file.symbol_by_index(*s)?;
                        let Some(sec) = sym.section_index() else {
                            bail!(
                                "{} calls {}, which the object does not define",
                                funcs[f].name,
                                sym.name().unwrap_or("?")
                            );
                        };
                        match sym.kind() {
                            SymbolKind::Section => (sec, sym.address() as i64 + (imm + 1) * 8),
                            _ => (sec, sym.address() as i64),
                        }
                    }
                    Some(other) => bail!(
                        "{}: call at byte {pc} has a relocation aya does not link ({other:?})",
                        funcs[f].name
                    ),
                    // No relocation: pc-relative in the same section.
                    None => (section, pc as i64 + (imm + 1) * 8),
                };
                let Some(&callee) = u64::try_from(target)
                    .ok()
                    .and_then(|t| at.get(&(target_section, t)))
                else {
                    bail!(
                        "{}: call at byte {pc} goes to byte {target} of section {}, where no function starts",
                        funcs[f].name,
                        target_section.0
                    );
                };
                if !funcs[f].calls.contains(&callee) {
                    funcs[f].calls.push(callee);
                }
            }
            pc += if op == LDDW { 2 * INSN } else { INSN };
        }
    }
    Ok(funcs)
}

/// The deepest chain of calls from `entry`. The kernel refuses recursion, so a cycle is not followed around.
pub fn deepest(funcs: &[Function], entry: usize) -> Chain {
    fn walk(
        funcs: &[Function],
        f: usize,
        on_path: &mut Vec<bool>,
        memo: &mut [Option<Chain>],
    ) -> Chain {
        if let Some(c) = &memo[f] {
            return c.clone();
        }
        on_path[f] = true;
        let mut best = Chain {
            total: 0,
            path: Vec::new(),
        };
        for &c in &funcs[f].calls {
            if on_path[c] {
                continue;
            }
            let sub = walk(funcs, c, on_path, memo);
            if sub.total > best.total {
                best = sub;
            }
        }
        on_path[f] = false;
        best.total += rounded(funcs[f].frame);
        best.path.insert(0, f);
        memo[f] = Some(best.clone());
        best
    }
    let mut on_path = vec![false; funcs.len()];
    let mut memo = vec![None; funcs.len()];
    walk(funcs, entry, &mut on_path, &mut memo)
}

/// Checks every program of `funcs` against `limit`; returns the deepest program and its chain, or an error naming
/// each program over the limit with its chain.
pub fn check(funcs: &[Function], limit: u64) -> Result<Option<(usize, Chain)>> {
    let mut worst: Option<(usize, Chain)> = None;
    let mut over = String::new();
    for (p, f) in funcs.iter().enumerate().filter(|(_, f)| f.program) {
        let chain = deepest(funcs, p);
        if chain.total > limit {
            let _ = write!(
                over,
                "\n  {}: {} bytes: {}",
                f.name,
                chain.total,
                describe(funcs, &chain)
            );
        }
        if worst.as_ref().is_none_or(|(_, w)| chain.total > w.total) {
            worst = Some((p, chain));
        }
    }
    if !over.is_empty() {
        bail!(
            "a chain of BPF calls needs more than {limit} bytes of stack as kernel 6.1 counts it (each frame \
             rounded up to 32, an empty one counting 32); the kernel would refuse these programs:{over}\n\
             Frames are shown as own bytes -> counted bytes. Shrink a frame on the chain or stop inlining into it \
             (move large temporaries to the per-CPU SCRATCH map)."
        );
    }
    Ok(worst)
}

/// `a 96->96 > b 312->320 > c 0->32`.
pub fn describe(funcs: &[Function], chain: &Chain) -> String {
    chain
        .path
        .iter()
        .map(|&f| {
            let f = &funcs[f];
            format!("{} {}->{}", short_name(&f.name), f.frame, rounded(f.frame))
        })
        .collect::<Vec<_>>()
        .join(" > ")
}

/// A Rust symbol demangled without its hash (`lb_ebpf::ipv6::l4_frame::<lb_ebpf::ctx::Tc>`); other names as they are.
pub fn short_name(name: &str) -> String {
    format!("{:#}", rustc_demangle::demangle(name))
}

/// Checks the object at `path`; returns its deepest program's name and chain total.
pub fn check_file(path: &Path, limit: u64) -> Result<Option<(String, u64)>> {
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let funcs =
        functions(&data).with_context(|| format!("reading the functions of {}", path.display()))?;
    let worst =
        check(&funcs, limit).with_context(|| format!("{}: BPF stack check", path.display()))?;
    Ok(worst.map(|(p, c)| (funcs[p].name.clone(), c.total)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One instruction.
    fn insn(op: u8, dst: u8, src: u8, off: i16, imm: i32) -> Vec<u8> {
        let mut v = vec![op, dst | (src << 4)];
        v.extend(off.to_le_bytes());
        v.extend(imm.to_le_bytes());
        v
    }

    fn func(frame: u64, calls: &[usize], program: bool) -> Function {
        Function {
            name: format!("f{frame}"),
            frame,
            calls: calls.to_vec(),
            program,
        }
    }

    #[test]
    fn rounding_is_6_1s() {
        assert_eq!(rounded(0), 32);
        assert_eq!(rounded(1), 32);
        assert_eq!(rounded(32), 32);
        assert_eq!(rounded(33), 64);
        assert_eq!(rounded(312), 320);
        assert_eq!(rounded(448), 448);
    }

    #[test]
    fn frame_counts_loads_stores_and_formed_pointers() {
        let code = [
            insn(0x79, 0, 10, -8, 0),      // r0 = *(u64 *)(r10 - 8)
            insn(0x7b, 10, 1, -24, 0),     // *(u64 *)(r10 - 24) = r1
            insn(0x18, 0, 0, 0, 0),        // lddw r0, ... (two halves; the second must be skipped)
            insn(0x7a, 10, 0, -400, 0), // looks like a store to r10 - 400 but is lddw's second half
            insn(0x62, 10, 0, -16, 7),  // *(u32 *)(r10 - 16) = 7
            insn(MOV64_REG, 2, 10, 0, 0), // r2 = r10
            insn(ADD64_IMM, 2, 0, 0, -40), // r2 += -40
            insn(0x95, 0, 0, 0, 0),     // exit
        ]
        .concat();
        assert_eq!(frame(&code), 40);
        // A pointer used with an offset: r3 = r10; r3 += -48; *(u64 *)(r3 - 16) = r1.
        let code = [
            insn(MOV64_REG, 3, 10, 0, 0),
            insn(ADD64_IMM, 3, 0, 0, -48),
            insn(0x7b, 3, 1, -16, 0),
        ]
        .concat();
        assert_eq!(frame(&code), 64);
        // A register overwritten after `rX = r10` is no stack pointer any more; a helper call clobbers r1-r5.
        let code = [
            insn(MOV64_REG, 4, 10, 0, 0),
            insn(0xb7, 4, 0, 0, 0), // r4 = 0
            insn(ADD64_IMM, 4, 0, 0, -100),
            insn(MOV64_REG, 1, 10, 0, 0),
            insn(CALL, 0, 0, 0, 1),
            insn(ADD64_IMM, 1, 0, 0, -200),
        ]
        .concat();
        assert_eq!(frame(&code), 0);
    }

    #[test]
    fn deepest_chain_sums_rounded_frames() {
        // 0 (program, 96) calls 1 (312) and 2 (0); 1 calls 3 (56); 2 calls 3.
        let funcs = vec![
            func(96, &[1, 2], true),
            func(312, &[3], false),
            func(0, &[3], false),
            func(56, &[], false),
        ];
        let c = deepest(&funcs, 0);
        assert_eq!(c.total, 96 + 320 + 64);
        assert_eq!(c.path, vec![0, 1, 3]);
        assert_eq!(check(&funcs, 512).unwrap().unwrap().1.total, 480);
        let err = check(&funcs, 448).unwrap_err().to_string();
        assert!(
            err.contains("f96: 480 bytes: f96 96->96 > f312 312->320 > f56 56->64"),
            "{err}"
        );
    }

    #[test]
    fn cycles_are_not_followed() {
        let funcs = vec![func(8, &[1], true), func(16, &[0, 1], false)];
        assert_eq!(deepest(&funcs, 0).total, 64);
    }

    #[test]
    fn short_names() {
        assert_eq!(
            short_name(
                "_RINvNtCsfnWAjMDHpRQ_7lb_ebpf4ipv68l4_frameNtNtB4_3ctx2TcECsc7XGJ4jhY0Y_2lb"
            ),
            "lb_ebpf::ipv6::l4_frame::<lb_ebpf::ctx::Tc>"
        );
        assert_eq!(
            short_name("_ZN7lb_ebpf3xdp8l4_frame17h0123456789abcdefE"),
            "lb_ebpf::xdp::l4_frame"
        );
        assert_eq!(short_name("memset"), "memset");
    }
}
