//! Memory budgets: the GPU's (what the worker reports, less the reserve, less what was granted)
//! and the host's, and waiting for GPU memory to free.

use super::*;

impl Dispatcher {
    /// The GPU budget admission uses now (None without a healthy GPU): total, the reserve kept
    /// for other programs, weights, what requests hold, observed free memory; on a GPU shared
    /// with other models, what they hold there too (see [`GpuShare`]).
    pub fn gpu_budget(&self) -> Option<Budget> {
        let own = self.own_gpu_budget()?;
        Some(self.beside_others(own, &[]))
    }

    /// The budget of this model alone on its GPU.
    pub(super) fn own_gpu_budget(&self) -> Option<Budget> {
        let s = &self.inner.supervisor;
        if s.config().gpu.is_none() || s.status().degraded || s.gpu_paused() {
            return None;
        }
        if s.gpu_loads_on_demand() {
            return self.gpu_budget_to_load(s.unloaded_gpu_reading().as_ref());
        }
        let worker = s.gpu_worker()?;
        let reading = worker.memory().borrow().clone()?;
        let total = reading.capacity_bytes?;
        // Grants made since the worker's last sample are not in its reading yet.
        let granted = self.inner.gpu_ledger.held_bytes();
        let unseen = granted.saturating_sub(reading.reserved_bytes);
        Some(Budget {
            total_bytes: total,
            reserve_bytes: self.vram_reserve_bytes(total),
            weights_bytes: reading.weights_bytes,
            held_bytes: reading.reserved_bytes.max(granted),
            observed_free_bytes: reading.used_bytes.map(|u| total.saturating_sub(u).saturating_sub(unseen)),
        })
    }

    /// The GPU budget while the model is unloaded (or loading again): its last worker's
    /// weights are charged as if loaded, against the VRAM free now, so a load is admitted like
    /// a request and a request that would not fit beside the reloaded weights goes elsewhere.
    /// A model never loaded yet (it loads at its first request) is charged the weights the
    /// memory model predicts for it.
    fn gpu_budget_to_load(&self, last: Option<&headroom_worker::MemoryReading>) -> Option<Budget> {
        let room = self.inner.supervisor.vram_room();
        let total = last.and_then(|r| r.capacity_bytes).or(room.map(|r| r.total_bytes))?;
        let weights = last.map_or_else(|| self.planner().shape.weights_bytes(), |r| r.weights_bytes);
        let granted = self.inner.gpu_ledger.held_bytes();
        Some(Budget {
            total_bytes: total,
            reserve_bytes: self.vram_reserve_bytes(total),
            weights_bytes: weights,
            held_bytes: granted,
            observed_free_bytes: room.map(|room| room.free_bytes.saturating_sub(weights).saturating_sub(granted)),
        })
    }

    /// The memory planner for the GPU worker as it runs now: a split worker is charged for the
    /// layers it says it loaded (`Ready { split }`), so admission follows what each GPU worker
    /// holds, whatever was asked of it.
    pub(super) fn planner(&self) -> Planner {
        let planner = self.inner.planner.clone();
        match self.inner.supervisor.gpu_worker().and_then(|w| w.ready.split) {
            Some(split) if !self.has_defect(Defect::SplitChargedWhole) => planner.split(split.gpu_layers as u64),
            _ => planner,
        }
    }

    /// The VRAM kept free for other programs: the settings' reserve, else the config's rule.
    pub(super) fn vram_reserve_bytes(&self, total: u64) -> u64 {
        match self.inner.settings.lock().unwrap().vram_reserve_mib {
            Some(mib) => mib * headroom_memory::MIB,
            None => self.inner.memory.vram_reserve_bytes(total),
        }
    }

    /// Reserves `bytes` of GPU memory if the budget has them now.
    pub(super) fn try_grant_gpu(&self, id: &str, bytes: u64) -> Option<Reservation> {
        let _one_at_a_time = self.inner.gpu_grant.lock().unwrap();
        let mut budget = self.gpu_budget()?;
        // On a shared GPU an idle model may make way (see [`Self::evict_for`]).
        if bytes > budget.available_bytes() && self.evict_for(bytes) {
            budget = self.gpu_budget()?;
        }
        (bytes <= budget.available_bytes()).then(|| self.inner.gpu_ledger.try_reserve(id, bytes).ok()).flatten()
    }

