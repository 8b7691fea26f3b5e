//! The on-disk cache of compiled modules: NVRTC output (CUBIN + PTX) keyed by everything that
//! determines it, so a process that loads a module compiled before (by itself or by another
//! process) skips NVRTC. A large kernel source takes NVRTC tens of seconds; a cache hit costs one
//! file read.
//!
//! Where: `$HOLDFAST_KERNEL_CACHE` ([`KERNEL_CACHE_ENV`]; `off` or an empty value disables the
//! cache), else `$XDG_CACHE_HOME/holdfast/kernels`, else `$HOME/.cache/holdfast/kernels`.
//!
//! The key hashes the full source text NVRTC sees (portability header included), the compile
//! options (architecture, warp width, …) and NVRTC's version, so a changed kernel, header, target
//! or compiler is a miss, never a stale hit. An entry is one file: a magic, the two lengths, a
//! checksum of the payload, then the CUBIN and the PTX; one that fails any check is recompiled
//! and replaced. Entries are written to a temporary file and renamed into place, so concurrent
//! processes never see a torn entry. The cache is best effort: a directory that cannot be read or
//! written only costs the compile.

use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::compile::Compiled;

/// Environment variable naming the cache directory (`off` or empty: no cache).
pub const KERNEL_CACHE_ENV: &str = "HOLDFAST_KERNEL_CACHE";

const MAGIC: &[u8; 8] = b"HFKC0001";
const HEADER: usize = 8 + 8 + 8 + 8;

/// The cache directory this process uses, or `None` when it is disabled or no home is known.
pub fn kernel_cache_dir() -> Option<PathBuf> {
    cache_dir_from(|k| std::env::var_os(k))
}

/// [`kernel_cache_dir`] with the environment read through `env`.
fn cache_dir_from(env: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
    match env(KERNEL_CACHE_ENV) {
        Some(v) if v.is_empty() || v == "off" => None,
        Some(v) => Some(PathBuf::from(v)),
        None => {
            env("XDG_CACHE_HOME").filter(|v| !v.is_empty()).map(|v| PathBuf::from(v).join("holdfast/kernels")).or_else(
                || env("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".cache/holdfast/kernels")),
            )
        }
    }
}

fn hash64(salt: u64, parts: &[&[u8]]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    salt.hash(&mut h);
    for p in parts {
        p.len().hash(&mut h);
        p.hash(&mut h);
    }
    h.finish()
}

/// The entry name for `text` compiled with `opts` by NVRTC `version`: 128 bits of hash, in hex.
pub(crate) fn key(text: &str, opts: &[String], version: (i32, i32)) -> String {
    let v = format!("{}.{}", version.0, version.1);
    let o = opts.join("\u{1f}");
    let parts: [&[u8]; 3] = [text.as_bytes(), o.as_bytes(), v.as_bytes()];
    format!("{:016x}{:016x}", hash64(0x6866_6b63_0000_0001, &parts), hash64(0x6866_6b63_0000_0002, &parts))
}

fn entry(dir: &Path, key: &str) -> PathBuf {
    dir.join(format!("{key}.bin"))
}

/// The cached output for `key`, if a complete, intact entry exists.
pub(crate) fn load(dir: &Path, key: &str) -> Option<Compiled> {
    let bytes = std::fs::read(entry(dir, key)).ok()?;
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return None;
    }
    let word = |i: usize| u64::from_le_bytes(bytes[8 + 8 * i..16 + 8 * i].try_into().expect("8 bytes"));
    let (nc, np, sum) = (word(0) as usize, word(1) as usize, word(2));
    if nc.checked_add(np)?.checked_add(HEADER)? != bytes.len() {
        return None;
    }
    let payload = &bytes[HEADER..];
    if hash64(0, &[payload]) != sum {
        return None;
    }
    Some(Compiled { cubin: payload[..nc].to_vec(), ptx: payload[nc..].to_vec() })
}

