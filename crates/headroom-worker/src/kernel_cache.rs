//! Where the CUDA backend keeps compiled kernels and autotune results between processes.
//!
//! cubecl compiles every kernel at first use (NVRTC) and autotunes matmuls per shape; measured on
//! an H200, a fresh process spent ~47 s before its first token. Without a disk cache every GPU
//! worker restart — the breaker's whole recovery path — pays that again, and the restore probe
//! times out before the worker can answer. A `cubecl.toml` the user put in place still wins.

use std::path::PathBuf;

/// `$HEADROOM_CACHE_DIR`, else `$XDG_CACHE_HOME/headroom`, else `~/.cache/headroom`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("HEADROOM_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("headroom");
    }
    std::env::var_os("HOME")
        .map(|home| PathBuf::from(home).join(".cache").join("headroom"))
        .unwrap_or_else(|| std::env::temp_dir().join("headroom-cache"))
}

/// Points cubecl's kernel and autotune caches at [`cache_dir`]`/cubecl`. Call before the first
/// CUDA device is created; later calls do nothing.
#[cfg(feature = "cuda")]
pub fn configure() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use cubecl::config::cache::CacheConfig;
        use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
        let user_file = ["cubecl.toml", "CubeCL.toml", "burn.toml", "Burn.toml"].iter().any(|name| {
            std::env::current_dir()
                .map(|dir| dir.ancestors().any(|d| d.join(name).exists()))
                .unwrap_or(false)
        });
        if user_file {
            tracing::info!("using the cubecl/burn config file found above the working directory");
            return;
        }
        let root = cache_dir().join("cubecl");
        if let Err(e) = std::fs::create_dir_all(&root) {
            tracing::warn!("cannot create the kernel cache {}: {e}; kernels compile in every process", root.display());
            return;
        }
        let mut config = CubeClRuntimeConfig::default().override_from_env();
        config.compilation.cache = Some(CacheConfig::File(root.clone()));
        config.autotune.cache = CacheConfig::File(root);
        // Panics only when the config was read already, i.e. a device exists: nothing to change.
        if std::panic::catch_unwind(|| CubeClRuntimeConfig::set(config)).is_err() {
            tracing::warn!("the CUDA runtime was configured before the kernel cache could be set");
        }
    });
}
