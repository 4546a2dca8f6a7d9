//! Target descriptions: one small TOML file per target in `targets/` (triple, ISA
//! features, vector width, cache sizes, core count), the facts that passes and back ends
//! take as data. `--target` takes a file name (`x86_64-avx512`, `cortex-a72`, `host`) or
//! the path of a `.toml` file; a user adds a board by adding a file.
//!
//! A name is looked up, first match wins, in: `$ONNXC_TARGETS_DIR`; the nearest
//! `targets/` (or `share/onnxc/targets/`) folder among the executable's ancestors; and
//! last the copies of the bundled files embedded in the binary, so that an installed
//! `onnxc` is self-contained.
//!
//! A file with `host = true` (the bundled `host.toml`) is resolved when loaded: triple,
//! ISA features, vector width, core count and (on Linux) cache sizes come from the
//! machine running onnxc; the file's cache sizes are only fallbacks.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A compilation target. Features are normalised when loaded: the prerequisites of a
/// listed feature are added (`avx2` brings `avx`, `sse4.2`, `sse4.1`; `dotprod` brings
/// `neon`), in the order of [`KNOWN_FEATURES`].
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Target {
    /// The target's name; for a file found by name it equals the file stem.
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// A target-lexicon triple, e.g. `x86_64-unknown-linux-gnu`.
    #[serde(default)]
    pub triple: String,
    /// ISA features, from [`KNOWN_FEATURES`] (and `sm_NN` for CUDA targets).
    #[serde(default)]
    pub features: Vec<String>,
    /// Widest vector register the code should use, in bits.
    #[serde(default)]
    pub vector_bits: u32,
    /// Per-core L1 data cache, KiB.
    #[serde(default)]
    pub l1d_kib: u32,
    /// L2 cache, KiB (per core or shared, as the part has it).
    #[serde(default)]
    pub l2_kib: u32,
    /// Last-level L3 cache, KiB; 0 when there is none.
    #[serde(default)]
    pub l3_kib: u32,
    /// Cores to plan tiling and parallel loops for.
    #[serde(default)]
    pub cores: u32,
    /// True for a target detected from the machine running onnxc.
    #[serde(default)]
    pub host: bool,
}

/// ISA feature names a target file may use, with the features each one implies.
pub const KNOWN_FEATURES: &[(&str, &[&str])] = &[
    ("sse4.1", &[]),
    ("sse4.2", &["sse4.1"]),
    ("avx", &["sse4.2"]),
    ("avx2", &["avx"]),
    ("fma", &["avx"]),
    ("f16c", &["avx"]),
    ("avx512f", &["avx2", "fma", "f16c"]),
    ("avx512cd", &["avx512f"]),
    ("avx512dq", &["avx512f"]),
    ("avx512bw", &["avx512f"]),
    ("avx512vl", &["avx512f"]),
    ("avx512vnni", &["avx512f"]),
    ("avx512bf16", &["avx512bw"]),
    ("avx512fp16", &["avx512bw"]),
    ("avxvnni", &["avx2"]),
    ("amx-int8", &["avx512vnni"]),
    ("neon", &[]),
    ("dotprod", &["neon"]),
    ("i8mm", &["neon"]),
    ("fp16", &["neon"]),
    ("bf16", &["neon"]),
    ("sve", &["neon"]),
    ("sve2", &["sve"]),
];

const X86_FEATURES: std::ops::Range<usize> = 0..16;
const ARM_FEATURES: std::ops::Range<usize> = 16..23;

macro_rules! bundled {
    ($($name:literal),* $(,)?) => {
        /// The bundled target files, embedded so that the binary works without them.
        pub const BUNDLED: &[(&str, &str)] = &[
            $(($name, include_str!(concat!("../../targets/", $name, ".toml")))),*
        ];
    };
}
bundled![
    "aarch64-neon",
    "cortex-a53",
    "cortex-a72",
    "host",
    "x86_64-amx",
    "x86_64-avx2",
    "x86_64-avx512",
    "x86_64-sse4"
];

