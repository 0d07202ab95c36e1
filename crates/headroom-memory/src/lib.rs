//! `headroom-memory` owns footprint estimates, the VRAM reserve policy, the ledger of
//! reservations, observations (NVML, host RAM via sysinfo, a counting allocator) and the
//! admission decision. It never runs models or spawns processes.

pub mod admit;
pub mod calibration;
pub mod config;
pub mod footprint;
pub mod keep_alive;
pub mod ledger;
pub mod observe;
pub mod split;

pub use admit::{decide_dropping, thousands, Admission, Allowances, Budget, Planner};
pub use calibration::{planner_for, CalibrationEntry, CalibrationFile, ResolvedCalibration};
pub use config::MemoryConfig;
pub use footprint::{Calibration, Footprint, ModelShape, RequestShape, WorkspaceSample, GIB, MIB};
pub use keep_alive::KeepAlive;
pub use ledger::{Insufficient, Ledger, Reservation};
pub use observe::{CountingAllocator, GpuMemory, HostMemory, MemorySampler, Sample};
pub use split::{gpu_part_shape, gpu_shape, plan_model_split, plan_split, Bandwidths, GpuLayers, SplitInputs, SplitPlan};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("memory config: {0}")]
    Config(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
