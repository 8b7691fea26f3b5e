//! Finding and opening NCCL at run time.
//!
//! The types and constants come from cudarc's NCCL bindings (generated from `nccl.h`), but the
//! library is opened here: cudarc looks for NCCL only under the names `libnccl.so`,
//! `libnccl.so.<CUDA major>` and a few others, never under its real SONAME `libnccl.so.2`, which
//! is all that the Debian packages without `-dev` and the pip wheels (`nvidia-nccl-cu12`,
//! `nvidia-nccl-cu13`, as installed with PyTorch) provide, and it panics when its search fails.
//! So the HAL resolves the few entry points it calls itself, from the first library found in:
//! the directories (or files) listed in `$HOLDFAST_NCCL_PATH`, the system loader path, CUDA's
//! library folders, and the `nvidia/nccl/lib` folder of the Python environments it can see.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t};

/// Environment variable: extra directories (or library files), `:`-separated, searched first.
pub(crate) const NCCL_PATH_ENV: &str = "HOLDFAST_NCCL_PATH";

/// Oldest NCCL with `ncclBfloat16` (2.10.0, encoded as NCCL does: major·10000 + minor·100 + patch).
const MIN_VERSION: c_int = 21000;

const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

type Collective = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    ncclComm_t,
    cudaStream_t,
) -> c_int;
type Gather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclComm_t, cudaStream_t) -> c_int;

/// The NCCL entry points the HAL uses. Results are read as plain `c_int` (`ncclResult_t` is a C
/// enum), so a code newer than the bindings cannot be an invalid Rust enum value.
pub(crate) struct Nccl {
    _lib: libloading::Library,
    /// Where it was loaded from.
    pub(crate) path: String,
    /// `ncclGetVersion`'s value, e.g. 22703 for 2.27.3.
    pub(crate) version: c_int,
    pub(crate) comm_init_all: unsafe extern "C" fn(*mut ncclComm_t, c_int, *const c_int) -> c_int,
    pub(crate) comm_destroy: unsafe extern "C" fn(ncclComm_t) -> c_int,
    pub(crate) all_reduce: Collective,
    pub(crate) reduce_scatter: Collective,
    pub(crate) all_gather: Gather,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    get_last_error: Option<unsafe extern "C" fn(ncclComm_t) -> *const c_char>,
}

impl Nccl {
    /// NCCL's description of `code`, with the comm's last error message where NCCL keeps one.
    pub(crate) fn describe(&self, code: c_int, comm: ncclComm_t) -> String {
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let mut s = unsafe { cstr((self.get_error_string)(code)) };
        if let Some(last) = self.get_last_error {
            // SAFETY: `comm` is null or a live communicator; NCCL returns a NUL-terminated string.
            let detail = unsafe { cstr(last(comm)) };
            if !detail.is_empty() {
                s = format!("{s}: {detail}");
            }
        }
        s
    }
}

/// # Safety
/// `p` is null or points at a NUL-terminated string that stays valid during the call.
unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: per this function's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The loaded library, or why it could not be loaded (what was searched).
pub(crate) fn load() -> Result<&'static Nccl, String> {
    static NCCL: OnceLock<Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(find).as_ref().map_err(Clone::clone)
}

/// Directories searched after `$HOLDFAST_NCCL_PATH` and the system loader, in order.
fn search_dirs() -> Vec<PathBuf> {
    // The CUDA libraries' places first, then NCCL's own and the system's.
    let mut dirs = super::loader::search_dirs();
    for d in ["/usr/local/nccl/lib", "/usr/lib64", "/usr/local/lib"] {
        dirs.push(PathBuf::from(d));
    }
    dirs.push(PathBuf::from(format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH)));
    // Python environments: the active virtualenv or conda env, the prefix of every `bin` folder on
    // PATH (where `python3` lives), the system and user prefixes.
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var) {
            prefixes.push(PathBuf::from(v));
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for bin in std::env::split_paths(&path) {
            if bin.ends_with("bin") {
                if let Some(prefix) = bin.parent() {
                    prefixes.push(prefix.to_path_buf());
                }
            }
        }
    }
    prefixes.push(PathBuf::from("/usr/local"));
    prefixes.push(PathBuf::from("/usr"));
    if let Some(home) = std::env::var_os("HOME") {
        prefixes.push(PathBuf::from(home).join(".local"));
    }
    for prefix in prefixes {
        for lib in ["lib", "lib64"] {
            let Ok(entries) = std::fs::read_dir(prefix.join(lib)) else { continue };
            let mut pythons: Vec<PathBuf> = entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
                .map(|e| e.path())
                .collect();
            pythons.sort();
            for py in pythons {
                for site in ["site-packages", "dist-packages"] {
                    dirs.push(py.join(site).join("nvidia/nccl/lib"));
                }
            }
        }
    }
    let mut unique = Vec::new();
    for d in dirs {
        if !unique.contains(&d) {
            unique.push(d);
        }
    }
    unique
}