/// Where names are looked up; a value so that tests need not touch the environment.
#[derive(Clone, Debug, Default)]
struct Search {
    env_dir: Option<PathBuf>,
    exe: Option<PathBuf>,
}

impl Search {
    fn from_env() -> Search {
        Search {
            env_dir: std::env::var_os("ONNXC_TARGETS_DIR")
                .filter(|d| !d.is_empty())
                .map(PathBuf::from),
            exe: std::env::current_exe().ok(),
        }
    }

    /// The folders to search, in order.
    fn dirs(&self) -> Vec<PathBuf> {
        let mut dirs = Vec::new();
        if let Some(d) = &self.env_dir {
            dirs.push(d.clone());
        }
        if let Some(exe) = &self.exe {
            let nearest = exe.ancestors().skip(1).find_map(|a| {
                [a.join("targets"), a.join("share/onnxc/targets")]
                    .into_iter()
                    .find(|d| d.is_dir())
            });
            dirs.extend(nearest);
        }
        dirs
    }

    fn describe(&self) -> String {
        let mut places: Vec<String> = self
            .dirs()
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        places.push("the targets built into onnxc".into());
        places.join(", ")
    }
}

impl Target {
    /// Loads a target by name (`x86_64-avx2`, `host`, ...) or from the path of a `.toml`
    /// file (an argument ending in `.toml` or containing a path separator).
    pub fn load(name_or_path: &str) -> Result<Target, String> {
        Self::load_with(name_or_path, &Search::from_env())
    }

    /// The machine running onnxc (the `host` target).
    pub fn host() -> Result<Target, String> {
        Self::load("host")
    }

    /// Every available target as (name, description), sorted by name: the files in the
    /// search folders and the bundled ones. For `onnxc --list-targets`.
    pub fn list() -> Vec<(String, String)> {
        Self::list_with(&Search::from_env())
    }

    pub fn is_x86(&self) -> bool {
        let arch = self.arch();
        arch == "x86_64"
            || arch == "x86"
            || (arch.len() == 4 && arch.starts_with('i') && arch.ends_with("86"))
    }

    pub fn is_aarch64(&self) -> bool {
        matches!(self.arch(), "aarch64" | "arm64" | "aarch64_be")
    }

    /// The architecture: the first component of the triple.
    pub fn arch(&self) -> &str {
        self.triple.split('-').next().unwrap_or("")
    }

    /// Whether the target has an ISA feature (after implied features were added).
    pub fn has(&self, feature: &str) -> bool {
        self.features.iter().any(|f| f == feature)
    }

    fn load_with(arg: &str, search: &Search) -> Result<Target, String> {
        let looks_like_path =
            arg.ends_with(".toml") || arg.contains('/') || arg.contains(std::path::MAIN_SEPARATOR);
        if looks_like_path {
            let path = Path::new(arg);
            if !path.is_file() {
                return Err(format!("target file '{arg}' does not exist"));
            }
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read target file '{arg}': {e}"))?;
            return Self::parse(&text, arg, None);
        }
        if arg.is_empty()
            || !arg
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        {
            return Err(format!(
                "'{arg}' is not a target name; available targets: {}",
                Self::names(search).join(", ")
            ));
        }
        for dir in search.dirs() {
            let file = dir.join(format!("{arg}.toml"));
            if file.is_file() {
                let origin = file.display().to_string();
                let text = std::fs::read_to_string(&file)
                    .map_err(|e| format!("cannot read target file '{origin}': {e}"))?;
                return Self::parse(&text, &origin, Some(arg));
            }
        }
        if let Some((_, text)) = BUNDLED.iter().find(|(n, _)| *n == arg) {
            return Self::parse(text, &format!("built-in target '{arg}'"), Some(arg));
        }
        Err(format!(
            "unknown target '{arg}'; available targets: {}. Pass one of these names or the path of a .toml target file (searched: {})",
            Self::names(search).join(", "),
            search.describe()
        ))
    }