/// Writes `c` as the entry for `key` (temporary file, then rename); errors are ignored.
pub(crate) fn store(dir: &Path, key: &str, c: &Compiled) {
    let _ = (|| -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let tmp = dir.join(format!(".{key}.{}.{nanos}.tmp", std::process::id()));
        let mut payload = Vec::with_capacity(c.cubin.len() + c.ptx.len());
        payload.extend_from_slice(&c.cubin);
        payload.extend_from_slice(&c.ptx);
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(MAGIC)?;
        f.write_all(&(c.cubin.len() as u64).to_le_bytes())?;
        f.write_all(&(c.ptx.len() as u64).to_le_bytes())?;
        f.write_all(&hash64(0, &[&payload]).to_le_bytes())?;
        f.write_all(&payload)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, entry(dir, key)).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    })();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("holdfast-kcache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn the_directory_follows_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| std::ffi::OsString::from(v))
        };
        let own: &'static [(&str, &str)] = &[(KERNEL_CACHE_ENV, "/tmp/kc"), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")];
        assert_eq!(cache_dir_from(env(own)), Some(PathBuf::from("/tmp/kc")));
        assert_eq!(cache_dir_from(env(&[(KERNEL_CACHE_ENV, "off"), ("HOME", "/h")])), None);
        assert_eq!(cache_dir_from(env(&[(KERNEL_CACHE_ENV, ""), ("HOME", "/h")])), None);
        let xdg = cache_dir_from(env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]));
        assert_eq!(xdg, Some(PathBuf::from("/x/holdfast/kernels")));
        let home = cache_dir_from(env(&[("XDG_CACHE_HOME", ""), ("HOME", "/h")]));
        assert_eq!(home, Some(PathBuf::from("/h/.cache/holdfast/kernels")));
        assert_eq!(cache_dir_from(env(&[])), None);
    }

    #[test]
    fn keys_separate_every_input() {
        let o = vec!["-arch=sm_90".to_string(), "-DHF_WARP_SIZE=32".to_string()];
        let k = key("src", &o, (13, 0));
        assert_eq!(k.len(), 32);
        assert_eq!(k, key("src", &o, (13, 0)));
        assert_ne!(k, key("src2", &o, (13, 0)));
        assert_ne!(k, key("src", &o, (13, 1)));
        assert_ne!(k, key("src", &["-arch=sm_80".to_string(), o[1].clone()], (13, 0)));
        // Option boundaries count: ["ab", "c"] is not ["a", "bc"].
        assert_ne!(key("s", &["ab".into(), "c".into()], (1, 0)), key("s", &["a".into(), "bc".into()], (1, 0)));
    }

    #[test]
    fn entries_round_trip_and_damaged_ones_are_misses() {
        let dir = scratch("rt");
        let c = Compiled { cubin: vec![1, 2, 3, 4, 5], ptx: b"// ptx\0".to_vec() };
        assert!(load(&dir, "k").is_none(), "an empty cache misses");
        store(&dir, "k", &c);
        let got = load(&dir, "k").expect("hit");
        assert_eq!((got.cubin, got.ptx), (c.cubin.clone(), c.ptx.clone()));
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(&dir).expect("dir").map(|e| e.expect("e").file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("k.bin")]);
        // A flipped payload byte, a truncated file and a foreign file are all misses.
        let path = entry(&dir, "k");
        let good = std::fs::read(&path).expect("read");
        let mut bad = good.clone();
        *bad.last_mut().expect("byte") ^= 1;
        std::fs::write(&path, &bad).expect("write");
        assert!(load(&dir, "k").is_none(), "checksum");
        std::fs::write(&path, &good[..good.len() - 1]).expect("write");
        assert!(load(&dir, "k").is_none(), "length");
        std::fs::write(&path, b"not an entry at all, but long enough to have a header").expect("write");
        assert!(load(&dir, "k").is_none(), "magic");
        // Storing again repairs it.
        store(&dir, "k", &c);
        assert!(load(&dir, "k").is_some());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_unwritable_directory_is_only_a_miss() {
        let file = scratch("file");
        std::fs::write(&file, b"x").expect("write");
        let c = Compiled { cubin: vec![9], ptx: vec![0] };
        store(&file, "k", &c); // `file` is not a directory: nothing happens, nothing panics
        assert!(load(&file, "k").is_none());
        let _ = std::fs::remove_file(&file);
    }
}
