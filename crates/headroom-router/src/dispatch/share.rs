//! Several models on one GPU. Each model's dispatcher joins a [`GpuShare`]: admission for one
//! counts what the others hold there (weights and their requests' grants), and before it sends
//! a request to the CPU for want of room it may evict another model that is idle (not pinned,
//! nothing waiting or running; least recently used first). An evicted model unloads as after its
//! keep_alive and loads again at its next request; a load waits for the evicted workers to be
//! gone, since their exit is what frees the memory.

use super::*;

/// One GPU that several models' dispatchers share.
#[derive(Clone, Default)]
pub struct GpuShare {
    inner: Arc<Mutex<ShareInner>>,
}

#[derive(Default)]
struct ShareInner {
    members: Vec<Seat>,
    /// Workers unloaded or evicted and not gone yet.
    leaving: Vec<Arc<crate::Worker>>,
    /// The host RAM ledger every member's CPU-path requests reserve from.
    host: Option<Ledger>,
}

struct Seat {
    pinned: bool,
    dispatcher: std::sync::Weak<Inner>,
}

/// A dispatcher's place in a share: the share, and the model's name there.
pub(super) struct Membership {
    share: GpuShare,
    name: String,
}

impl GpuShare {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Dispatcher {
    /// Joins `share` as the model `name`: from now on admission counts what the share's other
    /// models hold on the GPU, and may evict them when idle. A `pinned` model is never evicted.
    ///
    /// The models share the host too: from now on this one's CPU-path grants go to the share's
    /// host RAM ledger (the first member's), so no two models grant the same free RAM.
    pub fn share_gpu(&self, share: &GpuShare, name: &str, pinned: bool) {
        let mut members = share.inner.lock().unwrap();
        let host = members.host.get_or_insert_with(|| self.inner.host_ledger()).clone();
        if !self.host_share_ignored() {
            *self.inner.host_ledger.write().unwrap() = host;
        }
        members.members.push(Seat { pinned, dispatcher: Arc::downgrade(&self.inner) });
        drop(members);
        *self.inner.share.lock().unwrap() = Some(Membership { share: share.clone(), name: name.to_string() });
    }

    /// The other models of this one's share, with whether each is pinned.
    pub(super) fn others(&self) -> Vec<(Arc<Inner>, bool)> {
        let Some(share) = self.inner.share.lock().unwrap().as_ref().map(|m| m.share.clone()) else { return Vec::new() };
        let members = share.inner.lock().unwrap();
        members
            .members
            .iter()
            .filter_map(|seat| seat.dispatcher.upgrade().map(|d| (d, seat.pinned)))
            .filter(|(d, _)| !Arc::ptr_eq(d, &self.inner))
            .collect()
    }

    /// `own` (this model's budget alone) with what the share's other models hold on the GPU
    /// added, leaving out `except` (a model whose eviction is being weighed).
    pub(super) fn beside_others(&self, mut own: Budget, except: &[Arc<Inner>]) -> Budget {
        if self.share_ignored() {
            return own;
        }
        let (mut weights, mut held) = (0, 0);
        for (other, _) in self.others() {
            if except.iter().any(|e| Arc::ptr_eq(e, &other)) {
                continue;
            }
            let (w, h) = other.held_on_gpu();
            weights += w;
            held += h;
        }
        own.weights_bytes += weights;
        own.held_bytes += held;
        // A driver's reading of free memory already counts the other models' processes; the
        // sim GPU's reading is this worker's alone.
        if self.inner.supervisor.config().gpu.as_ref().is_some_and(|g| g.device == Device::Sim) {
            own.observed_free_bytes = own.observed_free_bytes.map(|free| free.saturating_sub(weights + held));
        }
        own
    }

    /// What this model holds on its GPU now: its weights and its requests' grants (nothing while
    /// unloaded; while loading, the weights it is about to take).
    pub fn held_on_gpu(&self) -> (u64, u64) {
        self.inner.held_on_gpu()
    }

    /// Evicts idle models of the share, least recently used first, until `needs` bytes fit;
    /// only when evicting every idle one would make them fit. Returns whether it evicted any.
    pub(super) fn evict_for(&self, needs: u64) -> bool {
        let Some(name) = self.inner.share.lock().unwrap().as_ref().map(|m| m.name.clone()) else { return false };
        if self.share_ignored() {
            return false;
        }
        let mut idle: Vec<Arc<Inner>> = self.others().into_iter().filter(|(o, pinned)| !pinned && o.evictable()).map(|(o, _)| o).collect();
        let Some(own) = self.own_gpu_budget() else { return false };
        if idle.is_empty() || needs > self.beside_others(own, &idle).available_bytes() {
            return false;
        }
        // Never used first, then the longest idle.
        idle.sort_by_key(|o| o.supervisor.last_used());
        let mut evicted = false;
        for other in idle {
            if self.gpu_budget().is_some_and(|b| needs <= b.available_bytes()) {
                break;
            }
            evicted |= other.stand_down(Some(&name));
        }
        evicted
    }