    fn names(search: &Search) -> Vec<String> {
        Self::list_with(search)
            .into_iter()
            .map(|(n, _)| n)
            .collect()
    }

    fn list_with(search: &Search) -> Vec<(String, String)> {
        let mut all = BTreeMap::new();
        for dir in search.dirs() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                if path.extension().and_then(|e| e.to_str()) != Some("toml") {
                    continue;
                }
                let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
                    continue;
                };
                let description = match std::fs::read_to_string(&path)
                    .map_err(|e| e.to_string())
                    .and_then(|t| toml::from_str::<Target>(&t).map_err(|e| e.message().to_string()))
                {
                    Ok(t) => t.description,
                    Err(e) => format!("(invalid target file {}: {e})", path.display()),
                };
                all.entry(stem.to_string()).or_insert(description);
            }
        }
        for (name, text) in BUNDLED {
            let description = toml::from_str::<Target>(text)
                .map(|t| t.description)
                .unwrap_or_default();
            all.entry(name.to_string()).or_insert(description);
        }
        all.into_iter().collect()
    }

    /// Parses, resolves `host = true`, normalises and validates one target file.
    /// `origin` names the file in errors; `expected_name` is the name it was found by.
    fn parse(text: &str, origin: &str, expected_name: Option<&str>) -> Result<Target, String> {
        let mut t: Target =
            toml::from_str(text).map_err(|e| format!("{origin}: {}", e.to_string().trim_end()))?;
        if let Some(expected) = expected_name {
            if t.name != expected {
                return Err(format!(
                    "{origin}: name = \"{}\" but the file is found as '{expected}'; a target's name must match its file name",
                    t.name
                ));
            }
        }
        if t.host {
            t.resolve_host();
        }
        t.normalise_and_validate()
            .map_err(|e| format!("{origin} (target '{}'): {e}", t.name))?;
        Ok(t)
    }

    fn normalise_and_validate(&mut self) -> Result<(), String> {
        if self.name.is_empty() {
            return Err("name is empty".into());
        }
        if self.triple.is_empty() {
            return Err(
                "missing `triple` (e.g. \"x86_64-unknown-linux-gnu\"), or set `host = true`".into(),
            );
        }
        let known = |f: &str| KNOWN_FEATURES.iter().position(|(k, _)| *k == f);
        let is_gpu = |f: &str| {
            f.strip_prefix("sm_")
                .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric()))
        };
        let mut on = [false; KNOWN_FEATURES.len()];
        let mut gpu = Vec::new();
        let mut stack: Vec<usize> = Vec::new();
        for f in &self.features {
            match known(f) {
                Some(i) => stack.push(i),
                None if is_gpu(f) => gpu.push(f.clone()),
                None => {
                    let names: Vec<&str> = KNOWN_FEATURES.iter().map(|(k, _)| *k).collect();
                    return Err(format!(
                        "unknown feature '{f}'; known features: {}, sm_NN",
                        names.join(", ")
                    ));
                }
            }
        }
        let listed =
            |range: std::ops::Range<usize>| stack.iter().copied().find(|i| range.contains(i));
        let wrong = if self.is_x86() {
            listed(ARM_FEATURES).map(|i| (i, "an ARM"))
        } else if self.is_aarch64() {
            listed(X86_FEATURES).map(|i| (i, "an x86"))
        } else {
            None
        };
        if let Some((i, family)) = wrong {
            return Err(format!(
                "feature '{}' is {family} feature but the triple is {}",
                KNOWN_FEATURES[i].0, self.triple
            ));
        }
        while let Some(i) = stack.pop() {
            if !std::mem::replace(&mut on[i], true) {
                stack.extend(KNOWN_FEATURES[i].1.iter().filter_map(|f| known(f)));
            }
        }
        gpu.sort();
        gpu.dedup();
        self.features = KNOWN_FEATURES
            .iter()
            .zip(on)
            .filter(|(_, on)| *on)
            .map(|((k, _), _)| k.to_string())
            .chain(gpu)
            .collect();
        if !(self.vector_bits.is_power_of_two() && (32..=2048).contains(&self.vector_bits)) {
            return Err(format!(
                "vector_bits = {} must be a power of two from 32 to 2048 (128, 256, 512)",
                self.vector_bits
            ));
        }
        if self.cores == 0 {
            return Err("cores must be at least 1".into());
        }
        if self.l1d_kib == 0 {
            return Err("l1d_kib must be at least 1".into());
        }
        Ok(())
    }

    /// Fills in the machine running onnxc: triple, features, vector width, cores and,
    /// where the OS reports them, cache sizes (the file's values stay as fallbacks).
    fn resolve_host(&mut self) {
        self.triple = host_triple();
        self.features = detect_features();
        let has = |f: &str| self.features.iter().any(|x| x == f);
        self.vector_bits = if has("avx512f") {
            512
        } else if has("avx2") || has("avx") {
            256
        } else {
            128
        };
        self.cores = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        let caches = detect_caches_kib();
        for (level, slot) in [
            (1, &mut self.l1d_kib),
            (2, &mut self.l2_kib),
            (3, &mut self.l3_kib),
        ] {
            if let Some(kib) = caches[level - 1] {
                *slot = kib;
            }
        }
        if self.l1d_kib == 0 {
            self.l1d_kib = 32;
        }
    }
}

