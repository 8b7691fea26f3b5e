//! What a compiled kernel costs, read from its CUBIN: registers and local memory per thread, and
//! static shared memory per block (the size of its `.nv.shared.<kernel>` section).
//!
//! A CUBIN is an ELF64 file. Its `.nv.info` section holds attribute records (a format byte, an
//! attribute byte, then a 2-byte value or a 2-byte length and that many bytes); the records that
//! describe one function carry its `.symtab` index first. The ones read here:
//! `EIATTR_REGCOUNT` (registers per thread, present for kernels only), `EIATTR_FRAME_SIZE`
//! (bytes of the function's local-memory frame: register spills and local arrays) and
//! `EIATTR_MAX_STACK_SIZE` (bytes of stack, calls included). All of it is known after NVRTC
//! compiled the source, so these checks run without a GPU.

use crate::error::{HalError, Result};

/// `SHT_NOBITS`: a section that occupies no bytes of the file.
const SHT_NOBITS: u32 = 8;
/// `EIATTR_REGCOUNT`.
const REGCOUNT: u8 = 0x2f;
/// `EIATTR_FRAME_SIZE`.
const FRAME_SIZE: u8 = 0x11;
/// `EIATTR_MAX_STACK_SIZE`.
const MAX_STACK_SIZE: u8 = 0x12;
/// `EIFMT_SVAL`: a 2-byte length, then that many bytes.
const FMT_SVAL: u8 = 0x04;
/// `EIFMT_NVAL`, `EIFMT_BVAL` and `EIFMT_HVAL`: records of four bytes (the value, if any, in the
/// last two).
const FMT_SHORT: [u8; 3] = [0x01, 0x02, 0x03];

/// One kernel's per-thread resources, as compiled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelResources {
    /// The kernel's name (its entry point).
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of local memory per thread for the kernel's own frame: register spills and local
    /// arrays. 0 when everything stays in registers.
    pub frame_bytes: u32,
    /// Bytes of stack per thread, the deepest call chain included (0 when every call was inlined
    /// and nothing spills).
    pub stack_bytes: u32,
    /// Bytes of static shared memory per block (its `.nv.shared.<name>` section; on sm_90 this
    /// includes the 1 KiB the system reserves per block), 0 where the CUBIN has none.
    pub static_shared_bytes: u64,
}

fn bad(what: impl std::fmt::Display) -> HalError {
    HalError::Unsupported(format!("not a readable CUBIN: {what}"))
}

fn bytes<'a>(d: &'a [u8], at: usize, n: usize, what: &str) -> Result<&'a [u8]> {
    at.checked_add(n)
        .and_then(|end| d.get(at..end))
        .ok_or_else(|| bad(format!("{what} at byte {at} runs past the end")))
}
fn u16_at(d: &[u8], at: usize, what: &str) -> Result<u16> {
    Ok(u16::from_le_bytes(bytes(d, at, 2, what)?.try_into().map_err(|_| bad(what))?))
}
fn u32_at(d: &[u8], at: usize, what: &str) -> Result<u32> {
    Ok(u32::from_le_bytes(bytes(d, at, 4, what)?.try_into().map_err(|_| bad(what))?))
}
fn u64_at(d: &[u8], at: usize, what: &str) -> Result<u64> {
    Ok(u64::from_le_bytes(bytes(d, at, 8, what)?.try_into().map_err(|_| bad(what))?))
}
fn usize_of(v: u64, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| bad(format!("{what} {v} does not fit this host")))
}

/// A section: file offset and size in the file, and its size in memory, bytes.
#[derive(Clone, Copy)]
struct Section {
    name: u32,
    offset: usize,
    size: usize,
    mem_size: u64,
    link: u32,
}

/// The NUL-terminated string at `at` of the string table `table`.
fn c_str(d: &[u8], table: Section, at: u32) -> Result<&str> {
    let start = table.offset.checked_add(at as usize).ok_or_else(|| bad("a string offset overflows"))?;
    let end = table.offset + table.size;
    let s = d.get(start..end.min(d.len())).ok_or_else(|| bad(format!("string {at} lies outside its table")))?;
    let n = s.iter().position(|&b| b == 0).ok_or_else(|| bad(format!("string {at} is not terminated")))?;
    std::str::from_utf8(&s[..n]).map_err(|_| bad(format!("string {at} is not UTF-8")))
}

