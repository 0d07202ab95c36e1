//! `headroom-model` owns the Llama-family decoder, generic over any burn `Backend`; loading of
//! Hugging Face model folders (config.json, safetensors, tokenizer.json, chat template) into a
//! [`ModelBundle`]; the host-side [`Sampler`]; and the generation [`Session`] with [`Checkpoint`]s.
//! It knows nothing about queues, HTTP, or which device is "better".

pub mod batch;
pub mod bert;
pub mod bundle;
pub mod config;
pub mod cpu;
pub mod device;
pub mod fixture;
pub mod generate;
pub mod gguf;
pub mod gguf_model;
pub mod model;
pub mod quants;
pub mod sampler;
pub mod split;
pub mod template;
pub mod weights;

pub use weights::StoreDtype;

#[cfg(feature = "train")]
pub mod train;

pub use bundle::{resolve_model, ModelBundle, WeightFormat};
pub use config::LlamaConfig;
pub use generate::{
    check_embedding, generate, BurnCache, CancelToken, Checkpoint, Decoder, FinishReason, GenerateRequest, Generation, PromptInput,
    Next, PromptSource, Session, StreamEvent, TeacherForced, teacher_forced, Work,
};
pub use batch::Batch;
pub use bert::Bert;
pub use cpu::{CpuModel, KvPrecision};
pub use model::{KvCache, LayerStack, Llama, Place, RopeTables};
pub use split::{SplitCache, SplitModel};
pub use sampler::{Sampler, SamplerState, SamplingParams};
pub use template::{ChatMessage, ChatTemplate};

/// The CPU backend every build has.
pub type CpuBackend = burn_ndarray::NdArray<f32>;

/// Everything that can go wrong loading or running a model. Each message says what to do next.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("model {path}: {reason}")]
    Folder { path: String, reason: String },
    #[error("{path} {reason}")]
    Gguf { path: String, reason: String },
    #[error("config: {0}")]
    Config(String),
    #[error("weights: {0}")]
    Weights(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error(
        "prompt has {prompt_tokens} tokens and asks for {max_tokens} more, but the model's context \
         is {context} tokens; shorten the prompt or lower max_tokens to at most {available}"
    )]
    ContextOverflow {
        prompt_tokens: usize,
        max_tokens: usize,
        context: usize,
        available: usize,
    },
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("generation was cancelled")]
    Cancelled,
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Whether a test switched a known defect back on (`HEADROOM_TEST_DEFECT`, comma-separated), so a
/// negative control can prove its check fails without the fix. Never set outside tests.
pub fn test_defect(name: &str) -> bool {
    // Read once: kernels ask on every call, and the variable is fixed for a process's life (a
    // negative control sets it for a child process).
    static DEFECTS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    DEFECTS
        .get_or_init(|| std::env::var("HEADROOM_TEST_DEFECT").map_or_else(|_| Vec::new(), |v| v.split(',').map(str::to_owned).collect()))
        .iter()
        .any(|d| d == name)
}

/// Runs the test `test` of the running test binary in a child process with the defect `defect`
/// switched on, asserts that exactly that test failed, and gives its output: the negative
/// controls of every crate's tests.
#[doc(hidden)]
pub fn failing_with_defect(test: &str, defect: &str) -> String {
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--test-threads", "1"])
        .env("HEADROOM_TEST_DEFECT", defect)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(!output.status.success() && stdout.contains("1 failed"), "with the defect the check still passed: {stdout}");
    stdout
}

/// The negative control of `test`: runs it with `defect` switched on ([`failing_with_defect`])
/// and asserts that it fails saying `says`. Does nothing inside another control's child run.
#[doc(hidden)]
pub fn assert_control_fails(test: &str, defect: &str, says: &str) {
    if std::env::var_os("HEADROOM_TEST_DEFECT").is_some() {
        return;
    }
    let stdout = failing_with_defect(test, defect);
    assert!(stdout.contains(says), "with the defect {defect}, {test} failed otherwise: {stdout}");
}
