//! Worker processes' lives: the GPU worker watched (health, stalls, exits), restarted with
//! backoff, probed before the breaker closes, retired when paused; the CPU worker kept warm.

use super::*;

impl Supervisor {
    /// Health checks, death and hang detection, restarts with backoff and the breaker's probe.
    pub(super) async fn watch_gpu(self) {
        let Some(gpu_device) = self.inner.config.gpu.as_ref().map(|g| g.device) else { return };
        let mut attempt = 0u32;
        // The breaker's opening count when the current worker was started: a worker older than
        // the latest opening is not trusted and is replaced before the probe.
        let mut worker_epoch = self.inner.breaker.lock().unwrap().times_opened();
        let mut paused = self.inner.gpu_paused.subscribe();
        let mut unloaded = self.inner.gpu_unloaded.subscribe();
        // The next launch loads a model a request waits for: at once, without the backoff.
        let mut on_demand = false;
        let mut stall = StallWatch::default();
        loop {
            if self.shutting_down() {
                return;
            }
            // Paused in settings, or the model unloaded (keep_alive, eviction): the worker stands
            // down once idle (requests already on it, or that picked it just before, finish;
            // nothing new is sent), and the GPU waits for the state to end.
            let standing_down = if self.gpu_paused() {
                Some((&mut paused, "stopped: the GPU is paused"))
            } else if self.gpu_unloaded() {
                // The next launch loads the model for a request waiting on it.
                on_demand = true;
                Some((&mut unloaded, "stopped: the model was unloaded (keep_alive)"))
            } else {
                None
            };
            if let Some((until, status)) = standing_down {
                if let Some(worker) = self.gpu_worker() {
                    self.clear_gpu(&worker);
                    retire_when_idle(worker.clone()).await;
                    self.emit(EventKind::WorkerExited { device: worker.device, pid: worker.pid, status: status.into() });
                }
                tokio::select! {
                    _ = async { let _ = until.wait_for(|on| !*on).await; } => {}
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
                attempt = 0;
                continue;
            }
            let worker = match self.gpu_worker() {
                Some(w) => w,
                None => {
                    if !std::mem::take(&mut on_demand) {
                        let delay = backoff(&self.inner.config, attempt);
                        attempt += 1;
                        self.emit(EventKind::WorkerRestartScheduled {
                            device: gpu_device,
                            attempt,
                            delay_ms: delay.as_millis() as u64,
                            reason: self.inner.breaker.lock().unwrap().reason().to_string(),
                        });
                        tokio::time::sleep(delay).await;
                    }
                    // Off the runtime's threads: a split's first plan measures the host's bandwidth.
                    let this = self.clone();
                    let replanned = tokio::task::spawn_blocking(move || this.replan_gpu()).await.unwrap_or_else(|e| Err(format!("the layer plan failed: {e}")));
                    if let Err(why) = replanned {
                        // Serve from the CPU and look again after the next backoff.
                        self.trip(FailureCause::DeviceLost, &why);
                        self.loaded();
                        continue;
                    }
                    let spec = self.gpu_spec().expect("watching a configured GPU");
                    let spawned = self.inner.config.launcher.launch(&spec).await;
                    match spawned {
                        Ok(w) => {
                            worker_epoch = self.inner.breaker.lock().unwrap().times_opened();
                            self.announce(&w);
                            let env = self.inner.sim_environment.lock().unwrap().clone();
                            for fault in env {
                                if let Err(e) = w.fault(fault).await {
                                    tracing::warn!(error = %e, "could not re-apply a sim environment fault");
                                }
                            }
                            *self.inner.gpu.write().unwrap() = Some(w.clone());
                            self.loaded();
                            w
                        }
                        Err(e) => {
                            tracing::error!(error = %e, attempt, "GPU worker restart failed");
                            self.trip(FailureCause::DeviceLost, &e.to_string());
                            self.loaded();
                            continue;
                        }
                    }
                }
            };
            let (state, times_opened) = {
                let b = self.inner.breaker.lock().unwrap();
                (b.state(), b.times_opened())
            };
            if state == BreakerState::Open && times_opened != worker_epoch {
                // Opened (allocation failures, a failed probe) while this process lived: restart
                // it clean rather than trust its allocator.
                self.retire_gpu(&worker).await;
                continue;
            }
            let begin = self.inner.breaker.lock().unwrap().begin_probe(Instant::now());
            if begin.is_some() {
                self.transition(begin);
                let timeout = self.inner.config.supervision.health_timeout().max(Duration::from_secs(10));
                let result = worker.probe(self.inner.config.supervision.probe_canary_mib * headroom_memory::MIB, timeout).await;
                let t = {
                    let mut breaker = self.inner.breaker.lock().unwrap();
                    match &result {
                        Ok(detail) => breaker.probe_succeeded(detail, Instant::now()),
                        Err(e) => breaker.probe_failed(&e.to_string(), Instant::now()),
                    }
                };
                self.transition(t);
                if result.is_ok() {
                    attempt = 0;
                }
                continue;
            }
            // While open, look again soon so the probe follows the cool-down closely.
            let wait = if state == BreakerState::Closed {
                self.inner.config.supervision.health_interval()
            } else {
                self.inner.config.supervision.health_interval().min(Duration::from_millis(50))
            };
            tokio::select! {
                _ = async { let _ = paused.wait_for(|p| *p).await; } => {}
                _ = async { let _ = unloaded.wait_for(|u| *u).await; } => {}
                info = worker.wait_exited() => {
                    self.emit(EventKind::WorkerExited { device: worker.device, pid: worker.pid, status: info.status.clone() });
                    self.trip(FailureCause::DeviceLost, &format!("GPU worker (pid {}) {}", worker.pid, info.status));
                    self.clear_gpu(&worker);
                }
                _ = tokio::time::sleep(wait) => {
                    if state != BreakerState::Closed {
                        continue;
                    }
                    let hung = match worker.health(self.inner.config.supervision.health_timeout()).await {
                        Ok(report) => stall.observe(worker.pid, &report, self.inner.config.supervision.stall_timeout_ms),
                        Err(_) if worker.has_exited() => continue,
                        Err(e) => Some(e.to_string()),
                    };
                    if let Some(reason) = hung {
                        self.emit(EventKind::HealthCheckFailed { device: worker.device, pid: worker.pid, reason: reason.clone() });
                        self.trip(FailureCause::HealthCheck, &reason);
                        self.retire_gpu(&worker).await;
                    }
                }
            }
        }
    }

    pub(super) fn clear_gpu(&self, worker: &Arc<Worker>) {
        // Its successor takes about as much: a GPU shared with other models keeps its place.
        if let Some(reading) = worker.memory().borrow().clone() {
            self.inner.residency.lock().unwrap().last_reading = Some(reading);
        }
        let mut slot = self.inner.gpu.write().unwrap();
        if slot.as_ref().is_some_and(|w| Arc::ptr_eq(w, worker)) {
            *slot = None;
        }
    }

    /// Kills a GPU worker that cannot be trusted and waits for it to be gone.
    pub(super) async fn retire_gpu(&self, worker: &Arc<Worker>) {
        worker.kill();
        let info = worker.wait_exited().await;
        self.emit(EventKind::WorkerExited { device: worker.device, pid: worker.pid, status: info.status });
        self.clear_gpu(worker);
    }

    /// The CPU worker is the fallback: if it dies it is restarted at once (no breaker). Run by
    /// the supervisor that owns it, for every model sharing it.
    pub(super) async fn watch_cpu(self) {
        let mut attempt = 0u32;
        loop {
            let Some(worker) = self.cpu_worker() else {
                tokio::time::sleep(backoff(&self.inner.config, attempt)).await;
                attempt += 1;
                match self.inner.config.launcher.launch(&self.cpu_spec()).await {
                    Ok(w) => {
                        self.announce(&w);
                        *self.inner.cpu.inner.worker.write().unwrap() = Some(w);
                        attempt = 0;
                    }
                    Err(e) => tracing::error!(error = %e, "CPU worker restart failed"),
                }
                continue;
            };
            let info = worker.wait_exited().await;
            if self.shutting_down() {
                return;
            }
            self.emit(EventKind::WorkerExited { device: worker.device, pid: worker.pid, status: info.status });
            let mut slot = self.inner.cpu.inner.worker.write().unwrap();
            if slot.as_ref().is_some_and(|w| Arc::ptr_eq(w, &worker)) {
                *slot = None;
            }
        }
    }
}

/// Tells a busy worker from a hung one by its progress between health answers.
#[derive(Debug, Default)]
pub(super) struct StallWatch {
    pid: u32,
    progress: u64,
    since: Option<Instant>,
}

impl StallWatch {
    /// Takes a health answer; returns why the worker is hung, if it is: requests running and
    /// no prefill or token for `stall_timeout_ms`.
    pub(super) fn observe(&mut self, pid: u32, report: &crate::worker::HealthReport, stall_timeout_ms: u64) -> Option<String> {
        let moved = pid != self.pid || report.progress != self.progress || report.active_requests == 0;
        if moved || self.since.is_none() {
            *self = Self { pid, progress: report.progress, since: Some(Instant::now()) };
            return None;
        }
        let still = self.since.map(|s| s.elapsed()).unwrap_or_default();
        (still >= Duration::from_millis(stall_timeout_ms)).then(|| {
            format!(
                "the worker (pid {pid}) answers health checks but its {} running request(s) produced nothing for {} ms",
                report.active_requests,
                still.as_millis()
            )
        })
    }
}

/// Lets a worker that no longer gets new requests finish the ones it runs, then stops it.
pub(super) async fn retire_when_idle(worker: Arc<Worker>) {
    // A request that picked this worker just before it was replaced may not have reached it yet.
    tokio::time::sleep(Duration::from_millis(500)).await;
    while worker.active_requests() > 0 && !worker.has_exited() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worker.shutdown().await;
    if tokio::time::timeout(Duration::from_secs(5), worker.wait_exited()).await.is_err() {
        worker.kill();
    }
}

pub(super) fn backoff(config: &SupervisorConfig, attempt: u32) -> Duration {
    let s = &config.supervision;
    let factor = 2u64.saturating_pow(attempt.min(16));
    Duration::from_millis(s.restart_backoff_initial_ms.saturating_mul(factor).min(s.restart_backoff_max_ms))
}