/// The target-lexicon triple of the machine onnxc runs on (as it was built for).
fn host_triple() -> String {
    let arch = std::env::consts::ARCH;
    let rest = if cfg!(target_os = "linux") {
        if cfg!(target_env = "musl") {
            "unknown-linux-musl".to_string()
        } else {
            "unknown-linux-gnu".to_string()
        }
    } else if cfg!(target_os = "macos") {
        "apple-darwin".to_string()
    } else if cfg!(target_os = "windows") {
        if cfg!(target_env = "gnu") {
            "pc-windows-gnu".to_string()
        } else {
            "pc-windows-msvc".to_string()
        }
    } else {
        format!("unknown-{}", std::env::consts::OS)
    };
    format!("{arch}-{rest}")
}

#[cfg(target_arch = "x86_64")]
fn detect_features() -> Vec<String> {
    let mut found = Vec::new();
    macro_rules! probe {
        ($($f:tt),*) => {$(
            if std::arch::is_x86_feature_detected!($f) {
                found.push($f.to_string());
            }
        )*};
    }
    probe!(
        "sse4.1",
        "sse4.2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512cd",
        "avx512dq",
        "avx512bw",
        "avx512vl",
        "avx512vnni",
        "avx512bf16",
        "avx512fp16",
        "avxvnni"
    );
    if amx_int8() {
        found.push("amx-int8".to_string());
    }
    found
}

/// AMX tiles with 8-bit products, by CPUID (std's detection of AMX is unstable): the CPU
/// has AMX-TILE and AMX-INT8 (leaf 7 EDX bits 24 and 25) and the OS saves the tile
/// state (XCR0 bits 17 and 18). A program still asks Linux for the tile state before
/// its first tile instruction (`arch_prctl(ARCH_REQ_XCOMP_PERM)`; the generated
/// kernels do).
#[cfg(target_arch = "x86_64")]
fn amx_int8() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count, _xgetbv};
    let leaf1 = __cpuid(1);
    let osxsave = leaf1.ecx & (1 << 27) != 0;
    if !osxsave || __cpuid(0).eax < 7 {
        return false;
    }
    let leaf7 = __cpuid_count(7, 0);
    if leaf7.edx & (3 << 24) != 3 << 24 {
        return false;
    }
    // SAFETY: xgetbv(0) is available when CPUID reports OSXSAVE, checked above.
    let xcr0 = unsafe { _xgetbv(0) };
    xcr0 & (3 << 17) == 3 << 17
}

