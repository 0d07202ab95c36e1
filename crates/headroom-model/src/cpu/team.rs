//! A team of the pool's threads that stays together for a whole forward pass.
//!
//! Decoding one token of a small model is ~120 matrix products of a few microseconds each.
//! Handing each one to rayon wakes the pool's sleeping threads every time, and the wake-up costs
//! as much as the product (SmolLM2-135M: 0.6× llama.cpp's decode speed, threads mostly idle).
//! llama.cpp keeps its threads spinning between operations instead. A team does the same inside
//! rayon's pool: one wake-up per forward pass forms it (the calling thread leads, the pool
//! lends the others); the leader runs the forward and publishes each parallel step, the others
//! spin waiting for the next one, claim its tasks from a shared counter, and leave when the
//! forward ends. Threads busy elsewhere simply never join: the leader claims whatever nobody else
//! did, so a team never waits on a thread that is not in it.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};

/// Runs a parallel step's tasks. `Team::solo()` runs them on the calling thread.
pub struct Team<'s> {
    state: Option<&'s State>,
}

type Job<'a> = &'a (dyn Fn(usize) + Sync);

/// The task index of a generation being published: above any task count, so nothing claims it.
const CLOSED: u64 = u32::MAX as u64;

struct State {
    /// The current step's generation (high 32 bits) and its next unclaimed task (low 32 bits),
    /// in one word so that a claim can only ever take a task of the step it read the job of.
    claim: AtomicU64,
    /// The current step's job: a pointer to a `Job` on the leader's stack.
    job: AtomicPtr<()>,
    tasks: AtomicUsize,
    done: AtomicUsize,
    finished: AtomicBool,
}

impl Team<'static> {
    /// A team of one: every task runs on the calling thread, in order.
    pub fn solo() -> Self {
        Team { state: None }
    }
}

impl Team<'_> {
    /// Forms a team of the pool's threads (the caller leads; `rayon::current_num_threads() - 1`
    /// others are asked to join) for as long as `lead` runs.
    pub fn run<R: Send>(lead: impl FnOnce(&Team) -> R + Send) -> R {
        let threads = rayon::current_num_threads();
        if threads <= 1 {
            return lead(&Team::solo());
        }
        let state = State {
            claim: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            tasks: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            finished: AtomicBool::new(false),
        };
        rayon::in_place_scope(|scope| {
            for _ in 1..threads {
                scope.spawn(|_| state.help());
            }
            let team = Team { state: Some(&state) };
            // Helpers leave even if `lead` panics (the scope waits for them).
            struct Finish<'a>(&'a AtomicBool);
            impl Drop for Finish<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Release);
                }
            }
            let _finish = Finish(&state.finished);
            lead(&team)
        })
    }

    /// Runs `job(0..tasks)` across the team and returns when every task has finished.
    pub fn for_each(&self, tasks: usize, job: impl Fn(usize) + Sync) {
        let Some(state) = self.state.filter(|_| tasks > 1) else {
            (0..tasks).for_each(job);
            return;
        };
        assert!(tasks < CLOSED as usize, "{tasks} tasks in one step");
        let job: Job = &job;
        let generation = (state.claim.load(Ordering::Relaxed) >> 32) + 1;
        // Close the new generation to claims first: a helper that read the last step's claim
        // word and then this step's job must find that word gone when it tries to claim.
        state.claim.store(generation << 32 | CLOSED, Ordering::Relaxed);
        state.tasks.store(tasks, Ordering::Release);
        state.done.store(0, Ordering::Release);
        state.job.store(&job as *const Job as *mut (), Ordering::Release);
        // Opens it: publishes job, tasks and done with the generation.
        state.claim.store(generation << 32, Ordering::Release);
        while state.claim_one(generation) {}
        let mut spins = 0u32;
        while state.done.load(Ordering::Acquire) < tasks {
            backoff(&mut spins);
        }
    }

    /// Threads in the team, counting the leader (an upper bound: helpers busy elsewhere may not
    /// have joined).
    pub fn threads(&self) -> usize {
        if self.state.is_some() { rayon::current_num_threads() } else { 1 }
    }
}

impl State {
    /// A helper's life: take tasks of each step as it is published until the forward ends.
    fn help(&self) {
        let mut spins = 0u32;
        loop {
            let current = self.claim.load(Ordering::Acquire);
            if (current as u32 as usize) < self.tasks.load(Ordering::Acquire) && self.claim_one(current >> 32) {
                spins = 0;
                continue;
            }
            if self.finished.load(Ordering::Acquire) {
                return;
            }
            backoff(&mut spins);
        }
    }

    /// Claims and runs one task of step `generation`; false when it has none left (or a later
    /// step replaced it).
    fn claim_one(&self, generation: u64) -> bool {
        let mut current = self.claim.load(Ordering::Acquire);
        loop {
            if current >> 32 != generation {
                return false;
            }
            // Read before the claim: a successful claim proves these belong to `generation`.
            let job = self.job.load(Ordering::Acquire) as *const Job;
            let tasks = self.tasks.load(Ordering::Acquire);
            let index = current as u32 as usize;
            if index >= tasks {
                return false;
            }
            match self.claim.compare_exchange_weak(current, current + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    // SAFETY: the step's leader keeps `job` alive until `done` counts every one
                    // of its tasks, this one included.
                    unsafe { (*job)(index) };
                    self.done.fetch_add(1, Ordering::Release);
                    return true;
                }
                Err(now) => current = now,
            }
        }
    }
}

/// Spins briefly, then yields the core: a helper waiting through the leader's serial work stays
/// ready within a microsecond, but one left waiting long does not starve other programs.
fn backoff(spins: &mut u32) {
    *spins = spins.saturating_add(1);
    if *spins < 20_000 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn steps(team: &Team, count: usize) {
        for step in 0..count {
            let tasks = 1 + step % 37;
            let hits: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
            team.for_each(tasks, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "step {step}");
        }
    }

    /// Every task of every step runs exactly once, steps in order, on a real pool: long teams,
    /// and many short ones whose helpers join while the first steps are being published (where
    /// a claim on the stale first generation once ran a job that was not there yet).
    #[test]
    fn every_task_of_every_step_runs_once() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        pool.install(|| Team::run(|team| steps(team, 2000)));
        for _ in 0..3000 {
            pool.install(|| Team::run(|team| steps(team, 2)));
        }
        // A caller outside the pool leads, as the engine's callers do (the global pool).
        for _ in 0..3000 {
            Team::run(|team| steps(team, 2));
        }
    }
}