fn find() -> Result<Nccl, String> {
    let mut failures = Vec::new();
    let mut candidates: Vec<PathBuf> = Vec::new();
    let env = std::env::var_os(NCCL_PATH_ENV);
    if let Some(v) = &env {
        for entry in std::env::split_paths(v) {
            if entry.is_file() {
                candidates.push(entry);
            } else {
                candidates.extend(NAMES.iter().map(|n| entry.join(n)));
            }
        }
    }
    // Bare names: the system loader's own search (LD_LIBRARY_PATH, ld.so.cache, default dirs).
    candidates.extend(NAMES.iter().map(PathBuf::from));
    let dirs = search_dirs();
    for d in &dirs {
        candidates.extend(NAMES.iter().map(|n| d.join(n)));
    }
    for c in &candidates {
        if c.is_absolute() && !c.exists() {
            continue;
        }
        match open(c) {
            Ok(nccl) => return Ok(nccl),
            Err(Some(why)) => failures.push(why),
            Err(None) => {}
        }
    }
    let env_part = match &env {
        Some(v) => format!("${NCCL_PATH_ENV} ({})", v.to_string_lossy()),
        None => format!("${NCCL_PATH_ENV} (unset)"),
    };
    let dirs: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    let mut reason = format!(
        "NCCL (libnccl.so.2, 2.10 or newer) was not found; searched {env_part}, the system loader path for {}, \
         then {}",
        NAMES.join(" and "),
        dirs.join(", ")
    );
    if !failures.is_empty() {
        reason.push_str(&format!("; rejected: {}", failures.join("; ")));
    }
    Err(reason)
}

/// Opens `path` and resolves every entry point. `Err(None)`: nothing there; `Err(Some(why))`: a
/// library that is not a usable NCCL.
fn open(path: &Path) -> Result<Nccl, Option<String>> {
    // SAFETY: loading a shared library runs its initialisers; this is NVIDIA's NCCL, loaded the way
    // the system loader would load it for a program linked against it.
    let lib = match unsafe { libloading::Library::new(path) } {
        Ok(lib) => lib,
        Err(e) if path.is_absolute() => return Err(Some(format!("{}: {e}", path.display()))),
        Err(_) => return Err(None),
    };
    let shown = path.display().to_string();
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol is NCCL's C entry point of that name, and the type it is read as is
            // the signature `nccl.h` declares for it (with `ncclResult_t` read as `c_int`).
            match unsafe { lib.get(concat!($name, "\0").as_bytes()) } {
                Ok(f) => *f,
                Err(e) => return Err(Some(format!("{shown}: no `{}` ({e})", $name))),
            }
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> c_int = sym!("ncclGetVersion");
    let mut version: c_int = 0;
    // SAFETY: out-parameter.
    let rc = unsafe { get_version(&mut version) };
    if rc != 0 || version < MIN_VERSION {
        return Err(Some(format!("{shown}: NCCL version code {version} (2.10.0 = {MIN_VERSION} or newer is needed)")));
    }
    let get_last_error = {
        // SAFETY: as in `sym!` (ncclGetLastError exists since NCCL 2.13; optional).
        match unsafe { lib.get::<unsafe extern "C" fn(ncclComm_t) -> *const c_char>(b"ncclGetLastError\0") } {
            Ok(f) => Some(*f),
            Err(_) => None,
        }
    };
    Ok(Nccl {
        comm_init_all: sym!("ncclCommInitAll"),
        comm_destroy: sym!("ncclCommDestroy"),
        all_reduce: sym!("ncclAllReduce"),
        reduce_scatter: sym!("ncclReduceScatter"),
        all_gather: sym!("ncclAllGather"),
        get_error_string: sym!("ncclGetErrorString"),
        get_last_error,
        version,
        path: shown,
        _lib: lib,
    })
}
