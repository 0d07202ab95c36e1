//! The two lanes a request can wait and run in. A lane is not a device: the GPU lane runs on
//! whatever GPU worker there is (`cuda:N` or `sim`), and a request can change lanes (a failover
//! moves it from the GPU lane to the CPU lane's queue).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Lane {
    Gpu,
    Cpu,
}

impl Lane {
    /// `gpu` or `cpu`: the label of metrics, queue status and the journal.
    pub fn as_str(self) -> &'static str {
        match self {
            Lane::Gpu => "gpu",
            Lane::Cpu => "cpu",
        }
    }
}

impl std::fmt::Display for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