/// Every kernel of the CUBIN `cubin` (what [`super::compile`] returns first) with its registers,
/// local-memory frame and stack per thread, in the order the CUBIN lists them. An error (never a
/// panic) says what is wrong with a file that is not a 64-bit little-endian ELF CUBIN or whose
/// tables run past its end.
pub fn kernel_resources(cubin: &[u8]) -> Result<Vec<KernelResources>> {
    let d = cubin;
    if bytes(d, 0, 4, "the ELF magic")? != b"\x7fELF" {
        return Err(bad("no ELF magic"));
    }
    if bytes(d, 4, 2, "the ELF class")? != [2, 1] {
        return Err(bad("not a 64-bit little-endian ELF file"));
    }
    let shoff = usize_of(u64_at(d, 0x28, "the section header offset")?, "section header offset")?;
    let shentsize = u16_at(d, 0x3a, "the section header size")? as usize;
    let shnum = u16_at(d, 0x3c, "the section count")? as usize;
    let shstrndx = u16_at(d, 0x3e, "the section name table index")? as usize;
    if shentsize < 0x40 {
        return Err(bad(format!("section headers of {shentsize} bytes")));
    }
    let mut sections = Vec::with_capacity(shnum);
    for i in 0..shnum {
        let at = shoff.checked_add(i * shentsize).ok_or_else(|| bad("the section headers overflow"))?;
        let mem_size = u64_at(d, at + 0x20, "a section size")?;
        let nobits = u32_at(d, at + 4, "a section type")? == SHT_NOBITS;
        let s = Section {
            name: u32_at(d, at, "a section name")?,
            offset: usize_of(u64_at(d, at + 0x18, "a section offset")?, "section offset")?,
            // Shared memory and the like occupy no bytes of the file.
            size: if nobits { 0 } else { usize_of(mem_size, "section size")? },
            mem_size,
            link: u32_at(d, at + 0x28, "a section link")?,
        };
        bytes(d, s.offset, s.size, "a section")?;
        sections.push(s);
    }
    let names = *sections.get(shstrndx).ok_or_else(|| bad(format!("no section {shstrndx} for the section names")))?;
    let mut symtab = None;
    let mut info = None;
    let mut shared: Vec<(&str, u64)> = Vec::new();
    for s in &sections {
        match c_str(d, names, s.name)? {
            ".symtab" => symtab = Some(*s),
            ".nv.info" => info = Some(*s),
            n => {
                if let Some(kernel) = n.strip_prefix(".nv.shared.") {
                    shared.push((kernel, s.mem_size));
                }
            }
        }
    }
    let symtab = symtab.ok_or_else(|| bad("no .symtab section"))?;
    let strtab = *sections.get(symtab.link as usize).ok_or_else(|| bad("the .symtab's string table is missing"))?;
    let symbol = |index: u32| -> Result<&str> {
        let at = (index as usize)
            .checked_mul(24)
            .filter(|&o| o < symtab.size)
            .ok_or_else(|| bad(format!("no symbol {index}")))?;
        c_str(d, strtab, u32_at(d, symtab.offset + at, "a symbol name")?)
    };
    let Some(info) = info else { return Ok(Vec::new()) };
    // Per function symbol: registers (kernels only), frame and stack.
    let mut found: Vec<(u32, Option<u32>, u32, u32)> = Vec::new();
    let mut at = info.offset;
    let end = info.offset + info.size;
    while at + 4 <= end {
        let (format, attribute) = (d[at], d[at + 1]);
        if FMT_SHORT.contains(&format) {
            at += 4;
            continue;
        }
        if format != FMT_SVAL {
            return Err(bad(format!("an .nv.info record of format {format:#x} at byte {at}")));
        }
        let len = u16_at(d, at + 2, "an .nv.info record length")? as usize;
        let value = bytes(d, at + 4, len, "an .nv.info record")?;
        if matches!(attribute, REGCOUNT | FRAME_SIZE | MAX_STACK_SIZE) && len == 8 {
            let sym = u32::from_le_bytes([value[0], value[1], value[2], value[3]]);
            let v = u32::from_le_bytes([value[4], value[5], value[6], value[7]]);
            let i = match found.iter().position(|f| f.0 == sym) {
                Some(i) => i,
                None => {
                    found.push((sym, None, 0, 0));
                    found.len() - 1
                }
            };
            match attribute {
                REGCOUNT => found[i].1 = Some(v),
                FRAME_SIZE => found[i].2 = v,
                _ => found[i].3 = v,
            }
        }
        at += 4 + len;
    }
    found
        .into_iter()
        .filter_map(|(sym, regs, frame, stack)| regs.map(|r| (sym, r, frame, stack)))
        .map(|(sym, registers, frame_bytes, stack_bytes)| {
            let name = symbol(sym)?;
            let static_shared_bytes = shared.iter().find(|(k, _)| *k == name).map_or(0, |&(_, b)| b);
            Ok(KernelResources { name: name.to_string(), registers, frame_bytes, stack_bytes, static_shared_bytes })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_not_a_cubin_is_an_error_that_says_why() {
        let err = |d: &[u8]| kernel_resources(d).expect_err("not a cubin").to_string();
        assert!(err(b"").contains("the ELF magic at byte 0 runs past the end"), "{}", err(b""));
        assert!(err(b"MZ\x90\x00 not an elf").contains("no ELF magic"));
        assert!(err(b"\x7fELF\x01\x01").contains("not a 64-bit little-endian"));
        // A header whose section table lies past the end.
        let mut h = vec![0u8; 0x40];
        h[..6].copy_from_slice(b"\x7fELF\x02\x01");
        h[0x28..0x30].copy_from_slice(&0x1000u64.to_le_bytes());
        h[0x3a..0x3c].copy_from_slice(&0x40u16.to_le_bytes());
        h[0x3c..0x3e].copy_from_slice(&1u16.to_le_bytes());
        assert!(err(&h).contains("runs past the end"), "{}", err(&h));
        // No sections at all: no section names either.
        h[0x3c..0x3e].copy_from_slice(&0u16.to_le_bytes());
        assert!(err(&h).contains("no section 0 for the section names"), "{}", err(&h));
    }
}