    /// The host RAM budget admission uses for the CPU path (its `weights_bytes` count every
    /// worker's host RAM once, a CPU worker shared by several models included).
    pub fn host_budget(&self) -> Budget {
        let ledger = self.inner.host_ledger();
        let host = headroom_memory::observe::host_memory();
        // The ledger's capacity already leaves the reserve out; the budget names the reserve
        // (for reasons) and keeps it out of live free RAM too.
        let reserve = host.map(|h| self.inner.memory.host_reserve_bytes(h.total_bytes)).unwrap_or(0);
        // With several models, the others' workers hold theirs on the same host; the ledger
        // (shared) has every model's grants.
        let mut models = vec![self.inner.clone()];
        if !self.host_share_ignored() {
            models.extend(self.others().into_iter().map(|(o, _)| o));
        }
        Budget {
            total_bytes: ledger.capacity_bytes() + reserve,
            reserve_bytes: reserve,
            weights_bytes: share::host_weights_bytes(&models, self.has_defect(Defect::SharedCpuCountedTwice)),
            held_bytes: ledger.held_bytes(),
            observed_free_bytes: host.map(|h| h.available_bytes),
        }
    }

    /// Host RAM the CPU worker's prefix cache holds (counted in [`Self::host_budget`]).
    pub(super) fn cpu_prefix_cache_bytes(&self) -> u64 {
        let worker = self.inner.supervisor.cpu_worker();
        worker.and_then(|w| w.memory().borrow().as_ref().and_then(|r| r.prefix_cache).map(|p| p.bytes)).unwrap_or(0)
    }

    /// Tells the CPU worker to drop its prefix cache, whose host RAM admission just gave to
    /// request `id`; the worker reads it before that request's job, which is sent later.
    pub(super) fn drop_cpu_prefix_cache(&self, id: &str) {
        let (Some(worker), Ok(runtime)) = (self.inner.supervisor.cpu_worker(), tokio::runtime::Handle::try_current()) else { return };
        tracing::info!(request_id = id, "the CPU worker's prefix cache is dropped to make room for a request");
        runtime.spawn(async move {
            if let Err(e) = worker.drop_prefix_cache().await {
                tracing::warn!(error = %e, "could not ask the CPU worker to drop its prefix cache");
            }
        });
    }

    /// Waits (in the GPU lane, holding a GPU slot) until the request's GPU memory is granted.
    pub(super) async fn wait_for_gpu_memory(&self, sub: &Submission, queued_at: Instant, preempted: bool, cancel: &CancelSignal) -> GpuWait {
        let inner = &self.inner;
        let needs = self.planner().footprint(RequestShape::of(&sub.run.request)).request_bytes();
        let max_wait = Duration::from_millis(sub.allow.max_wait_ms.unwrap_or(inner.memory.max_queue_wait_ms));
        loop {
            if self.gpu_budget().is_none() {
                return match inner.supervisor.gpu_unavailable() {
                    Some(why) => GpuWait::Leave { why, cpu_allowed: sub.allow.cpu },
                    // A healthy GPU without a memory reading yet: run without a grant.
                    None => GpuWait::Run(None),
                };
            }
            if let Some(r) = self.try_grant_gpu(&sub.run.request_id, needs) {
                return GpuWait::Run(Some(r));
            }
            if queued_at.elapsed() >= max_wait && !preempted {
                return GpuWait::Leave {
                    why: format!("waited {} ms for GPU memory that did not free", queued_at.elapsed().as_millis()),
                    cpu_allowed: sub.allow.cpu && inner.memory.allow_cpu_redirect,
                };
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                _ = cancel.cancelled() => return GpuWait::Cancelled,
            }
        }
    }
}

/// What waiting for GPU memory came to.
pub(super) enum GpuWait {
    /// Run now, with the memory granted (None: a healthy GPU with no memory reading yet).
    Run(Option<Reservation>),
    /// Leave the GPU lane: its memory did not free in time, or the GPU is gone.
    Leave { why: String, cpu_allowed: bool },
    Cancelled,
}