    /// Test-only: the defect the share's checks guard against, switched on in a test or, for
    /// the pressure harness's negative control, by `HEADROOM_TEST_DEFECT=gpu-share-ignored`.
    fn share_ignored(&self) -> bool {
        self.has_defect(Defect::GpuShareIgnored) || headroom_model::test_defect("gpu-share-ignored")
    }

    /// Test-only: the defect the host share's test guards against.
    pub(super) fn host_share_ignored(&self) -> bool {
        self.has_defect(Defect::HostShareIgnored)
    }

    /// Waits until the workers unloaded or evicted from this model's share have exited (their
    /// exit frees the memory a load is about to take), up to the load timeout.
    pub(super) async fn wait_for_departures(&self, cancel: &CancelSignal) {
        let Some(share) = self.inner.share.lock().unwrap().as_ref().map(|m| m.share.clone()) else { return };
        let limit = Instant::now() + Duration::from_millis(self.inner.supervisor.config().supervision.load_timeout_ms);
        loop {
            let gone = {
                let mut inner = share.inner.lock().unwrap();
                inner.leaving.retain(|w| !w.has_exited());
                inner.leaving.is_empty()
            };
            if gone || Instant::now() > limit || cancel.is_cancelled() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Host RAM the workers of `models` hold beside requests: each CPU worker's weights as it
/// reports holding them (packed GGUF tensors stay packed) and its prefix cache (blocks of
/// finished requests, at most its configured size), and each split GPU worker's CPU part. A
/// CPU worker several models share counts once (`counted_twice`: test-only, the defect).
pub(super) fn host_weights_bytes(models: &[Arc<Inner>], counted_twice: bool) -> u64 {
    let mut cpu_workers: Vec<Arc<crate::Worker>> = Vec::new();
    let mut bytes = 0;
    for model in models {
        bytes += model.split_host_bytes();
        let Some(cpu) = model.supervisor.cpu_worker() else { continue };
        if !counted_twice && cpu_workers.iter().any(|w| Arc::ptr_eq(w, &cpu)) {
            continue;
        }
        bytes += cpu.memory().borrow().as_ref().map_or(0, |r| r.weights_bytes + r.prefix_cache.map_or(0, |p| p.bytes));
        cpu_workers.push(cpu);
    }
    bytes
}

impl Inner {
    /// The host RAM ledger this model's CPU-path requests reserve from.
    pub(super) fn host_ledger(&self) -> Ledger {
        self.host_ledger.read().unwrap().clone()
    }

    /// Host RAM a split GPU worker holds for the layers it runs on the CPU.
    fn split_host_bytes(&self) -> u64 {
        self.supervisor.gpu_worker().and_then(|w| w.memory().borrow().as_ref().map(|r| r.host_weights_bytes)).unwrap_or(0)
    }

    /// The model's weights on its GPU and what its requests were granted there, now: nothing
    /// once unloaded; while loading again, the weights it is about to take.
    pub(super) fn held_on_gpu(&self) -> (u64, u64) {
        let s = &self.supervisor;
        if s.config().gpu.is_none() || s.gpu_unloaded() {
            return (0, 0);
        }
        let reading = match s.gpu_worker() {
            Some(worker) => worker.memory().borrow().clone(),
            None if s.gpu_loads_on_demand() => s.unloaded_gpu_reading(),
            // Paused: its worker is gone until the GPU resumes.
            None if s.gpu_paused() => return (0, 0),
            // Restarting after a failure or a resume: the launch is not admitted, so the weights
            // it is about to take count from now on (another model loading meanwhile would end
            // beside it, over the budget).
            None if !self.defects.lock().unwrap().contains(&Defect::RestartingModelUncounted) => s.last_gpu_reading(),
            None => return (0, 0),
        };
        let weights = reading.as_ref().map_or_else(|| self.planner.shape.weights_bytes(), |r| r.weights_bytes);
        let held = self.gpu_ledger.held_bytes().max(reading.map_or(0, |r| r.reserved_bytes));
        (weights, held)
    }

    /// Loaded on the GPU with nothing waiting for or running on it (a model whose worker is
    /// restarting is not: its launch is under way, and it counts as held).
    fn evictable(&self) -> bool {
        self.supervisor.gpu_worker().is_some() && !self.supervisor.gpu_unloaded() && self.gpu_lane_idle()
    }

    /// Unloads the model's GPU copy, after its keep_alive (`evicted_for` None) or for another
    /// model (see [`crate::Supervisor::unload`]), counts it, and puts its worker on the share's
    /// leaving list: a load of another model waits for it. Returns whether it unloaded.
    pub(super) fn stand_down(&self, evicted_for: Option<&str>) -> bool {
        let Some(worker) = self.supervisor.unload(evicted_for) else { return false };
        self.metrics.gpu_model_unloads.inc();
        if let Some(m) = self.share.lock().unwrap().as_ref() {
            m.share.inner.lock().unwrap().leaving.push(worker);
        }
        true
    }
}
