//! The settings a person changes while Headroom runs (the desktop app's settings screen, `PATCH
//! /v1/settings`): what each one is, how a change is validated, and where they persist. Applying
//! them is the dispatcher's and the supervisor's job ([`crate::Dispatcher::update_settings`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Everything the settings screen shows. Saved as JSON next to the journal; on start the saved
/// file overrides the config file, and command-line flags override both for that run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// VRAM kept free for other programs, in MiB; null: automatic (the config's percent and
    /// minimum). Applied to the next admission.
    pub vram_reserve_mib: Option<u64>,
    /// Send nothing to the GPU: running GPU requests finish, then the GPU worker exits and frees
    /// its VRAM; new requests go to the CPU worker. Unpausing starts the GPU worker again.
    pub gpu_paused: bool,
    /// A smaller model folder for the CPU worker; null: the served model. Applied by starting a
    /// new CPU worker beside the old one and switching when it is ready.
    pub fallback_model: Option<PathBuf>,
    /// Requests the CPU worker generates at once (1 to 16). Applied like `fallback_model`.
    pub cpu_max_concurrency: u32,
    /// The CPU worker's context limit (prompt + max_tokens), 64 to 131072 tokens. Applied like
    /// `fallback_model`.
    pub cpu_max_context_tokens: u32,
    /// The CUDA device index of the GPU worker. Takes effect at the next start.
    pub gpu_device: u32,
    /// Transformer layers the GPU holds: "auto" (as many as fit, the rest run on the CPU) or a
    /// count (0: all on the CPU); null: the config's `[memory] gpu_layers`. Takes effect at the
    /// next start.
    pub gpu_layers: Option<headroom_memory::GpuLayers>,
}

impl Default for Settings {
    fn default() -> Self {
        let cpu = headroom_worker::WorkerOptions::new(headroom_worker::Device::Cpu);
        Self {
            vram_reserve_mib: None,
            gpu_paused: false,
            fallback_model: None,
            cpu_max_concurrency: cpu.max_concurrency,
            cpu_max_context_tokens: cpu.max_context_tokens.unwrap_or(8192),
            gpu_device: 0,
            gpu_layers: None,
        }
    }
}

/// Settings that only a restart applies.
pub const RESTART_SETTINGS: [&str; 2] = ["gpu_device", "gpu_layers"];

/// Settings each served model has its own of (the others are the service's, the same for
/// every model).
/// A fallback answers its model's failed-over chats: an encoder (an embedding model) generates
/// nothing, and a fallback never embeds (another model's vectors live in another space).
pub fn refuse_encoder_fallback(dir: &std::path::Path) -> Result<(), String> {
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap_or_default();
    if serde_json::from_str::<Value>(&config).is_ok_and(|c| c["model_type"] == "bert") {
        return Err(format!("fallback_model {}: an embedding model (an encoder) cannot answer another model's requests; give a chat model, or leave the fallback out", dir.display()));
    }
    Ok(())
}

pub const MODEL_SETTINGS: [&str; 2] = ["fallback_model", "gpu_layers"];

impl Settings {
    /// Checks every value; the error names the setting and what it accepts.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(mib) = self.vram_reserve_mib {
            if mib > 1 << 20 {
                return Err(format!("vram_reserve_mib {mib} is more than 1 TiB; give MiB (e.g. 2048), or null for automatic"));
            }
        }
        if !(1..=16).contains(&self.cpu_max_concurrency) {
            return Err(format!("cpu_max_concurrency must be 1 to 16, got {}", self.cpu_max_concurrency));
        }
        if !(64..=131_072).contains(&self.cpu_max_context_tokens) {
            return Err(format!("cpu_max_context_tokens must be 64 to 131072, got {}", self.cpu_max_context_tokens));
        }
        if self.gpu_device > 63 {
            return Err(format!("gpu_device must be a CUDA device index (0 to 63), got {}", self.gpu_device));
        }
        if let Some(dir) = &self.fallback_model {
            if dir.as_os_str().is_empty() {
                return Err("fallback_model is empty; give a model folder, or null for the served model".into());
            }
            if !dir.join("config.json").is_file() {
                return Err(format!("fallback_model {}: no config.json there; give a Hugging Face model folder", dir.display()));
            }
            refuse_encoder_fallback(dir)?;
        }
        Ok(())
    }

    /// These settings with a JSON merge patch (RFC 7396) applied: keys present replace values,
    /// `null` resets an optional setting. Unknown keys and wrong types are errors naming them.
    pub fn patched(&self, patch: &Value) -> Result<Settings, String> {
        let Value::Object(changes) = patch else {
            return Err("the body must be a JSON object of settings to change, e.g. {\"vram_reserve_mib\": 2048}".into());
        };
        let Value::Object(mut merged) = serde_json::to_value(self).map_err(|e| e.to_string())? else {
            unreachable!("Settings serialises to an object")
        };
        for (key, value) in changes {
            if !merged.contains_key(key) {
                let known: Vec<&String> = merged.keys().collect();
                return Err(format!("unknown setting {key:?}; the settings are {known:?}"));
            }
            merged.insert(key.clone(), value.clone());
        }
        let next: Settings = serde_json::from_value(Value::Object(merged)).map_err(|e| format!("invalid settings: {e}"))?;
        next.validate()?;
        Ok(next)
    }

    /// Names of the settings that differ from `other`.
    pub fn changed_from(&self, other: &Settings) -> Vec<String> {
        let (Ok(Value::Object(a)), Ok(Value::Object(b))) = (serde_json::to_value(self), serde_json::to_value(other)) else {
            return Vec::new();
        };
        a.iter().filter(|(k, v)| b.get(*k) != Some(v)).map(|(k, _)| k.clone()).collect()
    }
}

