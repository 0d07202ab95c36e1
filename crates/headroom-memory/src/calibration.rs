//! Measured workspace calibrations, stored next to the model they were measured on.
//!
//! The activation workspace depends on the engine and backend, not only on the model's shape, so
//! a guess can be off by several MiB (the CPU engine's fixed buffers alone are ~8 MiB for the
//! embedded model). `headroom calibrate` measures it and writes `headroom-calibration.json` in the
//! model folder; planners read it back, keyed by bundle hash and backend, and fall back to the
//! analytic [`Calibration::default`] — saying so — when no matching entry exists.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::footprint::{Calibration, WorkspaceSample};

pub const CALIBRATION_FILE: &str = "headroom-calibration.json";

/// The compute backend a calibration was measured on. `sim` workers compute with ndarray, so they
/// share the CPU entry.
pub fn backend_key(device_label: &str) -> &'static str {
    if device_label.starts_with("cuda") {
        "cuda"
    } else {
        "cpu"
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrationEntry {
    pub bundle_hash: String,
    pub calibration: Calibration,
    pub samples: Vec<WorkspaceSample>,
    /// The largest relative error of the fit over its own samples, in percent.
    pub fit_error_percent: f64,
    pub headroom_version: String,
    pub measured_unix_s: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CalibrationFile {
    /// By backend key (`cpu`, `cuda`).
    pub entries: BTreeMap<String, CalibrationEntry>,
}

/// The calibration a planner should use, and where it came from (shown to users).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResolvedCalibration {
    pub calibration: Calibration,
    pub measured: bool,
    pub source: String,
}

impl CalibrationFile {
    /// Inside a model folder; beside a model file (`NAME.gguf.headroom-calibration.json`).
    pub fn path(model: &Path) -> PathBuf {
        if model.is_file() {
            let mut name = model.file_name().unwrap_or_default().to_os_string();
            name.push(".");
            name.push(CALIBRATION_FILE);
            return model.with_file_name(name);
        }
        model.join(CALIBRATION_FILE)
    }

    pub fn read(model_dir: &Path) -> Result<Option<Self>, String> {
        let path = Self::path(model_dir);
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| format!("{} is not a calibration file ({e}); delete it or rerun `headroom calibrate`", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        }
    }

    /// Adds or replaces the entry for `backend` and writes the file atomically.
    pub fn update(model_dir: &Path, backend: &str, entry: CalibrationEntry) -> Result<PathBuf, String> {
        let mut file = Self::read(model_dir).unwrap_or_default().unwrap_or_default();
        file.entries.insert(backend.to_string(), entry);
        let path = Self::path(model_dir);
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_string_pretty(&file).map_err(|e| e.to_string())?;
        std::fs::write(&tmp, text + "\n")
            .and_then(|_| std::fs::rename(&tmp, &path))
            .map_err(|e| format!("cannot write {}: {e} (is the model folder writable?)", path.display()))?;
        Ok(path)
    }
}

/// The measured calibration for this model and backend, or the analytic default with the reason.
pub fn resolve(model_dir: &Path, bundle_hash: &str, backend: &str) -> ResolvedCalibration {
    let fallback = |why: String| ResolvedCalibration {
        calibration: Calibration::default(),
        measured: false,
        source: format!("analytic default ({why}; run `headroom calibrate --model {}`)", model_dir.display()),
    };
    match CalibrationFile::read(model_dir) {
        Ok(Some(file)) => match file.entries.get(backend) {
            Some(entry) if entry.bundle_hash == bundle_hash => ResolvedCalibration {
                calibration: entry.calibration,
                measured: true,
                source: format!(
                    "measured on {backend} ({} samples, fit within {:.1}%)",
                    entry.samples.len(),
                    entry.fit_error_percent
                ),
            },
            Some(_) => fallback(format!("the {backend} calibration in {CALIBRATION_FILE} is for other weights")),
            None => fallback(format!("no {backend} calibration in {CALIBRATION_FILE}")),
        },
        Ok(None) => fallback(format!("no {CALIBRATION_FILE}")),
        Err(e) => {
            tracing::warn!("{e}");
            fallback(e)
        }
    }
}

/// A planner for `bundle` on `backend` with the best calibration available for it.
pub fn planner_for(
    bundle: &headroom_model::ModelBundle,
    backend: &str,
    config: crate::MemoryConfig,
) -> (crate::Planner, ResolvedCalibration) {
    let resolved = if bundle.config.is_encoder() {
        // `headroom calibrate` measures a decoder's prefill; an encoder's one pass keeps less
        // alive than the default's buffers, which over-predict it.
        ResolvedCalibration { calibration: Calibration::default(), measured: false, source: "analytic default (an encoder's workspace is not calibrated; the default over-predicts it)".into() }
    } else {
        resolve(&bundle.path, &bundle.hash, backend)
    };
    let shape = crate::ModelShape::for_backend(bundle, backend, config.cpu_kv_cache);
    (crate::Planner::new(shape, resolved.calibration, config), resolved)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(hash: &str) -> CalibrationEntry {
        CalibrationEntry {
            bundle_hash: hash.into(),
            calibration: Calibration { score_factor: 1.5, token_factor: 2.0, fixed_bytes: 1000.0, floor_bytes: 0.0 },
            samples: vec![],
            fit_error_percent: 0.5,
            headroom_version: "test".into(),
            measured_unix_s: 0,
        }
    }

    #[test]
    fn measured_entry_is_used_only_for_its_bundle_and_backend() {
        let dir = std::env::temp_dir().join(format!("headroom-calib-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = resolve(&dir, "abc", "cpu");
        assert!(!missing.measured && missing.source.contains("headroom calibrate"));
        CalibrationFile::update(&dir, "cpu", entry("abc")).unwrap();
        let found = resolve(&dir, "abc", "cpu");
        assert!(found.measured);
        assert_eq!(found.calibration.fixed_bytes, 1000.0);
        assert!(!resolve(&dir, "other", "cpu").measured, "stale weights");
        assert!(!resolve(&dir, "abc", "cuda").measured, "other backend");
        CalibrationFile::update(&dir, "cuda", entry("abc")).unwrap();
        assert!(resolve(&dir, "abc", "cpu").measured, "adding cuda keeps cpu");
        std::fs::write(CalibrationFile::path(&dir), "not json").unwrap();
        let broken = resolve(&dir, "abc", "cpu");
        assert!(!broken.measured && broken.source.contains("not a calibration file"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
