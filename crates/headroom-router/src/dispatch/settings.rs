//! Settings changed live from the settings screen: validated, applied (a new CPU worker, lane
//! sizes), saved.

use super::*;

/// What a settings change did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SettingsUpdate {
    pub settings: Settings,
    /// The settings that changed.
    pub changed: Vec<String>,
    /// Changed settings that take effect at the next start.
    pub restart_required: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// The change is not valid; nothing was applied.
    #[error("{0}")]
    Invalid(String),
    /// A valid change could not be applied (a new CPU worker failed to start); nothing changed.
    #[error("{0}")]
    NotApplied(String),
    /// Applied, but not saved: it is lost at the next start.
    #[error("{0}")]
    NotSaved(String),
}

impl Dispatcher {
    /// The file settings are saved to, if any.
    pub fn settings_path(&self) -> Option<String> {
        self.inner.settings_file.as_ref().map(|f| f.path.display().to_string())
    }

    /// The settings in force now.
    pub fn settings(&self) -> Settings {
        self.inner.settings.lock().unwrap().clone()
    }

    /// Applies a JSON merge patch of settings, live where possible: the VRAM reserve from the
    /// next admission, the GPU pause at once (running GPU requests finish), CPU concurrency,
    /// context and fallback model by starting a new CPU worker and switching to it when ready.
    /// Then saves them. The GPU device waits for a restart.
    pub async fn update_settings(&self, patch: &serde_json::Value) -> Result<SettingsUpdate, SettingsError> {
        let _one_at_a_time = self.inner.updating_settings.lock().await;
        let current = self.settings();
        let next = current.patched(patch).map_err(SettingsError::Invalid)?;
        let changed = next.changed_from(&current);
        let supervisor = &self.inner.supervisor;
        let mut setup = supervisor.cpu_setup();
        setup.options.max_concurrency = next.cpu_max_concurrency;
        setup.options.max_context_tokens = Some(next.cpu_max_context_tokens);
        setup.fallback_model_dir = next.fallback_model.clone();
        supervisor.replace_cpu_worker(setup).await.map_err(|e| match e {
            // A CPU worker shared with other models runs their model for them too.
            Error::Invalid(why) => SettingsError::Invalid(format!("nothing changed: {why}")),
            e => SettingsError::NotApplied(format!("the CPU worker could not start with these settings, so nothing changed: {e}")),
        })?;
        self.inner.cpu.resize(next.cpu_max_concurrency as usize);
        self.queue_changed(&self.inner.cpu);
        supervisor.set_gpu_paused(next.gpu_paused);
        *self.inner.settings.lock().unwrap() = next.clone();
        // The sim GPU keeps the reserve free itself when requests take KV blocks (overcommit).
        if let Some(gpu) = supervisor.config().gpu.as_ref().filter(|g| g.device == Device::Sim && next.vram_reserve_mib != current.vram_reserve_mib) {
            let total = gpu.sim_vram_mib * headroom_memory::MIB;
            supervisor.set_vram_reserve_mib(self.vram_reserve_bytes(total) / headroom_memory::MIB).await;
        }
        let restart_required: Vec<String> = changed.iter().filter(|c| RESTART_SETTINGS.contains(&c.as_str())).cloned().collect();
        supervisor.emit(EventKind::SettingsChanged { settings: next.clone(), changed: changed.clone(), restart_required: restart_required.clone() });
        if let Some(file) = &self.inner.settings_file {
            file.save(&next).map_err(|e| SettingsError::NotSaved(format!("applied, but {e}; it will be lost at the next start")))?;
        }
        Ok(SettingsUpdate { settings: next, changed, restart_required })
    }
}