/// Where settings persist: one JSON file, replaced atomically.
#[derive(Debug, Clone)]
pub struct SettingsFile {
    pub path: PathBuf,
}

impl SettingsFile {
    pub fn in_dir(dir: &Path) -> Self {
        Self { path: dir.join("settings.json") }
    }

    /// The saved settings, or None when nothing was saved yet.
    pub fn load(&self) -> Result<Option<Settings>, String> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", self.path.display())),
        };
        let settings: Settings = serde_json::from_str(&text)
            .map_err(|e| format!("{}: {e}; fix or delete the file (Headroom then starts from the config file)", self.path.display()))?;
        settings.validate().map_err(|e| format!("{}: {e}", self.path.display()))?;
        Ok(Some(settings))
    }

    /// Writes to a temporary file and renames it over the old one, so a crash never leaves half
    /// a file.
    pub fn save(&self, settings: &Settings) -> Result<(), String> {
        let text = serde_json::to_string_pretty(settings).map_err(|e| e.to_string())?;
        let tmp = self.path.with_extension("json.tmp");
        std::fs::write(&tmp, text + "\n")
            .and_then(|_| std::fs::rename(&tmp, &self.path))
            .map_err(|e| format!("cannot save settings to {}: {e}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_patch_changes_what_it_names_and_resets_with_null() {
        let base = Settings { vram_reserve_mib: Some(512), ..Settings::default() };
        let next = base.patched(&json!({"gpu_paused": true, "cpu_max_concurrency": 2})).unwrap();
        assert!(next.gpu_paused);
        assert_eq!(next.cpu_max_concurrency, 2);
        assert_eq!(next.vram_reserve_mib, Some(512), "untouched");
        let mut changed = next.changed_from(&base);
        changed.sort();
        assert_eq!(changed, ["cpu_max_concurrency", "gpu_paused"]);
        assert_eq!(next.patched(&json!({"vram_reserve_mib": null})).unwrap().vram_reserve_mib, None);
    }

    #[test]
    fn bad_patches_say_what_is_wrong() {
        let s = Settings::default();
        assert!(s.patched(&json!({"vram_reserve": 1})).unwrap_err().contains("unknown setting \"vram_reserve\""));
        assert!(s.patched(&json!({"cpu_max_concurrency": 0})).unwrap_err().contains("1 to 16"));
        assert!(s.patched(&json!({"gpu_paused": "yes"})).unwrap_err().contains("invalid settings"));
        assert!(s.patched(&json!({"vram_reserve_mib": -5})).unwrap_err().contains("invalid settings"));
        assert!(s.patched(&json!([1])).unwrap_err().contains("JSON object"));
        assert!(s.patched(&json!({"fallback_model": "/nonexistent/model"})).unwrap_err().contains("config.json"));
        let encoder = tempfile::tempdir().unwrap();
        std::fs::write(encoder.path().join("config.json"), r#"{"model_type": "bert"}"#).unwrap();
        let refused = s.patched(&json!({"fallback_model": encoder.path()})).unwrap_err();
        assert!(refused.contains("an embedding model (an encoder) cannot answer"), "{refused}");
    }

    #[test]
    fn settings_survive_a_save_and_load() {
        let dir = tempfile::tempdir().unwrap();
        let file = SettingsFile::in_dir(dir.path());
        assert_eq!(file.load().unwrap(), None, "nothing saved yet");
        let s = Settings { vram_reserve_mib: Some(3000), gpu_paused: true, ..Settings::default() };
        file.save(&s).unwrap();
        assert_eq!(file.load().unwrap(), Some(s));
        std::fs::write(&file.path, "{\"gpu_paused\": 3}").unwrap();
        assert!(file.load().unwrap_err().contains("fix or delete"));
    }
}