#[cfg(target_arch = "aarch64")]
fn detect_features() -> Vec<String> {
    let mut found = Vec::new();
    macro_rules! probe {
        ($($f:tt),*) => {$(
            if std::arch::is_aarch64_feature_detected!($f) {
                found.push($f.to_string());
            }
        )*};
    }
    probe!("neon", "dotprod", "i8mm", "fp16", "bf16", "sve", "sve2");
    found
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn detect_features() -> Vec<String> {
    Vec::new()
}

/// L1 data, L2 and L3 sizes in KiB of CPU 0, from Linux sysfs; `None` where unknown.
fn detect_caches_kib() -> [Option<u32>; 3] {
    let mut out = [None; 3];
    let base = Path::new("/sys/devices/system/cpu/cpu0/cache");
    for i in 0..16 {
        let dir = base.join(format!("index{i}"));
        let read = |f: &str| {
            std::fs::read_to_string(dir.join(f))
                .ok()
                .map(|s| s.trim().to_string())
        };
        let (Some(level), Some(kind), Some(size)) = (read("level"), read("type"), read("size"))
        else {
            continue;
        };
        let Ok(level) = level.parse::<usize>() else {
            continue;
        };
        if !(1..=3).contains(&level) || kind == "Instruction" {
            continue;
        }
        if let Some(kib) = parse_cache_size(&size) {
            out[level - 1] = Some(kib);
        }
    }
    out
}

/// Parses a sysfs cache size ("32K", "1024K", "32M") into KiB.
fn parse_cache_size(s: &str) -> Option<u32> {
    let (num, scale) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 1),
        b'M' | b'm' => (&s[..s.len() - 1], 1024),
        b'G' | b'g' => (&s[..s.len() - 1], 1024 * 1024),
        _ => (s, 0),
    };
    let n: u32 = num.parse().ok()?;
    if scale == 0 {
        Some(n / 1024)
    } else {
        n.checked_mul(scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo_targets() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../targets")
    }

    /// Only the embedded copies: no folder to search.
    fn embedded_only() -> Search {
        Search {
            env_dir: None,
            exe: Some(PathBuf::from("/nonexistent/bin/onnxc")),
        }
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn every_bundled_target_loads() {
        for (name, _) in BUNDLED {
            let t = Target::load_with(name, &embedded_only()).unwrap();
            assert_eq!(t.name, *name);
            assert!(!t.description.is_empty(), "{name}");
            assert!(
                t.cores >= 1 && t.l1d_kib >= 1 && t.l2_kib >= 1,
                "{name}: {t:?}"
            );
        }
        let t = Target::load_with("x86_64-avx512", &embedded_only()).unwrap();
        assert!(t.is_x86() && !t.is_aarch64());
        assert_eq!(t.triple, "x86_64-unknown-linux-gnu");
        assert_eq!(t.vector_bits, 512);
        for f in [
            "sse4.1",
            "avx",
            "avx2",
            "fma",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512vnni",
        ] {
            assert!(t.has(f), "{f}");
        }
        assert!(!t.has("neon"));
        let t = Target::load_with("x86_64-sse4", &embedded_only()).unwrap();
        assert_eq!(
            (t.vector_bits, t.has("sse4.1"), t.has("avx")),
            (128, true, false)
        );
        let t = Target::load_with("cortex-a72", &embedded_only()).unwrap();
        assert!(t.is_aarch64() && t.has("neon") && !t.has("dotprod"));
        assert_eq!(
            (
                t.triple.as_str(),
                t.vector_bits,
                t.l2_kib,
                t.l3_kib,
                t.cores
            ),
            ("aarch64-unknown-linux-gnu", 128, 1024, 0, 4)
        );
    }

    #[test]
    fn embedded_copies_match_the_targets_folder() {
        let mut on_disk: Vec<String> = std::fs::read_dir(repo_targets())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .map(|p| p.file_stem().unwrap().to_str().unwrap().to_string())
            .collect();
        on_disk.sort();
        let bundled: Vec<String> = BUNDLED.iter().map(|(n, _)| n.to_string()).collect();
        assert_eq!(
            on_disk, bundled,
            "add every targets/*.toml to bundled![] in targets.rs"
        );
        for (name, text) in BUNDLED {
            assert_eq!(
                std::fs::read_to_string(repo_targets().join(format!("{name}.toml"))).unwrap(),
                *text
            );
        }
    }

    #[test]
    fn list_names_every_target_with_its_description() {
        let list = Target::list_with(&embedded_only());
        let names: Vec<&str> = list.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "aarch64-neon",
                "cortex-a53",
                "cortex-a72",
                "host",
                "x86_64-amx",
                "x86_64-avx2",
                "x86_64-avx512",
                "x86_64-sse4"
            ]
        );
        assert!(list.iter().all(|(_, d)| !d.is_empty()));
        // The real search (test binary under target/, so the repo's targets/ is found).
        assert!(Target::list().iter().any(|(n, _)| n == "cortex-a53"));
    }

    #[test]
    fn search_order_env_dir_then_exe_folder_then_embedded() {
        let env = tempfile::tempdir().unwrap();
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("bin")).unwrap();
        std::fs::create_dir_all(root.path().join("targets")).unwrap();
        let board = "name = \"myboard\"\ndescription = \"a board\"\ntriple = \"aarch64-unknown-linux-gnu\"\nfeatures = [\"dotprod\"]\nvector_bits = 128\nl1d_kib = 64\nl2_kib = 2048\ncores = 8\n";
        write(&root.path().join("targets"), "myboard.toml", board);
        let overridden = BUNDLED
            .iter()
            .find(|(n, _)| *n == "x86_64-avx2")
            .unwrap()
            .1
            .replace(
                "description = \"x86-64-v3",
                "description = \"overridden x86-64-v3",
            );
        write(env.path(), "x86_64-avx2.toml", &overridden);
        let search = Search {
            env_dir: Some(env.path().into()),
            exe: Some(root.path().join("bin/onnxc")),
        };

        let t = Target::load_with("myboard", &search).unwrap();
        assert_eq!(t.features, ["neon", "dotprod"], "implied neon added");
        assert_eq!((t.l1d_kib, t.l2_kib, t.l3_kib, t.cores), (64, 2048, 0, 8));
        assert!(Target::load_with("x86_64-avx2", &search)
            .unwrap()
            .description
            .starts_with("overridden"));
        assert!(!Target::load_with("x86_64-avx2", &embedded_only())
            .unwrap()
            .description
            .starts_with("overridden"));
        assert_eq!(
            Target::load_with("cortex-a53", &search).unwrap().name,
            "cortex-a53",
            "embedded fallback"
        );
        let list = Target::list_with(&search);
        assert!(list.contains(&("myboard".into(), "a board".into())));
        assert!(list
            .iter()
            .any(|(n, d)| n == "x86_64-avx2" && d.starts_with("overridden")));
        assert_eq!(list.len(), BUNDLED.len() + 1);
        // The real environment finds the repo's targets/ next to the test binary.
        assert_eq!(Target::load("x86_64-avx2").unwrap().vector_bits, 256);
    }

    #[test]
    fn loads_a_file_by_path() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            dir.path(),
            "any-name.toml",
            "name = \"jetson\"\ntriple = \"aarch64-unknown-linux-gnu\"\nfeatures = [\"neon\", \"i8mm\", \"sm_87\"]\nvector_bits = 128\nl1d_kib = 64\nl2_kib = 256\nl3_kib = 2048\ncores = 6\n",
        );
        let t = Target::load_with(p.to_str().unwrap(), &embedded_only()).unwrap();
        assert_eq!(t.name, "jetson", "by path, the file name need not match");
        assert_eq!(t.features, ["neon", "i8mm", "sm_87"]);
        let err = Target::load_with("/no/such/target.toml", &embedded_only()).unwrap_err();
        assert!(
            err.contains("/no/such/target.toml") && err.contains("does not exist"),
            "{err}"
        );
    }

    #[test]
    fn unknown_target_lists_the_available_ones() {
        let err = Target::load_with("x86_64-avx9000", &embedded_only()).unwrap_err();
        assert!(err.contains("unknown target 'x86_64-avx9000'"), "{err}");
        for (name, _) in BUNDLED {
            assert!(err.contains(name), "{err}");
        }
        assert!(Target::load_with("..", &embedded_only())
            .unwrap_err()
            .contains("available targets"));
    }

    #[test]
    fn bad_files_are_named_and_explained() {
        let dir = tempfile::tempdir().unwrap();
        let search = Search {
            env_dir: Some(dir.path().into()),
            exe: None,
        };
        let base = "triple = \"x86_64-unknown-linux-gnu\"\nvector_bits = 256\nl1d_kib = 32\nl2_kib = 256\ncores = 2\n";
        let cases = [
            (
                "typo",
                format!("name = \"typo\"\n{base}features = [\"avx3\"]\n"),
                "unknown feature 'avx3'",
            ),
            (
                "mixed",
                format!("name = \"mixed\"\n{base}features = [\"avx2\", \"neon\"]\n"),
                "'neon' is an ARM feature",
            ),
            (
                "field",
                format!("name = \"field\"\n{base}vector_bytes = 3\n"),
                "vector_bytes",
            ),
            (
                "width",
                format!("name = \"width\"\n{}", base.replace("256\n", "100\n")),
                "vector_bits = 100",
            ),
            (
                "copied",
                format!("name = \"x86_64-avx2\"\n{base}"),
                "must match its file name",
            ),
            (
                "notriple",
                "name = \"notriple\"\nvector_bits = 128\nl1d_kib = 32\ncores = 1\n".into(),
                "missing `triple`",
            ),
        ];
        for (name, text, want) in cases {
            write(dir.path(), &format!("{name}.toml"), &text);
            let err = Target::load_with(name, &search).unwrap_err();
            assert!(
                err.contains(want) && err.contains(&format!("{name}.toml")),
                "{name}: {err}"
            );
        }
        let arm = "name = \"arm\"\ntriple = \"aarch64-unknown-linux-gnu\"\nfeatures = [\"avx2\"]\nvector_bits = 128\nl1d_kib = 32\ncores = 1\n";
        write(dir.path(), "arm.toml", arm);
        assert!(Target::load_with("arm", &search)
            .unwrap_err()
            .contains("'avx2' is an x86 feature"));
    }

    #[test]
    fn host_is_detected() {
        let t = Target::load_with("host", &embedded_only()).unwrap();
        assert!(t.host);
        assert_eq!(t.name, "host");
        assert!(t.triple.starts_with(std::env::consts::ARCH), "{}", t.triple);
        assert_eq!(
            t.cores as usize,
            std::thread::available_parallelism().unwrap().get()
        );
        assert!(t.l1d_kib >= 1);
        #[cfg(target_arch = "x86_64")]
        {
            assert!(t.is_x86());
            assert_eq!(t.has("avx2"), std::arch::is_x86_feature_detected!("avx2"));
            assert_eq!(t.has("fma"), std::arch::is_x86_feature_detected!("fma"));
            assert_eq!(
                t.has("avx512f"),
                std::arch::is_x86_feature_detected!("avx512f")
            );
            assert_eq!(
                t.has("avx512vnni"),
                std::arch::is_x86_feature_detected!("avx512vnni")
            );
            let want = if std::arch::is_x86_feature_detected!("avx512f") {
                512
            } else if std::arch::is_x86_feature_detected!("avx") {
                256
            } else {
                128
            };
            assert_eq!(t.vector_bits, want);
        }
        #[cfg(target_arch = "aarch64")]
        {
            assert!(t.is_aarch64() && t.has("neon") && t.vector_bits == 128);
        }
        if let Some(l1) = detect_caches_kib()[0] {
            assert_eq!(t.l1d_kib, l1);
        }
    }

    #[test]
    fn cache_sizes_parse() {
        assert_eq!(parse_cache_size("32K"), Some(32));
        assert_eq!(parse_cache_size("32M"), Some(32768));
        assert_eq!(parse_cache_size("65536"), Some(64));
        assert_eq!(parse_cache_size("K"), None);
        assert_eq!(parse_cache_size(""), None);
    }
}
